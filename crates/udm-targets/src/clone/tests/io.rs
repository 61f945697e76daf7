//! The clone's I/O path: what reads, writes, discards and the rest do to regions.

use super::*;

#[test]
fn passes_the_conformance_suite_while_hydrating_and_without() {
    for args in [
        "8 1 no_hydration",
        "8 0 4 hydration_threshold 64 hydration_batch_size 16",
        "64",
    ] {
        let r = rig(8 * MIB, args);
        conformance::run_all(&r.table);
    }
}

#[test]
fn unhydrated_reads_come_from_the_source_and_copy_nothing() {
    let r = rig(4 * MIB, "8 1 no_hydration");
    let expected = pattern(2 * MIB as usize, 1);
    assert!(read(&r.table, 4096, 8192)[..] == expected[4096..12288]);
    assert_eq!(r.dest.writes.load(Ordering::SeqCst), 0);
    assert!(
        r.status().contains(" 0/1024 0 1 no_hydration "),
        "{}",
        r.status()
    );
}

#[test]
fn full_region_writes_skip_the_copy_and_partial_writes_copy_once() {
    let r = rig(4 * MIB, "16 1 no_hydration");
    let source_reads = || r.source.reads.load(Ordering::SeqCst);
    // A write covering regions 1 and 2 entirely (8 KiB regions): no source read.
    let data = pattern(16384, 9);
    r.table.write(8192, &data, WriteFlags::default()).unwrap();
    assert_eq!(source_reads(), 0);
    assert!(r.status().contains(" 2/512 "), "{}", r.status());
    // A 512-byte write into region 5 copies it first; its other bytes keep the source data.
    // The copy and the write reach the destination as one write of the region.
    let dest_writes = r.dest.writes.load(Ordering::SeqCst);
    r.table
        .write(5 * 8192 + 512, &[0xee; 512], WriteFlags::default())
        .unwrap();
    assert_eq!(source_reads(), 1);
    assert_eq!(r.dest.writes.load(Ordering::SeqCst), dest_writes + 1);
    let region = read(&r.table, 5 * 8192, 8192);
    let expected = pattern(2 * MIB as usize, 1);
    assert!(region[..512] == expected[5 * 8192..5 * 8192 + 512]);
    assert!(region[512..1024].iter().all(|&b| b == 0xee));
    assert!(region[1024..] == expected[5 * 8192 + 1024..6 * 8192]);
    assert!(r.status().contains(" 3/512 "), "{}", r.status());
}

#[test]
fn concurrent_writes_to_one_region_wait_for_one_copy() {
    let r = rig(4 * MIB, "128 1 no_hydration");
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let table = &r.table;
            s.spawn(move || {
                table
                    .write(t * 4096, &[t as u8 + 1; 4096], WriteFlags::default())
                    .unwrap();
            });
        }
    });
    // One 64 KiB region, copied once (in one read), every write on top of it.
    assert_eq!(r.source.reads.load(Ordering::SeqCst), 1);
    let region = read(&r.table, 0, 65536);
    for t in 0..8usize {
        assert!(region[t * 4096..(t + 1) * 4096]
            .iter()
            .all(|&b| b == t as u8 + 1));
    }
    let expected = pattern(65536, 1);
    assert!(region[32768..] == expected[32768..]);
}

#[test]
fn discards_mark_covered_regions_hydrated_without_copying() {
    let r = rig(4 * MIB, "8 1 no_hydration");
    // 10 KiB from 2 KiB: regions 1 and 2 are covered, 0 and 3 only in part.
    r.table.discard(2048, 10240).unwrap();
    assert!(r.status().contains(" 2/1024 "), "{}", r.status());
    r.table.discard(0, 4 * MIB).unwrap();
    assert!(r.status().contains(" 1024/1024 "), "{}", r.status());
    assert_eq!(r.source.reads.load(Ordering::SeqCst), 0);
    assert_eq!(
        r.events.load(Ordering::SeqCst),
        1,
        "hydration complete raises an event"
    );
}

#[test]
fn source_errors_fail_only_the_affected_requests() {
    let r = rig(4 * MIB, "8 1 no_hydration");
    r.source.fail_reads.store(true, Ordering::SeqCst);
    let mut buf = AlignedBuf::zeroed(4096);
    assert_eq!(r.table.read(0, &mut buf).unwrap_err().errno(), libc::EIO);
    assert_eq!(
        r.table
            .write(512, &[1; 512], WriteFlags::default())
            .unwrap_err()
            .errno(),
        libc::EIO
    );
    // Full-region writes and reads of hydrated regions need no source.
    r.table
        .write(8192, &[7; 4096], WriteFlags::default())
        .unwrap();
    r.table.read(8192, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 7));
    assert!(r.status().ends_with(" rw"));
    r.source.fail_reads.store(false, Ordering::SeqCst);
    r.table
        .write(512, &[1; 512], WriteFlags::default())
        .unwrap();
}

#[test]
fn block_status_tells_what_reads_would_return() {
    let r = rig(4 * MIB, "8 1 no_hydration");
    // Source: data in the first 2 MiB, hole after.
    let extents = r.table.block_status(2 * MIB, 2 * MIB).unwrap();
    assert_eq!(
        extents[0].flags & udm_block::EXTENT_ZERO,
        udm_block::EXTENT_ZERO
    );
    r.table
        .write_zeroes(2 * MIB, 8192, ZeroFlags::default())
        .unwrap();
    r.table
        .write(3 * MIB, &[1; 4096], WriteFlags::default())
        .unwrap();
    let extents = r.table.block_status(3 * MIB, 4096).unwrap();
    assert_eq!(extents[0].flags, 0, "hydrated data region");
}

#[test]
fn hydrate_on_read_copies_what_is_read() {
    let r = rig(4 * MIB, "8 2 no_hydration hydrate_on_read");
    read(&r.table, 0, 16384);
    assert!(r.status().contains(" 4/1024 "), "{}", r.status());
    assert!(read(&*r.dest, 0, 16384)[..] == pattern(16384, 1)[..]);
}

#[test]
fn cache_requests_hydrate_the_range() {
    let r = rig(4 * MIB, "8 1 no_hydration");
    r.table.cache(MIB, 65536).unwrap();
    assert!(r.status().contains(" 16/1024 "), "{}", r.status());
}

#[test]
fn hydrated_regions_remap_onto_the_destination_and_the_rest_stays_with_the_clone() {
    use udm_block::{FileDevice, MapOp, OpenMode, Place};
    let dir = udm_testkit::TempDir::new("clone-map");
    let path = dir.sparse("dest.img", 4 * MIB);
    let dest = Arc::new(FileDevice::open(&path, OpenMode::ReadWrite).unwrap());
    let devices = switchables(&[("meta", MIB), ("source", 4 * MIB)]);
    devices.add("dest", dest, false);
    let text = "0 8192 clone meta dest source 16 1 no_hydration";
    let (table, _) = build_counting_events(&devices, text).unwrap();
    assert!(
        table.map(MapOp::Read, 8192, 8192).is_none(),
        "not hydrated yet"
    );
    // A whole-region write hydrates region 1.
    let data = pattern(8192, 3);
    table.write(8192, &data, WriteFlags::default()).unwrap();
    let mapping = table
        .map(MapOp::Read, 8192, 8192)
        .expect("hydrated: remapped");
    assert_eq!(mapping.pieces.len(), 1);
    let piece = &mapping.pieces[0];
    match &piece.place {
        Place::File { file, offset } => {
            assert_eq!(
                (file.path(), *offset, piece.len),
                (path.as_path(), 8192, 8192)
            );
        }
        Place::Zero => panic!("mapped to zeroes"),
    }
    assert!(
        table.map(MapOp::Read, 8192, 16384).is_none(),
        "region 2 is not hydrated"
    );
    assert!(table.map(MapOp::Write { fua: false }, 8192, 4096).is_some());
    // These commit the bitmap, which only the clone can do.
    assert!(table.map(MapOp::Write { fua: true }, 8192, 4096).is_none());
    assert!(table.map(MapOp::Flush, 0, 0).is_none());
    drop(mapping);
}
