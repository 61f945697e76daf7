//! The persistent exception store (`P`, `PO`): the kernel's layout, with group commits.
//!
//! Records are submitted once their data is durable on the COW device (the targets write it
//! with FUA) and wait for a commit. One committer thread takes everything queued, writes it
//! as one commit and wakes the waiters; whatever arrives meanwhile goes into the next one. A
//! commit:
//!
//! 1. if it fills the current area, zeroes the next one durably first (so the table still
//!    ends inside the next area after a crash) unless an earlier commit did,
//! 2. writes each changed area with FUA, all at once, and alongside them zeroes the area after
//!    the one it ends in, so that the commit filling that one needs no step 1.
//!
//! The kernel writes the data without FUA and the area with PREFLUSH + FUA instead; the
//! bytes on disk and the order in which they become durable are the same, but a preflush is
//! one flush of the whole device that every commit waits for in turn, whereas FUA data writes
//! are made durable in parallel by the submitters (the first-write benchmark: a third of the
//! throughput with the preflush).
//!
//! A torn area write keeps every record committed before it (they are written with the same
//! bytes), and whatever part of the new records survives is a prefix of valid records whose
//! data was already durable. The one danger is a later torn write bringing back records of
//! an earlier, interrupted commit that lie past the terminator; so at open, an area with
//! anything after its terminator is rewritten clean before anything else happens.

use parking_lot::{Condvar, Mutex};
use std::sync::Arc;
use std::thread::JoinHandle;

use log::warn;
use udm_block::{AlignedBuf, BlockDevice, WriteFlags, SECTOR_SIZE};

use super::layout::{
    area_image, check_chunk_sectors, encode_header, put_record, walk, Geometry, Header, Record,
    DEFAULT_CHUNK_SECTORS,
};
use super::{CommitStats, Durable, ExceptionStore, StoreError, Usage};

pub struct PersistentStore {
    shared: Arc<Shared>,
    /// Started by the first submission: a table that is built and never used (an inactive
    /// one, a COW device only read) runs no thread.
    committer: Mutex<Option<JoinHandle<()>>>,
}

/// What [`PersistentStore::open`] found on the device.
pub struct Opened {
    pub store: PersistentStore,
    pub records: Vec<Record>,
    pub valid: bool,
    /// The device was blank and has been formatted.
    pub formatted: bool,
}

struct Shared {
    dev: Arc<dyn BlockDevice>,
    geometry: Geometry,
    state: Mutex<State>,
    /// The committer waits here for records (or shutdown).
    work: Condvar,
    /// Submitters wait for their commit here, on the condition variable of its parity:
    /// the end of one commit wakes only its own waiters, not those already queued for the
    /// next.
    done: [Condvar; 2],
    /// One sequence of metadata writes at a time: a commit, a merge commit, invalidation.
    io: Mutex<Ahead>,
}

/// What the holder of [`Shared::io`] knows of the areas past the current one.
#[derive(Default)]
struct Ahead {
    /// An area past the current one that is durably zeroed: the commit that fills the area
    /// before it needs not zero it first. Each commit zeroes the area after the one it ends
    /// in alongside its area writes, so that filling an area costs one write time, not three
    /// (the zeroing, then the full area, then the next).
    zeroed: Option<u64>,
}

struct State {
    /// The durable table, in on-disk order.
    records: Vec<Record>,
    /// The area new records go to; the merge may step it back onto a full area.
    current_area: u64,
    next_free: u64,
    valid: bool,
    queue: Vec<Record>,
    /// Commits taken by the committer so far; records queued now go into the next one,
    /// whose number is their ticket.
    taken: u64,
    /// The last commit done (written, or failed).
    done: u64,
    /// The first commit that failed, and why; that and every later one fail.
    failure: Option<(u64, StoreError)>,
    shutdown: bool,
    stats: CommitStats,
    /// Told when the commit of their ticket is done ([`ExceptionStore::when_durable`]).
    callbacks: Vec<(u64, Durable)>,
}

impl State {
    fn in_area(&self, geometry: &Geometry) -> u64 {
        self.records.len() as u64 - self.current_area * geometry.per_area()
    }
}

/// A write that is durable when it returns, on devices with or without FUA.
fn write_durable(dev: &dyn BlockDevice, offset: u64, buf: &[u8]) -> Result<(), StoreError> {
    if dev.capabilities().native_fua {
        dev.write(offset, buf, WriteFlags { fua: true })?;
    } else {
        dev.write(offset, buf, WriteFlags::default())?;
        dev.flush()?;
    }
    Ok(())
}

fn header_sector(header: Header) -> AlignedBuf {
    let mut sector = AlignedBuf::zeroed(SECTOR_SIZE as usize);
    sector[..16].copy_from_slice(&encode_header(header));
    sector
}

impl PersistentStore {
    /// Opens the store on `dev`, formatting a blank device (magic 0) with `table_chunk_sectors`
    /// (0: the kernel's default, 32). A formatted device keeps its own chunk size, as in the
    /// kernel: the table's is only a default.
    pub fn open(dev: Arc<dyn BlockDevice>, table_chunk_sectors: u64) -> Result<Opened, StoreError> {
        let Some(found) = walk(&*dev)? else {
            let chunk_sectors = match table_chunk_sectors {
                0 => DEFAULT_CHUNK_SECTORS,
                n => n,
            };
            check_chunk_sectors(chunk_sectors).map_err(StoreError::Corrupt)?;
            let geometry = Geometry::new(chunk_sectors, dev.size());
            if geometry.chunks < 3 {
                return Err(StoreError::TooSmall(format!(
                    "{} sectors hold no more than the header and first metadata area; with \
                     chunks of {chunk_sectors} sectors it needs at least {} for one data chunk",
                    dev.size() / SECTOR_SIZE,
                    3 * chunk_sectors
                )));
            }
            let store = Self::start(dev, geometry, Vec::new(), 0, true);
            store.format()?;
            return Ok(Opened {
                store,
                records: Vec::new(),
                valid: true,
                formatted: true,
            });
        };
        let chunk_sectors = found.header.chunk_sectors;
        if table_chunk_sectors != 0 && table_chunk_sectors != chunk_sectors {
            warn!(
                "snapshot: the COW device's chunk size of {chunk_sectors} sectors overrides \
                 the table's {table_chunk_sectors}"
            );
        }
        let geometry = Geometry::new(chunk_sectors, dev.size());
        let next_free = found.next_free(&geometry);
        let store = Self::start(
            dev,
            geometry,
            found.records.clone(),
            found.current_area,
            found.header.valid,
        );
        store.shared.state.lock().next_free = next_free;
        if found.stale_tail {
            store.rewrite_current_area()?;
        }
        Ok(Opened {
            store,
            records: found.records,
            valid: found.header.valid,
            formatted: false,
        })
    }

    fn start(
        dev: Arc<dyn BlockDevice>,
        geometry: Geometry,
        records: Vec<Record>,
        current_area: u64,
        valid: bool,
    ) -> Self {
        let shared = Arc::new(Shared {
            dev,
            geometry,
            state: Mutex::new(State {
                records,
                current_area,
                next_free: 2,
                valid,
                queue: Vec::new(),
                taken: 0,
                done: 0,
                failure: None,
                shutdown: false,
                stats: CommitStats::default(),
                callbacks: Vec::new(),
            }),
            work: Condvar::new(),
            done: [Condvar::new(), Condvar::new()],
            io: Mutex::default(),
        });
        PersistentStore {
            shared,
            committer: Mutex::new(None),
        }
    }

    fn start_committer(&self) {
        let mut committer = self.committer.lock();
        if committer.is_none() {
            let shared = self.shared.clone();
            *committer = Some(
                std::thread::Builder::new()
                    .name("snapshot-commit".into())
                    .spawn(move || shared.committer())
                    .expect("spawn snapshot committer"),
            );
        }
    }

    pub fn geometry(&self) -> Geometry {
        self.shared.geometry
    }

    /// A zeroed area 0, made durable, then the header: a crash in between leaves a device
    /// that is still blank (the kernel writes the header first and can leave a header over a
    /// stale area).
    fn format(&self) -> Result<(), StoreError> {
        let g = self.shared.geometry;
        let dev = &*self.shared.dev;
        dev.write(
            g.offset(g.area_chunk(0)),
            &AlignedBuf::zeroed(g.chunk_bytes() as usize),
            WriteFlags::default(),
        )?;
        dev.flush()?;
        write_durable(
            dev,
            0,
            &header_sector(Header {
                valid: true,
                chunk_sectors: g.chunk_sectors,
            }),
        )
    }

    /// Rewrites the current area from the table in memory: its records, then zeroes.
    fn rewrite_current_area(&self) -> Result<(), StoreError> {
        let g = self.shared.geometry;
        let _io = self.shared.io.lock();
        let (area, image) = {
            let st = self.shared.state.lock();
            let first = (st.current_area * g.per_area()) as usize;
            (st.current_area, area_image(&g, &st.records[first..]))
        };
        write_durable(&*self.shared.dev, g.offset(g.area_chunk(area)), &image)
    }
}

impl Shared {
    fn committer(&self) {
        loop {
            let (batch, ticket, area, current) = {
                let mut st = self.state.lock();
                while st.queue.is_empty() && !st.shutdown {
                    self.work.wait(&mut st);
                }
                if st.queue.is_empty() {
                    return;
                }
                let batch = std::mem::take(&mut st.queue);
                st.taken += 1;
                let ticket = st.taken;
                if !st.valid && st.failure.is_none() {
                    st.failure = Some((ticket, StoreError::Invalid));
                }
                if st.failure.is_some() {
                    st.done = ticket;
                    self.done[ticket as usize % 2].notify_all();
                    let told = Self::due(&mut st);
                    drop(st);
                    Self::tell(told, &self.state);
                    continue;
                }
                let first = (st.current_area * self.geometry.per_area()) as usize;
                (batch, ticket, st.current_area, st.records[first..].to_vec())
            };
            let result = {
                let mut ahead = self.io.lock();
                self.write_commit(&batch, area, &current, &mut ahead)
            };
            let mut st = self.state.lock();
            match result {
                Ok(area) => {
                    st.stats.commits += 1;
                    st.stats.records += batch.len() as u64;
                    st.records.extend(batch);
                    st.current_area = area;
                }
                Err(e) => {
                    warn!("snapshot: committing exceptions: {e}");
                    st.failure = Some((ticket, e));
                }
            }
            st.done = ticket;
            self.done[ticket as usize % 2].notify_all();
            let told = Self::due(&mut st);
            drop(st);
            Self::tell(told, &self.state);
        }
    }

    /// The callbacks whose commit is done.
    fn due(st: &mut State) -> Vec<(u64, Durable)> {
        let done = st.done;
        let (due, later) = std::mem::take(&mut st.callbacks)
            .into_iter()
            .partition(|(ticket, _)| *ticket <= done);
        st.callbacks = later;
        due
    }

    /// Calls `told`, outside the state lock, with how their commits went.
    fn tell(told: Vec<(u64, Durable)>, state: &Mutex<State>) {
        if told.is_empty() {
            return;
        }
        let failure = state.lock().failure.clone();
        for (ticket, then) in told {
            then(match &failure {
                Some((first, e)) if ticket >= *first => Err(e.clone()),
                _ => Ok(()),
            })
        }
    }

    /// Writes `batch` after the `current` records of `area`; returns the area the next
    /// record goes to. Every area the batch fills is written only once the area after it is
    /// durably zero (so that the table still ends there after a crash); the area images are
    /// then written at once, with the zeroing of the area after the last one.
    fn write_commit(
        &self,
        batch: &[Record],
        mut area: u64,
        current: &[Record],
        ahead: &mut Ahead,
    ) -> Result<u64, StoreError> {
        let g = &self.geometry;
        let per_area = g.per_area();
        let mut image = area_image(g, current);
        let mut slot = current.len() as u64;
        let mut images = Vec::new();
        for record in batch {
            put_record(&mut image, slot, *record);
            slot += 1;
            if slot == per_area {
                images.push((
                    area,
                    std::mem::replace(&mut image, AlignedBuf::zeroed(g.chunk_bytes() as usize)),
                ));
                area += 1;
                slot = 0;
            }
        }
        if slot > 0 {
            images.push((area, image));
        }
        let zeroes = AlignedBuf::zeroed(g.chunk_bytes() as usize);
        // Allocation keeps room for the area after a full one; a device that ends anyway
        // simply ends the table there.
        let offset = |area: u64| Some(g.area_chunk(area)).filter(|&c| c < g.chunks);
        let known_zero = ahead.zeroed.take();
        let first: Vec<_> = images
            .iter()
            .filter(|(at, _)| *at < area && Some(at + 1) != known_zero)
            .filter_map(|(at, _)| offset(at + 1))
            .map(|chunk| (g.offset(chunk), &zeroes[..]))
            .collect();
        write_all_durable(&*self.dev, &first)?;
        let mut then: Vec<_> = images
            .iter()
            .map(|(at, image)| (g.offset(g.area_chunk(*at)), &image[..]))
            .collect();
        let next = offset(area + 1);
        if let Some(chunk) = next.filter(|_| known_zero != Some(area + 1)) {
            then.push((g.offset(chunk), &zeroes[..]));
        }
        write_all_durable(&*self.dev, &then)?;
        ahead.zeroed = next.map(|_| area + 1);
        Ok(area)
    }
}

/// Writes every `(offset, data)` durably, at once: each on a thread of its own but the first.
fn write_all_durable(dev: &dyn BlockDevice, writes: &[(u64, &[u8])]) -> Result<(), StoreError> {
    let Some(((offset, data), rest)) = writes.split_first() else {
        return Ok(());
    };
    std::thread::scope(|scope| {
        let others: Vec<_> = rest
            .iter()
            .map(|&(offset, data)| scope.spawn(move || write_durable(dev, offset, data)))
            .collect();
        let mine = write_durable(dev, *offset, data);
        others
            .into_iter()
            .map(|other| other.join().expect("metadata write thread"))
            .fold(mine, Result::and)
    })
}

impl ExceptionStore for PersistentStore {
    fn chunk_sectors(&self) -> u64 {
        self.shared.geometry.chunk_sectors
    }

    /// The next free chunk, skipping metadata chunks. Taking the last data chunk of an area
    /// also needs room for the next area, which a commit that fills this one zeroes.
    fn allocate(&self) -> Result<u64, StoreError> {
        let g = &self.shared.geometry;
        let mut st = self.shared.state.lock();
        if !st.valid {
            return Err(StoreError::Invalid);
        }
        let chunk = st.next_free;
        let mut next = chunk + 1;
        if g.is_metadata(next) {
            next += 1;
        }
        if next > g.chunks {
            return Err(StoreError::Full);
        }
        st.next_free = next;
        Ok(chunk)
    }

    fn submit(&self, records: &[Record]) -> Result<u64, StoreError> {
        self.start_committer();
        let mut st = self.shared.state.lock();
        if !st.valid {
            return Err(StoreError::Invalid);
        }
        if let Some((_, e)) = &st.failure {
            return Err(e.clone());
        }
        st.queue.extend_from_slice(records);
        self.shared.work.notify_one();
        Ok(st.taken + 1)
    }

    fn wait(&self, ticket: u64) -> Result<(), StoreError> {
        let mut st = self.shared.state.lock();
        while st.done < ticket {
            self.shared.done[ticket as usize % 2].wait(&mut st);
        }
        match &st.failure {
            Some((first, e)) if ticket >= *first => Err(e.clone()),
            _ => Ok(()),
        }
    }

    fn when_durable(&self, ticket: u64, then: Durable) {
        let mut st = self.shared.state.lock();
        if st.done < ticket {
            return st.callbacks.push((ticket, then));
        }
        drop(st);
        then(self.wait(ticket))
    }

    /// Writes the header with `valid = 0`, durably: an origin write that goes ahead without
    /// saving its chunk relies on the snapshot never being read again.
    fn invalidate(&self) -> Result<(), StoreError> {
        {
            let mut st = self.shared.state.lock();
            if !st.valid {
                return Ok(());
            }
            st.valid = false;
        }
        let _io = self.shared.io.lock();
        write_durable(
            &*self.shared.dev,
            0,
            &header_sector(Header {
                valid: false,
                chunk_sectors: self.shared.geometry.chunk_sectors,
            }),
        )
    }

    fn usage(&self) -> Usage {
        let g = &self.shared.geometry;
        let st = self.shared.state.lock();
        Usage {
            allocated: st.next_free * g.chunk_sectors,
            total: self.shared.dev.size() / SECTOR_SIZE,
            metadata: (st.current_area + 2) * g.chunk_sectors,
        }
    }

    fn stats(&self) -> CommitStats {
        self.shared.state.lock().stats
    }

    /// The last `max` records, across areas if need be.
    fn merge_batch(&self, max: usize) -> Result<Vec<Record>, StoreError> {
        let st = self.shared.state.lock();
        if !st.valid {
            return Err(StoreError::Invalid);
        }
        let take = st.records.len().min(max);
        Ok(st.records[st.records.len() - take..].to_vec())
    }

    /// Zeroes the last `n` records on disk, then forgets them; their data must already be
    /// durable on the origin. Each area they were in is written with FUA, the last one
    /// first: a crash in between leaves later areas emptied (those records were merged) and
    /// an earlier one still full, whose table then ends at the empty area after it.
    fn commit_merge(&self, n: usize) -> Result<(), StoreError> {
        let g = self.shared.geometry;
        let per_area = g.per_area() as usize;
        let mut ahead = self.shared.io.lock();
        // The areas past the new end are rewritten here; what follows them is not known.
        ahead.zeroed = None;
        let (writes, keep) = {
            let st = self.shared.state.lock();
            if n > st.records.len() {
                return Err(StoreError::Unsupported(format!(
                    "cannot merge {n} records: the table holds {}",
                    st.records.len()
                )));
            }
            let keep = st.records.len() - n;
            let last_area = st.records.len().saturating_sub(1) / per_area;
            let writes: Vec<(u64, AlignedBuf)> = (keep / per_area..=last_area)
                .rev()
                .map(|area| {
                    let first = area * per_area;
                    let image = area_image(&g, &st.records[first.min(keep)..keep]);
                    (area as u64, image)
                })
                .collect();
            (writes, keep)
        };
        for (area, image) in writes {
            write_durable(&*self.shared.dev, g.offset(g.area_chunk(area)), &image)?;
        }
        let mut st = self.shared.state.lock();
        st.records.truncate(keep);
        // The area holding the last record left (the kernel's merge steps back onto it).
        st.current_area = (keep.saturating_sub(1) / per_area) as u64;
        st.next_free = g.area_chunk(st.current_area) + st.in_area(&g) + 1;
        Ok(())
    }
}

impl Drop for PersistentStore {
    /// Commits what is queued, then stops the committer. The last reference may go on the
    /// committer itself (a [`ExceptionStore::when_durable`] callback holding the last user of
    /// the store): it then ends on its own, as the queue is empty, and is not waited for.
    fn drop(&mut self) {
        self.shared.state.lock().shutdown = true;
        self.shared.work.notify_all();
        if let Some(committer) = self.committer.get_mut().take() {
            if committer.thread().id() != std::thread::current().id() {
                let _ = committer.join();
            }
        }
    }
}

#[cfg(test)]
mod tests;
