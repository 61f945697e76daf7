//! End to end: the log-writes target records what a client did, and `udm replay-log` rebuilds
//! the device at chosen points.

mod common;

use common::*;

const MIB: u64 = 1 << 20;

#[test]
fn replay_rebuilds_the_device_at_marks_flushes_and_the_end() {
    let daemon = Daemon::start("log-writes");
    let dev = daemon.dir.path("dev.img");
    let log = daemon.dir.path("log.img");
    sparse_file(&dev, 8 * MIB);
    sparse_file(&log, 64 * MIB);
    daemon.udm(&[
        "create",
        "lw",
        "--table",
        &format!("0 16384 log-writes {} {}", dev.display(), log.display()),
    ]);
    let uri = daemon.uri("lw");
    tool(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-t",
            "writeback",
            "-c",
            "write -P 0x11 0 64k",
            "-c",
            "flush",
            "-c",
            "write -P 0x22 64k 64k",
            &uri,
        ],
    );
    daemon.udm(&["message", "lw", "0", "mark", "second-write"]);
    tool(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-t",
            "writeback",
            "-c",
            "write -P 0x33 0 4k",
            "-c",
            "write -z 1M 1M",
            "-c",
            "write -f -P 0x44 2M 8k",
            &uri,
        ],
    );
    let status = daemon.udm(&["status", "lw"]);
    assert!(status.starts_with("0 16384 log-writes "), "{status}");
    daemon.udm(&["remove", "lw"]);

    let replay = |args: &[&str]| -> std::process::Output {
        let target = daemon.dir.path("replay.img");
        sparse_file(&target, 8 * MIB);
        let mut all = vec![
            "replay-log",
            "--log",
            log.to_str().unwrap(),
            "--replay",
            target.to_str().unwrap(),
        ];
        all.extend_from_slice(args);
        daemon.run_udm(&all)
    };
    let replayed = || std::fs::read(daemon.dir.path("replay.img")).unwrap();

    // Up to the first flush: only the first write.
    assert!(replay(&["--stop-at", "flush"]).status.success());
    let data = replayed();
    assert!(
        data[..65536].iter().all(|&b| b == 0x11) && data[65536..131072].iter().all(|&b| b == 0)
    );
    // Up to the mark: both writes.
    assert!(replay(&["--end-mark", "second-write"]).status.success());
    assert!(replayed()[65536..131072].iter().all(|&b| b == 0x22));
    // A mark the log does not hold is an error, and nothing is replayed (not the whole log
    // in place of part of it).
    let out = replay(&["--end-mark", "secnod-write"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("the log has no mark 'secnod-write'"), "{err}");
    assert!(
        replayed().iter().all(|&b| b == 0),
        "replayed despite the error"
    );
    // Everything, checking at each FLUSH and FUA: the same bytes as the logged device.
    let out = replay(&["--check", "fua", "--fsck", "true", "--verbose"]);
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let points: u32 = stdout
        .rsplit("entries; ")
        .next()
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(points >= 2, "{stdout}");
    assert!(
        stdout.contains("Write+FUA offset 2097152 len 8192"),
        "{stdout}"
    );
    assert!(stdout.contains("mark 'second-write'"), "{stdout}");
    assert!(replayed() == std::fs::read(&dev).unwrap());
    // A failing check stops the replay and says where.
    let out = replay(&["--check", "flush", "--fsck", "false"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("check failed after entry 1 (Flush)"), "{err}");
}

#[test]
fn a_full_log_stops_logging_and_the_writes_go_on() {
    let daemon = Daemon::start("log-full");
    let dev = daemon.dir.path("dev.img");
    let log = daemon.dir.path("log.img");
    sparse_file(&dev, 8 * MIB);
    // 64 blocks: the superblock, then 17 per 64 KiB write and 1 per FLUSH.
    sparse_file(&log, 256 * 1024);
    daemon.udm(&[
        "create",
        "lw",
        "--table",
        &format!("0 16384 log-writes {} {}", dev.display(), log.display()),
    ]);
    // The fourth write does not fit: it and everything after go to the device unlogged.
    tool(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-t",
            "writeback",
            "-c",
            "write -P 0x11 0 64k",
            "-c",
            "flush",
            "-c",
            "write -P 0x22 64k 64k",
            "-c",
            "write -P 0x33 128k 64k",
            "-c",
            "write -P 0x44 192k 64k",
            "-c",
            "flush",
            "-c",
            "write -P 0x55 256k 4k",
            "-c",
            "read -P 0x44 192k 64k",
            &daemon.uri("lw"),
        ],
    );
    let status = daemon.udm(&["status", "lw"]);
    assert!(
        status.starts_with("0 16384 log-writes 4 ") && status.ends_with(" log full"),
        "{status}"
    );
    let warnings = daemon
        .log()
        .matches("ran out of space on the log device")
        .count();
    assert_eq!(warnings, 1, "{}", daemon.log());
    daemon.udm(&["remove", "lw"]);

    let target = daemon.dir.path("replay.img");
    sparse_file(&target, 8 * MIB);
    let out = daemon.run_udm(&[
        "replay-log",
        "--log",
        log.to_str().unwrap(),
        "--replay",
        target.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("replayed 4 entries")
            && stdout.contains("the log was cut off after 4 entries"),
        "{stdout}"
    );
    let replayed = std::fs::read(&target).unwrap();
    let logged = std::fs::read(&dev).unwrap();
    assert_eq!(replayed[..192 * 1024], logged[..192 * 1024]);
    assert!(replayed[192 * 1024..].iter().all(|&b| b == 0));
    assert!(logged[192 * 1024..256 * 1024].iter().all(|&b| b == 0x44));
}
