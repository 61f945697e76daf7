//! Per-region claims: whoever copies or overwrites an unhydrated region holds its claim, and
//! everyone else who needs that region waits for that one claim, never for a global lock.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};

#[derive(Default)]
struct Released {
    done: Mutex<bool>,
    cond: Condvar,
}

#[derive(Default)]
pub struct RegionClaims {
    busy: Mutex<HashMap<u64, Arc<Released>>>,
}

/// Holds a region until dropped.
pub struct Claim<'a> {
    claims: &'a RegionClaims,
    pub region: u64,
    released: Arc<Released>,
}

impl RegionClaims {
    /// Claims `region`, waiting while someone else holds it.
    pub fn claim(&self, region: u64) -> Claim<'_> {
        loop {
            let holder = {
                let mut busy = self.busy.lock().unwrap();
                match busy.get(&region) {
                    Some(holder) => holder.clone(),
                    None => return self.insert(&mut busy, region),
                }
            };
            let mut done = holder.done.lock().unwrap();
            while !*done {
                done = holder.cond.wait(done).unwrap();
            }
        }
    }

    /// Claims `region` if nobody holds it.
    pub fn try_claim(&self, region: u64) -> Option<Claim<'_>> {
        let mut busy = self.busy.lock().unwrap();
        (!busy.contains_key(&region)).then(|| self.insert(&mut busy, region))
    }

    /// Regions claimed right now (the status line's "hydrating").
    pub fn count(&self) -> usize {
        self.busy.lock().unwrap().len()
    }

    fn insert(&self, busy: &mut HashMap<u64, Arc<Released>>, region: u64) -> Claim<'_> {
        let released = Arc::new(Released::default());
        busy.insert(region, released.clone());
        Claim {
            claims: self,
            region,
            released,
        }
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.claims.busy.lock().unwrap().remove(&self.region);
        *self.released.done.lock().unwrap() = true;
        self.released.cond.notify_all();
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
