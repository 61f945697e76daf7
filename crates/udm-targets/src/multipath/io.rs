//! Serving requests: each goes down a path the selectors choose; one that fails there for a
//! reason that is the path's fails the path and goes down another; with no usable path it
//! waits or fails as queueing says. A FLUSH reaches every path that took writes since the last
//! one. Requests are remapped onto the chosen path when every path is a file (see
//! [`Inner::maps`](super::Inner)).

use std::sync::atomic::Ordering;

use udm_block::{
    BlockDevice, BlockError, Capabilities, Completed, Extent, MapOp, Mapping, Result, WriteFlags,
    ZeroFlags,
};

use super::paths::{NoPath, State};
use super::selector::Busy;
use super::{Inner, Multipath};

/// Whether an error is the path's fault, and the request worth sending down another: not
/// when any path would give it (a request the device refuses, no space, read-only), as the
/// kernel's `noretry_error`; nor when the path reports writes it acknowledged and lost
/// ([`BlockError::may_retry`]), which another path's success would hide.
fn fails_path(e: &BlockError) -> bool {
    e.may_retry()
        && !matches!(
            e.errno(),
            libc::EOPNOTSUPP
                | libc::EINVAL
                | libc::ENOSPC
                | libc::EDQUOT
                | libc::EFBIG
                | libc::EPERM
                | libc::EROFS
        )
}

impl Inner {
    /// A usable path for a request of `bytes`, counted in its load. With none, waits for one
    /// while queueing allows, then fails with EIO.
    fn path_for(&self, bytes: u64) -> Result<(usize, Busy)> {
        let features = &self.spec.features;
        let mut state = self.state.lock();
        loop {
            if let Some(path) = state.choose(&self.paths, &self.groups, bytes) {
                return Ok((path, self.paths[path].load.start(bytes)));
            }
            let until =
                match state.when_no_path(features.no_path_retry, features.checker_interval()) {
                    NoPath::Fail => {
                        return Err(BlockError::Io("multipath: no usable path".into()));
                    }
                    NoPath::PushBack => {
                        return Err(BlockError::Requeue(
                            "multipath: no usable path while suspending with noflush".into(),
                        ));
                    }
                    NoPath::Wait(until) => until,
                };
            state.waiting += 1;
            match until {
                Some(until) => {
                    self.changed.wait_until(&mut state, until);
                }
                None => self.changed.wait(&mut state),
            }
            state.waiting -= 1;
        }
    }

    /// Runs `op` down a path, and down another each time it fails there for the path's
    /// sake. A path that completes a write owes the next flush.
    fn on_path<T>(
        &self,
        writes: bool,
        bytes: u64,
        mut op: impl FnMut(&dyn BlockDevice) -> Result<T>,
    ) -> Result<T> {
        loop {
            let (index, busy) = self.path_for(bytes)?;
            let path = &self.paths[index];
            let result = op(&*path.dev);
            drop(busy);
            match result {
                Ok(value) => {
                    if writes {
                        path.dirty.store(true, Ordering::Release);
                    }
                    return Ok(value);
                }
                Err(e) if fails_path(&e) => self.fail_path(index, &e.to_string()),
                Err(e) => return Err(e),
            }
        }
    }

    /// Flushes every path that took writes since the last flush, all at once (each flush is
    /// a round trip to its path's server, or a sync of its file), failed paths too: a failed
    /// path's device may know that its server lost writes it acknowledged (a remote client
    /// whose connection died with writes no flush covered), and its flush then fails with
    /// [`BlockError::WritesLost`], which this reports as it is. A path whose flush fails
    /// for the path's sake (it failed before or during its flush), or that is suspended (its
    /// flush would wait for the resume), is covered by a flush down a usable path: all paths
    /// lead to one device. Paths still owed a flush when this fails stay owed.
    fn flush_paths(&self) -> Result<()> {
        let owed: Vec<usize> = (0..self.paths.len())
            .filter(|&i| self.paths[i].dirty.swap(false, Ordering::AcqRel))
            .collect();
        let owe_again = |paths: &[usize]| {
            for &i in paths {
                self.paths[i].dirty.store(true, Ordering::Release);
            }
        };
        let usable: Vec<bool> = {
            let state = self.state.lock();
            (0..self.paths.len()).map(|i| state.is_usable(i)).collect()
        };
        // Asked outside the state's lock: the answer is another device's.
        let (flushed, mut stranded): (Vec<usize>, Vec<usize>) = owed
            .iter()
            .partition(|&&i| usable[i] || !self.paths[i].dev.suspended());
        let mut error = None;
        for (i, result) in each_at_once("multipath-flush", &flushed, |i| {
            let path = &self.paths[i];
            let _busy = path.load.start(0);
            path.dev.flush()
        }) {
            match result {
                Ok(()) => {}
                Err(e) if fails_path(&e) => {
                    self.fail_path(i, &e.to_string());
                    stranded.push(i);
                }
                Err(e) => {
                    owe_again(&[i]);
                    error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = error {
            owe_again(&stranded);
            return Err(e);
        }
        if stranded.is_empty() {
            return Ok(());
        }
        let result = self.on_path(false, 0, |dev| dev.flush());
        if result.is_err() {
            owe_again(&stranded);
        }
        result
    }

    /// Whether a failed path took writes since the last flush.
    fn failed_path_owed(&self, state: &State) -> bool {
        (0..self.paths.len())
            .any(|i| !state.is_usable(i) && self.paths[i].dirty.load(Ordering::Acquire))
    }
}

/// How many paths [`each_at_once`] works on at a time: a table may have a thousand.
const AT_ONCE: usize = 32;

/// `op` for each of `items`, [`AT_ONCE`] at a time: the first of each batch on this thread,
/// the others on threads of their own, named `name` (on this thread too, after the first,
/// when no thread can be made).
pub(super) fn each_at_once<T: Send>(
    name: &str,
    items: &[usize],
    op: impl Fn(usize) -> T + Sync,
) -> Vec<(usize, T)> {
    items
        .chunks(AT_ONCE)
        .flat_map(|batch| batch_at_once(name, batch, &op))
        .collect()
}

fn batch_at_once<T: Send>(
    name: &str,
    items: &[usize],
    op: &(impl Fn(usize) -> T + Sync),
) -> Vec<(usize, T)> {
    let Some((&first, rest)) = items.split_first() else {
        return Vec::new();
    };
    std::thread::scope(|scope| {
        let others: Vec<_> = rest
            .iter()
            .map(|&i| {
                let thread = std::thread::Builder::new()
                    .name(name.into())
                    .spawn_scoped(scope, move || op(i));
                (i, thread)
            })
            .collect();
        let mut results = vec![(first, op(first))];
        for (i, thread) in others {
            let result = match thread {
                Ok(thread) => thread
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
                Err(_) => op(i),
            };
            results.push((i, result));
        }
        results
    })
}

impl BlockDevice for Multipath {
    fn size(&self) -> u64 {
        self.inner.len
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let len = buf.len() as u64;
        self.inner.on_path(false, len, |dev| dev.read(offset, buf))
    }

    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> Result<()> {
        let len = buf.len() as u64;
        self.inner
            .on_path(true, len, |dev| dev.write(offset, buf, flags))
    }

    fn flush(&self) -> Result<()> {
        self.inner.flush_paths()
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.inner
            .on_path(true, len, |dev| dev.discard(offset, len))
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.inner
            .on_path(true, len, |dev| dev.write_zeroes(offset, len, flags))
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.inner
            .on_path(false, 0, |dev| dev.block_status(offset, len))
    }

    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.on_path(false, 0, |dev| dev.cache(offset, len))
    }

    /// Onto the chosen path, which must not block: with no usable path (a request that may
    /// have to wait) the request goes the synchronous way. A mapped request that fails fails
    /// its path (when the error is the path's) and comes back to the synchronous way, which
    /// sends it down another path or waits for one, as a request that fails there does. A
    /// FLUSH maps only while one path is usable: with several, the synchronous flush sends
    /// one down each path at once and fails exactly those whose flush fails (a mapped
    /// request's failure does not say which of its files failed); and only while no failed
    /// path is owed one, which the synchronous flush sends it (it may report writes lost).
    fn map(&self, op: MapOp, offset: u64, len: u64) -> Option<Mapping> {
        // Discards and write-zeroes mean something of their own here: the synchronous way.
        if op.is_fill() {
            return None;
        }
        if !self.inner.maps {
            return None;
        }
        let inner = self.inner.clone();
        let (index, busy) = {
            let mut state = inner.state.lock();
            if op == MapOp::Flush && (state.usable_count() != 1 || inner.failed_path_owed(&state)) {
                return None;
            }
            let index = state.choose(&inner.paths, &inner.groups, len)?;
            (index, inner.paths[index].load.start(len))
        };
        let path = &inner.paths[index];
        let mapping = path.dev.map(op, offset, len)?;
        if op.is_write() {
            path.dirty.store(true, Ordering::Release);
        }
        Some(
            mapping
                .hold(busy)
                .when_complete(move |done| match done {
                    Completed::Failed(e) | Completed::Retried(e) if fails_path(e) => {
                        inner.fail_path(index, &e.to_string())
                    }
                    _ => {}
                })
                .retried_on_error(),
        )
    }
}
