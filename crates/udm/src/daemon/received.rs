//! What a daemon remembers of the snapshots it received, per pool, in
//! `STATE_DIR/replication/POOL.json`: which local thin device is which source snapshot (so
//! that an incremental stream finds its base, and one onto the wrong base is refused), and
//! the receives in progress that may resume (their hidden staging device, and the records it
//! holds durably).
//!
//! Entries name local thin devices by id and creation time: one whose device was deleted, or
//! whose id was reused since, no longer counts. A pool made again under the same name on new
//! metadata reuses ids and creation times from the start, so the file also names the pool by
//! its identity (its metadata's uuid): the file of an older pool of that name is set aside
//! (`POOL.json.stale-UUID`), never taken for the new pool's.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};

use log::warn;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use udm_targets::replica::PoolHandle;

use super::state_dir::write_durably;
use crate::replication::stream::{Header, Stamp};

/// A source snapshot: the source pool, and the snapshot's id and creation time there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    pub source: String,
    pub id: u32,
    pub time: u32,
}

impl Snapshot {
    pub fn to_of(h: &Header) -> Snapshot {
        Snapshot {
            source: h.source.clone(),
            id: h.to_id,
            time: h.to_time,
        }
    }

    pub fn from_of(h: &Header) -> Option<Snapshot> {
        (!h.is_full()).then(|| Snapshot {
            source: h.source.clone(),
            id: h.from_id,
            time: h.from_time,
        })
    }
}

impl std::fmt::Display for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "snapshot {} (time {}) of {}",
            self.id, self.time, self.source
        )
    }
}

/// What thin device `id` of `pool` holds, as its metadata tells (see [`Stamp`]).
pub fn stamp_of(pool: &PoolHandle, id: u32) -> Result<Stamp, String> {
    let mapped_blocks = pool.device(id).map_or(0, |d| d.mapped_blocks);
    let newest_mapping = pool.newest_mapping_time(id).map_err(|e| e.to_string())?;
    Ok(Stamp {
        newest_mapping,
        mapped_blocks,
    })
}

/// A local thin device that holds a received snapshot.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Mark {
    pub snapshot: Snapshot,
    /// The local device's creation time when it was received.
    pub local_time: u32,
    pub volume_bytes: u64,
    /// What the source snapshot held when it was sent, and what the local device held when
    /// it was received: an increment onto it must find both unchanged (a base written on
    /// either side since is not the snapshot the increment goes from). None: received by a
    /// udm that did not record them, and taken as it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sent: Option<Stamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local: Option<Stamp>,
}

/// What fixes a stream's records besides its snapshots' names: a kept receive continues
/// only a stream of the same plan (a snapshot written on the sender since, or a sending pool
/// made again under its name, has the same name and other records).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    pub block_bytes: u32,
    pub records: u64,
    pub changed_bytes: u64,
    pub to_stamp: Stamp,
    pub from_stamp: Stamp,
}

impl Plan {
    pub fn of(h: &Header) -> Plan {
        Plan {
            block_bytes: h.block_bytes,
            records: h.records,
            changed_bytes: h.changed_bytes,
            to_stamp: h.to_stamp,
            from_stamp: h.from_stamp,
        }
    }
}

impl std::fmt::Display for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} records of {} changed bytes, the snapshot with {}",
            self.records, self.changed_bytes, self.to_stamp
        )
    }
}

/// A receive in progress into thin device `id` (the map's key).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Partial {
    pub to: Snapshot,
    pub from: Option<Snapshot>,
    /// The hidden device the records go to, and its creation time (None: recorded before
    /// it was made, which a crash may have stopped).
    pub staging: u32,
    pub staging_time: Option<u32>,
    /// Records before this one are durable in the staging device.
    pub next_record: u64,
    /// The layout checksum of those records.
    pub layout: u32,
    /// Asked to be kept for resuming (`--resume`); one that was not goes at the next start
    /// of the daemon, if a crash stopped it. Files from before this was recorded keep theirs.
    #[serde(default = "kept")]
    pub resume: bool,
    /// The stream checked out and the staging device is being published, as a volume of
    /// this many bytes: recorded first, so that a crash after the publish's commit and
    /// before the record of what was received leaves what to complete it with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publishing: Option<u64>,
    /// The plan of the stream being received. None: kept by a udm that did not record it,
    /// and continued without that check.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<Plan>,
}

fn kept() -> bool {
    true
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct PoolState {
    /// The identity of the pool this is the state of (see [`identity_of`]). None: written
    /// before files named their pool, and taken for the open pool's (named at the next update).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_uuid: Option<String>,
    #[serde(default)]
    pub received: BTreeMap<u32, Mark>,
    #[serde(default)]
    pub partial: BTreeMap<u32, Partial>,
}

/// Serialises changes to the files (receives into different devices of a pool may run at once).
static WRITING: Mutex<()> = Mutex::new(());

/// The pools (by name and identity: a copy of a pool's metadata has its identity) seen in this
/// run of the daemon (see [`settle`]).
static SETTLED: Mutex<BTreeSet<(String, String)>> = Mutex::new(BTreeSet::new());

fn path(state_dir: &Path, pool: &str) -> PathBuf {
    state_dir.join("replication").join(format!("{pool}.json"))
}

/// The identity of `pool` (its metadata's uuid, in hex). A pool without one (kept read-only
/// since before pools had one, or restored by thin_restore) cannot be told from an older pool
/// of its name.
pub fn identity_of(pool_name: &str, pool: &PoolHandle) -> io::Result<String> {
    let uuid = pool.identity().ok_or_else(|| {
        io::Error::other(format!(
            "pool '{pool_name}' has no identity yet: open it writable once before receiving \
             into it"
        ))
    })?;
    Ok(uuid.iter().map(|b| format!("{b:02x}")).collect())
}

/// At the first use of a pool in this run of the daemon (its first table, at the start or
/// made later, or a receive into it), before any receive into it runs: a publish still
/// recorded as under way did not commit (its staging device is there, and a later loss of
/// that device must not pass for its commit), and one that did is recorded as received for
/// good (`id` deleted and made again would not be the device published). The file of an
/// older pool of its name is set aside then. A pool without an identity yet is left until it
/// has one.
pub fn settle(state_dir: &Path, pool_name: &str, pool: &PoolHandle) -> io::Result<()> {
    let Ok(identity) = identity_of(pool_name, pool) else {
        return Ok(());
    };
    let seen = (pool_name.to_string(), identity);
    // Seen once: later, a publish recorded as under way may be a receive's that runs.
    if !SETTLED.lock().insert(seen.clone()) || !path(state_dir, pool_name).exists() {
        return Ok(());
    }
    let settled = PoolState::update(state_dir, pool_name, pool, |s| {
        for p in s.partial.values_mut() {
            p.publishing = None;
        }
    });
    if settled.is_err() {
        // Tried again at the pool's next use.
        SETTLED.lock().remove(&seen);
    }
    settled
}

impl PoolState {
    /// The pool's state, without entries whose local devices are gone or were made again.
    pub fn load(state_dir: &Path, pool_name: &str, pool: &PoolHandle) -> io::Result<Self> {
        Ok(Self::load_with_older(state_dir, pool_name, pool)?.0)
    }

    /// [`PoolState::load`]; if the file is of an older pool of this name, an empty state and
    /// that pool's identity.
    fn load_with_older(
        state_dir: &Path,
        pool_name: &str,
        pool: &PoolHandle,
    ) -> io::Result<(Self, Option<String>)> {
        let mut state: PoolState = match std::fs::read(path(state_dir, pool_name)) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(io::Error::other)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Default::default()),
            Err(e) => return Err(e),
        };
        let identity = identity_of(pool_name, pool)?;
        match state.pool_uuid.replace(identity.clone()) {
            Some(older) if older != identity => {
                // It names the file the state is set aside as.
                if older.is_empty() || !older.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(io::Error::other(format!(
                        "pool_uuid {older:?} is not a uuid in hex"
                    )));
                }
                let state = PoolState {
                    pool_uuid: Some(identity),
                    ..Default::default()
                };
                return Ok((state, Some(older)));
            }
            _ => {}
        }
        let created = |id: u32| pool.device(id).map(|d| d.creation_time);
        // A publish a crash cut short after its commit: the staging device is gone, and `id`
        // was made after it (the publish's snapshot moves the pool's time on). Received.
        let published: Vec<u32> = (state.partial.iter())
            .filter(|(id, p)| {
                p.publishing.is_some()
                    && p.staging_time.is_some()
                    && created(p.staging).is_none()
                    && created(**id) > p.staging_time
            })
            .map(|(id, _)| *id)
            .collect();
        for id in published {
            let p = state.partial.remove(&id).expect("listed above");
            let mark = Mark {
                snapshot: p.to,
                local_time: created(id).expect("listed above"),
                volume_bytes: p.publishing.expect("listed above"),
                sent: p.plan.map(|plan| plan.to_stamp),
                // Not written since: the pool has had no table in this run of the daemon.
                local: stamp_of(pool, id).ok(),
            };
            state.received.insert(id, mark);
        }
        state
            .received
            .retain(|id, mark| created(*id) == Some(mark.local_time));
        // A staging device recorded just before it was made is the device of that id, if
        // the pool has one.
        for p in state.partial.values_mut() {
            if p.staging_time.is_none() {
                p.staging_time = created(p.staging);
            }
        }
        state
            .partial
            .retain(|_, p| p.staging_time.is_some() && created(p.staging) == p.staging_time);
        Ok((state, None))
    }

    /// Changes the pool's state on disk with `change` (read again under the lock, so that
    /// concurrent receives into other devices are kept). The file of an older pool of this
    /// name is set aside first.
    pub fn update(
        state_dir: &Path,
        pool_name: &str,
        pool: &PoolHandle,
        change: impl FnOnce(&mut PoolState),
    ) -> io::Result<()> {
        let identity = identity_of(pool_name, pool)?;
        let _writing = WRITING.lock();
        let (mut state, older) = Self::load_with_older(state_dir, pool_name, pool)?;
        let file = path(state_dir, pool_name);
        if let Some(older) = older {
            set_aside(&file, pool_name, &older, &identity)?;
        }
        state.pool_uuid = Some(identity);
        change(&mut state);
        std::fs::create_dir_all(file.parent().expect("in a directory"))?;
        write_durably(
            &file,
            &serde_json::to_vec_pretty(&state).expect("serialisable"),
        )
    }

    /// The local device holding `snapshot`, if one does.
    pub fn holder_of(&self, snapshot: &Snapshot) -> Option<u32> {
        self.received
            .iter()
            .find(|(_, mark)| mark.snapshot == *snapshot)
            .map(|(id, _)| *id)
    }
}

/// Keeps `file`, the state of an older pool of this name, beside it (a user may want what it
/// names) and out of this pool's way.
fn set_aside(file: &Path, pool_name: &str, older: &str, identity: &str) -> io::Result<()> {
    let aside = file.with_file_name(format!("{pool_name}.json.stale-{older}"));
    std::fs::rename(file, &aside)?;
    warn!(
        "replication state of pool '{pool_name}' is of an older pool of that name (uuid \
         {older}; this one's is {identity}): kept as {}, and this pool starts with none",
        aside.display()
    );
    Ok(())
}
