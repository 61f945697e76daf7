//! A caller's request: sent on the live connection under a fresh cookie, waited for in its
//! slot, sent again when the connection breaks first (failed then, with `fail_fast`), and
//! failed once `io_timeout` has passed (dropping a connection whose server stopped answering
//! on the way).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use udm_block::{BlockError, Extent};

use super::connection::{finish, Conn, Dest, Outcome, Slot, SlotState};
use super::reconnect::Shared;
use super::NbdClient;
use crate::protocol::CMD_BLOCK_STATUS;

/// What a request carries besides its header: nothing, the buffer a read lands in, or the data
/// a write sends.
pub(super) enum Payload<'a> {
    None,
    Read(&'a mut [u8]),
    Write(&'a [u8]),
}

impl NbdClient {
    /// Sends one request and waits for its reply, resending it across reconnections, for at
    /// most `io_timeout`. Returns the extents of a block-status reply (empty otherwise).
    pub(super) fn call(
        &self,
        command: u16,
        flags: u16,
        offset: u64,
        len: u32,
        payload: Payload<'_>,
    ) -> udm_block::Result<Vec<Extent>> {
        let shared = &*self.shared;
        let deadline = Instant::now() + shared.target.options.io_timeout;
        let (dest, data) = match payload {
            Payload::None => (None, &[][..]),
            Payload::Read(buf) => (
                Some(Dest {
                    ptr: buf.as_mut_ptr(),
                    len: buf.len(),
                }),
                &[][..],
            ),
            Payload::Write(data) => (None, data),
        };
        let state = SlotState {
            dest,
            ..SlotState::default()
        };
        let slot = Arc::new(Slot::new(command, offset, len, state));
        loop {
            let conn = shared.wait_connected(deadline)?;
            // Sent again on a connection that has no block status (the server came back
            // without it), the answer is what it would be without it.
            if command == CMD_BLOCK_STATUS && conn.info.base_allocation.is_none() {
                return Ok(vec![Extent::data(len.into())]);
            }
            let cookie = shared.next_cookie.fetch_add(1, Ordering::Relaxed);
            slot.state.lock().cookie = cookie;
            if !conn.register(cookie, &slot) {
                continue;
            }
            let replies_before = conn.replies.load(Ordering::Acquire);
            let header = slot.header(flags, cookie);
            if let Err(e) = conn.send(&header, data) {
                // Breaking the connection marks this slot lost too; it is resent below.
                shared.connection_lost(&conn, &format!("sending a request: {e}"));
            }
            if let Some(result) = shared.wait_reply(&slot, &conn, deadline, replies_before) {
                return result;
            }
            if shared.target.options.fail_fast {
                return Err(shared.unreachable_now("the connection broke"));
            }
        }
    }
}

impl Shared {
    fn unreachable(&self, why: &str) -> BlockError {
        BlockError::Io(format!(
            "nbd server {} unreachable: {why} within {:?}",
            self.target.address, self.target.options.io_timeout
        ))
    }

    /// For a `fail_fast` client: the request fails now rather than wait for a connection.
    fn unreachable_now(&self, why: &str) -> BlockError {
        BlockError::Io(format!(
            "nbd server {} unreachable: {why}",
            self.target.address
        ))
    }

    /// The live connection, waiting for one until `deadline` (not at all with `fail_fast`).
    fn wait_connected(&self, deadline: Instant) -> udm_block::Result<Arc<Conn>> {
        let mut state = self.state.lock();
        loop {
            if let Some(why) = &state.failed {
                return Err(BlockError::Io(why.clone()));
            }
            if state.closing {
                return Err(BlockError::Shutdown("the nbd client is closing".into()));
            }
            if let Some(conn) = &state.conn {
                return Ok(conn.clone());
            }
            if self.target.options.fail_fast {
                return Err(self.unreachable_now("not connected"));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(self.unreachable("no connection"));
            }
            self.changed.wait_for(&mut state, deadline - now);
        }
    }

    /// Waits for the slot's reply. `None` means the connection was lost before it came and
    /// the request must be sent again.
    fn wait_reply(
        &self,
        slot: &Slot,
        conn: &Arc<Conn>,
        deadline: Instant,
        replies_before: u64,
    ) -> Option<udm_block::Result<Vec<Extent>>> {
        let mut st = slot.state.lock();
        loop {
            if !st.filling {
                match st.outcome.take() {
                    Some(Outcome::Done) => return Some(finish(slot, &mut st)),
                    Some(Outcome::Lost) => {
                        let dest = st.dest;
                        *st = SlotState {
                            dest,
                            ..SlotState::default()
                        };
                        return None;
                    }
                    // Expired is set on mapped requests' slots only, which nobody waits on.
                    Some(Outcome::Expired) | None => {}
                }
            }
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            slot.wake.wait_for(&mut st, deadline - now);
        }
        // Timed out. A server that sent nothing at all since this request went out, or that
        // stalls in the middle of our data, is taken for gone: drop the connection so the
        // reader lets go of our buffer and a fresh connection is tried.
        let stalled = st.filling || conn.stalls_on(st.cookie);
        if stalled || conn.replies.load(Ordering::Acquire) == replies_before {
            drop(st);
            self.connection_lost(conn, "the server stopped answering");
            st = slot.state.lock();
            while st.filling {
                slot.wake.wait(&mut st);
            }
        }
        // Detach: a late reply finds no buffer and no cookie and is dropped.
        st.cookie = 0;
        st.dest = None;
        Some(Err(self.unreachable("no reply")))
    }
}
