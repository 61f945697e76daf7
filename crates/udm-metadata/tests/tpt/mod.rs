//! thin-provisioning-tools as the external judge of udm's pool metadata: `thin_check` must
//! pass, and `thin_dump`'s XML (parsed here) must say what udm says is mapped.

#![allow(dead_code)] // each test file uses part of this module

pub mod oracle;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use udm_block::{BlockDevice, FileDevice, OpenMode, WriteFlags};
use udm_metadata::ThinMetadata;
use udm_testkit::TempDir;

/// A zeroed file of `size` bytes in `dir`, opened as a device.
pub fn device(dir: &TempDir, file: &str, size: u64) -> (PathBuf, Arc<dyn BlockDevice>) {
    let path = dir.sparse(file, size);
    let dev = FileDevice::open(&path, OpenMode::ReadWrite).unwrap();
    (path, Arc::new(dev))
}

/// Copies a device's content into `path` (for the tools, which read files).
pub fn save(dev: &dyn BlockDevice, path: &Path) {
    let mut image = vec![0u8; dev.size() as usize];
    dev.read(0, &mut image).unwrap();
    std::fs::write(path, &image).unwrap();
}

/// Writes `path`'s content onto a device.
pub fn load(path: &Path, dev: &dyn BlockDevice) {
    let image = std::fs::read(path).unwrap();
    dev.write(0, &image, WriteFlags::default()).unwrap();
    dev.flush().unwrap();
}

fn run(cmd: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e} (is thin-provisioning-tools installed?)"));
    (out.status.success(), udm_testkit::printed(&out))
}

/// Runs `thin_check` on the metadata in `path`, and [`oracle::check`] (which also verifies the
/// data reference counts); panics with what they found unless both pass.
pub fn check(path: &Path, when: &str) {
    check_with(path, when, true)
}

/// [`check`] for metadata written by thin_restore, whose allocation hints are loose.
pub fn check_restored(path: &Path, when: &str) {
    check_with(path, when, false)
}

fn check_with(path: &Path, when: &str, hints: bool) {
    let (ok, text) = run("thin_check", &[path.to_str().unwrap()]);
    let head: String = text.chars().take(3000).collect();
    assert!(ok, "thin_check fails {when}:\n{head}");
    let image = std::fs::read(path).unwrap();
    if let Err(e) = oracle::check(&image, hints) {
        panic!("the space maps are wrong {when}: {e}");
    }
}

/// `thin_check`'s verdict and output.
pub fn check_result(path: &Path) -> (bool, String) {
    run("thin_check", &[path.to_str().unwrap()])
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DumpDevice {
    pub mapped_blocks: u64,
    pub transaction: u64,
    pub creation_time: u32,
    pub snap_time: u32,
    /// vblock → (data block, time)
    pub mappings: BTreeMap<u64, (u64, u32)>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dump {
    pub time: u32,
    pub transaction: u64,
    pub data_block_size: u32,
    pub nr_data_blocks: u64,
    pub devices: BTreeMap<u32, DumpDevice>,
}

fn attrs(line: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = line;
    while let Some(eq) = rest.find("=\"") {
        let name = rest[..eq].rsplit([' ', '<']).next().unwrap().to_string();
        let after = &rest[eq + 2..];
        let end = after.find('"').unwrap();
        out.insert(name, after[..end].to_string());
        rest = &after[end + 1..];
    }
    out
}

fn num<T: std::str::FromStr>(a: &BTreeMap<String, String>, name: &str) -> T
where
    T::Err: std::fmt::Debug,
{
    a.get(name)
        .unwrap_or_else(|| panic!("thin_dump: no {name} in {a:?}"))
        .parse()
        .unwrap()
}

/// Parses thin_dump's XML.
pub fn parse(xml: &str) -> Dump {
    let mut dump = Dump::default();
    let mut current: Option<u32> = None;
    for line in xml.lines().map(str::trim) {
        let a = attrs(line);
        if line.starts_with("<superblock") {
            dump.time = num(&a, "time");
            dump.transaction = num(&a, "transaction");
            dump.data_block_size = num(&a, "data_block_size");
            dump.nr_data_blocks = num(&a, "nr_data_blocks");
        } else if line.starts_with("<device") {
            let id = num(&a, "dev_id");
            dump.devices.insert(
                id,
                DumpDevice {
                    mapped_blocks: num(&a, "mapped_blocks"),
                    transaction: num(&a, "transaction"),
                    creation_time: num(&a, "creation_time"),
                    snap_time: num(&a, "snap_time"),
                    mappings: BTreeMap::new(),
                },
            );
            current = Some(id);
        } else if line.starts_with("<range_mapping") {
            let dev = dump.devices.get_mut(&current.unwrap()).unwrap();
            let (origin, data, len, time): (u64, u64, u64, u32) = (
                num(&a, "origin_begin"),
                num(&a, "data_begin"),
                num(&a, "length"),
                num(&a, "time"),
            );
            for i in 0..len {
                dev.mappings.insert(origin + i, (data + i, time));
            }
        } else if line.starts_with("<single_mapping") {
            let dev = dump.devices.get_mut(&current.unwrap()).unwrap();
            dev.mappings.insert(
                num(&a, "origin_block"),
                (num(&a, "data_block"), num(&a, "time")),
            );
        }
    }
    dump
}

/// `thin_dump` of the metadata in `path` (of its metadata snapshot with `snap`).
pub fn dump(path: &Path, snap: bool) -> Dump {
    let mut args = vec![path.to_str().unwrap()];
    if snap {
        args.push("-m");
    }
    let (ok, text) = run("thin_dump", &args);
    assert!(ok, "thin_dump fails:\n{text}");
    parse(&text)
}

/// What udm says about every device: details and every mapping (data block, shared).
pub fn udm_view(meta: &mut ThinMetadata) -> BTreeMap<u32, (u64, BTreeMap<u64, u64>)> {
    let mut out = BTreeMap::new();
    for info in meta.devices() {
        let mut maps = BTreeMap::new();
        for (vb, db, len, _) in meta.lookup_range(info.id, 0, u64::MAX).unwrap() {
            for i in 0..len {
                maps.insert(vb + i, db + i);
            }
        }
        out.insert(info.id, (info.mapped_blocks, maps));
    }
    out
}

/// Asserts that thin_dump of `path` shows exactly `meta`'s devices and mappings, and that
/// the data space map's used count equals the distinct data blocks mapped.
pub fn assert_dump_matches(meta: &mut ThinMetadata, path: &Path, when: &str) {
    let dump = dump(path, false);
    let udm = udm_view(meta);
    assert_eq!(
        dump.devices.keys().collect::<Vec<_>>(),
        udm.keys().collect::<Vec<_>>(),
        "{when}: devices"
    );
    let mut distinct = std::collections::BTreeSet::new();
    for (id, dev) in &dump.devices {
        let (mapped, maps) = &udm[id];
        assert_eq!(
            dev.mapped_blocks, *mapped,
            "{when}: device {id} mapped_blocks"
        );
        assert_eq!(
            dev.mappings.len() as u64,
            *mapped,
            "{when}: device {id} mappings"
        );
        let dumped: BTreeMap<u64, u64> = dev.mappings.iter().map(|(&v, &(d, _))| (v, d)).collect();
        assert!(
            dumped == *maps,
            "{when}: device {id}: thin_dump and udm differ"
        );
        distinct.extend(dumped.values().copied());
        let info = meta.device(*id).unwrap();
        assert_eq!(
            (dev.transaction, dev.creation_time, dev.snap_time),
            (
                info.transaction_id,
                info.creation_time,
                info.snapshotted_time
            ),
            "{when}: device {id} details"
        );
    }
    if meta.held_root().is_some() {
        // The metadata snapshot's trees keep their blocks too.
        for dev in self::dump(path, true).devices.values() {
            distinct.extend(dev.mappings.values().map(|&(d, _)| d));
        }
    }
    assert_eq!(
        dump.transaction,
        meta.transaction_id(),
        "{when}: transaction id"
    );
    assert_eq!(
        meta.data_usage().used,
        distinct.len() as u64,
        "{when}: data blocks in use"
    );
    assert_eq!(
        dump.nr_data_blocks,
        meta.data_usage().total,
        "{when}: data blocks"
    );
}
