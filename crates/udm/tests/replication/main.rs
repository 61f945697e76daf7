//! End to end: replicating thin snapshots between two real daemons (`udm send` / `udm
//! receive`), on two "hosts" (network namespaces made by the test) joined by a veth link; the
//! source volume an ext4 filesystem changed by debugfs through the daemon's FUSE export. The
//! judges are nobody's code here: `qemu-img compare` (byte for byte), `e2fsck -fn` and
//! `thin_check`.

mod bases;
#[path = "../common/mod.rs"]
mod common;
mod delta;
mod hosts;
mod listener;
mod streams;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::*;
use serde_json::Value;
use udm_testkit::run_ok;

/// The replicated volume (the size).
const VOLUME: u64 = 1 << 30;
/// The receiving host's address and replication port.
const B_ADDRESS: &str = "10.78.0.2";
const B_PORT: u16 = 10900;

struct Pool {
    meta: PathBuf,
    /// Its table, to make it again.
    table: String,
}

/// A pool "pool" of 2 GiB of 64 KiB blocks on fresh files in the daemon's directory.
fn make_pool(daemon: &Daemon) -> Pool {
    let meta = daemon.sparse("pool.meta", 16 * MIB);
    daemon.sparse("pool.data", 2 * VOLUME);
    let table = pool_table(daemon, "");
    daemon.udm(&["create", "pool", "--table", &table]);
    Pool { meta, table }
}

/// The table of `daemon`'s pool (see [`make_pool`]), followed by the feature arguments
/// `features` ("1 read_only"; "" for none).
fn pool_table(daemon: &Daemon, features: &str) -> String {
    let table = format!(
        "0 {} thin-pool {} {} 128 0 {features}",
        2 * VOLUME / 512,
        daemon.dir.path("pool.meta").display(),
        daemon.dir.path("pool.data").display()
    );
    table.trim_end().to_string()
}

/// Snapshot `id` of thin device 1 (served as `vol`), suspended meanwhile.
fn snapshot(daemon: &Daemon, id: u32) {
    daemon.udm(&["suspend", "vol"]);
    daemon.udm(&["message", "pool", "0", "create_snap", &id.to_string(), "1"]);
    daemon.udm(&["resume", "vol"]);
}

/// Runs `f` with thin device `id` of the pool served read-only as device `name`.
fn with_thin<T>(daemon: &Daemon, name: &str, id: u32, f: impl FnOnce() -> T) -> T {
    let table = format!("0 {} thin pool {id}", VOLUME / 512);
    daemon.udm(&["create", name, "--readonly", "--table", &table]);
    let out = f();
    daemon.udm(&["remove", name]);
    out
}

/// Thin device `id` of `a`'s pool equals `b`'s, byte for byte.
fn same_snapshot(a: &Daemon, b: &Daemon, id: u32) {
    with_thin(a, "check-a", id, || {
        with_thin(b, "check-b", id, || {
            same_content(&a.uri("check-a"), &b.uri("check-b"))
        })
    });
}

/// `e2fsck -fn` of thin device `id` (copied out through NBD, sparse).
fn fsck(daemon: &Daemon, id: u32) {
    let image = daemon.dir.path("fsck.img");
    with_thin(daemon, "fsck", id, || {
        qemu_img_convert(&daemon.uri("fsck"), "raw", &image)
    });
    tool("e2fsck", &["-fn", image.to_str().unwrap()]);
    std::fs::remove_file(image).unwrap();
}

/// `thin_check` of the pool's committed metadata (suspended meanwhile).
fn thin_check(daemon: &Daemon, pool: &Pool) {
    daemon.udm(&["suspend", "pool"]);
    tool("thin_check", &[pool.meta.to_str().unwrap()]);
    daemon.udm(&["resume", "pool"]);
}

/// What a pool holds, as `udm thin ls --json` says, without who uses what, and without the
/// time of each device's last snapshot: a receive that was refused made a snapshot of its
/// base and deleted it again, which moves that on (as any snapshot does; docs/replication-stream.md).
fn devices(daemon: &Daemon) -> Value {
    let mut details: Value =
        serde_json::from_str(&daemon.udm(&["thin", "ls", "pool", "--json"])).unwrap();
    for d in details["devices"].as_array_mut().unwrap() {
        let d = d.as_object_mut().unwrap();
        d.remove("used_by");
        d.remove("snapshotted_time");
    }
    details["devices"].clone()
}

/// A `udm` verb run in network namespace `ns` (to reach the other host), against `daemon`.
fn udm_in(ns: &Netns, daemon: &Daemon, args: &[&str]) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns.name(), UDM])
        .args(args)
        .env("UDM_CONTROL", daemon.control());
    c
}

fn succeeded(out: Output, what: &str) -> Value {
    assert!(
        out.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
}

fn send_to_file(daemon: &Daemon, id: u32, from: Option<u32>, file: &Path) {
    let id = id.to_string();
    let from = from.map(|f| f.to_string());
    let mut args = vec!["send", "pool", &id];
    if let Some(from) = &from {
        args.extend(["--from", from]);
    }
    run_ok(
        Command::new(UDM)
            .args(&args)
            .env("UDM_CONTROL", daemon.control())
            .stdout(std::fs::File::create(file).unwrap()),
    );
}

/// `udm receive POOL ID --json ARGS…` into `daemon`, started: its stdin takes the stream.
fn spawn_receive(daemon: &Daemon, id: u32, args: &[&str]) -> std::process::Child {
    Command::new(UDM)
        .args(["receive", "pool", &id.to_string(), "--json"])
        .args(args)
        .env("UDM_CONTROL", daemon.control())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// `udm receive POOL ID ARGS…` of `stream` into `daemon`.
fn receive(daemon: &Daemon, id: u32, stream: &[u8], args: &[&str]) -> Output {
    let mut child = spawn_receive(daemon, id, args);
    // The daemon may refuse before it has read everything: a broken pipe is its answer.
    let _ = child.stdin.take().unwrap().write_all(stream);
    child.wait_with_output().unwrap()
}

/// The byte offsets where the records of `stream` start, and where it ends.
fn record_starts(stream: &[u8]) -> Vec<usize> {
    let mut at = u32::from_le_bytes(stream[12..16].try_into().unwrap()) as usize;
    let mut starts = Vec::new();
    while at < stream.len() {
        starts.push(at);
        let len = u32::from_le_bytes(stream[at + 4..at + 8].try_into().unwrap()) as usize;
        at += 28 + if stream[at] == 1 { len } else { 0 };
    }
    starts.push(at);
    starts
}

/// The receiving daemon's replication state of the pool.
fn state(daemon: &Daemon) -> Value {
    let file = daemon.dir.path("state/replication/pool.json");
    std::fs::read(file).map_or(Value::Null, |b| serde_json::from_slice(&b).unwrap())
}

/// The records of the stream into thin device `id` the receiver has made durable so far.
fn kept_records(daemon: &Daemon, id: u32) -> u64 {
    state(daemon)["partial"][id.to_string()]["next_record"]
        .as_u64()
        .unwrap_or(0)
}

/// Two daemons on this host with a pool each; A's thin device 1 is `vol`.
/// Snapshots 2 and 3 of `a`'s volume, each taken after a qemu-io command (`first`, then
/// `then`), and 2 received whole by `b`; returns the stream of 3 from 2, not yet received.
fn base_received_and_increment(a: &Daemon, b: &Daemon, first: &str, then: &str) -> Vec<u8> {
    qemu_io_ok(&a.uri("vol"), &[first]);
    snapshot(a, 2);
    qemu_io_ok(&a.uri("vol"), &[then]);
    snapshot(a, 3);
    send_to_file(a, 2, None, &a.dir.path("full"));
    send_to_file(a, 3, Some(2), &a.dir.path("inc"));
    succeeded(
        receive(b, 2, &std::fs::read(a.dir.path("full")).unwrap(), &[]),
        "full receive",
    );
    std::fs::read(a.dir.path("inc")).unwrap()
}

/// [`base_received_and_increment`], then the first half of the increment received into 3
/// with `--resume`: cut, and kept with durable progress. Returns the whole increment.
fn increment_half_received(a: &Daemon, b: &Daemon, first: &str, then: &str) -> Vec<u8> {
    let inc = base_received_and_increment(a, b, first, then);
    let cut = receive(b, 3, &inc[..inc.len() / 2], &["--resume"]);
    assert!(!cut.status.success());
    assert!(kept_records(b, 3) > 0, "{}", state(b));
    inc
}

/// Writes into thin device `id` of `daemon`'s pool with the qemu-io command `write` through
/// a writable table, removed after: writes that no table shows any more.
fn written_through_a_table(daemon: &Daemon, id: u32, write: &str) {
    let table = format!("0 {} thin pool {id}", VOLUME / 512);
    daemon.udm(&["create", "writer", "--table", &table]);
    qemu_io_ok(&daemon.uri("writer"), &[write]);
    daemon.udm(&["remove", "writer"]);
}

/// Snapshot 2 of `a`'s volume, taken after the qemu-io command `write`; returns its full
/// stream.
fn first_snapshot_stream(a: &Daemon, write: &str) -> Vec<u8> {
    qemu_io_ok(&a.uri("vol"), &[write]);
    snapshot(a, 2);
    send_to_file(a, 2, None, &a.dir.path("full"));
    std::fs::read(a.dir.path("full")).unwrap()
}

fn two_daemons(tag: &str) -> (Daemon, Daemon, Pool) {
    let a = Daemon::start(&format!("repl-{tag}-a"));
    let mut b = Daemon::start(&format!("repl-{tag}-b"));
    make_pool(&a);
    let b_pool = make_pool(&b);
    a.udm(&["message", "pool", "0", "create_thin", "1"]);
    let table = format!("0 {} thin pool 1", VOLUME / 512);
    a.udm(&["create", "vol", "--table", &table]);
    b.set_env("UDM_LOG", "debug");
    (a, b, b_pool)
}
