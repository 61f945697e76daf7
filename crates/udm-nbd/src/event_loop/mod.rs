//! The transmission phase on io_uring: a few event-loop threads serve every connection.
//!
//! Each loop owns one ring. On it, each connection has at most one receive and one send in
//! flight; requests are parsed out of the receive buffer, remapped through the device
//! ([`udm_block::BlockDevice::map`]) and executed by the [`Engine`] on the same ring, and
//! their replies go out in batches, in completion order. A request the device cannot remap
//! runs on the [`Pool`] and its result comes back through the loop's mailbox, so no loop ever
//! waits on a disk, a slow target or a client.
//!
//! Memory: every request buffer comes from the server's [`BufferBudget`] without waiting
//! (`try_take`); a connection that finds no room stops reading until buffers come back. Each
//! connection also has at most `queue_depth` requests parsed and not yet replied to.

use parking_lot::Mutex;
use std::any::Any;
use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use io_uring::{opcode, squeue, types, IoUring};
use log::{debug, error, info, warn};
use udm_block::{BlockDevice, BlockError, MapOp, Mapping, Ready, WorkerPool as Pool};
use udm_uring::{is_engine, Engine, Outcome as MappedOutcome};

use crate::budget::{BufferBudget, Payload};
use crate::commands::{map_op, Outcome, Reply, Session};
use crate::handshake::{Negotiated, MAX_PAYLOAD};
use crate::protocol::*;
use crate::stall::{Pressure, Progress};
use crate::stream::Stream;
use crate::ServerConfig;

mod conn;
mod mailbox;
mod placement;
mod requests;

use mailbox::{Mailbox, Message};

const RECEIVE_BUFFER: usize = 256 << 10;
/// Replies sent with one sendmsg at most.
const SEND_BATCH: usize = 64;
/// A sendmsg takes no more replies once it carries this many bytes. The disk completes a
/// batch of reads together; sent in one piece, their replies reach the client only as a
/// whole, and it turns none round before it has read them all, while the disk waits for
/// work. In pieces, the client starts on the first while the rest follow: 4 KiB random reads
/// at depth 32 over `linear` on a file gained about 5 % (median of 8 alternating runs, 6 of
/// 8 pairs ahead). Writes' replies are headers only, so they still go 64 at a time: fewer
/// per piece cost them system calls and gained nothing.
const SEND_BYTES: usize = 32 << 10;
const RING_ENTRIES: u32 = 1024;
/// io-wq threads per loop, for bounded (disk) and unbounded work each.
const IO_WORKERS: u32 = 4;
/// How often idle and stalled connections are looked for.
const TICK: Duration = Duration::from_millis(200);
/// How soon a connection waiting for buffer room looks again.
const BUDGET_RETRY: Duration = Duration::from_millis(2);
/// The rest of a write payload at least this long is received straight into the request's
/// buffer instead of through the receive buffer and a copy.
const DIRECT_RECEIVE: usize = 16 << 10;
/// Entries queued while requests are started are submitted once there are this many, so the
/// disk works on the first requests of a burst while the loop parses and maps the rest. A
/// client at depth 32 often sends its requests together; started in one submission, the
/// first waited for all 32 (2-3 µs of kernel work each, and the block layer holds them until
/// the last). Smaller chunks start the disk sooner but cost a syscall and a device
/// notification each.
const SUBMIT_CHUNK: usize = 4;

// Kinds of the loop's own entries, in the low bits of user_data (the connection above).
const RECV: u64 = 1;
const SEND: u64 = 2;
const WAKE: u64 = 3;
const KIND_BITS: u32 = 8;

fn user_data(conn: usize, kind: u64) -> u64 {
    (conn as u64) << KIND_BITS | kind
}

/// A negotiated connection handed to a loop, with what must live as long as it.
pub(crate) struct Attach {
    pub stream: Stream,
    pub negotiated: Negotiated,
    /// The connection's place in the server's counts.
    pub slot: Box<dyn Any + Send>,
}

/// The running loops; each connection goes to its client's for its export, or else to the
/// one serving the fewest (see [`placement`]).
pub(crate) struct Loops {
    mailboxes: Vec<Arc<Mailbox>>,
    placement: Arc<placement::Placement>,
}

impl Loops {
    /// Starts `config.loop_threads` loops. Fails (and the caller falls back to the threaded
    /// server) when io_uring cannot be used.
    pub fn start(
        config: &ServerConfig,
        budget: Arc<BufferBudget>,
        pool: Arc<Pool>,
    ) -> io::Result<Loops> {
        let mut mailboxes = Vec::new();
        for i in 0..config.loop_threads.max(1) {
            let ring = IoUring::builder()
                .setup_cqsize(RING_ENTRIES * 8)
                .build(RING_ENTRIES)?;
            // The kernel runs what cannot complete at once (allocating writes, syncs) on
            // io-wq threads of the daemon's; bound them so a burst cannot add hundreds.
            let mut workers = [IO_WORKERS, IO_WORKERS];
            if let Err(e) = ring.submitter().register_iowq_max_workers(&mut workers) {
                debug!("nbd: cannot bound io_uring's worker threads: {e}");
            }
            let mailbox = Arc::new(Mailbox::new()?);
            let (mailbox_here, budget, pool) = (mailbox.clone(), budget.clone(), pool.clone());
            let (queue_depth, idle_timeout) = (config.queue_depth.max(1), config.idle_timeout);
            let write_timeout = config.handshake_timeout;
            let pressure = Pressure::new(&budget);
            // Built on its thread: a loop holds raw pointers (in-flight buffers) it never shares.
            let event_loop = move || EventLoop {
                ring,
                engine: Engine::new(),
                conns: Vec::new(),
                free: Vec::new(),
                mailbox: mailbox_here,
                wake_value: Box::new(0),
                queued: Vec::new(),
                backlog: VecDeque::new(),
                dirty: Vec::new(),
                budget,
                pool,
                queue_depth,
                idle_timeout,
                write_timeout,
                last_tick: Instant::now(),
                pressure,
            };
            std::thread::Builder::new()
                .name(format!("nbd-loop-{i}"))
                .spawn(move || event_loop().run())?;
            mailboxes.push(mailbox);
        }
        Ok(Loops {
            mailboxes,
            placement: Arc::default(),
        })
    }

    /// Connections attached to each loop.
    #[cfg(test)]
    pub fn connections(&self) -> Vec<usize> {
        let count = |m: &Arc<Mailbox>| m.connections.load(Ordering::Relaxed);
        self.mailboxes.iter().map(count).collect()
    }
}

/// A remapped request on the engine: its header and its buffer, kept until it completes.
struct Mapped {
    request: Request,
    payload: Option<Payload>,
}

/// Replies on the wire: kept, with the iovecs and header sendmsg reads, until sent.
struct Sending {
    /// What the iovecs point into.
    _replies: Vec<Reply>,
    iovecs: Vec<libc::iovec>,
    header: Box<libc::msghdr>,
    /// First iovec not yet sent in full.
    first: usize,
    progress: Progress,
}

/// How much of the next receive goes straight into a write's payload, and how much room of
/// the receive buffer it may fill after that: `room` is left after the `buffered` unparsed
/// bytes, `owed` bytes of the payload being received are still to come.
fn receive_plan(room: usize, buffered: usize, owed: usize, large_writes: bool) -> (usize, usize) {
    // Straight into the payload only when parse() has taken every buffered byte into it.
    let direct = if buffered == 0 && owed >= DIRECT_RECEIVE {
        owed
    } else {
        0
    };
    if !large_writes {
        return (direct, room);
    }
    let wanted = (owed - direct + REQUEST_HEADER_LEN).saturating_sub(buffered);
    (direct, room.min(wanted.max(1)))
}

/// A write whose payload is arriving.
struct Writing {
    request: Request,
    payload: Payload,
    /// Bytes of it received so far.
    got: usize,
    progress: Progress,
}

/// A receive's iovecs and the header recvmsg reads, kept until the receive completes.
struct Receive {
    header: libc::msghdr,
    iovecs: [libc::iovec; 2],
}

struct Conn {
    session: Arc<Session>,
    stream: Stream,
    _export: Box<dyn Any + Send + Sync>,
    _slot: Box<dyn Any + Send>,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    receiving: bool,
    /// Bytes of the receive in flight that land in the payload of `writing` (before any
    /// land in `buf`).
    receiving_payload: usize,
    receive: Box<Receive>,
    /// A write whose payload is still arriving. Kept while a receive into it is in flight,
    /// even if the connection is aborted.
    writing: Option<Writing>,
    /// The last request parsed was a write of at least [`DIRECT_RECEIVE`] bytes: the next
    /// receive into `buf` asks for no more than the rest of its payload and one header, so
    /// that the payload of a large write following it lands straight in its own buffer.
    /// Otherwise a client streaming large writes has the receive buffer filled with their
    /// payloads, each copied out again (a quarter of the loop's time at 256 KiB writes).
    large_writes: bool,
    mapped: Vec<Option<Mapped>>,
    mapped_free: Vec<usize>,
    /// Requests read and not yet answered (their replies not yet queued).
    in_flight: usize,
    replies: VecDeque<Reply>,
    sending: Option<Sending>,
    /// No more requests are read (disconnect, end of stream, idle); the connection ends once
    /// what is in flight is answered.
    closing: bool,
    /// The socket is gone: replies are dropped, and the connection ends once nothing of its
    /// is in flight.
    dead: bool,
    waiting_for_budget: bool,
    /// Requests held while the device is suspended, in arrival order (they would block a
    /// pool thread each); started when it resumes.
    held: VecDeque<(Request, Option<Payload>)>,
    last_active: Instant,
}

impl Conn {
    /// The entry for the next receive: straight into the rest of the payload of the write
    /// being received when that is long enough, then into the receive buffer after its
    /// unparsed bytes (all of its room or, after a large write, just enough for the rest of
    /// that write and the next header).
    fn receive_entry(&mut self, index: usize) -> squeue::Entry {
        let owed = self.writing.as_ref().map_or(0, |w| w.payload.len() - w.got);
        let (direct, room) = receive_plan(
            self.buf.len() - self.end,
            self.end - self.start,
            owed,
            self.large_writes,
        );
        let payload = match self.writing.as_mut() {
            Some(w) if direct > 0 => w.payload[w.got..].as_mut_ptr(),
            _ => std::ptr::null_mut(),
        };
        let receive = &mut *self.receive;
        receive.iovecs = [
            libc::iovec {
                iov_base: payload.cast(),
                iov_len: direct,
            },
            libc::iovec {
                iov_base: self.buf[self.end..].as_mut_ptr().cast(),
                iov_len: room,
            },
        ];
        receive.header.msg_iov = receive.iovecs.as_mut_ptr();
        receive.header.msg_iovlen = 2;
        self.receiving = true;
        self.receiving_payload = direct;
        // SAFETY (of the pointers handed to the kernel): the receive buffer and `receive`
        // live as long as the connection, which is not dropped while a receive is in flight;
        // the payload is not dropped while `receiving_payload` is set (see `abort`).
        opcode::RecvMsg::new(fd(&self.stream), &mut receive.header)
            .build()
            .user_data(user_data(index, RECV))
    }

    fn finished(&self) -> bool {
        self.closing
            && self.in_flight == 0
            && !self.receiving
            && self.sending.is_none()
            && (self.replies.is_empty() || self.dead)
    }
}

struct EventLoop {
    ring: IoUring,
    engine: Engine,
    conns: Vec<Option<Conn>>,
    free: Vec<usize>,
    mailbox: Arc<Mailbox>,
    /// Where the eventfd read lands.
    wake_value: Box<u64>,
    /// Entries waiting for room in the submission queue.
    queued: Vec<squeue::Entry>,
    /// Completions reaped early (to make room for submissions), not yet handled.
    backlog: VecDeque<(u64, i32)>,
    /// Connections to look at once this round's completions are handled.
    dirty: Vec<usize>,
    budget: Arc<BufferBudget>,
    pool: Arc<Pool>,
    queue_depth: usize,
    idle_timeout: Option<Duration>,
    write_timeout: Duration,
    last_tick: Instant,
    /// Whether others waited for buffer room since the last tick.
    pressure: Pressure,
}

impl EventLoop {
    fn run(mut self) {
        self.arm_wake();
        loop {
            self.submit_queued();
            let waiting = |c: &Conn| c.waiting_for_budget || !c.held.is_empty();
            let wait = if self.conns.iter().flatten().any(waiting) {
                BUDGET_RETRY
            } else {
                TICK
            };
            let timeout = types::Timespec::from(wait);
            let args = types::SubmitArgs::new().timespec(&timeout);
            if self.backlog.is_empty() {
                match self.ring.submitter().submit_with_args(1, &args) {
                    Ok(_) => {}
                    Err(e)
                        if matches!(
                            e.raw_os_error(),
                            Some(libc::ETIME | libc::EINTR | libc::EBUSY)
                        ) => {}
                    Err(e) => {
                        error!("nbd: event loop cannot wait on its ring: {e}");
                        std::thread::sleep(BUDGET_RETRY);
                    }
                }
            }
            // Requests this wake-up sends to remote exports (a multipath's or a linear's
            // NBD paths) go out together when it ends: one write per connection.
            let _batch = udm_block::Batch::open();
            self.reap();
            while let Some((user_data, result)) = self.backlog.pop_front() {
                // A bug here must not take every connection of the loop down with it.
                if let Err(panic) =
                    catch_unwind(AssertUnwindSafe(|| self.complete(user_data, result)))
                {
                    let why = crate::commands::panic_message(&*panic).to_string();
                    error!("nbd: event loop: handling a completion panicked: {why}");
                }
            }
            if self.last_tick.elapsed() >= TICK {
                self.tick();
            }
            let retry = self.conns.iter().enumerate();
            let retry = retry.filter(|(_, c)| c.as_ref().is_some_and(waiting));
            self.dirty.extend(retry.map(|(i, _)| i));
            let mut dirty = std::mem::take(&mut self.dirty);
            dirty.sort_unstable();
            dirty.dedup();
            for c in dirty {
                self.pump(c);
            }
        }
    }

    fn reap(&mut self) {
        self.backlog
            .extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
    }

    /// Moves queued entries into the submission queue, submitting whenever it is full.
    fn submit_queued(&mut self) {
        let mut done = 0;
        while done < self.queued.len() {
            // SAFETY: every entry's buffers are owned by a connection, a mapped request or the
            // loop, and stay alive until its completion is handled.
            done += unsafe { udm_uring::push_some(&mut self.ring, &self.queued[done..]) };
            if done < self.queued.len() {
                match self.ring.submit() {
                    Ok(_) => {}
                    // The completion queue is backed up: take completions to make room.
                    Err(e) if e.raw_os_error() == Some(libc::EBUSY) => self.reap(),
                    Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                    Err(e) => {
                        error!("nbd: event loop cannot submit: {e}");
                        std::thread::sleep(BUDGET_RETRY);
                    }
                }
            }
        }
        self.queued.clear();
    }

    /// Hands what is queued to the kernel at once.
    fn submit_now(&mut self) {
        self.submit_queued();
        match self.ring.submit() {
            Ok(_) => {}
            // Left in the submission queue, which the next wait submits.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EINTR)) => {}
            Err(e) => error!("nbd: event loop cannot submit: {e}"),
        }
    }

    fn arm_wake(&mut self) {
        let wake =
            udm_uring::eventfd_read(&self.mailbox.wake, &mut self.wake_value, user_data(0, WAKE));
        self.queued.push(wake);
    }

    fn complete(&mut self, user_data: u64, result: i32) {
        if is_engine(user_data) {
            let queued = &mut self.queued;
            if let Some((owner, outcome)) = self
                .engine
                .complete(user_data, result, &mut |e| queued.push(e))
            {
                self.mapped_done(owner, outcome);
            }
            return;
        }
        let conn = (user_data >> KIND_BITS) as usize;
        match user_data & ((1 << KIND_BITS) - 1) {
            WAKE => {
                self.arm_wake();
                for message in self.mailbox.take() {
                    match message {
                        Message::Attach(attach) => self.attach(*attach),
                        Message::Done {
                            conn,
                            request,
                            result,
                            payload,
                        } => self.answer(conn, &request, result, payload),
                        Message::Ready { owner, op, ready } => match ready {
                            Ready::Go(mapping) => self.submit_mapped(owner, op, mapping),
                            Ready::Failed(e) => {
                                self.mapped_done(owner, MappedOutcome::Done(Err(e)))
                            }
                            Ready::Retry => self.mapped_done(owner, MappedOutcome::Retry),
                        },
                    }
                }
            }
            RECV => self.received(conn, result),
            SEND => self.sent(conn, result),
            other => warn!("nbd: event loop: completion of unknown kind {other}"),
        }
    }
    /// Closes idle connections, and those whose client stopped in the middle of a request
    /// (see [`crate::stall`]): it reads none of its replies, or sends none of the rest of a
    /// write's data.
    fn tick(&mut self) {
        self.last_tick = Instant::now();
        let patience = self.pressure.patience(&self.budget, self.write_timeout);
        for index in 0..self.conns.len() {
            let Some(conn) = self.conns[index].as_ref().filter(|c| !c.dead) else {
                continue;
            };
            let sending = conn.sending.as_ref().map(|s| s.progress.quiet());
            let receiving = conn.writing.as_ref().map(|w| w.progress.quiet());
            let why = (sending
                .and_then(|quiet| patience.exceeded(quiet, "read none of its replies")))
            .or_else(|| {
                receiving.and_then(|quiet| {
                    patience.exceeded(quiet, "sent none of the rest of a write's data")
                })
            });
            if let Some(why) = why {
                self.abort(index, &why);
                continue;
            }
            let Some(idle) = self.idle_timeout else {
                continue;
            };
            let Some(conn) = self.conns[index].as_mut().filter(|c| !c.dead) else {
                continue;
            };
            // Part of a header is no request: a client that sends a few bytes of one and
            // stops is as idle as one that sends none (it kept its connection for good).
            let quiet = conn.in_flight == 0
                && conn.replies.is_empty()
                && conn.sending.is_none()
                && conn.writing.is_none()
                && conn.end - conn.start < REQUEST_HEADER_LEN;
            if !conn.closing && quiet && conn.last_active.elapsed() >= idle {
                info!(
                    "nbd export '{}': closing a connection idle for {idle:?}",
                    conn.session.name
                );
                conn.closing = true;
                conn.stream.shutdown();
                self.dirty.push(index);
            }
        }
    }
}

fn fd(stream: &Stream) -> types::Fd {
    types::Fd(stream.as_raw_fd())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn after_a_large_write_the_next_payload_is_received_in_place() {
        const ROOM: usize = RECEIVE_BUFFER;
        let big = 256 << 10;
        // Small requests: the whole buffer, as many of them as have arrived.
        assert_eq!(receive_plan(ROOM, 0, 0, false), (0, ROOM));
        // After a large write's header: its payload straight into its buffer, and in the same
        // receive only the next header, not the next write's payload to be copied out.
        assert_eq!(receive_plan(ROOM, 0, big, true), (big, REQUEST_HEADER_LEN));
        // Between requests of a stream of large writes: one header.
        assert_eq!(receive_plan(ROOM, 0, 0, true), (0, REQUEST_HEADER_LEN));
        // Part of a header already here: the rest of it.
        assert_eq!(
            receive_plan(ROOM - 10, 10, 0, true),
            (0, REQUEST_HEADER_LEN - 10)
        );
        // The short tail of a large payload goes through the buffer, with the next header.
        let tail = DIRECT_RECEIVE - 1;
        assert_eq!(
            receive_plan(ROOM, 0, tail, true),
            (0, tail + REQUEST_HEADER_LEN)
        );
        // Never an empty receive (which would read as the end of the stream).
        assert_eq!(receive_plan(ROOM - 40, 40, 0, true), (0, 1));
    }
}
