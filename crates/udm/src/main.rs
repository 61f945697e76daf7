//! `udm`: a device-mapper in user space. `udm daemon` holds and serves the devices; every
//! other verb is a thin client of the daemon's control socket, with dmsetup's semantics.

mod background;
mod cli;
mod client;
mod columns;
mod logger;
mod loop_device;
mod progress;
mod replay;
mod replicate;
mod thin_ls;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::Parser;
use serde_json::Value;

use cli::{Cli, Command, DaemonArgs, ThinCommand, TlsArg};
use udm::control::Request;
use udm::daemon;

fn main() -> ExitCode {
    logger::init();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // --help and --version are not errors.
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("udm: {}", cli::one_line(&e));
            return ExitCode::FAILURE;
        }
    };
    if let Command::Daemon(args) = &cli.command {
        if args.fork {
            return background::fork().unwrap_or_else(|e| {
                eprintln!("udm: {}", error_line(&e));
                ExitCode::FAILURE
            });
        }
    }
    match run(cli.command, cli.control.as_deref()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("udm: {}", error_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, each cause once: an error whose message already
/// ends with its cause's text (as many wrap an OS error) does not repeat it.
fn error_line(error: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in error.chain() {
        let text = cause.to_string().replace('\n', "; ");
        if line.ends_with(&text) {
            continue;
        }
        if !line.is_empty() {
            line += ": ";
        }
        line += &text;
    }
    line
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

fn daemon(args: DaemonArgs, control: PathBuf) -> anyhow::Result<()> {
    udm_targets::set_no_space_timeout(args.no_space_timeout);
    let defaults = udm_nbd::ServerConfig::default();
    let nbd_config = udm_nbd::ServerConfig {
        engine: args.nbd_engine.into(),
        loop_threads: args.nbd_loops.unwrap_or(defaults.loop_threads),
        pool_threads: args.nbd_pool_threads,
        queue_depth: args.nbd_queue_depth,
        workers_per_connection: args.nbd_threads,
        max_connections_per_client: args.nbd_max_connections_per_client as usize,
        idle_timeout: (!args.nbd_idle_timeout.is_zero()).then_some(args.nbd_idle_timeout),
        buffer_budget: args.nbd_buffer_budget,
        ..defaults
    };
    Ok(daemon::run(daemon::DaemonOptions {
        state_dir: args.state_dir,
        control,
        nbd: args.nbd,
        metrics: args.metrics,
        tls: tls_server(args.tls, args.tls_certificates, args.tls_verify_peer)?,
        fuse: args.fuse,
        nbd_config,
        fuse_threads: args.fuse_threads,
        fuse_uring: args.fuse_uring.into(),
        fuse_queue_threads: args.fuse_queue_threads,
        remote_timeout: std::time::Duration::from_secs(args.remote_timeout),
        replication: args.replication,
    })?)
}

/// How a verb's answer is printed.
enum Print {
    /// The daemon's text.
    Text,
    /// The daemon's data as JSON.
    Json,
    /// `info -c`: columns drawn from the data.
    Columns(cli::ColumnsArgs),
}

/// One arm per verb: most become a control request, a few run here (long for that reason).
/// `before_verb`: a `--control` given before the verb.
fn run(command: Command, before_verb: Option<&std::path::Path>) -> anyhow::Result<()> {
    let (control, request, print) = match command {
        Command::Daemon(args) => {
            let control = args.control(before_verb);
            return daemon(*args, control);
        }
        Command::Detach { loop_device } => return loop_device::detach(&loop_device),
        Command::ReplayLog(options) => return replay::run(options),
        Command::Attach { name, control } => {
            return loop_device::attach(&control.socket(before_verb), &name)
        }
        Command::Wait {
            name,
            progress: true,
            control,
            ..
        } => return progress::show(&control.socket(before_verb), &name),
        Command::Version { control } => return version(&control.socket(before_verb)),
        Command::Stop { control } => return background::stop(&control.socket(before_verb)),
        Command::Thin {
            command:
                ThinCommand::Ls {
                    pool,
                    json,
                    control,
                },
        } => return thin_ls::show(&control.socket(before_verb), &pool, json),
        Command::Thin {
            command:
                ThinCommand::Delta {
                    pool,
                    from,
                    to,
                    json,
                    control,
                },
        } => (
            control,
            Request::ThinDelta {
                pool,
                from: Some(from),
                to,
            },
            if json { Print::Json } else { Print::Text },
        ),
        Command::Send(args) => {
            let control = args.control.socket(before_verb);
            return replicate::send(&control, *args);
        }
        Command::Receive {
            pool,
            id,
            base,
            resume,
            json,
            progress,
            control,
        } => {
            let options = replicate::ReceiveOptions {
                base,
                resume,
                json,
                progress,
            };
            return replicate::receive(&control.socket(before_verb), &pool, id, options);
        }
        Command::Create {
            name,
            table,
            readonly,
            uuid,
            control,
        } => (
            control,
            Request::Create {
                name,
                table: table.text()?,
                read_only: readonly,
                uuid,
            },
            Print::Text,
        ),
        Command::Load {
            name,
            table,
            readonly,
            force,
            control,
        } => (
            control,
            Request::Load {
                name,
                table: table.text()?,
                force,
                read_only: readonly,
            },
            Print::Text,
        ),
        Command::Clear { name, control } => (control, Request::Clear { name }, Print::Text),
        Command::Suspend {
            name,
            noflush,
            control,
        } => (control, Request::Suspend { name, noflush }, Print::Text),
        Command::Resume { name, control } => (control, Request::Resume { name }, Print::Text),
        Command::Message {
            name,
            sector,
            words,
            control,
        } => (
            control,
            Request::Message {
                name,
                sector,
                words,
            },
            Print::Text,
        ),
        Command::Status {
            name,
            target,
            json,
            control,
        } => (
            control,
            Request::Status { name, target },
            json_or_text(json),
        ),
        Command::Table {
            name,
            target,
            inactive,
            control,
        } => (
            control,
            Request::Table {
                name,
                target,
                inactive,
            },
            Print::Text,
        ),
        Command::Info {
            name,
            columns,
            json,
            control,
        } => {
            let print = match (json, columns.wanted()) {
                (true, _) => Print::Json,
                (false, true) => Print::Columns(columns),
                (false, false) => Print::Text,
            };
            (control, Request::Info { name }, print)
        }
        Command::Deps {
            name,
            json,
            control,
        } => (control, Request::Deps { name }, json_or_text(json)),
        Command::Ls {
            tree,
            json,
            control,
        } => (control, Request::Ls { tree }, json_or_text(json)),
        Command::Wait {
            name,
            event_nr,
            control,
            ..
        } => (control, Request::Wait { name, event_nr }, Print::Text),
        Command::Rename {
            name,
            new,
            setuuid,
            control,
        } => {
            let (new_name, uuid) = match setuuid {
                true => (None, Some(new)),
                false => (Some(new), None),
            };
            (
                control,
                Request::Rename {
                    name,
                    new_name,
                    uuid,
                },
                Print::Text,
            )
        }
        Command::Remove {
            name,
            force,
            retry,
            deferred,
            control,
        } => (
            control,
            Request::Remove {
                name,
                force,
                retry,
                deferred,
            },
            Print::Text,
        ),
        Command::RemoveAll { force, control } => {
            (control, Request::RemoveAll { force }, Print::Text)
        }
        Command::Finalize { name, control } => (control, Request::Finalize { name }, Print::Text),
        Command::Targets { control } => (control, Request::Targets, Print::Text),
    };
    let response = client::call(&control.socket(before_verb), request)?;
    let data = response.data.unwrap_or_default();
    match print {
        Print::Json => println!("{}", serde_json::to_string_pretty(&data)?),
        Print::Columns(columns) => {
            let devices = match data {
                Value::Array(devices) => devices,
                device => vec![device],
            };
            let report = columns.layout().render(&devices)?;
            if !report.is_empty() {
                println!("{report}");
            }
        }
        Print::Text if !response.output.is_empty() => println!("{}", response.output),
        Print::Text => {}
    }
    Ok(())
}

fn json_or_text(json: bool) -> Print {
    if json {
        Print::Json
    } else {
        Print::Text
    }
}

/// dmsetup's `version`: this client's, then the daemon's.
fn version(control: &std::path::Path) -> anyhow::Result<()> {
    println!(
        "Library version:   udm {} (control protocol {})",
        env!("CARGO_PKG_VERSION"),
        udm::control::PROTOCOL_VERSION
    );
    let response = client::call(control, Request::Version)?;
    println!("Driver version:    {}", response.output);
    Ok(())
}
