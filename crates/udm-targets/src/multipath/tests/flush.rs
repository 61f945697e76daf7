//! Flushes reach every path that took writes, at once, in bounded batches.

use super::*;

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
    // b, failed, is sent the flush it is owed too (its device might report writes lost):
    // it fails there, and a covers it.
    assert_eq!(flushes(&rig), [1, 1, 0]);
    assert_eq!(rig.disk.allocated(), 3 * 4096);
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
fn work_for_many_paths_runs_at_once_in_bounded_batches() {
    let now = AtomicU64::new(0);
    let most = AtomicU64::new(0);
    let items: Vec<usize> = (0..70).collect();
    let results = crate::multipath::io::each_at_once("test", &items, |i| {
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
