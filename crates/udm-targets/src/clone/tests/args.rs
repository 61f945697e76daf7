//! The table line.

use super::*;

#[test]
fn constructor_checks_name_the_problem() {
    let resolver = switchables(&[
        ("meta", MIB),
        ("tiny", 4096),
        ("dest", 4 * MIB),
        ("small", MIB),
        ("source", 4 * MIB),
    ]);
    for (args, expected) in [
        ("meta dest source", "expected at least 4 arguments"),
        ("meta dest source 12", "invalid region size 12"),
        ("meta dest source 4", "invalid region size 4"),
        ("meta dest source 4194304", "invalid region size 4194304"),
        ("meta small source 8", "device 'small' has"),
        ("meta dest small 8", "device 'small' has"),
        ("tiny dest source 8", "metadata device too small"),
        (
            "meta dest source 8 1 bogus",
            "unsupported feature argument 'bogus'",
        ),
        (
            "meta dest source 8 4 no_hydration",
            "invalid number of feature arguments 4",
        ),
        (
            "meta dest source 8 0 3 hydration_threshold 4 x",
            "invalid number of core arguments 3",
        ),
        (
            // Pairs counted instead of words: the count of what follows says which.
            "meta dest source 8 0 1 hydration_threshold 4",
            "invalid number of core arguments 1 (2 follow)",
        ),
        (
            "meta dest source 8 0 2 hydration_batch_size 0",
            "invalid <hydration_batch_size> 0: must be at least 1",
        ),
        (
            "meta dest source 8 0 2 frob 1",
            "invalid core argument 'frob'",
        ),
        (
            "meta ghost source 8",
            "cannot open <destination dev> 'ghost'",
        ),
    ] {
        let text = format!("0 8192 clone {args}");
        let err = build_counting_events(&resolver, &text)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains(expected), "{args}: {err:?}");
    }
    // A valid line prints back exactly.
    let text = "0 8192 clone meta dest source 8 2 no_hydration no_discard_passdown 4 hydration_threshold 4 hydration_batch_size 2";
    let (table, _) = build_counting_events(&resolver, text).unwrap();
    assert_eq!(table.lines(), vec![text.to_string()]);
}
