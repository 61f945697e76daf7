//! Helpers for the targets' own tests: tables over udm-testkit's [`Devices`].
//!
//! udm-testkit is built on this crate, so in these unit tests its `Devices` implements the
//! other copy of [`Resolver`] (the library's, not the one under test); the impl here is for
//! this one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use udm_block::{BlockDevice, OpenMode};
pub use udm_testkit::{Devices, Switchable};

use crate::table::Table;
use crate::target::{Resolver, TargetError};

impl Resolver for Devices {
    fn open(&self, reference: &str, _mode: OpenMode) -> Result<Arc<dyn BlockDevice>, TargetError> {
        self.find(reference)
            .ok_or_else(|| TargetError::new(format!("no device named '{reference}'")))
    }
}

/// In-memory devices of the given sizes, by name.
pub fn memory_resolver(devices: &[(&str, u64)]) -> Devices {
    Devices::memory(devices)
}

/// Builds a table and makes it live, as the daemon does.
pub fn build(resolver: &dyn Resolver, text: &str) -> Result<Table, TargetError> {
    let table = Table::build("test", text, resolver, Arc::new(|| {}))?;
    table.resume();
    Ok(table)
}

/// Asserts that each table line is refused with an error that contains its expected words.
pub fn assert_refused(resolver: &dyn Resolver, cases: &[(&str, &str)]) {
    for (text, expected) in cases {
        let err = match build(resolver, text) {
            Ok(_) => panic!("{text}: accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(expected), "{text}: {err}");
    }
}

/// Builds a table whose events are counted, and makes it live.
pub fn build_counting_events(
    resolver: &dyn Resolver,
    text: &str,
) -> Result<(Table, Arc<AtomicU64>), TargetError> {
    let events = Arc::new(AtomicU64::new(0));
    let counter = events.clone();
    let table = Table::build(
        "test",
        text,
        resolver,
        Arc::new(move || {
            counter.fetch_add(1, Ordering::SeqCst);
        }),
    )?;
    table.resume();
    Ok((table, events))
}
