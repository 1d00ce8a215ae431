//! The step barrier of one generation, without I/O: windows of steps
//! issued ahead, the ranks' reports coming back, commits and failures out,
//! every timeout inside.
//!
//! While membership is stable the coordinator is off the step's path: it
//! sends every rank the next window of steps before the current one ends,
//! and the ranks report each window when they finish it. A window is
//! committed when every rank of the generation has reported all of it, in
//! order; a failure (a rank's error, a closed connection, a rank silent
//! past the step timeout) commits nothing more, and settles once every rank
//! that still owed a report has answered or is gone. The survivors then go
//! back to the end of the last committed window.

use crate::control::proto::{FailCause, StepDone, StepPlan};
use std::{
    collections::{BTreeSet, VecDeque},
    time::{Duration, Instant},
};

/// A rank's position in the generation (0-based).
pub type Rank = usize;

/// A window whose every step every rank finished.
#[derive(Debug, PartialEq)]
pub struct Committed {
    pub steps: Vec<StepPlan>,
    /// Each report's rank and its account of each step, in step order: one
    /// a rank, or one for a host's ranks that reported together (their
    /// relay summed their accounts), under the first of them.
    pub reports: Vec<(Rank, Vec<StepDone>)>,
    /// The slowest rank's set-up (first window of a generation), ms.
    pub setup_ms: f64,
}

/// Why the generation cannot go on.
#[derive(Debug, Default, PartialEq)]
pub struct Failure {
    /// Ranks that are gone (connection closed, or silent and given up).
    pub dead: BTreeSet<Rank>,
    pub errors: Vec<String>,
    /// Why a rank failed, where another generation cannot help: no teacher
    /// answered within the job's teacher wait, or the program's state does
    /// not fit the job's.
    pub cause: Option<FailCause>,
    /// The first step not committed.
    pub step: u64,
    /// Steps that were sent and are dropped (the failed one included).
    pub dropped: usize,
    /// Ranks that failed because no teacher answered them.
    pub no_teachers: BTreeSet<Rank>,
    /// When the last window before it was complete (or the generation
    /// began), and when the first sign of it came: the time without a
    /// commit starts at the one; detection took the time between.
    pub quiet_since: Option<Instant>,
    pub first_sign: Option<Instant>,
}

#[derive(Debug)]
struct Window {
    steps: Vec<StepPlan>,
    /// Per rank: its report of this window.
    reported: Vec<Option<Vec<StepDone>>>,
    /// Ranks that have not reported it.
    missing: usize,
}

/// The step barrier of one generation.
#[derive(Debug)]
pub struct Pipeline {
    pub generation: u64,
    world: usize,
    /// Each rank's name in errors (`worker 3 (pid 1234)`).
    names: Vec<String>,
    timeout: Duration,
    /// Issued and not committed, oldest first.
    windows: VecDeque<Window>,
    /// Per rank: when it last reported, or was given work while idle.
    heard: Vec<Instant>,
    /// Per rank: windows issued that it has not reported.
    owed: Vec<usize>,
    setup_ms: f64,
    failure: Option<Failure>,
    /// Per rank: it answered the failure (reported its own error or is gone).
    settled: BTreeSet<Rank>,
    /// The first step not issued yet.
    next_step: u64,
    committed_any: bool,
    /// When the last window was complete (every rank reported it), or the
    /// generation began.
    last_complete: Instant,
}

impl Pipeline {
    /// A generation of ranks (named in rank order) starting at committed
    /// step `step`; a rank with work that reports nothing for `timeout` is
    /// declared dead.
    pub fn new(generation: u64, names: Vec<String>, step: u64, now: Instant, timeout: Duration) -> Self {
        let world = names.len();
        Pipeline {
            generation,
            world,
            names,
            timeout,
            windows: VecDeque::new(),
            heard: vec![now; world],
            owed: vec![0; world],
            setup_ms: 0.0,
            failure: None,
            settled: BTreeSet::new(),
            next_step: step,
            committed_any: false,
            last_complete: now,
        }
    }

    /// Steps issued and not committed.
    pub fn in_flight(&self) -> usize {
        self.windows.iter().map(|w| w.steps.len()).sum()
    }

    /// Windows issued and not committed.
    pub fn windows(&self) -> usize {
        self.windows.len()
    }

    /// Whether any window was issued in this generation.
    pub fn started(&self) -> bool {
        self.committed_any || !self.windows.is_empty()
    }

    pub fn committed_any(&self) -> bool {
        self.committed_any
    }

    pub fn failed(&self) -> bool {
        self.failure.is_some()
    }

    /// Records a window sent to every rank. Steps must follow on from the
    /// last window's.
    pub fn issue(&mut self, now: Instant, steps: Vec<StepPlan>) {
        debug_assert_eq!(steps.first().map(|s| s.step), Some(self.next_step));
        for r in 0..self.world {
            if self.owed[r] == 0 {
                // An idle rank's clock starts with its new work.
                self.heard[r] = now;
            }
            self.owed[r] += 1;
        }
        self.next_step += steps.len() as u64;
        self.windows.push_back(Window { steps, reported: vec![None; self.world], missing: self.world });
    }

    /// A rank reported a window. It must be the oldest it has not reported,
    /// step for step; anything else is a protocol error that fails the rank.
    /// Reports still count after a failure: a window every rank finished
    /// commits whatever happened later.
    pub fn report(&mut self, now: Instant, rank: Rank, steps: Vec<StepDone>, setup_ms: f64) {
        self.report_group(now, &[rank], steps, setup_ms);
    }

    /// A host's ranks reported a window together, their accounts summed
    /// into `steps` by their relay: as if each reported it (the account is
    /// kept once, under the first).
    pub fn report_group(&mut self, now: Instant, ranks: &[Rank], steps: Vec<StepDone>, setup_ms: f64) {
        if ranks.iter().any(|&r| r >= self.world) {
            return;
        }
        self.setup_ms = self.setup_ms.max(setup_ms);
        let shape: Vec<(u64, u64)> = steps.iter().map(|d| (d.step, d.epoch)).collect();
        let mut steps = Some(steps);
        for &rank in ranks {
            self.heard[rank] = now;
            let Some(w) = self.windows.iter_mut().find(|w| w.reported[rank].is_none()) else {
                self.fail(now, rank, "reported steps that were not issued".into(), None);
                continue;
            };
            let matches = w.steps.len() == shape.len()
                && w.steps.iter().zip(&shape).all(|(p, &(step, epoch))| p.step == step && p.epoch == epoch);
            if !matches {
                let want = (w.steps[0].step, w.steps.len());
                self.fail(
                    now,
                    rank,
                    format!("reported other steps than window {} (+{})", want.0, want.1),
                    None,
                );
                continue;
            }
            w.reported[rank] = Some(steps.take().unwrap_or_default());
            w.missing -= 1;
            if w.missing == 0 {
                self.last_complete = now;
            }
            self.owed[rank] -= 1;
        }
    }

    /// A rank failed a step (its error), or broke the protocol.
    pub fn fail(&mut self, now: Instant, rank: Rank, error: String, cause: Option<FailCause>) {
        let text = format!("{}: {error}", self.name(rank));
        self.record(now, rank, text, cause);
    }

    fn name(&self, rank: Rank) -> String {
        self.names.get(rank).cloned().unwrap_or_else(|| format!("rank {rank}"))
    }

    fn record(&mut self, now: Instant, rank: Rank, text: String, cause: Option<FailCause>) {
        let quiet_since = self.last_complete;
        let f = self.failure.get_or_insert_with(|| Failure {
            quiet_since: Some(quiet_since),
            first_sign: Some(now),
            ..Failure::default()
        });
        f.errors.push(text);
        f.cause = f.cause.or(cause);
        if cause == Some(FailCause::NoTeachers) {
            f.no_teachers.insert(rank);
        }
        self.settled.insert(rank);
    }

    /// A rank is gone (its connection closed: `why`).
    pub fn lost(&mut self, now: Instant, rank: Rank, why: &str) {
        let text = format!("{} lost: {why}", self.name(rank));
        self.record(now, rank, text, None);
        if let Some(f) = self.failure.as_mut() {
            f.dead.insert(rank);
        }
    }

    fn first_uncommitted(&self) -> u64 {
        self.windows.front().map(|w| w.steps[0].step).unwrap_or(self.next_step)
    }

    /// When the next rank's time runs out, if any rank owes a report.
    pub fn poll_timeout(&self) -> Option<Instant> {
        (0..self.world).filter(|&r| self.waiting_on(r)).map(|r| self.heard[r] + self.timeout).min()
    }

    /// Whether the pipeline is waiting for `rank`.
    fn waiting_on(&self, rank: Rank) -> bool {
        self.owed[rank] > 0 && (self.failure.is_none() || !self.settled.contains(&rank))
    }

    /// Declares dead every rank with work that reported nothing within
    /// the timeout; returns them (the caller stops their processes).
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<Rank> {
        let late: Vec<Rank> =
            (0..self.world).filter(|&r| self.waiting_on(r) && now >= self.heard[r] + self.timeout).collect();
        for &r in &late {
            let text = format!("{} answered nothing within {:?}; stopping it", self.name(r), self.timeout);
            self.record(now, r, text, None);
            if let Some(f) = self.failure.as_mut() {
                f.dead.insert(r);
            }
        }
        late
    }

    /// The oldest window, once every rank reported it (and no failure came
    /// first: windows reported in full before a failure still commit).
    pub fn poll_commit(&mut self) -> Option<Committed> {
        if self.windows.front()?.missing > 0 {
            return None;
        }
        let w = self.windows.pop_front()?;
        self.committed_any = true;
        Some(Committed {
            steps: w.steps,
            // The ranks whose account a host's report holds are left out.
            reports: w
                .reported
                .into_iter()
                .enumerate()
                .filter_map(|(rank, got)| got.filter(|g| !g.is_empty()).map(|g| (rank, g)))
                .collect(),
            setup_ms: std::mem::take(&mut self.setup_ms),
        })
    }

    /// Once failed, the failure when every rank that owed a report has
    /// answered, is gone, or timed out (nothing more can commit).
    pub fn settled_failure(&mut self) -> Option<Failure> {
        self.failure.as_ref()?;
        let open = (0..self.world).any(|r| self.waiting_on(r));
        // Windows every rank reported before the failure are committed first.
        let committable = self.windows.front().is_some_and(|w| w.missing == 0);
        if open || committable {
            return None;
        }
        let step = self.first_uncommitted();
        let dropped = self.in_flight();
        let mut f = self.failure.take()?;
        // Teachers that answered another rank in the failed window are
        // there: a rank that reached none is at fault (its host or its
        // network), and is replaced, not the job ended.
        let others_reached = self.windows.front().is_some_and(|w| {
            w.reported.iter().enumerate().any(|(r, got)| got.is_some() && !f.no_teachers.contains(&r))
        });
        if f.cause == Some(FailCause::NoTeachers) && others_reached {
            f.cause = None;
            for &r in &f.no_teachers {
                f.dead.insert(r);
                f.errors.push(format!("{} reached no teacher while others did; replacing it", self.name(r)));
            }
        }
        Some(Failure { step, dropped, ..f })
    }

    /// The first step issued and not committed, if any.
    pub fn next_planned(&self) -> Option<StepPlan> {
        self.windows.front().map(|w| w.steps[0])
    }

    /// Nothing issued is waiting to commit.
    pub fn drained(&self) -> bool {
        self.windows.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use edl_plugin_sdk::Hyperparams;

    const T: Duration = Duration::from_secs(10);

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|r| format!("worker {}", r + 1)).collect()
    }

    fn plan(from: u64, n: u64) -> Vec<StepPlan> {
        let hyper = Hyperparams { global_batch: 4, local_batch: 2, lr: 0.1, momentum: 0.9 };
        (from..from + n).map(|s| StepPlan { step: s, epoch: 0, cursor: 4 * s as usize, hyper }).collect()
    }

    fn done(rank: usize, steps: &[StepPlan]) -> Vec<StepDone> {
        steps
            .iter()
            .map(|s| {
                let start = (s.cursor + 2 * rank) as u32;
                StepDone::plain(s.step, s.epoch, start, start + 2, 0.5, 1.0)
            })
            .collect()
    }

    #[test]
    fn windows_commit_in_order_once_every_rank_reported_them() {
        let t0 = Instant::now();
        let mut p = Pipeline::new(1, names(2), 0, t0, T);
        let (a, b) = (plan(0, 1), plan(1, 8));
        p.issue(t0, a.clone());
        p.issue(t0, b.clone());
        assert_eq!(p.in_flight(), 9);
        // Rank 0 runs ahead: both its windows are in; nothing commits yet.
        p.report(t0, 0, done(0, &a), 3.0);
        p.report(t0, 0, done(0, &b), 0.0);
        assert_eq!(p.poll_commit(), None);
        p.report(t0, 1, done(1, &a), 5.0);
        let c = p.poll_commit().expect("window 0 commits");
        assert_eq!((c.steps, c.setup_ms), (a.clone(), 5.0));
        assert_eq!(c.reports, vec![(0, done(0, &a)), (1, done(1, &a))]);
        assert_eq!(p.poll_commit(), None, "window 1 waits for rank 1");
        p.report(t0, 1, done(1, &b), 0.0);
        assert_eq!(p.poll_commit().unwrap().steps, b);
        assert!(p.drained() && p.committed_any());
        assert_eq!(p.settled_failure(), None);
    }

    #[test]
    fn a_host_s_ranks_reporting_together_count_as_each_reporting() {
        let t0 = Instant::now();
        let mut p = Pipeline::new(1, names(4), 0, t0, T);
        let a = plan(0, 3);
        p.issue(t0, a.clone());
        // Ranks 1..4 on one host, their accounts summed by its relay.
        p.report_group(t0, &[1, 2, 3], done(1, &a), 2.0);
        assert_eq!(p.poll_commit(), None, "rank 0 has not reported");
        p.report(t0, 0, done(0, &a), 1.0);
        let c = p.poll_commit().expect("every rank counted");
        assert_eq!(c.reports, vec![(0, done(0, &a)), (1, done(1, &a))], "the host's account once");
        assert_eq!(c.setup_ms, 2.0);
        // A host reporting steps it was not given fails each of its ranks.
        let b = plan(3, 2);
        p.issue(t0, b.clone());
        p.report_group(t0, &[2, 3], done(2, &plan(3, 1)), 0.0);
        assert!(p.failed());
    }

    #[test]
    fn a_failure_while_later_windows_are_out_commits_what_every_rank_finished() {
        let t0 = Instant::now();
        let mut p = Pipeline::new(3, names(3), 10, t0, T);
        let (a, b, c) = (plan(10, 1), plan(11, 4), plan(15, 4));
        for w in [&a, &b, &c] {
            p.issue(t0, w.clone());
        }
        for r in 0..3 {
            p.report(t0, r, done(r, &a), 0.0);
        }
        p.report(t0, 0, done(0, &b), 0.0);
        // Rank 2 dies during window b; rank 1 then fails in its all-reduce.
        p.lost(t0, 2, "connection closed");
        assert_eq!(p.poll_commit().unwrap().steps, a, "finished before the failure");
        assert_eq!(p.settled_failure(), None, "rank 1 owes an answer");
        p.report(t0, 1, done(1, &b), 0.0);
        assert_eq!(p.poll_commit(), None, "rank 2 never reported b");
        p.fail(t0, 1, "ring broke".into(), None);
        // Rank 0 reported b but still owes c: it must answer too.
        assert_eq!(p.settled_failure(), None);
        p.fail(t0, 0, "ring broke".into(), None);
        let f = p.settled_failure().expect("every rank answered");
        assert_eq!((f.step, f.dropped), (11, 8), "the survivors go back to step 11");
        assert_eq!(f.dead, BTreeSet::from([2]));
        assert_eq!(f.errors[0], "worker 3 lost: connection closed");
        assert_eq!(f.errors.len(), 3);
        assert_eq!(f.cause, None);
    }

    #[test]
    fn a_failure_says_when_the_last_window_was_complete_and_when_it_was_first_seen() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut p = Pipeline::new(1, names(2), 0, t0, T);
        let (a, b) = (plan(0, 2), plan(2, 2));
        p.issue(t0, a.clone());
        p.issue(t0, b.clone());
        p.report(at(5), 0, done(0, &a), 0.0);
        p.report(at(7), 1, done(1, &a), 0.0);
        p.report(at(9), 0, done(0, &b), 0.0);
        // Rank 1 dies in window b; rank 0 stays in its collective until
        // the dead rank's sockets close.
        p.lost(at(12), 1, "connection closed");
        p.fail(at(30), 0, "ring broke".into(), None);
        assert_eq!(p.poll_commit().unwrap().steps, a);
        let f = p.settled_failure().unwrap();
        assert_eq!(f.quiet_since, Some(at(7)), "window a was complete when rank 1 reported it");
        assert_eq!(f.first_sign, Some(at(12)), "the first sign, not the last answer");
    }

    #[test]
    fn a_silent_rank_is_given_up_after_the_timeout_counted_from_its_last_report() {
        let t0 = Instant::now();
        let mut p = Pipeline::new(1, names(2), 0, t0, T);
        assert_eq!(p.poll_timeout(), None, "nothing owed, no clock");
        let a = plan(0, 2);
        p.issue(t0, a.clone());
        assert_eq!(p.poll_timeout(), Some(t0 + T));
        let t1 = t0 + Duration::from_secs(6);
        p.report(t1, 0, done(0, &a), 0.0);
        assert_eq!(p.poll_timeout(), Some(t0 + T), "rank 1 still owes");
        assert!(p.handle_timeout(t0 + T - Duration::from_millis(1)).is_empty());
        // Rank 0 is idle: a new window starts its clock now, not at its last report.
        let t2 = t0 + Duration::from_secs(9);
        p.issue(t2, plan(2, 2));
        assert_eq!(p.handle_timeout(t0 + T), vec![1]);
        let f_pending = p.settled_failure();
        assert_eq!(f_pending, None, "rank 0 owes the new window");
        assert_eq!(p.handle_timeout(t2 + T), vec![0]);
        let f = p.settled_failure().unwrap();
        assert_eq!(f.dead, BTreeSet::from([0, 1]));
        assert_eq!(f.errors[0], "worker 2 answered nothing within 10s; stopping it");
    }

    #[test]
    fn reports_that_do_not_match_the_issued_window_fail_the_rank() {
        let t0 = Instant::now();
        let mut p = Pipeline::new(1, names(1), 0, t0, T);
        p.issue(t0, plan(0, 2));
        p.report(t0, 0, done(0, &plan(0, 1)), 0.0);
        let f = p.settled_failure().unwrap();
        assert_eq!(f.errors[0], "worker 1: reported other steps than window 0 (+2)");
        let mut p = Pipeline::new(1, names(1), 0, t0, T);
        p.report(t0, 0, done(0, &plan(0, 1)), 0.0);
        assert!(p.settled_failure().unwrap().errors[0].contains("not issued"));
    }

    #[test]
    fn no_teachers_is_carried_to_the_failure() {
        let t0 = Instant::now();
        let mut p = Pipeline::new(1, names(1), 0, t0, T);
        p.issue(t0, plan(0, 1));
        p.fail(t0, 0, "no teacher answered".into(), Some(FailCause::NoTeachers));
        assert_eq!(p.settled_failure().unwrap().cause, Some(FailCause::NoTeachers));
        // Every rank of a generation without teachers: the job's end.
        let mut p = Pipeline::new(2, names(2), 0, t0, T);
        p.issue(t0, plan(0, 2));
        p.fail(t0, 0, "no teacher answered".into(), Some(FailCause::NoTeachers));
        p.fail(t0, 1, "no teacher answered".into(), Some(FailCause::NoTeachers));
        assert_eq!(p.settled_failure().unwrap().cause, Some(FailCause::NoTeachers));
    }

    #[test]
    fn a_rank_that_reached_no_teacher_while_others_did_is_replaced_not_the_job_ended() {
        let t0 = Instant::now();
        let mut p = Pipeline::new(3, names(3), 0, t0, T);
        let a = plan(0, 3);
        p.issue(t0, a.clone());
        p.report(t0, 0, done(0, &a), 0.0);
        p.fail(t0, 1, "no teacher answered within 20s".into(), Some(FailCause::NoTeachers));
        p.fail(t0, 2, "ring broke".into(), None);
        let f = p.settled_failure().unwrap();
        assert_eq!(f.cause, None, "the teachers answered rank 0");
        assert_eq!(f.dead, BTreeSet::from([1]), "the rank that reached none goes");
        assert!(f.errors.last().unwrap().contains("reached no teacher while others did"), "{:?}", f.errors);
    }
}
