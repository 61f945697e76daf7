//! A ring with a thread of its own, for I/O that targets issue themselves rather than on a
//! client's behalf: a snapshot's copy-out reads the origin and writes the COW device, as the
//! kernel's kcopyd does for dm. The engine runs on an event loop's ring for clients' requests;
//! a target has no loop, so it hands its mapped requests to a [`Runner`], whose one thread
//! submits them and calls back with how each went. No thread waits per request: a request
//! whose mapping has steps (a `delay`'s timer) is posted once they are done.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use io_uring::{squeue, IoUring};
use log::error;
use parking_lot::Mutex;
use udm_block::{AlignedBuf, BlockError, MapOp, Mapping};

use crate::{is_engine, Engine, Outcome};

/// Entries in the ring; a request has one per piece, and more wait in the runner's queue.
const ENTRIES: u32 = 256;
/// The `user_data` of the mailbox's eventfd read (engine entries have the top bit set).
const WAKE: u64 = 1;

/// Told how a request went, with its buffer back (read into, for a read): on the runner's
/// thread, so it must be quick (map the next request, post it, take a lock briefly).
pub type Then = Box<dyn FnOnce(Outcome, AlignedBuf) + Send>;

struct Job {
    op: MapOp,
    mapping: Mapping,
    buf: AlignedBuf,
    then: Then,
}

struct Mailbox {
    jobs: Mutex<Vec<Job>>,
    wake: OwnedFd,
}

impl Mailbox {
    fn post(&self, job: Job) {
        let mut jobs = self.jobs.lock();
        jobs.push(job);
        // Whoever found the mailbox empty has woken the thread, which has not taken the jobs
        // yet: this one goes with them, without a wake (a syscall) of its own.
        if jobs.len() > 1 {
            return;
        }
        drop(jobs);
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a u64 to our eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }
}

/// Hands mapped requests to a thread that runs them on its own ring (see the module).
#[derive(Clone)]
pub struct Runner {
    mailbox: Arc<Mailbox>,
}

impl Runner {
    /// Starts the thread, named `name`; fails when io_uring or an eventfd cannot be had. The
    /// thread lives as long as the process (runners are process-wide, like the timer).
    /// `workers` bounds the kernel's io-wq workers, which run what cannot complete without
    /// blocking (FUA writes, syncs): that many such requests run at once. The kernel's default
    /// (4 per CPU) made FUA writes to a COW file the bound of a snapshot's copy-outs.
    pub fn start(name: &str, workers: u32) -> std::io::Result<Runner> {
        let ring = IoUring::new(ENTRIES)?;
        // Bounded (file I/O) and unbounded workers alike.
        let mut max = [workers, workers];
        if let Err(e) = ring.submitter().register_iowq_max_workers(&mut max) {
            log::warn!("{name}: cannot set its io_uring workers to {workers}: {e}");
        }
        // SAFETY: eventfd returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mailbox = Arc::new(Mailbox {
            jobs: Mutex::default(),
            // SAFETY: a descriptor we just made and own.
            wake: unsafe { OwnedFd::from_raw_fd(fd) },
        });
        let theirs = mailbox.clone();
        // The engine holds raw buffer pointers (not Send): it is made on its thread.
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                Thread {
                    ring,
                    engine: Engine::new(),
                    mailbox: theirs,
                    wake_value: Box::new(0),
                    running: Vec::new(),
                    free: Vec::new(),
                    queued: Vec::new(),
                }
                .run()
            })?;
        Ok(Runner { mailbox })
    }

    /// Runs `mapping`, a mapping of `op` over `buf` (as long as the mapping), once its steps
    /// are done; `then` is told how it went and given `buf` back. A step that failed is the
    /// request's failure (`then` runs on the thread that finished it, as the mapping's
    /// callbacks were told).
    pub fn run(&self, op: MapOp, mapping: Mapping, buf: AlignedBuf, then: Then) {
        let mailbox = self.mailbox.clone();
        mapping.when_ready(move |ready| match ready {
            Ok(mapping) => mailbox.post(Job {
                op,
                mapping,
                buf,
                then,
            }),
            Err(e) => then(Outcome::Done(Err(e)), buf),
        })
    }
}

struct Thread {
    ring: IoUring,
    engine: Engine,
    mailbox: Arc<Mailbox>,
    wake_value: Box<u64>,
    /// What each request started on the engine needs back: its buffer and its callback.
    running: Vec<Option<(AlignedBuf, Then)>>,
    free: Vec<usize>,
    /// Entries waiting for room in the submission queue.
    queued: Vec<squeue::Entry>,
}

impl Thread {
    fn run(mut self) {
        self.arm_wake();
        loop {
            self.submit_queued();
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EBUSY)) => {}
                Err(e) => {
                    error!("io_uring runner cannot wait on its ring: {e}");
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
            }
            let done: Vec<_> = self
                .ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (user_data, result) in done {
                if user_data == WAKE {
                    self.arm_wake();
                    let jobs = std::mem::take(&mut *self.mailbox.jobs.lock());
                    jobs.into_iter().for_each(|job| self.start(job));
                } else if is_engine(user_data) {
                    let queued = &mut self.queued;
                    let finished = self
                        .engine
                        .complete(user_data, result, &mut |e| queued.push(e));
                    if let Some((owner, outcome)) = finished {
                        let (buf, then) = self.running[owner as usize].take().expect("running");
                        self.free.push(owner as usize);
                        tell(then, outcome, buf);
                    }
                }
            }
        }
    }

    fn start(&mut self, job: Job) {
        let Job {
            op,
            mapping,
            mut buf,
            then,
        } = job;
        if op != MapOp::Flush && !op.is_fill() && (buf.len() as u64) < mapping.len() {
            let e = BlockError::Io("a copy's buffer is shorter than its mapping".into());
            return tell(then, Outcome::Done(Err(e)), buf);
        }
        let ptr = buf.as_mut_ptr();
        let slot = self.free.pop().unwrap_or_else(|| {
            self.running.push(None);
            self.running.len() - 1
        });
        let queued = &mut self.queued;
        // SAFETY: the buffer is as long as the mapping and stays in `running` (its heap
        // allocation does not move) until the engine says the request is complete.
        let at_once = unsafe {
            self.engine
                .start(op, mapping, ptr, slot as u64, &mut |e| queued.push(e))
        };
        match at_once {
            Some(result) => {
                self.free.push(slot);
                tell(then, Outcome::Done(result), buf)
            }
            None => self.running[slot] = Some((buf, then)),
        }
    }

    fn arm_wake(&mut self) {
        let wake = crate::eventfd_read(&self.mailbox.wake, &mut self.wake_value, WAKE);
        self.queued.push(wake);
    }

    /// Moves queued entries into the submission queue, submitting whenever it is full.
    fn submit_queued(&mut self) {
        let mut done = 0;
        while done < self.queued.len() {
            // SAFETY: every entry's buffer is held in `running` (or is the wake value) until
            // its completion is handled.
            done += unsafe { crate::push_some(&mut self.ring, &self.queued[done..]) };
            if done < self.queued.len() {
                if let Err(e) = self.ring.submit() {
                    if !matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EINTR)) {
                        error!("io_uring runner cannot submit: {e}");
                    }
                    // The completion queue is full: the loop reaps it after its wait.
                    break;
                }
            }
        }
        self.queued.drain(..done);
    }
}

/// Calls a request's callback; one that panics must not end the thread every other request
/// relies on.
fn tell(then: Then, outcome: Outcome, buf: AlignedBuf) {
    if let Err(panic) = catch_unwind(AssertUnwindSafe(|| then(outcome, buf))) {
        let why = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        error!("io_uring runner: a request's callback panicked: {why}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;
    use std::sync::mpsc;
    use std::time::{Duration, Instant};
    use udm_block::{Done, MappedFile, Pending, Place};

    fn file(tag: &str) -> (std::path::PathBuf, Arc<MappedFile>) {
        let path = std::env::temp_dir().join(format!("udm-runner-{tag}-{}", std::process::id()));
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(1 << 20).unwrap();
        f.write_all_at(&[7u8; 8192], 4096).unwrap();
        let open = || {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .unwrap()
        };
        let mapped = MappedFile::new(path.clone(), None, open());
        (path, Arc::new(mapped))
    }

    fn at(file: &Arc<MappedFile>, offset: u64, len: u64) -> Mapping {
        Mapping::single(
            len,
            Place::File {
                file: file.clone(),
                offset,
            },
        )
    }

    #[test]
    fn runs_requests_after_their_steps_and_hands_the_buffer_back() {
        let runner = Runner::start("test-runner", 4).unwrap();
        let (path, f) = file("steps");
        let (tx, rx) = mpsc::channel();
        let started = Instant::now();
        // A read waiting 30 ms for a step another thread finishes, as a delay's timer does.
        let step = Pending::new(|done: Done| {
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(30));
                done.finish(Ok(()))
            });
        });
        let tx2 = tx.clone();
        runner.run(
            MapOp::Read,
            at(&f, 4096, 4096).after(step),
            AlignedBuf::zeroed(4096),
            Box::new(move |outcome, buf| tx2.send((outcome, buf[0], started.elapsed())).unwrap()),
        );
        let mut data = AlignedBuf::zeroed(4096);
        data.fill(9);
        runner.run(
            MapOp::Write { fua: true },
            at(&f, 0, 4096),
            data,
            Box::new(move |outcome, buf| tx.send((outcome, buf[0], started.elapsed())).unwrap()),
        );
        let (write, byte, _) = rx.recv().unwrap();
        assert!(
            matches!(write, Outcome::Done(Ok(()))) && byte == 9,
            "{write:?}"
        );
        let (read, byte, took) = rx.recv().unwrap();
        assert!(
            matches!(read, Outcome::Done(Ok(()))) && byte == 7,
            "{read:?}"
        );
        assert!(
            took >= Duration::from_millis(30),
            "the read waited for its step"
        );
        let mut back = [0u8; 4096];
        std::fs::File::open(&path)
            .unwrap()
            .read_exact_at(&mut back, 0)
            .unwrap();
        assert_eq!(back, [9u8; 4096]);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn failures_and_failed_steps_reach_the_callback_and_a_panic_does_not_stop_the_thread() {
        let runner = Runner::start("test-runner", 4).unwrap();
        let (path, f) = file("fail");
        let (tx, rx) = mpsc::channel();
        // Reads `mapping` into a buffer of `len` bytes; the outcome comes back on `rx`.
        let read = |mapping: Mapping, len: usize| {
            let told = tx.clone();
            let tell: Then = Box::new(move |outcome, _| told.send(outcome).unwrap());
            runner.run(MapOp::Read, mapping, AlignedBuf::zeroed(len), tell);
        };
        let step = Pending::new(|done: Done| done.finish(Err(BlockError::Io("no".into()))));
        read(at(&f, 0, 4096).after(step), 4096);
        assert!(matches!(rx.recv().unwrap(), Outcome::Done(Err(_))));
        runner.run(
            MapOp::Read,
            at(&f, 0, 4096),
            AlignedBuf::zeroed(4096),
            Box::new(|_, _| panic!("a callback's bug")),
        );
        // A buffer shorter than the mapping is refused, not read past.
        read(at(&f, 0, 8192), 4096);
        assert!(matches!(rx.recv().unwrap(), Outcome::Done(Err(_))));
        read(at(&f, 0, 4096), 4096);
        assert!(matches!(rx.recv().unwrap(), Outcome::Done(Ok(()))));
        std::fs::remove_file(path).unwrap();
    }
}
