//! What a target is and what its constructor gets; the list of target types is in
//! `registry.rs`.

use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use udm_block::{BlockDevice, OpenMode, SECTOR_SIZE};

/// A table line or message that cannot be accepted. The text names the offending token.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{0}")]
pub struct TargetError(pub String);

impl TargetError {
    pub fn new(message: impl Into<String>) -> Self {
        TargetError(message.into())
    }
}

/// Opens the devices that table arguments name. The daemon implements it: paths become file
/// backends, NBD URIs remote clients, other words udm devices.
pub trait Resolver {
    fn open(&self, reference: &str, mode: OpenMode) -> Result<Arc<dyn BlockDevice>, TargetError>;

    /// Opens a multipath's path: a device whose failures have somewhere else to go. A remote
    /// export then fails a request as soon as its connection breaks, and after `timeout` when
    /// its server stops answering, instead of waiting up to the daemon's `--remote-timeout`
    /// for it to come back. Anything else opens as with [`Resolver::open`].
    fn open_path(
        &self,
        reference: &str,
        mode: OpenMode,
        _timeout: Duration,
    ) -> Result<Arc<dyn BlockDevice>, TargetError> {
        self.open(reference, mode)
    }

    /// Whether the tables built now bring devices back after a daemon restart, rather than
    /// being loaded by a user: a target that keeps a record for its device's whole life (the
    /// log-writes log) goes on with it instead of starting anew.
    fn restoring(&self) -> bool {
        false
    }

    /// Whether the tables built now serve a read-only device (dm's table mode): a target may
    /// refuse to be written where another may not be.
    fn read_only(&self) -> bool {
        false
    }
}

/// Raises a device event (hydration done, mode change, path failed…) for `udm wait`.
pub type EventSink = Arc<dyn Fn() + Send + Sync>;

/// Everything a constructor gets besides its arguments.
pub struct TargetContext<'a> {
    pub resolver: &'a dyn Resolver,
    /// The name of the device whose table is being built: the key under which targets that
    /// others look up (a thin pool) register themselves in a [`crate::Rendezvous`].
    pub owner: &'a str,
    /// Length of the segment in bytes.
    pub len: u64,
    pub raise_event: EventSink,
    /// See [`Resolver::restoring`].
    pub restoring: bool,
    /// See [`Resolver::read_only`].
    pub read_only: bool,
    /// How far into each lower device the target reaches, recorded by [`TargetContext::require`]
    /// so that shrinking a device under its users can be refused.
    pub(crate) needs: std::cell::RefCell<Vec<(String, u64)>>,
}

impl TargetContext<'_> {
    /// Checks that `[offset, offset + len)` lies on `dev` (opened as `reference`) and records
    /// that this target uses it up to there.
    pub fn require(
        &self,
        reference: &str,
        dev: &dyn BlockDevice,
        offset: u64,
        len: u64,
    ) -> Result<(), TargetError> {
        let end = offset.checked_add(len).filter(|end| *end <= dev.size());
        let Some(end) = end else {
            return Err(TargetError::new(format!(
                "device '{reference}' has {} sectors; offset {} + length {} does not fit",
                dev.size() / SECTOR_SIZE,
                offset / SECTOR_SIZE,
                len / SECTOR_SIZE
            )));
        };
        self.needs.borrow_mut().push((reference.to_string(), end));
        Ok(())
    }
}

/// A constructed target: a block device of its segment's length, plus the dm-style surface.
pub trait Target: BlockDevice {
    fn type_name(&self) -> &'static str;

    /// The arguments as a table line prints them; parsing them back gives the same target.
    /// None by default (`zero`, `error`).
    fn args(&self) -> String {
        String::new()
    }

    /// The `status` line (dm's STATUSTYPE_INFO).
    fn status(&self) -> String {
        String::new()
    }

    /// Machine-readable details beyond the status line (for `udm status --json`).
    fn status_details(&self) -> Option<serde_json::Value> {
        None
    }

    /// The target line (type and arguments) that can take this target's place once its job
    /// is done, for `udm finalize`: a fully hydrated clone becomes `linear <destination> 0`.
    /// `None` for targets that have no such end; an error says why it cannot happen yet.
    fn replacement(&self) -> Option<Result<String, TargetError>> {
        None
    }

    /// Handles `udm message`; the answer (possibly empty) is printed by the client.
    fn message(&self, words: &[&str]) -> Result<String, TargetError> {
        Err(TargetError::new(format!(
            "{}: unknown message '{}'",
            self.type_name(),
            words.join(" ")
        )))
    }

    /// Messages that bring a fresh target, built from the same table line, to this one's
    /// current settings (what `udm message` changed). The daemon saves them with the table and
    /// replays them when it brings the device back after a restart.
    fn settings_messages(&self) -> Vec<String> {
        Vec::new()
    }

    /// The device references this target uses (for `ls --tree` and cycle checks); none by
    /// default.
    fn references(&self) -> Vec<String> {
        Vec::new()
    }

    /// When this target's flush is its lower device's flush and nothing else (a `linear`),
    /// that device's identity ([`BlockDevice::identity`]), else a key of the handle itself
    /// (two NBD connections to one export are two devices to flush): a table flushes such a device
    /// once however many of its segments lead there. A device stacked over a fragmented one
    /// has a segment per fragment, and flushing the lower device once per segment, each
    /// time all of its own segments, cost segments × segments syncs per flush.
    fn flush_key(&self) -> Option<String> {
        None
    }

    /// Called when a suspend begins, before the requests in flight are waited for: a target
    /// holding requests that wait for something that may never come (a multipath queueing
    /// with no usable path) lets them fail now, as the kernel's presuspend does, so that the
    /// suspend cannot wait forever; or, when `noflush` (dmsetup's `suspend --noflush`, the
    /// table reload multipathd makes), hands them back to the device with
    /// [`BlockError::Requeue`](udm_block::BlockError::Requeue), which runs them again after
    /// the resume. Also before a device is removed and when the daemon stops (`noflush`
    /// false). `resume` undoes it.
    fn presuspend(&self, _noflush: bool) {}

    /// Asked before a table loaded by the user goes live (dm's preresume): an error refuses
    /// the resume, and nothing changes. Not asked when a restart brings a device back: it
    /// was accepted before.
    fn preresume(&self) -> Result<(), TargetError> {
        Ok(())
    }

    /// Called when the device is suspended (I/O already drained) and when the table is
    /// resumed, which includes first becoming live. Targets with background work start it at
    /// the first resume, never while they sit in an inactive table.
    fn suspend(&self) {}
    fn resume(&self) {}

    /// The device whose table this is is now called `new` (`udm rename`): a target that
    /// others find by its device's name follows.
    fn renamed(&self, _new: &str) {}
}
