//! Metadata per TiB of mapped data, beside `thin_metadata_size`'s estimate, and the speed of
//! inserts and warm lookups. About a minute in release mode:
//! `cargo test --release -p udm-metadata --test thin_size -- --ignored --nocapture`.

use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use udm_block::{BlockDevice, MemoryDevice};
use udm_metadata::ThinMetadata;

const TIB: u64 = 1 << 40;
const MIB: f64 = (1 << 20) as f64;

fn tpt_estimate_mib(block_kib: u64) -> f64 {
    let out = Command::new("thin_metadata_size")
        .args([
            "-b",
            &format!("{block_kib}k"),
            "-s",
            "1t",
            "-m",
            "1",
            "-u",
            "m",
            "-n",
        ])
        .output()
        .expect("thin_metadata_size");
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

/// Metadata blocks in use (the kernel's status counts the commit reserve as used too).
fn in_use(meta: &ThinMetadata) -> u64 {
    let usage = meta.metadata_usage();
    usage.used - (usage.total / 10).min(4096)
}

/// A 1 TiB pool of which one device maps `1/part` (in order or at random), committing every
/// 64 Ki blocks as a running pool does; the metadata for all of it mapped, in MiB: what the
/// empty pool uses plus the trees, scaled up from the part.
fn fill(block_kib: u64, part: u64, random: bool) -> f64 {
    let nr = TIB / (block_kib << 10);
    let n = nr / part;
    let dev: Arc<dyn BlockDevice> = Arc::new(MemoryDevice::new(16 << 30));
    let mut meta = ThinMetadata::open(dev, (block_kib * 2) as u32, nr).unwrap();
    meta.create_thin(1).unwrap();
    meta.commit().unwrap();
    let empty = in_use(&meta);
    // A permutation of 0..n (n a power of two): multiplying by an odd constant.
    let order = |i: u64| {
        if random {
            i.wrapping_mul(0x9E37_79B9_7F4A_7C15) % n
        } else {
            i
        }
    };
    let start = Instant::now();
    for i in 0..n {
        let b = meta.alloc_data_block().unwrap().unwrap();
        meta.insert(1, order(i), b).unwrap();
        if i % 65_536 == 65_535 {
            meta.commit().unwrap();
        }
    }
    meta.commit().unwrap();
    let inserts = start.elapsed();
    let start = Instant::now();
    for i in 0..n {
        assert!(meta.lookup(1, order(i)).unwrap().is_some());
    }
    let lookups = start.elapsed();
    let trees = (in_use(&meta) - empty) * part;
    let mib = (empty + trees) as f64 * 4096.0 / MIB;
    eprintln!(
        "{block_kib} KiB blocks, {} writes, {n} mappings: {:.2} µs per insert, {:.3} µs per \
         warm lookup ({} disk reads); 1 TiB mapped would use {mib:.1} MiB of metadata",
        if random { "random" } else { "sequential" },
        inserts.as_secs_f64() * 1e6 / n as f64,
        lookups.as_secs_f64() * 1e6 / n as f64,
        meta.disk_reads(),
    );
    mib
}

#[test]
#[ignore]
fn metadata_per_tib_beside_thin_metadata_size() {
    // 2 Mi mappings each: all of a TiB in 512 KiB blocks, an eighth of one in 64 KiB blocks.
    for (block_kib, part) in [(512, 1), (64, 8)] {
        let estimate = tpt_estimate_mib(block_kib);
        let sequential = fill(block_kib, part, false);
        let random = fill(block_kib, part, true);
        eprintln!(
            "1 TiB mapped in {block_kib} KiB blocks: udm {sequential:.1} MiB (sequential \
             writes), {random:.1} MiB (random); thin_metadata_size -b {block_kib}k -s 1t -m 1: \
             {estimate:.1} MiB"
        );
        assert!(sequential <= estimate && random <= estimate);
    }
}

/// The pool's hot path: lookups of mapped blocks, warm, in order and at random.
#[test]
#[ignore]
fn warm_lookup_speed() {
    let n = 1u64 << 20;
    let dev: Arc<dyn BlockDevice> = Arc::new(MemoryDevice::new(1 << 30));
    let mut meta = ThinMetadata::open(dev, 128, n).unwrap();
    for id in 0..4 {
        meta.create_thin(id).unwrap();
    }
    for i in 0..n {
        let b = meta.alloc_data_block().unwrap().unwrap();
        meta.insert((i % 4) as u32, i / 4, b).unwrap();
    }
    meta.commit().unwrap();
    for random in [false, true] {
        let order = |i: u64| {
            if random {
                i.wrapping_mul(0x9E37_79B9_7F4A_7C15) % n
            } else {
                i
            }
        };
        for i in 0..n {
            meta.lookup((order(i) % 4) as u32, order(i) / 4)
                .unwrap()
                .unwrap();
        }
        let start = Instant::now();
        for _ in 0..3 {
            for i in 0..n {
                meta.lookup((order(i) % 4) as u32, order(i) / 4)
                    .unwrap()
                    .unwrap();
            }
        }
        eprintln!(
            "warm lookup, {}: {:.3} µs",
            if random { "random" } else { "in order" },
            start.elapsed().as_secs_f64() * 1e6 / (3 * n) as f64
        );
    }
}
