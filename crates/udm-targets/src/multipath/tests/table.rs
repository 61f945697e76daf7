//! The table line, messages and selectors.

use super::*;

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
