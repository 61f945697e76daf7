//! The two-level mapping tree (K:`dm-thin-metadata.c`): the top level maps a device id to the
//! root of the device's own tree, which maps a virtual block to `data block << 24 | time`.
//! Changing a device's tree shadows its path in the top level first, so a top-level node
//! shared with a metadata snapshot is copied (and its device roots gain a referrer) before
//! the device's root moves.

use super::btree::insert::{insert, insert_slot};
use super::btree::lookup::lookup;
use super::btree::remove::remove;
use super::btree::{node, ValueKind};
use super::error::{corrupt, Result};
use super::transaction::Tm;

/// Data block numbers have 40 bits and times 24 (K:`pack_block_time`).
pub const MAX_DATA_BLOCKS: u64 = 1 << 40;
pub const MAX_TIME: u32 = (1 << 24) - 1;

pub fn pack(data_block: u64, time: u32) -> u64 {
    (data_block << 24) | time as u64
}

/// (data block, time) of a mapping value.
pub fn unpack(v: u64) -> (u64, u32) {
    (v >> 24, (v & 0xff_ffff) as u32)
}

pub fn u64_of(v: &[u8]) -> u64 {
    u64::from_le_bytes(v[..8].try_into().unwrap())
}

/// The roots after a change to a device's tree: the top level's and the device's.
pub struct Roots {
    pub top: u64,
    pub device: u64,
}

/// Runs `change` on the tree of device `id` (which exists), with the top level's path to it
/// shadowed; the new roots and what `change` returned.
fn change_device<T>(
    tm: &mut Tm,
    top: u64,
    id: u32,
    change: impl FnOnce(&mut Tm, u64) -> Result<(u64, T)>,
) -> Result<(Roots, T)> {
    let slot = insert_slot(tm, top, ValueKind::Subtree, id as u64)?;
    if !slot.existed {
        return Err(corrupt(
            top,
            format!("device {id} is missing from the mapping tree"),
        ));
    }
    let leaf = tm.cache.read(slot.leaf, super::checksum::Kind::Node)?;
    let root = node::value_u64(&leaf[..], slot.index);
    drop(leaf);
    let (device, out) = change(tm, root)?;
    node::set_value(
        tm.cache.get_mut(slot.leaf),
        slot.index,
        &device.to_le_bytes(),
    );
    let roots = Roots {
        top: slot.root,
        device,
    };
    Ok((roots, out))
}

/// Maps `vblock` of `id` to `value`; the old value if there was one.
pub fn insert_mapping(
    tm: &mut Tm,
    top: u64,
    id: u32,
    vblock: u64,
    value: u64,
) -> Result<(Roots, Option<u64>)> {
    change_device(tm, top, id, |tm, root| {
        let (root, old) = insert(tm, root, ValueKind::Mapping, vblock, &value.to_le_bytes())?;
        Ok((root, old.map(|v| u64_of(&v))))
    })
}

/// Unmaps `vblock` of `id`, whose tree is at `root`; the old value (None, and nothing
/// touched, if it was unmapped).
pub fn remove_mapping(
    tm: &mut Tm,
    top: u64,
    id: u32,
    vblock: u64,
    root: u64,
) -> Result<(Roots, Option<u64>)> {
    if lookup(&mut tm.cache, root, ValueKind::Mapping, vblock, |_| ())?.is_none() {
        return Ok((Roots { top, device: root }, None));
    }
    change_device(tm, top, id, |tm, root| {
        let (root, old) = remove(tm, root, ValueKind::Mapping, vblock)?;
        Ok((root, old.map(|v| u64_of(&v))))
    })
}
