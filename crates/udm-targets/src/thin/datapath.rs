//! A thin device's I/O. Reads and writes of provisioned blocks go straight to the data
//! device — remapped through `map()` onto the data file on the hot path. A write to an
//! unprovisioned block allocates one and fills the rest of it (zeroes, unless
//! skip_block_zeroing; the external origin where it reaches); a write to a shared block
//! copies it to a new one (breaking sharing) unless it covers the whole block. Only the
//! block being changed is held (its cell), and the data is written before the mapping is
//! inserted, so a committed mapping never points at data that is not there.

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use udm_block::{
    push_extent, AlignedBuf, BlockDevice, BlockError, Capabilities, Extent, MapOp, Mapping, Place,
    Result, WriteFlags, ZeroFlags,
};

use super::cells::{Cell, Cells};
use super::core::InFlight;
use super::device::Thin;
use super::space::Stall;
use super::status::Mode;

/// Largest piece of a block read or written at once while filling it.
const CHUNK: u64 = 1 << 20;
/// Blocks one block-status answer covers at most.
const STATUS_BLOCKS: u64 = 1 << 16;

thread_local! {
    /// Each thread reuses one buffer for filling blocks.
    static FILL_BUFFER: std::cell::RefCell<AlignedBuf> = std::cell::RefCell::new(AlignedBuf::new());
}

/// What the parts of a new block that a write does not cover are filled from.
#[derive(Clone, Copy)]
enum Source {
    /// Zeroes (or nothing, with skip_block_zeroing).
    Zero,
    /// The external origin, from this virtual block's offset.
    Origin,
    /// The data block being unshared.
    Block(u64),
}

/// One block's part of a request: (virtual block, offset in the block, range in the request).
type Piece = (u64, u64, Range<usize>);

impl Thin {
    fn pieces(&self, offset: u64, len: u64) -> Vec<Piece> {
        let block = self.pool.block_bytes();
        crate::runs::by_unit(offset, len, block)
            .map(|(vblock, at, _, range)| (vblock, at % block, range))
            .collect()
    }

    fn key(&self, vblock: u64) -> (u32, u64) {
        (self.id(), vblock)
    }

    /// Bytes of the external origin from `pos` on that lie on it (0 without one).
    fn origin_reach(&self, pos: u64, len: u64) -> u64 {
        match &self.origin {
            Some(origin) => origin.size().saturating_sub(pos).min(len),
            None => 0,
        }
    }

    fn read_unprovisioned(&self, pos: u64, buf: &mut [u8]) -> Result<()> {
        let on_origin = self.origin_reach(pos, buf.len() as u64) as usize;
        if let Some(origin) = &self.origin {
            if on_origin > 0 {
                origin.read(pos, &mut buf[..on_origin])?;
            }
        }
        buf[on_origin..].fill(0);
        Ok(())
    }

    /// Runs `f` inside the pool's gate; when it runs out of data space, leaves the gate (so
    /// that the pool can be suspended and grown), waits for space and runs it again — unless
    /// this device is being suspended, which must not wait for space (see `presuspend`).
    fn retrying_on_space(
        &self,
        mut f: impl FnMut() -> std::result::Result<(), Stall>,
    ) -> Result<()> {
        loop {
            let in_flight = self.pool.enter()?;
            match f() {
                Ok(()) => return Ok(()),
                Err(Stall::Failed(e)) => return Err(e),
                Err(Stall::NoSpace(_)) if self.suspending.load(Ordering::SeqCst) => {
                    return Err(if self.pushing_back.load(Ordering::SeqCst) {
                        BlockError::Requeue(format!(
                            "thin: no data space in pool '{}' while suspending with noflush",
                            self.pool.name
                        ))
                    } else {
                        self.pool.no_space_error()
                    });
                }
                Err(Stall::NoSpace(generation)) => {
                    drop(in_flight);
                    self.pool.wait_for_space(generation)?;
                }
            }
        }
    }

    /// Runs `piece` on each block's part of `[offset, offset + len)`, all again when the pool
    /// ran out of space and has room again; then, for FUA, commits (what `flush` does).
    fn each_piece(
        &self,
        offset: u64,
        len: u64,
        fua: bool,
        piece: impl Fn(u64, u64, Range<usize>) -> std::result::Result<(), Stall>,
    ) -> Result<()> {
        let pieces = self.pieces(offset, len);
        self.retrying_on_space(|| {
            for (vblock, at, range) in &pieces {
                piece(*vblock, *at, range.clone())?;
            }
            Ok(())
        })?;
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    /// Writes `data` at `at` in data block `data_block`, this device's own.
    fn write_provisioned(
        &self,
        data_block: u64,
        at: u64,
        data: &[u8],
    ) -> std::result::Result<(), Stall> {
        let offset = data_block * self.pool.block_bytes() + at;
        Ok(self
            .pool
            .data()
            .write(offset, data, WriteFlags::default())?)
    }

    fn write_block(&self, vblock: u64, at: u64, data: &[u8]) -> std::result::Result<(), Stall> {
        let cells = &*self.pool.cells;
        let block = self.pool.block_bytes();
        {
            let _cell = Cells::shared(cells, self.key(vblock));
            if let Some(m) = self.pool.lookup(self.id(), vblock)? {
                if !m.shared {
                    return self.write_provisioned(m.data_block, at, data);
                }
            }
        }
        let _cell = Cells::exclusive(cells, self.key(vblock));
        let source = match self.pool.lookup(self.id(), vblock)? {
            // Provisioned by someone else while we waited for the cell.
            Some(m) if !m.shared => return self.write_provisioned(m.data_block, at, data),
            Some(m) => Source::Block(m.data_block),
            None if self.origin_reach(vblock * block, 1) > 0 => Source::Origin,
            None => Source::Zero,
        };
        let (new, epoch) = self.pool.allocate()?;
        if let Err(e) = self.fill(vblock, new, source, at, data) {
            self.pool.give_back(new, epoch);
            return Err(e.into());
        }
        self.pool.insert(self.id(), vblock, new, epoch)?;
        Ok(())
    }

    /// Writes `data` at `at` into the new data block `new`, and the rest of the block from
    /// `source`, a chunk at a time (one write per chunk: the source read into a buffer and
    /// the new data laid over it).
    fn fill(&self, vblock: u64, new: u64, source: Source, at: u64, data: &[u8]) -> Result<()> {
        let block = self.pool.block_bytes();
        let data_dev = self.pool.data();
        let base = new * block;
        let written = at..at + data.len() as u64;
        if written == (0..block) {
            return data_dev.write(base, data, WriteFlags::default());
        }
        let zeroing = self.pool.features().zero_new_blocks;
        let mut chunk_start = 0;
        while chunk_start < block {
            let chunk = chunk_start..(chunk_start + CHUNK).min(block);
            let overlap = written.start.max(chunk.start)..written.end.min(chunk.end);
            let data_part = |r: &Range<u64>| &data[(r.start - at) as usize..(r.end - at) as usize];
            if overlap == chunk {
                data_dev.write(base + chunk.start, data_part(&chunk), WriteFlags::default())?;
            } else if matches!(source, Source::Zero) && !zeroing {
                if !overlap.is_empty() {
                    data_dev.write(
                        base + overlap.start,
                        data_part(&overlap),
                        WriteFlags::default(),
                    )?;
                }
            } else if overlap.is_empty() && matches!(source, Source::Zero) {
                data_dev.write_zeroes(
                    base + chunk.start,
                    chunk.end - chunk.start,
                    ZeroFlags::default(),
                )?;
            } else {
                FILL_BUFFER.with_borrow_mut(|buf| -> Result<()> {
                    buf.resize((chunk.end - chunk.start) as usize);
                    match source {
                        Source::Zero => buf.fill(0),
                        Source::Origin => {
                            self.read_unprovisioned(vblock * block + chunk.start, buf)?
                        }
                        Source::Block(old) => data_dev.read(old * block + chunk.start, buf)?,
                    }
                    if !overlap.is_empty() {
                        let into = (overlap.start - chunk.start) as usize;
                        buf[into..into + (overlap.end - overlap.start) as usize]
                            .copy_from_slice(data_part(&overlap));
                    }
                    data_dev.write(base + chunk.start, buf, WriteFlags::default())
                })?;
            }
            chunk_start = chunk.end;
        }
        Ok(())
    }

    /// Zeroes one block's piece. An unprovisioned block with no origin under it reads as
    /// zeroes already (zeroing part of it must not allocate it: fstrim sends the edges of
    /// every free extent); a whole provisioned one is unmapped when allowed; anything else is
    /// written with zeroes.
    fn zero_piece(
        &self,
        vblock: u64,
        at: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> std::result::Result<(), Stall> {
        let block = self.pool.block_bytes();
        let on_origin = self.origin_reach(vblock * block, block) > 0;
        {
            let _cell = Cells::exclusive(&*self.pool.cells, self.key(vblock));
            match self.pool.lookup(self.id(), vblock)? {
                None if !on_origin => return Ok(()),
                Some(_) if flags.may_unmap && !on_origin && at == 0 && len == block => {
                    return Ok(self.pool.unmap(self.id(), vblock)?)
                }
                _ => {}
            }
        }
        if flags.fast_only {
            return Err(BlockError::NotSupported(
                "thin: zeroing part of a block writes zeroes".into(),
            )
            .into());
        }
        let zeroes = AlignedBuf::zeroed(len.min(CHUNK) as usize);
        let mut done = 0;
        while done < len {
            let n = (len - done).min(CHUNK);
            self.write_block(vblock, at + done, &zeroes[..n as usize])?;
            done += n;
        }
        Ok(())
    }

    /// Remaps a read or write of provisioned, unshared blocks onto the data device; `None`
    /// for anything that needs the pool's attention (or would wait).
    fn map_blocks(&self, op: MapOp, offset: u64, len: u64) -> Option<Mapping> {
        let pool = &self.pool;
        let in_flight = pool.gate.try_enter().then(|| InFlight(pool.clone()))?;
        if pool.mode() == Mode::Fail {
            return None;
        }
        let pieces = self.pieces(offset, len);
        let mut cells: Vec<Cell<Arc<Cells>>> = Vec::with_capacity(pieces.len());
        for (vblock, _, _) in &pieces {
            cells.push(Cells::try_shared(pool.cells.clone(), self.key(*vblock))?);
        }
        let block = pool.block_bytes();
        // Per piece, its data block; None for a read of a block that reads as zeroes.
        let mut places = Vec::with_capacity(pieces.len());
        let mut meta = None;
        for (vblock, _, _) in &pieces {
            let found = match pool.cached(self.id(), *vblock) {
                Some(m) => Some(m),
                None => {
                    // Only when the metadata is free (not committing): map() must not wait.
                    if meta.is_none() {
                        meta = Some(pool.try_meta()?);
                    }
                    let meta = meta.as_mut().expect("locked above");
                    pool.lookup_locked(meta, self.id(), *vblock).ok()?
                }
            };
            match found {
                Some(m) if op.is_write() && m.shared => return None,
                Some(m) => places.push(Some(m.data_block)),
                // Unprovisioned without an origin under it: zeroes, while the cell holds it.
                None if !op.is_write() && self.origin_reach(*vblock * block, block) == 0 => {
                    places.push(None)
                }
                None => return None,
            }
        }
        drop(meta);
        let data = pool.data();
        let mut mapping = Mapping::new();
        for ((_, at, range), place) in pieces.iter().zip(places) {
            let len = range.len() as u64;
            let lower = match place {
                Some(data_block) => data.map(op, data_block * block + at, len)?,
                None => Mapping::single(len, Place::Zero),
            };
            mapping.append(range.start as u64, lower);
        }
        // One hold for both (one allocation per request); the cells go before the gate.
        Some(mapping.hold((cells, in_flight)))
    }
}

impl BlockDevice for Thin {
    fn size(&self) -> u64 {
        self.len
    }

    fn capabilities(&self) -> Capabilities {
        let data = self.pool.data().capabilities();
        Capabilities {
            read_only: false,
            native_fua: true,
            discard: self.pool.features().discard_enabled,
            fast_zero: false,
            rotational: data.rotational,
            flush_covers_all: true,
        }
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let _in = self.pool.enter()?;
        let block = self.pool.block_bytes();
        let data = self.pool.data();
        for (vblock, at, range) in self.pieces(offset, buf.len() as u64) {
            let _cell = Cells::shared(&*self.pool.cells, self.key(vblock));
            match self.pool.lookup(self.id(), vblock)? {
                Some(m) => data.read(m.data_block * block + at, &mut buf[range])?,
                None => self.read_unprovisioned(vblock * block + at, &mut buf[range])?,
            }
        }
        Ok(())
    }

    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> Result<()> {
        self.each_piece(offset, buf.len() as u64, flags.fua, |vblock, at, range| {
            self.write_block(vblock, at, &buf[range])
        })
    }

    fn flush(&self) -> Result<()> {
        let _in = self.pool.enter()?;
        self.pool.commit()?;
        self.pool.check_lost_writes(self.id())
    }

    /// Unmaps the blocks the range covers whole; parts of blocks are left as they are (a
    /// discard is a hint). Blocks no other device maps are discarded on the data device at
    /// the next commit, with discard passdown.
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        if !self.pool.features().discard_enabled {
            return Ok(());
        }
        let _in = self.pool.enter()?;
        if self.pool.mode() >= Mode::ReadOnly {
            return Ok(());
        }
        let block = self.pool.block_bytes();
        let end = offset + len;
        let first = offset.div_ceil(block);
        // The device's last block counts as covered when the range reaches the device's end.
        let last = if end == self.len {
            end.div_ceil(block)
        } else {
            end / block
        };
        for vblock in first..last.max(first) {
            let _cell = Cells::exclusive(&*self.pool.cells, self.key(vblock));
            self.pool.unmap(self.id(), vblock)?;
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.each_piece(offset, len, flags.fua, |vblock, at, range| {
            self.zero_piece(vblock, at, range.len() as u64, flags)
        })
    }

    /// Mapped blocks are data, unmapped ones holes — or what the external origin says of
    /// them where it reaches.
    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        let _in = self.pool.enter()?;
        let block = self.pool.block_bytes();
        // A bounded answer (callers ask again for the rest): the walk holds the metadata lock.
        let end = (offset + len).min((offset / block + STATUS_BLOCKS) * block);
        let runs = self
            .pool
            .lookup_range(self.id(), offset / block, end.div_ceil(block))?;
        let mut extents = Vec::new();
        let mut pos = offset;
        for (vblock, _, count, _) in runs.into_iter().chain([(u64::MAX, 0, 0, false)]) {
            let run_start = vblock.saturating_mul(block).max(offset).min(end);
            if run_start > pos {
                // A gap: unprovisioned.
                let on_origin = self.origin_reach(pos, run_start - pos);
                if on_origin > 0 {
                    let origin = self.origin.as_ref().expect("reach implies an origin");
                    // The origin's answer may be short: stop there, the caller asks again.
                    for e in origin.block_status(pos, on_origin)? {
                        push_extent(&mut extents, e);
                    }
                    return Ok(extents);
                }
                push_extent(&mut extents, Extent::hole(run_start - pos));
                pos = run_start;
            }
            if vblock == u64::MAX {
                break;
            }
            let run_end = ((vblock + count) * block).min(end);
            if run_end > pos {
                push_extent(&mut extents, Extent::data(run_end - pos));
                pos = run_end;
            }
        }
        Ok(extents)
    }

    fn map(&self, op: MapOp, offset: u64, len: u64) -> Option<Mapping> {
        // Discards and write-zeroes mean something of their own here: the synchronous way.
        if op.is_fill() {
            return None;
        }
        match op {
            // A flush with nothing to commit is the data device's flush; with metadata to
            // commit, the pool does it.
            MapOp::Flush => {
                let pool = &self.pool;
                let in_flight = pool.gate.try_enter().then(|| InFlight(pool.clone()))?;
                if pool.is_dirty()
                    || pool.mode() == Mode::Fail
                    || pool.check_lost_writes(self.id()).is_err()
                {
                    return None;
                }
                Some(pool.data().map(op, 0, 0)?.hold(in_flight))
            }
            // A FUA write is durable once its mapping is: only when nothing is uncommitted,
            // and it fails (the synchronous way) after lost writes, as a flush does. Checked
            // once the mapping holds the blocks' cells, so that their mappings can no longer
            // change: checked before, a block provisioned in between was found mapped but
            // not committed.
            MapOp::Write { fua: true } => {
                let mapping = self.map_blocks(op, offset, len)?;
                if self.pool.is_dirty() || self.pool.check_lost_writes(self.id()).is_err() {
                    return None;
                }
                Some(mapping)
            }
            _ => self.map_blocks(op, offset, len),
        }
    }
}
