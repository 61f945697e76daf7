//! Tables as large as users write them: LVM-style maps of thousands of segments.

use super::*;

/// 4,000 `linear` lines on one file: the file is opened once for the table, as the kernel's
/// dm_get_device does (each line opened it again, two descriptors each, and 10,000 lines ran
/// the daemon out of descriptors), and a client maps the device line by line without the
/// daemon walking the rest of the table for every answer.
#[test]
fn a_table_of_thousands_of_segments_on_one_file_opens_it_once_and_serves_it() {
    let daemon = Daemon::start("many-segments");
    let disk = daemon.sparse("disk.img", 16 * MIB);
    let segments = 4000u64;
    let table: String = (0..segments)
        .map(|i| format!("{} 8 linear {} {}\n", i * 8, disk.display(), i * 8))
        .collect();
    let before = open_descriptors(daemon.pid());
    let table_file = daemon.dir.path("vol.table");
    std::fs::write(&table_file, table).unwrap();
    daemon.udm(&[
        "create",
        "vol",
        "--table-file",
        table_file.to_str().unwrap(),
    ]);
    let added = open_descriptors(daemon.pid()) - before;
    assert!(added < 16, "{added} descriptors for one file");

    let uri = daemon.uri("vol");
    qemu_io_ok(&uri, &["write -P 0x3c 4092k 8k", "flush"]);
    qemu_io_ok(&uri, &["read -P 0x3c 4092k 8k"]);
    let map = nbd_map(&uri);
    let mapped: u64 = map.iter().map(|e| e[1].parse::<u64>().unwrap()).sum();
    assert_eq!(mapped, segments * 4096, "{map:?}");
}

/// A table larger than one control request may be (4 MiB) is refused, and the user reads
/// why, not the EPIPE the daemon's early close gives the sender.
#[test]
fn a_table_larger_than_a_request_may_be_is_refused_saying_why() {
    let daemon = Daemon::start("huge-table");
    let table_file = daemon.dir.path("huge.table");
    let table: String = (0..400_000u64)
        .map(|i| format!("{} 8 zero\n", i * 8))
        .collect();
    std::fs::write(&table_file, table).unwrap();
    let err = daemon.udm_err(&[
        "create",
        "vol",
        "--table-file",
        table_file.to_str().unwrap(),
    ]);
    assert!(err.contains("request too long"), "{err}");
    assert!(daemon.udm(&["ls"]).contains("No devices found"));
}

/// The kernel's thin-provisioning walkthrough as its documentation writes it: devices named
/// by their `/dev/mapper/` nodes, in verbs and in tables, and messages quoted as one argument.
/// udm answered "device '/dev/mapper/pool' does not exist" and "cannot open <pool dev>
/// '/dev/mapper/pool'".
#[test]
fn mapper_nodes_name_udm_devices_in_verbs_and_tables() {
    let daemon = Daemon::start("mapper-nodes");
    let meta = daemon.sparse("meta.img", 16 * MIB);
    let data = daemon.sparse("data.img", 64 * MIB);
    let (meta, data) = (meta.display(), data.display());
    daemon.create(
        "pool",
        &format!("0 131072 thin-pool {meta} {data} 128 1024"),
    );
    daemon.udm(&["message", "/dev/mapper/pool", "0", "create_thin 0"]);
    daemon.create("thin", "0 65536 thin /dev/mapper/pool 0");
    daemon.udm(&["suspend", "/dev/mapper/thin"]);
    daemon.udm(&["message", "/dev/mapper/pool", "0", "create_snap 1 0"]);
    daemon.udm(&["resume", "/dev/mapper/thin"]);
    daemon.create("snap", "0 65536 thin /dev/mapper/pool 1");
    // Shown by name, as the kernel shows a device by its number, not the path it was given.
    assert_eq!(daemon.udm(&["table", "snap"]), "0 65536 thin pool 1");
    qemu_io_ok(
        &daemon.uri("snap"),
        &["write -P 7 0 64k", "read -P 7 0 64k"],
    );
    daemon.udm(&["remove", "/dev/mapper/snap"]);
    daemon.udm(&["message", "/dev/mapper/pool", "0", "delete 1"]);
    // A node that names no udm device is still a path that does not exist.
    let err = daemon.udm_err(&[
        "create",
        "x",
        "--table",
        "0 65536 thin /dev/mapper/nopool 0",
    ]);
    assert!(err.contains("'/dev/mapper/nopool'"), "{err}");
    let err = daemon.udm_err(&["info", "/dev/mapper/nothing"]);
    assert!(
        err.contains("'/dev/mapper/nothing' does not exist"),
        "{err}"
    );
}

/// dmsetup takes a table from a file named after the device or from standard input
/// (`echo TABLE | dmsetup create NAME`, the form of most scripts), and lists the devices with a
/// target of one type (`ls --target`). udm wanted --table or --table-file.
#[test]
fn tables_come_from_a_file_argument_or_standard_input_as_with_dmsetup() {
    use std::io::Write;
    let daemon = Daemon::start("table-stdin");
    let disk = daemon.sparse("disk.img", 4 * MIB);
    let piped = |args: &[&str], table: &str| {
        let mut child = std::process::Command::new(UDM)
            .args(args)
            .env("UDM_CONTROL", daemon.control())
            .stdin(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(table.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    };
    let line = format!("0 8192 linear {} 0\n", disk.display());
    assert!(piped(&["create", "piped"], &line).status.success());
    assert_eq!(daemon.udm(&["table", "piped"]), line.trim_end());
    assert!(piped(&["load", "piped"], "0 4096 zero").status.success());
    daemon.udm(&["resume", "piped"]);
    assert_eq!(daemon.udm(&["table", "piped"]), "0 4096 zero");
    let file = daemon.dir.path("named.table");
    std::fs::write(&file, &line).unwrap();
    daemon.udm(&["create", "named", file.to_str().unwrap()]);
    assert_eq!(
        daemon.udm(&["ls", "--target", "linear"]),
        "named\t(8192 sectors)"
    );
    // Nothing on standard input says so, in one line.
    let out = piped(&["create", "empty"], "");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no table on standard input"),
        "{err}"
    );
}
