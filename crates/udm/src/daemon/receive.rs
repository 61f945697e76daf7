//! The receiving side of replication: a stream applied into a live pool. The records go to a
//! hidden staging device (a snapshot of the base the stream names, or a new thin device for a
//! full stream) through a private `thin` table, with the progress made durable every 64 MiB
//! or second; only at a trailer that checks out does the staging device become thin device
//! `id`, in one metadata commit. A stream that is refused, or cut, leaves the pool's devices as
//! they were — except that with `resume` a cut or refused receive keeps its staging device and
//! progress, for a later stream to continue from the last durable record.

use std::collections::BTreeSet;
use std::io::Read;
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{info, warn};
use parking_lot::Mutex;
use serde_json::json;
use udm_block::{AlignedBuf, BlockDevice, WriteFlags, ZeroFlags};
use udm_metadata::thin::MAX_DEV_ID;
use udm_targets::replica::{self, PoolHandle};
use udm_targets::Table;

use super::device::Events;
use super::received::{identity_of, settle, stamp_of, Mark, Partial, Plan, PoolState, Snapshot};
use super::registry::Registry;
use super::signals;
use crate::replication::stream::{Event, Header, Kind, Layout, Place, Reader, StreamError};

/// How the private tables of receives are named (never a device's name: those do not start
/// with a dot).
const RECEIVING_PREFIX: &str = ".receive-";
/// Records written at once (they never overlap).
const APPLY_AHEAD: usize = 8;
/// Progress becomes durable at least this often (bytes applied, or time).
const CHECKPOINT_BYTES: u64 = 64 << 20;
const CHECKPOINT_EVERY: Duration = Duration::from_secs(1);
/// How often a receive logs its progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// Receives running now, by (pool, id): two into one device would share its staging device.
static RECEIVING: Mutex<BTreeSet<(String, u32)>> = Mutex::new(BTreeSet::new());

struct Busy((String, u32));

impl Busy {
    fn take(pool: &str, id: u32) -> Result<Busy, String> {
        let key = (pool.to_string(), id);
        if !RECEIVING.lock().insert(key.clone()) {
            return Err(format!(
                "a receive into thin device {id} of pool '{pool}' is running"
            ));
        }
        Ok(Busy(key))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        RECEIVING.lock().remove(&self.0);
    }
}

pub struct Request {
    pub pool: String,
    pub id: u32,
    /// The local device the stream's base is, when the caller says so (else it is found by
    /// what each device was received as).
    pub base: Option<u32>,
    /// Keep a failed receive for resuming, and continue one kept before.
    pub resume: bool,
}

/// What the sender may want to know before it starts: a receive kept for resuming (its
/// snapshot and the first record it lacks).
pub fn partial_of(registry: &Registry, req: &Request) -> Result<serde_json::Value, String> {
    let pool = replica::pool(&req.pool).map_err(|e| e.to_string())?;
    let state =
        PoolState::load(&registry.state_dir, &req.pool, &pool).map_err(|e| e.to_string())?;
    Ok(match state.partial.get(&req.id) {
        Some(p) => json!({
            "to": p.to.id, "from": p.from.as_ref().map(|f| f.id), "source": p.to.source,
            "next_record": p.next_record, "layout": p.layout,
        }),
        None => serde_json::Value::Null,
    })
}

/// Why applying a stream stopped: the stream, or this side.
#[derive(Debug, thiserror::Error)]
enum Failure {
    #[error(transparent)]
    Stream(#[from] StreamError),
    #[error("{0}")]
    Local(String),
}

impl From<std::io::Error> for Failure {
    fn from(e: std::io::Error) -> Self {
        Failure::Local(format!("replication state: {e}"))
    }
}

/// How a receive ended: applied, or refused and why.
pub type Outcome = Result<serde_json::Value, String>;

/// Applies the stream on `input` into thin device `req.id` of pool `req.pool`.
pub fn receive(registry: &Registry, req: &Request, input: &mut dyn Read) -> Outcome {
    let _busy = Busy::take(&req.pool, req.id)?;
    let pool = replica::pool(&req.pool).map_err(|e| e.to_string())?;
    identity_of(&req.pool, &pool).map_err(|e| e.to_string())?;
    settle(&registry.state_dir, &req.pool, &pool)
        .map_err(|e| format!("replication state of pool '{}': {e}", req.pool))?;
    if pool.device(req.id).is_some() {
        return Err(format!(
            "thin device {} exists in pool '{}': receive into a new id (or delete it first)",
            req.id, req.pool
        ));
    }
    let header = Header::read(input).map_err(|e| e.to_string())?;
    let mut run = Receive::start(registry, req, pool, header)?;
    let started = Instant::now();
    let result = run.apply(input);
    match result {
        Ok(()) => {
            let seconds = started.elapsed().as_secs_f64();
            info!(
                "received {} into thin device {} of pool '{}': {} records from record {}, {} bytes of data in {seconds:.1} s",
                run.to, req.id, req.pool, run.header.records, run.first, run.data_bytes
            );
            Ok(json!({
                "pool": req.pool, "id": req.id, "snapshot": run.to.id, "source": run.to.source,
                "records": run.header.records, "resumed_from": run.first,
                "data_bytes": run.data_bytes, "applied_bytes": run.applied_bytes,
                "volume_bytes": run.header.volume_bytes, "seconds": seconds,
            }))
        }
        Err(e) => Err(run.fail(e)),
    }
}

struct Receive<'a> {
    registry: &'a Registry,
    req: &'a Request,
    pool: PoolHandle,
    header: Header,
    to: Snapshot,
    partial: Partial,
    /// Shared with the thread writing a batch.
    table: Option<Arc<Table>>,
    /// The first record this stream applies (records before it were durable already).
    first: u64,
    data_bytes: u64,
    applied_bytes: u64,
}

impl<'a> Receive<'a> {
    /// Finds the base, then continues the kept receive of this very stream (with `resume`)
    /// or starts a staging device afresh.
    fn start(
        registry: &'a Registry,
        req: &'a Request,
        pool: PoolHandle,
        header: Header,
    ) -> Result<Self, String> {
        // A record covers whole blocks of the source pool. Into larger blocks that are not
        // zeroed when first written, the rest of each would read what the data device held
        // (another device's old data) where the source reads zeroes.
        let block = pool.block_bytes();
        if !pool.zeroes_new_blocks() && u64::from(header.block_bytes) % block != 0 {
            return Err(format!(
                "pool '{}' has skip_block_zeroing and blocks of {} bytes, which do not divide \
                 the stream's ({} bytes): the replica would read stale data where the source \
                 reads zeroes (receive into a pool that zeroes new blocks)",
                req.pool, block, header.block_bytes
            ));
        }
        let state_dir = &registry.state_dir;
        let io = |e: std::io::Error| format!("replication state of pool '{}': {e}", req.pool);
        let state = PoolState::load(state_dir, &req.pool, &pool).map_err(io)?;
        let to = Snapshot::to_of(&header);
        let from = Snapshot::from_of(&header);
        let base = match (&from, req.base) {
            (None, Some(base)) => {
                return Err(format!("a full stream has no base (--base {base} given)"))
            }
            (None, None) => None,
            (Some(from), Some(base)) => match state.received.get(&base) {
                Some(mark) if mark.snapshot == *from => Some(base),
                Some(mark) => {
                    return Err(format!(
                        "wrong base: the stream is incremental from {from}, and thin device {base} \
                         holds {}",
                        mark.snapshot
                    ))
                }
                None => {
                    return Err(format!(
                        "wrong base: the stream is incremental from {from}, and thin device {base} \
                         was not received as any snapshot"
                    ))
                }
            },
            (Some(from), None) => Some(state.holder_of(from).ok_or_else(|| {
                format!(
                    "wrong base: the stream is incremental from {from}, which pool '{}' does \
                     not hold (receive a full stream first)",
                    req.pool
                )
            })?),
        };
        if let (Some(from), Some(base)) = (&from, base) {
            unchanged_base(&pool, req, &state.received[&base], base, from, &header)?;
        }
        let plan = Plan::of(&header);
        let kept = state.partial.get(&req.id).cloned();
        let partial = match kept {
            Some(p) if req.resume && p.to == to && p.from == from => match &p.plan {
                Some(kept) if *kept != plan => {
                    return Err(format!(
                        "the source of {to} changed since the kept receive into thin device {} \
                         began: this stream has {plan}, the kept one {kept}; a receive without \
                         --resume starts again",
                        req.id
                    ))
                }
                _ => p,
            },
            other => {
                if let Some(old) = other {
                    drop_staging(registry, &pool, &req.pool, req.id, &old)?;
                }
                new_staging(registry, &pool, req, to.clone(), from, base, plan)?
            }
        };
        let table = match header.volume_bytes {
            0 => None,
            bytes => {
                let owner = receiving(&req.pool, req.id);
                let text = format!("0 {} thin {} {}", bytes / 512, req.pool, partial.staging);
                match registry.build(&owner, &text, false, &Arc::new(Events::default())) {
                    Ok(table) => Some(Arc::new(table)),
                    Err(e) => {
                        let mut e = e.to_string();
                        if !req.resume {
                            if let Err(left) =
                                drop_staging(registry, &pool, &req.pool, req.id, &partial)
                            {
                                e = format!("{e}; {left}");
                            }
                        }
                        return Err(e);
                    }
                }
            }
        };
        Ok(Receive {
            registry,
            req,
            pool,
            first: partial.next_record,
            header,
            to,
            partial,
            table,
            data_bytes: 0,
            applied_bytes: 0,
        })
    }

    fn apply(&mut self, input: &mut dyn Read) -> Result<(), Failure> {
        let mut reader = Reader::new(
            input,
            self.header.clone(),
            self.partial.next_record,
            Layout(self.partial.layout),
        );
        let mut in_flight = None;
        let result = self.pump(&mut reader, &mut in_flight);
        // Whatever stopped the stream, the batch being written finishes first (and counts,
        // if it was written).
        if let Some(writing) = in_flight.take() {
            let finished = self.finish_batch(writing);
            if result.is_ok() {
                finished?;
            }
        }
        result?;
        self.publish()
    }

    /// Reads the records up to the trailer, writing each batch while the next one arrives.
    fn pump(
        &mut self,
        reader: &mut Reader<&mut dyn Read>,
        in_flight: &mut Option<Writing>,
    ) -> Result<(), Failure> {
        let mut filling = Batch::default();
        let mut spare = Batch::default();
        let (mut since_bytes, mut since) = (0u64, Instant::now());
        let (started, mut told) = (Instant::now(), Instant::now());
        loop {
            let end = match reader.next_event()? {
                Event::Record {
                    kind,
                    place,
                    payload,
                } => {
                    if place.seq >= self.partial.next_record {
                        filling.add(kind, place, payload);
                        filling.layout = reader.layout();
                    }
                    false
                }
                Event::End => true,
            };
            // A batch goes when it is full, or at the trailer.
            let full = filling.records.len() == APPLY_AHEAD;
            if filling.records.is_empty() || !(full || end) {
                if end {
                    return Ok(());
                }
                continue;
            }
            if let Some(writing) = in_flight.take() {
                spare = self.finish_batch(writing)?;
                since_bytes += spare.covered();
                spare.records.clear();
            }
            *in_flight =
                Some(self.start_batch(std::mem::replace(&mut filling, std::mem::take(&mut spare))));
            if since_bytes >= CHECKPOINT_BYTES || since.elapsed() >= CHECKPOINT_EVERY {
                self.checkpoint()?;
                (since_bytes, since) = (0, Instant::now());
            }
            if told.elapsed() >= PROGRESS_EVERY {
                self.tell_progress(started);
                told = Instant::now();
            }
            if end {
                return Ok(());
            }
        }
    }

    /// Writes a batch of records (disjoint ranges, so in parallel) on a thread of its own.
    fn start_batch(&self, batch: Batch) -> Writing {
        let table = self.table.clone().expect("records lie inside the volume");
        std::thread::spawn(move || {
            let written = batch.write(&table);
            (batch, written)
        })
    }

    /// Waits for a batch; counts it as applied (the progress a checkpoint records); gives its
    /// buffers back.
    fn finish_batch(&mut self, writing: Writing) -> Result<Batch, Failure> {
        let (batch, written) = writing.join().expect("a batch writer does not panic");
        written.map_err(|e| Failure::Local(format!("writing the staging device: {e}")))?;
        let last = batch.records.last().expect("batches are not empty").1;
        self.partial.next_record = last.seq + 1;
        self.partial.layout = batch.layout.0;
        for &(kind, place) in &batch.records {
            if kind == Kind::Data {
                self.data_bytes += place.len as u64;
            }
        }
        self.applied_bytes += batch.covered();
        Ok(batch)
    }

    /// A log line with how far the receive is, its rate and ETA (the receiving side of
    /// `udm send --to` has no terminal to draw a bar on).
    fn tell_progress(&self, started: Instant) {
        let rate = self.applied_bytes as f64 / started.elapsed().as_secs_f64().max(1e-3);
        let left = self.header.changed_bytes.saturating_sub(self.applied_bytes) as f64;
        info!(
            "receiving {} into thin device {} of pool '{}': record {} of {}, {:.1} MiB/s, \
             ETA {:.0} s",
            self.to,
            self.req.id,
            self.req.pool,
            self.partial.next_record,
            self.header.records,
            rate / (1 << 20) as f64,
            if rate > 0.0 { left / rate } else { 0.0 }
        );
    }

    /// Makes the records applied so far durable, then says so.
    fn checkpoint(&mut self) -> Result<(), Failure> {
        if let Some(table) = &self.table {
            table
                .flush()
                .map_err(|e| Failure::Local(format!("flushing the staging device: {e}")))?;
        }
        let kept = self.partial.clone();
        PoolState::update(&self.registry.state_dir, &self.req.pool, &self.pool, |s| {
            drop(s.partial.insert(self.req.id, kept))
        })?;
        Ok(())
    }

    /// The trailer checked out: the staging device becomes `id`, and is marked as the
    /// snapshot received.
    fn publish(&mut self) -> Result<(), Failure> {
        // Recorded (and the records made durable) before the publish: a crash after its
        // commit leaves the record to complete at the next start (see [`PoolState::load`]).
        self.partial.publishing = Some(self.header.volume_bytes);
        self.checkpoint()?;
        self.table = None;
        if let Err(e) = self.pool.publish(self.partial.staging, self.req.id) {
            self.partial.publishing = None;
            return Err(Failure::Local(e.to_string()));
        }
        signals::crash_point("published");
        let mark = Mark {
            snapshot: self.to.clone(),
            local_time: self.pool.device(self.req.id).map_or(0, |d| d.creation_time),
            volume_bytes: self.header.volume_bytes,
            sent: Some(self.header.to_stamp),
            local: Some(stamp_of(&self.pool, self.req.id).map_err(Failure::Local)?),
        };
        PoolState::update(&self.registry.state_dir, &self.req.pool, &self.pool, |s| {
            s.partial.remove(&self.req.id);
            s.received.insert(self.req.id, mark);
        })?;
        Ok(())
    }

    /// After a failure: with `resume`, what was applied is kept (made durable); otherwise the
    /// staging device goes. The error, saying how to go on.
    fn fail(mut self, e: Failure) -> String {
        let id = self.req.id;
        if self.req.resume {
            let kept = match self.checkpoint() {
                Ok(()) => self.partial.next_record,
                Err(e) => {
                    warn!("keeping the partial receive into thin device {id}: {e}");
                    self.first
                }
            };
            return format!(
                "{e}; {kept} of {} records are kept: resume with `udm receive --resume` and a \
                 stream from record {kept} or earlier (`udm send … --resume-at {kept}`)",
                self.header.records
            );
        }
        self.table = None;
        let dropped = drop_staging(self.registry, &self.pool, &self.req.pool, id, &self.partial);
        let left = dropped
            .err()
            .map_or(String::new(), |left| format!("; {left}"));
        format!("{e}; nothing was received (thin device {id} not created){left}")
    }
}

/// Refuses an increment onto local device `base` (which holds the stream's base `from`, as
/// `mark` says) if the base is not the snapshot it was when it was sent and received: written
/// on the sender since (the increment would leave out those writes), or here (the replica
/// would hold them). A mark of a udm that recorded neither stamp is taken as it is.
fn unchanged_base(
    pool: &PoolHandle,
    req: &Request,
    mark: &Mark,
    base: u32,
    from: &Snapshot,
    header: &Header,
) -> Result<(), String> {
    if let Some(sent) = mark.sent.filter(|sent| *sent != header.from_stamp) {
        return Err(format!(
            "the stream's base, {from}, was written on the sender since it was sent (it had \
             {sent}, now {}): an increment from it would not make the snapshot; send a full \
             stream, or one from a snapshot not written since it was sent",
            header.from_stamp
        ));
    }
    let Some(local) = mark.local else {
        return Ok(());
    };
    let now = stamp_of(pool, base)?;
    if now != local {
        return Err(format!(
            "thin device {base} of pool '{}', the stream's base ({from}), was written here \
             since it was received (it had {local}, now {now}): receive a full stream instead",
            req.pool
        ));
    }
    Ok(())
}

/// The name of the private table of a receive into thin device `id` of `pool`.
fn receiving(pool: &str, id: u32) -> String {
    format!("{RECEIVING_PREFIX}{pool}-{id}")
}

/// Keeps a receive's staging device for its own table: another would write into the
/// replica under the records applied, or stop the publish.
fn keep_private(pool: &PoolHandle, pool_name: &str, id: u32, staging: u32) {
    let what = format!("the staging device of a receive into thin device {id}");
    pool.keep_private(staging, &receiving(pool_name, id), &what);
}

/// Staging devices are chosen and made one at a time (two receives would pick the same id).
static CHOOSING: Mutex<()> = Mutex::new(());

/// A new staging device for a receive, a snapshot of `base` (or empty). Recorded before it is
/// made, so that a crash in between leaves no device that nothing names.
fn new_staging(
    registry: &Registry,
    pool: &PoolHandle,
    req: &Request,
    to: Snapshot,
    from: Option<Snapshot>,
    base: Option<u32>,
    plan: Plan,
) -> Result<Partial, String> {
    let _choosing = CHOOSING.lock();
    let io = |e: std::io::Error| format!("replication state of pool '{}': {e}", req.pool);
    let mut partial = Partial {
        to,
        from,
        staging: free_id(pool, req.id)?,
        staging_time: None,
        next_record: 0,
        layout: 0,
        resume: req.resume,
        publishing: None,
        plan: Some(plan),
    };
    let record = |p: &Partial| {
        let p = p.clone();
        PoolState::update(&registry.state_dir, &req.pool, pool, |s| {
            drop(s.partial.insert(req.id, p))
        })
    };
    record(&partial).map_err(io)?;
    keep_private(pool, &req.pool, req.id, partial.staging);
    let made = match base {
        Some(base) => pool
            .create_snap(partial.staging, base)
            .map_err(|e| format!("cannot snapshot the stream's base: {e}")),
        None => pool.create_thin(partial.staging).map_err(|e| e.to_string()),
    };
    if let Err(e) = made {
        pool.end_private(partial.staging);
        let _ = PoolState::update(&registry.state_dir, &req.pool, pool, |s| {
            drop(s.partial.remove(&req.id))
        });
        return Err(e);
    }
    partial.staging_time = pool.device(partial.staging).map(|d| d.creation_time);
    if let Err(e) = record(&partial) {
        let left = drop_staging(registry, pool, &req.pool, req.id, &partial)
            .err()
            .map_or(String::new(), |left| format!("; {left}"));
        return Err(format!("{}{left}", io(e)));
    }
    Ok(partial)
}

/// Records read and waiting to be written, with their data, and the layout checksum up to
/// the last of them.
#[derive(Default)]
struct Batch {
    records: Vec<(Kind, Place)>,
    bufs: Vec<AlignedBuf>,
    layout: Layout,
}

/// A batch being written, and how that went.
type Writing = std::thread::JoinHandle<(Batch, udm_block::Result<()>)>;

impl Batch {
    fn add(&mut self, kind: Kind, place: Place, payload: &[u8]) {
        let n = self.records.len();
        if self.bufs.len() == n {
            self.bufs.push(AlignedBuf::new());
        }
        self.bufs[n].resize(payload.len());
        self.bufs[n].copy_from_slice(payload);
        self.records.push((kind, place));
    }

    fn covered(&self) -> u64 {
        self.records.iter().map(|(_, p)| p.len as u64).sum()
    }

    fn write(&self, table: &Table) -> udm_block::Result<()> {
        let write = |&(kind, place): &(Kind, Place), buf: &AlignedBuf| match kind {
            Kind::Data => table.write(
                place.offset,
                &buf[..place.len as usize],
                WriteFlags::default(),
            ),
            Kind::Zero | Kind::Unmapped => table.write_zeroes(
                place.offset,
                place.len as u64,
                ZeroFlags {
                    may_unmap: true,
                    ..ZeroFlags::default()
                },
            ),
        };
        std::thread::scope(|s| {
            let writers: Vec<_> = self
                .records
                .iter()
                .zip(&self.bufs)
                .map(|(record, buf)| s.spawn(move || write(record, buf)))
                .collect();
            writers
                .into_iter()
                .try_for_each(|w| w.join().expect("a writer does not panic"))
        })
    }
}

/// At each table of pool device `pool_name` built: its replication state is settled if this
/// is the pool's first table in this run of the daemon (see [`settle`]), and the staging
/// devices it names are kept private again, which a pool opened anew (at the daemon's start,
/// or made again) knows nothing of.
pub fn pool_built(registry: &Registry, pool_name: &str) {
    let Ok(pool) = replica::pool(pool_name) else {
        return;
    };
    let state_dir = &registry.state_dir;
    let state = settle(state_dir, pool_name, &pool)
        .and_then(|()| PoolState::load(state_dir, pool_name, &pool));
    match state {
        Ok(state) => {
            for (id, partial) in &state.partial {
                keep_private(&pool, pool_name, *id, partial.staging);
            }
        }
        Err(e) => warn!("replication state of pool '{pool_name}': {e}"),
    }
}

/// At the daemon's start, after its devices are restored (which settled their pools'
/// replication state, see [`settle`]): the receives a crash stopped that were not to be kept
/// for resuming lose their staging devices (which hold the space of what they had applied),
/// as they would have had they been refused.
pub fn recover(registry: &Registry) {
    let dir = registry.state_dir.join("replication");
    let Ok(files) = std::fs::read_dir(&dir) else {
        return;
    };
    for file in files.flatten() {
        let name = file.file_name().to_string_lossy().into_owned();
        let Some(pool_name) = name.strip_suffix(".json") else {
            continue;
        };
        let Ok(pool) = replica::pool(pool_name) else {
            continue;
        };
        let state = match PoolState::load(&registry.state_dir, pool_name, &pool) {
            Ok(state) => state,
            Err(e) => {
                warn!("replication state of pool '{pool_name}': {e}");
                continue;
            }
        };
        for (id, partial) in state.partial.iter().filter(|(_, p)| !p.resume) {
            info!(
                "dropping the receive into thin device {id} of pool '{pool_name}' that stopped \
                 with the daemon (staging thin device {}; it was not asked to be kept)",
                partial.staging
            );
            if let Err(e) = drop_staging(registry, &pool, pool_name, *id, partial) {
                warn!("pool '{pool_name}': {e}");
            }
        }
    }
}

/// Deletes a kept receive's staging device and forgets it. One that cannot be deleted (the
/// pool read-only) stays named, no longer to be kept: the next receive into `id`, or the
/// daemon's next start, deletes it, where forgetting it would leave it in the pool for ever.
fn drop_staging(
    registry: &Registry,
    pool: &PoolHandle,
    pool_name: &str,
    id: u32,
    partial: &Partial,
) -> Result<(), String> {
    let deleted = pool.delete(partial.staging);
    let result = PoolState::update(&registry.state_dir, pool_name, pool, |s| match &deleted {
        Ok(()) => drop(s.partial.remove(&id)),
        Err(_) => {
            if let Some(p) = s.partial.get_mut(&id) {
                p.resume = false;
            }
        }
    });
    if let Err(e) = result {
        warn!("replication state of pool '{pool_name}': {e}");
    }
    deleted.map_err(|e| {
        format!(
            "staging thin device {} of the receive into thin device {id} stays until the next \
             receive into it or the daemon's next start: {e}",
            partial.staging
        )
    })
}

/// The highest free device id but `target`: staging devices stay out of the way of ids users
/// pick, and the staging device cannot take the id it is to be published as.
fn free_id(pool: &PoolHandle, target: u32) -> Result<u32, String> {
    let used: BTreeSet<u32> = pool.devices().iter().map(|d| d.id).collect();
    (0..=MAX_DEV_ID)
        .rev()
        .find(|id| *id != target && !used.contains(id))
        .ok_or_else(|| "the pool has no free device id".to_string())
}
