//! Making the bitmap durable, and what a metadata failure does to the clone.
//!
//! The metadata modes are the kernel's: a failed commit drops the clone to read-only (the
//! bitmap reverts to its last commit: regions copied since read from the source again), a
//! failure to do even that to fail (every request errors). Each change raises an event.
//!
//! How the clone keeps [`udm_metadata::CloneMetadata`]'s concurrency contract: bits are read
//! without a lock on every request, `set_hydrated` only ever runs in write mode with the
//! region's claim held, commits run one at a time inside the metadata, and a reload after a
//! failed commit happens only once the clone is read-only, so that no new copy or write
//! starts to set bits in the bitmap being replaced.

use parking_lot::Mutex;
use std::sync::atomic::Ordering;

use log::{error, info, warn};
use udm_block::{BlockDevice, BlockError, Result};
use udm_metadata::CommitOutcome;

use super::Inner;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Mode {
    Write = 0,
    ReadOnly = 1,
    Fail = 2,
}

impl Inner {
    pub(super) fn mode(&self) -> Mode {
        match self.mode.load(Ordering::Acquire) {
            0 => Mode::Write,
            1 => Mode::ReadOnly,
            _ => Mode::Fail,
        }
    }

    fn set_mode(&self, mode: Mode) {
        self.mode.store(mode as u8, Ordering::Release);
    }

    pub(super) fn check_not_failed(&self) -> Result<()> {
        if self.mode() == Mode::Fail {
            return Err(BlockError::Io(
                "clone: metadata failed; the device is in fail mode".into(),
            ));
        }
        Ok(())
    }

    /// Commits the bitmap if it changed (flushing the destination first), otherwise just
    /// flushes the destination. A metadata failure changes the mode.
    pub(super) fn commit(&self) -> Result<()> {
        match self.mode() {
            Mode::Fail => return self.check_not_failed(),
            Mode::ReadOnly if self.meta.is_dirty() => {
                return Err(BlockError::Io(
                    "clone: metadata is read-only; cannot commit".into(),
                ))
            }
            Mode::ReadOnly => return self.dest.flush(),
            Mode::Write => {}
        }
        let data_error = Mutex::new(None);
        let flush_data = || {
            self.dest
                .flush()
                .inspect_err(|e| *data_error.lock() = Some(e.clone()))
        };
        match self.meta.commit(&flush_data) {
            Ok(CommitOutcome::Committed) => Ok(()),
            Ok(CommitOutcome::NothingToCommit) => self.dest.flush(),
            Err(e) => {
                if let Some(data) = data_error.into_inner() {
                    // The destination failed to flush: nothing was written to the metadata,
                    // which stays consistent; only this flush fails.
                    return Err(data);
                }
                self.metadata_failed(&e.to_string());
                Err(BlockError::Io(format!(
                    "clone: metadata commit failed: {e}"
                )))
            }
        }
    }

    /// write → read-only (then the last committed bitmap is reread) → fail, each with an
    /// event. Read-only comes first: from then on nothing sets bits, so none is set in the
    /// bitmap while the reload replaces it (see the module's contract).
    pub(super) fn metadata_failed(&self, why: &str) {
        let was = self.mode();
        let next = if was == Mode::Write {
            Mode::ReadOnly
        } else {
            Mode::Fail
        };
        self.set_mode(next);
        error!(
            "clone '{}': metadata operation failed ({why}); switching to {next:?} mode",
            self.device
        );
        if was == Mode::Write {
            if let Err(e) = self.meta.load() {
                error!(
                    "clone '{}': reloading metadata failed too: {e}; switching to Fail mode",
                    self.device
                );
                self.set_mode(Mode::Fail);
            }
        }
        self.wake.notify_all();
        (self.raise_event)();
    }

    pub(super) fn is_complete(&self) -> bool {
        self.meta.hydrated_count() >= self.meta.regions()
    }

    /// Raises the hydration-complete event once (after committing, so the event means the
    /// clone can be switched to `linear <destination>` safely).
    pub(super) fn announce_if_complete(&self) {
        if self.is_complete() && !self.completion_announced.load(Ordering::Acquire) {
            if let Err(e) = self.commit() {
                warn!(
                    "clone '{}': final commit after hydration failed: {e}",
                    self.device
                );
                return;
            }
            if !self.completion_announced.swap(true, Ordering::AcqRel) {
                info!(
                    "clone '{}': hydration complete: all {} regions on the destination",
                    self.device,
                    self.meta.regions()
                );
                (self.raise_event)();
            }
        }
    }
}
