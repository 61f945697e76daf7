//! `snapshot-merge <origin> <COW device> <P|PO> <chunk size>`: rolls the origin back to a
//! snapshot while it is in use. The target takes the place of `snapshot-origin` and serves the
//! origin as it will be once merged: chunks the snapshot still holds are read and written on
//! the COW device, the rest on the origin (saved first into any other snapshot of it). In the
//! background, batches of chunks are copied from the end of the exception table back into the
//! origin: hold the chunks, save them into the other snapshots, copy (64 at once, through the
//! copier: on its io_uring ring when the devices map), flush the
//! origin, then drop their records from the table's tail, as the kernel's merge but with up to
//! 8 MiB of chunks per commit where the kernel merges one run of consecutive chunks. A restart resumes from what is left on the COW device; an event is raised when the
//! merge is done (udm adds: the kernel raises none) and when it fails.
//!
//! udm adds the message `max_merge_rate <KiB/s>` (0 = no cap), and the merge yields to user
//! I/O as a clone's hydration does.

use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{error, info};
use udm_block::{
    AlignedBuf, BlockDevice, BlockError, Capabilities, MapOp, Mapping, OpenMode, Result, WriteFlags,
};
use udm_metadata::snapshot::Record;

use super::chunk_locks::ChunkGuard;
use super::copier;
use super::cow::Snap;
use super::hub::RoleGuard;
use super::{details, each_chunk, parse, status_line, Persistence, SnapshotArgs};
use crate::args::Args;
use crate::pacing::{RateLimit, Throughput, UserActivity};
use crate::target::{EventSink, Target, TargetContext, TargetError};

/// Most bytes merged per metadata commit (each costs a flush of the origin and an area
/// write or a few).
const BATCH_BYTES: u64 = 8 << 20;
/// While the user has I/O going: smaller batches, each followed by a pause of eight times
/// its length, at most `MAX_YIELD` (see `pacing`). A batch's flushes hold up the user's
/// I/O more than its copies do, so these are not tiny, and the pauses long.
const BUSY_BATCH_BYTES: u64 = 1 << 20;
const MAX_YIELD: Duration = Duration::from_millis(500);
/// Copies of one batch's runs in flight at once (one while the user is busy).
const COPIES: usize = 64;

struct Control {
    paused: bool,
    shutdown: bool,
    in_batch: bool,
    /// `max_merge_rate`, KiB/s (0: none).
    rate_kib: u64,
    limit: RateLimit,
}

struct Inner {
    args: SnapshotArgs,
    len: u64,
    control: Mutex<Control>,
    wake: Condvar,
    failed: AtomicBool,
    complete: AtomicBool,
    /// Chunks the snapshot held when the merge became active (after a restart: what was
    /// left), the 100 % of the progress bar.
    total_chunks: AtomicU64,
    activity: Arc<UserActivity>,
    progress: Throughput,
    raise_event: EventSink,
}

pub struct Merge {
    inner: Arc<Inner>,
    /// The background merge, from the first resume on.
    worker: Mutex<Option<JoinHandle<()>>>,
    _role: RoleGuard,
}

pub fn construct(args: &mut Args, ctx: &TargetContext) -> Result<Arc<dyn Target>, TargetError> {
    let parsed = parse(args, ctx, OpenMode::ReadWrite, OpenMode::Handover)?;
    if parsed.persistence == Persistence::Transient {
        return Err(args.error(
            "a transient (N) snapshot cannot be merged: its exceptions are only in memory",
        ));
    }
    if !parsed.snap().is_valid() {
        return Err(args.error(format!(
            "COW device '{}' is marked invalid (it filled up or failed): there is nothing \
             trustworthy to merge",
            parsed.cow_ref
        )));
    }
    let role = parsed
        .handle
        .hub
        .serve_merge(ctx.owner, &parsed.snap().cow_key)
        .map_err(|e| args.error(e))?;
    let inner = Arc::new(Inner {
        args: parsed,
        len: ctx.len,
        control: Mutex::new(Control {
            // Nothing runs until the table is resumed.
            paused: true,
            shutdown: false,
            in_batch: false,
            rate_kib: 0,
            limit: RateLimit::default(),
        }),
        wake: Condvar::new(),
        failed: AtomicBool::new(false),
        complete: AtomicBool::new(false),
        total_chunks: AtomicU64::new(0),
        activity: Arc::default(),
        progress: Throughput::default(),
        raise_event: ctx.raise_event.clone(),
    });
    Ok(Arc::new(Merge {
        inner,
        worker: Mutex::new(None),
        _role: role,
    }))
}

impl Inner {
    fn snap(&self) -> &Snap {
        self.args.snap()
    }

    fn merged_bytes(&self) -> u64 {
        let left = self.snap().exceptions.len();
        self.total_chunks
            .load(Ordering::Acquire)
            .saturating_sub(left)
            * self.snap().chunk
    }

    fn run(&self) {
        let mut last_sample = Instant::now();
        loop {
            let batch_bytes = {
                let mut control = self.control.lock();
                loop {
                    if control.shutdown {
                        return;
                    }
                    let idle = control.paused
                        || self.failed.load(Ordering::Acquire)
                        || self.complete.load(Ordering::Acquire);
                    let wait = if idle {
                        Some(Duration::from_secs(1))
                    } else {
                        control.limit.wait(control.rate_kib)
                    };
                    match wait {
                        Some(wait) => {
                            self.wake.wait_for(&mut control, wait);
                        }
                        None => break,
                    }
                }
                control.in_batch = true;
                // Under a cap, a quarter of a second's worth at a time, so that the cap is
                // kept smoothly (and from the first batch after a restart).
                let most = match control.rate_kib {
                    0 => BATCH_BYTES,
                    kib => (kib * 1024 / 4).min(BATCH_BYTES),
                };
                if self.activity.busy() {
                    most.min(BUSY_BATCH_BYTES)
                } else {
                    most
                }
            };
            let started = Instant::now();
            let result = self.merge_batch(batch_bytes);
            let mut control = self.control.lock();
            control.in_batch = false;
            self.wake.notify_all();
            if last_sample.elapsed() >= Duration::from_secs(1) {
                self.progress.sample(self.merged_bytes());
                last_sample = Instant::now();
            }
            match result {
                Ok(0) => {
                    self.complete.store(true, Ordering::Release);
                    info!(
                        "snapshot-merge: '{}' is merged into '{}'",
                        self.args.cow_ref, self.args.origin_ref
                    );
                    (self.raise_event)();
                }
                Ok(chunks) => {
                    let kib = control.rate_kib;
                    control
                        .limit
                        .reserve(kib, chunks as u64 * self.snap().chunk);
                    let pause = self.activity.pause_after(started.elapsed(), MAX_YIELD);
                    if !pause.is_zero() {
                        self.wake
                            .wait_while_for(&mut control, |c| !c.paused && !c.shutdown, pause);
                    }
                }
                Err(e) => {
                    error!(
                        "snapshot-merge: merging '{}' into '{}' failed: {e}; the merge stops \
                         (status: Merge failed), the device keeps serving",
                        self.args.cow_ref, self.args.origin_ref
                    );
                    self.failed.store(true, Ordering::Release);
                    (self.raise_event)();
                }
            }
        }
    }

    /// Merges the next batch (at most `bytes`) from the end of the table; the number of
    /// chunks, 0 when there is nothing left.
    fn merge_batch(&self, bytes: u64) -> std::result::Result<usize, String> {
        let snap = self.snap();
        let origin = &*self.args.origin;
        let max = (bytes / snap.chunk).max(1) as usize;
        let mut records = snap.store.merge_batch(max).map_err(|e| e.to_string())?;
        if records.is_empty() {
            return Ok(0);
        }
        let count = records.len();
        records.sort_by_key(|r| r.old);
        // Writes into these chunks (on the COW device) wait until they are back on the
        // origin, and no origin write may reach them before.
        let _held: Vec<ChunkGuard> = records
            .iter()
            .map(|r| snap.locks.exclusive(r.old))
            .collect();
        let _writing = self.args.handle.hub.begin_write();
        let runs = runs(&records);
        let size = origin.size();
        let ranges: Vec<(u64, u64)> = runs
            .iter()
            .map(|run| run_bytes(snap, run, size))
            .filter(|(_, len)| *len > 0)
            .collect();
        self.args.handle.hub.copy_out_ranges(origin, &ranges);
        self.copy_runs(&runs)?;
        origin
            .flush()
            .map_err(|e| format!("flushing the origin: {e}"))?;
        snap.store.commit_merge(count).map_err(|e| e.to_string())?;
        for record in &records {
            snap.exceptions.remove(record.old);
        }
        Ok(count)
    }

    /// Copies each run from the COW device to the origin, a few runs at a time, through the
    /// copier ([`copier::io`]: on its ring when the devices map, else on its threads); this
    /// thread only waits for them.
    fn copy_runs(&self, runs: &[&[Record]]) -> std::result::Result<(), String> {
        let snap = self.snap();
        let size = self.args.origin.size();
        let mut copies = runs.iter().filter_map(|run| {
            let (at, len) = run_bytes(snap, run, size);
            (len > 0).then_some((run[0], at, len))
        });
        // While the user has I/O going, one copy at a time: the merge's share is its pauses'
        // to decide, not a burst of parallel copies in front of the user's requests.
        let window = if self.activity.busy() { 1 } else { COPIES };
        let (tx, rx) = std::sync::mpsc::channel();
        let (mut in_flight, mut failed) = (0, None);
        loop {
            while in_flight < window && failed.is_none() {
                let Some((record, at, len)) = copies.next() else {
                    break;
                };
                in_flight += 1;
                let (told, origin) = (Told(Some(tx.clone())), self.args.origin.clone());
                let buf = AlignedBuf::zeroed(len as usize);
                let from = record.new * snap.chunk;
                copier::io(snap.cow.clone(), None, from, buf, move |read, buf| {
                    if let Err(e) = read {
                        return told.tell(Err(format!("reading COW chunk {}: {e}", record.new)));
                    }
                    let flags = Some(WriteFlags::default());
                    copier::io(origin, flags, at, buf, move |written, _| {
                        let why = |e| format!("writing origin chunk {}: {e}", record.old);
                        told.tell(written.map_err(why))
                    });
                });
            }
            if in_flight == 0 {
                return failed.map_or(Ok(()), Err);
            }
            let copied = rx.recv().expect("this function holds a sender");
            in_flight -= 1;
            if let Err(e) = copied {
                failed.get_or_insert(e);
            }
        }
    }

    fn pause(&self, paused: bool) {
        let mut control = self.control.lock();
        control.paused = paused;
        self.wake.notify_all();
        while paused && control.in_batch {
            self.wake.wait(&mut control);
        }
    }

    /// Writes through the merging origin: into the snapshot's chunk on the COW device while
    /// it still has one (held shared, so the merge of that chunk waits), else onto the origin
    /// after saving into the other snapshots.
    fn write_through(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> Result<()> {
        let snap = self.snap();
        let hub = &self.args.handle.hub;
        let origin = &*self.args.origin;
        let mut origin_run: Option<(u64, std::ops::Range<usize>)> = None;
        let write_origin = |at: u64, range: std::ops::Range<usize>| {
            let _writing = hub.begin_write();
            hub.copy_out(origin, at, range.len() as u64);
            origin.write(at, &buf[range], flags)
        };
        each_chunk(
            snap.chunk,
            offset,
            buf.len() as u64,
            |chunk, at, _, range| {
                if snap.exceptions.get(chunk).is_some() {
                    let _held = snap.locks.shared(chunk);
                    if let Some(new) = snap.exceptions.get(chunk) {
                        if let Some((start, run)) = origin_run.take() {
                            write_origin(start, run)?;
                        }
                        return snap.cow.write(snap.cow_offset(new, at), &buf[range], flags);
                    }
                }
                // Consecutive chunks on the origin go down as one write.
                origin_run = Some(match origin_run.take() {
                    Some((start, run)) => (start, run.start..range.end),
                    None => (at, range),
                });
                Ok(())
            },
        )?;
        match origin_run {
            Some((start, run)) => write_origin(start, run),
            None => Ok(()),
        }
    }
}

/// How one copy of a merge went, told once: dropped untold (a callback that panicked), it
/// says the copy failed rather than leave the merge waiting for ever.
struct Told(Option<std::sync::mpsc::Sender<std::result::Result<(), String>>>);

impl Told {
    fn tell(mut self, result: std::result::Result<(), String>) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(result);
        }
    }
}

impl Drop for Told {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(Err("a merge copy was abandoned".into()));
        }
    }
}

/// Splits records sorted by origin chunk into runs consecutive on both devices.
fn runs(records: &[Record]) -> Vec<&[Record]> {
    let mut runs = Vec::new();
    let mut start = 0;
    for i in 1..=records.len() {
        let joined = i < records.len()
            && records[i].old == records[i - 1].old + 1
            && records[i].new == records[i - 1].new + 1;
        if !joined {
            runs.push(&records[start..i]);
            start = i;
        }
    }
    runs
}

/// The origin bytes a run covers, cut at the origin's end.
fn run_bytes(snap: &Snap, run: &[Record], origin_size: u64) -> (u64, u64) {
    let start = (run[0].old * snap.chunk).min(origin_size);
    let end = ((run[run.len() - 1].old + 1) * snap.chunk).min(origin_size);
    (start, end - start)
}

impl BlockDevice for Merge {
    fn size(&self) -> u64 {
        self.inner.len
    }

    fn capabilities(&self) -> Capabilities {
        let s = &self.inner;
        Capabilities {
            discard: false,
            fast_zero: false,
            ..Capabilities::weakest([&s.args.origin.capabilities(), &s.snap().cow.capabilities()])
        }
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let s = &self.inner;
        let _io = s.activity.begin();
        let snap = s.snap();
        each_chunk(
            snap.chunk,
            offset,
            buf.len() as u64,
            |chunk, at, _, range| match snap.exceptions.get(chunk) {
                Some(new) => snap.cow.read(snap.cow_offset(new, at), &mut buf[range]),
                None => s.args.origin.read(at, &mut buf[range]),
            },
        )
    }

    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> Result<()> {
        let _io = self.inner.activity.begin();
        self.inner.write_through(offset, buf, flags)
    }

    /// Writes land on both devices.
    fn flush(&self) -> Result<()> {
        let s = &self.inner;
        let _io = s.activity.begin();
        s.snap().cow.flush()?;
        s.args.origin.flush()
    }

    fn map(&self, op: MapOp, offset: u64, len: u64) -> Option<Mapping> {
        // Discards and write-zeroes mean something of their own here: the synchronous way.
        if op.is_fill() {
            return None;
        }
        let s = &self.inner;
        let snap = s.snap();
        if op == MapOp::Flush {
            let mut mapping = snap.cow.map(op, 0, 0)?;
            mapping.append(0, s.args.origin.map(op, 0, 0)?);
            return Some(mapping.hold(s.activity.begin_mapped()));
        }
        let chunks = snap.chunks(offset, len);
        let saved = chunks
            .clone()
            .filter(|&c| snap.exceptions.get(c).is_some())
            .count();
        let mut mapping = Mapping::new();
        if op.is_write() && saved == 0 {
            // Wholly on the origin: straight there if the other snapshots have it saved.
            let writing = s.args.handle.hub.try_begin_write()?;
            if !s.args.handle.hub.all_saved(offset, len) {
                return None;
            }
            mapping = s.args.origin.map(op, offset, len)?.hold(writing);
        } else if op.is_write() && (saved as u64) < chunks.end - chunks.start {
            return None;
        } else {
            each_chunk(snap.chunk, offset, len, |chunk, at, n, range| {
                let none = || BlockError::Io(String::new());
                let lower = match snap.exceptions.get(chunk) {
                    Some(_) if op.is_write() => {
                        let held = snap.locks.try_shared(chunk).ok_or_else(none)?;
                        // Merged while we took hold of it: the origin path decides.
                        let new = snap.exceptions.get(chunk).ok_or_else(none)?;
                        snap.cow
                            .map(op, snap.cow_offset(new, at), n)
                            .map(|m| m.hold(held))
                    }
                    Some(new) => snap.cow.map(op, snap.cow_offset(new, at), n),
                    None => s.args.origin.map(op, at, n),
                };
                mapping.append(range.start as u64, lower.ok_or_else(none)?);
                Ok(())
            })
            .ok()?;
        }
        Some(mapping.hold(s.activity.begin_mapped()))
    }
}

impl Target for Merge {
    fn type_name(&self) -> &'static str {
        "snapshot-merge"
    }

    fn args(&self) -> String {
        self.inner.args.line()
    }

    fn status(&self) -> String {
        status_line(self.inner.snap(), self.inner.failed.load(Ordering::Acquire))
    }

    fn status_details(&self) -> Option<serde_json::Value> {
        let s = &self.inner;
        let mut json = details(s.snap());
        let total = s.total_chunks.load(Ordering::Acquire) * s.snap().chunk;
        let done = s.merged_bytes();
        json["merge_failed"] = s.failed.load(Ordering::Acquire).into();
        json["progress"] = crate::pacing::progress_json(
            "merge",
            done,
            total,
            &s.progress,
            s.complete.load(Ordering::Acquire),
            s.failed
                .load(Ordering::Acquire)
                .then_some("the merge failed (see the daemon's log)"),
        );
        Some(json)
    }

    fn message(&self, words: &[&str]) -> Result<String, TargetError> {
        match words {
            [word, rate] if word.eq_ignore_ascii_case("max_merge_rate") => {
                let rate = rate.parse().map_err(|_| {
                    TargetError::new(format!(
                        "snapshot-merge: invalid value '{rate}' for max_merge_rate (KiB/s)"
                    ))
                })?;
                let mut control = self.inner.control.lock();
                control.rate_kib = rate;
                control.limit.reset();
                drop(control);
                self.inner.wake.notify_all();
                Ok(String::new())
            }
            _ => Err(TargetError::new(format!(
                "snapshot-merge: unsupported message '{}' (known: max_merge_rate <KiB/s>)",
                words.join(" ")
            ))),
        }
    }

    fn settings_messages(&self) -> Vec<String> {
        vec![format!(
            "max_merge_rate {}",
            self.inner.control.lock().rate_kib
        )]
    }

    fn references(&self) -> Vec<String> {
        vec![
            self.inner.args.origin_ref.clone(),
            self.inner.args.cow_ref.clone(),
        ]
    }

    /// Once merged, the device can become `snapshot-origin` again (`udm finalize`), which
    /// lets the COW device go.
    fn replacement(&self) -> Option<Result<String, TargetError>> {
        let s = &self.inner;
        Some(if s.complete.load(Ordering::Acquire) {
            Ok(format!("snapshot-origin {}", s.args.origin_ref))
        } else {
            Err(TargetError::new(format!(
                "snapshot-merge: the merge is not complete ({} chunks left)",
                s.snap().exceptions.len()
            )))
        })
    }

    fn suspend(&self) {
        self.inner.pause(true);
    }

    /// The first resume hands the snapshot over to the merge: origin writes stop saving
    /// chunks into it, and the worker starts (an inactive table has none).
    fn resume(&self) {
        let s = &self.inner;
        let handle = &s.args.handle;
        let mut worker = self.worker.lock();
        if worker.is_none() {
            let inner = s.clone();
            *worker = Some(
                std::thread::Builder::new()
                    .name("snapshot-merge".into())
                    .spawn(move || inner.run())
                    .expect("spawn merge worker"),
            );
        }
        drop(worker);
        if !handle.snap.is_merging() {
            handle.hub.activate(&handle.snap, || {
                handle.snap.set_merging();
                handle.snap.set_active();
            });
        }
        if s.total_chunks.load(Ordering::Acquire) == 0 {
            s.total_chunks
                .store(handle.snap.exceptions.len(), Ordering::Release);
            s.progress.sample(0);
        }
        s.pause(false);
    }
}

impl Drop for Merge {
    fn drop(&mut self) {
        self.inner.control.lock().shutdown = true;
        self.inner.wake.notify_all();
        if let Some(worker) = self.worker.lock().take() {
            let _ = worker.join();
        }
    }
}
