//! Space-map index entries (16 bytes each; K:`pd/dm-space-map-common.h` `struct disk_index_entry`)
//! and the metadata space map's single index block of 255 of them.

use crate::BLOCK_SIZE;

/// The metadata space map's index block holds this many entries, which caps the metadata
/// device at 255 bitmaps of 16,320 blocks (K:`DM_SM_METADATA_MAX_BLOCKS`).
pub const MAX_METADATA_BITMAPS: usize = (BLOCK_SIZE - 16) / 16;
pub const ENTRY_SIZE: usize = 16;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexEntry {
    /// Where the bitmap block is.
    pub blocknr: u64,
    /// Entries of the bitmap with count 0.
    pub nr_free: u32,
    /// No free entry sits below this one (an allocation hint).
    pub none_free_before: u32,
}

impl IndexEntry {
    pub fn decode(bytes: &[u8]) -> Self {
        IndexEntry {
            blocknr: u64::from_le_bytes(bytes[0..8].try_into().unwrap()),
            nr_free: u32::from_le_bytes(bytes[8..12].try_into().unwrap()),
            none_free_before: u32::from_le_bytes(bytes[12..16].try_into().unwrap()),
        }
    }

    pub fn encode(&self) -> [u8; ENTRY_SIZE] {
        let mut out = [0u8; ENTRY_SIZE];
        out[0..8].copy_from_slice(&self.blocknr.to_le_bytes());
        out[8..12].copy_from_slice(&self.nr_free.to_le_bytes());
        out[12..16].copy_from_slice(&self.none_free_before.to_le_bytes());
        out
    }
}

/// The entries of a metadata index block (header checked by the caller).
pub fn decode_index_block(block: &[u8], nr_bitmaps: usize) -> Vec<IndexEntry> {
    (0..nr_bitmaps)
        .map(|i| IndexEntry::decode(&block[16 + i * ENTRY_SIZE..16 + (i + 1) * ENTRY_SIZE]))
        .collect()
}

/// Fills a metadata index block: `entries`, then zeroes.
pub fn encode_index_block(entries: &[IndexEntry], block: &mut [u8]) {
    block[4..].fill(0);
    for (i, e) in entries.iter().enumerate() {
        block[16 + i * ENTRY_SIZE..16 + (i + 1) * ENTRY_SIZE].copy_from_slice(&e.encode());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_in_the_index_block() {
        assert_eq!(MAX_METADATA_BITMAPS, 255);
        let entries: Vec<IndexEntry> = (0..3)
            .map(|i| IndexEntry {
                blocknr: 10 + i,
                nr_free: 16_320 - i as u32,
                none_free_before: i as u32,
            })
            .collect();
        let mut block = vec![0xffu8; BLOCK_SIZE];
        encode_index_block(&entries, &mut block);
        assert_eq!(&block[16..24], &10u64.to_le_bytes());
        assert!(block[16 + 3 * 16..].iter().all(|&b| b == 0));
        assert_eq!(decode_index_block(&block, 3), entries);
    }
}
