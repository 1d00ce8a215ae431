//! What survives the coordinator: checkpoints written on the cadence and at
//! the end, the bookkeeping they carry besides the tensors, and a resume
//! that refuses to continue on another data order.

use super::records::*;
use super::{CHORES_EVERY, Coordinator, NoticeCheckpoint, ms};
use crate::checkpoint::{Checkpoints, Manifest, PluginState, Restored};
use crate::control::proto::ToWorker;
use crate::coordinator::machine::ledger::{EpochRecord, Ledger};
use crate::coordinator::machine::phase::Crash;
use crate::coordinator::machine::pipeline::Failure;
use crate::leader::record::{DataIdentity, JobState, PluginMemory, ScaleEvent};
use crate::leader::seal::RecordKey;
use crate::scalers::Scaler;
use crate::store::{Store, keys};
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::{
    collections::BTreeSet,
    path::PathBuf,
    sync::mpsc,
    time::{Duration, Instant},
};

/// What a checkpoint keeps for the coordinator besides the tensors.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct Bookkeeping {
    ledger: Ledger,
    events: Vec<ScaleEvent>,
    generation: u64,
    /// What the data order depends on: a resume with other values would
    /// walk another permutation and train samples twice or never.
    #[serde(default)]
    data: Option<DataIdentity>,
    /// The plugins' memory at the checkpoint's step.
    #[serde(default)]
    plugins: PluginMemory,
    /// The world the checkpoint's hyperparameters were set for (0: not
    /// known, in checkpoints written before it was kept): what a batch
    /// adapter is told the job resizes from when it starts again there.
    #[serde(default)]
    world: u32,
}

/// Marks a job finished (after its report is written): a rerun says so
/// and does nothing ([`AlreadyFinished`]; `--restart` trains it again).
/// Until then a rerun resumes from the final checkpoint and only writes
/// the report.
pub fn mark_complete(checkpoint_dir: &std::path::Path, epochs: &[EpochRecord]) -> Result<()> {
    Checkpoints::open(checkpoint_dir, 1)?.put_file(COMPLETE, &serde_json::to_vec_pretty(epochs)?)?;
    Ok(())
}

/// Whether job `job` finished before, as the marker beside its checkpoints
/// says: what a rerun tells before it starts anything (its teachers
/// included). The store's mark is the coordinator's to read.
pub fn finished_here(checkpoint_dir: &std::path::Path, job: &str) -> Result<Option<AlreadyFinished>> {
    let cps = Checkpoints::open(checkpoint_dir, 1)?;
    if !cps.has_file(COMPLETE).context("looking for the finished job's marker")? {
        return Ok(None);
    }
    AlreadyFinished::at(&cps, job).map(Some)
}

impl AlreadyFinished {
    /// Job `job`, finished, its final checkpoint the newest in `cps`.
    fn at(cps: &Checkpoints, job: &str) -> Result<AlreadyFinished> {
        let listed = cps.list().context("listing the finished job's checkpoints")?;
        // The marker is the epochs' records (unreadable: not known).
        let marker = cps.get_file(COMPLETE).ok().flatten();
        let epochs = marker.and_then(|b| serde_json::from_slice::<Vec<serde_json::Value>>(&b).ok());
        Ok(AlreadyFinished {
            job: job.to_string(),
            final_checkpoint: listed.last().map(|(_, p)| p.clone()),
            epochs: epochs.map(|e| e.len() as u64),
        })
    }
}

/// A job found finished (by a rerun, or a standby once the coordinator
/// that finished it let go): nothing to train, unless `--restart`.
#[derive(Debug, thiserror::Error)]
#[error(
    "job {job:?} finished before{}; nothing to do (--restart trains it again from step 0)",
    final_checkpoint.as_ref().map(|p| format!(", its final checkpoint is {}", p.display())).unwrap_or_default()
)]
pub struct AlreadyFinished {
    pub job: String,
    pub final_checkpoint: Option<PathBuf>,
    /// The epochs it trained, where its marker says.
    pub epochs: Option<u64>,
}

/// The marker of a finished job, beside its checkpoints.
const COMPLETE: &str = "complete.json";

impl Coordinator<'_> {
    /// Picks up where an earlier run of this job stopped: the store's job
    /// state (generations, worker ids) and the newest checkpoint that verifies.
    pub(super) fn resume(&mut self) -> Result<Option<u64>> {
        let key = keys::job_state(&self.cfg.spec.job);
        let stored: Option<JobState> = match self.io.rt.block_on(self.io.store.get(&key)) {
            Ok(Some(e)) => {
                self.state_token = Some(e.token);
                match JobState::open(&key, &e.value, &RecordKey::job_records(&self.cfg.secret)) {
                    Ok(s) => Some(s),
                    Err(why) => {
                        self.note(format!("the job's state in the store is ignored: {why}"));
                        None
                    }
                }
            }
            Ok(None) => None,
            Err(e) => bail!("reading the job state: {e}"),
        };
        let stored = self.believed(stored)?;
        if let Some(s) = &stored {
            self.generation = s.generation;
            self.membership.resume_ids(s.next_worker_id);
        }
        let complete = self.ckpt.has_file(COMPLETE).context("looking for the finished job's marker")?;
        if complete || stored.as_ref().is_some_and(|s| s.finished) {
            return self.finished_before().map(|()| None);
        }
        // Teachers the coordinator before left running: the pool takes them over.
        self.teachers_left = stored.as_ref().map(|s| s.teachers.clone()).unwrap_or_default();
        for p in self.checkpoints().clean_leftovers() {
            self.note(format!("removed {} (left by an interrupted checkpoint write)", p.display()));
        }
        if self.cfg.restart && self.ckpt.list().is_ok_and(|l| !l.is_empty()) {
            // Not set aside: a supervisor that restarts a crashed
            // coordinator with the same flags must not lose the progress.
            self.note(format!(
                "--restart trains a finished job again; job {:?} has not finished, so it resumes (to train it \
                 from step 0, give it another --job, or remove its checkpoints in {})",
                self.cfg.spec.job,
                self.cfg.spec.checkpoint_dir.display()
            ));
        }
        if let Some(s) = stored.as_ref().filter(|s| !s.members.is_empty() && self.shared_store())
            && let Some(h) = &s.handover
        {
            return self.take_over(s, h).map(Some);
        }
        self.resume_from_checkpoint(stored.map(|s| s.committed_steps))
    }

    /// The stored state, unless it is an earlier leader's than the one the
    /// checkpoints were last claimed by (left over, or replayed by a store
    /// writer: its `finished` is not believed). A job that failed for good
    /// under the coordinator before is not started again by a standby.
    fn believed(&mut self, stored: Option<JobState>) -> Result<Option<JobState>> {
        let Some(s) = stored else { return Ok(None) };
        let fence = self.ckpt.fence().context("reading the checkpoints' fence")?.map_or(0, |f| f.token);
        if self.shared_store() && s.fence < fence {
            self.note(format!(
                "the job's state in the store was written with token {}, below the checkpoints' fence (token \
                 {fence}): an earlier coordinator's, ignored",
                s.fence
            ));
            return Ok(None);
        }
        if let Some(why) = s.failed.as_ref().filter(|_| self.cfg.standby) {
            bail!(
                "job {:?} failed under the coordinator before ({why}); a standby does not start it again (a \
                 rerun without --standby does)",
                self.cfg.spec.job
            );
        }
        Ok(Some(s))
    }

    /// The job finished before. Without `--restart` there is nothing to
    /// do ([`AlreadyFinished`]); with it, the finished run's checkpoints are
    /// set aside (removed once this run has finished too) and the job
    /// starts again from step 0.
    fn finished_before(&mut self) -> Result<()> {
        let job = &self.cfg.spec.job;
        if !self.cfg.restart {
            return Err(AlreadyFinished::at(&self.ckpt, job)?.into());
        }
        let n = self.ckpt.set_aside_finished().context("setting the finished job's checkpoints aside")?;
        self.ckpt.remove_file(COMPLETE);
        self.note(format!(
            "job {job:?} finished before; --restart: training it again from step 0 (its {n} checkpoints are \
             kept as finished-step-* until this run finishes)"
        ));
        Ok(())
    }

    /// Keeps the fencing token monotonic across a store that lost its data
    /// (restarted without persistence, or replaced): its token sequence
    /// starts again, below the token the checkpoints were claimed with,
    /// which would refuse this coordinator and which the workers would not
    /// follow. The lease's fencing token goes above the fence then.
    pub(super) fn fence_above_checkpoints(
        &mut self,
        lease: &mut crate::leader::keeper::JobLease,
    ) -> Result<()> {
        let Some(fence) = self.ckpt.fence().context("reading the checkpoints' fence")? else { return Ok(()) };
        let store_token = lease.token();
        if lease.fence_above(fence.token) {
            self.note(format!(
                "the store's lease token {store_token} is not above the checkpoints' fence (token {}): the store \
                 lost its data; this coordinator fences with token {}",
                fence.token,
                lease.token()
            ));
        }
        Ok(())
    }

    /// Whether the job's store is shared (not the coordinator's own): the
    /// job can then be taken over, and its workers follow.
    pub(super) fn shared_store(&self) -> bool {
        !matches!(self.io.store, crate::store::AnyStore::Memory(_))
    }

    /// Carries on a job another coordinator ran (it died, was cut off or
    /// frozen, and its lease lapsed) from the progress the store holds at
    /// its last stored commit: the workers of its generation may come back
    /// with their state ([`Self::await_return`]). Returns that step.
    fn take_over(&mut self, s: &JobState, h: &crate::leader::record::Handover) -> Result<u64> {
        if self.tally.train_len() == 0 {
            self.tally.learn_train_len(h.ledger.samples());
        }
        let now = self.data_identity();
        let diff = h.data.differences(&now);
        if !diff.is_empty() {
            bail!(
                "job {:?} runs with {} (its coordinator at {}); a coordinator taking it over must be started \
                 with the same flags",
                self.cfg.spec.job,
                diff.join(", "),
                h.leader.addr
            );
        }
        self.tally.restore(s.committed_steps, s.epoch, s.cursor, h.ledger.clone()).map_err(|e| {
            anyhow::anyhow!("the job's state in the store at step {}: {e}", s.committed_steps)
        })?;
        self.hyper = h.hyper;
        // Set for the generation whose workers it takes over.
        self.hyper_world = s.members.len() as u32;
        self.events = h.events.clone();
        self.init = None;
        self.takeover = Some(super::Takeover {
            from: h.leader.clone(),
            generation: s.generation,
            members: s.members.clone(),
            handles: h.handles.clone(),
        });
        self.note(format!(
            "taking job {:?} over from the coordinator at {} (lease token {}) at step {} (epoch {}, cursor {}); \
             waiting for its {} workers to come back",
            self.cfg.spec.job,
            h.leader.addr,
            h.leader.token,
            s.committed_steps,
            s.epoch,
            s.cursor,
            s.members.len()
        ));
        self.restore_plugin_memory(&h.plugins, s.committed_steps);
        Ok(s.committed_steps)
    }

    /// The workers of the coordinator this one took the job over from come
    /// back within `within` (each with its process and its state); the job
    /// goes on from the stored step with those that did. None came back:
    /// it goes on from the newest checkpoint with new workers.
    pub(super) fn await_return(&mut self, within: Duration) -> Result<()> {
        let Some(t) = self.takeover.as_ref() else { return Ok(()) };
        // Its workers are admitted before the store names this coordinator:
        // one that found it there first would be refused as a stranger
        // (adopting their batch jobs below can take a while).
        let (generation, members) = (t.generation, t.members.clone());
        self.io.gate.expect_return(Some((generation, members.iter().copied().collect())));
        self.membership.expect_return(&members);
        // The store names this coordinator (the takeover's members still
        // its own): the workers find it there.
        self.save_state(false);
        let t = self.takeover.take().expect("checked above");
        let since = Instant::now();
        // Its workers are this coordinator's to stop and to place around.
        for (&id, handle) in t.handles.iter().filter(|(id, _)| t.members.contains(id)) {
            if !self.scaler.adopt(id, handle, &self.cfg.spec.job) {
                self.note(format!(
                    "worker {id} runs as {handle}, which this coordinator's scaler does not know"
                ));
            }
        }
        while self.membership.returning() > 0 && since.elapsed() < within {
            match self.receive(Duration::from_millis(50)) {
                Ok(ev) => self.handle(ev),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => bail!("the control listener stopped"),
            }
            self.check_fatal()?;
        }
        self.io.gate.expect_return(None);
        let missing = self.membership.end_return();
        for &id in &missing {
            // Not back, and never admitted now: whatever its scheduler
            // still runs for it is stopped, so nothing is left behind.
            if let Some(handle) = self.scaler.handle(id) {
                self.note(format!("worker {id} did not come back; stopping {handle}"));
            }
            self.scaler.stop(id, Duration::from_secs(1));
        }
        let back = self.membership.joiners();
        if back == 0 {
            self.note(format!(
                "no worker of the coordinator at {} came back within {within:?}; going on from the newest checkpoint",
                t.from.addr
            ));
            return self.recover_from_nothing();
        }
        let mut reason = format!(
            "coordinator takeover: the coordinator at {} (lease token {}) was gone; {back} of its {} workers \
             came back with their state",
            t.from.addr,
            t.from.token,
            t.members.len()
        );
        if !missing.is_empty() {
            reason.push_str(&format!(" (not back: {missing:?})"));
        }
        let mut pending = Pending::new(t.members.len() as u32, reason);
        pending.join_ms = Some(ms(since.elapsed()));
        self.pending = Some(pending);
        Ok(())
    }

    /// Resumes from the newest checkpoint that verifies; `stored_step`: the
    /// committed step the store names, to say how many steps are redone.
    fn resume_from_checkpoint(&mut self, stored_step: Option<u64>) -> Result<Option<u64>> {
        let (restored, skipped) =
            self.checkpoints().latest().context("listing the checkpoints to resume from")?;
        for e in skipped {
            self.note(format!("skipping an unusable checkpoint: {e}"));
        }
        let Some(r) = restored else { return Ok(None) };
        let m = &r.manifest;
        let book: Bookkeeping = m
            .plugin_state
            .read()
            .with_context(|| format!("{}: manifest has no coordinator state", r.path.display()))?;
        if self.tally.train_len() == 0 {
            // Launched without --samples: the checkpoint's, which the
            // programs' declarations are then checked against.
            self.tally.learn_train_len(book.ledger.samples());
        }
        let now = self.data_identity();
        let was = book.data.clone().unwrap_or_else(|| now.with_seed(m.seed));
        let diff = was.differences(&now);
        if !diff.is_empty() {
            bail!(
                "checkpoint {} was made with {}; resuming would train on another order of the data. \
                 Run with the same flags, or use another --checkpoint-dir",
                r.path.display(),
                diff.join(", ")
            );
        }
        if book.ledger.samples() != self.tally.train_len() {
            bail!(
                "checkpoint {} was written for {} training samples, this job has {}",
                r.path.display(),
                book.ledger.samples(),
                self.tally.train_len()
            );
        }
        let total = self.cfg.spec.epochs;
        if m.epoch > total || (m.epoch == total && m.cursor > 0) {
            bail!(
                "checkpoint {} is in epoch {} (step {}), past this job's --epochs {total}: resume it with \
                 --epochs {} or more, or train from step 0 under another --job (or with the checkpoints in {} \
                 removed)",
                r.path.display(),
                m.epoch,
                m.step,
                m.epoch + 1,
                self.cfg.spec.checkpoint_dir.display()
            );
        }
        self.restore(&r, book.ledger, book.world)?;
        self.events = book.events;
        self.generation = self.generation.max(book.generation);
        let lost = stored_step.map(|s| s.saturating_sub(m.step)).unwrap_or(0);
        self.note(format!(
            "resuming job {:?} from {} (step {}, epoch {}, cursor {}){}",
            self.cfg.spec.job,
            r.path.display(),
            m.step,
            m.epoch,
            m.cursor,
            if lost > 0 { format!("; redoing the {lost} steps committed after it") } else { String::new() }
        ));
        if lost > 0 {
            self.redone_steps += lost;
            (self.progress)(Progress::Redone { step: m.step, redone: lost, failed: false });
        }
        self.restore_plugin_memory(&book.plugins, m.step);
        Ok(Some(m.step))
    }

    /// Takes the cursor, hyperparameters and ledger of a checkpoint, whose
    /// parameters the first generation then loads; `world` is the one its
    /// hyperparameters were set for, which a batch adapter is told the
    /// job's first generation resizes from (0: not known).
    pub(super) fn restore(&mut self, r: &Restored, ledger: Ledger, world: u32) -> Result<()> {
        let m = &r.manifest;
        self.tally
            .restore(m.step, m.epoch, m.cursor, ledger)
            .map_err(|e| anyhow::anyhow!("checkpoint {}: {e}", r.path.display()))?;
        self.hyper = m.hyperparams;
        self.hyper_world = world;
        self.init = Some(r.path.clone());
        Ok(())
    }

    /// Every worker is gone: start over from the newest checkpoint with new ones.
    /// The same program error from the same checkpoint, once more than
    /// `--max-restarts` allows, ends the job with its traceback instead.
    pub(super) fn recover_from_nothing(&mut self) -> Result<()> {
        let joining = self.membership.joiners();
        let failed_at = self.tally.committed;
        let died_of = self.program_error_of_lost();
        // Judged before going back, so that a job that ends says no restart:
        // the step the newest checkpoint holds (0: none).
        let newest = self.ckpt.list().context("listing the checkpoints to restart from")?;
        let from = newest.last().map_or(0, |(step, _)| *step);
        self.lost.clear();
        self.crash_loop.all_lost(died_of.map(|(error, traceback)| Crash {
            from,
            step: failed_at,
            error,
            traceback,
        }))?;
        self.restore_newest(match joining {
            0 => "no worker left".into(),
            n => format!("no worker holding the state is left ({n} joining have none)"),
        })?;
        self.membership.refill(Instant::now());
        self.execute();
        self.wait_for_joiners(1)?;
        Ok(())
    }

    /// The program error the workers lost since the last restore died of
    /// (the exception their log ends with) and the log's tail that quotes
    /// it. Their last lines may still be on the way to the log: it is read
    /// again for a moment before no error is taken for an answer.
    fn program_error_of_lost(&self) -> Option<(String, String)> {
        let logs: Vec<(u64, PathBuf)> =
            self.lost.iter().filter_map(|&id| Some((id, self.scaler.log_of(id)?))).collect();
        if logs.is_empty() {
            return None;
        }
        let until = Instant::now() + Duration::from_secs(1);
        loop {
            for (id, log) in &logs {
                if let Some(error) = crate::process::program_error(log) {
                    return Some((error, self.log_tail(*id)));
                }
            }
            if Instant::now() >= until {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The job's state is held by no worker (`why`): the next generation
    /// loads the newest checkpoint (or starts from the beginning without one).
    pub(super) fn restore_newest(&mut self, why: String) -> Result<()> {
        self.notice_checkpoint = None;
        self.note(format!("{why}; restarting from the newest checkpoint"));
        let committed = self.tally.committed;
        let newest = self.checkpoints().latest().context("listing the checkpoints to restart from")?.0;
        let back_to = newest.as_ref().map_or(0, |r| r.manifest.step);
        if committed > back_to {
            self.redone_steps += committed - back_to;
            (self.progress)(Progress::Redone { step: back_to, redone: committed - back_to, failed: false });
        }
        match newest {
            Some(r) => {
                self.note(format!("restarting from step {} ({})", r.manifest.step, r.path.display()));
                let book: Bookkeeping =
                    r.manifest.plugin_state.read().with_context(|| {
                        format!("{}: manifest has no coordinator state", r.path.display())
                    })?;
                self.restore(&r, book.ledger, book.world)?;
                // The adapter goes back with the hyperparameters it set (a
                // rate's ramp, say); the policy keeps what it saw since.
                self.restore_adapter_memory(&book.plugins, r.manifest.step);
            }
            None => {
                self.tally.restart();
                self.hyper = self.cfg.hyper;
                self.hyper_world = 0;
                self.init = None;
            }
        }
        Ok(())
    }

    /// A checkpoint at this commit point: every `--checkpoint-every-steps`
    /// steps, when `--checkpoint-secs` passed since the last one, at each
    /// epoch's end, and once a sole worker holding the state was told to go.
    pub(super) fn checkpoint_due(&mut self) -> Option<Manifest> {
        let steps = self.cfg.checkpoint_every.is_some_and(|n| self.tally.committed.is_multiple_of(n.max(1)));
        let time = self.last_checkpoint.elapsed() >= self.cfg.checkpoint_interval;
        let at_epoch_start = self.tally.cursor == 0;
        if self.notice_checkpoint == Some(NoticeCheckpoint::Due) && !self.membership.told_alone() {
            // It handed its state over, or went: nothing to save for it.
            self.notice_checkpoint = None;
        }
        let notice = self.notice_checkpoint == Some(NoticeCheckpoint::Due);
        let stop = self.stopping.as_ref().is_some_and(|s| s.asked.is_none());
        if self.tally.committed == 0 || !(steps || time || at_epoch_start || notice || stop) {
            return None;
        }
        if let Some(s) = self.stopping.as_mut() {
            s.asked = Some(self.tally.committed);
        }
        if notice {
            self.notice_checkpoint = Some(NoticeCheckpoint::Writing(self.tally.committed));
        }
        self.last_checkpoint = Instant::now();
        Some(self.manifest())
    }

    /// SIGTERM or SIGINT came: the committed state goes to a checkpoint at
    /// the next commit point, then the job stops (an error saying so, which
    /// stops the workers with notice). It stops without one when no worker
    /// holds the state, nothing was committed yet, or the checkpoint did
    /// not come within half of [`crate::process::STOP_WITHIN`].
    pub(super) fn stop_signalled(&mut self) -> Result<()> {
        let Some(signal) = crate::process::stop_requested() else { return Ok(()) };
        if self.stopping.is_none() {
            self.note(format!(
                "{}: stopping the job once its committed state is in a checkpoint",
                crate::process::signal_name(signal)
            ));
            self.stopping = Some(super::Stopping { since: Instant::now(), asked: None, written: None });
        }
        let Some(s) = &self.stopping else { return Ok(()) };
        let out_of_time = s.since.elapsed() >= crate::process::STOP_WITHIN / 2;
        let nothing_to_save = self.membership.world() == 0 || self.tally.committed == 0;
        let what = match (&s.written, s.asked) {
            (Some(p), Some(step)) => format!("its state at step {step} is in checkpoint {}", p.display()),
            _ if !(out_of_time || nothing_to_save) => return Ok(()),
            _ => match self.checkpoints.last() {
                Some(p) => format!(
                    "no checkpoint of step {} was written; the newest is {}",
                    self.tally.committed,
                    p.display()
                ),
                None => format!("no checkpoint of step {} was written", self.tally.committed),
            },
        };
        Err(crate::process::StopSignalled { signal, what: format!("{what}; a rerun resumes from it") }.into())
    }

    pub(super) fn manifest(&mut self) -> Manifest {
        let book = Bookkeeping {
            ledger: self.tally.ledger.clone(),
            events: self.events.clone(),
            generation: self.generation,
            data: Some(self.data_identity()),
            plugins: self.plugin_memory(),
            world: self.hyper_world,
        };
        Manifest {
            step: self.tally.committed,
            epoch: self.tally.epoch,
            cursor: self.tally.cursor,
            seed: self.cfg.spec.seed,
            hyperparams: self.hyper,
            plugin_state: PluginState::of(&book).unwrap_or_default(),
            files: Default::default(),
            fence: self.fence,
        }
    }

    /// Asks rank 0 to write the job's final state and waits for it (bounded
    /// by the step timeout). An error: the failure that stopped it.
    pub(super) fn write_final(&mut self) -> Result<std::result::Result<PathBuf, Failure>> {
        let step = self.tally.committed;
        let Some(m0) = self.membership.members().first().cloned() else {
            bail!("no worker holds the final state");
        };
        let name = format!("worker {} (pid {})", m0.id, m0.pid);
        let failure = |error: String, dead: bool| Failure {
            dead: if dead { BTreeSet::from([0]) } else { BTreeSet::new() },
            errors: vec![error],
            cause: None,
            step,
            dropped: 0,
            no_teachers: BTreeSet::new(),
            quiet_since: None,
            first_sign: None,
        };
        self.saved = None;
        let msg = ToWorker::Commit {
            step,
            checkpoint: Some(self.manifest()),
            wait: true,
            stored: None,
            origin: false,
        };
        self.pin_ps(step, m0.id);
        let sent = match self.conns.get_mut(&m0.conn).filter(|_| !self.membership.is_closed(m0.conn)) {
            Some(stream) => stream.send(&msg).map_err(|e| e.to_string()),
            None => Err("connection closed".into()),
        };
        if let Err(e) = sent {
            return Ok(Err(failure(format!("{name} lost: {e}"), true)));
        }
        let deadline = Instant::now() + self.cfg.step_timeout;
        loop {
            if let Some(result) = self.saved.take() {
                return Ok(result.map_err(|e| failure(format!("{name}: the final checkpoint: {e}"), false)));
            }
            if self.membership.is_closed(m0.conn) {
                return Ok(Err(failure(format!("{name} lost while writing the final checkpoint"), true)));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                self.scaler.stop(m0.id, Duration::from_secs(1));
                let t = self.cfg.step_timeout;
                return Ok(Err(failure(
                    format!("{name} wrote no final checkpoint within {t:?}; stopping it"),
                    true,
                )));
            }
            match self.receive(left.min(CHORES_EVERY)) {
                Ok(ev) => self.handle(ev),
                Err(mpsc::RecvTimeoutError::Timeout) => self.check_spawning(),
                Err(mpsc::RecvTimeoutError::Disconnected) => bail!("the control listener stopped"),
            }
        }
    }

    /// Records the checkpoint writes a rank reported.
    pub(super) fn take_written(&mut self, written: &[crate::control::proto::Written]) {
        for w in written {
            match &w.result {
                Ok(p) => {
                    (self.progress)(Progress::Checkpoint {
                        step: w.step,
                        path: p,
                        secs: w.secs,
                        bytes: w.bytes,
                    });
                    if let Some(s) = self.stopping.as_mut().filter(|s| s.asked == Some(w.step)) {
                        s.written = Some(p.clone());
                    }
                    if self.notice_checkpoint == Some(NoticeCheckpoint::Writing(w.step)) {
                        self.notice_checkpoint = None;
                        self.note(format!(
                            "the state of step {} is in a checkpoint: a worker told to go held it alone",
                            w.step
                        ));
                    }
                    self.checkpoints.retain(|c| c != p);
                    self.checkpoints.push(p.clone());
                    if self.ckpt.is_remote() {
                        // Object storage prunes as a directory does: the newest stay.
                        let keep = self.cfg.spec.keep_checkpoints.max(1);
                        let over = self.checkpoints.len().saturating_sub(keep);
                        self.checkpoints.drain(..over);
                    } else {
                        self.checkpoints.retain(|c| c.exists());
                    }
                }
                Err(e) => {
                    if self.notice_checkpoint == Some(NoticeCheckpoint::Writing(w.step)) {
                        // Asked for again at the next commit.
                        self.notice_checkpoint = Some(NoticeCheckpoint::Due);
                    }
                    self.note(format!("checkpoint of step {} failed: {e}", w.step))
                }
            }
        }
    }
}
