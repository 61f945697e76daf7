//! Wire constants and the pure encoding/decoding functions of the NBD protocol
//! (`doc/proto.md` of the NetworkBlockDevice project). Nothing here does I/O, so the parsers
//! can be fuzzed and unit-tested on byte slices.
//!
//! One file per job: `wire` reads and writes fields in network byte order, `handshake` is
//! the option haggling before transmission (both sides), `transmission` the requests,
//! replies and structured chunks after it. This file holds the errors: the ones on the wire
//! and why a message is refused.

mod handshake;
mod transmission;
mod wire;

pub use handshake::*;
pub use transmission::*;
pub use wire::{Reader, Writer};

use thiserror::Error;

// Errors on the wire.
pub const NBD_EPERM: u32 = 1;
pub const NBD_EIO: u32 = 5;
pub const NBD_ENOMEM: u32 = 12;
pub const NBD_EINVAL: u32 = 22;
pub const NBD_ENOSPC: u32 = 28;
pub const NBD_EOVERFLOW: u32 = 75;
pub const NBD_ENOTSUP: u32 = 95;
pub const NBD_ESHUTDOWN: u32 = 108;

/// The one mapping from errno to the NBD error a client sees.
pub fn nbd_error(errno: i32) -> u32 {
    match errno {
        libc::EPERM | libc::EROFS | libc::EACCES | libc::EBADF => NBD_EPERM,
        libc::ENOMEM => NBD_ENOMEM,
        libc::EINVAL => NBD_EINVAL,
        libc::ENOSPC | libc::EDQUOT | libc::EFBIG => NBD_ENOSPC,
        libc::EOVERFLOW => NBD_EOVERFLOW,
        libc::EOPNOTSUPP | libc::ENOSYS => NBD_ENOTSUP,
        libc::ESHUTDOWN => NBD_ESHUTDOWN,
        _ => NBD_EIO,
    }
}

/// Why a byte sequence is not a valid protocol message.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ProtocolError {
    #[error("bad magic {0:#x}")]
    BadMagic(u64),
    #[error("{0} is truncated")]
    Truncated(&'static str),
    #[error("{0}")]
    Invalid(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_mapping_covers_the_protocol_errors() {
        assert_eq!(nbd_error(libc::EIO), NBD_EIO);
        assert_eq!(nbd_error(libc::EROFS), NBD_EPERM);
        assert_eq!(nbd_error(libc::EOPNOTSUPP), NBD_ENOTSUP);
        assert_eq!(nbd_error(libc::EDQUOT), NBD_ENOSPC);
        assert_eq!(nbd_error(libc::ESHUTDOWN), NBD_ESHUTDOWN);
        assert_eq!(nbd_error(libc::ENOENT), NBD_EIO);
    }
}
