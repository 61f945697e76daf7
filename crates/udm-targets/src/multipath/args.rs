//! The table line, in the kernel's syntax:
//!
//! ```text
//! multipath <#features> <feature>… <#hw handler args> <#priority groups> <initial group>
//!     (<selector> <#selector args> <#paths> <#path args> (<path> <path arg>…)…)…
//! ```
//!
//! Features: the kernel's `queue_if_no_path` and `retain_attached_hw_handler` (accepted: there
//! is no hardware handler to retain), and udm's `no_path_retry <n>` (multipathd's: queue for
//! at most n checker intervals once the last path has failed), `checker_interval <seconds>`
//! (multipathd's polling interval, default 5), `path_timeout <seconds>` (how long a remote
//! path may leave a request unanswered before it is failed, default 5) and
//! `failback immediate|manual` (multipathd's: with `immediate`, I/O goes back to a group
//! earlier in the table as soon as one of its paths is reinstated; `manual`, the default and
//! the kernel's behaviour, leaves that to `switch_group`), and `no_path_identity_check`
//! (paths are taken for one device without comparing their size and first 4 KiB; see
//! `identity`). Hardware handlers
//! (`<#hw handler args>` other than 0) are refused: udm's paths are not SCSI devices.
//!
//! Counts are bounded as the kernel bounds them, and every count must match what follows.

use std::time::Duration;

use super::selector::{PathArgs, Selector};
use crate::args::Args;
use crate::target::TargetError;

const DEFAULT_CHECKER_INTERVAL: u64 = 5;
const DEFAULT_PATH_TIMEOUT: u64 = 5;
/// The kernel's bound on every count in the line but the features'.
const MAX_COUNT: usize = 1024;
/// Every feature with its value, once each.
const MAX_FEATURE_WORDS: usize = 11;
const FEATURES: &str = "queue_if_no_path, no_path_retry <n>, retain_attached_hw_handler, \
                        checker_interval <seconds>, path_timeout <seconds>, \
                        failback immediate|manual, no_path_identity_check";

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Features {
    pub queue_if_no_path: bool,
    pub no_path_retry: Option<u32>,
    pub retain_attached_hw_handler: bool,
    /// Seconds, as given (printed back only when given).
    pub checker_interval: Option<u64>,
    pub path_timeout: Option<u64>,
    /// `Some(true)` immediate, `Some(false)` manual (printed back only when given).
    pub failback: Option<bool>,
    pub no_path_identity_check: bool,
}

impl Features {
    pub fn checker_interval(&self) -> Duration {
        Duration::from_secs(self.checker_interval.unwrap_or(DEFAULT_CHECKER_INTERVAL))
    }

    pub fn path_timeout(&self) -> Duration {
        Duration::from_secs(self.path_timeout.unwrap_or(DEFAULT_PATH_TIMEOUT))
    }

    pub fn failback_immediate(&self) -> bool {
        self.failback == Some(true)
    }

    fn parse(words: &[&str]) -> Result<Features, TargetError> {
        let mut args = Args::new("multipath", words);
        let mut features = Features::default();
        let mut seen: Vec<String> = Vec::new();
        while args.remaining() > 0 {
            let name = args.word("feature")?.to_ascii_lowercase();
            if seen.contains(&name) {
                return Err(args.error(format!("feature '{name}' is given twice")));
            }
            let value = |args: &mut Args| {
                if args.remaining() == 0 {
                    return Err(args.error(format!(
                        "feature '{name}' needs a value within the <#features> words"
                    )));
                }
                Ok(())
            };
            match name.as_str() {
                "queue_if_no_path" => features.queue_if_no_path = true,
                "retain_attached_hw_handler" => features.retain_attached_hw_handler = true,
                "no_path_identity_check" => features.no_path_identity_check = true,
                "no_path_retry" => {
                    value(&mut args)?;
                    features.no_path_retry = Some(args.number("no_path_retry")?);
                }
                "checker_interval" => {
                    value(&mut args)?;
                    features.checker_interval = Some(args.number_in("checker_interval", 1..=3600)?);
                }
                "path_timeout" => {
                    value(&mut args)?;
                    features.path_timeout = Some(args.number_in("path_timeout", 1..=3600)?);
                }
                "failback" => {
                    value(&mut args)?;
                    features.failback = match args.word("failback")? {
                        "immediate" => Some(true),
                        "manual" => Some(false),
                        other => {
                            return Err(args.error(format!(
                                "invalid <failback> '{other}': immediate or manual"
                            )))
                        }
                    };
                }
                _ => {
                    return Err(args.error(format!("unknown feature '{name}' (known: {FEATURES})")))
                }
            }
            seen.push(name);
        }
        Ok(features)
    }

    /// The feature words, with queueing as last set (the kernel prints its current state).
    fn words(&self, queue_if_no_path: bool) -> Vec<String> {
        let mut words = Vec::new();
        if queue_if_no_path {
            words.push("queue_if_no_path".to_string());
        }
        if let Some(n) = self.no_path_retry {
            words.extend(["no_path_retry".to_string(), n.to_string()]);
        }
        if self.retain_attached_hw_handler {
            words.push("retain_attached_hw_handler".to_string());
        }
        if let Some(s) = self.checker_interval {
            words.extend(["checker_interval".to_string(), s.to_string()]);
        }
        if let Some(s) = self.path_timeout {
            words.extend(["path_timeout".to_string(), s.to_string()]);
        }
        if let Some(immediate) = self.failback {
            let value = if immediate { "immediate" } else { "manual" };
            words.extend(["failback".to_string(), value.to_string()]);
        }
        if self.no_path_identity_check {
            words.push("no_path_identity_check".to_string());
        }
        words
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PathSpec {
    pub reference: String,
    pub args: PathArgs,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct GroupSpec {
    pub selector: Selector,
    pub paths: Vec<PathSpec>,
}

/// A multipath table line, read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Spec {
    pub features: Features,
    /// 1-based; 0 only when there are no groups.
    pub initial_group: usize,
    pub groups: Vec<GroupSpec>,
}

impl Spec {
    /// Every path in table order, with its group's index.
    pub fn paths(&self) -> impl Iterator<Item = (usize, &PathSpec)> {
        self.groups
            .iter()
            .enumerate()
            .flat_map(|(g, group)| group.paths.iter().map(move |p| (g, p)))
    }

    /// The arguments as the table prints them: every path's selector arguments in full,
    /// queueing as last set and `group_number` (the group I/O goes to) as the initial group,
    /// as the kernel does.
    pub fn print(&self, queue_if_no_path: bool, group_number: usize) -> String {
        let features = self.features.words(queue_if_no_path);
        let mut out = vec![features.len().to_string()];
        out.extend(features);
        out.extend([
            "0".to_string(),
            self.groups.len().to_string(),
            group_number.to_string(),
        ]);
        for group in &self.groups {
            let selector = group.selector;
            out.extend([
                selector.name().to_string(),
                selector.print_args(),
                group.paths.len().to_string(),
                selector.table_args().to_string(),
            ]);
            for path in &group.paths {
                out.push(path.reference.clone());
                out.push(selector.print_path_args(&path.args));
            }
        }
        out.join(" ")
    }
}

/// Reads the whole line; the paths are opened afterwards.
pub(super) fn parse(args: &mut Args) -> Result<Spec, TargetError> {
    let count = args.number_in("#features", 0..=MAX_FEATURE_WORDS)?;
    let features = Features::parse(&args.take(count, "<#features>")?)?;

    let hw_args = args.number_in("#hw handler args", 0..=MAX_COUNT)?;
    if hw_args > 0 {
        let handler = args.take(hw_args, "<#hw handler args>")?;
        return Err(args.error(format!(
            "hardware handler '{}' is not supported (udm's paths are not SCSI devices): \
             <#hw handler args> must be 0",
            handler[0]
        )));
    }

    let group_count = args.number_in("#priority groups", 0..=MAX_COUNT)?;
    let initial_group = args.number_in("initial group", 0..=MAX_COUNT)?;
    if (group_count == 0) != (initial_group == 0) || initial_group > group_count {
        return Err(args.error(format!(
            "invalid <initial group> {initial_group}: with {group_count} priority group(s) it \
             must be {}",
            if group_count == 0 {
                "0".to_string()
            } else {
                format!("between 1 and {group_count}")
            }
        )));
    }

    let mut groups = Vec::with_capacity(group_count);
    for number in 1..=group_count {
        let in_group = |e: TargetError| {
            TargetError::new(format!("multipath: priority group {number}: {}", bare(&e)))
        };
        groups.push(parse_group(args).map_err(in_group)?);
    }
    Ok(Spec {
        features,
        initial_group,
        groups,
    })
}

fn parse_group(args: &mut Args) -> Result<GroupSpec, TargetError> {
    let name = args.word("selector")?;
    let selector_args = args.number_in("#selector args", 0..=MAX_COUNT)?;
    let given = args.take(selector_args, "<#selector args>")?;
    let selector = Selector::parse(name, &given).map_err(|e| args.error(bare(&e)))?;
    let path_count = args.number_in("#paths", 1..=MAX_COUNT)?;
    let path_args = args.number_in("#path args", 0..=MAX_COUNT)?;
    let mut paths = Vec::with_capacity(path_count);
    for number in 1..=path_count {
        let reference = args
            .word(&format!("path {number} of {path_count}"))?
            .to_string();
        let words = args.take(path_args, &format!("<#path args> of path '{reference}'"))?;
        let parsed = selector
            .parse_path_args(&words)
            .map_err(|e| args.error(format!("path '{reference}': {e}")))?;
        paths.push(PathSpec {
            reference,
            args: parsed,
        });
    }
    Ok(GroupSpec { selector, paths })
}

/// An error's text without the "multipath: " its [`Args`] put in front.
fn bare(e: &TargetError) -> &str {
    e.0.strip_prefix("multipath: ").unwrap_or(&e.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(line: &str) -> Result<Spec, String> {
        let tokens: Vec<&str> = line.split_whitespace().collect();
        let mut args = Args::new("multipath", &tokens);
        let spec = parse(&mut args).map_err(|e| e.to_string())?;
        args.finish().map_err(|e| e.to_string())?;
        Ok(spec)
    }

    /// Printed with the settings it was read with.
    fn print(spec: &Spec) -> String {
        spec.print(spec.features.queue_if_no_path, spec.initial_group)
    }

    #[test]
    fn lines_read_and_print_back_as_the_kernel_prints_them() {
        let cases = [
            // The kernel fills in every path's selector arguments.
            (
                "0 0 1 1 round-robin 0 2 0 a b",
                "0 0 1 1 round-robin 0 2 1 a 1 b 1",
            ),
            (
                "1 queue_if_no_path 0 2 2 round-robin 0 1 1 a 10 queue-length 0 2 1 b 1 c 2",
                "1 queue_if_no_path 0 2 2 round-robin 0 1 1 a 10 queue-length 0 2 1 b 1 c 2",
            ),
            (
                "0 0 1 1 service-time 0 2 2 a 1 50 b 1 0",
                "0 0 1 1 service-time 0 2 2 a 1 50 b 1 0",
            ),
            (
                "0 0 1 1 service-time 0 1 1 a 4",
                "0 0 1 1 service-time 0 1 2 a 4 1",
            ),
            // Features in any order and case come back in one order.
            (
                "7 PATH_TIMEOUT 2 checker_interval 1 no_path_retry 3 queue_if_no_path \
                 0 1 1 round-robin 0 1 1 nbd://h/x 1",
                "7 queue_if_no_path no_path_retry 3 checker_interval 1 path_timeout 2 \
                 0 1 1 round-robin 0 1 1 nbd://h/x 1",
            ),
            (
                "9 failback immediate path_timeout 2 checker_interval 1 no_path_retry 3 \
                 queue_if_no_path 0 1 1 round-robin 0 1 1 a 1",
                "9 queue_if_no_path no_path_retry 3 checker_interval 1 path_timeout 2 \
                 failback immediate 0 1 1 round-robin 0 1 1 a 1",
            ),
            (
                "2 failback manual 0 1 1 round-robin 0 1 1 a 1",
                "2 failback manual 0 1 1 round-robin 0 1 1 a 1",
            ),
            (
                "1 retain_attached_hw_handler 0 1 1 round-robin 0 1 1 a 1",
                "1 retain_attached_hw_handler 0 1 1 round-robin 0 1 1 a 1",
            ),
            // historical-service-time's selector arguments, and its path argument printed 0.
            (
                "0 0 1 1 historical-service-time 0 2 1 a 3 b 1",
                "0 0 1 1 historical-service-time 2 972 0 2 1 a 0 b 0",
            ),
            (
                "0 0 1 1 historical-service-time 2 512 2 1 0 a",
                "0 0 1 1 historical-service-time 2 512 2 1 1 a 0",
            ),
            // No groups at all: the kernel accepts it (every request queues or fails).
            ("0 0 0 0", "0 0 0 0"),
        ];
        for (line, printed) in cases {
            let spec = read(line).unwrap_or_else(|e| panic!("{line}: {e}"));
            assert_eq!(print(&spec), printed, "{line}");
            // What is printed reads back as the same line.
            let again = read(printed).unwrap();
            assert_eq!(again, spec, "{printed}");
            assert_eq!(print(&again), printed);
        }
    }

    #[test]
    fn the_printed_line_carries_the_live_queueing_and_group() {
        let spec =
            read("1 queue_if_no_path 0 2 1 round-robin 0 1 1 a 1 round-robin 0 1 1 b 1").unwrap();
        assert_eq!(
            spec.print(false, 2),
            "0 0 2 2 round-robin 0 1 1 a 1 round-robin 0 1 1 b 1"
        );
    }

    /// Long on purpose: one table of hostile lines and the words each refusal must contain,
    /// read top to bottom; split, it would only scatter the table.
    #[test]
    fn hostile_lines_are_refused_naming_what_is_wrong() {
        let cases = [
            ("", "missing argument <#features>"),
            (
                "1",
                "<#features>: 1 announced but only 0 argument(s) follow",
            ),
            ("12 a b c d e f g h i j k l 0 0 0", "invalid <#features> 12"),
            (
                "2 failback soon 0 0 0",
                "invalid <failback> 'soon': immediate or manual",
            ),
            ("1 failback 0 0 0", "'failback' needs a value within"),
            (
                "1 no_path_retry 0 0 0",
                "'no_path_retry' needs a value within",
            ),
            ("2 no_path_retry x 0 0 0", "invalid <no_path_retry> 'x'"),
            ("2 queue_if_no_path queue_if_no_path 0 0 0", "given twice"),
            (
                "1 frobnicate 0 0 0",
                "unknown feature 'frobnicate' (known: queue_if_no_path",
            ),
            ("2 checker_interval 0 0 0 0", "invalid <checker_interval> 0"),
            (
                "0 1 alua 1 1 round-robin 0 1 1 a 1",
                "hardware handler 'alua' is not supported",
            ),
            ("0 2 emc", "<#hw handler args>: 2 announced but only 1"),
            ("0 0 1 0 round-robin 0 1 1 a 1", "invalid <initial group> 0"),
            (
                "0 0 0 1",
                "invalid <initial group> 1: with 0 priority group(s) it must be 0",
            ),
            ("0 0 1 2 round-robin 0 1 1 a 1", "must be between 1 and 1"),
            ("0 0 1025 1", "invalid <#priority groups> 1025"),
            // Counts that do not match what follows.
            (
                "0 0 2 1 round-robin 0 1 1 a 1",
                "priority group 2: missing argument <selector>",
            ),
            (
                "0 0 1 1 round-robin 0 1 1 a 1 round-robin 0 1 1 b 1",
                "unexpected argument 'round-robin'",
            ),
            (
                "0 0 1 1 round-robin 0 3 1 a 1 b 1",
                "priority group 1: missing argument <path 3 of 3>",
            ),
            (
                "0 0 1 1 round-robin 0 2 1 a 1 b",
                "<#path args> of path 'b': 1 announced but only 0",
            ),
            (
                "0 0 1 1 round-robin 0 1 2 a 1",
                "<#path args> of path 'a': 2 announced but only 1",
            ),
            // A group with no path, an unknown selector, selector arguments.
            (
                "0 0 1 1 round-robin 0 0 0",
                "invalid <#paths> 0: must be between 1 and 1024",
            ),
            (
                "0 0 1 1 least-pending 0 1 0 a",
                "unknown path selector 'least-pending' (known: round-robin",
            ),
            (
                "0 0 1 1 historical-service-time 1 2000 1 0 a",
                "priority group 1: historical-service-time: invalid <base_weight> 2000",
            ),
            (
                "0 0 1 1 round-robin 1 x 1 0 a",
                "round-robin takes no selector arguments",
            ),
            (
                "0 0 1 1 round-robin 0 1 2 a 1 2",
                "path 'a': round-robin: a path takes at most 1 argument(s), 2 given",
            ),
            (
                "0 0 1 1 round-robin 0 1 1 a 0",
                "path 'a': round-robin: invalid <repeat_count> 0",
            ),
            (
                "0 0 1 1 round-robin 0 99999999999999999999 0 a",
                "invalid <#paths> '99999999999999999999': expected a number",
            ),
        ];
        for (line, expected) in cases {
            let err = read(line)
                .err()
                .unwrap_or_else(|| panic!("accepted {line:?}"));
            assert!(err.contains(expected), "{line:?}: got {err:?}");
            assert!(err.starts_with("multipath: "), "{line:?}: got {err:?}");
        }
    }
}
