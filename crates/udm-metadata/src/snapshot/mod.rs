//! The exception stores of classic snapshots (the kernel's dm-snapshot): which origin chunks
//! a snapshot has saved, and where on its COW device.
//!
//! - [`PersistentStore`] (`P`, `PO`): the kernel's on-disk layout exactly ([`layout`],
//!   `docs/snapshot-metadata.md`), so a COW device udm wrote is one the kernel reads and the
//!   other way round. Exceptions are committed in batches: every exception submitted while a
//!   commit is being written goes into the next one, which costs one FUA write of the area
//!   however many exceptions it holds.
//! - [`TransientStore`] (`N`): allocation only; the table lives in memory and is gone after a
//!   restart.
//!
//! A store knows nothing of origins or I/O to them: the snapshot targets copy the data, then
//! submit the records describing it, and only use an exception once its commit has returned.

pub mod layout;
mod persistent;
mod transient;

use thiserror::Error;
use udm_block::BlockError;

pub use layout::{Geometry, Header, Record};
pub use persistent::PersistentStore;
pub use transient::TransientStore;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum StoreError {
    /// No room for another exception.
    #[error("the COW device is full")]
    Full,
    #[error("COW device: {0}")]
    Io(#[from] BlockError),
    #[error("COW device: {0}")]
    Corrupt(String),
    #[error("COW device too small: {0}")]
    TooSmall(String),
    /// The store was invalidated (full or failed) and takes no more exceptions.
    #[error("the snapshot is invalid")]
    Invalid,
    #[error("{0}")]
    Unsupported(String),
}

/// The status line's numbers, in sectors, as the kernel reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Chunks handed out, metadata included.
    pub allocated: u64,
    pub total: u64,
    /// The header and the metadata areas up to the current one.
    pub metadata: u64,
}

/// How well commits were batched, for `udm status --json` and the benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommitStats {
    pub commits: u64,
    pub records: u64,
}

/// Told how a commit went (see [`ExceptionStore::when_durable`]).
pub type Durable = Box<dyn FnOnce(Result<(), StoreError>) + Send>;

/// What both kinds of store do. Records submitted to a persistent store must describe data
/// already durable on the COW device (written with FUA); [`ExceptionStore::wait`] returns
/// once the records are durable too (at once for a transient store).
pub trait ExceptionStore: Send + Sync {
    fn chunk_sectors(&self) -> u64;

    /// A COW chunk for a new exception.
    fn allocate(&self) -> Result<u64, StoreError>;

    /// Queues records for the next commit; the ticket is for [`ExceptionStore::wait`].
    fn submit(&self, records: &[Record]) -> Result<u64, StoreError>;

    /// Waits until the commit holding `ticket` is durable.
    fn wait(&self, ticket: u64) -> Result<(), StoreError>;

    /// Calls `then` with what [`ExceptionStore::wait`] would return, once it would return,
    /// without a thread waiting meanwhile where the store can: on the thread that finished the
    /// commit (it must be quick), or on this one if the commit is already done.
    fn when_durable(&self, ticket: u64, then: Durable) {
        then(self.wait(ticket))
    }

    /// Marks the store invalid, durably where it is persistent, and refuses new records.
    fn invalidate(&self) -> Result<(), StoreError>;

    fn usage(&self) -> Usage;

    fn stats(&self) -> CommitStats {
        CommitStats::default()
    }

    /// The records a merge copies back next: the last `max` of the table (the merge runs
    /// from its end backwards).
    fn merge_batch(&self, _max: usize) -> Result<Vec<Record>, StoreError> {
        Err(StoreError::Unsupported(
            "only a persistent store can be merged".into(),
        ))
    }

    /// Drops the last `n` records durably, once their data is back on the origin.
    fn commit_merge(&self, _n: usize) -> Result<(), StoreError> {
        Err(StoreError::Unsupported(
            "only a persistent store can be merged".into(),
        ))
    }
}
