//! The workers as they come and go: the membership's commands carried out
//! (plans, stops, starts), what the control connections say, starters that
//! die before joining, failures that end a generation, and worker leases.

use super::records::*;
use super::{CRASH_LOG_LINES, Coordinator, SECOND};
use crate::control::inbox::Inbound;
use crate::coordinator::machine::timers::Timer;
use crate::scalers::Scaler;

use crate::control::proto::{FromWorker, ToWorker};
use crate::coordinator::machine::membership::{Command, MemberEvent, Worker};
use crate::coordinator::machine::pipeline::Failure;
use crate::store::keys;
use anyhow::{Result, bail};
use edl_host_gpu::comm::auth::JobAuth;
use std::{
    collections::BTreeSet,
    sync::mpsc,
    time::{Duration, Instant},
};

/// How long a member whose connection was lost may live on before its
/// process tree is killed: time for one that is exiting anyway (an error's
/// traceback, its loaders' teardown) to end by itself and report why.
const LINGER: Duration = Duration::from_secs(1);

/// A worker's lease in the store lasts this long, refreshed every
/// [`LEASE_ROUNDS`] seconds.
const WORKER_LEASE: Duration = Duration::from_secs(30);
const LEASE_ROUNDS: u64 = 10;

impl Coordinator<'_> {
    /// Carries out what membership decided.
    pub(super) fn execute(&mut self) {
        while let Some(cmd) = self.membership.poll_command() {
            match cmd {
                Command::Spawn { worker } => {
                    let auth = JobAuth { job: self.cfg.spec.job.clone(), secret: self.cfg.secret.clone() };
                    if let Err(e) = self.scaler.spawn(worker, &self.io.addr, &auth) {
                        self.membership.spawn_failed(worker, crate::error_line(&e));
                    }
                }
                Command::Welcome { conn, assigned } => {
                    // A failed send closes the connection; its reader reports that.
                    let welcome = ToWorker::Welcome(Box::new(self.told_spec()));
                    if let Some(stream) = self.conns.get_mut(&conn) {
                        if let Some(worker) = assigned {
                            let _ = stream.send(&ToWorker::Assigned { worker });
                        }
                        let _ = stream.send(&welcome);
                        self.beats.add(conn, stream);
                    }
                }
                Command::Refuse { conn, reason } => {
                    if let Some(mut stream) = self.drop_conn(conn) {
                        let _ = stream.send(&ToWorker::Stop { reason });
                    }
                }
                Command::Stop { worker, conn, reason, grace } => {
                    if let Some(mut stream) = conn.and_then(|c| self.drop_conn(c)) {
                        let _ = stream.send(&ToWorker::Stop { reason });
                    }
                    self.scaler.stop(worker, grace);
                    self.forget(worker);
                }
                Command::Note { text, log_of } => {
                    let log = log_of.map(|id| self.log_tail(id)).unwrap_or_default();
                    self.note(format!("{text}{log}"));
                }
            }
        }
    }

    /// Handles one inbound event: membership's, or the generation's step barrier's.
    pub(super) fn handle(&mut self, ev: Inbound) {
        let now = Instant::now();
        match ev {
            Inbound::Conn(n, s, _) => {
                self.conns.insert(n, s);
            }
            Inbound::Msg(n, FromWorker::Hello { worker, pid, protocol }) => {
                if self.speaks(n, worker, protocol) {
                    self.membership.handle(now, MemberEvent::Hello { conn: n, worker, pid });
                }
            }
            Inbound::Msg(n, FromWorker::Leaving { reason }) => {
                if let Some(id) = self.membership.worker_on(n) {
                    self.note(format!(
                        "worker {id} was told to go ({reason}); it leaves at the next step boundary"
                    ));
                    self.leaving.push((id, reason));
                }
            }
            Inbound::Msg(n, FromWorker::Return { worker, pid, rollback, protocol }) => {
                if !self.speaks(n, worker, protocol) {
                    return;
                }
                let holds = rollback.contains(&self.tally.committed);
                self.membership.handle(now, MemberEvent::Returned { conn: n, worker, pid, holds });
            }
            // The inbox keeps heartbeats to itself; one that got here says nothing new.
            Inbound::Msg(_, FromWorker::Heartbeat) => {}
            Inbound::Msg(n, FromWorker::Ready { samples }) => match self.take_samples(samples) {
                Ok(()) => {
                    self.membership.handle(now, MemberEvent::Ready { conn: n });
                    self.tell_readied();
                }
                Err(why) => {
                    self.fatal.get_or_insert(why);
                }
            },
            Inbound::Msg(n, FromWorker::Saved { checkpoints }) => {
                if let Some(id) = self.membership.worker_on(n) {
                    self.unpin_ps(id, &checkpoints);
                }
                self.take_written(&checkpoints);
                if let Some(w) = checkpoints.into_iter().rfind(|w| w.step == self.tally.committed) {
                    self.saved = Some(w.result);
                }
            }
            Inbound::Msg(n, FromWorker::Done { generation, steps, setup_ms }) => {
                if let (Some(&rank), Some(p)) = (self.ranks.get(&n), self.pipe.as_mut())
                    && p.generation == generation
                {
                    p.report(now, rank, steps, setup_ms);
                }
            }
            Inbound::Host(host, carried, FromWorker::Done { generation, steps, setup_ms }) => {
                self.host_done(now, host, &carried, generation, steps, setup_ms)
            }
            // A relay sums reports only.
            Inbound::Host(..) => {}
            // Before its workers' ends.
            Inbound::RelayLost(id, conns) => self.relay_lost(id, &conns),
            // One that cannot take them is shut; its reader says so.
            Inbound::ToRelay(out, frames) => {
                let _ = out.send(&frames);
            }
            Inbound::Msg(n, FromWorker::Failed { generation, error, cause, .. }) => {
                if let (Some(&rank), Some(p)) = (self.ranks.get(&n), self.pipe.as_mut())
                    && p.generation == generation
                {
                    p.fail(now, rank, error, cause);
                }
            }
            Inbound::Closed(n, why) => self.closed(now, n, &why),
        }
        self.execute();
    }

    /// Whether worker `worker` on connection `n` speaks this coordinator's
    /// control protocol; one that does not is told why and let go (it
    /// would take what it cannot read for a broken connection).
    fn speaks(&mut self, n: u64, worker: u64, protocol: u32) -> bool {
        let Some(why) = crate::control::proto::protocol_mismatch(&format!("worker {worker}"), protocol)
        else {
            return true;
        };
        self.note(format!("{why}; it is refused"));
        if let Some(mut stream) = self.drop_conn(n) {
            let _ = stream.send(&ToWorker::Stop { reason: why });
        }
        false
    }

    /// Forgets connection `n`: it is beaten no more. Returns its outbox, for
    /// a last word.
    fn drop_conn(&mut self, n: u64) -> Option<crate::control::outbox::Outbox> {
        self.beats.remove(n);
        self.conns.remove(&n)
    }

    /// Connection `n` closed: a member's rank is lost to its generation.
    fn closed(&mut self, now: Instant, n: u64, why: &str) {
        // The routes stay: the ranks' windows went out by them, and a
        // closed one's rank fails its generation anyway.
        self.drop_conn(n);
        let rank = self.ranks.get(&n).copied();
        let Some(worker) = self.membership.handle(now, MemberEvent::Closed { conn: n, why: why.to_string() })
        else {
            return;
        };
        // A process that went silent for its lease (hung, frozen) lives on
        // and would hold its peers' collectives to their timeout: killed if
        // still there shortly. One that hung up is ending by itself.
        if why.contains(crate::control::inbox::SILENT) {
            self.scaler.kill_if_lingering(worker, LINGER);
        }
        if let (Some(rank), Some(p)) = (rank, self.pipe.as_mut()) {
            p.lost(now, rank, why);
        }
    }

    /// Relay `id` was lost with the workers on its connections `conns`:
    /// the scaler starts another for those that follow. Their processes
    /// live on, cut off: stopped now, so that their sockets close and the
    /// others' collectives end then, not at their timeout. No grace: a
    /// scaler's stop is a SIGTERM first (a worker's session takes it as
    /// notice), then a kill.
    fn relay_lost(&mut self, id: u64, conns: &[u64]) {
        self.scaler.relay_lost(id);
        for worker in conns.iter().filter_map(|&n| self.membership.worker_on(n)) {
            self.scaler.stop(worker, Duration::ZERO);
        }
    }

    /// A worker's program said how many samples its data set holds: the
    /// job's samples when it was launched without `--samples`, else checked
    /// against them.
    fn take_samples(&mut self, declared: Option<u64>) -> Result<(), String> {
        match (self.tally.train_len(), declared) {
            (0, Some(n)) if n > crate::trainer::data::MAX_SAMPLES as u64 => Err(format!(
                "the program's data set declares {n} samples (len(dataset)); a job holds at most {} \
                 (a step's positions are 32-bit)",
                crate::trainer::data::MAX_SAMPLES
            )),
            (0, Some(n)) if n > 0 => {
                let n = n as usize;
                if self.hyper.global_batch as usize > n {
                    return Err(format!(
                        "--batch {} is above the {n} samples the program's data set holds",
                        self.hyper.global_batch
                    ));
                }
                self.tally.learn_train_len(n);
                self.note(format!(
                    "the job's samples: {n}, as its first worker's program declared (len(dataset))"
                ));
                Ok(())
            }
            (0, _) => Err("the job's samples are unknown: `launch` was given no --samples and the program \
                 declared none before its first step (edl.torch.ElasticLoader declares len(dataset); or set \
                 job.samples = len(dataset))"
                .into()),
            (len, Some(n)) if n as usize != len => Err(format!(
                "a worker's program declared {n} samples; the job has {len} (from --samples, a checkpoint or \
                 its first worker): every worker must read the same data set"
            )),
            _ => Ok(()),
        }
    }

    /// Stops the job when a worker's program declared what cannot be.
    pub(super) fn check_fatal(&mut self) -> Result<()> {
        match self.fatal.take() {
            Some(why) => bail!("{why}"),
            None => Ok(()),
        }
    }

    /// Notices started workers that died before joining, and gives up those
    /// past the join timeout.
    pub(super) fn check_spawning(&mut self) {
        for (worker, how) in self.scaler.kill_lingering() {
            self.note(format!(
                "worker {worker} went silent for its lease and still ran a second later: {how}"
            ));
        }
        let now = Instant::now();
        for (worker, why) in self.scaler.failed_spawns() {
            self.membership.spawn_failed(worker, why);
        }
        for (worker, status) in self.scaler.exited() {
            self.membership.handle(now, MemberEvent::Exited { worker, status });
        }
        self.membership.handle_timeout(now);
        self.execute();
    }

    /// Waits for joiners until at least `want` are there (or nothing is starting).
    pub(super) fn wait_for_joiners(&mut self, want: usize) -> Result<()> {
        while self.membership.joiners() < want && !self.membership.nothing_loading() {
            match self.receive(Duration::from_millis(100)) {
                Ok(ev) => {
                    // Whatever else has arrived too: the checks below look
                    // at every worker on its way, once per batch.
                    self.handle(ev);
                    while let Ok(ev) = self.io.rx.try_recv() {
                        self.handle(ev);
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => bail!("the control listener stopped"),
            }
            self.check_fatal()?;
            self.stop_signalled()?;
            self.check_spawning();
        }
        if self.membership.joiners() == 0 {
            let last = self.membership.start_failed().map(|w| format!("; the scaler could not start {w}"));
            bail!("no worker joined the job{} (worker logs: {})", last.unwrap_or_default(), self.log_hint());
        }
        Ok(())
    }

    /// A host's ranks reported a window as one (`carried`: their numbers
    /// on relay `host`).
    fn host_done(
        &mut self,
        now: Instant,
        host: u64,
        carried: &[u64],
        generation: u64,
        steps: Vec<crate::control::proto::StepDone>,
        setup_ms: f64,
    ) {
        if self.pipe.as_ref().is_none_or(|p| p.generation != generation) {
            return; // A generation that is over.
        }
        let Some(ranks) = self.reported_ranks(host, carried) else {
            // Only a relay at fault names a worker it does not carry.
            tracing::warn!("a relay reported for a worker it does not carry; ignored");
            return;
        };
        if let Some(p) = self.pipe.as_mut() {
            p.report_group(now, &ranks, steps, setup_ms);
        }
    }

    /// The ranks of a host's report: the run its relay (connection `host`)
    /// was sent the window for, when the report names that run's workers
    /// (`carried`, their numbers on the relay), as it does; otherwise each
    /// looked up among the relay's workers (`None` if one is not there, or
    /// they are not consecutive ranks in order).
    fn reported_ranks(&mut self, host: u64, carried: &[u64]) -> Option<Vec<usize>> {
        // The routes the windows went out by, as they are: checking them
        // against the members at each of a window's host reports would cost
        // O(ranks) each. They are made again only when the members change,
        // which a generation's pipeline (the report's) does not outlive.
        let routes = match self.routes {
            Some(ref r) => r,
            None => super::routes::Routes::of(&mut self.routes, self.membership.members(), &self.conns),
        };
        if let Some(run) = routes.carried_by(host, carried) {
            return Some((run.first..run.end).collect());
        }
        let on_relay: std::collections::HashMap<u64, u64> = self
            .conns
            .iter()
            .filter_map(|(&n, out)| out.relay().filter(|(h, ..)| *h == host).map(|(_, c, _)| (c, n)))
            .collect();
        let ranks: Vec<usize> = carried
            .iter()
            .map(|c| on_relay.get(c).and_then(|n| self.ranks.get(n)).copied())
            .collect::<Option<_>>()?;
        ranks.windows(2).all(|w| w[1] == w[0] + 1).then_some(ranks)
    }

    /// The end of worker `id`'s log, for a note about its failure.
    pub(super) fn log_tail(&self, id: u64) -> String {
        self.scaler.log_of(id).map(|p| crate::process::log_tail(&p, CRASH_LOG_LINES)).unwrap_or_default()
    }

    pub(super) fn log_hint(&self) -> String {
        self.scaler
            .log_of(0)
            .and_then(|p| p.parent().map(|d| d.display().to_string()))
            .unwrap_or_else(|| "the scaler's".into())
    }

    /// The generation failed: drop the dead, keep the survivors for the next one.
    pub(super) fn fail(&mut self, f: Failure) {
        let from = self.membership.world();
        let dead: BTreeSet<u64> =
            f.dead.iter().filter_map(|&r| self.membership.members().get(r).map(|m| m.id)).collect();
        self.membership.fail(Instant::now(), &dead);
        self.execute();
        self.lost.extend(&dead);
        let why = if f.errors.is_empty() { "a rank failed".to_string() } else { f.errors.join("; ") };
        let ahead = match f.dropped {
            0 | 1 => String::new(),
            n => format!(", {} later step(s) sent ahead dropped", n - 1),
        };
        let world = self.membership.world();
        if self.tally.epoch >= self.cfg.spec.epochs {
            self.note(format!(
                "the final checkpoint (step {}) was not written (generation {}): {why}; {world} worker(s) left",
                f.step, self.generation
            ));
        } else {
            self.note(format!(
                "step {} not committed (generation {}{ahead}): {why}; redoing it with {world} worker(s)",
                f.step, self.generation
            ));
            let redone = f.dropped.max(1) as u64;
            self.redone_steps += redone;
            (self.progress)(Progress::Redone { step: f.step, redone, failed: true });
        }
        let lost: Vec<String> = dead.iter().map(|d| format!("worker {d} lost")).collect();
        let reason = if lost.is_empty() { "collective failed".to_string() } else { lost.join(", ") };
        let mut pending = Pending { failure: true, ..Pending::new(from, reason) };
        if let (Some(quiet), Some(sign)) = (f.quiet_since, f.first_sign) {
            // The pause is the whole time without a commit: from the last
            // window every rank finished, through detecting the failure and
            // the survivors' collectives ending, to the next commit.
            pending.boundary = quiet;
            pending.first_sign = Some(sign);
            pending.settled = Some(Instant::now());
        }
        self.pending = Some(pending);
    }

    /// Removes a worker's lease from the store.
    pub(super) fn forget(&mut self, id: u64) {
        if let Some(k) = &self.keeper {
            k.delete(format!("{}{id}", keys::workers(&self.cfg.spec.job)));
        }
    }

    /// Tells the watchers how long the workers that became ready took.
    fn tell_readied(&mut self) {
        for r in self.membership.take_readied() {
            let (start_secs, load_secs) = (r.start.as_secs_f64(), r.load.as_secs_f64());
            (self.progress)(Progress::WorkerReady { id: r.id, start_secs, load_secs });
        }
    }

    /// Tells the watchers the workers and where each stands, when that changed.
    fn tell_workers(&mut self) {
        let on_the_way = self.membership.on_the_way();
        let scaler = &self.scaler;
        let changed =
            workers_now(&self.told_workers, self.membership.members(), &on_the_way, |id| scaler.handle(id));
        if let Some(now) = changed {
            (self.progress)(Progress::Workers(&now));
            self.told_workers = now;
        }
    }

    /// Keeps the members' leases in the store fresh: every member's when a
    /// generation forms, and a tenth of them each second after (each lease
    /// lasts [`WORKER_LEASE`], so a job of thousands of workers writes
    /// hundreds a second, not thousands).
    pub(super) fn lease_members(&mut self, now: Instant) {
        let due = self.timers.fire(Timer::WorkerLeases, now, SECOND);
        let all = std::mem::take(&mut self.lease_now);
        if !due && !all {
            return;
        }
        self.timers.set(Timer::WorkerLeases, now + SECOND);
        self.tell_workers();
        let Some(k) = &self.keeper else { return };
        let prefix = keys::workers(&self.cfg.spec.job);
        let records = LeaseRecords::of(&mut self.leases, &prefix, self.generation, self.membership.members());
        // A second that comes twice or is skipped leaves a lease 20 s
        // unrefreshed, within its 30.
        let round = self.started.elapsed().as_secs() % LEASE_ROUNDS;
        for r in records.each.iter().filter(|r| all || r.id % LEASE_ROUNDS == round) {
            k.lease(r.key.clone(), r.value.clone(), WORKER_LEASE);
        }
    }
}

/// The workers and where each stands (`members` in rank order, then those
/// on their way), when that differs from `told`; None when it does not.
/// The members' part, the bulk of a large job, is made again only when the
/// members are others than those told (ids and ranks compared): not
/// thousands of records made and compared each second to find nothing new.
fn workers_now(
    told: &[WorkerState],
    members: &[Worker],
    on_the_way: &[(u64, &str)],
    handle: impl Fn(u64) -> Option<String>,
) -> Option<Vec<WorkerState>> {
    let kept = told.len() >= members.len()
        && told.iter().zip(members).enumerate().all(|(rank, (w, m))| w.id == m.id && w.rank == Some(rank));
    let rest: Vec<WorkerState> = on_the_way
        .iter()
        .map(|&(id, stage)| {
            let stage = match stage {
                "still starting" => "starting",
                "still loading the job" => "loading",
                "a warm spare, ready" => "spare",
                s if s.starts_with("a warm spare") => "spare starting",
                _ => "ready",
            };
            WorkerState { id, rank: None, stage: stage.into(), handle: handle(id) }
        })
        .collect();
    let mut now = if kept {
        if told[members.len()..] == rest[..] {
            return None;
        }
        told[..members.len()].to_vec()
    } else {
        let each = |(rank, m): (usize, &Worker)| WorkerState {
            id: m.id,
            rank: Some(rank),
            stage: "training".into(),
            handle: handle(m.id),
        };
        members.iter().enumerate().map(each).collect()
    };
    now.extend(rest);
    Some(now)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn the_workers_are_told_again_only_when_members_or_those_on_their_way_change() {
        let asked = Cell::new(0);
        let handle = |id: u64| {
            asked.set(asked.get() + 1);
            Some(format!("pid {}", 100 + id))
        };
        let members: Vec<Worker> = [4, 7, 9].map(Worker::numbered).to_vec();
        let first = workers_now(&[], &members, &[(11, "still starting")], handle).expect("new");
        let shape = |l: &[WorkerState]| -> Vec<(u64, Option<usize>, String)> {
            l.iter().map(|w| (w.id, w.rank, w.stage.clone())).collect()
        };
        assert_eq!(
            shape(&first),
            vec![
                (4, Some(0), "training".into()),
                (7, Some(1), "training".into()),
                (9, Some(2), "training".into()),
                (11, None, "starting".into())
            ]
        );
        assert_eq!(first[1].handle.as_deref(), Some("pid 107"));
        // Nothing changed: nothing told, and only the one on its way looked at again.
        asked.set(0);
        assert_eq!(workers_now(&first, &members, &[(11, "still starting")], handle), None);
        assert_eq!(asked.get(), 1);
        // Only the one on its way moved on: the members' records are kept as told.
        asked.set(0);
        let second = workers_now(&first, &members, &[(11, "a warm spare, ready")], handle).expect("changed");
        assert_eq!(asked.get(), 1);
        assert_eq!(second[..3], first[..3]);
        assert_eq!(shape(&second[3..]), vec![(11, None, "spare".into())]);
        // A member lost (the list is shorter, its old record follows the kept
        // prefix): told again, without it.
        let fewer: Vec<Worker> = [4, 7].map(Worker::numbered).to_vec();
        let third = workers_now(&second, &fewer, &[], handle).expect("changed");
        assert_eq!(shape(&third), vec![(4, Some(0), "training".into()), (7, Some(1), "training".into())]);
        // Others in the same places, or the same ones in other ranks: made again.
        let moved: Vec<Worker> = [7, 4].map(Worker::numbered).to_vec();
        let fourth = workers_now(&third, &moved, &[], handle).expect("changed");
        assert_eq!(shape(&fourth), vec![(7, Some(0), "training".into()), (4, Some(1), "training".into())]);
    }
}
