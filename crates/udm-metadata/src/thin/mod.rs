//! dm-thin's pool metadata, byte for byte as the kernel's `dm-thin-metadata.c` writes it, so
//! thin-provisioning-tools (`thin_check`, `thin_dump`, `thin_restore`) work on udm's pools.
//! `docs/thin-metadata.md` describes the format as udm uses it.

use std::sync::Arc;

use thiserror::Error;
use udm_block::{BlockDevice, BlockError};

/// Where a thin device's virtual block lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapping {
    pub data_block: u64,
    /// The mapping was made before the device's last snapshot, so another device may share
    /// the block (dm_thin_find_block's time-based answer): a write must break sharing.
    pub shared: bool,
}

/// A thin device as the details tree records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceInfo {
    pub id: u32,
    pub mapped_blocks: u64,
    pub transaction_id: u64,
    pub creation_time: u32,
    pub snapshotted_time: u32,
}

/// Used and total blocks of a space map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub used: u64,
    pub total: u64,
}

#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum ThinError {
    #[error("thin device {0} does not exist")]
    NoSuchDevice(u32),
    #[error("thin device {0} already exists")]
    DeviceExists(u32),
    #[error("pool metadata is out of space")]
    MetadataFull,
    #[error("pool metadata block {block}: {what}")]
    Corrupt { block: u64, what: String },
    #[error("pool metadata device: {0}")]
    Io(#[from] BlockError),
    #[error("{0}")]
    BadArgument(String),
}

/// The pool metadata: the details of every thin device, their mappings, and the reference
/// counts of data and metadata blocks. Not internally locked: the pool wraps it in a Mutex.
pub struct ThinMetadata {
    _dev: Arc<dyn BlockDevice>,
}

impl ThinMetadata {
    /// Opens the pool metadata on `dev`; formats a new pool when the superblock block is all
    /// zeroes (as the kernel does). Refuses a data block size that differs from the
    /// superblock's, a bad checksum, a needs_check flag (with a clear error naming
    /// thin_check/thin_repair). A data device larger than the recorded one grows the pool.
    pub fn open(
        _dev: Arc<dyn BlockDevice>,
        _data_block_sectors: u32,
        _nr_data_blocks: u64,
    ) -> Result<Self, ThinError> {
        todo!()
    }

    /// The pool's transaction id (userspace's, set by `set_transaction_id`).
    pub fn transaction_id(&self) -> u64 {
        todo!()
    }

    /// Sets the transaction id to `new` if it is `old` now.
    pub fn set_transaction_id(&mut self, _old: u64, _new: u64) -> Result<(), ThinError> {
        todo!()
    }

    /// Creates an empty thin device.
    pub fn create_thin(&mut self, _id: u32) -> Result<(), ThinError> {
        todo!()
    }

    /// Creates `id` as a snapshot of `origin` (shares the origin's mapping tree); increments
    /// the pool's time and sets snapshotted_time of both.
    pub fn create_snap(&mut self, _id: u32, _origin: u32) -> Result<(), ThinError> {
        todo!()
    }

    /// Deletes a thin device, decrementing every data block it maps.
    pub fn delete(&mut self, _id: u32) -> Result<(), ThinError> {
        todo!()
    }

    /// Every thin device, by id.
    pub fn devices(&self) -> Vec<DeviceInfo> {
        todo!()
    }

    pub fn device(&self, _id: u32) -> Option<DeviceInfo> {
        todo!()
    }

    /// Where `vblock` of device `id` lives, if it is mapped. Served from memory once warm.
    pub fn lookup(&mut self, _id: u32, _vblock: u64) -> Result<Option<Mapping>, ThinError> {
        todo!()
    }

    /// Mapped runs in `[begin, end)`: (vblock, data_block, len, shared), both block numbers
    /// consecutive within a run.
    pub fn lookup_range(
        &mut self,
        _id: u32,
        _begin: u64,
        _end: u64,
    ) -> Result<Vec<(u64, u64, u64, bool)>, ThinError> {
        todo!()
    }

    /// Allocates a free data block (reference count 1, until `insert`ed); None: data space
    /// full. Never a block that is free only since the last commit.
    pub fn alloc_data_block(&mut self) -> Result<Option<u64>, ThinError> {
        todo!()
    }

    /// Maps `vblock` of `id` to `data_block` (allocated by `alloc_data_block`, whose reference
    /// the mapping takes over); an old mapping is replaced and its block decremented.
    pub fn insert(&mut self, _id: u32, _vblock: u64, _data_block: u64) -> Result<(), ThinError> {
        todo!()
    }

    /// Unmaps `vblock` of `id`; Some(data block) if that block became free (refcount 0).
    pub fn remove(&mut self, _id: u32, _vblock: u64) -> Result<Option<u64>, ThinError> {
        todo!()
    }

    /// How many mappings (or allocations) hold `data_block`.
    pub fn data_ref_count(&mut self, _data_block: u64) -> Result<u32, ThinError> {
        todo!()
    }

    /// The highest mapped virtual block of `id`, if any.
    pub fn highest_mapped(&mut self, _id: u32) -> Result<Option<u64>, ThinError> {
        todo!()
    }

    /// Data blocks in use and in all; exact, counts uncommitted allocations.
    pub fn data_usage(&self) -> Usage {
        todo!()
    }

    /// Metadata blocks in use and in all.
    pub fn metadata_usage(&self) -> Usage {
        todo!()
    }

    /// Grows the data space to `nr_data_blocks` (shrinking is refused).
    pub fn resize_data(&mut self, _nr_data_blocks: u64) -> Result<(), ThinError> {
        todo!()
    }

    /// Takes a metadata snapshot (a copy of the superblock whose trees stay readable by
    /// `thin_dump -m` while the pool runs).
    pub fn reserve_metadata_snap(&mut self) -> Result<(), ThinError> {
        todo!()
    }

    /// Drops the metadata snapshot.
    pub fn release_metadata_snap(&mut self) -> Result<(), ThinError> {
        todo!()
    }

    /// The metadata snapshot's block, if one is held (the pool status's held root).
    pub fn held_root(&self) -> Option<u64> {
        todo!()
    }

    pub fn needs_check(&self) -> bool {
        todo!()
    }

    /// Sets the needs_check flag and commits it, so the pool is not used again until checked.
    pub fn set_needs_check(&mut self) -> Result<(), ThinError> {
        todo!()
    }

    /// Makes everything since the last commit durable (dm's two-phase commit); the caller
    /// has flushed the data device first. A crash before it returns leaves the previous commit.
    pub fn commit(&mut self) -> Result<(), ThinError> {
        todo!()
    }

    /// Drops everything since the last commit (metadata back to the committed state).
    pub fn abort(&mut self) -> Result<(), ThinError> {
        todo!()
    }
}
