//! dmsetup's `rename`: a new name, or a UUID for a device that has none.

use log::info;

use super::registry::{check_name, check_uuid, Registry, RegistryError};

type Result<T, E = RegistryError> = std::result::Result<T, E>;

impl Registry {
    /// Renames a device. It keeps its tables, its clients and what it claims; new NBD clients
    /// and the FUSE mount find it under the new name. Refused while another device is built
    /// on it, since that device's tables name it.
    pub fn rename(&self, name: &str, new_name: &str) -> Result<()> {
        check_name(new_name)?;
        let _changes = self.changes.lock();
        let device = self.get(name)?;
        self.check_unused(new_name)?;
        self.check_no_unrestored_record(new_name)?;
        let holders = self.holders(name);
        if !holders.is_empty() {
            return Err(RegistryError::Busy(
                name.into(),
                format!(
                    "used by {}, whose tables name it; remove or reload them first",
                    holders.join(", ")
                ),
            ));
        }
        // A thin pool is found by its device's name: by thin tables, messages, `udm send`
        // and `udm receive`, and the replication state kept under it. Renamed, it would be
        // found by neither name until it was made again.
        let tables = [Some(device.live()), device.inactive()];
        let pool = tables.iter().flatten().any(|t| {
            t.segments()
                .iter()
                .any(|s| s.target.type_name() == "thin-pool")
        });
        if pool {
            return Err(RegistryError::Busy(
                name.into(),
                "a thin-pool device is found by its name; remove it and create it under the \
                 new name (its metadata keeps the thin devices)"
                    .into(),
            ));
        }
        device.set_name(new_name);
        if let Err(e) = self.rename_record(&device, name) {
            device.set_name(name);
            return Err(RegistryError::Persist(new_name.into(), e));
        }
        self.claims.rename_owner(name, new_name);
        for table in [Some(device.live()), device.inactive()].iter().flatten() {
            table.renamed(new_name);
        }
        let mut map = self.map();
        map.remove(name);
        map.insert(new_name.to_string(), device);
        drop(map);
        info!("renamed device '{name}' to '{new_name}'");
        Ok(())
    }

    /// Gives a device its UUID; as in dm, a UUID is set once.
    pub fn set_uuid(&self, name: &str, uuid: &str) -> Result<()> {
        check_uuid(uuid)?;
        let _changes = self.changes.lock();
        let device = self.get(name)?;
        if let Some(current) = device.uuid() {
            return Err(RegistryError::Busy(
                name.into(),
                format!("it has UUID {current} already, and a UUID is set only once"),
            ));
        }
        self.check_unused(uuid)?;
        device.set_uuid(uuid);
        self.save(&device)?;
        info!("device '{name}': UUID set to {uuid}");
        Ok(())
    }
}

#[cfg(test)]
mod tests {

    use udm_testkit::TempDir;

    use super::*;

    #[test]
    fn a_renamed_device_keeps_its_state_and_comes_back_under_its_new_name() {
        let dir = TempDir::new("rename");
        let meta = dir.sparse("log.img", 1 << 20);
        {
            let r = Registry::in_scratch(&dir);
            r.must_create("base", "0 2048 zero");
            // The log is claimed exclusively under the device's name.
            let table = format!("0 2048 log-writes base {}", meta.display());
            r.create("old", &table, false, Some("U-1")).unwrap();
            r.rename("old", "new").unwrap();
            assert!(r.get("old").is_err());
            assert_eq!(r.get("new").unwrap().name(), "new");
            assert_eq!(r.resolve("U-1").unwrap().name(), "new");
            // Its claims went with it: another device cannot take the log, and the device
            // itself can reload a table on it.
            let e = r
                .create("thief", &table, false, None)
                .err()
                .unwrap()
                .to_string();
            assert!(e.contains("in use by device 'new'"), "{e}");
            r.load("new", &table, false, false).unwrap();
            r.resume("new", false).unwrap();
            // A device used by another cannot be renamed: the other's table names it.
            let e = r.rename("base", "base2").unwrap_err().to_string();
            assert!(e.contains("used by new"), "{e}");
            // Names and UUIDs stay unique, each against both.
            assert!(r.rename("new", "base").is_err());
            assert!(r.rename("new", "U-1").is_err());
            assert!(r.create("U-1", "0 8 zero", false, None).is_err());
        }
        let r = Registry::in_scratch(&dir);
        assert_eq!(r.restore().unwrap(), 2);
        assert_eq!(r.get("new").unwrap().uuid().as_deref(), Some("U-1"));
        assert!(r.get("old").is_err());
        assert!(!dir.path("state/devices/old.json").exists());
    }

    #[test]
    fn a_rename_cut_short_by_a_crash_is_finished_at_restart() {
        let dir = TempDir::new("rename-crash");
        {
            let r = Registry::in_scratch(&dir);
            r.must_create("old", "0 8 zero");
        }
        // The first half of a rename: the record already names the device 'new', but the
        // file is still old.json.
        let path = dir.path("state/devices/old.json");
        let record = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, record.replace("\"old\"", "\"new\"")).unwrap();
        let r = Registry::in_scratch(&dir);
        assert_eq!(r.restore().unwrap(), 1);
        assert!(r.get("new").is_ok());
        assert!(!path.exists());
        assert!(dir.path("state/devices/new.json").exists());
    }

    #[test]
    fn a_uuid_is_set_once() {
        let dir = TempDir::new("setuuid");
        let r = Registry::in_scratch(&dir);
        r.must_create("a", "0 8 zero");
        r.create("b", "0 8 zero", false, Some("taken")).unwrap();
        assert!(r.set_uuid("a", "taken").is_err());
        assert!(r.set_uuid("a", "has space").is_err());
        r.set_uuid("a", "mine").unwrap();
        let e = r.set_uuid("a", "again").unwrap_err().to_string();
        assert!(e.contains("has UUID mine already"), "{e}");
    }
}
