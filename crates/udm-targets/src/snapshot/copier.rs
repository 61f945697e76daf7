//! The copy-out of a mapped origin write, as the kernel's kcopyd does it: asynchronous steps,
//! no thread held per copy. For each snapshot that lacks a chunk of the write:
//!
//! 1. hold the chunk (queued behind its holder, without a thread, when it is busy),
//! 2. read the origin chunk (once for every snapshot with the same chunk size),
//! 3. write it into a new COW chunk (FUA when persistent),
//! 4. submit the snapshot's records and, once their commit is durable, make them visible and
//!    let the chunks go.
//!
//! The write waits for the last commit ([`Done`]). Reads and writes run on the io_uring
//! runner ([`udm_uring::Runner`]) when the device maps them (files, and `delay`, `linear`
//! and the like over them; a `delay` waits on its timer); a device that does not map is read
//! or written synchronously on a pool thread (`snapshot-copy`), as is everything when io_uring
//! is unavailable. Failures drop the snapshot (invalid), never the origin write, as the
//! synchronous copy-out ([`super::hub::Hub::copy_out`]) does.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use log::warn;
use parking_lot::Mutex;
use udm_block::{AlignedBuf, BlockDevice, BlockError, Done, MapOp, WorkerPool, WriteFlags};
use udm_metadata::snapshot::Record;
use udm_uring::{Outcome, Runner};

use super::chunk_locks::ChunkGuard;
use super::cow::Snap;
use super::stages::Marks;

/// Threads for copies through devices that do not map, each held for one read or write; and
/// the kernel's workers for the runner's FUA writes to COW files (each waits for the disk),
/// so that as many copies write at once either way.
const COPY_THREADS: usize = 64;

fn pool() -> &'static Arc<WorkerPool> {
    static POOL: OnceLock<Arc<WorkerPool>> = OnceLock::new();
    POOL.get_or_init(|| WorkerPool::new("snapshot-copy", COPY_THREADS))
}

fn runner() -> Option<&'static Runner> {
    static RUNNER: OnceLock<Option<Runner>> = OnceLock::new();
    RUNNER
        .get_or_init(
            || match Runner::start("snapshot-kcopyd", COPY_THREADS as u32) {
                Ok(runner) => Some(runner),
                Err(e) => {
                    warn!("snapshot: copy-outs run on threads (no io_uring: {e})");
                    None
                }
            },
        )
        .as_ref()
}

/// Reads (`write` None) `buf.len()` bytes of `dev` at `offset` into `buf`, or writes them from
/// it; `then` gets the result and the buffer back. On the runner when `dev` maps the request,
/// else on a pool thread.
pub fn io(
    dev: Arc<dyn BlockDevice>,
    write: Option<WriteFlags>,
    offset: u64,
    buf: AlignedBuf,
    then: impl FnOnce(Result<(), BlockError>, AlignedBuf) + Send + 'static,
) {
    let op = match write {
        None => MapOp::Read,
        Some(flags) => MapOp::Write { fua: flags.fua },
    };
    let runner = runner();
    let mapping = runner.and(dev.map(op, offset, buf.len() as u64));
    let (Some(runner), Some(mapping)) = (runner, mapping) else {
        return pool().submit(Box::new(move || sync_io(&*dev, write, offset, buf, then)));
    };
    runner.run(
        op,
        mapping,
        buf,
        Box::new(move |outcome, buf| match outcome {
            Outcome::Done(result) => then(result, buf),
            // The mapping asked to be retried the synchronous way (a multipath path failed).
            Outcome::Retry => {
                pool().submit(Box::new(move || sync_io(&*dev, write, offset, buf, then)))
            }
        }),
    )
}

fn sync_io(
    dev: &dyn BlockDevice,
    write: Option<WriteFlags>,
    offset: u64,
    mut buf: AlignedBuf,
    then: impl FnOnce(Result<(), BlockError>, AlignedBuf),
) {
    let result = match write {
        None => dev.read(offset, &mut buf),
        Some(flags) => dev.write(offset, &buf, flags),
    };
    then(result, buf)
}

/// Saves every chunk of `[offset, offset + len)` of `origin` that one of `snaps` (in their
/// lock order) lacks, and finishes `done` once every commit is durable.
pub fn copy_out(
    snaps: Vec<Arc<Snap>>,
    origin: Arc<dyn BlockDevice>,
    offset: u64,
    len: u64,
    done: Done,
) {
    let wanted = snaps
        .iter()
        .flat_map(|snap| snap.chunks(offset, len).map(move |c| (snap.clone(), c)))
        .collect::<Vec<_>>()
        .into_iter();
    Locking {
        wanted,
        held: Vec::new(),
        origin,
        done,
        began: Instant::now(),
    }
    .next();
}

/// Step 1: taking the chunks one after the other, in the order every origin write takes them.
struct Locking {
    wanted: std::vec::IntoIter<(Arc<Snap>, u64)>,
    held: Vec<(Arc<Snap>, u64, ChunkGuard)>,
    origin: Arc<dyn BlockDevice>,
    done: Done,
    began: Instant,
}

impl Locking {
    fn next(mut self) {
        while let Some((snap, chunk)) = self.wanted.next() {
            if snap.exceptions.get(chunk).is_some() || !snap.is_valid() {
                continue;
            }
            match snap.locks.try_exclusive(chunk) {
                Some(guard) => self.keep(snap, chunk, guard),
                None => {
                    let locks = snap.locks.clone();
                    // Queued: the holder's release goes on from here.
                    return locks.exclusive_then(
                        chunk,
                        Box::new(move |guard| {
                            self.keep(snap, chunk, guard);
                            self.next()
                        }),
                    );
                }
            }
        }
        self.copy();
    }

    fn keep(&mut self, snap: Arc<Snap>, chunk: u64, guard: ChunkGuard) {
        // Saved by the write that held it before us.
        if snap.exceptions.get(chunk).is_none() {
            self.held.push((snap, chunk, guard));
        }
    }

    /// Steps 2 to 4 for every chunk held.
    fn copy(self) {
        let Locking {
            held,
            origin,
            done,
            began,
            ..
        } = self;
        let marks = (began, Instant::now());
        if held.is_empty() {
            return done.finish(Ok(()));
        }
        let size = origin.size();
        let write = Arc::new(Write {
            left: AtomicUsize::new(0),
            done: Mutex::new(Some(done)),
        });
        // Per snapshot, its chunks; per origin range, the chunks that need it.
        let mut saves: Vec<Arc<Save>> = Vec::new();
        let mut reads: BTreeMap<(u64, u64), Vec<Wanting>> = BTreeMap::new();
        for (snap, chunk, guard) in held {
            let range = snap.chunk_range(chunk, size);
            let save = match saves.last() {
                Some(save) if Arc::ptr_eq(&save.snap, &snap) => save.clone(),
                _ => {
                    write.left.fetch_add(1, Ordering::Relaxed);
                    let save = Arc::new(Save {
                        snap,
                        marks,
                        write: write.clone(),
                        left: AtomicUsize::new(0),
                        saved: Mutex::default(),
                    });
                    saves.push(save.clone());
                    save
                }
            };
            save.left.fetch_add(1, Ordering::Relaxed);
            save.saved.lock().guards.push(guard);
            reads.entry(range).or_default().push((save, chunk));
        }
        for ((start, end), chunks) in reads {
            let buf = AlignedBuf::zeroed((end - start) as usize);
            io(origin.clone(), None, start, buf, move |result, data| {
                for (save, chunk) in chunks {
                    save.saved.lock().read = Some(Instant::now());
                    match &result {
                        Ok(()) => save.clone().save(chunk, &data),
                        Err(e) => save
                            .clone()
                            .failed(format!("saving origin chunk {chunk}: {e}")),
                    }
                }
            });
        }
    }
}

/// A snapshot's part of a copy-out and the chunk of it that an origin read is for.
type Wanting = (Arc<Save>, u64);

/// The origin write waiting for its copy-out: how many snapshots' commits are left.
struct Write {
    left: AtomicUsize,
    done: Mutex<Option<Done>>,
}

impl Write {
    fn one_done(&self) {
        if self.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            if let Some(done) = self.done.lock().take() {
                done.finish(Ok(()));
            }
        }
    }
}

/// One snapshot's part of a copy-out: its chunks held, their COW writes, then its commit.
struct Save {
    snap: Arc<Snap>,
    /// When the copy-out began and when it held its chunks.
    marks: (Instant, Instant),
    write: Arc<Write>,
    /// COW writes not finished yet.
    left: AtomicUsize,
    saved: Mutex<Saved>,
}

#[derive(Default)]
struct Saved {
    records: Vec<Record>,
    guards: Vec<ChunkGuard>,
    failed: bool,
    /// When the last origin read for it was done.
    read: Option<Instant>,
}

impl Save {
    /// Step 3: `data` (origin chunk `chunk`) into a new COW chunk.
    fn save(self: Arc<Self>, chunk: u64, data: &[u8]) {
        let snap = &self.snap;
        let new = match snap.store.allocate() {
            Ok(new) => new,
            Err(e) => return self.failed(format!("saving origin chunk {chunk}: {e}")),
        };
        let mut buf = AlignedBuf::zeroed(data.len());
        buf.copy_from_slice(data);
        let flags = WriteFlags {
            fua: snap.persistent,
        };
        let at = new * snap.chunk;
        io(
            snap.cow.clone(),
            Some(flags),
            at,
            buf,
            move |result, _| match result {
                Ok(()) => {
                    self.saved.lock().records.push(Record { old: chunk, new });
                    self.written();
                }
                Err(e) => self.failed(format!("saving origin chunk {chunk}: {e}")),
            },
        );
    }

    /// Drops the snapshot, on a pool thread: marking the COW device invalid is a write that
    /// waits, and this may run on the runner's thread, which must never wait.
    fn failed(self: Arc<Self>, why: String) {
        pool().submit(Box::new(move || {
            self.snap.invalidate(&why);
            self.saved.lock().failed = true;
            self.written();
        }))
    }

    /// Step 4, once every COW write of this snapshot is over.
    fn written(&self) {
        if self.left.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let Saved {
            records,
            guards,
            failed,
            read,
        } = std::mem::take(&mut *self.saved.lock());
        let written = Instant::now();
        if failed || records.is_empty() {
            drop(guards);
            return self.write.one_done();
        }
        let (snap, write) = (self.snap.clone(), self.write.clone());
        let ((began, held), read) = (self.marks, read.unwrap_or(written));
        let ticket = match self.snap.store.submit(&records) {
            Ok(ticket) => ticket,
            // Off this thread, as in `failed`.
            Err(e) => {
                return pool().submit(Box::new(move || {
                    snap.invalidate(&format!("committing exceptions: {e}"));
                    drop(guards);
                    write.one_done()
                }))
            }
        };
        self.snap.store.when_durable(
            ticket,
            Box::new(move |result| {
                let durable = Instant::now();
                snap.stages.add(&Marks {
                    began,
                    held,
                    read,
                    written,
                    durable,
                });
                snap.committed(&records, result);
                drop(guards);
                write.one_done()
            }),
        );
    }
}
