//! `multipath <#features> <feature>… <#hw handler args> <#priority groups> <initial group>
//! (<selector> <#selector args> <#paths> <#path args> (<path> <path arg>…)…)…`
//!
//! Several paths to one device, as the kernel's dm-multipath: requests go down one path of
//! the current priority group, chosen by the group's selector; a request that fails on a path
//! fails that path (an event) and is sent down another, so a client sees no error while one
//! path lives. With no usable path a request waits if queueing (`queue_if_no_path`, bounded by
//! `no_path_retry` checker intervals), and fails with EIO otherwise. A path is any device
//! reference; a remote one is opened to fail fast (its connection breaking fails its requests
//! at once, a server that stops answering fails them after `path_timeout`) instead of waiting
//! for its server like a clone's source does.
//!
//! udm adds multipathd's path checker: a thread that reads a little from every path each
//! `checker_interval`, fails the active paths that do not answer and reinstates the failed
//! ones that do; and multipathd's `failback immediate` as a feature.
//!
//! A FLUSH goes to every path that took writes since the last one, failed paths too: a path's
//! device may report writes its server acknowledged and lost (`BlockError::WritesLost`), and
//! the flush then fails, never retried elsewhere. A path whose flush fails for the path's
//! sake is covered by a flush down a usable path, on the kernel's assumption that all paths
//! lead to one device (see docs/targets.md).
//!
//! One file per job: `args` reads and prints the table line, `selector` chooses among a
//! group's paths (`history` measures them for historical-service-time), `paths` holds the paths' and groups' state and picks the group, `io` serves
//! requests, `checker` probes failed paths, `messages` and `status` are what the target is
//! told and tells. This file holds the target and its life: built inactive, the checker
//! started at the first resume and stopped when the table is dropped.

mod args;
mod checker;
mod history;
mod identity;
mod io;
mod messages;
mod paths;
mod selector;
mod status;

use parking_lot::{Condvar, Mutex};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread::JoinHandle;

use log::{info, warn};
use udm_block::{BlockDevice, Capabilities, MapOp, OpenMode, SECTOR_SIZE};

use crate::args::Args;
use crate::target::{EventSink, Target, TargetContext, TargetError};
use args::Spec;
use paths::{Group, Path, State, Suspending};
use selector::Load;

/// What requests, messages and the checker share.
struct Inner {
    spec: Spec,
    paths: Vec<Path>,
    groups: Vec<Group>,
    state: Mutex<State>,
    /// Signalled when a path comes back, queueing changes, or the target suspends or stops:
    /// wakes requests waiting for a path, and the checker.
    changed: Condvar,
    len: u64,
    capabilities: Capabilities,
    /// Every path answers `map()` (files, devices over files): requests are remapped onto the
    /// chosen path. Otherwise none is, so that a request is never given a path twice.
    maps: bool,
    raise_event: EventSink,
}

/// The `multipath` target.
pub struct Multipath {
    inner: Arc<Inner>,
    /// The path checker, from the first resume on.
    checker: Mutex<Option<JoinHandle<()>>>,
}

pub fn construct(args: &mut Args, ctx: &TargetContext) -> Result<Arc<dyn Target>, TargetError> {
    let spec = args::parse(args)?;
    let timeout = spec.features.path_timeout();
    let mut paths: Vec<Path> = Vec::new();
    for (g, path) in spec.paths() {
        let group = &spec.groups[g];
        let reference = &path.reference;
        if paths.iter().any(|p| &p.reference == reference) {
            return Err(args.error(format!("path '{reference}' is listed twice")));
        }
        let dev = ctx
            .resolver
            .open_path(reference, OpenMode::ReadWrite, timeout)
            .map_err(|e| args.error(format!("cannot open path '{reference}': {e}")))?;
        ctx.require(reference, &*dev, 0, ctx.len)
            .map_err(|e| args.error(e))?;
        paths.push(Path {
            reference: reference.clone(),
            dev,
            args: path.args,
            load: Arc::new(Load::new(group.selector, group.paths.len())),
            dirty: AtomicBool::new(false),
            elsewhere: AtomicBool::new(false),
        });
    }
    let mut groups = Vec::with_capacity(spec.groups.len());
    let mut first = 0;
    for group in &spec.groups {
        let end = first + group.paths.len();
        groups.push(Group {
            selector: group.selector,
            paths: first..end,
        });
        first = end;
    }
    // A device brought back after a restart was accepted before; its paths are checked
    // again as they are reinstated.
    if !spec.features.no_path_identity_check && !ctx.restoring {
        identity::check_paths(&paths, ctx.len).map_err(|e| args.error(e))?;
    }
    let capabilities = Capabilities::weakest(paths.iter().map(|p| p.dev.capabilities()));
    let maps = !paths.is_empty()
        && paths
            .iter()
            .all(|p| p.dev.map(MapOp::Read, 0, SECTOR_SIZE).is_some());
    let state = State::new(
        paths.len(),
        groups.len(),
        spec.initial_group,
        spec.features.queue_if_no_path,
    );
    let inner = Arc::new(Inner {
        spec,
        paths,
        groups,
        state: Mutex::new(state),
        changed: Condvar::new(),
        len: ctx.len,
        capabilities,
        maps,
        raise_event: ctx.raise_event.clone(),
    });
    Ok(Arc::new(Multipath {
        inner,
        checker: Mutex::new(None),
    }))
}

impl Inner {
    /// Takes a path out of use (an event), unless it already was.
    fn fail_path(&self, path: usize, why: &str) {
        let (failed, none_left) = {
            let mut state = self.state.lock();
            (state.fail(path), !state.has_usable_path())
        };
        if !failed {
            return;
        }
        let reference = &self.paths[path].reference;
        warn!("multipath: failing path {reference}: {why}");
        if none_left {
            warn!("multipath: no usable path left");
        }
        (self.raise_event)();
    }

    /// Puts a path back in use (an event) and wakes requests waiting for one; with
    /// `failback immediate`, I/O goes back to the first group that can take it.
    fn reinstate_path(&self, path: usize, why: &str) {
        let failed_back = {
            let mut state = self.state.lock();
            if !state.reinstate(path) {
                return;
            }
            self.spec.features.failback_immediate() && state.fail_back(&self.groups)
        };
        info!(
            "multipath: reinstating path {}: {why}",
            self.paths[path].reference
        );
        if failed_back {
            info!("multipath: failing back to the first group with a usable path");
        }
        self.changed.notify_all();
        (self.raise_event)();
    }

    /// Why `path` must not be reinstated: it leads to another device than a usable path,
    /// read now (see `identity`). Nothing to compare with while no other path is usable.
    fn identity_mismatch(&self, path: usize) -> Option<String> {
        if self.spec.features.no_path_identity_check {
            return None;
        }
        let known = {
            let state = self.state.lock();
            (0..self.paths.len()).find(|&i| i != path && state.is_usable(i))?
        };
        let (path, known) = (&self.paths[path], &self.paths[known]);
        let head = identity::read_head(&*path.dev, self.len).ok()?;
        let known_head = identity::read_head(&*known.dev, self.len).ok()?;
        identity::mismatch(
            &identity::seen(path, &head),
            &identity::seen(known, &known_head),
        )
    }

    /// The path a message names.
    fn path_named(&self, reference: &str) -> Result<usize, TargetError> {
        self.paths
            .iter()
            .position(|p| p.reference == reference)
            .ok_or_else(|| {
                let known: Vec<&str> = self.paths.iter().map(|p| p.reference.as_str()).collect();
                TargetError::new(format!(
                    "multipath: no path '{reference}' (paths: {})",
                    known.join(", ")
                ))
            })
    }
}

impl Target for Multipath {
    fn type_name(&self) -> &'static str {
        "multipath"
    }

    fn args(&self) -> String {
        self.table_args()
    }

    fn status(&self) -> String {
        self.status_line()
    }

    fn status_details(&self) -> Option<serde_json::Value> {
        Some(self.details())
    }

    fn message(&self, words: &[&str]) -> Result<String, TargetError> {
        self.handle_message(words)
    }

    /// Queueing is the one setting messages change that a reload keeps (failed paths are
    /// found again by the checker, as multipathd finds them after a reload).
    fn settings_messages(&self) -> Vec<String> {
        let queue = self.inner.state.lock().queue_if_no_path;
        vec![if queue {
            "queue_if_no_path"
        } else {
            "fail_if_no_path"
        }
        .to_string()]
    }

    fn references(&self) -> Vec<String> {
        self.inner
            .paths
            .iter()
            .map(|p| p.reference.clone())
            .collect()
    }

    /// Requests waiting for a path fail now, and new ones do not wait, until the resume: a
    /// suspend waits for the requests in flight, and a path may never come back.
    fn presuspend(&self, noflush: bool) {
        self.inner.state.lock().suspending = if noflush {
            Suspending::PushingWaitersBack
        } else {
            Suspending::FailingWaiters
        };
        self.inner.changed.notify_all();
    }

    fn resume(&self) {
        self.inner.state.lock().suspending = Suspending::No;
        let mut checker = self.checker.lock();
        if checker.is_none() {
            match checker::start(&self.inner) {
                Ok(thread) => *checker = Some(thread),
                Err(e) => warn!("multipath: cannot start the path checker: {e}"),
            }
        }
    }
}

impl Drop for Multipath {
    fn drop(&mut self) {
        self.inner.state.lock().stopping = true;
        self.inner.changed.notify_all();
        // A probe waiting on a remote path must not hold up the table's end: the paths are
        // this table's own handles.
        for path in &self.inner.paths {
            path.dev.close();
        }
        if let Some(thread) = self.checker.lock().take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests;
