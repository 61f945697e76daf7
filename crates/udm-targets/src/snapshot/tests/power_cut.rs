//! Power cuts at every write: the snapshot reads exactly what the origin held.

use super::*;

/// A power cut at every write, cutting the origin and the COW device at once: after it,
/// the snapshot reads exactly what the origin held when it was taken, and every origin write
/// that was flushed is there.
#[test]
fn a_power_cut_at_any_write_keeps_the_snapshot_exact() {
    const SIZE: u64 = 512 * 1024;
    let mut cuts = 0;
    let mut cut_at = 1;
    loop {
        // The first write (the origin's contents) is not one to cut at.
        let power = PowerSwitch::new(cut_at + 1);
        let seed = cut_at;
        let origin_dev = Arc::new(CrashDevice::on_power(SIZE, power.clone(), seed));
        origin_dev
            .write(0, &original(SIZE), WriteFlags { fua: true })
            .unwrap();
        let cow_dev = Arc::new(CrashDevice::on_power(
            4 * MIB,
            power.clone(),
            seed + 1_000_000,
        ));
        let rig = Rig::new(SIZE);
        rig.set_origin(origin_dev.clone());
        let cow = rig.add("cow", cow_dev.clone());
        let mut flushed: HashMap<u64, u64> = HashMap::new();
        let mut unflushed: Vec<(u64, u64)> = Vec::new();
        let mut x = cut_at | 1;
        let mut run = || -> Result<(), String> {
            let origin = rig.try_table("origin-dev", &format!("snapshot-origin {}", rig.origin))?;
            let _snap = rig.try_table("snap-dev", &format!("snapshot {} {cow} P 8", rig.origin))?;
            for i in 0..40u64 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let block = x % (SIZE / 4096);
                // A write in flight at the cut may land, in part.
                unflushed.push((block, 100 + i));
                origin
                    .write(block * 4096, &pattern(4096, 100 + i), WriteFlags::default())
                    .map_err(|e| e.to_string())?;
                if i % 5 == 4 {
                    origin.flush().map_err(|e| e.to_string())?;
                    flushed.extend(unflushed.drain(..));
                }
            }
            Ok(())
        };
        let outcome = run();
        if !power.is_cut() {
            outcome.unwrap();
            break;
        }
        cuts += 1;
        let after = Rig::new(SIZE);
        after.set_origin(Arc::new(origin_dev.after_power_cut()));
        let cow = after.add("cow", Arc::new(cow_dev.after_power_cut()));
        let snap = after
            .try_table("snap-dev", &format!("snapshot {} {cow} P 8", after.origin))
            .unwrap_or_else(|e| panic!("cut at write {cut_at}: the snapshot does not load: {e}"));
        assert!(
            read(&snap, 0, SIZE as usize)[..] == original(SIZE)[..],
            "cut at write {cut_at}: the snapshot changed"
        );
        let origin = read(&*after.device(&after.origin), 0, SIZE as usize);
        for (block, seed) in &flushed {
            let at = (*block * 4096) as usize;
            let newer = unflushed.iter().any(|(b, _)| b == block);
            assert!(
                newer || origin[at..at + 4096] == pattern(4096, *seed)[..],
                "cut at write {cut_at}: flushed origin block {block} lost"
            );
        }
        cut_at += 1;
    }
    assert!(cuts >= 100, "only {cuts} cut points");
    eprintln!("snapshot targets: {cuts} power-cut points checked");
}
