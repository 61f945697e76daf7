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

mod batches;

use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use udm_block::{
    BlockDevice, BlockError, Capabilities, MapOp, Mapping, OpenMode, Result, WriteFlags,
};

use super::cow::Snap;
use super::hub::RoleGuard;
use super::{details, each_chunk, parse, status_line, Persistence, SnapshotArgs};
use crate::args::Args;
use crate::pacing::{RateLimit, Throughput, UserActivity};
use crate::target::{EventSink, Target, TargetContext, TargetError};

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
    /// The end of the merge was logged and its event raised.
    announced: AtomicBool,
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
    role: RoleGuard,
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
        announced: AtomicBool::new(false),
        total_chunks: AtomicU64::new(0),
        activity: Arc::default(),
        progress: Throughput::default(),
        raise_event: ctx.raise_event.clone(),
    });
    Ok(Arc::new(Merge {
        inner,
        worker: Mutex::new(None),
        role,
    }))
}

impl Inner {
    fn snap(&self) -> &Snap {
        self.args.snap()
    }

    /// Whether the merge is done: the store on the COW device holds no record any more. The
    /// one measure behind the status line (whose allocated sectors fall to the metadata's
    /// at that commit, what lvm polls for), the progress and `udm finalize`: a flag set by
    /// the worker's next round came up to a second later, refusing the finalize the status
    /// had announced.
    fn is_complete(&self) -> bool {
        !self.failed.load(Ordering::Acquire)
            && self
                .snap()
                .store
                .merge_batch(1)
                .is_ok_and(|left| left.is_empty())
    }

    fn merged_bytes(&self) -> u64 {
        let left = self.snap().exceptions.len();
        self.total_chunks
            .load(Ordering::Acquire)
            .saturating_sub(left)
            * self.snap().chunk
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

impl BlockDevice for Merge {
    fn size(&self) -> u64 {
        self.inner.len
    }

    fn capabilities(&self) -> Capabilities {
        let s = &self.inner;
        Capabilities {
            discard: false,
            fast_zero: false,
            ..Capabilities::weakest([s.args.origin.capabilities(), s.snap().cow.capabilities()])
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
                    // A write finds no exception here only when its chunk was merged since
                    // it was counted; straight to the origin without the hub's gate or a
                    // copy-out, which is safe: the batch that merged it landed its copy
                    // first and saved the chunk into every snapshot taking copy-outs, and no
                    // snapshot becomes active while a merge runs (refused when built and
                    // when first resumed), the one thing the gate holds writes off for.
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
            s.is_complete(),
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
        Some(if s.is_complete() {
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

    fn renamed(&self, new: &str) {
        self.role.rename(new);
    }

    /// The kernel's refusal (snapshot_preresume): the COW device is taken over from the
    /// snapshot device only once it is suspended, its I/O drained, as the documented
    /// procedure does. The snapshot's table in this very device is suspended by the resume.
    fn preresume(&self) -> Result<(), TargetError> {
        let snap = self.inner.snap();
        if snap.is_merging() {
            return Ok(());
        }
        snap.check_handover(&self.role.owner(), "snapshot-merge")
            .map_err(TargetError::new)
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
