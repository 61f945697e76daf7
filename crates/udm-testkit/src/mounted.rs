//! Filesystems mounted for a test: unmounted so that a fsck after it sees them really gone.
//!
//! Why this is more than `mount` and `umount`: on a host whose mounts are private (no
//! systemd making `/` shared: containers, this project's CI VMs), every mount namespace made
//! while a filesystem is mounted keeps a copy of its mount, and `umount` then only detaches
//! ours. `ip netns exec` and `ip -n` make such a namespace each time they run (another test's
//! daemon in a [`crate::Netns`] lives in one for the whole test). The filesystem stays alive
//! there, its log not closed, its device still claimed, until that namespace goes; a fsck run
//! after `umount` then finds a filesystem in use (xfs_repair -n: "ALERT: The filesystem has
//! valuable metadata changes in a log which is being ignored"), which reads like lost
//! writes. So the filesystem is mounted on a shared bind mount of its directory: the copies
//! `ip` makes are slaves of it, and the unmount reaches them too. A copy the unmount cannot
//! reach (a namespace made private) is waited for, and named if it stays.

use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::run_ok;

/// How long [`Mounted::unmount`] waits for other mount namespaces to let go.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(30);

/// A filesystem mounted with mount(8) on a directory; lazily unmounted on drop (a test that
/// checks the device afterwards calls [`Mounted::unmount`]).
pub struct Mounted {
    dir: PathBuf,
    device: PathBuf,
}

impl Mounted {
    /// Mounts `device` (its type found by mount(8)) on `at`, made if missing.
    pub fn new(device: &str, at: &Path) -> Mounted {
        std::fs::create_dir_all(at).unwrap();
        mount_syscall(Some(at), at, libc::MS_BIND);
        let mounted = Mounted {
            dir: at.to_path_buf(),
            device: PathBuf::from(device),
        };
        mount_syscall(None, at, libc::MS_SHARED);
        run_ok(Command::new("mount").arg(device).arg(at));
        mounted
    }

    /// Where the filesystem is.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Unmounts the filesystem, and returns once the kernel has let go of it in every mount
    /// namespace (the device is free for an exclusive open), so that what runs next (a fsck)
    /// sees it as its last writes left it.
    pub fn unmount(self) {
        run_ok(Command::new("umount").arg(&self.dir));
        wait_released(&self.device, RELEASE_TIMEOUT);
        run_ok(Command::new("umount").arg(&self.dir));
        std::mem::forget(self);
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        // The filesystem, then the bind mount under it; lazily, as a test that failed may
        // have left something open in it.
        for _ in 0..2 {
            let _ = Command::new("umount")
                .arg("-l")
                .arg(&self.dir)
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
}

fn mount_syscall(source: Option<&Path>, target: &Path, flags: libc::c_ulong) {
    let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    let source = source.map(c);
    let target = c(target);
    let source_ptr = source.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
    // SAFETY: NUL-terminated strings that outlive the call; no filesystem type or data.
    let rc = unsafe {
        libc::mount(
            source_ptr,
            target.as_ptr(),
            std::ptr::null(),
            flags,
            std::ptr::null(),
        )
    };
    assert!(
        rc == 0,
        "mount {source:?} on {target:?} (flags {flags:#x}): {}",
        std::io::Error::last_os_error()
    );
}

/// Waits until no mounted filesystem holds the block device `device` (an exclusive open
/// succeeds), at most `timeout`; then panics naming the processes whose mount namespaces
/// still have it mounted. A device that is not a block device has nothing to wait for.
fn wait_released(device: &Path, timeout: Duration) {
    let Ok(meta) = std::fs::metadata(device) else {
        return;
    };
    if !meta.file_type().is_block_device() {
        return;
    }
    let deadline = Instant::now() + timeout;
    loop {
        let open = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_EXCL)
            .open(device);
        match open {
            Ok(_) => return,
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!(
                "{} is still in use {timeout:?} after its unmount ({e}); mounted in the mount \
                 namespaces of: {}",
                device.display(),
                holders(meta.rdev()).join("; ")
            ),
        }
    }
}

/// The processes whose mount namespaces have a filesystem on device number `rdev` mounted,
/// as "PID COMMAND LINE".
fn holders(rdev: u64) -> Vec<String> {
    let dev = format!(" {}:{} ", libc::major(rdev), libc::minor(rdev));
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .flatten()
        .filter(|p| p.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter(|p| {
            std::fs::read_to_string(p.path().join("mountinfo"))
                .is_ok_and(|info| info.lines().any(|line| line.contains(&dev)))
        })
        .map(|p| {
            let cmdline = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            format!("{} {}", p.file_name().to_string_lossy(), cmdline.trim_end())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TempDir;
    use std::process::{Child, Stdio};

    /// A small ext4 on a loop device, detached on drop.
    struct Disk(String);

    impl Disk {
        fn new(dir: &TempDir) -> Disk {
            let image = dir.path("disk.img");
            std::fs::File::create(&image)
                .unwrap()
                .set_len(16 << 20)
                .unwrap();
            run_ok(Command::new("mkfs.ext4").arg("-q").arg(&image));
            let dev = run_ok(Command::new("losetup").args(["-f", "--show"]).arg(&image));
            Disk(dev.trim().to_string())
        }
    }

    impl Drop for Disk {
        fn drop(&mut self) {
            let _ = Command::new("losetup").args(["-d", &self.0]).status();
        }
    }

    /// A process in a mount namespace of its own, copied from ours with `propagation`
    /// (`slave`, as `ip netns exec` and `ip -n` make it, or `private`); killed on drop.
    struct Namespace(Child);

    impl Namespace {
        fn copy_with(propagation: &str) -> Namespace {
            let child = Command::new("unshare")
                .args(["--mount", "--propagation", propagation, "sleep", "60"])
                .stdin(Stdio::null())
                .spawn()
                .unwrap();
            let ns = Namespace(child);
            // unshare execs sleep once the namespace is made and set up.
            let comm = format!("/proc/{}/comm", ns.0.id());
            let started = Instant::now();
            while std::fs::read_to_string(&comm).unwrap_or_default().trim() != "sleep" {
                assert!(
                    started.elapsed() < Duration::from_secs(10),
                    "unshare did not start"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
            ns
        }
    }

    impl Drop for Namespace {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn device_free(dev: &str) -> bool {
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_EXCL)
            .open(dev)
            .is_ok()
    }

    #[test]
    fn an_unmount_reaches_a_mount_namespace_made_while_mounted() {
        let dir = TempDir::new("mounted-slave");
        let disk = Disk::new(&dir);
        let mounted = Mounted::new(&disk.0, &dir.path("mnt"));
        std::fs::write(mounted.path().join("file"), b"data").unwrap();
        let other = Namespace::copy_with("slave");
        let started = Instant::now();
        mounted.unmount();
        // Gone at once, while the other namespace lives on: not waited out.
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(device_free(&disk.0));
        drop(other);
    }

    #[test]
    fn a_copy_the_unmount_cannot_reach_is_waited_for_and_named() {
        let dir = TempDir::new("mounted-private");
        let disk = Disk::new(&dir);
        let mounted = Mounted::new(&disk.0, &dir.path("mnt"));
        let other = Namespace::copy_with("private");
        run_ok(Command::new("umount").arg(mounted.path()));
        let held = std::panic::catch_unwind(|| {
            wait_released(Path::new(&disk.0), Duration::from_millis(300))
        })
        .unwrap_err();
        let message = held.downcast_ref::<String>().unwrap();
        assert!(
            message.contains(&format!("{} sleep 60", other.0.id())),
            "{message}"
        );
        drop(other);
        wait_released(Path::new(&disk.0), Duration::from_secs(10));
        drop(mounted);
    }
}
