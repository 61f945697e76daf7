//! A bounded pool of threads for blocking work that must not hold up its caller: the NBD
//! event loops' requests that do not remap (the synchronous `BlockDevice` path, off the loops
//! so a slow target never stalls a loop), a snapshot's copy-outs for mapped origin writes.
//!
//! Threads start when work arrives and no thread is free, up to the bound, and end after a
//! while without work, so an idle daemon keeps none.

use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

pub type Job = Box<dyn FnOnce() + Send>;

/// How long a thread waits for work before it ends.
const IDLE: Duration = Duration::from_secs(10);

pub struct WorkerPool {
    name: &'static str,
    max_threads: usize,
    state: Mutex<State>,
    ready: Condvar,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Job>,
    threads: usize,
    idle: usize,
}

impl WorkerPool {
    /// A pool of at most `max_threads` (at least one), named `name` (the threads' name).
    pub fn new(name: &'static str, max_threads: usize) -> Arc<WorkerPool> {
        Arc::new(WorkerPool {
            name,
            max_threads: max_threads.max(1),
            state: Mutex::new(State::default()),
            ready: Condvar::new(),
        })
    }

    pub fn submit(self: &Arc<Self>, job: Job) {
        let mut state = self.state.lock();
        state.queue.push_back(job);
        if state.idle >= state.queue.len() || state.threads >= self.max_threads {
            drop(state);
            self.ready.notify_one();
            return;
        }
        state.threads += 1;
        drop(state);
        let pool = self.clone();
        let started = std::thread::Builder::new()
            .name(self.name.into())
            .spawn(move || pool.work());
        if let Err(e) = started {
            // The queued job waits for a running thread; with none, the next submit tries again.
            log::warn!("{}: cannot start a pool thread: {e}", self.name);
            self.state.lock().threads -= 1;
        }
    }

    fn work(&self) {
        let mut state = self.state.lock();
        loop {
            let Some(job) = state.queue.pop_front() else {
                state.idle += 1;
                let waited = self.ready.wait_for(&mut state, IDLE);
                state.idle -= 1;
                if waited.timed_out() && state.queue.is_empty() {
                    state.threads -= 1;
                    return;
                }
                continue;
            };
            drop(state);
            // Jobs catch their requests' panics themselves (an error reply); this one only
            // keeps the thread alive through a bug outside them.
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                log::warn!("{}: a pool job panicked", self.name);
            }
            state = self.state.lock();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn runs_jobs_on_at_most_its_bound_of_threads() {
        let pool = WorkerPool::new("test-pool", 2);
        let (tx, rx) = mpsc::channel();
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        for i in 0..5 {
            let (tx, gate) = (tx.clone(), gate.clone());
            pool.submit(Box::new(move || {
                let mut open = gate.0.lock();
                while !*open {
                    gate.1.wait(&mut open);
                }
                tx.send(i).unwrap();
            }));
        }
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(pool.state.lock().threads, 2);
        *gate.0.lock() = true;
        gate.1.notify_all();
        let mut done: Vec<i32> = (0..5).map(|_| rx.recv_timeout(IDLE).unwrap()).collect();
        done.sort();
        assert_eq!(done, vec![0, 1, 2, 3, 4]);
    }
}
