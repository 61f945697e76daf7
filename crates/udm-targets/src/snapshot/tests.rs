//! The snapshot targets against in-memory devices: points in time, copy-out, locking,
//! overflow, merging, reloads, and power cuts at every write.

use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use udm_block::{AlignedBuf, BlockDevice, MemoryDevice, WriteFlags};
use udm_testkit::{conformance, pattern, CrashDevice, PowerSwitch};

use crate::table::Table;
use crate::testing::{Devices, Switchable};
use crate::Target;

const MIB: u64 = 1 << 20;

/// Rendezvous are process-wide: every test names its devices uniquely.
fn unique(tag: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!("{tag}{}", N.fetch_add(1, Ordering::Relaxed))
}

/// Named devices and tables over them, each table owned by a device name of its own.
struct Rig {
    devices: Devices,
    events: Arc<AtomicU64>,
    origin: String,
}

impl Rig {
    /// An origin of `size` bytes holding pattern 1.
    fn new(size: u64) -> Rig {
        let origin = unique("origin");
        let dev = Arc::new(MemoryDevice::new(size));
        dev.write(0, &pattern(size as usize, 1), WriteFlags::default())
            .unwrap();
        let rig = Rig {
            devices: Devices::default(),
            events: Arc::new(AtomicU64::new(0)),
            origin: origin.clone(),
        };
        rig.devices.add(&origin, dev, false);
        rig
    }

    fn add(&self, tag: &str, dev: Arc<dyn BlockDevice>) -> String {
        let name = unique(tag);
        self.devices.add(&name, dev, false);
        name
    }

    /// Puts `dev` in the origin's place.
    fn set_origin(&self, dev: Arc<dyn BlockDevice>) {
        self.devices.add(&self.origin, dev, false);
    }

    fn cow(&self, size: u64) -> String {
        self.add("cow", Arc::new(MemoryDevice::new(size)))
    }

    fn device(&self, name: &str) -> Arc<dyn BlockDevice> {
        self.devices.get(name)
    }

    fn origin_size(&self) -> u64 {
        self.device(&self.origin).size()
    }

    fn try_table(&self, owner: &str, line: &str) -> Result<Table, String> {
        let events = self.events.clone();
        let text = format!("0 {} {line}", self.origin_size() / 512);
        let table = Table::build(
            owner,
            &text,
            &self.devices,
            Arc::new(move || {
                events.fetch_add(1, Ordering::SeqCst);
            }),
        )
        .map_err(|e| e.to_string())?;
        table.resume();
        Ok(table)
    }

    fn table(&self, owner: &str, line: &str) -> Table {
        self.try_table(owner, line).unwrap()
    }

    /// The origin device's table.
    fn origin_table(&self) -> Table {
        self.table("origin-dev", &format!("snapshot-origin {}", self.origin))
    }

    fn snapshot(&self, cow: &str, args: &str) -> Table {
        self.table(
            &format!("snap-{cow}"),
            &format!("snapshot {} {cow} {args}", self.origin),
        )
    }
}

fn target(table: &Table) -> &Arc<dyn Target> {
    table.target_at(0).unwrap()
}

fn read(dev: &dyn BlockDevice, offset: u64, len: usize) -> AlignedBuf {
    let mut buf = AlignedBuf::zeroed(len);
    dev.read(offset, &mut buf).unwrap();
    buf
}

fn write(dev: &dyn BlockDevice, offset: u64, len: usize, seed: u64) {
    dev.write(offset, &pattern(len, seed), WriteFlags::default())
        .unwrap();
}

fn original(size: u64) -> AlignedBuf {
    pattern(size as usize, 1)
}

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

/// An origin whose reads of one offset wait until released: a copy of that chunk is then
/// stuck for as long as the test wants.
struct Gated {
    inner: MemoryDevice,
    blocked: u64,
    open: Mutex<bool>,
    opened: Condvar,
    waiting: AtomicBool,
}

impl BlockDevice for Gated {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> udm_block::Result<()> {
        if offset == self.blocked {
            self.waiting.store(true, Ordering::SeqCst);
            let mut open = self.open.lock();
            while !*open {
                self.opened.wait(&mut open);
            }
        }
        self.inner.read(offset, buf)
    }
    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> udm_block::Result<()> {
        self.inner.write(offset, buf, flags)
    }
    fn flush(&self) -> udm_block::Result<()> {
        Ok(())
    }
}

#[test]
fn origin_writes_to_different_chunks_never_wait_for_each_other() {
    let rig = Rig::new(MIB);
    let gated = Arc::new(Gated {
        inner: MemoryDevice::new(MIB),
        blocked: 0,
        open: Mutex::new(false),
        opened: Condvar::new(),
        waiting: AtomicBool::new(false),
    });
    rig.set_origin(gated.clone());
    let cow = rig.cow(4 * MIB);
    let origin = rig.origin_table();
    let snap = rig.snapshot(&cow, "P 8");
    std::thread::scope(|s| {
        let stuck = s.spawn(|| write(&origin, 0, 4096, 1));
        while !gated.waiting.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        // Chunk 0's copy is stuck; writes to other chunks (and reads of the snapshot's other
        // chunks) go through.
        let t = Instant::now();
        for chunk in 1..50 {
            write(&origin, chunk * 4096, 4096, chunk);
        }
        assert!(read(&snap, 4096, 4096)[..] == [0u8; 4096][..]);
        assert!(t.elapsed() < Duration::from_secs(2));
        assert!(!stuck.is_finished(), "chunk 0's write waits for its copy");
        *gated.open.lock() = true;
        gated.opened.notify_all();
        stuck.join().unwrap();
    });
    assert!(read(&snap, 0, MIB as usize).iter().all(|&b| b == 0));
}

#[test]
fn concurrent_first_writes_share_commits() {
    let rig = Rig::new(16 * MIB);
    let cow = rig.cow(32 * MIB);
    let origin = rig.origin_table();
    let snap = rig.snapshot(&cow, "P 8");
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let origin = &origin;
            s.spawn(move || {
                for i in 0..64 {
                    write(origin, (t * 64 + i) * 8192, 4096, t);
                }
            });
        }
    });
    let details = target(&snap).status_details().unwrap();
    assert_eq!(details["exceptions_committed"], 512);
    let commits = details["commits"].as_u64().unwrap();
    assert!(commits < 512, "one commit per exception: {details}");
    assert!(read(&snap, 0, 16 * MIB as usize)[..] == original(16 * MIB)[..]);
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
fn one_merge_per_origin_and_never_beside_another_devices_snapshot_origin() {
    let rig = Rig::new(4 * MIB);
    let (a, b) = (rig.cow(4 * MIB), rig.cow(4 * MIB));
    let o = rig.origin.clone();
    let origin = rig.origin_table();
    drop(rig.snapshot(&a, "P 8"));
    drop(rig.snapshot(&b, "P 8"));
    let err = rig
        .try_table("other", &format!("snapshot-merge {o} {a} P 8"))
        .err()
        .unwrap();
    assert!(
        err.contains("serves origin") && err.contains("with snapshot-origin"),
        "{err}"
    );
    // In the origin device's own table, the merge takes the snapshot-origin's place.
    let merge = rig.table("origin-dev", &format!("snapshot-merge {o} {a} P 8"));
    drop(origin);
    let err = rig
        .try_table("third", &format!("snapshot-merge {o} {b} P 8"))
        .err()
        .unwrap();
    assert!(err.contains("already being merged"), "{err}");
    // The same COW device merged by a second device: two merges would copy it back twice.
    let err = rig
        .try_table("third", &format!("snapshot-merge {o} {a} P 8"))
        .err()
        .unwrap();
    assert!(
        err.contains("already being merged by device 'origin-dev'"),
        "{err}"
    );
    let err = rig
        .try_table("fourth", &format!("snapshot-origin {o}"))
        .err()
        .unwrap();
    assert!(
        err.contains("is being merged by device 'origin-dev'"),
        "{err}"
    );
    let fresh = rig.cow(4 * MIB);
    let err = rig
        .try_table("fifth", &format!("snapshot {o} {fresh} P 8"))
        .err()
        .unwrap();
    assert!(
        err.contains("take snapshots of it once the merge is done"),
        "{err}"
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

fn parse_status(status: &str) -> (u64, u64) {
    let (used, metadata) = status.split_once(' ').unwrap();
    let allocated = used.split_once('/').unwrap().0;
    (allocated.parse().unwrap(), metadata.parse().unwrap())
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

/// A power cut at every write, cutting the origin and the COW device at once: after it,
/// the snapshot reads exactly what the origin held when it was taken, and every origin write
/// that was flushed is there.
#[test]
fn a_power_cut_at_any_write_keeps_the_snapshot_exact() {
    const SIZE: u64 = 512 * 1024;
    let mut cuts = 0;
    let mut cut_at = 1;
    loop {
        // The first write (the origin's contents) is not one to cut at.
        let power = PowerSwitch::new(cut_at + 1);
        let seed = cut_at;
        let origin_dev = Arc::new(CrashDevice::on_power(SIZE, power.clone(), seed));
        origin_dev
            .write(0, &original(SIZE), WriteFlags { fua: true })
            .unwrap();
        let cow_dev = Arc::new(CrashDevice::on_power(
            4 * MIB,
            power.clone(),
            seed + 1_000_000,
        ));
        let rig = Rig::new(SIZE);
        rig.set_origin(origin_dev.clone());
        let cow = rig.add("cow", cow_dev.clone());
        let mut flushed: HashMap<u64, u64> = HashMap::new();
        let mut unflushed: Vec<(u64, u64)> = Vec::new();
        let mut x = cut_at | 1;
        let mut run = || -> Result<(), String> {
            let origin = rig.try_table("origin-dev", &format!("snapshot-origin {}", rig.origin))?;
            let _snap = rig.try_table("snap-dev", &format!("snapshot {} {cow} P 8", rig.origin))?;
            for i in 0..40u64 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let block = x % (SIZE / 4096);
                // A write in flight at the cut may land, in part.
                unflushed.push((block, 100 + i));
                origin
                    .write(block * 4096, &pattern(4096, 100 + i), WriteFlags::default())
                    .map_err(|e| e.to_string())?;
                if i % 5 == 4 {
                    origin.flush().map_err(|e| e.to_string())?;
                    flushed.extend(unflushed.drain(..));
                }
            }
            Ok(())
        };
        let outcome = run();
        if !power.is_cut() {
            outcome.unwrap();
            break;
        }
        cuts += 1;
        let after = Rig::new(SIZE);
        after.set_origin(Arc::new(origin_dev.after_power_cut()));
        let cow = after.add("cow", Arc::new(cow_dev.after_power_cut()));
        let snap = after
            .try_table("snap-dev", &format!("snapshot {} {cow} P 8", after.origin))
            .unwrap_or_else(|e| panic!("cut at write {cut_at}: the snapshot does not load: {e}"));
        assert!(
            read(&snap, 0, SIZE as usize)[..] == original(SIZE)[..],
            "cut at write {cut_at}: the snapshot changed"
        );
        let origin = read(&*after.device(&after.origin), 0, SIZE as usize);
        for (block, seed) in &flushed {
            let at = (*block * 4096) as usize;
            let newer = unflushed.iter().any(|(b, _)| b == block);
            assert!(
                newer || origin[at..at + 4096] == pattern(4096, *seed)[..],
                "cut at write {cut_at}: flushed origin block {block} lost"
            );
        }
        cut_at += 1;
    }
    assert!(cuts >= 100, "only {cuts} cut points");
    eprintln!("snapshot targets: {cuts} power-cut points checked");
}

/// What the hot path may remap onto files, on real files: an origin write only once every
/// snapshot has the chunk saved, a snapshot read of an unsaved chunk onto the origin while
/// holding the chunk (so that a copy-out of it waits for the read to complete).
#[test]
fn remapping_goes_straight_to_the_files_only_where_nothing_needs_saving() {
    use udm_block::{FileDevice, MapOp, OpenMode};
    let dir = udm_testkit::TempDir::new("snapshot-map");
    let file = |name: &str, size: u64| {
        let path = dir.path(name);
        std::fs::File::create(&path).unwrap().set_len(size).unwrap();
        Arc::new(FileDevice::open(&path, OpenMode::ReadWrite).unwrap()) as Arc<dyn BlockDevice>
    };
    let rig = Rig::new(MIB);
    rig.set_origin(file("origin.img", MIB));
    let cow = rig.add("cow", file("cow.img", 4 * MIB));
    let origin = rig.origin_table();
    let snap = rig.snapshot(&cow, "P 8");
    let write = MapOp::Write { fua: false };
    let first = origin.map(write, 8192, 4096).expect("mapped");
    assert!(!first.is_ready(), "chunk 2 is saved first");
    drop(first);
    assert_eq!(
        target(&snap).status_details().unwrap()["exceptions"],
        0,
        "a mapping dropped unused saves nothing"
    );
    let mut data = pattern(4096, 5);
    execute(write, origin.map(write, 4096, 4096).unwrap(), &mut data);
    assert_eq!(target(&snap).status_details().unwrap()["exceptions"], 1);
    assert!(
        read(&snap, 4096, 4096).iter().all(|&b| b == 0),
        "the snapshot keeps the chunk as it was"
    );
    assert!(
        read(&origin, 4096, 4096)[..] == data[..],
        "the write landed"
    );
    assert!(origin.map(MapOp::Read, 8192, 4096).is_some());
    // Snapshot reads of unsaved chunks map onto the origin and hold the chunk.
    let held = snap.map(MapOp::Read, 8192, 4096).expect("mapped");
    std::thread::scope(|s| {
        let writer = s.spawn(|| write_pattern(&origin, 8192));
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !writer.is_finished(),
            "the copy-out waits for the mapped read"
        );
        drop(held);
        writer.join().unwrap();
    });
    let mapping = origin
        .map(write, 8192, 4096)
        .expect("saved: straight to the origin");
    assert_eq!(mapping.pieces.len(), 1);
    assert!(mapping.is_ready(), "saved: nothing to wait for");
    assert!(
        !origin.map(write, 8192, 8192).unwrap().is_ready(),
        "chunk 3 is not saved"
    );
    // The snapshot's saved chunk maps onto the COW device, reads and writes alike.
    assert!(snap.map(MapOp::Read, 8192, 4096).is_some());
    assert!(snap.map(write, 8192, 4096).is_some());
    assert!(
        snap.map(write, 12288, 4096).is_none(),
        "a new exception is not a remap"
    );
    assert!(read(&snap, 8192, 4096).iter().all(|&b| b == 0));
}

/// Runs a mapping as an executor does: waits for its steps, then its pieces, on files.
fn execute(op: udm_block::MapOp, mapping: udm_block::Mapping, buf: &mut [u8]) {
    use std::os::fd::BorrowedFd;
    let (tx, rx) = std::sync::mpsc::channel();
    mapping.when_ready(move |ready| tx.send(ready).unwrap());
    let mapping = rx
        .recv_timeout(Duration::from_secs(10))
        .unwrap()
        .expect("the steps succeed");
    for piece in &mapping.pieces {
        let range = piece.at as usize..(piece.at + piece.len) as usize;
        let udm_block::Place::File { file, offset } = &piece.place else {
            buf[range].fill(0);
            continue;
        };
        // SAFETY: the mapping holds the file open while we use its descriptor.
        let fd = unsafe { BorrowedFd::borrow_raw(file.buffered_fd()) };
        let file = std::fs::File::from(fd.try_clone_to_owned().unwrap());
        use std::os::unix::fs::FileExt;
        match op {
            udm_block::MapOp::Read => file.read_exact_at(&mut buf[range], *offset).unwrap(),
            _ => file.write_all_at(&buf[range], *offset).unwrap(),
        }
    }
    for callback in mapping.on_complete {
        callback(udm_block::Completed::Ok);
    }
}

fn write_pattern(dev: &dyn BlockDevice, offset: u64) {
    write(dev, offset, 4096, 77);
}

/// A device that takes 1 ms for every read and write, as seed 002's table puts the data
/// devices behind a 1 ms delay.
struct Slow(MemoryDevice);

impl BlockDevice for Slow {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn capabilities(&self) -> udm_block::Capabilities {
        udm_block::Capabilities {
            native_fua: true,
            ..Default::default()
        }
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> udm_block::Result<()> {
        std::thread::sleep(Duration::from_millis(1));
        self.0.read(offset, buf)
    }
    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> udm_block::Result<()> {
        std::thread::sleep(Duration::from_millis(1));
        self.0.write(offset, buf, flags)
    }
    fn flush(&self) -> udm_block::Result<()> {
        Ok(())
    }
}

/// Seed 002's point: origin writes that copy out scale with the writers, because nothing
/// but the chunk they write is locked. Devices of 1 ms make each first write take about
/// 4 ms (read, copy, commit, write); 8 writers get at least 6 times as far as one.
#[test]
fn first_writes_scale_with_the_writers() {
    let rig = Rig::new(256 * MIB);
    rig.set_origin(Arc::new(Slow(MemoryDevice::new(256 * MIB))));
    let cow = rig.add("cow", Arc::new(Slow(MemoryDevice::new(512 * MIB))));
    let origin = rig.origin_table();
    let _snap = rig.snapshot(&cow, "P 8");
    let next = AtomicU64::new(0);
    let writes_in = |writers: u64| {
        let t = Instant::now();
        let done = AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..writers {
                s.spawn(|| {
                    while t.elapsed() < Duration::from_millis(500) {
                        // Every write to a chunk of its own: each one copies out.
                        let chunk = next.fetch_add(1, Ordering::Relaxed) * 7 % (256 * MIB / 4096);
                        write(&origin, chunk * 4096, 4096, 1);
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
        });
        done.load(Ordering::Relaxed)
    };
    let (one, eight) = (writes_in(1), writes_in(8));
    assert!(
        eight >= 6 * one,
        "8 writers made {eight} first writes where one made {one}"
    );
}

/// A COW device whose metadata writes (area 0, at chunk 1) wait while it is held, and which
/// counts the other (data) writes.
struct HeldCommits {
    dev: MemoryDevice,
    held: Mutex<bool>,
    released: Condvar,
    data_writes: AtomicU64,
}

impl BlockDevice for HeldCommits {
    fn size(&self) -> u64 {
        self.dev.size()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> udm_block::Result<()> {
        self.dev.read(offset, buf)
    }
    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> udm_block::Result<()> {
        if offset == 4096 {
            let mut held = self.held.lock();
            while *held {
                self.released.wait(&mut held);
            }
        } else {
            self.data_writes.fetch_add(1, Ordering::SeqCst);
        }
        self.dev.write(offset, buf, flags)
    }
    fn flush(&self) -> udm_block::Result<()> {
        Ok(())
    }
}

/// A mapped origin write holds no thread while its copy's commit is written: with the commit
/// held, far more first writes than there are copy threads get their chunk saved and wait,
/// then all complete once the commit goes through.
#[test]
fn mapped_first_writes_wait_for_their_commit_without_a_thread() {
    use udm_block::{FileDevice, MapOp, OpenMode};
    let dir = udm_testkit::TempDir::new("snapshot-defer");
    let path = dir.path("origin.img");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(4 * MIB)
        .unwrap();
    let rig = Rig::new(4 * MIB);
    rig.set_origin(Arc::new(
        FileDevice::open(&path, OpenMode::ReadWrite).unwrap(),
    ));
    let cow = Arc::new(HeldCommits {
        dev: MemoryDevice::new(8 * MIB),
        held: Mutex::new(false),
        released: Condvar::new(),
        data_writes: AtomicU64::new(0),
    });
    let cow_name = rig.add("cow", cow.clone());
    let origin = rig.origin_table();
    let snap = rig.snapshot(&cow_name, "P 8");
    let before = cow.data_writes.load(Ordering::SeqCst);
    *cow.held.lock() = true;
    const WRITES: u64 = 200;
    let (tx, rx) = std::sync::mpsc::channel();
    for chunk in 0..WRITES {
        let tx = tx.clone();
        let mapping = origin
            .map(MapOp::Write { fua: false }, chunk * 4096, 4096)
            .unwrap();
        mapping.when_ready(move |ready| tx.send(ready.is_ok()).unwrap());
    }
    let t = Instant::now();
    while cow.data_writes.load(Ordering::SeqCst) - before < WRITES {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "only {} of {WRITES} chunks were saved while the commit was held",
            cow.data_writes.load(Ordering::SeqCst) - before
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        rx.try_recv().is_err(),
        "no write goes ahead before its commit"
    );
    *cow.held.lock() = false;
    cow.released.notify_all();
    for _ in 0..WRITES {
        assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap());
    }
    assert_eq!(
        target(&snap).status_details().unwrap()["exceptions"],
        WRITES
    );
}

/// Tables meet by what they open, not by how they name it (the kernel keys origins by
/// dev_t): a snapshot naming the origin file by a hard link still gets its chunks saved
/// before the origin changes.
#[test]
fn an_origin_named_two_ways_is_one_origin() {
    use udm_block::{FileDevice, OpenMode};
    let dir = udm_testkit::TempDir::new("snapshot-identity");
    let (path, link) = (dir.path("origin.img"), dir.path("link.img"));
    std::fs::File::create(&path).unwrap().set_len(MIB).unwrap();
    std::fs::hard_link(&path, &link).unwrap();
    let open = |p: &std::path::Path| {
        Arc::new(FileDevice::open(p, OpenMode::ReadWrite).unwrap()) as Arc<dyn BlockDevice>
    };
    let rig = Rig::new(MIB);
    rig.set_origin(open(&path));
    let linked = rig.add("link", open(&link));
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
    let err = rig
        .try_table("other", &format!("snapshot {} {linked} P 8", rig.origin))
        .err()
        .unwrap();
    assert!(err.contains("cannot be the origin"), "{err}");
}

/// The snapshot's table goes away while a mapped first write waits for its commit: the
/// commit's callback then holds the last reference to the snapshot, and lets it go on the
/// store's own committer thread, which must not wait for itself.
#[test]
fn a_snapshot_dropped_while_a_mapped_write_waits_for_its_commit() {
    use udm_block::{FileDevice, MapOp, OpenMode};
    let dir = udm_testkit::TempDir::new("snapshot-drop-pending");
    let path = dir.path("origin.img");
    std::fs::File::create(&path).unwrap().set_len(MIB).unwrap();
    let rig = Rig::new(MIB);
    rig.set_origin(Arc::new(
        FileDevice::open(&path, OpenMode::ReadWrite).unwrap(),
    ));
    let cow = Arc::new(HeldCommits {
        dev: MemoryDevice::new(4 * MIB),
        held: Mutex::new(false),
        released: Condvar::new(),
        data_writes: AtomicU64::new(0),
    });
    let cow_name = rig.add("cow", cow.clone());
    let origin = rig.origin_table();
    let snap = rig.snapshot(&cow_name, "P 8");
    *cow.held.lock() = true;
    let (tx, rx) = std::sync::mpsc::channel();
    origin
        .map(MapOp::Write { fua: false }, 0, 4096)
        .unwrap()
        .when_ready(move |ready| tx.send(ready.is_ok()).unwrap());
    let t = Instant::now();
    while cow.data_writes.load(Ordering::SeqCst) == 0 {
        assert!(t.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(2));
    }
    static COMMITTER_PANICKED: AtomicBool = AtomicBool::new(false);
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if std::thread::current().name() == Some("snapshot-commit") {
            COMMITTER_PANICKED.store(true, Ordering::SeqCst);
        }
        previous(info)
    }));
    drop(snap);
    *cow.held.lock() = false;
    cow.released.notify_all();
    assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap());
    // The snapshot (and its store) is gone once the callback has let go of it.
    let t = Instant::now();
    while Arc::strong_count(&cow) > 2 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the snapshot never went"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    std::thread::sleep(Duration::from_millis(50));
    assert!(!COMMITTER_PANICKED.load(Ordering::SeqCst));
}
