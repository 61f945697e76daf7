//! Path selectors, as the kernel's: `round-robin` (each path in turn, `repeat_count` requests
//! at a time), `queue-length` (the path with the fewest requests in flight), `service-time`
//! (the path that would finish the new request first: bytes in flight plus the request's,
//! over the path's relative throughput) and `historical-service-time` (the path whose
//! measured service time, weighted by its load, is lowest: see [`super::history`]). Each
//! chooses among the usable paths of one priority group; what they weigh is the [`Load`]
//! every request adds to its path.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::history::{self, History, HstArgs};
use crate::args::Args;
use crate::target::TargetError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Selector {
    RoundRobin,
    QueueLength,
    ServiceTime,
    HistoricalServiceTime(HstArgs),
}

/// A path's selector arguments (the table's per-path arguments).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PathArgs {
    /// Requests sent down the path before round-robin moves on. queue-length and
    /// service-time choose for every request, as the kernel's do; they keep it for the table.
    pub repeat_count: u32,
    /// service-time's weight of the path, 0 to 100 (0: only when no other path is usable).
    pub relative_throughput: u32,
}

impl Default for PathArgs {
    /// The kernel's defaults.
    fn default() -> Self {
        PathArgs {
            repeat_count: 1,
            relative_throughput: 1,
        }
    }
}

/// The kernel's bound on service-time's relative throughput.
const MAX_RELATIVE_THROUGHPUT: u32 = 100;

/// What is in flight on a path: requests and bytes, and for historical-service-time how
/// long requests took. Updated without the multipath's lock.
#[derive(Default)]
pub(super) struct Load {
    requests: AtomicU64,
    bytes: AtomicU64,
    history: Option<History>,
}

impl Load {
    /// The load of a path in a group of `group_paths` paths chosen by `selector`.
    pub fn new(selector: Selector, group_paths: usize) -> Load {
        Load {
            history: match selector {
                Selector::HistoricalServiceTime(args) => Some(History::new(args, group_paths)),
                _ => None,
            },
            ..Load::default()
        }
    }

    /// Counts a request of `bytes` until the returned guard is dropped (also from a mapped
    /// request's holds, when the engine completes it).
    pub fn start(self: &Arc<Self>, bytes: u64) -> Busy {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        Busy {
            load: self.clone(),
            bytes,
            started: self.history.as_ref().map(|_| history::now_ns()),
        }
    }

    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}

/// A request's place in its path's [`Load`].
pub(super) struct Busy {
    load: Arc<Load>,
    bytes: u64,
    /// When it started, for a path whose service time is measured.
    started: Option<u64>,
}

impl Drop for Busy {
    fn drop(&mut self) {
        if let (Some(history), Some(started)) = (&self.load.history, self.started) {
            history.finished(started);
        }
        self.load.requests.fetch_sub(1, Ordering::Relaxed);
        self.load.bytes.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Where a group's selector stands: the path it looks at first, and how many requests it
/// has sent there in a row. The other selectors start their scan after the path they chose
/// last, so that paths with equal load take turns (the kernel moves the chosen path to the
/// end of its list).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Cursor {
    pub at: usize,
    pub used: u32,
}

/// One path of a group as a selector sees it.
#[derive(Clone, Copy)]
pub(super) struct Candidate<'a> {
    pub usable: bool,
    pub args: &'a PathArgs,
    pub load: &'a Load,
}

impl Selector {
    pub const NAMES: &'static str =
        "round-robin, queue-length, service-time, historical-service-time";

    /// The selector `name` with its selector arguments (`words`).
    pub fn parse(name: &str, words: &[&str]) -> Result<Selector, TargetError> {
        let selector = match name {
            "round-robin" => Selector::RoundRobin,
            "queue-length" => Selector::QueueLength,
            "service-time" => Selector::ServiceTime,
            "historical-service-time" => {
                return Ok(Selector::HistoricalServiceTime(HstArgs::parse(words)?))
            }
            _ => {
                return Err(TargetError::new(format!(
                    "unknown path selector '{name}' (known: {})",
                    Selector::NAMES
                )))
            }
        };
        if !words.is_empty() {
            return Err(TargetError::new(format!(
                "{name} takes no selector arguments, {} given",
                words.len()
            )));
        }
        Ok(selector)
    }

    pub fn name(self) -> &'static str {
        match self {
            Selector::RoundRobin => "round-robin",
            Selector::QueueLength => "queue-length",
            Selector::ServiceTime => "service-time",
            Selector::HistoricalServiceTime(_) => "historical-service-time",
        }
    }

    /// The selector arguments as the table prints them, their count first.
    pub fn print_args(self) -> String {
        match self {
            Selector::HistoricalServiceTime(args) => args.print(),
            _ => "0".to_string(),
        }
    }

    /// How many per-path arguments the table line prints (`#path args`).
    pub fn table_args(self) -> usize {
        match self {
            Selector::RoundRobin | Selector::QueueLength | Selector::HistoricalServiceTime(_) => 1,
            Selector::ServiceTime => 2,
        }
    }

    /// How many per-path values the status line prints.
    pub fn info_args(self) -> usize {
        match self {
            Selector::RoundRobin => 0,
            Selector::QueueLength => 1,
            Selector::ServiceTime => 2,
            Selector::HistoricalServiceTime(_) => 3,
        }
    }

    /// Reads a path's arguments: `[<repeat_count>]`, and for service-time
    /// `[<repeat_count> [<relative_throughput>]]`.
    pub fn parse_path_args(self, words: &[&str]) -> Result<PathArgs, TargetError> {
        let mut args = Args::new(self.name(), words);
        if words.len() > self.table_args() {
            return Err(args.error(format!(
                "a path takes at most {} argument(s), {} given",
                self.table_args(),
                words.len()
            )));
        }
        let mut parsed = PathArgs::default();
        if let Selector::HistoricalServiceTime(_) = self {
            // Read, and ignored, as the kernel's (which prints 0 for it).
            args.optional_number::<u32>("repeat_count")?;
            return Ok(parsed);
        }
        if let Some(repeat) = args.optional_number::<u32>("repeat_count")? {
            if repeat == 0 {
                return Err(args.error("invalid <repeat_count> 0: must be at least 1"));
            }
            parsed.repeat_count = repeat;
        }
        if self == Selector::ServiceTime && args.remaining() > 0 {
            parsed.relative_throughput =
                args.number_in("relative_throughput", 0..=MAX_RELATIVE_THROUGHPUT)?;
        }
        Ok(parsed)
    }

    /// A path's arguments as the table prints them (all of them, defaults included).
    pub fn print_path_args(self, args: &PathArgs) -> String {
        match self {
            Selector::HistoricalServiceTime(_) => "0".to_string(),
            Selector::RoundRobin | Selector::QueueLength => args.repeat_count.to_string(),
            Selector::ServiceTime => {
                format!("{} {}", args.repeat_count, args.relative_throughput)
            }
        }
    }

    /// A path's values in the status line: nothing; requests in flight; bytes in flight and
    /// relative throughput; the service time estimate, requests in flight and when the path
    /// goes stale.
    pub fn path_info(self, args: &PathArgs, load: &Load) -> Option<String> {
        match self {
            Selector::RoundRobin => None,
            Selector::QueueLength => Some(load.requests().to_string()),
            Selector::ServiceTime => Some(format!("{} {}", load.bytes(), args.relative_throughput)),
            Selector::HistoricalServiceTime(_) => {
                load.history.as_ref().map(|h| h.info(load.requests()))
            }
        }
    }

    /// Chooses among a group's `n` paths (`path(i)` for each) for a request of `bytes`;
    /// `None` when none is usable.
    pub fn pick<'a>(
        self,
        n: usize,
        path: impl Fn(usize) -> Candidate<'a>,
        cursor: &mut Cursor,
        bytes: u64,
    ) -> Option<usize> {
        if n == 0 {
            return None;
        }
        if self == Selector::RoundRobin {
            // Back at the first path with a fresh count after n steps at most.
            for _ in 0..=n {
                let candidate = path(cursor.at);
                if candidate.usable && cursor.used < candidate.args.repeat_count {
                    cursor.used += 1;
                    return Some(cursor.at);
                }
                cursor.at = (cursor.at + 1) % n;
                cursor.used = 0;
            }
            return None;
        }
        let now = match self {
            Selector::HistoricalServiceTime(_) => history::now_ns(),
            _ => 0,
        };
        let mut best: Option<(usize, Candidate)> = None;
        for step in 0..n {
            let i = (cursor.at + step) % n;
            let candidate = path(i);
            if !candidate.usable {
                continue;
            }
            if best.is_none_or(|(_, b)| self.better(&candidate, &b, bytes, now)) {
                best = Some((i, candidate));
            }
        }
        let (chosen, _) = best?;
        cursor.at = (chosen + 1) % n;
        Some(chosen)
    }

    /// Whether `a` should take the request rather than `b` (ties go to `b`, found first).
    fn better(self, a: &Candidate, b: &Candidate, bytes: u64, now: u64) -> bool {
        match self {
            Selector::RoundRobin => false,
            Selector::QueueLength => a.load.requests() < b.load.requests(),
            Selector::ServiceTime => service_time_less(a, b, bytes),
            Selector::HistoricalServiceTime(args) => {
                let estimate = |c: &Candidate| {
                    let history = c.load.history.as_ref().expect("measured paths");
                    history.estimate(c.load.requests())
                };
                let order =
                    history::compare(estimate(a), estimate(b), args.threshold_multiplier, now);
                order == std::cmp::Ordering::Less
            }
        }
    }
}

/// The kernel's service-time comparison: less loaded if equally fast; faster if equally
/// loaded (a path of throughput 0 loses to any other); otherwise the shorter time to finish
/// what is in flight plus this request, `(in flight + bytes) / throughput`, compared by
/// cross-multiplying (wide enough that nothing overflows); the faster on a tie.
fn service_time_less(a: &Candidate, b: &Candidate, bytes: u64) -> bool {
    let (ta, tb) = (a.args.relative_throughput, b.args.relative_throughput);
    let (sa, sb) = (a.load.bytes(), b.load.bytes());
    if ta == tb {
        return sa < sb;
    }
    if sa == sb || ta == 0 || tb == 0 {
        return ta > tb;
    }
    let time_a = u128::from(sa + bytes) * u128::from(tb);
    let time_b = u128::from(sb + bytes) * u128::from(ta);
    if time_a != time_b {
        return time_a < time_b;
    }
    ta > tb
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Loads with the given (requests, bytes) in flight.
    fn loads(values: &[(u64, u64)]) -> Vec<Arc<Load>> {
        values
            .iter()
            .map(|&(requests, bytes)| {
                let load = Arc::new(Load::default());
                load.requests.store(requests, Ordering::Relaxed);
                load.bytes.store(bytes, Ordering::Relaxed);
                load
            })
            .collect()
    }

    fn candidates<'a>(
        loads: &'a [Arc<Load>],
        args: &'a [PathArgs],
        usable: &[bool],
    ) -> Vec<Candidate<'a>> {
        (0..loads.len())
            .map(|i| Candidate {
                usable: usable[i],
                args: &args[i],
                load: &loads[i],
            })
            .collect()
    }

    fn pick(
        selector: Selector,
        paths: &[Candidate],
        cursor: &mut Cursor,
        bytes: u64,
    ) -> Option<usize> {
        selector.pick(paths.len(), |i| paths[i], cursor, bytes)
    }

    fn picks(selector: Selector, paths: &[Candidate], n: usize) -> Vec<Option<usize>> {
        let mut cursor = Cursor::default();
        (0..n)
            .map(|_| pick(selector, paths, &mut cursor, 4096))
            .collect()
    }

    fn repeat(counts: &[u32]) -> Vec<PathArgs> {
        counts
            .iter()
            .map(|&repeat_count| PathArgs {
                repeat_count,
                ..PathArgs::default()
            })
            .collect()
    }

    #[test]
    fn round_robin_sends_repeat_count_requests_to_each_usable_path_in_turn() {
        let l = loads(&[(0, 0); 3]);
        let args = repeat(&[1, 2, 1]);
        let all = candidates(&l, &args, &[true, true, true]);
        assert_eq!(
            picks(Selector::RoundRobin, &all, 8),
            [0, 1, 1, 2, 0, 1, 1, 2].map(Some)
        );
        let middle_down = candidates(&l, &args, &[true, false, true]);
        assert_eq!(
            picks(Selector::RoundRobin, &middle_down, 4),
            [0, 2, 0, 2].map(Some)
        );
        let one = candidates(&l, &args, &[false, true, false]);
        assert_eq!(picks(Selector::RoundRobin, &one, 3), [1, 1, 1].map(Some));
        let none = candidates(&l, &args, &[false, false, false]);
        assert_eq!(picks(Selector::RoundRobin, &none, 2), [None, None]);
    }

    #[test]
    fn queue_length_picks_the_fewest_in_flight_and_takes_turns_on_ties() {
        let args = repeat(&[1, 1, 1]);
        let l = loads(&[(3, 0), (1, 0), (2, 0)]);
        let paths = candidates(&l, &args, &[true, true, true]);
        assert_eq!(picks(Selector::QueueLength, &paths, 2), [Some(1), Some(1)]);
        let paths = candidates(&l, &args, &[true, false, true]);
        assert_eq!(picks(Selector::QueueLength, &paths, 1), [Some(2)]);
        let idle = loads(&[(0, 0); 3]);
        let paths = candidates(&idle, &args, &[true, true, true]);
        assert_eq!(
            picks(Selector::QueueLength, &paths, 4),
            [0, 1, 2, 0].map(Some)
        );
    }

    #[test]
    fn queue_length_counts_what_its_guards_hold() {
        let load = Arc::new(Load::default());
        let a = load.start(4096);
        let b = load.start(512);
        assert_eq!((load.requests(), load.bytes()), (2, 4608));
        drop(a);
        assert_eq!((load.requests(), load.bytes()), (1, 512));
        drop(b);
        assert_eq!((load.requests(), load.bytes()), (0, 0));
    }

    #[test]
    fn service_time_weighs_bytes_in_flight_by_relative_throughput() {
        let weights = |t: &[u32]| -> Vec<PathArgs> {
            t.iter()
                .map(|&relative_throughput| PathArgs {
                    relative_throughput,
                    ..PathArgs::default()
                })
                .collect()
        };
        let pick = |l: &[(u64, u64)], t: &[u32], bytes: u64| {
            let l = loads(l);
            let args = weights(t);
            let paths = candidates(&l, &args, &vec![true; l.len()]);
            pick(Selector::ServiceTime, &paths, &mut Cursor::default(), bytes)
        };
        // Same throughput: fewer bytes in flight.
        assert_eq!(pick(&[(1, 8192), (1, 4096)], &[1, 1], 4096), Some(1));
        // Same load: the faster path.
        assert_eq!(pick(&[(1, 4096), (1, 4096)], &[1, 3], 4096), Some(1));
        // A path of throughput 0 loses to any other, however loaded.
        assert_eq!(pick(&[(0, 0), (9, 1 << 30)], &[0, 1], 4096), Some(1));
        // Service time: (8K + 4K) / 4 = 3K beats (0 + 4K) / 1 = 4K.
        assert_eq!(pick(&[(2, 8192), (0, 0)], &[4, 1], 4096), Some(0));
        // (16K + 4K) / 4 = 5K loses to 4K.
        assert_eq!(pick(&[(4, 16384), (0, 0)], &[4, 1], 4096), Some(1));
        // Equal times: the faster path. (4K + 4K) / 2 = (0 + 4K) / 1.
        assert_eq!(pick(&[(1, 4096), (0, 0)], &[2, 1], 4096), Some(0));
        // Byte counts near the top of u64 do not overflow.
        assert_eq!(pick(&[(1, u64::MAX / 2), (1, 1)], &[100, 1], 4096), Some(1));
    }

    #[test]
    fn path_arguments_parse_print_and_refuse_what_is_wrong() {
        let rr = Selector::RoundRobin;
        assert_eq!(rr.parse_path_args(&[]).unwrap(), PathArgs::default());
        assert_eq!(rr.parse_path_args(&["3"]).unwrap().repeat_count, 3);
        assert_eq!(
            rr.print_path_args(&rr.parse_path_args(&["3"]).unwrap()),
            "3"
        );
        let st = Selector::ServiceTime;
        let args = st.parse_path_args(&["2", "50"]).unwrap();
        assert_eq!((args.repeat_count, args.relative_throughput), (2, 50));
        assert_eq!(st.print_path_args(&args), "2 50");
        assert_eq!(st.print_path_args(&st.parse_path_args(&[]).unwrap()), "1 1");
        let errors = [
            (rr, &["1", "2"][..], "at most 1 argument(s), 2 given"),
            (rr, &["0"][..], "invalid <repeat_count> 0"),
            (rr, &["x"][..], "invalid <repeat_count> 'x'"),
            (st, &["1", "101"][..], "invalid <relative_throughput> 101"),
            (st, &["1", "2", "3"][..], "at most 2 argument(s), 3 given"),
            (
                Selector::QueueLength,
                &["-1"][..],
                "invalid <repeat_count> '-1'",
            ),
        ];
        for (selector, words, expected) in errors {
            let err = selector.parse_path_args(words).unwrap_err().to_string();
            assert!(err.contains(expected), "{words:?}: {err}");
        }
        assert!(Selector::parse("least-pending", &[]).is_err());
        // historical-service-time reads its path argument, ignores it and prints 0.
        let hst = Selector::parse("historical-service-time", &[]).unwrap();
        assert_eq!(hst.print_args(), "2 972 0");
        assert_eq!(
            hst.print_path_args(&hst.parse_path_args(&["5"]).unwrap()),
            "0"
        );
        assert!(hst.parse_path_args(&["x"]).is_err());
    }

    #[test]
    fn historical_service_time_prefers_the_path_that_has_been_serving_faster() {
        let hst = Selector::parse("historical-service-time", &[]).unwrap();
        let loads: Vec<Arc<Load>> = (0..2).map(|_| Arc::new(Load::new(hst, 2))).collect();
        // Three requests each, path 0 taking 4 ms and path 1 0.2 ms, finishing a minute from
        // now: neither path goes stale while the test runs.
        let minute = history::now_ns() + 60_000_000_000;
        for (path, took) in [(0, 4_000_000), (1, 200_000)] {
            let history = loads[path].history.as_ref().unwrap();
            for k in 0..3 {
                let started = minute + k * 10_000_000;
                history.finished_at(started, started + took);
            }
        }
        let args = repeat(&[1, 1]);
        let paths = candidates(&loads, &args, &[true, true]);
        let mut cursor = Cursor::default();
        // Path 1 takes requests while (1 + in flight) × its estimate beats path 0's, idle:
        // about 20 of them.
        let mut held = Vec::new();
        let mut chosen = Vec::new();
        for _ in 0..24 {
            let path = pick(hst, &paths, &mut cursor, 4096).unwrap();
            chosen.push(path);
            held.push(loads[path].start(4096));
        }
        let to_fast = chosen.iter().filter(|&&p| p == 1).count();
        assert!(chosen[..16].iter().all(|&p| p == 1), "{chosen:?}");
        assert!((18..24).contains(&to_fast), "{chosen:?}");
        let info = hst.path_info(&args[0], &loads[0]).unwrap();
        let fields: Vec<&str> = info.split(' ').collect();
        assert_eq!(fields[1], (24 - to_fast).to_string(), "{info}");
    }
}
