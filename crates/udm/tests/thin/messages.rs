//! The pool's messages and modes against the kernel's dm-thin semantics: what each message
//! refuses and what the status line says after, needs_check, and crashes in the middle of
//! messages.

use super::*;

/// Sets the needs_check flag of the (unused) pool metadata in `meta` the way an operator
/// sees it happen, with thin-provisioning-tools: dumped, flagged, restored.
fn flag_needs_check(daemon: &Daemon, meta: &Path) {
    let xml = tool("thin_dump", &[meta.to_str().unwrap()]);
    assert!(xml.contains(" flags=\"0\" "), "{xml}");
    let flagged = daemon.dir.path("flagged.xml");
    std::fs::write(&flagged, xml.replacen(" flags=\"0\" ", " flags=\"1\" ", 1)).unwrap();
    tool(
        "thin_restore",
        &[
            "-i",
            flagged.to_str().unwrap(),
            "-o",
            meta.to_str().unwrap(),
        ],
    );
}

/// An NBD flush of `device`, sent whatever was written before (qemu-io skips it when
/// nothing was).
fn flush(daemon: &Daemon, device: &str) -> (bool, String) {
    nbdsh(&format!(
        "h.connect_uri('{}'); h.flush()",
        daemon.uri(device)
    ))
}

/// Metadata flagged needs_check (a metadata error sets it) used to be refused outright, so a
/// restart lost the pool and every volume on it until an offline repair. The kernel
/// activates such a pool read-only: its volumes read, writes to blocks already mapped go
/// on, nothing else changes, and the status says `ro … needs_check`.
#[test]
fn a_pool_flagged_needs_check_comes_back_read_only_with_its_volumes() {
    let mut daemon = Daemon::start("thin-needs-check");
    let pool = make_pool(&daemon, "pool", 64, "");
    make_volume(&daemon, &pool, "vol", 1, 4 * MIB);
    fill(&daemon, "vol", 0x5a, 0, 2 * BLOCK);
    daemon.stop(libc::SIGTERM);
    flag_needs_check(&daemon, &pool.meta);
    daemon.launch();

    let line = status_line_of(&daemon, "pool");
    assert!(
        line.ends_with(" 2/64 - ro discard_passdown queue_if_no_space needs_check 512"),
        "{line}\n{}",
        daemon.log()
    );
    expect_bytes(&contents(&daemon, "vol"), 0, 2 * BLOCK, 0x5a, "read-only");
    fill(&daemon, "vol", 0x6b, 0, 4096);
    let (ok, out) = qemu_io(
        &daemon.uri("vol"),
        &format!("write -P 1 {} 4096", 8 * BLOCK),
    );
    assert!(!ok && out.contains("Input/output error"), "{out}");
    let err = daemon.udm_err(&["message", "pool", "0", "create_thin", "2"]);
    assert!(err.contains("read-only"), "{err}");
    // Growing the data device waits for the repair too.
    resize(&pool.data, 128 * BLOCK);
    daemon.reload(
        "pool",
        &thin_pool_table(&pool.meta, &pool.data, 128 * BLOCK, "4"),
    );
    assert!(status_line_of(&daemon, "pool").contains(" 2/64 - ro "));

    // Taken down, checked and cleared, it is writable again with everything in it.
    daemon.udm(&["remove", "vol"]);
    daemon.udm(&["remove", "pool"]);
    tool(
        "thin_check",
        &["--clear-needs-check-flag", pool.meta.to_str().unwrap()],
    );
    daemon.create(
        "pool",
        &thin_pool_table(&pool.meta, &pool.data, 128 * BLOCK, "4"),
    );
    open_volume(&daemon, &pool, "vol", 1, 4 * MIB);
    let line = status_line_of(&daemon, "pool");
    assert!(
        line.contains(" 2/128 - rw ") && line.ends_with(" - 512"),
        "{line}"
    );
    let vol = contents(&daemon, "vol");
    expect_bytes(&vol, 0, 4096, 0x6b, "written while read-only");
    expect_bytes(&vol, 4096, 2 * BLOCK - 4096, 0x5a, "written before");
    fill(&daemon, "vol", 2, 8 * BLOCK, 4096);
    with_pool_still(&daemon, &pool, &["vol"], || thin_check(&pool.meta));
}

/// The metadata filling up in the middle of writes aborts the transaction, and with it the
/// mappings of writes acknowledged since the last commit. The next flush used to succeed,
/// telling the client those writes were durable when they were gone. As the kernel's
/// (aborted_with_changes), the device's flushes now fail for as long as its table is up.
#[test]
fn writes_lost_to_an_aborted_transaction_fail_the_flushes_after() {
    let daemon = Daemon::start("thin-lost-writes");
    // 512 KiB of metadata fills up long before 8 GiB of data blocks do.
    let size = 8 << 30;
    let pool = Pool {
        name: "pool".into(),
        meta: daemon.sparse("pool.meta", MIB / 2),
        data: daemon.sparse("pool.data", size),
    };
    let table = thin_pool_table(&pool.meta, &pool.data, size, "0 1 skip_block_zeroing");
    daemon.create("pool", &table);
    make_volume(&daemon, &pool, "vol", 1, size);
    // 4 KiB in every block, 32 at a time, until a write fails.
    let fio = std::process::Command::new("fio")
        .args([
            "--name=fill",
            "--ioengine=nbd",
            &format!("--uri={}", daemon.uri("vol")),
            "--rw=write:60k",
            "--bs=4k",
            "--iodepth=32",
            "--size=8g",
        ])
        .output()
        .unwrap();
    let out = udm_testkit::printed(&fio);
    assert!(
        !fio.status.success() && out.contains("Input/output error"),
        "{out}"
    );
    let line = status(&daemon, "pool");
    assert!(line.contains(" ro "), "{line}");
    for _ in 0..2 {
        let (ok, out) = flush(&daemon, "vol");
        assert!(!ok && out.contains("Input/output error"), "{out}");
    }
    assert!(
        daemon.log().contains("thin device(s) 1 lost the writes"),
        "{}",
        daemon.log()
    );
    // A new table of the device starts afresh (the pool is still read-only).
    daemon.udm(&["remove", "vol"]);
    open_volume(&daemon, &pool, "vol", 1, size);
    let (ok, out) = flush(&daemon, "vol");
    assert!(ok, "{out}");
    with_pool_still(&daemon, &pool, &["vol"], || thin_check(&pool.meta));
}
