//! The pool itself: out of data space, back after a restart, attacks on it, out of
//! metadata space.

use super::*;

#[test]
fn out_of_space_queues_then_errors_and_growing_the_pool_by_reload_unblocks_it() {
    let daemon = Daemon::start_with("thin-nospace", &["--no-space-timeout", "2s"]);
    let pool = make_pool(&daemon, "pool", 4, "");
    make_volume(&daemon, &pool, "vol", 1, 4 * MIB);
    fill(&daemon, "vol", 1, 0, 4 * BLOCK);
    let events = daemon.event_nr("pool");
    assert!(events >= 1, "the low water mark raised an event");
    // A fifth block waits, then fails with ENOSPC after the no-space timeout.
    let waited = fails_for_space(&daemon, "vol", 4 * BLOCK);
    assert!(
        waited >= Duration::from_millis(1900),
        "failed after {waited:?}"
    );
    let line = status(&daemon, "pool");
    assert!(
        line.contains(" 4/4 - out_of_data_space discard_passdown error_if_no_space - "),
        "{line}"
    );
    // Now writes that need space fail at once; writes to mapped blocks still work.
    assert!(fails_for_space(&daemon, "vol", 5 * BLOCK) < Duration::from_secs(1));
    fill(&daemon, "vol", 3, 0, 4096);
    // A write queued while the pool is grown by reload completes.
    let uri = daemon.uri("vol");
    daemon.udm(&["suspend", "pool"]);
    let queued =
        std::thread::spawn(move || qemu_io(&uri, &format!("write -P 7 {} {}", 6 * BLOCK, BLOCK)));
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !queued.is_finished(),
        "I/O waits while the pool is suspended"
    );
    resize(&pool.data, 16 * BLOCK);
    let table = thin_pool_table(&pool.meta, &pool.data, 16 * BLOCK, "4");
    daemon.udm(&["load", "pool", "--table", &table]);
    daemon.udm(&["resume", "pool"]);
    let (ok, out) = queued.join().unwrap();
    assert!(ok, "{out}");
    let line = status(&daemon, "pool");
    assert!(
        line.contains(" 5/16 - rw discard_passdown queue_if_no_space - "),
        "{line}"
    );
    fill(&daemon, "vol", 8, 4 * BLOCK, 4096);
    let vol = contents(&daemon, "vol");
    expect_bytes(&vol, 0, 4096, 3, "written while out of space");
    expect_bytes(&vol, 4 * BLOCK, 4096, 8, "after growing");
    expect_bytes(&vol, 6 * BLOCK, BLOCK, 7, "queued across the reload");
    with_pool_still(&daemon, &pool, &["vol"], || thin_check(&pool.meta));

    // error_if_no_space: fails at once.
    let strict = make_pool(&daemon, "strict", 2, "1 error_if_no_space");
    make_volume(&daemon, &strict, "svol", 1, MIB);
    fill(&daemon, "svol", 1, 0, 2 * BLOCK);
    assert!(fails_for_space(&daemon, "svol", 2 * BLOCK) < Duration::from_secs(1));
    with_pool_still(&daemon, &strict, &["svol"], || thin_check(&strict.meta));
}

/// dmsetup habits on a full pool that waits for space for ever (`--no-space-timeout 0`): a
/// suspend of the thin volume, or a reload of it without suspend, while a write waits for a
/// block. That used to wait as long as the write did: for ever. Now the waiting write fails
/// with ENOSPC (it was never acknowledged) as the suspend begins, and the suspend completes.
#[test]
fn suspending_a_volume_whose_write_waits_for_space_does_not_wait_for_ever() {
    let daemon = Daemon::start_with("thin-nospace-suspend", &["--no-space-timeout", "0"]);
    let pool = make_pool(&daemon, "pool", 2, "");
    make_volume(&daemon, &pool, "vol", 1, 4 * MIB);
    fill(&daemon, "vol", 1, 0, 2 * BLOCK);
    let table = daemon.udm(&["table", "vol"]);
    for verbs in [&["suspend"][..], &["load", "resume"]] {
        let uri = daemon.uri("vol");
        let waiting =
            std::thread::spawn(move || qemu_io(&uri, &format!("write -P 2 {} 4096", 3 * BLOCK)));
        // The pool stays out of data space from the first round on: what says that this
        // round's write waits is the count of writes waiting.
        let started = Instant::now();
        let writes_waiting = || pool_details(&daemon, &pool)["writes_waiting_for_space"].as_u64();
        while writes_waiting().expect("writes_waiting_for_space in the pool's details") == 0 {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the write never waited"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(status(&daemon, "pool").contains(" out_of_data_space "));
        let (done, finished) = std::sync::mpsc::channel();
        let control = daemon.control();
        let (verbs_run, table) = (verbs.to_vec(), table.clone());
        std::thread::spawn(move || {
            for verb in verbs_run {
                let mut args = vec![verb, "vol"];
                if verb == "load" {
                    args.extend(["--table", &table]);
                }
                let out = std::process::Command::new(UDM)
                    .args(&args)
                    .env("UDM_CONTROL", &control)
                    .output()
                    .unwrap();
                assert!(out.status.success(), "{out:?}");
            }
            let _ = done.send(());
        });
        finished
            .recv_timeout(Duration::from_secs(10))
            .unwrap_or_else(|_| panic!("{verbs:?} of vol waits for the write waiting for space"));
        daemon.udm(&["resume", "vol"]);
        let (ok, out) = waiting.join().unwrap();
        assert!(!ok && out.contains("No space left on device"), "{out}");
    }
    // A noflush suspend pushes the waiting write back instead: it is not answered, and
    // once the pool has grown and the volume is resumed it is done (the kernel requeues it).
    let uri = daemon.uri("vol");
    let waiting =
        std::thread::spawn(move || qemu_io(&uri, &format!("write -P 3 {} 4096", 3 * BLOCK)));
    let started = Instant::now();
    while pool_details(&daemon, &pool)["writes_waiting_for_space"].as_u64() != Some(1) {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the write never waited"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    daemon.udm(&["suspend", "--noflush", "vol"]);
    std::thread::sleep(Duration::from_millis(300));
    assert!(!waiting.is_finished(), "answered while suspended");
    // The pool grown, the pushed-back write and later ones go on, and nothing written before
    // changed.
    resize(&pool.data, 8 * BLOCK);
    daemon.reload(
        "pool",
        &thin_pool_table(&pool.meta, &pool.data, 8 * BLOCK, "4"),
    );
    daemon.udm(&["resume", "vol"]);
    let (ok, out) = waiting.join().unwrap();
    assert!(ok, "{out}");
    let vol = contents(&daemon, "vol");
    expect_bytes(&vol, 0, 2 * BLOCK, 1, "written before the pool filled");
    expect_bytes(&vol, 3 * BLOCK, 4096, 3, "written after growing");
    with_pool_still(&daemon, &pool, &["vol"], || thin_check(&pool.meta));
}

#[test]
fn pools_and_volumes_come_back_after_a_restart() {
    let mut daemon = Daemon::start("thin-restart");
    let pool = make_pool(&daemon, "pool", 64, "1 skip_block_zeroing");
    make_volume(&daemon, &pool, "vol", 1, 4 * MIB);
    fill(&daemon, "vol", 0x42, BLOCK, 2 * BLOCK);
    snapshot(&daemon, &pool, "vol", 2, 1);
    daemon.stop(libc::SIGTERM);
    thin_check(&pool.meta);
    daemon.launch();
    assert_eq!(
        daemon.udm(&["table", "pool"]),
        format!(
            "0 8192 thin-pool {} {} 128 4 1 skip_block_zeroing",
            pool.meta.display(),
            pool.data.display()
        )
    );
    expect_bytes(
        &contents(&daemon, "vol"),
        BLOCK,
        2 * BLOCK,
        0x42,
        "after restart",
    );
    open_volume(&daemon, &pool, "snap", 2, 4 * MIB);
    expect_bytes(
        &contents(&daemon, "snap"),
        BLOCK,
        2 * BLOCK,
        0x42,
        "the snapshot",
    );
    let ls = daemon.udm(&["thin", "ls", "pool"]);
    assert_eq!(ls.lines().count(), 3, "{ls}");
}

#[test]
fn attacks_on_the_pool_are_refused_and_leave_it_clean() {
    let daemon = Daemon::start("thin-attacks");
    let pool = make_pool(&daemon, "pool", 64, "");
    make_volume(&daemon, &pool, "vol", 1, 4 * MIB);
    fill(&daemon, "vol", 9, 0, BLOCK);
    // A second pool on the same metadata device, however it is named.
    let other_data = daemon.sparse("other.data", 64 * BLOCK);
    let other = format!(
        "0 {} thin-pool {} {} 128 0",
        64 * BLOCK / 512,
        pool.meta.display(),
        other_data.display()
    );
    let err = daemon.udm_err(&["create", "pool2", "--table", &other]);
    assert!(err.contains("pool.meta"), "{err}");
    // A thin line with an unknown id, or on something that is not a pool.
    let err = daemon.udm_err(&["create", "bad", "--table", "0 8 thin pool 77"]);
    assert!(err.contains("thin device 77 does not exist"), "{err}");
    daemon.create("z", "0 8 zero");
    let err = daemon.udm_err(&["create", "bad", "--table", "0 8 thin z 1"]);
    assert!(err.contains("'z' is not a thin-pool device"), "{err}");
    // Hostile messages: one-line errors, nothing changes.
    let before = status(&daemon, "pool");
    for words in [
        &["create_thin", "1"][..],
        &["create_thin", "16777216"],
        &["create_thin", "-1"],
        &["create_snap", "2", "9"],
        &["delete", "1"],
        &["delete", "99"],
        &["set_transaction_id", "3", "4"],
        &["release_metadata_snap"],
        &["create_thin"],
        &["frobnicate", "x"],
    ] {
        let mut args = vec!["message", "pool", "0"];
        args.extend_from_slice(words);
        daemon.udm_err(&args);
    }
    assert_eq!(status(&daemon, "pool"), before);
    // Reloading the pool on other devices, or with another block size, is refused; a
    // reload without suspend keeps the pool and the volume's data.
    let err = daemon.udm_err(&["load", "pool", "--table", &other]);
    assert!(err.contains("cannot replace"), "{err}");
    let same = daemon.udm(&["table", "pool"]);
    let err = daemon.udm_err(&["load", "pool", "--table", &same.replace(" 128 ", " 256 ")]);
    assert!(err.contains("block size"), "{err}");
    daemon.udm(&["load", "pool", "--table", &same]);
    daemon.udm(&["resume", "pool"]);
    daemon.udm(&["load", "vol", "--table", &daemon.udm(&["table", "vol"])]);
    daemon.udm(&["resume", "vol"]);
    expect_bytes(
        &contents(&daemon, "vol"),
        0,
        BLOCK,
        9,
        "after reloads without suspend",
    );
    // The pool cannot be removed under its volume.
    let err = daemon.udm_err(&["remove", "pool"]);
    assert!(err.contains("used by vol"), "{err}");
    daemon.udm(&["remove", "vol"]);
    daemon.udm(&["remove", "pool"]);
    thin_check(&pool.meta);
    // Damaged metadata is refused naming the file as the table does, not by its inode.
    flip_a_byte_in_blocks(&pool.meta, 1..20);
    let table = thin_pool_table(&pool.meta, &pool.data, 64 * BLOCK, "4 ");
    let err = daemon.udm_err(&["create", "pool", "--table", &table]);
    assert!(
        err.contains(&format!("metadata device '{}'", pool.meta.display()))
            && err.contains("checksum"),
        "{err}"
    );
}

/// Damages each 4 KiB block of `blocks` in the file at `path`: one byte inverted.
fn flip_a_byte_in_blocks(path: &Path, blocks: std::ops::Range<u64>) {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut byte = [0u8];
    for block in blocks {
        file.read_exact_at(&mut byte, block * 4096 + 100).unwrap();
        file.write_all_at(&[!byte[0]], block * 4096 + 100).unwrap();
    }
}

/// The pool status line's used and total metadata blocks.
fn metadata_usage(daemon: &Daemon, pool: &Pool) -> (u64, u64) {
    let line = status(daemon, &pool.name);
    let field = line.split(' ').nth(4).unwrap();
    let (used, total) = field.split_once('/').unwrap();
    (used.parse().unwrap(), total.parse().unwrap())
}

#[test]
fn a_pool_out_of_metadata_grows_onto_a_larger_metadata_device_by_reload() {
    let daemon = Daemon::start("thin-meta-grow");
    // 1 MiB of metadata: 256 blocks, filled below by thin devices of their own.
    let pool = Pool {
        name: "pool".into(),
        meta: daemon.sparse("pool.meta", MIB),
        data: daemon.sparse("pool.data", 256 * BLOCK),
    };
    let table = thin_pool_table(&pool.meta, &pool.data, 256 * BLOCK, "0");
    daemon.create("pool", &table);
    make_volume(&daemon, &pool, "vol", 1, 16 * MIB);
    fill(&daemon, "vol", 0x11, 0, 4 * BLOCK);
    assert_eq!(metadata_usage(&daemon, &pool).1, 256);
    let mut id = 2;
    loop {
        let out = daemon.run_udm(&["message", "pool", "0", "create_thin", &id.to_string()]);
        if !out.status.success() {
            break;
        }
        id += 1;
        assert!(id < 10_000, "the metadata never filled up");
    }
    let line = status(&daemon, "pool");
    assert!(line.contains(" ro "), "{line}");
    assert!(
        daemon.log().contains("the metadata device is full"),
        "{}",
        daemon.log()
    );
    // Out of metadata, a write that needs a block fails.
    let (ok, out) = qemu_io(
        &daemon.uri("vol"),
        &format!("write -P 2 {} 4096", 8 * BLOCK),
    );
    assert!(!ok && out.contains("failed"), "{out}");

    // A larger metadata device, by reloading the pool on it.
    resize(&pool.meta, 8 * MIB);
    daemon.reload("pool", &table);
    assert!(
        daemon
            .log()
            .contains("growing the metadata device from 256 to 2048 blocks"),
        "{}",
        daemon.log()
    );
    let line = status(&daemon, "pool");
    assert!(line.contains(" rw "), "{line}");
    let (used, total) = metadata_usage(&daemon, &pool);
    assert_eq!(total, 2048, "{line}");
    assert!(used < total / 2, "{line}");
    // Provisioning goes on: new blocks, new thin devices.
    fill(&daemon, "vol", 0x22, 8 * BLOCK, 8 * BLOCK);
    for more in id..id + 20 {
        daemon.udm(&["message", "pool", "0", "create_thin", &more.to_string()]);
    }
    let vol = contents(&daemon, "vol");
    expect_bytes(&vol, 0, 4 * BLOCK, 0x11, "written before");
    expect_bytes(&vol, 8 * BLOCK, 8 * BLOCK, 0x22, "written after growing");
    assert_eq!(data_used(&daemon, &pool), 12);
    with_pool_still(&daemon, &pool, &["vol"], || thin_check(&pool.meta));
    // Still there after the pool is closed and opened again.
    daemon.udm(&["remove", "vol"]);
    daemon.udm(&["remove", "pool"]);
    thin_check(&pool.meta);
    daemon.create("pool", &table);
    assert_eq!(metadata_usage(&daemon, &pool).1, 2048);
    // A smaller metadata device is refused: the pool's metadata may be anywhere on it.
    daemon.udm(&["suspend", "pool"]);
    resize(&pool.meta, 4 * MIB);
    let err = daemon.udm_err(&["load", "pool", "--table", &table]);
    assert!(err.contains("metadata device"), "{err}");
}
