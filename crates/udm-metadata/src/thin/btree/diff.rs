//! The difference of two trees of the same value kind (thin_delta's walk): both trees are
//! walked side by side, and a node that both reach is skipped whole, since a block number
//! names one content (nodes are copied before they change). So comparing a snapshot with a
//! later one reads only the nodes on the paths to what changed, whatever the device maps.
//!
//! Each tree is a frontier of pending items in key order: unread subtrees (a node block with
//! the key range its parent gives it and its height) and leaf entries. The fronts are compared;
//! a subtree is opened only when its range overlaps the other front's, the taller first (a
//! shared node sits at the same height in both trees: leaves are all at one depth).

use super::super::cache::BlockCache;
use super::super::error::{corrupt, Result};
use super::{node, read_node, ValueKind, MAX_DEPTH};

/// Where a key differs between the left and the right tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    LeftOnly,
    RightOnly,
    /// In both, with different values.
    Different,
}

#[derive(Debug, Clone, Copy)]
enum Item {
    /// An unread subtree: keys in `[lo, hi)` (hi None: unbounded), `height` levels (a leaf is 1).
    Node {
        block: u64,
        lo: u64,
        hi: Option<u64>,
        height: usize,
    },
    Entry {
        key: u64,
        value: u64,
    },
}

impl Item {
    fn lo(&self) -> u64 {
        match *self {
            Item::Node { lo, .. } => lo,
            Item::Entry { key, .. } => key,
        }
    }

    /// Every key of the item is below `self.end()` (None: no bound).
    fn end(&self) -> Option<u64> {
        match *self {
            Item::Node { hi, .. } => hi,
            Item::Entry { key, .. } => key.checked_add(1),
        }
    }

    fn height(&self) -> usize {
        match *self {
            Item::Node { height, .. } => height,
            Item::Entry { .. } => 0,
        }
    }

    /// Whether every key of `self` is below every key of `other`.
    fn before(&self, other: &Item) -> bool {
        self.end().is_some_and(|end| end <= other.lo())
    }
}

/// Pending items of one tree, the next one last (a stack).
struct Frontier(Vec<Item>);

impl Frontier {
    fn new(cache: &mut BlockCache, root: Option<u64>, vk: ValueKind) -> Result<Self> {
        let Some(root) = root else {
            return Ok(Frontier(Vec::new()));
        };
        Ok(Frontier(vec![Item::Node {
            block: root,
            lo: 0,
            hi: None,
            height: height(cache, root, vk)?,
        }]))
    }

    /// Replaces the subtree on top with its children (or entries).
    fn open(&mut self, cache: &mut BlockCache, vk: ValueKind) -> Result<()> {
        let Some(Item::Node {
            block, hi, height, ..
        }) = self.0.pop()
        else {
            unreachable!("only subtrees are opened");
        };
        let d = read_node(cache, block, vk)?;
        let d = &d[..];
        let nr = node::nr_entries(d);
        // A leaf where the tree's first path said there are more levels, or the reverse:
        // the tree is damaged (leaves are all at one depth).
        if node::is_leaf(d) != (height == 1) || height > MAX_DEPTH {
            return Err(corrupt(block, "btree leaves at different depths"));
        }
        for i in (0..nr).rev() {
            let key = node::key(d, i);
            self.0.push(if height == 1 {
                Item::Entry {
                    key,
                    value: node::value_u64(d, i),
                }
            } else {
                Item::Node {
                    block: node::value_u64(d, i),
                    lo: key,
                    hi: if i + 1 < nr {
                        Some(node::key(d, i + 1))
                    } else {
                        hi
                    },
                    height: height - 1,
                }
            });
        }
        Ok(())
    }
}

/// Levels of the tree at `root` (a lone leaf is 1), down its first path.
fn height(cache: &mut BlockCache, root: u64, vk: ValueKind) -> Result<usize> {
    let mut b = root;
    for depth in 1..=MAX_DEPTH {
        let d = read_node(cache, b, vk)?;
        if node::is_leaf(&d[..]) || node::nr_entries(&d[..]) == 0 {
            return Ok(depth);
        }
        b = node::value_u64(&d[..], 0);
    }
    Err(corrupt(root, "btree deeper than 16 levels (a cycle?)"))
}

/// Calls `visit(key, side)` for every key whose 8-byte value differs between the trees at
/// `left` and `right` (None: an empty tree), in key order. `same(a, b)` says whether two
/// values are the same (for mappings: the same data block, whatever the time).
pub fn diff(
    cache: &mut BlockCache,
    left: Option<u64>,
    right: Option<u64>,
    vk: ValueKind,
    same: impl Fn(u64, u64) -> bool,
    visit: &mut dyn FnMut(u64, Side),
) -> Result<()> {
    let mut l = Frontier::new(cache, left, vk)?;
    let mut r = Frontier::new(cache, right, vk)?;
    loop {
        match (l.0.last().copied(), r.0.last().copied()) {
            (None, None) => return Ok(()),
            (Some(Item::Entry { key, .. }), None) => {
                visit(key, Side::LeftOnly);
                l.0.pop();
            }
            (None, Some(Item::Entry { key, .. })) => {
                visit(key, Side::RightOnly);
                r.0.pop();
            }
            (Some(_), None) => l.open(cache, vk)?,
            (None, Some(_)) => r.open(cache, vk)?,
            (Some(Item::Node { block: a, .. }), Some(Item::Node { block: b, .. })) if a == b => {
                l.0.pop();
                r.0.pop();
            }
            (Some(x), Some(y)) => match (x, y) {
                (Item::Entry { key, .. }, _) if x.before(&y) => {
                    visit(key, Side::LeftOnly);
                    l.0.pop();
                }
                (_, Item::Entry { key, .. }) if y.before(&x) => {
                    visit(key, Side::RightOnly);
                    r.0.pop();
                }
                (Item::Entry { key, value: a }, Item::Entry { value: b, .. }) => {
                    // Overlapping entries have the same key.
                    if !same(a, b) {
                        visit(key, Side::Different);
                    }
                    l.0.pop();
                    r.0.pop();
                }
                _ if x.height() >= y.height() && matches!(x, Item::Node { .. }) => {
                    l.open(cache, vk)?
                }
                _ => r.open(cache, vk)?,
            },
        }
    }
}
