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
