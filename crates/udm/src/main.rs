//! `udm`: a device-mapper in user space. `udm daemon` holds and serves the devices; every
//! other verb is a thin client of the daemon's control socket, with dmsetup's semantics.

/// `print!` for the verbs' output. A reader that went away (`udm info vol | head -1`) ends
/// udm as SIGPIPE ends dmsetup, where `print!` panics with a backtrace; SIGPIPE itself stays
/// ignored, since the control client reads the daemon's answer after an EPIPE on its socket.
macro_rules! out {
    ($($arg:tt)*) => { $crate::write_out(format_args!($($arg)*)) };
}

/// [`out!`] with a newline, as `println!`.
macro_rules! outln {
    () => { out!("\n") };
    ($($arg:tt)*) => { out!("{}\n", format_args!($($arg)*)) };
}

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

/// A request's boxes (its mapping's transfers and completions, the NBD client's slot) are
/// made on the event loop that read it and freed on the thread that read its reply; glibc's
/// malloc took its arena's lock for most of those frees and allocations, and the two threads
/// met on it (a futex call every ten requests of a round-robin multipath).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc keeps what it frees for a while, in arenas it commits whole: a flood of 400 NBD
/// connections (a handshake thread each) left the daemon at 102 MiB resident, against 27 MiB
/// with glibc's malloc (`bench/scale.py`). Arenas committed as they are used and freed pages
/// given back at once: 38 MiB, and the CPU gained on the event loops stays. Set before the
/// Rust runtime's first allocation reserves the first arena: from `main` they came too late.
#[used]
#[link_section = ".init_array"]
static RETURN_FREED_MEMORY: extern "C" fn() = return_freed_memory;

extern "C" fn return_freed_memory() {
    // mi_option_e's numbers, which mimalloc keeps across versions (a retired option keeps its
    // place as `deprecated_…`): arena_eager_commit, purge_delay.
    const ARENA_EAGER_COMMIT: libmimalloc_sys::mi_option_t = 4;
    const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
    // SAFETY: setting an option is allowed at any time; these two only change how later
    // arenas are committed and how soon freed pages go back to the kernel.
    unsafe {
        libmimalloc_sys::mi_option_set(ARENA_EAGER_COMMIT, 0);
        libmimalloc_sys::mi_option_set(PURGE_DELAY, 0);
    }
}

use anyhow::{bail, Context};
use clap::Parser;
use serde_json::Value;

use cli::{Cli, Command, DaemonArgs, Print, ThinCommand, TlsArg, Verb};
use udm::control::Request;
use udm::daemon;

fn main() -> ExitCode {
    logger::init();
    let args = cli::options_after_verb(std::env::args_os().collect());
    let args = cli::uuid_as_name(args);
    if let Some(option) = cli::device_number_option(&args) {
        eprintln!(
            "udm: {option}: udm devices have no major and minor numbers; name the device by \
             its name or UUID"
        );
        return ExitCode::FAILURE;
    }
    let cli = match Cli::try_parse_from(args) {
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

/// What [`out!`] does: writes to stdout, and dies of SIGPIPE if no one reads it any more.
fn write_out(text: std::fmt::Arguments) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    match stdout.write_fmt(text).and_then(|()| stdout.flush()) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
            // SAFETY: plain libc calls; the default action ends the process here.
            unsafe {
                libc::signal(libc::SIGPIPE, libc::SIG_DFL);
                libc::raise(libc::SIGPIPE);
            }
            std::process::exit(141);
        }
        Err(e) => {
            eprintln!("udm: writing to stdout: {e}");
            std::process::exit(1);
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
        fuse_queue_reads: args.fuse_queue_reads,
        remote_timeout: std::time::Duration::from_secs(args.remote_timeout),
        replication: args.replication,
        stop_timeout: args.stop_timeout,
    })?)
}

/// Runs a verb: sends its control request and prints the answer, or runs it here.
/// `before_verb`: a `--control` given before the verb.
fn run(command: Command, before_verb: Option<&std::path::Path>) -> anyhow::Result<()> {
    match cli::verb(command)? {
        Verb::Requests(control, requests, print) => {
            ask_each(&control.socket(before_verb), requests, &print)
        }
        Verb::Listing(control, requests, print) => {
            ask_listing(&control.socket(before_verb), requests, &print)
        }
        Verb::Local(command) => run_here(command, before_verb),
    }
}

/// The verbs that run in the client: the daemon itself, and verbs that are more than one
/// control request (loop devices, progress bars, replication streams, thin ls's table).
fn run_here(command: Command, before_verb: Option<&std::path::Path>) -> anyhow::Result<()> {
    match command {
        Command::Daemon(args) => {
            let control = args.control(before_verb);
            daemon(*args, control)
        }
        Command::Detach { loop_device } => loop_device::detach(&loop_device),
        Command::ReplayLog(options) => replay::run(options),
        Command::Attach { name, control } => {
            loop_device::attach(&control.socket(before_verb), &name)
        }
        Command::Wait {
            name,
            progress: true,
            control,
            ..
        } => progress::show(&control.socket(before_verb), &name),
        Command::Version { control } => version(&control.socket(before_verb)),
        Command::WipeTable {
            names,
            noflush,
            control,
            ..
        } => {
            let control = control.socket(before_verb);
            let mut failed = None;
            for name in names {
                if let Err(error) = wipe_table(&control, name, noflush) {
                    keep_last(&mut failed, error);
                }
            }
            failed.map_or(Ok(()), Err)
        }
        Command::Splitname {
            name,
            subsystem,
            columns,
        } => splitname(&name, subsystem.as_deref(), &columns),
        // dmsetup's releases udev cookies; udm takes none, so there is nothing to release.
        Command::UdevcompleteAll { .. } => Ok(()),
        Command::Stop { control } => background::stop(&control.socket(before_verb)),
        Command::Thin {
            command:
                ThinCommand::Ls {
                    pool,
                    json,
                    control,
                },
        } => thin_ls::show(&control.socket(before_verb), &pool, json),
        Command::Send(args) => {
            let control = args.control.socket(before_verb);
            replicate::send(&control, *args)
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
            replicate::receive(&control.socket(before_verb), &pool, id, options)
        }
        // cli::verb answered every other verb with its request.
        _ => unreachable!("a control request verb reached run_here"),
    }
}

/// Sends each request in turn, as dmsetup goes through the devices it is given: one that
/// fails does not stop the others. Each failure is one line; the last is the verb's error.
fn ask_each(
    control: &std::path::Path,
    requests: Vec<Request>,
    print: &Print,
) -> anyhow::Result<()> {
    let mut failed = None;
    for request in requests {
        if let Err(error) = ask(control, request, print) {
            keep_last(&mut failed, error);
        }
    }
    failed.map_or(Ok(()), Err)
}

/// Keeps `error` as the one to return, printing the one kept before as its line.
fn keep_last(failed: &mut Option<anyhow::Error>, error: anyhow::Error) {
    if let Some(earlier) = failed.replace(error) {
        eprintln!("udm: {}", error_line(&earlier));
    }
}

/// `info`, `status`, `table` and `deps` of several devices, as dmsetup prints them: each text
/// line prefixed with `NAME: ` (info's blocks set apart by a blank line instead), the data
/// gathered into one list (one heading for `info -c`). One that fails stops none of the others.
fn ask_listing(
    control: &std::path::Path,
    requests: Vec<(String, Request)>,
    print: &Print,
) -> anyhow::Result<()> {
    let info = matches!(requests.first(), Some((_, Request::Info { .. })));
    let (mut texts, mut data, mut failed) = (Vec::new(), Vec::new(), None);
    for (name, request) in requests {
        let response = match client::call(control, request) {
            Ok(response) => response,
            Err(error) => {
                keep_last(&mut failed, error);
                continue;
            }
        };
        if info {
            texts.push(response.output);
        } else {
            texts.extend(response.output.lines().map(|l| format!("{name}: {l}")));
        }
        data.push(response.data.unwrap_or_default());
    }
    let separator = if info { "\n\n" } else { "\n" };
    show(&texts.join(separator), Value::Array(data), print)?;
    failed.map_or(Ok(()), Err)
}

/// Sends `request` to the daemon at `control` and prints its answer as `print` says.
fn ask(control: &std::path::Path, request: Request, print: &Print) -> anyhow::Result<()> {
    let response = client::call(control, request)?;
    show(&response.output, response.data.unwrap_or_default(), print)
}

/// Prints a verb's answer, its text `output` or its `data`, as `print` says.
fn show(output: &str, data: Value, print: &Print) -> anyhow::Result<()> {
    match print {
        Print::Json => outln!("{}", serde_json::to_string_pretty(&data)?),
        Print::Columns(columns) => {
            let devices = match data {
                Value::Array(devices) => devices,
                device => vec![device],
            };
            let report = columns.layout().render(&devices)?;
            if !report.is_empty() {
                outln!("{report}");
            }
        }
        Print::Text if !output.is_empty() => outln!("{output}"),
        Print::Text | Print::Nothing => {}
    }
    Ok(())
}

/// dmsetup's splitname: the parts of an LVM name, in columns as `info -c` draws them.
fn splitname(
    name: &str,
    subsystem: Option<&str>,
    columns: &cli::ColumnsArgs,
) -> anyhow::Result<()> {
    if let Some(other) = subsystem.filter(|s| *s != "LVM") {
        bail!("splitname: subsystem '{other}': only LVM names are split");
    }
    let layout = columns.layout_of(columns::SPLITNAME_FIELDS);
    outln!("{}", layout.render(&[serde_json::json!({ "name": name })])?);
    Ok(())
}

/// dmsetup's wipe_table: loads an `error` table as large as the device and resumes it (a
/// resume after a load suspends first, as the kernel's does).
fn wipe_table(control: &std::path::Path, name: String, noflush: bool) -> anyhow::Result<()> {
    let info = client::call(
        control,
        Request::Info {
            name: Some(name.clone()),
        },
    )?;
    let sectors = info.data.as_ref().and_then(|d| d["sectors"].as_u64());
    let sectors = sectors.context("the daemon's info on the device gave no size")?;
    let table = format!("0 {sectors} error");
    let load = Request::Load {
        name: name.clone(),
        table,
        force: false,
        read_only: false,
    };
    client::call(control, load)?;
    client::call(control, Request::Resume { name, noflush })?;
    Ok(())
}

/// dmsetup's `version`: this client's, then the daemon's.
fn version(control: &std::path::Path) -> anyhow::Result<()> {
    outln!(
        "Library version:   udm {} (control protocol {})",
        env!("CARGO_PKG_VERSION"),
        udm::control::PROTOCOL_VERSION
    );
    let response = client::call(control, Request::Version)?;
    outln!("Driver version:    {}", response.output);
    Ok(())
}
