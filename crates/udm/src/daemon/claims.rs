//! Who may write what: a target that keeps state on a device (a clone's metadata and
//! destination, a log-writes log) claims it exclusively, so that no other device's table and
//! no other udm process writes under it. Plain remapping targets (linear, striped…) share
//! what they open read-write, as dm allows, but never with an exclusive holder; read-only
//! opens (a clone's source) are not claims at all.
//!
//! Within the daemon a claim is held by a device name: the live and the inactive table of one
//! device share its claims, which is what a reload needs. Across processes, files are locked
//! with open-file-description (OFD) locks — a write lock for an exclusive claim, a read lock
//! for a shared one — on one byte far past any data ([`LOCK_BYTE`]), so udm processes exclude
//! each other without conflicting with the byte-range locks qemu takes on the same images.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use udm_block::{
    BlockDevice, Capabilities, Extent, MapOp, Mapping, OpenMode, Result as IoResult, WriteFlags,
    ZeroFlags,
};

use super::loopback::{loop_backing, LoopBacking};

/// The byte udm locks in files it opens read-write: 2^63 − 2^16, beyond any real file's end.
pub const LOCK_BYTE: i64 = i64::MAX - 0xffff;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    /// A file or block device, by (st_dev, st_ino).
    File(u64, u64),
    /// Another udm device, by name.
    Device(String),
}

struct Holder {
    /// Which guard holds this claim (owners may hold several, and may be renamed).
    id: u64,
    owner: String,
    exclusive: bool,
    /// [`OpenMode::Handover`]: shared with other devices' handover claims.
    handover: bool,
}

struct Entry {
    holders: Vec<Holder>,
    /// The descriptor carrying the OFD lock of a file key.
    lock: Option<File>,
    lock_exclusive: bool,
}

#[derive(Default)]
pub struct Claims {
    entries: Mutex<HashMap<Key, Entry>>,
    next_id: std::sync::atomic::AtomicU64,
}

/// Keeps a claim until dropped (with the device handle it was taken for).
pub struct ClaimGuard {
    claims: Arc<Claims>,
    key: Key,
    id: u64,
}

impl Claims {
    /// Claims the file at `path` for device `owner` as `mode` says (read-write shared, or
    /// exclusive when the owner keeps state on it, or for a state handed over between
    /// devices).
    /// Refuses, in one line, when another device or another process holds it in a way that
    /// conflicts.
    pub fn claim_file(
        self: &Arc<Self>,
        path: &Path,
        owner: &str,
        mode: OpenMode,
    ) -> Result<ClaimGuard, String> {
        let path = &underlying_file(path)?;
        let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
        self.claim(Key::File(meta.dev(), meta.ino()), owner, mode, Some(path))
    }

    /// Device `old` is now called `new`: its claims go with it.
    pub fn rename_owner(&self, old: &str, new: &str) {
        let mut entries = self.entries.lock();
        for entry in entries.values_mut() {
            for holder in entry.holders.iter_mut().filter(|h| h.owner == old) {
                holder.owner = new.to_string();
            }
        }
        if let Some(entry) = entries.remove(&Key::Device(old.into())) {
            entries.insert(Key::Device(new.into()), entry);
        }
    }

    /// Claims the udm device `name` for device `owner`.
    pub fn claim_device(
        self: &Arc<Self>,
        name: &str,
        owner: &str,
        mode: OpenMode,
    ) -> Result<ClaimGuard, String> {
        self.claim(Key::Device(name.into()), owner, mode, None)
    }

    fn claim(
        self: &Arc<Self>,
        key: Key,
        owner: &str,
        mode: OpenMode,
        path: Option<&Path>,
    ) -> Result<ClaimGuard, String> {
        let exclusive = mode.is_exclusive();
        let handover = mode == OpenMode::Handover;
        let mut entries = self.entries.lock();
        let entry = entries.entry(key.clone()).or_insert_with(|| Entry {
            holders: Vec::new(),
            lock: None,
            lock_exclusive: false,
        });
        let conflict = entry
            .holders
            .iter()
            .find(|h| h.owner != owner && (exclusive || h.exclusive) && !(handover && h.handover));
        let result = match conflict {
            Some(h) if h.exclusive => Err(format!(
                "in use by device '{}', which keeps its state there",
                h.owner
            )),
            Some(h) => Err(format!(
                "in use by device '{}'; a target that keeps its state on a device needs it \
                 for itself",
                h.owner
            )),
            None => match path {
                Some(path) => lock_file(entry, path, exclusive),
                None => Ok(()),
            },
        };
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match result {
            Ok(()) => entry.holders.push(Holder {
                id,
                owner: owner.into(),
                exclusive,
                handover,
            }),
            Err(e) => {
                if entry.holders.is_empty() {
                    entries.remove(&key);
                }
                return Err(e);
            }
        }
        Ok(ClaimGuard {
            claims: self.clone(),
            key,
            id,
        })
    }
}

/// The file whose claims `path` shares: a loop device's backing file (a loop device and its
/// file are one place to write, and a `linear` over a loop device on a live clone's
/// destination wrote under the clone), anything else itself. The lock goes on the backing
/// file too, where another process claiming the file looks.
fn underlying_file(path: &Path) -> Result<PathBuf, String> {
    let backing = loop_backing(path).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(match backing {
        LoopBacking::File(file) if file.exists() => file,
        // A loop device whose file was removed (or that has none) is all there is of it.
        LoopBacking::File(_) | LoopBacking::Detached | LoopBacking::NotALoopDevice => {
            path.to_path_buf()
        }
    })
}

/// Takes (or strengthens) the entry's OFD lock on `path`.
fn lock_file(entry: &mut Entry, path: &Path, exclusive: bool) -> Result<(), String> {
    if entry.lock.is_some() && (entry.lock_exclusive || !exclusive) {
        return Ok(());
    }
    if entry.lock.is_none() {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        entry.lock = Some(file);
    }
    let file = entry.lock.as_ref().expect("opened above");
    set_lock(
        file,
        if exclusive {
            libc::F_WRLCK
        } else {
            libc::F_RDLCK
        },
    )
    .map_err(|e| {
        if e.raw_os_error() == Some(libc::EAGAIN) || e.raw_os_error() == Some(libc::EACCES) {
            format!(
                "{} is in use by another process (another udm daemon holds it{})",
                path.display(),
                if exclusive { "" } else { " exclusively" }
            )
        } else {
            format!("locking {}: {e}", path.display())
        }
    })?;
    entry.lock_exclusive = exclusive;
    Ok(())
}

fn set_lock(file: &File, kind: libc::c_int) -> std::io::Result<()> {
    // SAFETY: a zeroed flock is a valid argument; every field we rely on is set below.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = LOCK_BYTE;
    lock.l_len = 1;
    // SAFETY: fcntl with a valid descriptor and a pointer to a live flock.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &mut lock) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl Drop for ClaimGuard {
    fn drop(&mut self) {
        let mut entries = self.claims.entries.lock();
        let Some(entry) = entries.get_mut(&self.key) else {
            return;
        };
        entry.holders.retain(|h| h.id != self.id);
        if entry.holders.is_empty() {
            // Closing the descriptor drops the lock.
            entries.remove(&self.key);
        } else if entry.lock_exclusive && !entry.holders.iter().any(|h| h.exclusive) {
            if let Some(file) = &entry.lock {
                if set_lock(file, libc::F_RDLCK).is_ok() {
                    entry.lock_exclusive = false;
                }
            }
        }
    }
}

/// A device handle that carries the claim it was opened under.
pub struct Claimed {
    device: Arc<dyn BlockDevice>,
    _claim: ClaimGuard,
}

impl Claimed {
    pub fn new(device: Arc<dyn BlockDevice>, claim: ClaimGuard) -> Self {
        Claimed {
            device,
            _claim: claim,
        }
    }
}

impl BlockDevice for Claimed {
    fn size(&self) -> u64 {
        self.device.size()
    }
    fn capabilities(&self) -> Capabilities {
        self.device.capabilities()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> IoResult<()> {
        self.device.read(offset, buf)
    }
    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> IoResult<()> {
        self.device.write(offset, buf, flags)
    }
    fn flush(&self) -> IoResult<()> {
        self.device.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> IoResult<()> {
        self.device.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> IoResult<()> {
        self.device.write_zeroes(offset, len, flags)
    }
    fn block_status(&self, offset: u64, len: u64) -> IoResult<Vec<Extent>> {
        self.device.block_status(offset, len)
    }
    fn cache(&self, offset: u64, len: u64) -> IoResult<()> {
        self.device.cache(offset, len)
    }
    fn map(&self, op: MapOp, offset: u64, len: u64) -> Option<Mapping> {
        self.device.map(op, offset, len)
    }
    fn identity(&self) -> Option<String> {
        self.device.identity()
    }
    fn suspended(&self) -> bool {
        self.device.suspended()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Claims on a scratch file of one test's own (removed when the test ends).
    struct Scratch {
        claims: Arc<Claims>,
        path: std::path::PathBuf,
    }

    impl Scratch {
        fn new(tag: &str) -> Scratch {
            let path =
                std::env::temp_dir().join(format!("udm-claims-{tag}-{}", std::process::id()));
            std::fs::write(&path, [0u8; 4096]).unwrap();
            Scratch {
                claims: Arc::new(Claims::default()),
                path,
            }
        }

        /// A claim on the file by `owner` that must be granted.
        fn grant(&self, owner: &str, mode: OpenMode) -> ClaimGuard {
            self.claims.claim_file(&self.path, owner, mode).unwrap()
        }

        /// Fails the test unless a claim on the file by `owner` is refused saying `why`.
        fn refuse(&self, owner: &str, mode: OpenMode, why: &str) {
            refused_with(self.claims.claim_file(&self.path, owner, mode), why);
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    /// Fails the test unless `claim` was refused with a reason that contains `why`.
    fn refused_with(claim: Result<ClaimGuard, String>, why: &str) {
        match claim {
            Ok(_) => panic!("granted; expected a refusal saying '{why}'"),
            Err(err) => assert!(err.contains(why), "{err}"),
        }
    }

    #[test]
    fn exclusive_claims_exclude_other_devices_but_not_the_owner() {
        let file = Scratch::new("excl");
        let live = file.grant("vol", OpenMode::Exclusive);
        // The same device's next table (a reload) shares it.
        let reload = file.grant("vol", OpenMode::Exclusive);
        file.refuse("other", OpenMode::Exclusive, "in use by device 'vol'");
        file.refuse("other", OpenMode::ReadWrite, "in use by device 'vol'");
        drop((live, reload));
        file.grant("other", OpenMode::Exclusive);
    }

    #[test]
    fn shared_claims_coexist_and_block_an_exclusive_one() {
        let claims = Arc::new(Claims::default());
        let a = claims
            .claim_device("base", "a", OpenMode::ReadWrite)
            .unwrap();
        let _b = claims
            .claim_device("base", "b", OpenMode::ReadWrite)
            .unwrap();
        refused_with(
            claims.claim_device("base", "c", OpenMode::Exclusive),
            "needs it for itself",
        );
        drop(a);
        assert!(claims
            .claim_device("base", "c", OpenMode::Exclusive)
            .is_err());
    }

    #[test]
    fn a_renamed_owner_keeps_its_claims_and_releases_them_under_its_new_name() {
        let file = Scratch::new("rename");
        let live = file.grant("old", OpenMode::Exclusive);
        file.claims.rename_owner("old", "new");
        // Its next table, built under the new name, shares the claim...
        let reload = file.grant("new", OpenMode::Exclusive);
        // ...and nobody else gets it, the old name included.
        file.refuse("old", OpenMode::Exclusive, "in use by device 'new'");
        drop((live, reload));
        file.grant("other", OpenMode::Exclusive);
    }

    #[test]
    fn handover_claims_are_shared_between_devices_and_exclusive_towards_the_rest() {
        let file = Scratch::new("handover");
        let snap = file.grant("snap", OpenMode::Handover);
        let merge = file.grant("base", OpenMode::Handover);
        for mode in [OpenMode::Exclusive, OpenMode::ReadWrite] {
            file.refuse("other", mode, "in use by device");
        }
        drop((snap, merge));
        let _clone = file.grant("clone", OpenMode::Exclusive);
        file.refuse("base", OpenMode::Handover, "in use by device 'clone'");
    }

    /// A loop device on the file, detached on drop.
    struct LoopDevice(PathBuf);

    impl LoopDevice {
        fn on(file: &Path) -> LoopDevice {
            let out = std::process::Command::new("losetup")
                .args(["-f", "--show"])
                .arg(file)
                .output()
                .expect("losetup");
            assert!(out.status.success(), "losetup: {out:?}");
            LoopDevice(String::from_utf8(out.stdout).unwrap().trim().into())
        }
    }

    impl Drop for LoopDevice {
        fn drop(&mut self) {
            let _ = std::process::Command::new("losetup")
                .arg("-d")
                .arg(&self.0)
                .status();
        }
    }

    /// A `linear` over a loop device on a live clone's destination was granted: the claims
    /// keyed the loop device by its own inode, not the file it writes.
    #[test]
    fn a_loop_device_shares_the_claims_of_its_backing_file() {
        let file = Scratch::new("loop");
        let device = LoopDevice::on(&file.path);
        let _clone = file.grant("clone", OpenMode::Exclusive);
        refused_with(
            file.claims
                .claim_file(&device.0, "linear", OpenMode::ReadWrite),
            "in use by device 'clone'",
        );
        // And the other way round: the loop device claimed first keeps the file.
        let other = Scratch::new("loop-first");
        let device = LoopDevice::on(&other.path);
        let _clone = other
            .claims
            .claim_file(&device.0, "clone", OpenMode::Exclusive)
            .unwrap();
        other.refuse("linear", OpenMode::ReadWrite, "in use by device 'clone'");
    }

    #[test]
    fn another_process_sees_the_lock() {
        let file = Scratch::new("ofd");
        let _held = file.grant("vol", OpenMode::Exclusive);
        // Another open file description stands for another process: OFD locks conflict
        // between descriptions, whoever owns them.
        let other = File::options()
            .read(true)
            .write(true)
            .open(&file.path)
            .unwrap();
        let err = set_lock(&other, libc::F_RDLCK).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EAGAIN));
    }
}
