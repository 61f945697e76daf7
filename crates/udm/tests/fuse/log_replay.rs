//! ext4 under log-writes, replayed to every FUA point with `fsck -n`: on linear, on a
//! hydrating clone, and a thin pool whose own devices are logged while ext4 and snapshots
//! live on it.

use super::*;

over_both_transports!(
    ext4_under_log_writes:
    ext4_under_log_writes_is_clean_at_every_fua_point_over_io_uring,
    ext4_under_log_writes_is_clean_at_every_fua_point_over_dev_fuse
);

/// Attaches `name` to a loop device, runs `prepare` on it (e.g. mkfs), mounts it, churns the
/// filesystem, unmounts, detaches and removes `name`, so that its log is complete.
fn churn_and_remove(daemon: &Daemon, name: &str, prepare: impl FnOnce(&str)) {
    let dev = Loop::attach(daemon, name);
    prepare(&dev.0);
    let mnt = daemon.dir.path("mnt");
    let mounted = Mounted::new(&dev.0, &mnt);
    churn(&mnt);
    mounted.unmount();
    drop(dev);
    remove_once_released(daemon, name);
}

fn ext4_under_log_writes(uring: &str) {
    let daemon = fuse_daemon_over(&format!("fuse-log-writes-{uring}"), uring);
    let disk = daemon.sparse("disk.img", 64 * MIB);
    let log = daemon.sparse("log.img", 512 * MIB);
    let table = format!("0 131072 log-writes {} {}", disk.display(), log.display());
    daemon.create("lw", &table);
    churn_and_remove(&daemon, "lw", |dev| {
        tool("mkfs.ext4", &["-q", "-F", "-E", "nodiscard", dev]);
        daemon.udm(&["message", "lw", "0", "mark", "mkfs"]);
    });
    let replay = daemon.sparse("replay.img", 64 * MIB);
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
    let dest = daemon.sparse("dest.img", 64 * MIB);
    let meta = daemon.sparse("meta.img", MIB);
    let log = daemon.sparse("log.img", 512 * MIB);
    // The clone hydrates slowly underneath while the filesystem is used through log-writes.
    daemon.create("vol", &format!(
        "0 131072 clone {} {} {} 16 0 6 hydration_threshold 64 hydration_batch_size 4 max_hydration_rate 8192",
        meta.display(), dest.display(), source.display()
    ));
    daemon.create("lw", &format!("0 131072 log-writes vol {}", log.display()));
    churn_and_remove(&daemon, "lw", |_| {});
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
    let daemon = fuse_daemon("fuse-thin-log");
    let disk = daemon.sparse("disk.img", (META_MIB + DATA_MIB) * MIB);
    let log = daemon.sparse("log.img", 1024 * MIB);
    pool_over_one_log(&daemon, &disk, &log);
    let reference = daemon.dir.path("reference");
    std::fs::create_dir_all(&reference).unwrap();
    ext4_and_snapshots_on_the_pool(&daemon, &reference);
    for name in ["pool", "data", "meta", "lw"] {
        daemon.udm(&["remove", name]);
    }

    // The check at each point, in a second daemon: the pool as the power cut left it,
    // opened read-only on copies of its two devices.
    let checker = Daemon::start("thin-log-check");
    let replay = daemon.sparse("replay.img", (META_MIB + DATA_MIB) * MIB);
    let work = daemon.dir.path("point");
    std::fs::create_dir_all(&work).unwrap();
    let script = daemon.dir.path("check-point.sh");
    std::fs::write(&script, point_check(&checker, &work, &replay, &reference)).unwrap();
    let fsck = format!("sh {}", script.display());
    let args = [
        "--check",
        "fua",
        "--fsck",
        &fsck,
        "--check-after-mark",
        "mkfs",
    ];
    let out = daemon.replay_log(&log, &replay, &args);
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

const META_MIB: u64 = 4;
const DATA_MIB: u64 = 128;
const VOLUME_MIB: u64 = 64;

fn sectors(mib: u64) -> u64 {
    mib * MIB / 512
}

fn volume_table(id: u32) -> String {
    format!("0 {} thin pool {id}", sectors(VOLUME_MIB))
}

/// `lw`, log-writes over `disk` logging onto `log`; `meta` and `data`, linear pieces of it;
/// and `pool`, a thin pool on them with thin device 1.
fn pool_over_one_log(daemon: &Daemon, disk: &Path, log: &Path) {
    let lw = format!(
        "0 {} log-writes {} {}",
        sectors(META_MIB + DATA_MIB),
        disk.display(),
        log.display()
    );
    daemon.create("lw", &lw);
    daemon.create("meta", &format!("0 {} linear lw 0", sectors(META_MIB)));
    let data = format!("0 {} linear lw {}", sectors(DATA_MIB), sectors(META_MIB));
    daemon.create("data", &data);
    let pool = format!("0 {} thin-pool meta data 128 0", sectors(DATA_MIB));
    daemon.create("pool", &pool);
    daemon.udm(&["message", "pool", "0", "create_thin", "1"]);
}

/// ext4 on volume 1, changed while snapshots 2, 3 (of 2) and 4 are taken; a copy of each
/// snapshot as taken goes to `reference`, and they still read so at the end.
fn ext4_and_snapshots_on_the_pool(daemon: &Daemon, reference: &Path) {
    daemon.create("vol", &volume_table(1));
    let dev = Loop::attach(daemon, "vol");
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
    let keep = |id: u32| {
        daemon.create("snap", &volume_table(id));
        "snap".to_string()
    };
    let copy_snapshot = |id: u32| {
        let copy = reference.join(format!("v{id}.img"));
        tool("nbdcopy", &[&daemon.uri(&keep(id)), copy.to_str().unwrap()]);
        daemon.udm(&["remove", "snap"]);
    };
    let linux = mnt.join("linux");
    tool("cp", &["-r", "/usr/include/linux", linux.to_str().unwrap()]);
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
    tool("rm", &["-rf", linux.to_str().unwrap()]);
    tool("sync", &[]);
    tool("fstrim", &[mnt.to_str().unwrap()]);
    churn(&mnt.join("again"));
    mounted.unmount();
    drop(dev);
    remove_once_released(daemon, "vol");
    // The snapshots hold what they held when taken, here and (in the replay) at every point.
    for id in [2, 3, 4] {
        let copy = reference.join(format!("v{id}.img"));
        same_content(&daemon.uri(&keep(id)), copy.to_str().unwrap());
        daemon.udm(&["remove", "snap"]);
    }
}

/// The script `replay-log --fsck` runs at each point: copies the pool's two devices out of
/// `replay` into `work`, thin_checks the metadata, opens the pool read-only in `checker`
/// and checks every thin device in it with e2fsck (and the snapshots against `reference`),
/// noting each device checked in `work/checked`.
fn point_check(checker: &Daemon, work: &Path, replay: &Path, reference: &Path) -> String {
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
    )
}
