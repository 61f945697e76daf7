//! The pool's life with its tables: binding the live pool table at resume (growth, mode),
//! suspend, the thin targets using it, status and messages.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use log::{error, info, warn};
use parking_lot::MutexGuard;
use udm_block::BlockDevice;
use udm_metadata::thin::{DeviceInfo, ThinError, ThinMetadata, MAX_METADATA_BLOCKS};

use super::{Bound, Hold, Meta, Pool, ThinUse};
use crate::target::TargetError;
use crate::thin::status::{metadata_low_water, Mode, PoolStatus};

impl Pool {
    /// Takes the live table's devices and features (at every resume of a pool table): grows
    /// the metadata space if the table's metadata device is larger and the data space if
    /// the table is, sets the mode the table asks for, and lets thin I/O through again.
    pub fn bind(&self, bound: Bound, nr_blocks: u64, metadata: &Arc<dyn BlockDevice>) {
        let read_only = bound.features.read_only;
        *self.bound.write() = bound;
        let mut meta = self.meta();
        // A pool read-only because its metadata filled up grows (that is the way out of
        // it); one read-only by its table, or failed, does not.
        if !read_only {
            let metadata_blocks =
                (metadata.size() / udm_metadata::BLOCK_SIZE as u64).min(MAX_METADATA_BLOCKS);
            let metadata_total = meta.md.metadata_usage().total;
            self.grow(
                &mut meta,
                "metadata",
                metadata_total,
                metadata_blocks,
                |md| md.resize_metadata(metadata.clone()),
            );
            let data_total = meta.md.data_usage().total;
            self.grow(&mut meta, "data", data_total, nr_blocks, |md| {
                md.resize_data(nr_blocks)
            });
        }
        match self.mode() {
            Mode::Fail => {}
            _ if !read_only && meta.md.needs_check() => {
                error!(
                    "thin-pool '{}': unable to switch the pool to write mode until repaired \
                     (thin_check, thin_repair)",
                    self.name
                );
                self.set_mode(Mode::ReadOnly);
            }
            _ => self.set_mode(if read_only {
                Mode::ReadOnly
            } else {
                Mode::Write
            }),
        }
        self.low_water_triggered.store(false, Ordering::Release);
        self.metadata_low_triggered.store(false, Ordering::Release);
        self.space.reset();
        match self.commit_locked(&mut meta) {
            Err(e) => warn!("thin-pool '{}': commit at resume failed: {e}", self.name),
            // Opened read-only without an identity, and writable now: it gets one (see
            // `Pool::open`), once the commit above went through, so that nothing else (no
            // mapping whose data was not flushed) rides on its commit.
            Ok(()) if self.mode() == Mode::Write => {
                if let Err(e) = meta.md.identify() {
                    warn!(
                        "thin-pool '{}': giving the pool an identity: {e}",
                        self.name
                    );
                }
            }
            Ok(()) => {}
        }
        // Reopened (or reloaded) with its metadata as full as it was: read-only at once.
        self.short_of_metadata(&meta);
        drop(meta);
        self.gate.open();
    }

    /// Grows the pool's `space` ("data" or "metadata") from `from` to `to` blocks with
    /// `resize`, unless it is not larger, the pool has failed, or the metadata awaits repair.
    fn grow(
        &self,
        meta: &mut Meta,
        space: &str,
        from: u64,
        to: u64,
        resize: impl FnOnce(&mut ThinMetadata) -> Result<(), ThinError>,
    ) {
        if to <= from || self.mode() == Mode::Fail {
            return;
        }
        if meta.md.needs_check() {
            error!(
                "thin-pool '{}': unable to grow the {space} device until repaired",
                self.name
            );
            return;
        }
        info!(
            "thin-pool '{}': growing the {space} device from {from} to {to} blocks",
            self.name
        );
        match resize(&mut meta.md) {
            Ok(()) => self.mark_dirty(),
            Err(e) => {
                self.metadata_failed(meta, &format!("resize_{space}"), e);
            }
        }
    }

    /// Holds thin I/O and waits for what is in flight, then commits (pool suspend).
    pub fn suspend(&self) {
        self.gate.close();
        if let Err(e) = self.commit() {
            warn!("thin-pool '{}': commit at suspend failed: {e}", self.name);
        }
    }

    /// Registers a thin target of device `id` in the table of device `owner` (`writable`
    /// or not), if the pool has that device and takes the table: checked with the users
    /// held, as `delete` holds them, so that the device cannot go between the check and the
    /// registration (the kernel counts opens under its metadata lock).
    pub fn register_thin(
        &self,
        id: u32,
        owner: &str,
        writable: bool,
    ) -> std::result::Result<u64, Unregistered> {
        let mut thins = self.thins.lock();
        if self.device(id).is_none() {
            return Err(Unregistered::NoDevice);
        }
        match self.holds.lock().get(&id) {
            Some(Hold::Private { owner: only, what }) if only != owner => {
                return Err(Unregistered::Private(what.clone()))
            }
            Some(Hold::Sent(sends)) if writable => return Err(Unregistered::Sent(sends.clone())),
            _ => {}
        }
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        thins.push(ThinUse {
            token,
            id,
            owner: owner.to_string(),
            live: false,
            writable,
        });
        Ok(token)
    }

    /// Keeps thin device `id` for the tables of device `owner` alone, saying to others what
    /// it is (`what`); None: for any table again.
    pub fn set_private(&self, id: u32, owner: Option<(&str, &str)>) {
        let mut holds = self.holds.lock();
        match owner {
            Some((owner, what)) => {
                let (owner, what) = (owner.into(), what.into());
                drop(holds.insert(id, Hold::Private { owner, what }))
            }
            None => drop(holds.remove(&id)),
        }
    }

    /// Keeps thin device `id` from writable tables while send `by` reads it, if none uses it
    /// now and it is not another device's alone (checked with the users held, as in
    /// [`Pool::register_thin`]): a snapshot being written is no consistent point, and a base
    /// that changes no longer matches what the receiver holds.
    pub fn hold_sent(&self, id: u32, by: &str) -> std::result::Result<(), TargetError> {
        let users = self.users();
        let mut holds = self.holds.lock();
        match holds.get_mut(&id) {
            Some(Hold::Private { what, .. }) => {
                return Err(TargetError::new(format!(
                    "thin device {id} of pool '{}' is {what}",
                    self.name
                )))
            }
            Some(Hold::Sent(sends)) => sends.push(by.to_string()),
            None => {
                let writers = users.writers(id);
                if let Some(first) = writers.first() {
                    return Err(TargetError::new(format!(
                        "thin device {id} of pool '{pool}' is used by {}, writable: send a \
                         snapshot (udm message {pool} 0 create_snap NEW {id}), or remove \
                         '{first}' or load it read-only",
                        writers.join(", "),
                        pool = self.name
                    )));
                }
                holds.insert(id, Hold::Sent(vec![by.to_string()]));
            }
        }
        Ok(())
    }

    /// Send `by` no longer reads thin device `id` (see [`Pool::hold_sent`]).
    pub fn end_sent(&self, id: u32, by: &str) {
        let mut holds = self.holds.lock();
        if let Some(Hold::Sent(sends)) = holds.get_mut(&id) {
            sends.retain(|s| s != by);
            if sends.is_empty() {
                holds.remove(&id);
            }
        }
    }

    pub fn set_thin_live(&self, token: u64, live: bool) {
        if let Some(thin) = self.thins.lock().iter_mut().find(|t| t.token == token) {
            thin.live = live;
        }
    }

    pub fn unregister_thin(&self, token: u64) {
        let mut thins = self.thins.lock();
        let Some(gone) = thins.iter().position(|t| t.token == token) else {
            return;
        };
        let id = thins.remove(gone).id;
        // The last table of a device that lost writes is gone: a new one starts afresh.
        if !thins.iter().any(|t| t.id == id) {
            self.lost.lock().remove(&id);
        }
    }

    /// The devices whose tables use thin device `id`: (name, live).
    pub fn users_of(&self, id: u32) -> Vec<(String, bool)> {
        self.users().of(id)
    }

    /// The thin targets using the pool, held still: while held, none registers, goes, or
    /// is resumed, so that a message can check them and act on what it found.
    pub fn users(&self) -> Users<'_> {
        Users(self.thins.lock())
    }

    pub fn device(&self, id: u32) -> Option<DeviceInfo> {
        self.meta().md.device(id)
    }

    /// The status line's numbers. Commits first when running (as the kernel does, so the
    /// metadata figures are current).
    pub fn status(&self) -> PoolStatus {
        if self.mode() != Mode::Fail && !self.gate.is_closed() {
            if let Err(e) = self.commit() {
                warn!("thin-pool '{}': commit for status failed: {e}", self.name);
            }
        }
        let meta = self.meta();
        let data = meta.md.data_usage();
        let metadata = meta.md.metadata_usage();
        let features = self.features();
        PoolStatus {
            mode: self.mode(),
            transaction_id: meta.md.transaction_id(),
            metadata_used: metadata.used,
            metadata_total: metadata.total,
            data_used: data.used,
            data_total: data.total,
            held_root: meta.md.held_root(),
            discard_enabled: features.discard_enabled,
            discard_passdown: features.discard_passdown,
            error_if_no_space: features.error_if_no_space || self.space.timed_out(),
            needs_check: meta.md.needs_check(),
            metadata_low_water: metadata_low_water(metadata.total),
        }
    }

    /// Runs a pool message that changes metadata, then commits (as the kernel does).
    pub fn message(
        &self,
        run: impl FnOnce(&mut Meta) -> std::result::Result<(), ThinError>,
        what: &str,
    ) -> std::result::Result<(), TargetError> {
        if self.mode() >= Mode::ReadOnly {
            return Err(TargetError::new(format!(
                "thin-pool: unable to service pool target messages in read-only or fail mode \
                 (pool '{}' is {})",
                self.name,
                self.mode().word()
            )));
        }
        let mut meta = self.meta();
        // Everything before the message committed first (its data flushed), under the same
        // lock: a message that fails half way and aborts drops nothing but itself, and a
        // metadata snapshot holds every write completed before it.
        self.commit_locked(&mut meta)
            .and_then(|()| self.make_metadata_room(&mut meta))
            .map_err(|e| TargetError::new(format!("thin-pool: {what}: {e}")))?;
        // Snapshots change which of a device's blocks are shared, deletes unmap whole
        // devices: the cache starts over.
        self.maps.clear();
        match run(&mut meta) {
            Ok(()) => {}
            Err(
                e @ (ThinError::NoSuchDevice(_)
                | ThinError::DeviceExists(_)
                | ThinError::BadArgument(_)),
            ) => return Err(TargetError::new(format!("thin-pool: {what}: {e}"))),
            Err(e) => {
                let e = self.metadata_failed(&mut meta, what, e);
                return Err(TargetError::new(format!("thin-pool: {e}")));
            }
        }
        self.mark_dirty();
        self.commit_locked(&mut meta)
            .map_err(|e| TargetError::new(format!("thin-pool: {what}: committing: {e}")))?;
        // A delete may have freed blocks that requests are waiting for.
        self.space.changed();
        Ok(())
    }
}

/// Why a thin target could not register with its pool.
pub enum Unregistered {
    NoDevice,
    /// The device is kept for another device's tables: what it is.
    Private(String),
    /// The device is being sent (by these sends) and the table would write.
    Sent(Vec<String>),
}

/// The thin targets of a pool, held (see [`Pool::users`]).
pub struct Users<'a>(MutexGuard<'a, Vec<ThinUse>>);

impl Users<'_> {
    /// The devices whose tables use thin device `id`: (name, live).
    pub fn of(&self, id: u32) -> Vec<(String, bool)> {
        let mut users: Vec<(String, bool)> = Vec::new();
        for thin in self.0.iter().filter(|t| t.id == id) {
            match users.iter_mut().find(|(name, _)| *name == thin.owner) {
                Some((_, live)) => *live |= thin.live,
                None => users.push((thin.owner.clone(), thin.live)),
            }
        }
        users
    }

    /// The devices whose writable tables use thin device `id`.
    pub fn writers(&self, id: u32) -> Vec<String> {
        let mut writers: Vec<String> = Vec::new();
        for thin in self.0.iter().filter(|t| t.id == id && t.writable) {
            if !writers.contains(&thin.owner) {
                writers.push(thin.owner.clone());
            }
        }
        writers
    }
}
