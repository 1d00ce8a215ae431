//! The coordinator's periodic work as one table of deadlines: the shell asks
//! which timers are due at the time it passes in, and sleeps until the
//! earliest. No clock is read here, so every cadence is tested with made-up
//! instants.

use std::time::{Duration, Instant};

/// The coordinator's timers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timer {
    /// Store news, ranks' timeouts, starters, the lease: checked together
    /// (their bounds are seconds; checking on every message would cost O(N)).
    Chores,
    /// The workers' leases in the store are written again.
    WorkerLeases,
    /// The job's progress is written to the store again although no commit
    /// asked for it.
    SaveState,
    /// The teacher processes this job started are looked at.
    TeacherCheck,
}

const TIMERS: usize = 4;

impl Timer {
    fn slot(self) -> usize {
        match self {
            Timer::Chores => 0,
            Timer::WorkerLeases => 1,
            Timer::SaveState => 2,
            Timer::TeacherCheck => 3,
        }
    }
}

/// A deadline per [`Timer`], each set or not.
#[derive(Clone, Debug, Default)]
pub struct TimerTable {
    deadlines: [Option<Instant>; TIMERS],
}

impl TimerTable {
    /// Every timer set to fire `every` after `now`.
    pub fn every(now: Instant, every: &[(Timer, Duration)]) -> Self {
        let mut table = TimerTable::default();
        for &(timer, period) in every {
            table.set(timer, now + period);
        }
        table
    }

    /// Sets `timer` to fire at `at`, replacing its deadline.
    pub fn set(&mut self, timer: Timer, at: Instant) {
        self.deadlines[timer.slot()] = Some(at);
    }

    /// Unsets `timer`.
    pub fn stop(&mut self, timer: Timer) {
        self.deadlines[timer.slot()] = None;
    }

    /// When `timer` fires, if it is set.
    pub fn get(&self, timer: Timer) -> Option<Instant> {
        self.deadlines[timer.slot()]
    }

    /// Whether `timer` is set and its deadline is not after `now`.
    pub fn is_due(&self, timer: Timer, now: Instant) -> bool {
        self.get(timer).is_some_and(|at| at <= now)
    }

    /// Whether `timer` is due; if so it is set again `period` after `now`.
    pub fn fire(&mut self, timer: Timer, now: Instant, period: Duration) -> bool {
        let due = self.is_due(timer, now);
        if due {
            self.set(timer, now + period);
        }
        due
    }

    /// The earliest deadline of all the timers set.
    pub fn next_timeout(&self) -> Option<Instant> {
        self.deadlines.iter().flatten().min().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: Duration = Duration::from_secs(1);

    #[test]
    fn a_timer_fires_once_at_its_deadline_and_again_a_period_later() {
        let t0 = Instant::now();
        let mut table = TimerTable::every(t0, &[(Timer::SaveState, SEC)]);
        assert!(!table.fire(Timer::SaveState, t0 + SEC / 2, SEC), "not yet");
        assert!(table.fire(Timer::SaveState, t0 + SEC, SEC), "at its deadline");
        assert!(!table.fire(Timer::SaveState, t0 + SEC, SEC), "once");
        assert_eq!(table.get(Timer::SaveState), Some(t0 + 2 * SEC));
        assert!(!table.is_due(Timer::TeacherCheck, t0 + 10 * SEC), "an unset timer is never due");
    }

    #[test]
    fn the_next_timeout_is_the_earliest_set_deadline() {
        let t0 = Instant::now();
        let mut table = TimerTable::every(t0, &[(Timer::Chores, SEC / 4), (Timer::WorkerLeases, SEC)]);
        assert_eq!(table.next_timeout(), Some(t0 + SEC / 4));
        table.stop(Timer::Chores);
        assert_eq!(table.next_timeout(), Some(t0 + SEC));
        table.set(Timer::TeacherCheck, t0 + SEC / 2);
        assert_eq!(table.next_timeout(), Some(t0 + SEC / 2));
        table.stop(Timer::TeacherCheck);
        table.stop(Timer::WorkerLeases);
        assert_eq!(table.next_timeout(), None);
    }
}
