//! Helpers for the targets' own tests: tables over named in-memory devices.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use udm_block::{BlockDevice, BlockError, MemoryDevice, OpenMode, WriteFlags, ZeroFlags};

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

/// Builds a table and makes it live, as the daemon does.
pub fn build(resolver: &dyn Resolver, text: &str) -> Result<Table, TargetError> {
    let table = Table::build("test", text, resolver, Arc::new(|| {}))?;
    table.resume();
    Ok(table)
}

/// Builds a table whose events are counted.
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

/// Runs at every read of a [`Switchable`], before it.
pub type ReadHook = Box<dyn Fn() + Send + Sync>;

/// A device that can be told to fail reads or writes, and counts what reaches it.
pub struct Switchable {
    pub inner: MemoryDevice,
    pub fail_reads: AtomicBool,
    pub fail_writes: AtomicBool,
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub on_read: std::sync::Mutex<Option<ReadHook>>,
}

impl Switchable {
    pub fn new(size: u64) -> Self {
        Switchable {
            inner: MemoryDevice::new(size),
            fail_reads: AtomicBool::new(false),
            fail_writes: AtomicBool::new(false),
            reads: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            on_read: Default::default(),
        }
    }

    fn check(&self, fail: &AtomicBool, count: &AtomicU64) -> udm_block::Result<()> {
        count.fetch_add(1, Ordering::SeqCst);
        if fail.load(Ordering::SeqCst) {
            return Err(BlockError::Io("switched off".into()));
        }
        Ok(())
    }
}

impl BlockDevice for Switchable {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> udm_block::Result<()> {
        if let Some(hook) = &*self.on_read.lock().unwrap() {
            hook();
        }
        self.check(&self.fail_reads, &self.reads)?;
        self.inner.read(offset, buf)
    }
    fn write(&self, offset: u64, buf: &[u8], flags: WriteFlags) -> udm_block::Result<()> {
        self.check(&self.fail_writes, &self.writes)?;
        self.inner.write(offset, buf, flags)
    }
    fn flush(&self) -> udm_block::Result<()> {
        self.check(&self.fail_writes, &AtomicU64::new(0))
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> udm_block::Result<()> {
        self.check(&self.fail_writes, &self.writes)?;
        self.inner.write_zeroes(offset, len, flags)
    }
    fn discard(&self, offset: u64, len: u64) -> udm_block::Result<()> {
        self.inner.discard(offset, len)
    }
    fn block_status(&self, offset: u64, len: u64) -> udm_block::Result<Vec<udm_block::Extent>> {
        self.inner.block_status(offset, len)
    }
}

/// Resolves names to devices given as trait objects.
pub struct AnyResolver(pub HashMap<String, Arc<dyn BlockDevice>>);

impl Resolver for AnyResolver {
    fn open(&self, reference: &str, _mode: OpenMode) -> Result<Arc<dyn BlockDevice>, TargetError> {
        self.0
            .get(reference)
            .cloned()
            .ok_or_else(|| TargetError::new(format!("no device named '{reference}'")))
    }
}
