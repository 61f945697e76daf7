//! The FUSE export against the real kernel: files through std::fs, fallocate, a catalog that
//! changes under the mount, loop devices with ext4 and fio on top, dead mounts and busy
//! unmounts. Needs root and /dev/fuse (skipped without them). Every loop device and mount is
//! undone by a guard, also when a test fails.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use udm_block::{
    AlignedBuf, BlockDevice, ExportCatalog, FileDevice, MapOp, Mapping, MemoryDevice, OpenMode,
    WriteFlags, ZeroFlags,
};
use udm_fuse::{recover_stale_mount, FuseConfig, FuseError, FuseExport, Transport, UringMode};
use udm_testkit::{pattern, Devices, TempDir};

pub const MIB: u64 = 1 << 20;

struct TestLog;

impl log::Log for TestLog {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= log::Level::Info
    }
    fn log(&self, record: &log::Record) {
        if self.enabled(record.metadata()) {
            eprintln!("{} {}", record.level(), record.args());
        }
    }
    fn flush(&self) {}
}

/// The tests mount filesystems and attach loop devices: without root they cannot run.
pub fn can_run() -> bool {
    if log::set_logger(&TestLog).is_ok() {
        log::set_max_level(log::LevelFilter::Info);
    }
    // SAFETY: plain getter.
    let root = unsafe { libc::geteuid() } == 0;
    let fuse = Path::new("/dev/fuse").exists();
    if !root || !fuse {
        eprintln!("skipped: needs root and /dev/fuse");
    }
    root && fuse
}

/// Runs a check once over /dev/fuse and once over io_uring (if the tests can run at all).
pub fn each_transport(check: impl Fn(UringMode)) {
    if !can_run() {
        return;
    }
    for mode in [UringMode::Off, UringMode::On] {
        eprintln!("over {mode:?}:");
        check(mode);
    }
}

pub fn mount(dir: &TempDir, catalog: &Arc<Devices>, mode: UringMode) -> FuseExport {
    mount_with(
        dir,
        catalog,
        FuseConfig {
            io_uring: mode,
            ..FuseConfig::default()
        },
    )
}

/// Mounts, and checks that requests come the way `config.io_uring` asked for.
pub fn mount_with(dir: &TempDir, catalog: &Arc<Devices>, config: FuseConfig) -> FuseExport {
    let mode = config.io_uring;
    let export = FuseExport::mount(&dir.path("mnt"), catalog.clone(), config).expect("mount");
    let transport = export.transport();
    match mode {
        UringMode::Off => assert!(matches!(transport, Transport::DevFuse { .. })),
        UringMode::On => assert!(matches!(transport, Transport::IoUring { .. })),
        UringMode::Auto => {}
    }
    export
}

pub fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A loop device on a file, detached on drop.
pub struct LoopDevice(pub String);

impl LoopDevice {
    pub fn attach(file: &Path) -> LoopDevice {
        let out = run(Command::new("losetup")
            .args(["--direct-io=on", "-f", "--show"])
            .arg(file));
        LoopDevice(out.trim().to_string())
    }

    /// Whether the kernel took the file with direct I/O (losetup only warns if not).
    pub fn direct_io(&self) -> bool {
        let name = Path::new(&self.0).file_name().unwrap().to_string_lossy();
        std::fs::read_to_string(format!("/sys/block/{name}/loop/dio"))
            .map(|s| s.trim() == "1")
            .unwrap_or(false)
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}

/// A filesystem mounted with mount(8), unmounted on drop.
pub struct Mounted(pub PathBuf);

impl Mounted {
    pub fn new(device: &str, at: &Path) -> Mounted {
        std::fs::create_dir_all(at).unwrap();
        run(Command::new("mount").arg(device).arg(at));
        Mounted(at.to_path_buf())
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

pub fn fallocate(file: &std::fs::File, mode: i32, offset: u64, len: u64) -> std::io::Result<()> {
    // SAFETY: plain syscall on an open file.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), mode, offset as i64, len as i64) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// A memory device that records the largest requests and the flushes it saw.
struct Recording {
    inner: MemoryDevice,
    largest_read: AtomicU64,
    largest_write: AtomicU64,
    flushes: AtomicU64,
}

impl Recording {
    fn new(size: u64) -> Arc<Recording> {
        Arc::new(Recording {
            inner: MemoryDevice::new(size),
            largest_read: AtomicU64::new(0),
            largest_write: AtomicU64::new(0),
            flushes: AtomicU64::new(0),
        })
    }
}

impl BlockDevice for Recording {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> udm_block::Result<()> {
        self.largest_read
            .fetch_max(buf.len() as u64, Ordering::SeqCst);
        self.inner.read(offset, buf)
    }
    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> udm_block::Result<()> {
        self.largest_write
            .fetch_max(buf.len() as u64, Ordering::SeqCst);
        self.inner.write(offset, buf, flags)
    }
    fn flush(&self) -> udm_block::Result<()> {
        self.flushes.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> udm_block::Result<()> {
        self.inner.write_zeroes(offset, len, flags)
    }
}

fn open_rw(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().read(true).write(true).open(path)
}

fn errno_of<T: std::fmt::Debug>(result: std::io::Result<T>) -> i32 {
    result.expect_err("should fail").raw_os_error().unwrap()
}

fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn devices_are_files_with_their_size_and_mode() {
    each_transport(|mode| {
        let dir = TempDir::new("attrs");
        let catalog = Arc::new(Devices::default());
        catalog.add_memory("vol", 8 * MIB);
        catalog.add("ro", Arc::new(MemoryDevice::new(MIB)), true);
        let export = mount(&dir, &catalog, mode);
        let mnt = export.mountpoint().to_path_buf();
        assert_eq!(listing(&mnt), ["ro", "vol"]);
        let vol = std::fs::metadata(mnt.join("vol")).unwrap();
        assert!(vol.is_file());
        assert_eq!(vol.len(), 8 * MIB);
        assert_eq!(vol.permissions().mode() & 0o7777, 0o600);
        let ro = std::fs::metadata(mnt.join("ro")).unwrap();
        assert_eq!(ro.len(), MIB);
        assert_eq!(ro.permissions().mode() & 0o7777, 0o400);
        // Inode numbers stay put while the export lives.
        assert_eq!(vol.ino(), std::fs::metadata(mnt.join("vol")).unwrap().ino());
        assert_ne!(vol.ino(), ro.ino());
        assert_eq!(errno_of(std::fs::metadata(mnt.join("nope"))), libc::ENOENT);
        let root = std::fs::metadata(&mnt).unwrap();
        assert!(root.is_dir());
        // Files come only from the catalog.
        assert!(File::create(mnt.join("new")).is_err());
        assert!(std::fs::create_dir(mnt.join("dir")).is_err());
        assert!(std::fs::remove_file(mnt.join("vol")).is_err());
        assert_eq!(listing(&mnt), ["ro", "vol"]);
        // Changes other than the size are accepted (and have no effect).
        std::fs::set_permissions(mnt.join("vol"), std::fs::Permissions::from_mode(0o644)).unwrap();
        // A whole read ends at the device size.
        assert_eq!(
            std::fs::read(mnt.join("ro")).unwrap(),
            vec![0u8; MIB as usize]
        );
        export.unmount();
        catalog.wait_closed();
        assert!(!dir.path("mnt").join("vol").exists(), "still mounted");
    });
}

#[test]
fn aligned_and_unaligned_reads_and_writes() {
    each_transport(|mode| {
        let dir = TempDir::new("rw");
        let catalog = Arc::new(Devices::default());
        let device = Recording::new(4 * MIB);
        catalog.add("vol", device.clone(), false);
        let export = mount(&dir, &catalog, mode);
        let path = export.mountpoint().join("vol");
        let mut model = vec![0u8; 4 * MIB as usize];
        let file = open_rw(&path).unwrap();

        let mut write = |file: &File, offset: usize, data: &[u8]| {
            file.write_all_at(data, offset as u64).unwrap();
            model[offset..offset + data.len()].copy_from_slice(data);
        };
        write(&file, 0, &pattern(64 * 1024, 1));
        write(&file, MIB as usize, &pattern(MIB as usize, 2));
        // Unaligned: within one sector, across a boundary, long with both ends partial.
        write(&file, 1000, b"abc");
        write(&file, 510, b"across");
        write(&file, 3 * MIB as usize + 77, &pattern(100_000, 3));
        // Byte by byte, like dd bs=1.
        for (i, b) in b"one byte at a time".iter().enumerate() {
            write(&file, 2 * MIB as usize + 511 + i, &[*b]);
        }
        file.sync_all().unwrap();
        assert!(
            device.flushes.load(Ordering::SeqCst) >= 1,
            "fsync reached the device"
        );

        let check = |offset: usize, len: usize| {
            let mut buf = vec![0u8; len];
            file.read_exact_at(&mut buf, offset as u64).unwrap();
            assert!(buf == model[offset..offset + len], "{offset}+{len} differs");
        };
        check(0, 64 * 1024);
        check(1, 1);
        check(999, 5);
        check(500, 20);
        check(MIB as usize - 3, 700);
        check(2 * MIB as usize + 500, 40);
        check(3 * MIB as usize, MIB as usize);
        // Reads at and across the end are short, like a regular file's.
        let mut tail = vec![0u8; 100];
        assert_eq!(file.read_at(&mut tail, 4 * MIB - 10).unwrap(), 10);
        assert_eq!(file.read_at(&mut tail, 4 * MIB).unwrap(), 0);
        // cat: the whole file, in whatever pieces the reader chooses.
        assert!(std::fs::read(&path).unwrap() == model);
        // What the device holds is what was written.
        let mut direct = vec![0u8; model.len()];
        device.inner.read(0, &mut direct).unwrap();
        assert!(direct == model);
        drop(file);
        catalog.wait_closed();
        export.unmount();
    });
}

#[test]
fn fallocate_punches_and_zeroes() {
    each_transport(|mode| {
        let dir = TempDir::new("falloc");
        let catalog = Arc::new(Devices::default());
        catalog.add_memory("vol", MIB);
        let export = mount(&dir, &catalog, mode);
        let file = open_rw(&export.mountpoint().join("vol")).unwrap();
        let ones = vec![0xffu8; MIB as usize];
        file.write_all_at(&ones, 0).unwrap();
        let keep = libc::FALLOC_FL_KEEP_SIZE;
        fallocate(&file, libc::FALLOC_FL_PUNCH_HOLE | keep, 4096, 8192).unwrap();
        fallocate(&file, libc::FALLOC_FL_ZERO_RANGE, 65536, 4096).unwrap();
        // Unaligned ends are zeroed too, and nothing beside them.
        fallocate(&file, libc::FALLOC_FL_PUNCH_HOLE | keep, 100_001, 2000).unwrap();
        fallocate(&file, libc::FALLOC_FL_ZERO_RANGE | keep, 200_100, 100).unwrap();
        // Beyond the end with KEEP_SIZE: only the part within the device.
        fallocate(&file, libc::FALLOC_FL_PUNCH_HOLE | keep, MIB - 512, 4096).unwrap();
        let mut expected = ones.clone();
        for (offset, len) in [
            (4096, 8192),
            (65536, 4096),
            (100_001, 2000),
            (200_100, 100),
            (MIB as usize - 512, 512),
        ] {
            expected[offset..offset + len].fill(0);
        }
        let mut got = vec![0u8; MIB as usize];
        file.read_exact_at(&mut got, 0).unwrap();
        let first_difference = got.iter().zip(&expected).position(|(a, b)| a != b);
        assert_eq!(first_difference, None);
        // Plain allocation is a no-op within the device; growing it is not possible.
        fallocate(&file, 0, 0, MIB).unwrap();
        assert_eq!(errno_of(fallocate(&file, 0, 0, 2 * MIB)), libc::EOPNOTSUPP);
        assert_eq!(
            errno_of(fallocate(&file, libc::FALLOC_FL_COLLAPSE_RANGE, 0, 4096)),
            libc::EOPNOTSUPP
        );
        drop(file);
        export.unmount();
    });
}

#[test]
fn writes_stop_at_the_end_and_the_size_cannot_change() {
    each_transport(|mode| {
        let dir = TempDir::new("end");
        let catalog = Arc::new(Devices::default());
        catalog.add_memory("vol", MIB);
        let export = mount(&dir, &catalog, mode);
        let path = export.mountpoint().join("vol");
        let file = open_rw(&path).unwrap();
        assert_eq!(file.write_at(&[7u8; 4096], MIB - 1024).unwrap(), 1024);
        assert_eq!(errno_of(file.write_at(&[7u8; 10], MIB)), libc::ENOSPC);
        assert_eq!(errno_of(file.set_len(2 * MIB)), libc::EINVAL);
        assert_eq!(errno_of(file.set_len(0)), libc::EINVAL);
        file.set_len(MIB).unwrap();
        // O_TRUNC is ignored, as on a block device: the data stays.
        let truncating = OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        drop(truncating);
        let mut tail = [0u8; 4];
        file.read_exact_at(&mut tail, MIB - 4).unwrap();
        assert_eq!(tail, [7; 4]);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), MIB);
        drop(file);
        export.unmount();
    });
}

#[test]
fn read_only_devices_refuse_writes() {
    each_transport(|mode| {
        let dir = TempDir::new("ro");
        let catalog = Arc::new(Devices::default());
        let device = Arc::new(MemoryDevice::new(MIB));
        device.write(0, &[5u8; 512], WriteFlags::default()).unwrap();
        catalog.add("ro", device, true);
        let export = mount(&dir, &catalog, mode);
        let path = export.mountpoint().join("ro");
        assert_eq!(errno_of(open_rw(&path)), libc::EROFS);
        assert_eq!(
            errno_of(OpenOptions::new().write(true).open(&path)),
            libc::EROFS
        );
        let data = std::fs::read(&path).unwrap();
        assert_eq!(&data[..512], &[5u8; 512][..]);
        export.unmount();
        catalog.wait_closed();
    });
}

#[test]
fn devices_come_and_go_with_the_catalog() {
    each_transport(|mode| {
        let dir = TempDir::new("catalog");
        let catalog = Arc::new(Devices::default());
        catalog.add_memory("a", MIB);
        let export = mount(&dir, &catalog, mode);
        let mnt = export.mountpoint().to_path_buf();
        assert_eq!(listing(&mnt), ["a"]);
        let ino = std::fs::metadata(mnt.join("a")).unwrap().ino();

        catalog.add_memory("b", 2 * MIB);
        assert_eq!(listing(&mnt), ["a", "b"]);
        assert_eq!(std::fs::metadata(mnt.join("b")).unwrap().len(), 2 * MIB);

        // An open file keeps its device even after the catalog drops it.
        let held = open_rw(&mnt.join("a")).unwrap();
        held.write_all_at(b"still here", 0).unwrap();
        catalog.remove("a");
        assert_eq!(listing(&mnt), ["b"]);
        assert_eq!(errno_of(std::fs::metadata(mnt.join("a"))), libc::ENOENT);
        assert_eq!(errno_of(File::open(mnt.join("a"))), libc::ENOENT);
        let mut buf = [0u8; 10];
        held.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(&buf, b"still here");
        drop(held);
        catalog.wait_closed();

        // Back under the same name: the same inode number, the new size.
        catalog.add_memory("a", 3 * MIB);
        let again = std::fs::metadata(mnt.join("a")).unwrap();
        assert_eq!(again.len(), 3 * MIB);
        assert_eq!(again.ino(), ino);
        // Names that cannot be files are not shown.
        catalog.add_memory("x/y", MIB);
        catalog.add_memory("..", MIB);
        assert_eq!(listing(&mnt), ["a", "b"]);
        export.unmount();
    });
}

#[test]
fn large_requests_arrive_whole() {
    each_transport(|mode| {
        let dir = TempDir::new("large");
        let catalog = Arc::new(Devices::default());
        let device = Recording::new(8 * MIB);
        catalog.add("vol", device.clone(), false);
        let export = mount(&dir, &catalog, mode);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(export.mountpoint().join("vol"))
            .unwrap();
        // Page-aligned user memory: 256 pages, one request.
        let mut buf = AlignedBuf::zeroed(MIB as usize);
        buf.copy_from_slice(&pattern(MIB as usize, 9));
        file.write_all_at(&buf, MIB).unwrap();
        file.read_exact_at(&mut buf, MIB).unwrap();
        assert_eq!(device.largest_write.load(Ordering::SeqCst), MIB);
        assert_eq!(device.largest_read.load(Ordering::SeqCst), MIB);
        drop(file);
        export.unmount();
    });
}

#[test]
fn ext4_on_a_loop_device() {
    each_transport(|mode| {
        let dir = TempDir::new("ext4");
        let backing = dir.path("backing.img");
        File::create(&backing).unwrap().set_len(128 * MIB).unwrap();
        let catalog = Arc::new(Devices::default());
        let device = FileDevice::open(&backing, OpenMode::ReadWrite).unwrap();
        catalog.add("vol", Arc::new(device), false);
        let export = mount(&dir, &catalog, mode);
        let lo = LoopDevice::attach(&export.mountpoint().join("vol"));
        assert!(lo.direct_io(), "{} without direct I/O", lo.0);
        run(Command::new("mkfs.ext4").args(["-q", "-F", &lo.0]));
        let files: Vec<(String, Vec<u8>)> = (0..20)
            .map(|i| {
                (
                    format!("file{i}"),
                    pattern(1000 + i as usize * 37_777, 100 + i).to_vec(),
                )
            })
            .collect();
        {
            let fs = Mounted::new(&lo.0, &dir.path("ext4"));
            for (name, data) in &files {
                std::fs::write(fs.0.join(name), data).unwrap();
            }
            run(&mut Command::new("sync"));
            for (name, data) in &files {
                assert!(std::fs::read(fs.0.join(name)).unwrap() == *data);
            }
        }
        run(Command::new("e2fsck").args(["-fn", &lo.0]));
        // Mounted again, the files are there (read back through the device, not a cache).
        run(Command::new("blockdev").args(["--flushbufs", &lo.0]));
        {
            let fs = Mounted::new(&lo.0, &dir.path("ext4"));
            for (name, data) in &files {
                assert!(std::fs::read(fs.0.join(name)).unwrap() == *data, "{name}");
            }
        }
        drop(lo);
        catalog.wait_closed();
        export.unmount();
    });
}

#[test]
fn fio_verify_on_a_loop_device() {
    each_transport(|mode| {
        let dir = TempDir::new("fio");
        let catalog = Arc::new(Devices::default());
        catalog.add_memory("vol", 64 * MIB);
        let export = mount(&dir, &catalog, mode);
        let lo = LoopDevice::attach(&export.mountpoint().join("vol"));
        let out = run(Command::new("fio").current_dir(&dir.0).args([
            "--name=verify",
            &format!("--filename={}", lo.0),
            "--direct=1",
            "--rw=randrw",
            "--bs=4k",
            "--iodepth=16",
            "--ioengine=io_uring",
            "--size=32M",
            "--verify=crc32c",
            "--verify_state_save=0",
        ]));
        eprintln!("{out}");
        assert!(out.contains("err= 0"), "{out}");
        drop(lo);
        catalog.wait_closed();
        export.unmount();
    });
}

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
            "child_mounts_and_waits_to_be_killed",
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
        let dir = TempDir::new("busy");
        let catalog = Arc::new(Devices::default());
        catalog.add_memory("vol", MIB);
        let export = mount(&dir, &catalog, mode);
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

/// A device whose data lives in a file the engine can reach (`map()`), and whose own
/// synchronous methods fail: what succeeds through the mount was served by the engine.
struct MapOnly(FileDevice);

impl BlockDevice for MapOnly {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn read(&self, _: u64, _: &mut [u8]) -> udm_block::Result<()> {
        Err(udm_block::BlockError::NotSupported(
            "synchronous read".into(),
        ))
    }
    fn write(&self, _: u64, _: &[u8], _: WriteFlags) -> udm_block::Result<()> {
        Err(udm_block::BlockError::NotSupported(
            "synchronous write".into(),
        ))
    }
    fn flush(&self) -> udm_block::Result<()> {
        Err(udm_block::BlockError::NotSupported(
            "synchronous flush".into(),
        ))
    }
    fn map(&self, op: MapOp, offset: u64, len: u64) -> Option<Mapping> {
        self.0.map(op, offset, len)
    }
}

fn open_direct(path: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap()
}

#[test]
fn over_io_uring_mapped_requests_go_to_the_engine() {
    if !can_run() {
        return;
    }
    let dir = TempDir::new("engine");
    let backing = dir.path("backing.img");
    File::create(&backing).unwrap().set_len(8 * MIB).unwrap();
    let file = FileDevice::open(&backing, OpenMode::ReadWrite).unwrap();
    let catalog = Arc::new(Devices::default());
    catalog.add("vol", Arc::new(MapOnly(file)), false);
    let export = mount(&dir, &catalog, UringMode::On);
    let vol = open_direct(&export.mountpoint().join("vol"));
    let mut buf = AlignedBuf::zeroed(MIB as usize);
    buf.copy_from_slice(&pattern(MIB as usize, 21));
    vol.write_all_at(&buf[..4096], 4096).unwrap();
    vol.write_all_at(&buf, 2 * MIB).unwrap();
    vol.sync_all().unwrap();
    let mut back = AlignedBuf::zeroed(MIB as usize);
    vol.read_exact_at(&mut back, 2 * MIB).unwrap();
    assert!(back[..] == buf[..]);
    vol.read_exact_at(&mut back[..4096], 4096).unwrap();
    assert!(back[..4096] == buf[..4096]);
    // In the backing file, where the mapping said.
    let on_disk = std::fs::read(&backing).unwrap();
    assert!(on_disk[2 * MIB as usize..3 * MIB as usize] == buf[..]);
    // A partial sector needs read-modify-write, which only the synchronous code does.
    let plain = open_rw(&export.mountpoint().join("vol")).unwrap();
    assert_eq!(errno_of(plain.write_at(b"x", 3)), libc::EOPNOTSUPP);
    drop((vol, plain));
    catalog.wait_closed();
    export.unmount();
}

/// A device that takes `delay` to read and cannot be mapped, counting reads in progress.
struct Slow {
    inner: MemoryDevice,
    delay: Duration,
    reading: AtomicUsize,
}

impl Slow {
    fn new(size: u64, delay: Duration) -> Arc<Slow> {
        Arc::new(Slow {
            inner: MemoryDevice::new(size),
            delay,
            reading: AtomicUsize::new(0),
        })
    }

    fn wait_reading(&self, count: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.reading.load(Ordering::SeqCst) < count {
            assert!(Instant::now() < deadline, "the slow reads never started");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl BlockDevice for Slow {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> udm_block::Result<()> {
        self.reading.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(self.delay);
        self.reading.fetch_sub(1, Ordering::SeqCst);
        self.inner.read(offset, buf)
    }
    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> udm_block::Result<()> {
        self.inner.write(offset, buf, flags)
    }
    fn flush(&self) -> udm_block::Result<()> {
        Ok(())
    }
}

/// Starts `count` threads each reading 4 KiB of `path` with O_DIRECT (one request each).
fn read_in_background(
    path: &Path,
    count: usize,
) -> Vec<std::thread::JoinHandle<std::io::Result<()>>> {
    (0..count)
        .map(|i| {
            let path = path.to_path_buf();
            std::thread::spawn(move || {
                let mut buf = AlignedBuf::zeroed(4096);
                OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(&path)?
                    .read_exact_at(&mut buf, i as u64 * 4096)
            })
        })
        .collect()
}

#[test]
fn over_io_uring_a_slow_device_does_not_hold_up_a_fast_one() {
    if !can_run() {
        return;
    }
    let dir = TempDir::new("slow");
    let backing = dir.path("fast.img");
    File::create(&backing).unwrap().set_len(4 * MIB).unwrap();
    let catalog = Arc::new(Devices::default());
    let slow = Slow::new(MIB, Duration::from_secs(3));
    catalog.add("slow", slow.clone(), false);
    let fast = FileDevice::open(&backing, OpenMode::ReadWrite).unwrap();
    catalog.add("fast", Arc::new(fast), false);
    // Two threads for synchronous requests, both kept busy by the slow device.
    let config = FuseConfig {
        workers: 2,
        io_uring: UringMode::On,
        ..FuseConfig::default()
    };
    let export = mount_with(&dir, &catalog, config);
    let mnt = export.mountpoint().to_path_buf();
    let readers = read_in_background(&mnt.join("slow"), 4);
    slow.wait_reading(2);
    let started = Instant::now();
    let fast = open_direct(&mnt.join("fast"));
    let mut buf = AlignedBuf::zeroed(64 * 1024);
    for i in 0..32 {
        fast.read_exact_at(&mut buf, i * 64 * 1024).unwrap();
    }
    fast.write_all_at(&buf, 0).unwrap();
    assert_eq!(std::fs::metadata(mnt.join("fast")).unwrap().len(), 4 * MIB);
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(1),
        "the fast device waited {took:?} behind the slow one"
    );
    assert_eq!(
        slow.reading.load(Ordering::SeqCst),
        2,
        "the pool is bounded"
    );
    drop(fast);
    for reader in readers {
        reader.join().unwrap().unwrap();
    }
    catalog.wait_closed();
    export.unmount();
}

#[test]
fn unmount_with_requests_in_flight_ends_in_bounded_time() {
    each_transport(|mode| {
        let dir = TempDir::new("inflight");
        let backing = dir.path("fast.img");
        File::create(&backing).unwrap().set_len(4 * MIB).unwrap();
        let catalog = Arc::new(Devices::default());
        // Longer than the grace a busy mount is served after it is detached.
        let slow = Slow::new(MIB, Duration::from_secs(5));
        catalog.add("slow", slow.clone(), false);
        let fast = FileDevice::open(&backing, OpenMode::ReadWrite).unwrap();
        catalog.add("fast", Arc::new(fast), false);
        let export = mount(&dir, &catalog, mode);
        let mnt = export.mountpoint().to_path_buf();
        let readers = read_in_background(&mnt.join("slow"), 3);
        // And the fast device busy with a stream of requests.
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        // The streamer must have its file open before the unmount, or the open itself fails
        // (it did, on a loaded machine, when the thread started late).
        let (opened, is_open) = std::sync::mpsc::channel();
        let streamer = {
            let (path, stop) = (mnt.join("fast"), stop.clone());
            std::thread::spawn(move || {
                let file = open_direct(&path);
                opened.send(()).unwrap();
                let mut buf = AlignedBuf::zeroed(4096);
                let mut served = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    match file.read_exact_at(&mut buf, (served % 1024) * 4096) {
                        Ok(()) => served += 1,
                        Err(e) => return (served, Some(e)),
                    }
                }
                (served, None)
            })
        };
        is_open.recv().unwrap();
        slow.wait_reading(3);
        let started = Instant::now();
        export.unmount();
        let took = started.elapsed();
        assert!(took < Duration::from_secs(15), "unmount took {took:?}");
        // Nothing reaches a device once unmount has returned.
        assert_eq!(slow.reading.load(Ordering::SeqCst), 0);
        stop.store(true, Ordering::SeqCst);
        let (served, error) = streamer.join().unwrap();
        assert!(served > 0);
        eprintln!("{served} reads, then {error:?}");
        for reader in readers {
            // Answered before the abort, or failed by it: never left hanging.
            if let Err(e) = reader.join().unwrap() {
                let errno = e.raw_os_error().unwrap();
                assert!(
                    errno == libc::ENOTCONN || errno == libc::ECONNABORTED,
                    "{e}"
                );
            }
        }
        assert!(started.elapsed() < Duration::from_secs(15));
        catalog.wait_closed();
    });
}
