//! Pacing background copies (a clone's hydration, a snapshot merge) against the user's I/O:
//! how busy the user is, a bandwidth cap, and the copy rate for progress bars.

use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// User I/O this recent counts as "the user is busy".
const USER_QUIET: Duration = Duration::from_millis(5);
/// While the user is busy, each batch is followed by a pause this many times as long as the
/// batch took, so copying gets at most 1/(1+N) of the devices' time and the user the rest.
const YIELD_FACTOR: u32 = 8;
/// Samples (one a second) the copy rate is averaged over.
const RATE_WINDOW: usize = 10;

/// The user's requests in flight and when the last one ended.
pub struct UserActivity {
    in_flight: AtomicUsize,
    /// Nanoseconds since `started` at which the last request ended.
    last: AtomicU64,
    started: Instant,
}

/// A user request in flight, counted until dropped.
pub struct UserIo<'a>(&'a UserActivity);

/// The same for a mapped request, which outlives the call that mapped it.
pub struct MappedUserIo(Arc<UserActivity>);

impl Default for UserActivity {
    fn default() -> Self {
        UserActivity {
            in_flight: AtomicUsize::new(0),
            last: AtomicU64::new(0),
            started: Instant::now(),
        }
    }
}

impl UserActivity {
    pub fn begin(&self) -> UserIo<'_> {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        UserIo(self)
    }

    pub fn begin_mapped(self: &Arc<Self>) -> MappedUserIo {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        MappedUserIo(self.clone())
    }

    fn end(&self) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.last
            .store(self.started.elapsed().as_nanos() as u64, Ordering::Release);
    }

    pub fn busy(&self) -> bool {
        let last = Duration::from_nanos(self.last.load(Ordering::Acquire));
        self.in_flight.load(Ordering::Acquire) > 0
            || self.started.elapsed().saturating_sub(last) < USER_QUIET
    }

    /// How long a background batch that took `took` should pause before the next: a
    /// multiple of it (at most `max`) while the user is busy, nothing otherwise.
    pub fn pause_after(&self, took: Duration, max: Duration) -> Duration {
        if self.busy() {
            (took * YIELD_FACTOR).min(max)
        } else {
            Duration::ZERO
        }
    }
}

impl Drop for UserIo<'_> {
    fn drop(&mut self) {
        self.0.end();
    }
}

impl Drop for MappedUserIo {
    fn drop(&mut self) {
        self.0.end();
    }
}

/// A bandwidth cap in KiB/s (0 = none), which the caller keeps with its settings: each copy
/// books its bytes, and the next may start once they would have taken at the cap.
pub struct RateLimit {
    next_at: Instant,
}

impl Default for RateLimit {
    fn default() -> Self {
        RateLimit {
            next_at: Instant::now(),
        }
    }
}

impl RateLimit {
    /// A new cap applies from now, not after what the old one had booked.
    pub fn reset(&mut self) {
        self.next_at = Instant::now();
    }

    /// How long a cap of `kib` KiB/s wants the next copy to wait, if at all.
    pub fn wait(&self, kib: u64) -> Option<Duration> {
        if kib == 0 {
            return None;
        }
        self.next_at
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
    }

    /// Books `bytes` at `kib` KiB/s.
    pub fn reserve(&mut self, kib: u64, bytes: u64) {
        if kib == 0 {
            return;
        }
        let at = self.next_at.max(Instant::now());
        self.next_at = at + Self::duration(kib, bytes);
    }

    /// Gives back `bytes` booked but not copied: the next copy may start that much earlier
    /// (never earlier than now, so no credit builds up).
    pub fn refund(&mut self, kib: u64, bytes: u64) {
        if kib == 0 || bytes == 0 {
            return;
        }
        let now = Instant::now();
        self.next_at = self
            .next_at
            .checked_sub(Self::duration(kib, bytes))
            .map_or(now, |at| at.max(now));
    }

    fn duration(kib: u64, bytes: u64) -> Duration {
        Duration::from_secs_f64(bytes as f64 / (kib as f64 * 1024.0))
    }
}

/// Progress sampled once a second, for a copy rate over the last few seconds.
#[derive(Default)]
pub struct Throughput {
    samples: Mutex<VecDeque<(Instant, u64)>>,
}

impl Throughput {
    /// Forgets the samples: the rate is measured from now (after a pause, say), not across
    /// a time nothing was copied.
    pub fn clear(&self) {
        self.samples.lock().clear();
    }

    /// Records that `done` bytes are done by now.
    pub fn sample(&self, done: u64) {
        let mut samples = self.samples.lock();
        samples.push_back((Instant::now(), done));
        if samples.len() > RATE_WINDOW {
            samples.pop_front();
        }
    }

    /// Bytes per second over the window, once there are two samples.
    pub fn bytes_per_second(&self) -> Option<f64> {
        let samples = self.samples.lock();
        let (first, last) = (samples.front()?, samples.back()?);
        let seconds = last.0.duration_since(first.0).as_secs_f64();
        (seconds > 0.0).then(|| last.1.saturating_sub(first.1) as f64 / seconds)
    }

    /// Seconds left for `remaining` bytes at the current rate (0 when nothing remains).
    pub fn eta_seconds(&self, remaining: u64) -> Option<f64> {
        match self.bytes_per_second() {
            _ if remaining == 0 => Some(0.0),
            Some(rate) if rate > 0.0 => Some((remaining as f64 / rate).round()),
            _ => None,
        }
    }
}

/// The `progress` object of `udm status --json` (what `udm wait NAME --progress` draws) for a
/// background job: `label` names it, `stopped` says why it will not go on, if it will not.
pub fn progress_json(
    label: &str,
    done: u64,
    total: u64,
    throughput: &Throughput,
    complete: bool,
    stopped: Option<&str>,
) -> serde_json::Value {
    serde_json::json!({
        "label": label,
        "done_bytes": done,
        "total_bytes": total,
        "rate_bytes_per_second": throughput.bytes_per_second().map(f64::round),
        "eta_seconds": throughput.eta_seconds(total.saturating_sub(done)),
        "complete": complete,
        "stopped": stopped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_in_flight_or_just_ended_makes_the_user_busy() {
        let activity = Arc::new(UserActivity::default());
        std::thread::sleep(USER_QUIET * 2);
        assert!(!activity.busy());
        assert_eq!(
            activity.pause_after(Duration::from_millis(1), Duration::from_secs(1)),
            Duration::ZERO
        );
        let mapped = activity.begin_mapped();
        assert!(activity.busy());
        assert_eq!(
            activity.pause_after(Duration::from_millis(1), Duration::from_secs(1)),
            Duration::from_millis(8)
        );
        drop(mapped);
        assert!(activity.busy(), "just ended");
        std::thread::sleep(USER_QUIET * 2);
        assert!(!activity.busy());
    }

    #[test]
    fn the_cap_spaces_copies_by_their_size_and_takes_back_what_was_not_copied() {
        let mut cap = RateLimit::default();
        assert!(cap.wait(1024).is_none());
        cap.reserve(1024, 512 * 1024);
        let wait = cap.wait(1024).unwrap();
        assert!(wait > Duration::from_millis(400) && wait <= Duration::from_millis(500));
        cap.refund(1024, 256 * 1024);
        let wait = cap.wait(1024).unwrap();
        assert!(wait > Duration::from_millis(150) && wait <= Duration::from_millis(250));
        cap.refund(1024, 1 << 30);
        assert!(cap.wait(1024).is_none(), "no credit builds up");
        assert!(cap.wait(0).is_none());
        cap.reserve(1024, 1 << 20);
        cap.reset();
        assert!(cap.wait(1024).is_none());
    }
}
