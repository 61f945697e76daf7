//! End to end across hosts: a multipath on host A over the TCP exports of udm daemons on hosts
//! B and C, each host a network namespace of the test's own joined to A by a veth link. B and
//! C export one disk (a file all three see, as two controllers reach one LUN). fio on A
//! verifies every write while B's server is killed and restarted, while B's link is cut, and
//! while both are gone with queueing on; no_path_retry bounds the wait; a clone on A hydrates
//! from the multipath while B is killed. Skipped (with a SKIPPED line) where network
//! namespaces cannot be made. `lost_writes`: a path's server that dies with writes it
//! acknowledged in a volatile cache makes the multipath's next flush fail.

mod across_hosts;
#[path = "../common/mod.rs"]
mod common;
mod lost_writes;
mod on_one_host;

use common::*;

const MIB: u64 = 1 << 20;

/// The state (`A` or `F`) and fail count of `path` in a multipath's status line: "F 1".
fn path_state(status: &str, path: &str) -> String {
    let words: Vec<&str> = status.split_whitespace().collect();
    let at = words
        .iter()
        .position(|w| *w == path)
        .unwrap_or_else(|| panic!("no path {path} in {status}"));
    format!("{} {}", words[at + 1], words[at + 2])
}
