//! The kernel's multipath messages: `queue_if_no_path`, `fail_if_no_path` (requests waiting
//! for a path fail with EIO now), `fail_path <path>`, `reinstate_path <path>`,
//! `switch_group <n>`, `enable_group <n>`, `disable_group <n>` (groups numbered from 1).
//! Paths are named as the table line names them.

use super::Multipath;
use crate::args::Args;
use crate::target::TargetError;

const MESSAGES: &str = "queue_if_no_path, fail_if_no_path, fail_path <path>, \
                        reinstate_path <path>, switch_group <n>, enable_group <n>, \
                        disable_group <n>";

impl Multipath {
    pub(super) fn handle_message(&self, words: &[&str]) -> Result<String, TargetError> {
        let inner = &self.inner;
        let name = words[0].to_ascii_lowercase();
        match (name.as_str(), &words[1..]) {
            ("queue_if_no_path" | "fail_if_no_path", []) => {
                inner.state.lock().queue_if_no_path = name == "queue_if_no_path";
                inner.changed.notify_all();
            }
            ("fail_path", [path]) => inner.fail_path(inner.path_named(path)?, "by message"),
            ("reinstate_path", [path]) => {
                let path = inner.path_named(path)?;
                if let Some(why) = inner.identity_mismatch(path) {
                    return Err(TargetError::new(format!("multipath: {why}")));
                }
                inner.reinstate_path(path, "by message")
            }
            ("switch_group" | "enable_group" | "disable_group", [_]) => {
                let group = self.group_number(words)?;
                let mut state = inner.state.lock();
                match name.as_str() {
                    "switch_group" => state.switch_group(group),
                    bypass => state.bypass(group, bypass == "disable_group"),
                }
                drop(state);
                (inner.raise_event)();
            }
            (
                "queue_if_no_path" | "fail_if_no_path" | "fail_path" | "reinstate_path"
                | "switch_group" | "enable_group" | "disable_group",
                _,
            ) => {
                return Err(TargetError::new(format!(
                    "multipath: wrong number of arguments for '{}' (messages: {MESSAGES})",
                    words[0]
                )))
            }
            _ => {
                return Err(TargetError::new(format!(
                    "multipath: unknown message '{}' (messages: {MESSAGES})",
                    words.join(" ")
                )))
            }
        }
        Ok(String::new())
    }

    /// The 0-based index of the group a `… <n>` message names.
    fn group_number(&self, words: &[&str]) -> Result<usize, TargetError> {
        let groups = self.inner.groups.len();
        if groups == 0 {
            return Err(TargetError::new("multipath: there are no priority groups"));
        }
        let n: usize = Args::new("multipath", &words[1..]).number_in("group", 1..=groups)?;
        Ok(n - 1)
    }
}
