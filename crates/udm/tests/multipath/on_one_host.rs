//! One host: paths to a peer daemon's two listeners, to file paths and to local devices;
//! remote paths taking no pool thread, and suspends, removes and shutdowns that never wait.

use std::io::Read;
use std::process::Command;
use std::time::{Duration, Instant};

use super::*;

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
    let second = peer_path(&peer, "second.sock");
    a.udm(&["message", "mp", "0", "fail_path", &second]);
    for name in ["mp", "lin"] {
        write_and_read_back(&a, name);
    }
    assert_eq!(a.pool_threads(), 0, "{}", a.log());
}

/// The replies of every remote path, of every multipath, are read by one thread of the
/// daemon: a burst spread over two paths wakes it once, where a reader per path woke two
/// threads each for half of it (issue #13). Each path's client keeps a thread of its own, to
/// redial.
#[test]
fn one_thread_reads_the_replies_of_every_remote_path() {
    let (peer, a, _) = peer_and_multipath("mp-one-reader", "0");
    let paths = ["nbd.sock", "second.sock"].map(|s| format!("{} 1", peer_path(&peer, s)));
    let table = format!(
        "0 {} multipath 0 0 1 1 round-robin 0 2 1 {}",
        16 * MIB / 512,
        paths.join(" ")
    );
    a.udm(&["create", "mp2", "--table", &table]);
    for name in ["mp", "mp2"] {
        write_and_read_back(&a, name);
    }
    assert_eq!(a.threads_named("nbd-replies"), 1, "{}", a.log());
    assert_eq!(a.threads_named("nbd-client-vol"), 4, "{}", a.log());
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
    let second = peer_path(&peer, "second.sock");
    a.udm(&["message", "mp", "0", "fail_path", &second]);
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
    let suspend = udm_within_5s(&a, &["suspend", "mp"]);
    assert!(suspend, "udm suspend waited for a path");
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

/// fio on `uri`: 4 KiB random writes over `size` (fio's notation), each block read back and
/// checked; asserts that every one was done and verified without an error.
fn fio_verifies(uri: &str, size: &str, log: impl Fn() -> String) {
    let out = Command::new("fio")
        .args([
            "--name=mp",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            &format!("--size={size}"),
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
    let fuse_path = fuse_file.display().to_string();
    let fuse_state = || path_state(&a.udm(&["status", "mp"]), &fuse_path);
    let error = format!("0 {} error", 16 * MIB / 512);
    peer.udm(&["load", "p", "--table", &error]);
    peer.udm(&["resume", "p"]);
    fio_verifies(&a.uri("mp"), "8M", || a.log());
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
    fio_verifies(&a.uri("mp"), "8M", || a.log());
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
    let remove = udm_within_5s(&a, &["remove", "mp"]);
    a.udm(&["resume", "x"]);
    assert!(remove, "removing the multipath waited for x");
}

/// Runs `udm args` against `daemon` under a 5 s timeout: true when it succeeded in time.
fn udm_within_5s(daemon: &Daemon, args: &[&str]) -> bool {
    Command::new("timeout")
        .args(["5", UDM])
        .args(args)
        .env("UDM_CONTROL", daemon.control())
        .status()
        .unwrap()
        .success()
}

/// Four hundred writes queue while both paths are down (`queue_if_no_path`: more than the
/// event loop's queue depth and the pool's threads), and every one is done, in place, once
/// a path is back.
#[test]
fn four_hundred_requests_queued_with_no_path_all_complete_when_a_path_returns() {
    let (mut peer, a, _) =
        peer_and_multipath("mp-queued-400", "3 queue_if_no_path checker_interval 1");
    peer.stop(libc::SIGKILL);
    let block = |i: u64| [(i % 251) as u8 + 1; 4096];
    let mut client = RawClient::connect(&a.nbd_socket(), "mp");
    // The server stops reading once its queue is full: the writes go from a thread of their
    // own, which is done once the path is back.
    let sender = std::thread::spawn(move || {
        for i in 0..400u64 {
            client.send(0, NBD_CMD_WRITE, i, i * 8192, 4096, &block(i));
        }
        client
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while !a.udm(&["status", "mp"]).contains("multipath 2 1 ") {
        assert!(Instant::now() < deadline, "the writes do not queue");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(500));
    peer.launch();
    let mut client = sender.join().unwrap();
    let mut done = vec![false; 400];
    for _ in 0..400 {
        let (error, cookie) = client.reply().unwrap();
        assert_eq!(error, 0, "write {cookie}; log:\n{}", a.log());
        done[cookie as usize] = true;
    }
    assert!(done.iter().all(|&d| d));
    for i in (0..400u64).step_by(37) {
        client.send(0, NBD_CMD_READ, 1000 + i, i * 8192, 4096, &[]);
        assert_eq!(client.reply().unwrap(), (0, 1000 + i));
        let mut back = [0u8; 4096];
        client.stream.read_exact(&mut back).unwrap();
        assert!(back == block(i), "block {i} reads back wrong");
    }
}

/// A path's server that stops answering in the middle of a burst (SIGSTOP: its connections
/// stay up, nothing more is read or answered, the socket fills) is failed after
/// `path_timeout`, and its requests go down the other path: fio sees no error and verifies
/// every write. Two servers over one file, as two controllers reach one LUN.
#[test]
fn a_path_whose_server_stops_answering_mid_burst_is_failed_and_io_goes_on() {
    let b = Daemon::start("mp-stall-b");
    let disk = b.create_linear("vol", "disk.img", 16 * MIB);
    let c = Daemon::start("mp-stall-c");
    c.create("vol", &linear_table(&disk, 16 * MIB));
    let a = Daemon::start("mp-stall");
    let paths = [&b, &c].map(|d| format!("{} 1", peer_path(d, "nbd.sock")));
    let table = format!(
        "0 {} multipath 2 path_timeout 1 0 1 1 round-robin 0 2 1 {}",
        16 * MIB / 512,
        paths.join(" ")
    );
    a.create("mp", &table);
    let stalled = b.pid() as i32;
    let stopper = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        // SAFETY: signals a child of this test, resumed below.
        unsafe { libc::kill(stalled, libc::SIGSTOP) };
    });
    let started = Instant::now();
    fio_verifies(&a.uri("mp"), "16M", || a.log());
    stopper.join().unwrap();
    let status = a.udm(&["status", "mp"]);
    // SAFETY: as above.
    unsafe { libc::kill(stalled, libc::SIGCONT) };
    assert!(
        started.elapsed() > Duration::from_millis(200),
        "fio was done before the server stopped"
    );
    let stalled_path = format!("{} F 1", peer_path(&b, "nbd.sock"));
    assert!(status.contains(&stalled_path), "{status}\n{}", a.log());
}

/// multipathd's habit: a table reload under a noflush suspend while I/O waits for a path
/// (queue_if_no_path, every path failed). The queued write is pushed back, not failed: the
/// suspend returns at once, and the write goes down the new table's path when it is resumed,
/// as the kernel requeues it. (A plain suspend fails it, as above.) Both ways of reloading:
/// `suspend --noflush`, load, resume; and load, then `resume --noflush` (multipathd's).
#[test]
fn a_noflush_reload_hands_queued_io_to_the_new_table() {
    let a = Daemon::start("mp-noflush");
    let disk = a.create_linear("pa", "disk.img", 16 * MIB);
    let sectors = 16 * MIB / 512;
    for path in ["pb", "pc"] {
        a.create(path, &format!("0 {sectors} linear {} 0", disk.display()));
    }
    let table = |paths: &[&str]| {
        format!(
            "0 {sectors} multipath 3 queue_if_no_path checker_interval 600 0 1 1 round-robin 0 \
             {} 1 {}",
            paths.len(),
            paths
                .iter()
                .map(|p| format!("{p} 1"))
                .collect::<Vec<_>>()
                .join(" ")
        )
    };
    a.create("mp", &table(&["pa", "pb"]));
    let mut client = RawClient::connect(&a.nbd_socket(), "mp");
    let reloads: [(&[&str], &[&[&str]]); 2] = [
        (&["pa", "pb"], &[&["suspend", "--noflush", "mp"]]),
        (&["pc"], &[]),
    ];
    for (round, (failing, suspend)) in reloads.into_iter().enumerate() {
        let fill = round as u8 + 7;
        for path in failing {
            a.udm(&["message", "mp", "0", "fail_path", path]);
        }
        client.send(0, NBD_CMD_WRITE, 1, 0, 4096, &[fill; 4096]);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !a.udm(&["status", "mp"]).contains("multipath 2 1 ") {
            assert!(Instant::now() < deadline, "the write does not queue");
            std::thread::sleep(Duration::from_millis(20));
        }
        for verb in suspend {
            assert!(udm_within_5s(&a, verb));
        }
        client
            .stream
            .set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let early = client.reply();
        assert!(early.is_err(), "round {round}: answered early: {early:?}");
        client
            .stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let next = if round == 0 { ["pc"] } else { ["pa"] };
        a.udm(&["load", "mp", "--table", &table(&next)]);
        assert!(udm_within_5s(&a, &["resume", "--noflush", "mp"]));
        assert_eq!(client.reply().unwrap(), (0, 1), "{}", a.log());
        let mut written = vec![0; 4096];
        std::fs::File::open(&disk)
            .unwrap()
            .read_exact(&mut written)
            .unwrap();
        assert!(written.iter().all(|&b| b == fill), "round {round}");
    }
}

/// Paths to two exports of different volumes were accepted, and reads alternated between
/// the two. The load compares the paths' size and first 4 KiB and refuses them in one line
/// naming both; `no_path_identity_check` takes them as given.
#[test]
fn paths_to_two_different_exports_are_refused_naming_both() {
    let peer = Daemon::start("mp-identity-peer");
    let one = peer.dir.path("one.img");
    let two = peer.dir.path("two.img");
    pattern_file(&one, 16 * MIB as usize, 1);
    pattern_file(&two, 16 * MIB as usize, 2);
    for (name, file) in [("one", &one), ("two", &two)] {
        let table = format!("0 {} linear {} 0", 16 * MIB / 512, file.display());
        peer.udm(&["create", name, "--table", &table]);
    }
    let socket = peer.nbd_socket();
    let [one, two] = ["one", "two"].map(|n| format!("nbd+unix:///{n}?socket={}", socket.display()));
    let a = Daemon::start("mp-identity");
    let table = |features: &str| {
        format!(
            "0 {} multipath {features} 0 1 1 round-robin 0 2 1 {one} 1 {two} 1",
            16 * MIB / 512
        )
    };
    let refused = a.udm_err(&["create", "mp", "--table", &table("0")]);
    assert!(
        refused.contains(&format!(
            "path '{two}' leads to another device than path '{one}'"
        )),
        "{refused}"
    );
    assert_eq!(refused.trim().lines().count(), 1, "{refused}");
    a.udm(&[
        "create",
        "mp",
        "--table",
        &table("1 no_path_identity_check"),
    ]);
}
