//! Space-map bitmap blocks (K:`pd/dm-space-map-common.c` `sm_lookup_bitmap`/`sm_set_bitmap`).
//!
//! After the 16-byte header (csum, unused, blocknr) come 510 little-endian u64 words of 32
//! two-bit entries: 16,320 blocks per bitmap. Entry `j` sits at bit `2*(j%32)` of word `j/32`
//! with its two bits *swapped*: bit `s` is the count's 2, bit `s+1` its 1. Count 3 means "3 or
//! more, see the overflow ref-count tree".

use crate::BLOCK_SIZE;

pub const WORDS: usize = (BLOCK_SIZE - 16) / 8;
pub const ENTRIES_PER_BITMAP: u64 = (WORDS * 32) as u64;

pub type Words = [u64; WORDS];

pub fn get(words: &Words, j: usize) -> u32 {
    let raw = (words[j / 32] >> (2 * (j % 32))) & 3;
    (((raw & 1) << 1) | (raw >> 1)) as u32
}

/// Sets entry `j` to `count` (0..=3).
pub fn set(words: &mut Words, j: usize, count: u32) {
    debug_assert!(count <= 3);
    let shift = 2 * (j % 32);
    let raw = (((count & 1) << 1) | (count >> 1)) as u64;
    let word = &mut words[j / 32];
    *word = (*word & !(3 << shift)) | (raw << shift);
}

/// Entries of a word that are 0 (both bits clear), as the low bit of each pair.
fn free_pairs(word: u64) -> u64 {
    !(word | (word >> 1)) & 0x5555_5555_5555_5555
}

/// The first entry in `[from, end)` with count 0 for which `usable` holds.
pub fn find_free(
    words: &Words,
    from: usize,
    end: usize,
    mut usable: impl FnMut(usize) -> bool,
) -> Option<usize> {
    let mut w = from / 32;
    while w * 32 < end {
        let mut pairs = free_pairs(words[w]);
        while pairs != 0 {
            let j = w * 32 + pairs.trailing_zeros() as usize / 2;
            if j >= end {
                return None;
            }
            if j >= from && usable(j) {
                return Some(j);
            }
            pairs &= pairs - 1;
        }
        w += 1;
    }
    None
}

/// Entries with count 0, over all 16,320 (the kernel's `nr_free` counts the slots past the
/// end of the device in the last bitmap too).
pub fn count_free(words: &Words) -> u32 {
    words.iter().map(|&w| free_pairs(w).count_ones()).sum()
}

pub fn decode(block: &[u8]) -> Box<Words> {
    let mut words = Box::new([0u64; WORDS]);
    for (i, w) in words.iter_mut().enumerate() {
        *w = u64::from_le_bytes(block[16 + i * 8..24 + i * 8].try_into().unwrap());
    }
    words
}

/// Writes the words into a bitmap block (the header is sealed at write-out).
pub fn encode(words: &Words, block: &mut [u8]) {
    block[4..8].fill(0);
    for (i, w) in words.iter().enumerate() {
        block[16 + i * 8..24 + i * 8].copy_from_slice(&w.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_stored_with_their_bits_swapped() {
        let mut words = [0u64; WORDS];
        set(&mut words, 0, 1);
        assert_eq!(words[0], 0b10, "count 1 is bit s+1");
        set(&mut words, 0, 2);
        assert_eq!(words[0], 0b01, "count 2 is bit s");
        set(&mut words, 33, 3);
        assert_eq!(words[1], 0b1100);
        for j in [0, 31, 32, 16_319] {
            for c in 0..4 {
                set(&mut words, j, c);
                assert_eq!(get(&words, j), c);
            }
        }
    }

    #[test]
    fn free_entries_are_found_and_counted() {
        let mut words = [0u64; WORDS];
        assert_eq!(count_free(&words), 16_320);
        for j in 0..100 {
            set(&mut words, j, 1 + (j % 3) as u32);
        }
        assert_eq!(count_free(&words), 16_220);
        assert_eq!(find_free(&words, 0, 16_320, |_| true), Some(100));
        assert_eq!(find_free(&words, 0, 100, |_| true), None);
        assert_eq!(find_free(&words, 0, 16_320, |j| j > 150), Some(151));
        set(&mut words, 50, 0);
        assert_eq!(find_free(&words, 10, 16_320, |_| true), Some(50));
        assert_eq!(find_free(&words, 51, 16_320, |_| true), Some(100));
        let mut block = vec![0u8; BLOCK_SIZE];
        encode(&words, &mut block);
        assert_eq!(*decode(&block), words);
    }
}
