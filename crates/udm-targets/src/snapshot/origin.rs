//! `snapshot-origin <origin>`: the origin as its users see it. Reads go straight to the
//! origin; a write first has every chunk it touches saved by each snapshot of the origin that
//! lacks it (committed, so the snapshot survives a crash right after the write lands), then
//! lands. Writes to chunks every snapshot has saved remap straight onto the origin; other
//! mapped writes wait for their copy-out as a step of their mapping ([`udm_block::pending`]),
//! holding no thread while the copies' commit is written.

use std::sync::Arc;

use udm_block::{
    BlockDevice, Capabilities, Extent, MapOp, Mapping, OpenMode, Pending, Result, WriteFlags,
};

use super::hub::{Hub, RoleGuard};
use crate::args::Args;
use crate::rendezvous::device_key;
use crate::target::{Target, TargetContext, TargetError};

pub struct Origin {
    hub: Arc<Hub>,
    origin: Arc<dyn BlockDevice>,
    origin_ref: String,
    len: u64,
    role: RoleGuard,
}

pub fn construct(args: &mut Args, ctx: &TargetContext) -> Result<Arc<dyn Target>, TargetError> {
    let (origin_ref, origin) = args.device(ctx, "origin", OpenMode::ReadWrite)?;
    ctx.require(&origin_ref, &*origin, 0, ctx.len)
        .map_err(|e| args.error(e))?;
    let hub = Hub::of(&device_key(&origin_ref, &*origin), &origin_ref);
    let role = hub.serve_origin(ctx.owner).map_err(|e| args.error(e))?;
    Ok(Arc::new(Origin {
        hub,
        origin,
        origin_ref,
        len: ctx.len,
        role,
    }))
}

impl BlockDevice for Origin {
    fn size(&self) -> u64 {
        self.len
    }

    /// The origin's, except discards: passing one down would change chunks without saving
    /// them, so they are accepted and ignored (a discard is a hint).
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            discard: false,
            fast_zero: false,
            ..self.origin.capabilities()
        }
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.origin.read(offset, buf)
    }

    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> Result<()> {
        let _writing = self.hub.begin_write();
        self.hub.copy_out(&*self.origin, offset, buf.len() as u64);
        self.origin.write(offset, buf, flags)
    }

    fn flush(&self) -> Result<()> {
        self.origin.flush()
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.origin.block_status(offset, len)
    }

    fn map(&self, op: MapOp, offset: u64, len: u64) -> Option<Mapping> {
        match op {
            MapOp::Discard { .. } | MapOp::WriteZeroes { .. } => None,
            MapOp::Read | MapOp::Flush => self.origin.map(op, offset, len),
            MapOp::Write { .. } => {
                let writing = self.hub.try_begin_write()?;
                let mapped = self.origin.map(op, offset, len)?.hold(writing);
                if self.hub.all_saved(offset, len) {
                    return Some(mapped);
                }
                // The chunks are saved first, by the copy workers; the write waits for
                // their commit without a thread waiting with it.
                let (hub, origin) = (self.hub.clone(), self.origin.clone());
                Some(mapped.after(Pending::new(move |done| {
                    hub.copy_out_then(origin, offset, len, done)
                })))
            }
        }
    }
}

impl Target for Origin {
    fn type_name(&self) -> &'static str {
        "snapshot-origin"
    }

    fn args(&self) -> String {
        self.origin_ref.clone()
    }

    fn references(&self) -> Vec<String> {
        vec![self.origin_ref.clone()]
    }

    fn renamed(&self, new: &str) {
        self.role.rename(new);
    }
}
