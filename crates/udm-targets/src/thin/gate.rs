//! The pool's gate: every thin request passes it, so suspending the pool holds the thin
//! devices' I/O and waits for what is in flight (the kernel's pool_presuspend suspends every
//! active thin) before the pool commits and a reload rebinds it.
//!
//! The I/O path touches only atomics: a request counts itself in, then checks `closed`;
//! `close` sets `closed`, then waits for the count to drain. With sequentially consistent
//! order one of them always sees the other.

use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

pub struct Gate {
    in_flight: AtomicUsize,
    closed: AtomicBool,
    sleep: Mutex<()>,
    wake: Condvar,
}

impl Gate {
    /// A gate that starts closed: a pool is suspended until its first resume.
    pub fn closed() -> Gate {
        Gate {
            in_flight: AtomicUsize::new(0),
            closed: AtomicBool::new(true),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
        }
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Counts a request in; false (and counted back out) while closed.
    pub fn try_enter(&self) -> bool {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        if !self.closed.load(Ordering::SeqCst) {
            return true;
        }
        self.leave();
        false
    }

    /// Counts a request in, waiting while the gate is closed.
    pub fn enter(&self) {
        while !self.try_enter() {
            let mut sleep = self.sleep.lock();
            while self.closed.load(Ordering::SeqCst) {
                self.wake.wait(&mut sleep);
            }
        }
    }

    pub fn leave(&self) {
        if self.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 && self.closed.load(Ordering::SeqCst)
        {
            let _sleep = self.sleep.lock();
            self.wake.notify_all();
        }
    }

    /// Closes the gate and waits until nothing is in flight. False if it was closed already.
    pub fn close(&self) -> bool {
        if self.closed.swap(true, Ordering::SeqCst) {
            return false;
        }
        let mut sleep = self.sleep.lock();
        while self.in_flight.load(Ordering::SeqCst) > 0 {
            self.wake.wait(&mut sleep);
        }
        true
    }

    pub fn open(&self) {
        let _sleep = self.sleep.lock();
        self.closed.store(false, Ordering::SeqCst);
        self.wake.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    #[test]
    fn close_waits_for_what_is_in_flight_and_holds_the_rest() {
        let gate = Arc::new(Gate::closed());
        assert!(!gate.try_enter());
        gate.open();
        assert!(gate.try_enter());
        let closer = {
            let gate = gate.clone();
            std::thread::spawn(move || {
                let t = Instant::now();
                assert!(gate.close());
                t.elapsed()
            })
        };
        std::thread::sleep(Duration::from_millis(40));
        gate.leave();
        assert!(closer.join().unwrap() >= Duration::from_millis(30));
        let waiter = {
            let gate = gate.clone();
            std::thread::spawn(move || {
                gate.enter();
                gate.leave();
            })
        };
        std::thread::sleep(Duration::from_millis(20));
        assert!(!waiter.is_finished());
        gate.open();
        waiter.join().unwrap();
    }
}
