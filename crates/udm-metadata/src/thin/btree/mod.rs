//! dm's persistent-data B-tree (K:`pd/dm-btree*.c`, TPT `src/pdata/btree.rs`): copy-on-write
//! nodes whose sharing between trees (snapshots) is recorded only in the metadata space map.
//!
//! A node with count > 1 is shared: changing it makes a copy, and the copy adds a referrer to
//! everything below it ([`shadow_node`] increments its children). Deleting a tree stops at
//! shared nodes, which only lose one reference ([`del_tree`]).

pub mod diff;
pub mod insert;
pub mod lookup;
pub mod node;
pub mod remove;

use std::sync::Arc;

use super::cache::{Block, BlockCache};
use super::checksum::Kind;
use super::error::{corrupt, Result};
use super::transaction::Tm;

/// No tree here is deeper than this; a deeper one has a cycle.
pub const MAX_DEPTH: usize = 16;

/// What a tree's leaves hold, which says what a reference from a leaf means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueKind {
    /// A thin device's mapping: data block << 24 | time; references a data block.
    Mapping,
    /// The top level of the mapping tree: a device's mapping tree root (a metadata block).
    Subtree,
    /// A device's details (24 bytes).
    Details,
    /// A data space map index entry (16 bytes).
    Index,
    /// A reference count of 3 or more (u32).
    RefCount,
}

impl ValueKind {
    pub fn size(self) -> usize {
        match self {
            ValueKind::Mapping | ValueKind::Subtree => 8,
            ValueKind::Details => 24,
            ValueKind::Index => 16,
            ValueKind::RefCount => 4,
        }
    }
}

fn u64_of(v: &[u8]) -> u64 {
    u64::from_le_bytes(v[..8].try_into().unwrap())
}

/// The data block of a mapping value.
pub fn mapping_block(v: u64) -> u64 {
    v >> 24
}

/// Node `b` of a tree of `vk`, with its header checked.
pub fn read_node(cache: &mut BlockCache, b: u64, vk: ValueKind) -> Result<Arc<Block>> {
    let d = cache.read(b, Kind::Node)?;
    node::check(b, &d[..], vk.size())?;
    Ok(d)
}

/// A new tree: one empty leaf.
pub fn new_tree(tm: &mut Tm, vk: ValueKind) -> Result<u64> {
    let b = tm.new_block(Kind::Node)?;
    node::init(tm.cache.get_mut(b), true, vk.size());
    Ok(b)
}

/// A writable version of node `b` (see [`Tm::shadow`]).
pub fn shadow_node(tm: &mut Tm, b: u64, vk: ValueKind) -> Result<u64> {
    read_node(&mut tm.cache, b, vk)?;
    let (copy, shared) = tm.shadow(b, Kind::Node)?;
    if shared {
        let d = read_node(&mut tm.cache, copy, vk)?;
        inc_children(tm, &d[..], vk)?;
    }
    Ok(copy)
}

/// Adds a reference to everything node `d` points at.
pub fn inc_children(tm: &mut Tm, d: &[u8], vk: ValueKind) -> Result<()> {
    for i in 0..node::nr_entries(d) {
        if node::is_leaf(d) {
            inc_value(tm, vk, node::value(d, i))?;
        } else {
            tm.inc(node::value_u64(d, i))?;
        }
    }
    Ok(())
}

pub fn inc_value(tm: &mut Tm, vk: ValueKind, v: &[u8]) -> Result<()> {
    match vk {
        ValueKind::Mapping => tm.dsm.inc(mapping_block(u64_of(v)), &mut tm.cache),
        ValueKind::Subtree => tm.inc(u64_of(v)),
        ValueKind::Details | ValueKind::Index | ValueKind::RefCount => Ok(()),
    }
}

/// Drops the reference a leaf value holds (deleting a device's mappings for [`ValueKind::Subtree`]).
pub fn dec_value(tm: &mut Tm, vk: ValueKind, v: &[u8]) -> Result<()> {
    match vk {
        ValueKind::Mapping => tm
            .dsm
            .dec(mapping_block(u64_of(v)), &mut tm.cache)
            .map(drop),
        ValueKind::Subtree => del_tree(tm, u64_of(v), ValueKind::Mapping),
        ValueKind::Details | ValueKind::Index | ValueKind::RefCount => Ok(()),
    }
}

/// Drops the reference to the tree at `root` (K:`dm_btree_del`): nodes left with no
/// referrer are freed, and so is what only they referenced.
pub fn del_tree(tm: &mut Tm, root: u64, vk: ValueKind) -> Result<()> {
    del_node(tm, root, vk, 0)
}

fn del_node(tm: &mut Tm, b: u64, vk: ValueKind, depth: usize) -> Result<()> {
    if depth > MAX_DEPTH {
        return Err(corrupt(b, "btree deeper than 16 levels (a cycle?)"));
    }
    if tm.count(b)? > 1 {
        tm.dec(b)?;
        return Ok(());
    }
    let d = read_node(&mut tm.cache, b, vk)?;
    for i in 0..node::nr_entries(&d[..]) {
        if node::is_leaf(&d[..]) {
            dec_value(tm, vk, node::value(&d[..], i))?;
        } else {
            del_node(tm, node::value_u64(&d[..], i), vk, depth + 1)?;
        }
    }
    tm.dec(b)?;
    Ok(())
}
