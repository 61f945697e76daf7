//! End to end: the dmsetup-style verbs, table swaps under load, restarts, and the errors a
//! user sees for bad input.

mod common;

use std::time::Duration;

use common::*;

const MIB: u64 = 1 << 20;

#[test]
fn verbs_report_state_tables_and_status() {
    let daemon = Daemon::start("verbs");
    let disk = daemon.dir.path("disk.img");
    sparse_file(&disk, 4 * MIB);
    let d = disk.to_str().unwrap();
    let table = format!("0 4096 linear {d} 0\n4096 4096 dust {d} 4096 512");
    let file = daemon.dir.path("vol.table");
    std::fs::write(&file, &table).unwrap();
    daemon.udm(&["create", "vol", "--table-file", file.to_str().unwrap()]);
    assert_eq!(daemon.udm(&["table", "vol"]), table);
    assert_eq!(
        daemon.udm(&["status", "vol"]),
        format!("0 4096 linear\n4096 4096 dust {d} bypass verbose")
    );
    let json: serde_json::Value =
        serde_json::from_str(&daemon.udm(&["status", "vol", "--json"])).unwrap();
    assert_eq!(json["targets"][1]["type"], "dust");
    let info = daemon.udm(&["info", "vol"]);
    assert!(info.contains("State:             ACTIVE"), "{info}");
    assert!(info.contains("Tables present:    LIVE\n"), "{info}");

    // Messages reach the target at the sector; its answer is printed.
    assert_eq!(
        daemon.udm(&["message", "vol", "4096", "addbadblock", "3"]),
        "dust_add_block: badblock added at block 3"
    );
    daemon.udm(&["message", "vol", "4096", "enable"]);
    let err = daemon.udm_err(&["message", "vol", "0", "frobnicate"]);
    assert!(
        err.contains("linear: unknown message 'frobnicate'"),
        "{err}"
    );
    let err = daemon.udm_err(&["message", "vol", "99999", "enable"]);
    assert!(err.contains("beyond the end"), "{err}");

    // The bad block fails exactly the reads that touch it.
    let uri = daemon.uri("vol");
    let bad = format!("read {} 512", 2 * MIB + 3 * 512);
    let out = std::process::Command::new("qemu-io")
        .args(["-f", "raw", "-c", &bad, &uri])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("Input/output error")
            || String::from_utf8_lossy(&out.stderr).contains("Input/output error"),
        "{out:?}"
    );
    tool(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            &format!("read {} 512", 2 * MIB + 4 * 512),
            &uri,
        ],
    );

    // Suspend and load show in info; resume makes the new table live.
    daemon.udm(&["suspend", "vol"]);
    daemon.udm(&["load", "vol", "--table", "0 8192 zero"]);
    let info = daemon.udm(&["info", "vol"]);
    assert!(
        info.contains("SUSPENDED") && info.contains("LIVE & INACTIVE"),
        "{info}"
    );
    daemon.udm(&["resume", "vol"]);
    assert_eq!(daemon.udm(&["table", "vol"]), "0 8192 zero");
    assert!(daemon.udm(&["targets"]).contains("striped"));
}

#[test]
fn bad_input_gets_one_line_errors_that_name_the_problem() {
    let daemon = Daemon::start("errors");
    let cases: &[(&[&str], &str)] = &[
        (
            &["create", "a", "--table", "0 8 linear"],
            "line 1: linear: missing argument <dev>",
        ),
        (
            &["create", "a", "--table", "0 8 nosuch"],
            "unknown target type 'nosuch'",
        ),
        (
            &["create", "a", "--table", "0 8 zero\n9 8 zero"],
            "line 2: segment starts at sector 9",
        ),
        (
            &["create", "a", "--table", "0 8 linear /nonexistent/x 0"],
            "/nonexistent/x",
        ),
        (
            &["create", "a", "--table", "0 8 linear ghost 0"],
            "no device named 'ghost'",
        ),
        (
            &[
                "create",
                "a",
                "--table",
                "0 8 linear nbd+unix:///x?socket=/nonexistent/nbd.sock 0",
            ],
            "cannot connect to nbd server",
        ),
        (
            &["create", "a/b", "--table", "0 8 zero"],
            "invalid device name 'a/b'",
        ),
        (&["status", "ghost"], "device 'ghost' does not exist"),
        (&["remove", "ghost"], "device 'ghost' does not exist"),
    ];
    for (args, expected) in cases {
        let err = daemon.udm_err(args);
        assert!(err.contains(expected), "udm {args:?}: {err}");
    }
    daemon.udm(&["create", "a", "--table", "0 8 zero"]);
    assert!(daemon
        .udm_err(&["create", "a", "--table", "0 8 zero"])
        .contains("already exists"));
    // A device cannot come to depend on itself.
    daemon.udm(&["create", "b", "--table", "0 8 linear a 0"]);
    let err = daemon.udm_err(&["load", "a", "--table", "0 8 linear b 0"]);
    assert!(err.contains("would make 'a' depend on itself"), "{err}");
    assert!(daemon.udm_err(&["remove", "a"]).contains("used by b"));
    // Nothing was lost: both devices are still there and the daemon still answers.
    assert_eq!(daemon.udm(&["ls"]), "a\t(8 sectors)\nb\t(8 sectors)");

    // The daemon is not reachable: a clear error, no hang.
    let out = std::process::Command::new(UDM)
        .args(["ls", "--control", "/nonexistent/control.sock"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach the udm daemon"));
}

#[test]
fn malformed_control_requests_leave_the_daemon_serving() {
    use std::io::{BufRead, BufReader, Write};
    let daemon = Daemon::start("control");
    for junk in [
        "not json\n",
        "{\"version\":1,\"command\":\"explode\"}\n",
        "{\"version\":9,\"command\":\"targets\"}\n",
        "{}\n",
    ] {
        let mut s = std::os::unix::net::UnixStream::connect(daemon.control()).unwrap();
        s.write_all(junk.as_bytes()).unwrap();
        let mut answer = String::new();
        BufReader::new(s).read_line(&mut answer).unwrap();
        let answer: serde_json::Value = serde_json::from_str(&answer).unwrap();
        assert_eq!(answer["ok"], false, "{junk}");
        assert!(answer["error"].as_str().unwrap().len() > 5);
    }
    daemon.udm(&["ls"]);
}

#[test]
fn invalid_utf8_in_a_control_request_gets_an_error_and_the_connection_stays_usable() {
    use std::io::{BufRead, BufReader, Write};
    let daemon = Daemon::start("control-utf8");
    let s = std::os::unix::net::UnixStream::connect(daemon.control()).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let mut writer = s.try_clone().unwrap();
    let mut reader = BufReader::new(s);
    let mut answer = |request: &[u8]| -> serde_json::Value {
        writer.write_all(request).unwrap();
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"))
    };
    for junk in [
        &b"{\"version\":1,\"command\":\"table\",\"name\":\"\xff\xfe\"}\n"[..],
        b"\xc3\x28\n",
    ] {
        let bad = answer(junk);
        assert_eq!(bad["ok"], false, "{bad}");
        assert!(
            bad["error"]
                .as_str()
                .unwrap()
                .starts_with("malformed request"),
            "{bad}"
        );
    }
    let good = answer(b"{\"version\":1,\"command\":\"ls\",\"tree\":false}\n");
    assert_eq!(good["ok"], true, "{good}");
}

#[test]
fn remove_refuses_open_devices_unless_forced() {
    let daemon = Daemon::start("remove");
    daemon.udm(&["create", "vol", "--table", "0 2048 zero"]);
    let mut client = RawClient::connect(&daemon.nbd_socket(), "vol");
    assert!(daemon
        .udm(&["info", "vol"])
        .contains("Open count:        1"));
    let err = daemon.udm_err(&["remove", "vol"]);
    assert!(err.contains("open by 1 client"), "{err}");
    daemon.udm(&["remove", "vol", "--force"]);
    // The client's I/O now fails instead of reaching the old table.
    client.send(0, NBD_CMD_READ, 1, 0, 512, &[]);
    let (error, cookie) = client.reply().unwrap();
    assert_eq!((error, cookie), (5, 1));
    assert_eq!(daemon.udm(&["ls"]), "No devices found");
}

#[test]
fn table_swaps_under_load_give_clients_no_error() {
    let daemon = Daemon::start("swap");
    let disk = daemon.dir.path("disk.img");
    sparse_file(&disk, 64 * MIB);
    let d = disk.to_str().unwrap();
    let one = format!("0 131072 linear {d} 0");
    let two = format!("0 65536 linear {d} 0\n65536 65536 linear {d} 65536");
    daemon.udm(&["create", "vol", "--table", &one]);
    let uri = format!("--uri={}", daemon.uri("vol"));
    let fio = std::process::Command::new("fio")
        .args([
            "--name=swap",
            "--ioengine=nbd",
            &uri,
            "--rw=randrw",
            "--bs=4k",
            "--iodepth=32",
            "--numjobs=2",
            "--size=32M",
            "--offset_increment=32M",
            "--verify=crc32c",
            "--verify_state_save=0",
            "--verify_fatal=1",
            "--time_based",
            "--runtime=6",
            "--verify_backlog=1024",
            "--output-format=json",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("fio");
    std::thread::sleep(Duration::from_millis(500));
    let mut swaps = 0;
    for i in 0..40 {
        daemon.udm(&["suspend", "vol"]);
        daemon.udm(&[
            "load",
            "vol",
            "--table",
            if i % 2 == 0 { &two } else { &one },
        ]);
        daemon.udm(&["resume", "vol"]);
        swaps += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = fio.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "fio failed during {swaps} swaps: {stdout}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&stdout[stdout.find('{').unwrap()..]).unwrap();
    for job in json["jobs"].as_array().unwrap() {
        assert_eq!(job["error"], 0, "{stdout}");
    }
    assert_eq!(daemon.udm(&["table", "vol"]), one);
}

#[test]
fn a_restarted_daemon_brings_every_device_back() {
    let mut daemon = Daemon::start("restart");
    let disk = daemon.dir.path("disk.img");
    sparse_file(&disk, 16 * MIB);
    let d = disk.to_str().unwrap();
    daemon.udm(&[
        "create",
        "base",
        "--table",
        &format!("0 32768 linear {d} 0"),
    ]);
    daemon.udm(&["create", "top", "--table", "0 16384 linear base 16384"]);
    daemon.udm(&["create", "ro", "--readonly", "--table", "0 8 zero"]);
    tool(
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0x77 0 1M", &daemon.uri("top")],
    );
    for signal in [libc::SIGTERM, libc::SIGKILL] {
        daemon.stop(signal);
        daemon.launch();
        assert_eq!(
            daemon.udm(&["ls"]),
            "base\t(32768 sectors)\nro\t(8 sectors)\ntop\t(16384 sectors)"
        );
        assert_eq!(daemon.udm(&["table", "top"]), "0 16384 linear base 16384");
        assert!(daemon.udm(&["info", "ro"]).contains("READ-ONLY"));
        tool(
            "qemu-io",
            &["-f", "raw", "-c", "read -P 0x77 0 1M", &daemon.uri("top")],
        );
    }
}

#[test]
fn abandoned_waits_leave_no_daemon_threads_behind() {
    let daemon = Daemon::start("wait-abandoned");
    daemon.udm(&["create", "z", "--table", "0 2048 zero"]);
    let tasks = format!("/proc/{}/task", daemon.pid());
    let threads = || std::fs::read_dir(&tasks).unwrap().count();
    // The `create` connection's thread ends once its client has gone.
    std::thread::sleep(Duration::from_millis(300));
    let baseline = threads();
    // Waits that no event will ever end: only their clients going away can.
    let mut waits: Vec<_> = (0..8)
        .map(|_| {
            std::process::Command::new(UDM)
                .args(["wait", "z", &u64::MAX.to_string()])
                .env("UDM_CONTROL", daemon.control())
                .spawn()
                .unwrap()
        })
        .collect();
    wait_for(
        || threads() >= baseline + 8,
        "the waits to reach the daemon",
    );
    for wait in &mut waits {
        wait.kill().unwrap();
        wait.wait().unwrap();
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while threads() > baseline {
        assert!(
            std::time::Instant::now() < deadline,
            "{} daemon threads 2 s after the waits' clients died (baseline {baseline})",
            threads()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    daemon.udm(&["info", "z"]);
}

/// `nbdinfo … && udm remove vol`: the client has hung up, but the server has not yet read the
/// hang-up when the remove arrives. Such a client must not make the remove fail with "open
/// by 1 client".
#[test]
fn remove_right_after_a_client_hangs_up_succeeds() {
    let daemon = Daemon::start("remove-after-hangup");
    let mut refused = Vec::new();
    for i in 0..100 {
        let created = daemon.control_request(serde_json::json!({
            "command": "create", "name": "vol", "table": "0 2048 zero",
        }));
        assert_eq!(created["ok"], true, "{created}");
        let mut client = RawClient::connect(&daemon.nbd_socket(), "vol");
        client.send(0, NBD_CMD_READ, 1, 0, 4096, &[]);
        let mut reply = [0u8; 16 + 4096];
        std::io::Read::read_exact(&mut client.stream, &mut reply).unwrap();
        client.send(0, NBD_CMD_DISC, 2, 0, 0, &[]);
        drop(client);
        let removed = daemon.control_request(serde_json::json!({
            "command": "remove", "name": "vol",
        }));
        if removed["ok"] != true {
            refused.push(format!("{i}: {}", removed["error"]));
            daemon.udm(&["remove", "vol", "--force"]);
        }
    }
    assert!(refused.is_empty(), "refused: {refused:?}");
}
