//! Every meaningful byte of every block of a valid thin pool, damaged one at a time (with
//! the checksum fixed up, and without): errors, never a panic. The fuzz target
//! `thin_metadata` explores further from the same start.

use std::panic::{catch_unwind, AssertUnwindSafe};

#[test]
fn damage_anywhere_in_a_pool_gives_errors_not_panics() {
    let mut tried = 0;
    // Header fields, keys, values, bitmap words: bytes that mean something.
    for at in [4u16, 16, 17, 20, 24, 32, 40, 100, 2048, 2100, 4000] {
        for block in 0..64u8 {
            for keep_checksum_broken in [0, 0x80] {
                let flip = 1u8 << ((block as u16 + at) % 8);
                let [lo, hi] = at.to_le_bytes();
                let edit = [block | keep_checksum_broken, lo, hi, flip];
                let outcome =
                    catch_unwind(AssertUnwindSafe(|| udm_fuzz::thin::thin_metadata(&edit)));
                assert!(outcome.is_ok(), "edit {edit:?} panics");
                tried += 1;
            }
        }
    }
    eprintln!("{tried} damaged pools, no panic");
}
