//! The replication stream (docs/replication-stream.md, byte by byte): a header naming the
//! source volume and the snapshots, then records — data, zeroes, unmapped — each with its
//! sequence number and a crc32c, then a trailer with the record count and a checksum of the
//! stream's layout. The reader refuses anything cut, corrupt, reordered or out of bounds,
//! saying where.

use std::io::{Read, Write};

use thiserror::Error;
use udm_block::AlignedBuf;

pub const MAGIC: [u8; 8] = *b"udm-send";
pub const VERSION: u32 = 1;
/// Data records carry at most this many bytes (so a reader needs no more memory than this).
pub const MAX_DATA: u32 = 1 << 20;
/// Zero and unmapped records cover at most this many bytes.
pub const MAX_EMPTY: u32 = 1 << 30;
/// `from_id` of a full stream.
pub const NO_BASE: u32 = u32::MAX;
const FIXED_HEADER: usize = 66;
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
    #[error("stream version {0} is not supported (this udm reads version {VERSION})")]
    Version(u32),
    #[error("{0}")]
    Corrupt(String),
}

type Result<T, E = StreamError> = std::result::Result<T, E>;

/// What a stream holds: the source volume, the snapshots it goes from and to, and its size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// The source pool's data block size.
    pub block_bytes: u32,
    /// The snapshot sent: its id in the source pool and its creation time there (which,
    /// with the source, names it even if the id is reused later).
    pub to_id: u32,
    pub to_time: u32,
    /// The snapshot the receiver must already hold (`NO_BASE`: a full stream).
    pub from_id: u32,
    pub from_time: u32,
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
        b.extend_from_slice(&(self.source.len() as u16).to_le_bytes());
        b.extend_from_slice(self.source.as_bytes());
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    pub fn read(r: &mut (impl Read + ?Sized)) -> Result<Header> {
        let mut b = vec![0u8; FIXED_HEADER];
        fill(r, &mut b, "inside the header")?;
        let magic: [u8; 8] = b[..8].try_into().unwrap();
        if magic != MAGIC {
            return Err(StreamError::NotAStream(magic));
        }
        let version = u32_at(&b, 8);
        if version != VERSION {
            return Err(StreamError::Version(version));
        }
        let source_len = u16::from_le_bytes([b[64], b[65]]) as usize;
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
            from_id: u32_at(&b, 28),
            from_time: u32_at(&b, 32),
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

/// A record read and checked.
#[derive(Debug, PartialEq, Eq)]
pub enum Event<'a> {
    Record {
        kind: Kind,
        place: Place,
        payload: &'a [u8],
    },
    /// The trailer, checked against the records read (with the layout given at the start).
    End,
}

/// Reads and checks the records after a header.
pub struct Reader<R: Read> {
    input: R,
    header: Header,
    /// The sequence number the next record must have (None: the first may be any up to
    /// `first_at_most`).
    next: Option<u64>,
    first_at_most: u64,
    layout: Layout,
    /// Aligned, so that data reaches O_DIRECT files without a copy.
    buf: AlignedBuf,
}

impl<R: Read> Reader<R> {
    /// `first_at_most` and `layout`: a resumed stream may start at any record up to the one
    /// the receiver has (it skips what it has); `layout` covers the records before that.
    pub fn new(input: R, header: Header, first_at_most: u64, layout: Layout) -> Self {
        Reader {
            input,
            header,
            next: None,
            first_at_most,
            layout,
            buf: AlignedBuf::new(),
        }
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The checksum of the places of every record up to the one expected next.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The next record, checked: its checksum, its place in the order, its range.
    pub fn next_event(&mut self) -> Result<Event<'_>> {
        let frame = self.read_frame()?;
        self.check_order(&frame)?;
        if frame.kind == END {
            self.check_trailer(&frame)?;
            return Ok(Event::End);
        }
        let seq = frame.seq;
        let kind = match frame.kind {
            1 => Kind::Data,
            2 => Kind::Zero,
            3 => Kind::Unmapped,
            other => return Err(corrupt(format!("record {seq}: unknown kind {other}"))),
        };
        let place = self.check_range(&frame)?;
        // The layout covers the records the receiver does not have yet; a record it has
        // (a resumed stream starting early) was counted when it first came.
        if seq >= self.first_at_most {
            self.layout.add(place);
        }
        self.next = Some(seq + 1);
        Ok(Event::Record {
            kind,
            place,
            payload: &self.buf[..frame.data_len],
        })
    }

    /// Reads a record's frame and its data (into `buf`), and checks its checksum.
    fn read_frame(&mut self) -> Result<Frame> {
        let where_ = match self.next {
            Some(n) => format!("before record {n} of {}", self.header.records),
            None => "before its first record".to_string(),
        };
        let mut f = [0u8; FRAME];
        fill(&mut self.input, &mut f, &where_)?;
        let (kind, len, seq, offset) = (f[0], u32_at(&f, 4), u64_at(&f, 8), u64_at(&f, 16));
        let data_len = if kind == Kind::Data as u8 {
            if len > MAX_DATA {
                return Err(corrupt(format!(
                    "record {seq}: {len} bytes of data (at most {MAX_DATA})"
                )));
            }
            len as usize
        } else {
            0
        };
        if self.buf.len() < data_len {
            self.buf.resize(data_len);
        }
        let payload = &mut self.buf[..data_len];
        fill(&mut self.input, payload, &format!("inside record {seq}"))?;
        let crc = crc32c::crc32c_append(crc32c::crc32c(&f[..24]), payload);
        if crc != u32_at(&f, 24) {
            return Err(corrupt(match self.next {
                Some(n) => format!("record {n}: its checksum is wrong (corrupt)"),
                None => "the first record's checksum is wrong (corrupt)".to_string(),
            }));
        }
        Ok(Frame {
            kind,
            len,
            seq,
            offset,
            data_len,
        })
    }

    /// The record is the one expected next (the first one of a resumed stream may come
    /// early, up to `first_at_most`).
    fn check_order(&self, frame: &Frame) -> Result<()> {
        let seq = frame.seq;
        let expected = self.next.unwrap_or(seq.min(self.first_at_most));
        if seq != expected && frame.kind == END {
            return Err(corrupt(format!(
                "the trailer where record {expected} belongs: the header promises {} records",
                self.header.records
            )));
        }
        if seq != expected {
            return Err(corrupt(match self.next {
                Some(_) => format!(
                    "record {seq} where record {expected} belongs (reordered or missing records)"
                ),
                None => format!(
                    "the stream starts at record {seq}, but the receiver has only records \
                     before {} (resume from at most there)",
                    self.first_at_most
                ),
            }));
        }
        Ok(())
    }

    /// The trailer comes after as many records as the header promised, and its checksum of
    /// their places matches them.
    fn check_trailer(&self, frame: &Frame) -> Result<()> {
        if frame.seq != self.header.records {
            return Err(corrupt(format!(
                "the trailer after record {} but the header promises {} records",
                frame.seq, self.header.records
            )));
        }
        if frame.offset != self.layout.0 as u64 {
            return Err(corrupt(
                "the trailer's checksum of the records does not match them",
            ));
        }
        Ok(())
    }

    /// The record covers whole sectors inside the volume, and is one the header counted.
    fn check_range(&self, frame: &Frame) -> Result<Place> {
        let Frame {
            seq, offset, len, ..
        } = *frame;
        let end = offset.checked_add(len as u64);
        if len == 0
            || len > MAX_EMPTY
            || !offset.is_multiple_of(512)
            || !len.is_multiple_of(512)
            || end.is_none_or(|end| end > self.header.volume_bytes)
            || seq >= self.header.records
        {
            return Err(corrupt(format!(
                "record {seq}: {len} bytes at {offset} is not a valid range of the {}-byte \
                 volume",
                self.header.volume_bytes
            )));
        }
        Ok(Place { seq, offset, len })
    }
}

/// A record's frame as read, its data in the reader's buffer.
#[derive(Clone, Copy)]
struct Frame {
    kind: u8,
    len: u32,
    seq: u64,
    offset: u64,
    data_len: usize,
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

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(records: u64) -> Header {
        Header {
            block_bytes: 65536,
            to_id: 5,
            to_time: 9,
            from_id: 3,
            from_time: 4,
            volume_bytes: 1 << 20,
            records,
            changed_bytes: 8192,
            source: "host/pool".into(),
        }
    }

    /// A stream of data, zero and unmapped records, from record `first` on; its bytes and
    /// the byte offsets where its records start.
    fn stream(first: u64) -> (Vec<u8>, Vec<usize>) {
        let places = [
            (Kind::Data, 0u64, 4096u32),
            (Kind::Zero, 8192, 4096),
            (Kind::Unmapped, 65536, 131072),
            (Kind::Data, 1040384, 8192),
        ];
        let mut out = header(places.len() as u64).encode();
        let mut layout = Layout::default();
        for (seq, &(_, offset, len)) in places.iter().enumerate().take(first as usize) {
            layout.add(Place {
                seq: seq as u64,
                offset,
                len,
            });
        }
        let mut starts = Vec::new();
        let mut w = Writer::new(Vec::new(), layout);
        for (seq, &(kind, offset, len)) in places.iter().enumerate().skip(first as usize) {
            starts.push(out.len() + w.out.len());
            let payload = vec![seq as u8 + 1; if kind == Kind::Data { len as usize } else { 0 }];
            w.record(
                kind,
                Place {
                    seq: seq as u64,
                    offset,
                    len,
                },
                &payload,
            )
            .unwrap();
        }
        starts.push(out.len() + w.out.len());
        out.extend(w.finish(places.len() as u64).unwrap());
        (out, starts)
    }

    /// Reads a whole stream as a receiver holding records before `have` (with their layout);
    /// the records applied.
    fn read(bytes: &[u8], have: u64, layout: Layout) -> Result<Vec<(Kind, u64, u32, u8)>> {
        let mut input = bytes;
        let h = Header::read(&mut input)?;
        let mut r = Reader::new(input, h, have, layout);
        let mut got = Vec::new();
        loop {
            match r.next_event()? {
                Event::Record {
                    kind,
                    place,
                    payload,
                } => got.push((
                    kind,
                    place.offset,
                    place.len,
                    payload.first().copied().unwrap_or(0),
                )),
                Event::End => return Ok(got),
            }
        }
    }

    #[test]
    fn a_stream_reads_back_as_written() {
        let (bytes, _) = stream(0);
        let got = read(&bytes, 0, Layout::default()).unwrap();
        assert_eq!(
            got,
            [
                (Kind::Data, 0, 4096, 1),
                (Kind::Zero, 8192, 4096, 0),
                (Kind::Unmapped, 65536, 131072, 0),
                (Kind::Data, 1040384, 8192, 4)
            ]
        );
        let mut input = &bytes[..];
        assert_eq!(Header::read(&mut input).unwrap(), header(4));
    }

    #[test]
    fn every_flipped_byte_and_every_cut_is_refused() {
        let (bytes, _) = stream(0);
        for at in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[at] ^= 0x10;
            assert!(
                read(&bad, 0, Layout::default()).is_err(),
                "byte {at} flipped"
            );
        }
        for len in 0..bytes.len() {
            let err = read(&bytes[..len], 0, Layout::default()).unwrap_err();
            assert!(matches!(err, StreamError::Cut(_)), "cut at {len}: {err}");
        }
    }

    #[test]
    fn reordered_dropped_and_appended_records_are_refused() {
        let (bytes, s) = stream(0);
        let swapped = [
            &bytes[..s[1]],
            &bytes[s[2]..s[3]],
            &bytes[s[1]..s[2]],
            &bytes[s[3]..],
        ]
        .concat();
        let err = read(&swapped, 0, Layout::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("record 2 where record 1 belongs"), "{err}");
        let dropped = [&bytes[..s[2]], &bytes[s[3]..]].concat();
        let err = read(&dropped, 0, Layout::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("record 3 where record 2 belongs"), "{err}");
        // The last record dropped: the trailer comes early.
        let short = [&bytes[..s[3]], &bytes[s[4]..]].concat();
        let err = read(&short, 0, Layout::default()).unwrap_err().to_string();
        assert!(err.contains("promises 4 records"), "{err}");
    }

    #[test]
    fn a_resumed_stream_continues_where_the_receiver_stopped() {
        let (full, _) = stream(0);
        // The receiver committed records 0 and 1 of the full stream.
        let mut layout = Layout::default();
        layout.add(Place {
            seq: 0,
            offset: 0,
            len: 4096,
        });
        layout.add(Place {
            seq: 1,
            offset: 8192,
            len: 4096,
        });
        let (resumed, _) = stream(2);
        let got = read(&resumed, 2, layout).unwrap();
        assert_eq!(got.len(), 2);
        // The whole stream again: records it has are read (and skipped by the receiver).
        assert_eq!(read(&full, 2, layout).unwrap().len(), 4);
        // A stream that starts past what the receiver has, or a wrong layout, is refused.
        let (later, _) = stream(3);
        let err = read(&later, 2, layout).unwrap_err().to_string();
        assert!(err.contains("starts at record 3"), "{err}");
        let err = read(&resumed, 2, Layout::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("checksum of the records"), "{err}");
    }

    #[test]
    fn hostile_headers_are_refused_before_anything_is_allocated() {
        let mut b = header(1).encode();
        b[64] = 0xff;
        b[65] = 0xff;
        assert!(Header::read(&mut &b[..]).is_err());
        let err = Header::read(
            &mut &b"not a stream at all, really no no no no no no no no no no no no no"[..],
        )
        .unwrap_err();
        assert!(matches!(err, StreamError::NotAStream(_)), "{err}");
    }
}
