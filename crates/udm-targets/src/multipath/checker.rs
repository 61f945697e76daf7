//! The path checker, multipathd's job done in the daemon: every `checker_interval` it reads a
//! little from each failed path (multipathd's `directio` checker: one aligned block at the
//! start) and reinstates the paths that answer. For a remote path the read is also the
//! connection check: its client redials on its own (with backoff up to 5 s) and fails
//! requests at once while it has no connection, and one whose server stopped answering
//! fails after `path_timeout`, so a probe never waits longer than that.

use std::io;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use log::debug;
use udm_block::{AlignedBuf, BlockDevice};

use super::Inner;

/// Bytes a probe reads: a page, which O_DIRECT accepts anywhere.
const PROBE: u64 = 4096;

pub(super) fn start(inner: &Arc<Inner>) -> io::Result<JoinHandle<()>> {
    let inner = inner.clone();
    std::thread::Builder::new()
        .name("multipath-check".into())
        .spawn(move || run(&inner))
}

fn run(inner: &Inner) {
    let interval = inner.spec.features.checker_interval();
    loop {
        let failed = {
            let mut state = inner.state.lock();
            let next = Instant::now() + interval;
            while !state.stopping && Instant::now() < next {
                inner.changed.wait_until(&mut state, next);
            }
            if state.stopping {
                return;
            }
            state.failed_paths()
        };
        for index in failed {
            if inner.state.lock().stopping {
                return;
            }
            let path = &inner.paths[index];
            match probe(&*path.dev, inner.len) {
                Ok(()) => inner.reinstate_path(index, "the path checker's read succeeded"),
                Err(e) => debug!("multipath: path {} still fails: {e}", path.reference),
            }
        }
    }
}

fn probe(dev: &dyn BlockDevice, len: u64) -> udm_block::Result<()> {
    let mut buf = AlignedBuf::zeroed(PROBE.min(len) as usize);
    dev.read(0, &mut buf)
}
