//! `udm replay-log`: rebuild a device from a log-writes log, up to a chosen point, checking it
//! at every FLUSH (or FUA) on the way. Runs without the daemon, on files or block devices.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use udm_block::{BlockDevice, FileDevice, OpenMode, WriteFlags, ZeroFlags};
use udm_metadata::log::{EntryKind, LogEntry, LogReader};

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CheckPoint {
    /// After every FLUSH.
    Flush,
    /// After every FLUSH and every FUA write.
    Fua,
}

#[derive(Args)]
pub struct ReplayOptions {
    /// The log device or file (written by a `log-writes` target).
    #[arg(long)]
    log: PathBuf,
    /// The device or file to replay onto (it should start as the logged device started).
    #[arg(long)]
    replay: PathBuf,
    /// Stop after this many entries.
    #[arg(long)]
    limit: Option<u64>,
    /// Stop after the mark with this text.
    #[arg(long)]
    end_mark: Option<String>,
    /// Stop at the first FLUSH (or FUA write, with `fua`) after the other limits allow.
    #[arg(long, value_enum)]
    stop_at: Option<CheckPoint>,
    /// Run --fsck at every such point, stopping at the first failure.
    #[arg(long, value_enum, requires = "fsck")]
    check: Option<CheckPoint>,
    /// The check command (run with sh -c; exit status 0 means consistent).
    #[arg(long)]
    fsck: Option<String>,
    /// Check only after the mark with this text (e.g. one set once mkfs finished: before
    /// that there is no filesystem to check).
    #[arg(long, requires = "check")]
    check_after_mark: Option<String>,
    /// Print every entry. A count, as the `-v` every verb takes for dmsetup's sake is: the
    /// two are one argument, and clap reads them as one type.
    #[arg(short = 'v', long, action = clap::ArgAction::Count)]
    verbose: u8,
}

/// Whether the log holds a mark with this text. Looked for before replaying anything, so that
/// a mistyped mark does not replay the whole log onto the target instead of part of it.
fn has_mark(log: &Arc<dyn BlockDevice>, mark: &str) -> anyhow::Result<bool> {
    let mut reader = LogReader::open(log.clone()).context("reading the log")?;
    while let Some((entry, _)) = reader.next_entry().context("reading the log")? {
        if entry.kind == EntryKind::Mark && entry.mark == mark {
            return Ok(true);
        }
    }
    Ok(false)
}

fn is_point(point: CheckPoint, kind: EntryKind, fua: bool) -> bool {
    kind == EntryKind::Flush || (point == CheckPoint::Fua && fua)
}

/// One entry as `--verbose` prints it.
fn describe(entry: &LogEntry) -> String {
    let mark = if entry.mark.is_empty() {
        String::new()
    } else {
        format!(" mark '{}'", entry.mark)
    };
    let fua = if entry.fua { "+FUA" } else { "" };
    format!(
        "{:>8} {:?}{fua} offset {} len {}{mark}",
        entry.seq, entry.kind, entry.offset, entry.len
    )
}

/// Does to `target` what `entry` (with the data of a write) did to the logged device.
fn apply(target: &FileDevice, entry: &LogEntry, data: &[u8]) -> anyhow::Result<()> {
    let end = entry
        .offset
        .checked_add(entry.len)
        .filter(|&end| end <= target.size());
    if entry.len > 0 && end.is_none() {
        bail!(
            "entry {}: range {}+{} is beyond the replay target",
            entry.seq,
            entry.offset,
            entry.len
        );
    }
    match entry.kind {
        EntryKind::Write => target.write(entry.offset, data, WriteFlags::default())?,
        // What a discard leaves is unspecified; zeroes are the harshest honest choice.
        EntryKind::Discard | EntryKind::WriteZeroes => {
            target.write_zeroes(entry.offset, entry.len, ZeroFlags::default())?
        }
        EntryKind::Flush | EntryKind::Mark | EntryKind::Restart => {}
    }
    Ok(())
}

/// Replays the log entry by entry, checking at each point asked for. Long-ish: the replay
/// loop and its stop conditions read in order.
pub fn run(o: ReplayOptions) -> anyhow::Result<()> {
    let log: Arc<dyn BlockDevice> = Arc::new(
        FileDevice::open(&o.log, OpenMode::ReadOnly)
            .with_context(|| format!("log {}", o.log.display()))?,
    );
    for mark in [&o.end_mark, &o.check_after_mark].into_iter().flatten() {
        if !has_mark(&log, mark)? {
            bail!(
                "the log has no mark '{mark}' (`udm message NAME 0 mark TEXT` sets one); \
                 nothing was replayed"
            );
        }
    }
    let target = FileDevice::open(&o.replay, OpenMode::ReadWrite)
        .with_context(|| format!("replay target {}", o.replay.display()))?;
    let mut reader = LogReader::open(log).context("reading the log")?;
    let (mut replayed, mut checked) = (0u64, 0u64);
    let mut checking = o.check_after_mark.is_none();
    // Whether the whole log was replayed (rather than up to a limit, mark or stop point).
    let mut to_the_end = true;
    while let Some((entry, data)) = reader.next_entry().context("reading the log")? {
        if o.limit.is_some_and(|limit| replayed >= limit) {
            to_the_end = false;
            break;
        }
        if o.verbose > 0 {
            outln!("{}", describe(&entry));
        }
        apply(&target, &entry, &data)?;
        replayed += 1;
        if entry.kind == EntryKind::Mark
            && o.check_after_mark.as_deref() == Some(entry.mark.as_str())
        {
            checking = true;
        }
        if let (true, Some(point), Some(fsck)) = (checking, o.check, &o.fsck) {
            if is_point(point, entry.kind, entry.fua) {
                target.flush()?;
                let status = Command::new("sh")
                    .arg("-c")
                    .arg(fsck)
                    .status()
                    .context("running --fsck")?;
                checked += 1;
                if !status.success() {
                    bail!(
                        "check failed after entry {} ({:?}{}): `{fsck}` exited with {status}",
                        entry.seq,
                        entry.kind,
                        if entry.fua { "+FUA" } else { "" }
                    );
                }
            }
        }
        if o.end_mark
            .as_deref()
            .is_some_and(|m| entry.kind == EntryKind::Mark && entry.mark == m)
        {
            to_the_end = false;
            break;
        }
        if o.stop_at
            .is_some_and(|point| is_point(point, entry.kind, entry.fua))
        {
            to_the_end = false;
            break;
        }
    }
    target.flush()?;
    out!("replayed {replayed} entries; {checked} check point(s) passed");
    if to_the_end && reader.is_cut_off() {
        // The replay is what was logged, but not what the logged device ended up holding.
        out!(
            "; the log was cut off after {replayed} entries: its device filled up, and later \
             writes to the logged device were not logged"
        );
    }
    outln!();
    Ok(())
}
