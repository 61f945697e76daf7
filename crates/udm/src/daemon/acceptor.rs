//! The daemon's socket servers (control, replication) accept alike: one thread accepting,
//! a thread of its own for each connection, up to a limit.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use log::warn;

/// Runs `accept` on a thread named `NAME-accept`, and `serve` on each connection it returns,
/// on a thread named `NAME`, with at most `limit` connections served at once: past it, a
/// connection is handed to `refuse` (which answers it, saying why) and closed. Without the
/// limit every idle connection held a thread, and a peer of the replication port could make
/// the daemon spawn threads until none could be made for its devices' work. A failed accept
/// is logged and the next one tried.
pub fn spawn<S: Send + 'static>(
    name: &str,
    limit: usize,
    mut accept: impl FnMut() -> std::io::Result<S> + Send + 'static,
    serve: impl Fn(S) + Send + Sync + 'static,
    refuse: impl Fn(S) + Send + 'static,
) -> std::io::Result<()> {
    let serve = Arc::new(serve);
    let serving = Arc::new(AtomicUsize::new(0));
    let name = name.to_string();
    std::thread::Builder::new()
        .name(format!("{name}-accept"))
        .spawn(move || {
            // One warning per crowd, not one per refused connection.
            let mut warned = false;
            loop {
                let connection = match accept() {
                    Ok(connection) => connection,
                    Err(e) => {
                        warn!("{name}: accept failed: {e}");
                        continue;
                    }
                };
                if serving.load(Ordering::Acquire) >= limit {
                    if !warned {
                        warn!("{name}: {limit} connections open, the most served at once: refusing more");
                        warned = true;
                    }
                    refuse(connection);
                    continue;
                }
                warned = false;
                serving.fetch_add(1, Ordering::AcqRel);
                let (serve, serving) = (serve.clone(), serving.clone());
                let spawned = std::thread::Builder::new().name(name.clone()).spawn(move || {
                    serve(connection);
                    serving.fetch_sub(1, Ordering::AcqRel);
                });
                if let Err(e) = spawned {
                    // The connection went down with the closure; its count with it.
                    warn!("{name}: cannot start a thread for a connection: {e}");
                }
            }
        })?;
    Ok(())
}
