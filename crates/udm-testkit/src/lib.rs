//! What udm's tests share, so that each crate's tests say what they check and not how to set
//! it up. A dev-dependency only (and of the fuzzers' harness): nothing here is part of udm.
//!
//! - [`TempDir`]: a scratch directory removed on drop, with sparse disk images in it.
//! - [`Rng`], [`pattern`], [`pattern_file`]: deterministic data, different at every offset.
//! - [`Devices`]: block devices by name, as a catalog of exports and as a table resolver.
//! - [`Switchable`]: a memory device that fails, counts and calls back on command.
//! - [`conformance`]: what every device that stores data must do.
//! - [`CrashDevice`]: durable and volatile writes, and a power cut at any write; devices on
//!   one [`PowerSwitch`] lose power together.
//! - [`Mounted`]: a filesystem mounted so that its unmount is complete when a fsck follows.
//! - [`run_ok`], [`printed`]: the tools tests check against, run.
//! - [`Netns`]: network namespaces joined by links that can be cut, for servers on other
//!   "hosts".

pub mod conformance;
mod crash;
mod devices;
mod mounted;
mod netns;
mod pattern;
mod process;
mod switchable;
mod temp_dir;

pub use crash::{CrashDevice, PowerSwitch};
pub use devices::Devices;
pub use mounted::Mounted;
pub use netns::Netns;
pub use pattern::{pattern, pattern_file, Rng};
pub use process::{printed, run_ok};
pub use switchable::Switchable;
pub use temp_dir::TempDir;
