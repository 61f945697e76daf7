//! The fixed newstyle handshake: options until the client picks an export (GO or
//! EXPORT_NAME), aborts, or breaks the protocol.

use std::io::{self, Read, Write};

use log::debug;

use crate::protocol::*;
use crate::{Export, ExportCatalog};

/// Options larger than this are refused with ERR_TOO_BIG (names are at most 4 KiB; a meta
/// context request with many queries stays far below).
const MAX_OPTION_LEN: u32 = 64 * 1024;

/// Block sizes we advertise: sector-aligned requests, 4 KiB preferred, 32 MiB at most.
pub const MIN_BLOCK: u32 = 512;
pub const PREFERRED_BLOCK: u32 = 4096;
pub const MAX_PAYLOAD: u32 = 32 << 20;

pub struct Negotiated {
    pub name: String,
    pub export: Export,
    pub structured: bool,
    pub base_allocation: bool,
}

/// Why the handshake ended without an export.
#[derive(Debug)]
pub enum HandshakeEnd {
    /// The client aborted or closed the connection; nothing to report.
    Closed,
    /// The client broke the protocol; the reason is logged.
    Violation(String),
    Io(io::Error),
}

impl From<io::Error> for HandshakeEnd {
    fn from(e: io::Error) -> Self {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            HandshakeEnd::Closed
        } else {
            HandshakeEnd::Io(e)
        }
    }
}

fn read_u32(s: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

fn read_u64(s: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

pub fn transmission_flags(export: &Export) -> u16 {
    let caps = export.device.capabilities();
    let mut flags = TF_HAS_FLAGS | TF_SEND_FLUSH | TF_SEND_DF | TF_SEND_CACHE;
    if export.read_only || caps.read_only {
        flags |= TF_READ_ONLY;
    } else {
        flags |= TF_SEND_FUA | TF_SEND_TRIM | TF_SEND_WRITE_ZEROES | TF_SEND_FAST_ZERO;
    }
    if caps.rotational {
        flags |= TF_ROTATIONAL;
    }
    // One process serves every connection and a flush reaches every backend, so a flush on
    // any connection covers the writes of all of them, unless a target says otherwise.
    if caps.flush_covers_all {
        flags |= TF_CAN_MULTI_CONN;
    }
    flags
}

struct Handshake<'a, S> {
    stream: &'a mut S,
    catalog: &'a dyn ExportCatalog,
    structured: bool,
    base_allocation: bool,
    no_zeroes: bool,
}

fn greet(stream: &mut impl Write) -> io::Result<()> {
    let mut greeting = Vec::with_capacity(18);
    greeting.extend_from_slice(&NBDMAGIC.to_be_bytes());
    greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    stream.write_all(&greeting)
}

/// Options a refused client may send before it is disconnected.
const MAX_REFUSED_OPTIONS: usize = 16;

/// Tells a client the server will not serve it (too many connections): the greeting, then
/// NBD_REP_ERR_POLICY with `why` for every option, so that the client's NBD_OPT_GO fails with
/// the reason whatever it asks first. Ends when the client aborts, or picks an export with
/// NBD_OPT_EXPORT_NAME, which has no error reply: closing is all the protocol allows.
pub fn refuse<S: Read + Write>(stream: &mut S, why: &str) -> Result<(), HandshakeEnd> {
    greet(stream)?;
    read_u32(stream)?; // the client's flags: nothing is negotiated
    for _ in 0..MAX_REFUSED_OPTIONS {
        let magic = read_u64(stream)?;
        if magic != IHAVEOPT {
            return Err(HandshakeEnd::Violation(format!(
                "bad option magic {magic:#x}"
            )));
        }
        let option = read_u32(stream)?;
        let len = read_u32(stream)?;
        if option == OPT_EXPORT_NAME || len > MAX_OPTION_LEN {
            break;
        }
        io::copy(&mut (&mut *stream).take(len.into()), &mut io::sink())?;
        if option == OPT_ABORT {
            let _ = stream.write_all(&option_reply(option, REP_ACK, &[]));
            break;
        }
        stream.write_all(&option_reply(option, REP_ERR_POLICY, why.as_bytes()))?;
    }
    Ok(())
}

/// Runs the handshake on any byte stream (a socket, or a fuzzer's buffer).
pub fn negotiate<S: Read + Write>(
    stream: &mut S,
    catalog: &dyn ExportCatalog,
) -> Result<Negotiated, HandshakeEnd> {
    greet(stream)?;
    let client_flags = read_u32(stream)?;
    if client_flags & !(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES) != 0 {
        return Err(HandshakeEnd::Violation(format!(
            "unknown client flags {client_flags:#x}"
        )));
    }
    let mut h: Handshake<'_, S> = Handshake {
        stream,
        catalog,
        structured: false,
        base_allocation: false,
        no_zeroes: client_flags & CLIENT_NO_ZEROES != 0,
    };
    loop {
        if let Some(done) = h.option()? {
            return Ok(done);
        }
    }
}

impl<S: Read + Write> Handshake<'_, S> {
    fn reply(&mut self, option: u32, reply: u32, data: &[u8]) -> io::Result<()> {
        self.stream.write_all(&option_reply(option, reply, data))
    }

    fn error(&mut self, option: u32, reply: u32, message: &str) -> io::Result<()> {
        debug!("nbd option {option}: refused ({reply:#x}): {message}");
        self.reply(option, reply, message.as_bytes())
    }

    /// Handles one option; `Some` when the client has picked an export.
    fn option(&mut self) -> Result<Option<Negotiated>, HandshakeEnd> {
        let magic = read_u64(self.stream)?;
        if magic != IHAVEOPT {
            return Err(HandshakeEnd::Violation(format!(
                "bad option magic {magic:#x}"
            )));
        }
        let option = read_u32(self.stream)?;
        let len = read_u32(self.stream)?;
        if len > MAX_OPTION_LEN {
            if option == OPT_EXPORT_NAME {
                return Err(HandshakeEnd::Violation(format!(
                    "export name of {len} bytes"
                )));
            }
            io::copy(&mut (&mut *self.stream).take(len.into()), &mut io::sink())?;
            self.error(option, REP_ERR_TOO_BIG, "option data too large")?;
            return Ok(None);
        }
        let mut data = vec![0u8; len as usize];
        self.stream.read_exact(&mut data)?;
        match option {
            OPT_EXPORT_NAME => self.export_name(&data).map(Some),
            OPT_ABORT => {
                // The client may already have gone; the acknowledgement is a courtesy.
                let _ = self.reply(option, REP_ACK, &[]);
                Err(HandshakeEnd::Closed)
            }
            OPT_LIST => {
                if !data.is_empty() {
                    self.error(option, REP_ERR_INVALID, "NBD_OPT_LIST takes no data")?;
                    return Ok(None);
                }
                for (name, _) in self.catalog.list() {
                    let mut entry = (name.len() as u32).to_be_bytes().to_vec();
                    entry.extend_from_slice(name.as_bytes());
                    self.reply(option, REP_SERVER, &entry)?;
                }
                self.reply(option, REP_ACK, &[])?;
                Ok(None)
            }
            OPT_INFO | OPT_GO => self.info_or_go(option, &data),
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    self.error(
                        option,
                        REP_ERR_INVALID,
                        "NBD_OPT_STRUCTURED_REPLY takes no data",
                    )?;
                } else {
                    self.structured = true;
                    self.reply(option, REP_ACK, &[])?;
                }
                Ok(None)
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                self.meta_context(option, &data)?;
                Ok(None)
            }
            _ => {
                self.error(option, REP_ERR_UNSUP, "option not supported")?;
                Ok(None)
            }
        }
    }

    fn export_name(&mut self, data: &[u8]) -> Result<Negotiated, HandshakeEnd> {
        let name = String::from_utf8_lossy(data).into_owned();
        // EXPORT_NAME has no way to report an error: closing is all the protocol allows.
        let export = self
            .catalog
            .open(&name)
            .ok_or_else(|| HandshakeEnd::Violation(format!("unknown export '{name}'")))?;
        let mut reply = export.device.size().to_be_bytes().to_vec();
        reply.extend_from_slice(&transmission_flags(&export).to_be_bytes());
        if !self.no_zeroes {
            reply.extend_from_slice(&[0u8; 124]);
        }
        self.stream.write_all(&reply)?;
        Ok(self.negotiated(name, export))
    }

    fn negotiated(&self, name: String, export: Export) -> Negotiated {
        Negotiated {
            name,
            export,
            structured: self.structured,
            base_allocation: self.structured && self.base_allocation,
        }
    }

    fn info_or_go(&mut self, option: u32, data: &[u8]) -> Result<Option<Negotiated>, HandshakeEnd> {
        let (name, infos) = match parse_info_request(data) {
            Ok(parsed) => parsed,
            Err(e) => {
                self.error(option, REP_ERR_INVALID, &e.to_string())?;
                return Ok(None);
            }
        };
        let Some(export) = self.catalog.open(&name) else {
            self.error(
                option,
                REP_ERR_UNKNOWN,
                &format!("no export named '{name}'"),
            )?;
            return Ok(None);
        };
        let mut info = INFO_EXPORT.to_be_bytes().to_vec();
        info.extend_from_slice(&export.device.size().to_be_bytes());
        info.extend_from_slice(&transmission_flags(&export).to_be_bytes());
        self.reply(option, REP_INFO, &info)?;
        // Block sizes are sent whether asked or not: the protocol allows it and clients that
        // did not ask still benefit from knowing the alignment.
        let mut sizes = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
        for v in [MIN_BLOCK, PREFERRED_BLOCK, MAX_PAYLOAD] {
            sizes.extend_from_slice(&v.to_be_bytes());
        }
        self.reply(option, REP_INFO, &sizes)?;
        if infos.contains(&INFO_NAME) {
            let mut reply = INFO_NAME.to_be_bytes().to_vec();
            reply.extend_from_slice(name.as_bytes());
            self.reply(option, REP_INFO, &reply)?;
        }
        if infos.contains(&INFO_DESCRIPTION) && !export.description.is_empty() {
            let mut reply = INFO_DESCRIPTION.to_be_bytes().to_vec();
            reply.extend_from_slice(export.description.as_bytes());
            self.reply(option, REP_INFO, &reply)?;
        }
        self.reply(option, REP_ACK, &[])?;
        Ok((option == OPT_GO).then(|| self.negotiated(name, export)))
    }

    fn meta_context(&mut self, option: u32, data: &[u8]) -> io::Result<()> {
        let (name, queries) = match parse_meta_context_request(data) {
            Ok(parsed) => parsed,
            Err(e) => return self.error(option, REP_ERR_INVALID, &e.to_string()),
        };
        if option == OPT_SET_META_CONTEXT && !self.structured {
            return self.error(
                option,
                REP_ERR_INVALID,
                "negotiate structured replies first",
            );
        }
        if self.catalog.open(&name).is_none() {
            return self.error(
                option,
                REP_ERR_UNKNOWN,
                &format!("no export named '{name}'"),
            );
        }
        let listing_all = option == OPT_LIST_META_CONTEXT && queries.is_empty();
        let selected = listing_all
            || queries
                .iter()
                .any(|q| q == BASE_ALLOCATION || (option == OPT_LIST_META_CONTEXT && q == "base:"));
        if option == OPT_SET_META_CONTEXT {
            self.base_allocation = selected;
        }
        if selected {
            // Ids mean something only for SET; LIST answers 0, as the protocol asks.
            let id = if option == OPT_SET_META_CONTEXT {
                BASE_ALLOCATION_ID
            } else {
                0
            };
            let mut reply = id.to_be_bytes().to_vec();
            reply.extend_from_slice(BASE_ALLOCATION.as_bytes());
            self.reply(option, REP_META_CONTEXT, &reply)?;
        }
        self.reply(option, REP_ACK, &[])
    }
}
