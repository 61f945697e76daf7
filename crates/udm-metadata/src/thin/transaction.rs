//! The transaction manager (K:`pd/dm-transaction-manager.c`): the block cache, the two space
//! maps, and the rules that keep the last commit intact until the next one is durable:
//!
//! * a block is written in place only if this transaction allocated it and nothing else
//!   references it; any other block is *shadowed* (copied to a new block) before a change;
//! * a new block must be free both now and at the last commit, so a block freed in this
//!   transaction is not reused until the commit has made the trees that no longer need it
//!   durable;
//! * the commit writes every new block, flushes, then writes the superblock and flushes
//!   ([`Tm::write_commit`]).

use std::sync::Arc;

use udm_block::BlockDevice;

use super::cache::BlockCache;
use super::checksum::Kind;
use super::error::{Result, ThinError};
use super::space_map::{SmKind, SpaceMap};
use super::superblock::{Superblock, SUPERBLOCK_LOCATION};
use crate::BLOCK_SIZE;

/// The kernel keeps back a tenth of the metadata device, at most 16 MiB, so that a commit
/// still finds blocks after the operations before it filled the rest (`__set_metadata_reserve`).
pub fn metadata_reserve(nr_blocks: u64) -> u64 {
    (nr_blocks / 10).min(4096)
}

pub struct Tm {
    pub cache: BlockCache,
    pub msm: SpaceMap,
    pub dsm: SpaceMap,
    /// While false, allocations leave `metadata_reserve` blocks free.
    committing: bool,
}

impl Tm {
    pub fn new(dev: Arc<dyn BlockDevice>) -> Self {
        Tm {
            cache: BlockCache::new(dev),
            msm: SpaceMap::new(SmKind::Metadata),
            dsm: SpaceMap::new(SmKind::Data),
            committing: false,
        }
    }

    /// Lets the allocations of a commit (or a format) use the reserve.
    pub fn set_committing(&mut self, committing: bool) {
        self.committing = committing;
    }

    /// A new metadata block with count 1.
    pub fn alloc(&mut self) -> Result<u64> {
        if !self.committing && self.msm.nr_usable() <= metadata_reserve(self.msm.nr_blocks()) {
            return Err(ThinError::MetadataFull);
        }
        self.msm
            .alloc(&mut self.cache)?
            .ok_or(ThinError::MetadataFull)
    }

    /// A new zeroed block of `kind`.
    pub fn new_block(&mut self, kind: Kind) -> Result<u64> {
        let b = self.alloc()?;
        self.cache.put(b, kind, Arc::new([0u8; BLOCK_SIZE]));
        Ok(b)
    }

    pub fn count(&mut self, b: u64) -> Result<u32> {
        self.msm.count(b, &mut self.cache)
    }

    pub fn inc(&mut self, b: u64) -> Result<()> {
        self.msm.inc(b, &mut self.cache)
    }

    /// Drops a reference to metadata block `b`; its new count.
    pub fn dec(&mut self, b: u64) -> Result<u32> {
        let count = self.msm.dec(b, &mut self.cache)?;
        if count == 0 {
            // Nothing reaches it any more (an abort reads it again from the disk, where it
            // stays until the next commit): it must not take the place of live blocks.
            self.cache.forget(b);
        }
        Ok(count)
    }

    /// True if `b` may be changed in place: this transaction made it and it has one owner.
    pub fn writable(&mut self, b: u64) -> Result<bool> {
        Ok(self.msm.is_new(b) && self.count(b)? == 1)
    }

    /// Makes `b` writable: itself if it already is, else a copy in a new block, with the
    /// reference moved from `b` to the copy. The flag says `b` was shared, so the copy's
    /// children gained a referrer (the caller increments them).
    pub fn shadow(&mut self, b: u64, kind: Kind) -> Result<(u64, bool)> {
        let count = self.count(b)?;
        if self.msm.is_new(b) && count == 1 {
            return Ok((b, false));
        }
        let data = self.cache.read(b, kind)?;
        let copy = self.alloc()?;
        self.cache.put(copy, kind, data);
        self.dec(b)?;
        Ok((copy, count > 1))
    }

    /// The second half of a commit, once every block is in the cache: writes the blocks,
    /// flushes, writes `sb` to block 0 and flushes again. Either the old or the new superblock
    /// is on disk if it fails, and each names complete trees.
    pub fn write_commit(&mut self, sb: &Superblock) -> Result<()> {
        self.cache.write_dirty()?;
        self.cache.flush()?;
        let block = sb.encode(SUPERBLOCK_LOCATION);
        self.cache.write_now(SUPERBLOCK_LOCATION, &block)?;
        self.msm.committed_now();
        self.dsm.committed_now();
        Ok(())
    }
}
