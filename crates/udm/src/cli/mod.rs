//! The command line: verbs, their arguments and their help. Every positional argument and
//! flag says what it is, since `udm VERB --help` is where an admin looks first.

use std::ffi::OsString;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::client;
use crate::columns;
use crate::replay;

mod daemon_args;
mod requests;
mod values;

pub use daemon_args::*;
pub use requests::{verb, Print, Verb};
pub use values::*;

const DEFAULT_CONTROL: &str = "/run/udm/control.sock";

#[derive(Parser)]
#[command(
    name = "udm",
    version,
    about = "A device-mapper in user space",
    after_help = "NAME is a device's name or its UUID. Every verb but `daemon`, `detach` and \
                  `replay-log` talks to the daemon at --control (or $UDM_CONTROL)."
)]
pub struct Cli {
    /// The control socket, given before the verb as older versions of udm took it.
    #[arg(long = "control", value_name = "PATH", hide = true)]
    pub control: Option<PathBuf>,
    #[command(flatten)]
    pub udev: UdevOptions,
    #[command(subcommand)]
    pub command: Command,
}

/// dmsetup's options for udev and its prompts, which scripts pass to every verb out of habit
/// (`dmsetup remove -y --noudevsync vol`). udm makes no device nodes, so it sends no udev
/// events to wait for or verify, asks nothing to say yes to, and prints the same however
/// verbose: each is accepted, before or after the verb, and changes nothing.
#[derive(Args)]
pub struct UdevOptions {
    /// Ignored (dmsetup's: do not wait for udev; udm makes no device nodes).
    #[arg(long, global = true, hide = true)]
    noudevsync: bool,
    /// Ignored (dmsetup's: check udev made the nodes; udm makes none).
    #[arg(long, global = true, hide = true)]
    verifyudev: bool,
    /// Ignored (dmsetup's: tell udev not to run its rules; udm sends it nothing).
    #[arg(long, global = true, hide = true)]
    noudevrules: bool,
    /// Ignored (dmsetup's: make the /dev/mapper node at create; udm makes none).
    #[arg(long, global = true, hide = true)]
    addnodeoncreate: bool,
    /// Ignored (dmsetup's: make the /dev/mapper node at resume; udm makes none).
    #[arg(long, global = true, hide = true)]
    addnodeonresume: bool,
    /// Ignored (dmsetup's: a kernel block device's read-ahead; the NBD or loop device a udm
    /// device is used through has its own).
    #[arg(long, global = true, hide = true, value_name = "SECTORS")]
    readahead: Option<String>,
    /// Ignored (dmsetup's: answer yes to prompts; udm asks none).
    #[arg(short = 'y', long, global = true, hide = true)]
    yes: bool,
    /// Ignored (dmsetup's: more detail; udm prints the same).
    #[arg(short = 'v', long, global = true, hide = true, action = clap::ArgAction::Count)]
    verbose: u8,
}

/// The verbs whose device dmsetup's `-u UUID` may name: those that name an existing device.
const NAMED_BY_UUID: &[&str] = &[
    "info",
    "status",
    "table",
    "deps",
    "remove",
    "suspend",
    "resume",
    "message",
    "load",
    "reload",
    "clear",
    "wait",
    "rename",
    "mknodes",
    "attach",
    "finalize",
    "wipe_table",
];

/// dmsetup names a device by its UUID with `-u UUID` (`dmsetup remove -u LVM-…`). udm takes a
/// UUID wherever it takes a name, so in the verbs that name a device, `-u UUID`, `--uuid UUID`
/// and `--uuid=UUID` become that argument, where they stand (in `create`, -u stays the new
/// device's UUID).
pub fn uuid_as_name(args: Vec<OsString>) -> Vec<OsString> {
    let Some(verb) = verb_position(&args).filter(|&i| NAMED_BY_UUID.iter().any(|v| args[i] == *v))
    else {
        return args;
    };
    let mut out = args[..=verb].to_vec();
    let mut rest = args.into_iter().skip(verb + 1);
    while let Some(arg) = rest.next() {
        if arg == "-u" || arg == "--uuid" {
            out.extend(rest.next());
        } else if let Some(uuid) = arg.to_str().and_then(|a| a.strip_prefix("--uuid=")) {
            out.push(uuid.into());
        } else {
            out.push(arg);
        }
    }
    out
}

/// dmsetup reads its options anywhere, before the verb too (`dmsetup -f remove vol`, `dmsetup
/// -c info`), as getopt does: what stands before the verb, but the `--control` udm takes there,
/// moves to just after it. Only options and their values may stand before the verb (`udm
/// frobnicate info` stays an unknown verb, not info on device frobnicate).
pub fn options_after_verb(args: Vec<OsString>) -> Vec<OsString> {
    let Some(verb) = verb_after_options(&args) else {
        return args;
    };
    let (mut out, mut moved) = (vec![args[0].clone()], Vec::new());
    let mut before = args[1..verb].iter().cloned();
    while let Some(arg) = before.next() {
        if arg == "--control" {
            out.push(arg);
            out.extend(before.next());
        } else if arg.to_str().is_some_and(|a| a.starts_with("--control=")) {
            out.push(arg);
        } else {
            moved.push(arg);
        }
    }
    out.push(args[verb].clone());
    out.extend(moved);
    out.extend(args[verb + 1..].iter().cloned());
    out
}

/// Where the verb is if only options and their values stand before it (`--target thin
/// status`: thin is --target's value).
fn verb_after_options(args: &[OsString]) -> Option<usize> {
    use clap::CommandFactory;
    let udm = Cli::command();
    let mut i = 1;
    while let Some(arg) = args.get(i).and_then(|a| a.to_str()) {
        if !arg.starts_with('-') {
            return udm.find_subcommand(arg).is_some().then_some(i);
        }
        i += if takes_value(&udm, &args[i]) { 2 } else { 1 };
    }
    None
}

/// Whether `arg` is an option that takes a value, in any verb or before them.
fn takes_value(udm: &clap::Command, arg: &OsString) -> bool {
    let Some(arg) = arg.to_str() else {
        return false;
    };
    let names = |option: &clap::Arg| {
        let long = arg
            .strip_prefix("--")
            .is_some_and(|l| option.get_long() == Some(l));
        let short = arg.strip_prefix('-').and_then(|s| s.parse::<char>().ok());
        long || (short.is_some() && option.get_short() == short)
    };
    let verbs = udm.get_subcommands().chain([udm]);
    let mut options = verbs.flat_map(|verb| verb.get_arguments());
    options.any(|option| option.get_action().takes_values() && names(option))
}

/// dmsetup's `-j MAJOR -m MINOR` (`--major`, `--minor`), which name a device by its number or
/// give a new one its number: the first found after the verb. Looked for before clap checks
/// the verb's arguments, so that `remove -j 253 -m 0` hears why rather than that NAME is
/// missing.
pub fn device_number_option(args: &[OsString]) -> Option<String> {
    let verb = verb_position(args)?;
    let is_one = |arg: &&str| {
        matches!(*arg, "-j" | "-m" | "--major" | "--minor")
            || arg.starts_with("--major=")
            || arg.starts_with("--minor=")
    };
    let after = args[verb + 1..].iter().filter_map(|a| a.to_str());
    after.into_iter().find(is_one).map(str::to_string)
}

/// Where the verb is: the first argument after the program's that is not an option (the
/// `--control PATH` before a verb takes a value).
fn verb_position(args: &[OsString]) -> Option<usize> {
    let mut i = 1;
    while i < args.len() {
        match args[i].to_str() {
            Some("--control") => i += 2,
            Some(arg) if arg.starts_with('-') => i += 1,
            _ => return Some(i),
        }
    }
    None
}

/// Where the daemon answers the verbs.
#[derive(Args)]
pub struct Control {
    /// The daemon's control socket [default: $UDM_CONTROL, else /run/udm/control.sock].
    #[arg(long = "control", value_name = "PATH")]
    path: Option<PathBuf>,
}

impl Control {
    /// The socket: given after the verb, else before it, else $UDM_CONTROL, else the default.
    pub fn socket(&self, before_verb: Option<&Path>) -> PathBuf {
        control_socket(self.path.as_deref(), before_verb)
    }
}

fn control_socket(after_verb: Option<&Path>, before_verb: Option<&Path>) -> PathBuf {
    after_verb
        .or(before_verb)
        .map(Path::to_path_buf)
        .or_else(|| {
            std::env::var_os("UDM_CONTROL")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        })
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CONTROL))
}

/// Where a table comes from: `--table` lines, a file, or standard input, as dmsetup takes it
/// (`dmsetup create NAME FILE`, `echo TABLE | dmsetup create NAME`).
#[derive(Args)]
pub struct TableSource {
    /// A table line `START LEN TARGET ARGS…` in 512-byte sectors (repeat for more lines).
    #[arg(long = "table", value_name = "LINE", conflicts_with_all = ["table_file", "file"])]
    lines: Vec<String>,
    /// A file with the table, one line per segment (`-` for standard input).
    #[arg(long, value_name = "FILE", conflicts_with = "file")]
    table_file: Option<PathBuf>,
    /// The same as --table-file FILE. Without any of the three, the table is read from
    /// standard input (unless it is a terminal).
    #[arg(value_name = "TABLE_FILE")]
    file: Option<PathBuf>,
}

impl TableSource {
    pub fn text(&self) -> anyhow::Result<String> {
        let text = match self.table_file.as_ref().or(self.file.as_ref()) {
            Some(path) if path.as_os_str() == "-" => read_stdin()?,
            Some(path) => std::fs::read_to_string(path)
                .with_context(|| format!("reading table file {}", path.display()))?,
            None if !self.lines.is_empty() => self.lines.join("\n"),
            None if std::io::stdin().is_terminal() => {
                bail!("give the table with --table, --table-file or a file, or on standard input")
            }
            None => read_stdin()?,
        };
        client::absolutize_table(&text)
    }
}

/// The table on standard input: at least one line.
fn read_stdin() -> anyhow::Result<String> {
    let text = std::io::read_to_string(std::io::stdin()).context("reading the table")?;
    if text.trim().is_empty() {
        bail!("no table on standard input: give it there, or with --table or --table-file");
    }
    Ok(text)
}

#[derive(Subcommand)]
pub enum Command {
    /// Run the daemon in the foreground (logs to stderr; UDM_LOG=debug for more; tells
    /// systemd READY=1 through $NOTIFY_SOCKET once every device is restored).
    Daemon(Box<DaemonArgs>),
    /// Create a device from a table and make it live.
    Create {
        /// The new device's name (letters, digits and _ . + - : @).
        name: String,
        #[command(flatten)]
        table: TableSource,
        /// Refuse writes to the device.
        #[arg(long, short = 'r')]
        readonly: bool,
        /// A unique identifier that names the device as well as its name does (up to 128
        /// printable characters).
        #[arg(long, short = 'u', value_name = "UUID")]
        uuid: Option<String>,
        /// Refused: dmsetup's, to make a device without a table and load one later; a udm
        /// device is made with its table.
        #[arg(long, short = 'n')]
        notable: bool,
        #[command(flatten)]
        control: Control,
    },
    /// Load a table into the inactive slot (made live by `resume`).
    #[command(visible_alias = "reload")]
    Load {
        /// The device's name or UUID.
        name: String,
        #[command(flatten)]
        table: TableSource,
        /// Make the device read-only when this table goes live (without it, the device is
        /// writable then, as with dmsetup).
        #[arg(long, short = 'r')]
        readonly: bool,
        /// Load a smaller table even though devices built on this one reach past its end
        /// (their I/O there then fails with EIO).
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        control: Control,
    },
    /// Make an `error` table as large as the device live (load, then resume): new I/O fails,
    /// and the files and devices the old table used are let go.
    #[command(name = "wipe_table", visible_alias = "wipe-table")]
    WipeTable {
        /// The devices' names or UUIDs, wiped in turn.
        #[arg(required = true)]
        names: Vec<String>,
        /// Push the requests a multipath holds back to the device rather than failing them,
        /// as `suspend --noflush` (they then fail on the error table).
        #[arg(long)]
        noflush: bool,
        /// Accepted and ignored, as for `suspend`.
        #[arg(long)]
        nolockfs: bool,
        /// Accepted and ignored: the table is replaced whoever has the device open.
        #[arg(long, short = 'f')]
        force: bool,
        #[command(flatten)]
        control: Control,
    },
    /// Drop the inactive table (dmsetup clear).
    Clear {
        /// The device's name or UUID.
        name: String,
        #[command(flatten)]
        control: Control,
    },
    /// Hold new I/O and wait for I/O in flight.
    Suspend {
        /// The devices' names or UUIDs, suspended in turn.
        #[arg(required = true)]
        names: Vec<String>,
        /// Push the requests a multipath holds for a path back to the device, to run after
        /// the resume on the table live then, instead of failing them (dmsetup's, for
        /// multipathd's reloads).
        #[arg(long)]
        noflush: bool,
        /// Accepted and ignored: dmsetup's, for not freezing a filesystem mounted on the
        /// device; udm's devices hold none of their own (one on a loop device over the FUSE
        /// file is the loop device's), so the suspend is the same.
        #[arg(long)]
        nolockfs: bool,
        #[command(flatten)]
        control: Control,
    },
    /// Make the inactive table live (if loaded) and let I/O flow.
    Resume {
        /// The devices' names or UUIDs, resumed in turn.
        #[arg(required = true)]
        names: Vec<String>,
        /// For a swap without a `suspend` before it (load, then resume): suspend with
        /// `--noflush` (multipathd's reload).
        #[arg(long)]
        noflush: bool,
        #[command(flatten)]
        control: Control,
    },
    /// Send a message to the target at SECTOR.
    Message {
        /// The device's name or UUID.
        name: String,
        /// A sector inside the segment whose target gets the message (0 for the first).
        sector: u64,
        /// The message: the target's words (`addbadblock 10`, `hydration_threshold 64`), or
        /// `@cancel_deferred_remove`.
        #[arg(required = true, num_args = 1.., allow_hyphen_values = true)]
        words: Vec<String>,
        #[command(flatten)]
        control: Control,
    },
    /// Print the status line of each target (of every device without NAME, each line
    /// prefixed with `NAME: `).
    Status {
        /// The devices' names or UUIDs; every device without them.
        names: Vec<String>,
        /// Only segments of this target type.
        #[arg(long, value_name = "TYPE")]
        target: Option<String>,
        /// Accepted and ignored: dmsetup's, for a thin pool's status without a metadata
        /// commit; udm's status never commits.
        #[arg(long)]
        noflush: bool,
        /// Print the status as JSON, with details (hydration progress, rate, ETA).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        control: Control,
    },
    /// Print the live table (of every device without NAME, each line prefixed with `NAME: `).
    Table {
        /// The devices' names or UUIDs; every device without them.
        names: Vec<String>,
        /// Only segments of this target type.
        #[arg(long, value_name = "TYPE")]
        target: Option<String>,
        /// The inactive table (loaded, not yet resumed) instead of the live one.
        #[arg(long)]
        inactive: bool,
        /// Accepted and ignored: dmsetup's, to show crypt keys; no udm target has keys, so
        /// every table is shown whole.
        #[arg(long)]
        showkeys: bool,
        #[command(flatten)]
        control: Control,
    },
    /// Print the state, tables present, open count, event number and UUID (of every device
    /// without NAME).
    Info {
        /// The devices' names or UUIDs; every device without them.
        names: Vec<String>,
        #[command(flatten)]
        columns: ColumnsArgs,
        /// Print the information as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        control: Control,
    },
    /// Print what each device is built on, as `dmsetup deps -o devname` does: files, remote
    /// exports and other devices in parentheses.
    Deps {
        /// The devices' names or UUIDs; every device without them.
        names: Vec<String>,
        /// dmsetup's `devname`, which is what udm prints anyway (`devno` and `blkdevname`, a
        /// kernel block device's, are refused).
        #[arg(short = 'o', long = "options", value_name = "devname", value_parser = parse_deps_option)]
        options: Option<String>,
        /// Print the dependencies as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        control: Control,
    },
    /// List devices: name, size in sectors and UUID.
    Ls {
        /// Show what each device is built on.
        #[arg(long)]
        tree: bool,
        /// Only devices with at least one target of this type.
        #[arg(long, value_name = "TYPE")]
        target: Option<String>,
        /// Print the list as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        control: Control,
    },
    /// Wait until the device's event number passes EVENT_NR (default: the current one).
    Wait {
        /// The device's name or UUID.
        name: String,
        /// The event number to wait past.
        event_nr: Option<u64>,
        /// Accepted and ignored: dmsetup's, for a thin pool's status without a metadata
        /// commit; udm's status never commits.
        #[arg(long)]
        noflush: bool,
        /// Instead, show the progress (rate, ETA) of the background copies (clone hydration,
        /// snapshot merge) until they are done.
        #[arg(long, conflicts_with = "event_nr")]
        progress: bool,
        #[command(flatten)]
        control: Control,
    },
    /// Rename a device, or give it a UUID (`--setuuid`).
    Rename {
        /// The device's name or UUID.
        name: String,
        /// The new name, or with --setuuid the UUID.
        new: String,
        /// Set the device's UUID (once; a device that has one keeps it).
        #[arg(long)]
        setuuid: bool,
        #[command(flatten)]
        control: Control,
    },
    /// Remove devices.
    Remove {
        /// The devices' names or UUIDs, removed in turn (one that fails leaves the others
        /// going, as with dmsetup).
        #[arg(required = true)]
        names: Vec<String>,
        /// Remove even while clients have it open (their I/O then fails).
        #[arg(long, short = 'f')]
        force: bool,
        /// Wait up to 5 s (instead of 1 s) for clients to let go before refusing.
        #[arg(long)]
        retry: bool,
        /// If the device is in use, remove it once its last client and the last device
        /// built on it let go (`message NAME 0 @cancel_deferred_remove` takes it back).
        #[arg(long, conflicts_with = "force")]
        deferred: bool,
        #[command(flatten)]
        control: Control,
    },
    /// Remove every device, those built on others first (open ones stay unless --force).
    #[command(name = "remove_all", visible_alias = "remove-all")]
    RemoveAll {
        /// Remove devices clients have open too (their I/O then fails).
        #[arg(long, short = 'f')]
        force: bool,
        #[command(flatten)]
        control: Control,
    },
    /// Attach the device's FUSE file to a loop device (direct I/O) and print its path.
    Attach {
        /// The device's name or UUID.
        name: String,
        #[command(flatten)]
        control: Control,
    },
    /// Detach a loop device made by `attach` (one whose file is in a udm FUSE mount; any
    /// other loop device is refused).
    Detach {
        /// The loop device, e.g. /dev/loop0.
        loop_device: PathBuf,
    },
    /// Swap finished targets for their end state, live (a hydrated clone becomes
    /// `linear <destination> 0`).
    Finalize {
        /// The device's name or UUID.
        name: String,
        #[command(flatten)]
        control: Control,
    },
    /// List the target types.
    Targets {
        #[command(flatten)]
        control: Control,
    },
    /// Check the devices exist (dmsetup's makes their /dev/mapper nodes; udm has none to make,
    /// and its devices are reached over NBD or FUSE by name).
    Mknodes {
        /// The devices' names or UUIDs; every device without them.
        names: Vec<String>,
        #[command(flatten)]
        control: Control,
    },
    /// Split an LVM device name into volume group, volume and layer (no daemon needed).
    Splitname {
        /// The device-mapper name, e.g. vg00-lv--home (a doubled `-` stands for `-`).
        name: String,
        /// The subsystem whose names these are: only LVM's are split, as with dmsetup.
        subsystem: Option<String>,
        #[command(flatten)]
        columns: ColumnsArgs,
    },
    /// Does nothing: dmsetup's, to release udev cookies a crashed run left; udm takes none.
    #[command(name = "udevcomplete_all", visible_alias = "udevcomplete-all")]
    UdevcompleteAll {
        /// Ignored (dmsetup's: only cookies older than AGE_IN_MINUTES).
        age_in_minutes: Option<u64>,
    },
    /// Stop the daemon (as SIGTERM does: every device flushed) and wait until it has exited.
    Stop {
        #[command(flatten)]
        control: Control,
    },
    /// Print the versions of this client and of the daemon.
    Version {
        #[command(flatten)]
        control: Control,
    },
    /// Thin pools: `udm thin ls POOL` lists its thin devices and what they hold.
    Thin {
        #[command(subcommand)]
        command: ThinCommand,
    },
    /// Replay a log-writes log onto a device, checking it at flush points (no daemon needed).
    ReplayLog(replay::ReplayOptions),
    /// Write a stream of thin device ID of POOL (a snapshot): every mapped block, or with
    /// --from only what differs from that older snapshot. To stdout, or to a remote daemon
    /// with --to (docs/replication-stream.md).
    Send(Box<SendArgs>),
    /// Apply a stream from stdin (`udm send`'s) as new thin device ID of POOL. It appears once
    /// the whole stream has arrived and checked out; until then the pool is as it was.
    Receive {
        /// The thin-pool device's name or UUID.
        pool: String,
        /// The new thin device's id.
        id: u32,
        /// The local thin device holding the stream's base (by default, the one received as
        /// that snapshot).
        #[arg(long, value_name = "ID")]
        base: Option<u32>,
        /// Keep what arrived if the stream is cut or refused, and continue a receive kept
        /// before (from the record the stream starts at, if this receive has it).
        #[arg(long)]
        resume: bool,
        /// Print the summary as JSON.
        #[arg(long)]
        json: bool,
        /// Progress lines on stderr even when it is not a terminal.
        #[arg(long)]
        progress: bool,
        #[command(flatten)]
        control: Control,
    },
}

#[derive(Args)]
pub struct SendArgs {
    /// The thin-pool device's name or UUID.
    pub pool: String,
    /// The thin device to send (a snapshot no writable table uses).
    pub id: u32,
    /// Send only what differs from this older snapshot (which the receiver holds).
    #[arg(long, value_name = "ID")]
    pub from: Option<u32>,
    /// Send to the --replication listener of a remote daemon: tcp:HOST:PORT/POOL[/ID] (ID
    /// defaults to the id sent).
    #[arg(long, value_name = "DESTINATION")]
    pub to: Option<String>,
    /// With --to: keep what arrives if the transfer breaks, and continue a transfer kept by
    /// the receiver from where it stopped.
    #[arg(long)]
    pub resume: bool,
    /// Start the stream at record N (what a `udm receive --resume` that stopped asks for).
    #[arg(long, value_name = "N")]
    pub resume_at: Option<u64>,
    /// Print the summary as JSON (on stderr when the stream goes to stdout).
    #[arg(long)]
    pub json: bool,
    /// Progress lines on stderr even when it is not a terminal.
    #[arg(long)]
    pub progress: bool,
    #[command(flatten)]
    pub control: Control,
}

#[derive(Subcommand)]
pub enum ThinCommand {
    /// The blocks that differ between thin devices FROM and TO of a pool (as thin_delta):
    /// `BEGIN LENGTH KIND` per run, in data blocks; KIND is different, left_only (only FROM
    /// maps it) or right_only.
    Delta {
        /// The thin-pool device's name or UUID.
        pool: String,
        from: u32,
        to: u32,
        /// Print the runs as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        control: Control,
    },
    /// The pool's thin devices: mapped, exclusive and shared blocks (like thin_ls).
    Ls {
        /// The thin-pool device's name or UUID.
        pool: String,
        /// Print the numbers as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        control: Control,
    },
}

/// `info -c` and its options, as dmsetup's.
#[derive(Args)]
pub struct ColumnsArgs {
    /// One line per device in columns, as `dmsetup info -c` (`splitname` always prints them).
    #[arg(short = 'c', short_alias = 'C', long)]
    columns: bool,
    /// The columns (implies -c): name, uuid, attr, tables_loaded, suspended, readonly,
    /// open, segments, events, sectors, vg_name, lv_name, lv_layer; `+FIELDS` adds to the
    /// default name,attr,open,segments,events,uuid (splitname's: vg_name,lv_name,lv_layer).
    #[arg(short = 'o', long = "options", value_name = "FIELDS")]
    fields: Option<String>,
    /// No heading line; fields separated by `:` and not aligned (as dmsetup; implies -c).
    #[arg(long)]
    noheadings: bool,
    /// Separate the fields with SEP instead of aligning them (implies -c).
    #[arg(long, value_name = "SEP")]
    separator: Option<String>,
    /// Each field as DM_FIELD='value', for a shell to eval (implies -c).
    #[arg(long)]
    nameprefixes: bool,
}

impl ColumnsArgs {
    /// Whether the columns were asked for at all.
    pub fn wanted(&self) -> bool {
        self.columns
            || self.fields.is_some()
            || self.noheadings
            || self.separator.is_some()
            || self.nameprefixes
    }

    pub fn layout(&self) -> columns::Layout<'_> {
        self.layout_of(columns::DEFAULT_FIELDS)
    }

    /// The layout with `default` as the fields without `-o`.
    pub fn layout_of(&self, default: &'static str) -> columns::Layout<'_> {
        columns::Layout {
            fields: self.fields.as_deref(),
            default,
            name_prefixes: self.nameprefixes,
            headings: !self.noheadings,
            separator: self.separator.as_deref().or(self.noheadings.then_some(":")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

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

    /// `udm VERB --help` describes every argument: none is left with an empty line.
    #[test]
    fn every_argument_and_flag_is_described() {
        let mut missing = Vec::new();
        let udm = Cli::command();
        let mut verbs = vec![udm.clone()];
        verbs.extend(udm.get_subcommands().cloned());
        for verb in &verbs {
            for arg in verb.get_arguments() {
                let id = arg.get_id().as_str();
                if arg.get_help().is_none() && !["help", "version"].contains(&id) {
                    missing.push(format!("{} {id}", verb.get_name()));
                }
            }
        }
        assert!(missing.is_empty(), "undescribed: {missing:?}");
    }

    #[test]
    fn the_control_socket_may_come_before_or_after_the_verb_and_after_wins() {
        let socket = |args: &[&str]| {
            let cli = Cli::try_parse_from(args).unwrap();
            let Command::Ls { control, .. } = cli.command else {
                panic!("not ls")
            };
            control.socket(cli.control.as_deref())
        };
        assert_eq!(
            socket(&["udm", "--control", "/a", "ls"]),
            PathBuf::from("/a")
        );
        assert_eq!(
            socket(&["udm", "ls", "--control", "/b"]),
            PathBuf::from("/b")
        );
        assert_eq!(
            socket(&["udm", "--control", "/a", "ls", "--control", "/b"]),
            PathBuf::from("/b")
        );
        // Detach and replay-log talk to no daemon: one given before them is ignored.
        Cli::try_parse_from(["udm", "--control", "/a", "detach", "/dev/loop0"]).unwrap();
    }

    /// `line` as a command line rewritten by `rewrite`, joined again.
    fn rewritten_by(rewrite: fn(Vec<OsString>) -> Vec<OsString>, line: &str) -> String {
        let args = line.split_whitespace().map(OsString::from).collect();
        rewrite(args).join(" ".as_ref()).into_string().unwrap()
    }

    #[test]
    fn options_before_the_verb_move_after_it_but_control() {
        let rewritten = |line| rewritten_by(options_after_verb, line);
        assert_eq!(
            rewritten("udm -f --control /c remove vol"),
            "udm --control /c remove -f vol"
        );
        assert_eq!(rewritten("udm -o name info -c"), "udm info -o name -c");
        assert_eq!(
            rewritten("udm --control /a detach /dev/loop0"),
            "udm --control /a detach /dev/loop0"
        );
        assert_eq!(rewritten("udm --help"), "udm --help");
        assert_eq!(
            rewritten("udm frobnicate -f info"),
            "udm frobnicate -f info"
        );
        assert_eq!(
            rewritten("udm --target thin status pool"),
            "udm status --target thin pool"
        );
    }

    #[test]
    fn dash_u_names_the_device_except_in_create() {
        let rewritten = |line| rewritten_by(uuid_as_name, line);
        assert_eq!(
            rewritten("udm --control /c info -c -u U-1"),
            "udm --control /c info -c U-1"
        );
        assert_eq!(rewritten("udm remove --uuid=U-1 -f"), "udm remove U-1 -f");
        assert_eq!(
            rewritten("udm create -u U-1 vol --table x"),
            "udm create -u U-1 vol --table x"
        );
    }

    /// The options every verb takes for dmsetup's sake parse beside a verb's own arguments of
    /// the same name: replay-log's --verbose read as dmsetup's -v count made udm panic.
    #[test]
    fn dmsetup_options_parse_before_and_after_every_verb() {
        for line in [
            "udm -v -y --noudevsync ls",
            "udm ls -vv --verifyudev --noudevrules --yes",
            "udm replay-log --log l --replay r --verbose",
            "udm -v replay-log --log l --replay r",
            "udm replay-log --log l --replay r",
            "udm daemon --state-dir s -v",
        ] {
            let cli = Cli::try_parse_from(line.split_whitespace());
            assert!(cli.is_ok(), "{line}");
        }
    }

    #[test]
    fn a_bad_command_line_is_one_line_naming_the_verb() {
        for (args, expected) in [
            (&["udm", "create"][..], "<NAME>"),
            (&["udm", "create", "x", "--bogus"], "'--bogus'"),
            (&["udm", "frobnicate"], "'frobnicate'"),
        ] {
            let error = Cli::try_parse_from(args).err().unwrap();
            let line = one_line(&error);
            assert!(!line.contains('\n'), "{line}");
            assert!(line.contains(expected), "{line}");
            assert!(line.ends_with("--help`"), "{line}");
        }
        let line = one_line(&Cli::try_parse_from(["udm", "create"]).err().unwrap());
        assert!(line.contains("see `udm create --help`"), "{line}");
    }
}
