//! dm-style tables of targets.
//!
//! A table line `START LEN TYPE ARGS…` becomes a [`Target`] through [`construct`]; a
//! [`Table`] is the contiguous list of them and is itself a [`udm_block::BlockDevice`]. Targets
//! reach the devices their arguments name through a [`Resolver`] the daemon supplies, so a
//! reference may be a file, a remote export or another udm device (stacking).

mod args;
mod filter;
mod pacing;
mod reference;
mod registry;
mod rendezvous;
mod runs;
mod table;
mod target;
mod timer;

mod clone;
mod delay;
mod dust;
mod error_target;
mod flakey;
mod linear;
mod log_writes;
mod multipath;
mod snapshot;
mod striped;
mod thin;
mod zero;

pub use args::Args;
pub use filter::{Filter, Filtered, Lower, OpKind};
pub use reference::Reference;
pub use registry::{construct, TARGET_TYPES};
pub use rendezvous::{device_key, Rendezvous};
pub use table::{Segment, Table, TableLine};
pub use target::{Resolver, Target, TargetContext, TargetError};
pub use thin::replica;
pub use thin::set_no_space_timeout;

#[cfg(test)]
pub(crate) mod testing;
