//! `udm wait NAME --progress`: a live progress bar for a device's background jobs (a clone's
//! hydration, a snapshot merge), from the `progress` object of `status --json`.

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::Duration;

use anyhow::bail;

use crate::client;
use udm::control::Request;

struct Progress {
    /// What the jobs are ("hydration", "merge").
    label: String,
    done: u64,
    total: u64,
    rate: Option<f64>,
    eta: Option<f64>,
    complete: bool,
    /// Why a job stopped short, if one did.
    stopped: Option<String>,
}

/// Sums the progress of the device's targets that report one.
fn sample(control: &Path, name: &str) -> anyhow::Result<Progress> {
    let response = client::call(
        control,
        Request::Status {
            name: name.to_string(),
        },
    )?;
    let data = response.data.unwrap_or_default();
    let mut p = Progress {
        label: String::new(),
        done: 0,
        total: 0,
        rate: None,
        eta: None,
        complete: true,
        stopped: None,
    };
    let mut labels: Vec<String> = Vec::new();
    for target in data["targets"].as_array().into_iter().flatten() {
        let job = &target["details"]["progress"];
        if job.is_null() {
            continue;
        }
        let label = job["label"].as_str().unwrap_or("job").to_string();
        if !labels.contains(&label) {
            labels.push(label);
        }
        p.done += job["done_bytes"].as_u64().unwrap_or(0);
        p.total += job["total_bytes"].as_u64().unwrap_or(0);
        p.complete &= job["complete"].as_bool().unwrap_or(false);
        if let Some(r) = job["rate_bytes_per_second"].as_f64() {
            p.rate = Some(p.rate.unwrap_or(0.0) + r);
        }
        if let Some(e) = job["eta_seconds"].as_f64() {
            p.eta = Some(p.eta.unwrap_or(0.0).max(e));
        }
        if let Some(why) = job["stopped"].as_str() {
            p.stopped = Some(why.to_string());
        }
    }
    if labels.is_empty() {
        bail!("device '{name}' has no background job to wait for (a clone or a snapshot merge)");
    }
    p.label = labels.join(" and ");
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
        p.done as f64 / p.total as f64
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
        human(p.done as f64),
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
        if let Some(why) = &p.stopped {
            writeln!(out)?;
            bail!("{why}");
        }
        if p.complete {
            if terminal {
                writeln!(out)?;
            }
            writeln!(out, "{} complete", p.label)?;
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(if terminal { 250 } else { 1000 }));
    }
}
