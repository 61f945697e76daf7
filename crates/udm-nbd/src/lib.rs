//! NBD for udm: the protocol's encoding, the server that exports udm devices, and (with the
//! clone target) the client that makes a remote export a backend.
//!
//! The server gives each connection a small pool of worker threads that take turns reading a
//! request from the socket, handle it, and write the reply under a writer lock (nbdkit's
//! model): a request at queue depth one is read, handled and answered by the same thread, and
//! deeper queues keep every worker busy without any hand-off. Every device is served through
//! [`udm_block::Checked`], so requests are validated in one place.

pub mod protocol;
pub mod uri;

mod client;
mod handshake;
mod server;
mod stream;
mod transmission;

use std::any::Any;
use std::sync::Arc;

use udm_block::BlockDevice;

pub use client::{ClientError, ClientOptions, NbdClient};
pub use protocol::nbd_error;
pub use server::{NbdServer, ServerConfig};
pub use stream::Stream;
pub use uri::{NbdAddress, NbdUri, UriError};

/// A device opened for a client. `open_guard` is held for as long as the client uses it, so
/// the registry can count opens and refuse to remove a device in use.
pub struct Export {
    pub device: Arc<dyn BlockDevice>,
    pub read_only: bool,
    pub description: String,
    pub open_guard: Box<dyn Any + Send + Sync>,
}

/// Where the server looks devices up: the daemon's device registry.
pub trait ExportCatalog: Send + Sync {
    /// Opens the active device `name`, or `None` if there is none.
    fn open(&self, name: &str) -> Option<Export>;
    /// Names and descriptions of the devices a client may open.
    fn list(&self) -> Vec<(String, String)>;
}
