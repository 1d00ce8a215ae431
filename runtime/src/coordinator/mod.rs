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

mod beats;
mod held;
pub mod machine;
mod members;
mod memory;
mod pins;
pub mod pool;
mod ps;
mod records;
pub mod report;
mod resume;
mod routes;
mod scaling;
mod spares;
mod steps;
pub mod watchdog;

use crate::job::{JobConfig, assembly::Job};
use crate::leader::record::TeacherHandle;
pub use records::{
    AdapterDecision, JobOutcome, PolicyDecision, Progress, ServerDecision, SpareDecision, StepRecord,
    StoreEvent, UnusedWorker, WorkerState,
};
pub use resume::{AlreadyFinished, finished_here, mark_complete};

use crate::checkpoint::Checkpoints;
use crate::control::inbox::Inbound;
use crate::control::proto::StepPlan;
use crate::coordinator::machine::membership::{Leave, Membership};
use crate::coordinator::machine::phase::{CrashLoop, JobPhase, Phase};
use crate::coordinator::machine::pipeline::Pipeline;
use crate::coordinator::machine::tally::Tally;
use crate::coordinator::machine::timers::{Timer, TimerTable};
use crate::leader::record::{DataIdentity, JobState, PluginMemory, ScaleEvent};
use crate::leader::seal::RecordKey;
use crate::plugin::{AdapterPlugin, PolicyPlugin};
use crate::scalers::Scaler;
use crate::store::{AnyStore, keys};
use anyhow::{Context, Result, anyhow, bail};
use edl_host_gpu::comm::{RendezvousServer, auth::JobAuth};
use edl_plugin_sdk::{Action, Hyperparams};
use records::Pending;
use std::{
    collections::HashMap,
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, mpsc},
    time::{Duration, Instant},
};

struct Coordinator<'a> {
    /// How the job runs: fixed once it starts.
    cfg: Arc<JobConfig>,
    /// What workers are told that changes while the job runs.
    told: Told,
    /// The teacher processes this job started, when it started them.
    teacher_watch: Option<Box<dyn crate::job::teacher_pool::TeacherWatch>>,
    /// The pool that sizes them.
    pool: Option<pool::PoolThread>,
    /// When the pool was last told what the students did.
    pool_told: Instant,
    /// The scaling policy's decisions (the newest), for the report.
    policy_decisions: std::collections::VecDeque<records::PolicyDecision>,
    adapter_decisions: std::collections::VecDeque<records::AdapterDecision>,
    /// Workers the job ended before they joined.
    unused: Vec<UnusedWorker>,
    /// Steps computed again (after failures, or a resume past the checkpoint).
    redone_steps: u64,
    /// The workers' states last told to the watchers.
    told_workers: Vec<WorkerState>,
    /// Step times measured at each (world size, global batch), for the
    /// adapter, and the key of the window since the last decision.
    step_times: machine::steptimes::StepTimes,
    /// When the current decision window started.
    window_started: Instant,
    /// The student world the pool was last told was planned.
    pool_planned: u32,
    /// The pool's teachers that outlive this coordinator (kept in the
    /// store for the one that takes the job over), and those the one before
    /// left, until the pool has taken them over.
    teacher_handles: Box<dyn Fn() -> Vec<TeacherHandle> + Send>,
    teachers_left: Vec<TeacherHandle>,
    policy: Box<dyn PolicyPlugin>,
    adapter: Option<Box<dyn AdapterPlugin>>,
    scaler: crate::scalers::fenced::FencedScaler,
    progress: &'a mut dyn FnMut(Progress),
    /// The store, the control port and the rendezvous.
    io: Io,
    /// Where the job's checkpoints are (read here, written by rank 0).
    ckpt: Checkpoints,
    /// Open control connections.
    conns: HashMap<u64, crate::control::outbox::Outbox>,
    /// The welcomed workers' heartbeats (see [`beats`]).
    beats: beats::Beats,
    /// How the ranks are reached (see [`routes::Routes`]).
    routes: Option<routes::Routes>,
    /// Who is in the job (the decisions; this struct does the I/O).
    membership: Membership,
    /// The job's parameter servers, and what it follows of them.
    ps: PsState,
    /// What a policy sizing the warm spares is told of them.
    spare_book: SpareBook,
    generation: u64,
    first_generation: u64,
    /// Steps committed, the epoch and cursor, the ledger, throughput.
    tally: Tally,
    hyper: Hyperparams,
    /// The world of the generation `hyper` was set for (0 before the
    /// first): the world a resize goes from, whenever its workers left
    /// (a scale-in or a loss takes them out before the boundary).
    hyper_world: u32,
    /// The checkpoint's step this run resumed from, if it did.
    resumed: Option<u64>,
    /// Watches that the loop comes back to the workers (`--loop-stall-secs`).
    watchdog: Option<watchdog::Watchdog>,
    events: Vec<ScaleEvent>,
    pending: Option<Pending>,
    /// Decisions whose workers have not joined yet, oldest first.
    decided: std::collections::VecDeque<Pending>,
    init: Option<PathBuf>,
    /// A generation was just formed: leases are written at once.
    lease_now: bool,
    /// The members' lease records, made once a generation.
    leases: Option<records::LeaseRecords>,
    last_change: Instant,
    started: Instant,
    /// The periodic work's deadlines.
    timers: TimerTable,
    /// When the first generation formed: training time (and so samples/s)
    /// counts from here, not from the workers' start-up.
    training_since: Option<Instant>,
    /// The room the scheduler last reported (said when it changes).
    capacity: Option<u32>,
    timeline: Vec<StepRecord>,
    checkpoints: Vec<PathBuf>,
    /// Writes job state and leases off the step's path (from the job's start).
    keeper: Option<crate::leader::keeper::StoreKeeper>,
    /// The stored job state's token when this run read it.
    state_token: Option<u64>,
    /// The lease token every checkpoint is written with (see
    /// [`crate::checkpoint::Fence`]).
    fence: Option<u64>,
    /// The current generation's step barrier, and its ranks by connection.
    pipe: Option<Pipeline>,
    /// The relays of a generation that drained for a change, holding its
    /// last commit: written with the next generation's first messages (one
    /// write, and one wake-up of each worker, for both), or before anything
    /// that waits for workers.
    drained_relays: Option<held::HeldRelays>,
    ranks: HashMap<u64, usize>,
    /// The next step to plan (the adapter is asked once per step, as it
    /// is planned).
    plan_at: StepPlan,
    /// A policy decision that removes workers, applied once the windows
    /// already sent are committed.
    decision: Option<Vec<Action>>,
    /// The slowest rank's compute per step (moving average), ms: sizes the windows.
    step_ms: Option<f64>,
    last_checkpoint: Instant,
    /// The epoch permutation windows are planned from.
    plan_perm: Option<(u64, Vec<u32>)>,
    /// The last reported write of a checkpoint of the committed step.
    saved: Option<Result<PathBuf, String>>,
    /// What stops the job at the next look: a worker's program declared
    /// samples that cannot be the job's.
    fatal: Option<String>,
    /// The job is being taken over from another coordinator.
    takeover: Option<Takeover>,
    store_events: Vec<StoreEvent>,
    /// Workers told to go by their scheduler, and why: they leave at the
    /// next boundary.
    leaving: Vec<(u64, String)>,
    /// A worker told to go holds the only state: a checkpoint of it, so
    /// that its going first costs only the steps since then.
    notice_checkpoint: Option<NoticeCheckpoint>,
    /// Workers lost since the job last went back to a checkpoint (their
    /// logs say what they died of).
    lost: Vec<u64>,
    /// Every worker lost to the same program error again and again.
    crash_loop: CrashLoop,
    /// SIGTERM or SIGINT came: the job stops once its committed state is
    /// in a checkpoint.
    stopping: Option<Stopping>,
    /// Why the job failed for good (the same crash again and again): a
    /// standby does not start it again.
    failed: Option<String>,
}

/// A job stopping on a signal: the checkpoint asked of its committed
/// state, and where it was written.
struct Stopping {
    since: Instant,
    asked: Option<u64>,
    written: Option<PathBuf>,
}

/// What workers are told about the job that is not its configuration:
/// the leader to follow and the teachers alive change while it runs; the
/// teachers it started are known once they serve. The rest of the
/// [`JobSpec`](crate::job::spec::JobSpec) they get is the configuration's.
struct Told {
    /// Where a worker that loses this coordinator finds the next one.
    follow: Option<crate::job::spec::Follow>,
    /// The teachers still alive (teachers this job started that exited are
    /// no longer handed out).
    teachers: Option<crate::job::spec::TeacherSource>,
    /// How students reach them: the configured access, trusting also the
    /// certificate of the teachers this job started.
    teacher_access: crate::distill::TeacherAccess,
}

/// Where a job taken over from another coordinator stood.
struct Takeover {
    from: crate::job::spec::Leader,
    generation: u64,
    members: Vec<u64>,
    /// How the scheduler knows them.
    handles: std::collections::BTreeMap<u64, String>,
}

/// Where the checkpoint of a state a worker told to go holds alone stands.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum NoticeCheckpoint {
    /// Written at the next commit.
    Due,
    /// Asked of rank 0 at this step.
    Writing(u64),
}

/// The coordinator's lease on its job in the store (renewed every third of
/// it): a standby takes the job over this long after its coordinator died.
pub(crate) const LEASE_TTL: Duration = Duration::from_secs(5);
/// How long a coordinator that took a job over waits for its workers to come back.
pub(crate) const RETURN_WITHIN: Duration = Duration::from_secs(10);

/// Windows kept ahead of the ranks while membership is stable.
const AHEAD: usize = 2;
/// A window holds about this much work (by the measured step time)...
const WINDOW_WORK_MS: f64 = 100.0;
/// ... and at most this many steps.
const MAX_WINDOW: u64 = 32;
/// Lines of a crashed worker's log its error quotes (a Python traceback is
/// quoted whole).
const CRASH_LOG_LINES: usize = 20;
/// How often the coordinator looks after starters, leases, teachers and the store.
const CHORES_EVERY: Duration = Duration::from_millis(100);
/// How often worker leases, the job's state and the teachers are looked at
/// when nothing else asks for it.
const SECOND: Duration = Duration::from_secs(1);

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Runs a job put together by [`Job::assemble`] to its end; the job's
/// lock is held until then.
pub fn run(job: Job, progress: &mut dyn FnMut(Progress)) -> Result<JobOutcome> {
    run_recorded(job, progress).map_err(|u| u.error)
}

/// A job that ended without finishing: why, and what it did until then
/// (its steps, scale events, epochs and plugins' decisions; None when it
/// failed before its coordinator began).
#[derive(Debug)]
pub struct Unfinished {
    pub error: anyhow::Error,
    pub so_far: Option<Box<JobOutcome>>,
}

impl From<anyhow::Error> for Unfinished {
    fn from(error: anyhow::Error) -> Self {
        Unfinished { error, so_far: None }
    }
}

/// [`run`], keeping the record of a job that fails.
pub fn run_recorded(job: Job, progress: &mut dyn FnMut(Progress)) -> Result<JobOutcome, Unfinished> {
    let Job { cfg, lock, plugins, scaler, mut teachers, ps, on_stall } = job;
    cfg.validate()?;
    let cfg = Arc::new(cfg);
    let io = Io::open(&cfg)?;
    let told = Told {
        follow: None,
        teachers: cfg.spec.teachers.clone().or_else(|| {
            let addrs = teachers.addrs();
            (!addrs.is_empty()).then_some(crate::job::spec::TeacherSource::Fixed(addrs))
        }),
        teacher_access: crate::job::assembly::with_ca(&cfg.spec.teacher_access, teachers.ca_pem()),
    };
    let pool = teachers.take_pool().map(|p| pool::PoolThread::start(p, cfg.loop_stall)).transpose()?;
    let plugins = Plugins {
        teacher_handles: Box::new(teachers.handles()),
        policy: plugins.policy,
        adapter: plugins.adapter,
        scaler,
        teacher_watch: if pool.is_some() { None } else { teachers.watch() },
        pool,
    };
    let ps_control = cfg.spec.ps.clone().map(|t| {
        let auth = crate::worker::session::JobAuth { job: cfg.spec.job.clone(), secret: cfg.secret.clone() };
        (crate::ps::control::PsControl::new(auth, t), ps)
    });
    let mut c = Coordinator::new(cfg, io, plugins, told, progress)?;
    c.ps.servers = ps_control;
    if let Some(bound) = c.cfg.loop_stall {
        // The loop does not come back to end the job: the process ends.
        let said = on_stall.unwrap_or_else(|| Box::new(drop));
        c.watchdog = Some(watchdog::Watchdog::start(
            watchdog::Watched::Coordinator,
            bound,
            watchdog::ending_the_process(said),
        ));
    }
    let result = c.job();
    // Stopping the workers is not the loop's.
    c.watchdog = None;
    if let Some(e @ crate::coordinator::machine::phase::JobEnds::SameCrash { .. }) =
        result.as_ref().err().and_then(|e| e.downcast_ref())
    {
        // A standby would only fail the same way again.
        c.failed = Some(e.to_string().lines().next().unwrap_or_default().to_string());
        c.save_state(false);
    }
    let reason = match &result {
        Ok(_) => "the job is done".to_string(),
        Err(e) => match e.downcast_ref::<crate::process::StopSignalled>() {
            Some(s) => format!("the coordinator was stopped by {}", crate::process::signal_name(s.signal)),
            None => "the job failed".to_string(),
        },
    };
    c.say_ps();
    // What a failed job did, taken before its workers are stopped (their
    // stopping is not its training time); its teachers' record and the
    // workers that never joined, once they are.
    let mut so_far =
        result.is_err().then(|| c.record(PathBuf::new(), c.membership.world(), Default::default()));
    c.close(&reason);
    if let Some(o) = so_far.as_mut() {
        let pool = c.pool.as_mut().map(|p| p.stop()).unwrap_or_default();
        (o.teacher_events, o.teacher_decisions) = (pool.events, pool.decisions);
        o.workers_unused = std::mem::take(&mut c.unused);
    }
    let result = result.map_err(|error| Unfinished { error, so_far: so_far.map(Box::new) });
    drop(lock);
    drop(teachers);
    drop(c.ps.servers.take());
    result
}

/// Who may be in the job, as the configuration and the scaler say.
fn membership_of(cfg: &JobConfig, scaler: &dyn crate::scalers::Scaler) -> Membership {
    let mut membership = Membership::new(cfg.min_workers, cfg.max_workers, cfg.join_timeout, 1);
    membership.admit_uninvited(scaler.admits_uninvited());
    membership
}

/// What the coordinator follows of its spares for a policy sizing them.
struct SpareBook {
    /// When the spares wanted last changed.
    changed: Instant,
    /// Spare-seconds held so far, summed at each look, and when the last was.
    held_secs: f64,
    looked: Instant,
    /// The policy was told the job gave spares up (said once).
    told_gave_up: bool,
    /// The last answer kept within the bound (said once while it lasts).
    clamped: Option<u32>,
    /// The policy's answers, for the report (the newest of them).
    decisions: std::collections::VecDeque<records::SpareDecision>,
    /// The spares as the job's final phase found them (before it stopped
    /// them).
    at_end: Option<edl_plugin_sdk::SpareView>,
}

impl SpareBook {
    fn new(now: Instant) -> Self {
        SpareBook {
            changed: now,
            held_secs: 0.0,
            looked: now,
            told_gave_up: false,
            clamped: None,
            decisions: Default::default(),
            at_end: None,
        }
    }
}

/// The job's parameter servers, and what the coordinator follows of them
/// between boundaries.
#[derive(Default)]
struct PsState {
    /// Where its tables are, and the processes it started for them.
    servers: Option<(crate::ps::control::PsControl, crate::job::ps_servers::PsServers)>,
    /// Servers started, to join at the next boundary.
    added: Vec<(u64, String)>,
    /// Servers told to go: their shards are copied from them, then they stop.
    leaving: Vec<u64>,
    /// Checkpoints asked of workers and not written yet.
    pins: pins::Pins,
    /// New rows the servers refused at their bound, as last seen.
    refused: u64,
    /// The servers as last seen, each one's requests per second since the
    /// look before, and when that look was (with each one's requests then).
    seen: Vec<crate::ps::Stats>,
    rates: std::collections::BTreeMap<u64, f64>,
    looked: Option<(std::time::Instant, std::collections::BTreeMap<u64, u64>)>,
    /// When the servers last changed (None: not since the job started).
    changed: Option<std::time::Instant>,
    /// The servers forgot how to undo the steps before this one; when a
    /// trim last failed.
    trimmed: u64,
    trim_failed: Option<std::time::Instant>,
    /// The scaling policy decides the servers' number (it answered one
    /// last): the memory rule does not add servers.
    sized_by_policy: bool,
    /// The servers of `added` being given their shards while training goes
    /// on: the step the copy is of, and the thread copying.
    ahead: Option<(u64, std::thread::JoinHandle<Result<crate::ps::control::Ahead>>)>,
    /// What the scaling policy was asked about the servers, and answered (the newest).
    decisions: std::collections::VecDeque<ServerDecision>,
    /// A server refused new rows at its bound since the last boundary: the
    /// next one waits for the servers starting.
    want_room: bool,
    /// When servers were last started to bring the job back to its fewest,
    /// and the pause before the next try.
    floor_tried: Option<(std::time::Instant, std::time::Duration)>,
}

/// The plugins and processes a coordinator drives.
struct Plugins {
    policy: Box<dyn PolicyPlugin>,
    adapter: Option<Box<dyn AdapterPlugin>>,
    scaler: Box<dyn Scaler>,
    teacher_watch: Option<Box<dyn crate::job::teacher_pool::TeacherWatch>>,
    /// The pool that sizes the job's teachers, when it has one.
    pool: Option<pool::PoolThread>,
    teacher_handles: Box<dyn Fn() -> Vec<TeacherHandle> + Send>,
}

/// The coordinator's sockets and store, opened before anything is decided.
struct Io {
    rt: tokio::runtime::Runtime,
    store: AnyStore,
    /// `host:port` workers reach the control port at.
    addr: String,
    /// `host:port` workers reach the rendezvous at.
    rendezvous_at: String,
    rendezvous: RendezvousServer,
    /// Who may open a control connection (told each new generation).
    gate: Arc<crate::control::inbox::Gate>,
    /// What the control connections say.
    rx: mpsc::Receiver<Inbound>,
}

impl Io {
    /// Opens the store, the control port (with the thread that reads its
    /// connections) and the rendezvous, at the configured addresses.
    fn open(cfg: &JobConfig) -> Result<Io> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let store = {
            let _g = rt.enter();
            AnyStore::open(&cfg.store)?
        };
        let net = &cfg.addresses;
        let listener = edl_host_gpu::comm::listen::listen(net.listen)
            .with_context(|| format!("--listen {}", net.listen))?;
        let host = net.advertised_host()?;
        let addr = crate::net::host_port(&host, listener.local_addr()?.port());
        let auth = JobAuth { job: cfg.spec.job.clone(), secret: cfg.secret.clone() };
        let rendezvous_listen = SocketAddr::new(net.listen.ip(), net.rendezvous_port).to_string();
        let rendezvous = RendezvousServer::start_with(&rendezvous_listen, Some(auth.clone()))
            .with_context(|| format!("rendezvous server on {rendezvous_listen}"))?;
        let rendezvous_at = crate::net::host_port(&host, rendezvous.addr().port());
        let (tx, rx) = mpsc::channel();
        let lease = Duration::from_millis(cfg.spec.worker_lease_ms);
        let gate = crate::control::inbox::start(listener, auth, lease, tx).context("control connections")?;
        Ok(Io { rt, store, addr, rendezvous_at, rendezvous, gate, rx })
    }
}

/// The coordinator's periodic work, each first due a period from `now`.
fn timers(now: Instant) -> TimerTable {
    TimerTable::every(
        now,
        &[
            (Timer::Chores, CHORES_EVERY),
            (Timer::WorkerLeases, SECOND),
            (Timer::SaveState, SECOND),
            (Timer::TeacherCheck, SECOND),
        ],
    )
}

impl<'a> Coordinator<'a> {
    fn new(
        cfg: Arc<JobConfig>,
        io: Io,
        plugins: Plugins,
        told: Told,
        progress: &'a mut dyn FnMut(Progress),
    ) -> Result<Self> {
        let membership = membership_of(&cfg, &*plugins.scaler);
        let now = Instant::now();
        Ok(Coordinator {
            told,
            teacher_watch: plugins.teacher_watch,
            pool: plugins.pool,
            pool_told: now,
            pool_planned: 0,
            policy_decisions: Default::default(),
            adapter_decisions: Default::default(),
            unused: Vec::new(),
            redone_steps: 0,
            told_workers: Vec::new(),
            step_times: Default::default(),
            window_started: Instant::now(),
            teacher_handles: plugins.teacher_handles,
            teachers_left: Vec::new(),
            policy: plugins.policy,
            adapter: plugins.adapter,
            scaler: crate::scalers::fenced::FencedScaler::new(plugins.scaler),
            progress,
            io,
            ckpt: Checkpoints::open(&cfg.spec.checkpoint_dir, cfg.spec.keep_checkpoints)?,
            conns: HashMap::new(),
            beats: beats::Beats::start(Duration::from_millis(cfg.spec.worker_lease_ms) / 4),
            routes: None,
            membership,
            ps: Default::default(),
            spare_book: SpareBook::new(now),
            generation: 0,
            first_generation: 0,
            tally: Tally::new(cfg.spec.samples, cfg.spec.seed, now),
            hyper: cfg.hyper,
            hyper_world: 0,
            resumed: None,
            watchdog: None,
            events: Vec::new(),
            pending: None,
            decided: Default::default(),
            init: None,
            lease_now: true,
            leases: None,
            last_change: now,
            started: now,
            timers: timers(now),
            training_since: None,
            capacity: None,
            timeline: Vec::new(),
            checkpoints: Vec::new(),
            keeper: None,
            state_token: None,
            fence: None,
            pipe: None,
            drained_relays: None,
            ranks: HashMap::new(),
            plan_at: StepPlan { step: 0, epoch: 0, cursor: 0, hyper: cfg.hyper },
            decision: None,
            step_ms: None,
            last_checkpoint: now,
            plan_perm: None,
            saved: None,
            fatal: None,
            takeover: None,
            store_events: Vec::new(),
            leaving: Vec::new(),
            lost: Vec::new(),
            crash_loop: CrashLoop::new(cfg.max_restarts),
            stopping: None,
            failed: None,
            notice_checkpoint: None,
            cfg,
        })
    }

    /// The job is over (`reason`: how): its workers are stopped, or
    /// left to the coordinator that deposed this one, and the store is
    /// written one last time.
    fn close(&mut self, reason: &str) {
        if self.keeper.as_ref().and_then(|k| k.fenced()).is_some() {
            // Deposed: the workers follow the coordinator that leads now,
            // and so do the teachers that outlive this one. What was held
            // for them is not sent.
            if let Some(held) = self.drained_relays.take() {
                held.discard();
            }
            self.scaler.release();
            if let Some(p) = &self.pool {
                p.release();
            }
        } else {
            self.stop_everyone(reason);
        }
        // Every stop done before the lease goes: a stop command run after
        // it could reach the workers of a coordinator that leads then.
        self.scaler.settle();
        if let Some(k) = &self.keeper {
            k.release();
            let _ = k.flush(Duration::from_secs(5));
        }
    }

    /// Every worker, in whatever state, is told to stop; those asked for
    /// that never joined are said, each with where it stood.
    fn stop_everyone(&mut self, reason: &str) {
        self.release_drained();
        for (id, stage) in self.membership.on_the_way() {
            self.note(format!("worker {id} was {stage} when the job ended; stopped unused"));
            self.unused.push(UnusedWorker { id, stage: stage.to_string() });
        }
        self.membership.stop_all(reason);
        self.execute();
    }

    /// What the data order and the state depend on, now.
    fn data_identity(&self) -> DataIdentity {
        DataIdentity::of(&self.cfg.spec, self.tally.train_len())
    }

    /// The job as workers are told it now: the configuration's, with the
    /// samples learned, the leader to follow and the teachers still alive.
    fn told_spec(&self) -> crate::job::spec::JobSpec {
        crate::job::spec::JobSpec {
            samples: self.tally.train_len(),
            follow: self.told.follow.clone(),
            teachers: self.told.teachers.clone(),
            teacher_access: self.told.teacher_access.clone(),
            protocol: crate::control::proto::PROTOCOL,
            ..self.cfg.spec.clone()
        }
    }
}

impl Coordinator<'_> {
    fn note(&mut self, s: String) {
        (self.progress)(Progress::Note(s));
    }

    /// Tells the teacher pool what the students did, once a window, and
    /// at once when more students are planned (for it to grow ahead of
    /// them); says what it changed.
    fn tend_pool(&mut self) {
        let Some(pool) = self.pool.as_mut() else { return };
        let world = self.membership.world();
        let planned = world + self.membership.coming();
        let more_planned = planned > world && planned != self.pool_planned;
        if self.pool_told.elapsed() >= pool.every() || more_planned {
            self.pool_told = Instant::now();
            self.pool_planned = planned;
            pool.tell(pool::Students {
                step: self.tally.committed,
                wait_share: self.tally.teacher_wait_share(),
                throughput: self.tally.samples_per_sec(),
                world,
                planned,
                calls: self.tally.teacher_calls(),
            });
        }
        if let Some(view) = pool.latest_view() {
            (self.progress)(Progress::TeacherView(&view));
        }
        for (event, said) in pool.news() {
            for s in said {
                self.note(s);
            }
            if let Some(e) = event {
                (self.progress)(Progress::Teachers(&e));
            }
        }
    }

    fn checkpoints(&self) -> &Checkpoints {
        &self.ckpt
    }

    fn spawn(&mut self, n: u32) {
        self.membership.spawn(Instant::now(), n);
        self.execute();
    }

    /// Starts the warm spares the job keeps (`--warm-spares`), once its
    /// first generation is formed.
    fn keep_spares(&mut self) {
        if self.cfg.warm_spares > 0 {
            self.membership.set_spares(Instant::now(), self.cfg.warm_spares);
            self.execute();
        }
    }

    /// Checks the teachers this job started: a dead one is no longer handed
    /// to new workers; with none left the job cannot go on.
    fn check_teachers(&mut self) -> Result<()> {
        self.tend_pool();
        let Some(watch) = self.teacher_watch.as_mut() else { return Ok(()) };
        let dead = watch.dead();
        let Some(crate::job::spec::TeacherSource::Fixed(list)) = self.told.teachers.as_mut() else {
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

    fn job(&mut self) -> Result<JobOutcome> {
        self.start()?;
        let final_checkpoint = self.train_to_the_end()?;
        self.finish(final_checkpoint)
    }

    /// Takes the job (its lease, its state in the store, the newest
    /// checkpoint), starts the first workers and makes them members.
    /// Keeps the step the job resumed from (`resumed`).
    fn start(&mut self) -> Result<()> {
        // Before anything is read or changed: one coordinator per job.
        let seal = RecordKey::job_records(&self.cfg.secret);
        let mut lease = self.io.rt.block_on(crate::leader::keeper::take_lease(
            &self.io.store,
            &self.cfg.spec.job,
            LEASE_TTL,
            self.cfg.standby,
            &seal,
        ))?;
        let resumed = self.resume()?;
        self.resumed = resumed;
        // The checkpoints are this coordinator's from here on: a deposed one
        // that runs on cannot write or prune them. A store of its own (the
        // embedded one) gives tokens that start again with each run; the
        // job's local lock keeps others out then, and the claim is replaced.
        let shared = !matches!(self.io.store, crate::store::AnyStore::Memory(_));
        if shared {
            self.fence_above_checkpoints(&mut lease)?;
        }
        let token = if shared { lease.token() } else { 0 };
        self.ckpt.claim(token, resumed.unwrap_or(0), !shared).with_context(|| {
            format!("claiming the checkpoints at {}", self.cfg.spec.checkpoint_dir.display())
        })?;
        self.fence = Some(token);
        if shared && self.scaler.workers_outlive() {
            // Workers that lose this coordinator find the next in the store.
            self.told.follow = Some(crate::job::spec::Follow { store: self.cfg.store.clone(), token });
        }
        self.keeper = Some(crate::leader::keeper::StoreKeeper::start(
            &self.cfg.store,
            keys::job_state(&self.cfg.spec.job),
            self.state_token,
            Some(lease),
            seal,
        )?);
        if let Some(k) = &self.keeper {
            // Every start and stop from here on checks the lease first.
            self.scaler.guard(k.fence());
        }
        if resumed.is_none() {
            // A job that starts from step 0 (new, or finished before and
            // restarted) is no longer finished in the store from here on.
            self.save_state(false);
        }
        self.first_generation = self.generation + 1;
        self.take_teachers_over();
        self.note(format!(
            "coordinator at {} (rendezvous {}); workers join with `edl-runtime worker --coordinator {}`",
            self.io.addr, self.io.rendezvous_at, self.io.addr
        ));
        if self.takeover.is_some() {
            self.await_return(RETURN_WITHIN)?;
            if self.membership.joiners() > 0 {
                self.boundary()?;
                // Workers lost with the old coordinator are started anew
                // where the job is short of its minimum.
                let short =
                    self.cfg.min_workers.saturating_sub(self.membership.world() + self.membership.coming());
                if short > 0 {
                    self.spawn(short);
                }
                self.keep_spares();
                return Ok(());
            }
        }
        let first = self.cfg.initial_workers.clamp(self.cfg.min_workers.max(1), self.cfg.max_workers.max(1));
        self.spawn(first);
        self.wait_for_joiners(first as usize)?;
        // The first workers are members before any phase: a job resumed at
        // its end goes straight to the final checkpoint, which admits no
        // newcomer.
        self.boundary()?;
        self.keep_spares();
        Ok(())
    }

    /// Trains generation after generation until every epoch is committed,
    /// then writes the final checkpoint; returns its path.
    fn train_to_the_end(&mut self) -> Result<PathBuf> {
        let total = self.cfg.spec.epochs;
        let mut phase = JobPhase::new(total, Duration::from_millis(self.cfg.spec.teacher_wait_ms));
        loop {
            self.fenced()?;
            // The state lives in the members alone: with none left, the
            // workers that are joining have nothing to take it from.
            if self.membership.world() == 0 {
                self.release_drained();
                self.recover_from_nothing()?;
            }
            match phase.next(self.tally.epoch) {
                Phase::Train { again } => {
                    if again {
                        // Every worker died before the final state was written:
                        // the recovery went back to an earlier checkpoint, whose
                        // remaining steps are trained again.
                        self.note(format!(
                            "the final state was lost with its workers; training again from step {}",
                            self.tally.committed
                        ));
                    }
                    self.check_teachers()?;
                    if let Some(actions) = self.decision.take() {
                        self.apply_decision(&actions);
                    }
                    self.apply_leaving();
                    self.boundary()?;
                    let before = self.tally.committed;
                    let Some(f) = self.run_generation()? else { continue };
                    if f.cause == Some(crate::control::proto::FailCause::NoTeachers) {
                        // Name the teachers' end if the job started them.
                        self.check_teachers()?;
                    }
                    phase.generation_failed(self.tally.committed > before, &f)?;
                    // A coordinator whose lease lapsed (it was frozen) starts
                    // no worker: another may lead the job now.
                    self.fenced()?;
                    let no_state = f.cause == Some(crate::control::proto::FailCause::NoState);
                    self.fail(f);
                    if no_state && self.membership.world() > 0 {
                        self.restore_newest(format!(
                            "no worker of generation {} holds the job's state",
                            self.generation
                        ))?;
                    }
                    self.check_spawning();
                }
                Phase::Finish { entering } => {
                    self.release_drained();
                    if entering {
                        // The spares as they stood, for the report, then
                        // the final state: no new workers any more.
                        let now = Instant::now();
                        self.spare_book.at_end = Some(self.spare_view(now));
                        self.membership.stop_newcomers("the job is done");
                        self.execute();
                    }
                    self.boundary()?;
                    // Workers that have not joined a generation yet (a job
                    // resumed at its end) load the state first.
                    self.ensure_generation()?;
                    match self.write_final()? {
                        Ok(p) => return Ok(p),
                        Err(f) => {
                            phase
                                .final_failed()
                                .map_err(|e| anyhow!("{e}; last: {}", f.errors.join("; ")))?;
                            self.fail(f);
                        }
                    }
                }
            }
        }
    }

    /// Stops the workers, leaves the final state in the store and accounts
    /// for every epoch.
    fn finish(&mut self, final_checkpoint: PathBuf) -> Result<JobOutcome> {
        let total = self.cfg.spec.epochs;
        let final_world = self.membership.world();
        self.stop_everyone("the job is done");
        // The store says "finished" only once every epoch is accounted for:
        // a job that is not stays resumable from its checkpoints.
        let accounted = self.accounted_for(total);
        self.save_state(accounted.is_ok());
        if let Some(k) = &self.keeper
            && let Err(e) = k.flush(Duration::from_secs(10))
        {
            self.note(format!("the job's final state may not be in the store: {e}"));
        }
        self.store_news();
        accounted?;
        for p in self.ckpt.remove_set_aside() {
            self.note(format!("removed {} (the run before --restart)", p.display()));
        }
        let pool = self.pool.as_mut().map(|p| p.stop()).unwrap_or_default();
        Ok(self.record(final_checkpoint, final_world, pool))
    }

    /// What the job did: at its end, or until it failed; `pool`: what its
    /// teacher pool did.
    fn record(&mut self, final_checkpoint: PathBuf, final_world: u32, pool: pool::PoolRecord) -> JobOutcome {
        JobOutcome {
            final_checkpoint,
            steps: self.tally.committed,
            epochs: self.tally.ledger.epochs.clone(),
            scale_events: self.events.clone(),
            timeline: std::mem::take(&mut self.timeline),
            resumed_from_step: self.resumed,
            samples: self.tally.samples,
            train_secs: self.training_since.map_or(0.0, |t| t.elapsed().as_secs_f64()),
            generations: (self.first_generation, self.generation),
            checkpoints: self.checkpoints.clone(),
            final_world,
            hyper: self.hyper,
            workers_started: self.membership.started().to_vec(),
            store_events: std::mem::take(&mut self.store_events),
            teacher_events: pool.events,
            teacher_decisions: pool.decisions,
            policy_decisions: std::mem::take(&mut self.policy_decisions).into(),
            adapter_decisions: std::mem::take(&mut self.adapter_decisions).into(),
            server_decisions: std::mem::take(&mut self.ps.decisions).into(),
            spares: (self.cfg.warm_spares > 0 || !self.spare_book.decisions.is_empty()).then(|| {
                let at_end = self.spare_book.at_end.take();
                at_end.unwrap_or_else(|| self.spare_view(Instant::now()))
            }),
            spare_decisions: std::mem::take(&mut self.spare_book.decisions).into(),
            workers_unused: std::mem::take(&mut self.unused),
            redone_steps: self.redone_steps,
            worker_handles: self
                .membership
                .started()
                .iter()
                .filter_map(|&id| Some((id, self.scaler.handle(id)?)))
                .collect(),
            parameter_servers: self.ps_stats(),
        }
    }

    /// Whether every one of the job's `total` epochs is accounted for.
    fn accounted_for(&self, total: u64) -> Result<()> {
        let epochs = &self.tally.ledger.epochs;
        let whole = self.tally.train_len() as u64;
        if epochs.len() as u64 != total {
            bail!(
                "the job ended with {} of {total} epochs accounted for ({}); its checkpoints stay for a rerun",
                epochs.len(),
                epochs
                    .iter()
                    .map(|e| format!("epoch {}: {} of {whole} samples", e.epoch, e.samples_committed))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        Ok(())
    }

    /// Takes what the keeper saw happen to the store, and says it.
    fn store_news(&mut self) {
        let Some(k) = &self.keeper else { return };
        for what in k.store_events() {
            self.note(format!("store: {what}; the job went on"));
            let at_secs = self.started.elapsed().as_secs_f64();
            self.store_events.push(StoreEvent { at_secs, step: self.tally.committed, what });
        }
    }

    /// The job was taken over (its lease in the store is lost): stop.
    fn fenced(&self) -> Result<()> {
        match self.keeper.as_ref().and_then(|k| k.fenced()) {
            Some(why) => bail!("job {:?}: {why}", self.cfg.spec.job),
            None => Ok(()),
        }
    }

    /// The next event from the workers, waiting at most `within`: where
    /// the loop comes back to them, which the watchdog is told.
    fn receive(&self, within: Duration) -> Result<Inbound, mpsc::RecvTimeoutError> {
        if let Some(w) = &self.watchdog {
            w.turned();
        }
        self.io.rx.recv_timeout(within)
    }

    /// A membership change waits for the windows already sent to commit.
    fn change_waiting(&self) -> bool {
        self.decision.is_some()
            || !self.leaving.is_empty()
            || self.membership.change_waiting()
            || self.ps_change_waiting()
    }

    /// Workers told to go leave now (the windows sent before are committed):
    /// a planned scale-in, named so in the scale event.
    fn apply_leaving(&mut self) {
        let from = self.membership.world();
        let mut left = Vec::new();
        for (id, why) in std::mem::take(&mut self.leaving) {
            match self.membership.leave(Instant::now(), id, &why) {
                Some(Leave::Now(said)) => left.push(said),
                // Nothing changes yet: the change is said when it happens.
                Some(Leave::AfterHandover(said)) => {
                    self.note(format!("{said}; the state goes to a checkpoint too, in case it goes before"));
                    self.notice_checkpoint = Some(NoticeCheckpoint::Due);
                }
                None => {}
            }
        }
        self.execute();
        if !left.is_empty() {
            let reason = left.join(", ");
            match self.pending.as_mut() {
                Some(p) => p.reason = format!("{}; {reason}", p.reason),
                None => self.pending = Some(records::Pending::new(from, reason)),
            }
        }
    }

    /// This coordinator leads the job: its pool takes over the teachers the
    /// coordinator before left running (and a standby's pool starts sizing).
    fn take_teachers_over(&mut self) {
        let Some(pool) = self.pool.as_ref() else { return };
        let left = self.teachers_left.clone();
        let said = pool.take_over(left);
        self.teachers_left.clear();
        // Their handles are the pool's now: stored with the state from here on.
        self.save_state(false);
        for s in said {
            self.note(s);
        }
    }

    /// Hands the job's state to the store keeper (written off the step's path).
    fn save_state(&mut self, finished: bool) {
        let plugins = if self.told.follow.is_some() { self.plugin_memory() } else { PluginMemory::default() };
        // Until the workers of a job taken over are back, they are still its
        // members: a coordinator that dies meanwhile leaves them to the next.
        let (members, handles) = match &self.takeover {
            Some(t) => (t.members.clone(), t.handles.clone()),
            None => (
                self.membership.members().iter().map(|m| m.id).collect(),
                self.membership
                    .members()
                    .iter()
                    .filter_map(|m| Some((m.id, self.scaler.handle(m.id)?)))
                    .collect(),
            ),
        };
        let s = JobState {
            generation: self.generation,
            committed_steps: self.tally.committed,
            epoch: self.tally.epoch,
            cursor: self.tally.cursor,
            next_worker_id: self.membership.next_id(),
            members,
            finished,
            failed: self.failed.clone(),
            fence: self.fence.unwrap_or(0),
            handover: self.told.follow.as_ref().map(|f| f.token).map(|token| {
                crate::leader::record::Handover {
                    leader: crate::job::spec::Leader { addr: self.io.addr.clone(), token },
                    hyper: self.hyper,
                    ledger: self.tally.ledger.clone(),
                    events: self.events.clone(),
                    data: self.data_identity(),
                    plugins,
                    handles,
                }
            }),
            torchrun: None,
            teachers: {
                let mut all = (self.teacher_handles)();
                let left: Vec<TeacherHandle> = self
                    .teachers_left
                    .iter()
                    .filter(|l| all.iter().all(|t| t.addr != l.addr))
                    .cloned()
                    .collect();
                all.extend(left);
                all
            },
        };
        if let Some(k) = &self.keeper {
            k.state(s);
        }
        self.timers.set(Timer::SaveState, Instant::now() + SECOND);
    }
}
