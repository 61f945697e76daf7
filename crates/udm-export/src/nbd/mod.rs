//! The NBD server: fixed newstyle handshake, structured replies, `base:allocation`, and many
//! requests in flight per connection answered out of order.
//!
//! Each connection has a small pool of worker threads that take turns reading a request from
//! the socket, handle it, and write the reply under a writer lock (nbdkit's model): a request
//! at queue depth one is read, handled and answered by the same thread, and deeper queues keep
//! every worker busy without any hand-off.

pub mod protocol;

mod handshake;
mod server;
mod stream;
mod transmission;

pub use protocol::nbd_error;
pub use server::{NbdServer, ServerConfig};
pub use stream::Stream;
