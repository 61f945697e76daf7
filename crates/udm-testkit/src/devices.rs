//! Block devices by name: what a test hands the code under test as its catalog of exports (an
//! NBD server, a FUSE mount) or as the resolver of the names in a table.

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use udm_block::{BlockDevice, Export, ExportCatalog, MemoryDevice, OpenMode};
use udm_targets::{Resolver, TargetError};

/// A device and whether it is exported read-only.
type Entry = (Arc<dyn BlockDevice>, bool);

/// Devices by name, changeable at any time (like the daemon's registry under an export). As a
/// catalog it counts the opens it hands out until their guards are dropped.
#[derive(Default)]
pub struct Devices {
    entries: Mutex<BTreeMap<String, Entry>>,
    opens: Arc<AtomicUsize>,
    opened: AtomicUsize,
}

/// Counts an open of the catalog until dropped.
struct OpenGuard(Arc<AtomicUsize>);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Devices {
    /// In-memory devices of the given sizes.
    pub fn memory(devices: &[(&str, u64)]) -> Devices {
        let all = Devices::default();
        for (name, size) in devices {
            all.add_memory(name, *size);
        }
        all
    }

    /// Adds (or replaces) `name`; `read_only` as exported.
    pub fn add(&self, name: &str, device: Arc<dyn BlockDevice>, read_only: bool) {
        let mut entries = self.entries.lock();
        entries.insert(name.into(), (device, read_only));
    }

    /// Adds a read-write in-memory device of `size` bytes.
    pub fn add_memory(&self, name: &str, size: u64) -> Arc<MemoryDevice> {
        let device = Arc::new(MemoryDevice::new(size));
        self.add(name, device.clone(), false);
        device
    }

    pub fn remove(&self, name: &str) {
        self.entries.lock().remove(name);
    }

    /// The device `name`; panics if there is none.
    pub fn get(&self, name: &str) -> Arc<dyn BlockDevice> {
        self.find(name)
            .unwrap_or_else(|| panic!("no device named '{name}'"))
    }

    /// The device `name`, if there is one.
    pub fn find(&self, name: &str) -> Option<Arc<dyn BlockDevice>> {
        let entries = self.entries.lock();
        entries.get(name).map(|(device, _)| device.clone())
    }

    /// Opens handed out as a catalog and not yet released.
    pub fn open_count(&self) -> usize {
        self.opens.load(Ordering::SeqCst)
    }

    /// Opens handed out as a catalog so far (each NBD connection takes one).
    pub fn opened(&self) -> usize {
        self.opened.load(Ordering::SeqCst)
    }

    /// Waits (up to 10 s, then panics) for every open to be released: a FUSE RELEASE, for
    /// one, arrives after the close that caused it.
    pub fn wait_closed(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.open_count() != 0 {
            assert!(Instant::now() < deadline, "opens never released");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl ExportCatalog for Devices {
    fn open(&self, name: &str) -> Option<Export> {
        let (device, read_only) = self.entries.lock().get(name).cloned()?;
        self.opens.fetch_add(1, Ordering::SeqCst);
        self.opened.fetch_add(1, Ordering::SeqCst);
        Some(Export {
            device,
            read_only,
            description: String::new(),
            open_guard: Box::new(OpenGuard(self.opens.clone())),
        })
    }

    fn list(&self) -> Vec<(String, String)> {
        let entries = self.entries.lock();
        entries.keys().map(|n| (n.clone(), String::new())).collect()
    }
}

/// Every name resolves to its device, whatever the mode (tests check claims elsewhere).
impl Resolver for Devices {
    fn open(&self, reference: &str, _mode: OpenMode) -> Result<Arc<dyn BlockDevice>, TargetError> {
        self.find(reference)
            .ok_or_else(|| TargetError::new(format!("no device named '{reference}'")))
    }
}
