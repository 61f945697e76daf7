//! End to end: classic snapshots in a real daemon, with fio, qemu-io, qemu-img and nbdcopy,
//! restarts and an independent reading of the COW devices udm writes.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;

const MIB: u64 = 1 << 20;

/// An origin file of `size` random bytes, the device `base` (`snapshot-origin` over it) and
/// a copy of the original bytes to compare snapshots with.
fn origin_of(daemon: &Daemon, size: u64) -> (PathBuf, PathBuf) {
    let origin = daemon.dir.path("origin.img");
    pattern_file(&origin, size as usize, 7);
    let original = daemon.dir.path("original.img");
    std::fs::copy(&origin, &original).unwrap();
    daemon.create(
        "base",
        &format!("0 {} snapshot-origin {}", size / 512, origin.display()),
    );
    (origin, original)
}

/// A snapshot device `name` of the origin on a fresh COW file of `cow_size` bytes.
fn snapshot(daemon: &Daemon, name: &str, origin: &Path, cow_size: u64, args: &str) -> PathBuf {
    let cow = daemon.dir.path(&format!("{name}.cow"));
    sparse_file(&cow, cow_size);
    let size = std::fs::metadata(origin).unwrap().len();
    daemon.create(
        name,
        &format!(
            "0 {} snapshot {} {} {args}",
            size / 512,
            origin.display(),
            cow.display()
        ),
    );
    cow
}

fn qemu_io(uri: &str, commands: &[impl AsRef<str>]) -> String {
    let mut args = vec!["-f", "raw"];
    for c in commands {
        args.extend(["-c", c.as_ref()]);
    }
    args.push(uri);
    let out = tool("qemu-io", &args);
    assert!(!out.contains("Pattern verification failed"), "{out}");
    assert!(!out.contains("failed:"), "{out}");
    out
}

/// qemu-io reads checking that a device of `mib` MiB holds `writes` (pattern, MiB, MiB)
/// made in order over zeroes, one read per run of a pattern.
fn reads_of(writes: &[(u8, usize, usize)], mib: usize) -> Vec<String> {
    let mut bytes = vec![0u8; mib];
    for &(byte, at, len) in writes {
        bytes[at..at + len].fill(byte);
    }
    let mut reads = Vec::new();
    let mut start = 0;
    for i in 1..=mib {
        if i == mib || bytes[i] != bytes[start] {
            reads.push(format!("read -P {} {start}M {}M", bytes[start], i - start));
            start = i;
        }
    }
    reads
}

fn status(daemon: &Daemon, name: &str) -> String {
    let line = daemon.udm(&["status", name]);
    line.splitn(4, ' ').nth(3).unwrap_or("").to_string()
}

/// Chunks a snapshot or merge holds (`status --json`).
fn exceptions(daemon: &Daemon, name: &str) -> u64 {
    let json: serde_json::Value =
        serde_json::from_str(&daemon.udm(&["status", name, "--json"])).unwrap();
    json["targets"][0]["details"]["exceptions"]
        .as_u64()
        .unwrap()
}

/// `<allocated>/<total> <metadata>` as numbers.
fn usage(status: &str) -> (u64, u64, u64) {
    let (used, metadata) = status
        .split_once(' ')
        .unwrap_or_else(|| panic!("not a usage status: {status}"));
    let (allocated, total) = used.split_once('/').unwrap();
    (
        allocated.parse().unwrap(),
        total.parse().unwrap(),
        metadata.parse().unwrap(),
    )
}

fn fio(uri: &str, extra: &[&str]) -> String {
    let uri = format!("--uri={uri}");
    let mut args = vec![
        "--name=verify",
        "--ioengine=nbd",
        uri.as_str(),
        "--rw=randwrite",
        "--bsrange=4k-64k",
        "--iodepth=16",
        "--verify=crc32c",
        "--verify_fatal=1",
        "--verify_state_save=0",
        "--randseed=11",
    ];
    args.extend_from_slice(extra);
    tool("fio", &args)
}

#[test]
fn fio_writes_the_origin_while_its_snapshot_keeps_the_point_in_time() {
    let daemon = Daemon::start("snap-fio");
    let (origin, original) = origin_of(&daemon, 64 * MIB);
    snapshot(&daemon, "snap", &origin, 64 * MIB, "P 8");
    fio(
        &daemon.uri("base"),
        &["--offset=8M", "--size=32M", "--numjobs=2"],
    );
    fio(
        &daemon.uri("base"),
        &["--offset=8M", "--size=32M", "--numjobs=2", "--verify_only"],
    );
    same_content(original.to_str().unwrap(), &daemon.uri("snap"));
    let (allocated, total, metadata) = usage(&status(&daemon, "snap"));
    assert_eq!(total, 64 * MIB / 512);
    assert!(allocated > metadata, "the origin writes saved chunks");
    // The snapshot is writable; its writes stay in it.
    qemu_io(
        &daemon.uri("snap"),
        &["write -P 0x5a 1M 64k", "write -P 0x5b 9M 3k", "flush"],
    );
    qemu_io(
        &daemon.uri("snap"),
        &["read -P 0x5a 1M 64k", "read -P 0x5b 9M 3k"],
    );
    let data = std::fs::read(&origin).unwrap();
    let first = std::fs::read(&original).unwrap();
    assert!(data[MIB as usize..MIB as usize + 65536] == first[MIB as usize..MIB as usize + 65536]);
}

#[test]
fn four_snapshots_of_one_origin_each_read_their_own_moment() {
    let daemon = Daemon::start("snap-four");
    let origin = daemon.sparse("origin.img", 16 * MIB);
    daemon.create(
        "base",
        &format!("0 32768 snapshot-origin {}", origin.display()),
    );
    let base = daemon.uri("base");
    // Each snapshot, its chunk size, then a write to the origin (pattern, MiB, MiB).
    let steps = [
        ("s0", 8, (0x11, 0, 4)),
        ("s1", 16, (0x22, 2, 4)),
        ("s2", 32, (0x33, 1, 1)),
        ("s3", 128, (0x44, 0, 8)),
    ];
    let writes: Vec<_> = steps.iter().map(|s| s.2).collect();
    for (name, chunk, (byte, at, len)) in steps {
        snapshot(&daemon, name, &origin, 32 * MIB, &format!("P {chunk}"));
        qemu_io(&base, &[&format!("write -P {byte} {at}M {len}M")]);
    }
    for (i, (name, _, _)) in steps.iter().enumerate() {
        qemu_io(&daemon.uri(name), &reads_of(&writes[..i], 16));
    }
    qemu_io(&base, &reads_of(&writes, 16));
    assert_eq!(
        daemon.udm(&["table", "s3"]),
        format!(
            "0 32768 snapshot {} {} P 128",
            origin.display(),
            daemon.dir.path("s3.cow").display()
        )
    );
    let tree = daemon.udm(&["ls", "--tree"]);
    assert!(tree.contains("s3"), "{tree}");
}

#[test]
fn a_full_cow_invalidates_with_an_event_and_the_origin_keeps_working() {
    let daemon = Daemon::start("snap-full");
    let (origin, _) = origin_of(&daemon, 16 * MIB);
    // Header, area and 14 data chunks of 4 KiB.
    snapshot(&daemon, "snap", &origin, 64 * 1024, "P 8");
    let before = daemon.event_nr("snap");
    qemu_io(&daemon.uri("base"), &["write -P 0x66 0 1M", "flush"]);
    assert_eq!(status(&daemon, "snap"), "Invalid");
    assert!(daemon.event_nr("snap") > before);
    let out = std::process::Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read 0 4k", &daemon.uri("snap")])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("Input/output error"), "{text}");
    qemu_io(
        &daemon.uri("base"),
        &[
            "write -P 0x67 2M 1M",
            "read -P 0x66 0 1M",
            "read -P 0x67 2M 1M",
        ],
    );
    // PO: writes to the snapshot overflow it, reads go on.
    let (origin2, _) = (daemon.dir.path("o2.img"), ());
    pattern_file(&origin2, 4 * MIB as usize, 3);
    snapshot(&daemon, "po", &origin2, 64 * 1024, "PO 8");
    let out = std::process::Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 1 0 1M", &daemon.uri("po")])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("Input/output error")
            || !out.status.success()
    );
    assert_eq!(status(&daemon, "po"), "Overflow");
    qemu_io(&daemon.uri("po"), &["read -P 1 0 56k"]);
}

/// Reads a COW device the way `docs/snapshot-metadata.md` describes it, without udm's code:
/// the header, then each area's records up to the zero terminator. Returns (chunk sectors,
/// records).
fn parse_cow(cow: &[u8]) -> (u64, Vec<(u64, u64)>) {
    let le32 = |at: usize| u32::from_le_bytes(cow[at..at + 4].try_into().unwrap()) as u64;
    let le64 = |at: usize| u64::from_le_bytes(cow[at..at + 8].try_into().unwrap());
    assert_eq!(&cow[0..4], b"SnAp", "magic");
    assert_eq!(le32(4), 1, "valid");
    assert_eq!(le32(8), 1, "version");
    let chunk_sectors = le32(12);
    let chunk = chunk_sectors as usize * 512;
    assert!(
        cow[16..chunk].iter().all(|&b| b == 0),
        "the rest of the header chunk is zero"
    );
    let per_area = chunk / 16;
    let mut records = Vec::new();
    for area in 0.. {
        let at = (1 + area * (per_area + 1)) * chunk;
        for i in 0..per_area {
            let (old, new) = (le64(at + i * 16), le64(at + i * 16 + 8));
            if new == 0 {
                return (chunk_sectors, records);
            }
            assert_ne!(new % (per_area as u64 + 1), 1, "data in a metadata chunk");
            records.push((old, new));
        }
    }
    unreachable!()
}

#[test]
fn the_cow_device_udm_writes_is_the_kernels_layout() {
    let daemon = Daemon::start("snap-layout");
    let (origin, original) = origin_of(&daemon, 8 * MIB);
    let cow = snapshot(&daemon, "snap", &origin, 8 * MIB, "P 8");
    // 700 chunks of 4 KiB saved: areas 0 and 1 full (256 records each), area 2 in use.
    for i in 0..700u64 {
        qemu_io(
            &daemon.uri("base"),
            &[&format!(
                "write -P 0x{:02x} {} 512",
                i % 250 + 1,
                i * 8192 + 1024
            )],
        );
    }
    let (allocated, _, metadata) = usage(&status(&daemon, "snap"));
    daemon.udm(&["remove", "snap"]);
    let image = std::fs::read(&cow).unwrap();
    let (chunk_sectors, records) = parse_cow(&image);
    assert_eq!(chunk_sectors, 8);
    assert_eq!(records.len(), 700);
    assert_eq!(metadata, 4 * 8, "header and areas 0 to 2");
    assert_eq!(
        allocated,
        (2 + 700 + 2) * 8,
        "header, 3 areas, 700 data chunks"
    );
    let first = std::fs::read(&original).unwrap();
    let mut olds: Vec<u64> = records.iter().map(|r| r.0).collect();
    olds.sort();
    assert_eq!(olds, (0..700).map(|i| i * 2).collect::<Vec<_>>());
    for (old, new) in records {
        let saved = &image[new as usize * 4096..new as usize * 4096 + 4096];
        let was = &first[old as usize * 4096..old as usize * 4096 + 4096];
        assert!(
            saved == was,
            "chunk {old} saved in {new} holds the origin's old data"
        );
    }
}

#[test]
fn a_merge_rolls_back_under_fio_and_resumes_after_kill_9() {
    let mut daemon = Daemon::start("snap-merge");
    let (origin, _) = origin_of(&daemon, 64 * MIB);
    let cow = snapshot(&daemon, "snap", &origin, 64 * MIB, "P 8");
    // Change 40 MiB of the origin; keep what the snapshot shows.
    fio(
        &daemon.uri("base"),
        &["--offset=0", "--size=40M", "--bs=4k", "--do_verify=0"],
    );
    let view = daemon.dir.path("view.img");
    tool("nbdcopy", &[&daemon.uri("snap"), view.to_str().unwrap()]);
    // The kernel's way (lvconvert --merge): suspend the snapshot device, load the merge in
    // the origin device's place (it takes the COW device over), resume, then drop the
    // snapshot device, whose I/O fails from the merge's resume on.
    daemon.udm(&["suspend", "snap"]);
    let merge_table = format!(
        "0 131072 snapshot-merge {} {} P 8",
        origin.display(),
        cow.display()
    );
    daemon.udm(&["load", "base", "--table", &merge_table]);
    daemon.udm(&["resume", "base"]);
    assert_eq!(status(&daemon, "snap"), "Invalid");
    daemon.udm(&["resume", "snap"]);
    let (read, said) = common::qemu_io(&daemon.uri("snap"), "read 0 4k");
    assert!(!read && said.contains("Input/output error"), "{said}");
    daemon.udm(&["remove", "snap"]);
    daemon.udm(&["message", "base", "0", "max_merge_rate", "4096"]);
    assert_eq!(daemon.udm(&["table", "base"]), merge_table);
    // At once the device reads as the snapshot did, while the merge copies in the
    // background and fio writes and verifies its own region.
    same_content(view.to_str().unwrap(), &daemon.uri("base"));
    fio(&daemon.uri("base"), &["--offset=48M", "--size=8M"]);
    let left = exceptions(&daemon, "base");
    assert!(left > 0, "still merging");
    daemon.stop(libc::SIGKILL);
    daemon.reap();
    daemon.launch();
    // (The allocated sectors of the status line are computed differently while merging and
    // after a load, as in the kernel; the count of chunks left is the plain measure.)
    let again = exceptions(&daemon, "base");
    assert!(
        again <= left && again > 0,
        "resumed mid-way: {again} left, {left} before"
    );
    daemon.udm(&["message", "base", "0", "max_merge_rate", "0"]);
    let before = daemon.event_nr("base");
    let out = daemon.udm(&["wait", "base", "--progress"]);
    assert!(out.ends_with("merge complete"), "{out}");
    assert!(daemon.event_nr("base") > before, "an event at completion");
    let (allocated, _, metadata) = usage(&status(&daemon, "base"));
    assert_eq!(allocated, metadata);
    fio(
        &daemon.uri("base"),
        &["--offset=48M", "--size=8M", "--verify_only"],
    );
    // Everything fio did not write during the merge is the snapshot's, on the origin file.
    let merged = std::fs::read(&origin).unwrap();
    let view = std::fs::read(&view).unwrap();
    assert!(merged[..48 * MIB as usize] == view[..48 * MIB as usize]);
    assert!(merged[56 * MIB as usize..] == view[56 * MIB as usize..]);
    // Done: back to snapshot-origin; the COW device is free again.
    daemon.udm(&["finalize", "base"]);
    assert!(daemon.udm(&["table", "base"]).contains("snapshot-origin"));
    std::fs::remove_file(&cow).unwrap();
}

#[test]
fn clear_errors_for_bad_chunk_sizes_small_cows_and_a_second_merge() {
    let daemon = Daemon::start("snap-errors");
    let (origin, _) = origin_of(&daemon, 8 * MIB);
    let cow = daemon.sparse("cow.img", 8 * MIB);
    // A table line of `target` over the origin with COW device `cow` and `args`.
    let line = |target: &str, cow: &Path, args: &str| {
        let (origin, cow) = (origin.display(), cow.display());
        format!("0 16384 {target} {origin} {cow} {args}")
    };
    let create_err =
        |name: &str, table: String| daemon.udm_err(&["create", name, "--table", &table]);
    for (args, expected) in [
        (
            "P 3",
            "chunk size 3 is not a power of two from 8 to 2048 sectors",
        ),
        ("P 4", "chunk size 4 is not a power of two from 8"),
        ("P 4096", "chunk size 4096"),
        ("P 9223372036854775808", "chunk size 9223372036854775808"),
        ("P abc", "invalid <chunk size> 'abc'"),
        ("Q 8", "expected P, PO or N"),
    ] {
        let err = create_err("bad", line("snapshot", &cow, args));
        assert!(err.contains(expected), "{args}: {err}");
    }
    let tiny = daemon.sparse("tiny.cow", 8192);
    let err = create_err("bad", line("snapshot", &tiny, "P 8"));
    assert!(err.contains("COW device too small"), "{err}");
    // A chunk size of 0 on a new COW device is the kernel's default, 32.
    daemon.create("snap", &line("snapshot", &cow, "P 0"));
    assert!(daemon.udm(&["table", "snap"]).ends_with(" P 32"));
    // A merge while another device serves the origin is refused, naming it.
    daemon.udm(&["remove", "snap"]);
    let err = create_err("m", line("snapshot-merge", &cow, "P 32"));
    assert!(err.contains("device 'base' serves origin"), "{err}");
    // Two merges into one origin: the second is refused.
    let other = daemon.sparse("other.cow", 8 * MIB);
    daemon.create("snap2", &line("snapshot", &other, "P 8"));
    daemon.udm(&["remove", "snap2"]);
    daemon.reload("base", &line("snapshot-merge", &cow, "P 32"));
    let err = create_err("m2", line("snapshot-merge", &other, "P 8"));
    assert!(err.contains("already being merged"), "{err}");
    // The COW device is the merge's alone.
    let err = create_err("s", line("snapshot", &cow, "P 32"));
    assert!(err.contains("base"), "{err}");
}

#[test]
fn truncated_and_corrupt_cow_devices_are_refused_and_nothing_is_written() {
    let daemon = Daemon::start("snap-corrupt");
    let (origin, _) = origin_of(&daemon, 8 * MIB);
    let cow = snapshot(&daemon, "snap", &origin, 8 * MIB, "P 8");
    qemu_io(&daemon.uri("base"), &["write -P 1 0 2M"]);
    daemon.udm(&["remove", "snap"]);
    let line = format!(
        "0 16384 snapshot {} {} P 8",
        origin.display(),
        cow.display()
    );
    let full = std::fs::read(&cow).unwrap();
    // Cut the device after the first area: its records point past the end.
    std::fs::write(&cow, &full[..3 * 4096]).unwrap();
    let err = daemon.udm_err(&["create", "snap", "--table", &line]);
    assert!(
        err.contains("past the end") && err.contains("truncated"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(&cow).unwrap(),
        &full[..3 * 4096],
        "refused, not rewritten"
    );
    // Not a COW device at all.
    let mut garbage = full.clone();
    garbage[..4].copy_from_slice(b"XFSB");
    std::fs::write(&cow, &garbage).unwrap();
    let err = daemon.udm_err(&["create", "snap", "--table", &line]);
    assert!(err.contains("not a snapshot COW device"), "{err}");
    // A version from the future, a hostile chunk size in the header.
    let mut future = full.clone();
    future[8] = 2;
    std::fs::write(&cow, &future).unwrap();
    let err = daemon.udm_err(&["create", "snap", "--table", &line]);
    assert!(err.contains("version 2"), "{err}");
    let mut huge = full.clone();
    huge[12..16].copy_from_slice(&0x8000_0000u32.to_le_bytes());
    std::fs::write(&cow, &huge).unwrap();
    let err = daemon.udm_err(&["create", "snap", "--table", &line]);
    assert!(err.contains("chunk size 2147483648"), "{err}");
    // Intact again, it loads, and the snapshot still shows the original data.
    std::fs::write(&cow, &full).unwrap();
    daemon.create("snap", &line);
    same_content(
        daemon.dir.path("original.img").to_str().unwrap(),
        &daemon.uri("snap"),
    );
}

#[test]
fn reloads_without_suspend_under_fio_and_an_origin_that_is_a_udm_device() {
    let daemon = Daemon::start("snap-reload");
    let real = daemon.dir.path("real.img");
    pattern_file(&real, 32 * MIB as usize, 5);
    let original = daemon.dir.path("original.img");
    std::fs::copy(&real, &original).unwrap();
    // The origin is itself a udm device.
    daemon.create("base-real", &format!("0 65536 linear {} 0", real.display()));
    daemon.create("base", "0 65536 snapshot-origin base-real");
    let cow = daemon.sparse("snap.cow", 32 * MIB);
    let snap_table = format!("0 65536 snapshot base-real {} P 16", cow.display());
    daemon.create("snap", &snap_table);
    std::thread::scope(|s| {
        let writer = s.spawn(|| fio(&daemon.uri("base"), &["--size=24M", "--numjobs=2"]));
        for _ in 0..5 {
            std::thread::sleep(Duration::from_millis(150));
            // dmsetup's habit: load + resume, no suspend.
            daemon.udm(&["load", "snap", "--table", &snap_table]);
            daemon.udm(&["resume", "snap"]);
            daemon.udm(&[
                "load",
                "base",
                "--table",
                "0 65536 snapshot-origin base-real",
            ]);
            daemon.udm(&["resume", "base"]);
        }
        writer.join().unwrap();
    });
    fio(
        &daemon.uri("base"),
        &["--size=24M", "--numjobs=2", "--verify_only"],
    );
    same_content(original.to_str().unwrap(), &daemon.uri("snap"));
    let tree = daemon.udm(&["ls", "--tree"]);
    assert!(tree.contains("base-real"), "{tree}");
}

/// A snapshot meets its origin by what it opens, not by how it names it (the kernel keys
/// origins by dev_t): the origin file named through a hard link, a symlink or a relative path
/// is one origin, so its chunks are saved before the origin's writes land.
#[test]
fn an_origin_named_another_way_is_still_one_origin() {
    let daemon = Daemon::start("snap-identity");
    let file = daemon.dir.path("file.img");
    pattern_file(&file, 8 * MIB as usize, 6);
    let original = daemon.dir.path("original.img");
    std::fs::copy(&file, &original).unwrap();
    let hard = daemon.dir.path("hard.img");
    std::fs::hard_link(&file, &hard).unwrap();
    let soft = daemon.dir.path("soft.img");
    std::os::unix::fs::symlink(&file, &soft).unwrap();
    daemon.udm(&[
        "create",
        "base",
        "--table",
        &format!("0 16384 snapshot-origin {}", file.display()),
    ]);
    for (name, origin) in [("hard", &hard), ("soft", &soft)] {
        let cow = daemon.dir.path(&format!("{name}.cow"));
        sparse_file(&cow, 8 * MIB);
        daemon.udm(&[
            "create",
            name,
            "--table",
            &format!(
                "0 16384 snapshot {} {} P 8",
                origin.display(),
                cow.display()
            ),
        ]);
    }
    qemu_io(&daemon.uri("base"), &["write -P 9 0 4M"]);
    same_content(original.to_str().unwrap(), &daemon.uri("hard"));
    same_content(original.to_str().unwrap(), &daemon.uri("soft"));
}

#[test]
fn snapshots_come_back_after_a_restart_and_a_transient_one_comes_back_invalid() {
    let mut daemon = Daemon::start("snap-restart");
    let (origin, original) = origin_of(&daemon, 16 * MIB);
    snapshot(&daemon, "snap", &origin, 16 * MIB, "P 8");
    snapshot(&daemon, "temp", &origin, 16 * MIB, "N 8");
    qemu_io(&daemon.uri("base"), &["write -P 9 1M 2M"]);
    same_content(original.to_str().unwrap(), &daemon.uri("temp"));
    daemon.stop(libc::SIGKILL);
    daemon.reap();
    daemon.launch();
    same_content(original.to_str().unwrap(), &daemon.uri("snap"));
    qemu_io(
        &daemon.uri("base"),
        &["read -P 9 1M 2M", "write -P 10 8M 1M"],
    );
    same_content(original.to_str().unwrap(), &daemon.uri("snap"));
    // A transient snapshot's exceptions were in memory: it is gone, and says so.
    assert_eq!(status(&daemon, "temp"), "Invalid");
}

/// A client that sends first writes and vanishes while their copy-outs wait on a slow COW
/// device (they wait as steps of their mappings, on no thread): the writes finish without
/// it, the origin device still suspends (nothing is left counted in flight), the snapshot
/// is exact and both devices go away cleanly.
#[test]
fn a_client_that_vanishes_while_its_first_writes_copy_out_leaves_nothing_behind() {
    let daemon = Daemon::start("snap-vanish");
    let (origin, original) = origin_of(&daemon, 8 * MIB);
    let cow = daemon.dir.path("snap.cow");
    sparse_file(&cow, 8 * MIB);
    daemon.udm(&[
        "create",
        "slowcow",
        "--table",
        &format!("0 16384 delay {} 0 100", cow.display()),
    ]);
    daemon.udm(&[
        "create",
        "snap",
        "--table",
        &format!("0 16384 snapshot {} slowcow P 8", origin.display()),
    ]);
    let mut client = RawClient::connect(&daemon.nbd_socket(), "base");
    let data = vec![0xabu8; 4096];
    for chunk in 0..64u64 {
        client.send(0, NBD_CMD_WRITE, chunk, chunk * 8 * 4096, 4096, &data);
    }
    drop(client);
    let t = std::time::Instant::now();
    daemon.udm(&["suspend", "base"]);
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    daemon.udm(&["resume", "base"]);
    same_content(original.to_str().unwrap(), &daemon.uri("snap"));
    daemon.udm(&["remove", "snap"]);
    daemon.udm(&["remove", "slowcow"]);
    daemon.udm(&["remove", "base"]);
    assert!(!daemon.log().contains("panic"), "{}", daemon.log());
}

/// kill -9 with many first writes in flight at once (fio, 4 jobs at depth 32, so hundreds of
/// copy-outs wait for commits as steps of their mappings): after the restart the snapshot
/// is the origin as it was, chunk for chunk: no origin write landed before its chunk was
/// committed into the snapshot.
#[test]
fn kill_9_with_hundreds_of_copy_outs_in_flight_keeps_the_snapshot_exact() {
    let mut daemon = Daemon::start("snap-kill-load");
    let (origin, original) = origin_of(&daemon, 64 * MIB);
    snapshot(&daemon, "snap", &origin, 64 * MIB, "P 8");
    for round in 0..3 {
        let uri = format!("--uri={}", daemon.uri("base"));
        let mut writer = std::process::Command::new("fio")
            .args([
                "--name=load",
                "--ioengine=nbd",
                &uri,
                "--rw=randwrite",
                "--bs=4k",
                "--iodepth=32",
                "--numjobs=4",
                "--time_based",
                "--runtime=30",
                "--norandommap",
                &format!("--randseed={round}"),
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(1500));
        daemon.stop(libc::SIGKILL);
        daemon.reap();
        let _ = writer.kill();
        let _ = writer.wait();
        daemon.launch();
        same_content(original.to_str().unwrap(), &daemon.uri("snap"));
    }
}
