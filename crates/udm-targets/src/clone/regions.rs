//! Per-region claims: whoever copies or overwrites an unhydrated region holds its claim, and
//! everyone else who needs that region waits for that one claim, never for a global lock.
//!
//! Claiming and releasing take one short mutex and allocate nothing; the condition variable
//! is signalled only when somebody is actually waiting, so the common, uncontended case
//! costs no system call.

use parking_lot::{Condvar, Mutex};
use std::collections::HashSet;

#[derive(Default)]
struct Busy {
    regions: HashSet<u64>,
    waiters: usize,
}

#[derive(Default)]
pub struct RegionClaims {
    busy: Mutex<Busy>,
    released: Condvar,
}

/// Holds a region until dropped.
pub struct Claim<'a> {
    claims: &'a RegionClaims,
    pub region: u64,
}

impl RegionClaims {
    /// Claims `region`, waiting while someone else holds it.
    pub fn claim(&self, region: u64) -> Claim<'_> {
        let mut busy = self.busy.lock();
        while busy.regions.contains(&region) {
            busy.waiters += 1;
            self.released.wait(&mut busy);
            busy.waiters -= 1;
        }
        busy.regions.insert(region);
        Claim {
            claims: self,
            region,
        }
    }

    /// Claims `region` if nobody holds it.
    pub fn try_claim(&self, region: u64) -> Option<Claim<'_>> {
        let mut busy = self.busy.lock();
        busy.regions.insert(region).then(|| Claim {
            claims: self,
            region,
        })
    }

    /// Regions claimed right now (the status line's "hydrating").
    pub fn count(&self) -> usize {
        self.busy.lock().regions.len()
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        let mut busy = self.claims.busy.lock();
        busy.regions.remove(&self.region);
        if busy.waiters > 0 {
            self.claims.released.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn a_second_claimant_waits_for_the_first() {
        let claims = RegionClaims::default();
        let first = claims.claim(7);
        assert!(claims.try_claim(7).is_none());
        assert!(claims.try_claim(8).is_some());
        std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                let t = Instant::now();
                let _second = claims.claim(7);
                t.elapsed()
            });
            std::thread::sleep(Duration::from_millis(50));
            drop(first);
            assert!(waiter.join().unwrap() >= Duration::from_millis(40));
        });
        assert_eq!(claims.count(), 0);
    }
}
