//! End to end: the log-writes target records what a client did, and `udm replay-log` rebuilds
//! the device at chosen points.

mod common;

use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use common::*;

/// A daemon with `lw`, a log-writes device over an 8 MiB file, logging onto a file of
/// `log_size` bytes; returns the daemon and the two files' paths.
fn log_writes(tag: &str, log_size: u64) -> (Daemon, PathBuf, PathBuf) {
    let daemon = Daemon::start(tag);
    let dev = daemon.sparse("dev.img", 8 * MIB);
    let log = daemon.sparse("log.img", log_size);
    let table = format!("0 16384 log-writes {} {}", dev.display(), log.display());
    daemon.create("lw", &table);
    (daemon, dev, log)
}

/// qemu-io `commands` in one connection, with writeback caching (so a write is not FUA
/// unless it says `-f`).
fn write_back(uri: &str, commands: &[&str]) {
    qemu_io_ok_with(uri, &["-t", "writeback"], commands);
}

#[test]
fn replay_rebuilds_the_device_at_marks_flushes_and_the_end() {
    let (daemon, dev, log) = log_writes("log-writes", 64 * MIB);
    let uri = daemon.uri("lw");
    write_back(
        &uri,
        &["write -P 0x11 0 64k", "flush", "write -P 0x22 64k 64k"],
    );
    daemon.udm(&["message", "lw", "0", "mark", "second-write"]);
    write_back(
        &uri,
        &[
            "write -P 0x33 0 4k",
            "write -z 1M 1M",
            "write -f -P 0x44 2M 8k",
        ],
    );
    let status = daemon.udm(&["status", "lw"]);
    assert!(status.starts_with("0 16384 log-writes "), "{status}");
    daemon.udm(&["remove", "lw"]);

    let replay = |args: &[&str]| {
        let target = daemon.sparse("replay.img", 8 * MIB);
        daemon.replay_log(&log, &target, args)
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
    let points = replay_points(&stdout);
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
    // 64 blocks: the superblock, then 17 per 64 KiB write and 1 per FLUSH.
    let (daemon, dev, log) = log_writes("log-full", 256 * 1024);
    // The fourth write does not fit: it and everything after go to the device unlogged.
    write_back(
        &daemon.uri("lw"),
        &[
            "write -P 0x11 0 64k",
            "flush",
            "write -P 0x22 64k 64k",
            "write -P 0x33 128k 64k",
            "write -P 0x44 192k 64k",
            "flush",
            "write -P 0x55 256k 4k",
            "read -P 0x44 192k 64k",
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

    let target = daemon.sparse("replay.img", 8 * MIB);
    let out = daemon.replay_log(&log, &target, &[]);
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

#[test]
fn a_log_damaged_before_its_last_flush_is_refused_naming_the_entry() {
    let (daemon, _dev, log) = log_writes("log-damaged", 64 * MIB);
    write_back(
        &daemon.uri("lw"),
        &["write -P 0x11 0 4k", "write -P 0x22 4k 4k", "flush"],
    );
    daemon.udm(&["remove", "lw"]);
    // Entry 1's header is block 3: after the superblock and entry 0's header and data block.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&log)
        .unwrap();
    let mut byte = [0u8];
    file.read_at(&mut byte, 3 * 4096 + 40).unwrap();
    file.write_at(&[byte[0] ^ 0x5a], 3 * 4096 + 40).unwrap();
    // Before, the log read as one entry long and the replay "passed" with no check point.
    let target = daemon.sparse("replay.img", 8 * MIB);
    let out = daemon.replay_log(&log, &target, &["--check", "flush", "--fsck", "true"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("entry 1 has a bad header") && err.contains("the log is damaged"),
        "{err}"
    );
}

#[test]
fn the_log_goes_on_after_a_daemon_restart_and_a_new_table_starts_anew() {
    let (mut daemon, dev, log) = log_writes("log-restart", 64 * MIB);
    let replay_to_the_end = |daemon: &Daemon| {
        let target = daemon.sparse("replay.img", 8 * MIB);
        let out = daemon.replay_log(&log, &target, &["--verbose"]);
        assert!(out.status.success(), "{out:?}");
        (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            std::fs::read(&target).unwrap(),
        )
    };
    write_back(&daemon.uri("lw"), &["write -P 0x11 0 64k", "flush"]);
    // Before, the restored table started a new log: the first write vanished from it, and the
    // replay rebuilt a device that never was.
    for (signal, data) in [(libc::SIGKILL, "0x22"), (libc::SIGTERM, "0x33")] {
        daemon.stop(signal);
        daemon.launch();
        let offset = if signal == libc::SIGKILL {
            "64k"
        } else {
            "128k"
        };
        write_back(
            &daemon.uri("lw"),
            &[&format!("write -P {data} {offset} 64k"), "flush"],
        );
    }
    let (entries, replayed) = replay_to_the_end(&daemon);
    assert_eq!(entries.matches("Restart").count(), 2, "{entries}");
    assert!(entries.contains("udm restarted"), "{entries}");
    assert!(replayed == std::fs::read(&dev).unwrap(), "{entries}");
    // A table loaded by the user starts a new log when it goes live, as the kernel's does;
    // while it waits inactive, the live table's log is untouched.
    let table = daemon.udm(&["table", "lw"]);
    daemon.udm(&["load", "lw", "--table", &table]);
    write_back(&daemon.uri("lw"), &["write -P 0x44 0 4k", "flush"]);
    assert!(replay_to_the_end(&daemon)
        .0
        .contains("Write offset 0 len 4096"));
    daemon.udm(&["resume", "lw"]);
    write_back(&daemon.uri("lw"), &["write -P 0x55 4k 4k", "flush"]);
    let (entries, _) = replay_to_the_end(&daemon);
    assert!(
        !entries.contains("Restart") && entries.contains("Write offset 4096 len 4096"),
        "{entries}"
    );
}
