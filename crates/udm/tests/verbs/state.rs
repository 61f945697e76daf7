//! What the verbs show and change: status and tables, live swaps under load, restarts,
//! listings in dmsetup's formats, renames, deferred removal, and the log line of each change.

use super::*;

#[test]
fn verbs_report_state_tables_and_status() {
    let daemon = Daemon::start("verbs");
    let disk = daemon.sparse("disk.img", 4 * MIB);
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
    // Quoted as one argument, as the kernel's documentation writes them (`dmsetup message
    // /dev/mapper/pool 0 "create_thin 0"`): dmsetup joins its arguments with spaces and the
    // kernel splits the message at whitespace. udm took "removebadblock 3" for one word.
    assert_eq!(
        daemon.udm(&["message", "vol", "4096", "removebadblock 3"]),
        "dust_remove_block: badblock removed at block 3"
    );
    daemon.udm(&["message", "vol", "4096", "addbadblock", " 3 "]);
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
    qemu_io_ok(&uri, &[&format!("read {} 512", 2 * MIB + 4 * 512)]);

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
fn table_swaps_under_load_give_clients_no_error() {
    let daemon = Daemon::start("swap");
    let disk = daemon.sparse("disk.img", 64 * MIB);
    let d = disk.to_str().unwrap();
    let one = format!("0 131072 linear {d} 0");
    let two = format!("0 65536 linear {d} 0\n65536 65536 linear {d} 65536");
    daemon.create("vol", &one);
    let fio = fio_verified_command(
        &daemon.uri("vol"),
        &[
            "--name=swap",
            "--rw=randrw",
            "--bs=4k",
            "--iodepth=32",
            "--numjobs=2",
            "--size=32M",
            "--offset_increment=32M",
            "--time_based",
            "--runtime=6",
            "--verify_backlog=1024",
            "--output-format=json",
        ],
    )
    .stdout(std::process::Stdio::piped())
    .spawn()
    .expect("fio");
    std::thread::sleep(Duration::from_millis(500));
    daemon.swap_tables("vol", &one, &two, 40, Duration::from_millis(50));
    let out = fio.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "fio failed during 40 swaps: {stdout}");
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
    let disk = daemon.sparse("disk.img", 16 * MIB);
    let d = disk.to_str().unwrap();
    daemon.create("base", &format!("0 32768 linear {d} 0"));
    daemon.create("top", "0 16384 linear base 16384");
    daemon.udm(&["create", "ro", "--readonly", "--table", "0 8 zero"]);
    qemu_io_ok(&daemon.uri("top"), &["write -P 0x77 0 1M"]);
    for signal in [libc::SIGTERM, libc::SIGKILL] {
        daemon.stop(signal);
        daemon.launch();
        assert_eq!(
            daemon.udm(&["ls"]),
            "base\t(32768 sectors)\nro\t(8 sectors)\ntop\t(16384 sectors)"
        );
        assert_eq!(daemon.udm(&["table", "top"]), "0 16384 linear base 16384");
        assert!(daemon.udm(&["info", "ro"]).contains("READ-ONLY"));
        qemu_io_ok(&daemon.uri("top"), &["read -P 0x77 0 1M"]);
    }
}

/// dmsetup's listings: without a name, every device, each line prefixed `NAME: `; `info -c`
/// columns; `deps`; `--target`, `--inactive`; `ls --json`; `version`.
/// The end of `listings_without_a_name_cover_every_device_in_dmsetups_formats`, with `vol`
/// all zero and `base` linear over `disk`: deps, ls (text and JSON) and version.
fn dependencies_ls_and_version(daemon: &Daemon, d: &str) {
    // `vol` is all zero now: it depends on nothing.
    assert_eq!(
        daemon.udm(&["deps"]),
        format!("base: 1 dependencies\t: ({d})\nvol: 0 dependencies\t:")
    );
    daemon.udm(&["load", "vol", "--table", "0 2048 linear base 0"]);
    daemon.udm(&["resume", "vol"]);
    assert_eq!(daemon.udm(&["deps", "vol"]), "1 dependencies\t: (base)");

    let ls: serde_json::Value = serde_json::from_str(&daemon.udm(&["ls", "--json"])).unwrap();
    assert_eq!(ls[1]["name"], "vol");
    assert_eq!(ls[1]["uuid"], "UDM-vol-1");
    assert_eq!(ls[1]["sectors"], 2048);
    assert_eq!(ls[1]["dependencies"][0], "base");
    assert_eq!(
        daemon.udm(&["ls"]),
        "base\t(2048 sectors)\nvol\t(2048 sectors)\tUDM-vol-1"
    );

    let version = daemon.udm(&["version"]);
    let lines: Vec<&str> = version.lines().collect();
    assert!(lines[0].starts_with("Library version:   udm "), "{version}");
    assert!(
        lines[1].starts_with("Driver version:    udm daemon "),
        "{version}"
    );
}

#[test]
fn listings_without_a_name_cover_every_device_in_dmsetups_formats() {
    let daemon = Daemon::start("listings");
    assert_eq!(daemon.udm(&["status"]), "No devices found");
    assert_eq!(daemon.udm(&["info"]), "No devices found");
    let disk = daemon.create_linear("base", "base.img", MIB);
    let d = disk.display();
    daemon.udm(&[
        "create",
        "vol",
        "--uuid",
        "UDM-vol-1",
        "--table",
        "0 1024 linear base 0\n1024 1024 dust base 1024 512",
    ]);
    assert_eq!(
        daemon.udm(&["table"]),
        format!(
            "base: 0 2048 linear {d} 0\nvol: 0 1024 linear base 0\nvol: 1024 1024 dust base 1024 512"
        )
    );
    assert_eq!(
        daemon.udm(&["status"]),
        "base: 0 2048 linear\nvol: 0 1024 linear\nvol: 1024 1024 dust base bypass verbose"
    );
    assert_eq!(
        daemon.udm(&["status", "--target", "dust"]),
        "vol: 1024 1024 dust base bypass verbose"
    );
    assert_eq!(
        daemon.udm(&["table", "vol", "--target", "linear"]),
        "0 1024 linear base 0"
    );
    // Blocks separated by a blank line; the UUID where it is set.
    let info = daemon.udm(&["info"]);
    let blocks: Vec<&str> = info.split("\n\n").collect();
    assert_eq!(blocks.len(), 2, "{info}");
    assert!(blocks[0].starts_with("Name:              base\n"), "{info}");
    assert!(blocks[1].contains("\nUUID: UDM-vol-1"), "{info}");
    assert!(blocks[1].contains("\nNumber of targets: 2\n"), "{info}");

    daemon.udm(&["load", "vol", "--table", "0 2048 zero"]);
    daemon.udm(&["suspend", "vol"]);
    assert_eq!(daemon.udm(&["table", "vol", "--inactive"]), "0 2048 zero");
    assert_eq!(daemon.udm(&["table", "base", "--inactive"]), "");
    assert_eq!(
        daemon.udm(&["info", "-c"]),
        "Name             Stat Open Targ Event  UUID\n\
         base             L--w    1    1      0\n\
         vol              LIsw    0    2      0 UDM-vol-1"
    );
    assert_eq!(
        daemon.udm(&["info", "-c", "--noheadings", "-o", "name,attr,open"]),
        "base:L--w:1\nvol:LIsw:0"
    );
    assert_eq!(
        daemon.udm(&[
            "info",
            "UDM-vol-1",
            "-c",
            "-o",
            "name,sectors",
            "--separator",
            ","
        ]),
        "Name,Sectors\nvol,2048"
    );
    let err = daemon.udm_err(&["info", "-c", "-o", "name,major"]);
    assert!(err.contains("field 'major'"), "{err}");
    daemon.udm(&["resume", "vol"]);

    dependencies_ls_and_version(&daemon, &d.to_string());
}

/// `rename` keeps the device (and its clients) and serves it under the new name; a UUID
/// names the device wherever a name does; read-only is a property of each loaded table.
#[test]
fn rename_uuids_and_read_only_loads() {
    let daemon = Daemon::start("rename");
    daemon.create_linear("vol", "vol.img", MIB);
    let mut client = RawClient::connect(&daemon.nbd_socket(), "vol");
    daemon.udm(&["rename", "vol", "data"]);
    let err = daemon.udm_err(&["info", "vol"]);
    assert!(err.contains("device 'vol' does not exist"), "{err}");
    // The connected client goes on; new clients find the new name.
    client.send(0, NBD_CMD_READ, 1, 0, 512, &[]);
    let mut reply = [0u8; 16 + 512];
    std::io::Read::read_exact(&mut client.stream, &mut reply).unwrap();
    tool("nbdinfo", &["--size", &daemon.uri("data")]);
    drop(client);

    daemon.udm(&["rename", "data", "--setuuid", "UDM-data"]);
    let err = daemon.udm_err(&["rename", "data", "--setuuid", "UDM-other"]);
    assert!(err.contains("has UUID UDM-data already"), "{err}");
    for verb in [
        &["info", "UDM-data"][..],
        &["table", "UDM-data"],
        &["status", "UDM-data"],
    ] {
        daemon.udm(verb);
    }
    assert!(daemon
        .udm(&["info", "UDM-data"])
        .starts_with("Name:              data\n"));
    let err = daemon.udm_err(&["create", "UDM-data", "--table", "0 8 zero"]);
    assert!(err.contains("already exists"), "{err}");

    // A table loaded --readonly makes the device read-only once live, and back.
    let table = daemon.udm(&["table", "data"]);
    daemon.udm(&["reload", "UDM-data", "--readonly", "--table", &table]);
    daemon.udm(&["resume", "data"]);
    assert!(daemon.udm(&["info", "data"]).contains("ACTIVE (READ-ONLY)"));
    assert!(tool("nbdinfo", &[&daemon.uri("data")]).contains("is_read_only: true"));
    daemon.udm(&["load", "data", "--table", &table]);
    daemon.udm(&["resume", "data"]);
    assert!(!daemon.udm(&["info", "data"]).contains("READ-ONLY"));
    qemu_io_ok(&daemon.uri("data"), &["write 0 4k"]);

    // A device others are built on keeps its name: their tables name it.
    daemon.create("top", "0 8 linear data 0");
    let err = daemon.udm_err(&["rename", "data", "base"]);
    assert!(err.contains("used by top"), "{err}");

    // All of it survives a restart.
    let mut daemon = daemon;
    daemon.crash_and_restart();
    assert_eq!(
        daemon.udm(&["ls"]),
        "data\t(2048 sectors)\tUDM-data\ntop\t(8 sectors)"
    );
}

/// `remove --deferred` removes a device once its last client and the last device on it let
/// go; `@cancel_deferred_remove` takes it back; `remove_all` removes from the top down.
#[test]
fn deferred_removal_and_remove_all() {
    let mut daemon = Daemon::start("deferred");
    daemon.create("vol", "0 2048 zero");
    // Not in use: removed at once.
    daemon.udm(&["remove", "--deferred", "vol"]);
    assert_eq!(daemon.udm(&["ls"]), "No devices found");

    daemon.create("vol", "0 2048 zero");
    let client = RawClient::connect(&daemon.nbd_socket(), "vol");
    let said = daemon.udm(&["remove", "--deferred", "vol"]);
    assert!(said.contains("will be removed once unused"), "{said}");
    assert!(daemon.udm(&["info", "vol"]).contains("(DEFERRED REMOVE)"));
    daemon.udm(&["message", "vol", "0", "@cancel_deferred_remove"]);
    assert!(!daemon.udm(&["info", "vol"]).contains("DEFERRED"));
    daemon.udm(&["remove", "--deferred", "vol"]);
    std::thread::sleep(Duration::from_millis(500));
    assert!(daemon.udm(&["ls"]).starts_with("vol"), "removed while open");
    drop(client);
    wait_for(
        || daemon.udm(&["ls"]) == "No devices found",
        "the deferred removal",
    );

    // Asked while in use, then the daemon restarts: nothing uses it any more, so it goes.
    daemon.create("vol", "0 2048 zero");
    let client = RawClient::connect(&daemon.nbd_socket(), "vol");
    daemon.udm(&["remove", "--deferred", "vol"]);
    daemon.stop(libc::SIGKILL);
    drop(client);
    daemon.launch();
    wait_for(
        || daemon.udm(&["ls"]) == "No devices found",
        "the deferred removal after the restart",
    );

    // remove_all: tops first; an open device (and what it is built on) stays unless --force.
    daemon.create("base", "0 2048 zero");
    daemon.create("mid", "0 2048 linear base 0");
    daemon.create("top", "0 2048 linear mid 0");
    daemon.create("other", "0 2048 zero");
    let _client = RawClient::connect(&daemon.nbd_socket(), "mid");
    let err = daemon.udm_err(&["remove_all"]);
    assert!(
        err.contains("removed 2 device(s)")
            && err.contains("device 'mid' is busy: open by 1 client(s)")
            && err.contains("device 'base' is used by mid"),
        "{err}"
    );
    assert_eq!(
        daemon.udm(&["ls"]),
        "base\t(2048 sectors)\nmid\t(2048 sectors)"
    );
    daemon.udm(&["remove-all", "--force"]);
    assert_eq!(daemon.udm(&["ls"]), "No devices found");
}

/// The daemon's log lets an operator reconstruct what happened: one line per change, each a
/// whole line of the logger's, naming the device.
#[test]
fn every_change_is_one_line_in_the_log() {
    let mut daemon = Daemon::start("log-lines");
    let disk = daemon.create_linear("base", "base.img", MIB);
    daemon.create("bad", "0 2048 dust base 0 512");
    daemon.udm(&["message", "bad", "0", "addbadblock", "1"]);
    daemon.udm(&["load", "bad", "--table", "0 1024 zero"]);
    daemon.udm(&["suspend", "bad"]);
    daemon.udm(&["resume", "bad"]);
    daemon.udm(&["rename", "bad", "good"]);
    let _client = RawClient::connect(&daemon.nbd_socket(), "good");
    daemon.udm(&["remove", "--force", "good"]);
    daemon.stop(libc::SIGTERM);
    daemon.launch();
    let log = daemon.log();
    let pid_prefix = |line: &str| line.starts_with("udm[") && line.contains("]: ");
    for line in log.lines() {
        assert!(pid_prefix(line), "a line split in two: {line:?}\n{log}");
    }
    for expected in [
        "created device 'base' (2048 sectors: linear)".to_string(),
        "created device 'bad' (2048 sectors: dust)".into(),
        "device 'bad': message to sector 0: addbadblock 1".into(),
        "device 'bad': inactive table loaded (1024 sectors: zero); resume makes it live".into(),
        "device 'bad': suspended (in-flight I/O drained in ".into(),
        "device 'bad': resumed with its new table live (1024 sectors: zero)".into(),
        "renamed device 'bad' to 'good'".into(),
        "removed device 'good' by force: 1 client(s) had it open and their I/O now fails".into(),
        "restored device 'base' (2048 sectors: linear)".into(),
        "restored 1 device(s)".into(),
    ] {
        assert_eq!(log.matches(&expected).count(), 1, "{expected}\n{log}");
    }
    drop(disk);
}
