//! The write log of the `log-writes` target: every write, discard, zeroing, FLUSH, FUA and
//! mark, in order, with its data, so a test can replay a device to any point.
//!
//! Layout (4 KiB blocks; `docs/log-writes.md` has every byte): block 0 is the superblock; each
//! entry is a header block followed by its data, padded to whole blocks. Entries carry the
//! log's random id and a sequence number, so a reader stops exactly at the end of this log,
//! even over the leftovers of an older one.

use std::sync::Arc;

use udm_block::{AlignedBuf, BlockDevice, WriteFlags};

use crate::block::{read_u64, seal, verify, write_u64, BlockType, MetadataError, BLOCK_SIZE};
use crate::random::random_bytes;

const MAGIC: &[u8; 8] = b"udmlogwr";
const VERSION: u32 = 1;
pub const MAX_MARK: usize = 256;
/// A superblock and one entry header.
pub const MIN_LOG_SIZE: u64 = 2 * BLOCK_SIZE as u64;
/// Superblock flag: the log device filled up, and what happened after the last entry was not
/// logged.
const FLAG_CUT_OFF: u32 = 1;
/// Where a restart entry's header keeps the id of the entries after it.
const NEXT_ID_AT: usize = 72 + MAX_MARK;
/// The text a restart entry shows where a mark shows its own.
const RESTART_TEXT: &str = "udm restarted: writes not flushed before this may be missing";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum EntryKind {
    Write = 1,
    Discard = 2,
    WriteZeroes = 3,
    Flush = 4,
    Mark = 5,
    /// The daemon came back after a stop or a crash and goes on with this log: what was not
    /// flushed before it may be missing. The entries after it carry a new log id.
    Restart = 6,
}

impl EntryKind {
    fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            1 => EntryKind::Write,
            2 => EntryKind::Discard,
            3 => EntryKind::WriteZeroes,
            4 => EntryKind::Flush,
            5 => EntryKind::Mark,
            6 => EntryKind::Restart,
            _ => return None,
        })
    }
}

/// One logged operation. Offsets and lengths are bytes on the logged device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogEntry {
    pub seq: u64,
    pub kind: EntryKind,
    pub fua: bool,
    pub offset: u64,
    pub len: u64,
    pub mark: String,
}

/// An operation to log, as [`LogWriter::append`] takes it: each kind with what it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op<'a> {
    Write {
        offset: u64,
        data: &'a [u8],
        fua: bool,
    },
    Discard {
        offset: u64,
        len: u64,
    },
    WriteZeroes {
        offset: u64,
        len: u64,
        fua: bool,
    },
    Flush,
    Mark(&'a str),
    /// Written by [`LogWriter::resume`]: the entries after it carry `next_id`.
    Restart {
        next_id: u64,
    },
}

impl Op<'_> {
    fn kind(&self) -> EntryKind {
        match self {
            Op::Write { .. } => EntryKind::Write,
            Op::Discard { .. } => EntryKind::Discard,
            Op::WriteZeroes { .. } => EntryKind::WriteZeroes,
            Op::Flush => EntryKind::Flush,
            Op::Mark(_) => EntryKind::Mark,
            Op::Restart { .. } => EntryKind::Restart,
        }
    }

    fn fua(&self) -> bool {
        matches!(
            self,
            Op::Write { fua: true, .. } | Op::WriteZeroes { fua: true, .. }
        )
    }

    /// (offset, length) on the logged device.
    fn range(&self) -> (u64, u64) {
        match *self {
            Op::Write { offset, data, .. } => (offset, data.len() as u64),
            Op::Discard { offset, len } | Op::WriteZeroes { offset, len, .. } => (offset, len),
            Op::Flush | Op::Mark(_) | Op::Restart { .. } => (0, 0),
        }
    }

    fn data(&self) -> Option<&[u8]> {
        match self {
            Op::Write { data, .. } => Some(data),
            _ => None,
        }
    }

    fn mark(&self) -> &str {
        match self {
            Op::Mark(text) => text,
            Op::Restart { .. } => RESTART_TEXT,
            _ => "",
        }
    }
}

/// What became of an appended entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Appended {
    Logged,
    /// The log device is full: neither this entry nor any later one is logged.
    CutOff,
}

/// Appends entries; one writer per log, callers serialise.
pub struct LogWriter {
    dev: Arc<dyn BlockDevice>,
    /// The superblock's id: the first entries'.
    log_id: u64,
    /// The id the next entry carries (a new one after each restart entry).
    id: u64,
    next_block: u64,
    next_seq: u64,
    cut_off: bool,
}

fn blocks_for(len: u64) -> u64 {
    len.div_ceil(BLOCK_SIZE as u64)
}

impl LogWriter {
    /// Starts a new, empty log on `dev` (whatever it held before is ignored from now on).
    pub fn create(dev: Arc<dyn BlockDevice>) -> Result<Self, MetadataError> {
        if dev.size() < MIN_LOG_SIZE {
            return Err(MetadataError::Mismatch(
                "log device smaller than 8 KiB".into(),
            ));
        }
        let id = random_id();
        let mut writer = LogWriter {
            dev,
            log_id: id,
            id,
            next_block: 1,
            next_seq: 0,
            cut_off: false,
        };
        writer.write_superblock()?;
        writer.dev.flush()?;
        Ok(writer)
    }

    /// Goes on with the log already on `dev` after the daemon restarted (a restart is not a
    /// new table, so it must not throw the record away): appends a restart entry after the
    /// last whole entry, and the entries after it carry a new id, so that an older entry past
    /// the end (written before the crash, never flushed) can never be read as following them.
    /// A log cut off before stays cut off; a damaged one is refused.
    pub fn resume(dev: Arc<dyn BlockDevice>) -> Result<Self, MetadataError> {
        let mut reader = LogReader::open(dev.clone())?;
        reader.read_to_end()?;
        let mut writer = LogWriter {
            dev,
            log_id: reader.log_id,
            id: reader.id,
            next_block: reader.next_block,
            next_seq: reader.next_seq,
            cut_off: reader.cut_off,
        };
        let next_id = random_id();
        if writer.append(Op::Restart { next_id })? == Appended::Logged {
            writer.id = next_id;
        }
        Ok(writer)
    }

    pub fn entries(&self) -> u64 {
        self.next_seq
    }

    /// Blocks of the log device in use, the superblock included.
    pub fn blocks_used(&self) -> u64 {
        self.next_block
    }

    /// Whether the log device filled up, so that logging has stopped.
    pub fn is_cut_off(&self) -> bool {
        self.cut_off
    }

    fn write_superblock(&mut self) -> Result<(), MetadataError> {
        let mut block = AlignedBuf::zeroed(BLOCK_SIZE);
        block[16..24].copy_from_slice(MAGIC);
        block[24..28].copy_from_slice(&VERSION.to_le_bytes());
        let flags = if self.cut_off { FLAG_CUT_OFF } else { 0 };
        block[28..32].copy_from_slice(&flags.to_le_bytes());
        write_u64(&mut block, 32, self.log_id);
        write_u64(&mut block, 40, self.next_seq);
        write_u64(&mut block, 48, self.dev.size());
        seal(BlockType::LogSuperblock, 0, &mut block);
        self.dev.write(0, &block, WriteFlags::default())?;
        Ok(())
    }

    /// Appends an entry (with the data of a write). FLUSH entries and marks also update the
    /// superblock's entry count and flush the log device, so the log survives a crash up to
    /// there. The first entry that does not fit cuts the log off for good (even if a smaller
    /// one would still fit, a log with a gap would replay to a state that never was): the
    /// superblock records it and the log device is flushed, so a reader knows.
    pub fn append(&mut self, op: Op) -> Result<Appended, MetadataError> {
        let (kind, fua, data, mark) = (op.kind(), op.fua(), op.data(), op.mark());
        let (offset, len) = op.range();
        if self.cut_off {
            return Ok(Appended::CutOff);
        }
        let data_len = data.map_or(0, |d| d.len() as u64);
        let needed = 1 + blocks_for(data_len);
        if (self.next_block + needed) * BLOCK_SIZE as u64 > self.dev.size() {
            self.cut_off = true;
            self.flush_then_record()?;
            self.dev.flush()?;
            return Ok(Appended::CutOff);
        }
        let mut buf = AlignedBuf::zeroed((needed as usize) * BLOCK_SIZE);
        let mark = &mark.as_bytes()[..mark.len().min(MAX_MARK)];
        write_u64(&mut buf, 16, self.id);
        write_u64(&mut buf, 24, self.next_seq);
        buf[32..36].copy_from_slice(&(kind as u32).to_le_bytes());
        buf[36..40].copy_from_slice(&u32::from(fua).to_le_bytes());
        write_u64(&mut buf, 40, offset);
        write_u64(&mut buf, 48, len);
        write_u64(&mut buf, 56, data_len);
        let data_crc = data.map_or(0, crc32c::crc32c);
        buf[64..68].copy_from_slice(&data_crc.to_le_bytes());
        buf[68..72].copy_from_slice(&(mark.len() as u32).to_le_bytes());
        buf[72..72 + mark.len()].copy_from_slice(mark);
        if let Op::Restart { next_id } = op {
            write_u64(&mut buf, NEXT_ID_AT, next_id);
        }
        seal(BlockType::LogEntry, self.next_block, &mut buf[..BLOCK_SIZE]);
        if let Some(data) = data {
            buf[BLOCK_SIZE..BLOCK_SIZE + data.len()].copy_from_slice(data);
        }
        self.dev.write(
            self.next_block * BLOCK_SIZE as u64,
            &buf,
            WriteFlags::default(),
        )?;
        self.next_block += needed;
        self.next_seq += 1;
        if matches!(
            kind,
            EntryKind::Flush | EntryKind::Mark | EntryKind::Restart
        ) || fua
        {
            self.flush_then_record()?;
        }
        Ok(Appended::Logged)
    }

    /// Makes every entry so far durable, then records their number in the superblock. In that
    /// order, a superblock that reached the disk never counts an entry that did not, so a
    /// reader takes a bad block among the counted entries for damage; the count itself
    /// becomes durable with the next flush (a count one flush point behind is still true).
    fn flush_then_record(&mut self) -> Result<(), MetadataError> {
        self.dev.flush()?;
        self.write_superblock()
    }
}

fn random_id() -> u64 {
    u64::from_le_bytes(random_bytes())
}

/// Reads a log back, entry by entry, with the data of writes.
pub struct LogReader {
    dev: Arc<dyn BlockDevice>,
    /// The superblock's id, and the id the next entry must carry.
    log_id: u64,
    id: u64,
    next_block: u64,
    next_seq: u64,
    /// Entries the superblock records as flushed: the log cannot end before them, so a block
    /// among them that is not the next entry is damage, not the end.
    flushed_entries: u64,
    cut_off: bool,
}

impl LogReader {
    pub fn open(dev: Arc<dyn BlockDevice>) -> Result<Self, MetadataError> {
        let mut block = AlignedBuf::zeroed(BLOCK_SIZE);
        dev.read(0, &mut block)?;
        verify(BlockType::LogSuperblock, 0, &block)?;
        if &block[16..24] != MAGIC {
            return Err(MetadataError::Corrupt {
                block: 0,
                what: "not a udm write log".into(),
            });
        }
        let version = u32::from_le_bytes(block[24..28].try_into().unwrap());
        if version != VERSION {
            return Err(MetadataError::Corrupt {
                block: 0,
                what: format!("log format version {version}"),
            });
        }
        let flags = u32::from_le_bytes(block[28..32].try_into().unwrap());
        Ok(LogReader {
            log_id: read_u64(&block, 32),
            id: read_u64(&block, 32),
            dev,
            next_block: 1,
            next_seq: 0,
            flushed_entries: read_u64(&block, 40),
            cut_off: flags & FLAG_CUT_OFF != 0,
        })
    }

    /// Whether the writer ran out of space: the device was written to after the log's last
    /// entry, and those operations were not logged.
    pub fn is_cut_off(&self) -> bool {
        self.cut_off
    }

    /// Reads every entry left, checking each: an error if the log is damaged.
    pub fn read_to_end(&mut self) -> Result<(), MetadataError> {
        while self.next_entry()?.is_some() {}
        Ok(())
    }

    /// The next entry and its data, or `None` at the end of the log: the first block that is
    /// not the next entry of this log, or an entry whose data did not all reach the log — after
    /// the last flushed entry, where a power cut may have torn a write. Before it, either is
    /// damage and an error.
    pub fn next_entry(&mut self) -> Result<Option<(LogEntry, AlignedBuf)>, MetadataError> {
        match self.read_entry()? {
            Ok(entry) => {
                self.next_seq += 1;
                Ok(Some(entry))
            }
            Err(why) if self.next_seq < self.flushed_entries => Err(MetadataError::Corrupt {
                block: self.next_block,
                what: format!(
                    "entry {} {why}, but the superblock records {} entries as flushed: \
                     the log is damaged",
                    self.next_seq, self.flushed_entries
                ),
            }),
            Err(_) => Ok(None),
        }
    }

    /// Reads the entry at `next_block`: `Ok(Err(why))` when what is there is not a whole entry
    /// of this log.
    fn read_entry(&mut self) -> Result<Result<(LogEntry, AlignedBuf), String>, MetadataError> {
        if (self.next_block + 1) * BLOCK_SIZE as u64 > self.dev.size() {
            return Ok(Err("would start past the end of the log device".into()));
        }
        let mut header = AlignedBuf::zeroed(BLOCK_SIZE);
        self.dev
            .read(self.next_block * BLOCK_SIZE as u64, &mut header)?;
        if let Err(e) = verify(BlockType::LogEntry, self.next_block, &header) {
            return Ok(Err(format!("has a bad header ({e})")));
        }
        if read_u64(&header, 16) != self.id {
            return Ok(Err("belongs to another log".into()));
        }
        let seq = read_u64(&header, 24);
        if seq != self.next_seq {
            return Ok(Err(format!("has sequence number {seq}")));
        }
        let kind = EntryKind::from_u32(u32::from_le_bytes(header[32..36].try_into().unwrap()))
            .ok_or_else(|| MetadataError::Corrupt {
                block: self.next_block,
                what: "unknown entry kind".into(),
            })?;
        let data_len = read_u64(&header, 56);
        let mark_len =
            (u32::from_le_bytes(header[68..72].try_into().unwrap()) as usize).min(MAX_MARK);
        let entry = LogEntry {
            seq: self.next_seq,
            kind,
            fua: u32::from_le_bytes(header[36..40].try_into().unwrap()) & 1 != 0,
            offset: read_u64(&header, 40),
            len: read_u64(&header, 48),
            mark: String::from_utf8_lossy(&header[72..72 + mark_len]).into_owned(),
        };
        let data_blocks = blocks_for(data_len);
        if (self.next_block + 1 + data_blocks) * BLOCK_SIZE as u64 > self.dev.size() {
            return Ok(Err("has data running past the end of the log device".into()));
        }
        let mut data = AlignedBuf::zeroed((data_blocks as usize) * BLOCK_SIZE);
        if data_blocks > 0 {
            self.dev
                .read((self.next_block + 1) * BLOCK_SIZE as u64, &mut data)?;
        }
        data.resize(data_len as usize);
        let stored_crc = u32::from_le_bytes(header[64..68].try_into().unwrap());
        if data_len > 0 && crc32c::crc32c(&data) != stored_crc {
            return Ok(Err("has data that fails its checksum".into()));
        }
        self.next_block += 1 + data_blocks;
        if kind == EntryKind::Restart {
            self.id = read_u64(&header, NEXT_ID_AT);
        }
        Ok(Ok((entry, data)))
    }
}

#[cfg(test)]
mod tests;
