//! SIGTERM and SIGINT, collected by the main thread alone so that it shuts down in order; and
//! SIGHUP, which reopens the log file (see [`log_file`](super::log_file)) at any time.

use std::time::{Duration, Instant};

use super::log_file;

/// Blocks SIGTERM, SIGINT and SIGHUP in every thread started after this (threads inherit the
/// mask), so that only [`wait_for_signal`] sees them: SIGHUP's default action would end the
/// daemon without its stop (no flush, sockets left behind).
pub fn block_daemon_signals() -> libc::sigset_t {
    // SAFETY: plain signal-mask calls on a set we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGHUP);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// Waits for SIGTERM or SIGINT, or `timeout` (zero: only looks); returns the signal. A SIGHUP
/// meanwhile reopens the log file, and the wait goes on.
pub fn wait_for_signal(signals: &libc::sigset_t, timeout: Option<Duration>) -> Option<i32> {
    let deadline = timeout.map(|timeout| Instant::now() + timeout);
    loop {
        let signal = match deadline {
            // SAFETY: waits for one of the blocked signals.
            None => unsafe {
                let mut signal = 0;
                libc::sigwait(signals, &mut signal);
                signal
            },
            Some(deadline) => {
                let left = deadline.saturating_duration_since(Instant::now());
                let timeout = libc::timespec {
                    tv_sec: left.as_secs() as libc::time_t,
                    tv_nsec: left.subsec_nanos() as libc::c_long,
                };
                // SAFETY: as above, with a timeout; -1 (EAGAIN) when it expires.
                unsafe { libc::sigtimedwait(signals, std::ptr::null_mut(), &timeout) }
            }
        };
        match signal {
            libc::SIGHUP => log_file::reopen(),
            signal => return (signal > 0).then_some(signal),
        }
    }
}

/// Kills the daemon here, as `kill -9` would, when `UDM_CRASH_AT` names `point`: for the tests
/// of what the next start finds after a crash at that very point, which a kill from outside
/// cannot aim at.
pub fn crash_point(point: &str) {
    if std::env::var_os("UDM_CRASH_AT").is_some_and(|at| at == point) {
        // SAFETY: kill(2) on our own pid; SIGKILL cannot be caught, so nothing runs after it.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}
