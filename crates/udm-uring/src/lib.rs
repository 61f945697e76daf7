//! The io_uring engine: executes remapped requests ([`udm_block::Mapping`]) on files and
//! block devices.
//!
//! The engine owns no ring. An event loop (the NBD server's, a FUSE queue's) owns its ring and
//! other work on it (sockets, /dev/fuse commands); it hands a mapped request to
//! [`Engine::start`], which turns every piece into a submission entry, and gives back each
//! completion whose `user_data` [`is_engine`] recognises to [`Engine::complete`], which says
//! when the last piece of a request is done and how it went. So one ring, and one wait, serve
//! the loop's sockets and its disk I/O together.
//!
//! What the engine does per operation (the same as [`udm_block::FileDevice`]'s synchronous
//! path, so a request means the same whichever way it goes):
//! - reads and writes on the O_DIRECT descriptor, again on the buffered one when O_DIRECT
//!   refuses the alignment (EINVAL); short transfers are resubmitted for the rest; a read
//!   past the end of a file that shrank reads zeroes;
//! - FUA writes with RWF_DSYNC;
//! - FLUSH as an fdatasync of every file the device maps to;
//! - discard as fallocate(PUNCH_HOLE), done when the file cannot (a discard is a hint);
//! - write-zeroes as fallocate(PUNCH_HOLE) when it may unmap, then ZERO_RANGE, then by
//!   writing zero buffers (or NotSupported when only a fast way will do), each tried when
//!   the one before is unsupported; with FUA, either is followed by an fdatasync of the file;
//! - zero pieces are filled (reads) or dropped (writes) without a submission.

use std::os::fd::AsRawFd;
use std::sync::Arc;

use io_uring::{cqueue, opcode, squeue, types, IoUring};
use smallvec::SmallVec;
use udm_block::{
    zero_chunk, BlockError, Callbacks, Completed, Holds, MapOp, MappedFile, Mapping, Pieces, Place,
};

mod limit;
mod runner;
pub use limit::InFlightLimit;
pub use runner::{Runner, Then};

/// Set in the `user_data` of every entry the engine submits; the ring's owner keeps it clear
/// in its own.
pub const ENGINE_TAG: u64 = 1 << 63;
const PIECE_BITS: u32 = 20;
const PIECE_MASK: u64 = (1 << PIECE_BITS) - 1;
/// The largest transfer one entry asks for; longer pieces continue as short transfers do.
const MAX_TRANSFER: u64 = 1 << 30;

/// True for completions of entries the engine submitted.
pub fn is_engine(user_data: u64) -> bool {
    user_data & ENGINE_TAG != 0
}

/// Pushes entries from the front of `entries` into `ring`'s submission queue until it is
/// full; returns how many went in. Every ring owner (the NBD loop, a FUSE queue, the runner)
/// keeps a backlog longer than its queue can take at once and drains it this way.
///
/// # Safety
///
/// Each entry's buffers must stay valid until its completion is handled.
pub unsafe fn push_some<S: squeue::EntryMarker, C: cqueue::EntryMarker>(
    ring: &mut IoUring<S, C>,
    entries: &[S],
) -> usize {
    let mut sq = ring.submission();
    let mut pushed = 0;
    for entry in entries {
        // SAFETY: the caller keeps the entry's buffers valid until its completion.
        if unsafe { sq.push(entry) }.is_err() {
            break;
        }
        pushed += 1;
    }
    pushed
}

/// An entry that reads an eventfd's 8-byte count into `into`: how a ring owner's thread is
/// woken from its wait when other threads hand it work. `into` must stay put until the
/// completion (a boxed value the owner keeps).
pub fn eventfd_read(fd: &impl AsRawFd, into: &mut u64, user_data: u64) -> squeue::Entry {
    let into: *mut u64 = into;
    opcode::Read::new(types::Fd(fd.as_raw_fd()), into.cast(), 8)
        .build()
        .user_data(user_data)
}

/// Whether io_uring can be used here; the error is one line naming why not (disabled by
/// sysctl, refused by a seccomp filter, an old kernel).
pub fn probe() -> Result<(), String> {
    let disabled = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(0);
    match io_uring::IoUring::new(2) {
        Ok(_) => Ok(()),
        Err(e) if disabled != 0 => Err(format!(
            "io_uring is disabled (kernel.io_uring_disabled = {disabled}): {e}"
        )),
        Err(e) => Err(format!("io_uring is unavailable: {e}")),
    }
}

/// One piece of a request in flight on a file.
struct FilePiece {
    at: u64,
    len: u64,
    /// Bytes already transferred (short transfers continue from here).
    done: u64,
    file: Arc<MappedFile>,
    offset: u64,
    /// O_DIRECT refused this piece's alignment: it goes through the buffered descriptor.
    buffered: bool,
    /// How a discard or write-zeroes piece is being done.
    fill: Fill,
    finished: bool,
}

/// The ways of zeroing or deallocating a piece, in the order they are tried.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Fill {
    Punch,
    ZeroRange,
    /// Writing zero buffers: the slow way, when the file can neither punch nor zero.
    Write,
    /// Done, and FUA: syncing the file.
    Sync,
}

impl Fill {
    fn first(op: MapOp) -> Fill {
        match op {
            MapOp::WriteZeroes {
                may_unmap: false, ..
            } => Fill::ZeroRange,
            _ => Fill::Punch,
        }
    }
}

fn is_unsupported(errno: i32) -> bool {
    matches!(errno, libc::EOPNOTSUPP | libc::ENOSYS | libc::EINVAL)
}

struct Request {
    op: MapOp,
    buf: *mut u8,
    pieces: FilePieces,
    remaining: usize,
    error: Option<BlockError>,
    owner: u64,
    /// Told the outcome when the request completes (the device's I/O statistics).
    on_complete: Callbacks,
    /// A failure goes back to the owner as [`Outcome::Retry`].
    retry_on_error: bool,
    /// Released (the suspend gate, a clone's user I/O count) when the request completes.
    holds: Holds,
}

/// A request's pieces on files, inline for two as the mapping's are.
type FilePieces = SmallVec<[FilePiece; 2]>;

/// The requests one ring has in flight.
#[derive(Default)]
pub struct Engine {
    requests: Vec<Option<Request>>,
    free: Vec<usize>,
}

/// How a request the engine ran ended.
#[derive(Debug)]
pub enum Outcome {
    Done(Result<(), BlockError>),
    /// It failed, and its mapping asked for a retry ([`Mapping::retry_on_error`]): the owner
    /// runs the request again through the device's synchronous method, whose result is the
    /// request's.
    Retry,
}

/// What finished: the `owner` given to [`Engine::start`] and how.
pub type Completion = (u64, Outcome);

impl Engine {
    pub fn new() -> Self {
        Engine::default()
    }

    /// Requests started and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.requests.len() - self.free.len()
    }

    /// Starts `mapping` for a request of `op`, with the request's data at `buf` (read into,
    /// or written from). Entries go to `push`; the request's completion comes out of
    /// [`Engine::complete`] tagged `owner`, unless it needs no I/O at all (zero pieces, a
    /// flush of nothing), when it is returned here at once.
    ///
    /// # Safety
    /// `buf` must be valid for the mapping's length (reads write into it) and stay valid and
    /// untouched until the request completes; for O_DIRECT it should be page-aligned.
    pub unsafe fn start(
        &mut self,
        op: MapOp,
        mapping: Mapping,
        buf: *mut u8,
        owner: u64,
        push: &mut dyn FnMut(squeue::Entry),
    ) -> Option<Result<(), BlockError>> {
        if !mapping.is_ready() {
            // Its pieces must not run before its steps: the caller owed when_ready().
            return Some(Err(BlockError::Io(
                "a mapping was submitted before the steps it waits for".into(),
            )));
        }
        // SAFETY: as the caller promised, `buf` holds the mapping's length.
        let pieces = unsafe { file_pieces(op, mapping.pieces, buf) };
        if pieces.is_empty() {
            mapping
                .on_complete
                .into_iter()
                .for_each(|told| told(Completed::Ok));
            return Some(Ok(()));
        }
        let request = Request {
            op,
            buf,
            remaining: pieces.len(),
            pieces,
            error: None,
            owner,
            on_complete: mapping.on_complete,
            retry_on_error: mapping.retry_on_error,
            holds: mapping.holds,
        };
        let slot = self.store(request);
        let request = self.requests[slot].as_ref().expect("just stored");
        for index in 0..request.pieces.len() {
            push(entry(request, slot, index));
        }
        None
    }

    /// Keeps `request` in a free slot (or a new one); its slot number.
    fn store(&mut self, request: Request) -> usize {
        match self.free.pop() {
            Some(slot) => {
                self.requests[slot] = Some(request);
                slot
            }
            None => {
                self.requests.push(Some(request));
                self.requests.len() - 1
            }
        }
    }

    /// Takes the completion of an engine entry (`is_engine(user_data)`) with its result;
    /// returns the request's outcome once its last piece is done. Pieces to continue are
    /// resubmitted through `push`.
    pub fn complete(
        &mut self,
        user_data: u64,
        result: i32,
        push: &mut dyn FnMut(squeue::Entry),
    ) -> Option<Completion> {
        let slot = ((user_data & !ENGINE_TAG) >> PIECE_BITS) as usize;
        let index = (user_data & PIECE_MASK) as usize;
        let request = self.requests.get_mut(slot)?.as_mut()?;
        let op = request.op;
        let piece = request.pieces.get_mut(index)?;
        if piece.finished {
            return None;
        }
        match advance(op, piece, result) {
            Step::Again => {
                push(entry(request, slot, index));
                return None;
            }
            Step::Done => {}
            Step::Failed(errno) => {
                let error = piece_error(op, piece, errno);
                request.error.get_or_insert(error);
            }
            Step::PastEnd => {
                let error =
                    BlockError::past_end_of_file(piece.file.path(), piece.offset, piece.len);
                request.error.get_or_insert(error);
            }
        }
        request.pieces[index].finished = true;
        request.remaining -= 1;
        if request.remaining > 0 {
            return None;
        }
        let request = self.requests[slot].take().expect("present");
        self.free.push(slot);
        let owner = request.owner;
        let outcome = match &request.error {
            None => Completed::Ok,
            Some(e) if request.retry_on_error && e.may_retry() => Completed::Retried(e),
            Some(e) => Completed::Failed(e),
        };
        let retry = matches!(outcome, Completed::Retried(_));
        request
            .on_complete
            .into_iter()
            .for_each(|told| told(outcome));
        // The holds go (with the request) before the retry starts, as the callbacks said.
        drop(request.holds);
        Some(if retry {
            (owner, Outcome::Retry)
        } else {
            (owner, Outcome::Done(request.error.map_or(Ok(()), Err)))
        })
    }
}

enum Step {
    /// Submit the piece (again) for what is left.
    Again,
    Done,
    Failed(i32),
    /// A read met the end of its file: the file shrank under the device.
    PastEnd,
}
/// The pieces of a mapping that are file I/O, one sync per file for a flush; a read's zero
/// pieces are zeroed in `buf` here.
///
/// # Safety
/// `buf` must be valid for writes over every zero piece of a read.
unsafe fn file_pieces(op: MapOp, mapping_pieces: Pieces, buf: *mut u8) -> FilePieces {
    let mut pieces = FilePieces::with_capacity(mapping_pieces.len());
    for piece in mapping_pieces {
        match piece.place {
            Place::Zero => {
                if op == MapOp::Read {
                    // SAFETY: the piece lies within the request's buffer.
                    unsafe {
                        std::ptr::write_bytes(buf.add(piece.at as usize), 0, piece.len as usize)
                    };
                }
            }
            Place::File { file, offset } => {
                // One sync per file, however many pieces name it.
                if op == MapOp::Flush
                    && pieces
                        .iter()
                        .any(|p: &FilePiece| Arc::ptr_eq(&p.file, &file))
                {
                    continue;
                }
                pieces.push(FilePiece {
                    at: piece.at,
                    len: piece.len,
                    done: 0,
                    file,
                    offset,
                    buffered: false,
                    fill: Fill::first(op),
                    finished: false,
                });
            }
        }
    }
    pieces
}

/// Accounts one completion of a piece.
fn advance(op: MapOp, piece: &mut FilePiece, result: i32) -> Step {
    if !op.is_fill() {
        return advance_transfer(op, piece, result);
    }
    let step = match piece.fill {
        Fill::Write => advance_transfer(op, piece, result),
        Fill::Sync if result < 0 && matches!(-result, libc::EINTR | libc::EAGAIN) => Step::Again,
        Fill::Sync if result < 0 => Step::Failed(-result),
        Fill::Sync => return Step::Done,
        Fill::Punch | Fill::ZeroRange => advance_fallocate(op, piece, result),
    };
    // A FUA discard or write-zeroes is durable when it completes, as the synchronous way's
    // flush after it makes it.
    if matches!(step, Step::Done) && op.fua() {
        piece.fill = Fill::Sync;
        return Step::Again;
    }
    step
}

/// Accounts one completion of a read or write (or of writing zeroes).
fn advance_transfer(op: MapOp, piece: &mut FilePiece, result: i32) -> Step {
    if result < 0 {
        let errno = -result;
        return match errno {
            libc::EINTR | libc::EAGAIN => Step::Again,
            libc::EINVAL if !piece.buffered && piece.file.is_direct() && op != MapOp::Flush => {
                piece.buffered = true;
                Step::Again
            }
            _ => Step::Failed(errno),
        };
    }
    if op == MapOp::Flush {
        return Step::Done;
    }
    let n = result as u64;
    if n == 0 {
        // The table was checked against the file's size when it loaded, so a read that finds
        // the end inside the device means the file shrank under it. That fails, as the
        // kernel's I/O past a shrunk device does: zeroes would be data nobody wrote, and a
        // clone would copy them as hydrated.
        return if op == MapOp::Read {
            Step::PastEnd
        } else {
            Step::Failed(libc::EIO)
        };
    }
    piece.done += n;
    if piece.done < piece.len {
        Step::Again
    } else {
        Step::Done
    }
}

/// Accounts the completion of a fallocate: done, or the next way to try.
fn advance_fallocate(op: MapOp, piece: &mut FilePiece, result: i32) -> Step {
    let errno = -result;
    if result >= 0 {
        return Step::Done;
    }
    if matches!(errno, libc::EINTR | libc::EAGAIN) {
        return Step::Again;
    }
    if !is_unsupported(errno) {
        return Step::Failed(errno);
    }
    match (op, piece.fill) {
        // A discard is a hint: a file that cannot punch holes keeps its data.
        (MapOp::Discard { .. }, _) => Step::Done,
        (_, Fill::Punch) => {
            piece.fill = Fill::ZeroRange;
            Step::Again
        }
        (
            MapOp::WriteZeroes {
                fast_only: true, ..
            },
            _,
        ) => Step::Failed(libc::EOPNOTSUPP),
        _ => {
            piece.fill = Fill::Write;
            Step::Again
        }
    }
}

fn piece_error(op: MapOp, piece: &FilePiece, errno: i32) -> BlockError {
    if matches!(
        op,
        MapOp::WriteZeroes {
            fast_only: true,
            ..
        }
    ) && errno == libc::EOPNOTSUPP
    {
        // What the synchronous way answers (write_zeroes_by_writing).
        return BlockError::NotSupported("this device cannot zero quickly".into());
    }
    let what = match op {
        MapOp::Read => "read",
        MapOp::Write { .. } => "write",
        MapOp::Flush => "fdatasync",
        MapOp::Discard { .. } => "discard",
        MapOp::WriteZeroes { .. } => "write_zeroes",
    };
    let context = if op == MapOp::Flush {
        format!("{what} {}", piece.file.path().display())
    } else {
        format!(
            "{what} {} at {}+{}",
            piece.file.path().display(),
            piece.offset,
            piece.len
        )
    };
    BlockError::Os { context, errno }
}

/// The submission entry for what is left of one piece.
fn entry(request: &Request, slot: usize, index: usize) -> squeue::Entry {
    let piece = &request.pieces[index];
    let user_data = ENGINE_TAG | (slot as u64) << PIECE_BITS | index as u64;
    let fd = types::Fd(if piece.buffered {
        piece.file.buffered_fd()
    } else {
        piece.file.data_fd()
    });
    let len = (piece.len - piece.done).min(MAX_TRANSFER) as u32;
    let offset = piece.offset + piece.done;
    // A discard or write-zeroes has no buffer: only reads and writes point into it.
    // SAFETY (of the pointer arithmetic): the piece lies within the request's buffer.
    let data = || unsafe { request.buf.add((piece.at + piece.done) as usize) };
    let keep_size = libc::FALLOC_FL_KEEP_SIZE;
    let entry = match (request.op, piece.fill) {
        (MapOp::Read, _) => opcode::Read::new(fd, data(), len).offset(offset).build(),
        (MapOp::Write { fua }, _) => opcode::Write::new(fd, data(), len)
            .offset(offset)
            .rw_flags(if fua { libc::RWF_DSYNC } else { 0 })
            .build(),
        (MapOp::Flush, _) => opcode::Fsync::new(types::Fd(piece.file.buffered_fd()))
            .flags(types::FsyncFlags::DATASYNC)
            .build(),
        (_, Fill::Punch) => opcode::Fallocate::new(fd, piece.len)
            .offset(piece.offset)
            .mode(libc::FALLOC_FL_PUNCH_HOLE | keep_size)
            .build(),
        (_, Fill::ZeroRange) => opcode::Fallocate::new(fd, piece.len)
            .offset(piece.offset)
            .mode(libc::FALLOC_FL_ZERO_RANGE | keep_size)
            .build(),
        (_, Fill::Sync) => opcode::Fsync::new(types::Fd(piece.file.buffered_fd()))
            .flags(types::FsyncFlags::DATASYNC)
            .build(),
        (_, Fill::Write) => {
            let zeroes = zero_chunk();
            let len = (piece.len - piece.done).min(zeroes.len() as u64) as u32;
            opcode::Write::new(fd, zeroes.as_ptr().cast_mut(), len)
                .offset(offset)
                .build()
        }
    };
    entry.user_data(user_data)
}

#[cfg(test)]
mod tests;
