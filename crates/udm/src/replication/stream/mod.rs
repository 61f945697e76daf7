//! The replication stream (docs/replication-stream.md, byte by byte): a header naming the
//! source volume and the snapshots, then records — data, zeroes, unmapped — each with its
//! sequence number and a crc32c, then a trailer with the record count and a checksum of the
//! stream's layout. The reader refuses anything cut, corrupt, reordered or out of bounds,
//! saying where. This file holds the format and the writer; [`reader`] the reader.

mod reader;

use std::io::{Read, Write};

use serde::{Deserialize, Serialize};
use thiserror::Error;

pub use reader::{Event, Reader};

pub const MAGIC: [u8; 8] = *b"udm-send";
/// Version 2 names what the snapshot sent and the base held when the stream was made (their
/// [`Stamp`]s); version 1 streams did not, and are refused (see [`StreamError::Version`]).
pub const VERSION: u32 = 2;
/// Data records carry at most this many bytes (so a reader needs no more memory than this).
pub const MAX_DATA: u32 = 1 << 20;
/// Zero and unmapped records cover at most this many bytes.
pub const MAX_EMPTY: u32 = 1 << 30;
/// `from_id` of a full stream.
pub const NO_BASE: u32 = u32::MAX;
const FIXED_HEADER: usize = 90;
const MAX_SOURCE: usize = 1024;
/// A record's (and the trailer's) frame before its payload.
pub const FRAME: usize = 28;

#[derive(Debug, Error)]
pub enum StreamError {
    #[error("reading the stream: {0}")]
    Io(#[from] std::io::Error),
    #[error("the stream is cut: it ends {0}")]
    Cut(String),
    #[error("not a udm replication stream (magic {0:02x?})")]
    NotAStream([u8; 8]),
    /// A version 1 stream does not say what its base held when it was sent, so an increment
    /// onto a base written since would pass; the sender still holds the snapshot, and a
    /// newer udm there sends it again.
    #[error(
        "stream version {0} is not supported (this udm reads version {VERSION}; send it again \
         with the same udm version on both hosts)"
    )]
    Version(u32),
    #[error("{0}")]
    Corrupt(String),
}

type Result<T, E = StreamError> = std::result::Result<T, E>;

/// What a thin device held, as far as its metadata tells: the newest time among its mappings
/// (None: it maps nothing) and how many blocks it maps. A snapshot whose blocks are all shared
/// (all mapped before it was last snapshotted) gets a newer mapping at any write, and fewer
/// mapped blocks at a discard: a snapshot written since changes its stamp.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stamp {
    pub newest_mapping: Option<u32>,
    pub mapped_blocks: u64,
}

impl std::fmt::Display for Stamp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.newest_mapping {
            Some(time) => write!(
                f,
                "{} blocks mapped, the newest at time {time}",
                self.mapped_blocks
            ),
            None => write!(f, "no block mapped"),
        }
    }
}

/// `newest_mapping` in the header of a device that maps nothing (mapping times have 24 bits).
const NO_MAPPING: u32 = u32::MAX;

/// What a stream holds: the source volume, the snapshots it goes from and to, and its size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// The source pool's data block size.
    pub block_bytes: u32,
    /// The snapshot sent: its id in the source pool and its creation time there (which,
    /// with the source, names it even if the id is reused later).
    pub to_id: u32,
    pub to_time: u32,
    /// What the snapshot sent held: the receiver records it, and an increment from this
    /// snapshot later must carry the same stamp as its base's.
    pub to_stamp: Stamp,
    /// The snapshot the receiver must already hold (`NO_BASE`: a full stream).
    pub from_id: u32,
    pub from_time: u32,
    /// What the base holds now (a full stream: the default).
    pub from_stamp: Stamp,
    pub volume_bytes: u64,
    /// Records in the whole stream (a resumed stream starts later, but counts them all).
    pub records: u64,
    /// Bytes the data and zero records cover, for progress.
    pub changed_bytes: u64,
    /// The source pool, "HOST/POOL".
    pub source: String,
}

impl Header {
    pub fn is_full(&self) -> bool {
        self.from_id == NO_BASE
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(FIXED_HEADER + self.source.len() + 4);
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        let len = (FIXED_HEADER + self.source.len() + 4) as u32;
        b.extend_from_slice(&len.to_le_bytes());
        for v in [
            self.block_bytes,
            self.to_id,
            self.to_time,
            self.from_id,
            self.from_time,
            0,
        ] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for v in [self.volume_bytes, self.records, self.changed_bytes] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for stamp in [self.to_stamp, self.from_stamp] {
            let newest = stamp.newest_mapping.unwrap_or(NO_MAPPING);
            b.extend_from_slice(&newest.to_le_bytes());
        }
        for stamp in [self.to_stamp, self.from_stamp] {
            b.extend_from_slice(&stamp.mapped_blocks.to_le_bytes());
        }
        b.extend_from_slice(&(self.source.len() as u16).to_le_bytes());
        b.extend_from_slice(self.source.as_bytes());
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    pub fn read(r: &mut (impl Read + ?Sized)) -> Result<Header> {
        // The magic and version first: another version's header may be shorter.
        let mut b = vec![0u8; 12];
        fill(r, &mut b, "inside the header")?;
        let magic: [u8; 8] = b[..8].try_into().unwrap();
        if magic != MAGIC {
            return Err(StreamError::NotAStream(magic));
        }
        let version = u32_at(&b, 8);
        if version != VERSION {
            return Err(StreamError::Version(version));
        }
        b.resize(FIXED_HEADER, 0);
        fill(r, &mut b[12..], "inside the header")?;
        let source_len = u16::from_le_bytes([b[88], b[89]]) as usize;
        if source_len > MAX_SOURCE || u32_at(&b, 12) as usize != FIXED_HEADER + source_len + 4 {
            return Err(corrupt("the header's length fields disagree"));
        }
        b.resize(FIXED_HEADER + source_len + 4, 0);
        fill(r, &mut b[FIXED_HEADER..], "inside the header")?;
        let body = FIXED_HEADER + source_len;
        if crc32c::crc32c(&b[..body]) != u32_at(&b, body) {
            return Err(corrupt("the header's checksum is wrong"));
        }
        let header = Header {
            block_bytes: u32_at(&b, 16),
            to_id: u32_at(&b, 20),
            to_time: u32_at(&b, 24),
            to_stamp: stamp_at(&b, 64, 72),
            from_id: u32_at(&b, 28),
            from_time: u32_at(&b, 32),
            from_stamp: stamp_at(&b, 68, 80),
            volume_bytes: u64_at(&b, 40),
            records: u64_at(&b, 48),
            changed_bytes: u64_at(&b, 56),
            source: String::from_utf8(b[FIXED_HEADER..body].to_vec())
                .map_err(|_| corrupt("the header's source name is not UTF-8"))?,
        };
        if header.block_bytes == 0 || !header.volume_bytes.is_multiple_of(512) {
            return Err(corrupt("the header's block or volume size is invalid"));
        }
        Ok(header)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The bytes follow.
    Data = 1,
    /// The range reads as zeroes.
    Zero = 2,
    /// The range is not mapped in the snapshot sent (it reads as zeroes).
    Unmapped = 3,
}

const END: u8 = b'E';

/// One record's place in the stream: what the trailer's layout checksum covers, so that a
/// sender resuming at record N can compute it without reading records 0..N again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    pub seq: u64,
    pub offset: u64,
    pub len: u32,
}

/// The running checksum of the records' places.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Layout(pub u32);

impl Layout {
    pub fn add(&mut self, p: Place) {
        let mut b = [0u8; 20];
        b[..8].copy_from_slice(&p.seq.to_le_bytes());
        b[8..16].copy_from_slice(&p.offset.to_le_bytes());
        b[16..].copy_from_slice(&p.len.to_le_bytes());
        self.0 = crc32c::crc32c_append(self.0, &b);
    }
}

fn frame(kind: u8, len: u32, seq: u64, offset: u64) -> [u8; FRAME] {
    let mut f = [0u8; FRAME];
    f[0] = kind;
    f[4..8].copy_from_slice(&len.to_le_bytes());
    f[8..16].copy_from_slice(&seq.to_le_bytes());
    f[16..24].copy_from_slice(&offset.to_le_bytes());
    f
}

/// Writes records after a header the caller has written.
pub struct Writer<W: Write> {
    out: W,
    layout: Layout,
}

impl<W: Write> Writer<W> {
    /// `layout`: the checksum of the records before the first one written (a resumed stream).
    pub fn new(out: W, layout: Layout) -> Self {
        Writer { out, layout }
    }

    /// A record at `place`: `payload` for data, nothing for the others.
    pub fn record(&mut self, kind: Kind, place: Place, payload: &[u8]) -> std::io::Result<()> {
        debug_assert_eq!(kind == Kind::Data, payload.len() == place.len as usize);
        let mut f = frame(kind as u8, place.len, place.seq, place.offset);
        let crc = crc32c::crc32c_append(crc32c::crc32c(&f[..24]), payload);
        f[24..].copy_from_slice(&crc.to_le_bytes());
        self.out.write_all(&f)?;
        self.out.write_all(payload)?;
        self.layout.add(place);
        Ok(())
    }

    /// The trailer, after the last of `records` records; then a flush.
    pub fn finish(mut self, records: u64) -> std::io::Result<W> {
        let mut f = frame(END, 0, records, self.layout.0 as u64);
        let crc = crc32c::crc32c(&f[..24]);
        f[24..].copy_from_slice(&crc.to_le_bytes());
        self.out.write_all(&f)?;
        self.out.flush()?;
        Ok(self.out)
    }
}

fn fill(r: &mut (impl Read + ?Sized), buf: &mut [u8], where_: &str) -> Result<()> {
    let mut at = 0;
    while at < buf.len() {
        match r.read(&mut buf[at..]) {
            Ok(0) => return Err(StreamError::Cut(where_.to_string())),
            Ok(n) => at += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

fn corrupt(what: impl Into<String>) -> StreamError {
    StreamError::Corrupt(what.into())
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

/// A stamp whose newest mapping time is at `newest`, its mapped blocks at `mapped`.
fn stamp_at(b: &[u8], newest: usize, mapped: usize) -> Stamp {
    Stamp {
        newest_mapping: Some(u32_at(b, newest)).filter(|&t| t != NO_MAPPING),
        mapped_blocks: u64_at(b, mapped),
    }
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

#[cfg(test)]
mod tests;
