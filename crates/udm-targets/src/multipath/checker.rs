//! The path checker, multipathd's job done in the daemon: every `checker_interval` it reads a
//! little from every path (multipathd's `directio` checker: one aligned block at the start),
//! many paths at once, fails the active paths that do not answer (before a request finds them
//! dead) and reinstates the failed ones that do. For a remote path the read is also the
//! connection check: its client redials on its own (with backoff up to 5 s) and fails
//! requests at once while it has no connection, and one whose server stopped answering
//! fails after `path_timeout`, so a probe never waits longer than that. A failed path that
//! answers with other data at its start than a usable path this round leads to another
//! device, and stays failed (see `identity`).

use std::io;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use std::sync::atomic::Ordering;

use log::{debug, warn};

use super::identity::{mismatch, read_head, seen};
use super::io::each_at_once;
use super::Inner;

pub(super) fn start(inner: &Arc<Inner>) -> io::Result<JoinHandle<()>> {
    let inner = inner.clone();
    std::thread::Builder::new()
        .name("multipath-check".into())
        .spawn(move || run(&inner))
}

fn run(inner: &Inner) {
    let interval = inner.spec.features.checker_interval();
    let every: Vec<usize> = (0..inner.paths.len()).collect();
    loop {
        let before: Vec<bool> = {
            let mut state = inner.state.lock();
            let next = Instant::now() + interval;
            while !state.stopping && Instant::now() < next {
                inner.changed.wait_until(&mut state, next);
            }
            if state.stopping {
                return;
            }
            every.iter().map(|&i| state.is_usable(i)).collect()
        };
        // A suspended path (a udm device being reloaded) would hold its probe until the
        // resume, and the table's removal with it: it is probed at the next round.
        let awake: Vec<usize> = every
            .iter()
            .copied()
            .filter(|&i| !inner.paths[i].dev.suspended())
            .collect();
        let probed = each_at_once("multipath-probe", &awake, |index| {
            read_head(&*inner.paths[index].dev, inner.len)
        });
        if inner.state.lock().stopping {
            return;
        }
        // What a usable path read this round: a failed path that answers must have read the
        // same to come back (see `identity`).
        let known = probed
            .iter()
            .find_map(|(i, head)| Some((*i, head.as_ref().ok()?)))
            .filter(|(i, _)| before[*i] && !inner.spec.features.no_path_identity_check);
        for (index, result) in &probed {
            let index = *index;
            // A path whose state changed while it was probed (I/O failed it, a message
            // reinstated it) keeps its new state: the probe may have seen it before.
            let usable = inner.state.lock().is_usable(index);
            if usable != before[index] {
                continue;
            }
            let path = &inner.paths[index];
            match (result, usable) {
                (Ok(head), false) => {
                    let elsewhere = known.and_then(|(k, known_head)| {
                        mismatch(&seen(path, head), &seen(&inner.paths[k], known_head))
                    });
                    match elsewhere {
                        // Said once, not at every round it stays so.
                        Some(why) => {
                            if !path.elsewhere.swap(true, Ordering::Relaxed) {
                                warn!("multipath: not reinstating: {why}");
                            }
                        }
                        None => {
                            path.elsewhere.store(false, Ordering::Relaxed);
                            inner.reinstate_path(index, "the path checker's read succeeded")
                        }
                    }
                }
                (Err(e), true) => {
                    inner.fail_path(index, &format!("the path checker's read failed: {e}"))
                }
                (Err(e), false) => debug!("multipath: path {} still fails: {e}", path.reference),
                (Ok(_), true) => {}
            }
        }
    }
}
