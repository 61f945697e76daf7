//! `error`: every request fails with EIO, except a flush, which has nothing to make durable.

use std::sync::Arc;

use udm_block::{BlockDevice, BlockError, Extent, MapOp, Mapping, Result, WriteFlags, ZeroFlags};

use crate::args::Args;
use crate::target::{Target, TargetContext, TargetError};

pub struct ErrorTarget {
    len: u64,
}

pub fn construct(_args: &mut Args, ctx: &TargetContext) -> Result<Arc<dyn Target>, TargetError> {
    Ok(Arc::new(ErrorTarget { len: ctx.len }))
}

fn fail<T>() -> Result<T> {
    Err(BlockError::Io("error target".into()))
}

impl BlockDevice for ErrorTarget {
    fn size(&self) -> u64 {
        self.len
    }
    fn read(&self, _offset: u64, _buf: &mut [u8]) -> Result<()> {
        fail()
    }
    fn write(&self, _offset: u64, _buf: &[u8], _flags: WriteFlags) -> Result<()> {
        fail()
    }
    /// Nothing was written here, so nothing is owed: dm sends an error target no flush. A
    /// table masking a bad region with one (dm's "LVs that have holes in them") must still
    /// flush, or a filesystem on it takes every failed flush for a dead disk.
    fn flush(&self) -> Result<()> {
        Ok(())
    }
    fn discard(&self, _offset: u64, _len: u64) -> Result<()> {
        fail()
    }
    fn write_zeroes(&self, _offset: u64, _len: u64, _flags: ZeroFlags) -> Result<()> {
        fail()
    }
    fn block_status(&self, _offset: u64, _len: u64) -> Result<Vec<Extent>> {
        fail()
    }
    /// A flush has no file to sync here, so the rest of the table's flush stays mapped.
    fn map(&self, op: MapOp, _offset: u64, _len: u64) -> Option<Mapping> {
        (op == MapOp::Flush).then(Mapping::new)
    }
}

impl Target for ErrorTarget {
    fn type_name(&self) -> &'static str {
        "error"
    }
}

#[cfg(test)]
mod tests {
    use crate::testing::{build, memory_resolver};

    #[test]
    fn passes_the_error_conformance_checks() {
        let table = build(&memory_resolver(&[]), "0 2048 error").unwrap();
        udm_testkit::conformance::fails_every_request(&table);
    }
}
