//! Where an asynchronous copy-out's time goes, for `udm status --json` and the benchmark
//! (`bench/snapshot.py` logs it): the mean of each stage over the copy-outs committed so far.
//! A few clock reads per copy-out, so always on.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// The stages, in order, as `status --json` names them.
const NAMES: [&str; 4] = ["chunk_locks", "origin_read", "cow_write", "commit"];

#[derive(Default)]
pub struct Stages {
    count: AtomicU64,
    nanos: [AtomicU64; 4],
}

/// When a copy-out began, held its chunks, read the origin, wrote the COW chunks and saw its
/// commit durable.
pub struct Marks {
    pub began: Instant,
    pub held: Instant,
    pub read: Instant,
    pub written: Instant,
    pub durable: Instant,
}

impl Stages {
    pub fn add(&self, m: &Marks) {
        let spans = [
            m.held - m.began,
            m.read.saturating_duration_since(m.held),
            m.written.saturating_duration_since(m.read),
            m.durable - m.written,
        ];
        for (total, span) in self.nanos.iter().zip(spans) {
            total.fetch_add(span.as_nanos() as u64, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Mean microseconds of each stage, and over how many copy-outs.
    pub fn json(&self) -> serde_json::Value {
        let count = self.count.load(Ordering::Relaxed);
        let mut out = serde_json::Map::new();
        out.insert("copy_outs".into(), count.into());
        for (name, total) in NAMES.iter().zip(&self.nanos) {
            let mean = total.load(Ordering::Relaxed) / count.max(1) / 1000;
            out.insert(format!("{name}_us"), mean.into());
        }
        out.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn means_per_stage() {
        let stages = Stages::default();
        let began = Instant::now();
        let ms = |n| began + Duration::from_millis(n);
        for scale in [1, 3] {
            stages.add(&Marks {
                began,
                held: ms(scale),
                read: ms(3 * scale),
                written: ms(6 * scale),
                durable: ms(10 * scale),
            });
        }
        assert_eq!(
            stages.json(),
            serde_json::json!({"copy_outs": 2, "chunk_locks_us": 2000, "origin_read_us": 4000,
                               "cow_write_us": 6000, "commit_us": 8000})
        );
    }
}
