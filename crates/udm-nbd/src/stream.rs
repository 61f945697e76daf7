//! A connected socket, Unix or TCP, behind one type.

use std::fmt;
use std::io::{self, IoSlice, Read, Write};
use std::net::{IpAddr, Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

pub enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

/// Who is at the other end, for per-client limits: the user of a Unix socket peer, the
/// address (not the port) of a TCP one.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ClientKey {
    Uid(u32),
    /// A Unix socket peer's process (see [`Stream::client_process`]).
    Pid(i32),
    Ip(IpAddr),
}

impl fmt::Display for ClientKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientKey::Uid(uid) => write!(f, "uid {uid}"),
            ClientKey::Pid(pid) => write!(f, "pid {pid}"),
            ClientKey::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

impl Stream {
    pub fn client_key(&self) -> io::Result<ClientKey> {
        match self {
            // IPv4 clients of a dual-stack listener count as the IPv4 address they are.
            Stream::Tcp(s) => Ok(ClientKey::Ip(s.peer_addr()?.ip().to_canonical())),
            Stream::Unix(s) => Ok(ClientKey::Uid(peer_credentials(s)?.uid)),
        }
    }

    /// Who is at the other end, finer than [`Stream::client_key`]: the process of a Unix
    /// socket peer (each of a user's programs is a client of its own), the address of a TCP
    /// one (the same as `client_key`: nothing finer is known of it).
    pub fn client_process(&self) -> io::Result<ClientKey> {
        match self {
            Stream::Unix(s) => Ok(ClientKey::Pid(peer_credentials(s)?.pid)),
            Stream::Tcp(_) => self.client_key(),
        }
    }

    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
        })
    }

    pub fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_read_timeout(timeout),
            Stream::Tcp(s) => s.set_read_timeout(timeout),
        }
    }

    pub fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_write_timeout(timeout),
            Stream::Tcp(s) => s.set_write_timeout(timeout),
        }
    }

    pub fn write_timeout(&self) -> io::Result<Option<Duration>> {
        match self {
            Stream::Unix(s) => s.write_timeout(),
            Stream::Tcp(s) => s.write_timeout(),
        }
    }

    pub fn read_timeout(&self) -> io::Result<Option<Duration>> {
        match self {
            Stream::Unix(s) => s.read_timeout(),
            Stream::Tcp(s) => s.read_timeout(),
        }
    }

    pub fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_nonblocking(nonblocking),
            Stream::Tcp(s) => s.set_nonblocking(nonblocking),
        }
    }

    pub fn shutdown(&self) {
        let _ = match self {
            Stream::Unix(s) => s.shutdown(Shutdown::Both),
            Stream::Tcp(s) => s.shutdown(Shutdown::Both),
        };
    }

    /// Shuts the connection down for good, discarding what it has not delivered yet: a TCP
    /// socket is reset when closed (SO_LINGER 0) instead of sending its queue and a FIN. A
    /// request given up on (and sent again elsewhere) must not reach the server later, when a
    /// cut link comes back, and overwrite what was written since.
    pub fn abort(&self) {
        if let Stream::Tcp(s) = self {
            let linger = libc::linger {
                l_onoff: 1,
                l_linger: 0,
            };
            // SAFETY: SO_LINGER reads a linger of the size passed.
            unsafe {
                libc::setsockopt(
                    s.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_LINGER,
                    (&linger as *const libc::linger).cast(),
                    std::mem::size_of::<libc::linger>() as libc::socklen_t,
                )
            };
        }
        self.shutdown();
    }

    /// Writes every byte of every slice, in as few system calls as the kernel allows.
    pub fn write_all_vectored(&mut self, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
        IoSlice::advance_slices(&mut slices, 0);
        while !slices.is_empty() {
            match self.write_vectored(slices) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => IoSlice::advance_slices(&mut slices, n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// The credentials of a Unix socket's peer, as it connected.
fn peer_credentials(s: &UnixStream) -> io::Result<libc::ucred> {
    // SAFETY: SO_PEERCRED fills a ucred of the size passed.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred)
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Stream::Unix(s) => s.as_raw_fd(),
            Stream::Tcp(s) => s.as_raw_fd(),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write(buf),
            Stream::Tcp(s) => s.write(buf),
        }
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write_vectored(bufs),
            Stream::Tcp(s) => s.write_vectored(bufs),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A handshake's stream: a read waits no longer than what is left of the handshake's
/// timeout, which bounds the whole handshake. As each read's own timeout, it did not: a peer
/// that sent a byte now and then stayed in the handshake for good (a client of our server,
/// with a thread and a connection slot; a server we dial, with the verb that dials it).
pub(crate) struct Deadline<'a> {
    pub(crate) stream: &'a mut Stream,
    until: Instant,
    timeout: Duration,
    /// Who the other end is, for the error: "client" or "server".
    peer: &'static str,
}

impl<'a> Deadline<'a> {
    pub(crate) fn new(stream: &'a mut Stream, timeout: Duration, peer: &'static str) -> Self {
        Deadline {
            stream,
            until: Instant::now() + timeout,
            timeout,
            peer,
        }
    }
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the {} took longer than {:?} over the handshake",
                    self.peer, self.timeout
                ),
            ));
        }
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read(buf)
    }
}

impl Write for Deadline<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}
