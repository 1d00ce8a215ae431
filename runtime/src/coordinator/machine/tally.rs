//! The job's committed position, without I/O: steps committed, the epoch
//! and the cursor in it, the samples each committed step trained on (in the
//! [`Ledger`]), and the throughput they add up to. Time enters as an
//! argument, so the bookkeeping of a commit is tested without a job.

use super::ledger::{EpochRecord, Ledger, LedgerError};
use super::noise::NoiseTerms;
use crate::control::proto::{StepDone, StepPlan};
use crate::distill::stats::TeacherRequests;
use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    time::Instant,
};

/// Committed steps the moving throughput is measured over.
const THROUGHPUT_STEPS: usize = 20;

/// A commit the reports do not add up to.
#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    #[error("worker {worker}: step {step} reported positions {start}..{end} outside the epoch")]
    OutsideEpoch { worker: u64, step: u64, start: u32, end: u32 },
    #[error("worker {worker}: {source}")]
    Ledger { worker: u64, source: LedgerError },
    #[error("step {step}: the ranks trained on {rows} samples, the step has {expected}")]
    WrongCount { step: u64, rows: usize, expected: usize },
}

/// What one committed step adds up to.
#[derive(Clone, Debug, PartialEq)]
pub struct StepTotals {
    /// Samples the ranks trained on.
    pub rows: usize,
    /// The ranks' losses, summed.
    pub loss: f64,
    /// The program's own metrics, summed over the ranks.
    pub metrics: BTreeMap<String, f64>,
    /// Committed samples per second over the last few steps.
    pub samples_per_sec: f64,
    /// The gradient noise scale, smoothed over the steps measured so far.
    pub noise_scale: Option<f64>,
    /// Its smoothed parts `(S, |G|^2)`, once a step was measured.
    pub noise_parts: Option<(f64, f64)>,
}

/// The job's committed position and what it has trained on.
#[derive(Clone, Debug)]
pub struct Tally {
    /// Steps committed: the number of the next step.
    pub committed: u64,
    pub epoch: u64,
    /// Samples of the epoch consumed.
    pub cursor: usize,
    /// Samples committed by this run.
    pub samples: u64,
    pub ledger: Ledger,
    train_len: usize,
    seed: u64,
    /// The permutation reported positions are mapped through.
    perm: Option<(u64, Vec<u32>)>,
    /// (when, samples) of the last committed steps.
    recent: VecDeque<(Instant, u64)>,
    /// Per worker: samples and seconds of compute since the last decision.
    worker_rate: HashMap<u64, (f64, f64)>,
    /// When the last decision was and the samples committed then.
    decision_window: (Instant, u64),
    /// The ranks' time waiting for soft labels and their compute time
    /// (which holds it), ms, since the teacher pool last asked.
    teacher_wait: (f64, f64),
    /// What the ranks' requests to each teacher did since then (by `host:port`).
    teacher_calls: BTreeMap<String, TeacherRequests>,
    /// The gradient noise scale, from the ranks' all-reduces.
    noise: super::noise::NoiseScale,
}

/// The permutation of `epoch` (of `len` samples under `seed`), kept in `cache`.
pub fn permutation_of(cache: &mut Option<(u64, Vec<u32>)>, len: usize, seed: u64, epoch: u64) -> &[u32] {
    if cache.as_ref().map(|p| p.0) != Some(epoch) {
        *cache = Some((epoch, crate::trainer::data::permutation(len, seed, epoch)));
    }
    &cache.as_ref().expect("set above").1
}

impl Tally {
    /// A job of `train_len` samples whose epochs are ordered by `seed`, at step 0.
    pub fn new(train_len: usize, seed: u64, now: Instant) -> Self {
        Tally {
            committed: 0,
            epoch: 0,
            cursor: 0,
            samples: 0,
            ledger: Ledger::new(train_len),
            train_len,
            seed,
            perm: None,
            recent: VecDeque::new(),
            worker_rate: HashMap::new(),
            decision_window: (now, 0),
            teacher_wait: (0.0, 0.0),
            teacher_calls: BTreeMap::new(),
            noise: Default::default(),
        }
    }

    /// The gradient noise scale so far (None until measured).
    pub fn noise_scale(&self) -> Option<f64> {
        self.noise.value()
    }

    /// Samples in the training set (0: not known yet).
    pub fn train_len(&self) -> usize {
        self.train_len
    }

    /// The training set's size, learned after the start (from the first
    /// worker of a program that declares it): the ledger starts over.
    pub fn learn_train_len(&mut self, n: usize) {
        self.train_len = n;
        self.ledger = Ledger::new(n);
        self.perm = None;
    }

    /// Goes to a stored position (a checkpoint, or the state a coordinator
    /// took over), with the ledger of its epoch; refused (nothing changed)
    /// where the ledger is of another number of samples or the position is
    /// past the epoch's end.
    pub fn restore(
        &mut self,
        committed: u64,
        epoch: u64,
        cursor: usize,
        ledger: Ledger,
    ) -> Result<(), String> {
        let train_len = if self.train_len == 0 { ledger.samples() } else { self.train_len };
        if ledger.samples() != train_len {
            return Err(format!("its ledger counts {} samples, the job has {train_len}", ledger.samples()));
        }
        if cursor > train_len {
            return Err(format!("its position {cursor} is past the epoch's {train_len} samples"));
        }
        if self.train_len == 0 {
            self.learn_train_len(train_len);
        }
        (self.committed, self.epoch, self.cursor, self.ledger) = (committed, epoch, cursor, ledger);
        Ok(())
    }

    /// Back to the first step of the first epoch.
    pub fn restart(&mut self) {
        (self.committed, self.epoch, self.cursor) = (0, 0, 0);
        self.ledger = Ledger::new(self.train_len);
    }

    /// Commits one step every rank finished: the ids at the positions each
    /// rank reported enter the ledger, and the cursor moves past the step.
    /// `members[rank]` names the worker of each report; `first`: the
    /// generation's first step, whose compute also started the read-ahead
    /// and is not counted in the workers' rates.
    pub fn commit(
        &mut self,
        now: Instant,
        plan: &StepPlan,
        reports: &[StepDone],
        members: &[u64],
        first: bool,
    ) -> Result<StepTotals, CommitError> {
        let gb = plan.hyper.global_batch.max(1) as usize;
        let expected = (plan.cursor + gb).min(self.train_len) - plan.cursor;
        let perm = permutation_of(&mut self.perm, self.train_len, self.seed, plan.epoch);
        let mut totals = StepTotals {
            rows: 0,
            loss: 0.0,
            metrics: BTreeMap::new(),
            samples_per_sec: 0.0,
            noise_scale: None,
            noise_parts: None,
        };
        let mut terms = NoiseTerms::default();
        let mut measured = 0;
        for (d, &worker) in reports.iter().zip(members) {
            let ids = perm.get(d.start as usize..d.end as usize).ok_or(CommitError::OutsideEpoch {
                worker,
                step: d.step,
                start: d.start,
                end: d.end,
            })?;
            self.ledger.commit(ids).map_err(|source| CommitError::Ledger { worker, source })?;
            totals.rows += ids.len();
            totals.loss += d.loss;
            let told = match (d.noise_terms, d.grad_sq) {
                (Some(t), _) => Some(t),
                (None, Some(sq)) => Some(NoiseTerms::of(ids.len(), sq)),
                (None, None) => None,
            };
            if let Some(t) = told {
                terms.add(t);
                measured += 1;
            }
            for (name, v) in &d.metrics {
                *totals.metrics.entry(name.clone()).or_default() += v;
            }
            self.teacher_wait.0 += d.teacher_wait_ms;
            self.teacher_wait.1 += d.compute_ms;
            for c in &d.teacher_calls {
                let calls = self.teacher_calls.entry(c.addr.clone());
                calls
                    .or_insert_with(|| TeacherRequests { addr: c.addr.clone(), ..Default::default() })
                    .merge(c.clone());
            }
            if d.compute_ms > 0.0 && !ids.is_empty() && !first {
                let rate = self.worker_rate.entry(worker).or_insert((0.0, 0.0));
                rate.0 += ids.len() as f64;
                rate.1 += d.compute_ms / 1e3;
            }
        }
        if totals.rows != expected {
            return Err(CommitError::WrongCount { step: plan.step, rows: totals.rows, expected });
        }
        self.committed = plan.step + 1;
        self.samples += totals.rows as u64;
        self.epoch = plan.epoch;
        self.cursor = plan.cursor + gb;
        totals.samples_per_sec = self.moving_throughput(now, totals.rows as u64);
        // Every rank must have told its norms for the step to be measured.
        totals.noise_scale = match measured == reports.len() {
            true => self.noise.step_terms(terms, totals.rows),
            false => self.noise.value(),
        };
        totals.noise_parts = self.noise.parts();
        Ok(totals)
    }

    fn moving_throughput(&mut self, now: Instant, rows: u64) -> f64 {
        self.recent.push_back((now, rows));
        while self.recent.len() > THROUGHPUT_STEPS {
            self.recent.pop_front();
        }
        match (self.recent.front(), self.recent.len()) {
            (Some((t0, _)), n) if n > 1 => {
                let s: u64 = self.recent.iter().skip(1).map(|r| r.1).sum();
                s as f64 / now.duration_since(*t0).as_secs_f64().max(1e-9)
            }
            _ => 0.0,
        }
    }

    /// Closes the epoch when the last commit reached its end.
    pub fn end_epoch(&mut self) -> Option<EpochRecord> {
        if self.cursor < self.train_len {
            return None;
        }
        let rec = self.ledger.finish_epoch(self.epoch);
        self.epoch += 1;
        self.cursor = 0;
        Some(rec)
    }

    /// Samples committed per second since the last call (the last decision),
    /// and per worker: its samples per second of compute. Both start over.
    pub fn since_decision(&mut self, now: Instant) -> (f64, HashMap<u64, f64>) {
        let (t0, s0) = self.decision_window;
        let throughput = (self.samples - s0) as f64 / now.duration_since(t0).as_secs_f64().max(1e-9);
        self.decision_window = (now, self.samples);
        let workers = self
            .worker_rate
            .drain()
            .filter(|(_, (_, secs))| *secs > 0.0)
            .map(|(id, (rows, secs))| (id, rows / secs))
            .collect();
        (throughput, workers)
    }

    /// Committed samples per second over the last few steps.
    pub fn samples_per_sec(&self) -> f64 {
        match (self.recent.front(), self.recent.back(), self.recent.len()) {
            (Some((t0, _)), Some((t1, _)), n) if n > 1 => {
                let s: u64 = self.recent.iter().skip(1).map(|r| r.1).sum();
                s as f64 / t1.duration_since(*t0).as_secs_f64().max(1e-9)
            }
            _ => 0.0,
        }
    }

    /// The share of the ranks' compute time spent waiting for soft labels
    /// since the last call (None: nothing was computed); starts over.
    pub fn teacher_wait_share(&mut self) -> Option<f64> {
        let (waited, computed) = std::mem::take(&mut self.teacher_wait);
        (computed > 0.0).then(|| (waited / computed).clamp(0.0, 1.0))
    }

    /// What the ranks' requests to each teacher did since the last call
    /// (by `host:port`); starts over.
    pub fn teacher_calls(&mut self) -> BTreeMap<String, TeacherRequests> {
        std::mem::take(&mut self.teacher_calls)
    }

    /// Samples left to train, up to the end of epoch `epochs - 1`.
    pub fn remaining(&self, epochs: u64) -> u64 {
        (epochs.saturating_sub(self.epoch) as usize * self.train_len).saturating_sub(self.cursor) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use edl_plugin_sdk::Hyperparams;
    use std::time::Duration;

    fn plan(step: u64, epoch: u64, cursor: usize, batch: u32) -> StepPlan {
        StepPlan {
            step,
            epoch,
            cursor,
            hyper: Hyperparams { global_batch: batch, local_batch: batch, lr: 0.1, momentum: 0.0 },
        }
    }

    fn done(step: u64, start: u32, end: u32, loss: f64) -> StepDone {
        StepDone::plain(step, 0, start, end, loss, 10.0)
    }

    #[test]
    fn a_commit_moves_the_cursor_and_fills_the_ledger_until_the_epoch_ends() {
        let t0 = Instant::now();
        let mut tally = Tally::new(6, 7, t0);
        let totals = tally
            .commit(t0, &plan(0, 0, 0, 4), &[done(0, 0, 2, 1.0), done(0, 2, 4, 3.0)], &[1, 2], true)
            .unwrap();
        assert_eq!((totals.rows, totals.loss), (4, 4.0));
        assert_eq!((tally.committed, tally.cursor, tally.samples), (1, 4, 4));
        assert_eq!(tally.end_epoch(), None, "two samples are left");
        // The last step of the epoch is short: two samples, not four.
        tally
            .commit(t0 + Duration::from_secs(1), &plan(1, 0, 4, 4), &[done(1, 4, 6, 0.5)], &[1], false)
            .unwrap();
        let rec = tally.end_epoch().expect("the epoch ended");
        assert_eq!((rec.epoch, rec.samples_committed, rec.duplicates, rec.missing), (0, 6, 0, 0));
        assert_eq!((tally.epoch, tally.cursor), (1, 0));
        assert_eq!(tally.remaining(2), 6);
    }

    #[test]
    fn the_share_of_compute_spent_waiting_for_teachers_is_summed_over_ranks_and_steps() {
        let t0 = Instant::now();
        let mut tally = Tally::new(8, 7, t0);
        assert_eq!(tally.teacher_wait_share(), None, "nothing computed yet");
        let waited = |step, start, end, ms| StepDone { teacher_wait_ms: ms, ..done(step, start, end, 0.0) };
        // Each rank computes 10 ms a step: 4 + 0 of 20, then 6 + 6 of 20.
        tally
            .commit(t0, &plan(0, 0, 0, 4), &[waited(0, 0, 2, 4.0), waited(0, 2, 4, 0.0)], &[1, 2], true)
            .unwrap();
        tally
            .commit(t0, &plan(1, 0, 4, 4), &[waited(1, 4, 6, 6.0), waited(1, 6, 8, 6.0)], &[1, 2], false)
            .unwrap();
        assert!((tally.teacher_wait_share().unwrap() - 0.4).abs() < 1e-12);
        assert_eq!(tally.teacher_wait_share(), None, "it starts over");
    }

    #[test]
    fn reports_that_do_not_add_up_are_refused_naming_the_worker_or_the_step() {
        let t0 = Instant::now();
        let mut tally = Tally::new(6, 7, t0);
        let e = tally.commit(t0, &plan(0, 0, 0, 4), &[done(0, 0, 3, 0.0)], &[9], true).unwrap_err();
        assert_eq!(e.to_string(), "step 0: the ranks trained on 3 samples, the step has 4");
        let e = tally.commit(t0, &plan(0, 0, 0, 4), &[done(0, 4, 9, 0.0)], &[9], true).unwrap_err();
        assert_eq!(e.to_string(), "worker 9: step 0 reported positions 4..9 outside the epoch");
        assert_eq!(tally.committed, 0, "nothing moved");
    }

    #[test]
    fn throughput_since_a_decision_counts_its_samples_and_each_workers_compute() {
        let t0 = Instant::now();
        let mut tally = Tally::new(100, 1, t0);
        tally.commit(t0, &plan(0, 0, 0, 10), &[done(0, 0, 10, 0.0)], &[4], true).unwrap();
        let t1 = t0 + Duration::from_secs(1);
        let totals = tally.commit(t1, &plan(1, 0, 10, 10), &[done(1, 10, 20, 0.0)], &[4], false).unwrap();
        assert_eq!(totals.samples_per_sec, 10.0, "the second step's samples over the second between them");
        let (throughput, workers) = tally.since_decision(t0 + Duration::from_secs(2));
        assert_eq!(throughput, 10.0, "20 samples in 2 s");
        assert_eq!(workers.get(&4), Some(&1000.0), "10 samples in 10 ms; the first step does not count");
        let (_, workers) = tally.since_decision(t0 + Duration::from_secs(3));
        assert!(workers.is_empty(), "the rates start over at each decision");
    }

    #[test]
    fn a_restored_position_carries_its_ledger_and_a_restart_clears_it() {
        let t0 = Instant::now();
        let mut tally = Tally::new(0, 1, t0);
        let mut ledger = Ledger::new(8);
        ledger.commit(&[0, 1]).unwrap();
        tally.restore(3, 1, 2, ledger.clone()).unwrap();
        assert_eq!(tally.train_len(), 8, "learned from the ledger");
        assert_eq!((tally.committed, tally.epoch, tally.cursor), (3, 1, 2));
        assert_eq!(tally.ledger, ledger);
        // A position past the epoch's end, or a ledger of another data set
        // (a record of another version, a hand-made manifest): refused by
        // what is wrong, nothing moved.
        let e = tally.restore(5, 1, 9, ledger.clone()).unwrap_err();
        assert_eq!(e, "its position 9 is past the epoch's 8 samples");
        let e = tally.restore(5, 1, 2, Ledger::new(9)).unwrap_err();
        assert_eq!(e, "its ledger counts 9 samples, the job has 8");
        assert_eq!((tally.committed, tally.epoch, tally.cursor), (3, 1, 2));
        tally.restart();
        assert_eq!((tally.committed, tally.epoch, tally.cursor), (0, 0, 0));
        assert_eq!(tally.ledger, Ledger::new(8));
    }
}
