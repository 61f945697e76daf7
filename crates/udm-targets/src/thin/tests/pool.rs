//! The pool's life: snapshots, running out of data or metadata space, reloads, refused
//! lines and messages, durability across reopening, suspend.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use udm_block::{BlockDevice, BlockError, MapOp, MemoryDevice, WriteFlags};

use super::*;

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
    // Named as the table names it, not by its identity (`file:DEV:INODE` for files).
    let named = format!("metadata device '{}'", rig.unique_name("meta"));
    assert!(
        err.contains("already in use by pool") && err.contains(&named),
        "{err}"
    );
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
    // The pool went read-only while it still had room for the changes under way.
    let failure = failure.expect("the metadata device filled up");
    assert!(failure.contains("read-only"), "{failure}");
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

/// A memory device whose next `fail` writes fail: one transient write error.
struct FailingWrites {
    inner: MemoryDevice,
    fail: std::sync::atomic::AtomicU32,
}

impl BlockDevice for FailingWrites {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> udm_block::Result<()> {
        self.inner.read(offset, buf)
    }
    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> udm_block::Result<()> {
        let failing = self
            .fail
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if failing.is_ok() {
            return Err(BlockError::Io("injected write error".into()));
        }
        self.inner.write(offset, buf, flags)
    }
    fn flush(&self) -> udm_block::Result<()> {
        self.inner.flush()
    }
}

/// A metadata write error at a commit aborts the transaction, dropping the mappings of
/// writes acknowledged since the last commit. Only the flush whose commit failed said so;
/// the next one succeeded, and a client took the lost writes for durable. As the kernel's
/// (aborted_with_changes), every flush of the device fails now, while a table uses it.
#[test]
fn writes_lost_to_an_aborted_transaction_fail_every_flush_after() {
    let rig = Rig::new(0, 16 * BLOCK);
    let meta = Arc::new(FailingWrites {
        inner: MemoryDevice::new(4 * MIB),
        fail: 0.into(),
    });
    rig.add("meta", meta.clone());
    let pool = rig.pool(16 * BLOCK / 512, "128 0");
    rig.message(&pool, "create_thin 1").unwrap();
    rig.message(&pool, "create_thin 2").unwrap();
    let thin = rig.thin(MIB, 1).unwrap();
    let other = rig.thin(MIB, 2).unwrap();
    write(&thin, 0, &filled(BLOCK, 1));
    thin.flush().unwrap();
    write(&thin, BLOCK, &filled(BLOCK, 2));
    meta.fail.store(1, Ordering::SeqCst);
    assert!(thin.flush().is_err(), "the commit failed");
    assert!(rig.status(&pool).contains(" ro "), "{}", rig.status(&pool));
    assert_eq!(read(&thin, BLOCK, BLOCK), filled(BLOCK, 0), "dropped");
    for _ in 0..2 {
        let err = thin.flush().unwrap_err().to_string();
        assert!(err.contains("lost writes"), "{err}");
    }
    let fua = WriteFlags { fua: true };
    assert!(thin.write(0, &filled(4 * KIB, 3), fua).is_err());
    // A device that lost nothing flushes; a new table of the one that did starts afresh.
    other.flush().unwrap();
    drop(thin);
    rig.thin(MIB, 1).unwrap().flush().unwrap();
}

/// A memory device whose flushes, and then writes, can be held: a test stops the pool in
/// the middle of a message's commit, or a thin write between its lookup and its data.
#[derive(Default)]
struct Holding {
    inner: Option<MemoryDevice>,
    /// (flushes held, writes held, flushes waiting, writes waiting)
    state: parking_lot::Mutex<(bool, bool, u32, u32)>,
    changed: parking_lot::Condvar,
}

impl Holding {
    fn new(size: u64) -> Holding {
        Holding {
            inner: Some(MemoryDevice::new(size)),
            ..Holding::default()
        }
    }

    fn inner(&self) -> &MemoryDevice {
        self.inner.as_ref().unwrap()
    }

    fn pass(&self, flush: bool) {
        let mut state = self.state.lock();
        let held = |s: &(bool, bool, u32, u32)| if flush { s.0 } else { s.1 };
        if !held(&state) {
            return;
        }
        if flush {
            state.2 += 1;
        } else {
            state.3 += 1;
        }
        self.changed.notify_all();
        self.changed.wait_while(&mut state, |s| held(s));
    }

    fn set(&self, f: impl FnOnce(&mut (bool, bool, u32, u32))) {
        f(&mut self.state.lock());
        self.changed.notify_all();
    }

    /// Waits (at most `ms`) until `ready` holds; whether it did.
    fn wait(&self, ms: u64, ready: impl Fn(&(bool, bool, u32, u32)) -> bool) -> bool {
        let mut state = self.state.lock();
        let deadline = Instant::now() + Duration::from_millis(ms);
        while !ready(&state) {
            if self.changed.wait_until(&mut state, deadline).timed_out() {
                return ready(&state);
            }
        }
        true
    }
}

impl BlockDevice for Holding {
    fn size(&self) -> u64 {
        self.inner().size()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> udm_block::Result<()> {
        self.inner().read(offset, buf)
    }
    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> udm_block::Result<()> {
        self.pass(false);
        self.inner().write(offset, buf, flags)
    }
    fn flush(&self) -> udm_block::Result<()> {
        self.pass(true);
        self.inner().flush()
    }
}

/// `create_snap` of an origin checked that no live table used it, then took the snapshot:
/// a resume of the origin in between went through, and a write to it, looked up before the
/// snapshot and landing after, changed a block the snapshot shared (a snapshot that is not
/// of one moment). The check and the snapshot now hold the pool's users: the resume waits.
#[test]
fn a_resume_racing_create_snap_waits_and_the_snapshot_stays_as_taken() {
    let rig = Arc::new(Rig::new(4 * MIB, 0));
    let data = Arc::new(Holding::new(16 * BLOCK));
    rig.add("data", data.clone());
    let pool = rig.pool(16 * BLOCK / 512, "128 0");
    rig.message(&pool, "create_thin 1").unwrap();
    let origin = Arc::new(rig.thin(MIB, 1).unwrap());
    write(&*origin, 0, &filled(BLOCK, 1));
    origin.flush().unwrap();
    assert_eq!(read(&*origin, 0, 4 * KIB), filled(4 * KIB, 1));
    origin.suspend();

    data.set(|s| s.0 = true);
    let snapshot = {
        let (rig, pool) = (rig.clone(), pool.clone());
        std::thread::spawn(move || rig.message(&pool, "create_snap 2 1"))
    };
    assert!(data.wait(5000, |s| s.2 > 0), "create_snap never flushed");
    let resume = {
        let origin = origin.clone();
        std::thread::spawn(move || origin.resume())
    };
    let write_after_resume = || {
        let origin = origin.clone();
        std::thread::spawn(move || write(&*origin, 0, &filled(4 * KIB, 2)))
    };
    let mut writer = None;
    // (Nothing wakes this wait: it sleeps its time, and then looks.)
    if data.wait(300, |_| resume.is_finished()) {
        // The resume went through while create_snap ran: a write now, held at its data.
        data.set(|s| s.1 = true);
        writer = Some(write_after_resume());
        data.wait(5000, |s| s.3 > 0);
    }
    data.set(|s| s.0 = false);
    snapshot.join().unwrap().unwrap();
    resume.join().unwrap();
    data.set(|s| s.1 = false);
    writer.unwrap_or_else(write_after_resume).join().unwrap();

    let snap = rig.thin(MIB, 2).unwrap();
    assert!(
        read(&snap, 0, 4 * KIB) == filled(4 * KIB, 1),
        "the snapshot changed"
    );
    assert!(read(&*origin, 0, 4 * KIB) == filled(4 * KIB, 2));
}

#[test]
fn a_device_deleted_while_its_usage_is_counted_is_left_out() {
    let (rig, pool) = pool_with_thin(64, "");
    let origin = rig.thin(4 * MIB, 1).unwrap();
    write(&origin, 0, &filled(2 * BLOCK, 1));
    origin.suspend();
    rig.message(&pool, "create_snap 2 1").unwrap();
    origin.resume();
    let shared = crate::thin::core::POOLS.get(&rig.name).unwrap();
    // The walk lists the devices, then lets the lock go between windows: the snapshot is
    // deleted in between.
    let listed = shared.meta().md.devices();
    assert_eq!(listed.len(), 2);
    rig.message(&pool, "delete 2").unwrap();
    let usage = crate::thin::usage::usage_of(&shared, listed).unwrap();
    assert_eq!(usage.len(), 1, "the deleted snapshot is left out");
    let origin_usage = &usage[0];
    assert_eq!(origin_usage.id, 1);
    assert_eq!(origin_usage.mapped, 2);
    assert_eq!(
        (origin_usage.exclusive, origin_usage.shared),
        (2, 0),
        "blocks the deleted snapshot shared are the origin's alone"
    );
}

/// A pool on a metadata device of 128 KiB (32 blocks): the headroom kept for the change under
/// way was a sixteenth of it, 2 blocks, less than one insert into the mappings can take. A
/// write ran out half way, the transaction was aborted, and the FUA writes acknowledged
/// since the last commit were lost (every flush of the thin device failing from then on).
/// Running out of metadata must stop the pool cleanly, read-only, losing nothing, at any
/// size and with writes in parallel (each inserting a block handed out before the others').
#[test]
fn a_tiny_metadata_device_runs_out_without_aborting_a_transaction() {
    let (blocks, writers) = (8192, 8);
    for meta_size in [128 * KIB, 256 * KIB] {
        let rig = Rig::new(meta_size, blocks * BLOCK);
        let pool = rig.pool(blocks * BLOCK / 512, "128 0");
        rig.message(&pool, "create_thin 1").unwrap();
        let thin = rig.thin(blocks * BLOCK, 1).unwrap();
        let written: Vec<u64> = std::thread::scope(|s| {
            let writers: Vec<_> = (0..writers)
                .map(|first| {
                    let thin = &thin;
                    s.spawn(move || {
                        let fua = WriteFlags { fua: true };
                        (first..blocks)
                            .step_by(writers as usize)
                            .take_while(|block| {
                                thin.write(block * BLOCK, &filled(4 * KIB, 7), fua).is_ok()
                            })
                            .collect::<Vec<u64>>()
                    })
                })
                .collect();
            writers
                .into_iter()
                .flat_map(|w| w.join().unwrap())
                .collect()
        });
        assert!(
            written.len() < blocks as usize,
            "the metadata device never filled up"
        );
        thin.flush().expect("no acknowledged write was dropped");
        let status = rig.status(&pool);
        assert!(status.contains(" ro "), "{status}");
        for block in written {
            assert_eq!(read(&thin, block * BLOCK, 4 * KIB), filled(4 * KIB, 7));
        }
    }
}
