//! Remote (NBD) references in tables: opened as clients with the daemon's `--remote-timeout`,
//! and the size each export was last seen with, kept in the state dir. A device that was live
//! must come back after a restart even while its remote is down, and its table cannot be
//! built without the remote's size; a new table on an unreachable remote is refused as dm
//! refuses a table whose device is missing.

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use log::warn;
use udm_block::{BlockDevice, OpenMode};
use udm_nbd::{ClientError, ClientOptions, NbdClient};
use udm_targets::TargetError;

use super::write_durably;

pub struct Remotes {
    /// `remotes.json` in the state dir: URI → size in bytes.
    path: PathBuf,
    sizes: Mutex<BTreeMap<String, u64>>,
    timeout: Duration,
    /// Tables being built are the saved ones of a restart, not new ones.
    restoring: AtomicBool,
}

/// While it lives, unreachable remotes with a known size open disconnected.
pub struct Restoring<'a>(&'a Remotes);

impl Drop for Restoring<'_> {
    fn drop(&mut self) {
        self.0.restoring.store(false, Ordering::Release);
    }
}

impl Remotes {
    /// Reads the sizes recorded in `state_dir`. A damaged record is reported and ignored: it
    /// only matters for remotes that are down at restart.
    pub fn new(state_dir: &Path, timeout: Duration) -> Remotes {
        let path = state_dir.join("remotes.json");
        let sizes = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                warn!("ignoring {}: {e}", path.display());
                BTreeMap::new()
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => {
                warn!("ignoring {}: {e}", path.display());
                BTreeMap::new()
            }
        };
        Remotes {
            path,
            sizes: Mutex::new(sizes),
            timeout,
            restoring: AtomicBool::new(false),
        }
    }

    pub fn restoring(&self) -> Restoring<'_> {
        self.restoring.store(true, Ordering::Release);
        Restoring(self)
    }

    pub fn open(&self, uri: &str, mode: OpenMode) -> Result<Arc<dyn BlockDevice>, TargetError> {
        self.open_with(uri, Self::options(mode, self.timeout))
    }

    /// A multipath's path: it fails requests at once when its connection breaks, and after
    /// `timeout` when the server stops answering, for the multipath to send them elsewhere.
    pub fn open_path(
        &self,
        uri: &str,
        mode: OpenMode,
        timeout: Duration,
    ) -> Result<Arc<dyn BlockDevice>, TargetError> {
        let options = ClientOptions {
            fail_fast: true,
            ..Self::options(mode, timeout)
        };
        self.open_with(uri, options)
    }

    fn options(mode: OpenMode, io_timeout: Duration) -> ClientOptions {
        ClientOptions {
            read_only: mode == OpenMode::ReadOnly,
            io_timeout,
            ..ClientOptions::default()
        }
    }

    fn open_with(
        &self,
        uri: &str,
        options: ClientOptions,
    ) -> Result<Arc<dyn BlockDevice>, TargetError> {
        let error = match NbdClient::connect(uri, options.clone()) {
            Ok(client) => {
                self.remember(uri, client.size());
                return Ok(Arc::new(client));
            }
            Err(e @ ClientError::Uri(_)) => return Err(TargetError::new(e.to_string())),
            Err(e) => e,
        };
        if !self.restoring.load(Ordering::Acquire) {
            return Err(TargetError::new(error.to_string()));
        }
        let Some(size) = self.sizes.lock().get(uri).copied() else {
            return Err(TargetError::new(format!(
                "{error} (and its size was never recorded, so the device cannot come back without it)"
            )));
        };
        warn!(
            "{error}; restoring with the size it had ({size} bytes) and reconnecting in the \
             background"
        );
        let client = NbdClient::disconnected(uri, options, size)
            .map_err(|e| TargetError::new(e.to_string()))?;
        Ok(Arc::new(client))
    }

    fn remember(&self, uri: &str, size: u64) {
        let mut sizes = self.sizes.lock();
        if sizes.insert(uri.to_string(), size) == Some(size) {
            return;
        }
        let json = serde_json::to_vec_pretty(&*sizes).expect("serialisable");
        // The device works without the record; only a restart while the remote is down
        // would miss it.
        if let Err(e) = write_durably(&self.path, &json) {
            warn!(
                "recording the size of {uri} in {}: {e}",
                self.path.display()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unreachable_remote_opens_only_at_restore_and_only_with_a_recorded_size() {
        let dir = std::env::temp_dir().join(format!("udm-remotes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let uri = format!("nbd+unix:///?socket={}", dir.join("gone.sock").display());
        let error = |r: Result<Arc<dyn BlockDevice>, TargetError>| match r {
            Ok(_) => panic!("opened an unreachable remote"),
            Err(e) => e.to_string(),
        };

        let remotes = Remotes::new(&dir, Duration::from_secs(1));
        assert!(error(remotes.open(&uri, OpenMode::ReadOnly)).contains("cannot connect"));
        {
            let _restoring = remotes.restoring();
            let e = error(remotes.open(&uri, OpenMode::ReadOnly));
            assert!(e.contains("never recorded"), "{e}");
        }
        remotes.remember(&uri, 4 << 20);

        // The record survives a restart.
        let remotes = Remotes::new(&dir, Duration::from_secs(1));
        {
            let _restoring = remotes.restoring();
            let dev = remotes.open(&uri, OpenMode::ReadOnly).unwrap();
            assert_eq!(dev.size(), 4 << 20);
        }
        // Outside a restore, a new table on it is still refused.
        assert!(error(remotes.open(&uri, OpenMode::ReadOnly)).contains("cannot connect"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
