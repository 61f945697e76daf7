//! What differs between two thin devices (thin_delta): runs of virtual blocks mapped by only
//! one of them or to different data blocks, from a walk of their mapping trees that skips
//! the subtrees they share ([`super::btree::diff`]), so its cost follows the change.

use super::btree::diff::diff;
pub use super::btree::diff::Side;
use super::btree::{mapping_block, ValueKind};
use super::error::Result;
use super::ThinMetadata;

/// `len` virtual blocks from `begin` that differ the same way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaRun {
    pub begin: u64,
    pub len: u64,
    pub side: Side,
}

impl ThinMetadata {
    /// The blocks that differ from device `from` (None: a device that maps nothing) to device
    /// `to`, in order: `RightOnly` and `Different` blocks hold new data in `to`, `LeftOnly`
    /// ones are unmapped in `to`. Two mappings of one data block are the same.
    pub fn delta(&mut self, from: Option<u32>, to: u32) -> Result<Vec<DeltaRun>> {
        self.usable()?;
        let left = match from {
            Some(id) => {
                self.info(id)?;
                Some(self.root_of(id)?)
            }
            None => None,
        };
        self.info(to)?;
        let right = Some(self.root_of(to)?);
        let mut runs: Vec<DeltaRun> = Vec::new();
        diff(
            &mut self.tm.cache,
            left,
            right,
            ValueKind::Mapping,
            |a, b| mapping_block(a) == mapping_block(b),
            &mut |vblock, side| match runs.last_mut() {
                Some(run) if run.side == side && run.begin + run.len == vblock => run.len += 1,
                _ => runs.push(DeltaRun {
                    begin: vblock,
                    len: 1,
                    side,
                }),
            },
        )?;
        Ok(runs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use udm_block::MemoryDevice;

    /// The delta computed the slow way: every mapping of both devices compared.
    fn brute(meta: &mut ThinMetadata, from: u32, to: u32) -> BTreeMap<u64, Side> {
        let all = |meta: &mut ThinMetadata, id| -> BTreeMap<u64, u64> {
            let mut map = BTreeMap::new();
            for (vb, db, len, _) in meta.lookup_range(id, 0, u64::MAX).unwrap() {
                for i in 0..len {
                    map.insert(vb + i, db + i);
                }
            }
            map
        };
        let (l, r) = (all(meta, from), all(meta, to));
        let mut out = BTreeMap::new();
        for vb in l.keys().chain(r.keys()) {
            match (l.get(vb), r.get(vb)) {
                (Some(a), Some(b)) if a == b => {}
                (Some(_), Some(_)) => drop(out.insert(*vb, Side::Different)),
                (Some(_), None) => drop(out.insert(*vb, Side::LeftOnly)),
                _ => drop(out.insert(*vb, Side::RightOnly)),
            }
        }
        out
    }

    fn expand(runs: &[DeltaRun]) -> BTreeMap<u64, Side> {
        runs.iter()
            .flat_map(|r| (r.begin..r.begin + r.len).map(move |vb| (vb, r.side)))
            .collect()
    }

    #[test]
    fn the_delta_is_what_differs_and_reads_only_the_changed_paths() {
        let dev = Arc::new(MemoryDevice::new(64 << 20));
        let mut meta = ThinMetadata::open(dev.clone(), 128, 400_000).unwrap();
        meta.create_thin(1).unwrap();
        for vb in 0..150_000 {
            let b = meta.alloc_data_block().unwrap().unwrap();
            meta.insert(1, vb, b).unwrap();
        }
        meta.create_snap(2, 1).unwrap();
        // A few writes and discards on the origin after the snapshot; one block far out.
        let mut seed = 7u64;
        for _ in 0..300 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let vb = (seed >> 33) % 160_000;
            if vb.is_multiple_of(5) {
                meta.remove(1, vb).unwrap();
            } else {
                let b = meta.alloc_data_block().unwrap().unwrap();
                meta.insert(1, vb, b).unwrap();
            }
        }
        meta.commit().unwrap();
        meta.create_snap(3, 1).unwrap();
        meta.commit().unwrap();
        let expected = brute(&mut meta, 2, 3);
        drop(meta);
        assert!(expected.len() > 200, "the workload changed blocks");
        // Reopened, cold: the walk reads a few nodes per change, not the 600 leaves.
        let mut meta = ThinMetadata::open(dev, 128, 400_000).unwrap();
        let before = meta.disk_reads();
        let runs = meta.delta(Some(2), 3).unwrap();
        let reads = meta.disk_reads() - before;
        assert_eq!(expand(&runs), expected);
        assert!(reads < 3 * 300 + 10, "{reads} nodes read for 300 changes");
        // Both ways round, the whole device, and a device against itself.
        let back = meta.delta(Some(3), 2).unwrap();
        let flipped: BTreeMap<u64, Side> = expected
            .iter()
            .map(|(vb, side)| {
                let side = match side {
                    Side::LeftOnly => Side::RightOnly,
                    Side::RightOnly => Side::LeftOnly,
                    Side::Different => Side::Different,
                };
                (*vb, side)
            })
            .collect();
        assert_eq!(expand(&back), flipped);
        let full = meta.delta(None, 2).unwrap();
        assert_eq!(
            full,
            [DeltaRun {
                begin: 0,
                len: 150_000,
                side: Side::RightOnly
            }]
        );
        assert_eq!(meta.delta(Some(3), 3).unwrap(), []);
        assert_eq!(
            meta.delta(Some(9), 3),
            Err(super::super::ThinError::NoSuchDevice(9))
        );
    }

    #[test]
    fn trees_of_different_heights_compare_by_key() {
        let mut meta =
            ThinMetadata::open(Arc::new(MemoryDevice::new(16 << 20)), 128, 100_000).unwrap();
        meta.create_thin(1).unwrap();
        meta.create_thin(2).unwrap();
        for vb in 0..20_000u64 {
            let b = meta.alloc_data_block().unwrap().unwrap();
            meta.insert(1, vb * 3, b).unwrap();
        }
        for vb in [1u64, 3, 30_000, 59_997, 70_000] {
            let b = meta.alloc_data_block().unwrap().unwrap();
            meta.insert(2, vb, b).unwrap();
        }
        assert_eq!(
            expand(&meta.delta(Some(1), 2).unwrap()),
            brute(&mut meta, 1, 2)
        );
        assert_eq!(
            expand(&meta.delta(Some(2), 1).unwrap()),
            brute(&mut meta, 2, 1)
        );
    }
}
