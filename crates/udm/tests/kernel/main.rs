//! Linux's own device-mapper as the judge. A guest boots Debian's 6.12 kernel (see
//! `scripts/kernel-vm.sh`: under TCG here, about 35 s a boot on an idle machine), and the
//! kernel's targets read what udm wrote and write what udm then reads, on the same images.
//! Where no guest can boot (no kernel package, qemu or virtme-ng to be had), each test says so
//! in one line and passes; where one booted, every difference fails the test.
//!
//! Run alone: `cargo test -p udm --test kernel -- --nocapture` (with `UDM_KERNEL_KVM=1` on a
//! host where KVM works).

#[path = "../common/mod.rs"]
mod common;
mod thin;

use std::path::{Path, PathBuf};
use std::process::Command;

/// The folder of this file, where the guest's scripts are.
fn scripts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/kernel")
}

/// Runs `script args…` as root in a guest with `disks` as its /dev/vda, /dev/vdb, …; the
/// guest may write into `results`. Returns what it printed, or `None` when no guest can boot
/// here (the harness printed why). Fails the test when the script failed in a guest that
/// booted.
fn in_guest(disks: &[&Path], results: &Path, script: &str, args: &[&str]) -> Option<String> {
    std::fs::create_dir_all(results).unwrap();
    let harness = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/kernel-vm.sh");
    let mut command = Command::new("bash");
    command.arg(harness).arg("--results").arg(results);
    for disk in disks {
        command.arg("--disk").arg(disk);
    }
    let output = command
        .args(["--timeout", "900", "--", "bash"])
        .arg(scripts().join(script))
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
