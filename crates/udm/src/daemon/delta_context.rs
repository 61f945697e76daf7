//! The NBD meta context `udm:delta:ID` (as qemu's `qemu:dirty-bitmap:NAME`): on the export of a
//! device whose table is one `thin` target, block status says which blocks differ from thin
//! device ID of the same pool (flag 1) and which do not (0) — what `udm send --from ID` would
//! send, for libnbd's tools (`nbdinfo --map=udm:delta:ID`). Computed from the metadata at each
//! request (a walk that skips what the two devices share).

use std::sync::Arc;

use udm_block::{BlockError, Extent, MetaContext, Result};
use udm_targets::replica;

use super::Registry;

pub const PREFIX: &str = "udm:delta:";
/// At most this many contexts are listed (a pool may hold thousands of devices).
const LISTED: usize = 100;
/// The flag of a block that differs.
pub const CHANGED: u32 = 1;

/// The pool and thin device id that device `name` serves, if its table is one `thin` target.
fn thin_of(registry: &Registry, name: &str) -> Option<(String, u32)> {
    let table = registry.get(name).ok()?.live();
    let [segment] = table.segments() else {
        return None;
    };
    if segment.target.type_name() != "thin" {
        return None;
    }
    let details = segment.target.status_details()?;
    let id = u32::try_from(details["id"].as_u64()?).ok()?;
    Some((details["pool"].as_str()?.to_string(), id))
}

/// Context `context` of export `name`, if it is `udm:delta:ID` of a thin device's export and
/// the pool has device ID.
pub fn find(registry: &Registry, name: &str, context: &str) -> Option<Arc<dyn MetaContext>> {
    let from: u32 = context.strip_prefix(PREFIX)?.parse().ok()?;
    let (pool, to) = thin_of(registry, name)?;
    replica::pool(&pool).ok()?.device(from)?;
    Some(Arc::new(Delta { pool, from, to }))
}

/// The delta contexts export `name` offers whose names start with `prefix`.
pub fn list(registry: &Registry, name: &str, prefix: &str) -> Vec<String> {
    let Some((pool, to)) = thin_of(registry, name) else {
        return Vec::new();
    };
    let Ok(handle) = replica::pool(&pool) else {
        return Vec::new();
    };
    handle
        .devices()
        .iter()
        .filter(|d| d.id != to)
        .map(|d| format!("{PREFIX}{}", d.id))
        .filter(|c| c.starts_with(prefix) || PREFIX.starts_with(prefix))
        .take(LISTED)
        .collect()
}

struct Delta {
    pool: String,
    from: u32,
    to: u32,
}

impl MetaContext for Delta {
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        let io = |e: udm_targets::TargetError| BlockError::Io(e.to_string());
        let pool = replica::pool(&self.pool).map_err(io)?;
        let block = pool.block_bytes();
        let runs = pool.delta(Some(self.from), self.to).map_err(io)?;
        let end = offset + len;
        let mut extents: Vec<Extent> = Vec::new();
        let mut at = offset;
        let mut push = |extents: &mut Vec<Extent>, upto: u64, flags: u32| {
            if upto > at {
                extents.push(Extent {
                    len: upto - at,
                    flags,
                });
                at = upto;
            }
        };
        for run in runs {
            let (start, stop) = (run.begin * block, (run.begin + run.len) * block);
            if stop <= offset {
                continue;
            }
            if start >= end {
                break;
            }
            push(&mut extents, start.clamp(offset, end), 0);
            push(&mut extents, stop.min(end), CHANGED);
        }
        push(&mut extents, end, 0);
        Ok(extents)
    }
}
