//! Network namespaces of a test's own, to put servers on "other hosts": joined by veth pairs
//! with addresses that exist only inside them, links that can be cut, and everything deleted
//! on drop (deleting a namespace deletes its links), also when the test fails.

use std::process::{Command, Stdio};

/// A network namespace, deleted on drop. Processes started in it (`ip netns exec NAME …`)
/// must be ended by their owner first: a namespace lives on while a process is in it.
pub struct Netns {
    name: String,
}

/// Runs `ip ARGS…`; the error is its message.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run ip: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    ))
}

impl Netns {
    /// A fresh namespace named after the test and this process, with its loopback up; an
    /// error (to skip on) where namespaces cannot be made, e.g. without CAP_SYS_ADMIN.
    pub fn new(tag: &str) -> Result<Netns, String> {
        let name = format!("udm-{}-{tag}", std::process::id());
        // A namespace left by an earlier run that died (same pid, same tag) goes first.
        let _ = ip(&["netns", "del", &name]);
        ip(&["netns", "add", &name])?;
        let ns = Netns { name };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `ip ARGS…` inside the namespace.
    pub fn ip(&self, args: &[&str]) -> Result<(), String> {
        let mut all = vec!["-n", &self.name];
        all.extend_from_slice(args);
        ip(&all)
    }

    /// Joins this namespace and `other` with a veth pair: `here` = (interface, address/prefix)
    /// on this side, `there` on the other; both ends up.
    pub fn link(
        &self,
        here: (&str, &str),
        other: &Netns,
        there: (&str, &str),
    ) -> Result<(), String> {
        self.ip(&[
            "link",
            "add",
            here.0,
            "type",
            "veth",
            "peer",
            "name",
            there.0,
            "netns",
            &other.name,
        ])?;
        self.ip(&["addr", "add", here.1, "dev", here.0])?;
        other.ip(&["addr", "add", there.1, "dev", there.0])?;
        self.set_link(here.0, true)?;
        other.set_link(there.0, true)
    }

    /// Brings an interface of this namespace up or down (`ip link set … down` cuts a link:
    /// packets are dropped, connections are not told).
    pub fn set_link(&self, interface: &str, up: bool) -> Result<(), String> {
        self.ip(&["link", "set", interface, if up { "up" } else { "down" }])
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = ip(&["netns", "del", &self.name]) {
            eprintln!("{e}");
        }
    }
}
