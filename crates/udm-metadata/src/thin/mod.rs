//! dm-thin's pool metadata, written as the kernel's `dm-thin-metadata.c` writes it, so that
//! thin-provisioning-tools (`thin_check`, `thin_dump`, `thin_restore`, …) work on udm's pools
//! and a pool written by udm can be activated by the kernel. `docs/thin-metadata.md` describes
//! the format as udm uses it, byte by byte, with the kernel and tools sources it follows.
//!
//! One file per job: [`checksum`] (crc32c and salts), [`superblock`], [`btree`] (node layout,
//! lookup, insert, remove), [`space_map`] (bitmaps, index, the data and metadata maps),
//! [`cache`] (blocks in memory), [`transaction`] (shadowing, allocation, two-phase commit),
//! [`mapping`] (the two-level mapping tree), [`details`], [`delta`] (thin_delta's runs). The
//! pool's API, [`ThinMetadata`], is split the same way: [`open`] (format, check, load),
//! [`devices`] (create, snapshot, delete), [`blocks`] (lookups and mappings), [`space`]
//! (usage, growth), [`metadata_snap`], [`commit`] (commit, abort, needs_check); this file holds
//! its state and the checks every change goes through.

mod btree;
mod cache;
pub mod checksum;
mod delta;
mod details;
mod error;
mod mapping;
mod space_map;
mod superblock;
mod transaction;

mod blocks;
mod commit;
mod devices;
mod metadata_snap;
mod open;
mod space;

use std::collections::{BTreeMap, BTreeSet};

use self::cache::NumberMap;
use self::error::corrupt;
use self::space_map::index::MAX_METADATA_BITMAPS;
use self::space_map::{bitmap::ENTRIES_PER_BITMAP, disk};
use self::superblock::Superblock;
use self::transaction::Tm;

pub use self::delta::{DeltaRun, Side};
pub use self::details::DeviceInfo;
pub use self::error::ThinError;

type Result<T, E = ThinError> = std::result::Result<T, E>;

/// The most metadata blocks a pool uses (K:`DM_SM_METADATA_MAX_BLOCKS`, 255 bitmaps of
/// 16,320): 15.9 GiB; the rest of a larger metadata device is left alone.
pub const MAX_METADATA_BLOCKS: u64 = MAX_METADATA_BITMAPS as u64 * ENTRIES_PER_BITMAP;
/// Thin device ids have 24 bits (K:`MAX_DEV_ID` in dm-thin.c).
pub const MAX_DEV_ID: u32 = (1 << 24) - 1;
/// Data block sizes the pool accepts, in sectors: 64 KiB to 1 GiB in steps of 64 KiB.
pub const MIN_DATA_BLOCK_SECTORS: u32 = 128;
pub const MAX_DATA_BLOCK_SECTORS: u32 = 2_097_152;

/// Where a thin device's virtual block lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapping {
    pub data_block: u64,
    /// The mapping was made before the device's last snapshot, so another device may share
    /// the block (`dm_thin_find_block`'s time-based answer): a write must break sharing.
    pub shared: bool,
}

/// Used and total blocks of a space map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub used: u64,
    pub total: u64,
}

/// The pool metadata: the details of every thin device, their mappings, and the reference
/// counts of data and metadata blocks. Not internally locked: the pool wraps it in a Mutex.
///
/// Changes build up a transaction in memory (new blocks are written only by `commit`); the
/// metadata on disk is always the last commit. After an error from a change other than a
/// refused argument (`NoSuchDevice`, `DeviceExists`, `BadArgument`), the transaction is
/// unusable: every call but `abort` (and `set_needs_check`) fails with `Aborting`.
pub struct ThinMetadata {
    tm: Tm,
    /// The superblock the next commit writes.
    sb: Superblock,
    /// The superblock of the last commit.
    committed: Superblock,
    details: BTreeMap<u32, DeviceInfo>,
    /// The root of each device's tree (also in the top level, which the hot path skips).
    roots: NumberMap<u32, u64>,
    /// Devices whose details changed (or which were deleted) since the last commit.
    changed: BTreeSet<u32>,
    failed: Option<String>,
}

impl std::fmt::Debug for ThinMetadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThinMetadata")
            .field("transaction_id", &self.sb.trans_id)
            .field("devices", &self.details.len())
            .field("data", &self.data_usage())
            .field("metadata", &self.metadata_usage())
            .field("failed", &self.failed)
            .finish()
    }
}

impl ThinMetadata {
    fn usable(&self) -> Result<()> {
        match &self.failed {
            Some(why) => Err(ThinError::Aborting(why.clone())),
            None => Ok(()),
        }
    }

    /// Runs a change; an error leaves the transaction half done, so it must be aborted.
    /// Metadata that needs checking is not changed at all.
    fn change<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        self.usable()?;
        if self.needs_check() {
            return Err(ThinError::NeedsCheck);
        }
        let out = f(self).and_then(|out| {
            disk::place_changed_bitmaps(&mut self.tm)?;
            Ok(out)
        });
        if let Err(e) = &out {
            self.failed = Some(e.to_string());
        }
        out
    }

    fn info(&self, id: u32) -> Result<DeviceInfo> {
        self.details
            .get(&id)
            .copied()
            .ok_or(ThinError::NoSuchDevice(id))
    }

    fn root_of(&self, id: u32) -> Result<u64> {
        self.roots.get(&id).copied().ok_or_else(|| {
            corrupt(
                self.sb.data_mapping_root,
                format!("device {id} has details but no mapping tree"),
            )
        })
    }

    /// The data block size, in sectors.
    pub fn data_block_sectors(&self) -> u32 {
        self.sb.data_block_size
    }

    /// Metadata blocks read from the device so far (a warm lookup reads none).
    pub fn disk_reads(&self) -> u64 {
        self.tm.cache.disk_reads()
    }

    /// Bounds the clean metadata blocks kept in memory (default 65,536: 256 MiB).
    pub fn set_cache_blocks(&mut self, blocks: usize) {
        self.tm.cache.set_capacity(blocks);
    }
}

#[cfg(test)]
mod tests;
