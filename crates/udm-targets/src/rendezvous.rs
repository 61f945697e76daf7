//! Where targets of different tables find each other.
//!
//! Some targets only work together: a `thin` device finds the `thin-pool` that holds its
//! blocks, a `snapshot` and the `snapshot-origin` over the same origin must both see every
//! write to it. The kernel keeps a hash of such objects keyed by the device they share (its
//! `_origins` table, its pool table keyed by the pool's device); a [`Rendezvous`] is that
//! hash. It holds only weak references, so an entry lives exactly as long as the targets
//! using it and a removed device leaves nothing behind.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::path::Path;

use std::sync::{Arc, Weak};
use udm_block::BlockDevice;

use crate::Reference;

/// A process-wide map from a key naming a shared device to the object targets share on it.
pub struct Rendezvous<T: ?Sized> {
    entries: Mutex<Option<HashMap<String, Weak<T>>>>,
}

impl<T: ?Sized> Rendezvous<T> {
    /// An empty rendezvous, usable as a `static`.
    pub const fn new() -> Self {
        Rendezvous {
            entries: Mutex::new(None),
        }
    }

    /// The live object under `key`, if any target still holds it.
    pub fn get(&self, key: &str) -> Option<Arc<T>> {
        let entries = self.entries.lock();
        entries.as_ref()?.get(key)?.upgrade()
    }

    /// The live object under `key`, or the one `make` builds (which is then registered).
    /// `make` runs under the lock, so two tables naming the same key at once share one object.
    pub fn get_or_try_insert<E>(
        &self,
        key: &str,
        make: impl FnOnce() -> Result<Arc<T>, E>,
    ) -> Result<Arc<T>, E> {
        let mut entries = self.entries.lock();
        let entries = entries.get_or_insert_with(HashMap::new);
        // Entries whose targets are all gone are dropped here rather than by the targets,
        // which cannot tell whether they held the last reference.
        entries.retain(|_, object| object.strong_count() > 0);
        if let Some(object) = entries.get(key).and_then(Weak::upgrade) {
            return Ok(object);
        }
        let object = make()?;
        entries.insert(key.to_string(), Arc::downgrade(&object));
        Ok(object)
    }
}

impl<T: ?Sized> Default for Rendezvous<T> {
    fn default() -> Self {
        Self::new()
    }
}

/// The key for the device a table line's `reference` opened as `dev`: its identity (a file's
/// inode, a block device's number, a udm device's serial, so that `./origin.img`, a hard link
/// to it and `/abs/origin.img` meet, and a renamed udm device is still itself), else a path
/// made canonical, else the reference as written (a URI).
pub fn device_key(reference: &str, dev: &dyn BlockDevice) -> String {
    if let Some(identity) = dev.identity() {
        return identity;
    }
    if let Reference::Path(path) = Reference::parse(reference) {
        if let Ok(canonical) = Path::new(path).canonicalize() {
            return canonical.to_string_lossy().into_owned();
        }
    }
    reference.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_object_per_key_while_someone_holds_it() {
        let shared: Rendezvous<Mutex<u32>> = Rendezvous::new();
        let first = shared
            .get_or_try_insert::<()>("pool", || Ok(Arc::new(Mutex::new(1))))
            .unwrap();
        let second = shared
            .get_or_try_insert::<()>("pool", || Ok(Arc::new(Mutex::new(2))))
            .unwrap();
        assert!(Arc::ptr_eq(&first, &second));
        assert!(shared.get("other").is_none());
        drop((first, second));
        assert!(
            shared.get("pool").is_none(),
            "a dropped object is not found"
        );
        let third = shared
            .get_or_try_insert::<()>("pool", || Ok(Arc::new(Mutex::new(3))))
            .unwrap();
        assert_eq!(*third.lock(), 3);
    }

    #[test]
    fn a_failed_make_registers_nothing() {
        let shared: Rendezvous<u32> = Rendezvous::new();
        let failed = shared.get_or_try_insert("pool", || Err("no metadata"));
        assert_eq!(failed.unwrap_err(), "no metadata");
        assert!(shared.get("pool").is_none());
    }

    #[test]
    fn devices_meet_by_identity_else_by_canonical_path_else_by_name() {
        let dir = std::env::temp_dir();
        let file = dir.join(format!("udm-rendezvous-{}", std::process::id()));
        std::fs::write(&file, vec![0u8; 4096]).unwrap();
        let nameless = udm_block::MemoryDevice::new(4096);
        let direct = device_key(file.to_str().unwrap(), &nameless);
        let dotted = device_key(
            &format!(
                "{}/../{}/{}",
                dir.display(),
                dir.file_name().unwrap().to_string_lossy(),
                file.file_name().unwrap().to_string_lossy()
            ),
            &nameless,
        );
        assert_eq!(direct, dotted);
        assert_eq!(device_key("pool", &nameless), "pool");
        let opened = udm_block::FileDevice::open(&file, udm_block::OpenMode::ReadOnly).unwrap();
        assert_eq!(device_key("any name", &opened), opened.identity().unwrap());
        std::fs::remove_file(file).unwrap();
    }
}
