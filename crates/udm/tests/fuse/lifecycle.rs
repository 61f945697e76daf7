//! The mount's life: a killed daemon's dead mount recovered, stops with filesystems mounted
//! and requests in flight, loop devices udm did not make, slow devices beside fast ones, and
//! /dev/fuse when io_uring is denied.

use super::*;

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
    let disk = daemon.sparse("disk.img", 64 * MIB);
    let table = format!("0 131072 linear {} 0", disk.display());
    daemon.create("vol", &table);
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

/// A process in a mount namespace of its own (`unshare -m`, private propagation), holding a
/// copy of every mount there was when it started, as a container or a service with
/// PrivateTmp does; killed on drop.
struct NamespaceHolder(std::process::Child);

impl NamespaceHolder {
    /// Starts one once `mountpoint` is mounted, and returns when its copy is there.
    fn of(mountpoint: &Path) -> NamespaceHolder {
        let child = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sleep", "1000"])
            .spawn()
            .expect("spawn unshare");
        let holder = NamespaceHolder(child);
        let mountinfo = format!("/proc/{}/mountinfo", holder.pid());
        let listed = format!(" {} ", mountpoint.display());
        wait_for(
            || {
                let comm = std::fs::read_to_string(format!("/proc/{}/comm", holder.pid()));
                comm.is_ok_and(|c| c.trim() == "sleep")
                    && std::fs::read_to_string(&mountinfo).is_ok_and(|m| m.contains(&listed))
            },
            "the new mount namespace to hold a copy of the FUSE mount",
        );
        holder
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for NamespaceHolder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Whether `file` (the device's backing file) starts with `len` bytes of `byte`.
fn starts_with(file: &Path, byte: u8, len: usize) -> bool {
    let data = std::fs::read(file).unwrap();
    data[..len].iter().all(|&b| b == byte)
}

/// A copy of the FUSE mount in another mount namespace keeps its connection up after the
/// daemon's own unmount: the stop hung for ever after "flushing devices and stopping", deaf to
/// more signals, until that namespace ended. Now the devices are flushed first, the log names
/// who holds the mount, and the connection is aborted after --stop-timeout (10 s by default).
#[test]
fn a_mount_held_by_another_namespace_is_aborted_after_the_stop_timeout() {
    let mut daemon = fuse_daemon("fuse-held-elsewhere");
    let disk = daemon.create_linear("vol", "disk.img", 16 * MIB);
    std::fs::write(daemon.dir.path("fuse/vol"), vec![0x5au8; 1 << 20]).unwrap();
    let holder = NamespaceHolder::of(&daemon.dir.path("fuse"));

    let asked = Instant::now();
    let stopped = signal_and_wait(&mut daemon, libc::SIGTERM, Duration::from_secs(40));
    let took = asked.elapsed();
    let log = daemon.log();
    assert!(
        stopped,
        "the stop hangs on the other namespace's mount:\n{log}"
    );
    assert!(
        took >= Duration::from_secs(9),
        "stopped in {took:?}, before the stop timeout"
    );
    assert!(
        log.contains(&format!("pid {} sleep", holder.pid()))
            && log.contains("aborted the connection"),
        "{log}"
    );
    // Flushed before the wait, and the file is the same after it.
    let flushed = log.find("flushing devices").unwrap();
    assert!(log[flushed..].contains("still in use"), "{log}");
    assert!(starts_with(&disk, 0x5a, 1 << 20));
}

/// A second signal does not wait out --stop-timeout.
#[test]
fn a_second_signal_aborts_a_mount_held_by_another_namespace_at_once() {
    let mut daemon = Daemon::start_with(
        "fuse-held-second-signal",
        &["--fuse", "{dir}/fuse", "--stop-timeout", "10m"],
    );
    daemon.create_linear("vol", "disk.img", 16 * MIB);
    let holder = NamespaceHolder::of(&daemon.dir.path("fuse"));
    unsafe { libc::kill(daemon.pid() as i32, libc::SIGTERM) };
    wait_for(
        || {
            daemon
                .log()
                .contains(&format!("pid {} sleep", holder.pid()))
        },
        "the log to name the namespace that holds the mount",
    );
    assert!(daemon.log().contains("up to 600s"), "{}", daemon.log());
    assert!(
        signal_and_wait(&mut daemon, libc::SIGINT, Duration::from_secs(10)),
        "a second signal does not stop the daemon:\n{}",
        daemon.log()
    );
    assert!(daemon.log().contains("aborted the connection"));
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
    let plain = daemon.sparse("plain.img", 4 * MIB);
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
    daemon.create("z", "0 8192 zero");
    let mine = Loop::attach(&daemon, "z");
    daemon.udm(&["detach", &mine.0]);
    assert_eq!(backing_file(&mine.0), None);
}

/// A table that reads a device's own FUSE file, or a loop device on it, loops every read
/// through the kernel back into udm until the FUSE queues fill and the mount hangs for good
/// (found by hand: `dd` on the loop device stuck in D state, the mount dead). Such paths are
/// the device they lead to, and the cycle check refuses them as it refuses names.
#[test]
fn tables_reading_udms_own_fuse_files_are_held_to_the_cycle_check() {
    let daemon = fuse_daemon("fuse-cycle");
    let disk = daemon.sparse("disk.img", 4 * MIB);
    daemon.create("vol", &format!("0 8192 linear {} 0", disk.display()));
    let dev = Loop::attach(&daemon, "vol");
    let file = daemon.dir.path("fuse/vol");
    for path in [dev.0.clone(), file.display().to_string()] {
        daemon.udm(&["suspend", "vol"]);
        let err = daemon.udm_err(&["load", "vol", "--table", &format!("0 8192 linear {path} 0")]);
        assert!(
            err.contains("reads udm's own device 'vol'") && err.contains("depend on itself"),
            "{err}"
        );
        daemon.udm(&["resume", "vol"]);
    }
    // Through another device: top reads vol's loop device, so vol may not read top.
    daemon.create("top", &format!("0 8192 linear {} 0", dev.0));
    let err = daemon.udm_err(&["load", "vol", "--table", "0 8192 linear top 0"]);
    assert!(err.contains("depend on itself"), "{err}");
    // And nothing hangs: the device still reads through its loop device.
    dd(
        Path::new(&dev.0),
        Path::new("/dev/null"),
        &["bs=4k", "count=4", "iflag=direct"],
    );
    daemon.udm(&["remove", "top"]);
}

/// `dd` reading one block of `bs` bytes at block `skip` of `file` with O_DIRECT (one FUSE
/// request), in the background.
pub(super) fn dd_in_background(file: &Path, bs: usize, skip: usize) -> std::process::Child {
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
pub(super) fn delayed_reads(daemon: &Daemon, name: &str) -> u64 {
    let json: serde_json::Value =
        serde_json::from_str(&daemon.udm(&["status", name, "--json"])).unwrap();
    let status = json["targets"][0]["status"].as_str().unwrap().to_string();
    status.split(' ').next().unwrap().parse().unwrap()
}

/// A daemon with a device `slow` whose reads take `delay_ms` and which the io_uring engine
/// cannot take (a delay target over `dust`, which never maps: its reads sleep on a pool
/// thread) and a `linear` device `fast`, both in its FUSE mount.
fn slow_and_fast(tag: &str, args: &[&str], delay_ms: u32) -> Daemon {
    let mut all = vec!["--fuse", "{dir}/fuse"];
    all.extend_from_slice(args);
    let daemon = Daemon::start_with(tag, &all);
    let disk = daemon.sparse("slow.img", 4 * MIB);
    daemon.create(
        "unmapped",
        &format!("0 8192 dust {} 0 4096", disk.display()),
    );
    daemon.create("slow", &format!("0 8192 delay unmapped 0 {delay_ms}"));
    daemon.create_linear("fast", "fast.img", 64 * MIB);
    daemon
}

#[test]
fn over_io_uring_delayed_reads_wait_without_taking_pool_threads() {
    // One pool thread; a delay over a file maps, so its reads wait for their timer parked
    // in their ring entries, all at once, rather than in turn on the pool.
    let daemon = one_uring_thread("fuse-delay-parked");
    let disk = daemon.sparse("slow.img", 4 * MIB);
    daemon.create("slow", &format!("0 8192 delay {} 0 2000", disk.display()));
    let fuse = daemon.dir.path("fuse");
    let started = Instant::now();
    let readers: Vec<_> = (0..6)
        .map(|i| dd_in_background(&fuse.join("slow"), 4096, i))
        .collect();
    wait_for(
        || delayed_reads(&daemon, "slow") == 6,
        "six delayed reads at once",
    );
    for mut dd in readers {
        assert!(dd.wait().unwrap().success());
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(8),
        "six reads delayed 2 s each took {took:?}"
    );
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

over_both_transports!(
    a_stop_with_requests_in_flight_ends_in_bounded_time:
    a_stop_with_requests_in_flight_ends_in_bounded_time_over_io_uring,
    a_stop_with_requests_in_flight_ends_in_bounded_time_over_dev_fuse
);

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

#[test]
fn over_io_uring_first_writes_to_a_snapshot_origin_save_the_old_data_first() {
    // A first write to a chunk waits, parked in its ring entry, for the chunk's copy into
    // the snapshot and its commit; then it goes to the engine.
    let daemon = one_uring_thread("fuse-snapshot-origin");
    let origin = daemon.dir.path("origin.img");
    pattern_file(&origin, 4 * MIB as usize, 7);
    let original = std::fs::read(&origin).unwrap();
    let cow = daemon.sparse("snap.cow", 4 * MIB);
    let table = format!("0 8192 snapshot-origin {}", origin.display());
    daemon.create("base", &table);
    let table = format!("0 8192 snapshot {} {} P 8", origin.display(), cow.display());
    daemon.create("snap", &table);
    let fuse = daemon.dir.path("fuse");
    // Eight writes at once, to chunks of their own and to one chunk together.
    let writers: Vec<_> = (0..8)
        .map(|i| {
            Command::new("dd")
                .args(["if=/dev/zero", "bs=4096", "count=1", "oflag=direct"])
                .arg(format!("of={}", fuse.join("base").display()))
                .arg(format!("seek={}", if i < 6 { i * 3 } else { 100 }))
                .args(["conv=notrunc", "status=none"])
                .spawn()
                .unwrap()
        })
        .collect();
    for mut dd in writers {
        assert!(dd.wait().unwrap().success());
    }
    let now = std::fs::read(fuse.join("base")).unwrap();
    let kept = std::fs::read(fuse.join("snap")).unwrap();
    assert!(
        kept == original,
        "the snapshot lost the data the writes replaced"
    );
    for block in [0, 3, 6, 9, 12, 15, 100] {
        let at = block * 4096;
        assert!(now[at..at + 4096].iter().all(|&b| b == 0), "block {block}");
    }
    assert!(now[4096..8192] == original[4096..8192]);
}

over_both_transports!(
    a_device_on_a_remote_export_reads_and_writes_through_its_client:
    over_io_uring_a_device_on_a_remote_export_reads_and_writes_through_its_client,
    over_dev_fuse_a_device_on_a_remote_export_reads_and_writes_through_its_client
);

/// Over io_uring, a remote export's client moves a request's data itself (a transfer, with
/// the ring entry's payload buffer) and answers on its reader thread; a FUSE queue that
/// parked such a request without handing it the buffer failed every one with EIO.
fn a_device_on_a_remote_export_reads_and_writes_through_its_client(uring: &str) {
    let server = Daemon::start(&format!("fuse-remote-server-{uring}"));
    let disk = server.dir.path("disk.img");
    server.create_linear("vol", "disk.img", 8 * MIB);
    let daemon = fuse_daemon_over(&format!("fuse-remote-client-{uring}"), uring);
    daemon.create("remote", &format!("0 16384 linear {} 0", server.uri("vol")));
    let file = daemon.dir.path("fuse").join("remote");
    let data = daemon.dir.path("data.bin");
    dd(Path::new("/dev/urandom"), &data, &["count=32"]);
    dd(
        &data,
        &file,
        &["seek=16", "oflag=direct", "conv=notrunc,fsync"],
    );
    let back = daemon.dir.path("back.bin");
    dd(&file, &back, &["skip=16", "count=32", "iflag=direct"]);
    let written = std::fs::read(&data).unwrap();
    assert!(
        std::fs::read(&back).unwrap() == written,
        "read back differs"
    );
    let stored = std::fs::read(&disk).unwrap();
    assert!(
        stored[1 << 20..3 << 20] == written[..],
        "the export holds other data"
    );
}

/// dd from `from` to `to` in 64 KiB blocks, with `operands` (offsets, O_DIRECT, sync).
fn dd(from: &Path, to: &Path, operands: &[&str]) {
    let (input, output) = (
        format!("if={}", from.display()),
        format!("of={}", to.display()),
    );
    tool(
        "dd",
        &[&[input.as_str(), output.as_str(), "bs=64k"], operands].concat(),
    );
}

/// A daemon whose FUSE mount is served over io_uring by one thread, so that requests meet
/// in that thread's ring.
fn one_uring_thread(tag: &str) -> Daemon {
    let args = [
        "--fuse",
        "{dir}/fuse",
        "--fuse-uring",
        "on",
        "--fuse-threads",
        "1",
    ];
    Daemon::start_with(tag, &args)
}
