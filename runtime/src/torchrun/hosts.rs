//! `launch --torchrun` across hosts: one agent per host, the group's
//! membership from the launcher.
//!
//! Each host runs `edl-runtime agent` (started by the `command` scaler, or
//! by hand or another engine with the `external` one). The agent proves
//! the job's secret on the launcher's port, says which address its host is
//! reached at, and runs its host's `--nproc-per-node` ranks of each group
//! it is given, with the environment torchrun gives them across hosts
//! (`GROUP_RANK`, `GROUP_WORLD_SIZE`, `LOCAL_WORLD_SIZE`, global `RANK`;
//! `MASTER_ADDR` is the host's own loopback bridge to the group's c10d
//! store, see [`c10d`](super::c10d)). The launcher decides as on
//! one host ([`RestartDecider`]): the policy sizes the number of hosts, a failed rank
//! restarts the group while restarts are left, and a host that is lost (its
//! agent's connection closed, or silent for the lease) restarts the group
//! on the hosts that are left: a change of membership, as in torchrun, not
//! counted against `--max-restarts`.
//!
//! A group starts in two moves: group rank 0's host first, which serves
//! the group's c10d store (sealed) on its own address and says on which
//! port, then every other host with that port.

use super::follow::{Adopt, Hold, adopt};
use super::ranks::{Exit, RankFailure};
use super::{GroupEvent, GroupRecord, Next, RestartDecider, TorchrunConfig, TorchrunOutcome, decide};
use crate::control::{
    inbox::{self, Inbound, Message},
    proto,
};
use crate::coordinator::{AlreadyFinished, RETURN_WITHIN};
use crate::job::spec::{Follow, Leader};
use crate::leader::keeper::Fenced;
use crate::leader::record::GroupHandover;
use crate::net::Addresses;
use crate::plugin::PolicyPlugin;
use crate::plugin::replay::Decision;
use crate::scalers::Scaler;
use anyhow::{Context, Result, bail};
use edl_host_gpu::comm::auth::JobAuth;
use serde::{Deserialize, Serialize};
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    time::{Duration, Instant},
};

/// What an agent tells the launcher.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum FromAgent {
    /// The agent's id (0: let the launcher give one), the address other
    /// hosts reach its host at, and its pid there.
    Hello {
        agent: u64,
        host: String,
        pid: u32,
        /// The group whose ranks it runs: an agent that lost its launcher
        /// and comes back to the one that took the job over.
        #[serde(default)]
        running: Option<u32>,
        /// The control protocol it speaks ([`crate::control::proto::PROTOCOL`];
        /// 0: an edl from before the number).
        #[serde(default)]
        protocol: u32,
    },
    Heartbeat,
    /// Its ranks of `group` started; `master_port` is the c10d store's
    /// port when it holds group rank 0.
    Started {
        group: u32,
        master_port: u16,
    },
    /// A line one of its ranks wrote.
    Output {
        group: u32,
        rank: u32,
        line: String,
    },
    /// A rank ended; a failure says what is known of it.
    Exited {
        group: u32,
        rank: u32,
        exit: Exit,
        failure: Option<RankFailure>,
    },
    /// Its ranks of `group` are gone (after a stop).
    Stopped {
        group: u32,
    },
}

impl Message for FromAgent {
    fn is_heartbeat(&self) -> bool {
        matches!(self, FromAgent::Heartbeat)
    }
}

/// What the launcher tells an agent.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToAgent {
    /// The job: what each rank runs, how many ranks a host runs, how often
    /// to send heartbeats and how long a stopped rank gets before SIGKILL.
    Welcome {
        agent: u64,
        job: String,
        command: Vec<String>,
        nproc: u32,
        max_restarts: u32,
        heartbeat_ms: u64,
        grace_ms: u64,
        /// The job's store and this launcher's lease token: an agent that
        /// loses the launcher keeps its ranks and follows the launcher the
        /// store names with a higher token (None: nobody takes over).
        #[serde(default)]
        follow: Option<Follow>,
        /// How long such an agent looks for that launcher, and how long a
        /// launcher may be silent before it counts as lost, ms.
        #[serde(default)]
        reconnect_ms: u64,
        #[serde(default)]
        lease_ms: u64,
        /// The control protocol the launcher speaks.
        #[serde(default)]
        protocol: u32,
    },
    /// The launcher is alive (a few times per lease).
    Heartbeat,
    /// Start this host's ranks of `group`. `master_port` 0: this host holds
    /// group rank 0 and serves the group's store on its own address.
    Start {
        group: u32,
        group_rank: u32,
        group_world: u32,
        restart_count: u32,
        master_addr: String,
        master_port: u16,
    },
    /// Stop the ranks of `group` and say so.
    Stop { group: u32 },
    /// Leave: the job is over for this host, or it was scaled in.
    Exit { reason: String },
}

/// How the launcher meets its agents.
pub struct HostsConfig {
    /// Ranks each host runs (`--nproc-per-node`).
    pub nproc: u32,
    pub addresses: Addresses,
    pub auth: JobAuth,
    /// An agent not heard from for this long is lost (with its host).
    pub lease: Duration,
    /// How long an agent asked for may take to join.
    pub join_timeout: Duration,
    /// A shared store through which the launcher leads the job, so that
    /// its groups outlive it (None: the job ends with the launcher).
    pub lead: Option<Lead>,
}

/// Leading the job through a shared store.
pub struct Lead {
    /// `redis://...`, `etcd://...` (told to the agents only over their
    /// sealed connections: it may hold a password).
    pub store: String,
    /// Wait for the job's lease and take the job over (`--standby`).
    pub standby: bool,
    /// Start a job that finished (or failed) under a launcher before
    /// again (`--restart`).
    pub restart: bool,
    /// How long an agent that lost its launcher looks for the next one.
    pub reconnect: Duration,
}

/// An agent that joined.
struct Joined {
    conn: u64,
    host: String,
    to: crate::control::outbox::Sender,
}

/// The launcher's side: the agents, the scaler that starts them, the
/// events, and the groups it runs on them.
struct Launcher<'a> {
    cfg: &'a TorchrunConfig,
    hc: HostsConfig,
    scaler: &'a mut dyn Scaler,
    rx: mpsc::Receiver<Inbound<FromAgent>>,
    /// Connections that proved the secret and have not said hello yet.
    fresh: HashMap<u64, crate::control::outbox::Outbox>,
    /// Joined agents, by id (group ranks are given in id order).
    agents: BTreeMap<u64, Joined>,
    /// Agents asked for and not joined yet: id -> when asked.
    asked: BTreeMap<u64, Instant>,
    next_id: u64,
    /// Where agents connect (`host:port`).
    addr: String,
    /// The job's lease and record in a shared store.
    hold: Option<Hold>,
    /// Why this launcher no longer leads the job: it does nothing more.
    deposed: Option<Fenced>,
    /// The group agents may come back running (a job taken over), and
    /// those that did.
    returning: Option<(u32, Vec<u64>)>,
    back: BTreeSet<u64>,
    /// What agents that came back said during the return (ranks that
    /// exited while the job had no launcher), for the group they run.
    replay: std::collections::VecDeque<(u64, FromAgent)>,
    /// While set, each agent's heartbeat thread tells it this launcher is
    /// alive (cleared once deposed, so its agents hear the silence).
    leading: Arc<AtomicBool>,
    policy: &'a mut dyn PolicyPlugin,
    /// What the group does next, from the ranks' exits and the policy.
    decider: RestartDecider,
    /// The groups so far, the running one last.
    groups: Vec<GroupRecord>,
    decisions: Vec<Decision>,
    /// When the group last changed size (the policy is shown how long ago).
    last_change: Instant,
    /// What is known of the last rank that failed.
    last_failure: Option<RankFailure>,
    t0: Instant,
}

/// Why a message did not reach an agent.
#[derive(Debug, thiserror::Error)]
enum SendError {
    #[error("this launcher no longer leads the job")]
    Deposed,
    #[error("agent {0} is gone")]
    Gone(u64),
    #[error("agent {id} on {host}: {cause}")]
    Failed { id: u64, host: String, cause: proto::ProtoError },
}

/// What one event meant for the running group.
enum Happened {
    Nothing,
    /// A member of the group was lost: its id, host and why.
    Lost(u64, String, String),
    /// An agent joined (not in the group).
    Joined,
    Msg(u64, FromAgent),
}

impl Launcher<'_> {
    /// Takes one event off the connections; `members` are the ids in the running group.
    fn event(&mut self, wait: Duration, members: &[u64], on: &mut dyn FnMut(GroupEvent)) -> Happened {
        if self.deposed() {
            std::thread::sleep(wait);
            return Happened::Nothing;
        }
        if let Some((id, msg)) = self.replay.pop_front() {
            return Happened::Msg(id, msg);
        }
        let ev = match self.rx.recv_timeout(wait) {
            Ok(ev) => ev,
            Err(_) => return Happened::Nothing,
        };
        // A launcher frozen in the wait above may have been deposed meanwhile.
        if self.deposed() {
            return Happened::Nothing;
        }
        match ev {
            Inbound::Conn(n, stream, _) => {
                self.fresh.insert(n, stream);
                Happened::Nothing
            }
            // A hello on a connection that already joined is not one.
            Inbound::Msg(n, FromAgent::Hello { .. }) if !self.fresh.contains_key(&n) => Happened::Nothing,
            Inbound::Msg(n, FromAgent::Hello { agent, host, pid, running, protocol }) => {
                match crate::control::proto::protocol_mismatch(
                    &format!("the agent on {host} (pid {pid})"),
                    protocol,
                ) {
                    None => self.hello(n, agent, host, pid, running, on),
                    Some(why) => self.refuse(n, why, on),
                }
            }
            Inbound::Msg(n, msg) => match self.id_of(n) {
                Some(id) => Happened::Msg(id, msg),
                None => Happened::Nothing,
            },
            // Agents come through no relay.
            Inbound::Host(..) | Inbound::RelayLost(..) | Inbound::ToRelay(..) => Happened::Nothing,
            Inbound::Closed(n, why) => {
                self.fresh.remove(&n);
                let Some(id) = self.id_of(n) else { return Happened::Nothing };
                let Some(a) = self.agents.remove(&id) else { return Happened::Nothing };
                if members.contains(&id) {
                    Happened::Lost(id, a.host, why)
                } else {
                    on(GroupEvent::Host(format!("agent {id} on {} left: {why}", a.host)));
                    Happened::Nothing
                }
            }
        }
    }

    /// Admits the agent that said hello on connection `conn` (`agent`: its
    /// id, 0 for none yet) and sends it the job. An agent that comes back
    /// `running` a group keeps its ranks when this launcher carries that
    /// group on, and stops them otherwise.
    fn hello(
        &mut self,
        conn: u64,
        agent: u64,
        host: String,
        pid: u32,
        running: Option<u32>,
        on: &mut dyn FnMut(GroupEvent),
    ) -> Happened {
        let Some(stream) = self.fresh.remove(&conn) else { return Happened::Nothing };
        // An agent without an id (started by hand or by another engine)
        // takes the place of the longest awaited one.
        let id = match (agent, self.asked.keys().next().copied()) {
            (0, Some(awaited)) => awaited,
            (0, None) => self.fresh_id(),
            (id, _) => id,
        };
        let to = crate::control::outbox::Sender::new(stream);
        if self.agents.contains_key(&id) {
            let _ = to.send(&ToAgent::Exit { reason: format!("agent {id} has already joined") });
            return Happened::Nothing;
        }
        self.next_id = self.next_id.max(id + 1);
        self.asked.remove(&id);
        if let Err(e) = to.send(&self.welcome(id)) {
            on(GroupEvent::Host(format!("agent {id} on {host}: cannot send it the job: {e}")));
            return Happened::Nothing;
        }
        self.beat(&to);
        match running {
            None => on(GroupEvent::Host(format!("agent {id} joined from {host} (pid {pid})"))),
            Some(group)
                if self.returning.as_ref().is_some_and(|(g, ids)| *g == group && ids.contains(&id)) =>
            {
                on(GroupEvent::Host(format!(
                    "agent {id} came back from {host} (pid {pid}) with its ranks of group {group} running"
                )));
                self.back.insert(id);
            }
            Some(group) => {
                // Ranks of a group this launcher does not carry on.
                on(GroupEvent::Host(format!(
                    "agent {id} joined from {host} (pid {pid}); its ranks of group {group} are stopped"
                )));
                let _ = to.send(&ToAgent::Stop { group });
            }
        }
        self.agents.insert(id, Joined { conn, host, to });
        Happened::Joined
    }

    /// Sends the agent on connection `conn` away before it joins, saying why.
    fn refuse(&mut self, conn: u64, why: String, on: &mut dyn FnMut(GroupEvent)) -> Happened {
        on(GroupEvent::Host(format!("{why}; it is refused")));
        if let Some(stream) = self.fresh.remove(&conn) {
            let _ = crate::control::outbox::Sender::new(stream).send(&ToAgent::Exit { reason: why });
        }
        Happened::Nothing
    }

    /// The job as agent `id` is told it when it joins.
    fn welcome(&self, id: u64) -> ToAgent {
        ToAgent::Welcome {
            agent: id,
            job: self.cfg.job.clone(),
            command: self.cfg.command.clone(),
            nproc: self.hc.nproc,
            max_restarts: self.cfg.max_restarts,
            heartbeat_ms: (self.hc.lease.as_millis() as u64 / 4).max(50),
            grace_ms: self.cfg.grace.as_millis() as u64,
            follow: self.follow(),
            reconnect_ms: self.hc.lead.as_ref().map_or(0, |l| l.reconnect.as_millis() as u64),
            // Heartbeats come from threads of their own (`beat`): silence
            // is a launcher frozen, gone or cut off.
            lease_ms: self.hc.lease.as_millis() as u64,
            protocol: crate::control::proto::PROTOCOL,
        }
    }

    /// Whether another launcher took the job over: this one then acts on
    /// nobody (its agents are that launcher's now, and are let go).
    fn deposed(&mut self) -> bool {
        if self.deposed.is_none()
            && let Some(why) = self.hold.as_ref().and_then(Hold::fenced)
        {
            self.scaler.release();
            self.leading.store(false, Ordering::SeqCst);
            self.deposed = Some(why);
        }
        self.deposed.is_some()
    }

    /// Tells the agent behind `to` that this launcher is alive, a few times
    /// per lease, from a thread of its own: the launcher's loop may wait on
    /// a stopping agent's command for longer than a lease, and an agent
    /// that hears nothing for a lease looks for another launcher.
    fn beat(&self, to: &crate::control::outbox::Sender) {
        let (to, leading) = (to.clone(), self.leading.clone());
        // The lease's own end is checked too: the launcher's loop that
        // would notice it may be waiting on an agent's stop.
        let fence = self.hold.as_ref().map(Hold::fence);
        let leads =
            move || leading.load(Ordering::SeqCst) && fence.as_ref().is_none_or(|f| f.fenced().is_none());
        let every = (self.hc.lease / 4).max(Duration::from_millis(50));
        let spawned = std::thread::Builder::new().name("edl-agent-beat".into()).spawn(move || {
            while leads() && to.send(&ToAgent::Heartbeat).is_ok() {
                std::thread::sleep(every);
            }
        });
        if let Err(e) = spawned {
            tracing::warn!("no heartbeats for an agent: {e}");
        }
    }

    /// What agents need to follow the next launcher, when there can be one.
    fn follow(&self) -> Option<Follow> {
        let (lead, hold) = (self.hc.lead.as_ref()?, self.hold.as_ref()?);
        Some(Follow { store: lead.store.clone(), token: hold.token })
    }

    fn id_of(&self, conn: u64) -> Option<u64> {
        self.agents.iter().find(|(_, a)| a.conn == conn).map(|(id, _)| *id)
    }

    fn fresh_id(&mut self) -> u64 {
        self.next_id = self.next_id.max(1);
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Asks the scaler for agents until `want` have joined or are on their way.
    fn ask_for(&mut self, want: u32, on: &mut dyn FnMut(GroupEvent)) {
        while !self.deposed() && (self.agents.len() + self.asked.len()) < want as usize {
            let id = self.fresh_id();
            match self.scaler.spawn(id, &self.addr, &self.hc.auth) {
                Ok(()) => {
                    self.asked.insert(id, Instant::now());
                }
                Err(e) => {
                    on(GroupEvent::Host(format!("cannot start agent {id}: {e:#}")));
                    return;
                }
            }
        }
    }

    /// Agents asked for that will not come: their command ended, or the
    /// join timeout passed.
    fn give_up_on_late(&mut self, on: &mut dyn FnMut(GroupEvent)) {
        for (id, why) in self.scaler.failed_spawns() {
            if self.asked.remove(&id).is_some() {
                on(GroupEvent::Host(format!("cannot start agent {id}: {why}")));
            }
        }
        for (id, how) in self.scaler.exited() {
            if self.asked.remove(&id).is_some() {
                on(GroupEvent::Host(format!("agent {id} ended before it joined: {how}")));
            }
        }
        let late: Vec<u64> = self
            .asked
            .iter()
            .filter(|(_, t)| t.elapsed() > self.hc.join_timeout)
            .map(|(id, _)| *id)
            .collect();
        for id in late {
            self.asked.remove(&id);
            self.scaler.stop(id, Duration::from_secs(1));
            on(GroupEvent::Host(format!(
                "agent {id} did not join within {:.0} s; given up",
                self.hc.join_timeout.as_secs_f64()
            )));
        }
    }

    /// Waits until `world` agents have joined (asking for the missing
    /// ones). Returns how many hosts the group can have: `world`, or fewer
    /// (at least `min`) when the others did not come in time.
    fn gather(&mut self, world: u32, min: u32, on: &mut dyn FnMut(GroupEvent)) -> Result<u32> {
        let deadline = Instant::now() + self.hc.join_timeout;
        loop {
            if let Some(why) = &self.deposed {
                bail!("{why}");
            }
            if self.agents.len() as u32 >= world {
                return Ok(world);
            }
            self.give_up_on_late(on);
            if Instant::now() > deadline {
                let have = self.agents.len() as u32;
                if have >= min {
                    on(GroupEvent::Host(format!(
                        "{have} of {world} hosts joined in time; the group starts on {have}"
                    )));
                    return Ok(have);
                }
                bail!(
                    "only {have} of the {min} hosts the job needs joined within {:.0} s (agents asked for at {}; \
                     see their logs)",
                    self.hc.join_timeout.as_secs_f64(),
                    self.addr
                );
            }
            self.ask_for(world, on);
            self.event(Duration::from_millis(50), &[], on);
        }
    }

    fn send(&mut self, id: u64, msg: &ToAgent) -> Result<(), SendError> {
        if self.deposed() {
            return Err(SendError::Deposed);
        }
        let a = self.agents.get(&id).ok_or(SendError::Gone(id))?;
        a.to.send(msg).map_err(|cause| SendError::Failed { id, host: a.host.clone(), cause })
    }

    /// Sends the agent away and makes sure its command is gone.
    fn dismiss(&mut self, id: u64, reason: &str) {
        if self.deposed() {
            return;
        }
        let _ = self.send(id, &ToAgent::Exit { reason: reason.into() });
        self.agents.remove(&id);
        self.scaler.stop(id, self.cfg.grace + Duration::from_secs(5));
    }
}

/// The running group's hosts and what they reported.
struct Running {
    n: u32,
    members: Vec<u64>,
    /// Ranks that succeeded, per member index.
    done: Vec<u32>,
}

/// Runs a `launch --torchrun` job across hosts until its ranks succeed or a
/// failure has no restart left. `cfg`'s worker bounds count hosts.
pub fn run_hosts(
    cfg: &TorchrunConfig,
    hc: HostsConfig,
    scaler: &mut dyn Scaler,
    policy: &mut dyn PolicyPlugin,
    on: &mut dyn FnMut(GroupEvent),
) -> Result<TorchrunOutcome> {
    if cfg.command.is_empty() {
        bail!("no program to launch");
    }
    if hc.nproc == 0 {
        crate::refuse!("--nproc-per-node 0: a host runs at least one rank");
    }
    let mut l = Launcher::open(cfg, hc, scaler, policy, on)?;
    let (base, mut kept) = match l.hold.as_ref().and_then(|h| h.found.clone()) {
        Some(g) => l.take_over(&g, on)?,
        None => (0, None),
    };
    loop {
        let n = base + l.groups.len() as u32;
        let (mut run, started) = match kept.take() {
            Some((run, record)) => (run, Ok(record)),
            None => l.form_group(n, on)?,
        };
        let next = match started {
            Ok(record) => {
                l.started(record, &run, on);
                l.watch(&mut run, on)
            }
            Err(next) => {
                l.not_started(&run);
                next
            }
        };
        if let Some(why) = l.deposed.take() {
            // Another launcher leads the job and its agents: this one stops
            // without a word to them.
            bail!("{why}");
        }
        l.stop_group(&run, on);
        if let Some(outcome) = l.group_ended(next, on) {
            return Ok(outcome);
        }
    }
}

/// What a launcher does with a job that ended under a launcher before: one
/// that finished is done ([`AlreadyFinished`]) and one that failed is not
/// started again by a standby, unless `--restart`; a job started again is
/// neither from here on.
fn ended_before(hold: Hold, lead: &Lead, job: &str) -> Result<Hold> {
    if !lead.restart {
        if hold.finished {
            return Err(AlreadyFinished { job: job.into(), final_checkpoint: None, epochs: None }.into());
        }
        if let Some(why) = hold.failed.as_ref().filter(|_| lead.standby) {
            bail!(
                "job {job:?} failed under the launcher before ({why}); a standby does not start it again \
                 (--restart does)"
            );
        }
    }
    if hold.finished || hold.failed.is_some() {
        hold.started_afresh();
    }
    Ok(hold)
}

/// A group found running, carried on by a launcher that took the job over.
type Kept = (Running, GroupRecord);

impl<'a> Launcher<'a> {
    /// Takes the job in the shared store, if there is one (before anything
    /// is started: one launcher leads the job), and opens the port agents
    /// join at.
    fn open(
        cfg: &'a TorchrunConfig,
        hc: HostsConfig,
        scaler: &'a mut dyn Scaler,
        policy: &'a mut dyn PolicyPlugin,
        on: &mut dyn FnMut(GroupEvent),
    ) -> Result<Self> {
        let hold = match &hc.lead {
            Some(lead) => {
                let hold = Hold::take(&lead.store, &cfg.job, lead.standby, &hc.auth.secret)?;
                Some(ended_before(hold, lead, &cfg.job)?)
            }
            None => None,
        };
        let listen = hc.addresses.listen;
        let listener =
            edl_host_gpu::comm::listen::listen(listen).with_context(|| format!("--listen {listen}"))?;
        let addr = crate::net::host_port(&hc.addresses.advertised_host()?, listener.local_addr()?.port());
        let (tx, rx) = mpsc::channel();
        inbox::start_channel(listener, hc.auth.clone(), "agent", hc.lease, tx)
            .context("agent connections")?;
        on(GroupEvent::Host(format!("agents join at {addr}")));
        Ok(Launcher {
            cfg,
            hc,
            scaler,
            policy,
            rx,
            fresh: HashMap::new(),
            agents: BTreeMap::new(),
            asked: BTreeMap::new(),
            next_id: 1,
            addr,
            hold,
            deposed: None,
            returning: None,
            back: BTreeSet::new(),
            replay: Default::default(),
            leading: Arc::new(AtomicBool::new(true)),
            decider: RestartDecider::of(cfg),
            groups: Vec::new(),
            decisions: Vec::new(),
            last_change: Instant::now(),
            last_failure: None,
            t0: Instant::now(),
        })
    }

    /// Takes the job over from the launcher that formed group `g`: names
    /// this launcher in the store, admits the group's agents that come back
    /// within [`RETURN_WITHIN`], and keeps the group when all did. When some
    /// did, it is stopped on them and restarts (a change of membership);
    /// when none did, the job starts afresh. Returns the number of the next
    /// group and the group kept, if so.
    fn take_over(
        &mut self,
        g: &GroupHandover,
        on: &mut dyn FnMut(GroupEvent),
    ) -> Result<(u32, Option<Kept>)> {
        self.claim(g, on);
        let back = self.await_return(g, on)?;
        self.decider.restarts = g.restart_count;
        Ok(self.carry_on(g, &back, on))
    }

    /// Names this launcher in the store as group `g`'s leader, and takes
    /// its agents over: they are this launcher's to stop and to place around.
    fn claim(&mut self, g: &GroupHandover, on: &mut dyn FnMut(GroupEvent)) {
        on(GroupEvent::Host(format!(
            "taking the job over from the launcher at {} (lease token {}): waiting for the {} agents of group {} \
             to come back",
            g.leader.addr,
            g.leader.token,
            g.agents.len(),
            g.group
        )));
        if let Some(h) = &self.hold {
            h.formed(GroupHandover {
                leader: Leader { addr: self.addr.clone(), token: h.token },
                ..g.clone()
            });
        }
        self.next_id = g.agents.iter().max().map_or(1, |m| m + 1);
        for (&id, handle) in g.handles.iter().filter(|(id, _)| g.agents.contains(id)) {
            if !self.scaler.adopt(id, handle, &self.hc.auth.job) {
                on(GroupEvent::Host(format!(
                    "agent {id} runs as {handle}, which this launcher's scaler does not know"
                )));
            }
        }
    }

    /// Waits (at most [`RETURN_WITHIN`]) for group `g`'s agents to come
    /// back, keeping what they say for the group they run; returns those
    /// that did. The others are stopped, so that nothing is left behind.
    fn await_return(&mut self, g: &GroupHandover, on: &mut dyn FnMut(GroupEvent)) -> Result<BTreeSet<u64>> {
        self.returning = Some((g.group, g.agents.clone()));
        let since = Instant::now();
        let mut said = std::collections::VecDeque::new();
        while self.back.len() < g.agents.len() && since.elapsed() < RETURN_WITHIN {
            if let Some(why) = &self.deposed {
                bail!("{why}");
            }
            if let Happened::Msg(id, msg) = self.event(Duration::from_millis(50), &[], on) {
                said.push_back((id, msg));
            }
        }
        self.replay = said;
        self.returning = None;
        let mut back = std::mem::take(&mut self.back);
        // One that came back and was lost again is not back.
        back.retain(|id| self.agents.contains_key(id));
        for &id in g.agents.iter().filter(|id| !back.contains(id)) {
            // Never admitted now: whatever its scheduler still runs for it is stopped.
            if let Some(handle) = self.scaler.handle(id) {
                on(GroupEvent::Host(format!("agent {id} did not come back; stopping {handle}")));
            }
            self.scaler.stop(id, Duration::from_secs(1));
        }
        Ok(back)
    }

    /// What becomes of group `g` now that the agents `back` came back:
    /// the number of the next group and the group kept, if so.
    fn carry_on(
        &mut self,
        g: &GroupHandover,
        back: &BTreeSet<u64>,
        on: &mut dyn FnMut(GroupEvent),
    ) -> (u32, Option<Kept>) {
        let from = format!("the launcher at {} (lease token {})", g.leader.addr, g.leader.token);
        match adopt(&g.agents, back) {
            Adopt::Keep => {
                on(GroupEvent::Host(format!(
                    "coordinator takeover: {from} was gone; all {} agents of group {} came back with their \
                     ranks running: the group goes on, not restarted",
                    g.agents.len(),
                    g.group
                )));
                self.decider.world = g.agents.len() as u32;
                let run = Running { n: g.group, members: g.agents.clone(), done: vec![0; g.agents.len()] };
                (g.group, Some((run, self.kept_record(g))))
            }
            Adopt::Restart { on: members, missing } => {
                on(GroupEvent::Host(format!(
                    "coordinator takeover: {from} was gone; {} of the {} agents of group {} came back (not \
                     back: {missing:?}); the group restarts on them",
                    members.len(),
                    g.agents.len(),
                    g.group
                )));
                let run = Running { n: g.group, done: vec![0; members.len()], members };
                self.replay.clear();
                self.stop_group(&run, on);
                self.decider.world = (run.members.len() as u32).clamp(self.decider.min, self.decider.max);
                (g.group + 1, None)
            }
            Adopt::Afresh => {
                on(GroupEvent::Host(format!(
                    "coordinator takeover: {from} was gone; no agent of group {} came back within \
                     {RETURN_WITHIN:?}: the job starts afresh",
                    g.group
                )));
                self.replay.clear();
                (g.group + 1, None)
            }
        }
    }

    /// The record of group `g`, carried on as it runs.
    fn kept_record(&self, g: &GroupHandover) -> GroupRecord {
        GroupRecord {
            group: g.group,
            world: g.agents.len() as u32 * g.nproc,
            hosts: g.hosts.clone(),
            restart_count: g.restart_count,
            master_addr: g.master_addr.clone(),
            master_port: g.master_port,
            log_dir: self.cfg.log_dir.join(format!("group-{}", g.group)),
            started_secs: 0.0,
            ended_secs: 0.0,
            ended: String::new(),
            taken_over: true,
        }
    }

    /// Gathers the hosts of group `n` and starts it on them: its record,
    /// or the next move when a host was lost on the way.
    fn form_group(
        &mut self,
        n: u32,
        on: &mut dyn FnMut(GroupEvent),
    ) -> Result<(Running, Result<GroupRecord, Next>)> {
        let hosts = self.gather(self.decider.world(), self.decider.min, on)?;
        self.decider.world = hosts;
        let members: Vec<u64> = self.agents.keys().copied().take(hosts as usize).collect();
        let run = Running { n, members, done: vec![0; hosts as usize] };
        let t0 = self.t0;
        let started = self
            .start_group(&run, on)
            .map(|record| GroupRecord { started_secs: t0.elapsed().as_secs_f64(), ..record });
        Ok((run, started))
    }

    /// The group started: the store names it, and its record is kept.
    fn started(&mut self, record: GroupRecord, run: &Running, on: &mut dyn FnMut(GroupEvent)) {
        self.formed(&record, &run.members, self.decider.restarts());
        self.groups.push(record);
        self.decider.started();
        on(GroupEvent::Started(self.groups.last().expect("just pushed")));
    }

    /// Keeps the record of a group that could not start.
    fn not_started(&mut self, run: &Running) {
        let n = run.n;
        self.groups.push(GroupRecord {
            group: n,
            world: run.members.len() as u32 * self.hc.nproc,
            hosts: run.members.iter().filter_map(|id| self.agents.get(id).map(|a| a.host.clone())).collect(),
            restart_count: self.decider.restarts(),
            master_addr: String::new(),
            master_port: 0,
            log_dir: self.cfg.log_dir.join(format!("group-{n}")),
            started_secs: self.t0.elapsed().as_secs_f64(),
            ended_secs: 0.0,
            ended: String::new(),
            taken_over: false,
        });
    }

    /// Records how the stopped group ended and acts on it: hosts beyond a
    /// smaller size leave, and at the job's end every agent does. Returns
    /// the job's outcome when it is over.
    fn group_ended(&mut self, next: Next, on: &mut dyn FnMut(GroupEvent)) -> Option<TorchrunOutcome> {
        let record = self.groups.last_mut().expect("a record per group");
        record.ended_secs = self.t0.elapsed().as_secs_f64();
        match next {
            Next::Continue => unreachable!("a group is watched until it changes"),
            Next::Restart { world, reason, failure } => {
                record.ended = if failure {
                    reason.clone()
                } else if reason.contains(" lost") {
                    format!("restarted on {world} hosts: {reason}")
                } else {
                    format!("resized to {world} hosts")
                };
                if !failure {
                    self.last_change = Instant::now();
                }
                // Hosts beyond the new size leave (the policy scaled in).
                let extra: Vec<u64> = self.agents.keys().copied().skip(world as usize).collect();
                for id in extra {
                    self.dismiss(id, "the job scaled in");
                }
                on(GroupEvent::Restarting { reason: &reason, failure });
                None
            }
            Next::Succeeded => Some(self.finish(None)),
            Next::Stopped { signal } => Some(self.stopped(signal)),
            Next::Failed { .. } => {
                let failure = self.last_failure.take();
                Some(self.finish(failure))
            }
        }
    }

    /// The launcher was stopped by `signal`: every agent is sent away (its
    /// ranks stopped with notice) and the lease given up, the job left
    /// unfinished in the store for a launcher that takes it over.
    fn stopped(&mut self, signal: i32) -> TorchrunOutcome {
        let reason = format!("the launcher was stopped by {}", crate::process::signal_name(signal));
        if let Some(h) = &self.hold {
            h.release();
        }
        let ids: Vec<u64> = self.agents.keys().copied().collect();
        for id in &ids {
            let _ = self.send(*id, &ToAgent::Exit { reason: reason.clone() });
        }
        for id in ids {
            self.dismiss(id, &reason);
        }
        let (groups, decisions) = (std::mem::take(&mut self.groups), std::mem::take(&mut self.decisions));
        let mut outcome = TorchrunOutcome::end(groups, &self.decider, self.cfg, decisions, None, self.t0);
        outcome.stop(signal);
        outcome
    }

    /// The job is over: the store says so first (an agent looking for a
    /// launcher stops looking), then every agent is sent away.
    fn finish(&mut self, failure: Option<RankFailure>) -> TorchrunOutcome {
        let reason = if failure.is_none() { "the job is done" } else { "the job failed" };
        if let Some(h) = &self.hold {
            let failed = failure.as_ref().map_or_else(|| "no restart left".to_string(), |f| f.to_string());
            h.finish((reason == "the job failed").then_some(failed));
        }
        let ids: Vec<u64> = self.agents.keys().copied().collect();
        for id in &ids {
            let _ = self.send(*id, &ToAgent::Exit { reason: reason.into() });
        }
        for id in ids {
            self.dismiss(id, reason);
        }
        let (groups, decisions) = (std::mem::take(&mut self.groups), std::mem::take(&mut self.decisions));
        TorchrunOutcome::end(groups, &self.decider, self.cfg, decisions, failure, self.t0)
    }

    /// Records the group that formed in the store, naming this launcher.
    fn formed(&self, record: &GroupRecord, members: &[u64], restart_count: u32) {
        let Some(h) = &self.hold else { return };
        h.formed(GroupHandover {
            group: record.group,
            agents: members.to_vec(),
            hosts: record.hosts.clone(),
            master_addr: record.master_addr.clone(),
            master_port: record.master_port,
            nproc: self.hc.nproc,
            restart_count,
            leader: Leader { addr: self.addr.clone(), token: h.token },
            handles: members.iter().filter_map(|&id| Some((id, self.scaler.handle(id)?))).collect(),
        });
    }

    /// Starts the group on its hosts: group rank 0's first (it picks the
    /// store's port), then the others. A host lost on the way gives the next
    /// move instead of a record.
    fn start_group(&mut self, run: &Running, on: &mut dyn FnMut(GroupEvent)) -> Result<GroupRecord, Next> {
        let restart_count = self.decider.restarts();
        let first = run.members[0];
        let master_addr = self.agents[&first].host.clone();
        let start = |group_rank: u32, port: u16| ToAgent::Start {
            group: run.n,
            group_rank,
            group_world: run.members.len() as u32,
            restart_count,
            master_addr: master_addr.clone(),
            master_port: port,
        };
        if let Err(e) = self.send(first, &start(0, 0)) {
            on(GroupEvent::Host(e.to_string()));
            return Err(self.decider.lost(&master_addr, self.agents.len() as u32));
        }
        let deadline = Instant::now() + self.hc.join_timeout;
        let port = loop {
            if self.deposed.is_some() {
                return Err(Next::Continue);
            }
            if Instant::now() > deadline {
                on(GroupEvent::Host(format!(
                    "agent {first} did not start group {} in time; it is sent away",
                    run.n
                )));
                self.dismiss(first, "it did not start its ranks in time");
                return Err(self.decider.lost(&master_addr, self.agents.len() as u32));
            }
            match self.event(Duration::from_millis(50), &run.members, on) {
                Happened::Msg(id, FromAgent::Started { group, master_port })
                    if id == first && group == run.n =>
                {
                    break master_port;
                }
                Happened::Msg(_, FromAgent::Exited { group, rank, exit, failure }) if group == run.n => {
                    let f = failure.map(|f| f.to_string()).unwrap_or_else(|| format!("rank {rank}: {exit}"));
                    on(GroupEvent::Host(format!("group {} could not start: {f}", run.n)));
                    return Err(self.decider.exited(rank, exit));
                }
                Happened::Lost(_, host, why) => {
                    on(GroupEvent::Host(format!("host {host} lost: {why}")));
                    return Err(self.decider.lost(&host, self.agents.len() as u32));
                }
                _ => {}
            }
        };
        for (i, id) in run.members.iter().enumerate().skip(1) {
            if let Err(e) = self.send(*id, &start(i as u32, port)) {
                let host = self.agents.get(id).map(|a| a.host.clone()).unwrap_or_default();
                on(GroupEvent::Host(e.to_string()));
                self.agents.remove(id);
                return Err(self.decider.lost(&host, self.agents.len() as u32));
            }
        }
        Ok(GroupRecord {
            group: run.n,
            world: run.members.len() as u32 * self.hc.nproc,
            hosts: run.members.iter().map(|id| self.agents[id].host.clone()).collect(),
            restart_count: self.decider.restarts(),
            master_addr,
            master_port: port,
            log_dir: self.cfg.log_dir.join(format!("group-{}", run.n)),
            started_secs: 0.0,
            ended_secs: 0.0,
            ended: String::new(),
            taken_over: false,
        })
    }

    /// Watches the running group until something changes it: every rank
    /// done, a rank failed, a host lost, or the policy resized it.
    fn watch(&mut self, run: &mut Running, on: &mut dyn FnMut(GroupEvent)) -> Next {
        let mut decide_at = Instant::now() + self.cfg.decide_every;
        // A resize to more hosts waits, the group running, until they joined.
        let mut growing: Option<Next> = None;
        loop {
            if self.deposed.is_some() {
                return Next::Continue;
            }
            if let Some(signal) = crate::process::stop_requested() {
                return Next::Stopped { signal };
            }
            if let Some(next) = self.grown(&mut growing, run, on) {
                return next;
            }
            match self.event(Duration::from_millis(20), &run.members, on) {
                Happened::Msg(_, FromAgent::Output { group, rank, line }) if group == run.n => {
                    on(GroupEvent::Output { rank, line: &line });
                }
                Happened::Msg(id, FromAgent::Exited { group, rank, exit, failure }) if group == run.n => {
                    let Some(i) = run.members.iter().position(|m| *m == id) else { continue };
                    if exit.success() {
                        run.done[i] += 1;
                        if run.done[i] == self.hc.nproc {
                            match self.decider.exited(i as u32, exit) {
                                Next::Continue => {}
                                next => return next,
                            }
                        }
                        continue;
                    }
                    self.last_failure = failure;
                    return self.decider.exited(rank, exit);
                }
                Happened::Lost(_, host, why) => {
                    on(GroupEvent::Host(format!("host {host} lost: {why}")));
                    return self.decider.lost(&host, self.agents.len() as u32);
                }
                _ => {}
            }
            if growing.is_none() && Instant::now() >= decide_at {
                decide_at = Instant::now() + self.cfg.decide_every;
                match decide(
                    self.cfg,
                    &mut self.decider,
                    &mut *self.policy,
                    &mut self.decisions,
                    self.last_change,
                    on,
                ) {
                    Next::Continue => {}
                    Next::Restart { world, reason, failure } if world > run.members.len() as u32 => {
                        self.ask_for(world, on);
                        growing = Some(Next::Restart { world, reason, failure });
                    }
                    next => return next,
                }
            }
        }
    }

    /// A resize to more hosts (`growing`) once they joined; given up when
    /// none of them came (the group goes on as it is).
    fn grown(
        &mut self,
        growing: &mut Option<Next>,
        run: &Running,
        on: &mut dyn FnMut(GroupEvent),
    ) -> Option<Next> {
        let Some(Next::Restart { world, .. }) = growing else { return None };
        let world = *world;
        self.give_up_on_late(on);
        if self.agents.len() as u32 >= world {
            return growing.take();
        }
        if self.asked.is_empty() && self.agents.len() as u32 <= run.members.len() as u32 {
            on(GroupEvent::Host(
                "the hosts the policy asked for did not join; the group keeps its size".into(),
            ));
            self.decider.world = run.members.len() as u32;
            *growing = None;
        }
        None
    }

    /// Stops the group on every host still there and waits (bounded) until
    /// each says its ranks are gone, so that the next group never meets them.
    fn stop_group(&mut self, run: &Running, on: &mut dyn FnMut(GroupEvent)) {
        let mut waiting: Vec<u64> = Vec::new();
        for id in &run.members {
            if self.send(*id, &ToAgent::Stop { group: run.n }).is_ok() {
                waiting.push(*id);
            }
        }
        let deadline = Instant::now() + self.cfg.grace + Duration::from_secs(10);
        while !waiting.is_empty() && Instant::now() < deadline {
            match self.event(Duration::from_millis(20), &run.members, on) {
                Happened::Msg(id, FromAgent::Stopped { group }) if group == run.n => {
                    waiting.retain(|w| *w != id)
                }
                Happened::Msg(_, FromAgent::Output { group, rank, line }) if group == run.n => {
                    on(GroupEvent::Output { rank, line: &line });
                }
                Happened::Lost(id, host, why) => {
                    on(GroupEvent::Host(format!("host {host} lost while its ranks stopped: {why}")));
                    waiting.retain(|w| *w != id);
                }
                _ => {}
            }
        }
        for id in waiting {
            let host = self.agents.get(&id).map(|a| a.host.clone()).unwrap_or_default();
            on(GroupEvent::Host(format!(
                "agent {id} on {host} did not say its ranks stopped; it is sent away"
            )));
            self.dismiss(id, "its ranks did not stop in time");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_read_back_as_they_were_sent() {
        let m = FromAgent::Exited { group: 3, rank: 5, exit: Exit::Signal(9), failure: None };
        let line = serde_json::to_string(&m).unwrap();
        assert!(line.contains("\"type\":\"exited\""), "{line}");
        let back: FromAgent = serde_json::from_str(&line).unwrap();
        assert!(matches!(
            back,
            FromAgent::Exited { group: 3, rank: 5, exit: Exit::Signal(9), failure: None }
        ));
        let s = ToAgent::Start {
            group: 1,
            group_rank: 2,
            group_world: 3,
            restart_count: 0,
            master_addr: "10.0.0.1".into(),
            master_port: 0,
        };
        let back: ToAgent = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert!(matches!(back, ToAgent::Start { group_rank: 2, master_port: 0, .. }));
    }
}
