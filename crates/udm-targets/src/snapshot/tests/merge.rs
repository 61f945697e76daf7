//! Merging a snapshot back into its origin (online rollback).

use super::*;

#[test]
fn one_merge_per_origin_and_never_beside_another_devices_snapshot_origin() {
    let rig = Rig::new(4 * MIB);
    let (a, b) = (rig.cow(4 * MIB), rig.cow(4 * MIB));
    let o = rig.origin.clone();
    let origin = rig.origin_table();
    drop(rig.snapshot(&a, "P 8"));
    drop(rig.snapshot(&b, "P 8"));
    let merge_a = format!("snapshot-merge {o} {a} P 8");
    rig.assert_refused(
        "other",
        &merge_a,
        &["serves origin", "with snapshot-origin"],
    );
    // In the origin device's own table, the merge takes the snapshot-origin's place.
    let merge = rig.table("origin-dev", &merge_a);
    drop(origin);
    let merge_b = format!("snapshot-merge {o} {b} P 8");
    rig.assert_refused("third", &merge_b, &["already being merged"]);
    // The same COW device merged by a second device: two merges would copy it back twice.
    let by_origin_dev = "already being merged by device 'origin-dev'";
    rig.assert_refused("third", &merge_a, &[by_origin_dev]);
    let origin_line = format!("snapshot-origin {o}");
    rig.assert_refused(
        "fourth",
        &origin_line,
        &["is being merged by device 'origin-dev'"],
    );
    let fresh = rig.cow(4 * MIB);
    let snapshot = format!("snapshot {o} {fresh} P 8");
    rig.assert_refused(
        "fifth",
        &snapshot,
        &["take snapshots of it once the merge is done"],
    );
    drop(merge);
    rig.table("fourth", &format!("snapshot-origin {o}"));
}

/// Drives a merge to its end, checking the progress it reports on the way.
fn wait_merged(merge: &Table, events: &AtomicU64, events_before: u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while events.load(Ordering::SeqCst) == events_before {
        assert!(
            Instant::now() < deadline,
            "merge did not finish: {}",
            target(merge).status()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let details = target(merge).status_details().unwrap();
    assert_eq!(details["progress"]["complete"], true, "{details}");
    assert_eq!(
        details["progress"]["done_bytes"],
        details["progress"]["total_bytes"]
    );
}

#[test]
fn a_merge_rolls_the_origin_back_while_writes_go_on_and_resumes_after_a_restart() {
    let rig = Rig::new(8 * MIB);
    let cow = rig.cow(16 * MIB);
    let o = rig.origin.clone();
    let origin = rig.origin_table();
    let snap = rig.snapshot(&cow, "P 8");
    // Change most of the origin, in scattered writes.
    for i in 0..1500u64 {
        write(&origin, (i * 5573 * 4096) % (8 * MIB), 4096, 1000 + i);
    }
    let snapshot_view = read(&snap, 0, 8 * MIB as usize);
    assert!(snapshot_view[..] == original(8 * MIB)[..]);
    // The LVM way: suspend the origin, drop the snapshot device, load the merge in the
    // origin device's place.
    drop(snap);
    drop(origin);
    let merge = rig.table("origin-dev", &format!("snapshot-merge {o} {cow} P 8"));
    target(&merge).message(&["max_merge_rate", "4096"]).unwrap();
    // At once the device reads as the snapshot did.
    assert!(read(&merge, 0, 8 * MIB as usize)[..] == snapshot_view[..]);
    // A restart in the middle: the table goes away and comes back from the devices.
    std::thread::sleep(Duration::from_millis(300));
    merge.suspend();
    let left = |merge: &Table| target(merge).status_details().unwrap()["exceptions"].as_u64();
    let before = left(&merge).unwrap();
    drop(merge);
    let merge = rig.table("origin-dev", &format!("snapshot-merge {o} {cow} P 8"));
    // It goes on from what is left on the COW device (already merging again).
    let after = left(&merge).unwrap();
    assert!(
        after <= before && after > 0,
        "{before} chunks left, then {after}"
    );
    // Writes while merging: into merged and unmerged chunks alike.
    let events = rig.events.load(Ordering::SeqCst);
    let mut expected = snapshot_view;
    for i in 0..200u64 {
        let at = (i * 7919 * 4096 + 512) % (8 * MIB - 8192);
        let data = pattern(6144, 5000 + i);
        merge.write(at, &data, WriteFlags::default()).unwrap();
        expected[at as usize..at as usize + 6144].copy_from_slice(&data);
    }
    target(&merge).message(&["max_merge_rate", "0"]).unwrap();
    wait_merged(&merge, &rig.events, events);
    let status = target(&merge).status();
    let (allocated, metadata) = parse_status(&status);
    assert_eq!(allocated, metadata, "merged: {status}");
    assert!(read(&merge, 0, 8 * MIB as usize)[..] == expected[..]);
    assert!(read(&*rig.device(&o), 0, 8 * MIB as usize)[..] == expected[..]);
    assert_eq!(
        target(&merge).replacement().unwrap().unwrap(),
        format!("snapshot-origin {o}")
    );
}

/// lvm polls the status line until the allocated sectors are the metadata's, then asks for
/// the merge's end at once. The worker found the merge done only at its next round, which a
/// pause (a rate cap here, the user's I/O in the attack) put off by up to a second: finalize
/// refused "the merge is not complete (0 chunks left)" while the status said merged.
#[test]
fn the_merge_is_finalizable_as_soon_as_its_status_says_merged() {
    let rig = Rig::new(4 * MIB);
    let cow = rig.cow(8 * MIB);
    let o = rig.origin.clone();
    let origin = rig.origin_table();
    let snap = rig.snapshot(&cow, "P 8");
    for i in 0..64u64 {
        write(&origin, i * 16 * 4096, 4096, 10 + i);
    }
    drop(snap);
    drop(origin);
    let merge = rig
        .try_load("origin-dev", &format!("snapshot-merge {o} {cow} P 8"))
        .unwrap();
    // 512 KiB/s: batches of 32 chunks, a quarter of a second apart; the 64 chunks are
    // merged by the second batch, and the worker's next round is a quarter of a second on.
    target(&merge).message(&["max_merge_rate", "512"]).unwrap();
    merge.resume();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let status = target(&merge).status();
        let (allocated, metadata) = parse_status(&status);
        if allocated == metadata {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the merge did not finish: {status}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let finalized = target(&merge).replacement().unwrap();
    assert_eq!(finalized.unwrap(), format!("snapshot-origin {o}"));
    let details = target(&merge).status_details().unwrap();
    assert_eq!(details["progress"]["complete"], true, "{details}");
}

fn parse_status(status: &str) -> (u64, u64) {
    let (used, metadata) = status.split_once(' ').unwrap();
    let allocated = used.split_once('/').unwrap().0;
    (allocated.parse().unwrap(), metadata.parse().unwrap())
}

/// The merge takes the COW device over from a snapshot device that is still live (refused
/// when the user resumes the merge, but a restart resumes what it restores before it
/// suspends it, and a resume of the snapshot device may race the merge's; this table is
/// resumed without the preresume check, as a restart's): a write to the snapshot remapped
/// onto a saved chunk and still under way then must land before the merge copies that chunk
/// back. It landed after, in a COW chunk already merged: completed, and lost.
#[test]
fn a_snapshot_write_under_way_at_the_handover_lands_before_its_chunk_is_merged() {
    use udm_block::MapOp;
    let dir = udm_testkit::TempDir::new("merge-handover");
    let rig = Rig::new(MIB);
    rig.file_origin(&dir, MIB);
    let cow = rig.add("cow", file_device(&dir.path("cow.img"), 4 * MIB));
    let o = rig.origin.clone();
    let origin = rig.origin_table();
    let snap = rig.snapshot(&cow, "P 8");
    write(&origin, 0, 4096, 2);
    let op = MapOp::Write { fua: false };
    let under_way = snap.map(op, 0, 4096).expect("a saved chunk remaps");
    drop(origin);
    let mut data = pattern(4096, 3);
    let merge = std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(200));
            execute(op, under_way, &mut data);
        });
        rig.table("origin-dev", &format!("snapshot-merge {o} {cow} P 8"))
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while target(&merge).status_details().unwrap()["progress"]["complete"] != true {
        assert!(Instant::now() < deadline, "the merge did not finish");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        read(&merge, 0, 4096)[..] == pattern(4096, 3)[..],
        "the write the snapshot completed is not in the merged origin"
    );
    assert!(
        snap.write(0, &pattern(4096, 4), WriteFlags::default())
            .is_err(),
        "a write after the handover lands nowhere and must fail"
    );
}
