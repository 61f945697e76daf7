//! Transmission: requests, simple replies and structured reply chunks.

use super::wire::{Reader, Writer};
use super::ProtocolError;

pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

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

pub const REQUEST_HEADER_LEN: usize = 28;
pub const SIMPLE_REPLY_LEN: usize = 16;
pub const CHUNK_HEADER_LEN: usize = 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub command: u16,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

pub fn parse_request(header: &[u8; REQUEST_HEADER_LEN]) -> Result<Request, ProtocolError> {
    let mut r = Reader::new(header, "request header");
    let magic = r.u32()?;
    if magic != REQUEST_MAGIC {
        return Err(ProtocolError::BadMagic(magic.into()));
    }
    Ok(Request {
        flags: r.u16()?,
        command: r.u16()?,
        cookie: r.u64()?,
        offset: r.u64()?,
        length: r.u32()?,
    })
}

pub fn encode_request(r: &Request) -> [u8; REQUEST_HEADER_LEN] {
    let mut out = [0u8; REQUEST_HEADER_LEN];
    Writer::new(&mut out)
        .u32(REQUEST_MAGIC)
        .u16(r.flags)
        .u16(r.command)
        .u64(r.cookie)
        .u64(r.offset)
        .u32(r.length);
    out
}

pub fn simple_reply(cookie: u64, error: u32) -> [u8; SIMPLE_REPLY_LEN] {
    let mut out = [0u8; SIMPLE_REPLY_LEN];
    Writer::new(&mut out)
        .u32(SIMPLE_REPLY_MAGIC)
        .u32(error)
        .u64(cookie);
    out
}

pub fn chunk_header(flags: u16, kind: u16, cookie: u64, length: u32) -> [u8; CHUNK_HEADER_LEN] {
    let mut out = [0u8; CHUNK_HEADER_LEN];
    Writer::new(&mut out)
        .u32(STRUCTURED_REPLY_MAGIC)
        .u16(flags)
        .u16(kind)
        .u64(cookie)
        .u32(length);
    out
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
    use crate::protocol::{NBD_EIO, NBD_ENOSPC};

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
    fn replies_the_server_encodes_parse_back() {
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
