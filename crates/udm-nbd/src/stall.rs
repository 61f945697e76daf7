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
/// room is ended, and its buffers given to them. A client that keeps moving data, however
/// slowly, is not: it is served, and it gives its buffers back as its requests complete.
pub(crate) const UNDER_PRESSURE: Duration = Duration::from_secs(1);

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
    let mut progress = Instant::now();
    while len > 0 {
        match step() {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                len -= n;
                progress = Instant::now();
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                let patience = pressure.patience(budget, timeout);
                if let Some(why) = patience.exceeded(progress.elapsed(), what) {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, why));
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
