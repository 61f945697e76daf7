//! What every thread serving one connection shares: the filesystem, the limits told to the
//! kernel at INIT, and how the INIT handshake went (which decides whether requests come
//! through /dev/fuse or through io_uring).

use parking_lot::{Condvar, Mutex};
use std::time::Duration;

use crate::fs::Fs;

/// What the kernel is told at INIT.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub max_request: u32,
    pub max_background: u16,
}

pub(crate) struct Session {
    pub fs: Fs,
    pub limits: Limits,
    /// Whether INIT asks for FUSE over io_uring: the queues are set up and wait for it.
    pub offer_uring: bool,
    /// `Some(uring)` once INIT has been answered.
    handshake: Mutex<Option<bool>>,
    answered: Condvar,
}

impl Session {
    pub fn new(fs: Fs, limits: Limits, offer_uring: bool) -> Session {
        Session {
            fs,
            limits,
            offer_uring,
            handshake: Mutex::new(None),
            answered: Condvar::new(),
        }
    }

    /// INIT has been answered (the kernel has processed the reply when the write returns),
    /// with FUSE over io_uring agreed or not.
    pub fn handshake_done(&self, uring: bool) {
        *self.handshake.lock() = Some(uring);
        self.answered.notify_all();
    }

    /// Waits up to `limit` for INIT to be answered; whether io_uring was agreed, or None if
    /// the kernel never sent INIT in that time.
    pub fn wait_handshake(&self, limit: Duration) -> Option<bool> {
        let mut guard = self.handshake.lock();
        self.answered
            .wait_while_for(&mut guard, |h| h.is_none(), limit);
        *guard
    }
}
