//! The pool object: what every table of one pool device and every thin device on it share —
//! the metadata (behind one mutex, never held across data I/O except the data flush that
//! must precede a commit, as the kernel's pre-commit callback), the mode, the gate, the
//! cells, the thin devices using it, and the commit once a second.
//!
//! Pools are found in two [`Rendezvous`]: by the pool device's name (how `thin` finds its
//! pool, and how a reloaded pool table finds the pool it replaces) and by the metadata
//! device (two pools on one metadata device are refused), as the kernel's pool table.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use log::{error, info, warn};
use udm_block::{BlockDevice, BlockError, Result};
use udm_metadata::thin::{DeviceInfo, Mapping, ThinError, ThinMetadata};

use super::args::Features;
use super::gate::Gate;
use super::mapcache::MapCache;
use super::space::Space;
use super::status::{metadata_low_water, Mode, PoolStatus};
use crate::rendezvous::Rendezvous;
use crate::target::{EventSink, TargetError};

/// Pools by the name of their pool device.
pub static POOLS: Rendezvous<Pool> = Rendezvous::new();
/// Pools by their metadata device.
static BY_METADATA: Rendezvous<Pool> = Rendezvous::new();

const COMMIT_PERIOD: Duration = Duration::from_secs(1);

/// What the live pool table contributes: taken from the table at every resume (the kernel's
/// bind_control_target), so a reload can grow the data device or change features.
pub struct Bound {
    pub data: Arc<dyn BlockDevice>,
    /// As requested, with passdown off when the data device cannot discard.
    pub features: Features,
    pub low_water_blocks: u64,
    pub raise_event: EventSink,
}

pub struct Meta {
    pub md: ThinMetadata,
    /// Counts aborted transactions: a block allocated before an abort is not the pool's
    /// any more and must not be inserted.
    pub epoch: u64,
    /// Data blocks unmapped to refcount 0, discarded on the data device at the next commit
    /// if they are still free then: a block allocated in the same transaction may have been
    /// freed and allocated again meanwhile.
    passdown: Vec<u64>,
}

/// One thin target (in a live or an inactive table) using a thin device of this pool.
struct ThinUse {
    token: u64,
    id: u32,
    owner: String,
    /// Resumed and not suspended: I/O may be running.
    live: bool,
}

pub struct Pool {
    /// The pool device's name.
    pub name: String,
    metadata_key: String,
    data_key: String,
    pub block_sectors: u64,
    meta: Mutex<Meta>,
    /// Changed since the last commit. Written under the metadata lock.
    dirty: AtomicBool,
    mode: AtomicU8,
    bound: RwLock<Bound>,
    pub gate: Gate,
    pub cells: Arc<super::cells::Cells>,
    /// Mappings recently used, kept exact by every change below.
    maps: MapCache,
    pub space: Space,
    thins: Mutex<Vec<ThinUse>>,
    next_token: AtomicU64,
    low_water_triggered: AtomicBool,
    metadata_low_triggered: AtomicBool,
    /// Tells the commit thread to stop.
    stop: Arc<(Mutex<bool>, Condvar)>,
}

/// A thin request's place in the pool's gate.
pub struct InFlight<P: std::ops::Deref<Target = Pool>>(pub P);

impl<P: std::ops::Deref<Target = Pool>> Drop for InFlight<P> {
    fn drop(&mut self) {
        self.0.gate.leave();
    }
}

/// What opening or reloading a pool needs from its table line.
pub struct Opening<'a> {
    pub owner: &'a str,
    pub metadata_key: String,
    pub data_key: String,
    pub metadata: Arc<dyn BlockDevice>,
    pub block_sectors: u64,
    pub nr_blocks: u64,
    pub bound: Bound,
}

impl Pool {
    /// The pool of device `owner`: the one already there (a reload, which must name the same
    /// metadata and data devices, block size and discard support) or a new one opened on the
    /// metadata device.
    pub fn find_or_open(opening: Opening) -> std::result::Result<Arc<Pool>, String> {
        let mut created = false;
        let pool = POOLS.get_or_try_insert(opening.owner, || {
            if let Some(other) = BY_METADATA.get(&opening.metadata_key) {
                return Err(format!(
                    "metadata device '{}' is already in use by pool '{}'",
                    opening.metadata_key, other.name
                ));
            }
            let pool = Pool::open(&opening)?;
            BY_METADATA
                .get_or_try_insert::<()>(&opening.metadata_key, || Ok(pool.clone()))
                .expect("checked above");
            start_committer(&pool);
            created = true;
            Ok(pool)
        })?;
        if created {
            return Ok(pool);
        }
        if pool.metadata_key != opening.metadata_key || pool.data_key != opening.data_key {
            return Err(format!(
                "a different pool cannot replace pool '{}' (metadata '{}', data '{}'): \
                 remove the thin devices and the pool first",
                pool.name, pool.metadata_key, pool.data_key
            ));
        }
        if pool.block_sectors != opening.block_sectors {
            return Err(format!(
                "pool '{}' has data blocks of {} sectors; its block size cannot change",
                pool.name, pool.block_sectors
            ));
        }
        if pool.features().discard_enabled != opening.bound.features.discard_enabled {
            return Err(format!(
                "discard support of pool '{}' cannot change once the pool is active",
                pool.name
            ));
        }
        let total = pool.meta().md.data_usage().total;
        if opening.nr_blocks < total {
            return Err(format!(
                "pool target ({} blocks) too small: pool '{}' has {total} data blocks \
                 (a pool's data device cannot shrink)",
                opening.nr_blocks, pool.name
            ));
        }
        Ok(pool)
    }

    fn open(opening: &Opening) -> std::result::Result<Arc<Pool>, String> {
        if opening.bound.features.read_only && superblock_is_blank(&*opening.metadata)? {
            return Err(format!(
                "read_only: metadata device '{}' holds no pool to open (it is all zeroes)",
                opening.metadata_key
            ));
        }
        let md = ThinMetadata::open(
            opening.metadata.clone(),
            opening.block_sectors as u32,
            opening.nr_blocks,
        )
        .map_err(|e| format!("metadata device '{}': {e}", opening.metadata_key))?;
        let mode = if opening.bound.features.read_only || md.needs_check() {
            Mode::ReadOnly
        } else {
            Mode::Write
        };
        info!(
            "thin-pool '{}': opened, {} thin device(s), {}/{} data blocks of {} sectors used",
            opening.owner,
            md.devices().len(),
            md.data_usage().used,
            md.data_usage().total,
            opening.block_sectors
        );
        Ok(Arc::new(Pool {
            name: opening.owner.to_string(),
            metadata_key: opening.metadata_key.clone(),
            data_key: opening.data_key.clone(),
            block_sectors: opening.block_sectors,
            meta: Mutex::new(Meta {
                md,
                epoch: 0,
                passdown: Vec::new(),
            }),
            dirty: AtomicBool::new(false),
            mode: AtomicU8::new(mode as u8),
            bound: RwLock::new(Bound {
                data: opening.bound.data.clone(),
                features: opening.bound.features,
                low_water_blocks: opening.bound.low_water_blocks,
                raise_event: opening.bound.raise_event.clone(),
            }),
            // Closed until the first resume binds a table.
            gate: Gate::closed(),
            cells: Arc::default(),
            maps: MapCache::default(),
            space: Space::default(),
            thins: Mutex::new(Vec::new()),
            next_token: AtomicU64::new(0),
            low_water_triggered: AtomicBool::new(false),
            metadata_low_triggered: AtomicBool::new(false),
            stop: Arc::new((Mutex::new(false), Condvar::new())),
        }))
    }

    pub fn block_bytes(&self) -> u64 {
        self.block_sectors * udm_block::SECTOR_SIZE
    }

    pub fn meta(&self) -> MutexGuard<'_, Meta> {
        self.meta.lock().unwrap()
    }

    pub fn try_meta(&self) -> Option<MutexGuard<'_, Meta>> {
        self.meta.try_lock().ok()
    }

    pub fn mode(&self) -> Mode {
        Mode::from_u8(self.mode.load(Ordering::Acquire))
    }

    pub fn is_dirty(&self) -> bool {
        self.dirty.load(Ordering::Acquire)
    }

    pub fn mark_dirty(&self) {
        self.dirty.store(true, Ordering::Release);
    }

    /// The data device of the live pool table.
    pub fn data(&self) -> Arc<dyn BlockDevice> {
        self.bound.read().unwrap().data.clone()
    }

    pub fn features(&self) -> Features {
        self.bound.read().unwrap().features
    }

    pub fn raise_event(&self) {
        let sink = self.bound.read().unwrap().raise_event.clone();
        sink();
    }

    /// Enters the gate for a synchronous thin request, waiting while the pool is suspended.
    pub fn enter(&self) -> Result<InFlight<&Pool>> {
        self.gate.enter();
        let in_flight = InFlight(self);
        if self.mode() == Mode::Fail {
            return Err(BlockError::Io(format!(
                "thin-pool '{}' is in fail mode",
                self.name
            )));
        }
        Ok(in_flight)
    }

    /// Changes the mode, saying so in the log and with an event.
    pub fn set_mode(&self, new: Mode) {
        let old = Mode::from_u8(self.mode.swap(new as u8, Ordering::AcqRel));
        if old == new {
            return;
        }
        let what = match new {
            Mode::Write => "write mode",
            Mode::OutOfDataSpace if self.features().error_if_no_space => {
                "out-of-data-space (error IO) mode"
            }
            Mode::OutOfDataSpace => "out-of-data-space (queue IO) mode",
            Mode::ReadOnly => "read-only mode",
            Mode::Fail => "failure mode",
        };
        match new {
            Mode::Write => info!("thin-pool '{}': switching pool to {what}", self.name),
            _ => error!("thin-pool '{}': switching pool to {what}", self.name),
        }
        self.raise_event();
        self.space.changed();
    }

    /// After a metadata operation failed: the transaction is dropped and the pool goes
    /// read-only (needs_check set, unless the metadata device is merely full), or to fail
    /// mode when even that fails. Returns the error for the request that ran into it.
    pub fn metadata_failed(&self, meta: &mut Meta, op: &str, e: ThinError) -> BlockError {
        let full = e == ThinError::MetadataFull;
        if full {
            let usage = meta.md.metadata_usage();
            error!(
                "thin-pool '{}': the metadata device is full ({}/{} blocks) during {op}: \
                 switching the pool to read-only; writes that need a new block and messages \
                 fail until the pool is on a larger metadata device",
                self.name, usage.used, usage.total
            );
        } else {
            error!(
                "thin-pool '{}': metadata operation {op} failed: {e}; run thin_check on the \
                 metadata device",
                self.name
            );
        }
        let mut next = Mode::ReadOnly;
        if let Err(abort) = meta.md.abort() {
            error!(
                "thin-pool '{}': aborting the transaction failed too: {abort}",
                self.name
            );
            next = Mode::Fail;
        }
        meta.epoch += 1;
        meta.passdown.clear();
        self.maps.clear();
        self.dirty.store(false, Ordering::Release);
        if !full && next != Mode::Fail {
            if let Err(flag) = meta.md.set_needs_check() {
                error!(
                    "thin-pool '{}': setting needs_check failed: {flag}",
                    self.name
                );
                next = Mode::Fail;
            }
        }
        if self.mode() != Mode::Fail {
            self.set_mode(next);
        }
        BlockError::Io(format!("thin-pool '{}': {op}: {e}", self.name))
    }

    /// Makes every completed write durable: the data device is flushed, then (if anything
    /// changed) the metadata committed, so no committed mapping points at data that is not
    /// on disk.
    pub fn commit(&self) -> Result<()> {
        let mut meta = self.meta();
        self.commit_locked(&mut meta)
    }

    pub fn commit_locked(&self, meta: &mut Meta) -> Result<()> {
        let data = self.data();
        let block = self.block_bytes();
        let freed: Vec<u64> = meta.passdown.drain(..).collect();
        for block_nr in freed {
            // Under the metadata lock nobody can allocate it between the check and the discard.
            match meta.md.data_ref_count(block_nr) {
                Ok(0) => {}
                Ok(_) => continue,
                Err(e) => return Err(self.metadata_failed(meta, "data_ref_count", e)),
            }
            if let Err(e) = data.discard(block_nr * block, block) {
                warn!(
                    "thin-pool '{}': discard passdown of block {block_nr}: {e}",
                    self.name
                );
            }
        }
        data.flush()?;
        if !self.is_dirty() || self.mode() >= Mode::ReadOnly {
            return Ok(());
        }
        if let Err(e) = meta.md.commit() {
            return Err(self.metadata_failed(meta, "commit", e));
        }
        self.dirty.store(false, Ordering::Release);
        if self.mode() == Mode::OutOfDataSpace {
            let usage = meta.md.data_usage();
            if usage.used < usage.total {
                // Blocks freed in the transaction just committed can be allocated now.
                self.space.reset();
                self.set_mode(Mode::Write);
            }
        }
        self.check_metadata_low_water(meta);
        Ok(())
    }

    /// Commits if something changed and the pool is running (the once-a-second commit).
    fn periodic_commit(&self) {
        if self.is_dirty() && !self.gate.is_closed() && self.mode() < Mode::ReadOnly {
            if let Err(e) = self.commit() {
                warn!("thin-pool '{}': periodic commit failed: {e}", self.name);
            }
        }
    }

    /// Hands out a data block for a write (the caller fills it, then inserts it). `None`
    /// means the data device is full.
    pub fn alloc_block(&self) -> std::result::Result<Option<(u64, u64)>, BlockError> {
        let mut meta = self.meta();
        self.check_writable()?;
        match meta.md.alloc_data_block() {
            Ok(Some(block)) => {
                self.mark_dirty();
                self.check_low_water(&meta);
                Ok(Some((block, meta.epoch)))
            }
            Ok(None) => Ok(None),
            Err(e) => Err(self.metadata_failed(&mut meta, "alloc_data_block", e)),
        }
    }

    /// Takes back a block whose data write failed (unless the transaction that allocated
    /// it was rolled back since, which took it back already).
    pub fn give_back(&self, block: u64, epoch: u64) {
        let mut meta = self.meta();
        if meta.epoch == epoch {
            if let Err(e) = meta.md.release_data_block(block) {
                self.metadata_failed(&mut meta, "release_data_block", e);
            }
        }
    }

    /// Maps `vblock` of `id` to a block from [`Pool::alloc_block`], now filled.
    pub fn insert(&self, id: u32, vblock: u64, block: u64, epoch: u64) -> Result<()> {
        let mut meta = self.meta();
        if meta.epoch != epoch {
            return Err(BlockError::Io(format!(
                "thin-pool '{}': the metadata transaction was rolled back while block {vblock} \
                 of thin device {id} was being written",
                self.name
            )));
        }
        self.check_writable()?;
        match meta.md.insert(id, vblock, block) {
            Ok(()) => {
                self.mark_dirty();
                // Made now, after the device's last snapshot: its own.
                let mapping = Mapping {
                    data_block: block,
                    shared: false,
                };
                self.maps.put((id, vblock), mapping);
                Ok(())
            }
            Err(e) => Err(self.metadata_failed(&mut meta, "insert", e)),
        }
    }

    /// Unmaps `vblock` of `id` (a discard); a block that became free is passed down to the
    /// data device at the next commit, if the pool passes discards down.
    pub fn unmap(&self, id: u32, vblock: u64) -> Result<()> {
        let mut meta = self.meta();
        self.check_writable()?;
        match meta.md.lookup(id, vblock) {
            Ok(None) => return Ok(()),
            Ok(Some(_)) => {}
            Err(e) => return Err(self.lookup_failed(id, vblock, e)),
        }
        match meta.md.remove(id, vblock) {
            Ok(freed) => {
                self.mark_dirty();
                self.maps.forget((id, vblock));
                if let Some(freed) = freed.filter(|_| self.features().discard_passdown) {
                    meta.passdown.push(freed);
                }
                Ok(())
            }
            Err(e) => Err(self.metadata_failed(&mut meta, "remove", e)),
        }
    }

    /// Where `vblock` of `id` lives. The caller holds the block's cell (shared or
    /// exclusive), which is what keeps the mapping cache exact for it.
    pub fn lookup(&self, id: u32, vblock: u64) -> Result<Option<Mapping>> {
        if let Some(mapping) = self.maps.get((id, vblock)) {
            return Ok(Some(mapping));
        }
        let mut meta = self.meta();
        self.lookup_locked(&mut meta, id, vblock)
            .map_err(|e| self.lookup_failed(id, vblock, e))
    }

    /// [`Pool::lookup`] past the cache, with the metadata lock held; remembers what it finds.
    pub fn lookup_locked(
        &self,
        meta: &mut Meta,
        id: u32,
        vblock: u64,
    ) -> std::result::Result<Option<Mapping>, ThinError> {
        let found = meta.md.lookup(id, vblock)?;
        if let Some(mapping) = found {
            self.maps.put((id, vblock), mapping);
        }
        Ok(found)
    }

    /// [`Pool::lookup`] from the cache alone.
    pub fn cached(&self, id: u32, vblock: u64) -> Option<Mapping> {
        self.maps.get((id, vblock))
    }

    /// Mapped runs of `id` in `[begin, end)`: (vblock, data block, len, shared).
    pub fn lookup_range(
        &self,
        id: u32,
        begin: u64,
        end: u64,
    ) -> Result<Vec<(u64, u64, u64, bool)>> {
        self.meta()
            .md
            .lookup_range(id, begin, end)
            .map_err(|e| self.lookup_failed(id, begin, e))
    }

    /// A failed lookup fails the request; the metadata is not changed by it, so the mode
    /// stays (as the kernel's dm_thin_find_block failures).
    pub fn lookup_failed(&self, id: u32, vblock: u64, e: ThinError) -> BlockError {
        error!(
            "thin-pool '{}': looking up block {vblock} of thin device {id}: {e}",
            self.name
        );
        BlockError::Io(format!("thin-pool '{}': {e}", self.name))
    }

    fn check_writable(&self) -> Result<()> {
        match self.mode() {
            Mode::Write | Mode::OutOfDataSpace => Ok(()),
            mode => Err(BlockError::Io(format!(
                "thin-pool '{}' is {}: no new blocks can be mapped",
                self.name,
                match mode {
                    Mode::Fail => "in fail mode",
                    _ => "read-only",
                }
            ))),
        }
    }

    fn check_low_water(&self, meta: &Meta) {
        let usage = meta.md.data_usage();
        let free = usage.total - usage.used;
        let low_water = self.bound.read().unwrap().low_water_blocks;
        if free <= low_water && !self.low_water_triggered.swap(true, Ordering::AcqRel) {
            warn!(
                "thin-pool '{}': reached low water mark for data device ({free} of {} blocks \
                 free, mark {low_water}): sending event",
                self.name, usage.total
            );
            self.raise_event();
        }
    }

    fn check_metadata_low_water(&self, meta: &Meta) {
        let usage = meta.md.metadata_usage();
        let free = usage.total - usage.used;
        if free <= metadata_low_water(usage.total)
            && !self.metadata_low_triggered.swap(true, Ordering::AcqRel)
        {
            warn!(
                "thin-pool '{}': reached low water mark for metadata device ({free} of {} \
                 blocks free): sending event",
                self.name, usage.total
            );
            self.raise_event();
        }
    }

    /// Takes the live table's devices and features (at every resume of a pool table): grows
    /// the data space if the table is larger, sets the mode the table asks for, and lets
    /// thin I/O through again.
    pub fn bind(&self, bound: Bound, nr_blocks: u64) {
        let read_only = bound.features.read_only;
        *self.bound.write().unwrap() = bound;
        let mut meta = self.meta();
        let total = meta.md.data_usage().total;
        if nr_blocks > total && self.mode() < Mode::ReadOnly {
            if meta.md.needs_check() {
                error!(
                    "thin-pool '{}': unable to grow the data device until repaired",
                    self.name
                );
            } else {
                info!(
                    "thin-pool '{}': growing the data device from {total} to {nr_blocks} blocks",
                    self.name
                );
                match meta.md.resize_data(nr_blocks) {
                    Ok(()) => self.mark_dirty(),
                    Err(e) => {
                        self.metadata_failed(&mut meta, "resize_data", e);
                    }
                }
            }
        }
        match self.mode() {
            Mode::Fail => {}
            _ if !read_only && meta.md.needs_check() => {
                error!(
                    "thin-pool '{}': unable to switch the pool to write mode until repaired \
                     (thin_check, thin_repair)",
                    self.name
                );
                self.set_mode(Mode::ReadOnly);
            }
            _ => self.set_mode(if read_only {
                Mode::ReadOnly
            } else {
                Mode::Write
            }),
        }
        self.low_water_triggered.store(false, Ordering::Release);
        self.metadata_low_triggered.store(false, Ordering::Release);
        self.space.reset();
        if let Err(e) = self.commit_locked(&mut meta) {
            warn!("thin-pool '{}': commit at resume failed: {e}", self.name);
        }
        drop(meta);
        self.gate.open();
    }

    /// Holds thin I/O and waits for what is in flight, then commits (pool suspend).
    pub fn suspend(&self) {
        self.gate.close();
        if let Err(e) = self.commit() {
            warn!("thin-pool '{}': commit at suspend failed: {e}", self.name);
        }
    }

    /// Registers a thin target of device `id` in the table of device `owner`.
    pub fn register_thin(&self, id: u32, owner: &str) -> u64 {
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        self.thins.lock().unwrap().push(ThinUse {
            token,
            id,
            owner: owner.to_string(),
            live: false,
        });
        token
    }

    pub fn set_thin_live(&self, token: u64, live: bool) {
        if let Some(thin) = self
            .thins
            .lock()
            .unwrap()
            .iter_mut()
            .find(|t| t.token == token)
        {
            thin.live = live;
        }
    }

    pub fn unregister_thin(&self, token: u64) {
        self.thins.lock().unwrap().retain(|t| t.token != token);
    }

    /// The devices whose tables use thin device `id`: (name, live).
    pub fn users_of(&self, id: u32) -> Vec<(String, bool)> {
        let mut users: Vec<(String, bool)> = Vec::new();
        for thin in self.thins.lock().unwrap().iter().filter(|t| t.id == id) {
            match users.iter_mut().find(|(name, _)| *name == thin.owner) {
                Some((_, live)) => *live |= thin.live,
                None => users.push((thin.owner.clone(), thin.live)),
            }
        }
        users
    }

    pub fn device(&self, id: u32) -> Option<DeviceInfo> {
        self.meta().md.device(id)
    }

    /// The status line's numbers. Commits first when running (as the kernel does, so the
    /// metadata figures are current).
    pub fn status(&self) -> PoolStatus {
        if self.mode() != Mode::Fail && !self.gate.is_closed() {
            if let Err(e) = self.commit() {
                warn!("thin-pool '{}': commit for status failed: {e}", self.name);
            }
        }
        let meta = self.meta();
        let data = meta.md.data_usage();
        let metadata = meta.md.metadata_usage();
        let features = self.features();
        PoolStatus {
            mode: self.mode(),
            transaction_id: meta.md.transaction_id(),
            metadata_used: metadata.used,
            metadata_total: metadata.total,
            data_used: data.used,
            data_total: data.total,
            held_root: meta.md.held_root(),
            discard_enabled: features.discard_enabled,
            discard_passdown: features.discard_passdown,
            error_if_no_space: features.error_if_no_space || self.space.timed_out(),
            needs_check: meta.md.needs_check(),
            metadata_low_water: metadata_low_water(metadata.total),
        }
    }

    /// Runs a pool message that changes metadata, then commits (as the kernel does).
    pub fn message(
        &self,
        run: impl FnOnce(&mut Meta) -> std::result::Result<(), ThinError>,
        what: &str,
    ) -> std::result::Result<(), TargetError> {
        if self.mode() >= Mode::ReadOnly {
            return Err(TargetError::new(format!(
                "thin-pool: unable to service pool target messages in read-only or fail mode \
                 (pool '{}' is {})",
                self.name,
                self.mode().word()
            )));
        }
        let mut meta = self.meta();
        // Snapshots change which of a device's blocks are shared, deletes unmap whole
        // devices: the cache starts over.
        self.maps.clear();
        match run(&mut meta) {
            Ok(()) => {}
            Err(
                e @ (ThinError::NoSuchDevice(_)
                | ThinError::DeviceExists(_)
                | ThinError::BadArgument(_)),
            ) => return Err(TargetError::new(format!("thin-pool: {what}: {e}"))),
            Err(e) => {
                let e = self.metadata_failed(&mut meta, what, e);
                return Err(TargetError::new(format!("thin-pool: {e}")));
            }
        }
        self.mark_dirty();
        self.commit_locked(&mut meta)
            .map_err(|e| TargetError::new(format!("thin-pool: {what}: committing: {e}")))?;
        // A delete may have freed blocks that requests are waiting for.
        self.space.changed();
        Ok(())
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let (stop, wake) = &*self.stop;
        *stop.lock().unwrap() = true;
        wake.notify_all();
        if self.mode() < Mode::ReadOnly && self.dirty.load(Ordering::Acquire) {
            let mut meta = self.meta.lock().unwrap();
            if let Err(e) = self.commit_locked(&mut meta) {
                warn!("thin-pool '{}': final commit failed: {e}", self.name);
            }
        }
    }
}

/// True when the superblock block of `dev` is all zeroes (no pool was ever formatted there).
fn superblock_is_blank(dev: &dyn BlockDevice) -> std::result::Result<bool, String> {
    let mut block = udm_block::AlignedBuf::zeroed(udm_metadata::BLOCK_SIZE);
    dev.read(0, &mut block)
        .map_err(|e| format!("reading the metadata superblock: {e}"))?;
    Ok(block.iter().all(|&b| b == 0))
}

/// Commits a pool once a second while it lives. The thread holds only a weak reference, so
/// it never keeps a removed pool alive.
fn start_committer(pool: &Arc<Pool>) {
    let weak = Arc::downgrade(pool);
    let stop = pool.stop.clone();
    let spawned = std::thread::Builder::new()
        .name("thin-commit".into())
        .spawn(move || loop {
            {
                let (stopped, wake) = &*stop;
                let stopped = stopped.lock().unwrap();
                let (stopped, _) = wake
                    .wait_timeout_while(stopped, COMMIT_PERIOD, |s| !*s)
                    .unwrap();
                if *stopped {
                    return;
                }
            }
            let Some(pool) = weak.upgrade() else {
                return;
            };
            pool.periodic_commit();
        });
    if let Err(e) = spawned {
        warn!(
            "thin-pool '{}': cannot start the commit thread ({e}); commits happen on \
             FLUSH and FUA only",
            pool.name
        );
    }
}
