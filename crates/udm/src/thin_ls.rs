//! `udm thin ls POOL`: the thin devices of a pool and what they hold, like thin_ls — from the
//! pool's `status --json` details, so both always give the same numbers.

use std::path::Path;

use anyhow::{bail, Context};
use serde_json::Value;

use crate::client;

pub fn show(control: &Path, pool: &str, json: bool) -> anyhow::Result<()> {
    let data = client::status(control, pool)?;
    let Some(details) = data["targets"]
        .as_array()
        .and_then(|targets| targets.iter().find(|t| t["type"] == "thin-pool"))
        .map(|t| &t["details"])
    else {
        bail!("device '{pool}' is not a thin pool (its table has no thin-pool target)");
    };
    if json {
        outln!("{}", serde_json::to_string_pretty(details)?);
        return Ok(());
    }
    out!("{}", table(details)?);
    Ok(())
}

fn table(details: &Value) -> anyhow::Result<String> {
    let devices = details["devices"]
        .as_array()
        .context("the pool's status has no device list")?;
    let block = details["block_bytes"].as_u64().unwrap_or(0);
    let header = [
        "DEV",
        "MAPPED_BLOCKS",
        "EXCLUSIVE_BLOCKS",
        "SHARED_BLOCKS",
        "MAPPED",
        "CREATE_TIME",
        "SNAP_TIME",
        "USED_BY",
    ];
    let mut rows = vec![header.iter().map(|h| h.to_string()).collect::<Vec<_>>()];
    for device in devices {
        if let Some(error) = device["error"].as_str() {
            bail!("reading the pool's mappings: {error}");
        }
        let number = |key: &str| device[key].as_u64().unwrap_or(0);
        let used_by: Vec<&str> = device["used_by"]
            .as_array()
            .map(|names| names.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        rows.push(vec![
            number("id").to_string(),
            number("mapped_blocks").to_string(),
            number("exclusive_blocks").to_string(),
            number("shared_blocks").to_string(),
            human(number("mapped_blocks") * block),
            number("creation_time").to_string(),
            number("snapshotted_time").to_string(),
            if used_by.is_empty() {
                "-".to_string()
            } else {
                used_by.join(",")
            },
        ]);
    }
    let widths: Vec<usize> = (0..header.len())
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        out += cells.join("  ").trim_end();
        out.push('\n');
    }
    Ok(out)
}

/// Bytes with a binary unit, as thin_ls prints sizes.
fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prints_one_row_per_device() {
        let details = serde_json::json!({
            "block_bytes": 65536,
            "devices": [
                {"id": 1, "mapped_blocks": 16, "exclusive_blocks": 6, "shared_blocks": 10,
                 "creation_time": 0, "snapshotted_time": 1, "used_by": ["vol"]},
                {"id": 2, "mapped_blocks": 10, "exclusive_blocks": 0, "shared_blocks": 10,
                 "creation_time": 1, "snapshotted_time": 1, "used_by": []},
            ]
        });
        let text = table(&details).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(
            lines[0].starts_with("DEV  MAPPED_BLOCKS  EXCLUSIVE_BLOCKS"),
            "{text}"
        );
        let row: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(row, ["1", "16", "6", "10", "1.0", "MiB", "0", "1", "vol"]);
        assert!(lines[2].ends_with('-'), "{text}");
        assert_eq!(human(512), "512 B");
    }
}
