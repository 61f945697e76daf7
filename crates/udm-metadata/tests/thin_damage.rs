//! Damaged pool metadata: a flipped byte in each kind of block, a truncated device, a full
//! metadata device. Each gives a clear error naming the block, and a full device leaves the
//! last commit intact. (Damage anywhere, never a panic: crates/udm-fuzz's `thin_metadata`.)

mod tpt;

use std::sync::Arc;

use udm_block::{BlockDevice, MemoryDevice, WriteFlags};
use udm_metadata::{ThinError, ThinMetadata, BLOCK_SIZE};
use udm_testkit::{Rng, TempDir};

const B: u64 = BLOCK_SIZE as u64;

fn u64_at(block: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(block[at..at + 8].try_into().unwrap())
}

fn read_block(dev: &dyn BlockDevice, b: u64) -> Vec<u8> {
    let mut block = vec![0u8; BLOCK_SIZE];
    dev.read(b * B, &mut block).unwrap();
    block
}

fn write_block(dev: &dyn BlockDevice, b: u64, block: &[u8]) {
    dev.write(b * B, block, WriteFlags::default()).unwrap();
}

/// A pool with two devices (one a snapshot), a tree of several levels, committed.
fn pool() -> Arc<dyn BlockDevice> {
    let dev: Arc<dyn BlockDevice> = Arc::new(MemoryDevice::new(4 << 20));
    let mut meta = ThinMetadata::open(dev.clone(), 128, 40_000).unwrap();
    meta.create_thin(1).unwrap();
    for vb in 0..600 {
        let b = meta.alloc_data_block().unwrap().unwrap();
        meta.insert(1, vb * 3, b).unwrap();
    }
    meta.create_snap(2, 1).unwrap();
    for vb in 0..20 {
        let b = meta.alloc_data_block().unwrap().unwrap();
        meta.insert(2, vb, b).unwrap();
    }
    meta.commit().unwrap();
    dev
}

fn copy(dev: &dyn BlockDevice, size: u64) -> Arc<dyn BlockDevice> {
    let out = MemoryDevice::new(size);
    let mut image = vec![0u8; size.min(dev.size()) as usize];
    dev.read(0, &mut image).unwrap();
    out.write(0, &image, WriteFlags::default()).unwrap();
    Arc::new(out)
}

fn corrupt_block(err: ThinError) -> u64 {
    match err {
        ThinError::Corrupt { block, .. } => block,
        other => panic!("expected a Corrupt error, got {other:?}"),
    }
}

/// Flips one byte of block `b` on a copy of `dev`.
fn flipped(dev: &dyn BlockDevice, b: u64, at: usize) -> Arc<dyn BlockDevice> {
    let copy = copy(dev, dev.size());
    let mut block = read_block(copy.as_ref(), b);
    block[at] ^= 0x40;
    write_block(copy.as_ref(), b, &block);
    copy
}

#[test]
fn a_damaged_superblock_node_or_bitmap_is_named() {
    let dev = pool();
    let sb = read_block(dev.as_ref(), 0);

    let err = ThinMetadata::open(flipped(dev.as_ref(), 0, 100), 128, 40_000).unwrap_err();
    assert_eq!(corrupt_block(err.clone()), 0);
    assert!(err.to_string().contains("checksum"), "{err}");

    // The mapping tree's top level, read at open.
    let top = u64_at(&sb, 320);
    let err = ThinMetadata::open(flipped(dev.as_ref(), top, 40), 128, 40_000).unwrap_err();
    assert_eq!(corrupt_block(err), top);

    // A leaf of device 1, read on lookup.
    let top_block = read_block(dev.as_ref(), top);
    let root1 = u64_at(&top_block, 32 + 8 * 252);
    let root_block = read_block(dev.as_ref(), root1);
    assert_eq!(
        u32::from_le_bytes(root_block[4..8].try_into().unwrap()),
        1,
        "internal"
    );
    let leaf = u64_at(&root_block, 32 + 8 * 252 + 8);
    let damaged = flipped(dev.as_ref(), leaf, 2000);
    let mut meta = ThinMetadata::open(damaged, 128, 40_000).unwrap();
    assert!(meta.lookup(1, 0).is_ok(), "other leaves still read");
    let first_key = u64_at(&read_block(dev.as_ref(), leaf), 32);
    let err = meta.lookup(1, first_key).unwrap_err();
    assert_eq!(corrupt_block(err.clone()), leaf);
    assert!(err.to_string().contains(&format!("block {leaf}")), "{err}");

    // A metadata space map bitmap, read at open.
    let index = u64_at(&sb, 192 + 16);
    let bitmap = u64_at(&read_block(dev.as_ref(), index), 16);
    let err = ThinMetadata::open(flipped(dev.as_ref(), bitmap, 300), 128, 40_000).unwrap_err();
    assert_eq!(corrupt_block(err), bitmap);

    // A data space map bitmap, read when first used.
    let data_index = u64_at(&sb, 64 + 16);
    let entry = read_block(dev.as_ref(), data_index);
    let data_bitmap = u64_at(&entry, 32 + 8 * 168);
    let mut meta = ThinMetadata::open(flipped(dev.as_ref(), data_bitmap, 17), 128, 40_000).unwrap();
    let err = meta.data_ref_count(5).unwrap_err();
    assert_eq!(corrupt_block(err), data_bitmap);
}

#[test]
fn a_truncated_metadata_device_is_refused_by_name() {
    let dev = pool();
    for size in [0, 2048, B, 64 * B] {
        let err = ThinMetadata::open(copy(dev.as_ref(), size), 128, 40_000)
            .err()
            .unwrap_or_else(|| panic!("{size} bytes opened"));
        let text = err.to_string();
        assert!(
            text.contains("block 0")
                && (text.contains("beyond the end") || text.contains("truncated")),
            "{size} bytes: {text}"
        );
    }
}

#[test]
fn a_full_metadata_device_fails_cleanly_and_keeps_the_last_commit() {
    let scratch = TempDir::new("thin-full");
    // 48 blocks of metadata, 4 kept back for commits.
    let (path, dev) = tpt::device(&scratch, "meta", 48 * B);
    let mut meta = ThinMetadata::open(dev.clone(), 128, 100_000).unwrap();
    meta.create_thin(1).unwrap();
    let mut committed = 0u64;
    let mut vb = 0;
    let err = loop {
        // Random-ish order: leaves split and fill the device quickly.
        let b = match meta.alloc_data_block() {
            Ok(b) => b.unwrap(),
            Err(e) => break e,
        };
        if let Err(e) = meta.insert(1, (vb * 7919) % 100_000, b) {
            break e;
        }
        vb += 1;
        if vb % 500 == 0 {
            meta.commit().unwrap();
            committed = vb;
        }
    };
    assert_eq!(err, ThinError::MetadataFull);
    // Blocks freed since the last commit stay in use until the next: "full" comes before
    // every block is used.
    let usage = meta.metadata_usage();
    assert!(usage.used * 3 > usage.total * 2, "{usage:?}");
    assert!(
        matches!(meta.lookup(1, 0), Err(ThinError::Aborting(_))),
        "the failed transaction must be aborted"
    );
    assert!(matches!(meta.commit(), Err(ThinError::Aborting(_))));
    meta.abort().unwrap();
    assert_eq!(meta.device(1).unwrap().mapped_blocks, committed);
    tpt::check(&path, "after the metadata filled up");
    for i in 0..committed {
        assert!(meta.lookup(1, (i * 7919) % 100_000).unwrap().is_some());
    }
    // Unmapping makes room again, a few blocks per commit (each copies the leaves it
    // changes; the blocks it frees are reused after the commit).
    for i in 0..committed / 2 {
        meta.remove(1, (i * 7919) % 100_000).unwrap();
        if i % 4 == 3 {
            meta.commit().unwrap();
        }
    }
    meta.commit().unwrap();
    tpt::check(&path, "after unmapping half");
    // ... where new mappings fit.
    for i in 0..100 {
        let b = meta.alloc_data_block().unwrap().unwrap();
        meta.insert(1, (i * 7919) % 100_000, b).unwrap();
        if i % 4 == 3 {
            meta.commit().unwrap();
        }
    }
    tpt::check(&path, "after mapping some again");
    drop(meta);
    let mut meta = ThinMetadata::open(dev, 128, 100_000).unwrap();
    assert_eq!(
        meta.device(1).unwrap().mapped_blocks,
        committed - committed / 2 + 100
    );
    assert!(meta.lookup(1, 0).unwrap().is_some());
    assert!(meta.lookup(1, 100 * 7919 % 100_000).unwrap().is_none());
}

#[test]
fn blocks_freed_in_a_transaction_do_not_count_as_room_for_its_commit() {
    let scratch = TempDir::new("thin-freedroom");
    let (path, dev) = tpt::device(&scratch, "meta", 64 * B);
    let mut meta = ThinMetadata::open(dev, 128, 100_000).unwrap();
    meta.create_thin(1).unwrap();
    for vb in 0..2_000u64 {
        let b = meta.alloc_data_block().unwrap().unwrap();
        meta.insert(1, (vb * 7919) % 100_000, b).unwrap();
    }
    meta.commit().unwrap();
    // Deleting the device frees its blocks, but only for the next transaction: mappings
    // added in this one must stop while its commit still has room.
    // The inserts that succeed before MetadataFull.
    let replay = |meta: &mut ThinMetadata, most: u64| -> u64 {
        meta.delete(1).unwrap();
        meta.create_thin(2).unwrap();
        for vb in 0..most {
            let b = meta.alloc_data_block().unwrap().unwrap();
            match meta.insert(2, (vb * 104_729) % 100_000, b) {
                Ok(()) => {}
                Err(ThinError::MetadataFull) => return vb,
                Err(e) => panic!("{e}"),
            }
        }
        most
    };
    let most = replay(&mut meta, u64::MAX);
    meta.abort().unwrap();
    assert!(most > 100, "{most}");
    assert_eq!(replay(&mut meta, most), most);
    meta.commit().unwrap();
    tpt::check(&path, "after the fullest transaction that succeeded");
}

#[test]
fn a_delete_that_touches_every_data_bitmap_fails_or_commits() {
    let scratch = TempDir::new("thin-spread");
    let (path, dev) = tpt::device(&scratch, "meta", 128 * B);
    let mut meta = ThinMetadata::open(dev, 128, 40 * 16_320).unwrap();
    // Device 1 maps one data block in each of the 40 data bitmaps.
    meta.create_thin(1).unwrap();
    let blocks: Vec<u64> = (0..40 * 16_320)
        .map(|_| meta.alloc_data_block().unwrap().unwrap())
        .collect();
    for (vb, &b) in blocks.iter().enumerate() {
        if b % 16_320 == 7 {
            meta.insert(1, vb as u64, b).unwrap();
        } else {
            meta.release_data_block(b).unwrap();
        }
    }
    meta.commit().unwrap();
    assert_eq!(meta.data_usage().used, 40);
    // Device 2 fills the metadata.
    meta.create_thin(2).unwrap();
    meta.commit().unwrap();
    for vb in 0.. {
        let b = meta.alloc_data_block().unwrap().unwrap();
        if meta.insert(2, (vb * 7919) % 100_000, b).is_err() {
            break;
        }
        if vb % 5 == 4 {
            meta.commit().unwrap();
        }
    }
    meta.abort().unwrap();
    // Deleting device 1 changes all 40 data bitmaps: the delete fails, or its commit works.
    match meta.delete(1) {
        Ok(()) => meta.commit().unwrap(),
        Err(ThinError::MetadataFull) => meta.abort().unwrap(),
        Err(e) => panic!("{e}"),
    }
    tpt::check(&path, "after deleting device 1");
}

/// Transactions on a nearly full metadata device: each either fails at an operation with
/// MetadataFull (and is aborted) or commits; a commit never runs out of room.
#[test]
fn a_transaction_whose_operations_succeed_always_commits() {
    let scratch = TempDir::new("thin-edge");
    // 96 metadata blocks (9 kept back), 12 data bitmaps: removals all over the data device
    // change many bitmaps in one transaction.
    let (path, dev) = tpt::device(&scratch, "meta", 96 * B);
    let mut meta = ThinMetadata::open(dev, 128, 12 * 16_320).unwrap();
    let mut rng = Rng::new(7);
    let mut next = move || rng.next();
    let mut next_id = 0;
    let (mut commits, mut full) = (0, 0);
    for round in 0..400 {
        let result = (|| -> Result<(), ThinError> {
            let ids: Vec<u32> = meta.devices().iter().map(|d| d.id).collect();
            if ids.len() < 2 || next() % 8 == 0 {
                meta.create_thin(next_id)?;
                next_id += 1;
            } else if next() % 6 == 0 {
                meta.create_snap(next_id, ids[next() as usize % ids.len()])?;
                next_id += 1;
            } else if ids.len() > 3 && next() % 5 == 0 {
                meta.delete(ids[next() as usize % ids.len()])?;
            }
            let ids: Vec<u32> = meta.devices().iter().map(|d| d.id).collect();
            for _ in 0..next() % 400 {
                let id = ids[next() as usize % ids.len()];
                let vblock = next() % 20_000;
                if next() % 3 == 0 {
                    meta.remove(id, vblock)?;
                } else if let Some(b) = meta.alloc_data_block()? {
                    meta.insert(id, vblock, b)?;
                }
            }
            Ok(())
        })();
        match result {
            Ok(()) => {
                meta.commit().unwrap_or_else(|e| {
                    panic!("round {round}: the operations succeeded, the commit failed: {e}")
                });
                commits += 1;
            }
            Err(ThinError::MetadataFull) => {
                meta.abort().unwrap();
                full += 1;
                // Make room: delete the device with the most mappings, in its own commit.
                let big = meta
                    .devices()
                    .into_iter()
                    .max_by_key(|d| d.mapped_blocks)
                    .unwrap();
                if meta.delete(big.id).is_ok() {
                    meta.commit().unwrap();
                } else {
                    meta.abort().unwrap();
                }
            }
            Err(e) => panic!("round {round}: {e}"),
        }
        if round % 50 == 49 {
            tpt::check(&path, &format!("round {round}"));
        }
    }
    eprintln!("{commits} commits, {full} transactions stopped by a full metadata device");
    assert!(commits > 100 && full > 10, "{commits} commits, {full} full");
}

#[test]
fn a_data_growth_too_large_for_the_metadata_fails_at_once() {
    let dev: Arc<dyn BlockDevice> = Arc::new(MemoryDevice::new(64 * B));
    let mut meta = ThinMetadata::open(dev, 128, 16_320).unwrap();
    // 200 more bitmaps need 200 metadata blocks: the resize says so, not the next commit.
    assert_eq!(meta.resize_data(201 * 16_320), Err(ThinError::MetadataFull));
    meta.abort().unwrap();
    meta.resize_data(20 * 16_320).unwrap();
    meta.commit().unwrap();
    assert_eq!(meta.data_usage().total, 20 * 16_320);
}
