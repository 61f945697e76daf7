//! The FUSE export against the real kernel: files through std::fs, fallocate, a catalog that
//! changes under the mount, loop devices with ext4 and fio on top, dead mounts and busy
//! unmounts. Needs root and /dev/fuse (skipped without them). Every loop device and mount is
//! undone by a guard, also when a test fails.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use udm_block::{
    AlignedBuf, BlockDevice, ExportCatalog, FileDevice, MapOp, Mapping, MemoryDevice, OpenMode,
    Pending, WriteFlags, ZeroFlags,
};
use udm_fuse::{recover_stale_mount, FuseConfig, FuseError, FuseExport, Transport, UringMode};
use udm_testkit::{pattern, run_ok, Devices, Mounted, TempDir};

mod files;
mod lifecycle;
mod uring;

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

/// Mounts over `mode`, in a fresh directory tagged `tag`, a catalog that `add` fills first
/// (it may put backing files in the directory): where most tests start. The directory and the
/// catalog come back with the export, to be kept as long as it.
pub fn mounted(
    tag: &str,
    mode: UringMode,
    add: impl FnOnce(&TempDir, &Devices),
) -> (TempDir, Arc<Devices>, FuseExport) {
    let config = FuseConfig {
        io_uring: mode,
        ..FuseConfig::default()
    };
    mounted_with(tag, config, add)
}

/// [`mounted`] with a configuration of the test's own.
pub fn mounted_with(
    tag: &str,
    config: FuseConfig,
    add: impl FnOnce(&TempDir, &Devices),
) -> (TempDir, Arc<Devices>, FuseExport) {
    let dir = TempDir::new(tag);
    let catalog = Arc::new(Devices::default());
    add(&dir, &catalog);
    let export = mount_with(&dir, &catalog, config);
    (dir, catalog, export)
}

/// A file device on a sparse file of `size` bytes in `dir`.
pub fn file_device(dir: &TempDir, name: &str, size: u64) -> FileDevice {
    FileDevice::open(&dir.sparse(name, size), OpenMode::ReadWrite).unwrap()
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

/// A loop device on a file, detached on drop.
pub struct LoopDevice(pub String);

impl LoopDevice {
    pub fn attach(file: &Path) -> LoopDevice {
        let out = run_ok(
            Command::new("losetup")
                .args(["--direct-io=on", "-f", "--show"])
                .arg(file),
        );
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
