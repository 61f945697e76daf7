//! A thin device's mappings: looking blocks up, allocating and releasing data blocks, mapping
//! and unmapping them.

use super::btree::lookup::{last_key, lookup as btree_lookup, walk};
use super::btree::ValueKind;
use super::mapping::{insert_mapping, pack, remove_mapping, u64_of, unpack};
use super::{Mapping, Result, ThinError, ThinMetadata};

impl ThinMetadata {
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

    /// The newest time among `id`'s mappings (None: it maps nothing). A write that maps a
    /// block anew (a first write, or one that breaks sharing with a snapshot) records the
    /// pool's time then, so a device whose every mapping was shared is seen to be written
    /// since: replication names a snapshot's content by this and its mapped blocks. Reads
    /// every leaf of the device's tree.
    pub fn newest_mapping_time(&mut self, id: u32) -> Result<Option<u32>> {
        self.usable()?;
        self.info(id)?;
        let root = self.root_of(id)?;
        let mut newest = None;
        walk(
            &mut self.tm.cache,
            root,
            ValueKind::Mapping,
            0,
            None,
            &mut |_, v| {
                newest = newest.max(Some(unpack(u64_of(v)).1));
                Ok(())
            },
        )?;
        Ok(newest)
    }

    /// The highest mapped virtual block of `id`, if any.
    pub fn highest_mapped(&mut self, id: u32) -> Result<Option<u64>> {
        self.usable()?;
        self.info(id)?;
        let root = self.root_of(id)?;
        last_key(&mut self.tm.cache, root, ValueKind::Mapping)
    }
}
