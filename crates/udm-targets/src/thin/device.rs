//! `thin <pool dev> <dev id> [<external origin dev>]`: a thin device of a pool. Blocks are
//! allocated from the pool on first write; unprovisioned blocks read as zeroes, or from the
//! read-only external origin where it reaches. Its I/O is in `datapath.rs`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use udm_block::{BlockDevice, OpenMode};

use super::args::ThinLine;
use super::core::{Pool, Unregistered, POOLS};
use super::status::{thin_status, Mode};
use crate::args::Args;
use crate::target::{Target, TargetContext, TargetError};

pub struct Thin {
    pub(super) line: ThinLine,
    pub(super) pool: Arc<Pool>,
    pub(super) len: u64,
    pub(super) origin: Option<Arc<dyn BlockDevice>>,
    /// Held for the dependency on the pool device (ls --tree, remove refusing the pool).
    _pool_dev: Arc<dyn BlockDevice>,
    /// This target's entry in the pool's list of thin users.
    token: u64,
    /// A suspend (or removal, or the daemon stopping) has begun: writes waiting for data
    /// space fail now (see [`Target::presuspend`] and `retrying_on_space`)...
    pub(super) suspending: AtomicBool,
    /// ...or, for a noflush suspend, go back to the device to run again after the resume.
    pub(super) pushing_back: AtomicBool,
}

pub fn construct(args: &mut Args, ctx: &TargetContext) -> Result<Arc<dyn Target>, TargetError> {
    let line = ThinLine::parse(args)?;
    let origin = match &line.origin {
        Some(origin) => Some(args.open(ctx, "external origin dev", origin, OpenMode::ReadOnly)?),
        None => None,
    };
    let pool_dev = args.open(ctx, "pool dev", &line.pool, OpenMode::ReadWrite)?;
    let pool = POOLS.get(&line.pool).ok_or_else(|| {
        args.error(format!(
            "'{}' is not a thin-pool device (no thin-pool target is active on it)",
            line.pool
        ))
    })?;
    if pool.mode() == Mode::Fail {
        return Err(args.error(format!("pool '{}' is in fail mode", line.pool)));
    }
    if pool.gate.is_closed() {
        return Err(args.error(format!(
            "unable to activate a thin device while pool '{}' is suspended",
            line.pool
        )));
    }
    let token = pool
        .register_thin(line.id, ctx.owner, !ctx.read_only)
        .map_err(|why| match why {
            Unregistered::NoDevice => args.error(format!(
                "thin device {id} does not exist in pool '{pool}' (create it with: udm message \
                 {pool} 0 create_thin {id})",
                id = line.id,
                pool = line.pool
            )),
            Unregistered::Private(what) => args.error(format!(
                "thin device {} of pool '{}' is {what}: it takes no other table",
                line.id, line.pool
            )),
            Unregistered::Sent(sends) => args.error(format!(
                "thin device {} of pool '{}' is being sent ({}): it takes no writable table \
                 until the send ends (make it --readonly, or use a snapshot of it)",
                line.id,
                line.pool,
                sends.join(", ")
            )),
        })?;
    Ok(Arc::new(Thin {
        line,
        pool,
        len: ctx.len,
        origin,
        _pool_dev: pool_dev,
        token,
        suspending: AtomicBool::new(false),
        pushing_back: AtomicBool::new(false),
    }))
}

impl Thin {
    pub(super) fn id(&self) -> u32 {
        self.line.id
    }

    /// Mapped blocks and the highest mapped block.
    fn usage(&self) -> Option<(u64, Option<u64>)> {
        let mut meta = self.pool.meta();
        let mapped = meta.md.device(self.id())?.mapped_blocks;
        let highest = meta.md.highest_mapped(self.id()).ok()?;
        Some((mapped, highest))
    }
}

impl Target for Thin {
    fn type_name(&self) -> &'static str {
        "thin"
    }

    fn args(&self) -> String {
        self.line.print()
    }

    fn status(&self) -> String {
        match self.usage() {
            Some((mapped, highest)) => thin_status(
                self.pool.mode() == Mode::Fail,
                mapped,
                highest,
                self.pool.block_sectors,
            ),
            None if self.pool.mode() == Mode::Fail => "Fail".into(),
            None => "Error".into(),
        }
    }

    fn status_details(&self) -> Option<serde_json::Value> {
        let (mapped, highest) = self.usage()?;
        Some(serde_json::json!({
            "pool": self.line.pool,
            "id": self.id(),
            "block_bytes": self.pool.block_bytes(),
            "mapped_blocks": mapped,
            "mapped_bytes": mapped * self.pool.block_bytes(),
            "highest_mapped_block": highest,
            "pool_mode": self.pool.mode().word(),
        }))
    }

    fn references(&self) -> Vec<String> {
        let mut refs = vec![self.line.pool.clone()];
        refs.extend(self.line.origin.clone());
        refs
    }

    /// A write waiting for data space could wait as long as the pool stays full (for ever
    /// with `--no-space-timeout 0`), and the suspend with it. The kernel's plain suspend
    /// waits until the no-space timeout fails it with ENOSPC; here it fails now, with the
    /// same error (the write was never acknowledged), as multipath's presuspend does. A
    /// noflush suspend pushes it back to the device instead, as the kernel's requeues it:
    /// it runs again after the resume, when the pool may have grown.
    fn presuspend(&self, noflush: bool) {
        self.pushing_back.store(noflush, Ordering::SeqCst);
        self.suspending.store(true, Ordering::SeqCst);
        self.pool.space.changed();
    }

    fn suspend(&self) {
        self.pool.set_thin_live(self.token, false);
    }

    fn resume(&self) {
        self.suspending.store(false, Ordering::SeqCst);
        self.pushing_back.store(false, Ordering::SeqCst);
        self.pool.set_thin_live(self.token, true);
    }
}

impl Drop for Thin {
    fn drop(&mut self) {
        self.pool.unregister_thin(self.token);
    }
}
