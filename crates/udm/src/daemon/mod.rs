//! `udm daemon`: holds the devices, serves them, answers the control socket.

mod control;
mod device;
mod listener;
mod registry;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use log::{info, warn};
use udm_block::{Export, ExportCatalog};
use udm_fuse::{FuseConfig, FuseExport};
use udm_nbd::{NbdServer, ServerConfig, TlsServer};

pub use listener::{Address, Listener};
pub use registry::Registry;

pub struct DaemonOptions {
    pub state_dir: PathBuf,
    pub control: PathBuf,
    pub nbd: Vec<Listener>,
    /// Offered (or required) on every TCP listener; Unix sockets are guarded by their
    /// filesystem permissions instead.
    pub tls: Option<TlsServer>,
    pub fuse: Option<PathBuf>,
    pub nbd_threads: usize,
    pub fuse_threads: usize,
    pub remote_timeout: std::time::Duration,
}

/// Every device, served by name.
struct Catalog(Arc<Registry>);

impl ExportCatalog for Catalog {
    fn open(&self, name: &str) -> Option<Export> {
        let device = self.0.get(name).ok()?;
        Some(Export {
            read_only: device.read_only(),
            description: format!("udm device {name}"),
            open_guard: Box::new(device.open()),
            device,
        })
    }

    fn list(&self) -> Vec<(String, String)> {
        self.0
            .all()
            .iter()
            .map(|d| (d.name().to_string(), format!("udm device {}", d.name())))
            .collect()
    }
}

/// Blocks SIGTERM and SIGINT in every thread, so that the main thread alone collects them
/// with sigwait and shuts down in order.
fn block_shutdown_signals() -> libc::sigset_t {
    // SAFETY: plain signal-mask calls on a set we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

pub fn run(options: DaemonOptions) -> anyhow::Result<()> {
    if options.fuse.is_some() {
        // Serving a mounted filesystem's backing store: memory reclaim must not wait on us
        // (set before any thread starts, since threads inherit it).
        udm_fuse::set_io_flusher();
    }
    let signals = block_shutdown_signals();
    let registry = Arc::new(
        Registry::new(&options.state_dir, options.remote_timeout)
            .with_context(|| format!("state dir {}", options.state_dir.display()))?,
    );
    let restored = registry.restore().context("reading the state dir")?;
    info!(
        "restored {restored} device(s) from {}",
        options.state_dir.display()
    );

    let catalog: Arc<dyn ExportCatalog> = Arc::new(Catalog(registry.clone()));
    let fuse = match &options.fuse {
        Some(mountpoint) => {
            let export = FuseExport::mount(
                mountpoint,
                catalog.clone(),
                FuseConfig {
                    workers: options.fuse_threads,
                    ..FuseConfig::default()
                },
            )
            .with_context(|| format!("FUSE mount at {}", mountpoint.display()))?;
            info!(
                "fuse: every device is the file {}/NAME",
                mountpoint.display()
            );
            Some(export)
        }
        None => None,
    };
    let server = NbdServer::new(
        catalog.clone(),
        ServerConfig {
            workers_per_connection: options.nbd_threads,
            ..ServerConfig::default()
        },
    );
    for listener in &options.nbd {
        let catalog = listener.catalog(catalog.clone());
        match &listener.address {
            Address::Unix(path) => server
                .for_listener(catalog, None)
                .listen_unix(path)
                .with_context(|| format!("NBD socket {}", path.display()))?,
            Address::Tcp(addr) => {
                server
                    .for_listener(catalog, options.tls.clone())
                    .listen_tcp(addr.as_str())
                    .with_context(|| format!("NBD on tcp:{addr}"))?;
            }
        }
    }
    control::listen(&options.control, registry.clone(), options.fuse.clone())
        .with_context(|| format!("control socket {}", options.control.display()))?;
    info!("control socket {}", options.control.display());

    let mut signal = 0;
    // SAFETY: waits for one of the blocked signals.
    unsafe { libc::sigwait(&signals, &mut signal) };
    info!("signal {signal}: flushing devices and stopping");
    if let Some(fuse) = fuse {
        fuse.unmount();
    }
    registry.flush_all();
    remove_socket(&options.control);
    for listener in &options.nbd {
        if let Address::Unix(path) = &listener.address {
            remove_socket(path);
        }
    }
    Ok(())
}

fn remove_socket(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        warn!("removing {}: {e}", path.display());
    }
}
