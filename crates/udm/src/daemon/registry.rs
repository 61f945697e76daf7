//! The device registry: names → devices, the dmsetup verbs, stacking and cycle checks, and the
//! resolver that opens what a table names (persistence is in `persist.rs`, removal in
//! `removal.rs`, renaming in `rename.rs`).

use parking_lot::{Mutex, MutexGuard};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::info;
use thiserror::Error;
use udm_block::{BlockDevice, SECTOR_SIZE};
use udm_targets::{Reference, Table, TargetError};

use super::claims::Claims;
use super::device::{Device, Events};
use super::loopback::OwnExports;
use super::persist::Change;
use super::remotes::Remotes;
use super::resolver::{mapper_node_name, mapper_nodes_as_names, TableResolver};

#[derive(Debug, Error)]
pub enum RegistryError {
    #[error("device '{}' does not exist", shown(.0))]
    NoSuchDevice(String),
    #[error("device '{}' already exists", shown(.0))]
    Exists(String),
    #[error("invalid device name '{}': {}", shown(.0), .1)]
    InvalidName(String, &'static str),
    #[error("invalid UUID '{}': {}", shown(.0), .1)]
    InvalidUuid(String, &'static str),
    #[error("{0}")]
    Table(#[from] TargetError),
    #[error("device '{}' is busy: {}", shown(.0), .1)]
    Busy(String, String),
    /// Part of a request on many devices failed; says what was done and what was not.
    #[error("{0}")]
    Incomplete(String),
    #[error("cannot save the state of '{0}': {1}")]
    Persist(String, std::io::Error),
    #[error(
        "device '{}' could not be restored at the daemon's start and its record {} is kept; \
         restart the daemon once what its table needs is back, or run `udm remove {}` to \
         discard the record",
        shown(.0), .1.display(), shown(.0)
    )]
    Unrestored(String, PathBuf),
}

type Result<T, E = RegistryError> = std::result::Result<T, E>;

pub struct Registry {
    devices: Mutex<BTreeMap<String, Arc<Device>>>,
    /// Serialises the verbs that change tables, so checks (name free, no cycle, not busy)
    /// cannot race with each other. I/O never takes it.
    pub(super) changes: Mutex<()>,
    pub(super) state_dir: PathBuf,
    /// The daemon's directory when it started, which relative paths in tables (`./a.img`)
    /// are made absolute against: the daemon then leaves it for `/`. (The `udm` client makes
    /// them absolute against its own directory before sending; only a table sent straight to
    /// the control socket reaches the daemon with them.)
    start_dir: PathBuf,
    /// Opens remote (NBD) references; knows their sizes for restoring while they are down.
    pub(super) remotes: Remotes,
    pub(super) claims: Arc<Claims>,
    /// References that lead back into this daemon are its devices, for the cycle checks.
    pub(super) own_exports: OwnExports,
}

/// A name as an error shows it: whole up to the longest a valid one can be, else its start
/// and its length, so that a hostile 1 MB name is not echoed back whole.
fn shown(name: &str) -> String {
    const LONGEST: usize = 128;
    if name.len() <= LONGEST {
        return name.to_string();
    }
    let cut = (0..=64)
        .rev()
        .find(|&i| name.is_char_boundary(i))
        .unwrap_or(0);
    format!("{}… ({} bytes)", &name[..cut], name.len())
}

pub(super) fn check_name(name: &str) -> Result<()> {
    let bad = |why| Err(RegistryError::InvalidName(name.to_string(), why));
    if name.is_empty() || name.len() > 127 {
        return bad("names are 1 to 127 characters");
    }
    if name.starts_with(['.', '-']) {
        return bad("a name may not start with '.' or '-'");
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "_.+-:@".contains(c))
    {
        return bad("use letters, digits and _ . + - : @");
    }
    Ok(())
}

/// UUIDs are dm's: up to 128 printable characters, without spaces.
pub(super) fn check_uuid(uuid: &str) -> Result<()> {
    let bad = |why| Err(RegistryError::InvalidUuid(uuid.to_string(), why));
    if uuid.is_empty() || uuid.len() > 128 {
        return bad("UUIDs are 1 to 128 characters");
    }
    if !uuid.chars().all(|c| c.is_ascii_graphic()) {
        return bad("use printable ASCII characters without spaces");
    }
    Ok(())
}

/// "2048 sectors: linear, dust" — a table in a few words, for the log.
pub(super) fn describe(table: &Table) -> String {
    let mut types: Vec<&str> = Vec::new();
    for segment in table.segments() {
        let name = segment.target.type_name();
        if !types.contains(&name) {
            types.push(name);
        }
    }
    format!(
        "{} sectors: {}",
        table.size() / SECTOR_SIZE,
        types.join(", ")
    )
}

impl Registry {
    pub fn new(state_dir: &Path, remote_timeout: Duration) -> std::io::Result<Self> {
        std::fs::create_dir_all(state_dir.join("devices"))?;
        Ok(Registry {
            devices: Mutex::new(BTreeMap::new()),
            changes: Mutex::new(()),
            state_dir: state_dir.to_path_buf(),
            start_dir: std::env::current_dir()?,
            remotes: Remotes::new(state_dir, remote_timeout),
            claims: Arc::default(),
            own_exports: OwnExports::default(),
        })
    }

    pub(super) fn map(&self) -> MutexGuard<'_, BTreeMap<String, Arc<Device>>> {
        self.devices.lock()
    }

    pub fn get(&self, name: &str) -> Result<Arc<Device>> {
        self.map()
            .get(name)
            .cloned()
            .ok_or_else(|| RegistryError::NoSuchDevice(name.into()))
    }

    /// The device called `name_or_uuid`, or else the one with that UUID (names and UUIDs
    /// never collide: `create` and `rename` see to it).
    /// `/dev/mapper/NAME` is device NAME, as for dmsetup (see [`mapper_node_name`]).
    pub fn resolve(&self, name_or_uuid: &str) -> Result<Arc<Device>> {
        let map = self.map();
        let word = mapper_node_name(name_or_uuid).unwrap_or(name_or_uuid);
        if let Some(device) = map.get(word) {
            return Ok(device.clone());
        }
        map.values()
            .find(|d| d.uuid().as_deref() == Some(name_or_uuid))
            .cloned()
            .ok_or_else(|| RegistryError::NoSuchDevice(name_or_uuid.into()))
    }

    /// Refuses a name or UUID that is already some device's name or UUID.
    pub(super) fn check_unused(&self, word: &str) -> Result<()> {
        let map = self.map();
        if map.contains_key(word) || map.values().any(|d| d.uuid().as_deref() == Some(word)) {
            return Err(RegistryError::Exists(word.into()));
        }
        Ok(())
    }

    /// Refuses `name` while the state dir keeps the record of a device of that name that
    /// could not be restored (its table's devices were missing at the start, or the record
    /// is damaged): a new device of the name would overwrite the only copy of its tables.
    /// Refused rather than moved aside, because a record moved aside is never restored: the
    /// user decides, and `remove` discards it ([`Registry::discard_unrestored`]).
    pub(super) fn check_no_unrestored_record(&self, name: &str) -> Result<()> {
        let path = self.state_path(name);
        if !self.map().contains_key(name) && path.exists() {
            return Err(RegistryError::Unrestored(name.into(), path));
        }
        Ok(())
    }

    pub fn all(&self) -> Vec<Arc<Device>> {
        self.map().values().cloned().collect()
    }

    /// Device names the tables of `device` use.
    pub fn dependencies(&self, device: &Device) -> Vec<String> {
        let mut tables = vec![device.live()];
        tables.extend(device.inactive());
        self.devices_named_by(&tables)
    }

    /// The first suspended device that I/O through `table` reaches, through the live tables
    /// of the devices it is built on: a flush of `table` would wait at that device's gate
    /// until it is resumed.
    pub(super) fn suspended_under(&self, table: &Arc<Table>) -> Option<String> {
        let mut stack = self.devices_named_by(std::slice::from_ref(table));
        let mut seen = Vec::new();
        while let Some(name) = stack.pop() {
            if seen.contains(&name) {
                continue;
            }
            let Ok(below) = self.get(&name) else {
                continue;
            };
            if below.is_suspended() {
                return Some(name);
            }
            stack.extend(self.devices_named_by(&[below.live()]));
            seen.push(name);
        }
        None
    }

    /// Device names `tables` use.
    fn devices_named_by(&self, tables: &[Arc<Table>]) -> Vec<String> {
        let map = self.map();
        let mut deps: Vec<String> = Vec::new();
        for table in tables {
            for r in table.references() {
                let name = match Reference::parse(&r) {
                    Reference::Device(_) => Some(r),
                    _ => self.own_exports.device_behind(&r),
                };
                if let Some(name) = name.filter(|n| map.contains_key(n) && !deps.contains(n)) {
                    deps.push(name);
                }
            }
        }
        deps
    }

    /// Devices whose tables use `name`.
    pub fn holders(&self, name: &str) -> Vec<String> {
        self.all()
            .iter()
            .filter(|d| self.dependencies(d).iter().any(|dep| dep == name))
            .map(|d| d.name().to_string())
            .collect()
    }

    /// Does `from` (transitively) use `target`?
    pub(super) fn depends_on(&self, from: &str, target: &str) -> bool {
        let mut stack = vec![from.to_string()];
        let mut seen = Vec::new();
        while let Some(name) = stack.pop() {
            if name == target {
                return true;
            }
            if seen.contains(&name) {
                continue;
            }
            if let Ok(dev) = self.get(&name) {
                stack.extend(self.dependencies(&dev));
            }
            seen.push(name);
        }
        false
    }

    /// Builds a table of device `owner`, which is `read_only` while the table is live (see
    /// [`udm_targets::Resolver::read_only`]).
    pub(super) fn build(
        &self,
        owner: &str,
        text: &str,
        read_only: bool,
        events: &Arc<Events>,
    ) -> Result<Table> {
        self.build_as(owner, text, read_only, events, false)
    }

    /// [`Registry::build`], saying whether the table brings its device back after a restart
    /// (see [`udm_targets::Resolver::restoring`]).
    fn build_as(
        &self,
        owner: &str,
        text: &str,
        read_only: bool,
        events: &Arc<Events>,
        restoring: bool,
    ) -> Result<Table> {
        let resolver = TableResolver {
            registry: self,
            owner,
            opened: Default::default(),
            restoring,
            read_only,
        };
        let events = events.clone();
        let text = Reference::absolute_paths(text, &self.start_dir);
        let text = mapper_nodes_as_names(&text, |name| self.map().contains_key(name));
        let _building = super::device::no_waiting_while_building();
        let table = Table::build(owner, &text, &resolver, Arc::new(move || events.raise()))?;
        // Before the table goes live: a new pool's thin devices take no table until then.
        super::receive::pool_built(self, owner);
        Ok(table)
    }

    pub fn create(
        &self,
        name: &str,
        text: &str,
        read_only: bool,
        uuid: Option<&str>,
    ) -> Result<Arc<Device>> {
        check_name(name)?;
        if let Some(uuid) = uuid {
            check_uuid(uuid)?;
        }
        let _changes = self.changes.lock();
        self.check_no_unrestored_record(name)?;
        let device = self.build_device(name, uuid, text, read_only, false, |_| {})?;
        self.save(&device)?;
        self.map().insert(name.to_string(), device.clone());
        info!(
            "created device '{name}' ({}{}{})",
            describe(&device.live()),
            uuid.map(|u| format!(", UUID {u}")).unwrap_or_default(),
            if read_only { ", read-only" } else { "" }
        );
        Ok(device)
    }

    /// Builds a device; `before_live` sees its table before it becomes live (and its
    /// targets start any background work).
    pub(super) fn build_device(
        &self,
        name: &str,
        uuid: Option<&str>,
        text: &str,
        read_only: bool,
        restoring: bool,
        before_live: impl FnOnce(&Table),
    ) -> Result<Arc<Device>> {
        self.check_unused(name)?;
        if let Some(uuid) = uuid {
            self.check_unused(uuid)?;
        }
        let events = Arc::new(Events::default());
        let table = self.build_as(name, text, read_only, &events, restoring)?;
        if !restoring {
            table.preresume()?;
        }
        before_live(&table);
        Ok(Arc::new(Device::new(
            name.to_string(),
            uuid.map(str::to_string),
            read_only,
            table,
            events,
        )))
    }

    /// Fills the inactive slot; `read_only` says whether the device is read-only once it goes
    /// live. A table smaller than what a device built on this one reaches into is refused,
    /// naming that device, unless `force`d.
    pub fn load(&self, name: &str, text: &str, force: bool, read_only: bool) -> Result<()> {
        let _changes = self.changes.lock();
        let device = self.get(name)?;
        let table = self.build(name, text, read_only, device.events())?;
        if !force {
            self.check_holders_fit(name, table.size())?;
        }
        let what = describe(&table);
        self.save_ahead(
            &device,
            Some(Change::Load {
                table: &table,
                read_only,
            }),
        )?;
        device.load(table, read_only);
        info!(
            "device '{name}': inactive table loaded ({what}{}{}); resume makes it live",
            if read_only { ", read-only" } else { "" },
            if force {
                ", forced past its users' needs"
            } else {
                ""
            }
        );
        Ok(())
    }

    /// Fails if a table of a device using `name` reaches past `size` bytes of it.
    fn check_holders_fit(&self, name: &str, size: u64) -> Result<()> {
        for holder in self.holders(name) {
            let Ok(device) = self.get(&holder) else {
                continue;
            };
            let tables = std::iter::once(device.live()).chain(device.inactive());
            if let Some(need) = tables.map(|t| t.needs_of(name)).max().filter(|n| *n > size) {
                return Err(RegistryError::Busy(
                    name.into(),
                    format!(
                        "device '{holder}' uses {} sectors of it and the new table has {}; \
                         change '{holder}' first, or load with --force (its I/O past the \
                         end then fails)",
                        need / SECTOR_SIZE,
                        size / SECTOR_SIZE
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Drops the inactive table (dmsetup clear).
    pub fn clear(&self, name: &str) -> Result<()> {
        let _changes = self.changes.lock();
        let device = self.get(name)?;
        let had = device.inactive().is_some();
        self.save_ahead(&device, Some(Change::ClearInactive))?;
        device.clear_inactive();
        if had {
            info!("device '{name}': inactive table dropped");
        }
        Ok(())
    }

    /// Holds new I/O and waits for what is in flight. `noflush` is dmsetup's: requests a
    /// multipath holds for a path are pushed back to the device, to run on the table live
    /// after the resume (a reload that adds a path), instead of failing.
    ///
    /// The record says suspended only once the drain is over, just before the answer: a
    /// daemon that dies while a suspend drains brings the device back active, as its admin
    /// was never told it was suspended. A record that cannot be saved undoes the suspend.
    pub fn suspend(&self, name: &str, noflush: bool) -> Result<()> {
        let device = self.get(name)?;
        let was = device.is_suspended();
        let started = Instant::now();
        // The drain is waited for without the lock, so that a device slow to drain does not
        // hold up every other verb; the record is saved after it, as the device is then (a
        // resume may have come in between).
        device.suspend(noflush);
        let _changes = self.changes.lock();
        if let Err(e) = self.save(&device) {
            if !was {
                device.undo_suspend();
            }
            return Err(e);
        }
        if !was {
            info!(
                "device '{name}': suspended{} (in-flight I/O drained in {} ms)",
                if noflush { " (noflush)" } else { "" },
                started.elapsed().as_millis()
            );
        }
        Ok(())
    }

    pub fn resume(&self, name: &str, noflush: bool) -> Result<()> {
        let device = self.get(name)?;
        let was = device.is_suspended();
        // A swap drains the old table's I/O first, which may be parked at a suspended device
        // below: drained without the lock, which that device's resume needs (the swap under
        // the lock then finds the device suspended and drained). Only once the change is
        // recorded: a change that cannot be saved is not made, nor one the new table refuses.
        if let Some(inactive) = device.inactive() {
            {
                let _changes = self.changes.lock();
                inactive.preresume()?;
                self.save_ahead(&device, Some(Change::Resume))?;
            }
            device.suspend(noflush);
        }
        let _changes = self.changes.lock();
        let device = self.get(name)?;
        // The table going live again is asked too, as the kernel asks at every resume: a
        // snapshot whose COW device another device has taken over must not serve it beside it.
        if device.is_suspended() && device.inactive().is_none() {
            device.live().preresume()?;
        }
        self.save_ahead(&device, Some(Change::Resume))?;
        match device.resume() {
            Some(_) => info!(
                "device '{name}': resumed with its new table live ({}{})",
                describe(&device.live()),
                if device.read_only() {
                    ", read-only"
                } else {
                    ""
                }
            ),
            None if was => info!("device '{name}': resumed"),
            None => {}
        }
        Ok(())
    }

    /// Sends a message to the target at `sector` of the live table; what it changed is saved
    /// so that it survives a restart.
    pub fn message(&self, name: &str, sector: u64, words: &[&str]) -> Result<String> {
        let device = self.get(name)?;
        let table = device.live();
        let target = table.target_at(sector).ok_or_else(|| {
            RegistryError::Table(TargetError::new(format!(
                "sector {sector} is beyond the end of '{name}'"
            )))
        })?;
        if words.is_empty() {
            return Err(RegistryError::Table(TargetError::new(
                "a message needs at least one word",
            )));
        }
        let answer = target.message(words)?;
        info!(
            "device '{name}': message to sector {sector}: {}",
            words.join(" ")
        );
        if !target.settings_messages().is_empty() {
            let _changes = self.changes.lock();
            self.save(&device)?;
        }
        Ok(answer)
    }

    /// Swaps every target that has finished its job for its replacement (a hydrated clone
    /// for `linear <destination> 0`) with suspend, load and resume: clients stay connected.
    /// Returns the new table, or `None` when no target has such an end (a device finalized
    /// already): nothing to do.
    pub fn finalize(&self, name: &str) -> Result<Option<String>> {
        let (device, table, text) = {
            let _changes = self.changes.lock();
            match self.finalized_table(name)? {
                Some(finalized) => finalized,
                None => return Ok(None),
            }
        };
        // The swap drains the old table's I/O, which may be parked at a suspended device
        // below: drained without the lock, which that device's resume needs, as a resume's
        // swap is. The record is saved again under the lock in case a verb came in between.
        device.suspend(false);
        let _changes = self.changes.lock();
        self.save_ahead(&device, Some(Change::ReplaceLive(&table)))
            .map_err(|e| {
                RegistryError::Incomplete(format!(
                    "finalizing '{name}': {e}; it is left suspended with its old table: \
                     resume it"
                ))
            })?;
        device.replace_live(table);
        info!(
            "device '{name}': finalized; its table is now: {}",
            text.replace('\n', "; ")
        );
        Ok(Some(text))
    }

    /// The device, its finished targets' replacement table and that table's text; `None`
    /// when no target has finished such a job. The change is recorded ahead.
    fn finalized_table(&self, name: &str) -> Result<Option<(Arc<Device>, Table, String)>> {
        let device = self.get(name)?;
        // Finalizing swaps tables itself; it must not resume a device the user suspended, nor
        // replace a table the user loaded.
        if device.is_suspended() {
            return Err(RegistryError::Busy(
                name.into(),
                "it is suspended and finalizing would resume it; resume it first".into(),
            ));
        }
        if device.inactive().is_some() {
            return Err(RegistryError::Busy(
                name.into(),
                "it has an inactive table that finalizing would replace; resume or clear it \
                 first"
                    .into(),
            ));
        }
        let live = device.live();
        let mut lines = Vec::new();
        let mut replaced = 0;
        for (segment, line) in live.segments().iter().zip(live.lines()) {
            match segment.target.replacement() {
                Some(replacement) => {
                    let (start, len) = (segment.start / SECTOR_SIZE, segment.len / SECTOR_SIZE);
                    lines.push(format!("{start} {len} {}", replacement?));
                    replaced += 1;
                }
                None => lines.push(line),
            }
        }
        if replaced == 0 {
            return Ok(None);
        }
        let text = lines.join("\n");
        let table = self.build(name, &text, device.read_only(), device.events())?;
        self.save_ahead(&device, Some(Change::ReplaceLive(&table)))?;
        Ok(Some((device, table, text)))
    }
}

/// What the daemon's unit tests build on: a registry in a scratch directory, devices that
/// must be created.
#[cfg(test)]
impl Registry {
    /// A registry keeping its state under `dir`/state.
    pub(super) fn in_scratch(dir: &udm_testkit::TempDir) -> Arc<Registry> {
        Arc::new(Registry::new(&dir.path("state"), Duration::from_secs(1)).unwrap())
    }

    /// Creates device `name` (read-write, no UUID) with `table`, which must succeed.
    pub(super) fn must_create(&self, name: &str, table: &str) -> Arc<Device> {
        self.create(name, table, false, None)
            .unwrap_or_else(|e| panic!("creating {name}: {e}"))
    }
}

#[cfg(test)]
mod tests;
