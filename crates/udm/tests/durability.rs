//! End to end: what a dmsetup user does that must never lose or leak data — shrinking a device
//! under queued I/O or under another device, reloading a clone without suspending it first,
//! finalizing a device the user suspended.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;

const EIO: u32 = 5;

/// A clone's metadata, destination and random source of `size` bytes, in a daemon's directory.
struct CloneFiles {
    meta: PathBuf,
    dest: PathBuf,
    source: PathBuf,
    size: u64,
}

impl CloneFiles {
    fn new(daemon: &Daemon, size: u64, seed: u64) -> CloneFiles {
        let source = daemon.dir.path("source");
        pattern_file(&source, size as usize, seed);
        CloneFiles {
            meta: daemon.sparse("meta", 4 * MIB),
            dest: daemon.sparse("dest", size),
            source,
            size,
        }
    }

    /// The clone's table line over the whole source, `rest` after its devices.
    fn table(&self, rest: &str) -> String {
        format!(
            "0 {} clone {} {} {} {rest}",
            self.size / 512,
            self.meta.display(),
            self.dest.display(),
            self.source.display()
        )
    }
}

/// Creates device `vol`, a clone of a random source of `size` bytes (from `seed`) with `rest`
/// after its devices; returns its files and its table line.
fn create_clone_vol(daemon: &Daemon, size: u64, seed: u64, rest: &str) -> (CloneFiles, String) {
    let files = CloneFiles::new(daemon, size, seed);
    let table = files.table(rest);
    daemon.create("vol", &table);
    (files, table)
}

fn read_file_at(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; len];
    std::fs::File::open(path)
        .unwrap()
        .read_exact_at(&mut buf, offset)
        .unwrap();
    buf
}

#[test]
fn requests_queued_across_a_shrink_fail_whole() {
    let daemon = Daemon::start("shrink-queued");
    let disk = daemon.dir.path("disk.img");
    pattern_file(&disk, 64 * MIB as usize, 7);
    let d = disk.to_str().unwrap();
    daemon.create("vol", &format!("0 131072 linear {d} 0"));
    let before_48 = read_file_at(&disk, 48 * MIB, 4096);
    let before_32 = read_file_at(&disk, 32 * MIB - 2048, 4096);

    let mut client = RawClient::connect(&daemon.nbd_socket(), "vol");
    // Prime a worker's buffer with data, so a read that returned it unread would show.
    client.send(0, NBD_CMD_READ, 1, 0, 4096, &[]);
    assert_eq!(client.reply().unwrap(), (0, 1));
    let mut primed = vec![0u8; 4096];
    std::io::Read::read_exact(&mut client.stream, &mut primed).unwrap();

    daemon.udm(&["suspend", "vol"]);
    let pattern = vec![0x5au8; 4096];
    client.send(0, NBD_CMD_WRITE, 2, 48 * MIB, 4096, &pattern);
    client.send(0, NBD_CMD_WRITE, 3, 32 * MIB - 2048, 4096, &pattern);
    client.send(0, NBD_CMD_READ, 4, 40 * MIB, 4096, &[]);
    std::thread::sleep(Duration::from_millis(300));
    daemon.udm(&["load", "vol", "--table", &format!("0 65536 linear {d} 0")]);
    daemon.udm(&["resume", "vol"]);

    let mut errors = std::collections::BTreeMap::new();
    for _ in 0..3 {
        let (error, cookie) = client.reply().unwrap();
        errors.insert(cookie, error);
    }
    // Each was checked against the table that served it: the whole request fails, nothing of
    // it is done, and the read sends no bytes (a reply with data would break the framing of
    // the next reply read here).
    assert_eq!(
        errors,
        [(2, EIO), (3, EIO), (4, EIO)].into(),
        "daemon log:\n{}",
        daemon.log()
    );
    assert_eq!(read_file_at(&disk, 48 * MIB, 4096), before_48);
    assert_eq!(read_file_at(&disk, 32 * MIB - 2048, 4096), before_32);
    // The connection is still in step: a read inside the new size works.
    client.send(0, NBD_CMD_READ, 5, 0, 4096, &[]);
    assert_eq!(client.reply().unwrap(), (0, 5));
}

#[test]
fn shrinking_a_device_under_another_is_refused_or_fails_its_io() {
    let mut daemon = Daemon::start("shrink-holder");
    let disk = daemon.sparse("disk.img", 64 * MIB);
    let d = disk.to_str().unwrap();
    daemon.create("base", &format!("0 131072 linear {d} 0"));
    daemon.create("top", "0 131072 linear base 0");
    let small = format!("0 65536 linear {d} 0");

    let err = daemon.udm_err(&["load", "base", "--table", &small]);
    assert!(
        err.contains("device 'top' uses 131072 sectors of it and the new table has 65536"),
        "{err}"
    );
    assert!(daemon
        .udm(&["info", "base"])
        .contains("Tables present:    LIVE\n"));

    // Forced: top's I/O past base's new end fails instead of vanishing.
    daemon.udm(&["load", "base", "--force", "--table", &small]);
    daemon.udm(&["resume", "base"]);
    qemu_io_eio(&daemon.uri("top"), "write -P 0x11 40M 64k");
    qemu_io_ok(&daemon.uri("top"), &["write -P 0x22 1M 64k"]);

    // top cannot come back on a base too small for it: the restart says so in the log.
    daemon.stop(libc::SIGTERM);
    daemon.launch();
    assert!(daemon.log().contains("cannot restore device 'top'"));
}

/// An error reaches a structured-reply client as an error chunk with the error's words.
/// Words of more than 994 bytes (a path of 1,000 characters in "past the end of the file")
/// made a chunk payload over qemu's limit of 1,000 bytes: qemu refused the reply, and the
/// read failed with EINVAL instead of EIO (found with a remote whose error messages were
/// 64 KiB long; libnbd, without that limit, saw EIO). The words are cut to fit now.
#[test]
fn a_long_error_message_still_reaches_qemu_as_eio() {
    let daemon = Daemon::start("long-error-message");
    let part = "d".repeat(200);
    let deep = daemon.dir.path(&[part.as_str(); 5].join("/"));
    std::fs::create_dir_all(&deep).unwrap();
    let file = deep.join("f.img");
    std::fs::File::create(&file).unwrap().set_len(MIB).unwrap();
    daemon.create("long", &linear_table(&file, MIB));
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(64 << 10)
        .unwrap();
    qemu_io_eio(&daemon.uri("long"), "read 512k 4k");
}

/// Someone truncates a clone's source file while it hydrates (an operator's slip, a script
/// reusing the name). What is gone must not come back as zeroes: reads of it fail, and the
/// hydration never marks those regions copied, so restoring the file lets it finish right.
#[test]
fn a_clone_source_truncated_under_it_fails_reads_and_hydrates_no_zeroes() {
    let daemon = Daemon::start("clone-source-shrinks");
    let (files, _) = create_clone_vol(&daemon, 16 * MIB, 11, "8 1 no_hydration");
    let (source, dest) = (&files.source, &files.dest);
    let original = std::fs::read(source).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(source)
        .unwrap()
        .set_len(4 * MIB)
        .unwrap();

    let uri = daemon.uri("vol");
    qemu_io_eio(&uri, "read 8M 4k");
    // Inside what is left of the source, reads go on as before.
    let mut client = RawClient::connect(&daemon.nbd_socket(), "vol");
    client.send(0, NBD_CMD_READ, 1, MIB, 4096, &[]);
    assert_eq!(client.reply().unwrap(), (0, 1));
    let mut head = vec![0u8; 4096];
    std::io::Read::read_exact(&mut client.stream, &mut head).unwrap();
    assert_eq!(head, original[MIB as usize..MIB as usize + 4096]);
    drop(client);

    daemon.udm(&["message", "vol", "0", "enable_hydration"]);
    wait_for(
        || daemon.log().contains("shrank"),
        "the hydration's warning",
    );
    std::thread::sleep(Duration::from_millis(500));
    let status = daemon.udm(&["status", "vol"]);
    let hydrated: u64 = status
        .split_whitespace()
        .nth(6)
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        hydrated <= 1024,
        "regions past the source's end were marked hydrated: {status}"
    );

    // The file comes back: the hydration finishes with the real data.
    std::fs::write(source, &original).unwrap();
    wait_for(
        || daemon.udm(&["status", "vol"]).contains(" 4096/4096 "),
        "the hydration to finish",
    );
    daemon.udm(&["remove", "vol"]);
    assert_eq!(std::fs::read(dest).unwrap(), original);
}

/// dmsetup's habit: `reload` then `resume`, with no `suspend` in between.
#[test]
fn reload_and_resume_without_suspend_keeps_a_clones_writes() {
    let mut daemon = Daemon::start("clone-reload");
    let (files, table) = create_clone_vol(&daemon, 64 * MIB, 3, "128 1 no_hydration");

    // A whole-region write: it goes to the destination and sets a bit, committed at the next
    // FLUSH or second; no flush is sent here.
    let mut client = RawClient::connect(&daemon.nbd_socket(), "vol");
    let pattern = vec![0xa5u8; 64 * 1024];
    client.send(0, NBD_CMD_WRITE, 1, 8 * MIB, 64 * 1024, &pattern);
    assert_eq!(client.reply().unwrap(), (0, 1));

    daemon.udm(&["load", "vol", "--table", &table]);
    daemon.udm(&["resume", "vol"]);
    client.send(0, NBD_CMD_READ, 2, 8 * MIB, 64 * 1024, &[]);
    assert_eq!(client.reply().unwrap(), (0, 2));
    let mut back = vec![0u8; 64 * 1024];
    std::io::Read::read_exact(&mut client.stream, &mut back).unwrap();
    assert!(back == pattern, "the write reads back as source data");

    // And it survives a restart followed by hydration of everything.
    client.send(0, NBD_CMD_FLUSH, 3, 0, 0, &[]);
    assert_eq!(client.reply().unwrap(), (0, 3));
    drop(client);
    daemon.stop(libc::SIGTERM);
    daemon.launch();
    daemon.udm(&["message", "vol", "0", "enable_hydration"]);
    daemon.udm(&["wait", "vol", "--progress"]);
    assert!(read_file_at(&files.dest, 8 * MIB, 64 * 1024) == pattern);
}

#[test]
fn finalize_leaves_a_suspended_device_and_an_inactive_table_alone() {
    let daemon = Daemon::start("finalize-respect");
    create_clone_vol(&daemon, 8 * MIB, 5, "128");
    daemon.udm(&["wait", "vol", "--progress"]);

    daemon.udm(&["suspend", "vol"]);
    let err = daemon.udm_err(&["finalize", "vol"]);
    assert!(err.contains("suspended"), "{err}");
    assert!(daemon.udm(&["info", "vol"]).contains("SUSPENDED"));
    daemon.udm(&["resume", "vol"]);

    daemon.udm(&["load", "vol", "--table", "0 16384 zero"]);
    let err = daemon.udm_err(&["finalize", "vol"]);
    assert!(err.contains("inactive table"), "{err}");
    assert!(daemon
        .udm(&["info", "vol"])
        .contains("Tables present:    LIVE & INACTIVE"));
    daemon.udm(&["clear", "vol"]);
    assert!(daemon.udm(&["finalize", "vol"]).contains("linear"));
}

fn flip_byte(path: &Path, offset: u64) {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, offset).unwrap();
    byte[0] ^= 0xff;
    file.write_all_at(&byte, offset).unwrap();
    file.sync_all().unwrap();
}

#[test]
fn corrupt_clone_superblocks_are_refused_or_reported_never_reformatted() {
    let mut daemon = Daemon::start("clone-corrupt");
    let (files, table) = create_clone_vol(&daemon, 16 * MIB, 9, "128 1 no_hydration");
    // Two flushed writes: two commits, so both superblock slots hold one.
    for (at, byte) in [("1M", "0x11"), ("2M", "0x22")] {
        qemu_io_ok(
            &daemon.uri("vol"),
            &[&format!("write -P {byte} {at} 64k"), "flush"],
        );
    }
    let status: serde_json::Value =
        serde_json::from_str(&daemon.udm(&["status", "vol", "--json"])).unwrap();
    let transaction = status["targets"][0]["details"]["metadata_transaction"]
        .as_u64()
        .unwrap_or_else(|| panic!("{status}"));
    daemon.stop(libc::SIGTERM);

    // The newest slot damaged: the older commit is used, and everyone is told.
    let newest = (transaction - 1) % 2; // transaction 1 is in slot 0, 2 in slot 1, 3 in 0…
    flip_byte(&files.meta, newest * 4096 + 200);
    daemon.launch();
    let status: serde_json::Value =
        serde_json::from_str(&daemon.udm(&["status", "vol", "--json"])).unwrap();
    let fallback = &status["targets"][0]["details"]["metadata_fallback"];
    assert_eq!(fallback["bad_slot"], newest, "{status}");
    assert_eq!(fallback["bad_slot_claims_transaction"], transaction);
    assert_eq!(fallback["used_transaction"], transaction - 1);
    assert!(daemon
        .log()
        .contains(&format!("claims transaction {transaction}")));
    daemon.stop(libc::SIGTERM);

    // Both slots damaged: the device is not brought back, and nothing is reformatted.
    flip_byte(&files.meta, (1 - newest) * 4096 + 200);
    let meta_before = std::fs::read(&files.meta).unwrap();
    daemon.launch();
    assert!(
        daemon.log().contains("refusing to use or reformat it"),
        "{}",
        daemon.log()
    );
    assert!(!daemon.udm(&["ls"]).contains("vol"));
    let err = daemon.udm_err(&["create", "vol2", "--table", &table]);
    assert!(err.contains("refusing to use or reformat it"), "{err}");
    assert!(
        std::fs::read(&files.meta).unwrap() == meta_before,
        "the metadata was rewritten"
    );
}

#[test]
fn a_second_daemon_on_the_same_state_dir_or_sockets_is_refused() {
    let daemon = Daemon::start("two-daemons");
    daemon.create_linear("vol", "disk.img", 4 * MIB);
    let path = |name: &str| daemon.dir.path(name).display().to_string();
    // A second daemon on the state directory, control and NBD sockets named: refused at once
    // (exit code 1), saying `why`.
    let refused = |state: &str, control: &str, nbd: &str, why: &str| {
        let out = std::process::Command::new(UDM)
            .args(["daemon", "--state-dir", &path(state)])
            .args(["--control", &path(control)])
            .arg("--nbd")
            .arg(format!("unix:{}", path(nbd)))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains(why), "{err}");
    };
    let running = format!("udm daemon already running (pid {})", daemon.pid());
    refused("state", "other-control.sock", "other-nbd.sock", &running);
    let in_use = "is in use by a running server";
    refused(
        "other-state",
        "control.sock",
        "other-nbd.sock",
        &format!("control.sock {in_use}"),
    );
    refused(
        "other-state2",
        "other-control.sock",
        "nbd.sock",
        &format!("nbd.sock {in_use}"),
    );

    // The first daemon still answers on both sockets.
    daemon.udm(&["ls"]);
    tool("nbdinfo", &["--size", &daemon.uri("vol")]);
}

#[test]
fn state_a_target_keeps_on_a_file_is_claimed_against_other_tables_and_processes() {
    let daemon = Daemon::start("claims");
    let (files, table) = create_clone_vol(&daemon, 16 * MIB, 4, "128");

    let err = daemon.udm_err(&["create", "twin", "--table", &table]);
    assert!(err.contains("in use by device 'vol'"), "{err}");
    let err = daemon.udm_err(&[
        "create",
        "peek",
        "--table",
        &format!("0 32768 linear {} 0", files.dest.display()),
    ]);
    assert!(err.contains("in use by device 'vol'"), "{err}");
    // Sharing the read-only source is fine.
    let second = CloneFiles {
        meta: daemon.sparse("meta2", 4 * MIB),
        dest: daemon.sparse("dest2", 16 * MIB),
        ..files
    };
    daemon.create("vol2", &second.table("128"));

    // Another udm process on the same files is refused too.
    let other = Daemon::start("claims-other");
    let err = other.udm_err(&["create", "twin", "--table", &table]);
    assert!(err.contains("in use by another process"), "{err}");

    // Removing the holder releases its claims.
    daemon.udm(&["remove", "vol"]);
    daemon.create("again", &table);
}

#[test]
fn settings_suspension_and_inactive_tables_survive_a_crash() {
    let mut daemon = Daemon::start("persist-settings");
    create_clone_vol(&daemon, 16 * MIB, 8, "8");
    for message in [
        "disable_hydration",
        "hydration_threshold 7",
        "max_hydration_rate 1234",
    ] {
        let mut args = vec!["message", "vol", "0"];
        args.extend(message.split(' '));
        daemon.udm(&args);
    }
    daemon.create_linear("other", "other.img", 4 * MIB);
    daemon.udm(&["load", "other", "--table", "0 8192 zero"]);
    daemon.udm(&["suspend", "other"]);

    daemon.crash_and_restart();
    let status = daemon.udm(&["status", "vol"]);
    assert!(status.contains(" 1 no_hydration "), "{status}");
    assert!(
        status.contains("hydration_threshold 7 hydration_batch_size 1 max_hydration_rate 1234"),
        "{status}"
    );
    let hydrated = |s: &str| s.split(' ').nth(6).unwrap().to_string();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        hydrated(&daemon.udm(&["status", "vol"])),
        hydrated(&status),
        "hydration ran"
    );
    let info = daemon.udm(&["info", "other"]);
    assert!(info.contains("SUSPENDED"), "{info}");
    assert!(info.contains("LIVE & INACTIVE"), "{info}");
    daemon.udm(&["resume", "other"]);
    assert_eq!(daemon.udm(&["table", "other"]), "0 8192 zero");
}

/// A bad region masked with an `error` segment, as dm users bring up volumes with holes:
/// writes to the rest must be flushable on both engines. Every FLUSH failed with EIO, so a
/// filesystem on such a device took its first journal commit for a dead disk.
#[test]
fn a_device_with_an_error_segment_flushes_its_writes_on_both_engines() {
    for engine in ["uring", "threads"] {
        let daemon = Daemon::start_with(&format!("error-hole-{engine}"), &["--nbd-engine", engine]);
        let disk = daemon.sparse("disk.img", 2 * MIB);
        let table = format!(
            "0 2048 linear {disk} 0\n2048 8 error\n2056 2040 linear {disk} 2056",
            disk = disk.display()
        );
        daemon.create("vol", &table);
        let mut client = RawClient::connect(&daemon.nbd_socket(), "vol");
        client.send(0, NBD_CMD_WRITE, 1, 1536 * 512, 4096, &[0x5a; 4096]);
        assert_eq!(client.reply().unwrap(), (0, 1), "{engine}: the write");
        client.send(0, NBD_CMD_FLUSH, 2, 0, 0, &[]);
        assert_eq!(client.reply().unwrap(), (0, 2), "{engine}: the flush");
        // The hole itself still fails.
        client.send(0, NBD_CMD_WRITE, 3, 2048 * 512, 512, &[0; 512]);
        assert_eq!(
            client.reply().unwrap(),
            (EIO, 3),
            "{engine}: a write to the hole"
        );
        assert_eq!(read_file_at(&disk, 1536 * 512, 4096), vec![0x5a; 4096]);
    }
}
