//! Background hydration: workers copy batches of contiguous unhydrated regions, at most
//! `hydration_threshold` regions at a time, under an optional bandwidth cap, and step back
//! while the user's I/O is in flight. A committer thread commits the bitmap once a second and
//! samples progress for the copy rate.
//!
//! Workers run only while there is copying to do, as many as the settings can keep busy
//! (threshold / batch size, at most [`WORKERS`]): a clone that is complete, paused, suspended
//! or not hydrating holds its committer alone. A host of hundreds of clones must not hold 16
//! idle threads for each (it did: 17 threads per clone, each waking ten times a second).

use parking_lot::MutexGuard;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{info, warn};

use super::commit::Mode;
use super::regions::Claim;
use super::Inner;
use crate::pacing::RateLimit;

/// Copy threads of one clone at most; `hydration_threshold` and `hydration_batch_size` decide
/// how many run (threshold / batch size).
const WORKERS: u64 = 16;
/// The longest pause after a batch while the user is busy (see `pacing`): hydration keeps
/// moving.
const MAX_YIELD: Duration = Duration::from_millis(50);
/// After a failed copy every worker waits (they share the wait: each waiting its own let 16
/// of them ask a failing source 32 times a second), twice as long after each failure in a
/// row, up to the most the NBD client waits between redials, so that copying resumes soon
/// after a source comes back.
const ERROR_BACKOFF: Duration = Duration::from_millis(500);
const MAX_ERROR_BACKOFF: Duration = Duration::from_secs(5);

/// What the user steers, with the table line's core arguments and with messages.
#[derive(Debug, Clone, Copy)]
pub(super) struct Settings {
    pub hydration_enabled: bool,
    /// Regions copied at once, at most.
    pub threshold: u64,
    /// Contiguous regions one worker claims and copies together.
    pub batch_size: u64,
    /// KiB per second for background copying; 0 = unlimited.
    pub max_rate_kib: u64,
}

impl Default for Settings {
    /// The kernel's defaults.
    fn default() -> Self {
        Settings {
            hydration_enabled: true,
            threshold: 1,
            batch_size: 1,
            max_rate_kib: 0,
        }
    }
}

/// The background copy: the settings that steer it and where it stands, under one lock (and
/// one condition variable, [`Inner::wake`]) so that a worker sees both change together.
pub(super) struct Hydration {
    pub settings: Settings,
    /// Regions the workers are copying.
    in_flight: u64,
    /// Where the next batch starts looking.
    cursor: u64,
    /// The bandwidth cap's bookings (the cap is `settings.max_rate_kib`).
    limit: RateLimit,
    /// Nothing is copied until the table goes live, nor while it is suspended.
    paused: bool,
    shutdown: bool,
    /// Copy threads running.
    workers: u64,
    /// No copy starts before this, after a failed one.
    retry_at: Option<Instant>,
    /// The wait after the next failure.
    backoff: Duration,
}

impl Hydration {
    pub(super) fn new(settings: Settings) -> Self {
        Hydration {
            settings,
            in_flight: 0,
            cursor: 0,
            limit: RateLimit::default(),
            // An inactive table must not touch what the live one is using.
            paused: true,
            shutdown: false,
            workers: 0,
            retry_at: None,
            backoff: ERROR_BACKOFF,
        }
    }

    /// Regions being copied right now.
    pub(super) fn in_flight(&self) -> u64 {
        self.in_flight
    }

    /// Copy threads running.
    pub(super) fn workers(&self) -> u64 {
        self.workers
    }

    /// Why no copy is starting while regions remain, if something holds it back: the user
    /// (`disable_hydration`, `hydration_threshold 0`) or the device (suspended, or this table
    /// not live yet).
    pub(super) fn paused_by(&self) -> Option<&'static str> {
        if !self.settings.hydration_enabled {
            Some("disable_hydration")
        } else if self.settings.threshold == 0 {
            Some("hydration_threshold 0")
        } else if self.paused {
            Some("the device is suspended")
        } else {
            None
        }
    }

    pub(super) fn set_max_rate(&mut self, kib: u64) {
        self.settings.max_rate_kib = kib;
        self.limit.reset();
    }
}

impl Inner {
    /// One line when the table first goes live: where hydration starts from and how.
    pub(super) fn log_start(&self) {
        let state = self.hydration.lock();
        let (hydrated, regions) = (self.meta.hydrated_count(), self.meta.regions());
        let what = if hydrated >= regions {
            "nothing left to hydrate".to_string()
        } else if let Some(why) = state.paused_by() {
            format!("hydration paused ({why})")
        } else {
            let s = state.settings;
            let cap = match s.max_rate_kib {
                0 => "no rate cap".to_string(),
                kib => format!("at most {kib} KiB/s"),
            };
            format!(
                "hydration started (hydration_threshold {}, hydration_batch_size {}, {cap})",
                s.threshold, s.batch_size
            )
        };
        info!(
            "clone '{}': {what}; {hydrated} of {regions} regions on the destination",
            self.device
        );
    }

    /// One line when the user pauses or resumes hydration (a message changed the settings
    /// from `was` to `now`); called under the hydration lock, so that no copy starts before
    /// the count is taken.
    pub(super) fn log_pause_change(&self, was: Option<&'static str>, now: Option<&'static str>) {
        if now == was || self.is_complete() {
            return;
        }
        let (hydrated, regions) = (self.meta.hydrated_count(), self.meta.regions());
        match now {
            Some(why) => info!(
                "clone '{}': hydration paused ({why}) at {hydrated} of {regions} regions",
                self.device
            ),
            None => {
                self.progress.clear();
                info!(
                    "clone '{}': hydration resumed at {hydrated} of {regions} regions",
                    self.device
                )
            }
        }
    }
}

/// Starts the committer; it runs until [`stop`].
pub(super) fn start_committer(inner: &Arc<Inner>) -> JoinHandle<()> {
    let inner = inner.clone();
    std::thread::Builder::new()
        .name("clone-commit".into())
        .spawn(move || committer(&inner))
        .expect("spawn clone committer")
}

/// How many copy threads the state can keep busy: none while nothing may be copied for a
/// reason only a change of settings, mode or suspension ends.
fn wanted_workers(inner: &Inner, s: &Hydration) -> u64 {
    if s.shutdown || s.paused_by().is_some() || inner.mode() != Mode::Write || inner.is_complete() {
        return 0;
    }
    s.settings
        .threshold
        .div_ceil(s.settings.batch_size)
        .min(WORKERS)
}

/// Starts the copy threads the state wants and has not got (after a resume or a change of
/// settings); threads it no longer wants leave by themselves.
pub(super) fn staff(inner: &Arc<Inner>) {
    let mut state = inner.hydration.lock();
    let mut copiers = inner.copiers.lock();
    // The threads that have left are joined here, so that their handles do not pile up.
    copiers.retain(|worker| !worker.is_finished());
    while state.workers < wanted_workers(inner, &state) {
        state.workers += 1;
        let inner = inner.clone();
        copiers.push(
            std::thread::Builder::new()
                .name("clone-hydrate".into())
                .spawn(move || worker(&inner))
                .expect("spawn hydration worker"),
        );
    }
}

/// Waits for every thread, once [`stop`] has told them to go.
pub(super) fn join(inner: &Inner, committer: Option<JoinHandle<()>>) {
    let copiers = std::mem::take(&mut *inner.copiers.lock());
    for thread in copiers.into_iter().chain(committer) {
        let _ = thread.join();
    }
}

/// Pausing waits for the batches in flight to finish.
pub(super) fn pause(inner: &Inner, paused: bool) {
    let mut state = inner.hydration.lock();
    if !paused && state.paused {
        // The rate is measured from here, not across the time nothing was copied.
        inner.progress.clear();
    }
    state.paused = paused;
    inner.wake.notify_all();
    while paused && state.in_flight > 0 {
        inner.wake.wait(&mut state);
    }
}

pub(super) fn stop(inner: &Inner) {
    inner.hydration.lock().shutdown = true;
    inner.wake.notify_all();
}

fn may_copy(inner: &Inner, s: &Hydration) -> bool {
    s.settings.hydration_enabled
        && !s.paused
        && s.in_flight < s.settings.threshold
        && inner.mode() == Mode::Write
        && !inner.is_complete()
        // While the user is busy, one batch at a time.
        && (s.in_flight == 0 || !inner.activity.busy())
}

fn worker(inner: &Inner) {
    let mut state = inner.hydration.lock();
    loop {
        if state.workers > wanted_workers(inner, &state) {
            state.workers -= 1;
            return;
        }
        if !may_copy(inner, &state) {
            inner.wake.wait_for(&mut state, Duration::from_millis(100));
            continue;
        }
        if let Some(at) = state.retry_at {
            let now = Instant::now();
            if now < at {
                inner.wake.wait_for(&mut state, at - now);
                continue;
            }
            state.retry_at = None;
        }
        // Wait out the bandwidth cap before claiming anything: a claimed region holds up the
        // user's I/O to it and a suspend, so claims are only ever held while copying. A rate
        // change or a pause wakes the wait.
        if let Some(wait) = state.limit.wait(state.settings.max_rate_kib) {
            inner.wake.wait_for(&mut state, wait);
            continue;
        }
        let claims = claim_batch(inner, &mut state);
        if claims.is_empty() {
            // Everything left is being copied by someone else right now.
            inner.wake.wait_for(&mut state, Duration::from_millis(20));
            continue;
        }
        let count = claims.len() as u64;
        state.in_flight += count;
        // Booked whole before copying, so that workers starting together do not burst past
        // the cap; what the source turns out not to need reading is given back below.
        let kib = state.settings.max_rate_kib;
        state.limit.reserve(kib, count * inner.region);
        drop(state);

        let first = claims[0].region;
        let started = Instant::now();
        let result = inner.copy_claimed(claims);

        state = inner.hydration.lock();
        state.in_flight -= count;
        // The cap counts what was read from the source: ranges the source reports as zero
        // cost it nothing, and a sparse source must not be held to the rate of a full one.
        if let Ok(read) = &result {
            let kib = state.settings.max_rate_kib;
            state
                .limit
                .refund(kib, (count * inner.region).saturating_sub(*read));
        }
        inner.wake.notify_all();
        let pause = match &result {
            // A copy cut short because the table is going away is not worth a warning.
            Err(_) if state.shutdown => Duration::ZERO,
            Err(e) => {
                warn!(
                    "clone '{}': hydrating regions {first}..{}: {e}; will retry in {:?}",
                    inner.device,
                    first + count,
                    state.backoff
                );
                state.retry_at = Some(Instant::now() + state.backoff);
                state.backoff = (state.backoff * 2).min(MAX_ERROR_BACKOFF);
                Duration::ZERO
            }
            Ok(_) => {
                state.backoff = ERROR_BACKOFF;
                inner.activity.pause_after(started.elapsed(), MAX_YIELD)
            }
        };
        if !pause.is_zero() {
            // Sleep holding nothing, and only until a pause or stop asks for attention.
            inner
                .wake
                .wait_while_for(&mut state, |s| !s.paused && !s.shutdown, pause);
        }
    }
}

/// Claims up to a batch of contiguous unhydrated regions from the cursor on.
fn claim_batch<'a>(inner: &'a Inner, state: &mut MutexGuard<'_, Hydration>) -> Vec<Claim<'a>> {
    let allowed = state
        .settings
        .batch_size
        .min(state.settings.threshold - state.in_flight);
    let Some(first) = inner.meta.next_unhydrated(state.cursor) else {
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
    state.cursor = if claims.is_empty() { first + 1 } else { region };
    claims
}

fn committer(inner: &Inner) {
    let mut next_tick = Instant::now() + Duration::from_secs(1);
    loop {
        {
            let mut state = inner.hydration.lock();
            loop {
                if state.shutdown {
                    return;
                }
                let Some(left) = next_tick.checked_duration_since(Instant::now()) else {
                    break;
                };
                inner.wake.wait_for(&mut state, left);
            }
        }
        next_tick += Duration::from_secs(1);
        inner
            .progress
            .sample(inner.meta.hydrated_count() * inner.region);
        if inner.mode() == Mode::Write && inner.meta.is_dirty() {
            if let Err(e) = inner.commit() {
                warn!("clone '{}': periodic commit: {e}", inner.device);
            }
        }
        inner.announce_if_complete();
    }
}

/// A test's way into the gap between checking a region and claiming it.
#[cfg(test)]
pub(super) mod tests_hook {
    use parking_lot::Mutex;

    type Hook = Box<dyn Fn(&super::Inner, u64) + Send>;
    pub static HOOK: Mutex<Option<Hook>> = Mutex::new(None);

    pub fn between_check_and_claim(inner: &super::Inner, region: u64) {
        if let Some(hook) = &*HOOK.lock() {
            hook(inner, region);
        }
    }
}
