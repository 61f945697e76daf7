//! What replication (`udm send` / `udm receive`) needs from a live pool, found by its pool
//! device's name: the delta between two thin devices, and the metadata changes that make a
//! received volume appear at once. Data moves through `thin` targets like any other I/O.

use std::sync::Arc;

use udm_metadata::thin::{DeltaRun, DeviceInfo, ThinError};

use super::core::{Pool, POOLS};
use crate::target::TargetError;

/// A live pool.
pub struct PoolHandle(Arc<Pool>);

/// The pool of the device called `name`.
pub fn pool(name: &str) -> Result<PoolHandle, TargetError> {
    POOLS.get(name).map(PoolHandle).ok_or_else(|| {
        TargetError::new(format!(
            "'{name}' is not a thin-pool device (no thin-pool target is active on it)"
        ))
    })
}

impl PoolHandle {
    /// The pool's identity (its metadata's uuid), which a pool made again under the same
    /// name on new metadata does not share; None while a pool without one is read-only.
    pub fn identity(&self) -> Option<[u8; 16]> {
        self.0.meta().md.identity()
    }

    pub fn block_bytes(&self) -> u64 {
        self.0.block_bytes()
    }

    /// Whether new blocks are zeroed before a write that does not cover them whole (no
    /// `skip_block_zeroing`).
    pub fn zeroes_new_blocks(&self) -> bool {
        self.0.features().zero_new_blocks
    }

    pub fn device(&self, id: u32) -> Option<DeviceInfo> {
        self.0.device(id)
    }

    pub fn devices(&self) -> Vec<DeviceInfo> {
        self.0.meta().md.devices()
    }

    /// The highest mapped block of `id`, if it maps any.
    pub fn highest_mapped(&self, id: u32) -> Result<Option<u64>, TargetError> {
        self.0
            .meta()
            .md
            .highest_mapped(id)
            .map_err(|e| self.error(e))
    }

    /// The newest time among `id`'s mappings (see
    /// [`udm_metadata::ThinMetadata::newest_mapping_time`]).
    pub fn newest_mapping_time(&self, id: u32) -> Result<Option<u32>, TargetError> {
        self.0
            .meta()
            .md
            .newest_mapping_time(id)
            .map_err(|e| self.error(e))
    }

    /// The devices whose tables use thin device `id`.
    pub fn users_of(&self, id: u32) -> Vec<String> {
        self.0
            .users_of(id)
            .into_iter()
            .map(|(name, _)| name)
            .collect()
    }

    /// What differs from `from` (None: nothing) to `to`; see [`udm_metadata::ThinMetadata::delta`].
    pub fn delta(&self, from: Option<u32>, to: u32) -> Result<Vec<DeltaRun>, TargetError> {
        self.0.meta().md.delta(from, to).map_err(|e| self.error(e))
    }

    /// Creates empty thin device `id`.
    pub fn create_thin(&self, id: u32) -> Result<(), TargetError> {
        self.0
            .message(|meta| meta.md.create_thin(id), "create_thin")
    }

    /// Creates thin device `id` as a snapshot of `origin`, refused while a writable table
    /// uses `origin`: such a table may have writes in flight that the snapshot would half
    /// hold, and a base that is written is no longer the snapshot it was received as. The
    /// users stay held until the snapshot is taken, as the pool's `create_snap` holds them:
    /// no table of `origin` is made or resumed in between.
    pub fn create_snap(&self, id: u32, origin: u32) -> Result<(), TargetError> {
        let users = self.0.users();
        let writers = users.writers(origin);
        if let Some(first) = writers.first() {
            return Err(TargetError::new(format!(
                "thin device {origin} of pool '{}' is used by {}, writable: remove it or load \
                 it read-only first (udm remove {first})",
                self.0.name,
                writers.join(", ")
            )));
        }
        self.0
            .message(|meta| meta.md.create_snap(id, origin), "create_snap")
    }

    /// Seals thin device `id` (see [`udm_metadata::ThinMetadata::seal`]), committed: a write
    /// to it from then on maps a new block at a newer time. A pool message, so refused where
    /// the pool takes none (read-only, failed).
    pub fn seal(&self, id: u32) -> Result<(), TargetError> {
        self.0.message(|meta| meta.md.seal(id), "seal")
    }

    /// Keeps thin device `id` for the tables of device `owner` alone (a receive's staging
    /// device): another table is refused, saying that `id` is `what`. Until `id` is deleted
    /// or published.
    pub fn keep_private(&self, id: u32, owner: &str, what: &str) {
        self.0.set_private(id, Some((owner, what)));
    }

    /// Keeps thin device `id` from writable tables until the hold goes, while a send reads
    /// it through the tables of device `by` (see [`Pool::hold_sent`]).
    pub fn hold_sent(&self, id: u32, by: &str) -> Result<SentHold, TargetError> {
        self.0.hold_sent(id, by)?;
        Ok(SentHold {
            pool: self.0.clone(),
            id,
            by: by.to_string(),
        })
    }

    /// Lets any table use thin device `id` again (it was kept private for a device that was
    /// not made after all).
    pub fn end_private(&self, id: u32) {
        self.0.set_private(id, None);
    }

    /// Deletes thin device `id`, which no table may use.
    pub fn delete(&self, id: u32) -> Result<(), TargetError> {
        // Held until the device is gone, as the pool's `delete` holds them: a table of `id`
        // made in between would be left on a deleted device.
        let users = self.0.users();
        self.unused(id, users.of(id))?;
        self.0.message(|meta| meta.md.delete(id), "delete")?;
        self.0.set_private(id, None);
        Ok(())
    }

    /// Makes `staged` known as `id` in one commit: `id` becomes a snapshot of it, and `staged`
    /// goes. A crash leaves the one or the other, never both half. No device made later has
    /// `id`'s creation time. `id` is sealed, as any snapshot is made (see
    /// [`udm_metadata::ThinMetadata::seal`]): a write to it later maps a new block and shows
    /// in its stamp.
    pub fn publish(&self, staged: u32, id: u32) -> Result<(), TargetError> {
        // Held to the end, as in `delete`.
        let users = self.0.users();
        self.unused(staged, users.of(staged))?;
        self.0.message(
            |meta| {
                meta.md.create_snap(id, staged)?;
                meta.md.delete(staged)?;
                // A snapshot of `id`, dropped at once, moves the pool's time past `id`'s
                // creation time: `create_thin` takes the pool's current time, so an id made
                // again after a delete would otherwise carry the creation time that names
                // this received device, and pass for it as the base of the next stream.
                meta.md.create_snap(staged, id)?;
                meta.md.delete(staged)
            },
            "publish",
        )?;
        self.0.set_private(staged, None);
        Ok(())
    }

    /// Refuses `id` if `users` (its users, held) is not empty.
    fn unused(&self, id: u32, users: Vec<(String, bool)>) -> Result<(), TargetError> {
        let users: Vec<String> = users.into_iter().map(|(name, _)| name).collect();
        if users.is_empty() {
            return Ok(());
        }
        Err(TargetError::new(format!(
            "thin device {id} of pool '{}' is in use by {} (remove it first)",
            self.0.name,
            users.join(", ")
        )))
    }

    fn error(&self, e: ThinError) -> TargetError {
        TargetError::new(format!("thin-pool '{}': {e}", self.0.name))
    }
}

/// A thin device kept from writable tables for a send (see [`PoolHandle::hold_sent`]).
pub struct SentHold {
    pool: Arc<Pool>,
    id: u32,
    by: String,
}

impl Drop for SentHold {
    fn drop(&mut self) {
        self.pool.end_sent(self.id, &self.by);
    }
}
