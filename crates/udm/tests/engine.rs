//! The NBD data path's engines: io_uring event loops serve many connections on a few threads,
//! slow targets do not stall remapped I/O, and the threaded fallback serves the same bytes.

mod common;

use parking_lot::{Mutex, MutexGuard};
use std::io::{Read, Write};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

/// One test at a time: one of them turns io_uring off for the whole machine for a moment.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock()
}

/// A daemon serving NBD on io_uring event loops (`extra`: more options).
fn uring_daemon(tag: &str, extra: &[&str]) -> Daemon {
    let mut args = vec!["--nbd-engine", "uring"];
    args.extend_from_slice(extra);
    Daemon::start_with(tag, &args)
}

/// [`uring_daemon`] with `vol`, a linear device of `size` bytes on disk.img.
fn uring_daemon_with_vol(tag: &str, size: u64, extra: &[&str]) -> Daemon {
    let daemon = uring_daemon(tag, extra);
    daemon.create_linear("vol", "disk.img", size);
    daemon
}

/// Writes a block, pipelined with a read of another, on one raw connection.
fn exercise(client: &mut RawClient, id: u64, rounds: u64) {
    for round in 0..rounds {
        let block = id * 64 + round % 64;
        let data = vec![(id + round) as u8; 4096];
        client.send(0, NBD_CMD_WRITE, 1, block * 4096, 4096, &data);
        assert_eq!(client.reply().unwrap(), (0, 1));
        client.send(0, NBD_CMD_READ, 2, block * 4096, 4096, &[]);
        assert_eq!(client.reply().unwrap(), (0, 2));
        let mut back = vec![0u8; 4096];
        client.stream.read_exact(&mut back).unwrap();
        assert_eq!(back, data, "connection {id} round {round}");
    }
}

#[test]
fn sixty_four_connections_are_served_by_a_few_threads() {
    let _serial = serial();
    let daemon = uring_daemon_with_vol("engine-64", 64 << 20, &["--nbd-loops", "2"]);
    let (idle, _) = daemon.threads();
    let mut clients: Vec<RawClient> = (0..64)
        .map(|_| RawClient::connect(&daemon.nbd_socket(), "vol"))
        .collect();
    let most = std::thread::scope(|scope| {
        let workers: Vec<_> = clients
            .iter_mut()
            .enumerate()
            .map(|(id, client)| scope.spawn(move || exercise(client, id as u64, 50)))
            .collect();
        let mut most = (0, 0);
        while workers.iter().any(|w| !w.is_finished()) {
            let (ours, kernel) = daemon.threads();
            most = (most.0.max(ours), most.1.max(kernel));
            std::thread::sleep(Duration::from_millis(20));
        }
        for w in workers {
            w.join().unwrap();
        }
        most
    });
    // Linear over a file remaps: no pool thread is needed, and no thread per connection.
    assert!(
        most.0 <= idle + 2,
        "64 busy connections took {} threads (idle: {idle})",
        most.0
    );
    // io_uring's own workers are bounded per loop (4 + 4).
    assert!(most.1 <= 2 * 8, "{} io_uring workers", most.1);
}

/// A slow device's requests wait without stalling the loop, whether they run on the pool
/// (a `delay` over a device that does not remap sleeps on a pool thread) or wait on a timer as
/// a step of their mapping (a `delay` over a file remaps).
#[test]
fn a_slow_target_does_not_stall_remapped_io_on_the_same_loop() {
    let _serial = serial();
    // One loop: the slow device's connection and the fast one share it.
    let daemon = uring_daemon("engine-slow", &["--nbd-loops", "1"]);
    let disk = daemon.create_linear("fast", "disk.img", 8 << 20);
    daemon.udm(&[
        "create",
        "passthrough",
        "--table",
        &format!("0 16384 flakey {} 0 1000 0", disk.display()),
    ]);
    let slow_devices = [
        (
            "0 16384 delay passthrough 0 2000".to_string(),
            "through the targets (worker threads)",
        ),
        (
            format!("0 16384 delay {} 0 2000", disk.display()),
            "remapped onto files (io_uring)",
        ),
    ];
    for (table, data_path) in slow_devices {
        daemon.udm(&["create", "slow", "--table", &table]);
        // `udm info` says which devices the engine remaps and which take their requests.
        let info = daemon.udm(&["info", "slow"]);
        assert!(
            info.contains(&format!("Data path:         {data_path}")),
            "{info}"
        );
        let mut slow = RawClient::connect(&daemon.nbd_socket(), "slow");
        for cookie in 0..8 {
            slow.send(0, NBD_CMD_READ, cookie, cookie * 4096, 4096, &[]);
        }
        let mut fast = RawClient::connect(&daemon.nbd_socket(), "fast");
        let started = Instant::now();
        exercise(&mut fast, 0, 100);
        let took = started.elapsed();
        assert!(
            took < Duration::from_millis(1500),
            "{table}: 100 round trips on the fast device took {took:?} while the slow one's \
             reads waited"
        );
        for _ in 0..8 {
            let (error, _) = slow.reply().unwrap();
            assert_eq!(error, 0);
            let mut data = vec![0u8; 4096];
            slow.stream.read_exact(&mut data).unwrap();
        }
        drop(slow);
        daemon.udm(&["remove", "slow"]);
    }
}

/// `udm info` names what remapped I/O reaches: a `linear` over a remote export goes out
/// through the NBD client from the event loop, not onto files, which the line used to say for
/// both; a `zero` reaches neither, and the line claims no destination for it.
#[test]
fn info_names_what_remapped_io_reaches() {
    let _serial = serial();
    let daemon = uring_daemon_with_vol("engine-reaches", 8 << 20, &[]);
    let socket = daemon.dir.path("nbdkit.sock");
    let _peer = Peer::start(
        "nbdkit",
        &["-f", "-U", socket.to_str().unwrap(), "memory", "8M"],
        &socket,
    );
    let remote = format!("nbd+unix:///?socket={}", socket.display());
    daemon.create("remote", &format!("0 16384 linear {remote} 0"));
    daemon.create("nothing", "0 16384 zero");
    for (device, data_path) in [
        ("vol", "remapped onto files (io_uring)"),
        ("remote", "remapped onto remote exports (io_uring)"),
        ("nothing", "remapped (io_uring)"),
    ] {
        let info = daemon.udm(&["info", device]);
        let line = format!("Data path:         {data_path}");
        assert!(info.lines().any(|l| l == line), "{device}: {info}");
    }
}

#[test]
fn both_engines_serve_the_same_bytes_to_real_clients() {
    let _serial = serial();
    for engine in ["uring", "threads"] {
        let daemon = Daemon::start_with(&format!("engine-{engine}"), &["--nbd-engine", engine]);
        daemon.create_linear("vol", "disk.img", 32 << 20);
        let log = daemon.log();
        assert!(
            log.contains(&format!(
                "nbd: engine: {}",
                if engine == "uring" {
                    "io_uring"
                } else {
                    "threads"
                }
            )),
            "{log}"
        );
        let info = daemon.udm(&["info", "vol"]);
        let expected = if engine == "uring" {
            [
                "NBD engine:        io_uring (",
                "Data path:         remapped onto files (io_uring)",
            ]
        } else {
            [
                "NBD engine:        threads (",
                "Data path:         through the targets (worker threads)",
            ]
        };
        for line in expected {
            assert!(info.contains(line), "{engine}: {info}");
        }
        let source = daemon.dir.path("source.raw");
        pattern_file(&source, 32 << 20, 7);
        let uri = daemon.uri("vol");
        tool("nbdcopy", &[source.to_str().unwrap(), &uri]);
        let back = daemon.dir.path("back.raw");
        tool("nbdcopy", &[&uri, back.to_str().unwrap()]);
        same_content(source.to_str().unwrap(), back.to_str().unwrap());
        // Every request shape qemu-io sends, checked by qemu-io itself.
        let io = tool(
            "qemu-io",
            &[
                "--image-opts",
                &format!(
                    "driver=nbd,server.type=unix,server.path={},export=vol",
                    daemon.nbd_socket().display()
                ),
                "-c",
                "write -P 0x5a 1000448 70144",
                "-c",
                "write -z 2097152 65536",
                "-c",
                "discard 4194304 65536",
                "-c",
                "flush",
                "-c",
                "read -P 0x5a 1000448 70144",
                "-c",
                "read -P 0 2097152 65536",
            ],
        );
        assert!(
            !io.contains("Pattern verification failed"),
            "{engine}: {io}"
        );
    }
}

#[test]
fn a_client_that_stops_reading_replies_costs_no_thread_and_others_go_on() {
    let _serial = serial();
    let daemon = uring_daemon_with_vol("engine-stall", 64 << 20, &["--nbd-loops", "1"]);
    let (idle, _) = daemon.threads();
    // Asks for 64 MiB of reads and never reads a byte of the replies.
    let mut stalled = RawClient::connect(&daemon.nbd_socket(), "vol");
    for cookie in 0..64u64 {
        stalled.send(0, NBD_CMD_READ, cookie, cookie << 20, 1 << 20, &[]);
    }
    std::thread::sleep(Duration::from_millis(500));
    let mut other = RawClient::connect(&daemon.nbd_socket(), "vol");
    exercise(&mut other, 1, 20);
    assert!(daemon.threads().0 <= idle + 1);
}

/// Sets kernel.io_uring_disabled for as long as it lives.
struct IoUringDisabled(String);

impl IoUringDisabled {
    const KNOB: &'static str = "/proc/sys/kernel/io_uring_disabled";

    /// `None` where the knob cannot be written (a container with /proc/sys read-only).
    fn set() -> Option<IoUringDisabled> {
        let before = std::fs::read_to_string(Self::KNOB).ok()?;
        std::fs::write(Self::KNOB, "2").ok()?;
        Some(IoUringDisabled(before))
    }
}

impl Drop for IoUringDisabled {
    fn drop(&mut self) {
        std::fs::write(Self::KNOB, self.0.trim()).unwrap();
    }
}

#[test]
fn without_io_uring_the_daemon_says_why_and_serves_with_threads() {
    let _serial = serial();
    let Some(disabled) = IoUringDisabled::set() else {
        return eprintln!("SKIPPED: cannot write {}", IoUringDisabled::KNOB);
    };
    // `uring` asked for explicitly: refused, in one line that names the cause.
    let dir = TempDir::new("engine-none");
    let out = std::process::Command::new(UDM)
        .args([
            "--control",
            dir.path("ctl.sock").to_str().unwrap(),
            "daemon",
        ])
        .args(["--state-dir", dir.path("state").to_str().unwrap()])
        .args(["--nbd", &format!("unix:{}", dir.path("nbd.sock").display())])
        .args(["--nbd-engine", "uring"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("kernel.io_uring_disabled = 2"), "{err}");
    // auto: falls back, says so, and serves.
    let daemon = Daemon::start("engine-auto");
    drop(disabled);
    let log = daemon.log();
    assert!(
        log.contains("io_uring is disabled") && log.contains("serving with threads"),
        "{log}"
    );
    daemon.create_linear("vol", "disk.img", 8 << 20);
    // Nothing runs on io_uring, so nothing is remapped: `info` must not say it is.
    let info = daemon.udm(&["info", "vol"]);
    assert!(info.contains("NBD engine:        threads"), "{info}");
    assert!(
        info.contains(
            "Data path:         through the targets (worker threads): no export runs on io_uring"
        ),
        "{info}"
    );
    let mut client = RawClient::connect(&daemon.nbd_socket(), "vol");
    exercise(&mut client, 0, 10);
}

#[test]
fn requests_to_a_suspended_device_wait_without_taking_the_pool_from_others() {
    let _serial = serial();
    let daemon = uring_daemon("engine-suspend", &["--nbd-pool-threads", "2"]);
    daemon.create_linear("held", "held.img", 8 << 20);
    daemon.create_linear("other", "other.img", 8 << 20);
    daemon.udm(&["suspend", "held"]);
    let mut held = RawClient::connect(&daemon.nbd_socket(), "held");
    for cookie in 0..8 {
        held.send(0, NBD_CMD_READ, cookie, cookie * 4096, 4096, &[]);
    }
    std::thread::sleep(Duration::from_millis(300));
    // A discard is never remapped: it needs the pool, which the held reads must not occupy.
    const NBD_CMD_TRIM: u16 = 4;
    let mut other = RawClient::connect(&daemon.nbd_socket(), "other");
    other
        .stream
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    other.send(0, NBD_CMD_TRIM, 99, 0, 65536, &[]);
    assert_eq!(other.reply().unwrap(), (0, 99));
    exercise(&mut other, 0, 5);
    daemon.udm(&["resume", "held"]);
    for _ in 0..8 {
        assert_eq!(held.reply().unwrap().0, 0);
        let mut data = vec![0u8; 4096];
        held.stream.read_exact(&mut data).unwrap();
    }
}

#[test]
fn large_writes_arriving_in_pieces_or_cut_off_are_stored_whole_or_not_at_all() {
    let _serial = serial();
    let daemon = uring_daemon_with_vol("engine-trickle", 16 << 20, &[]);
    let mut rng = udm_testkit::Rng::new(10);
    let data: Vec<u8> = (0..1 << 20).map(|_| rng.next() as u8).collect();

    // A 1 MiB write whose payload trickles in (the loop receives it straight into the
    // request's buffer, a piece at a time), with a read of another range pipelined right
    // behind its last byte (the two may be answered in either order).
    let mut client = RawClient::connect(&daemon.nbd_socket(), "vol");
    let mut first = request_header(0, NBD_CMD_WRITE, 1, 1 << 20, 1 << 20);
    first.extend_from_slice(&data[..1000]);
    client.stream.write_all(&first).unwrap();
    for piece in data[1000..data.len() - 5000].chunks(100_000) {
        std::thread::sleep(Duration::from_millis(20));
        client.stream.write_all(piece).unwrap();
    }
    let mut last = data[data.len() - 5000..].to_vec();
    last.extend_from_slice(&request_header(0, NBD_CMD_READ, 2, 8 << 20, 4096));
    client.stream.write_all(&last).unwrap();
    let mut back = vec![0u8; 1 << 20];
    let mut cookies = Vec::new();
    for _ in 0..2 {
        let (error, cookie) = client.reply().unwrap();
        assert_eq!(error, 0, "request {cookie}");
        if cookie == 2 {
            client.stream.read_exact(&mut back[..4096]).unwrap();
        }
        cookies.push(cookie);
    }
    cookies.sort();
    assert_eq!(cookies, [1, 2]);
    client.send(0, NBD_CMD_READ, 3, 1 << 20, 1 << 20, &[]);
    assert_eq!(client.reply().unwrap(), (0, 3));
    client.stream.read_exact(&mut back).unwrap();
    assert!(back == data, "the trickled write did not read back");

    // Clients that vanish in the middle of a large payload: nothing of their write is
    // stored, and the daemon serves the next client.
    for cut in [100, 200_000, (1 << 20) - 1] {
        let mut gone = RawClient::connect(&daemon.nbd_socket(), "vol");
        let mut req = request_header(0, NBD_CMD_WRITE, 3, 4 << 20, 1 << 20);
        req.extend_from_slice(&vec![0xee; cut]);
        gone.stream.write_all(&req).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        drop(gone);
    }
    let mut after = RawClient::connect(&daemon.nbd_socket(), "vol");
    after.send(0, NBD_CMD_READ, 4, 4 << 20, 1 << 20, &[]);
    assert_eq!(after.reply().unwrap(), (0, 4));
    after.stream.read_exact(&mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0), "a cut-off write was stored");
    exercise(&mut after, 0, 10);
}

#[test]
fn pipelined_large_and_small_writes_are_stored_whole() {
    // Large payloads are received straight into their buffers, and after a large write the
    // loop asks for one header at a time: a burst mixing them with small writes (and sizes
    // that are no multiple of a page) must still land byte for byte where each says.
    let _serial = serial();
    let daemon = uring_daemon_with_vol("engine-large-writes", 64 << 20, &[]);
    let writes = pipelined_writes();
    let mut client = RawClient::connect(&daemon.nbd_socket(), "vol");
    // All sent before any reply is read: the replies (16 bytes each) fit the socket.
    for (cookie, (offset, data)) in writes.iter().enumerate() {
        client.send(
            0,
            NBD_CMD_WRITE,
            cookie as u64,
            *offset,
            data.len() as u32,
            data,
        );
    }
    let mut answered: Vec<u64> = (0..writes.len())
        .map(|_| {
            let (error, cookie) = client.reply().unwrap();
            assert_eq!(error, 0, "write {cookie}");
            cookie
        })
        .collect();
    answered.sort();
    assert_eq!(answered, (0..writes.len() as u64).collect::<Vec<_>>());
    for (cookie, (offset, data)) in writes.iter().enumerate() {
        client.send(
            0,
            NBD_CMD_READ,
            cookie as u64,
            *offset,
            data.len() as u32,
            &[],
        );
        assert_eq!(client.reply().unwrap(), (0, cookie as u64));
        let mut back = vec![0u8; data.len()];
        client.stream.read_exact(&mut back).unwrap();
        assert!(
            back == *data,
            "write {cookie} ({} bytes) did not read back",
            data.len()
        );
    }
    a_header_trickling_in_after_a_large_write_is_read_whole(&mut client);
}

/// Writes of 256 KiB down to 512 bytes (some no multiple of a page), four rounds, each a
/// few sectors apart so that offsets are not page-aligned: (offset, data).
fn pipelined_writes() -> Vec<(u64, Vec<u8>)> {
    let mut rng = udm_testkit::Rng::new(11);
    let sizes = [
        256 << 10,
        256 << 10,
        4096,
        256 << 10,
        20_992,
        16 << 10,
        (16 << 10) - 512,
        512,
        1 << 20,
        4096,
    ];
    let mut writes = Vec::new();
    let mut offset = 0u64;
    for round in 0..4 {
        for &len in &sizes {
            let data: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            writes.push((offset, data));
            // Apart by whole sectors, not pages, so offsets are not page-aligned.
            offset += len as u64 + 512 * (round + 1);
        }
    }
    writes
}

/// After a large write, the next request's header trickling in a byte at a time (the loop
/// asks for what is left of one header each time) is read whole.
fn a_header_trickling_in_after_a_large_write_is_read_whole(client: &mut RawClient) {
    let data = vec![0x5a; 256 << 10];
    client.send(0, NBD_CMD_WRITE, 100, 32 << 20, data.len() as u32, &data);
    assert_eq!(client.reply().unwrap(), (0, 100));
    let header = request_header(0, NBD_CMD_READ, 101, (32 << 20) + 4096, 4096);
    for byte in header {
        client.stream.write_all(&[byte]).unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(client.reply().unwrap(), (0, 101));
    let mut back = vec![0u8; 4096];
    client.stream.read_exact(&mut back).unwrap();
    assert_eq!(back, vec![0x5a; 4096]);
}

#[test]
fn discards_and_write_zeroes_on_linear_go_to_the_file_on_the_engine() {
    let _serial = serial();
    let daemon = uring_daemon_with_vol("engine-fill", 16 << 20, &[]);
    let uri = daemon.uri("vol");
    let io = |command: &str| {
        qemu_io_ok(&uri, &[command]);
    };
    io("write -P 0xaa 0 8M");
    io("discard 1M 1M");
    io("write -z -u 3M 1M"); // may unmap: punched
    io("write -z 5M 1M"); // no hole: zeroed in place
    for zero in ["1M", "3M", "5M"] {
        io(&format!("read -P 0 {zero} 1M"));
    }
    for kept in ["0", "2M", "4M", "6M"] {
        io(&format!("read -P 0xaa {kept} 1M"));
    }
    // None of it needed a pool thread: the event loop did it on io_uring.
    assert_eq!(daemon.pool_threads(), 0, "{}", daemon.log());
    // The punched ranges are holes in the file, which block status reports.
    let out = Command::new("nbdinfo")
        .args(["--map", &uri])
        .output()
        .unwrap();
    let map = String::from_utf8_lossy(&out.stdout);
    let holes: Vec<(u64, u64)> = map
        .lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            (f.get(2) == Some(&"3")).then(|| (f[0].parse().unwrap(), f[1].parse().unwrap()))
        })
        .collect();
    for start in [1u64 << 20, 3 << 20] {
        assert!(
            holes
                .iter()
                .any(|&(s, l)| s <= start && start + (1 << 20) <= s + l),
            "{start} is not a hole: {map}"
        );
    }
}

#[test]
fn a_discard_over_many_stripes_goes_the_synchronous_way_and_a_short_one_does_not() {
    let _serial = serial();
    let daemon = uring_daemon("engine-fill-striped", &[]);
    let (a, b) = (
        daemon.sparse("a.img", 32 << 20),
        daemon.sparse("b.img", 32 << 20),
    );
    // 4 KiB chunks: a 64 MiB device has 16,384 of them.
    let table = format!("0 131072 striped 2 8 {} 0 {} 0", a.display(), b.display());
    daemon.create("vol", &table);
    let uri = daemon.uri("vol");
    let io = |command: &str| {
        qemu_io_ok(&uri, &[command]);
    };
    io("write -P 0xaa 0 64M");
    io("discard 0 1M"); // 256 chunks: mapped
    assert_eq!(daemon.pool_threads(), 0, "a short discard needed the pool");
    io("discard 8M 48M"); // 12,288 chunks: synchronous
    assert!(daemon.pool_threads() > 0, "a long discard was mapped");
    io("read -P 0 0 1M");
    io("read -P 0xaa 1M 7M");
    io("read -P 0 8M 48M");
    io("read -P 0xaa 56M 8M");
}
