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

use super::claims::{Claimed, Claims};
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

/// What the state dir keeps per device: enough to bring it back after a restart as it was —
/// its tables, whether it was suspended, and what messages changed.
#[derive(Serialize, Deserialize)]
struct SavedDevice {
    name: String,
    read_only: bool,
    table: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    inactive: Option<Vec<String>>,
    #[serde(default)]
    suspended: bool,
    /// Per segment of the live table (by start sector), the messages that restore its
    /// targets' settings.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    settings: Vec<SavedSettings>,
}

#[derive(Serialize, Deserialize)]
struct SavedSettings {
    sector: u64,
    messages: Vec<String>,
}

pub struct Registry {
    devices: Mutex<BTreeMap<String, Arc<Device>>>,
    /// Serialises the verbs that change tables, so checks (name free, no cycle, not busy)
    /// cannot race with each other. I/O never takes it.
    changes: Mutex<()>,
    state_dir: PathBuf,
    /// Opens remote (NBD) references; knows their sizes for restoring while they are down.
    remotes: Remotes,
    claims: Arc<Claims>,
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
            claims: Arc::default(),
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
            owner,
            text,
            &resolver,
            Arc::new(move || events.raise()),
        )?)
    }

    pub fn create(&self, name: &str, text: &str, read_only: bool) -> Result<Arc<Device>> {
        check_name(name)?;
        let _changes = self.changes.lock().unwrap();
        let device = self.build_device(name, text, read_only, |_| {})?;
        self.save(&device)?;
        self.map().insert(name.to_string(), device.clone());
        info!(
            "created device '{name}' ({} sectors)",
            device.size() / SECTOR_SIZE
        );
        Ok(device)
    }

    /// Builds a device; `before_live` sees its table before it becomes live (and its
    /// targets start any background work).
    fn build_device(
        &self,
        name: &str,
        text: &str,
        read_only: bool,
        before_live: impl FnOnce(&Table),
    ) -> Result<Arc<Device>> {
        if self.map().contains_key(name) {
            return Err(RegistryError::Exists(name.into()));
        }
        let events = Arc::new(Events::default());
        let table = self.build(name, text, &events)?;
        before_live(&table);
        Ok(Arc::new(Device::new(
            name.to_string(),
            read_only,
            table,
            events,
        )))
    }

    /// Fills the inactive slot. A table smaller than what a device built on this one reaches
    /// into is refused, naming that device, unless `force`d.
    pub fn load(&self, name: &str, text: &str, force: bool) -> Result<()> {
        let _changes = self.changes.lock().unwrap();
        let device = self.get(name)?;
        let table = self.build(name, text, device.events())?;
        if !force {
            self.check_holders_fit(name, table.size())?;
        }
        device.load(table);
        self.save(&device)?;
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
        let _changes = self.changes.lock().unwrap();
        let device = self.get(name)?;
        device.clear_inactive();
        self.save(&device)
    }

    pub fn suspend(&self, name: &str) -> Result<()> {
        let device = self.get(name)?;
        device.suspend();
        let _changes = self.changes.lock().unwrap();
        self.save(&device)
    }

    pub fn resume(&self, name: &str) -> Result<()> {
        let _changes = self.changes.lock().unwrap();
        let device = self.get(name)?;
        if device.resume().is_some() {
            info!("device '{name}': new table is live");
        }
        self.save(&device)
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
        if !target.settings_messages().is_empty() {
            let _changes = self.changes.lock().unwrap();
            self.save(&device)?;
        }
        Ok(answer)
    }

    /// Swaps every target that has finished its job for its replacement (a hydrated clone
    /// for `linear <destination> 0`) with suspend, load and resume: clients stay connected.
    pub fn finalize(&self, name: &str) -> Result<String> {
        let _changes = self.changes.lock().unwrap();
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
        let live = device.live();
        let settings = live
            .segments()
            .iter()
            .map(|segment| SavedSettings {
                sector: segment.start / SECTOR_SIZE,
                messages: segment.target.settings_messages(),
            })
            .filter(|saved| !saved.messages.is_empty())
            .collect();
        let saved = SavedDevice {
            name: device.name().to_string(),
            read_only: device.read_only(),
            table: live.lines(),
            inactive: device.inactive().map(|t| t.lines()),
            suspended: device.is_suspended(),
            settings,
        };
        let json = serde_json::to_vec_pretty(&saved).expect("serialisable");
        write_durably(&self.state_path(device.name()), &json)
            .map_err(|e| RegistryError::Persist(device.name().into(), e))
    }

    /// Brings back the devices of the state dir, each as it was: live table and its targets'
    /// settings, inactive table, suspended or not. Devices built on other devices wait until
    /// those exist; what cannot be built is logged and left in the state dir. Suspending comes
    /// last, so that devices built on a suspended one are constructed first.
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
        let mut restored = Vec::new();
        let _restoring = self.remotes.restoring();
        loop {
            let before = pending.len();
            let mut failures = Vec::new();
            pending.retain(|saved| match self.restore_one(saved) {
                Ok(device) => {
                    restored.push((device, saved.suspended));
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
                break;
            }
        }
        for (device, _) in restored.iter().filter(|(_, suspended)| *suspended) {
            device.suspend();
            info!("device '{}' restored suspended, as it was", device.name());
        }
        Ok(restored.len())
    }

    fn restore_one(&self, saved: &SavedDevice) -> Result<Arc<Device>> {
        let _changes = self.changes.lock().unwrap();
        let name = &saved.name;
        let restore_settings = |table: &Table| {
            for settings in &saved.settings {
                let Some(target) = table.target_at(settings.sector) else {
                    warn!(
                        "'{name}': no segment at sector {} for saved settings",
                        settings.sector
                    );
                    continue;
                };
                for message in &settings.messages {
                    let words: Vec<&str> = message.split_whitespace().collect();
                    if let Err(e) = target.message(&words) {
                        warn!("'{name}': restoring setting '{message}': {e}");
                    }
                }
            }
        };
        let device = self.build_device(
            name,
            &saved.table.join("\n"),
            saved.read_only,
            restore_settings,
        )?;
        if let Some(inactive) = &saved.inactive {
            match self.build(name, &inactive.join("\n"), device.events()) {
                Ok(table) => device.load(table),
                Err(e) => warn!("'{name}': its inactive table cannot be restored: {e}"),
            }
        }
        self.map().insert(name.clone(), device.clone());
        Ok(device)
    }

    /// Flushes every device (at shutdown). A suspended device is left alone: its I/O was
    /// drained and its targets committed when it was suspended, a flush would wait at its
    /// gate forever, and it comes back suspended after the restart.
    pub fn flush_all(&self) {
        for device in self.all() {
            if device.is_suspended() {
                info!("'{}' is suspended: nothing to flush", device.name());
                continue;
            }
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
        let claims = &self.registry.claims;
        let exclusive = mode == OpenMode::Exclusive;
        if is_path(reference) {
            let claim = match mode {
                OpenMode::ReadOnly => None,
                _ => Some(
                    claims
                        .claim_file(Path::new(reference), self.owner, exclusive)
                        .map_err(TargetError::new)?,
                ),
            };
            let dev: Arc<dyn BlockDevice> = Arc::new(
                FileDevice::open(Path::new(reference), mode)
                    .map_err(|e| TargetError::new(e.to_string()))?,
            );
            return Ok(match claim {
                Some(claim) => Arc::new(Claimed::new(dev, claim)),
                None => dev,
            });
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
        if mode == OpenMode::ReadOnly {
            return Ok(device);
        }
        let claim = claims
            .claim_device(reference, self.owner, exclusive)
            .map_err(TargetError::new)?;
        Ok(Arc::new(Claimed::new(device, claim)))
    }
}
