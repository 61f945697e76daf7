//! One established connection, and the slots its requests wait in: the table of requests in
//! flight by cookie, the writer the callers take turns on, the handle that shuts the socket
//! down, and what a slot holds once its reply is in.

use parking_lot::{Condvar, Mutex};
use smallvec::SmallVec;
use std::collections::HashMap;
use std::io::{self, IoSlice, Write};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use udm_block::{BlockError, Extent};

use super::dial::ExportInfo;
use crate::protocol::*;
use crate::stream::Stream;

/// A caller's buffer that the reply reader fills. It lives on the caller's stack; the slot
/// protocol (see [`Slot`]) guarantees the caller neither touches nor leaves it while the
/// reader writes to it.
#[derive(Clone, Copy)]
pub(super) struct Dest {
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
}

// SAFETY: the pointer is only dereferenced by the reply reader while `filling` is set, during
// which the owning caller is blocked in `wait_reply` and does not access the buffer.
unsafe impl Send for Dest {}

pub(super) enum Outcome {
    /// The last chunk arrived: the result is in the slot.
    Done,
    /// The connection broke first: send the request again.
    Lost,
    /// A mapped request's deadline passed first (see `mapped::overdue`): it fails.
    Expired,
}

/// The parts of a read's buffer that chunks have filled. Inline for two: a read's reply is
/// most often one chunk, and a vector would cost an allocation per read.
pub(super) type Covered = SmallVec<[(usize, usize); 2]>;

#[derive(Default)]
pub(super) struct SlotState {
    /// The cookie of the attempt in flight; 0 when none (not sent yet, or abandoned after a
    /// timeout, in which case whatever still arrives for the old cookie is dropped).
    pub(super) cookie: u64,
    pub(super) dest: Option<Dest>,
    /// The reader is writing into `dest` right now.
    pub(super) filling: bool,
    pub(super) received: u64,
    /// The parts of the read's buffer chunks have filled, sorted and joined: overlapping
    /// chunks could add up to `received` with some of the buffer never written.
    pub(super) covered: Covered,
    pub(super) extents: Vec<Extent>,
    /// The `base:allocation` chunk of a block status reply came: a second one is an error.
    pub(super) described: bool,
    pub(super) error: Option<BlockError>,
    pub(super) outcome: Option<Outcome>,
    /// A mapped request: nobody waits in `wait_reply`; the slot settles by calling this
    /// (see [`settle`]).
    pub(super) mapped: Option<super::mapped::Waiting>,
    /// A mapped request's data is being sent from its caller's buffer: the slot must not
    /// settle (and the caller reuse the buffer) before the send is over.
    pub(super) sending: bool,
}

/// One request and the place its reply lands.
pub(super) struct Slot {
    pub(super) command: u16,
    pub(super) offset: u64,
    pub(super) len: u32,
    pub(super) state: Mutex<SlotState>,
    pub(super) wake: Condvar,
}

impl Slot {
    /// The slot of a request for `len` bytes at `offset`, starting in `state`.
    pub(super) fn new(command: u16, offset: u64, len: u32, state: SlotState) -> Slot {
        Slot {
            command,
            offset,
            len,
            state: Mutex::new(state),
            wake: Condvar::new(),
        }
    }

    /// The request header asking for this slot's operation under `cookie`.
    pub(super) fn header(&self, flags: u16, cookie: u64) -> [u8; REQUEST_HEADER_LEN] {
        encode_request(&Request {
            flags,
            command: self.command,
            cookie,
            offset: self.offset,
            length: self.len,
        })
    }
}

#[derive(Default)]
pub(super) struct InFlight {
    pub(super) slots: HashMap<u64, Arc<Slot>>,
    /// Set once, when the connection dies; nothing is registered after that.
    pub(super) broken: bool,
    /// Writes, write-zeroes and trims the server acknowledged; the server may hold them in a
    /// cache it loses if it dies before a flush.
    pub(super) writes_done: u64,
    /// How many of `writes_done` a completed flush made durable.
    pub(super) writes_flushed: u64,
    /// Each flush in flight, by cookie, with the `writes_done` it covers: those acknowledged
    /// before it was sent.
    pub(super) flushes: HashMap<u64, u64>,
}

impl InFlight {
    /// Whether writes the server acknowledged are not known to be durable yet.
    pub(super) fn unflushed(&self) -> bool {
        self.writes_done > self.writes_flushed
    }
}

impl Conn {
    /// With nothing in flight and writes no flush has covered, how many writes the
    /// connection has had acknowledged (which tells a later look whether any came since).
    /// None from a server that takes no flush.
    pub(super) fn quiet_and_owing(&self) -> Option<u64> {
        if !self.info.has(TF_SEND_FLUSH) {
            return None;
        }
        let in_flight = self.in_flight.lock();
        (in_flight.slots.is_empty() && in_flight.unflushed()).then_some(in_flight.writes_done)
    }
}

/// A mapped request waiting in its connection's outbox for the end of the executor's batch
/// (see [`udm_block::batch`]): its header, and a write's data.
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

/// Slices per write of the outbox: well under the kernel's IOV_MAX (1024).
const SLICES_PER_WRITE: usize = 512;

/// One established connection.
pub(super) struct Conn {
    pub(super) info: ExportInfo,
    pub(super) writer: Mutex<Writer>,
    /// A second handle used only to shut the socket down, which must work while a writer
    /// holds `writer`.
    pub(super) control: Stream,
    pub(super) in_flight: Mutex<InFlight>,
    /// Reply headers received; a request that times out while this did not move tells that
    /// the server stopped answering altogether.
    pub(super) replies: AtomicU64,
    /// The cookie of the reply whose header is in and whose rest is not yet (0: none): a
    /// request past its deadline with this cookie has a server stalling in the middle of its
    /// data.
    pub(super) partial: AtomicU64,
    /// Mapped requests to send together (see [`Conn::queue`]).
    outbox: Mutex<Vec<Outgoing>>,
    /// A thread is sending the outbox and backlog, waiting for the socket (see
    /// `Shared::send_outbox`); whatever is queued meanwhile it sends too.
    pub(super) sender: AtomicBool,
}

impl Conn {
    /// Returns the connection and the handle the reply reader reads from.
    pub(super) fn new(stream: Stream, info: ExportInfo) -> io::Result<(Arc<Conn>, Stream)> {
        let reader = stream.try_clone()?;
        let conn = Conn {
            info,
            control: stream.try_clone()?,
            writer: Mutex::new(Writer::new(stream)),
            in_flight: Mutex::new(InFlight::default()),
            replies: AtomicU64::new(0),
            partial: AtomicU64::new(0),
            outbox: Mutex::new(Vec::new()),
            sender: AtomicBool::new(false),
        };
        Ok((Arc::new(conn), reader))
    }

    /// Files the slot under `cookie`; false if the connection died meanwhile.
    pub(super) fn register(&self, cookie: u64, slot: &Arc<Slot>) -> bool {
        let mut in_flight = self.in_flight.lock();
        if in_flight.broken {
            return false;
        }
        in_flight.slots.insert(cookie, slot.clone());
        if slot.command == CMD_FLUSH {
            let covers = in_flight.writes_done;
            in_flight.flushes.insert(cookie, covers);
        }
        true
    }

    /// Whether the server stopped in the middle of the reply to `cookie` (as far as it came).
    pub(super) fn stalls_on(&self, cookie: u64) -> bool {
        cookie != 0 && self.partial.load(Ordering::Acquire) == cookie
    }

    pub(super) fn slot(&self, cookie: u64) -> Option<Arc<Slot>> {
        self.in_flight.lock().slots.get(&cookie).cloned()
    }

    /// Sends a request, waiting for the socket (up to its send timeout): after what the
    /// outbox left unsent (see [`Conn::send_outbox`]), which must go first.
    pub(super) fn send(&self, header: &[u8; REQUEST_HEADER_LEN], data: &[u8]) -> io::Result<()> {
        let mut writer = self.writer.lock();
        let (backlog, sent) = writer.write_backlog(true);
        let result = sent.and_then(|_| {
            if data.is_empty() {
                writer.stream.write_all(header)
            } else {
                let mut slices = [IoSlice::new(header), IoSlice::new(data)];
                writer.stream.write_all_vectored(&mut slices)
            }
        });
        drop(writer);
        backlog.iter().for_each(|slot| finish_send(slot));
        result
    }

    /// Puts a mapped request in the outbox. True when the outbox was empty: the caller is
    /// to see it written ([`Conn::send_outbox`]); otherwise whoever filled it first will.
    pub(super) fn queue(&self, outgoing: Outgoing) -> bool {
        let mut outbox = self.outbox.lock();
        outbox.push(outgoing);
        outbox.len() == 1
    }

    /// Whether requests wait in the outbox.
    pub(super) fn has_outbox(&self) -> bool {
        !self.outbox.lock().is_empty()
    }

    /// Writes the backlog and then every request in the outbox, in as few writes as there
    /// are [`SLICES_PER_WRITE`]s in them. With `wait` false it never waits, neither for the
    /// writer nor for room in the socket (it runs on the executor's thread, which serves
    /// other connections too): what the socket cannot take now stays in the backlog, or in
    /// the outbox when another thread holds the writer, and `Ok(false)` says that someone
    /// must send it waiting. Returns the slots whose sends are over (written, or failed with
    /// the connection).
    pub(super) fn send_outbox(&self, wait: bool) -> (io::Result<bool>, Vec<Arc<Slot>>) {
        let mut writer = match wait {
            true => self.writer.lock(),
            false => match self.writer.try_lock() {
                Some(writer) => writer,
                None => return (Ok(false), Vec::new()),
            },
        };
        let outbox = std::mem::take(&mut *self.outbox.lock());
        writer.backlog.extend(outbox);
        let (slots, result) = writer.write_backlog(wait);
        (result, slots)
    }
}

/// A connection's writing side: the socket, and the requests of an outbox that a send which
/// was not to wait left unsent, or sent in part.
pub(super) struct Writer {
    pub(super) stream: Stream,
    /// Nothing else may be written before these, the first `sent` bytes of which are out.
    backlog: Vec<Outgoing>,
    sent: usize,
}

impl Writer {
    fn new(stream: Stream) -> Writer {
        Writer {
            stream,
            backlog: Vec::new(),
            sent: 0,
        }
    }

    /// Whether a request written now would start at a request's boundary.
    pub(super) fn idle(&self) -> bool {
        self.backlog.is_empty()
    }

    /// Writes the backlog, waiting for room in the socket if `wait`. Returns the slots whose
    /// sends are over (all of them, or none if the socket took only part: `Ok(false)`); on an
    /// error the backlog is dropped, and its slots are lost with the connection.
    fn write_backlog(&mut self, wait: bool) -> (Vec<Arc<Slot>>, io::Result<bool>) {
        let result = self.write_out(wait);
        if matches!(result, Ok(false)) {
            return (Vec::new(), result);
        }
        self.sent = 0;
        let slots = self.backlog.drain(..).map(|o| o.slot).collect();
        (slots, result)
    }

    fn write_out(&mut self, wait: bool) -> io::Result<bool> {
        let mut slices = Vec::with_capacity(2 * self.backlog.len());
        for outgoing in &self.backlog {
            slices.push(IoSlice::new(&outgoing.header));
            if outgoing.len > 0 {
                // SAFETY: see `Outgoing::new`; the slot's send is not over before this returns.
                let data = unsafe { std::slice::from_raw_parts(outgoing.data, outgoing.len) };
                slices.push(IoSlice::new(data));
            }
        }
        let mut left = &mut slices[..];
        IoSlice::advance_slices(&mut left, self.sent);
        while !left.is_empty() {
            let n = left.len().min(SLICES_PER_WRITE);
            match send_slices(&self.stream, &left[..n], wait) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(written) => {
                    self.sent += written;
                    IoSlice::advance_slices(&mut left, written);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && !wait => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }
}

/// One sendmsg of `slices`; without `wait`, it takes what the socket has room for now.
fn send_slices(stream: &Stream, slices: &[IoSlice<'_>], wait: bool) -> io::Result<usize> {
    // SAFETY: an all-zero msghdr is a valid empty one.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // IoSlice is an iovec on Unix, by its documentation.
    msg.msg_iov = slices.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = slices.len();
    let flags = libc::MSG_NOSIGNAL | if wait { 0 } else { libc::MSG_DONTWAIT };
    // SAFETY: the iovecs point into live buffers for the call.
    let n = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, flags) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// A polite goodbye (the server may already be gone; nothing depends on it arriving).
pub(super) fn disconnect(stream: &mut Stream) {
    let request = encode_request(&Request {
        flags: 0,
        command: CMD_DISC,
        cookie: 0,
        offset: 0,
        length: 0,
    });
    let _ = stream.write_all(&request);
    stream.shutdown();
}

/// The result of a completed slot.
pub(super) fn finish(slot: &Slot, st: &mut SlotState) -> udm_block::Result<Vec<Extent>> {
    if let Some(e) = st.error.take() {
        return Err(e);
    }
    if slot.command == CMD_READ && st.received != u64::from(slot.len) {
        return Err(BlockError::Io(format!(
            "the nbd server's reply covered {} of the {} bytes read",
            st.received, slot.len
        )));
    }
    Ok(std::mem::take(&mut st.extents))
}

/// Wakes whoever waits for the slot now that something happened to it: the caller blocked in
/// `wait_reply`, or, for a mapped request, its [`Done`](udm_block::Done) once nothing touches
/// its buffer any more. Takes the slot's state lock and lets it go before calling the done.
pub(super) fn settle(slot: &Slot, mut st: parking_lot::MutexGuard<'_, SlotState>) {
    if st.mapped.is_none() {
        slot.wake.notify_all();
        return;
    }
    if st.filling || st.sending || st.outcome.is_none() {
        return;
    }
    let outcome = st.outcome.take().expect("checked above");
    let waiting = st.mapped.take().expect("checked above");
    // None: the connection broke first.
    let result = match outcome {
        Outcome::Done => Some(finish(slot, &mut st).map(drop)),
        Outcome::Expired => Some(Err(waiting.expired())),
        Outcome::Lost => None,
    };
    // A late reply to this cookie finds no buffer and is dropped.
    st.dest = None;
    st.cookie = 0;
    drop(st);
    match result {
        Some(result) => waiting.finish(result),
        None => waiting.lost(),
    }
}

/// A mapped request's send is over: the slot may settle now.
pub(super) fn finish_send(slot: &Slot) {
    let mut st = slot.state.lock();
    st.sending = false;
    settle(slot, st);
}
