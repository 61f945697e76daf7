//! dm-thin both ways: a pool udm wrote under a workload is activated by the kernel, which must
//! read every thin device as udm served it and report the same status lines; the kernel then
//! writes, snapshots, deletes and discards on it, and udm takes the pool back and must read
//! what the kernel wrote and report what the kernel reported. thin_check at every handover.

use std::path::Path;

use super::common::*;
use super::{in_guest, result};

/// 64 KiB data blocks and a low water mark of 4 blocks, the same table rest on both sides.
const POOL_REST: &str = "128 4";
const VOLUME: u64 = 8 * MIB;

fn pool_table(meta: &Path, data: &Path, size: u64) -> String {
    format!(
        "0 {} thin-pool {} {} {POOL_REST}",
        size / 512,
        meta.display(),
        data.display()
    )
}

fn message(daemon: &Daemon, words: &str) {
    let mut args = vec!["message", "pool", "0"];
    args.extend(words.split(' '));
    daemon.udm(&args);
}

fn activate(daemon: &Daemon, id: u32) {
    let table = format!("0 {} thin pool {id}", VOLUME / 512);
    daemon.create(&format!("thin{id}"), &table);
}

fn qemu_io_on(daemon: &Daemon, id: u32, command: &str) {
    let (ok, out) = qemu_io(&daemon.uri(&format!("thin{id}")), command);
    assert!(ok, "qemu-io {command} on thin{id}: {out}\n{}", daemon.log());
}

fn snapshot(daemon: &Daemon, id: u32, origin: u32) {
    daemon.udm(&["suspend", &format!("thin{origin}")]);
    message(daemon, &format!("create_snap {id} {origin}"));
    daemon.udm(&["resume", &format!("thin{origin}")]);
    activate(daemon, id);
}

/// A status line without its "start length type" (what the guest records of dmsetup's).
fn status_fields(daemon: &Daemon, device: &str) -> String {
    let line = daemon.udm(&["status", device]);
    line.splitn(4, ' ').nth(3).unwrap_or("").to_string()
}

fn sha256(daemon: &Daemon, device: &str) -> String {
    let script = format!("nbdcopy '{}' - | sha256sum", daemon.uri(device));
    let out = tool("sh", &["-c", &script]);
    out.split_whitespace().next().unwrap().to_string()
}

fn thin_check(meta: &Path) {
    tool("thin_check", &[meta.to_str().unwrap()]);
}

#[test]
fn dm_thin_takes_over_a_pool_udm_wrote_and_udm_reads_back_what_the_kernel_wrote() {
    let daemon = Daemon::start("kernel-thin");
    let meta = daemon.sparse("meta.img", 8 * MIB);
    let data = daemon.sparse("data.img", 32 * MIB);
    daemon.create("pool", &pool_table(&meta, &data, 32 * MIB));

    // udm's workload: snapshots of snapshots, overwrites that break sharing, a discard, a
    // device deleted, the data device grown, and a metadata snapshot held.
    message(&daemon, "create_thin 1");
    activate(&daemon, 1);
    qemu_io_on(&daemon, 1, "write -P 0x11 0 8M");
    snapshot(&daemon, 2, 1);
    qemu_io_on(&daemon, 1, "write -P 0x22 1M 1M");
    qemu_io_on(&daemon, 2, "write -P 0x33 2M 512K");
    snapshot(&daemon, 3, 2);
    qemu_io_on(&daemon, 3, "write -P 0x44 3M 64K");
    message(&daemon, "create_thin 4");
    activate(&daemon, 4);
    qemu_io_on(&daemon, 4, "write -P 0x55 0 4M");
    qemu_io_on(&daemon, 4, "discard 1M 2M");
    message(&daemon, "create_thin 5");
    activate(&daemon, 5);
    qemu_io_on(&daemon, 5, "write -P 0x66 0 1M");
    daemon.udm(&["remove", "thin5"]);
    message(&daemon, "delete 5");
    daemon.udm(&["suspend", "pool"]);
    std::fs::File::options()
        .write(true)
        .open(&data)
        .unwrap()
        .set_len(48 * MIB)
        .unwrap();
    daemon.udm(&[
        "load",
        "pool",
        "--table",
        &pool_table(&meta, &data, 48 * MIB),
    ]);
    daemon.udm(&["resume", "pool"]);
    message(&daemon, "reserve_metadata_snap");
    qemu_io_on(&daemon, 1, "write -P 0x77 5M 128K");

    let before: Vec<u32> = vec![1, 2, 3, 4];
    let served: Vec<(String, String)> = before
        .iter()
        .map(|id| {
            let device = format!("thin{id}");
            (sha256(&daemon, &device), status_fields(&daemon, &device))
        })
        .collect();
    for id in &before {
        daemon.udm(&["remove", &format!("thin{id}")]);
    }
    daemon.udm(&["suspend", "pool"]);
    let pool_status = status_fields(&daemon, "pool");
    daemon.udm(&["remove", "pool"]);
    thin_check(&meta);

    let results = daemon.dir.path("results");
    let after = "1 2 3 6 7";
    let Some(_) = in_guest(
        &[&meta, &data],
        &results,
        "thin_guest.sh",
        &[
            results.to_str().unwrap(),
            POOL_REST,
            &(VOLUME / 512).to_string(),
            "1 2 3 4",
            after,
        ],
    ) else {
        return;
    };

    // What the kernel found is what udm served and said.
    let (mut differences, mut checks) = (Vec::new(), 0);
    let mut compare = |what: String, udm: &str, kernel: String| {
        checks += 1;
        if udm != kernel {
            differences.push(format!("{what}: udm '{udm}', kernel '{kernel}'"));
        }
    };
    compare(
        "pool status, handed to the kernel".into(),
        &pool_status,
        result(&results, "before.pool"),
    );
    for (id, (sha, status)) in before.iter().zip(&served) {
        compare(
            format!("thin {id} content"),
            sha,
            result(&results, &format!("before.sha.{id}")),
        );
        compare(
            format!("thin {id} status"),
            status,
            result(&results, &format!("before.thin{id}")),
        );
    }

    // And back: udm reads what the kernel wrote, and says what the kernel said.
    thin_check(&meta);
    daemon.create("pool", &pool_table(&meta, &data, 48 * MIB));
    compare(
        "pool status, taken back from the kernel".into(),
        &status_fields(&daemon, "pool"),
        result(&results, "after.pool"),
    );
    for id in after.split(' ') {
        let id: u32 = id.parse().unwrap();
        activate(&daemon, id);
        let device = format!("thin{id}");
        compare(
            format!("thin {id} content, written by the kernel"),
            &sha256(&daemon, &device),
            result(&results, &format!("after.sha.{id}")),
        );
        compare(
            format!("thin {id} status, after the kernel"),
            &status_fields(&daemon, &device),
            result(&results, &format!("after.thin{id}")),
        );
    }
    assert!(differences.is_empty(), "{}", differences.join("\n"));
    eprintln!(
        "dm-thin: {checks} checks against the kernel, all equal (pool as the kernel left it: \
         {})",
        result(&results, "after.pool")
    );
    // The kernel deleted thin 4: udm must not find it.
    let e = daemon.udm_err(&["create", "thin4", "--table", "0 16384 thin pool 4"]);
    assert!(e.contains('4'), "{e}");
    qemu_io_on(&daemon, 7, "write -P 0x7a 2M 64K");
    for id in after.split(' ') {
        daemon.udm(&["remove", &format!("thin{id}")]);
    }
    daemon.udm(&["remove", "pool"]);
    thin_check(&meta);
}
