use std::sync::mpsc;
use std::time::{Duration, Instant};

use udm_block::{AlignedBuf, BlockDevice, MapOp};
use udm_testkit::TempDir;

use super::*;
use crate::daemon::Registry;

/// Every read of `slow` takes this long.
const SLOW: Duration = Duration::from_millis(300);

/// A registry with `base` (a zero device) and `slow` (a delay over it).
fn registry(dir: &TempDir) -> Arc<Registry> {
    let registry = Registry::in_scratch(dir);
    registry.must_create("base", "0 2048 zero");
    let table = format!("0 2048 delay base 0 {}", SLOW.as_millis());
    registry.must_create("slow", &table);
    registry
}

fn read(device: &Device) -> Result<()> {
    device.read(0, &mut AlignedBuf::zeroed(4096))
}

/// Runs `op` while a read of `device` is in flight (it has passed the gate); returns how
/// long `op` took.
fn with_a_read_in_flight(device: &Arc<Device>, op: impl FnOnce()) -> Duration {
    std::thread::scope(|s| {
        let reader = s.spawn(|| read(device));
        while device.gate.in_flight.load(Ordering::SeqCst) == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        let started = Instant::now();
        op();
        let took = started.elapsed();
        reader
            .join()
            .unwrap()
            .expect("the read in flight completes");
        took
    })
}

#[test]
fn suspend_waits_for_the_requests_in_flight() {
    let dir = TempDir::new("gate-drain");
    let slow = registry(&dir).get("slow").unwrap();
    let took = with_a_read_in_flight(&slow, || slow.suspend(false));
    assert!(took >= SLOW / 3, "suspend returned after {took:?}");
    assert!(slow.is_suspended());
}

#[test]
fn requests_wait_at_a_suspended_device_until_resume() {
    let dir = TempDir::new("gate-hold");
    let base = registry(&dir).get("base").unwrap();
    base.suspend(false);
    let (done, finished) = mpsc::channel();
    let held = base.clone();
    let reader = std::thread::spawn(move || done.send(read(&held)).unwrap());
    assert!(
        finished.recv_timeout(Duration::from_millis(200)).is_err(),
        "a read went through a suspended device"
    );
    base.resume();
    finished
        .recv_timeout(Duration::from_secs(10))
        .unwrap()
        .expect("the held read succeeds after resume");
    reader.join().unwrap();
}

#[test]
fn a_mapped_request_holds_its_place_until_it_completes_and_never_waits() {
    let dir = TempDir::new("gate-map");
    let base = registry(&dir).get("base").unwrap();
    let mapping = base.map(MapOp::Read, 0, 4096).expect("zero maps reads");
    std::thread::scope(|s| {
        let suspender = s.spawn(|| base.suspend(false));
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            !suspender.is_finished(),
            "suspend did not wait for a mapped request"
        );
        drop(mapping);
        suspender.join().unwrap();
    });
    // Suspended: mapping declines (the request takes the synchronous way and waits there).
    assert!(base.map(MapOp::Read, 0, 4096).is_none());
    base.resume();
    assert!(base.map(MapOp::Read, 0, 4096).is_some());
}

#[test]
fn resume_with_an_inactive_table_drains_the_old_one_first() {
    let dir = TempDir::new("gate-swap");
    let registry = registry(&dir);
    let slow = registry.get("slow").unwrap();
    registry.load("slow", "0 4096 zero", false, false).unwrap();
    // No suspend before: as dmsetup's reload + resume, the resume suspends first.
    let took = with_a_read_in_flight(&slow, || {
        slow.resume().expect("a table was replaced");
    });
    assert!(took >= SLOW / 3, "the swap did not wait: {took:?}");
    assert!(!slow.is_suspended());
    assert_eq!(slow.live().lines(), ["0 4096 zero"]);
    assert_eq!(slow.size(), 4096 * 512);
    assert!(slow.inactive().is_none());
}

#[test]
fn events_wake_a_waiter_and_time_out_otherwise() {
    let events = Arc::new(Events::default());
    let start = events.current();
    assert_eq!(events.wait(start, Duration::from_millis(20)), start);
    let raiser = {
        let events = events.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            events.raise();
        })
    };
    assert_eq!(events.wait(start, Duration::from_secs(10)), start + 1);
    raiser.join().unwrap();
}

#[test]
fn open_handles_count_and_release_their_device() {
    let dir = TempDir::new("opens");
    let base = registry(&dir).get("base").unwrap();
    let nbd = base.open(false);
    let file = base.open(true);
    assert_eq!((base.open_count(), base.file_open_count()), (2, 1));
    drop(file);
    assert_eq!((base.open_count(), base.file_open_count()), (1, 0));
    drop(nbd);
    assert_eq!(base.open_count(), 0);
}
