//! End to end: thin pools and thin volumes in a real daemon, driven by real clients (fio,
//! qemu-io, nbdcopy, nbdinfo), and checked against thin-provisioning-tools, which nobody
//! here wrote: thin_check on the metadata of every pool a test touches (after suspending the
//! pool, so everything is committed), thin_dump's mappings against what udm serves, thin_ls
//! against `udm thin ls`, and a pool made by thin_restore from XML served by udm.

#[path = "../common/mod.rs"]
mod common;
mod messages;
mod pools;
mod volumes;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;

const KIB: u64 = 1024;
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
    let meta = daemon.sparse(&format!("{name}.meta"), 8 * MIB);
    let data = daemon.sparse(&format!("{name}.data"), blocks * BLOCK);
    let table = thin_pool_table(&meta, &data, blocks * BLOCK, &format!("4 {features}"));
    daemon.create(name, &table);
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
    daemon.create(name, &table);
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

/// Writes `len` bytes of `pattern` at `offset` with qemu-io.
fn fill(daemon: &Daemon, device: &str, pattern: u8, offset: u64, len: u64) {
    let command = format!("write -P {pattern} {offset} {len}");
    let (ok, out) = qemu_io(&daemon.uri(device), &command);
    assert!(ok, "qemu-io {command} on {device}: {out}\n{}", daemon.log());
}

/// A 4 KiB write at `offset` that must fail with ENOSPC; returns how long it took.
fn fails_for_space(daemon: &Daemon, device: &str, offset: u64) -> Duration {
    let started = Instant::now();
    let (ok, out) = qemu_io(&daemon.uri(device), &format!("write -P 2 {offset} 4096"));
    assert!(!ok && out.contains("No space left on device"), "{out}");
    started.elapsed()
}

/// Grows or shrinks a pool's file to `len` bytes.
fn resize(file: &Path, len: u64) {
    let file = std::fs::File::options().write(true).open(file).unwrap();
    file.set_len(len).unwrap();
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
    tool("thin_check", &[meta.to_str().unwrap()]);
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

/// A status line without its start, length and type.
fn status_line_of(daemon: &Daemon, device: &str) -> String {
    let line = status(daemon, device);
    line.splitn(4, ' ').nth(3).unwrap().to_string()
}
