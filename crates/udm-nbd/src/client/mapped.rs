//! Mapped requests: a read, write or flush the executor (the NBD event loop) hands over
//! without a thread waiting for it. [`NbdClient`]'s `map()` answers with a [`Transfer`]; the
//! executor starts it with the request's buffer, which sends the request on the connection
//! from the executor's own thread, and the reply reader (see `poller`) puts the reply into
//! the buffer and calls the transfer's [`Done`], which hands the request back to the
//! executor to answer.
//! An executor that batches (the NBD event loop: see [`udm_block::batch`]) has the requests
//! it starts in one wake-up sent together when it is done, one write per connection.
//!
//! Timing is the synchronous requests' (see `request`): a mapped request older than
//! `io_timeout` fails, and the connection is dropped when the server sent nothing since it
//! went out, or stalls in the middle of its reply. No caller waits to notice, so the reply
//! reader (see `poller`) looks ([`overdue`]) every [`tick`] of the client.
//!
//! A mapped request whose connection breaks, or that finds none, is not resent here: it asks
//! for a retry ([`Done::retry`]), and the executor runs it again through the synchronous
//! methods, which wait for the connection (or, with `fail_fast`, fail at once, for a
//! multipath to send the request down another path).

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::warn;
use udm_block::{BlockError, Done, MapOp, Mapping, Transfer, TransferBuf};

use super::connection::{finish_send, Conn, Dest, Outcome, Outgoing, Slot, SlotState};
use super::reconnect::Shared;
use super::{ClientOptions, NbdClient};
use crate::protocol::*;

/// How often the reader looks for mapped requests past their deadline: often enough that
/// one fails close to its `io_timeout`.
pub(super) fn tick(options: &ClientOptions) -> Duration {
    (options.io_timeout / 8).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

/// What a mapped request's slot keeps instead of a waiting caller.
pub(super) struct Waiting {
    done: Done,
    deadline: Instant,
    /// Reply headers the connection had received when the request went out.
    replies_before: u64,
    shared: Arc<Shared>,
}

impl Waiting {
    pub(super) fn finish(self, result: udm_block::Result<()>) {
        self.done.finish(result)
    }

    /// The connection broke before the reply came: the synchronous way resends it, or fails
    /// it at once with `fail_fast`. Past its deadline, it fails.
    pub(super) fn lost(self) {
        if Instant::now() >= self.deadline {
            let e = self.expired();
            return self.done.finish(Err(e));
        }
        let e = BlockError::Io(format!(
            "nbd server {}: the connection broke",
            self.shared.target.address
        ));
        self.done.retry(e)
    }

    pub(super) fn expired(&self) -> BlockError {
        BlockError::Io(format!(
            "nbd server {} unreachable: no reply within {:?}",
            self.shared.target.address, self.shared.target.options.io_timeout
        ))
    }
}

impl NbdClient {
    /// A read, write or flush as a transfer, when the request needs one round trip; `None`
    /// sends it the synchronous way (a request to split, FUA the server cannot do, a
    /// read-only export's refusal). Without a connection it is a transfer all the same,
    /// which asks for a retry at once: the synchronous way waits for the connection (or,
    /// with `fail_fast`, fails), so that a device over this client (a multipath) remaps
    /// whether or not its remote was up when it was made.
    pub(super) fn mapping(&self, op: MapOp, offset: u64, len: u64) -> Option<Mapping> {
        let info = self.info();
        let fits = len <= u64::from(info.max_request);
        let (command, flags) = match op {
            MapOp::Read if fits => (CMD_READ, 0),
            MapOp::Write { fua } if fits && !self.read_only(&info) => {
                if fua && !info.has(TF_SEND_FUA) {
                    return None;
                }
                (CMD_WRITE, if fua { CMD_FLAG_FUA } else { 0 })
            }
            // Nothing to make durable (see `flush`): done at once, unless there are lost
            // writes to report, which the synchronous way does.
            MapOp::Flush if self.flush_sends_nothing(&info) => {
                let lost = self.shared.writes_lost.load(Ordering::Acquire);
                return (!lost).then(Mapping::new);
            }
            MapOp::Flush => (CMD_FLUSH, 0),
            _ => return None,
        };
        let shared = self.shared.clone();
        let len = if op == MapOp::Flush { 0 } else { len };
        Some(
            Mapping::new().taking(Transfer::new(0, len, move |buf, done| {
                shared.start(command, flags, offset, buf, done)
            })),
        )
    }
}

impl Shared {
    /// Sends a mapped request on the live connection; its reply settles it (see
    /// [`super::connection::settle`]).
    fn start(self: Arc<Self>, command: u16, flags: u16, offset: u64, buf: TransferBuf, done: Done) {
        let conn = match self.state.lock().conn.clone() {
            Some(conn) => conn,
            None => {
                let why = format!("nbd server {}: not connected", self.target.address);
                return done.retry(BlockError::Io(why));
            }
        };
        self.send_mapped(conn, command, flags, offset, buf, done);
    }

    /// Flushes, with nobody waiting, the writes no flush has covered on a connection that has
    /// gone quiet (see `Shared::wait_lost`). A flush of this that fails leaves the writes in
    /// doubt, so the next flush reports them lost.
    pub(super) fn flush_quiet(self: &Arc<Self>, conn: Arc<Conn>) {
        let shared = self.clone();
        let done = Done::new(move |result| {
            if let Err(e) = result {
                warn!(
                    "nbd: flushing the writes of a quiet connection to {} failed: {e}",
                    shared.target.address
                );
                shared.writes_lost.store(true, Ordering::Release);
            }
        });
        self.clone()
            .send_mapped(conn, CMD_FLUSH, 0, 0, TransferBuf::empty(), done);
    }

    fn send_mapped(
        self: Arc<Self>,
        conn: Arc<Conn>,
        command: u16,
        flags: u16,
        offset: u64,
        buf: TransferBuf,
        done: Done,
    ) {
        let len = buf.len() as u32;
        let cookie = self.next_cookie.fetch_add(1, Ordering::Relaxed);
        let replies_before = conn.replies.load(Ordering::Acquire);
        let slot = Arc::new(Slot::new(
            command,
            offset,
            len,
            SlotState {
                cookie,
                dest: (command == CMD_READ).then(|| Dest {
                    ptr: buf.as_mut_ptr(),
                    len: buf.len(),
                }),
                mapped: Some(Waiting {
                    done,
                    deadline: Instant::now() + self.target.options.io_timeout,
                    replies_before,
                    shared: self.clone(),
                }),
                sending: true,
                ..SlotState::default()
            },
        ));
        if !conn.register(cookie, &slot) {
            slot.state.lock().outcome = Some(Outcome::Lost);
            return finish_send(&slot);
        }
        let header = slot.header(flags, cookie);
        let data: &[u8] = if command == CMD_WRITE {
            // SAFETY: the executor lends the write's data until the transfer is done, which
            // `sending` holds off until the outbox holding it has been written.
            unsafe { std::slice::from_raw_parts(buf.as_mut_ptr(), buf.len()) }
        } else {
            &[]
        };
        // The requests an executor starts in one wake-up go out together, in one write per
        // connection, when its batch ends (at once when it has none open).
        if conn.queue(Outgoing::new(header, data, slot)) {
            udm_block::at_batch_end(move || self.send_outbox(&conn));
        }
    }

    /// Writes the connection's outbox without waiting (this is the executor's thread, which
    /// serves other connections too): what the socket cannot take now, or all of it when
    /// another thread is writing, is left to a sender thread, which waits for the socket.
    /// Every request written (or lost, with the connection, when the write fails) may settle.
    fn send_outbox(self: &Arc<Self>, conn: &Arc<Conn>) {
        // A sender at work takes what was queued since, as it ends.
        if conn.sender.load(Ordering::SeqCst) {
            return;
        }
        if !self.settle_sends(conn, conn.send_outbox(false)) {
            self.start_sender(conn);
        }
    }

    /// Settles the slots whose sends are over; false when some requests are still to be
    /// sent, waiting.
    fn settle_sends(&self, conn: &Arc<Conn>, sent: (io::Result<bool>, Vec<Arc<Slot>>)) -> bool {
        let (result, slots) = sent;
        let all = result.unwrap_or_else(|e| {
            // Breaking the connection marks these slots lost too: they settle once sent.
            self.connection_lost(conn, &format!("sending a request: {e}"));
            true
        });
        for slot in slots {
            finish_send(&slot);
        }
        all
    }

    /// Starts the thread that sends, waiting, what the outbox and backlog hold, unless one
    /// is at work. One at a time per connection; it ends when nothing is left.
    fn start_sender(self: &Arc<Self>, conn: &Arc<Conn>) {
        if conn.sender.swap(true, Ordering::SeqCst) {
            return;
        }
        let (shared, sent) = (self.clone(), conn.clone());
        let spawned = std::thread::Builder::new()
            .name("nbd-sender".into())
            .spawn(move || shared.send_waiting(&sent));
        if let Err(e) = spawned {
            // Sending here, waiting, beats leaving the requests unsent for ever.
            warn!("nbd: cannot start a sender thread: {e}");
            self.send_waiting(conn);
        }
    }

    /// The sender thread's work: until the outbox stays empty. The flag is cleared before
    /// the outbox is looked at, and a queuer fills the outbox before looking at the flag,
    /// so one of them sees the other's request.
    fn send_waiting(&self, conn: &Arc<Conn>) {
        loop {
            self.settle_sends(conn, conn.send_outbox(true));
            conn.sender.store(false, Ordering::SeqCst);
            if !conn.has_outbox() || conn.sender.swap(true, Ordering::SeqCst) {
                return;
            }
        }
    }
}

/// Fails the mapped requests of `conn` past their deadline, as a synchronous caller's
/// `wait_reply` fails its own: when the server sent nothing since one went out, or stalls in
/// the middle of its data, the connection is taken for gone (the error says why, and every
/// request on it is then lost); otherwise the request alone fails, and a late reply to it is
/// dropped.
pub(super) fn overdue(conn: &Conn) -> Result<(), String> {
    let now = Instant::now();
    let slots: Vec<Arc<Slot>> = conn.in_flight.lock().slots.values().cloned().collect();
    let replies = conn.replies.load(Ordering::Acquire);
    for slot in slots {
        let mut st = slot.state.lock();
        let Some(waiting) = &st.mapped else { continue };
        if waiting.deadline > now || st.outcome.is_some() {
            continue;
        }
        if st.filling || conn.stalls_on(st.cookie) || replies == waiting.replies_before {
            return Err("the server stopped answering".into());
        }
        st.outcome = Some(Outcome::Expired);
        super::connection::settle(&slot, st);
    }
    Ok(())
}
