//! Targets that sit on one lower device at an offset (linear, flakey, dust) share one
//! implementation: a [`Filter`] says what it does differently, [`Filtered`] does the rest.
//! This is nbdkit's filter idea: every operation passes down unless a hook intervenes.

use std::sync::Arc;

use udm_block::{
    AlignedBuf, BlockDevice, BlockError, Capabilities, Extent, MapOp, Mapping, OpenMode, Result,
    WriteFlags, ZeroFlags, SECTOR_SIZE,
};

use crate::args::Args;
use crate::target::{TargetContext, TargetError};

/// A lower device seen from `offset` on, for `len` bytes.
pub struct Lower {
    pub reference: String,
    pub dev: Arc<dyn BlockDevice>,
    pub offset: u64,
    pub len: u64,
}

impl Lower {
    /// Parses `<dev> <offset>` and checks that the segment fits on the device.
    pub fn parse(
        args: &mut Args,
        ctx: &TargetContext,
        mode: OpenMode,
    ) -> Result<Self, TargetError> {
        let (reference, dev) = args.device(ctx, "dev", mode)?;
        let offset = args.sectors("offset")?;
        ctx.require(&reference, &*dev, offset, ctx.len)
            .map_err(|e| args.error(e))?;
        let lower = Lower {
            reference,
            dev,
            offset,
            len: ctx.len,
        };
        Ok(lower)
    }

    /// `<dev> <offset>` as a table line prints it.
    pub fn args(&self) -> String {
        format!("{} {}", self.reference, self.offset / SECTOR_SIZE)
    }
}

/// Which way a request goes, for filters that treat them differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// read, block status, cache
    Read,
    /// write, discard, write zeroes
    Write,
    Flush,
}

pub trait Filter: Send + Sync {
    fn lower(&self) -> &Lower;

    /// Decides a request's fate before it goes down: `Ok(true)` passes it, `Ok(false)`
    /// completes it successfully without doing it, an error fails it.
    fn admit(&self, _kind: OpKind, _offset: u64, _len: u64) -> Result<bool> {
        Ok(true)
    }

    /// May change data read from the lower device before the caller sees it.
    fn after_read(&self, _offset: u64, _buf: &mut [u8]) {}

    /// May replace the data of a write (to corrupt it on purpose).
    fn replace_write(&self, _offset: u64, _buf: &[u8]) -> Option<AlignedBuf> {
        None
    }

    /// True for a filter with no hooks on reads, writes and flushes, whose requests can
    /// therefore be remapped onto the lower device (see [`udm_block::map`]).
    fn remaps(&self) -> bool {
        false
    }
}

/// A filter turned into a device.
pub struct Filtered<F>(pub F);

impl<F: Filter> Filtered<F> {
    fn lower(&self) -> &Lower {
        self.0.lower()
    }
}

impl<F: Filter> BlockDevice for Filtered<F> {
    fn size(&self) -> u64 {
        self.lower().len
    }

    fn capabilities(&self) -> Capabilities {
        self.lower().dev.capabilities()
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        if self.0.admit(OpKind::Read, offset, buf.len() as u64)? {
            let lower = self.lower();
            lower.dev.read(lower.offset + offset, buf)?;
            self.0.after_read(offset, buf);
        }
        Ok(())
    }

    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> Result<()> {
        if !self.0.admit(OpKind::Write, offset, buf.len() as u64)? {
            return Ok(());
        }
        let lower = self.lower();
        match self.0.replace_write(offset, buf) {
            Some(replaced) => lower.dev.write(lower.offset + offset, &replaced, flags),
            None => lower.dev.write(lower.offset + offset, buf, flags),
        }
    }

    fn flush(&self) -> Result<()> {
        if self.0.admit(OpKind::Flush, 0, 0)? {
            self.lower().dev.flush()?;
        }
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        if self.0.admit(OpKind::Write, offset, len)? {
            let lower = self.lower();
            lower.dev.discard(lower.offset + offset, len)?;
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        if self.0.admit(OpKind::Write, offset, len)? {
            let lower = self.lower();
            lower.dev.write_zeroes(lower.offset + offset, len, flags)?;
        }
        Ok(())
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        if !self.0.admit(OpKind::Read, offset, len)? {
            return Err(BlockError::Io("block status dropped".into()));
        }
        let lower = self.lower();
        lower.dev.block_status(lower.offset + offset, len)
    }

    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        let lower = self.lower();
        lower.dev.cache(lower.offset + offset, len)
    }

    fn map(&self, op: MapOp, offset: u64, len: u64) -> Option<Mapping> {
        if !self.0.remaps() {
            return None;
        }
        let lower = self.lower();
        match op {
            MapOp::Flush => lower.dev.map(op, 0, 0),
            _ => lower.dev.map(op, lower.offset + offset, len),
        }
    }
}
