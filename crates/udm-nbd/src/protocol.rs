//! Wire constants and the pure encoding/decoding functions of the NBD protocol
//! (`doc/proto.md` of the NetworkBlockDevice project). Nothing here does I/O, so the parsers
//! can be fuzzed and unit-tested on byte slices.

use thiserror::Error;

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
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
pub const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
pub const REP_ERR_INVALID: u32 = (1 << 31) + 3;
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
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
}
