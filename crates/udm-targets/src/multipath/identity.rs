//! Whether two paths lead to one device. The kernel takes any path it is given; multipathd
//! builds a map from the paths of one WWID only, and udm's checker takes multipathd's place,
//! so udm checks instead: paths to two exports with different content served alternate reads
//! from each, and spread writes over both.
//!
//! A path's identity is its size and its first 4 KiB, compared with another path's read at
//! the same moment (at table load, at `reinstate_path`, and when the checker would reinstate
//! it: the checker's probe is that read). Content rather than the NBD export description:
//! only NBD paths have a description, few servers set one (udm's own does not), and files
//! and udm devices have none, while every path answers a read; and the first 4 KiB is where
//! volumes differ (a partition table, a filesystem's or LVM's label with its UUID). Two blank
//! volumes look alike until one is written; a read racing a write to the first block may
//! differ for a moment (the checker tries again at its next round). `no_path_identity_check`
//! skips the check.

use udm_block::{AlignedBuf, BlockDevice};

use super::io::each_at_once;
use super::paths::Path;

/// Bytes of a path's start that identify it: a page, which O_DIRECT accepts anywhere.
pub(super) const PROBE: u64 = 4096;

/// Reads the first [`PROBE`] bytes of `dev` (less when the multipath is smaller).
pub(super) fn read_head(dev: &dyn BlockDevice, len: u64) -> udm_block::Result<AlignedBuf> {
    let mut buf = AlignedBuf::zeroed(PROBE.min(len) as usize);
    dev.read(0, &mut buf)?;
    Ok(buf)
}

/// What a path looked like: its size and its first bytes.
pub(super) struct Seen<'a> {
    pub reference: &'a str,
    pub size: u64,
    pub head: &'a [u8],
}

/// Why `path` is not the device `known` leads to, in one line; `None` when it may be.
/// Sizes are compared first: they need no read to differ.
pub(super) fn mismatch(path: &Seen, known: &Seen) -> Option<String> {
    let why = if path.size != known.size {
        format!(
            "it is {} bytes and '{}' is {} bytes",
            path.size, known.reference, known.size
        )
    } else if path.head != known.head {
        format!(
            "their first {} bytes differ (read at the same moment)",
            path.head.len()
        )
    } else {
        return None;
    };
    Some(format!(
        "path '{}' leads to another device than path '{}': {why}; if they are one device, \
         add the feature no_path_identity_check",
        path.reference, known.reference
    ))
}

/// What `path` looks like with `head` read from it.
pub(super) fn seen<'a>(path: &'a Path, head: &'a [u8]) -> Seen<'a> {
    Seen {
        reference: &path.reference,
        size: path.dev.size(),
        head,
    }
}

/// At table load: every path's size against the first's, then the first bytes of those
/// that answer (a path down now is checked when it is reinstated), read at once.
pub(super) fn check_paths(paths: &[Path], len: u64) -> Result<(), String> {
    let Some(first) = paths.first() else {
        return Ok(());
    };
    if let Some(why) = paths[1..]
        .iter()
        .find_map(|path| mismatch(&seen(path, &[]), &seen(first, &[])))
    {
        return Err(why);
    }
    let every: Vec<usize> = (0..paths.len()).collect();
    let heads = each_at_once("multipath-probe", &every, |i| {
        read_head(&*paths[i].dev, len)
    });
    let answered: Vec<(usize, AlignedBuf)> = heads
        .into_iter()
        .filter_map(|(i, head)| Some((i, head.ok()?)))
        .collect();
    let Some(((known, known_head), rest)) = answered.split_first() else {
        return Ok(());
    };
    let known = seen(&paths[*known], known_head);
    match rest
        .iter()
        .find_map(|(i, head)| mismatch(&seen(&paths[*i], head), &known))
    {
        Some(why) => Err(why),
        None => Ok(()),
    }
}
