//! The metadata blocks in memory: verified copies of what is on disk (clean) and the blocks
//! written in this transaction (dirty), which reach the disk only at commit.
//!
//! Reads of a warm block cost a hash lookup: the pool looks up a mapping on every I/O.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use udm_block::{AlignedBuf, BlockDevice, WriteFlags};

use super::checksum::{seal, verify, Kind};
use super::error::{corrupt, Result};
use crate::BLOCK_SIZE;

pub type Block = [u8; BLOCK_SIZE];

/// Hashes block numbers (and device ids) with one multiplication (Fibonacci hashing):
/// SipHash's defence against chosen keys buys nothing for these, and its cost showed in
/// every lookup.
#[derive(Default, Clone, Copy)]
pub struct NumberHasher(u64);

impl Hasher for NumberHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(29) ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(n as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map keyed by block numbers or ids.
pub type NumberMap<K, V> = HashMap<K, V, BuildHasherDefault<NumberHasher>>;

/// Clean blocks kept by default: 256 MiB, the metadata of about 2 TiB mapped in 64 KiB blocks.
pub const DEFAULT_CACHE_BLOCKS: usize = 65_536;
/// The most blocks one write at commit carries.
const WRITE_RUN: usize = 256;

pub struct BlockCache {
    dev: Arc<dyn BlockDevice>,
    dev_blocks: u64,
    clean: NumberMap<u64, (Kind, Arc<Block>)>,
    dirty: NumberMap<u64, (Kind, Arc<Block>)>,
    capacity: usize,
    disk_reads: u64,
}

impl BlockCache {
    pub fn new(dev: Arc<dyn BlockDevice>) -> Self {
        let dev_blocks = dev.size() / BLOCK_SIZE as u64;
        BlockCache {
            dev,
            dev_blocks,
            clean: NumberMap::default(),
            dirty: NumberMap::default(),
            capacity: DEFAULT_CACHE_BLOCKS,
            disk_reads: 0,
        }
    }

    /// Whole 4 KiB blocks on the device.
    pub fn dev_blocks(&self) -> u64 {
        self.dev_blocks
    }

    /// Blocks read from the device so far (tests check that warm lookups read none).
    pub fn disk_reads(&self) -> u64 {
        self.disk_reads
    }

    pub fn set_capacity(&mut self, blocks: usize) {
        self.capacity = blocks.max(16);
        self.evict();
    }

    /// Reads one block from the device, unchecked.
    pub fn read_raw(&mut self, b: u64) -> Result<Box<Block>> {
        if b >= self.dev_blocks {
            return Err(corrupt(
                b,
                format!(
                    "beyond the end of the metadata device ({} blocks)",
                    self.dev_blocks
                ),
            ));
        }
        let mut buf = AlignedBuf::zeroed(BLOCK_SIZE);
        self.dev.read(b * BLOCK_SIZE as u64, &mut buf)?;
        self.disk_reads += 1;
        let mut block = Box::new([0u8; BLOCK_SIZE]);
        block.copy_from_slice(&buf);
        Ok(block)
    }

    /// Block `b` if it is in memory (which must be as a `kind`), without touching the disk.
    pub fn cached(&self, b: u64, kind: Kind) -> Result<Option<&Arc<Block>>> {
        let found = self.dirty.get(&b).or_else(|| self.clean.get(&b));
        match found {
            Some((cached_kind, block)) if *cached_kind == kind => Ok(Some(block)),
            // A block met again as another type: damage somewhere above it.
            Some((cached_kind, _)) => Err(corrupt(
                b,
                format!("is a {}, expected a {}", cached_kind.name(), kind.name()),
            )),
            None => Ok(None),
        }
    }

    /// Block `b`, which must be a `kind`: this transaction's version if it wrote one, else
    /// the (verified) one on disk.
    pub fn read(&mut self, b: u64, kind: Kind) -> Result<Arc<Block>> {
        if let Some(block) = self.cached(b, kind)? {
            return Ok(block.clone());
        }
        let block = self.read_raw(b)?;
        verify(kind, b, &block[..])?;
        let block: Arc<Block> = Arc::from(block);
        if self.clean.len() >= self.capacity {
            self.evict();
        }
        self.clean.insert(b, (kind, block.clone()));
        Ok(block)
    }

    fn evict(&mut self) {
        // Arbitrary victims (hash order): cheap, and hot blocks come back on their next use.
        let target = self.capacity - self.capacity / 8;
        if self.clean.len() <= target {
            return;
        }
        let excess = self.clean.len() - target;
        let victims: Vec<u64> = self.clean.keys().take(excess).copied().collect();
        for b in victims {
            self.clean.remove(&b);
        }
    }

    /// Makes `block` the content of `b` in this transaction.
    pub fn put(&mut self, b: u64, kind: Kind, block: Arc<Block>) {
        self.clean.remove(&b);
        self.dirty.insert(b, (kind, block));
    }

    /// The writable content of dirty block `b`.
    pub fn get_mut(&mut self, b: u64) -> &mut Block {
        let (_, block) = self
            .dirty
            .get_mut(&b)
            .unwrap_or_else(|| panic!("metadata block {b} written without being shadowed"));
        Arc::make_mut(block)
    }

    /// Forgets block `b` (it was freed).
    pub fn forget(&mut self, b: u64) {
        self.dirty.remove(&b);
        self.clean.remove(&b);
    }

    /// Forgets every dirty block (abort).
    pub fn discard_dirty(&mut self) {
        self.dirty.clear();
    }

    pub fn has_dirty(&self) -> bool {
        !self.dirty.is_empty()
    }

    /// Seals and writes every dirty block, in runs of consecutive blocks; they become clean.
    /// The caller flushes.
    pub fn write_dirty(&mut self) -> Result<()> {
        let mut blocks: Vec<u64> = self.dirty.keys().copied().collect();
        blocks.sort_unstable();
        let mut buf = AlignedBuf::zeroed(WRITE_RUN * BLOCK_SIZE);
        let mut start = 0;
        while start < blocks.len() {
            let mut end = start + 1;
            while end < blocks.len()
                && end - start < WRITE_RUN
                && blocks[end] == blocks[end - 1] + 1
            {
                end += 1;
            }
            for (i, &b) in blocks[start..end].iter().enumerate() {
                let (kind, block) = self.dirty.get_mut(&b).expect("dirty block");
                let kind = *kind;
                let block = Arc::make_mut(block);
                seal(kind, b, &mut block[..]);
                buf[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE].copy_from_slice(&block[..]);
            }
            let len = (end - start) * BLOCK_SIZE;
            self.dev.write(
                blocks[start] * BLOCK_SIZE as u64,
                &buf[..len],
                WriteFlags::default(),
            )?;
            start = end;
        }
        for (b, entry) in self.dirty.drain() {
            self.clean.insert(b, entry);
        }
        if self.clean.len() > self.capacity {
            self.evict();
        }
        Ok(())
    }

    /// Writes one block outside the dirty set (the superblock), then flushes.
    pub fn write_now(&mut self, b: u64, block: &Block) -> Result<()> {
        let mut buf = AlignedBuf::zeroed(BLOCK_SIZE);
        buf.copy_from_slice(block);
        self.dev
            .write(b * BLOCK_SIZE as u64, &buf, WriteFlags::default())?;
        self.dev.flush()?;
        Ok(())
    }

    pub fn flush(&self) -> Result<()> {
        self.dev.flush()?;
        Ok(())
    }
}
