use std::sync::Arc;

use udm_block::{BlockDevice, MemoryDevice, WriteFlags};

use super::*;
use crate::snapshot::layout::{get_record, RECORD_SIZE};

const KIB: u64 = 1024;

fn device(bytes: u64) -> Arc<MemoryDevice> {
    Arc::new(MemoryDevice::new(bytes))
}

fn open(dev: &Arc<MemoryDevice>, chunk_sectors: u64) -> Opened {
    PersistentStore::open(dev.clone() as Arc<dyn BlockDevice>, chunk_sectors).unwrap()
}

fn commit(store: &PersistentStore, records: &[Record]) {
    let ticket = store.submit(records).unwrap();
    store.wait(ticket).unwrap();
}

fn read(dev: &MemoryDevice, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    dev.read(offset, &mut buf).unwrap();
    buf
}

/// Allocates and commits exceptions for origin chunks `olds`, one commit each.
fn save(store: &PersistentStore, olds: impl IntoIterator<Item = u64>) -> Vec<Record> {
    olds.into_iter()
        .map(|old| {
            let record = Record {
                old,
                new: store.allocate().unwrap(),
            };
            commit(store, &[record]);
            record
        })
        .collect()
}

#[test]
fn a_blank_device_is_formatted_and_records_land_where_the_kernel_reads_them() {
    let dev = device(1 << 20);
    let opened = open(&dev, 8);
    assert!(opened.formatted && opened.valid && opened.records.is_empty());
    let store = opened.store;
    let saved = save(&store, [7, 3, 1000]);
    assert_eq!(saved.iter().map(|r| r.new).collect::<Vec<_>>(), [2, 3, 4]);
    // Header: "SnAp", valid 1, version 1, chunk size 8.
    assert_eq!(
        read(&dev, 0, 16),
        [0x53, 0x6e, 0x41, 0x70, 1, 0, 0, 0, 1, 0, 0, 0, 8, 0, 0, 0]
    );
    // Area 0 is chunk 1: three records, then the zero terminator.
    let area = read(&dev, 4096, 4096);
    assert_eq!(get_record(&area, 0), Record { old: 7, new: 2 });
    assert_eq!(get_record(&area, 2), Record { old: 1000, new: 4 });
    assert!(area[3 * RECORD_SIZE..].iter().all(|&b| b == 0));
    assert_eq!(
        store.usage(),
        Usage {
            allocated: 5 * 8,
            total: 2048,
            metadata: 16
        }
    );
    drop(store);
    let again = open(&dev, 8);
    assert!(!again.formatted && again.valid);
    assert_eq!(again.records, saved);
    assert_eq!(again.store.allocate().unwrap(), 5);
}

#[test]
fn concurrent_submissions_share_commits() {
    let dev = device(8 << 20);
    let store = open(&dev, 8).store;
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let store = &store;
            s.spawn(move || {
                for i in 0..100 {
                    let record = Record {
                        old: t * 1000 + i,
                        new: store.allocate().unwrap(),
                    };
                    commit(store, &[record]);
                }
            });
        }
    });
    let stats = store.stats();
    assert_eq!(stats.records, 800);
    assert!(
        stats.commits < 800,
        "every record had its own commit: {stats:?}"
    );
    drop(store);
    assert_eq!(open(&dev, 8).records.len(), 800);
}

#[test]
fn filling_an_area_zeroes_the_next_and_allocation_skips_metadata_chunks() {
    // 4 KiB chunks: 256 records per area; area 1 is chunk 258, area 2 chunk 515.
    let dev = device(4 << 20);
    // Garbage where area 1 will be: the commit that fills area 0 must zero it first.
    dev.write(258 * 4096, &[0xab; 4096], WriteFlags::default())
        .unwrap();
    let store = open(&dev, 8).store;
    let records: Vec<Record> = (0..600)
        .map(|old| Record {
            old,
            new: store.allocate().unwrap(),
        })
        .collect();
    assert!(records.iter().all(|r| r.new != 258 && r.new != 515));
    assert_eq!(records[255].new, 257);
    assert_eq!(records[256].new, 259);
    commit(&store, &records[..256]);
    assert!(read(&dev, 258 * 4096, 4096).iter().all(|&b| b == 0));
    commit(&store, &records[256..]);
    assert_eq!(store.usage().metadata, 4 * 8, "header and areas 0 to 2");
    drop(store);
    let again = open(&dev, 8);
    assert_eq!(again.records, records);
    assert_eq!(again.store.allocate().unwrap(), 604);
}

#[test]
fn a_full_device_keeps_room_for_the_next_area() {
    // 259 chunks of 4 KiB: header, area 0, its 256 data chunks and area 1 — nothing more.
    let dev = device(259 * 4096);
    let store = open(&dev, 8).store;
    for _ in 0..256 {
        store.allocate().unwrap();
    }
    assert_eq!(store.allocate(), Err(StoreError::Full));
    let dev = device(258 * 4096);
    let store = open(&dev, 8).store;
    for _ in 0..255 {
        store.allocate().unwrap();
    }
    assert_eq!(
        store.allocate(),
        Err(StoreError::Full),
        "the last data chunk of area 0 needs area 1 to exist"
    );
}

#[test]
fn invalidation_is_durable_and_refuses_more() {
    let dev = device(1 << 20);
    let store = open(&dev, 16).store;
    save(&store, [1, 2]);
    store.invalidate().unwrap();
    assert_eq!(store.allocate(), Err(StoreError::Invalid));
    assert_eq!(store.submit(&[]), Err(StoreError::Invalid));
    drop(store);
    assert_eq!(read(&dev, 4, 4), [0, 0, 0, 0]);
    let again = open(&dev, 16);
    assert!(!again.valid);
    assert!(again.records.is_empty());
}

#[test]
fn the_stored_chunk_size_wins_over_the_table() {
    let dev = device(1 << 20);
    drop(open(&dev, 16));
    let again = open(&dev, 32);
    assert_eq!(again.store.chunk_sectors(), 16);
    assert_eq!(open(&dev, 0).store.chunk_sectors(), 16);
    let fresh = device(1 << 20);
    assert_eq!(open(&fresh, 0).store.chunk_sectors(), 32, "the default");
}

#[test]
fn too_small_and_corrupt_devices_are_refused_with_the_reason() {
    let err = |dev: &Arc<MemoryDevice>, chunk| {
        PersistentStore::open(dev.clone() as Arc<dyn BlockDevice>, chunk)
            .err()
            .unwrap()
            .to_string()
    };
    let small = device(8 * KIB);
    assert!(err(&small, 8).contains("too small"), "{}", err(&small, 8));
    for bad in [12, 4, 4096, 1 << 40] {
        let e = err(&device(1 << 20), bad);
        assert!(e.contains(&format!("chunk size {bad}")), "{e}");
    }
    // A record pointing past the end, one pointing at a metadata chunk, duplicates.
    let cases: [(&[Record], &str); 4] = [
        (&[Record { old: 1, new: 300 }], "past the end"),
        (&[Record { old: 1, new: 1 }], "holds metadata"),
        (
            &[Record { old: 1, new: 2 }, Record { old: 1, new: 3 }],
            "origin chunk 1 a second time",
        ),
        (
            &[Record { old: 1, new: 2 }, Record { old: 2, new: 2 }],
            "COW chunk 2 a second time",
        ),
    ];
    for (records, expected) in cases {
        let dev = device(256 * 4096);
        drop(open(&dev, 8));
        let area = crate::snapshot::layout::area_image(&Geometry::new(8, 1 << 20), records);
        dev.write(4096, &area, WriteFlags::default()).unwrap();
        let e = err(&dev, 8);
        assert!(e.contains(expected), "{e}");
    }
    let garbage = device(1 << 20);
    garbage
        .write(0, &[0x11; 512], WriteFlags::default())
        .unwrap();
    assert!(err(&garbage, 8).contains("not a snapshot COW device"));
}

#[test]
fn records_after_the_terminator_are_wiped_at_open() {
    let dev = device(1 << 20);
    let store = open(&dev, 8).store;
    let saved = save(&store, [5, 6]);
    drop(store);
    // What a torn commit can leave: a record after the terminator.
    let stale = Record { old: 99, new: 40 };
    let mut slot = vec![0u8; 16];
    crate::snapshot::layout::put_record(&mut slot, 0, stale);
    dev.write(
        4096 + 512,
        &[&slot[..], &[0u8; 496]].concat(),
        WriteFlags::default(),
    )
    .unwrap();
    let again = open(&dev, 8);
    assert_eq!(again.records, saved);
    assert!(read(&dev, 4096 + 2 * 16, 4096 - 32).iter().all(|&b| b == 0));
}

#[test]
fn merging_truncates_from_the_tail_across_areas() {
    let dev = device(4 << 20);
    let store = open(&dev, 8).store;
    let records = save(&store, 0..600); // areas 0 and 1 full (256 each), 88 in area 2
    assert_eq!(store.usage().metadata, 4 * 8);
    let batch = store.merge_batch(100).unwrap();
    assert_eq!(batch, records[500..].to_vec());
    store.commit_merge(batch.len()).unwrap();
    // 500 left: area 2 emptied on disk, area 1 holds 244.
    assert_eq!(store.usage().metadata, 3 * 8);
    assert!(read(&dev, 515 * 4096, 4096).iter().all(|&b| b == 0));
    drop(store);
    let again = open(&dev, 8);
    assert_eq!(again.records, records[..500].to_vec());
    let store = again.store;
    // A batch across the end of area 0.
    let batch = store.merge_batch(300).unwrap();
    assert_eq!(batch, records[200..500].to_vec());
    store.commit_merge(300).unwrap();
    drop(store);
    let again = open(&dev, 8);
    assert_eq!(again.records, records[..200].to_vec());
    let store = again.store;
    loop {
        let batch = store.merge_batch(64).unwrap();
        if batch.is_empty() {
            break;
        }
        store.commit_merge(batch.len()).unwrap();
    }
    let usage = store.usage();
    assert_eq!(
        usage.allocated, usage.metadata,
        "merged: allocated == metadata, as the kernel reports it"
    );
    assert_eq!(usage.metadata, 16);
    drop(store);
    assert!(open(&dev, 8).records.is_empty());
}

#[test]
fn when_durable_tells_after_the_commit_and_at_once_when_it_is_done() {
    let dev = device(1 << 20);
    let store = open(&dev, 8).store;
    let (tx, rx) = std::sync::mpsc::channel();
    let record = Record {
        old: 1,
        new: store.allocate().unwrap(),
    };
    let ticket = store.submit(&[record]).unwrap();
    let told = tx.clone();
    store.when_durable(ticket, Box::new(move |r| told.send(r).unwrap()));
    assert_eq!(
        rx.recv_timeout(std::time::Duration::from_secs(5)).unwrap(),
        Ok(())
    );
    assert_eq!(
        store.stats().records,
        1,
        "told once the record is committed"
    );
    store.when_durable(ticket, Box::new(move |r| tx.send(r).unwrap()));
    assert_eq!(
        rx.try_recv().unwrap(),
        Ok(()),
        "a done commit tells at once"
    );
}

#[test]
fn when_durable_tells_a_failed_commit() {
    let dev = Arc::new(udm_testkit::Switchable::new(1 << 20));
    let store = PersistentStore::open(dev.clone() as Arc<dyn BlockDevice>, 8)
        .unwrap()
        .store;
    let new = store.allocate().unwrap();
    dev.fail_writes
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let ticket = store.submit(&[Record { old: 1, new }]).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    store.when_durable(ticket, Box::new(move |r| tx.send(r).unwrap()));
    let told = rx.recv_timeout(std::time::Duration::from_secs(5)).unwrap();
    assert!(matches!(told, Err(StoreError::Io(_))), "{told:?}");
}
