//! The thin superblock (block 0; K:`dm-thin-metadata.c` `struct thin_disk_superblock`,
//! TPT `src/thin/superblock.rs`). Its 364 bytes fit in one sector, so a torn write leaves the
//! old or the new one; the rest of the block is zero and inside the checksum.

use super::checksum::{seal, verify, Kind};
use super::error::{corrupt, Result, ThinError};
use crate::block::{read_u64, write_u64};
use crate::random::random_bytes;
use crate::BLOCK_SIZE;

pub const SUPERBLOCK_LOCATION: u64 = 0;
pub const MAGIC: u64 = 27_022_010;
/// What the kernel writes (`THIN_VERSION`); versions 1 and 2 share the layout udm uses.
pub const VERSION: u32 = 2;
/// Metadata blocks are 4 KiB: 8 sectors.
pub const METADATA_BLOCK_SECTORS: u32 = 8;
/// Bit 0 of `flags`.
pub const NEEDS_CHECK: u32 = 1;

/// The root of a space map, as kept in the superblock's 128-byte areas (only 32 bytes used).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SmRoot {
    pub nr_blocks: u64,
    pub nr_allocated: u64,
    /// Data: root of the index tree. Metadata: the index block.
    pub bitmap_root: u64,
    pub ref_count_root: u64,
}

impl SmRoot {
    fn read(block: &[u8], at: usize) -> Self {
        SmRoot {
            nr_blocks: read_u64(block, at),
            nr_allocated: read_u64(block, at + 8),
            bitmap_root: read_u64(block, at + 16),
            ref_count_root: read_u64(block, at + 24),
        }
    }

    fn write(&self, block: &mut [u8], at: usize) {
        write_u64(block, at, self.nr_blocks);
        write_u64(block, at + 8, self.nr_allocated);
        write_u64(block, at + 16, self.bitmap_root);
        write_u64(block, at + 24, self.ref_count_root);
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub flags: u32,
    /// The pool's identity: random, written when udm formats the metadata or first opens it
    /// writable (zeroes until then: the kernel and thin_restore write none).
    pub uuid: [u8; 16],
    pub version: u32,
    pub time: u32,
    pub trans_id: u64,
    pub held_root: u64,
    pub data_sm: SmRoot,
    pub metadata_sm: SmRoot,
    pub data_mapping_root: u64,
    pub device_details_root: u64,
    pub data_block_size: u32,
    pub metadata_block_size: u32,
    pub metadata_nr_blocks: u64,
    pub compat_flags: u32,
    pub compat_ro_flags: u32,
    pub incompat_flags: u32,
}

/// A random uuid (version 4, RFC 9562), never all zeroes, which stand for none.
pub fn random_uuid() -> [u8; 16] {
    let mut uuid: [u8; 16] = random_bytes();
    uuid[6] = (uuid[6] & 0x0f) | 0x40;
    uuid[8] = (uuid[8] & 0x3f) | 0x80;
    uuid
}

fn u32_at(block: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(block[at..at + 4].try_into().unwrap())
}

fn put_u32(block: &mut [u8], at: usize, value: u32) {
    block[at..at + 4].copy_from_slice(&value.to_le_bytes());
}

impl Superblock {
    /// Decodes and checks the superblock read from `location` (0, or a metadata snapshot's).
    pub fn decode(location: u64, block: &[u8]) -> Result<Self> {
        verify(Kind::Superblock, location, block)?;
        let magic = read_u64(block, 32);
        if magic != MAGIC {
            return Err(corrupt(
                location,
                format!("bad superblock magic {magic}, expected {MAGIC}"),
            ));
        }
        Ok(Superblock {
            flags: u32_at(block, 4),
            uuid: block[16..32].try_into().unwrap(),
            version: u32_at(block, 40),
            time: u32_at(block, 44),
            trans_id: read_u64(block, 48),
            held_root: read_u64(block, 56),
            data_sm: SmRoot::read(block, 64),
            metadata_sm: SmRoot::read(block, 192),
            data_mapping_root: read_u64(block, 320),
            device_details_root: read_u64(block, 328),
            data_block_size: u32_at(block, 336),
            metadata_block_size: u32_at(block, 340),
            metadata_nr_blocks: read_u64(block, 344),
            compat_flags: u32_at(block, 352),
            compat_ro_flags: u32_at(block, 356),
            incompat_flags: u32_at(block, 360),
        })
    }

    /// The sealed 4 KiB block for `location`.
    pub fn encode(&self, location: u64) -> Box<[u8; BLOCK_SIZE]> {
        let mut block = Box::new([0u8; BLOCK_SIZE]);
        put_u32(&mut block[..], 4, self.flags);
        block[16..32].copy_from_slice(&self.uuid);
        write_u64(&mut block[..], 32, MAGIC);
        put_u32(&mut block[..], 40, self.version);
        put_u32(&mut block[..], 44, self.time);
        write_u64(&mut block[..], 48, self.trans_id);
        write_u64(&mut block[..], 56, self.held_root);
        self.data_sm.write(&mut block[..], 64);
        self.metadata_sm.write(&mut block[..], 192);
        write_u64(&mut block[..], 320, self.data_mapping_root);
        write_u64(&mut block[..], 328, self.device_details_root);
        put_u32(&mut block[..], 336, self.data_block_size);
        put_u32(&mut block[..], 340, self.metadata_block_size);
        write_u64(&mut block[..], 344, self.metadata_nr_blocks);
        put_u32(&mut block[..], 352, self.compat_flags);
        put_u32(&mut block[..], 356, self.compat_ro_flags);
        put_u32(&mut block[..], 360, self.incompat_flags);
        seal(Kind::Superblock, location, &mut block[..]);
        block
    }

    /// Refuses what this implementation cannot safely write to (as the kernel does on open).
    pub fn check_features(&self) -> Result<()> {
        if self.incompat_flags != 0 {
            return Err(ThinError::BadArgument(format!(
                "pool metadata has incompatible features {:#x} this udm does not know",
                self.incompat_flags
            )));
        }
        if self.compat_ro_flags != 0 {
            return Err(ThinError::BadArgument(format!(
                "pool metadata has features {:#x} that allow only read-only use",
                self.compat_ro_flags
            )));
        }
        if self.metadata_block_size != METADATA_BLOCK_SECTORS {
            return Err(corrupt(
                SUPERBLOCK_LOCATION,
                format!(
                    "metadata block size {} sectors, expected {METADATA_BLOCK_SECTORS}",
                    self.metadata_block_size
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Superblock {
        Superblock {
            flags: 0,
            uuid: [0; 16],
            version: VERSION,
            time: 3,
            trans_id: 42,
            held_root: 0,
            data_sm: SmRoot {
                nr_blocks: 100_000,
                nr_allocated: 3,
                bitmap_root: 4,
                ref_count_root: 5,
            },
            metadata_sm: SmRoot {
                nr_blocks: 2048,
                nr_allocated: 18,
                bitmap_root: 1,
                ref_count_root: 2,
            },
            data_mapping_root: 7,
            device_details_root: 6,
            data_block_size: 128,
            metadata_block_size: 8,
            metadata_nr_blocks: 2048,
            compat_flags: 0,
            compat_ro_flags: 0,
            incompat_flags: 0,
        }
    }

    #[test]
    fn round_trips_at_the_documented_offsets() {
        let sb = sample();
        let block = sb.encode(0);
        assert_eq!(&block[32..40], &[0xba, 0x52, 0x9c, 0x01, 0, 0, 0, 0]);
        assert_eq!(read_u64(&block[..], 64), 100_000);
        assert_eq!(read_u64(&block[..], 192), 2048);
        assert_eq!(read_u64(&block[..], 320), 7);
        assert!(block[364..].iter().all(|&b| b == 0));
        assert_eq!(Superblock::decode(0, &block[..]).unwrap(), sb);
        let err = Superblock::decode(5, &block[..]).unwrap_err().to_string();
        assert!(err.contains("block 5"), "{err}");
    }

    #[test]
    fn unknown_features_are_refused() {
        let mut sb = sample();
        sb.check_features().unwrap();
        sb.incompat_flags = 1;
        assert!(sb.check_features().is_err());
        sb.incompat_flags = 0;
        sb.compat_ro_flags = 2;
        assert!(sb.check_features().is_err());
    }
}
