//! Real filesystems through the FUSE export: made, filled from a tarball, checked file by
//! file and with fsck, on linear, on a clone while it hydrates and on thin volumes; fio on a
//! file in the filesystem across live table swaps.

use super::*;

over_both_transports!(
    ext4_and_xfs_on_linear:
    ext4_and_xfs_on_linear_through_fuse_over_io_uring_and_a_loop_device,
    ext4_and_xfs_on_linear_through_fuse_over_dev_fuse_and_a_loop_device
);

fn ext4_and_xfs_on_linear(uring: &str) {
    let daemon = fuse_daemon_over(&format!("fuse-linear-{uring}"), uring);
    let tarball = real_tarball(&daemon.dir.0);
    for fs in ["ext4", "xfs"] {
        let disk = daemon.sparse(&format!("{fs}.img"), 512 * MIB);
        daemon.create(
            fs,
            &format!("0 {} linear {} 0", 512 * MIB / 512, disk.display()),
        );
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
    // Long on purpose: one end-to-end story (source image, clone, mount, hydrate, fstrim, compare) whose steps depend on each other.
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
    let dest = daemon.sparse("dest.img", 256 * MIB);
    let meta = daemon.sparse("meta.img", 4 * MIB);
    daemon.create(
        "slow",
        &format!(
            "0 524288 delay {} 0 1 {} 0 0",
            source.display(),
            source.display()
        ),
    );
    daemon.create("vol", &format!(
        "0 524288 clone {} {} slow 8 1 no_hydration 4 hydration_threshold 256 hydration_batch_size 64",
        meta.display(), dest.display()
    ));
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
    let meta = daemon.sparse("pool.meta", 16 * MIB);
    let data = daemon.sparse("pool.data", 512 * MIB);
    daemon.create("pool", &thin_pool_table(&meta, &data, 512 * MIB, "0"));
    daemon.udm(&["message", "pool", "0", "create_thin", "1"]);
    let volume = |name: &str, id: u32| {
        let table = format!("0 {} thin pool {id}", 384 * MIB / 512);
        daemon.create(name, &table);
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

over_both_transports!(
    fio_across_live_table_swaps:
    fio_verifies_a_file_in_the_filesystem_across_live_table_swaps_over_io_uring,
    fio_verifies_a_file_in_the_filesystem_across_live_table_swaps_over_dev_fuse
);

fn fio_across_live_table_swaps(uring: &str) {
    let daemon = fuse_daemon_over(&format!("fuse-fio-{uring}"), uring);
    let disk = daemon.sparse("disk.img", 256 * MIB);
    let one = format!("0 524288 linear {} 0", disk.display());
    let two = format!(
        "0 262144 linear {} 0\n262144 262144 linear {} 262144",
        disk.display(),
        disk.display()
    );
    daemon.create("vol", &one);
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

#[test]
fn xfs_made_on_a_clone_while_it_hydrates() {
    let daemon = fuse_daemon("fuse-clone-xfs");
    let tarball = real_tarball(&daemon.dir.0);
    // An old, unrelated volume as the source: the new filesystem overwrites it while the
    // clone copies it underneath.
    let source = daemon.dir.path("source.img");
    pattern_file(&source, 512 * MIB as usize, 8);
    let dest = daemon.sparse("dest.img", 512 * MIB);
    let meta = daemon.sparse("meta.img", 4 * MIB);
    daemon.create("vol", &format!(
        "0 1048576 clone {} {} {} 16 0 6 hydration_threshold 64 hydration_batch_size 16 max_hydration_rate 65536",
        meta.display(), dest.display(), source.display()
    ));
    let dev = Loop::attach(&daemon, "vol");
    // Without discarding the device first: mkfs.xfs's discard of the whole device would mark
    // every region hydrated before the filesystem exists, and nothing would race the copy.
    tool("mkfs.xfs", &["-q", "-f", "-K", &dev.0]);
    fill_and_check("xfs", &dev.0, &daemon.dir.path("mnt"), &tarball);
    let out = daemon.udm(&["wait", "vol", "--progress"]);
    assert!(out.ends_with("hydration complete"));
    fsck("xfs", &dev.0);
    drop(dev);
    // Hydrated: the destination alone holds the filesystem.
    fsck("xfs", dest.to_str().unwrap());
}
