//! A COW device in use: its exception store, the table of completed exceptions, the chunk
//! locks, and whether the snapshot is still valid. One [`Snap`] per COW device, shared by
//! every table of the device that uses it (a reload keeps the same one, as the kernel's
//! exception handover does), found through a [`Rendezvous`] keyed by the COW device.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use log::{error, warn};
use udm_block::{AlignedBuf, BlockDevice, BlockError, WriteFlags, SECTOR_SIZE};
use udm_metadata::snapshot::{ExceptionStore, Record, StoreError};

use super::chunk_locks::{ChunkGuard, ChunkLocks};
use super::exceptions::ExceptionTable;
use super::hub::{Hub, WriteGate};
use super::stages::Stages;
use crate::rendezvous::Rendezvous;
use crate::target::EventSink;

static COWS: Rendezvous<SnapHandle> = Rendezvous::new();
/// Activation order, which is the order origin writes lock snapshots in.
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// One chunk buffer per thread for origin chunks being saved.
    static CHUNK_BUFFER: std::cell::RefCell<AlignedBuf> = std::cell::RefCell::new(AlignedBuf::new());
}

pub struct Snap {
    pub id: u64,
    /// The COW device's identity ([`crate::rendezvous::device_key`]).
    pub cow_key: String,
    /// The COW device as the table that opened it first named it, for messages.
    pub cow_name: String,
    pub cow: Arc<dyn BlockDevice>,
    pub store: Box<dyn ExceptionStore>,
    pub persistent: bool,
    /// Chunk size in bytes.
    pub chunk: u64,
    pub exceptions: ExceptionTable,
    pub locks: Arc<ChunkLocks>,
    /// The snapshot device's writes in flight (mapped ones until they land): a merge takes
    /// the COW device over between them ([`Snap::set_merging`]).
    pub writes: Arc<WriteGate>,
    /// Where the asynchronous copy-outs' time goes.
    pub stages: Stages,
    valid: AtomicBool,
    /// A `PO` snapshot whose COW device filled up on a write to the snapshot: writes to it
    /// fail, reads go on.
    overflow: AtomicBool,
    merging: AtomicBool,
    active: AtomicBool,
    /// The `snapshot` tables on this COW device that are live and not suspended, by id, with
    /// their device: a merge takes the device over only once they are suspended.
    live_sources: Mutex<Vec<(u64, String)>>,
    raise_event: EventSink,
}

/// A snapshot registered with its origin's hub for as long as a table uses its COW device.
pub struct SnapHandle {
    pub snap: Arc<Snap>,
    pub hub: Arc<Hub>,
}

impl Drop for SnapHandle {
    fn drop(&mut self) {
        self.hub.deactivate(&self.snap);
    }
}

/// How a table wants to use a COW device.
pub struct CowUse<'a> {
    pub cow_key: String,
    pub cow_name: String,
    pub cow: Arc<dyn BlockDevice>,
    pub persistent: bool,
    pub hub: Arc<Hub>,
    pub raise_event: &'a EventSink,
}

impl SnapHandle {
    /// The snapshot on `cow`: the one a table of this device already uses, or one opened
    /// from the device by `open` (which reads the exception store).
    pub fn get(
        using: CowUse,
        open: impl FnOnce() -> Result<(Box<dyn ExceptionStore>, Vec<Record>, bool), String>,
    ) -> Result<Arc<SnapHandle>, String> {
        let handle = COWS.get_or_try_insert::<String>(&using.cow_key, || {
            let (store, records, valid) = open()?;
            let chunk = store.chunk_sectors() * SECTOR_SIZE;
            Ok(Arc::new(SnapHandle {
                snap: Arc::new(Snap {
                    id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
                    cow_key: using.cow_key.clone(),
                    cow_name: using.cow_name.clone(),
                    cow: using.cow.clone(),
                    store,
                    persistent: using.persistent,
                    chunk,
                    exceptions: ExceptionTable::new(&records),
                    locks: Arc::default(),
                    writes: Arc::default(),
                    stages: Stages::default(),
                    valid: AtomicBool::new(valid),
                    overflow: AtomicBool::new(false),
                    merging: AtomicBool::new(false),
                    active: AtomicBool::new(false),
                    live_sources: Mutex::default(),
                    raise_event: using.raise_event.clone(),
                }),
                hub: using.hub.clone(),
            }))
        })?;
        if !Arc::ptr_eq(&handle.hub, &using.hub) {
            return Err(format!(
                "COW device '{}' holds a snapshot of '{}', not of '{}'",
                using.cow_name,
                handle.hub.name(),
                using.hub.name()
            ));
        }
        if handle.snap.persistent != using.persistent {
            return Err(format!(
                "COW device '{}' is in use as a {} store",
                using.cow_name,
                if handle.snap.persistent {
                    "persistent"
                } else {
                    "transient"
                }
            ));
        }
        Ok(handle)
    }
}

impl Snap {
    pub fn is_valid(&self) -> bool {
        self.valid.load(Ordering::Acquire)
    }

    pub fn is_overflowed(&self) -> bool {
        self.overflow.load(Ordering::Acquire)
    }

    pub fn is_merging(&self) -> bool {
        self.merging.load(Ordering::Acquire)
    }

    pub fn is_active(&self) -> bool {
        self.active.load(Ordering::Acquire)
    }

    pub fn set_active(&self) {
        self.active.store(true, Ordering::Release);
    }

    /// `snapshot` table `table` of device `owner` serves I/O: resumed.
    pub fn source_resumed(&self, table: u64, owner: &str) {
        let mut sources = self.live_sources.lock();
        sources.retain(|(t, _)| *t != table);
        sources.push((table, owner.to_string()));
    }

    /// `snapshot` table `table` no longer serves I/O: suspended, or gone.
    pub fn source_suspended(&self, table: u64) {
        self.live_sources.lock().retain(|(t, _)| *t != table);
    }

    /// The device of `snapshot` table `table` is now called `new`.
    pub fn rename_source(&self, table: u64, new: &str) {
        let mut sources = self.live_sources.lock();
        for source in sources.iter_mut().filter(|(t, _)| *t == table) {
            source.1 = new.to_string();
        }
    }

    /// A device other than `except` whose `snapshot` table on this COW device serves I/O.
    pub fn live_source(&self, except: &str) -> Option<String> {
        let sources = self.live_sources.lock();
        sources
            .iter()
            .find(|(_, owner)| owner != except)
            .map(|(_, owner)| owner.clone())
    }

    /// The kernel's refusal (snapshot_preresume) of a table of device `owner` taking this COW
    /// device over while another device's `snapshot` table on it is live: two live tables
    /// would write one store as aliases. The COW device changes hands once that table is
    /// suspended, its I/O drained. `target` names the refused table's type.
    pub fn check_handover(&self, owner: &str, target: &str) -> Result<(), String> {
        match self.live_source(owner) {
            Some(device) => Err(format!(
                "{target}: unable to perform snapshot handover until source is suspended: \
                 device '{device}' serves COW device '{}' (udm suspend {device} first)",
                self.cow_name
            )),
            None => Ok(()),
        }
    }

    /// Gives the COW device to a merge once the snapshot device's writes under way have
    /// landed; later ones find it merging and fail. The merge's preresume has found the
    /// snapshot device suspended, but a restart resumes the devices it restores before it
    /// suspends them, and a resume of the snapshot device may come between that check and
    /// this: a write landing in a COW chunk the merge had copied back already would
    /// complete, and be in neither the origin nor any exception.
    pub fn set_merging(&self) {
        let _frozen = self.writes.freeze();
        self.merging.store(true, Ordering::Release);
    }

    /// Origin writes save their chunks here: an active, valid snapshot that is not being
    /// merged back.
    pub fn takes_copy_outs(&self) -> bool {
        self.is_active() && self.is_valid() && !self.is_merging()
    }

    pub fn chunks(&self, offset: u64, len: u64) -> std::ops::Range<u64> {
        offset / self.chunk..(offset + len).div_ceil(self.chunk)
    }

    pub fn has_all(&self, offset: u64, len: u64) -> bool {
        self.chunks(offset, len)
            .all(|c| self.exceptions.get(c).is_some())
    }

    /// Where the snapshot's own reads and writes find chunk `chunk`: its COW chunk once saved
    /// (an exception never moves while the snapshot serves, so that needs no hold); else
    /// `None`, with the chunk held (shared to read, exclusive to write) so that no copy-out
    /// saves it meanwhile, and looked up again once held: one may have saved it while we
    /// waited. The guard, if any, is for the caller to keep until its I/O is done.
    pub fn settle(&self, chunk: u64, exclusive: bool) -> (Option<u64>, Option<ChunkGuard>) {
        if let Some(new) = self.exceptions.get(chunk) {
            return (Some(new), None);
        }
        let held = match exclusive {
            true => self.locks.exclusive(chunk),
            false => self.locks.shared(chunk),
        };
        (self.exceptions.get(chunk), Some(held))
    }

    /// Where byte `offset` of the origin lives in COW chunk `new`.
    pub fn cow_offset(&self, new: u64, offset: u64) -> u64 {
        new * self.chunk + offset % self.chunk
    }

    /// The bytes of origin chunk `chunk` on an origin of `origin_size` (the last chunk may
    /// be short).
    pub fn chunk_range(&self, chunk: u64, origin_size: u64) -> (u64, u64) {
        let start = chunk * self.chunk;
        (start, (start + self.chunk).min(origin_size))
    }

    /// Drops the snapshot: durably marked invalid, so that origin writes no longer need to
    /// save anything for it, and an event. `why` says what happened.
    pub fn invalidate(&self, why: &str) {
        if !self.valid.swap(false, Ordering::AcqRel) {
            return;
        }
        error!("snapshot on '{}': invalidating it: {why}", self.cow_name);
        if let Err(e) = self.store.invalidate() {
            error!(
                "snapshot on '{}': marking the COW device invalid failed: {e}; after a \
                 restart it may be read as valid although the origin has moved on",
                self.cow_name
            );
        }
        (self.raise_event)();
    }

    /// A `PO` snapshot whose COW device filled up on a write to the snapshot.
    pub fn set_overflowed(&self) {
        if !self.overflow.swap(true, Ordering::AcqRel) {
            warn!(
                "snapshot on '{}': the COW device is full; writes to the snapshot fail from \
                 now on (Overflow)",
                self.cow_name
            );
            (self.raise_event)();
        }
    }

    /// Saves `data` (origin chunk `chunk` as the snapshot must see it) in a new COW chunk;
    /// the caller holds the chunk and submits the record. A persistent store's record may
    /// only be committed once its data is durable: written with FUA, so that the writes of
    /// concurrent copies become durable together rather than one device flush per commit.
    pub fn save_chunk(&self, chunk: u64, data: &[u8]) -> Result<Record, StoreError> {
        let new = self.store.allocate()?;
        self.cow.write(
            new * self.chunk,
            data,
            WriteFlags {
                fua: self.persistent,
            },
        )?;
        Ok(Record { old: chunk, new })
    }

    /// Commits `records` (their data saved) and makes them visible.
    pub fn commit(&self, records: &[Record]) -> Result<(), StoreError> {
        let ticket = self.store.submit(records)?;
        self.store.wait(ticket)?;
        self.insert(records);
        Ok(())
    }

    fn insert(&self, records: &[Record]) {
        for record in records {
            self.exceptions.insert(record.old, record.new);
        }
    }

    /// How a copy-out's commit went: its exceptions visible, or the snapshot dropped.
    pub fn committed(&self, records: &[Record], result: Result<(), StoreError>) {
        match result {
            Ok(()) => self.insert(records),
            Err(e) => self.invalidate(&format!("committing exceptions: {e}")),
        }
    }

    /// The first half of an origin write's copy-out: holds and saves every chunk of the
    /// ranges this snapshot lacks, and submits their records. `None` when there is nothing
    /// to save or the snapshot had to be dropped.
    pub fn begin_copy_out(
        self: &Arc<Self>,
        origin: &mut OriginCache,
        ranges: &[(u64, u64)],
    ) -> Option<Saving> {
        let mut guards = Vec::new();
        let mut records = Vec::new();
        // Ascending and each once: two ranges may fall in one chunk of this snapshot, and
        // holding a chunk twice would wait for ourselves.
        let mut chunks: Vec<u64> = ranges
            .iter()
            .flat_map(|&(offset, len)| self.chunks(offset, len))
            .collect();
        chunks.sort_unstable();
        chunks.dedup();
        for chunk in chunks {
            if self.exceptions.get(chunk).is_some() {
                continue;
            }
            let guard = self.locks.exclusive(chunk);
            if self.exceptions.get(chunk).is_some() {
                continue;
            }
            if !self.is_valid() {
                return None;
            }
            let saved = origin
                .chunk(self, chunk)
                .map_err(StoreError::from)
                .and_then(|data| self.save_chunk(chunk, data));
            match saved {
                Ok(record) => {
                    records.push(record);
                    guards.push(guard);
                }
                Err(e) => {
                    self.invalidate(&format!("saving origin chunk {chunk}: {e}"));
                    return None;
                }
            }
        }
        if records.is_empty() {
            return None;
        }
        match self.store.submit(&records) {
            Ok(ticket) => Some(Saving {
                snap: self.clone(),
                records,
                ticket,
                _guards: guards,
            }),
            Err(e) => {
                self.invalidate(&format!("committing exceptions: {e}"));
                None
            }
        }
    }
}

/// Chunks saved and submitted, held until their commit is durable.
pub struct Saving {
    snap: Arc<Snap>,
    records: Vec<Record>,
    ticket: u64,
    /// Let go once the commit is durable, by dropping the saving.
    _guards: Vec<ChunkGuard>,
}

impl Saving {
    /// Waits for the commit; the chunks are let go when this returns.
    pub fn finish(self) {
        let result = self.snap.store.wait(self.ticket);
        self.snap.committed(&self.records, result);
    }
}

/// The origin chunk last read for a copy-out, so that snapshots with the same chunk size
/// share one read.
pub struct OriginCache<'a> {
    origin: &'a dyn BlockDevice,
    buf: &'a mut AlignedBuf,
    held: Option<(u64, u64)>,
}

impl<'a> OriginCache<'a> {
    pub fn with<T>(origin: &dyn BlockDevice, f: impl FnOnce(&mut OriginCache) -> T) -> T {
        CHUNK_BUFFER.with_borrow_mut(|buf| {
            f(&mut OriginCache {
                origin,
                buf,
                held: None,
            })
        })
    }

    /// Origin chunk `chunk` as `snap` cuts chunks.
    fn chunk(&mut self, snap: &Snap, chunk: u64) -> Result<&[u8], BlockError> {
        let (start, end) = snap.chunk_range(chunk, self.origin.size());
        if self.held != Some((start, end)) {
            self.held = None;
            self.buf.resize((end - start) as usize);
            self.origin.read(start, self.buf)?;
            self.held = Some((start, end));
        }
        Ok(self.buf)
    }
}
