//! How the command line reads sizes and times, and how it reports what clap refused.

/// A command line clap refused, as one line: what is wrong (and clap's tip), then where to
/// look. Clap's own rendering spans several lines and prints a usage line that shows options
/// from the environment ($UDM_CONTROL) as if they were required.
pub fn one_line(error: &clap::Error) -> String {
    let rendered = error.render().to_string();
    let mut what = Vec::new();
    let mut tips = Vec::new();
    let mut verb = String::from("udm");
    for line in rendered.lines().map(str::trim) {
        if let Some(usage) = line.strip_prefix("Usage: ") {
            // "udm create [OPTIONS] <NAME>" → "udm create"
            verb = usage
                .split_whitespace()
                .take_while(|w| !w.starts_with(['[', '<', '-']))
                .collect::<Vec<_>>()
                .join(" ");
            break;
        }
        if let Some(tip) = line.strip_prefix("tip: ") {
            tips.push(tip.to_string());
        } else if !line.is_empty() {
            what.push(line.strip_prefix("error: ").unwrap_or(line).to_string());
        }
    }
    let mut out = what.join(" ");
    for tip in tips {
        out += &format!(" ({tip})");
    }
    format!("{out}; see `{verb} --help`")
}

/// `256M`, `1G`, `4096`: bytes, or binary K, M, G.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let (digits, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, ""),
    };
    let shift = match unit {
        "" => 0,
        "K" | "k" => 10,
        "M" | "m" => 20,
        "G" | "g" => 30,
        _ => {
            return Err(format!(
                "'{s}': expected a size such as 256M (bytes, K, M or G)"
            ))
        }
    };
    digits
        .parse::<usize>()
        .ok()
        .filter(|&n| n > 0)
        .and_then(|n| n.checked_mul(1 << shift))
        .ok_or_else(|| format!("'{s}': expected a size above zero such as 256M"))
}

/// `300` or `300s` (seconds), `5m`, `500ms`.
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let (digits, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("'{s}': expected a time such as 300s, 5m or 500ms"))?;
    match unit {
        "ms" => Ok(std::time::Duration::from_millis(n)),
        "s" => Ok(std::time::Duration::from_secs(n)),
        "m" => Ok(std::time::Duration::from_secs(n * 60)),
        _ => Err(format!("'{s}': expected a time such as 300s, 5m or 500ms")),
    }
}

/// `deps -o`: dmsetup's `devname` is what udm's `deps` prints; its `devno` and `blkdevname`
/// are a kernel block device's numbers and name, which udm devices do not have.
pub fn parse_deps_option(s: &str) -> Result<String, String> {
    match s {
        "devname" => Ok(s.to_string()),
        "devno" | "blkdevname" => {
            Err("udm devices are not kernel block devices: deps names them (devname)".into())
        }
        _ => Err(format!("unknown '{s}' (deps shows devname)")),
    }
}
