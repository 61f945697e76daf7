//! Insertion (K:`dm_btree_insert`, `btree_insert_raw`, `rebalance_or_split`): top-down, and
//! every full node met on the way is given room before the descent continues, so a parent
//! always has a free slot for a new sibling. Room comes, as in the kernel, from moving entries
//! into an unshared sibling with at least 8 free slots, else from a split: one node into two at
//! the edges of the parent (sequential writes leave full nodes behind), two into three inside.

use super::super::checksum::Kind;
use super::super::error::{corrupt, Result};
use super::super::transaction::Tm;
use super::node::{self, Entries};
use super::{read_node, shadow_node, ValueKind, MAX_DEPTH};

/// A sibling gets entries only if it has this many free slots (the kernel's SPACE_THRESHOLD).
const SPACE_THRESHOLD: usize = 8;

/// Where a key's value lives after [`insert_slot`].
pub struct Slot {
    /// The tree's root after shadowing.
    pub root: u64,
    /// The leaf holding the key (writable in this transaction) and the key's index in it.
    pub leaf: u64,
    pub index: usize,
    /// The key was already there (else its value is zeroes for the caller to fill in).
    pub existed: bool,
}

/// Inserts `(key, value)`; the old value if the key was there. Nothing is incremented for the
/// new value (the caller hands its reference over) and nothing is decremented for the old.
pub fn insert(
    tm: &mut Tm,
    root: u64,
    vk: ValueKind,
    key: u64,
    value: &[u8],
) -> Result<(u64, Option<Vec<u8>>)> {
    let slot = insert_slot(tm, root, vk, key)?;
    let leaf = tm.cache.get_mut(slot.leaf);
    let old = slot
        .existed
        .then(|| node::value(&leaf[..], slot.index).to_vec());
    node::set_value(&mut leaf[..], slot.index, value);
    Ok((slot.root, old))
}

fn needs_room(d: &[u8], key: u64) -> bool {
    if node::nr_entries(d) < node::max_entries(d) {
        return false;
    }
    // A full leaf that has the key needs no room: the insert is an overwrite.
    !(node::is_leaf(d) && node::lower_bound(d, key).is_some_and(|i| node::key(d, i) == key))
}

/// Shadows the path to `key`, making room on the way, and returns its slot (a new key is
/// inserted with a zero value).
pub fn insert_slot(tm: &mut Tm, root: u64, vk: ValueKind, key: u64) -> Result<Slot> {
    let root = shadow_node(tm, root, vk)?;
    if needs_room(&read_node(&mut tm.cache, root, vk)?[..], key) {
        split_beneath(tm, root, vk)?;
    }
    let mut b = root;
    for _ in 0..MAX_DEPTH {
        let d = read_node(&mut tm.cache, b, vk)?;
        let found = node::lower_bound(&d[..], key);
        if node::is_leaf(&d[..]) {
            let (index, existed) = match found {
                Some(i) if node::key(&d[..], i) == key => (i, true),
                Some(i) => (i + 1, false),
                None => (0, false),
            };
            drop(d);
            if !existed {
                let zero = vec![0u8; vk.size()];
                node::insert_at(tm.cache.get_mut(b), index, key, &zero);
            }
            return Ok(Slot {
                root,
                leaf: b,
                index,
                existed,
            });
        }
        let mut i = found.unwrap_or(0);
        let child = node::value_u64(&d[..], i);
        drop(d);
        if found.is_none() {
            // Below every key: the leftmost lower bound comes down to it.
            node::set_key(tm.cache.get_mut(b), 0, key);
        }
        let child = shadow_node(tm, child, vk)?;
        node::set_value(tm.cache.get_mut(b), i, &child.to_le_bytes());
        if needs_room(&read_node(&mut tm.cache, child, vk)?[..], key) {
            i = make_room(tm, b, i, vk, key)?;
        }
        b = node::value_u64(&read_node(&mut tm.cache, b, vk)?[..], i);
    }
    Err(corrupt(root, "btree deeper than 16 levels (a cycle?)"))
}

/// Splits a full root beneath itself: its entries go to two new children and it becomes an
/// internal node over them, staying where it is.
fn split_beneath(tm: &mut Tm, root: u64, vk: ValueKind) -> Result<()> {
    let d = read_node(&mut tm.cache, root, vk)?;
    let leaf = node::is_leaf(&d[..]);
    let vs = node::value_size(&d[..]);
    let mut entries = Entries::new(vs);
    entries.take_from(&d[..]);
    drop(d);
    let n = entries.len();
    let mut children = [0u64; 2];
    for (c, range) in children.iter_mut().zip([0..n / 2, n / 2..n]) {
        *c = tm.new_block(Kind::Node)?;
        let cd = tm.cache.get_mut(*c);
        node::init(cd, leaf, vs);
        entries.put_into(cd, range);
    }
    let rd = tm.cache.get_mut(root);
    node::init(rd, false, 8);
    for (i, c) in children.iter().enumerate() {
        let first = entries.keys[if i == 0 { 0 } else { n / 2 }];
        node::insert_at(rd, i, first, &c.to_le_bytes());
    }
    Ok(())
}

/// Gives the full child at `i` of `parent` room; the index of the child that now covers `key`.
fn make_room(tm: &mut Tm, parent: u64, i: usize, vk: ValueKind, key: u64) -> Result<usize> {
    let pd = read_node(&mut tm.cache, parent, vk)?;
    let nr_parent = node::nr_entries(&pd[..]);
    let left = (i > 0).then(|| node::value_u64(&pd[..], i - 1));
    let right = (i + 1 < nr_parent).then(|| node::value_u64(&pd[..], i + 1));
    drop(pd);
    let mut left_shared = false;
    let mut right_shared = false;
    if let Some(l) = left {
        left_shared = tm.count(l)? > 1;
        if !left_shared && free_slots(tm, l, vk)? >= SPACE_THRESHOLD {
            rebalance(tm, parent, &[i - 1, i], vk)?;
            return covering(tm, parent, vk, key);
        }
    }
    if let Some(r) = right {
        right_shared = tm.count(r)? > 1;
        if !right_shared && free_slots(tm, r, vk)? >= SPACE_THRESHOLD {
            rebalance(tm, parent, &[i, i + 1], vk)?;
            return covering(tm, parent, vk, key);
        }
    }
    if left_shared || right_shared || nr_parent <= 2 || i == 0 || i + 1 == nr_parent {
        split(tm, parent, &[i], vk)?;
    } else {
        split(tm, parent, &[i - 1, i], vk)?;
    }
    covering(tm, parent, vk, key)
}

fn free_slots(tm: &mut Tm, b: u64, vk: ValueKind) -> Result<usize> {
    let d = read_node(&mut tm.cache, b, vk)?;
    Ok(node::max_entries(&d[..]) - node::nr_entries(&d[..]))
}

/// The index of the child of `parent` whose range holds `key`.
fn covering(tm: &mut Tm, parent: u64, vk: ValueKind, key: u64) -> Result<usize> {
    let d = read_node(&mut tm.cache, parent, vk)?;
    Ok(node::lower_bound(&d[..], key).unwrap_or(0))
}

/// Shadows the children at `indexes` of `parent` (updating its pointers); their blocks.
pub fn shadow_children(
    tm: &mut Tm,
    parent: u64,
    indexes: &[usize],
    vk: ValueKind,
) -> Result<Vec<u64>> {
    let mut blocks = Vec::with_capacity(indexes.len());
    for &i in indexes {
        let child = node::value_u64(&read_node(&mut tm.cache, parent, vk)?[..], i);
        let child = shadow_node(tm, child, vk)?;
        node::set_value(tm.cache.get_mut(parent), i, &child.to_le_bytes());
        blocks.push(child);
    }
    Ok(blocks)
}

/// Pools the entries of `blocks` (neighbours, in order) and deals them out by `counts`.
pub fn redistribute(tm: &mut Tm, blocks: &[u64], counts: &[usize], vk: ValueKind) -> Result<()> {
    let first = read_node(&mut tm.cache, blocks[0], vk)?;
    let mut entries = Entries::new(node::value_size(&first[..]));
    drop(first);
    for &b in blocks {
        // Not `read_node`: a split's new internal node is empty, which its check refuses
        // (every block here was checked when it was read or made in this transaction).
        entries.take_from(&tm.cache.read(b, Kind::Node)?[..]);
    }
    debug_assert_eq!(entries.len(), counts.iter().sum::<usize>());
    let mut at = 0;
    for (&b, &n) in blocks.iter().zip(counts) {
        entries.put_into(tm.cache.get_mut(b), at..at + n);
        at += n;
    }
    Ok(())
}

/// Sets the parent's key of each child at `indexes` to the child's first key.
pub fn fix_keys(tm: &mut Tm, parent: u64, indexes: &[usize], vk: ValueKind) -> Result<()> {
    for &i in indexes {
        let child = node::value_u64(&read_node(&mut tm.cache, parent, vk)?[..], i);
        let first = node::key(&read_node(&mut tm.cache, child, vk)?[..], 0);
        node::set_key(tm.cache.get_mut(parent), i, first);
    }
    Ok(())
}

fn nr_of(tm: &mut Tm, b: u64, vk: ValueKind) -> Result<usize> {
    Ok(node::nr_entries(&read_node(&mut tm.cache, b, vk)?[..]))
}

/// Evens out two neighbouring children (the left gets half, rounded down).
fn rebalance(tm: &mut Tm, parent: u64, pair: &[usize], vk: ValueKind) -> Result<()> {
    let blocks = shadow_children(tm, parent, pair, vk)?;
    let total = nr_of(tm, blocks[0], vk)? + nr_of(tm, blocks[1], vk)?;
    redistribute(tm, &blocks, &[total / 2, total - total / 2], vk)?;
    fix_keys(tm, parent, &pair[1..], vk)
}

/// Splits the child at `indexes[0]` into two, or the two children at `indexes` into three,
/// with a new node after the first.
fn split(tm: &mut Tm, parent: u64, indexes: &[usize], vk: ValueKind) -> Result<()> {
    let mut blocks = shadow_children(tm, parent, indexes, vk)?;
    let template = read_node(&mut tm.cache, blocks[0], vk)?;
    let (leaf, vs) = (
        node::is_leaf(&template[..]),
        node::value_size(&template[..]),
    );
    drop(template);
    let new = tm.new_block(Kind::Node)?;
    node::init(tm.cache.get_mut(new), leaf, vs);
    let at = indexes[0] + 1;
    node::insert_at(tm.cache.get_mut(parent), at, 0, &new.to_le_bytes());
    blocks.insert(1, new);
    let mut total = 0;
    // The new node (index 1) is empty.
    for &b in blocks.iter().filter(|&&b| b != new) {
        total += nr_of(tm, b, vk)?;
    }
    let counts = if blocks.len() == 2 {
        vec![total / 2, total - total / 2]
    } else {
        let left = total / 3;
        let centre = (total - left) / 2;
        vec![left, centre, total - left - centre]
    };
    redistribute(tm, &blocks, &counts, vk)?;
    let moved: Vec<usize> = (at..at + blocks.len() - 1).collect();
    fix_keys(tm, parent, &moved, vk)
}
