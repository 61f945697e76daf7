//! The registry as the exports see it: every device, served by name.

use std::sync::Arc;

use udm_block::{Export, ExportCatalog, MetaContext};

use super::delta_context;

use super::Registry;

/// Every device, served by name, to NBD clients or (`as_files`) through the FUSE mount.
pub struct Catalog {
    pub registry: Arc<Registry>,
    /// Opens count as opens of the device's file (see [`super::Device::file_open_count`]).
    pub as_files: bool,
}

impl ExportCatalog for Catalog {
    fn open(&self, name: &str) -> Option<Export> {
        let device = self.registry.get(name).ok()?;
        Some(Export {
            read_only: device.read_only(),
            description: format!("udm device {name}"),
            open_guard: Box::new(device.open(self.as_files)),
            device,
        })
    }

    fn list(&self) -> Vec<(String, String)> {
        self.registry
            .all()
            .iter()
            .map(|d| (d.name().to_string(), format!("udm device {}", d.name())))
            .collect()
    }

    fn meta_context(&self, name: &str, context: &str) -> Option<Arc<dyn MetaContext>> {
        delta_context::find(&self.registry, name, context)
    }

    fn meta_contexts(&self, name: &str, prefix: &str) -> Vec<String> {
        delta_context::list(&self.registry, name, prefix)
    }
}
