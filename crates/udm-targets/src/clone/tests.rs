//! The clone target against in-memory devices that count and fail on command.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use udm_block::{conformance, AlignedBuf, BlockDevice, WriteFlags, ZeroFlags};

use crate::table::Table;
use crate::testing::{build_counting_events, AnyResolver, Switchable};

const MIB: u64 = 1 << 20;

struct Rig {
    table: Table,
    meta: Arc<Switchable>,
    dest: Arc<Switchable>,
    source: Arc<Switchable>,
    events: Arc<AtomicU64>,
}

impl Rig {
    fn clone_target(&self) -> &Arc<dyn crate::Target> {
        self.table.target_at(0).unwrap()
    }
    fn status(&self) -> String {
        self.clone_target().status()
    }
    fn message(&self, words: &str) {
        let words: Vec<&str> = words.split_whitespace().collect();
        self.clone_target().message(&words).unwrap();
    }
    fn transaction(&self) -> u64 {
        self.clone_target().status_details().unwrap()["metadata_transaction"]
            .as_u64()
            .unwrap()
    }
    fn wait_complete(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.events.load(Ordering::SeqCst) == 0 {
            assert!(
                Instant::now() < deadline,
                "hydration did not finish: {}",
                self.status()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// A clone of `size` bytes whose source holds a pattern in its first half and a hole after.
fn rig_with(size: u64, table_args: &str, setup_devices: impl FnOnce(&Rig)) -> Rig {
    let meta = Arc::new(Switchable::new(MIB));
    let dest = Arc::new(Switchable::new(size));
    let source = Arc::new(Switchable::new(size));
    source
        .inner
        .write(
            0,
            &conformance::pattern((size / 2) as usize, 1),
            WriteFlags::default(),
        )
        .unwrap();
    let devices: HashMap<String, Arc<dyn BlockDevice>> = [
        ("meta".to_string(), meta.clone() as Arc<dyn BlockDevice>),
        ("dest".to_string(), dest.clone() as Arc<dyn BlockDevice>),
        ("source".to_string(), source.clone() as Arc<dyn BlockDevice>),
    ]
    .into();
    let pre = Rig {
        table: Table::build(
            "test",
            "0 8 zero",
            &AnyResolver(HashMap::new()),
            Arc::new(|| {}),
        )
        .unwrap(),
        meta: meta.clone(),
        dest: dest.clone(),
        source: source.clone(),
        events: Arc::new(AtomicU64::new(0)),
    };
    setup_devices(&pre);
    let text = format!("0 {} clone meta dest source {table_args}", size / 512);
    let (table, events) = build_counting_events(&AnyResolver(devices), &text).unwrap();
    Rig {
        table,
        meta,
        dest,
        source,
        events,
    }
}

fn rig(size: u64, table_args: &str) -> Rig {
    rig_with(size, table_args, |_| {})
}

fn read(dev: &dyn BlockDevice, offset: u64, len: usize) -> AlignedBuf {
    let mut buf = AlignedBuf::zeroed(len);
    dev.read(offset, &mut buf).unwrap();
    buf
}

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
    let expected = conformance::pattern(2 * MIB as usize, 1);
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
    let data = conformance::pattern(16384, 9);
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
    let expected = conformance::pattern(2 * MIB as usize, 1);
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
    let expected = conformance::pattern(65536, 1);
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
fn flush_commits_only_when_something_changed() {
    let r = rig(4 * MIB, "8 1 no_hydration");
    let t0 = r.transaction();
    r.table.flush().unwrap();
    assert_eq!(r.transaction(), t0, "nothing changed: no commit");
    let meta_writes = r.meta.writes.load(Ordering::SeqCst);
    r.table
        .write(0, &[1u8; 4096], WriteFlags::default())
        .unwrap();
    r.table.flush().unwrap();
    assert_eq!(r.transaction(), t0 + 1);
    assert!(r.meta.writes.load(Ordering::SeqCst) > meta_writes);
    // A FUA write that hydrates commits too.
    r.table
        .write(8192, &[2u8; 4096], WriteFlags { fua: true })
        .unwrap();
    assert_eq!(r.transaction(), t0 + 2);
    // A write to a hydrated region changes no metadata.
    r.table
        .write(0, &[3u8; 4096], WriteFlags { fua: true })
        .unwrap();
    r.table.flush().unwrap();
    assert_eq!(r.transaction(), t0 + 2);
}

#[test]
fn changes_are_committed_within_about_a_second() {
    let r = rig(4 * MIB, "8 1 no_hydration");
    let t0 = r.transaction();
    r.table
        .write(0, &[1u8; 4096], WriteFlags::default())
        .unwrap();
    let deadline = Instant::now() + Duration::from_millis(2500);
    while r.transaction() == t0 {
        assert!(Instant::now() < deadline, "no commit within 2.5 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    // And no further commits while idle.
    let t1 = r.transaction();
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(r.transaction(), t1);
}

#[test]
fn background_hydration_copies_everything_and_skips_zeroes() {
    let r = rig(
        8 * MIB,
        "8 0 4 hydration_threshold 256 hydration_batch_size 64",
    );
    r.wait_complete();
    assert!(read(&*r.dest, 0, 8 * MIB as usize)[..] == read(&*r.source, 0, 8 * MIB as usize)[..]);
    // The second half of the source is a hole: the destination keeps it unallocated.
    assert!(
        r.dest.inner.allocated() <= 4 * MIB,
        "allocated {}",
        r.dest.inner.allocated()
    );
    assert!(r.status().contains(" 2048/2048 0 "), "{}", r.status());
    let details = r.clone_target().status_details().unwrap();
    assert_eq!(details["complete"], true);
    assert_eq!(details["hydrated_bytes"], 8 * MIB);
}

#[test]
fn stale_destination_data_under_a_source_hole_is_zeroed() {
    // The destination held something before (an old volume): its bytes under the source's
    // hole must not survive hydration, while the rest of the hole stays unallocated.
    let stale = 6 * MIB;
    let r = rig_with(
        8 * MIB,
        "8 0 4 hydration_threshold 256 hydration_batch_size 64",
        |pre| {
            let junk = conformance::pattern(64 << 10, 7);
            pre.dest
                .inner
                .write(stale, &junk, WriteFlags::default())
                .unwrap();
        },
    );
    r.wait_complete();
    assert!(read(&r.table, 0, 8 * MIB as usize)[..] == read(&*r.source, 0, 8 * MIB as usize)[..]);
    assert!(read(&*r.dest, stale, 64 << 10).iter().all(|&b| b == 0));
    assert!(
        r.dest.inner.allocated() <= 4 * MIB + (64 << 10),
        "allocated {}",
        r.dest.inner.allocated()
    );
}

#[test]
fn messages_steer_hydration() {
    let r = rig(4 * MIB, "8 1 no_hydration");
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(r.dest.writes.load(Ordering::SeqCst), 0);
    r.message("hydration_threshold 32");
    r.message("hydration_batch_size 8");
    assert!(
        r.status()
            .contains(" 4 hydration_threshold 32 hydration_batch_size 8 rw"),
        "{}",
        r.status()
    );
    r.message("enable_hydration");
    r.wait_complete();
    let target = r.clone_target();
    for bad in [
        &["hydration_threshold"][..],
        &["hydration_batch_size", "0"],
        &["frob"],
        &["enable_hydration", "x"],
    ] {
        assert!(target.message(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn the_bandwidth_cap_limits_background_copying() {
    // 256 KiB/s on a 4 MiB volume: about 1 s in, far from done.
    let r = rig(
        4 * MIB,
        "8 0 4 hydration_threshold 64 max_hydration_rate 256",
    );
    assert!(r
        .status()
        .contains(" 6 hydration_threshold 64 hydration_batch_size 1 max_hydration_rate 256 rw"));
    std::thread::sleep(Duration::from_millis(1000));
    let hydrated = r.clone_target().status_details().unwrap()["hydrated_bytes"]
        .as_u64()
        .unwrap();
    assert!(
        hydrated > 0 && hydrated < 700 * 1024,
        "hydrated {hydrated} bytes in 1 s at 256 KiB/s"
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
fn metadata_failures_go_read_only_then_fail_with_events() {
    let r = rig(4 * MIB, "8 1 no_hydration");
    r.table.write(0, &[1; 4096], WriteFlags::default()).unwrap();
    r.table.flush().unwrap();
    r.table
        .write(4096, &[2; 4096], WriteFlags::default())
        .unwrap();
    r.meta.fail_writes.store(true, Ordering::SeqCst);
    assert_eq!(r.table.flush().unwrap_err().errno(), libc::EIO);
    assert_eq!(r.events.load(Ordering::SeqCst), 1);
    assert!(r.status().ends_with(" ro"), "{}", r.status());
    // Read-only: the uncommitted region 1 reads from the source again; region 0 is kept.
    assert!(read(&r.table, 0, 4096).iter().all(|&b| b == 1));
    assert!(read(&r.table, 4096, 4096)[..] == conformance::pattern(8192, 1)[4096..]);
    // Writes to hydrated regions work; writes that need hydration fail; discards are ignored.
    r.table.write(0, &[3; 4096], WriteFlags::default()).unwrap();
    assert_eq!(
        r.table
            .write(8192, &[3; 4096], WriteFlags::default())
            .unwrap_err()
            .errno(),
        libc::EIO
    );
    r.table.discard(0, 4 * MIB).unwrap();
    r.table.flush().unwrap();
}

/// The bitmap is reread only once nothing can set bits in it any more: a region marked
/// hydrated while the reload overwrites its word would be lost, or counted with the bit gone.
#[test]
fn a_failed_commit_goes_read_only_before_it_rereads_the_bitmap() {
    let r = rig(4 * MIB, "8 1 no_hydration");
    r.table.write(0, &[1; 4096], WriteFlags::default()).unwrap();
    r.meta.fail_writes.store(true, Ordering::SeqCst);
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (target, log) = (r.clone_target().clone(), seen.clone());
    *r.meta.on_read.lock().unwrap() = Some(Box::new(move || {
        log.lock().unwrap().push(target.status());
    }));
    assert_eq!(r.table.flush().unwrap_err().errno(), libc::EIO);
    // The hook holds the target: let go of it before the rig goes.
    r.meta.on_read.lock().unwrap().take();
    let seen = seen.lock().unwrap();
    assert!(!seen.is_empty(), "the bitmap was not reread");
    for status in seen.iter() {
        assert!(status.ends_with(" ro"), "reread in mode: {status}");
    }
}

#[test]
fn a_metadata_device_that_cannot_even_be_reread_means_fail_mode() {
    let r = rig(4 * MIB, "8 1 no_hydration");
    r.table.write(0, &[1; 4096], WriteFlags::default()).unwrap();
    r.meta.fail_writes.store(true, Ordering::SeqCst);
    r.meta.fail_reads.store(true, Ordering::SeqCst);
    assert_eq!(r.table.flush().unwrap_err().errno(), libc::EIO);
    assert_eq!(r.status(), "Fail");
    assert_eq!(r.events.load(Ordering::SeqCst), 1);
    let mut buf = AlignedBuf::zeroed(4096);
    assert_eq!(r.table.read(0, &mut buf).unwrap_err().errno(), libc::EIO);
    assert_eq!(
        r.table
            .write(0, &buf, WriteFlags::default())
            .unwrap_err()
            .errno(),
        libc::EIO
    );
}

#[test]
fn reopening_keeps_committed_regions_and_refuses_other_geometries() {
    let meta: Arc<Switchable> = Arc::new(Switchable::new(MIB));
    let dest = Arc::new(Switchable::new(4 * MIB));
    let source = Arc::new(Switchable::new(4 * MIB));
    source
        .inner
        .write(0, &conformance::pattern(4096, 3), WriteFlags::default())
        .unwrap();
    let resolver = AnyResolver(
        [
            ("meta".to_string(), meta.clone() as Arc<dyn BlockDevice>),
            ("dest".to_string(), dest.clone() as Arc<dyn BlockDevice>),
            ("source".to_string(), source.clone() as Arc<dyn BlockDevice>),
        ]
        .into(),
    );
    let line = "0 8192 clone meta dest source 8 1 no_hydration";
    {
        let (table, _) = build_counting_events(&resolver, line).unwrap();
        table
            .write(65536, &[5; 4096], WriteFlags::default())
            .unwrap();
        table.flush().unwrap();
    }
    let (table, _) = build_counting_events(&resolver, line).unwrap();
    assert!(read(&table, 65536, 4096).iter().all(|&b| b == 5));
    assert!(table.target_at(0).unwrap().status().contains(" 1/1024 "));
    drop(table);
    for (text, expected) in [
        ("0 8192 clone meta dest source 16", "made for region size 8"),
        ("0 4096 clone meta dest source 8", "length 8192 sectors"),
    ] {
        let err = build_counting_events(&resolver, text)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains(expected), "{text}: {err}");
    }
}

#[test]
fn constructor_checks_name_the_problem() {
    let devices: HashMap<String, Arc<dyn BlockDevice>> = [
        (
            "meta".to_string(),
            Arc::new(Switchable::new(MIB)) as Arc<dyn BlockDevice>,
        ),
        (
            "tiny".to_string(),
            Arc::new(Switchable::new(4096)) as Arc<dyn BlockDevice>,
        ),
        (
            "dest".to_string(),
            Arc::new(Switchable::new(4 * MIB)) as Arc<dyn BlockDevice>,
        ),
        (
            "small".to_string(),
            Arc::new(Switchable::new(MIB)) as Arc<dyn BlockDevice>,
        ),
        (
            "source".to_string(),
            Arc::new(Switchable::new(4 * MIB)) as Arc<dyn BlockDevice>,
        ),
    ]
    .into();
    let resolver = AnyResolver(devices);
    for (args, expected) in [
        ("meta dest source", "expected at least 4 arguments"),
        ("meta dest source 12", "invalid region size 12"),
        ("meta dest source 4", "invalid region size 4"),
        ("meta dest source 4194304", "invalid region size 4194304"),
        ("meta small source 8", "device 'small' has"),
        ("meta dest small 8", "device 'small' has"),
        ("tiny dest source 8", "metadata device too small"),
        (
            "meta dest source 8 1 bogus",
            "unsupported feature argument 'bogus'",
        ),
        (
            "meta dest source 8 4 no_hydration",
            "invalid number of feature arguments 4",
        ),
        (
            "meta dest source 8 0 3 hydration_threshold 4 x",
            "invalid number of core arguments 3",
        ),
        (
            "meta dest source 8 0 2 hydration_batch_size 0",
            "invalid value '0' for hydration_batch_size",
        ),
        (
            "meta dest source 8 0 2 frob 1",
            "invalid core argument 'frob'",
        ),
        (
            "meta ghost source 8",
            "cannot open <destination dev> 'ghost'",
        ),
    ] {
        let text = format!("0 8192 clone {args}");
        let err = build_counting_events(&resolver, &text)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains(expected), "{args}: {err:?}");
    }
    // A valid line prints back exactly.
    let text = "0 8192 clone meta dest source 8 2 no_hydration no_discard_passdown 4 hydration_threshold 4 hydration_batch_size 2";
    let (table, _) = build_counting_events(&resolver, text).unwrap();
    assert_eq!(table.lines(), vec![text.to_string()]);
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
    assert!(read(&*r.dest, 0, 16384)[..] == conformance::pattern(16384, 1)[..]);
}

#[test]
fn cache_requests_hydrate_the_range() {
    let r = rig(4 * MIB, "8 1 no_hydration");
    r.table.cache(MIB, 65536).unwrap();
    assert!(r.status().contains(" 16/1024 "), "{}", r.status());
}

#[test]
fn a_rate_capped_copier_holds_no_claims_while_it_waits() {
    // 16 KiB/s with batches of 16 x 64 KiB: the first batch copies at once, the next may
    // start only 64 s later. Nothing the user does may wait for that.
    let r = rig(
        16 * MIB,
        "128 0 6 hydration_threshold 16 hydration_batch_size 16 max_hydration_rate 16",
    );
    let hydrated = || r.clone_target().status_details().unwrap()["hydrated_regions"].as_u64();
    let deadline = Instant::now() + Duration::from_secs(10);
    while hydrated() < Some(16) {
        assert!(Instant::now() < deadline, "{}", r.status());
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(200));
    let started = Instant::now();
    r.table
        .write(20 * 65536 + 4096, &[0x77; 4096], WriteFlags::default())
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "a 4 KiB write waited {:?} for the rate-limited copier",
        started.elapsed()
    );
    let started = Instant::now();
    r.table.suspend();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "suspend waited {:?}",
        started.elapsed()
    );
    r.table.resume();
    // Lifting the cap takes effect at once, not after the 64 s the old one had booked.
    r.message("max_hydration_rate 0");
    r.wait_complete();
}

#[test]
fn a_whole_region_write_in_the_copiers_check_to_claim_gap_is_not_overwritten() {
    use super::hydration::tests_hook::HOOK;
    let r = rig(4 * MIB, "128 1 no_hydration");
    let (hit, gap) = std::sync::mpsc::channel::<u64>();
    let (done, resume) = std::sync::mpsc::channel::<()>();
    let source = Arc::as_ptr(&r.source) as *const () as usize;
    let once = std::sync::atomic::AtomicBool::new(false);
    let resume = std::sync::Mutex::new(resume);
    let hit = std::sync::Mutex::new(hit);
    *HOOK.lock().unwrap() = Some(Box::new(move |inner, region| {
        // Only this test's clone, and only once: stop in the gap until the user has written.
        if Arc::as_ptr(&inner.source) as *const () as usize == source
            && !once.swap(true, Ordering::SeqCst)
        {
            hit.lock().unwrap().send(region).unwrap();
            let _ = resume.lock().unwrap().recv_timeout(Duration::from_secs(10));
        }
    }));
    r.message("enable_hydration");
    let region = gap.recv_timeout(Duration::from_secs(10)).unwrap();
    let data = vec![0x3cu8; 65536];
    r.table
        .write(region * 65536, &data, WriteFlags::default())
        .unwrap();
    done.send(()).unwrap();
    r.wait_complete();
    *HOOK.lock().unwrap() = None;
    assert!(
        read(&r.table, region * 65536, 65536)[..] == data[..],
        "the copier overwrote region {region} with source data"
    );
}

#[test]
fn hydrated_regions_remap_onto_the_destination_and_the_rest_stays_with_the_clone() {
    use udm_block::{FileDevice, MapOp, OpenMode, Place};
    let path = std::env::temp_dir().join(format!("udm-clone-map-{}", std::process::id()));
    std::fs::File::create(&path)
        .unwrap()
        .set_len(4 * MIB)
        .unwrap();
    let dest = Arc::new(FileDevice::open(&path, OpenMode::ReadWrite).unwrap());
    let devices: HashMap<String, Arc<dyn BlockDevice>> = [
        (
            "meta".to_string(),
            Arc::new(Switchable::new(MIB)) as Arc<dyn BlockDevice>,
        ),
        ("dest".to_string(), dest as Arc<dyn BlockDevice>),
        (
            "source".to_string(),
            Arc::new(Switchable::new(4 * MIB)) as Arc<dyn BlockDevice>,
        ),
    ]
    .into();
    let text = "0 8192 clone meta dest source 16 1 no_hydration";
    let (table, _) = build_counting_events(&AnyResolver(devices), text).unwrap();
    assert!(
        table.map(MapOp::Read, 8192, 8192).is_none(),
        "not hydrated yet"
    );
    // A whole-region write hydrates region 1.
    let data = conformance::pattern(8192, 3);
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
    std::fs::remove_file(&path).unwrap();
}
