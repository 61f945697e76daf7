//! End to end: clones whose source is a remote NBD export (a real nbdkit) that is down when
//! the daemon starts, shuts down cleanly, or dies for good.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;

/// nbdkit serving `image` on `socket`, each read taking `read_delay` (nbdkit's syntax) if set.
fn nbdkit(socket: &Path, image: &Path, read_delay: Option<&str>) -> Peer {
    let mut args = vec!["-f", "-U", socket.to_str().unwrap()];
    let delay = read_delay.map(|d| format!("rdelay={d}"));
    if delay.is_some() {
        args.push("--filter=delay");
    }
    args.extend_from_slice(&["file", image.to_str().unwrap()]);
    args.extend(delay.as_deref());
    Peer::start("nbdkit", &args, socket)
}

fn remote(socket: &Path) -> String {
    format!("nbd+unix:///?socket={}", socket.display())
}

/// `vol`: a clone of the remote onto fresh files in the daemon's directory.
fn create_clone(daemon: &Daemon, remote: &str, size: u64, options: &str) {
    let dest = daemon.sparse("dest.img", size);
    let meta = daemon.sparse("meta.img", MIB);
    daemon.create(
        "vol",
        &format!(
            "0 {} clone {} {} {remote} 128 {options}",
            size / 512,
            meta.display(),
            dest.display()
        ),
    );
}

fn wait_hydrated(daemon: &Daemon) {
    let out = daemon.udm(&["wait", "vol", "--progress"]);
    assert!(out.ends_with("hydration complete"), "{out}");
}

/// A daemon whose remote requests time out after `timeout` seconds, with a 16 MiB source
/// image of pattern `seed` and the socket path its nbdkit will serve it on.
fn with_source(tag: &str, timeout: &str, seed: u64) -> (Daemon, PathBuf, PathBuf) {
    let daemon = Daemon::start_with(tag, &["--remote-timeout", timeout]);
    let source = daemon.dir.path("source.img");
    let socket = daemon.dir.path("nbdkit.sock");
    pattern_file(&source, 16 * MIB as usize, seed);
    (daemon, source, socket)
}

#[test]
fn a_clone_whose_remote_is_down_at_restart_comes_back_and_hydrates_once_it_returns() {
    let (mut daemon, source, socket) = with_source("remote-restart", "2", 61);
    let peer = nbdkit(&socket, &source, None);
    create_clone(&daemon, &remote(&socket), 16 * MIB, "1 no_hydration");
    qemu_io_ok(&daemon.uri("vol"), &["write -P 0x5 0 64k"]);
    let mut expected = std::fs::read(&source).unwrap();
    expected[..65536].fill(5);
    std::fs::write(daemon.dir.path("expected.img"), &expected).unwrap();

    daemon.stop(libc::SIGTERM);
    drop(peer);
    daemon.launch();
    assert!(
        daemon.udm(&["ls"]).contains("vol"),
        "the clone was not restored; log:\n{}",
        daemon.log()
    );
    // What is on the destination reads; what needs the source fails after the timeout.
    qemu_io_ok(&daemon.uri("vol"), &["read -P 0x5 0 64k"]);
    let started = Instant::now();
    let (ok, out) = qemu_io(&daemon.uri("vol"), "read 8M 4k");
    assert!(!ok && out.contains("Input/output error"), "{out}");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(1500) && took < Duration::from_secs(10),
        "took {took:?}"
    );
    // A new table on the unreachable remote is refused, as dm refuses a missing device.
    let err = daemon.udm_err(&[
        "create",
        "other",
        "--table",
        &format!("0 8 linear {} 0", remote(&socket)),
    ]);
    assert!(err.contains("cannot connect to nbd server"), "{err}");

    // The remote comes back: reads work again and hydration finishes.
    let _peer = nbdkit(&socket, &source, None);
    qemu_io_ok(&daemon.uri("vol"), &["read 8M 4k"]);
    daemon.udm(&["message", "vol", "0", "enable_hydration"]);
    wait_hydrated(&daemon);
    same_content(
        daemon.dir.path("expected.img").to_str().unwrap(),
        &daemon.uri("vol"),
    );
    assert!(std::fs::read(daemon.dir.path("dest.img")).unwrap() == expected);
}

#[test]
fn a_remote_shutting_down_cleanly_is_let_go_and_io_resumes_on_its_successor() {
    let (daemon, source, socket) = with_source("remote-eshutdown", "20", 62);
    let mut data = std::fs::read(&source).unwrap();
    data[8 * MIB as usize..][..65536].fill(0x5a);
    std::fs::write(&source, &data).unwrap();
    // Reads take 3 s, so the user's read is in flight when nbdkit is told to stop; nbdkit then
    // answers it with ESHUTDOWN and exits only once its clients hang up.
    let mut first = nbdkit(&socket, &source, Some("3"));
    create_clone(&daemon, &remote(&socket), 16 * MIB, "1 no_hydration");

    std::thread::scope(|s| {
        let uri = daemon.uri("vol");
        let reader = s.spawn(move || qemu_io(&uri, "read -P 0x5a 8M 64k"));
        std::thread::sleep(Duration::from_millis(500));
        let stopped = Instant::now();
        unsafe { libc::kill(first.0.id() as i32, libc::SIGTERM) };
        while !matches!(first.0.try_wait(), Ok(Some(_))) {
            assert!(
                stopped.elapsed() < Duration::from_secs(5),
                "nbdkit does not exit: udm keeps its connection; log:\n{}",
                daemon.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(!reader.is_finished(), "the read failed instead of waiting");
        let _second = nbdkit(&socket, &source, None);
        let (ok, out) = reader.join().unwrap();
        assert!(ok, "{out}");
        assert!(stopped.elapsed() < Duration::from_secs(20));

        daemon.udm(&["message", "vol", "0", "enable_hydration"]);
        wait_hydrated(&daemon);
    });
    assert!(std::fs::read(daemon.dir.path("dest.img")).unwrap() == data);
}

#[test]
fn removing_a_clone_whose_remote_is_dead_does_not_wait_for_the_remote_timeout() {
    let (daemon, source, socket) = with_source("remote-remove", "30", 63);
    let peer = nbdkit(&socket, &source, None);
    // Slow hydration (1 MiB/s), so copies are under way when the remote dies.
    create_clone(
        &daemon,
        &remote(&socket),
        16 * MIB,
        "0 2 max_hydration_rate 1024",
    );
    std::thread::sleep(Duration::from_millis(500));
    drop(peer);
    // Long enough for the copy threads to be waiting for the dead remote.
    std::thread::sleep(Duration::from_secs(1));
    let started = Instant::now();
    daemon.udm(&["remove", "vol"]);
    let took = started.elapsed();
    eprintln!("remove with a dead remote took {took:?}");
    assert!(took < Duration::from_secs(5), "remove took {took:?}");
    assert!(!daemon.udm(&["ls"]).contains("vol"));
}

/// `remove --force` of a clone whose reader waited on a remote that stopped answering (an
/// nbdkit stopped with SIGSTOP) took the whole remote timeout (9 s of 10, both engines): the
/// swap to the error table drained the clients' requests, and the remote was closed only when
/// the table was dropped, after that drain. The table's remotes are now closed first.
#[test]
fn removing_a_clone_by_force_fails_a_read_waiting_on_a_stopped_remote_at_once() {
    for engine in ["uring", "threads"] {
        let daemon = Daemon::start_with(
            &format!("remote-force-{engine}"),
            &["--remote-timeout", "10", "--nbd-engine", engine],
        );
        let source = daemon.dir.path("source.img");
        let socket = daemon.dir.path("nbdkit.sock");
        pattern_file(&source, 16 * MIB as usize, 64);
        let peer = nbdkit(&socket, &source, None);
        create_clone(&daemon, &remote(&socket), 16 * MIB, "1 no_hydration");
        let pid = peer.0.id() as libc::pid_t;
        // SAFETY: signalling our own child.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        let script = format!("h.connect_uri({:?}); h.pread(65536, 0)", daemon.uri("vol"));
        let reader = std::thread::spawn(move || nbdsh(&script));
        wait_for(
            || {
                daemon
                    .udm(&["info", "vol"])
                    .contains("Open count:        1")
            },
            "the reader's connection",
        );
        // The read goes out as soon as qemu-io is connected; give it time to be waiting.
        std::thread::sleep(Duration::from_secs(1));
        assert!(
            !reader.is_finished(),
            "the read did not wait for the remote"
        );
        let started = Instant::now();
        daemon.udm(&["remove", "--force", "vol"]);
        let took = started.elapsed();
        let (ok, out) = reader.join().unwrap();
        let reader_took = started.elapsed();
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGCONT) };
        assert!(
            took < Duration::from_secs(3),
            "{engine}: remove --force took {took:?}"
        );
        assert!(
            reader_took < Duration::from_secs(3),
            "{engine}: the reader heard after {reader_took:?}"
        );
        assert!(!ok, "{engine}: the read succeeded: {out}");
    }
}

/// A table that reads the daemon's own NBD export is that device: reading itself held every
/// read until the remote timeout (found by hand), so the cycle check refuses it, through
/// other devices too. Reading another of its own devices over NBD stays allowed.
#[test]
fn a_table_reading_the_daemons_own_export_is_held_to_the_cycle_check() {
    let daemon = Daemon::start("own-export");
    let disk = daemon.sparse("disk.img", 4 * MIB);
    daemon.create("vol", &format!("0 8192 linear {} 0", disk.display()));
    let own = |name: &str| {
        format!(
            "nbd+unix:///{name}?socket={}",
            daemon.nbd_socket().display()
        )
    };
    let err = daemon.udm_err(&[
        "load",
        "vol",
        "--table",
        &format!("0 8192 linear {} 0", own("vol")),
    ]);
    assert!(
        err.contains("reads udm's own device 'vol'") && err.contains("depend on itself"),
        "{err}"
    );
    daemon.create("top", &format!("0 8192 linear {} 0", own("vol")));
    qemu_io_ok(&daemon.uri("top"), &["write -P 0x5e 0 64k", "flush"]);
    qemu_io_ok(&daemon.uri("vol"), &["read -P 0x5e 0 64k"]);
    let err = daemon.udm_err(&["load", "vol", "--table", "0 8192 linear top 0"]);
    assert!(err.contains("depend on itself"), "{err}");
    daemon.udm(&["remove", "top"]);
}

/// A server may describe runs of bytes, not sectors: nbdkit scripted to say (truthfully) that
/// the first byte of its export is a zero hole and the rest data. The clone used to stretch
/// the one-byte zero run to a whole sector and zeroed the destination's first sector, losing
/// bytes 1 to 511 of the source while marking the region hydrated (found by hand with
/// nbdkit's sh plugin).
#[test]
fn a_zero_run_shorter_than_a_sector_is_not_stretched_over_data() {
    let (daemon, source, socket) = with_source("remote-byte-extents", "5", 64);
    let mut data = std::fs::read(&source).unwrap();
    data[0] = 0;
    std::fs::write(&source, &data).unwrap();
    let size = data.len();
    let pread = format!(
        "pread=dd if={} skip=$4 count=$3 iflag=skip_bytes,count_bytes status=none",
        source.display()
    );
    let extents = format!("extents=echo 0 1 hole,zero; echo 1 {} 0", size - 1);
    let _peer = Peer::start(
        "nbdkit",
        &[
            "-f",
            "-U",
            socket.to_str().unwrap(),
            "eval",
            &format!("get_size=echo {size}"),
            &pread,
            "can_extents=exit 0",
            &extents,
        ],
        &socket,
    );
    create_clone(&daemon, &remote(&socket), size as u64, "");
    wait_hydrated(&daemon);
    let copied = std::fs::read(daemon.dir.path("dest.img")).unwrap();
    let wrong = copied.iter().zip(&data).filter(|(a, b)| a != b).count();
    assert_eq!(
        wrong, 0,
        "{wrong} bytes of the destination differ from the source"
    );
}

/// A source that comes back smaller fails for good; each of the 16 copy threads used to wait
/// out its own half-second backoff and try the next region, so the failing source was asked
/// 32 times a second and the log got as many warnings, for as long as the daemon ran (found
/// by hand, restarting nbdkit on a smaller image). The backoff is shared and grows now.
#[test]
fn a_source_that_fails_for_good_is_retried_with_a_growing_backoff() {
    let (daemon, source, socket) = with_source("remote-shrunk", "5", 65);
    let first = nbdkit(&socket, &source, Some("200ms"));
    create_clone(&daemon, &remote(&socket), 16 * MIB, "");
    std::thread::sleep(Duration::from_millis(500));
    drop(first);
    let smaller = daemon.dir.path("smaller.img");
    pattern_file(&smaller, 8 * MIB as usize, 66);
    let _second = nbdkit(&socket, &smaller, None);
    std::thread::sleep(Duration::from_secs(4));
    let log = daemon.log();
    assert!(log.contains("changed size"), "{log}");
    let retries = log.matches("will retry").count();
    assert!(retries <= 10, "{retries} copy retries in 4 s:\n{log}");
}

/// A remote that stops reading (its process hung; here stopped with SIGSTOP) held the NBD
/// event loop that started a write to it: the write's send waited for room in the socket,
/// up to the remote timeout, and so did every other device that loop served (found by
/// reading the client's send path). What the socket cannot take is now sent by a thread of
/// its own. One loop, so that the other device is on the loop the write starts on.
#[test]
fn a_remote_that_stops_reading_holds_up_no_other_device() {
    let daemon = Daemon::start_with(
        "remote-stops-reading",
        &["--remote-timeout", "10", "--nbd-loops", "1"],
    );
    let socket = daemon.dir.path("nbdkit.sock");
    let args = ["-f", "-U", socket.to_str().unwrap(), "memory", "64M"];
    let peer = Peer::start("nbdkit", &args, &socket);
    let table = format!("0 {} linear {} 0", 64 * MIB / 512, remote(&socket));
    daemon.create("stalled", &table);
    daemon.create_linear("other", "other.img", 16 * MIB);
    let pid = peer.0.id() as libc::pid_t;
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let stalled = daemon.uri("stalled");
    let writer = std::thread::spawn(move || qemu_io(&stalled, "write -P 0x11 0 8M"));
    // Reads of the other device for 3 s, while the write waits for the stopped remote.
    let started = Instant::now();
    let (mut reads, mut slowest) = (0, Duration::ZERO);
    while started.elapsed() < Duration::from_secs(3) {
        let read = Instant::now();
        qemu_io_ok(&daemon.uri("other"), &["read 0 64k"]);
        slowest = slowest.max(read.elapsed());
        reads += 1;
    }
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert!(
        slowest < Duration::from_secs(2),
        "a read of another device took {slowest:?} ({reads} reads)"
    );
    assert!(
        !writer.is_finished(),
        "the write did not wait for the remote"
    );
    let (ok, out) = writer.join().unwrap();
    assert!(ok, "{out}");
    qemu_io_ok(&daemon.uri("stalled"), &["read -P 0x11 0 8M"]);
}

/// The connections in nbdkit's log filter output that took a write after their last flush.
fn connections_with_unflushed_writes(log: &str) -> Vec<String> {
    let mut unflushed = std::collections::BTreeSet::new();
    for line in log.lines() {
        let Some((_, rest)) = line.split_once(" connection=") else {
            continue;
        };
        let mut words = rest.split_whitespace();
        let (Some(id), Some(request)) = (words.next(), words.next()) else {
            continue;
        };
        match request {
            "Write" | "Zero" | "Trim" => unflushed.insert(id.to_string()),
            "Flush" => unflushed.remove(id),
            _ => false,
        };
    }
    unflushed.into_iter().collect()
}

/// Two segments on one export are two connections to it; a server that does not advertise
/// multi-conn (qemu-nbd) makes a FLUSH durable only for its own connection's writes, so the
/// device's flush must go down both. Before, both had the URI as flush key and only the
/// first connection was flushed.
#[test]
fn a_flush_goes_down_every_connection_to_a_remote() {
    let daemon = Daemon::start("remote-flush");
    let image = daemon.sparse("remote.img", 8 * MIB);
    let socket = daemon.dir.path("nbdkit.sock");
    let log = daemon.dir.path("nbdkit.log");
    let logfile = format!("logfile={}", log.display());
    let args = ["-f", "-U", socket.to_str().unwrap(), "--filter=log"];
    let plugin = ["file", image.to_str().unwrap(), &logfile];
    let _peer = Peer::start("nbdkit", &[&args[..], &plugin[..]].concat(), &socket);
    let uri = remote(&socket);
    daemon.create(
        "vol",
        &format!("0 8192 linear {uri} 0\n8192 8192 linear {uri} 8192"),
    );
    qemu_io_ok_with(
        &daemon.uri("vol"),
        &["-t", "writeback"],
        &["write -P 1 0 4k", "write -P 2 4M 4k", "flush"],
    );
    // Before nbdkit goes: the stop would wait for it to time out.
    daemon.udm(&["remove", "vol"]);
    let log = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        connections_with_unflushed_writes(&log),
        Vec::<String>::new(),
        "acknowledged flushes never reached these connections:\n{log}"
    );
}
