//! Refused clients are told why by one thread for the whole process, `nbd-refuse`: each
//! refused socket, non-blocking, goes through the handshake's [`Refusal`] as its bytes come,
//! all of them in one `poll`. Before, each had a thread of its own for up to
//! [`REFUSAL_TIMEOUT`], and past 16 at once the rest were closed without a word: a client
//! refused while 16 others sat on their answer never learned why. Now a refusal costs a
//! socket and a few hundred bytes, for at most [`REFUSAL_TIMEOUT`]; [`MAX_REFUSING`] bounds
//! how many are pending at once (a flood), past which the oldest is let go.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use log::{debug, warn};
use parking_lot::{Condvar, Mutex};

use crate::handshake::Refusal;
use crate::stream::Stream;

/// How long a refused client has to read why.
const REFUSAL_TIMEOUT: Duration = Duration::from_secs(5);
/// Refusals pending at once: each holds a descriptor until its client has read the answer,
/// or [`REFUSAL_TIMEOUT`].
const MAX_REFUSING: usize = 1024;

/// How often the thread looks for newly refused sockets while it waits on others: it holds
/// no descriptor of its own to be woken by (a daemon's descriptors are all its clients').
const ARRIVALS: Duration = Duration::from_millis(50);

/// Refused sockets on their way to the thread.
struct Inbox {
    arrived: Mutex<Vec<(Stream, Arc<str>)>>,
    /// Wakes the thread when it has nothing else to wait on.
    arrival: Condvar,
    /// The thread started: without it, refused clients are closed without a word.
    running: bool,
}

static INBOX: OnceLock<Inbox> = OnceLock::new();

/// Tells the client on `stream` why it is refused, in the handshake, without waiting.
pub fn refuse(stream: Stream, why: Arc<str>) {
    let inbox = INBOX.get_or_init(|| {
        let started = std::thread::Builder::new()
            .name("nbd-refuse".into())
            .spawn(run);
        if let Err(e) = &started {
            warn!("nbd: cannot start the thread that answers refused clients: {e}");
        }
        Inbox {
            arrived: Mutex::default(),
            arrival: Condvar::new(),
            running: started.is_ok(),
        }
    });
    if inbox.running {
        inbox.arrived.lock().push((stream, why));
        inbox.arrival.notify_one();
    }
}

/// One refused client.
struct Pending {
    stream: Stream,
    refusal: Refusal,
    /// Answers not yet sent.
    out: Vec<u8>,
    deadline: Instant,
}

impl Pending {
    /// Reads and writes what the socket allows now; false once the connection is done with.
    fn progress(&mut self, readable: bool) -> bool {
        if readable && !self.refusal.is_over() {
            let mut buf = [0u8; 4096];
            loop {
                match self.stream.read(&mut buf) {
                    Ok(0) => return false,
                    Ok(n) => self.refusal.receive(&buf[..n], &mut self.out),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return gone(e),
                }
                if self.refusal.is_over() {
                    break;
                }
            }
        }
        while !self.out.is_empty() {
            match self.stream.write(&self.out) {
                Ok(n) => drop(self.out.drain(..n)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return gone(e),
            }
        }
        !self.refusal.is_over()
    }
}

/// A refused client's socket failed: it is let go.
fn gone(e: io::Error) -> bool {
    debug!("nbd: refused client: {e}");
    false
}

/// The thread: takes in refused sockets as they arrive and answers each as it reads.
fn run() {
    let inbox = INBOX.wait();
    let mut pending: VecDeque<Pending> = VecDeque::new();
    loop {
        let arrived = {
            let mut arrived = inbox.arrived.lock();
            while pending.is_empty() && arrived.is_empty() {
                inbox.arrival.wait(&mut arrived);
            }
            std::mem::take(&mut *arrived)
        };
        for (stream, why) in arrived {
            if let Some(p) = admit(stream, why) {
                if pending.len() == MAX_REFUSING {
                    pending.pop_front();
                }
                pending.push_back(p);
            }
        }
        if pending.is_empty() {
            continue;
        }
        let mut fds: Vec<libc::pollfd> = pending
            .iter()
            .map(|p| libc::pollfd {
                fd: p.stream.as_raw_fd(),
                events: if p.out.is_empty() {
                    libc::POLLIN
                } else {
                    libc::POLLIN | libc::POLLOUT
                },
                revents: 0,
            })
            .collect();
        let now = Instant::now();
        let timeout = pending
            .iter()
            .map(|p| p.deadline.saturating_duration_since(now))
            .fold(ARRIVALS, Duration::min);
        let timeout = timeout.as_millis() as libc::c_int + 1;
        // SAFETY: `fds` is a live array of `fds.len()` pollfd structures.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        if ready < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                warn!("nbd: refusals: poll: {e}");
                std::thread::sleep(ARRIVALS);
            }
            continue;
        }
        let now = Instant::now();
        pending = pending
            .into_iter()
            .zip(&fds)
            .filter_map(|(mut p, fd)| {
                let readable = fd.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0;
                let live = fd.revents == 0 || p.progress(readable);
                (live && now < p.deadline).then_some(p)
            })
            .collect();
    }
}

/// A refused socket, greeted; `None` when it is already done with.
fn admit(stream: Stream, why: Arc<str>) -> Option<Pending> {
    if let Err(e) = stream.set_nonblocking(true) {
        debug!("nbd: refused client: {e}");
        return None;
    }
    let (refusal, greeting) = Refusal::new(why);
    let mut p = Pending {
        stream,
        refusal,
        out: greeting,
        deadline: Instant::now() + REFUSAL_TIMEOUT,
    };
    p.progress(false).then_some(p)
}
