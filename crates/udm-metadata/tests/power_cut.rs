//! Every metadata format against a power cut at every write: after the cut the metadata
//! opens, everything committed before the cut is there, and nothing that was never written
//! appears.

mod tpt;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use udm_block::{BlockDevice, WriteFlags};
use udm_metadata::log::{EntryKind, LogReader, LogWriter, Op};
use udm_metadata::snapshot::layout::put_record;
use udm_metadata::snapshot::{ExceptionStore, Geometry, PersistentStore, Record, StoreError};
use udm_metadata::{CloneGeometry, CloneMetadata, ThinMetadata};
use udm_testkit::{CrashDevice, PowerSwitch, Rng, TempDir};

/// Runs `round(seed, cut_at)` for each seed with the power cut at write `first`, then at the
/// next, and so on until a round ends before its cut. `round` says whether the power was cut
/// (then it has checked what survived). Asserts that at least `at_least` cuts were checked.
fn at_every_write(
    what: &str,
    seeds: std::ops::Range<u64>,
    first: u64,
    at_least: usize,
    mut round: impl FnMut(u64, u64) -> bool,
) {
    let mut cuts = 0;
    for seed in seeds {
        for cut_at in first.. {
            if !round(seed, cut_at) {
                break;
            }
            cuts += 1;
        }
    }
    assert!(cuts >= at_least, "only {cuts} cut points exercised");
    eprintln!("{what}: {cuts} power-cut points checked");
}

#[test]
fn clone_metadata_survives_a_power_cut_at_every_write() {
    // 40,000 regions: several bitmap blocks per area, so commits write runs of blocks.
    let geometry = CloneGeometry {
        region_sectors: 8,
        target_sectors: 40_000 * 8,
    };
    // Several seeds: each tears the in-flight and unflushed writes differently.
    at_every_write("clone metadata", 0..5, 1, 200, |seed, cut_at| {
        let dev = Arc::new(CrashDevice::new(1 << 20, cut_at, cut_at * 31 + seed));
        let mut committed = BTreeSet::new();
        let mut ever_set = BTreeSet::new();
        let mut rng = Rng::new(cut_at);
        if let Ok(meta) = CloneMetadata::open(dev.clone(), geometry) {
            for _ in 0..20 {
                for _ in 0..(rng.below(50)) {
                    let first = rng.below(40_000);
                    let len = 1 + rng.below(8);
                    let range = first..(first + len).min(40_000);
                    ever_set.extend(range.clone());
                    meta.set_hydrated(range);
                }
                match meta.commit(&|| Ok(())) {
                    Ok(_) => committed = ever_set.clone(),
                    Err(_) => break,
                }
            }
        }
        if !dev.is_cut() {
            return false;
        }
        let image: Arc<dyn BlockDevice> = Arc::new(dev.after_power_cut());
        let reopened = CloneMetadata::open(image, geometry)
            .unwrap_or_else(|e| panic!("cut at write {cut_at}: metadata does not reopen: {e}"));
        for &r in &committed {
            assert!(
                reopened.is_hydrated(r),
                "cut at write {cut_at}: committed region {r} lost"
            );
        }
        let hydrated = reopened.hydrated_count();
        assert!(hydrated >= committed.len() as u64 && hydrated <= ever_set.len() as u64);
        for r in (0..40_000).step_by(97) {
            if reopened.is_hydrated(r) {
                assert!(
                    ever_set.contains(&r),
                    "cut at write {cut_at}: region {r} was never set"
                );
            }
        }
        true
    });
}

#[test]
fn the_write_log_survives_a_power_cut_at_every_write() {
    at_every_write("write log", 0..1, 1, 50, |_, cut_at| {
        let dev = Arc::new(CrashDevice::new(4 << 20, cut_at, cut_at + 7));
        // Every entry whose append was attempted (one in flight at the cut may still land),
        // and how many a flush made durable.
        let mut appended = Vec::new();
        let mut durable = 0;
        if let Ok(mut log) = LogWriter::create(dev.clone()) {
            for i in 0..60u64 {
                appended.push(i);
                let result = if i % 7 == 6 {
                    log.append(Op::Flush)
                } else {
                    let data = vec![i as u8; 512 * (1 + i as usize % 9)];
                    log.append(Op::Write {
                        offset: i * 4096,
                        data: &data,
                        fua: false,
                    })
                };
                if result.is_err() {
                    break;
                }
                if i % 7 == 6 {
                    durable = appended.len();
                }
            }
        }
        if !dev.is_cut() {
            return false;
        }
        let image: Arc<dyn BlockDevice> = Arc::new(dev.after_power_cut());
        let Ok(mut reader) = LogReader::open(image) else {
            assert_eq!(
                durable, 0,
                "cut at write {cut_at}: the log is gone after a flush"
            );
            return true;
        };
        let mut read = 0;
        // A power cut ends the log early at worst; it never makes it unreadable.
        while let Some((entry, data)) = reader
            .next_entry()
            .unwrap_or_else(|e| panic!("cut at {cut_at}: {e}"))
        {
            let i = appended
                .get(read)
                .copied()
                .unwrap_or_else(|| panic!("cut at {cut_at}: entry {read} never appended"));
            if entry.kind == EntryKind::Write {
                assert_eq!(entry.offset, i * 4096);
                assert!(
                    data.iter().all(|&b| b == i as u8),
                    "cut at {cut_at}: entry {read} data"
                );
            }
            read += 1;
        }
        assert!(
            read >= durable,
            "cut at write {cut_at}: {read} entries readable, {durable} were flushed"
        );
        true
    });
}

type ThinModel = BTreeMap<u32, BTreeMap<u64, u64>>;

/// One round of a thin pool's work: new devices, snapshots, deletes, writes (each to a new
/// data block, as the pool breaks sharing) and discards, decided by `rng` alone.
fn thin_round(
    meta: &mut ThinMetadata,
    model: &mut ThinModel,
    rng: &mut Rng,
    next_id: &mut u32,
) -> Result<(), udm_metadata::ThinError> {
    let ids: Vec<u32> = model.keys().copied().collect();
    let pick = |rng: &mut Rng| ids[rng.below(ids.len() as u64) as usize];
    match rng.below(6) {
        0 => {
            meta.create_thin(*next_id)?;
            model.insert(*next_id, BTreeMap::new());
            *next_id += 1;
        }
        1 => {
            let origin = pick(rng);
            meta.create_snap(*next_id, origin)?;
            model.insert(*next_id, model[&origin].clone());
            *next_id += 1;
        }
        2 if ids.len() > 2 => {
            let id = pick(rng);
            meta.delete(id)?;
            model.remove(&id);
        }
        _ => {}
    }
    let ids: Vec<u32> = model.keys().copied().collect();
    for _ in 0..40 {
        let id = ids[rng.below(ids.len() as u64) as usize];
        let vblock = rng.below(3000);
        if rng.below(5) == 0 {
            meta.remove(id, vblock)?;
            model.get_mut(&id).unwrap().remove(&vblock);
        } else {
            let b = meta.alloc_data_block()?.expect("data space");
            meta.insert(id, vblock, b)?;
            model.get_mut(&id).unwrap().insert(vblock, b);
        }
    }
    Ok(())
}

fn thin_view(meta: &mut ThinMetadata) -> ThinModel {
    tpt::udm_view(meta)
        .into_iter()
        .map(|(id, (_, maps))| (id, maps))
        .collect()
}

#[test]
fn thin_metadata_survives_a_power_cut_at_every_write() {
    // Long on purpose: the model of what must survive is built alongside the writes it checks; one loop per cut point.
    let scratch = TempDir::new("thin-powercut");
    let image_path = scratch.path("image");
    at_every_write(
        "thin metadata (with thin_check)",
        0..3,
        1,
        150,
        |seed, cut_at| {
            let dev = Arc::new(CrashDevice::new(2 << 20, cut_at, cut_at * 131 + seed));
            let mut rng = Rng::new(seed);
            // The last commit that returned, and the one in progress at the cut (which may
            // or may not have become durable).
            let mut committed = None;
            let mut attempted = ThinModel::new();
            if let Ok(mut meta) = ThinMetadata::open(dev.clone(), 128, 20_000) {
                committed = Some(ThinModel::new());
                let mut model = ThinModel::new();
                let mut next_id = 2;
                let started = meta.create_thin(1).map(|_| {
                    model.insert(1, BTreeMap::new());
                });
                if started.is_ok() {
                    for _ in 0..30 {
                        if thin_round(&mut meta, &mut model, &mut rng, &mut next_id).is_err() {
                            break;
                        }
                        attempted = model.clone();
                        if meta.commit().is_err() {
                            break;
                        }
                        committed = Some(model.clone());
                        // Now and then a metadata snapshot is taken or dropped (it changes
                        // no mapping; the next commit records it).
                        if rng.below(4) == 0 {
                            let toggled = match meta.held_root() {
                                Some(_) => meta.release_metadata_snap(),
                                None => meta.reserve_metadata_snap(),
                            };
                            if toggled.is_err() {
                                break;
                            }
                        }
                    }
                }
            }
            if !dev.is_cut() {
                return false;
            }
            let image: Arc<dyn BlockDevice> = Arc::new(dev.after_power_cut());
            let mut meta = ThinMetadata::open(image.clone(), 128, 20_000).unwrap_or_else(|e| {
                panic!("seed {seed}, cut at write {cut_at}: the pool does not reopen: {e}")
            });
            let found = thin_view(&mut meta);
            let ok = match &committed {
                // Cut before the format was durable: a new, empty pool.
                None => found.is_empty(),
                Some(c) => found == *c || found == attempted,
            };
            assert!(
                ok,
                "seed {seed}, cut at write {cut_at}: the pool is neither the last commit nor \
                 the one in progress"
            );
            tpt::save(image.as_ref(), &image_path);
            tpt::check(&image_path, &format!("seed {seed}, cut at write {cut_at}"));
            // The reopened pool takes more work, and stays clean.
            let mut model = found;
            if model.is_empty() {
                meta.create_thin(1).unwrap();
                model.insert(1, BTreeMap::new());
            }
            let mut next_id = 1000;
            thin_round(&mut meta, &mut model, &mut rng, &mut next_id).unwrap();
            meta.commit().unwrap();
            assert_eq!(thin_view(&mut meta), model);
            tpt::save(image.as_ref(), &image_path);
            tpt::check(
                &image_path,
                &format!("seed {seed}, cut at write {cut_at}, after more work"),
            );
            true
        },
    );
}

/// The data a snapshot saved for origin chunk `old` (4 KiB chunks).
fn saved_chunk(old: u64) -> Vec<u8> {
    let mut data = vec![0u8; 4096];
    Rng::new(old).fill(&mut data);
    data
}

/// Saves exceptions in batches (each chunk's data durable first, as the targets write it),
/// then merges them all back into an origin on the same power: after a cut at any write, the
/// store opens, and every origin chunk that was ever committed reads as its saved data, from the
/// COW device if its record survived or from the origin if a merge took it back.
#[test]
fn the_snapshot_store_survives_a_power_cut_at_every_write() {
    // Long on purpose: the model of what must survive is built alongside the writes it checks; one loop per cut point.
    const CHUNKS: u64 = 300; // more than one area of 256 records
    at_every_write("snapshot store", 0..3, 1, 1000, |seed, cut_at| {
        let power = PowerSwitch::new(cut_at);
        let cow = Arc::new(CrashDevice::on_power(2 << 20, power.clone(), seed + cut_at));
        let origin = Arc::new(CrashDevice::on_power(CHUNKS * 4096, power.clone(), seed));
        let mut committed = BTreeSet::new();
        let mut rng = Rng::new(cut_at * 7 + seed);
        let mut run = || -> Result<(), String> {
            let store = PersistentStore::open(cow.clone(), 8)
                .map_err(|e| e.to_string())?
                .store;
            let mut olds: Vec<u64> = (0..CHUNKS).collect();
            while !olds.is_empty() {
                let take = (1 + rng.below(24)).min(olds.len() as u64) as usize;
                let mut batch = Vec::new();
                for old in olds.drain(..take) {
                    let new = store.allocate().map_err(|e| e.to_string())?;
                    cow.write(new * 4096, &saved_chunk(old), WriteFlags { fua: true })
                        .map_err(|e| e.to_string())?;
                    batch.push(Record { old, new });
                }
                let ticket = store.submit(&batch).map_err(|e| e.to_string())?;
                store.wait(ticket).map_err(|e| e.to_string())?;
                committed.extend(batch.iter().map(|r| r.old));
            }
            loop {
                let batch = store
                    .merge_batch(1 + rng.below(40) as usize)
                    .map_err(|e| e.to_string())?;
                if batch.is_empty() {
                    return Ok(());
                }
                for r in &batch {
                    let mut data = vec![0u8; 4096];
                    cow.read(r.new * 4096, &mut data)
                        .map_err(|e| e.to_string())?;
                    origin
                        .write(r.old * 4096, &data, WriteFlags::default())
                        .map_err(|e| e.to_string())?;
                }
                origin.flush().map_err(|e| e.to_string())?;
                store.commit_merge(batch.len()).map_err(|e| e.to_string())?;
            }
        };
        let outcome = run();
        if !power.is_cut() {
            outcome.unwrap();
            return false;
        }
        let cow = Arc::new(cow.after_power_cut());
        let origin = origin.after_power_cut();
        let opened = PersistentStore::open(cow.clone(), 8).unwrap_or_else(|e| {
            panic!("seed {seed}, cut at write {cut_at}: the store does not open: {e}")
        });
        let records: HashMap<u64, u64> = opened.records.iter().map(|r| (r.old, r.new)).collect();
        for old in 0..CHUNKS {
            let mut data = vec![0u8; 4096];
            let from_cow = records.get(&old);
            match from_cow {
                Some(&new) => cow.read(new * 4096, &mut data).unwrap(),
                None => origin.read(old * 4096, &mut data).unwrap(),
            }
            if committed.contains(&old) || from_cow.is_some() {
                assert!(
                    data == saved_chunk(old),
                    "seed {seed}, cut at write {cut_at}: origin chunk {old} reads wrong \
                         data (from the {})",
                    if from_cow.is_some() {
                        "COW device"
                    } else {
                        "origin"
                    }
                );
            }
        }
        true
    });
}

/// A COW device used before: its areas past the first hold an older table's records (the
/// benchmarks and LVM blank only the header and area 0). Commits that fill area after area,
/// with a cut at every write: the store opens with every committed record and nothing else,
/// which holds only if each area is durably zero before the one before it is written full
/// (the zeroing a commit does ahead of time, or first).
#[test]
fn the_snapshot_store_never_exposes_a_stale_area_after_a_power_cut() {
    const RECORDS: u64 = 700; // areas 0 and 1 filled, area 2 begun
    let g = Geometry::new(8, 4 << 20);
    let mut stale = vec![0u8; 4 << 20];
    for area in 1..4 {
        let at = g.offset(g.area_chunk(area)) as usize;
        for i in 0..g.per_area() {
            let record = Record {
                old: (1 << 30) + area * 1000 + i,
                new: g.area_chunk(area) + 1 + i,
            };
            put_record(&mut stale[at..at + 4096], i, record);
        }
    }
    // From the second write: the first is the stale image, before the power can go.
    at_every_write(
        "snapshot store over a stale table",
        0..3,
        2,
        120,
        |seed, cut_at| {
            let cow = Arc::new(CrashDevice::new(4 << 20, cut_at, seed * 1000 + cut_at));
            cow.write(0, &stale, WriteFlags::default()).unwrap();
            cow.flush().unwrap();
            let mut submitted = HashMap::new();
            let mut committed = Vec::new();
            let mut rng = Rng::new(seed + cut_at);
            let mut run = || -> Result<(), StoreError> {
                let store = PersistentStore::open(cow.clone(), 8)?.store;
                let mut old = 0;
                while old < RECORDS {
                    let take = (1 + rng.below(30)).min(RECORDS - old);
                    let mut batch = Vec::new();
                    for _ in 0..take {
                        batch.push(Record {
                            old,
                            new: store.allocate()?,
                        });
                        submitted.insert(old, batch.last().unwrap().new);
                        old += 1;
                    }
                    store.wait(store.submit(&batch)?)?;
                    committed.extend(batch);
                }
                Ok(())
            };
            let outcome = run();
            if !cow.is_cut() {
                outcome.unwrap();
                return false;
            }
            let image: Arc<dyn BlockDevice> = Arc::new(cow.after_power_cut());
            let opened = PersistentStore::open(image, 8).unwrap_or_else(|e| {
                panic!("seed {seed}, cut at write {cut_at}: the store does not open: {e}")
            });
            assert!(
                opened.records.starts_with(&committed),
                "seed {seed}, cut at write {cut_at}: committed records lost"
            );
            for r in &opened.records {
                assert_eq!(
                    submitted.get(&r.old),
                    Some(&r.new),
                    "seed {seed}, cut at write {cut_at}: a record never submitted: {r:?}"
                );
            }
            true
        },
    );
}
