//! The server-wide budget for request payloads: every READ and WRITE buffer of every
//! connection on every listener is taken from one [`BufferBudget`], so the memory clients can
//! make the server hold is bounded by the budget whatever they send.
//!
//! Buffers are mapped straight from the kernel and go back to it when freed (the allocator
//! could keep freed memory beyond the budget). Buffers of up to [`CACHED_MAX`] bytes are kept
//! in a pool once their reply is sent, so small requests reuse warm memory instead of mapping
//! and faulting in pages each time; pooled buffers count against the budget like lent ones
//! and are freed when a request needs their room. Larger buffers are freed after the reply.
//!
//! Requests are granted in arrival order, so a large one is not starved by a stream of small
//! ones. A request larger than the whole budget waits until no other buffer is lent out and
//! is then served alone: the budget is exceeded by that one request, never refused.

use parking_lot::{Condvar, Mutex, MutexGuard};
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use udm_block::AlignedBuf;

const PAGE: usize = 4096;
/// Buffers up to this size are pooled after use (by power-of-two size class).
pub const CACHED_MAX: usize = 4 << 20;
const CLASSES: usize = (CACHED_MAX / PAGE).trailing_zeros() as usize + 1;
/// At most this many bytes of idle buffers are pooled, so a burst does not pin the budget.
const POOL_MAX: usize = 64 << 20;

pub struct BufferBudget {
    limit: usize,
    state: Mutex<State>,
    changed: Condvar,
    /// Requests told to wait for room so far: whether it moved tells whether anyone waits
    /// for memory that a stalled client holds (see `stall`).
    refusals: AtomicU64,
}

#[derive(Default)]
struct State {
    /// Bytes of every buffer that exists: lent out or pooled.
    allocated: usize,
    /// Of those, bytes idle in the pool.
    pooled: usize,
    /// Idle buffers by size class (`PAGE << class` bytes).
    pool: [Vec<AlignedBuf>; CLASSES],
    /// Ticket of the next request to arrive, and of the one whose turn it is.
    next_ticket: u64,
    serving: u64,
    /// Requests blocked in `take`; nobody is woken when there are none.
    waiting: usize,
}

impl State {
    fn lent(&self) -> usize {
        self.allocated - self.pooled
    }

    /// Pops the largest pooled buffer, to free its room.
    fn evict(&mut self) -> Option<AlignedBuf> {
        let class = (0..CLASSES).rev().find(|&c| !self.pool[c].is_empty())?;
        let size = PAGE << class;
        self.pooled -= size;
        self.allocated -= size;
        self.pool[class].pop()
    }
}

/// The buffer sizes requests are rounded to: a power of two while pooled, whole pages beyond.
fn size_for(len: usize) -> usize {
    let len = len.max(PAGE);
    if len <= CACHED_MAX {
        len.next_power_of_two()
    } else {
        len.next_multiple_of(PAGE)
    }
}

fn class_of(size: usize) -> Option<usize> {
    (size <= CACHED_MAX).then(|| (size / PAGE).trailing_zeros() as usize)
}

impl BufferBudget {
    /// A budget of `limit` bytes (at least one page).
    pub fn new(limit: usize) -> Self {
        BufferBudget {
            limit: limit.max(PAGE),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            refusals: AtomicU64::new(0),
        }
    }

    /// How many requests have been told to wait for room so far.
    pub fn refusals(&self) -> u64 {
        self.refusals.load(Ordering::Relaxed)
    }

    /// Whether a request waits for room now, blocked in [`BufferBudget::take`].
    pub fn waiting(&self) -> bool {
        self.lock().waiting > 0
    }

    /// Bytes of buffers that exist now, lent out or pooled.
    #[cfg(test)]
    fn allocated(&self) -> usize {
        self.lock().allocated
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    /// A buffer of `len` bytes, waiting for room in the budget if needed. Its contents are
    /// unspecified (a pooled buffer keeps an earlier request's data): fill it before use.
    pub fn take(self: &Arc<Self>, len: usize) -> Payload {
        let size = size_for(len);
        let mut evicted = Vec::new();
        let mut st = self.lock();
        let ticket = st.next_ticket;
        st.next_ticket += 1;
        let pooled = loop {
            if st.serving == ticket {
                if let Some(buf) = class_of(size).and_then(|c| st.pool[c].pop()) {
                    st.pooled -= size;
                    break Some(buf);
                }
                if st.lent() + size <= self.limit || st.lent() == 0 {
                    while st.allocated + size > self.limit {
                        match st.evict() {
                            Some(buf) => evicted.push(buf),
                            None => break,
                        }
                    }
                    st.allocated += size;
                    break None;
                }
            }
            st.waiting += 1;
            self.refusals.fetch_add(1, Ordering::Relaxed);
            self.changed.wait(&mut st);
            st.waiting -= 1;
        };
        st.serving += 1;
        if st.waiting > 0 {
            // The next ticket may be waiting for its turn.
            self.changed.notify_all();
        }
        drop(st);
        drop(evicted);
        self.lend(pooled, size, len)
    }

    /// A buffer of `len` bytes if there is room now; `None` means try again once buffers
    /// come back. For event loops, which must not wait. Takers blocked in
    /// [`BufferBudget::take`] go first.
    pub fn try_take(self: &Arc<Self>, len: usize) -> Option<Payload> {
        let size = size_for(len);
        let mut evicted = Vec::new();
        let mut st = self.lock();
        if st.waiting > 0 {
            self.refusals.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let pooled = match class_of(size).and_then(|c| st.pool[c].pop()) {
            Some(buf) => {
                st.pooled -= size;
                Some(buf)
            }
            None if st.lent() + size <= self.limit || st.lent() == 0 => {
                while st.allocated + size > self.limit {
                    match st.evict() {
                        Some(buf) => evicted.push(buf),
                        None => break,
                    }
                }
                st.allocated += size;
                None
            }
            None => {
                self.refusals.fetch_add(1, Ordering::Relaxed);
                return None;
            }
        };
        drop(st);
        drop(evicted);
        Some(self.lend(pooled, size, len))
    }

    fn lend(self: &Arc<Self>, pooled: Option<AlignedBuf>, size: usize, len: usize) -> Payload {
        let mut buf = pooled.unwrap_or_else(|| AlignedBuf::mapped(size));
        buf.resize(len);
        Payload {
            buf: Some(buf),
            size,
            budget: self.clone(),
        }
    }

    fn give_back(&self, buf: AlignedBuf, size: usize) {
        let mut st = self.lock();
        let freed = match class_of(size) {
            Some(class) if st.pooled + size <= POOL_MAX.min(self.limit) => {
                st.pooled += size;
                st.pool[class].push(buf);
                None
            }
            _ => {
                st.allocated -= size;
                Some(buf)
            }
        };
        if st.waiting > 0 {
            self.changed.notify_all();
        }
        drop(st);
        drop(freed);
    }
}

/// A buffer lent by a [`BufferBudget`]; it goes back (to the pool or the kernel) on drop,
/// also when a request handler panics.
pub struct Payload {
    buf: Option<AlignedBuf>,
    size: usize,
    budget: Arc<BufferBudget>,
}

impl Deref for Payload {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.buf.as_deref().expect("payload present until dropped")
    }
}

impl DerefMut for Payload {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.buf
            .as_deref_mut()
            .expect("payload present until dropped")
    }
}

impl Drop for Payload {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.budget.give_back(buf, self.size);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    /// Asserts that a take of `len` waits while `held` is lent (`why`), is served once it
    /// comes back, and that the budget was kept.
    fn waits_for_the_return_of(budget: &Arc<BufferBudget>, held: Payload, len: usize, why: &str) {
        std::thread::scope(|scope| {
            let (tx, rx) = mpsc::channel();
            scope.spawn(move || tx.send(budget.take(len).len()).unwrap());
            assert!(
                rx.recv_timeout(Duration::from_millis(200)).is_err(),
                "{why}"
            );
            drop(held);
            assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), len);
        });
        assert!(budget.allocated() <= budget.limit);
    }

    #[test]
    fn try_take_never_waits_and_yields_to_blocked_takers() {
        let budget = &Arc::new(BufferBudget::new(8 << 20));
        let held = budget.try_take(6 << 20).expect("room");
        assert!(
            budget.try_take(4 << 20).is_none(),
            "no room: no wait either"
        );
        assert_eq!(budget.refusals(), 1, "each refusal is counted");
        let small = budget.try_take(4096).expect("room for a small one");
        drop(small);
        std::thread::scope(|scope| {
            let (tx, rx) = mpsc::channel();
            scope.spawn(move || {
                let _b = budget.take(4 << 20);
                tx.send(()).unwrap();
            });
            while budget.lock().waiting == 0 {
                std::thread::sleep(Duration::from_millis(5));
            }
            assert!(
                budget.try_take(4096).is_none(),
                "a blocked taker goes first"
            );
            assert_eq!(budget.refusals(), 3, "the wait and the refusal are counted");
            drop(held);
            rx.recv_timeout(Duration::from_secs(5)).unwrap();
        });
        assert!(
            budget.try_take(8 << 20).is_some(),
            "alone, the whole budget"
        );
    }

    #[test]
    fn sizes_round_to_classes_then_pages() {
        assert_eq!(size_for(0), PAGE);
        assert_eq!(size_for(512), PAGE);
        assert_eq!(size_for(12 << 10), 16 << 10);
        assert_eq!(size_for(CACHED_MAX), CACHED_MAX);
        assert_eq!(size_for(CACHED_MAX + 1), CACHED_MAX + PAGE);
        assert_eq!(class_of(PAGE), Some(0));
        assert_eq!(class_of(CACHED_MAX), Some(CLASSES - 1));
        assert_eq!(class_of(CACHED_MAX + PAGE), None);
    }

    #[test]
    fn small_buffers_are_reused_and_large_ones_freed() {
        let budget = &Arc::new(BufferBudget::new(64 << 20));
        let first = budget.take(4096).as_ptr();
        assert_eq!(budget.allocated(), 4096, "the small buffer stays pooled");
        assert_eq!(budget.take(2048).as_ptr(), first, "and is reused");
        drop(budget.take(8 << 20));
        assert_eq!(
            budget.allocated(),
            4096,
            "the large one went back to the kernel"
        );
    }

    #[test]
    fn takers_wait_for_room_and_pooled_buffers_make_way() {
        let budget = &Arc::new(BufferBudget::new(8 << 20));
        drop((budget.take(4 << 20), budget.take(2 << 20)));
        assert_eq!(budget.allocated(), 6 << 20, "both pooled");
        let all = budget.take(8 << 20);
        assert_eq!(budget.allocated(), 8 << 20, "the pool made way");
        drop(all);
        assert_eq!(budget.allocated(), 0);
        let held = budget.take(4 << 20);
        let why = "8 MiB must wait while 4 MiB are lent";
        waits_for_the_return_of(budget, held, 8 << 20, why);
    }

    #[test]
    fn a_request_larger_than_the_budget_is_served_alone() {
        let budget = &Arc::new(BufferBudget::new(1 << 20));
        let small = budget.take(4096);
        let why = "2 MiB must wait for the 4 KiB lent";
        waits_for_the_return_of(budget, small, 2 << 20, why);
    }

    #[test]
    fn later_small_requests_queue_behind_a_waiting_large_one() {
        let budget = &Arc::new(BufferBudget::new(8 << 20));
        let held = budget.take(6 << 20);
        std::thread::scope(|scope| {
            let (tx, rx) = mpsc::channel();
            let big_tx = tx.clone();
            scope.spawn(move || {
                let _b = budget.take(4 << 20);
                big_tx.send("big").unwrap();
            });
            std::thread::sleep(Duration::from_millis(100));
            scope.spawn(move || {
                let _s = budget.take(4096);
                tx.send("small").unwrap();
            });
            // The small one would fit beside what is held, but its turn comes after the big one.
            assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());
            drop(held);
            let mut served = [rx.recv_timeout(Duration::from_secs(5)).unwrap(), ""];
            served[1] = rx.recv_timeout(Duration::from_secs(5)).unwrap();
            served.sort();
            assert_eq!(served, ["big", "small"]);
        });
    }
}
