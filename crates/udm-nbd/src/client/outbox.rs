//! The write side of a connection: requests go out whole and in order, one writer at a time.
//!
//! A writer is a synchronous caller sending its own request, or whoever writes the outbox,
//! where mapped requests wait for the end of their executor's batch (see
//! [`udm_block::batch`]). Requests queued while someone writes stay in the outbox for that
//! writer, which writes them when it is done: nobody else writes in the middle of its
//! requests, and a queued request never waits for a batch that has already ended.
//!
//! On an executor that takes writes onto its ring (the NBD event loop) the outbox goes out as
//! one `sendmsg` on that ring, submitted with the rest of the loop's wake-up: a second
//! connection (a multipath's second path) then costs a submission entry rather than a system
//! call. Anywhere else it is written at once. A connection lost meanwhile is shut down (see
//! `Shared::connection_lost`), which fails a write still in flight on the ring, so that no
//! request given up on reaches the server later.

use std::io::{self, IoSlice, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use udm_block::RingWrite;

use super::connection::{disconnect, finish_send, Conn, Slot};
use super::reconnect::Shared;
use crate::protocol::REQUEST_HEADER_LEN;

/// Slices per write: within the kernel's IOV_MAX (1024).
const SLICES_PER_WRITE: usize = 1024;

/// A mapped request waiting in its connection's outbox: its header, and a write's data.
pub(super) struct Outgoing {
    header: [u8; REQUEST_HEADER_LEN],
    data: *const u8,
    len: usize,
    slot: Arc<Slot>,
}

// SAFETY: the data is lent by the executor until the request's transfer is done, which the
// slot's `sending` holds off until the outbox has been written.
unsafe impl Send for Outgoing {}

impl Outgoing {
    /// `data` must stay valid and unchanged until the slot's send is over ([`finish_send`]).
    pub(super) fn new(header: [u8; REQUEST_HEADER_LEN], data: &[u8], slot: Arc<Slot>) -> Self {
        Outgoing {
            header,
            data: data.as_ptr(),
            len: data.len(),
            slot,
        }
    }
}

/// The requests waiting to be written, and whether someone is writing.
#[derive(Default)]
pub(super) struct Outbox {
    queued: Vec<Outgoing>,
    writing: bool,
}

impl Conn {
    /// Puts a mapped request in the outbox. True when the caller is to see the outbox written
    /// ([`Shared::send_outbox`]): nobody writes, and nobody was asked to before.
    pub(super) fn queue(&self, outgoing: Outgoing) -> bool {
        let mut outbox = self.outbox.lock();
        outbox.queued.push(outgoing);
        !outbox.writing && outbox.queued.len() == 1
    }

    /// Makes the caller the writer, once the one writing is done; false when that takes
    /// longer than the connection's I/O timeout (a write stuck on a server that reads
    /// nothing, which the reply reader is about to end).
    fn claim_writer(&self, timeout: std::time::Duration) -> bool {
        let mut outbox = self.outbox.lock();
        let deadline = std::time::Instant::now() + timeout;
        while outbox.writing {
            if self
                .writer_free
                .wait_until(&mut outbox, deadline)
                .timed_out()
            {
                return false;
            }
        }
        outbox.writing = true;
        true
    }

    /// Makes the caller the writer if nobody writes.
    fn try_claim_writer(&self) -> bool {
        let mut outbox = self.outbox.lock();
        !std::mem::replace(&mut outbox.writing, true)
    }

    /// The queued requests, with the caller as their writer; none when someone else writes
    /// (they are that writer's) or nothing is queued.
    fn claim_queued(&self) -> Option<Vec<Outgoing>> {
        let mut outbox = self.outbox.lock();
        if outbox.writing || outbox.queued.is_empty() {
            return None;
        }
        outbox.writing = true;
        Some(std::mem::take(&mut outbox.queued))
    }

    /// The writer is done: what was queued meanwhile is still its to write, or else it
    /// stops being the writer.
    fn next_or_release(&self) -> Option<Vec<Outgoing>> {
        let mut outbox = self.outbox.lock();
        debug_assert!(outbox.writing);
        if outbox.queued.is_empty() {
            outbox.writing = false;
            self.writer_free.notify_one();
            return None;
        }
        Some(std::mem::take(&mut outbox.queued))
    }

    /// The socket, for writes on a ring: the one `control` shuts down when the connection is
    /// lost, which fails such a write.
    fn socket(&self) -> RawFd {
        self.control.as_raw_fd()
    }
}

impl Shared {
    /// Writes a synchronous caller's request now, then whatever was queued meanwhile.
    pub(super) fn send_now(
        self: &Arc<Self>,
        conn: &Arc<Conn>,
        header: &[u8; REQUEST_HEADER_LEN],
        data: &[u8],
    ) -> io::Result<()> {
        if !conn.claim_writer(self.target.options.io_timeout) {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the connection's writer did not finish within the I/O timeout",
            ));
        }
        let result = {
            let mut writer = conn.writer.lock();
            if data.is_empty() {
                writer.write_all(header)
            } else {
                writer.write_all_vectored(&mut [IoSlice::new(header), IoSlice::new(data)])
            }
        };
        if let Some(next) = conn.next_or_release() {
            self.write_outbox(conn, next);
        }
        result
    }

    /// Says goodbye on `conn` and shuts it down. The goodbye is skipped when someone writes
    /// (a writer stuck on a server that stopped reading must not hold us up, and a goodbye
    /// in the middle of its requests would corrupt them); requests queued meanwhile are then
    /// written to the dead socket, which fails them as lost.
    pub(super) fn hang_up(self: &Arc<Self>, conn: &Arc<Conn>) {
        let writer = conn.try_claim_writer();
        if writer {
            disconnect(&mut conn.writer.lock());
        }
        // The reply reader sees the socket end and marks the connection lost; the requests
        // it had in flight are then resent, find the client closing and fail.
        conn.control.shutdown();
        if writer {
            if let Some(next) = conn.next_or_release() {
                self.write_outbox(conn, next);
            }
        }
    }

    /// Writes the outbox, unless someone is writing already (then it is theirs).
    pub(super) fn send_outbox(self: &Arc<Self>, conn: &Arc<Conn>) {
        if let Some(outbox) = conn.claim_queued() {
            self.write_outbox(conn, outbox);
        }
    }

    /// Writes `outbox`, the caller being the writer, and what is queued after it: on this
    /// thread's ring when it has one (its completion goes on from there), else at once.
    fn write_outbox(self: &Arc<Self>, conn: &Arc<Conn>, mut outbox: Vec<Outgoing>) {
        loop {
            if udm_block::ring_writes_here() {
                let write = OutboxWrite::new(self.clone(), conn.clone(), outbox);
                if let Err(write) = udm_block::write_on_ring(Box::new(write)) {
                    unreachable!("the ring took writes a moment ago: {}", write.fd());
                }
                return;
            }
            let result = write_now(conn, &outbox);
            self.written(conn, outbox, result);
            match conn.next_or_release() {
                Some(next) => outbox = next,
                None => return,
            }
        }
    }

    /// The outbox's write is over: every request in it has been sent, or is lost with the
    /// connection when the write failed, and may settle.
    fn written(&self, conn: &Arc<Conn>, outbox: Vec<Outgoing>, result: io::Result<()>) {
        if let Err(e) = result {
            // Breaking the connection marks these slots lost too: they settle once sent.
            self.connection_lost(conn, &format!("sending a request: {e}"));
        }
        for outgoing in outbox {
            finish_send(&outgoing.slot);
        }
    }
}

/// The slices of `outbox`: each request's header and a write's data.
fn slices(outbox: &[Outgoing]) -> Vec<IoSlice<'_>> {
    let mut slices = Vec::with_capacity(2 * outbox.len());
    for outgoing in outbox {
        slices.push(IoSlice::new(&outgoing.header));
        if outgoing.len > 0 {
            // SAFETY: see `Outgoing::new`; the slot's send is not over before the write is.
            let data = unsafe { std::slice::from_raw_parts(outgoing.data, outgoing.len) };
            slices.push(IoSlice::new(data));
        }
    }
    slices
}

fn write_now(conn: &Conn, outbox: &[Outgoing]) -> io::Result<()> {
    let mut slices = slices(outbox);
    let mut writer = conn.writer.lock();
    slices
        .chunks_mut(SLICES_PER_WRITE)
        .try_for_each(|chunk| writer.write_all_vectored(chunk))
}

/// An outbox being written on the executor's ring.
struct OutboxWrite {
    shared: Arc<Shared>,
    conn: Arc<Conn>,
    outbox: Vec<Outgoing>,
    /// The outbox's slices; those before `next` are written, and so is `next`'s start.
    iovecs: Vec<libc::iovec>,
    next: usize,
}

impl OutboxWrite {
    fn new(shared: Arc<Shared>, conn: Arc<Conn>, outbox: Vec<Outgoing>) -> OutboxWrite {
        let iovecs = slices(&outbox)
            .iter()
            .map(|slice| libc::iovec {
                iov_base: slice.as_ptr() as *mut libc::c_void,
                iov_len: slice.len(),
            })
            .collect();
        OutboxWrite {
            shared,
            conn,
            outbox,
            iovecs,
            next: 0,
        }
    }
}

/// Moves `next` (the first iovec not wholly written) past `n` more written bytes, shortening
/// the iovec they end in; true when every iovec is written.
fn advance(iovecs: &mut [libc::iovec], next: &mut usize, mut n: usize) -> bool {
    while let Some(iovec) = iovecs.get_mut(*next) {
        if n < iovec.iov_len {
            // SAFETY: still within the slice this iovec describes.
            iovec.iov_base = unsafe { iovec.iov_base.cast::<u8>().add(n) }.cast();
            iovec.iov_len -= n;
            return false;
        }
        n -= iovec.iov_len;
        *next += 1;
    }
    true
}

impl RingWrite for OutboxWrite {
    fn fd(&self) -> RawFd {
        self.conn.socket()
    }

    fn iovecs(&self) -> &[libc::iovec] {
        let end = self.iovecs.len().min(self.next + SLICES_PER_WRITE);
        &self.iovecs[self.next..end]
    }

    fn written(mut self: Box<Self>, result: i32) {
        let result = match usize::try_from(result) {
            Err(_) => Err(io::Error::from_raw_os_error(-result)),
            Ok(0) => Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "the connection took no more bytes",
            )),
            Ok(n) if !advance(&mut self.iovecs, &mut self.next, n) => {
                // The rest, on the same ring: the writer is still this write.
                if let Err(write) = udm_block::write_on_ring(self) {
                    unreachable!(
                        "a ring write completes on its ring's thread: {}",
                        write.fd()
                    );
                }
                return;
            }
            Ok(_) => Ok(()),
        };
        let OutboxWrite {
            shared,
            conn,
            outbox,
            ..
        } = *self;
        shared.written(&conn, outbox, result);
        if let Some(next) = conn.next_or_release() {
            shared.write_outbox(&conn, next);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_write_goes_on_from_the_first_byte_not_written() {
        let (a, b) = ([1u8; 48], [2u8; 100]);
        let iovec = |s: &[u8]| libc::iovec {
            iov_base: s.as_ptr() as *mut libc::c_void,
            iov_len: s.len(),
        };
        let mut iovecs = [iovec(&a), iovec(&b)];
        let mut next = 0;
        assert!(!advance(&mut iovecs, &mut next, 10));
        assert_eq!((next, iovecs[0].iov_len), (0, 38));
        assert_eq!(iovecs[0].iov_base as usize, a.as_ptr() as usize + 10);
        // The end of the first and the start of the second.
        assert!(!advance(&mut iovecs, &mut next, 40));
        assert_eq!((next, iovecs[1].iov_len), (1, 98));
        assert_eq!(iovecs[1].iov_base as usize, b.as_ptr() as usize + 2);
        assert!(advance(&mut iovecs, &mut next, 98));
        assert_eq!(next, 2);
    }
}
