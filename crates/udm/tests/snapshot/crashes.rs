//! Merges, restarts, kill -9 and vanished clients: nothing lost, nothing left behind.

use super::*;

#[test]
fn a_merge_rolls_back_under_fio_and_resumes_after_kill_9() {
    let mut daemon = Daemon::start("snap-merge");
    let (origin, _) = origin_of(&daemon, 64 * MIB);
    let cow = snapshot(&daemon, "snap", &origin, 64 * MIB, "P 8");
    // Change 40 MiB of the origin; keep what the snapshot shows.
    fio(
        &daemon.uri("base"),
        &["--offset=0", "--size=40M", "--bs=4k", "--do_verify=0"],
    );
    let view = daemon.dir.path("view.img");
    tool("nbdcopy", &[&daemon.uri("snap"), view.to_str().unwrap()]);
    // The kernel's way (lvconvert --merge): suspend the snapshot device, load the merge in
    // the origin device's place (it takes the COW device over), resume, then drop the
    // snapshot device, whose I/O fails from the merge's resume on.
    daemon.udm(&["suspend", "snap"]);
    let merge = merge_table(&origin, &cow);
    daemon.udm(&["load", "base", "--table", &merge]);
    daemon.udm(&["resume", "base"]);
    assert_eq!(status(&daemon, "snap"), "Invalid");
    daemon.udm(&["resume", "snap"]);
    let (read, said) = common::qemu_io(&daemon.uri("snap"), "read 0 4k");
    assert!(!read && said.contains("Input/output error"), "{said}");
    daemon.udm(&["remove", "snap"]);
    daemon.udm(&["message", "base", "0", "max_merge_rate", "4096"]);
    assert_eq!(daemon.udm(&["table", "base"]), merge);
    // At once the device reads as the snapshot did, while the merge copies in the
    // background and fio writes and verifies its own region.
    same_content(view.to_str().unwrap(), &daemon.uri("base"));
    fio(&daemon.uri("base"), &["--offset=48M", "--size=8M"]);
    let left = exceptions(&daemon, "base");
    assert!(left > 0, "still merging");
    daemon.crash_and_restart();
    // (The allocated sectors of the status line are computed differently while merging and
    // after a load, as in the kernel; the count of chunks left is the plain measure.)
    let again = exceptions(&daemon, "base");
    assert!(
        again <= left && again > 0,
        "resumed mid-way: {again} left, {left} before"
    );
    daemon.udm(&["message", "base", "0", "max_merge_rate", "0"]);
    let before = daemon.event_nr("base");
    let out = daemon.udm(&["wait", "base", "--progress"]);
    assert!(out.ends_with("merge complete"), "{out}");
    assert!(daemon.event_nr("base") > before, "an event at completion");
    let (allocated, _, metadata) = usage(&status(&daemon, "base"));
    assert_eq!(allocated, metadata);
    fio(
        &daemon.uri("base"),
        &["--offset=48M", "--size=8M", "--verify_only"],
    );
    // Everything fio did not write during the merge is the snapshot's, on the origin file.
    let merged = std::fs::read(&origin).unwrap();
    let view = std::fs::read(&view).unwrap();
    assert!(merged[..48 * MIB as usize] == view[..48 * MIB as usize]);
    assert!(merged[56 * MIB as usize..] == view[56 * MIB as usize..]);
    // Done: back to snapshot-origin; the COW device is free again.
    daemon.udm(&["finalize", "base"]);
    assert!(daemon.udm(&["table", "base"]).contains("snapshot-origin"));
    std::fs::remove_file(&cow).unwrap();
}

/// dmsetup's habit the kernel refuses: a merge that would take the COW device over from a
/// snapshot device still live, by `udm resume` of the origin device with the merge loaded or
/// by `udm create`. udm took it over (the snapshot's I/O failing from then on); now it is
/// refused as by the kernel's snapshot_preresume, naming the device, and nothing changes.
/// The documented procedure (suspend the snapshot device first) goes ahead.
#[test]
fn a_merge_is_refused_while_its_snapshot_device_is_live_and_nothing_changes() {
    let daemon = Daemon::start("snap-merge-live");
    let (origin, original, cow) = changed_since_snapshot(&daemon, 4 * MIB, MIB);
    let cow_before = std::fs::read(&cow).unwrap();
    let merge = merge_table(&origin, &cow);
    let refused = "unable to perform snapshot handover until source is suspended: device \
                   'snap' serves COW device";
    // Nothing changed: the tables, the data of both devices, the COW device.
    let unchanged = |origin_device: Option<&str>| {
        assert!(!status(&daemon, "snap").contains("Invalid"));
        same_content(original.to_str().unwrap(), &daemon.uri("snap"));
        if let Some(name) = origin_device {
            assert!(daemon.udm(&["table", name]).contains("snapshot-origin"));
            qemu_io(&daemon.uri(name), &["read -P 5 0 1M"]);
        }
        assert!(
            std::fs::read(&cow).unwrap() == cow_before,
            "the COW device changed"
        );
    };
    daemon.udm(&["load", "base", "--table", &merge]);
    let err = daemon.udm_err(&["resume", "base"]);
    assert!(err.contains(refused), "{err}");
    unchanged(Some("base"));
    daemon.udm(&["remove", "base"]);
    let err = daemon.udm_err(&["create", "merged", "--table", &merge]);
    assert!(err.contains(refused), "{err}");
    unchanged(None);
    daemon.udm(&["suspend", "snap"]);
    daemon.create("base", &merge);
    assert_eq!(status(&daemon, "snap"), "Invalid");
    daemon.udm(&["remove", "snap"]);
    daemon.udm(&["wait", "base", "--progress"]);
    same_content(original.to_str().unwrap(), &daemon.uri("base"));
}

/// A snapshot is refused while a merge rolls its origin back, but one loaded (built) before
/// the merge began and resumed during it was accepted: its point in time was the origin file
/// half rolled back, which no reader of the origin device ever saw (chunks merged already as
/// the snapshot, the rest as before the merge). Its first resume is now refused until the
/// merge is finalized.
#[test]
fn a_snapshot_loaded_before_a_merge_cannot_become_active_during_it() {
    let daemon = Daemon::start("snap-merge-late");
    let (origin, original, cow) = changed_since_snapshot(&daemon, 32 * MIB, 32 * MIB);
    let late_cow = daemon.sparse("late.cow", 40 * MIB);
    daemon.create("late", &format!("0 {} zero", 32 * MIB / 512));
    let late = format!(
        "0 {} snapshot {} {} P 8",
        32 * MIB / 512,
        origin.display(),
        late_cow.display()
    );
    daemon.udm(&["load", "late", "--table", &late]);
    daemon.udm(&["suspend", "snap"]);
    daemon.udm(&["load", "base", "--table", &merge_table(&origin, &cow)]);
    daemon.udm(&["resume", "base"]);
    daemon.udm(&["message", "base", "0", "max_merge_rate", "256"]);
    daemon.udm(&["remove", "snap"]);
    assert!(exceptions(&daemon, "base") > 0, "still merging");
    let err = daemon.udm_err(&["resume", "late"]);
    assert!(
        err.contains("origin '") && err.contains("is being merged into by device 'base'"),
        "{err}"
    );
    assert!(daemon.udm(&["table", "late"]).contains(" zero"));
    daemon.udm(&["message", "base", "0", "max_merge_rate", "0"]);
    daemon.udm(&["wait", "base", "--progress"]);
    daemon.udm(&["finalize", "base"]);
    // Once the merge is done, it is a snapshot of the origin rolled back.
    daemon.udm(&["resume", "late"]);
    qemu_io(&daemon.uri("base"), &["write -P 6 0 32M"]);
    same_content(original.to_str().unwrap(), &daemon.uri("late"));
}

/// `udm rename` (LVM renames the devices of a volume) of the devices a merge involves: the
/// origin's roles and the snapshot devices were known by the name the device had when its
/// table was built. Renamed, the merging device was refused its own merge table again
/// ("already being merged by device 'base'", a device that no longer existed), and a new
/// device under the old name was let serve the origin with snapshot-origin beside the merge:
/// its writes went straight to chunks the merge had yet to copy back, and were overwritten.
#[test]
fn renamed_devices_keep_their_places_in_a_merge() {
    let daemon = Daemon::start("snap-merge-rename");
    let (origin, original, cow) = changed_since_snapshot(&daemon, 32 * MIB, 32 * MIB);
    let merge = merge_table(&origin, &cow);
    daemon.udm(&["rename", "snap", "snap-renamed"]);
    daemon.udm(&["load", "base", "--table", &merge]);
    let err = daemon.udm_err(&["resume", "base"]);
    assert!(err.contains("device 'snap-renamed' serves"), "{err}");
    daemon.udm(&["suspend", "snap-renamed"]);
    daemon.udm(&["resume", "base"]);
    daemon.udm(&["message", "base", "0", "max_merge_rate", "256"]);
    daemon.udm(&["rename", "base", "merging"]);
    let err = daemon.udm_err(&[
        "create",
        "base",
        "--table",
        &format!("0 {} snapshot-origin {}", 32 * MIB / 512, origin.display()),
    ]);
    assert!(err.contains("being merged by device 'merging'"), "{err}");
    daemon.reload("merging", &merge);
    daemon.udm(&["message", "merging", "0", "max_merge_rate", "0"]);
    daemon.udm(&["wait", "merging", "--progress"]);
    same_content(original.to_str().unwrap(), &daemon.uri("merging"));
}

#[test]
fn snapshots_come_back_after_a_restart_and_a_transient_one_comes_back_invalid() {
    let mut daemon = Daemon::start("snap-restart");
    let (origin, original) = origin_of(&daemon, 16 * MIB);
    snapshot(&daemon, "snap", &origin, 16 * MIB, "P 8");
    snapshot(&daemon, "temp", &origin, 16 * MIB, "N 8");
    qemu_io(&daemon.uri("base"), &["write -P 9 1M 2M"]);
    same_content(original.to_str().unwrap(), &daemon.uri("temp"));
    daemon.crash_and_restart();
    same_content(original.to_str().unwrap(), &daemon.uri("snap"));
    qemu_io(
        &daemon.uri("base"),
        &["read -P 9 1M 2M", "write -P 10 8M 1M"],
    );
    same_content(original.to_str().unwrap(), &daemon.uri("snap"));
    // A transient snapshot's exceptions were in memory: it is gone, and says so.
    assert_eq!(status(&daemon, "temp"), "Invalid");
}

/// Snapshots of an origin that is being rolled back to another snapshot of it: the merge
/// saves each chunk into them before it overwrites it. After a restart the merge used to
/// come back before some of them (in the order the state files were read), and those were
/// then refused ("origin is being merged into"): gone, while the merge went on overwriting
/// what they had not saved yet; also with the merge only loaded, not yet resumed. Now they
/// come back before the merge, and stay exact.
#[test]
fn sibling_snapshots_of_a_merge_come_back_after_a_restart_and_stay_exact() {
    let mut daemon = Daemon::start("snap-merge-siblings");
    let (origin, _) = origin_of(&daemon, 4 * MIB);
    let cow = snapshot(&daemon, "rollback", &origin, 8 * MIB, "P 8");
    qemu_io(&daemon.uri("base"), &["write -P 1 0 4M"]);
    // Several, so that some sort after the merge's device whatever the directory's order.
    let views: Vec<(String, String)> = (0..6)
        .map(|i| {
            let name = format!("sibling{i}");
            snapshot(&daemon, &name, &origin, 8 * MIB, "P 8");
            let view = daemon.dir.path(&format!("{name}.view"));
            tool("nbdcopy", &[&daemon.uri(&name), view.to_str().unwrap()]);
            (name, view.to_str().unwrap().to_string())
        })
        .collect();
    daemon.udm(&["suspend", "rollback"]);
    let merge = merge_table(&origin, &cow);
    daemon.udm(&["load", "base", "--table", &merge]);
    // Killed with the merge loaded, then with it running.
    for round in 0..2 {
        daemon.stop(libc::SIGKILL);
        daemon.reap();
        daemon.launch();
        for (name, view) in &views {
            same_content(view, &daemon.uri(name));
        }
        if round == 0 {
            daemon.udm(&["resume", "base"]);
            daemon.udm(&["message", "base", "0", "max_merge_rate", "256"]);
            daemon.udm(&["remove", "rollback"]);
        }
    }
    daemon.udm(&["message", "base", "0", "max_merge_rate", "0"]);
    let out = daemon.udm(&["wait", "base", "--progress"]);
    assert!(out.ends_with("merge complete"), "{out}");
    for (name, view) in &views {
        same_content(view, &daemon.uri(name));
    }
}

/// A client that sends first writes and vanishes while their copy-outs wait on a slow COW
/// device (they wait as steps of their mappings, on no thread): the writes finish without
/// it, the origin device still suspends (nothing is left counted in flight), the snapshot
/// is exact and both devices go away cleanly.
#[test]
fn a_client_that_vanishes_while_its_first_writes_copy_out_leaves_nothing_behind() {
    let daemon = Daemon::start("snap-vanish");
    let (origin, original) = origin_of(&daemon, 8 * MIB);
    let cow = daemon.sparse("snap.cow", 8 * MIB);
    daemon.udm(&[
        "create",
        "slowcow",
        "--table",
        &format!("0 16384 delay {} 0 100", cow.display()),
    ]);
    daemon.udm(&[
        "create",
        "snap",
        "--table",
        &format!("0 16384 snapshot {} slowcow P 8", origin.display()),
    ]);
    let mut client = RawClient::connect(&daemon.nbd_socket(), "base");
    let data = vec![0xabu8; 4096];
    for chunk in 0..64u64 {
        client.send(0, NBD_CMD_WRITE, chunk, chunk * 8 * 4096, 4096, &data);
    }
    drop(client);
    let t = std::time::Instant::now();
    daemon.udm(&["suspend", "base"]);
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    daemon.udm(&["resume", "base"]);
    same_content(original.to_str().unwrap(), &daemon.uri("snap"));
    daemon.udm(&["remove", "snap"]);
    daemon.udm(&["remove", "slowcow"]);
    daemon.udm(&["remove", "base"]);
    assert!(!daemon.log().contains("panic"), "{}", daemon.log());
}

/// kill -9 with many first writes in flight at once (fio, 4 jobs at depth 32, so hundreds of
/// copy-outs wait for commits as steps of their mappings): after the restart the snapshot
/// is the origin as it was, chunk for chunk: no origin write landed before its chunk was
/// committed into the snapshot.
#[test]
fn kill_9_with_hundreds_of_copy_outs_in_flight_keeps_the_snapshot_exact() {
    let mut daemon = Daemon::start("snap-kill-load");
    let (origin, original) = origin_of(&daemon, 64 * MIB);
    // Room for every chunk of the origin and the metadata areas that record them (64 areas of
    // 4 KiB): three rounds of random writes can touch nearly every chunk, and a COW no larger
    // than the origin then fills up and invalidates the snapshot.
    snapshot(&daemon, "snap", &origin, 72 * MIB, "P 8");
    for round in 0..3 {
        let uri = format!("--uri={}", daemon.uri("base"));
        let load = [
            "--name=load",
            "--ioengine=nbd",
            &uri,
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=32",
            "--numjobs=4",
            "--time_based",
            "--runtime=30",
            "--norandommap",
            &format!("--randseed={round}"),
        ];
        crash_under_fio(&mut daemon, &load, Duration::from_millis(1500));
        same_content(original.to_str().unwrap(), &daemon.uri("snap"));
    }
}

/// Runs fio with `args`; fails the test if it fails or has not finished in two minutes (a
/// copy-out or commit that never ends hangs its writes).
fn fio_within_two_minutes(args: &[&str]) {
    let mut fio = std::process::Command::new("fio")
        .args(args)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(status) = fio.try_wait().unwrap() {
            return assert!(status.success(), "fio {args:?}: {status}");
        }
        if std::time::Instant::now() > deadline {
            let _ = fio.kill();
            panic!("fio {args:?} hung");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A 64 MiB origin of pattern `seed` and a COW device of `cow_size`, each behind a 1 ms
/// `delay` (odelay, cdelay), with `base` (snapshot-origin) and `snap` (persistent, 4 KiB
/// chunks) on them; returns a copy of the origin as it was.
fn delayed_snapshot(daemon: &Daemon, seed: u64, cow_size: u64) -> std::path::PathBuf {
    let (origin, original) = patterned_with_copy(daemon, "origin.img", 64 * MIB, seed);
    let cow = daemon.sparse("snap.cow", cow_size);
    daemon.create(
        "odelay",
        &format!("0 131072 delay {} 0 1", origin.display()),
    );
    let cow_sectors = cow_size / 512;
    daemon.create(
        "cdelay",
        &format!("0 {cow_sectors} delay {} 0 1", cow.display()),
    );
    daemon.create("base", "0 131072 snapshot-origin odelay");
    daemon.create("snap", "0 131072 snapshot odelay cdelay P 8");
    original
}

/// fio's 8 writers at depth 32 over 8 MiB each of `uri` (`--uri=…`), 4 KiB random writes.
/// Runs fio with `args`, kills the daemon with SIGKILL `after` fio has begun (its writes in
/// flight: a crash), ends fio and starts the daemon again on the state it left.
fn crash_under_fio(daemon: &mut Daemon, args: &[&str], after: Duration) {
    let mut writer = std::process::Command::new("fio")
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(after);
    daemon.stop(libc::SIGKILL);
    let _ = writer.kill();
    let _ = writer.wait();
    daemon.launch();
}

fn burst_of_eight(uri: &str) -> [&str; 10] {
    [
        "--name=burst",
        "--ioengine=nbd",
        uri,
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=32",
        "--numjobs=8",
        "--size=8M",
        "--offset_increment=8M",
        // Jobs as threads: killing fio kills them all, none left writing to a dead socket.
        "--thread",
    ]
}

/// The attack on a COW device that fills in the middle of a burst of 8 writers at depth 32,
/// origin and COW behind a 1 ms `delay` (copy-outs on the runner, commits filling area after
/// area, the zeroing of the next area done ahead): killed -9 early in a burst, the snapshot
/// comes back exact; then a burst that fills it: Invalid with an event, every origin write
/// lands (fio verifies each), nothing hangs; after another restart it is still Invalid, as
/// `dmsetup status` would say, and the origin still takes writes.
#[test]
fn a_cow_that_fills_under_eight_writers_goes_invalid_and_the_origin_keeps_every_write() {
    let mut daemon = Daemon::start("snap-fill-burst");
    // 4096 chunks of 4 KiB: 15 metadata areas fill before it is full.
    let original = delayed_snapshot(&daemon, 9, 16 * MIB);
    let uri = format!("--uri={}", daemon.uri("base"));
    let burst = burst_of_eight(&uri);
    let timed = [
        &burst[..],
        &["--time_based", "--runtime=30", "--norandommap"],
    ]
    .concat();
    crash_under_fio(&mut daemon, &timed, Duration::from_millis(300));
    let saved = status(&daemon, "snap");
    assert_ne!(
        saved, "Invalid",
        "the COW device filled in 300 ms: make it larger"
    );
    same_content(original.to_str().unwrap(), &daemon.uri("snap"));
    let before = daemon.event_nr("snap");
    // Every chunk of the origin written once, four times what the COW device holds.
    fio_within_two_minutes(
        &[
            &burst[..],
            &[
                "--verify=crc32c",
                "--verify_fatal=1",
                "--verify_state_save=0",
            ],
        ]
        .concat(),
    );
    assert_eq!(status(&daemon, "snap"), "Invalid");
    assert!(daemon.event_nr("snap") > before);
    common::qemu_io_eio(&daemon.uri("snap"), "read 0 4k");
    daemon.crash_and_restart();
    assert_eq!(status(&daemon, "snap"), "Invalid");
    fio_within_two_minutes(
        &[
            &burst[..],
            &["--verify=crc32c", "--verify_only", "--verify_state_save=0"],
        ]
        .concat(),
    );
    qemu_io(
        &daemon.uri("base"),
        &["write -P 0x5a 0 1M", "read -P 0x5a 0 1M"],
    );
    assert!(!daemon.log().contains("panic"), "{}", daemon.log());
}

/// dmsetup's reload (load + resume, no suspend) of the snapshot and of the origin, again and
/// again, while 8 writers at depth 32 save chunks through delayed devices (copy-outs and
/// commits in flight across every swap): no write lost (fio verifies each), the snapshot
/// still the origin as it was, nothing hangs.
#[test]
fn reloads_without_suspend_during_a_burst_of_eight_writers_lose_nothing() {
    let daemon = Daemon::start("snap-reload-burst");
    let original = delayed_snapshot(&daemon, 4, 72 * MIB);
    let snap_table = "0 131072 snapshot odelay cdelay P 8";
    let uri = format!("--uri={}", daemon.uri("base"));
    let burst = [
        &burst_of_eight(&uri)[..],
        &[
            // Each pass writes and verifies its region again: long enough for every reload.
            "--loops=4",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--verify_state_save=0",
        ],
    ]
    .concat();
    std::thread::scope(|s| {
        let writer = s.spawn(|| fio_within_two_minutes(&burst));
        for _ in 0..5 {
            std::thread::sleep(Duration::from_millis(50));
            daemon.udm(&["load", "snap", "--table", snap_table]);
            daemon.udm(&["resume", "snap"]);
            daemon.udm(&["load", "base", "--table", "0 131072 snapshot-origin odelay"]);
            daemon.udm(&["resume", "base"]);
        }
        assert!(
            !writer.is_finished(),
            "the burst ended before the reloads did"
        );
        writer.join().unwrap();
    });
    assert_ne!(status(&daemon, "snap"), "Invalid");
    same_content(original.to_str().unwrap(), &daemon.uri("snap"));
    assert!(!daemon.log().contains("panic"), "{}", daemon.log());
}
