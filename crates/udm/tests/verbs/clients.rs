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
