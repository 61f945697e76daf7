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
//! A device may also take runs of the request and move them itself, not through files: a
//! [`Transfer`] (a remote export's client sends the request on its connection, and its reader
//! puts the reply into the request's buffer). The executor starts those after the steps,
//! with the request's buffer ([`Mapping::when_ready_with`]), and gets the mapping back once
//! they are done too, with only the pieces on files (if any) left to submit.
//!
//! A step or transfer is started by the executor, never by the device that made it, so a
//! mapping dropped unused (`udm info`'s probe, an executor that cannot wait and takes the
//! synchronous path) sets nothing in motion.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{BlockError, Result};
use crate::map::{Completed, Mapping};

type Finish = Box<dyn FnOnce(Result<()>, bool) + Send>;

/// Finishes one started step or transfer; call it once, from any thread. Dropped without being
/// called, it fails (a worker that went away must not leave its request waiting for ever).
pub struct Done(Option<Finish>);

impl Done {
    pub fn new(f: impl FnOnce(Result<()>) + Send + 'static) -> Self {
        Done(Some(Box::new(move |result, _retry| f(result))))
    }

    pub fn finish(mut self, result: Result<()>) {
        if let Some(f) = self.0.take() {
            f(result, false)
        }
    }

    /// Fails it, asking that the request run again the synchronous way, where it may still
    /// succeed (a remote client whose connection broke resends it there once the connection
    /// is back, waiting as its synchronous requests do): the callbacks hear
    /// [`Completed::Retried`] and the executor [`Ready::Retry`], as when the mapping asks for
    /// a retry on any error ([`Mapping::retry_on_error`]).
    pub fn retry(mut self, error: BlockError) {
        if let Some(f) = self.0.take() {
            f(Err(error), true)
        }
    }
}

impl Drop for Done {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f(
                Err(BlockError::Io(
                    "a step the request waited for was abandoned".into(),
                )),
                false,
            )
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

/// The part of a request's buffer a [`Transfer`] moves: read into, or written from (null and
/// empty for a flush, or for an executor with no buffer). Valid until the transfer's
/// [`Done`] is called, and touched by nobody else meanwhile.
pub struct TransferBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the executor lends the buffer to the transfer alone until its Done is called
// (`Mapping::when_ready_with`'s contract), whichever thread that is on.
unsafe impl Send for TransferBuf {}

impl TransferBuf {
    /// No buffer: a flush's, or one a device starts itself.
    pub fn empty() -> Self {
        TransferBuf {
            ptr: std::ptr::null_mut(),
            len: 0,
        }
    }

    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

type StartTransfer = Box<dyn FnOnce(TransferBuf, Done) + Send>;

/// A run of a request that its device moves itself (see [`crate::pending`]).
pub struct Transfer {
    at: u64,
    len: u64,
    start: StartTransfer,
}

impl Transfer {
    /// `len` bytes `at` bytes into the request (0 and 0 for a flush). `start` begins moving
    /// them between the buffer it is given and where they live, and calls the [`Done`] once
    /// they have moved (a read's bytes are in the buffer then).
    pub fn new(at: u64, len: u64, start: impl FnOnce(TransferBuf, Done) + Send + 'static) -> Self {
        Transfer {
            at,
            len,
            start: Box::new(start),
        }
    }

    /// The same run in a request that starts `by` bytes earlier (a lower device's mapping
    /// appended to an upper one's).
    pub(crate) fn shifted(self, by: u64) -> Self {
        Transfer {
            at: self.at + by,
            ..self
        }
    }
}

/// What an executor gets back from [`Mapping::when_ready_with`].
// A mapping keeps its first entries inline (see [`Mapping`]); it moves here once per
// request, and boxing it would cost the allocation those inline entries save.
#[allow(clippy::large_enum_variant)]
pub enum Ready {
    /// Every step and transfer is done: submit the pieces (there may be none).
    Go(Mapping),
    /// One failed, and so did the request: this is its outcome. The callbacks were told
    /// [`Completed::Failed`] and the holds let go.
    Failed(BlockError),
    /// One failed, and the request runs again the synchronous way, whose result is the
    /// request's (the mapping asked for it, or the transfer did: [`Done::retry`]). The
    /// callbacks were told [`Completed::Retried`] and the holds let go.
    Retry,
}

type Then = Box<dyn FnOnce(Ready) + Send>;
type Next = Box<dyn FnOnce(Mapping, Then) + Send>;

/// The mapping and what comes after while a set of steps or transfers runs.
struct Join {
    left: AtomicUsize,
    state: Mutex<Joining>,
}

struct Joining {
    /// Taken by the last one to finish.
    waiting: Option<(Mapping, Then, Next)>,
    /// The first that failed, and whether any asked for a retry.
    error: Option<BlockError>,
    retry: bool,
}

impl Mapping {
    /// Adds a step the pieces wait for (see [`crate::pending`]).
    pub fn after(mut self, step: Pending) -> Self {
        self.waits.push(step);
        self
    }

    /// Adds a run the device moves itself (see [`crate::pending`]).
    pub fn taking(mut self, transfer: Transfer) -> Self {
        self.transfers.push(transfer);
        self
    }

    /// True when nothing is left to wait for or move: the pieces may be submitted now. An
    /// executor that cannot wait must not submit a mapping that is not ready (it drops it
    /// and takes the synchronous path).
    pub fn is_ready(&self) -> bool {
        self.waits.is_empty() && self.transfers.is_empty()
    }

    /// [`Mapping::when_ready_with`] for an executor without the request's buffer at hand
    /// (a test, a probe): a mapping with transfers fails, a retry is an error.
    pub fn when_ready(self, f: impl FnOnce(Result<Mapping>) + Send + 'static) {
        let then = move |ready| {
            f(match ready {
                Ready::Go(mapping) => Ok(mapping),
                Ready::Failed(e) => Err(e),
                Ready::Retry => Err(BlockError::Io("the request is to be retried".into())),
            })
        };
        if !self.transfers.is_empty() {
            let e = BlockError::Io("a transfer was started without the request's buffer".into());
            return fail(self, e, false, Box::new(then));
        }
        // SAFETY: there are no transfers, the only users of the buffer.
        unsafe { self.when_ready_with(std::ptr::null_mut(), then) }
    }

    /// Starts every step, then every transfer (with its part of `buf`), and calls `f` once
    /// all are done: at once (on this thread) if there are none, else on the thread that
    /// finished the last one. See [`Ready`] for what a failure gives.
    ///
    /// # Safety
    /// `buf` must be valid for the request's length (transfers of a read write into it) and
    /// stay valid and untouched by the caller until `f` is called.
    pub unsafe fn when_ready_with(mut self, buf: *mut u8, f: impl FnOnce(Ready) + Send + 'static) {
        let steps: Vec<_> = std::mem::take(&mut self.waits)
            .into_iter()
            .map(|step| -> StartOne { Box::new(move |done| step.start(done)) })
            .collect();
        let transfers = std::mem::take(&mut self.transfers);
        let buf = TransferBuf { ptr: buf, len: 0 };
        let start_transfers: Next = Box::new(move |mapping, then| {
            let starts = transfers
                .into_iter()
                .map(|t| -> StartOne {
                    let base = buf.as_mut_ptr();
                    let part = TransferBuf {
                        // SAFETY: the transfer's run lies within the request's buffer.
                        ptr: if base.is_null() {
                            base
                        } else {
                            unsafe { base.add(t.at as usize) }
                        },
                        len: t.len as usize,
                    };
                    Box::new(move |done| (t.start)(part, done))
                })
                .collect();
            all_of(
                mapping,
                starts,
                then,
                Box::new(|mapping, then| then(Ready::Go(mapping))),
            )
        });
        all_of(self, steps, Box::new(f), start_transfers);
    }
}

type StartOne = Box<dyn FnOnce(Done) + Send>;

/// Starts each of `starts`; once all have finished, `next` gets the mapping and `then`, on the
/// thread that finished the last; if one failed, the request did ([`fail`]).
fn all_of(mapping: Mapping, starts: Vec<StartOne>, then: Then, next: Next) {
    if starts.is_empty() {
        return next(mapping, then);
    }
    let join = Arc::new(Join {
        left: AtomicUsize::new(starts.len()),
        state: Mutex::new(Joining {
            waiting: Some((mapping, then, next)),
            error: None,
            retry: false,
        }),
    });
    for start in starts {
        let join = join.clone();
        start(Done(Some(Box::new(move |result, retry| {
            if let Err(e) = result {
                let mut state = join.state.lock();
                state.error.get_or_insert(e);
                state.retry |= retry;
            }
            if join.left.fetch_sub(1, Ordering::AcqRel) != 1 {
                return;
            }
            let (waiting, error, retry) = {
                let mut state = join.state.lock();
                (state.waiting.take(), state.error.take(), state.retry)
            };
            let (mapping, then, next) = waiting.expect("the last one finishes once");
            match error {
                None => next(mapping, then),
                Some(e) => fail(mapping, e, retry, then),
            }
        }))));
    }
}

/// The request failed in a step or transfer: its callbacks are told, its holds let go, and
/// the executor told whether it runs again the synchronous way.
fn fail(mut mapping: Mapping, e: BlockError, retry: bool, then: Then) {
    let retry = (retry || mapping.retry_on_error) && e.may_retry();
    let told = if retry {
        Completed::Retried(&e)
    } else {
        Completed::Failed(&e)
    };
    for callback in mapping.on_complete.drain(..) {
        callback(told);
    }
    drop(mapping);
    then(if retry {
        Ready::Retry
    } else {
        Ready::Failed(e)
    })
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

    /// A transfer that fills its run of the buffer with `byte`, from another thread, and
    /// records when it started.
    fn filling(at: u64, len: u64, byte: u8, log: Arc<Mutex<Vec<&'static str>>>) -> Transfer {
        Transfer::new(at, len, move |buf, done| {
            log.lock().push("transfer");
            std::thread::spawn(move || {
                // SAFETY: the executor lends us this run of its buffer until done.
                unsafe { std::ptr::write_bytes(buf.as_mut_ptr(), byte, buf.len()) };
                done.finish(Ok(()))
            });
        })
    }

    #[test]
    fn transfers_start_after_the_steps_each_with_its_run_of_the_buffer() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let (step, started) = manual();
        let mut mapping = Mapping::new().after(step);
        mapping.append(0, Mapping::new().taking(filling(0, 512, 1, log.clone())));
        // A lower device's mapping of the second half: its run moves with it.
        mapping.append(512, Mapping::new().taking(filling(0, 512, 2, log.clone())));
        assert!(!mapping.is_ready());
        let mut buf = vec![0u8; 1024];
        let (tx, rx) = mpsc::channel();
        // SAFETY: `buf` outlives the wait below and is not touched until then.
        unsafe {
            mapping.when_ready_with(buf.as_mut_ptr(), move |ready| {
                tx.send(matches!(ready, Ready::Go(m) if m.is_ready()))
                    .unwrap()
            })
        };
        assert!(log.lock().is_empty(), "no transfer before the step is done");
        started.recv().unwrap().finish(Ok(()));
        assert!(rx.recv_timeout(std::time::Duration::from_secs(5)).unwrap());
        assert_eq!(*log.lock(), ["transfer", "transfer"]);
        assert!(buf[..512].iter().all(|&b| b == 1) && buf[512..].iter().all(|&b| b == 2));
    }

    #[test]
    fn a_transfer_that_asks_for_a_retry_gets_one_and_its_callbacks_hear_it() {
        let told = Arc::new(Mutex::new(Vec::new()));
        let record = told.clone();
        let mapping = Mapping::new()
            .hold(Arc::clone(&told))
            .when_complete(move |done| record.lock().push(matches!(done, Completed::Retried(_))))
            .taking(Transfer::new(0, 0, |_, done| {
                done.retry(BlockError::Io("connection broke".into()))
            }));
        let (tx, rx) = mpsc::channel();
        // SAFETY: a flush: no buffer is used.
        unsafe {
            mapping.when_ready_with(std::ptr::null_mut(), move |ready| {
                tx.send(matches!(ready, Ready::Retry)).unwrap()
            })
        };
        assert!(rx.recv().unwrap());
        assert_eq!(*told.lock(), [true]);
        assert_eq!(Arc::strong_count(&told), 1, "the holds are let go");
    }

    #[test]
    fn a_transfer_that_fails_fails_the_request_unless_the_mapping_asks_for_a_retry() {
        for asks in [false, true] {
            let mut mapping = Mapping::new().taking(Transfer::new(0, 0, |_, done| {
                done.finish(Err(BlockError::Io("the server failed it".into())))
            }));
            mapping.retry_on_error = asks;
            let (tx, rx) = mpsc::channel();
            // SAFETY: no buffer is used.
            unsafe {
                mapping.when_ready_with(std::ptr::null_mut(), move |ready| {
                    tx.send(match ready {
                        Ready::Go(_) => "go",
                        Ready::Failed(_) => "failed",
                        Ready::Retry => "retry",
                    })
                    .unwrap()
                })
            };
            assert_eq!(rx.recv().unwrap(), if asks { "retry" } else { "failed" });
        }
    }

    #[test]
    fn an_executor_without_the_buffer_starts_no_transfer() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        Mapping::new()
            .taking(filling(0, 512, 1, log.clone()))
            .when_ready(move |m| tx.send(m.is_err()).unwrap());
        assert_eq!(rx.try_recv(), Ok(true));
        assert!(log.lock().is_empty());
    }
}
