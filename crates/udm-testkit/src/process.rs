//! Running the tools the tests check against (mkfs, qemu-io, thin_check, openssl…).

use std::process::{Command, Output};

/// What a process printed: its standard output, then its standard error.
pub fn printed(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs `command`, which must succeed; returns its standard output. A failure shows the
/// command, its status and everything it printed.
pub fn run_ok(command: &mut Command) -> String {
    let out = command.output().unwrap_or_else(|e| {
        panic!("cannot run {command:?} (is it installed? .ci/run installs it): {e}")
    });
    assert!(
        out.status.success(),
        "{command:?} failed ({}):\n{}",
        out.status,
        printed(&out)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
