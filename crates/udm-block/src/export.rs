//! The interface between the device registry and the exports (NBD, FUSE): look a device up by
//! name, hold it open while a client uses it.

use std::any::Any;
use std::sync::Arc;

use crate::{BlockDevice, Extent, Result};

/// A device opened for a client. `open_guard` is held for as long as the client uses it, so
/// the registry can count opens and refuse to remove a device in use.
pub struct Export {
    pub device: Arc<dyn BlockDevice>,
    pub read_only: bool,
    pub description: String,
    pub open_guard: Box<dyn Any + Send + Sync>,
}

/// Where exports look devices up: the daemon's device registry.
pub trait ExportCatalog: Send + Sync {
    /// Opens the active device `name`, or `None` if there is none.
    fn open(&self, name: &str) -> Option<Export>;
    /// Names and descriptions of the devices a client may open.
    fn list(&self) -> Vec<(String, String)>;
    /// Meta context `context` of export `name` other than `base:allocation` (NBD block
    /// status), if the export offers it.
    fn meta_context(&self, _name: &str, _context: &str) -> Option<Arc<dyn MetaContext>> {
        None
    }
    /// The names of the meta contexts export `name` offers that start with `prefix`
    /// (`base:allocation` aside; some, where there are too many to list).
    fn meta_contexts(&self, _name: &str, _prefix: &str) -> Vec<String> {
        Vec::new()
    }
}

/// A meta context's answer to NBD block status: consecutive extents from `offset`, together
/// covering at least one byte and at most `len`, with the context's own flags.
pub trait MetaContext: Send + Sync {
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>>;
}
