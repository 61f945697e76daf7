//! Fault tables under a clone: `dust` and `flakey` under its source, destination and
//! metadata, swapped in and out live. Errors reach the client as EIO on exactly the affected
//! requests, the clone's metadata modes change as documented, and once the fault is gone the
//! device works and verifies.

mod common;

use common::*;

const MIB: u64 = 1 << 20;

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
    let (dest, meta) = (daemon.dir.path("dest.img"), daemon.dir.path("meta.img"));
    sparse_file(&dest, 8 * MIB);
    sparse_file(&meta, MIB);
    daemon.udm(&[
        "create",
        "srcdev",
        "--table",
        &format!("0 16384 dust {} 0 4096", source.display()),
    ]);
    daemon.udm(&[
        "create",
        "destdev",
        "--table",
        &format!("0 16384 linear {} 0", dest.display()),
    ]);
    daemon.udm(&[
        "create",
        "metadev",
        "--table",
        &format!("0 2048 linear {} 0", meta.display()),
    ]);
    daemon.udm(&[
        "create",
        "vol",
        "--table",
        &format!("0 16384 clone metadev destdev srcdev {region_sectors} 1 no_hydration"),
    ]);
    Rig { daemon, source }
}

impl Rig {
    /// Runs qemu-io commands (separated by `;`) in one connection.
    fn io(&self, commands: &str) -> Result<String, String> {
        let mut args = vec!["-f", "raw", "-t", "writeback"];
        for command in commands.split(';') {
            args.extend(["-c", command.trim()]);
        }
        let uri = self.daemon.uri("vol");
        args.push(&uri);
        let out = std::process::Command::new("qemu-io")
            .args(&args)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if text.contains("error") || text.contains("failed") || !out.status.success() {
            Err(text)
        } else {
            Ok(text)
        }
    }

    fn eio(&self, command: &str) {
        let err = self.io(command).expect_err(command);
        assert!(err.contains("Input/output error"), "{command}: {err}");
    }

    fn swap(&self, device: &str, table: &str) {
        self.daemon.udm(&["suspend", device]);
        self.daemon.udm(&["load", device, "--table", table]);
        self.daemon.udm(&["resume", device]);
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
    let dest = r.daemon.dir.path("dest.img");
    r.io("write -P 0x1 0 64k").unwrap();
    r.swap(
        "destdev",
        &format!("0 16384 flakey {} 0 0 1 1 error_writes", dest.display()),
    );
    r.eio("write -P 0x2 0 4k");
    r.eio("write -P 0x2 1M 4k");
    // Reads still work, from the destination and from the source.
    r.io("read -P 0x1 0 64k").unwrap();
    r.io("read 2M 64k").unwrap();
    r.swap("destdev", &format!("0 16384 linear {} 0", dest.display()));
    r.io("write -P 0x3 1M 4k").unwrap();
    r.io("read -P 0x3 1M 4k").unwrap();
    r.io("read -P 0x1 0 64k").unwrap();
    assert!(r.status().ends_with(" rw"));
}

#[test]
fn metadata_write_errors_make_the_clone_read_only_and_a_reload_recovers() {
    let r = rig("fault-meta", 8);
    let meta = r.daemon.dir.path("meta.img");
    r.io("write -P 0x1 0 4k").unwrap();
    r.daemon.udm(&["message", "vol", "0", "disable_hydration"]);
    let events_before: u64 = r
        .daemon
        .udm(&["info", "vol", "--json"])
        .parse::<serde_json::Value>()
        .unwrap()["event_nr"]
        .as_u64()
        .unwrap();
    r.swap(
        "metadev",
        &format!("0 2048 flakey {} 0 0 1 1 error_writes", meta.display()),
    );
    // The next commit fails: read-only mode, with an event.
    // (qemu-io reports a failed flush only through its exit status.)
    r.io("write -P 0x2 1M 4k; flush")
        .expect_err("the flush needs a commit, which fails");
    let status = r.status();
    assert!(status.ends_with(" ro"), "{status}");
    let events: u64 = r
        .daemon
        .udm(&["info", "vol", "--json"])
        .parse::<serde_json::Value>()
        .unwrap()["event_nr"]
        .as_u64()
        .unwrap();
    assert_eq!(events, events_before + 1);
    // Read-only: reads work, writes to hydrated regions work, writes that need hydration fail.
    r.io("read -P 0x1 0 4k").unwrap();
    r.io("write -P 0x4 0 4k").unwrap();
    r.eio("write -P 0x5 2M 512");
    // The fault is removed and the clone reloaded: read-write again, everything verifies.
    r.swap("metadev", &format!("0 2048 linear {} 0", meta.display()));
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
    let meta = r.daemon.dir.path("meta.img");
    r.io("write -P 0x1 0 4k").unwrap();
    r.swap(
        "metadev",
        &format!("0 2048 flakey {} 0 0 1", meta.display()),
    );
    // (qemu-io reports a failed flush only through its exit status.)
    r.io("write -P 0x2 1M 4k; flush")
        .expect_err("the flush needs a commit, which fails");
    assert_eq!(r.status(), "0 16384 clone Fail");
    r.eio("read 0 4k");
    // Other devices keep serving.
    tool(
        "qemu-io",
        &["-f", "raw", "-c", "read 0 4k", &r.daemon.uri("srcdev")],
    );
}
