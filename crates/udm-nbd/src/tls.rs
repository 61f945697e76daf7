//! NBD over TLS: NBD_OPT_STARTTLS with x509 certificates, through rustls.
//!
//! A TLS session cannot be shared by the transmission phase's reader and writer threads the
//! way a socket can (one rustls state encrypts and decrypts both directions). So once the TLS
//! handshake is done, one relay thread owns the TLS session and the network socket, and
//! exchanges plaintext with the rest of the server through a socketpair: the handshake and
//! transmission code go on with an ordinary Unix stream, unchanged.

use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::debug;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig, ServerConnection};

use crate::stream::Stream;

/// qemu's and nbdkit's names for the files of a certificate directory.
pub const CA_CERT: &str = "ca-cert.pem";
pub const SERVER_CERT: &str = "server-cert.pem";
pub const SERVER_KEY: &str = "server-key.pem";

/// Plaintext held in the relay per direction before it stops reading more.
const RELAY_BUFFER: usize = 256 << 10;

/// How long the relay keeps delivering the last replies of a connection whose server side
/// has closed, when the stream had no write timeout of its own.
const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsMode {
    /// STARTTLS is offered; plaintext clients are served too (the spec's SELECTIVETLS).
    On,
    /// Every option but STARTTLS and ABORT is refused until TLS is up (FORCEDTLS).
    Require,
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{}: {why}", path.display())]
    File { path: PathBuf, why: String },
    #[error("TLS setup: {0}")]
    Setup(String),
}

/// The server side of NBD's TLS: its certificate, key and client policy.
#[derive(Clone)]
pub struct TlsServer {
    config: Arc<ServerConfig>,
    mode: TlsMode,
}

fn file_error(path: &Path, why: impl std::fmt::Display) -> TlsError {
    TlsError::File {
        path: path.to_path_buf(),
        why: why.to_string(),
    }
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_error(path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(path, e))?;
    if certs.is_empty() {
        return Err(file_error(path, "no PEM certificate in the file"));
    }
    Ok(certs)
}

impl TlsServer {
    /// Loads `server-cert.pem` (the certificate, then any intermediates) and `server-key.pem`
    /// from `dir`; with `verify_peer`, clients must present a certificate signed by a CA in
    /// `ca-cert.pem`.
    pub fn from_dir(dir: &Path, mode: TlsMode, verify_peer: bool) -> Result<TlsServer, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let chain = certificates(&dir.join(SERVER_CERT))?;
        let key_path = dir.join(SERVER_KEY);
        let key = PrivateKeyDer::from_pem_file(&key_path).map_err(|e| file_error(&key_path, e))?;
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Setup(e.to_string()))?;
        let builder = if verify_peer {
            let ca_path = dir.join(CA_CERT);
            let mut roots = RootCertStore::empty();
            for ca in certificates(&ca_path)? {
                roots.add(ca).map_err(|e| file_error(&ca_path, e))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| file_error(&ca_path, e))?;
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let config = builder
            .with_single_cert(chain, key)
            .map_err(|e| file_error(&key_path, format!("does not fit {SERVER_CERT}: {e}")))?;
        Ok(TlsServer {
            config: Arc::new(config),
            mode,
        })
    }

    pub fn required(&self) -> bool {
        self.mode == TlsMode::Require
    }

    /// Runs the TLS handshake on `stream` (within its timeouts), then hands the session to a
    /// relay thread and leaves `stream` as the plaintext end of a socketpair, with the same
    /// timeouts.
    pub(crate) fn upgrade(&self, stream: &mut Stream) -> io::Result<()> {
        let mut tls = ServerConnection::new(self.config.clone()).map_err(io::Error::other)?;
        while tls.is_handshaking() {
            if tls.complete_io(stream)? == (0, 0) {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
        let (relay_end, server_end) = UnixStream::pair()?;
        let (read_timeout, write_timeout) = (stream.read_timeout()?, stream.write_timeout()?);
        server_end.set_read_timeout(read_timeout)?;
        server_end.set_write_timeout(write_timeout)?;
        stream.set_nonblocking(true)?;
        relay_end.set_nonblocking(true)?;
        let net = std::mem::replace(stream, Stream::Unix(server_end));
        let mut relay = Relay {
            tls,
            net,
            local: relay_end,
            to_local: Vec::new(),
            from_local: Vec::new(),
            net_eof: false,
            local_eof: false,
            local_shut: false,
            drain_timeout: write_timeout.unwrap_or(DEFAULT_DRAIN_TIMEOUT),
        };
        std::thread::Builder::new()
            .name("nbd-tls".into())
            .spawn(move || relay.run())?;
        Ok(())
    }
}

/// Moves bytes between the network (TLS records) and the server's end of the socketpair
/// (plaintext), in both directions, on non-blocking sockets.
struct Relay {
    tls: ServerConnection,
    net: Stream,
    local: UnixStream,
    /// Decrypted, not yet passed to the server.
    to_local: Vec<u8>,
    /// From the server, not yet accepted by the TLS session.
    from_local: Vec<u8>,
    /// The client has closed its side: no more requests.
    net_eof: bool,
    /// The server has closed its side: no more replies.
    local_eof: bool,
    /// The server has been told there are no more requests.
    local_shut: bool,
    drain_timeout: Duration,
}

fn would_block(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    )
}

impl Relay {
    fn run(&mut self) {
        if let Err(e) = self.pump() {
            debug!("nbd tls: connection ended: {e}");
        }
        self.tls.send_close_notify();
        // Best effort: the close_notify goes out if the socket has room for it.
        let _ = self.tls.write_tls(&mut self.net);
        self.net.shutdown();
    }

    fn pump(&mut self) -> io::Result<()> {
        let mut buf = vec![0u8; 64 << 10];
        let mut draining_since: Option<Instant> = None;
        loop {
            let drained = self.decrypted()?;
            self.write_local()?;
            if self.net_eof && drained && self.to_local.is_empty() && !self.local_shut {
                // Every request has been passed on: the server sees the end of the stream.
                let _ = self.local.shutdown(std::net::Shutdown::Write);
                self.local_shut = true;
            }
            self.encrypt()?;
            self.write_net()?;
            if self.local_eof && self.from_local.is_empty() && !self.tls.wants_write() {
                return Ok(());
            }
            // (wants_read is false while decrypted plaintext waits: that is the back-pressure.)
            let net_in = !self.net_eof && self.tls.wants_read();
            let net_out = self.tls.wants_write();
            let local_in = !self.local_eof && self.from_local.is_empty();
            let local_out = !self.to_local.is_empty();
            let mut fds = [
                poll_fd(self.net.as_raw_fd(), net_in, net_out),
                poll_fd(self.local.as_raw_fd(), local_in, local_out),
            ];
            // Once the server side is gone, what is left is delivering its last replies;
            // a client that does not take them within the timeout is left.
            let timeout = if self.local_eof {
                let since = *draining_since.get_or_insert_with(Instant::now);
                let left = self.drain_timeout.saturating_sub(since.elapsed());
                if left.is_zero() {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the client stopped reading",
                    ));
                }
                left.as_millis().clamp(1, i32::MAX as u128) as i32
            } else {
                -1
            };
            // SAFETY: `fds` is a valid array of pollfd for the duration of the call.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if fds[0].revents != 0 && net_in {
                self.read_net()?;
            }
            if fds[1].revents != 0 && local_in {
                match self.local.read(&mut buf) {
                    Ok(0) => self.local_eof = true,
                    Ok(n) => self.from_local.extend_from_slice(&buf[..n]),
                    Err(e) if would_block(&e) => {}
                    // The server's end is gone: nothing more will come from it.
                    Err(_) => self.local_eof = true,
                }
            }
        }
    }

    fn read_net(&mut self) -> io::Result<()> {
        match self.tls.read_tls(&mut self.net) {
            Ok(0) => self.net_eof = true,
            Ok(_) => match self.tls.process_new_packets() {
                // close_notify: the client sends nothing more.
                Ok(state) => self.net_eof |= state.peer_has_closed(),
                Err(e) => {
                    // Send the alert that says why, then give up.
                    let _ = self.tls.write_tls(&mut self.net);
                    return Err(io::Error::new(io::ErrorKind::InvalidData, e));
                }
            },
            Err(e) if would_block(&e) => {}
            Err(e) => return Err(e),
        }
        Ok(())
    }

    /// Takes the plaintext the TLS session has decrypted, up to the relay's buffer; true when
    /// the session holds no more.
    fn decrypted(&mut self) -> io::Result<bool> {
        let mut chunk = [0u8; 16 << 10];
        while self.to_local.len() < RELAY_BUFFER {
            match self.tls.reader().read(&mut chunk) {
                // close_notify, and everything before it taken.
                Ok(0) => {
                    self.net_eof = true;
                    return Ok(true);
                }
                Ok(n) => self.to_local.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
                // The client closed without close_notify: what arrived is still passed on.
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                    self.net_eof = true;
                    return Ok(true);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(false)
    }

    fn write_local(&mut self) -> io::Result<()> {
        while !self.to_local.is_empty() {
            match self.local.write(&self.to_local) {
                Ok(n) => {
                    self.to_local.drain(..n);
                }
                Err(e) if would_block(&e) => break,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Hands the server's plaintext to the TLS session, as much as its buffer takes.
    fn encrypt(&mut self) -> io::Result<()> {
        while !self.from_local.is_empty() {
            let n = self.tls.writer().write(&self.from_local)?;
            if n == 0 {
                break;
            }
            self.from_local.drain(..n);
        }
        Ok(())
    }

    fn write_net(&mut self) -> io::Result<()> {
        while self.tls.wants_write() {
            match self.tls.write_tls(&mut self.net) {
                Ok(_) => {}
                Err(e) if would_block(&e) => break,
                Err(e) => return Err(e),
            }
            // Room freed in the session's buffer: take more of the server's plaintext.
            self.encrypt()?;
        }
        Ok(())
    }
}

fn poll_fd(fd: i32, read: bool, write: bool) -> libc::pollfd {
    let mut events = 0;
    if read {
        events |= libc::POLLIN;
    }
    if write {
        events |= libc::POLLOUT;
    }
    libc::pollfd {
        // A negative fd is skipped: a hang-up on a socket we have nothing to do with now
        // must not wake the loop over and over.
        fd: if events == 0 { -1 } else { fd },
        events,
        revents: 0,
    }
}
