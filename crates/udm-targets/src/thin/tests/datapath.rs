//! Thin I/O: provisioning, zeroing, discards, racing first writes, external origins,
//! remapping onto the data file, and a random model check against a plain device.

use std::sync::Arc;

use udm_testkit::conformance;

use udm_block::{
    BlockDevice, FileDevice, MapOp, MemoryDevice, OpenMode, Place, WriteFlags, ZeroFlags,
    EXTENT_HOLE,
};

use super::*;

#[test]
fn a_thin_device_passes_the_conformance_suite() {
    let (rig, _pool) = pool_with_thin(256, "");
    let thin = rig.thin(8 * MIB, 1).unwrap();
    conformance::run_all(&thin);
}

#[test]
fn first_writes_allocate_and_zero_the_rest_of_the_block() {
    let (rig, pool) = pool_with_thin(64, "");
    // Garbage where blocks will be allocated: zeroing must hide it.
    write(&*rig.dev("data"), 0, &filled(64 * BLOCK, 0xee));
    let thin = rig.thin(16 * MIB, 1).unwrap();
    assert_eq!(
        read(&thin, 0, 2 * BLOCK),
        filled(2 * BLOCK, 0),
        "unprovisioned reads zero"
    );
    assert_eq!(rig.status(&thin), "0 -");
    write(&thin, BLOCK + 4 * KIB, &filled(4 * KIB, 7));
    let back = read(&thin, BLOCK, BLOCK);
    assert_eq!(back[..4096], filled(4 * KIB, 0)[..]);
    assert_eq!(back[4096..8192], filled(4 * KIB, 7)[..]);
    assert!(
        back[8192..].iter().all(|&b| b == 0),
        "the rest of the new block is zeroed"
    );
    assert_eq!(rig.status(&thin), "128 255");
    assert_eq!(rig.data_used(&pool), 1);
    // A second write to the block goes to the same block.
    write(&thin, BLOCK, &filled(4 * KIB, 8));
    assert_eq!(rig.data_used(&pool), 1);
    assert_eq!(read(&thin, BLOCK, 8 * KIB)[..4096], filled(4 * KIB, 8)[..]);
}

#[test]
fn skip_block_zeroing_leaves_what_was_on_the_data_device() {
    let (rig, _pool) = pool_with_thin(16, "1 skip_block_zeroing");
    write(&*rig.dev("data"), 0, &filled(16 * BLOCK, 0xee));
    let thin = rig.thin(MIB, 1).unwrap();
    write(&thin, 0, &filled(4 * KIB, 7));
    let back = read(&thin, 0, BLOCK);
    assert_eq!(back[..4096], filled(4 * KIB, 7)[..]);
    assert!(
        back[4096..].iter().all(|&b| b == 0xee),
        "no zeroing was asked for"
    );
}

#[test]
fn discards_unmap_whole_blocks_only() {
    let (rig, pool) = pool_with_thin(64, "");
    let thin = rig.thin(MIB, 1).unwrap();
    write(&thin, 0, &filled(4 * BLOCK, 5));
    assert_eq!(rig.data_used(&pool), 4);
    // Half of block 0, all of 1 and 2, a quarter of 3.
    thin.discard(BLOCK / 2, 2 * BLOCK + BLOCK / 4 + BLOCK / 2)
        .unwrap();
    assert_eq!(rig.data_used(&pool), 2);
    assert_eq!(read(&thin, 0, BLOCK), filled(BLOCK, 5));
    assert_eq!(read(&thin, BLOCK, 2 * BLOCK), filled(2 * BLOCK, 0));
    assert_eq!(read(&thin, 3 * BLOCK, BLOCK), filled(BLOCK, 5));
    let extents = thin.block_status(0, 4 * BLOCK).unwrap();
    let flags: Vec<_> = extents
        .iter()
        .map(|e| (e.len, e.flags & EXTENT_HOLE))
        .collect();
    assert_eq!(
        flags,
        vec![(BLOCK, 0), (2 * BLOCK, EXTENT_HOLE), (BLOCK, 0)]
    );
    // write_zeroes that may unmap frees whole blocks too.
    thin.write_zeroes(
        0,
        BLOCK,
        ZeroFlags {
            may_unmap: true,
            ..ZeroFlags::default()
        },
    )
    .unwrap();
    assert_eq!(rig.data_used(&pool), 1);
    assert_eq!(read(&thin, 0, BLOCK), filled(BLOCK, 0));
}

#[test]
fn ignore_discard_keeps_every_block() {
    let (rig, pool) = pool_with_thin(16, "1 ignore_discard");
    let thin = rig.thin(MIB, 1).unwrap();
    write(&thin, 0, &filled(BLOCK, 5));
    assert!(!thin.capabilities().discard);
    thin.discard(0, BLOCK).unwrap();
    assert_eq!(rig.data_used(&pool), 1);
    assert!(rig.status(&pool).contains(" ignore_discard "));
}

#[test]
fn writers_racing_for_one_new_block_share_one_allocation() {
    let (rig, pool) = pool_with_thin(64, "");
    let thin = rig.thin(MIB, 1).unwrap();
    std::thread::scope(|s| {
        for i in 0..16u64 {
            let thin = &thin;
            s.spawn(move || write(thin, i * 4 * KIB, &filled(4 * KIB, i as u8 + 1)));
        }
    });
    assert_eq!(rig.data_used(&pool), 1);
    let back = read(&thin, 0, BLOCK);
    for i in 0..16 {
        assert!(back[i * 4096..(i + 1) * 4096]
            .iter()
            .all(|&b| b == i as u8 + 1));
    }
}

#[test]
fn an_external_origin_fills_what_is_not_provisioned() {
    let (rig, _pool) = pool_with_thin(64, "");
    let origin = Arc::new(MemoryDevice::new(BLOCK + BLOCK / 2));
    origin
        .write(0, &filled(BLOCK + BLOCK / 2, 4), WriteFlags::default())
        .unwrap();
    rig.add("golden", origin);
    let thin = rig
        .build(
            "ext",
            &format!("0 {} thin {} 1 {{golden}}", 4 * BLOCK / 512, rig.name),
        )
        .unwrap();
    thin.resume();
    let mut expected = filled(4 * BLOCK, 0);
    expected[..(BLOCK + BLOCK / 2) as usize].fill(4);
    assert_eq!(
        read(&thin, 0, 4 * BLOCK),
        expected,
        "the origin, then zeroes past its end"
    );
    // A partial write into the block the origin half covers copies that half.
    write(&thin, BLOCK + 4 * KIB, &filled(4 * KIB, 8));
    expected[(BLOCK + 4 * KIB) as usize..(BLOCK + 8 * KIB) as usize].fill(8);
    assert_eq!(read(&thin, 0, 4 * BLOCK), expected);
    assert_eq!(rig.status(&thin), "128 255");
}

/// A pool of `blocks` blocks whose data device is a file in `dir` (which the hot path
/// remaps onto), with thin device 1.
fn pool_on_a_file(dir: &udm_testkit::TempDir, blocks: u64, features: &str) -> (Rig, Arc<Table>) {
    let path = dir.sparse("data.img", blocks * BLOCK);
    let rig = Rig::new(4 * MIB, MIB);
    rig.add(
        "data",
        Arc::new(FileDevice::open(&path, OpenMode::ReadWrite).unwrap()),
    );
    let pool = rig.pool(blocks * BLOCK / 512, &format!("128 0 {features}"));
    rig.message(&pool, "create_thin 1").unwrap();
    (rig, pool)
}

#[test]
fn provisioned_blocks_remap_onto_the_data_file() {
    let dir = udm_testkit::TempDir::new("thin-map");
    let (rig, pool) = pool_on_a_file(&dir, 16, "");
    rig.message(&pool, "create_thin 2").unwrap();
    let thin = rig.thin(MIB, 1).unwrap();
    let other = rig.thin(MIB, 2).unwrap();
    // Unprovisioned: a read is zeroes, a write is the pool's.
    let zeroes = thin.map(MapOp::Read, 0, 4096).unwrap();
    assert!(matches!(
        zeroes.pieces[..],
        [udm_block::Piece {
            place: Place::Zero,
            ..
        }]
    ));
    drop(zeroes);
    assert!(thin.map(MapOp::Write { fua: false }, 0, 4096).is_none());
    write(&other, 0, &filled(BLOCK, 1));
    write(&thin, 4096, &filled(4096, 2));
    assert!(
        thin.map(MapOp::Write { fua: true }, 4096, 4096).is_none(),
        "a FUA write waits for the commit of its block"
    );
    assert!(
        thin.map(MapOp::Flush, 0, 0).is_none(),
        "a flush must commit"
    );
    thin.flush().unwrap();
    let mapping = thin.map(MapOp::Write { fua: true }, 4096, 8192).unwrap();
    let pieces: Vec<_> = mapping
        .pieces
        .iter()
        .map(|p| match &p.place {
            Place::File { offset, .. } => (p.at, p.len, *offset),
            Place::Zero => panic!("a zero piece"),
        })
        .collect();
    // Thin block 0 is the pool's second block (the other device took the first).
    assert_eq!(pieces, vec![(0, 8192, BLOCK + 4096)]);
    assert!(thin.map(MapOp::Flush, 0, 0).is_some());
    // A write spilling onto an unprovisioned block is the pool's; a read maps both parts.
    assert!(thin
        .map(MapOp::Write { fua: false }, BLOCK - 4096, 8192)
        .is_none());
    let spill = thin.map(MapOp::Read, BLOCK - 4096, 8192).unwrap();
    assert!(matches!(spill.pieces[1].place, Place::Zero));
    drop(spill);
    drop(mapping);
    // Shared blocks: reads remap, writes do not.
    thin.suspend();
    rig.message(&pool, "create_snap 3 1").unwrap();
    thin.resume();
    assert!(thin.map(MapOp::Read, 0, 4096).is_some());
    assert!(thin.map(MapOp::Write { fua: false }, 0, 4096).is_none());
}

/// A FUA write is remapped only onto blocks whose mappings are committed: its completion
/// says it survives a crash, and a block mapped since the last commit does not. The write
/// that provisions the block races the FUA write's map(); a map() that took the pool for clean
/// before the block was allocated, and found the block once it was inserted (its thread
/// descheduled in between, on a loaded machine), let the FUA write complete onto a mapping a
/// crash would drop.
#[test]
fn a_fua_write_never_lands_on_a_mapping_provisioned_after_the_commit_check() {
    let dir = udm_testkit::TempDir::new("thin-fua-race");
    const BLOCKS: u64 = 2048;
    let (rig, _pool) = pool_on_a_file(&dir, BLOCKS, "1 skip_block_zeroing");
    let thin = rig.thin(BLOCKS * BLOCK, 1).unwrap();
    // Every block but the last provisioned (4 KiB each, unzeroed: quick) and committed; the
    // writer provisions the last each round. The FUA write spans them all, which gives the
    // race room: map() takes every block's cell before it looks any of them up.
    for block in 0..BLOCKS - 1 {
        write(&thin, block * BLOCK, &filled(4096, 1));
    }
    thin.flush().unwrap();
    let last = (BLOCKS - 1) * BLOCK;
    let fua = MapOp::Write { fua: true };
    for round in 0..200u64 {
        let provisioned = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                write(&thin, last, &filled(4096, 2));
                provisioned.store(true, std::sync::atomic::Ordering::Release);
            });
            while !provisioned.load(std::sync::atomic::Ordering::Acquire) {
                let Some(mapping) = thin.map(fua, 0, BLOCKS * BLOCK) else {
                    continue;
                };
                // Its blocks are held (the mapping holds their cells) and nothing else
                // writes: metadata left to commit is the last block's mapping.
                assert!(
                    thin.map(MapOp::Flush, 0, 0).is_some(),
                    "round {round}: a FUA write was remapped onto an uncommitted mapping"
                );
                drop(mapping);
            }
        });
        thin.discard(last, BLOCK).unwrap();
        thin.flush().unwrap();
    }
}

/// Random writes, zeroings (unmapping or not), discards, flushes and snapshots, on a thin
/// device and on a plain memory device side by side: every read must agree, and every
/// snapshot must still hold what the device held when it was taken (a discard of whole blocks reads
/// back as zeroes on a thin device without an origin, so the model zeroes those blocks).
/// It caught discard passdown punching a block that had been freed and allocated again in
/// the same transaction (mkfs.ext4 on a thin volume found it first).
#[test]
fn random_operations_read_back_as_on_a_plain_device() {
    let (rig, pool) = pool_with_thin(2048, "");
    let size = 8 * MIB;
    let thin = rig.thin(size, 1).unwrap();
    let model = MemoryDevice::new(size);
    let mut snapshots: Vec<(u32, Vec<u8>)> = Vec::new();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut random = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    for step in 0..3000 {
        let offset = random(size / 512) * 512;
        let len = ((random(4) + 1) * 512 * (1 + random(300))).min(size - offset);
        match random(10) {
            0..=5 => {
                let data = filled(len, (step % 250 + 1) as u8);
                write(&thin, offset, &data);
                write(&model, offset, &data);
            }
            6 | 7 => {
                let flags = ZeroFlags {
                    may_unmap: random(2) == 0,
                    ..ZeroFlags::default()
                };
                thin.write_zeroes(offset, len, flags).unwrap();
                model
                    .write_zeroes(offset, len, ZeroFlags::default())
                    .unwrap();
            }
            _ => {
                thin.discard(offset, len).unwrap();
                let first = offset.div_ceil(BLOCK);
                let end = offset + len;
                let last = if end == size {
                    end.div_ceil(BLOCK)
                } else {
                    end / BLOCK
                };
                for b in first..last.max(first) {
                    write(&model, b * BLOCK, &filled(BLOCK, 0));
                }
            }
        }
        if random(20) == 0 {
            thin.flush().unwrap();
        }
        if step % 100 == 99 {
            assert!(
                read(&thin, 0, size) == read(&model, 0, size),
                "step {step}: the thin device differs from the model"
            );
        }
        // Now and then a snapshot, which must keep what the device held then; some of them
        // are deleted again.
        if step % 500 == 250 {
            let id = 2 + step as u32 / 500;
            thin.suspend();
            rig.message(&pool, &format!("create_snap {id} 1")).unwrap();
            thin.resume();
            snapshots.push((id, read(&model, 0, size)));
            if snapshots.len().is_multiple_of(3) {
                let (gone, _) = snapshots.remove(0);
                rig.message(&pool, &format!("delete {gone}")).unwrap();
            }
        }
    }
    for (id, then) in &snapshots {
        let snap = rig.thin(size, *id).unwrap();
        assert!(read(&snap, 0, size) == *then, "snapshot {id} changed");
    }
}

#[test]
fn zeroing_part_of_an_unprovisioned_block_allocates_nothing() {
    let (rig, pool) = pool_with_thin(16, "");
    let thin = rig.thin(MIB, 1).unwrap();
    for may_unmap in [true, false] {
        let flags = ZeroFlags {
            may_unmap,
            ..ZeroFlags::default()
        };
        thin.write_zeroes(4 * KIB, BLOCK + 8 * KIB, flags).unwrap();
    }
    assert_eq!(rig.data_used(&pool), 0);
    // Part of a provisioned block is written with zeroes, and stays provisioned.
    write(&thin, 0, &filled(BLOCK, 3));
    thin.write_zeroes(
        4 * KIB,
        4 * KIB,
        ZeroFlags {
            may_unmap: true,
            ..ZeroFlags::default()
        },
    )
    .unwrap();
    assert_eq!(rig.data_used(&pool), 1);
    let mut expected = filled(BLOCK, 3);
    expected[4096..8192].fill(0);
    assert_eq!(read(&thin, 0, BLOCK), expected);
}
