//! End to end across hosts: a multipath on host A over the TCP exports of udm daemons on hosts
//! B and C, each host a network namespace of the test's own joined to A by a veth link. B and
//! C export one disk (a file all three see, as two controllers reach one LUN). fio on A
//! verifies every write while B's server is killed and restarted, while B's link is cut, and
//! while both are gone with queueing on; no_path_retry bounds the wait; a clone on A hydrates
//! from the multipath while B is killed. Skipped (with a SKIPPED line) where network
//! namespaces cannot be made.

mod common;

use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::*;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 64 * MIB;

/// One lab at a time: each runs three daemons and fio, on a machine of two cores.
static SERIAL: Mutex<()> = Mutex::new(());

/// Hosts A, B and C. Fields drop in order: the daemons before the namespaces they run in.
struct Lab {
    a: Daemon,
    /// B and C.
    servers: [Daemon; 2],
    disk: PathBuf,
    _scratch: TempDir,
    /// A, B, C.
    hosts: [Netns; 3],
}

/// A's interface towards B and C.
const LINKS: [&str; 2] = ["to-b", "to-c"];

fn server_address(i: usize) -> String {
    format!("10.77.{}.2", i + 1)
}

/// The export of B (0) or C (1), as A's table names it.
fn path_uri(i: usize) -> String {
    format!("nbd://{}:10809/vol", server_address(i))
}

impl Lab {
    /// The lab, or `None` (with a SKIPPED line) where namespaces cannot be made.
    fn new(tag: &str) -> Option<Lab> {
        let hosts = match ["a", "b", "c"].map(|h| Netns::new(&format!("{tag}-{h}"))) {
            [Ok(a), Ok(b), Ok(c)] => [a, b, c],
            [a, b, c] => {
                let why = [a.err(), b.err(), c.err()].into_iter().flatten().next();
                eprintln!("SKIPPED: {tag}: network namespaces cannot be created here: {why:?}");
                return None;
            }
        };
        for (i, link) in LINKS.iter().enumerate() {
            let net = i + 1;
            hosts[0]
                .link(
                    (link, &format!("10.77.{net}.1/24")),
                    &hosts[i + 1],
                    ("to-a", &format!("10.77.{net}.2/24")),
                )
                .unwrap();
        }
        let scratch = TempDir::new(&format!("mp-{tag}"));
        let disk = scratch.path("disk.img");
        pattern_file(&disk, SIZE as usize, 41);
        let servers = [0, 1].map(|i| {
            let listen = format!("tcp:{}:10809", server_address(i));
            let server =
                Daemon::start_in(&hosts[i + 1], &format!("mp-{tag}-{i}"), &["--nbd", &listen]);
            let table = format!("0 {} linear {} 0", SIZE / 512, disk.display());
            server.udm(&["create", "vol", "--table", &table]);
            server
        });
        let a = Daemon::start_in(&hosts[0], &format!("mp-{tag}-a"), &[]);
        Some(Lab {
            a,
            servers,
            disk,
            _scratch: scratch,
            hosts,
        })
    }

    /// `mp` on A: round-robin over B's and C's exports, with these features.
    fn multipath(&self, features: &[&str]) {
        let [b, c] = [0, 1].map(path_uri);
        self.multipath_with(features, &format!("1 1 round-robin 0 2 1 {b} 1 {c} 1"));
    }

    /// `mp` on A with these features and `groups` (`<#groups> <initial group> …`).
    fn multipath_with(&self, features: &[&str], groups: &str) {
        let table = format!(
            "0 {} multipath {} {} 0 {groups}",
            SIZE / 512,
            features.len(),
            features.join(" "),
        );
        self.a.udm(&["create", "mp", "--table", &table]);
    }

    fn status(&self) -> String {
        self.a.udm(&["status", "mp"])
    }

    /// Waits until A's status line of `mp` satisfies `ready`.
    fn wait_status(&self, what: &str, ready: impl Fn(&str) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let status = self.status();
            if ready(&status) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting until {what}: {status}\nA's log:\n{}",
                self.a.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill(&mut self, server: usize) {
        self.servers[server].stop(libc::SIGKILL);
    }

    fn restart(&mut self, server: usize) {
        self.servers[server].launch();
    }

    fn cut(&self, server: usize, cut: bool) {
        self.hosts[0].set_link(LINKS[server], !cut).unwrap();
    }

    /// fio on A: 4 KiB random writes over the first 32 MiB at 2000 IOPS (about 4 s), then
    /// every block read back and checked.
    fn fio(&self) -> Child {
        Command::new("fio")
            .args([
                "--name=mp",
                "--ioengine=nbd",
                &format!("--uri={}", self.a.uri("mp")),
                "--rw=randwrite",
                "--bs=4k",
                "--iodepth=16",
                "--size=32M",
                "--rate_iops=2000",
                "--verify=crc32c",
                "--verify_fatal=1",
                "--verify_state_save=0",
                "--output-format=json",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("fio")
    }
}

/// fio's outcome: every write done and verified, no error. Returns the longest write
/// completion latency, in ms.
fn fio_verified(fio: Child, lab: &Lab) -> f64 {
    let out = fio.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "fio failed: {stdout}{}\nA's log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        lab.a.log()
    );
    let json: serde_json::Value =
        serde_json::from_str(&stdout[stdout.find('{').unwrap()..]).unwrap();
    let job = &json["jobs"][0];
    assert_eq!(job["error"], 0, "{stdout}");
    assert_eq!(
        job["write"]["io_bytes"].as_u64().unwrap(),
        32 * MIB,
        "{stdout}"
    );
    // The verify pass read every block back.
    assert_eq!(
        job["read"]["io_bytes"].as_u64().unwrap(),
        32 * MIB,
        "{stdout}"
    );
    job["write"]["clat_ns"]["max"].as_f64().unwrap() / 1e6
}

/// The failed count and state of B's path in the status line.
fn path_state(status: &str, server: usize) -> String {
    let uri = path_uri(server);
    let words: Vec<&str> = status.split_whitespace().collect();
    let at = words.iter().position(|w| *w == uri).unwrap();
    format!("{} {}", words[at + 1], words[at + 2])
}

#[test]
fn fio_verifies_every_write_while_a_server_is_killed_and_restarted() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut lab) = Lab::new("kill") else {
        return;
    };
    lab.multipath(&["checker_interval", "1"]);
    let fio = lab.fio();
    std::thread::sleep(Duration::from_millis(1500));
    lab.kill(0);
    lab.wait_status("B's path fails", |s| path_state(s, 0) == "F 1");
    std::thread::sleep(Duration::from_millis(1000));
    lab.restart(0);
    lab.wait_status("the checker reinstates B's path", |s| {
        path_state(s, 0) == "A 1"
    });
    let gap = fio_verified(fio, &lab);
    eprintln!("longest write while B was killed: {gap:.1} ms");
    assert_eq!(path_state(&lab.status(), 1), "A 0");
    // Both paths served writes: B's writes reached the disk before it died.
    assert!(lab
        .a
        .log()
        .contains("failing path nbd://10.77.1.2:10809/vol"));
}

#[test]
fn fio_verifies_every_write_while_a_link_is_cut() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::new("cut") else {
        return;
    };
    lab.multipath(&["checker_interval", "1", "path_timeout", "2"]);
    let fio = lab.fio();
    std::thread::sleep(Duration::from_millis(1500));
    let cut = Instant::now();
    lab.cut(0, true);
    // No reset arrives: only the path timeout tells the path is gone.
    lab.wait_status("B's path fails", |s| path_state(s, 0) == "F 1");
    let noticed = cut.elapsed();
    assert!(
        noticed >= Duration::from_millis(1500) && noticed < Duration::from_secs(6),
        "B's path failed {noticed:?} after the cut"
    );
    std::thread::sleep(Duration::from_millis(500));
    lab.cut(0, false);
    lab.wait_status("the checker reinstates B's path", |s| {
        path_state(s, 0) == "A 1"
    });
    let gap = fio_verified(fio, &lab);
    eprintln!("B's path failed {noticed:?} after the cut; longest write {gap:.1} ms");
    assert!(gap < 4000.0, "a write waited {gap} ms");
}

#[test]
fn with_both_servers_gone_io_queues_and_resumes_when_one_returns() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut lab) = Lab::new("queue") else {
        return;
    };
    lab.multipath(&["queue_if_no_path", "checker_interval", "1"]);
    let mut fio = lab.fio();
    std::thread::sleep(Duration::from_millis(1000));
    lab.kill(0);
    lab.kill(1);
    lab.wait_status("requests wait for a path", |s| s.contains("multipath 2 1 "));
    std::thread::sleep(Duration::from_millis(2000));
    assert!(
        fio.try_wait().unwrap().is_none(),
        "fio ended while no path was there"
    );
    lab.restart(1);
    lab.wait_status("C's path is back", |s| path_state(s, 1).starts_with('A'));
    fio_verified(fio, &lab);
    assert!(lab.status().contains("multipath 2 0 "));
}

#[test]
fn with_both_servers_gone_no_path_retry_fails_io_after_its_bound() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut lab) = Lab::new("retry") else {
        return;
    };
    lab.multipath(&[
        "queue_if_no_path",
        "no_path_retry",
        "2",
        "checker_interval",
        "1",
    ]);
    let uri = lab.a.uri("mp");
    let (ok, out) = qemu_io(&uri, "read -P 0 0 4k");
    assert!(!ok, "the disk holds a pattern, not zeroes: {out}");
    lab.kill(0);
    lab.kill(1);
    let started = Instant::now();
    let (ok, out) = qemu_io(&uri, "read 1M 4k");
    let took = started.elapsed();
    assert!(!ok && out.contains("Input/output error"), "{out}");
    // Two checker intervals after the last path failed (the read failed both first).
    assert!(
        took >= Duration::from_millis(1800) && took < Duration::from_secs(6),
        "failed after {took:?}"
    );
    // Past the bound, requests fail at once until a path is back.
    let started = Instant::now();
    let (ok, _) = qemu_io(&uri, "read 2M 4k");
    assert!(!ok && started.elapsed() < Duration::from_millis(1500));
    lab.restart(0);
    lab.wait_status("B's path is back", |s| path_state(s, 0).starts_with('A'));
    let (ok, out) = qemu_io(&uri, "read 1M 4k");
    assert!(ok, "{out}");
}

#[test]
fn a_clone_hydrating_from_the_multipath_completes_when_a_server_is_killed() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut lab) = Lab::new("clone") else {
        return;
    };
    lab.multipath(&[]);
    let (meta, dest) = (lab.a.dir.path("meta.img"), lab.a.dir.path("dest.img"));
    sparse_file(&meta, MIB);
    sparse_file(&dest, SIZE);
    // 16 MiB/s: four seconds to copy, so B dies mid-way.
    let table = format!(
        "0 {} clone {} {} mp 128 0 2 max_hydration_rate 16384",
        SIZE / 512,
        meta.display(),
        dest.display()
    );
    lab.a.udm(&["create", "vol", "--table", &table]);
    std::thread::sleep(Duration::from_millis(1500));
    let progress = lab.a.udm(&["status", "vol", "--json"]);
    lab.kill(0);
    let out = lab.a.udm(&["wait", "vol", "--progress"]);
    assert!(out.ends_with("hydration complete"), "{out}");
    assert!(
        !progress.contains("\"complete\": true") && !progress.contains("\"complete\":true"),
        "hydration was over before B was killed: {progress}"
    );
    assert_eq!(path_state(&lab.status(), 0), "F 1");
    assert!(std::fs::read(&dest).unwrap() == std::fs::read(&lab.disk).unwrap());
}

#[test]
fn a_write_abandoned_on_a_cut_link_does_not_land_when_the_link_returns() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lab) = Lab::new("stale") else {
        return;
    };
    // B's group first, C's second: I/O goes to B while it answers.
    let [b, c] = [0, 1].map(path_uri);
    lab.multipath_with(
        &["checker_interval", "1", "path_timeout", "1"],
        &format!("2 1 round-robin 0 1 1 {b} 1 round-robin 0 1 1 {c} 1"),
    );
    let mut client = RawClient::connect(&lab.a.nbd_socket(), "mp");
    let write = |client: &mut RawClient, cookie: u64, byte: u8| {
        client.send(0, NBD_CMD_WRITE, cookie, 0, 4096, &[byte; 4096]);
        assert_eq!(client.reply().unwrap(), (0, cookie));
    };
    write(&mut client, 1, 0x11);
    lab.cut(0, true);
    // Stuck on B's path until its timeout, then done down C's.
    write(&mut client, 2, 0x22);
    assert_eq!(path_state(&lab.status(), 0), "F 1");
    write(&mut client, 3, 0x33);
    lab.cut(0, false);
    lab.wait_status("the checker reinstates B's path", |s| {
        path_state(s, 0) == "A 1"
    });
    // Long enough for TCP to retransmit whatever B's old connection still had to send.
    std::thread::sleep(Duration::from_secs(5));
    let mut block = vec![0u8; 4096];
    use std::os::unix::fs::FileExt;
    std::fs::File::open(&lab.disk)
        .unwrap()
        .read_exact_at(&mut block, 0)
        .unwrap();
    assert!(
        block.iter().all(|&b| b == 0x33),
        "block 0 holds {:#x}: a write abandoned on the cut link landed after the one that \
         replaced it",
        block[0]
    );
}

/// Two paths to one export of a peer daemon on this host (its two Unix listeners): no
/// namespaces needed to kill both at once.
fn peer_and_multipath(tag: &str, features: &str) -> (Daemon, Daemon, String) {
    let peer = Daemon::start_with(&format!("{tag}-peer"), &["--nbd", "unix:{dir}/second.sock"]);
    peer.create_linear("vol", "disk.img", 16 * MIB);
    let paths = ["nbd.sock", "second.sock"].map(|s| format!("{} 1", peer_path(&peer, s)));
    let a = Daemon::start(tag);
    let table = format!(
        "0 {} multipath {features} 0 1 1 round-robin 0 2 1 {}",
        16 * MIB / 512,
        paths.join(" ")
    );
    a.udm(&["create", "mp", "--table", &table]);
    (peer, a, table)
}

/// Requests down remote paths are transfers: the event loop sends them and the NBD client's
/// reader completes them, with no pool thread per request (the pool starts its threads on
/// demand, so a daemon that served nothing else has none). `linear` over one remote export
/// goes the same way, flushes included; so does a multipath's flush while one path is usable.
#[test]
fn reads_writes_and_flushes_down_remote_paths_take_no_pool_thread() {
    let (peer, a, _) = peer_and_multipath("mp-nopool", "0");
    let export = peer_path(&peer, "nbd.sock");
    a.udm(&[
        "create",
        "lin",
        "--table",
        &format!("0 {} linear {export} 0", 16 * MIB / 512),
    ]);
    a.udm(&[
        "message",
        "mp",
        "0",
        "fail_path",
        &peer_path(&peer, "second.sock"),
    ]);
    for name in ["mp", "lin"] {
        write_and_read_back(&a, name);
    }
    assert_eq!(a.pool_threads(), 0, "{}", a.log());
}

/// A multipath made while its remote paths were down (a restart) remaps once they are back:
/// no pool thread either.
#[test]
fn a_multipath_restored_with_its_paths_down_takes_no_pool_thread_once_they_are_back() {
    let (mut peer, mut a, _) = peer_and_multipath("mp-nopool-restart", "2 checker_interval 1");
    a.stop(libc::SIGTERM);
    peer.stop(libc::SIGKILL);
    a.launch();
    peer.launch();
    // Both clients have connected (they were made disconnected), and both paths are active.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let status = a.udm(&["status", "mp"]);
        if status.matches(" A ").count() == 2 && a.log().matches("attempt(s)").count() == 2 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the paths are not back: {status}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // One path, so that the flush maps too (over two it goes to the pool, one down each).
    a.udm(&[
        "message",
        "mp",
        "0",
        "fail_path",
        &peer_path(&peer, "second.sock"),
    ]);
    write_and_read_back(&a, "mp");
    assert_eq!(a.pool_threads(), 0, "{}", a.log());
}

/// 64 writes of 4 KiB in flight at once and a flush on `name` of `daemon`, then each block
/// read back and checked.
fn write_and_read_back(daemon: &Daemon, name: &str) {
    {
        let mut client = RawClient::connect(&daemon.nbd_socket(), name);
        let block = |i: u64| vec![i as u8 + 1; 4096];
        for i in 0..64 {
            client.send(0, NBD_CMD_WRITE, i, i * 8192, 4096, &block(i));
        }
        client.send(0, NBD_CMD_FLUSH, 64, 0, 0, &[]);
        let mut cookies: Vec<u64> = (0..65)
            .map(|_| client.reply().unwrap())
            .map(|(error, cookie)| {
                assert_eq!(error, 0, "{name}: request {cookie} failed");
                cookie
            })
            .collect();
        cookies.sort();
        assert_eq!(cookies, (0..65).collect::<Vec<_>>());
        for i in 0..64 {
            client.send(0, NBD_CMD_READ, i, i * 8192, 4096, &[]);
            assert_eq!(client.reply().unwrap(), (0, i));
            let mut back = vec![0u8; 4096];
            client.stream.read_exact(&mut back).unwrap();
            assert!(back == block(i), "{name}: block {i} reads back wrong");
        }
    }
}

/// The path argument naming `socket` of the peer in [`peer_and_multipath`].
fn peer_path(peer: &Daemon, socket: &str) -> String {
    format!("nbd+unix:///vol?socket={}", peer.dir.path(socket).display())
}

#[test]
fn a_suspend_a_remove_and_a_shutdown_never_wait_for_a_path() {
    let (mut peer, mut a, table) = peer_and_multipath("mp-stop", "1 queue_if_no_path");
    // The table and the queueing setting come back after a restart.
    a.udm(&["message", "mp", "0", "fail_if_no_path"]);
    a.stop(libc::SIGTERM);
    a.launch();
    let without = table.replace("multipath 1 queue_if_no_path", "multipath 0");
    assert_eq!(a.udm(&["table", "mp"]), without);
    a.udm(&["message", "mp", "0", "queue_if_no_path"]);
    assert_eq!(a.udm(&["table", "mp"]), table);

    // A write not flushed yet, then the server dies: a read waits for a path. (A raw client:
    // qemu-io would flush on its way out, and that flush would wait for a path too.)
    let mut client = RawClient::connect(&a.nbd_socket(), "mp");
    client.send(0, NBD_CMD_WRITE, 1, 0, 4096, &[7; 4096]);
    assert_eq!(client.reply().unwrap(), (0, 1));
    peer.stop(libc::SIGKILL);
    client.send(0, NBD_CMD_READ, 2, 0, 4096, &[]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !a.udm(&["status", "mp"]).contains("multipath 2 1 ") {
        assert!(Instant::now() < deadline, "the read does not queue");
        std::thread::sleep(Duration::from_millis(20));
    }
    // A suspend fails it rather than wait for a path that may never come.
    let suspend = Command::new("timeout")
        .args(["5", UDM, "suspend", "mp"])
        .env("UDM_CONTROL", a.control())
        .status()
        .unwrap();
    assert!(suspend.success(), "udm suspend waited for a path");
    assert_eq!(client.reply().unwrap(), (libc::EIO as u32, 2));
    a.udm(&["resume", "mp"]);

    // The daemon stops, though the flush it owes the dead paths has nowhere to go.
    let started = Instant::now();
    a.stop(libc::SIGTERM);
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(a.log().contains("flushing 'mp' at shutdown"), "{}", a.log());
    // Back with its paths still down (their sizes were recorded), and removed at once.
    a.launch();
    assert_eq!(a.udm(&["table", "mp"]), table);
    let started = Instant::now();
    a.udm(&["remove", "mp"]);
    assert!(started.elapsed() < Duration::from_secs(5));
    peer.launch();
}

/// fio on `uri`: 4 KiB random writes over 8 MiB, each block read back and checked; asserts
/// that every one was done and verified without an error.
fn fio_verifies(uri: &str, log: impl Fn() -> String) {
    let out = Command::new("fio")
        .args([
            "--name=mp",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--size=8M",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--verify_state_save=0",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("err= 0"),
        "fio failed: {stdout}{}\nlog:\n{}",
        String::from_utf8_lossy(&out.stderr),
        log()
    );
}

/// Requests remapped onto a file path (io_uring) that starts failing fail that path and go
/// down the other one, as requests through the targets do; the checker then probes the path
/// (still failing, it stays failed) and reinstates it once it answers. The failing file is
/// a peer daemon's FUSE export of a device that turns into an `error` device; the other
/// path is the disk file under it.
#[test]
fn remapped_requests_that_fail_on_a_file_path_go_down_another_path() {
    let peer = Daemon::start_with("mp-filepath-peer", &["--fuse", "{dir}/fuse"]);
    let disk = peer.create_linear("p", "disk.img", 16 * MIB);
    let fuse_file = peer.dir.path("fuse").join("p");
    let a = Daemon::start_with(
        "mp-filepath",
        &[
            "--nbd-engine",
            "uring",
            "--fuse",
            "{dir}/fuse",
            "--fuse-uring",
            "on",
        ],
    );
    let table = format!(
        "0 {} multipath 2 checker_interval 1 0 1 1 round-robin 0 2 1 {} 1 {} 1",
        16 * MIB / 512,
        fuse_file.display(),
        disk.display()
    );
    a.udm(&["create", "mp", "--table", &table]);
    let info = a.udm(&["info", "mp"]);
    assert!(info.contains("Data path:         remapped"), "{info}");
    let fuse_state = || {
        let status = a.udm(&["status", "mp"]);
        let words: Vec<String> = status.split_whitespace().map(String::from).collect();
        let at = words
            .iter()
            .position(|w| *w == fuse_file.display().to_string())
            .unwrap();
        format!("{} {}", words[at + 1], words[at + 2])
    };
    let error = format!("0 {} error", 16 * MIB / 512);
    peer.udm(&["load", "p", "--table", &error]);
    peer.udm(&["resume", "p"]);
    fio_verifies(&a.uri("mp"), || a.log());
    assert_eq!(fuse_state(), "F 1", "{}", a.log());
    // Probed every second, the path stays failed while it fails...
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(fuse_state(), "F 1");
    // ...and comes back when it answers.
    let linear = format!("0 {} linear {} 0", 16 * MIB / 512, disk.display());
    peer.udm(&["load", "p", "--table", &linear]);
    peer.udm(&["resume", "p"]);
    wait_for(
        || fuse_state() == "A 1",
        "the checker to reinstate the path",
    );
    fio_verifies(&a.uri("mp"), || a.log());
    // The same through A's own FUSE export (its io_uring queues remap too).
    peer.udm(&["load", "p", "--table", &error]);
    peer.udm(&["resume", "p"]);
    let copy = a.dir.path("copy.img");
    tool(
        "dd",
        &[
            &format!("if={}", a.dir.path("fuse").join("mp").display()),
            &format!("of={}", copy.display()),
            "bs=64k",
            "iflag=direct",
        ],
    );
    assert_eq!(fuse_state(), "F 2", "{}", a.log());
    assert!(std::fs::read(&copy).unwrap() == std::fs::read(&disk).unwrap());
}

/// A path that is a suspended udm device is not probed (the probe would wait for the resume,
/// and the table's removal for the probe): removing the multipath does not wait for it.
#[test]
fn a_multipath_over_a_suspended_device_is_removed_without_waiting_for_it() {
    let a = Daemon::start("mp-suspended-path");
    let disk = a.create_linear("x", "disk.img", 16 * MIB);
    let table = format!(
        "0 {} multipath 2 checker_interval 1 0 1 1 round-robin 0 2 1 x 1 {} 1",
        16 * MIB / 512,
        disk.display()
    );
    a.udm(&["create", "mp", "--table", &table]);
    a.udm(&["suspend", "x"]);
    // The checker's round comes while x is suspended.
    std::thread::sleep(Duration::from_millis(1500));
    let remove = Command::new("timeout")
        .args(["5", UDM, "remove", "mp"])
        .env("UDM_CONTROL", a.control())
        .status()
        .unwrap();
    a.udm(&["resume", "x"]);
    assert!(remove.success(), "removing the multipath waited for x");
}
