//! The device registry: names → devices, the dmsetup verbs, stacking, and persistence.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use log::{info, warn};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use udm_block::{BlockDevice, FileDevice, OpenMode, SECTOR_SIZE};
use udm_targets::{Resolver, Table, TargetError};

use super::device::{Device, Events};
use super::remotes::Remotes;
use super::write_durably;

#[derive(Debug, Error)]
pub enum RegistryError {
    #[error("device '{0}' does not exist")]
    NoSuchDevice(String),
    #[error("device '{0}' already exists")]
    Exists(String),
    #[error("invalid device name '{0}': {1}")]
    InvalidName(String, &'static str),
    #[error("{0}")]
    Table(#[from] TargetError),
    #[error("device '{0}' is busy: {1}")]
    Busy(String, String),
    #[error("cannot save the state of '{0}': {1}")]
    Persist(String, std::io::Error),
}

type Result<T, E = RegistryError> = std::result::Result<T, E>;

/// What the state dir keeps per device: enough to bring it back after a restart.
#[derive(Serialize, Deserialize)]
struct SavedDevice {
    name: String,
    read_only: bool,
    table: Vec<String>,
}

pub struct Registry {
    devices: Mutex<BTreeMap<String, Arc<Device>>>,
    /// Serialises the verbs that change tables, so checks (name free, no cycle, not busy)
    /// cannot race with each other. I/O never takes it.
    changes: Mutex<()>,
    state_dir: PathBuf,
    /// Opens remote (NBD) references; knows their sizes for restoring while they are down.
    remotes: Remotes,
}

/// Is `reference` a path (as opposed to a URI or a device name)?
pub fn is_path(reference: &str) -> bool {
    reference.starts_with('/') || reference.starts_with("./") || reference.starts_with("../")
}

pub fn is_uri(reference: &str) -> bool {
    reference.starts_with("nbd://") || reference.starts_with("nbd+unix://")
}

fn check_name(name: &str) -> Result<()> {
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

impl Registry {
    pub fn new(state_dir: &Path, remote_timeout: Duration) -> std::io::Result<Self> {
        std::fs::create_dir_all(state_dir.join("devices"))?;
        Ok(Registry {
            devices: Mutex::new(BTreeMap::new()),
            changes: Mutex::new(()),
            state_dir: state_dir.to_path_buf(),
            remotes: Remotes::new(state_dir, remote_timeout),
        })
    }

    fn map(&self) -> MutexGuard<'_, BTreeMap<String, Arc<Device>>> {
        self.devices.lock().unwrap()
    }

    pub fn get(&self, name: &str) -> Result<Arc<Device>> {
        self.map()
            .get(name)
            .cloned()
            .ok_or_else(|| RegistryError::NoSuchDevice(name.into()))
    }

    pub fn all(&self) -> Vec<Arc<Device>> {
        self.map().values().cloned().collect()
    }

    /// Device names the tables of `device` use.
    pub fn dependencies(&self, device: &Device) -> Vec<String> {
        let mut tables = vec![device.live()];
        tables.extend(device.inactive());
        let map = self.map();
        let mut deps: Vec<String> = Vec::new();
        for table in tables {
            for r in table.references() {
                if map.contains_key(&r) && !deps.contains(&r) {
                    deps.push(r);
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
    fn depends_on(&self, from: &str, target: &str) -> bool {
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

    fn build(&self, owner: &str, text: &str, events: &Arc<Events>) -> Result<Table> {
        let resolver = TableResolver {
            registry: self,
            owner,
        };
        let events = events.clone();
        Ok(Table::build(
            text,
            &resolver,
            Arc::new(move || events.raise()),
        )?)
    }

    pub fn create(&self, name: &str, text: &str, read_only: bool) -> Result<Arc<Device>> {
        check_name(name)?;
        let _changes = self.changes.lock().unwrap();
        if self.map().contains_key(name) {
            return Err(RegistryError::Exists(name.into()));
        }
        let events = Arc::new(Events::default());
        let table = self.build(name, text, &events)?;
        let device = Arc::new(Device::new(name.to_string(), read_only, table, events));
        self.save(&device)?;
        self.map().insert(name.to_string(), device.clone());
        info!(
            "created device '{name}' ({} sectors)",
            device.size() / SECTOR_SIZE
        );
        Ok(device)
    }

    pub fn load(&self, name: &str, text: &str) -> Result<()> {
        let _changes = self.changes.lock().unwrap();
        let device = self.get(name)?;
        let table = self.build(name, text, device.events())?;
        device.load(table);
        Ok(())
    }

    pub fn suspend(&self, name: &str) -> Result<()> {
        self.get(name)?.suspend();
        Ok(())
    }

    pub fn resume(&self, name: &str) -> Result<()> {
        let _changes = self.changes.lock().unwrap();
        let device = self.get(name)?;
        if device.resume().is_some() {
            self.save(&device)?;
            info!("device '{name}': new table is live");
        }
        Ok(())
    }

    /// Swaps every target that has finished its job for its replacement (a hydrated clone
    /// for `linear <destination> 0`) with suspend, load and resume: clients stay connected.
    pub fn finalize(&self, name: &str) -> Result<String> {
        let _changes = self.changes.lock().unwrap();
        let device = self.get(name)?;
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
            return Err(RegistryError::Table(TargetError::new(format!(
                "device '{name}' has no target to finalize (e.g. a clone)"
            ))));
        }
        let text = lines.join("\n");
        let table = self.build(name, &text, device.events())?;
        device.replace_live(table);
        self.save(&device)?;
        info!("device '{name}': finalized to\n{text}");
        Ok(text)
    }

    /// Removes a device. A device another device's table uses is never removed; one a client
    /// has open only with `force`, which first swaps in an all-error table so the client's
    /// I/O fails instead of reaching the old targets.
    pub fn remove(&self, name: &str, force: bool) -> Result<()> {
        let _changes = self.changes.lock().unwrap();
        let device = self.get(name)?;
        let holders = self.holders(name);
        if !holders.is_empty() {
            return Err(RegistryError::Busy(
                name.into(),
                format!("used by {}", holders.join(", ")),
            ));
        }
        let opens = device.open_count();
        if opens > 0 {
            if !force {
                return Err(RegistryError::Busy(
                    name.into(),
                    format!("open by {opens} client(s); use --force to fail their I/O and remove"),
                ));
            }
            let sectors = device.size() / SECTOR_SIZE;
            let error_table = self.build(name, &format!("0 {sectors} error"), device.events())?;
            device.replace_live(error_table);
        }
        self.map().remove(name);
        if let Err(e) = device.live().flush() {
            warn!("removing '{name}': flushing: {e}");
        }
        let path = self.state_path(name);
        if let Err(e) = std::fs::remove_file(&path) {
            warn!("removing {}: {e}", path.display());
        }
        info!("removed device '{name}'");
        Ok(())
    }

    fn state_path(&self, name: &str) -> PathBuf {
        self.state_dir.join("devices").join(format!("{name}.json"))
    }

    /// Writes the device's live table to the state dir: temp file, fsync, rename, fsync dir,
    /// so a crash leaves either the old or the new record.
    fn save(&self, device: &Device) -> Result<()> {
        let saved = SavedDevice {
            name: device.name().to_string(),
            read_only: device.read_only(),
            table: device.live().lines(),
        };
        let json = serde_json::to_vec_pretty(&saved).expect("serialisable");
        write_durably(&self.state_path(device.name()), &json)
            .map_err(|e| RegistryError::Persist(device.name().into(), e))
    }

    /// Brings back the devices of the state dir. Devices built on other devices wait until
    /// those exist; what cannot be built is logged and left in the state dir.
    pub fn restore(&self) -> std::io::Result<usize> {
        let mut pending: Vec<SavedDevice> = Vec::new();
        for entry in std::fs::read_dir(self.state_dir.join("devices"))? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "json") {
                match std::fs::read(&path).map(|b| serde_json::from_slice::<SavedDevice>(&b)) {
                    Ok(Ok(saved)) => pending.push(saved),
                    Ok(Err(e)) => warn!("ignoring {}: {e}", path.display()),
                    Err(e) => warn!("ignoring {}: {e}", path.display()),
                }
            }
        }
        let mut restored = 0;
        let _restoring = self.remotes.restoring();
        loop {
            let before = pending.len();
            let mut failures = Vec::new();
            pending.retain(|saved| match self.create_restored(saved) {
                Ok(()) => {
                    restored += 1;
                    false
                }
                Err(e) => {
                    failures.push(format!("'{}': {e}", saved.name));
                    true
                }
            });
            if pending.is_empty() || pending.len() == before {
                for failure in failures {
                    warn!("cannot restore device {failure}");
                }
                return Ok(restored);
            }
        }
    }

    fn create_restored(&self, saved: &SavedDevice) -> Result<()> {
        self.create(&saved.name, &saved.table.join("\n"), saved.read_only)
            .map(|_| ())
    }

    /// Flushes every device (at shutdown).
    pub fn flush_all(&self) {
        for device in self.all() {
            if let Err(e) = device.flush() {
                warn!("flushing '{}' at shutdown: {e}", device.name());
            }
        }
    }
}

/// Opens the references of one device's table.
struct TableResolver<'a> {
    registry: &'a Registry,
    owner: &'a str,
}

impl Resolver for TableResolver<'_> {
    fn open(&self, reference: &str, mode: OpenMode) -> Result<Arc<dyn BlockDevice>, TargetError> {
        if is_path(reference) {
            let dev = FileDevice::open(Path::new(reference), mode)
                .map_err(|e| TargetError::new(e.to_string()))?;
            return Ok(Arc::new(dev));
        }
        if is_uri(reference) {
            return self.registry.remotes.open(reference, mode);
        }
        if reference == self.owner || self.registry.depends_on(reference, self.owner) {
            return Err(TargetError::new(format!(
                "using device '{reference}' would make '{}' depend on itself",
                self.owner
            )));
        }
        let device = self.registry.get(reference).map_err(|_| {
            TargetError::new(format!(
                "no device named '{reference}' (paths start with / or ./, remote exports \
                 with nbd:// or nbd+unix://)"
            ))
        })?;
        Ok(device)
    }
}
