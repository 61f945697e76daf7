//! Reading a tree: one key (K:`dm_btree_lookup`), keys in a range in order, the last key.
//! Reads need only the cache: no block is shadowed or allocated.

use super::super::cache::BlockCache;
use super::super::checksum::Kind;
use super::super::error::{corrupt, Result};
use super::{node, read_node, ValueKind, MAX_DEPTH};

/// The value of `key`, passed through `decode`. The pool's hot path: warm nodes are read
/// in place, without a disk read, a copy or a reference count.
pub fn lookup<T>(
    cache: &mut BlockCache,
    root: u64,
    vk: ValueKind,
    key: u64,
    decode: impl FnOnce(&[u8]) -> T,
) -> Result<Option<T>> {
    let mut b = root;
    let mut depth = 0;
    while depth < MAX_DEPTH {
        let Some(d) = cache.cached(b, Kind::Node)? else {
            // A miss: read the node in, then look again.
            read_node(cache, b, vk)?;
            continue;
        };
        let d = &d[..];
        node::check(b, d, vk.size())?;
        depth += 1;
        let Some(i) = node::lower_bound(d, key) else {
            return Ok(None);
        };
        if node::is_leaf(d) {
            return Ok((node::key(d, i) == key).then(|| decode(node::value(d, i))));
        }
        b = node::value_u64(d, i);
    }
    Err(corrupt(root, "btree deeper than 16 levels (a cycle?)"))
}

/// Calls `visit(key, value)` for every key in `[lo, hi)` (every key from `lo` with `hi` None),
/// in order.
pub fn walk(
    cache: &mut BlockCache,
    root: u64,
    vk: ValueKind,
    lo: u64,
    hi: Option<u64>,
    visit: &mut dyn FnMut(u64, &[u8]) -> Result<()>,
) -> Result<()> {
    walk_node(cache, root, vk, lo, hi, 0, visit)
}

fn walk_node(
    cache: &mut BlockCache,
    b: u64,
    vk: ValueKind,
    lo: u64,
    hi: Option<u64>,
    depth: usize,
    visit: &mut dyn FnMut(u64, &[u8]) -> Result<()>,
) -> Result<()> {
    if depth >= MAX_DEPTH {
        return Err(corrupt(b, "btree deeper than 16 levels (a cycle?)"));
    }
    let d = read_node(cache, b, vk)?;
    let d = &d[..];
    let below_hi = |k: u64| hi.is_none_or(|hi| k < hi);
    let nr = node::nr_entries(d);
    if node::is_leaf(d) {
        let first = match node::lower_bound(d, lo) {
            Some(i) if node::key(d, i) == lo => i,
            Some(i) => i + 1,
            None => 0,
        };
        for i in first..nr {
            let k = node::key(d, i);
            if !below_hi(k) {
                break;
            }
            visit(k, node::value(d, i))?;
        }
        return Ok(());
    }
    // Child i holds keys from key(i) (a lower bound) up to key(i + 1).
    let first = node::lower_bound(d, lo).unwrap_or(0);
    for i in first..nr {
        if !below_hi(node::key(d, i)) {
            break;
        }
        walk_node(cache, node::value_u64(d, i), vk, lo, hi, depth + 1, visit)?;
    }
    Ok(())
}

/// The highest key of the tree, if it has any.
pub fn last_key(cache: &mut BlockCache, root: u64, vk: ValueKind) -> Result<Option<u64>> {
    let mut b = root;
    for _ in 0..MAX_DEPTH {
        let d = read_node(cache, b, vk)?;
        let nr = node::nr_entries(&d[..]);
        if nr == 0 {
            return Ok(None);
        }
        if node::is_leaf(&d[..]) {
            return Ok(Some(node::key(&d[..], nr - 1)));
        }
        b = node::value_u64(&d[..], nr - 1);
    }
    Err(corrupt(root, "btree deeper than 16 levels (a cycle?)"))
}
