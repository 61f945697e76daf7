//! A restart that cannot bring a snapshot back holds its origin device suspended.
//!
//! Origin writes are saved into a snapshot only while its table is up: an origin device that
//! came back without one of its snapshots (its COW file unreadable, a remote COW device down)
//! would let writes change chunks the snapshot never saved, and the snapshot would be
//! silently stale once its device is back. The kernel invalidates a snapshot it cannot keep;
//! udm cannot here (the COW device is the very thing it cannot reach, and may only be late),
//! so the origin is held instead: nothing is lost, and the admin decides — repair the
//! snapshot's devices and restart, or resume the origin and give that snapshot up.

use std::path::Path;

use log::warn;

use super::registry::Registry;

impl Registry {
    /// After a restore: suspends each live device serving the origin of a `snapshot` table
    /// among `unrestored` (device name, table lines), with one log line naming the snapshot.
    /// The record is left as it was, so that a restart that brings the snapshot back finds
    /// the origin device live again.
    pub(super) fn hold_origins_of<'a>(
        &self,
        unrestored: impl IntoIterator<Item = (&'a str, &'a [String])>,
    ) {
        for (snapshot, lines) in unrestored {
            for origin in lines.iter().filter_map(|line| snapshot_origin(line)) {
                for device in self.all().iter().filter(|d| !d.is_suspended()) {
                    let serves = device.live().segments().iter().any(|segment| {
                        segment.target.type_name() == "snapshot-origin"
                            && segment
                                .target
                                .references()
                                .iter()
                                .any(|reference| same_device(reference, origin))
                    });
                    if !serves {
                        continue;
                    }
                    device.suspend(false);
                    warn!(
                        "device '{}' is held suspended: its snapshot '{snapshot}' could not be \
                         restored, and writes to origin '{origin}' would not be saved into it; \
                         make the snapshot's devices readable and restart the daemon, or `udm \
                         resume {}` to go on without it (then remove '{snapshot}': it is stale)",
                        device.name(),
                        device.name()
                    );
                }
            }
        }
    }
}

/// The origin of a `snapshot` table line (`<start> <len> snapshot <origin> ...`).
fn snapshot_origin(line: &str) -> Option<&str> {
    let mut words = line.split_whitespace().skip(2);
    match (words.next(), words.next()) {
        (Some("snapshot"), origin) => origin,
        _ => None,
    }
}

/// Whether two references name one device: the same words, or one file by two paths.
fn same_device(a: &str, b: &str) -> bool {
    if a == b {
        return true;
    }
    match (Path::new(a).canonicalize(), Path::new(b).canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use udm_block::{AlignedBuf, BlockDevice};
    use udm_testkit::TempDir;

    use super::super::registry::Registry;

    /// A snapshot whose device cannot be rebuilt at a restart (its COW file gone here) left its
    /// origin device live: writes to the origin were no longer saved into the snapshot, which
    /// was silently stale once its COW file came back. The origin device is held suspended.
    #[test]
    fn an_origin_whose_snapshot_cannot_be_restored_is_held_suspended() {
        let dir = TempDir::new("held-origin");
        let (origin, cow) = (
            dir.sparse("origin.img", 1 << 22),
            dir.sparse("cow.img", 1 << 22),
        );
        let origin_line = format!("0 8192 snapshot-origin {}", origin.display());
        {
            let r = Registry::in_scratch(&dir);
            r.must_create("base", &origin_line);
            let line = format!("0 8192 snapshot {} {} P 8", origin.display(), cow.display());
            r.must_create("snap", &line);
            r.must_create("other", "0 8 zero");
        }
        let away = dir.path("cow.away");
        std::fs::rename(&cow, &away).unwrap();
        let r = Registry::in_scratch(&dir);
        assert_eq!(r.restore().unwrap(), 2);
        let base = r.get("base").unwrap();
        assert!(
            base.is_suspended(),
            "the origin came back live without its snapshot"
        );
        assert!(!r.get("other").unwrap().is_suspended());
        // The COW file back and the daemon restarted: both come back, live.
        drop((base, r));
        std::fs::rename(&away, &cow).unwrap();
        let r = Registry::in_scratch(&dir);
        assert_eq!(r.restore().unwrap(), 3);
        let base = r.get("base").unwrap();
        assert!(!base.is_suspended());
        base.write(0, &AlignedBuf::zeroed(4096), Default::default())
            .unwrap();
    }
}
