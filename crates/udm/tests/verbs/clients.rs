//! Devices and their clients: removing open devices, abandoned waits, a client that just
//! hung up.

use super::*;

#[test]
fn remove_refuses_open_devices_unless_forced() {
    let daemon = Daemon::start("remove");
    daemon.create("vol", "0 2048 zero");
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

/// A forced removal flushes the table that took the client's writes, not the error table
/// swapped in to fail the client's further I/O: the log-writes log ends with the flush, and
/// the daemon logs no failed flush.
#[test]
fn a_forced_remove_flushes_the_table_the_writes_went_to() {
    let daemon = Daemon::start("remove-force-flush");
    let (data, log) = (daemon.sparse("data", MIB), daemon.sparse("log", 4 * MIB));
    daemon.create(
        "vol",
        &format!("0 2048 log-writes {} {}", data.display(), log.display()),
    );
    let mut client = RawClient::connect(&daemon.nbd_socket(), "vol");
    client.send(0, NBD_CMD_WRITE, 1, 0, 4096, &[0x5a; 4096]);
    assert_eq!(client.reply().unwrap(), (0, 1));
    daemon.udm(&["remove", "vol", "--force"]);
    let replay = daemon.replay_log(&log, &daemon.sparse("replay", MIB), &[]);
    let said = String::from_utf8_lossy(&replay.stdout);
    assert!(said.contains("replayed 2 entries"), "{said}");
    assert!(!daemon.log().contains("flushing"), "{}", daemon.log());
}

#[test]
fn abandoned_waits_leave_no_daemon_threads_behind() {
    let daemon = Daemon::start("wait-abandoned");
    daemon.create("z", "0 2048 zero");
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

/// Every control slot taken by a client that connects and says nothing: each is let go
/// within the daemon's request timeout (10 s, with a one-line answer saying why), and the
/// operator's `udm ls` works again. A request sent in many small writes is still answered,
/// and a `udm wait` that outlasts the timeout is not cut off.
#[test]
fn silent_control_connections_do_not_lock_the_operator_out() {
    use std::io::{BufRead, BufReader, Write};
    use std::os::unix::net::UnixStream;
    const TIMEOUT: Duration = Duration::from_secs(10);
    let daemon = Daemon::start("control-silent");
    daemon.create("z", "0 2048 zero");
    let tasks = format!("/proc/{}/task", daemon.pid());
    let threads = || std::fs::read_dir(&tasks).unwrap().count();
    std::thread::sleep(Duration::from_millis(300));
    let baseline = threads();
    let waiter = std::process::Command::new(UDM)
        .args(["wait", "z", &u64::MAX.to_string()])
        .env("UDM_CONTROL", daemon.control())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(|| threads() > baseline, "the wait to reach the daemon");
    // 256 is the daemon's limit; the `wait` holds one slot, the silent ones the rest.
    let silent: Vec<UnixStream> = (0..255)
        .map(|_| UnixStream::connect(daemon.control()).unwrap())
        .collect();
    let start = std::time::Instant::now();
    let busy = daemon.run_udm(&["ls"]);
    assert!(
        String::from_utf8_lossy(&busy.stderr).contains("busy"),
        "{busy:?}"
    );
    // A request in 40 writes, 50 ms apart, on a connection that got its slot in between.
    let slow = loop {
        let s = UnixStream::connect(daemon.control()).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let mut probe = [0u8; 1];
        if std::io::Read::read(&mut &s, &mut probe).is_err() {
            break s; // no refusal answered: served
        }
        assert!(start.elapsed() < TIMEOUT * 2, "no slot came free");
        std::thread::sleep(Duration::from_millis(100));
    };
    slow.set_read_timeout(Some(TIMEOUT)).unwrap();
    for piece in br#"{"version":1,"command":"ls","tree":false}"#.chunks(1) {
        (&slow).write_all(piece).unwrap();
        std::thread::sleep(Duration::from_millis(50));
    }
    (&slow).write_all(b"\n").unwrap();
    let mut answer = String::new();
    BufReader::new(&slow).read_line(&mut answer).unwrap();
    assert!(answer.contains("\"ok\":true"), "{answer}");
    assert!(start.elapsed() < TIMEOUT + Duration::from_secs(5));
    assert!(daemon.run_udm(&["ls"]).status.success());
    // The silent ones heard why.
    let mut why = String::new();
    BufReader::new(&silent[0]).read_line(&mut why).unwrap();
    assert!(why.contains("no complete request within 10 s"), "{why}");
    // The wait, older than the timeout, still waits: it ends when its device goes.
    std::thread::sleep(TIMEOUT.saturating_sub(start.elapsed()) + Duration::from_secs(1));
    daemon.udm(&["remove", "z"]);
    let out = waiter.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("no complete request"), "{err}");
    assert!(err.contains("z"), "{err}");
}
