//! End to end: the dmsetup-style verbs, table swaps under load, restarts, and the errors a
//! user sees for bad input.

mod clients;
#[path = "../common/mod.rs"]
mod common;
mod dmsetup;
mod errors;
mod stacks;
mod state;
mod tables;

use std::time::Duration;

use common::*;
