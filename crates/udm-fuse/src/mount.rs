//! The system side of a FUSE export: /dev/fuse descriptors, mount and unmount, aborting a
//! connection, finding and clearing mounts whose server died, and the process flag a daemon
//! backing filesystems needs.

use std::ffi::{CStr, CString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use log::{info, warn};

use crate::abi::FUSE_DEV_IOC_CLONE;
use crate::error::FuseError;

/// Where the kernel's FUSE control filesystem lives (systemd mounts it at boot; not every
/// container does).
const FUSECTL: &str = "/sys/fs/fuse/connections";

/// The filesystem type udm's mounts show in /proc/self/mountinfo, which tells them apart from
/// other FUSE filesystems.
const FS_TYPE: &CStr = c"fuse.udm";

/// How long a probe of a mountpoint may take before its server counts as hung.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// A crash loop can leave several dead mounts stacked on one path; more than this is not a
/// crash loop but something else mounting there.
const MAX_STACKED: usize = 16;

fn cpath(path: &Path) -> Result<CString, FuseError> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| FuseError::Config(format!("{} contains a NUL byte", path.display())))
}

pub(crate) fn open_fuse_device() -> Result<OwnedFd, FuseError> {
    // SAFETY: open with a static NUL-terminated path.
    let fd = unsafe { libc::open(c"/dev/fuse".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(FuseError::last_os("open /dev/fuse"));
    }
    // SAFETY: fd was just opened and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A second descriptor on the connection of `fd`, with a processing queue of its own, so
/// workers on different descriptors do not contend for one queue lock in the kernel.
pub(crate) fn clone_device(fd: &OwnedFd) -> Result<OwnedFd, FuseError> {
    let clone = open_fuse_device()?;
    let source = fd.as_raw_fd() as u32;
    // SAFETY: the ioctl reads one u32 through the pointer.
    if unsafe { libc::ioctl(clone.as_raw_fd(), FUSE_DEV_IOC_CLONE, &source) } != 0 {
        return Err(FuseError::last_os("FUSE_DEV_IOC_CLONE"));
    }
    Ok(clone)
}

pub(crate) fn mount_fuse(mountpoint: &Path, fd: &OwnedFd) -> Result<(), FuseError> {
    let target = cpath(mountpoint)?;
    // SAFETY: plain getters.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    // allow_other: the files are for whoever may use block devices (loop setup, mkfs), not only
    // the daemon's user; default_permissions: the kernel checks the file modes, so udm need
    // not answer ACCESS for every lookup.
    let options = CString::new(format!(
        "fd={},rootmode=40000,user_id={uid},group_id={gid},allow_other,default_permissions",
        fd.as_raw_fd()
    ))
    .expect("mount options have no NUL");
    // SAFETY: all pointers are NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            c"udm".as_ptr(),
            target.as_ptr(),
            FS_TYPE.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            options.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(FuseError::last_os(format!(
            "mount fuse on {}",
            mountpoint.display()
        )));
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unmounted {
    /// Gone at once; the kernel aborted the connection.
    Clean,
    /// Still in use (a loop device, an open file): detached from the tree, alive until its
    /// last user lets go.
    Detached,
    /// Someone else unmounted it already.
    NotMounted,
}

pub(crate) fn unmount(mountpoint: &Path) -> Result<Unmounted, FuseError> {
    let target = cpath(mountpoint)?;
    // SAFETY: a NUL-terminated path. NOFOLLOW: never unmount what a symlink points to.
    if unsafe { libc::umount2(target.as_ptr(), libc::UMOUNT_NOFOLLOW) } == 0 {
        return Ok(Unmounted::Clean);
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EBUSY) => {
            // SAFETY: as above.
            let flags = libc::UMOUNT_NOFOLLOW | libc::MNT_DETACH;
            if unsafe { libc::umount2(target.as_ptr(), flags) } == 0 {
                Ok(Unmounted::Detached)
            } else {
                Err(FuseError::last_os(format!(
                    "umount -l {}",
                    mountpoint.display()
                )))
            }
        }
        Some(libc::EINVAL) | Some(libc::ENOENT) => Ok(Unmounted::NotMounted),
        _ => Err(FuseError::io(
            format!("umount {}", mountpoint.display()),
            err,
        )),
    }
}

/// The name of a connection in the FUSE control filesystem: the kernel's `dev_t` of its
/// superblock, which user space sees (re-encoded) as `st_dev`.
pub(crate) fn connection_id(st_dev: u64) -> u64 {
    (u64::from(libc::major(st_dev)) << 20) | u64::from(libc::minor(st_dev))
}

/// A mount namespace other than ours where the mount is still listed, and the processes in it
/// (a few of them: what an admin needs to find the container or service).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Holder {
    /// As /proc/PID/ns/mnt names it: `mnt:[4026532841]`.
    pub namespace: String,
    /// (pid, command name)
    pub processes: Vec<(u32, String)>,
}

/// Processes shown per namespace; a container has many, one or two name it.
const PROCESSES_SHOWN: usize = 3;

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "{} (", self.namespace)?;
        for (i, (pid, comm)) in self.processes.iter().take(PROCESSES_SHOWN).enumerate() {
            let comma = if i > 0 { ", " } else { "" };
            write!(f, "{comma}pid {pid} {comm}")?;
        }
        match self.processes.len().saturating_sub(PROCESSES_SHOWN) {
            0 => write!(f, ")"),
            more => write!(f, " and {more} more)"),
        }
    }
}

/// The other mount namespaces whose mountinfo lists the mount of device `st_dev`, found
/// through /proc (processes we may not inspect are skipped). A namespace no process is in
/// (kept by a bind mount of its ns file) cannot be found this way.
pub(crate) fn holders(st_dev: u64) -> Vec<Holder> {
    let device = format!("{}:{}", libc::major(st_dev), libc::minor(st_dev));
    let ours = std::fs::read_link("/proc/self/ns/mnt").ok();
    let Ok(proc) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = proc
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();
    // Whether each namespace lists the mount: its mountinfo is read once, for its first pid.
    let mut listed: std::collections::HashMap<PathBuf, bool> = Default::default();
    let mut holders: Vec<Holder> = Vec::new();
    for pid in pids {
        let Ok(namespace) = std::fs::read_link(format!("/proc/{pid}/ns/mnt")) else {
            continue;
        };
        if Some(&namespace) == ours.as_ref() {
            continue;
        }
        let lists_it = *listed.entry(namespace.clone()).or_insert_with(|| {
            std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
                .is_ok_and(|text| lists_device(&text, &device))
        });
        if !lists_it {
            continue;
        }
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        let namespace = namespace.display().to_string();
        let process = (pid, comm.trim_end().to_string());
        match holders.iter_mut().find(|h| h.namespace == namespace) {
            Some(holder) => holder.processes.push(process),
            None => holders.push(Holder {
                namespace,
                processes: vec![process],
            }),
        }
    }
    holders
}

/// Whether a mountinfo text has a mount of device `major:minor` (its third field).
fn lists_device(mountinfo: &str, device: &str) -> bool {
    mountinfo
        .lines()
        .any(|line| line.split(' ').nth(2) == Some(device))
}

/// Fails every request of a connection, pending and future, and wakes the server's readers
/// with ENODEV: the only way to end a mount that was detached while still in use.
pub(crate) fn abort_connection(connection: u64) -> Result<(), FuseError> {
    let dir = Path::new(FUSECTL).join(connection.to_string());
    if !dir.exists() {
        mount_fusectl()?;
    }
    std::fs::write(dir.join("abort"), "1")
        .map_err(|e| FuseError::io(format!("abort {}", dir.display()), e))
}

fn mount_fusectl() -> Result<(), FuseError> {
    let target = cpath(Path::new(FUSECTL))?;
    // SAFETY: NUL-terminated strings, no data.
    let rc = unsafe {
        libc::mount(
            c"fusectl".as_ptr(),
            target.as_ptr(),
            c"fusectl".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc == 0 {
        info!("fuse: mounted the FUSE control filesystem on {FUSECTL}");
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    // Mounted meanwhile by someone else: fine.
    if err.raw_os_error() == Some(libc::EBUSY) {
        return Ok(());
    }
    Err(FuseError::io(format!("mount fusectl on {FUSECTL}"), err))
}

/// What is at a mountpoint, as far as a new mount there is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Probe {
    Missing,
    /// A FUSE mount whose server is gone: every access fails with ENOTCONN.
    Stale,
    /// A FUSE mount whose server answers.
    Live,
    /// Anything else: a plain directory, another filesystem.
    Other,
}

/// The absolute path as /proc/self/mountinfo spells it, found without touching the last
/// component (which may be a dead mount that fails every stat).
pub(crate) fn resolve(mountpoint: &Path) -> Result<PathBuf, FuseError> {
    let absolute = std::path::absolute(mountpoint)
        .map_err(|e| FuseError::io(format!("resolve {}", mountpoint.display()), e))?;
    Ok(match (absolute.parent(), absolute.file_name()) {
        (Some(parent), Some(name)) => match parent.canonicalize() {
            Ok(parent) => parent.join(name),
            Err(_) => absolute,
        },
        _ => absolute,
    })
}

pub(crate) fn probe(path: &Path) -> Result<Probe, FuseError> {
    let listed = fuse_listed_at(path)?;
    match statfs_within(path, PROBE_TIMEOUT)? {
        Ok(f_type) if listed && f_type == libc::FUSE_SUPER_MAGIC => Ok(Probe::Live),
        Ok(_) => Ok(Probe::Other),
        Err(e) => match e.raw_os_error() {
            // ECONNABORTED and ECANCELED: a request caught in the kernel's teardown of a
            // connection (an io_uring one's goes on after its server process is gone).
            Some(libc::ENOTCONN | libc::ECONNABORTED | libc::ECANCELED) => Ok(Probe::Stale),
            Some(libc::ENOENT) => Ok(Probe::Missing),
            _ => Err(FuseError::io(format!("statfs {}", path.display()), e)),
        },
    }
}

/// statfs always asks the server (stat may answer from cached attributes), so it tells a dead
/// server from a live one. A live but hung server would block it forever; the probe runs on a
/// thread of its own and is abandoned after `limit` (the thread stays blocked until the server
/// answers or dies).
fn statfs_within(
    path: &Path,
    limit: Duration,
) -> Result<std::io::Result<libc::__fsword_t>, FuseError> {
    let target = cpath(path)?;
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("fuse-probe".into())
        .spawn(move || {
            // SAFETY: statfs fills the zeroed struct; the path is NUL-terminated.
            let mut st: libc::statfs = unsafe { std::mem::zeroed() };
            let result = if unsafe { libc::statfs(target.as_ptr(), &mut st) } == 0 {
                Ok(st.f_type)
            } else {
                Err(std::io::Error::last_os_error())
            };
            let _ = tx.send(result);
        })
        .map_err(|e| FuseError::io("spawn a mount probe", e))?;
    rx.recv_timeout(limit)
        .map_err(|_| FuseError::Unresponsive(path.to_path_buf()))
}

/// Whether the top-most mount at `path` in /proc/self/mountinfo is a FUSE filesystem.
fn fuse_listed_at(path: &Path) -> Result<bool, FuseError> {
    Ok(mount_type_at(path)?.is_some_and(|t| t == "fuse" || t.starts_with("fuse.")))
}

/// Whether `path` is where a udm daemon mounted (or had mounted, if it died) its FUSE export:
/// files there are udm devices.
pub fn is_udm_mount(path: &Path) -> Result<bool, FuseError> {
    Ok(mount_type_at(path)?.is_some_and(|t| t.as_bytes() == FS_TYPE.to_bytes()))
}

/// The filesystem type of the top-most mount at `path`, if `path` is a mountpoint.
fn mount_type_at(path: &Path) -> Result<Option<String>, FuseError> {
    let text = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| FuseError::io("read /proc/self/mountinfo", e))?;
    Ok(top_mount_type(&text, path.as_os_str().as_bytes()).map(str::to_string))
}

fn top_mount_type<'a>(mountinfo: &'a str, path: &[u8]) -> Option<&'a str> {
    let mut top = None;
    for line in mountinfo.lines() {
        // "ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL…] - FSTYPE SOURCE SUPEROPTS"
        let Some((mount, fs)) = line.split_once(" - ") else {
            continue;
        };
        if mount.split(' ').nth(4).map(unescape).as_deref() != Some(path) {
            continue;
        }
        // Later lines are mounted later: the last match is on top.
        top = fs.split(' ').next();
    }
    top
}

/// mountinfo writes space, tab, newline and backslash as `\NNN` octal escapes.
fn unescape(field: &str) -> Vec<u8> {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).and_then(|d| {
            let d = std::str::from_utf8(d).ok()?;
            u8::from_str_radix(d, 8).ok()
        });
        match (bytes[i], octal) {
            (b'\\', Some(byte)) => {
                out.push(byte);
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    out
}

/// Lazily unmounts a dead FUSE mount at `mountpoint` (one left by a daemon that crashed or was
/// killed), so a new daemon can mount there. Returns whether there was one. Several dead
/// mounts stacked by a crash loop are all removed. A live FUSE mount is left alone.
pub fn recover_stale_mount(mountpoint: &Path) -> Result<bool, FuseError> {
    let path = resolve(mountpoint)?;
    let mut recovered = false;
    for _ in 0..MAX_STACKED {
        if probe(&path)? != Probe::Stale {
            break;
        }
        let target = cpath(&path)?;
        // SAFETY: a NUL-terminated path. Lazy: a dead mount may still have users (a loop
        // device whose I/O now fails); they keep it until they let go, but the path is free.
        let flags = libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW;
        if unsafe { libc::umount2(target.as_ptr(), flags) } != 0 {
            return Err(FuseError::last_os(format!("umount -l {}", path.display())));
        }
        warn!(
            "fuse: removed a dead FUSE mount on {} (its server is gone)",
            path.display()
        );
        recovered = true;
    }
    Ok(recovered)
}

/// Puts the process in the IO_FLUSHER state (PR_SET_IO_FLUSHER): memory it allocates while
/// serving I/O is not reclaimed by writing back to filesystems, which could be the ones it
/// backs (a filesystem on a loop device on a FUSE file) and would deadlock.
///
/// The flag belongs to the calling thread and is inherited by threads it creates afterwards:
/// call it early, before the device registry and the FUSE export start their threads. It needs
/// CAP_SYS_RESOURCE (containers often drop it even for root); without it this only warns.
pub fn set_io_flusher() {
    // Not in the libc crate for Linux yet; value from <linux/prctl.h>.
    const PR_SET_IO_FLUSHER: libc::c_int = 57;
    // SAFETY: prctl with integer arguments only.
    let rc = unsafe {
        libc::prctl(
            PR_SET_IO_FLUSHER,
            1 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    if rc != 0 {
        warn!(
            "fuse: cannot set PR_SET_IO_FLUSHER ({}): memory pressure while a filesystem on a \
             udm file is busy could deadlock",
            std::io::Error::last_os_error()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 1 0:21 / /sys rw,nosuid - sysfs sysfs rw
40 22 0:40 / /tmp/my\\040dir rw,nosuid,nodev shared:5 - fuse.udm udm rw,user_id=0
41 22 0:41 / /tmp/stacked rw - fuse.udm udm rw
42 41 0:42 / /tmp/stacked rw - tmpfs tmpfs rw
43 22 0:43 / /tmp/plain rw - fuse sshfs rw
";

    #[test]
    fn mountinfo_paths_are_unescaped_and_the_top_mount_counts() {
        let at = |path: &[u8]| top_mount_type(MOUNTINFO, path);
        assert_eq!(at(b"/tmp/my dir"), Some("fuse.udm"));
        assert_eq!(at(b"/tmp/my\\040dir"), None);
        assert_eq!(at(b"/tmp/stacked"), Some("tmpfs"));
        assert_eq!(at(b"/tmp/plain"), Some("fuse"));
        assert_eq!(at(b"/sys"), Some("sysfs"));
        assert_eq!(at(b"/tmp"), None);
    }

    #[test]
    fn unescape_leaves_lone_backslashes() {
        assert_eq!(unescape("a\\134b\\"), b"a\\b\\");
        assert_eq!(unescape("x\\01"), b"x\\01");
    }

    #[test]
    fn mounts_are_found_by_device_number() {
        assert!(lists_device(MOUNTINFO, "0:41"));
        assert!(!lists_device(MOUNTINFO, "0:4"));
        let holder = Holder {
            namespace: "mnt:[4026532841]".into(),
            processes: (1..=5).map(|pid| (pid, "sleep".to_string())).collect(),
        };
        assert_eq!(
            holder.to_string(),
            "mnt:[4026532841] (pid 1 sleep, pid 2 sleep, pid 3 sleep and 2 more)"
        );
    }

    #[test]
    fn connection_ids_are_kernel_dev_numbers() {
        assert_eq!(connection_id(libc::makedev(0, 45)), 45);
        assert_eq!(connection_id(libc::makedev(0, 300)), 300);
        assert_eq!(connection_id(libc::makedev(8, 1)), (8 << 20) | 1);
    }
}
