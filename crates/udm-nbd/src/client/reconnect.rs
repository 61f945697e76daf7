//! The state callers share with the client's thread and the reply reader, and the client's
//! thread: it hands each connection to the reply reader (see `poller`), which marks it lost
//! when it breaks (its requests are then resent); the thread then redials with backoff. A
//! server that comes back with another export size fails the device.

use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{debug, error, info};
use udm_block::BlockError;

use super::connection::{disconnect, settle, Conn, Outcome};
use super::dial::{ExportInfo, Target};
use super::poller;
use super::usable;
use crate::stream::Stream;

const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// A connection with nothing in flight at two looks this far apart, owing the same writes,
/// has them flushed (see `Shared::wait_lost`): 2 to 4 s after its last write, far inside
/// any server's idle timeout, and at most one flush per quiet spell.
const QUIET_FLUSH: Duration = Duration::from_secs(2);

pub(super) struct State {
    pub(super) conn: Option<Arc<Conn>>,
    /// What the latest connection negotiated.
    pub(super) info: ExportInfo,
    /// Set when the device can never work again (the export changed size).
    pub(super) failed: Option<String>,
    pub(super) closing: bool,
    /// A connection was made once; `info` is the server's word, not a stand-in.
    pub(super) connected_before: bool,
}

pub(super) struct Shared {
    pub(super) target: Target,
    /// Fixed at the first connection (or given to a client made disconnected); a server that
    /// comes back with another size is refused.
    pub(super) size: u64,
    pub(super) state: Mutex<State>,
    /// Signalled when the connection comes or goes, the device fails, or the client closes.
    pub(super) changed: Condvar,
    pub(super) next_cookie: AtomicU64,
    /// A connection died with writes its server acknowledged but no flush made durable: the
    /// next flush fails, whether it succeeds (see `read_replies`) or fails for another
    /// reason (see `NbdClient::flush`).
    pub(super) writes_lost: AtomicBool,
}

/// The error that reports writes lost, if a connection died with some since the last report
/// (`Shared::writes_lost`); reported once. [`BlockError::WritesLost`], so that no caller
/// retries the flush elsewhere: that one succeeding would vouch for the writes.
pub(super) fn take_writes_lost(writes_lost: &AtomicBool) -> Option<BlockError> {
    writes_lost.swap(false, Ordering::AcqRel).then(|| {
        BlockError::WritesLost(
            "the nbd server's connection broke with writes it had acknowledged but not \
             flushed; they may be lost"
                .into(),
        )
    })
}

impl Shared {
    /// Marks `conn` dead: aborts its socket (what it had not delivered is dropped, never sent
    /// later), tells every request in flight to resend, and wakes the reconnect loop.
    /// Idempotent.
    pub(super) fn connection_lost(&self, conn: &Arc<Conn>, why: &str) {
        let (slots, owed) = {
            let mut in_flight = conn.in_flight.lock();
            if in_flight.broken {
                return;
            }
            in_flight.broken = true;
            let owed = in_flight.unflushed();
            if owed {
                self.writes_lost.store(true, Ordering::Release);
            }
            (std::mem::take(&mut in_flight.slots), owed)
        };
        conn.control.abort();
        // Out of service before its requests hear of it, so that none is sent on it again.
        {
            let mut state = self.state.lock();
            if state.conn.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
                state.conn = None;
                // A server closing a connection that neither waits for a reply nor owes
                // writes (an idle timeout) loses nothing: no warning for that.
                let level = if slots.is_empty() && !owed {
                    log::Level::Info
                } else {
                    log::Level::Warn
                };
                if !state.closing {
                    log::log!(
                        level,
                        "nbd: connection to {} lost: {why}; reconnecting",
                        self.target.address
                    );
                }
            }
        }
        for (cookie, slot) in slots {
            let mut st = slot.state.lock();
            if st.cookie == cookie && st.outcome.is_none() {
                st.outcome = Some(Outcome::Lost);
                settle(&slot, st);
            }
        }
        self.changed.notify_all();
    }

    /// The client's thread: hands each connection to the reply reader (see `poller`) and
    /// waits until it breaks (see `wait_lost`), then reconnects, until the client is dropped
    /// or the device fails. A client made disconnected starts by dialling. Replies are none
    /// of its business.
    pub(super) fn run(self: Arc<Self>, mut current: Option<(Arc<Conn>, Stream)>) {
        let mut delay = FIRST_BACKOFF;
        loop {
            if let Some((conn, reader)) = current {
                let up_since = Instant::now();
                if let Err(why) = poller::watch(self.clone(), conn.clone(), reader) {
                    self.connection_lost(&conn, &why);
                }
                if !self.wait_lost(&conn) {
                    return;
                }
                // A server that breaks every connection as soon as it is made (a protocol
                // error on each request) must not be redialled in a tight loop: the backoff
                // starts over only after a connection that lasted.
                if up_since.elapsed() >= MAX_BACKOFF {
                    delay = FIRST_BACKOFF;
                } else if !self.pause(&mut delay, Instant::now()) {
                    return;
                }
            }
            current = self.reconnect(&mut delay);
            if current.is_none() {
                return;
            }
        }
    }

    /// Sleeps until `conn` is out of service (see [`Shared::connection_lost`]); false once
    /// the client is closing, whose connection the reader ends by itself.
    ///
    /// Meanwhile it flushes the writes of a connection quiet for [`QUIET_FLUSH`] that no
    /// flush covered: a server may close a quiet connection (udm's own after
    /// `--nbd-idle-timeout`, 5 minutes by default), and a connection that ends owing writes
    /// makes the next flush fail, for want of knowing whether the server kept them. Left
    /// owing, a write followed by a quiet spell and a flush failed with EIO though nothing
    /// was lost.
    fn wait_lost(self: &Arc<Self>, conn: &Arc<Conn>) -> bool {
        let in_service =
            |s: &State| !s.closing && s.conn.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn));
        // The writes the connection owed, quiet, at the last look.
        let mut owing = None;
        let mut state = self.state.lock();
        while in_service(&state) {
            if !self.changed.wait_for(&mut state, QUIET_FLUSH).timed_out() {
                continue;
            }
            let now_owing = conn.quiet_and_owing();
            if now_owing.is_some() && now_owing == owing && in_service(&state) {
                drop(state);
                self.flush_quiet(conn.clone());
                state = self.state.lock();
            }
            owing = now_owing;
        }
        !state.closing
    }

    /// Sleeps until `delay` after `since` (less if the client closes) and doubles it; false
    /// once the client is closing or the device has failed.
    fn pause(&self, delay: &mut Duration, since: Instant) -> bool {
        let mut state = self.state.lock();
        let left = delay.saturating_sub(since.elapsed());
        self.changed
            .wait_while_for(&mut state, |s| !s.closing, left);
        *delay = (*delay * 2).min(MAX_BACKOFF);
        !state.closing && state.failed.is_none()
    }

    fn stopped(&self) -> bool {
        let state = self.state.lock();
        state.closing || state.failed.is_some()
    }

    /// Redials until a connection is made or the client stops. Attempts start at most
    /// [`MAX_BACKOFF`] apart, however long each takes: across a cut link no reset comes, and
    /// a connect waits for its SYNs to be answered, retransmitted 1, 3 and 7 s after the
    /// first. Each waited up to the 10 s connect timeout and only then paused for its
    /// backoff, so when the link came back the attempt under way saw it only at its next
    /// retransmission or the one after it: a multipath's path came back about 10 s after its
    /// link did, where the documentation promises the checker interval plus 5 s. Now the
    /// connect is bounded by [`MAX_BACKOFF`] and the pause counts from the attempt's start.
    fn reconnect(&self, delay: &mut Duration) -> Option<(Arc<Conn>, Stream)> {
        let mut attempts = 0u32;
        loop {
            if self.stopped() {
                return None;
            }
            attempts = attempts.saturating_add(1);
            let started = Instant::now();
            let dialled = self
                .target
                .dial_within(MAX_BACKOFF)
                .and_then(|(stream, info)| {
                    Conn::new(stream, info).map_err(|e| self.target.handshake_io(e))
                });
            match dialled {
                Ok((conn, reader)) => return self.install(conn, reader, attempts),
                Err(e) => debug!("nbd: reconnect attempt {attempts}: {e}"),
            }
            if !self.pause(delay, started) {
                return None;
            }
        }
    }

    /// Puts a fresh connection in service, unless the export is no longer the same one.
    fn install(
        &self,
        conn: Arc<Conn>,
        reader: Stream,
        attempts: u32,
    ) -> Option<(Arc<Conn>, Stream)> {
        let mut state = self.state.lock();
        // The partial sector at the end is never used, so only a change beyond it matters.
        if usable(conn.info.size) != usable(self.size) {
            let why = format!(
                "nbd export '{}' on {} changed size from {} to {} bytes; the device has failed",
                self.target.export, self.target.address, self.size, conn.info.size
            );
            error!("{why}");
            state.failed = Some(why);
        }
        if state.closing || state.failed.is_some() {
            drop(state);
            self.changed.notify_all();
            disconnect(&mut conn.writer.lock().stream);
            return None;
        }
        state.conn = Some(conn.clone());
        state.info = conn.info;
        if std::mem::replace(&mut state.connected_before, true) {
            info!(
                "nbd: reconnected to {} export '{}' after {attempts} attempt(s)",
                self.target.address, self.target.export
            );
        } else {
            info!(
                "nbd: connected to {} export '{}' ({} bytes) after {attempts} attempt(s)",
                self.target.address, self.target.export, conn.info.size
            );
            self.target.warn_about(&conn.info);
        }
        self.changed.notify_all();
        Some((conn, reader))
    }
}
