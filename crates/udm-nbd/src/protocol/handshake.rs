//! The handshake: the server's greeting, the options a client sends (with their data) and
//! the server's replies to them, for both sides.

use super::wire::{message, Reader, Writer};
use super::ProtocolError;

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// What an oldstyle server sends where a newstyle one sends `IHAVEOPT`.
pub const OLDSTYLE_MAGIC: u64 = 0x0000_4202_8186_1253;
pub const OPTION_REPLY_MAGIC: u64 = 0x3_e889_0455_65a9;

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

pub const BASE_ALLOCATION: &str = "base:allocation";
/// The id we give `base:allocation` when a client selects it.
pub const BASE_ALLOCATION_ID: u32 = 1;

pub const OPTION_REPLY_HEADER_LEN: usize = 20;

pub fn option_reply(option: u32, reply: u32, data: &[u8]) -> Vec<u8> {
    message(OPTION_REPLY_HEADER_LEN + data.len(), |w| {
        w.u64(OPTION_REPLY_MAGIC)
            .u32(option)
            .u32(reply)
            .u32(data.len() as u32)
            .bytes(data);
    })
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
    message(16 + data.len(), |w| {
        w.u64(IHAVEOPT)
            .u32(option)
            .u32(data.len() as u32)
            .bytes(data);
    })
}

/// The data of NBD_OPT_INFO / NBD_OPT_GO; the inverse of [`parse_info_request`].
pub fn encode_info_request(name: &str, infos: &[u16]) -> Vec<u8> {
    message(Writer::string_len(name) + 2 + 2 * infos.len(), |w| {
        w.string(name).u16(infos.len() as u16);
        for &info in infos {
            w.u16(info);
        }
    })
}

/// The data of NBD_OPT_LIST/SET_META_CONTEXT; the inverse of [`parse_meta_context_request`].
pub fn encode_meta_context_request(name: &str, queries: &[&str]) -> Vec<u8> {
    let len = queries.iter().map(|q| Writer::string_len(q)).sum::<usize>();
    message(Writer::string_len(name) + 4 + len, |w| {
        w.string(name).u32(queries.len() as u32);
        for query in queries {
            w.string(query);
        }
    })
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn option_replies_the_server_encodes_parse_back() {
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
    }
}
