//! The thin devices of a pool: creating, snapshotting and deleting them, their details, and
//! the pool's transaction id.

use super::btree::insert::insert as btree_insert;
use super::btree::remove::remove as btree_remove;
use super::btree::{del_tree, new_tree, ValueKind};
use super::error::corrupt;
use super::mapping;
use super::mapping::u64_of;
use super::{DeviceInfo, Result, ThinError, ThinMetadata, MAX_DEV_ID};

impl ThinMetadata {
    /// The pool's transaction id (userspace's, set by `set_transaction_id`).
    pub fn transaction_id(&self) -> u64 {
        self.sb.trans_id
    }

    /// Sets the transaction id to `new` if it is `old` now.
    pub fn set_transaction_id(&mut self, old: u64, new: u64) -> Result<()> {
        self.usable()?;
        if self.needs_check() {
            return Err(ThinError::NeedsCheck);
        }
        if self.sb.trans_id != old {
            return Err(ThinError::BadArgument(format!(
                "transaction id is {}, not {old}",
                self.sb.trans_id
            )));
        }
        self.sb.trans_id = new;
        Ok(())
    }

    fn check_new_id(&self, id: u32) -> Result<()> {
        if id > MAX_DEV_ID {
            return Err(ThinError::BadArgument(format!(
                "device id {id} is above the maximum {MAX_DEV_ID}"
            )));
        }
        if self.details.contains_key(&id) {
            return Err(ThinError::DeviceExists(id));
        }
        Ok(())
    }

    fn add_device(&mut self, id: u32, root: u64, mapped_blocks: u64) -> Result<()> {
        let (top, old) = btree_insert(
            &mut self.tm,
            self.sb.data_mapping_root,
            ValueKind::Subtree,
            id as u64,
            &root.to_le_bytes(),
        )?;
        self.sb.data_mapping_root = top;
        if old.is_some() {
            return Err(corrupt(
                top,
                format!("device {id} had a mapping tree but no details"),
            ));
        }
        self.details.insert(
            id,
            DeviceInfo {
                id,
                mapped_blocks,
                transaction_id: self.sb.trans_id,
                creation_time: self.sb.time,
                snapshotted_time: self.sb.time,
            },
        );
        self.roots.insert(id, root);
        self.changed.insert(id);
        Ok(())
    }

    /// Creates an empty thin device.
    pub fn create_thin(&mut self, id: u32) -> Result<()> {
        self.usable()?;
        self.check_new_id(id)?;
        self.change(|m| {
            let root = new_tree(&mut m.tm, ValueKind::Mapping)?;
            m.add_device(id, root, 0)
        })
    }

    /// Creates `id` as a snapshot of `origin`, which must not change meanwhile (the pool
    /// suspends it): the two share the origin's mapping tree, whose root gains a reference.
    /// The pool's time goes up, and both devices' snapshotted_time becomes it, so every
    /// mapping made so far reads as shared (K:`__create_snap`).
    pub fn create_snap(&mut self, id: u32, origin: u32) -> Result<()> {
        self.usable()?;
        self.check_new_id(id)?;
        let origin_info = self.info(origin)?;
        self.check_time_left()?;
        self.change(|m| {
            let root = m.root_of(origin)?;
            m.tm.inc(root)?;
            m.sb.time += 1;
            m.add_device(id, root, origin_info.mapped_blocks)?;
            m.mark_snapshotted(origin);
            Ok(())
        })
    }

    /// Whether `id` is sealed (see [`DeviceInfo::is_sealed`]). Reads every leaf of its tree.
    pub fn is_sealed(&mut self, id: u32) -> Result<bool> {
        let info = self.info(id)?;
        Ok(info.is_sealed(self.newest_mapping_time(id)?))
    }

    /// Seals `id` (see [`DeviceInfo::is_sealed`]) as a snapshot of it would, without one:
    /// the pool's time goes up and becomes the device's snapshotted_time, so its every
    /// mapping reads as shared (K:`__create_snap` does this to the origin). Replication seals
    /// what it sends, so that a write to it since changes what its mappings say. Costs one
    /// unit of the pool's time; a device already sealed is left as it is.
    pub fn seal(&mut self, id: u32) -> Result<()> {
        self.usable()?;
        if self.is_sealed(id)? {
            return Ok(());
        }
        self.check_time_left()?;
        self.change(|m| {
            m.sb.time += 1;
            m.mark_snapshotted(id);
            Ok(())
        })
    }

    /// Refuses to move the pool's time on when it has reached its last value.
    fn check_time_left(&self) -> Result<()> {
        if self.sb.time >= mapping::MAX_TIME {
            return Err(ThinError::BadArgument(
                "the pool's snapshot time is exhausted (2^24 snapshots)".into(),
            ));
        }
        Ok(())
    }

    /// `id` was snapshotted now: its mappings made so far read as shared.
    fn mark_snapshotted(&mut self, id: u32) {
        let time = self.sb.time;
        self.details.get_mut(&id).expect("device").snapshotted_time = time;
        self.changed.insert(id);
    }

    /// Deletes a thin device, dropping every data block only it mapped.
    pub fn delete(&mut self, id: u32) -> Result<()> {
        self.usable()?;
        self.info(id)?;
        self.change(|m| {
            let (top, old) = btree_remove(
                &mut m.tm,
                m.sb.data_mapping_root,
                ValueKind::Subtree,
                id as u64,
            )?;
            m.sb.data_mapping_root = top;
            let root = old.ok_or_else(|| {
                corrupt(top, format!("device {id} has details but no mapping tree"))
            })?;
            del_tree(&mut m.tm, u64_of(&root), ValueKind::Mapping)?;
            m.details.remove(&id);
            m.roots.remove(&id);
            m.changed.insert(id);
            Ok(())
        })
    }

    /// Every thin device, by id.
    pub fn devices(&self) -> Vec<DeviceInfo> {
        self.details.values().copied().collect()
    }

    pub fn device(&self, id: u32) -> Option<DeviceInfo> {
        self.details.get(&id).copied()
    }
}
