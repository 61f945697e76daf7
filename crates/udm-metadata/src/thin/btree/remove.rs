//! Removal (K:`pd/dm-btree-remove.c`): top-down like insertion. Before stepping into a child
//! that is at the minimum (a third of its capacity) the child is refilled from a neighbour,
//! or merged with it when the two together are small — as the kernel's `rebalance2` does — so
//! that every node but the root keeps at least a third of its entries, which `thin_check`
//! verifies. (The kernel rebalances at every step, even above the minimum; refilling only at
//! the minimum gives the same guarantee and copies fewer shared nodes.) A root left with one
//! child takes that child's place.

use super::super::error::{corrupt, Result};
use super::super::transaction::Tm;
use super::insert::{fix_keys, redistribute, shadow_children};
use super::lookup::lookup;
use super::{inc_children, node, read_node, shadow_node, ValueKind, MAX_DEPTH};

/// Removes `key`; the new root and the value it had (None, and the tree untouched, if it was
/// not there). The value's reference is the caller's to drop.
pub fn remove(tm: &mut Tm, root: u64, vk: ValueKind, key: u64) -> Result<(u64, Option<Vec<u8>>)> {
    if lookup(&mut tm.cache, root, vk, key, |_| ())?.is_none() {
        return Ok((root, None));
    }
    let root = shadow_node(tm, root, vk)?;
    let mut b = root;
    for _ in 0..2 * MAX_DEPTH {
        let d = read_node(&mut tm.cache, b, vk)?;
        let nr = node::nr_entries(&d[..]);
        let found = node::lower_bound(&d[..], key);
        if node::is_leaf(&d[..]) {
            let i = found
                .filter(|&i| node::key(&d[..], i) == key)
                .ok_or_else(|| corrupt(b, format!("key {key} vanished from its leaf")))?;
            let old = node::value(&d[..], i).to_vec();
            drop(d);
            node::remove_at(tm.cache.get_mut(b), i);
            return Ok((root, Some(old)));
        }
        if nr == 1 {
            if b != root {
                return Err(corrupt(
                    b,
                    "internal btree node below the root with one child",
                ));
            }
            // Only the root can have one child: it takes the child's place.
            let child = node::value_u64(&d[..], 0);
            drop(d);
            collapse(tm, b, child, vk)?;
            continue;
        }
        let i = found.ok_or_else(|| corrupt(b, format!("key {key} below the node's range")))?;
        let child = node::value_u64(&d[..], i);
        drop(d);
        let child = shadow_node(tm, child, vk)?;
        node::set_value(tm.cache.get_mut(b), i, &child.to_le_bytes());
        let cd = read_node(&mut tm.cache, child, vk)?;
        let at_minimum = node::nr_entries(&cd[..]) <= node::max_entries(&cd[..]) / 3;
        drop(cd);
        if at_minimum {
            let pair = if i > 0 { [i - 1, i] } else { [i, i + 1] };
            refill(tm, b, pair, vk)?;
            if b == root && node::nr_entries(&read_node(&mut tm.cache, b, vk)?[..]) == 1 {
                continue;
            }
        }
        let d = read_node(&mut tm.cache, b, vk)?;
        let i = node::lower_bound(&d[..], key).unwrap_or(0);
        b = node::value_u64(&d[..], i);
    }
    Err(corrupt(root, "btree deeper than 16 levels (a cycle?)"))
}

/// Copies `child` over the (writable) root `b` and drops the reference to `child`.
fn collapse(tm: &mut Tm, b: u64, child: u64, vk: ValueKind) -> Result<()> {
    let cd = read_node(&mut tm.cache, child, vk)?;
    if tm.count(child)? > 1 {
        // The child stays where it is for its other owner, and the root's copy adds a
        // referrer to everything below.
        inc_children(tm, &cd[..], vk)?;
    }
    tm.cache.get_mut(b).copy_from_slice(&cd[..]);
    drop(cd);
    tm.dec(child)?;
    Ok(())
}

/// Refills the children at `pair` of `parent`, one of them at the minimum: merged into the
/// left one if together they are below 2 × (minimum + 1) (K:`__rebalance2`), else evened out.
fn refill(tm: &mut Tm, parent: u64, pair: [usize; 2], vk: ValueKind) -> Result<()> {
    let blocks = shadow_children(tm, parent, &pair, vk)?;
    let l = read_node(&mut tm.cache, blocks[0], vk)?;
    let r = read_node(&mut tm.cache, blocks[1], vk)?;
    let (nr_left, nr_right) = (node::nr_entries(&l[..]), node::nr_entries(&r[..]));
    let max = node::max_entries(&l[..]).min(node::max_entries(&r[..]));
    drop((l, r));
    let total = nr_left + nr_right;
    if total < 2 * (max / 3 + 1) && total <= max {
        redistribute(tm, &blocks, &[total, 0], vk)?;
        node::remove_at(tm.cache.get_mut(parent), pair[1]);
        // The right node's entries now live in the left one: only the node itself goes.
        tm.dec(blocks[1])?;
    } else {
        redistribute(tm, &blocks, &[total / 2, total - total / 2], vk)?;
        fix_keys(tm, parent, &pair[1..], vk)?;
    }
    Ok(())
}
