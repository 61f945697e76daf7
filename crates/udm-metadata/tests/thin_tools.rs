//! udm's pool metadata judged by thin-provisioning-tools: after every commit `thin_check`
//! passes and `thin_dump` shows exactly what udm says is mapped.

mod tpt;

use std::collections::BTreeMap;

use tpt::{assert_dump_matches, check, Scratch};
use udm_metadata::ThinMetadata;

fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

#[test]
fn a_new_pool_passes_thin_check() {
    let scratch = Scratch::new("new");
    let (path, dev) = scratch.device("meta", 4 << 20);
    let mut meta = ThinMetadata::open(dev.clone(), 128, 1000).unwrap();
    check(&path, "after format");
    meta.create_thin(1).unwrap();
    for vb in 0..10 {
        let b = meta.alloc_data_block().unwrap().unwrap();
        meta.insert(1, vb, b).unwrap();
    }
    meta.commit().unwrap();
    check(&path, "after ten mappings");
    assert_dump_matches(&mut meta, &path, "ten mappings");
    drop(meta);
    let mut meta = ThinMetadata::open(dev, 128, 1000).unwrap();
    assert_eq!(meta.lookup(1, 3).unwrap().unwrap().data_block, 3);
    let _ = BTreeMap::<u8, u8>::new();
    let _ = next;
}
