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
    pub fn block_bytes(&self) -> u64 {
        self.0.block_bytes()
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

    /// Creates thin device `id`: empty, or a snapshot of `origin` (which must not be live).
    pub fn create(&self, id: u32, origin: Option<u32>) -> Result<(), TargetError> {
        match origin {
            Some(origin) => self
                .0
                .message(|meta| meta.md.create_snap(id, origin), "create_snap"),
            None => self
                .0
                .message(|meta| meta.md.create_thin(id), "create_thin"),
        }
    }

    /// Deletes thin device `id`, which no table may use.
    pub fn delete(&self, id: u32) -> Result<(), TargetError> {
        self.unused(id)?;
        self.0.message(|meta| meta.md.delete(id), "delete")
    }

    /// Makes `staged` known as `id` in one commit: `id` becomes a snapshot of it, and `staged`
    /// goes. A crash leaves the one or the other, never both half.
    pub fn publish(&self, staged: u32, id: u32) -> Result<(), TargetError> {
        self.unused(staged)?;
        self.0.message(
            |meta| {
                meta.md.create_snap(id, staged)?;
                meta.md.delete(staged)
            },
            "publish",
        )
    }

    fn unused(&self, id: u32) -> Result<(), TargetError> {
        let users = self.users_of(id);
        if users.is_empty() {
            return Ok(());
        }
        Err(TargetError::new(format!(
            "thin device {id} of pool '{}' is in use by {}",
            self.0.name,
            users.join(", ")
        )))
    }

    fn error(&self, e: ThinError) -> TargetError {
        TargetError::new(format!("thin-pool '{}': {e}", self.0.name))
    }
}
