//! The pool object: what every table of one pool device and every thin device on it share —
//! the metadata (behind one mutex, never held across data I/O except the data flush that
//! must precede a commit, as the kernel's pre-commit callback), the mode, the gate, the
//! cells, the thin devices using it, and the commit once a second.
//!
//! Pools are found in two [`Rendezvous`]: by the pool device's name (how `thin` finds its
//! pool, and how a reloaded pool table finds the pool it replaces) and by the metadata
//! device (two pools on one metadata device are refused), as the kernel's pool table.
//!
//! This file holds the state, opening and the mode; [`commit`] the commits and what a failed
//! metadata operation does, [`mappings`] the pool's side of thin I/O, [`binding`] its life with
//! its tables (resume, suspend, users, status, messages).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use log::{error, info, warn};
use udm_block::{BlockDevice, BlockError, Result};
use udm_metadata::thin::ThinMetadata;

mod binding;
pub use binding::Unregistered;
mod commit;
mod mappings;

use crate::rendezvous::Rendezvous;
use crate::target::EventSink;
use crate::thin::args::Features;
use crate::thin::gate::Gate;
use crate::thin::mapcache::MapCache;
use crate::thin::space::Space;
use crate::thin::status::Mode;

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
    /// Thin devices whose mappings I/O changed since the last commit: the ones that lose
    /// acknowledged writes if this transaction is aborted.
    touched: BTreeSet<u32>,
}

/// One thin target (in a live or an inactive table) using a thin device of this pool.
struct ThinUse {
    token: u64,
    id: u32,
    owner: String,
    /// Resumed and not suspended: I/O may be running.
    live: bool,
    /// Its device is writable (or will be, once the table is live).
    writable: bool,
}

/// Which tables a thin device takes (see [`Pool::register_thin`]).
enum Hold {
    /// Only those of device `owner`: to others it is `what` (a receive's staging device).
    Private { owner: String, what: String },
    /// No writable one: the tables of the sends reading it (a snapshot being sent).
    Sent(Vec<String>),
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
    /// Thin devices that take only some tables (taken under `thins`).
    holds: Mutex<std::collections::BTreeMap<u32, Hold>>,
    /// Thin devices that lost acknowledged writes when a transaction was aborted: their
    /// flushes fail, so that no client takes them for durable, while a table uses them (the
    /// kernel's aborted_with_changes, which lasts as long as the device is open).
    lost: Mutex<BTreeSet<u32>>,
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
    /// The metadata device as the table names it, for messages (the key is its identity).
    pub metadata_name: &'a str,
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
                    opening.metadata_name, other.name
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
        let metadata_total = pool.meta().md.metadata_usage().total;
        let metadata_blocks = opening.metadata.size() / udm_metadata::BLOCK_SIZE as u64;
        if metadata_blocks < metadata_total {
            return Err(format!(
                "metadata device '{}' ({metadata_blocks} blocks) is smaller than the \
                 metadata of pool '{}' ({metadata_total} blocks): a metadata device cannot \
                 shrink",
                opening.metadata_name, pool.name
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
                opening.metadata_name
            ));
        }
        let mut md = ThinMetadata::open(
            opening.metadata.clone(),
            opening.block_sectors as u32,
            opening.nr_blocks,
        )
        .map_err(|e| format!("metadata device '{}': {e}", opening.metadata_name))?;
        let mode = if opening.bound.features.read_only || md.needs_check() {
            Mode::ReadOnly
        } else {
            Mode::Write
        };
        // Replication tells pools apart by their identity (one made again under the same
        // name reuses the old one's device ids and creation times): metadata without one
        // gets it at its first writable open; read-only, it is not written.
        if mode == Mode::Write {
            md.identify()
                .map_err(|e| format!("metadata device '{}': {e}", opening.metadata_name))?;
        }
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
                touched: BTreeSet::new(),
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
            holds: Mutex::default(),
            lost: Mutex::new(BTreeSet::new()),
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
        self.meta.lock()
    }

    pub fn try_meta(&self) -> Option<MutexGuard<'_, Meta>> {
        self.meta.try_lock()
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
        self.bound.read().data.clone()
    }

    pub fn features(&self) -> Features {
        self.bound.read().features
    }

    pub fn raise_event(&self) {
        let sink = self.bound.read().raise_event.clone();
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
}

impl Drop for Pool {
    fn drop(&mut self) {
        let (stop, wake) = &*self.stop;
        *stop.lock() = true;
        wake.notify_all();
        if self.mode() < Mode::ReadOnly && self.dirty.load(Ordering::Acquire) {
            let mut meta = self.meta.lock();
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
                let mut stopped = stopped.lock();
                wake.wait_while_for(&mut stopped, |s| !*s, COMMIT_PERIOD);
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
