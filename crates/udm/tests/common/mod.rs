//! Shared harness for the end-to-end tests: a real `udm daemon` in a temporary directory, the
//! real client tools, and a raw NBD socket for the cases no polite client produces.

#![allow(dead_code)] // each test binary uses its own subset

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub const UDM: &str = env!("CARGO_BIN_EXE_udm");

#[allow(unused_imports)] // as above
pub use udm_testkit::{pattern_file, Netns, TempDir};

/// A running daemon with one Unix NBD listener.
pub struct Daemon {
    pub dir: TempDir,
    child: Option<Child>,
    extra_args: Vec<String>,
    /// Started with io_uring denied (see [`deny_io_uring`]).
    no_io_uring: bool,
    /// Environment variables the daemon is started with.
    env: Vec<(String, String)>,
    /// Runs in this network namespace (a "host" of the test's own).
    netns: Option<String>,
}

impl Daemon {
    pub fn start(tag: &str) -> Daemon {
        Self::start_with(tag, &[])
    }

    /// Starts a daemon with extra `udm daemon` options; `{dir}` in them stands for the
    /// daemon's scratch directory.
    pub fn start_with(tag: &str, extra_args: &[&str]) -> Daemon {
        Self::start_configured(tag, extra_args, false)
    }

    /// [`Daemon::start_with`] in a process where io_uring is denied.
    pub fn start_without_io_uring(tag: &str, extra_args: &[&str]) -> Daemon {
        Self::start_configured(tag, extra_args, true)
    }

    /// [`Daemon::start_with`] inside a network namespace; its control and Unix NBD sockets
    /// are files, reachable from outside it as from anywhere.
    pub fn start_in(netns: &Netns, tag: &str, extra_args: &[&str]) -> Daemon {
        Self::start_configured_in(tag, extra_args, false, Some(netns.name().to_string()))
    }

    fn start_configured(tag: &str, extra_args: &[&str], no_io_uring: bool) -> Daemon {
        Self::start_configured_in(tag, extra_args, no_io_uring, None)
    }

    fn start_configured_in(
        tag: &str,
        extra_args: &[&str],
        no_io_uring: bool,
        netns: Option<String>,
    ) -> Daemon {
        let mut daemon = Self::prepare(tag, extra_args);
        daemon.no_io_uring = no_io_uring;
        daemon.netns = netns;
        daemon.launch();
        daemon
    }

    /// A daemon set up but not started: [`Daemon::launch`] starts it.
    pub fn prepare(tag: &str, extra_args: &[&str]) -> Daemon {
        let dir = TempDir::new(tag);
        let extra_args = extra_args
            .iter()
            .map(|a| a.replace("{dir}", &dir.0.display().to_string()))
            .collect();
        Daemon {
            dir,
            child: None,
            extra_args,
            no_io_uring: false,
            env: Vec::new(),
            netns: None,
        }
    }

    /// Sets an environment variable for the next [`Daemon::launch`].
    pub fn set_env(&mut self, key: &str, value: &str) {
        self.env.push((key.to_string(), value.to_string()));
    }

    pub fn control(&self) -> PathBuf {
        self.dir.path("control.sock")
    }

    pub fn nbd_socket(&self) -> PathBuf {
        self.dir.path("nbd.sock")
    }

    /// `nbd+unix:///NAME?socket=…`
    pub fn uri(&self, name: &str) -> String {
        format!("nbd+unix:///{name}?socket={}", self.nbd_socket().display())
    }

    /// (Re)starts the daemon on the same state dir and sockets.
    pub fn launch(&mut self) {
        assert!(self.child.is_none(), "daemon already running");
        let _ = std::fs::remove_file(self.control());
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path("daemon.log"))
            .unwrap();
        let mut command = match &self.netns {
            Some(netns) => {
                let mut command = Command::new("ip");
                command.args(["netns", "exec", netns, UDM]);
                command
            }
            None => Command::new(UDM),
        };
        if self.no_io_uring {
            deny_io_uring(&mut command);
        }
        let child = command
            .arg("daemon")
            .arg("--state-dir")
            .arg(self.dir.path("state"))
            .arg("--control")
            .arg(self.control())
            .arg("--nbd")
            .arg(format!("unix:{}", self.nbd_socket().display()))
            .args(&self.extra_args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .env("UDM_LOG", "debug")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start udm daemon");
        self.child = Some(child);
        wait_for(|| self.udm_ok(&["ls"]), "the daemon's control socket");
    }

    /// Stops the daemon with SIGTERM (clean) or SIGKILL (crash).
    pub fn stop(&mut self, signal: i32) {
        if let Some(mut child) = self.child.take() {
            unsafe { libc::kill(child.id() as i32, signal) };
            let status = child.wait().unwrap();
            if signal == libc::SIGTERM {
                assert!(
                    status.success(),
                    "daemon exited with {status}; log:\n{}",
                    self.log()
                );
            }
        }
    }

    /// The daemon's threads: its own, and io_uring's kernel workers (iou-wrk), which come
    /// and go with the disk's load rather than with connections.
    pub fn threads(&self) -> (usize, usize) {
        let mut own = 0;
        let mut kernel = 0;
        for task in std::fs::read_dir(format!("/proc/{}/task", self.pid())).unwrap() {
            let comm = task.unwrap().path().join("comm");
            if std::fs::read_to_string(comm)
                .unwrap_or_default()
                .starts_with("iou-")
            {
                kernel += 1;
            } else {
                own += 1;
            }
        }
        (own, kernel)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("daemon running").id()
    }

    /// Collects a daemon that was killed from outside.
    pub fn reap(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.wait();
        }
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    /// The ports of the daemon's TCP listeners, in the order of its `--nbd` options (give
    /// `tcp:0` to have the kernel pick a free one).
    pub fn tcp_ports(&self) -> Vec<u16> {
        self.log()
            .lines()
            .filter_map(|line| line.split_once("nbd: listening on tcp:"))
            .map(|(_, addr)| addr.rsplit_once(':').unwrap().1.parse().unwrap())
            .collect()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path("daemon.log")).unwrap_or_default()
    }

    pub fn run_udm(&self, args: &[&str]) -> Output {
        Command::new(UDM)
            .args(args)
            .env("UDM_CONTROL", self.control())
            .output()
            .unwrap()
    }

    /// Sends one request over the control socket as a script would (no `udm` process in
    /// between, so nothing slows the request down); returns the answer.
    pub fn control_request(&self, request: serde_json::Value) -> serde_json::Value {
        use std::io::{BufRead, BufReader};
        let mut request = request;
        request["version"] = 1.into();
        let mut stream = UnixStream::connect(self.control()).unwrap();
        stream.write_all(format!("{request}\n").as_bytes()).unwrap();
        let mut answer = String::new();
        BufReader::new(stream).read_line(&mut answer).unwrap();
        serde_json::from_str(&answer).unwrap()
    }

    fn udm_ok(&self, args: &[&str]) -> bool {
        self.run_udm(args).status.success()
    }

    /// Creates a sparse file `file` of `size` bytes in the scratch directory and a device
    /// `name` that is `linear` over all of it; returns the file's path.
    pub fn create_linear(&self, name: &str, file: &str, size: u64) -> PathBuf {
        let path = self.dir.path(file);
        sparse_file(&path, size);
        let table = format!("0 {} linear {} 0", size / 512, path.display());
        self.udm(&["create", name, "--table", &table]);
        path
    }

    /// Runs a verb that must succeed; returns its standard output.
    pub fn udm(&self, args: &[&str]) -> String {
        let out = self.run_udm(args);
        assert!(
            out.status.success(),
            "udm {args:?} failed: {}\ndaemon log:\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.log()
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .trim_end()
            .to_string()
    }

    /// Runs a verb that must fail; returns its one-line error.
    pub fn udm_err(&self, args: &[&str]) -> String {
        let out = self.run_udm(args);
        assert!(!out.status.success(), "udm {args:?} unexpectedly succeeded");
        let err = String::from_utf8(out.stderr).unwrap();
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "error is not one line: {err:?}"
        );
        err.trim_end().to_string()
    }
}

impl Drop for Daemon {
    /// Stops the daemon cleanly (so a FUSE mount is unmounted), killing it if it hangs, and
    /// detaches whatever mount a killed daemon left in the scratch directory.
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        // Harmless when nothing is mounted there.
        let fuse = self.dir.path("fuse");
        let _ = Command::new("umount")
            .arg("-l")
            .arg(&fuse)
            .stderr(Stdio::null())
            .status();
    }
}

pub fn wait_for(mut ready: impl FnMut() -> bool, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ready() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs a client tool that must succeed; returns its standard output.
pub fn tool(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program} (install it; .ci/run does): {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// An ext4 image of `size` bytes at `image` holding the files of `tree` (made without mounting).
pub fn ext4_image_of(tree: &Path, image: &Path, size: u64) {
    sparse_file(image, size);
    tool(
        "mkfs.ext4",
        &[
            "-q",
            "-F",
            "-d",
            tree.to_str().unwrap(),
            image.to_str().unwrap(),
        ],
    );
}

/// `qemu-img compare` of two raw images (files or NBD URIs); fails the test if they differ.
pub fn same_content(a: &str, b: &str) {
    tool("qemu-img", &["compare", "-f", "raw", "-F", "raw", a, b]);
}

pub fn sparse_file(path: &Path, len: u64) {
    std::fs::File::create(path).unwrap().set_len(len).unwrap();
}

/// A raw NBD connection that has negotiated an export, for hand-made requests.
pub struct RawClient<S = UnixStream> {
    pub stream: S,
    pub size: u64,
}

pub const NBD_CMD_READ: u16 = 0;
pub const NBD_CMD_WRITE: u16 = 1;
pub const NBD_CMD_DISC: u16 = 2;
pub const NBD_CMD_FLUSH: u16 = 3;

impl RawClient {
    /// Connects and opens `name` with NBD_OPT_EXPORT_NAME (simple replies only).
    pub fn connect(socket: &Path, name: &str) -> RawClient {
        let stream = UnixStream::connect(socket).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        RawClient::open(stream, name)
    }
}

impl RawClient<TcpStream> {
    /// The same over TCP to 127.0.0.1:`port`.
    pub fn connect_tcp(port: u16, name: &str) -> RawClient<TcpStream> {
        let stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        RawClient::open(stream, name)
    }
}

impl<S: Read + Write> RawClient<S> {
    fn open(mut stream: S, name: &str) -> RawClient<S> {
        let mut greeting = [0u8; 18];
        stream.read_exact(&mut greeting).unwrap();
        assert_eq!(&greeting[..8], b"NBDMAGIC");
        stream.write_all(&3u32.to_be_bytes()).unwrap(); // fixed newstyle, no zeroes
        let mut opt = b"IHAVEOPT".to_vec();
        opt.extend_from_slice(&1u32.to_be_bytes());
        opt.extend_from_slice(&(name.len() as u32).to_be_bytes());
        opt.extend_from_slice(name.as_bytes());
        stream.write_all(&opt).unwrap();
        let mut reply = [0u8; 10];
        stream.read_exact(&mut reply).unwrap();
        RawClient {
            stream,
            size: u64::from_be_bytes(reply[..8].try_into().unwrap()),
        }
    }

    pub fn send(
        &mut self,
        flags: u16,
        command: u16,
        cookie: u64,
        offset: u64,
        len: u32,
        data: &[u8],
    ) {
        self.try_send(flags, command, cookie, offset, len, data)
            .unwrap();
    }

    pub fn try_send(
        &mut self,
        flags: u16,
        command: u16,
        cookie: u64,
        offset: u64,
        len: u32,
        data: &[u8],
    ) -> std::io::Result<()> {
        let mut req = 0x2560_9513u32.to_be_bytes().to_vec();
        req.extend_from_slice(&flags.to_be_bytes());
        req.extend_from_slice(&command.to_be_bytes());
        req.extend_from_slice(&cookie.to_be_bytes());
        req.extend_from_slice(&offset.to_be_bytes());
        req.extend_from_slice(&len.to_be_bytes());
        req.extend_from_slice(data);
        self.stream.write_all(&req)
    }

    /// Reads a simple reply: (error, cookie).
    pub fn reply(&mut self) -> std::io::Result<(u32, u64)> {
        let mut reply = [0u8; 16];
        self.stream.read_exact(&mut reply)?;
        assert_eq!(
            u32::from_be_bytes(reply[..4].try_into().unwrap()),
            0x6744_6698
        );
        Ok((
            u32::from_be_bytes(reply[4..8].try_into().unwrap()),
            u64::from_be_bytes(reply[8..16].try_into().unwrap()),
        ))
    }

    /// True once the server has closed the connection (false if it is still open when the
    /// read timeout expires, or sends more data).
    pub fn is_closed(&mut self) -> bool {
        let mut byte = [0u8; 1];
        match self.stream.read(&mut byte) {
            Ok(n) => n == 0,
            Err(e) => !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
        }
    }
}

/// A peer server (nbdkit, qemu-nbd) run as a child and killed on drop.
pub struct Peer(pub Child);

impl Peer {
    /// Starts `program args…` and waits until `socket` accepts connections.
    pub fn start(program: &str, args: &[&str], socket: &Path) -> Peer {
        let _ = std::fs::remove_file(socket);
        let child = Command::new(program)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {program} (install it; .ci/run does): {e}"));
        let peer = Peer(child);
        wait_for(|| UnixStream::connect(socket).is_ok(), program);
        peer
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Makes io_uring_setup fail with ENOSYS in the process `command` starts, with a seccomp
/// filter as container runtimes install: io_uring is unavailable there.
#[cfg(target_arch = "x86_64")]
pub fn deny_io_uring(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    const NR: u32 = 0; // offsetof(struct seccomp_data, nr)
    let stmt = |code: u32, k: u32| libc::sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    };
    let filter = [
        stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, NR),
        libc::sock_filter {
            code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
            jt: 0,
            jf: 1,
            k: libc::SYS_io_uring_setup as u32,
        },
        stmt(
            libc::BPF_RET | libc::BPF_K,
            libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32,
        ),
        stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ALLOW),
    ];
    // SAFETY: between fork and exec only prctl runs, on memory the closure owns.
    unsafe {
        command.pre_exec(move || {
            let program = libc::sock_fprog {
                len: filter.len() as u16,
                filter: filter.as_ptr().cast_mut(),
            };
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
                || libc::prctl(
                    libc::PR_SET_SECCOMP,
                    libc::SECCOMP_MODE_FILTER,
                    &program as *const libc::sock_fprog,
                ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    };
}

/// qemu-io `command` on `uri`: (succeeded, output).
pub fn qemu_io(uri: &str, command: &str) -> (bool, String) {
    let out = Command::new("qemu-io")
        .args(["-f", "raw", "-c", command, uri])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // qemu-io reports a failed command on its output and still exits 0.
    (out.status.success() && !text.contains("error"), text)
}

/// Runs `nbdsh -c SCRIPT`; returns (success, stdout + stderr). Debian's python3-libnbd is
/// built for the system python, so /usr/bin comes first on PATH.
pub fn nbdsh(script: &str) -> (bool, String) {
    let path = format!("/usr/bin:{}", std::env::var("PATH").unwrap_or_default());
    let out = std::process::Command::new("nbdsh")
        .args(["-c", script])
        .env("PATH", path)
        .output()
        .expect("nbdsh (python3-libnbd; scripts/install-deps.sh installs it)");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}
