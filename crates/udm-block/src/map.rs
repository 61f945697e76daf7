//! Remapping, device-mapper's `map()`: a device answers "where do these bytes live" with
//! pieces on lower files, and the hot path submits those itself (through io_uring) instead
//! of calling down through every layer on a blocking thread.
//!
//! A device that can say where a request lives returns a [`Mapping`]; one that must take the
//! request itself (a partial clone write, delay, flakey, log-writes, a remote NBD source)
//! returns `None`, and the request goes through [`crate::BlockDevice`]'s synchronous methods
//! on a worker thread as before. Stacked devices compose their lower devices' mappings, so
//! `linear` over `striped` over two files maps to extents of the two files.
//!
//! Mapping is an optimisation, never a change of meaning: whatever a mapping does must be
//! what the synchronous call would have done.

use smallvec::SmallVec;
use std::any::Any;
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::pending::{Pending, Transfer};
use crate::BlockError;

/// The request being mapped. Block status and cache are never mapped. Discard and
/// write-zeroes are mapped only by devices that say so (files, and `linear`, `striped`,
/// tables and `zero` above them): other targets give them meaning of their own (a thin
/// device unmaps blocks, a clone skips hydrating regions) and return `None` for them
/// ([`MapOp::is_fill`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MapOp {
    Read,
    /// `fua`: the data must be durable when the write completes.
    Write {
        fua: bool,
    },
    /// Every completed write durable. Mapped to the files to sync (pieces of length 0).
    Flush,
    /// Deallocate the range (a hint: a file that cannot punch holes keeps its data); `fua`:
    /// durable when it completes.
    Discard {
        fua: bool,
    },
    /// Make the range read zeroes: `may_unmap`, by deallocating it; `fast_only`, fail with
    /// NotSupported rather than write zero buffers; `fua`, durable when it completes.
    WriteZeroes {
        may_unmap: bool,
        fast_only: bool,
        fua: bool,
    },
}

impl MapOp {
    /// True for operations that change data: writes, discards and write-zeroes.
    pub fn is_write(self) -> bool {
        matches!(
            self,
            MapOp::Write { .. } | MapOp::Discard { .. } | MapOp::WriteZeroes { .. }
        )
    }

    /// Discard and write-zeroes: mapped only by devices that say so (see [`MapOp`]).
    pub fn is_fill(self) -> bool {
        matches!(self, MapOp::Discard { .. } | MapOp::WriteZeroes { .. })
    }

    /// The request must be durable when it completes.
    pub fn fua(self) -> bool {
        match self {
            MapOp::Write { fua } | MapOp::Discard { fua } | MapOp::WriteZeroes { fua, .. } => fua,
            MapOp::Read | MapOp::Flush => false,
        }
    }
}

/// The descriptors of a file or block device backend, shared by the backend and the
/// mappings it hands out (which may outlive a table reload).
pub struct MappedFile {
    path: PathBuf,
    /// O_DIRECT, when the filesystem accepts it.
    direct: Option<File>,
    /// For requests whose alignment O_DIRECT refuses, and for syncs.
    buffered: File,
}

impl MappedFile {
    pub fn new(path: PathBuf, direct: Option<File>, buffered: File) -> Self {
        MappedFile {
            path,
            direct,
            buffered,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's length now, which is not the device's size if someone truncated the file.
    pub fn current_len(&self) -> std::io::Result<u64> {
        self.buffered.metadata().map(|m| m.len())
    }

    /// The descriptor for data: O_DIRECT when there is one.
    pub fn data_fd(&self) -> RawFd {
        self.direct.as_ref().unwrap_or(&self.buffered).as_raw_fd()
    }

    /// The buffered descriptor: the retry for an alignment O_DIRECT refused (EINVAL), and
    /// the one to sync (fdatasync covers writes through either).
    pub fn buffered_fd(&self) -> RawFd {
        self.buffered.as_raw_fd()
    }

    pub fn is_direct(&self) -> bool {
        self.direct.is_some()
    }
}

/// Where one run of a request's bytes lives.
#[derive(Clone)]
pub enum Place {
    /// On a file, from `offset` on.
    File { file: Arc<MappedFile>, offset: u64 },
    /// Nowhere: reads give zeroes, writes are dropped (the `zero` target).
    Zero,
}

/// One run of a request: `len` bytes starting `at` bytes into the request's buffer.
/// A flush's pieces have length 0 and name the files to sync.
#[derive(Clone)]
pub struct Piece {
    pub at: u64,
    pub len: u64,
    pub place: Place,
}

/// How a mapped request went, as its [`Mapping::on_complete`] callbacks are told.
#[derive(Debug, Clone, Copy)]
pub enum Completed<'a> {
    Ok,
    /// Failed: the request's outcome.
    Failed(&'a BlockError),
    /// Failed, and the request runs again the synchronous way ([`Mapping::retry_on_error`]):
    /// the retry's outcome is the request's, and the retry counts itself.
    Retried(&'a BlockError),
}

/// Told, when a mapped request completes, how it went (a device's I/O statistics, a
/// multipath's path failure).
pub type OnComplete = Box<dyn FnOnce(Completed<'_>) + Send>;

/// A mapping's pieces: inline for two, as most requests land in one place (a stripe
/// boundary or a thin block boundary makes two); more spill to the heap.
pub type Pieces = SmallVec<[Piece; 2]>;
/// The most pieces a mapping may have: one per sector of the largest NBD request (32 MiB).
/// Devices that add pieces in a loop (tables, stripes) stop past it and let the request go
/// the synchronous way: a discard or write-zeroes has no payload to bound it, and over
/// stacked fragmented tables every level multiplies the pieces. Well below the 2^20 pieces
/// per request the io_uring engine can address.
pub const MAX_MAPPED_PIECES: usize = 65536;
/// A mapping's holds.
pub type Holds = SmallVec<[Box<dyn Any + Send>; 4]>;
/// A mapping's completion callbacks.
pub type Callbacks = SmallVec<[OnComplete; 4]>;

/// Where a whole request lives, and what must be held until every piece has completed.
///
/// Every mapped request builds one, and stacked devices add to it: its lists keep their
/// first few entries inline (a device's gate hold and statistics callback, a multipath's
/// path load and path-failure callback), so mapping a request allocates only what the
/// entries themselves box.
#[derive(Default)]
pub struct Mapping {
    pub pieces: Pieces,
    /// Dropped when the request completes: a device's place in its suspend gate, so that
    /// suspend waits for mapped I/O as it waits for synchronous I/O.
    pub holds: Holds,
    /// Called by whoever executes the mapping once the request has completed, before the
    /// holds are released. A mapping dropped unused (a probe, a request that went the
    /// synchronous way after all) calls none of them.
    pub on_complete: Callbacks,
    /// Steps the pieces wait for (a timer, a copy into a snapshot), started by the executor
    /// through [`Mapping::when_ready`]; see [`crate::pending`].
    pub waits: Vec<Pending>,
    /// Runs of the request the device moves itself, not through files (a remote export's
    /// client sends them and its reader completes them), started by the executor with the
    /// request's buffer through [`Mapping::when_ready_with`] once the steps are done; see
    /// [`crate::pending`].
    pub transfers: Vec<Transfer>,
    /// A failure is not final: whoever executes the mapping runs the request again through
    /// the device's synchronous method (after telling the callbacks [`Completed::Retried`] and
    /// releasing the holds), where the device chooses again: a multipath, whose callback has
    /// failed the path, sends it down another or waits for one. Without this, the error of a
    /// piece is the request's; so is an error that may not be retried
    /// ([`BlockError::may_retry`]: writes lost), with or without it.
    pub retry_on_error: bool,
}

impl Mapping {
    pub fn new() -> Self {
        Mapping::default()
    }

    /// A mapping of `len` bytes to one place.
    pub fn single(len: u64, place: Place) -> Self {
        Mapping {
            pieces: smallvec::smallvec![Piece { at: 0, len, place }],
            ..Mapping::default()
        }
    }

    /// Adds a lower device's mapping of the run that starts `at` bytes into this request.
    pub fn append(&mut self, at: u64, lower: Mapping) {
        self.pieces
            .extend(lower.pieces.into_iter().map(|piece| Piece {
                at: piece.at + at,
                ..piece
            }));
        self.holds.extend(lower.holds);
        self.on_complete.extend(lower.on_complete);
        self.waits.extend(lower.waits);
        self.transfers
            .extend(lower.transfers.into_iter().map(|t| t.shifted(at)));
        self.retry_on_error |= lower.retry_on_error;
    }

    pub fn hold(mut self, hold: impl Any + Send) -> Self {
        self.holds.push(Box::new(hold));
        self
    }

    /// Adds a callback told how the request went (see [`Mapping::on_complete`]).
    pub fn when_complete(mut self, callback: impl FnOnce(Completed<'_>) + Send + 'static) -> Self {
        self.on_complete.push(Box::new(callback));
        self
    }

    /// Asks for a synchronous retry when the request fails (see [`Mapping::retry_on_error`]).
    pub fn retried_on_error(mut self) -> Self {
        self.retry_on_error = true;
        self
    }

    /// Bytes covered by the pieces (0 for a flush).
    pub fn len(&self) -> u64 {
        self.pieces.iter().map(|p| p.len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// Past [`MAX_MAPPED_PIECES`]: the request should go the synchronous way.
    pub fn is_too_large(&self) -> bool {
        self.pieces.len() > MAX_MAPPED_PIECES
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appending_shifts_the_lower_pieces_into_the_request() {
        let mut whole = Mapping::new();
        whole.append(0, Mapping::single(4096, Place::Zero));
        whole.append(4096, Mapping::single(512, Place::Zero).hold(7u32));
        let ats: Vec<_> = whole.pieces.iter().map(|p| (p.at, p.len)).collect();
        assert_eq!(ats, vec![(0, 4096), (4096, 512)]);
        assert_eq!(whole.len(), 4608);
        assert_eq!(whole.holds.len(), 1);
    }

    #[test]
    fn appending_keeps_the_lower_steps() {
        let mut whole = Mapping::new();
        whole.append(
            0,
            Mapping::single(512, Place::Zero).after(Pending::new(drop)),
        );
        assert!(!whole.is_ready());
    }

    #[test]
    fn appending_keeps_the_lower_completion_callbacks() {
        let told = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let record = |tag: u32| {
            let told = told.clone();
            move |done: Completed| told.lock().push((tag, matches!(done, Completed::Ok)))
        };
        let mut whole = Mapping::new().when_complete(record(1));
        whole.append(
            0,
            Mapping::single(512, Place::Zero).when_complete(record(2)),
        );
        for callback in whole.on_complete {
            callback(Completed::Ok);
        }
        assert_eq!(*told.lock(), [(1, true), (2, true)]);
    }

    #[test]
    fn a_lower_mapping_that_asks_for_a_retry_makes_the_whole_request_ask() {
        let mut whole = Mapping::single(512, Place::Zero);
        assert!(!whole.retry_on_error);
        whole.append(512, Mapping::single(512, Place::Zero).retried_on_error());
        whole.append(1024, Mapping::single(512, Place::Zero));
        assert!(whole.retry_on_error);
    }
}
