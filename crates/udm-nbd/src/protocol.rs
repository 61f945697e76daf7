//! Wire constants and the pure encoding/decoding functions of the NBD protocol
//! (`doc/proto.md` of the NetworkBlockDevice project). Nothing here does I/O, so the parsers
//! can be fuzzed and unit-tested on byte slices.

use thiserror::Error;

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// What an oldstyle server sends where a newstyle one sends `IHAVEOPT`.
pub const OLDSTYLE_MAGIC: u64 = 0x0000_4202_8186_1253;
pub const OPTION_REPLY_MAGIC: u64 = 0x3_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// Handshake flags.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const CLIENT_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const CLIENT_NO_ZEROES: u32 = 1 << 1;

// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

// Option replies.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
/// Every error reply has this bit set, including ones this code does not know.
pub const REP_ERR_BIT: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
pub const REP_ERR_POLICY: u32 = (1 << 31) + 2;
pub const REP_ERR_INVALID: u32 = (1 << 31) + 3;
pub const REP_ERR_PLATFORM: u32 = (1 << 31) + 4;
pub const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
pub const REP_ERR_SHUTDOWN: u32 = (1 << 31) + 7;
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = (1 << 31) + 8;
pub const REP_ERR_TOO_BIG: u32 = (1 << 31) + 9;

// Info types.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// Transmission flags.
pub const TF_HAS_FLAGS: u16 = 1 << 0;
pub const TF_READ_ONLY: u16 = 1 << 1;
pub const TF_SEND_FLUSH: u16 = 1 << 2;
pub const TF_SEND_FUA: u16 = 1 << 3;
pub const TF_ROTATIONAL: u16 = 1 << 4;
pub const TF_SEND_TRIM: u16 = 1 << 5;
pub const TF_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TF_SEND_DF: u16 = 1 << 7;
pub const TF_CAN_MULTI_CONN: u16 = 1 << 8;
pub const TF_SEND_CACHE: u16 = 1 << 10;
pub const TF_SEND_FAST_ZERO: u16 = 1 << 11;

// Commands and their flags.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

// Structured reply chunks.
pub const CHUNK_FLAG_DONE: u16 = 1;
pub const CHUNK_NONE: u16 = 0;
pub const CHUNK_OFFSET_DATA: u16 = 1;
pub const CHUNK_OFFSET_HOLE: u16 = 2;
pub const CHUNK_BLOCK_STATUS: u16 = 5;
pub const CHUNK_ERROR: u16 = 32769;
pub const CHUNK_ERROR_OFFSET: u16 = 32770;
/// Chunk types with this bit set are errors, even the ones this code does not know.
pub const CHUNK_ERROR_BIT: u16 = 1 << 15;

// Errors on the wire.
pub const NBD_EPERM: u32 = 1;
pub const NBD_EIO: u32 = 5;
pub const NBD_ENOMEM: u32 = 12;
pub const NBD_EINVAL: u32 = 22;
pub const NBD_ENOSPC: u32 = 28;
pub const NBD_EOVERFLOW: u32 = 75;
pub const NBD_ENOTSUP: u32 = 95;
pub const NBD_ESHUTDOWN: u32 = 108;

pub const BASE_ALLOCATION: &str = "base:allocation";
/// The id we give `base:allocation` when a client selects it.
pub const BASE_ALLOCATION_ID: u32 = 1;

pub const REQUEST_HEADER_LEN: usize = 28;
pub const OPTION_REPLY_HEADER_LEN: usize = 20;
pub const SIMPLE_REPLY_LEN: usize = 16;
pub const CHUNK_HEADER_LEN: usize = 20;

/// The one mapping from errno to the NBD error a client sees.
pub fn nbd_error(errno: i32) -> u32 {
    match errno {
        libc::EPERM | libc::EROFS | libc::EACCES | libc::EBADF => NBD_EPERM,
        libc::ENOMEM => NBD_ENOMEM,
        libc::EINVAL => NBD_EINVAL,
        libc::ENOSPC | libc::EDQUOT | libc::EFBIG => NBD_ENOSPC,
        libc::EOVERFLOW => NBD_EOVERFLOW,
        libc::EOPNOTSUPP | libc::ENOSYS => NBD_ENOTSUP,
        libc::ESHUTDOWN => NBD_ESHUTDOWN,
        _ => NBD_EIO,
    }
}

/// Why a byte sequence is not a valid protocol message.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ProtocolError {
    #[error("bad magic {0:#x}")]
    BadMagic(u64),
    #[error("{0} is truncated")]
    Truncated(&'static str),
    #[error("{0}")]
    Invalid(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub command: u16,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

pub fn parse_request(header: &[u8; REQUEST_HEADER_LEN]) -> Result<Request, ProtocolError> {
    let magic = u32::from_be_bytes(header[0..4].try_into().unwrap());
    if magic != REQUEST_MAGIC {
        return Err(ProtocolError::BadMagic(magic.into()));
    }
    Ok(Request {
        flags: u16::from_be_bytes(header[4..6].try_into().unwrap()),
        command: u16::from_be_bytes(header[6..8].try_into().unwrap()),
        cookie: u64::from_be_bytes(header[8..16].try_into().unwrap()),
        offset: u64::from_be_bytes(header[16..24].try_into().unwrap()),
        length: u32::from_be_bytes(header[24..28].try_into().unwrap()),
    })
}

pub fn encode_request(r: &Request) -> [u8; REQUEST_HEADER_LEN] {
    let mut out = [0u8; REQUEST_HEADER_LEN];
    out[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&r.flags.to_be_bytes());
    out[6..8].copy_from_slice(&r.command.to_be_bytes());
    out[8..16].copy_from_slice(&r.cookie.to_be_bytes());
    out[16..24].copy_from_slice(&r.offset.to_be_bytes());
    out[24..28].copy_from_slice(&r.length.to_be_bytes());
    out
}

pub fn simple_reply(cookie: u64, error: u32) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out[4..8].copy_from_slice(&error.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    out
}

pub fn chunk_header(flags: u16, kind: u16, cookie: u64, length: u32) -> [u8; 20] {
    let mut out = [0u8; 20];
    out[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&flags.to_be_bytes());
    out[6..8].copy_from_slice(&kind.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    out[16..20].copy_from_slice(&length.to_be_bytes());
    out
}

pub fn option_reply(option: u32, reply: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(20 + data.len());
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out
}

/// A cursor over option data that reports truncation instead of panicking.
pub struct Reader<'a> {
    data: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub fn new(data: &'a [u8], what: &'static str) -> Self {
        Reader { data, what }
    }
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], ProtocolError> {
        if self.data.len() < n {
            return Err(ProtocolError::Truncated(self.what));
        }
        let (head, tail) = self.data.split_at(n);
        self.data = tail;
        Ok(head)
    }
    pub fn u16(&mut self) -> Result<u16, ProtocolError> {
        Ok(u16::from_be_bytes(self.bytes(2)?.try_into().unwrap()))
    }
    pub fn u32(&mut self) -> Result<u32, ProtocolError> {
        Ok(u32::from_be_bytes(self.bytes(4)?.try_into().unwrap()))
    }
    pub fn u64(&mut self) -> Result<u64, ProtocolError> {
        Ok(u64::from_be_bytes(self.bytes(8)?.try_into().unwrap()))
    }
    /// Whatever is left.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.data)
    }
    /// A u32 length followed by that many bytes of UTF-8.
    pub fn string(&mut self) -> Result<String, ProtocolError> {
        let len = self.u32()? as usize;
        let bytes = self.bytes(len)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| ProtocolError::Invalid(format!("{} contains invalid UTF-8", self.what)))
    }
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

/// The data of NBD_OPT_INFO / NBD_OPT_GO: an export name and the info types asked for.
pub fn parse_info_request(data: &[u8]) -> Result<(String, Vec<u16>), ProtocolError> {
    let mut r = Reader::new(data, "NBD_OPT_INFO/GO data");
    let name = r.string()?;
    let count = r.u16()?;
    let infos = (0..count).map(|_| r.u16()).collect::<Result<Vec<_>, _>>()?;
    if !r.is_empty() {
        return Err(ProtocolError::Invalid(
            "trailing bytes after the info requests".into(),
        ));
    }
    Ok((name, infos))
}

/// The data of NBD_OPT_LIST/SET_META_CONTEXT: an export name and the context queries.
pub fn parse_meta_context_request(data: &[u8]) -> Result<(String, Vec<String>), ProtocolError> {
    let mut r = Reader::new(data, "meta context request");
    let name = r.string()?;
    let count = r.u32()?;
    if count as usize > data.len() / 4 {
        return Err(ProtocolError::Invalid(format!(
            "{count} queries cannot fit the data"
        )));
    }
    let queries = (0..count)
        .map(|_| r.string())
        .collect::<Result<Vec<_>, _>>()?;
    if !r.is_empty() {
        return Err(ProtocolError::Invalid(
            "trailing bytes after the queries".into(),
        ));
    }
    Ok((name, queries))
}

// The client's side of the conversation: what it sends, and the replies it parses.

/// An option as the client sends it: magic, option, data length, data.
pub fn encode_option(option: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + data.len());
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out
}

fn push_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// The data of NBD_OPT_INFO / NBD_OPT_GO; the inverse of [`parse_info_request`].
pub fn encode_info_request(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut out = Vec::with_capacity(6 + name.len() + 2 * infos.len());
    push_string(&mut out, name);
    out.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for info in infos {
        out.extend_from_slice(&info.to_be_bytes());
    }
    out
}

/// The data of NBD_OPT_LIST/SET_META_CONTEXT; the inverse of [`parse_meta_context_request`].
pub fn encode_meta_context_request(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut out = Vec::new();
    push_string(&mut out, name);
    out.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for query in queries {
        push_string(&mut out, query);
    }
    out
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionReplyHeader {
    pub option: u32,
    pub reply: u32,
    pub length: u32,
}

pub fn parse_option_reply_header(
    header: &[u8; OPTION_REPLY_HEADER_LEN],
) -> Result<OptionReplyHeader, ProtocolError> {
    let mut r = Reader::new(header, "option reply header");
    let magic = r.u64()?;
    if magic != OPTION_REPLY_MAGIC {
        return Err(ProtocolError::BadMagic(magic));
    }
    Ok(OptionReplyHeader {
        option: r.u32()?,
        reply: r.u32()?,
        length: r.u32()?,
    })
}

/// Words for an option error reply, for messages when the server sends no text of its own.
pub fn option_error_name(reply: u32) -> &'static str {
    match reply {
        REP_ERR_UNSUP => "option not supported",
        REP_ERR_POLICY => "forbidden by the server's policy",
        REP_ERR_INVALID => "invalid option",
        REP_ERR_PLATFORM => "not supported on the server's platform",
        REP_ERR_TLS_REQD => "TLS required",
        REP_ERR_UNKNOWN => "no such export",
        REP_ERR_SHUTDOWN => "the server is shutting down",
        REP_ERR_BLOCK_SIZE_REQD => "block size negotiation required",
        REP_ERR_TOO_BIG => "request too big",
        _ => "unknown error",
    }
}

/// One `NBD_REP_INFO` reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Info {
    Export {
        size: u64,
        flags: u16,
    },
    BlockSize {
        min: u32,
        preferred: u32,
        max: u32,
    },
    /// A kind this code has no use for (name, description, future ones).
    Other(u16),
}

pub fn parse_info_reply(data: &[u8]) -> Result<Info, ProtocolError> {
    let mut r = Reader::new(data, "NBD_REP_INFO");
    let info = match r.u16()? {
        INFO_EXPORT => Info::Export {
            size: r.u64()?,
            flags: r.u16()?,
        },
        INFO_BLOCK_SIZE => Info::BlockSize {
            min: r.u32()?,
            preferred: r.u32()?,
            max: r.u32()?,
        },
        other => return Ok(Info::Other(other)),
    };
    if !r.is_empty() {
        return Err(ProtocolError::Invalid(
            "trailing bytes after an info reply".into(),
        ));
    }
    Ok(info)
}

/// One `NBD_REP_META_CONTEXT` reply: the context's id and name.
pub fn parse_meta_context_reply(data: &[u8]) -> Result<(u32, String), ProtocolError> {
    let mut r = Reader::new(data, "NBD_REP_META_CONTEXT");
    let id = r.u32()?;
    let name = String::from_utf8(r.rest().to_vec())
        .map_err(|_| ProtocolError::Invalid("meta context name contains invalid UTF-8".into()))?;
    Ok((id, name))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimpleReply {
    pub error: u32,
    pub cookie: u64,
}

pub fn parse_simple_reply(header: &[u8; SIMPLE_REPLY_LEN]) -> Result<SimpleReply, ProtocolError> {
    let mut r = Reader::new(header, "simple reply");
    let magic = r.u32()?;
    if magic != SIMPLE_REPLY_MAGIC {
        return Err(ProtocolError::BadMagic(magic.into()));
    }
    Ok(SimpleReply {
        error: r.u32()?,
        cookie: r.u64()?,
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub length: u32,
}

pub fn parse_chunk_header(header: &[u8; CHUNK_HEADER_LEN]) -> Result<ChunkHeader, ProtocolError> {
    let mut r = Reader::new(header, "structured reply chunk header");
    let magic = r.u32()?;
    if magic != STRUCTURED_REPLY_MAGIC {
        return Err(ProtocolError::BadMagic(magic.into()));
    }
    Ok(ChunkHeader {
        flags: r.u16()?,
        kind: r.u16()?,
        cookie: r.u64()?,
        length: r.u32()?,
    })
}

/// The payload of a BLOCK_STATUS chunk: the context id and its (length, flags) descriptors.
pub fn parse_block_status(payload: &[u8]) -> Result<(u32, Vec<(u32, u32)>), ProtocolError> {
    let mut r = Reader::new(payload, "block status chunk");
    let context = r.u32()?;
    let body = r.rest();
    if body.is_empty() || !body.len().is_multiple_of(8) {
        return Err(ProtocolError::Invalid(format!(
            "block status chunk with {} bytes of descriptors",
            body.len()
        )));
    }
    let mut r = Reader::new(body, "block status descriptor");
    let extents = (0..body.len() / 8)
        .map(|_| Ok((r.u32()?, r.u32()?)))
        .collect::<Result<Vec<_>, ProtocolError>>()?;
    Ok((context, extents))
}

/// The payload of an error chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkError {
    pub error: u32,
    pub message: String,
    /// Where the error happened, for `NBD_REPLY_TYPE_ERROR_OFFSET`.
    pub offset: Option<u64>,
}

pub fn parse_error_chunk(kind: u16, payload: &[u8]) -> Result<ChunkError, ProtocolError> {
    let mut r = Reader::new(payload, "error chunk");
    let error = r.u32()?;
    if error == 0 {
        return Err(ProtocolError::Invalid("error chunk with error 0".into()));
    }
    let len = r.u16()?;
    let message = String::from_utf8_lossy(r.bytes(len.into())?).into_owned();
    let offset = if kind == CHUNK_ERROR_OFFSET {
        Some(r.u64()?)
    } else {
        None
    };
    Ok(ChunkError {
        error,
        message,
        offset,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips_and_bad_magic_is_caught() {
        let r = Request {
            flags: 1,
            command: CMD_WRITE,
            cookie: 7,
            offset: 4096,
            length: 512,
        };
        assert_eq!(parse_request(&encode_request(&r)).unwrap(), r);
        let mut bad = encode_request(&r);
        bad[0] ^= 1;
        assert!(matches!(
            parse_request(&bad),
            Err(ProtocolError::BadMagic(_))
        ));
    }

    #[test]
    fn info_request_parses_and_rejects_truncation() {
        let mut data = Vec::new();
        data.extend_from_slice(&3u32.to_be_bytes());
        data.extend_from_slice(b"vol");
        data.extend_from_slice(&1u16.to_be_bytes());
        data.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        assert_eq!(
            parse_info_request(&data).unwrap(),
            ("vol".into(), vec![INFO_BLOCK_SIZE])
        );
        for cut in 0..data.len() {
            assert!(parse_info_request(&data[..cut]).is_err(), "cut at {cut}");
        }
        let mut huge = data.clone();
        huge[0..4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(parse_info_request(&huge).is_err());
    }

    #[test]
    fn meta_context_request_with_absurd_count_is_refused() {
        let mut data = Vec::new();
        data.extend_from_slice(&0u32.to_be_bytes());
        data.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(parse_meta_context_request(&data).is_err());
    }

    #[test]
    fn errno_mapping_covers_the_protocol_errors() {
        assert_eq!(nbd_error(libc::EIO), NBD_EIO);
        assert_eq!(nbd_error(libc::EROFS), NBD_EPERM);
        assert_eq!(nbd_error(libc::EOPNOTSUPP), NBD_ENOTSUP);
        assert_eq!(nbd_error(libc::EDQUOT), NBD_ENOSPC);
        assert_eq!(nbd_error(libc::ESHUTDOWN), NBD_ESHUTDOWN);
        assert_eq!(nbd_error(libc::ENOENT), NBD_EIO);
    }

    #[test]
    fn client_encodings_round_trip_through_the_server_parsers() {
        let info = encode_info_request("vol", &[INFO_BLOCK_SIZE, INFO_NAME]);
        assert_eq!(
            parse_info_request(&info).unwrap(),
            ("vol".into(), vec![INFO_BLOCK_SIZE, INFO_NAME])
        );
        let meta = encode_meta_context_request("vol", &[BASE_ALLOCATION]);
        assert_eq!(
            parse_meta_context_request(&meta).unwrap(),
            ("vol".into(), vec![BASE_ALLOCATION.to_string()])
        );
        let option = encode_option(OPT_GO, &info);
        assert_eq!(&option[..8], &IHAVEOPT.to_be_bytes());
        assert_eq!(&option[16..], &info[..]);
    }

    #[test]
    fn replies_the_server_encodes_parse_back() {
        let reply = option_reply(OPT_GO, REP_INFO, &[0, 0]);
        let header = parse_option_reply_header(reply[..20].try_into().unwrap()).unwrap();
        assert_eq!(
            header,
            OptionReplyHeader {
                option: OPT_GO,
                reply: REP_INFO,
                length: 2
            }
        );
        assert_eq!(
            parse_simple_reply(&simple_reply(9, NBD_EIO)).unwrap(),
            SimpleReply {
                error: NBD_EIO,
                cookie: 9
            }
        );
        let chunk = chunk_header(CHUNK_FLAG_DONE, CHUNK_OFFSET_DATA, 3, 4104);
        assert_eq!(
            parse_chunk_header(&chunk).unwrap(),
            ChunkHeader {
                flags: CHUNK_FLAG_DONE,
                kind: CHUNK_OFFSET_DATA,
                cookie: 3,
                length: 4104
            }
        );
        assert!(matches!(
            parse_simple_reply(chunk[..16].try_into().unwrap()),
            Err(ProtocolError::BadMagic(_))
        ));
    }

    #[test]
    fn info_replies_parse_and_unknown_kinds_pass() {
        let mut export = INFO_EXPORT.to_be_bytes().to_vec();
        export.extend_from_slice(&(1u64 << 30).to_be_bytes());
        export.extend_from_slice(&(TF_HAS_FLAGS | TF_SEND_FLUSH).to_be_bytes());
        assert_eq!(
            parse_info_reply(&export).unwrap(),
            Info::Export {
                size: 1 << 30,
                flags: TF_HAS_FLAGS | TF_SEND_FLUSH
            }
        );
        assert!(parse_info_reply(&export[..10]).is_err());
        let mut name = INFO_NAME.to_be_bytes().to_vec();
        name.extend_from_slice(b"vol");
        assert_eq!(parse_info_reply(&name).unwrap(), Info::Other(INFO_NAME));
    }

    #[test]
    fn block_status_and_error_payloads_parse() {
        let mut payload = 7u32.to_be_bytes().to_vec();
        for (len, flags) in [(4096u32, 3u32), (512, 0)] {
            payload.extend_from_slice(&len.to_be_bytes());
            payload.extend_from_slice(&flags.to_be_bytes());
        }
        assert_eq!(
            parse_block_status(&payload).unwrap(),
            (7, vec![(4096, 3), (512, 0)])
        );
        assert!(parse_block_status(&payload[..4]).is_err());
        assert!(parse_block_status(&payload[..9]).is_err());

        let mut error = NBD_ENOSPC.to_be_bytes().to_vec();
        error.extend_from_slice(&4u16.to_be_bytes());
        error.extend_from_slice(b"full");
        error.extend_from_slice(&8192u64.to_be_bytes());
        assert_eq!(
            parse_error_chunk(CHUNK_ERROR_OFFSET, &error).unwrap(),
            ChunkError {
                error: NBD_ENOSPC,
                message: "full".into(),
                offset: Some(8192)
            }
        );
        assert!(parse_error_chunk(CHUNK_ERROR_OFFSET, &error[..10]).is_err());
        assert!(parse_error_chunk(CHUNK_ERROR, &[0, 0, 0, 0, 0, 0]).is_err());
    }
}
