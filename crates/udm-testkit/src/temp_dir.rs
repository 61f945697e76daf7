//! Scratch directories.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A scratch directory, removed with everything in it on drop (declare it before the guards of
/// whatever is mounted in it, so that those go first). Made under `$UDM_TEST_DIR` if set, else
/// the system's temporary directory; the name carries a tag, the pid and a counter, so tests
/// running at once never share one.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static N: AtomicU64 = AtomicU64::new(0);
        let base = std::env::var_os("UDM_TEST_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let dir = base.join(format!(
            "udm-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    /// `name` inside the directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// A sparse file of `len` bytes, `name` inside the directory: a disk image for a test.
    pub fn sparse(&self, name: &str, len: u64) -> PathBuf {
        let path = self.path(name);
        std::fs::File::create(&path).unwrap().set_len(len).unwrap();
        path
    }

    pub fn root(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
