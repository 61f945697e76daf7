//! The kernel's persistent exception store, byte by byte (`docs/snapshot-metadata.md`).
//!
//! The COW device is cut into chunks. Chunk 0 is the header; chunk 1 is metadata area 0,
//! followed by the `E` data chunks it describes; then area 1 and its `E` data chunks, and so
//! on. An area is an array of `E = chunk bytes / 16` records `(old_chunk, new_chunk)`, both
//! little-endian u64; the first record whose `new_chunk` is 0 ends the table. There is no
//! checksum anywhere: this is the format the kernel reads, so it is the format udm writes.

use udm_block::{AlignedBuf, BlockDevice, SECTOR_SIZE};

use super::StoreError;

/// `"SnAp"` read as a little-endian u32.
pub const MAGIC: u32 = 0x7041_6E53;
/// The only version the kernel (and udm) reads.
pub const VERSION: u32 = 1;
pub const RECORD_SIZE: usize = 16;
/// Smallest chunk udm accepts: one 4 KiB page, so every chunk can be read and written with
/// O_DIRECT. (The kernel goes down to the COW's logical block size.)
pub const MIN_CHUNK_SECTORS: u64 = 8;
/// Largest chunk udm accepts: 1 MiB. An area is one chunk and is rewritten at every commit,
/// so larger chunks only make commits slower (LVM stops at 512 KiB).
pub const MAX_CHUNK_SECTORS: u64 = 2048;
/// The kernel's default chunk size (16 KiB), used when the table says 0 for a new store.
pub const DEFAULT_CHUNK_SECTORS: u64 = 32;

/// One exception: origin chunk `old` is saved in COW chunk `new`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Record {
    pub old: u64,
    pub new: u64,
}

/// The header in the first 16 bytes of chunk 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub valid: bool,
    pub chunk_sectors: u64,
}

/// Checks a chunk size given in a table or read from a header.
pub fn check_chunk_sectors(sectors: u64) -> Result<(), String> {
    if !sectors.is_power_of_two() || !(MIN_CHUNK_SECTORS..=MAX_CHUNK_SECTORS).contains(&sectors) {
        return Err(format!(
            "chunk size {sectors} is not a power of two from {MIN_CHUNK_SECTORS} to \
             {MAX_CHUNK_SECTORS} sectors"
        ));
    }
    Ok(())
}

/// Where things are on a COW device of a given chunk size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub chunk_sectors: u64,
    /// Whole chunks on the COW device (a partial chunk at its end is never used).
    pub chunks: u64,
}

impl Geometry {
    pub fn new(chunk_sectors: u64, device_bytes: u64) -> Self {
        Geometry {
            chunk_sectors,
            chunks: device_bytes / (chunk_sectors * SECTOR_SIZE),
        }
    }

    pub fn chunk_bytes(&self) -> u64 {
        self.chunk_sectors * SECTOR_SIZE
    }

    /// Records per metadata area (`E`).
    pub fn per_area(&self) -> u64 {
        self.chunk_bytes() / RECORD_SIZE as u64
    }

    /// The chunk holding metadata area `area`.
    pub fn area_chunk(&self, area: u64) -> u64 {
        1 + area * (self.per_area() + 1)
    }

    /// True for chunks that hold the header or a metadata area, never data.
    pub fn is_metadata(&self, chunk: u64) -> bool {
        chunk == 0 || chunk % (self.per_area() + 1) == 1
    }

    pub fn offset(&self, chunk: u64) -> u64 {
        chunk * self.chunk_bytes()
    }
}

pub fn encode_header(header: Header) -> [u8; 16] {
    let mut bytes = [0u8; 16];
    bytes[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    bytes[4..8].copy_from_slice(&(header.valid as u32).to_le_bytes());
    bytes[8..12].copy_from_slice(&VERSION.to_le_bytes());
    bytes[12..16].copy_from_slice(&(header.chunk_sectors as u32).to_le_bytes());
    bytes
}

fn le32(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())
}

fn le64(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
}

/// Decodes the first sector of a COW device: `None` for a blank (never formatted) device.
pub fn decode_header(sector: &[u8]) -> Result<Option<Header>, StoreError> {
    let magic = le32(sector, 0);
    if magic == 0 {
        return Ok(None);
    }
    if magic != MAGIC {
        return Err(StoreError::Corrupt(format!(
            "not a snapshot COW device: magic {magic:#010x}, expected {MAGIC:#010x} (\"SnAp\")"
        )));
    }
    let version = le32(sector, 8);
    if version != VERSION {
        return Err(StoreError::Corrupt(format!(
            "COW format version {version}; only version {VERSION} exists"
        )));
    }
    let chunk_sectors = le32(sector, 12) as u64;
    check_chunk_sectors(chunk_sectors)
        .map_err(|e| StoreError::Corrupt(format!("the COW header's {e}")))?;
    Ok(Some(Header {
        valid: le32(sector, 4) != 0,
        chunk_sectors,
    }))
}

/// Writes `record` into slot `index` of an area image.
pub fn put_record(area: &mut [u8], index: u64, record: Record) {
    let at = index as usize * RECORD_SIZE;
    area[at..at + 8].copy_from_slice(&record.old.to_le_bytes());
    area[at + 8..at + 16].copy_from_slice(&record.new.to_le_bytes());
}

pub fn get_record(area: &[u8], index: u64) -> Record {
    let at = index as usize * RECORD_SIZE;
    Record {
        old: le64(area, at),
        new: le64(area, at + 8),
    }
}

/// An area image holding `records` from slot 0, zero after them.
pub fn area_image(geometry: &Geometry, records: &[Record]) -> AlignedBuf {
    let mut area = AlignedBuf::zeroed(geometry.chunk_bytes() as usize);
    for (i, record) in records.iter().enumerate() {
        put_record(&mut area, i as u64, *record);
    }
    area
}

/// What a walk of the metadata areas found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Walk {
    pub header: Header,
    /// Every record, area by area, in on-disk order.
    pub records: Vec<Record>,
    /// The area new records go to (the first one that is not full).
    pub current_area: u64,
    /// The current area has non-zero bytes after its terminating record: records of a write
    /// that never completed, which a later torn write could bring back to life.
    pub stale_tail: bool,
}

impl Walk {
    /// The first chunk never handed out, as the kernel computes it: one past the highest
    /// data chunk in use, past the metadata chunk if it lands on one, and at least the first
    /// data chunk of area 0.
    pub fn next_free(&self, geometry: &Geometry) -> u64 {
        let mut next = self.records.iter().map(|r| r.new + 1).max().unwrap_or(2);
        if geometry.is_metadata(next) {
            next += 1;
        }
        next
    }
}

/// Reads the header and every metadata area of a COW device, checking each record: a record
/// must name a data chunk that exists on the device, and no origin chunk or COW chunk may be
/// named twice. `Ok(None)` for a blank device. An invalid store's areas are not read (the
/// kernel ignores them too).
pub fn walk(dev: &dyn BlockDevice) -> Result<Option<Walk>, StoreError> {
    let Some((header, geometry)) = read_header(dev)? else {
        return Ok(None);
    };
    let mut found = Walk {
        header,
        records: Vec::new(),
        current_area: 0,
        stale_tail: false,
    };
    if !header.valid {
        return Ok(Some(found));
    }
    let per_area = geometry.per_area();
    let mut seen = Seen::default();
    let mut area = AlignedBuf::zeroed(geometry.chunk_bytes() as usize);
    loop {
        let chunk = geometry.area_chunk(found.current_area);
        if chunk >= geometry.chunks {
            // The previous area is full and the device ends before the next one: the store
            // is simply full (udm never fills an area without room for the next).
            if found.current_area > 0 {
                return Ok(Some(found));
            }
            return Err(StoreError::Corrupt(format!(
                "metadata area {} (chunk {chunk}) lies past the end of the COW device \
                 ({} chunks): truncated?",
                found.current_area, geometry.chunks
            )));
        }
        dev.read(geometry.offset(chunk), &mut area)?;
        for index in 0..per_area {
            let record = get_record(&area, index);
            if record.new == 0 {
                let tail = &area[index as usize * RECORD_SIZE..];
                found.stale_tail = tail.iter().any(|&b| b != 0);
                return Ok(Some(found));
            }
            let at = || format!("record {index} of metadata area {}", found.current_area);
            seen.check(&geometry, record, at)?;
            found.records.push(record);
        }
        found.current_area += 1;
    }
}

/// The header of a COW device and the geometry it gives the device; `None` for a blank one.
/// Refuses a device too small for its header and first metadata area.
fn read_header(dev: &dyn BlockDevice) -> Result<Option<(Header, Geometry)>, StoreError> {
    if dev.size() < SECTOR_SIZE {
        return Err(StoreError::TooSmall(format!(
            "the COW device has {} bytes, less than its header's sector",
            dev.size()
        )));
    }
    let mut first = AlignedBuf::zeroed(SECTOR_SIZE as usize);
    dev.read(0, &mut first)?;
    let Some(header) = decode_header(&first)? else {
        return Ok(None);
    };
    let geometry = Geometry::new(header.chunk_sectors, dev.size());
    if geometry.chunks < 2 {
        return Err(StoreError::TooSmall(format!(
            "the COW device ({} sectors) is smaller than its header and first metadata area \
             ({} sectors with its chunk size of {})",
            dev.size() / SECTOR_SIZE,
            2 * header.chunk_sectors,
            header.chunk_sectors
        )));
    }
    Ok(Some((header, geometry)))
}

/// The origin and COW chunks the records read so far name: each may be named once.
#[derive(Default)]
struct Seen {
    olds: std::collections::HashSet<u64>,
    news: std::collections::HashSet<u64>,
}

impl Seen {
    /// Checks `record` (found `at()`) against the device and the records before it.
    fn check(
        &mut self,
        geometry: &Geometry,
        record: Record,
        at: impl Fn() -> String,
    ) -> Result<(), StoreError> {
        let problem = if record.new >= geometry.chunks {
            format!(
                "points to COW chunk {}, past the end of the device ({} chunks): truncated?",
                record.new, geometry.chunks
            )
        } else if geometry.is_metadata(record.new) {
            format!("points to chunk {}, which holds metadata", record.new)
        } else if !self.olds.insert(record.old) {
            format!("saves origin chunk {} a second time", record.old)
        } else if !self.news.insert(record.new) {
            format!("uses COW chunk {} a second time", record.new)
        } else {
            return Ok(());
        };
        Err(StoreError::Corrupt(format!("{} {problem}", at())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_bytes_are_the_kernels() {
        let bytes = encode_header(Header {
            valid: true,
            chunk_sectors: 16,
        });
        assert_eq!(
            bytes,
            [0x53, 0x6e, 0x41, 0x70, 1, 0, 0, 0, 1, 0, 0, 0, 16, 0, 0, 0]
        );
        assert_eq!(&bytes[..4], b"SnAp");
        let mut sector = vec![0u8; 512];
        sector[..16].copy_from_slice(&bytes);
        assert_eq!(
            decode_header(&sector).unwrap(),
            Some(Header {
                valid: true,
                chunk_sectors: 16
            })
        );
        assert_eq!(decode_header(&[0u8; 512]).unwrap(), None);
    }

    #[test]
    fn areas_sit_between_their_data_chunks() {
        // 8 KiB chunks: 512 records per area, so area 1 is at chunk 1 + 513.
        let g = Geometry::new(16, 1 << 30);
        assert_eq!(g.per_area(), 512);
        assert_eq!(g.area_chunk(0), 1);
        assert_eq!(g.area_chunk(1), 514);
        assert!(g.is_metadata(0) && g.is_metadata(1) && g.is_metadata(514));
        assert!(!g.is_metadata(2) && !g.is_metadata(513) && !g.is_metadata(515));
    }

    #[test]
    fn bad_headers_say_what_is_wrong() {
        let mut sector = vec![0u8; 512];
        sector[..4].copy_from_slice(&0xdead_beefu32.to_le_bytes());
        let err = decode_header(&sector).unwrap_err().to_string();
        assert!(err.contains("not a snapshot COW device"), "{err}");
        sector[..16].copy_from_slice(&encode_header(Header {
            valid: true,
            chunk_sectors: 16,
        }));
        sector[8] = 2;
        let err = decode_header(&sector).unwrap_err().to_string();
        assert!(err.contains("version 2"), "{err}");
        sector[8] = 1;
        sector[12] = 12;
        let err = decode_header(&sector).unwrap_err().to_string();
        assert!(err.contains("chunk size 12"), "{err}");
    }

    #[test]
    fn next_free_skips_metadata_chunks() {
        let g = Geometry::new(8, 1 << 30); // 256 records per area: area 1 at chunk 258
        let walk = |records: Vec<Record>| Walk {
            header: Header {
                valid: true,
                chunk_sectors: 8,
            },
            records,
            current_area: 0,
            stale_tail: false,
        };
        assert_eq!(walk(vec![]).next_free(&g), 2);
        assert_eq!(walk(vec![Record { old: 9, new: 5 }]).next_free(&g), 6);
        assert_eq!(walk(vec![Record { old: 9, new: 257 }]).next_free(&g), 259);
    }
}
