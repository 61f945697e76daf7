//! A raw NBD connection, for the requests and the misbehaviour no polite client produces.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// A raw NBD connection that has negotiated an export, for hand-made requests.
pub struct RawClient<S = UnixStream> {
    pub stream: S,
    pub size: u64,
    /// The first failed write of a request, returned by the next [`RawClient::reply`]: a
    /// server may go away between a request and its reply, and a test sees that where it
    /// reads the reply.
    failed_send: Option<std::io::Error>,
}

pub const NBD_CMD_READ: u16 = 0;
pub const NBD_CMD_WRITE: u16 = 1;
pub const NBD_CMD_DISC: u16 = 2;
pub const NBD_CMD_FLUSH: u16 = 3;

impl RawClient {
    /// Connects and opens `name` with NBD_OPT_EXPORT_NAME (simple replies only).
    pub fn connect(socket: &Path, name: &str) -> RawClient {
        let stream = UnixStream::connect(socket).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        RawClient::open(stream, name)
    }
}

impl RawClient<TcpStream> {
    /// The same over TCP to 127.0.0.1:`port`.
    pub fn connect_tcp(port: u16, name: &str) -> RawClient<TcpStream> {
        let stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        RawClient::open(stream, name)
    }
}

impl<S: Read + Write> RawClient<S> {
    fn open(mut stream: S, name: &str) -> RawClient<S> {
        let mut greeting = [0u8; 18];
        stream.read_exact(&mut greeting).unwrap();
        assert_eq!(&greeting[..8], b"NBDMAGIC");
        stream.write_all(&3u32.to_be_bytes()).unwrap(); // fixed newstyle, no zeroes
        let mut opt = b"IHAVEOPT".to_vec();
        opt.extend_from_slice(&1u32.to_be_bytes());
        opt.extend_from_slice(&(name.len() as u32).to_be_bytes());
        opt.extend_from_slice(name.as_bytes());
        stream.write_all(&opt).unwrap();
        let mut reply = [0u8; 10];
        stream.read_exact(&mut reply).unwrap();
        RawClient {
            stream,
            size: u64::from_be_bytes(reply[..8].try_into().unwrap()),
            failed_send: None,
        }
    }

    /// Sends a request (see `failed_send` for what happens when the write fails); a test that
    /// sends requests in pieces writes [`request_header`]s to `stream` itself.
    pub fn send(
        &mut self,
        flags: u16,
        command: u16,
        cookie: u64,
        offset: u64,
        len: u32,
        data: &[u8],
    ) {
        let mut req = request_header(flags, command, cookie, offset, len);
        req.extend_from_slice(data);
        if self.failed_send.is_none() {
            self.failed_send = self.stream.write_all(&req).err();
        }
    }

    /// Reads a simple reply: (error, cookie).
    pub fn reply(&mut self) -> std::io::Result<(u32, u64)> {
        if let Some(error) = self.failed_send.take() {
            return Err(error);
        }
        let mut reply = [0u8; 16];
        self.stream.read_exact(&mut reply)?;
        assert_eq!(
            u32::from_be_bytes(reply[..4].try_into().unwrap()),
            0x6744_6698
        );
        Ok((
            u32::from_be_bytes(reply[4..8].try_into().unwrap()),
            u64::from_be_bytes(reply[8..16].try_into().unwrap()),
        ))
    }

    /// True once the server has closed the connection (false if it is still open when the
    /// read timeout expires, or sends more data).
    pub fn is_closed(&mut self) -> bool {
        let mut byte = [0u8; 1];
        loop {
            return match self.stream.read(&mut byte) {
                Ok(n) => n == 0,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ),
            };
        }
    }
}

/// The 28 bytes that start an NBD request (its payload, if any, follows them).
pub fn request_header(flags: u16, command: u16, cookie: u64, offset: u64, len: u32) -> Vec<u8> {
    let mut header = 0x2560_9513u32.to_be_bytes().to_vec();
    header.extend_from_slice(&flags.to_be_bytes());
    header.extend_from_slice(&command.to_be_bytes());
    header.extend_from_slice(&cookie.to_be_bytes());
    header.extend_from_slice(&offset.to_be_bytes());
    header.extend_from_slice(&len.to_be_bytes());
    header
}
