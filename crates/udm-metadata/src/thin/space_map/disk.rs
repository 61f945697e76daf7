//! The data space map on disk (K:`pd/dm-space-map-disk.c`): a B-tree from bitmap number to
//! index entry (16-byte values), the bitmaps it points at, and a B-tree of the counts of 3 or
//! more (u32 values). All of it lives on the metadata device.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::super::btree::insert::insert;
use super::super::btree::lookup::walk;
use super::super::btree::remove::remove;
use super::super::btree::ValueKind;
use super::super::cache::BlockCache;
use super::super::checksum::Kind;
use super::super::error::{corrupt, Result};
use super::super::mapping::MAX_DATA_BLOCKS;
use super::super::superblock::{SmRoot, SUPERBLOCK_LOCATION};
use super::super::transaction::Tm;
use super::index::IndexEntry;
use super::{bitmap, SmKind, SpaceMap};
use crate::BLOCK_SIZE;

/// Opens the committed data space map at `root` (bitmaps are read when first used).
pub fn open(cache: &mut BlockCache, root: &SmRoot) -> Result<SpaceMap> {
    if root.nr_blocks > MAX_DATA_BLOCKS {
        return Err(corrupt(
            SUPERBLOCK_LOCATION,
            format!(
                "the data space map counts {} blocks, more than dm-thin addresses",
                root.nr_blocks
            ),
        ));
    }
    let nr = SpaceMap::bitmaps_for(root.nr_blocks);
    // Collected as the tree gives them (not sized by the root, which may be damaged).
    let mut entries = Vec::new();
    walk(
        cache,
        root.bitmap_root,
        ValueKind::Index,
        0,
        None,
        &mut |k, v| {
            if k != entries.len() as u64 || entries.len() == nr {
                return Err(corrupt(
                    root.bitmap_root,
                    format!(
                        "data space map index has bitmap {k} after {} of {nr}",
                        entries.len()
                    ),
                ));
            }
            entries.push(IndexEntry::decode(v));
            Ok(())
        },
    )?;
    if entries.len() != nr {
        return Err(corrupt(
            root.bitmap_root,
            format!("data space map index has {} bitmaps of {nr}", entries.len()),
        ));
    }
    let overflow = load_overflow(cache, root.ref_count_root)?;
    Ok(SpaceMap::committed(SmKind::Data, root, entries, overflow))
}

/// Every count of a ref-count tree.
pub fn load_overflow(cache: &mut BlockCache, root: u64) -> Result<BTreeMap<u64, u32>> {
    let mut counts = BTreeMap::new();
    walk(cache, root, ValueKind::RefCount, 0, None, &mut |b, v| {
        counts.insert(b, u32::from_le_bytes(v.try_into().unwrap()));
        Ok(())
    })?;
    Ok(counts)
}

fn sm(tm: &mut Tm, kind: SmKind) -> &mut SpaceMap {
    match kind {
        SmKind::Data => &mut tm.dsm,
        SmKind::Metadata => &mut tm.msm,
    }
}

/// Writes the changed overflow counts of a space map into its ref-count tree.
pub fn write_overflow(tm: &mut Tm, kind: SmKind) -> Result<bool> {
    let pending = std::mem::take(&mut sm(tm, kind).overflow_dirty);
    for &b in &pending {
        let count = sm(tm, kind).overflow_count(b);
        let root = sm(tm, kind).ref_count_root;
        let root = match count {
            Some(c) => insert(tm, root, ValueKind::RefCount, b, &c.to_le_bytes())?.0,
            None => remove(tm, root, ValueKind::RefCount, b)?.0,
        };
        sm(tm, kind).ref_count_root = root;
    }
    Ok(!pending.is_empty())
}

/// A block this transaction may write for a space-map block now at `location` (0: none
/// yet): the same block if it is new in this transaction, else a new one (the old one is
/// released; the last commit still reads it until the next).
pub fn relocate(tm: &mut Tm, location: u64) -> Result<u64> {
    if location != 0 && tm.writable(location)? {
        return Ok(location);
    }
    let new = tm.alloc()?;
    if location != 0 {
        tm.dec(location)?;
    }
    Ok(new)
}

/// Gives each data bitmap changed for the first time in this transaction its new block now,
/// as the kernel shadows a bitmap when it changes it: an operation that changes many bitmaps
/// (deleting a device) then runs out of room itself, instead of leaving its commit without.
pub fn place_changed_bitmaps(tm: &mut Tm) -> Result<()> {
    for k in tm.dsm.take_newly_dirty() {
        let location = relocate(tm, tm.dsm.bitmaps[k].location)?;
        tm.dsm.bitmaps[k].location = location;
    }
    Ok(())
}

/// Puts the bitmap's current words into its block.
pub fn write_bitmap(tm: &mut Tm, location: u64, words: &bitmap::Words) {
    let mut block = [0u8; BLOCK_SIZE];
    bitmap::encode(words, &mut block);
    tm.cache.put(location, Kind::Bitmap, Arc::new(block));
}

/// Writes the data space map's changes: ref-count tree, changed bitmaps, index tree.
pub fn commit(tm: &mut Tm) -> Result<()> {
    write_overflow(tm, SmKind::Data)?;
    for k in 0..tm.dsm.bitmaps.len() {
        if !tm.dsm.bitmaps[k].dirty {
            continue;
        }
        let location = relocate(tm, tm.dsm.bitmaps[k].location)?;
        tm.dsm.bitmaps[k].location = location;
        let words = *tm.dsm.bitmaps[k].words();
        write_bitmap(tm, location, &words);
        let entry = tm.dsm.bitmaps[k].index_entry().encode();
        let root = tm.dsm.bitmap_root;
        tm.dsm.bitmap_root = insert(tm, root, ValueKind::Index, k as u64, &entry)?.0;
    }
    Ok(())
}
