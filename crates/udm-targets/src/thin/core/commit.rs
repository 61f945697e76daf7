//! Commits (the data device flushed first), what a failed metadata operation does to the
//! pool (abort, needs_check, read-only or fail mode), and the low-water events.

use std::sync::atomic::Ordering;

use log::{error, warn};
use udm_block::{BlockDevice, BlockError, Result};
use udm_metadata::thin::ThinError;

use super::{Meta, Pool};
use crate::thin::status::{metadata_low_water, Mode};

/// Metadata blocks a running pool keeps free beyond the reserve for commits: 64, or a
/// sixteenth of a smaller device, and never fewer than [`MOST_BLOCKS_PER_CHANGE`]. Down to
/// these, it commits before a change, and goes read-only if that made no room (the kernel's
/// alloc_data_block: "commit before we use up the metadata reserve"), so that a full
/// metadata device stops the pool cleanly rather than failing a change half way, which
/// aborts the transaction and drops the writes acknowledged since the last commit. Every
/// change checks (a block handed out, its insert, an unmap, a message), one at a time under
/// the metadata lock, so the headroom is for one change.
fn metadata_headroom(meta: &Meta) -> u64 {
    (meta.md.metadata_usage().total / 16).clamp(MOST_BLOCKS_PER_CHANGE, 64)
}

/// The most metadata blocks one change may take in a transaction: an insert shadows each
/// level of the two mapping trees, splits a node or two, and updates both space maps. A
/// sixteenth of a 128 KiB device was 2 blocks, and an insert there ran out half way.
const MOST_BLOCKS_PER_CHANGE: u64 = 16;

impl Pool {
    /// After a metadata operation failed: the transaction is dropped and the pool goes
    /// read-only (needs_check set, unless the metadata device is merely full), or to fail
    /// mode when even that fails. Returns the error for the request that ran into it.
    pub fn metadata_failed(&self, meta: &mut Meta, op: &str, e: ThinError) -> BlockError {
        let full = e == ThinError::MetadataFull;
        if full {
            self.log_metadata_full(meta, &format!(" during {op}"));
        } else {
            error!(
                "thin-pool '{}': metadata operation {op} failed: {e}; run thin_check on the \
                 metadata device",
                self.name
            );
        }
        let mut next = Mode::ReadOnly;
        if let Err(abort) = meta.md.abort() {
            error!(
                "thin-pool '{}': aborting the transaction failed too: {abort}",
                self.name
            );
            next = Mode::Fail;
        }
        meta.epoch += 1;
        meta.passdown.clear();
        self.maps.clear();
        let touched = std::mem::take(&mut meta.touched);
        if !touched.is_empty() {
            error!(
                "thin-pool '{}': thin device(s) {} lost the writes made since the last commit; \
                 their flushes fail while a table uses them",
                self.name,
                touched
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            // Before `dirty` is cleared: a flush that finds nothing to commit then sees these.
            self.lost.lock().extend(touched);
        }
        self.dirty.store(false, Ordering::Release);
        if !full && next != Mode::Fail {
            if let Err(flag) = meta.md.set_needs_check() {
                error!(
                    "thin-pool '{}': setting needs_check failed: {flag}",
                    self.name
                );
                next = Mode::Fail;
            }
        }
        if self.mode() != Mode::Fail {
            self.set_mode(next);
        }
        BlockError::Io(format!("thin-pool '{}': {op}: {e}", self.name))
    }

    fn log_metadata_full(&self, meta: &Meta, during: &str) {
        let usage = meta.md.metadata_usage();
        error!(
            "thin-pool '{}': the metadata device is full ({}/{} blocks){during}: switching \
             the pool to read-only; writes that need a new block and messages fail until the \
             pool is on a larger metadata device",
            self.name, usage.used, usage.total
        );
    }

    /// Before a change to the metadata: when its room is down to the headroom, commits, and
    /// goes read-only (an error) if that made none.
    pub(super) fn make_metadata_room(&self, meta: &mut Meta) -> Result<()> {
        if meta.md.metadata_room() > metadata_headroom(meta) {
            return Ok(());
        }
        self.commit_locked(meta)?;
        if self.short_of_metadata(meta) {
            return Err(BlockError::Io(format!(
                "thin-pool '{}': the metadata device is out of space: the pool is read-only \
                 until it is on a larger one",
                self.name
            )));
        }
        self.check_writable()
    }

    /// After a commit and at resume (the kernel's check_for_metadata_space): a pool whose
    /// metadata room is down to the headroom goes read-only. True if it is short.
    pub(super) fn short_of_metadata(&self, meta: &Meta) -> bool {
        if meta.md.metadata_room() > metadata_headroom(meta) {
            return false;
        }
        if self.mode() < Mode::ReadOnly {
            self.log_metadata_full(meta, "");
            self.set_mode(Mode::ReadOnly);
        }
        true
    }

    /// Makes every completed write durable: the data device is flushed, then (if anything
    /// changed) the metadata committed, so no committed mapping points at data that is not
    /// on disk.
    pub fn commit(&self) -> Result<()> {
        let mut meta = self.meta();
        self.commit_locked(&mut meta)
    }

    pub fn commit_locked(&self, meta: &mut Meta) -> Result<()> {
        let data = self.data();
        let block = self.block_bytes();
        let freed: Vec<u64> = meta.passdown.drain(..).collect();
        for block_nr in freed {
            // Under the metadata lock nobody can allocate it between the check and the discard.
            match meta.md.data_ref_count(block_nr) {
                Ok(0) => {}
                Ok(_) => continue,
                Err(e) => return Err(self.metadata_failed(meta, "data_ref_count", e)),
            }
            if let Err(e) = data.discard(block_nr * block, block) {
                warn!(
                    "thin-pool '{}': discard passdown of block {block_nr}: {e}",
                    self.name
                );
            }
        }
        data.flush()?;
        if !self.is_dirty() || self.mode() >= Mode::ReadOnly {
            return Ok(());
        }
        if let Err(e) = meta.md.commit() {
            return Err(self.metadata_failed(meta, "commit", e));
        }
        self.dirty.store(false, Ordering::Release);
        meta.touched.clear();
        self.short_of_metadata(meta);
        if self.mode() == Mode::OutOfDataSpace {
            let usage = meta.md.data_usage();
            if usage.used < usage.total {
                // Blocks freed in the transaction just committed can be allocated now.
                self.space.reset();
                self.set_mode(Mode::Write);
            }
        }
        self.check_metadata_low_water(meta);
        Ok(())
    }

    /// Fails a flush of thin device `id` if writes it acknowledged were dropped by an abort
    /// (checked after the flush's commit, which is when an abort would have happened).
    pub fn check_lost_writes(&self, id: u32) -> Result<()> {
        if !self.lost.lock().contains(&id) {
            return Ok(());
        }
        Err(BlockError::Io(format!(
            "thin-pool '{}': thin device {id} lost writes when a metadata transaction was \
             aborted (see the log); its flushes fail until no table uses it",
            self.name
        )))
    }

    /// Commits if something changed and the pool is running (the once-a-second commit).
    pub(super) fn periodic_commit(&self) {
        if self.is_dirty() && !self.gate.is_closed() && self.mode() < Mode::ReadOnly {
            if let Err(e) = self.commit() {
                warn!("thin-pool '{}': periodic commit failed: {e}", self.name);
            }
        }
    }

    pub(super) fn check_low_water(&self, meta: &Meta) {
        let usage = meta.md.data_usage();
        let free = usage.total - usage.used;
        let low_water = self.bound.read().low_water_blocks;
        if free <= low_water && !self.low_water_triggered.swap(true, Ordering::AcqRel) {
            warn!(
                "thin-pool '{}': reached low water mark for data device ({free} of {} blocks \
                 free, mark {low_water}): sending event",
                self.name, usage.total
            );
            self.raise_event();
        }
    }

    fn check_metadata_low_water(&self, meta: &Meta) {
        let usage = meta.md.metadata_usage();
        let free = usage.total - usage.used;
        if free <= metadata_low_water(usage.total)
            && !self.metadata_low_triggered.swap(true, Ordering::AcqRel)
        {
            warn!(
                "thin-pool '{}': reached low water mark for metadata device ({free} of {} \
                 blocks free): sending event",
                self.name, usage.total
            );
            self.raise_event();
        }
    }
}
