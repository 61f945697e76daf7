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

/// The metadata filling up in the middle of writes used to fail the insert that found no
/// room, which aborted the transaction and dropped every write acknowledged since the last
/// commit (up to a second of them). As the kernel's, the pool now commits before it uses up
/// its room and goes read-only cleanly: the writes that fail were never acknowledged, and
/// every acknowledged one is still there, flushes succeeding.
#[test]
fn a_full_metadata_device_stops_the_pool_without_losing_acknowledged_writes() {
    let mut daemon = Daemon::start("thin-metadata-full");
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
    // 4 KiB at the start of every block, one at a time, until a write fails: every block
    // before that one holds an acknowledged write.
    let fio = std::process::Command::new("fio")
        .args([
            "--name=fill",
            "--ioengine=nbd",
            &format!("--uri={}", daemon.uri("vol")),
            "--rw=write:60k",
            "--bs=4k",
            "--iodepth=1",
            "--size=8g",
            "--buffer_pattern=0x5a",
        ])
        .output()
        .unwrap();
    let out = udm_testkit::printed(&fio);
    let failed_at: u64 = out
        .split("write offset=")
        .nth(1)
        .and_then(|rest| rest.split(',').next())
        .and_then(|offset| offset.parse().ok())
        .unwrap_or_else(|| panic!("no failed write: {out}"));
    let acknowledged = failed_at / BLOCK;
    assert!(acknowledged > 1000, "{out}");
    assert!(status(&daemon, "pool").contains(" ro "));
    let (ok, out) = flush(&daemon, "vol");
    assert!(ok, "{out}\n{}", daemon.log());
    let log = daemon.log();
    assert!(log.contains("the metadata device is full"), "{log}");
    assert!(!log.contains("lost the writes"), "{log}");
    let line = status_line_of(&daemon, "vol");
    let mapped: u64 = line.split(' ').next().unwrap().parse().unwrap();
    assert!(
        mapped * 512 / BLOCK >= acknowledged,
        "{line}: {acknowledged} written"
    );
    let (ok, out) = nbdsh(&format!(
        "h.connect_uri('{}')\nfor b in range({acknowledged}):\n    \
         assert h.pread(4096, b * 65536) == b'\\x5a' * 4096, b",
        daemon.uri("vol")
    ));
    assert!(ok, "block {out} lost");
    with_pool_still(&daemon, &pool, &["vol"], || thin_check(&pool.meta));
    // Back after a restart as full as it was: read-only at once.
    daemon.stop(libc::SIGTERM);
    daemon.launch();
    assert!(status(&daemon, "pool").contains(" ro "));
}

/// Writes slot `i % 256` (one per 64 KiB block of the first 16 MiB) with the value `i + 1`,
/// a flush after every 16 writes, recording in `flushed` how many writes the last
/// acknowledged flush covered; until the connection breaks.
const SLOT_WRITER: &str = "
import os
h.connect_uri(URI)
i = 0
try:
    while True:
        for _ in range(16):
            h.pwrite((i + 1).to_bytes(8, 'little') * 512, (i % 256) * 65536)
            i += 1
        h.flush()
        with open(FLUSHED + '.new', 'w') as f:
            f.write(str(i))
        os.rename(FLUSHED + '.new', FLUSHED)
except nbd.Error:
    pass
";

/// Checks the slots against `flushed`: each holds a value written to it, no older than the
/// last one a flush covered. Prints the number of slots checked.
const SLOT_CHECKER: &str = "
h.connect_uri(URI)
flushed = int(open(FLUSHED).read())
for s in range(256):
    data = h.pread(4096, s * 65536)
    v = int.from_bytes(data[:8], 'little')
    assert data == data[:8] * 512, f'slot {s} is torn'
    last = s + ((flushed - 1 - s) // 256) * 256 + 1 if flushed > s else 0
    assert v >= last and (v == 0 or (v - 1) % 256 == s), f'slot {s}: {v}, flushed {last}'
print('checked', flushed)
";

/// kill -9 in the middle of a create_snap/delete storm on the volume a client is writing
/// (and flushing): the metadata checks clean, and after the restart every flushed write is
/// there, and what fio wrote and flushed before still verifies.
#[test]
fn a_crash_in_a_create_snap_and_delete_storm_keeps_every_flushed_write() {
    let mut daemon = Daemon::start("thin-storm");
    let pool = make_pool(&daemon, "pool", 1024, "");
    make_volume(&daemon, &pool, "vol", 1, 32 * MIB);
    let fio_job = [
        "--name=seed",
        "--rw=write",
        "--bs=64k",
        "--offset=16m",
        "--size=16m",
    ];
    fio_verified(
        &daemon.uri("vol"),
        &[&fio_job[..], &["--end_fsync=1"]].concat(),
    );
    let flushed = daemon.dir.path("flushed");
    std::fs::write(&flushed, "0").unwrap();
    let prelude = format!(
        "URI = '{}'\nFLUSHED = '{}'\n",
        daemon.uri("vol"),
        flushed.display()
    );
    let script = |body: &str| format!("{prelude}{body}");
    let writer = {
        let script = script(SLOT_WRITER);
        std::thread::spawn(move || nbdsh(&script))
    };
    let flushes = || std::fs::read_to_string(&flushed).unwrap();
    for id in 2..12 {
        // Every round between two of the writer's flushes.
        let before = flushes();
        wait_for(|| flushes() != before, "a flush");
        snapshot(&daemon, &pool, "vol", id, 1);
        if id % 2 == 1 {
            daemon.udm(&["message", "pool", "0", "delete", &(id - 1).to_string()]);
        }
    }
    daemon.stop(libc::SIGKILL);
    let (_, out) = writer.join().unwrap();
    thin_check(&pool.meta);
    daemon.launch();
    let (ok, out2) = nbdsh(&script(SLOT_CHECKER));
    assert!(ok && out2.contains("checked"), "{out}\n{out2}");
    let ids: Vec<u32> = thin_dump(&pool.meta).devices.keys().copied().collect();
    let kept: Vec<u32> = [1].into_iter().chain((3..12).step_by(2)).collect();
    assert_eq!(ids, kept);
    fio_verified(
        &daemon.uri("vol"),
        &[&fio_job[..], &["--verify_only=1"]].concat(),
    );
}

/// `udm message pool 0 WORDS…`, which must succeed.
fn message(daemon: &Daemon, words: &str) -> String {
    let mut args = vec!["message", "pool", "0"];
    args.extend(words.split(' '));
    daemon.udm(&args)
}

/// `udm message pool 0 WORDS…`, which must fail; its error.
fn refused(daemon: &Daemon, words: &str) -> String {
    let mut args = vec!["message", "pool", "0"];
    args.extend(words.split(' '));
    daemon.udm_err(&args)
}

/// Checked against the kernel's, not a defect: each refused message says why in one line;
/// a metadata snapshot is what thin_dump -m
/// reads while the pool goes on (thin_check passes on the live metadata), a second reserve
/// and a second release are refused naming why, a wrong set_transaction_id names the
/// current id and changes nothing, and all of it survives a restart.
#[test]
fn a_metadata_snapshot_and_the_transaction_id_survive_restarts_and_read_in_thin_tools() {
    let mut daemon = Daemon::start("thin-metadata-snap");
    let pool = make_pool(&daemon, "pool", 64, "");
    make_volume(&daemon, &pool, "vol", 1, 4 * MIB);
    fill(&daemon, "vol", 1, 0, 2 * BLOCK);
    for (words, error) in [
        ("create_thin 1", "thin device 1 already exists"),
        (
            "create_thin 16777216",
            "invalid device id '16777216' (0 to 16777215)",
        ),
        ("create_snap 3 9", "thin device 9 does not exist"),
        ("create_snap 3 1", "origin thin device 1 is active as 'vol'"),
        ("delete 1", "thin device 1 is in use by vol"),
        ("delete 99", "thin device 99 does not exist"),
    ] {
        let err = refused(&daemon, words);
        assert!(
            err.contains(error) && err.lines().count() == 1,
            "{words}: {err}"
        );
    }
    message(&daemon, "create_thin 16777215");
    message(&daemon, "delete 16777215");
    message(&daemon, "set_transaction_id 0 7");
    let err = refused(&daemon, "set_transaction_id 0 8");
    assert!(err.contains("transaction id is 7, not 0"), "{err}");
    message(&daemon, "reserve_metadata_snap");
    let err = refused(&daemon, "reserve_metadata_snap");
    assert!(err.contains("already held"), "{err}");
    fill(&daemon, "vol", 2, 2 * BLOCK, 2 * BLOCK);
    let line = status_line_of(&daemon, "pool");
    let fields: Vec<&str> = line.split(' ').collect();
    assert_eq!((fields[0], fields[2]), ("7", "4/64"), "{line}");
    let held = fields[3].to_string();
    assert_ne!(held, "-", "{line}");
    // The live metadata checks clean, and -m shows the pool as it was at the reserve.
    thin_check(&pool.meta);
    let xml = tool("thin_dump", &["-m", pool.meta.to_str().unwrap()]);
    assert!(xml.contains(" mapped_blocks=\"2\" "), "{xml}");

    daemon.stop(libc::SIGTERM);
    thin_check(&pool.meta);
    daemon.launch();
    let line = status_line_of(&daemon, "pool");
    assert!(
        line.starts_with("7 ") && line.contains(&format!(" 4/64 {held} rw ")),
        "{line}"
    );
    message(&daemon, "release_metadata_snap");
    let err = refused(&daemon, "release_metadata_snap");
    assert!(err.contains("no metadata snapshot is held"), "{err}");
    assert!(status_line_of(&daemon, "pool").contains(" 4/64 - rw "));
    let vol = contents(&daemon, "vol");
    expect_bytes(&vol, 0, 2 * BLOCK, 1, "before the reserve");
    expect_bytes(&vol, 2 * BLOCK, 2 * BLOCK, 2, "after it");
    with_pool_still(&daemon, &pool, &["vol"], || thin_check(&pool.meta));
}
