//! `udm`: a device-mapper in user space. `udm daemon` holds and serves the devices; every
//! other verb is a thin client of the daemon's control socket, with dmsetup's semantics.

mod client;

mod daemon;
mod logger;
mod progress;
mod replay;

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand, ValueEnum};

use udm::control::Request;

const DEFAULT_CONTROL: &str = "/run/udm/control.sock";

#[derive(Parser)]
#[command(name = "udm", version, about = "A device-mapper in user space")]
struct Cli {
    /// The daemon's control socket.
    #[arg(long, global = true, env = "UDM_CONTROL", default_value = DEFAULT_CONTROL)]
    control: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Args)]
struct TableSource {
    /// A table line `START LEN TARGET ARGS…` (repeat for more lines).
    #[arg(long = "table", value_name = "LINE", conflicts_with = "table_file")]
    lines: Vec<String>,
    /// A file with the table, one line per segment (`-` for standard input).
    #[arg(long, value_name = "FILE")]
    table_file: Option<PathBuf>,
}

impl TableSource {
    fn text(&self) -> anyhow::Result<String> {
        let text = match &self.table_file {
            Some(path) if path.as_os_str() == "-" => std::io::read_to_string(std::io::stdin())?,
            Some(path) => std::fs::read_to_string(path)
                .with_context(|| format!("reading table file {}", path.display()))?,
            None if self.lines.is_empty() => bail!("give the table with --table or --table-file"),
            None => self.lines.join("\n"),
        };
        client::absolutize_table(&text)
    }
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon in the foreground (logs to stderr; UDM_LOG=debug for more).
    Daemon {
        /// Where device tables are kept across restarts.
        #[arg(long)]
        state_dir: PathBuf,
        /// NBD listener: unix:PATH, tcp:PORT (binds 127.0.0.1), tcp:HOST:PORT, then options:
        /// `,export=NAME` (repeatable: only these devices are listed and served there) and
        /// `,read-only`. Repeatable.
        #[arg(long, value_name = "LISTENER")]
        nbd: Vec<daemon::Listener>,
        /// TLS on the TCP listeners: off; on (offered, plaintext clients served too); require
        /// (a client gets nothing before STARTTLS).
        #[arg(long, value_enum, default_value_t = TlsArg::Off)]
        tls: TlsArg,
        /// Directory with server-cert.pem, server-key.pem and, for --tls-verify-peer,
        /// ca-cert.pem (the layout qemu and nbdkit use).
        #[arg(long, value_name = "DIR")]
        tls_certificates: Option<PathBuf>,
        /// Serve only clients whose certificate is signed by the CA in ca-cert.pem.
        #[arg(long)]
        tls_verify_peer: bool,
        /// Expose every device as a file under this FUSE mount point.
        #[arg(long, value_name = "MOUNTPOINT")]
        fuse: Option<PathBuf>,
        /// What serves NBD connections: io_uring event loops (uring), a thread per request in
        /// progress (threads), or io_uring when it works here and threads otherwise (auto).
        /// The log says which serves.
        #[arg(long, value_enum, default_value_t = NbdEngineArg::Auto)]
        nbd_engine: NbdEngineArg,
        /// Event-loop threads serving every NBD connection (io_uring engine; default: one per
        /// CPU).
        #[arg(long, value_name = "N")]
        nbd_loops: Option<usize>,
        /// Threads running the NBD requests a device cannot remap onto its files (io_uring
        /// engine): delays, partial clone writes, remote sources, discards.
        #[arg(long, default_value_t = 16, value_name = "N")]
        nbd_pool_threads: usize,
        /// Requests one NBD connection may have read and not yet answered (io_uring engine).
        #[arg(long, default_value_t = 128, value_name = "N")]
        nbd_queue_depth: usize,
        /// Threads per NBD connection, each with one request in progress (threads engine).
        #[arg(long, default_value_t = 32, value_name = "N")]
        nbd_threads: usize,
        /// Memory all NBD connections together may hold in request buffers (K, M, G suffixes);
        /// requests wait for room. One larger than the budget waits until it can be served
        /// alone.
        #[arg(long, default_value = "256M", value_parser = parse_size, value_name = "SIZE")]
        nbd_buffer_budget: usize,
        /// NBD connections one client may have open (a Unix socket peer's uid, a TCP peer's
        /// address); more are refused with an error in the handshake.
        #[arg(long, default_value_t = 64, value_name = "N",
              value_parser = clap::value_parser!(u32).range(1..))]
        nbd_max_connections_per_client: u32,
        /// Close an NBD connection with no request in flight after this long without a
        /// request (300, 300s, 5m, 500ms; 0 never).
        #[arg(long, default_value = "300s", value_parser = parse_duration, value_name = "TIME")]
        nbd_idle_timeout: std::time::Duration,
        /// Threads serving FUSE requests synchronously: every request over /dev/fuse; over
        /// io_uring, those the io_uring engine cannot take (devices that cannot say where
        /// their data lives, partial sectors, fallocate).
        #[arg(long, default_value_t = 16)]
        fuse_threads: usize,
        /// How FUSE requests reach the daemon: auto (io_uring where the kernel offers it,
        /// turning the fuse module's enable_uring on when root; else /dev/fuse, saying why
        /// in the log), on (io_uring or refuse to start), off (/dev/fuse).
        #[arg(long, value_enum, default_value_t = FuseUringArg::Auto)]
        fuse_uring: FuseUringArg,
        /// Seconds a request to a remote (nbd://) backend waits for an unreachable server
        /// before failing with EIO; meanwhile the client reconnects with backoff.
        #[arg(long, default_value_t = 30)]
        remote_timeout: u64,
    },
    /// Create a device from a table and make it live.
    Create {
        name: String,
        #[command(flatten)]
        table: TableSource,
        /// Refuse writes to the device.
        #[arg(long)]
        readonly: bool,
    },
    /// Load a table into the inactive slot (made live by `resume`).
    Load {
        name: String,
        #[command(flatten)]
        table: TableSource,
        /// Load a smaller table even though devices built on this one reach past its end
        /// (their I/O there then fails with EIO).
        #[arg(long)]
        force: bool,
    },
    /// Drop the inactive table (dmsetup clear).
    Clear { name: String },
    /// Hold new I/O and wait for I/O in flight.
    Suspend { name: String },
    /// Make the inactive table live (if loaded) and let I/O flow.
    Resume { name: String },
    /// Send a message to the target at SECTOR.
    Message {
        name: String,
        sector: u64,
        #[arg(required = true, num_args = 1.., allow_hyphen_values = true)]
        words: Vec<String>,
    },
    /// Print the status line of each target.
    Status {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Print the live table.
    Table { name: String },
    /// Print the state, tables present, open count and event number.
    Info {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// List devices.
    Ls {
        /// Show what each device is built on.
        #[arg(long)]
        tree: bool,
    },
    /// Wait until the device's event number passes EVENT_NR (default: the current one).
    Wait {
        name: String,
        event_nr: Option<u64>,
        /// Instead, show the progress (rate, ETA) of the background jobs (clone hydration,
        /// snapshot merge) until they are done.
        #[arg(long, conflicts_with = "event_nr")]
        progress: bool,
    },
    /// Attach the device's FUSE file to a loop device (direct I/O) and print its path.
    Attach { name: String },
    /// Detach a loop device made by `attach` (one whose file is in a udm FUSE mount; any
    /// other loop device is refused).
    Detach { loop_device: PathBuf },
    /// Swap finished targets for their end state, live (a hydrated clone becomes
    /// `linear <destination> 0`).
    Finalize { name: String },
    /// Remove a device.
    Remove {
        name: String,
        /// Remove even while clients have it open (their I/O then fails).
        #[arg(long)]
        force: bool,
    },
    /// List the target types.
    Targets,
    /// Replay a log-writes log onto a device, checking it at flush points (no daemon needed).
    ReplayLog(replay::ReplayOptions),
}

fn main() -> ExitCode {
    logger::init();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("udm: {}", format!("{e:#}").replace('\n', "; "));
            ExitCode::FAILURE
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum NbdEngineArg {
    Auto,
    Uring,
    Threads,
}

impl From<NbdEngineArg> for udm_nbd::Engine {
    fn from(arg: NbdEngineArg) -> Self {
        match arg {
            NbdEngineArg::Auto => udm_nbd::Engine::Auto,
            NbdEngineArg::Uring => udm_nbd::Engine::Uring,
            NbdEngineArg::Threads => udm_nbd::Engine::Threads,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum TlsArg {
    Off,
    On,
    Require,
}

#[derive(Clone, Copy, ValueEnum)]
enum FuseUringArg {
    Auto,
    On,
    Off,
}

impl From<FuseUringArg> for udm_fuse::UringMode {
    fn from(arg: FuseUringArg) -> Self {
        match arg {
            FuseUringArg::Auto => udm_fuse::UringMode::Auto,
            FuseUringArg::On => udm_fuse::UringMode::On,
            FuseUringArg::Off => udm_fuse::UringMode::Off,
        }
    }
}

fn tls_server(
    tls: TlsArg,
    certificates: Option<PathBuf>,
    verify_peer: bool,
) -> anyhow::Result<Option<udm_nbd::TlsServer>> {
    let mode = match tls {
        TlsArg::Off if certificates.is_some() || verify_peer => {
            bail!("--tls-certificates and --tls-verify-peer need --tls on or --tls require")
        }
        TlsArg::Off => return Ok(None),
        TlsArg::On => udm_nbd::TlsMode::On,
        TlsArg::Require => udm_nbd::TlsMode::Require,
    };
    let Some(dir) = certificates else {
        bail!("--tls on/require needs --tls-certificates DIR (server-cert.pem, server-key.pem)")
    };
    let server = udm_nbd::TlsServer::from_dir(&dir, mode, verify_peer)
        .with_context(|| format!("--tls-certificates {}", dir.display()))?;
    Ok(Some(server))
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let (request, json) = match cli.command {
        Command::Daemon {
            state_dir,
            nbd,
            tls,
            tls_certificates,
            tls_verify_peer,
            fuse,
            nbd_engine,
            nbd_loops,
            nbd_pool_threads,
            nbd_queue_depth,
            nbd_threads,
            nbd_buffer_budget,
            nbd_max_connections_per_client,
            nbd_idle_timeout,
            fuse_threads,
            fuse_uring,
            remote_timeout,
        } => {
            let defaults = udm_nbd::ServerConfig::default();
            let nbd_config = udm_nbd::ServerConfig {
                engine: nbd_engine.into(),
                loop_threads: nbd_loops.unwrap_or(defaults.loop_threads),
                pool_threads: nbd_pool_threads,
                queue_depth: nbd_queue_depth,
                workers_per_connection: nbd_threads,
                max_connections_per_client: nbd_max_connections_per_client as usize,
                idle_timeout: (!nbd_idle_timeout.is_zero()).then_some(nbd_idle_timeout),
                buffer_budget: nbd_buffer_budget,
                ..defaults
            };
            return daemon::run(daemon::DaemonOptions {
                state_dir,
                control: cli.control,
                nbd,
                tls: tls_server(tls, tls_certificates, tls_verify_peer)?,
                fuse,
                nbd_config,
                fuse_threads,
                fuse_uring: fuse_uring.into(),
                remote_timeout: std::time::Duration::from_secs(remote_timeout),
            });
        }
        Command::Create {
            name,
            table,
            readonly,
        } => (
            Request::Create {
                name,
                table: table.text()?,
                read_only: readonly,
            },
            false,
        ),
        Command::Load { name, table, force } => (
            Request::Load {
                name,
                table: table.text()?,
                force,
            },
            false,
        ),
        Command::Clear { name } => (Request::Clear { name }, false),
        Command::Suspend { name } => (Request::Suspend { name }, false),
        Command::Resume { name } => (Request::Resume { name }, false),
        Command::Message {
            name,
            sector,
            words,
        } => (
            Request::Message {
                name,
                sector,
                words,
            },
            false,
        ),
        Command::Status { name, json } => (Request::Status { name }, json),
        Command::Table { name } => (Request::Table { name }, false),
        Command::Info { name, json } => (Request::Info { name }, json),
        Command::Ls { tree } => (Request::Ls { tree }, false),
        Command::Wait {
            name,
            progress: true,
            ..
        } => return progress::show(&cli.control, &name),
        Command::Wait { name, event_nr, .. } => (Request::Wait { name, event_nr }, false),
        Command::Attach { name } => return attach(&cli.control, &name),
        Command::Detach { loop_device } => return detach(&loop_device),
        Command::Finalize { name } => (Request::Finalize { name }, false),
        Command::Remove { name, force } => (Request::Remove { name, force }, false),
        Command::Targets => (Request::Targets, false),
        Command::ReplayLog(options) => return replay::run(options),
    };
    let response = client::call(&cli.control, request)?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&response.data.unwrap_or_default())?
        );
    } else if !response.output.is_empty() {
        println!("{}", response.output);
    }
    Ok(())
}

/// `256M`, `1G`, `4096`: bytes, or binary K, M, G.
fn parse_size(s: &str) -> Result<usize, String> {
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
fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
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

/// `losetup --direct-io=on -f --show` on the device's file in the daemon's FUSE mount.
fn attach(control: &Path, name: &str) -> anyhow::Result<()> {
    let response = client::call(
        control,
        Request::Info {
            name: name.to_string(),
        },
    )?;
    let data = response.data.unwrap_or_default();
    let Some(file) = data["fuse_file"].as_str() else {
        bail!("the daemon has no FUSE mount: start it with --fuse MOUNTPOINT");
    };
    let mut args = vec!["--direct-io=on", "-f", "--show"];
    if data["read_only"].as_bool() == Some(true) {
        args.push("--read-only");
    }
    args.push(file);
    let out = std::process::Command::new("losetup")
        .args(&args)
        .output()
        .context("running losetup")?;
    if !out.status.success() {
        bail!(
            "losetup {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    print!("{}", String::from_utf8_lossy(&out.stdout));
    Ok(())
}

/// `losetup -d`, but only for a loop device of udm's: one whose backing file is in a udm FUSE
/// mount. Any other loop device is someone else's disk, and detaching it would pull it from
/// under them.
fn detach(loop_device: &Path) -> anyhow::Result<()> {
    let backing = loop_backing_file(loop_device)?;
    let in_udm_mount = match backing.parent() {
        Some(dir) => udm_fuse::is_udm_mount(dir)?,
        None => false,
    };
    if !in_udm_mount {
        bail!(
            "{} is not udm's: its backing file {} is not in a udm FUSE mount (use losetup -d)",
            loop_device.display(),
            backing.display()
        );
    }
    let out = std::process::Command::new("losetup")
        .arg("-d")
        .arg(loop_device)
        .output()
        .context("running losetup")?;
    if !out.status.success() {
        bail!(
            "losetup -d {}: {}",
            loop_device.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The file a loop device is bound to, as the kernel shows it in sysfs.
fn loop_backing_file(loop_device: &Path) -> anyhow::Result<PathBuf> {
    let meta = std::fs::metadata(loop_device).with_context(|| loop_device.display().to_string())?;
    let rdev = meta.rdev();
    let sysfs = PathBuf::from(format!(
        "/sys/dev/block/{}:{}/loop",
        libc::major(rdev),
        libc::minor(rdev)
    ));
    if !meta.file_type().is_block_device() || !sysfs.is_dir() {
        bail!("{} is not a loop device", loop_device.display());
    }
    let text = match std::fs::read_to_string(sysfs.join("backing_file")) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            bail!("{} is not attached to a file", loop_device.display())
        }
        Err(e) => return Err(e).context(format!("{}/backing_file", sysfs.display())),
    };
    // A file removed since (a udm device removed while attached) shows as "PATH (deleted)".
    let text = text.trim_end_matches('\n');
    Ok(PathBuf::from(
        text.strip_suffix(" (deleted)").unwrap_or(text),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_times_parse_or_say_what_is_wrong() {
        assert_eq!(parse_size("256M"), Ok(256 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        for bad in ["", "0", "M", "12X", "-1", "99999999999999999999G"] {
            assert!(
                parse_size(bad).unwrap_err().contains(&format!("'{bad}'")),
                "{bad}"
            );
        }
        assert_eq!(
            parse_duration("300"),
            Ok(std::time::Duration::from_secs(300))
        );
        assert_eq!(
            parse_duration("5m"),
            Ok(std::time::Duration::from_secs(300))
        );
        assert_eq!(
            parse_duration("500ms"),
            Ok(std::time::Duration::from_millis(500))
        );
        assert_eq!(parse_duration("0"), Ok(std::time::Duration::ZERO));
        for bad in ["", "s", "5h", "1.5s"] {
            assert!(
                parse_duration(bad)
                    .unwrap_err()
                    .contains(&format!("'{bad}'")),
                "{bad}"
            );
        }
    }
}
