//! Dialling an NBD server as a client: the socket (Unix or TCP), the fixed-newstyle
//! handshake, and option negotiation (structured replies, `base:allocation`, NBD_OPT_GO or
//! the older NBD_OPT_EXPORT_NAME), ending with what the export offers.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use log::{debug, warn};

use super::{ClientError, ClientOptions, MAX_REQUEST, SECTOR};
use crate::protocol::*;
use crate::stream::{Deadline, Stream};
use crate::uri::{NbdAddress, NbdUri};

/// Option replies are small (info, context names, messages of at most 4 KiB); anything
/// larger is a broken or hostile server.
const MAX_OPTION_REPLY: u32 = 64 * 1024;

/// What the handshake told us about the export.
#[derive(Debug, Clone, Copy)]
pub(super) struct ExportInfo {
    pub(super) size: u64,
    pub(super) flags: u16,
    pub(super) min_block: u32,
    /// Largest READ/WRITE/WRITE_ZEROES/CACHE we send: the server's maximum, capped at
    /// [`MAX_REQUEST`] and aligned.
    pub(super) max_request: u32,
    pub(super) structured: bool,
    /// The id the server gave `base:allocation`, if it was negotiated.
    pub(super) base_allocation: Option<u32>,
}

impl ExportInfo {
    pub(super) fn has(&self, flag: u16) -> bool {
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
pub(super) struct Target {
    pub(super) address: NbdAddress,
    pub(super) export: String,
    pub(super) options: ClientOptions,
}

impl Target {
    pub(super) fn parse(uri: &str, options: ClientOptions) -> Result<Target, ClientError> {
        let NbdUri { address, export } = uri.parse()?;
        Ok(Target {
            address,
            export,
            options,
        })
    }

    /// What about a freshly negotiated export the user should know.
    pub(super) fn warn_about(&self, info: &ExportInfo) {
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

    pub(super) fn handshake_io(&self, source: io::Error) -> ClientError {
        // A socket timeout reads as EAGAIN ("Resource temporarily unavailable"): say what it
        // means (unless already said).
        let source = if is_timeout(&source) && source.raw_os_error().is_some() {
            timed_out(format!(
                "no answer within {:?}",
                self.options.connect_timeout
            ))
        } else {
            source
        };
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
    pub(super) fn dial(&self) -> Result<(Stream, ExportInfo), ClientError> {
        self.dial_within(self.options.connect_timeout)
    }

    /// [`Target::dial`], giving the TCP connect at most `connect` (and at most the connect
    /// timeout): a redial is tried again soon anyway, with a fresh first SYN.
    pub(super) fn dial_within(
        &self,
        connect: Duration,
    ) -> Result<(Stream, ExportInfo), ClientError> {
        let connect = connect.min(self.options.connect_timeout);
        let stream = self
            .open_socket(connect)
            .map_err(|source| ClientError::Connect {
                address: self.address.to_string(),
                source,
            })?;
        let timeout = Some(self.options.connect_timeout);
        stream
            .set_read_timeout(timeout)
            .and_then(|()| stream.set_write_timeout(timeout))
            .map_err(|e| self.handshake_io(e))?;
        let mut stream = stream;
        let timeout = self.options.connect_timeout;
        let info = self.handshake(&mut Deadline::new(&mut stream, timeout, "server"))?;
        // The reply reader never blocks on the socket (see `poller`); a writer stuck on a
        // server that stopped reading gives up after io_timeout.
        stream
            .set_read_timeout(None)
            .and_then(|()| stream.set_write_timeout(Some(self.options.io_timeout)))
            .map_err(|e| self.handshake_io(e))?;
        Ok((stream, info))
    }

    fn open_socket(&self, connect: Duration) -> io::Result<Stream> {
        match &self.address {
            NbdAddress::Unix { path } => {
                crate::socket_path_fits(path)?;
                UnixStream::connect(path).map(Stream::Unix)
            }
            NbdAddress::Tcp { host, port } => {
                let mut last = None;
                for addr in (host.as_str(), *port).to_socket_addrs()? {
                    match TcpStream::connect_timeout(&addr, connect) {
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

    fn handshake(&self, s: &mut Deadline<'_>) -> Result<ExportInfo, ClientError> {
        let mut greeting = [0u8; 18];
        s.read_exact(&mut greeting).map_err(|e| {
            if !is_timeout(&e) {
                return self.handshake_io(e);
            }
            self.handshake_io(timed_out(format!(
                "no greeting within {:?}; a server that serves one client at a time \
                 (qemu-nbd without --shared) may be busy with another",
                self.options.connect_timeout
            )))
        })?;
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

    fn send_option(
        &self,
        s: &mut Deadline<'_>,
        option: u32,
        data: &[u8],
    ) -> Result<(), ClientError> {
        s.write_all(&encode_option(option, data))
            .map_err(|e| self.handshake_io(e))
    }

    /// Reads one reply to `option`: its type and data.
    fn option_reply(
        &self,
        s: &mut Deadline<'_>,
        option: u32,
    ) -> Result<(u32, Vec<u8>), ClientError> {
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

    fn negotiate_structured_replies(&self, s: &mut Deadline<'_>) -> Result<bool, ClientError> {
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

    fn negotiate_base_allocation(&self, s: &mut Deadline<'_>) -> Result<Option<u32>, ClientError> {
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
    fn go(&self, s: &mut Deadline<'_>) -> Result<Option<Selected>, ClientError> {
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
    fn export_name(&self, s: &mut Deadline<'_>, no_zeroes: bool) -> Result<Selected, ClientError> {
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

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

fn timed_out(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, what)
}
