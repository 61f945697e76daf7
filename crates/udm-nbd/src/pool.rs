//! The bounded pool of threads that run the requests the event loops cannot remap (a partial
//! clone write, delay, flakey, log-writes, a remote source, discards, block status): the
//! synchronous `BlockDevice` path, off the loops so a slow target never stalls a loop.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};

use log::warn;

pub(crate) type Job = Box<dyn FnOnce() + Send>;

pub(crate) struct Pool {
    queue: Mutex<VecDeque<Job>>,
    ready: Condvar,
}

impl Pool {
    /// Starts `threads` workers (at least one). They live as long as the process.
    pub fn start(threads: usize) -> std::io::Result<Arc<Pool>> {
        let pool = Arc::new(Pool {
            queue: Mutex::new(VecDeque::new()),
            ready: Condvar::new(),
        });
        for i in 0..threads.max(1) {
            let pool = pool.clone();
            std::thread::Builder::new()
                .name(format!("nbd-pool-{i}"))
                .spawn(move || pool.work())?;
        }
        Ok(pool)
    }

    pub fn submit(&self, job: Job) {
        self.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(job);
        self.ready.notify_one();
    }

    fn work(&self) {
        loop {
            let job = {
                let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    match queue.pop_front() {
                        Some(job) => break job,
                        None => queue = self.ready.wait(queue).unwrap_or_else(|e| e.into_inner()),
                    }
                }
            };
            // Jobs catch their requests' panics themselves (an error reply); this one only
            // keeps the worker alive through a bug outside them.
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                warn!("nbd: a pool job panicked");
            }
        }
    }
}
