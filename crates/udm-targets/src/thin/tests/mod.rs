//! The pool and thin targets on memory devices (and files, where remapping is checked):
//! provisioning, zeroing, sharing and breaking it, discards, running out of space, reloads,
//! and the refusals.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use udm_block::{BlockDevice, MemoryDevice, OpenMode, WriteFlags};

use crate::table::Table;
use crate::target::{Resolver, TargetError};

const KIB: u64 = 1024;
const MIB: u64 = 1 << 20;
/// 64 KiB blocks.
const BLOCK: u64 = 64 * KIB;

/// Named devices for tables, with the pool device added once built; every name unique in
/// the process, since pools are found by name process-wide.
struct Rig {
    name: String,
    devices: Mutex<HashMap<String, Arc<dyn BlockDevice>>>,
    events: Arc<AtomicU64>,
}

fn unique(tag: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!("{tag}-{}", N.fetch_add(1, Ordering::Relaxed))
}

impl Resolver for Rig {
    fn open(&self, reference: &str, _mode: OpenMode) -> Result<Arc<dyn BlockDevice>, TargetError> {
        self.devices
            .lock()
            .get(reference)
            .cloned()
            .ok_or_else(|| TargetError::new(format!("no device named '{reference}'")))
    }
}

/// The rig's devices, opened for the tables of read-only devices.
struct ReadOnly<'a>(&'a Rig);

impl Resolver for ReadOnly<'_> {
    fn open(&self, reference: &str, mode: OpenMode) -> Result<Arc<dyn BlockDevice>, TargetError> {
        self.0.open(reference, mode)
    }

    fn read_only(&self) -> bool {
        true
    }
}

impl Rig {
    /// A rig with a metadata device `meta` and a data device `data` of these sizes.
    fn new(meta_size: u64, data_size: u64) -> Rig {
        let rig = Rig {
            name: unique("pool"),
            devices: Mutex::default(),
            events: Arc::default(),
        };
        rig.add("meta", Arc::new(MemoryDevice::new(meta_size)));
        rig.add("data", Arc::new(MemoryDevice::new(data_size)));
        rig
    }

    /// Device names are made unique per rig (pools are keyed by their metadata device
    /// process-wide): `{meta}` in a table stands for this rig's `meta`.
    fn unique_name(&self, name: &str) -> String {
        format!("{}-{name}", self.name)
    }

    fn add(&self, name: &str, dev: Arc<dyn BlockDevice>) {
        self.devices.lock().insert(self.unique_name(name), dev);
    }

    fn dev(&self, name: &str) -> Arc<dyn BlockDevice> {
        self.devices.lock()[&self.unique_name(name)].clone()
    }

    fn build(&self, owner: &str, text: &str) -> Result<Table, TargetError> {
        self.build_with(self, owner, text)
    }

    /// [`Rig::build`], opening devices with `resolver`.
    fn build_with(
        &self,
        resolver: &dyn Resolver,
        owner: &str,
        text: &str,
    ) -> Result<Table, TargetError> {
        let events = self.events.clone();
        let text: Vec<String> = text
            .split(' ')
            .map(
                |word| match word.strip_prefix('{').and_then(|w| w.strip_suffix('}')) {
                    Some(name) => self.unique_name(name),
                    None => word.to_string(),
                },
            )
            .collect();
        Table::build(
            owner,
            &text.join(" "),
            resolver,
            Arc::new(move || {
                events.fetch_add(1, Ordering::SeqCst);
            }),
        )
    }

    /// Builds the pool table (`rest` after the devices), makes it live and adds it as the
    /// device `self.name`.
    fn pool(&self, sectors: u64, rest: &str) -> Arc<Table> {
        let table = Arc::new(
            self.build(
                &self.name,
                &format!("0 {sectors} thin-pool {{meta}} {{data}} {rest}"),
            )
            .unwrap(),
        );
        table.resume();
        self.devices.lock().insert(self.name.clone(), table.clone());
        table
    }

    fn thin(&self, len: u64, id: u32) -> Result<Table, TargetError> {
        self.thin_with(self, len, id)
    }

    /// [`Rig::thin`] of a read-only device.
    fn thin_read_only(&self, len: u64, id: u32) -> Result<Table, TargetError> {
        self.thin_with(&ReadOnly(self), len, id)
    }

    fn thin_with(&self, resolver: &dyn Resolver, len: u64, id: u32) -> Result<Table, TargetError> {
        let table = self.build_with(
            resolver,
            &unique("vol"),
            &format!("0 {} thin {} {id}", len / 512, self.name),
        )?;
        table.resume();
        Ok(table)
    }

    fn message(&self, pool: &Table, text: &str) -> Result<String, TargetError> {
        let words: Vec<&str> = text.split_whitespace().collect();
        pool.target_at(0).unwrap().message(&words)
    }

    fn status(&self, table: &Table) -> String {
        table.segments()[0].target.status()
    }

    /// Used data blocks, from the pool's status line.
    fn data_used(&self, pool: &Table) -> u64 {
        let status = self.status(pool);
        let field = status.split(' ').nth(2).unwrap();
        field.split('/').next().unwrap().parse().unwrap()
    }
}

fn filled(len: u64, byte: u8) -> Vec<u8> {
    vec![byte; len as usize]
}

fn read(dev: &dyn BlockDevice, offset: u64, len: u64) -> Vec<u8> {
    let mut buf = vec![0u8; len as usize];
    dev.read(offset, &mut buf).unwrap();
    buf
}

fn write(dev: &dyn BlockDevice, offset: u64, data: &[u8]) {
    dev.write(offset, data, WriteFlags::default()).unwrap();
}

/// A pool of `blocks` 64 KiB data blocks on 4 MiB of metadata, with thin device 1.
fn pool_with_thin(blocks: u64, features: &str) -> (Rig, Arc<Table>) {
    let rig = Rig::new(4 * MIB, blocks * BLOCK);
    let pool = rig.pool(blocks * BLOCK / 512, &format!("128 0 {features}"));
    rig.message(&pool, "create_thin 1").unwrap();
    (rig, pool)
}

mod datapath;
mod pool;
mod replica;
