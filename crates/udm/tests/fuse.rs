//! End to end through the FUSE export and a loop device: real filesystems (ext4, xfs) made,
//! filled from a real tarball, checked file by file and with fsck, on linear and on a clone
//! while it hydrates; fstrim reaching the clone; fio on a file in the filesystem; live table
//! swaps under a mounted filesystem; a killed daemon's mount recovered by the next one; and an
//! ext4 under log-writes replayed to every FUA point with `fsck -n`, among them a thin pool
//! whose own devices are logged while ext4 and snapshots live on it.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

const MIB: u64 = 1 << 20;

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
    daemon.udm(&["create", "transport-probe", "--table", "0 8 zero"]);
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

/// A mounted filesystem, unmounted on drop.
struct Mounted(PathBuf);

impl Mounted {
    fn new(dev: &str, dir: &Path) -> Mounted {
        std::fs::create_dir_all(dir).unwrap();
        tool("mount", &[dev, dir.to_str().unwrap()]);
        Mounted(dir.to_path_buf())
    }
    fn unmount(self) {
        tool("umount", &[self.0.to_str().unwrap()]);
        std::mem::forget(self);
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
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

/// Replays `log` onto `replay`, running `e2fsck -fn` at every FUA point; returns the report.
fn replay_checking_ext4(daemon: &Daemon, log: &Path, replay: &Path, extra: &[&str]) -> String {
    let fsck = format!("e2fsck -fn {} >/dev/null 2>&1", replay.display());
    let mut args = vec!["--check", "fua", "--fsck", &fsck];
    args.extend_from_slice(extra);
    let out = daemon.replay_log(log, replay, &args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
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

over_both_transports!(ext4_and_xfs_on_linear: ext4_and_xfs_on_linear_through_fuse_over_io_uring_and_a_loop_device, ext4_and_xfs_on_linear_through_fuse_over_dev_fuse_and_a_loop_device);

fn ext4_and_xfs_on_linear(uring: &str) {
    let daemon = fuse_daemon_over(&format!("fuse-linear-{uring}"), uring);
    let tarball = real_tarball(&daemon.dir.0);
    for fs in ["ext4", "xfs"] {
        let disk = daemon.dir.path(&format!("{fs}.img"));
        sparse_file(&disk, 512 * MIB);
        daemon.udm(&[
            "create",
            fs,
            "--table",
            &format!("0 {} linear {} 0", 512 * MIB / 512, disk.display()),
        ]);
        let info = daemon.udm(&["info", fs]);
        assert!(
            info.contains(&format!(
                "FUSE file:         {}/fuse/{fs}",
                daemon.dir.0.display()
            )) && info.contains("FUSE transport:    "),
            "{info}"
        );
        let dev = Loop::attach(&daemon, fs);
        mkfs(fs, &dev.0);
        fill_and_check(fs, &dev.0, &daemon.dir.path(&format!("mnt-{fs}")), &tarball);
    }
}

#[test]
fn ext4_on_a_clone_while_it_hydrates_and_fstrim_skips_unused_space() {
    let daemon = fuse_daemon("fuse-clone");
    let tarball = real_tarball(&daemon.dir.0);
    // The source: an ext4 image holding the tarball's files (made without mounting).
    let tree = daemon.dir.path("tree");
    std::fs::create_dir_all(&tree).unwrap();
    tool(
        "tar",
        &[
            "-C",
            tree.to_str().unwrap(),
            "-xf",
            tarball.to_str().unwrap(),
        ],
    );
    let source = daemon.dir.path("source.img");
    ext4_image_of(&tree, &source, 256 * MIB);
    let (dest, meta) = (daemon.dir.path("dest.img"), daemon.dir.path("meta.img"));
    sparse_file(&dest, 256 * MIB);
    sparse_file(&meta, 4 * MIB);
    daemon.udm(&[
        "create",
        "slow",
        "--table",
        &format!(
            "0 524288 delay {} 0 1 {} 0 0",
            source.display(),
            source.display()
        ),
    ]);
    daemon.udm(&["create", "vol", "--table", &format!(
        "0 524288 clone {} {} slow 8 1 no_hydration 4 hydration_threshold 256 hydration_batch_size 64",
        meta.display(), dest.display()
    )]);
    let dev = Loop::attach(&daemon, "vol");
    let mnt = daemon.dir.path("mnt");
    let mounted = Mounted::new(&dev.0, &mnt);
    tar_matches(&mnt, &tarball);
    let hydrated = |d: &Daemon| -> u64 {
        let json: serde_json::Value =
            serde_json::from_str(&d.udm(&["status", "vol", "--json"])).unwrap();
        json["targets"][0]["details"]["hydrated_bytes"]
            .as_u64()
            .unwrap()
    };
    let before = hydrated(&daemon);
    // fstrim: the free space reaches the clone as zeroing of whole regions, which marks
    // them hydrated without reading the source.
    tool("fstrim", &[mnt.to_str().unwrap()]);
    let after_trim = hydrated(&daemon);
    assert!(
        after_trim > before + 100 * MIB,
        "fstrim hydrated only {} bytes",
        after_trim - before
    );
    // Write while it hydrates, then let it finish.
    tool(
        "cp",
        &[
            "-r",
            tree.join("linux").to_str().unwrap(),
            mnt.join("copy").to_str().unwrap(),
        ],
    );
    daemon.udm(&["message", "vol", "0", "enable_hydration"]);
    tool("sync", &[]);
    let out = daemon.udm(&["wait", "vol", "--progress"]);
    assert!(out.ends_with("hydration complete"));
    tool(
        "diff",
        &[
            "-r",
            tree.join("linux").to_str().unwrap(),
            mnt.join("copy").to_str().unwrap(),
        ],
    );
    tar_matches(&mnt, &tarball);
    mounted.unmount();
    fsck("ext4", &dev.0);
    // Finalize under the attached loop device; the destination alone is now the filesystem.
    daemon.udm(&["finalize", "vol"]);
    drop(dev);
    fsck("ext4", dest.to_str().unwrap());
}

/// Used data blocks of a thin pool, from its status line.
fn thin_pool_used(daemon: &Daemon, pool: &str) -> u64 {
    let status = daemon.udm(&["status", pool]);
    let used = status.split(' ').nth(5).unwrap();
    used.split('/').next().unwrap().parse().unwrap()
}

#[test]
fn ext4_on_a_thin_volume_with_a_snapshot_taken_while_mounted() {
    let daemon = fuse_daemon("fuse-thin");
    let tarball = real_tarball(&daemon.dir.0);
    let (meta, data) = (daemon.dir.path("pool.meta"), daemon.dir.path("pool.data"));
    sparse_file(&meta, 16 * MIB);
    sparse_file(&data, 512 * MIB);
    let pool = format!(
        "0 {} thin-pool {} {} 128 0",
        512 * MIB / 512,
        meta.display(),
        data.display()
    );
    daemon.udm(&["create", "pool", "--table", &pool]);
    daemon.udm(&["message", "pool", "0", "create_thin", "1"]);
    let volume = |name: &str, id: u32| {
        let table = format!("0 {} thin pool {id}", 384 * MIB / 512);
        daemon.udm(&["create", name, "--table", &table]);
    };
    volume("vol", 1);
    let dev = Loop::attach(&daemon, "vol");
    mkfs("ext4", &dev.0);
    let mnt = daemon.dir.path("mnt");
    let mounted = Mounted::new(&dev.0, &mnt);
    tar_in(&mnt, "-xf", &tarball);
    tool("sync", &[]);
    // A snapshot of the mounted filesystem, frozen and its volume suspended meanwhile (what
    // lvcreate --snapshot does).
    tool("fsfreeze", &["-f", mnt.to_str().unwrap()]);
    daemon.udm(&["suspend", "vol"]);
    daemon.udm(&["message", "pool", "0", "create_snap", "2", "1"]);
    daemon.udm(&["resume", "vol"]);
    tool("fsfreeze", &["-u", mnt.to_str().unwrap()]);
    // The origin changes: files go, others come; a big file written after the snapshot and
    // deleted gives its blocks back to the pool through fstrim.
    churn(&mnt);
    tool("rm", &["-rf", mnt.join("linux").to_str().unwrap()]);
    tool(
        "dd",
        &[
            "if=/dev/urandom",
            &format!("of={}", mnt.join("big").display()),
            "bs=1M",
            "count=64",
            "conv=fsync",
        ],
    );
    let with_big = thin_pool_used(&daemon, "pool");
    tool("rm", &[mnt.join("big").to_str().unwrap()]);
    // ext4 trims only blocks whose release is committed to its journal.
    tool("sync", &[]);
    tool("fstrim", &[mnt.to_str().unwrap()]);
    let trimmed = thin_pool_used(&daemon, "pool");
    // At least 60 of the file's 64 MiB (its ends share thin blocks with other data).
    assert!(
        trimmed + 60 * MIB / (64 * 1024) <= with_big,
        "fstrim gave back too little: {with_big} blocks used before, {trimmed} after"
    );
    mounted.unmount();
    fsck("ext4", &dev.0);
    drop(dev);
    remove_once_released(&daemon, "vol");
    // The snapshot is the filesystem as it was frozen: clean, every file of the tarball.
    volume("snap", 2);
    let snap = Loop::attach(&daemon, "snap");
    fsck("ext4", &snap.0);
    let snap_mnt = daemon.dir.path("snap-mnt");
    let mounted = Mounted::new(&snap.0, &snap_mnt);
    tar_matches(&snap_mnt, &tarball);
    mounted.unmount();
    drop(snap);
    remove_once_released(&daemon, "snap");
    daemon.udm(&["suspend", "pool"]);
    tool("thin_check", &[meta.to_str().unwrap()]);
}

over_both_transports!(fio_across_live_table_swaps: fio_verifies_a_file_in_the_filesystem_across_live_table_swaps_over_io_uring, fio_verifies_a_file_in_the_filesystem_across_live_table_swaps_over_dev_fuse);

fn fio_across_live_table_swaps(uring: &str) {
    let daemon = fuse_daemon_over(&format!("fuse-fio-{uring}"), uring);
    let disk = daemon.dir.path("disk.img");
    sparse_file(&disk, 256 * MIB);
    let one = format!("0 524288 linear {} 0", disk.display());
    let two = format!(
        "0 262144 linear {} 0\n262144 262144 linear {} 262144",
        disk.display(),
        disk.display()
    );
    daemon.udm(&["create", "vol", "--table", &one]);
    let dev = Loop::attach(&daemon, "vol");
    mkfs("ext4", &dev.0);
    let mnt = daemon.dir.path("mnt");
    let mounted = Mounted::new(&dev.0, &mnt);
    let fio = Command::new("fio")
        .args([
            "--name=fs",
            "--directory",
            mnt.to_str().unwrap(),
            "--rw=randrw",
            "--bs=4k",
            "--size=64M",
            "--ioengine=psync",
            "--direct=1",
            "--numjobs=2",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--verify_state_save=0",
            "--fsync=32",
            "--time_based",
            "--runtime=5",
            "--verify_backlog=256",
        ])
        .output_async();
    std::thread::sleep(Duration::from_millis(800));
    daemon.swap_tables("vol", &one, &two, 10, Duration::from_millis(200));
    let out = fio.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "fio: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("err= 0"));
    mounted.unmount();
    fsck("ext4", &dev.0);
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

#[test]
fn a_killed_daemon_leaves_a_dead_mount_that_the_next_daemon_recovers() {
    let mut daemon = fuse_daemon("fuse-kill");
    daemon.create_linear("vol", "disk.img", 16 * MIB);
    let file = daemon.dir.path("fuse/vol");
    std::fs::write(&file, vec![0x42u8; 4096]).unwrap();
    daemon.stop(libc::SIGKILL);
    // Dead: ENOTCONN once the kernel has torn the connection down. An io_uring
    // connection's teardown goes on after the process is gone, failing the requests it
    // catches with ECONNABORTED or ECANCELED.
    wait_for(
        || {
            let err = std::fs::metadata(&file).unwrap_err();
            let errno = err.raw_os_error().unwrap();
            assert!(
                [libc::ENOTCONN, libc::ECONNABORTED, libc::ECANCELED].contains(&errno),
                "{err}"
            );
            errno == libc::ENOTCONN
        },
        "the dead mount to fail with ENOTCONN",
    );
    daemon.launch();
    let data = std::fs::read(&file).unwrap();
    assert_eq!(data.len(), 16 * MIB as usize);
    assert!(data[..4096].iter().all(|&b| b == 0x42));
    // A clean stop unmounts.
    daemon.stop(libc::SIGTERM);
    assert!(!file.exists());
}

over_both_transports!(ext4_under_log_writes: ext4_under_log_writes_is_clean_at_every_fua_point_over_io_uring, ext4_under_log_writes_is_clean_at_every_fua_point_over_dev_fuse);

fn ext4_under_log_writes(uring: &str) {
    let daemon = fuse_daemon_over(&format!("fuse-log-writes-{uring}"), uring);
    let (disk, log) = (daemon.dir.path("disk.img"), daemon.dir.path("log.img"));
    sparse_file(&disk, 64 * MIB);
    sparse_file(&log, 512 * MIB);
    daemon.udm(&[
        "create",
        "lw",
        "--table",
        &format!("0 131072 log-writes {} {}", disk.display(), log.display()),
    ]);
    let dev = Loop::attach(&daemon, "lw");
    tool("mkfs.ext4", &["-q", "-F", "-E", "nodiscard", &dev.0]);
    daemon.udm(&["message", "lw", "0", "mark", "mkfs"]);
    let mnt = daemon.dir.path("mnt");
    let mounted = Mounted::new(&dev.0, &mnt);
    churn(&mnt);
    mounted.unmount();
    drop(dev);
    remove_once_released(&daemon, "lw");
    let replay = daemon.dir.path("replay.img");
    sparse_file(&replay, 64 * MIB);
    // Check from the end of mkfs on: before it finishes there is no filesystem to check.
    let stdout = replay_checking_ext4(&daemon, &log, &replay, &["--check-after-mark", "mkfs"]);
    let points = replay_points(&stdout);
    assert!(points >= 5, "{stdout}");
    eprintln!("log-writes: {stdout}");
    // The end of the log is the device itself.
    assert!(std::fs::read(&replay).unwrap() == std::fs::read(&disk).unwrap());
}

#[test]
fn ext4_on_a_hydrating_clone_is_clean_at_every_fua_point_of_its_log() {
    let daemon = fuse_daemon("fuse-clone-log");
    let tree = daemon.dir.path("tree");
    std::fs::create_dir_all(&tree).unwrap();
    tool(
        "cp",
        &[
            "-r",
            "/usr/include/linux",
            tree.join("linux").to_str().unwrap(),
        ],
    );
    let source = daemon.dir.path("source.img");
    ext4_image_of(&tree, &source, 64 * MIB);
    let (dest, meta, log) = (
        daemon.dir.path("dest.img"),
        daemon.dir.path("meta.img"),
        daemon.dir.path("log.img"),
    );
    sparse_file(&dest, 64 * MIB);
    sparse_file(&meta, MIB);
    sparse_file(&log, 512 * MIB);
    // The clone hydrates slowly underneath while the filesystem is used through log-writes.
    daemon.udm(&["create", "vol", "--table", &format!(
        "0 131072 clone {} {} {} 16 0 6 hydration_threshold 64 hydration_batch_size 4 max_hydration_rate 8192",
        meta.display(), dest.display(), source.display()
    )]);
    daemon.udm(&[
        "create",
        "lw",
        "--table",
        &format!("0 131072 log-writes vol {}", log.display()),
    ]);
    let dev = Loop::attach(&daemon, "lw");
    let mnt = daemon.dir.path("mnt");
    let mounted = Mounted::new(&dev.0, &mnt);
    churn(&mnt);
    mounted.unmount();
    drop(dev);
    remove_once_released(&daemon, "lw");
    // The clone read as the source when the log began: replay onto a copy of it.
    let replay = daemon.dir.path("replay.img");
    std::fs::copy(&source, &replay).unwrap();
    let stdout = replay_checking_ext4(&daemon, &log, &replay, &[]);
    eprintln!("clone under log-writes: {stdout}");
    let copy = daemon.dir.path("clone-now.img");
    tool("nbdcopy", &[&daemon.uri("vol"), copy.to_str().unwrap()]);
    assert!(std::fs::read(&replay).unwrap() == std::fs::read(&copy).unwrap());
}

/// ext4 on a thin volume, snapshots taken while it is mounted, and the pool's own metadata
/// and data devices both carved out of ONE log-writes device; the log is replayed to every
/// FLUSH and FUA point, and at each the pool's metadata must pass thin_check and every thin
/// device it holds (the origin and the snapshots that exist by then) an `e2fsck -fn`.
///
/// Why this stacking rather than log-writes over the thin volume: a log of the volume
/// records what ext4 sent, and replaying it onto a plain file checks ext4, not the pool. A
/// log under the pool records what the pool sent its devices, in the order they completed:
/// data writes, the data flush, then the metadata blocks and superblock of each commit (and
/// discards passed down). One log for both devices keeps the order between them, which is
/// what crash safety depends on: a commit must not reach the disk before the data it maps,
/// and a block must not be reused or discarded while a committed mapping still points at
/// it. Each replay point is a power cut at that moment, and the pool read there (read-only,
/// by a second daemon) must hold consistent metadata and the filesystems ext4 made durable.
#[test]
fn ext4_on_a_thin_pool_with_snapshots_is_clean_at_every_fua_point_of_the_pools_log() {
    const META_MIB: u64 = 4;
    const DATA_MIB: u64 = 128;
    const VOLUME_MIB: u64 = 64;
    let daemon = fuse_daemon("fuse-thin-log");
    let (disk, log) = (daemon.dir.path("disk.img"), daemon.dir.path("log.img"));
    sparse_file(&disk, (META_MIB + DATA_MIB) * MIB);
    sparse_file(&log, 1024 * MIB);
    let sectors = |mib: u64| mib * MIB / 512;
    daemon.udm(&[
        "create",
        "lw",
        "--table",
        &format!(
            "0 {} log-writes {} {}",
            sectors(META_MIB + DATA_MIB),
            disk.display(),
            log.display()
        ),
    ]);
    daemon.udm(&[
        "create",
        "meta",
        "--table",
        &format!("0 {} linear lw 0", sectors(META_MIB)),
    ]);
    daemon.udm(&[
        "create",
        "data",
        "--table",
        &format!("0 {} linear lw {}", sectors(DATA_MIB), sectors(META_MIB)),
    ]);
    daemon.udm(&[
        "create",
        "pool",
        "--table",
        &format!("0 {} thin-pool meta data 128 0", sectors(DATA_MIB)),
    ]);
    daemon.udm(&["message", "pool", "0", "create_thin", "1"]);
    let volume_table = |id: u32| format!("0 {} thin pool {id}", sectors(VOLUME_MIB));
    daemon.udm(&["create", "vol", "--table", &volume_table(1)]);
    let dev = Loop::attach(&daemon, "vol");
    tool("mkfs.ext4", &["-q", "-F", "-E", "nodiscard", &dev.0]);
    daemon.udm(&["message", "lw", "0", "mark", "mkfs"]);
    let mnt = daemon.dir.path("mnt");
    let mounted = Mounted::new(&dev.0, &mnt);
    // Snapshots as lvcreate takes them: the filesystem frozen, its volume suspended.
    let snapshot = |id: &str| {
        tool("fsfreeze", &["-f", mnt.to_str().unwrap()]);
        daemon.udm(&["suspend", "vol"]);
        daemon.udm(&["message", "pool", "0", "create_snap", id, "1"]);
        daemon.udm(&["resume", "vol"]);
        tool("fsfreeze", &["-u", mnt.to_str().unwrap()]);
    };
    // Nothing writes the snapshots: wherever one exists in the replay, it must hold what it
    // held when taken, byte for byte (e2fsck alone would miss a file's data lost under it).
    let reference = daemon.dir.path("reference");
    std::fs::create_dir_all(&reference).unwrap();
    let keep = |id: u32| {
        daemon.udm(&["create", "snap", "--table", &volume_table(id)]);
        "snap".to_string()
    };
    let copy_snapshot = |id: u32| {
        let copy = reference.join(format!("v{id}.img"));
        tool("nbdcopy", &[&daemon.uri(&keep(id)), copy.to_str().unwrap()]);
        daemon.udm(&["remove", "snap"]);
    };
    tool(
        "cp",
        &[
            "-r",
            "/usr/include/linux",
            mnt.join("linux").to_str().unwrap(),
        ],
    );
    snapshot("2");
    copy_snapshot(2);
    // Overwrites break the sharing with device 2; a snapshot of the snapshot (not active,
    // so no suspend) shares with both.
    churn(&mnt);
    daemon.udm(&["message", "pool", "0", "create_snap", "3", "2"]);
    copy_snapshot(3);
    snapshot("4");
    copy_snapshot(4);
    // Blocks freed and trimmed: unmapped in the pool, and passed down for those no snapshot
    // still holds.
    tool("rm", &["-rf", mnt.join("linux").to_str().unwrap()]);
    tool("sync", &[]);
    tool("fstrim", &[mnt.to_str().unwrap()]);
    churn(&mnt.join("again"));
    mounted.unmount();
    drop(dev);
    remove_once_released(&daemon, "vol");
    // The snapshots hold what they held when taken, here and (below) at every replay point.
    for id in [2, 3, 4] {
        same_content(
            &daemon.uri(&keep(id)),
            reference.join(format!("v{id}.img")).to_str().unwrap(),
        );
        daemon.udm(&["remove", "snap"]);
    }
    for name in ["pool", "data", "meta", "lw"] {
        daemon.udm(&["remove", name]);
    }

    // The check at each point, in a second daemon: the pool as the power cut left it,
    // opened read-only on copies of its two devices.
    let checker = Daemon::start("thin-log-check");
    let script = daemon.dir.path("check-point.sh");
    let replay = daemon.dir.path("replay.img");
    let work = daemon.dir.path("point");
    std::fs::create_dir_all(&work).unwrap();
    std::fs::write(
        &script,
        format!(
            r#"set -e
cd {work}
dd if={replay} of=meta bs=1M count={META_MIB} status=none
dd if={replay} of=data bs=1M skip={META_MIB} conv=sparse status=none
thin_check -q meta
export UDM_CONTROL={control}
{udm} create pool --table "0 {data_sectors} thin-pool {work}/meta {work}/data 128 0 1 read_only"
for id in $(thin_ls --no-headers -o DEV meta); do
  {udm} create v$id --table "0 {volume_sectors} thin pool $id"
  rm -f v$id.img
  nbdcopy "nbd+unix:///v$id?socket={socket}" v$id.img
  {udm} remove v$id
  if [ -f {reference}/v$id.img ]; then
    cmp -s v$id.img {reference}/v$id.img || {{ echo "snapshot $id changed" >&2; exit 1; }}
  fi
  # The journal replayed first, as a mount would (the copy is ours to change): a power
  # cut leaves ext4 needing recovery, and the blocks it wrote in place are consistent
  # only with its journal.
  e2fsck -E journal_only -y v$id.img >e2fsck.out 2>&1 || true
  e2fsck -fn v$id.img >>e2fsck.out 2>&1 || {{ echo "device $id:" >&2; cat e2fsck.out >&2; exit 1; }}
  echo $id >> checked
done
{udm} remove pool
"#,
            work = work.display(),
            replay = replay.display(),
            reference = reference.display(),
            control = checker.control().display(),
            udm = UDM,
            socket = checker.nbd_socket().display(),
            data_sectors = sectors(DATA_MIB),
            volume_sectors = sectors(VOLUME_MIB),
        ),
    )
    .unwrap();
    sparse_file(&replay, (META_MIB + DATA_MIB) * MIB);
    let fsck = format!("sh {}", script.display());
    let out = daemon.run_udm(&[
        "replay-log",
        "--log",
        log.to_str().unwrap(),
        "--replay",
        replay.to_str().unwrap(),
        "--check",
        "fua",
        "--fsck",
        &fsck,
        "--check-after-mark",
        "mkfs",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}\nchecker log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        checker.log()
    );
    eprintln!("thin pool under log-writes: {stdout}");
    // Every device was checked at some point, the snapshots at the points after they came.
    let checked = std::fs::read_to_string(work.join("checked")).unwrap();
    for id in ["1", "2", "3", "4"] {
        let times = checked.lines().filter(|l| *l == id).count();
        assert!(times >= 2, "device {id} checked {times} times:\n{checked}");
    }
    // The end of the log is the disk itself.
    assert!(std::fs::read(&replay).unwrap() == std::fs::read(&disk).unwrap());
}

#[test]
fn xfs_made_on_a_clone_while_it_hydrates() {
    let daemon = fuse_daemon("fuse-clone-xfs");
    let tarball = real_tarball(&daemon.dir.0);
    // An old, unrelated volume as the source: the new filesystem overwrites it while the
    // clone copies it underneath.
    let source = daemon.dir.path("source.img");
    pattern_file(&source, 512 * MIB as usize, 8);
    let (dest, meta) = (daemon.dir.path("dest.img"), daemon.dir.path("meta.img"));
    sparse_file(&dest, 512 * MIB);
    sparse_file(&meta, 4 * MIB);
    daemon.udm(&["create", "vol", "--table", &format!(
        "0 1048576 clone {} {} {} 16 0 6 hydration_threshold 64 hydration_batch_size 16 max_hydration_rate 65536",
        meta.display(), dest.display(), source.display()
    )]);
    let dev = Loop::attach(&daemon, "vol");
    mkfs("xfs", &dev.0);
    fill_and_check("xfs", &dev.0, &daemon.dir.path("mnt"), &tarball);
    let out = daemon.udm(&["wait", "vol", "--progress"]);
    assert!(out.ends_with("hydration complete"));
    fsck("xfs", &dev.0);
    drop(dev);
    // Hydrated: the destination alone holds the filesystem.
    fsck("xfs", dest.to_str().unwrap());
}

/// Sends `signal` and reports whether the daemon exits within `within`.
fn signal_and_wait(daemon: &mut Daemon, signal: i32, within: Duration) -> bool {
    unsafe { libc::kill(daemon.pid() as i32, signal) };
    let deadline = std::time::Instant::now() + within;
    while std::time::Instant::now() < deadline {
        if !daemon.is_running() {
            daemon.reap();
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

#[test]
fn a_stop_waits_for_a_mounted_filesystem_and_a_second_signal_forces_it() {
    let mut daemon = fuse_daemon("fuse-stop");
    let disk = daemon.dir.path("disk.img");
    sparse_file(&disk, 64 * MIB);
    let table = format!("0 131072 linear {} 0", disk.display());
    daemon.udm(&["create", "vol", "--table", &table]);
    let dev = Loop::attach(&daemon, "vol");
    mkfs("ext4", &dev.0);
    let mnt = daemon.dir.path("mnt");
    let mounted = Mounted::new(&dev.0, &mnt);

    assert!(!signal_and_wait(
        &mut daemon,
        libc::SIGTERM,
        Duration::from_secs(2)
    ));
    assert!(
        daemon.log().contains("not stopping while these files"),
        "{}",
        daemon.log()
    );
    // Still serving: the filesystem takes writes and stays clean.
    std::fs::write(mnt.join("after-sigterm"), vec![7u8; 1 << 20]).unwrap();
    tool("sync", &[]);
    mounted.unmount();
    fsck("ext4", &dev.0);
    drop(dev);
    assert!(
        signal_and_wait(&mut daemon, 0, Duration::from_secs(5)),
        "the daemon did not stop once its files were released:\n{}",
        daemon.log()
    );

    // A second signal stops it with a loop device still attached.
    daemon.launch();
    let _dev = Loop::attach(&daemon, "vol");
    assert!(!signal_and_wait(
        &mut daemon,
        libc::SIGTERM,
        Duration::from_secs(1)
    ));
    assert!(signal_and_wait(
        &mut daemon,
        libc::SIGTERM,
        Duration::from_secs(20)
    ));
}

#[test]
fn a_suspended_device_does_not_hold_up_a_stop() {
    let mut daemon = Daemon::start("stop-suspended");
    daemon.create_linear("vol", "disk.img", 16 * MIB);
    daemon.udm(&["suspend", "vol"]);
    assert!(
        signal_and_wait(&mut daemon, libc::SIGTERM, Duration::from_secs(5)),
        "SIGTERM with a suspended device hangs:\n{}",
        daemon.log()
    );
}

/// The file a loop device is bound to, or None once it is detached.
fn backing_file(dev: &str) -> Option<String> {
    let name = dev.strip_prefix("/dev/").unwrap();
    std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file")).ok()
}

#[test]
fn detach_refuses_loop_devices_udm_did_not_make() {
    let daemon = fuse_daemon("detach");
    let plain = daemon.dir.path("plain.img");
    sparse_file(&plain, 4 * MIB);
    let other = Loop(
        tool("losetup", &["-f", "--show", plain.to_str().unwrap()])
            .trim()
            .to_string(),
    );
    let err = daemon.udm_err(&["detach", &other.0]);
    assert!(
        err.contains(&format!("{} is not udm's", other.0))
            && err.contains(&format!("backing file {}", plain.display())),
        "{err}"
    );
    assert!(backing_file(&other.0).is_some(), "{} was detached", other.0);
    // A loop device on a plain file is no loop device at all to detach.
    let err = daemon.udm_err(&["detach", plain.to_str().unwrap()]);
    assert!(err.contains("is not a loop device"), "{err}");

    // udm's own loop devices detach.
    daemon.udm(&["create", "z", "--table", "0 8192 zero"]);
    let mine = Loop::attach(&daemon, "z");
    daemon.udm(&["detach", &mine.0]);
    assert_eq!(backing_file(&mine.0), None);
}

/// `dd` reading one block of `bs` bytes at block `skip` of `file` with O_DIRECT (one FUSE
/// request), in the background.
fn dd_in_background(file: &Path, bs: usize, skip: usize) -> std::process::Child {
    Command::new("dd")
        .arg(format!("if={}", file.display()))
        .args([
            "of=/dev/null",
            &format!("bs={bs}"),
            "count=1",
            &format!("skip={skip}"),
            "iflag=direct",
            "status=none",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn dd")
}

/// Reads in flight in a delay target: the first number of its status.
fn delayed_reads(daemon: &Daemon, name: &str) -> u64 {
    let json: serde_json::Value =
        serde_json::from_str(&daemon.udm(&["status", name, "--json"])).unwrap();
    let status = json["targets"][0]["status"].as_str().unwrap().to_string();
    status.split(' ').next().unwrap().parse().unwrap()
}

/// A daemon with a device `slow` whose reads take `delay_ms` (a delay target, which the
/// io_uring engine cannot take) and a `linear` device `fast`, both in its FUSE mount.
fn slow_and_fast(tag: &str, args: &[&str], delay_ms: u32) -> Daemon {
    let mut all = vec!["--fuse", "{dir}/fuse"];
    all.extend_from_slice(args);
    let daemon = Daemon::start_with(tag, &all);
    let disk = daemon.dir.path("slow.img");
    sparse_file(&disk, 4 * MIB);
    let table = format!("0 8192 delay {} 0 {delay_ms}", disk.display());
    daemon.udm(&["create", "slow", "--table", &table]);
    daemon.create_linear("fast", "fast.img", 64 * MIB);
    daemon
}

#[test]
fn over_io_uring_a_delayed_device_does_not_hold_up_a_fast_one_in_the_same_mount() {
    // Two threads for what the engine cannot take; four reads of the slow device keep
    // them both busy and leave two waiting.
    let args = ["--fuse-uring", "on", "--fuse-threads", "2"];
    let daemon = slow_and_fast("fuse-slow", &args, 3000);
    let fuse = daemon.dir.path("fuse");
    let slow: Vec<_> = (0..4)
        .map(|i| dd_in_background(&fuse.join("slow"), 4096, i))
        .collect();
    wait_for(|| delayed_reads(&daemon, "slow") == 2, "two delayed reads");
    let started = Instant::now();
    let out = Command::new("dd")
        .arg(format!("if={}", fuse.join("fast").display()))
        .args(["of=/dev/null", "bs=64k", "count=256", "iflag=direct"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    tool("stat", &[fuse.join("fast").to_str().unwrap()]);
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(1),
        "16 MiB of the fast device waited {took:?} behind the slow one"
    );
    assert_eq!(delayed_reads(&daemon, "slow"), 2, "the pool is bounded");
    for mut dd in slow {
        assert!(dd.wait().unwrap().success());
    }
}

fn a_stop_with_requests_in_flight_ends_in_bounded_time(uring: &str) {
    // Reads longer than the grace a busy mount is served after the forced stop unmounts it.
    let args = ["--fuse-uring", uring, "--fuse-threads", "4"];
    let mut daemon = slow_and_fast(&format!("fuse-stop-inflight-{uring}"), &args, 6000);
    let fuse = daemon.dir.path("fuse");
    // A stream of requests on the fast device through a loop device.
    let dev = Loop::attach(&daemon, "fast");
    let mut fio = Command::new("fio")
        .args([
            "--name=busy",
            &format!("--filename={}", dev.0),
            "--rw=randrw",
            "--bs=4k",
            "--iodepth=16",
            "--ioengine=io_uring",
            "--direct=1",
            "--time_based",
            "--runtime=60",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // More reads of the slow device than there are threads for them: some wait.
    let mut readers: Vec<_> = (0..6)
        .map(|i| dd_in_background(&fuse.join("slow"), 4096, i))
        .collect();
    wait_for(|| delayed_reads(&daemon, "slow") == 4, "four delayed reads");
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    // Files are open: the first signal waits for them, the second stops anyway.
    assert!(!signal_and_wait(
        &mut daemon,
        libc::SIGTERM,
        Duration::from_millis(500)
    ));
    assert!(
        signal_and_wait(&mut daemon, libc::SIGTERM, Duration::from_secs(20)),
        "the daemon did not stop:\n{}",
        daemon.log()
    );
    // Every user of the mount gets its answer or an error, none hangs.
    let deadline = started + Duration::from_secs(30);
    for child in readers.iter_mut().chain(std::iter::once(&mut fio)) {
        while child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "a reader of the mount hangs");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    assert!(
        daemon.log().contains("aborted the connection"),
        "{}",
        daemon.log()
    );
}

over_both_transports!(a_stop_with_requests_in_flight_ends_in_bounded_time: a_stop_with_requests_in_flight_ends_in_bounded_time_over_io_uring, a_stop_with_requests_in_flight_ends_in_bounded_time_over_dev_fuse);

#[test]
fn without_io_uring_auto_serves_over_dev_fuse_and_on_refuses_to_start() {
    // auto: one line says why, and the mount works over /dev/fuse.
    let daemon = Daemon::start_without_io_uring("fuse-no-uring", &["--fuse", "{dir}/fuse"]);
    let transport = fuse_transport(&daemon);
    assert!(transport.starts_with("/dev/fuse"), "{transport}");
    let log = daemon.log();
    let why: Vec<_> = log
        .lines()
        .filter(|l| l.contains("not using io_uring"))
        .collect();
    assert_eq!(why.len(), 1, "{log}");
    assert!(why[0].contains("io_uring is unavailable"), "{log}");
    daemon.create_linear("vol", "disk.img", 16 * MIB);
    let file = daemon.dir.path("fuse/vol");
    std::fs::write(&file, vec![0x5au8; 8192]).unwrap();
    assert!(std::fs::read(&file).unwrap()[..8192] == [0x5a; 8192]);

    // on: the daemon does not start, and says why in one line.
    let dir = TempDir::new("fuse-no-uring-on");
    let mut command = Command::new(common::UDM);
    common::deny_io_uring(&mut command);
    let out = command
        .arg("daemon")
        .arg("--state-dir")
        .arg(dir.path("state"))
        .arg("--control")
        .arg(dir.path("control.sock"))
        .arg("--fuse")
        .arg(dir.path("fuse"))
        .args(["--fuse-uring", "on"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("udm: FUSE mount at ")
            && last.contains("FUSE over io_uring is unavailable: io_uring is unavailable"),
        "{stderr}"
    );
    assert!(
        !udm_fuse_mounted(&dir.path("fuse")),
        "a mount was left behind"
    );
}

/// Whether a FUSE filesystem is mounted at `path`.
fn udm_fuse_mounted(path: &Path) -> bool {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(path.to_str().unwrap()))
}
