//! The daemon logs to its stderr. When that is a file (`udm daemon … 2>>/var/log/udm.log`),
//! SIGHUP reopens it by the path it had when the daemon started, so that it can be rotated
//! (`mv udm.log udm.log.1; kill -HUP PID`, or logrotate without copytruncate): new lines go to
//! a new file at the old path. Under systemd the log is the journal's socket, and there is
//! nothing to reopen. udm has no configuration file, so SIGHUP re-reads none.

use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::OnceLock;

use log::{info, warn};

/// The log file as the daemon started with it.
struct LogFile {
    path: PathBuf,
    /// Permission bits, for the new file at the path.
    mode: u32,
}

/// `None`: stderr is not a file (a terminal, a pipe, the journal, /dev/null).
static LOG_FILE: OnceLock<Option<LogFile>> = OnceLock::new();

/// The regular file stderr writes to, if it is one, by its path (/proc/self/fd/2 names the file
/// the descriptor is open on, wherever it was opened from).
fn stderr_file() -> Option<LogFile> {
    let meta = std::fs::metadata("/proc/self/fd/2").ok()?;
    if !meta.is_file() {
        return None;
    }
    let path = std::fs::read_link("/proc/self/fd/2").ok()?;
    // A file deleted since has no path to reopen.
    if path.to_string_lossy().ends_with(" (deleted)") {
        return None;
    }
    Some(LogFile {
        path,
        mode: meta.mode() & 0o7777,
    })
}

/// Notes where the log goes, for [`reopen`]: called at the start, before anything is rotated.
pub fn remember() {
    LOG_FILE.get_or_init(stderr_file);
}

/// SIGHUP: points stderr at a file opened anew at the log's path (made if it was moved away),
/// and says so in the log.
pub fn reopen() {
    const NOTHING_ELSE: &str = "udm has no configuration file, nothing else is reloaded";
    let Some(log) = LOG_FILE.get_or_init(stderr_file) else {
        info!(
            "SIGHUP: the log is not a file (stderr is not one), nothing to reopen; {NOTHING_ELSE}"
        );
        return;
    };
    let opened = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(log.mode)
        .open(&log.path);
    match opened {
        Ok(file) => {
            // SAFETY: dup2 onto descriptor 2 from a descriptor we own; the old file is closed
            // by it, and every later write to stderr goes to the new one.
            unsafe { libc::dup2(file.as_raw_fd(), 2) };
            info!(
                "SIGHUP: reopened the log file {}; {NOTHING_ELSE}",
                log.path.display()
            );
        }
        Err(e) => warn!(
            "SIGHUP: cannot reopen the log file {}: {e}; logging on to the file open before",
            log.path.display()
        ),
    }
}
