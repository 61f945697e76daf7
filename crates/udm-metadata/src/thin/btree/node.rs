//! The B-tree node block (K:`pd/dm-btree-internal.h` `struct btree_node`, TPT
//! `src/pdata/btree.rs`):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | csum (salt 121107) |
//! | 4 | 4 | flags: 1 internal, 2 leaf |
//! | 8 | 8 | blocknr |
//! | 16 | 4 | nr_entries |
//! | 20 | 4 | max_entries |
//! | 24 | 4 | value_size (8 in internal nodes: child block numbers) |
//! | 28 | 4 | padding |
//! | 32 | 8 × max_entries | keys, ascending |
//! | 32 + 8 × max_entries | value_size × max_entries | values |
//!
//! These functions read and write a node in place; [`check`] makes every later access in
//! bounds, so damaged metadata gives an error, never a panic.

use super::super::error::{corrupt, Result};
use crate::BLOCK_SIZE;

pub const INTERNAL: u32 = 1;
pub const LEAF: u32 = 2;
const HEADER: usize = 32;

/// Entries of a node with `value_size`-byte values: the kernel's `calc_max_entries`
/// (rounded down to a multiple of 3 so that splits and merges balance).
pub fn calc_max_entries(value_size: usize) -> usize {
    let n = (BLOCK_SIZE - HEADER) / (8 + value_size);
    3 * (n / 3)
}

fn u32_at(d: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(d[at..at + 4].try_into().unwrap())
}

fn put_u32(d: &mut [u8], at: usize, v: u32) {
    d[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

/// Checks the header of node `b` in a tree whose leaves hold `leaf_value_size`-byte values.
pub fn check(b: u64, d: &[u8], leaf_value_size: usize) -> Result<()> {
    let flags = u32_at(d, 4);
    let value_size = u32_at(d, 24) as usize;
    let max = u32_at(d, 20) as usize;
    let nr = u32_at(d, 16) as usize;
    let expected = match flags {
        INTERNAL => 8,
        LEAF => leaf_value_size,
        _ => return Err(corrupt(b, format!("btree node flags {flags:#x}"))),
    };
    if value_size != expected {
        return Err(corrupt(
            b,
            format!("btree node value size {value_size}, expected {expected}"),
        ));
    }
    // Every writer (kernel, thin-provisioning-tools, udm) sizes nodes this way; insisting on
    // it keeps every node of a tree the same size, which moving entries between them needs.
    if max != calc_max_entries(value_size) {
        return Err(corrupt(
            b,
            format!(
                "btree node max_entries {max}, expected {}",
                calc_max_entries(value_size)
            ),
        ));
    }
    if nr > max {
        return Err(corrupt(
            b,
            format!("btree node has {nr} entries, room for {max}"),
        ));
    }
    if flags == INTERNAL && nr == 0 {
        return Err(corrupt(b, "internal btree node without entries"));
    }
    Ok(())
}

pub fn is_leaf(d: &[u8]) -> bool {
    u32_at(d, 4) == LEAF
}

pub fn nr_entries(d: &[u8]) -> usize {
    u32_at(d, 16) as usize
}

pub fn max_entries(d: &[u8]) -> usize {
    u32_at(d, 20) as usize
}

pub fn value_size(d: &[u8]) -> usize {
    u32_at(d, 24) as usize
}

pub fn key(d: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(d[HEADER + 8 * i..HEADER + 8 * i + 8].try_into().unwrap())
}

fn value_at(d: &[u8], i: usize) -> usize {
    HEADER + 8 * max_entries(d) + i * value_size(d)
}

pub fn value(d: &[u8], i: usize) -> &[u8] {
    let at = value_at(d, i);
    &d[at..at + value_size(d)]
}

pub fn value_u64(d: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(value(d, i)[..8].try_into().unwrap())
}

/// Index of the largest key ≤ `k` (None: every key is greater, or the node is empty).
pub fn lower_bound(d: &[u8], k: u64) -> Option<usize> {
    let (mut lo, mut hi) = (0, nr_entries(d));
    // Invariant: keys below lo are ≤ k, keys from hi on are > k.
    while lo < hi {
        let mid = (lo + hi) / 2;
        if key(d, mid) <= k {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo.checked_sub(1)
}

/// Makes `d` an empty node.
pub fn init(d: &mut [u8], leaf: bool, value_size: usize) {
    d[4..].fill(0);
    put_u32(d, 4, if leaf { LEAF } else { INTERNAL });
    put_u32(d, 20, calc_max_entries(value_size) as u32);
    put_u32(d, 24, value_size as u32);
}

pub fn set_nr_entries(d: &mut [u8], n: usize) {
    put_u32(d, 16, n as u32);
}

pub fn set_key(d: &mut [u8], i: usize, k: u64) {
    d[HEADER + 8 * i..HEADER + 8 * i + 8].copy_from_slice(&k.to_le_bytes());
}

pub fn set_value(d: &mut [u8], i: usize, v: &[u8]) {
    let at = value_at(d, i);
    d[at..at + v.len()].copy_from_slice(v);
}

/// Inserts entry `(k, v)` at `i`, moving the later entries up (the node has room).
pub fn insert_at(d: &mut [u8], i: usize, k: u64, v: &[u8]) {
    let nr = nr_entries(d);
    let vs = value_size(d);
    d.copy_within(HEADER + 8 * i..HEADER + 8 * nr, HEADER + 8 * (i + 1));
    let vals = value_at(d, 0);
    d.copy_within(vals + vs * i..vals + vs * nr, vals + vs * (i + 1));
    set_key(d, i, k);
    set_value(d, i, v);
    set_nr_entries(d, nr + 1);
}

/// Removes entry `i`, moving the later entries down.
pub fn remove_at(d: &mut [u8], i: usize) {
    let nr = nr_entries(d);
    let vs = value_size(d);
    d.copy_within(HEADER + 8 * (i + 1)..HEADER + 8 * nr, HEADER + 8 * i);
    let vals = value_at(d, 0);
    d.copy_within(vals + vs * (i + 1)..vals + vs * nr, vals + vs * i);
    set_nr_entries(d, nr - 1);
    // Stale slots are zeroed as TPT does: what a node holds is only its entries.
    set_key(d, nr - 1, 0);
    let at = value_at(d, nr - 1);
    d[at..at + vs].fill(0);
}

/// A node's entries, detached (for moving entries between nodes).
pub struct Entries {
    pub keys: Vec<u64>,
    pub values: Vec<u8>,
    pub value_size: usize,
}

impl Entries {
    pub fn new(value_size: usize) -> Self {
        Entries {
            keys: Vec::new(),
            values: Vec::new(),
            value_size,
        }
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Appends the entries of node `d`.
    pub fn take_from(&mut self, d: &[u8]) {
        let nr = nr_entries(d);
        self.keys.extend((0..nr).map(|i| key(d, i)));
        let at = value_at(d, 0);
        self.values
            .extend_from_slice(&d[at..at + nr * self.value_size]);
    }

    /// Fills node `d` (keeping its header) with entries `range`.
    pub fn put_into(&self, d: &mut [u8], range: std::ops::Range<usize>) {
        let max = max_entries(d);
        let vs = self.value_size;
        d[HEADER..].fill(0);
        for (slot, i) in range.clone().enumerate() {
            set_key(d, slot, self.keys[i]);
        }
        let at = HEADER + 8 * max;
        d[at..at + range.len() * vs]
            .copy_from_slice(&self.values[range.start * vs..range.end * vs]);
        set_nr_entries(d, range.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_entries_match_the_kernel() {
        assert_eq!(calc_max_entries(8), 252);
        assert_eq!(calc_max_entries(24), 126);
        assert_eq!(calc_max_entries(16), 168);
        assert_eq!(calc_max_entries(4), 336);
    }

    #[test]
    fn entries_stay_sorted_through_inserts_and_removes() {
        let mut d = vec![0u8; BLOCK_SIZE];
        init(&mut d, true, 8);
        check(0, &d, 8).unwrap();
        assert_eq!(lower_bound(&d, 5), None);
        for (i, k) in [10u64, 30, 20].iter().enumerate() {
            let at = lower_bound(&d, *k).map_or(0, |i| i + 1);
            insert_at(&mut d, at, *k, &(i as u64 * 100).to_le_bytes());
        }
        assert_eq!((0..3).map(|i| key(&d, i)).collect::<Vec<_>>(), [10, 20, 30]);
        assert_eq!(value_u64(&d, 1), 200);
        assert_eq!(lower_bound(&d, 25), Some(1));
        assert_eq!(lower_bound(&d, 9), None);
        assert_eq!(lower_bound(&d, 99), Some(2));
        remove_at(&mut d, 0);
        assert_eq!(nr_entries(&d), 2);
        assert_eq!((key(&d, 0), value_u64(&d, 0)), (20, 200));
        assert_eq!(key(&d, 2), 0, "stale slot cleared");
        assert!(check(0, &d, 24).is_err(), "a leaf of another tree");
    }

    #[test]
    fn damaged_headers_are_refused() {
        let mut d = vec![0u8; BLOCK_SIZE];
        init(&mut d, false, 8);
        assert!(check(3, &d, 24).is_err(), "an empty internal node");
        put_u32(&mut d, 16, 1);
        check(3, &d, 24).unwrap();
        put_u32(&mut d, 16, 253);
        assert!(check(3, &d, 24).is_err());
        put_u32(&mut d, 16, 1);
        put_u32(&mut d, 20, 1000);
        assert!(check(3, &d, 24).is_err());
        put_u32(&mut d, 20, 249);
        assert!(check(3, &d, 24).is_err(), "another size than the kernel's");
        put_u32(&mut d, 4, 3);
        assert!(check(3, &d, 24).is_err());
    }
}
