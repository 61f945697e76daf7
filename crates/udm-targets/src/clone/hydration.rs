//! Background hydration: workers copy batches of contiguous unhydrated regions, at most
//! `hydration_threshold` regions at a time, under an optional bandwidth cap, and step back
//! while the user's I/O is in flight. A committer thread commits the bitmap once a second and
//! samples progress for the copy rate.

use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::warn;

use super::{Inner, Mode, Settings};

/// Copy threads; `hydration_threshold` and `hydration_batch_size` decide how many of them
/// copy at once (threshold / batch size, at least one).
const WORKERS: usize = 16;
/// User I/O this recent counts as "the user is busy".
const USER_QUIET: Duration = Duration::from_millis(5);
/// While the user is busy, each batch is followed by a pause this many times as long as the
/// batch took, so copying gets at most 1/(1+N) of the devices' time and the user the rest.
const YIELD_FACTOR: u32 = 8;
const MAX_YIELD: Duration = Duration::from_millis(50);
const ERROR_BACKOFF: Duration = Duration::from_millis(500);
const RATE_WINDOW: usize = 10;

pub(super) fn start(inner: &Arc<Inner>) -> Vec<JoinHandle<()>> {
    let mut threads = Vec::new();
    for i in 0..WORKERS {
        let inner = inner.clone();
        threads.push(
            std::thread::Builder::new()
                .name(format!("clone-hydrate-{i}"))
                .spawn(move || worker(&inner))
                .expect("spawn hydration worker"),
        );
    }
    let inner = inner.clone();
    threads.push(
        std::thread::Builder::new()
            .name("clone-commit".into())
            .spawn(move || committer(&inner))
            .expect("spawn clone committer"),
    );
    threads
}

/// Pausing waits for the batches in flight to finish.
pub(super) fn pause(inner: &Inner, paused: bool) {
    let mut settings = inner.settings.lock().unwrap();
    settings.paused = paused;
    inner.wake.notify_all();
    while paused && settings.in_flight > 0 {
        settings = inner.wake.wait(settings).unwrap();
    }
}

pub(super) fn stop(inner: &Inner) {
    inner.settings.lock().unwrap().shutdown = true;
    inner.wake.notify_all();
}

/// Bytes per second hydrated over the last few seconds, once there are two samples.
pub(super) fn rate_bytes_per_second(inner: &Inner) -> Option<f64> {
    let samples = inner.progress.lock().unwrap();
    let (first, last) = (samples.front()?, samples.back()?);
    let seconds = last.0.duration_since(first.0).as_secs_f64();
    (seconds > 0.0).then(|| (last.1 - first.1) as f64 * inner.region as f64 / seconds)
}

fn user_busy(inner: &Inner) -> bool {
    let last = Duration::from_nanos(inner.last_user_io.load(Ordering::Acquire));
    inner.user_in_flight.load(Ordering::Acquire) > 0
        || inner.started.elapsed().saturating_sub(last) < USER_QUIET
}

fn may_copy(inner: &Inner, s: &Settings) -> bool {
    s.hydration_enabled
        && !s.paused
        && s.in_flight < s.threshold
        && inner.mode() == Mode::Write
        && !inner.is_complete()
        // While the user is busy, one batch at a time.
        && (s.in_flight == 0 || !user_busy(inner))
}

fn worker(inner: &Inner) {
    let mut settings = inner.settings.lock().unwrap();
    loop {
        if settings.shutdown {
            return;
        }
        if !may_copy(inner, &settings) {
            settings = inner
                .wake
                .wait_timeout(settings, Duration::from_millis(100))
                .unwrap()
                .0;
            continue;
        }
        let claims = claim_batch(inner, &mut settings);
        if claims.is_empty() {
            // Everything left is being copied by someone else right now.
            settings = inner
                .wake
                .wait_timeout(settings, Duration::from_millis(20))
                .unwrap()
                .0;
            continue;
        }
        let count = claims.len() as u64;
        let bytes = count * inner.region;
        settings.in_flight += count;
        let start_at = throttle(&mut settings, bytes);
        drop(settings);

        if let Some(wait) = start_at.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let first = claims[0].region;
        let started = Instant::now();
        let result = inner.copy_regions(first..first + count, true);
        drop(claims);
        if let Err(e) = &result {
            // A copy cut short because the table is going away is not worth a warning.
            if !inner.settings.lock().unwrap().shutdown {
                warn!(
                    "clone: hydrating regions {first}..{}: {e}; will retry",
                    first + count
                );
                std::thread::sleep(ERROR_BACKOFF);
            }
        } else if user_busy(inner) {
            std::thread::sleep((started.elapsed() * YIELD_FACTOR).min(MAX_YIELD));
        }

        settings = inner.settings.lock().unwrap();
        settings.in_flight -= count;
        inner.wake.notify_all();
    }
}

/// Claims up to a batch of contiguous unhydrated regions from the cursor on.
fn claim_batch<'a>(
    inner: &'a Inner,
    settings: &mut MutexGuard<'_, Settings>,
) -> Vec<super::regions::Claim<'a>> {
    let allowed = settings
        .batch_size
        .min(settings.threshold - settings.in_flight);
    let Some(first) = inner.meta.next_unhydrated(settings.cursor) else {
        return Vec::new();
    };
    let mut claims = Vec::new();
    let mut region = first;
    while (claims.len() as u64) < allowed
        && region < inner.meta.regions()
        && !inner.meta.is_hydrated(region)
    {
        match inner.claims.try_claim(region) {
            Some(claim) => claims.push(claim),
            None => break,
        }
        region += 1;
    }
    settings.cursor = if claims.is_empty() { first + 1 } else { region };
    claims
}

/// The moment a copy of `bytes` may start under the bandwidth cap.
fn throttle(settings: &mut Settings, bytes: u64) -> Instant {
    let now = Instant::now();
    if settings.max_rate_kib == 0 {
        return now;
    }
    let at = settings.next_copy_at.max(now);
    settings.next_copy_at =
        at + Duration::from_secs_f64(bytes as f64 / (settings.max_rate_kib as f64 * 1024.0));
    at
}

fn committer(inner: &Inner) {
    let mut next_tick = Instant::now() + Duration::from_secs(1);
    loop {
        {
            let mut settings = inner.settings.lock().unwrap();
            loop {
                if settings.shutdown {
                    return;
                }
                let Some(left) = next_tick.checked_duration_since(Instant::now()) else {
                    break;
                };
                settings = inner.wake.wait_timeout(settings, left).unwrap().0;
            }
        }
        next_tick += Duration::from_secs(1);
        {
            let mut samples = inner.progress.lock().unwrap();
            samples.push_back((Instant::now(), inner.meta.hydrated_count()));
            if samples.len() > RATE_WINDOW {
                samples.pop_front();
            }
        }
        if inner.mode() == Mode::Write && inner.meta.is_dirty() {
            if let Err(e) = inner.commit() {
                warn!("clone: periodic commit: {e}");
            }
        }
        inner.announce_if_complete();
    }
}
