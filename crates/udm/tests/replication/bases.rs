//! What a receive does to a base that tables use: a writable table on it is refused (the
//! snapshot of a base being written half holds its writes, and a written base is no longer
//! the snapshot it was received as), a replica kept mounted read-only is not.

use super::*;

/// The one-line error of a receive that must be refused, and that it changed no device.
fn refused(daemon: &Daemon, id: u32, stream: &[u8], what: &str) -> String {
    let before = devices(daemon);
    let out = receive(daemon, id, stream, &[]);
    let err = String::from_utf8_lossy(&out.stderr).trim_end().to_string();
    assert!(!out.status.success(), "{what}: received");
    assert_eq!(err.lines().count(), 1, "{what}: {err}");
    assert_eq!(devices(daemon), before, "{what}: the pool changed");
    err
}

#[test]
fn a_receive_onto_a_base_that_a_writable_table_uses_is_refused_a_read_only_one_is_kept() {
    let (a, b, b_pool) = two_daemons("live-base");
    let inc = base_received_and_increment(&a, &b, "write -P 0x61 0 2M", "write -P 0x62 1M 2M");
    let table = format!("0 {} thin pool 2", VOLUME / 512);
    b.udm(&["create", "base", "--table", &table]);
    let expected = "cannot snapshot the stream's base: thin device 2 of pool 'pool' is used by \
                    base, writable: remove it or load it read-only first (udm remove base)";
    let err = refused(&b, 3, &inc, "a live writable base");
    assert!(err.contains(expected), "{err}");
    // Suspended, it is still writable once resumed.
    b.udm(&["suspend", "base"]);
    let err = refused(&b, 3, &inc, "a suspended writable base");
    assert!(err.contains(expected), "{err}");
    b.udm(&["remove", "base"]);
    // Read-only, but with a writable table loaded to go live at the next resume.
    b.udm(&["create", "base", "--readonly", "--table", &table]);
    b.udm(&["load", "base", "--table", &table]);
    let err = refused(&b, 3, &inc, "a read-only base with a writable table loaded");
    assert!(err.contains(expected), "{err}");
    b.udm(&["clear", "base"]);
    // The replica mounted read-only stays while the next snapshot arrives onto it.
    succeeded(receive(&b, 3, &inc, &[]), "receive onto a read-only base");
    b.udm(&["remove", "base"]);
    same_snapshot(&a, &b, 2);
    same_snapshot(&a, &b, 3);
    thin_check(&b, &b_pool);
}

/// A base is the snapshot it was when it was sent and received: one written since on the
/// sender (then snapshotted, which makes a stream of no record at all, or not) or on the
/// receiver, through a table removed since, is refused, saying which side wrote it. Applied,
/// the increment would make a replica that differs from the source's snapshot.
#[test]
fn an_increment_from_a_base_written_since_it_was_sent_is_refused_on_either_side() {
    let (a, b, b_pool) = two_daemons("written-base");
    let full = first_snapshot_stream(&a, "write -P 0x6c 0 2M");
    succeeded(receive(&b, 2, &full, &[]), "full receive");
    written_through_a_table(&a, 2, "write -P 0x6d 1M 1M");
    a.udm(&["message", "pool", "0", "create_snap", "3", "2"]);
    snapshot(&a, 4);
    for (id, what) in [
        (3, "a snapshot of the base written on the sender"),
        (4, "a later snapshot of the volume"),
    ] {
        send_to_file(&a, id, Some(2), &a.dir.path("inc"));
        let err = refused(&b, id, &std::fs::read(a.dir.path("inc")).unwrap(), what);
        assert!(
            err.contains("the stream's base, snapshot 2 ")
                && err.contains("was written on the sender since it was sent"),
            "{what}: {err}"
        );
    }
    // The receiver's copy written: 4 received whole, written on b, then 5 from 4.
    send_to_file(&a, 4, None, &a.dir.path("four"));
    succeeded(
        receive(&b, 4, &std::fs::read(a.dir.path("four")).unwrap(), &[]),
        "full receive of 4",
    );
    written_through_a_table(&b, 4, "write -P 0x6e 3M 64k");
    snapshot(&a, 5);
    send_to_file(&a, 5, Some(4), &a.dir.path("inc"));
    let inc = std::fs::read(a.dir.path("inc")).unwrap();
    let err = refused(
        &b,
        5,
        &inc,
        "an increment onto a base written on the receiver",
    );
    assert!(
        err.contains("thin device 4 of pool 'pool', the stream's base")
            && err.contains("was written here since it was received"),
        "{err}"
    );
    thin_check(&b, &b_pool);
}

/// A base written in place since it was sent is refused like one written anew. dm-thin writes
/// a block in place when the device's mapping of it is newer than its last snapshot (its own,
/// written since): no new mapping, no new time, and a stamp that stays as it was. 21 was
/// written through a table after it was made, so it had such blocks when it was sent; 11 had
/// only blocks its volume has overwritten since (not shared any more, but older than 11's
/// snapshot time, so a write still breaks their sharing). Each is written again over those
/// blocks after it was sent, then snapshotted: the increment from it (no record at all) would
/// make that snapshot a copy of the base as the receiver holds it. The same on the receiver.
#[test]
fn an_increment_from_a_base_overwritten_in_place_since_it_was_sent_is_refused() {
    let (a, b, b_pool) = two_daemons("in-place-base");
    qemu_io_ok(&a.uri("vol"), &["write -P 0x91 0 2M"]);
    snapshot(&a, 11);
    snapshot(&a, 21);
    qemu_io_ok(&a.uri("vol"), &["write -P 0x92 0 2M"]);
    written_through_a_table(&a, 21, "write -P 0x93 1M 64k");
    for (base, overwrite) in [(11, "write -P 0x94 1M 64k"), (21, "write -P 0x95 1M 64k")] {
        let full = a.dir.path("full");
        send_to_file(&a, base, None, &full);
        succeeded(
            receive(&b, base, &std::fs::read(&full).unwrap(), &[]),
            "full receive",
        );
        same_snapshot(&a, &b, base);
        written_through_a_table(&a, base, overwrite);
        let next = base + 1;
        a.udm(&[
            "message",
            "pool",
            "0",
            "create_snap",
            &next.to_string(),
            &base.to_string(),
        ]);
        send_to_file(&a, next, Some(base), &a.dir.path("inc"));
        let what = format!("an increment from {base}, overwritten since it was sent");
        let err = refused(&b, next, &std::fs::read(a.dir.path("inc")).unwrap(), &what);
        assert!(
            err.contains(&format!("the stream's base, snapshot {base} "))
                && err.contains("was written on the sender since it was sent"),
            "{what}: {err}"
        );
    }
    // The receiver's copy is published sealed: overwritten there over blocks it maps, the
    // increment onto it is refused too.
    let full = first_snapshot_stream(&a, "write -P 0x96 0 2M");
    succeeded(receive(&b, 2, &full, &[]), "full receive of 2");
    written_through_a_table(&b, 2, "write -P 0x97 0 64k");
    snapshot(&a, 3);
    send_to_file(&a, 3, Some(2), &a.dir.path("inc"));
    let what = "an increment onto a base overwritten on the receiver";
    let err = refused(&b, 3, &std::fs::read(a.dir.path("inc")).unwrap(), what);
    assert!(
        err.contains("was written here since it was received"),
        "{err}"
    );
    thin_check(&b, &b_pool);
}

/// A send seals what it sends, which takes a metadata commit: a read-only pool still sends a
/// snapshot that needs no seal (not written since it was made), and refuses, in one line
/// saying why, to send one written since or an increment from it, rather than send it
/// unsealed; writable again, it sends it.
#[test]
fn a_read_only_pool_sends_sealed_snapshots_and_refuses_what_it_cannot_seal() {
    let (a, b, b_pool) = two_daemons("read-only-send");
    qemu_io_ok(&a.uri("vol"), &["write -P 0xa1 0 1M"]);
    snapshot(&a, 2);
    written_through_a_table(&a, 2, "write -P 0xa2 0 64k");
    snapshot(&a, 3);
    a.reload("pool", &pool_table(&a, "1 read_only"));
    send_to_file(&a, 3, None, &a.dir.path("three"));
    succeeded(
        receive(&b, 3, &std::fs::read(a.dir.path("three")).unwrap(), &[]),
        "a snapshot sent by a read-only pool",
    );
    same_snapshot(&a, &b, 3);
    for args in [
        &["send", "pool", "2"][..],
        &["send", "pool", "3", "--from", "2"],
    ] {
        let err = a.udm_err(args);
        assert!(
            err.contains(
                "cannot send thin device 2 of pool 'pool': it was written since it was last \
                 snapshotted"
            ) && err.contains("read-only"),
            "{args:?}: {err}"
        );
    }
    a.reload("pool", &pool_table(&a, ""));
    send_to_file(&a, 2, None, &a.dir.path("two"));
    succeeded(
        receive(&b, 2, &std::fs::read(a.dir.path("two")).unwrap(), &[]),
        "the snapshot sealed once the pool is writable",
    );
    same_snapshot(&a, &b, 2);
    thin_check(&b, &b_pool);
}

/// A received device deleted and its id made again is no base, although `create_thin` gives
/// the new device the pool's current time, which was the received device's creation time.
#[test]
fn a_received_device_deleted_and_its_id_made_again_is_no_base() {
    let (a, b, b_pool) = two_daemons("reused-base");
    let inc = base_received_and_increment(&a, &b, "write -P 0x71 0 2M", "write -P 0x72 3M 1M");
    b.udm(&["message", "pool", "0", "delete", "2"]);
    b.udm(&["message", "pool", "0", "create_thin", "2"]);
    let err = refused(&b, 3, &inc, "a base deleted and made again");
    assert!(err.contains("wrong base"), "{err}");
    thin_check(&b, &b_pool);
}

/// A pool is found by its device's name (thin tables, messages, send, receive, and the
/// replication state kept under it): renaming its device would leave it found by neither
/// name, so the rename is refused.
#[test]
fn a_pool_device_is_not_renamed_from_under_its_replicas() {
    let (a, b, _) = two_daemons("rename-pool");
    let full = first_snapshot_stream(&a, "write -P 0x81 0 1M");
    succeeded(receive(&b, 2, &full, &[]), "full receive");
    let err = b.udm_err(&["rename", "pool", "pool2"]);
    assert!(err.contains("thin-pool"), "{err}");
    // Still found under its name, with what it received.
    succeeded(receive(&b, 3, &full, &[]), "second receive");
    send_to_file(&b, 3, None, &b.dir.path("three"));
    let table = format!("0 {} thin pool 2", VOLUME / 512);
    b.udm(&["create", "replica", "--readonly", "--table", &table]);
}

/// A pool that skips zeroing new blocks leaves what its data device held in the part of a
/// block a write does not cover: with blocks larger than the stream's, the replica would read
/// that where the source reads zeroes. Refused; with blocks the stream's divide, received.
#[test]
fn a_pool_that_skips_zeroing_takes_only_streams_whose_blocks_cover_its_own() {
    let (a, b, _) = two_daemons("skip-zeroing");
    qemu_io_ok(
        &a.uri("vol"),
        &["write -P 0x91 0 64k", "write -P 0x92 3M 64k"],
    );
    snapshot(&a, 2);
    send_to_file(&a, 2, None, &a.dir.path("full"));
    let data = b.dir.path("big.data");
    std::fs::write(&data, vec![0xaa; 64 << 20]).unwrap();
    let pool = |name: &str, meta: &str, block_sectors: u32| {
        let table = format!(
            "0 {} thin-pool {} {} {block_sectors} 0 1 skip_block_zeroing",
            32 << 11,
            b.sparse(meta, 16 * MIB).display(),
            data.display()
        );
        b.udm(&["create", name, "--table", &table]);
    };
    pool("big", "big.meta", 2048);
    let out = Command::new(UDM)
        .args(["receive", "big", "2"])
        .env("UDM_CONTROL", b.control())
        .stdin(std::fs::File::open(a.dir.path("full")).unwrap())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "received into 1 MiB blocks");
    assert!(err.contains("skip_block_zeroing"), "{err}");
    b.udm(&["remove", "big"]);
    // The stream's 64 KiB blocks: every record covers whole blocks.
    pool("small", "small.meta", 128);
    let out = Command::new(UDM)
        .args(["receive", "small", "2"])
        .env("UDM_CONTROL", b.control())
        .stdin(std::fs::File::open(a.dir.path("full")).unwrap())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = format!("0 {} thin small 2", 4 * MIB / 512);
    b.udm(&["create", "replica", "--readonly", "--table", &table]);
    let table = format!("0 {} thin pool 2", 4 * MIB / 512);
    a.udm(&["create", "source", "--readonly", "--table", &table]);
    same_content(&a.uri("source"), &b.uri("replica"));
}

/// A snapshot being sent is not deleted from under the send, and the refusal says what holds
/// it (no device the user could remove).
#[test]
fn a_snapshot_being_sent_is_not_deleted_and_the_refusal_says_why() {
    let (a, _b, _) = two_daemons("delete-sent");
    qemu_io_ok(&a.uri("vol"), &["write -P 0xa1 0 64M"]);
    snapshot(&a, 2);
    // A reader that takes nothing: the send stops with its pipe full, holding the snapshot.
    let mut send = Command::new(UDM)
        .args(["send", "pool", "2"])
        .env("UDM_CONTROL", a.control())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(
        || a.udm(&["thin", "ls", "pool"]).contains(".send-"),
        "the send to hold the snapshot",
    );
    let err = a.udm_err(&["message", "pool", "0", "delete", "2"]);
    assert!(
        err.contains("thin device 2 is in use by a send or receive of udm's")
            && err.contains("wait for it to end"),
        "{err}"
    );
    send.kill().unwrap();
    let _ = send.wait();
    wait_for(
        || {
            a.run_udm(&["message", "pool", "0", "delete", "2"])
                .status
                .success()
        },
        "the delete once the send is gone",
    );
}

/// A snapshot being sent is not written until the send ends: a writable table on it, made
/// or loaded onto a read-only device of it, is refused naming the send; a read-only one is
/// served, and another send of it runs.
#[test]
fn a_snapshot_being_sent_takes_no_writable_table() {
    let (a, _b, _) = two_daemons("write-sent");
    qemu_io_ok(&a.uri("vol"), &["write -P 0xa2 0 64M"]);
    snapshot(&a, 2);
    let table = format!("0 {} thin pool 2", VOLUME / 512);
    a.udm(&["create", "reader", "--readonly", "--table", &table]);
    let mut send = Command::new(UDM)
        .args(["send", "pool", "2"])
        .env("UDM_CONTROL", a.control())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(
        || a.udm(&["thin", "ls", "pool"]).contains(".send-"),
        "the send to hold the snapshot",
    );
    for args in [
        &["create", "writer", "--table", &table][..],
        &["load", "reader", "--table", &table],
    ] {
        let err = a.udm_err(args);
        assert!(
            err.contains("thin device 2 of pool 'pool' is being sent (.send-pool-2-")
                && err.trim_end().lines().count() == 1,
            "{args:?}: {err}"
        );
    }
    a.udm(&["create", "peek", "--readonly", "--table", &table]);
    a.udm(&["remove", "peek"]);
    send_to_file(&a, 2, None, &a.dir.path("full"));
    send.kill().unwrap();
    let _ = send.wait();
    wait_for(
        || {
            a.run_udm(&["create", "writer", "--table", &table])
                .status
                .success()
        },
        "a writable table once the send is gone",
    );
}

/// A send is refused while a writable table is loaded on its snapshot to go live, even on a
/// device read-only until then: its resume would write under the send.
#[test]
fn a_snapshot_with_a_writable_table_loaded_is_not_sent() {
    let (a, _b, _) = two_daemons("loaded-writable");
    qemu_io_ok(&a.uri("vol"), &["write -P 0xa3 0 1M"]);
    snapshot(&a, 2);
    let table = format!("0 {} thin pool 2", VOLUME / 512);
    a.udm(&["create", "reader", "--readonly", "--table", &table]);
    a.udm(&["load", "reader", "--table", &table]);
    let err = a.udm_err(&["send", "pool", "2"]);
    assert!(
        err.contains("thin device 2 of pool 'pool' is used by reader, writable"),
        "{err}"
    );
    a.udm(&["clear", "reader"]);
    send_to_file(&a, 2, None, &a.dir.path("full"));
}

/// A pool a send reads or a receive writes is not removed from under them: they hold it as
/// a client does (the daemon's own tables on it are no device's, so nothing else counted).
#[test]
fn a_pool_is_not_removed_while_a_send_or_a_receive_uses_it() {
    let (a, b, _) = two_daemons("remove-pool");
    qemu_io_ok(&a.uri("vol"), &["write -P 0xb1 0 64M"]);
    snapshot(&a, 2);
    a.udm(&["remove", "vol"]);
    send_to_file(&a, 2, None, &a.dir.path("full"));
    let full = std::fs::read(a.dir.path("full")).unwrap();
    // A send whose reader takes nothing, and a receive whose stream stops half way.
    let mut send = Command::new(UDM)
        .args(["send", "pool", "2"])
        .env("UDM_CONTROL", a.control())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut receiving = spawn_receive(&b, 2, &[]);
    let mut stdin = receiving.stdin.take().unwrap();
    stdin.write_all(&full[..full.len() / 2]).unwrap();
    for (daemon, what) in [(&a, "send"), (&b, "receive")] {
        wait_for(
            || {
                daemon
                    .udm(&["thin", "ls", "pool"])
                    .contains(&format!(".{what}-"))
            },
            "the transfer to hold the pool",
        );
        let err = daemon.udm_err(&["remove", "pool"]);
        assert!(err.contains("is busy: open by 1 client"), "{what}: {err}");
    }
    send.kill().unwrap();
    let _ = send.wait();
    stdin.write_all(&full[full.len() / 2..]).unwrap();
    drop(stdin);
    succeeded(receiving.wait_with_output().unwrap(), "the receive");
    wait_for(
        || a.run_udm(&["remove", "pool"]).status.success(),
        "the removal once the send is gone",
    );
    b.udm(&["remove", "pool"]);
}

/// Removes `daemon`'s pool and makes it again under its name on zeroed metadata, a new pool,
/// with thin device 1 and snapshots of it at `snapshots`, in order: the n-th is made at the
/// pool's time n, as the old pool's devices were made at theirs.
fn pool_made_again(daemon: &Daemon, pool: &Pool, snapshots: &[u32]) {
    daemon.udm(&["remove", "pool"]);
    daemon.sparse("pool.meta", 16 * MIB);
    daemon.create("pool", &pool.table);
    daemon.udm(&["message", "pool", "0", "create_thin", "1"]);
    for id in snapshots {
        daemon.udm(&["message", "pool", "0", "create_snap", &id.to_string(), "1"]);
    }
}

/// The creation time of thin device `id` of the pool (what the replication state names it by).
fn creation_time(daemon: &Daemon, id: u32) -> Value {
    let devices = devices(daemon);
    let device = devices.as_array().unwrap().iter().find(|d| d["id"] == id);
    device.unwrap_or_else(|| panic!("no thin device {id}: {devices}"))["creation_time"].clone()
}

/// The pool's identity: the uuid in its metadata's superblock, in hex.
fn uuid_of(pool: &Pool) -> String {
    let superblock = std::fs::read(&pool.meta).unwrap();
    superblock[16..32]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A pool made again under its name on new metadata numbers its devices and times from the
/// start, as the old one did: its device 2, made at the time the received one was, is no base
/// for the next snapshot of the old one's replica (applied onto it, the increment would leave
/// a silently wrong replica). The old pool's state is kept aside, not taken for the new one's.
#[test]
fn a_pool_made_again_on_new_metadata_does_not_take_the_old_ones_replicas_for_its_own() {
    let (a, b, b_pool) = two_daemons("pool-again");
    let inc = base_received_and_increment(&a, &b, "write -P 0x65 0 2M", "write -P 0x66 1M 2M");
    let old = state(&b);
    pool_made_again(&b, &b_pool, &[2]);
    assert_eq!(creation_time(&b, 2), old["received"]["2"]["local_time"]);
    let err = refused(&b, 3, &inc, "an increment onto the new pool's device 2");
    assert!(err.contains("wrong base"), "{err}");
    // The new pool receives as any new pool does.
    let full = std::fs::read(a.dir.path("full")).unwrap();
    succeeded(
        receive(&b, 4, &full, &[]),
        "a full receive into the new pool",
    );
    assert_eq!(state(&b)["pool_uuid"], uuid_of(&b_pool).as_str());
    assert_ne!(state(&b)["pool_uuid"], old["pool_uuid"]);
    let aside = format!(
        "state/replication/pool.json.stale-{}",
        old["pool_uuid"].as_str().unwrap()
    );
    let kept: Value = serde_json::from_slice(&std::fs::read(b.dir.path(&aside)).unwrap()).unwrap();
    assert_eq!(kept, old, "the old pool's state, kept aside");
    thin_check(&b, &b_pool);
}

/// A receive kept for resuming into the old pool names its staging device by id and time:
/// the new pool's device of that id and time is neither kept from tables as that staging
/// device, nor deleted by the next receive into the id the kept one was into.
#[test]
fn a_kept_receive_of_an_old_pool_neither_hides_nor_deletes_a_device_of_the_new_one() {
    let (a, mut b, b_pool) = two_daemons("kept-again");
    increment_half_received(&a, &b, "write -P 0x67 0 1M", "write -P 0x68 8M 64M");
    let kept = state(&b)["partial"]["3"].clone();
    let staging = u32::try_from(kept["staging"].as_u64().unwrap()).unwrap();
    pool_made_again(&b, &b_pool, &[2, 4, staging]);
    assert_eq!(creation_time(&b, staging), kept["staging_time"]);
    // The daemon's next start reads the state again for the pool it restores.
    b.stop(libc::SIGTERM);
    b.launch();
    let table = format!("0 {} thin pool {staging}", VOLUME / 512);
    b.udm(&["create", "mine", "--readonly", "--table", &table]);
    b.udm(&["remove", "mine"]);
    send_to_file(&a, 3, None, &a.dir.path("three"));
    let three = std::fs::read(a.dir.path("three")).unwrap();
    succeeded(receive(&b, 3, &three, &[]), "a full receive into 3");
    assert_eq!(creation_time(&b, staging), kept["staging_time"]);
    thin_check(&b, &b_pool);
}

/// What [`uuid_of`] says of metadata without a uuid.
const NO_UUID: &str = "00000000000000000000000000000000";

/// Removes `daemon`'s pool and writes its metadata again with thin_dump and thin_restore,
/// which leave the uuid out: as udm left a pool's metadata before it gave pools an identity.
fn remade_without_uuid(daemon: &Daemon, pool: &Pool) {
    daemon.udm(&["remove", "pool"]);
    let (meta, xml) = (pool.meta.to_str().unwrap(), daemon.dir.path("pool.xml"));
    std::fs::write(&xml, tool("thin_dump", &[meta])).unwrap();
    tool("thin_restore", &["-i", xml.to_str().unwrap(), "-o", meta]);
    assert_eq!(uuid_of(pool), NO_UUID);
}

/// A pool and its state file from before pools had an identity (no uuid in the metadata, no
/// pool_uuid in the file): opened writable, the pool gets one, and the file is taken for its
/// own (the bases it records count) and names it.
#[test]
fn a_state_file_without_a_pool_identity_is_taken_for_the_open_pool() {
    let (a, b, b_pool) = two_daemons("legacy-state");
    let inc = base_received_and_increment(&a, &b, "write -P 0x69 0 1M", "write -P 0x6a 2M 1M");
    let mut legacy = state(&b);
    legacy.as_object_mut().unwrap().remove("pool_uuid");
    let file = b.dir.path("state/replication/pool.json");
    std::fs::write(file, legacy.to_string()).unwrap();
    remade_without_uuid(&b, &b_pool);
    b.create("pool", &b_pool.table);
    assert_ne!(uuid_of(&b_pool), NO_UUID);
    succeeded(
        receive(&b, 3, &inc, &[]),
        "an increment onto the base it records",
    );
    same_snapshot(&a, &b, 3);
    assert_eq!(state(&b)["pool_uuid"], uuid_of(&b_pool).as_str());
}

/// A pool whose metadata has no uuid (as thin_restore writes it) and that is opened read-only
/// cannot be told from an older pool of its name: receives into it are refused, saying so,
/// and its metadata is not written; opened writable, it gets its identity and receives.
#[test]
fn a_read_only_pool_without_a_uuid_takes_no_receive_until_opened_writable() {
    let (a, b, b_pool) = two_daemons("no-uuid");
    let full = first_snapshot_stream(&a, "write -P 0x6b 0 1M");
    remade_without_uuid(&b, &b_pool);
    b.create("pool", &format!("{} 1 read_only", b_pool.table));
    let err = refused(
        &b,
        2,
        &full,
        "a receive into a read-only pool without a uuid",
    );
    assert!(
        err.contains(
            "pool 'pool' has no identity yet: open it writable once before receiving into it"
        ),
        "{err}"
    );
    assert_eq!(
        uuid_of(&b_pool),
        NO_UUID,
        "a read-only pool's metadata was written"
    );
    b.reload("pool", &b_pool.table);
    assert_ne!(uuid_of(&b_pool), NO_UUID);
    succeeded(
        receive(&b, 2, &full, &[]),
        "a receive into the pool made writable",
    );
    assert_eq!(state(&b)["pool_uuid"], uuid_of(&b_pool).as_str());
}
