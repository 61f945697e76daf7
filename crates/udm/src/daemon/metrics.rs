//! `udm daemon --metrics tcp:…`: Prometheus's text format at `/metrics` over plain HTTP, one
//! connection at a time. Per device (`device` label): requests, bytes, errors and latency per
//! operation, requests in flight, opens, size, state; per clone device, hydration progress.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use log::{info, warn};
use udm_block::BlockDevice;

use super::registry::Registry;
use super::stats::{Op, LATENCY_BUCKETS};

/// How long a scraper may take to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// A request line and headers longer than this are refused.
const MAX_REQUEST: usize = 8192;

/// Where `/metrics` is served: `tcp:PORT` (127.0.0.1) or `tcp:HOST:PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsAddress(pub String);

impl std::str::FromStr for MetricsAddress {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("'{s}': expected tcp:PORT or tcp:HOST:PORT");
        let addr = s.strip_prefix("tcp:").ok_or_else(bad)?;
        if addr.parse::<u16>().is_ok() {
            return Ok(MetricsAddress(format!("127.0.0.1:{addr}")));
        }
        match addr.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                Ok(MetricsAddress(addr.to_string()))
            }
            _ => Err(bad()),
        }
    }
}

/// Starts serving; returns the bound address (useful with port 0).
pub fn serve(address: &MetricsAddress, registry: Arc<Registry>) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(address.0.as_str())?;
    let local = listener.local_addr()?;
    info!("metrics: http://{local}/metrics");
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for stream in listener.incoming() {
                match stream {
                    Ok(stream) => answer(stream, &registry),
                    Err(e) => warn!("metrics: accept failed: {e}"),
                }
            }
        })?;
    Ok(local)
}

fn answer(mut stream: TcpStream, registry: &Registry) {
    let _ = stream.set_read_timeout(Some(REQUEST_TIMEOUT));
    let _ = stream.set_write_timeout(Some(REQUEST_TIMEOUT));
    let Some(request_line) = read_request(&mut stream) else {
        return;
    };
    let mut words = request_line.split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let (status, body) = match (method, path) {
        ("GET", "/metrics") => ("200 OK", render(registry)),
        ("GET", _) => ("404 Not Found", "udm serves /metrics only\n".to_string()),
        _ => ("405 Method Not Allowed", "GET /metrics\n".to_string()),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream
        .write_all(head.as_bytes())
        .and_then(|()| stream.write_all(body.as_bytes()));
}

/// The request line, once the whole head has arrived (what follows it is not needed).
fn read_request(stream: &mut TcpStream) -> Option<String> {
    let mut head = Vec::new();
    let mut chunk = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut chunk).ok().filter(|&n| n > 0)?;
        head.extend_from_slice(&chunk[..n]);
        if head.len() > MAX_REQUEST {
            return None;
        }
    }
    let text = String::from_utf8_lossy(&head);
    Some(text.lines().next().unwrap_or("").to_string())
}

/// Prometheus's exposition: each family's HELP and TYPE once, then its samples.
struct Exposition {
    text: String,
}

impl Exposition {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.text, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        let labels: Vec<String> = labels
            .iter()
            .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
            .collect();
        let _ = writeln!(self.text, "{name}{{{}}} {value}", labels.join(","));
    }
}

/// Label values escape backslash, quote and newline.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The counters of one operation: (family, help, what of the operation it counts).
const COUNTERS: &[(&str, &str, Op, bool)] = &[
    (
        "udm_reads_total",
        "Read requests completed.",
        Op::Read,
        false,
    ),
    (
        "udm_read_bytes_total",
        "Bytes read successfully.",
        Op::Read,
        true,
    ),
    (
        "udm_writes_total",
        "Write requests completed.",
        Op::Write,
        false,
    ),
    (
        "udm_written_bytes_total",
        "Bytes written successfully.",
        Op::Write,
        true,
    ),
    (
        "udm_flushes_total",
        "Flush requests completed.",
        Op::Flush,
        false,
    ),
    (
        "udm_discards_total",
        "Discard requests completed.",
        Op::Discard,
        false,
    ),
    (
        "udm_discarded_bytes_total",
        "Bytes discarded successfully.",
        Op::Discard,
        true,
    ),
    (
        "udm_write_zeroes_total",
        "Write-zeroes requests completed.",
        Op::WriteZeroes,
        false,
    ),
    (
        "udm_zeroed_bytes_total",
        "Bytes zeroed successfully.",
        Op::WriteZeroes,
        true,
    ),
];

/// A gauge family: name, help, and its value for one device (or one clone).
type Gauge<T> = (&'static str, &'static str, fn(&T) -> f64);

/// Every device's metrics, now.
pub fn render(registry: &Registry) -> String {
    let devices = registry.all();
    let mut out = Exposition {
        text: String::new(),
    };
    out.family("udm_devices", "gauge", "Devices the daemon holds.");
    let _ = writeln!(out.text, "udm_devices {}", devices.len());
    let names: Vec<String> = devices.iter().map(|d| d.name()).collect();
    for &(family, help, op, bytes) in COUNTERS {
        out.family(family, "counter", help);
        for (device, name) in devices.iter().zip(&names) {
            let s = device.stats().snapshot(op);
            let value = if bytes { s.bytes } else { s.completed };
            out.sample(family, &[("device", name)], value);
        }
    }
    out.family(
        "udm_errors_total",
        "counter",
        "Requests that completed with an error, by operation.",
    );
    for (device, name) in devices.iter().zip(&names) {
        for op in Op::ALL {
            let errors = device.stats().snapshot(op).errors;
            out.sample(
                "udm_errors_total",
                &[("device", name), ("op", op.label())],
                errors,
            );
        }
    }
    latency_histograms(&mut out, &devices, &names);
    out.family(
        "udm_open_count",
        "gauge",
        "Clients and devices built on it that have the device open.",
    );
    for (device, name) in devices.iter().zip(&names) {
        let opens = device.open_count() + registry.holders(name).len();
        out.sample("udm_open_count", &[("device", name)], opens);
    }
    let gauges: &[Gauge<super::Device>] = &[
        (
            "udm_in_flight",
            "Requests in progress on the device.",
            |d| d.stats().in_flight() as f64,
        ),
        ("udm_size_bytes", "The device's size.", |d| d.size() as f64),
        ("udm_suspended", "1 while the device is suspended.", |d| {
            f64::from(u8::from(d.is_suspended()))
        }),
        ("udm_read_only", "1 if the device is read-only.", |d| {
            f64::from(u8::from(d.read_only()))
        }),
        ("udm_event_number", "The device's event counter.", |d| {
            d.events().current() as f64
        }),
    ];
    for (family, help, value) in gauges {
        out.family(family, "gauge", help);
        for (device, name) in devices.iter().zip(&names) {
            out.sample(family, &[("device", name)], value(device));
        }
    }
    clone_metrics(&mut out, &devices, &names);
    out.text
}

/// Each device's request latencies, per operation, as Prometheus histograms.
fn latency_histograms(out: &mut Exposition, devices: &[Arc<super::Device>], names: &[String]) {
    let latency = "udm_request_duration_seconds";
    out.family(
        latency,
        "histogram",
        "Time from a request's arrival at the device to its completion, by operation.",
    );
    for (device, name) in devices.iter().zip(names) {
        for op in Op::ALL {
            let s = device.stats().snapshot(op);
            let labels = [("device", name.as_str()), ("op", op.label())];
            let bounds = LATENCY_BUCKETS
                .iter()
                .map(|b| b.to_string())
                .chain(["+Inf".to_string()]);
            for (bound, count) in bounds.zip(&s.cumulative) {
                let mut with_le = labels.to_vec();
                with_le.push(("le", &bound));
                out.sample(&format!("{latency}_bucket"), &with_le, count);
            }
            out.sample(&format!("{latency}_sum"), &labels, s.latency_seconds);
            out.sample(&format!("{latency}_count"), &labels, s.completed);
        }
    }
}

/// Hydration of the devices with clone targets (summed over a device's clone segments).
fn clone_metrics(out: &mut Exposition, devices: &[Arc<super::Device>], names: &[String]) {
    struct Clone {
        hydrated: u64,
        total: u64,
        rate: f64,
        complete: bool,
    }
    let clones: Vec<(&String, Clone)> = devices
        .iter()
        .zip(names)
        .filter_map(|(device, name)| {
            let table = device.live();
            let details: Vec<_> = table
                .segments()
                .iter()
                .filter(|s| s.target.type_name() == "clone")
                .filter_map(|s| s.target.status_details())
                .collect();
            if details.is_empty() {
                return None;
            }
            let sum = |key: &str| details.iter().filter_map(|d| d[key].as_u64()).sum::<u64>();
            Some((
                name,
                Clone {
                    hydrated: sum("hydrated_bytes"),
                    total: sum("total_bytes"),
                    rate: details
                        .iter()
                        .filter_map(|d| d["copy_rate_bytes_per_second"].as_f64())
                        .sum(),
                    complete: details.iter().all(|d| d["complete"] == true),
                },
            ))
        })
        .collect();
    let families: &[Gauge<Clone>] = &[
        (
            "udm_clone_hydrated_bytes",
            "Bytes of the clone's volume copied to its destination (or written there).",
            |c| c.hydrated as f64,
        ),
        (
            "udm_clone_size_bytes",
            "Bytes the clone's volume holds.",
            |c| c.total as f64,
        ),
        (
            "udm_clone_hydration_rate_bytes_per_second",
            "The background copy's recent rate.",
            |c| c.rate,
        ),
        (
            "udm_clone_hydration_complete",
            "1 once every region is hydrated.",
            |c| f64::from(u8::from(c.complete)),
        ),
    ];
    for (family, help, value) in families {
        out.family(family, "gauge", help);
        for (name, clone) in &clones {
            out.sample(family, &[("device", name)], value(clone));
        }
    }
}

#[cfg(test)]
mod tests {
    use udm_block::AlignedBuf;
    use udm_testkit::TempDir;

    use super::*;

    #[test]
    fn addresses_parse() {
        let a: MetricsAddress = "tcp:9100".parse().unwrap();
        assert_eq!(a.0, "127.0.0.1:9100");
        let a: MetricsAddress = "tcp:0.0.0.0:9100".parse().unwrap();
        assert_eq!(a.0, "0.0.0.0:9100");
        for bad in ["9100", "tcp:", "tcp:host", "unix:/x"] {
            assert!(bad.parse::<MetricsAddress>().is_err(), "{bad}");
        }
    }

    #[test]
    fn the_exposition_counts_what_reached_each_device() {
        let dir = TempDir::new("metrics");
        let registry = Registry::in_scratch(&dir);
        let vol = registry.must_create("vol", "0 2048 zero");
        registry.must_create("top", "0 2048 linear vol 0");
        let mut buf = AlignedBuf::zeroed(4096);
        let top = registry.get("top").unwrap();
        top.read(0, &mut buf).unwrap();
        top.read(4096, &mut buf).unwrap();
        vol.write(0, &buf, Default::default()).unwrap();
        let text = render(&registry);
        let line = |prefix: &str| {
            text.lines()
                .find(|l| l.starts_with(prefix))
                .unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
                .to_string()
        };
        assert_eq!(
            line("udm_reads_total{device=\"top\"}"),
            "udm_reads_total{device=\"top\"} 2"
        );
        // The reads went through `top` onto `vol`: both counted them.
        assert!(line("udm_reads_total{device=\"vol\"}").ends_with(" 2"));
        assert!(line("udm_read_bytes_total{device=\"vol\"}").ends_with(" 8192"));
        assert!(line("udm_writes_total{device=\"vol\"}").ends_with(" 1"));
        assert!(line("udm_written_bytes_total{device=\"vol\"}").ends_with(" 4096"));
        assert!(
            line("udm_open_count{device=\"vol\"}").ends_with(" 1"),
            "top holds vol"
        );
        assert!(line(
            "udm_request_duration_seconds_bucket{device=\"top\",op=\"read\",le=\"+Inf\"}"
        )
        .ends_with(" 2"));
        assert_eq!(text.matches("# TYPE udm_reads_total counter").count(), 1);
        // A read-only device refuses a write: an error, no bytes.
        registry.create("ro", "0 8 zero", true, None).unwrap();
        let ro = registry.get("ro").unwrap();
        ro.write(0, &buf[..512], Default::default()).unwrap_err();
        let text = render(&registry);
        assert!(
            text.contains("udm_errors_total{device=\"ro\",op=\"write\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("udm_written_bytes_total{device=\"ro\"} 0"),
            "{text}"
        );
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
