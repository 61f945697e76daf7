//! Linux's own device-mapper as the judge. A guest boots Debian's 6.12 kernel (see
//! `scripts/kernel-vm.sh`: under TCG here, about 35 s a boot on an idle machine), and the
//! kernel's targets read what udm wrote and write what udm then reads, on the same images,
//! every check in one boot. Where no guest can boot (no kernel package, qemu or virtme-ng to be
//! had), the test says so in one line and passes; where one booted, every difference fails it.
//!
//! Run alone: `cargo test -p udm --test kernel -- --nocapture` (with `UDM_KERNEL_KVM=1` on a
//! host where KVM works). What is checked, and what is not yet: docs/kernel-checks.md.

#[path = "../common/mod.rs"]
mod common;
mod snapshot;
mod thin;

use std::path::Path;
use std::process::Command;

use common::*;

/// Runs `script args…` (a file beside this one) as root in a guest with `disks` as its
/// /dev/vda, /dev/vdb, …; the guest may write into `results`. Returns what it printed, or
/// `None` when no guest can boot here (the harness printed why). Fails the test when the
/// script failed in a guest that booted.
fn in_guest(disks: &[&Path], results: &Path, script: &str, args: &[String]) -> Option<String> {
    std::fs::create_dir_all(results).unwrap();
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut command = Command::new("bash");
    command
        .arg(here.join("../../scripts/kernel-vm.sh"))
        .arg("--results")
        .arg(results);
    for disk in disks {
        command.arg("--disk").arg(disk);
    }
    let output = command
        .args(["--timeout", "900", "--", "bash"])
        .arg(here.join("tests/kernel").join(script))
        .arg(results)
        .args(args)
        .output()
        .expect("run scripts/kernel-vm.sh");
    let printed = String::from_utf8_lossy(&output.stdout).to_string()
        + &String::from_utf8_lossy(&output.stderr);
    match output.status.code() {
        Some(0) => Some(printed),
        Some(77) => {
            eprintln!("{}", printed.trim_end());
            None
        }
        _ => panic!(
            "{script} failed in the guest ({}):\n{printed}",
            output.status
        ),
    }
}

/// A file the guest wrote into `results`, without its line end.
fn result(results: &Path, name: &str) -> String {
    std::fs::read_to_string(results.join(name))
        .unwrap_or_else(|e| panic!("the guest left no {name}: {e}"))
        .trim_end()
        .to_string()
}

/// A status line without its "start length type", as the guest records dmsetup's.
fn status_fields(daemon: &Daemon, device: &str) -> String {
    let line = daemon.udm(&["status", device]);
    line.splitn(4, ' ').nth(3).unwrap_or("").to_string()
}

/// The sha256 of a udm device's content, read over NBD.
fn sha256(daemon: &Daemon, device: &str) -> String {
    let script = format!("nbdcopy '{}' - | sha256sum", daemon.uri(device));
    let out = tool("sh", &["-c", &script]);
    out.split_whitespace().next().unwrap().to_string()
}

/// Where udm and the kernel disagreed; every comparison counted.
#[derive(Default)]
struct Differences {
    checks: usize,
    found: Vec<String>,
}

impl Differences {
    fn compare(&mut self, what: &str, udm: &str, kernel: String) {
        self.checks += 1;
        if udm != kernel {
            self.found
                .push(format!("{what}: udm '{udm}', kernel '{kernel}'"));
        }
    }
}

#[test]
fn the_kernels_device_mapper_and_udm_read_and_write_each_others_metadata() {
    let daemon = Daemon::start("kernel");
    let thin = thin::Handover::prepare(&daemon);
    let snapshot = snapshot::Handover::prepare(&daemon);
    let results = daemon.dir.path("results");
    let mut args = thin::guest_args();
    args.push(snapshot::CHUNK_SECTORS.to_string());
    let disks = [&thin.meta, &thin.data, &snapshot.origin, &snapshot.cow];
    let disks = disks.map(|d| d.as_path());
    if in_guest(&disks, &results, "guest.sh", &args).is_none() {
        return;
    }
    let mut differences = Differences::default();
    thin.take_back(&daemon, &results, &mut differences);
    snapshot.take_back(&daemon, &results, &mut differences);
    assert!(
        differences.found.is_empty(),
        "{} of {} checks differ from the kernel:\n{}",
        differences.found.len(),
        differences.checks,
        differences.found.join("\n")
    );
    eprintln!(
        "{} checks against the kernel's dm-thin and dm-snapshot: all equal",
        differences.checks
    );
}
