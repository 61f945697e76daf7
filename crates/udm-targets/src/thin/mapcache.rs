//! Where recently used virtual blocks live, so that I/O to provisioned blocks needs neither
//! the metadata lock (held across a commit's data flush) nor a btree walk.
//!
//! It stays exact because every change of a mapping goes through the pool, which updates it
//! under the metadata lock, and a change happens only while the block's cell is held
//! exclusively — so a reader holding the cell shared sees either the old or the new mapping
//! before it, never a stale one after. Snapshots change the `shared` flag of a whole device,
//! whose I/O is suspended then; the pool clears the cache at every message and every abort.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use udm_metadata::thin::Mapping;

use super::cells::{Key, KeyHasher};

/// Entries kept before the cache starts over (about 32 MiB).
const CAPACITY: usize = 1 << 20;

#[derive(Default)]
pub struct MapCache {
    entries: Mutex<HashMap<Key, Mapping, BuildHasherDefault<KeyHasher>>>,
}

impl MapCache {
    pub fn get(&self, key: Key) -> Option<Mapping> {
        self.entries.lock().get(&key).copied()
    }

    pub fn put(&self, key: Key, mapping: Mapping) {
        let mut entries = self.entries.lock();
        if entries.len() >= CAPACITY {
            entries.clear();
        }
        entries.insert(key, mapping);
    }

    pub fn forget(&self, key: Key) {
        self.entries.lock().remove(&key);
    }

    pub fn clear(&self) {
        self.entries.lock().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_forgets_and_starts_over_when_full() {
        let cache = MapCache::default();
        let m = Mapping {
            data_block: 9,
            shared: false,
        };
        cache.put((1, 2), m);
        assert_eq!(cache.get((1, 2)), Some(m));
        assert_eq!(cache.get((2, 2)), None);
        cache.forget((1, 2));
        assert_eq!(cache.get((1, 2)), None);
        for v in 0..CAPACITY as u64 + 1 {
            cache.put((0, v), m);
        }
        assert_eq!(cache.entries.lock().len(), 1);
    }
}
