//! A hostile user of the FUSE files, over both transports: writes of 1 byte, unaligned
//! spans and 1 GiB; a device removed by force while a read of it is parked in the daemon; a
//! loop device detached while fio runs on it; the daemon killed with -9 under a mounted ext4;
//! rm, mv, mkdir and the like in the mount.
//! Each must end in bounded time with the daemon (or what is left of it) still answering.

use std::os::unix::fs::{FileExt, OpenOptionsExt};

use super::lifecycle::{dd_in_background, delayed_reads};
use super::*;

/// Seconds a command may take before `within` calls it hung.
const HANG: &str = "30";

/// `program args` under timeout(1): its exit status, which is 124 if it hung.
fn within(program: &str, args: &[&str]) -> std::process::ExitStatus {
    Command::new("timeout")
        .arg(HANG)
        .arg(program)
        .args(args)
        .status()
        .expect("spawn timeout")
}

over_both_transports!(hostile_write_sizes_land_exactly: hostile_write_sizes_land_exactly_over_io_uring, hostile_write_sizes_land_exactly_over_dev_fuse);

fn hostile_write_sizes_land_exactly(uring: &str) {
    let daemon = fuse_daemon_over(&format!("fuse-hostile-writes-{uring}"), uring);
    let size = 64 * MIB;
    let backing = daemon.create_linear("vol", "disk.img", size);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(daemon.dir.path("fuse/vol"))
        .unwrap();
    let same = |what: &str| {
        let through_fuse = std::fs::read(daemon.dir.path("fuse/vol")).unwrap();
        assert!(
            through_fuse == std::fs::read(&backing).unwrap(),
            "after {what}: the FUSE file and its backing file differ"
        );
    };
    assert_eq!(file.write_at(b"x", 1).unwrap(), 1);
    same("1 byte at 1");
    assert_eq!(file.write_at(&[0x79; 4097], 511).unwrap(), 4097);
    same("4097 bytes at 511");
    assert_eq!(
        file.write_at(b"zzz", size - 1).unwrap(),
        1,
        "cut at the end"
    );
    same("3 bytes at the last byte");
    let past = file.write_at(b"q", size).unwrap_err();
    assert_eq!(past.raw_os_error(), Some(libc::ENOSPC), "{past}");
    // Zeroed pages cost nothing until read: the kernel splits the write into max_write
    // requests and the device's end cuts it short.
    let gib = vec![0u8; 1 << 30];
    assert_eq!(file.write_at(&gib, 0).unwrap(), size as usize);
    same("1 GiB at 0");
    assert!(std::fs::read(&backing).unwrap().iter().all(|&b| b == 0));
}

over_both_transports!(a_forced_remove_ends_a_parked_read: a_forced_remove_ends_a_parked_read_over_io_uring, a_forced_remove_ends_a_parked_read_over_dev_fuse);

fn a_forced_remove_ends_a_parked_read(uring: &str) {
    let mut daemon = fuse_daemon_over(&format!("fuse-remove-parked-{uring}"), uring);
    let disk = daemon.sparse("slow.img", 4 * MIB);
    daemon.create("slow", &format!("0 8192 delay {} 0 3000", disk.display()));
    daemon.create_linear("fast", "fast.img", 16 * MIB);
    let fuse = daemon.dir.path("fuse");
    let mut readers: Vec<_> = (0..4)
        .map(|i| dd_in_background(&fuse.join("slow"), 4096, i))
        .collect();
    wait_for(
        || delayed_reads(&daemon, "slow") == 4,
        "four reads waiting in the delay",
    );
    daemon.udm(&["remove", "--force", "slow"]);
    let started = Instant::now();
    for dd in &mut readers {
        // Served by the timer or failed with the device: either way, over.
        dd.wait().unwrap();
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "parked reads took {took:?} to end"
    );
    assert!(!fuse.join("slow").exists());
    // Every ring entry and pool thread came back: a full queue's worth of requests at once.
    let fio = within(
        "fio",
        &[
            "--name=after",
            "--ioengine=io_uring",
            "--direct=1",
            &format!("--filename={}", fuse.join("fast").display()),
            "--rw=randread",
            "--bs=4k",
            "--iodepth=64",
            "--size=16M",
            "--io_size=32M",
            "--output=/dev/null",
        ],
    );
    assert!(fio.success(), "fio on the fast device: {fio}");
    assert!(daemon.is_running(), "{}", daemon.log());
}

over_both_transports!(a_loop_device_detached_under_fio_lets_go: a_loop_device_detached_under_fio_lets_go_over_io_uring, a_loop_device_detached_under_fio_lets_go_over_dev_fuse);

fn a_loop_device_detached_under_fio_lets_go(uring: &str) {
    let mut daemon = fuse_daemon_over(&format!("fuse-detach-fio-{uring}"), uring);
    daemon.create_linear("vol", "disk.img", 64 * MIB);
    let dev = Loop::attach(&daemon, "vol");
    let fio = Command::new("timeout")
        .args([
            HANG,
            "fio",
            "--name=detach",
            "--ioengine=io_uring",
            "--direct=1",
        ])
        .arg(format!("--filename={}", dev.0))
        .args(["--rw=randrw", "--bs=4k", "--iodepth=32", "--time_based"])
        .args(["--runtime=3", "--output=/dev/null"])
        .output_async();
    std::thread::sleep(Duration::from_secs(1));
    // Detaching a busy loop device is deferred until its last user closes it.
    daemon.udm(&["detach", &dev.0]);
    let out = fio.wait_with_output().unwrap();
    assert!(out.status.success(), "fio: {out:?}");
    remove_once_released(&daemon, "vol");
    assert!(daemon.is_running(), "{}", daemon.log());
}

over_both_transports!(a_killed_daemon_under_a_mounted_filesystem_fails_its_io_and_lets_go: a_killed_daemon_under_a_mounted_ext4_over_io_uring, a_killed_daemon_under_a_mounted_ext4_over_dev_fuse);

fn a_killed_daemon_under_a_mounted_filesystem_fails_its_io_and_lets_go(uring: &str) {
    let mut daemon = fuse_daemon_over(&format!("fuse-kill-mounted-{uring}"), uring);
    daemon.create_linear("vol", "disk.img", 64 * MIB);
    let dev = Loop::attach(&daemon, "vol");
    mkfs("ext4", &dev.0);
    let mnt = daemon.dir.path("mnt");
    let mounted = Mounted::new(&dev.0, &mnt);
    let data = mounted.path().join("data");
    tool(
        "dd",
        &[
            "if=/dev/urandom",
            &format!("of={}", data.display()),
            "bs=1M",
            "count=8",
            "status=none",
        ],
    );
    daemon.stop(libc::SIGKILL);
    // The dirty pages cannot reach the disk any more: the sync fails, it does not hang.
    let sync = within("sync", &["-f", data.to_str().unwrap()]);
    assert_ne!(
        sync.code(),
        Some(124),
        "sync hung on the dead daemon's loop device"
    );
    assert!(
        !sync.success(),
        "sync of data the dead daemon never got succeeded"
    );
    let umount = within("umount", &[mnt.to_str().unwrap()]);
    assert!(umount.success(), "umount: {umount}");
    // The bind mount under it.
    drop(mounted);
    let detach = within("losetup", &["-d", &dev.0]);
    assert!(detach.success(), "losetup -d: {detach}");
    // The next daemon recovers the dead FUSE mount and the device's bytes are readable.
    daemon.launch();
    let _ = std::fs::read(daemon.dir.path("fuse/vol")).unwrap();
}

/// dmsetup habits in the mount: rm, mkdir, mv, ln, touch of a new name, mknod, mkfifo and
/// O_TMPFILE are told "Operation not permitted" (the names are `udm`'s to make and remove),
/// not "Function not implemented", and the device is untouched.
#[test]
fn changing_names_in_the_mount_is_not_permitted() {
    let daemon = fuse_daemon("fuse-names");
    daemon.create_linear("vol", "disk.img", 4 * MIB);
    let mnt = daemon.dir.path("fuse");
    let at = |name: &str| mnt.join(name).to_str().unwrap().to_string();
    let attempts: [(&str, Vec<String>); 9] = [
        ("rm", vec!["-f".into(), at("vol")]),
        ("mkdir", vec![at("dir")]),
        ("mv", vec![at("vol"), at("vol2")]),
        ("ln", vec![at("vol"), at("hard")]),
        ("ln", vec!["-s".into(), "vol".into(), at("soft")]),
        ("touch", vec![at("new")]),
        (
            "mknod",
            vec![at("node"), "b".into(), "7".into(), "0".into()],
        ),
        ("mkfifo", vec![at("fifo")]),
        ("cp", vec!["/etc/hostname".into(), at("copy")]),
    ];
    for (program, args) in &attempts {
        let out = Command::new(program).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("Operation not permitted"),
            "{program} {args:?}: {err}"
        );
    }
    let tmpfile = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_TMPFILE)
        .open(&mnt)
        .unwrap_err();
    assert_eq!(tmpfile.raw_os_error(), Some(libc::EPERM), "{tmpfile}");
    let names: Vec<_> = std::fs::read_dir(&mnt)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["vol"]);
    assert_eq!(std::fs::metadata(at("vol")).unwrap().len(), 4 * MIB);
    assert!(!daemon.log().contains("panic"));
}
