//! The model: what the daemon should hold, as plain data, and how each table reads it.

use std::collections::BTreeMap;
use std::path::Path;

/// Every data device is 4 MiB: 64 blocks of 64 KiB, each holding one byte value throughout.
pub const BLOCK: u64 = 64 * 1024;
pub const BLOCKS: usize = 64;
pub const SECTORS: u64 = BLOCK * BLOCKS as u64 / 512;
/// The names the walk picks devices by; few, so that verbs collide (and must fail) often.
pub const NAMES: [&str; 5] = ["a", "b", "c", "d", "e"];
/// Thin pools, made at the start and never removed (snapshots are sent from the first to
/// the second); thin device ids are picked from `THIN_IDS`.
pub const POOLS: [&str; 2] = ["pool", "pool2"];
pub const THIN_IDS: std::ops::RangeInclusive<u32> = 1..=6;
/// The replicated volume, device `v`, is thin device `VOLUME` of the first pool; its
/// snapshots, sent to the second pool under the same ids, take ids from `SNAPSHOT_IDS`; a
/// sent snapshot is written through device `w`. Out of the other verbs' way.
pub const VOLUME: u32 = 7;
pub const SNAPSHOT_IDS: std::ops::RangeInclusive<u32> = 8..=10;
pub const REPLICATED: &str = "v";
pub const WRITER: &str = "w";
/// Plain backing files linear tables map.
pub const FILES: usize = 3;
/// Classic snapshots have devices of their own, out of the way of the other verbs: `o`
/// serves the origin file, `s` is a snapshot of it, and `t` a second snapshot table on `s`'s
/// COW device (a handover, refused while `s` is live).
pub const ORIGIN: &str = "o";
pub const SNAPSHOT: &str = "s";
pub const TWIN: &str = "t";
/// A received thin device is read back through a read-only device of this name, at once
/// removed.
pub const RECEIVED: &str = "r";
pub const ORIGIN_FILE: &str = "origin.img";
/// A COW device holds every chunk of the origin and its metadata with room to spare.
pub const COW_BYTES: u64 = 2 * BLOCK * BLOCKS as u64;

/// A source file every clone copies from; never written, so its blocks are these.
pub fn source_byte(block: usize) -> u8 {
    0x40 + (block % 32) as u8
}

#[derive(Clone, Debug, PartialEq)]
pub enum Table {
    Zero,
    /// `linear` over all of a file of the scratch directory.
    Linear {
        file: String,
    },
    /// `linear` over another device.
    Over {
        below: String,
    },
    /// A clone of the source file onto `clone{n}.dest`, created without hydration.
    Clone {
        n: usize,
        threshold: u32,
        batch: u32,
    },
    Thin {
        pool: &'static str,
        id: u32,
    },
    /// `snapshot-origin` over the origin file.
    Origin,
    /// A `snapshot` of the origin file on COW file `cow_file(cow)`, in chunks of 4 KiB.
    Snapshot {
        cow: usize,
    },
    /// `snapshot-merge` of COW file `cow_file(cow)` back into the origin file.
    Merge {
        cow: usize,
    },
}

impl Table {
    /// The table line, as `udm table` prints it back.
    pub fn text(&self, dir: &Path) -> String {
        let path = |file: &str| dir.join(file).display().to_string();
        match self {
            Table::Zero => format!("0 {SECTORS} zero"),
            Table::Linear { file } => format!("0 {SECTORS} linear {} 0", path(file)),
            Table::Over { below } => format!("0 {SECTORS} linear {below} 0"),
            Table::Clone {
                n,
                threshold,
                batch,
            } => format!(
                "0 {SECTORS} clone {} {} {} 128 1 no_hydration 4 hydration_threshold {threshold} \
                 hydration_batch_size {batch}",
                path(&format!("clone{n}.meta")),
                path(&clone_dest(*n)),
                path("source.img")
            ),
            Table::Thin { pool, id } => format!("0 {SECTORS} thin {pool} {id}"),
            Table::Origin => format!("0 {SECTORS} snapshot-origin {}", path(ORIGIN_FILE)),
            Table::Snapshot { cow } => format!(
                "0 {SECTORS} snapshot {} {} P 8",
                path(ORIGIN_FILE),
                path(&cow_file(*cow))
            ),
            Table::Merge { cow } => format!(
                "0 {SECTORS} snapshot-merge {} {} P 8",
                path(ORIGIN_FILE),
                path(&cow_file(*cow))
            ),
        }
    }
}

pub fn clone_dest(n: usize) -> String {
    format!("clone{n}.dest")
}

/// A COW file; in the model's stores, the snapshot's view: the origin as it was at the
/// snapshot's first resume, with the snapshot's own writes.
pub fn cow_file(n: usize) -> String {
    format!("cow{n}.img")
}

pub fn thin_store(pool: &str, id: u32) -> String {
    format!("{pool}:{id}")
}

/// A clone's settings as its messages left them (the table keeps its creation line).
#[derive(Clone, Debug, PartialEq)]
pub struct CloneSettings {
    pub threshold: u32,
    pub batch: u32,
    pub hydrating: bool,
    /// Blocks written through the clone: whole regions, hydrated without a copy.
    pub written: [bool; BLOCKS],
}

#[derive(Clone, Debug)]
pub struct Device {
    pub live: Table,
    pub inactive: Option<Table>,
    pub suspended: bool,
    /// The last event number seen while this daemon lives.
    pub event_nr: Option<u64>,
}

/// What a device reads as.
pub enum Content {
    Zero,
    Store(String),
}

/// What the second pool's copy of a thin device is to an increment from it (the walk
/// receives the first pool's device ID as the second pool's device ID).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Replica {
    /// Received, and neither copy written since: an increment from it must be received.
    Exact,
    /// Written on the sender since it was sent: an increment from it must be refused.
    WrittenOnSender,
    /// Written on the receiver since it was received (and not on the sender): refused.
    WrittenOnReceiver,
    /// Deleted on either side since, perhaps made again: whether the stamps and creation
    /// times tell is not the model's to know. An increment from it may be refused, but one
    /// received must make the snapshot.
    Unknown,
}

#[derive(Default)]
pub struct World {
    pub devices: BTreeMap<String, Device>,
    /// Block contents of every backing store: files by name, thin devices as `pool:id`.
    pub stores: BTreeMap<String, Vec<u8>>,
    /// Settings of each clone by number (kept after it is finalized: harmless).
    pub clones: BTreeMap<usize, CloneSettings>,
    pub next_clone: usize,
    /// The number of the next snapshot's COW file (each snapshot gets a fresh one).
    pub next_cow: usize,
    /// The second pool's received copies of the first pool's thin devices, by id.
    pub replicas: BTreeMap<u32, Replica>,
}

impl World {
    pub fn new() -> World {
        let mut world = World::default();
        for f in 0..FILES {
            world.stores.insert(file_name(f), vec![0; BLOCKS]);
        }
        world.stores.insert(ORIGIN_FILE.into(), vec![0; BLOCKS]);
        world
    }

    pub fn exists(&self, name: &str) -> bool {
        self.devices.contains_key(name)
    }

    pub fn thin_exists(&self, pool: &str, id: u32) -> bool {
        self.stores.contains_key(&thin_store(pool, id))
    }

    /// Devices whose live or inactive table names `name`.
    pub fn holders(&self, name: &str) -> Vec<String> {
        self.devices
            .iter()
            .filter(|(_, d)| {
                std::iter::once(&d.live)
                    .chain(&d.inactive)
                    .any(|t| matches!(t, Table::Over { below } if below == name))
            })
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Why `create_snap id origin` must be refused in `pool` now: what its error says.
    pub fn snapshot_refusal(&self, pool: &str, id: u32, origin: u32) -> Option<&'static str> {
        let active = self
            .thin_users(pool, origin, true)
            .into_iter()
            .any(|user| !self.devices[&user].suspended);
        // The pool asks about an active origin first (pool.rs), the metadata the rest.
        if active {
            Some("is active as")
        } else if self.thin_exists(pool, id) {
            Some("already exists")
        } else if !self.thin_exists(pool, origin) {
            Some("does not exist")
        } else {
            None
        }
    }

    /// Devices whose live or inactive table maps thin device `id` of `pool`.
    pub fn thin_users(&self, pool: &str, id: u32, live_only: bool) -> Vec<String> {
        let wanted = Table::Thin {
            pool: POOLS.iter().find(|p| **p == pool).unwrap(),
            id,
        };
        self.devices
            .iter()
            .filter(|(_, d)| {
                d.live == wanted || (!live_only && d.inactive.as_ref() == Some(&wanted))
            })
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Whether `name`'s table would reach `target` through the devices it is built on.
    pub fn reaches(&self, table: &Table, target: &str) -> bool {
        let Table::Over { below } = table else {
            return false;
        };
        below == target
            || self.devices.get(below).is_some_and(|d| {
                std::iter::once(&d.live)
                    .chain(&d.inactive)
                    .any(|t| self.reaches(t, target))
            })
    }

    /// Why `table` cannot be built now, for a device named `name`: what its error must name.
    pub fn unbuildable(&self, name: &str, table: &Table) -> Option<String> {
        match table {
            Table::Over { below } if !self.exists(below) => Some(below.clone()),
            Table::Over { below } if below == name || self.reaches(table, name) => {
                Some(below.clone())
            }
            // A thin device is not activated while its pool is suspended.
            Table::Thin { pool, .. } if self.devices[*pool].suspended => {
                Some("suspended".to_string())
            }
            Table::Thin { pool, id } if !self.thin_exists(pool, *id) => Some(format!("{id}")),
            _ => None,
        }
    }

    pub fn is_pool(&self, name: &str) -> bool {
        POOLS.contains(&name)
    }

    /// What `name` reads as through its live table and those below.
    pub fn content(&self, name: &str) -> Content {
        match &self.devices[name].live {
            Table::Zero => Content::Zero,
            Table::Linear { file } => Content::Store(file.clone()),
            Table::Over { below } => self.content(below),
            Table::Clone { n, .. } => Content::Store(clone_dest(*n)),
            Table::Thin { pool, id } => Content::Store(thin_store(pool, *id)),
            // A merge reads as the snapshot at once: the model copies the snapshot's view
            // onto the origin's when the merge is resumed.
            Table::Origin | Table::Merge { .. } => Content::Store(ORIGIN_FILE.into()),
            Table::Snapshot { cow } => Content::Store(cow_file(*cow)),
        }
    }

    /// Whether I/O to `name` flows: it and every device under its live table are active.
    pub fn flows(&self, name: &str) -> bool {
        !self.devices[name].suspended && self.flows_below(name)
    }

    /// Whether I/O from `name`'s live table flows into the devices under it.
    pub fn flows_below(&self, name: &str) -> bool {
        match &self.devices[name].live {
            Table::Over { below } => self.flows(below),
            Table::Thin { pool, .. } => !self.devices[*pool].suspended,
            _ => true,
        }
    }

    /// The expected bytes of `name`, block by block.
    pub fn expected(&self, name: &str) -> Vec<u8> {
        match self.content(name) {
            Content::Zero => vec![0; BLOCKS],
            Content::Store(store) => self.stores[&store].clone(),
        }
    }

    /// A write has reached backing store `store`: a thin device's copy, sent or received,
    /// is then no base for an increment.
    pub fn written(&mut self, store: &str) {
        let Some((pool, id)) = store.split_once(':') else {
            return;
        };
        let Some(replica) = self.replicas.get_mut(&id.parse().unwrap()) else {
            return;
        };
        *replica = match (*replica, pool == POOLS[0]) {
            (Replica::Unknown, _) => Replica::Unknown,
            // The receiver checks the sender's stamp first.
            (_, true) | (Replica::WrittenOnSender, false) => Replica::WrittenOnSender,
            (_, false) => Replica::WrittenOnReceiver,
        };
    }

    /// A new clone's number, its settings and destination as the model sees them.
    pub fn new_clone(&mut self, threshold: u32, batch: u32) -> Table {
        let n = self.next_clone;
        self.next_clone += 1;
        self.clones.insert(
            n,
            CloneSettings {
                threshold,
                batch,
                hydrating: false,
                written: [false; BLOCKS],
            },
        );
        self.stores
            .insert(clone_dest(n), (0..BLOCKS).map(source_byte).collect());
        Table::Clone {
            n,
            threshold,
            batch,
        }
    }
}

pub fn file_name(f: usize) -> String {
    format!("F{f}.img")
}
