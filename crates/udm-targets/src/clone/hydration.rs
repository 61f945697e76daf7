//! Background hydration: workers copy batches of contiguous unhydrated regions, at most
//! `hydration_threshold` regions at a time, under an optional bandwidth cap, and step back
//! while the user's I/O is in flight. A committer thread commits the bitmap once a second and
//! samples progress for the copy rate.

use std::sync::{Arc, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::warn;

use super::{Inner, Mode, Settings};

/// Copy threads; `hydration_threshold` and `hydration_batch_size` decide how many of them
/// copy at once (threshold / batch size, at least one).
const WORKERS: usize = 16;
/// The longest pause after a batch while the user is busy: hydration keeps moving.
const MAX_YIELD: Duration = Duration::from_millis(50);
const ERROR_BACKOFF: Duration = Duration::from_millis(500);

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

fn may_copy(inner: &Inner, s: &Settings) -> bool {
    s.hydration_enabled
        && !s.paused
        && s.in_flight < s.threshold
        && inner.mode() == Mode::Write
        && !inner.is_complete()
        // While the user is busy, one batch at a time.
        && (s.in_flight == 0 || !inner.activity.busy())
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
        // Wait out the bandwidth cap before claiming anything: a claimed region holds up the
        // user's I/O to it and a suspend, so claims are only ever held while copying. A rate
        // change or a pause wakes the wait.
        if let Some(wait) = settings.rate.wait() {
            settings = inner.wake.wait_timeout(settings, wait).unwrap().0;
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
        settings.in_flight += count;
        settings.rate.reserve(count * inner.region);
        drop(settings);

        let first = claims[0].region;
        let started = Instant::now();
        let result = inner.copy_claimed(claims);

        settings = inner.settings.lock().unwrap();
        settings.in_flight -= count;
        inner.wake.notify_all();
        let pause = match &result {
            // A copy cut short because the table is going away is not worth a warning.
            Err(_) if settings.shutdown => Duration::ZERO,
            Err(e) => {
                warn!(
                    "clone: hydrating regions {first}..{}: {e}; will retry",
                    first + count
                );
                ERROR_BACKOFF
            }
            Ok(()) => inner.activity.pause_after(started.elapsed(), MAX_YIELD),
        };
        if !pause.is_zero() {
            // Sleep holding nothing, and only until a pause or stop asks for attention.
            settings = inner
                .wake
                .wait_timeout_while(settings, pause, |s| !s.paused && !s.shutdown)
                .unwrap()
                .0;
        }
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
        #[cfg(test)]
        tests_hook::between_check_and_claim(inner, region);
        let Some(claim) = inner.claims.try_claim(region) else {
            break;
        };
        // A user's whole-region write may have finished between the check above and the
        // claim (it marks the region before it lets go of its claim): copying the source now
        // would overwrite that write. Under the claim the bit is final.
        if inner.meta.is_hydrated(region) {
            break;
        }
        claims.push(claim);
        region += 1;
    }
    settings.cursor = if claims.is_empty() { first + 1 } else { region };
    claims
}

/// A test's way into the gap between checking a region and claiming it.
#[cfg(test)]
pub(super) mod tests_hook {
    use std::sync::Mutex;

    type Hook = Box<dyn Fn(&super::Inner, u64) + Send>;
    pub static HOOK: Mutex<Option<Hook>> = Mutex::new(None);

    pub fn between_check_and_claim(inner: &super::Inner, region: u64) {
        if let Some(hook) = &*HOOK.lock().unwrap() {
            hook(inner, region);
        }
    }
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
        inner
            .progress
            .sample(inner.meta.hydrated_count() * inner.region);
        if inner.mode() == Mode::Write && inner.meta.is_dirty() {
            if let Err(e) = inner.commit() {
                warn!("clone: periodic commit: {e}");
            }
        }
        inner.announce_if_complete();
    }
}
