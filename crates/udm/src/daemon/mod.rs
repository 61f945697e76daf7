//! `udm daemon`: holds the devices, serves them, answers the control socket.
//!
//! Where the daemon keeps its state: [`Registry`] (names → [`Device`]s, the verbs, stacking
//! and cycle checks; persisted by `persist.rs` to `STATE_DIR/devices/NAME.json`), each
//! [`Device`] (live and inactive table, the suspend gate, events, open counts), [`claims`]
//! (who may write which file or device) and `remotes.rs` (sizes of remote exports). [`run`]
//! wires them to the NBD server, the FUSE export, the control socket, `/metrics` and systemd.

mod acceptor;
mod catalog;
mod claims;
mod control;
mod delta_context;
mod device;
mod held_origins;
mod listener;
mod log_file;
pub mod loopback;
mod metrics;
pub mod notify;
mod persist;
mod receive;
mod received;
mod registry;
mod remotes;
mod removal;
mod rename;
mod report;
mod resolver;
mod send;
mod signals;
mod state_dir;
mod stats;
mod transfer;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use log::{info, warn};
use thiserror::Error;
use udm_block::ExportCatalog;
use udm_fuse::{FuseConfig, FuseError, FuseExport, Transport, UringMode};
use udm_nbd::{NbdServer, ServerConfig, TlsServer};

pub use catalog::Catalog;
pub use device::{Device, Events, OpenHandle};
pub use listener::{Address, Listener};
pub use metrics::MetricsAddress;
pub use registry::{Registry, RegistryError};
use state_dir::{lock_state_dir, write_durably};

pub struct DaemonOptions {
    pub state_dir: PathBuf,
    pub control: PathBuf,
    pub nbd: Vec<Listener>,
    /// Where to serve Prometheus metrics, if anywhere.
    pub metrics: Option<MetricsAddress>,
    /// Offered (or required) on every TCP listener; Unix sockets are guarded by their
    /// filesystem permissions instead.
    pub tls: Option<TlsServer>,
    pub fuse: Option<PathBuf>,
    /// Engine, limits and timeouts of the NBD server.
    pub nbd_config: ServerConfig,
    pub fuse_threads: usize,
    pub fuse_uring: UringMode,
    pub fuse_queue_threads: u16,
    /// Reads one FUSE queue keeps at the disk at once over io_uring (0: no bound).
    pub fuse_queue_reads: u16,
    pub remote_timeout: Duration,
    /// Where to take replication streams from other hosts (`udm send … --to tcp:…`).
    pub replication: Option<MetricsAddress>,
    /// How long a stop serves a FUSE mount still in use after its unmount (a copy in another
    /// mount namespace) before aborting its connection.
    pub stop_timeout: Duration,
}

impl DaemonOptions {
    /// The options with every path made absolute against the current directory: `udm info`
    /// and `udm stop` hand them to clients in other directories, and the daemon leaves its own
    /// for `/` once started.
    fn with_absolute_paths(mut self) -> std::io::Result<DaemonOptions> {
        self.state_dir = std::path::absolute(&self.state_dir)?;
        self.control = std::path::absolute(&self.control)?;
        if let Some(fuse) = &self.fuse {
            self.fuse = Some(std::path::absolute(fuse)?);
        }
        for listener in &mut self.nbd {
            if let Address::Unix(path) = &listener.address {
                listener.address = Address::Unix(std::path::absolute(path)?);
            }
        }
        Ok(self)
    }
}

/// Makes the directory of the control socket if it is missing (`/run/udm` by default, which
/// systemd's RuntimeDirectory makes for the service but nobody makes for a daemon run by
/// hand), readable by all as /run's directories are: the socket's own mode guards it.
fn make_socket_dir(socket: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let Some(dir) = socket.parent().filter(|dir| !dir.exists()) else {
        return Ok(());
    };
    std::fs::create_dir_all(dir)?;
    // 0755 whatever the umask (a root shell with umask 077 would make it 0700).
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    info!(
        "made the directory {} for the control socket",
        dir.display()
    );
    Ok(())
}

/// Why the daemon could not start; each names what it was setting up, and its `source()` says
/// what went wrong there (the binary prints the chain).
#[derive(Debug, Error)]
pub enum DaemonError {
    #[error("{context}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    #[error("state dir {} is in use: udm daemon already running (pid {pid})", state_dir.display())]
    InUse { state_dir: PathBuf, pid: String },
    #[error("FUSE mount at {}", mountpoint.display())]
    Fuse {
        mountpoint: PathBuf,
        source: FuseError,
    },
}

impl DaemonError {
    /// Turns an I/O error into one that says what the daemon was doing.
    fn io(context: String) -> impl Fn(std::io::Error) -> DaemonError {
        move |source| DaemonError::Io {
            context: context.clone(),
            source,
        }
    }
}

/// Every open file holds two descriptors (O_DIRECT and buffered) and every NBD connection
/// one, so a host serving hundreds of volumes passes the usual soft limit of 1,024 long before
/// its hard limit. A server raises its own soft limit (systemd's advice for services, and
/// what nbdkit and qemu do); it is logged so the number is known when it runs out anyway.
fn raise_descriptor_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit write and read the one struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 || limit.rlim_cur >= limit.rlim_max
        {
            return;
        }
        let wanted = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &wanted) == 0 {
            info!(
                "open files: soft limit raised from {} to {}",
                limit.rlim_cur, limit.rlim_max
            );
        }
    }
}

/// Runs the daemon until SIGTERM or SIGINT, then stops in order: waits for the FUSE mount's
/// users, flushes every device, unmounts (aborting a connection other mount namespaces still
/// hold after `stop_timeout`), flushes again, removes the sockets. SIGHUP reopens the log file.
/// Under systemd (`Type=notify`) it says READY=1 once every device is restored and every
/// listener is up, and STOPPING=1 when the stop begins.
pub fn run(options: DaemonOptions) -> Result<(), DaemonError> {
    if options.fuse.is_some() {
        // Serving a mounted filesystem's backing store: memory reclaim must not wait on us
        // (set before any thread starts, since threads inherit it).
        udm_fuse::set_io_flusher();
    }
    let options = options
        .with_absolute_paths()
        .map_err(DaemonError::io("finding the current directory".into()))?;
    raise_descriptor_limit();
    let signals = signals::block_daemon_signals();
    log_file::remember();
    let _state_lock = lock_state_dir(&options.state_dir)?;
    // Declared after the lock, so dropped before it: a failed start removes the sockets it
    // made, and `udm stop` (which waits for the lock) finds them gone.
    let mut sockets = OwnSockets::default();
    let registry = Arc::new(
        Registry::new(&options.state_dir, options.remote_timeout).map_err(DaemonError::io(
            format!("state dir {}", options.state_dir.display()),
        ))?,
    );
    if let Some(mountpoint) = &options.fuse {
        registry.own_exports.set_fuse(mountpoint);
    }
    registry.own_exports.set_nbd(&options.nbd);
    let restored = registry
        .restore()
        .map_err(DaemonError::io("reading the state dir".into()))?;
    info!(
        "restored {restored} device(s) from {}",
        options.state_dir.display()
    );
    receive::recover(&registry);
    if let Some(address) = &options.metrics {
        metrics::serve(address, registry.clone())
            .map_err(DaemonError::io(format!("metrics on tcp:{}", address.0)))?;
    }

    if let Some(address) = &options.replication {
        transfer::listen(address, registry.clone())
            .map_err(DaemonError::io(format!("replication on tcp:{}", address.0)))?;
    }

    let fuse = match &options.fuse {
        Some(mountpoint) => Some(mount_fuse(&options, mountpoint, &registry)?),
        None => None,
    };
    let fuse_files = match (&options.fuse, &fuse) {
        (Some(dir), Some(export)) => Some(report::FuseFiles {
            dir: dir.clone(),
            transport: export.transport().to_string(),
            on_io_uring: matches!(export.transport(), Transport::IoUring { .. }),
        }),
        _ => None,
    };
    let (nbd_engine, nbd_on_io_uring) = match listen_nbd(&options, &registry, &mut sockets)? {
        Some((engine, on_io_uring)) => (Some(engine), on_io_uring),
        None => (None, false),
    };
    let exports = report::Exports {
        fuse: fuse_files,
        nbd_engine,
        nbd_on_io_uring,
    };
    // Every path it holds is absolute, and a daemon left in its start directory would keep
    // that filesystem busy (no umount) for its whole life. Before the control socket: once a
    // client reaches the daemon, it is done.
    std::env::set_current_dir("/").map_err(DaemonError::io("chdir /".into()))?;
    let control_context = format!("control socket {}", options.control.display());
    make_socket_dir(&options.control).map_err(DaemonError::io(control_context.clone()))?;
    control::listen(&options.control, registry.clone(), exports)
        .map_err(DaemonError::io(control_context))?;
    sockets.made(&options.control);
    info!("control socket {}", options.control.display());
    notify::notify(&format!(
        "READY=1\nSTATUS=serving {restored} restored device(s)"
    ));

    let signal = signals::wait_for_signal(&signals, None).expect("no timeout");
    info!("signal {signal}: stopping");
    notify::notify("STOPPING=1\nSTATUS=stopping: flushing devices");
    let forced = wait_for_file_users(&registry, &signals, options.fuse.as_deref());
    info!("flushing devices and stopping");
    // First, so that every write acknowledged so far is durable whatever the unmount waits for
    // (and however it ends: systemd's SIGKILL after TimeoutStopSec).
    registry.flush_all();
    if let Some(fuse) = fuse {
        let patience = if forced {
            Duration::ZERO
        } else {
            options.stop_timeout
        };
        unmount_fuse(fuse, &signals, patience);
        // What the mount's last users wrote while it was served on.
        registry.flush_all();
    }
    Ok(())
}

/// Unmounts the FUSE export. A copy of the mount in another mount namespace (a container, a
/// service with PrivateTmp, `unshare -m`) keeps its connection up after our unmount, for as
/// long as that namespace lives: it is served for up to `patience`, then aborted; a second
/// SIGTERM or SIGINT aborts it at once.
fn unmount_fuse(fuse: FuseExport, signals: &libc::sigset_t, patience: Duration) {
    let mut hinted = false;
    fuse.unmount_within(patience, || {
        // First asked right after the export has said whom it waits for.
        if !std::mem::replace(&mut hinted, true) {
            info!("send SIGTERM or SIGINT again to abort it now (--stop-timeout {patience:?})");
        }
        let signal = signals::wait_for_signal(signals, Some(Duration::ZERO));
        if let Some(signal) = signal {
            warn!("signal {signal} again: aborting the FUSE connection now");
        }
        signal.is_some()
    });
}

/// The socket files this daemon made, removed when it stops or fails to start; each only if it
/// is still the very file it made (by inode), never one another daemon has put there since.
#[derive(Default)]
struct OwnSockets(Vec<(PathBuf, u64, u64)>);

impl OwnSockets {
    /// Notes the socket just bound at `path`.
    fn made(&mut self, path: &Path) {
        use std::os::unix::fs::MetadataExt;
        match std::fs::symlink_metadata(path) {
            Ok(meta) => self.0.push((path.to_path_buf(), meta.dev(), meta.ino())),
            Err(e) => warn!("socket {}: {e}", path.display()),
        }
    }
}

impl Drop for OwnSockets {
    fn drop(&mut self) {
        use std::os::unix::fs::MetadataExt;
        for (path, dev, ino) in &self.0 {
            let ours = std::fs::symlink_metadata(path)
                .is_ok_and(|meta| (meta.dev(), meta.ino()) == (*dev, *ino));
            if !ours {
                continue;
            }
            if let Err(e) = std::fs::remove_file(path) {
                warn!("removing {}: {e}", path.display());
            }
        }
    }
}

fn mount_fuse(
    options: &DaemonOptions,
    mountpoint: &Path,
    registry: &Arc<Registry>,
) -> Result<FuseExport, DaemonError> {
    let catalog = Arc::new(Catalog {
        registry: registry.clone(),
        as_files: true,
    });
    let config = FuseConfig {
        workers: options.fuse_threads,
        io_uring: options.fuse_uring,
        threads_per_queue: options.fuse_queue_threads,
        queue_reads: options.fuse_queue_reads,
        ..FuseConfig::default()
    };
    let export =
        FuseExport::mount(mountpoint, catalog, config).map_err(|source| DaemonError::Fuse {
            mountpoint: mountpoint.to_path_buf(),
            source,
        })?;
    info!(
        "fuse: every device is the file {}/NAME",
        mountpoint.display()
    );
    Ok(export)
}

/// Starts the NBD server on every `--nbd` listener, each with its own view of the devices.
/// Returns the engine serving them (for `udm info`) and whether it runs on io_uring, or
/// `None` when the daemon serves no NBD.
fn listen_nbd(
    options: &DaemonOptions,
    registry: &Arc<Registry>,
    sockets: &mut OwnSockets,
) -> Result<Option<(String, bool)>, DaemonError> {
    let catalog: Arc<dyn ExportCatalog> = Arc::new(Catalog {
        registry: registry.clone(),
        as_files: false,
    });
    let server = NbdServer::new(catalog.clone(), options.nbd_config.clone())
        .map_err(DaemonError::io("NBD server".into()))?;
    for listener in &options.nbd {
        let catalog = listener.catalog(catalog.clone());
        match &listener.address {
            Address::Unix(path) => {
                server
                    .for_listener(catalog, None)
                    .listen_unix(path)
                    .map_err(DaemonError::io(format!("NBD socket {}", path.display())))?;
                sockets.made(path);
            }
            Address::Tcp(addr) => {
                server
                    .for_listener(catalog, options.tls.clone())
                    .listen_tcp(addr.as_str())
                    .map_err(DaemonError::io(format!("NBD on tcp:{addr}")))?;
            }
        }
    }
    Ok((!options.nbd.is_empty()).then(|| (server.engine(), server.on_io_uring())))
}

/// A stop does not pull a device from under a loop device or a mounted filesystem: while
/// files of the FUSE mount are open, the daemon keeps serving, says which devices hold it, and
/// stops when they are released — or at a second signal, which forces the stop (devices are
/// still flushed first). NBD clients do not hold it up: their requests in flight complete and
/// the flush makes them durable; a client that wants to outlive a restart reconnects. True if
/// a second signal forced the stop.
fn wait_for_file_users(
    registry: &Registry,
    signals: &libc::sigset_t,
    mount: Option<&Path>,
) -> bool {
    let Some(mount) = mount else {
        return false;
    };
    let mut reported = Vec::new();
    loop {
        let busy: Vec<String> = registry
            .all()
            .iter()
            .filter(|d| d.file_open_count() > 0)
            .map(|d| d.name().to_string())
            .collect();
        if busy.is_empty() {
            return false;
        }
        if busy != reported {
            warn!(
                "not stopping while these files of {} are open (loop devices, mounted \
                 filesystems?): {}; release them (umount, losetup -d) or send the signal again \
                 to stop anyway",
                mount.display(),
                busy.join(", ")
            );
            reported = busy;
        }
        if let Some(signal) = signals::wait_for_signal(signals, Some(Duration::from_millis(500))) {
            warn!("signal {signal} again: stopping with files still open; their users get errors");
            return true;
        }
    }
}
