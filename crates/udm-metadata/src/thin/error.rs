//! What can go wrong with pool metadata.

use thiserror::Error;
use udm_block::BlockError;

#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum ThinError {
    #[error("thin device {0} does not exist")]
    NoSuchDevice(u32),
    #[error("thin device {0} already exists")]
    DeviceExists(u32),
    /// No free metadata block is left for this operation (the blocks kept back for a commit
    /// excepted): the pool must go read-only.
    #[error("pool metadata is out of space")]
    MetadataFull,
    #[error("pool metadata block {block}: {what}")]
    Corrupt { block: u64, what: String },
    /// The superblock's needs_check flag is set: the kernel or udm found an error before.
    #[error(
        "pool metadata needs checking (the needs_check flag is set): run thin_check \
         (thin_repair if it finds damage), then thin_check --clear-needs-check-flag"
    )]
    NeedsCheck,
    /// An operation failed half way and left the in-memory transaction inconsistent: only
    /// `abort` (back to the last commit) is allowed until then.
    #[error("pool metadata transaction failed earlier ({0}); abort it before going on")]
    Aborting(String),
    #[error("pool metadata device: {0}")]
    Io(#[from] BlockError),
    #[error("{0}")]
    BadArgument(String),
}

pub type Result<T, E = ThinError> = std::result::Result<T, E>;

/// Shorthand for the error of a damaged block.
pub fn corrupt(block: u64, what: impl Into<String>) -> ThinError {
    ThinError::Corrupt {
        block,
        what: what.into(),
    }
}
