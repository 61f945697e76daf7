//! Copy-out: origin writes to different chunks never wait for each other, commits are
//! shared, mapped writes wait for their copy without a thread, through the copier on files.

use super::*;

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

/// What the hot path may remap onto files, on real files: an origin write only once every
/// snapshot has the chunk saved, a snapshot read of an unsaved chunk onto the origin while
/// holding the chunk (so that a copy-out of it waits for the read to complete).
#[test]
fn remapping_goes_straight_to_the_files_only_where_nothing_needs_saving() {
    use udm_block::MapOp;
    let dir = udm_testkit::TempDir::new("snapshot-map");
    let rig = Rig::new(MIB);
    rig.file_origin(&dir, MIB);
    let cow = rig.add("cow", file_device(&dir.path("cow.img"), 4 * MIB));
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

/// A mapped origin write holds no thread while its copy's commit is written: with the commit
/// held, far more first writes than there are copy threads get their chunk saved and wait,
/// then all complete once the commit goes through.
#[test]
fn mapped_first_writes_wait_for_their_commit_without_a_thread() {
    use udm_block::MapOp;
    let dir = udm_testkit::TempDir::new("snapshot-defer");
    let rig = Rig::new(4 * MIB);
    rig.file_origin(&dir, 4 * MIB);
    let cow = HeldCommits::new(8 * MIB);
    let cow_name = rig.add("cow", cow.clone());
    let origin = rig.origin_table();
    let snap = rig.snapshot(&cow_name, "P 8");
    let before = cow.data_writes.load(Ordering::SeqCst);
    cow.hold(true);
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
    cow.hold(false);
    for _ in 0..WRITES {
        assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap());
    }
    assert_eq!(
        target(&snap).status_details().unwrap()["exceptions"],
        WRITES
    );
}

/// The snapshot's table goes away while a mapped first write waits for its commit: the
/// commit's callback then holds the last reference to the snapshot, and lets it go on the
/// store's own committer thread, which must not wait for itself.
#[test]
fn a_snapshot_dropped_while_a_mapped_write_waits_for_its_commit() {
    use udm_block::MapOp;
    let dir = udm_testkit::TempDir::new("snapshot-drop-pending");
    let rig = Rig::new(MIB);
    rig.file_origin(&dir, MIB);
    let cow = HeldCommits::new(4 * MIB);
    let cow_name = rig.add("cow", cow.clone());
    let origin = rig.origin_table();
    let snap = rig.snapshot(&cow_name, "P 8");
    cow.hold(true);
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
    cow.hold(false);
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

/// `delay <file> 0 <ms>` as a device of `rig`'s, named after `file`.
fn delayed(rig: &Rig, dir: &udm_testkit::TempDir, file: &str, size: u64, ms: u64) -> String {
    let under = rig.add(file, file_device(&dir.path(file), size));
    let text = format!("0 {} delay {under} 0 {ms}", size / 512);
    let table = Table::build(&unique("delay"), &text, &rig.devices, Arc::new(|| {})).unwrap();
    table.resume();
    rig.add("delayed", Arc::new(table))
}

/// Seed 002's table in miniature: origin and COW device behind a `delay` over files. The
/// copier reads and writes them on its ring, each waiting on the delay's timer, so a burst
/// of first writes far larger than any pool of copy threads is saved in about one round of
/// read, write and commit or two (600–800 ms). A copy holding a thread through each 200 ms
/// delay, 64 threads at most, would need 4 rounds of 400 ms for 250 writes; the margin
/// between is for a loaded machine.
#[test]
fn the_copier_saves_a_burst_of_first_writes_through_delays_without_a_thread_each() {
    use udm_block::MapOp;
    const WRITES: u64 = 250;
    let dir = udm_testkit::TempDir::new("snapshot-copier");
    let rig = Rig::new(8 * MIB);
    let origin_dev = delayed(&rig, &dir, "origin.img", 8 * MIB, 200);
    rig.set_origin(rig.device(&origin_dev));
    let cow = delayed(&rig, &dir, "cow.img", 16 * MIB, 200);
    let origin = rig.origin_table();
    let snap = rig.snapshot(&cow, "P 8");
    let (tx, rx) = std::sync::mpsc::channel();
    let t = Instant::now();
    for chunk in 0..WRITES {
        let tx = tx.clone();
        let write = MapOp::Write { fua: false };
        let mapping = origin.map(write, chunk * 4096, 4096).expect("mapped");
        assert!(!mapping.is_ready(), "chunk {chunk} is saved first");
        mapping.when_ready(move |ready| tx.send((chunk, ready)).unwrap());
    }
    let mut ready = Vec::new();
    for _ in 0..WRITES {
        let (chunk, mapping) = rx.recv_timeout(Duration::from_secs(20)).unwrap();
        ready.push((chunk, mapping.expect("the copy-out succeeds")));
    }
    let took = t.elapsed();
    eprintln!("{WRITES} copy-outs through 200 ms delays: {took:?}");
    assert!(
        took < Duration::from_millis(1300),
        "{WRITES} copy-outs through 200 ms delays took {took:?}"
    );
    assert_eq!(
        target(&snap).status_details().unwrap()["exceptions"],
        WRITES
    );
    // The origin writes land once their copies are in: the snapshot keeps what was there.
    for (chunk, mapping) in ready {
        execute(
            MapOp::Write { fua: false },
            mapping,
            &mut pattern(4096, chunk),
        );
    }
    // (Each read is another 200 ms, one chunk at a time on this synchronous path.)
    for chunk in [0, 1, WRITES - 1] {
        let at = chunk * 4096;
        assert!(
            read(&snap, at, 4096).iter().all(|&b| b == 0),
            "chunk {chunk}"
        );
        assert!(read(&origin, at, 4096)[..] == pattern(4096, chunk)[..]);
    }
}

/// The copier fills a COW device on a file: the copy-out that finds no room drops the
/// snapshot (invalid on disk, an event) and its origin write goes ahead, as on the
/// synchronous path.
#[test]
fn a_copy_out_on_the_ring_that_fills_the_cow_invalidates_and_the_write_goes_ahead() {
    use udm_block::MapOp;
    let dir = udm_testkit::TempDir::new("snapshot-copier-full");
    let rig = Rig::new(MIB);
    rig.file_origin(&dir, MIB);
    // Header, area and 6 data chunks of 4 KiB.
    let cow = rig.add("cow", file_device(&dir.path("cow.img"), 8 * 4096));
    let origin = rig.origin_table();
    let snap = rig.snapshot(&cow, "P 8");
    for chunk in 0..7u64 {
        let write = MapOp::Write { fua: false };
        let mapping = origin.map(write, chunk * 65536, 4096).unwrap();
        assert!(!mapping.is_ready());
        execute(write, mapping, &mut pattern(4096, chunk));
    }
    assert_eq!(target(&snap).status(), "Invalid");
    assert_eq!(rig.events.load(Ordering::SeqCst), 1);
    assert!(read(&origin, 6 * 65536, 4096)[..] == pattern(4096, 6)[..]);
    assert_eq!(read(&*rig.device(&cow), 4, 4)[..], [0, 0, 0, 0]);
    let write = MapOp::Write { fua: false };
    assert!(
        origin.map(write, 7 * 65536, 4096).unwrap().is_ready(),
        "nothing is saved for a dropped snapshot"
    );
}
