//! The FUSE export of udm: every device of the catalog as a regular file `MOUNTPOINT/NAME`,
//! so that `losetup --direct-io=on -f --show MOUNTPOINT/NAME` turns it into a kernel block
//! device (for mkfs, mount, anything that needs a /dev node) on hosts without the nbd module.
//!
//! The protocol is spoken directly over /dev/fuse, without libfuse: udm decides the threads
//! (a fixed pool, each with its own descriptor and buffers allocated once, so serving a write
//! never allocates), the request size (1 MiB reads and writes arrive whole) and the file flags
//! (direct I/O, parallel writes) that make a loop device on the file behave like one on a disk.
//! Every request goes through `udm_block::Checked`, like the NBD export's.

mod abi;
mod dispatch;
mod error;
mod export;
mod fs;
mod mount;
mod session;
mod uring;
mod worker;

pub use error::FuseError;
pub use export::{FuseConfig, FuseExport, Transport, UringMode};
pub use mount::{is_udm_mount, recover_stale_mount, set_io_flusher};
pub use uring::enable_kernel_support;
