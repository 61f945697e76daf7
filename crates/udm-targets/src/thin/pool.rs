//! `thin-pool <metadata dev> <data dev> <data block size> <low water mark> [<#features>
//! <feature>*]`: the pool device. Its own reads and writes pass through to the data device
//! (as the kernel's pool_map); its job is to hold the pool object that thin devices find by the
//! pool device's name, and to bind the live table's data device and features to it at every
//! resume — so reloading the pool with a larger data device grows it, keeping its state.

use std::sync::Arc;

use udm_block::{
    BlockDevice, Capabilities, Extent, MapOp, Mapping, OpenMode, Result, WriteFlags, ZeroFlags,
};

use super::args::PoolLine;
use super::core::{Bound, Opening, Pool};
use super::messages::PoolMessage;
use super::usage;
use crate::args::Args;
use crate::rendezvous::device_key;
use crate::target::{EventSink, Target, TargetContext, TargetError};

pub struct PoolTarget {
    line: PoolLine,
    pool: Arc<Pool>,
    data: Arc<dyn BlockDevice>,
    /// Held so the metadata device stays claimed by this pool's device; made the pool's at
    /// resume when it grew.
    metadata: Arc<dyn BlockDevice>,
    nr_blocks: u64,
    len: u64,
    raise_event: EventSink,
}

pub fn construct(args: &mut Args, ctx: &TargetContext) -> Result<Arc<dyn Target>, TargetError> {
    let line = PoolLine::parse(args)?;
    let metadata = args.open(ctx, "metadata dev", &line.metadata, OpenMode::Exclusive)?;
    let data = args.open(ctx, "data dev", &line.data, OpenMode::Exclusive)?;
    ctx.require(&line.data, &*data, 0, ctx.len)
        .map_err(|e| args.error(e))?;
    let block_bytes = line.block_sectors * udm_block::SECTOR_SIZE;
    let nr_blocks = ctx.len / block_bytes;
    if nr_blocks == 0 {
        return Err(args.error(format!(
            "the pool's length ({} sectors) is less than one data block ({} sectors)",
            ctx.len / udm_block::SECTOR_SIZE,
            line.block_sectors
        )));
    }
    if line.features.discard_passdown && !data.capabilities().discard {
        log::warn!(
            "thin-pool '{}': data device '{}' cannot discard: disabling discard passdown",
            ctx.owner,
            line.data
        );
    }
    let bound = bound(&line, &data, &ctx.raise_event);
    let pool = Pool::find_or_open(Opening {
        owner: ctx.owner,
        metadata_name: &line.metadata,
        metadata_key: device_key(&line.metadata, &*metadata),
        data_key: device_key(&line.data, &*data),
        metadata: metadata.clone(),
        block_sectors: line.block_sectors,
        nr_blocks,
        bound,
    })
    .map_err(|e| args.error(e))?;
    Ok(Arc::new(PoolTarget {
        line,
        pool,
        data,
        metadata,
        nr_blocks,
        len: ctx.len,
        raise_event: ctx.raise_event.clone(),
    }))
}

/// What this table gives the pool when it is made live.
fn bound(line: &PoolLine, data: &Arc<dyn BlockDevice>, raise_event: &EventSink) -> Bound {
    let mut features = line.features;
    features.discard_passdown &= data.capabilities().discard;
    Bound {
        data: data.clone(),
        features,
        low_water_blocks: line.low_water_blocks,
        raise_event: raise_event.clone(),
    }
}

/// The pool device itself reads and writes the data device, as the kernel's does.
impl BlockDevice for PoolTarget {
    fn size(&self) -> u64 {
        self.len
    }
    fn capabilities(&self) -> Capabilities {
        self.data.capabilities()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.data.read(offset, buf)
    }
    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> Result<()> {
        self.data.write(offset, buf, flags)
    }
    /// A flush of the pool device commits the pool (so `udm remove` and a daemon stop leave
    /// the metadata committed).
    fn flush(&self) -> Result<()> {
        self.pool.commit()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.data.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.data.write_zeroes(offset, len, flags)
    }
    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.data.block_status(offset, len)
    }
    fn map(&self, op: MapOp, offset: u64, len: u64) -> Option<Mapping> {
        // Discards and write-zeroes mean something of their own here: the synchronous way.
        if op.is_fill() {
            return None;
        }
        self.data.map(op, offset, len)
    }
}

impl Target for PoolTarget {
    fn type_name(&self) -> &'static str {
        "thin-pool"
    }

    fn args(&self) -> String {
        self.line.print()
    }

    fn status(&self) -> String {
        self.pool.status().to_string()
    }

    fn status_details(&self) -> Option<serde_json::Value> {
        Some(usage::pool_details(&self.pool))
    }

    fn message(&self, words: &[&str]) -> Result<String, TargetError> {
        let message = PoolMessage::parse(words)?;
        let pool = &self.pool;
        match message {
            PoolMessage::CreateThin(id) => {
                pool.message(|meta| meta.md.create_thin(id), "create_thin")?
            }
            PoolMessage::CreateSnap { id, origin } => {
                // The kernel documents that an active origin must be suspended first, but
                // does not check; udm does: a live table of the origin may have writes in
                // flight that the snapshot would half contain. The users stay held until
                // the snapshot is taken: a resume of the origin waits for it.
                let users = pool.users();
                if let Some((user, _)) = users.of(origin).into_iter().find(|(_, l)| *l) {
                    return Err(TargetError::new(format!(
                        "thin-pool: create_snap {id} {origin}: origin thin device {origin} is \
                         active as '{user}': suspend it first (udm suspend {user})"
                    )));
                }
                pool.message(|meta| meta.md.create_snap(id, origin), "create_snap")?
            }
            PoolMessage::Delete(id) => {
                // Held until the device is gone: no table of it can be made meanwhile.
                let users = pool.users();
                let using = users.of(id);
                // udm's own tables (a send reading the device, a receive writing it) have
                // names with a leading dot, which no device's name has: nothing to remove,
                // they go when the transfer ends.
                let (own, names): (Vec<_>, Vec<_>) = using
                    .into_iter()
                    .map(|(name, _)| name)
                    .partition(|name| name.starts_with('.'));
                if !names.is_empty() {
                    return Err(TargetError::new(format!(
                        "thin-pool: delete {id}: thin device {id} is in use by {} (remove \
                         it first)",
                        names.join(", ")
                    )));
                }
                if !own.is_empty() {
                    return Err(TargetError::new(format!(
                        "thin-pool: delete {id}: thin device {id} is in use by a send or \
                         receive of udm's ({}): wait for it to end",
                        own.join(", ")
                    )));
                }
                pool.message(|meta| meta.md.delete(id), "delete")?;
                // A receive's staging device dropped by hand: the id is anyone's again.
                pool.set_private(id, None)
            }
            PoolMessage::SetTransactionId { old, new } => pool.message(
                |meta| meta.md.set_transaction_id(old, new),
                "set_transaction_id",
            )?,
            // The snapshot is of committed metadata: `message` commits (data flushed first)
            // under the lock it holds while the snapshot is taken.
            PoolMessage::ReserveMetadataSnap => pool.message(
                |meta| meta.md.reserve_metadata_snap(),
                "reserve_metadata_snap",
            )?,
            PoolMessage::ReleaseMetadataSnap => pool.message(
                |meta| meta.md.release_metadata_snap(),
                "release_metadata_snap",
            )?,
        }
        Ok(String::new())
    }

    fn references(&self) -> Vec<String> {
        vec![self.line.metadata.clone(), self.line.data.clone()]
    }

    fn suspend(&self) {
        self.pool.suspend();
    }

    fn resume(&self) {
        let bound = bound(&self.line, &self.data, &self.raise_event);
        self.pool.bind(bound, self.nr_blocks, &self.metadata);
    }
}
