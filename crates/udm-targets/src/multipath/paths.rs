//! Paths, priority groups and their state: which paths are usable and how often each failed,
//! which groups are bypassed (`disable_group`), which group I/O goes to. Choosing a path is
//! the kernel's `choose_pgpath`: a group named by `switch_group` (or the initial group) first,
//! then the current group while it has a usable path, then the first group in table order that
//! has one, bypassed groups last. Like the kernel, a group is not failed back to when its
//! paths return while another serves (that is `switch_group`'s job), unless the table asks for
//! multipathd's `failback immediate`.

use std::ops::Range;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use udm_block::BlockDevice;

use super::selector::{Candidate, Cursor, Load, PathArgs, Selector};

pub(super) struct Path {
    pub reference: String,
    pub dev: Arc<dyn BlockDevice>,
    pub args: PathArgs,
    pub load: Arc<Load>,
    /// Took writes since the last flush: the next flush must reach it.
    pub dirty: AtomicBool,
    /// The checker found it leading to another device (said once until it no longer does).
    pub elsewhere: AtomicBool,
}

pub(super) struct Group {
    pub selector: Selector,
    /// Its paths' indexes.
    pub paths: Range<usize>,
}

/// What a request that finds no usable path does.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum NoPath {
    Fail,
    /// Waits for a path, until the instant if there is one.
    Wait(Option<Instant>),
    /// Goes back to the device, to run again after its resume (a noflush suspend).
    PushBack,
}

/// A suspend under way, from its presuspend to the next resume: nothing waits for a path
/// then, so that the suspend never waits forever. The kernel's presuspend turns queueing off
/// the same way, and a noflush suspend pushes what would have waited back to the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Suspending {
    No,
    FailingWaiters,
    PushingWaitersBack,
}

pub(super) struct State {
    usable: Vec<bool>,
    fail_counts: Vec<u32>,
    usable_count: usize,
    bypassed: Vec<bool>,
    cursors: Vec<Cursor>,
    current: Option<usize>,
    /// Chosen from first at the next request: the initial group, or `switch_group`'s.
    next: Option<usize>,
    /// Since when no path has been usable (the start of `no_path_retry`'s count).
    no_path_since: Option<Instant>,
    /// Requests wait for a path while none is usable: the feature, or the message last sent.
    pub queue_if_no_path: bool,
    pub suspending: Suspending,
    /// The target is going away: the checker stops.
    pub stopping: bool,
    /// Requests waiting for a path.
    pub waiting: usize,
}

impl State {
    /// Every path usable; `initial_group` is 1-based (0: no groups).
    pub fn new(paths: usize, groups: usize, initial_group: usize, queue_if_no_path: bool) -> State {
        State {
            usable: vec![true; paths],
            fail_counts: vec![0; paths],
            usable_count: paths,
            bypassed: vec![false; groups],
            cursors: vec![Cursor::default(); groups],
            current: None,
            next: initial_group.checked_sub(1),
            no_path_since: (paths == 0).then(Instant::now),
            queue_if_no_path,
            suspending: Suspending::No,
            stopping: false,
            waiting: 0,
        }
    }

    /// The path for a request of `bytes`; `None` when no path is usable.
    pub fn choose(&mut self, paths: &[Path], groups: &[Group], bytes: u64) -> Option<usize> {
        if self.usable_count == 0 {
            self.current = None;
            return None;
        }
        if let Some(g) = self.next.take() {
            if let Some(path) = self.choose_in(g, paths, groups, bytes) {
                self.current = Some(g);
                return Some(path);
            }
        }
        if let Some(g) = self.current {
            if let Some(path) = self.choose_in(g, paths, groups, bytes) {
                return Some(path);
            }
        }
        for bypassed in [false, true] {
            for g in 0..groups.len() {
                if self.bypassed[g] != bypassed {
                    continue;
                }
                if let Some(path) = self.choose_in(g, paths, groups, bytes) {
                    self.current = Some(g);
                    return Some(path);
                }
            }
        }
        self.current = None;
        None
    }

    fn choose_in(
        &mut self,
        g: usize,
        paths: &[Path],
        groups: &[Group],
        bytes: u64,
    ) -> Option<usize> {
        let range = groups[g].paths.clone();
        let usable = &self.usable;
        let candidate = |i: usize| {
            let p = range.start + i;
            Candidate {
                usable: usable[p],
                args: &paths[p].args,
                load: &paths[p].load,
            }
        };
        groups[g]
            .selector
            .pick(range.len(), candidate, &mut self.cursors[g], bytes)
            .map(|i| range.start + i)
    }

    /// Takes a path out of use; false if it already was.
    pub fn fail(&mut self, path: usize) -> bool {
        if !std::mem::replace(&mut self.usable[path], false) {
            return false;
        }
        self.fail_counts[path] += 1;
        self.usable_count -= 1;
        if self.usable_count == 0 {
            self.no_path_since = Some(Instant::now());
        }
        true
    }

    /// Puts a path back in use; false if it already was.
    pub fn reinstate(&mut self, path: usize) -> bool {
        if std::mem::replace(&mut self.usable[path], true) {
            return false;
        }
        self.usable_count += 1;
        self.no_path_since = None;
        true
    }

    /// multipathd's `failback immediate`, after a path is reinstated: I/O goes to the first
    /// group in table order that is not bypassed and has a usable path, if it goes elsewhere.
    /// True if it moves.
    pub fn fail_back(&mut self, groups: &[Group]) -> bool {
        let best = (0..groups.len())
            .find(|&g| !self.bypassed[g] && groups[g].paths.clone().any(|p| self.usable[p]));
        match best {
            Some(g) if self.next.or(self.current) != Some(g) => {
                self.current = None;
                self.next = Some(g);
                true
            }
            _ => false,
        }
    }

    /// `switch_group`: the next request goes to `group` if it has a usable path; every group
    /// stops being bypassed.
    pub fn switch_group(&mut self, group: usize) {
        self.bypassed.fill(false);
        self.current = None;
        self.next = Some(group);
    }

    /// `disable_group` / `enable_group`: a bypassed group is used only when no other group
    /// has a usable path (also when it was to be chosen next, where the kernel would still
    /// send it the next request).
    pub fn bypass(&mut self, group: usize, bypassed: bool) {
        self.bypassed[group] = bypassed;
        self.current = None;
        if bypassed && self.next == Some(group) {
            self.next = None;
        }
    }

    pub fn is_usable(&self, path: usize) -> bool {
        self.usable[path]
    }

    pub fn fail_count(&self, path: usize) -> u32 {
        self.fail_counts[path]
    }

    pub fn has_usable_path(&self) -> bool {
        self.usable_count > 0
    }

    pub fn usable_count(&self) -> usize {
        self.usable_count
    }

    /// The status letter of a group: D bypassed, A current, E enabled.
    pub fn group_state(&self, group: usize) -> char {
        if self.bypassed[group] {
            'D'
        } else if self.current == Some(group) {
            'A'
        } else {
            'E'
        }
    }

    /// The group number the status and table lines print (1-based): the one chosen next,
    /// else the current one, else 1 (0 with no groups).
    pub fn group_number(&self) -> usize {
        match self.next.or(self.current) {
            Some(g) => g + 1,
            None => usize::from(!self.bypassed.is_empty()),
        }
    }

    /// What a request that finds no usable path does: fail unless queueing, and with
    /// `no_path_retry` wait only until that many checker intervals have passed since the last
    /// path failed (then fail at once until a path is back, as multipathd turns queueing off).
    /// During a noflush suspend the request goes back to the device, queueing or not, as the
    /// kernel's `must_push_back_bio` says.
    pub fn when_no_path(&self, no_path_retry: Option<u32>, interval: Duration) -> NoPath {
        match self.suspending {
            _ if self.stopping => return NoPath::Fail,
            Suspending::PushingWaitersBack => return NoPath::PushBack,
            Suspending::FailingWaiters => return NoPath::Fail,
            Suspending::No if !self.queue_if_no_path => return NoPath::Fail,
            Suspending::No => {}
        }
        let Some(retries) = no_path_retry else {
            return NoPath::Wait(None);
        };
        let since = self.no_path_since.unwrap_or_else(Instant::now);
        let end = since + interval * retries;
        if Instant::now() >= end {
            NoPath::Fail
        } else {
            NoPath::Wait(Some(end))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use udm_block::MemoryDevice;

    /// Groups of the given sizes, round-robin, over memory devices.
    fn topology(sizes: &[usize]) -> (Vec<Path>, Vec<Group>) {
        let mut paths = Vec::new();
        let mut groups = Vec::new();
        for (g, &n) in sizes.iter().enumerate() {
            let first = paths.len();
            for i in 0..n {
                paths.push(Path {
                    reference: format!("g{g}p{i}"),
                    dev: Arc::new(MemoryDevice::new(4096)),
                    args: PathArgs::default(),
                    load: Arc::default(),
                    dirty: AtomicBool::new(false),
                    elsewhere: AtomicBool::new(false),
                });
            }
            groups.push(Group {
                selector: Selector::RoundRobin,
                paths: first..paths.len(),
            });
        }
        (paths, groups)
    }

    #[test]
    fn io_stays_in_a_group_until_it_has_no_path_then_fails_over_in_table_order() {
        let (paths, groups) = topology(&[2, 1, 1]);
        let mut st = State::new(4, 3, 1, false);
        let choose = |st: &mut State| st.choose(&paths, &groups, 4096);
        assert_eq!((choose(&mut st), choose(&mut st)), (Some(0), Some(1)));
        assert_eq!((st.group_state(0), st.group_state(1)), ('A', 'E'));
        assert!(st.fail(0) && !st.fail(0));
        assert_eq!((choose(&mut st), choose(&mut st)), (Some(1), Some(1)));
        st.fail(1);
        assert_eq!(choose(&mut st), Some(2));
        assert_eq!(
            (st.group_state(0), st.group_state(1), st.group_number()),
            ('E', 'A', 2)
        );
        // Group 1's path returns: no failback while group 2 serves.
        st.reinstate(0);
        assert_eq!(choose(&mut st), Some(2));
        // switch_group does it.
        st.switch_group(0);
        assert_eq!(st.group_number(), 1);
        assert_eq!(choose(&mut st), Some(0));
        assert_eq!(
            (st.fail_count(0), st.fail_count(1), st.fail_count(2)),
            (1, 1, 0)
        );
    }

    #[test]
    fn failback_moves_io_to_the_first_group_with_a_usable_path() {
        let (paths, groups) = topology(&[1, 1, 1]);
        let mut st = State::new(3, 3, 1, false);
        let choose = |st: &mut State| st.choose(&paths, &groups, 4096);
        st.fail(0);
        st.fail(1);
        assert_eq!(choose(&mut st), Some(2));
        assert!(!st.fail_back(&groups), "already on the only usable group");
        st.reinstate(1);
        assert!(st.fail_back(&groups));
        assert_eq!((choose(&mut st), st.group_number()), (Some(1), 2));
        // A bypassed group is not failed back to.
        st.reinstate(0);
        st.bypass(0, true);
        st.fail_back(&groups);
        assert_eq!(choose(&mut st), Some(1));
        st.bypass(0, false);
        assert!(st.fail_back(&groups));
        assert_eq!(choose(&mut st), Some(0));
    }

    #[test]
    fn a_bypassed_group_is_the_last_resort() {
        let (paths, groups) = topology(&[1, 1]);
        let mut st = State::new(2, 2, 1, false);
        st.bypass(0, true);
        assert_eq!(st.choose(&paths, &groups, 512), Some(1));
        assert_eq!((st.group_state(0), st.group_state(1)), ('D', 'A'));
        st.fail(1);
        assert_eq!(st.choose(&paths, &groups, 512), Some(0));
        st.bypass(0, false);
        assert_eq!(st.group_state(0), 'E');
        // switch_group to a group without a usable path falls through to one that has one.
        st.reinstate(1);
        st.fail(0);
        st.switch_group(0);
        assert_eq!(st.choose(&paths, &groups, 512), Some(1));
    }

    #[test]
    fn with_no_path_requests_fail_or_wait_as_long_as_no_path_retry_allows() {
        let (paths, groups) = topology(&[1]);
        let mut st = State::new(1, 1, 1, true);
        let interval = Duration::from_millis(100);
        st.fail(0);
        assert_eq!(st.choose(&paths, &groups, 512), None);
        assert_eq!(st.when_no_path(None, interval), NoPath::Wait(None));
        let NoPath::Wait(Some(end)) = st.when_no_path(Some(2), interval) else {
            panic!("no bound")
        };
        assert!(end > Instant::now() + Duration::from_millis(150));
        assert_eq!(st.when_no_path(Some(0), interval), NoPath::Fail);
        std::thread::sleep(Duration::from_millis(210));
        assert_eq!(st.when_no_path(Some(2), interval), NoPath::Fail);
        // A path back starts the count over.
        st.reinstate(0);
        st.fail(0);
        assert!(matches!(
            st.when_no_path(Some(2), interval),
            NoPath::Wait(Some(_))
        ));
        st.suspending = Suspending::FailingWaiters;
        assert_eq!(st.when_no_path(None, interval), NoPath::Fail);
        st.suspending = Suspending::PushingWaitersBack;
        assert_eq!(st.when_no_path(None, interval), NoPath::PushBack);
        st.suspending = Suspending::No;
        st.queue_if_no_path = false;
        assert_eq!(st.when_no_path(None, interval), NoPath::Fail);
        // A noflush suspend pushes back without queueing too.
        st.suspending = Suspending::PushingWaitersBack;
        assert_eq!(st.when_no_path(None, interval), NoPath::PushBack);
    }

    #[test]
    fn no_groups_means_no_path_from_the_start() {
        let mut st = State::new(0, 0, 0, false);
        assert_eq!(st.choose(&[], &[], 512), None);
        assert_eq!(st.group_number(), 0);
        assert!(!st.has_usable_path());
    }
}
