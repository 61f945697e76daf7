//! What a table's references open: files and block devices, remote exports and other udm
//! devices, each claimed in the name of the device whose table it is, and no device that
//! would depend on itself.

use std::borrow::Cow;
use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use udm_block::{BlockDevice, FileDevice, OpenMode};
use udm_targets::{Reference, Resolver, TargetError};

use super::claims::Claimed;
use super::registry::Registry;

/// Where dmsetup users find a device-mapper device: they name it so in verbs and tables.
const MAPPER_NODES: &str = "/dev/mapper/";

/// The udm device a `/dev/mapper/NAME` node names: udm makes no such nodes, so one that does
/// not exist on this host means udm's device NAME (the kernel's documentation and dmsetup
/// users write `dmsetup message /dev/mapper/pool 0 …` and `thin /dev/mapper/pool 0`). One that
/// exists is the kernel's device (an LVM volume udm is stacked on) and stays a path.
pub(super) fn mapper_node_name(word: &str) -> Option<&str> {
    let name = word.strip_prefix(MAPPER_NODES)?;
    (!name.is_empty() && !Path::new(word).exists()).then_some(name)
}

/// `text` with each `/dev/mapper/NAME` that names a udm device written as `NAME`, the way the
/// kernel's table shows a device by its number rather than the path it was given as.
pub(super) fn mapper_nodes_as_names<'t>(
    text: &'t str,
    is_device: impl Fn(&str) -> bool,
) -> Cow<'t, str> {
    if !text.contains(MAPPER_NODES) {
        return Cow::Borrowed(text);
    }
    let word = |w: &'t str| {
        mapper_node_name(w)
            .filter(|name| is_device(name))
            .unwrap_or(w)
    };
    let lines: Vec<String> = text
        .lines()
        .map(|line| {
            line.split_whitespace()
                .map(word)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    Cow::Owned(lines.join("\n"))
}

/// A file as one table opened it: (device, inode, read-only).
type OpenedKey = (u64, u64, bool);

/// Opens the references of one device's table.
pub(super) struct TableResolver<'a> {
    pub(super) registry: &'a Registry,
    /// The device whose table this is: what it opens is claimed in its name.
    pub(super) owner: &'a str,
    /// Files this table opened shared (read-only or read-write), by (device, inode) and mode:
    /// a table of many segments on one file opens it once, as the kernel's dm_get_device
    /// does. Before, each segment opened it again (two descriptors each), and a table of
    /// 10,000 `linear` lines on one file ran the daemon out of descriptors.
    pub(super) opened: Mutex<HashMap<OpenedKey, Arc<dyn BlockDevice>>>,
    /// The table brings its device back after a restart ([`Resolver::restoring`]).
    pub(super) restoring: bool,
    /// The table serves a read-only device ([`Resolver::read_only`]).
    pub(super) read_only: bool,
}

impl Resolver for TableResolver<'_> {
    fn restoring(&self) -> bool {
        self.restoring
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn open(&self, reference: &str, mode: OpenMode) -> Result<Arc<dyn BlockDevice>, TargetError> {
        self.check_not_our_own(reference)?;
        match Reference::parse(reference) {
            Reference::Path(path) => self.open_file(Path::new(path), mode),
            Reference::Remote(uri) => self.registry.remotes.open(uri, mode),
            Reference::Device(name) => self.open_device(name, mode),
        }
    }

    fn open_path(
        &self,
        reference: &str,
        mode: OpenMode,
        timeout: Duration,
    ) -> Result<Arc<dyn BlockDevice>, TargetError> {
        self.check_not_our_own(reference)?;
        match Reference::parse(reference) {
            Reference::Remote(uri) => self.registry.remotes.open_path(uri, mode, timeout),
            _ => self.open(reference, mode),
        }
    }
}

impl TableResolver<'_> {
    /// A file or block device, claimed unless opened read-only; opened once per table unless
    /// exclusive (an exclusive user named twice must still be refused by the claims).
    fn open_file(&self, path: &Path, mode: OpenMode) -> Result<Arc<dyn BlockDevice>, TargetError> {
        if mode.is_exclusive() {
            return self.open_and_claim_file(path, mode);
        }
        let meta = std::fs::metadata(path)
            .map_err(|e| TargetError::new(format!("{}: {e}", path.display())))?;
        let key = (meta.dev(), meta.ino(), mode == OpenMode::ReadOnly);
        if let Some(dev) = self.opened.lock().get(&key) {
            return Ok(dev.clone());
        }
        let dev = self.open_and_claim_file(path, mode)?;
        self.opened.lock().insert(key, dev.clone());
        Ok(dev)
    }

    fn open_and_claim_file(
        &self,
        path: &Path,
        mode: OpenMode,
    ) -> Result<Arc<dyn BlockDevice>, TargetError> {
        let claim = match mode {
            OpenMode::ReadOnly => None,
            _ => Some(
                self.registry
                    .claims
                    .claim_file(path, self.owner, mode)
                    .map_err(TargetError::new)?,
            ),
        };
        let dev: Arc<dyn BlockDevice> =
            Arc::new(FileDevice::open(path, mode).map_err(|e| TargetError::new(e.to_string()))?);
        Ok(match claim {
            Some(claim) => Arc::new(Claimed::new(dev, claim)),
            None => dev,
        })
    }

    /// Another udm device, unless that would make a cycle; claimed unless opened read-only.
    /// A path or URI that leads back into this daemon is the device it reaches.
    fn check_not_our_own(&self, reference: &str) -> Result<(), TargetError> {
        match self.registry.own_exports.device_behind(reference) {
            Some(name) => self.check_no_cycle(&name).map_err(|e| {
                TargetError::new(format!("{reference} reads udm's own device '{name}': {e}"))
            }),
            None => Ok(()),
        }
    }

    fn check_no_cycle(&self, name: &str) -> Result<(), TargetError> {
        if name == self.owner || self.registry.depends_on(name, self.owner) {
            return Err(TargetError::new(format!(
                "using device '{name}' would make '{}' depend on itself",
                self.owner
            )));
        }
        Ok(())
    }

    fn open_device(&self, name: &str, mode: OpenMode) -> Result<Arc<dyn BlockDevice>, TargetError> {
        self.check_no_cycle(name)?;
        let device = self.registry.get(name).map_err(|_| {
            TargetError::new(format!(
                "no device named '{name}' (paths start with / or ./, remote exports \
                 with nbd:// or nbd+unix://)"
            ))
        })?;
        if mode == OpenMode::ReadOnly {
            return Ok(device);
        }
        let claim = self
            .registry
            .claims
            .claim_device(name, self.owner, mode)
            .map_err(TargetError::new)?;
        Ok(Arc::new(Claimed::new(device, claim)))
    }
}
