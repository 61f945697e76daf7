//! `udm daemon`: holds the devices, serves them, answers the control socket.

mod claims;
mod control;
mod device;
mod listener;
mod registry;
mod remotes;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use log::{info, warn};
use udm_block::{Export, ExportCatalog};
use udm_fuse::{FuseConfig, FuseExport, UringMode};
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
    /// Engine, limits and timeouts of the NBD server.
    pub nbd_config: ServerConfig,
    pub fuse_threads: usize,
    pub fuse_uring: UringMode,
    pub remote_timeout: std::time::Duration,
}

/// Every device, served by name, to NBD clients or (`as_files`) through the FUSE mount.
struct Catalog {
    registry: Arc<Registry>,
    as_files: bool,
}

impl ExportCatalog for Catalog {
    fn open(&self, name: &str) -> Option<Export> {
        let device = self.registry.get(name).ok()?;
        Some(Export {
            read_only: device.read_only(),
            description: format!("udm device {name}"),
            open_guard: Box::new(device.open(self.as_files)),
            device,
        })
    }

    fn list(&self) -> Vec<(String, String)> {
        self.registry
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
    let _state_lock = lock_state_dir(&options.state_dir)?;
    let registry = Arc::new(
        Registry::new(&options.state_dir, options.remote_timeout)
            .with_context(|| format!("state dir {}", options.state_dir.display()))?,
    );
    let restored = registry.restore().context("reading the state dir")?;
    info!(
        "restored {restored} device(s) from {}",
        options.state_dir.display()
    );

    let fuse = match &options.fuse {
        Some(mountpoint) => {
            let catalog = Arc::new(Catalog {
                registry: registry.clone(),
                as_files: true,
            });
            let export = FuseExport::mount(
                mountpoint,
                catalog,
                FuseConfig {
                    workers: options.fuse_threads,
                    io_uring: options.fuse_uring,
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
    let fuse_files = match (&options.fuse, &fuse) {
        (Some(dir), Some(export)) => Some(control::FuseFiles {
            dir: dir.clone(),
            transport: export.transport().to_string(),
        }),
        _ => None,
    };
    let catalog: Arc<dyn ExportCatalog> = Arc::new(Catalog {
        registry: registry.clone(),
        as_files: false,
    });
    let server =
        NbdServer::new(catalog.clone(), options.nbd_config.clone()).context("NBD server")?;
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
    let exports = control::Exports {
        fuse: fuse_files,
        nbd_engine: (!options.nbd.is_empty()).then(|| server.engine()),
    };
    control::listen(&options.control, registry.clone(), exports)
        .with_context(|| format!("control socket {}", options.control.display()))?;
    info!("control socket {}", options.control.display());

    let signal = wait_for_signal(&signals, None).expect("no timeout");
    info!("signal {signal}: stopping");
    wait_for_file_users(&registry, &signals, options.fuse.as_deref());
    info!("flushing devices and stopping");
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

/// Waits for one of the blocked signals, or `timeout`; returns the signal.
fn wait_for_signal(signals: &libc::sigset_t, timeout: Option<Duration>) -> Option<i32> {
    let signal = match timeout {
        // SAFETY: waits for one of the blocked signals.
        None => unsafe {
            let mut signal = 0;
            libc::sigwait(signals, &mut signal);
            signal
        },
        Some(timeout) => {
            let timeout = libc::timespec {
                tv_sec: timeout.as_secs() as libc::time_t,
                tv_nsec: timeout.subsec_nanos() as libc::c_long,
            };
            // SAFETY: as above, with a timeout; -1 (EAGAIN) when it expires.
            unsafe { libc::sigtimedwait(signals, std::ptr::null_mut(), &timeout) }
        }
    };
    (signal > 0).then_some(signal)
}

/// A stop does not pull a device from under a loop device or a mounted filesystem: while
/// files of the FUSE mount are open, the daemon keeps serving, says which devices hold it, and
/// stops when they are released — or at a second signal, which forces the stop (devices are
/// still flushed first). NBD clients do not hold it up: their requests in flight complete and
/// the flush makes them durable; a client that wants to outlive a restart reconnects.
fn wait_for_file_users(registry: &Registry, signals: &libc::sigset_t, mount: Option<&Path>) {
    let Some(mount) = mount else {
        return;
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
            return;
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
        if let Some(signal) = wait_for_signal(signals, Some(Duration::from_millis(500))) {
            warn!("signal {signal} again: stopping with files still open; their users get errors");
            return;
        }
    }
}

/// Takes the state dir for this daemon alone: two daemons on one state dir would open the same
/// clone metadata and lose each other's commits. The lock (flock on `state-dir/lock`) is held
/// until the process exits, however it exits; the file names the holder's pid for the message.
fn lock_state_dir(state_dir: &Path) -> anyhow::Result<std::fs::File> {
    use std::io::{Read, Seek, Write};
    use std::os::fd::AsRawFd;
    std::fs::create_dir_all(state_dir)
        .with_context(|| format!("state dir {}", state_dir.display()))?;
    let path = state_dir.join("lock");
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("lock file {}", path.display()))?;
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let mut holder = String::new();
        let _ = file.read_to_string(&mut holder);
        anyhow::bail!(
            "state dir {} is in use: udm daemon already running (pid {})",
            state_dir.display(),
            holder.trim()
        );
    }
    file.set_len(0)?;
    file.rewind()?;
    writeln!(file, "{}", std::process::id())?;
    Ok(file)
}

/// Replaces `path` with `data` so that a crash leaves the old or the new content: temp file,
/// fsync, rename, fsync of the directory.
fn write_durably(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let file = std::fs::File::create(&tmp)?;
    std::io::Write::write_all(&mut &file, data)?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(path.parent().expect("a file in a directory"))?.sync_all()
}

fn remove_socket(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        warn!("removing {}: {e}", path.display());
    }
}
