//! The bounded pool of threads that serve, on the synchronous code, what a queue must not
//! wait for: requests of devices that cannot say where their data lives (delay, log-writes,
//! a clone's partial writes, remote sources), unaligned reads and writes, fallocate, opens.
//! A thread takes a job (a slot holding a request), leaves the reply in the slot, and posts
//! the slot back to its queue, whose ring waits on the mailbox's eventfd. The same mailbox
//! brings back mapped requests whose steps (a delay's timer, a snapshot copy-out) are done.

use parking_lot::Mutex;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;

use udm_block::{MapOp, Ready};

use crate::error::FuseError;
use crate::session::Session;

use super::slot::{SlotBufs, SlotServer};

/// A request handed to the pool: the slot holding it and where to post it when served.
pub(crate) struct Job {
    pub bufs: SlotBufs,
    pub slot: u16,
    pub mailbox: Arc<Mailbox>,
}

pub(crate) type Jobs = Arc<Mutex<Receiver<Job>>>;

pub(crate) fn jobs() -> (Sender<Job>, Jobs) {
    let (tx, rx) = mpsc::channel();
    (tx, Arc::new(Mutex::new(rx)))
}

/// Serves jobs until every queue has gone (the last sender is dropped).
pub(crate) fn run(session: Arc<Session>, jobs: Jobs) {
    let mut server = SlotServer::new(&session);
    loop {
        let job = match jobs.lock().recv() {
            Ok(job) => job,
            Err(_) => return,
        };
        // SAFETY: the queue handed the slot over with the job and does not touch it until
        // it is posted back.
        unsafe { server.serve(&session, job.bufs) };
        job.mailbox.post(Posted::Served(job.slot));
    }
}

/// What comes back to a queue from other threads.
// `Ready` carries a mapping, whose first entries are inline (see `udm_block::Mapping`):
// boxing it would cost the allocation they save.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Posted {
    /// The pool served the request in this slot; its reply is in the slot.
    Served(u16),
    /// The steps and transfers the mapping of the request in `slot` waited for are done (or
    /// one failed, or asked for the synchronous way): its pieces may go to the engine now.
    Ready { slot: u16, op: MapOp, ready: Ready },
}

/// Slots on their way back to their queue.
pub(crate) struct Mailbox {
    posted: Mutex<Vec<Posted>>,
    /// Readable when `posted` may hold something: the queue's ring polls it.
    eventfd: OwnedFd,
}

impl Mailbox {
    pub fn new() -> Result<Mailbox, FuseError> {
        // SAFETY: plain syscall.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(FuseError::last_os("eventfd"));
        }
        Ok(Mailbox {
            posted: Mutex::new(Vec::new()),
            // SAFETY: just created, owned by nobody else.
            eventfd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    pub fn eventfd(&self) -> i32 {
        self.eventfd.as_raw_fd()
    }

    pub fn post(&self, posted: Posted) {
        self.posted.lock().push(posted);
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a local. It cannot fail short of the counter reaching
        // u64::MAX - 1, which a queue reading it never lets happen.
        unsafe { libc::write(self.eventfd.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    /// What was posted since the last call. Resets the eventfd first, so that a slot
    /// posted meanwhile makes it readable again.
    pub fn take(&self) -> Vec<Posted> {
        let mut count = [0u8; 8];
        // SAFETY: reads 8 bytes into a local; EAGAIN (nothing posted) is fine.
        unsafe { libc::read(self.eventfd.as_raw_fd(), count.as_mut_ptr().cast(), 8) };
        std::mem::take(&mut *self.posted.lock())
    }
}
