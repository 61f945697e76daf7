//! The export as a whole: mount, start the workers, and tear both down again.

use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{error, info, warn};
use udm_block::ExportCatalog;

use crate::error::FuseError;
use crate::fs::Fs;
use crate::mount::{self, Probe, Unmounted};
use crate::worker::{Limits, Worker};

/// How long a mount detached while still in use (a loop device on one of its files) is served
/// on before its connection is aborted, so that shutting down cannot hang on a user that never
/// lets go.
const DETACH_GRACE: Duration = Duration::from_secs(3);

#[derive(Debug, Clone)]
pub struct FuseConfig {
    /// Threads serving requests: the number of requests in progress at once.
    pub workers: usize,
    /// The largest read or write the kernel sends in one request (a multiple of 4 KiB, at least
    /// 8 KiB). Each worker keeps two buffers of about this size. The kernel caps requests at
    /// `fs.fuse.max_pages_limit` pages (1 MiB by default).
    pub max_request: u32,
}

impl Default for FuseConfig {
    fn default() -> Self {
        FuseConfig {
            workers: 8,
            max_request: 1 << 20,
        }
    }
}

impl FuseConfig {
    fn validate(&self) -> Result<(), FuseError> {
        if self.workers == 0 {
            return Err(FuseError::Config("at least one worker is needed".into()));
        }
        if self.max_request < 8192 || !self.max_request.is_multiple_of(4096) {
            return Err(FuseError::Config(format!(
                "max_request {} is not a multiple of 4096 of at least 8192",
                self.max_request
            )));
        }
        Ok(())
    }
}

/// Counts the workers still running, so teardown can wait for them with a deadline.
#[derive(Default)]
struct Running {
    count: Mutex<usize>,
    changed: Condvar,
}

impl Running {
    /// Waits until every worker has ended or `limit` has passed; true if they all ended.
    fn wait(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let mut count = self.count.lock().unwrap();
        while *count > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            count = self.changed.wait_timeout(count, left).unwrap().0;
        }
        true
    }
}

/// Decrements the count when its worker ends, however it ends.
struct RunningGuard(Arc<Running>);

impl Drop for RunningGuard {
    fn drop(&mut self) {
        *self.0.count.lock().unwrap() -= 1;
        self.0.changed.notify_all();
    }
}

/// Every device of a catalog as a regular file `MOUNTPOINT/NAME`, served over FUSE.
///
/// The files have the size of their device, mode 0600 (0400 for read-only devices), no page
/// cache (every read and write reaches the device), and take requests from many threads at
/// once, so `losetup --direct-io=on` on one gives a block device for mkfs and mount.
pub struct FuseExport {
    mountpoint: PathBuf,
    /// The connection's name in the FUSE control filesystem, once known.
    connection: Option<u64>,
    threads: Vec<JoinHandle<()>>,
    running: Arc<Running>,
    stopped: bool,
}

impl FuseExport {
    /// Mounts the export on `mountpoint` (created if missing; a dead FUSE mount left there by
    /// a crashed daemon is cleared first) and starts `config.workers` threads serving it.
    /// Returns once the kernel has completed the protocol handshake.
    pub fn mount(
        mountpoint: &Path,
        catalog: Arc<dyn ExportCatalog>,
        config: FuseConfig,
    ) -> Result<FuseExport, FuseError> {
        config.validate()?;
        let path = mount::resolve(mountpoint)?;
        mount::recover_stale_mount(&path)?;
        match mount::probe(&path)? {
            Probe::Live => return Err(FuseError::AlreadyMounted(path)),
            Probe::Missing => std::fs::create_dir_all(&path)
                .map_err(|e| FuseError::io(format!("create {}", path.display()), e))?,
            Probe::Stale | Probe::Other => {}
        }
        let fd = mount::open_fuse_device()?;
        mount::mount_fuse(&path, &fd)?;
        // From here on, dropping the export unmounts again.
        let mut export = FuseExport {
            mountpoint: path,
            connection: None,
            threads: Vec::with_capacity(config.workers),
            running: Arc::new(Running::default()),
            stopped: false,
        };
        export.start_workers(fd, catalog, &config)?;
        // The first request through the mount waits for INIT to be answered, so this both
        // confirms the handshake and names the connection.
        let meta = std::fs::metadata(&export.mountpoint).map_err(|e| {
            FuseError::io(
                format!("stat the new mount {}", export.mountpoint.display()),
                e,
            )
        })?;
        export.connection = Some(mount::connection_id(meta.dev()));
        info!(
            "fuse: serving devices as files in {} with {} workers",
            export.mountpoint.display(),
            config.workers
        );
        Ok(export)
    }

    fn start_workers(
        &mut self,
        fd: OwnedFd,
        catalog: Arc<dyn ExportCatalog>,
        config: &FuseConfig,
    ) -> Result<(), FuseError> {
        let fs = Arc::new(Fs::new(catalog));
        let limits = Limits {
            max_request: config.max_request,
            // Asynchronous requests (a loop device's queue) the kernel lets wait in the input
            // queue: enough that a worker finishing one finds the next without a round trip
            // through the kernel's background queue.
            max_background: (config.workers * 2).clamp(16, usize::from(u16::MAX)) as u16,
        };
        // Worker 0 reads the descriptor the mount was made with, every other worker a clone
        // of it. Clones share the connection's input queue but each has its own queue of
        // requests in progress (and its lock), so replies from many threads do not contend.
        // Measured against all workers on one descriptor (2 vCPUs, fio through a loop device):
        // equal within noise, the clones slightly ahead at queue depth 32; they are the layout
        // that scales with cores.
        let first = Arc::new(fd);
        for i in 0..config.workers {
            let fd = if i == 0 {
                first.clone()
            } else {
                Arc::new(mount::clone_device(&first)?)
            };
            let worker = Worker::new(fs.clone(), fd, limits);
            *self.running.count.lock().unwrap() += 1;
            let guard = RunningGuard(self.running.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("fuse-{i}"))
                .spawn(move || {
                    let _guard = guard;
                    worker.run();
                });
            match spawned {
                Ok(handle) => self.threads.push(handle),
                Err(e) => return Err(FuseError::io("spawn a FUSE worker", e)),
            }
        }
        Ok(())
    }

    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Unmounts and waits for the workers. A mount still in use (a loop device or an open file
    /// on it) is detached lazily and served for a few more seconds; if its users still hold it
    /// then, its connection is aborted (their I/O fails from then on) so that no request
    /// reaches a device after this returns.
    pub fn unmount(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if std::mem::replace(&mut self.stopped, true) {
            return;
        }
        let path = self.mountpoint.display().to_string();
        let ended = match mount::unmount(&self.mountpoint) {
            // The kernel ended the connection; every worker is leaving.
            Ok(Unmounted::Clean) => true,
            Ok(Unmounted::Detached) => {
                warn!("fuse: {path} is still in use (a loop device?); detached it lazily");
                self.running.wait(DETACH_GRACE) || self.abort()
            }
            Ok(Unmounted::NotMounted) => self.running.wait(DETACH_GRACE) || self.abort(),
            Err(e) => {
                error!("fuse: {e}");
                self.abort()
            }
        };
        if ended {
            for handle in self.threads.drain(..) {
                let _ = handle.join();
            }
            info!("fuse: {path} unmounted");
        } else {
            // Nothing more can be done from here: they end when the last user of the mount
            // lets go, or with the process.
            error!("fuse: leaving the workers of {path} serving a mount that cannot be ended");
            self.threads.clear();
        }
    }

    /// Aborts the connection; true if the workers are on their way out.
    fn abort(&self) -> bool {
        let Some(connection) = self.connection else {
            error!("fuse: cannot abort a connection whose handshake never completed");
            return false;
        };
        match mount::abort_connection(connection) {
            Ok(()) => {
                warn!(
                    "fuse: aborted the connection of {}: its remaining users get errors",
                    self.mountpoint.display()
                );
                true
            }
            Err(e) => {
                error!("fuse: {e}");
                false
            }
        }
    }
}

impl Drop for FuseExport {
    fn drop(&mut self) {
        self.stop();
    }
}
