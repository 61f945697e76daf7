//! End to end across hosts: a multipath on host A over the TCP exports of udm daemons on hosts
//! B and C, each host a network namespace of the test's own joined to A by a veth link. B and
//! C export one disk (a file all three see, as two controllers reach one LUN). fio on A
//! verifies every write while B's server is killed and restarted, while B's link is cut, and
//! while both are gone with queueing on; no_path_retry bounds the wait; a clone on A hydrates
//! from the multipath while B is killed. Skipped (with a SKIPPED line) where network
//! namespaces cannot be made.

mod across_hosts;
#[path = "../common/mod.rs"]
mod common;
mod on_one_host;

use common::*;

const MIB: u64 = 1 << 20;
