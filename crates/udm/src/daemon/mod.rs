//! `udm daemon`: holds the devices, serves them, answers the control socket.

mod control;
mod device;
mod registry;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use log::{info, warn};
use udm_block::{Export, ExportCatalog};
use udm_fuse::{FuseConfig, FuseExport};
use udm_nbd::{NbdServer, ServerConfig};

pub use registry::Registry;

/// Where the NBD server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listener {
    Unix(PathBuf),
    Tcp(String),
}

impl std::str::FromStr for Listener {
    type Err = String;
    /// `unix:PATH`, `tcp:PORT` (loopback), `tcp:HOST:PORT` or `tcp:[IPv6]:PORT`.
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("unix: needs a socket path".into());
            }
            return Ok(Listener::Unix(path.into()));
        }
        if let Some(addr) = s.strip_prefix("tcp:") {
            if addr.parse::<u16>().is_ok() {
                return Ok(Listener::Tcp(format!("127.0.0.1:{addr}")));
            }
            return match addr.rsplit_once(':') {
                Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                    Ok(Listener::Tcp(addr.to_string()))
                }
                _ => Err(format!("'{s}': expected tcp:PORT or tcp:HOST:PORT")),
            };
        }
        Err(format!("'{s}': expected unix:PATH or tcp:[HOST:]PORT"))
    }
}

pub struct DaemonOptions {
    pub state_dir: PathBuf,
    pub control: PathBuf,
    pub nbd: Vec<Listener>,
    pub fuse: Option<PathBuf>,
    pub nbd_threads: usize,
    pub nbd_buffer_budget: usize,
    pub nbd_max_connections_per_client: usize,
    pub nbd_idle_timeout: Option<std::time::Duration>,
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
        catalog,
        ServerConfig {
            workers_per_connection: options.nbd_threads,
            max_connections_per_client: options.nbd_max_connections_per_client,
            idle_timeout: options.nbd_idle_timeout,
            buffer_budget: options.nbd_buffer_budget,
            ..ServerConfig::default()
        },
    );
    for listener in &options.nbd {
        match listener {
            Listener::Unix(path) => server
                .listen_unix(path)
                .with_context(|| format!("NBD socket {}", path.display()))?,
            Listener::Tcp(addr) => {
                server
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
        if let Listener::Unix(path) = listener {
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
