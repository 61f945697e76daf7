//! A bound on the requests of one kind a ring keeps at the disk, the rest waiting in order.
//!
//! A ring owner (a FUSE queue's thread) can put every request it holds on
//! the disk at once. Where the disk answers more depth with more latency rather than more
//! throughput (a virtual disk's random reads: see bench/README.md, "the FUSE path"), the
//! requests beyond what the disk rewards gain nothing by waiting there instead of here, and
//! each one in flight at the disk lengthens every other's wait. The owner admits a request
//! before starting it and releases it when it completes; what is not admitted waits, first
//! come first started.

use std::collections::VecDeque;

/// Up to `limit` admitted at once (no bound when `None`); the others wait in order.
pub struct InFlightLimit<T> {
    limit: Option<usize>,
    running: usize,
    waiting: VecDeque<T>,
}

impl<T> InFlightLimit<T> {
    /// `limit` 0 means no bound.
    pub fn new(limit: usize) -> Self {
        InFlightLimit {
            limit: (limit > 0).then_some(limit),
            running: 0,
            waiting: VecDeque::new(),
        }
    }

    /// `item` back to start now (it counts as running until [`InFlightLimit::release`]), or
    /// None: it waits, and comes back from a later `release`.
    pub fn admit(&mut self, item: T) -> Option<T> {
        match self.limit {
            Some(limit) if self.running >= limit => {
                self.waiting.push_back(item);
                None
            }
            _ => {
                self.running += 1;
                Some(item)
            }
        }
    }

    /// One admitted item is done; the longest waiting one, if any, to start now (it counts as
    /// running in its place).
    pub fn release(&mut self) -> Option<T> {
        self.running = self.running.saturating_sub(1);
        let next = self.waiting.pop_front()?;
        self.running += 1;
        Some(next)
    }

    /// Items admitted and not released.
    pub fn running(&self) -> usize {
        self.running
    }

    /// Items waiting to be admitted.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_up_to_the_limit_and_starts_the_waiting_in_order() {
        let mut limit = InFlightLimit::new(2);
        assert_eq!(limit.admit(1), Some(1));
        assert_eq!(limit.admit(2), Some(2));
        assert_eq!(limit.admit(3), None);
        assert_eq!(limit.admit(4), None);
        assert_eq!((limit.running(), limit.waiting()), (2, 2));
        assert_eq!(limit.release(), Some(3));
        assert_eq!(limit.release(), Some(4));
        assert_eq!(limit.release(), None);
        assert_eq!((limit.running(), limit.waiting()), (1, 0));
        assert_eq!(limit.admit(5), Some(5));
        assert_eq!(limit.admit(6), None);
    }

    #[test]
    fn zero_is_no_limit() {
        let mut limit = InFlightLimit::new(0);
        assert!((0..1000).all(|i| limit.admit(i) == Some(i)));
        assert_eq!(limit.waiting(), 0);
    }
}
