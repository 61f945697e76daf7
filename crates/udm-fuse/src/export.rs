//! The export as a whole: mount, choose the transport (io_uring or /dev/fuse), start its
//! threads, and tear it all down again.

use parking_lot::{Condvar, Mutex};
use std::fmt;
use std::ops::Range;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{error, info, warn};
use udm_block::ExportCatalog;

use crate::error::FuseError;
use crate::fs::Fs;
use crate::mount::{self, Probe, Unmounted};
use crate::session::{Limits, Session};
use crate::uring::{self, Queue};
use crate::worker::Worker;

/// How long [`FuseExport::unmount`] serves a mount still in use after the unmount (a loop
/// device on one of its files, a copy in another mount namespace) before it aborts the
/// connection, so that shutting down cannot hang on a user that never lets go.
const DETACH_GRACE: Duration = Duration::from_secs(3);

/// How long the workers of a connection may take to end once the kernel has ended it; longer,
/// and something else holds the connection up.
const ENDING: Duration = Duration::from_millis(200);

/// How long the kernel may take to send INIT after the mount, and the queues to register.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether requests come through io_uring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UringMode {
    /// Always /dev/fuse.
    Off,
    /// io_uring when the kernel and the process allow it (turning the fuse module's
    /// `enable_uring` on if we are root), else /dev/fuse with a line in the log saying why.
    Auto,
    /// io_uring, or the mount fails saying why not.
    On,
}

#[derive(Debug, Clone)]
pub struct FuseConfig {
    /// Threads serving requests synchronously: over /dev/fuse the number of requests in
    /// progress at once; over io_uring the pool that serves what the engine cannot.
    pub workers: usize,
    /// The largest read or write the kernel sends in one request (a multiple of 4 KiB, at least
    /// 8 KiB). Each worker and each ring entry keeps buffers of about this size. The kernel caps
    /// requests at `fs.fuse.max_pages_limit` pages (1 MiB by default).
    pub max_request: u32,
    pub io_uring: UringMode,
    /// Ring entries per queue (one queue per CPU): the requests a CPU's queue holds at once.
    pub queue_depth: u16,
    /// Threads (each with its own ring) that share a queue's entries. One thread per queue
    /// is a single point that every request and every disk completion of its CPU must pass
    /// (the kernel delivers both as task work to the thread that owns the entry), and on a
    /// busy CPU each of them waits for that thread to be scheduled; with two, one serves
    /// while the other waits. Measured on 2 vCPUs under load (fio through a loop device,
    /// 4 KiB, depth 32, alternating in one run, medians of 4): random writes 24.7k IOPS with
    /// one thread per queue, 33.8k with two, 33.1k with four; random reads 28.3k, 31.1k,
    /// 33.9k.
    pub threads_per_queue: u16,
    /// Over io_uring: reads shorter than 128 KiB one queue keeps at the disk at once, dealt
    /// out among its threads (at least one each; 0: no bound, every entry's read goes to the
    /// disk); the others wait in order. See bench/README.md ("the FUSE path") for why a bound pays on a disk that
    /// answers depth with latency.
    pub queue_reads: u16,
}

impl Default for FuseConfig {
    fn default() -> Self {
        FuseConfig {
            workers: 8,
            max_request: 1 << 20,
            io_uring: UringMode::Auto,
            queue_depth: 32,
            threads_per_queue: 2,
            queue_reads: 16,
        }
    }
}

/// How requests reach the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Worker threads reading and writing /dev/fuse.
    DevFuse { workers: usize },
    /// Queues of ring entries, one per CPU, and a pool for synchronous requests.
    IoUring {
        queues: usize,
        depth: usize,
        threads_per_queue: usize,
        /// Reads at the disk per queue (0: no bound).
        reads: usize,
        pool: usize,
    },
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            Transport::DevFuse { workers } => write!(f, "/dev/fuse ({workers} worker threads)"),
            Transport::IoUring {
                queues,
                depth,
                threads_per_queue,
                reads,
                pool,
            } => {
                write!(
                    f,
                    "io_uring ({queues} queues of {depth} entries on {threads_per_queue} \
                     threads each, "
                )?;
                match reads {
                    0 => write!(f, "no bound on reads at the disk, ")?,
                    n => write!(f, "at most {n} reads under 128 KiB at the disk per queue, ")?,
                }
                write!(f, "{pool} threads for synchronous requests)")
            }
        }
    }
}

impl FuseConfig {
    fn validate(&self) -> Result<(), FuseError> {
        if self.workers == 0 {
            return Err(FuseError::Config("at least one worker is needed".into()));
        }
        if self.queue_depth == 0 {
            return Err(FuseError::Config("queue_depth must be at least 1".into()));
        }
        if self.threads_per_queue == 0 || self.threads_per_queue > self.queue_depth {
            return Err(FuseError::Config(format!(
                "threads_per_queue {} is not between 1 and queue_depth {}",
                self.threads_per_queue, self.queue_depth
            )));
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

/// With `Auto`, logs why io_uring is not used and lets the mount go on over /dev/fuse; with
/// `On`, fails it.
fn fallback(mode: UringMode, reason: String) -> Result<(), FuseError> {
    if mode == UringMode::On {
        return Err(FuseError::IoUring(reason));
    }
    warn!("fuse: not using io_uring: {reason}; serving over /dev/fuse");
    Ok(())
}

/// What INIT tells the kernel, for `queues` ring queues (0: /dev/fuse).
fn limits(config: &FuseConfig, queues: usize) -> Limits {
    // Asynchronous requests (a loop device's queue) the kernel lets wait in the input
    // queue: enough that a worker finishing one finds the next without a round trip through
    // the kernel's background queue; over io_uring, enough to fill every entry.
    let wanted = (config.workers * 2).max(queues * usize::from(config.queue_depth));
    Limits {
        max_request: config.max_request,
        max_background: wanted.clamp(16, usize::from(u16::MAX)) as u16,
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
        let mut count = self.count.lock();
        while *count > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            self.changed.wait_for(&mut count, left);
        }
        true
    }
}

/// Decrements the count when its worker ends, however it ends.
struct RunningGuard(Arc<Running>);

impl Drop for RunningGuard {
    fn drop(&mut self) {
        *self.0.count.lock() -= 1;
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
    /// The mount's device number (`st_dev`), once the handshake has completed: it names the
    /// connection in the FUSE control filesystem and the mount in other namespaces'
    /// mountinfo.
    device: Option<u64>,
    threads: Vec<JoinHandle<()>>,
    running: Arc<Running>,
    stopped: bool,
    transport: Transport,
}

impl FuseExport {
    /// Mounts the export on `mountpoint` (created if missing; a dead FUSE mount left there by
    /// a crashed daemon is cleared first) and starts the threads serving it, over io_uring or
    /// /dev/fuse as `config.io_uring` says. Returns once the kernel has completed the protocol
    /// handshake.
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
        let queues = match config.io_uring {
            UringMode::Off => None,
            mode => match uring::prepare(
                config.queue_depth,
                config.threads_per_queue,
                config.queue_reads,
                config.max_request as usize,
            ) {
                Ok(queues) => Some(queues),
                Err(reason) => {
                    fallback(mode, reason)?;
                    None
                }
            },
        };
        let queue_count = queues.as_ref().map_or(0, |rings| {
            rings.len() / usize::from(config.threads_per_queue)
        });
        let session = Arc::new(Session::new(
            Fs::new(catalog),
            limits(&config, queue_count),
            queues.is_some(),
        ));
        let fd = Arc::new(mount::open_fuse_device()?);
        mount::mount_fuse(&path, &fd)?;
        // From here on, dropping the export unmounts again.
        let mut export = FuseExport {
            mountpoint: path,
            device: None,
            threads: Vec::new(),
            running: Arc::new(Running::default()),
            stopped: false,
            transport: Transport::DevFuse {
                workers: config.workers,
            },
        };
        match queues {
            None => export.start_workers(&fd, &session, 0..config.workers)?,
            Some(queues) => {
                // Over io_uring, only INIT (before the queues register) and FORGET and
                // INTERRUPT come through /dev/fuse: one worker reads it.
                export.start_workers(&fd, &session, 0..1)?;
                match export.start_uring(queues, &fd, &session, &config) {
                    Ok(transport) => export.transport = transport,
                    Err(reason) => {
                        fallback(config.io_uring, reason)?;
                        export.start_workers(&fd, &session, 1..config.workers)?;
                    }
                }
            }
        }
        // The first request through the mount waits for INIT to be answered (and the ring to
        // be ready), so this both confirms the handshake and names the connection.
        let meta = std::fs::metadata(&export.mountpoint).map_err(|e| {
            FuseError::io(
                format!("stat the new mount {}", export.mountpoint.display()),
                e,
            )
        })?;
        export.device = Some(meta.dev());
        info!(
            "fuse: serving devices as files in {} over {}",
            export.mountpoint.display(),
            export.transport
        );
        Ok(export)
    }

    /// Starts /dev/fuse workers number `range`.
    ///
    /// Worker 0 reads the descriptor the mount was made with, every other worker a clone of
    /// it. Clones share the connection's input queue but each has its own queue of requests
    /// in progress (and its lock), so replies from many threads do not contend. Measured
    /// against all workers on one descriptor (2 vCPUs, fio through a loop device): equal
    /// within noise, the clones slightly ahead at queue depth 32; they are the layout that
    /// scales with cores.
    fn start_workers(
        &mut self,
        first: &Arc<OwnedFd>,
        session: &Arc<Session>,
        range: Range<usize>,
    ) -> Result<(), FuseError> {
        for i in range {
            let fd = if i == 0 {
                first.clone()
            } else {
                Arc::new(mount::clone_device(first)?)
            };
            let worker = Worker::new(session.clone(), fd);
            self.spawn(format!("fuse-{i}"), move || worker.run())?;
        }
        Ok(())
    }

    /// Waits for INIT, then starts the queues and the pool if the kernel agreed on io_uring
    /// and took every queue's entries; Err says why requests come through /dev/fuse instead.
    fn start_uring(
        &mut self,
        queues: Vec<Queue>,
        fd: &Arc<OwnedFd>,
        session: &Arc<Session>,
        config: &FuseConfig,
    ) -> Result<Transport, String> {
        match session.wait_handshake(HANDSHAKE_TIMEOUT) {
            Some(true) => {}
            Some(false) => return Err("the kernel did not agree to it at INIT".into()),
            None => return Err("the kernel sent no INIT".into()),
        }
        let transport = Transport::IoUring {
            queues: queues.len() / usize::from(config.threads_per_queue),
            depth: usize::from(config.queue_depth),
            threads_per_queue: usize::from(config.threads_per_queue),
            reads: usize::from(config.queue_reads),
            pool: config.workers,
        };
        let (jobs, pool) = uring::jobs();
        for i in 0..config.workers {
            let (session, pool) = (session.clone(), pool.clone());
            self.spawn(format!("fuse-pool-{i}"), move || {
                uring::run_pool(session, pool)
            })
            .map_err(|e| e.to_string())?;
        }
        let (started, reports) = mpsc::channel();
        let count = queues.len();
        for queue in queues {
            let (session, fd, jobs, started) =
                (session.clone(), fd.clone(), jobs.clone(), started.clone());
            self.spawn(queue.thread_name(), move || {
                queue.run(session, fd, jobs, started)
            })
            .map_err(|e| e.to_string())?;
        }
        let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
        for _ in 0..count {
            let left = deadline.saturating_duration_since(Instant::now());
            match reports.recv_timeout(left) {
                Ok(Ok(())) => {}
                Ok(Err(reason)) => return Err(reason),
                Err(_) => return Err("a queue did not register its entries".into()),
            }
        }
        Ok(transport)
    }

    /// Starts a thread that counts as running until it ends.
    fn spawn(&mut self, name: String, f: impl FnOnce() + Send + 'static) -> Result<(), FuseError> {
        *self.running.count.lock() += 1;
        let guard = RunningGuard(self.running.clone());
        let spawned = std::thread::Builder::new().name(name).spawn(move || {
            let _guard = guard;
            f();
        });
        match spawned {
            Ok(handle) => {
                self.threads.push(handle);
                Ok(())
            }
            Err(e) => Err(FuseError::io("spawn a FUSE thread", e)),
        }
    }

    /// How requests reach the export.
    pub fn transport(&self) -> Transport {
        self.transport
    }

    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Unmounts and waits for the workers. A mount still in use (a loop device or an open file
    /// on it, a copy in another mount namespace) is served for a few more seconds; if its users
    /// still hold it then, its connection is aborted (their I/O fails from then on) so that no
    /// request reaches a device after this returns.
    pub fn unmount(self) {
        self.unmount_within(DETACH_GRACE, || false);
    }

    /// [`FuseExport::unmount`], serving a mount still in use for up to `limit` (saying in the
    /// log who holds it), or until `abort_now` (asked a few times a second) says to stop at
    /// once.
    pub fn unmount_within(mut self, limit: Duration, abort_now: impl FnMut() -> bool) {
        self.stop(limit, abort_now);
    }

    fn stop(&mut self, limit: Duration, abort_now: impl FnMut() -> bool) {
        if std::mem::replace(&mut self.stopped, true) {
            return;
        }
        let path = self.mountpoint.display().to_string();
        let ended = match mount::unmount(&self.mountpoint) {
            // Gone from this namespace. The kernel ends the connection with the last mount of
            // it: at once, unless another mount namespace has a copy.
            Ok(Unmounted::Clean) => self.serve_last_users(limit, abort_now),
            Ok(Unmounted::Detached) => {
                warn!("fuse: {path} is still in use (a loop device?); detached it lazily");
                self.serve_last_users(limit, abort_now)
            }
            Ok(Unmounted::NotMounted) => self.serve_last_users(limit, abort_now),
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

    /// Waits for the workers to end, which they do once the connection's last mount and user
    /// are gone; after `limit`, or when `abort_now` says so, aborts the connection. True if
    /// the workers are on their way out.
    fn serve_last_users(&self, limit: Duration, mut abort_now: impl FnMut() -> bool) -> bool {
        if self.running.wait(ENDING) {
            return true;
        }
        let holders = self.device.map(mount::holders).unwrap_or_default();
        let held = match holders.is_empty() {
            true => "no other mount namespace has it (an open file or a loop device?)".into(),
            false => format!(
                "other mount namespaces have it mounted: {}",
                holders
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        };
        warn!(
            "fuse: {} is unmounted here but its connection is still in use; {held}; {}: their \
             I/O fails from then on",
            self.mountpoint.display(),
            match limit.is_zero() {
                true => "aborting it now".to_string(),
                false => format!("serving it for up to {limit:.0?}, then aborting it"),
            }
        );
        let deadline = Instant::now() + limit;
        loop {
            if Instant::now() >= deadline || abort_now() {
                return self.abort();
            }
            if self.running.wait(ENDING) {
                info!(
                    "fuse: the last users of {} let go",
                    self.mountpoint.display()
                );
                return true;
            }
        }
    }

    /// Aborts the connection; true if the workers are on their way out.
    fn abort(&self) -> bool {
        let Some(device) = self.device else {
            error!("fuse: cannot abort a connection whose handshake never completed");
            return false;
        };
        match mount::abort_connection(mount::connection_id(device)) {
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
        self.stop(DETACH_GRACE, || false);
    }
}
