//! On-disk metadata of udm targets.
//!
//! Every format is made of 4 KiB blocks whose header carries a crc32c salted with the block's
//! type and its own block number ([`block`]), so a torn, misdirected or stale write is caught
//! when read. Commits never overwrite what the last durable commit points to. The exception
//! store of classic snapshots ([`snapshot`]) is the exception: it is the kernel's format, read
//! and written as the kernel does, without checksums. Each format is described byte by byte in
//! the repository's `docs/`.

pub mod block;
mod clone;
pub mod log;
mod random;
pub mod snapshot;
pub mod thin;

pub use block::{BlockType, MetadataError, BLOCK_SIZE};
pub use clone::{CloneGeometry, CloneMetadata, CommitOutcome, SuperblockFallback};
pub use thin::{DeviceInfo, Mapping, ThinError, ThinMetadata, Usage};
