//! End to end: the clone target in a real daemon, with real clients, real filesystems and
//! real crashes.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;

fn wait_hydrated(daemon: &Daemon, name: &str) {
    let out = daemon.udm(&["wait", name, "--progress"]);
    assert!(out.ends_with("hydration complete"), "{out}");
}

fn details(daemon: &Daemon, name: &str) -> serde_json::Value {
    let json: serde_json::Value =
        serde_json::from_str(&daemon.udm(&["status", name, "--json"])).unwrap();
    json["targets"][0]["details"].clone()
}

/// A clone of `source` (through a 1 ms delay device) onto fresh destination and metadata files.
fn clone_of(daemon: &Daemon, source: &Path, region_sectors: u64, extra: &str) -> u64 {
    let size = std::fs::metadata(source).unwrap().len();
    let sectors = size / 512;
    let dest = daemon.sparse("dest.img", size);
    let meta = daemon.sparse("meta.img", 4 * MIB);
    let delay = format!("0 {sectors} delay {} 0 1", source.display());
    daemon.create("slow-source", &delay);
    let clone = format!(
        "0 {sectors} clone {} {} slow-source {region_sectors} {extra}",
        meta.display(),
        dest.display()
    );
    daemon.create("vol", &clone);
    size
}

/// A daemon with a clone (as [`clone_of`]) of a source file of `size` bytes of pattern
/// `seed`; returns the daemon and the source's path.
fn clone_of_pattern(
    tag: &str,
    size: u64,
    seed: u64,
    region_sectors: u64,
    extra: &str,
) -> (Daemon, PathBuf) {
    let daemon = Daemon::start(tag);
    let source = daemon.dir.path("source.img");
    pattern_file(&source, size as usize, seed);
    clone_of(&daemon, &source, region_sectors, extra);
    (daemon, source)
}

#[test]
fn fio_stomps_the_clone_while_it_hydrates_and_everything_verifies() {
    let (daemon, source) = clone_of_pattern(
        "clone-stomp",
        64 * MIB,
        21,
        128,
        "0 4 hydration_threshold 64 hydration_batch_size 16",
    );
    let fio_args = |extra: &[&str]| {
        let job = [
            "--name=stomp",
            "--rw=randwrite",
            "--bsrange=4k-128k",
            "--iodepth=16",
            "--offset=8M",
            "--size=16M",
            "--randseed=7",
        ];
        fio_verified(&daemon.uri("vol"), &[&job[..], extra].concat())
    };
    fio_args(&[]);
    wait_hydrated(&daemon, "vol");
    // After hydration the data fio wrote is still there (now read from the destination)…
    fio_args(&["--verify_only"]);
    // …and everything fio did not touch is the source.
    let copy = daemon.dir.path("copy.img");
    tool("nbdcopy", &[&daemon.uri("vol"), copy.to_str().unwrap()]);
    let (copy, source) = (
        std::fs::read(copy).unwrap(),
        std::fs::read(&source).unwrap(),
    );
    assert!(copy[..8 * MIB as usize] == source[..8 * MIB as usize]);
    assert!(copy[24 * MIB as usize..] == source[24 * MIB as usize..]);
    assert_eq!(details(&daemon, "vol")["complete"], true);
}

#[test]
fn an_ext4_source_reads_file_by_file_through_the_clone_before_and_after_hydration() {
    let daemon = Daemon::start("clone-ext4");
    let tree = daemon.dir.path("tree");
    std::fs::create_dir_all(tree.join("sub/deeper")).unwrap();
    let mut files = Vec::new();
    for i in 0..40u64 {
        let path = tree
            .join(match i % 3 {
                0 => "",
                1 => "sub",
                _ => "sub/deeper",
            })
            .join(format!("file{i}"));
        pattern_file(&path, (i as usize * 37_813) % 900_000 + 1, i + 1);
        files.push(path);
    }
    let source = daemon.dir.path("source.img");
    ext4_image_of(&tree, &source, 64 * MIB);
    clone_of(&daemon, &source, 8, "1 no_hydration");

    let check_through_clone = |label: &str| {
        let copy = daemon.dir.path(&format!("copy-{label}.img"));
        tool("nbdcopy", &[&daemon.uri("vol"), copy.to_str().unwrap()]);
        tool("e2fsck", &["-fn", copy.to_str().unwrap()]);
        let out = daemon.dir.path(&format!("out-{label}"));
        std::fs::create_dir_all(&out).unwrap();
        tool(
            "debugfs",
            &[
                "-R",
                &format!("rdump / {}", out.display()),
                copy.to_str().unwrap(),
            ],
        );
        for file in &files {
            let rel = file.strip_prefix(&tree).unwrap();
            assert!(
                std::fs::read(file).unwrap() == std::fs::read(out.join(rel)).unwrap(),
                "{label}: {rel:?}"
            );
        }
    };
    check_through_clone("unhydrated");
    daemon.udm(&["message", "vol", "0", "hydration_threshold", "256"]);
    daemon.udm(&["message", "vol", "0", "hydration_batch_size", "64"]);
    daemon.udm(&["message", "vol", "0", "enable_hydration"]);
    wait_hydrated(&daemon, "vol");
    check_through_clone("hydrated");
    // The finished clone becomes a plain linear device on the destination, live.
    assert_eq!(
        daemon.udm(&["finalize", "vol"]),
        format!(
            "0 131072 linear {} 0",
            daemon.dir.path("dest.img").display()
        )
    );
    assert!(std::fs::read(&source).unwrap() == std::fs::read(daemon.dir.path("dest.img")).unwrap());
}

#[test]
fn discarded_space_is_never_copied() {
    let (daemon, source) = clone_of_pattern(
        "clone-discard",
        32 * MIB,
        5,
        16,
        "1 no_hydration 4 hydration_threshold 128 hydration_batch_size 32",
    );
    // Tell the clone that the second half is unused, as fstrim would.
    qemu_io_ok(&daemon.uri("vol"), &["discard 16M 16M"]);
    let d = details(&daemon, "vol");
    assert_eq!(d["hydrated_bytes"], 16 * MIB, "{d}");
    daemon.udm(&["message", "vol", "0", "enable_hydration"]);
    wait_hydrated(&daemon, "vol");
    let dest = std::fs::read(daemon.dir.path("dest.img")).unwrap();
    let source = std::fs::read(&source).unwrap();
    assert!(dest[..16 * MIB as usize] == source[..16 * MIB as usize]);
    assert!(
        dest[16 * MIB as usize..].iter().all(|&b| b == 0),
        "discarded half was copied"
    );
}

#[test]
fn block_status_on_the_clone_lets_clients_skip_zeroes() {
    let daemon = Daemon::start("clone-map");
    let source = daemon.sparse("source.img", 32 * MIB);
    qemu_io_ok(source.to_str().unwrap(), &["write -P 0x61 4M 1M"]);
    clone_of(&daemon, &source, 8, "1 no_hydration");
    let map = nbd_map(&daemon.uri("vol"));
    assert!(map.contains(&extent(4 * MIB, MIB, "0", "data")), "{map:?}");
    let holes = map.iter().filter(|r| r[3] == "hole,zero").count();
    assert!(holes >= 2, "{map:?}");
    // Zero-aware hydration: the holes of the source stay holes on the destination.
    daemon.udm(&["message", "vol", "0", "hydration_threshold", "512"]);
    daemon.udm(&["message", "vol", "0", "hydration_batch_size", "128"]);
    daemon.udm(&["message", "vol", "0", "enable_hydration"]);
    wait_hydrated(&daemon, "vol");
    let allocated = tool("du", &["-k", daemon.dir.path("dest.img").to_str().unwrap()]);
    let kib: u64 = allocated
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        kib <= 2048,
        "destination allocated {kib} KiB for 1 MiB of data"
    );
    same_content(source.to_str().unwrap(), &daemon.uri("vol"));
}

#[test]
fn hydration_complete_raises_an_event_for_wait() {
    let (daemon, _) = clone_of_pattern(
        "clone-event",
        4 * MIB,
        9,
        8,
        "1 no_hydration 4 hydration_threshold 64 hydration_batch_size 64",
    );
    let before = daemon.event_nr("vol");
    std::thread::scope(|s| {
        let waiter = s.spawn(|| daemon.udm(&["wait", "vol", &before.to_string()]));
        std::thread::sleep(Duration::from_millis(200));
        daemon.udm(&["message", "vol", "0", "enable_hydration"]);
        let after: u64 = waiter.join().unwrap().parse().unwrap();
        assert_eq!(after, before + 1);
    });
    assert_eq!(details(&daemon, "vol")["complete"], true);
}

#[test]
fn a_remote_source_goes_away_and_comes_back_while_the_clone_hydrates() {
    let daemon = Daemon::start_with("clone-remote", &["--remote-timeout", "2"]);
    let source = daemon.dir.path("source.img");
    pattern_file(&source, 32 * MIB as usize, 44);
    let socket = daemon.dir.path("nbdkit.sock");
    let serve = || {
        Peer::start(
            "nbdkit",
            &[
                "-f",
                "-U",
                socket.to_str().unwrap(),
                "--filter=delay",
                "file",
                source.to_str().unwrap(),
                "rdelay=1ms",
            ],
            &socket,
        )
    };
    let peer = serve();
    let remote = format!("nbd+unix:///?socket={}", socket.display());
    let dest = daemon.sparse("dest.img", 32 * MIB);
    let meta = daemon.sparse("meta.img", MIB);
    daemon.create("vol", &format!(
        "0 65536 clone {} {} {remote} 128 1 no_hydration 4 hydration_threshold 64 hydration_batch_size 8",
        meta.display(), dest.display()
    ));
    assert!(daemon.udm(&["ls", "--tree"]).contains(&remote));
    same_content(source.to_str().unwrap(), &daemon.uri("vol"));

    // The source goes away: a read that needs it fails with EIO after the timeout, and a
    // region already on the destination still reads.
    qemu_io_ok(&daemon.uri("vol"), &["write -P 0x5 0 64k"]);
    drop(peer);
    let started = Instant::now();
    qemu_io_eio(&daemon.uri("vol"), "read 16M 4k");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "took {:?}",
        started.elapsed()
    );
    qemu_io_ok(&daemon.uri("vol"), &["read -P 0x5 0 64k"]);

    // Hydration starts while the source is away, and finishes once it is back.
    daemon.udm(&["message", "vol", "0", "enable_hydration"]);
    std::thread::sleep(Duration::from_millis(500));
    let _peer = serve();
    wait_hydrated(&daemon, "vol");
    let (got, want) = (
        std::fs::read(&dest).unwrap(),
        std::fs::read(&source).unwrap(),
    );
    assert!(got[..65536].iter().all(|&b| b == 5));
    assert!(got[65536..] == want[65536..]);
}

/// A paused hydration says so (in `status --json` and in the progress line) instead of
/// showing a rate and an ETA it does not have; starting, pausing, resuming and completing
/// are one log line each.
#[test]
fn a_paused_hydration_says_so_and_every_step_is_logged() {
    let (daemon, _) = clone_of_pattern("clone-paused", 8 * MIB, 5, 8, "1 no_hydration");
    let d = details(&daemon, "vol");
    assert_eq!(
        (&d["state"], &d["paused_by"]),
        (&"paused".into(), &"disable_hydration".into())
    );
    assert!(
        d["copy_rate_bytes_per_second"].is_null() && d["eta_seconds"].is_null(),
        "{d}"
    );

    // The progress line (not a terminal: one line per second) says paused and why.
    let mut wait = std::process::Command::new(UDM)
        .args(["wait", "vol", "--progress"])
        .env("UDM_CONTROL", daemon.control())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(wait.stdout.take().unwrap()),
        &mut first,
    )
    .unwrap();
    wait.kill().unwrap();
    wait.wait().unwrap();
    assert!(first.contains("  paused (disable_hydration)"), "{first}");
    assert!(!first.contains("ETA") && !first.contains("/s"), "{first}");

    daemon.udm(&["message", "vol", "0", "hydration_threshold", "64"]);
    daemon.udm(&["message", "vol", "0", "enable_hydration"]);
    wait_hydrated(&daemon, "vol");
    let log = daemon.log();
    for expected in [
        "clone 'vol': hydration paused (disable_hydration); 0 of 2048 regions on the destination",
        "clone 'vol': hydration resumed at 0 of 2048 regions",
        "clone 'vol': hydration complete: all 2048 regions on the destination",
    ] {
        assert_eq!(log.matches(expected).count(), 1, "{expected}\n{log}");
    }
    daemon.udm(&["finalize", "vol"]);
    let log = daemon.log();
    let finalized: Vec<&str> = log.lines().filter(|l| l.contains("finalized")).collect();
    assert_eq!(finalized.len(), 1, "{log}");
    assert!(
        finalized[0].contains("its table is now: 0 16384 linear /"),
        "{log}"
    );
}

#[test]
fn idle_clones_hold_no_copy_threads_and_hydrating_ones_what_their_settings_use() {
    let daemon = Daemon::start("clone-threads");
    let source = daemon.dir.path("source.img");
    pattern_file(&source, 8 * MIB as usize, 3);
    let (before, _) = daemon.threads();
    for i in 0..20 {
        let meta = daemon.sparse(&format!("meta{i}.img"), 4 * MIB);
        let dest = daemon.sparse(&format!("dest{i}.img"), 8 * MIB);
        let table = format!(
            "0 16384 clone {} {} {} 8 1 no_hydration",
            meta.display(),
            dest.display(),
            source.display()
        );
        daemon.create(&format!("c{i}"), &table);
    }
    // A committer each (and a few threads the daemon starts on first use). Before, 17 each:
    // 16 copy threads waking ten times a second whether or not there was anything to copy.
    let (idle, _) = daemon.threads();
    assert!(
        idle <= before + 2 * 20,
        "{before} threads before, {idle} with 20 idle clones"
    );
    assert_eq!(details(&daemon, "c0")["copy_threads"], 0);
    for message in [
        "max_hydration_rate 2048",
        "hydration_threshold 4",
        "enable_hydration",
    ] {
        let words: Vec<&str> = message.split(' ').collect();
        daemon.udm(&[&["message", "c0", "0"][..], &words].concat());
    }
    // Threshold 4 with batches of one region: four threads copy, for as long as there is
    // something to copy.
    assert_eq!(details(&daemon, "c0")["copy_threads"], 4);
    daemon.udm(&["message", "c0", "0", "max_hydration_rate", "0"]);
    wait_hydrated(&daemon, "c0");
    wait_for(
        || details(&daemon, "c0")["copy_threads"] == 0,
        "c0's copy threads to leave",
    );
    same_content(source.to_str().unwrap(), &daemon.uri("c0"));
}

/// udm's main job's last step followed by a reboot: a finalized clone comes back active with
/// its final table after a clean stop and after a kill -9, and serves reads at once. It came
/// back suspended (finalize recorded its own internal suspend) and every read hung.
#[test]
fn a_finalized_clone_comes_back_active_after_a_restart() {
    let (mut daemon, source) = clone_of_pattern("clone-finalized-restart", 4 * MIB, 9, 8, "");
    wait_hydrated(&daemon, "vol");
    daemon.udm(&["finalize", "vol"]);
    for signal in [libc::SIGTERM, libc::SIGKILL] {
        daemon.stop(signal);
        daemon.launch();
        let info: serde_json::Value =
            serde_json::from_str(&daemon.udm(&["info", "vol", "--json"])).unwrap();
        assert_eq!(info["state"], "ACTIVE", "after signal {signal}: {info}");
        assert!(daemon.udm(&["table", "vol"]).contains(" linear "));
        // A hung read would hold the test: qemu-img gets 30 s.
        let copy = daemon.dir.path("copy.img");
        let mut convert = std::process::Command::new("timeout")
            .args(["30", "qemu-img", "convert", "-f", "raw", "-O", "raw"])
            .arg(daemon.uri("vol"))
            .arg(&copy)
            .status()
            .unwrap();
        assert!(
            convert.success(),
            "reading the finalized clone after signal {signal}"
        );
        convert = std::process::Command::new("cmp")
            .arg(&copy)
            .arg(&source)
            .status()
            .unwrap();
        assert!(convert.success(), "content after signal {signal}");
    }
}

/// A clone whose newest metadata superblock is unusable opens from the older one and warns:
/// the warning came twice for one `create`, once from opening the metadata and again from
/// the table's first resume, which rereads it.
#[test]
fn a_metadata_fallback_is_logged_once_per_open() {
    let (daemon, _source) = clone_of_pattern("clone-fallback-once", 4 * MIB, 10, 8, "");
    wait_hydrated(&daemon, "vol");
    let table = daemon.udm(&["table", "vol"]);
    daemon.udm(&["remove", "vol"]);
    // Both superblock slots have been committed to by now; damage the first.
    let meta = daemon.dir.path("meta.img");
    let mut bytes = std::fs::read(&meta).unwrap();
    bytes[100..612].fill(0xff);
    std::fs::write(&meta, &bytes).unwrap();
    daemon.create("vol", &table);
    let log = daemon.log();
    let warnings = log.matches("clone metadata: ").count();
    assert_eq!(warnings, 1, "{log}");
}
