//! Copying regions from the source to the destination: for the background workers and for
//! the user's I/O that needs a region first. Zero-aware: what the source reports as zero is
//! zeroed on the destination, not read and written.

use std::ops::Range;

use udm_block::SECTOR_SIZE;
use udm_block::{AlignedBuf, BlockDevice, Extent, Result, WriteFlags, ZeroFlags, EXTENT_ZERO};

use super::commit::Mode;
use super::regions::Claim;
use super::Inner;

/// Largest piece copied with one read and one write.
pub(super) const COPY_CHUNK: u64 = 1 << 20;
/// On-demand copies (a user's write waiting) ask the source for zeroes only for regions at
/// least this large.
const ON_DEMAND_PROBE_MIN: u64 = 1 << 20;

thread_local! {
    /// Each copying thread reuses one buffer: allocating (and zeroing) a fresh megabyte per
    /// batch cost the background copy a good part of its throughput.
    pub(super) static COPY_BUFFER: std::cell::RefCell<AlignedBuf> =
        std::cell::RefCell::new(AlignedBuf::new());
}

impl Inner {
    /// Copies `regions` from the source to the destination and marks them hydrated; returns
    /// the bytes read from the source. With `probe_zeroes`, ranges the source reports as zero
    /// are zeroed on the destination instead of read and written; the probe costs a round
    /// trip to the source, worth it for the background copy, not while a user's write waits
    /// for a small region. The caller holds the regions' claims.
    fn copy_regions(&self, regions: Range<u64>, probe_zeroes: bool) -> Result<u64> {
        let start = self.bounds(regions.start).0;
        let end = self.bounds(regions.end - 1).1;
        let read =
            COPY_BUFFER.with_borrow_mut(|buf| self.copy_range(start, end, probe_zeroes, buf))?;
        self.meta.set_hydrated(regions);
        self.announce_if_complete();
        Ok(read)
    }

    /// Copies a background batch of contiguous claimed regions, at most a copy chunk (or one
    /// region) at a time, letting go of each piece's claims as soon as it is on the
    /// destination: a user's I/O to a claimed region waits for one piece, not the batch.
    /// Returns the bytes read from the source (what the bandwidth cap counts).
    pub(super) fn copy_claimed(&self, claims: Vec<Claim<'_>>) -> Result<u64> {
        let per_piece = (COPY_CHUNK / self.region).max(1) as usize;
        let mut claims = claims.into_iter().peekable();
        let mut read = 0;
        while let Some(first) = claims.peek().map(|c| c.region) {
            let piece: Vec<_> = claims.by_ref().take(per_piece).collect();
            read += self.copy_regions(first..first + piece.len() as u64, true)?;
        }
        Ok(read)
    }

    /// Copies `start..end`; returns the bytes read from the source (zero runs read none).
    fn copy_range(
        &self,
        start: u64,
        end: u64,
        probe_zeroes: bool,
        buf: &mut AlignedBuf,
    ) -> Result<u64> {
        let mut read = 0;
        let mut pos = start;
        while pos < end {
            let extent = if probe_zeroes {
                self.source.block_status(pos, end - pos)?.first().copied()
            } else {
                None
            }
            .unwrap_or(Extent::data(end - pos));
            let run = extent.len.clamp(SECTOR_SIZE, end - pos);
            if extent.flags & EXTENT_ZERO != 0 {
                self.zero_destination(pos, run)?;
            } else {
                let mut done = 0;
                while done < run {
                    let n = (run - done).min(COPY_CHUNK);
                    buf.resize(n as usize);
                    self.source.read(pos + done, buf)?;
                    self.dest.write(pos + done, buf, WriteFlags::default())?;
                    done += n;
                }
                read += run;
            }
            pos += run;
        }
        Ok(read)
    }

    /// Makes a destination range read as zeroes for a range the source reports as zero. What
    /// already reads as zero (a fresh sparse or preallocated destination) is left alone; the
    /// rest is zeroed without unmapping, so a preallocated destination keeps its space.
    fn zero_destination(&self, offset: u64, len: u64) -> Result<()> {
        let end = offset + len;
        let mut pos = offset;
        for extent in self.dest.block_status(offset, len)? {
            let run = extent.len.min(end - pos);
            if extent.flags & EXTENT_ZERO == 0 {
                self.dest.write_zeroes(pos, run, ZeroFlags::default())?;
            }
            pos += run;
            if pos == end {
                return Ok(());
            }
        }
        // The destination described only part of the range: zero the rest.
        self.dest.write_zeroes(pos, end - pos, ZeroFlags::default())
    }

    /// Makes sure `region` is on the destination, copying it or waiting for whoever is.
    pub(super) fn ensure_hydrated(&self, region: u64) -> Result<()> {
        if self.meta.is_hydrated(region) {
            return Ok(());
        }
        if self.mode() != Mode::Write {
            return Err(udm_block::BlockError::Io(format!(
                "clone: metadata is read-only; cannot hydrate region {region}"
            )));
        }
        let _claim = self.claims.claim(region);
        if self.meta.is_hydrated(region) {
            return Ok(());
        }
        self.copy_regions(region..region + 1, self.region >= ON_DEMAND_PROBE_MIN)
            .map(drop)
    }
}
