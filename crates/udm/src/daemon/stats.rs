//! Per-device I/O statistics: what reached the device (from clients and from devices built
//! on it), counted when each request completes, for `/metrics`.
//!
//! Everything is a relaxed atomic: a request touches a few counters of its own operation, and
//! a scrape reads them one by one (a scrape in the middle of a request may see its count
//! before its latency, never a torn number).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use udm_block::MapOp;

/// Upper bounds of the latency histogram's buckets, in seconds (and `+Inf` after them).
pub const LATENCY_BUCKETS: [f64; 16] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 10.0,
];

/// The operations counted apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    Flush,
    Discard,
    WriteZeroes,
}

impl Op {
    pub const ALL: [Op; 5] = [Op::Read, Op::Write, Op::Flush, Op::Discard, Op::WriteZeroes];

    pub fn label(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
            Op::Discard => "discard",
            Op::WriteZeroes => "write_zeroes",
        }
    }
}

impl From<MapOp> for Op {
    fn from(op: MapOp) -> Op {
        match op {
            MapOp::Read => Op::Read,
            MapOp::Write { .. } => Op::Write,
            MapOp::Flush => Op::Flush,
            MapOp::Discard { .. } => Op::Discard,
            MapOp::WriteZeroes { .. } => Op::WriteZeroes,
        }
    }
}

#[derive(Default)]
struct Counters {
    completed: AtomicU64,
    errors: AtomicU64,
    bytes: AtomicU64,
    /// Sum of latencies, nanoseconds.
    latency_ns: AtomicU64,
    /// Non-cumulative: `buckets[i]` counts latencies in (bound i-1, bound i]; the last one
    /// those above every bound.
    buckets: [AtomicU64; LATENCY_BUCKETS.len() + 1],
}

/// One device's counters.
#[derive(Default)]
pub struct IoStats {
    ops: [Counters; Op::ALL.len()],
    in_flight: AtomicU64,
}

/// What a scrape reads of one operation.
#[derive(Debug, Clone, PartialEq)]
pub struct OpSnapshot {
    pub completed: u64,
    pub errors: u64,
    pub bytes: u64,
    pub latency_seconds: f64,
    /// Cumulative counts per bucket bound, as Prometheus wants them (the last is `+Inf`).
    pub cumulative: Vec<u64>,
}

impl IoStats {
    /// Counts a request in flight until the returned tracker is finished or dropped.
    pub fn start(self: &Arc<Self>, op: Op, bytes: u64) -> Tracker {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        Tracker {
            stats: self.clone(),
            op,
            bytes,
            started: Instant::now(),
        }
    }

    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    pub fn snapshot(&self, op: Op) -> OpSnapshot {
        let c = &self.ops[op as usize];
        let mut total = 0;
        let cumulative = c
            .buckets
            .iter()
            .map(|b| {
                total += b.load(Ordering::Relaxed);
                total
            })
            .collect();
        OpSnapshot {
            completed: c.completed.load(Ordering::Relaxed),
            errors: c.errors.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            latency_seconds: c.latency_ns.load(Ordering::Relaxed) as f64 / 1e9,
            cumulative,
        }
    }
}

/// A request being counted: in flight while it lives, recorded by [`Tracker::finish`].
pub struct Tracker {
    stats: Arc<IoStats>,
    op: Op,
    bytes: u64,
    started: Instant,
}

impl Tracker {
    /// Records the request as completed (its bytes only if it succeeded) and passes its
    /// result through.
    pub fn finish<T, E>(self, result: Result<T, E>) -> Result<T, E> {
        self.record(result.is_ok());
        result
    }

    pub fn record(self, ok: bool) {
        let elapsed = self.started.elapsed();
        let c = &self.stats.ops[self.op as usize];
        if ok {
            c.bytes.fetch_add(self.bytes, Ordering::Relaxed);
        } else {
            c.errors.fetch_add(1, Ordering::Relaxed);
        }
        c.latency_ns
            .fetch_add(elapsed.as_nanos() as u64, Ordering::Relaxed);
        let seconds = elapsed.as_secs_f64();
        let bucket = LATENCY_BUCKETS
            .iter()
            .position(|&bound| seconds <= bound)
            .unwrap_or(LATENCY_BUCKETS.len());
        c.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        // Last, so that a scrape never sees a request counted whose bytes are missing.
        c.completed.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        self.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_count_when_they_complete_and_failures_carry_no_bytes() {
        let stats = Arc::new(IoStats::default());
        let read = stats.start(Op::Read, 4096);
        let write = stats.start(Op::Write, 512);
        assert_eq!(stats.in_flight(), 2);
        assert_eq!(stats.snapshot(Op::Read).completed, 0);
        read.finish(Ok::<(), ()>(())).unwrap();
        write.finish(Err::<(), ()>(())).unwrap_err();
        assert_eq!(stats.in_flight(), 0);
        let r = stats.snapshot(Op::Read);
        assert_eq!((r.completed, r.errors, r.bytes), (1, 0, 4096));
        assert_eq!(*r.cumulative.last().unwrap(), 1);
        let w = stats.snapshot(Op::Write);
        assert_eq!((w.completed, w.errors, w.bytes), (1, 1, 0));
        // A request that was never finished (a mapping dropped unused) leaves no trace.
        drop(stats.start(Op::Flush, 0));
        assert_eq!(stats.in_flight(), 0);
        assert_eq!(stats.snapshot(Op::Flush).completed, 0);
    }

    #[test]
    fn latencies_land_in_cumulative_buckets() {
        let stats = Arc::new(IoStats::default());
        let mut slow = stats.start(Op::Read, 0);
        slow.started -= std::time::Duration::from_millis(3);
        slow.record(true);
        stats.start(Op::Read, 0).record(true);
        let r = stats.snapshot(Op::Read);
        let at =
            |bound: f64| r.cumulative[LATENCY_BUCKETS.iter().position(|&b| b == bound).unwrap()];
        assert_eq!(at(0.0025), 1, "{r:?}");
        assert_eq!(at(0.005), 2, "{r:?}");
        assert!(r.latency_seconds >= 0.003);
    }
}
