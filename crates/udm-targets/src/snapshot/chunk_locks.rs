//! Per-chunk locks of one snapshot.
//!
//! Whoever creates an exception for a chunk (an origin write copying it out, a write to the
//! snapshot) or merges it back holds the chunk exclusively; whoever relies on the chunk
//! staying as it is while it reads or writes elsewhere (a snapshot read from the origin, a
//! write into a chunk a merge has yet to copy) holds it shared. Requests to different chunks
//! never wait for each other. A waiting exclusive holder keeps new shared ones out, so a
//! stream of reads cannot starve an origin write.
//!
//! The copier ([`super::copier`]) holds no thread while it waits for a chunk: it queues a
//! callback ([`ChunkLocks::exclusive_then`]), which the last holder's release hands the chunk
//! to, ahead of threads waiting for it.

use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

const SHARDS: usize = 64;

/// Given the chunk once it is free (see [`ChunkLocks::exclusive_then`]).
pub type Granted = Box<dyn FnOnce(ChunkGuard) + Send>;

#[derive(Default)]
struct Entry {
    shared: u32,
    exclusive: bool,
    /// Exclusive holders waiting, threads and callbacks alike.
    exclusive_waiting: u32,
    /// Threads waiting on the condition variable.
    waiting: u32,
    /// Callbacks waiting, first come first served.
    queued: VecDeque<Granted>,
}

impl Entry {
    fn is_free(&self) -> bool {
        !self.exclusive && self.shared == 0
    }

    /// A shared holder may come in: nobody holds the chunk exclusively or waits to.
    fn admits_shared(&self) -> bool {
        !self.exclusive && self.exclusive_waiting == 0
    }
}

#[derive(Default)]
struct Shard {
    chunks: Mutex<HashMap<u64, Entry>>,
    released: Condvar,
}

pub struct ChunkLocks {
    shards: Vec<Shard>,
}

impl Default for ChunkLocks {
    fn default() -> Self {
        ChunkLocks {
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
        }
    }
}

/// A chunk held shared or exclusively until dropped. Owns a reference to its locks, so a
/// mapped request can carry it until its I/O completes.
pub struct ChunkGuard {
    locks: Arc<ChunkLocks>,
    chunk: u64,
    exclusive: bool,
}

impl ChunkLocks {
    fn shard(&self, chunk: u64) -> &Shard {
        &self.shards[chunk as usize % SHARDS]
    }

    /// Holds `chunk` exclusively, waiting until no one else holds it.
    pub fn exclusive(self: &Arc<Self>, chunk: u64) -> ChunkGuard {
        self.wait_for(chunk, true)
    }

    /// Holds `chunk` shared, waiting while anyone holds it exclusively or waits to.
    pub fn shared(self: &Arc<Self>, chunk: u64) -> ChunkGuard {
        self.wait_for(chunk, false)
    }

    /// Waits on the shard's condition variable until `chunk` can be held as asked. From the
    /// first time it has to wait, the thread counts among the waiters, and an exclusive one
    /// also among those that keep new shared holders out.
    fn wait_for(self: &Arc<Self>, chunk: u64, exclusive: bool) -> ChunkGuard {
        let shard = self.shard(chunk);
        let mut chunks = shard.chunks.lock();
        let mut queued = false;
        loop {
            let entry = chunks.entry(chunk).or_default();
            let free = if exclusive {
                entry.is_free()
            } else {
                entry.admits_shared()
            };
            if free {
                if exclusive {
                    entry.exclusive = true;
                } else {
                    entry.shared += 1;
                }
                if queued {
                    entry.waiting -= 1;
                    entry.exclusive_waiting -= u32::from(exclusive);
                }
                break;
            }
            if !queued {
                entry.waiting += 1;
                entry.exclusive_waiting += u32::from(exclusive);
                queued = true;
            }
            shard.released.wait(&mut chunks);
        }
        self.guard(chunk, exclusive)
    }

    /// Holds `chunk` exclusively if that needs no waiting.
    pub fn try_exclusive(self: &Arc<Self>, chunk: u64) -> Option<ChunkGuard> {
        let mut chunks = self.shard(chunk).chunks.lock();
        let entry = chunks.entry(chunk).or_default();
        if !entry.is_free() || !entry.queued.is_empty() {
            return None;
        }
        entry.exclusive = true;
        drop(chunks);
        Some(self.guard(chunk, true))
    }

    /// Holds `chunk` exclusively without a thread waiting for it: `granted` gets it at once
    /// (on this thread) when it is free, else from the release that frees it, on that thread
    /// (so it must be quick).
    pub fn exclusive_then(self: &Arc<Self>, chunk: u64, granted: Granted) {
        let mut chunks = self.shard(chunk).chunks.lock();
        let entry = chunks.entry(chunk).or_default();
        if entry.is_free() && entry.queued.is_empty() {
            entry.exclusive = true;
            drop(chunks);
            return granted(self.guard(chunk, true));
        }
        entry.exclusive_waiting += 1;
        entry.queued.push_back(granted);
    }

    /// Holds `chunk` shared if that needs no waiting (for the non-blocking mapped path).
    pub fn try_shared(self: &Arc<Self>, chunk: u64) -> Option<ChunkGuard> {
        let mut chunks = self.shard(chunk).chunks.lock();
        let entry = chunks.entry(chunk).or_default();
        if !entry.admits_shared() {
            return None;
        }
        entry.shared += 1;
        drop(chunks);
        Some(self.guard(chunk, false))
    }

    fn guard(self: &Arc<Self>, chunk: u64, exclusive: bool) -> ChunkGuard {
        ChunkGuard {
            locks: self.clone(),
            chunk,
            exclusive,
        }
    }

    /// Chunks held or waited for right now.
    #[cfg(test)]
    fn busy(&self) -> usize {
        self.shards.iter().map(|s| s.chunks.lock().len()).sum()
    }
}

impl Drop for ChunkGuard {
    fn drop(&mut self) {
        let shard = self.locks.shard(self.chunk);
        let mut chunks = shard.chunks.lock();
        let entry = chunks
            .get_mut(&self.chunk)
            .expect("a held chunk has an entry");
        if self.exclusive {
            entry.exclusive = false;
        } else {
            entry.shared -= 1;
        }
        if entry.is_free() {
            if let Some(next) = entry.queued.pop_front() {
                entry.exclusive = true;
                entry.exclusive_waiting -= 1;
                drop(chunks);
                return next(self.locks.guard(self.chunk, true));
            }
        }
        if entry.waiting > 0 {
            shard.released.notify_all();
        } else if entry.is_free() {
            chunks.remove(&self.chunk);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn exclusive_waits_for_shared_and_keeps_new_shared_out() {
        let locks = Arc::new(ChunkLocks::default());
        let reader = locks.shared(5);
        assert!(locks.try_shared(5).is_some(), "shared holders share");
        std::thread::scope(|s| {
            let writer = s.spawn(|| {
                let t = Instant::now();
                let _held = locks.exclusive(5);
                t.elapsed()
            });
            std::thread::sleep(Duration::from_millis(30));
            assert!(
                locks.try_shared(5).is_none(),
                "a waiting writer keeps new readers out"
            );
            assert!(locks.try_shared(6).is_some(), "other chunks are free");
            drop(reader);
            assert!(writer.join().unwrap() >= Duration::from_millis(25));
        });
        assert_eq!(locks.busy(), 0, "idle chunks leave nothing behind");
    }

    #[test]
    fn a_queued_callback_gets_the_chunk_from_the_release_ahead_of_new_holders() {
        let locks = Arc::new(ChunkLocks::default());
        let reader = locks.shared(3);
        let (tx, rx) = std::sync::mpsc::channel();
        let sent = tx.clone();
        locks.exclusive_then(3, Box::new(move |guard| sent.send(guard).unwrap()));
        assert!(rx.try_recv().is_err(), "a shared holder keeps it");
        assert!(locks.try_shared(3).is_none() && locks.try_exclusive(3).is_none());
        locks.exclusive_then(3, Box::new(move |guard| tx.send(guard).unwrap()));
        drop(reader);
        let first = rx.try_recv().expect("handed over by the release");
        assert!(rx.try_recv().is_err(), "one holder at a time");
        drop(first);
        let second = rx.try_recv().expect("the next in line");
        assert!(locks.try_exclusive(3).is_none());
        drop(second);
        let free = locks.try_exclusive(3).expect("free again");
        drop(free);
        assert_eq!(locks.busy(), 0, "idle chunks leave nothing behind");
    }

    #[test]
    fn a_thread_waiting_for_a_chunk_gets_it_after_the_queued_callbacks() {
        let locks = Arc::new(ChunkLocks::default());
        let held = locks.exclusive(8);
        std::thread::scope(|s| {
            let waiter = s.spawn(|| drop(locks.exclusive(8)));
            std::thread::sleep(Duration::from_millis(20));
            let (tx, rx) = std::sync::mpsc::channel();
            locks.exclusive_then(8, Box::new(move |guard| tx.send(guard).unwrap()));
            drop(held);
            let guard = rx.recv().unwrap();
            std::thread::sleep(Duration::from_millis(20));
            assert!(!waiter.is_finished(), "the callback holds it");
            drop(guard);
            waiter.join().unwrap();
        });
        assert_eq!(locks.busy(), 0);
    }

    #[test]
    fn different_chunks_never_wait() {
        let locks = Arc::new(ChunkLocks::default());
        let held: Vec<_> = (0..200).map(|c| locks.exclusive(c)).collect();
        let t = Instant::now();
        let _other = locks.exclusive(1000);
        assert!(t.elapsed() < Duration::from_millis(10));
        drop(held);
    }
}
