//! Per-block cells (dm's bio prison, reduced to what udm needs): I/O to a provisioned block
//! holds its cell shared; whoever changes where a block lives — provisioning it, breaking
//! sharing, unmapping it — holds it exclusively. So a request waits only for the one block
//! being changed, never for a pool-wide lock, and a data block is never freed (and handed to
//! another device) while I/O through the old mapping is still in flight.
//!
//! One short mutex; the condition variable is signalled only when somebody waits.

use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::ops::Deref;

/// (thin device id, virtual block).
pub type Key = (u32, u64);

#[derive(Default)]
struct State {
    shared: u32,
    exclusive: bool,
}

/// Every mapped request takes and drops a cell (and looks in the mapping cache): the keys are
/// block numbers, so a multiply-and-rotate hash does instead of SipHash.
#[derive(Default)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(n as u64);
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

#[derive(Default)]
struct Busy {
    cells: HashMap<Key, State, BuildHasherDefault<KeyHasher>>,
    waiters: usize,
}

#[derive(Default)]
pub struct Cells {
    busy: Mutex<Busy>,
    released: Condvar,
}

/// A held cell, released on drop. `C` is `&Cells` on the synchronous path and an owning
/// handle for mapped requests, which hold their cells until the I/O completes.
pub struct Cell<C: Deref<Target = Cells>> {
    cells: C,
    key: Key,
    exclusive: bool,
}

impl Cells {
    /// Holds `key` shared, waiting while someone holds it exclusively.
    pub fn shared<C: Deref<Target = Cells>>(cells: C, key: Key) -> Cell<C> {
        Cells::hold(cells, key, false)
    }

    /// Holds `key` exclusively, waiting for every other holder.
    pub fn exclusive<C: Deref<Target = Cells>>(cells: C, key: Key) -> Cell<C> {
        Cells::hold(cells, key, true)
    }

    fn hold<C: Deref<Target = Cells>>(cells: C, key: Key, exclusive: bool) -> Cell<C> {
        cells.acquire(key, exclusive);
        Cell {
            cells,
            key,
            exclusive,
        }
    }

    /// Holds `key` shared if nobody holds it exclusively (for callers that must not wait).
    pub fn try_shared<C: Deref<Target = Cells>>(cells: C, key: Key) -> Option<Cell<C>> {
        let mut busy = cells.busy.lock();
        let state = busy.cells.entry(key).or_default();
        if state.exclusive {
            return None;
        }
        state.shared += 1;
        drop(busy);
        Some(Cell {
            cells,
            key,
            exclusive: false,
        })
    }

    fn acquire(&self, key: Key, exclusive: bool) {
        let mut busy = self.busy.lock();
        loop {
            let state = busy.cells.entry(key).or_default();
            let free = !state.exclusive && (!exclusive || state.shared == 0);
            if free {
                if exclusive {
                    state.exclusive = true;
                } else {
                    state.shared += 1;
                }
                return;
            }
            busy.waiters += 1;
            self.released.wait(&mut busy);
            busy.waiters -= 1;
        }
    }

    fn release(&self, key: Key, exclusive: bool) {
        let mut busy = self.busy.lock();
        if let Some(state) = busy.cells.get_mut(&key) {
            if exclusive {
                state.exclusive = false;
            } else {
                state.shared -= 1;
            }
            if !state.exclusive && state.shared == 0 {
                busy.cells.remove(&key);
            }
        }
        if busy.waiters > 0 {
            self.released.notify_all();
        }
    }

    /// Cells held right now.
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.busy.lock().cells.len()
    }
}

impl<C: Deref<Target = Cells>> Drop for Cell<C> {
    fn drop(&mut self) {
        self.cells.release(self.key, self.exclusive);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    #[test]
    fn readers_share_and_a_changer_waits_for_them() {
        let cells = Cells::default();
        let a = Cells::shared(&cells, (1, 5));
        let b = Cells::try_shared(&cells, (1, 5)).expect("shared twice");
        std::thread::scope(|s| {
            let changer = s.spawn(|| {
                let t = Instant::now();
                let _x = Cells::exclusive(&cells, (1, 5));
                assert!(Cells::try_shared(&cells, (1, 5)).is_none());
                // Other blocks and other devices are not held up.
                let _other = Cells::exclusive(&cells, (2, 5));
                let _next = Cells::try_shared(&cells, (1, 6)).unwrap();
                t.elapsed()
            });
            std::thread::sleep(Duration::from_millis(30));
            drop(a);
            std::thread::sleep(Duration::from_millis(30));
            drop(b);
            assert!(changer.join().unwrap() >= Duration::from_millis(50));
        });
        assert_eq!(cells.held(), 0);
    }

    #[test]
    fn owned_cells_outlive_the_caller() {
        let cells = Arc::new(Cells::default());
        let held = Cells::try_shared(cells.clone(), (0, 0)).unwrap();
        let mapped: Box<dyn std::any::Any + Send> = Box::new(held);
        assert_eq!(cells.held(), 1);
        drop(mapped);
        assert_eq!(cells.held(), 0);
    }
}
