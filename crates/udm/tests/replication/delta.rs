//! `udm thin delta` and the `udm:delta:ID` NBD context against thin_delta on a metadata
//! snapshot of the live pool.

use std::collections::BTreeMap;

use super::*;

/// Blocks by kind, from `BEGIN LENGTH KIND` lines or thin_delta's XML.
fn blocks_of(runs: impl Iterator<Item = (u64, u64, String)>) -> BTreeMap<u64, String> {
    let mut map = BTreeMap::new();
    for (begin, length, kind) in runs.filter(|(_, _, kind)| kind != "same") {
        for block in begin..begin + length {
            map.insert(block, kind.clone());
        }
    }
    map
}

/// The blocks `udm thin delta` lists as changed from snapshot `from` to `to`.
fn udm_delta(daemon: &Daemon, from: u32, to: u32) -> BTreeMap<u64, String> {
    let printed = daemon.udm(&["thin", "delta", "pool", &from.to_string(), &to.to_string()]);
    blocks_of(printed.lines().map(|l| {
        let w: Vec<&str> = l.split_whitespace().collect();
        (
            w[0].parse().unwrap(),
            w[1].parse().unwrap(),
            w[2].to_string(),
        )
    }))
}

/// The blocks thin_delta lists as changed, from its XML on a metadata snapshot of the live
/// pool (taken and released around it).
fn thin_delta(daemon: &Daemon, from: u32, to: u32) -> BTreeMap<u64, String> {
    daemon.udm(&["message", "pool", "0", "reserve_metadata_snap"]);
    let meta = daemon.dir.path("pool.meta");
    let (from, to) = (from.to_string(), to.to_string());
    let xml = tool(
        "thin_delta",
        &[
            "-m",
            "--snap1",
            &from,
            "--snap2",
            &to,
            meta.to_str().unwrap(),
        ],
    );
    daemon.udm(&["message", "pool", "0", "release_metadata_snap"]);
    blocks_of(xml.lines().filter_map(|line| {
        let line = line.trim();
        let kind = line.strip_prefix('<')?.split(' ').next()?.to_string();
        let field = |name: &str| -> Option<u64> {
            let at = line.find(&format!("{name}=\""))? + name.len() + 2;
            line[at..].split('"').next()?.parse().ok()
        };
        Some((field("begin")?, field("length")?, kind))
    }))
}

/// The 64 KiB blocks libnbd's `nbdinfo --map` marks in `map` (every extent block-aligned).
fn nbdinfo_blocks(map: &str) -> BTreeMap<u64, ()> {
    let block = 64 * 1024;
    let mut marked = BTreeMap::new();
    for line in map.lines() {
        let w: Vec<u64> = line
            .split_whitespace()
            .take(3)
            .map(|f| f.parse().unwrap())
            .collect();
        assert_eq!((w[0] % block, w[1] % block), (0, 0), "{line}");
        if w[2] == 1 {
            for b in w[0] / block..(w[0] + w[1]) / block {
                marked.insert(b, ());
            }
        }
    }
    marked
}

#[test]
fn udm_thin_delta_equals_thin_delta_on_a_metadata_snapshot_of_the_live_pool() {
    let (a, _b, _) = two_daemons("delta");
    let vol = a.uri("vol");
    qemu_io_ok(&vol, &["write -P 0x11 0 40M", "write -P 0x12 900M 8M"]);
    snapshot(&a, 2);
    let changes = [
        "write -P 0x13 1M 3M",
        "discard 900M 4M",
        "write -P 0x14 500M 64k",
    ];
    qemu_io_ok(&vol, &changes);
    snapshot(&a, 3);
    let ours = udm_delta(&a, 2, 3);
    assert!(ours.len() > 100, "{ours:?}");
    assert_eq!(ours, thin_delta(&a, 2, 3));
    // The same delta as an NBD meta context of the snapshot's export, seen by libnbd's nbdinfo.
    let map = with_thin(&a, "three", 3, || {
        let uri = a.uri("three");
        let contexts = tool("nbdinfo", &["--list", &uri]);
        assert!(contexts.contains("udm:delta:2"), "{contexts}");
        tool("nbdinfo", &["--map=udm:delta:2", &uri])
    });
    assert!(
        nbdinfo_blocks(&map).keys().eq(ours.keys()),
        "nbdinfo --map=udm:delta:2:\n{map}"
    );
    // Both contexts in one request: one block-status chunk each (libnbd's nbdsh).
    let both = with_thin(&a, "three", 3, || {
        nbdsh(&format!(
            "h.add_meta_context('base:allocation'); h.add_meta_context('udm:delta:2')\n\
             h.connect_uri('{}')\n\
             seen = {{}}\n\
             def cb(context, offset, entries, err):\n    seen[context] = entries\n    return 0\n\
             h.block_status(8 << 20, 1 << 20, cb)\n\
             print(sorted(seen.items()))",
            a.uri("three")
        ))
    });
    assert!(both.0, "{}", both.1);
    // From 1 MiB: 3 MiB written since snapshot 2 (changed), then 5 MiB not; all of it data.
    assert!(
        both.1.contains("('base:allocation', [8388608, 0])"),
        "{}",
        both.1
    );
    assert!(
        both.1.contains("('udm:delta:2', [3145728, 1, 5242880, 0])"),
        "{}",
        both.1
    );
}
