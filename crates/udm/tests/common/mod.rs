//! Shared harness for the end-to-end tests: a real `udm daemon` in a temporary directory, the
//! real client tools, and a raw NBD socket for the cases no polite client produces.

#![allow(dead_code)] // each test binary uses its own subset

mod raw;
mod seccomp;
mod tables;
mod tools;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub const UDM: &str = env!("CARGO_BIN_EXE_udm");

pub const MIB: u64 = 1 << 20;

#[allow(unused_imports)] // as above
pub use raw::*;
#[allow(unused_imports)] // as above
pub use seccomp::deny_io_uring;
#[allow(unused_imports)] // as above
pub use tables::*;
#[allow(unused_imports)] // as above
pub use tools::*;
#[allow(unused_imports)] // as above
pub use udm_testkit::{pattern_file, Mounted, Netns, TempDir};

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

    /// Kills the daemon with SIGKILL (a crash) and starts it again on the state it left.
    pub fn crash_and_restart(&mut self) {
        self.stop(libc::SIGKILL);
        self.launch();
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

    /// The daemon's NBD pool threads (started for requests the device does not remap, and
    /// ended when idle for 10 s).
    pub fn pool_threads(&self) -> usize {
        self.threads_named("nbd-pool")
    }

    /// How many of the daemon's threads have a name starting with `prefix`.
    pub fn threads_named(&self, prefix: &str) -> usize {
        std::fs::read_dir(format!("/proc/{}/task", self.pid()))
            .unwrap()
            .filter(|task| {
                let comm = task.as_ref().unwrap().path().join("comm");
                std::fs::read_to_string(comm)
                    .unwrap_or_default()
                    .starts_with(prefix)
            })
            .count()
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

    /// `udm replay-log` of `log` onto `onto`, with more options `args`.
    pub fn replay_log(&self, log: &Path, onto: &Path, args: &[&str]) -> Output {
        let mut all = vec![
            "replay-log",
            "--log",
            log.to_str().unwrap(),
            "--replay",
            onto.to_str().unwrap(),
        ];
        all.extend_from_slice(args);
        self.run_udm(&all)
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

    /// A sparse file `file` of `size` bytes in the scratch directory; returns its path.
    pub fn sparse(&self, file: &str, size: u64) -> PathBuf {
        self.dir.sparse(file, size)
    }

    /// Creates device `name` with `table`.
    pub fn create(&self, name: &str, table: &str) {
        self.udm(&["create", name, "--table", table]);
    }

    /// Swaps `name`'s table live: suspend, load `table`, resume.
    pub fn reload(&self, name: &str, table: &str) {
        self.udm(&["suspend", name]);
        self.udm(&["load", name, "--table", table]);
        self.udm(&["resume", name]);
    }

    /// The number of `name`'s last event (`udm info`), for `udm wait`.
    pub fn event_nr(&self, name: &str) -> u64 {
        let info: serde_json::Value =
            serde_json::from_str(&self.udm(&["info", name, "--json"])).unwrap();
        info["event_nr"].as_u64().unwrap()
    }

    /// Swaps `name`'s table live `times` times, `other` and `first` in turn (so an even count
    /// ends on `first`), pausing `pause` after each swap.
    pub fn swap_tables(&self, name: &str, first: &str, other: &str, times: u32, pause: Duration) {
        for i in 0..times {
            self.reload(name, if i % 2 == 0 { other } else { first });
            std::thread::sleep(pause);
        }
    }

    /// Creates a sparse file `file` of `size` bytes in the scratch directory and a device
    /// `name` that is `linear` over all of it; returns the file's path.
    pub fn create_linear(&self, name: &str, file: &str, size: u64) -> PathBuf {
        let path = self.sparse(file, size);
        self.create(
            name,
            &format!("0 {} linear {} 0", size / 512, path.display()),
        );
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
        if std::thread::panicking() {
            // A test that failed in CI leaves nothing else behind: its daemon's last words.
            let log = self.log();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!("--- the daemon's log, last {} lines ---", tail.len());
            tail.iter().rev().for_each(|line| eprintln!("{line}"));
        }
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
