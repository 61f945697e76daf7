//! The verbs of the walk: each picks its arguments, predicts the outcome from the model,
//! runs the real verb, checks that it succeeded or failed as predicted and updates the model.

use std::process::Command;

use crate::world::*;
use crate::Walk;

/// One random step; returns what it did, for the step log.
pub fn random_step(walk: &mut Walk) -> String {
    let roll = walk.rng.below(100);
    match roll {
        0..=9 => create(walk),
        10..=15 => load(walk),
        16..=18 => clear(walk),
        19..=24 => suspend(walk),
        25..=32 => resume(walk),
        33..=36 => rename(walk),
        37..=41 => remove(walk),
        42..=51 => write(walk),
        52..=56 => clone_message(walk),
        57..=62 => finalize(walk),
        63..=71 => thin_message(walk),
        72..=79 => send_receive(walk),
        80..=89 => classic(walk),
        90..=94 => {
            walk.restart(false);
            "restart (SIGTERM)".into()
        }
        _ => {
            walk.restart(true);
            "restart (kill -9)".into()
        }
    }
}

/// A device name of the walk's few; often one that does not exist.
fn any_name(walk: &mut Walk) -> String {
    walk.rng.pick(&NAMES).to_string()
}

/// A device the walk may suspend and resume: a name, or now and then a pool.
fn any_device(walk: &mut Walk) -> String {
    if walk.rng.chance(15) {
        walk.rng.pick(&POOLS).to_string()
    } else {
        any_name(walk)
    }
}

/// A random table for a data device; a clone gets fresh metadata and destination files.
fn random_table(walk: &mut Walk) -> Table {
    match walk.rng.below(10) {
        0 => Table::Zero,
        1..=3 => Table::Linear {
            file: file_name(walk.rng.below(FILES as u64) as usize),
        },
        4..=5 => Table::Over {
            below: any_name(walk),
        },
        6..=7 => {
            let threshold = walk.rng.pick(&[1, 4, 64, 256]);
            let batch = walk.rng.pick(&[1, 16, 64]);
            let table = walk.world.new_clone(threshold, batch);
            let Table::Clone { n, .. } = table else {
                unreachable!()
            };
            walk.daemon
                .sparse(&format!("clone{n}.meta"), crate::common::MIB);
            walk.daemon.sparse(&clone_dest(n), BLOCK * BLOCKS as u64);
            table
        }
        _ => Table::Thin {
            pool: walk.rng.pick(&POOLS),
            id: walk.rng.below(*THIN_IDS.end() as u64) as u32 + 1,
        },
    }
}

fn create(walk: &mut Walk) -> String {
    let name = any_name(walk);
    let table = random_table(walk);
    let text = table.text(&walk.daemon.dir.0);
    let args = ["create", &name, "--table", &text];
    if walk.world.exists(&name) {
        walk.fails(&args, "already exists");
        return format!("create {name} {table:?}: refused, it exists");
    }
    if let Some(names) = walk.world.unbuildable(&name, &table) {
        let err = walk.fails(&args, &names);
        return format!("create {name} {table:?}: refused ({err})");
    }
    walk.ok(&args);
    walk.world.devices.insert(
        name.clone(),
        Device {
            live: table.clone(),
            inactive: None,
            suspended: false,
            event_nr: None,
        },
    );
    format!("create {name} {table:?}")
}

fn load(walk: &mut Walk) -> String {
    let name = any_name(walk);
    let table = random_table(walk);
    let text = table.text(&walk.daemon.dir.0);
    let args = ["load", &name, "--table", &text];
    if !walk.world.exists(&name) {
        walk.fails(&args, "does not exist");
        return format!("load {name}: refused, no such device");
    }
    if let Some(names) = walk.world.unbuildable(&name, &table) {
        let err = walk.fails(&args, &names);
        return format!("load {name} {table:?}: refused ({err})");
    }
    walk.ok(&args);
    walk.world.devices.get_mut(&name).unwrap().inactive = Some(table.clone());
    format!("load {name} {table:?}")
}

fn clear(walk: &mut Walk) -> String {
    let name = any_name(walk);
    if !walk.world.exists(&name) {
        walk.fails(&["clear", &name], "does not exist");
        return format!("clear {name}: refused, no such device");
    }
    walk.ok(&["clear", &name]);
    walk.world.devices.get_mut(&name).unwrap().inactive = None;
    format!("clear {name}")
}

fn suspend(walk: &mut Walk) -> String {
    let name = any_device(walk);
    if !walk.world.exists(&name) {
        walk.fails(&["suspend", &name], "does not exist");
        return format!("suspend {name}: refused, no such device");
    }
    walk.ok(&["suspend", &name]);
    walk.world.devices.get_mut(&name).unwrap().suspended = true;
    format!("suspend {name}")
}

fn resume(walk: &mut Walk) -> String {
    let name = any_device(walk);
    if !walk.world.exists(&name) {
        walk.fails(&["resume", &name], "does not exist");
        return format!("resume {name}: refused, no such device");
    }
    walk.ok(&["resume", &name]);
    let device = walk.world.devices.get_mut(&name).unwrap();
    if let Some(table) = device.inactive.take() {
        device.live = table;
    }
    device.suspended = false;
    format!("resume {name}")
}

fn rename(walk: &mut Walk) -> String {
    let (old, new) = (any_name(walk), any_name(walk));
    let args = ["rename", &old, &new];
    if !walk.world.exists(&old) {
        walk.fails(&args, "does not exist");
        return format!("rename {old} {new}: refused, no such device");
    }
    if walk.world.exists(&new) {
        walk.fails(&args, "already exists");
        return format!("rename {old} {new}: refused, {new} exists");
    }
    let holders = walk.world.holders(&old);
    if !holders.is_empty() {
        walk.fails(&args, &holders[0]);
        return format!("rename {old} {new}: refused, {holders:?} name it");
    }
    walk.ok(&args);
    let device = walk.world.devices.remove(&old).unwrap();
    walk.world.devices.insert(new.clone(), device);
    format!("rename {old} {new}")
}

fn remove(walk: &mut Walk) -> String {
    let name = any_name(walk);
    if !walk.world.exists(&name) {
        walk.fails(&["remove", &name], "does not exist");
        return format!("remove {name}: refused, no such device");
    }
    let holders = walk.world.holders(&name);
    if !holders.is_empty() {
        walk.fails(&["remove", &name], &holders[0]);
        return format!("remove {name}: refused, used by {holders:?}");
    }
    // Over a suspended device, the removal does not wait to flush (as the kernel's).
    let over_suspended = !walk.world.flows_below(&name);
    walk.ok(&["remove", &name]);
    walk.world.devices.remove(&name);
    if over_suspended {
        return format!("remove {name} (over a suspended device)");
    }
    format!("remove {name}")
}

/// A pattern written through NBD and flushed, then read back; only where I/O flows (I/O to
/// a suspended device waits, as it must).
fn write(walk: &mut Walk) -> String {
    let name = any_name(walk);
    if !walk.world.exists(&name) || !walk.world.flows(&name) {
        return format!("write {name}: skipped, missing or suspended");
    }
    write_somewhere(walk, &name)
}

/// Writes a random pattern over a few random blocks of `name`, where I/O flows.
fn write_somewhere(walk: &mut Walk, name: &str) -> String {
    let name = name.to_string();
    let first = walk.rng.below(BLOCKS as u64) as usize;
    let blocks = 1 + walk.rng.below((BLOCKS - first).min(8) as u64) as usize;
    let byte = 1 + walk.rng.below(255) as u8;
    walk.write(&name, first, blocks, byte);
    if let Content::Store(store) = walk.world.content(&name) {
        walk.world.stores.get_mut(&store).unwrap()[first..first + blocks].fill(byte);
        walk.world.written(&store);
    }
    if let Some(n) = clone_of(walk, &name) {
        walk.world.clones.get_mut(&n).unwrap().written[first..first + blocks].fill(true);
    }
    walk.check_data(&name);
    format!("write {name} blocks {first}+{blocks} = {byte:#x}")
}

/// The clone number of `name`'s live table, if a clone, looking through devices below.
fn clone_of(walk: &Walk, name: &str) -> Option<usize> {
    match &walk.world.devices.get(name)?.live {
        Table::Clone { n, .. } => Some(*n),
        Table::Over { below } => clone_of(walk, below),
        _ => None,
    }
}

fn live_clone(walk: &Walk, name: &str) -> Option<usize> {
    match walk.world.devices.get(name)?.live {
        Table::Clone { n, .. } => Some(n),
        _ => None,
    }
}

/// A name for a clone verb: mostly a live clone's (finalizing one needs a few verbs in a
/// row on it), else any name.
fn clone_name(walk: &mut Walk) -> String {
    let clones: Vec<&str> = NAMES
        .into_iter()
        .filter(|name| live_clone(walk, name).is_some())
        .collect();
    if !clones.is_empty() && walk.rng.chance(75) {
        walk.rng.pick(&clones).to_string()
    } else {
        any_name(walk)
    }
}

fn clone_message(walk: &mut Walk) -> String {
    let name = clone_name(walk);
    let words: Vec<String> = match walk.rng.below(6) {
        0 => vec![
            "hydration_threshold".into(),
            walk.rng.pick(&[1, 4, 64, 256]).to_string(),
        ],
        1 => vec![
            "hydration_batch_size".into(),
            walk.rng.pick(&[1, 16, 64]).to_string(),
        ],
        2..=4 => vec!["enable_hydration".into()],
        _ => vec!["disable_hydration".into()],
    };
    let mut args = vec!["message", &name, "0"];
    args.extend(words.iter().map(String::as_str));
    if !walk.world.exists(&name) {
        walk.fails(&args, "does not exist");
        return format!("message {name} {words:?}: refused, no such device");
    }
    let Some(n) = live_clone(walk, &name) else {
        walk.fails(&args, &words[0]);
        return format!("message {name} {words:?}: refused, not a clone");
    };
    walk.ok(&args);
    let settings = walk.world.clones.get_mut(&n).unwrap();
    match words[0].as_str() {
        "hydration_threshold" => settings.threshold = words[1].parse().unwrap(),
        "hydration_batch_size" => settings.batch = words[1].parse().unwrap(),
        "enable_hydration" => settings.hydrating = true,
        _ => settings.hydrating = false,
    }
    format!("message {name} {words:?}")
}

/// Whether clone `name` reports its hydration complete (`status --json`): how far a
/// background copy got is not the model's to know, only what finalize must then do.
fn hydrated(walk: &Walk, name: &str) -> bool {
    let status: serde_json::Value =
        serde_json::from_str(&walk.ok(&["status", name, "--json"])).unwrap();
    status["targets"][0]["details"]["complete"]
        .as_bool()
        .unwrap_or_else(|| panic!("no complete flag in {status}"))
}

fn finalize(walk: &mut Walk) -> String {
    let name = clone_name(walk);
    let args = ["finalize", &name];
    let Some(device) = walk.world.devices.get(&name) else {
        walk.fails(&args, "does not exist");
        return format!("finalize {name}: refused, no such device");
    };
    if device.suspended {
        walk.fails(&args, "suspended");
        return format!("finalize {name}: refused, suspended");
    }
    if device.inactive.is_some() {
        walk.fails(&args, "inactive table");
        return format!("finalize {name}: refused, it has an inactive table");
    }
    let Some(n) = live_clone(walk, &name) else {
        let out = walk.ok(&args);
        assert!(
            out.contains("nothing to finalize"),
            "finalize {name}: {out}"
        );
        return format!("finalize {name}: nothing to finalize");
    };
    let settings = &walk.world.clones[&n];
    if settings.hydrating {
        // Hydration runs in the background: wait for its end (a stall is a failure).
        let out = Command::new("timeout")
            .args(["60", crate::common::UDM, "wait", &name, "--progress"])
            .env("UDM_CONTROL", walk.daemon.control())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "udm wait {name} --progress: {}",
            udm_testkit::printed(&out)
        );
    }
    let complete = hydrated(walk, &name);
    if settings.written.iter().all(|w| *w) {
        assert!(complete, "{name}: every region written, yet not complete");
    }
    if !complete {
        walk.fails(&args, "hydration is not complete");
        return format!("finalize {name}: refused, not hydrated");
    }
    let dest = clone_dest(n);
    let table = Table::Linear { file: dest };
    assert_eq!(walk.ok(&args), table.text(&walk.daemon.dir.0));
    walk.world.devices.get_mut(&name).unwrap().live = table;
    format!("finalize {name} (clone {n})")
}

fn thin_message(walk: &mut Walk) -> String {
    let pool = if walk.rng.chance(80) {
        POOLS[0]
    } else {
        POOLS[1]
    };
    let id = walk.rng.below(*THIN_IDS.end() as u64) as u32 + 1;
    let origin = walk.rng.below(*THIN_IDS.end() as u64) as u32 + 1;
    let world = &walk.world;
    let (words, refusal): (Vec<String>, Option<String>) = match walk.rng.below(3) {
        0 => (
            vec!["create_thin".into(), id.to_string()],
            world
                .thin_exists(pool, id)
                .then(|| "already exists".to_string()),
        ),
        1 => (
            vec!["create_snap".into(), id.to_string(), origin.to_string()],
            world.snapshot_refusal(pool, id, origin).map(String::from),
        ),
        _ => {
            let users = world.thin_users(pool, id, false);
            let refusal = if !world.thin_exists(pool, id) {
                Some("does not exist".to_string())
            } else if !users.is_empty() {
                Some("in use".to_string())
            } else {
                None
            };
            (vec!["delete".into(), id.to_string()], refusal)
        }
    };
    let mut args = vec!["message", pool, "0"];
    args.extend(words.iter().map(String::as_str));
    if let Some(refusal) = refusal {
        walk.fails(&args, &refusal);
        return format!("message {pool} {words:?}: refused, {refusal}");
    }
    walk.ok(&args);
    let stores = &mut walk.world.stores;
    match words[0].as_str() {
        "create_thin" => {
            stores.insert(thin_store(pool, id), vec![0; BLOCKS]);
        }
        "create_snap" => {
            let content = stores[&thin_store(pool, origin)].clone();
            stores.insert(thin_store(pool, id), content);
        }
        _ => {
            stores.remove(&thin_store(pool, id));
            if let Some(replica) = walk.world.replicas.get_mut(&id) {
                *replica = Replica::Unknown;
            }
        }
    }
    format!("message {pool} {words:?}")
}

/// `udm send pool ID [--from BASE] | udm receive pool2 ID`: a full stream, or an increment
/// from a snapshot received before, arrives whole in the second pool and is read back there;
/// an increment from a base written since it was sent (on either side) is refused.
fn send_receive(walk: &mut Walk) -> String {
    let id = walk.rng.below(*THIN_IDS.end() as u64) as u32 + 1;
    let (from, to) = (POOLS[0], POOLS[1]);
    if walk.world.devices[from].suspended || walk.world.devices[to].suspended {
        return format!("send {from} {id}: skipped, a pool is suspended");
    }
    if walk.rng.chance(50) {
        return replication_round(walk);
    }
    // Bases the sender still has, mostly.
    let received: Vec<u32> = walk
        .world
        .replicas
        .keys()
        .copied()
        .filter(|b| walk.world.thin_exists(from, *b) || walk.rng.chance(20))
        .collect();
    let base = match walk.rng.below(10) {
        0..=3 => None,
        4..=8 if !received.is_empty() => Some(walk.rng.pick(&received)),
        _ => Some(walk.rng.below(*THIN_IDS.end() as u64) as u32 + 1),
    };
    // Mostly a device of the pool, often a snapshot taken for the send (as a replication
    // round does), else any id.
    let existing: Vec<u32> = THIN_IDS
        .filter(|id| walk.world.thin_exists(from, *id))
        .collect();
    let (id, took) = match walk.rng.below(10) {
        0..=3 => fresh_snapshot(walk, from).unwrap_or((id, String::new())),
        4..=7 if !existing.is_empty() => (walk.rng.pick(&existing), String::new()),
        _ => (id, String::new()),
    };
    send_and_receive(walk, id, base, took)
}

/// `udm send pool ID [--from BASE] | udm receive pool2 ID` (neither pool suspended), checked
/// against the model; `took` says what the step did before.
fn send_and_receive(walk: &mut Walk, id: u32, base: Option<u32>, took: String) -> String {
    let (from, to) = (POOLS[0], POOLS[1]);
    let (id_text, base_text) = (id.to_string(), base.map(|b| b.to_string()));
    let mut send = vec!["send", from, &id_text];
    if let Some(base) = &base_text {
        send.extend(["--from", base]);
    }
    let what = format!("{took}send {}", send[1..].join(" "));
    if base == Some(id) {
        walk.fails(&send, "is the snapshot sent");
        return format!("{what}: refused, its own base");
    }
    // The sender's refusals, in the order it checks: the snapshot, then the base.
    for sent in std::iter::once(id).chain(base) {
        if !walk.world.thin_exists(from, sent) {
            walk.fails(&send, "does not exist");
            return format!("{what}: refused, no thin device {sent}");
        }
        let writers = walk.world.thin_users(from, sent, true);
        if !writers.is_empty() {
            walk.fails(&send, "writable");
            return format!("{what}: refused, {sent} used by {writers:?}");
        }
    }
    let stream = walk.daemon.dir.path("stream");
    let out = Command::new("timeout")
        .args(["30", crate::common::UDM])
        .args(&send)
        .env("UDM_CONTROL", walk.daemon.control())
        .stdout(std::fs::File::create(&stream).unwrap())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "udm {send:?}: {}",
        udm_testkit::printed(&out)
    );
    let receive = Command::new("timeout")
        .args(["30", crate::common::UDM, "receive", to, &id_text])
        .env("UDM_CONTROL", walk.daemon.control())
        .stdin(std::fs::File::open(&stream).unwrap())
        .output()
        .unwrap();
    let text = udm_testkit::printed(&receive);
    let what = format!("{what} | receive {to} {id}");
    let refusal = if walk.world.thin_exists(to, id) {
        Some("exists")
    } else {
        base.and_then(|base| match walk.world.replicas.get(&base) {
            None => Some("wrong base"),
            Some(Replica::WrittenOnSender) => Some("written on the sender since it was sent"),
            Some(Replica::WrittenOnReceiver) => Some("was written here since it was received"),
            Some(Replica::Exact) if !walk.world.thin_users(to, base, true).is_empty() => {
                Some("writable")
            }
            Some(Replica::Exact) => None,
            Some(Replica::Unknown) if !receive.status.success() => Some(""),
            Some(Replica::Unknown) => None,
        })
    };
    if let Some(refusal) = refusal {
        assert!(
            !receive.status.success() && text.contains(refusal) && text.trim().lines().count() == 1,
            "udm {what} must be refused in one line naming {refusal:?}: {text}"
        );
        return format!("{what}: refused ({})", text.trim());
    }
    assert!(receive.status.success(), "udm {what}: {text}");
    let content = walk.world.stores[&thin_store(from, id)].clone();
    walk.world
        .stores
        .insert(thin_store(to, id), content.clone());
    walk.world.replicas.insert(id, Replica::Exact);
    // The replica, read back through a table of its own.
    let table = Table::Thin { pool: to, id }.text(&walk.daemon.dir.0);
    walk.ok(&["create", RECEIVED, "--readonly", "--table", &table]);
    walk.check_bytes(RECEIVED, &content);
    walk.ok(&["remove", RECEIVED]);
    what
}

/// A step of replication as it is done: volume `v` (thin device `VOLUME` of the first pool)
/// written, snapshotted (suspended around the `create_snap`) and each snapshot sent, in full
/// or as an increment from the last one received; now and then a sent base written through
/// a table of its own on either side, after which an increment from it must be refused.
fn replication_round(walk: &mut Walk) -> String {
    let pool = POOLS[0];
    if !walk.world.thin_exists(pool, VOLUME) {
        walk.ok(&["message", pool, "0", "create_thin", &VOLUME.to_string()]);
        walk.world
            .stores
            .insert(thin_store(pool, VOLUME), vec![0; BLOCKS]);
        let table = Table::Thin { pool, id: VOLUME };
        return format!(
            "message {pool} 0 create_thin {VOLUME}; {}",
            create_classic(walk, REPLICATED, table)
        );
    }
    let bases: Vec<u32> = SNAPSHOT_IDS
        .filter(|b| walk.world.replicas.contains_key(b) && walk.world.thin_exists(pool, *b))
        .collect();
    match walk.rng.below(10) {
        0..=3 => write_somewhere(walk, REPLICATED),
        8 | 9 if !bases.is_empty() => {
            let (base, side) = (walk.rng.pick(&bases), walk.rng.pick(&POOLS));
            if !walk.world.thin_exists(side, base) {
                return format!("write {side}:{base}: skipped, deleted");
            }
            create_classic(
                walk,
                WRITER,
                Table::Thin {
                    pool: side,
                    id: base,
                },
            );
            let wrote = write_somewhere(walk, WRITER);
            walk.ok(&["remove", WRITER]);
            walk.world.devices.remove(WRITER);
            format!("{wrote} (thin device {base} of {side}, sent)")
        }
        _ => {
            // A snapshot id free in both pools: the oldest snapshot goes from both if need be.
            let id = walk.rng.pick(&SNAPSHOT_IDS.collect::<Vec<_>>());
            let mut took = String::new();
            for side in POOLS {
                if walk.world.thin_exists(side, id) {
                    walk.ok(&["message", side, "0", "delete", &id.to_string()]);
                    walk.world.stores.remove(&thin_store(side, id));
                    walk.world.replicas.insert(id, Replica::Unknown);
                    took += &format!("message {side} 0 delete {id}; ");
                }
            }
            walk.ok(&["suspend", REPLICATED]);
            walk.ok(&[
                "message",
                pool,
                "0",
                "create_snap",
                &id.to_string(),
                &VOLUME.to_string(),
            ]);
            walk.ok(&["resume", REPLICATED]);
            let now = walk.world.stores[&thin_store(pool, VOLUME)].clone();
            walk.world.stores.insert(thin_store(pool, id), now);
            took += &format!("message {pool} 0 create_snap {id} {VOLUME}; ");
            // Mostly an increment from a snapshot received before.
            let bases: Vec<u32> = bases.into_iter().filter(|b| *b != id).collect();
            let base = (!bases.is_empty() && walk.rng.chance(80)).then(|| walk.rng.pick(&bases));
            send_and_receive(walk, id, base, took)
        }
    }
}

/// Takes a snapshot of a device of `pool` into a free id, if one may be taken; returns its id
/// and what was done.
fn fresh_snapshot(walk: &mut Walk, pool: &'static str) -> Option<(u32, String)> {
    let world = &walk.world;
    // Free in the receiving pool too, where there is such an id, so that it can be received.
    let free_in = |pools: &[&str]| -> Vec<u32> {
        THIN_IDS
            .filter(|id| pools.iter().all(|pool| !world.thin_exists(pool, *id)))
            .collect()
    };
    let free = match free_in(&POOLS) {
        both if !both.is_empty() => both,
        _ => free_in(&[pool]),
    };
    let origins: Vec<u32> = THIN_IDS
        .filter(|origin| {
            free.first()
                .is_some_and(|id| world.snapshot_refusal(pool, *id, *origin).is_none())
        })
        .collect();
    if origins.is_empty() {
        return None;
    }
    let (id, origin) = (walk.rng.pick(&free), walk.rng.pick(&origins));
    let (id_text, origin_text) = (id.to_string(), origin.to_string());
    walk.ok(&["message", pool, "0", "create_snap", &id_text, &origin_text]);
    let content = walk.world.stores[&thin_store(pool, origin)].clone();
    walk.world.stores.insert(thin_store(pool, id), content);
    Some((id, format!("message {pool} 0 create_snap {id} {origin}; ")))
}

/// One step in the life of a classic snapshot, chosen by where that life is: the origin
/// device made, a snapshot of it taken, both written (the snapshot must keep the origin as it
/// was at its first resume), the snapshot suspended and merged back into the origin, the
/// snapshot device removed, the merge waited for and finalized. The walk's restarts and
/// `kill -9`s fall between any two of these steps, in the middle of a merge among them.
fn classic(walk: &mut Walk) -> String {
    let Some(origin) = walk.world.devices.get(ORIGIN) else {
        return create_classic(walk, ORIGIN, Table::Origin);
    };
    if let Table::Merge { cow } = origin.live {
        return if walk.world.exists(SNAPSHOT) {
            // The snapshot device's I/O fails from the merge's resume on: LVM drops it.
            walk.ok(&["remove", SNAPSHOT]);
            walk.world.devices.remove(SNAPSHOT);
            format!("remove {SNAPSHOT} (merging)")
        } else if walk.rng.chance(40) {
            write_classic(walk, ORIGIN)
        } else {
            finish_merge(walk, cow)
        };
    }
    let Some(snapshot) = walk.world.devices.get(SNAPSHOT) else {
        return match walk.rng.below(10) {
            0..=1 => write_classic(walk, ORIGIN),
            2 => {
                walk.ok(&["remove", ORIGIN]);
                walk.world.devices.remove(ORIGIN);
                format!("remove {ORIGIN}")
            }
            _ => take_snapshot(walk),
        };
    };
    let Table::Snapshot { cow } = snapshot.live else {
        unreachable!("only the classic steps make {SNAPSHOT}")
    };
    let handover_refused = format!(
        "unable to perform snapshot handover until source is suspended: device '{SNAPSHOT}'"
    );
    if !snapshot.suspended {
        return match walk.rng.below(10) {
            0..=1 => write_classic(walk, ORIGIN),
            2..=3 => write_classic(walk, SNAPSHOT),
            4 => {
                // Two live tables on one COW device would write one store as aliases.
                let table = Table::Snapshot { cow }.text(&walk.daemon.dir.0);
                walk.fails(&["create", TWIN, "--table", &table], &handover_refused);
                format!("create {TWIN} on {SNAPSHOT}'s COW device: refused, {SNAPSHOT} is live")
            }
            5 => {
                // The merge takes the COW device over, so the snapshot device must be
                // suspended first (the kernel's snapshot_preresume): the resume is refused,
                // and the merge table stays loaded until cleared.
                let table = Table::Merge { cow };
                walk.ok(&["load", ORIGIN, "--table", &table.text(&walk.daemon.dir.0)]);
                walk.fails(&["resume", ORIGIN], &handover_refused);
                walk.ok(&["clear", ORIGIN]);
                format!("merge into {ORIGIN}: refused, {SNAPSHOT} is live")
            }
            _ => {
                walk.ok(&["suspend", SNAPSHOT]);
                walk.world.devices.get_mut(SNAPSHOT).unwrap().suspended = true;
                format!("suspend {SNAPSHOT}")
            }
        };
    }
    match walk.rng.below(10) {
        0..=1 => {
            walk.ok(&["resume", SNAPSHOT]);
            walk.world.devices.get_mut(SNAPSHOT).unwrap().suspended = false;
            walk.check_data(SNAPSHOT);
            format!("resume {SNAPSHOT}")
        }
        2..=3 => write_classic(walk, ORIGIN),
        _ => start_merge(walk, cow),
    }
}

fn create_classic(walk: &mut Walk, name: &str, table: Table) -> String {
    walk.ok(&["create", name, "--table", &table.text(&walk.daemon.dir.0)]);
    walk.world.devices.insert(
        name.to_string(),
        Device {
            live: table.clone(),
            inactive: None,
            suspended: false,
            event_nr: None,
        },
    );
    walk.check_data(name);
    format!("create {name} {table:?}")
}

/// A snapshot on a fresh COW device: it reads as the origin does now.
fn take_snapshot(walk: &mut Walk) -> String {
    let cow = walk.world.next_cow;
    walk.world.next_cow += 1;
    walk.daemon.sparse(&cow_file(cow), COW_BYTES);
    let now = walk.world.stores[ORIGIN_FILE].clone();
    walk.world.stores.insert(cow_file(cow), now);
    create_classic(walk, SNAPSHOT, Table::Snapshot { cow })
}

/// A write to the origin or the snapshot; both are read back (the other must not change).
fn write_classic(walk: &mut Walk, name: &str) -> String {
    let done = write_somewhere(walk, name);
    for other in [ORIGIN, SNAPSHOT] {
        if other != name && walk.world.exists(other) && walk.world.flows(other) {
            walk.check_data(other);
        }
    }
    done
}

/// The merge of suspended snapshot `cow` into the origin: the origin reads as the snapshot
/// at once, and copies it back in the background, slowly, so that restarts come mid-merge.
fn start_merge(walk: &mut Walk, cow: usize) -> String {
    let table = Table::Merge { cow };
    walk.ok(&["load", ORIGIN, "--table", &table.text(&walk.daemon.dir.0)]);
    walk.ok(&["resume", ORIGIN]);
    walk.ok(&["message", ORIGIN, "0", "max_merge_rate", "256"]);
    let view = walk.world.stores[&cow_file(cow)].clone();
    walk.world.stores.insert(ORIGIN_FILE.into(), view);
    walk.world.devices.get_mut(ORIGIN).unwrap().live = table.clone();
    walk.check_data(ORIGIN);
    format!("merge {SNAPSHOT} into {ORIGIN} {table:?}")
}

/// The end of a merge: waited for (a stall is a failure), then finalized back to
/// `snapshot-origin`, the origin reading as the snapshot did.
fn finish_merge(walk: &mut Walk, cow: usize) -> String {
    walk.ok(&["message", ORIGIN, "0", "max_merge_rate", "0"]);
    let out = Command::new("timeout")
        .args(["60", crate::common::UDM, "wait", ORIGIN, "--progress"])
        .env("UDM_CONTROL", walk.daemon.control())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "udm wait {ORIGIN} --progress: {}",
        udm_testkit::printed(&out)
    );
    walk.ok(&["finalize", ORIGIN]);
    walk.world.devices.get_mut(ORIGIN).unwrap().live = Table::Origin;
    walk.check_data(ORIGIN);
    format!("finalize {ORIGIN} (merged {})", cow_file(cow))
}
