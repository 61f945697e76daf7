//! Snapshots keep their moment: under fio, four of one origin, a full COW, reloads without
//! suspend, an origin named another way.

use super::*;

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

#[test]
fn reloads_without_suspend_under_fio_and_an_origin_that_is_a_udm_device() {
    let daemon = Daemon::start("snap-reload");
    let (real, original) = patterned_with_copy(&daemon, "real.img", 32 * MIB, 5);
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
    let (file, original) = patterned_with_copy(&daemon, "file.img", 8 * MIB, 6);
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
        let cow = daemon.sparse(&format!("{name}.cow"), 8 * MIB);
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
