//! `edl-runtime launch --torchrun`: unmodified torchrun scripts.
//!
//! The launcher plays torchrun's elastic agent for this host. It starts the
//! group's ranks with the environment torchrun gives them (`RANK`,
//! `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `TORCHELASTIC_*`...), watches
//! them, and restarts the whole group when its membership changes, as
//! torchrun does. Unlike torchrun, the world size comes from the scaling
//! policy within `min..=max`: when the policy asks for another size the group
//! is stopped and started again at that size (a resize, which does not count
//! as a restart). A rank that fails stops the group, which starts again while
//! `max_restarts` allow; when they are spent the launcher gives up with the
//! failing rank's exit status, its log's last lines and, when the script
//! records one (torch's `@record`), its error file.
//!
//! What to do next is decided by [`RestartDecider`], a state machine fed with the
//! ranks' exits and the policy's actions; [`run`] does the processes, the
//! clock and the logs around it.

mod agent;
mod c10d;
mod follow;
mod hosts;
mod ranks;

pub use agent::{AgentArgs, run_agent};
pub use hosts::{HostsConfig, Lead, run_hosts};
pub use ranks::{Exit, Placement, RankFailure};

use crate::plugin::PolicyPlugin;
use crate::plugin::replay::{Decision, asked};
use anyhow::{Result, bail};
use c10d::GroupStore;
use edl_host_gpu::comm::auth::{JobAuth, Secret};
use edl_plugin_sdk::{Action, ClusterView};
use ranks::{Line, Ranks};
use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr},
    path::PathBuf,
    sync::mpsc,
    time::{Duration, Instant},
};

/// What the launcher does next.
#[derive(Debug, PartialEq)]
pub enum Next {
    /// Let the group run.
    Continue,
    /// Stop the group and start it again with `world` ranks; `failure`
    /// restarts count against the limit, resizes do not.
    Restart { world: u32, reason: String, failure: bool },
    /// Every rank of the group succeeded.
    Succeeded,
    /// A rank failed and no restart is left.
    Failed { rank: u32, exit: Exit },
    /// SIGTERM or SIGINT came to the launcher: the group is stopped with
    /// notice (its ranks get SIGTERM and the grace) and the job ends.
    Stopped { signal: i32 },
}

/// The launcher's decisions, without processes or clocks.
#[derive(Debug)]
pub struct RestartDecider {
    min: u32,
    max: u32,
    world: u32,
    restarts: u32,
    max_restarts: u32,
    /// Ranks of the running group that finished successfully.
    succeeded: BTreeSet<u32>,
}

impl RestartDecider {
    /// The decider of a job run as `cfg` says (its bounds, first group and restarts).
    pub fn of(cfg: &TorchrunConfig) -> RestartDecider {
        RestartDecider::new(cfg.min_workers, cfg.max_workers, cfg.initial_workers, cfg.max_restarts)
    }

    /// A decider whose first group has `initial` ranks (kept within `min..=max`).
    pub fn new(min: u32, max: u32, initial: u32, max_restarts: u32) -> RestartDecider {
        let min = min.max(1);
        let max = max.max(min);
        RestartDecider {
            min,
            max,
            world: initial.clamp(min, max),
            restarts: 0,
            max_restarts,
            succeeded: BTreeSet::new(),
        }
    }

    /// Ranks in the group to start (or running).
    pub fn world(&self) -> u32 {
        self.world
    }

    /// Failure restarts so far (`TORCHELASTIC_RESTART_COUNT`).
    pub fn restarts(&self) -> u32 {
        self.restarts
    }

    /// A new group started: none of its ranks has finished.
    pub fn started(&mut self) {
        self.succeeded.clear();
    }

    /// Rank `rank` of the running group ended with `exit`.
    pub fn exited(&mut self, rank: u32, exit: Exit) -> Next {
        if exit.success() {
            self.succeeded.insert(rank);
            return if self.succeeded.len() as u32 >= self.world { Next::Succeeded } else { Next::Continue };
        }
        if self.restarts >= self.max_restarts {
            return Next::Failed { rank, exit };
        }
        self.restarts += 1;
        Next::Restart {
            world: self.world,
            reason: format!("rank {rank} failed ({exit}); restart {}/{}", self.restarts, self.max_restarts),
            failure: true,
        }
    }

    /// A host of the running group was lost, `alive` hosts are left: the
    /// group restarts on them, or on `min` (the missing asked for). A change
    /// of membership, as in torchrun: not counted against `max_restarts`.
    pub fn lost(&mut self, host: &str, alive: u32) -> Next {
        self.world = alive.clamp(self.min, self.max);
        Next::Restart {
            world: self.world,
            reason: format!("host {host} lost; the group restarts on {} hosts", self.world),
            failure: false,
        }
    }

    /// The view the policy is shown now; `decisions` counts the policy's
    /// decisions so far (its `step`: an unmodified script reports no steps).
    pub fn view(&self, decisions: u64, since_change: Duration, price_per_worker_hour: f64) -> ClusterView {
        ClusterView {
            step: decisions,
            world_size: self.world,
            min_workers: self.min,
            max_workers: self.max,
            free_slots: self.max - self.world,
            secs_since_change: since_change.as_secs_f64(),
            price_per_worker_hour,
            ..ClusterView::default()
        }
    }

    /// The policy answered `actions` to `view`. A group some of whose ranks
    /// already finished is left to finish; a replacement is not a resize (a
    /// group restarts whole: replacing one rank would restart them all).
    pub fn decided(&mut self, view: &ClusterView, actions: &[Action]) -> Next {
        if !self.succeeded.is_empty() {
            return Next::Continue;
        }
        let target = asked(view, actions).clamp(self.min, self.max);
        if target == self.world {
            return Next::Continue;
        }
        let from = std::mem::replace(&mut self.world, target);
        Next::Restart {
            world: target,
            reason: format!("the policy asked for {target} ranks ({from} before)"),
            failure: false,
        }
    }
}

/// A `launch --torchrun` job.
#[derive(Clone, Debug)]
pub struct TorchrunConfig {
    /// `TORCHELASTIC_RUN_ID`.
    pub job: String,
    /// The script and its arguments, run as every rank.
    pub command: Vec<String>,
    /// Where each group's ranks log (`group-G/rank-R.log`).
    pub log_dir: PathBuf,
    pub min_workers: u32,
    pub max_workers: u32,
    pub initial_workers: u32,
    pub max_restarts: u32,
    /// Time between two policy decisions (counted from each group's start).
    pub decide_every: Duration,
    /// Time a stopped rank gets to exit after SIGTERM before SIGKILL.
    pub grace: Duration,
    pub price_per_worker_hour: f64,
}

impl TorchrunConfig {
    /// A job with torchrun's defaults on this host.
    pub fn new(job: &str, command: Vec<String>, log_dir: PathBuf) -> TorchrunConfig {
        TorchrunConfig {
            job: job.into(),
            command,
            log_dir,
            min_workers: 1,
            max_workers: 1,
            initial_workers: 1,
            max_restarts: 3,
            decide_every: Duration::from_secs(30),
            grace: Duration::from_secs(15),
            price_per_worker_hour: 0.0,
        }
    }
}

/// What happens, as it happens.
#[derive(Debug)]
pub enum GroupEvent<'a> {
    Started(&'a GroupRecord),
    /// A line a rank wrote (stdout or stderr).
    Output {
        rank: u32,
        line: &'a str,
    },
    /// The group stops for `reason` and starts again.
    Restarting {
        reason: &'a str,
        failure: bool,
    },
    /// The policy failed; the group holds its size.
    PolicyFailed(String),
    /// Hosts joining, leaving, lost (a group across hosts).
    Host(String),
}

/// One group: its size and how it ended.
#[derive(Clone, Debug, serde::Serialize)]
pub struct GroupRecord {
    pub group: u32,
    /// Ranks in the group.
    pub world: u32,
    /// For a group across hosts: its hosts, in `GROUP_RANK` order (each
    /// runs `world / hosts.len()` ranks); empty for a group on this host.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<String>,
    /// `TORCHELASTIC_RESTART_COUNT` its ranks saw.
    pub restart_count: u32,
    pub master_addr: String,
    pub master_port: u16,
    pub log_dir: PathBuf,
    /// Seconds since the job started.
    pub started_secs: f64,
    pub ended_secs: f64,
    /// `succeeded`, `resized to N`, `rank R failed (...)`.
    pub ended: String,
    /// Started by another launcher, whose job this one took over with the
    /// group running (it was not restarted).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub taken_over: bool,
}

/// How a `launch --torchrun` job went.
#[derive(Debug, serde::Serialize)]
pub struct TorchrunOutcome {
    pub groups: Vec<GroupRecord>,
    /// Failure restarts used.
    pub restarts: u32,
    pub max_restarts: u32,
    #[serde(skip)]
    pub decisions: Vec<Decision>,
    /// None: every rank of the last group succeeded, or the launcher was
    /// stopped.
    pub failure: Option<RankFailure>,
    pub secs: f64,
    /// The signal that stopped the launcher (SIGTERM: 15, SIGINT: 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped_by: Option<i32>,
}

/// Runs the job until its ranks succeed or a failure has no restart left.
pub fn run(
    cfg: &TorchrunConfig,
    policy: &mut dyn PolicyPlugin,
    on: &mut dyn FnMut(GroupEvent),
) -> Result<TorchrunOutcome> {
    if cfg.command.is_empty() {
        bail!("no program to launch");
    }
    let mut job = OneHost::new(cfg)?;
    loop {
        let mut group = job.start_group(on)?;
        let next = job.watch(&mut group, policy, on);
        let failure = match &next {
            Next::Failed { rank, exit } => Some(group.failure(*rank, *exit)),
            _ => None,
        };
        job.stop_group(group, on);
        if let Some(outcome) = job.group_ended(next, failure, on) {
            return Ok(outcome);
        }
    }
}

/// A job on this host as it runs: its groups so far and the decisions
/// that shaped them.
struct OneHost<'a> {
    cfg: &'a TorchrunConfig,
    decider: RestartDecider,
    groups: Vec<GroupRecord>,
    decisions: Vec<Decision>,
    /// When the group last changed size (the policy is shown how long ago).
    last_change: Instant,
    t0: Instant,
    /// What the ranks write: their group's number, the rank, the line.
    tx: mpsc::Sender<Line>,
    rx: mpsc::Receiver<Line>,
    /// The groups' c10d store, and the secret its bridge proves (this
    /// launcher's alone: nothing outside it reaches the store).
    store: GroupStore,
    store_auth: JobAuth,
}

impl<'a> OneHost<'a> {
    fn new(cfg: &'a TorchrunConfig) -> Result<Self> {
        let (tx, rx) = mpsc::channel();
        let secret =
            Secret::generate().map_err(|e| anyhow::anyhow!("a secret for the group's store: {e}"))?;
        let store_auth = JobAuth { job: cfg.job.clone(), secret };
        // Every rank is on this host: the store is served on its loopback.
        let store = GroupStore::serve(IpAddr::V4(Ipv4Addr::LOCALHOST), store_auth.clone())?;
        Ok(OneHost {
            cfg,
            decider: RestartDecider::of(cfg),
            groups: Vec::new(),
            decisions: Vec::new(),
            last_change: Instant::now(),
            t0: Instant::now(),
            tx,
            rx,
            store,
            store_auth,
        })
    }

    /// The running group's number.
    fn n(&self) -> u32 {
        self.groups.len() as u32 - 1
    }

    /// Starts the next group with the decider's world.
    fn start_group(&mut self, on: &mut dyn FnMut(GroupEvent)) -> Result<Ranks> {
        let (cfg, n) = (self.cfg, self.groups.len() as u32);
        self.store.open(n);
        self.groups.push(GroupRecord::next(n, cfg, &self.decider, self.t0, self.store.port()));
        let record = &self.groups[n as usize];
        let place = Placement {
            group: n,
            job: cfg.job.clone(),
            restart_count: record.restart_count,
            max_restarts: cfg.max_restarts,
            master_addr: record.master_addr.clone(),
            master_port: record.master_port,
            group_rank: 0,
            group_world: 1,
            nproc: record.world,
            log_dir: record.log_dir.clone(),
            extra_env: Vec::new(),
        };
        let group = Ranks::start(&cfg.command, &place, &self.store_auth, &self.tx)?;
        self.decider.started();
        on(GroupEvent::Started(record));
        Ok(group)
    }

    /// Watches the running group until something changes it: every rank
    /// done, a rank failed, or the policy resized it.
    fn watch(
        &mut self,
        group: &mut Ranks,
        policy: &mut dyn PolicyPlugin,
        on: &mut dyn FnMut(GroupEvent),
    ) -> Next {
        let n = self.n();
        let mut decide_at = Instant::now() + self.cfg.decide_every;
        loop {
            if let Some(signal) = crate::process::stop_requested() {
                return Next::Stopped { signal };
            }
            if let Some((rank, exit)) = group.poll() {
                match self.decider.exited(rank, exit) {
                    Next::Continue => continue,
                    next => return next,
                }
            }
            if Instant::now() >= decide_at {
                decide_at = Instant::now() + self.cfg.decide_every;
                let next =
                    decide(self.cfg, &mut self.decider, policy, &mut self.decisions, self.last_change, on);
                if next != Next::Continue {
                    return next;
                }
            }
            match self.rx.recv_timeout(Duration::from_millis(20)) {
                Ok((g, rank, line)) if g == n => on(GroupEvent::Output { rank, line: &line }),
                // A stopped group's last words.
                Ok(_) | Err(_) => {}
            }
        }
    }

    /// Stops the group's ranks and shows what they wrote last, before
    /// whatever comes next.
    fn stop_group(&mut self, mut group: Ranks, on: &mut dyn FnMut(GroupEvent)) {
        let n = self.n();
        group.stop(self.cfg.grace);
        drop(group);
        while let Ok((g, rank, line)) = self.rx.try_recv() {
            if g == n {
                on(GroupEvent::Output { rank, line: &line });
            }
        }
    }

    /// Records how the stopped group ended; the job's outcome when it is over.
    fn group_ended(
        &mut self,
        next: Next,
        failure: Option<RankFailure>,
        on: &mut dyn FnMut(GroupEvent),
    ) -> Option<TorchrunOutcome> {
        let record = self.groups.last_mut().expect("a record per group");
        record.ended_secs = self.t0.elapsed().as_secs_f64();
        match next {
            Next::Continue => unreachable!("a group is watched until it changes"),
            Next::Restart { world, reason, failure } => {
                record.ended = if failure { reason.clone() } else { format!("resized to {world}") };
                if !failure {
                    self.last_change = Instant::now();
                }
                on(GroupEvent::Restarting { reason: &reason, failure });
                None
            }
            Next::Stopped { signal } => {
                let mut outcome = TorchrunOutcome::end(
                    std::mem::take(&mut self.groups),
                    &self.decider,
                    self.cfg,
                    std::mem::take(&mut self.decisions),
                    None,
                    self.t0,
                );
                outcome.stop(signal);
                Some(outcome)
            }
            Next::Succeeded | Next::Failed { .. } => Some(TorchrunOutcome::end(
                std::mem::take(&mut self.groups),
                &self.decider,
                self.cfg,
                std::mem::take(&mut self.decisions),
                failure,
                self.t0,
            )),
        }
    }
}

impl TorchrunOutcome {
    /// The job's end: the last group's record says how it ended.
    fn end(
        mut groups: Vec<GroupRecord>,
        decider: &RestartDecider,
        cfg: &TorchrunConfig,
        decisions: Vec<Decision>,
        failure: Option<RankFailure>,
        t0: Instant,
    ) -> Self {
        if let Some(last) = groups.last_mut() {
            last.ended = match &failure {
                None => "succeeded".into(),
                Some(f) => format!("rank {} failed ({}), no restart left", f.rank, f.exit),
            };
        }
        TorchrunOutcome {
            groups,
            restarts: decider.restarts(),
            max_restarts: cfg.max_restarts,
            decisions,
            failure,
            secs: t0.elapsed().as_secs_f64(),
            stopped_by: None,
        }
    }

    /// The launcher was stopped by `signal`: its last group says so.
    fn stop(&mut self, signal: i32) {
        if let Some(last) = self.groups.last_mut() {
            last.ended = format!("stopped by {}", crate::process::signal_name(signal));
        }
        self.stopped_by = Some(signal);
    }
}

impl GroupRecord {
    /// The record of group `n`, starting now with the decider's world, its
    /// store on this host's `store_port`.
    fn next(n: u32, cfg: &TorchrunConfig, decider: &RestartDecider, t0: Instant, store_port: u16) -> Self {
        GroupRecord {
            group: n,
            world: decider.world(),
            hosts: Vec::new(),
            restart_count: decider.restarts(),
            master_addr: Ipv4Addr::LOCALHOST.to_string(),
            master_port: store_port,
            log_dir: cfg.log_dir.join(format!("group-{n}")),
            started_secs: t0.elapsed().as_secs_f64(),
            ended_secs: 0.0,
            ended: String::new(),
            taken_over: false,
        }
    }
}

/// Asks the policy once, records its decision, and says what the group must do.
fn decide(
    cfg: &TorchrunConfig,
    decider: &mut RestartDecider,
    policy: &mut dyn PolicyPlugin,
    decisions: &mut Vec<Decision>,
    last_change: Instant,
    on: &mut dyn FnMut(GroupEvent),
) -> Next {
    let view = decider.view(decisions.len() as u64, last_change.elapsed(), cfg.price_per_worker_hour);
    let actions = policy.decide(&view).unwrap_or_else(|e| {
        on(GroupEvent::PolicyFailed(format!("scaling policy failed, holding: {e}")));
        vec![Action::Hold]
    });
    let next = decider.decided(&view, &actions);
    decisions.push(Decision {
        step: view.step,
        world_size: view.world_size,
        chosen: decider.world(),
        throughput: 0.0,
        capacity: view.max_workers,
        actions,
    });
    next
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(a: &RestartDecider) -> ClusterView {
        a.view(0, Duration::ZERO, 0.0)
    }

    #[test]
    fn failures_restart_the_group_until_the_limit() {
        let mut a = RestartDecider::new(2, 2, 2, 2);
        a.started();
        let n = a.exited(1, Exit::Code(3));
        assert!(
            matches!(&n, Next::Restart { world: 2, failure: true, reason } if reason.contains("rank 1")),
            "{n:?}"
        );
        assert_eq!(a.restarts(), 1);
        a.started();
        assert!(matches!(a.exited(0, Exit::Signal(9)), Next::Restart { failure: true, .. }));
        a.started();
        assert_eq!(a.exited(1, Exit::Code(3)), Next::Failed { rank: 1, exit: Exit::Code(3) });
        assert_eq!(a.restarts(), 2);
    }

    #[test]
    fn a_lost_host_restarts_the_group_on_the_survivors_and_is_no_failure_restart() {
        let mut a = RestartDecider::new(2, 4, 4, 0);
        a.started();
        let n = a.lost("h3", 3);
        assert!(
            matches!(&n, Next::Restart { world: 3, failure: false, reason } if reason.contains("h3")),
            "{n:?}"
        );
        assert_eq!((a.world(), a.restarts()), (3, 0));
        // Below the minimum: the group waits for `min` hosts again.
        assert!(matches!(a.lost("h2", 1), Next::Restart { world: 2, failure: false, .. }));
        // And a rank failure still counts (none is left here).
        a.started();
        assert_eq!(a.exited(0, Exit::Code(1)), Next::Failed { rank: 0, exit: Exit::Code(1) });
    }

    #[test]
    fn the_group_succeeds_when_every_rank_has() {
        let mut a = RestartDecider::new(1, 4, 3, 0);
        a.started();
        assert_eq!(a.exited(2, Exit::Code(0)), Next::Continue);
        assert_eq!(a.exited(0, Exit::Code(0)), Next::Continue);
        assert_eq!(a.exited(1, Exit::Code(0)), Next::Succeeded);
    }

    #[test]
    fn resizes_follow_the_policy_within_the_bounds_and_are_not_restarts() {
        let mut a = RestartDecider::new(1, 3, 1, 0);
        a.started();
        let v = view(&a);
        assert_eq!(v.free_slots, 2);
        let n = a.decided(&v, &[Action::ScaleOut(5)]);
        assert!(matches!(n, Next::Restart { world: 3, failure: false, .. }), "{n:?}");
        assert_eq!((a.world(), a.restarts()), (3, 0));
        a.started();
        assert_eq!(a.decided(&view(&a), &[Action::Hold]), Next::Continue);
        assert_eq!(a.decided(&view(&a), &[Action::Replace(1)]), Next::Continue, "a replacement is no resize");
        assert!(matches!(a.decided(&view(&a), &[Action::ScaleIn(9)]), Next::Restart { world: 1, .. }));
    }

    #[test]
    fn a_finishing_group_is_not_resized() {
        let mut a = RestartDecider::new(1, 3, 2, 0);
        a.started();
        assert_eq!(a.exited(0, Exit::Code(0)), Next::Continue);
        assert_eq!(a.decided(&view(&a), &[Action::ScaleOut(1)]), Next::Continue);
        assert_eq!(a.world(), 2);
    }

    #[test]
    fn error_files_in_torch_s_format_give_their_message() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("e.json");
        assert_eq!(ranks::error_message(&p), None);
        std::fs::write(&p, r#"{"message": {"message": "RuntimeError: boom", "extraInfo": {}}}"#).unwrap();
        assert_eq!(ranks::error_message(&p).as_deref(), Some("RuntimeError: boom"));
        std::fs::write(&p, r#"{"message": "plain"}"#).unwrap();
        assert_eq!(ranks::error_message(&p).as_deref(), Some("plain"));
        std::fs::write(&p, "not json").unwrap();
        assert_eq!(ranks::error_message(&p), None);
    }
}
