//! Space maps: a reference count for every data block and every metadata block
//! (K:`pd/dm-space-map-common.c`, `dm-space-map-disk.c`, `dm-space-map-metadata.c`).
//!
//! On disk a space map is bitmaps of two-bit counts ([`bitmap`]), an index of the bitmaps
//! ([`index`]: a B-tree for data, one block for metadata) and a B-tree of the counts of 3 and
//! more. In memory, [`SpaceMap`] holds the index, the bitmaps it has read (decoded) and every
//! overflow count, and records each change since the last commit: the old count is what makes
//! a block freed in this transaction unusable until the commit (a crash must find the old trees
//! intact), and the set of changed bitmaps is what the commit writes ([`disk`], [`metadata`]).

pub mod bitmap;
pub mod disk;
pub mod index;
pub mod metadata;

use std::collections::{BTreeMap, BTreeSet};

use self::bitmap::{Words, ENTRIES_PER_BITMAP};
use self::index::IndexEntry;
use super::cache::{BlockCache, NumberMap};
use super::checksum::Kind;
use super::error::{corrupt, Result, ThinError};
use super::superblock::SmRoot;

/// Which device a space map counts (for error messages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SmKind {
    Data,
    Metadata,
}

/// One bitmap of the map.
pub struct Bitmap {
    /// Where the bitmap block is; 0 until the first commit writes a new bitmap.
    pub location: u64,
    pub nr_free: u32,
    pub none_free_before: u32,
    /// Decoded entries, read on first use.
    words: Option<Box<Words>>,
    /// Changed since the last commit.
    pub dirty: bool,
}

impl Bitmap {
    fn fresh() -> Self {
        Bitmap {
            location: 0,
            nr_free: ENTRIES_PER_BITMAP as u32,
            none_free_before: 0,
            words: Some(Box::new([0; bitmap::WORDS])),
            dirty: true,
        }
    }

    fn on_disk(entry: IndexEntry) -> Self {
        Bitmap {
            location: entry.blocknr,
            nr_free: entry.nr_free,
            none_free_before: entry.none_free_before,
            words: None,
            dirty: false,
        }
    }

    pub fn index_entry(&self) -> IndexEntry {
        IndexEntry {
            blocknr: self.location,
            nr_free: self.nr_free,
            none_free_before: self.none_free_before,
        }
    }

    /// The decoded entries (loaded: every dirty bitmap is).
    pub fn words(&self) -> &Words {
        self.words.as_ref().expect("bitmap loaded")
    }
}

pub struct SpaceMap {
    kind: SmKind,
    nr_blocks: u64,
    nr_allocated: u64,
    pub bitmaps: Vec<Bitmap>,
    /// Every count of 3 or more (the bitmap says 3).
    overflow: BTreeMap<u64, u32>,
    /// Blocks whose overflow entry changed since the last commit.
    pub overflow_dirty: BTreeSet<u64>,
    /// Bitmaps changed for the first time since the last commit, whose new block the
    /// transaction has not taken yet ([`SpaceMap::take_newly_dirty`]).
    newly_dirty: Vec<usize>,
    /// Counts at the last commit of the blocks changed since.
    undo: NumberMap<u64, u32>,
    /// Blocks free now that were in use at the last commit: not usable before the next.
    freed_here: u64,
    /// Where the next search for a free block starts (the kernel's linear scan).
    cursor: u64,
    /// Data: root of the index tree. Metadata: the index block.
    pub bitmap_root: u64,
    pub ref_count_root: u64,
}

impl SpaceMap {
    /// An empty map over no blocks (grown with [`SpaceMap::extend`]).
    pub fn new(kind: SmKind) -> Self {
        SpaceMap {
            kind,
            nr_blocks: 0,
            nr_allocated: 0,
            bitmaps: Vec::new(),
            overflow: BTreeMap::new(),
            overflow_dirty: BTreeSet::new(),
            newly_dirty: Vec::new(),
            undo: NumberMap::default(),
            freed_here: 0,
            cursor: 0,
            bitmap_root: 0,
            ref_count_root: 0,
        }
    }

    /// A committed map: its root and index entries, and its overflow counts.
    pub fn committed(
        kind: SmKind,
        root: &SmRoot,
        entries: Vec<IndexEntry>,
        overflow: BTreeMap<u64, u32>,
    ) -> Self {
        SpaceMap {
            kind,
            nr_blocks: root.nr_blocks,
            nr_allocated: root.nr_allocated,
            bitmaps: entries.into_iter().map(Bitmap::on_disk).collect(),
            overflow,
            overflow_dirty: BTreeSet::new(),
            newly_dirty: Vec::new(),
            undo: NumberMap::default(),
            freed_here: 0,
            cursor: 0,
            bitmap_root: root.bitmap_root,
            ref_count_root: root.ref_count_root,
        }
    }

    pub fn nr_blocks(&self) -> u64 {
        self.nr_blocks
    }

    pub fn nr_allocated(&self) -> u64 {
        self.nr_allocated
    }

    pub fn nr_free(&self) -> u64 {
        self.nr_blocks.saturating_sub(self.nr_allocated)
    }

    /// Free blocks this transaction may take (those freed in it wait for the commit).
    pub fn nr_usable(&self) -> u64 {
        self.nr_free().saturating_sub(self.freed_here)
    }

    pub fn root(&self) -> SmRoot {
        SmRoot {
            nr_blocks: self.nr_blocks,
            nr_allocated: self.nr_allocated,
            bitmap_root: self.bitmap_root,
            ref_count_root: self.ref_count_root,
        }
    }

    pub fn overflow_count(&self, b: u64) -> Option<u32> {
        self.overflow.get(&b).copied()
    }

    /// Bitmaps needed for `nr_blocks` blocks.
    pub fn bitmaps_for(nr_blocks: u64) -> usize {
        nr_blocks.div_ceil(ENTRIES_PER_BITMAP) as usize
    }

    /// Grows the map to `nr_blocks` with new, empty bitmaps.
    pub fn extend(&mut self, nr_blocks: u64) {
        assert!(nr_blocks >= self.nr_blocks, "space maps only grow");
        let need = Self::bitmaps_for(nr_blocks);
        while self.bitmaps.len() < need {
            self.newly_dirty.push(self.bitmaps.len());
            self.bitmaps.push(Bitmap::fresh());
        }
        self.nr_blocks = nr_blocks;
    }

    fn out_of_range(&self, b: u64) -> ThinError {
        match self.kind {
            SmKind::Metadata => corrupt(
                b,
                format!("beyond the metadata space map ({} blocks)", self.nr_blocks),
            ),
            SmKind::Data => ThinError::BadArgument(format!(
                "data block {b} is beyond the data device ({} blocks)",
                self.nr_blocks
            )),
        }
    }

    fn place(&self, b: u64) -> Result<(usize, usize)> {
        if b >= self.nr_blocks {
            return Err(self.out_of_range(b));
        }
        Ok((
            (b / ENTRIES_PER_BITMAP) as usize,
            (b % ENTRIES_PER_BITMAP) as usize,
        ))
    }

    fn load(&mut self, k: usize, cache: &mut BlockCache) -> Result<()> {
        let bm = &mut self.bitmaps[k];
        if bm.words.is_none() {
            let block = cache.read(bm.location, Kind::Bitmap)?;
            let words = bitmap::decode(&block[..]);
            // Recounted: the index entry's figures are hints another writer may have left loose.
            bm.nr_free = bitmap::count_free(&words);
            bm.none_free_before =
                bitmap::find_free(&words, 0, ENTRIES_PER_BITMAP as usize, |_| true)
                    .unwrap_or(ENTRIES_PER_BITMAP as usize) as u32;
            bm.words = Some(words);
        }
        Ok(())
    }

    /// Reads every bitmap (the metadata map keeps them all: its changes must not read), and
    /// counts the blocks in use from them.
    pub fn load_all(&mut self, cache: &mut BlockCache) -> Result<()> {
        (0..self.bitmaps.len()).try_for_each(|k| self.load(k, cache))?;
        let free: u64 = self.bitmaps.iter().map(|b| b.nr_free as u64).sum();
        // Slots past the end of the last bitmap count as free and are never used.
        let past_end = self.bitmaps.len() as u64 * ENTRIES_PER_BITMAP - self.nr_blocks;
        self.nr_allocated = self.nr_blocks.saturating_sub(free.saturating_sub(past_end));
        Ok(())
    }

    pub fn count(&mut self, b: u64, cache: &mut BlockCache) -> Result<u32> {
        let (k, j) = self.place(b)?;
        self.load(k, cache)?;
        let small = bitmap::get(self.bitmaps[k].words(), j);
        if small < 3 {
            return Ok(small);
        }
        self.overflow.get(&b).copied().ok_or_else(|| {
            corrupt(
                self.bitmaps[k].location,
                format!(
                    "{:?} block {b} has count 3 in its bitmap but no entry in the ref count tree",
                    self.kind
                ),
            )
        })
    }

    /// Sets the count of `b`.
    pub fn set(&mut self, b: u64, count: u32, cache: &mut BlockCache) -> Result<()> {
        let old = self.count(b, cache)?;
        if old == count {
            return Ok(());
        }
        let committed = *self.undo.entry(b).or_insert(old);
        if committed > 0 && (old == 0) != (count == 0) {
            if count == 0 {
                self.freed_here += 1;
            } else {
                self.freed_here -= 1;
            }
        }
        let (k, j) = self.place(b)?;
        let bm = &mut self.bitmaps[k];
        bitmap::set(bm.words.as_mut().expect("loaded"), j, count.min(3));
        if !bm.dirty {
            self.newly_dirty.push(k);
        }
        bm.dirty = true;
        if count >= 3 {
            self.overflow.insert(b, count);
        } else if old >= 3 {
            self.overflow.remove(&b);
        }
        if count >= 3 || old >= 3 {
            self.overflow_dirty.insert(b);
        }
        if old == 0 {
            bm.nr_free -= 1;
            self.nr_allocated += 1;
            if j as u32 == bm.none_free_before {
                bm.none_free_before += 1;
            }
        } else if count == 0 {
            bm.nr_free += 1;
            // Saturating: a damaged root's count must not bring the pool down.
            self.nr_allocated = self.nr_allocated.saturating_sub(1);
            bm.none_free_before = bm.none_free_before.min(j as u32);
            if committed == 0 {
                // Never committed: usable again at once, and the next search finds it.
                self.cursor = self.cursor.min(b);
            }
        }
        Ok(())
    }

    pub fn inc(&mut self, b: u64, cache: &mut BlockCache) -> Result<()> {
        let count = self.count(b, cache)?;
        self.set(b, count + 1, cache)
    }

    /// Decrements `b`; its new count.
    pub fn dec(&mut self, b: u64, cache: &mut BlockCache) -> Result<u32> {
        let count = self.count(b, cache)?;
        if count == 0 {
            return Err(match self.kind {
                SmKind::Metadata => corrupt(b, "reference count would go below zero"),
                SmKind::Data => ThinError::BadArgument(format!(
                    "data block {b}: reference count would go below zero"
                )),
            });
        }
        self.set(b, count - 1, cache)?;
        Ok(count - 1)
    }

    /// True if `b` was free at the last commit (so this transaction may write it in place).
    pub fn is_new(&self, b: u64) -> bool {
        self.undo.get(&b) == Some(&0)
    }

    /// True if `b` was in use at the last commit (then it must not be reused before the next).
    fn is_freed_here(&self, b: u64) -> bool {
        self.undo.get(&b).is_some_and(|&old| old > 0)
    }

    /// Takes a block free now and at the last commit, giving it count 1; None if there is none.
    pub fn alloc(&mut self, cache: &mut BlockCache) -> Result<Option<u64>> {
        let found = match self.search(self.cursor, self.nr_blocks, cache)? {
            Some(b) => Some(b),
            None => self.search(0, self.cursor.min(self.nr_blocks), cache)?,
        };
        if let Some(b) = found {
            self.set(b, 1, cache)?;
            self.cursor = b + 1;
        }
        Ok(found)
    }

    fn search(&mut self, lo: u64, hi: u64, cache: &mut BlockCache) -> Result<Option<u64>> {
        let mut at = lo;
        while at < hi {
            let k = (at / ENTRIES_PER_BITMAP) as usize;
            let base = k as u64 * ENTRIES_PER_BITMAP;
            let end = (hi - base).min(ENTRIES_PER_BITMAP) as usize;
            if self.bitmaps[k].nr_free > 0 {
                self.load(k, cache)?;
                let from = ((at - base) as usize).max(self.bitmaps[k].none_free_before as usize);
                let bm = &self.bitmaps[k];
                if let Some(j) = bitmap::find_free(bm.words(), from, end, |j| {
                    !self.is_freed_here(base + j as u64)
                }) {
                    return Ok(Some(base + j as u64));
                }
            }
            at = base + ENTRIES_PER_BITMAP;
        }
        Ok(None)
    }

    /// The bitmaps that changed for the first time since the last call.
    pub fn take_newly_dirty(&mut self) -> Vec<usize> {
        std::mem::take(&mut self.newly_dirty)
    }

    /// The transaction is committed: its state is the new committed state.
    pub fn committed_now(&mut self) {
        self.undo.clear();
        self.freed_here = 0;
        self.overflow_dirty.clear();
        self.newly_dirty.clear();
        for bm in &mut self.bitmaps {
            bm.dirty = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use udm_block::MemoryDevice;

    fn cache() -> BlockCache {
        BlockCache::new(Arc::new(MemoryDevice::new(1 << 20)))
    }

    #[test]
    fn counts_overflow_past_two_and_come_back() {
        let mut c = cache();
        let mut sm = SpaceMap::new(SmKind::Data);
        sm.extend(40_000);
        assert_eq!(sm.bitmaps.len(), 3);
        for _ in 0..5 {
            sm.inc(20_000, &mut c).unwrap();
        }
        assert_eq!(sm.count(20_000, &mut c).unwrap(), 5);
        assert_eq!(sm.overflow_count(20_000), Some(5));
        assert!(sm.overflow_dirty.contains(&20_000));
        for _ in 0..3 {
            sm.dec(20_000, &mut c).unwrap();
        }
        assert_eq!(sm.count(20_000, &mut c).unwrap(), 2);
        assert_eq!(sm.overflow_count(20_000), None);
        assert_eq!(sm.nr_allocated(), 1);
        assert_eq!(sm.bitmaps[1].nr_free, 16_319);
        sm.dec(20_000, &mut c).unwrap();
        sm.dec(20_000, &mut c).unwrap();
        assert!(sm.dec(20_000, &mut c).is_err(), "below zero");
        assert!(sm.count(40_000, &mut c).is_err(), "out of range");
    }

    #[test]
    fn blocks_freed_in_a_transaction_wait_for_the_commit() {
        let mut c = cache();
        let mut sm = SpaceMap::new(SmKind::Metadata);
        sm.extend(10);
        let got: Vec<u64> = (0..10)
            .map(|_| sm.alloc(&mut c).unwrap().unwrap())
            .collect();
        assert_eq!(got, (0..10).collect::<Vec<_>>());
        assert_eq!(sm.alloc(&mut c).unwrap(), None);
        sm.committed_now();
        sm.dec(3, &mut c).unwrap();
        assert_eq!(
            sm.alloc(&mut c).unwrap(),
            None,
            "3 is still in the committed state"
        );
        assert!(!sm.is_new(4));
        sm.committed_now();
        assert_eq!(sm.alloc(&mut c).unwrap(), Some(3));
        assert!(sm.is_new(3));
        sm.dec(3, &mut c).unwrap();
        assert_eq!(
            sm.alloc(&mut c).unwrap(),
            Some(3),
            "never committed: reusable"
        );
    }
}
