//! The pool and thin targets on memory devices (and files, where remapping is checked):
//! provisioning, zeroing, sharing and breaking it, discards, running out of space, reloads,
//! and the refusals.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use udm_testkit::conformance;

use udm_block::{
    BlockDevice, BlockError, FileDevice, MapOp, MemoryDevice, OpenMode, Place, WriteFlags,
    ZeroFlags, EXTENT_HOLE,
};

use crate::table::Table;
use crate::target::{Resolver, TargetError};

const KIB: u64 = 1024;
const MIB: u64 = 1 << 20;
/// 64 KiB blocks.
const BLOCK: u64 = 64 * KIB;

/// Named devices for tables, with the pool device added once built; every name unique in
/// the process, since pools are found by name process-wide.
struct Rig {
    name: String,
    devices: Mutex<HashMap<String, Arc<dyn BlockDevice>>>,
    events: Arc<AtomicU64>,
}

fn unique(tag: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!("{tag}-{}", N.fetch_add(1, Ordering::Relaxed))
}

impl Resolver for Rig {
    fn open(&self, reference: &str, _mode: OpenMode) -> Result<Arc<dyn BlockDevice>, TargetError> {
        self.devices
            .lock()
            .unwrap()
            .get(reference)
            .cloned()
            .ok_or_else(|| TargetError::new(format!("no device named '{reference}'")))
    }
}

impl Rig {
    /// A rig with a metadata device `meta` and a data device `data` of these sizes.
    fn new(meta_size: u64, data_size: u64) -> Rig {
        let rig = Rig {
            name: unique("pool"),
            devices: Mutex::default(),
            events: Arc::default(),
        };
        rig.add("meta", Arc::new(MemoryDevice::new(meta_size)));
        rig.add("data", Arc::new(MemoryDevice::new(data_size)));
        rig
    }

    /// Device names are made unique per rig (pools are keyed by their metadata device
    /// process-wide): `{meta}` in a table stands for this rig's `meta`.
    fn unique_name(&self, name: &str) -> String {
        format!("{}-{name}", self.name)
    }

    fn add(&self, name: &str, dev: Arc<dyn BlockDevice>) {
        self.devices
            .lock()
            .unwrap()
            .insert(self.unique_name(name), dev);
    }

    fn dev(&self, name: &str) -> Arc<dyn BlockDevice> {
        self.devices.lock().unwrap()[&self.unique_name(name)].clone()
    }

    fn build(&self, owner: &str, text: &str) -> Result<Table, TargetError> {
        let events = self.events.clone();
        let text: Vec<String> = text
            .split(' ')
            .map(
                |word| match word.strip_prefix('{').and_then(|w| w.strip_suffix('}')) {
                    Some(name) => self.unique_name(name),
                    None => word.to_string(),
                },
            )
            .collect();
        Table::build(
            owner,
            &text.join(" "),
            self,
            Arc::new(move || {
                events.fetch_add(1, Ordering::SeqCst);
            }),
        )
    }

    /// Builds the pool table (`rest` after the devices), makes it live and adds it as the
    /// device `self.name`.
    fn pool(&self, sectors: u64, rest: &str) -> Arc<Table> {
        let table = Arc::new(
            self.build(
                &self.name,
                &format!("0 {sectors} thin-pool {{meta}} {{data}} {rest}"),
            )
            .unwrap(),
        );
        table.resume();
        self.devices
            .lock()
            .unwrap()
            .insert(self.name.clone(), table.clone());
        table
    }

    fn thin(&self, len: u64, id: u32) -> Result<Table, TargetError> {
        let table = self.build(
            &unique("vol"),
            &format!("0 {} thin {} {id}", len / 512, self.name),
        )?;
        table.resume();
        Ok(table)
    }

    fn message(&self, pool: &Table, text: &str) -> Result<String, TargetError> {
        let words: Vec<&str> = text.split_whitespace().collect();
        pool.target_at(0).unwrap().message(&words)
    }

    fn status(&self, table: &Table) -> String {
        table.segments()[0].target.status()
    }

    /// Used data blocks, from the pool's status line.
    fn data_used(&self, pool: &Table) -> u64 {
        let status = self.status(pool);
        let field = status.split(' ').nth(2).unwrap();
        field.split('/').next().unwrap().parse().unwrap()
    }
}

fn filled(len: u64, byte: u8) -> Vec<u8> {
    vec![byte; len as usize]
}

fn read(dev: &dyn BlockDevice, offset: u64, len: u64) -> Vec<u8> {
    let mut buf = vec![0u8; len as usize];
    dev.read(offset, &mut buf).unwrap();
    buf
}

fn write(dev: &dyn BlockDevice, offset: u64, data: &[u8]) {
    dev.write(offset, data, WriteFlags::default()).unwrap();
}

/// A pool of `blocks` 64 KiB data blocks on 4 MiB of metadata, with thin device 1.
fn pool_with_thin(blocks: u64, features: &str) -> (Rig, Arc<Table>) {
    let rig = Rig::new(4 * MIB, blocks * BLOCK);
    let pool = rig.pool(blocks * BLOCK / 512, &format!("128 0 {features}"));
    rig.message(&pool, "create_thin 1").unwrap();
    (rig, pool)
}

#[test]
fn a_thin_device_passes_the_conformance_suite() {
    let (rig, _pool) = pool_with_thin(256, "");
    let thin = rig.thin(8 * MIB, 1).unwrap();
    conformance::run_all(&thin);
}

#[test]
fn first_writes_allocate_and_zero_the_rest_of_the_block() {
    let (rig, pool) = pool_with_thin(64, "");
    // Garbage where blocks will be allocated: zeroing must hide it.
    write(&*rig.dev("data"), 0, &filled(64 * BLOCK, 0xee));
    let thin = rig.thin(16 * MIB, 1).unwrap();
    assert_eq!(
        read(&thin, 0, 2 * BLOCK),
        filled(2 * BLOCK, 0),
        "unprovisioned reads zero"
    );
    assert_eq!(rig.status(&thin), "0 -");
    write(&thin, BLOCK + 4 * KIB, &filled(4 * KIB, 7));
    let back = read(&thin, BLOCK, BLOCK);
    assert_eq!(back[..4096], filled(4 * KIB, 0)[..]);
    assert_eq!(back[4096..8192], filled(4 * KIB, 7)[..]);
    assert!(
        back[8192..].iter().all(|&b| b == 0),
        "the rest of the new block is zeroed"
    );
    assert_eq!(rig.status(&thin), "128 255");
    assert_eq!(rig.data_used(&pool), 1);
    // A second write to the block goes to the same block.
    write(&thin, BLOCK, &filled(4 * KIB, 8));
    assert_eq!(rig.data_used(&pool), 1);
    assert_eq!(read(&thin, BLOCK, 8 * KIB)[..4096], filled(4 * KIB, 8)[..]);
}

#[test]
fn skip_block_zeroing_leaves_what_was_on_the_data_device() {
    let (rig, _pool) = pool_with_thin(16, "1 skip_block_zeroing");
    write(&*rig.dev("data"), 0, &filled(16 * BLOCK, 0xee));
    let thin = rig.thin(MIB, 1).unwrap();
    write(&thin, 0, &filled(4 * KIB, 7));
    let back = read(&thin, 0, BLOCK);
    assert_eq!(back[..4096], filled(4 * KIB, 7)[..]);
    assert!(
        back[4096..].iter().all(|&b| b == 0xee),
        "no zeroing was asked for"
    );
}

#[test]
fn a_snapshot_keeps_the_old_data_and_snapshots_of_it_too() {
    let (rig, pool) = pool_with_thin(64, "");
    let origin = rig.thin(4 * MIB, 1).unwrap();
    write(&origin, 0, &filled(2 * BLOCK, 1));
    // The origin is live: a snapshot now could catch half a write.
    let err = rig
        .message(&pool, "create_snap 2 1")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("active") && err.contains("suspend it first"),
        "{err}"
    );
    origin.suspend();
    rig.message(&pool, "create_snap 2 1").unwrap();
    origin.resume();
    let snap = rig.thin(4 * MIB, 2).unwrap();
    assert_eq!(rig.data_used(&pool), 2, "a snapshot copies nothing");
    // A partial write to a shared block copies it first; a whole-block write does not.
    write(&origin, 4 * KIB, &filled(4 * KIB, 2));
    write(&origin, BLOCK, &filled(BLOCK, 3));
    assert_eq!(rig.data_used(&pool), 4);
    let mut expected = filled(BLOCK, 1);
    expected[4096..8192].fill(2);
    assert_eq!(read(&origin, 0, BLOCK), expected);
    assert_eq!(read(&origin, BLOCK, BLOCK), filled(BLOCK, 3));
    assert_eq!(read(&snap, 0, 2 * BLOCK), filled(2 * BLOCK, 1));
    // A snapshot of the snapshot, and a write to the snapshot.
    drop(snap);
    rig.message(&pool, "create_snap 3 2").unwrap();
    let snap = rig.thin(4 * MIB, 2).unwrap();
    let snap_of_snap = rig.thin(4 * MIB, 3).unwrap();
    write(&snap, 0, &filled(4 * KIB, 9));
    assert_eq!(read(&snap_of_snap, 0, 2 * BLOCK), filled(2 * BLOCK, 1));
    assert_eq!(read(&snap, 0, 4 * KIB), filled(4 * KIB, 9));
    assert_eq!(read(&origin, BLOCK, BLOCK), filled(BLOCK, 3));
    assert_eq!(rig.data_used(&pool), 5);
    // Deleting needs the device unused; then it frees what only it held.
    let err = rig.message(&pool, "delete 2").unwrap_err().to_string();
    assert!(err.contains("in use by"), "{err}");
    drop(snap);
    rig.message(&pool, "delete 2").unwrap();
    assert_eq!(rig.data_used(&pool), 4, "the snapshot's own block is free");
    drop(snap_of_snap);
    rig.message(&pool, "delete 3").unwrap();
    assert_eq!(
        rig.data_used(&pool),
        2,
        "the blocks only the snapshots held are free"
    );
    let err = rig.message(&pool, "delete 3").unwrap_err().to_string();
    assert!(err.contains("thin device 3 does not exist"), "{err}");
}

#[test]
fn discards_unmap_whole_blocks_only() {
    let (rig, pool) = pool_with_thin(64, "");
    let thin = rig.thin(MIB, 1).unwrap();
    write(&thin, 0, &filled(4 * BLOCK, 5));
    assert_eq!(rig.data_used(&pool), 4);
    // Half of block 0, all of 1 and 2, a quarter of 3.
    thin.discard(BLOCK / 2, 2 * BLOCK + BLOCK / 4 + BLOCK / 2)
        .unwrap();
    assert_eq!(rig.data_used(&pool), 2);
    assert_eq!(read(&thin, 0, BLOCK), filled(BLOCK, 5));
    assert_eq!(read(&thin, BLOCK, 2 * BLOCK), filled(2 * BLOCK, 0));
    assert_eq!(read(&thin, 3 * BLOCK, BLOCK), filled(BLOCK, 5));
    let extents = thin.block_status(0, 4 * BLOCK).unwrap();
    let flags: Vec<_> = extents
        .iter()
        .map(|e| (e.len, e.flags & EXTENT_HOLE))
        .collect();
    assert_eq!(
        flags,
        vec![(BLOCK, 0), (2 * BLOCK, EXTENT_HOLE), (BLOCK, 0)]
    );
    // write_zeroes that may unmap frees whole blocks too.
    thin.write_zeroes(
        0,
        BLOCK,
        ZeroFlags {
            may_unmap: true,
            ..ZeroFlags::default()
        },
    )
    .unwrap();
    assert_eq!(rig.data_used(&pool), 1);
    assert_eq!(read(&thin, 0, BLOCK), filled(BLOCK, 0));
}

#[test]
fn ignore_discard_keeps_every_block() {
    let (rig, pool) = pool_with_thin(16, "1 ignore_discard");
    let thin = rig.thin(MIB, 1).unwrap();
    write(&thin, 0, &filled(BLOCK, 5));
    assert!(!thin.capabilities().discard);
    thin.discard(0, BLOCK).unwrap();
    assert_eq!(rig.data_used(&pool), 1);
    assert!(rig.status(&pool).contains(" ignore_discard "));
}

#[test]
fn error_if_no_space_fails_at_once_and_says_so() {
    let (rig, pool) = pool_with_thin(2, "1 error_if_no_space");
    let thin = rig.thin(MIB, 1).unwrap();
    write(&thin, 0, &filled(2 * BLOCK, 1));
    let t = Instant::now();
    let err = thin
        .write(2 * BLOCK, &filled(4 * KIB, 1), WriteFlags::default())
        .unwrap_err();
    assert!(matches!(err, BlockError::NoSpace(_)), "{err:?}");
    assert!(t.elapsed() < Duration::from_secs(1));
    let status = rig.status(&pool);
    assert!(
        status.ends_with(" out_of_data_space discard_passdown error_if_no_space - 256 "),
        "{status}"
    );
    // Writes to blocks already there still work, reads too.
    write(&thin, 0, &filled(4 * KIB, 2));
    assert_eq!(read(&thin, 0, 4 * KIB), filled(4 * KIB, 2));
    // Freeing a block (committed) gives the pool its space back.
    thin.discard(BLOCK, BLOCK).unwrap();
    thin.flush().unwrap();
    assert!(rig.status(&pool).contains(" rw "), "{}", rig.status(&pool));
    write(&thin, 2 * BLOCK, &filled(4 * KIB, 1));
}

/// The one test that changes the process-wide no-space timeout (others never wait for it).
#[test]
fn out_of_space_queues_until_the_pool_grows_then_times_out() {
    crate::thin::set_no_space_timeout(Duration::from_millis(400));
    let rig = Rig::new(4 * MIB, 8 * BLOCK);
    let pool = rig.pool(2 * BLOCK / 512, "128 1");
    rig.message(&pool, "create_thin 1").unwrap();
    let thin = Arc::new(rig.thin(MIB, 1).unwrap());
    let events = rig.events.load(Ordering::SeqCst);
    write(&*thin, 0, &filled(2 * BLOCK, 1));
    assert!(
        rig.events.load(Ordering::SeqCst) > events,
        "the low water mark raised an event"
    );
    // The third block queues…
    let writer = {
        let thin = thin.clone();
        std::thread::spawn(move || thin.write(2 * BLOCK, &filled(BLOCK, 3), WriteFlags::default()))
    };
    std::thread::sleep(Duration::from_millis(100));
    assert!(!writer.is_finished(), "the write waits for space");
    assert!(rig
        .status(&pool)
        .contains(" out_of_data_space discard_passdown queue_if_no_space "));
    // …until the pool is reloaded larger (suspend does not wait for the queued write).
    let bigger = rig
        .build(
            &rig.name,
            &format!("0 {} thin-pool {{meta}} {{data}} 128 1", 4 * BLOCK / 512),
        )
        .unwrap();
    pool.suspend();
    bigger.resume();
    writer.join().unwrap().unwrap();
    assert_eq!(read(&*thin, 2 * BLOCK, BLOCK), filled(BLOCK, 3));
    let status = rig.status(&bigger);
    assert!(status.contains(" 3/4 - rw "), "{status}");
    drop(pool);
    // Full again: after the timeout the write fails, and so do the next ones at once.
    write(&*thin, 3 * BLOCK, &filled(BLOCK, 4));
    let t = Instant::now();
    let err = thin
        .write(4 * BLOCK, &filled(BLOCK, 5), WriteFlags::default())
        .unwrap_err();
    assert!(matches!(err, BlockError::NoSpace(_)), "{err:?}");
    assert!(
        t.elapsed() >= Duration::from_millis(350),
        "{:?}",
        t.elapsed()
    );
    assert!(rig
        .status(&bigger)
        .contains(" out_of_data_space discard_passdown error_if_no_space "));
    let t = Instant::now();
    assert!(thin
        .write(5 * BLOCK, &filled(BLOCK, 5), WriteFlags::default())
        .is_err());
    assert!(t.elapsed() < Duration::from_millis(200));
}

#[test]
fn a_reload_finds_the_same_pool_and_other_pools_are_refused() {
    let (rig, pool) = pool_with_thin(32, "");
    let thin = rig.thin(MIB, 1).unwrap();
    write(&thin, 0, &filled(BLOCK, 6));
    // Same devices, reloaded: the same pool, same data.
    let again = rig.build(&rig.name, &pool.lines()[0]).unwrap();
    pool.suspend();
    again.resume();
    assert_eq!(read(&thin, 0, BLOCK), filled(BLOCK, 6));
    // Another metadata device under the same pool name.
    rig.add("meta2", Arc::new(MemoryDevice::new(4 * MIB)));
    let err = rig
        .build(
            &rig.name,
            &format!("0 {} thin-pool {{meta2}} {{data}} 128 0", 32 * BLOCK / 512),
        )
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("a different pool cannot replace"), "{err}");
    // Another pool on the same metadata.
    let err = rig
        .build(
            &unique("pool"),
            &format!("0 {} thin-pool {{meta}} {{data}} 128 0", 32 * BLOCK / 512),
        )
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("already in use by pool"), "{err}");
    // Smaller, another block size, discards switched off: refused.
    for (table, expected) in [
        (
            format!("0 {} thin-pool {{meta}} {{data}} 128 0", 16 * BLOCK / 512),
            "too small",
        ),
        (
            format!("0 {} thin-pool {{meta}} {{data}} 256 0", 32 * BLOCK / 512),
            "block size",
        ),
        (
            format!(
                "0 {} thin-pool {{meta}} {{data}} 128 0 1 ignore_discard",
                32 * BLOCK / 512
            ),
            "discard support",
        ),
    ] {
        let err = rig.build(&rig.name, &table).err().unwrap().to_string();
        assert!(err.contains(expected), "{table}: {err}");
    }
}

#[test]
fn thin_lines_that_name_nothing_are_refused() {
    let (rig, pool) = pool_with_thin(16, "");
    let err = rig.thin(MIB, 7).err().unwrap().to_string();
    assert!(err.contains("thin device 7 does not exist"), "{err}");
    let err = rig
        .build("x", "0 8 thin {meta} 1")
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("-meta' is not a thin-pool device"), "{err}");
    pool.suspend();
    let err = rig.thin(MIB, 1).err().unwrap().to_string();
    assert!(
        err.contains("while pool") && err.contains("is suspended"),
        "{err}"
    );
    pool.resume();
    rig.thin(MIB, 1).unwrap();
}

#[test]
fn hostile_messages_change_nothing() {
    let (rig, pool) = pool_with_thin(16, "");
    let before = rig.status(&pool);
    for text in [
        "create_thin 1",
        "create_thin 99999999",
        "create_snap 5 4",
        "create_snap 1 1",
        "delete 4",
        "set_transaction_id 5 6",
        "release_metadata_snap",
        "frobnicate",
        "create_thin",
    ] {
        assert!(rig.message(&pool, text).is_err(), "{text} was accepted");
    }
    assert_eq!(rig.status(&pool), before);
    rig.message(&pool, "set_transaction_id 0 1").unwrap();
    assert!(rig.status(&pool).starts_with("1 "));
    rig.message(&pool, "reserve_metadata_snap").unwrap();
    let status = rig.status(&pool);
    let held: Vec<&str> = status.split(' ').collect();
    assert_ne!(held[3], "-", "{status}");
    assert!(rig.message(&pool, "reserve_metadata_snap").is_err());
    rig.message(&pool, "release_metadata_snap").unwrap();
    assert!(rig.status(&pool).split(' ').nth(3) == Some("-"));
}

#[test]
fn writers_racing_for_one_new_block_share_one_allocation() {
    let (rig, pool) = pool_with_thin(64, "");
    let thin = rig.thin(MIB, 1).unwrap();
    std::thread::scope(|s| {
        for i in 0..16u64 {
            let thin = &thin;
            s.spawn(move || write(thin, i * 4 * KIB, &filled(4 * KIB, i as u8 + 1)));
        }
    });
    assert_eq!(rig.data_used(&pool), 1);
    let back = read(&thin, 0, BLOCK);
    for i in 0..16 {
        assert!(back[i * 4096..(i + 1) * 4096]
            .iter()
            .all(|&b| b == i as u8 + 1));
    }
}

#[test]
fn an_external_origin_fills_what_is_not_provisioned() {
    let (rig, _pool) = pool_with_thin(64, "");
    let origin = Arc::new(MemoryDevice::new(BLOCK + BLOCK / 2));
    origin
        .write(0, &filled(BLOCK + BLOCK / 2, 4), WriteFlags::default())
        .unwrap();
    rig.add("golden", origin);
    let thin = rig
        .build(
            "ext",
            &format!("0 {} thin {} 1 {{golden}}", 4 * BLOCK / 512, rig.name),
        )
        .unwrap();
    thin.resume();
    let mut expected = filled(4 * BLOCK, 0);
    expected[..(BLOCK + BLOCK / 2) as usize].fill(4);
    assert_eq!(
        read(&thin, 0, 4 * BLOCK),
        expected,
        "the origin, then zeroes past its end"
    );
    // A partial write into the block the origin half covers copies that half.
    write(&thin, BLOCK + 4 * KIB, &filled(4 * KIB, 8));
    expected[(BLOCK + 4 * KIB) as usize..(BLOCK + 8 * KIB) as usize].fill(8);
    assert_eq!(read(&thin, 0, 4 * BLOCK), expected);
    assert_eq!(rig.status(&thin), "128 255");
}

#[test]
fn flushed_writes_survive_reopening_and_the_timer_commits_the_rest() {
    let rig = Rig::new(4 * MIB, 64 * BLOCK);
    let pool = rig.pool(64 * BLOCK / 512, "128 0");
    rig.message(&pool, "create_thin 1").unwrap();
    let thin = rig.thin(MIB, 1).unwrap();
    write(&thin, 0, &filled(BLOCK, 1));
    thin.flush().unwrap();
    write(&thin, BLOCK, &filled(BLOCK, 2));
    // Copy the devices as a crash would leave them, after the once-a-second commit.
    std::thread::sleep(Duration::from_millis(1500));
    let copy = |name: &str| {
        let dev = rig.dev(name);
        let copy = MemoryDevice::new(dev.size());
        copy.write(0, &read(&*dev, 0, dev.size()), WriteFlags::default())
            .unwrap();
        Arc::new(copy) as Arc<dyn BlockDevice>
    };
    let other = Rig::new(MIB, MIB);
    other.add("meta", copy("meta"));
    other.add("data", copy("data"));
    let _reopened = other.pool(64 * BLOCK / 512, "128 0");
    let thin = other.thin(MIB, 1).unwrap();
    assert_eq!(read(&thin, 0, BLOCK), filled(BLOCK, 1));
    assert_eq!(read(&thin, BLOCK, BLOCK), filled(BLOCK, 2));
}

#[test]
fn metadata_full_turns_the_pool_read_only() {
    // A small metadata device; every thin device takes metadata blocks of its own.
    let rig = Rig::new(MIB, 64 * BLOCK);
    let pool = rig.pool(64 * BLOCK / 512, "128 0");
    rig.message(&pool, "create_thin 0").unwrap();
    let thin = rig.thin(MIB, 0).unwrap();
    write(&thin, 0, &filled(BLOCK, 1));
    thin.flush().unwrap();
    let mut failure = None;
    for id in 1..10_000 {
        if let Err(e) = rig.message(&pool, &format!("create_thin {id}")) {
            failure = Some(e.to_string());
            break;
        }
    }
    let failure = failure.expect("the metadata device filled up");
    assert!(failure.contains("out of space"), "{failure}");
    let status = rig.status(&pool);
    assert!(status.contains(" ro "), "{status}");
    let err = rig
        .message(&pool, "create_thin 20000")
        .unwrap_err()
        .to_string();
    assert!(err.contains("read-only"), "{err}");
    // Writes that need a block fail; reads and writes to mapped blocks still work.
    let err = thin
        .write(BLOCK, &filled(4 * KIB, 2), WriteFlags::default())
        .unwrap_err();
    assert!(matches!(err, BlockError::Io(_)), "{err:?}");
    write(&thin, 0, &filled(4 * KIB, 3));
    assert_eq!(read(&thin, 4 * KIB, 4 * KIB), filled(4 * KIB, 1));
    assert_eq!(read(&thin, 0, 4 * KIB), filled(4 * KIB, 3));
}

#[test]
fn provisioned_blocks_remap_onto_the_data_file() {
    let dir = std::env::temp_dir();
    let path = dir.join(format!("udm-thin-map-{}", unique("data")));
    std::fs::File::create(&path)
        .unwrap()
        .set_len(16 * BLOCK)
        .unwrap();
    let rig = Rig::new(4 * MIB, MIB);
    rig.add(
        "data",
        Arc::new(FileDevice::open(&path, OpenMode::ReadWrite).unwrap()),
    );
    let pool = rig.pool(16 * BLOCK / 512, "128 0");
    rig.message(&pool, "create_thin 1").unwrap();
    rig.message(&pool, "create_thin 2").unwrap();
    let thin = rig.thin(MIB, 1).unwrap();
    let other = rig.thin(MIB, 2).unwrap();
    // Unprovisioned: a read is zeroes, a write is the pool's.
    let zeroes = thin.map(MapOp::Read, 0, 4096).unwrap();
    assert!(matches!(
        zeroes.pieces[..],
        [udm_block::Piece {
            place: Place::Zero,
            ..
        }]
    ));
    drop(zeroes);
    assert!(thin.map(MapOp::Write { fua: false }, 0, 4096).is_none());
    write(&other, 0, &filled(BLOCK, 1));
    write(&thin, 4096, &filled(4096, 2));
    assert!(
        thin.map(MapOp::Write { fua: true }, 4096, 4096).is_none(),
        "a FUA write waits for the commit of its block"
    );
    assert!(
        thin.map(MapOp::Flush, 0, 0).is_none(),
        "a flush must commit"
    );
    thin.flush().unwrap();
    let mapping = thin.map(MapOp::Write { fua: true }, 4096, 8192).unwrap();
    let pieces: Vec<_> = mapping
        .pieces
        .iter()
        .map(|p| match &p.place {
            Place::File { offset, .. } => (p.at, p.len, *offset),
            Place::Zero => panic!("a zero piece"),
        })
        .collect();
    // Thin block 0 is the pool's second block (the other device took the first).
    assert_eq!(pieces, vec![(0, 8192, BLOCK + 4096)]);
    assert!(thin.map(MapOp::Flush, 0, 0).is_some());
    // A write spilling onto an unprovisioned block is the pool's; a read maps both parts.
    assert!(thin
        .map(MapOp::Write { fua: false }, BLOCK - 4096, 8192)
        .is_none());
    let spill = thin.map(MapOp::Read, BLOCK - 4096, 8192).unwrap();
    assert!(matches!(spill.pieces[1].place, Place::Zero));
    drop(spill);
    drop(mapping);
    // Shared blocks: reads remap, writes do not.
    thin.suspend();
    rig.message(&pool, "create_snap 3 1").unwrap();
    thin.resume();
    assert!(thin.map(MapOp::Read, 0, 4096).is_some());
    assert!(thin.map(MapOp::Write { fua: false }, 0, 4096).is_none());
    std::fs::remove_file(path).unwrap();
}

#[test]
fn suspending_the_pool_holds_thin_io_until_resume() {
    let (rig, pool) = pool_with_thin(16, "");
    let thin = Arc::new(rig.thin(MIB, 1).unwrap());
    pool.suspend();
    let reader = {
        let thin = thin.clone();
        std::thread::spawn(move || read(&*thin, 0, 4096))
    };
    std::thread::sleep(Duration::from_millis(50));
    assert!(!reader.is_finished());
    assert!(thin.map(MapOp::Read, 0, 4096).is_none());
    pool.resume();
    assert_eq!(reader.join().unwrap(), filled(4096, 0));
}

/// Random writes, zeroings (unmapping or not), discards, flushes and snapshots, on a thin
/// device and on a plain memory device side by side: every read must agree, and every
/// snapshot must still hold what the device held when it was taken (a discard of whole blocks reads
/// back as zeroes on a thin device without an origin, so the model zeroes those blocks).
/// It caught discard passdown punching a block that had been freed and allocated again in
/// the same transaction (mkfs.ext4 on a thin volume found it first).
#[test]
fn random_operations_read_back_as_on_a_plain_device() {
    let (rig, pool) = pool_with_thin(2048, "");
    let size = 8 * MIB;
    let thin = rig.thin(size, 1).unwrap();
    let model = MemoryDevice::new(size);
    let mut snapshots: Vec<(u32, Vec<u8>)> = Vec::new();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut random = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    for step in 0..3000 {
        let offset = random(size / 512) * 512;
        let len = ((random(4) + 1) * 512 * (1 + random(300))).min(size - offset);
        match random(10) {
            0..=5 => {
                let data = filled(len, (step % 250 + 1) as u8);
                write(&thin, offset, &data);
                write(&model, offset, &data);
            }
            6 | 7 => {
                let flags = ZeroFlags {
                    may_unmap: random(2) == 0,
                    ..ZeroFlags::default()
                };
                thin.write_zeroes(offset, len, flags).unwrap();
                model
                    .write_zeroes(offset, len, ZeroFlags::default())
                    .unwrap();
            }
            _ => {
                thin.discard(offset, len).unwrap();
                let first = offset.div_ceil(BLOCK);
                let end = offset + len;
                let last = if end == size {
                    end.div_ceil(BLOCK)
                } else {
                    end / BLOCK
                };
                for b in first..last.max(first) {
                    write(&model, b * BLOCK, &filled(BLOCK, 0));
                }
            }
        }
        if random(20) == 0 {
            thin.flush().unwrap();
        }
        if step % 100 == 99 {
            assert!(
                read(&thin, 0, size) == read(&model, 0, size),
                "step {step}: the thin device differs from the model"
            );
        }
        // Now and then a snapshot, which must keep what the device held then; some of them
        // are deleted again.
        if step % 500 == 250 {
            let id = 2 + step as u32 / 500;
            thin.suspend();
            rig.message(&pool, &format!("create_snap {id} 1")).unwrap();
            thin.resume();
            snapshots.push((id, read(&model, 0, size)));
            if snapshots.len().is_multiple_of(3) {
                let (gone, _) = snapshots.remove(0);
                rig.message(&pool, &format!("delete {gone}")).unwrap();
            }
        }
    }
    for (id, then) in &snapshots {
        let snap = rig.thin(size, *id).unwrap();
        assert!(read(&snap, 0, size) == *then, "snapshot {id} changed");
    }
}

#[test]
fn zeroing_part_of_an_unprovisioned_block_allocates_nothing() {
    let (rig, pool) = pool_with_thin(16, "");
    let thin = rig.thin(MIB, 1).unwrap();
    for may_unmap in [true, false] {
        let flags = ZeroFlags {
            may_unmap,
            ..ZeroFlags::default()
        };
        thin.write_zeroes(4 * KIB, BLOCK + 8 * KIB, flags).unwrap();
    }
    assert_eq!(rig.data_used(&pool), 0);
    // Part of a provisioned block is written with zeroes, and stays provisioned.
    write(&thin, 0, &filled(BLOCK, 3));
    thin.write_zeroes(
        4 * KIB,
        4 * KIB,
        ZeroFlags {
            may_unmap: true,
            ..ZeroFlags::default()
        },
    )
    .unwrap();
    assert_eq!(rig.data_used(&pool), 1);
    let mut expected = filled(BLOCK, 3);
    expected[4096..8192].fill(0);
    assert_eq!(read(&thin, 0, BLOCK), expected);
}
