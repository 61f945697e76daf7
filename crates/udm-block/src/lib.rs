//! The block layer of udm.
//!
//! Every layer of udm talks to the one below through [`BlockDevice`]: targets, the tables that
//! stack them, the backends at the bottom (files, block devices, memory) and the exports on top.
//! The trait is synchronous and object safe; concurrency comes from many threads calling it at
//! once (the model of nbdkit's thread pool), which keeps each target a plain piece of code with
//! no runtime of its own and no second, asynchronous copy of it.

pub mod batch;
mod buffer;
mod checked;
mod device;
mod error;
mod export;
mod file;
pub mod map;
mod memory;
pub mod pending;
mod pool;

pub use batch::{at_batch_end, Batch};
pub use buffer::AlignedBuf;
pub use checked::{check_request, Checked, SECTOR_SIZE};
pub use device::{
    align_extents, clamp_extents, clip_extents, flush_every, merge_extents, push_extent,
    write_zeroes_by_writing, zero_chunk, BlockDevice, Capabilities, Extent, WriteFlags, ZeroFlags,
    EXTENT_HOLE, EXTENT_ZERO,
};
pub use error::{BlockError, Result};
pub use export::{Export, ExportCatalog, MetaContext};
pub use file::{FileDevice, OpenMode};
pub use map::{
    Callbacks, Completed, Holds, MapOp, MappedFile, Mapping, OnComplete, Piece, Pieces, Place,
    MAX_MAPPED_PIECES,
};
pub use memory::MemoryDevice;
pub use pending::{Done, Pending, Ready, Transfer, TransferBuf};
pub use pool::{Job, WorkerPool};
