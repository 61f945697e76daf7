//! Commits, metadata failures and reopening.

use super::*;

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
    assert!(read(&r.table, 4096, 4096)[..] == pattern(8192, 1)[4096..]);
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
    let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let (target, log) = (r.clone_target().clone(), seen.clone());
    *r.meta.on_read.lock() = Some(Box::new(move || {
        log.lock().push(target.status());
    }));
    assert_eq!(r.table.flush().unwrap_err().errno(), libc::EIO);
    // The hook holds the target: let go of it before the rig goes.
    r.meta.on_read.lock().take();
    let seen = seen.lock();
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
        .write(0, &pattern(4096, 3), WriteFlags::default())
        .unwrap();
    let resolver = named(&[("meta", meta), ("dest", dest), ("source", source)]);
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
