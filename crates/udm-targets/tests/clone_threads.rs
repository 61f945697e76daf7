//! A clone's threads exist only while its table is live: an inactive table (loaded, not
//! yet resumed) must not hold threads. Alone in its test binary, so that the threads it counts
//! are this test's.

use std::sync::Arc;

use udm_targets::Table;
use udm_testkit::Devices;

/// Threads of this process. (Counted, not matched by name: a new thread names itself only
/// once it runs.)
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

#[test]
fn copy_threads_start_when_the_table_goes_live_and_end_with_it() {
    let devices = Devices::memory(&[("meta", 1 << 20), ("dest", 8 << 20), ("source", 8 << 20)]);
    let text = "0 16384 clone meta dest source 8";
    let build = || Table::build("vol", text, &devices, Arc::new(|| {})).unwrap();
    let before = threads();

    let inactive = build();
    assert_eq!(threads(), before, "an inactive table started threads");
    drop(inactive);

    let live = build();
    live.resume();
    let running = threads();
    assert!(running > before, "a live clone has no copy threads");
    live.suspend();
    live.resume();
    // The copy thread the suspend sent away may take a moment to end.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while threads() > running && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(threads(), running, "a second resume started more threads");
    drop(live);
    assert_eq!(threads(), before, "threads outlived their table");
}
