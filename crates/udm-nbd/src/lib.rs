//! NBD for udm: the protocol's encoding, the server that exports udm devices, and the client
//! that makes a remote export a backend (a clone's source, for example).
//!
//! The server gives each connection a small pool of worker threads that take turns reading a
//! request from the socket, handle it, and write the reply under a writer lock (nbdkit's
//! model): a request at queue depth one is read, handled and answered by the same thread, and
//! deeper queues keep every worker busy without any hand-off. Every device is served through
//! [`udm_block::Checked`], so requests are validated in one place. Request payloads come from
//! one buffer budget shared by all connections, so memory stays bounded whatever clients send.
//!
//! TLS ([`TlsServer`]) is negotiated with NBD_OPT_STARTTLS; a relay thread then owns the TLS
//! session, and the connection's threads work on a plaintext socketpair as before.

pub mod protocol;
pub mod uri;

mod budget;
mod client;
mod commands;
mod event_loop;
pub mod handshake;
mod refusals;
mod server;
mod stall;
mod stream;
mod tls;
mod transmission;

pub use client::{ClientError, ClientOptions, NbdClient};
pub use protocol::nbd_error;
pub use server::{remove_stale_socket, socket_path_fits, Engine, NbdServer, ServerConfig};
pub use stream::Stream;
pub use tls::{TlsError, TlsMode, TlsServer};
pub use udm_block::{Export, ExportCatalog};
pub use uri::{NbdAddress, NbdUri, UriError};
