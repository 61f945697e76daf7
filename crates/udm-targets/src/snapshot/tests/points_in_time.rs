//! Points in time: what snapshots read after origin writes, writes to snapshots, full and
//! overflowing COW devices, discards, bad tables, reloads, origins named two ways.

use super::*;

#[test]
fn a_snapshot_keeps_reading_what_the_origin_held_when_it_was_taken() {
    let rig = Rig::new(4 * MIB);
    let cow = rig.cow(4 * MIB);
    let origin = rig.origin_table();
    let snap = rig.snapshot(&cow, "P 16");
    write(&origin, 8192, 4096, 2);
    write(&origin, 3 * MIB + 512, 1024, 3);
    assert!(read(&snap, 0, 4 * MIB as usize)[..] == original(4 * MIB)[..]);
    assert!(read(&origin, 8192, 4096)[..] == pattern(4096, 2)[..]);
    // Two chunks of 8 KiB saved: header + area + 2 data chunks of 16 sectors allocated.
    assert_eq!(target(&snap).status(), "64/8192 32");
    // Writing the same chunks again saves nothing more.
    write(&origin, 8192, 8192, 4);
    assert_eq!(target(&snap).status(), "64/8192 32");
    assert!(read(&snap, 0, 4 * MIB as usize)[..] == original(4 * MIB)[..]);
    assert_eq!(target(&origin).status(), "");
}

#[test]
fn passes_the_conformance_suite_as_origin_snapshot_and_merge() {
    let rig = Rig::new(8 * MIB);
    let cows = [rig.cow(16 * MIB), rig.cow(16 * MIB)];
    let origin = rig.origin_table();
    let snap = rig.snapshot(&cows[0], "P 8");
    conformance::run_all(&origin);
    conformance::run_all(&snap);
    let transient = rig.snapshot(&cows[1], "N 32");
    conformance::run_all(&transient);
    drop((origin, transient));
    drop(snap);
    let merge = rig.table(
        "origin-dev",
        &format!("snapshot-merge {} {} P 8", rig.origin, cows[0]),
    );
    conformance::run_all(&merge);
}

#[test]
fn four_snapshots_each_keep_their_own_point_in_time() {
    let rig = Rig::new(2 * MIB);
    let origin = rig.origin_table();
    let mut snaps = Vec::new();
    let mut expected = Vec::new();
    for (i, chunk) in [8u64, 16, 32, 8].into_iter().enumerate() {
        let cow = rig.cow(4 * MIB);
        expected.push(read(&origin, 0, 2 * MIB as usize));
        snaps.push(rig.snapshot(&cow, &format!("P {chunk}")));
        // Overlapping writes of different sizes after each snapshot.
        for j in 0..20u64 {
            write(
                &origin,
                ((i as u64 * 7919 + j * 40_961) % (2 * MIB - 8192)) & !511,
                6144,
                i as u64 * 100 + j,
            );
        }
    }
    for (snap, expected) in snaps.iter().zip(&expected) {
        assert!(read(snap, 0, 2 * MIB as usize)[..] == expected[..]);
    }
}

#[test]
fn writes_to_the_snapshot_stay_there_and_whole_chunks_skip_the_origin_read() {
    let rig = Rig::new(4 * MIB);
    let counted = Arc::new(Switchable::new(4 * MIB));
    counted
        .inner
        .write(0, &original(4 * MIB), WriteFlags::default())
        .unwrap();
    rig.set_origin(counted.clone());
    let cow = rig.cow(4 * MIB);
    let snap = rig.snapshot(&cow, "P 16");
    let reads = || counted.reads.load(Ordering::SeqCst);
    // A whole 8 KiB chunk: no origin read.
    write(&snap, 16384, 8192, 5);
    assert_eq!(reads(), 0);
    // Part of a chunk: the chunk is read once, the rest of it kept.
    write(&snap, 65536 + 1024, 512, 6);
    assert_eq!(reads(), 1);
    let chunk = read(&snap, 65536, 8192);
    assert!(chunk[..1024] == original(4 * MIB)[65536..65536 + 1024]);
    assert!(chunk[1024..1536] == pattern(512, 6)[..]);
    assert!(chunk[1536..] == original(4 * MIB)[65536 + 1536..65536 + 8192]);
    assert!(read(&snap, 16384, 8192)[..] == pattern(8192, 5)[..]);
    assert!(read(&*counted, 0, 4 * MIB as usize)[..] == original(4 * MIB)[..]);
}

#[test]
fn a_full_cow_invalidates_the_snapshot_and_the_origin_keeps_working() {
    let rig = Rig::new(4 * MIB);
    // Header, area and 6 data chunks of 4 KiB.
    let cow = rig.cow(8 * 4096);
    let origin = rig.origin_table();
    let snap = rig.snapshot(&cow, "P 8");
    for i in 0..6 {
        write(&origin, i * 65536, 4096, 10 + i);
    }
    assert_eq!(target(&snap).status(), "64/64 16");
    assert_eq!(rig.events.load(Ordering::SeqCst), 0);
    write(&origin, 6 * 65536, 4096, 20);
    assert_eq!(target(&snap).status(), "Invalid");
    assert_eq!(
        rig.events.load(Ordering::SeqCst),
        1,
        "invalidation raises an event"
    );
    let mut buf = AlignedBuf::zeroed(4096);
    assert_eq!(snap.read(0, &mut buf).unwrap_err().errno(), libc::EIO);
    assert_eq!(
        snap.write(0, &buf, WriteFlags::default())
            .unwrap_err()
            .errno(),
        libc::EIO
    );
    // The origin goes on, and no longer saves anything for the dropped snapshot.
    write(&origin, 7 * 65536, 4096, 21);
    assert!(read(&origin, 7 * 65536, 4096)[..] == pattern(4096, 21)[..]);
    // The invalidation is on disk: `valid` is 0 in the header.
    assert_eq!(read(&*rig.device(&cow), 4, 4)[..], [0, 0, 0, 0]);
    drop(snap);
    let again = rig.snapshot(&cow, "P 8");
    assert_eq!(target(&again).status(), "Invalid");
}

#[test]
fn po_overflows_on_snapshot_writes_and_keeps_reading() {
    let rig = Rig::new(4 * MIB);
    let cow = rig.cow(4 * 4096);
    let snap = rig.snapshot(&cow, "PO 8");
    write(&snap, 0, 4096, 3);
    write(&snap, 4096, 4096, 4);
    let err = snap
        .write(8192, &pattern(4096, 5), WriteFlags::default())
        .unwrap_err();
    assert_eq!(err.errno(), libc::EIO);
    assert_eq!(target(&snap).status(), "Overflow");
    assert!(read(&snap, 0, 4096)[..] == pattern(4096, 3)[..]);
    assert!(read(&snap, 8192, 4096)[..] == original(4 * MIB)[8192..12288]);
    // Even chunks it has fail to write now, as in the kernel.
    assert!(snap.write(0, &[0u8; 4096], WriteFlags::default()).is_err());
    assert_eq!(
        read(&*rig.device(&cow), 4, 4)[..],
        [1, 0, 0, 0],
        "still valid on disk"
    );
}

/// The kernel's discard features: whole chunks the snapshot holds read zeroes, chunks it
/// does not hold are left alone (no copy-out), and with passdown the origin itself is
/// discarded behind snapshot-origin's back. Without them, a discard changes nothing.
#[test]
fn discards_zero_the_snapshots_chunks_and_pass_down_to_the_origin_only_when_asked() {
    let rig = Rig::new(MIB);
    let origin = rig.origin_table();
    let plain = rig.cow(2 * MIB);
    let plain = rig.snapshot(&plain, "P 8");
    let cow = rig.cow(2 * MIB);
    let snap = rig.snapshot(&cow, "P 8 1 discard_zeroes_cow");
    assert_eq!(
        target(&snap).args().rsplit_once(" P 8").unwrap().1,
        " 1 discard_zeroes_cow",
        "the table line keeps its features"
    );
    assert!(snap.capabilities().discard && !plain.capabilities().discard);
    let was = original(MIB);
    write(&origin, 4096, 4096, 9); // chunk 1 saved into both snapshots
    write(&snap, 8192, 4096, 10); // chunk 2 written in the snapshot
    plain.discard(4096, 8192).unwrap();
    assert!(read(&plain, 4096, 8192)[..] == was[4096..12288], "ignored");
    snap.discard(4096, 4096 + 1024).unwrap();
    assert!(
        read(&snap, 4096, 4096).iter().all(|&b| b == 0),
        "whole chunk"
    );
    assert!(
        read(&snap, 9216, 3072)[..] == pattern(4096, 10)[1024..],
        "the rest of a partly discarded chunk stays"
    );
    snap.discard(12288, 4096).unwrap();
    assert!(read(&snap, 12288, 4096)[..] == was[12288..16384]);
    assert_eq!(target(&snap).status_details().unwrap()["exceptions"], 2);
    assert!(read(&origin, 12288, 4096)[..] == was[12288..16384]);

    let cow = rig.cow(2 * MIB);
    let passing = rig.snapshot(&cow, "P 8 2 discard_zeroes_cow discard_passdown_origin");
    passing.discard(16384, 4096).unwrap();
    assert!(
        read(&origin, 16384, 4096).iter().all(|&b| b == 0),
        "passed down to the origin"
    );
    assert!(
        read(&plain, 16384, 4096).iter().all(|&b| b == 0),
        "without a copy-out: other snapshots lose the chunk, as in the kernel"
    );
}

#[test]
fn bad_tables_are_refused_naming_the_problem() {
    let rig = Rig::new(4 * MIB);
    let cow = rig.cow(4 * MIB);
    let tiny = rig.cow(8192);
    let o = rig.origin.clone();
    let cases = [
        (
            format!("snapshot {o} {cow} P 12"),
            "chunk size 12 is not a power of two",
        ),
        (
            format!("snapshot {o} {cow} P 4"),
            "chunk size 4 is not a power of two from 8",
        ),
        (format!("snapshot {o} {cow} P 1048576"), "from 8 to 2048"),
        (format!("snapshot {o} {cow} P -8"), "expected a number"),
        (format!("snapshot {o} {cow} X 8"), "expected P, PO or N"),
        (format!("snapshot {o} {o} P 8"), "cannot be the origin"),
        (format!("snapshot {o} {tiny} P 8"), "too small"),
        (
            format!("snapshot {o} {cow} P"),
            "expected <origin> <COW device>",
        ),
        (
            format!("snapshot {o} {cow} P 8 1 discard_passdown_origin"),
            "discard_passdown_origin needs discard_zeroes_cow",
        ),
        (
            format!("snapshot {o} {cow} P 8 1 bogus"),
            "unrecognised feature 'bogus'",
        ),
        (
            format!("snapshot {o} {cow} P 8 2 discard_zeroes_cow"),
            "2 feature arguments announced, 1 given",
        ),
        (
            format!("snapshot {o} {cow} P 8 1"),
            "1 feature arguments announced, 0 given",
        ),
        (
            format!("snapshot {o} {cow} P 8 18446744073709551617 x"),
            "#feature args",
        ),
        (
            format!("snapshot-merge {o} {cow} N 8"),
            "transient (N) snapshot cannot be merged",
        ),
    ];
    for (line, expected) in cases {
        let err = rig.try_table("dev", &line).err().unwrap();
        assert!(err.contains(expected), "{line}: {err}");
    }
}

#[test]
fn a_reload_keeps_the_snapshot_and_a_transient_one_asks_to_be_dropped_after_a_restart() {
    let rig = Rig::new(4 * MIB);
    let (cow, scratch) = (rig.cow(4 * MIB), rig.cow(4 * MIB));
    let origin = rig.origin_table();
    let owner = format!("snap-{cow}");
    let line = format!("snapshot {} {cow} P 8", rig.origin);
    let first = rig.table(&owner, &line);
    write(&origin, 0, 8192, 2);
    // The new table is built while the old one is live, and shares its exceptions.
    let second = rig.table(&owner, &line);
    drop(first);
    write(&origin, 65536, 4096, 3);
    assert!(read(&second, 0, 4 * MIB as usize)[..] == original(4 * MIB)[..]);
    assert_eq!(target(&second).args(), format!("{} {cow} P 8", rig.origin));
    let transient = rig.snapshot(&scratch, "N 16");
    assert_eq!(target(&transient).settings_messages(), vec!["invalidate"]);
    assert!(target(&second).settings_messages().is_empty());
    assert_eq!(target(&transient).status(), "0/8192 0");
}

/// Tables meet by what they open, not by how they name it (the kernel keys origins by
/// dev_t): a snapshot naming the origin file by a hard link still gets its chunks saved
/// before the origin changes.
#[test]
fn an_origin_named_two_ways_is_one_origin() {
    let dir = udm_testkit::TempDir::new("snapshot-identity");
    let rig = Rig::new(MIB);
    rig.file_origin(&dir, MIB);
    let link = dir.path("link.img");
    std::fs::hard_link(dir.path("origin.img"), &link).unwrap();
    let linked = rig.add("link", file_device(&link, MIB));
    let origin = rig.origin_table();
    let cow = rig.cow(2 * MIB);
    let snap = rig.table(
        &format!("snap-{cow}"),
        &format!("snapshot {linked} {cow} P 8"),
    );
    write(&origin, 0, 4096, 9);
    assert!(
        read(&snap, 0, 4096).iter().all(|&b| b == 0),
        "the snapshot kept the chunk as it was"
    );
    // The COW device may not be the origin under another name either.
    let line = format!("snapshot {} {linked} P 8", rig.origin);
    rig.assert_refused("other", &line, &["cannot be the origin"]);
}
