//! The parts of `udm` other programs use: the control protocol spoken between the verbs and
//! the daemon (and fuzzed by `udm-fuzz`).

pub mod control;
