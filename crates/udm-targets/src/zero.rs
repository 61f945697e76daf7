//! `zero`: reads return zeroes, writes are accepted and dropped. The null device that measures
//! udm's own overhead (null_blk's role in the seeds).

use std::sync::Arc;

use udm_block::{
    BlockDevice, Capabilities, Extent, MapOp, Mapping, Place, Result, WriteFlags, ZeroFlags,
};

use crate::args::Args;
use crate::target::{Target, TargetContext, TargetError};

pub struct Zero {
    len: u64,
}

pub fn construct(_args: &mut Args, ctx: &TargetContext) -> Result<Arc<dyn Target>, TargetError> {
    Ok(Arc::new(Zero { len: ctx.len }))
}

impl BlockDevice for Zero {
    fn size(&self) -> u64 {
        self.len
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::in_memory()
    }
    fn read(&self, _offset: u64, buf: &mut [u8]) -> Result<()> {
        buf.fill(0);
        Ok(())
    }
    fn write(&self, _offset: u64, _buf: &[u8], _flags: WriteFlags) -> Result<()> {
        Ok(())
    }
    fn flush(&self) -> Result<()> {
        Ok(())
    }
    fn write_zeroes(&self, _offset: u64, _len: u64, _flags: ZeroFlags) -> Result<()> {
        Ok(())
    }
    fn block_status(&self, _offset: u64, len: u64) -> Result<Vec<Extent>> {
        Ok(vec![Extent::hole(len)])
    }
    fn map(&self, op: MapOp, _offset: u64, len: u64) -> Option<Mapping> {
        Some(match op {
            // Nothing to sync, and nothing to deallocate or zero: it reads zeroes already.
            MapOp::Flush | MapOp::Discard { .. } | MapOp::WriteZeroes { .. } => Mapping::new(),
            MapOp::Read | MapOp::Write { .. } => Mapping::single(len, Place::Zero),
        })
    }
}

impl Target for Zero {
    fn type_name(&self) -> &'static str {
        "zero"
    }
}

#[cfg(test)]
mod tests {
    use crate::testing::{build, memory_resolver};

    #[test]
    fn passes_the_zero_conformance_checks() {
        let table = build(&memory_resolver(&[]), "0 2048 zero").unwrap();
        udm_testkit::conformance::reads_zero_and_drops_writes(&table);
    }
}
