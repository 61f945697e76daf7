//! Helpers for the targets' own tests: tables over named in-memory devices.

use std::collections::HashMap;
use std::sync::Arc;

use udm_block::{BlockDevice, MemoryDevice, OpenMode};

use crate::table::Table;
use crate::target::{Resolver, TargetError};

pub struct MemoryResolver(HashMap<String, Arc<MemoryDevice>>);

impl MemoryResolver {
    pub fn get(&self, name: &str) -> Arc<MemoryDevice> {
        self.0[name].clone()
    }
}

impl Resolver for MemoryResolver {
    fn open(&self, reference: &str, _mode: OpenMode) -> Result<Arc<dyn BlockDevice>, TargetError> {
        self.0
            .get(reference)
            .map(|d| d.clone() as Arc<dyn BlockDevice>)
            .ok_or_else(|| TargetError::new(format!("no device named '{reference}'")))
    }
}

pub fn memory_resolver(devices: &[(&str, u64)]) -> MemoryResolver {
    MemoryResolver(
        devices
            .iter()
            .map(|(n, size)| (n.to_string(), Arc::new(MemoryDevice::new(*size))))
            .collect(),
    )
}

pub fn build(resolver: &dyn Resolver, text: &str) -> Result<Table, TargetError> {
    Table::build(text, resolver, Arc::new(|| {}))
}
