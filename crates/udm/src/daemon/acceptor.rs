//! The daemon's socket servers (control, replication) accept alike: one thread accepting,
//! a thread of its own for each connection.

use std::sync::Arc;

use log::warn;

/// Runs `accept` on a thread named `NAME-accept`, and `serve` on each connection it returns,
/// on a thread named `NAME`. A failed accept is logged and the next one tried.
pub fn spawn<S: Send + 'static>(
    name: &str,
    mut accept: impl FnMut() -> std::io::Result<S> + Send + 'static,
    serve: impl Fn(S) + Send + Sync + 'static,
) -> std::io::Result<()> {
    let serve = Arc::new(serve);
    let name = name.to_string();
    std::thread::Builder::new()
        .name(format!("{name}-accept"))
        .spawn(move || loop {
            match accept() {
                Ok(connection) => {
                    let serve = serve.clone();
                    let _ = std::thread::Builder::new()
                        .name(name.clone())
                        .spawn(move || serve(connection));
                }
                Err(e) => warn!("{name}: accept failed: {e}"),
            }
        })?;
    Ok(())
}
