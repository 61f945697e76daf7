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

use udm_block::{AlignedBuf, BlockDevice, BlockError, WriteFlags, SECTOR_SIZE};

use crate::block::{
    read_u64, seal, verify, write_u64, BlockType, MetadataError, BLOCK_SIZE, HEADER_SIZE,
};

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

fn read_blocks(dev: &dyn BlockDevice, first: u64, count: u64) -> Result<AlignedBuf, MetadataError> {
    let mut buf = AlignedBuf::zeroed((count as usize) * BLOCK_SIZE);
    dev.read(first * BLOCK_SIZE as u64, &mut buf)?;
    Ok(buf)
}

fn parse_superblock(number: u64, block: &[u8]) -> Result<Superblock, MetadataError> {
    verify(BlockType::CloneSuperblock, number, block)?;
    if &block[16..24] != MAGIC {
        return Err(MetadataError::Corrupt {
            block: number,
            what: "bad magic".into(),
        });
    }
    let version = u32::from_le_bytes(block[24..28].try_into().unwrap());
    if version != VERSION {
        return Err(MetadataError::Corrupt {
            block: number,
            what: format!("format version {version}, this udm reads {VERSION}"),
        });
    }
    Ok(Superblock {
        transaction: read_u64(block, 32),
        geometry: CloneGeometry {
            region_sectors: read_u64(block, 40),
            target_sectors: read_u64(block, 48),
        },
    })
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

    fn write_commit(
        &self,
        blocks: &BTreeSet<u64>,
        transaction: u64,
        slot: u64,
        flush_data: &dyn Fn() -> Result<(), BlockError>,
    ) -> Result<(), MetadataError> {
        let area = self.geometry.area_start(slot);
        // Encode first, then flush the data: every bit encoded was set after its data was
        // written, so the flush below makes that data durable before the bit is.
        let encoded: Vec<(u64, AlignedBuf)> = blocks
            .iter()
            .map(|&b| (b, self.encode_bitmap_block(area + b, b)))
            .collect();
        let hydrated = self.hydrated_count();
        flush_data()?;
        for run in contiguous_runs(&encoded) {
            let mut buf = AlignedBuf::zeroed(run.len() * BLOCK_SIZE);
            for (i, (_, block)) in run.iter().enumerate() {
                buf[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE].copy_from_slice(block);
            }
            self.dev.write(
                (area + run[0].0) * BLOCK_SIZE as u64,
                &buf,
                WriteFlags::default(),
            )?;
        }
        self.dev.flush()?;
        let sb = self.encode_superblock(slot, transaction, hydrated);
        self.dev
            .write(slot * BLOCK_SIZE as u64, &sb, WriteFlags::default())?;
        self.dev.flush()?;
        Ok(())
    }

    fn encode_bitmap_block(&self, number: u64, index: u64) -> AlignedBuf {
        let mut block = AlignedBuf::zeroed(BLOCK_SIZE);
        let first = index * WORDS_PER_BLOCK;
        for i in 0..WORDS_PER_BLOCK {
            let Some(word) = self.bits.get((first + i) as usize) else {
                break;
            };
            write_u64(
                &mut block,
                HEADER_SIZE + i as usize * 8,
                word.load(Ordering::Acquire),
            );
        }
        seal(BlockType::CloneBitmap, number, &mut block);
        block
    }

    fn encode_superblock(&self, slot: u64, transaction: u64, hydrated: u64) -> AlignedBuf {
        let g = self.geometry;
        let mut block = AlignedBuf::zeroed(BLOCK_SIZE);
        block[16..24].copy_from_slice(MAGIC);
        block[24..28].copy_from_slice(&VERSION.to_le_bytes());
        write_u64(&mut block, 32, transaction);
        write_u64(&mut block, 40, g.region_sectors);
        write_u64(&mut block, 48, g.target_sectors);
        write_u64(&mut block, 56, g.regions());
        write_u64(&mut block, 64, g.bitmap_blocks());
        write_u64(&mut block, 72, g.area_start(slot));
        write_u64(&mut block, 80, hydrated);
        seal(BlockType::CloneSuperblock, slot, &mut block);
        block
    }

    /// Writes an empty bitmap to area A and superblock A (transaction 1).
    fn format(&self) -> Result<(), MetadataError> {
        let blocks = self.geometry.bitmap_blocks();
        let mut area = AlignedBuf::zeroed(blocks as usize * BLOCK_SIZE);
        for b in 0..blocks {
            let block = self.encode_bitmap_block(self.geometry.area_start(0) + b, b);
            area[(b as usize) * BLOCK_SIZE..(b as usize + 1) * BLOCK_SIZE].copy_from_slice(&block);
        }
        self.dev.write(
            self.geometry.area_start(0) * BLOCK_SIZE as u64,
            &area,
            WriteFlags::default(),
        )?;
        self.dev.flush()?;
        let sb = self.encode_superblock(0, 1, 0);
        self.dev.write(0, &sb, WriteFlags::default())?;
        self.dev.flush()?;
        let mut st = self.state.lock();
        st.transaction = 1;
        st.slot = 0;
        // Area B has never been written: the first commit must write all of it.
        st.previous = (0..blocks).collect();
        st.dirty.clear();
        Ok(())
    }

    /// Reads the last durable commit into memory (at open, and to abort after a failed
    /// commit). Changes since that commit are dropped.
    pub fn load(&self) -> Result<(), MetadataError> {
        *self.fallback.lock() = None;
        let supers = read_blocks(&*self.dev, 0, SUPERBLOCKS)?;
        let parsed: Vec<_> = (0..SUPERBLOCKS)
            .map(|slot| {
                parse_superblock(
                    slot,
                    &supers[slot as usize * BLOCK_SIZE..(slot as usize + 1) * BLOCK_SIZE],
                )
            })
            .collect();
        let (slot, current) = match (&parsed[0], &parsed[1]) {
            (Ok(a), Ok(b)) if b.transaction > a.transaction => (1, b),
            (Ok(a), Ok(_)) => (0, a),
            (Ok(a), Err(e)) => (0, self.fall_back(0, a, 1, e, &supers)),
            (Err(e), Ok(b)) => (1, self.fall_back(1, b, 0, e, &supers)),
            (Err(a), Err(b)) => {
                return Err(MetadataError::Corrupt {
                    block: 0,
                    what: format!(
                        "no valid clone superblock (slot 0: {a}; slot 1: {b}) on a device \
                         that has been committed to; refusing to use or reformat it"
                    ),
                })
            }
        };
        if current.geometry != self.geometry {
            return Err(MetadataError::Mismatch(format!(
                "metadata was made for region size {} and length {} sectors, but the table \
                 says region size {} and length {}",
                current.geometry.region_sectors,
                current.geometry.target_sectors,
                self.geometry.region_sectors,
                self.geometry.target_sectors
            )));
        }
        let other_valid = parsed[(1 - slot) as usize].is_ok();
        let (words, previous) = self.read_area(slot, other_valid)?;
        // The bits and their count change together, under the lock `set_hydrated` takes.
        let mut st = self.state.lock();
        for (word, value) in self.bits.iter().zip(&words) {
            word.store(*value, Ordering::Release);
        }
        let hydrated = words.iter().map(|w| w.count_ones() as u64).sum();
        self.hydrated.store(hydrated, Ordering::Release);
        st.transaction = current.transaction;
        st.slot = slot;
        st.previous = previous;
        st.dirty.clear();
        Ok(())
    }

    /// The bitmap words of the area `slot` names, and the blocks the other area lacks (all of
    /// them when the other slot is not valid): the next commit writes the other area.
    fn read_area(
        &self,
        slot: u64,
        other_valid: bool,
    ) -> Result<(Vec<u64>, BTreeSet<u64>), MetadataError> {
        let blocks = self.geometry.bitmap_blocks();
        let area = read_blocks(&*self.dev, self.geometry.area_start(slot), blocks)?;
        let other = read_blocks(&*self.dev, self.geometry.area_start(1 - slot), blocks)?;
        let mut previous = BTreeSet::new();
        let mut words = Vec::with_capacity(self.bits.len());
        let regions = self.regions();
        for b in 0..blocks {
            let range = (b as usize) * BLOCK_SIZE..(b as usize + 1) * BLOCK_SIZE;
            let block = &area[range.clone()];
            verify(
                BlockType::CloneBitmap,
                self.geometry.area_start(slot) + b,
                block,
            )?;
            if !other_valid || other[range.start + HEADER_SIZE..range.end] != block[HEADER_SIZE..] {
                previous.insert(b);
            }
            for i in 0..WORDS_PER_BLOCK {
                let index = b * WORDS_PER_BLOCK + i;
                if index as usize >= self.bits.len() {
                    break;
                }
                let mut value = read_u64(block, HEADER_SIZE + i as usize * 8);
                // Bits past the last region carry no meaning; keep them clear.
                let first_region = index * 64;
                if first_region + 64 > regions {
                    value &= (1u64 << (regions - first_region)) - 1;
                }
                words.push(value);
            }
        }
        Ok((words, previous))
    }
}

impl CloneMetadata {
    /// Uses the valid slot when the other is not valid, and says so unless the other was
    /// simply never written (slot 1 before the first commit). A torn superblock from a crash
    /// mid-commit lands here too, and then nothing acknowledged was lost; a newer slot
    /// damaged after its commit completed means the changes of that commit are gone. Which
    /// of the two it was cannot be told from the disk, so the fallback is always reported.
    fn fall_back<'s>(
        &self,
        used: u64,
        current: &'s Superblock,
        bad: u64,
        why: &MetadataError,
        supers: &[u8],
    ) -> &'s Superblock {
        let block = &supers[bad as usize * BLOCK_SIZE..(bad as usize + 1) * BLOCK_SIZE];
        if block.iter().all(|&x| x == 0) {
            return current;
        }
        // Unverified, but the best hint of how much was lost.
        let claimed = (&block[16..24] == MAGIC).then(|| read_u64(block, 32));
        let fallback = SuperblockFallback {
            used_slot: used,
            used_transaction: current.transaction,
            bad_slot: bad,
            bad_slot_claims_transaction: claimed,
            reason: why.to_string(),
        };
        log::warn!("clone metadata: {fallback}");
        *self.fallback.lock() = Some(fallback);
        current
    }

    /// Set when the last open or reload had to use the older superblock slot.
    pub fn fallback(&self) -> Option<SuperblockFallback> {
        self.fallback.lock().clone()
    }
}

/// What `udm status --json` and the log say when the newest superblock was unusable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SuperblockFallback {
    pub used_slot: u64,
    pub used_transaction: u64,
    pub bad_slot: u64,
    /// The transaction id the bad slot's (unverified) bytes carry, if it still has our magic.
    pub bad_slot_claims_transaction: Option<u64>,
    pub reason: String,
}

impl std::fmt::Display for SuperblockFallback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "superblock slot {} is invalid ({}",
            self.bad_slot, self.reason
        )?;
        if let Some(t) = self.bad_slot_claims_transaction {
            write!(f, "; it claims transaction {t}")?;
        }
        write!(
            f,
            "); using slot {} at transaction {}: a commit after it, if one completed, is lost",
            self.used_slot, self.used_transaction
        )
    }
}

fn contiguous_runs(blocks: &[(u64, AlignedBuf)]) -> Vec<&[(u64, AlignedBuf)]> {
    let mut runs = Vec::new();
    let mut start = 0;
    for i in 1..=blocks.len() {
        if i == blocks.len() || blocks[i].0 != blocks[i - 1].0 + 1 {
            runs.push(&blocks[start..i]);
            start = i;
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;
    use udm_block::MemoryDevice;

    fn geometry(regions: u64) -> CloneGeometry {
        CloneGeometry {
            region_sectors: 8,
            target_sectors: regions * 8 - 3,
        }
    }

    fn no_data() -> Result<(), BlockError> {
        Ok(())
    }

    /// A reload racing with regions being marked must keep the count equal to the bits set:
    /// a count above them would make an unfinished clone look complete.
    #[test]
    fn the_count_matches_the_bits_whatever_a_reload_races_with() {
        let dev: Arc<dyn BlockDevice> = Arc::new(MemoryDevice::new(4 << 20));
        let regions = 20_000;
        let meta = CloneMetadata::open(dev, geometry(regions)).unwrap();
        let stop = std::sync::atomic::AtomicBool::new(false);
        let most = std::thread::scope(|s| {
            let marker = s.spawn(|| {
                let mut most = 0;
                while !stop.load(Ordering::Relaxed) {
                    meta.set_hydrated(0..regions);
                    most = most.max(meta.hydrated_count());
                }
                most
            });
            let started = std::time::Instant::now();
            while started.elapsed() < std::time::Duration::from_millis(500) {
                meta.load().unwrap();
            }
            stop.store(true, Ordering::Relaxed);
            marker.join().unwrap()
        });
        assert!(most <= regions, "counted {most} of {regions} regions");
        let set = (0..regions).filter(|&r| meta.is_hydrated(r)).count() as u64;
        assert_eq!(meta.hydrated_count(), set);
    }

    #[test]
    fn formats_a_blank_device_and_reopens_committed_bits() {
        let dev: Arc<dyn BlockDevice> = Arc::new(MemoryDevice::new(4 << 20));
        let g = geometry(100_000);
        let meta = CloneMetadata::open(dev.clone(), g).unwrap();
        assert_eq!(meta.hydrated_count(), 0);
        assert_eq!(meta.set_hydrated(5..10), 5);
        assert_eq!(meta.set_hydrated(8..12), 2);
        meta.set_hydrated(99_999..100_000);
        assert_eq!(meta.commit(&no_data).unwrap(), CommitOutcome::Committed);
        assert_eq!(
            meta.commit(&no_data).unwrap(),
            CommitOutcome::NothingToCommit
        );
        meta.set_hydrated(50_000..50_001);
        // Not committed: lost on reopen.
        let again = CloneMetadata::open(dev, g).unwrap();
        assert_eq!(again.hydrated_count(), 8);
        assert!(again.is_hydrated(5) && again.is_hydrated(11) && again.is_hydrated(99_999));
        assert!(!again.is_hydrated(4) && !again.is_hydrated(12) && !again.is_hydrated(50_000));
    }

    #[test]
    fn alternating_commits_keep_both_areas_consistent() {
        let dev: Arc<dyn BlockDevice> = Arc::new(MemoryDevice::new(4 << 20));
        let g = geometry(200_000);
        let meta = CloneMetadata::open(dev.clone(), g).unwrap();
        // Each commit touches a different bitmap block; reopening after each must see all.
        for round in 0..6u64 {
            meta.set_hydrated(round * 33_000..round * 33_000 + 3);
            meta.commit(&no_data).unwrap();
            let reopened = CloneMetadata::open(dev.clone(), g).unwrap();
            assert_eq!(reopened.hydrated_count(), (round + 1) * 3, "round {round}");
            assert_eq!(reopened.transaction(), round + 2);
        }
    }

    #[test]
    fn refuses_mismatched_small_and_garbage_devices() {
        let dev: Arc<dyn BlockDevice> = Arc::new(MemoryDevice::new(4 << 20));
        CloneMetadata::open(dev.clone(), geometry(1000)).unwrap();
        let err = CloneMetadata::open(
            dev.clone(),
            CloneGeometry {
                region_sectors: 16,
                target_sectors: 8000 - 3,
            },
        )
        .err()
        .unwrap();
        assert!(err.to_string().contains("made for region size 8"), "{err}");
        let tiny: Arc<dyn BlockDevice> = Arc::new(MemoryDevice::new(8192));
        let err = CloneMetadata::open(tiny, geometry(1000)).err().unwrap();
        assert!(
            err.to_string().contains("metadata device too small"),
            "{err}"
        );
        let garbage = MemoryDevice::new(1 << 20);
        garbage
            .write(0, &[0xab; 512], WriteFlags::default())
            .unwrap();
        let err = CloneMetadata::open(Arc::new(garbage), geometry(1000))
            .err()
            .unwrap();
        assert!(err.to_string().contains("refusing to format"), "{err}");
    }

    #[test]
    fn a_torn_superblock_falls_back_to_the_previous_commit() {
        let dev = Arc::new(MemoryDevice::new(4 << 20));
        let g = geometry(1000);
        let meta = CloneMetadata::open(dev.clone(), g).unwrap();
        meta.set_hydrated(0..10);
        meta.commit(&no_data).unwrap(); // transaction 2 in slot B
        meta.set_hydrated(10..20);
        meta.commit(&no_data).unwrap(); // transaction 3 in slot A
        dev.write(100, &[0xff; 512], WriteFlags::default()).unwrap(); // tear slot A
        let reopened = CloneMetadata::open(dev, g).unwrap();
        assert_eq!(reopened.transaction(), 2);
        assert_eq!(reopened.hydrated_count(), 10);
        let fallback = reopened.fallback().expect("the fallback is reported");
        assert_eq!(
            (
                fallback.used_slot,
                fallback.used_transaction,
                fallback.bad_slot
            ),
            (1, 2, 0)
        );
        assert_eq!(fallback.bad_slot_claims_transaction, Some(3));
        assert!(
            fallback.to_string().contains("claims transaction 3"),
            "{fallback}"
        );
    }

    /// Flips a byte inside a block's checksummed part, keeping the magic.
    fn corrupt(dev: &MemoryDevice, block: u64) {
        let mut buf = AlignedBuf::zeroed(BLOCK_SIZE);
        dev.read(block * BLOCK_SIZE as u64, &mut buf).unwrap();
        buf[200] ^= 0xff;
        dev.write(block * BLOCK_SIZE as u64, &buf, WriteFlags::default())
            .unwrap();
    }

    #[test]
    fn both_superblocks_corrupt_after_a_commit_are_refused_not_reformatted() {
        let dev = Arc::new(MemoryDevice::new(4 << 20));
        let g = geometry(1000);
        let meta = CloneMetadata::open(dev.clone(), g).unwrap();
        meta.set_hydrated(0..10);
        meta.commit(&no_data).unwrap();
        corrupt(&dev, 0);
        corrupt(&dev, 1);
        let err = CloneMetadata::open(dev.clone(), g).err().unwrap();
        assert!(
            err.to_string().contains("refusing to use or reformat"),
            "{err}"
        );
        // Nothing was written: the bitmap committed in slot 1's area is still there.
        let mut area = AlignedBuf::zeroed(BLOCK_SIZE);
        dev.read(g.area_start(1) * BLOCK_SIZE as u64, &mut area)
            .unwrap();
        assert_eq!(read_u64(&area, HEADER_SIZE), (1 << 10) - 1);
    }

    #[test]
    fn an_intact_older_slot_is_not_a_fallback() {
        let dev = Arc::new(MemoryDevice::new(4 << 20));
        let g = geometry(1000);
        CloneMetadata::open(dev.clone(), g).unwrap();
        // Formatted, never committed: slot 1 is blank, which is no loss.
        assert!(CloneMetadata::open(dev.clone(), g)
            .unwrap()
            .fallback()
            .is_none());
        let meta = CloneMetadata::open(dev.clone(), g).unwrap();
        meta.set_hydrated(0..1);
        meta.commit(&no_data).unwrap();
        assert!(CloneMetadata::open(dev, g).unwrap().fallback().is_none());
    }

    #[test]
    fn a_format_torn_before_any_commit_is_redone() {
        let dev = Arc::new(MemoryDevice::new(4 << 20));
        let g = geometry(1000);
        CloneMetadata::open(dev.clone(), g).unwrap();
        corrupt(&dev, 0);
        let meta = CloneMetadata::open(dev.clone(), g).unwrap();
        assert_eq!((meta.transaction(), meta.hydrated_count()), (1, 0));
    }

    #[test]
    fn a_failed_data_flush_commits_nothing_and_keeps_changes_pending() {
        let dev: Arc<dyn BlockDevice> = Arc::new(MemoryDevice::new(4 << 20));
        let g = geometry(1000);
        let meta = CloneMetadata::open(dev.clone(), g).unwrap();
        meta.set_hydrated(0..4);
        let failing = || Err(BlockError::Io("destination flush failed".into()));
        assert!(meta.commit(&failing).is_err());
        assert!(meta.is_dirty());
        assert_eq!(
            CloneMetadata::open(dev.clone(), g)
                .unwrap()
                .hydrated_count(),
            0
        );
        meta.commit(&no_data).unwrap();
        assert_eq!(CloneMetadata::open(dev, g).unwrap().hydrated_count(), 4);
    }

    #[test]
    fn next_unhydrated_wraps_and_skips_hydrated_words() {
        let dev: Arc<dyn BlockDevice> = Arc::new(MemoryDevice::new(1 << 20));
        let meta = CloneMetadata::open(dev, geometry(300)).unwrap();
        meta.set_hydrated(0..200);
        assert_eq!(meta.next_unhydrated(0), Some(200));
        assert_eq!(meta.next_unhydrated(250), Some(250));
        meta.set_hydrated(200..300);
        assert_eq!(meta.next_unhydrated(0), None);
        let dev: Arc<dyn BlockDevice> = Arc::new(MemoryDevice::new(1 << 20));
        let meta = CloneMetadata::open(dev, geometry(300)).unwrap();
        meta.set_hydrated(10..300);
        assert_eq!(meta.next_unhydrated(100), Some(0));
    }
}
