//! Deterministic test data.

use std::path::Path;

use udm_block::AlignedBuf;

/// xorshift64: fast and deterministic, to vary test data and a test's choices.
pub struct Rng(u64);

impl Rng {
    /// Different seeds, even neighbouring ones, give unrelated sequences.
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    #[allow(clippy::should_implement_trait)] // not an iterator: it never ends
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A number below `n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            chunk.copy_from_slice(&self.next().to_le_bytes()[..chunk.len()]);
        }
    }
}

/// `len` bytes that depend on `seed` and the position, so misplaced data is caught.
pub fn pattern(len: usize, seed: u64) -> AlignedBuf {
    let mut buf = AlignedBuf::zeroed(len);
    Rng::new(seed).fill(&mut buf);
    buf
}

/// A file of `len` bytes of [`pattern`].
pub fn pattern_file(path: &Path, len: usize, seed: u64) {
    std::fs::write(path, &pattern(len, seed)[..]).unwrap();
}
