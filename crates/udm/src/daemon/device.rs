//! A udm device: a name (and optional UUID), a live table and an inactive one, the suspend
//! gate, events, the open count and I/O statistics.

use log::debug;
use parking_lot::{Condvar, Mutex, RwLock};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use udm_block::{
    BlockDevice, BlockError, Capabilities, Completed, Extent, MapOp, Mapping, Result, WriteFlags,
    ZeroFlags,
};
use udm_targets::Table;

use super::stats::{IoStats, Op};

struct Tables {
    live: Arc<Table>,
    inactive: Option<Arc<Table>>,
    /// Whether the device is read-only once the inactive table goes live (dmsetup's
    /// `load --readonly`: read-only is a property of each loaded table).
    inactive_read_only: bool,
}

/// The suspend gate. The I/O path touches only atomics: a request counts itself in, then
/// checks `suspended`; `suspend` sets `suspended`, then waits for the count to drain. With
/// sequentially consistent order one of them always sees the other. The mutex and condvar
/// are only for sleeping: a held request waiting for resume, a suspend waiting for the last
/// request out.
#[derive(Default)]
struct Gate {
    in_flight: AtomicUsize,
    suspended: AtomicBool,
    sleep: Mutex<()>,
    wake: Condvar,
}

pub struct Device {
    /// Changed by `rename`.
    name: RwLock<String>,
    /// Set at create, or once later (`rename --setuuid`).
    uuid: RwLock<Option<String>>,
    read_only: AtomicBool,
    tables: RwLock<Tables>,
    /// The live table's size, read on every request.
    size: AtomicU64,
    /// Shared with mapped requests, which hold their place in it until they complete.
    gate: Arc<Gate>,
    events: Arc<Events>,
    /// Client connections using this device (other devices' tables are counted by the
    /// registry, which knows every table).
    opens: AtomicUsize,
    /// Of those, opens of its file in the FUSE mount: a loop device or a mounted filesystem
    /// that must not lose the device under it when the daemon is asked to stop.
    file_opens: AtomicUsize,
    /// Woken when the last open handle goes (a `remove` waiting out a client that is
    /// disconnecting, a deferred removal).
    released: (Mutex<()>, Condvar),
    /// `remove --deferred`: remove once nothing uses the device any more.
    deferred_remove: AtomicBool,
    stats: Arc<IoStats>,
    /// Unique in the process and kept through renames: the device's identity.
    serial: u64,
}

impl Gate {
    /// Counts a request in; false (and counted back out) while suspended.
    fn try_enter(&self) -> bool {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        if !self.suspended.load(Ordering::SeqCst) {
            return true;
        }
        self.leave();
        false
    }

    /// Counts a request out; the last one out wakes a waiting `suspend`.
    fn leave(&self) {
        if self.in_flight.fetch_sub(1, Ordering::SeqCst) == 1
            && self.suspended.load(Ordering::SeqCst)
        {
            let _sleep = self.sleep.lock();
            self.wake.notify_all();
        }
    }
}

/// Holds a synchronous request's place in the gate.
struct InFlight<'a>(&'a Gate);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.leave();
    }
}

/// Holds a mapped request's place in the gate until its pieces complete.
struct MappedInFlight(Arc<Gate>);

impl Drop for MappedInFlight {
    fn drop(&mut self) {
        self.0.leave();
    }
}

impl Device {
    /// `events` is the counter the table's targets were given to raise events on.
    pub fn new(
        name: String,
        uuid: Option<String>,
        read_only: bool,
        live: Table,
        events: Arc<Events>,
    ) -> Self {
        live.resume();
        Device {
            name: RwLock::new(name),
            uuid: RwLock::new(uuid),
            read_only: AtomicBool::new(read_only),
            size: AtomicU64::new(live.size()),
            tables: RwLock::new(Tables {
                live: Arc::new(live),
                inactive: None,
                inactive_read_only: false,
            }),
            gate: Arc::default(),
            events,
            opens: AtomicUsize::new(0),
            file_opens: AtomicUsize::new(0),
            released: (Mutex::new(()), Condvar::new()),
            deferred_remove: AtomicBool::new(false),
            stats: Arc::default(),
            serial: {
                static SERIAL: AtomicU64 = AtomicU64::new(0);
                SERIAL.fetch_add(1, Ordering::Relaxed)
            },
        }
    }

    pub fn name(&self) -> String {
        self.name.read().clone()
    }

    /// Only the registry renames, under its lock, with the device's other records.
    pub(super) fn set_name(&self, name: &str) {
        *self.name.write() = name.to_string();
    }

    pub fn uuid(&self) -> Option<String> {
        self.uuid.read().clone()
    }

    pub(super) fn set_uuid(&self, uuid: &str) {
        *self.uuid.write() = Some(uuid.to_string());
    }

    pub fn read_only(&self) -> bool {
        self.read_only.load(Ordering::Acquire)
    }

    /// Whether the inactive table, if any, was loaded read-only.
    pub fn inactive_read_only(&self) -> bool {
        self.tables.read().inactive_read_only
    }

    pub fn stats(&self) -> &Arc<IoStats> {
        &self.stats
    }

    pub fn deferred_remove(&self) -> bool {
        self.deferred_remove.load(Ordering::Acquire)
    }

    pub(super) fn set_deferred_remove(&self, deferred: bool) {
        self.deferred_remove.store(deferred, Ordering::Release);
    }

    /// Waits up to `timeout` for every open handle to go; returns the open count then.
    pub fn wait_released(&self, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        let (lock, released) = &self.released;
        let mut guard = lock.lock();
        loop {
            let opens = self.open_count();
            let left = deadline.saturating_duration_since(Instant::now());
            if opens == 0 || left.is_zero() {
                return opens;
            }
            released.wait_for(&mut guard, left);
        }
    }

    pub fn live(&self) -> Arc<Table> {
        self.tables.read().live.clone()
    }

    pub fn inactive(&self) -> Option<Arc<Table>> {
        self.tables.read().inactive.clone()
    }

    pub fn is_suspended(&self) -> bool {
        self.gate.suspended.load(Ordering::SeqCst)
    }

    pub fn open_count(&self) -> usize {
        self.opens.load(Ordering::Acquire)
    }

    /// Opens of the device's file in the FUSE mount.
    pub fn file_open_count(&self) -> usize {
        self.file_opens.load(Ordering::Acquire)
    }

    /// Counts a client's open; `as_file` for the FUSE mount's file.
    pub fn open(self: &Arc<Self>, as_file: bool) -> OpenHandle {
        self.opens.fetch_add(1, Ordering::AcqRel);
        if as_file {
            self.file_opens.fetch_add(1, Ordering::AcqRel);
        }
        OpenHandle {
            device: self.clone(),
            as_file,
        }
    }

    /// Runs `request` on the live table inside the gate. A request its target pushed back (a
    /// noflush suspend began while it waited for a path) leaves the gate, so that the suspend
    /// completes, waits there for the resume and runs again on the table live then, as dm
    /// requeues it. Targets push back only between a presuspend and the resume, while the
    /// gate is closed, so this never spins.
    fn run<T>(&self, mut request: impl FnMut(&Table) -> Result<T>) -> Result<T> {
        loop {
            let (table, _in) = self.enter()?;
            match request(&table) {
                Err(BlockError::Requeue(why)) => debug!("device '{}': {why}", self.name()),
                done => return done,
            }
        }
    }

    /// Waits at the gate while the device is suspended, then enters it; on a thread that
    /// builds a table ([`no_waiting_while_building`]) a suspended device is an error instead.
    fn enter(&self) -> Result<(Arc<Table>, InFlight<'_>)> {
        let gate = &*self.gate;
        loop {
            if gate.try_enter() {
                return Ok((self.live(), InFlight(gate)));
            }
            if BUILDING.get() {
                return Err(BlockError::Io(format!(
                    "device '{}' is suspended: resume it before a table that reads it is \
                     loaded",
                    self.name()
                )));
            }
            // Suspended: sleep until resumed.
            let mut sleep = gate.sleep.lock();
            while gate.suspended.load(Ordering::SeqCst) {
                gate.wake.wait(&mut sleep);
            }
        }
    }

    /// Holds new I/O and waits for in-flight I/O to finish (dm's suspend). With `noflush`,
    /// what a target holds waiting (a multipath's requests queued for a path) comes back
    /// to the gate and waits there for the resume instead of failing.
    pub fn suspend(&self, noflush: bool) {
        let gate = &self.gate;
        if gate.suspended.swap(true, Ordering::SeqCst) {
            return;
        }
        self.live().presuspend(noflush);
        let mut sleep = gate.sleep.lock();
        while gate.in_flight.load(Ordering::SeqCst) > 0 {
            gate.wake.wait(&mut sleep);
        }
        drop(sleep);
        self.live().suspend();
    }

    /// Makes the inactive table live if there is one, and lets I/O flow again. Returns the
    /// table that was replaced, if any.
    ///
    /// A swap always happens on a suspended device: resuming with an inactive table but
    /// without a prior `suspend` (dmsetup's reload + resume habit) suspends first, so the old
    /// table's I/O drains and its targets commit before the new table reads their state, as
    /// the kernel's do_resume does.
    pub fn resume(&self) -> Option<Arc<Table>> {
        if self.inactive().is_some() {
            self.suspend(false);
        }
        let (replaced, live) = {
            let mut t = self.tables.write();
            let replaced = t
                .inactive
                .take()
                .map(|new| std::mem::replace(&mut t.live, new));
            if replaced.is_some() {
                self.read_only
                    .store(t.inactive_read_only, Ordering::Release);
            }
            self.size.store(t.live.size(), Ordering::SeqCst);
            (replaced, t.live.clone())
        };
        if self.is_suspended() || replaced.is_some() {
            live.resume();
        }
        self.open_gate();
        replaced
    }

    /// Lets I/O flow again on the live table, leaving an inactive table where it is: a
    /// suspend undone because it could not be recorded.
    pub fn undo_suspend(&self) {
        if self.is_suspended() {
            self.live().resume();
            self.open_gate();
        }
    }

    fn open_gate(&self) {
        let _sleep = self.gate.sleep.lock();
        self.gate.suspended.store(false, Ordering::SeqCst);
        self.gate.wake.notify_all();
    }

    /// Fills the inactive slot (dm's load); the live table is untouched until resume, which
    /// also makes the device read-only or read-write as `read_only` says.
    pub fn load(&self, table: Table, read_only: bool) {
        let mut tables = self.tables.write();
        tables.inactive = Some(Arc::new(table));
        tables.inactive_read_only = read_only;
    }

    /// Drops the inactive table, if any.
    pub fn clear_inactive(&self) {
        self.tables.write().inactive = None;
    }

    /// Replaces the live table at once (suspend, swap, resume), keeping read-only as it is
    /// and an inactive table the user loaded where it is. Returns the table replaced.
    pub fn replace_live(&self, table: Table) -> Option<Arc<Table>> {
        self.suspend(false);
        let kept = {
            let mut tables = self.tables.write();
            let kept = (tables.inactive.take(), tables.inactive_read_only);
            tables.inactive = Some(Arc::new(table));
            tables.inactive_read_only = self.read_only();
            kept
        };
        let replaced = self.resume();
        let mut tables = self.tables.write();
        (tables.inactive, tables.inactive_read_only) = kept;
        replaced
    }

    pub fn events(&self) -> &Arc<Events> {
        &self.events
    }
}

thread_local! {
    /// Whether this thread is building a table, under the registry's lock: I/O it does then
    /// (a constructor reading its metadata) must not wait at a suspended device's gate, as the
    /// resume that would open it needs that lock.
    static BUILDING: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread as building a table until the guard is dropped.
pub(super) fn no_waiting_while_building() -> impl Drop {
    struct Building(bool);
    impl Drop for Building {
        fn drop(&mut self) {
            BUILDING.set(self.0);
        }
    }
    Building(BUILDING.replace(true))
}

/// A device's event counter (dm's event_nr), raised by its targets and waited on by
/// `udm wait`.
#[derive(Default)]
pub struct Events {
    counter: Mutex<u64>,
    raised: Condvar,
}

impl Events {
    pub fn current(&self) -> u64 {
        *self.counter.lock()
    }

    pub fn raise(&self) {
        *self.counter.lock() += 1;
        self.raised.notify_all();
    }

    /// Blocks until the counter passes `after`, or `timeout` elapses; returns it.
    pub fn wait(&self, after: u64, timeout: Duration) -> u64 {
        let mut counter = self.counter.lock();
        self.raised
            .wait_while_for(&mut counter, |n| *n <= after, timeout);
        *counter
    }
}

/// A client's hold on a device. The device counts them, and `remove` refuses while any is
/// held (unless forced).
pub struct OpenHandle {
    device: Arc<Device>,
    as_file: bool,
}

impl Drop for OpenHandle {
    fn drop(&mut self) {
        let device = &self.device;
        if self.as_file {
            device.file_opens.fetch_sub(1, Ordering::AcqRel);
        }
        if device.opens.fetch_sub(1, Ordering::AcqRel) == 1 {
            let _lock = device.released.0.lock();
            device.released.1.notify_all();
        }
    }
}

impl BlockDevice for Device {
    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }
    fn capabilities(&self) -> Capabilities {
        let caps = self.live().capabilities();
        Capabilities {
            read_only: caps.read_only || self.read_only(),
            ..caps
        }
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let io = self.stats.start(Op::Read, buf.len() as u64);
        io.finish(self.run(|table| table.read(offset, buf)))
    }
    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> Result<()> {
        let io = self.stats.start(Op::Write, buf.len() as u64);
        if self.read_only() {
            return io.finish(Err(BlockError::ReadOnly(format!(
                "device {} is read-only",
                self.name()
            ))));
        }
        io.finish(self.run(|table| table.write(offset, buf, flags)))
    }
    fn flush(&self) -> Result<()> {
        let io = self.stats.start(Op::Flush, 0);
        io.finish(self.run(|table| table.flush()))
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        let io = self.stats.start(Op::Discard, len);
        io.finish(self.run(|table| table.discard(offset, len)))
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        let io = self.stats.start(Op::WriteZeroes, len);
        io.finish(self.run(|table| table.write_zeroes(offset, len, flags)))
    }
    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.run(|table| table.block_status(offset, len))
    }
    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        self.run(|table| table.cache(offset, len))
    }
    /// Never waits: a suspended device's requests take the synchronous way and wait there.
    /// A request mapped here is counted when the engine completes it; one that is not
    /// mapped after all is counted by the synchronous call it then becomes.
    fn map(&self, op: MapOp, offset: u64, len: u64) -> Option<Mapping> {
        if self.read_only() && op.is_write() {
            return None;
        }
        if !self.gate.try_enter() {
            return None;
        }
        let hold = MappedInFlight(self.gate.clone());
        let io = self.stats.start(op.into(), len);
        let mapping = self.live().map(op, offset, len)?;
        Some(mapping.hold(hold).when_complete(move |done| match done {
            Completed::Ok => io.record(true),
            Completed::Failed(_) => io.record(false),
            // The synchronous retry counts the request.
            Completed::Retried(_) => {}
        }))
    }
    fn suspended(&self) -> bool {
        self.is_suspended()
    }
    fn identity(&self) -> Option<String> {
        Some(format!("udm-device:{}", self.serial))
    }
}

#[cfg(test)]
mod tests;
