//! End to end: the clone target in a real daemon, with real clients, real filesystems and
//! real crashes.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;

const MIB: u64 = 1 << 20;

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
    let dest = daemon.dir.path("dest.img");
    let meta = daemon.dir.path("meta.img");
    sparse_file(&dest, size);
    sparse_file(&meta, 4 * MIB);
    daemon.udm(&[
        "create",
        "slow-source",
        "--table",
        &format!("0 {sectors} delay {} 0 1", source.display()),
    ]);
    daemon.udm(&[
        "create",
        "vol",
        "--table",
        &format!(
            "0 {sectors} clone {} {} slow-source {region_sectors} {extra}",
            meta.display(),
            dest.display()
        ),
    ]);
    size
}

#[test]
fn fio_stomps_the_clone_while_it_hydrates_and_everything_verifies() {
    let daemon = Daemon::start("clone-stomp");
    let source = daemon.dir.path("source.img");
    random_file(&source, 64 * MIB as usize, 21);
    clone_of(
        &daemon,
        &source,
        128,
        "0 4 hydration_threshold 64 hydration_batch_size 16",
    );
    let uri = format!("--uri={}", daemon.uri("vol"));
    let fio_args = |extra: &[&str]| {
        let mut args = vec![
            "--name=stomp",
            "--ioengine=nbd",
            &uri,
            "--rw=randwrite",
            "--bsrange=4k-128k",
            "--iodepth=16",
            "--offset=8M",
            "--size=16M",
            "--verify=crc32c",
            "--verify_state_save=0",
            "--verify_fatal=1",
            "--randseed=7",
        ];
        args.extend_from_slice(extra);
        tool("fio", &args)
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
        random_file(&path, (i as usize * 37_813) % 900_000 + 1, i + 1);
        files.push(path);
    }
    let source = daemon.dir.path("source.img");
    sparse_file(&source, 64 * MIB);
    tool(
        "mkfs.ext4",
        &[
            "-q",
            "-F",
            "-d",
            tree.to_str().unwrap(),
            source.to_str().unwrap(),
        ],
    );
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
    let daemon = Daemon::start("clone-discard");
    let source = daemon.dir.path("source.img");
    random_file(&source, 32 * MIB as usize, 5);
    clone_of(
        &daemon,
        &source,
        16,
        "1 no_hydration 4 hydration_threshold 128 hydration_batch_size 32",
    );
    // Tell the clone that the second half is unused, as fstrim would.
    tool(
        "qemu-io",
        &["-f", "raw", "-c", "discard 16M 16M", &daemon.uri("vol")],
    );
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
    let source = daemon.dir.path("source.img");
    sparse_file(&source, 32 * MIB);
    tool(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 0x61 4M 1M",
            source.to_str().unwrap(),
        ],
    );
    clone_of(&daemon, &source, 8, "1 no_hydration");
    let map = tool("nbdinfo", &["--map", &daemon.uri("vol")]);
    let rows: Vec<Vec<&str>> = map
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert!(
        rows.contains(&vec!["4194304", "1048576", "0", "data"]),
        "{map}"
    );
    assert!(
        rows.iter().filter(|r| r[3] == "hole,zero").count() >= 2,
        "{map}"
    );
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
    tool(
        "qemu-img",
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            source.to_str().unwrap(),
            &daemon.uri("vol"),
        ],
    );
}

#[test]
fn hydration_complete_raises_an_event_for_wait() {
    let daemon = Daemon::start("clone-event");
    let source = daemon.dir.path("source.img");
    random_file(&source, 4 * MIB as usize, 9);
    clone_of(
        &daemon,
        &source,
        8,
        "1 no_hydration 4 hydration_threshold 64 hydration_batch_size 64",
    );
    let before: u64 = daemon
        .udm(&["info", "vol", "--json"])
        .parse::<serde_json::Value>()
        .unwrap()["event_nr"]
        .as_u64()
        .unwrap();
    std::thread::scope(|s| {
        let waiter = s.spawn(|| daemon.udm(&["wait", "vol", &before.to_string()]));
        std::thread::sleep(Duration::from_millis(200));
        daemon.udm(&["message", "vol", "0", "enable_hydration"]);
        let after: u64 = waiter.join().unwrap().parse().unwrap();
        assert_eq!(after, before + 1);
    });
    assert_eq!(details(&daemon, "vol")["complete"], true);
}

/// A deterministic 4 KiB block for (block, version).
fn block_data(block: u64, version: u64) -> Vec<u8> {
    let mut data = vec![0u8; 4096];
    let mut x = (block << 32 | version) | 1;
    for chunk in data.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    data
}

fn read_all(client: &mut RawClient, size: u64) -> Vec<u8> {
    use std::io::Read;
    let mut out = vec![0u8; size as usize];
    let chunk = MIB;
    for (i, piece) in out.chunks_mut(chunk as usize).enumerate() {
        client.send(
            0,
            NBD_CMD_READ,
            i as u64,
            i as u64 * chunk,
            chunk as u32,
            &[],
        );
        assert_eq!(client.reply().unwrap(), (0, i as u64));
        client.stream.read_exact(piece).unwrap();
    }
    out
}

#[test]
fn kill_9_during_writes_and_hydration_loses_no_flushed_write() {
    let rounds: u64 = std::env::var("UDM_CRASH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12);
    let mut daemon = Daemon::start("clone-crash");
    let source = daemon.dir.path("source.img");
    let size = 16 * MIB;
    random_file(&source, size as usize, 77);
    let source_data = std::fs::read(&source).unwrap();
    let sectors = size / 512;
    sparse_file(&daemon.dir.path("dest.img"), size);
    sparse_file(&daemon.dir.path("meta.img"), MIB);
    // 8 KiB regions (4 KiB writes copy half a region first); hydration capped at 4 MiB/s so
    // crashes land in the middle of it.
    daemon.udm(&["create", "vol", "--table", &format!(
        "0 {sectors} clone {} {} {} 16 0 6 hydration_threshold 32 hydration_batch_size 4 max_hydration_rate 4096",
        daemon.dir.path("meta.img").display(), daemon.dir.path("dest.img").display(), source.display()
    )]);
    // For every block: the versions a read may return (0 = the source's data).
    let blocks = size / 4096;
    let mut allowed: HashMap<u64, Vec<u64>> = (0..blocks).map(|b| (b, vec![0])).collect();
    let mut version = 0u64;
    let mut seed = 0x1234_5678_9abc_def1u64;
    let mut random = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut flushed_writes = 0;
    for round in 0..rounds {
        let mut client = RawClient::connect(&daemon.nbd_socket(), "vol");
        let pid = daemon.pid();
        let kill_after = Duration::from_millis(30 + random() % 300);
        let killer = std::thread::spawn(move || {
            std::thread::sleep(kill_after);
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        });
        let start = Instant::now();
        let mut unflushed: Vec<(u64, u64)> = Vec::new();
        'workload: while start.elapsed() < Duration::from_secs(5) {
            for _ in 0..8 {
                let block = random() % blocks;
                version += 1;
                // A write may land even if its reply never comes.
                allowed.get_mut(&block).unwrap().push(version);
                let sent = client.try_send(
                    0,
                    NBD_CMD_WRITE,
                    version,
                    block * 4096,
                    4096,
                    &block_data(block, version),
                );
                match sent.and_then(|()| client.reply()) {
                    Ok((0, _)) => unflushed.push((block, version)),
                    _ => break 'workload,
                }
            }
            match client
                .try_send(0, NBD_CMD_FLUSH, 0, 0, 0, &[])
                .and_then(|()| client.reply())
            {
                Ok((0, _)) => {
                    // Durable now: older versions of these blocks can no longer appear.
                    for (block, v) in unflushed.drain(..) {
                        allowed.get_mut(&block).unwrap().retain(|&old| old >= v);
                        flushed_writes += 1;
                    }
                }
                _ => break 'workload,
            }
        }
        killer.join().unwrap();
        daemon.reap();
        daemon.launch();
        let mut client = RawClient::connect(&daemon.nbd_socket(), "vol");
        let data = read_all(&mut client, size);
        for block in 0..blocks {
            let got = &data[(block * 4096) as usize..((block + 1) * 4096) as usize];
            let matches = allowed[&block].iter().any(|&v| {
                if v == 0 {
                    got == &source_data[(block * 4096) as usize..((block + 1) * 4096) as usize]
                } else {
                    got == block_data(block, v).as_slice()
                }
            });
            assert!(
                matches,
                "round {round}: block {block} holds none of versions {:?}",
                allowed[&block]
            );
        }
        // What was read is now what must stay.
        for block in 0..blocks {
            let got = &data[(block * 4096) as usize..((block + 1) * 4096) as usize];
            let keep = allowed[&block].iter().copied().find(|&v| {
                if v == 0 {
                    got == &source_data[(block * 4096) as usize..((block + 1) * 4096) as usize]
                } else {
                    got == block_data(block, v).as_slice()
                }
            });
            allowed.insert(block, vec![keep.unwrap()]);
        }
    }
    assert!(flushed_writes > 0, "the workload never got a flush through");
    eprintln!("{rounds} crashes survived, {flushed_writes} flushed writes checked");
}

#[test]
fn a_remote_source_goes_away_and_comes_back_while_the_clone_hydrates() {
    let daemon = Daemon::start_with("clone-remote", &["--remote-timeout", "2"]);
    let source = daemon.dir.path("source.img");
    random_file(&source, 32 * MIB as usize, 44);
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
    let (dest, meta) = (daemon.dir.path("dest.img"), daemon.dir.path("meta.img"));
    sparse_file(&dest, 32 * MIB);
    sparse_file(&meta, MIB);
    daemon.udm(&["create", "vol", "--table", &format!(
        "0 65536 clone {} {} {remote} 128 1 no_hydration 4 hydration_threshold 64 hydration_batch_size 8",
        meta.display(), dest.display()
    )]);
    assert!(daemon.udm(&["ls", "--tree"]).contains(&remote));
    tool(
        "qemu-img",
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            source.to_str().unwrap(),
            &daemon.uri("vol"),
        ],
    );

    // The source goes away: a read that needs it fails with EIO after the timeout, and a
    // region already on the destination still reads.
    tool(
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0x5 0 64k", &daemon.uri("vol")],
    );
    drop(peer);
    let started = Instant::now();
    let out = std::process::Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read 16M 4k", &daemon.uri("vol")])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("Input/output error"), "{text}");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "took {:?}",
        started.elapsed()
    );
    tool(
        "qemu-io",
        &["-f", "raw", "-c", "read -P 0x5 0 64k", &daemon.uri("vol")],
    );

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
