//! Paths that lead back into udm: a device's file in the daemon's own FUSE mount, or a loop
//! device whose backing file is one. A table that reads through one of them uses that udm
//! device as surely as if it named it, and must pass the same cycle check: a device whose
//! table reads `/dev/loop0`, where loop0 is on its own FUSE file, sends every read around
//! loop → FUSE → udm → loop until the FUSE queues fill, and then the mount hangs for good.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// What a path is bound to as a loop device.
#[derive(Debug, PartialEq, Eq)]
pub enum LoopBacking {
    NotALoopDevice,
    /// A loop device with no file attached.
    Detached,
    /// The file, as the kernel shows it (a removed file without its " (deleted)" mark).
    File(PathBuf),
}

/// The file the loop device `path` is bound to, from sysfs.
pub fn loop_backing(path: &Path) -> std::io::Result<LoopBacking> {
    let meta = std::fs::metadata(path)?;
    let rdev = meta.rdev();
    let sysfs = PathBuf::from(format!(
        "/sys/dev/block/{}:{}/loop",
        libc::major(rdev),
        libc::minor(rdev)
    ));
    if !meta.file_type().is_block_device() || !sysfs.is_dir() {
        return Ok(LoopBacking::NotALoopDevice);
    }
    let text = match std::fs::read_to_string(sysfs.join("backing_file")) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(LoopBacking::Detached),
        Err(e) => return Err(e),
    };
    let text = text.trim_end_matches('\n');
    Ok(LoopBacking::File(PathBuf::from(
        text.strip_suffix(" (deleted)").unwrap_or(text),
    )))
}

/// Where the daemon's FUSE export is mounted, made absolute and free of symlinks.
#[derive(Debug, Default)]
pub struct FuseMount(std::sync::OnceLock<PathBuf>);

impl FuseMount {
    pub fn set(&self, dir: &Path) {
        let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
        let _ = self.0.set(dir);
    }

    /// The udm device that `path` reads, if it leads back into the FUSE mount.
    pub fn device_behind(&self, path: &Path) -> Option<String> {
        let mount = self.0.get()?;
        if let Some(name) = device_file_name(mount, path) {
            return Some(name);
        }
        // Only now touch the path: stat and canonicalize outside the mount are harmless.
        match loop_backing(path).ok()? {
            LoopBacking::File(backing) => device_file_name(mount, &backing),
            LoopBacking::Detached => None,
            LoopBacking::NotALoopDevice => device_file_name(mount, &path.canonicalize().ok()?),
        }
    }
}

/// `mount/NAME` → NAME.
fn device_file_name(mount: &Path, path: &Path) -> Option<String> {
    let rest = path.strip_prefix(mount).ok()?;
    let mut parts = rest.components();
    match (parts.next(), parts.next()) {
        (Some(std::path::Component::Normal(name)), None) => name.to_str().map(str::to_string),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_in_the_mount_name_their_device_and_nothing_else_does() {
        let mount = FuseMount::default();
        assert_eq!(
            mount.device_behind(Path::new("/srv/fuse/vol")),
            None,
            "no mount yet"
        );
        mount.set(Path::new("/srv/fuse"));
        assert_eq!(
            mount.device_behind(Path::new("/srv/fuse/vol")),
            Some("vol".to_string())
        );
        assert_eq!(mount.device_behind(Path::new("/srv/fuse")), None);
        assert_eq!(mount.device_behind(Path::new("/srv/fuse/a/b")), None);
        assert_eq!(mount.device_behind(Path::new("/srv/fusewhat/vol")), None);
        assert_eq!(mount.device_behind(Path::new("/nonexistent/x")), None);
    }
}
