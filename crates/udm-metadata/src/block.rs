//! Checksummed metadata blocks.
//!
//! Header (16 bytes, little-endian):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | crc32c of bytes 4..4096, seeded with the salt of the block type and number |
//! | 4 | 4 | block type |
//! | 8 | 8 | the block's own number on the metadata device |

use thiserror::Error;
use udm_block::BlockError;

pub const BLOCK_SIZE: usize = 4096;
pub const HEADER_SIZE: usize = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum BlockType {
    CloneSuperblock = 0x434c_5350,
    CloneBitmap = 0x434c_424d,
    LogSuperblock = 0x4c47_5350,
    LogEntry = 0x4c47_454e,
}

#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum MetadataError {
    #[error("metadata block {block}: {what}")]
    Corrupt { block: u64, what: String },
    #[error("metadata device: {0}")]
    Io(#[from] BlockError),
    #[error("{0}")]
    Mismatch(String),
}

fn salt(kind: BlockType, number: u64) -> u32 {
    // Mixing type and number into the seed makes a block written to the wrong place, or a
    // block of another type, fail its checksum.
    (kind as u32) ^ (number as u32).rotate_left(16) ^ ((number >> 32) as u32) ^ 0x9e37_79b9
}

fn checksum(kind: BlockType, number: u64, block: &[u8]) -> u32 {
    crc32c::crc32c_append(salt(kind, number), &block[4..BLOCK_SIZE])
}

/// Fills in the header of `block` (whose payload is already written).
pub fn seal(kind: BlockType, number: u64, block: &mut [u8]) {
    block[4..8].copy_from_slice(&(kind as u32).to_le_bytes());
    block[8..16].copy_from_slice(&number.to_le_bytes());
    let crc = checksum(kind, number, block);
    block[0..4].copy_from_slice(&crc.to_le_bytes());
}

/// Checks the header of a block read from `number`.
pub fn verify(kind: BlockType, number: u64, block: &[u8]) -> Result<(), MetadataError> {
    let corrupt = |what: String| MetadataError::Corrupt {
        block: number,
        what,
    };
    let stored_type = u32::from_le_bytes(block[4..8].try_into().unwrap());
    if stored_type != kind as u32 {
        return Err(corrupt(format!(
            "type {stored_type:#x}, expected {:#x}",
            kind as u32
        )));
    }
    let stored_number = u64::from_le_bytes(block[8..16].try_into().unwrap());
    if stored_number != number {
        return Err(corrupt(format!("header says block {stored_number}")));
    }
    let stored = u32::from_le_bytes(block[0..4].try_into().unwrap());
    let computed = checksum(kind, number, block);
    if stored != computed {
        return Err(corrupt(format!(
            "checksum {stored:#010x}, computed {computed:#010x}"
        )));
    }
    Ok(())
}

pub fn read_u64(block: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(block[at..at + 8].try_into().unwrap())
}

pub fn write_u64(block: &mut [u8], at: usize, value: u64) {
    block[at..at + 8].copy_from_slice(&value.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_blocks_verify_and_any_change_is_caught() {
        let mut block = vec![0u8; BLOCK_SIZE];
        block[100] = 7;
        seal(BlockType::CloneBitmap, 5, &mut block);
        verify(BlockType::CloneBitmap, 5, &block).unwrap();
        assert!(
            verify(BlockType::CloneBitmap, 6, &block).is_err(),
            "misdirected"
        );
        assert!(
            verify(BlockType::CloneSuperblock, 5, &block).is_err(),
            "wrong type"
        );
        for at in [0, 5, 12, 100, 4095] {
            let mut bad = block.clone();
            bad[at] ^= 0x10;
            assert!(
                verify(BlockType::CloneBitmap, 5, &bad).is_err(),
                "flip at {at}"
            );
        }
        assert!(verify(BlockType::CloneBitmap, 5, &vec![0u8; BLOCK_SIZE]).is_err());
    }
}
