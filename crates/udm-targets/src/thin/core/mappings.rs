//! The pool's side of thin I/O: handing out, inserting and unmapping data blocks, and
//! lookups through the mapping cache.

use log::error;
use udm_block::{BlockError, Result};
use udm_metadata::thin::{Mapping, ThinError};

use super::{Meta, Pool};
use crate::thin::status::Mode;

impl Pool {
    /// Hands out a data block for a write (the caller fills it, then inserts it). `None`
    /// means the data device is full.
    pub fn alloc_block(&self) -> std::result::Result<Option<(u64, u64)>, BlockError> {
        let mut meta = self.meta();
        self.check_writable()?;
        self.make_metadata_room(&mut meta)?;
        match meta.md.alloc_data_block() {
            Ok(Some(block)) => {
                self.mark_dirty();
                self.check_low_water(&meta);
                Ok(Some((block, meta.epoch)))
            }
            Ok(None) => Ok(None),
            Err(e) => Err(self.metadata_failed(&mut meta, "alloc_data_block", e)),
        }
    }

    /// Takes back a block whose data write failed (unless the transaction that allocated
    /// it was rolled back since, which took it back already).
    pub fn give_back(&self, block: u64, epoch: u64) {
        self.give_back_locked(&mut self.meta(), block, epoch);
    }

    fn give_back_locked(&self, meta: &mut Meta, block: u64, epoch: u64) {
        if meta.epoch == epoch {
            if let Err(e) = meta.md.release_data_block(block) {
                self.metadata_failed(meta, "release_data_block", e);
            }
        }
    }

    /// Maps `vblock` of `id` to a block from [`Pool::alloc_block`], now filled.
    pub fn insert(&self, id: u32, vblock: u64, block: u64, epoch: u64) -> Result<()> {
        let mut meta = self.meta();
        if meta.epoch != epoch {
            return Err(BlockError::Io(format!(
                "thin-pool '{}': the metadata transaction was rolled back while block {vblock} \
                 of thin device {id} was being written",
                self.name
            )));
        }
        self.check_writable()?;
        // Room is checked again here, not only when the block was handed out: the writes
        // under way since have taken theirs. Refused now, the write fails unacknowledged and
        // its block goes back; run out half way, the insert would abort the transaction.
        if let Err(e) = self.make_metadata_room(&mut meta) {
            self.give_back_locked(&mut meta, block, epoch);
            return Err(e);
        }
        match meta.md.insert(id, vblock, block) {
            Ok(()) => {
                self.mark_dirty();
                meta.touched.insert(id);
                // Made now, after the device's last snapshot: its own.
                let mapping = Mapping {
                    data_block: block,
                    shared: false,
                };
                self.maps.put((id, vblock), mapping);
                Ok(())
            }
            Err(e) => Err(self.metadata_failed(&mut meta, "insert", e)),
        }
    }

    /// Unmaps `vblock` of `id` (a discard); a block that became free is passed down to the
    /// data device at the next commit, if the pool passes discards down.
    pub fn unmap(&self, id: u32, vblock: u64) -> Result<()> {
        let mut meta = self.meta();
        self.check_writable()?;
        match meta.md.lookup(id, vblock) {
            Ok(None) => return Ok(()),
            Ok(Some(_)) => {}
            Err(e) => return Err(self.lookup_failed(id, vblock, e)),
        }
        self.make_metadata_room(&mut meta)?;
        match meta.md.remove(id, vblock) {
            Ok(freed) => {
                self.mark_dirty();
                meta.touched.insert(id);
                self.maps.forget((id, vblock));
                if let Some(freed) = freed.filter(|_| self.features().discard_passdown) {
                    meta.passdown.push(freed);
                }
                Ok(())
            }
            Err(e) => Err(self.metadata_failed(&mut meta, "remove", e)),
        }
    }

    /// Where `vblock` of `id` lives. The caller holds the block's cell (shared or
    /// exclusive), which is what keeps the mapping cache exact for it.
    pub fn lookup(&self, id: u32, vblock: u64) -> Result<Option<Mapping>> {
        if let Some(mapping) = self.maps.get((id, vblock)) {
            return Ok(Some(mapping));
        }
        let mut meta = self.meta();
        self.lookup_locked(&mut meta, id, vblock)
            .map_err(|e| self.lookup_failed(id, vblock, e))
    }

    /// [`Pool::lookup`] past the cache, with the metadata lock held; remembers what it finds.
    pub fn lookup_locked(
        &self,
        meta: &mut Meta,
        id: u32,
        vblock: u64,
    ) -> std::result::Result<Option<Mapping>, ThinError> {
        let found = meta.md.lookup(id, vblock)?;
        if let Some(mapping) = found {
            self.maps.put((id, vblock), mapping);
        }
        Ok(found)
    }

    /// [`Pool::lookup`] from the cache alone.
    pub fn cached(&self, id: u32, vblock: u64) -> Option<Mapping> {
        self.maps.get((id, vblock))
    }

    /// Mapped runs of `id` in `[begin, end)`: (vblock, data block, len, shared).
    pub fn lookup_range(
        &self,
        id: u32,
        begin: u64,
        end: u64,
    ) -> Result<Vec<(u64, u64, u64, bool)>> {
        self.meta()
            .md
            .lookup_range(id, begin, end)
            .map_err(|e| self.lookup_failed(id, begin, e))
    }

    /// A failed lookup fails the request; the metadata is not changed by it, so the mode
    /// stays (as the kernel's dm_thin_find_block failures).
    pub fn lookup_failed(&self, id: u32, vblock: u64, e: ThinError) -> BlockError {
        error!(
            "thin-pool '{}': looking up block {vblock} of thin device {id}: {e}",
            self.name
        );
        BlockError::Io(format!("thin-pool '{}': {e}", self.name))
    }

    pub(super) fn check_writable(&self) -> Result<()> {
        match self.mode() {
            Mode::Write | Mode::OutOfDataSpace => Ok(()),
            mode => Err(BlockError::Io(format!(
                "thin-pool '{}' is {}: no new blocks can be mapped",
                self.name,
                match mode {
                    Mode::Fail => "in fail mode",
                    _ => "read-only",
                }
            ))),
        }
    }
}
