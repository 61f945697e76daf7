//! Steps a mapped request waits for without a thread waiting with it: dm's "take the bio and
//! complete it later", for the remapped path.
//!
//! A device whose request must wait for something before its pieces may run (a `delay`'s
//! timer, a `snapshot-origin` write whose chunk is being copied into a snapshot) returns a
//! [`Mapping`] with a [`Pending`] step in it instead of `None`. Whoever executes the mapping
//! calls [`Mapping::when_ready`], which starts the steps and hands the mapping back, on
//! whichever thread finished the last step, once every step is done; the executor then submits
//! the pieces from its own thread. Nothing waits in between: a step finishes by calling its
//! [`Done`] from a timer, a commit, a worker.
//!
//! A step is started by the executor, never by the device that made it, so a mapping dropped
//! unused (`udm info`'s probe, an executor that cannot wait and takes the synchronous path)
//! sets nothing in motion.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{BlockError, Result};
use crate::map::{Completed, Mapping};

/// Finishes one started step; call it once, from any thread. Dropped without being called,
/// the step fails (a worker that went away must not leave its request waiting for ever).
pub struct Done(Option<Box<dyn FnOnce(Result<()>) + Send>>);

impl Done {
    pub fn new(f: impl FnOnce(Result<()>) + Send + 'static) -> Self {
        Done(Some(Box::new(f)))
    }

    pub fn finish(mut self, result: Result<()>) {
        if let Some(f) = self.0.take() {
            f(result)
        }
    }
}

impl Drop for Done {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f(Err(BlockError::Io(
                "a step the request waited for was abandoned".into(),
            )))
        }
    }
}

/// A step a mapped request waits for before its pieces run, not started yet.
pub struct Pending(Box<dyn FnOnce(Done) + Send>);

impl Pending {
    /// A step that `start` begins; it calls the [`Done`] it is given when the step is over.
    pub fn new(start: impl FnOnce(Done) + Send + 'static) -> Self {
        Pending(Box::new(start))
    }

    pub fn start(self, done: Done) {
        (self.0)(done)
    }
}

/// The mapping and its executor's callback while its steps run.
struct Join<F> {
    left: AtomicUsize,
    state: Mutex<Joining<F>>,
}

struct Joining<F> {
    /// Taken by the last step to finish.
    waiting: Option<(Mapping, F)>,
    /// The first step that failed.
    error: Option<BlockError>,
}

impl Mapping {
    /// Adds a step the pieces wait for (see [`crate::pending`]).
    pub fn after(mut self, step: Pending) -> Self {
        self.waits.push(step);
        self
    }

    /// True when nothing is left to wait for: the pieces may be submitted now. An executor
    /// that cannot wait must not submit a mapping that is not ready (it drops it and takes
    /// the synchronous path).
    pub fn is_ready(&self) -> bool {
        self.waits.is_empty()
    }

    /// Starts every step and calls `f` with the mapping, ready, once all are done: at once
    /// (on this thread) if there are none, else on the thread that finished the last one. If
    /// a step failed, the request failed: its completion callbacks are told so, its holds are
    /// let go, and `f` gets the first error.
    pub fn when_ready(mut self, f: impl FnOnce(Result<Mapping>) + Send + 'static) {
        let steps = std::mem::take(&mut self.waits);
        if steps.is_empty() {
            return f(Ok(self));
        }
        let join = Arc::new(Join {
            left: AtomicUsize::new(steps.len()),
            state: Mutex::new(Joining {
                waiting: Some((self, f)),
                error: None,
            }),
        });
        for step in steps {
            let join = join.clone();
            step.start(Done::new(move |result| {
                if let Err(e) = result {
                    join.state.lock().error.get_or_insert(e);
                }
                if join.left.fetch_sub(1, Ordering::AcqRel) != 1 {
                    return;
                }
                let (waiting, error) = {
                    let mut state = join.state.lock();
                    (state.waiting.take(), state.error.take())
                };
                let (mut mapping, f) = waiting.expect("the last step finishes once");
                match error {
                    None => f(Ok(mapping)),
                    Some(e) => {
                        for callback in mapping.on_complete.drain(..) {
                            callback(Completed::Failed(&e));
                        }
                        drop(mapping);
                        f(Err(e))
                    }
                }
            }));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::map::Place;
    use std::sync::mpsc;

    /// A step finished by the test, from another thread.
    fn manual() -> (Pending, mpsc::Receiver<Done>) {
        let (tx, rx) = mpsc::channel();
        (Pending::new(move |done| tx.send(done).unwrap()), rx)
    }

    #[test]
    fn a_ready_mapping_is_handed_back_at_once() {
        let (tx, rx) = mpsc::channel();
        Mapping::single(512, Place::Zero).when_ready(move |m| tx.send(m.is_ok()).unwrap());
        assert_eq!(rx.try_recv(), Ok(true));
    }

    #[test]
    fn the_mapping_waits_for_every_step_then_comes_back_without_them() {
        let (a, started_a) = manual();
        let (b, started_b) = manual();
        let mapping = Mapping::single(512, Place::Zero).after(a).after(b);
        assert!(!mapping.is_ready());
        let (tx, rx) = mpsc::channel();
        mapping.when_ready(move |m| tx.send(m.map(|m| m.is_ready())).unwrap());
        let a = started_a.try_recv().expect("steps start at when_ready");
        let b = started_b.try_recv().unwrap();
        b.finish(Ok(()));
        assert!(rx.try_recv().is_err(), "one step is still running");
        std::thread::spawn(move || a.finish(Ok(()))).join().unwrap();
        assert!(rx.try_recv().unwrap().unwrap());
    }

    #[test]
    fn a_failed_step_fails_the_request_and_tells_its_callbacks() {
        let told = Arc::new(Mutex::new(Vec::new()));
        let (a, started) = manual();
        let record = told.clone();
        let mapping = Mapping::single(512, Place::Zero)
            .hold(Arc::clone(&told))
            .when_complete(move |done| record.lock().push(matches!(done, Completed::Ok)))
            .after(a);
        let (tx, rx) = mpsc::channel();
        mapping.when_ready(move |m| tx.send(m.err()).unwrap());
        started
            .recv()
            .unwrap()
            .finish(Err(BlockError::Io("copy failed".into())));
        assert!(matches!(rx.recv().unwrap(), Some(BlockError::Io(_))));
        assert_eq!(*told.lock(), [false]);
        assert_eq!(Arc::strong_count(&told), 1, "the holds are let go");
    }

    #[test]
    fn an_abandoned_step_fails_rather_than_waits_for_ever() {
        let (a, started) = manual();
        let (tx, rx) = mpsc::channel();
        Mapping::new()
            .after(a)
            .when_ready(move |m| tx.send(m.is_err()).unwrap());
        drop(started.recv().unwrap());
        assert!(rx.recv().unwrap());
    }

    #[test]
    fn a_mapping_dropped_unused_starts_nothing() {
        let (a, started) = manual();
        drop(Mapping::new().after(a));
        assert!(started.try_recv().is_err());
    }
}
