//! dm-snapshot both ways: a persistent COW store udm wrote under origin and snapshot writes is
//! taken over by the kernel, which must read origin and snapshot as udm served them and report
//! the same status; the kernel writes to both, and udm takes the store back, reads what the
//! kernel wrote, and merges it into the origin, which must then read as the kernel's snapshot.

use std::path::{Path, PathBuf};

use super::common::*;
use super::{result, sha256, status_fields, Differences};

/// 8 KiB chunks, on both sides.
pub const CHUNK_SECTORS: u64 = 16;
const SIZE: u64 = 8 * MIB;

/// A COW store udm wrote and let go of, for the kernel to take over (`snapshot_guest.sh`).
pub struct Handover {
    pub origin: PathBuf,
    pub cow: PathBuf,
    /// sha256 of the origin's and the snapshot's content, and the snapshot's status, as udm
    /// served and said them.
    served: (String, String, String),
}

fn origin_table(origin: &Path) -> String {
    format!("0 {} snapshot-origin {}", SIZE / 512, origin.display())
}

fn snapshot_table(origin: &Path, cow: &Path) -> String {
    format!(
        "0 {} snapshot {} {} P {CHUNK_SECTORS}",
        SIZE / 512,
        origin.display(),
        cow.display()
    )
}

fn write(daemon: &Daemon, device: &str, command: &str) {
    let (ok, out) = qemu_io(&daemon.uri(device), command);
    assert!(ok, "qemu-io {command} on {device}: {out}\n{}", daemon.log());
}

fn open(daemon: &Daemon, origin: &Path, cow: &Path) {
    daemon.create("origin", &origin_table(origin));
    daemon.create("snap", &snapshot_table(origin, cow));
}

fn served(daemon: &Daemon) -> (String, String, String) {
    (
        sha256(daemon, "origin"),
        sha256(daemon, "snap"),
        status_fields(daemon, "snap"),
    )
}

impl Handover {
    /// udm's workload: origin writes that save chunks into the snapshot (one over a chunk saved
    /// already), a write to the snapshot alone; then both devices removed.
    pub fn prepare(daemon: &Daemon) -> Handover {
        let origin = daemon.sparse("origin.img", SIZE);
        let cow = daemon.sparse("snap.cow", 4 * MIB);
        daemon.create(
            "fill",
            &format!("0 {} linear {} 0", SIZE / 512, origin.display()),
        );
        write(daemon, "fill", "write -P 0x01 0 8M");
        daemon.udm(&["remove", "fill"]);
        open(daemon, &origin, &cow);
        write(daemon, "origin", "write -P 0x21 1M 256K");
        write(daemon, "snap", "write -P 0x22 3M 64K");
        write(daemon, "origin", "write -P 0x23 1032K 8K");
        let served = served(daemon);
        daemon.udm(&["remove", "snap"]);
        daemon.udm(&["remove", "origin"]);
        Handover {
            origin,
            cow,
            served,
        }
    }

    pub fn take_back(&self, daemon: &Daemon, results: &Path, differences: &mut Differences) {
        let (origin, snapshot, status) = &self.served;
        let kernel = |name: &str| result(results, name);
        differences.compare(
            "snapshot-origin content",
            origin,
            kernel("before.sha.origin"),
        );
        differences.compare("snapshot content", snapshot, kernel("before.sha.snapshot"));
        differences.compare("snapshot status", status, kernel("before.snapshot"));

        open(daemon, &self.origin, &self.cow);
        let (origin, snapshot, status) = served(daemon);
        let what = "after the kernel";
        differences.compare(
            &format!("snapshot-origin content, {what}"),
            &origin,
            kernel("after.sha.origin"),
        );
        differences.compare(
            &format!("snapshot content, {what}"),
            &snapshot,
            kernel("after.sha.snapshot"),
        );
        differences.compare(
            &format!("snapshot status, {what}"),
            &status,
            kernel("after.snapshot"),
        );

        // udm merges the kernel's store back: the origin then reads as the snapshot did.
        daemon.udm(&["suspend", "snap"]);
        let merge = format!(
            "0 {} snapshot-merge {} {} P {CHUNK_SECTORS}",
            SIZE / 512,
            self.origin.display(),
            self.cow.display()
        );
        daemon.udm(&["load", "origin", "--table", &merge]);
        daemon.udm(&["resume", "origin"]);
        daemon.udm(&["remove", "snap"]);
        daemon.udm(&["wait", "origin", "--progress"]);
        daemon.udm(&["finalize", "origin"]);
        differences.compare(
            "the origin after udm merged the kernel's snapshot",
            &sha256(daemon, "origin"),
            kernel("after.sha.snapshot"),
        );
        daemon.udm(&["remove", "origin"]);
    }
}
