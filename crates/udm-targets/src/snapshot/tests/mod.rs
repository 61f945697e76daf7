//! The snapshot targets against in-memory devices: points in time, copy-out, locking,
//! overflow, merging, reloads, and power cuts at every write.

use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use udm_block::{AlignedBuf, BlockDevice, MemoryDevice, WriteFlags};
use udm_testkit::{conformance, pattern, CrashDevice, PowerSwitch};

use crate::table::Table;
use crate::testing::{Devices, Switchable};
use crate::Target;

mod copy_out;
mod merge;
mod points_in_time;
mod power_cut;

const MIB: u64 = 1 << 20;

/// Rendezvous are process-wide: every test names its devices uniquely.
fn unique(tag: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!("{tag}{}", N.fetch_add(1, Ordering::Relaxed))
}

/// Named devices and tables over them, each table owned by a device name of its own.
struct Rig {
    devices: Devices,
    events: Arc<AtomicU64>,
    origin: String,
}

impl Rig {
    /// An origin of `size` bytes holding pattern 1.
    fn new(size: u64) -> Rig {
        let origin = unique("origin");
        let dev = Arc::new(MemoryDevice::new(size));
        dev.write(0, &pattern(size as usize, 1), WriteFlags::default())
            .unwrap();
        let rig = Rig {
            devices: Devices::default(),
            events: Arc::new(AtomicU64::new(0)),
            origin: origin.clone(),
        };
        rig.devices.add(&origin, dev, false);
        rig
    }

    fn add(&self, tag: &str, dev: Arc<dyn BlockDevice>) -> String {
        let name = unique(tag);
        self.devices.add(&name, dev, false);
        name
    }

    /// Puts `dev` in the origin's place.
    fn set_origin(&self, dev: Arc<dyn BlockDevice>) {
        self.devices.add(&self.origin, dev, false);
    }

    fn cow(&self, size: u64) -> String {
        self.add("cow", Arc::new(MemoryDevice::new(size)))
    }

    fn device(&self, name: &str) -> Arc<dyn BlockDevice> {
        self.devices.get(name)
    }

    fn origin_size(&self) -> u64 {
        self.device(&self.origin).size()
    }

    /// Table `line` of device `owner`, built but not resumed (a table loaded).
    fn try_load(&self, owner: &str, line: &str) -> Result<Table, String> {
        let events = self.events.clone();
        let text = format!("0 {} {line}", self.origin_size() / 512);
        Table::build(
            owner,
            &text,
            &self.devices,
            Arc::new(move || {
                events.fetch_add(1, Ordering::SeqCst);
            }),
        )
        .map_err(|e| e.to_string())
    }

    fn try_table(&self, owner: &str, line: &str) -> Result<Table, String> {
        let table = self.try_load(owner, line)?;
        table.resume();
        Ok(table)
    }

    fn table(&self, owner: &str, line: &str) -> Table {
        self.try_table(owner, line).unwrap()
    }

    /// Asserts that device `owner` is refused the table `line`, with an error that holds each
    /// of `words`.
    fn assert_refused(&self, owner: &str, line: &str, words: &[&str]) {
        match self.try_table(owner, line) {
            Ok(_) => panic!("{owner}: '{line}' accepted"),
            Err(err) => assert!(words.iter().all(|w| err.contains(w)), "{err}"),
        }
    }

    /// The origin device's table.
    fn origin_table(&self) -> Table {
        self.table("origin-dev", &format!("snapshot-origin {}", self.origin))
    }

    fn snapshot(&self, cow: &str, args: &str) -> Table {
        self.table(
            &format!("snap-{cow}"),
            &format!("snapshot {} {cow} {args}", self.origin),
        )
    }
}

fn target(table: &Table) -> &Arc<dyn Target> {
    table.target_at(0).unwrap()
}

fn read(dev: &dyn BlockDevice, offset: u64, len: usize) -> AlignedBuf {
    let mut buf = AlignedBuf::zeroed(len);
    dev.read(offset, &mut buf).unwrap();
    buf
}

fn write(dev: &dyn BlockDevice, offset: u64, len: usize, seed: u64) {
    dev.write(offset, &pattern(len, seed), WriteFlags::default())
        .unwrap();
}

fn original(size: u64) -> AlignedBuf {
    pattern(size as usize, 1)
}

/// Runs a mapping as an executor does: waits for its steps, then its pieces, on files.
fn execute(op: udm_block::MapOp, mapping: udm_block::Mapping, buf: &mut [u8]) {
    use std::os::fd::BorrowedFd;
    let (tx, rx) = std::sync::mpsc::channel();
    mapping.when_ready(move |ready| tx.send(ready).unwrap());
    let mapping = rx
        .recv_timeout(Duration::from_secs(10))
        .unwrap()
        .expect("the steps succeed");
    for piece in &mapping.pieces {
        let range = piece.at as usize..(piece.at + piece.len) as usize;
        let udm_block::Place::File { file, offset } = &piece.place else {
            buf[range].fill(0);
            continue;
        };
        // SAFETY: the mapping holds the file open while we use its descriptor.
        let fd = unsafe { BorrowedFd::borrow_raw(file.buffered_fd()) };
        let file = std::fs::File::from(fd.try_clone_to_owned().unwrap());
        use std::os::unix::fs::FileExt;
        match op {
            udm_block::MapOp::Read => file.read_exact_at(&mut buf[range], *offset).unwrap(),
            _ => file.write_all_at(&buf[range], *offset).unwrap(),
        }
    }
    for callback in mapping.on_complete {
        callback(udm_block::Completed::Ok);
    }
}

fn write_pattern(dev: &dyn BlockDevice, offset: u64) {
    write(dev, offset, 4096, 77);
}

/// The file at `path`, made `size` bytes long, opened as a device: one the hot path maps
/// (onto the ring, for the copier).
fn file_device(path: &std::path::Path, size: u64) -> Arc<dyn BlockDevice> {
    std::fs::File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .unwrap()
        .set_len(size)
        .unwrap();
    let opened = udm_block::FileDevice::open(path, udm_block::OpenMode::ReadWrite).unwrap();
    Arc::new(opened)
}

impl Rig {
    /// The origin on a file of `size` bytes in `dir`.
    fn file_origin(&self, dir: &udm_testkit::TempDir, size: u64) {
        self.set_origin(file_device(&dir.path("origin.img"), size));
    }
}

/// A COW device whose metadata writes (area 0, at chunk 1) wait while it is held, and which
/// counts the other (data) writes.
struct HeldCommits {
    dev: MemoryDevice,
    held: Mutex<bool>,
    released: Condvar,
    data_writes: AtomicU64,
}

impl HeldCommits {
    fn new(size: u64) -> Arc<HeldCommits> {
        Arc::new(HeldCommits {
            dev: MemoryDevice::new(size),
            held: Mutex::new(false),
            released: Condvar::new(),
            data_writes: AtomicU64::new(0),
        })
    }

    fn hold(&self, held: bool) {
        *self.held.lock() = held;
        self.released.notify_all();
    }
}

impl BlockDevice for HeldCommits {
    fn size(&self) -> u64 {
        self.dev.size()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> udm_block::Result<()> {
        self.dev.read(offset, buf)
    }
    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> udm_block::Result<()> {
        if offset == 4096 {
            let mut held = self.held.lock();
            while *held {
                self.released.wait(&mut held);
            }
        } else {
            self.data_writes.fetch_add(1, Ordering::SeqCst);
        }
        self.dev.write(offset, buf, flags)
    }
    fn flush(&self) -> udm_block::Result<()> {
        Ok(())
    }
}
