//! A loop's mailbox: where other threads (the acceptor, pool jobs, mappings done waiting)
//! leave work for it, with an eventfd that wakes it.

use super::*;

pub(super) enum Message {
    Attach(Box<Attach>),
    /// A pool job finished.
    Done {
        conn: usize,
        request: Request,
        result: Result<Outcome, BlockError>,
        payload: Option<Payload>,
    },
    /// A parked request's mapping is done waiting (see [`Mapping::when_ready`]).
    Ready {
        owner: u64,
        op: MapOp,
        ready: Ready,
    },
}

/// Where other threads leave work for a loop; the eventfd wakes it.
pub(super) struct Mailbox {
    messages: Mutex<Vec<Message>>,
    /// The eventfd the loop keeps a read on; a post that finds the list empty writes it.
    pub wake: OwnedFd,
    /// Connections attached to the loop and not yet detached.
    pub connections: AtomicUsize,
}

impl Mailbox {
    pub fn new() -> io::Result<Mailbox> {
        // SAFETY: eventfd returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Mailbox {
            messages: Mutex::new(Vec::new()),
            // SAFETY: fd is a fresh descriptor we own.
            wake: unsafe { OwnedFd::from_raw_fd(fd) },
            connections: AtomicUsize::new(0),
        })
    }

    pub fn post(&self, message: Message) {
        let was_empty = {
            let mut messages = self.messages.lock();
            messages.push(message);
            messages.len() == 1
        };
        // One wake-up per batch: the loop takes every message after each wake-up, so the
        // messages posted before it does ride on the first one's (a remote export's reader
        // completes requests one after another).
        if !was_empty {
            return;
        }
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a u64 to our eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    pub fn take(&self) -> Vec<Message> {
        std::mem::take(&mut *self.messages.lock())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The eventfd's count (and resets it).
    fn wake_ups(mailbox: &Mailbox) -> u64 {
        let mut count = 0u64;
        // SAFETY: reads 8 bytes into a u64 from our eventfd.
        unsafe { libc::read(mailbox.wake.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
        count
    }

    fn ready() -> Message {
        Message::Ready {
            owner: 0,
            op: MapOp::Flush,
            ready: Ready::Retry,
        }
    }

    #[test]
    fn messages_posted_before_the_loop_takes_them_share_one_wake_up() {
        let mailbox = Mailbox::new().unwrap();
        for _ in 0..3 {
            mailbox.post(ready());
        }
        assert_eq!(wake_ups(&mailbox), 1);
        assert_eq!(mailbox.take().len(), 3);
        // Taken: the next one wakes the loop again.
        mailbox.post(ready());
        assert_eq!(wake_ups(&mailbox), 1);
    }
}
