//! What a table's references open: files and block devices, remote exports and other udm
//! devices, each claimed in the name of the device whose table it is, and no device that
//! would depend on itself.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use udm_block::{BlockDevice, FileDevice, OpenMode};
use udm_targets::{Reference, Resolver, TargetError};

use super::claims::Claimed;
use super::registry::Registry;

/// Opens the references of one device's table.
pub(super) struct TableResolver<'a> {
    pub(super) registry: &'a Registry,
    /// The device whose table this is: what it opens is claimed in its name.
    pub(super) owner: &'a str,
}

impl Resolver for TableResolver<'_> {
    fn open(&self, reference: &str, mode: OpenMode) -> Result<Arc<dyn BlockDevice>, TargetError> {
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
        match Reference::parse(reference) {
            Reference::Remote(uri) => self.registry.remotes.open_path(uri, mode, timeout),
            _ => self.open(reference, mode),
        }
    }
}

impl TableResolver<'_> {
    /// A file or block device, claimed unless opened read-only.
    fn open_file(&self, path: &Path, mode: OpenMode) -> Result<Arc<dyn BlockDevice>, TargetError> {
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
    fn open_device(&self, name: &str, mode: OpenMode) -> Result<Arc<dyn BlockDevice>, TargetError> {
        if name == self.owner || self.registry.depends_on(name, self.owner) {
            return Err(TargetError::new(format!(
                "using device '{name}' would make '{}' depend on itself",
                self.owner
            )));
        }
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
