//! The COW device on disk: the kernel's layout read independently, bad arguments, and
//! truncated or corrupt COW devices refused.

use super::*;

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
