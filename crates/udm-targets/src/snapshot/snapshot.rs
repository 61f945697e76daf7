//! `snapshot <origin> <COW device> <P|PO|N> <chunk size>`: the origin as it was when the
//! snapshot became active (its first resume). Reads of chunks with an exception come from the
//! COW device, the rest from the origin (holding the chunk shared, so that an origin write
//! saving it waits for the read). Writes go to the COW device: into the chunk's exception, or
//! a new one, which copies the origin chunk first unless the write covers all of it.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use udm_block::{
    AlignedBuf, BlockDevice, BlockError, Capabilities, MapOp, Mapping, OpenMode, Result, WriteFlags,
};
use udm_metadata::snapshot::StoreError;

use super::cow::Snap;
use super::{details, each_chunk, invalid, parse, status_line, Persistence, SnapshotArgs};
use crate::args::Args;
use crate::target::{Target, TargetContext, TargetError};

thread_local! {
    /// A chunk being assembled from the origin and a partial write.
    static CHUNK: std::cell::RefCell<AlignedBuf> = std::cell::RefCell::new(AlignedBuf::new());
}

/// Numbers tables, so that the COW device knows which of its tables serve I/O.
static NEXT_TABLE: AtomicU64 = AtomicU64::new(0);

pub struct Snapshot {
    args: SnapshotArgs,
    len: u64,
    /// This table, among the tables on the COW device.
    table: u64,
    /// The device whose table this is, as it is called now.
    owner: Mutex<String>,
}

pub fn construct(args: &mut Args, ctx: &TargetContext) -> Result<Arc<dyn Target>, TargetError> {
    let parsed = parse(args, ctx, OpenMode::ReadOnly, OpenMode::Handover)?;
    if parsed.snap().is_merging() {
        return Err(args.error(format!(
            "COW device '{}' is being merged into its origin by device '{}'; it is no \
             longer a snapshot",
            parsed.cow_ref,
            parsed.handle.hub.merged_by().unwrap_or_default()
        )));
    }
    check_no_merge(&parsed).map_err(|e| args.error(e))?;
    Ok(Arc::new(Snapshot {
        args: parsed,
        len: ctx.len,
        table: NEXT_TABLE.fetch_add(1, Ordering::Relaxed),
        owner: Mutex::new(ctx.owner.to_string()),
    }))
}

/// A new snapshot (one not active yet) is refused while a merge rolls its origin back: the
/// origin file is then half rolled back, no moment to take a snapshot of.
fn check_no_merge(args: &SnapshotArgs) -> std::result::Result<(), String> {
    if args.snap().is_active() {
        return Ok(());
    }
    match args.handle.hub.merged_by() {
        Some(merger) => Err(format!(
            "origin '{}' is being merged into by device '{merger}'; take snapshots of it once \
             the merge is done",
            args.origin_ref
        )),
        None => Ok(()),
    }
}

impl Snapshot {
    fn snap(&self) -> &Snap {
        self.args.snap()
    }

    fn check_usable(&self) -> Result<()> {
        let snap = self.snap();
        if !snap.is_valid() {
            return Err(invalid(snap));
        }
        if snap.is_merging() {
            return Err(BlockError::Io(
                "the snapshot was handed over to its merge into the origin".into(),
            ));
        }
        Ok(())
    }

    /// A write to a chunk that has no exception yet: saves the chunk with the write applied.
    fn write_new_chunk(&self, chunk: u64, at: u64, data: &[u8]) -> Result<()> {
        let snap = self.snap();
        let origin = &*self.args.origin;
        let (start, end) = snap.chunk_range(chunk, origin.size());
        let saved = if at == start && at + data.len() as u64 == end {
            // The write covers the whole chunk: nothing of the origin's is kept.
            snap.save_chunk(chunk, data)
        } else {
            CHUNK.with_borrow_mut(|buf| {
                buf.resize((end - start) as usize);
                origin.read(start, buf)?;
                let from = (at - start) as usize;
                buf[from..from + data.len()].copy_from_slice(data);
                snap.save_chunk(chunk, buf)
            })
        };
        let record = match saved {
            Ok(record) => record,
            Err(StoreError::Full) if self.args.persistence == Persistence::PersistentOverflow => {
                snap.set_overflowed();
                return Err(BlockError::Io("the snapshot's COW device is full".into()));
            }
            Err(e) => {
                snap.invalidate(&format!("writing to the snapshot: {e}"));
                return Err(invalid(snap));
            }
        };
        snap.commit(&[record]).map_err(|e| {
            snap.invalidate(&format!("committing an exception: {e}"));
            invalid(snap)
        })
    }
}

impl BlockDevice for Snapshot {
    fn size(&self) -> u64 {
        self.len
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            discard: self.args.discards.zeroes_cow,
            fast_zero: false,
            ..Capabilities::weakest([self.snap().cow.capabilities()])
        }
    }

    /// The kernel's `discard_zeroes_cow` and `discard_passdown_origin` ([`super::Discards`]);
    /// without them a discard is ignored (a hint the snapshot does not take).
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        let discards = self.args.discards;
        if !discards.zeroes_cow {
            return Ok(());
        }
        let snap = self.snap();
        // It changes the COW device too: inside the gate, as a write.
        let _writing = snap.writes.enter();
        self.check_usable()?;
        let origin = &*self.args.origin;
        each_chunk(snap.chunk, offset, len, |chunk, at, n, _| {
            if discards.passdown_origin {
                origin.discard(at, n)?;
            }
            let _held = snap.locks.exclusive(chunk);
            let Some(new) = snap.exceptions.get(chunk) else {
                return Ok(());
            };
            let (start, end) = snap.chunk_range(chunk, origin.size());
            if at == start && at + n == end {
                snap.cow
                    .write_zeroes(snap.cow_offset(new, at), n, udm_block::ZeroFlags::default())
            } else {
                snap.cow.discard(snap.cow_offset(new, at), n)
            }
        })
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check_usable()?;
        let snap = self.snap();
        each_chunk(
            snap.chunk,
            offset,
            buf.len() as u64,
            |chunk, at, _, range| match snap.settle(chunk, false) {
                (Some(new), _held) => snap.cow.read(snap.cow_offset(new, at), &mut buf[range]),
                (None, _held) => self.args.origin.read(at, &mut buf[range]),
            },
        )
    }

    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> Result<()> {
        let snap = self.snap();
        // Checked inside the gate: a merge takes the COW device over between writes.
        let _writing = snap.writes.enter();
        self.check_usable()?;
        if snap.is_overflowed() {
            return Err(BlockError::Io(
                "the snapshot overflowed: its COW device is full".into(),
            ));
        }
        each_chunk(
            snap.chunk,
            offset,
            buf.len() as u64,
            |chunk, at, _, range| match snap.settle(chunk, true) {
                (Some(new), _held) => snap.cow.write(snap.cow_offset(new, at), &buf[range], flags),
                (None, _held) => self.write_new_chunk(chunk, at, &buf[range]),
            },
        )
    }

    fn flush(&self) -> Result<()> {
        self.check_usable()?;
        self.snap().cow.flush()
    }

    /// Reads map onto the COW device and the origin (holding the origin's chunks shared
    /// until the read completes); writes and flushes onto the COW device once every chunk
    /// they touch has its exception.
    fn map(&self, op: MapOp, offset: u64, len: u64) -> Option<Mapping> {
        // Discards and write-zeroes mean something of their own here: the synchronous way.
        if op.is_fill() {
            return None;
        }
        let snap = self.snap();
        // A write holds its place among the snapshot's writes until it has landed, and checks
        // the snapshot inside: a merge takes the COW device over between writes.
        let writing = match op.is_write() {
            true => Some(snap.writes.try_enter()?),
            false => None,
        };
        if self.check_usable().is_err() {
            return None;
        }
        if op == MapOp::Flush {
            return snap.cow.map(op, 0, 0);
        }
        if op.is_write() && snap.is_overflowed() {
            return None;
        }
        let mut mapping = Mapping::new();
        each_chunk(snap.chunk, offset, len, |chunk, at, n, range| {
            let none = || BlockError::Io(String::new());
            let lower = match snap.exceptions.get(chunk) {
                Some(new) => snap.cow.map(op, snap.cow_offset(new, at), n),
                None if op == MapOp::Read => {
                    let held = snap.locks.try_shared(chunk).ok_or_else(none)?;
                    // Saved while we took hold of it: read the copy instead.
                    match snap.exceptions.get(chunk) {
                        Some(new) => snap.cow.map(op, snap.cow_offset(new, at), n),
                        None => self.args.origin.map(op, at, n).map(|m| m.hold(held)),
                    }
                }
                None => None,
            };
            mapping.append(range.start as u64, lower.ok_or_else(none)?);
            Ok(())
        })
        .ok()?;
        Some(match writing {
            Some(writing) => mapping.hold(writing),
            None => mapping,
        })
    }
}

impl Target for Snapshot {
    fn type_name(&self) -> &'static str {
        "snapshot"
    }

    fn args(&self) -> String {
        self.args.line()
    }

    /// `Invalid` once a merge has taken the COW device over (the kernel invalidates the
    /// source of a handover), else the usage.
    fn status(&self) -> String {
        if self.snap().is_merging() {
            return "Invalid".into();
        }
        status_line(self.snap(), false)
    }

    fn status_details(&self) -> Option<serde_json::Value> {
        Some(details(self.snap()))
    }

    /// udm adds `invalidate`: drops the snapshot (status `Invalid`, I/O fails), as a full
    /// COW device would.
    fn message(&self, words: &[&str]) -> Result<String, TargetError> {
        match words {
            [word] if word.eq_ignore_ascii_case("invalidate") => {
                self.snap().invalidate("asked to by a message");
                Ok(String::new())
            }
            _ => Err(TargetError::new(format!(
                "snapshot: unsupported message '{}' (known: invalidate)",
                words.join(" ")
            ))),
        }
    }

    /// A transient snapshot's exceptions live in memory only: the same table built again
    /// after a restart would be a new snapshot of the origin as it is then, silently. The
    /// saved setting invalidates it instead, which is what it is.
    fn settings_messages(&self) -> Vec<String> {
        if self.args.persistence == Persistence::Transient {
            vec!["invalidate".into()]
        } else {
            Vec::new()
        }
    }

    fn references(&self) -> Vec<String> {
        vec![self.args.origin_ref.clone(), self.args.cow_ref.clone()]
    }

    /// A table built before a merge into the origin began is refused when it would become
    /// the snapshot's point in time during it; a table on a COW device another device's
    /// `snapshot` table serves is refused until that one is suspended (a handover, as the
    /// kernel's), so that the store has one live table at a time.
    fn preresume(&self) -> std::result::Result<(), TargetError> {
        check_no_merge(&self.args).map_err(|e| TargetError::new(format!("snapshot: {e}")))?;
        self.snap()
            .check_handover(&self.owner.lock(), "snapshot")
            .map_err(TargetError::new)
    }

    /// No longer a source a merge may take the COW device over from while it is live.
    fn suspend(&self) {
        self.snap().source_suspended(self.table);
    }

    fn renamed(&self, new: &str) {
        *self.owner.lock() = new.to_string();
        self.snap().rename_source(self.table, new);
    }

    /// The first resume of any table on this COW device is the snapshot's point in time.
    fn resume(&self) {
        self.snap().source_resumed(self.table, &self.owner.lock());
        let handle = &self.args.handle;
        if !handle.snap.is_active() {
            handle
                .hub
                .activate(&handle.snap, || handle.snap.set_active());
        }
    }
}

impl Drop for Snapshot {
    fn drop(&mut self) {
        self.snap().source_suspended(self.table);
    }
}
