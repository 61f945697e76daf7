//! `striped <#stripes> <chunk sectors> (<dev> <offset>)+`: chunks go round-robin over the
//! stripes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use udm_block::{
    BlockDevice, Capabilities, Extent, OpenMode, Result, WriteFlags, ZeroFlags, SECTOR_SIZE,
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
    if ctx.len % (chunk * count) != 0 {
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

impl Striped {
    /// Calls `f(stripe, offset on its device, range of the request)` per chunk piece.
    fn each_chunk(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(&Stripe, u64, std::ops::Range<usize>) -> Result<()>,
    ) -> Result<()> {
        let count = self.stripes.len() as u64;
        let mut done = 0;
        while done < len {
            let pos = offset + done;
            let chunk_index = pos / self.chunk;
            let in_chunk = pos % self.chunk;
            let n = (self.chunk - in_chunk).min(len - done);
            let stripe = &self.stripes[(chunk_index % count) as usize];
            let at = stripe.offset + (chunk_index / count) * self.chunk + in_chunk;
            f(stripe, at, done as usize..(done + n) as usize).inspect_err(|_| {
                stripe.errors.fetch_add(1, Ordering::Relaxed);
            })?;
            done += n;
        }
        Ok(())
    }
}

impl BlockDevice for Striped {
    fn size(&self) -> u64 {
        self.len
    }
    fn capabilities(&self) -> Capabilities {
        let caps: Vec<_> = self.stripes.iter().map(|s| s.dev.capabilities()).collect();
        Capabilities::weakest(caps.iter())
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
        self.stripes.iter().try_for_each(|s| s.dev.flush())
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
        // Within one chunk the stripe's own answer holds; the caller asks again after it.
        let in_chunk = self.chunk - offset % self.chunk;
        let mut extents = Vec::new();
        self.each_chunk(offset, len.min(in_chunk), |s, at, r| {
            extents = s.dev.block_status(at, r.len() as u64)?;
            Ok(())
        })?;
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
mod tests {
    use crate::testing::{build, memory_resolver};
    use udm_block::{conformance, BlockDevice};

    #[test]
    fn passes_the_conformance_suite_and_places_chunks_round_robin() {
        let resolver = memory_resolver(&[("a", 8 << 20), ("b", 8 << 20)]);
        let table = build(&resolver, "0 16384 striped 2 16 a 0 b 2048").unwrap();
        conformance::run_all(&table);
        // Chunk 1 (bytes 8192..16384) is the first chunk on b, 1 MiB in.
        let data = conformance::pattern(8192, 5);
        table.write(8192, &data, Default::default()).unwrap();
        let mut buf = vec![0u8; 8192];
        resolver.get("b").read(1 << 20, &mut buf).unwrap();
        assert_eq!(&buf[..], &data[..]);
        assert_eq!(table.status_lines()[0], "0 16384 striped 2 a b 1 AA");
    }

    #[test]
    fn refuses_bad_geometry() {
        let resolver = memory_resolver(&[("a", 8 << 20), ("b", 8 << 20)]);
        for (text, expected) in [
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
        ] {
            let err = build(&resolver, text).err().unwrap().to_string();
            assert!(err.contains(expected), "{text}: {err}");
        }
    }
}
