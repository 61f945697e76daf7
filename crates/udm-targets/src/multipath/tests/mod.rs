//! The multipath target over routes to one in-memory disk that fail on command (or over two
//! names of one file, for mapped requests). One file per job: `failover` (paths failing,
//! groups, queueing and its bounds), `checker`, `flush`, `identity` (paths to another device), `mapped` (requests remapped onto
//! the paths), `table` (the table line, messages, selectors). This file holds the rig they
//! share.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use udm_block::{BlockDevice, BlockError, MemoryDevice, Result, WriteFlags};
use udm_testkit::{conformance, pattern};

use crate::table::Table;
use crate::testing::{build, build_counting_events, Devices, Switchable};
use crate::Target;

mod checker;
mod failover;
mod flush;
mod identity;
mod mapped;
mod table;

const MIB: u64 = 1 << 20;

const SECTORS: u64 = 4 * MIB / 512;

/// Routes `a`, `b` and `c` to one disk, each failing on command.
struct Rig {
    devices: Devices,
    disk: Arc<MemoryDevice>,
    routes: Vec<Arc<Switchable>>,
}

impl Rig {
    fn new() -> Rig {
        let disk = Arc::new(MemoryDevice::new(4 * MIB));
        let devices = Devices::default();
        let routes: Vec<_> = ["a", "b", "c"]
            .iter()
            .map(|name| {
                let route = Arc::new(Switchable::over(disk.clone()));
                devices.add(name, route.clone(), false);
                route
            })
            .collect();
        Rig {
            devices,
            disk,
            routes,
        }
    }

    /// A live multipath of the whole disk with these arguments, and its event count.
    /// The routes' read counts start after the build, whose reads compare the paths'
    /// identities.
    fn build(&self, args: &str) -> (Table, Arc<AtomicU64>) {
        let built =
            build_counting_events(&self.devices, &format!("0 {SECTORS} multipath {args}")).unwrap();
        for route in &self.routes {
            route.reads.store(0, Ordering::SeqCst);
        }
        built
    }

    /// [`TWO_PATHS`] with these features (`N feature…`) instead of none.
    fn two_paths(&self, features: &str) -> (Table, Arc<AtomicU64>) {
        let groups = TWO_PATHS.strip_prefix("0 ").expect("no features");
        self.build(&format!("{features} {groups}"))
    }

    fn down(&self, route: usize, down: bool) {
        self.routes[route].fail_reads.store(down, Ordering::SeqCst);
        self.routes[route].fail_writes.store(down, Ordering::SeqCst);
    }

    fn reads(&self, route: usize) -> u64 {
        self.routes[route].reads.load(Ordering::SeqCst)
    }
}

fn target(table: &Table) -> &Arc<dyn Target> {
    table.target_at(0).unwrap()
}

fn message(table: &Table, words: &str) -> std::result::Result<String, String> {
    let words: Vec<&str> = words.split_whitespace().collect();
    target(table).message(&words).map_err(|e| e.to_string())
}

fn read(table: &Table, offset: u64) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; 4096];
    table.read(offset, &mut buf).map(|()| buf)
}

const TWO_PATHS: &str = "0 0 1 1 round-robin 0 2 1 a 1 b 1";

/// Runs a read of `table` on a thread; returns its handle.
fn reader(table: &Arc<Table>) -> std::thread::JoinHandle<Result<Vec<u8>>> {
    let table = table.clone();
    std::thread::spawn(move || read(&table, 0))
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Two names of one 4 MiB file as the paths `a` and `b` of a multipath with this selector;
/// the table and the two names.
fn file_paths(dir: &udm_testkit::TempDir, selector: &str) -> (Table, [std::path::PathBuf; 2]) {
    use udm_block::{FileDevice, OpenMode};
    let (a, b) = (dir.sparse("a.img", 4 * MIB), dir.path("b.img"));
    std::fs::hard_link(&a, &b).unwrap();
    let files = Devices::default();
    for (name, path) in [("a", &a), ("b", &b)] {
        let file = FileDevice::open(path, OpenMode::ReadWrite).unwrap();
        files.add(name, Arc::new(file), false);
    }
    let groups = TWO_PATHS.replace("round-robin", selector);
    let table = build(&files, &format!("0 {SECTORS} multipath {groups}")).unwrap();
    (table, [a, b])
}
