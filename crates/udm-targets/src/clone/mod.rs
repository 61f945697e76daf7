//! `clone <metadata dev> <destination dev> <source dev> <region size> [<#features>
//! [no_hydration] [no_discard_passdown] [hydrate_on_read]] [<#core args>
//! [hydration_threshold <n>] [hydration_batch_size <n>] [max_hydration_rate <KiB/s>]]`
//!
//! Copies ("hydrates") a slow or remote source onto a fast destination while the device is in
//! use, as the kernel's dm-clone. Reads of regions not yet copied come from the source; writes
//! go to the destination (copying the region first unless the write covers all of it); a
//! bitmap on the metadata device, committed on FLUSH/FUA and every second, says which regions
//! are on the destination. Background workers copy the rest, skipping what the source reports
//! as zero and yielding to user I/O.
//!
//! udm adds: `hydrate_on_read` (a read of an unhydrated region copies it first, the kernel's
//! known gap), `max_hydration_rate` (a bandwidth cap for the background copy; also a message),
//! NBD_CMD_CACHE hydrating the range, and zero-aware copying.
//!
//! One file per job: `args` reads the table line, `io` serves requests, `copy` moves regions
//! from source to destination, `hydration` runs the background workers and the committer,
//! `commit` makes the bitmap durable and handles metadata failures, `status` answers status
//! and messages, `regions` keeps per-region claims. This file holds the target and its life:
//! built inactive, started at its first resume, stopped when dropped.

mod args;
mod commit;
mod copy;
mod hydration;
mod io;
mod regions;
mod status;

use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicBool, AtomicU8};
use std::sync::Arc;
use std::thread::JoinHandle;

use log::{info, warn};
use udm_block::BlockDevice;
use udm_metadata::CloneMetadata;

use crate::args::Args;
use crate::pacing::{Throughput, UserActivity};
use crate::target::{EventSink, Target, TargetContext, TargetError};
use commit::Mode;
use hydration::Hydration;
use regions::RegionClaims;

/// What the target's threads and requests share.
struct Inner {
    /// The device this clone is part of, as its log lines name it.
    device: String,
    meta: CloneMetadata,
    source: Arc<dyn BlockDevice>,
    dest: Arc<dyn BlockDevice>,
    /// Region size in bytes.
    region: u64,
    len: u64,
    claims: RegionClaims,
    /// A [`Mode`].
    mode: AtomicU8,
    hydration: Mutex<Hydration>,
    /// Wakes background workers when settings change or work is released.
    wake: Condvar,
    discard_passdown: bool,
    hydrate_on_read: bool,
    /// The user's I/O, which background copying yields to.
    activity: Arc<UserActivity>,
    raise_event: EventSink,
    completion_announced: AtomicBool,
    /// Hydrated bytes once a second, for the copy rate.
    progress: Throughput,
    /// The copy threads started so far (see [`hydration::staff`]).
    copiers: Mutex<Vec<JoinHandle<()>>>,
}

/// The `clone` target.
pub struct CloneTarget {
    inner: Arc<Inner>,
    /// The table line's arguments, printed back as given.
    args: Vec<String>,
    /// Metadata, destination, source.
    references: Vec<String>,
    /// The committer, from the first resume on; `None` while the table has never been live.
    committer: Mutex<Option<JoinHandle<()>>>,
}

pub fn construct(args: &mut Args, ctx: &TargetContext) -> Result<Arc<dyn Target>, TargetError> {
    let parsed = args::parse(args, ctx)?;
    let inner = Arc::new(Inner {
        device: ctx.owner.to_string(),
        meta: parsed.meta,
        source: parsed.source,
        dest: parsed.dest,
        region: parsed.region,
        len: ctx.len,
        claims: RegionClaims::default(),
        mode: AtomicU8::new(Mode::Write as u8),
        hydration: Mutex::new(Hydration::new(parsed.settings)),
        wake: Condvar::new(),
        discard_passdown: parsed.discard_passdown,
        hydrate_on_read: parsed.hydrate_on_read,
        activity: Arc::default(),
        raise_event: ctx.raise_event.clone(),
        completion_announced: AtomicBool::new(false),
        progress: Throughput::default(),
        copiers: Mutex::default(),
    });
    Ok(Arc::new(CloneTarget {
        inner,
        args: parsed.line,
        references: parsed.references,
        committer: Mutex::new(None),
    }))
}

impl Target for CloneTarget {
    fn type_name(&self) -> &'static str {
        "clone"
    }

    fn args(&self) -> String {
        self.args.join(" ")
    }

    fn status(&self) -> String {
        self.status_line()
    }

    fn status_details(&self) -> Option<serde_json::Value> {
        Some(self.details())
    }

    fn message(&self, words: &[&str]) -> Result<String, TargetError> {
        self.handle_message(words)
    }

    fn settings_messages(&self) -> Vec<String> {
        self.saved_settings()
    }

    fn references(&self) -> Vec<String> {
        self.references.clone()
    }

    fn replacement(&self) -> Option<Result<String, TargetError>> {
        Some(self.finished_replacement())
    }

    fn suspend(&self) {
        hydration::pause(&self.inner, true);
        if let Err(e) = self.inner.commit() {
            warn!(
                "clone '{}': commit at suspend failed: {e}",
                self.inner.device
            );
        }
    }

    /// The first resume makes the table live: the bitmap is reread (another clone on the same
    /// metadata may have been live while this table was loaded, and committed at its
    /// suspend) and the committer starts. Every resume lets the copy threads start again.
    fn resume(&self) {
        let mut committer = self.committer.lock();
        let first = committer.is_none();
        if first {
            if let Err(e) = self.inner.meta.load() {
                self.inner
                    .metadata_failed(&format!("rereading metadata on activation: {e}"));
            }
            *committer = Some(hydration::start_committer(&self.inner));
        }
        drop(committer);
        hydration::pause(&self.inner, false);
        hydration::staff(&self.inner);
        if first {
            self.inner.log_start();
        }
    }
}

impl Drop for CloneTarget {
    fn drop(&mut self) {
        hydration::stop(&self.inner);
        // A copy waiting for a remote source that is down would hold up `udm remove` for the
        // whole remote timeout; the source is this table's own handle, so let it go first.
        // Regions being copied stay unhydrated and are copied again by the next table.
        self.inner.source.close();
        let copying = self.inner.hydration.lock().in_flight();
        if copying > 0 {
            info!(
                "clone '{}': stopping: waiting for {copying} region copies in flight",
                self.inner.device
            );
        }
        hydration::join(&self.inner, self.committer.lock().take());
        if self.inner.mode() == Mode::Write {
            if let Err(e) = self.inner.commit() {
                warn!("clone '{}': final commit failed: {e}", self.inner.device);
            }
        }
    }
}

#[cfg(test)]
mod tests;
