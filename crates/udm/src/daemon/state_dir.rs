//! The state dir on disk: one daemon at a time holds it, and every record in it is replaced
//! whole, so that a crash leaves the old record or the new one.

use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::Path;

use super::DaemonError;

/// Takes the state dir for this daemon alone: two daemons on one state dir would open the same
/// clone metadata and lose each other's commits. The lock (flock on `state-dir/lock`) is held
/// until the process exits, however it exits; the file names the holder's pid for the message.
pub fn lock_state_dir(state_dir: &Path) -> Result<std::fs::File, DaemonError> {
    let io = DaemonError::io(format!("state dir {}", state_dir.display()));
    std::fs::create_dir_all(state_dir).map_err(&io)?;
    let path = state_dir.join("lock");
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(DaemonError::io(format!("lock file {}", path.display())))?;
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let mut holder = String::new();
        let _ = file.read_to_string(&mut holder);
        return Err(DaemonError::InUse {
            state_dir: state_dir.to_path_buf(),
            pid: holder.trim().to_string(),
        });
    }
    file.set_len(0).map_err(&io)?;
    file.rewind().map_err(&io)?;
    writeln!(file, "{}", std::process::id()).map_err(&io)?;
    Ok(file)
}

/// Replaces `path` with `data` so that a crash leaves the old or the new content: temp file,
/// fsync, rename, fsync of the directory.
pub fn write_durably(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let file = std::fs::File::create(&tmp)?;
    std::io::Write::write_all(&mut &file, data)?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(path.parent().expect("a file in a directory"))?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_naming_the_first() {
        let dir = std::env::temp_dir().join(format!("udm-state-lock-{}", std::process::id()));
        let _held = lock_state_dir(&dir).unwrap();
        // flock conflicts between open file descriptions, as between two daemons.
        let err = lock_state_dir(&dir).unwrap_err().to_string();
        assert!(
            err.contains(&format!("already running (pid {})", std::process::id())),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_durable_write_replaces_the_whole_file() {
        let dir = std::env::temp_dir().join(format!("udm-durable-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("record.json");
        write_durably(&path, b"a longer first version").unwrap();
        write_durably(&path, b"second").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"second");
        assert!(!dir.join("record.json.tmp").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
