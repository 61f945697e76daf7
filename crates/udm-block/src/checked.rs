//! The one place where requests are checked before any target sees them.
//!
//! Exports wrap every device they serve in [`Checked`]; targets below it can then assume
//! aligned, in-range requests and need not repeat the checks. Missing capabilities are
//! emulated here too, so a target never has to implement FUA on its own.

use crate::device::{clamp_extents, BlockDevice, Capabilities, Extent, WriteFlags, ZeroFlags};
use crate::error::{BlockError, Result};
use crate::map::{MapOp, Mapping};

pub const SECTOR_SIZE: u64 = 512;

/// Checks that `[offset, offset + len)` is sector-aligned and lies within a device of `size`
/// bytes. Zero-length requests are rejected: no client has a reason to send one.
pub fn check_request(size: u64, offset: u64, len: u64) -> Result<()> {
    check_request_or(size, offset, len, BlockError::InvalidArgument)
}

/// [`check_request`] with the error for a range beyond the end chosen by the caller.
fn check_request_or(
    size: u64,
    offset: u64,
    len: u64,
    beyond_end: fn(String) -> BlockError,
) -> Result<()> {
    if len == 0 {
        return Err(BlockError::InvalidArgument("zero-length request".into()));
    }
    if !offset.is_multiple_of(SECTOR_SIZE) || !len.is_multiple_of(SECTOR_SIZE) {
        return Err(BlockError::InvalidArgument(format!(
            "offset {offset} length {len} not aligned to {SECTOR_SIZE} bytes"
        )));
    }
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(beyond_end(format!(
            "offset {offset} length {len} beyond the end of the device ({size} bytes)"
        ))),
    }
}

/// A device whose requests are validated and whose missing capabilities are emulated.
pub struct Checked<D> {
    inner: D,
    read_only: bool,
}

impl<D: BlockDevice> Checked<D> {
    /// `read_only` forces the device read-only even when the device itself could write.
    pub fn new(inner: D, read_only: bool) -> Self {
        let read_only = read_only || inner.capabilities().read_only;
        Checked { inner, read_only }
    }

    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// Data written past the end fails with ENOSPC, as on the kernel's block devices (and
    /// nbdkit); a discard past the end is merely invalid.
    fn check_write(&self, offset: u64, len: u64, writes_data: bool) -> Result<()> {
        if self.read_only {
            return Err(BlockError::ReadOnly("the device is read-only".into()));
        }
        let beyond_end = if writes_data {
            BlockError::NoSpace
        } else {
            BlockError::InvalidArgument
        };
        check_request_or(self.inner.size(), offset, len, beyond_end)
    }
}

impl<D: BlockDevice> BlockDevice for Checked<D> {
    fn size(&self) -> u64 {
        self.inner.size()
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            read_only: self.read_only,
            native_fua: true,
            ..self.inner.capabilities()
        }
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        check_request(self.inner.size(), offset, buf.len() as u64)?;
        self.inner.read(offset, buf)
    }

    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> Result<()> {
        self.check_write(offset, buf.len() as u64, true)?;
        if flags.fua && !self.inner.capabilities().native_fua {
            self.inner.write(offset, buf, WriteFlags { fua: false })?;
            return self.inner.flush();
        }
        self.inner.write(offset, buf, flags)
    }

    fn flush(&self) -> Result<()> {
        self.inner.flush()
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.check_write(offset, len, false)?;
        self.inner.discard(offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.check_write(offset, len, true)?;
        if flags.fua && !self.inner.capabilities().native_fua {
            self.inner.write_zeroes(
                offset,
                len,
                ZeroFlags {
                    fua: false,
                    ..flags
                },
            )?;
            return self.inner.flush();
        }
        self.inner.write_zeroes(offset, len, flags)
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        check_request(self.inner.size(), offset, len)?;
        let mut extents = self.inner.block_status(offset, len)?;
        clamp_extents(&mut extents, len);
        Ok(extents)
    }

    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        check_request(self.inner.size(), offset, len)?;
        self.inner.cache(offset, len)
    }

    /// Only requests that pass the checks are mapped; the others go the synchronous way,
    /// which fails them with the error that names what is wrong.
    fn map(&self, op: MapOp, offset: u64, len: u64) -> Option<Mapping> {
        let checked = match op {
            MapOp::Read => check_request(self.inner.size(), offset, len),
            MapOp::Write { .. } => self.check_write(offset, len, true),
            MapOp::WriteZeroes { .. } => self.check_write(offset, len, true),
            MapOp::Discard { .. } => self.check_write(offset, len, false),
            MapOp::Flush => Ok(()),
        };
        checked.ok()?;
        self.inner.map(op, offset, len)
    }

    fn suspended(&self) -> bool {
        self.inner.suspended()
    }

    fn identity(&self) -> Option<String> {
        self.inner.identity()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryDevice;

    #[test]
    fn rejects_what_no_target_should_see() {
        let dev = Checked::new(MemoryDevice::new(1 << 20), false);
        let mut buf = vec![0u8; 512];
        assert!(matches!(
            dev.read(1 << 20, &mut buf),
            Err(BlockError::InvalidArgument(_))
        ));
        assert!(matches!(
            dev.read(100, &mut buf),
            Err(BlockError::InvalidArgument(_))
        ));
        assert!(matches!(
            dev.read(0, &mut []),
            Err(BlockError::InvalidArgument(_))
        ));
        assert!(matches!(
            dev.discard(u64::MAX - 511, 512),
            Err(BlockError::InvalidArgument(_))
        ));
        dev.read((1 << 20) - 512, &mut buf).unwrap();
    }

    #[test]
    fn writes_past_the_end_find_no_space_and_discards_are_invalid() {
        let dev = Checked::new(MemoryDevice::new(1 << 20), false);
        assert!(matches!(
            dev.write(1 << 20, &[0u8; 512], WriteFlags::default()),
            Err(BlockError::NoSpace(_))
        ));
        assert!(matches!(
            dev.write_zeroes(u64::MAX - 511, 512, ZeroFlags::default()),
            Err(BlockError::NoSpace(_))
        ));
        assert!(matches!(
            dev.discard(1 << 20, 512),
            Err(BlockError::InvalidArgument(_))
        ));
        // Misalignment stays invalid whatever the kind of request.
        assert!(matches!(
            dev.write(100, &[0u8; 512], WriteFlags::default()),
            Err(BlockError::InvalidArgument(_))
        ));
    }

    #[test]
    fn read_only_refuses_every_kind_of_write() {
        let dev = Checked::new(MemoryDevice::new(1 << 20), true);
        let buf = vec![1u8; 512];
        assert!(matches!(
            dev.write(0, &buf, WriteFlags::default()),
            Err(BlockError::ReadOnly(_))
        ));
        assert!(matches!(dev.discard(0, 512), Err(BlockError::ReadOnly(_))));
        assert!(matches!(
            dev.write_zeroes(0, 512, ZeroFlags::default()),
            Err(BlockError::ReadOnly(_))
        ));
        assert!(dev.capabilities().read_only);
    }
}
