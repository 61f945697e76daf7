//! One error type for the data path, and the one place that turns it into an errno.

use thiserror::Error;

/// What went wrong with a block request. Every variant maps to exactly one errno through
/// [`BlockError::errno`]; exports translate that errno into their own wire codes.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum BlockError {
    /// The operating system refused an operation on a backing file or device.
    #[error("{context}: {}", std::io::Error::from_raw_os_error(*errno))]
    Os { context: String, errno: i32 },
    /// The request itself is malformed: out of range, misaligned, too large.
    #[error("invalid request: {0}")]
    InvalidArgument(String),
    /// The device or target cannot do this kind of request at all (or not quickly, for a
    /// fast-zero request).
    #[error("not supported: {0}")]
    NotSupported(String),
    /// A write to something opened or exported read-only.
    #[error("read-only: {0}")]
    ReadOnly(String),
    /// A target failed the request on purpose or after a failure below it (error, flakey,
    /// dust, a failed copy, a metadata device in fail mode).
    #[error("I/O error: {0}")]
    Io(String),
    /// No space left for the write (a full snapshot store, a full backing file).
    #[error("no space: {0}")]
    NoSpace(String),
    /// The device is going away.
    #[error("shutting down: {0}")]
    Shutdown(String),
    /// Writes the device acknowledged were lost before anything made them durable (a remote
    /// server died with them in its cache): told to the next flush, once. Final: the request
    /// must not be retried elsewhere, since a retry that succeeds would vouch for them.
    #[error("writes lost: {0}")]
    WritesLost(String),
    /// The target hands the request back to its device, to run again once the device is
    /// resumed, on whatever table is live then: dm's DM_MAPIO_REQUEUE, for a request a
    /// multipath had queued when a `suspend --noflush` began. Only the device that is being
    /// suspended sees it; should it ever reach a client, it is an I/O error.
    #[error("pushed back to the device: {0}")]
    Requeue(String),
}

pub type Result<T, E = BlockError> = std::result::Result<T, E>;

impl BlockError {
    /// Wraps the last OS error with the operation and object it concerned.
    pub fn last_os(context: impl Into<String>) -> Self {
        Self::from_io(context, std::io::Error::last_os_error())
    }

    pub fn from_io(context: impl Into<String>, err: std::io::Error) -> Self {
        BlockError::Os {
            context: context.into(),
            errno: err.raw_os_error().unwrap_or(libc::EIO),
        }
    }

    /// A read that met the end of its file inside the device. Tables are checked against a
    /// file's size when they load, so the file shrank under the device (someone truncated it).
    pub fn past_end_of_file(path: &std::path::Path, offset: u64, len: u64) -> Self {
        BlockError::Io(format!(
            "read {} at {offset}+{len}: past the end of the file, which shrank under the \
             device (truncated since the table loaded?)",
            path.display()
        ))
    }

    /// The errno this error stands for; the single mapping used by every export.
    pub fn errno(&self) -> i32 {
        match self {
            BlockError::Os { errno, .. } => *errno,
            BlockError::InvalidArgument(_) => libc::EINVAL,
            BlockError::NotSupported(_) => libc::EOPNOTSUPP,
            BlockError::ReadOnly(_) => libc::EPERM,
            BlockError::Io(_) => libc::EIO,
            BlockError::NoSpace(_) => libc::ENOSPC,
            BlockError::Shutdown(_) => libc::ESHUTDOWN,
            BlockError::WritesLost(_) | BlockError::Requeue(_) => libc::EIO,
        }
    }

    /// Whether the request may be run again, here or down another path, in the hope that it
    /// succeeds: not when the failure reports data already gone.
    pub fn may_retry(&self) -> bool {
        !matches!(self, BlockError::WritesLost(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_its_errno() {
        let os = BlockError::from_io("pread /x", std::io::Error::from_raw_os_error(libc::ENOSPC));
        assert_eq!(os.errno(), libc::ENOSPC);
        assert!(os.to_string().starts_with("pread /x: "), "{os}");
        assert_eq!(
            BlockError::InvalidArgument(String::new()).errno(),
            libc::EINVAL
        );
        assert_eq!(
            BlockError::NotSupported(String::new()).errno(),
            libc::EOPNOTSUPP
        );
        assert_eq!(BlockError::ReadOnly(String::new()).errno(), libc::EPERM);
        assert_eq!(BlockError::Io(String::new()).errno(), libc::EIO);
        assert_eq!(BlockError::NoSpace(String::new()).errno(), libc::ENOSPC);
        assert_eq!(BlockError::Shutdown(String::new()).errno(), libc::ESHUTDOWN);
        let lost = BlockError::WritesLost(String::new());
        assert_eq!(lost.errno(), libc::EIO);
        assert!(!lost.may_retry() && BlockError::Io(String::new()).may_retry());
    }
}
