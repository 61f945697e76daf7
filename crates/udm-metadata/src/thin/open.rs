//! Opening a pool's metadata: formatting a blank device (K:`__format_metadata`), checking and
//! growing an existing one, and reading the committed state into memory.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use udm_block::BlockDevice;

use super::btree::lookup::walk;
use super::btree::{new_tree, ValueKind};
use super::cache::NumberMap;
use super::error::corrupt;
use super::mapping::{u64_of, MAX_DATA_BLOCKS};
use super::space_map::{disk, metadata};
use super::superblock::{
    random_uuid, Superblock, METADATA_BLOCK_SECTORS, SUPERBLOCK_LOCATION, VERSION,
};
use super::transaction::Tm;
use super::{
    DeviceInfo, Result, ThinError, ThinMetadata, MAX_DATA_BLOCK_SECTORS, MAX_METADATA_BLOCKS,
    MIN_DATA_BLOCK_SECTORS,
};

impl ThinMetadata {
    /// Opens the pool metadata on `dev`; formats a new pool when the superblock block is all
    /// zeroes (as the kernel does). Refuses a data block size that differs from the
    /// superblock's and a bad checksum. A data device larger than the recorded one grows the
    /// pool (and a larger metadata device its metadata space), committed at once; a smaller
    /// one is refused. Metadata flagged needs_check opens as it is, never grown nor changed
    /// (see [`ThinMetadata::needs_check`]): the kernel activates such a pool read-only, so
    /// its volumes stay readable until the pool is taken down for thin_check.
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
        let grows = nr_data_blocks > recorded || metadata_blocks > meta.tm.msm.nr_blocks();
        if grows && !meta.needs_check() {
            meta.tm.dsm.extend(nr_data_blocks);
            meta.tm
                .msm
                .extend(metadata_blocks.max(meta.tm.msm.nr_blocks()));
            meta.commit()?;
        }
        Ok(meta)
    }

    /// The pool's identity, as last committed (None: its metadata has none yet; see
    /// [`ThinMetadata::identify`]). A pool made again on new metadata has another one, where
    /// its device ids and creation times start over as the old pool's did.
    pub fn identity(&self) -> Option<[u8; 16]> {
        (self.committed.uuid != [0; 16]).then_some(self.committed.uuid)
    }

    /// Gives metadata without an identity (written before udm gave pools one, or by
    /// thin_restore) a random one, committed at once; the caller opens the pool writable and
    /// has nothing else to commit. Metadata that needs checking is not changed.
    pub fn identify(&mut self) -> Result<()> {
        if self.identity().is_some() || self.needs_check() {
            return Ok(());
        }
        self.usable()?;
        self.sb.uuid = random_uuid();
        self.commit()
    }

    /// Writes a new, empty pool (K:`__format_metadata`), with an identity of its own.
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
                uuid: random_uuid(),
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
}

/// The devices' details and the roots of their trees.
type Devices = (BTreeMap<u32, DeviceInfo>, NumberMap<u32, u64>);

/// Reads the committed state named by `sb` into `tm`: both space maps; and the device details
/// and the roots of the devices' trees, checked against each other.
pub(super) fn load(tm: &mut Tm, sb: &Superblock) -> Result<Devices> {
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
