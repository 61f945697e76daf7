//! The NBD client: a remote export as a udm [`BlockDevice`], so a clone can hydrate from
//! `nbd://backup-host/vol`.
//!
//! One connection carries every request. Callers write their request under a writer lock with
//! a fresh cookie and sleep on a slot of their own; one thread per client reads the replies,
//! copies read data straight from the socket into the caller's buffer, and wakes the slot.
//! The same thread, when the connection breaks, redials with backoff. Requests in flight
//! then are not failed: their callers resend them once the connection is back (reads, writes,
//! flushes and the rest are all idempotent), and only a request older than `io_timeout`
//! fails, so nothing waits forever on a server that stays away. A server that answers
//! ESHUTDOWN is going away cleanly: that counts as a broken connection too, and closing ours
//! lets it exit.
//!
//! A client can also start without a connection ([`NbdClient::disconnected`]), for a device
//! that must come back while its remote is down: the size it was last seen with stands in
//! until the first connection confirms it.

use std::collections::HashMap;
use std::io::{self, BufReader, IoSlice, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{debug, error, info, warn};
use thiserror::Error;
use udm_block::{
    write_zeroes_by_writing, BlockDevice, BlockError, Capabilities, Extent, WriteFlags, ZeroFlags,
    EXTENT_HOLE, EXTENT_ZERO,
};

use crate::protocol::*;
use crate::stream::Stream;
use crate::uri::{NbdAddress, NbdUri, UriError};

/// Requests are split to this size at most, whatever the server allows: the protocol's
/// portable maximum, which no server treats as a denial of service.
const MAX_REQUEST: u32 = 32 << 20;
/// TRIM and BLOCK_STATUS carry no payload and may exceed the maximum block size; they are
/// still bounded by the 32-bit length field. 2 GiB stays aligned to any minimum block size.
const MAX_NO_PAYLOAD: u64 = 1 << 31;
const SECTOR: u32 = 512;
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Option replies are small (info, context names, messages of at most 4 KiB); anything
/// larger is a broken or hostile server.
const MAX_OPTION_REPLY: u32 = 64 * 1024;
/// Block status and error chunks are buffered; a sane one is far smaller.
const MAX_CHUNK_PAYLOAD: u32 = 16 << 20;

#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Refuse writes locally even if the export is writable.
    pub read_only: bool,
    /// A request not completed within this time (because the server is unreachable or does
    /// not answer) fails with EIO.
    pub io_timeout: Duration,
    /// Bounds each connection attempt: dialling and the handshake.
    pub connect_timeout: Duration,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            read_only: false,
            io_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
        }
    }
}

/// Why [`NbdClient::connect`] failed.
#[derive(Debug, Error)]
pub enum ClientError {
    #[error(transparent)]
    Uri(#[from] UriError),
    #[error("cannot connect to nbd server {address}: {source}")]
    Connect {
        address: String,
        #[source]
        source: io::Error,
    },
    #[error("nbd server {address}: handshake failed: {source}")]
    Handshake {
        address: String,
        #[source]
        source: io::Error,
    },
    #[error("nbd server {address}: {what}")]
    Protocol { address: String, what: String },
    #[error("nbd server {address} refused export '{export}': {message}")]
    Refused {
        address: String,
        export: String,
        message: String,
    },
}

/// What the handshake told us about the export.
#[derive(Debug, Clone, Copy)]
struct ExportInfo {
    size: u64,
    flags: u16,
    min_block: u32,
    /// Largest READ/WRITE/WRITE_ZEROES/CACHE we send: the server's maximum, capped at
    /// [`MAX_REQUEST`] and aligned.
    max_request: u32,
    structured: bool,
    /// The id the server gave `base:allocation`, if it was negotiated.
    base_allocation: Option<u32>,
}

impl ExportInfo {
    fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }
}

/// The export the handshake ended on.
struct Selected {
    size: u64,
    flags: u16,
    /// Minimum and maximum block size, if the server told them.
    block: Option<(u32, u32)>,
}

/// Where to connect and what to ask for; everything needed to dial again.
struct Target {
    address: NbdAddress,
    export: String,
    options: ClientOptions,
}

impl Target {
    fn parse(uri: &str, options: ClientOptions) -> Result<Target, ClientError> {
        let NbdUri { address, export } = uri.parse()?;
        Ok(Target {
            address,
            export,
            options,
        })
    }

    /// What about a freshly negotiated export the user should know.
    fn warn_about(&self, info: &ExportInfo) {
        if info.min_block > SECTOR {
            warn!(
                "nbd server {}: export '{}' needs {}-byte alignment; smaller requests will fail",
                self.address, self.export, info.min_block
            );
        }
        if !info.size.is_multiple_of(SECTOR.into()) {
            warn!(
                "nbd server {}: export '{}' is {} bytes; the last partial sector is not used",
                self.address, self.export, info.size
            );
        }
    }

    fn protocol(&self, what: impl Into<String>) -> ClientError {
        ClientError::Protocol {
            address: self.address.to_string(),
            what: what.into(),
        }
    }

    fn handshake_io(&self, source: io::Error) -> ClientError {
        ClientError::Handshake {
            address: self.address.to_string(),
            source,
        }
    }

    fn refused(&self, message: String) -> ClientError {
        ClientError::Refused {
            address: self.address.to_string(),
            export: self.export.clone(),
            message,
        }
    }

    /// Connects and negotiates; the stream is ready for transmission.
    fn dial(&self) -> Result<(Stream, ExportInfo), ClientError> {
        let stream = self.open_socket().map_err(|source| ClientError::Connect {
            address: self.address.to_string(),
            source,
        })?;
        let timeout = Some(self.options.connect_timeout);
        stream
            .set_read_timeout(timeout)
            .and_then(|()| set_write_timeout(&stream, timeout))
            .map_err(|e| self.handshake_io(e))?;
        let mut stream = stream;
        let info = self.handshake(&mut stream)?;
        // The reader waits for replies as long as it takes (the connection is ended by
        // shutdown); a writer stuck on a server that stopped reading gives up after io_timeout.
        stream
            .set_read_timeout(None)
            .and_then(|()| set_write_timeout(&stream, Some(self.options.io_timeout)))
            .map_err(|e| self.handshake_io(e))?;
        Ok((stream, info))
    }

    fn open_socket(&self) -> io::Result<Stream> {
        match &self.address {
            NbdAddress::Unix { path } => UnixStream::connect(path).map(Stream::Unix),
            NbdAddress::Tcp { host, port } => {
                let mut last = None;
                for addr in (host.as_str(), *port).to_socket_addrs()? {
                    match TcpStream::connect_timeout(&addr, self.options.connect_timeout) {
                        Ok(s) => {
                            // Requests are small and latency-bound; don't let Nagle hold them.
                            s.set_nodelay(true)?;
                            return Ok(Stream::Tcp(s));
                        }
                        Err(e) => last = Some(e),
                    }
                }
                Err(last.unwrap_or_else(|| {
                    io::Error::new(io::ErrorKind::NotFound, "the host has no address")
                }))
            }
        }
    }

    fn handshake(&self, s: &mut Stream) -> Result<ExportInfo, ClientError> {
        let mut greeting = [0u8; 18];
        s.read_exact(&mut greeting)
            .map_err(|e| self.handshake_io(e))?;
        let magic = u64::from_be_bytes(greeting[0..8].try_into().unwrap());
        let style = u64::from_be_bytes(greeting[8..16].try_into().unwrap());
        let flags = u16::from_be_bytes(greeting[16..18].try_into().unwrap());
        if magic != NBDMAGIC {
            return Err(self.protocol(format!("not an NBD server (magic {magic:#x})")));
        }
        if style == OLDSTYLE_MAGIC {
            return Err(self.protocol("oldstyle negotiation is not supported"));
        }
        if style != IHAVEOPT {
            return Err(self.protocol(format!("bad handshake magic {style:#x}")));
        }
        if flags & FLAG_FIXED_NEWSTYLE == 0 {
            return Err(self.protocol("the server does not support fixed newstyle negotiation"));
        }
        let no_zeroes = flags & FLAG_NO_ZEROES != 0;
        let client_flags = CLIENT_FIXED_NEWSTYLE | if no_zeroes { CLIENT_NO_ZEROES } else { 0 };
        s.write_all(&client_flags.to_be_bytes())
            .map_err(|e| self.handshake_io(e))?;

        let structured = self.negotiate_structured_replies(s)?;
        let base_allocation = if structured {
            self.negotiate_base_allocation(s)?
        } else {
            None
        };
        let Selected { size, flags, block } = match self.go(s)? {
            Some(selected) => selected,
            None => self.export_name(s, no_zeroes)?,
        };
        let (min_block, max_block) = match block {
            Some((min, max)) => (min.max(1), max),
            None => (1, MAX_REQUEST),
        };
        let align = min_block.max(SECTOR);
        let max_request = (max_block.min(MAX_REQUEST) / align * align).max(align);
        Ok(ExportInfo {
            size,
            flags,
            min_block,
            max_request,
            structured,
            base_allocation,
        })
    }

    fn send_option(&self, s: &mut Stream, option: u32, data: &[u8]) -> Result<(), ClientError> {
        s.write_all(&encode_option(option, data))
            .map_err(|e| self.handshake_io(e))
    }

    /// Reads one reply to `option`: its type and data.
    fn option_reply(&self, s: &mut Stream, option: u32) -> Result<(u32, Vec<u8>), ClientError> {
        let mut header = [0u8; OPTION_REPLY_HEADER_LEN];
        s.read_exact(&mut header)
            .map_err(|e| self.handshake_io(e))?;
        let header =
            parse_option_reply_header(&header).map_err(|e| self.protocol(e.to_string()))?;
        if header.option != option {
            return Err(self.protocol(format!(
                "reply to option {} while waiting for option {option}",
                header.option
            )));
        }
        if header.length > MAX_OPTION_REPLY {
            return Err(self.protocol(format!("option reply of {} bytes", header.length)));
        }
        let mut data = vec![0u8; header.length as usize];
        s.read_exact(&mut data).map_err(|e| self.handshake_io(e))?;
        Ok((header.reply, data))
    }

    /// An option error's words: the server's message, or what the code means.
    fn error_text(reply: u32, data: &[u8]) -> String {
        match String::from_utf8_lossy(data).trim() {
            "" => option_error_name(reply).to_string(),
            text => text.to_string(),
        }
    }

    fn negotiate_structured_replies(&self, s: &mut Stream) -> Result<bool, ClientError> {
        self.send_option(s, OPT_STRUCTURED_REPLY, &[])?;
        match self.option_reply(s, OPT_STRUCTURED_REPLY)? {
            (REP_ACK, _) => Ok(true),
            (reply, data) if reply & REP_ERR_BIT != 0 => {
                // Older servers: reads come back as simple replies, block status is unknown.
                debug!(
                    "nbd server {}: no structured replies: {}",
                    self.address,
                    Self::error_text(reply, &data)
                );
                Ok(false)
            }
            (reply, _) => Err(self.protocol(format!(
                "unexpected reply {reply:#x} to NBD_OPT_STRUCTURED_REPLY"
            ))),
        }
    }

    fn negotiate_base_allocation(&self, s: &mut Stream) -> Result<Option<u32>, ClientError> {
        let data = encode_meta_context_request(&self.export, &[BASE_ALLOCATION]);
        self.send_option(s, OPT_SET_META_CONTEXT, &data)?;
        let mut id = None;
        loop {
            match self.option_reply(s, OPT_SET_META_CONTEXT)? {
                (REP_META_CONTEXT, data) => {
                    let (context, name) = parse_meta_context_reply(&data)
                        .map_err(|e| self.protocol(e.to_string()))?;
                    if name == BASE_ALLOCATION {
                        id = Some(context);
                    }
                }
                (REP_ACK, _) => return Ok(id),
                (reply, data) if reply & REP_ERR_BIT != 0 => {
                    debug!(
                        "nbd server {}: no base:allocation: {}",
                        self.address,
                        Self::error_text(reply, &data)
                    );
                    return Ok(None);
                }
                (reply, _) => {
                    return Err(self.protocol(format!(
                        "unexpected reply {reply:#x} to NBD_OPT_SET_META_CONTEXT"
                    )))
                }
            }
        }
    }

    /// NBD_OPT_GO; `None` if the server does not know it (then NBD_OPT_EXPORT_NAME is the way).
    fn go(&self, s: &mut Stream) -> Result<Option<Selected>, ClientError> {
        let data = encode_info_request(&self.export, &[INFO_BLOCK_SIZE]);
        self.send_option(s, OPT_GO, &data)?;
        let mut export = None;
        let mut block = None;
        loop {
            match self.option_reply(s, OPT_GO)? {
                (REP_INFO, data) => match parse_info_reply(&data) {
                    Ok(Info::Export { size, flags }) => export = Some((size, flags)),
                    Ok(Info::BlockSize { min, max, .. }) => block = Some((min, max)),
                    Ok(Info::Other(_)) => {}
                    Err(e) => return Err(self.protocol(e.to_string())),
                },
                (REP_ACK, _) => {
                    let (size, flags) = export.ok_or_else(|| {
                        self.protocol("NBD_OPT_GO succeeded without telling the export's size")
                    })?;
                    return Ok(Some(Selected { size, flags, block }));
                }
                (REP_ERR_UNSUP, _) => return Ok(None),
                (reply, data) if reply & REP_ERR_BIT != 0 => {
                    return Err(self.refused(Self::error_text(reply, &data)))
                }
                (reply, _) => {
                    return Err(self.protocol(format!("unexpected reply {reply:#x} to NBD_OPT_GO")))
                }
            }
        }
    }

    /// The old way to pick an export; a server that does not have it just hangs up.
    fn export_name(&self, s: &mut Stream, no_zeroes: bool) -> Result<Selected, ClientError> {
        self.send_option(s, OPT_EXPORT_NAME, self.export.as_bytes())?;
        let mut reply = vec![0u8; if no_zeroes { 10 } else { 134 }];
        match s.read_exact(&mut reply) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                return Err(self.refused("the server closed the connection".into()))
            }
            Err(e) => return Err(self.handshake_io(e)),
        }
        Ok(Selected {
            size: u64::from_be_bytes(reply[0..8].try_into().unwrap()),
            flags: u16::from_be_bytes(reply[8..10].try_into().unwrap()),
            block: None,
        })
    }
}

/// The part of an export of `size` bytes that whole sectors cover.
fn usable(size: u64) -> u64 {
    size / u64::from(SECTOR) * u64::from(SECTOR)
}

fn set_write_timeout(stream: &Stream, timeout: Option<Duration>) -> io::Result<()> {
    match stream {
        Stream::Unix(s) => s.set_write_timeout(timeout),
        Stream::Tcp(s) => s.set_write_timeout(timeout),
    }
}

/// A caller's buffer that the reader thread fills. It lives on the caller's stack; the slot
/// protocol (see [`Slot`]) guarantees the caller neither touches nor leaves it while the
/// reader writes to it.
#[derive(Clone, Copy)]
struct Dest {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the pointer is only dereferenced by the reader thread while `filling` is set, during
// which the owning caller is blocked in `wait_reply` and does not access the buffer.
unsafe impl Send for Dest {}

enum Outcome {
    /// The last chunk arrived: the result is in the slot.
    Done,
    /// The connection broke first: send the request again.
    Lost,
}

#[derive(Default)]
struct SlotState {
    /// The cookie of the attempt in flight; 0 when none (not sent yet, or abandoned after a
    /// timeout, in which case whatever still arrives for the old cookie is dropped).
    cookie: u64,
    dest: Option<Dest>,
    /// The reader is writing into `dest` right now.
    filling: bool,
    received: u64,
    extents: Vec<Extent>,
    error: Option<BlockError>,
    outcome: Option<Outcome>,
}

/// One request and the place its reply lands.
struct Slot {
    command: u16,
    offset: u64,
    len: u32,
    state: Mutex<SlotState>,
    wake: Condvar,
}

#[derive(Default)]
struct InFlight {
    slots: HashMap<u64, Arc<Slot>>,
    /// Set once, when the connection dies; nothing is registered after that.
    broken: bool,
}

/// One established connection.
struct Conn {
    info: ExportInfo,
    writer: Mutex<Stream>,
    /// A second handle used only to shut the socket down, which must work while a writer
    /// holds `writer` or the reader is blocked.
    control: Stream,
    in_flight: Mutex<InFlight>,
    /// Reply headers received; a request that times out while this did not move tells that
    /// the server stopped answering altogether.
    replies: AtomicU64,
}

impl Conn {
    /// Returns the connection and the handle its reader thread reads from.
    fn new(stream: Stream, info: ExportInfo) -> io::Result<(Arc<Conn>, Stream)> {
        let reader = stream.try_clone()?;
        let conn = Conn {
            info,
            control: stream.try_clone()?,
            writer: Mutex::new(stream),
            in_flight: Mutex::new(InFlight::default()),
            replies: AtomicU64::new(0),
        };
        Ok((Arc::new(conn), reader))
    }

    /// Files the slot under `cookie`; false if the connection died meanwhile.
    fn register(&self, cookie: u64, slot: &Arc<Slot>) -> bool {
        let mut in_flight = self.in_flight.lock().unwrap();
        if in_flight.broken {
            return false;
        }
        in_flight.slots.insert(cookie, slot.clone());
        true
    }

    fn slot(&self, cookie: u64) -> Option<Arc<Slot>> {
        self.in_flight.lock().unwrap().slots.get(&cookie).cloned()
    }

    fn send(&self, header: &[u8; REQUEST_HEADER_LEN], data: &[u8]) -> io::Result<()> {
        let mut writer = self.writer.lock().unwrap();
        if data.is_empty() {
            writer.write_all(header)
        } else {
            writer.write_all_vectored(&mut [IoSlice::new(header), IoSlice::new(data)])
        }
    }
}

struct State {
    conn: Option<Arc<Conn>>,
    /// What the latest connection negotiated.
    info: ExportInfo,
    /// Set when the device can never work again (the export changed size).
    failed: Option<String>,
    closing: bool,
    /// A connection was made once; `info` is the server's word, not a stand-in.
    connected_before: bool,
}

struct Shared {
    target: Target,
    /// Fixed at the first connection (or given to a client made disconnected); a server that
    /// comes back with another size is refused.
    size: u64,
    state: Mutex<State>,
    /// Signalled when the connection comes or goes, the device fails, or the client closes.
    changed: Condvar,
    next_cookie: AtomicU64,
}

/// A remote NBD export as a block device. See the module documentation for the design.
pub struct NbdClient {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

enum Payload<'a> {
    None,
    Read(&'a mut [u8]),
    Write(&'a [u8]),
}

impl NbdClient {
    /// Connects to `uri` (`nbd://HOST[:PORT]/EXPORT` or `nbd+unix:///EXPORT?socket=PATH`).
    /// The first connection must succeed; later breaks are repaired in the background.
    pub fn connect(uri: &str, options: ClientOptions) -> Result<NbdClient, ClientError> {
        let target = Target::parse(uri, options)?;
        let (stream, info) = target.dial()?;
        let (conn, reader) = Conn::new(stream, info).map_err(|e| target.handshake_io(e))?;
        info!(
            "nbd: connected to {} export '{}' ({} bytes)",
            target.address, target.export, info.size
        );
        target.warn_about(&info);
        Self::start(target, info, Some((conn, reader)))
    }

    /// A client for `uri` that does not connect now: its export was last seen with `size`
    /// bytes and is expected back. Requests wait for the connection the background thread
    /// keeps trying to make (up to `io_timeout`); an export that comes back with another size
    /// fails the device, as on any reconnection.
    pub fn disconnected(
        uri: &str,
        options: ClientOptions,
        size: u64,
    ) -> Result<NbdClient, ClientError> {
        let target = Target::parse(uri, options)?;
        // Until the server tells, assume the least: no optional commands, no block status.
        // Skipping FLUSH meanwhile loses nothing, since nothing was written through us yet.
        let info = ExportInfo {
            size,
            flags: 0,
            min_block: 1,
            max_request: MAX_REQUEST,
            structured: false,
            base_allocation: None,
        };
        Self::start(target, info, None)
    }

    fn start(
        target: Target,
        info: ExportInfo,
        conn: Option<(Arc<Conn>, Stream)>,
    ) -> Result<NbdClient, ClientError> {
        let name = format!("nbd-client-{}", target.export);
        let shared = Arc::new(Shared {
            size: info.size,
            target,
            state: Mutex::new(State {
                connected_before: conn.is_some(),
                conn: conn.as_ref().map(|(conn, _)| conn.clone()),
                info,
                failed: None,
                closing: false,
            }),
            changed: Condvar::new(),
            next_cookie: AtomicU64::new(1),
        });
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn({
                let shared = shared.clone();
                move || shared.run(conn)
            })
            .map_err(|e| shared.target.handshake_io(e))?;
        Ok(NbdClient {
            shared,
            thread: Some(thread),
        })
    }

    /// Whether the connection is up. Background work (hydration) can pause while it is not;
    /// requests made meanwhile wait for it, up to `io_timeout`.
    pub fn is_connected(&self) -> bool {
        self.shared.state.lock().unwrap().conn.is_some()
    }

    fn info(&self) -> ExportInfo {
        self.shared.state.lock().unwrap().info
    }

    fn read_only(&self, info: &ExportInfo) -> bool {
        self.shared.target.options.read_only || info.has(TF_READ_ONLY)
    }

    fn check_writable(&self, info: &ExportInfo) -> udm_block::Result<()> {
        if self.read_only(info) {
            return Err(BlockError::ReadOnly(format!(
                "nbd export '{}' is read-only",
                self.shared.target.export
            )));
        }
        Ok(())
    }

    /// Sends `[offset, offset + len)` as requests of at most `max` bytes, one after another.
    fn in_pieces(
        &self,
        command: u16,
        flags: u16,
        offset: u64,
        len: u64,
        max: u64,
    ) -> udm_block::Result<()> {
        let mut done = 0;
        while done < len {
            let n = (len - done).min(max);
            self.call(command, flags, offset + done, n as u32, Payload::None)?;
            done += n;
        }
        Ok(())
    }

    /// Sends one request and waits for its reply, resending it across reconnections, for at
    /// most `io_timeout`. Returns the extents of a block-status reply (empty otherwise).
    fn call(
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
        let slot = Arc::new(Slot {
            command,
            offset,
            len,
            state: Mutex::new(SlotState {
                dest,
                ..SlotState::default()
            }),
            wake: Condvar::new(),
        });
        loop {
            let conn = shared.wait_connected(deadline)?;
            let cookie = shared.next_cookie.fetch_add(1, Ordering::Relaxed);
            slot.state.lock().unwrap().cookie = cookie;
            if !conn.register(cookie, &slot) {
                continue;
            }
            let replies_before = conn.replies.load(Ordering::Acquire);
            let header = encode_request(&Request {
                flags,
                command,
                cookie,
                offset,
                length: len,
            });
            if let Err(e) = conn.send(&header, data) {
                // Breaking the connection marks this slot lost too; it is resent below.
                shared.connection_lost(&conn, &format!("sending a request: {e}"));
            }
            if let Some(result) = shared.wait_reply(&slot, &conn, deadline, replies_before) {
                return result;
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

    /// The live connection, waiting for one until `deadline`.
    fn wait_connected(&self, deadline: Instant) -> udm_block::Result<Arc<Conn>> {
        let mut state = self.state.lock().unwrap();
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
            let now = Instant::now();
            if now >= deadline {
                return Err(self.unreachable("no connection"));
            }
            state = self.changed.wait_timeout(state, deadline - now).unwrap().0;
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
        let mut st = slot.state.lock().unwrap();
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
                    None => {}
                }
            }
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            st = slot.wake.wait_timeout(st, deadline - now).unwrap().0;
        }
        // Timed out. A server that sent nothing at all since this request went out, or that
        // stalls in the middle of our data, is taken for gone: drop the connection so the
        // reader lets go of our buffer and a fresh connection is tried.
        if st.filling || conn.replies.load(Ordering::Acquire) == replies_before {
            drop(st);
            self.connection_lost(conn, "the server stopped answering");
            st = slot.state.lock().unwrap();
            while st.filling {
                st = slot.wake.wait(st).unwrap();
            }
        }
        // Detach: a late reply finds no buffer and no cookie and is dropped.
        st.cookie = 0;
        st.dest = None;
        Some(Err(self.unreachable("no reply")))
    }

    /// Marks `conn` dead: shuts its socket, tells every request in flight to resend, and
    /// wakes the reconnect loop. Idempotent.
    fn connection_lost(&self, conn: &Arc<Conn>, why: &str) {
        let slots = {
            let mut in_flight = conn.in_flight.lock().unwrap();
            if in_flight.broken {
                return;
            }
            in_flight.broken = true;
            std::mem::take(&mut in_flight.slots)
        };
        conn.control.shutdown();
        for (cookie, slot) in slots {
            let mut st = slot.state.lock().unwrap();
            if st.cookie == cookie && st.outcome.is_none() {
                st.outcome = Some(Outcome::Lost);
                slot.wake.notify_all();
            }
        }
        let mut state = self.state.lock().unwrap();
        if state.conn.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
            state.conn = None;
            if !state.closing {
                warn!(
                    "nbd: connection to {} lost: {why}; reconnecting",
                    self.target.address
                );
            }
        }
        self.changed.notify_all();
    }

    /// The client's thread: reads replies until the connection breaks, then reconnects, until
    /// the client is dropped or the device fails. A client made disconnected starts by
    /// dialling.
    fn run(self: Arc<Self>, mut current: Option<(Arc<Conn>, Stream)>) {
        let mut delay = FIRST_BACKOFF;
        loop {
            if let Some((conn, reader)) = current {
                let up_since = Instant::now();
                let why = read_replies(&conn, reader);
                self.connection_lost(&conn, &why);
                // A server that breaks every connection as soon as it is made (a protocol
                // error on each request) must not be redialled in a tight loop: the backoff
                // starts over only after a connection that lasted.
                if up_since.elapsed() >= MAX_BACKOFF {
                    delay = FIRST_BACKOFF;
                } else if !self.pause(&mut delay) {
                    return;
                }
            }
            current = self.reconnect(&mut delay);
            if current.is_none() {
                return;
            }
        }
    }

    /// Sleeps for `delay` (less if the client closes) and doubles it; false once the client
    /// is closing or the device has failed.
    fn pause(&self, delay: &mut Duration) -> bool {
        let state = self.state.lock().unwrap();
        let (state, _) = self
            .changed
            .wait_timeout_while(state, *delay, |s| !s.closing)
            .unwrap();
        *delay = (*delay * 2).min(MAX_BACKOFF);
        !state.closing && state.failed.is_none()
    }

    fn stopped(&self) -> bool {
        let state = self.state.lock().unwrap();
        state.closing || state.failed.is_some()
    }

    fn reconnect(&self, delay: &mut Duration) -> Option<(Arc<Conn>, Stream)> {
        let mut attempts = 0u32;
        loop {
            if self.stopped() {
                return None;
            }
            attempts = attempts.saturating_add(1);
            let dialled = self.target.dial().and_then(|(stream, info)| {
                Conn::new(stream, info).map_err(|e| self.target.handshake_io(e))
            });
            match dialled {
                Ok((conn, reader)) => return self.install(conn, reader, attempts),
                Err(e) => debug!("nbd: reconnect attempt {attempts}: {e}"),
            }
            if !self.pause(delay) {
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
        let mut state = self.state.lock().unwrap();
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
            disconnect(&mut conn.writer.lock().unwrap());
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

/// A polite goodbye (the server may already be gone; nothing depends on it arriving).
fn disconnect(stream: &mut Stream) {
    let request = encode_request(&Request {
        flags: 0,
        command: CMD_DISC,
        cookie: 0,
        offset: 0,
        length: 0,
    });
    let _ = stream.write_all(&request);
    stream.shutdown();
}

/// The result of a completed slot.
fn finish(slot: &Slot, st: &mut SlotState) -> udm_block::Result<Vec<Extent>> {
    if let Some(e) = st.error.take() {
        return Err(e);
    }
    if slot.command == CMD_READ && st.received != u64::from(slot.len) {
        return Err(BlockError::Io(format!(
            "the nbd server's reply covered {} of the {} bytes read",
            st.received, slot.len
        )));
    }
    Ok(std::mem::take(&mut st.extents))
}

/// How a connection ended, from the reader's side.
#[derive(Debug, Error)]
enum ReplyError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("protocol error: {0}")]
    Protocol(String),
    /// NBD_ESHUTDOWN: the server is going away and will not serve this connection again. It
    /// may wait for us to hang up before it exits, so we do, and redial.
    #[error("the server is shutting down")]
    ShuttingDown,
}

impl From<ProtocolError> for ReplyError {
    fn from(e: ProtocolError) -> Self {
        ReplyError::Protocol(e.to_string())
    }
}

/// Reads replies until the connection fails; returns why it did.
fn read_replies(conn: &Conn, reader: Stream) -> String {
    let mut reader = BufReader::with_capacity(256 << 10, reader);
    loop {
        if let Err(e) = read_reply(conn, &mut reader) {
            return match e {
                ReplyError::Io(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                    "the server closed the connection".into()
                }
                e => e.to_string(),
            };
        }
    }
}

fn read_reply(conn: &Conn, r: &mut impl Read) -> Result<(), ReplyError> {
    let mut header = [0u8; CHUNK_HEADER_LEN];
    r.read_exact(&mut header[..SIMPLE_REPLY_LEN])?;
    conn.replies.fetch_add(1, Ordering::Release);
    let magic = u32::from_be_bytes(header[..4].try_into().unwrap());
    if magic == SIMPLE_REPLY_MAGIC {
        let reply = parse_simple_reply(header[..SIMPLE_REPLY_LEN].try_into().unwrap())?;
        let slot = in_flight(conn, reply.cookie)?;
        if reply.error == NBD_ESHUTDOWN {
            return Err(ReplyError::ShuttingDown);
        }
        if reply.error != 0 {
            set_error(&slot, reply.cookie, block_error(reply.error, ""));
        } else if slot.command == CMD_READ {
            if conn.info.structured {
                return Err(ReplyError::Protocol(
                    "a simple reply with data after structured replies were negotiated".into(),
                ));
            }
            fill(r, &slot, reply.cookie, 0, slot.len as usize, false)?;
        }
        complete(conn, &slot, reply.cookie);
        return Ok(());
    }
    if magic != STRUCTURED_REPLY_MAGIC {
        return Err(ProtocolError::BadMagic(magic.into()).into());
    }
    r.read_exact(&mut header[SIMPLE_REPLY_LEN..])?;
    let chunk = parse_chunk_header(&header)?;
    let slot = in_flight(conn, chunk.cookie)?;
    match chunk.kind {
        CHUNK_NONE if chunk.length == 0 && chunk.flags & CHUNK_FLAG_DONE != 0 => {}
        CHUNK_OFFSET_DATA if slot.command == CMD_READ && chunk.length >= 8 => {
            let mut offset = [0u8; 8];
            r.read_exact(&mut offset)?;
            let len = chunk.length - 8;
            let at = position(&slot, u64::from_be_bytes(offset), len)?;
            fill(r, &slot, chunk.cookie, at, len as usize, false)?;
        }
        CHUNK_OFFSET_HOLE if slot.command == CMD_READ && chunk.length == 12 => {
            let mut body = [0u8; 12];
            r.read_exact(&mut body)?;
            let offset = u64::from_be_bytes(body[..8].try_into().unwrap());
            let len = u32::from_be_bytes(body[8..].try_into().unwrap());
            let at = position(&slot, offset, len)?;
            fill(r, &slot, chunk.cookie, at, len as usize, true)?;
        }
        CHUNK_BLOCK_STATUS if slot.command == CMD_BLOCK_STATUS => {
            let (context, descriptors) = parse_block_status(&payload(r, chunk.length)?)?;
            // Only the context we asked for counts; a server may describe others too.
            if Some(context) == conn.info.base_allocation {
                let mut st = slot.state.lock().unwrap();
                if st.cookie == chunk.cookie {
                    st.extents
                        .extend(descriptors.into_iter().filter(|(len, _)| *len > 0).map(
                            |(len, flags)| Extent {
                                len: u64::from(len),
                                flags: flags & (EXTENT_HOLE | EXTENT_ZERO),
                            },
                        ));
                }
            }
        }
        kind if kind & CHUNK_ERROR_BIT != 0 => {
            let e = parse_error_chunk(kind, &payload(r, chunk.length)?)?;
            if e.error == NBD_ESHUTDOWN {
                return Err(ReplyError::ShuttingDown);
            }
            let message = match e.offset {
                Some(offset) => format!("{} (at offset {offset})", e.message),
                None => e.message,
            };
            set_error(&slot, chunk.cookie, block_error(e.error, &message));
        }
        kind => {
            return Err(ReplyError::Protocol(format!(
                "chunk type {kind} of {} bytes in reply to command {}",
                chunk.length, slot.command
            )))
        }
    }
    if chunk.flags & CHUNK_FLAG_DONE != 0 {
        complete(conn, &slot, chunk.cookie);
    }
    Ok(())
}

fn in_flight(conn: &Conn, cookie: u64) -> Result<Arc<Slot>, ReplyError> {
    conn.slot(cookie)
        .ok_or_else(|| ReplyError::Protocol(format!("reply to unknown cookie {cookie}")))
}

/// Where a data or hole chunk lands in the request's buffer.
fn position(slot: &Slot, offset: u64, len: u32) -> Result<usize, ReplyError> {
    let end = offset.checked_add(u64::from(len));
    match end {
        Some(end)
            if offset >= slot.offset && end <= slot.offset + u64::from(slot.len) && len > 0 =>
        {
            Ok((offset - slot.offset) as usize)
        }
        _ => Err(ReplyError::Protocol(format!(
            "chunk for {len} bytes at {offset} outside the read of {} at {}",
            slot.len, slot.offset
        ))),
    }
}

/// Reads a chunk payload that is parsed rather than copied to a caller.
fn payload(r: &mut impl Read, len: u32) -> Result<Vec<u8>, ReplyError> {
    if len > MAX_CHUNK_PAYLOAD {
        return Err(ReplyError::Protocol(format!(
            "chunk payload of {len} bytes"
        )));
    }
    let mut data = vec![0u8; len as usize];
    r.read_exact(&mut data)?;
    Ok(data)
}

/// Puts `len` bytes at `at` in the slot's buffer: from the socket, or zeroes for a hole. When
/// the caller has given up on this cookie the bytes are read and dropped, so the stream stays
/// in step.
fn fill(
    r: &mut impl Read,
    slot: &Slot,
    cookie: u64,
    at: usize,
    len: usize,
    zero: bool,
) -> io::Result<()> {
    let dest = {
        let mut st = slot.state.lock().unwrap();
        match st.dest {
            Some(dest) if st.cookie == cookie => {
                st.filling = true;
                Some(dest)
            }
            _ => None,
        }
    };
    let Some(dest) = dest else {
        if !zero {
            io::copy(&mut r.by_ref().take(len as u64), &mut io::sink())?;
        }
        return Ok(());
    };
    debug_assert!(at + len <= dest.len);
    // SAFETY: `position` keeps `at + len` within the request, whose length is the buffer's;
    // the caller owning the buffer waits while `filling` is set and never returns before it
    // is cleared (see `wait_reply`), so the memory is valid and not aliased.
    let buf = unsafe { std::slice::from_raw_parts_mut(dest.ptr.add(at), len) };
    let result = if zero {
        buf.fill(0);
        Ok(())
    } else {
        r.read_exact(buf)
    };
    let mut st = slot.state.lock().unwrap();
    st.filling = false;
    if result.is_ok() {
        st.received += len as u64;
    }
    slot.wake.notify_all();
    result
}

fn set_error(slot: &Slot, cookie: u64, error: BlockError) {
    let mut st = slot.state.lock().unwrap();
    if st.cookie == cookie && st.error.is_none() {
        st.error = Some(error);
    }
}

fn complete(conn: &Conn, slot: &Slot, cookie: u64) {
    conn.in_flight.lock().unwrap().slots.remove(&cookie);
    let mut st = slot.state.lock().unwrap();
    if st.cookie == cookie && st.outcome.is_none() {
        st.outcome = Some(Outcome::Done);
        slot.wake.notify_all();
    }
}

/// The server's error code as a block error (the inverse of [`nbd_error`]).
fn block_error(code: u32, message: &str) -> BlockError {
    let text = if message.is_empty() {
        "the nbd server failed the request".to_string()
    } else {
        format!("nbd server: {message}")
    };
    match code {
        NBD_EIO => BlockError::Io(text),
        NBD_EINVAL => BlockError::InvalidArgument(text),
        NBD_ENOSPC => BlockError::NoSpace(text),
        NBD_EPERM => BlockError::ReadOnly(text),
        NBD_ENOTSUP => BlockError::NotSupported(text),
        other => BlockError::Os {
            context: text,
            errno: i32::try_from(other).unwrap_or(libc::EIO),
        },
    }
}

impl BlockDevice for NbdClient {
    fn size(&self) -> u64 {
        usable(self.shared.size)
    }

    fn capabilities(&self) -> Capabilities {
        let info = self.info();
        Capabilities {
            read_only: self.read_only(&info),
            native_fua: info.has(TF_SEND_FUA),
            discard: info.has(TF_SEND_TRIM),
            fast_zero: info.has(TF_SEND_FAST_ZERO),
            rotational: info.has(TF_ROTATIONAL),
            // Every request goes over one connection, so a flush covers every write we made.
            flush_covers_all: true,
        }
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> udm_block::Result<()> {
        let max = self.info().max_request as usize;
        for (i, piece) in buf.chunks_mut(max).enumerate() {
            let len = piece.len() as u32;
            self.call(
                CMD_READ,
                0,
                offset + (i * max) as u64,
                len,
                Payload::Read(piece),
            )?;
        }
        Ok(())
    }

    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> udm_block::Result<()> {
        let info = self.info();
        self.check_writable(&info)?;
        let native_fua = flags.fua && info.has(TF_SEND_FUA);
        let max = info.max_request as usize;
        for (i, piece) in buf.chunks(max).enumerate() {
            self.call(
                CMD_WRITE,
                if native_fua { CMD_FLAG_FUA } else { 0 },
                offset + (i * max) as u64,
                piece.len() as u32,
                Payload::Write(piece),
            )?;
        }
        if flags.fua && !native_fua {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&self) -> udm_block::Result<()> {
        // A server without FLUSH writes through, and a read-only client wrote nothing: either
        // way there is nothing to make durable, and no reason to wait for a server that is
        // down.
        let info = self.info();
        if !info.has(TF_SEND_FLUSH) || self.read_only(&info) {
            return Ok(());
        }
        self.call(CMD_FLUSH, 0, 0, 0, Payload::None).map(drop)
    }

    fn discard(&self, offset: u64, len: u64) -> udm_block::Result<()> {
        let info = self.info();
        self.check_writable(&info)?;
        if !info.has(TF_SEND_TRIM) {
            return Ok(());
        }
        self.in_pieces(CMD_TRIM, 0, offset, len, MAX_NO_PAYLOAD)
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> udm_block::Result<()> {
        let info = self.info();
        self.check_writable(&info)?;
        if !info.has(TF_SEND_WRITE_ZEROES) {
            return write_zeroes_by_writing(self, offset, len, flags);
        }
        if flags.fast_only && !info.has(TF_SEND_FAST_ZERO) {
            return Err(BlockError::NotSupported(
                "the nbd server cannot promise fast zeroing".into(),
            ));
        }
        let native_fua = flags.fua && info.has(TF_SEND_FUA);
        let mut command_flags = 0;
        if !flags.may_unmap {
            command_flags |= CMD_FLAG_NO_HOLE;
        }
        if flags.fast_only {
            command_flags |= CMD_FLAG_FAST_ZERO;
        }
        if native_fua {
            command_flags |= CMD_FLAG_FUA;
        }
        self.in_pieces(
            CMD_WRITE_ZEROES,
            command_flags,
            offset,
            len,
            info.max_request.into(),
        )?;
        if flags.fua && !native_fua {
            self.flush()?;
        }
        Ok(())
    }

    fn block_status(&self, offset: u64, len: u64) -> udm_block::Result<Vec<Extent>> {
        let info = self.info();
        if info.base_allocation.is_none() {
            return Ok(vec![Extent::data(len)]);
        }
        let len = len.min(MAX_NO_PAYLOAD);
        let mut extents = self.call(CMD_BLOCK_STATUS, 0, offset, len as u32, Payload::None)?;
        // The server's answer may run past the request; keep it within.
        let mut left = len;
        extents.retain_mut(|e| {
            e.len = e.len.min(left);
            left -= e.len;
            e.len > 0
        });
        if extents.is_empty() {
            extents.push(Extent::data(len));
        }
        Ok(extents)
    }

    fn cache(&self, offset: u64, len: u64) -> udm_block::Result<()> {
        let info = self.info();
        if !info.has(TF_SEND_CACHE) {
            return Ok(());
        }
        self.in_pieces(CMD_CACHE, 0, offset, len, info.max_request.into())
    }

    /// Hangs up: requests waiting for a connection or a reply fail with ESHUTDOWN, and the
    /// background thread stops redialling.
    fn close(&self) {
        let conn = {
            let mut state = self.shared.state.lock().unwrap();
            state.closing = true;
            state.conn.take()
        };
        self.shared.changed.notify_all();
        if let Some(conn) = conn {
            // A writer stuck on a server that stopped reading must not hold us up: the goodbye
            // is skipped then.
            if let Ok(mut writer) = conn.writer.try_lock() {
                disconnect(&mut writer);
            }
            // Breaks the reader's wait; the requests it had in flight are then resent, find
            // the client closing and fail.
            conn.control.shutdown();
        }
    }
}

impl Drop for NbdClient {
    fn drop(&mut self) {
        self.close();
        if let Some(thread) = self.thread.take() {
            // The reader sees the shutdown, the reconnect loop sees `closing`; both end.
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_errors_map_to_block_errors() {
        assert_eq!(block_error(NBD_EIO, "").errno(), libc::EIO);
        assert_eq!(block_error(NBD_EINVAL, "").errno(), libc::EINVAL);
        assert_eq!(block_error(NBD_ENOSPC, "").errno(), libc::ENOSPC);
        assert_eq!(block_error(NBD_EPERM, "").errno(), libc::EPERM);
        assert_eq!(block_error(NBD_ENOTSUP, "").errno(), libc::EOPNOTSUPP);
        assert_eq!(block_error(NBD_ENOMEM, "").errno(), libc::ENOMEM);
        assert_eq!(block_error(NBD_EOVERFLOW, "").errno(), libc::EOVERFLOW);
        assert!(block_error(NBD_EIO, "disk on fire")
            .to_string()
            .contains("disk on fire"));
        // Every errno the server side sends comes back as itself.
        for errno in [
            libc::EIO,
            libc::EINVAL,
            libc::ENOSPC,
            libc::EPERM,
            libc::ENOMEM,
        ] {
            assert_eq!(block_error(nbd_error(errno), "").errno(), errno);
        }
    }

    #[test]
    fn chunks_outside_the_read_are_refused() {
        let slot = Slot {
            command: CMD_READ,
            offset: 4096,
            len: 8192,
            state: Mutex::new(SlotState::default()),
            wake: Condvar::new(),
        };
        assert_eq!(position(&slot, 4096, 8192).unwrap(), 0);
        assert_eq!(position(&slot, 8192, 4096).unwrap(), 4096);
        assert!(position(&slot, 0, 512).is_err());
        assert!(position(&slot, 8192, 8192).is_err());
        assert!(position(&slot, 8192, 0).is_err());
        assert!(position(&slot, u64::MAX, 2).is_err());
    }
}
