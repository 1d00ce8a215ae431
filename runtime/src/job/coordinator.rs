//! The coordinator (job server): membership, generations, ranks and the
//! global data cursor; the scaling policy on a fixed cadence and the batch
//! adapter at each step and resize; workers started and stopped through a
//! [`Scaler`].
//!
//! The coordinator is the step barrier. It sends every rank the plan of a
//! step, and commits the step when every rank of the generation reports it
//! done; only then does the cursor move and the sample ids the ranks trained
//! on enter the ledger. When a rank dies (its control connection closes),
//! fails (its ring broke) or hangs (no answer within the step timeout), the
//! step is not committed; the survivors form the next generation from the
//! committed state and redo it. Joiners wait until a step boundary and get
//! the state by broadcast. The job's progress (generation, cursor, members)
//! is kept in the store and on the checkpoint cadence rank 0 writes a
//! checkpoint; a restarted job resumes from the newest one that verifies.

use super::inbox::Inbound;
use super::ledger::{EpochRecord, Ledger};
use super::membership::{Command, Event, Membership};
use super::phase::{JobPhase, Phase};
use super::pipeline::{Committed, Failure, Pipeline};
use super::proto::{
    FromWorker, Generation, JobSpec, Share, StepDone, StepPlan, ToWorker, encode, send, send_encoded,
};
use super::scaler::Scaler;
use crate::checkpoint::{Checkpoints, Manifest, Restored};
use crate::plugin::{AdapterPlugin, PolicyPlugin};
use crate::store::{AnyStore, Store, keys};
use anyhow::{Context, Result, anyhow, bail};
use edl_host_gpu::comm::{
    RendezvousServer,
    auth::{JobAuth, Secret},
};
use edl_plugin_sdk::{Action, ClusterView, Hyperparams, ResizeEvent, WorkerStats};
use serde::{Deserialize, Serialize};
use std::{
    collections::{BTreeSet, HashMap},
    net::{SocketAddr, TcpListener, TcpStream},
    path::PathBuf,
    sync::{Arc, mpsc},
    time::{Duration, Instant},
};

/// How the job runs.
pub struct JobConfig {
    pub spec: JobSpec,
    pub min_workers: u32,
    pub max_workers: u32,
    /// Workers at the start.
    pub initial_workers: u32,
    /// Steps between two policy decisions.
    pub decide_every: u64,
    /// Steps between two checkpoints (and one at each epoch's end).
    pub checkpoint_every: Option<u64>,
    /// Longest training time between two checkpoints.
    pub checkpoint_interval: Duration,
    /// Hyperparameters at the start (the adapter changes them).
    pub hyper: Hyperparams,
    /// `memory` or `redis://...`.
    pub store: String,
    /// A rank that answers no step within this is declared dead.
    pub step_timeout: Duration,
    /// A started worker that does not join within this is given up.
    pub join_timeout: Duration,
    pub price_per_worker_hour: f64,
    /// The teacher processes this job started, when it started them.
    pub teacher_watch: Option<Box<dyn super::teachers::TeacherWatch>>,
    /// The job's secret: every control connection, rendezvous registration
    /// and ring link proves it.
    pub secret: Secret,
    /// Where the control port and the rendezvous listen, and what workers are told.
    pub addresses: super::net::Addresses,
}

impl JobConfig {
    /// Refuses settings a job cannot run with, naming the flag, before
    /// anything starts.
    pub fn validate(&self) -> Result<()> {
        let h = &self.hyper;
        let train_len = self.spec.samples;
        if train_len == 0 {
            bail!("the job has no samples (--samples 0, or --train-samples 0)");
        }
        if self.spec.epochs == 0 {
            bail!("--epochs 0: a job trains at least one epoch");
        }
        if self.min_workers == 0 || self.min_workers > self.max_workers {
            bail!(
                "--min-workers {} and --max-workers {}: need 1 <= min <= max",
                self.min_workers,
                self.max_workers
            );
        }
        if self.initial_workers > self.max_workers {
            bail!("--workers {} is above --max-workers {}", self.initial_workers, self.max_workers);
        }
        if h.global_batch == 0 || h.global_batch as usize > train_len {
            bail!("--batch {}: need 1 <= batch <= {train_len} (the training samples)", h.global_batch);
        }
        if !(h.lr.is_finite() && h.lr > 0.0) {
            bail!("--lr {}: need a finite learning rate above 0", h.lr);
        }
        if !(h.momentum.is_finite() && (0.0..1.0).contains(&h.momentum)) {
            bail!("--momentum {}: need 0 <= momentum < 1", h.momentum);
        }
        let spec = &self.spec;
        if !(spec.temperature.is_finite() && spec.temperature > 0.0) {
            bail!("--temperature {}: need a finite temperature above 0", spec.temperature);
        }
        if !(spec.alpha.is_finite() && (0.0..=1.0).contains(&spec.alpha)) {
            bail!("--alpha {}: need 0 <= alpha <= 1", spec.alpha);
        }
        for (flag, v) in [
            ("--decide-every", self.decide_every),
            ("--checkpoint-every", self.checkpoint_every.unwrap_or(1)),
            ("--checkpoint-secs", self.checkpoint_interval.as_secs()),
            ("--keep-checkpoints", spec.keep_checkpoints as u64),
            ("--collective-timeout-ms", spec.collective_timeout_ms),
            ("--step-timeout", self.step_timeout.as_secs()),
            ("--teacher-wait-secs", spec.teacher_wait_ms),
            ("--worker-lease-secs", spec.worker_lease_ms),
            ("--teacher-timeout-ms", spec.teacher_calls.request_timeout_ms),
            ("--teacher-batch", spec.teacher_calls.teacher_batch as u64),
            ("--teacher-in-flight", spec.teacher_calls.in_flight as u64),
        ] {
            if v == 0 {
                bail!("{flag} 0: need at least 1");
            }
        }
        if spec.teachers.is_some() {
            self.validate_teacher_wait()?;
        }
        Ok(())
    }

    /// For a job with teachers: a worker waiting for them must give up
    /// before the coordinator declares it dead.
    pub fn validate_teacher_wait(&self) -> Result<()> {
        let wait = self.spec.teacher_wait_ms;
        if Duration::from_millis(wait) >= self.step_timeout {
            bail!(
                "--teacher-wait-secs {} must be below --step-timeout {}: a worker waiting for teachers \
                 would be declared dead first",
                wait / 1000,
                self.step_timeout.as_secs()
            );
        }
        Ok(())
    }
}

/// A change of world size, as the report shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScaleEvent {
    /// Committed steps when the new generation started.
    pub step: u64,
    pub from: u32,
    pub to: u32,
    /// From the resize at the step boundary to the first committed step of
    /// the new generation (ring, broadcast and one step included).
    pub pause_ms: f64,
    pub reason: String,
    pub generation: u64,
    /// The slowest rank's ring set-up and parameter broadcast, within the pause.
    pub setup_ms: f64,
    /// For scale-outs: from the policy's decision to the new worker being
    /// ready (process start and data load), while the others kept training.
    pub join_ms: Option<f64>,
    /// Seconds since the job (this run) started.
    pub at_secs: f64,
}

/// One committed step, for the progress display and the plot.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StepRecord {
    pub step: u64,
    pub epoch: u64,
    pub world: u32,
    pub secs: f64,
    pub loss: f64,
    /// Committed samples per second over the last few steps.
    pub samples_per_sec: f64,
    /// Samples of the epoch consumed after this step.
    pub cursor: usize,
}

/// What the coordinator reports while it runs.
pub enum Progress<'a> {
    Step(&'a StepRecord),
    Scale(&'a ScaleEvent),
    Epoch(&'a EpochRecord),
    Checkpoint { step: u64, path: &'a std::path::Path },
    Note(String),
}

/// The end of a job.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct JobOutcome {
    pub final_checkpoint: PathBuf,
    pub steps: u64,
    pub epochs: Vec<EpochRecord>,
    pub scale_events: Vec<ScaleEvent>,
    pub timeline: Vec<StepRecord>,
    pub resumed_from_step: Option<u64>,
    /// Samples committed by this run, and the seconds it trained.
    pub samples: u64,
    pub train_secs: f64,
    pub generations: (u64, u64),
    pub checkpoints: Vec<PathBuf>,
    pub final_world: u32,
    pub hyper: Hyperparams,
    /// Ids of the workers this run started.
    pub workers_started: Vec<u64>,
}

/// What the store keeps about a job (survives a coordinator restart).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct JobState {
    pub generation: u64,
    pub committed_steps: u64,
    pub epoch: u64,
    pub cursor: usize,
    pub next_worker_id: u64,
    pub members: Vec<u64>,
    pub finished: bool,
}

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
}

/// What decides which samples a (step, cursor) names, and what the state is.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
struct DataIdentity {
    samples: usize,
    seed: u64,
    program: String,
}

impl DataIdentity {
    fn of(spec: &JobSpec) -> Self {
        DataIdentity { samples: spec.samples, seed: spec.seed, program: spec.program.identity() }
    }

    /// The differences from `now`, as flags.
    fn differences(&self, now: &DataIdentity) -> Vec<String> {
        let mut d = Vec::new();
        let mut cmp = |flag: &str, was: String, is: String| {
            if was != is {
                d.push(format!("{flag} {was} (this run: {is})"));
            }
        };
        cmp("samples (--samples, --train-samples)", self.samples.to_string(), now.samples.to_string());
        cmp("--seed", self.seed.to_string(), now.seed.to_string());
        cmp("the program", self.program.clone(), now.program.clone());
        d
    }
}

/// A resize waiting for the first committed step of its generation.
struct Pending {
    from: u32,
    reason: String,
    boundary: Instant,
    join_ms: Option<f64>,
    /// The generation it made, once formed.
    generation: Option<u64>,
    /// It follows a failure (workers lost), not a decision.
    failure: bool,
}

impl Pending {
    /// A resize decided now, from a world of `from`.
    fn new(from: u32, reason: String) -> Self {
        Pending { from, reason, boundary: Instant::now(), join_ms: None, generation: None, failure: false }
    }
}

struct Coordinator<'a> {
    cfg: JobConfig,
    policy: Box<dyn PolicyPlugin>,
    adapter: Option<Box<dyn AdapterPlugin>>,
    scaler: Box<dyn Scaler>,
    progress: &'a mut dyn FnMut(Progress),
    rt: tokio::runtime::Runtime,
    store: AnyStore,
    /// `host:port` workers reach the control port at.
    addr: String,
    /// `host:port` workers reach the rendezvous at.
    rendezvous_at: String,
    /// Where the job's checkpoints are (read here, written by rank 0).
    ckpt: Checkpoints,
    rendezvous: RendezvousServer,
    /// Who may open a control connection (told each new generation).
    gate: Arc<super::inbox::Gate>,
    rx: mpsc::Receiver<Inbound>,
    /// Open control connections.
    conns: HashMap<u64, TcpStream>,
    /// Who is in the job (the decisions; this struct does the I/O).
    m: Membership,
    generation: u64,
    first_generation: u64,
    committed: u64,
    epoch: u64,
    cursor: usize,
    hyper: Hyperparams,
    ledger: Ledger,
    events: Vec<ScaleEvent>,
    pending: Option<Pending>,
    init: Option<PathBuf>,
    /// A generation was just formed: leases are written at once.
    lease_now: bool,
    last_change: Instant,
    started: Instant,
    window: (Instant, u64),
    /// Per worker: samples and seconds of compute since the last decision.
    worker_rate: HashMap<u64, (f64, f64)>,
    recent: std::collections::VecDeque<(Instant, u64)>,
    timeline: Vec<StepRecord>,
    checkpoints: Vec<PathBuf>,
    samples: u64,
    last_lease: Instant,
    train_len: usize,
    /// Writes job state and leases off the step's path (from the job's start).
    keeper: Option<super::keeper::StoreKeeper>,
    /// The stored job state's token when this run read it.
    state_token: Option<u64>,
    /// The current generation's step barrier, and its ranks by connection.
    pipe: Option<Pipeline>,
    ranks: HashMap<u64, usize>,
    /// The next step to plan (the adapter is asked once per step, as it
    /// is planned).
    plan_at: StepPlan,
    /// A policy decision that removes workers, applied once the windows
    /// already sent are committed.
    decision: Option<Vec<Action>>,
    /// The slowest rank's compute per step (moving average), ms: sizes the windows.
    step_ms: Option<f64>,
    last_save: Instant,
    last_checkpoint: Instant,
    last_teacher_check: Instant,
    /// The epoch permutation the ledger maps reported positions through.
    perm: Option<(u64, Vec<u32>)>,
    /// The epoch permutation windows are planned from.
    plan_perm: Option<(u64, Vec<u32>)>,
    /// The last reported write of a checkpoint of the committed step.
    saved: Option<Result<PathBuf, String>>,
}

/// The coordinator's lease on its job in the store (renewed every third of it).
const LEASE_TTL: Duration = Duration::from_secs(10);

/// Windows kept ahead of the ranks while membership is stable.
const AHEAD: usize = 2;
/// A window holds about this much work (by the measured step time)...
const WINDOW_WORK_MS: f64 = 25.0;
/// ... and at most this many steps.
const MAX_WINDOW: u64 = 32;
/// How often the coordinator looks after starters, leases, teachers and the store.
const CHORES_EVERY: Duration = Duration::from_millis(100);

/// The permutation of `epoch` (of `len` samples under `seed`), kept in `cache`.
fn permutation_of(cache: &mut Option<(u64, Vec<u32>)>, len: usize, seed: u64, epoch: u64) -> &[u32] {
    if cache.as_ref().map(|p| p.0) != Some(epoch) {
        *cache = Some((epoch, crate::data::permutation(len, seed, epoch)));
    }
    &cache.as_ref().expect("set above").1
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Runs a job to its end.
/// `lock` is the job's [`JobLock`](super::JobLock), held until the job ends.
pub fn run(
    cfg: JobConfig,
    lock: super::JobLock,
    policy: Box<dyn PolicyPlugin>,
    adapter: Option<Box<dyn AdapterPlugin>>,
    scaler: Box<dyn Scaler>,
    progress: &mut dyn FnMut(Progress),
) -> Result<JobOutcome> {
    cfg.validate()?;
    let samples = cfg.spec.samples;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let store = {
        let _g = rt.enter();
        AnyStore::open(&cfg.store)?
    };
    let net = &cfg.addresses;
    let listener = TcpListener::bind(net.listen).with_context(|| format!("--listen {}", net.listen))?;
    let host = net.advertised_host()?;
    let addr = super::net::host_port(&host, listener.local_addr()?.port());
    let auth = JobAuth { job: cfg.spec.job.clone(), secret: cfg.secret.clone() };
    let rendezvous_listen = SocketAddr::new(net.listen.ip(), net.rendezvous_port).to_string();
    let rendezvous = RendezvousServer::start_with(&rendezvous_listen, Some(auth.clone()))
        .with_context(|| format!("rendezvous server on {rendezvous_listen}"))?;
    let rendezvous_at = super::net::host_port(&host, rendezvous.addr().port());
    let (tx, rx) = mpsc::channel();
    let lease = Duration::from_millis(cfg.spec.worker_lease_ms);
    let gate = super::inbox::start(listener, auth.clone(), lease, tx).context("control connections")?;
    let mut m = Membership::new(cfg.min_workers, cfg.max_workers, cfg.join_timeout, 1);
    m.admit_uninvited(scaler.admits_uninvited());
    let now = Instant::now();
    let mut c = Coordinator {
        policy,
        adapter,
        scaler,
        progress,
        rt,
        store,
        addr,
        rendezvous_at,
        rendezvous,
        gate,
        ckpt: Checkpoints::open(&cfg.spec.checkpoint_dir, cfg.spec.keep_checkpoints)?,
        rx,
        conns: HashMap::new(),
        m,
        generation: 0,
        first_generation: 0,
        committed: 0,
        epoch: 0,
        cursor: 0,
        hyper: cfg.hyper,
        ledger: Ledger::new(samples),
        events: Vec::new(),
        pending: None,
        init: None,
        lease_now: true,
        last_change: now,
        started: now,
        window: (now, 0),
        worker_rate: HashMap::new(),
        recent: Default::default(),
        timeline: Vec::new(),
        checkpoints: Vec::new(),
        samples: 0,
        last_lease: now,
        train_len: samples,
        keeper: None,
        state_token: None,
        pipe: None,
        ranks: HashMap::new(),
        plan_at: StepPlan { step: 0, epoch: 0, cursor: 0, hyper: cfg.hyper },
        decision: None,
        step_ms: None,
        last_save: now,
        last_checkpoint: now,
        last_teacher_check: now,
        perm: None,
        plan_perm: None,
        saved: None,
        cfg,
    };
    let result = c.job();
    c.m.stop_all(if result.is_ok() { "the job is done" } else { "the job failed" });
    c.execute();
    if let Some(k) = &c.keeper {
        k.release();
        let _ = k.flush(Duration::from_secs(5));
    }
    drop(lock);
    result
}

/// Marks a job finished (after its report is written): a rerun starts
/// it again from step 0. Until then a rerun resumes from the final
/// checkpoint and only writes the report.
pub fn mark_complete(checkpoint_dir: &std::path::Path, epochs: &[EpochRecord]) -> Result<()> {
    Checkpoints::open(checkpoint_dir, 1)?.put_file(COMPLETE, &serde_json::to_vec_pretty(epochs)?)?;
    Ok(())
}

/// The marker of a finished job, beside its checkpoints.
const COMPLETE: &str = "complete.json";

impl Coordinator<'_> {
    fn note(&mut self, s: String) {
        (self.progress)(Progress::Note(s));
    }

    fn checkpoints(&self) -> &Checkpoints {
        &self.ckpt
    }

    /// Picks up where an earlier run of this job stopped: the store's job
    /// state (generations, worker ids) and the newest checkpoint that verifies.
    fn resume(&mut self) -> Result<Option<u64>> {
        let key = keys::job_state(&self.cfg.spec.job);
        let stored: Option<JobState> = match self.rt.block_on(self.store.get(&key)) {
            Ok(Some(e)) => {
                self.state_token = Some(e.token);
                serde_json::from_slice(&e.value).ok()
            }
            Ok(None) => None,
            Err(e) => bail!("reading the job state: {e}"),
        };
        if let Some(s) = &stored {
            self.generation = s.generation;
            self.m.resume_ids(s.next_worker_id);
        }
        let complete = self.ckpt.has_file(COMPLETE).context("looking for the finished job's marker")?;
        if complete || stored.as_ref().is_some_and(|s| s.finished) {
            self.note(format!("job {:?} finished before; starting it again from step 0", self.cfg.spec.job));
            for (_, p) in self.ckpt.list().context("listing the finished job's checkpoints")? {
                self.ckpt.remove(&p);
            }
            self.ckpt.remove_file(COMPLETE);
            return Ok(None);
        }
        for p in self.checkpoints().clean_leftovers() {
            self.note(format!("removed {} (left by an interrupted checkpoint write)", p.display()));
        }
        let (restored, skipped) = self.checkpoints().latest().context("listing the checkpoints to resume from")?;
        for e in skipped {
            self.note(format!("skipping an unusable checkpoint: {e}"));
        }
        let Some(r) = restored else { return Ok(None) };
        let m = &r.manifest;
        let book: Bookkeeping = serde_json::from_value(m.plugin_state.clone())
            .with_context(|| format!("{}: manifest has no coordinator state", r.path.display()))?;
        let now = DataIdentity::of(&self.cfg.spec);
        let was = book.data.clone().unwrap_or(DataIdentity { seed: m.seed, ..now.clone() });
        let diff = was.differences(&now);
        if !diff.is_empty() {
            bail!(
                "checkpoint {} was made with {}; resuming would train on another order of the data. \
                 Run with the same flags, or use another --checkpoint-dir",
                r.path.display(),
                diff.join(", ")
            );
        }
        if book.ledger.samples() != self.train_len {
            bail!(
                "checkpoint {} was written for {} training samples, this job has {}",
                r.path.display(),
                book.ledger.samples(),
                self.train_len
            );
        }
        self.restore(&r, book.ledger);
        self.events = book.events;
        self.generation = self.generation.max(book.generation);
        let lost = stored.map(|s| s.committed_steps.saturating_sub(m.step)).unwrap_or(0);
        self.note(format!(
            "resuming job {:?} from {} (step {}, epoch {}, cursor {}){}",
            self.cfg.spec.job,
            r.path.display(),
            m.step,
            m.epoch,
            m.cursor,
            if lost > 0 { format!("; redoing the {lost} steps committed after it") } else { String::new() }
        ));
        Ok(Some(m.step))
    }

    /// Takes the cursor, hyperparameters and ledger of a checkpoint, whose
    /// parameters the first generation then loads.
    fn restore(&mut self, r: &Restored, ledger: Ledger) {
        let m = &r.manifest;
        self.committed = m.step;
        self.epoch = m.epoch;
        self.cursor = m.cursor;
        self.hyper = m.hyperparams;
        self.ledger = ledger;
        self.init = Some(r.path.clone());
    }

    fn spawn(&mut self, n: u32) {
        self.m.spawn(Instant::now(), n);
        self.execute();
    }

    /// Carries out what membership decided.
    fn execute(&mut self) {
        while let Some(cmd) = self.m.poll_command() {
            match cmd {
                Command::Spawn { worker } => {
                    let auth = JobAuth { job: self.cfg.spec.job.clone(), secret: self.cfg.secret.clone() };
                    if let Err(e) = self.scaler.spawn(worker, &self.addr, &auth) {
                        self.m.spawn_failed(worker, format!("{e:#}"));
                    }
                }
                Command::Welcome { conn, assigned } => {
                    // A failed send closes the connection; its reader reports that.
                    let welcome = ToWorker::Welcome(Box::new(self.cfg.spec.clone()));
                    if let Some(stream) = self.conns.get_mut(&conn) {
                        if let Some(worker) = assigned {
                            let _ = send(stream, &ToWorker::Assigned { worker });
                        }
                        let _ = send(stream, &welcome);
                    }
                }
                Command::Refuse { conn, reason } => {
                    if let Some(mut stream) = self.conns.remove(&conn) {
                        let _ = send(&mut stream, &ToWorker::Stop { reason });
                    }
                }
                Command::Stop { worker, conn, reason, grace } => {
                    if let Some(mut stream) = conn.and_then(|c| self.conns.remove(&c)) {
                        let _ = send(&mut stream, &ToWorker::Stop { reason });
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
    fn handle(&mut self, ev: Inbound) {
        let now = Instant::now();
        match ev {
            Inbound::Conn(n, s) => {
                self.conns.insert(n, s);
            }
            Inbound::Msg(n, FromWorker::Hello { worker, pid }) => {
                self.m.handle(now, Event::Hello { conn: n, worker, pid });
            }
            // The inbox keeps heartbeats to itself; one that got here says nothing new.
            Inbound::Msg(_, FromWorker::Heartbeat) => {}
            Inbound::Msg(n, FromWorker::Ready) => {
                self.m.handle(now, Event::Ready { conn: n });
            }
            Inbound::Msg(_, FromWorker::Saved { checkpoints }) => {
                self.take_written(&checkpoints);
                if let Some(w) = checkpoints.into_iter().rfind(|w| w.step == self.committed) {
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
            Inbound::Msg(n, FromWorker::Failed { generation, error, cause, .. }) => {
                if let (Some(&rank), Some(p)) = (self.ranks.get(&n), self.pipe.as_mut())
                    && p.generation == generation
                {
                    p.fail(rank, error, cause);
                }
            }
            Inbound::Closed(n, why) => {
                self.conns.remove(&n);
                let rank = self.ranks.get(&n).copied();
                if self.m.handle(now, Event::Closed { conn: n, why: why.clone() }).is_some()
                    && let (Some(rank), Some(p)) = (rank, self.pipe.as_mut())
                {
                    p.lost(rank, &why);
                }
            }
        }
        self.execute();
    }

    /// Notices started workers that died before joining, and gives up those
    /// past the join timeout.
    fn check_spawning(&mut self) {
        let now = Instant::now();
        for (worker, status) in self.scaler.exited() {
            self.m.handle(now, Event::Exited { worker, status });
        }
        self.m.handle_timeout(now);
        self.execute();
    }

    /// Waits for joiners until at least `want` are there (or nothing is starting).
    fn wait_for_joiners(&mut self, want: usize) -> Result<()> {
        while self.m.joiners() < want && !self.m.nothing_loading() {
            match self.rx.recv_timeout(Duration::from_millis(100)) {
                Ok(ev) => self.handle(ev),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => bail!("the control listener stopped"),
            }
            self.check_spawning();
        }
        if self.m.joiners() == 0 {
            bail!("no worker joined the job (worker logs: {})", self.log_hint());
        }
        Ok(())
    }

    /// The end of worker `id`'s log, for a note about its failure.
    fn log_tail(&self, id: u64) -> String {
        self.scaler.log_of(id).map(|p| super::scaler::log_tail(&p, 3)).unwrap_or_default()
    }

    /// Checks the teachers this job started: a dead one is no longer handed
    /// to new workers; with none left the job cannot go on.
    fn check_teachers(&mut self) -> Result<()> {
        let Some(watch) = self.cfg.teacher_watch.as_mut() else { return Ok(()) };
        let dead = watch.dead();
        let Some(super::proto::TeacherSource::Fixed(list)) = self.cfg.spec.teachers.as_mut() else {
            return Ok(());
        };
        let mut gone = Vec::new();
        for (addr, how) in dead {
            if let Some(i) = list.iter().position(|a| *a == addr) {
                list.remove(i);
                gone.push(how);
            }
        }
        if list.is_empty() && !gone.is_empty() {
            bail!("every teacher of the job has exited: {}", gone.join("; "));
        }
        for how in gone {
            self.note(format!("{how}; new workers will not be given it"));
        }
        Ok(())
    }

    fn log_hint(&self) -> String {
        self.scaler
            .log_of(0)
            .and_then(|p| p.parent().map(|d| d.display().to_string()))
            .unwrap_or_else(|| "the scaler's".into())
    }

    fn job(&mut self) -> Result<JobOutcome> {
        // Before anything is read or changed: one coordinator per job.
        let lease =
            self.rt.block_on(super::keeper::take_lease(&self.store, &self.cfg.spec.job, LEASE_TTL))?;
        let resumed = self.resume()?;
        self.keeper = Some(super::keeper::StoreKeeper::start(
            &self.cfg.store,
            keys::job_state(&self.cfg.spec.job),
            self.state_token,
            Some(lease),
        )?);
        self.first_generation = self.generation + 1;
        self.note(format!(
            "coordinator at {} (rendezvous {}); workers join with `edl-runtime worker --coordinator {}`",
            self.addr, self.rendezvous_at, self.addr
        ));
        let total = self.cfg.spec.epochs;
        let first = self.cfg.initial_workers.clamp(self.cfg.min_workers.max(1), self.cfg.max_workers.max(1));
        self.spawn(first);
        self.wait_for_joiners(first as usize)?;
        // The first workers are members before any phase: a job resumed at
        // its end goes straight to the final checkpoint, which admits no
        // newcomer.
        self.boundary()?;
        let mut phase = JobPhase::new(total, Duration::from_millis(self.cfg.spec.teacher_wait_ms));
        let final_checkpoint = loop {
            self.fenced()?;
            if self.m.world() == 0 && self.m.joiners() == 0 {
                self.recover_from_nothing()?;
            }
            match phase.next(self.epoch) {
                Phase::Train { again } => {
                    if again {
                        // Every worker died before the final state was written:
                        // the recovery went back to an earlier checkpoint, whose
                        // remaining steps are trained again.
                        self.note(format!(
                            "the final state was lost with its workers; training again from step {}",
                            self.committed
                        ));
                    }
                    self.check_teachers()?;
                    if let Some(actions) = self.decision.take() {
                        self.apply_decision(&actions);
                    }
                    self.boundary()?;
                    let before = self.committed;
                    let Some(f) = self.run_generation()? else { continue };
                    if f.cause == Some(super::proto::FailCause::NoTeachers) {
                        // Name the teachers' end if the job started them.
                        self.check_teachers()?;
                    }
                    phase.generation_failed(self.committed > before, &f).map_err(|e| anyhow!(e))?;
                    self.fail(f);
                    self.check_spawning();
                }
                Phase::Finish { entering } => {
                    if entering {
                        // The final state: no new workers any more.
                        self.m.stop_newcomers("the job is done");
                        self.execute();
                    }
                    self.boundary()?;
                    // Workers that have not joined a generation yet (a job
                    // resumed at its end) load the state first.
                    self.ensure_generation();
                    match self.write_final()? {
                        Ok(p) => break p,
                        Err(f) => {
                            phase
                                .final_failed()
                                .map_err(|e| anyhow!("{e}; last: {}", f.errors.join("; ")))?;
                            self.fail(f);
                        }
                    }
                }
            }
        };
        let final_world = self.m.world();
        self.m.stop_all("the job is done");
        self.execute();
        self.save_state(true);
        if let Some(k) = &self.keeper
            && let Err(e) = k.flush(Duration::from_secs(10))
        {
            self.note(format!("the job's final state may not be in the store: {e}"));
        }
        let outcome = JobOutcome {
            final_checkpoint,
            steps: self.committed,
            epochs: self.ledger.epochs.clone(),
            scale_events: self.events.clone(),
            timeline: std::mem::take(&mut self.timeline),
            resumed_from_step: resumed,
            samples: self.samples,
            train_secs: self.started.elapsed().as_secs_f64(),
            generations: (self.first_generation, self.generation),
            checkpoints: self.checkpoints.clone(),
            final_world,
            hyper: self.hyper,
            workers_started: self.m.started().to_vec(),
        };
        let finished = outcome.epochs.len() as u64;
        let whole = self.train_len as u64;
        if finished != total {
            bail!(
                "the job ended with {finished} of {total} epochs accounted for ({}); its checkpoints stay for a rerun",
                outcome
                    .epochs
                    .iter()
                    .map(|e| format!("epoch {}: {} of {whole} samples", e.epoch, e.samples_committed))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        Ok(outcome)
    }

    /// Every worker is gone: start over from the newest checkpoint with new ones.
    fn recover_from_nothing(&mut self) -> Result<()> {
        self.note("no worker left; restarting from the newest checkpoint".into());
        match self.checkpoints().latest().context("listing the checkpoints to restart from")?.0 {
            Some(r) => {
                let book: Bookkeeping = serde_json::from_value(r.manifest.plugin_state.clone())
                    .with_context(|| format!("{}: manifest has no coordinator state", r.path.display()))?;
                self.restore(&r, book.ledger);
            }
            None => {
                self.committed = 0;
                self.epoch = 0;
                self.cursor = 0;
                self.hyper = self.cfg.hyper;
                self.ledger = Ledger::new(self.train_len);
                self.init = None;
            }
        }
        self.m.refill(Instant::now());
        self.execute();
        self.wait_for_joiners(1)?;
        Ok(())
    }

    /// At a step boundary: admits joiners, applies replacements, forms a new
    /// generation when membership changed.
    fn boundary(&mut self) -> Result<()> {
        let from = self.m.world();
        let b = self.m.boundary(true, self.init.is_some());
        self.execute();
        let (reasons, admitted) = (b.reasons, b.admitted);
        if !b.changed {
            return Ok(());
        }
        self.generation += 1;
        self.pipe = None;
        self.lease_now = true;
        let to = self.m.world();
        let mut pending = self.pending.take().unwrap_or(Pending::new(from, String::new()));
        if pending.reason.is_empty() {
            pending.reason = match (from, self.init.is_some()) {
                (0, true) => "job resumed".into(),
                (0, false) => "job started".into(),
                _ if to > from => "workers joined".into(),
                _ => "workers left".into(),
            };
        }
        if admitted > 0 && pending.join_ms.is_none() && from > 0 {
            // The policy decided earlier; the others trained while the new worker started.
            pending.join_ms = Some(ms(pending.boundary.elapsed()));
            pending.boundary = Instant::now();
        }
        if !reasons.is_empty() {
            pending.reason = format!("{}; {}", pending.reason, reasons.join(", "));
        }
        pending.generation = Some(self.generation);
        self.pending = Some(pending);
        let local = (self.hyper.global_batch / to.max(1)).max(1);
        self.hyper.local_batch = local;
        if let Some(a) = self.adapter.as_mut() {
            let ev = ResizeEvent { step: self.committed, old_world_size: from, new_world_size: to };
            let answer = a.on_resize(&ev, &self.hyper);
            if let Some(h) = self.adapter_answer("on-resize", answer)? {
                self.hyper = h;
            }
        }
        self.last_change = Instant::now();
        self.save_state(false);
        Ok(())
    }

    /// The adapter's hyperparameters, to use. An answer that breaks the
    /// contract (the plugin layer checked it) or asks for a batch larger
    /// than the training set ends the job, naming the adapter: training on
    /// it would be garbage. A trap or a deadline keeps the current
    /// hyperparameters (`None`).
    fn adapter_answer(
        &mut self,
        call: &str,
        answer: Result<Hyperparams, crate::plugin::Error>,
    ) -> Result<Option<Hyperparams>> {
        let name = self.adapter.as_ref().map(|a| a.info().name.clone()).unwrap_or_default();
        match answer {
            Ok(h) if h.global_batch as usize > self.train_len => bail!(
                "batch adapter {name}: {call} asked for a global batch of {}, above the {} training samples",
                h.global_batch,
                self.train_len
            ),
            Ok(h) => Ok(Some(h)),
            Err(e @ crate::plugin::Error::Contract { .. }) => bail!("batch adapter {name}: {e}"),
            Err(e) => {
                self.note(format!("batch adapter {name}: {call} failed, hyperparameters kept: {e}"));
                Ok(None)
            }
        }
    }

    /// A checkpoint at this commit point: every `--checkpoint-every`
    /// steps, when `--checkpoint-secs` passed since the last one, and at
    /// each epoch's end.
    fn checkpoint_due(&mut self) -> Option<Manifest> {
        let steps = self.cfg.checkpoint_every.is_some_and(|n| self.committed.is_multiple_of(n.max(1)));
        let time = self.last_checkpoint.elapsed() >= self.cfg.checkpoint_interval;
        let at_epoch_start = self.cursor == 0;
        if self.committed == 0 || !(steps || time || at_epoch_start) {
            return None;
        }
        self.last_checkpoint = Instant::now();
        Some(self.manifest())
    }

    fn manifest(&self) -> Manifest {
        let book = Bookkeeping {
            ledger: self.ledger.clone(),
            events: self.events.clone(),
            generation: self.generation,
            data: Some(DataIdentity::of(&self.cfg.spec)),
        };
        Manifest {
            step: self.committed,
            epoch: self.epoch,
            cursor: self.cursor,
            seed: self.cfg.spec.seed,
            hyperparams: self.hyper,
            plugin_state: serde_json::to_value(book).unwrap_or_default(),
            files: Default::default(),
        }
    }

    /// The job was taken over (its lease in the store is lost): stop.
    fn fenced(&self) -> Result<()> {
        match self.keeper.as_ref().and_then(|k| k.fenced()) {
            Some(why) => bail!("job {:?}: {why}", self.cfg.spec.job),
            None => Ok(()),
        }
    }

    /// A membership change waits for the windows already sent to commit.
    fn change_waiting(&self) -> bool {
        self.decision.is_some() || self.m.change_waiting()
    }

    /// Runs the current generation's steps, forming it first when it is
    /// new, until it drains for a membership change or the job's end
    /// (`None`), or fails.
    fn run_generation(&mut self) -> Result<Option<Failure>> {
        self.ensure_generation();
        let mut chores = Instant::now() + CHORES_EVERY;
        loop {
            self.fill_windows()?;
            while let Some(c) = self.pipe.as_mut().and_then(Pipeline::poll_commit) {
                self.commit_window(c)?;
                self.fill_windows()?;
            }
            let pipe = self.pipe.as_mut().expect("formed above");
            if let Some(f) = pipe.settled_failure() {
                self.pipe = None;
                return Ok(Some(f));
            }
            if pipe.drained() && !pipe.failed() {
                return Ok(None);
            }
            // Ranks' timeouts are checked with the chores (their bound is
            // seconds; checking on every message would cost O(N) each).
            let wake = [self.m.poll_timeout(), Some(chores)].into_iter().flatten().min();
            let left = wake.map_or(CHORES_EVERY, |t| t.saturating_duration_since(Instant::now()));
            match self.rx.recv_timeout(left) {
                Ok(ev) => {
                    self.handle(ev);
                    // Whatever else has arrived, before planning again.
                    while let Ok(ev) = self.rx.try_recv() {
                        self.handle(ev);
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => bail!("the control listener stopped"),
            }
            let now = Instant::now();
            if now >= chores {
                chores = now + CHORES_EVERY;
                let late = self.pipe.as_mut().map(|p| p.handle_timeout(now)).unwrap_or_default();
                for rank in late {
                    let id = self.m.members()[rank].id;
                    self.scaler.stop(id, Duration::from_secs(1));
                }
                self.check_spawning();
                self.lease_members();
                if self.last_teacher_check.elapsed() >= Duration::from_secs(1) {
                    self.last_teacher_check = Instant::now();
                    self.check_teachers()?;
                }
                if self.last_save.elapsed() >= Duration::from_secs(1) {
                    self.save_state(false);
                }
                self.fenced()?;
            }
        }
    }

    /// Forms the current generation unless it is formed already.
    fn ensure_generation(&mut self) {
        if self.pipe.as_ref().map(|p| p.generation) != Some(self.generation) {
            self.start_generation();
        }
    }

    /// Tells every member its place in the new generation; planning starts
    /// again from the committed step.
    fn start_generation(&mut self) {
        let key = format!("{}/generation-{}", self.cfg.spec.job, self.generation);
        self.rendezvous.set_generation(self.generation);
        self.gate.set_generation(self.generation);
        let names: Vec<String> =
            self.m.members().iter().map(|m| format!("worker {} (pid {})", m.id, m.pid)).collect();
        let world = names.len();
        let mut pipe =
            Pipeline::new(self.generation, names, self.committed, Instant::now(), self.cfg.step_timeout);
        for (rank, m) in self.m.members().iter().enumerate() {
            let g = Generation {
                generation: self.generation,
                rank,
                world,
                rendezvous: self.rendezvous_at.clone(),
                rendezvous_key: key.clone(),
                committed_steps: self.committed,
                init: self.init.clone(),
            };
            let Some(stream) = self.conns.get_mut(&m.conn).filter(|_| !self.m.is_closed(m.conn)) else {
                pipe.lost(rank, "connection closed");
                continue;
            };
            if let Err(e) = send(stream, &ToWorker::Generation(Box::new(g))) {
                pipe.lost(rank, &e.to_string());
            }
        }
        self.pipe = Some(pipe);
        self.ranks = self.m.members().iter().enumerate().map(|(r, m)| (m.conn, r)).collect();
        self.plan_at =
            StepPlan { step: self.committed, epoch: self.epoch, cursor: self.cursor, hyper: self.hyper };
    }

    /// Sends windows ahead while membership is stable: the first window of
    /// a generation is one step; later ones hold about `WINDOW_WORK_MS` of
    /// steps and end where a checkpoint, a policy decision or an epoch's
    /// end falls.
    fn fill_windows(&mut self) -> Result<()> {
        let total = self.cfg.spec.epochs;
        loop {
            let Some(pipe) = self.pipe.as_ref() else { return Ok(()) };
            if pipe.failed() || pipe.windows() >= AHEAD || self.plan_at.epoch >= total {
                return Ok(());
            }
            if pipe.started() && self.change_waiting() {
                return Ok(());
            }
            let n = if pipe.started() { self.window_len() } else { 1 };
            let mut steps = Vec::with_capacity(n as usize);
            for _ in 0..n {
                steps.push(self.plan_at);
                let cut = self.advance_plan()?;
                if cut || self.plan_at.epoch >= total {
                    break;
                }
            }
            let generation = self.generation;
            let world = self.m.members().len();
            let (len, seed) = (self.train_len, self.cfg.spec.seed);
            let perm = permutation_of(&mut self.plan_perm, len, seed, steps[0].epoch);
            let mut lost = Vec::new();
            for (rank, m) in self.m.members().iter().enumerate() {
                // Each rank gets its own samples of every step of the window.
                let shares = steps
                    .iter()
                    .map(|p| {
                        let gb = p.hyper.global_batch.max(1) as usize;
                        let r = crate::data::shard(p.cursor, gb, rank, world, len);
                        Share { start: r.start as u32, end: r.end as u32, indices: perm[r].to_vec() }
                    })
                    .collect();
                let line = encode(&ToWorker::Steps { generation, steps: steps.clone(), shares })
                    .map_err(|e| anyhow!("encoding a window: {e}"))?;
                if let Some(stream) = self.conns.get_mut(&m.conn)
                    && let Err(e) = send_encoded(stream, &line)
                {
                    lost.push((rank, e.to_string()));
                }
            }
            let pipe = self.pipe.as_mut().expect("checked above");
            pipe.issue(Instant::now(), steps);
            for (rank, e) in lost {
                pipe.lost(rank, &e);
            }
        }
    }

    fn window_len(&self) -> u64 {
        match self.step_ms {
            Some(ms) if ms > 0.0 => ((WINDOW_WORK_MS / ms) as u64).clamp(1, MAX_WINDOW),
            _ => 1,
        }
    }

    /// Moves the plan to the next step, asking the adapter for its
    /// hyperparameters. True when a window must end there.
    fn advance_plan(&mut self) -> Result<bool> {
        let mut p = self.plan_at;
        p.cursor += p.hyper.global_batch.max(1) as usize;
        p.step += 1;
        let mut cut = false;
        if p.cursor >= self.train_len {
            p.cursor = 0;
            p.epoch += 1;
            cut = true;
        }
        cut |= self.cfg.checkpoint_every.is_some_and(|n| p.step.is_multiple_of(n.max(1)))
            || p.step.is_multiple_of(self.cfg.decide_every.max(1));
        if let Some(a) = self.adapter.as_mut() {
            let answer = a.on_step(p.step, &p.hyper);
            if let Some(h) = self.adapter_answer("on-step", answer)? {
                p.hyper = h;
            }
        }
        self.plan_at = p;
        Ok(cut)
    }

    /// Every rank finished a window: its steps enter the ledger, in order.
    fn commit_window(&mut self, c: Committed) -> Result<()> {
        let first_of_generation =
            self.pending.as_ref().is_some_and(|p| p.generation == Some(self.generation))
                && c.steps.first().map(|s| s.step) == Some(self.committed);
        if !first_of_generation && !c.steps.is_empty() {
            // The slowest rank's compute per step: windows are sized by the
            // work in them, not by the time the control plane itself takes.
            let per = c
                .reports
                .iter()
                .map(|r| r.iter().map(|d| d.compute_ms).sum::<f64>() / c.steps.len() as f64)
                .fold(0.0, f64::max);
            self.step_ms = Some(self.step_ms.map_or(per, |m| 0.7 * m + 0.3 * per));
        }
        // The step after the window: the next one sent, or the next to plan.
        let after = self.pipe.as_ref().and_then(Pipeline::next_planned).unwrap_or(self.plan_at);
        for (i, plan) in c.steps.iter().enumerate() {
            let reports: Vec<StepDone> = c.reports.iter().map(|r| r[i]).collect();
            let next = c.steps.get(i + 1).copied().unwrap_or(after);
            self.commit_step(plan, &reports, first_of_generation && i == 0, c.setup_ms, next.hyper)?;
        }
        self.init = None;
        // At the job's end the final checkpoint is asked for on its own.
        let checkpoint = if self.epoch < self.cfg.spec.epochs { self.checkpoint_due() } else { None };
        let step = self.committed;
        let wrote = checkpoint.is_some();
        let commit = |checkpoint| {
            encode(&ToWorker::Commit { step, checkpoint, wait: false }).map_err(|e| anyhow!("a commit: {e}"))
        };
        // Rank 0's message differs only when it carries a checkpoint.
        let rank0 = checkpoint.map(|c| commit(Some(c))).transpose()?;
        let rest = commit(None)?;
        for (rank, m) in self.m.members().iter().enumerate() {
            if let Some(stream) = self.conns.get_mut(&m.conn) {
                let line = rank0.as_ref().filter(|_| rank == 0).unwrap_or(&rest);
                // A failed send closes the connection; its reader reports that.
                let _ = send_encoded(stream, line);
            }
        }
        if wrote || self.last_save.elapsed() >= Duration::from_secs(1) {
            self.save_state(false);
        }
        if self.committed.is_multiple_of(self.cfg.decide_every.max(1)) && self.epoch < self.cfg.spec.epochs {
            self.decide();
        }
        Ok(())
    }

    /// Commits one step every rank finished: its samples enter the ledger
    /// (the ids at the positions each rank reported), the cursor moves.
    /// `next_hyper`: the hyperparameters planned for the step after it.
    fn commit_step(
        &mut self,
        plan: &StepPlan,
        reports: &[StepDone],
        first: bool,
        setup_ms: f64,
        next_hyper: Hyperparams,
    ) -> Result<()> {
        let gb = plan.hyper.global_batch.max(1) as usize;
        let expected = (plan.cursor + gb).min(self.train_len) - plan.cursor;
        let perm = permutation_of(&mut self.perm, self.train_len, self.cfg.spec.seed, plan.epoch);
        let mut rows = 0usize;
        let mut loss = 0.0;
        for (rank, d) in reports.iter().enumerate() {
            let id = self.m.members()[rank].id;
            let ids = perm.get(d.start as usize..d.end as usize).ok_or_else(|| {
                anyhow!(
                    "worker {id}: step {} reported positions {}..{} outside the epoch",
                    d.step,
                    d.start,
                    d.end
                )
            })?;
            self.ledger.commit(ids).map_err(|e| anyhow!("worker {id}: {e}"))?;
            rows += ids.len();
            loss += d.loss;
            // The first step of a generation also starts the read-ahead; it does not count.
            if d.compute_ms > 0.0 && !ids.is_empty() && !first {
                let e = self.worker_rate.entry(id).or_insert((0.0, 0.0));
                e.0 += ids.len() as f64;
                e.1 += d.compute_ms / 1e3;
            }
        }
        if rows != expected {
            bail!("step {}: the ranks trained on {rows} samples, the step has {expected}", plan.step);
        }
        self.committed = plan.step + 1;
        self.samples += rows as u64;
        self.epoch = plan.epoch;
        self.cursor = plan.cursor + gb;
        self.hyper = next_hyper;
        let now = Instant::now();
        self.recent.push_back((now, rows as u64));
        while self.recent.len() > 20 {
            self.recent.pop_front();
        }
        let sps = match (self.recent.front(), self.recent.len()) {
            (Some((t0, _)), n) if n > 1 => {
                let s: u64 = self.recent.iter().skip(1).map(|r| r.1).sum();
                s as f64 / now.duration_since(*t0).as_secs_f64().max(1e-9)
            }
            _ => 0.0,
        };
        let rec = StepRecord {
            step: self.committed,
            epoch: self.epoch,
            world: self.m.world(),
            secs: self.started.elapsed().as_secs_f64(),
            loss,
            samples_per_sec: sps,
            cursor: self.cursor.min(self.train_len),
        };
        (self.progress)(Progress::Step(&rec));
        self.timeline.push(rec);
        if let Some(p) = self.pending.take_if(|_| first) {
            let ev = ScaleEvent {
                setup_ms,
                step: self.committed - 1,
                from: p.from,
                to: self.m.world(),
                pause_ms: ms(p.boundary.elapsed()),
                reason: p.reason,
                generation: self.generation,
                join_ms: p.join_ms,
                at_secs: self.started.elapsed().as_secs_f64(),
            };
            (self.progress)(Progress::Scale(&ev));
            self.events.push(ev);
        }
        if self.cursor >= self.train_len {
            let rec = self.ledger.finish_epoch(self.epoch);
            (self.progress)(Progress::Epoch(&rec));
            self.epoch += 1;
            self.cursor = 0;
        }
        Ok(())
    }

    /// Asks rank 0 to write the job's final state and waits for it (bounded
    /// by the step timeout). An error: the failure that stopped it.
    fn write_final(&mut self) -> Result<std::result::Result<PathBuf, Failure>> {
        let step = self.committed;
        let Some(m0) = self.m.members().first().cloned() else {
            bail!("no worker holds the final state");
        };
        let name = format!("worker {} (pid {})", m0.id, m0.pid);
        let failure = |error: String, dead: bool| Failure {
            dead: if dead { BTreeSet::from([0]) } else { BTreeSet::new() },
            errors: vec![error],
            cause: None,
            step,
            dropped: 0,
        };
        self.saved = None;
        let msg = ToWorker::Commit { step, checkpoint: Some(self.manifest()), wait: true };
        let sent = match self.conns.get_mut(&m0.conn).filter(|_| !self.m.is_closed(m0.conn)) {
            Some(stream) => send(stream, &msg).map_err(|e| e.to_string()),
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
            if self.m.is_closed(m0.conn) {
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
            match self.rx.recv_timeout(left.min(CHORES_EVERY)) {
                Ok(ev) => self.handle(ev),
                Err(mpsc::RecvTimeoutError::Timeout) => self.check_spawning(),
                Err(mpsc::RecvTimeoutError::Disconnected) => bail!("the control listener stopped"),
            }
        }
    }

    /// Records the checkpoint writes a rank reported.
    fn take_written(&mut self, written: &[super::proto::Written]) {
        for w in written {
            match &w.result {
                Ok(p) => {
                    (self.progress)(Progress::Checkpoint { step: w.step, path: p });
                    self.checkpoints.push(p.clone());
                    self.checkpoints.retain(|c| c.exists());
                }
                Err(e) => self.note(format!("checkpoint of step {} failed: {e}", w.step)),
            }
        }
    }

    /// The generation failed: drop the dead, keep the survivors for the next one.
    fn fail(&mut self, f: Failure) {
        let from = self.m.world();
        let dead: BTreeSet<u64> =
            f.dead.iter().filter_map(|&r| self.m.members().get(r).map(|m| m.id)).collect();
        self.m.fail(Instant::now(), &dead);
        self.execute();
        let why = if f.errors.is_empty() { "a rank failed".to_string() } else { f.errors.join("; ") };
        let ahead = match f.dropped {
            0 | 1 => String::new(),
            n => format!(", {} later step(s) sent ahead dropped", n - 1),
        };
        let world = self.m.world();
        if self.epoch >= self.cfg.spec.epochs {
            self.note(format!(
                "the final checkpoint (step {}) was not written (generation {}): {why}; {world} worker(s) left",
                f.step, self.generation
            ));
        } else {
            self.note(format!(
                "step {} not committed (generation {}{ahead}): {why}; redoing it with {world} worker(s)",
                f.step, self.generation
            ));
        }
        let lost: Vec<String> = dead.iter().map(|d| format!("worker {d} lost")).collect();
        let reason = if lost.is_empty() { "collective failed".to_string() } else { lost.join(", ") };
        self.pending = Some(Pending { failure: true, ..Pending::new(from, reason) });
    }

    /// Carries out a policy decision.
    fn apply_decision(&mut self, actions: &[Action]) {
        let world = self.m.world();
        if let Some(reason) = self.m.apply_decision(Instant::now(), actions) {
            match self.pending.as_mut() {
                // A failure's resize not formed yet: one event says both.
                Some(p) if p.generation.is_none() && p.failure => {
                    p.reason = format!("{}; {reason}", p.reason)
                }
                _ => self.pending = Some(Pending::new(world, reason)),
            }
        }
        self.execute();
    }

    /// Asks the policy what to do.
    fn decide(&mut self) {
        if self.m.handing_over() {
            // A handover is under way; the policy sees the job after it.
            return;
        }
        let now = Instant::now();
        let (t0, s0) = self.window;
        let throughput = (self.samples - s0) as f64 / now.duration_since(t0).as_secs_f64().max(1e-9);
        self.window = (now, self.samples);
        let world = self.m.world();
        let coming = self.m.coming();
        let remaining = (self.cfg.spec.epochs.saturating_sub(self.epoch) as usize * self.train_len)
            .saturating_sub(self.cursor) as u64;
        let view = ClusterView {
            step: self.committed,
            epoch: self.epoch as u32,
            world_size: world,
            min_workers: self.cfg.min_workers,
            max_workers: self.cfg.max_workers,
            free_slots: self.cfg.max_workers.saturating_sub(world + coming),
            global_batch: self.hyper.global_batch,
            throughput,
            workers: self
                .m
                .members()
                .iter()
                .filter_map(|m| {
                    let (rows, secs) = self.worker_rate.get(&m.id).copied()?;
                    (secs > 0.0).then(|| WorkerStats { id: m.id, throughput: rows / secs })
                })
                .collect(),
            secs_since_change: self.last_change.elapsed().as_secs_f64(),
            price_per_worker_hour: self.cfg.price_per_worker_hour,
            samples_remaining: remaining,
        };
        self.worker_rate.clear();
        let actions = match self.policy.decide(&view) {
            Ok(a) => a,
            Err(e) => {
                self.note(format!("scaling policy failed, holding: {e}"));
                return;
            }
        };
        if actions.iter().any(|a| matches!(a, Action::ScaleIn(_))) {
            // Workers leave at a step boundary: once the windows already
            // sent are committed.
            self.decision = Some(actions);
        } else {
            // Starting workers (and replacements) needs no boundary: they
            // join at one once ready.
            self.apply_decision(&actions);
        }
    }

    /// Removes a worker's lease from the store.
    fn forget(&mut self, id: u64) {
        if let Some(k) = &self.keeper {
            k.delete(format!("{}{id}", keys::workers(&self.cfg.spec.job)));
        }
    }

    /// Keeps the members' leases in the store fresh (once a second).
    fn lease_members(&mut self) {
        if self.last_lease.elapsed() < Duration::from_secs(1) && !std::mem::take(&mut self.lease_now) {
            return;
        }
        self.last_lease = Instant::now();
        let Some(k) = &self.keeper else { return };
        let prefix = keys::workers(&self.cfg.spec.job);
        for m in self.m.members() {
            let v = serde_json::json!({"pid": m.pid, "generation": self.generation}).to_string();
            k.lease(format!("{prefix}{}", m.id), v.into_bytes(), Duration::from_secs(5));
        }
    }

    /// Hands the job's state to the store keeper (written off the step's path).
    fn save_state(&mut self, finished: bool) {
        let s = JobState {
            generation: self.generation,
            committed_steps: self.committed,
            epoch: self.epoch,
            cursor: self.cursor,
            next_worker_id: self.m.next_id(),
            members: self.m.members().iter().map(|m| m.id).collect(),
            finished,
        };
        if let Some(k) = &self.keeper {
            k.state(s);
        }
    }
}
