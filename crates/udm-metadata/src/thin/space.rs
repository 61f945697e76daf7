//! How much data and metadata space a pool uses, and growing either.

use std::sync::Arc;

use udm_block::BlockDevice;

use super::mapping::MAX_DATA_BLOCKS;
use super::transaction::metadata_reserve;
use super::{Result, ThinError, ThinMetadata, Usage, MAX_METADATA_BLOCKS};

impl ThinMetadata {
    /// Data blocks in use and in all; exact, counts uncommitted allocations.
    pub fn data_usage(&self) -> Usage {
        Usage {
            used: self.tm.dsm.nr_allocated(),
            total: self.tm.dsm.nr_blocks(),
        }
    }

    /// Metadata blocks in use and in all, as the kernel's pool status counts them: the blocks
    /// kept back for commits (a tenth of the device, at most 4096) count as used.
    pub fn metadata_usage(&self) -> Usage {
        let total = self.tm.msm.nr_blocks();
        let free = self
            .tm
            .msm
            .nr_free()
            .saturating_sub(metadata_reserve(total));
        Usage {
            used: total - free,
            total,
        }
    }

    /// Metadata blocks this transaction can still allocate: the free ones, less those freed
    /// in it (they wait for the commit) and the reserve kept for commits.
    pub fn metadata_room(&self) -> u64 {
        self.tm
            .msm
            .nr_usable()
            .saturating_sub(metadata_reserve(self.tm.msm.nr_blocks()))
    }

    /// Grows the data space to `nr_data_blocks` (shrinking is refused).
    pub fn resize_data(&mut self, nr_data_blocks: u64) -> Result<()> {
        self.usable()?;
        let now = self.tm.dsm.nr_blocks();
        if nr_data_blocks < now || nr_data_blocks > MAX_DATA_BLOCKS {
            return Err(ThinError::BadArgument(format!(
                "cannot resize the data space from {now} to {nr_data_blocks} blocks: \
                 it only grows, up to 2^40"
            )));
        }
        // The new bitmaps take their blocks now: a growth too large for the metadata fails
        // here, not in the commit.
        self.change(|m| {
            m.tm.dsm.extend(nr_data_blocks);
            Ok(())
        })
    }

    /// Grows the metadata space onto `dev`, the metadata device opened again after it grew
    /// (K:`dm_pool_resize_metadata_dev`): the new blocks are the pool's from the next
    /// commit on. A device smaller than the metadata space is refused.
    pub fn resize_metadata(&mut self, dev: Arc<dyn BlockDevice>) -> Result<()> {
        self.usable()?;
        let now = self.tm.msm.nr_blocks();
        let blocks = (dev.size() / crate::BLOCK_SIZE as u64).min(MAX_METADATA_BLOCKS);
        if blocks < now {
            return Err(ThinError::BadArgument(format!(
                "the metadata device has {blocks} blocks, fewer than the pool's {now}: \
                 metadata devices do not shrink"
            )));
        }
        self.tm.cache.grow_device(dev);
        // The new bitmaps find their blocks at commit, in the space they add.
        self.change(|m| {
            m.tm.msm.extend(blocks);
            Ok(())
        })
    }
}
