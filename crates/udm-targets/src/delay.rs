//! `delay <dev> <offset> <ms> [<write dev> <offset> <ms> [<flush dev> <offset> <ms>]]`: adds
//! latency, for example to make a local file behave like a slow disk or a remote source.
//!
//! With one group every request is delayed alike; with two, the second group takes writes
//! (and flushes); with three, flushes have their own. As in the kernel, each group may name a
//! different device. Over devices that remap, requests remap too and wait on a timer
//! ([`crate::timer`]); otherwise they sleep on the thread that runs them.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use udm_block::{
    BlockDevice, Capabilities, Extent, MapOp, Mapping, OpenMode, Pending, Result, WriteFlags,
    ZeroFlags,
};

use crate::args::Args;
use crate::filter::Lower;
use crate::target::{Target, TargetContext, TargetError};
use crate::timer;

struct Group {
    lower: Lower,
    delay: Duration,
}

#[derive(Clone, Copy)]
enum Kind {
    Read = 0,
    Write = 1,
    Flush = 2,
}

pub struct Delay {
    groups: Vec<Group>,
    /// Requests of each kind delayed right now (the status line's counts); shared with the
    /// timer steps of mapped requests.
    delayed: Arc<[AtomicU32; 3]>,
}

pub fn construct(args: &mut Args, ctx: &TargetContext) -> Result<Arc<dyn Target>, TargetError> {
    if !matches!(args.remaining(), 3 | 6 | 9) {
        return Err(args.error(format!(
            "expected 3, 6 or 9 arguments (<dev> <offset> <ms> per group), got {}",
            args.remaining()
        )));
    }
    let mut groups = Vec::new();
    while args.remaining() > 0 {
        let lower = Lower::parse(args, ctx, OpenMode::ReadWrite)?;
        let ms: u32 = args.number("delay ms")?;
        groups.push(Group {
            lower,
            delay: Duration::from_millis(ms.into()),
        });
    }
    Ok(Arc::new(Delay {
        groups,
        delayed: Arc::default(),
    }))
}

impl Delay {
    fn group(&self, kind: Kind) -> &Group {
        &self.groups[(kind as usize).min(self.groups.len() - 1)]
    }

    /// Sleeps for the group that handles `kind`, then runs `op` on its device.
    fn run<T>(&self, kind: Kind, op: impl FnOnce(&Lower) -> Result<T>) -> Result<T> {
        let group = self.group(kind);
        if !group.delay.is_zero() {
            let counter = &self.delayed[kind as usize];
            counter.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(group.delay);
            counter.fetch_sub(1, Ordering::Relaxed);
        }
        op(&group.lower)
    }
}

impl BlockDevice for Delay {
    fn size(&self) -> u64 {
        self.groups[0].lower.len
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::weakest(self.groups.iter().map(|g| g.lower.dev.capabilities()))
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.run(Kind::Read, |l| l.dev.read(l.offset + offset, buf))
    }
    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> Result<()> {
        self.run(Kind::Write, |l| l.dev.write(l.offset + offset, buf, flags))
    }
    fn flush(&self) -> Result<()> {
        self.run(Kind::Flush, |l| l.dev.flush())
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.run(Kind::Write, |l| l.dev.discard(l.offset + offset, len))
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.run(Kind::Write, |l| {
            l.dev.write_zeroes(l.offset + offset, len, flags)
        })
    }
    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.run(Kind::Read, |l| l.dev.block_status(l.offset + offset, len))
    }

    /// The group's device's mapping, after a timer step: the request waits for its delay
    /// without a thread sleeping for it (the kernel's dm-delay queues bios on a timer too).
    fn map(&self, op: MapOp, offset: u64, len: u64) -> Option<Mapping> {
        // Discards and zeroing are delayed as writes, as on the synchronous path.
        let kind = match op {
            MapOp::Read => Kind::Read,
            MapOp::Write { .. } | MapOp::Discard { .. } | MapOp::WriteZeroes { .. } => Kind::Write,
            MapOp::Flush => Kind::Flush,
        };
        let group = self.group(kind);
        let lower = &group.lower;
        let mapping = match op {
            MapOp::Flush => lower.dev.map(op, 0, 0)?,
            _ => lower.dev.map(op, lower.offset + offset, len)?,
        };
        if group.delay.is_zero() {
            return Some(mapping);
        }
        let delayed = self.delayed.clone();
        let wait = group.delay;
        Some(mapping.after(Pending::new(move |done| {
            delayed[kind as usize].fetch_add(1, Ordering::Relaxed);
            timer::after(wait, move || {
                delayed[kind as usize].fetch_sub(1, Ordering::Relaxed);
            })
            .start(done)
        })))
    }
}

impl Target for Delay {
    fn type_name(&self) -> &'static str {
        "delay"
    }
    fn args(&self) -> String {
        let groups: Vec<_> = self
            .groups
            .iter()
            .map(|g| format!("{} {}", g.lower.args(), g.delay.as_millis()))
            .collect();
        groups.join(" ")
    }
    fn status(&self) -> String {
        // As the kernel: reads and writes in flight, and flushes when they have a group.
        let shown = if self.groups.len() == 3 { 3 } else { 2 };
        let counts: Vec<_> = self.delayed[..shown]
            .iter()
            .map(|c| c.load(Ordering::Relaxed).to_string())
            .collect();
        counts.join(" ")
    }
    fn references(&self) -> Vec<String> {
        self.groups
            .iter()
            .map(|g| g.lower.reference.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use crate::testing::{assert_refused, build, memory_resolver};
    use std::time::Instant;
    use udm_block::{BlockDevice, WriteFlags};

    use udm_testkit::conformance;

    #[test]
    fn passes_the_conformance_suite() {
        let resolver = memory_resolver(&[("a", 8 << 20)]);
        conformance::run_all(&build(&resolver, "0 16384 delay a 0 0").unwrap());
    }

    #[test]
    fn delays_reads_and_writes_by_their_group() {
        let resolver = memory_resolver(&[("a", 1 << 20), ("b", 1 << 20)]);
        let table = build(&resolver, "0 2048 delay a 0 30 b 0 0").unwrap();
        let mut buf = vec![0u8; 4096];
        let t = Instant::now();
        table.write(0, &buf, WriteFlags::default()).unwrap();
        assert!(t.elapsed().as_millis() < 30);
        let t = Instant::now();
        table.read(0, &mut buf).unwrap();
        assert!(t.elapsed().as_millis() >= 30);
        assert_eq!(table.status_lines()[0], "0 2048 delay 0 0");
        // Writes went to b, reads come from a.
        table.write(0, &[1u8; 512], WriteFlags::default()).unwrap();
        resolver.get("b").read(0, &mut buf[..512]).unwrap();
        assert_eq!(buf[0], 1);
    }

    #[test]
    fn mapped_requests_wait_on_the_timer_and_count_as_delayed() {
        use udm_block::{FileDevice, MapOp, OpenMode};
        let dir = udm_testkit::TempDir::new("delay-map");
        let path = dir.sparse("a.img", 1 << 20);
        let resolver = udm_testkit::Devices::default();
        let file = FileDevice::open(&path, OpenMode::ReadWrite).unwrap();
        resolver.add("a", std::sync::Arc::new(file), false);
        let table = build(&resolver, "0 2048 delay a 0 0 a 0 40").unwrap();
        assert!(
            table.map(MapOp::Read, 0, 4096).unwrap().is_ready(),
            "no delay, no step"
        );
        let write = table.map(MapOp::Write { fua: false }, 4096, 4096).unwrap();
        assert!(!write.is_ready());
        let (tx, rx) = std::sync::mpsc::channel();
        let t = Instant::now();
        write.when_ready(move |m| tx.send(m.map(|m| m.pieces.len())).unwrap());
        assert_eq!(table.status_lines()[0], "0 2048 delay 0 1");
        assert_eq!(rx.recv().unwrap().unwrap(), 1);
        assert!(t.elapsed().as_millis() >= 40);
        assert_eq!(table.status_lines()[0], "0 2048 delay 0 0");
    }

    #[test]
    fn refuses_wrong_argument_counts() {
        let resolver = memory_resolver(&[("a", 1 << 20)]);
        assert_refused(
            &resolver,
            &[
                ("0 8 delay a 0", "expected 3, 6 or 9 arguments"),
                ("0 8 delay a 0 x", "invalid <delay ms> 'x'"),
            ],
        );
    }
}
