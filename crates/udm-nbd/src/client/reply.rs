//! The reply reader's side of a connection (see `poller`): tells how long each reply (simple,
//! or a structured chunk) is, then reads it from the reader's buffer, finds the slot waiting
//! for its cookie, copies read data into the caller's buffer, records errors and extents,
//! and wakes the caller. Any protocol violation, or ESHUTDOWN, ends the connection.

use std::io::{self, Read};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use thiserror::Error;
use udm_block::{BlockError, Extent, EXTENT_HOLE, EXTENT_ZERO};

use super::connection::{settle, Conn, Covered, Dest, Outcome, Slot};
use super::reconnect::take_writes_lost;
use crate::protocol::*;

/// Block status and error chunks are buffered; a sane one is far smaller.
const MAX_CHUNK_PAYLOAD: u32 = 16 << 20;
/// The most separate pieces a read's reply may be in, while it comes (see `cover`): servers
/// send a read's chunks in order, each joining the last, so a reply is most often one.
const MAX_PIECES: usize = 1024;

/// How a connection ended, from the reader's side.
#[derive(Debug, Error)]
pub(super) enum ReplyError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("protocol error: {0}")]
    Protocol(String),
    /// NBD_ESHUTDOWN: the server is going away and will not serve this connection again. It
    /// may wait for us to hang up before it exits, so we do, and redial.
    #[error("the server is shutting down")]
    ShuttingDown,
}

impl From<ProtocolError> for ReplyError {
    fn from(e: ProtocolError) -> Self {
        ReplyError::Protocol(e.to_string())
    }
}

/// The reply (simple, or one structured chunk) at the start of what the reader received:
/// `head` bytes, then `data` bytes of a read's data (0 for any other), under `cookie`.
pub(super) struct Frame {
    pub(super) head: usize,
    pub(super) data: usize,
    pub(super) cookie: u64,
}

/// How long the reply at the start of `received` is, as far as it tells: while its header is
/// not whole, `head` is that header's length and `cookie` 0. The reader hands the reply to
/// [`read_reply`] once it is all in, or once its head is for a big read (see [`Direct`]).
pub(super) fn frame(conn: &Conn, received: &[u8]) -> Result<Frame, ReplyError> {
    let header_only = |head| Frame {
        head,
        data: 0,
        cookie: 0,
    };
    if received.len() < SIMPLE_REPLY_LEN {
        return Ok(header_only(SIMPLE_REPLY_LEN));
    }
    let magic = u32::from_be_bytes(received[..4].try_into().unwrap());
    if magic == SIMPLE_REPLY_MAGIC {
        let reply = parse_simple_reply(received[..SIMPLE_REPLY_LEN].try_into().unwrap())?;
        // Only a successful read carries data, and only without structured replies (one with
        // it after is a protocol error, which `read_reply` reports).
        let data = match conn.slot(reply.cookie) {
            Some(slot) if reply.error == 0 && slot.command == CMD_READ && !conn.info.structured => {
                slot.len as usize
            }
            _ => 0,
        };
        return Ok(Frame {
            head: SIMPLE_REPLY_LEN,
            data,
            cookie: reply.cookie,
        });
    }
    // `read_reply` reports a bad magic.
    if magic != STRUCTURED_REPLY_MAGIC {
        return Ok(header_only(SIMPLE_REPLY_LEN));
    }
    if received.len() < CHUNK_HEADER_LEN {
        return Ok(header_only(CHUNK_HEADER_LEN));
    }
    let chunk = parse_chunk_header(received[..CHUNK_HEADER_LEN].try_into().unwrap())?;
    // The largest a sane chunk gets: a read's data and its offset.
    if chunk.length > MAX_CHUNK_PAYLOAD.max(super::MAX_REQUEST + 8) {
        return Err(ReplyError::Protocol(format!(
            "chunk payload of {} bytes",
            chunk.length
        )));
    }
    let length = chunk.length as usize;
    Ok(match chunk.kind {
        CHUNK_OFFSET_DATA if length >= 8 => Frame {
            head: CHUNK_HEADER_LEN + 8,
            data: length - 8,
            cookie: chunk.cookie,
        },
        _ => Frame {
            head: CHUNK_HEADER_LEN + length,
            data: 0,
            cookie: chunk.cookie,
        },
    })
}

/// Reads one simple reply or structured chunk and delivers it to the request in flight it
/// answers; with `direct`, a read's data is left to come (see [`Direct`]), `r` ending before
/// it. Long: every chunk type and its checks, kept together so that the order of checks
/// is visible.
pub(super) fn read_reply(
    conn: &Conn,
    r: &mut impl Read,
    writes_lost: &AtomicBool,
    direct: bool,
) -> Result<Option<Direct>, ReplyError> {
    let mut header = [0u8; CHUNK_HEADER_LEN];
    r.read_exact(&mut header[..SIMPLE_REPLY_LEN])?;
    conn.replies.fetch_add(1, Ordering::Release);
    let magic = u32::from_be_bytes(header[..4].try_into().unwrap());
    if magic == SIMPLE_REPLY_MAGIC {
        let reply = parse_simple_reply(header[..SIMPLE_REPLY_LEN].try_into().unwrap())?;
        let slot = in_flight(conn, reply.cookie)?;
        if reply.error == NBD_ESHUTDOWN {
            return Err(ReplyError::ShuttingDown);
        }
        if reply.error != 0 {
            set_error(&slot, reply.cookie, block_error(reply.error, ""));
        } else if slot.command == CMD_READ {
            if conn.info.structured {
                return Err(ReplyError::Protocol(
                    "a simple reply with data after structured replies were negotiated".into(),
                ));
            }
            let len = slot.len as usize;
            if direct {
                return Direct::start(slot, reply.cookie, 0, len, true).map(Some);
            }
            fill(r, &slot, reply.cookie, 0, len, false)?;
        }
        complete(conn, &slot, reply.cookie, writes_lost);
        return Ok(None);
    }
    if magic != STRUCTURED_REPLY_MAGIC {
        return Err(ProtocolError::BadMagic(magic.into()).into());
    }
    r.read_exact(&mut header[SIMPLE_REPLY_LEN..])?;
    let chunk = parse_chunk_header(&header)?;
    let slot = in_flight(conn, chunk.cookie)?;
    match chunk.kind {
        CHUNK_NONE if chunk.length == 0 && chunk.flags & CHUNK_FLAG_DONE != 0 => {}
        CHUNK_OFFSET_DATA if slot.command == CMD_READ && chunk.length >= 8 => {
            let mut offset = [0u8; 8];
            r.read_exact(&mut offset)?;
            let len = chunk.length - 8;
            let at = position(&slot, u64::from_be_bytes(offset), len)?;
            if direct {
                let last = chunk.flags & CHUNK_FLAG_DONE != 0;
                return Direct::start(slot, chunk.cookie, at, len as usize, last).map(Some);
            }
            fill(r, &slot, chunk.cookie, at, len as usize, false)?;
        }
        CHUNK_OFFSET_HOLE if slot.command == CMD_READ && chunk.length == 12 => {
            let mut body = [0u8; 12];
            r.read_exact(&mut body)?;
            let offset = u64::from_be_bytes(body[..8].try_into().unwrap());
            let len = u32::from_be_bytes(body[8..].try_into().unwrap());
            let at = position(&slot, offset, len)?;
            fill(r, &slot, chunk.cookie, at, len as usize, true)?;
        }
        CHUNK_BLOCK_STATUS if slot.command == CMD_BLOCK_STATUS => {
            let (context, descriptors) = parse_block_status(&payload(r, chunk.length)?)?;
            // Only the context we asked for counts; a server may describe others too.
            if Some(context) == conn.info.base_allocation {
                let mut st = slot.state.lock();
                if st.cookie == chunk.cookie {
                    // One chunk per context: a second one would be taken for the runs after
                    // the first one's, describing part of the range twice (data as a hole).
                    if std::mem::replace(&mut st.described, true) {
                        return Err(ReplyError::Protocol(
                            "a second block status chunk for base:allocation".into(),
                        ));
                    }
                    st.extents
                        .extend(descriptors.into_iter().filter(|(len, _)| *len > 0).map(
                            |(len, flags)| Extent {
                                len: u64::from(len),
                                flags: flags & (EXTENT_HOLE | EXTENT_ZERO),
                            },
                        ));
                }
            }
        }
        kind if kind & CHUNK_ERROR_BIT != 0 => {
            let e = parse_error_chunk(kind, &payload(r, chunk.length)?)?;
            if e.error == NBD_ESHUTDOWN {
                return Err(ReplyError::ShuttingDown);
            }
            let message = match e.offset {
                Some(offset) => format!("{} (at offset {offset})", e.message),
                None => e.message,
            };
            set_error(&slot, chunk.cookie, block_error(e.error, &message));
        }
        kind => {
            return Err(ReplyError::Protocol(format!(
                "chunk type {kind} of {} bytes in reply to command {}",
                chunk.length, slot.command
            )))
        }
    }
    if chunk.flags & CHUNK_FLAG_DONE != 0 {
        complete(conn, &slot, chunk.cookie, writes_lost);
    }
    Ok(None)
}

fn in_flight(conn: &Conn, cookie: u64) -> Result<Arc<Slot>, ReplyError> {
    conn.slot(cookie)
        .ok_or_else(|| ReplyError::Protocol(format!("reply to unknown cookie {cookie}")))
}

/// Where a data or hole chunk lands in the request's buffer.
fn position(slot: &Slot, offset: u64, len: u32) -> Result<usize, ReplyError> {
    let end = offset.checked_add(u64::from(len));
    match end {
        Some(end)
            if offset >= slot.offset && end <= slot.offset + u64::from(slot.len) && len > 0 =>
        {
            Ok((offset - slot.offset) as usize)
        }
        _ => Err(ReplyError::Protocol(format!(
            "chunk for {len} bytes at {offset} outside the read of {} at {}",
            slot.len, slot.offset
        ))),
    }
}

/// Reads a chunk payload that is parsed rather than copied to a caller.
fn payload(r: &mut impl Read, len: u32) -> Result<Vec<u8>, ReplyError> {
    if len > MAX_CHUNK_PAYLOAD {
        return Err(ReplyError::Protocol(format!(
            "chunk payload of {len} bytes"
        )));
    }
    let mut data = vec![0u8; len as usize];
    r.read_exact(&mut data)?;
    Ok(data)
}

/// Records that chunk `at..at + len` of a read's buffer is filled; false if some of it
/// already was. The server must not send overlapping chunks.
fn cover(covered: &mut Covered, at: usize, len: usize) -> bool {
    let end = at + len;
    // The first filled part that ends after `at`: the chunk must end before it starts.
    let i = covered.partition_point(|&(_, e)| e <= at);
    if covered.get(i).is_some_and(|&(start, _)| start < end) {
        return false;
    }
    // Chunks usually come in order, each one joining the previous: the list stays short.
    let joins_previous = i > 0 && covered[i - 1].1 == at;
    let joins_next = covered.get(i).is_some_and(|&(start, _)| start == end);
    match (joins_previous, joins_next) {
        (true, true) => {
            covered[i - 1].1 = covered[i].1;
            covered.remove(i);
        }
        (true, false) => covered[i - 1].1 = end,
        (false, true) => covered[i].0 = at,
        (false, false) => covered.insert(i, (at, end)),
    }
    true
}

/// Puts `len` bytes at `at` in the slot's buffer: from the socket, or zeroes for a hole. When
/// the caller has given up on this cookie the bytes are read and dropped, so the stream stays
/// in step.
fn fill(
    r: &mut impl Read,
    slot: &Slot,
    cookie: u64,
    at: usize,
    len: usize,
    zero: bool,
) -> Result<(), ReplyError> {
    let Some(dest) = begin_fill(slot, cookie, at, len)? else {
        if !zero {
            io::copy(&mut r.by_ref().take(len as u64), &mut io::sink())?;
        }
        return Ok(());
    };
    // SAFETY: see `begin_fill`.
    let buf = unsafe { std::slice::from_raw_parts_mut(dest.ptr.add(at), len) };
    let result = if zero {
        buf.fill(0);
        Ok(())
    } else {
        r.read_exact(buf)
    };
    end_fill(slot, result.is_ok(), len);
    Ok(result?)
}

/// Claims `at..at + len` of the slot's buffer for the reader, until [`end_fill`]: the
/// caller's buffer, or `None` when the caller gave up on this cookie.
///
/// `position` keeps `at + len` within the request, whose length is the buffer's; the caller
/// owning the buffer waits while `filling` is set and never returns before it is cleared
/// (see `wait_reply`), so the memory stays valid and not aliased until then.
fn begin_fill(slot: &Slot, cookie: u64, at: usize, len: usize) -> Result<Option<Dest>, ReplyError> {
    let mut st = slot.state.lock();
    match st.dest {
        Some(dest) if st.cookie == cookie => {
            if !cover(&mut st.covered, at, len) {
                return Err(ReplyError::Protocol(format!(
                    "chunk for {len} bytes at {} overlaps another in the read of {} at {}",
                    slot.offset + at as u64,
                    slot.len,
                    slot.offset
                )));
            }
            // Each separate piece costs memory until the gaps are filled.
            if st.covered.len() > MAX_PIECES {
                return Err(ReplyError::Protocol(format!(
                    "the reply to the read of {} at {} in more than {MAX_PIECES} pieces",
                    slot.len, slot.offset
                )));
            }
            debug_assert!(at + len <= dest.len);
            st.filling = true;
            Ok(Some(dest))
        }
        _ => Ok(None),
    }
}

/// Gives the buffer [`begin_fill`] claimed back to its caller, with `len` more bytes in it
/// if `filled`.
fn end_fill(slot: &Slot, filled: bool, len: usize) {
    let mut st = slot.state.lock();
    st.filling = false;
    if filled {
        st.received += len as u64;
    }
    settle(slot, st);
}

/// A read's data on its way from the socket straight into its caller's buffer, over as many
/// wake-ups of the reader as it takes: a big read, which the reader would otherwise copy
/// twice (into its own buffer, then out).
pub(super) struct Direct {
    slot: Arc<Slot>,
    cookie: u64,
    /// The caller's buffer; `None` when the caller gave up on the request: the bytes are
    /// received and dropped.
    dest: Option<Dest>,
    at: usize,
    len: usize,
    received: usize,
    /// The request is complete once this data is in (a simple reply, or a chunk flagged done).
    last: bool,
}

impl Direct {
    fn start(
        slot: Arc<Slot>,
        cookie: u64,
        at: usize,
        len: usize,
        last: bool,
    ) -> Result<Direct, ReplyError> {
        let dest = begin_fill(&slot, cookie, at, len)?;
        Ok(Direct {
            slot,
            cookie,
            dest,
            at,
            len,
            received: 0,
            last,
        })
    }

    pub(super) fn cookie(&self) -> u64 {
        self.cookie
    }

    /// Bytes still to come.
    pub(super) fn left(&self) -> usize {
        self.len - self.received
    }

    /// Where the rest is to be received: the caller's buffer, or `None` to drop it.
    pub(super) fn spare(&mut self) -> Option<&mut [u8]> {
        let dest = self.dest?;
        // SAFETY: claimed by `begin_fill` until `end_fill`.
        let at = unsafe { dest.ptr.add(self.at + self.received) };
        Some(unsafe { std::slice::from_raw_parts_mut(at, self.left()) })
    }

    /// `n` bytes were received into [`Direct::spare`].
    pub(super) fn advance(&mut self, n: usize) {
        self.received += n;
    }

    /// Takes what it needs of bytes the reader had buffered; returns how many.
    pub(super) fn feed(&mut self, bytes: &[u8]) -> usize {
        let n = bytes.len().min(self.left());
        if let Some(spare) = self.spare() {
            spare[..n].copy_from_slice(&bytes[..n]);
        }
        self.received += n;
        n
    }

    /// The data is all in: the caller has its buffer back, and the request completes if this
    /// was its last part.
    pub(super) fn finish(self, conn: &Conn, writes_lost: &AtomicBool) {
        debug_assert_eq!(self.left(), 0);
        if self.dest.is_some() {
            end_fill(&self.slot, true, self.len);
        }
        if self.last {
            complete(conn, &self.slot, self.cookie, writes_lost);
        }
    }

    /// The connection ended first: the caller has its buffer back (and hears of the loss
    /// from `Shared::connection_lost`).
    pub(super) fn abort(self) {
        if self.dest.is_some() {
            end_fill(&self.slot, false, self.len);
        }
    }
}

fn set_error(slot: &Slot, cookie: u64, error: BlockError) {
    let mut st = slot.state.lock();
    if st.cookie == cookie && st.error.is_none() {
        st.error = Some(error);
    }
}

fn complete(conn: &Conn, slot: &Slot, cookie: u64, writes_lost: &AtomicBool) {
    // A request its caller gave up on (the cookie moved on) may have been done all the same.
    let failed = {
        let st = slot.state.lock();
        st.cookie == cookie && st.error.is_some()
    };
    let mut flushed = false;
    {
        let mut in_flight = conn.in_flight.lock();
        in_flight.slots.remove(&cookie);
        let covers = in_flight.flushes.remove(&cookie);
        // A server without FLUSH writes through: nothing it acknowledged waits for one.
        let cached = conn.info.has(TF_SEND_FLUSH);
        match slot.command {
            CMD_WRITE | CMD_WRITE_ZEROES | CMD_TRIM if !failed && cached => {
                in_flight.writes_done += 1
            }
            CMD_FLUSH if !failed => {
                flushed = true;
                let covers = covers.unwrap_or(0);
                in_flight.writes_flushed = in_flight.writes_flushed.max(covers);
            }
            _ => {}
        }
    }
    let mut st = slot.state.lock();
    if st.cookie == cookie && st.outcome.is_none() {
        // This flush cannot vouch for writes an earlier connection's server acknowledged and
        // may have lost with its cache: say so, once, as the kernel reports a lost write
        // back to the next fsync.
        if let Some(lost) = flushed.then(|| take_writes_lost(writes_lost)).flatten() {
            st.error = Some(lost);
        }
        st.outcome = Some(Outcome::Done);
        settle(slot, st);
    }
}

/// The server's error code as a block error (the inverse of [`nbd_error`]).
fn block_error(code: u32, message: &str) -> BlockError {
    let text = if message.is_empty() {
        "the nbd server failed the request".to_string()
    } else {
        format!("nbd server: {message}")
    };
    match code {
        NBD_EIO => BlockError::Io(text),
        NBD_EINVAL => BlockError::InvalidArgument(text),
        NBD_ENOSPC => BlockError::NoSpace(text),
        NBD_EPERM => BlockError::ReadOnly(text),
        NBD_ENOTSUP => BlockError::NotSupported(text),
        other => BlockError::Os {
            context: text,
            errno: i32::try_from(other).unwrap_or(libc::EIO),
        },
    }
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::client::connection::SlotState;

    #[test]
    fn server_errors_map_to_block_errors() {
        assert_eq!(block_error(NBD_EIO, "").errno(), libc::EIO);
        assert_eq!(block_error(NBD_EINVAL, "").errno(), libc::EINVAL);
        assert_eq!(block_error(NBD_ENOSPC, "").errno(), libc::ENOSPC);
        assert_eq!(block_error(NBD_EPERM, "").errno(), libc::EPERM);
        assert_eq!(block_error(NBD_ENOTSUP, "").errno(), libc::EOPNOTSUPP);
        assert_eq!(block_error(NBD_ENOMEM, "").errno(), libc::ENOMEM);
        assert_eq!(block_error(NBD_EOVERFLOW, "").errno(), libc::EOVERFLOW);
        assert!(block_error(NBD_EIO, "disk on fire")
            .to_string()
            .contains("disk on fire"));
        // Every errno the server side sends comes back as itself.
        for errno in [
            libc::EIO,
            libc::EINVAL,
            libc::ENOSPC,
            libc::EPERM,
            libc::ENOMEM,
        ] {
            assert_eq!(block_error(nbd_error(errno), "").errno(), errno);
        }
    }

    #[test]
    fn overlapping_chunks_are_refused_in_any_order() {
        let mut covered = Covered::new();
        assert!(cover(&mut covered, 1024, 512));
        assert!(cover(&mut covered, 0, 512));
        assert!(!cover(&mut covered, 1000, 100));
        assert!(!cover(&mut covered, 256, 512));
        assert!(cover(&mut covered, 512, 512));
        assert_eq!(covered[..], [(0, 1536)]);
        assert!(!cover(&mut covered, 1535, 1));
        assert!(cover(&mut covered, 2048, 512));
        assert!(cover(&mut covered, 1536, 512));
        assert_eq!(covered[..], [(0, 2560)]);
    }

    /// Each separate piece of a read's reply costs an entry in its `covered` list: a server
    /// that sent a 32 MiB read as a byte at every other offset made 16 million of them, 256
    /// MiB, for each read in flight (found by reading `cover`). A reply in more pieces than
    /// [`MAX_PIECES`] is a protocol error now.
    #[test]
    fn a_read_reply_in_too_many_separate_pieces_is_refused() {
        let mut buf = vec![0u8; 1 << 20];
        let dest = Dest {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
        };
        let state = SlotState {
            cookie: 7,
            dest: Some(dest),
            ..SlotState::default()
        };
        let slot = Slot::new(CMD_READ, 0, buf.len() as u32, state);
        let piece = |i: usize| begin_fill(&slot, 7, 2 * i, 1);
        for i in 0..MAX_PIECES {
            assert!(piece(i).unwrap().is_some(), "piece {i}");
            end_fill(&slot, true, 1);
        }
        assert!(
            piece(MAX_PIECES).is_err(),
            "{} pieces taken",
            MAX_PIECES + 1
        );
    }

    #[test]
    fn chunks_outside_the_read_are_refused() {
        let slot = Slot::new(CMD_READ, 4096, 8192, SlotState::default());
        assert_eq!(position(&slot, 4096, 8192).unwrap(), 0);
        assert_eq!(position(&slot, 8192, 4096).unwrap(), 4096);
        assert!(position(&slot, 0, 512).is_err());
        assert!(position(&slot, 8192, 8192).is_err());
        assert!(position(&slot, 8192, 0).is_err());
        assert!(position(&slot, u64::MAX, 2).is_err());
    }
}
