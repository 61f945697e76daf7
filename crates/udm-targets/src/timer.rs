//! One process-wide timer thread: steps of mapped requests that only wait for a moment to
//! pass (a `delay`), finished when it comes, so that no thread sleeps per request.

use parking_lot::{Condvar, Mutex};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use udm_block::{Done, Pending};

struct Entry {
    at: Instant,
    /// Arrival order, so that equal deadlines fire first come first served.
    seq: u64,
    done: Done,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Entry {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

#[derive(Default)]
struct Timer {
    due: Mutex<(BinaryHeap<Reverse<Entry>>, u64)>,
    changed: Condvar,
}

fn timer() -> &'static Timer {
    static TIMER: OnceLock<&'static Timer> = OnceLock::new();
    TIMER.get_or_init(|| {
        let timer: &'static Timer = Box::leak(Box::default());
        std::thread::Builder::new()
            .name("udm-timer".into())
            .spawn(move || timer.run())
            .expect("spawn the timer thread");
        timer
    })
}

impl Timer {
    fn run(&self) {
        let mut due = self.due.lock();
        loop {
            let now = Instant::now();
            let mut fired = Vec::new();
            while due.0.peek().is_some_and(|Reverse(e)| e.at <= now) {
                fired.push(due.0.pop().expect("peeked").0.done);
            }
            if !fired.is_empty() {
                drop(due);
                for done in fired {
                    done.finish(Ok(()));
                }
                due = self.due.lock();
                continue;
            }
            match due.0.peek().map(|Reverse(e)| e.at) {
                Some(at) => {
                    self.changed.wait_until(&mut due, at);
                }
                None => self.changed.wait(&mut due),
            }
        }
    }

    fn add(&self, at: Instant, done: Done) {
        let mut due = self.due.lock();
        due.1 += 1;
        let seq = due.1;
        let earliest = due.0.peek().is_none_or(|Reverse(e)| at < e.at);
        due.0.push(Reverse(Entry { at, seq, done }));
        if earliest {
            self.changed.notify_one();
        }
    }
}

/// A step that is done `wait` after it starts; `then` runs when it is, on the timer thread
/// (it must be quick).
pub fn after(wait: Duration, then: impl FnOnce() + Send + 'static) -> Pending {
    Pending::new(move |done| {
        let at = Instant::now() + wait;
        timer().add(
            at,
            Done::new(move |result| {
                then();
                done.finish(result)
            }),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn steps_finish_in_deadline_order_no_sooner_than_asked() {
        let (tx, rx) = mpsc::channel();
        let t = Instant::now();
        for ms in [40u64, 10, 25] {
            let tx = tx.clone();
            after(Duration::from_millis(ms), || {}).start(Done::new(move |r| {
                tx.send((ms, t.elapsed(), r.is_ok())).unwrap()
            }));
        }
        let fired: Vec<_> = (0..3).map(|_| rx.recv().unwrap()).collect();
        assert_eq!(fired.iter().map(|f| f.0).collect::<Vec<_>>(), [10, 25, 40]);
        for (ms, took, ok) in fired {
            assert!(
                ok && took >= Duration::from_millis(ms),
                "{ms} ms took {took:?}"
            );
        }
    }
}
