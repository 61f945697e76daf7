//! End to end: thin pools and thin volumes in a real daemon, driven by real clients (fio,
//! qemu-io, nbdcopy, nbdinfo), and checked against thin-provisioning-tools, which nobody
//! here wrote: thin_check on the metadata of every pool a test touches (after suspending the
//! pool, so everything is committed), thin_dump's mappings against what udm serves, thin_ls
//! against `udm thin ls`, and a pool made by thin_restore from XML served by udm.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

const KIB: u64 = 1024;
const MIB: u64 = 1 << 20;
/// 64 KiB data blocks (128 sectors), the tests' block size.
const BLOCK: u64 = 64 * KIB;

struct Pool {
    name: String,
    meta: PathBuf,
    data: PathBuf,
}

/// Creates a pool of `blocks` 64 KiB data blocks on fresh files (8 MiB of metadata) with
/// the features `features` (`<#features> <feature>*`, or "").
fn make_pool(daemon: &Daemon, name: &str, blocks: u64, features: &str) -> Pool {
    let meta = daemon.dir.path(&format!("{name}.meta"));
    let data = daemon.dir.path(&format!("{name}.data"));
    sparse_file(&meta, 8 * MIB);
    sparse_file(&data, blocks * BLOCK);
    let table = format!(
        "0 {} thin-pool {} {} 128 4 {features}",
        blocks * BLOCK / 512,
        meta.display(),
        data.display()
    );
    daemon.udm(&["create", name, "--table", &table]);
    Pool {
        name: name.to_string(),
        meta,
        data,
    }
}

/// Creates thin device `id` in the pool and a volume `name` of `size` bytes on it.
fn make_volume(daemon: &Daemon, pool: &Pool, name: &str, id: u32, size: u64) {
    daemon.udm(&["message", &pool.name, "0", "create_thin", &id.to_string()]);
    open_volume(daemon, pool, name, id, size);
}

fn open_volume(daemon: &Daemon, pool: &Pool, name: &str, id: u32, size: u64) {
    let table = format!("0 {} thin {} {id}", size / 512, pool.name);
    daemon.udm(&["create", name, "--table", &table]);
}

/// Takes a snapshot `id` of the thin device `origin` that volume `origin_volume` serves,
/// suspending the volume meanwhile as the kernel requires.
fn snapshot(daemon: &Daemon, pool: &Pool, origin_volume: &str, id: u32, origin: u32) {
    daemon.udm(&["suspend", origin_volume]);
    daemon.udm(&[
        "message",
        &pool.name,
        "0",
        "create_snap",
        &id.to_string(),
        &origin.to_string(),
    ]);
    daemon.udm(&["resume", origin_volume]);
}

fn qemu_io(daemon: &Daemon, device: &str, command: &str) -> std::process::Output {
    Command::new("qemu-io")
        .args(["-f", "raw", "-c", command, &daemon.uri(device)])
        .output()
        .expect("qemu-io")
}

/// Writes `len` bytes of `pattern` at `offset` with qemu-io.
fn fill(daemon: &Daemon, device: &str, pattern: u8, offset: u64, len: u64) {
    let out = qemu_io(
        daemon,
        device,
        &format!("write -P {pattern} {offset} {len}"),
    );
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && !text.contains("failed"),
        "qemu-io write to {device}: {text}\n{}",
        daemon.log()
    );
}

/// The whole device, read with nbdcopy.
fn contents(daemon: &Daemon, device: &str) -> Vec<u8> {
    let copy = daemon.dir.path(&format!("{device}.copy"));
    let _ = std::fs::remove_file(&copy);
    tool("nbdcopy", &[&daemon.uri(device), copy.to_str().unwrap()]);
    std::fs::read(copy).unwrap()
}

fn expect_bytes(data: &[u8], offset: u64, len: u64, byte: u8, what: &str) {
    let part = &data[offset as usize..(offset + len) as usize];
    if let Some(bad) = part.iter().position(|&b| b != byte) {
        panic!(
            "{what}: byte {} is {:#x}, expected {byte:#x}",
            offset + bad as u64,
            part[bad]
        );
    }
}

fn status(daemon: &Daemon, device: &str) -> String {
    daemon.udm(&["status", device])
}

fn pool_details(daemon: &Daemon, pool: &Pool) -> serde_json::Value {
    let json: serde_json::Value =
        serde_json::from_str(&daemon.udm(&["status", &pool.name, "--json"])).unwrap();
    json["targets"][0]["details"].clone()
}

/// The status line's used data blocks.
fn data_used(daemon: &Daemon, pool: &Pool) -> u64 {
    pool_details(daemon, pool)["data_blocks"]["used"]
        .as_u64()
        .unwrap()
}

/// Runs `f` while the pool (and the volumes on it) are suspended, so the metadata on disk is
/// committed and still: where thin_check, thin_dump and thin_ls look at it.
fn with_pool_still<T>(daemon: &Daemon, pool: &Pool, volumes: &[&str], f: impl FnOnce() -> T) -> T {
    for volume in volumes {
        daemon.udm(&["suspend", volume]);
    }
    daemon.udm(&["suspend", &pool.name]);
    let result = f();
    daemon.udm(&["resume", &pool.name]);
    for volume in volumes {
        daemon.udm(&["resume", volume]);
    }
    result
}

fn thin_check(meta: &Path) {
    let out = Command::new("thin_check")
        .arg(meta)
        .output()
        .expect("thin_check");
    assert!(
        out.status.success(),
        "thin_check {} failed:\n{}{}",
        meta.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The value of attribute `name` in one XML tag.
fn attribute(tag: &str, name: &str) -> u64 {
    let start = tag
        .find(&format!(" {name}=\""))
        .unwrap_or_else(|| panic!("no {name} in {tag}"))
        + name.len()
        + 3;
    let end = tag[start..].find('"').unwrap() + start;
    tag[start..end].parse().unwrap()
}

/// thin_dump's mappings: device id → (virtual block → data block), and the superblock.
struct Dump {
    transaction: u64,
    nr_data_blocks: u64,
    devices: BTreeMap<u32, BTreeMap<u64, u64>>,
}

fn thin_dump(meta: &Path) -> Dump {
    let xml = tool("thin_dump", &[meta.to_str().unwrap()]);
    let mut dump = Dump {
        transaction: 0,
        nr_data_blocks: 0,
        devices: BTreeMap::new(),
    };
    let mut device = None;
    for line in xml.lines().map(str::trim) {
        if line.starts_with("<superblock") {
            dump.transaction = attribute(line, "transaction");
            dump.nr_data_blocks = attribute(line, "nr_data_blocks");
        } else if line.starts_with("<device") {
            let id = attribute(line, "dev_id") as u32;
            dump.devices.insert(id, BTreeMap::new());
            device = Some(id);
        } else if line.starts_with("<range_mapping") {
            let (origin, data, len) = (
                attribute(line, "origin_begin"),
                attribute(line, "data_begin"),
                attribute(line, "length"),
            );
            let map = dump.devices.get_mut(&device.unwrap()).unwrap();
            map.extend((0..len).map(|i| (origin + i, data + i)));
        } else if line.starts_with("<single_mapping") {
            let map = dump.devices.get_mut(&device.unwrap()).unwrap();
            map.insert(
                attribute(line, "origin_block"),
                attribute(line, "data_block"),
            );
        }
    }
    dump
}

/// Virtual blocks a volume reports as data in NBD block status (`nbdinfo --map`).
fn mapped_blocks_of(daemon: &Daemon, volume: &str) -> Vec<u64> {
    let map = tool("nbdinfo", &["--map", &daemon.uri(volume)]);
    let mut blocks = Vec::new();
    for line in map.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (offset, len, kind): (u64, u64, u32) = (
            fields[0].parse().unwrap(),
            fields[1].parse().unwrap(),
            fields[2].parse().unwrap(),
        );
        if kind & 1 == 0 {
            assert!(offset % BLOCK == 0 && len % BLOCK == 0, "{map}");
            blocks.extend(offset / BLOCK..(offset + len) / BLOCK);
        }
    }
    blocks
}

#[test]
fn fio_and_qemu_io_on_a_thin_volume_verify_and_the_pool_checks_clean() {
    let daemon = Daemon::start("thin-fio");
    let pool = make_pool(&daemon, "pool", 1024, "");
    make_volume(&daemon, &pool, "vol", 1, 64 * MIB);
    let uri = format!("--uri={}", daemon.uri("vol"));
    let fio = |extra: &[&str]| {
        let mut args = vec![
            "--name=thin",
            "--ioengine=nbd",
            &uri,
            "--rw=randwrite",
            "--bsrange=4k-192k",
            "--iodepth=16",
            "--offset=4M",
            "--size=24M",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--randseed=11",
        ];
        args.extend_from_slice(extra);
        tool("fio", &args)
    };
    fio(&[]);
    fio(&["--verify_only"]);
    fill(&daemon, "vol", 0x5a, 40 * MIB + 4 * KIB, 8 * KIB);
    let data = contents(&daemon, "vol");
    expect_bytes(&data, 0, 4 * MIB, 0, "never written");
    expect_bytes(&data, 40 * MIB, 4 * KIB, 0, "zeroed part of a new block");
    expect_bytes(&data, 40 * MIB + 4 * KIB, 8 * KIB, 0x5a, "qemu-io's write");
    expect_bytes(
        &data,
        40 * MIB + 12 * KIB,
        BLOCK - 12 * KIB,
        0,
        "zeroed part of a new block",
    );
    // The thin status says what the pool says, and thin_check agrees once it is still.
    let used = data_used(&daemon, &pool);
    let line = status(&daemon, "vol");
    let mapped: u64 = line.split(' ').nth(3).unwrap().parse().unwrap();
    assert_eq!(mapped, used * 128, "{line}");
    with_pool_still(&daemon, &pool, &["vol"], || thin_check(&pool.meta));
    daemon.udm(&["remove", "vol"]);
    daemon.udm(&["remove", "pool"]);
    thin_check(&pool.meta);
}

#[test]
fn snapshots_keep_old_data_chain_and_delete_frees_exactly() {
    let daemon = Daemon::start("thin-snap");
    let pool = make_pool(&daemon, "pool", 256, "");
    make_volume(&daemon, &pool, "vol", 1, 4 * MIB);
    fill(&daemon, "vol", 0xa1, 0, 8 * BLOCK);
    assert_eq!(data_used(&daemon, &pool), 8);
    // The origin is live: a snapshot is refused until it is suspended.
    let err = daemon.udm_err(&["message", "pool", "0", "create_snap", "2", "1"]);
    assert!(err.contains("suspend it first"), "{err}");
    snapshot(&daemon, &pool, "vol", 2, 1);
    open_volume(&daemon, &pool, "snap", 2, 4 * MIB);
    assert_eq!(data_used(&daemon, &pool), 8, "a snapshot copies no data");
    // Overwrite half of the origin: partial writes copy, whole-block ones do not.
    fill(&daemon, "vol", 0xb2, 0, 3 * BLOCK);
    fill(&daemon, "vol", 0xb3, 3 * BLOCK + 4 * KIB, 4 * KIB);
    assert_eq!(data_used(&daemon, &pool), 12);
    let snap = contents(&daemon, "snap");
    expect_bytes(&snap, 0, 8 * BLOCK, 0xa1, "the snapshot");
    expect_bytes(
        &snap,
        8 * BLOCK,
        4 * MIB - 8 * BLOCK,
        0,
        "the snapshot's tail",
    );
    let vol = contents(&daemon, "vol");
    expect_bytes(&vol, 0, 3 * BLOCK, 0xb2, "the origin's new data");
    expect_bytes(&vol, 3 * BLOCK, 4 * KIB, 0xa1, "the origin's copied block");
    expect_bytes(
        &vol,
        3 * BLOCK + 4 * KIB,
        4 * KIB,
        0xb3,
        "the origin's partial write",
    );
    // A snapshot of the snapshot; then the snapshot changes and its snapshot does not.
    snapshot(&daemon, &pool, "snap", 3, 2);
    open_volume(&daemon, &pool, "snap2", 3, 4 * MIB);
    fill(&daemon, "snap", 0xc4, 7 * BLOCK, BLOCK);
    assert_eq!(data_used(&daemon, &pool), 13);
    expect_bytes(
        &contents(&daemon, "snap2"),
        0,
        8 * BLOCK,
        0xa1,
        "the snapshot's snapshot",
    );
    expect_bytes(
        &contents(&daemon, "snap"),
        7 * BLOCK,
        BLOCK,
        0xc4,
        "the snapshot's write",
    );

    // thin ls and status --json give the same numbers, and thin_ls agrees.
    let ls = daemon.udm(&["thin", "ls", "pool"]);
    let details = pool_details(&daemon, &pool);
    let ours: Vec<(u64, u64, u64, u64)> = details["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            let n = |k: &str| d[k].as_u64().unwrap();
            (
                n("id"),
                n("mapped_blocks"),
                n("exclusive_blocks"),
                n("shared_blocks"),
            )
        })
        .collect();
    // Device 1: 3 whole new blocks + 1 copied (exclusive), 4 shared with 2 and 3.
    // Device 2: 8 mapped, 7 shared (with 1 and 3), block 7 its own now.
    // Device 3: 8 mapped, every one shared (block 7 with device 1, the rest with 2).
    assert_eq!(
        ours,
        vec![(1, 8, 4, 4), (2, 8, 1, 7), (3, 8, 0, 8)],
        "{details}"
    );
    for (id, mapped, exclusive, shared) in &ours {
        let row = ls
            .lines()
            .find(|l| l.split_whitespace().next() == Some(&id.to_string()))
            .unwrap_or_else(|| panic!("no row for {id}:\n{ls}"));
        let fields: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(
            &fields[1..4],
            &[
                mapped.to_string(),
                exclusive.to_string(),
                shared.to_string()
            ],
            "{ls}"
        );
    }
    let volumes = ["vol", "snap", "snap2"];
    let (tools_ls, dump) = with_pool_still(&daemon, &pool, &volumes, || {
        thin_check(&pool.meta);
        (
            tool(
                "thin_ls",
                &[
                    "--no-headers",
                    "-o",
                    "DEV,MAPPED_BLOCKS,EXCLUSIVE_BLOCKS,SHARED_BLOCKS",
                    pool.meta.to_str().unwrap(),
                ],
            ),
            thin_dump(&pool.meta),
        )
    });
    let theirs: Vec<(u64, u64, u64, u64)> = tools_ls
        .lines()
        .map(|l| {
            let f: Vec<u64> = l.split_whitespace().map(|x| x.parse().unwrap()).collect();
            (f[0], f[1], f[2], f[3])
        })
        .collect();
    assert_eq!(ours, theirs, "udm thin ls against thin_ls");
    // thin_dump's mappings are what udm serves: the same blocks mapped, holding the bytes
    // the data file holds where thin_dump says they are.
    let data_file = std::fs::read(&pool.data).unwrap();
    for (volume, id) in [("vol", 1), ("snap", 2), ("snap2", 3)] {
        let mappings = &dump.devices[&id];
        assert_eq!(
            mapped_blocks_of(&daemon, volume),
            mappings.keys().copied().collect::<Vec<_>>(),
            "{volume}: block status against thin_dump"
        );
        let served = contents(&daemon, volume);
        for (vblock, data_block) in mappings {
            let v = (*vblock * BLOCK) as usize;
            let d = (*data_block * BLOCK) as usize;
            assert!(
                served[v..v + BLOCK as usize] == data_file[d..d + BLOCK as usize],
                "{volume}: block {vblock} is not data block {data_block}"
            );
        }
    }
    assert_eq!(dump.nr_data_blocks, 256);

    // Roll the origin back to the snapshot: the volume now maps device 2.
    daemon.udm(&["suspend", "vol"]);
    daemon.udm(&["remove", "snap"]);
    daemon.udm(&[
        "load",
        "vol",
        "--table",
        &format!("0 {} thin pool 2", 4 * MIB / 512),
    ]);
    daemon.udm(&["resume", "vol"]);
    daemon.udm(&["message", "pool", "0", "delete", "1"]);
    expect_bytes(
        &contents(&daemon, "vol"),
        7 * BLOCK,
        BLOCK,
        0xc4,
        "rolled back",
    );
    // Device 1's own 4 blocks are free; the rest are still held by 2 and 3.
    assert_eq!(data_used(&daemon, &pool), 9);
    daemon.udm(&["remove", "snap2"]);
    daemon.udm(&["message", "pool", "0", "delete", "3"]);
    assert_eq!(data_used(&daemon, &pool), 8);
    daemon.udm(&["remove", "vol"]);
    daemon.udm(&["message", "pool", "0", "delete", "2"]);
    assert_eq!(data_used(&daemon, &pool), 0);
    daemon.udm(&["remove", "pool"]);
    thin_check(&pool.meta);
}

#[test]
fn a_pool_made_by_thin_restore_serves_the_data_its_xml_maps() {
    let daemon = Daemon::start("thin-restore");
    let meta = daemon.dir.path("restored.meta");
    let data = daemon.dir.path("restored.data");
    sparse_file(&meta, 8 * MIB);
    // Data blocks 0..16, block n filled with byte 0x10 + n.
    let mut bytes = vec![0u8; (16 * BLOCK) as usize];
    for (n, block) in bytes.chunks_mut(BLOCK as usize).enumerate() {
        block.fill(0x10 + n as u8);
    }
    std::fs::write(&data, &bytes).unwrap();
    let xml = daemon.dir.path("pool.xml");
    std::fs::write(
        &xml,
        r#"<superblock uuid="" time="1" transaction="5" flags="0" version="2" data_block_size="128" nr_data_blocks="16">
  <device dev_id="1" mapped_blocks="3" transaction="0" creation_time="0" snap_time="1">
    <range_mapping origin_begin="0" data_begin="3" length="2" time="0"/>
    <single_mapping origin_block="10" data_block="7" time="0"/>
  </device>
  <device dev_id="4" mapped_blocks="1" transaction="0" creation_time="1" snap_time="1">
    <single_mapping origin_block="0" data_block="3" time="0"/>
  </device>
</superblock>
"#,
    )
    .unwrap();
    tool(
        "thin_restore",
        &["-i", xml.to_str().unwrap(), "-o", meta.to_str().unwrap()],
    );
    let table = format!(
        "0 {} thin-pool {} {} 128 0",
        16 * BLOCK / 512,
        meta.display(),
        data.display()
    );
    daemon.udm(&["create", "pool", "--table", &table]);
    daemon.udm(&[
        "create",
        "vol",
        "--table",
        &format!("0 {} thin pool 1", 16 * BLOCK / 512),
    ]);
    daemon.udm(&[
        "create",
        "snap",
        "--table",
        &format!("0 {} thin pool 4", 16 * BLOCK / 512),
    ]);
    let line = status(&daemon, "pool");
    assert!(line.starts_with("0 2048 thin-pool 5 "), "{line}");
    assert!(
        line.ends_with(" 3/16 - rw discard_passdown queue_if_no_space - 512"),
        "{line}"
    );
    let vol = contents(&daemon, "vol");
    expect_bytes(&vol, 0, BLOCK, 0x13, "block 0 → data block 3");
    expect_bytes(&vol, BLOCK, BLOCK, 0x14, "block 1 → data block 4");
    expect_bytes(&vol, 2 * BLOCK, 8 * BLOCK, 0, "unmapped");
    expect_bytes(&vol, 10 * BLOCK, BLOCK, 0x17, "block 10 → data block 7");
    expect_bytes(
        &contents(&daemon, "snap"),
        0,
        BLOCK,
        0x13,
        "device 4 shares block 3",
    );
    assert_eq!(status_line_of(&daemon, "vol"), "384 1407");
    // A write to the block device 4 shares breaks the sharing; device 4 keeps its data.
    fill(&daemon, "vol", 0xee, 4 * KIB, 4 * KIB);
    expect_bytes(
        &contents(&daemon, "snap"),
        0,
        BLOCK,
        0x13,
        "device 4 after the write",
    );
    let vol = contents(&daemon, "vol");
    expect_bytes(&vol, 0, 4 * KIB, 0x13, "copied");
    expect_bytes(&vol, 4 * KIB, 4 * KIB, 0xee, "written");
    daemon.udm(&["remove", "vol"]);
    daemon.udm(&["remove", "snap"]);
    daemon.udm(&["remove", "pool"]);
    thin_check(&meta);
}

fn status_line_of(daemon: &Daemon, device: &str) -> String {
    let line = status(daemon, device);
    line.splitn(4, ' ').nth(3).unwrap().to_string()
}

#[test]
fn out_of_space_queues_then_errors_and_growing_the_pool_by_reload_unblocks_it() {
    let daemon = Daemon::start_with("thin-nospace", &["--no-space-timeout", "2s"]);
    let pool = make_pool(&daemon, "pool", 4, "");
    make_volume(&daemon, &pool, "vol", 1, 4 * MIB);
    fill(&daemon, "vol", 1, 0, 4 * BLOCK);
    let events = daemon.udm(&["info", "pool", "--json"]);
    let events: serde_json::Value = serde_json::from_str(&events).unwrap();
    assert!(
        events["event_nr"].as_u64().unwrap() >= 1,
        "the low water mark raised an event"
    );
    // A fifth block waits, then fails with ENOSPC after the no-space timeout.
    let t = Instant::now();
    let out = qemu_io(&daemon, "vol", &format!("write -P 2 {} 4096", 4 * BLOCK));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("No space left on device"), "{text}");
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_millis(1900),
        "failed after {waited:?}"
    );
    let line = status(&daemon, "pool");
    assert!(
        line.contains(" 4/4 - out_of_data_space discard_passdown error_if_no_space - "),
        "{line}"
    );
    // Now writes that need space fail at once; writes to mapped blocks still work.
    let t = Instant::now();
    let out = qemu_io(&daemon, "vol", &format!("write -P 2 {} 4096", 5 * BLOCK));
    assert!(String::from_utf8_lossy(&out.stdout).contains("No space left"));
    assert!(t.elapsed() < Duration::from_secs(1));
    fill(&daemon, "vol", 3, 0, 4096);
    // A write queued while the pool is grown by reload completes.
    let uri = daemon.uri("vol");
    daemon.udm(&["suspend", "pool"]);
    let queued = std::thread::spawn(move || {
        Command::new("qemu-io")
            .args([
                "-f",
                "raw",
                "-c",
                &format!("write -P 7 {} {}", 6 * BLOCK, BLOCK),
                &uri,
            ])
            .output()
            .unwrap()
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !queued.is_finished(),
        "I/O waits while the pool is suspended"
    );
    std::fs::File::options()
        .write(true)
        .open(&pool.data)
        .unwrap()
        .set_len(16 * BLOCK)
        .unwrap();
    let table = format!(
        "0 {} thin-pool {} {} 128 4",
        16 * BLOCK / 512,
        pool.meta.display(),
        pool.data.display()
    );
    daemon.udm(&["load", "pool", "--table", &table]);
    daemon.udm(&["resume", "pool"]);
    let out = queued.join().unwrap();
    assert!(out.status.success() && !String::from_utf8_lossy(&out.stdout).contains("failed"));
    let line = status(&daemon, "pool");
    assert!(
        line.contains(" 5/16 - rw discard_passdown queue_if_no_space - "),
        "{line}"
    );
    fill(&daemon, "vol", 8, 4 * BLOCK, 4096);
    let vol = contents(&daemon, "vol");
    expect_bytes(&vol, 0, 4096, 3, "written while out of space");
    expect_bytes(&vol, 4 * BLOCK, 4096, 8, "after growing");
    expect_bytes(&vol, 6 * BLOCK, BLOCK, 7, "queued across the reload");
    with_pool_still(&daemon, &pool, &["vol"], || thin_check(&pool.meta));

    // error_if_no_space: fails at once.
    let strict = make_pool(&daemon, "strict", 2, "1 error_if_no_space");
    make_volume(&daemon, &strict, "svol", 1, MIB);
    fill(&daemon, "svol", 1, 0, 2 * BLOCK);
    let t = Instant::now();
    let out = qemu_io(&daemon, "svol", &format!("write -P 2 {} 4096", 2 * BLOCK));
    assert!(String::from_utf8_lossy(&out.stdout).contains("No space left"));
    assert!(t.elapsed() < Duration::from_secs(1));
    with_pool_still(&daemon, &strict, &["svol"], || thin_check(&strict.meta));
}

#[test]
fn pools_and_volumes_come_back_after_a_restart() {
    let mut daemon = Daemon::start("thin-restart");
    let pool = make_pool(&daemon, "pool", 64, "1 skip_block_zeroing");
    make_volume(&daemon, &pool, "vol", 1, 4 * MIB);
    fill(&daemon, "vol", 0x42, BLOCK, 2 * BLOCK);
    snapshot(&daemon, &pool, "vol", 2, 1);
    daemon.stop(libc::SIGTERM);
    thin_check(&pool.meta);
    daemon.launch();
    assert_eq!(
        daemon.udm(&["table", "pool"]),
        format!(
            "0 8192 thin-pool {} {} 128 4 1 skip_block_zeroing",
            pool.meta.display(),
            pool.data.display()
        )
    );
    expect_bytes(
        &contents(&daemon, "vol"),
        BLOCK,
        2 * BLOCK,
        0x42,
        "after restart",
    );
    open_volume(&daemon, &pool, "snap", 2, 4 * MIB);
    expect_bytes(
        &contents(&daemon, "snap"),
        BLOCK,
        2 * BLOCK,
        0x42,
        "the snapshot",
    );
    let ls = daemon.udm(&["thin", "ls", "pool"]);
    assert_eq!(ls.lines().count(), 3, "{ls}");
}

#[test]
fn attacks_on_the_pool_are_refused_and_leave_it_clean() {
    let daemon = Daemon::start("thin-attacks");
    let pool = make_pool(&daemon, "pool", 64, "");
    make_volume(&daemon, &pool, "vol", 1, 4 * MIB);
    fill(&daemon, "vol", 9, 0, BLOCK);
    // A second pool on the same metadata device, however it is named.
    let other = format!(
        "0 {} thin-pool {} {} 128 0",
        64 * BLOCK / 512,
        pool.meta.display(),
        daemon.dir.path("other.data").display()
    );
    sparse_file(&daemon.dir.path("other.data"), 64 * BLOCK);
    let err = daemon.udm_err(&["create", "pool2", "--table", &other]);
    assert!(err.contains("pool.meta"), "{err}");
    // A thin line with an unknown id, or on something that is not a pool.
    let err = daemon.udm_err(&["create", "bad", "--table", "0 8 thin pool 77"]);
    assert!(err.contains("thin device 77 does not exist"), "{err}");
    daemon.udm(&["create", "z", "--table", "0 8 zero"]);
    let err = daemon.udm_err(&["create", "bad", "--table", "0 8 thin z 1"]);
    assert!(err.contains("'z' is not a thin-pool device"), "{err}");
    // Hostile messages: one-line errors, nothing changes.
    let before = status(&daemon, "pool");
    for words in [
        &["create_thin", "1"][..],
        &["create_thin", "16777216"],
        &["create_thin", "-1"],
        &["create_snap", "2", "9"],
        &["delete", "1"],
        &["delete", "99"],
        &["set_transaction_id", "3", "4"],
        &["release_metadata_snap"],
        &["create_thin"],
        &["frobnicate", "x"],
    ] {
        let mut args = vec!["message", "pool", "0"];
        args.extend_from_slice(words);
        daemon.udm_err(&args);
    }
    assert_eq!(status(&daemon, "pool"), before);
    // Reloading the pool on other devices, or with another block size, is refused; a
    // reload without suspend keeps the pool and the volume's data.
    let err = daemon.udm_err(&["load", "pool", "--table", &other]);
    assert!(err.contains("cannot replace"), "{err}");
    let same = daemon.udm(&["table", "pool"]);
    let err = daemon.udm_err(&["load", "pool", "--table", &same.replace(" 128 ", " 256 ")]);
    assert!(err.contains("block size"), "{err}");
    daemon.udm(&["load", "pool", "--table", &same]);
    daemon.udm(&["resume", "pool"]);
    daemon.udm(&["load", "vol", "--table", &daemon.udm(&["table", "vol"])]);
    daemon.udm(&["resume", "vol"]);
    expect_bytes(
        &contents(&daemon, "vol"),
        0,
        BLOCK,
        9,
        "after reloads without suspend",
    );
    // The pool cannot be removed under its volume.
    let err = daemon.udm_err(&["remove", "pool"]);
    assert!(err.contains("used by vol"), "{err}");
    daemon.udm(&["remove", "vol"]);
    daemon.udm(&["remove", "pool"]);
    thin_check(&pool.meta);
}
