//! The backends against the conformance suite. (Here and not beside them: the suite lives in
//! udm-testkit, which is built on this crate, and a unit test would see a second copy of the
//! `BlockDevice` trait.)

use udm_block::{FileDevice, MemoryDevice, OpenMode};
use udm_testkit::{conformance, TempDir};

#[test]
fn a_file_passes_the_conformance_suite() {
    let dir = TempDir::new("file-conformance");
    let path = dir.sparse("disk.img", 8 << 20);
    conformance::run_all(&FileDevice::open(&path, OpenMode::ReadWrite).unwrap());
}

#[test]
fn memory_passes_the_conformance_suite() {
    conformance::run_all(&MemoryDevice::new(8 << 20));
}
