//! The job's phase, without I/O: it trains generations until the last
//! epoch is committed, then has the final checkpoint written; it decides
//! when failures end the job.
//!
//! A generation that fails is retried (the survivors form the next one)
//! unless no teacher answered (every worker reads from the same teachers:
//! another generation would fail the same) or generations have failed
//! [`MAX_FAILED_GENERATIONS`] times in a row without committing a step. The
//! final checkpoint gets [`MAX_FINAL_ATTEMPTS`] tries; a recovery that went
//! back to an earlier checkpoint (every worker lost) sends the job back to
//! training.

use crate::control::proto::FailCause;
use crate::coordinator::machine::pipeline::Failure;
use std::time::Duration;

/// Generations failed in a row, without a committed step, that end the job.
pub const MAX_FAILED_GENERATIONS: u32 = 5;
/// Tries at writing the final checkpoint.
pub const MAX_FINAL_ATTEMPTS: u32 = 3;

/// What the job does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Train the next generation. `again`: the final state was lost and the
    /// job goes back to training from an earlier checkpoint.
    Train { again: bool },
    /// Every epoch is committed: have the final checkpoint written.
    /// `entering`: the first time (no new workers are admitted from now on).
    Finish { entering: bool },
}

/// The job's phase and its failure counts.
#[derive(Debug)]
pub struct JobPhase {
    epochs: u64,
    finishing: bool,
    failures: u32,
    final_attempts: u32,
    teacher_wait: Duration,
}

impl JobPhase {
    pub fn new(epochs: u64, teacher_wait: Duration) -> Self {
        JobPhase { epochs, finishing: false, failures: 0, final_attempts: 0, teacher_wait }
    }

    /// The phase for a job whose committed state is in `epoch`.
    pub fn next(&mut self, epoch: u64) -> Phase {
        let finish = epoch >= self.epochs;
        let was = std::mem::replace(&mut self.finishing, finish);
        match (was, finish) {
            (_, true) => Phase::Finish { entering: !was },
            (true, false) => {
                self.final_attempts = 0;
                Phase::Train { again: true }
            }
            (false, false) => Phase::Train { again: false },
        }
    }

    /// A generation failed; `progressed`: it committed steps first. An
    /// error ends the job, with the reason.
    pub fn generation_failed(&mut self, progressed: bool, f: &Failure) -> Result<(), JobEnds> {
        if progressed {
            self.failures = 0;
        }
        self.failures += 1;
        match f.cause {
            Some(FailCause::NoTeachers) => {
                let (step, wait, errors) = (f.step, self.teacher_wait, f.errors.join("; "));
                return Err(JobEnds::NoTeachers { step, wait, errors });
            }
            Some(FailCause::State) => {
                return Err(JobEnds::StateMismatch { step: f.step, errors: f.errors.join("; ") });
            }
            // The coordinator goes back to a checkpoint: another generation can.
            Some(FailCause::NoState) | None => {}
        }
        if self.failures >= MAX_FAILED_GENERATIONS {
            return Err(JobEnds::FailedInARow {
                step: f.step,
                times: self.failures,
                last: f.errors.join("; "),
            });
        }
        Ok(())
    }

    /// The final checkpoint was not written.
    pub fn final_failed(&mut self) -> Result<(), JobEnds> {
        self.final_attempts += 1;
        if self.final_attempts >= MAX_FINAL_ATTEMPTS {
            return Err(JobEnds::NoFinalCheckpoint { tries: self.final_attempts });
        }
        Ok(())
    }
}

/// How far apart two failures' steps may be noticed and still be the same
/// step's: the windows of steps sent ahead of the ranks (two of up to 32).
pub const SAME_STEP_WITHIN: u64 = 64;

/// Every worker lost to the same program error (its exception line, which
/// names what failed), from the same checkpoint, again and again: another
/// restart would fail the same. Counts the repeats; `limit` restarts after
/// the same failure are allowed.
#[derive(Debug)]
pub struct CrashLoop {
    limit: u32,
    last: Option<Crash>,
    times: u32,
}

/// One loss of every worker: the step the job goes back to, the step it
/// failed at and the program's error (its exception line, and the
/// traceback to quote).
#[derive(Clone, Debug)]
pub struct Crash {
    pub from: u64,
    pub step: u64,
    pub error: String,
    pub traceback: String,
}

impl CrashLoop {
    pub fn new(limit: u32) -> Self {
        CrashLoop { limit, last: None, times: 0 }
    }

    /// Every worker was lost; `crash`: to a program error (None: killed, or
    /// no error known, which is never taken for a repeat). An error ends
    /// the job: the same crash came more than `limit` times in a row.
    pub fn all_lost(&mut self, crash: Option<Crash>) -> Result<(), JobEnds> {
        let Some(c) = crash else {
            self.last = None;
            self.times = 0;
            return Ok(());
        };
        // The step a failure is noticed at moves with the windows sent
        // ahead (by less than [`SAME_STEP_WITHIN`]); the checkpoint and the
        // program's error do not.
        let same = self.last.as_ref().is_some_and(|l| {
            (l.from, &l.error) == (c.from, &c.error) && l.step.abs_diff(c.step) <= SAME_STEP_WITHIN
        });
        self.times = if same { self.times + 1 } else { 1 };
        if self.times > self.limit {
            return Err(JobEnds::SameCrash { times: self.times, limit: self.limit, crash: c });
        }
        self.last = Some(c);
        Ok(())
    }
}

/// Why failures end the job.
#[derive(Debug, thiserror::Error)]
pub enum JobEnds {
    #[error("step {step}: no teacher answered within {wait:?}; the job cannot go on without them ({errors})")]
    NoTeachers { step: u64, wait: Duration, errors: String },
    #[error(
        "step {step}: a worker's state does not fit the job's, which no other generation can change: {errors}"
    )]
    StateMismatch { step: u64, errors: String },
    #[error("step {step} failed {times} times in a row; last: {last}")]
    FailedInARow { step: u64, times: u32, last: String },
    #[error("the final checkpoint could not be written ({tries} tries)")]
    NoFinalCheckpoint { tries: u32 },
    #[error(
        "step {}: every worker failed with the same error {times} times in a row from step {} ({limit} restart(s) \
         allowed by --max-restarts): {}{}",
        crash.step, crash.from, crash.error, crash.traceback
    )]
    SameCrash { times: u32, limit: u32, crash: Crash },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(step: u64, no_teachers: bool) -> Failure {
        let cause = no_teachers.then_some(FailCause::NoTeachers);
        Failure { step, cause, errors: vec!["worker 1: ring broke".into()], ..Failure::default() }
    }

    #[test]
    fn five_generations_failing_in_a_row_end_the_job_and_a_commit_resets_the_count() {
        let mut p = JobPhase::new(2, Duration::from_secs(20));
        for _ in 0..4 {
            p.generation_failed(false, &failure(7, false)).unwrap();
        }
        // One generation committed steps before failing: counting starts over.
        p.generation_failed(true, &failure(9, false)).unwrap();
        for _ in 0..3 {
            p.generation_failed(false, &failure(9, false)).unwrap();
        }
        let e = p.generation_failed(false, &failure(9, false)).unwrap_err();
        assert_eq!(e.to_string(), "step 9 failed 5 times in a row; last: worker 1: ring broke");
    }

    #[test]
    fn the_same_crash_from_the_same_checkpoint_ends_the_job_past_the_limit_and_anything_else_resets_it() {
        let crash = |from, step, error: &str| {
            Some(Crash { from, step, error: error.into(), traceback: "\n  Traceback ...".into() })
        };
        let mut one = CrashLoop::new(1);
        one.all_lost(crash(2, 3, "ValueError: bad")).unwrap();
        let e = one.all_lost(crash(2, 3, "ValueError: bad")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "step 3: every worker failed with the same error 2 times in a row from step 2 (1 restart(s) allowed by \
             --max-restarts): ValueError: bad\n  Traceback ..."
        );
        // Another error, another checkpoint, or a loss with no program
        // error between: not a repeat.
        let mut l = CrashLoop::new(1);
        l.all_lost(crash(2, 3, "ValueError: bad")).unwrap();
        l.all_lost(crash(2, 3, "KeyError: 'x'")).unwrap();
        l.all_lost(crash(4, 3, "KeyError: 'x'")).unwrap();
        l.all_lost(None).unwrap();
        l.all_lost(crash(4, 5, "KeyError: 'x'")).unwrap();
        // The same error far later (a flaky one, not the same step): not a repeat.
        l.all_lost(crash(4, 500, "KeyError: 'x'")).unwrap();
        // Noticed a step later (windows sent ahead): the same crash.
        assert!(l.all_lost(crash(4, 501, "KeyError: 'x'")).is_err());
        // --max-restarts 3: the fourth restart is refused.
        let mut three = CrashLoop::new(3);
        for _ in 0..3 {
            three.all_lost(crash(0, 1, "RuntimeError")).unwrap();
        }
        assert!(matches!(
            three.all_lost(crash(0, 1, "RuntimeError")),
            Err(JobEnds::SameCrash { times: 4, .. })
        ));
    }

    #[test]
    fn no_teacher_answering_ends_the_job_at_once() {
        let mut p = JobPhase::new(2, Duration::from_secs(3));
        let e = p.generation_failed(false, &failure(4, true)).unwrap_err();
        assert!(e.to_string().starts_with("step 4: no teacher answered within 3s;"), "{e}");
    }

    #[test]
    fn the_final_checkpoint_gets_three_tries_and_a_lost_final_state_trains_again() {
        let mut p = JobPhase::new(2, Duration::from_secs(20));
        assert_eq!(p.next(1), Phase::Train { again: false });
        assert_eq!(p.next(2), Phase::Finish { entering: true });
        p.final_failed().unwrap();
        assert_eq!(p.next(2), Phase::Finish { entering: false });
        p.final_failed().unwrap();
        // Every worker was lost; the recovery went back to epoch 1.
        assert_eq!(p.next(1), Phase::Train { again: true });
        assert_eq!(p.next(1), Phase::Train { again: false });
        assert_eq!(p.next(2), Phase::Finish { entering: true });
        p.final_failed().unwrap();
        p.final_failed().unwrap();
        assert_eq!(
            p.final_failed().unwrap_err().to_string(),
            "the final checkpoint could not be written (3 tries)"
        );
    }
}
