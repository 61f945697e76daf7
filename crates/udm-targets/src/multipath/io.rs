//! Serving requests: each goes down a path the selectors choose; one that fails there for a
//! reason that is the path's fails the path and goes down another; with no usable path it
//! waits or fails as queueing says. A FLUSH reaches every path that took writes since the last
//! one. Requests are remapped onto the chosen path when every path is a file (see
//! [`Inner::maps`](super::Inner)).

use std::sync::atomic::Ordering;

use udm_block::{
    BlockDevice, BlockError, Capabilities, Extent, MapOp, Mapping, Result, WriteFlags, ZeroFlags,
};

use super::paths::NoPath;
use super::selector::Busy;
use super::{Inner, Multipath};

/// Whether an error is the path's fault, and the request worth sending down another: not
/// when any path would give it (a request the device refuses, no space, read-only), as the
/// kernel's `noretry_error`.
fn fails_path(e: &BlockError) -> bool {
    !matches!(
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

    /// Flushes every path that took writes since the last flush. One that has failed (before
    /// or during its flush) is covered by a flush down a usable path: all paths lead to one
    /// device. Paths still owed a flush when this fails stay owed.
    fn flush_paths(&self) -> Result<()> {
        let owed: Vec<usize> = (0..self.paths.len())
            .filter(|&i| self.paths[i].dirty.swap(false, Ordering::AcqRel))
            .collect();
        let owe_again = |paths: &[usize]| {
            for &i in paths {
                self.paths[i].dirty.store(true, Ordering::Release);
            }
        };
        let mut stranded = Vec::new();
        for (k, &i) in owed.iter().enumerate() {
            let path = &self.paths[i];
            if self.state.lock().is_usable(i) {
                let _busy = path.load.start(0);
                match path.dev.flush() {
                    Ok(()) => continue,
                    Err(e) if fails_path(&e) => self.fail_path(i, &e.to_string()),
                    Err(e) => {
                        owe_again(&owed[k..]);
                        owe_again(&stranded);
                        return Err(e);
                    }
                }
            }
            stranded.push(i);
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
    /// have to wait) the request goes the synchronous way. A FLUSH maps onto every usable
    /// path. An error of a mapped request is not retried on another path: files are trusted
    /// as `linear` trusts them, and fail by message.
    fn map(&self, op: MapOp, offset: u64, len: u64) -> Option<Mapping> {
        // Discards and write-zeroes mean something of their own here: the synchronous way.
        if op.is_fill() {
            return None;
        }
        let inner = &self.inner;
        if !inner.maps {
            return None;
        }
        if op == MapOp::Flush {
            let usable: Vec<usize> = {
                let state = inner.state.lock();
                (0..inner.paths.len())
                    .filter(|&i| state.is_usable(i))
                    .collect()
            };
            if usable.is_empty() {
                return None;
            }
            let mut mapping = Mapping::new();
            for i in usable {
                mapping.append(0, inner.paths[i].dev.map(op, 0, 0)?);
            }
            return Some(mapping);
        }
        let (index, busy) = {
            let mut state = inner.state.lock();
            let index = state.choose(&inner.paths, &inner.groups, len)?;
            (index, inner.paths[index].load.start(len))
        };
        let path = &inner.paths[index];
        let mapping = path.dev.map(op, offset, len)?;
        if op.is_write() {
            path.dirty.store(true, Ordering::Release);
        }
        Some(mapping.hold(busy))
    }
}
