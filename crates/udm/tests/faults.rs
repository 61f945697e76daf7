//! Fault tables under a clone: `dust` and `flakey` under its source, destination and
//! metadata, swapped in and out live. Errors reach the client as EIO on exactly the affected
//! requests, the clone's metadata modes change as documented, and once the fault is gone the
//! device works and verifies.

mod common;

use common::*;

struct Rig {
    daemon: Daemon,
    source: std::path::PathBuf,
}

/// `vol` = clone(metadata `metadev`, destination `destdev`, source `srcdev`), each of those a
/// udm device over a file so faults can be swapped in under them.
fn rig(tag: &str, region_sectors: u64) -> Rig {
    let daemon = Daemon::start(tag);
    let source = daemon.dir.path("source.img");
    pattern_file(&source, 8 * MIB as usize, 3);
    daemon.create(
        "srcdev",
        &format!("0 16384 dust {} 0 4096", source.display()),
    );
    daemon.create_linear("destdev", "dest.img", 8 * MIB);
    daemon.create_linear("metadev", "meta.img", MIB);
    daemon.create(
        "vol",
        &format!("0 16384 clone metadev destdev srcdev {region_sectors} 1 no_hydration"),
    );
    Rig { daemon, source }
}

impl Rig {
    /// Runs qemu-io commands (separated by `;`) in one connection, with writeback caching.
    fn io(&self, commands: &str) -> Result<String, String> {
        let commands: Vec<&str> = commands.split(';').map(str::trim).collect();
        match qemu_io_with(&self.daemon.uri("vol"), &["-t", "writeback"], &commands) {
            (true, out) => Ok(out),
            (false, out) => Err(out),
        }
    }

    fn eio(&self, command: &str) {
        let err = self.io(command).expect_err(command);
        assert!(err.contains("Input/output error"), "{command}: {err}");
    }

    fn swap(&self, device: &str, table: &str) {
        self.daemon.reload(device, table);
    }

    /// The file under `destdev` or `metadev`, and its length in sectors.
    fn file_of(&self, device: &str) -> (std::path::PathBuf, u64) {
        match device {
            "destdev" => (self.daemon.dir.path("dest.img"), 16384),
            "metadev" => (self.daemon.dir.path("meta.img"), 2048),
            other => panic!("{other} has no file of its own here"),
        }
    }

    /// Puts `device` down: flakey over its file, never up, with flakey's `features`
    /// (none: every request fails; `1 error_writes`: only writes).
    fn fault(&self, device: &str, features: &str) {
        let (file, sectors) = self.file_of(device);
        let table = format!("0 {sectors} flakey {} 0 0 1 {features}", file.display());
        self.swap(device, table.trim_end());
    }

    /// Brings `device` back: linear over its file.
    fn heal(&self, device: &str) {
        let (file, sectors) = self.file_of(device);
        self.swap(device, &format!("0 {sectors} linear {} 0", file.display()));
    }

    fn status(&self) -> String {
        self.daemon.udm(&["status", "vol"])
    }
}

#[test]
fn a_bad_source_block_fails_exactly_the_reads_that_need_it() {
    let r = rig("fault-source", 8);
    r.daemon
        .udm(&["message", "srcdev", "0", "addbadblock", "100"]);
    r.daemon.udm(&["message", "srcdev", "0", "enable"]);
    r.eio("read 400k 4k");
    r.eio("read 396k 8k");
    r.io("read 404k 4k").unwrap();
    // A write covering the region needs no copy, so it works, and then so do reads there.
    r.io("write -P 0x7 400k 4k").unwrap();
    r.io("read -P 0x7 400k 4k").unwrap();
    // A partial write of another bad region needs its copy: EIO, and the region stays as it was.
    r.daemon
        .udm(&["message", "srcdev", "0", "addbadblock", "200"]);
    r.eio("write -P 0x8 800k 512");
    assert!(r.status().ends_with(" rw"), "{}", r.status());
    r.daemon
        .udm(&["message", "srcdev", "0", "removebadblock", "200"]);
    r.io("write -P 0x8 800k 512").unwrap();
    let source = std::fs::read(&r.source).unwrap();
    let out = r.io("read -v 800k 1k").unwrap();
    assert!(out.contains("08 08 08 08"), "{out}");
    assert!(source.len() == 8 * MIB as usize);
}

#[test]
fn destination_write_errors_fail_writes_until_the_fault_is_gone() {
    let r = rig("fault-dest", 8);
    r.io("write -P 0x1 0 64k").unwrap();
    r.fault("destdev", "1 error_writes");
    r.eio("write -P 0x2 0 4k");
    r.eio("write -P 0x2 1M 4k");
    // Reads still work, from the destination and from the source.
    r.io("read -P 0x1 0 64k").unwrap();
    r.io("read 2M 64k").unwrap();
    r.heal("destdev");
    r.io("write -P 0x3 1M 4k").unwrap();
    r.io("read -P 0x3 1M 4k").unwrap();
    r.io("read -P 0x1 0 64k").unwrap();
    assert!(r.status().ends_with(" rw"));
}

#[test]
fn metadata_write_errors_make_the_clone_read_only_and_a_reload_recovers() {
    let r = rig("fault-meta", 8);
    r.io("write -P 0x1 0 4k").unwrap();
    r.daemon.udm(&["message", "vol", "0", "disable_hydration"]);
    let events_before = r.daemon.event_nr("vol");
    r.fault("metadev", "1 error_writes");
    // The next commit fails: read-only mode, with an event.
    // (qemu-io reports a failed flush only through its exit status.)
    r.io("write -P 0x2 1M 4k; flush")
        .expect_err("the flush needs a commit, which fails");
    let status = r.status();
    assert!(status.ends_with(" ro"), "{status}");
    let events = r.daemon.event_nr("vol");
    assert_eq!(events, events_before + 1);
    // Read-only: reads work, writes to hydrated regions work, writes that need hydration fail.
    r.io("read -P 0x1 0 4k").unwrap();
    r.io("write -P 0x4 0 4k").unwrap();
    r.eio("write -P 0x5 2M 512");
    // The fault is removed and the clone reloaded: read-write again, everything verifies.
    r.heal("metadev");
    let table = r.daemon.udm(&["table", "vol"]);
    r.swap("vol", &table);
    assert!(r.status().ends_with(" rw"), "{}", r.status());
    r.io("write -P 0x6 2M 512").unwrap();
    r.io("read -P 0x6 2M 512").unwrap();
    r.io("read -P 0x4 0 4k").unwrap();
}

#[test]
fn metadata_that_cannot_be_read_or_written_means_fail_mode() {
    let r = rig("fault-fail", 8);
    r.io("write -P 0x1 0 4k").unwrap();
    r.fault("metadev", "");
    // (qemu-io reports a failed flush only through its exit status.)
    r.io("write -P 0x2 1M 4k; flush")
        .expect_err("the flush needs a commit, which fails");
    assert_eq!(r.status(), "0 16384 clone Fail");
    r.eio("read 0 4k");
    // Other devices keep serving.
    qemu_io_ok(&r.daemon.uri("srcdev"), &["read 0 4k"]);
}
