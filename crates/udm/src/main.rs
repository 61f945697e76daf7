//! `udm`: a device-mapper in user space. `udm daemon` holds and serves the devices; every
//! other verb is a thin client of the daemon's control socket, with dmsetup's semantics.

mod client;

mod daemon;
mod logger;
mod progress;
mod replay;

use std::path::PathBuf;
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
        /// Requests each NBD connection may have in progress at once.
        #[arg(long, default_value_t = 32)]
        nbd_threads: usize,
        /// Requests the FUSE export serves at once (worker threads).
        #[arg(long, default_value_t = 16)]
        fuse_threads: usize,
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
    },
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
        /// Instead, show hydration progress (rate, ETA) until every clone target is done.
        #[arg(long, conflicts_with = "event_nr")]
        progress: bool,
    },
    /// Attach the device's FUSE file to a loop device (direct I/O) and print its path.
    Attach { name: String },
    /// Detach a loop device made by `attach`.
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
enum TlsArg {
    Off,
    On,
    Require,
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
            nbd_threads,
            fuse_threads,
            remote_timeout,
        } => {
            return daemon::run(daemon::DaemonOptions {
                state_dir,
                control: cli.control,
                nbd,
                tls: tls_server(tls, tls_certificates, tls_verify_peer)?,
                fuse,
                nbd_threads,
                fuse_threads,
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
        Command::Load { name, table } => (
            Request::Load {
                name,
                table: table.text()?,
            },
            false,
        ),
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

/// `losetup --direct-io=on -f --show` on the device's file in the daemon's FUSE mount.
fn attach(control: &std::path::Path, name: &str) -> anyhow::Result<()> {
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

fn detach(loop_device: &std::path::Path) -> anyhow::Result<()> {
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
