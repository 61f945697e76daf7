//! One origin and everything that must see its writes: the snapshots of it, which get a copy
//! of each chunk before an origin write changes it, and the targets serving the origin
//! (`snapshot-origin`, or the `snapshot-merge` that took its place).
//!
//! Hubs live in a [`Rendezvous`] keyed by the origin's identity
//! ([`crate::rendezvous::device_key`]: a file's inode, a udm device's serial), so the tables
//! of different devices meet in one hub however they name the origin (the kernel's
//! `_origins` hash, keyed by dev_t). A udm device and the file under it are different
//! devices, as a dm device and its backing disk are.

use parking_lot::{Condvar, Mutex, RwLock};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use udm_block::{BlockDevice, Done};

use super::copier;
use super::cow::{OriginCache, Snap};
use crate::rendezvous::Rendezvous;

static HUBS: Rendezvous<Hub> = Rendezvous::new();

pub struct Hub {
    /// The origin as the table that made the hub named it, for messages.
    name: String,
    /// Active snapshots, in activation order: the order in which an origin write locks their
    /// chunks, so that two writes never wait for each other crosswise.
    snaps: RwLock<Vec<Arc<Snap>>>,
    gate: Arc<WriteGate>,
    roles: Mutex<Vec<Role>>,
    next_role: AtomicU64,
}

/// A target serving the origin, for the checks that keep a merge and a `snapshot-origin`
/// (or two merges) from writing it at once.
struct Role {
    id: u64,
    owner: String,
    /// The COW device being merged, for a `snapshot-merge`.
    merging: Option<String>,
}

/// Holds a role until the target is dropped.
pub struct RoleGuard {
    hub: Arc<Hub>,
    id: u64,
}

impl RoleGuard {
    /// The device holding the role, as it is called now.
    pub fn owner(&self) -> String {
        let roles = self.hub.roles.lock();
        let role = roles.iter().find(|r| r.id == self.id);
        role.map(|r| r.owner.clone()).unwrap_or_default()
    }

    /// The device holding the role is now called `new`.
    pub fn rename(&self, new: &str) {
        let mut roles = self.hub.roles.lock();
        for role in roles.iter_mut().filter(|r| r.id == self.id) {
            role.owner = new.to_string();
        }
    }
}

impl Drop for RoleGuard {
    fn drop(&mut self) {
        self.hub.roles.lock().retain(|r| r.id != self.id);
    }
}

impl Hub {
    /// The hub of the origin whose [`device_key`] is `origin_key`, named `name` in messages.
    ///
    /// [`device_key`]: crate::rendezvous::device_key
    pub fn of(origin_key: &str, name: &str) -> Arc<Hub> {
        HUBS.get_or_try_insert::<()>(origin_key, || {
            Ok(Arc::new(Hub {
                name: name.to_string(),
                snaps: RwLock::default(),
                gate: Arc::default(),
                roles: Mutex::default(),
                next_role: AtomicU64::new(0),
            }))
        })
        .expect("making a hub cannot fail")
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    fn add_role(self: &Arc<Self>, owner: &str, merging: Option<String>) -> RoleGuard {
        let id = self.next_role.fetch_add(1, Ordering::Relaxed);
        self.roles.lock().push(Role {
            id,
            owner: owner.to_string(),
            merging,
        });
        RoleGuard {
            hub: self.clone(),
            id,
        }
    }

    /// `snapshot-origin` in the tables of `owner`: refused while another device merges
    /// into this origin, since its writes would go straight to chunks the merge has yet to
    /// copy back.
    pub fn serve_origin(self: &Arc<Self>, owner: &str) -> Result<RoleGuard, String> {
        let roles = self.roles.lock();
        if let Some(merge) = roles
            .iter()
            .find(|r| r.merging.is_some() && r.owner != owner)
        {
            return Err(format!(
                "origin '{}' is being merged by device '{}'; its snapshot-merge target \
                 serves the origin until the merge is done",
                self.name, merge.owner
            ));
        }
        drop(roles);
        Ok(self.add_role(owner, None))
    }

    /// The device merging a snapshot into this origin, if one is: the origin file is then
    /// half rolled back, no moment to take a new snapshot of.
    pub fn merged_by(&self) -> Option<String> {
        let roles = self.roles.lock();
        roles
            .iter()
            .find(|r| r.merging.is_some())
            .map(|r| r.owner.clone())
    }

    /// `snapshot-merge` of `cow_key` in the tables of `owner`: the merge takes the place of
    /// `snapshot-origin`, so it is refused while another device serves the origin or merges
    /// another snapshot into it.
    pub fn serve_merge(self: &Arc<Self>, owner: &str, cow_key: &str) -> Result<RoleGuard, String> {
        let roles = self.roles.lock();
        for role in roles.iter() {
            match &role.merging {
                Some(other) if other != cow_key || role.owner != owner => {
                    return Err(format!(
                        "origin '{}' is already being merged by device '{}': one merge per \
                         origin at a time",
                        self.name, role.owner
                    ))
                }
                None if role.owner != owner => {
                    return Err(format!(
                        "device '{}' serves origin '{}' with snapshot-origin; load \
                         snapshot-merge into '{}' in its place (the merge takes over the \
                         origin's role)",
                        role.owner, self.name, role.owner
                    ))
                }
                _ => {}
            }
        }
        drop(roles);
        Ok(self.add_role(owner, Some(cow_key.to_string())))
    }

    /// Makes `snap` see every origin write from now on (its point in time), after the writes
    /// in flight have landed. `prepare` runs with the origin's writes held off.
    pub fn activate(&self, snap: &Arc<Snap>, prepare: impl FnOnce()) {
        let _frozen = self.gate.freeze();
        prepare();
        let mut snaps = self.snaps.write();
        if !snaps.iter().any(|s| Arc::ptr_eq(s, snap)) {
            snaps.push(snap.clone());
            snaps.sort_by_key(|s| s.id);
        }
    }

    pub fn deactivate(&self, snap: &Snap) {
        self.snaps.write().retain(|s| !std::ptr::eq(&**s, snap));
    }

    /// An origin write is starting; held until it has landed.
    pub fn begin_write(&self) -> GateGuard {
        self.gate.enter()
    }

    /// The same without waiting, for the mapped path.
    pub fn try_begin_write(&self) -> Option<GateGuard> {
        self.gate.try_enter()
    }

    fn targets(&self) -> Vec<Arc<Snap>> {
        self.snaps
            .read()
            .iter()
            .filter(|s| s.takes_copy_outs())
            .cloned()
            .collect()
    }

    /// True when every snapshot already has its own copy of every chunk of the range: an
    /// origin write there can go straight to the origin.
    pub fn all_saved(&self, offset: u64, len: u64) -> bool {
        self.snaps
            .read()
            .iter()
            .all(|s| !s.takes_copy_outs() || s.has_all(offset, len))
    }

    /// Before an origin write to `[offset, offset + len)` lands: copies every chunk of it
    /// that a snapshot has not saved yet into that snapshot, and returns once the copies are
    /// committed. Snapshots that cannot take them (full, failing) are invalidated instead;
    /// the origin write goes ahead either way. The commits of different snapshots run at
    /// once.
    pub fn copy_out(&self, origin: &dyn BlockDevice, offset: u64, len: u64) {
        self.copy_out_ranges(origin, &[(offset, len)]);
    }

    /// [`Hub::copy_out`] for a mapped origin write, holding no thread while it waits: the
    /// copier ([`super::copier`]) saves the chunks, and `done` is finished once every
    /// snapshot's commit is durable. The origin write goes ahead either way, as with
    /// [`Hub::copy_out`].
    pub fn copy_out_then(&self, origin: Arc<dyn BlockDevice>, offset: u64, len: u64, done: Done) {
        copier::copy_out(self.targets(), origin, offset, len, done)
    }

    /// [`Hub::copy_out`] for several ranges at once (a merge batch), with one commit per
    /// snapshot.
    pub fn copy_out_ranges(&self, origin: &dyn BlockDevice, ranges: &[(u64, u64)]) {
        let targets = self.targets();
        if targets.is_empty() {
            return;
        }
        OriginCache::with(origin, |cache| {
            let savings: Vec<_> = targets
                .iter()
                .filter_map(|snap| snap.begin_copy_out(cache, ranges))
                .collect();
            for saving in savings {
                saving.finish();
            }
        });
    }
}

/// Counts writes in flight, so that a change happens between them: a snapshot becomes
/// active between origin writes (one that sees part of a write it was not told about would
/// change under its reader), and a merge takes a COW device over between the snapshot's own
/// writes.
#[derive(Default)]
pub struct WriteGate {
    in_flight: AtomicU64,
    frozen: AtomicBool,
    lock: Mutex<()>,
    changed: Condvar,
}

pub struct GateGuard(Arc<WriteGate>);

pub struct Frozen<'a>(&'a WriteGate);

impl WriteGate {
    pub fn try_enter(self: &Arc<Self>) -> Option<GateGuard> {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let guard = GateGuard(self.clone());
        (!self.frozen.load(Ordering::SeqCst)).then_some(guard)
    }

    pub fn enter(self: &Arc<Self>) -> GateGuard {
        loop {
            if let Some(guard) = self.try_enter() {
                return guard;
            }
            let mut lock = self.lock.lock();
            if self.frozen.load(Ordering::SeqCst) {
                self.changed.wait_for(&mut lock, Duration::from_millis(10));
            }
        }
    }

    pub fn freeze(&self) -> Frozen<'_> {
        let mut lock = self.lock.lock();
        // One activation at a time; a second waits for the first to thaw.
        while self.frozen.swap(true, Ordering::SeqCst) {
            self.changed.wait_for(&mut lock, Duration::from_millis(10));
        }
        while self.in_flight.load(Ordering::SeqCst) > 0 {
            self.changed.wait_for(&mut lock, Duration::from_millis(10));
        }
        Frozen(self)
    }
}

impl Drop for GateGuard {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::SeqCst) == 1
            && self.0.frozen.load(Ordering::SeqCst)
        {
            let _lock = self.0.lock.lock();
            self.0.changed.notify_all();
        }
    }
}

impl Drop for Frozen<'_> {
    fn drop(&mut self) {
        let _lock = self.0.lock.lock();
        self.0.frozen.store(false, Ordering::SeqCst);
        self.0.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn freezing_waits_for_writes_in_flight_and_holds_new_ones() {
        let gate = Arc::new(WriteGate::default());
        let write = gate.try_enter().unwrap();
        std::thread::scope(|s| {
            let freezer = s.spawn(|| {
                let t = Instant::now();
                let frozen = gate.freeze();
                let waited = t.elapsed();
                std::thread::sleep(Duration::from_millis(30));
                drop(frozen);
                waited
            });
            std::thread::sleep(Duration::from_millis(30));
            assert!(gate.try_enter().is_none(), "new writes wait while frozen");
            drop(write);
            let t = Instant::now();
            let _next = gate.enter();
            assert!(t.elapsed() >= Duration::from_millis(15));
            assert!(freezer.join().unwrap() >= Duration::from_millis(25));
        });
    }
}
