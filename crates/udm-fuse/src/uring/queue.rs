//! One thread of a queue of FUSE over io_uring: a thread on the queue's CPU (the kernel gives
//! a request to the queue of the CPU it was issued on) owning a ring with its share of the
//! queue's entries registered on /dev/fuse. The kernel hands a request to any free entry of
//! the queue, whichever thread registered it.
//!
//! A request that arrives is served one of three ways, so that nothing the thread waits for
//! can stall the queue:
//! - a READ, WRITE, FSYNC or FALLOCATE whose device can say where the bytes live (`map()`)
//!   goes to the io_uring engine on this same ring: the data moves between the entry's payload
//!   buffer and the files with no copy and no thread waiting. A mapping that must wait for
//!   steps first (a delay's timer, a snapshot copy-out) is parked in its entry and comes back
//!   through the mailbox when they are done;
//! - requests that only look at the catalog's tables (lookup, getattr, open, readdir…) are
//!   served inline;
//! - everything else goes to the pool, which answers in the entry and posts it back.
//!
//! Either way the reply is committed with COMMIT_AND_FETCH, which also waits for the next
//! request on the entry.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::mpsc::Sender;
use std::sync::Arc;

use io_uring::{cqueue, opcode, squeue, types, IoUring};
use log::{debug, error, warn};
use udm_block::{MapOp, Mapping, Ready};
use udm_uring::{is_engine, Engine, InFlightLimit, Outcome};

use crate::abi::{self, opcode as op, ring};
use crate::session::Session;

use super::plan::{plan, Answer, Mapped};
use super::pool::{Job, Mailbox, Posted};
use super::slot::{Slot, SlotServer};

/// `user_data` of the poll on the mailbox's eventfd; entries use their index, the engine
/// bit 63.
const WAKE: u64 = 1 << 62;
/// Reads this long or longer are not held by the bound on reads at the disk: a stream of
/// them is after bandwidth, which depth buys (256 KiB sequential reads at depth 32 lost a
/// fifth of their MB/s to a bound of 16 per queue), where small random reads only wait
/// longer at the disk for it.
const LARGE_READ: u64 = 128 << 10;

/// A queue's thread set up before the mount: its ring, its entries' buffers, its mailbox.
pub(crate) struct Queue {
    qid: u16,
    /// Which of the queue's threads.
    thread: u16,
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    slots: Vec<Slot>,
    mailbox: Arc<Mailbox>,
    /// Reads this thread keeps at the disk at once (0: no bound).
    reads: usize,
}

impl Queue {
    /// Thread `thread` of queue `qid`, with `depth` entries whose payload buffers take
    /// `payload_len` bytes, keeping at most `reads` reads at the disk (0: no bound).
    pub fn new(
        qid: u16,
        thread: u16,
        depth: u16,
        reads: u16,
        payload_len: usize,
    ) -> Result<Queue, String> {
        // Commands for every entry plus the engine's pieces; more wait in the backlog.
        let entries = (u32::from(depth) * 2).next_power_of_two();
        let ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder()
            .setup_cqsize(entries * 4)
            .build(entries)
            .map_err(|e| format!("cannot make an io_uring with 128-byte entries: {e}"))?;
        let mailbox = Mailbox::new().map_err(|e| e.to_string())?;
        Ok(Queue {
            qid,
            thread,
            ring,
            slots: (0..depth).map(|_| Slot::new(payload_len)).collect(),
            mailbox: Arc::new(mailbox),
            reads: usize::from(reads),
        })
    }

    pub fn thread_name(&self) -> String {
        format!("fuse-ring-{}.{}", self.qid, self.thread)
    }

    /// Registers the entries, says through `started` whether the kernel took them, and
    /// serves requests until the connection ends and every entry has come back.
    pub fn run(
        self,
        session: Arc<Session>,
        fuse: Arc<OwnedFd>,
        jobs: Sender<Job>,
        started: Sender<Result<(), String>>,
    ) {
        if std::env::var_os("UDM_FUSE_NOPIN").is_none() {
            pin_to_cpu(usize::from(self.qid));
        }
        let count = self.slots.len();
        let server = SlotServer::new(&session);
        let mut q = Serving {
            states: (0..count).map(|_| State::Gone).collect(),
            live: count,
            engine: Engine::new(),
            reads: InFlightLimit::new(self.reads),
            backlog: VecDeque::new(),
            completions: Vec::new(),
            register_error: None,
            queue: self,
            session,
            fuse,
            jobs,
            server,
        };
        for slot in 0..count {
            q.send_command(slot, None);
        }
        q.arm_wake();
        // A refused REGISTER completes at once; an accepted one stays pending until a
        // request comes.
        let submitted = q.submit(false);
        q.reap();
        let outcome = match (submitted, q.register_error.take()) {
            (Err(e), _) => Err(format!("submitting to the ring: {e}")),
            (Ok(()), Some(e)) => Err(e),
            (Ok(()), None) => Ok(()),
        };
        let _ = started.send(outcome);
        q.serve();
    }
}

/// Who holds an entry.
enum State {
    /// The kernel: registered (`None`) or committed (`Some(commit_id)`), waiting for a
    /// request. The command is kept for a retry the kernel may ask for (EAGAIN).
    Kernel(Option<u64>),
    /// udm, serving a request whose reply goes in with `commit_id`; `mapped` while the
    /// engine executes it (or its mapping waits for its steps).
    Serving {
        commit_id: u64,
        mapped: Option<Mapped>,
    },
    /// Nobody: the connection ended (or the kernel refused the entry).
    Gone,
}

struct Serving {
    queue: Queue,
    session: Arc<Session>,
    fuse: Arc<OwnedFd>,
    jobs: Sender<Job>,
    server: SlotServer,
    states: Vec<State>,
    /// Entries not gone: the thread ends when none is left.
    live: usize,
    engine: Engine,
    /// Reads at the disk, and those waiting for their turn (entry, mapping).
    reads: InFlightLimit<(usize, Mapping)>,
    /// Entries for the submission queue, in order, when it is full.
    backlog: VecDeque<squeue::Entry128>,
    /// Reused for each batch of completions.
    completions: Vec<(u64, i32)>,
    register_error: Option<String>,
}

impl Serving {
    fn serve(&mut self) {
        while self.live > 0 {
            if let Err(e) = self.submit(true) {
                // Nothing can reach the kernel any more; its side of the entries ends with
                // the connection.
                return error!("fuse: ring of queue {} failed: {e}", self.queue.qid);
            }
            self.reap();
        }
        debug!("fuse: queue {} ended", self.queue.qid);
    }

    /// Moves the backlog to the ring and submits it; with `wait`, until a completion comes.
    fn submit(&mut self, wait: bool) -> std::io::Result<()> {
        loop {
            let backlog = self.backlog.make_contiguous();
            // SAFETY: every entry's buffers (slots, the engine's requests) stay valid until its
            // completion is reaped.
            let pushed = unsafe { udm_uring::push_some(&mut self.queue.ring, backlog) };
            self.backlog.drain(..pushed);
            let more = !self.backlog.is_empty();
            let want = usize::from(wait && !more);
            match self.queue.ring.submit_and_wait(want) {
                Ok(_) => {}
                // Completions must be reaped before more can be submitted (EBUSY), or a
                // signal came: reap, then go on.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EINTR)) => {
                    return Ok(())
                }
                Err(e) => return Err(e),
            }
            if !more {
                return Ok(());
            }
        }
    }

    fn reap(&mut self) {
        let mut completions = std::mem::take(&mut self.completions);
        completions.extend(
            self.queue
                .ring
                .completion()
                .map(|c| (c.user_data(), c.result())),
        );
        for &(user_data, result) in &completions {
            if is_engine(user_data) {
                let backlog = &mut self.backlog;
                let mut push = |e: squeue::Entry| backlog.push_back(e.into());
                if let Some((slot, outcome)) = self.engine.complete(user_data, result, &mut push) {
                    self.finish_mapped(slot as usize, outcome);
                }
            } else if user_data == WAKE {
                if result < 0 {
                    error!(
                        "fuse: queue {}: polling its mailbox failed: {}",
                        self.queue.qid,
                        std::io::Error::from_raw_os_error(-result)
                    );
                }
                for posted in self.queue.mailbox.take() {
                    match posted {
                        Posted::Served(slot) => self.commit(usize::from(slot)),
                        Posted::Ready { slot, op, ready } => {
                            let slot = usize::from(slot);
                            match ready {
                                Ready::Go(mapping) => self.submit_mapped(slot, op, mapping),
                                Ready::Failed(e) => self.finish_mapped(slot, Outcome::Done(Err(e))),
                                Ready::Retry => self.finish_mapped(slot, Outcome::Retry),
                            }
                        }
                    }
                }
                self.arm_wake();
            } else {
                self.entry_completed(user_data as usize, result);
            }
        }
        completions.clear();
        self.completions = completions;
    }

    /// A REGISTER or COMMIT_AND_FETCH completed: a request arrived, or the entry ended.
    fn entry_completed(&mut self, slot: usize, result: i32) {
        let State::Kernel(command) = self.states[slot] else {
            return error!(
                "fuse: a completion for ring entry {slot}, which the kernel did not hold"
            );
        };
        if result >= 0 {
            return self.take_request(slot);
        }
        let errno = -result;
        match errno {
            libc::EAGAIN | libc::EINTR => return self.send_command(slot, command),
            // The connection ended (unmount, abort): the entry is released.
            libc::ENOTCONN | libc::ECONNABORTED | libc::ENODEV => {}
            _ => {
                let err = std::io::Error::from_raw_os_error(errno);
                match command {
                    None => {
                        self.register_error.get_or_insert_with(|| {
                            format!("the kernel refused a ring entry (FUSE_IO_URING_CMD_REGISTER: {err})")
                        });
                    }
                    // ENOENT: the request was ended meanwhile (its caller was killed, the
                    // connection aborted); its reply has nobody to go to.
                    Some(id) => warn!(
                        "fuse: queue {}: the reply to request {id} was not taken \
                         (FUSE_IO_URING_CMD_COMMIT_AND_FETCH: {err}); the entry is lost",
                        self.queue.qid
                    ),
                }
            }
        }
        self.states[slot] = State::Gone;
        self.live -= 1;
    }

    fn take_request(&mut self, slot: usize) {
        let bufs = self.queue.slots[slot].bufs;
        // SAFETY: the kernel handed the entry over with its completion; nothing else holds it.
        let (commit_id, opcode) = unsafe { (bufs.commit_id(), bufs.request().header.opcode) };
        self.states[slot] = State::Serving {
            commit_id,
            mapped: None,
        };
        match opcode {
            op::READ | op::WRITE | op::FSYNC | op::FALLOCATE if self.start_mapped(slot) => {}
            // Answered from the catalog's tables, without I/O. Opening a file takes an open
            // of the device, and releasing it gives that back, which are counters too; so
            // a device busy in the pool does not hold up opening another.
            op::LOOKUP
            | op::GETATTR
            | op::SETATTR
            | op::ACCESS
            | op::STATFS
            | op::OPEN
            | op::RELEASE
            | op::OPENDIR
            | op::READDIR
            | op::RELEASEDIR
            | op::FLUSH => {
                // SAFETY: this thread holds the entry.
                unsafe { self.server.serve(&self.session, bufs) };
                self.commit(slot);
            }
            _ => self.serve_on_pool(slot),
        }
    }

    /// Serves the request in `slot` through the device's synchronous methods, on the pool.
    fn serve_on_pool(&mut self, slot: usize) {
        let bufs = self.queue.slots[slot].bufs;
        let job = Job {
            bufs,
            slot: slot as u16,
            mailbox: self.queue.mailbox.clone(),
        };
        // The pool lives as long as any queue holds a sender; should it be gone, the request
        // is still answered.
        if let Err(refused) = self.jobs.send(job) {
            // SAFETY: the job came back: this thread holds the entry.
            unsafe { self.server.serve(&self.session, refused.0.bufs) };
            self.commit(slot);
        }
    }

    /// Starts the request in `slot` on the engine if its device can map it; false if it must
    /// be served synchronously.
    fn start_mapped(&mut self, slot: usize) -> bool {
        let bufs = self.queue.slots[slot].bufs;
        // SAFETY: this thread holds the entry; the request's borrows end with the block.
        let planned = plan(&self.session.fs, &unsafe { bufs.request() });
        let Some((map_op, mapping, mapped)) = planned else {
            return false;
        };
        if let State::Serving { mapped: m, .. } = &mut self.states[slot] {
            *m = Some(mapped);
        }
        if mapping.is_ready() {
            self.submit_mapped(slot, map_op, mapping);
        } else {
            // It waits for steps, or transfers (a remote export's client moving the data with
            // the entry's payload buffer), that finish on other threads: the entry stays with
            // udm, holding no thread, and the mapping comes back through the mailbox.
            let mailbox = self.queue.mailbox.clone();
            let slot = slot as u16;
            // SAFETY: the payload buffer holds the request's bytes (a write's data, room for a
            // read's) and stays untouched in the Serving state until the mapping comes back.
            unsafe {
                mapping.when_ready_with(bufs.payload, move |ready| {
                    mailbox.post(Posted::Ready {
                        slot,
                        op: map_op,
                        ready,
                    })
                })
            };
        }
        true
    }

    /// Hands the ready mapping of the request in `slot` to the engine, once the bound on
    /// reads at the disk lets it.
    fn submit_mapped(&mut self, slot: usize, map_op: MapOp, mapping: Mapping) {
        if map_op != MapOp::Read || mapping.len() >= LARGE_READ {
            return self.start_on_engine(slot, map_op, mapping);
        }
        if let Some((slot, mapping)) = self.reads.admit((slot, mapping)) {
            self.start_read(slot, mapping);
        }
    }

    /// Starts a read the bound admitted; it is released when it completes.
    fn start_read(&mut self, slot: usize, mapping: Mapping) {
        if let State::Serving {
            mapped: Some(m), ..
        } = &mut self.states[slot]
        {
            m.admitted = true;
        }
        self.start_on_engine(slot, MapOp::Read, mapping);
    }

    fn start_on_engine(&mut self, slot: usize, map_op: MapOp, mapping: Mapping) {
        let bufs = self.queue.slots[slot].bufs;
        let backlog = &mut self.backlog;
        let mut push = |e: squeue::Entry| backlog.push_back(e.into());
        // SAFETY: the payload buffer holds a read's or write's bytes (at least the mapping's
        // length: the kernel's request size; a fallocate's pieces do not use it) and is left
        // alone until the engine completes the request, since the entry stays in the Serving
        // state until then.
        let done = unsafe {
            self.engine
                .start(map_op, mapping, bufs.payload, slot as u64, &mut push)
        };
        if let Some(outcome) = done {
            self.finish_mapped(slot, Outcome::Done(outcome));
        }
    }

    fn finish_mapped(&mut self, slot: usize, outcome: Outcome) {
        let State::Serving { mapped, .. } = &mut self.states[slot] else {
            return error!("fuse: the engine completed ring entry {slot}, which it did not hold");
        };
        let Some(Mapped {
            unique,
            answer,
            admitted,
        }) = mapped.take()
        else {
            return error!("fuse: the engine completed ring entry {slot}, which it did not run");
        };
        if admitted {
            if let Some((next, mapping)) = self.reads.release() {
                self.start_read(next, mapping);
            }
        }
        let outcome = match outcome {
            Outcome::Done(outcome) => outcome,
            // The request is still in the entry's buffers, untouched but for a read's data,
            // which the synchronous read overwrites.
            Outcome::Retry => return self.serve_on_pool(slot),
        };
        let bufs = self.queue.slots[slot].bufs;
        // SAFETY: the engine is done with the entry's buffers; this thread holds it.
        unsafe {
            match (outcome, answer) {
                (Err(e), _) => {
                    debug!("fuse: request {unique} failed: {e}");
                    bufs.set_reply(unique, e.errno(), 0);
                }
                (Ok(()), Answer::Data(len)) => bufs.set_reply(unique, 0, len),
                (Ok(()), Answer::Written(n)) => bufs.reply_with(unique, 0, &abi::write_out(n)),
                (Ok(()), Answer::Empty) => bufs.set_reply(unique, 0, 0),
            }
        }
        self.commit(slot);
    }

    /// Hands the reply in the entry to the kernel and waits for the next request on it.
    fn commit(&mut self, slot: usize) {
        match self.states[slot] {
            State::Serving { commit_id, .. } => self.send_command(slot, Some(commit_id)),
            _ => error!("fuse: committing ring entry {slot}, which is not being served"),
        }
    }

    /// Queues REGISTER (`command` None) or COMMIT_AND_FETCH for the entry.
    fn send_command(&mut self, slot: usize, command: Option<u64>) {
        self.states[slot] = State::Kernel(command);
        let fd = types::Fd(self.fuse.as_raw_fd());
        let qid = self.queue.qid;
        let entry = match command {
            None => with_len(
                opcode::UringCmd80::new(fd, ring::CMD_REGISTER)
                    .cmd(ring::cmd_req(qid, 0))
                    .addr(Some(self.queue.slots[slot].iovecs()))
                    .build(),
                2,
            ),
            Some(commit_id) => opcode::UringCmd80::new(fd, ring::CMD_COMMIT_AND_FETCH)
                .cmd(ring::cmd_req(qid, commit_id))
                .build(),
        };
        self.backlog.push_back(entry.user_data(slot as u64));
    }

    /// Polls the mailbox: the ring completes when the pool has posted slots.
    fn arm_wake(&mut self) {
        let fd = types::Fd(self.queue.mailbox.eventfd());
        let poll = opcode::PollAdd::new(fd, libc::POLLIN as u32).build();
        self.backlog.push_back(poll.user_data(WAKE).into());
    }
}

/// Sets `sqe->len`, which `UringCmd80` has no setter for: REGISTER passes the number of
/// iovecs there.
fn with_len(mut entry: squeue::Entry128, len: u32) -> squeue::Entry128 {
    // SAFETY: Entry128 is #[repr(C)], starting with the kernel's struct io_uring_sqe, whose
    // u32 `len` is at byte 24.
    unsafe {
        std::ptr::from_mut(&mut entry)
            .cast::<u8>()
            .add(24)
            .cast::<u32>()
            .write_unaligned(len)
    };
    entry
}

/// Runs the thread on the CPU whose requests the queue gets, as the kernel expects; a CPU
/// that is offline (possible but not present) leaves it unpinned. Measured on 2 vCPUs (fio
/// through a loop device, 4 KiB, depth 32): random writes 55k IOPS pinned, 40k unpinned;
/// random reads equal.
fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET stays within it.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        debug!(
            "fuse: queue {cpu} not pinned to its CPU: {}",
            std::io::Error::last_os_error()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn register_entries_carry_the_iovec_count() {
        let entry = with_len(
            opcode::UringCmd80::new(types::Fd(3), ring::CMD_REGISTER)
                .addr(Some(0x1000))
                .build(),
            2,
        );
        // SAFETY: reading the bytes of a 128-byte plain struct.
        let bytes: [u8; 128] = unsafe { std::mem::transmute(entry) };
        assert_eq!(bytes[0], 46, "IORING_OP_URING_CMD");
        assert_eq!(&bytes[16..24], &0x1000u64.to_ne_bytes(), "addr");
        assert_eq!(&bytes[24..28], &2u32.to_ne_bytes(), "len");
    }
}
