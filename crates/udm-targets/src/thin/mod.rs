//! `thin-pool` and `thin`: the kernel's dm-thin, on dm-thin's own metadata format
//! ([`udm_metadata::thin`]), so thin-provisioning-tools work on udm's pools.
//!
//! A pool device holds a pool object ([`core::Pool`]): the metadata, a gate every thin
//! request passes, per-block cells, and the list of thin devices using it. Thin devices find
//! it by the pool device's name. Provisioned, unshared blocks are remapped straight onto the
//! data device; the first write to a block allocates it, a write to a shared block breaks
//! sharing, and FLUSH/FUA (and a timer, once a second) commit the metadata after flushing
//! the data device.

mod args;
mod cells;
mod core;
mod datapath;
mod device;
mod gate;
mod mapcache;
mod messages;
mod pool;
pub mod replica;
mod space;
mod status;
mod usage;

pub use device::construct as construct_thin;
pub use pool::construct as construct_pool;
pub use space::set_no_space_timeout;

#[cfg(test)]
mod tests;
