//! One established connection, and the slots its requests wait in: the table of requests in
//! flight by cookie, the writer the callers take turns on, the handle that shuts the socket
//! down, and what a slot holds once its reply is in.

use parking_lot::{Condvar, Mutex};
use smallvec::SmallVec;
use std::collections::HashMap;
use std::io::{self, IoSlice, Write};
use std::sync::atomic::{AtomicU64, Ordering};
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
    pub(super) writer: Mutex<Stream>,
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
}

impl Conn {
    /// Returns the connection and the handle the reply reader reads from.
    pub(super) fn new(stream: Stream, info: ExportInfo) -> io::Result<(Arc<Conn>, Stream)> {
        let reader = stream.try_clone()?;
        let conn = Conn {
            info,
            control: stream.try_clone()?,
            writer: Mutex::new(stream),
            in_flight: Mutex::new(InFlight::default()),
            replies: AtomicU64::new(0),
            partial: AtomicU64::new(0),
            outbox: Mutex::new(Vec::new()),
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

    pub(super) fn send(&self, header: &[u8; REQUEST_HEADER_LEN], data: &[u8]) -> io::Result<()> {
        let mut writer = self.writer.lock();
        if data.is_empty() {
            writer.write_all(header)
        } else {
            writer.write_all_vectored(&mut [IoSlice::new(header), IoSlice::new(data)])
        }
    }

    /// Puts a mapped request in the outbox. True when the outbox was empty: the caller is
    /// to see it written ([`Conn::send_outbox`]); otherwise whoever filled it first will.
    pub(super) fn queue(&self, outgoing: Outgoing) -> bool {
        let mut outbox = self.outbox.lock();
        outbox.push(outgoing);
        outbox.len() == 1
    }

    /// Writes every request in the outbox, as few writes as there are [`SLICES_PER_WRITE`]s
    /// in it; returns how that went and their slots, whose sends are then over.
    pub(super) fn send_outbox(&self) -> (io::Result<()>, Vec<Arc<Slot>>) {
        let outbox = std::mem::take(&mut *self.outbox.lock());
        let mut slices = Vec::with_capacity(2 * outbox.len());
        for outgoing in &outbox {
            slices.push(IoSlice::new(&outgoing.header));
            if outgoing.len > 0 {
                // SAFETY: see `Outgoing::new`; the slot's send is not over before this returns.
                let data = unsafe { std::slice::from_raw_parts(outgoing.data, outgoing.len) };
                slices.push(IoSlice::new(data));
            }
        }
        let result = {
            let mut writer = self.writer.lock();
            slices
                .chunks_mut(SLICES_PER_WRITE)
                .try_for_each(|chunk| writer.write_all_vectored(chunk))
        };
        drop(slices);
        (result, outbox.into_iter().map(|o| o.slot).collect())
    }
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
