//! The NBD client against real servers: nbdkit, qemu-nbd and udm's own, over Unix sockets in
//! a temporary directory. Every server process is killed when its guard is dropped.

use parking_lot::Mutex;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use udm_block::{
    AlignedBuf, BlockDevice, Extent, MemoryDevice, WriteFlags, ZeroFlags, EXTENT_HOLE, EXTENT_ZERO,
};
use udm_nbd::protocol::*;
use udm_nbd::{ClientError, ClientOptions, NbdClient, NbdServer, ServerConfig};
use udm_testkit::{conformance, pattern, Devices, Rng, TempDir};

const MIB: u64 = 1 << 20;

/// The client's log lines (connection up, down, back) go to the test's captured output, so a
/// failing test shows what the connection went through.
struct TestLog;

impl log::Log for TestLog {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }
    fn log(&self, record: &log::Record) {
        eprintln!("{} {}", record.level(), record.args());
    }
    fn flush(&self) {}
}

/// A scratch directory for one test; every test starts here, so this is also where the log
/// is set up.
fn scratch(tag: &str) -> TempDir {
    if log::set_logger(&TestLog).is_ok() {
        log::set_max_level(log::LevelFilter::Debug);
    }
    TempDir::new(&format!("nbd-client-{tag}"))
}

/// The socket servers listen on in `dir`.
fn socket(dir: &TempDir) -> PathBuf {
    dir.path("nbd.sock")
}

fn uri(dir: &TempDir) -> String {
    uri_for(dir, "")
}

fn uri_for(dir: &TempDir, export: &str) -> String {
    format!("nbd+unix:///{export}?socket={}", socket(dir).display())
}

/// A server process; killed (SIGKILL, like a crash) and reaped on drop.
struct Server(Child);

impl Server {
    fn start(dir: &TempDir, program: &str, args: &[&str]) -> Server {
        // A socket left by a killed server would make the next one fail to bind.
        let _ = std::fs::remove_file(socket(dir));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.path(&format!("{program}.log")))
            .unwrap();
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {program}: {e}"));
        Server(child)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// nbdkit in the foreground (so the child is the server) on the directory's socket.
fn nbdkit(dir: &TempDir, args: &[&str]) -> Server {
    let socket = socket(dir);
    let mut all = vec!["-f", "--exit-with-parent", "-U", socket.to_str().unwrap()];
    all.extend_from_slice(args);
    Server::start(dir, "nbdkit", &all)
}

fn options(io_timeout: Duration) -> ClientOptions {
    ClientOptions {
        io_timeout,
        ..ClientOptions::default()
    }
}

/// Connects, giving a server that was just started time to listen.
fn connect(uri: &str, options: ClientOptions) -> NbdClient {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match NbdClient::connect(uri, options.clone()) {
            Ok(client) => return client,
            Err(ClientError::Connect { .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => panic!("connecting to {uri}: {e}"),
        }
    }
}

/// Whether a thread of this process has this name (as the kernel keeps it: 15 bytes).
fn thread_named(name: &str) -> bool {
    std::fs::read_dir("/proc/self/task").unwrap().any(|task| {
        let comm = task.unwrap().path().join("comm");
        std::fs::read_to_string(comm).is_ok_and(|c| c.trim_end() == name)
    })
}

fn wait_until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn read(dev: &dyn BlockDevice, offset: u64, len: usize) -> AlignedBuf {
    let mut buf = AlignedBuf::zeroed(len);
    dev.read(offset, &mut buf).expect("read");
    buf
}

/// The allocation map of a range, asking as often as the device needs and joining runs.
fn map(dev: &dyn BlockDevice, offset: u64, len: u64) -> Vec<Extent> {
    let mut out: Vec<Extent> = Vec::new();
    let mut pos = offset;
    while pos < offset + len {
        for e in dev.block_status(pos, offset + len - pos).unwrap() {
            pos += e.len;
            match out.last_mut() {
                Some(last) if last.flags == e.flags => last.len += e.len,
                _ => out.push(e),
            }
        }
    }
    out
}

/// udm's server in this process, serving `device` as `vol`; returns the export's URI.
fn udm_server(dir: &TempDir, device: Arc<dyn BlockDevice>) -> String {
    let devices = Devices::default();
    devices.add("vol", device, false);
    let server = NbdServer::new(Arc::new(devices), ServerConfig::default()).unwrap();
    server.listen_unix(&socket(dir)).unwrap();
    format!("nbd+unix:///vol?socket={}", socket(dir).display())
}

#[test]
fn conformance_against_nbdkit_memory() {
    let dir = scratch("memory");
    let _server = nbdkit(&dir, &["memory", "64M"]);
    let client = connect(&uri(&dir), ClientOptions::default());
    assert_eq!(client.size(), 64 * MIB);
    let caps = client.capabilities();
    assert!(caps.native_fua && caps.discard && caps.fast_zero && !caps.read_only);
    assert!(client.is_connected());
    conformance::run_all(&client);
    client.cache(0, 2 * MIB).unwrap();
}

#[test]
fn conformance_against_nbdkit_without_structured_replies() {
    // Simple replies only: read data follows the reply header, and there is no block status.
    let dir = scratch("no-sr");
    let _server = nbdkit(&dir, &["--no-sr", "memory", "64M"]);
    let client = connect(&uri(&dir), ClientOptions::default());
    conformance::run_all(&client);
    assert_eq!(
        client.block_status(0, 8 * MIB).unwrap(),
        vec![Extent::data(8 * MIB)]
    );
}

#[test]
fn conformance_against_qemu_nbd() {
    let dir = scratch("qemu");
    let image = dir.path("disk.img");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(64 * MIB)
        .unwrap();
    let socket = socket(&dir);
    let _server = Server::start(
        &dir,
        "qemu-nbd",
        &[
            "-t",
            "-e",
            "4",
            "-k",
            socket.to_str().unwrap(),
            "-f",
            "raw",
            "--discard=unmap",
            image.to_str().unwrap(),
        ],
    );
    let client = connect(&uri(&dir), ClientOptions::default());
    assert_eq!(client.size(), 64 * MIB);
    conformance::run_all(&client);
}

#[test]
fn conformance_against_udm_server() {
    let dir = scratch("udm");
    let uri = udm_server(&dir, Arc::new(MemoryDevice::new(64 * MIB)));
    let client = connect(&uri, ClientOptions::default());
    assert_eq!(client.size(), 64 * MIB);
    conformance::run_all(&client);
}

#[test]
fn tcp_and_ipv6_addresses_reach_the_server() {
    let _dir = scratch("tcp");
    let server = NbdServer::new(
        Arc::new(Devices::memory(&[("vol", 8 * MIB)])),
        ServerConfig::default(),
    )
    .unwrap();
    let v4 = server.listen_tcp("127.0.0.1:0").unwrap();
    let client = connect(
        &format!("nbd://127.0.0.1:{}/vol", v4.port()),
        ClientOptions::default(),
    );
    conformance::writes_read_back(&client);
    // IPv6 loopback may be missing in a container; test it where it exists.
    if let Ok(v6) = server.listen_tcp("[::1]:0") {
        let client = connect(
            &format!("nbd://[::1]:{}/vol", v6.port()),
            ClientOptions::default(),
        );
        assert!(read(&client, 0, 512)[..] == pattern(512, 1)[..]);
    }
}

#[test]
fn block_status_tells_holes_from_data() {
    let hole = |len| Extent {
        len,
        flags: EXTENT_HOLE | EXTENT_ZERO,
    };

    // qemu-nbd over a sparse file answers from SEEK_DATA/SEEK_HOLE.
    let dir = scratch("map");
    let image = dir.path("sparse.img");
    let mut file = std::fs::File::create(&image).unwrap();
    file.set_len(4 * MIB).unwrap();
    let data = pattern(65536, 5);
    std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(MIB)).unwrap();
    file.write_all(&data).unwrap();
    drop(file);
    let socket = socket(&dir);
    let _server = Server::start(
        &dir,
        "qemu-nbd",
        &[
            "-t",
            "-r",
            "-k",
            socket.to_str().unwrap(),
            "-f",
            "raw",
            image.to_str().unwrap(),
        ],
    );
    let client = connect(&uri(&dir), ClientOptions::default());
    assert!(client.capabilities().read_only);
    assert_eq!(
        map(&client, 0, 4 * MIB),
        vec![hole(MIB), Extent::data(65536), hole(3 * MIB - 65536)]
    );
    assert!(read(&client, MIB, 65536)[..] == data[..]);
    assert!(read(&client, 0, 65536).iter().all(|&b| b == 0));

    // udm's server over a memory device: unwritten pages are holes.
    let dir = scratch("map-udm");
    let uri = udm_server(&dir, Arc::new(MemoryDevice::new(4 * MIB)));
    let client = connect(&uri, ClientOptions::default());
    client
        .write(8192, &pattern(4096, 1), WriteFlags::default())
        .unwrap();
    assert_eq!(
        map(&client, 0, MIB),
        vec![hole(8192), Extent::data(4096), hole(MIB - 12288)]
    );
    // A read of a hole comes back as a hole chunk, which must zero the caller's buffer.
    let mut buf = AlignedBuf::zeroed(8192);
    buf.fill(0xff);
    client.read(0, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
}

#[test]
fn many_requests_in_flight_from_many_threads() {
    const THREADS: u64 = 8;
    const WRITES: usize = 200;
    const REGION: u64 = 8 * MIB;
    let dir = scratch("threads");
    let _server = nbdkit(&dir, &["memory", "64M"]);
    let client = connect(&uri(&dir), ClientOptions::default());
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let client = &client;
            s.spawn(move || {
                let base = t * REGION;
                let mut rng = Rng::new(t);
                let mut written = std::collections::HashMap::new();
                for i in 0..WRITES {
                    let block = rng.below(REGION / 4096);
                    let seed = t << 32 | i as u64;
                    client
                        .write(
                            base + block * 4096,
                            &pattern(4096, seed),
                            WriteFlags::default(),
                        )
                        .unwrap();
                    written.insert(block, seed);
                }
                for (block, seed) in written {
                    assert!(
                        read(client, base + block * 4096, 4096)[..] == pattern(4096, seed)[..],
                        "thread {t} block {block}"
                    );
                }
            });
        }
    });
}

#[test]
fn requests_beyond_the_servers_maximum_are_split() {
    let dir = scratch("split");
    let _server = nbdkit(
        &dir,
        &[
            "--filter=blocksize-policy",
            "memory",
            "64M",
            "blocksize-maximum=64K",
            "blocksize-error-policy=error",
        ],
    );
    let client = connect(&uri(&dir), ClientOptions::default());
    let data = pattern(MIB as usize + 4096, 3);
    client.write(4096, &data, WriteFlags { fua: true }).unwrap();
    assert!(read(&client, 4096, data.len())[..] == data[..]);
    client
        .write_zeroes(4096, MIB, ZeroFlags::default())
        .unwrap();
    let after = read(&client, 4096, data.len());
    assert!(after[..MIB as usize].iter().all(|&b| b == 0));
    assert!(after[MIB as usize..] == data[MIB as usize..]);
    client.cache(0, 4 * MIB).unwrap();
    client.discard(0, 16 * MIB).unwrap();
}

#[test]
fn reconnects_and_resends_after_the_server_restarts() {
    let dir = scratch("reconnect");
    let image = dir.path("disk.img");
    let data = pattern(4 * MIB as usize, 11);
    std::fs::write(&image, &data[..]).unwrap();
    let file_arg = format!("file={}", image.display());
    // Reads take 300 ms, so one can be caught in flight when the server dies.
    let args = ["--filter=delay", "file", &file_arg, "delay-read=300ms"];
    let server = nbdkit(&dir, &args);
    let client = Arc::new(connect(&uri(&dir), options(Duration::from_secs(10))));
    assert!(read(&*client, 0, 4096)[..] == data[..4096]);

    let spawn_read = |offset: u64| {
        let client = client.clone();
        std::thread::spawn(move || {
            let mut buf = AlignedBuf::zeroed(65536);
            client.read(offset, &mut buf).map(|()| buf)
        })
    };
    let in_flight = spawn_read(MIB);
    std::thread::sleep(Duration::from_millis(100));
    drop(server);
    wait_until(
        "the client sees the server gone",
        Duration::from_secs(2),
        || !client.is_connected(),
    );
    let while_down = spawn_read(2 * MIB + 8192);
    std::thread::sleep(Duration::from_millis(300));
    assert!(!in_flight.is_finished() && !while_down.is_finished());

    let _server = nbdkit(&dir, &args);
    let got = in_flight
        .join()
        .unwrap()
        .expect("the read in flight is resent");
    assert!(got[..] == data[MIB as usize..][..65536]);
    let got = while_down
        .join()
        .unwrap()
        .expect("the read made while down is sent");
    assert!(got[..] == data[2 * MIB as usize + 8192..][..65536]);
    assert!(client.is_connected());
    client
        .write(0, &pattern(4096, 12), WriteFlags { fua: true })
        .unwrap();
    assert!(read(&*client, 0, 4096)[..] == pattern(4096, 12)[..]);
}

#[test]
fn a_fail_fast_client_fails_requests_when_the_connection_breaks_and_serves_once_back() {
    let dir = scratch("fail-fast");
    let image = dir.path("disk.img");
    let data = pattern(4 * MIB as usize, 13);
    std::fs::write(&image, &data[..]).unwrap();
    let file_arg = format!("file={}", image.display());
    // Reads take 2 s, so one is in flight when the server dies.
    let args = ["--filter=delay", "file", &file_arg, "delay-read=2"];
    let server = nbdkit(&dir, &args);
    let options = ClientOptions {
        fail_fast: true,
        ..options(Duration::from_secs(30))
    };
    let client = Arc::new(connect(&uri(&dir), options));
    let in_flight = {
        let client = client.clone();
        std::thread::spawn(move || {
            let mut buf = AlignedBuf::zeroed(4096);
            let started = Instant::now();
            (client.read(0, &mut buf), started.elapsed())
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    drop(server);
    // Not resent, not waited for: the io_timeout (30 s) plays no part.
    let (result, took) = in_flight.join().unwrap();
    let err = result.unwrap_err();
    assert_eq!(err.errno(), libc::EIO, "{err}");
    assert!(err.to_string().contains("connection broke"), "{err}");
    assert!(took < Duration::from_secs(2), "failed after {took:?}");
    // While there is no connection, a request fails at once.
    let started = Instant::now();
    let mut buf = AlignedBuf::zeroed(4096);
    let err = client.read(0, &mut buf).unwrap_err();
    assert!(err.to_string().contains("not connected"), "{err}");
    assert!(started.elapsed() < Duration::from_millis(100));
    // The client redials by itself; requests succeed again once it has.
    let _server = nbdkit(&dir, &["file", &file_arg]);
    wait_until("the client is back", Duration::from_secs(10), || {
        client.is_connected()
    });
    assert!(read(&*client, MIB, 4096)[..] == data[MIB as usize..][..4096]);
}

#[test]
fn a_server_that_stays_away_fails_requests_after_io_timeout() {
    let dir = scratch("away");
    let server = nbdkit(&dir, &["memory", "64M"]);
    // nbdkit serves any export name; this one names the client's thread "nbd-client-away".
    let client = connect(&uri_for(&dir, "away"), options(Duration::from_secs(1)));
    // The thread names itself once it runs.
    wait_until("the client's thread runs", Duration::from_secs(2), || {
        thread_named("nbd-client-away")
    });
    drop(server);
    let start = Instant::now();
    let mut buf = AlignedBuf::zeroed(4096);
    let err = client.read(0, &mut buf).unwrap_err();
    let took = start.elapsed();
    assert_eq!(err.errno(), libc::EIO, "{err}");
    assert!(err.to_string().contains("unreachable"), "{err}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_millis(2500),
        "failed after {took:?}"
    );
    // Dropping it stops the reconnect loop at once, and its thread is gone.
    let start = Instant::now();
    drop(client);
    assert!(start.elapsed() < Duration::from_secs(1));
    assert!(!thread_named("nbd-client-away"));
}

#[test]
fn a_server_that_stops_answering_is_dropped_and_redialled() {
    // Reads hang for 20 s; writes are immediate.
    let dir = scratch("stalled");
    let _server = nbdkit(&dir, &["--filter=delay", "memory", "64M", "delay-read=20"]);
    let client = connect(&uri(&dir), options(Duration::from_secs(1)));
    let start = Instant::now();
    let mut buf = AlignedBuf::zeroed(4096);
    let err = client.read(0, &mut buf).unwrap_err();
    assert_eq!(err.errno(), libc::EIO, "{err}");
    assert!(start.elapsed() < Duration::from_millis(2500));
    // The silent connection was abandoned; a fresh one serves what the server still does.
    client
        .write(0, &pattern(4096, 1), WriteFlags::default())
        .unwrap();
    assert!(client.is_connected());
}

#[test]
fn an_export_that_comes_back_with_another_size_fails_the_device() {
    let dir = scratch("resized");
    let server = nbdkit(&dir, &["memory", "64M"]);
    let client = connect(&uri(&dir), options(Duration::from_secs(5)));
    drop(server);
    wait_until(
        "the client sees the server gone",
        Duration::from_secs(2),
        || !client.is_connected(),
    );
    let _server = nbdkit(&dir, &["memory", "32M"]);
    let start = Instant::now();
    let mut buf = AlignedBuf::zeroed(4096);
    let err = client.read(0, &mut buf).unwrap_err();
    assert_eq!(err.errno(), libc::EIO);
    assert!(err.to_string().contains("changed size"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(4));
    assert!(!client.is_connected());
    let err = client.write(0, &buf, WriteFlags::default()).unwrap_err();
    assert_eq!(err.errno(), libc::EIO);
}

#[test]
fn a_client_made_disconnected_connects_once_the_server_is_there() {
    let dir = scratch("later");
    let image = dir.path("disk.img");
    let data = pattern(4 * MIB as usize, 21);
    std::fs::write(&image, &data[..]).unwrap();
    let file_arg = format!("file={}", image.display());
    let client = Arc::new(
        NbdClient::disconnected(&uri(&dir), options(Duration::from_secs(10)), 4 * MIB).unwrap(),
    );
    assert_eq!(client.size(), 4 * MIB);
    assert!(!client.is_connected());
    let waiting = {
        let client = client.clone();
        std::thread::spawn(move || {
            let mut buf = AlignedBuf::zeroed(65536);
            client.read(MIB, &mut buf).map(|()| buf)
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    assert!(!waiting.is_finished());
    let _server = nbdkit(&dir, &["file", &file_arg]);
    let got = waiting
        .join()
        .unwrap()
        .expect("the read waits for the server");
    assert!(got[..] == data[MIB as usize..][..65536]);
    assert!(client.is_connected());

    // The size it was made with is checked against the server's.
    let wrong =
        NbdClient::disconnected(&uri(&dir), options(Duration::from_secs(5)), 8 * MIB).unwrap();
    let mut buf = AlignedBuf::zeroed(4096);
    let err = wrong.read(0, &mut buf).unwrap_err();
    assert_eq!(err.errno(), libc::EIO);
    assert!(err.to_string().contains("changed size"), "{err}");
}

#[test]
fn a_server_shutting_down_is_let_go_and_its_successor_serves_the_request() {
    for structured in [true, false] {
        let dir = scratch("eshutdown");
        let image = dir.path("disk.img");
        let data = pattern(4 * MIB as usize, 22);
        std::fs::write(&image, &data[..]).unwrap();
        let file_arg = format!("file={}", image.display());
        // Reads take 5 s, so one is in flight when the server is told to stop; nbdkit then
        // answers it (and anything after it) with ESHUTDOWN and waits for us to hang up.
        let mut args = vec!["--filter=delay", "file", &file_arg, "rdelay=5"];
        if !structured {
            args.insert(0, "--no-sr");
        }
        let mut server = nbdkit(&dir, &args);
        let client = Arc::new(connect(&uri(&dir), options(Duration::from_secs(20))));
        let in_flight = {
            let client = client.clone();
            std::thread::spawn(move || {
                let mut buf = AlignedBuf::zeroed(65536);
                client.read(MIB, &mut buf).map(|()| buf)
            })
        };
        std::thread::sleep(Duration::from_millis(300));
        unsafe { libc::kill(server.0.id() as i32, libc::SIGTERM) };
        wait_until(
            "nbdkit exits (the client hangs up)",
            Duration::from_secs(4),
            || matches!(server.0.try_wait(), Ok(Some(_))),
        );
        assert!(
            !in_flight.is_finished(),
            "the request failed instead of waiting"
        );
        let _server = nbdkit(&dir, &["file", &file_arg]);
        let got = in_flight
            .join()
            .unwrap()
            .expect("the request is resent to the new server");
        assert!(got[..] == data[MIB as usize..][..65536]);
    }
}

#[test]
fn closing_fails_waiting_requests_at_once() {
    let dir = scratch("close");
    let server = nbdkit(&dir, &["memory", "64M"]);
    let client = Arc::new(connect(&uri(&dir), options(Duration::from_secs(30))));
    drop(server);
    let waiting = {
        let client = client.clone();
        std::thread::spawn(move || {
            let mut buf = AlignedBuf::zeroed(4096);
            client.read(0, &mut buf)
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    assert!(!waiting.is_finished());
    let start = Instant::now();
    client.close();
    let err = waiting.join().unwrap().unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(err.errno(), libc::ESHUTDOWN, "{err}");
}

#[test]
fn a_read_only_client_does_not_wait_for_a_dead_server_to_flush() {
    let dir = scratch("ro-flush");
    let server = nbdkit(&dir, &["memory", "64M"]);
    let options = ClientOptions {
        read_only: true,
        ..options(Duration::from_secs(30))
    };
    let client = connect(&uri(&dir), options);
    drop(server);
    let start = Instant::now();
    client.flush().unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn server_errors_reach_the_caller_with_their_errno() {
    for structured in [true, false] {
        let dir = scratch("errors");
        let mut args = vec![
            "--filter=error",
            "memory",
            "64M",
            "error-pread=EIO",
            "error-pread-rate=100%",
            "error-pwrite=ENOSPC",
            "error-pwrite-rate=100%",
            "error-zero=EINVAL",
            "error-zero-rate=100%",
            "error-trim=EPERM",
            "error-trim-rate=100%",
        ];
        if !structured {
            args.insert(0, "--no-sr");
        }
        let _server = nbdkit(&dir, &args);
        let client = connect(&uri(&dir), ClientOptions::default());
        let mut buf = AlignedBuf::zeroed(4096);
        let errno = |r: udm_block::Result<()>| r.unwrap_err().errno();
        assert_eq!(errno(client.read(0, &mut buf)), libc::EIO);
        assert_eq!(
            errno(client.write(0, &buf, WriteFlags::default())),
            libc::ENOSPC
        );
        assert_eq!(
            errno(client.write_zeroes(0, 4096, ZeroFlags::default())),
            libc::EINVAL
        );
        assert_eq!(errno(client.discard(0, 4096)), libc::EPERM);
        // Errors are answers, not broken connections.
        assert!(client.is_connected());
        client.flush().unwrap();
    }
}

#[test]
fn read_only_exports_and_clients_refuse_writes() {
    let dir = scratch("ro");
    let _server = nbdkit(&dir, &["-r", "memory", "64M"]);
    let client = connect(&uri(&dir), ClientOptions::default());
    assert!(client.capabilities().read_only);
    let buf = AlignedBuf::zeroed(4096);
    let err = client.write(0, &buf, WriteFlags::default()).unwrap_err();
    assert_eq!(err.errno(), libc::EPERM);

    let dir = scratch("ro-option");
    let _server = nbdkit(&dir, &["memory", "64M"]);
    let client = connect(
        &uri(&dir),
        ClientOptions {
            read_only: true,
            ..ClientOptions::default()
        },
    );
    assert!(client.capabilities().read_only);
    assert_eq!(client.discard(0, 4096).unwrap_err().errno(), libc::EPERM);
    assert_eq!(
        client
            .write_zeroes(0, 4096, ZeroFlags::default())
            .unwrap_err()
            .errno(),
        libc::EPERM
    );
    read(&client, 0, 4096);
}

#[test]
fn connect_reports_what_went_wrong() {
    let dir = scratch("connect");
    let missing = NbdClient::connect(&uri(&dir), ClientOptions::default());
    assert!(matches!(missing, Err(ClientError::Connect { .. })));

    let bad = NbdClient::connect("nbd://host:99999/x", ClientOptions::default());
    assert!(matches!(bad, Err(ClientError::Uri(_))));

    let unknown =
        udm_server(&dir, Arc::new(MemoryDevice::new(4 * MIB))).replace("///vol", "///nope");
    match NbdClient::connect(&unknown, ClientOptions::default()) {
        Err(ClientError::Refused {
            export, message, ..
        }) => {
            assert_eq!(export, "nope");
            assert!(message.contains("nope"), "{message}");
        }
        other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
    }

    let dir = scratch("oldstyle");
    let _server = nbdkit(&dir, &["-o", "memory", "4M"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    let err = loop {
        match NbdClient::connect(&uri(&dir), ClientOptions::default()) {
            Err(ClientError::Connect { .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => break e,
            Ok(_) => panic!("an oldstyle server was accepted"),
        }
    };
    assert!(err.to_string().contains("oldstyle"), "{err}");
}

/// The least a fixed-newstyle server can be: every option but NBD_OPT_EXPORT_NAME is refused
/// as unsupported, replies are simple, and the 124 zero bytes are always sent. It serves one
/// connection after another until a client says goodbye with NBD_CMD_DISC.
struct MinimalServer {
    disk: Mutex<Vec<u8>>,
    /// Answer the first request of the first connection with garbage.
    garbage_first: bool,
    connections: AtomicUsize,
    saw_disc: AtomicBool,
}

impl MinimalServer {
    fn start(dir: &TempDir, garbage_first: bool) -> (Arc<MinimalServer>, JoinHandle<()>) {
        let listener = UnixListener::bind(socket(dir)).unwrap();
        let server = Arc::new(MinimalServer {
            disk: Mutex::new(vec![0u8; 4 * MIB as usize]),
            garbage_first,
            connections: AtomicUsize::new(0),
            saw_disc: AtomicBool::new(false),
        });
        let thread = std::thread::spawn({
            let server = server.clone();
            move || {
                for stream in listener.incoming() {
                    let first = server.connections.fetch_add(1, Ordering::AcqRel) == 0;
                    if server.serve(stream.unwrap(), first && server.garbage_first) {
                        return;
                    }
                }
            }
        });
        (server, thread)
    }

    /// Serves one connection; true when it ended with NBD_CMD_DISC.
    fn serve(&self, mut s: UnixStream, garbage: bool) -> bool {
        let mut greeting = NBDMAGIC.to_be_bytes().to_vec();
        greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
        greeting.extend_from_slice(&FLAG_FIXED_NEWSTYLE.to_be_bytes());
        s.write_all(&greeting).unwrap();
        let mut word = [0u8; 4];
        s.read_exact(&mut word).unwrap();
        assert_eq!(u32::from_be_bytes(word), CLIENT_FIXED_NEWSTYLE);
        loop {
            let mut header = [0u8; 16];
            s.read_exact(&mut header).unwrap();
            let option = u32::from_be_bytes(header[8..12].try_into().unwrap());
            let len = u32::from_be_bytes(header[12..16].try_into().unwrap());
            let mut data = vec![0u8; len as usize];
            s.read_exact(&mut data).unwrap();
            if option == OPT_EXPORT_NAME {
                let size = self.disk.lock().len() as u64;
                let mut reply = size.to_be_bytes().to_vec();
                reply.extend_from_slice(&(TF_HAS_FLAGS | TF_SEND_FLUSH).to_be_bytes());
                reply.extend_from_slice(&[0u8; 124]);
                s.write_all(&reply).unwrap();
                break;
            }
            s.write_all(&option_reply(option, REP_ERR_UNSUP, &[]))
                .unwrap();
        }
        loop {
            let mut header = [0u8; REQUEST_HEADER_LEN];
            if s.read_exact(&mut header).is_err() {
                return false;
            }
            let r = parse_request(&header).unwrap();
            if garbage {
                // Then wait for the client to hang up, as it must.
                s.write_all(&[0xde; 16]).unwrap();
                let _ = s.read_to_end(&mut Vec::new());
                return false;
            }
            let range = r.offset as usize..(r.offset + u64::from(r.length)) as usize;
            match r.command {
                CMD_READ => {
                    let mut reply = simple_reply(r.cookie, 0).to_vec();
                    reply.extend_from_slice(&self.disk.lock()[range]);
                    s.write_all(&reply).unwrap();
                }
                CMD_WRITE => {
                    s.read_exact(&mut self.disk.lock()[range]).unwrap();
                    s.write_all(&simple_reply(r.cookie, 0)).unwrap();
                }
                CMD_FLUSH => s.write_all(&simple_reply(r.cookie, 0)).unwrap(),
                CMD_DISC => {
                    self.saw_disc.store(true, Ordering::Release);
                    return true;
                }
                _ => s.write_all(&simple_reply(r.cookie, NBD_EINVAL)).unwrap(),
            }
        }
    }
}

#[test]
fn a_server_without_options_is_reached_through_export_name() {
    let dir = scratch("minimal");
    let (server, thread) = MinimalServer::start(&dir, false);
    let client = NbdClient::connect(&uri(&dir), ClientOptions::default()).unwrap();
    let caps = client.capabilities();
    assert!(!caps.native_fua && !caps.discard && !caps.fast_zero);
    let data = pattern(65536, 8);
    client.write(8192, &data, WriteFlags { fua: true }).unwrap();
    assert!(read(&client, 8192, 65536)[..] == data[..]);
    assert!(server.disk.lock()[8192..8192 + 65536] == data[..]);
    // No WRITE_ZEROES, TRIM, CACHE or block status: emulated or answered locally.
    client
        .write_zeroes(8192, 4096, ZeroFlags::default())
        .unwrap();
    assert!(read(&client, 8192, 4096).iter().all(|&b| b == 0));
    client.discard(0, 4096).unwrap();
    client.cache(0, 4096).unwrap();
    assert_eq!(
        client.block_status(0, MIB).unwrap(),
        vec![Extent::data(MIB)]
    );
    drop(client);
    thread.join().unwrap();
    assert!(
        server.saw_disc.load(Ordering::Acquire),
        "no NBD_CMD_DISC on drop"
    );
}

#[test]
fn a_protocol_error_from_the_server_means_reconnect_and_resend() {
    let dir = scratch("garbage");
    let (server, thread) = MinimalServer::start(&dir, true);
    server.disk.lock()[..4096].copy_from_slice(&pattern(4096, 4));
    let client = NbdClient::connect(&uri(&dir), options(Duration::from_secs(5))).unwrap();
    assert!(read(&client, 0, 4096)[..] == pattern(4096, 4)[..]);
    assert_eq!(server.connections.load(Ordering::Acquire), 2);
    drop(client);
    thread.join().unwrap();
}
