//! The multipath target over routes to one in-memory disk that fail on command: failover,
//! queueing and its bounds, the checker, flushes, messages and the status line.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use udm_block::{BlockDevice, BlockError, MemoryDevice, Result, WriteFlags};
use udm_testkit::{conformance, pattern};

use crate::table::Table;
use crate::testing::{build, build_counting_events, Devices, Switchable};
use crate::Target;

const MIB: u64 = 1 << 20;
const SECTORS: u64 = 4 * MIB / 512;

/// Routes `a`, `b` and `c` to one disk, each failing on command.
struct Rig {
    devices: Devices,
    disk: Arc<MemoryDevice>,
    routes: Vec<Arc<Switchable>>,
}

impl Rig {
    fn new() -> Rig {
        let disk = Arc::new(MemoryDevice::new(4 * MIB));
        let devices = Devices::default();
        let routes: Vec<_> = ["a", "b", "c"]
            .iter()
            .map(|name| {
                let route = Arc::new(Switchable::over(disk.clone()));
                devices.add(name, route.clone(), false);
                route
            })
            .collect();
        Rig {
            devices,
            disk,
            routes,
        }
    }

    /// A live multipath of the whole disk with these arguments, and its event count.
    fn build(&self, args: &str) -> (Table, Arc<AtomicU64>) {
        build_counting_events(&self.devices, &format!("0 {SECTORS} multipath {args}")).unwrap()
    }

    fn down(&self, route: usize, down: bool) {
        self.routes[route].fail_reads.store(down, Ordering::SeqCst);
        self.routes[route].fail_writes.store(down, Ordering::SeqCst);
    }

    fn reads(&self, route: usize) -> u64 {
        self.routes[route].reads.load(Ordering::SeqCst)
    }
}

fn target(table: &Table) -> &Arc<dyn Target> {
    table.target_at(0).unwrap()
}

fn message(table: &Table, words: &str) -> std::result::Result<String, String> {
    let words: Vec<&str> = words.split_whitespace().collect();
    target(table).message(&words).map_err(|e| e.to_string())
}

fn read(table: &Table, offset: u64) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; 4096];
    table.read(offset, &mut buf).map(|()| buf)
}

const TWO_PATHS: &str = "0 0 1 1 round-robin 0 2 1 a 1 b 1";

#[test]
fn passes_the_conformance_suite() {
    let rig = Rig::new();
    let (table, _) = rig.build(TWO_PATHS);
    conformance::run_all(&table);
    assert!(
        rig.reads(0) > 0 && rig.reads(1) > 0,
        "round-robin used one path"
    );
}

#[test]
fn io_that_fails_on_a_path_fails_the_path_and_goes_down_the_other() {
    let rig = Rig::new();
    let (table, events) = rig.build(TWO_PATHS);
    table
        .write(0, &pattern(65536, 1), WriteFlags::default())
        .unwrap();
    rig.down(0, true);
    // Every request succeeds, whichever path round-robin picked first.
    for i in 0..8 {
        assert_eq!(
            read(&table, i * 4096).unwrap(),
            pattern(65536, 1)[i as usize * 4096..][..4096]
        );
    }
    table
        .write(65536, &pattern(4096, 2), WriteFlags::default())
        .unwrap();
    assert_eq!(target(&table).status(), "2 0 0 0 1 1 A 0 2 0 a F 1 b A 0");
    assert_eq!(
        events.load(Ordering::SeqCst),
        1,
        "one event for the failed path"
    );
    // The failed path is left alone until it is reinstated.
    let before = rig.reads(0);
    for _ in 0..4 {
        read(&table, 0).unwrap();
    }
    assert_eq!(rig.reads(0), before);
    rig.down(0, false);
    message(&table, "reinstate_path a").unwrap();
    assert_eq!(events.load(Ordering::SeqCst), 2);
    for _ in 0..4 {
        read(&table, 0).unwrap();
    }
    assert!(rig.reads(0) > before, "the reinstated path takes I/O again");
    assert_eq!(target(&table).status(), "2 0 0 0 1 1 A 0 2 0 a A 1 b A 0");
}

#[test]
fn groups_fail_over_in_order_and_messages_steer_them() {
    let rig = Rig::new();
    let (table, events) = rig.build("0 0 2 1 round-robin 0 1 1 a 1 queue-length 0 2 1 b 1 c 1");
    read(&table, 0).unwrap();
    assert_eq!(rig.reads(0), 1);
    assert_eq!(
        target(&table).status(),
        "2 0 0 0 2 1 A 0 1 0 a A 0 E 0 2 1 b A 0 0 c A 0 0"
    );
    rig.down(0, true);
    read(&table, 0).unwrap();
    assert!(rig.reads(1) + rig.reads(2) == 1);
    assert!(target(&table)
        .status()
        .starts_with("2 0 0 0 2 2 E 0 1 0 a F 1 A"));
    // switch_group back to a group whose only path is failed: I/O stays where it can go.
    message(&table, "switch_group 1").unwrap();
    read(&table, 0).unwrap();
    assert!(target(&table).status().starts_with("2 0 0 0 2 2 E"));
    rig.down(0, false);
    message(&table, "reinstate_path a").unwrap();
    message(&table, "switch_group 1").unwrap();
    read(&table, 0).unwrap();
    assert!(target(&table).status().starts_with("2 0 0 0 2 1 A"));
    message(&table, "disable_group 1").unwrap();
    read(&table, 0).unwrap();
    assert!(target(&table)
        .status()
        .starts_with("2 0 0 0 2 2 D 0 1 0 a A 1 A"));
    message(&table, "enable_group 1").unwrap();
    assert!(target(&table).status().starts_with("2 0 0 0 2 1 E"));
    // fail, switch, reinstate, switch, disable, enable: one event each.
    assert_eq!(events.load(Ordering::SeqCst), 6);
    // The table line prints the group I/O goes to as the initial one, as the kernel's does.
    read(&table, 0).unwrap();
    assert_eq!(
        table.lines()[0],
        format!("0 {SECTORS} multipath 0 0 2 1 round-robin 0 1 1 a 1 queue-length 0 2 1 b 1 c 1")
    );
}

#[test]
fn with_no_path_and_no_queueing_requests_fail_at_once() {
    let rig = Rig::new();
    let (table, _) = rig.build(TWO_PATHS);
    rig.down(0, true);
    rig.down(1, true);
    let started = Instant::now();
    let err = read(&table, 0).unwrap_err();
    assert_eq!(err.errno(), libc::EIO);
    assert!(err.to_string().contains("no usable path"), "{err}");
    assert!(started.elapsed() < Duration::from_millis(100));
    assert!(target(&table).status().ends_with("a F 1 b F 1"));
}

/// Runs a read of `table` on a thread; returns its handle.
fn reader(table: &Arc<Table>) -> std::thread::JoinHandle<Result<Vec<u8>>> {
    let table = table.clone();
    std::thread::spawn(move || read(&table, 0))
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn queue_if_no_path_holds_requests_until_a_path_returns_or_fail_if_no_path() {
    let rig = Rig::new();
    let (table, _) = rig.build(&format!("1 queue_if_no_path {}", &TWO_PATHS[2..]));
    let table = Arc::new(table);
    table
        .write(0, &pattern(4096, 3), WriteFlags::default())
        .unwrap();
    rig.down(0, true);
    rig.down(1, true);
    let waiting = reader(&table);
    wait_for("the read to queue", || {
        target(&table).status().starts_with("2 1 ")
    });
    std::thread::sleep(Duration::from_millis(100));
    assert!(!waiting.is_finished());
    rig.down(1, false);
    message(&table, "reinstate_path b").unwrap();
    assert_eq!(waiting.join().unwrap().unwrap(), &pattern(4096, 3)[..]);

    // fail_if_no_path releases waiters with EIO, and later requests fail at once.
    message(&table, "fail_path b").unwrap();
    let waiting = reader(&table);
    wait_for("the read to queue", || {
        target(&table).status().starts_with("2 1 ")
    });
    message(&table, "fail_if_no_path").unwrap();
    assert_eq!(waiting.join().unwrap().unwrap_err().errno(), libc::EIO);
    assert_eq!(read(&table, 0).unwrap_err().errno(), libc::EIO);
    // The setting shows in the table line and is what a restart replays.
    assert!(
        table.lines()[0].contains("multipath 0 0 1"),
        "{}",
        table.lines()[0]
    );
    assert_eq!(target(&table).settings_messages(), ["fail_if_no_path"]);
    message(&table, "queue_if_no_path").unwrap();
    assert_eq!(target(&table).settings_messages(), ["queue_if_no_path"]);

    // A suspend does not wait for a path that may never come: presuspend fails the waiters.
    let waiting = reader(&table);
    wait_for("the read to queue", || {
        target(&table).status().starts_with("2 1 ")
    });
    table.presuspend();
    assert_eq!(waiting.join().unwrap().unwrap_err().errno(), libc::EIO);
    table.resume();
    let waiting = reader(&table);
    wait_for("the read to queue after the resume", || {
        target(&table).status().starts_with("2 1 ")
    });
    // Reinstated while still down: the read fails it again and keeps waiting, until the
    // path really answers and is reinstated once more.
    message(&table, "reinstate_path a").unwrap();
    wait_for("a to fail again", || {
        target(&table).status().contains("a F 2")
    });
    rig.down(0, false);
    message(&table, "reinstate_path a").unwrap();
    assert_eq!(waiting.join().unwrap().unwrap(), &pattern(4096, 3)[..]);
}

#[test]
fn no_path_retry_bounds_the_wait_in_checker_intervals() {
    let rig = Rig::new();
    let (table, _) = rig.build(&format!(
        "5 queue_if_no_path no_path_retry 2 checker_interval 1 {}",
        &TWO_PATHS[2..]
    ));
    rig.down(0, true);
    rig.down(1, true);
    let started = Instant::now();
    let err = read(&table, 0).unwrap_err();
    let took = started.elapsed();
    assert_eq!(err.errno(), libc::EIO);
    assert!(
        took >= Duration::from_millis(1900) && took < Duration::from_millis(3000),
        "failed after {took:?}"
    );
    // Past the bound, requests fail at once until a path is back.
    let started = Instant::now();
    assert!(read(&table, 0).is_err());
    assert!(started.elapsed() < Duration::from_millis(100));
    // The checker finds a path that answers again, and the count starts over.
    rig.down(0, false);
    wait_for("the checker to reinstate a", || {
        target(&table).status().contains("a A")
    });
    read(&table, 0).unwrap();
}

#[test]
fn the_checker_reinstates_failed_paths_that_answer_again() {
    let rig = Rig::new();
    let (table, events) = rig.build(&format!("2 checker_interval 1 {}", &TWO_PATHS[2..]));
    rig.down(1, true);
    read(&table, 0).unwrap();
    read(&table, 0).unwrap();
    assert!(target(&table).status().ends_with("b F 1"));
    // Still down: the checker's probes fail and the path stays failed.
    std::thread::sleep(Duration::from_millis(1300));
    assert!(target(&table).status().ends_with("b F 1"));
    rig.down(1, false);
    let started = Instant::now();
    wait_for("the checker to reinstate b", || {
        target(&table).status().ends_with("b A 1")
    });
    assert!(started.elapsed() < Duration::from_millis(1500));
    assert_eq!(events.load(Ordering::SeqCst), 2);
    let details = target(&table).status_details().unwrap();
    assert_eq!(details["groups"][0]["paths"][1]["state"], "active");
    assert_eq!(details["checker_interval_seconds"], 1);
}

#[test]
fn a_flush_reaches_every_path_that_took_writes_and_only_those() {
    let rig = Rig::new();
    let (table, _) = rig.build("0 0 1 1 round-robin 0 3 1 a 1 b 1 c 1");
    let flushes = |rig: &Rig| -> Vec<u64> {
        rig.routes
            .iter()
            .map(|r| r.flushes.swap(0, Ordering::SeqCst))
            .collect()
    };
    // Round-robin: one write each to a and b.
    table
        .write(0, &pattern(4096, 4), WriteFlags::default())
        .unwrap();
    table
        .write(4096, &pattern(4096, 5), WriteFlags::default())
        .unwrap();
    table.flush().unwrap();
    assert_eq!(flushes(&rig), [1, 1, 0]);
    // Nothing written since: nothing to flush.
    table.flush().unwrap();
    assert_eq!(flushes(&rig), [0, 0, 0]);
    // c takes a write and then fails: its flush goes down a usable path instead.
    table
        .write(8192, &pattern(4096, 6), WriteFlags::default())
        .unwrap();
    rig.down(2, true);
    table.flush().unwrap();
    let counts = flushes(&rig);
    assert_eq!(counts[0] + counts[1], 1, "{counts:?}");
    assert!(target(&table).status().ends_with("c F 1"));
    // With no path at all the flush fails, and the paths stay owed.
    table
        .write(0, &pattern(4096, 7), WriteFlags::default())
        .unwrap();
    rig.down(0, true);
    rig.down(1, true);
    assert_eq!(table.flush().unwrap_err().errno(), libc::EIO);
    flushes(&rig);
    rig.down(0, false);
    message(&table, "reinstate_path a").unwrap();
    table.flush().unwrap();
    assert_eq!(flushes(&rig), [1, 0, 0]);
    assert_eq!(rig.disk.allocated(), 3 * 4096);
}

/// A path that refuses writes for lack of space: no other path would do better.
struct Full(Arc<MemoryDevice>);

impl BlockDevice for Full {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.0.read(offset, buf)
    }
    fn write(&self, _: u64, _: &[u8], _: WriteFlags) -> Result<()> {
        Err(BlockError::NoSpace("full".into()))
    }
    fn flush(&self) -> Result<()> {
        Ok(())
    }
}

#[test]
fn errors_that_any_path_would_give_reach_the_caller_and_fail_no_path() {
    let rig = Rig::new();
    rig.devices
        .add("full", Arc::new(Full(rig.disk.clone())), false);
    let table = build(
        &rig.devices,
        &format!("0 {SECTORS} multipath 0 0 1 1 round-robin 0 2 1 full 1 a 1"),
    )
    .unwrap();
    let err = table
        .write(0, &pattern(4096, 1), WriteFlags::default())
        .unwrap_err();
    assert_eq!(err.errno(), libc::ENOSPC);
    assert!(target(&table).status().contains("full A 0"));
}

#[test]
fn bad_messages_say_what_is_wrong() {
    let rig = Rig::new();
    let (table, events) = rig.build("0 0 2 1 round-robin 0 1 1 a 1 round-robin 0 1 1 b 1");
    let cases = [
        (
            "fail_path nosuch",
            "multipath: no path 'nosuch' (paths: a, b)",
        ),
        ("reinstate_path ./a", "no path './a'"),
        ("fail_path", "wrong number of arguments for 'fail_path'"),
        ("fail_path a b", "wrong number of arguments"),
        (
            "queue_if_no_path now",
            "wrong number of arguments for 'queue_if_no_path'",
        ),
        (
            "switch_group 0",
            "invalid <group> 0: must be between 1 and 2",
        ),
        ("switch_group 3", "invalid <group> 3"),
        ("disable_group x", "invalid <group> 'x'"),
        (
            "frobnicate",
            "multipath: unknown message 'frobnicate' (messages: queue_if_no_path",
        ),
    ];
    for (words, expected) in cases {
        let err = message(&table, words).unwrap_err();
        assert!(err.contains(expected), "{words}: {err}");
    }
    assert_eq!(events.load(Ordering::SeqCst), 0);
    // Messages are case-insensitive, as the kernel's.
    message(&table, "FAIL_PATH a").unwrap();
    assert!(target(&table).status().contains("a F 1"));
    let (none, _) = rig.build("1 queue_if_no_path 0 0 0");
    let err = message(&none, "switch_group 1").unwrap_err();
    assert!(err.contains("there are no priority groups"), "{err}");
}

#[test]
fn a_multipath_with_no_groups_fails_or_queues_everything() {
    let rig = Rig::new();
    let (table, _) = rig.build("0 0 0 0");
    assert_eq!(target(&table).status(), "2 0 0 0 0 0");
    assert_eq!(read(&table, 0).unwrap_err().errno(), libc::EIO);
    let (table, _) = rig.build("3 queue_if_no_path no_path_retry 0 0 0 0");
    assert_eq!(read(&table, 0).unwrap_err().errno(), libc::EIO);
}

#[test]
fn tables_with_bad_paths_are_refused() {
    let rig = Rig::new();
    rig.devices.add_memory("small", MIB);
    let cases = [
        (
            "0 0 1 1 round-robin 0 2 1 a 1 a 1",
            "path 'a' is listed twice",
        ),
        (
            "0 0 2 1 round-robin 0 1 1 a 1 round-robin 0 1 1 a 1",
            "path 'a' is listed twice",
        ),
        (
            "0 0 1 1 round-robin 0 1 1 nosuch 1",
            "cannot open path 'nosuch'",
        ),
        (
            "0 0 1 1 round-robin 0 1 1 small 1",
            "device 'small' has 2048 sectors",
        ),
    ];
    for (args, expected) in cases {
        let err = build(&rig.devices, &format!("0 {SECTORS} multipath {args}"))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.starts_with("line 1: multipath: "), "{args}: {err}");
        assert!(err.contains(expected), "{args}: {err}");
    }
}

#[test]
fn selectors_spread_requests_over_the_paths() {
    let rig = Rig::new();
    let (table, _) = rig.build("0 0 1 1 round-robin 0 2 1 a 3 b 1");
    for _ in 0..8 {
        read(&table, 0).unwrap();
    }
    assert_eq!((rig.reads(0), rig.reads(1)), (6, 2));
    for (selector, args) in [("queue-length", "1"), ("service-time", "1 1")] {
        let rig = Rig::new();
        let (table, _) = rig.build(&format!(
            "0 0 1 1 {selector} 0 2 {} a {args} b {args}",
            args.split(' ').count()
        ));
        for _ in 0..8 {
            read(&table, 0).unwrap();
        }
        // Idle paths tie, and take turns.
        assert_eq!((rig.reads(0), rig.reads(1)), (4, 4), "{selector}");
    }
}

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

/// Two names of one 4 MiB file as the paths `a` and `b` of a round-robin multipath.
fn file_paths(dir: &udm_testkit::TempDir) -> Table {
    use udm_block::{FileDevice, OpenMode};
    let (a, b) = (dir.path("a.img"), dir.path("b.img"));
    std::fs::File::create(&a).unwrap().set_len(4 * MIB).unwrap();
    std::fs::hard_link(&a, &b).unwrap();
    let files = Devices::default();
    for (name, path) in [("a", &a), ("b", &b)] {
        let file = FileDevice::open(path, OpenMode::ReadWrite).unwrap();
        files.add(name, Arc::new(file), false);
    }
    build(&files, &format!("0 {SECTORS} multipath {TWO_PATHS}")).unwrap()
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

#[test]
fn flushes_to_several_paths_run_at_once() {
    let rig = Rig::new();
    let (table, _) = rig.build("0 0 1 1 round-robin 0 3 1 a 1 b 1 c 1");
    let now = Arc::new(AtomicU64::new(0));
    let most = Arc::new(AtomicU64::new(0));
    for route in &rig.routes {
        let (now, most) = (now.clone(), most.clone());
        *route.on_flush.lock() = Some(Box::new(move || {
            most.fetch_max(now.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(200));
            now.fetch_sub(1, Ordering::SeqCst);
        }));
    }
    for i in 0..3 {
        table
            .write(i * 4096, &pattern(4096, 9), WriteFlags::default())
            .unwrap();
    }
    let started = Instant::now();
    table.flush().unwrap();
    assert_eq!(most.load(Ordering::SeqCst), 3, "flushes one after another");
    assert!(started.elapsed() < Duration::from_millis(550));
    // One failing among them fails its path alone; its writes are covered down another.
    for i in 0..3 {
        table
            .write(i * 4096, &pattern(4096, 10), WriteFlags::default())
            .unwrap();
    }
    rig.routes[1].fail_writes.store(true, Ordering::SeqCst);
    table.flush().unwrap();
    assert!(target(&table).status().ends_with("a A 0 b F 1 c A 0"));
}

#[test]
fn the_checker_fails_an_active_path_that_stops_answering_before_io_finds_it() {
    let rig = Rig::new();
    let (table, events) = rig.build(&format!("2 checker_interval 1 {}", &TWO_PATHS[2..]));
    rig.down(0, true);
    let started = Instant::now();
    wait_for("the checker to fail a", || {
        target(&table).status().contains("a F 1")
    });
    assert!(started.elapsed() < Duration::from_millis(1500));
    assert_eq!(events.load(Ordering::SeqCst), 1);
    // No request went down a to find it dead: only probes read it.
    let probes = rig.reads(0);
    for i in 0..4 {
        read(&table, i * 4096).unwrap();
    }
    assert_eq!(rig.reads(0), probes);
}

#[test]
fn failback_immediate_sends_io_back_to_the_first_group_when_its_path_returns() {
    for (failback, back) in [("immediate", true), ("manual", false)] {
        let rig = Rig::new();
        let (table, _) = rig.build(&format!(
            "4 checker_interval 1 failback {failback} 0 2 1 \
             round-robin 0 1 1 a 1 round-robin 0 1 1 b 1"
        ));
        rig.down(0, true);
        read(&table, 0).unwrap();
        assert!(target(&table).status().contains("a F 1"));
        rig.down(0, false);
        wait_for("the checker to reinstate a", || {
            target(&table).status().contains("a A 1")
        });
        let (a, b) = (rig.reads(0), rig.reads(1));
        for i in 0..4 {
            read(&table, i * 4096).unwrap();
        }
        let went_back = rig.reads(0) - a >= 4;
        assert_eq!(went_back, back, "failback {failback}");
        assert_eq!(rig.reads(1) - b >= 4, !back, "failback {failback}");
        let group = if back { "2 0 0 0 2 1" } else { "2 0 0 0 2 2" };
        assert!(
            target(&table).status().starts_with(group),
            "failback {failback}: {}",
            target(&table).status()
        );
    }
}

#[test]
fn historical_service_time_sends_most_requests_down_the_path_that_serves_faster() {
    let rig = Rig::new();
    *rig.routes[1].on_read.lock() = Some(Box::new(|| std::thread::sleep(Duration::from_millis(3))));
    let (table, _) = rig.build("0 0 1 1 historical-service-time 0 2 1 a 0 b 0");
    let table = Arc::new(table);
    let until = Instant::now() + Duration::from_millis(400);
    let readers: Vec<_> = (0..8)
        .map(|_| {
            let table = table.clone();
            std::thread::spawn(move || {
                while Instant::now() < until {
                    read(&table, 0).unwrap();
                }
            })
        })
        .collect();
    for reader in readers {
        reader.join().unwrap();
    }
    let (fast, slow) = (rig.reads(0), rig.reads(1));
    assert!(fast > 10 * slow && slow > 0, "a: {fast} reads, b: {slow}");
    // Status: the estimate (ns × 1024), requests in flight, when the path goes stale.
    let status = target(&table).status();
    let words: Vec<&str> = status.split_whitespace().collect();
    assert_eq!(
        words[..10],
        ["2", "0", "0", "0", "1", "1", "A", "0", "2", "3"]
    );
    let estimate = |at: usize| words[at].parse::<u64>().unwrap() >> 10;
    let (a_ns, b_ns) = (estimate(13), estimate(19));
    assert!(b_ns > 3 * a_ns && b_ns > 1_000_000, "{status}");
    assert_eq!((words[14], words[20]), ("0", "0"), "{status}");
}

#[test]
fn work_for_many_paths_runs_at_once_in_bounded_batches() {
    let now = AtomicU64::new(0);
    let most = AtomicU64::new(0);
    let items: Vec<usize> = (0..70).collect();
    let results = super::io::each_at_once("test", &items, |i| {
        most.fetch_max(now.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(20));
        now.fetch_sub(1, Ordering::SeqCst);
        i * 2
    });
    assert_eq!(
        results,
        items.iter().map(|&i| (i, i * 2)).collect::<Vec<_>>()
    );
    let most = most.load(Ordering::SeqCst);
    assert!((2..=32).contains(&most), "{most} at once");
}
