//! End to end with real NBD clients: nbdinfo, qemu-img, qemu-io, nbdcopy and fio against a
//! real daemon.

mod common;

use common::*;

fn linear_over_file(tag: &str, size: u64) -> (Daemon, std::path::PathBuf) {
    let daemon = Daemon::start(tag);
    let disk = daemon.create_linear("vol", "disk.img", size);
    (daemon, disk)
}

#[test]
fn nbdinfo_sees_size_flags_block_sizes_list_and_map() {
    let (daemon, _) = linear_over_file("nbdinfo", 64 * MIB);
    daemon.udm(&["create", "ro", "--readonly", "--table", "0 2048 zero"]);
    let info = tool("nbdinfo", &["--json", &daemon.uri("vol")]);
    let json: serde_json::Value = serde_json::from_str(&info).unwrap();
    let export = &json["exports"][0];
    assert_eq!(export["export-size"], 64 * MIB);
    assert_eq!(export["is_read_only"], false);
    for flag in [
        "can_flush",
        "can_fua",
        "can_trim",
        "can_zero",
        "can_fast_zero",
        "can_multi_conn",
        "can_cache",
    ] {
        assert_eq!(export[flag], true, "{flag} in {info}");
    }
    assert_eq!(export["block_size_minimum"], 512);
    assert_eq!(export["block_size_preferred"], 4096);
    assert_eq!(export["block_size_maximum"], 32 * MIB);

    let ro: serde_json::Value =
        serde_json::from_str(&tool("nbdinfo", &["--json", &daemon.uri("ro")])).unwrap();
    assert_eq!(ro["exports"][0]["is_read_only"], true);

    let list = tool("nbdinfo", &["--list", "--json", &daemon.uri("")]);
    let list: serde_json::Value = serde_json::from_str(&list).unwrap();
    let mut names: Vec<_> = list["exports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["export-name"].as_str().unwrap().to_string())
        .collect();
    names.sort();
    assert_eq!(names, ["ro", "vol"]);

    // Write 1 MiB at 8 MiB; the map shows it as data and the rest as holes.
    qemu_io_ok(&daemon.uri("vol"), &["write -P 0x5a 8M 1M"]);
    let map = nbd_map(&daemon.uri("vol"));
    assert!(map.contains(&extent(8 * MIB, MIB, "0", "data")), "{map:?}");
    let leading_hole = map.iter().any(|r| r[0] == "0" && r[3] == "hole,zero");
    assert!(leading_hole, "{map:?}");

    assert!(tool("nbdinfo", &["--map", &daemon.uri("ro")]).contains("hole,zero"));
}

#[test]
fn unknown_export_is_refused_cleanly() {
    let (daemon, _) = linear_over_file("unknown", 4 * MIB);
    let out = std::process::Command::new("nbdinfo")
        .arg(daemon.uri("nosuch"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("nosuch"), "{err}");
}

#[test]
fn qemu_img_convert_in_and_out_and_compare() {
    let (daemon, _) = linear_over_file("qemu-img", 32 * MIB);
    let source = daemon.dir.path("source.raw");
    pattern_file(&source, 32 * MIB as usize, 11);
    let src = source.to_str().unwrap();
    qemu_img_copy(src, &daemon.uri("vol"));
    same_content(src, &daemon.uri("vol"));
    let back = daemon.dir.path("back.qcow2");
    qemu_img_convert(&daemon.uri("vol"), "qcow2", &back);
    tool(
        "qemu-img",
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "qcow2",
            src,
            back.to_str().unwrap(),
        ],
    );
    let info = tool(
        "qemu-img",
        &["info", "--output=json", "-f", "raw", &daemon.uri("vol")],
    );
    assert!(
        info.contains(&format!("\"virtual-size\": {}", 32 * MIB)),
        "{info}"
    );
}

#[test]
fn qemu_io_write_zeroes_discard_fua_and_flush() {
    let (daemon, disk) = linear_over_file("qemu-io", 16 * MIB);
    let uri = daemon.uri("vol");
    qemu_io_ok(&uri, &["write -P 0x11 0 4M", "flush"]);
    qemu_io_ok(
        &uri,
        &["write -z 1M 1M", "discard 2M 1M", "write -f -P 0x22 3M 64k"],
    );
    let out = qemu_io_ok(
        &uri,
        &[
            "read -P 0x11 0 1M",
            "read -P 0 1M 1M",
            "read -P 0x22 3M 64k",
        ],
    );
    assert!(!out.contains("Pattern verification failed"), "{out}");
    // Zeroing and discard reached the file as holes.
    let data = std::fs::read(&disk).unwrap();
    assert!(data[MIB as usize..2 * MIB as usize].iter().all(|&b| b == 0));
    assert!(data[..MIB as usize].iter().all(|&b| b == 0x11));
}

#[test]
fn nbdcopy_in_and_out_with_multi_conn() {
    let (daemon, _) = linear_over_file("nbdcopy", 64 * MIB);
    let source = daemon.dir.path("source.raw");
    pattern_file(&source, 48 * MIB as usize, 3);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&source)
        .unwrap()
        .set_len(64 * MIB)
        .unwrap();
    tool(
        "nbdcopy",
        &[
            "--connections=4",
            source.to_str().unwrap(),
            &daemon.uri("vol"),
        ],
    );
    let back = daemon.dir.path("back.raw");
    tool(
        "nbdcopy",
        &[
            "--connections=4",
            &daemon.uri("vol"),
            back.to_str().unwrap(),
        ],
    );
    assert!(std::fs::read(&source).unwrap() == std::fs::read(&back).unwrap());
}

#[test]
fn fio_verify_with_several_jobs_and_deep_queues() {
    let (daemon, _) = linear_over_file("fio", 64 * MIB);
    let uri = daemon.uri("vol");
    let out = fio_verified(
        &uri,
        &[
            "--name=verify",
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=32",
            "--numjobs=4",
            "--size=16M",
            "--offset_increment=16M",
            "--group_reporting",
            "--output-format=json",
        ],
    );
    let json: serde_json::Value = serde_json::from_str(&out[out.find('{').unwrap()..]).unwrap();
    assert_eq!(json["jobs"][0]["error"], 0, "{out}");
    assert!(json["jobs"][0]["write"]["io_bytes"].as_u64().unwrap() >= 64 * MIB);
    assert!(json["jobs"][0]["read"]["io_bytes"].as_u64().unwrap() >= 64 * MIB);
    // Mixed sizes, including requests larger than the preferred block size.
    fio_verified(
        &uri,
        &[
            "--name=mixed",
            "--rw=randrw",
            "--bsrange=4k-1m",
            "--iodepth=16",
            "--size=64M",
        ],
    );
}

#[test]
fn a_stack_of_targets_serves_data_where_the_table_says() {
    let daemon = Daemon::start("stack");
    let a = daemon.sparse("a.img", 8 * MIB);
    let b = daemon.sparse("b.img", 8 * MIB);
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    daemon.create("stripes", &format!("0 16384 striped 2 128 {a} 0 {b} 0"));
    daemon.create("top", "0 8192 linear stripes 8192\n8192 8192 zero");
    qemu_io_ok(&daemon.uri("top"), &["write -P 0x33 0 128k"]);
    // top's first 64 KiB chunk lands on stripe device a at 2 MiB (chunk 64 of the stripe set).
    let a_data = std::fs::read(a).unwrap();
    assert!(a_data[2 * MIB as usize..2 * MIB as usize + 65536]
        .iter()
        .all(|&x| x == 0x33));
    let b_data = std::fs::read(b).unwrap();
    assert!(b_data[2 * MIB as usize..2 * MIB as usize + 65536]
        .iter()
        .all(|&x| x == 0x33));
    let tree = daemon.udm(&["ls", "--tree"]);
    assert!(tree.starts_with("top\n └─stripes\n"), "{tree}");
    assert!(tree.contains(a), "{tree}");
}
