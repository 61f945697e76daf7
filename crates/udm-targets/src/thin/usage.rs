//! What each thin device holds, as `thin_ls` counts it: mapped blocks, and of those the ones
//! no other device maps (exclusive) and the ones it shares. Counted by walking every device's
//! mappings — data reference counts cannot tell, since snapshots share whole subtrees whose
//! blocks keep a count of 1. A mapping made after its device's last snapshot is its own (the
//! block was allocated for it, and no snapshot has it); only the others are counted across
//! devices, so the memory goes with the blocks snapshots may share. The walk takes the
//! metadata lock a window at a time, so I/O goes on meanwhile; its time goes with the mapped
//! blocks.

use std::collections::HashMap;

use serde_json::json;

use udm_metadata::thin::{DeviceInfo, ThinError};

use super::core::Pool;

/// Virtual blocks looked up per metadata lock.
const WINDOW: u64 = 1 << 16;

pub struct DeviceUsage {
    pub id: u32,
    pub mapped: u64,
    pub exclusive: u64,
    pub shared: u64,
    pub highest: Option<u64>,
    pub transaction_id: u64,
    pub creation_time: u32,
    pub snapshotted_time: u32,
}

/// Every device's usage, by id.
pub fn devices(pool: &Pool) -> Result<Vec<DeviceUsage>, String> {
    let infos = pool.meta().md.devices();
    usage_of(pool, infos)
}

/// The usage of the devices `infos` lists. The walk lets the metadata lock go between
/// windows, so a device may be deleted while it runs: such a device is left out, as it
/// would have been had the walk started a moment later.
pub(super) fn usage_of(pool: &Pool, infos: Vec<DeviceInfo>) -> Result<Vec<DeviceUsage>, String> {
    let mut walked = Vec::with_capacity(infos.len());
    let mut users: HashMap<u64, u32> = HashMap::new();
    for info in infos {
        match walk(pool, info.id) {
            Ok((runs, highest)) => {
                // Counted once the walk is whole: a device deleted half-way counts for none.
                for &(data, len, _) in runs.iter().filter(|run| run.2) {
                    for block in data..data + len {
                        *users.entry(block).or_default() += 1;
                    }
                }
                walked.push((info, runs, highest))
            }
            Err(ThinError::NoSuchDevice(id)) if id == info.id => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(walked
        .into_iter()
        .map(|(info, runs, highest)| {
            let mut usage = DeviceUsage {
                id: info.id,
                mapped: 0,
                exclusive: 0,
                shared: 0,
                highest,
                transaction_id: info.transaction_id,
                creation_time: info.creation_time,
                snapshotted_time: info.snapshotted_time,
            };
            for (data, len, shared) in runs {
                usage.mapped += len;
                if !shared {
                    usage.exclusive += len;
                    continue;
                }
                for block in data..data + len {
                    if users[&block] == 1 {
                        usage.exclusive += 1;
                    } else {
                        usage.shared += 1;
                    }
                }
            }
            usage
        })
        .collect())
}

/// A run of mapped blocks: its first data block, its length, and whether it may be shared.
type Run = (u64, u64, bool);

/// The mapped runs of device `id` and its highest mapped block.
fn walk(pool: &Pool, id: u32) -> Result<(Vec<Run>, Option<u64>), ThinError> {
    let highest = pool.meta().md.highest_mapped(id)?;
    let mut runs = Vec::new();
    let mut begin = 0;
    let end = highest.map_or(0, |h| h + 1);
    while begin < end {
        let window = pool
            .meta()
            .md
            .lookup_range(id, begin, (begin + WINDOW).min(end))?;
        runs.extend(
            window
                .into_iter()
                .map(|(_, data, len, shared)| (data, len, shared)),
        );
        begin += WINDOW;
    }
    Ok((runs, highest))
}

/// The pool's `udm status --json` details: the status line's numbers by name, and every
/// thin device's usage (what `udm thin ls` prints).
pub fn pool_details(pool: &Pool) -> serde_json::Value {
    let status = pool.status();
    let block = pool.block_bytes();
    let devices = match devices(pool) {
        Ok(devices) => devices
            .iter()
            .map(|d| {
                json!({
                    "id": d.id,
                    "mapped_blocks": d.mapped,
                    "exclusive_blocks": d.exclusive,
                    "shared_blocks": d.shared,
                    "mapped_bytes": d.mapped * block,
                    "highest_mapped_block": d.highest,
                    "transaction_id": d.transaction_id,
                    "creation_time": d.creation_time,
                    "snapshotted_time": d.snapshotted_time,
                    "used_by": pool.users_of(d.id).into_iter().map(|(name, _)| name)
                        .collect::<Vec<_>>(),
                })
            })
            .collect(),
        Err(e) => vec![json!({ "error": e })],
    };
    json!({
        "mode": status.mode.word(),
        "transaction_id": status.transaction_id,
        "block_bytes": block,
        "data_blocks": { "used": status.data_used, "total": status.data_total },
        "metadata_blocks": { "used": status.metadata_used, "total": status.metadata_total },
        "held_metadata_root": status.held_root,
        "discard": match (status.discard_enabled, status.discard_passdown) {
            (false, _) => "ignore_discard",
            (true, true) => "discard_passdown",
            (true, false) => "no_discard_passdown",
        },
        "no_space": if status.error_if_no_space { "error" } else { "queue" },
        "writes_waiting_for_space": pool.space.waiting(),
        "needs_check": status.needs_check,
        "metadata_low_water_blocks": status.metadata_low_water,
        "devices": devices,
    })
}
