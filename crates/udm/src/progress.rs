//! `udm wait NAME --progress`: a live progress bar for hydration, from `status --json`.

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::Duration;

use anyhow::bail;

use crate::client;
use udm::control::Request;

struct Progress {
    hydrated: u64,
    total: u64,
    rate: Option<f64>,
    eta: Option<f64>,
    complete: bool,
    mode: String,
}

/// Sums the clone targets of the device's status.
fn sample(control: &Path, name: &str) -> anyhow::Result<Progress> {
    let response = client::call(
        control,
        Request::Status {
            name: Some(name.to_string()),
            target: None,
        },
    )?;
    let data = response.data.unwrap_or_default();
    let mut p = Progress {
        hydrated: 0,
        total: 0,
        rate: None,
        eta: None,
        complete: true,
        mode: "write".into(),
    };
    let mut found = false;
    for target in data["targets"].as_array().into_iter().flatten() {
        let d = &target["details"];
        if target["type"] != "clone" || d.is_null() {
            continue;
        }
        found = true;
        p.hydrated += d["hydrated_bytes"].as_u64().unwrap_or(0);
        p.total += d["total_bytes"].as_u64().unwrap_or(0);
        p.complete &= d["complete"].as_bool().unwrap_or(false);
        if let Some(r) = d["copy_rate_bytes_per_second"].as_f64() {
            p.rate = Some(p.rate.unwrap_or(0.0) + r);
        }
        if let Some(e) = d["eta_seconds"].as_f64() {
            p.eta = Some(p.eta.unwrap_or(0.0).max(e));
        }
        if let Some(m) = d["mode"].as_str() {
            if m != "write" {
                p.mode = m.to_string();
            }
        }
    }
    if !found {
        bail!("device '{name}' has no clone target to wait for");
    }
    Ok(p)
}

fn human(bytes: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < units.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", units[unit])
}

fn line(p: &Progress) -> String {
    let fraction = if p.total == 0 {
        1.0
    } else {
        p.hydrated as f64 / p.total as f64
    };
    let width = 30;
    let filled = (fraction * width as f64).round() as usize;
    let rate = p
        .rate
        .map_or("-".to_string(), |r| format!("{}/s", human(r)));
    let eta = p.eta.map_or("-".to_string(), |e| {
        let e = e as u64;
        format!("{}:{:02}:{:02}", e / 3600, e / 60 % 60, e % 60)
    });
    format!(
        "[{}{}] {:5.1}%  {} / {}  {rate}  ETA {eta}",
        "#".repeat(filled),
        ".".repeat(width - filled),
        fraction * 100.0,
        human(p.hydrated as f64),
        human(p.total as f64)
    )
}

pub fn show(control: &Path, name: &str) -> anyhow::Result<()> {
    let terminal = std::io::stdout().is_terminal();
    let mut out = std::io::stdout();
    loop {
        let p = sample(control, name)?;
        if terminal {
            write!(out, "\r{}\x1b[K", line(&p))?;
        } else {
            writeln!(out, "{}", line(&p))?;
        }
        out.flush()?;
        if p.mode != "write" {
            writeln!(out)?;
            bail!(
                "clone metadata is in {} mode; hydration has stopped",
                p.mode
            );
        }
        if p.complete {
            if terminal {
                writeln!(out)?;
            }
            writeln!(out, "hydration complete")?;
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(if terminal { 250 } else { 1000 }));
    }
}
