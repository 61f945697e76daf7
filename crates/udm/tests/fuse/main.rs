//! End to end through the FUSE export and a loop device: real filesystems (ext4, xfs) made,
//! filled from a real tarball, checked file by file and with fsck, on linear and on a clone
//! while it hydrates; fstrim reaching the clone; fio on a file in the filesystem; live table
//! swaps under a mounted filesystem; a killed daemon's mount recovered by the next one; and an
//! ext4 under log-writes replayed to every FUA point with `fsck -n`, among them a thin pool
//! whose own devices are logged while ext4 and snapshots live on it.

#[path = "../common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

/// Two tests of `$check(uring)`: one over FUSE's io_uring transport, one over /dev/fuse.
macro_rules! over_both_transports {
    ($check:ident: $over_io_uring:ident, $over_dev_fuse:ident) => {
        #[test]
        fn $over_io_uring() {
            $check("on");
        }

        #[test]
        fn $over_dev_fuse() {
            $check("off");
        }
    };
}

// After the macro, which they use.
mod attacks;
mod filesystems;
mod lifecycle;
mod log_replay;

fn fuse_daemon(tag: &str) -> Daemon {
    fuse_daemon_over(tag, "auto")
}

/// A daemon with a FUSE mount served as `--fuse-uring` says (on, off, auto).
fn fuse_daemon_over(tag: &str, uring: &str) -> Daemon {
    let daemon = Daemon::start_with(tag, &["--fuse", "{dir}/fuse", "--fuse-uring", uring]);
    let transport = fuse_transport(&daemon);
    match uring {
        "on" => assert!(transport.starts_with("io_uring"), "{transport}"),
        "off" => assert!(transport.starts_with("/dev/fuse"), "{transport}"),
        _ => {}
    }
    daemon
}

/// How the daemon's FUSE mount gets its requests, as `udm info` says.
fn fuse_transport(daemon: &Daemon) -> String {
    daemon.create("transport-probe", "0 8 zero");
    let info = daemon.udm(&["info", "transport-probe", "--json"]);
    daemon.udm(&["remove", "transport-probe"]);
    let info: serde_json::Value = serde_json::from_str(&info).unwrap();
    info["fuse_transport"].as_str().unwrap().to_string()
}

/// A loop device attached with `udm attach`, detached on drop.
struct Loop(String);

impl Loop {
    fn attach(daemon: &Daemon, name: &str) -> Loop {
        let dev = daemon.udm(&["attach", name]);
        assert!(dev.starts_with("/dev/loop"), "{dev}");
        Loop(dev)
    }
}

/// Removes a device whose loop device was just detached: the kernel (or udev's probe of the
/// detached device) may hold the file open a moment longer.
fn remove_once_released(daemon: &Daemon, name: &str) {
    wait_for(
        || daemon.run_udm(&["remove", name]).status.success(),
        "the detached loop device to release its file",
    );
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}

/// Changes a mounted filesystem: copies trees of real files, syncs, deletes, copies again.
fn churn(mnt: &Path) {
    tool(
        "cp",
        &[
            "-r",
            "/usr/include/x86_64-linux-gnu",
            mnt.join("arch").to_str().unwrap(),
        ],
    );
    tool("sync", &[]);
    tool("rm", &["-rf", mnt.join("arch/bits").to_str().unwrap()]);
    tool(
        "cp",
        &[
            "-r",
            "/usr/include/linux/netfilter",
            mnt.join("again").to_str().unwrap(),
        ],
    );
}

/// Replays `log` onto `replay` and checks ext4 at every FUA point as a power cut there
/// would leave it; returns the report.
///
/// The check runs on a copy whose journal is replayed first, as a mount would (xfstests'
/// log-writes tests mount before they fsck). `e2fsck -n` alone skips journal recovery, and
/// a point taken while ext4 was checkpointing a committed transaction holds some of its
/// blocks in place and the rest only in the journal: consistent after recovery, reported
/// as damage without it. That made this check fail now and then under load on correct logs.
fn replay_checking_ext4(daemon: &Daemon, log: &Path, replay: &Path, extra: &[&str]) -> String {
    let point = daemon.dir.path("fsck-point.img");
    let report = daemon.dir.path("fsck-point.out");
    let fsck = format!(
        "cp --sparse=always {replay} {point} && \
         {{ e2fsck -E journal_only -y {point} >{report} 2>&1; \
           e2fsck -fn {point} >>{report} 2>&1; }}",
        replay = replay.display(),
        point = point.display(),
        report = report.display(),
    );
    let mut args = vec!["--check", "fua", "--fsck", &fsck];
    args.extend_from_slice(extra);
    let out = daemon.replay_log(log, replay, &args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}\ne2fsck at the failed point:\n{}",
        String::from_utf8_lossy(&out.stderr),
        std::fs::read_to_string(&report).unwrap_or_default()
    );
    stdout
}

/// Runs `tar -C mnt <op> tarball`: `-xf` extracts, `-df` compares every file byte for byte.
fn tar_in(mnt: &Path, op: &str, tarball: &Path) {
    tool(
        "tar",
        &["-C", mnt.to_str().unwrap(), op, tarball.to_str().unwrap()],
    );
}

/// Every file of the tarball is in the filesystem at `mnt`, byte for byte.
fn tar_matches(mnt: &Path, tarball: &Path) {
    tar_in(mnt, "-df", tarball);
}

/// A tarball of real files: C and C++ headers of this machine (a few thousand files).
fn real_tarball(dir: &Path) -> PathBuf {
    let tarball = dir.join("headers.tar");
    tool(
        "tar",
        &[
            "-C",
            "/usr/include",
            "-cf",
            tarball.to_str().unwrap(),
            "linux",
            "x86_64-linux-gnu",
            "c++",
        ],
    );
    tarball
}

fn mkfs(fs: &str, dev: &str) {
    match fs {
        "ext4" => tool("mkfs.ext4", &["-q", "-F", dev]),
        "xfs" => tool("mkfs.xfs", &["-q", "-f", dev]),
        other => panic!("{other}"),
    };
}

fn fsck(fs: &str, dev: &str) {
    match fs {
        "ext4" => tool("e2fsck", &["-fn", dev]),
        "xfs" => tool("xfs_repair", &["-n", dev]),
        other => panic!("{other}"),
    };
}

/// Extracts the tarball into the filesystem, syncs, unmounts, checks, remounts and compares
/// every file with the archive.
fn fill_and_check(fs: &str, dev: &str, mnt: &Path, tarball: &Path) {
    let mounted = Mounted::new(dev, mnt);
    tar_in(mnt, "-xf", tarball);
    tool("sync", &[]);
    tar_matches(mnt, tarball);
    mounted.unmount();
    fsck(fs, dev);
    let mounted = Mounted::new(dev, mnt);
    tar_matches(mnt, tarball);
    mounted.unmount();
}

trait OutputAsync {
    fn output_async(&mut self) -> std::process::Child;
}

impl OutputAsync for Command {
    fn output_async(&mut self) -> std::process::Child {
        self.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn")
    }
}
