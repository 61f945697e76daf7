//! What the multipath tells: the table line and the status line in the kernel's formats, and
//! the JSON details behind `udm status --json`.
//!
//! Status: `2 <queueing> 0 0 <#groups> <group> (<A|D|E> 0 <#paths> <#info args>
//! (<path> <A|F> <fail count> <info>…)…)…`. The kernel's first two feature values are its
//! `queue_io` flag and pg_init count; with no hardware handler to initialise, udm prints 1
//! for the first while requests are waiting for a path, and 0 for the second. Groups are
//! A (active: I/O goes there), E (enabled) or D (disabled, bypassed); paths A (active) or F
//! (failed) with how often they failed; the selector adds each path's requests in flight
//! (queue-length), or bytes in flight and relative throughput (service-time).

use super::Multipath;

impl Multipath {
    pub(super) fn table_args(&self) -> String {
        let state = self.inner.state.lock();
        self.inner
            .spec
            .print(state.queue_if_no_path, state.group_number())
    }

    pub(super) fn status_line(&self) -> String {
        let inner = &self.inner;
        let state = inner.state.lock();
        let mut out = vec![
            "2".to_string(),
            u8::from(state.waiting > 0).to_string(),
            "0".to_string(),
            "0".to_string(),
            inner.groups.len().to_string(),
            state.group_number().to_string(),
        ];
        for (g, group) in inner.groups.iter().enumerate() {
            let selector = group.selector;
            out.extend([
                state.group_state(g).to_string(),
                "0".to_string(),
                group.paths.len().to_string(),
                selector.info_args().to_string(),
            ]);
            for i in group.paths.clone() {
                let path = &inner.paths[i];
                out.extend([
                    path.reference.clone(),
                    if state.is_usable(i) { "A" } else { "F" }.to_string(),
                    state.fail_count(i).to_string(),
                ]);
                out.extend(selector.path_info(&path.args, &path.load));
            }
        }
        out.join(" ")
    }

    pub(super) fn details(&self) -> serde_json::Value {
        let inner = &self.inner;
        let state = inner.state.lock();
        let features = &inner.spec.features;
        let groups: Vec<_> = inner
            .groups
            .iter()
            .enumerate()
            .map(|(g, group)| {
                let paths: Vec<_> = group
                    .paths
                    .clone()
                    .map(|i| {
                        let path = &inner.paths[i];
                        serde_json::json!({
                            "path": path.reference,
                            "state": if state.is_usable(i) { "active" } else { "failed" },
                            "fail_count": state.fail_count(i),
                            "in_flight": path.load.requests(),
                            "in_flight_bytes": path.load.bytes(),
                        })
                    })
                    .collect();
                serde_json::json!({
                    "group": g + 1,
                    "state": match state.group_state(g) {
                        'A' => "active",
                        'D' => "disabled",
                        _ => "enabled",
                    },
                    "selector": group.selector.name(),
                    "paths": paths,
                })
            })
            .collect();
        serde_json::json!({
            "queue_if_no_path": state.queue_if_no_path,
            "no_path_retry": features.no_path_retry,
            "checker_interval_seconds": features.checker_interval().as_secs(),
            "path_timeout_seconds": features.path_timeout().as_secs(),
            "requests_waiting_for_a_path": state.waiting,
            "groups": groups,
        })
    }
}
