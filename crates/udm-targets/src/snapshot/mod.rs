//! Classic snapshots, as the kernel's dm-snapshot (`snapshot.rst`):
//!
//! - `snapshot-origin <origin>` ([`origin`]): the origin as its users see it; before a write
//!   changes a chunk, the chunk is copied into every snapshot that has not saved it yet.
//! - `snapshot <origin> <COW device> <P|PO|N> <chunk size>` ([`snapshot`]): the origin as it
//!   was when the snapshot became active; chunks saved or written since live on the COW
//!   device, the rest is read from the origin.
//! - `snapshot-merge <origin> <COW device> <P|PO> <chunk size>` ([`merge`]): takes the place
//!   of `snapshot-origin` and copies a snapshot's chunks back into the origin in the
//!   background (a rollback), while serving the origin as it will be once merged.
//!
//! The pieces: [`hub`] (one per origin: the snapshots that must see its writes), [`cow`]
//! (one per COW device: its store, exceptions and chunk locks), [`exceptions`],
//! [`chunk_locks`], [`copier`] (the copy-out of a mapped origin write, asynchronous steps on
//! io_uring as the kernel's kcopyd); the on-disk store is `udm_metadata::snapshot`.

mod chunk_locks;
mod copier;
mod cow;
mod exceptions;
mod hub;
mod merge;
mod origin;
#[allow(clippy::module_inception)]
mod snapshot;
mod stages;

use std::sync::Arc;

use udm_block::{BlockDevice, BlockError, OpenMode, SECTOR_SIZE};
use udm_metadata::snapshot::layout::{check_chunk_sectors, DEFAULT_CHUNK_SECTORS};
use udm_metadata::snapshot::{ExceptionStore, PersistentStore, TransientStore};

use crate::args::Args;
use crate::rendezvous::device_key;
use crate::target::{TargetContext, TargetError};
use cow::{CowUse, Snap, SnapHandle};
use hub::Hub;

pub use merge::construct as construct_merge;
pub use origin::construct as construct_origin;
pub use snapshot::construct as construct_snapshot;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Persistence {
    Persistent,
    /// Persistent, and the user understands an `Overflow` status.
    PersistentOverflow,
    Transient,
}

impl Persistence {
    fn word(self) -> &'static str {
        match self {
            Persistence::Persistent => "P",
            Persistence::PersistentOverflow => "PO",
            Persistence::Transient => "N",
        }
    }
}

/// The arguments `snapshot` and `snapshot-merge` share, with their devices open and the
/// snapshot on the COW device found or loaded.
struct SnapshotArgs {
    origin_ref: String,
    origin: Arc<dyn BlockDevice>,
    cow_ref: String,
    persistence: Persistence,
    discards: Discards,
    handle: Arc<SnapHandle>,
}

/// The kernel's optional discard features (`[<#feature args> <feature>*]`). Without them a
/// snapshot takes no discards.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Discards {
    /// `discard_zeroes_cow`: a discard of a whole chunk the snapshot holds zeroes its copy
    /// (the exception stays and reads zeroes); of part of one, is passed to the COW device;
    /// of a chunk it does not hold, does nothing.
    zeroes_cow: bool,
    /// `discard_passdown_origin` (needs `discard_zeroes_cow`): the discard also goes to the
    /// origin device itself, past `snapshot-origin`, so nothing is saved first: it frees
    /// the origin's space, and other snapshots of it lose those chunks.
    passdown_origin: bool,
}

impl Discards {
    fn parse(args: &mut Args) -> Result<Discards, TargetError> {
        let mut discards = Discards::default();
        if args.remaining() == 0 {
            return Ok(discards);
        }
        let count: usize = args.number("#feature args")?;
        if count != args.remaining() {
            return Err(args.error(format!(
                "{count} feature arguments announced, {} given",
                args.remaining()
            )));
        }
        for _ in 0..count {
            match args.word("feature")? {
                "discard_zeroes_cow" => discards.zeroes_cow = true,
                "discard_passdown_origin" => discards.passdown_origin = true,
                other => {
                    return Err(args.error(format!(
                        "unrecognised feature '{other}' (known: discard_zeroes_cow, \
                         discard_passdown_origin)"
                    )))
                }
            }
        }
        if discards.passdown_origin && !discards.zeroes_cow {
            return Err(
                args.error("discard_passdown_origin needs discard_zeroes_cow, as in the kernel")
            );
        }
        Ok(discards)
    }

    /// The feature arguments as the kernel prints them: nothing when there are none.
    fn words(self) -> String {
        let mut words = Vec::new();
        if self.zeroes_cow {
            words.push("discard_zeroes_cow");
        }
        if self.passdown_origin {
            words.push("discard_passdown_origin");
        }
        match words.len() {
            0 => String::new(),
            n => format!(" {n} {}", words.join(" ")),
        }
    }
}

impl SnapshotArgs {
    fn snap(&self) -> &Arc<Snap> {
        &self.handle.snap
    }

    /// The table line's arguments with the chunk size in use (which a formatted COW device
    /// decides), as the kernel prints them.
    fn line(&self) -> String {
        format!(
            "{} {} {} {}{}",
            self.origin_ref,
            self.cow_ref,
            self.persistence.word(),
            self.snap().store.chunk_sectors(),
            self.discards.words()
        )
    }
}

/// `origin_mode` and `cow_mode` are how the origin and the COW device are opened: a merge
/// writes the origin; a COW device is opened for handover, so that the merge of another
/// device can take it over from the snapshot device (the kernel's exception handover).
fn parse(
    args: &mut Args,
    ctx: &TargetContext,
    origin_mode: OpenMode,
    cow_mode: OpenMode,
) -> Result<SnapshotArgs, TargetError> {
    if args.remaining() < 4 {
        return Err(args.error(format!(
            "expected <origin> <COW device> <P|PO|N> <chunk size>, got {} argument(s)",
            args.remaining()
        )));
    }
    let (origin_ref, origin) = args.device(ctx, "origin", origin_mode)?;
    let cow_ref = args.word("COW device")?.to_string();
    let cow = ctx
        .resolver
        .open(&cow_ref, cow_mode)
        .map_err(|e| args.error(format!("cannot open <COW device> '{cow_ref}': {e}")))?;
    let (origin_key, cow_key) = (
        device_key(&origin_ref, &*origin),
        device_key(&cow_ref, &*cow),
    );
    if cow_key == origin_key {
        return Err(args.error(format!(
            "the COW device '{cow_ref}' cannot be the origin itself"
        )));
    }
    let persistence = match args.word("persistent?")?.to_ascii_uppercase().as_str() {
        "P" => Persistence::Persistent,
        "PO" => Persistence::PersistentOverflow,
        "N" => Persistence::Transient,
        other => {
            return Err(args.error(format!(
                "invalid <persistent?> '{other}': expected P, PO or N"
            )))
        }
    };
    let chunk_sectors: u64 = args.number("chunk size")?;
    if chunk_sectors != 0 {
        check_chunk_sectors(chunk_sectors)
            .map_err(|e| args.error(format!("invalid <chunk size>: {e}")))?;
    }
    let discards = Discards::parse(args)?;
    ctx.require(&origin_ref, &*origin, 0, ctx.len)
        .map_err(|e| args.error(e))?;
    ctx.require(&cow_ref, &*cow, 0, cow.size())
        .map_err(|e| args.error(e))?;
    let hub = Hub::of(&origin_key, &origin_ref);
    let persistent = persistence != Persistence::Transient;
    let using = CowUse {
        cow_key,
        cow_name: cow_ref.clone(),
        cow: cow.clone(),
        persistent,
        hub,
        raise_event: &ctx.raise_event,
    };
    let handle = SnapHandle::get(using, || {
        open_store(cow.clone(), persistent, chunk_sectors)
            .map_err(|e| format!("COW device '{cow_ref}': {e}"))
    })
    .map_err(|e| args.error(e))?;
    let in_use = handle.snap.store.chunk_sectors();
    if chunk_sectors != 0 && chunk_sectors != in_use {
        log::warn!(
            "snapshot: COW device '{cow_ref}' has chunks of {in_use} sectors; the table's \
             {chunk_sectors} is ignored, as the kernel does"
        );
    }
    Ok(SnapshotArgs {
        origin_ref,
        origin,
        cow_ref,
        persistence,
        discards,
        handle,
    })
}

type Opened = (
    Box<dyn ExceptionStore>,
    Vec<udm_metadata::snapshot::Record>,
    bool,
);

fn open_store(
    cow: Arc<dyn BlockDevice>,
    persistent: bool,
    chunk_sectors: u64,
) -> Result<Opened, String> {
    if persistent {
        let opened = PersistentStore::open(cow, chunk_sectors).map_err(|e| e.to_string())?;
        if !opened.valid {
            log::warn!("snapshot: the COW device is marked invalid; the snapshot is unusable");
        }
        return Ok((Box::new(opened.store), opened.records, opened.valid));
    }
    let chunk_sectors = match chunk_sectors {
        0 => DEFAULT_CHUNK_SECTORS,
        n => n,
    };
    let store = TransientStore::new(chunk_sectors, cow.size()).map_err(|e| e.to_string())?;
    Ok((Box::new(store), Vec::new(), true))
}

/// The status line of a snapshot or a merge, as the kernel's.
fn status_line(snap: &Snap, merge_failed: bool) -> String {
    if !snap.is_valid() {
        return "Invalid".into();
    }
    if merge_failed {
        return "Merge failed".into();
    }
    if snap.is_overflowed() {
        return "Overflow".into();
    }
    let usage = snap.store.usage();
    format!("{}/{} {}", usage.allocated, usage.total, usage.metadata)
}

/// What `udm status --json` adds for a snapshot or a merge.
fn details(snap: &Snap) -> serde_json::Value {
    let usage = snap.store.usage();
    let stats = snap.store.stats();
    serde_json::json!({
        "valid": snap.is_valid(),
        "overflow": snap.is_overflowed(),
        "merging": snap.is_merging(),
        "persistent": snap.persistent,
        "chunk_sectors": snap.chunk / SECTOR_SIZE,
        "exceptions": snap.exceptions.len(),
        "sectors_allocated": usage.allocated,
        "total_sectors": usage.total,
        "metadata_sectors": usage.metadata,
        "commits": stats.commits,
        "exceptions_committed": stats.records,
        "copy_out_stages": snap.stages.json(),
    })
}

fn invalid(snap: &Snap) -> BlockError {
    BlockError::Io(format!(
        "snapshot on '{}' is invalid (its COW device filled up or failed)",
        snap.cow_name
    ))
}

/// Calls `f(chunk, offset, len, range in request)` for each chunk-sized piece of a request.
fn each_chunk(
    chunk: u64,
    offset: u64,
    len: u64,
    mut f: impl FnMut(u64, u64, u64, std::ops::Range<usize>) -> Result<(), BlockError>,
) -> Result<(), BlockError> {
    for (index, at, n, range) in crate::runs::by_unit(offset, len, chunk) {
        f(index, at, n, range)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
