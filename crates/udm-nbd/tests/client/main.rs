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

mod errors;
mod mapped;
mod reconnect;
mod requests;

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
/// `disk.img`, 4 MiB of pattern `seed`, in `dir`: its data and nbdkit's `file=` argument.
fn patterned_image(dir: &TempDir, seed: u64) -> (AlignedBuf, String) {
    let image = dir.path("disk.img");
    let data = pattern(4 * MIB as usize, seed);
    std::fs::write(&image, &data[..]).unwrap();
    (data, format!("file={}", image.display()))
}

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

/// qemu-nbd serving the raw `image` on the test's socket, staying up across disconnects
/// (`-t`), with `args` besides.
fn qemu_nbd(dir: &TempDir, image: &std::path::Path, args: &[&str]) -> Server {
    let socket = socket(dir);
    let mut all = vec!["-t", "-k", socket.to_str().unwrap(), "-f", "raw"];
    all.extend_from_slice(args);
    all.push(image.to_str().unwrap());
    Server::start(dir, "qemu-nbd", &all)
}

fn options(io_timeout: Duration) -> ClientOptions {
    ClientOptions {
        io_timeout,
        ..ClientOptions::default()
    }
}

/// A multipath path's options: requests fail at once when the connection breaks.
fn fail_fast(io_timeout: Duration) -> ClientOptions {
    ClientOptions {
        fail_fast: true,
        ..options(io_timeout)
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

/// How many times the threads of this process with this name were switched out: each time
/// one slept and was woken, or was preempted.
fn thread_switches(name: &str) -> u64 {
    let mut switches = 0;
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let task = task.unwrap().path();
        let comm = std::fs::read_to_string(task.join("comm")).unwrap_or_default();
        if comm.trim_end() != name {
            continue;
        }
        let status = std::fs::read_to_string(task.join("status")).unwrap_or_default();
        switches += status
            .lines()
            .filter(|l| l.contains("ctxt_switches:"))
            .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .sum::<u64>();
    }
    switches
}

/// How many threads of this process have this name.
fn threads_named(name: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter(|task| {
            let comm = task.as_ref().unwrap().path().join("comm");
            std::fs::read_to_string(comm).is_ok_and(|c| c.trim_end() == name)
        })
        .count()
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
    udm_server_with(dir, device, ServerConfig::default()).0
}

/// [`udm_server`] with its settings; also returns its catalog, which counts connections.
fn udm_server_with(
    dir: &TempDir,
    device: Arc<dyn BlockDevice>,
    config: ServerConfig,
) -> (String, Arc<Devices>) {
    let devices = Arc::new(Devices::default());
    devices.add("vol", device, false);
    let server = NbdServer::new(devices.clone(), config).unwrap();
    server.listen_unix(&socket(dir)).unwrap();
    let uri = format!("nbd+unix:///vol?socket={}", socket(dir).display());
    (uri, devices)
}
