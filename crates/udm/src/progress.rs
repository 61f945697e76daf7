//! `udm wait NAME --progress`: a live progress bar for a device's background copies (a clone's
//! hydration, a snapshot merge), from `status --json`. The line fits the terminal (narrower ones
//! drop the ETA, then the rate, then the sizes, then the bar), and a paused hydration says so
//! instead of showing a rate and an ETA it does not have.

use std::io::{IsTerminal, Write};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::bail;

use crate::client;
use serde_json::Value;

/// Lines written to something that is not a terminal are not cut.
const UNLIMITED: usize = usize::MAX;
/// The bar's width when there is room.
const BAR: usize = 30;
/// Narrower than this, the bar goes before anything else does.
const MIN_BAR: usize = 10;

struct Progress {
    hydrated: u64,
    total: u64,
    rate: Option<f64>,
    eta: Option<f64>,
    complete: bool,
    mode: String,
    /// What holds hydration back, when every clone that has regions left is paused.
    paused_by: Option<String>,
    /// Why a merge stopped short, if one did.
    stopped: Option<String>,
    /// What completes: "hydration", "merge", or both.
    label: String,
}

impl Progress {
    /// Adds one copy job (a merge's `progress` object or a clone's details, whose bytes done
    /// and rate go by the names given): bytes add up, rates add up, the last ETA counts.
    fn add(&mut self, job: &Value, done: &str, rate: &str) {
        self.hydrated += job[done].as_u64().unwrap_or(0);
        self.total += job["total_bytes"].as_u64().unwrap_or(0);
        self.complete &= job["complete"].as_bool().unwrap_or(false);
        if let Some(r) = job[rate].as_f64() {
            self.rate = Some(self.rate.unwrap_or(0.0) + r);
        }
        if let Some(e) = job["eta_seconds"].as_f64() {
            self.eta = Some(self.eta.unwrap_or(0.0).max(e));
        }
    }
}

/// Sums the clone and snapshot-merge targets of the device's status. A merge reports its
/// progress in a `progress` object (label, done and total bytes, rate, ETA, complete, why it
/// stopped).
fn sample(control: &Path, name: &str) -> anyhow::Result<Progress> {
    let data = client::status(control, name)?;
    let mut p = Progress {
        hydrated: 0,
        total: 0,
        rate: None,
        eta: None,
        complete: true,
        mode: "write".into(),
        paused_by: None,
        stopped: None,
        label: String::new(),
    };
    let mut labels: Vec<&str> = Vec::new();
    let mut hydrating = false;
    for target in data["targets"].as_array().into_iter().flatten() {
        let d = &target["details"];
        let job = &d["progress"];
        if job.is_object() {
            labels.push(job["label"].as_str().unwrap_or("copy"));
            p.add(job, "done_bytes", "rate_bytes_per_second");
            if let Some(why) = job["stopped"].as_str() {
                p.stopped = Some(why.to_string());
            }
            hydrating = true;
            continue;
        }
        if target["type"] != "clone" || d.is_null() {
            continue;
        }
        labels.push("hydration");
        p.add(d, "hydrated_bytes", "copy_rate_bytes_per_second");
        if let Some(m) = d["mode"].as_str() {
            if m != "write" {
                p.mode = m.to_string();
            }
        }
        match d["state"].as_str() {
            Some("paused") => {
                p.paused_by = d["paused_by"].as_str().map(str::to_string);
            }
            Some("hydrating") => hydrating = true,
            _ => {}
        }
    }
    if labels.is_empty() {
        bail!("device '{name}' has no clone or snapshot-merge target to wait for");
    }
    labels.dedup();
    p.label = labels.join(" and ");
    if hydrating {
        p.paused_by = None;
    } else if p.paused_by.is_some() {
        (p.rate, p.eta) = (None, None);
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

/// The progress line, at most `width - 1` characters (a line as wide as the terminal wraps
/// on some terminals).
fn line(p: &Progress, width: usize) -> String {
    let room = width.saturating_sub(1);
    let fraction = if p.total == 0 {
        1.0
    } else {
        p.hydrated as f64 / p.total as f64
    };
    let percent = format!("{:5.1}%", fraction * 100.0);
    let sizes = format!("{} / {}", human(p.hydrated as f64), human(p.total as f64));
    // Fields after the bar and percent, the first to go last: a pause matters more than the
    // sizes, the sizes more than the rate, the rate more than the ETA.
    let mut fields: Vec<String> = Vec::new();
    match &p.paused_by {
        Some(why) => fields.extend([format!("paused ({why})"), sizes]),
        None => {
            fields.push(sizes);
            fields.push(p.rate.map_or("-".into(), |r| format!("{}/s", human(r))));
            fields.push(p.eta.map_or("ETA -".into(), |e| {
                let e = e as u64;
                format!("ETA {}:{:02}:{:02}", e / 3600, e / 60 % 60, e % 60)
            }));
        }
    }
    let text = |fields: &[String]| {
        let mut t = percent.clone();
        for f in fields {
            t += "  ";
            t += f;
        }
        t
    };
    // Drop fields from the end until they fit beside a bar of the least width.
    while !fields.is_empty() && text(&fields).chars().count() + MIN_BAR + 3 > room {
        let last = fields.pop().expect("not empty");
        // A pause loses its reason before it loses the word.
        if last.starts_with("paused (") {
            fields.push("paused".into());
            if text(&fields).chars().count() + MIN_BAR + 3 <= room {
                break;
            }
            fields.pop();
        }
    }
    let text = text(&fields);
    let bar_width = room.saturating_sub(text.chars().count() + 3).min(BAR);
    if bar_width < MIN_BAR.min(BAR) {
        return text.chars().take(room).collect();
    }
    let filled = (fraction * bar_width as f64).round() as usize;
    format!(
        "[{}{}] {text}",
        "#".repeat(filled),
        ".".repeat(bar_width - filled)
    )
}

/// The terminal's width in columns, if `fd` is one that says.
fn terminal_width(fd: i32) -> Option<usize> {
    let mut size: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: TIOCGWINSZ fills a winsize we own.
    let ok = unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut size) };
    (ok == 0 && size.ws_col > 0).then_some(size.ws_col as usize)
}

/// A transfer's progress bar on stderr (`udm send`, `udm receive`, whose stdout may be the
/// stream): redrawn at most four times a second on a terminal; one line a second elsewhere
/// when asked for; nothing otherwise.
pub struct Meter {
    done: u64,
    total: u64,
    started: Instant,
    drawn: Option<Instant>,
    terminal: bool,
    shown: bool,
}

impl Meter {
    pub fn new(total: u64, asked: bool) -> Meter {
        let terminal = std::io::stderr().is_terminal();
        Meter {
            done: 0,
            total,
            started: Instant::now(),
            drawn: None,
            terminal,
            shown: terminal || asked,
        }
    }

    pub fn add(&mut self, bytes: u64) {
        self.done += bytes;
        let every = Duration::from_millis(if self.terminal { 250 } else { 1000 });
        if self.shown && self.drawn.is_none_or(|d| d.elapsed() >= every) {
            self.draw();
        }
    }

    /// Bytes per second so far.
    pub fn rate(&self) -> f64 {
        self.done as f64 / self.started.elapsed().as_secs_f64().max(1e-6)
    }

    pub fn seconds(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    fn draw(&mut self) {
        let rate = self.rate();
        let p = Progress {
            hydrated: self.done.min(self.total),
            total: self.total,
            rate: Some(rate),
            eta: (rate > 0.0).then(|| self.total.saturating_sub(self.done) as f64 / rate),
            complete: false,
            mode: "write".into(),
            paused_by: None,
            stopped: None,
            label: String::new(),
        };
        let mut err = std::io::stderr();
        let _ = if self.terminal {
            let width = terminal_width(err.as_raw_fd()).unwrap_or(80);
            write!(err, "\r{}\x1b[K", line(&p, width))
        } else {
            writeln!(err, "{}", line(&p, UNLIMITED))
        };
        self.drawn = Some(Instant::now());
    }

    /// The last line, ended.
    pub fn finish(mut self) {
        if self.shown {
            self.draw();
            if self.terminal {
                let _ = writeln!(std::io::stderr());
            }
        }
    }
}

pub fn show(control: &Path, name: &str) -> anyhow::Result<()> {
    let terminal = std::io::stdout().is_terminal();
    let mut out = std::io::stdout();
    loop {
        let p = sample(control, name)?;
        if terminal {
            // Asked each time: the terminal may have been resized.
            let width = terminal_width(out.as_raw_fd()).unwrap_or(80);
            write!(out, "\r{}\x1b[K", line(&p, width))?;
        } else {
            writeln!(out, "{}", line(&p, UNLIMITED))?;
        }
        out.flush()?;
        if p.mode != "write" {
            writeln!(out)?;
            bail!(
                "clone metadata is in {} mode; hydration has stopped",
                p.mode
            );
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn progress(paused_by: Option<&str>) -> Progress {
        Progress {
            hydrated: 6120 << 20,
            total: 10 << 30,
            rate: paused_by.is_none().then_some(412.3 * 1048576.0),
            eta: paused_by.is_none().then_some(10.0),
            complete: false,
            mode: "write".into(),
            paused_by: paused_by.map(str::to_string),
            stopped: None,
            label: "hydration".into(),
        }
    }

    #[test]
    fn the_line_fits_the_terminal_dropping_the_least_needed_first() {
        let p = progress(None);
        assert_eq!(
            line(&p, UNLIMITED),
            "[##################............]  59.8%  6.0 GiB / 10.0 GiB  412.3 MiB/s  ETA 0:00:10"
        );
        for width in [120, 80, 60, 50, 40, 30, 20, 12, 8] {
            let l = line(&p, width);
            assert!(l.chars().count() < width, "{width}: {l:?}");
            assert!(l.contains("59.8%"), "{width}: {l:?}");
        }
        assert!(line(&p, 80).contains("ETA 0:00:10"));
        let at_60 = line(&p, 60);
        assert!(!at_60.contains("ETA") && at_60.contains("MiB/s"), "{at_60}");
        let at_40 = line(&p, 40);
        assert!(
            at_40.ends_with("10.0 GiB") && at_40.starts_with('['),
            "{at_40}"
        );
        let at_36 = line(&p, 36);
        assert!(!at_36.contains("GiB") && at_36.starts_with('['), "{at_36}");
        assert!(!line(&p, 12).contains('['), "{}", line(&p, 12));
    }

    #[test]
    fn a_paused_hydration_shows_paused_and_no_rate_or_eta() {
        let p = progress(Some("disable_hydration"));
        let l = line(&p, 80);
        assert!(l.contains("  paused (disable_hydration)  6.0 GiB"), "{l}");
        assert!(!l.contains("ETA") && !l.contains("/s"), "{l}");
        let narrow = line(&p, 50);
        assert!(narrow.ends_with("  paused (disable_hydration)"), "{narrow}");
        let narrower = line(&p, 30);
        assert!(narrower.ends_with("  paused"), "{narrower}");
    }
}
