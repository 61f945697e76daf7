//! Persistence: each device is `STATE_DIR/devices/NAME.json`, rewritten durably at every
//! change, and brought back in dependency order when the daemon starts.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use log::{info, warn};
use serde::{Deserialize, Serialize};
use udm_block::SECTOR_SIZE;
use udm_targets::Table;

use super::device::Device;
use super::registry::{describe, Registry, RegistryError};
use super::write_durably;

type Result<T, E = RegistryError> = std::result::Result<T, E>;

/// What the state dir keeps per device: enough to bring it back after a restart as it was —
/// its tables, whether it was suspended, and what messages changed.
#[derive(Serialize, Deserialize)]
struct SavedDevice {
    /// The device's name; the file's name follows it (see [`Registry::rename_record`]).
    name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    uuid: Option<String>,
    read_only: bool,
    table: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    inactive: Option<Vec<String>>,
    /// Whether the device is read-only once the inactive table goes live.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    inactive_read_only: bool,
    #[serde(default)]
    suspended: bool,
    /// `remove --deferred` was asked: the device goes once nothing uses it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    deferred_remove: bool,
    /// Per segment of the live table (by start sector), the messages that restore its
    /// targets' settings.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    settings: Vec<SavedSettings>,
}

impl SavedDevice {
    /// Whether the live or the inactive table merges a snapshot into its origin
    /// (`snapshot-merge`; a loaded one already counts as merging for new snapshots).
    fn merges(&self) -> bool {
        self.table
            .iter()
            .chain(self.inactive.iter().flatten())
            .any(|line| line.split_whitespace().nth(2) == Some("snapshot-merge"))
    }
}

#[derive(Serialize, Deserialize)]
struct SavedSettings {
    sector: u64,
    messages: Vec<String>,
}

impl Registry {
    pub(super) fn state_path(&self, name: &str) -> PathBuf {
        self.state_dir.join("devices").join(format!("{name}.json"))
    }

    /// Writes the device's record to the state dir: temp file, fsync, rename, fsync dir, so a
    /// crash leaves either the old or the new record.
    pub(super) fn save(&self, device: &Device) -> Result<()> {
        self.save_ahead(device, None)
    }

    /// Saves the record of what `change` is about to make of `device`, before it is made: a
    /// change whose record cannot be written (a full disk) is refused and not made, and a
    /// crash right after the record brings the device back as its user was told it is.
    pub(super) fn save_ahead(&self, device: &Device, change: Option<Change>) -> Result<()> {
        write_durably(&self.state_path(&device.name()), &record(device, change))
            .map_err(|e| RegistryError::Persist(device.name(), e))
    }

    /// Moves a renamed device's record from `old`'s file to its new name's in two atomic
    /// steps: the record names the device anew, then the file is renamed. A crash in between
    /// leaves a record whose name is not its file's, which [`Registry::restore`] finishes.
    pub(super) fn rename_record(&self, device: &Device, old: &str) -> std::io::Result<()> {
        let from = self.state_path(old);
        write_durably(&from, &record(device, None))?;
        finish_rename(&from, &self.state_path(&device.name()))
    }

    /// Brings back the devices of the state dir, each as it was: live table and its targets'
    /// settings, inactive table, suspended or not. Devices built on other devices wait until
    /// those exist; what cannot be built is logged and left in the state dir. Suspending comes
    /// last, so that devices built on a suspended one are constructed first. A device whose
    /// removal was deferred is removed as soon as nothing uses it. Each device restored is
    /// one line in the log.
    pub fn restore(self: &Arc<Self>) -> std::io::Result<usize> {
        let mut pending: Vec<SavedDevice> = Vec::new();
        for entry in std::fs::read_dir(self.state_dir.join("devices"))? {
            let path = entry?.path();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            let saved = match std::fs::read(&path).map(|b| serde_json::from_slice(&b)) {
                Ok(Ok(saved)) => saved,
                Ok(Err(e)) => {
                    warn!("ignoring {}: {e}", path.display());
                    continue;
                }
                Err(e) => {
                    warn!("ignoring {}: {e}", path.display());
                    continue;
                }
            };
            finish_interrupted_rename(&path, &saved, &self.state_path(&saved.name))?;
            pending.push(saved);
        }
        // Snapshots before the merges into their origins: a merge saves each chunk into the
        // origin's other snapshots before it overwrites it, so they must be there when it
        // starts, and a snapshot is refused once a merge into its origin runs.
        pending.sort_by_key(SavedDevice::merges);
        let mut restored = Vec::new();
        let _restoring = self.remotes.restoring();
        loop {
            let before = pending.len();
            let mut failures = Vec::new();
            for saved in std::mem::take(&mut pending) {
                match self.restore_one(&saved) {
                    Ok(device) => restored.push((device, saved)),
                    Err(e) => {
                        failures.push(format!("'{}': {e}", saved.name));
                        pending.push(saved);
                    }
                }
            }
            if pending.is_empty() || pending.len() == before {
                for failure in failures {
                    warn!("cannot restore device {failure}");
                }
                break;
            }
        }
        // Inactive tables once every device is back: one may name a device whose record is
        // read after its own (it was dropped at the restart).
        for (device, saved) in &restored {
            self.restore_inactive(device, saved);
        }
        for (device, saved) in &restored {
            if saved.suspended {
                device.suspend(false);
            }
            info!(
                "restored device '{}' ({}{}{}{})",
                device.name(),
                describe(&device.live()),
                if device.inactive().is_some() {
                    ", with an inactive table"
                } else {
                    ""
                },
                if saved.suspended {
                    ", suspended as it was"
                } else {
                    ""
                },
                if device.deferred_remove() {
                    ", to be removed once unused"
                } else {
                    ""
                },
            );
        }
        self.hold_origins_of(
            pending
                .iter()
                .map(|s| (s.name.as_str(), s.table.as_slice())),
        );
        for (device, _) in restored.iter().filter(|(d, _)| d.deferred_remove()) {
            self.watch_deferred(device.clone());
        }
        Ok(restored.len())
    }

    fn restore_one(&self, saved: &SavedDevice) -> Result<Arc<Device>> {
        let _changes = self.changes.lock();
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
            saved.uuid.as_deref(),
            &saved.table.join("\n"),
            saved.read_only,
            true,
            restore_settings,
        )?;
        device.set_deferred_remove(saved.deferred_remove);
        self.map().insert(name.clone(), device.clone());
        Ok(device)
    }

    /// Loads the inactive table `saved` records for `device`, if any; one that cannot be
    /// built is logged and dropped.
    fn restore_inactive(&self, device: &Device, saved: &SavedDevice) {
        let Some(inactive) = &saved.inactive else {
            return;
        };
        let _changes = self.changes.lock();
        let read_only = saved.inactive_read_only;
        match self.build(
            &saved.name,
            &inactive.join("\n"),
            read_only,
            device.events(),
        ) {
            Ok(table) => device.load(table, read_only),
            Err(e) => warn!(
                "'{}': its inactive table cannot be restored: {e}",
                saved.name
            ),
        }
    }
}

/// A change to a device's tables or suspension, saved ahead by [`Registry::save_ahead`].
pub(super) enum Change<'a> {
    Load {
        table: &'a Table,
        read_only: bool,
    },
    ClearInactive,
    /// The inactive table, if any, goes live; the device is no longer suspended.
    Resume,
    /// The daemon swaps the live table itself (finalize): it suspends the device for the
    /// swap and resumes it after, so the record says not suspended whatever the device is
    /// while the record is written (a finalized clone came back suspended, its I/O hanging).
    ReplaceLive(&'a Table),
}

/// The device's record once `change` is made, as JSON.
fn record(device: &Device, change: Option<Change>) -> Vec<u8> {
    let (current_live, current_inactive) = (device.live(), device.inactive());
    let mut live: &Table = &current_live;
    let mut read_only = device.read_only();
    let mut inactive = current_inactive.as_deref();
    let mut inactive_read_only = device.inactive_read_only();
    let mut suspended = device.is_suspended();
    match change {
        None => {}
        Some(Change::Load { table, read_only }) => {
            inactive = Some(table);
            inactive_read_only = read_only;
        }
        Some(Change::ClearInactive) => inactive = None,
        Some(Change::Resume) => {
            if let Some(table) = inactive.take() {
                (live, read_only) = (table, inactive_read_only);
            }
            suspended = false;
        }
        Some(Change::ReplaceLive(table)) => {
            live = table;
            suspended = false;
        }
    }
    if inactive.is_none() {
        inactive_read_only = false;
    }
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
        name: device.name(),
        uuid: device.uuid(),
        read_only,
        table: live.lines(),
        inactive: inactive.map(Table::lines),
        inactive_read_only,
        suspended,
        deferred_remove: device.deferred_remove(),
        settings,
    };
    serde_json::to_vec_pretty(&saved).expect("serialisable")
}

/// A record at `path` that names another device than its file does is the first half of a
/// rename cut short by a crash (see [`Registry::rename_record`]): moves it to `named`.
fn finish_interrupted_rename(
    path: &Path,
    saved: &SavedDevice,
    named: &Path,
) -> std::io::Result<()> {
    if path == named {
        return Ok(());
    }
    warn!(
        "{} holds device '{}': finishing its rename",
        path.display(),
        saved.name
    );
    finish_rename(path, named)
}

/// Renames a record's file and makes the rename durable.
fn finish_rename(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::rename(from, to)?;
    std::fs::File::open(to.parent().expect("a file in a directory"))?.sync_all()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use udm_block::{AlignedBuf, BlockDevice};
    use udm_testkit::TempDir;

    use super::*;

    /// What a device looks like from outside, to compare before and after a restart.
    fn describe(r: &Registry, name: &str) -> (Vec<String>, Option<Vec<String>>, bool, bool) {
        let d = r.get(name).unwrap();
        let inactive = d.inactive().map(|t| t.lines());
        (d.live().lines(), inactive, d.is_suspended(), d.read_only())
    }

    #[test]
    fn a_restart_brings_every_device_back_as_it_was() {
        let dir = TempDir::new("restore");
        let names = ["base", "bad", "mid", "top", "ro"];
        let before = {
            let r = Registry::in_scratch(&dir);
            // Names sort against the stack (top < mid < base would be read first), so the
            // restore has to wait for lower devices whatever order it reads the records in.
            r.must_create("base", "0 4096 zero");
            r.must_create("bad", "0 4096 dust base 0 512");
            r.must_create("mid", "0 4096 linear bad 0");
            r.must_create("top", "0 2048 linear mid 2048");
            r.create("ro", "0 8 zero", true, None).unwrap();
            r.must_create("gone", "0 8 zero");
            r.remove("gone", false, Duration::ZERO).unwrap();
            r.message("bad", 0, &["addbadblock", "3"]).unwrap();
            r.message("bad", 0, &["enable"]).unwrap();
            r.load("top", "0 1024 linear base 0", false, false).unwrap();
            r.suspend("mid", false).unwrap();
            names.map(|n| describe(&r, n))
        };
        let r = Registry::in_scratch(&dir);
        assert_eq!(r.restore().unwrap(), names.len());
        assert_eq!(names.map(|n| describe(&r, n)), before);
        assert!(r.get("gone").is_err());
        // The message's settings came back with the table: block 3 is bad again.
        let bad = r.get("bad").unwrap();
        let mut buf = AlignedBuf::zeroed(512);
        assert!(bad.read(3 * 512, &mut buf).is_err());
        bad.read(2 * 512, &mut buf).unwrap();
        assert_eq!(
            bad.live().segments()[0].target.settings_messages()[0],
            "enable"
        );
    }

    #[test]
    fn a_change_whose_record_cannot_be_saved_is_not_made() {
        let dir = TempDir::new("unsaved");
        let r = Registry::in_scratch(&dir);
        r.must_create("vol", "0 2048 zero");
        r.load("vol", "0 4096 zero", false, false).unwrap();
        // A directory where the record's temporary file goes: every save fails, as on a full
        // disk. Before, each verb changed the device and then reported that the state could
        // not be saved; a restart then undid the change (a resumed table's writes went behind
        // the old table).
        let blocker = r.state_path("vol").with_extension("json.tmp");
        std::fs::create_dir(&blocker).unwrap();
        let before = describe(&r, "vol");
        assert!(r.resume("vol", false).is_err());
        assert!(r.load("vol", "0 1024 zero", false, false).is_err());
        assert!(r.clear("vol").is_err());
        assert!(r.suspend("vol", false).is_err());
        assert_eq!(describe(&r, "vol"), before);
        std::fs::remove_dir(&blocker).unwrap();
        r.resume("vol", false).unwrap();
        let now = describe(&r, "vol");
        assert_eq!(now.0, ["0 4096 zero"]);
        let restarted = Registry::in_scratch(&dir);
        restarted.restore().unwrap();
        assert_eq!(describe(&restarted, "vol"), now);
    }

    fn recorded_suspended(r: &Registry, name: &str) -> bool {
        let saved: SavedDevice =
            serde_json::from_slice(&std::fs::read(r.state_path(name)).unwrap()).unwrap();
        saved.suspended
    }

    /// A daemon that dies while a suspend waits for in-flight I/O brings the device back
    /// active: its admin was never told it was suspended. The record said suspended from the
    /// start of the drain, and the device came back held.
    #[test]
    fn a_suspend_is_recorded_only_once_its_drain_is_over() {
        let dir = TempDir::new("suspend-record");
        let r = Registry::in_scratch(&dir);
        r.must_create("base", "0 2048 zero");
        let slow = r.must_create("slow", "0 2048 delay base 0 1500");
        let reader = std::thread::spawn(move || {
            slow.read(0, &mut AlignedBuf::zeroed(4096)).unwrap();
        });
        std::thread::sleep(Duration::from_millis(200));
        let suspender = {
            let r = r.clone();
            std::thread::spawn(move || r.suspend("slow", false).unwrap())
        };
        std::thread::sleep(Duration::from_millis(400));
        assert!(!suspender.is_finished(), "the read was not in flight");
        assert!(!recorded_suspended(&r, "slow"), "recorded before the drain");
        suspender.join().unwrap();
        reader.join().unwrap();
        assert!(recorded_suspended(&r, "slow"));
    }

    #[test]
    fn a_damaged_record_is_skipped_and_the_rest_restored() {
        let dir = TempDir::new("damaged");
        {
            let r = Registry::in_scratch(&dir);
            r.must_create("good", "0 8 zero");
            r.must_create("lost", "0 8 zero");
        }
        std::fs::write(dir.path("state/devices/lost.json"), b"{ torn").unwrap();
        // A record whose lower device never comes back cannot be built; it stays on disk.
        let orphan = br#"{"name":"orphan","read_only":false,"table":["0 8 linear nowhere 0"]}"#;
        std::fs::write(dir.path("state/devices/orphan.json"), orphan).unwrap();
        let r = Registry::in_scratch(&dir);
        assert_eq!(r.restore().unwrap(), 1);
        assert_eq!(r.all().len(), 1);
        assert!(dir.path("state/devices/orphan.json").exists());
    }

    /// An inactive table may name a device whose record is read after its own: the
    /// inactive tables are built once every device is back. They were built with their
    /// device's live table, and one naming a device not restored yet was dropped with a
    /// warning (found by the model test: a loaded table vanished at a restart).
    #[test]
    fn an_inactive_table_naming_a_device_restored_later_comes_back() {
        let dir = TempDir::new("restore-inactive");
        // Records are read in directory order: with many tables naming one device, all but
        // the rare order that reads it first name a device that is not back yet.
        let names: Vec<String> = (0..16).map(|i| format!("holder{i}")).collect();
        let before = {
            let r = Registry::in_scratch(&dir);
            r.must_create("named", "0 8 zero");
            for name in &names {
                r.must_create(name, "0 8 zero");
                r.load(name, "0 8 linear named 0", false, false).unwrap();
            }
            names.iter().map(|n| describe(&r, n)).collect::<Vec<_>>()
        };
        let r = Registry::in_scratch(&dir);
        assert_eq!(r.restore().unwrap(), names.len() + 1);
        assert_eq!(
            names.iter().map(|n| describe(&r, n)).collect::<Vec<_>>(),
            before
        );
    }

    /// A device that could not be restored is kept in the state dir, but a new device of its
    /// name silently replaced its record, and with it the only copy of its tables. The name
    /// is refused while the record holds it, until `remove` discards the record.
    #[test]
    fn an_unrestored_record_holds_its_name_until_removed() {
        let dir = TempDir::new("unrestored");
        std::fs::create_dir_all(dir.path("state/devices")).unwrap();
        let orphan = br#"{"name":"orphan","read_only":false,"table":["0 8 linear nowhere 0"]}"#;
        std::fs::write(dir.path("state/devices/orphan.json"), orphan).unwrap();
        let r = Registry::in_scratch(&dir);
        assert_eq!(r.restore().unwrap(), 0);
        let Err(refused) = r.create("orphan", "0 8 zero", false, None) else {
            panic!("a device replaced the record of one that could not be restored");
        };
        let refused = refused.to_string();
        assert!(refused.contains("could not be restored"), "{refused}");
        assert!(refused.contains("udm remove orphan"), "{refused}");
        r.must_create("other", "0 8 zero");
        let refused = r.rename("other", "orphan").unwrap_err().to_string();
        assert!(refused.contains("could not be restored"), "{refused}");
        assert_eq!(
            std::fs::read(dir.path("state/devices/orphan.json")).unwrap(),
            orphan
        );
        r.remove("orphan", false, Duration::ZERO).unwrap();
        assert!(!dir.path("state/devices/orphan.json").exists());
        r.must_create("orphan", "0 8 zero");
    }

    /// A device is suspended only once everything built on it is back: building a table reads
    /// its lower devices (a clone's metadata here), and a read of a suspended device waits
    /// for a resume that would never come.
    #[test]
    fn devices_built_on_a_suspended_device_are_built_before_it_is_suspended() {
        let dir = TempDir::new("restore-suspended");
        for file in ["meta.img", "dest.img"] {
            dir.sparse(file, 1 << 20);
        }
        {
            let r = Registry::in_scratch(&dir);
            let meta = dir.path("meta.img");
            let dest = dir.path("dest.img");
            r.create(
                "meta",
                &format!("0 2048 linear {} 0", meta.display()),
                false,
                None,
            )
            .unwrap();
            r.must_create("source", "0 2048 zero");
            // No background copy: it would commit to the suspended metadata device.
            let clone = format!(
                "0 2048 clone meta {} source 8 1 no_hydration",
                dest.display()
            );
            r.must_create("clone", &clone);
            r.suspend("meta", false).unwrap();
        }
        let (done, restored) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let r = Registry::in_scratch(&dir);
            done.send(r.restore().unwrap()).unwrap();
            // Keep the devices (and their files) until the test has its answer.
            std::thread::sleep(Duration::from_secs(1));
            drop(r);
            drop(dir);
        });
        let count = restored
            .recv_timeout(Duration::from_secs(30))
            .expect("the restore hung on a suspended device");
        assert_eq!(count, 3);
    }
}
