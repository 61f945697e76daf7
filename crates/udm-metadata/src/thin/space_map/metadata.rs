//! The metadata space map on disk (K:`pd/dm-space-map-metadata.c`): one index block of up to
//! 255 entries, the bitmaps, and a ref-count tree, all counted in the map itself.
//!
//! The kernel breaks the recursion (writing a bitmap needs a block, which changes a bitmap)
//! with a queue of pending operations. udm keeps every count of the metadata map in memory
//! during the transaction and writes the map only at commit, by iterating to a fixed point:
//! move each changed bitmap and the index block to a block of this transaction (which changes
//! counts, possibly of other bitmaps) until nothing moves, then write the final counts.

use super::super::cache::BlockCache;
use super::super::checksum::Kind;
use super::super::error::{corrupt, Result};
use super::super::superblock::SmRoot;
use super::super::transaction::Tm;
use super::disk::{load_overflow, relocate, write_bitmap, write_overflow};
use super::index::{decode_index_block, encode_index_block, IndexEntry, MAX_METADATA_BITMAPS};
use super::{SmKind, SpaceMap};
use crate::BLOCK_SIZE;

/// Opens the committed metadata space map at `root`, reading every bitmap.
pub fn open(cache: &mut BlockCache, root: &SmRoot) -> Result<SpaceMap> {
    let nr = SpaceMap::bitmaps_for(root.nr_blocks);
    if nr > MAX_METADATA_BITMAPS {
        return Err(corrupt(
            0,
            format!(
                "metadata space map of {} blocks needs {nr} bitmaps, at most {MAX_METADATA_BITMAPS} fit",
                root.nr_blocks
            ),
        ));
    }
    let block = cache.read(root.bitmap_root, Kind::Index)?;
    let entries = decode_index_block(&block[..], nr);
    let overflow = load_overflow(cache, root.ref_count_root)?;
    let mut sm = SpaceMap::committed(SmKind::Metadata, root, entries, overflow);
    sm.load_all(cache)?;
    Ok(sm)
}

/// Writes the metadata space map's changes (the last step before the blocks go to disk).
pub fn commit(tm: &mut Tm) -> Result<()> {
    if !tm.msm.bitmaps.iter().any(|b| b.dirty) && tm.msm.overflow_dirty.is_empty() {
        return Ok(());
    }
    loop {
        let mut moved = write_overflow(tm, SmKind::Metadata)?;
        for k in 0..tm.msm.bitmaps.len() {
            let location = tm.msm.bitmaps[k].location;
            if tm.msm.bitmaps[k].dirty && !(location != 0 && tm.writable(location)?) {
                tm.msm.bitmaps[k].location = relocate(tm, location)?;
                moved = true;
            }
        }
        let index = tm.msm.bitmap_root;
        if !(index != 0 && tm.writable(index)?) {
            tm.msm.bitmap_root = relocate(tm, index)?;
            moved = true;
        }
        if !moved {
            break;
        }
    }
    let mut entries: Vec<IndexEntry> = Vec::with_capacity(tm.msm.bitmaps.len());
    for k in 0..tm.msm.bitmaps.len() {
        let bm = &tm.msm.bitmaps[k];
        entries.push(bm.index_entry());
        if bm.dirty {
            let (location, words) = (bm.location, *bm.words());
            write_bitmap(tm, location, &words);
        }
    }
    let mut block = [0u8; BLOCK_SIZE];
    encode_index_block(&entries, &mut block);
    tm.cache
        .put(tm.msm.bitmap_root, Kind::Index, std::sync::Arc::new(block));
    Ok(())
}
