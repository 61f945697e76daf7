//! Replays every input in `fuzz/corpus/<target>/` (seeds, and every crash the fuzzers found,
//! kept as regression tests) through the checks, on stable Rust, in every test run.

use std::path::Path;

#[test]
fn every_corpus_input_passes_its_check() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    let mut replayed = 0;
    for (name, check) in udm_fuzz::TARGETS {
        let dir = root.join(name);
        let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries {
            let path = entry.unwrap().path();
            let data = std::fs::read(&path).unwrap();
            let result = std::panic::catch_unwind(|| check(&data));
            assert!(result.is_ok(), "{name}: {} fails its check", path.display());
            replayed += 1;
        }
    }
    assert!(
        replayed >= udm_fuzz::TARGETS.len() * 3,
        "only {replayed} corpus inputs"
    );
}
