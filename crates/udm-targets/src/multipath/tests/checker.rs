//! The path checker: failed paths that answer come back, active ones that stop are failed.

use super::*;

/// Waits for `what`, which the checker (every second here) must bring about within 1.5 s.
fn checker_brings(what: &str, done: impl FnMut() -> bool) {
    let started = Instant::now();
    wait_for(what, done);
    assert!(started.elapsed() < Duration::from_millis(1500));
}

#[test]
fn the_checker_reinstates_failed_paths_that_answer_again() {
    let rig = Rig::new();
    let (table, events) = rig.two_paths("2 checker_interval 1");
    rig.down(1, true);
    read(&table, 0).unwrap();
    read(&table, 0).unwrap();
    assert!(target(&table).status().ends_with("b F 1"));
    // Still down: the checker's probes fail and the path stays failed.
    std::thread::sleep(Duration::from_millis(1300));
    assert!(target(&table).status().ends_with("b F 1"));
    rig.down(1, false);
    checker_brings("the checker to reinstate b", || {
        target(&table).status().ends_with("b A 1")
    });
    assert_eq!(events.load(Ordering::SeqCst), 2);
    let details = target(&table).status_details().unwrap();
    assert_eq!(details["groups"][0]["paths"][1]["state"], "active");
    assert_eq!(details["checker_interval_seconds"], 1);
}

#[test]
fn the_checker_fails_an_active_path_that_stops_answering_before_io_finds_it() {
    let rig = Rig::new();
    let (table, events) = rig.two_paths("2 checker_interval 1");
    rig.down(0, true);
    checker_brings("the checker to fail a", || {
        target(&table).status().contains("a F 1")
    });
    assert_eq!(events.load(Ordering::SeqCst), 1);
    // No request went down a to find it dead: only probes read it.
    let probes = rig.reads(0);
    for i in 0..4 {
        read(&table, i * 4096).unwrap();
    }
    assert_eq!(rig.reads(0), probes);
}
