//! End to end: classic snapshots in a real daemon, with fio, qemu-io, qemu-img and nbdcopy,
//! restarts and an independent reading of the COW devices udm writes.

#[path = "../common/mod.rs"]
mod common;
mod cow_layout;
mod crashes;
mod point_in_time;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;

const MIB: u64 = 1 << 20;

/// A file `name` of `size` bytes of pattern `seed`, and original.img, a copy of them to
/// compare snapshots with.
fn patterned_with_copy(daemon: &Daemon, name: &str, size: u64, seed: u64) -> (PathBuf, PathBuf) {
    let file = daemon.dir.path(name);
    pattern_file(&file, size as usize, seed);
    let original = daemon.dir.path("original.img");
    std::fs::copy(&file, &original).unwrap();
    (file, original)
}

/// An origin file of `size` random bytes, the device `base` (`snapshot-origin` over it) and
/// a copy of the original bytes to compare snapshots with.
fn origin_of(daemon: &Daemon, size: u64) -> (PathBuf, PathBuf) {
    let (origin, original) = patterned_with_copy(daemon, "origin.img", size, 7);
    daemon.create(
        "base",
        &format!("0 {} snapshot-origin {}", size / 512, origin.display()),
    );
    (origin, original)
}

/// A snapshot device `name` of the origin on a fresh COW file of `cow_size` bytes.
fn snapshot(daemon: &Daemon, name: &str, origin: &Path, cow_size: u64, args: &str) -> PathBuf {
    let cow = daemon.sparse(&format!("{name}.cow"), cow_size);
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

/// The `snapshot-merge` table of the origin file `origin` with the COW device `cow`, over
/// all of the origin.
fn merge_table(origin: &Path, cow: &Path) -> String {
    let size = std::fs::metadata(origin).unwrap().len();
    format!(
        "0 {} snapshot-merge {} {} P 8",
        size / 512,
        origin.display(),
        cow.display()
    )
}

/// `base` over an origin of `size` bytes, a snapshot device `snap` of it, then pattern 5
/// written over the first `changed` bytes of `base`: (origin file, its original bytes,
/// the snapshot's COW file).
fn changed_since_snapshot(daemon: &Daemon, size: u64, changed: u64) -> (PathBuf, PathBuf, PathBuf) {
    let (origin, original) = origin_of(daemon, size);
    let cow = snapshot(daemon, "snap", &origin, size + 8 * MIB, "P 8");
    qemu_io(&daemon.uri("base"), &[format!("write -P 5 0 {changed}")]);
    (origin, original, cow)
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
