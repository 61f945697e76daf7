//! `clone <metadata dev> <destination dev> <source dev> <region size> [<#features>
//! [no_hydration] [no_discard_passdown] [hydrate_on_read]] [<#core args>
//! [hydration_threshold <n>] [hydration_batch_size <n>] [max_hydration_rate <KiB/s>]]`
//!
//! Copies ("hydrates") a slow or remote source onto a fast destination while the device is in
//! use, as the kernel's dm-clone. Reads of regions not yet copied come from the source; writes
//! go to the destination (copying the region first unless the write covers all of it); a
//! bitmap on the metadata device, committed on FLUSH/FUA and every second, says which regions
//! are on the destination. Background workers copy the rest, skipping what the source reports
//! as zero and yielding to user I/O.
//!
//! udm adds: `hydrate_on_read` (a read of an unhydrated region copies it first, the kernel's
//! known gap), `max_hydration_rate` (a bandwidth cap for the background copy; also a message),
//! NBD_CMD_CACHE hydrating the range, and zero-aware copying.

mod hydration;
mod regions;

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use log::{error, info, warn};
use udm_block::{
    AlignedBuf, BlockDevice, BlockError, Capabilities, Extent, MapOp, Mapping, OpenMode, Result,
    WriteFlags, ZeroFlags, EXTENT_ZERO, SECTOR_SIZE,
};
use udm_metadata::{CloneGeometry, CloneMetadata, CommitOutcome};

use crate::args::Args;
use crate::pacing::{RateLimit, Throughput, UserActivity};
use crate::target::{EventSink, Target, TargetContext, TargetError};
use regions::RegionClaims;

const MIN_REGION_SECTORS: u64 = 8;
const MAX_REGION_SECTORS: u64 = 2_097_152;
/// On-demand copies (a user's write waiting) ask the source for zeroes only for regions at
/// least this large.
const ON_DEMAND_PROBE_MIN: u64 = 1 << 20;
/// Largest piece copied with one read and one write.
const COPY_CHUNK: u64 = 1 << 20;

thread_local! {
    /// Each copying thread reuses one buffer: allocating (and zeroing) a fresh megabyte per
    /// batch cost the background copy a good part of its throughput.
    static COPY_BUFFER: std::cell::RefCell<AlignedBuf> = std::cell::RefCell::new(AlignedBuf::new());
}

/// Metadata modes, as the kernel's: a failed commit drops to read-only (after reloading the
/// last committed bitmap), a failure to do even that to fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Mode {
    Write = 0,
    ReadOnly = 1,
    Fail = 2,
}

/// What the user can steer with messages.
struct Settings {
    hydration_enabled: bool,
    threshold: u64,
    batch_size: u64,
    /// The cap on background copying (`max_hydration_rate`).
    rate: RateLimit,
    /// Regions the background workers are copying.
    in_flight: u64,
    /// Where the next background batch starts looking.
    cursor: u64,
    paused: bool,
    shutdown: bool,
}

struct Inner {
    meta: CloneMetadata,
    source: Arc<dyn BlockDevice>,
    dest: Arc<dyn BlockDevice>,
    region: u64,
    len: u64,
    claims: RegionClaims,
    mode: AtomicU8,
    settings: Mutex<Settings>,
    /// Wakes background workers when settings change or work is released.
    wake: Condvar,
    discard_passdown: bool,
    hydrate_on_read: bool,
    /// The user's I/O, which background copying yields to.
    activity: Arc<UserActivity>,
    raise_event: EventSink,
    completion_announced: AtomicBool,
    /// Hydrated bytes once a second, for the copy rate.
    progress: Throughput,
}

pub struct Clone {
    inner: Arc<Inner>,
    activated: AtomicBool,
    args: Vec<String>,
    references: Vec<String>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

fn positive(args: &Args, key: &str, word: &str, min: u64) -> Result<u64, TargetError> {
    word.parse::<u64>()
        .ok()
        .filter(|v| *v >= min)
        .ok_or_else(|| args.error(format!("invalid value '{word}' for {key}")))
}

pub fn construct(args: &mut Args, ctx: &TargetContext) -> Result<Arc<dyn Target>, TargetError> {
    let original: Vec<String> = args.tokens().to_vec();
    if args.remaining() < 4 {
        return Err(args.error(format!(
            "expected at least 4 arguments (<metadata dev> <destination dev> <source dev> \
             <region size>), got {}",
            args.remaining()
        )));
    }
    let (meta_ref, meta_dev) = args.device(ctx, "metadata dev", OpenMode::Exclusive)?;
    let (dest_ref, dest) = args.device(ctx, "destination dev", OpenMode::Exclusive)?;
    let (source_ref, source) = args.device(ctx, "source dev", OpenMode::ReadOnly)?;
    let region_sectors: u64 = args.number("region size")?;
    if !region_sectors.is_power_of_two()
        || !(MIN_REGION_SECTORS..=MAX_REGION_SECTORS).contains(&region_sectors)
    {
        return Err(args.error(format!(
            "invalid region size {region_sectors}: must be a power of two from \
             {MIN_REGION_SECTORS} to {MAX_REGION_SECTORS} sectors"
        )));
    }
    for (reference, dev) in [(&dest_ref, &dest), (&source_ref, &source)] {
        ctx.require(reference, &**dev, 0, ctx.len)
            .map_err(|e| args.error(e))?;
    }
    let mut hydration_enabled = true;
    let mut discard_passdown = true;
    let mut hydrate_on_read = false;
    if args.remaining() > 0 {
        let count: usize = args.number("#features")?;
        if count > 3 || count > args.remaining() {
            return Err(args.error(format!("invalid number of feature arguments {count}")));
        }
        for _ in 0..count {
            match args.word("feature")?.to_ascii_lowercase().as_str() {
                "no_hydration" => hydration_enabled = false,
                "no_discard_passdown" => discard_passdown = false,
                "hydrate_on_read" => hydrate_on_read = true,
                other => return Err(args.error(format!("unsupported feature argument '{other}'"))),
            }
        }
    }
    let (mut threshold, mut batch_size, mut max_rate_kib) = (1, 1, 0);
    if args.remaining() > 0 {
        let count: usize = args.number("#core args")?;
        if count % 2 != 0 || count > 6 || count != args.remaining() {
            return Err(args.error(format!(
                "invalid number of core arguments {count}: key/value pairs, at most 3"
            )));
        }
        for _ in 0..count / 2 {
            let key = args.word("core arg")?.to_ascii_lowercase();
            let value = args.word("core arg value")?;
            match key.as_str() {
                "hydration_threshold" => threshold = positive(args, &key, value, 0)?,
                "hydration_batch_size" => batch_size = positive(args, &key, value, 1)?,
                "max_hydration_rate" => max_rate_kib = positive(args, &key, value, 0)?,
                other => return Err(args.error(format!("invalid core argument '{other}'"))),
            }
        }
    }
    let geometry = CloneGeometry {
        region_sectors,
        target_sectors: ctx.len / SECTOR_SIZE,
    };
    let meta = CloneMetadata::open(meta_dev.clone(), geometry)
        .map_err(|e| args.error(format!("metadata device '{meta_ref}': {e}")))?;
    let meta_bytes = geometry.required_blocks() * udm_metadata::BLOCK_SIZE as u64;
    ctx.require(&meta_ref, &*meta_dev, 0, meta_bytes)
        .map_err(|e| args.error(e))?;
    let inner = Arc::new(Inner {
        meta,
        source,
        dest,
        region: region_sectors * SECTOR_SIZE,
        len: ctx.len,
        claims: RegionClaims::default(),
        mode: AtomicU8::new(Mode::Write as u8),
        settings: Mutex::new(Settings {
            hydration_enabled,
            threshold,
            batch_size,
            rate: RateLimit::new(max_rate_kib),
            in_flight: 0,
            cursor: 0,
            // Nothing runs until the table is resumed (made live): an inactive table must
            // not touch what the live one is using.
            paused: true,
            shutdown: false,
        }),
        wake: Condvar::new(),
        discard_passdown,
        hydrate_on_read,
        activity: Arc::default(),
        raise_event: ctx.raise_event.clone(),
        completion_announced: AtomicBool::new(false),
        progress: Throughput::default(),
    });
    let workers = hydration::start(&inner);
    Ok(Arc::new(Clone {
        inner,
        activated: AtomicBool::new(false),
        args: original,
        references: vec![meta_ref, dest_ref, source_ref],
        workers: Mutex::new(workers),
    }))
}

impl Inner {
    fn mode(&self) -> Mode {
        match self.mode.load(Ordering::Acquire) {
            0 => Mode::Write,
            1 => Mode::ReadOnly,
            _ => Mode::Fail,
        }
    }

    fn check_not_failed(&self) -> Result<()> {
        if self.mode() == Mode::Fail {
            return Err(BlockError::Io(
                "clone: metadata failed; the device is in fail mode".into(),
            ));
        }
        Ok(())
    }

    fn regions_of(&self, offset: u64, len: u64) -> std::ops::Range<u64> {
        offset / self.region..(offset + len).div_ceil(self.region)
    }

    /// Byte range of a region (the last one may be short).
    fn bounds(&self, region: u64) -> (u64, u64) {
        (
            region * self.region,
            ((region + 1) * self.region).min(self.len),
        )
    }

    /// Copies `regions` from the source to the destination and marks them hydrated. With
    /// `probe_zeroes`, ranges the source reports as zero are zeroed on the destination instead
    /// of read and written; the probe costs a round trip to the source, worth it for the
    /// background copy, not while a user's write waits for a small region.
    /// The caller holds the regions' claims.
    fn copy_regions(&self, regions: std::ops::Range<u64>, probe_zeroes: bool) -> Result<()> {
        let start = self.bounds(regions.start).0;
        let end = self.bounds(regions.end - 1).1;
        COPY_BUFFER.with_borrow_mut(|buf| self.copy_range(start, end, probe_zeroes, buf))?;
        self.meta.set_hydrated(regions);
        self.announce_if_complete();
        Ok(())
    }

    /// Copies a background batch of contiguous claimed regions, at most a copy chunk (or one
    /// region) at a time, letting go of each piece's claims as soon as it is on the
    /// destination: a user's I/O to a claimed region waits for one piece, not the batch.
    fn copy_claimed(&self, claims: Vec<regions::Claim<'_>>) -> Result<()> {
        let per_piece = (COPY_CHUNK / self.region).max(1) as usize;
        let mut claims = claims.into_iter().peekable();
        while let Some(first) = claims.peek().map(|c| c.region) {
            let piece: Vec<_> = claims.by_ref().take(per_piece).collect();
            self.copy_regions(first..first + piece.len() as u64, true)?;
        }
        Ok(())
    }

    fn copy_range(
        &self,
        start: u64,
        end: u64,
        probe_zeroes: bool,
        buf: &mut AlignedBuf,
    ) -> Result<()> {
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
            }
            pos += run;
        }
        Ok(())
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
    fn ensure_hydrated(&self, region: u64) -> Result<()> {
        if self.meta.is_hydrated(region) {
            return Ok(());
        }
        if self.mode() != Mode::Write {
            return Err(BlockError::Io(format!(
                "clone: metadata is read-only; cannot hydrate region {region}"
            )));
        }
        let _claim = self.claims.claim(region);
        if self.meta.is_hydrated(region) {
            return Ok(());
        }
        self.copy_regions(region..region + 1, self.region >= ON_DEMAND_PROBE_MIN)
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

    /// Commits the bitmap if it changed (flushing the destination first), otherwise just
    /// flushes the destination. A metadata failure changes the mode.
    fn commit(&self) -> Result<()> {
        match self.mode() {
            Mode::Fail => return self.check_not_failed(),
            Mode::ReadOnly if self.meta.is_dirty() => {
                return Err(BlockError::Io(
                    "clone: metadata is read-only; cannot commit".into(),
                ))
            }
            Mode::ReadOnly => return self.dest.flush(),
            Mode::Write => {}
        }
        let data_error = Mutex::new(None);
        let flush_data = || {
            self.dest
                .flush()
                .inspect_err(|e| *data_error.lock().unwrap() = Some(e.clone()))
        };
        match self.meta.commit(&flush_data) {
            Ok(CommitOutcome::Committed) => Ok(()),
            Ok(CommitOutcome::NothingToCommit) => self.dest.flush(),
            Err(e) => {
                if let Some(data) = data_error.into_inner().unwrap() {
                    // The destination failed to flush: nothing was written to the metadata,
                    // which stays consistent; only this flush fails.
                    return Err(data);
                }
                self.metadata_failed(&e.to_string());
                Err(BlockError::Io(format!(
                    "clone: metadata commit failed: {e}"
                )))
            }
        }
    }

    /// write → read-only (reloading the last committed bitmap) → fail, each with an event.
    fn metadata_failed(&self, why: &str) {
        let next = match self.mode() {
            Mode::Write => match self.meta.load() {
                Ok(()) => Mode::ReadOnly,
                Err(e) => {
                    error!("clone: reloading metadata failed too: {e}");
                    Mode::Fail
                }
            },
            _ => Mode::Fail,
        };
        error!("clone: metadata operation failed ({why}); switching to {next:?} mode");
        self.mode.store(next as u8, Ordering::Release);
        self.wake.notify_all();
        (self.raise_event)();
    }

    fn is_complete(&self) -> bool {
        self.meta.hydrated_count() >= self.meta.regions()
    }

    /// Raises the hydration-complete event once (after committing, so the event means the
    /// clone can be switched to `linear <destination>` safely).
    fn announce_if_complete(&self) {
        if self.is_complete() && !self.completion_announced.load(Ordering::Acquire) {
            if let Err(e) = self.commit() {
                warn!("clone: final commit after hydration failed: {e}");
                return;
            }
            if !self.completion_announced.swap(true, Ordering::AcqRel) {
                (self.raise_event)();
            }
        }
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
        let mut pos = offset;
        while pos < end {
            let region = pos / self.region;
            let hydrated = self.meta.is_hydrated(region);
            let mut run_end = self.bounds(region).1.min(end);
            while run_end < end && self.meta.is_hydrated(run_end / self.region) == hydrated {
                run_end = self.bounds(run_end / self.region).1.min(end);
            }
            f(
                hydrated,
                pos,
                run_end - pos,
                (pos - offset) as usize..(run_end - offset) as usize,
            )?;
            pos = run_end;
        }
        Ok(())
    }
}

impl BlockDevice for Clone {
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

impl Target for Clone {
    fn type_name(&self) -> &'static str {
        "clone"
    }

    fn args(&self) -> String {
        self.args.join(" ")
    }

    fn status(&self) -> String {
        let s = &self.inner;
        if s.mode() == Mode::Fail {
            return "Fail".into();
        }
        let (used, total) = s.meta.blocks_used_and_total();
        let settings = s.settings.lock().unwrap();
        let mut features = Vec::new();
        if !settings.hydration_enabled {
            features.push("no_hydration");
        }
        if !s.discard_passdown {
            features.push("no_discard_passdown");
        }
        if s.hydrate_on_read {
            features.push("hydrate_on_read");
        }
        let mut core = format!(
            "hydration_threshold {} hydration_batch_size {}",
            settings.threshold, settings.batch_size
        );
        let mut core_count = 4;
        if settings.rate.kib_per_second() > 0 {
            core += &format!(" max_hydration_rate {}", settings.rate.kib_per_second());
            core_count = 6;
        }
        let features = std::iter::once(features.len().to_string())
            .chain(features.iter().map(|f| f.to_string()))
            .collect::<Vec<_>>()
            .join(" ");
        format!(
            "8 {used}/{total} {} {}/{} {} {features} {core_count} {core} {}",
            s.region / SECTOR_SIZE,
            s.meta.hydrated_count(),
            s.meta.regions(),
            s.claims.count(),
            if s.mode() == Mode::Write { "rw" } else { "ro" }
        )
    }

    fn status_details(&self) -> Option<serde_json::Value> {
        let s = &self.inner;
        let hydrated = s.meta.hydrated_count();
        let regions = s.meta.regions();
        let hydrated_bytes = (hydrated * s.region).min(s.len);
        let rate = s.progress.bytes_per_second();
        let eta = s.progress.eta_seconds(s.len - hydrated_bytes);
        Some(serde_json::json!({
            "mode": format!("{:?}", s.mode()).to_lowercase(),
            "regions": regions,
            "hydrated_regions": hydrated,
            "region_bytes": s.region,
            "total_bytes": s.len,
            "hydrated_bytes": hydrated_bytes,
            "hydrating_regions": s.claims.count(),
            "hydration_enabled": s.settings.lock().unwrap().hydration_enabled,
            "copy_rate_bytes_per_second": rate.map(f64::round),
            "eta_seconds": eta,
            "complete": hydrated >= regions,
            "progress": crate::pacing::progress_json(
                "hydration",
                hydrated_bytes,
                s.len,
                &s.progress,
                hydrated >= regions,
                (s.mode() != Mode::Write).then_some(
                    "the clone's metadata is no longer writable; hydration has stopped",
                ),
            ),
            "metadata_transaction": s.meta.transaction(),
            "metadata_fallback": s.meta.fallback().map(|f| serde_json::json!({
                "used_slot": f.used_slot,
                "used_transaction": f.used_transaction,
                "bad_slot": f.bad_slot,
                "bad_slot_claims_transaction": f.bad_slot_claims_transaction,
                "reason": f.reason,
            })),
        }))
    }

    fn message(&self, words: &[&str]) -> Result<String, TargetError> {
        let s = &self.inner;
        let lowered: Vec<String> = words.iter().map(|w| w.to_ascii_lowercase()).collect();
        let lowered: Vec<&str> = lowered.iter().map(String::as_str).collect();
        let number = |word: &str, min: u64| {
            word.parse::<u64>()
                .ok()
                .filter(|v| *v >= min)
                .ok_or_else(|| {
                    TargetError::new(format!("clone: invalid value '{word}' for {}", words[0]))
                })
        };
        let mut settings = s.settings.lock().unwrap();
        match lowered.as_slice() {
            ["enable_hydration"] => settings.hydration_enabled = true,
            ["disable_hydration"] => settings.hydration_enabled = false,
            ["hydration_threshold", n] => settings.threshold = number(n, 0)?,
            ["hydration_batch_size", n] => settings.batch_size = number(n, 1)?,
            ["max_hydration_rate", n] => settings.rate.set(number(n, 0)?),
            ["enable_hydration"
            | "disable_hydration"
            | "hydration_threshold"
            | "hydration_batch_size"
            | "max_hydration_rate", ..] => {
                return Err(TargetError::new(format!(
                    "clone: wrong number of arguments for '{}'",
                    words[0]
                )))
            }
            _ => {
                return Err(TargetError::new(format!(
                    "clone: unsupported message '{}'",
                    words.join(" ")
                )))
            }
        }
        drop(settings);
        s.wake.notify_all();
        Ok(String::new())
    }

    fn settings_messages(&self) -> Vec<String> {
        let settings = self.inner.settings.lock().unwrap();
        vec![
            if settings.hydration_enabled {
                "enable_hydration"
            } else {
                "disable_hydration"
            }
            .to_string(),
            format!("hydration_threshold {}", settings.threshold),
            format!("hydration_batch_size {}", settings.batch_size),
            format!("max_hydration_rate {}", settings.rate.kib_per_second()),
        ]
    }

    fn references(&self) -> Vec<String> {
        self.references.clone()
    }

    fn replacement(&self) -> Option<Result<String, TargetError>> {
        let s = &self.inner;
        Some(if s.is_complete() && !s.meta.is_dirty() {
            Ok(format!("linear {} 0", self.references[1]))
        } else {
            Err(TargetError::new(format!(
                "clone: hydration is not complete ({} of {} regions)",
                s.meta.hydrated_count(),
                s.meta.regions()
            )))
        })
    }

    fn suspend(&self) {
        hydration::pause(&self.inner, true);
        if let Err(e) = self.inner.commit() {
            warn!("clone: commit at suspend failed: {e}");
        }
    }

    fn resume(&self) {
        if !self.activated.swap(true, Ordering::AcqRel) {
            // A table loaded while another clone on the same metadata was live: reread what
            // that one committed at its suspend.
            if let Err(e) = self.inner.meta.load() {
                self.inner
                    .metadata_failed(&format!("rereading metadata on activation: {e}"));
            }
        }
        hydration::pause(&self.inner, false);
    }
}

impl Drop for Clone {
    fn drop(&mut self) {
        hydration::stop(&self.inner);
        // A copy waiting for a remote source that is down would hold up `udm remove` for the
        // whole remote timeout; the source is this table's own handle, so let it go first.
        // Regions being copied stay unhydrated and are copied again by the next table.
        self.inner.source.close();
        let copying = self.inner.settings.lock().unwrap().in_flight;
        if copying > 0 {
            info!("clone: stopping: waiting for {copying} region copies in flight");
        }
        for worker in self.workers.lock().unwrap().drain(..) {
            let _ = worker.join();
        }
        if self.inner.mode() == Mode::Write {
            if let Err(e) = self.inner.commit() {
                warn!("clone: final commit failed: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests;
