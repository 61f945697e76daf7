//! The clone's I/O path: reads, writes and the rest, region by region. Hydrated regions are
//! served by the destination; the rest by the source for reads, and for writes by copying the
//! region first (or not at all when the write covers it whole).

use udm_block::{
    BlockDevice, BlockError, Capabilities, Extent, MapOp, Mapping, Result, WriteFlags, ZeroFlags,
};

use super::commit::Mode;
use super::copy::{COPY_BUFFER, COPY_CHUNK};
use super::{CloneTarget, Inner};

impl Inner {
    pub(super) fn regions_of(&self, offset: u64, len: u64) -> std::ops::Range<u64> {
        offset / self.region..(offset + len).div_ceil(self.region)
    }

    /// Byte range of a region (the last one may be short).
    pub(super) fn bounds(&self, region: u64) -> (u64, u64) {
        (
            region * self.region,
            ((region + 1) * self.region).min(self.len),
        )
    }

    /// Writes and write-zeroes: regions the request covers entirely go straight to the
    /// destination (no copy) and are marked hydrated after; partly covered ones are copied
    /// first.
    fn write_through(
        &self,
        offset: u64,
        len: u64,
        fua: bool,
        op: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        self.check_not_failed()?;
        let mut covered = Vec::new();
        for region in self.regions_of(offset, len) {
            if self.meta.is_hydrated(region) {
                continue;
            }
            let (start, end) = self.bounds(region);
            if offset > start || offset + len < end {
                self.ensure_hydrated(region)?;
                continue;
            }
            if self.mode() != Mode::Write {
                return Err(BlockError::Io(
                    "clone: metadata is read-only; cannot hydrate".into(),
                ));
            }
            let claim = self.claims.claim(region);
            if !self.meta.is_hydrated(region) {
                covered.push(claim);
            }
        }
        op()?;
        for claim in &covered {
            self.meta.set_hydrated(claim.region..claim.region + 1);
        }
        if !covered.is_empty() {
            self.announce_if_complete();
        }
        drop(covered);
        if fua {
            self.commit()?;
        }
        Ok(())
    }

    /// A write inside one unhydrated region that it does not cover: the region is read from
    /// the source, the write laid over it, and the result written to the destination once —
    /// copying first would write the region and then the user's data again. Returns false,
    /// having done nothing, for writes this does not fit (they take `write_through`).
    fn write_merged(&self, offset: u64, data: &[u8], fua: bool) -> Result<bool> {
        let region = offset / self.region;
        let (start, end) = self.bounds(region);
        let len = data.len() as u64;
        let partial = offset + len <= end && (offset > start || offset + len < end);
        if !partial
            || end - start > COPY_CHUNK
            || self.mode() != Mode::Write
            || self.meta.is_hydrated(region)
        {
            return Ok(false);
        }
        let claim = self.claims.claim(region);
        if self.meta.is_hydrated(region) {
            // Copied while we waited for the claim: now a plain write.
            return Ok(false);
        }
        COPY_BUFFER.with_borrow_mut(|buf| {
            buf.resize((end - start) as usize);
            self.source.read(start, buf)?;
            buf[(offset - start) as usize..][..data.len()].copy_from_slice(data);
            self.dest.write(start, buf, WriteFlags { fua: false })
        })?;
        self.meta.set_hydrated(region..region + 1);
        drop(claim);
        self.announce_if_complete();
        if fua {
            self.commit()?;
        }
        Ok(true)
    }

    /// Calls `f(hydrated, offset, len, range in request)` for each run of regions with the
    /// same state.
    fn each_run(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(bool, u64, u64, std::ops::Range<usize>) -> Result<()>,
    ) -> Result<()> {
        let end = offset + len;
        let run_from = |pos| {
            let region = pos / self.region;
            let hydrated = self.meta.is_hydrated(region);
            let mut run_end = self.bounds(region).1.min(end);
            while run_end < end && self.meta.is_hydrated(run_end / self.region) == hydrated {
                run_end = self.bounds(run_end / self.region).1.min(end);
            }
            (hydrated, run_end)
        };
        for (hydrated, at, n, range) in crate::runs::runs(offset, len, run_from) {
            f(hydrated, at, n, range)?;
        }
        Ok(())
    }
}

impl BlockDevice for CloneTarget {
    fn size(&self) -> u64 {
        self.inner.len
    }

    fn capabilities(&self) -> Capabilities {
        let dest = self.inner.dest.capabilities();
        Capabilities {
            read_only: false,
            native_fua: true,
            discard: true,
            fast_zero: dest.fast_zero,
            rotational: dest.rotational,
            flush_covers_all: true,
        }
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let s = &self.inner;
        let _io = s.activity.begin();
        s.check_not_failed()?;
        s.each_run(offset, buf.len() as u64, |hydrated, at, len, range| {
            if hydrated {
                return s.dest.read(at, &mut buf[range]);
            }
            if s.hydrate_on_read && s.mode() == Mode::Write {
                for region in s.regions_of(at, len) {
                    s.ensure_hydrated(region)?;
                }
                return s.dest.read(at, &mut buf[range]);
            }
            s.source.read(at, &mut buf[range])
        })
    }

    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> Result<()> {
        let s = &self.inner;
        let _io = s.activity.begin();
        if s.write_merged(offset, buf, flags.fua)? {
            return Ok(());
        }
        s.write_through(offset, buf.len() as u64, flags.fua, || {
            s.dest.write(offset, buf, WriteFlags { fua: false })
        })
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        let s = &self.inner;
        let _io = s.activity.begin();
        s.write_through(offset, len, flags.fua, || {
            s.dest.write_zeroes(
                offset,
                len,
                ZeroFlags {
                    fua: false,
                    ..flags
                },
            )
        })
    }

    fn flush(&self) -> Result<()> {
        let _io = self.inner.activity.begin();
        self.inner.commit()
    }

    /// Requests wholly inside hydrated regions remap onto the destination, as dm-clone's
    /// map() does. Flushes and FUA writes commit the bitmap, and everything touching an
    /// unhydrated region may copy or wait for a copy: those the clone handles itself.
    fn map(&self, op: MapOp, offset: u64, len: u64) -> Option<Mapping> {
        let s = &self.inner;
        let usable = match op {
            MapOp::Read => s.mode() != Mode::Fail,
            MapOp::Write { fua: false } => s.mode() == Mode::Write,
            MapOp::Write { fua: true } | MapOp::Flush => false,
            // A discard skips hydrating the regions it covers; the synchronous way does it.
            MapOp::Discard { .. } | MapOp::WriteZeroes { .. } => false,
        };
        if !usable || !s.regions_of(offset, len).all(|r| s.meta.is_hydrated(r)) {
            return None;
        }
        let hold = s.activity.begin_mapped();
        Some(s.dest.map(op, offset, len)?.hold(hold))
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        let s = &self.inner;
        let _io = s.activity.begin();
        s.check_not_failed()?;
        if s.mode() != Mode::Write {
            return Ok(());
        }
        // Only regions the discard covers entirely count; they need no copy any more.
        let end = offset + len;
        let first = offset.div_ceil(s.region);
        let last = if end == s.len {
            end.div_ceil(s.region)
        } else {
            end / s.region
        };
        for region in first..last.max(first) {
            if !s.meta.is_hydrated(region) {
                let _claim = s.claims.claim(region);
                s.meta.set_hydrated(region..region + 1);
            }
        }
        if last > first {
            s.announce_if_complete();
            if s.discard_passdown && s.dest.capabilities().discard {
                let start = first * s.region;
                let stop = (last * s.region).min(s.len);
                s.dest.discard(start, stop - start)?;
            }
        }
        Ok(())
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        let s = &self.inner;
        s.check_not_failed()?;
        // Describe the first run of same-state regions from the device that serves it.
        let mut answer = Vec::new();
        s.each_run(offset, len, |hydrated, at, run, _| {
            if answer.is_empty() {
                let dev = if hydrated { &s.dest } else { &s.source };
                answer = dev.block_status(at, run)?;
            }
            Ok(())
        })?;
        Ok(answer)
    }

    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        let s = &self.inner;
        s.check_not_failed()?;
        if s.mode() != Mode::Write {
            return Ok(());
        }
        for region in s.regions_of(offset, len) {
            s.ensure_hydrated(region)?;
        }
        Ok(())
    }
}
