//! The pool metadata's API on memory devices: warm lookups, sharing, aborts, growth.

use super::*;
use crate::BLOCK_SIZE;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use udm_block::{BlockDevice, MemoryDevice, WriteFlags};

/// A memory device that counts writes.
struct Counting(MemoryDevice, AtomicU64);

impl BlockDevice for Counting {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> udm_block::Result<()> {
        self.0.read(offset, buf)
    }
    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> udm_block::Result<()> {
        self.1.fetch_add(1, Ordering::SeqCst);
        self.0.write(offset, buf, flags)
    }
    fn flush(&self) -> udm_block::Result<()> {
        Ok(())
    }
}

fn device() -> Arc<Counting> {
    Arc::new(Counting(MemoryDevice::new(8 << 20), AtomicU64::new(0)))
}

/// Pool metadata for `data_blocks` blocks of 128 sectors, formatted on a fresh device.
fn pool(data_blocks: u64) -> (Arc<Counting>, ThinMetadata) {
    let dev = device();
    let meta = ThinMetadata::open(dev.clone(), 128, data_blocks).unwrap();
    (dev, meta)
}

fn map_new(meta: &mut ThinMetadata, id: u32, vblock: u64) -> u64 {
    let b = meta.alloc_data_block().unwrap().unwrap();
    meta.insert(id, vblock, b).unwrap();
    b
}

#[test]
fn the_pool_can_move_between_threads() {
    fn send<T: Send>() {}
    send::<ThinMetadata>();
}

#[test]
fn warm_lookups_read_nothing_from_disk() {
    let (dev, mut meta) = pool(100_000);
    meta.create_thin(1).unwrap();
    for vb in 0..20_000 {
        map_new(&mut meta, 1, vb * 2);
    }
    meta.commit().unwrap();
    let mut meta = ThinMetadata::open(dev, 128, 100_000).unwrap();
    for vb in 0..20_000 {
        assert!(meta.lookup(1, vb * 2).unwrap().is_some());
    }
    let warm = meta.disk_reads();
    for vb in 0..40_000 {
        assert_eq!(meta.lookup(1, vb).unwrap().is_some(), vb % 2 == 0);
    }
    assert_eq!(meta.disk_reads(), warm, "warm lookups went to the disk");
}

#[test]
fn a_tree_of_three_levels_splits_its_inner_nodes() {
    // 200,000 mappings fill more than 252 × 252 / 2 leaves' worth: the inner nodes under
    // the root fill up and split (an empty new inner node was once refused as corrupt).
    let dev = Arc::new(MemoryDevice::new(64 << 20));
    let mut meta = ThinMetadata::open(dev.clone(), 128, 400_000).unwrap();
    meta.create_thin(1).unwrap();
    let blocks: Vec<u64> = (0..200_000).map(|vb| map_new(&mut meta, 1, vb)).collect();
    meta.commit().unwrap();
    let mut meta = ThinMetadata::open(dev, 128, 400_000).unwrap();
    for (vb, block) in blocks.iter().enumerate() {
        assert_eq!(
            meta.lookup(1, vb as u64).unwrap().unwrap().data_block,
            *block
        );
    }
}

#[test]
fn freed_blocks_do_not_crowd_live_ones_out_of_the_cache() {
    let mut meta = pool(100_000).1;
    meta.set_cache_blocks(1000);
    meta.create_thin(1).unwrap();
    // Random inserts copy a leaf each, commit after commit: thousands of freed blocks.
    let order = |i: u64| (i * 7919) % 60_000;
    for i in 0..60_000 {
        map_new(&mut meta, 1, order(i));
        if i % 1000 == 999 {
            meta.commit().unwrap();
        }
    }
    assert!(
        meta.metadata_usage().used < 1000,
        "the live metadata fits the cache"
    );
    for i in 0..60_000 {
        meta.lookup(1, order(i)).unwrap();
    }
    let warm = meta.disk_reads();
    for i in 0..60_000 {
        meta.lookup(1, order(i)).unwrap();
    }
    assert_eq!(meta.disk_reads(), warm);
}

#[test]
fn refused_arguments_leave_the_transaction_usable() {
    let mut meta = pool(1000).1;
    assert!(matches!(
        ThinMetadata::open(device(), 100, 1000),
        Err(ThinError::BadArgument(_))
    ));
    meta.create_thin(1).unwrap();
    assert_eq!(meta.create_thin(1), Err(ThinError::DeviceExists(1)));
    assert_eq!(meta.create_snap(1, 1), Err(ThinError::DeviceExists(1)));
    assert_eq!(meta.create_snap(2, 7), Err(ThinError::NoSuchDevice(7)));
    assert_eq!(meta.delete(7), Err(ThinError::NoSuchDevice(7)));
    assert_eq!(meta.lookup(7, 0), Err(ThinError::NoSuchDevice(7)));
    assert!(matches!(
        meta.create_thin(1 << 24),
        Err(ThinError::BadArgument(_))
    ));
    assert!(matches!(
        meta.insert(1, 0, 1000),
        Err(ThinError::BadArgument(_))
    ));
    assert!(matches!(
        meta.set_transaction_id(3, 4),
        Err(ThinError::BadArgument(_))
    ));
    assert!(matches!(
        meta.resize_data(999),
        Err(ThinError::BadArgument(_))
    ));
    assert!(matches!(
        meta.release_metadata_snap(),
        Err(ThinError::BadArgument(_))
    ));
    meta.set_transaction_id(0, 4).unwrap();
    map_new(&mut meta, 1, 0);
    meta.commit().unwrap();
    assert_eq!(meta.transaction_id(), 4);
}

#[test]
fn sharing_follows_snapshot_time_and_blocks_free_when_the_last_user_goes() {
    let mut meta = pool(1000).1;
    meta.create_thin(1).unwrap();
    let old = map_new(&mut meta, 1, 5);
    assert!(!meta.lookup(1, 5).unwrap().unwrap().shared);
    meta.create_snap(2, 1).unwrap();
    let origin = meta.device(1).unwrap();
    let snap = meta.device(2).unwrap();
    assert_eq!((origin.snapshotted_time, snap.creation_time), (1, 1));
    assert_eq!(snap.mapped_blocks, 1);
    assert!(meta.lookup(1, 5).unwrap().unwrap().shared);
    assert!(meta.lookup(2, 5).unwrap().unwrap().shared);
    // A write to the origin breaks sharing: new block, new time.
    let new = map_new(&mut meta, 1, 5);
    assert_eq!(
        meta.lookup(1, 5).unwrap(),
        Some(Mapping {
            data_block: new,
            shared: false
        })
    );
    assert_eq!(meta.lookup(2, 5).unwrap().unwrap().data_block, old);
    assert_eq!(meta.data_ref_count(old).unwrap(), 1);
    assert_eq!(meta.remove(2, 5).unwrap(), Some(old), "the last user");
    assert_eq!(meta.remove(2, 5).unwrap(), None, "not mapped");
    // A block shared through a common leaf counts once; deleting one device keeps it.
    meta.create_snap(3, 1).unwrap();
    assert_eq!(meta.data_ref_count(new).unwrap(), 1);
    meta.delete(1).unwrap();
    assert_eq!(meta.lookup(3, 5).unwrap().unwrap().data_block, new);
    assert_eq!(meta.data_ref_count(new).unwrap(), 1);
    assert_eq!(meta.data_usage().used, 1);
    meta.delete(3).unwrap();
    assert_eq!(meta.data_usage().used, 0);
}

#[test]
fn the_newest_mapping_time_shows_a_snapshot_written_since_it_was_made() {
    let mut meta = pool(1000).1;
    meta.create_thin(1).unwrap();
    assert_eq!(meta.newest_mapping_time(1).unwrap(), None);
    for vb in 0..300 {
        map_new(&mut meta, 1, vb);
    }
    meta.create_snap(2, 1).unwrap();
    let made = meta.device(2).unwrap().creation_time;
    assert_eq!(meta.newest_mapping_time(2).unwrap(), Some(made - 1));
    // Overwritten, a shared block is mapped anew at the pool's time: newer than the snapshot.
    map_new(&mut meta, 2, 250);
    assert_eq!(meta.newest_mapping_time(2).unwrap(), Some(made));
    assert_eq!(meta.newest_mapping_time(1).unwrap(), Some(made - 1));
}

#[test]
fn released_and_aborted_blocks_come_back() {
    let mut meta = pool(1000).1;
    meta.create_thin(1).unwrap();
    meta.commit().unwrap();
    let a = meta.alloc_data_block().unwrap().unwrap();
    let b = meta.alloc_data_block().unwrap().unwrap();
    meta.release_data_block(a).unwrap();
    assert!(
        meta.release_data_block(a).is_err(),
        "not allocated any more"
    );
    assert_eq!(meta.alloc_data_block().unwrap(), Some(a));
    meta.insert(1, 0, a).unwrap();
    meta.insert(1, 1, b).unwrap();
    assert_eq!(meta.data_usage().used, 2);
    meta.abort().unwrap();
    assert_eq!(meta.data_usage().used, 0);
    assert_eq!(meta.device(1).unwrap().mapped_blocks, 0);
    assert_eq!(meta.lookup(1, 0).unwrap(), None);
    // A block freed after a commit waits for the next one.
    let c = map_new(&mut meta, 1, 0);
    meta.commit().unwrap();
    assert_eq!(meta.remove(1, 0).unwrap(), Some(c));
    assert_ne!(meta.alloc_data_block().unwrap(), Some(c));
}

#[test]
fn a_commit_with_nothing_new_writes_nothing() {
    let (dev, mut meta) = pool(1000);
    meta.create_thin(1).unwrap();
    meta.commit().unwrap();
    let writes = dev.1.load(Ordering::SeqCst);
    meta.commit().unwrap();
    meta.lookup(1, 0).unwrap();
    meta.commit().unwrap();
    assert_eq!(dev.1.load(Ordering::SeqCst), writes);
    map_new(&mut meta, 1, 0);
    meta.commit().unwrap();
    assert!(dev.1.load(Ordering::SeqCst) > writes);
}

#[test]
fn needs_check_is_written_at_once_and_flagged_metadata_opens_but_never_changes() {
    let (dev, mut meta) = pool(1000);
    meta.create_thin(1).unwrap();
    map_new(&mut meta, 1, 0);
    meta.commit().unwrap();
    meta.create_thin(2).unwrap();
    meta.set_needs_check().unwrap();
    assert!(meta.needs_check());
    // Opened again (on a larger data device, which it must not grow into): the last commit,
    // readable, flagged, and refusing every change.
    let mut meta = ThinMetadata::open(dev, 128, 2000).unwrap();
    assert!(meta.needs_check());
    assert_eq!(meta.data_usage().total, 1000);
    assert!(meta.lookup(1, 0).unwrap().is_some());
    assert!(meta.device(2).is_none());
    let err = meta.create_thin(3).unwrap_err();
    assert_eq!(err, ThinError::NeedsCheck);
    assert!(err.to_string().contains("thin_check"), "{err}");
    assert_eq!(meta.alloc_data_block(), Err(ThinError::NeedsCheck));
    assert_eq!(meta.set_transaction_id(0, 1), Err(ThinError::NeedsCheck));
    assert_eq!(meta.resize_data(3000), Err(ThinError::NeedsCheck));
    // Nothing was spoiled by the refusals: lookups and commits go on.
    assert!(meta.lookup(1, 0).unwrap().is_some());
    meta.commit().unwrap();
}

/// Metadata as the kernel or thin_restore leaves it: committed with no identity.
fn without_identity(dev: Arc<Counting>, meta: &mut ThinMetadata) -> ThinMetadata {
    meta.sb.uuid = [0; 16];
    meta.commit().unwrap();
    ThinMetadata::open(dev, 128, 1000).unwrap()
}

#[test]
fn a_pool_has_an_identity_from_its_format_or_its_first_writable_open_and_keeps_it() {
    let (dev, mut meta) = pool(1000);
    let formatted = meta.identity().expect("formatted metadata has an identity");
    assert_ne!(
        pool(1000).1.identity(),
        Some(formatted),
        "two pools, one identity"
    );
    let mut meta = without_identity(dev.clone(), &mut meta);
    // Opening writes none: a pool opened read-only stays as it is.
    assert_eq!(meta.identity(), None);
    let writes = dev.1.load(Ordering::SeqCst);
    meta.identify().unwrap();
    let given = meta.identity().expect("identified");
    assert!(dev.1.load(Ordering::SeqCst) > writes, "not committed");
    // Committed once, and kept: opened again, it is the same, and writes nothing.
    let mut meta = ThinMetadata::open(dev.clone(), 128, 1000).unwrap();
    let writes = dev.1.load(Ordering::SeqCst);
    meta.identify().unwrap();
    assert_eq!(meta.identity(), Some(given));
    assert_eq!(dev.1.load(Ordering::SeqCst), writes);
    // Metadata that needs checking gets none.
    let mut meta = without_identity(dev.clone(), &mut meta);
    meta.set_needs_check().unwrap();
    let mut meta = ThinMetadata::open(dev.clone(), 128, 1000).unwrap();
    let writes = dev.1.load(Ordering::SeqCst);
    meta.identify().unwrap();
    assert_eq!(meta.identity(), None);
    assert_eq!(dev.1.load(Ordering::SeqCst), writes);
}

#[test]
fn the_pool_grows_with_its_devices() {
    let (dev, mut meta) = pool(1000);
    assert_eq!(
        meta.data_usage(),
        Usage {
            used: 0,
            total: 1000
        }
    );
    let total = meta.metadata_usage().total;
    assert_eq!(total, 2048);
    meta.resize_data(50_000).unwrap();
    meta.commit().unwrap();
    let meta = ThinMetadata::open(dev.clone(), 128, 60_000).unwrap();
    assert_eq!(meta.data_usage().total, 60_000);
    drop(meta);
    assert!(
        ThinMetadata::open(dev, 128, 59_999).is_err(),
        "no shrinking"
    );
}

/// `dev`'s bytes on a new memory device of `blocks` blocks (the device grown).
fn grown(dev: &MemoryDevice, blocks: u64) -> Arc<MemoryDevice> {
    let mut bytes = vec![0u8; dev.size() as usize];
    dev.read(0, &mut bytes).unwrap();
    let bigger = MemoryDevice::new(blocks * BLOCK_SIZE as u64);
    bigger.write(0, &bytes, WriteFlags::default()).unwrap();
    Arc::new(bigger)
}

#[test]
fn full_metadata_grows_onto_a_larger_device_and_goes_on() {
    let small = Arc::new(MemoryDevice::new(256 * BLOCK_SIZE as u64));
    let mut meta = ThinMetadata::open(small.clone(), 128, 1000).unwrap();
    let mut id = 0;
    let err = loop {
        // Committed one by one, as pool messages are.
        match meta.create_thin(id).and_then(|()| meta.commit()) {
            Ok(()) => id += 1,
            Err(e) => break e,
        }
    };
    assert_eq!(err, ThinError::MetadataFull);
    meta.abort().unwrap();
    let refused = meta.resize_metadata(Arc::new(MemoryDevice::new(100 * BLOCK_SIZE as u64)));
    assert!(
        matches!(refused, Err(ThinError::BadArgument(_))),
        "{refused:?}"
    );
    let bigger = grown(&small, 2048);
    meta.resize_metadata(bigger.clone()).unwrap();
    for more in id..id + 200 {
        meta.create_thin(more).unwrap();
    }
    meta.commit().unwrap();
    assert_eq!(meta.metadata_usage().total, 2048);
    drop(meta);
    let meta = ThinMetadata::open(bigger, 128, 1000).unwrap();
    assert_eq!(meta.metadata_usage().total, 2048);
    assert_eq!(meta.devices().len() as u32, id + 200);
}
