//! `udm daemon`'s options, and the choices some of them take.

use super::*;

#[derive(Args)]
pub struct DaemonArgs {
    /// Where the daemon listens for the verbs, its control socket [default: $UDM_CONTROL,
    /// else /run/udm/control.sock].
    #[arg(long = "control", value_name = "PATH")]
    control: Option<PathBuf>,
    /// Where device tables are kept across restarts.
    #[arg(long, value_name = "DIR")]
    pub state_dir: PathBuf,
    /// Run in the background: return once every device is restored and the sockets listen
    /// (the log still goes to stderr; `udm stop` stops it).
    #[arg(long)]
    pub fork: bool,
    /// NBD listener: unix:PATH, tcp:PORT (binds 127.0.0.1), tcp:HOST:PORT, then options:
    /// `,export=NAME` (repeatable: only these devices are listed and served there) and
    /// `,read-only`. Repeatable.
    #[arg(long, value_name = "LISTENER")]
    pub nbd: Vec<udm::daemon::Listener>,
    /// Serve Prometheus metrics at http://ADDRESS/metrics: tcp:PORT (binds 127.0.0.1) or
    /// tcp:HOST:PORT.
    #[arg(long, value_name = "ADDRESS")]
    pub metrics: Option<udm::daemon::MetricsAddress>,
    /// TLS on the TCP listeners: off; on (offered, plaintext clients served too); require
    /// (a client gets nothing before STARTTLS).
    #[arg(long, value_enum, default_value_t = TlsArg::Off)]
    pub tls: TlsArg,
    /// Directory with server-cert.pem, server-key.pem and, for --tls-verify-peer,
    /// ca-cert.pem (the layout qemu and nbdkit use).
    #[arg(long, value_name = "DIR")]
    pub tls_certificates: Option<PathBuf>,
    /// Serve only clients whose certificate is signed by the CA in ca-cert.pem.
    #[arg(long)]
    pub tls_verify_peer: bool,
    /// Expose every device as a file under this FUSE mount point.
    #[arg(long, value_name = "MOUNTPOINT")]
    pub fuse: Option<PathBuf>,
    /// What serves NBD connections: io_uring event loops (uring), a thread per request in
    /// progress (threads), or io_uring when it works here and threads otherwise (auto).
    /// The log says which serves.
    #[arg(long, value_enum, default_value_t = NbdEngineArg::Auto)]
    pub nbd_engine: NbdEngineArg,
    /// Event-loop threads serving every NBD connection (io_uring engine; default: one per
    /// CPU).
    #[arg(long, value_name = "N")]
    pub nbd_loops: Option<usize>,
    /// Threads running the NBD requests a device cannot remap onto its files (io_uring
    /// engine): delays, partial clone writes, remote sources, discards.
    #[arg(long, default_value_t = 16, value_name = "N")]
    pub nbd_pool_threads: usize,
    /// Requests one NBD connection may have read and not yet answered (io_uring engine).
    #[arg(long, default_value_t = 128, value_name = "N")]
    pub nbd_queue_depth: usize,
    /// Threads per NBD connection, each with one request in progress (threads engine).
    #[arg(long, default_value_t = 32, value_name = "N")]
    pub nbd_threads: usize,
    /// Memory all NBD connections together may hold in request buffers (K, M, G suffixes);
    /// requests wait for room. One larger than the budget waits until it can be served
    /// alone. A client that moves under 64 KiB of a request's data (a write's, a reply's)
    /// in 1 s while others wait for room, or in 30 s otherwise, is disconnected.
    #[arg(long, default_value = "256M", value_parser = parse_size, value_name = "SIZE")]
    pub nbd_buffer_budget: usize,
    /// NBD connections one client may have open (a Unix socket peer's uid, a TCP peer's
    /// address); more are refused with an error in the handshake.
    #[arg(long, default_value_t = 64, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub nbd_max_connections_per_client: u32,
    /// Close an NBD connection with no request in flight after this long without a
    /// request (300, 300s, 5m, 500ms; 0 never).
    #[arg(long, default_value = "300s", value_parser = parse_duration, value_name = "TIME")]
    pub nbd_idle_timeout: std::time::Duration,
    /// Threads serving FUSE requests synchronously: every request over /dev/fuse; over
    /// io_uring, those the io_uring engine cannot take (devices that cannot say where
    /// their data lives, partial sectors, fallocate).
    #[arg(long, default_value_t = 16, value_name = "N")]
    pub fuse_threads: usize,
    /// How FUSE requests reach the daemon: auto (io_uring where the kernel offers it,
    /// turning the fuse module's enable_uring on when root; else /dev/fuse, saying why
    /// in the log), on (io_uring or refuse to start), off (/dev/fuse).
    #[arg(long, value_enum, default_value_t = FuseUringArg::Auto)]
    pub fuse_uring: FuseUringArg,
    /// Over io_uring: threads sharing each CPU's queue of 32 entries, each on a ring of its
    /// own (with one, every request and disk completion of a busy CPU waits for that
    /// thread to be scheduled).
    #[arg(long, default_value_t = 2, value_name = "N",
          value_parser = clap::value_parser!(u16).range(1..=32))]
    pub fuse_queue_threads: u16,
    /// Over io_uring: reads shorter than 128 KiB each CPU's queue keeps at the disk at once,
    /// dealt out among its threads; the others wait in order (0: no bound). A disk that
    /// answers more depth with more latency but little more throughput serves fewer reads
    /// sooner.
    #[arg(long, default_value_t = 16, value_name = "N",
          value_parser = clap::value_parser!(u16).range(0..=32))]
    pub fuse_queue_reads: u16,
    /// Seconds a request to a remote (nbd://) backend waits for an unreachable server
    /// before failing with EIO; meanwhile the client reconnects with backoff.
    #[arg(long, default_value_t = 30, value_name = "SECONDS")]
    pub remote_timeout: u64,
    /// How long writes to a thin pool that is out of data space wait for space (the data
    /// device grown, blocks freed) before failing with ENOSPC (60s like the kernel's
    /// no_space_timeout; 0 waits for ever; error_if_no_space fails at once).
    #[arg(long, default_value = "60s", value_parser = parse_duration, value_name = "TIME")]
    pub no_space_timeout: std::time::Duration,
    /// How long a stop serves the FUSE mount after unmounting it while other mount
    /// namespaces still have it mounted (containers, services with PrivateTmp, unshare -m),
    /// before aborting its connection: their I/O fails from then on. Every device is flushed
    /// before this wait; a second SIGTERM or SIGINT ends it at once.
    #[arg(long, default_value = "10s", value_parser = parse_duration, value_name = "TIME")]
    pub stop_timeout: std::time::Duration,
    /// Take replication streams from other hosts' `udm send … --to` here: tcp:PORT (binds
    /// 127.0.0.1) or tcp:HOST:PORT. Anyone who reaches it can add thin devices to pools.
    #[arg(long, value_name = "ADDRESS")]
    pub replication: Option<udm::daemon::MetricsAddress>,
}

impl DaemonArgs {
    pub fn control(&self, before_verb: Option<&Path>) -> PathBuf {
        control_socket(self.control.as_deref(), before_verb)
    }
}

#[derive(Clone, Copy, ValueEnum)]
pub enum NbdEngineArg {
    Auto,
    Uring,
    Threads,
}

impl From<NbdEngineArg> for udm_nbd::Engine {
    fn from(arg: NbdEngineArg) -> Self {
        match arg {
            NbdEngineArg::Auto => udm_nbd::Engine::Auto,
            NbdEngineArg::Uring => udm_nbd::Engine::Uring,
            NbdEngineArg::Threads => udm_nbd::Engine::Threads,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
pub enum TlsArg {
    Off,
    On,
    Require,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum FuseUringArg {
    Auto,
    On,
    Off,
}

impl From<FuseUringArg> for udm_fuse::UringMode {
    fn from(arg: FuseUringArg) -> Self {
        match arg {
            FuseUringArg::Auto => udm_fuse::UringMode::Auto,
            FuseUringArg::On => udm_fuse::UringMode::On,
            FuseUringArg::Off => udm_fuse::UringMode::Off,
        }
    }
}
