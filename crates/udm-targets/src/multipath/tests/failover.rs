//! Failing paths: a request goes down another path, groups fail over, and with no path left
//! requests fail or queue within their bounds.

use super::*;

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

#[test]
fn queue_if_no_path_holds_requests_until_a_path_returns_or_fail_if_no_path() {
    let rig = Rig::new();
    let (table, _) = rig.two_paths("1 queue_if_no_path");
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
    table.presuspend(false);
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
    let (table, _) = rig.two_paths("5 queue_if_no_path no_path_retry 2 checker_interval 1");
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
fn a_multipath_with_no_groups_fails_or_queues_everything() {
    let rig = Rig::new();
    let (table, _) = rig.build("0 0 0 0");
    assert_eq!(target(&table).status(), "2 0 0 0 0 0");
    assert_eq!(read(&table, 0).unwrap_err().errno(), libc::EIO);
    let (table, _) = rig.build("3 queue_if_no_path no_path_retry 0 0 0 0");
    assert_eq!(read(&table, 0).unwrap_err().errno(), libc::EIO);
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
