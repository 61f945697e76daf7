//! The background job of `snapshot-merge` ([`super`]): batch after batch from the end of the
//! exception table, each held, saved into the other snapshots, copied back onto the origin,
//! flushed and dropped from the table, paced by `max_merge_rate` and by the user's I/O.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use log::{error, info};
use udm_block::{AlignedBuf, BlockDevice, WriteFlags};
use udm_metadata::snapshot::Record;

use super::super::chunk_locks::ChunkGuard;
use super::super::copier;
use super::super::cow::Snap;
use super::Inner;

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

impl Inner {
    /// The job, until the table goes: a batch whenever the merge is resumed and not done.
    pub(super) fn run(&self) {
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
                        || self.announced.load(Ordering::Acquire);
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
                // Announced by the batch that left nothing, not by a next round after its
                // pause: the status says merged from that commit on.
                Ok(_) if self.is_complete() => {
                    self.announced.store(true, Ordering::Release);
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
