//! Listeners: accept connections on Unix and TCP sockets and give each its own threads.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::{TcpListener, ToSocketAddrs};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use log::{debug, info, warn};

use crate::budget::BufferBudget;
use crate::event_loop::{Attach, Loops};
use crate::handshake::{negotiate_with_tls, HandshakeEnd, StartTls};
use crate::refusals;
use crate::stream::{ClientKey, Deadline, Stream};
use crate::tls::TlsServer;
use crate::transmission;
use crate::ExportCatalog;
use udm_block::WorkerPool as Pool;

/// Which code serves connections once negotiated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// io_uring event loops when io_uring works here, threads otherwise.
    Auto,
    /// io_uring event loops; the server does not start without them.
    Uring,
    /// Threads per connection calling the devices synchronously (the fallback).
    Threads,
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub engine: Engine,
    /// Event-loop threads serving every connection (io_uring engine).
    pub loop_threads: usize,
    /// Threads running the requests devices cannot remap (io_uring engine).
    pub pool_threads: usize,
    /// Requests one connection can have read and not yet answered (io_uring engine).
    pub queue_depth: usize,
    /// Threads per connection, each with one request in progress (threads engine).
    pub workers_per_connection: usize,
    /// Connections beyond this are refused, so a flood cannot exhaust threads.
    pub max_connections: usize,
    /// Connections from one client (a Unix socket peer's uid, a TCP peer's address) beyond
    /// this are refused, so one client cannot take every connection.
    pub max_connections_per_client: usize,
    /// A client that stalls in the handshake longer than this is dropped.
    pub handshake_timeout: Duration,
    /// A connection with no request in flight and none arriving for this long is closed.
    pub idle_timeout: Option<Duration>,
    /// Bytes of request payload buffers all connections together may hold.
    pub buffer_budget: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            engine: Engine::Auto,
            loop_threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            pool_threads: 16,
            queue_depth: 128,
            workers_per_connection: 16,
            max_connections: 256,
            max_connections_per_client: 64,
            handshake_timeout: Duration::from_secs(30),
            idle_timeout: Some(Duration::from_secs(300)),
            buffer_budget: 256 << 20,
        }
    }
}

/// Open connections, in total and per client.
#[derive(Default)]
struct Counts {
    total: usize,
    per_client: HashMap<ClientKey, usize>,
}

#[derive(Clone)]
pub struct NbdServer {
    catalog: Arc<dyn ExportCatalog>,
    config: ServerConfig,
    counts: Arc<Mutex<Counts>>,
    budget: Arc<BufferBudget>,
    tls: Option<TlsServer>,
    /// The io_uring event loops; `None` serves with threads.
    loops: Option<Arc<Loops>>,
}

/// A connection's place in the counts, given back on drop: also when its thread panics.
struct Slot {
    counts: Arc<Mutex<Counts>>,
    key: ClientKey,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut counts = self.counts.lock();
        counts.total -= 1;
        if let Some(n) = counts.per_client.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                counts.per_client.remove(&self.key);
            }
        }
    }
}

impl NbdServer {
    /// A server with the engine `config` asks for; with `Engine::Auto`, io_uring event
    /// loops when io_uring works here (the log says which serves), threads otherwise.
    pub fn new(catalog: Arc<dyn ExportCatalog>, config: ServerConfig) -> std::io::Result<Self> {
        let budget = Arc::new(BufferBudget::new(config.buffer_budget));
        let loops = match config.engine {
            Engine::Threads => None,
            Engine::Auto | Engine::Uring => match Self::start_loops(&config, &budget) {
                Ok(loops) => Some(Arc::new(loops)),
                Err(why) if config.engine == Engine::Auto => {
                    warn!("nbd: {why}; serving with threads per connection instead");
                    None
                }
                Err(why) => return Err(std::io::Error::other(why)),
            },
        };
        let server = NbdServer {
            catalog,
            budget,
            config,
            counts: Arc::default(),
            tls: None,
            loops,
        };
        if server.loops.is_none() {
            info!("nbd: engine: {}", server.engine());
        }
        Ok(server)
    }

    /// Whether connections are served by io_uring event loops (or threads).
    pub fn on_io_uring(&self) -> bool {
        self.loops.is_some()
    }

    /// Which engine serves this server's connections, as `udm info` and the log name it.
    pub fn engine(&self) -> String {
        match &self.loops {
            Some(_) => format!(
                "io_uring ({} event loops, {} pool threads)",
                self.config.loop_threads.max(1),
                self.config.pool_threads.max(1)
            ),
            None => format!(
                "threads ({} per connection)",
                self.config.workers_per_connection
            ),
        }
    }

    fn start_loops(config: &ServerConfig, budget: &Arc<BufferBudget>) -> Result<Loops, String> {
        udm_uring::probe()?;
        let pool = Pool::new("nbd-pool", config.pool_threads);
        let loops = Loops::start(config, budget.clone(), pool)
            .map_err(|e| format!("cannot start the io_uring event loops: {e}"))?;
        info!(
            "nbd: engine: io_uring, {} event loops, {} pool threads, queue depth {} per connection",
            config.loop_threads.max(1),
            config.pool_threads.max(1),
            config.queue_depth.max(1)
        );
        Ok(loops)
    }

    /// This server for one listener: its own view of the exports and its own TLS, sharing
    /// the configuration and the connection limit.
    pub fn for_listener(&self, catalog: Arc<dyn ExportCatalog>, tls: Option<TlsServer>) -> Self {
        NbdServer {
            catalog,
            tls,
            ..self.clone()
        }
    }

    /// Connections attached to each event loop.
    #[cfg(test)]
    fn connections_per_loop(&self) -> Vec<usize> {
        self.loops.as_ref().map_or(Vec::new(), |l| l.connections())
    }

    /// Connections open now (in the handshake or transmission).
    #[cfg(test)]
    fn connections(&self) -> usize {
        self.counts.lock().total
    }

    /// Listens on a Unix socket (a stale socket is replaced; any other file is not).
    pub fn listen_unix(&self, path: &Path) -> std::io::Result<()> {
        remove_stale_socket(path)?;
        let listener = UnixListener::bind(path)?;
        info!("nbd: listening on unix:{}", path.display());
        let accept = move || listener.accept().map(|(s, _)| s);
        self.spawn_acceptor("nbd-accept-unix", accept, Stream::Unix)
    }

    /// Listens on TCP; returns the bound address (useful with port 0).
    pub fn listen_tcp(&self, addr: impl ToSocketAddrs) -> std::io::Result<std::net::SocketAddr> {
        let listener = TcpListener::bind(addr)?;
        let local = listener.local_addr()?;
        info!("nbd: listening on tcp:{local}");
        let accept = move || listener.accept().map(|(s, _)| s);
        self.spawn_acceptor("nbd-accept-tcp", accept, |s| {
            let _ = s.set_nodelay(true);
            Stream::Tcp(s)
        })?;
        Ok(local)
    }

    /// A thread named `name` that takes connections from `accept` (a listener's) for as long
    /// as the process lives; `stream` makes each one a [`Stream`].
    fn spawn_acceptor<S>(
        &self,
        name: &str,
        mut accept: impl FnMut() -> std::io::Result<S> + Send + 'static,
        stream: impl Fn(S) -> Stream + Send + 'static,
    ) -> std::io::Result<()> {
        let server = self.clone();
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || loop {
                match accept() {
                    Ok(s) => server.accept(stream(s)),
                    Err(e) => warn!("nbd: accept failed: {e}"),
                }
            })?;
        Ok(())
    }

    /// Counts the connection in, or says why it is refused.
    fn admit(&self, key: ClientKey) -> Result<Slot, String> {
        let mut counts = self.counts.lock();
        let from_client = counts.per_client.get(&key).copied().unwrap_or(0);
        if counts.total >= self.config.max_connections {
            return Err(format!(
                "too many connections: the server's limit of {} is reached",
                self.config.max_connections
            ));
        }
        if from_client >= self.config.max_connections_per_client {
            return Err(format!(
                "too many connections from {key}: the limit is {} per client",
                self.config.max_connections_per_client
            ));
        }
        counts.total += 1;
        *counts.per_client.entry(key.clone()).or_default() += 1;
        Ok(Slot {
            counts: self.counts.clone(),
            key,
        })
    }

    fn accept(&self, stream: Stream) {
        let key = match stream.client_key() {
            Ok(key) => key,
            Err(e) => return warn!("nbd: cannot tell who connected: {e}"),
        };
        let slot = match self.admit(key) {
            Ok(slot) => slot,
            Err(why) => return self.refuse(stream, why),
        };
        let server = self.clone();
        let spawned = std::thread::Builder::new()
            .name("nbd-conn".into())
            .spawn(move || server.connection(stream, slot));
        if let Err(e) = spawned {
            warn!("nbd: cannot start a connection thread: {e}");
        }
    }

    /// Answers a refused client's handshake with the reason (see `refusals`).
    fn refuse(&self, stream: Stream, why: String) {
        warn!("nbd: refusing a connection: {why}");
        refusals::refuse(stream, why.into());
    }

    fn connection(&self, mut stream: Stream, slot: Slot) {
        // A client that stops reading its replies must not hold workers forever.
        let _ = stream.set_write_timeout(Some(self.config.handshake_timeout));
        let tls = self.tls.as_ref();
        let upgrade = |s: &mut Deadline| tls.expect("offered only with TLS").upgrade(s.stream);
        let offer = tls.map(|t| StartTls {
            required: t.required(),
            upgrade: &upgrade,
        });
        let mut handshake = Deadline::new(&mut stream, self.config.handshake_timeout, "client");
        let negotiated = match negotiate_with_tls(&mut handshake, &*self.catalog, offer) {
            Ok(n) => n,
            Err(HandshakeEnd::Closed) => return,
            Err(HandshakeEnd::Violation(why)) => return warn!("nbd: handshake refused: {why}"),
            Err(HandshakeEnd::Io(e)) => return debug!("nbd: handshake ended: {e}"),
        };
        let name = negotiated.name.clone();
        debug!("nbd: client attached to '{name}'");
        if let Some(loops) = &self.loops {
            let slot = Box::new(slot);
            return loops.attach(Attach {
                stream,
                negotiated,
                slot,
            });
        }
        let _slot = slot;
        if let Err(e) = transmission::serve(stream, negotiated, &self.config, &self.budget) {
            warn!("nbd: connection to '{name}' failed: {e}");
        }
        debug!("nbd: client detached from '{name}'");
    }
}

/// The longest path a Unix socket address holds (sun_path's 108 bytes, less the NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// Checks that `path` fits in a Unix socket address, saying so in bytes when it does not (the
/// standard library's error names a C macro instead).
pub fn socket_path_fits(path: &Path) -> std::io::Result<()> {
    let len = path.as_os_str().len();
    if len <= MAX_SOCKET_PATH {
        return Ok(());
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!(
            "socket path {} is {len} bytes; a Unix socket path holds at most {MAX_SOCKET_PATH} \
             (use a shorter directory)",
            path.display()
        ),
    ))
}

/// Removes a leftover Unix socket at `path` so it can be bound again, refusing to delete
/// anything that is not a socket, or a socket some process still answers on; first checks
/// that the path fits in a socket address at all.
pub fn remove_stale_socket(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    socket_path_fits(path)?;
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    format!("{} is in use by a running server", path.display()),
                ));
            }
            std::fs::remove_file(path)
        }
        Ok(_) => Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            format!("{} exists and is not a socket", path.display()),
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ClientOptions, NbdClient};
    use std::io::{Read, Write};

    #[test]
    fn a_socket_path_too_long_is_refused_in_bytes() {
        let long = std::path::PathBuf::from(format!("/tmp/{}/s.sock", "d".repeat(120)));
        let e = remove_stale_socket(&long).unwrap_err().to_string();
        assert!(e.contains("at most 107"), "{e}");
        assert!(!e.contains("SUN_LEN"), "{e}");
        socket_path_fits(std::path::Path::new(&"x".repeat(107))).unwrap();
    }
    use std::path::PathBuf;
    use std::time::Instant;
    use udm_block::{BlockDevice, BlockError, WriteFlags};
    use udm_testkit::Devices;

    /// A device with a bug: reads at offset 0 panic.
    struct PanicsOnRead;

    impl BlockDevice for PanicsOnRead {
        fn size(&self) -> u64 {
            1 << 20
        }
        fn read(&self, offset: u64, buf: &mut [u8]) -> udm_block::Result<()> {
            assert!(offset != 0, "a bug in the target");
            buf.fill(1);
            Ok(())
        }
        fn write(&self, _: u64, _: &[u8], _: WriteFlags) -> udm_block::Result<()> {
            Ok(())
        }
        fn flush(&self) -> udm_block::Result<()> {
            Ok(())
        }
    }

    /// A server with `config` listening on a socket in a directory of its own (named after
    /// `tag`), exporting `exports`: (the directory, the socket, the server).
    fn serving(tag: &str, exports: &[&str], config: ServerConfig) -> (PathBuf, PathBuf, NbdServer) {
        let dir = std::env::temp_dir().join(format!("udm-nbd-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("nbd.sock");
        let catalog = Devices::default();
        for name in exports {
            catalog.add(name, Arc::new(PanicsOnRead), false);
        }
        let server = NbdServer::new(Arc::new(catalog), config).unwrap();
        server.listen_unix(&socket).unwrap();
        (dir, socket, server)
    }

    #[test]
    fn a_connection_goes_to_its_partys_loop_or_the_one_serving_the_fewest() {
        let config = ServerConfig {
            engine: Engine::Uring,
            loop_threads: 2,
            ..ServerConfig::default()
        };
        let (dir, socket, server) = serving("loops", &["vol", "other"], config);
        let connect = |export: &str| {
            let uri = format!("nbd+unix:///{export}?socket={}", socket.display());
            let client = NbdClient::connect(&uri, ClientOptions::default()).unwrap();
            // Served: attached to its loop.
            client.read(4096, &mut [0u8; 4096]).unwrap();
            client
        };
        let until = |want: Vec<usize>| {
            let deadline = Instant::now() + Duration::from_secs(5);
            while server.connections_per_loop() != want {
                let now = server.connections_per_loop();
                assert!(Instant::now() < deadline, "{now:?}, not {want:?}");
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        // This process is one client: its connections to one export (a multipath's paths)
        // share a loop, those to another export go to the other loop.
        let long = connect("vol");
        let path = connect("vol");
        until(vec![2, 0]);
        let short = connect("other");
        until(vec![2, 1]);
        // A probe comes and goes: the next long-lived connection still gets the idle loop.
        drop(short);
        until(vec![2, 0]);
        let other = connect("other");
        until(vec![2, 1]);
        drop((long, path, other));
        until(vec![0, 0]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_client_trickling_its_handshake_is_dropped_at_the_handshake_timeout() {
        let config = ServerConfig {
            handshake_timeout: Duration::from_secs(1),
            ..ServerConfig::default()
        };
        let (dir, socket, _server) = serving("trickle", &["vol"], config);
        let mut client = std::os::unix::net::UnixStream::connect(&socket).unwrap();
        client.read_exact(&mut [0u8; 18]).unwrap();
        client.write_all(&3u32.to_be_bytes()).unwrap();
        // An option of 100 bytes, sent a byte every 100 ms: each read gets one in time.
        let started = Instant::now();
        let head = [&b"IHAVEOPT"[..], &1u32.to_be_bytes(), &100u32.to_be_bytes()].concat();
        client.write_all(&head).unwrap();
        client
            .set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        while client.write_all(b"x").is_ok() {
            if matches!(client.read(&mut [0u8; 1]), Ok(0)) {
                break;
            }
            assert!(started.elapsed() < Duration::from_secs(5), "never dropped");
        }
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(900), "dropped after {took:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_panicking_request_gets_eio_and_its_connection_slot_comes_back() {
        panicking_request_with(Engine::Uring);
        panicking_request_with(Engine::Threads);
    }

    fn panicking_request_with(engine: Engine) {
        let config = ServerConfig {
            engine,
            max_connections: 1,
            ..ServerConfig::default()
        };
        let (dir, socket, server) = serving(&format!("panic-{engine:?}"), &["vol"], config);
        let uri = format!("nbd+unix:///vol?socket={}", socket.display());
        let options = ClientOptions {
            io_timeout: Duration::from_secs(5),
            ..ClientOptions::default()
        };
        for round in 0..2 {
            // The only slot must have come back for the second round to connect.
            let client = NbdClient::connect(&uri, options.clone())
                .unwrap_or_else(|e| panic!("round {round}: {e}"));
            let mut buf = vec![0u8; 4096];
            let err = client.read(0, &mut buf).unwrap_err();
            assert!(
                matches!(&err, BlockError::Io(m) if m.contains("a bug in the target")),
                "round {round}: {err}"
            );
            // The connection carries on.
            client.read(4096, &mut buf).unwrap();
            assert_eq!(buf, vec![1u8; 4096]);
            drop(client);
            let deadline = Instant::now() + Duration::from_secs(5);
            while server.connections() > 0 {
                assert!(Instant::now() < deadline, "round {round}: the slot leaked");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
