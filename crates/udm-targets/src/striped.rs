//! `striped <#stripes> <chunk sectors> (<dev> <offset>)+`: chunks go round-robin over the
//! stripes.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use udm_block::{
    push_extent, BlockDevice, Capabilities, Extent, MapOp, Mapping, OpenMode, Result, WriteFlags,
    ZeroFlags, SECTOR_SIZE,
};

use crate::args::Args;
use crate::target::{Target, TargetContext, TargetError};

struct Stripe {
    reference: String,
    dev: Arc<dyn BlockDevice>,
    offset: u64,
    /// Failed requests, shown as `D` (dead) instead of `A` in the status line.
    errors: AtomicU64,
}

/// The most chunks a discard or write-zeroes may span and still be mapped.
const MAX_MAPPED_FILL_CHUNKS: u64 = 4096;

pub struct Striped {
    stripes: Vec<Stripe>,
    chunk: u64,
    len: u64,
}

pub fn construct(args: &mut Args, ctx: &TargetContext) -> Result<Arc<dyn Target>, TargetError> {
    let count: u64 = args.number("#stripes")?;
    if count == 0 {
        return Err(args.error("<#stripes> must be at least 1"));
    }
    let chunk = args.sectors("chunk size")?;
    if chunk < 8 * SECTOR_SIZE {
        return Err(args.error(format!(
            "<chunk size> {} is below the minimum of 8 sectors",
            chunk / SECTOR_SIZE
        )));
    }
    if !ctx.len.is_multiple_of(chunk * count) {
        return Err(args.error(format!(
            "target length {} is not a multiple of chunk size {} x {count} stripes",
            ctx.len / SECTOR_SIZE,
            chunk / SECTOR_SIZE
        )));
    }
    if args.remaining() as u64 != count * 2 {
        return Err(args.error(format!(
            "expected {count} <dev> <offset> pairs, got {} arguments",
            args.remaining()
        )));
    }
    let per_stripe = ctx.len / count;
    let mut stripes = Vec::new();
    for _ in 0..count {
        let (reference, dev) = args.device(ctx, "dev", OpenMode::ReadWrite)?;
        let offset = args.sectors("offset")?;
        ctx.require(&reference, &*dev, offset, per_stripe)
            .map_err(|e| args.error(e))?;
        stripes.push(Stripe {
            reference,
            dev,
            offset,
            errors: AtomicU64::new(0),
        });
    }
    Ok(Arc::new(Striped {
        stripes,
        chunk,
        len: ctx.len,
    }))
}

/// Most chunks one block-status answer walks (1 GiB with 4 KiB chunks). The walk is
/// arithmetic over one answer per stripe, so this bounds the CPU spent per request.
const MAX_STATUS_CHUNKS: u64 = 1 << 18;
/// Most runs in one block-status answer (a device whose chunks alternate data and holes).
const MAX_STATUS_EXTENTS: usize = 1024;

/// The part of a request that falls in one chunk.
struct Piece {
    stripe: usize,
    /// Offset on the stripe's device.
    at: u64,
    /// Offset within the request.
    done: u64,
    len: u64,
}

impl Striped {
    /// The request's chunk pieces, in order.
    fn pieces(&self, offset: u64, len: u64) -> impl Iterator<Item = Piece> + '_ {
        let count = self.stripes.len() as u64;
        let mut done = 0;
        std::iter::from_fn(move || {
            if done >= len {
                return None;
            }
            let pos = offset + done;
            let chunk_index = pos / self.chunk;
            let in_chunk = pos % self.chunk;
            let n = (self.chunk - in_chunk).min(len - done);
            let stripe = (chunk_index % count) as usize;
            let at = self.stripes[stripe].offset + (chunk_index / count) * self.chunk + in_chunk;
            let piece = Piece {
                stripe,
                at,
                done,
                len: n,
            };
            done += n;
            Some(piece)
        })
    }

    /// Calls `f(stripe, offset on its device, range of the request)` per chunk piece.
    fn each_chunk(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(&Stripe, u64, std::ops::Range<usize>) -> Result<()>,
    ) -> Result<()> {
        for p in self.pieces(offset, len) {
            let stripe = &self.stripes[p.stripe];
            f(stripe, p.at, p.done as usize..(p.done + p.len) as usize).inspect_err(|_| {
                stripe.errors.fetch_add(1, Ordering::Relaxed);
            })?;
        }
        Ok(())
    }
}

impl BlockDevice for Striped {
    fn size(&self) -> u64 {
        self.len
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::weakest(self.stripes.iter().map(|s| s.dev.capabilities()))
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.each_chunk(offset, buf.len() as u64, |s, at, r| {
            s.dev.read(at, &mut buf[r])
        })
    }
    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> Result<()> {
        self.each_chunk(offset, buf.len() as u64, |s, at, r| {
            s.dev.write(at, &buf[r], flags)
        })
    }
    fn flush(&self) -> Result<()> {
        udm_block::flush_every(self.stripes.iter().map(|s| &*s.dev))
    }
    fn map(&self, op: MapOp, offset: u64, len: u64) -> Option<Mapping> {
        // A discard may span up to 4 GiB: one piece per chunk would be millions of pieces
        // held at once. Beyond this many chunks it goes the synchronous way, chunk by chunk.
        if op.is_fill() && len.div_ceil(self.chunk) > MAX_MAPPED_FILL_CHUNKS {
            return None;
        }
        let mut mapping = Mapping::new();
        if op == MapOp::Flush {
            for stripe in &self.stripes {
                mapping.append(0, stripe.dev.map(op, 0, 0)?);
            }
            return Some(mapping);
        }
        for p in self.pieces(offset, len) {
            mapping.append(p.done, self.stripes[p.stripe].dev.map(op, p.at, p.len)?);
            // Stripes over fragmented devices multiply the pieces (see MAX_MAPPED_PIECES).
            if mapping.is_too_large() {
                return None;
            }
        }
        Some(mapping)
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.each_chunk(offset, len, |s, at, r| s.dev.discard(at, r.len() as u64))
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.each_chunk(offset, len, |s, at, r| {
            s.dev.write_zeroes(at, r.len() as u64, flags)
        })
    }
    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        // A stripe holds its chunks of the range back to back, so one question per stripe
        // covers them all; the answers are dealt back out chunk by chunk and equal runs
        // joined, so a sparse device answers in a few extents, not one per chunk.
        let len = len.min((offset / self.chunk + MAX_STATUS_CHUNKS) * self.chunk - offset);
        let mut spans: Vec<Option<(u64, u64)>> = vec![None; self.stripes.len()];
        for p in self.pieces(offset, len) {
            let span = spans[p.stripe].get_or_insert((p.at, p.at));
            span.1 = p.at + p.len;
        }
        let mut answers = Vec::with_capacity(self.stripes.len());
        for (stripe, span) in self.stripes.iter().zip(spans) {
            let extents = match span {
                Some((start, end)) => {
                    stripe
                        .dev
                        .block_status(start, end - start)
                        .inspect_err(|_| {
                            stripe.errors.fetch_add(1, Ordering::Relaxed);
                        })?
                }
                None => Vec::new(),
            };
            answers.push(VecDeque::from(extents));
        }
        let mut extents = Vec::new();
        'pieces: for p in self.pieces(offset, len) {
            let answer = &mut answers[p.stripe];
            let mut left = p.len;
            while left > 0 {
                // A stripe's answer may stop short: so does ours, the caller asks again.
                let Some(front) = answer.front_mut() else {
                    break 'pieces;
                };
                let take = front.len.min(left);
                push_extent(
                    &mut extents,
                    Extent {
                        len: take,
                        flags: front.flags,
                    },
                );
                front.len -= take;
                left -= take;
                if front.len == 0 {
                    answer.pop_front();
                }
            }
            if extents.len() >= MAX_STATUS_EXTENTS {
                break;
            }
        }
        Ok(extents)
    }
}

impl Target for Striped {
    fn type_name(&self) -> &'static str {
        "striped"
    }
    fn args(&self) -> String {
        let mut out = format!("{} {}", self.stripes.len(), self.chunk / SECTOR_SIZE);
        for s in &self.stripes {
            out += &format!(" {} {}", s.reference, s.offset / SECTOR_SIZE);
        }
        out
    }
    fn status(&self) -> String {
        let names: Vec<_> = self.stripes.iter().map(|s| s.reference.as_str()).collect();
        let health: String = self
            .stripes
            .iter()
            .map(|s| {
                if s.errors.load(Ordering::Relaxed) > 0 {
                    'D'
                } else {
                    'A'
                }
            })
            .collect();
        format!("{} {} 1 {health}", self.stripes.len(), names.join(" "))
    }
    fn references(&self) -> Vec<String> {
        self.stripes.iter().map(|s| s.reference.clone()).collect()
    }
}

#[cfg(test)]
mod power_cut;

#[cfg(test)]
mod tests {
    use crate::testing::{assert_refused, build, memory_resolver};
    use udm_block::{BlockDevice, Extent};

    use udm_testkit::{conformance, pattern};

    #[test]
    fn block_status_joins_chunks_into_runs() {
        // 32 MiB in 8192 chunks of 4 KiB; data in chunks 5 (on b) and 6 (on a) only.
        let resolver = memory_resolver(&[("a", 16 << 20), ("b", 16 << 20)]);
        let table = build(&resolver, "0 65536 striped 2 8 a 0 b 0").unwrap();
        table
            .write(5 * 4096, &[1u8; 8192], Default::default())
            .unwrap();
        let size = table.size();
        assert_eq!(
            table.block_status(0, size).unwrap(),
            vec![
                Extent::hole(5 * 4096),
                Extent::data(8192),
                Extent::hole(size - 7 * 4096)
            ]
        );
        // From inside a chunk, and stopping inside one.
        assert_eq!(
            table.block_status(512, 7 * 4096).unwrap(),
            vec![
                Extent::hole(5 * 4096 - 512),
                Extent::data(8192),
                Extent::hole(512)
            ]
        );
    }

    #[test]
    fn passes_the_conformance_suite_and_places_chunks_round_robin() {
        let resolver = memory_resolver(&[("a", 8 << 20), ("b", 8 << 20)]);
        let table = build(&resolver, "0 16384 striped 2 16 a 0 b 2048").unwrap();
        conformance::run_all(&table);
        // Chunk 1 (bytes 8192..16384) is the first chunk on b, 1 MiB in.
        let data = pattern(8192, 5);
        table.write(8192, &data, Default::default()).unwrap();
        let mut buf = vec![0u8; 8192];
        resolver.get("b").read(1 << 20, &mut buf).unwrap();
        assert_eq!(&buf[..], &data[..]);
        assert_eq!(table.status_lines()[0], "0 16384 striped 2 a b 1 AA");
    }

    #[test]
    fn refuses_bad_geometry() {
        let resolver = memory_resolver(&[("a", 8 << 20), ("b", 8 << 20)]);
        assert_refused(
            &resolver,
            &[
                (
                    "0 16384 striped 2 4 a 0 b 0",
                    "below the minimum of 8 sectors",
                ),
                (
                    "0 16376 striped 2 8 a 0 b 0",
                    "not a multiple of chunk size 8 x 2",
                ),
                ("0 16384 striped 2 8 a 0", "expected 2 <dev> <offset> pairs"),
                ("0 16384 striped 0 8", "<#stripes> must be at least 1"),
                ("0 16384 striped 2 8 a 16384 b 0", "device 'a' has"),
            ],
        );
    }
}
