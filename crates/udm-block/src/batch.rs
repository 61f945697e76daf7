//! An executor's batch: what a transfer may put off until the executor has started every
//! request of one wake-up, so that a remote client sends all the requests it was given then
//! in one write per connection instead of one each (one system call, and one wake-up of the
//! server, rather than a dozen).
//!
//! The executor opens a batch on its thread ([`Batch::open`]) around the work of one
//! wake-up; a transfer that would rather send later asks for it with [`at_batch_end`], which
//! runs its work at once when the thread has no batch open (every executor that does not
//! batch, and every other thread). The batch runs what was put off when it is dropped, in
//! the order it was put off, also when the executor unwinds from a panic: a transfer whose
//! send never happened would wait for ever.

use std::cell::RefCell;
use std::marker::PhantomData;

type Deferred = Box<dyn FnOnce()>;

thread_local! {
    /// `Some` while a batch is open on this thread.
    static OPEN: RefCell<Option<Vec<Deferred>>> = const { RefCell::new(None) };
}

/// An open batch on this thread (not `Send`: it belongs to the thread that opened it).
pub struct Batch {
    /// Whether this guard opened the batch: one opened inside another leaves it to the outer.
    outer: bool,
    _thread: PhantomData<*const ()>,
}

impl Batch {
    pub fn open() -> Batch {
        let outer = OPEN.with_borrow_mut(|open| {
            let outer = open.is_none();
            open.get_or_insert_with(Vec::new);
            outer
        });
        Batch {
            outer,
            _thread: PhantomData,
        }
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        if !self.outer {
            return;
        }
        // Closed before running: what they put off in turn runs at once.
        let deferred = OPEN.with_borrow_mut(Option::take).unwrap_or_default();
        for work in deferred {
            work();
        }
    }
}

/// Runs `work` when this thread's open batch ends, or now when none is open.
pub fn at_batch_end(work: impl FnOnce() + 'static) {
    let work: Deferred = Box::new(work);
    let now = OPEN.with_borrow_mut(|open| match open {
        Some(deferred) => {
            deferred.push(work);
            None
        }
        None => Some(work),
    });
    if let Some(work) = now {
        work()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::rc::Rc;

    type Log = Rc<RefCell<Vec<u32>>>;

    /// A log, and work that adds a number to it.
    fn recorder() -> (Log, impl Fn(u32) -> Box<dyn FnOnce()>) {
        let log = Rc::new(RefCell::new(Vec::new()));
        let at = log.clone();
        (log, move |n| {
            let at = at.clone();
            Box::new(move || at.borrow_mut().push(n))
        })
    }

    #[test]
    fn without_a_batch_work_runs_at_once() {
        let (log, push) = recorder();
        at_batch_end(push(1));
        assert_eq!(*log.borrow(), [1]);
    }

    #[test]
    fn work_waits_for_the_end_of_the_batch_and_runs_in_order() {
        let (log, push) = recorder();
        let batch = Batch::open();
        at_batch_end(push(1));
        at_batch_end(push(2));
        assert!(log.borrow().is_empty());
        drop(batch);
        assert_eq!(*log.borrow(), [1, 2]);
        // The batch is closed: the next runs at once.
        at_batch_end(push(3));
        assert_eq!(*log.borrow(), [1, 2, 3]);
    }

    #[test]
    fn an_inner_batch_leaves_the_work_to_the_outer() {
        let (log, push) = recorder();
        let outer = Batch::open();
        let inner = Batch::open();
        at_batch_end(push(1));
        drop(inner);
        assert!(log.borrow().is_empty());
        drop(outer);
        assert_eq!(*log.borrow(), [1]);
    }

    #[test]
    fn work_put_off_while_the_batch_ends_runs_at_once() {
        let (log, push) = recorder();
        let batch = Batch::open();
        let again = push(2);
        let first = push(1);
        at_batch_end(move || {
            first();
            at_batch_end(again);
        });
        drop(batch);
        assert_eq!(*log.borrow(), [1, 2]);
    }

    #[test]
    fn a_panic_in_the_batch_still_runs_its_work() {
        let (log, push) = recorder();
        let work = push(1);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _batch = Batch::open();
            at_batch_end(work);
            panic!("the executor failed");
        }));
        assert!(result.is_err());
        assert_eq!(*log.borrow(), [1]);
    }

    #[test]
    fn a_batch_belongs_to_its_thread() {
        let (log, push) = recorder();
        let _batch = Batch::open();
        std::thread::spawn(|| {
            let ran = Rc::new(RefCell::new(false));
            let flag = ran.clone();
            at_batch_end(move || *flag.borrow_mut() = true);
            assert!(*ran.borrow());
        })
        .join()
        .unwrap();
        at_batch_end(push(1));
        assert!(log.borrow().is_empty());
    }
}
