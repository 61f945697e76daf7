//! dm-thin's pool metadata, written as the kernel's `dm-thin-metadata.c` writes it, so that
//! thin-provisioning-tools (`thin_check`, `thin_dump`, `thin_restore`, …) work on udm's pools
//! and a pool written by udm can be activated by the kernel. `docs/thin-metadata.md` describes
//! the format as udm uses it, byte by byte, with the kernel and tools sources it follows.
//!
//! One file per job: [`checksum`] (crc32c and salts), [`superblock`], [`btree`] (node layout,
//! lookup, insert, remove), [`space_map`] (bitmaps, index, the data and metadata maps),
//! [`cache`] (blocks in memory), [`transaction`] (shadowing, allocation, two-phase commit),
//! [`mapping`] (the two-level mapping tree), [`details`]; this file is the pool's API.

mod btree;
mod cache;
pub mod checksum;
mod delta;
mod details;
mod error;
mod mapping;
mod space_map;
mod superblock;
mod transaction;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use udm_block::BlockDevice;

use self::btree::insert::insert as btree_insert;
use self::btree::lookup::{last_key, lookup as btree_lookup, walk};
use self::btree::remove::remove as btree_remove;
use self::btree::{del_tree, new_tree, ValueKind};
use self::cache::NumberMap;
use self::checksum::Kind;
use self::error::corrupt;
use self::mapping::{insert_mapping, pack, remove_mapping, unpack, MAX_DATA_BLOCKS};
use self::space_map::index::MAX_METADATA_BITMAPS;
use self::space_map::{bitmap::ENTRIES_PER_BITMAP, disk, metadata};
use self::superblock::{
    Superblock, METADATA_BLOCK_SECTORS, NEEDS_CHECK, SUPERBLOCK_LOCATION, VERSION,
};
use self::transaction::{metadata_reserve, Tm};

pub use self::delta::{DeltaRun, Side};
pub use self::details::DeviceInfo;
pub use self::error::ThinError;

type Result<T, E = ThinError> = std::result::Result<T, E>;

/// The most metadata blocks a pool uses (K:`DM_SM_METADATA_MAX_BLOCKS`, 255 bitmaps of
/// 16,320): 15.9 GiB; the rest of a larger metadata device is left alone.
pub const MAX_METADATA_BLOCKS: u64 = MAX_METADATA_BITMAPS as u64 * ENTRIES_PER_BITMAP;
/// Thin device ids have 24 bits (K:`MAX_DEV_ID` in dm-thin.c).
pub const MAX_DEV_ID: u32 = (1 << 24) - 1;
/// Data block sizes the pool accepts, in sectors: 64 KiB to 1 GiB in steps of 64 KiB.
pub const MIN_DATA_BLOCK_SECTORS: u32 = 128;
pub const MAX_DATA_BLOCK_SECTORS: u32 = 2_097_152;

/// Where a thin device's virtual block lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapping {
    pub data_block: u64,
    /// The mapping was made before the device's last snapshot, so another device may share
    /// the block (`dm_thin_find_block`'s time-based answer): a write must break sharing.
    pub shared: bool,
}

/// Used and total blocks of a space map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub used: u64,
    pub total: u64,
}

/// The pool metadata: the details of every thin device, their mappings, and the reference
/// counts of data and metadata blocks. Not internally locked: the pool wraps it in a Mutex.
///
/// Changes build up a transaction in memory (new blocks are written only by `commit`); the
/// metadata on disk is always the last commit. After an error from a change other than a
/// refused argument (`NoSuchDevice`, `DeviceExists`, `BadArgument`), the transaction is
/// unusable: every call but `abort` (and `set_needs_check`) fails with `Aborting`.
pub struct ThinMetadata {
    tm: Tm,
    /// The superblock the next commit writes.
    sb: Superblock,
    /// The superblock of the last commit.
    committed: Superblock,
    details: BTreeMap<u32, DeviceInfo>,
    /// The root of each device's tree (also in the top level, which the hot path skips).
    roots: NumberMap<u32, u64>,
    /// Devices whose details changed (or which were deleted) since the last commit.
    changed: BTreeSet<u32>,
    failed: Option<String>,
}

impl std::fmt::Debug for ThinMetadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThinMetadata")
            .field("transaction_id", &self.sb.trans_id)
            .field("devices", &self.details.len())
            .field("data", &self.data_usage())
            .field("metadata", &self.metadata_usage())
            .field("failed", &self.failed)
            .finish()
    }
}

fn u64_of(v: &[u8]) -> u64 {
    u64::from_le_bytes(v[..8].try_into().unwrap())
}

impl ThinMetadata {
    /// Opens the pool metadata on `dev`; formats a new pool when the superblock block is all
    /// zeroes (as the kernel does). Refuses a data block size that differs from the
    /// superblock's, a bad checksum, a needs_check flag (with a clear error naming
    /// thin_check/thin_repair). A data device larger than the recorded one grows the pool (and
    /// a larger metadata device its metadata space), committed at once; a smaller one is
    /// refused.
    pub fn open(
        dev: Arc<dyn BlockDevice>,
        data_block_sectors: u32,
        nr_data_blocks: u64,
    ) -> Result<Self> {
        if !(MIN_DATA_BLOCK_SECTORS..=MAX_DATA_BLOCK_SECTORS).contains(&data_block_sectors)
            || !data_block_sectors.is_multiple_of(MIN_DATA_BLOCK_SECTORS)
        {
            return Err(ThinError::BadArgument(format!(
                "data block size {data_block_sectors} sectors: must be a multiple of 128 \
                 (64 KiB) from 128 to 2097152 (1 GiB)"
            )));
        }
        if nr_data_blocks > MAX_DATA_BLOCKS {
            return Err(ThinError::BadArgument(format!(
                "{nr_data_blocks} data blocks: dm-thin addresses at most 2^40"
            )));
        }
        let mut tm = Tm::new(dev);
        let block0 = tm.cache.read_raw(SUPERBLOCK_LOCATION)?;
        if block0.iter().all(|&b| b == 0) {
            return Self::format(tm, data_block_sectors, nr_data_blocks);
        }
        let sb = Superblock::decode(SUPERBLOCK_LOCATION, &block0[..])?;
        sb.check_features()?;
        if sb.data_block_size != data_block_sectors {
            return Err(ThinError::BadArgument(format!(
                "data block size {data_block_sectors} sectors differs from the pool metadata's {}",
                sb.data_block_size
            )));
        }
        if sb.flags & NEEDS_CHECK != 0 {
            return Err(ThinError::NeedsCheck);
        }
        let (details, roots) = load(&mut tm, &sb)?;
        let mut meta = ThinMetadata {
            tm,
            committed: sb.clone(),
            sb,
            details,
            roots,
            changed: BTreeSet::new(),
            failed: None,
        };
        let recorded = meta.tm.dsm.nr_blocks();
        if nr_data_blocks < recorded {
            return Err(ThinError::BadArgument(format!(
                "the data device has {nr_data_blocks} blocks, fewer than the pool's {recorded}: \
                 pools do not shrink"
            )));
        }
        let metadata_blocks = meta.tm.cache.dev_blocks().min(MAX_METADATA_BLOCKS);
        if nr_data_blocks > recorded || metadata_blocks > meta.tm.msm.nr_blocks() {
            meta.tm.dsm.extend(nr_data_blocks);
            meta.tm
                .msm
                .extend(metadata_blocks.max(meta.tm.msm.nr_blocks()));
            meta.commit()?;
        }
        Ok(meta)
    }

    /// Writes a new, empty pool (K:`__format_metadata`).
    fn format(mut tm: Tm, data_block_sectors: u32, nr_data_blocks: u64) -> Result<Self> {
        let nr_blocks = tm.cache.dev_blocks().min(MAX_METADATA_BLOCKS);
        tm.set_committing(true);
        tm.msm.extend(nr_blocks);
        let built = (|| -> Result<Superblock> {
            tm.msm.set(SUPERBLOCK_LOCATION, 1, &mut tm.cache)?;
            tm.msm.ref_count_root = new_tree(&mut tm, ValueKind::RefCount)?;
            tm.dsm.bitmap_root = new_tree(&mut tm, ValueKind::Index)?;
            tm.dsm.ref_count_root = new_tree(&mut tm, ValueKind::RefCount)?;
            tm.dsm.extend(nr_data_blocks);
            Ok(Superblock {
                flags: 0,
                uuid: [0; 16],
                version: VERSION,
                time: 0,
                trans_id: 0,
                held_root: 0,
                data_sm: Default::default(),
                metadata_sm: Default::default(),
                data_mapping_root: new_tree(&mut tm, ValueKind::Subtree)?,
                device_details_root: new_tree(&mut tm, ValueKind::Details)?,
                data_block_size: data_block_sectors,
                metadata_block_size: METADATA_BLOCK_SECTORS,
                metadata_nr_blocks: nr_blocks,
                compat_flags: 0,
                compat_ro_flags: 0,
                incompat_flags: 0,
            })
        })();
        let too_small = |e: ThinError| match e {
            ThinError::MetadataFull | ThinError::Corrupt { .. } => ThinError::BadArgument(format!(
                "metadata device of {nr_blocks} blocks is too small for a pool of \
                     {nr_data_blocks} data blocks"
            )),
            e => e,
        };
        let sb = built.map_err(too_small)?;
        tm.set_committing(false);
        let mut meta = ThinMetadata {
            tm,
            committed: sb.clone(),
            sb,
            details: BTreeMap::new(),
            roots: NumberMap::default(),
            changed: BTreeSet::new(),
            failed: None,
        };
        meta.commit().map_err(too_small)?;
        Ok(meta)
    }

    fn usable(&self) -> Result<()> {
        match &self.failed {
            Some(why) => Err(ThinError::Aborting(why.clone())),
            None => Ok(()),
        }
    }

    /// Runs a change; an error leaves the transaction half done, so it must be aborted.
    fn change<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        self.usable()?;
        let out = f(self).and_then(|out| {
            disk::place_changed_bitmaps(&mut self.tm)?;
            Ok(out)
        });
        if let Err(e) = &out {
            self.failed = Some(e.to_string());
        }
        out
    }

    fn info(&self, id: u32) -> Result<DeviceInfo> {
        self.details
            .get(&id)
            .copied()
            .ok_or(ThinError::NoSuchDevice(id))
    }

    fn root_of(&self, id: u32) -> Result<u64> {
        self.roots.get(&id).copied().ok_or_else(|| {
            corrupt(
                self.sb.data_mapping_root,
                format!("device {id} has details but no mapping tree"),
            )
        })
    }

    /// The pool's transaction id (userspace's, set by `set_transaction_id`).
    pub fn transaction_id(&self) -> u64 {
        self.sb.trans_id
    }

    /// Sets the transaction id to `new` if it is `old` now.
    pub fn set_transaction_id(&mut self, old: u64, new: u64) -> Result<()> {
        self.usable()?;
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
        if self.sb.time >= mapping::MAX_TIME {
            return Err(ThinError::BadArgument(
                "the pool's snapshot time is exhausted (2^24 snapshots)".into(),
            ));
        }
        self.change(|m| {
            let root = m.root_of(origin)?;
            m.tm.inc(root)?;
            m.sb.time += 1;
            m.add_device(id, root, origin_info.mapped_blocks)?;
            let time = m.sb.time;
            m.details.get_mut(&origin).expect("origin").snapshotted_time = time;
            m.changed.insert(origin);
            Ok(())
        })
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

    /// Where `vblock` of device `id` lives, if it is mapped. Served from memory once warm.
    pub fn lookup(&mut self, id: u32, vblock: u64) -> Result<Option<Mapping>> {
        self.usable()?;
        let info = self.info(id)?;
        let root = self.root_of(id)?;
        let value = btree_lookup(&mut self.tm.cache, root, ValueKind::Mapping, vblock, u64_of)?;
        Ok(value.map(|v| {
            let (data_block, time) = unpack(v);
            Mapping {
                data_block,
                shared: info.snapshotted_time > time,
            }
        }))
    }

    /// Mapped runs in `[begin, end)`: (vblock, data_block, len, shared), both block numbers
    /// consecutive within a run.
    pub fn lookup_range(
        &mut self,
        id: u32,
        begin: u64,
        end: u64,
    ) -> Result<Vec<(u64, u64, u64, bool)>> {
        self.usable()?;
        let info = self.info(id)?;
        let root = self.root_of(id)?;
        let mut runs: Vec<(u64, u64, u64, bool)> = Vec::new();
        walk(
            &mut self.tm.cache,
            root,
            ValueKind::Mapping,
            begin,
            Some(end),
            &mut |vblock, v| {
                let (data_block, time) = unpack(u64_of(v));
                let shared = info.snapshotted_time > time;
                match runs.last_mut() {
                    Some((vb, db, len, sh))
                        if *vb + *len == vblock && *db + *len == data_block && *sh == shared =>
                    {
                        *len += 1
                    }
                    _ => runs.push((vblock, data_block, 1, shared)),
                }
                Ok(())
            },
        )?;
        Ok(runs)
    }

    /// Allocates a free data block (reference count 1, which `insert` hands to the mapping);
    /// None: data space full. Never a block that is free only since the last commit.
    pub fn alloc_data_block(&mut self) -> Result<Option<u64>> {
        self.change(|m| m.tm.dsm.alloc(&mut m.tm.cache))
    }

    /// Gives back a block from `alloc_data_block` that will not be inserted (its data write
    /// failed, or the request went away): its reference is dropped, and a block allocated in
    /// this transaction is the next one allocated.
    pub fn release_data_block(&mut self, data_block: u64) -> Result<()> {
        self.usable()?;
        if self.tm.dsm.count(data_block, &mut self.tm.cache)? == 0 {
            return Err(ThinError::BadArgument(format!(
                "data block {data_block} is not allocated"
            )));
        }
        self.change(|m| m.tm.dsm.dec(data_block, &mut m.tm.cache).map(drop))
    }

    /// Maps `vblock` of `id` to `data_block` (allocated by `alloc_data_block`, whose reference
    /// the mapping takes over) at the pool's current time; an old mapping to another block is
    /// replaced and that block decremented.
    pub fn insert(&mut self, id: u32, vblock: u64, data_block: u64) -> Result<()> {
        self.usable()?;
        self.info(id)?;
        if data_block >= self.tm.dsm.nr_blocks() {
            return Err(ThinError::BadArgument(format!(
                "data block {data_block} is beyond the data device ({} blocks)",
                self.tm.dsm.nr_blocks()
            )));
        }
        self.change(|m| {
            let value = pack(data_block, m.sb.time);
            let (roots, old) =
                insert_mapping(&mut m.tm, m.sb.data_mapping_root, id, vblock, value)?;
            m.sb.data_mapping_root = roots.top;
            m.roots.insert(id, roots.device);
            match old.map(unpack) {
                None => m.details.get_mut(&id).expect("device").mapped_blocks += 1,
                Some((old_block, _)) if old_block != data_block => {
                    m.tm.dsm.dec(old_block, &mut m.tm.cache)?;
                }
                Some(_) => {}
            }
            m.changed.insert(id);
            Ok(())
        })
    }

    /// Unmaps `vblock` of `id`; Some(data block) if that block became free (refcount 0).
    pub fn remove(&mut self, id: u32, vblock: u64) -> Result<Option<u64>> {
        self.usable()?;
        self.info(id)?;
        self.change(|m| {
            let root = m.root_of(id)?;
            let (roots, old) = remove_mapping(&mut m.tm, m.sb.data_mapping_root, id, vblock, root)?;
            m.sb.data_mapping_root = roots.top;
            m.roots.insert(id, roots.device);
            let Some((data_block, _)) = old.map(unpack) else {
                return Ok(None);
            };
            let info = m.details.get_mut(&id).expect("device");
            info.mapped_blocks = info.mapped_blocks.saturating_sub(1);
            m.changed.insert(id);
            let left = m.tm.dsm.dec(data_block, &mut m.tm.cache)?;
            Ok((left == 0).then_some(data_block))
        })
    }

    /// How many mappings (or allocations) hold `data_block`. A block mapped by several
    /// devices through a tree node they share counts once.
    pub fn data_ref_count(&mut self, data_block: u64) -> Result<u32> {
        self.usable()?;
        self.tm.dsm.count(data_block, &mut self.tm.cache)
    }

    /// The highest mapped virtual block of `id`, if any.
    pub fn highest_mapped(&mut self, id: u32) -> Result<Option<u64>> {
        self.usable()?;
        self.info(id)?;
        let root = self.root_of(id)?;
        last_key(&mut self.tm.cache, root, ValueKind::Mapping)
    }

    /// Data blocks in use and in all; exact, counts uncommitted allocations.
    pub fn data_usage(&self) -> Usage {
        Usage {
            used: self.tm.dsm.nr_allocated(),
            total: self.tm.dsm.nr_blocks(),
        }
    }

    /// Metadata blocks in use and in all, as the kernel's pool status counts them: the blocks
    /// kept back for commits (a tenth of the device, at most 4096) count as used.
    pub fn metadata_usage(&self) -> Usage {
        let total = self.tm.msm.nr_blocks();
        let free = self
            .tm
            .msm
            .nr_free()
            .saturating_sub(metadata_reserve(total));
        Usage {
            used: total - free,
            total,
        }
    }

    /// Grows the data space to `nr_data_blocks` (shrinking is refused).
    pub fn resize_data(&mut self, nr_data_blocks: u64) -> Result<()> {
        self.usable()?;
        let now = self.tm.dsm.nr_blocks();
        if nr_data_blocks < now || nr_data_blocks > MAX_DATA_BLOCKS {
            return Err(ThinError::BadArgument(format!(
                "cannot resize the data space from {now} to {nr_data_blocks} blocks: \
                 it only grows, up to 2^40"
            )));
        }
        // The new bitmaps take their blocks now: a growth too large for the metadata fails
        // here, not in the commit.
        self.change(|m| {
            m.tm.dsm.extend(nr_data_blocks);
            Ok(())
        })
    }

    /// Grows the metadata space onto `dev`, the metadata device opened again after it grew
    /// (K:`dm_pool_resize_metadata_dev`): the new blocks are the pool's from the next
    /// commit on. A device smaller than the metadata space is refused.
    pub fn resize_metadata(&mut self, dev: Arc<dyn BlockDevice>) -> Result<()> {
        self.usable()?;
        let now = self.tm.msm.nr_blocks();
        let blocks = (dev.size() / crate::BLOCK_SIZE as u64).min(MAX_METADATA_BLOCKS);
        if blocks < now {
            return Err(ThinError::BadArgument(format!(
                "the metadata device has {blocks} blocks, fewer than the pool's {now}: \
                 metadata devices do not shrink"
            )));
        }
        self.tm.cache.grow_device(dev);
        // The new bitmaps find their blocks at commit, in the space they add.
        self.change(|m| {
            m.tm.msm.extend(blocks);
            Ok(())
        })
    }

    /// Takes a metadata snapshot (K:`__reserve_metadata_snap`): commits, then copies the
    /// superblock to a new block whose trees stay as they are now, for `thin_dump -m` and
    /// `thin_delta -m` while the pool runs. The next commit records it (`held_root`).
    pub fn reserve_metadata_snap(&mut self) -> Result<()> {
        self.usable()?;
        if self.sb.held_root != 0 {
            return Err(ThinError::BadArgument(format!(
                "a metadata snapshot is already held (block {}): release it first",
                self.sb.held_root
            )));
        }
        self.commit()?;
        self.change(|m| {
            let copy = m.tm.alloc()?;
            let mut snap = m.committed.clone();
            snap.data_sm = Default::default();
            snap.metadata_sm = Default::default();
            m.tm.cache
                .put(copy, Kind::Superblock, Arc::from(snap.encode(copy)));
            m.tm.inc(snap.data_mapping_root)?;
            m.tm.inc(snap.device_details_root)?;
            m.sb.held_root = copy;
            Ok(())
        })
    }

    /// Drops the metadata snapshot and what only it kept (K:`__release_metadata_snap`); the
    /// next commit records it.
    pub fn release_metadata_snap(&mut self) -> Result<()> {
        self.usable()?;
        let held = self.sb.held_root;
        if held == 0 {
            return Err(ThinError::BadArgument(
                "no metadata snapshot is held".into(),
            ));
        }
        self.change(|m| {
            let block = m.tm.cache.read(held, Kind::Superblock)?;
            let snap = Superblock::decode(held, &block[..])?;
            del_tree(&mut m.tm, snap.data_mapping_root, ValueKind::Subtree)?;
            del_tree(&mut m.tm, snap.device_details_root, ValueKind::Details)?;
            m.tm.dec(held)?;
            m.sb.held_root = 0;
            Ok(())
        })
    }

    /// The metadata snapshot's block, if one is held (the pool status's held root).
    pub fn held_root(&self) -> Option<u64> {
        (self.sb.held_root != 0).then_some(self.sb.held_root)
    }

    pub fn needs_check(&self) -> bool {
        self.sb.flags & NEEDS_CHECK != 0
    }

    /// Sets the needs_check flag in the superblock of the last commit and writes it at once,
    /// without committing what changed since (after an error that may be the damage). The pool
    /// will not open until `thin_check --clear-needs-check-flag` passes.
    pub fn set_needs_check(&mut self) -> Result<()> {
        self.sb.flags |= NEEDS_CHECK;
        self.committed.flags |= NEEDS_CHECK;
        let block = self.committed.encode(SUPERBLOCK_LOCATION);
        self.tm.cache.write_now(SUPERBLOCK_LOCATION, &block)
    }

    fn has_changes(&self) -> bool {
        self.tm.cache.has_dirty()
            || !self.changed.is_empty()
            || self.sb != self.committed
            || self.tm.dsm.nr_blocks() != self.committed.data_sm.nr_blocks
            || self.tm.msm.nr_blocks() != self.committed.metadata_sm.nr_blocks
            || [&self.tm.dsm, &self.tm.msm]
                .iter()
                .any(|sm| sm.bitmaps.iter().any(|b| b.dirty) || !sm.overflow_dirty.is_empty())
    }

    /// Makes everything since the last commit durable (dm's two-phase commit,
    /// K:`__commit_transaction`); the caller has flushed the data device first. A crash before
    /// it returns leaves the previous commit. A commit with nothing to do writes nothing.
    pub fn commit(&mut self) -> Result<()> {
        self.usable()?;
        if !self.has_changes() {
            return Ok(());
        }
        self.tm.set_committing(true);
        let out = self.write_transaction();
        self.tm.set_committing(false);
        if let Err(e) = &out {
            self.failed = Some(e.to_string());
        }
        out
    }

    fn write_transaction(&mut self) -> Result<()> {
        let mut root = self.sb.device_details_root;
        for id in std::mem::take(&mut self.changed) {
            root = match self.details.get(&id) {
                Some(info) => {
                    let value = info.encode();
                    btree_insert(&mut self.tm, root, ValueKind::Details, id as u64, &value)?.0
                }
                None => btree_remove(&mut self.tm, root, ValueKind::Details, id as u64)?.0,
            };
        }
        self.sb.device_details_root = root;
        disk::commit(&mut self.tm)?;
        metadata::commit(&mut self.tm)?;
        self.sb.data_sm = self.tm.dsm.root();
        self.sb.metadata_sm = self.tm.msm.root();
        self.tm.write_commit(&self.sb)?;
        self.committed = self.sb.clone();
        Ok(())
    }

    /// Drops everything since the last commit (metadata back to the committed state, read
    /// again from the device).
    pub fn abort(&mut self) -> Result<()> {
        let block0 = self.tm.cache.read_raw(SUPERBLOCK_LOCATION)?;
        let sb = Superblock::decode(SUPERBLOCK_LOCATION, &block0[..])?;
        self.tm.cache.discard_dirty();
        (self.details, self.roots) = load(&mut self.tm, &sb)?;
        self.committed = sb.clone();
        self.sb = sb;
        self.changed.clear();
        self.failed = None;
        Ok(())
    }

    /// The data block size, in sectors.
    pub fn data_block_sectors(&self) -> u32 {
        self.sb.data_block_size
    }

    /// Metadata blocks read from the device so far (a warm lookup reads none).
    pub fn disk_reads(&self) -> u64 {
        self.tm.cache.disk_reads()
    }

    /// Bounds the clean metadata blocks kept in memory (default 65,536: 256 MiB).
    pub fn set_cache_blocks(&mut self, blocks: usize) {
        self.tm.cache.set_capacity(blocks);
    }
}

/// The devices' details and the roots of their trees.
type Devices = (BTreeMap<u32, DeviceInfo>, NumberMap<u32, u64>);

/// Reads the committed state named by `sb` into `tm`: both space maps; and the device details
/// and the roots of the devices' trees, checked against each other.
fn load(tm: &mut Tm, sb: &Superblock) -> Result<Devices> {
    let dev_blocks = tm.cache.dev_blocks();
    if sb.metadata_sm.nr_blocks > dev_blocks {
        return Err(corrupt(
            SUPERBLOCK_LOCATION,
            format!(
                "the metadata space map counts {} blocks, the device has {dev_blocks} \
                 (truncated?)",
                sb.metadata_sm.nr_blocks
            ),
        ));
    }
    tm.msm = metadata::open(&mut tm.cache, &sb.metadata_sm)?;
    tm.dsm = disk::open(&mut tm.cache, &sb.data_sm)?;
    let mut details = BTreeMap::new();
    walk(
        &mut tm.cache,
        sb.device_details_root,
        ValueKind::Details,
        0,
        None,
        &mut |id, v| {
            let id32 = u32::try_from(id)
                .map_err(|_| corrupt(sb.device_details_root, format!("device id {id}")))?;
            details.insert(id32, DeviceInfo::decode(id32, v));
            Ok(())
        },
    )?;
    let mut with_trees = Vec::with_capacity(details.len());
    walk(
        &mut tm.cache,
        sb.data_mapping_root,
        ValueKind::Subtree,
        0,
        None,
        &mut |id, v| {
            with_trees.push((id, u64_of(v)));
            Ok(())
        },
    )?;
    if !with_trees
        .iter()
        .map(|&(id, _)| id)
        .eq(details.keys().map(|&id| id as u64))
    {
        return Err(corrupt(
            sb.data_mapping_root,
            "the devices of the mapping tree and of the details tree differ",
        ));
    }
    let roots = with_trees
        .into_iter()
        .map(|(id, root)| (id as u32, root))
        .collect();
    Ok((details, roots))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BLOCK_SIZE;
    use std::sync::atomic::{AtomicU64, Ordering};
    use udm_block::{MemoryDevice, WriteFlags};

    /// A memory device that counts writes.
    struct Counting(MemoryDevice, AtomicU64);

    impl BlockDevice for Counting {
        fn size(&self) -> u64 {
            self.0.size()
        }
        fn read(&self, offset: u64, buf: &mut [u8]) -> udm_block::Result<()> {
            self.0.read(offset, buf)
        }
        fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> udm_block::Result<()> {
            self.1.fetch_add(1, Ordering::SeqCst);
            self.0.write(offset, buf, flags)
        }
        fn flush(&self) -> udm_block::Result<()> {
            Ok(())
        }
    }

    fn device() -> Arc<Counting> {
        Arc::new(Counting(MemoryDevice::new(8 << 20), AtomicU64::new(0)))
    }

    fn map_new(meta: &mut ThinMetadata, id: u32, vblock: u64) -> u64 {
        let b = meta.alloc_data_block().unwrap().unwrap();
        meta.insert(id, vblock, b).unwrap();
        b
    }

    #[test]
    fn the_pool_can_move_between_threads() {
        fn send<T: Send>() {}
        send::<ThinMetadata>();
    }

    #[test]
    fn warm_lookups_read_nothing_from_disk() {
        let dev = device();
        let mut meta = ThinMetadata::open(dev.clone(), 128, 100_000).unwrap();
        meta.create_thin(1).unwrap();
        for vb in 0..20_000 {
            map_new(&mut meta, 1, vb * 2);
        }
        meta.commit().unwrap();
        let mut meta = ThinMetadata::open(dev, 128, 100_000).unwrap();
        for vb in 0..20_000 {
            assert!(meta.lookup(1, vb * 2).unwrap().is_some());
        }
        let warm = meta.disk_reads();
        for vb in 0..40_000 {
            assert_eq!(meta.lookup(1, vb).unwrap().is_some(), vb % 2 == 0);
        }
        assert_eq!(meta.disk_reads(), warm, "warm lookups went to the disk");
    }

    #[test]
    fn a_tree_of_three_levels_splits_its_inner_nodes() {
        // 200,000 mappings fill more than 252 × 252 / 2 leaves' worth: the inner nodes under
        // the root fill up and split (an empty new inner node was once refused as corrupt).
        let dev = Arc::new(MemoryDevice::new(64 << 20));
        let mut meta = ThinMetadata::open(dev.clone(), 128, 400_000).unwrap();
        meta.create_thin(1).unwrap();
        let blocks: Vec<u64> = (0..200_000).map(|vb| map_new(&mut meta, 1, vb)).collect();
        meta.commit().unwrap();
        let mut meta = ThinMetadata::open(dev, 128, 400_000).unwrap();
        for (vb, block) in blocks.iter().enumerate() {
            assert_eq!(
                meta.lookup(1, vb as u64).unwrap().unwrap().data_block,
                *block
            );
        }
    }

    #[test]
    fn freed_blocks_do_not_crowd_live_ones_out_of_the_cache() {
        let mut meta = ThinMetadata::open(device(), 128, 100_000).unwrap();
        meta.set_cache_blocks(1000);
        meta.create_thin(1).unwrap();
        // Random inserts copy a leaf each, commit after commit: thousands of freed blocks.
        let order = |i: u64| (i * 7919) % 60_000;
        for i in 0..60_000 {
            map_new(&mut meta, 1, order(i));
            if i % 1000 == 999 {
                meta.commit().unwrap();
            }
        }
        assert!(
            meta.metadata_usage().used < 1000,
            "the live metadata fits the cache"
        );
        for i in 0..60_000 {
            meta.lookup(1, order(i)).unwrap();
        }
        let warm = meta.disk_reads();
        for i in 0..60_000 {
            meta.lookup(1, order(i)).unwrap();
        }
        assert_eq!(meta.disk_reads(), warm);
    }

    #[test]
    fn refused_arguments_leave_the_transaction_usable() {
        let mut meta = ThinMetadata::open(device(), 128, 1000).unwrap();
        assert!(matches!(
            ThinMetadata::open(device(), 100, 1000),
            Err(ThinError::BadArgument(_))
        ));
        meta.create_thin(1).unwrap();
        assert_eq!(meta.create_thin(1), Err(ThinError::DeviceExists(1)));
        assert_eq!(meta.create_snap(1, 1), Err(ThinError::DeviceExists(1)));
        assert_eq!(meta.create_snap(2, 7), Err(ThinError::NoSuchDevice(7)));
        assert_eq!(meta.delete(7), Err(ThinError::NoSuchDevice(7)));
        assert_eq!(meta.lookup(7, 0), Err(ThinError::NoSuchDevice(7)));
        assert!(matches!(
            meta.create_thin(1 << 24),
            Err(ThinError::BadArgument(_))
        ));
        assert!(matches!(
            meta.insert(1, 0, 1000),
            Err(ThinError::BadArgument(_))
        ));
        assert!(matches!(
            meta.set_transaction_id(3, 4),
            Err(ThinError::BadArgument(_))
        ));
        assert!(matches!(
            meta.resize_data(999),
            Err(ThinError::BadArgument(_))
        ));
        assert!(matches!(
            meta.release_metadata_snap(),
            Err(ThinError::BadArgument(_))
        ));
        meta.set_transaction_id(0, 4).unwrap();
        map_new(&mut meta, 1, 0);
        meta.commit().unwrap();
        assert_eq!(meta.transaction_id(), 4);
    }

    #[test]
    fn sharing_follows_snapshot_time_and_blocks_free_when_the_last_user_goes() {
        let mut meta = ThinMetadata::open(device(), 128, 1000).unwrap();
        meta.create_thin(1).unwrap();
        let old = map_new(&mut meta, 1, 5);
        assert!(!meta.lookup(1, 5).unwrap().unwrap().shared);
        meta.create_snap(2, 1).unwrap();
        let origin = meta.device(1).unwrap();
        let snap = meta.device(2).unwrap();
        assert_eq!((origin.snapshotted_time, snap.creation_time), (1, 1));
        assert_eq!(snap.mapped_blocks, 1);
        assert!(meta.lookup(1, 5).unwrap().unwrap().shared);
        assert!(meta.lookup(2, 5).unwrap().unwrap().shared);
        // A write to the origin breaks sharing: new block, new time.
        let new = map_new(&mut meta, 1, 5);
        assert_eq!(
            meta.lookup(1, 5).unwrap(),
            Some(Mapping {
                data_block: new,
                shared: false
            })
        );
        assert_eq!(meta.lookup(2, 5).unwrap().unwrap().data_block, old);
        assert_eq!(meta.data_ref_count(old).unwrap(), 1);
        assert_eq!(meta.remove(2, 5).unwrap(), Some(old), "the last user");
        assert_eq!(meta.remove(2, 5).unwrap(), None, "not mapped");
        // A block shared through a common leaf counts once; deleting one device keeps it.
        meta.create_snap(3, 1).unwrap();
        assert_eq!(meta.data_ref_count(new).unwrap(), 1);
        meta.delete(1).unwrap();
        assert_eq!(meta.lookup(3, 5).unwrap().unwrap().data_block, new);
        assert_eq!(meta.data_ref_count(new).unwrap(), 1);
        assert_eq!(meta.data_usage().used, 1);
        meta.delete(3).unwrap();
        assert_eq!(meta.data_usage().used, 0);
    }

    #[test]
    fn released_and_aborted_blocks_come_back() {
        let mut meta = ThinMetadata::open(device(), 128, 1000).unwrap();
        meta.create_thin(1).unwrap();
        meta.commit().unwrap();
        let a = meta.alloc_data_block().unwrap().unwrap();
        let b = meta.alloc_data_block().unwrap().unwrap();
        meta.release_data_block(a).unwrap();
        assert!(
            meta.release_data_block(a).is_err(),
            "not allocated any more"
        );
        assert_eq!(meta.alloc_data_block().unwrap(), Some(a));
        meta.insert(1, 0, a).unwrap();
        meta.insert(1, 1, b).unwrap();
        assert_eq!(meta.data_usage().used, 2);
        meta.abort().unwrap();
        assert_eq!(meta.data_usage().used, 0);
        assert_eq!(meta.device(1).unwrap().mapped_blocks, 0);
        assert_eq!(meta.lookup(1, 0).unwrap(), None);
        // A block freed after a commit waits for the next one.
        let c = map_new(&mut meta, 1, 0);
        meta.commit().unwrap();
        assert_eq!(meta.remove(1, 0).unwrap(), Some(c));
        assert_ne!(meta.alloc_data_block().unwrap(), Some(c));
    }

    #[test]
    fn a_commit_with_nothing_new_writes_nothing() {
        let dev = device();
        let mut meta = ThinMetadata::open(dev.clone(), 128, 1000).unwrap();
        meta.create_thin(1).unwrap();
        meta.commit().unwrap();
        let writes = dev.1.load(Ordering::SeqCst);
        meta.commit().unwrap();
        meta.lookup(1, 0).unwrap();
        meta.commit().unwrap();
        assert_eq!(dev.1.load(Ordering::SeqCst), writes);
        map_new(&mut meta, 1, 0);
        meta.commit().unwrap();
        assert!(dev.1.load(Ordering::SeqCst) > writes);
    }

    #[test]
    fn needs_check_is_written_at_once_and_refused_on_open() {
        let dev = device();
        let mut meta = ThinMetadata::open(dev.clone(), 128, 1000).unwrap();
        meta.create_thin(1).unwrap();
        meta.commit().unwrap();
        meta.create_thin(2).unwrap();
        meta.set_needs_check().unwrap();
        assert!(meta.needs_check());
        let err = ThinMetadata::open(dev, 128, 1000).unwrap_err();
        assert_eq!(err, ThinError::NeedsCheck);
        assert!(err.to_string().contains("thin_check"), "{err}");
    }

    #[test]
    fn the_pool_grows_with_its_devices() {
        let dev = device();
        let mut meta = ThinMetadata::open(dev.clone(), 128, 1000).unwrap();
        assert_eq!(
            meta.data_usage(),
            Usage {
                used: 0,
                total: 1000
            }
        );
        let total = meta.metadata_usage().total;
        assert_eq!(total, 2048);
        meta.resize_data(50_000).unwrap();
        meta.commit().unwrap();
        let meta = ThinMetadata::open(dev.clone(), 128, 60_000).unwrap();
        assert_eq!(meta.data_usage().total, 60_000);
        drop(meta);
        assert!(
            ThinMetadata::open(dev, 128, 59_999).is_err(),
            "no shrinking"
        );
    }

    /// `dev`'s bytes on a new memory device of `blocks` blocks (the device grown).
    fn grown(dev: &MemoryDevice, blocks: u64) -> Arc<MemoryDevice> {
        let mut bytes = vec![0u8; dev.size() as usize];
        dev.read(0, &mut bytes).unwrap();
        let bigger = MemoryDevice::new(blocks * BLOCK_SIZE as u64);
        bigger.write(0, &bytes, WriteFlags::default()).unwrap();
        Arc::new(bigger)
    }

    #[test]
    fn full_metadata_grows_onto_a_larger_device_and_goes_on() {
        let small = Arc::new(MemoryDevice::new(256 * BLOCK_SIZE as u64));
        let mut meta = ThinMetadata::open(small.clone(), 128, 1000).unwrap();
        let mut id = 0;
        let err = loop {
            // Committed one by one, as pool messages are.
            match meta.create_thin(id).and_then(|()| meta.commit()) {
                Ok(()) => id += 1,
                Err(e) => break e,
            }
        };
        assert_eq!(err, ThinError::MetadataFull);
        meta.abort().unwrap();
        let refused = meta.resize_metadata(Arc::new(MemoryDevice::new(100 * BLOCK_SIZE as u64)));
        assert!(
            matches!(refused, Err(ThinError::BadArgument(_))),
            "{refused:?}"
        );
        let bigger = grown(&small, 2048);
        meta.resize_metadata(bigger.clone()).unwrap();
        for more in id..id + 200 {
            meta.create_thin(more).unwrap();
        }
        meta.commit().unwrap();
        assert_eq!(meta.metadata_usage().total, 2048);
        drop(meta);
        let meta = ThinMetadata::open(bigger, 128, 1000).unwrap();
        assert_eq!(meta.metadata_usage().total, 2048);
        assert_eq!(meta.devices().len() as u32, id + 200);
    }
}
