//! Ending a transaction: the two-phase commit (K:`__commit_transaction`), abort back to the
//! last commit, and the needs_check flag written at once after damage.

use super::btree::insert::insert as btree_insert;
use super::btree::remove::remove as btree_remove;
use super::btree::ValueKind;
use super::open::load;
use super::space_map::{disk, metadata};
use super::superblock::{Superblock, NEEDS_CHECK, SUPERBLOCK_LOCATION};
use super::{Result, ThinMetadata};

impl ThinMetadata {
    /// The needs_check flag: an earlier metadata error may have left damage. Such metadata
    /// is read but never changed (every change fails with `NeedsCheck`) until
    /// `thin_check --clear-needs-check-flag` has passed on it.
    pub fn needs_check(&self) -> bool {
        self.sb.flags & NEEDS_CHECK != 0
    }

    /// Sets the needs_check flag in the superblock of the last commit and writes it at once,
    /// without committing what changed since (after an error that may be the damage). The pool
    /// stays read-only, here and when opened again, until `thin_check
    /// --clear-needs-check-flag` passes.
    pub fn set_needs_check(&mut self) -> Result<()> {
        self.sb.flags |= NEEDS_CHECK;
        self.committed.flags |= NEEDS_CHECK;
        let block = self.committed.encode(SUPERBLOCK_LOCATION);
        self.tm.cache.write_now(SUPERBLOCK_LOCATION, &block)
    }

    fn has_changes(&self) -> bool {
        self.tm.cache.has_dirty()
            || !self.changed.is_empty()
            || self.sb != self.committed
            || self.tm.dsm.nr_blocks() != self.committed.data_sm.nr_blocks
            || self.tm.msm.nr_blocks() != self.committed.metadata_sm.nr_blocks
            || [&self.tm.dsm, &self.tm.msm]
                .iter()
                .any(|sm| sm.bitmaps.iter().any(|b| b.dirty) || !sm.overflow_dirty.is_empty())
    }

    /// Makes everything since the last commit durable (dm's two-phase commit,
    /// K:`__commit_transaction`); the caller has flushed the data device first. A crash before
    /// it returns leaves the previous commit. A commit with nothing to do writes nothing.
    pub fn commit(&mut self) -> Result<()> {
        self.usable()?;
        if !self.has_changes() {
            return Ok(());
        }
        self.tm.set_committing(true);
        let out = self.write_transaction();
        self.tm.set_committing(false);
        if let Err(e) = &out {
            self.failed = Some(e.to_string());
        }
        out
    }

    fn write_transaction(&mut self) -> Result<()> {
        let mut root = self.sb.device_details_root;
        for id in std::mem::take(&mut self.changed) {
            root = match self.details.get(&id) {
                Some(info) => {
                    let value = info.encode();
                    btree_insert(&mut self.tm, root, ValueKind::Details, id as u64, &value)?.0
                }
                None => btree_remove(&mut self.tm, root, ValueKind::Details, id as u64)?.0,
            };
        }
        self.sb.device_details_root = root;
        disk::commit(&mut self.tm)?;
        metadata::commit(&mut self.tm)?;
        self.sb.data_sm = self.tm.dsm.root();
        self.sb.metadata_sm = self.tm.msm.root();
        self.tm.write_commit(&self.sb)?;
        self.committed = self.sb.clone();
        Ok(())
    }

    /// Drops everything since the last commit (metadata back to the committed state, read
    /// again from the device).
    pub fn abort(&mut self) -> Result<()> {
        let block0 = self.tm.cache.read_raw(SUPERBLOCK_LOCATION)?;
        let sb = Superblock::decode(SUPERBLOCK_LOCATION, &block0[..])?;
        self.tm.cache.discard_dirty();
        (self.details, self.roots) = load(&mut self.tm, &sb)?;
        self.committed = sb.clone();
        self.sb = sb;
        self.changed.clear();
        self.failed = None;
        Ok(())
    }
}
