//! Running out of data space, as dm-thin does: a write that needs a block when none is free
//! puts the pool in out_of_data_space mode and waits (outside the pool's gate and its cell,
//! so the pool can still be suspended and reloaded with a larger data device) for space:
//! a grown data device, or blocks freed by discards or deletes once committed. After
//! `--no-space-timeout` (the kernel's `no_space_timeout` module parameter, 60 s by default,
//! 0 = wait for ever) the pool switches to erroring, and waiting and new writes fail with
//! ENOSPC until space comes back. With `error_if_no_space` they fail at once.

use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use log::error;
use udm_block::{BlockError, Result};

use super::core::Pool;
use super::status::Mode;

static NO_SPACE_TIMEOUT_MS: AtomicU64 = AtomicU64::new(60_000);

/// How long writes wait for data space before failing (the daemon's `--no-space-timeout`).
pub fn set_no_space_timeout(timeout: Duration) {
    NO_SPACE_TIMEOUT_MS.store(timeout.as_millis() as u64, Ordering::Relaxed);
}

fn no_space_timeout() -> Option<Duration> {
    match NO_SPACE_TIMEOUT_MS.load(Ordering::Relaxed) {
        0 => None,
        ms => Some(Duration::from_millis(ms)),
    }
}

#[derive(Default)]
struct State {
    /// When the pool ran out of space (the timeout runs from here).
    since: Option<Instant>,
    /// The timeout passed: requests fail until space comes back.
    timed_out: bool,
    /// Bumped whenever space may have come back, so that a waiter retries.
    generation: u64,
}

#[derive(Default)]
pub struct Space {
    state: Mutex<State>,
    changed: Condvar,
    /// Writes waiting for space now: the pool's status details show it (what a grown data
    /// device would set going).
    waiting: AtomicUsize,
}

/// Why a write could not complete now.
pub enum Stall {
    /// No free data block: wait for `generation` to change (see [`Pool::wait_for_space`]).
    NoSpace(u64),
    Failed(BlockError),
}

impl From<BlockError> for Stall {
    fn from(e: BlockError) -> Self {
        Stall::Failed(e)
    }
}

impl Space {
    /// Something that may give space back happened: waiters retry.
    pub fn changed(&self) {
        self.state.lock().generation += 1;
        self.changed.notify_all();
    }

    /// Space is back (or the pool was rebound): the next shortage starts a new timeout.
    pub fn reset(&self) {
        let mut state = self.state.lock();
        state.since = None;
        state.timed_out = false;
        state.generation += 1;
        self.changed.notify_all();
    }

    pub fn timed_out(&self) -> bool {
        self.state.lock().timed_out
    }

    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }
}

impl Pool {
    /// A data block for a write (and the metadata epoch it belongs to), or the reason to
    /// wait or fail.
    pub fn allocate(&self) -> std::result::Result<(u64, u64), Stall> {
        if let Some(block) = self.alloc_block()? {
            return Ok(block);
        }
        let error_at_once = self.features().error_if_no_space;
        self.set_mode(Mode::OutOfDataSpace);
        let generation = {
            let mut state = self.space.state.lock();
            state.since.get_or_insert_with(Instant::now);
            (!error_at_once && !state.timed_out).then_some(state.generation)
        };
        match generation {
            Some(generation) => Err(Stall::NoSpace(generation)),
            None => Err(Stall::Failed(self.no_space_error())),
        }
    }

    /// Waits until space may have come back (then the caller retries) or the no-space
    /// timeout passes (then ENOSPC).
    pub fn wait_for_space(&self, generation: u64) -> Result<()> {
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        self.space.waiting.fetch_add(1, Ordering::SeqCst);
        let _waiting = Waiting(&self.space.waiting);
        let mut state = self.space.state.lock();
        loop {
            if state.generation != generation {
                return Ok(());
            }
            if state.timed_out {
                return Err(self.no_space_error());
            }
            let deadline = no_space_timeout()
                .map(|timeout| state.since.unwrap_or_else(Instant::now) + timeout);
            match deadline {
                Some(deadline) if Instant::now() >= deadline => {
                    state.timed_out = true;
                    drop(state);
                    error!(
                        "thin-pool '{}': no data space for {:?}: switching to erroring \
                         writes that need a new block (ENOSPC) until the data device grows",
                        self.name,
                        no_space_timeout().unwrap_or_default()
                    );
                    self.raise_event();
                    self.space.changed.notify_all();
                    return Err(self.no_space_error());
                }
                Some(deadline) => {
                    self.space
                        .changed
                        .wait_for(&mut state, deadline - Instant::now());
                }
                None => self.space.changed.wait(&mut state),
            }
        }
    }

    pub(super) fn no_space_error(&self) -> BlockError {
        BlockError::NoSpace(format!("thin-pool '{}' is out of data space", self.name))
    }
}
