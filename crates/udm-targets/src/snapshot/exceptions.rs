//! The completed exceptions of one snapshot: origin chunk → COW chunk, looked up on every
//! request. Sharded by chunk so that lookups for different chunks never contend, and only
//! ever holding exceptions whose commit is durable.

use parking_lot::RwLock;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use udm_metadata::snapshot::Record;

const SHARDS: usize = 64;

pub struct ExceptionTable {
    shards: Vec<RwLock<HashMap<u64, u64>>>,
    count: AtomicU64,
}

impl ExceptionTable {
    pub fn new(records: &[Record]) -> Self {
        let table = ExceptionTable {
            shards: (0..SHARDS).map(|_| RwLock::default()).collect(),
            count: AtomicU64::new(0),
        };
        for record in records {
            table.insert(record.old, record.new);
        }
        table
    }

    fn shard(&self, old: u64) -> &RwLock<HashMap<u64, u64>> {
        &self.shards[old as usize % SHARDS]
    }

    pub fn get(&self, old: u64) -> Option<u64> {
        self.shard(old).read().get(&old).copied()
    }

    pub fn insert(&self, old: u64, new: u64) {
        if self.shard(old).write().insert(old, new).is_none() {
            self.count.fetch_add(1, Ordering::AcqRel);
        }
    }

    pub fn remove(&self, old: u64) {
        if self.shard(old).write().remove(&old).is_some() {
            self.count.fetch_sub(1, Ordering::AcqRel);
        }
    }

    pub fn len(&self) -> u64 {
        self.count.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_what_it_holds() {
        let table = ExceptionTable::new(&[Record { old: 3, new: 2 }, Record { old: 67, new: 3 }]);
        assert_eq!(
            (table.get(3), table.get(67), table.get(4)),
            (Some(2), Some(3), None)
        );
        table.insert(3, 9);
        assert_eq!((table.len(), table.get(3)), (2, Some(9)));
        table.remove(3);
        table.remove(3);
        assert_eq!(table.len(), 1);
    }
}
