//! Metadata snapshots (`reserve_metadata_snap`): a frozen copy of the trees for `thin_dump -m`
//! and `thin_delta -m` while the pool runs.

use std::sync::Arc;

use super::btree::{del_tree, ValueKind};
use super::checksum::Kind;
use super::superblock::Superblock;
use super::{Result, ThinError, ThinMetadata};

impl ThinMetadata {
    /// Takes a metadata snapshot (K:`__reserve_metadata_snap`): commits, then copies the
    /// superblock to a new block whose trees stay as they are now, for `thin_dump -m` and
    /// `thin_delta -m` while the pool runs. The next commit records it (`held_root`).
    pub fn reserve_metadata_snap(&mut self) -> Result<()> {
        self.usable()?;
        if self.sb.held_root != 0 {
            return Err(ThinError::BadArgument(format!(
                "a metadata snapshot is already held (block {}): release it first",
                self.sb.held_root
            )));
        }
        self.commit()?;
        self.change(|m| {
            let copy = m.tm.alloc()?;
            let mut snap = m.committed.clone();
            snap.data_sm = Default::default();
            snap.metadata_sm = Default::default();
            m.tm.cache
                .put(copy, Kind::Superblock, Arc::from(snap.encode(copy)));
            m.tm.inc(snap.data_mapping_root)?;
            m.tm.inc(snap.device_details_root)?;
            m.sb.held_root = copy;
            Ok(())
        })
    }

    /// Drops the metadata snapshot and what only it kept (K:`__release_metadata_snap`); the
    /// next commit records it.
    pub fn release_metadata_snap(&mut self) -> Result<()> {
        self.usable()?;
        let held = self.sb.held_root;
        if held == 0 {
            return Err(ThinError::BadArgument(
                "no metadata snapshot is held".into(),
            ));
        }
        self.change(|m| {
            let block = m.tm.cache.read(held, Kind::Superblock)?;
            let snap = Superblock::decode(held, &block[..])?;
            del_tree(&mut m.tm, snap.data_mapping_root, ValueKind::Subtree)?;
            del_tree(&mut m.tm, snap.device_details_root, ValueKind::Details)?;
            m.tm.dec(held)?;
            m.sb.held_root = 0;
            Ok(())
        })
    }

    /// The metadata snapshot's block, if one is held (the pool status's held root).
    pub fn held_root(&self) -> Option<u64> {
        (self.sb.held_root != 0).then_some(self.sb.held_root)
    }
}
