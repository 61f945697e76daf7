//! The kill -9 harness: a client writes versioned blocks with flushes and FUA writes, the
//! daemon is killed at a random moment, restarted, and every block is checked against a
//! model of what must have survived: the last durable version or a newer one, never an older
//! one, and for blocks never written, the original data (which also proves that no clone
//! region was marked hydrated before its data reached the destination).
//!
//! `UDM_CRASH_ROUNDS` sets the kills per table (default 100: 200 in a CI run).

mod common;

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use udm_testkit::{pattern, Rng};

const BLOCK: u64 = 4096;
const SIZE: u64 = 16 * MIB;
const FUA: u16 = 1;

fn rounds() -> u64 {
    std::env::var("UDM_CRASH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100)
}

/// A deterministic block for (block, version).
fn block_data(block: u64, version: u64) -> udm_block::AlignedBuf {
    pattern(BLOCK as usize, block << 32 | version)
}

fn read_all(client: &mut RawClient) -> Vec<u8> {
    let mut out = vec![0u8; SIZE as usize];
    for (i, piece) in out.chunks_mut(MIB as usize).enumerate() {
        client.send(0, NBD_CMD_READ, i as u64, i as u64 * MIB, MIB as u32, &[]);
        assert_eq!(client.reply().unwrap(), (0, i as u64));
        client.stream.read_exact(piece).unwrap();
    }
    out
}

struct Model {
    /// For every block, the versions a read may return (0 = the original data).
    allowed: HashMap<u64, Vec<u64>>,
    version: u64,
    durable_writes: u64,
}

impl Model {
    fn new() -> Self {
        Model {
            allowed: (0..SIZE / BLOCK).map(|b| (b, vec![0])).collect(),
            version: 0,
            durable_writes: 0,
        }
    }

    fn made_durable(&mut self, block: u64, version: u64) {
        self.allowed
            .get_mut(&block)
            .unwrap()
            .retain(|&v| v >= version);
        self.durable_writes += 1;
    }

    /// Checks the device read back after a crash and pins every block to what it holds now.
    fn check(&mut self, data: &[u8], original: &[u8], what: &str) {
        for block in 0..SIZE / BLOCK {
            let range = (block * BLOCK) as usize..((block + 1) * BLOCK) as usize;
            let got = &data[range.clone()];
            let found = self.allowed[&block].iter().copied().find(|&v| {
                if v == 0 {
                    got == &original[range.clone()]
                } else {
                    got == &block_data(block, v)[..]
                }
            });
            let Some(version) = found else {
                panic!(
                    "{what}: block {block} holds none of the allowed versions {:?}",
                    self.allowed[&block]
                );
            };
            self.allowed.insert(block, vec![version]);
        }
    }
}

/// Runs the workload until the daemon dies under it.
fn workload_until_killed(client: &mut RawClient, model: &mut Model, random: &mut Rng) {
    let start = Instant::now();
    let mut unflushed: Vec<(u64, u64)> = Vec::new();
    while start.elapsed() < Duration::from_secs(10) {
        for _ in 0..8 {
            let block = random.below(SIZE / BLOCK);
            model.version += 1;
            let version = model.version;
            let fua = random.below(8) == 0;
            // A write may land even if its reply never comes.
            model.allowed.get_mut(&block).unwrap().push(version);
            let flags = if fua { FUA } else { 0 };
            let data = block_data(block, version);
            client.send(
                flags,
                NBD_CMD_WRITE,
                version,
                block * BLOCK,
                BLOCK as u32,
                &data,
            );
            match client.reply() {
                Ok((0, _)) if fua => model.made_durable(block, version),
                Ok((0, _)) => unflushed.push((block, version)),
                _ => return,
            }
        }
        client.send(0, NBD_CMD_FLUSH, 0, 0, 0, &[]);
        match client.reply() {
            Ok((0, _)) => {
                for (block, version) in unflushed.drain(..) {
                    model.made_durable(block, version);
                }
            }
            _ => return,
        }
    }
    panic!("the daemon was not killed within 10 s");
}

/// Kills the daemon under the workload on `vol` again and again. `setup` creates `vol` (and
/// whatever else) over a copy of the original data it is given the path of; after each
/// restart `check` may look at the other devices.
fn crash_rounds(
    tag: &str,
    setup: impl FnOnce(&Daemon, &Path),
    check: impl Fn(&Daemon, &[u8], &str),
) {
    let mut daemon = Daemon::start(tag);
    let original_path = daemon.dir.path("original.img");
    pattern_file(&original_path, SIZE as usize, 77);
    let original = std::fs::read(&original_path).unwrap();
    setup(&daemon, &original_path);
    let mut model = Model::new();
    let mut random = Rng::new(tag.len() as u64);
    let rounds = rounds();
    for round in 0..rounds {
        let mut client = RawClient::connect(&daemon.nbd_socket(), "vol");
        let pid = daemon.pid();
        let kill_after = Duration::from_millis(20 + random.below(250));
        let killer = std::thread::spawn(move || {
            std::thread::sleep(kill_after);
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        });
        workload_until_killed(&mut client, &mut model, &mut random);
        killer.join().unwrap();
        daemon.reap();
        daemon.launch();
        let mut client = RawClient::connect(&daemon.nbd_socket(), "vol");
        let what = format!("{tag} round {round}");
        model.check(&read_all(&mut client), &original, &what);
        check(&daemon, &original, &what);
    }
    assert!(
        model.durable_writes > rounds,
        "too few writes became durable: {}",
        model.durable_writes
    );
    eprintln!(
        "{tag}: {rounds} kills survived, {} durable writes checked",
        model.durable_writes
    );
}

fn no_check(_: &Daemon, _: &[u8], _: &str) {}

/// Creates `vol` from a table over a copy of the original data.
fn vol(table: impl FnOnce(&Daemon, &Path) -> String) -> impl FnOnce(&Daemon, &Path) {
    move |daemon, original| {
        daemon.create("vol", &table(daemon, original));
    }
}

fn copy_of_original(daemon: &Daemon, original: &Path, name: &str) -> PathBuf {
    let disk = daemon.dir.path(name);
    std::fs::copy(original, &disk).unwrap();
    disk
}

/// `vol`, a `snapshot-origin` over a copy of the original data, and `snap`, a persistent
/// snapshot of it; returns the paths of the copy and of the COW device.
fn snapshot_of_original(daemon: &Daemon, original: &Path) -> (PathBuf, PathBuf) {
    let disk = copy_of_original(daemon, original, "disk.img");
    let cow = daemon.sparse("snap.cow", 2 * SIZE);
    let sectors = SIZE / 512;
    daemon.create(
        "vol",
        &format!("0 {sectors} snapshot-origin {}", disk.display()),
    );
    let snap = format!(
        "0 {sectors} snapshot {} {} P 8",
        disk.display(),
        cow.display()
    );
    daemon.create("snap", &snap);
    (disk, cow)
}

#[test]
fn linear_survives_kill_9() {
    crash_rounds(
        "crash-linear",
        vol(|daemon, original| {
            // The device starts as a copy of the original data.
            let disk = copy_of_original(daemon, original, "disk.img");
            linear_table(&disk, SIZE)
        }),
        no_check,
    );
}

/// Writes the original data through `vol` and flushes it: a device whose layout is not
/// the original file's (a striped one) starts as the model's original all the same.
fn write_original_through_vol(daemon: &Daemon, original: &Path) {
    let data = std::fs::read(original).unwrap();
    let mut client = RawClient::connect(&daemon.nbd_socket(), "vol");
    for (i, piece) in data.chunks(MIB as usize).enumerate() {
        let at = i as u64 * MIB;
        client.send(0, NBD_CMD_WRITE, i as u64, at, MIB as u32, piece);
        assert_eq!(client.reply().unwrap(), (0, i as u64));
    }
    client.send(0, NBD_CMD_FLUSH, 0, 0, 0, &[]);
    assert_eq!(client.reply().unwrap().0, 0);
}

/// `linear` over `striped` (4 KiB chunks, so every write of the workload lands on one stripe
/// and the flushes must reach both) over two `linear` udm devices over a file each: the
/// daemon restores the three levels in order after each kill.
#[test]
fn a_striped_stack_survives_kill_9() {
    crash_rounds(
        "crash-striped",
        |daemon, original| {
            let half = SIZE / 2 / 512;
            for name in ["low-a", "low-b"] {
                let disk = daemon.sparse(&format!("{name}.img"), SIZE / 2);
                daemon.create(name, &format!("0 {half} linear {} 0", disk.display()));
            }
            let sectors = SIZE / 512;
            daemon.create("st", &format!("0 {sectors} striped 2 8 low-a 0 low-b 0"));
            daemon.create("vol", &format!("0 {sectors} linear st 0"));
            write_original_through_vol(daemon, original);
        },
        no_check,
    );
}

/// `pool`, a thin pool of `data` bytes (4 MiB of metadata), with thin device 1.
fn thin_pool_with_device_1(daemon: &Daemon, data: u64) {
    let meta = daemon.sparse("pool.meta", 4 * MIB);
    let data_file = daemon.sparse("pool.data", data);
    daemon.create("pool", &thin_pool_table(&meta, &data_file, data, "0"));
    daemon.udm(&["message", "pool", "0", "create_thin", "1"]);
}

/// thin_check on the pool's metadata, with `vol` and the pool suspended (all committed).
fn thin_check_still(daemon: &Daemon) {
    daemon.udm(&["suspend", "vol"]);
    daemon.udm(&["suspend", "pool"]);
    tool(
        "thin_check",
        &[daemon.dir.path("pool.meta").to_str().unwrap()],
    );
    daemon.udm(&["resume", "pool"]);
    daemon.udm(&["resume", "vol"]);
}

/// A thin volume whose external origin is the original data: 4 KiB writes into 64 KiB
/// blocks copy the rest of each block from the origin as they provision it. After every
/// restart the pool's metadata must pass thin_check.
#[test]
fn thin_survives_kill_9_while_provisioning() {
    crash_rounds(
        "crash-thin",
        vol(|daemon, original| {
            thin_pool_with_device_1(daemon, 2 * SIZE);
            format!("0 {} thin pool 1 {}", SIZE / 512, original.display())
        }),
        |daemon, _, _| thin_check_still(daemon),
    );
}

/// A thin volume snapshotted again after every restart, so that each round's 4 KiB writes
/// break sharing with a snapshot (copying the rest of their 64 KiB block first). After every
/// restart the snapshot taken after the restart before must read exactly as the volume did
/// when it was taken, and the pool's metadata must pass thin_check.
#[test]
fn thin_survives_kill_9_while_breaking_sharing_with_a_snapshot() {
    let taken = std::cell::RefCell::new(None::<(u32, Vec<u8>)>);
    crash_rounds(
        "crash-thin-snap",
        vol(|daemon, original| {
            thin_pool_with_device_1(daemon, 4 * SIZE);
            daemon.create("vol", &format!("0 {} thin pool 1", SIZE / 512));
            // The volume starts as the original data, so that every block is mapped.
            tool("nbdcopy", &[original.to_str().unwrap(), &daemon.uri("vol")]);
            daemon.udm(&["remove", "vol"]);
            format!("0 {} thin pool 1", SIZE / 512)
        }),
        |daemon, _, what| {
            let table = format!("0 {} thin pool", SIZE / 512);
            let mut taken = taken.borrow_mut();
            if let Some((id, expected)) = taken.take() {
                daemon.create("snap", &format!("{table} {id}"));
                let mut client = RawClient::connect(&daemon.nbd_socket(), "snap");
                assert!(
                    read_all(&mut client) == expected,
                    "{what}: snapshot {id} changed"
                );
                drop(client);
                daemon.udm(&["remove", "snap"]);
                daemon.udm(&["message", "pool", "0", "delete", &id.to_string()]);
            }
            // A new id each round: the round number after the volume's id.
            let id = 2 + what.rsplit(' ').next().unwrap().parse::<u32>().unwrap();
            daemon.udm(&["suspend", "vol"]);
            daemon.udm(&["message", "pool", "0", "create_snap", &id.to_string(), "1"]);
            daemon.udm(&["resume", "vol"]);
            let mut client = RawClient::connect(&daemon.nbd_socket(), "vol");
            *taken = Some((id, read_all(&mut client)));
            thin_check_still(daemon);
        },
    );
}

#[test]
fn clone_survives_kill_9_while_hydrating() {
    crash_rounds(
        "crash-clone",
        vol(|daemon, original| {
            let dest = daemon.sparse("dest.img", SIZE);
            let meta = daemon.sparse("meta.img", MIB);
            // 8 KiB regions, so 4 KiB writes copy half a region first; hydration capped at
            // 2 MiB/s so the kills land in the middle of it for many rounds.
            format!(
                "0 {} clone {} {} {} 16 0 6 hydration_threshold 32 hydration_batch_size 4 max_hydration_rate 2048",
                SIZE / 512,
                meta.display(),
                dest.display(),
                original.display()
            )
        }),
        no_check,
    );
}

/// The origin under its writes, and after every kill a snapshot taken before the first
/// write that still reads exactly the original data.
#[test]
fn a_snapshot_origin_survives_kill_9_and_its_snapshot_stays_exact() {
    crash_rounds(
        "crash-snapshot",
        |daemon, original| {
            snapshot_of_original(daemon, original);
        },
        |daemon, original, what| {
            let mut client = RawClient::connect(&daemon.nbd_socket(), "snap");
            assert!(
                read_all(&mut client) == original,
                "{what}: the snapshot changed"
            );
        },
    );
}

/// A merge rolling the origin back to a snapshot (the original data) while the workload
/// writes through it and the daemon is killed again and again: the device always reads as
/// the snapshot plus every write made durable since, whether the merge has reached a chunk
/// yet or not.
#[test]
fn a_merge_survives_kill_9_while_it_rolls_back() {
    crash_rounds(
        "crash-merge",
        |daemon, original| {
            let (disk, cow) = snapshot_of_original(daemon, original);
            // Change every chunk of the origin, then merge the snapshot back.
            qemu_io_ok(&daemon.uri("vol"), &["write -P 0x5c 0 16M"]);
            daemon.udm(&["suspend", "vol"]);
            daemon.udm(&["remove", "snap"]);
            let merge = format!(
                "0 {} snapshot-merge {} {} P 8",
                SIZE / 512,
                disk.display(),
                cow.display()
            );
            daemon.udm(&["load", "vol", "--table", &merge]);
            daemon.udm(&["resume", "vol"]);
            // Slow, so that the kills land in the middle of it for many rounds (the setting
            // is saved with the device and survives the restarts).
            daemon.udm(&["message", "vol", "0", "max_merge_rate", "256"]);
        },
        |daemon, _, what| {
            // Still merging, or merged: never failed or dropped.
            let status = daemon.udm(&["status", "vol"]);
            let usage = status.rsplit_once("snapshot-merge ").unwrap().1;
            assert!(usage.contains('/'), "{what}: {status}");
        },
    );
}
