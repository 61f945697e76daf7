//! Errors of setting up and tearing down the export. Errors of single requests never leave the
//! worker that serves them: they become an errno in the reply.

use std::path::PathBuf;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum FuseError {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid FUSE configuration: {0}")]
    Config(String),
    #[error("{} is already the mount point of a FUSE filesystem whose server answers", .0.display())]
    AlreadyMounted(PathBuf),
    #[error("the FUSE server of {} does not answer; unmount it by hand (umount -l)", .0.display())]
    Unresponsive(PathBuf),
    #[error("FUSE over io_uring is unavailable: {0}")]
    IoUring(String),
}

impl FuseError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        FuseError::Io {
            context: context.into(),
            source,
        }
    }

    pub(crate) fn last_os(context: impl Into<String>) -> Self {
        Self::io(context, std::io::Error::last_os_error())
    }
}
