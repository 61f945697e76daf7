//! End to end: udm as a service — the unit file's command line runs as written, the daemon
//! tells systemd READY=1 only once its devices are back and STOPPING=1 when it stops, and
//! `/metrics` counts what fio did.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

const UNIT: &str = include_str!("../../../packaging/udm.service");

/// The unit's ExecStart, with the binary under test and `dir` in place of /var/lib and /run.
fn exec_start(dir: &Path) -> Vec<String> {
    let line = UNIT
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("the unit has an ExecStart");
    line.split_whitespace()
        .map(|word| {
            word.replace("/usr/local/bin/udm", UDM)
                .replace("/var/lib/udm", &dir.join("state").display().to_string())
                .replace("/run/udm", &dir.join("run").display().to_string())
        })
        .collect()
}

/// `udm` verbs against the daemon started from the unit.
fn udm(dir: &Path, args: &[&str]) -> String {
    let out = Command::new(UDM)
        .args(args)
        .env("UDM_CONTROL", dir.join("run/control.sock"))
        .output()
        .unwrap();
    assert!(out.status.success(), "udm {args:?}: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

fn receive(socket: &UnixDatagram) -> String {
    let mut buf = [0u8; 512];
    let n = socket
        .recv(&mut buf)
        .expect("a notification within the timeout");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[test]
fn the_unit_starts_the_daemon_which_tells_systemd_when_ready_and_when_stopping() {
    let dir = TempDir::new("unit");
    // systemd makes the RuntimeDirectory; here the test does.
    std::fs::create_dir_all(dir.path("run")).unwrap();
    let command = exec_start(&dir.0);
    let start = || {
        let mut daemon = Command::new(&command[0]);
        daemon
            .args(&command[1..])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path("daemon.log")).unwrap());
        daemon
    };

    // Devices to restore: made on a first run, which has no NOTIFY_SOCKET.
    let mut first = start().spawn().unwrap();
    wait_for(
        || dir.path("run/control.sock").exists(),
        "the first daemon's control socket",
    );
    for i in 0..40 {
        udm(
            &dir.0,
            &["create", &format!("vol{i:02}"), "--table", "0 2048 zero"],
        );
    }
    unsafe { libc::kill(first.id() as i32, libc::SIGTERM) };
    assert!(first.wait().unwrap().success());

    let notify = UnixDatagram::bind(dir.path("notify.sock")).unwrap();
    notify
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut daemon = start()
        .env("NOTIFY_SOCKET", dir.path("notify.sock"))
        .spawn()
        .unwrap();
    let ready = receive(&notify);
    // Asked at once: READY=1 promises that every device is back and the verbs are answered.
    let listed = udm(&dir.0, &["ls"]);
    assert_eq!(ready, "READY=1\nSTATUS=serving 40 restored device(s)");
    assert_eq!(listed.lines().count(), 40, "{listed}");
    let log = std::fs::read_to_string(dir.path("daemon.log")).unwrap();
    assert!(log.contains("restored 40 device(s)"), "{log}");

    // `systemctl reload`: the unit's ExecReload, $MAINPID the daemon's; it serves on.
    let reload: Vec<String> = UNIT
        .lines()
        .find_map(|l| l.strip_prefix("ExecReload="))
        .expect("the unit has an ExecReload")
        .split_whitespace()
        .map(|word| word.replace("$MAINPID", &daemon.id().to_string()))
        .collect();
    assert!(Command::new(&reload[0])
        .args(&reload[1..])
        .status()
        .unwrap()
        .success());
    wait_for(
        || {
            let log = std::fs::read_to_string(dir.path("daemon.log")).unwrap();
            log.contains("SIGHUP: reopened the log file")
        },
        "the daemon to reopen its log",
    );
    assert_eq!(udm(&dir.0, &["ls"]).lines().count(), 40);

    unsafe { libc::kill(daemon.id() as i32, libc::SIGTERM) };
    let stopping = receive(&notify);
    assert!(stopping.starts_with("STOPPING=1\n"), "{stopping}");
    assert!(daemon.wait().unwrap().success());
    // Nothing more after the stop began, and the sockets are gone.
    notify
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    assert!(notify.recv(&mut [0u8; 64]).is_err());
    assert!(!dir.path("run/control.sock").exists());
}

#[test]
fn systemd_accepts_the_unit() {
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("systemd-analyze is not installed: the unit is not verified");
        return;
    }
    let dir = TempDir::new("unit-verify");
    let unit = dir.path("udm.service");
    std::fs::write(&unit, UNIT.replace("/usr/local/bin/udm", UDM)).unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&unit)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && said.trim().is_empty(), "{said}");
}

/// `GET /metrics` over plain HTTP: the body.
fn scrape(port: u16) -> String {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    assert!(
        head.contains("Content-Type: text/plain; version=0.0.4"),
        "{head}"
    );
    body.to_string()
}

/// One sample's value: `family{labels}` as written in the exposition.
fn value(body: &str, sample: &str) -> f64 {
    body.lines()
        .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {sample} in\n{body}"))
        .parse()
        .unwrap()
}

/// The port the daemon's metrics endpoint took (`--metrics tcp:0`), from its log.
fn metrics_port(daemon: &Daemon) -> u16 {
    daemon
        .log()
        .lines()
        .find_map(|l| l.split_once("metrics: http://127.0.0.1:"))
        .and_then(|(_, rest)| rest.split_once('/'))
        .map(|(port, _)| port.parse().unwrap())
        .expect("the metrics address in the log")
}

#[test]
fn metrics_count_exactly_what_fio_did() {
    let daemon = Daemon::start_with("metrics", &["--metrics", "tcp:0"]);
    let port = metrics_port(&daemon);
    daemon.create_linear("vol", "vol.img", 64 << 20);
    let before = scrape(port);
    assert_eq!(value(&before, "udm_reads_total{device=\"vol\"}"), 0.0);

    let fio = Command::new("fio")
        .args([
            "--name=metrics",
            "--ioengine=nbd",
            &format!("--uri={}", daemon.uri("vol")),
            "--rw=randrw",
            "--bs=4k",
            "--iodepth=16",
            "--size=64M",
            "--time_based",
            "--runtime=3",
            "--output-format=json",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("fio");
    // fio takes a while to start on a loaded machine: sample from its connection on.
    wait_for(
        || value(&scrape(port), "udm_open_count{device=\"vol\"}") == 1.0,
        "fio's connection",
    );
    // While fio runs, the counters move and its connection counts as an open.
    let mut reads = Vec::new();
    let mut saw_in_flight = false;
    for _ in 0..4 {
        std::thread::sleep(Duration::from_millis(500));
        let body = scrape(port);
        reads.push(value(&body, "udm_reads_total{device=\"vol\"}"));
        saw_in_flight |= value(&body, "udm_in_flight{device=\"vol\"}") > 0.0;
        assert_eq!(value(&body, "udm_open_count{device=\"vol\"}"), 1.0);
    }
    let out = fio.wait_with_output().unwrap();
    assert!(out.status.success(), "fio failed");
    assert!(
        reads.windows(2).all(|w| w[1] > w[0]),
        "reads did not move while fio ran: {reads:?}"
    );
    assert!(saw_in_flight, "no request in flight in any scrape");

    let stdout = String::from_utf8_lossy(&out.stdout);
    let json: serde_json::Value =
        serde_json::from_str(&stdout[stdout.find('{').unwrap()..]).unwrap();
    let job = &json["jobs"][0];
    let after = scrape(port);
    for (op, family, bytes) in [
        ("read", "udm_reads_total", "udm_read_bytes_total"),
        ("write", "udm_writes_total", "udm_written_bytes_total"),
    ] {
        let ios = job[op]["total_ios"].as_f64().unwrap();
        let io_bytes = job[op]["io_bytes"].as_f64().unwrap();
        assert!(ios > 1000.0, "{op}: fio did only {ios} I/Os");
        let sample = |family: &str| value(&after, &format!("{family}{{device=\"vol\"}}"));
        assert_eq!(sample(family), ios, "{op} requests");
        assert_eq!(sample(bytes), io_bytes, "{op} bytes");
        let count = value(
            &after,
            &format!("udm_request_duration_seconds_count{{device=\"vol\",op=\"{op}\"}}"),
        );
        assert_eq!(count, ios, "{op} latencies");
        let errors = value(
            &after,
            &format!("udm_errors_total{{device=\"vol\",op=\"{op}\"}}"),
        );
        assert_eq!(errors, 0.0);
    }
    assert_eq!(value(&after, "udm_in_flight{device=\"vol\"}"), 0.0);
    wait_for(
        || value(&scrape(port), "udm_open_count{device=\"vol\"}") == 0.0,
        "fio's connection to close",
    );
}

#[test]
fn metrics_show_a_clone_hydrating_to_the_end() {
    let daemon = Daemon::start_with("metrics-clone", &["--metrics", "tcp:0"]);
    let port = metrics_port(&daemon);
    let source = daemon.dir.path("source.img");
    pattern_file(&source, 4 << 20, 7);
    let meta = daemon.sparse("meta.img", 1 << 20);
    let dest = daemon.sparse("dest.img", 4 << 20);
    let table = format!(
        "0 8192 clone {} {} {} 8 1 no_hydration",
        meta.display(),
        dest.display(),
        source.display()
    );
    daemon.create("vol", &table);
    let body = scrape(port);
    assert_eq!(
        value(&body, "udm_clone_size_bytes{device=\"vol\"}"),
        4194304.0
    );
    assert_eq!(
        value(&body, "udm_clone_hydrated_bytes{device=\"vol\"}"),
        0.0
    );
    assert_eq!(
        value(&body, "udm_clone_hydration_complete{device=\"vol\"}"),
        0.0
    );
    daemon.udm(&["message", "vol", "0", "hydration_threshold", "64"]);
    daemon.udm(&["message", "vol", "0", "enable_hydration"]);
    wait_for(
        || {
            value(
                &scrape(port),
                "udm_clone_hydration_complete{device=\"vol\"}",
            ) == 1.0
        },
        "the clone to hydrate",
    );
    let body = scrape(port);
    assert_eq!(
        value(&body, "udm_clone_hydrated_bytes{device=\"vol\"}"),
        4194304.0
    );
    // Devices without a clone have no clone metrics.
    daemon.create_linear("plain", "plain.img", 1 << 20);
    assert!(!scrape(port).contains("udm_clone_size_bytes{device=\"plain\"}"));
}

/// `udm daemon --fork` returns once the daemon answers and its devices are back; `udm stop`
/// returns once it has exited, so the next start on the same state dir never races it.
#[test]
fn fork_returns_when_ready_and_stop_when_stopped() {
    let dir = TempDir::new("fork");
    let control = dir.path("control.sock");
    let start = || {
        Command::new(UDM)
            .args(["daemon", "--fork", "--state-dir"])
            .arg(dir.path("state"))
            .arg("--control")
            .arg(&control)
            .stderr(std::fs::File::create(dir.path("daemon.log")).unwrap())
            .status()
            .unwrap()
    };
    let udm = |args: &[&str]| {
        Command::new(UDM)
            .args(args)
            .env("UDM_CONTROL", &control)
            .output()
            .unwrap()
    };
    assert!(start().success());
    assert!(udm(&["create", "vol", "--table", "0 8 zero"])
        .status
        .success());
    for round in 0..5 {
        assert!(udm(&["stop"]).status.success(), "round {round}");
        assert!(
            start().success(),
            "round {round}: {}",
            std::fs::read_to_string(dir.path("daemon.log")).unwrap()
        );
        let ls = udm(&["ls"]);
        assert_eq!(
            String::from_utf8_lossy(&ls.stdout),
            "vol\t(8 sectors)\n",
            "round {round}"
        );
    }
    // A second daemon on the same state dir fails, and --fork says so with its status.
    let second = Command::new(UDM)
        .args(["daemon", "--fork", "--state-dir"])
        .arg(dir.path("state"))
        .arg("--control")
        .arg(dir.path("other.sock"))
        .output()
        .unwrap();
    assert_eq!(second.status.code(), Some(1));
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(err.contains("udm daemon already running"), "{err}");
    assert!(udm(&["stop"]).status.success());
    let log = std::fs::read_to_string(dir.path("daemon.log")).unwrap();
    assert!(!log.contains("warning"), "{log}");
}

/// `out=$(udm daemon --fork)` returns once the daemon is ready: the daemon keeps neither the
/// caller's stdout nor a piped stderr open (it waited for the daemon to exit, 10 min measured).
#[test]
fn fork_lets_go_of_the_callers_stdout_and_a_piped_stderr() {
    let dir = TempDir::new("fork-pipes");
    let control = dir.path("control.sock");
    let (done, finished) = std::sync::mpsc::channel();
    let mut command = Command::new(UDM);
    command
        .args(["daemon", "--fork", "--state-dir"])
        .arg(dir.path("state"))
        .arg("--control")
        .arg(&control);
    std::thread::spawn(move || done.send(command.output().unwrap()));
    let output = finished
        .recv_timeout(std::time::Duration::from_secs(30))
        .expect("udm daemon --fork kept its caller's pipes open");
    assert!(output.status.success());
    assert!(output.stdout.is_empty());
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(err.contains("stderr is a pipe"), "{err}");
    let stop = Command::new(UDM)
        .arg("stop")
        .env("UDM_CONTROL", &control)
        .status()
        .unwrap();
    assert!(stop.success());
}

/// Waits until the daemon's log has `line`, failing at once if the daemon is gone.
fn wait_for_log_line(daemon: &mut Daemon, line: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !daemon.log().contains(line) {
        assert!(
            daemon.is_running(),
            "the daemon is gone; its log:\n{}",
            daemon.log()
        );
        assert!(
            std::time::Instant::now() < deadline,
            "no {line:?} in the log"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Admins send SIGHUP by habit; it killed the daemon without a stop (a zombie, no log line,
/// sockets left behind). It reopens the log file, so a log can be rotated by moving it away.
#[test]
fn sighup_reopens_the_log_file_and_the_daemon_serves_on() {
    let mut daemon = Daemon::start("sighup");
    let hup = |daemon: &Daemon| unsafe { libc::kill(daemon.pid() as i32, libc::SIGHUP) };
    let reopened = format!(
        "reopened the log file {}",
        daemon.dir.path("daemon.log").display()
    );
    hup(&daemon);
    wait_for_log_line(&mut daemon, &reopened);
    daemon.create("before", "0 8 zero");

    let rotated = daemon.dir.path("daemon.log.1");
    std::fs::rename(daemon.dir.path("daemon.log"), &rotated).unwrap();
    hup(&daemon);
    wait_for_log_line(&mut daemon, &reopened);
    daemon.create("after", "0 8 zero");
    let new = daemon.log();
    assert!(new.contains("created device 'after'"), "{new}");
    assert!(!new.contains("created device 'before'"), "{new}");
    let old = std::fs::read_to_string(&rotated).unwrap();
    assert!(
        old.contains("created device 'before'") && !old.contains("'after'"),
        "{old}"
    );
    daemon.stop(libc::SIGTERM);
}

/// Relative paths given to the daemon: `udm stop` from another directory looked for the state
/// dir the daemon named (`st`) in its own directory and failed. The daemon makes its paths
/// absolute, shows them so, and leaves its start directory for `/`; relative paths in a table
/// sent straight to the control socket still mean its start directory. The control socket's
/// missing directory is made.
#[test]
fn a_daemon_started_with_relative_paths_is_stopped_from_anywhere() {
    let dir = TempDir::new("relative");
    std::fs::File::create(dir.path("a.img"))
        .unwrap()
        .set_len(MIB)
        .unwrap();
    let mut daemon = Command::new(UDM)
        .args(["daemon", "--state-dir", "st", "--control", "run/udm/c.sock"])
        .args(["--nbd", "unix:n.sock", "--fuse", "fuse"])
        .current_dir(&dir.0)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path("daemon.log")).unwrap())
        .spawn()
        .unwrap();
    let control = dir.path("run/udm/c.sock");
    wait_for(|| control.exists(), "the control socket");
    // Its directory was missing (as /run/udm is for a daemon run by hand): made, 0755.
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(dir.path("run/udm"))
            .unwrap()
            .permissions(),
    );
    assert_eq!(mode & 0o777, 0o755);
    let udm = |args: &[&str]| {
        let out = Command::new(UDM)
            .args(args)
            .env("UDM_CONTROL", &control)
            .current_dir("/")
            .output()
            .unwrap();
        let log = std::fs::read_to_string(dir.path("daemon.log")).unwrap();
        assert!(out.status.success(), "udm {args:?}: {out:?}\n{log}");
        String::from_utf8(out.stdout).unwrap()
    };
    // Straight to the socket, as a script would: `./a.img` is in the daemon's start directory.
    let mut stream = std::os::unix::net::UnixStream::connect(&control).unwrap();
    let create = serde_json::json!({"version": 1, "command": "create", "name": "vol",
        "table": "0 2048 linear ./a.img 0"});
    writeln!(stream, "{create}").unwrap();
    let mut answer = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stream), &mut answer).unwrap();
    assert!(answer.contains("\"ok\":true"), "{answer}");
    let info = udm(&["info", "vol"]);
    assert!(
        info.contains(&format!(
            "FUSE file:         {}",
            dir.path("fuse/vol").display()
        )),
        "{info}"
    );
    let table = udm(&["table", "vol"]);
    assert_eq!(
        table.trim(),
        format!("0 2048 linear {} 0", dir.path("a.img").display())
    );
    let cwd = std::fs::read_link(format!("/proc/{}/cwd", daemon.id())).unwrap();
    assert_eq!(
        cwd,
        Path::new("/"),
        "the daemon keeps its start directory busy"
    );
    udm(&["stop"]);
    assert!(daemon.wait().unwrap().success());
    assert!(!control.exists() && !dir.path("n.sock").exists());
}

/// A start that fails after some sockets are made (here a TCP listener whose port is taken)
/// left them behind; now it removes them, and never one that another live daemon serves.
#[test]
fn a_failed_start_removes_its_sockets_and_no_one_elses() {
    let live = Daemon::start("failed-start-live");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dir = TempDir::new("failed-start");
    let start = |control: &Path, nbd: &[String]| {
        let mut command = Command::new(UDM);
        command
            .args(["daemon", "--state-dir"])
            .arg(dir.path("state"))
            .arg("--control")
            .arg(control);
        for listener in nbd {
            command.args(["--nbd", listener]);
        }
        command.output().unwrap()
    };
    let own = dir.path("own.sock");
    let port = taken.local_addr().unwrap().port();
    let out = start(
        &dir.path("control.sock"),
        &[
            format!("unix:{}", own.display()),
            format!("tcp:127.0.0.1:{port}"),
        ],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("Address already in use"), "{err}");
    assert!(
        !own.exists(),
        "the failed start left {} behind",
        own.display()
    );

    // Its own NBD socket made, then the control socket of a live daemon: refused, and the live
    // daemon's socket stays.
    let out = start(&live.control(), &[format!("unix:{}", own.display())]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("in use by a running server"), "{err}");
    assert!(
        !own.exists(),
        "the failed start left {} behind",
        own.display()
    );
    assert!(live.control().exists());
    live.udm(&["ls"]);
    // And the other way round: the live daemon's NBD socket, refused, stays.
    let out = start(
        &dir.path("control.sock"),
        &[format!("unix:{}", live.nbd_socket().display())],
    );
    assert!(!out.status.success());
    assert!(live.nbd_socket().exists());
    assert!(!dir.path("control.sock").exists());
}
