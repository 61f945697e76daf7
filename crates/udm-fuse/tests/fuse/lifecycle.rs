//! A mount's life: dead mounts recovered, busy unmounts, configurations refused, and the
//! daemon marked as an I/O flusher.

use super::*;

const CHILD_MOUNT: &str = "UDM_FUSE_TEST_CHILD_MOUNT";

/// Not a test of its own: the child process of `dead_mounts_are_recovered`, which mounts and
/// then waits to be killed.
#[test]
fn child_mounts_and_waits_to_be_killed() {
    let Some(mnt) = std::env::var_os(CHILD_MOUNT) else {
        return;
    };
    let catalog = Arc::new(Devices::default());
    catalog.add_memory("vol", MIB);
    let export = FuseExport::mount(Path::new(&mnt), catalog, FuseConfig::default()).unwrap();
    let mut out = std::io::stdout();
    writeln!(out, "mounted").unwrap();
    out.flush().unwrap();
    std::thread::sleep(Duration::from_secs(600));
    drop(export);
}

/// Mounts in a child process and kills it with SIGKILL: the mount stays, dead.
fn leave_dead_mount(mnt: &Path) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "lifecycle::child_mounts_and_waits_to_be_killed",
            "--nocapture",
        ])
        .env(CHILD_MOUNT, mnt)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // The test harness prints its own lines first.
    let mounted = BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
        .any(|line| line == "mounted");
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(mounted, "the child did not mount");
    assert_dead(mnt);
}

/// A dead mount fails every access with ENOTCONN, once the kernel has torn the connection
/// down: an io_uring connection's teardown goes on after its server process is gone, and
/// fails the requests it catches with ECONNABORTED or ECANCELED.
pub fn assert_dead(mnt: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let errno = errno_of(std::fs::metadata(mnt));
        if errno == libc::ENOTCONN {
            return;
        }
        assert!(
            errno == libc::ECONNABORTED || errno == libc::ECANCELED,
            "{}: errno {errno}",
            mnt.display()
        );
        assert!(Instant::now() < deadline, "{} never died", mnt.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn dead_mounts_are_recovered() {
    if !can_run() {
        return;
    }
    let dir = TempDir::new("stale");
    let mnt = dir.path("mnt");
    leave_dead_mount(&mnt);
    assert!(recover_stale_mount(&mnt).unwrap());
    assert!(
        !recover_stale_mount(&mnt).unwrap(),
        "nothing left to recover"
    );
    assert!(std::fs::metadata(&mnt).unwrap().is_dir());

    // Twice dead, stacked; mount clears both by itself.
    leave_dead_mount(&mnt);
    leave_dead_mount(&mnt);
    let catalog = Arc::new(Devices::default());
    catalog.add_memory("fresh", MIB);
    let export = mount(&dir, &catalog, UringMode::Auto);
    assert_eq!(listing(&mnt), ["fresh"]);
    // A live mount is neither recovered nor mounted over.
    assert!(!recover_stale_mount(&mnt).unwrap());
    assert!(matches!(
        FuseExport::mount(&mnt, catalog.clone(), FuseConfig::default()),
        Err(FuseError::AlreadyMounted(_))
    ));
    export.unmount();
    assert!(!recover_stale_mount(&mnt).unwrap());
}

#[test]
fn a_busy_mount_is_detached_then_aborted() {
    each_transport(|mode| {
        let (dir, catalog, export) = mounted("busy", mode, |_, catalog| {
            catalog.add_memory("vol", MIB);
        });
        let held = File::open(export.mountpoint().join("vol")).unwrap();
        let mut buf = [0u8; 512];
        held.read_exact_at(&mut buf, 0).unwrap();
        let started = Instant::now();
        export.unmount();
        assert!(started.elapsed() < Duration::from_secs(30));
        // The mount is gone from the tree, and the file that kept it no longer reaches a device.
        assert!(!dir.path("mnt").join("vol").exists());
        assert_eq!(errno_of(held.read_exact_at(&mut buf, 0)), libc::ENOTCONN);
        drop(held);
        catalog.wait_closed();
    });
}

#[test]
fn bad_configurations_are_refused() {
    let dir = TempDir::new("config");
    let catalog: Arc<dyn ExportCatalog> = Arc::new(Devices::default());
    for config in [
        FuseConfig {
            workers: 0,
            ..FuseConfig::default()
        },
        FuseConfig {
            max_request: 4096,
            ..FuseConfig::default()
        },
        FuseConfig {
            max_request: 65536 + 512,
            ..FuseConfig::default()
        },
        FuseConfig {
            threads_per_queue: 0,
            ..FuseConfig::default()
        },
        // More threads than entries would leave a thread with none.
        FuseConfig {
            queue_depth: 4,
            threads_per_queue: 5,
            ..FuseConfig::default()
        },
    ] {
        let result = FuseExport::mount(&dir.path("mnt"), catalog.clone(), config);
        assert!(matches!(result, Err(FuseError::Config(_))));
    }
}

#[test]
fn io_flusher_is_set_when_the_process_may() {
    if !can_run() {
        return;
    }
    // From <linux/prctl.h>; the libc crate does not have it for Linux.
    const PR_GET_IO_FLUSHER: libc::c_int = 58;
    const CAP_SYS_RESOURCE: u32 = 24;
    // A thread of its own: the flag would otherwise stay on a test harness thread.
    let flag = std::thread::spawn(|| {
        udm_fuse::set_io_flusher();
        // SAFETY: prctl with no pointer arguments.
        unsafe { libc::prctl(PR_GET_IO_FLUSHER, 0, 0, 0, 0) }
    })
    .join()
    .unwrap();
    // Both prctls need CAP_SYS_RESOURCE, which containers often drop even for root; without
    // it set_io_flusher only warns.
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let effective = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|hex| u64::from_str_radix(hex.trim(), 16).unwrap())
        .unwrap();
    if effective & (1 << CAP_SYS_RESOURCE) != 0 {
        assert_eq!(flag, 1);
    } else {
        eprintln!("no CAP_SYS_RESOURCE: PR_SET_IO_FLUSHER is refused here");
        assert_eq!(flag, -1);
    }
}
