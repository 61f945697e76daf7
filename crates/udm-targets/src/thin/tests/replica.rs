//! What replication asks of a live pool (`replica.rs`), raced against tables being made.

use std::sync::Barrier;

use udm_block::BlockError;

use super::*;
use crate::thin::replica;

/// A table made for the staging device while the receive publishes it must not end up on a
/// deleted device: either the table is refused (the device went) or the publish is (the
/// device is in use). Publishing holds the pool's users from its check to the end of the
/// change, as the pool's `delete` does. The window it closed is a few instructions wide, so
/// this races many rounds, the publish starting a little later each round.
#[test]
fn a_table_made_while_a_staging_device_is_published_is_refused_or_refuses_it() {
    let (rig, _pool) = pool_with_thin(64, "");
    let handle = replica::pool(&rig.name).unwrap();
    let mut both = Vec::new();
    for round in 0..4000u32 {
        let (staged, id) = (100 + 2 * round, 101 + 2 * round);
        handle.create_thin(staged).unwrap();
        let start = Barrier::new(2);
        let (published, table) = std::thread::scope(|s| {
            let publish = s.spawn(|| {
                start.wait();
                for _ in 0..round % 200 {
                    std::hint::spin_loop();
                }
                handle.publish(staged, id)
            });
            let table = s.spawn(|| {
                start.wait();
                rig.thin(BLOCK, staged)
            });
            (publish.join().unwrap(), table.join().unwrap())
        });
        match (published, table) {
            (Ok(()), Ok(_)) => both.push(round),
            (Ok(()), Err(_)) => handle.delete(id).unwrap(),
            (Err(_), table) => {
                drop(table);
                handle.delete(staged).unwrap();
            }
        }
    }
    assert!(
        both.is_empty(),
        "rounds where a table was made on a published (deleted) staging device: {both:?}"
    );
}

/// A staging device kept private to its receive's table, deleted by the pool's own `delete`
/// message (a user dropping a kept receive by hand): the id takes tables again once made
/// anew.
#[test]
fn a_private_device_deleted_by_message_is_private_no_more() {
    let (rig, pool) = pool_with_thin(64, "");
    let handle = replica::pool(&rig.name).unwrap();
    handle.create_thin(5).unwrap();
    handle.keep_private(5, ".receive-x-3", "the staging device of a receive");
    let refused = rig.thin(BLOCK, 5).err().unwrap().to_string();
    assert!(
        refused.contains("is the staging device of a receive"),
        "{refused}"
    );
    rig.message(&pool, "delete 5").unwrap();
    rig.message(&pool, "create_thin 5").unwrap();
    rig.thin(BLOCK, 5).unwrap();
}

/// A device held by a send takes read-only tables and other sends, no writable table, until
/// the last hold goes; a device a writable table uses is not held.
#[test]
fn a_device_held_by_a_send_takes_no_writable_table() {
    let (rig, _pool) = pool_with_thin(64, "");
    let handle = replica::pool(&rig.name).unwrap();
    handle.create_thin(5).unwrap();
    let first = handle.hold_sent(5, ".send-x-5-0").unwrap();
    let second = handle.hold_sent(5, ".send-x-5-1").unwrap();
    let refused = rig.thin(BLOCK, 5).err().unwrap().to_string();
    assert!(
        refused.contains("is being sent (.send-x-5-0, .send-x-5-1)"),
        "{refused}"
    );
    let reader = rig.thin_read_only(BLOCK, 5).unwrap();
    drop(first);
    assert!(rig.thin(BLOCK, 5).is_err(), "a send still holds it");
    drop((second, reader));
    let writer = rig.thin(BLOCK, 5).unwrap();
    let refused = handle
        .hold_sent(5, ".send-x-5-2")
        .err()
        .unwrap()
        .to_string();
    assert!(refused.contains("is used by"), "{refused}");
    drop(writer);
    handle.hold_sent(5, ".send-x-5-3").unwrap();
}

/// A send seals the device it sends (a metadata commit, no data block), so a pool out of
/// data space still sends; from then on a write over a block the device held as its own,
/// made in place before the seal, needs a new block, and fails at once for want of one.
#[test]
fn a_pool_out_of_data_space_seals_and_a_write_after_needs_a_new_block() {
    let (rig, pool) = pool_with_thin(2, "1 error_if_no_space");
    let thin = rig.thin(MIB, 1).unwrap();
    write(&thin, 0, &filled(2 * BLOCK, 1));
    let full = thin.write(2 * BLOCK, &filled(4 * KIB, 1), WriteFlags::default());
    assert!(matches!(full, Err(BlockError::NoSpace(_))), "{full:?}");
    assert!(rig.status(&pool).contains(" out_of_data_space "));
    write(&thin, 0, &filled(4 * KIB, 2));
    drop(thin);
    let handle = replica::pool(&rig.name).unwrap();
    handle.seal(1).unwrap();
    let newest = handle.newest_mapping_time(1).unwrap();
    assert!(handle.device(1).unwrap().is_sealed(newest));
    let thin = rig.thin(MIB, 1).unwrap();
    let unshared = thin.write(0, &filled(4 * KIB, 3), WriteFlags::default());
    assert!(
        matches!(unshared, Err(BlockError::NoSpace(_))),
        "{unshared:?}"
    );
    assert_eq!(read(&thin, 0, 4 * KIB), filled(4 * KIB, 2));
}
