//! Listeners: accept connections on Unix and TCP sockets and give each its own threads.

use std::net::{TcpListener, ToSocketAddrs};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use log::{debug, info, warn};

use crate::handshake::{negotiate_with_tls, HandshakeEnd, StartTls};
use crate::stream::Stream;
use crate::tls::TlsServer;
use crate::transmission;
use crate::ExportCatalog;

#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Requests one connection can have in progress at once.
    pub workers_per_connection: usize,
    /// Connections beyond this are closed at once, so a flood cannot exhaust threads.
    pub max_connections: usize,
    /// A client that stalls in the handshake longer than this is dropped.
    pub handshake_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            workers_per_connection: 16,
            max_connections: 256,
            handshake_timeout: Duration::from_secs(30),
        }
    }
}

#[derive(Clone)]
pub struct NbdServer {
    catalog: Arc<dyn ExportCatalog>,
    config: ServerConfig,
    connections: Arc<AtomicUsize>,
    tls: Option<TlsServer>,
}

impl NbdServer {
    pub fn new(catalog: Arc<dyn ExportCatalog>, config: ServerConfig) -> Self {
        NbdServer {
            catalog,
            config,
            connections: Arc::new(AtomicUsize::new(0)),
            tls: None,
        }
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

    /// Listens on a Unix socket (a stale socket is replaced; any other file is not).
    pub fn listen_unix(&self, path: &Path) -> std::io::Result<()> {
        remove_stale_socket(path)?;
        let listener = UnixListener::bind(path)?;
        info!("nbd: listening on unix:{}", path.display());
        let server = self.clone();
        std::thread::Builder::new()
            .name("nbd-accept-unix".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    match stream {
                        Ok(s) => server.accept(Stream::Unix(s)),
                        Err(e) => warn!("nbd: accept failed: {e}"),
                    }
                }
            })?;
        Ok(())
    }

    /// Listens on TCP; returns the bound address (useful with port 0).
    pub fn listen_tcp(&self, addr: impl ToSocketAddrs) -> std::io::Result<std::net::SocketAddr> {
        let listener = TcpListener::bind(addr)?;
        let local = listener.local_addr()?;
        info!("nbd: listening on tcp:{local}");
        let server = self.clone();
        std::thread::Builder::new()
            .name("nbd-accept-tcp".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    match stream {
                        Ok(s) => {
                            let _ = s.set_nodelay(true);
                            server.accept(Stream::Tcp(s))
                        }
                        Err(e) => warn!("nbd: accept failed: {e}"),
                    }
                }
            })?;
        Ok(local)
    }

    fn accept(&self, stream: Stream) {
        let count = self.connections.fetch_add(1, Ordering::AcqRel) + 1;
        if count > self.config.max_connections {
            self.connections.fetch_sub(1, Ordering::AcqRel);
            warn!(
                "nbd: refusing a connection: {} already open",
                self.config.max_connections
            );
            return;
        }
        let server = self.clone();
        let spawned = std::thread::Builder::new()
            .name("nbd-conn".into())
            .spawn(move || {
                server.connection(stream);
                server.connections.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            self.connections.fetch_sub(1, Ordering::AcqRel);
            warn!("nbd: cannot start a connection thread: {e}");
        }
    }

    fn connection(&self, mut stream: Stream) {
        let _ = stream.set_read_timeout(Some(self.config.handshake_timeout));
        // A client that stops reading its replies must not hold workers forever.
        let _ = stream.set_write_timeout(Some(self.config.handshake_timeout));
        let tls = self.tls.as_ref();
        let upgrade = |s: &mut Stream| tls.expect("offered only with TLS").upgrade(s);
        let offer = tls.map(|t| StartTls {
            required: t.required(),
            upgrade: &upgrade,
        });
        let negotiated = match negotiate_with_tls(&mut stream, &*self.catalog, offer) {
            Ok(n) => n,
            Err(HandshakeEnd::Closed) => return,
            Err(HandshakeEnd::Violation(why)) => return warn!("nbd: handshake refused: {why}"),
            Err(HandshakeEnd::Io(e)) => return debug!("nbd: handshake ended: {e}"),
        };
        let _ = stream.set_read_timeout(None);
        let name = negotiated.name.clone();
        debug!("nbd: client attached to '{name}'");
        if let Err(e) = transmission::serve(stream, negotiated, self.config.workers_per_connection)
        {
            warn!("nbd: connection to '{name}' failed: {e}");
        }
        debug!("nbd: client detached from '{name}'");
    }
}

/// Removes a leftover Unix socket at `path` so it can be bound again, refusing to delete
/// anything that is not a socket.
pub fn remove_stale_socket(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(path),
        Ok(_) => Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            format!("{} exists and is not a socket", path.display()),
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}
