//! `udm` as a library: the control protocol spoken between the verbs and the daemon (also
//! fuzzed by `udm-fuzz`), and the daemon itself — the registry of devices, the suspend gate,
//! persistence, the control socket — so that each part can be tested on its own. The binary
//! (`main.rs`) is the command line only.

pub mod control;
pub mod daemon;
pub mod replication;
