//! The filesystem the export shows: one flat directory with a regular file per device of the
//! catalog, and the tables that tie the kernel's inode numbers and file handles to devices.

use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use udm_block::{BlockDevice, Checked, Export, ExportCatalog};

use crate::abi::{Attr, ROOT_ID};

/// A device opened through the export: what READ and WRITE on its handle use.
pub(crate) struct OpenDevice {
    pub device: Checked<Arc<dyn BlockDevice>>,
    /// Held (with its open guard) until RELEASE, so the registry counts the file as an open of
    /// the device and will not remove it from under a loop device.
    _export: Export,
}

/// One entry of a directory listing taken at OPENDIR.
pub(crate) struct DirEntry {
    pub ino: u64,
    pub name: String,
    pub is_dir: bool,
}

/// Inode numbers by device name. A name keeps its number for the life of the export (a device
/// removed and created again comes back under the same number), and numbers are never reused
/// for another name, so the kernel's FORGET needs no bookkeeping.
#[derive(Default)]
struct Inodes {
    by_name: HashMap<String, u64>,
    names: HashMap<u64, String>,
}

pub(crate) struct Fs {
    catalog: Arc<dyn ExportCatalog>,
    /// Timestamp of every file: the mount time.
    time: u64,
    inodes: Mutex<Inodes>,
    files: RwLock<HashMap<u64, Arc<OpenDevice>>>,
    dirs: Mutex<HashMap<u64, Arc<[DirEntry]>>>,
    next_fh: AtomicU64,
}

pub(crate) type Errno = i32;

/// A name the kernel may show in a directory: one path component, no longer than NAME_MAX.
fn valid_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && name.len() <= 255 && !name.contains('/')
}

impl Fs {
    pub fn new(catalog: Arc<dyn ExportCatalog>) -> Fs {
        let time = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Fs {
            catalog,
            time,
            inodes: Mutex::new(Inodes::default()),
            files: RwLock::new(HashMap::new()),
            dirs: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
        }
    }

    fn ino_for(&self, name: &str) -> u64 {
        let mut inodes = self.inodes.lock();
        if let Some(&ino) = inodes.by_name.get(name) {
            return ino;
        }
        let ino = ROOT_ID + 1 + inodes.by_name.len() as u64;
        inodes.by_name.insert(name.to_owned(), ino);
        inodes.names.insert(ino, name.to_owned());
        ino
    }

    fn name_of(&self, ino: u64) -> Option<String> {
        self.inodes.lock().names.get(&ino).cloned()
    }

    pub fn root_attr(&self) -> Attr {
        Attr {
            ino: ROOT_ID,
            size: 0,
            mode: libc::S_IFDIR | 0o755,
            nlink: 2,
            time: self.time,
        }
    }

    fn file_attr(&self, ino: u64, device: &Checked<Arc<dyn BlockDevice>>) -> Attr {
        let mode = if device.capabilities().read_only {
            0o400
        } else {
            0o600
        };
        Attr {
            ino,
            size: device.size(),
            mode: libc::S_IFREG | mode,
            nlink: 1,
            time: self.time,
        }
    }

    /// Opens `name` in the catalog, wrapped in the central request checks.
    fn open_export(&self, name: &str) -> Option<(Export, Checked<Arc<dyn BlockDevice>>)> {
        if !valid_name(name) {
            return None;
        }
        let export = self.catalog.open(name)?;
        let device = Checked::new(export.device.clone(), export.read_only);
        Some((export, device))
    }

    /// The attributes of a device file right now. The catalog has no way to describe a device
    /// without opening it, so this takes an open for an instant.
    fn current_attr(&self, name: &str) -> Option<Attr> {
        let (_export, device) = self.open_export(name)?;
        Some(self.file_attr(self.ino_for(name), &device))
    }

    pub fn lookup(&self, parent: u64, name: &[u8]) -> Result<Attr, Errno> {
        if parent != ROOT_ID {
            return Err(libc::ENOTDIR);
        }
        let name = std::str::from_utf8(name).map_err(|_| libc::ENOENT)?;
        self.current_attr(name).ok_or(libc::ENOENT)
    }

    /// Attributes by inode, or through the open handle `fh` when the kernel has one (fstat).
    pub fn getattr(&self, ino: u64, fh: Option<u64>) -> Result<Attr, Errno> {
        if ino == ROOT_ID {
            return Ok(self.root_attr());
        }
        if let Some(open) = fh.and_then(|fh| self.file(fh)) {
            return Ok(self.file_attr(ino, &open.device));
        }
        let name = self.name_of(ino).ok_or(libc::ENOENT)?;
        self.current_attr(&name).ok_or(libc::ENOENT)
    }

    pub fn open(&self, ino: u64, writable: bool) -> Result<u64, Errno> {
        if ino == ROOT_ID {
            return Err(libc::EISDIR);
        }
        let name = self.name_of(ino).ok_or(libc::ENOENT)?;
        let (export, device) = self.open_export(&name).ok_or(libc::ENOENT)?;
        if writable && device.capabilities().read_only {
            return Err(libc::EROFS);
        }
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        let open = OpenDevice {
            device,
            _export: export,
        };
        self.files.write().insert(fh, Arc::new(open));
        Ok(fh)
    }

    pub fn file(&self, fh: u64) -> Option<Arc<OpenDevice>> {
        self.files.read().get(&fh).cloned()
    }

    pub fn release(&self, fh: u64) {
        // The export (and the device's open count) goes when the last request using it ends.
        self.files.write().remove(&fh);
    }

    pub fn opendir(&self, ino: u64) -> Result<u64, Errno> {
        if ino != ROOT_ID {
            return Err(libc::ENOTDIR);
        }
        let mut names: Vec<String> = self
            .catalog
            .list()
            .into_iter()
            .map(|(name, _)| name)
            .filter(|name| valid_name(name))
            .collect();
        names.sort();
        let dots = [(ROOT_ID, "."), (ROOT_ID, "..")]
            .into_iter()
            .map(|(ino, name)| DirEntry {
                ino,
                name: name.into(),
                is_dir: true,
            });
        let devices = names.into_iter().map(|name| DirEntry {
            ino: self.ino_for(&name),
            name,
            is_dir: false,
        });
        let listing: Arc<[DirEntry]> = dots.chain(devices).collect();
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.dirs.lock().insert(fh, listing);
        Ok(fh)
    }

    /// The listing taken when the directory handle was opened: offsets stay meaningful across
    /// the READDIR calls of one listing even while devices come and go.
    pub fn listing(&self, fh: u64) -> Option<Arc<[DirEntry]>> {
        self.dirs.lock().get(&fh).cloned()
    }

    pub fn releasedir(&self, fh: u64) {
        self.dirs.lock().remove(&fh);
    }

    pub fn device_count(&self) -> u64 {
        self.catalog.list().len() as u64
    }
}
