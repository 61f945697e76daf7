//! `historical-service-time`, as the kernel's dm-ps-historical-service-time: each path keeps
//! a time-weighted exponential moving average of how long its requests took, and a request
//! goes to the path whose estimate, times its requests in flight plus one, is lowest. Paths
//! whose estimates differ by less than `threshold_multiplier` times are compared by requests
//! in flight alone. A path that has finished nothing for its estimate times the group's path
//! count is "stale": unloaded, it gets the next request (a probe, in case it got better);
//! loaded, it gets no more than an equal share.
//!
//! Fixed point as the kernel's: estimates are nanoseconds × 1024. The weight of the old
//! average is `base_weight` / 1024 (default 972, 0.95) per 2^24 ns (about 16 ms) the request
//! took, so that a slow request moves the estimate further than a fast one; past 63 such
//! periods the old average counts for nothing.

use parking_lot::Mutex;
use std::cmp::Ordering;
use std::sync::OnceLock;
use std::time::Instant;

use crate::args::Args;
use crate::target::TargetError;

const FIXED_SHIFT: u32 = 10;
const FIXED_1: u64 = 1 << FIXED_SHIFT;
const FIXED_MAX: u64 = u64::MAX >> FIXED_SHIFT;
/// The kernel's default base weight, 0.95.
const DEFAULT_BASE_WEIGHT: u32 = 972;
const BUCKET_SHIFT: u32 = 24;
const WEIGHT_COUNT: u64 = 64;
/// In-flight counts from which estimates are scaled down before multiplying (the kernel's
/// overflow guard).
const MAX_INFLIGHT: u64 = FIXED_1;

/// The selector's arguments: `[<base_weight> [<threshold_multiplier>]]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct HstArgs {
    pub base_weight: u32,
    pub threshold_multiplier: u32,
}

impl Default for HstArgs {
    fn default() -> Self {
        HstArgs {
            base_weight: DEFAULT_BASE_WEIGHT,
            threshold_multiplier: 0,
        }
    }
}

impl HstArgs {
    pub fn parse(words: &[&str]) -> Result<HstArgs, TargetError> {
        let mut args = Args::new("historical-service-time", words);
        if words.len() > 2 {
            return Err(args.error(format!(
                "takes at most 2 selector arguments, {} given",
                words.len()
            )));
        }
        let mut parsed = HstArgs::default();
        if args.remaining() > 0 {
            parsed.base_weight = args.number_in("base_weight", 0..=(FIXED_1 as u32 - 1))?;
        }
        if args.remaining() > 0 {
            parsed.threshold_multiplier = args.number("threshold_multiplier")?;
        }
        Ok(parsed)
    }

    /// As the kernel prints them: both, always.
    pub fn print(&self) -> String {
        format!("2 {} {}", self.base_weight, self.threshold_multiplier)
    }
}

/// Nanoseconds on a clock that starts with the first use (the kernel's sched_clock).
pub(super) fn now_ns() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    // Never 0: 0 means "never" in `History`.
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64 + 1
}

/// One path's measurements.
pub(super) struct History {
    args: HstArgs,
    /// Paths in the path's group: how many estimates pass before it is stale.
    group_paths: u64,
    state: Mutex<Measured>,
}

#[derive(Clone, Copy)]
struct Measured {
    /// The estimate, ns × 1024.
    service_time: u64,
    last_finish: u64,
    stale_after: u64,
}

/// What the comparison looks at, read once per candidate.
#[derive(Clone, Copy)]
pub(super) struct Estimate {
    service_time: u64,
    in_flight: u64,
    stale_after: u64,
}

impl History {
    pub fn new(args: HstArgs, group_paths: usize) -> History {
        History {
            args,
            group_paths: group_paths as u64,
            state: Mutex::new(Measured {
                service_time: FIXED_1,
                last_finish: 0,
                stale_after: 0,
            }),
        }
    }

    pub fn estimate(&self, in_flight: u64) -> Estimate {
        let m = *self.state.lock();
        Estimate {
            service_time: m.service_time,
            in_flight,
            stale_after: m.stale_after,
        }
    }

    /// A request that started at `started` (ns) has finished.
    pub fn finished(&self, started: u64) {
        self.finished_at(started, now_ns());
    }

    /// A request that started at `started` finished at `now`.
    pub fn finished_at(&self, started: u64, now: u64) {
        let mut m = self.state.lock();
        // Requests that overlap are taken as served one after another.
        let started = started.max(m.last_finish);
        m.last_finish = now;
        let took = now.saturating_sub(started);
        let weight = self.weight(took);
        m.service_time = ema(
            m.service_time,
            took.saturating_mul(FIXED_1).min(FIXED_MAX),
            weight,
        );
        m.stale_after = m.last_finish + self.group_paths * (m.service_time >> FIXED_SHIFT);
    }

    /// The old average's weight for a request that took `took` ns: base^(bucket + 1), none
    /// for the last bucket.
    fn weight(&self, took: u64) -> u64 {
        let bucket = (took >> BUCKET_SHIFT).min(WEIGHT_COUNT - 1);
        if bucket == WEIGHT_COUNT - 1 {
            return 0;
        }
        fixed_power(u64::from(self.args.base_weight), bucket as u32 + 1)
    }

    /// The selector's status values: the estimate (ns × 1024), requests in flight, and when
    /// the path goes stale (ns on [`now_ns`]'s clock).
    pub fn info(&self, in_flight: u64) -> String {
        let m = *self.state.lock();
        format!("{} {in_flight} {}", m.service_time, m.stale_after)
    }
}

/// The kernel's `hst_compare`: `Less` when `a` should take the request rather than `b`.
pub(super) fn compare(a: Estimate, b: Estimate, threshold: u32, now: u64) -> Ordering {
    let (h1, h2) = (u128::from(a.service_time), u128::from(b.service_time));
    let (o1, o2) = (a.in_flight, b.in_flight);
    let by_load = o1.cmp(&o2);
    let threshold = u128::from(threshold);
    let different = if h1 > h2 {
        h1 > threshold * h2
    } else {
        h2 > threshold * h1
    };
    if !different {
        return by_load;
    }
    let (stale1, stale2) = (a.stale_after < now, b.stale_after < now);
    // An unloaded stale path gets the request; of two unloaded paths, the staler.
    if (o1 == 0 && stale1) || (o2 == 0 && stale2) || (o1 == 0 && o2 == 0) {
        let k1 = if o2 == 0 {
            i128::from(a.stale_after)
        } else {
            0
        };
        let k2 = if o1 == 0 {
            i128::from(b.stale_after)
        } else {
            0
        };
        return k1.cmp(&k2);
    }
    let b_better = if o1 == o2 {
        h1 > h2
    } else {
        let (h1, h2) = if o1 >= MAX_INFLIGHT || o2 >= MAX_INFLIGHT {
            (h1 >> FIXED_SHIFT, h2 >> FIXED_SHIFT)
        } else {
            (h1, h2)
        };
        (1 + u128::from(o1)) * h1 > (1 + u128::from(o2)) * h2
    };
    // A stale winner gets no more than an equal share.
    match (b_better, stale1, stale2) {
        (true, _, true) | (false, true, _) => by_load,
        (true, _, false) => Ordering::Greater,
        (false, false, _) => Ordering::Less,
    }
}

/// `last * weight + next * (1 - weight)`, in fixed point.
fn ema(last: u64, next: u64, weight: u64) -> u64 {
    let sum = u128::from(last) * u128::from(weight)
        + u128::from(next) * u128::from(FIXED_1 - weight)
        + (1 << (FIXED_SHIFT - 1));
    (sum >> FIXED_SHIFT) as u64
}

/// `x^n` in fixed point, rounding at each step as the kernel's `fixed_power`.
fn fixed_power(mut x: u64, mut n: u32) -> u64 {
    let half = 1 << (FIXED_SHIFT - 1);
    let mut result = FIXED_1;
    while n > 0 {
        if n & 1 == 1 {
            result = (result * x + half) >> FIXED_SHIFT;
        }
        n >>= 1;
        if n > 0 {
            x = (x * x + half) >> FIXED_SHIFT;
        }
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn estimate(service_ns: u64, in_flight: u64, stale_after: u64) -> Estimate {
        Estimate {
            service_time: service_ns * FIXED_1,
            in_flight,
            stale_after,
        }
    }

    #[test]
    fn the_average_moves_towards_what_requests_take_and_further_for_slow_ones() {
        assert_eq!(fixed_power(972, 1), 972);
        assert_eq!(fixed_power(512, 2), 256);
        assert_eq!(fixed_power(0, 3), 0);
        let h = History::new(HstArgs::default(), 2);
        let sample = |h: &History, took: u64| {
            let mut m = h.state.lock();
            let weight = h.weight(took);
            m.service_time = ema(m.service_time, took * FIXED_1, weight);
            m.service_time >> FIXED_SHIFT
        };
        // 1 ms (bucket 0, weight 0.95): 5 % of the way from 1 ns.
        let after = sample(&h, 1_000_000);
        assert!((49_000..=51_000).contains(&after), "{after}");
        // A request of 1 s is past the last bucket: the old average is dropped.
        assert_eq!(sample(&h, 1_100_000_000), 1_100_000_000);
        // base_weight 0 ignores history.
        let fresh = History::new(
            HstArgs {
                base_weight: 0,
                threshold_multiplier: 0,
            },
            2,
        );
        assert_eq!(sample(&fresh, 7_000), 7_000);
    }

    #[test]
    fn finishing_updates_the_estimate_and_when_the_path_goes_stale() {
        let h = History::new(HstArgs::default(), 3);
        let started = now_ns();
        std::thread::sleep(std::time::Duration::from_millis(2));
        h.finished(started);
        let m = *h.state.lock();
        assert!(m.service_time > FIXED_1);
        assert_eq!(
            m.stale_after,
            m.last_finish + 3 * (m.service_time >> FIXED_SHIFT)
        );
    }

    #[test]
    fn compares_estimated_service_times_weighted_by_load() {
        let now = 1_000_000;
        let fresh = now * 2;
        // Equally loaded: the faster path.
        let fast = estimate(1_000, 4, fresh);
        let slow = estimate(5_000, 4, fresh);
        assert_eq!(compare(fast, slow, 0, now), Ordering::Less);
        assert_eq!(compare(slow, fast, 0, now), Ordering::Greater);
        // (1 + 10) × 1000 > (1 + 1) × 5000: the slow path, less loaded, wins.
        assert_eq!(
            compare(
                estimate(1_000, 10, fresh),
                estimate(5_000, 1, fresh),
                0,
                now
            ),
            Ordering::Greater
        );
        // Within the threshold (5000 ≤ 10 × 1000), only the load counts.
        assert_eq!(
            compare(
                estimate(1_000, 3, fresh),
                estimate(5_000, 2, fresh),
                10,
                now
            ),
            Ordering::Greater
        );
        // An unloaded stale path gets the next request, however slow it looked.
        let stale_idle = estimate(50_000, 0, now - 1);
        assert_eq!(compare(stale_idle, fast, 0, now), Ordering::Less);
        // Two unloaded paths: the staler first.
        assert_eq!(
            compare(estimate(1, 0, 10), estimate(1, 0, 20), 0, now),
            Ordering::Less
        );
        // A stale winner is held to an equal share: compared by load.
        let stale_fast = estimate(1_000, 5, now - 1);
        assert_eq!(compare(stale_fast, slow, 0, now), Ordering::Greater);
    }

    #[test]
    fn selector_arguments_parse_print_and_refuse_what_is_wrong() {
        assert_eq!(HstArgs::parse(&[]).unwrap(), HstArgs::default());
        let args = HstArgs::parse(&["512", "3"]).unwrap();
        assert_eq!((args.base_weight, args.threshold_multiplier), (512, 3));
        assert_eq!(args.print(), "2 512 3");
        for (words, expected) in [
            (&["1024"][..], "invalid <base_weight> 1024"),
            (&["x"][..], "invalid <base_weight> 'x'"),
            (
                &["1", "2", "3"][..],
                "at most 2 selector arguments, 3 given",
            ),
        ] {
            let err = HstArgs::parse(words).unwrap_err().to_string();
            assert!(err.contains(expected), "{words:?}: {err}");
        }
    }
}
