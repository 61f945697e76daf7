//! The fixed newstyle handshake: options until the client picks an export (GO or
//! EXPORT_NAME), aborts, or breaks the protocol.

use std::io::{self, Read, Write};
use std::sync::Arc;

use log::debug;

use crate::protocol::*;
use crate::{Export, ExportCatalog};
use udm_block::MetaContext;

/// Options larger than this are refused with ERR_TOO_BIG (names are at most 4 KiB; a meta
/// context request with many queries stays far below).
const MAX_OPTION_LEN: u32 = 64 * 1024;

/// Block sizes we advertise: sector-aligned requests, 4 KiB preferred, 32 MiB at most.
pub const MIN_BLOCK: u32 = 512;
pub const PREFERRED_BLOCK: u32 = 4096;
pub const MAX_PAYLOAD: u32 = 32 << 20;

/// Meta contexts selected besides base:allocation, with the ids the client knows them by.
pub type Contexts = Vec<(u32, Arc<dyn MetaContext>)>;

pub struct Negotiated {
    pub name: String,
    pub export: Export,
    pub structured: bool,
    pub base_allocation: bool,
    /// Other meta contexts selected, with their ids.
    pub contexts: Contexts,
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

/// What the server offers for NBD_OPT_STARTTLS.
pub struct StartTls<'a, S> {
    /// The spec's FORCEDTLS: until TLS is up, every option but STARTTLS and ABORT is refused
    /// with NBD_REP_ERR_TLS_REQD. Otherwise (SELECTIVETLS) plaintext clients are served too.
    pub required: bool,
    /// Runs the TLS handshake on the stream and leaves the stream carrying the plaintext.
    pub upgrade: &'a dyn Fn(&mut S) -> io::Result<()>,
}

struct Handshake<'a, S> {
    stream: &'a mut S,
    catalog: &'a dyn ExportCatalog,
    structured: bool,
    base_allocation: bool,
    /// Meta contexts other than base:allocation selected by SET_META_CONTEXT, for the export
    /// named first.
    contexts: Option<(String, Contexts)>,
    no_zeroes: bool,
    tls: Option<StartTls<'a, S>>,
    tls_active: bool,
}

fn greet(stream: &mut impl Write) -> io::Result<()> {
    stream.write_all(&greeting())
}

fn greeting() -> Vec<u8> {
    let mut greeting = Vec::with_capacity(18);
    greeting.extend_from_slice(&NBDMAGIC.to_be_bytes());
    greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    greeting
}

/// Options a refused client may send before it is disconnected.
const MAX_REFUSED_OPTIONS: usize = 16;

/// Tells a client the server will not serve it (too many connections): the greeting, then
/// NBD_REP_ERR_POLICY with `why` for every option, so that the client's NBD_OPT_GO fails with
/// the reason whatever it asks first. Ends when the client aborts, breaks the protocol, or
/// picks an export with NBD_OPT_EXPORT_NAME, which has no error reply: closing is all the
/// protocol allows.
///
/// Without I/O of its own: one thread answers every refused client on non-blocking sockets
/// (see `refusals`), feeding each one's bytes in as they come. What it keeps is a
/// 16-byte header and a count, and what it answers is bounded by [`MAX_REFUSED_OPTIONS`].
pub struct Refusal {
    why: Arc<str>,
    /// The part of the client's flags or of an option header received so far.
    header: Vec<u8>,
    stage: RefusalStage,
    options: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RefusalStage {
    /// The client's 4 bytes of flags: nothing is negotiated.
    Flags,
    /// An option's 16-byte header.
    OptionHeader,
    /// An option's data, skipped, then answered.
    Skipping {
        option: u32,
        left: u32,
    },
    Over,
}

impl Refusal {
    /// A refusal saying `why`, and the greeting to send first.
    pub fn new(why: Arc<str>) -> (Refusal, Vec<u8>) {
        let refusal = Refusal {
            why,
            header: Vec::with_capacity(16),
            stage: RefusalStage::Flags,
            options: 0,
        };
        (refusal, greeting())
    }

    /// Whether the exchange is over: the connection closes once the answers are sent.
    pub fn is_over(&self) -> bool {
        self.stage == RefusalStage::Over
    }

    /// Takes what the client sent, appending the answers to `out`. Bytes past the end of
    /// the exchange are ignored.
    pub fn receive(&mut self, mut input: &[u8], out: &mut Vec<u8>) {
        while !self.is_over() {
            match self.stage {
                RefusalStage::Flags | RefusalStage::OptionHeader => {
                    let wanted = if self.stage == RefusalStage::Flags {
                        4
                    } else {
                        16
                    };
                    let n = (wanted - self.header.len()).min(input.len());
                    self.header.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    if self.header.len() < wanted {
                        return;
                    }
                    if self.stage == RefusalStage::Flags {
                        self.stage = RefusalStage::OptionHeader;
                    } else {
                        self.stage = self.option_header();
                    }
                    self.header.clear();
                }
                RefusalStage::Skipping { option, left } => {
                    let n = (left as usize).min(input.len());
                    input = &input[n..];
                    let left = left - n as u32;
                    if left > 0 {
                        self.stage = RefusalStage::Skipping { option, left };
                        return;
                    }
                    self.stage = self.answer(option, out);
                }
                RefusalStage::Over => unreachable!("the loop ends when the refusal is over"),
            }
        }
    }

    /// What follows a complete option header.
    fn option_header(&self) -> RefusalStage {
        let magic = u64::from_be_bytes(self.header[..8].try_into().expect("8 bytes"));
        let option = u32::from_be_bytes(self.header[8..12].try_into().expect("4 bytes"));
        let left = u32::from_be_bytes(self.header[12..16].try_into().expect("4 bytes"));
        if magic != IHAVEOPT {
            debug!("nbd: refused client sent bad option magic {magic:#x}");
            return RefusalStage::Over;
        }
        if option == OPT_EXPORT_NAME || left > MAX_OPTION_LEN {
            return RefusalStage::Over;
        }
        RefusalStage::Skipping { option, left }
    }

    fn answer(&mut self, option: u32, out: &mut Vec<u8>) -> RefusalStage {
        if option == OPT_ABORT {
            out.extend_from_slice(&option_reply(option, REP_ACK, &[]));
            return RefusalStage::Over;
        }
        out.extend_from_slice(&option_reply(option, REP_ERR_POLICY, self.why.as_bytes()));
        self.options += 1;
        if self.options == MAX_REFUSED_OPTIONS {
            RefusalStage::Over
        } else {
            RefusalStage::OptionHeader
        }
    }
}

/// Runs the handshake on any byte stream (a socket, or a fuzzer's buffer), without TLS.
pub fn negotiate<S: Read + Write>(
    stream: &mut S,
    catalog: &dyn ExportCatalog,
) -> Result<Negotiated, HandshakeEnd> {
    negotiate_with_tls(stream, catalog, None)
}

/// Runs the handshake, offering TLS when `tls` is given.
pub fn negotiate_with_tls<'a, S: Read + Write>(
    stream: &'a mut S,
    catalog: &'a dyn ExportCatalog,
    tls: Option<StartTls<'a, S>>,
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
        contexts: None,
        no_zeroes: client_flags & CLIENT_NO_ZEROES != 0,
        tls,
        tls_active: false,
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

    /// Handles one option; `Some` when the client has picked an export. One arm per option,
    /// as the protocol lists them: long for that reason.
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
        let tls_missing = !self.tls_active && self.tls.as_ref().is_some_and(|t| t.required);
        if tls_missing && !matches!(option, OPT_STARTTLS | OPT_ABORT) {
            if option == OPT_EXPORT_NAME {
                // No error reply exists for EXPORT_NAME; closing is the refusal.
                return Err(HandshakeEnd::Violation(
                    "NBD_OPT_EXPORT_NAME before TLS, which this server requires".into(),
                ));
            }
            self.error(
                option,
                REP_ERR_TLS_REQD,
                "this server requires TLS: negotiate NBD_OPT_STARTTLS first",
            )?;
            return Ok(None);
        }
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
            OPT_STARTTLS => self.start_tls(&data),
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

    fn start_tls(&mut self, data: &[u8]) -> Result<Option<Negotiated>, HandshakeEnd> {
        let Some(upgrade) = self.tls.as_ref().map(|t| t.upgrade) else {
            self.error(
                OPT_STARTTLS,
                REP_ERR_UNSUP,
                "TLS is not enabled on this server",
            )?;
            return Ok(None);
        };
        if !data.is_empty() {
            self.error(
                OPT_STARTTLS,
                REP_ERR_INVALID,
                "NBD_OPT_STARTTLS takes no data",
            )?;
        } else if self.tls_active {
            self.error(OPT_STARTTLS, REP_ERR_INVALID, "TLS is already negotiated")?;
        } else {
            self.reply(OPT_STARTTLS, REP_ACK, &[])?;
            upgrade(self.stream)
                .map_err(|e| HandshakeEnd::Violation(format!("TLS handshake failed: {e}")))?;
            self.tls_active = true;
            // Nothing agreed in plaintext may carry over: a man in the middle could have
            // chosen it (the spec asks servers to forget such state).
            self.structured = false;
            self.base_allocation = false;
            self.contexts = None;
        }
        Ok(None)
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
            export,
            structured: self.structured,
            base_allocation: self.structured && self.base_allocation,
            // Contexts chosen for another export mean nothing for this one.
            contexts: match &self.contexts {
                Some((export, contexts)) if self.structured && *export == name => contexts.clone(),
                _ => Vec::new(),
            },
            name,
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
        let listing = option == OPT_LIST_META_CONTEXT;
        let listing_all = listing && queries.is_empty();
        let selected = listing_all
            || queries
                .iter()
                .any(|q| q == BASE_ALLOCATION || (listing && q == "base:"));
        if !listing {
            self.base_allocation = selected;
        }
        // Ids mean something only for SET; LIST answers 0, as the protocol asks.
        let mut answers: Vec<(u32, String)> = Vec::new();
        if selected {
            answers.push((
                if listing { 0 } else { BASE_ALLOCATION_ID },
                BASE_ALLOCATION.into(),
            ));
        }
        let mut contexts = Vec::new();
        for query in queries.iter().filter(|q| !q.starts_with("base:")) {
            if listing && (query.is_empty() || query.ends_with(':')) {
                for found in self.catalog.meta_contexts(&name, query) {
                    answers.push((0, found));
                }
            } else if let Some(context) = self.catalog.meta_context(&name, query) {
                let id = BASE_ALLOCATION_ID + 1 + contexts.len() as u32;
                answers.push((if listing { 0 } else { id }, query.clone()));
                contexts.push((id, context));
            }
        }
        if listing_all {
            answers.extend(
                self.catalog
                    .meta_contexts(&name, "")
                    .into_iter()
                    .map(|c| (0, c)),
            );
        }
        if !listing {
            self.contexts = Some((name.clone(), contexts));
        }
        for (id, context) in answers {
            let mut reply = id.to_be_bytes().to_vec();
            reply.extend_from_slice(context.as_bytes());
            self.reply(option, REP_META_CONTEXT, &reply)?;
        }
        self.reply(option, REP_ACK, &[])
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use udm_testkit::Devices;

    use super::*;

    /// A client that sends a fixed script and records the server's bytes.
    struct Scripted {
        input: io::Cursor<Vec<u8>>,
        output: Vec<u8>,
    }

    impl Read for Scripted {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.input.read(buf)
        }
    }

    impl Write for Scripted {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.output.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn script(options: &[(u32, &[u8])]) -> Scripted {
        let mut input = (CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES)
            .to_be_bytes()
            .to_vec();
        for (option, data) in options {
            input.extend_from_slice(&encode_option(*option, data));
        }
        Scripted {
            input: io::Cursor::new(input),
            output: Vec::new(),
        }
    }

    /// The (option, reply type) of every option reply the server sent.
    fn replies(output: &[u8]) -> Vec<(u32, u32)> {
        let mut rest = &output[18..]; // past the greeting
        let mut out = Vec::new();
        while !rest.is_empty() {
            let header =
                parse_option_reply_header(rest[..OPTION_REPLY_HEADER_LEN].try_into().unwrap())
                    .unwrap();
            out.push((header.option, header.reply));
            rest = &rest[OPTION_REPLY_HEADER_LEN + header.length as usize..];
        }
        out
    }

    /// Runs the script against a server offering TLS (`required` or not); the upgrade is a
    /// no-op that counts its calls.
    fn run(
        required: Option<bool>,
        options: &[(u32, &[u8])],
    ) -> (Result<Negotiated, HandshakeEnd>, Vec<(u32, u32)>, usize) {
        let mut stream = script(options);
        let upgrades = Cell::new(0);
        let upgrade = |_: &mut Scripted| {
            upgrades.set(upgrades.get() + 1);
            Ok(())
        };
        let tls = required.map(|required| StartTls {
            required,
            upgrade: &upgrade,
        });
        let catalog = Devices::memory(&[("vol", 1 << 20)]);
        let result = negotiate_with_tls(&mut stream, &catalog, tls);
        (result, replies(&stream.output), upgrades.get())
    }

    #[test]
    fn required_tls_refuses_every_option_before_starttls() {
        let go = encode_info_request("vol", &[]);
        let (result, replies, upgrades) = run(
            Some(true),
            &[
                (OPT_LIST, &[]),
                (OPT_STRUCTURED_REPLY, &[]),
                (OPT_GO, &go),
                (OPT_STARTTLS, &[]),
                (OPT_GO, &go),
            ],
        );
        assert_eq!(
            &replies[..4],
            &[
                (OPT_LIST, REP_ERR_TLS_REQD),
                (OPT_STRUCTURED_REPLY, REP_ERR_TLS_REQD),
                (OPT_GO, REP_ERR_TLS_REQD),
                (OPT_STARTTLS, REP_ACK),
            ]
        );
        assert_eq!(replies.last(), Some(&(OPT_GO, REP_ACK)));
        assert_eq!(upgrades, 1);
        assert_eq!(result.unwrap().name, "vol");
    }

    #[test]
    fn required_tls_closes_on_export_name_before_starttls() {
        let (result, _, _) = run(Some(true), &[(OPT_EXPORT_NAME, b"vol")]);
        assert!(matches!(result, Err(HandshakeEnd::Violation(_))));
    }

    #[test]
    fn starttls_forgets_plaintext_state_and_is_accepted_once() {
        let go = encode_info_request("vol", &[]);
        let (result, replies, upgrades) = run(
            Some(false),
            &[
                (OPT_STRUCTURED_REPLY, &[]),
                (OPT_STARTTLS, &[]),
                (OPT_STARTTLS, &[]),
                (OPT_GO, &go),
            ],
        );
        assert_eq!(
            &replies[..3],
            &[
                (OPT_STRUCTURED_REPLY, REP_ACK),
                (OPT_STARTTLS, REP_ACK),
                (OPT_STARTTLS, REP_ERR_INVALID),
            ]
        );
        assert_eq!(upgrades, 1);
        assert!(
            !result.unwrap().structured,
            "structured replies survived STARTTLS"
        );
    }

    #[test]
    fn starttls_without_tls_is_unsupported() {
        let (_, replies, _) = run(None, &[(OPT_STARTTLS, &[]), (OPT_ABORT, &[])]);
        assert_eq!(replies[0], (OPT_STARTTLS, REP_ERR_UNSUP));
    }

    /// A refused client fed one byte at a time: each option is answered with the reason once
    /// its data is in, and an abort ends the exchange with an ACK.
    #[test]
    fn a_refusal_answers_each_option_however_its_bytes_arrive() {
        let option = |code: u32, data: &[u8]| {
            let mut bytes = IHAVEOPT.to_be_bytes().to_vec();
            bytes.extend_from_slice(&code.to_be_bytes());
            bytes.extend_from_slice(&(data.len() as u32).to_be_bytes());
            bytes.extend_from_slice(data);
            bytes
        };
        let mut client = 0u32.to_be_bytes().to_vec();
        client.extend(option(OPT_GO, b"\0\0\0\x03vol\0\0"));
        client.extend(option(OPT_LIST, &[]));
        client.extend(option(OPT_ABORT, &[]));
        let (mut refusal, greeting) = Refusal::new("too many".into());
        assert_eq!(greeting.len(), 18);
        let mut out = Vec::new();
        for byte in &client {
            assert!(!refusal.is_over());
            refusal.receive(std::slice::from_ref(byte), &mut out);
        }
        assert!(refusal.is_over());
        let mut expected = option_reply(OPT_GO, REP_ERR_POLICY, b"too many");
        expected.extend(option_reply(OPT_LIST, REP_ERR_POLICY, b"too many"));
        expected.extend(option_reply(OPT_ABORT, REP_ACK, &[]));
        assert_eq!(out, expected);
    }
}
