//! The verbs of the walk: each picks its arguments, predicts the outcome from the model,
//! runs the real verb, checks that it succeeded or failed as predicted and updates the model.

use std::process::Command;

use crate::world::*;
use crate::Walk;

/// One random step; returns what it did, for the step log.
pub fn random_step(walk: &mut Walk) -> String {
    let roll = walk.rng.below(100);
    match roll {
        0..=11 => create(walk),
        12..=18 => load(walk),
        19..=21 => clear(walk),
        22..=28 => suspend(walk),
        29..=37 => resume(walk),
        38..=41 => rename(walk),
        42..=47 => remove(walk),
        48..=59 => write(walk),
        60..=65 => clone_message(walk),
        66..=72 => finalize(walk),
        73..=83 => thin_message(walk),
        84..=89 => send_receive(walk),
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
    if !walk.world.flows_below(&name) {
        // A removal flushes the device's table, and that flush waits for the suspended
        // device below it to be resumed (removal.rs: by design, outside the lock so that
        // the resume can come); the walk has one thread to resume it with.
        return format!("remove {name}: skipped, it would wait for a device below to resume");
    }
    let holders = walk.world.holders(&name);
    if !holders.is_empty() {
        walk.fails(&["remove", &name], &holders[0]);
        return format!("remove {name}: refused, used by {holders:?}");
    }
    walk.ok(&["remove", &name]);
    walk.world.devices.remove(&name);
    format!("remove {name}")
}

/// A pattern written through NBD and flushed, then read back; only where I/O flows (I/O to
/// a suspended device waits, as it must).
fn write(walk: &mut Walk) -> String {
    let name = any_name(walk);
    if !walk.world.exists(&name) || !walk.world.flows(&name) {
        return format!("write {name}: skipped, missing or suspended");
    }
    let first = walk.rng.below(BLOCKS as u64) as usize;
    let blocks = 1 + walk.rng.below((BLOCKS - first).min(8) as u64) as usize;
    let byte = 1 + walk.rng.below(255) as u8;
    walk.write(&name, first, blocks, byte);
    if let Content::Store(store) = walk.world.content(&name) {
        walk.world.stores.get_mut(&store).unwrap()[first..first + blocks].fill(byte);
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
        1 => {
            let active = world
                .thin_users(pool, origin, true)
                .into_iter()
                .filter(|user| !world.devices[user].suspended)
                .collect::<Vec<_>>();
            let refusal = if world.thin_exists(pool, id) {
                Some("already exists".to_string())
            } else if !world.thin_exists(pool, origin) {
                Some("does not exist".to_string())
            } else if !active.is_empty() {
                Some("is active as".to_string())
            } else {
                None
            };
            (
                vec!["create_snap".into(), id.to_string(), origin.to_string()],
                refusal,
            )
        }
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
        }
    }
    format!("message {pool} {words:?}")
}

/// `udm send pool ID | udm receive pool2 ID`: the snapshot arrives whole in the second pool.
fn send_receive(walk: &mut Walk) -> String {
    let id = walk.rng.below(*THIN_IDS.end() as u64) as u32 + 1;
    let (from, to) = (POOLS[0], POOLS[1]);
    if walk.world.devices[from].suspended || walk.world.devices[to].suspended {
        return format!("send {from} {id}: skipped, a pool is suspended");
    }
    let id_text = id.to_string();
    let send = ["send", from, &id_text];
    if !walk.world.thin_exists(from, id) {
        walk.fails(&send, "does not exist");
        return format!("send {from} {id}: refused, no such thin device");
    }
    let writers = walk.world.thin_users(from, id, true);
    if !writers.is_empty() {
        walk.fails(&send, "writable");
        return format!("send {from} {id}: refused, used by {writers:?}");
    }
    let stream = walk.daemon.dir.path("stream");
    let out = Command::new("timeout")
        .args(["30", crate::common::UDM])
        .args(send)
        .env("UDM_CONTROL", walk.daemon.control())
        .stdout(std::fs::File::create(&stream).unwrap())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "udm send {from} {id}: {}",
        udm_testkit::printed(&out)
    );
    let receive = Command::new("timeout")
        .args(["30", crate::common::UDM, "receive", to, &id_text])
        .env("UDM_CONTROL", walk.daemon.control())
        .stdin(std::fs::File::open(&stream).unwrap())
        .output()
        .unwrap();
    let text = udm_testkit::printed(&receive);
    if walk.world.thin_exists(to, id) {
        assert!(
            !receive.status.success() && text.contains("exists"),
            "udm receive {to} {id} over an existing thin device: {text}"
        );
        return format!("send {from} {id} | receive {to} {id}: refused, it exists");
    }
    assert!(receive.status.success(), "udm receive {to} {id}: {text}");
    let content = walk.world.stores[&thin_store(from, id)].clone();
    walk.world.stores.insert(thin_store(to, id), content);
    format!("send {from} {id} | receive {to} {id}")
}
