//! dm-thin both ways: a pool udm wrote under a workload is activated by the kernel, which must
//! read every thin device as udm served it and report the same status lines; the kernel then
//! writes, snapshots, deletes and discards on it, and udm takes the pool back and must read
//! what the kernel wrote and report what the kernel reported. thin_check at every handover.

use std::path::{Path, PathBuf};

use super::common::*;
use super::{result, sha256, status_fields, Differences};

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

fn thin_check(meta: &Path) {
    tool("thin_check", &[meta.to_str().unwrap()]);
}

/// The thin devices udm hands over, and those the kernel leaves (it deletes 4, makes 6 and 7).
const HANDED_OVER: [u32; 4] = [1, 2, 3, 4];
const LEFT_BY_THE_KERNEL: [u32; 5] = [1, 2, 3, 6, 7];

/// A pool udm wrote and let go of, for the kernel to take over (`thin_guest.sh`).
pub struct Handover {
    pub meta: PathBuf,
    pub data: PathBuf,
    /// Per thin device handed over: its content's sha256 and its status, as udm served them.
    served: Vec<(String, String)>,
    pool_status: String,
}

/// The guest script's arguments after RESULTS.
pub fn guest_args() -> Vec<String> {
    let ids = |ids: &[u32]| ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ");
    vec![
        POOL_REST.to_string(),
        (VOLUME / 512).to_string(),
        ids(&HANDED_OVER),
        ids(&LEFT_BY_THE_KERNEL),
    ]
}

impl Handover {
    /// udm's workload on a new pool: snapshots of snapshots, overwrites that break sharing, a
    /// discard, a device deleted, the data device grown, and a metadata snapshot held; then
    /// every device removed, the pool last, and thin_check.
    pub fn prepare(daemon: &Daemon) -> Handover {
        let meta = daemon.sparse("meta.img", 8 * MIB);
        let data = daemon.sparse("data.img", 32 * MIB);
        daemon.create("pool", &pool_table(&meta, &data, 32 * MIB));
        message(daemon, "create_thin 1");
        activate(daemon, 1);
        qemu_io_on(daemon, 1, "write -P 0x11 0 8M");
        snapshot(daemon, 2, 1);
        qemu_io_on(daemon, 1, "write -P 0x22 1M 1M");
        qemu_io_on(daemon, 2, "write -P 0x33 2M 512K");
        snapshot(daemon, 3, 2);
        qemu_io_on(daemon, 3, "write -P 0x44 3M 64K");
        message(daemon, "create_thin 4");
        activate(daemon, 4);
        qemu_io_on(daemon, 4, "write -P 0x55 0 4M");
        qemu_io_on(daemon, 4, "discard 1M 2M");
        message(daemon, "create_thin 5");
        activate(daemon, 5);
        qemu_io_on(daemon, 5, "write -P 0x66 0 1M");
        daemon.udm(&["remove", "thin5"]);
        message(daemon, "delete 5");
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
        message(daemon, "reserve_metadata_snap");
        qemu_io_on(daemon, 1, "write -P 0x77 5M 128K");

        let served = HANDED_OVER
            .iter()
            .map(|id| {
                let device = format!("thin{id}");
                (sha256(daemon, &device), status_fields(daemon, &device))
            })
            .collect();
        for id in HANDED_OVER {
            daemon.udm(&["remove", &format!("thin{id}")]);
        }
        // Suspended, the pool has committed: its status is what its metadata says.
        daemon.udm(&["suspend", "pool"]);
        let pool_status = status_fields(daemon, "pool");
        daemon.udm(&["remove", "pool"]);
        thin_check(&meta);
        Handover {
            meta,
            data,
            served,
            pool_status,
        }
    }

    /// What the kernel found must be what udm served and said; then udm takes the pool back
    /// and must read what the kernel wrote and say what the kernel said.
    pub fn take_back(&self, daemon: &Daemon, results: &Path, differences: &mut Differences) {
        differences.compare(
            "thin-pool status, handed to the kernel",
            &self.pool_status,
            result(results, "before.pool"),
        );
        for (id, (sha, status)) in HANDED_OVER.iter().zip(&self.served) {
            let content = result(results, &format!("before.sha.{id}"));
            differences.compare(&format!("thin {id} content"), sha, content);
            let kernel = result(results, &format!("before.thin{id}"));
            differences.compare(&format!("thin {id} status"), status, kernel);
        }

        thin_check(&self.meta);
        daemon.create("pool", &pool_table(&self.meta, &self.data, 48 * MIB));
        differences.compare(
            "thin-pool status, taken back from the kernel",
            &status_fields(daemon, "pool"),
            result(results, "after.pool"),
        );
        for id in LEFT_BY_THE_KERNEL {
            activate(daemon, id);
            let device = format!("thin{id}");
            differences.compare(
                &format!("thin {id} content, after the kernel"),
                &sha256(daemon, &device),
                result(results, &format!("after.sha.{id}")),
            );
            differences.compare(
                &format!("thin {id} status, after the kernel"),
                &status_fields(daemon, &device),
                result(results, &format!("after.thin{id}")),
            );
        }
        // The kernel deleted thin 4: udm must not find it.
        let e = daemon.udm_err(&["create", "thin4", "--table", "0 16384 thin pool 4"]);
        assert!(e.contains('4'), "{e}");
        qemu_io_on(daemon, 7, "write -P 0x7a 2M 64K");
        for id in LEFT_BY_THE_KERNEL {
            daemon.udm(&["remove", &format!("thin{id}")]);
        }
        daemon.udm(&["remove", "pool"]);
        thin_check(&self.meta);
    }
}
