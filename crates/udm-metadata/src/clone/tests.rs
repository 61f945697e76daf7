//! The clone metadata against memory devices: formats, commits, torn and corrupt blocks.

use super::*;
use udm_block::{AlignedBuf, MemoryDevice, WriteFlags};

use crate::block::read_u64;

fn geometry(regions: u64) -> CloneGeometry {
    CloneGeometry {
        region_sectors: 8,
        target_sectors: regions * 8 - 3,
    }
}

/// Clone metadata for `regions` regions, formatted on a fresh 4 MiB memory device.
fn formatted(regions: u64) -> (Arc<MemoryDevice>, CloneGeometry, CloneMetadata) {
    let dev = Arc::new(MemoryDevice::new(4 << 20));
    let g = geometry(regions);
    let meta = CloneMetadata::open(dev.clone(), g).unwrap();
    (dev, g, meta)
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
    let (dev, g, meta) = formatted(100_000);
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
    let (dev, g, meta) = formatted(200_000);
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
    let (dev, g, meta) = formatted(1000);
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
    let (dev, g, meta) = formatted(1000);
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
    let (dev, g, meta) = formatted(1000);
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
