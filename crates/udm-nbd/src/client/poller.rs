//! The one thread that reads the replies of every client of the process ("nbd-replies"). It
//! waits on all their sockets at once (epoll), so that a burst of replies spread over several
//! connections (a multipath's paths) wakes one thread once, not one thread per connection.
//!
//! The reader never waits on one socket: each watched connection has a buffer, and a reply
//! is handed to `reply::read_reply` only once it is whole in there (a big read's data, once
//! its head is: the data then goes straight into the caller's buffer as it comes, see
//! `reply::Direct`), so that a server that sends half a reply holds up no other connection.
//! A reply whose header is in and whose data is not is the connection's `partial` one (see
//! [`Conn::partial`]): past its deadline, it is taken for a server that stalls in the middle
//! of its data. The thread also looks, every `tick` of each client,
//! for mapped requests past their deadline (see `mapped::overdue`), and ends a connection
//! that breaks, or whose server stopped answering: its client's own thread then redials.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use log::error;

use super::connection::Conn;
use super::mapped::{overdue, tick};
use super::reconnect::Shared;
use super::reply::{frame, read_reply, Direct, ReplyError};
use crate::stream::Stream;

/// A connection's buffer, enough for dozens of small replies; it grows for a reply larger
/// than this other than a read's data (block status) while that one comes in.
const BUFFER: usize = 256 << 10;
/// A read of this much data or more goes from the socket straight to its caller's buffer
/// (see `reply::Direct`); a smaller one is copied from the reader's buffer, which is cheaper
/// than a receive of its own.
const DIRECT: usize = 64 << 10;
/// Reads of one connection per wake-up, so that a busy one does not starve the others.
const READS_PER_WAKE: usize = 8;
/// The epoll token of the eventfd that announces new connections.
const WAKE: u64 = 0;

/// The process's reply reader: its epoll, and the connections handed to it since it last
/// looked.
pub(super) struct Poller {
    epoll: OwnedFd,
    wake: OwnedFd,
    incoming: Mutex<Vec<Watch>>,
}

static POLLER: OnceLock<Result<Poller, String>> = OnceLock::new();

/// Hands an established connection to the reader; when it ends, its client hears through
/// `Shared::connection_lost` (its state's `conn` goes away). An error means there is no
/// reader (epoll or the thread could not be made).
pub(super) fn watch(shared: Arc<Shared>, conn: Arc<Conn>, stream: Stream) -> Result<(), String> {
    let poller = POLLER.get_or_init(Poller::start).as_ref()?;
    poller.incoming.lock().push(Watch {
        tick: tick(&shared.target.options),
        shared,
        conn,
        stream,
        buf: vec![0; BUFFER],
        start: 0,
        end: 0,
        direct: None,
        last_look: Instant::now(),
    });
    let one = 1u64.to_ne_bytes();
    // SAFETY: writing 8 bytes from a live buffer to our own eventfd.
    unsafe { libc::write(poller.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
    Ok(())
}

thread_local! {
    static IS_READER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is the reply reader.
pub(super) fn is_reader() -> bool {
    IS_READER.get()
}

fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// Takes ownership of a file descriptor a system call just returned.
fn owned(fd: io::Result<libc::c_int>) -> io::Result<OwnedFd> {
    // SAFETY: a fresh descriptor, owned by nobody else.
    fd.map(|fd| unsafe { OwnedFd::from_raw_fd(fd) })
}

impl Poller {
    fn start() -> Result<Poller, String> {
        let make = || -> io::Result<Poller> {
            // SAFETY: plain system calls with constant arguments.
            let epoll = owned(cvt(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) }))?;
            let wake = owned(cvt(unsafe {
                libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK)
            }))?;
            let poller = Poller {
                epoll,
                wake,
                incoming: Mutex::new(Vec::new()),
            };
            poller.ctl(libc::EPOLL_CTL_ADD, poller.wake.as_raw_fd(), WAKE)?;
            Ok(poller)
        };
        let poller = make().map_err(|e| format!("cannot make the nbd reply reader: {e}"))?;
        std::thread::Builder::new()
            .name("nbd-replies".into())
            .spawn(|| {
                // The thread may run before `start` returns and the poller is in place.
                let poller = POLLER.wait().as_ref();
                poller.expect("the thread starts only with a poller").run()
            })
            .map_err(|e| format!("cannot start the nbd reply reader: {e}"))?;
        Ok(poller)
    }

    fn ctl(&self, op: libc::c_int, fd: RawFd, token: u64) -> io::Result<()> {
        let mut event = libc::epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLRDHUP) as u32,
            u64: token,
        };
        // SAFETY: `event` lives across the call; a bad fd is reported, not undefined.
        cvt(unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), op, fd, &mut event) }).map(drop)
    }

    fn run(&self) {
        IS_READER.set(true);
        let mut watches: HashMap<u64, Watch> = HashMap::new();
        let mut next_token = WAKE + 1;
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 64];
        loop {
            let timeout = next_look(&watches);
            // SAFETY: `events` is valid for its length.
            let n = unsafe {
                libc::epoll_wait(self.epoll.as_raw_fd(), events.as_mut_ptr(), 64, timeout)
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    error!("nbd reply reader: epoll_wait: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                }
                continue;
            }
            for event in &events[..n as usize] {
                let token = event.u64;
                if token == WAKE {
                    self.adopt(&mut watches, &mut next_token);
                } else if let Some(watch) = watches.get_mut(&token) {
                    if let Err(why) = watch.on_readable() {
                        self.end(&mut watches, token, &why);
                    }
                }
            }
            let now = Instant::now();
            let overdue: Vec<(u64, String)> = watches
                .iter_mut()
                .filter_map(|(token, watch)| Some((*token, watch.look(now).err()?)))
                .collect();
            for (token, why) in overdue {
                self.end(&mut watches, token, &why);
            }
        }
    }

    /// Starts watching the connections handed over since the last time.
    fn adopt(&self, watches: &mut HashMap<u64, Watch>, next_token: &mut u64) {
        let mut count = [0u8; 8];
        // SAFETY: reading 8 bytes into a live buffer from our own (non-blocking) eventfd.
        unsafe { libc::read(self.wake.as_raw_fd(), count.as_mut_ptr().cast(), 8) };
        let incoming = std::mem::take(&mut *self.incoming.lock());
        for watch in incoming {
            let token = *next_token;
            *next_token += 1;
            match self.ctl(libc::EPOLL_CTL_ADD, watch.stream.as_raw_fd(), token) {
                Ok(()) => {
                    watches.insert(token, watch);
                }
                Err(e) => watch.lost(&format!("cannot watch the socket: {e}")),
            }
        }
    }

    /// Stops watching a connection that broke, and tells its client.
    fn end(&self, watches: &mut HashMap<u64, Watch>, token: u64, why: &str) {
        if let Some(watch) = watches.remove(&token) {
            // The socket has other descriptors (the writer's): it stays in the epoll set
            // until told otherwise.
            let _ = self.ctl(libc::EPOLL_CTL_DEL, watch.stream.as_raw_fd(), token);
            watch.lost(why);
        }
    }
}

/// Milliseconds until the first connection is due a look for overdue requests; -1 (for ever)
/// with none.
fn next_look(watches: &HashMap<u64, Watch>) -> libc::c_int {
    let now = Instant::now();
    watches
        .values()
        .map(|w| (w.last_look + w.tick).saturating_duration_since(now))
        .min()
        .map_or(-1, |wait| wait.as_millis().saturating_add(1) as libc::c_int)
}

/// One connection the reader watches, and the bytes of it not yet delivered.
struct Watch {
    shared: Arc<Shared>,
    conn: Arc<Conn>,
    stream: Stream,
    tick: Duration,
    last_look: Instant,
    /// Received bytes are `buf[start..end]`.
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// A big read's data on its way.
    direct: Option<Direct>,
}

impl Watch {
    /// Reads what the socket has and delivers every whole reply; an error (why) ends the
    /// connection.
    fn on_readable(&mut self) -> Result<(), String> {
        for _ in 0..READS_PER_WAKE {
            // A big read's data goes straight to its caller's buffer; while it comes, the
            // reader's own buffer is empty (`deliver` gave it all).
            let (into, len, direct) = match self.direct.as_mut().and_then(Direct::spare) {
                Some(spare) => (spare.as_mut_ptr(), spare.len(), true),
                None => {
                    let spare = &mut self.buf[self.end..];
                    (spare.as_mut_ptr(), spare.len(), false)
                }
            };
            // SAFETY: `into` is valid for `len` bytes. MSG_DONTWAIT rather than O_NONBLOCK,
            // which would make the writer's descriptor (the same socket) non-blocking too.
            let n = unsafe {
                libc::recv(
                    self.stream.as_raw_fd(),
                    into.cast(),
                    len,
                    libc::MSG_DONTWAIT,
                )
            };
            if n == 0 {
                return Err("the server closed the connection".into());
            }
            if n < 0 {
                let e = io::Error::last_os_error();
                return match e.kind() {
                    io::ErrorKind::WouldBlock => Ok(()),
                    io::ErrorKind::Interrupted => continue,
                    _ => Err(e.to_string()),
                };
            }
            match &mut self.direct {
                Some(d) if direct => d.advance(n as usize),
                _ => self.end += n as usize,
            }
            self.deliver().map_err(|e| e.to_string())?;
            // A read that did not fill the room emptied the socket: asking again would only
            // answer EAGAIN (half the receives, measured), and the level-triggered epoll
            // reports what arrives since.
            if (n as usize) < len {
                break;
            }
        }
        Ok(())
    }

    /// Hands every whole reply in the buffer over (and the head of a big read, whose data
    /// then comes straight to its caller's buffer), and makes room for the rest of the next.
    fn deliver(&mut self) -> Result<(), ReplyError> {
        let writes_lost = &self.shared.writes_lost;
        loop {
            if let Some(direct) = &mut self.direct {
                self.start += direct.feed(&self.buf[self.start..self.end]);
                if direct.left() == 0 {
                    let direct = self.direct.take().expect("checked above");
                    direct.finish(&self.conn, writes_lost);
                }
            }
            if self.start == self.end {
                self.start = 0;
                self.end = 0;
                if self.buf.len() > BUFFER {
                    self.buf = vec![0; BUFFER];
                }
                let partial = self.direct.as_ref().map_or(0, Direct::cookie);
                self.conn.partial.store(partial, Ordering::Release);
                return Ok(());
            }
            let received = &self.buf[self.start..self.end];
            let frame = frame(&self.conn, received)?;
            let direct = frame.data >= DIRECT;
            let len = if direct {
                frame.head
            } else {
                frame.head + frame.data
            };
            if received.len() < len {
                self.conn.partial.store(frame.cookie, Ordering::Release);
                self.make_room(len);
                return Ok(());
            }
            let mut reply = &received[..len];
            self.direct = read_reply(&self.conn, &mut reply, writes_lost, direct)?;
            if !reply.is_empty() || direct != self.direct.is_some() {
                return Err(ReplyError::Protocol(
                    "a reply not as long as it said".into(),
                ));
            }
            self.start += len;
        }
    }

    /// Makes sure a reply of `len` bytes starting at `start` fits in the buffer.
    fn make_room(&mut self, len: usize) {
        if self.start + len <= self.buf.len() {
            return;
        }
        self.buf.copy_within(self.start..self.end, 0);
        self.end -= self.start;
        self.start = 0;
        if len > self.buf.len() {
            self.buf.resize(len, 0);
        }
    }

    /// Fails the mapped requests past their deadline, if a tick has passed since the last
    /// look; an error (why) means the connection is to be dropped.
    fn look(&mut self, now: Instant) -> Result<(), String> {
        if now < self.last_look + self.tick {
            return Ok(());
        }
        self.last_look = now;
        overdue(&self.conn)
    }

    fn lost(self, why: &str) {
        if let Some(direct) = self.direct {
            direct.abort();
        }
        self.shared.connection_lost(&self.conn, why);
    }
}
