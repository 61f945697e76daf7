//! Hostile streams (cut, corrupt, reordered, on the wrong base) and a receiver killed mid-stream:
//! the replica stays as it was, and resumes.

use std::io::Read;

use super::*;

/// Copies of `stream` damaged one way each: (what, the copy, what the receiver must say).
fn damaged_copies(stream: &[u8]) -> [(&'static str, Vec<u8>, &'static str); 4] {
    let starts = record_starts(stream);
    assert!(starts.len() >= 5, "{} records", starts.len() - 1);
    let mut corrupt = stream.to_vec();
    corrupt[starts[1] + 28 + 1000] ^= 0x40;
    let reordered = [
        &stream[..starts[1]],
        &stream[starts[2]..starts[3]],
        &stream[starts[1]..starts[2]],
        &stream[starts[3]..],
    ]
    .concat();
    [
        ("a corrupt byte", corrupt, "checksum is wrong"),
        ("reordered records", reordered, "where record 1 belongs"),
        (
            "a cut stream",
            stream[..starts[2] + 100].to_vec(),
            "the stream is cut",
        ),
        (
            "no trailer",
            stream[..starts[starts.len() - 2]].to_vec(),
            "the stream is cut",
        ),
    ]
}

#[test]
fn cut_corrupt_truncated_reordered_and_wrong_base_streams_leave_the_replica_as_it_was() {
    let (a, b, b_pool) = two_daemons("hostile");
    qemu_io_ok(
        &a.uri("vol"),
        &["write -P 0x11 0 4M", "write -P 0x22 100M 2M"],
    );
    snapshot(&a, 2);
    qemu_io_ok(
        &a.uri("vol"),
        &["write -P 0x33 1M 3M", "discard 100M 1M", "write -z 200M 1M"],
    );
    snapshot(&a, 3);
    qemu_io_ok(&a.uri("vol"), &["write -P 0x44 50M 1M"]);
    snapshot(&a, 4);
    let dir = &a.dir;
    send_to_file(&a, 2, None, &dir.path("full"));
    send_to_file(&a, 3, Some(2), &dir.path("inc"));
    send_to_file(&a, 4, Some(3), &dir.path("inc2"));
    succeeded(
        receive(&b, 2, &std::fs::read(dir.path("full")).unwrap(), &[]),
        "full receive",
    );
    let inc = std::fs::read(dir.path("inc")).unwrap();
    let inc2 = std::fs::read(dir.path("inc2")).unwrap();
    let before = (devices(&b), state(&b));
    let damaged = damaged_copies(&inc);
    let mut cases: Vec<(&str, &[u8], &[&str], &str)> = damaged
        .iter()
        .map(|(what, stream, expected)| (*what, &stream[..], &[][..], *expected))
        .collect();
    // `cat inc inc2`, and the stream followed by 5 MiB of garbage.
    let appended = [&inc[..], &inc2].concat();
    let mut garbage = inc.clone();
    let urandom = std::fs::File::open("/dev/urandom").unwrap();
    urandom.take(5 << 20).read_to_end(&mut garbage).unwrap();
    let after_trailer = "after its trailer";
    cases.push(("another stream appended", &appended, &[], after_trailer));
    cases.push(("garbage appended", &garbage, &[], after_trailer));
    cases.push(("an unknown base", &inc2, &[], "wrong base"));
    cases.push(("the wrong base", &inc2, &["--base", "2"], "wrong base"));
    for (what, stream, args, expected) in cases {
        let out = receive(&b, 3, stream, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{what}: received");
        assert!(err.contains(expected), "{what}: {err}");
        assert_eq!(
            (devices(&b), state(&b)),
            before,
            "{what}: the replica changed"
        );
    }
    thin_check(&b, &b_pool);
    same_snapshot(&a, &b, 2);
    // The good stream still applies; then the next one onto it.
    succeeded(receive(&b, 3, &inc, &[]), "incremental receive");
    succeeded(receive(&b, 4, &inc2, &[]), "second incremental receive");
    same_snapshot(&a, &b, 3);
    same_snapshot(&a, &b, 4);
    // Two receives of one stream at once, into two new devices: each gets its own staging.
    let (b_ref, inc2) = (&b, &inc2);
    std::thread::scope(|s| {
        let twins = [5, 6].map(|id| s.spawn(move || receive(b_ref, id, inc2, &["--base", "3"])));
        for twin in twins {
            succeeded(twin.join().unwrap(), "concurrent receive");
        }
    });
    // Into the highest id, where the staging devices go (a staging device of that very id
    // used to make the publish fail once the whole stream had arrived).
    let highest = 16_777_215;
    succeeded(
        receive(&b, highest, inc2, &["--base", "3"]),
        "receive into the highest id",
    );
    for twin in [5, 6, highest] {
        with_thin(&b, "twin", twin, || {
            with_thin(&b, "four", 4, || {
                same_content(&b.uri("twin"), &b.uri("four"))
            })
        });
    }
    thin_check(&b, &b_pool);
}

/// A kept receive continues only its own stream: the snapshot written on the sender since
/// (its name the same, its records others) is refused at the header, the kept records stay,
/// and a receive without --resume starts again.
#[test]
fn a_kept_receive_refuses_at_the_header_a_stream_whose_source_changed() {
    let (a, b, b_pool) = two_daemons("changed-source");
    let full = first_snapshot_stream(&a, "write -P 0x5d 0 32M");
    let cut = receive(&b, 2, &full[..full.len() / 2], &["--resume"]);
    assert!(!cut.status.success());
    let kept = state(&b)["partial"]["2"].clone();
    assert!(kept["next_record"].as_u64().unwrap() > 0, "{kept}");
    written_through_a_table(&a, 2, "write -P 0x5e 0 96M");
    send_to_file(&a, 2, None, &a.dir.path("again"));
    let again = std::fs::read(a.dir.path("again")).unwrap();
    let out = receive(&b, 2, &again, &["--resume"]);
    let err = String::from_utf8_lossy(&out.stderr).trim_end().to_string();
    assert!(!out.status.success(), "the changed stream was received");
    assert!(
        err.contains("changed since the kept receive into thin device 2 began")
            && err.contains("a receive without --resume starts again")
            && err.lines().count() == 1,
        "{err}"
    );
    assert_eq!(state(&b)["partial"]["2"], kept, "the kept receive changed");
    succeeded(receive(&b, 2, &again, &[]), "a receive without --resume");
    same_snapshot(&a, &b, 2);
    thin_check(&b, &b_pool);
}

/// A stream starts at most at its trailer (after its last record): a start past it is
/// refused by the sender, naming how many records there are.
#[test]
fn a_send_from_past_its_last_record_is_refused_naming_the_record_count() {
    let (a, _b, _) = two_daemons("resume-past");
    let full = first_snapshot_stream(&a, "write -P 0x5f 0 3M");
    // The starts of the records and the trailer, and the end.
    let records = record_starts(&full).len() as u64 - 2;
    for past in [records + 1, u64::MAX] {
        let err = a.udm_err(&["send", "pool", "2", "--resume-at", &past.to_string()]);
        assert!(
            err.contains(&format!("at record {past}: it has {records} records")),
            "{err}"
        );
    }
    let at_trailer = a.run_udm(&["send", "pool", "2", "--resume-at", &records.to_string()]);
    assert!(at_trailer.status.success(), "{at_trailer:?}");
}

#[test]
fn a_receiver_killed_mid_stream_keeps_its_pool_and_resumes() {
    let (a, mut b, b_pool) = two_daemons("kill");
    let big = base_received_and_increment(&a, &b, "write -P 0x51 0 1M", "write -P 0x52 8M 192M");
    // Half the stream, then wait for progress to be durable, then kill -9.
    let mut child = spawn_receive(&b, 3, &["--resume"]);
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(&big[..big.len() / 2]).unwrap();
    wait_for(
        || kept_records(&b, 3) > 0,
        "durable progress of the receive",
    );
    // A staging device being written is no snapshot to send.
    let staging = state(&b)["partial"]["3"]["staging"].to_string();
    let err = b.udm_err(&["send", "pool", &staging]);
    assert!(err.contains("staging device of a receive"), "{err}");
    b.stop(libc::SIGKILL);
    drop(stdin);
    let _ = child.wait();
    b.launch();
    thin_check(&b, &b_pool);
    same_snapshot(&a, &b, 2);
    assert!(b
        .udm_err(&["thin", "delta", "pool", "2", "3"])
        .contains("does not exist"));
    // The whole stream again: what the receiver kept is skipped.
    let summary = succeeded(receive(&b, 3, &big, &["--resume"]), "resumed receive");
    assert!(summary["resumed_from"].as_u64().unwrap() > 0, "{summary}");
    same_snapshot(&a, &b, 3);
    thin_check(&b, &b_pool);
    assert!(state(&b)["partial"].as_object().unwrap().is_empty());
}

#[test]
fn a_receive_without_resume_whose_daemon_was_killed_leaves_nothing_after_the_restart() {
    let (a, mut b, b_pool) = two_daemons("kill-noresume");
    let big = base_received_and_increment(&a, &b, "write -P 0x53 0 1M", "write -P 0x54 8M 192M");
    let before = devices(&b);
    let mut child = spawn_receive(&b, 3, &[]);
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(&big[..big.len() / 2]).unwrap();
    wait_for(|| kept_records(&b, 3) > 0, "progress of the receive");
    b.stop(libc::SIGKILL);
    drop(stdin);
    let _ = child.wait();
    b.launch();
    // Nobody asked to keep it: its staging device (and the space it holds) goes.
    assert_eq!(devices(&b), before, "the killed receive left a device");
    assert!(state(&b)["partial"].as_object().unwrap().is_empty());
    thin_check(&b, &b_pool);
    same_snapshot(&a, &b, 2);
}

#[test]
fn the_staging_device_of_a_kept_receive_takes_no_table() {
    let (a, b, b_pool) = two_daemons("staging-table");
    let inc = increment_half_received(&a, &b, "write -P 0x55 0 1M", "write -P 0x56 8M 64M");
    // A table there would write into the replica under the records kept, or stop the
    // publish: refused, writable or not.
    let staging = state(&b)["partial"]["3"]["staging"].to_string();
    let table = format!("0 {} thin pool {staging}", VOLUME / 512);
    for args in [
        &["create", "peek", "--table", &table][..],
        &["create", "peek", "--readonly", "--table", &table],
    ] {
        let err = b.udm_err(args);
        assert!(
            err.contains(&format!(
                "thin device {staging} of pool 'pool' is the staging device of a receive"
            )),
            "{args:?}: {err}"
        );
    }
    // Nor is it a snapshot to send (half of one).
    let err = b.udm_err(&["send", "pool", &staging]);
    assert!(err.contains("the staging device of a receive"), "{err}");
    succeeded(receive(&b, 3, &inc, &["--resume"]), "resumed receive");
    same_snapshot(&a, &b, 3);
    // Published, the id is free for tables again like any other.
    b.udm(&["message", "pool", "0", "create_thin", &staging]);
    b.udm(&["create", "peek", "--table", &table]);
    b.udm(&["remove", "peek"]);
    thin_check(&b, &b_pool);
}

#[test]
fn a_staging_device_that_cannot_be_deleted_stays_named_until_it_can() {
    let (a, mut b, b_pool) = two_daemons("undeletable-staging");
    let full = first_snapshot_stream(&a, "write -P 0x57 0 32M");
    let cut = receive(&b, 2, &full[..full.len() / 2], &["--resume"]);
    assert!(!cut.status.success());
    assert!(kept_records(&b, 2) > 0, "{}", state(&b));
    // The pool goes read-only (as a full metadata device makes it): a receive without
    // --resume cannot delete the kept one's staging device, and must not forget it.
    b.reload("pool", &pool_table(&b, "1 read_only"));
    let out = receive(&b, 2, &full, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("staging thin device 16777215 of the receive into thin device 2 stays")
            && err.trim_end().lines().count() == 1,
        "{err}"
    );
    b.reload("pool", &pool_table(&b, ""));
    let named: Vec<String> = state(&b)["partial"]
        .as_object()
        .unwrap()
        .values()
        .map(|p| p["staging"].to_string())
        .collect();
    let staging: Vec<String> = devices(&b)
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].to_string())
        .collect();
    assert_eq!(named, staging, "a staging device the state no longer names");
    // The daemon's next start drops it (nobody asked to keep it any more).
    b.stop(libc::SIGTERM);
    b.launch();
    assert!(
        devices(&b).as_array().unwrap().is_empty(),
        "{}",
        devices(&b)
    );
    succeeded(receive(&b, 2, &full, &[]), "receive");
    assert_eq!(devices(&b).as_array().unwrap().len(), 1);
    thin_check(&b, &b_pool);
}

/// Two daemons, `b` killed right after the publish's metadata commit of a receive of snapshot
/// 3 (from 2, received before), before anything else was written, and not started again;
/// with the stream of snapshot 4 from 3.
fn killed_as_it_publishes(tag: &str) -> (Daemon, Daemon, Pool, Vec<u8>) {
    let (a, mut b, b_pool) = two_daemons(tag);
    let inc = base_received_and_increment(&a, &b, "write -P 0x58 0 1M", "write -P 0x59 8M 8M");
    qemu_io_ok(&a.uri("vol"), &["write -P 0x5a 20M 1M"]);
    snapshot(&a, 4);
    send_to_file(&a, 4, Some(3), &a.dir.path("inc2"));
    b.stop(libc::SIGTERM);
    b.set_env("UDM_CRASH_AT", "published");
    b.launch();
    assert!(!receive(&b, 3, &inc, &[]).status.success());
    b.stop(libc::SIGKILL);
    b.set_env("UDM_CRASH_AT", "");
    let inc2 = std::fs::read(a.dir.path("inc2")).unwrap();
    (a, b, b_pool, inc2)
}

/// The receive of snapshot 3 is recorded in `b`'s state, as received and no more in progress.
fn recorded_as_received(b: &Daemon) {
    assert!(state(b)["received"]["3"].is_object(), "{}", state(b));
    assert!(state(b)["partial"].as_object().unwrap().is_empty());
}

#[test]
fn a_receiver_killed_as_it_publishes_knows_what_it_received_after_the_restart() {
    let (a, mut b, b_pool, inc2) = killed_as_it_publishes("kill-publish");
    b.launch();
    recorded_as_received(&b);
    same_snapshot(&a, &b, 3);
    // The next increment finds its base.
    succeeded(receive(&b, 4, &inc2, &[]), "the next incremental receive");
    same_snapshot(&a, &b, 4);
    thin_check(&b, &b_pool);
}

/// A pool that is not restored at the daemon's start (made by hand after it) has its
/// publish completed when it comes, for good: not only when a receive reads the state, where
/// the published id deleted and made again since would pass for the device published.
#[test]
fn a_publish_killed_after_its_commit_is_recorded_when_its_pool_comes_after_the_restart() {
    let (_a, mut b, b_pool, inc2) = killed_as_it_publishes("kill-publish-pool-later");
    std::fs::remove_file(b.dir.path("state/devices/pool.json")).unwrap();
    b.launch();
    b.create("pool", &b_pool.table);
    recorded_as_received(&b);
    b.udm(&["message", "pool", "0", "delete", "3"]);
    b.udm(&["message", "pool", "0", "create_thin", "3"]);
    let out = receive(&b, 4, &inc2, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "received onto a device made again");
    assert!(err.contains("wrong base"), "{err}");
    thin_check(&b, &b_pool);
}

#[test]
fn the_staging_device_of_a_kept_receive_takes_no_table_after_a_restart_or_a_new_pool_table() {
    let (a, mut b, b_pool) = two_daemons("staging-restart");
    let inc = increment_half_received(&a, &b, "write -P 0x5b 0 1M", "write -P 0x5c 8M 64M");
    let staging = state(&b)["partial"]["3"]["staging"].to_string();
    let table = format!("0 {} thin pool {staging}", VOLUME / 512);
    let refused = |b: &Daemon, after: &str| {
        let err = b.udm_err(&["create", "peek", "--table", &table]);
        assert!(
            err.contains("is the staging device of a receive"),
            "{after}: {err}"
        );
    };
    b.stop(libc::SIGKILL);
    b.launch();
    refused(&b, "a restart");
    // The pool device made again (or first made after the daemon's start).
    b.udm(&["remove", "pool"]);
    b.udm(&["create", "pool", "--table", &b_pool.table]);
    refused(&b, "the pool made again");
    succeeded(receive(&b, 3, &inc, &["--resume"]), "resumed receive");
    same_snapshot(&a, &b, 3);
    thin_check(&b, &b_pool);
}
