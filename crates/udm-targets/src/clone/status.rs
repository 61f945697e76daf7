//! What the clone tells and what it is told: the status line (the kernel's format), the JSON
//! details behind `udm status --json` and `udm wait --progress`, messages, and the messages
//! that bring back its settings after a restart.

use udm_block::SECTOR_SIZE;

use super::commit::Mode;
use super::hydration;
use super::CloneTarget;
use crate::args::Args;
use crate::target::TargetError;

impl CloneTarget {
    /// `<metadata block size> <used>/<total metadata blocks> <region size>
    /// <hydrated>/<total regions> <hydrating regions> <#features> <features>* <#core args>
    /// <core args>* <clone metadata mode>`
    pub(super) fn status_line(&self) -> String {
        let s = &self.inner;
        if s.mode() == Mode::Fail {
            return "Fail".into();
        }
        let (used, total) = s.meta.blocks_used_and_total();
        let settings = s.hydration.lock().settings;
        let mut features = Vec::new();
        if !settings.hydration_enabled {
            features.push("no_hydration");
        }
        if !s.discard_passdown {
            features.push("no_discard_passdown");
        }
        if s.hydrate_on_read {
            features.push("hydrate_on_read");
        }
        let mut core = format!(
            "hydration_threshold {} hydration_batch_size {}",
            settings.threshold, settings.batch_size
        );
        let mut core_count = 4;
        if settings.max_rate_kib > 0 {
            core += &format!(" max_hydration_rate {}", settings.max_rate_kib);
            core_count = 6;
        }
        let features = std::iter::once(features.len().to_string())
            .chain(features.iter().map(|f| f.to_string()))
            .collect::<Vec<_>>()
            .join(" ");
        format!(
            "8 {used}/{total} {} {}/{} {} {features} {core_count} {core} {}",
            s.region / SECTOR_SIZE,
            s.meta.hydrated_count(),
            s.meta.regions(),
            s.claims.count(),
            if s.mode() == Mode::Write { "rw" } else { "ro" }
        )
    }

    /// Progress in bytes, the copy rate and an ETA, and the metadata's state. `state` says
    /// whether hydration is copying, paused (and `paused_by` what), stopped by a metadata
    /// failure, or complete; only while it copies are there a rate and an ETA.
    pub(super) fn details(&self) -> serde_json::Value {
        let s = &self.inner;
        let hydrated = s.meta.hydrated_count();
        let regions = s.meta.regions();
        let hydrated_bytes = (hydrated * s.region).min(s.len);
        let (enabled, paused_by, copy_threads) = {
            let h = s.hydration.lock();
            (h.settings.hydration_enabled, h.paused_by(), h.workers())
        };
        let state = match (hydrated >= regions, s.mode(), paused_by) {
            (true, ..) => "complete",
            (false, Mode::Write, None) => "hydrating",
            (false, Mode::Write, Some(_)) => "paused",
            (false, ..) => "stopped",
        };
        let (rate, eta) = match state {
            "hydrating" => (
                s.progress.bytes_per_second(),
                s.progress.eta_seconds(s.len - hydrated_bytes),
            ),
            _ => (None, (hydrated_bytes == s.len).then_some(0.0)),
        };
        serde_json::json!({
            "state": state,
            "paused_by": paused_by.filter(|_| state == "paused"),
            "mode": format!("{:?}", s.mode()).to_lowercase(),
            "regions": regions,
            "hydrated_regions": hydrated,
            "region_bytes": s.region,
            "total_bytes": s.len,
            "hydrated_bytes": hydrated_bytes,
            "hydrating_regions": s.claims.count(),
            "hydration_enabled": enabled,
            "copy_threads": copy_threads,
            "copy_rate_bytes_per_second": rate.map(f64::round),
            "eta_seconds": eta,
            "complete": hydrated >= regions,
            "metadata_transaction": s.meta.transaction(),
            "metadata_fallback": s.meta.fallback().map(|f| serde_json::json!({
                "used_slot": f.used_slot,
                "used_transaction": f.used_transaction,
                "bad_slot": f.bad_slot,
                "bad_slot_claims_transaction": f.bad_slot_claims_transaction,
                "reason": f.reason,
            })),
        })
    }

    /// `enable_hydration`, `disable_hydration`, `hydration_threshold <n>`,
    /// `hydration_batch_size <n>`, `max_hydration_rate <KiB/s>`.
    pub(super) fn handle_message(&self, words: &[&str]) -> Result<String, TargetError> {
        let s = &self.inner;
        let lowered: Vec<String> = words.iter().map(|w| w.to_ascii_lowercase()).collect();
        let lowered: Vec<&str> = lowered.iter().map(String::as_str).collect();
        // The value of a `KEY VALUE` message, at least `min`.
        let number = |min| Args::new("clone", &words[1..]).number_at_least(lowered[0], min);
        let mut hydration = s.hydration.lock();
        let was = hydration.paused_by();
        match lowered.as_slice() {
            ["enable_hydration"] => hydration.settings.hydration_enabled = true,
            ["disable_hydration"] => hydration.settings.hydration_enabled = false,
            ["hydration_threshold", _] => hydration.settings.threshold = number(0)?,
            ["hydration_batch_size", _] => hydration.settings.batch_size = number(1)?,
            ["max_hydration_rate", _] => hydration.set_max_rate(number(0)?),
            ["enable_hydration"
            | "disable_hydration"
            | "hydration_threshold"
            | "hydration_batch_size"
            | "max_hydration_rate", ..] => {
                return Err(TargetError::new(format!(
                    "clone: wrong number of arguments for '{}'",
                    words[0]
                )))
            }
            _ => {
                return Err(TargetError::new(format!(
                    "clone: unsupported message '{}'",
                    words.join(" ")
                )))
            }
        }
        // Logged before the workers can take the hydration lock again: the count is the one
        // at the change (they copy as soon as a resume lets them).
        s.log_pause_change(was, hydration.paused_by());
        drop(hydration);
        s.wake.notify_all();
        hydration::staff(s);
        Ok(String::new())
    }

    /// The messages that set a fresh clone's settings to these.
    pub(super) fn saved_settings(&self) -> Vec<String> {
        let settings = self.inner.hydration.lock().settings;
        vec![
            if settings.hydration_enabled {
                "enable_hydration"
            } else {
                "disable_hydration"
            }
            .to_string(),
            format!("hydration_threshold {}", settings.threshold),
            format!("hydration_batch_size {}", settings.batch_size),
            format!("max_hydration_rate {}", settings.max_rate_kib),
        ]
    }

    /// `linear <destination> 0` once every region is hydrated and committed.
    pub(super) fn finished_replacement(&self) -> Result<String, TargetError> {
        let s = &self.inner;
        if s.is_complete() && !s.meta.is_dirty() {
            Ok(format!("linear {} 0", self.references[1]))
        } else {
            Err(TargetError::new(format!(
                "clone: hydration is not complete ({} of {} regions)",
                s.meta.hydrated_count(),
                s.meta.regions()
            )))
        }
    }
}
