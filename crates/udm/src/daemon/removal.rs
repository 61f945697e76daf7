//! Removing devices: at once, after the clients that are disconnecting have gone, when the
//! last user lets go (`--deferred`), or all of them (`remove_all`).

use std::sync::Arc;
use std::time::Duration;

use log::{info, warn};
use udm_block::{BlockDevice, SECTOR_SIZE};

use super::device::Device;
use super::registry::{check_name, Registry, RegistryError};

type Result<T, E = RegistryError> = std::result::Result<T, E>;

/// How long a plain `remove` waits for a device's clients to let go before refusing. A client
/// that has just disconnected (`nbdinfo … && udm remove vol`) still counts until the server
/// has read its hang-up, which is milliseconds away; a client that stays connected costs the
/// caller this long before the refusal.
pub const CLOSING_GRACE: Duration = Duration::from_secs(1);

/// How long `remove --retry` waits (dmsetup retries for about as long).
pub const RETRY_WAIT: Duration = Duration::from_secs(5);

/// How often a deferred removal looks again whether devices built on it have gone.
const DEFERRED_POLL: Duration = Duration::from_millis(200);

impl Registry {
    /// Removes a device. A device another device's table uses is never removed; one a client
    /// has open, after waiting up to `wait` for its clients to let go, only with `force`,
    /// which first swaps in an all-error table so the clients' I/O fails instead of reaching
    /// the old targets. The table is flushed, unless a device below is suspended (as the
    /// kernel, which does not flush on removal).
    pub fn remove(&self, name: &str, force: bool, wait: Duration) -> Result<()> {
        let device = match self.get(name) {
            Err(RegistryError::NoSuchDevice(_)) if self.discard_unrestored(name)? => {
                return Ok(());
            }
            found => found?,
        };
        self.refuse_if_held(name)?;
        if !force && device.open_count() > 0 {
            device.wait_released(wait);
        }
        let changes = self.changes.lock();
        let device = self.get(name)?;
        self.refuse_if_held(name)?;
        let opens = device.open_count();
        let mut error_table = None;
        if opens > 0 {
            if !force {
                return Err(RegistryError::Busy(
                    name.into(),
                    format!("open by {opens} client(s); use --force to fail their I/O and remove"),
                ));
            }
            let sectors = device.size() / SECTOR_SIZE;
            let error = format!("0 {sectors} error");
            error_table = Some(self.build(name, &error, device.read_only(), device.events())?);
        }
        self.map().remove(name);
        let path = self.state_path(name);
        if let Err(e) = std::fs::remove_file(&path) {
            warn!("removing {}: {e}", path.display());
        }
        // The swap's drain waits for I/O parked at a suspended device below, if any: not
        // under the lock, which every other change needs, the resume that ends the wait
        // among them. Out of the map, the device is no longer the registry's to change.
        drop(changes);
        if error_table.is_some() {
            // The swap waits for the clients' requests in flight: one waiting on a remote
            // that stopped answering would hold it for the whole remote timeout.
            device.live().close_remotes();
        }
        let retired = error_table.and_then(|t| device.replace_live(t));
        // The flush is owed to the table that took the writes: flushing the error table put
        // in by force only failed ("error target"), and left the real one unflushed.
        let table = retired.unwrap_or_else(|| device.live());
        // Nothing may wait for a path that never comes back now.
        table.presuspend(false);
        // A flush through a suspended device would wait for its resume, and the removal
        // with it, for ever if none comes. The kernel's removal does not flush at all
        // (dm_destroy waits only for I/O in flight): nor does this one then.
        if let Some(below) = self.suspended_under(&table) {
            warn!(
                "removing '{name}': it is built on suspended '{below}': not flushed (writes it \
                 has not flushed yet may be lost)"
            );
        } else if let Err(e) = table.flush() {
            warn!("removing '{name}': flushing: {e}");
        }
        if opens > 0 {
            info!(
                "removed device '{name}' by force: {opens} client(s) had it open and their I/O \
                 now fails"
            );
        } else {
            info!("removed device '{name}'");
        }
        Ok(())
    }

    /// Removes the record of device `name` that could not be restored (see
    /// [`Registry::check_no_unrestored_record`]); false when there is none.
    fn discard_unrestored(&self, name: &str) -> Result<bool> {
        // Only a valid name is a file in the state dir (not `../…`).
        if check_name(name).is_err() {
            return Ok(false);
        }
        let _changes = self.changes.lock();
        let path = self.state_path(name);
        if self.map().contains_key(name) || !path.exists() {
            return Ok(false);
        }
        std::fs::remove_file(&path).map_err(|e| RegistryError::Persist(name.into(), e))?;
        warn!(
            "discarded the record of device '{name}', which could not be restored ({})",
            path.display()
        );
        Ok(true)
    }

    /// Flushes every device (at shutdown). A suspended device is left alone: its I/O was
    /// drained and its targets committed when it was suspended, a flush would wait at its
    /// gate forever, and it comes back suspended after the restart. So is a device built on
    /// a suspended one: its flush would wait at that gate (and the stop with it) for ever.
    pub fn flush_all(&self) {
        for device in self.all() {
            let name = device.name();
            if device.is_suspended() {
                info!("'{name}' is suspended: nothing to flush");
                continue;
            }
            if let Some(below) = self.suspended_under(&device.live()) {
                warn!(
                    "'{name}' is built on suspended '{below}': not flushed (writes it has not \
                     flushed yet may be lost)"
                );
                continue;
            }
            // The daemon is stopping: nothing may wait for a path that never comes back.
            device.live().presuspend(false);
            if let Err(e) = device.flush() {
                warn!("flushing '{name}' at shutdown: {e}");
            }
        }
    }

    fn refuse_if_held(&self, name: &str) -> Result<()> {
        let holders = self.holders(name);
        if holders.is_empty() {
            return Ok(());
        }
        Err(RegistryError::Busy(
            name.into(),
            format!("used by {}", holders.join(", ")),
        ))
    }

    /// dmsetup's `remove --deferred`: removes the device now if nothing uses it, otherwise
    /// once its last client lets go and no device is built on it any more. Until then it
    /// works as before; `message NAME 0 @cancel_deferred_remove` takes the request back.
    /// Returns whether it was removed at once.
    pub fn remove_deferred(self: &Arc<Self>, name: &str) -> Result<bool> {
        let device = self.get(name)?;
        if device.open_count() == 0 && self.holders(name).is_empty() {
            self.remove(name, false, Duration::ZERO)?;
            return Ok(true);
        }
        {
            let _changes = self.changes.lock();
            device.set_deferred_remove(true);
            self.save(&device)?;
        }
        info!(
            "device '{name}': will be removed once unused ({} client(s) and {} device(s) use it)",
            device.open_count(),
            self.holders(name).len()
        );
        self.watch_deferred(device);
        Ok(false)
    }

    /// Takes back a deferred removal.
    pub fn cancel_deferred_remove(&self, name: &str) -> Result<()> {
        let _changes = self.changes.lock();
        let device = self.get(name)?;
        if !device.deferred_remove() {
            return Err(RegistryError::Busy(
                name.into(),
                "no deferred removal to cancel".into(),
            ));
        }
        device.set_deferred_remove(false);
        self.save(&device)?;
        info!("device '{name}': deferred removal cancelled");
        Ok(())
    }

    /// Removes `device` once nothing uses it, unless the removal is cancelled or the device
    /// goes some other way first.
    pub(super) fn watch_deferred(self: &Arc<Self>, device: Arc<Device>) {
        let registry = self.clone();
        let spawned = std::thread::Builder::new()
            .name("deferred-remove".into())
            .spawn(move || loop {
                device.wait_released(DEFERRED_POLL);
                let name = device.name();
                let still_ours = registry
                    .get(&name)
                    .is_ok_and(|current| Arc::ptr_eq(&current, &device));
                if !still_ours || !device.deferred_remove() {
                    return;
                }
                if device.open_count() > 0 || !registry.holders(&name).is_empty() {
                    std::thread::sleep(DEFERRED_POLL);
                    continue;
                }
                match registry.remove(&name, false, Duration::ZERO) {
                    Ok(()) => return info!("device '{name}': deferred removal done"),
                    // A client came back between the look and the removal: wait again.
                    Err(RegistryError::Busy(..)) => continue,
                    Err(e) => return warn!("device '{name}': deferred removal failed: {e}"),
                }
            });
        if let Err(e) = spawned {
            warn!("cannot watch a deferred removal: {e}");
        }
    }

    /// dmsetup's `remove_all`: removes every device, those built on others first. Devices
    /// clients hold open are left (with `force`, their clients' I/O fails and they go too),
    /// and so are those below them; the error names each device left and why.
    pub fn remove_all(&self, force: bool) -> Result<usize> {
        let mut removed = 0;
        let mut refused: Vec<(String, String)> = Vec::new();
        loop {
            let tops: Vec<String> = self
                .all()
                .iter()
                .map(|d| d.name())
                .filter(|n| self.holders(n).is_empty() && !refused.iter().any(|(r, _)| r == n))
                .collect();
            if tops.is_empty() {
                break;
            }
            for name in tops {
                match self.remove(&name, force, Duration::ZERO) {
                    Ok(()) => removed += 1,
                    Err(e) => refused.push((name, e.to_string())),
                }
            }
        }
        let mut left: Vec<String> = refused.into_iter().map(|(_, why)| why).collect();
        for device in self.all() {
            let name = device.name();
            if !self.holders(&name).is_empty() {
                left.push(format!(
                    "device '{name}' is used by {}",
                    self.holders(&name).join(", ")
                ));
            }
        }
        if left.is_empty() {
            return Ok(removed);
        }
        Err(RegistryError::Incomplete(format!(
            "removed {removed} device(s); left {}",
            left.join("; ")
        )))
    }
}
