//! dm's block checksums (kernel `dm_bm_checksum`, TPT `src/checksum.rs`).
//!
//! Every metadata block stores at offset 0 the crc32c of its bytes 4..4096, computed the
//! kernel's way (register seeded with `!0`, no final inversion), XORed with a salt that names
//! the block's type; at offset 8 it stores its own block number. A block of the wrong type, at
//! the wrong place, or torn fails [`verify`].

use super::error::{corrupt, Result};
use crate::BLOCK_SIZE;

/// The kinds of block on a thin metadata device, each with its salt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Superblock,
    Node,
    Bitmap,
    Index,
}

const KINDS: [Kind; 4] = [Kind::Superblock, Kind::Node, Kind::Bitmap, Kind::Index];

impl Kind {
    pub fn salt(self) -> u32 {
        match self {
            Kind::Superblock => 160_774,
            Kind::Node => 121_107,
            Kind::Bitmap => 240_779,
            Kind::Index => 160_478,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kind::Superblock => "superblock",
            Kind::Node => "btree node",
            Kind::Bitmap => "space map bitmap",
            Kind::Index => "metadata space map index",
        }
    }
}

/// The kernel's `crc32c(~0, bytes)`: a standard crc32c without its final inversion.
pub fn raw_crc32c(bytes: &[u8]) -> u32 {
    !crc32c::crc32c(bytes)
}

fn stored(block: &[u8]) -> u32 {
    u32::from_le_bytes(block[0..4].try_into().unwrap())
}

/// Writes `blocknr` and the checksum of a block whose payload is complete.
pub fn seal(kind: Kind, blocknr: u64, block: &mut [u8]) {
    block[8..16].copy_from_slice(&blocknr.to_le_bytes());
    let csum = raw_crc32c(&block[4..BLOCK_SIZE]) ^ kind.salt();
    block[0..4].copy_from_slice(&csum.to_le_bytes());
}

/// Checks a block read from `blocknr` that should be of `kind`.
pub fn verify(kind: Kind, blocknr: u64, block: &[u8]) -> Result<()> {
    let salt = stored(block) ^ raw_crc32c(&block[4..BLOCK_SIZE]);
    if salt != kind.salt() {
        let what = match KINDS.iter().find(|k| k.salt() == salt) {
            Some(other) => format!("is a {}, expected a {}", other.name(), kind.name()),
            None if block.iter().all(|&b| b == 0) => {
                format!("is all zeroes, expected a {}", kind.name())
            }
            None => format!("bad checksum (expected a {})", kind.name()),
        };
        return Err(corrupt(blocknr, what));
    }
    let recorded = u64::from_le_bytes(block[8..16].try_into().unwrap());
    if recorded != blocknr {
        return Err(corrupt(
            blocknr,
            format!("{} says it is block {recorded}", kind.name()),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_crc_matches_the_kernel_vectors() {
        // dm-formats.md A.1: bytes 4..4096 all zero.
        let zero = vec![0u8; BLOCK_SIZE];
        assert_eq!(raw_crc32c(&zero[4..]), 0x58CD_A791);
        assert_eq!(raw_crc32c(b"123456789"), !0xE306_9283);
        let mut node = zero.clone();
        seal(Kind::Node, 0, &mut node);
        assert_eq!(stored(&node), 0x58CC_7E82);
        let mut sb = zero;
        seal(Kind::Superblock, 0, &mut sb);
        assert_eq!(stored(&sb), 0x58CF_D397);
    }

    #[test]
    fn verify_names_what_is_wrong() {
        let mut block = vec![0u8; BLOCK_SIZE];
        block[100] = 1;
        seal(Kind::Bitmap, 7, &mut block);
        verify(Kind::Bitmap, 7, &block).unwrap();
        let err = verify(Kind::Node, 7, &block).unwrap_err().to_string();
        assert!(
            err.contains("block 7") && err.contains("is a space map bitmap"),
            "{err}"
        );
        let err = verify(Kind::Bitmap, 8, &block).unwrap_err().to_string();
        assert!(err.contains("says it is block 7"), "{err}");
        block[200] ^= 4;
        let err = verify(Kind::Bitmap, 7, &block).unwrap_err().to_string();
        assert!(err.contains("bad checksum"), "{err}");
        let err = verify(Kind::Superblock, 0, &[0u8; BLOCK_SIZE])
            .unwrap_err()
            .to_string();
        assert!(err.contains("all zeroes"), "{err}");
    }
}
