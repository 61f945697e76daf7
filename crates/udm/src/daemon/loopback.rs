//! References that lead back into this daemon: a device's file in its own FUSE mount, a
//! loop device whose backing file is one, or an NBD URI naming one of its own listeners. A
//! table that reads through one of them uses that udm device as surely as if it named it, and
//! must pass the same cycle check. Found by hand: a device whose table read `/dev/loop0`,
//! where loop0 was on its own FUSE file, sent every read around loop → FUSE → udm → loop
//! until the FUSE queues filled, and the mount hung for good; one whose table read its own
//! export over NBD held each read until the remote timeout.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use udm_nbd::uri::{NbdAddress, NbdUri};
use udm_targets::Reference;

use super::listener::{Address, Listener};

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

/// Where this daemon can be reached by its own tables.
#[derive(Debug, Default)]
pub struct OwnExports {
    /// The FUSE mount, absolute and free of symlinks.
    fuse: OnceLock<PathBuf>,
    nbd: OnceLock<Vec<Listener>>,
}

impl OwnExports {
    pub fn set_fuse(&self, dir: &Path) {
        let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
        let _ = self.fuse.set(dir);
    }

    pub fn set_nbd(&self, listeners: &[Listener]) {
        let _ = self.nbd.set(listeners.to_vec());
    }

    /// The udm device that a table reference reads, if it leads back into this daemon.
    pub fn device_behind(&self, reference: &str) -> Option<String> {
        match Reference::parse(reference) {
            Reference::Path(path) => self.device_behind_path(Path::new(path)),
            Reference::Remote(uri) => self.device_behind_uri(&uri.parse().ok()?),
            Reference::Device(_) => None,
        }
    }

    fn device_behind_path(&self, path: &Path) -> Option<String> {
        let mount = self.fuse.get()?;
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

    fn device_behind_uri(&self, uri: &NbdUri) -> Option<String> {
        let listener = self
            .nbd
            .get()?
            .iter()
            .find(|l| is_listener(l, &uri.address))?;
        if !uri.export.is_empty() {
            return Some(uri.export.clone());
        }
        // The default export of a listener narrowed to one device is that device.
        match listener.exports.as_deref() {
            Some([only]) => Some(only.clone()),
            _ => None,
        }
    }
}

/// Does `address` reach `listener`? A Unix socket by its file; TCP by port, on a loopback
/// host or the very host the listener binds.
fn is_listener(listener: &Listener, address: &NbdAddress) -> bool {
    match (&listener.address, address) {
        (Address::Unix(ours), NbdAddress::Unix { path }) => {
            let canonical = |p: &Path| p.canonicalize().unwrap_or_else(|_| p.to_path_buf());
            canonical(ours) == canonical(path)
        }
        (Address::Tcp(ours), NbdAddress::Tcp { host, port }) => {
            let Some((bound, our_port)) = ours.rsplit_once(':') else {
                return false;
            };
            let loopback = host == "localhost"
                || host
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback() || ip.is_unspecified());
            our_port.parse() == Ok(*port)
                && (loopback || bound.trim_matches(['[', ']']) == host.as_str())
        }
        _ => false,
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
        let own = OwnExports::default();
        assert_eq!(own.device_behind("/srv/fuse/vol"), None, "no mount yet");
        own.set_fuse(Path::new("/srv/fuse"));
        assert_eq!(own.device_behind("/srv/fuse/vol"), Some("vol".to_string()));
        assert_eq!(own.device_behind("/srv/fuse"), None);
        assert_eq!(own.device_behind("/srv/fuse/a/b"), None);
        assert_eq!(own.device_behind("/srv/fusewhat/vol"), None);
        assert_eq!(own.device_behind("/nonexistent/x"), None);
        assert_eq!(own.device_behind("vol"), None, "names are checked as names");
    }

    #[test]
    fn uris_of_our_own_listeners_name_their_export() {
        let own = OwnExports::default();
        let listeners: Vec<Listener> = [
            "unix:/run/udm/nbd.sock",
            "tcp:10809",
            "tcp:0.0.0.0:10810,export=one",
        ]
        .iter()
        .map(|l| l.parse().unwrap())
        .collect();
        own.set_nbd(&listeners);
        let behind = |uri: &str| own.device_behind(uri);
        assert_eq!(
            behind("nbd+unix:///vol?socket=/run/udm/nbd.sock"),
            Some("vol".into())
        );
        assert_eq!(behind("nbd+unix:///vol?socket=/run/other.sock"), None);
        assert_eq!(behind("nbd://127.0.0.1:10809/vol"), Some("vol".into()));
        assert_eq!(behind("nbd://localhost:10809/vol"), Some("vol".into()));
        assert_eq!(behind("nbd://storage.example:10809/vol"), None);
        assert_eq!(behind("nbd://127.0.0.1:10811/vol"), None);
        assert_eq!(behind("nbd://127.0.0.1:10810"), Some("one".into()));
    }
}
