//! The clone target's metadata: which regions are hydrated, committed crash-safely.
//!
//! Layout of the metadata device (4 KiB blocks; `docs/clone-metadata.md` has every byte):
//!
//! | block | contents |
//! |---|---|
//! | 0, 1 | superblock slots A and B |
//! | 2 … 2+B-1 | bitmap area A (B blocks) |
//! | 2+B … 2+2B-1 | bitmap area B |
//!
//! The slot with the highest valid transaction id is current and names its area. A commit
//! writes the other area (the blocks changed since that area was last written), flushes,
//! writes the other slot's superblock with the next transaction id, and flushes again. A crash
//! at any point leaves the current slot and its area untouched, so the last durable commit is
//! always readable; a torn superblock fails its checksum and the older slot wins.
//!
//! Concurrency contract ([`CloneMetadata`] is shared by every request and copy thread):
//! - `is_hydrated`, `hydrated_count` and `next_unhydrated` read atomics, without a lock, on
//!   every request.
//! - `set_hydrated` and `load` change the bits and their count together under one lock: the
//!   count always equals the bits set. A caller sets a region's bit only once the region's
//!   data is on the destination.
//! - `commit` runs one at a time. It takes the changed blocks, then encodes them and flushes
//!   the data device before writing them, so a bit set while it runs is in this commit or the
//!   next, never described before its data is durable.
//! - `load` replaces the bits with the last commit's, dropping what was set since: the caller
//!   stops whatever sets bits it would lose (the clone goes read-only first).

use parking_lot::Mutex;
use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use udm_block::{BlockDevice, BlockError, SECTOR_SIZE};

use crate::block::{MetadataError, BLOCK_SIZE, HEADER_SIZE};

mod disk;

pub use disk::SuperblockFallback;
use disk::{parse_superblock, read_blocks};

const MAGIC: &[u8; 8] = b"udmclone";
const VERSION: u32 = 1;
/// 64-bit words of bitmap in one block after its header.
const WORDS_PER_BLOCK: u64 = ((BLOCK_SIZE - HEADER_SIZE) / 8) as u64;
const SUPERBLOCKS: u64 = 2;

/// The table's view of the volume, which the metadata must match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CloneGeometry {
    pub region_sectors: u64,
    pub target_sectors: u64,
}

impl CloneGeometry {
    pub fn regions(&self) -> u64 {
        self.target_sectors.div_ceil(self.region_sectors)
    }
    fn words(&self) -> u64 {
        self.regions().div_ceil(64)
    }
    pub fn bitmap_blocks(&self) -> u64 {
        self.words().div_ceil(WORDS_PER_BLOCK).max(1)
    }
    /// Blocks the format needs: two superblocks and two bitmap areas.
    pub fn required_blocks(&self) -> u64 {
        SUPERBLOCKS + 2 * self.bitmap_blocks()
    }
    fn area_start(&self, slot: u64) -> u64 {
        SUPERBLOCKS + slot * self.bitmap_blocks()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitOutcome {
    Committed,
    /// Nothing changed since the last commit; nothing was written (the caller still owes its
    /// data device a flush).
    NothingToCommit,
}

struct CommitState {
    /// Bitmap blocks changed since the last commit.
    dirty: BTreeSet<u64>,
    /// Blocks the last commit wrote: the other area lacks them, so the next commit (which
    /// writes that area) must write them too.
    previous: BTreeSet<u64>,
    transaction: u64,
    slot: u64,
}

pub struct CloneMetadata {
    dev: Arc<dyn BlockDevice>,
    geometry: CloneGeometry,
    /// One bit per region, read lock-free on every I/O.
    bits: Vec<AtomicU64>,
    hydrated: AtomicU64,
    state: Mutex<CommitState>,
    /// One commit at a time; I/O never takes it.
    commit_lock: Mutex<()>,
    fallback: Mutex<Option<SuperblockFallback>>,
}

struct Superblock {
    transaction: u64,
    geometry: CloneGeometry,
}

impl CloneMetadata {
    /// Opens the metadata on `dev`, formatting it if it is blank (both superblock slots all
    /// zero). Refuses a device that is too small, holds metadata for another geometry, or is
    /// neither blank nor valid.
    pub fn open(dev: Arc<dyn BlockDevice>, geometry: CloneGeometry) -> Result<Self, MetadataError> {
        let need = geometry.required_blocks() * BLOCK_SIZE as u64;
        if dev.size() < need {
            return Err(MetadataError::Mismatch(format!(
                "metadata device too small: {} regions need {} sectors ({} blocks of 4 KiB), \
                 the device has {} sectors",
                geometry.regions(),
                need / SECTOR_SIZE,
                geometry.required_blocks(),
                dev.size() / SECTOR_SIZE
            )));
        }
        let words = geometry.words() as usize;
        let meta = CloneMetadata {
            dev,
            geometry,
            bits: (0..words).map(|_| AtomicU64::new(0)).collect(),
            hydrated: AtomicU64::new(0),
            state: Mutex::new(CommitState {
                dirty: BTreeSet::new(),
                previous: BTreeSet::new(),
                transaction: 0,
                slot: 0,
            }),
            commit_lock: Mutex::new(()),
            fallback: Mutex::new(None),
        };
        let supers = read_blocks(&*meta.dev, 0, SUPERBLOCKS)?;
        let slots: Vec<&[u8]> = supers.chunks(BLOCK_SIZE).collect();
        let any_valid = slots
            .iter()
            .enumerate()
            .any(|(n, b)| parse_superblock(n as u64, b).is_ok());
        // Formatting writes slot 0 only; the first commit is the first write of slot 1. So
        // while slot 1 is all zero no commit ever completed, no bit was ever durable, and a
        // slot 0 that is blank or a torn superblock of ours (our magic in its first sector)
        // is an interrupted format, safe to redo. Once slot 1 was written, a device without a
        // valid superblock has lost committed state and is refused, never reformatted.
        let never_committed = slots[1].iter().all(|&x| x == 0);
        let slot0_blank_or_ours = slots[0].iter().all(|&x| x == 0) || &slots[0][16..24] == MAGIC;
        match (any_valid, never_committed, slot0_blank_or_ours) {
            (false, true, true) => meta.format()?,
            (false, true, false) => {
                return Err(MetadataError::Corrupt {
                    block: 0,
                    what: "neither blank nor clone metadata; refusing to format it".into(),
                })
            }
            _ => meta.load()?,
        }
        Ok(meta)
    }

    pub fn geometry(&self) -> CloneGeometry {
        self.geometry
    }

    pub fn regions(&self) -> u64 {
        self.geometry.regions()
    }

    /// Blocks the format uses and blocks the device has (the status line's used/total).
    pub fn blocks_used_and_total(&self) -> (u64, u64) {
        (
            self.geometry.required_blocks(),
            self.dev.size() / BLOCK_SIZE as u64,
        )
    }

    pub fn is_hydrated(&self, region: u64) -> bool {
        self.bits[(region / 64) as usize].load(Ordering::Acquire) & (1 << (region % 64)) != 0
    }

    pub fn hydrated_count(&self) -> u64 {
        self.hydrated.load(Ordering::Acquire)
    }

    pub fn transaction(&self) -> u64 {
        self.state.lock().transaction
    }

    /// Marks regions hydrated (their data must already be on the destination). Returns how
    /// many were not hydrated before.
    pub fn set_hydrated(&self, regions: Range<u64>) -> u64 {
        // Under the state lock, so that a reload never replaces the bits between a bit being
        // set and its count.
        let mut st = self.state.lock();
        let mut newly = 0;
        for region in regions {
            let word = region / 64;
            let bit = 1u64 << (region % 64);
            if self.bits[word as usize].fetch_or(bit, Ordering::AcqRel) & bit == 0 {
                newly += 1;
                st.dirty.insert(word / WORDS_PER_BLOCK);
            }
        }
        self.hydrated.fetch_add(newly, Ordering::AcqRel);
        newly
    }

    pub fn is_dirty(&self) -> bool {
        !self.state.lock().dirty.is_empty()
    }

    /// The first unhydrated region at or after `from`, wrapping around once.
    pub fn next_unhydrated(&self, from: u64) -> Option<u64> {
        let regions = self.regions();
        if regions == 0 || self.hydrated_count() >= regions {
            return None;
        }
        let from = from % regions;
        let scan = |range: Range<u64>| -> Option<u64> {
            let mut region = range.start;
            while region < range.end {
                let word = self.bits[(region / 64) as usize].load(Ordering::Acquire);
                let free = !word & (!0u64 << (region % 64));
                if free != 0 {
                    let found = (region & !63) + free.trailing_zeros() as u64;
                    return (found < range.end).then_some(found);
                }
                region = (region & !63) + 64;
            }
            None
        };
        scan(from..regions).or_else(|| scan(0..from))
    }

    /// Makes every bit set so far durable: snapshots the changed bitmap blocks, calls
    /// `flush_data` (the destination: data must be durable before the bits that describe
    /// it), writes the blocks to the other area, flushes, writes that slot's superblock and
    /// flushes again. On failure the changes stay pending and the last commit stays current.
    pub fn commit(
        &self,
        flush_data: &dyn Fn() -> Result<(), BlockError>,
    ) -> Result<CommitOutcome, MetadataError> {
        let _one_at_a_time = self.commit_lock.lock();
        let (committing, blocks, transaction, slot) = {
            let mut st = self.state.lock();
            if st.dirty.is_empty() {
                return Ok(CommitOutcome::NothingToCommit);
            }
            let committing = std::mem::take(&mut st.dirty);
            let blocks: BTreeSet<u64> = committing.union(&st.previous).copied().collect();
            (committing, blocks, st.transaction + 1, 1 - st.slot)
        };
        let result = self.write_commit(&blocks, transaction, slot, flush_data);
        let mut st = self.state.lock();
        match result {
            Ok(()) => {
                st.previous = committing;
                st.transaction = transaction;
                st.slot = slot;
                Ok(CommitOutcome::Committed)
            }
            Err(e) => {
                st.dirty.extend(committing);
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests;
