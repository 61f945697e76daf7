//! When a connection whose client stopped in the middle of a request is ended, the same on
//! both engines: a request's buffer is held while the client sends the rest of a write's
//! data or reads a reply, and a client that stops there (a paused VM, a hostile peer) holds
//! that memory of the [`BufferBudget`] for as long as the server waits for it. A dozen such
//! clients with 32 MiB requests held the whole budget, and every other client of the daemon
//! waited behind them.

use std::io;
use std::time::{Duration, Instant};

use crate::budget::BufferBudget;

/// A connection that makes no progress for this long while other requests wait for buffer
/// room is ended, and its buffers given to them.
pub(crate) const UNDER_PRESSURE: Duration = Duration::from_secs(1);

/// Progress is this many bytes of a request's data moved (or the rest of it): a client that
/// sent a byte of a write every half second held its 32 MiB buffer for good, as one that
/// sends none did. So while others wait for room, a client must move at least 64 KiB a
/// second; slower than that, it gives its buffers to them. A reader that slow looks stalled
/// anyway: its socket's buffer takes what it reads, and the server moves nothing until about
/// half of that buffer is free (100 KiB of a Unix socket's).
pub(crate) const PROGRESS: usize = 64 << 10;

/// When a request's data last moved [`PROGRESS`] bytes.
pub(crate) struct Progress {
    since: Instant,
    moved: usize,
}

impl Progress {
    pub fn new() -> Self {
        Progress {
            since: Instant::now(),
            moved: 0,
        }
    }

    /// Counts `n` bytes moved.
    pub fn moved(&mut self, n: usize) {
        self.moved += n;
        if self.moved >= PROGRESS {
            self.moved = 0;
            self.since = Instant::now();
        }
    }

    /// How long since the data last made progress.
    pub fn quiet(&self) -> Duration {
        self.since.elapsed()
    }
}

/// How often the threaded engine's blocked reads and writes of a request's data look whether
/// their client has stalled (their socket's timeout while they move it).
pub(crate) const LOOK_EVERY: Duration = Duration::from_millis(250);

/// Whether other requests wait for buffer room, as one observer (an event loop, a connection)
/// sees it between its looks.
pub(crate) struct Pressure {
    refusals_seen: u64,
}

impl Pressure {
    pub fn new(budget: &BufferBudget) -> Self {
        Pressure {
            refusals_seen: budget.refusals(),
        }
    }

    /// How long a client may make no progress now: [`UNDER_PRESSURE`] if a request was
    /// refused room since the last look or waits for it now, `timeout` otherwise.
    pub fn patience(&mut self, budget: &BufferBudget, timeout: Duration) -> Patience {
        let refusals = budget.refusals();
        let moved = std::mem::replace(&mut self.refusals_seen, refusals) != refusals;
        if moved || budget.waiting() {
            Patience {
                limit: UNDER_PRESSURE,
                pressed: true,
            }
        } else {
            Patience {
                limit: timeout,
                pressed: false,
            }
        }
    }
}

/// How long a client may make no progress, and why.
pub(crate) struct Patience {
    limit: Duration,
    pressed: bool,
}

impl Patience {
    /// Why a connection whose client made no progress for `quiet` is ended, if it is: the
    /// client `what` ("sent none of …", "read none of …") for too long.
    pub fn exceeded(&self, quiet: Duration, what: &str) -> Option<String> {
        (quiet > self.limit).then(|| {
            let pressed = if self.pressed {
                ", while other requests waited for buffer room"
            } else {
                ""
            };
            format!("the client {what} for {:?}{pressed}", self.limit)
        })
    }
}

/// Whether a blocking socket's read or write ended because its timeout expired.
pub(crate) fn timed_out(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Moves a request's data with a blocking socket whose timeout is [`LOOK_EVERY`] (the
/// threaded engine): `step` moves some of it and says how many bytes, until `len` have moved.
/// Fails with why once the client makes no progress for longer than [`Pressure`] allows
/// (`what` says what it failed to do), or ends the connection.
pub(crate) fn move_all(
    budget: &BufferBudget,
    timeout: Duration,
    what: &str,
    mut len: usize,
    mut step: impl FnMut() -> io::Result<usize>,
) -> io::Result<()> {
    let mut pressure = Pressure::new(budget);
    let mut progress = Progress::new();
    while len > 0 {
        match step() {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                len -= n;
                progress.moved(n);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if timed_out(&e) => {
                let patience = pressure.patience(budget, timeout);
                if let Some(why) = patience.exceeded(progress.quiet(), what) {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, why));
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_byte_now_and_then_is_no_progress_and_pressure_shortens_the_patience() {
        let mut progress = Progress::new();
        let start = progress.since;
        progress.moved(1);
        progress.moved(PROGRESS - 2);
        assert_eq!(progress.since, start, "a byte short of a piece");
        progress.moved(1);
        assert!(progress.since > start, "a whole piece");

        let budget = Arc::new(BufferBudget::new(8192));
        let mut pressure = Pressure::new(&budget);
        let timeout = Duration::from_secs(30);
        let quiet = Duration::from_secs(2);
        assert_eq!(
            pressure.patience(&budget, timeout).exceeded(quiet, "x"),
            None
        );
        let held = budget.try_take(8192).expect("room");
        assert!(budget.try_take(4096).is_none(), "refused");
        let why = pressure
            .patience(&budget, timeout)
            .exceeded(quiet, "moved nothing");
        assert_eq!(
            why.as_deref(),
            Some("the client moved nothing for 1s, while other requests waited for buffer room")
        );
        // Refused once, long ago: no pressure now.
        assert_eq!(
            pressure.patience(&budget, timeout).exceeded(quiet, "x"),
            None
        );
        drop(held);
    }
}
