//! Paths to another device: refused at table load, by `reinstate_path` and by the checker,
//! unless `no_path_identity_check` says the paths are one device whatever they look like.

use super::*;

/// Writes pattern `seed` over the first 4 KiB of `dev`, where a path's identity is read.
fn stamp(dev: &dyn BlockDevice, seed: u64) {
    dev.write(0, &pattern(4096, seed), WriteFlags::default())
        .unwrap();
}

/// The rig's routes a, b and c to one disk, and `other`: a device of the same size with
/// other content at its start (another export).
fn rig_with_other() -> (Rig, Arc<Switchable>) {
    let rig = Rig::new();
    stamp(&*rig.disk, 1);
    let other = Arc::new(Switchable::new(4 * MIB));
    stamp(&*other.inner, 2);
    rig.devices.add("other", other.clone(), false);
    (rig, other)
}

#[test]
fn a_path_to_another_device_is_refused_at_load_naming_both_paths() {
    let (rig, _other) = rig_with_other();
    let line = format!("0 {SECTORS} multipath 0 0 1 1 round-robin 0 2 1 a 1 other 1");
    let Err(refused) = build(&rig.devices, &line) else {
        panic!("a path to another device was accepted");
    };
    let refused = refused.to_string();
    assert!(
        refused.contains("'other'") && refused.contains("'a'"),
        "{refused}"
    );
    assert!(refused.contains("no_path_identity_check"), "{refused}");
    assert_eq!(refused.lines().count(), 1, "{refused}");
    // Another size is another device too.
    rig.devices
        .add("small", Arc::new(MemoryDevice::new(8 * MIB)), false);
    let line = format!("0 {SECTORS} multipath 0 0 1 1 round-robin 0 2 1 a 1 small 1");
    let refused = build(&rig.devices, &line).err().unwrap().to_string();
    assert!(refused.contains("8388608"), "{refused}");
    // The feature skips the check.
    let line = format!(
        "0 {SECTORS} multipath 1 no_path_identity_check 0 1 1 round-robin 0 2 1 a 1 other 1"
    );
    let table = build(&rig.devices, &line).unwrap();
    assert!(table.lines()[0].contains(" 1 no_path_identity_check 0 "));
}

#[test]
fn reinstating_a_path_that_now_leads_elsewhere_is_refused() {
    let rig = Rig::new();
    let other = Arc::new(Switchable::new(4 * MIB));
    rig.devices.add("other", other.clone(), false);
    // Both blank: alike at load.
    let (table, _) = rig.build("2 checker_interval 3600 0 1 1 round-robin 0 2 1 a 1 other 1");
    message(&table, "fail_path other").unwrap();
    stamp(&*rig.disk, 3);
    let refused = message(&table, "reinstate_path other").unwrap_err();
    assert!(
        refused.contains("'other'") && refused.contains("'a'"),
        "{refused}"
    );
    assert!(target(&table).status().ends_with("other F 1"));
    // Alike again (the same data written to both), it comes back.
    stamp(&*other.inner, 3);
    message(&table, "reinstate_path other").unwrap();
    assert!(target(&table).status().ends_with("other A 1"));
}

#[test]
fn the_checker_leaves_failed_a_path_that_now_leads_elsewhere() {
    let rig = Rig::new();
    let other = Arc::new(Switchable::new(4 * MIB));
    rig.devices.add("other", other.clone(), false);
    let (table, _) = rig.build("2 checker_interval 1 0 1 1 round-robin 0 2 1 a 1 other 1");
    other.fail_reads.store(true, Ordering::SeqCst);
    wait_for("the checker to fail other", || {
        target(&table).status().ends_with("other F 1")
    });
    stamp(&*rig.disk, 4);
    other.fail_reads.store(false, Ordering::SeqCst);
    // Two rounds of the checker see it answer, with other content.
    let reads = other.reads.load(Ordering::SeqCst);
    wait_for("two probes of other", || {
        other.reads.load(Ordering::SeqCst) >= reads + 2
    });
    assert!(target(&table).status().ends_with("other F 1"));
    stamp(&*other.inner, 4);
    wait_for("the checker to reinstate other", || {
        target(&table).status().ends_with("other A 1")
    });
}
