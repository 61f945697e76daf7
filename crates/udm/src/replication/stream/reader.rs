//! Reading a stream's records after its header, each checked: checksum, order, range, and
//! the trailer against the records read.

use std::io::Read;

use udm_block::AlignedBuf;

use super::*;

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
            self.check_ended()?;
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

    /// Nothing follows the trailer: a stream with another one appended (or garbage) would
    /// otherwise pass for the first one alone.
    fn check_ended(&mut self) -> Result<()> {
        let mut byte = [0u8; 1];
        loop {
            return match self.input.read(&mut byte) {
                Ok(0) => Ok(()),
                Ok(_) => Err(corrupt(
                    "bytes follow the stream after its trailer (another stream appended, or \
                     garbage): send one stream per receive",
                )),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => Err(e.into()),
            };
        }
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
