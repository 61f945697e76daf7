//! The background copy: it finishes, skips zeroes, obeys messages and the bandwidth cap, and
//! never holds up or overwrites the user.

use super::*;

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
            let junk = pattern(64 << 10, 7);
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
fn the_bandwidth_cap_counts_bytes_copied_not_holes_skipped() {
    // A 64 MiB source that is all hole, capped at 1 MiB/s: nothing is read, so nothing is
    // held back. (Counting the regions' bytes, the cap held this to 64 s.)
    let started = Instant::now();
    let r = rig_with(
        64 * MIB,
        "8 0 6 hydration_threshold 256 hydration_batch_size 64 max_hydration_rate 1024",
        |pre| pre.source.inner.discard(0, 64 * MIB).unwrap(),
    );
    r.wait_complete();
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "64 MiB of holes took {:?} under a 1 MiB/s cap",
        started.elapsed()
    );
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
    use crate::clone::hydration::tests_hook::HOOK;
    let r = rig(4 * MIB, "128 1 no_hydration");
    let (hit, gap) = std::sync::mpsc::channel::<u64>();
    let (done, resume) = std::sync::mpsc::channel::<()>();
    let source = Arc::as_ptr(&r.source) as *const () as usize;
    let once = std::sync::atomic::AtomicBool::new(false);
    let resume = parking_lot::Mutex::new(resume);
    let hit = parking_lot::Mutex::new(hit);
    *HOOK.lock() = Some(Box::new(move |inner, region| {
        // Only this test's clone, and only once: stop in the gap until the user has written.
        if Arc::as_ptr(&inner.source) as *const () as usize == source
            && !once.swap(true, Ordering::SeqCst)
        {
            hit.lock().send(region).unwrap();
            let _ = resume.lock().recv_timeout(Duration::from_secs(10));
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
    *HOOK.lock() = None;
    assert!(
        read(&r.table, region * 65536, 65536)[..] == data[..],
        "the copier overwrote region {region} with source data"
    );
}

#[test]
fn a_paused_hydration_says_so_and_shows_no_rate_or_eta() {
    let r = rig(8 * MIB, "8 1 no_hydration");
    let details = || r.clone_target().status_details().unwrap();
    let d = details();
    assert_eq!(d["state"], "paused", "{d}");
    assert_eq!(d["paused_by"], "disable_hydration", "{d}");
    assert!(d["copy_rate_bytes_per_second"].is_null() && d["eta_seconds"].is_null());
    // Threshold 0 first: enabled with threshold 1 even for a moment, hydration of this
    // small memory clone can finish before the next message (seen under load).
    r.message("hydration_threshold 0");
    r.message("enable_hydration");
    assert_eq!(details()["paused_by"], "hydration_threshold 0");
    r.table.suspend();
    r.message("hydration_threshold 1");
    let d = details();
    assert_eq!(
        (&d["state"], &d["paused_by"]),
        (&"paused".into(), &"the device is suspended".into())
    );
    r.table.resume();
    assert_eq!(details()["state"], "hydrating");
    assert!(details()["paused_by"].is_null());
    r.message("hydration_threshold 256");
    r.message("hydration_batch_size 64");
    r.wait_complete();
    let d = details();
    assert_eq!(
        (&d["state"], &d["eta_seconds"]),
        (&"complete".into(), &0.0.into())
    );
}
