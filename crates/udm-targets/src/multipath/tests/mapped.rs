//! Requests remapped onto the chosen path, and what a mapped request's failure does.

use super::*;

#[test]
fn requests_map_onto_the_chosen_file_and_count_until_they_complete() {
    use udm_block::{FileDevice, MapOp, OpenMode, Place};
    let dir = udm_testkit::TempDir::new("mp-map");
    // Two names of one file: two routes to one disk.
    let (a, b) = (dir.path("a.img"), dir.path("b.img"));
    std::fs::File::create(&a).unwrap().set_len(4 * MIB).unwrap();
    std::fs::hard_link(&a, &b).unwrap();
    let files = Devices::default();
    for (name, path) in [("a", &a), ("b", &b)] {
        let file = FileDevice::open(path, OpenMode::ReadWrite).unwrap();
        files.add(name, Arc::new(file), false);
    }
    let table = build(
        &files,
        &format!("0 {SECTORS} multipath 0 0 1 1 queue-length 0 2 1 a 1 b 1"),
    )
    .unwrap();
    let file_of = |mapping: &udm_block::Mapping| match &mapping.pieces[0].place {
        Place::File { file, offset } => {
            assert_eq!(*offset, 8192);
            file.path().to_path_buf()
        }
        Place::Zero => panic!("mapped to zeroes"),
    };
    // The first mapping is held (in flight): queue-length sends the next one to b.
    let first = table.map(MapOp::Read, 8192, 4096).unwrap();
    assert_eq!(file_of(&first), a);
    assert!(target(&table).status().ends_with("a A 0 1 b A 0 0"));
    let second = table.map(MapOp::Write { fua: false }, 8192, 4096).unwrap();
    assert_eq!(file_of(&second), b);
    drop((first, second));
    assert!(target(&table).status().ends_with("a A 0 0 b A 0 0"));
    // A flush with several usable paths goes the synchronous way (one down each path at
    // once, each failure failing its own path); with one, it maps onto it.
    assert!(table.map(MapOp::Flush, 0, 0).is_none());
    message(&table, "fail_path a").unwrap();
    for _ in 0..3 {
        assert_eq!(file_of(&table.map(MapOp::Read, 8192, 4096).unwrap()), b);
    }
    assert_eq!(table.map(MapOp::Flush, 0, 0).unwrap().pieces.len(), 1);
    // With no usable path a request may have to wait: it goes the synchronous way.
    message(&table, "fail_path b").unwrap();
    assert!(table.map(MapOp::Read, 0, 4096).is_none());
    assert!(table.map(MapOp::Flush, 0, 0).is_none());
    // Paths that do not map (remote ones) are never mapped onto.
    let rig = Rig::new();
    let (table, _) = rig.build(TWO_PATHS);
    assert!(table.map(MapOp::Read, 0, 4096).is_none());
}

#[test]
fn a_mapped_request_that_fails_fails_its_path_and_is_retried_the_synchronous_way() {
    use udm_block::{Completed, MapOp};
    let dir = udm_testkit::TempDir::new("mp-retry");
    let table = file_paths(&dir);
    let eio = BlockError::Os {
        context: "read".into(),
        errno: libc::EIO,
    };
    // Round-robin: the first request goes down a.
    let mapping = table.map(MapOp::Read, 0, 4096).unwrap();
    assert!(mapping.retry_on_error, "a failure would reach the client");
    for told in mapping.on_complete {
        told(Completed::Retried(&eio));
    }
    assert!(target(&table).status().ends_with("a F 1 b A 0"));
    // The retry (the synchronous read) goes down b.
    read(&table, 0).unwrap();
    // An error any path would give (no space) does not fail the path; the retry returns it.
    let enospc = BlockError::Os {
        context: "write".into(),
        errno: libc::ENOSPC,
    };
    let mapping = table.map(MapOp::Write { fua: false }, 0, 4096).unwrap();
    for told in mapping.on_complete {
        told(Completed::Retried(&enospc));
    }
    assert!(target(&table).status().ends_with("a F 1 b A 0"));
}
