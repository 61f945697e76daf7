//! Stacks whose lower device is suspended: verbs on the upper device that must wait for the
//! lower one (a swap's drain of I/O parked there) wait without holding up the verbs of every
//! other device, so the operator can still resume the lower device and end the wait; a
//! table that reads it while being built is refused; neither a removal nor a stop waits for
//! it to flush.

use std::process::{Child, Command};
use std::time::Instant;

use super::*;

/// `udm ARGS` started in the background.
fn udm_in_background(daemon: &Daemon, args: &[&str]) -> Child {
    Command::new(UDM)
        .args(args)
        .env("UDM_CONTROL", daemon.control())
        .spawn()
        .unwrap()
}

/// `low` (a file) under `top` (linear over `low`), `low` suspended.
fn stack_with_low_suspended(tag: &str) -> Daemon {
    let daemon = Daemon::start(tag);
    daemon.create_linear("low", "low.img", MIB);
    daemon.create("top", "0 2048 linear low 0");
    daemon.udm(&["suspend", "low"]);
    daemon
}

/// The waiting verb has reached the daemon and waits; the other verbs still work, among
/// them the resume of `low` that ends the wait.
fn resume_low_ends(daemon: &Daemon, mut waiting: Child) {
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        waiting.try_wait().unwrap().is_none(),
        "did not wait for 'low'"
    );
    let started = Instant::now();
    for verb in [
        &["create", "other", "--table", "0 8 zero"][..],
        &["resume", "low"],
    ] {
        // Under timeout(1): a verb held up for ever is a failure, not a test that hangs.
        let out = Command::new("timeout")
            .args(["10", UDM])
            .args(verb)
            .env("UDM_CONTROL", daemon.control())
            .output()
            .unwrap();
        assert!(out.status.success(), "udm {verb:?}: {out:?}");
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(waiting.wait().unwrap().success());
}

/// A removal flushed the device's table, and that flush waited at the suspended device's
/// gate until it was resumed: `udm remove top` hung for ever unless someone resumed `low`.
/// The kernel's removal does not flush (`dm_destroy` only waits for I/O in flight), so
/// neither does udm's when a device below is suspended: it says so in the log (writes not
/// flushed yet may be lost, as when the daemon stops) and returns at once.
#[test]
fn removing_a_device_over_a_suspended_one_does_not_wait_for_its_resume() {
    let daemon = stack_with_low_suspended("remove-over-suspended");
    let started = Instant::now();
    let out = Command::new("timeout")
        .args(["10", UDM, "remove", "top"])
        .env("UDM_CONTROL", daemon.control())
        .output()
        .unwrap();
    assert!(out.status.success(), "udm remove top: {out:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(daemon.udm(&["ls"]), "low\t(2048 sectors)");
    assert!(
        daemon
            .log()
            .contains("removing 'top': it is built on suspended 'low': not flushed"),
        "{}",
        daemon.log()
    );
    // `low` is left as it was.
    assert!(daemon.udm(&["info", "low"]).contains("SUSPENDED"));
    daemon.udm(&["resume", "low"]);
}

/// A forced removal swaps in an error table, which drains the client's read parked at the
/// suspended device's gate: that wait too holds up no other verb.
#[test]
fn removing_by_force_a_device_over_a_suspended_one_holds_up_no_other_verb() {
    let daemon = stack_with_low_suspended("force-over-suspended");
    let mut client = RawClient::connect(&daemon.nbd_socket(), "top");
    client.send(0, NBD_CMD_READ, 1, 0, 4096, &[]);
    // The read must be parked at `low`'s gate before the error table goes in: one that has
    // not reached `top`'s table yet fails with EIO, as the kernel's would (seen once in CI).
    std::thread::sleep(Duration::from_millis(500));
    let remove = udm_in_background(&daemon, &["remove", "--force", "top"]);
    resume_low_ends(&daemon, remove);
    assert_eq!(client.reply().unwrap(), (0, 1));
}

#[test]
fn swapping_the_table_of_a_device_over_a_suspended_one_holds_up_no_other_verb() {
    let daemon = stack_with_low_suspended("swap-over-suspended");
    // A read parked at the suspended device's gate is top's I/O in flight: the swap drains it.
    let mut client = RawClient::connect(&daemon.nbd_socket(), "top");
    client.send(0, NBD_CMD_READ, 1, 0, 4096, &[]);
    daemon.udm(&["load", "top", "--table", "0 2048 zero"]);
    let resume = udm_in_background(&daemon, &["resume", "top"]);
    resume_low_ends(&daemon, resume);
    assert_eq!(client.reply().unwrap(), (0, 1));
    assert_eq!(daemon.udm(&["table", "top"]), "0 2048 zero");
}

/// A table whose constructor reads a suspended device (a clone's metadata) is refused,
/// naming the device, instead of waiting for a resume that needs the lock it holds.
#[test]
fn a_table_that_reads_a_suspended_device_is_refused_not_left_waiting() {
    let daemon = Daemon::start("build-over-suspended");
    daemon.create_linear("meta", "meta.img", MIB);
    daemon.udm(&["suspend", "meta"]);
    let (dest, source) = (
        daemon.sparse("dest", 4 * MIB),
        daemon.sparse("src", 4 * MIB),
    );
    let table = format!(
        "0 8192 clone meta {} {} 8",
        dest.display(),
        source.display()
    );
    let out = Command::new("timeout")
        .args(["10", UDM, "create", "cl", "--table", &table])
        .env("UDM_CONTROL", daemon.control())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("'meta' is suspended"), "{out:?}");
    daemon.udm(&["resume", "meta"]);
    daemon.udm(&["create", "cl", "--table", &table]);
}

/// A stop flushes every device, but not one whose flush would wait at a suspended
/// device's gate: it is named in the log, and the daemon stops.
#[test]
fn a_stop_does_not_wait_for_devices_over_a_suspended_one() {
    let mut daemon = stack_with_low_suspended("stop-over-suspended");
    unsafe { libc::kill(daemon.pid() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while daemon.is_running() {
        assert!(Instant::now() < deadline, "no stop: {}", daemon.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(daemon
        .log()
        .contains("'top' is built on suspended 'low': not flushed"));
}

/// Finalizing a hydrated clone whose destination is suspended swaps tables, which drains the
/// client's read parked at the destination's gate: that wait holds up no other verb either.
#[test]
fn finalizing_a_clone_over_a_suspended_destination_holds_up_no_other_verb() {
    let daemon = Daemon::start("finalize-over-suspended");
    daemon.create_linear("low", "low.img", MIB);
    let (meta, source) = (daemon.sparse("meta", MIB), daemon.sparse("src", MIB));
    daemon.create(
        "cl",
        &format!("0 2048 clone {} low {} 8", meta.display(), source.display()),
    );
    let progress = daemon.udm(&["wait", "cl", "--progress"]);
    assert!(progress.ends_with("hydration complete"), "{progress}");
    daemon.udm(&["suspend", "low"]);
    let mut client = RawClient::connect(&daemon.nbd_socket(), "cl");
    client.send(0, NBD_CMD_READ, 1, 0, 4096, &[]);
    let finalize = udm_in_background(&daemon, &["finalize", "cl"]);
    resume_low_ends(&daemon, finalize);
    assert_eq!(client.reply().unwrap(), (0, 1));
    assert_eq!(daemon.udm(&["table", "cl"]), "0 2048 linear low 0");
}
