//! The worker's side of the elastic protocol, for any training program: the
//! built-in MLP worker ([`crate::trainer::worker`]) and the Python package both drive
//! a [`Session`].
//!
//! A program registers its state (named float32 tensors behind [`State`]),
//! then asks for steps one at a time. Between steps the session does what
//! the coordinator says: it forms generations (builds the ring, brings the
//! state to the committed step from a rollback point, a checkpoint or rank
//! 0's broadcast), keeps rollback points at window starts, and has rank 0
//! write checkpoints of committed states in the background. A step gives the
//! program its sample indices and hyperparameters; the program computes,
//! sums its gradients over the ring with [`Session::all_reduce`] and reports
//! the step with [`Session::finish`]. When the ring breaks the step is
//! abandoned: the program may go on with what it has (its state is put back
//! at the next generation), and the next step it gets is the redone one.

use crate::checkpoint::{Checkpoints, Manifest};
use crate::control::outbox::{Outbox, Sender};
use crate::control::proto::{
    FailCause, FromWorker, Generation, Receiver, Share, StepDone, StepPlan, ToWorker, Written,
};
use crate::coordinator::machine::noise::{GradSq, NoiseTerms, squared_norm};
use crate::job::spec::{JobSpec, Leader};
use crate::state::Layout;
use anyhow::{Context, Result, anyhow, bail};
pub use edl_host_gpu::comm::auth::{JobAuth, Secret};
use edl_host_gpu::comm::{Communicator, ReduceOp, RingOptions, TcpRendezvous, TcpRing, auth};
use edl_plugin_sdk::Hyperparams;
use std::{
    collections::{BTreeMap, VecDeque},
    net::{SocketAddr, TcpStream},
    sync::{Arc, Mutex, mpsc},
    time::{Duration, Instant},
};

/// Rollback points a worker keeps at most (the committed step's, the
/// windows sent ahead, and those the store has not caught up with).
const MAX_ROLLBACK_POINTS: usize = 6;

/// Set when this process was told to go: SIGTERM (a scheduler's
/// preemption or its notice before a time limit, a pod's deletion), or the
/// file `$EDL_NOTICE_FILE` appeared (a spot-instance notice written by a
/// watcher). Schedulers may send it more than once (a node set down after
/// a preemption): it stays a notice; they end a worker that overstays with
/// SIGKILL.
static NOTICE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// What the notice command said, once it said the worker must go.
static COMMAND_NOTICE: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Installs the SIGTERM handler that sets [`NOTICE`] and starts the
/// notice command's watcher (once per process).
fn hear_notice() {
    static INSTALL: std::sync::Once = std::sync::Once::new();
    INSTALL.call_once(|| {
        watch_notice_command();
        // SAFETY: the handler only stores to an atomic (async-signal-safe).
        let installed = unsafe {
            signal_hook_registry::register(libc::SIGTERM, || {
                NOTICE.store(true, std::sync::atomic::Ordering::SeqCst);
            })
        };
        if let Err(e) = installed {
            tracing::warn!("SIGTERM will end this worker without notice: {e}");
        }
    });
}

/// `$EDL_NOTICE_COMMAND`, run by `sh` every `$EDL_NOTICE_EVERY_SECS` (5)
/// on a thread of its own: its success is the notice (as `curl -sf` of a
/// cloud's spot-instance notice succeeds only once there is one). Each run
/// is bounded by the interval, so a hook that hangs is stopped and tried
/// again.
fn watch_notice_command() {
    let Some(hook) = std::env::var("EDL_NOTICE_COMMAND").ok().filter(|c| !c.trim().is_empty()) else {
        return;
    };
    let every = std::env::var("EDL_NOTICE_EVERY_SECS")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .map_or(Duration::from_secs(5), |s| Duration::from_secs_f64(s.max(0.05)));
    let watcher = std::thread::Builder::new().name("edl-notice".into()).spawn(move || {
        let mut failed_to_run = false;
        loop {
            let mut sh = std::process::Command::new("sh");
            sh.args(["-c", &hook]);
            match crate::process::output("the notice command", &mut sh, b"", every) {
                Ok(out) if out.status.success() => {
                    let _ = COMMAND_NOTICE.set(format!("notice command `{hook}`"));
                    return;
                }
                Ok(_) => {}
                Err(e) if !failed_to_run => {
                    tracing::warn!("{e:#}");
                    failed_to_run = true;
                }
                Err(_) => {}
            }
            std::thread::sleep(every);
        }
    });
    if let Err(e) = watcher {
        tracing::warn!("the notice command will not be run: {e}");
    }
}

/// Why this worker was told to go, if it was (the notice file is looked
/// at most once a second).
fn told_to_go(looked: &mut Option<Instant>) -> Option<String> {
    if let Some(said) = COMMAND_NOTICE.get() {
        return Some(said.clone());
    }
    if NOTICE.load(std::sync::atomic::Ordering::SeqCst) {
        // Where, when a scheduler says (a node set down ends its jobs so).
        return Some(match std::env::var("SLURMD_NODENAME") {
            Ok(node) => format!("SIGTERM on {node}"),
            Err(_) => "SIGTERM".into(),
        });
    }
    let file = std::env::var_os("EDL_NOTICE_FILE")?;
    if looked.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
        return None;
    }
    *looked = Some(Instant::now());
    let path = std::path::Path::new(&file);
    path.exists().then(|| format!("notice file {}", path.display()))
}

/// What the store says of a job that ended.
const JOB_FINISHED: &str = "the job's store says the job is finished";

/// Why a worker could not follow the coordinator that took its job over.
enum Followed {
    /// It was refused: no use trying again.
    Refused(String),
    Failed(String),
}

/// A program's state, as the session sees it.
pub trait State {
    /// The tensors, in the order of [`State::save_into`]'s values.
    fn layout(&self) -> &Layout;
    /// Every value of the state, laid end to end, into `out` (cleared first).
    fn save_into(&mut self, out: &mut Vec<f32>) -> Result<()>;
    /// Replaces every value of the state.
    fn load(&mut self, values: &[f32]) -> Result<()>;
    /// Called about every 100 ms while the session waits for the
    /// coordinator; an error (the program was interrupted) ends the wait.
    fn idle(&mut self) -> Result<()> {
        Ok(())
    }
}

/// The job's sparse tables at a step, from its parameter servers.
/// Called with the step and the generation whose servers hold it.
pub type TableExport = Box<dyn FnMut(u64, Option<u64>) -> Result<Vec<crate::ps::SavedTable>> + Send>;

/// One step of this rank.
#[derive(Clone, Debug)]
pub struct Step {
    pub generation: u64,
    pub rank: usize,
    pub world: usize,
    /// Steps committed before this one (0 for the job's first).
    pub step: u64,
    pub epoch: u64,
    pub hyper: Hyperparams,
    /// This rank's samples (indices into `0..samples`); may be empty.
    pub indices: Vec<u32>,
    /// Samples of the whole step, over every rank: a mean loss divides by it.
    pub global_rows: usize,
    /// Steps committed when this step's generation formed: the state it
    /// started from (a parameter server rolls its tables back to it).
    pub base: u64,
    /// The last step of its epoch.
    pub ends_epoch: bool,
    start: u32,
    end: u32,
    opens: bool,
    closes: bool,
}

impl Step {
    /// Where this step's requests to the parameter servers stand.
    pub fn ps_mark(&self) -> crate::ps::Mark {
        crate::ps::Mark::of_worker(self.generation, self.base)
    }

    /// Where this rank's pushes of the step belong.
    pub fn ps_tag(&self) -> crate::ps::PushTag {
        let (step, rank, world) = (self.step, self.rank as u32, self.world as u32);
        crate::ps::PushTag { mark: self.ps_mark(), step, rank, world }
    }
}

/// What the program does next.
pub enum Event {
    Step(Step),
    /// The job is over for this worker (done, or scaled in).
    Stop(String),
}

/// Where the current generation's ring meets, for programs that build their own collectives.
#[derive(Clone, Debug)]
pub struct Rendezvous {
    pub generation: u64,
    pub rank: usize,
    pub world: usize,
    pub addr: SocketAddr,
    pub key: String,
}

#[derive(Clone, Copy)]
struct Place {
    generation: u64,
    rank: usize,
    world: usize,
    base: u64,
}

/// The worker side of a job.
pub struct Session {
    id: u64,
    /// Where the coordinator listens (reached again after a lost connection).
    coordinator: SocketAddr,
    spec: JobSpec,
    /// Where the job's checkpoints are (opened once: a store client and its
    /// runtime for object storage).
    checkpoints: Checkpoints,
    /// The job's name and secret, proven on the rendezvous and the ring too.
    auth: JobAuth,
    out: Sender,
    /// The address of this host that the job's other hosts reach.
    ring_ip: std::net::IpAddr,
    ring_advertise: Option<std::net::IpAddr>,
    /// Set by [`Session::set_ring_address`] (the ring's address is not
    /// taken from the control connection's).
    ring_chosen: bool,
    /// Sends heartbeats while the session lives.
    _heartbeat: Heartbeat,
    inbox: mpsc::Receiver<Result<ToWorker, crate::control::proto::ProtoError>>,
    /// Messages taken from the inbox between steps and not handled yet (in
    /// order; handled first by the next [`Session::next`]).
    held: VecDeque<Result<ToWorker, crate::control::proto::ProtoError>>,
    /// The control connection, to close when this worker follows another coordinator.
    control: TcpStream,
    /// When the coordinator last said something, and when the store was
    /// last asked who leads the job.
    heard: Instant,
    /// When the coordinator last said more than a beat: a frozen one says
    /// nothing, a deposed one still shutting down may still beat, and the
    /// store is asked who leads once it has told nothing for a second.
    told: Instant,
    looked: Instant,
    /// The job's store, opened when this worker first looks for its leader.
    store: Option<(tokio::runtime::Runtime, crate::store::AnyStore)>,
    /// Told to go and said so (it leaves at the coordinator's next boundary);
    /// when the notice file was last looked for.
    leaving: bool,
    notice_looked: Option<Instant>,
    /// Steps applied to the current state (None: nothing yet, a joiner).
    applied: Option<u64>,
    /// The newest commit heard of: every step before it is committed.
    committed: u64,
    /// The checkpoint the current generation started from, if it did.
    restored_from: Option<std::path::PathBuf>,
    /// The parameter servers of the current generation (they change when
    /// one is lost).
    ps: Option<crate::job::spec::PsTopology>,
    /// The job's sparse tables at a step, for the checkpoints this worker
    /// writes (a program with parameter servers sets it).
    /// Shared with the checkpoint writer's thread, which calls it.
    table_export: Option<Arc<Mutex<TableExport>>>,
    /// Rollback points: the state at the start of each window not known
    /// to be committed, and at the last committed step.
    snapshots: BTreeMap<u64, Arc<Vec<f32>>>,
    /// The state of step 0, kept while the job may go back to its start
    /// with this worker alive (until its first checkpoint is written).
    origin: Option<Arc<Vec<f32>>>,
    /// A released rollback point's buffer, for the next one.
    spare: Option<Vec<f32>>,
    layout: Layout,
    place: Option<Place>,
    rendezvous: Option<Rendezvous>,
    /// The generation in which this worker failed a step (its later steps are dropped).
    failed: Option<u64>,
    queue: VecDeque<Step>,
    /// The step handed to the program and not finished yet.
    current: Option<Step>,
    /// Steps of the current window done so far, and the generation's set-up time.
    window: Vec<StepDone>,
    setup_ms: f64,
    /// What the current step waited for soft labels, ms, and what its
    /// requests to the teachers did.
    teacher_wait_ms: f64,
    teacher_calls: Vec<crate::distill::stats::TeacherRequests>,
    /// What the current step's all-reduces gave and got back (squared norms).
    /// Tagged with the (generation, step) they were measured in: norms of
    /// a step left without a commit are not told with the next one.
    grad_sq: Option<((u64, u64), GradSq)>,
    /// The current step's gradient computed in parts: each part's rows and
    /// squared norm (see [`Session::gradient_parts`]).
    parts: Option<((u64, u64), Parts)>,
    ring: Option<(u64, TcpRing)>,
    /// A checkpoint being written in the background: its step and thread.
    writing: Option<(u64, WriteThread)>,
    /// Checkpoint writes that ended, not reported yet.
    written: Vec<Written>,
    /// Set when the coordinator said stop.
    stopped: Option<String>,
}

/// A thread that tells the coordinator this worker is alive, every
/// `every`, until dropped (or the connection fails).
struct Heartbeat {
    _stop: mpsc::Sender<()>,
}

impl Heartbeat {
    fn start(out: Sender, every: Duration) -> Result<Self> {
        let (stop, stopped) = mpsc::channel::<()>();
        std::thread::Builder::new().name("edl-heartbeat".into()).spawn(move || {
            while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(every) {
                if out.send(&FromWorker::Heartbeat).is_err() {
                    return;
                }
            }
        })?;
        Ok(Heartbeat { _stop: stop })
    }
}

/// Joining a job: the coordinator either welcomes the worker or has no use for it.
pub enum Joined {
    Welcome(Box<Session>),
    NotNeeded(String),
}

/// The job a worker belongs to, from the environment its launcher set:
/// `EDL_JOB`, and `EDL_JOB_SECRET` (64 hex digits) or `EDL_JOB_SECRET_FILE`
/// (a file holding it, or `-` for standard input).
pub fn auth_from_env() -> Result<JobAuth> {
    let var = |k: &str| {
        std::env::var(k).map_err(|_| {
            anyhow!("{k} is not set: a worker needs the job's name and secret (`edl-runtime` sets them for the workers it starts; the secret is in .edl/<job>/secret)")
        })
    };
    let secret = match std::env::var("EDL_JOB_SECRET_FILE") {
        Ok(file) => read_secret(std::path::Path::new(&file)).context("EDL_JOB_SECRET_FILE")?,
        Err(_) => Secret::from_hex(&var("EDL_JOB_SECRET")?).map_err(|e| anyhow!("EDL_JOB_SECRET: {e}"))?,
    };
    let job = var("EDL_JOB")?;
    crate::job::check_job_name(&job).map_err(|e| anyhow!("EDL_JOB: {e}"))?;
    Ok(JobAuth { job, secret })
}

/// Reads the job's secret from a file, or from standard input for `-` (one line).
pub fn read_secret(path: &std::path::Path) -> Result<Secret> {
    if path == std::path::Path::new("-") {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).context("reading the job's secret from standard input")?;
        return Secret::from_hex(line.trim()).map_err(|e| anyhow!("the job's secret on standard input: {e}"));
    }
    read_secret_file(path)
}

/// Reads a secret file, warning when others on the host may read it.
pub fn read_secret_file(path: &std::path::Path) -> Result<Secret> {
    if let Some(warning) = Secret::exposure(path) {
        eprintln!("warning: {warning}");
    }
    Secret::read(path).map_err(|e| anyhow!("{e}"))
}

/// Longest a worker waits, once its connection is admitted, for the
/// coordinator to welcome it: a coordinator frozen (SIGSTOP, a paused VM)
/// between the two would otherwise hold it forever, since nothing it sends
/// is left unacknowledged and the frozen host's kernel answers keepalives.
/// Long, because the welcome comes from the coordinator's own loop, which
/// may be busy for a while (verifying a large checkpoint as it resumes,
/// moving parameter-server shards) while its inbox admits connections.
pub const WELCOME_WITHIN: Duration = Duration::from_secs(300);

impl Session {
    /// Connects worker `id` to the coordinator at `coordinator`, proves the
    /// job's secret and reads the job.
    pub fn join(coordinator: SocketAddr, id: u64, auth: JobAuth) -> Result<Joined> {
        Self::join_within(coordinator, id, auth, WELCOME_WITHIN)
    }

    /// [`Session::join`], waiting at most `within` for the welcome.
    fn join_within(coordinator: SocketAddr, id: u64, auth: JobAuth, within: Duration) -> Result<Joined> {
        let hello = |id| FromWorker::Hello {
            worker: id,
            pid: std::process::id(),
            protocol: crate::control::proto::PROTOCOL,
        };
        let (control, out, mut rx) = Self::connect(coordinator, id, &auth, 0, &hello(id), within)?;
        // A worker that joined without an id (started by another engine)
        // is given one first.
        let mut id = id;
        let spec = loop {
            let msg = rx.recv::<ToWorker>().with_context(|| {
                format!("worker {id}: the coordinator at {coordinator} admitted it but did not welcome it (waited at most {within:?})")
            })?;
            match msg {
                ToWorker::Assigned { worker } if id == 0 => id = worker,
                ToWorker::Welcome(spec) => break *spec,
                // Refused for its protocol: a failure, not a worker not needed.
                ToWorker::Stop { reason } if reason.contains(crate::control::proto::ONE_VERSION) => {
                    bail!("worker {id}: the coordinator at {coordinator} refused it: {reason}")
                }
                ToWorker::Stop { reason } => return Ok(Joined::NotNeeded(reason)),
                ToWorker::Beat => {}
                _ => bail!("worker {id}: the coordinator sent something before the job"),
            }
        };
        let at = format!("the coordinator at {coordinator}");
        if let Some(why) = crate::control::proto::protocol_mismatch(&at, spec.protocol) {
            bail!("worker {id}: {why}");
        }
        let (heartbeat, inbox) = Self::listen(&control, &out, rx, &spec)?;
        let checkpoints = Checkpoints::open(&spec.checkpoint_dir, spec.keep_checkpoints)?;
        hear_notice();
        let ring_ip = control.local_addr()?.ip();
        Ok(Joined::Welcome(Box::new(Session {
            id,
            coordinator,
            checkpoints,
            spec,
            auth,
            out,
            ring_ip,
            ring_advertise: None,
            ring_chosen: false,
            _heartbeat: heartbeat,
            inbox,
            held: VecDeque::new(),
            control,
            heard: Instant::now(),
            told: Instant::now(),
            looked: Instant::now(),
            store: None,
            leaving: false,
            notice_looked: None,
            applied: None,
            committed: 0,
            restored_from: None,
            ps: None,
            table_export: None,
            snapshots: BTreeMap::new(),
            origin: None,
            spare: None,
            layout: Layout::default(),
            place: None,
            rendezvous: None,
            failed: None,
            queue: VecDeque::new(),
            current: None,
            window: Vec::new(),
            setup_ms: 0.0,
            teacher_wait_ms: 0.0,
            teacher_calls: Vec::new(),
            grad_sq: None,
            parts: None,
            ring: None,
            writing: None,
            written: Vec::new(),
            stopped: None,
        })))
    }

    /// Opens a control connection to the coordinator at `coordinator`
    /// claiming `generation` (0 for a new worker), proves the job's secret
    /// and sends `first`.
    fn connect(
        coordinator: SocketAddr,
        id: u64,
        auth: &JobAuth,
        generation: u64,
        first: &FromWorker,
        welcome_within: Duration,
    ) -> Result<(TcpStream, Sender, Receiver)> {
        let mut stream = TcpStream::connect_timeout(&coordinator, Duration::from_secs(10))
            .with_context(|| format!("worker {id}: cannot reach the coordinator at {coordinator}"))?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        let keys = auth::connect(&mut stream, &auth.secret, &auth.claim("control", generation, id)).map_err(
            |e| {
                anyhow!(
                    "worker {id}: the coordinator at {coordinator} did not admit it to job {:?}: {e}",
                    auth.job
                )
            },
        )?;
        // Bounded until the welcome (see [`Session::listen`]).
        stream.set_read_timeout(Some(welcome_within))?;
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(Duration::from_secs(10)))?;
        crate::control::proto::keepalive(&stream);
        let (out, rx) = crate::control::proto::seal(&stream, keys)?;
        let (out, rx) = (Sender::new(Outbox::direct(out)), Receiver::new(rx));
        out.send(first)?;
        Ok((stream, out, rx))
    }

    /// Once welcomed: heartbeats go out, and messages are read on a thread
    /// of their own (so that windows sent ahead queue up while steps run).
    #[allow(clippy::type_complexity)]
    fn listen(
        stream: &TcpStream,
        out: &Sender,
        mut rx: Receiver,
        spec: &JobSpec,
    ) -> Result<(Heartbeat, mpsc::Receiver<Result<ToWorker, crate::control::proto::ProtoError>>)> {
        // From here on the coordinator hears from this worker at least a
        // few times per lease, and a coordinator that stops acknowledging
        // what the worker sends is given up within the lease.
        let lease = Duration::from_millis(spec.worker_lease_ms.max(1));
        // Welcomed: the connection is read for as long as the job runs.
        stream.set_read_timeout(None)?;
        crate::control::proto::give_up_unacked(stream, lease);
        let heartbeat = Heartbeat::start(out.clone(), lease / 4)?;
        let (tx, inbox) = mpsc::channel();
        std::thread::Builder::new().name("edl-control".into()).spawn(move || {
            loop {
                let msg = rx.recv::<ToWorker>();
                let end = msg.is_err();
                if tx.send(msg).is_err() || end {
                    return;
                }
            }
        })?;
        Ok((heartbeat, inbox))
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// Where this worker's ring listens (`bind`) and the address the other
    /// ranks are told (`advertise`, for a host behind NAT; None: `bind`).
    /// By default both are the address the control connection leaves from.
    pub fn set_ring_address(&mut self, bind: std::net::IpAddr, advertise: Option<std::net::IpAddr>) {
        self.ring_ip = bind;
        self.ring_advertise = advertise;
        self.ring_chosen = true;
    }

    /// Every step before this one is committed (as this worker last heard).
    pub fn committed(&self) -> u64 {
        self.committed
    }

    /// The job's parameter servers as of the current generation.
    pub fn ps_topology(&self) -> Option<&crate::job::spec::PsTopology> {
        self.ps.as_ref().or(self.spec.ps.as_ref())
    }

    /// The checkpoint the current generation started from (the first
    /// generation of a resumed job), if it did.
    pub fn restored_from(&self) -> Option<&std::path::Path> {
        self.restored_from.as_deref()
    }

    /// Gives the checkpoints this worker writes the job's sparse tables,
    /// as `export(step)` returns them at the checkpoint's step.
    pub fn set_table_export(&mut self, export: TableExport) {
        self.table_export = Some(Arc::new(Mutex::new(export)));
    }

    pub fn spec(&self) -> &JobSpec {
        &self.spec
    }

    /// The job's identity this worker proves on its connections (for the
    /// generation's key-value store, see [`edl_host_gpu::comm::KvClient`]).
    pub fn auth(&self) -> &JobAuth {
        &self.auth
    }

    /// The program has built its state (of `layout`): the worker can be given a rank.
    /// `samples`: how many samples the program's data set holds, for a job
    /// launched without `--samples` (the first worker's number is the job's).
    pub fn ready(&mut self, layout: Layout, samples: Option<u64>) -> Result<()> {
        self.layout = layout;
        if let Some(n) = samples
            && self.spec.samples == 0
        {
            self.spec.samples = n as usize;
        }
        self.out.send(&FromWorker::Ready { samples })?;
        tracing::info!("worker {}: ready; it joins the job at the next step boundary", self.id);
        Ok(())
    }

    /// The current generation's rendezvous (None before the first).
    pub fn rendezvous(&self) -> Option<&Rendezvous> {
        self.rendezvous.as_ref()
    }

    /// Takes in the windows that arrived during the current step, so that
    /// [`Session::planned`] shows them (for reading ahead): a window is
    /// queued at once when only commits arrived before it; anything else,
    /// and all after it, waits for [`Session::next`], in order.
    pub fn take_in_windows(&mut self) {
        while let Ok(m) = self.inbox.try_recv() {
            self.heard = Instant::now();
            // Commits waiting before it change nothing a window is queued
            // by (the generation and the rank); anything else might.
            let only_commits = self.held.iter().all(|h| matches!(h, Ok(ToWorker::Commit { .. })));
            match m {
                Ok(ToWorker::Steps { generation, steps, shares })
                    if only_commits && shares.len() == steps.len() =>
                {
                    // Only a window whose shares do not match its steps is refused.
                    let _ = self.enqueue(generation, steps, shares);
                }
                // Heard (above): nothing else to keep of it.
                Ok(ToWorker::Beat) => {}
                other => self.held.push_back(other),
            }
        }
    }

    /// Steps planned after the current one, in order (for reading ahead).
    pub fn planned(&self) -> impl Iterator<Item = &Step> {
        self.queue.iter()
    }

    /// The next step, once the coordinator has planned it; meanwhile does
    /// what the coordinator asks. A step handed out and not finished is
    /// abandoned.
    pub fn next(&mut self, state: &mut dyn State) -> Result<Event> {
        if let Some(s) = self.current.take() {
            self.report_failure(s.generation, s.step, anyhow!("the program skipped step {}", s.step));
        }
        loop {
            if let Some(reason) = &self.stopped {
                return Ok(Event::Stop(reason.clone()));
            }
            if !self.leaving
                && let Some(why) = told_to_go(&mut self.notice_looked)
            {
                self.leaving = true;
                if self.place.is_none() {
                    // Not in the job yet: nothing to hand over.
                    return Ok(Event::Stop(format!("told to go ({why}) before it was given a rank")));
                }
                tracing::warn!(
                    "worker {}: told to go ({why}); leaving at the job's next step boundary",
                    self.id
                );
                self.tell(&FromWorker::Leaving { reason: why })?;
            }
            // Checkpoint writes that ended go out first (the final one is
            // written before its commit is done with).
            self.reap_write(false);
            if !self.written.is_empty() {
                let checkpoints = std::mem::take(&mut self.written);
                self.tell(&FromWorker::Saved { checkpoints })?;
            }
            let msg = if let Some(m) = self.held.pop_front() {
                Some(m)
            } else if self.queue.is_empty() {
                match self.inbox.recv_timeout(Duration::from_millis(100)) {
                    Ok(m) => Some(m),
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        state.idle()?;
                        self.look_for_leader(state)?;
                        if let Some(why) = self.coordinator_silent() {
                            // Closed here: a coordinator that wakes finds
                            // this worker gone, not a connection that hangs.
                            let _ = self.control.shutdown(std::net::Shutdown::Both);
                            self.lost_coordinator(&why, state)?;
                        }
                        None
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        self.lost_coordinator("connection closed", state)?;
                        continue;
                    }
                }
            } else {
                self.inbox.try_recv().ok()
            };
            if let Some(m) = &msg {
                self.heard = Instant::now();
                if !matches!(m, Ok(ToWorker::Beat)) {
                    self.told = self.heard;
                }
            }
            if let Some(msg) = msg {
                self.handle(msg, state)?;
                continue;
            }
            let Some(s) = self.queue.pop_front() else { continue };
            if self.applied != Some(s.step) {
                let e = anyhow!("state at step {:?}, the plan is for step {}", self.applied, s.step);
                self.report_failure(s.generation, s.step, e);
                continue;
            }
            if s.opens && !self.snapshots.contains_key(&s.step) {
                // The rollback point of this window, until a later commit.
                self.snapshot(state)?;
            }
            self.current = Some(s.clone());
            // A wait told of a step that failed is not this one's.
            self.teacher_wait_ms = 0.0;
            return Ok(Event::Step(s));
        }
    }

    fn handle(
        &mut self,
        msg: Result<ToWorker, crate::control::proto::ProtoError>,
        state: &mut dyn State,
    ) -> Result<()> {
        match msg {
            Ok(ToWorker::Stop { reason }) => {
                tracing::info!("worker {}: stopping: {reason}", self.id);
                // A checkpoint under way is finished, not left half written.
                self.reap_write(true);
                if !self.written.is_empty() {
                    let checkpoints = std::mem::take(&mut self.written);
                    let _ = self.out.send(&FromWorker::Saved { checkpoints });
                }
                self.stopped = Some(reason);
            }
            Ok(ToWorker::Welcome(_) | ToWorker::Assigned { .. }) => {
                bail!("worker {}: a second welcome", self.id)
            }
            // Heard: that is all a beat says.
            Ok(ToWorker::Beat) => {}
            Ok(ToWorker::Generation(g)) => {
                if let Err(e) = self.start_generation(&g, state) {
                    let cause = match () {
                        _ if e.downcast_ref::<StateMismatch>().is_some() => Some(FailCause::State),
                        // The job's newest checkpoint is chosen again.
                        _ if e.downcast_ref::<NoState>().is_some() => Some(FailCause::NoState),
                        _ if e.downcast_ref::<PlannedCheckpoint>().is_some() => Some(FailCause::NoState),
                        _ => None,
                    };
                    // No step ran: unless a load into the state failed part
                    // way, the state is where the generation found it (or
                    // where its start put it back to).
                    let spoiled = e.downcast_ref::<LoadFailed>().is_some();
                    let applied = self.applied;
                    self.report(g.generation, g.committed_steps, e, cause)?;
                    if !spoiled {
                        self.applied = applied;
                    }
                }
            }
            Ok(ToWorker::Steps { generation, steps, shares }) => self.enqueue(generation, steps, shares)?,
            Ok(ToWorker::Commit { step, checkpoint, wait, stored, origin }) => {
                if !origin {
                    // A checkpoint is there to go back to.
                    self.origin = None;
                }
                self.commit(step, checkpoint, wait, stored, state)?
            }
            Err(e) => self.lost_coordinator(&e.to_string(), state)?,
        }
        Ok(())
    }

    /// The control connection ended (`why`). A worker that was in a
    /// generation tries for the spec's reconnect time to reach a coordinator
    /// again: in a job that can be taken over, the one the store names once
    /// it is another (a higher lease token), which takes it back with its
    /// process and state (then this returns Ok and the session goes on);
    /// otherwise the same one, to hear where it stands: a job that went on
    /// without it refuses it, naming the generation that is over.
    fn lost_coordinator(&mut self, why: &str, state: &mut dyn State) -> Result<()> {
        let lost = format!("worker {}: lost the coordinator at {} ({why})", self.id, self.coordinator);
        let window = Duration::from_millis(self.spec.worker_reconnect_ms);
        let Some(place) = self.place.filter(|_| !window.is_zero()) else { bail!(lost) };
        tracing::warn!("{lost}; trying to reach it again for {window:?}");
        let claim = self.auth.claim("control", place.generation, self.id);
        let deadline = Instant::now() + window;
        let mut last = String::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!("{lost}, and could not reach it again within {window:?}: {last}");
            }
            match self.newer_leader() {
                Ok(Some(leader)) => match self.follow(&leader) {
                    Ok(()) => return Ok(()),
                    Err(Followed::Refused(reason)) => {
                        bail!(
                            "{lost}; the coordinator at {} that took the job over refused it: {reason}",
                            leader.addr
                        )
                    }
                    Err(Followed::Failed(e)) => last = e,
                },
                Ok(None) => {}
                Err(e) if e.starts_with(JOB_FINISHED) => {
                    // It ended as this worker lost it: nothing to redo.
                    self.stopped = Some(e);
                    return Ok(());
                }
                Err(e) => last = e,
            }
            let io = |e: std::io::Error| auth::AuthError::Io(e.to_string());
            let attempt = TcpStream::connect_timeout(&self.coordinator, left.min(Duration::from_secs(5)))
                .map_err(io)
                .and_then(|mut s| {
                    s.set_read_timeout(Some(left.min(Duration::from_secs(10)))).map_err(io)?;
                    auth::connect(&mut s, &self.auth.secret, &claim)
                });
            match attempt {
                Err(auth::AuthError::Refused(reason)) => {
                    bail!("{lost}; on its return the coordinator refused it: {reason}");
                }
                Err(e) if last.is_empty() || self.spec.follow.is_none() => last = e.to_string(),
                Err(_) => {}
                // A connection that claims a generation is never taken back
                // by the coordinator it was lost to.
                Ok(_) => {
                    bail!("{lost}; it took the connection back without saying where this worker stands")
                }
            }
            state.idle().map_err(|e| e.context(lost.clone()))?;
            if let Some(why) = told_to_go(&mut self.notice_looked) {
                bail!("{lost}; told to go ({why}) meanwhile");
            }
            std::thread::sleep(left.min(Duration::from_millis(250)));
        }
    }

    /// Why the coordinator is taken for lost, when it has said nothing
    /// (not even a beat, which comes four times per lease) for three
    /// leases: frozen, its connection still open, it would be waited for
    /// forever.
    fn coordinator_silent(&self) -> Option<String> {
        let lease = Duration::from_millis(self.spec.worker_lease_ms);
        let bound = crate::control::proto::coordinator_silence(lease);
        let quiet = self.heard.elapsed();
        (quiet >= bound).then(|| {
            format!(
                "it said nothing for {:.1} s, where it beats every {:.1} s",
                quiet.as_secs_f64(),
                lease.as_secs_f64() / 4.0
            )
        })
    }

    /// While the coordinator says nothing for a while (it may be frozen or
    /// cut off, its connection still open), asks the store at most once a
    /// second who leads the job: another coordinator that took it over is
    /// followed, and the silent one's connection closed.
    fn look_for_leader(&mut self, state: &mut dyn State) -> Result<()> {
        const SILENT: Duration = Duration::from_secs(1);
        if self.spec.follow.is_none()
            || self.place.is_none()
            || self.told.elapsed() < SILENT
            || self.looked.elapsed() < SILENT
        {
            return Ok(());
        }
        self.looked = Instant::now();
        match self.newer_leader() {
            Ok(Some(leader)) => {
                tracing::warn!(
                    "worker {}: the coordinator at {} is silent and the job's store names another, {} (lease \
                     token {}): following it",
                    self.id,
                    self.coordinator,
                    leader.addr,
                    leader.token
                );
                let _ = self.control.shutdown(std::net::Shutdown::Both);
                match self.follow(&leader) {
                    Ok(()) => Ok(()),
                    Err(_) => self.lost_coordinator("silent; another coordinator leads the job", state),
                }
            }
            Ok(None) => Ok(()),
            Err(e) => {
                tracing::debug!("worker {}: asking the store who leads the job: {e}", self.id);
                Ok(())
            }
        }
    }

    /// The coordinator the job's store names, when it is one that took the
    /// job over from this worker's (a higher lease token). A job the store
    /// says is finished ends this worker.
    fn newer_leader(&mut self) -> Result<Option<Leader>, String> {
        let Some(follow) = self.spec.follow.clone() else { return Ok(None) };
        if self.store.is_none() {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            let store = {
                let _g = rt.enter();
                crate::store::AnyStore::open(&follow.store).map_err(|e| format!("{e:#}"))?
            };
            self.store = Some((rt, store));
        }
        use crate::store::Store;
        let (rt, store) = self.store.as_ref().expect("opened above");
        let key = crate::store::keys::job_state(&self.spec.job);
        let shown = crate::store::redact(&follow.store);
        let got = rt
            .block_on(async { tokio::time::timeout(Duration::from_secs(5), store.get(&key)).await })
            .map_err(|_| format!("the job's store {shown} did not answer within 5 s"))?
            .map_err(|e| format!("the job's store {shown}: {e}"))?;
        let Some(entry) = got else { return Ok(None) };
        let seal = crate::leader::seal::RecordKey::job_records(&self.auth.secret);
        let s = crate::leader::record::JobState::open(&key, &entry.value, &seal)
            .map_err(|e| format!("the job's state in {shown} is ignored: {e}"))?;
        // (A finished mark of an earlier leader's is left over, or replayed.)
        if s.finished && s.fence >= follow.token {
            return Err(JOB_FINISHED.into());
        }
        Ok(s.handover.map(|h| h.leader).filter(|l| l.token > follow.token))
    }

    /// Goes over to `leader`, which took the job over: comes back to it
    /// with this worker's process and state (its rollback points), and is
    /// welcomed again. Steps sent and not committed are redone.
    fn follow(&mut self, leader: &Leader) -> Result<(), Followed> {
        let place = self.place.ok_or_else(|| Followed::Failed("never in a generation".into()))?;
        let addr = crate::net::resolve(&leader.addr).map_err(|e| Followed::Failed(format!("{e:#}")))?;
        let back = FromWorker::Return {
            worker: self.id,
            pid: std::process::id(),
            rollback: self.snapshots.keys().copied().collect(),
            protocol: crate::control::proto::PROTOCOL,
        };
        let (control, out, mut rx) =
            Self::connect(addr, self.id, &self.auth, place.generation, &back, WELCOME_WITHIN).map_err(
                |e| {
                    let text = format!("{e:#}");
                    // Refused by the coordinator itself, not by the network.
                    match text.contains(": refused: ") || text.contains("does not know the job's secret") {
                        true => Followed::Refused(text),
                        false => Followed::Failed(text),
                    }
                },
            )?;
        let spec = match rx.recv::<ToWorker>() {
            Ok(ToWorker::Welcome(spec)) => match crate::control::proto::protocol_mismatch(
                &format!("the coordinator at {}", leader.addr),
                spec.protocol,
            ) {
                Some(why) => return Err(Followed::Refused(why)),
                None => *spec,
            },
            Ok(ToWorker::Stop { reason }) => return Err(Followed::Refused(reason)),
            Ok(_) => return Err(Followed::Failed("it sent something before the job".into())),
            Err(e) => {
                return Err(Followed::Failed(format!(
                    "admitted but not welcomed (waited at most {WELCOME_WITHIN:?}): {e}"
                )));
            }
        };
        let (heartbeat, inbox) =
            Self::listen(&control, &out, rx, &spec).map_err(|e| Followed::Failed(format!("{e:#}")))?;
        tracing::info!(
            "worker {}: now with the coordinator at {} (lease token {}), holding steps {:?}",
            self.id,
            leader.addr,
            leader.token,
            self.snapshots.keys().collect::<Vec<_>>()
        );
        let _ = self.control.shutdown(std::net::Shutdown::Both);
        let samples = self.spec.samples;
        self.spec = spec;
        if self.spec.samples == 0 {
            self.spec.samples = samples;
        }
        (self.coordinator, self.control, self.out, self._heartbeat, self.inbox) =
            (addr, control, out, heartbeat, inbox);
        // What the old connection said and was not handled is its past.
        self.held.clear();
        self.heard = Instant::now();
        self.told = self.heard;
        // A notice told to the coordinator that is gone is told again to
        // this one (the notice itself stays set).
        self.leaving = false;
        // What the old coordinator sent ahead is its no more.
        self.queue.clear();
        self.window.clear();
        self.current = None;
        self.ring = None;
        self.failed = None;
        Ok(())
    }

    /// Sends `msg` to the coordinator. In a job that can be taken over a
    /// coordinator that is gone is not an error here: the reader sees the
    /// connection end and the worker follows the next coordinator, which
    /// redoes what was not committed.
    fn tell(&self, msg: &FromWorker) -> Result<()> {
        match self.out.send(msg) {
            Err(e) if self.spec.follow.is_some() => {
                tracing::debug!("worker {}: {e}", self.id);
                Ok(())
            }
            r => r.map_err(Into::into),
        }
    }

    /// Sums `values` over the generation's ring, in place. An error
    /// abandons the step (it is reported; the next step is the redone one).
    pub fn all_reduce(&mut self, values: &mut [f32]) -> Result<()> {
        let Some(s) = self.current.as_ref() else { bail!("all_reduce outside a step") };
        let (generation, step) = (s.generation, s.step);
        let local = squared_norm(values);
        let r = match self.ring.as_mut() {
            Some((g, r)) if *g == generation => {
                r.all_reduce(values, ReduceOp::Sum).with_context(|| format!("all-reduce of step {step}"))
            }
            _ => Err(anyhow!("no ring for generation {generation}")),
        };
        if let Err(e) = r {
            let text = format!("{e:#}");
            self.current = None;
            self.grad_sq = None;
            self.parts = None;
            self.report_failure(generation, step, e);
            bail!(text);
        }
        self.add_norms((generation, step), local, squared_norm(values));
        Ok(())
    }

    /// What collectives other than [`Session::all_reduce`] gave and got back
    /// in the current step, as squared norms (a DDP communication hook's
    /// buckets): the gradient noise scale's measure, told with the step.
    pub fn reduced_norms(&mut self, local: f64, reduced: f64) {
        if let Some(s) = self.current.as_ref() {
            self.add_norms((s.generation, s.step), local, reduced);
        }
    }

    /// The current step's gradient was computed in parts, each given as its
    /// rows and the squared norm of its share of the step's mean gradient
    /// (what [`crate::trainer::train::Trainer::compute_gradient_in_parts`]
    /// returns): the gradient noise scale compares the parts as it compares
    /// ranks, so a job of one worker measures it too.
    pub(crate) fn gradient_parts(&mut self, parts: Parts) {
        if let Some(s) = self.current.as_ref() {
            self.parts = Some(((s.generation, s.step), parts));
        }
    }

    /// Adds to the norms of step `at` (those of an earlier step are dropped).
    fn add_norms(&mut self, at: (u64, u64), local: f64, reduced: f64) {
        let (tag, sq) = self.grad_sq.get_or_insert_with(|| (at, Default::default()));
        if *tag != at {
            (*tag, *sq) = (at, Default::default());
        }
        sq.local += local;
        sq.reduced += reduced;
    }

    /// The current step waited `ms` for its soft labels (told with it when
    /// it is done: what the teacher pool is sized by).
    pub fn waited_for_teachers(&mut self, ms: f64) {
        self.teacher_wait_ms += ms;
    }

    /// What this rank's requests to the teachers did (from
    /// [`crate::distill::DistillReader::take_calls`]), told with the step.
    pub fn called_teachers(&mut self, calls: Vec<crate::distill::stats::TeacherRequests>) {
        for c in calls {
            match self.teacher_calls.iter_mut().find(|t| t.addr == c.addr) {
                Some(t) => t.merge(c),
                None => self.teacher_calls.push(c),
            }
        }
    }

    /// The current step is done on this rank: its state has the update.
    /// `loss`: this rank's summed loss divided by the step's global rows.
    pub fn finish(&mut self, loss: f64, compute_ms: f64) -> Result<()> {
        self.finish_with(loss, compute_ms, Vec::new())
    }

    /// [`Session::finish`] with the program's own metrics of the step, each
    /// weighted as `loss` is (its share of the step's samples).
    pub fn finish_with(&mut self, loss: f64, compute_ms: f64, metrics: Vec<(String, f64)>) -> Result<()> {
        let Some(s) = self.current.take() else {
            bail!("finish outside a step (or after a failed all-reduce)")
        };
        self.applied = Some(s.step + 1);
        let at = (s.generation, s.step);
        let grad_sq = self.grad_sq.take().filter(|(tag, _)| *tag == at).map(|(_, sq)| sq);
        // Parts stand for this rank in the estimate, each as a rank would;
        // only two or more, and only if they are this step's rows.
        let rows = s.end.saturating_sub(s.start) as usize;
        let parts = self
            .parts
            .take()
            .filter(|(tag, p)| *tag == at && p.len() >= 2 && p.iter().map(|(r, _)| r).sum::<usize>() == rows);
        let (grad_sq, noise_terms) = match (grad_sq, parts) {
            (Some(sq), Some((_, parts))) => (None, Some(NoiseTerms::of_parts(&parts, sq.reduced))),
            (sq, _) => (sq, None),
        };
        self.window.push(StepDone {
            step: s.step,
            epoch: s.epoch,
            start: s.start,
            end: s.end,
            loss,
            compute_ms,
            teacher_wait_ms: std::mem::take(&mut self.teacher_wait_ms),
            metrics,
            teacher_calls: std::mem::take(&mut self.teacher_calls),
            grad_sq,
            noise_terms,
        });
        if s.closes {
            let steps = std::mem::take(&mut self.window);
            let setup_ms = std::mem::take(&mut self.setup_ms);
            self.tell(&FromWorker::Done { generation: s.generation, steps, setup_ms })?;
        }
        Ok(())
    }

    /// The program could not do the current step: the coordinator is told,
    /// the generation's remaining steps are dropped.
    pub fn fail(&mut self, e: anyhow::Error, cause: Option<FailCause>) -> Result<()> {
        let Some(s) = self.current.take() else { bail!("fail outside a step: {e:#}") };
        self.grad_sq = None;
        self.parts = None;
        self.report(s.generation, s.step, e, cause)
    }

    /// Whether the program is inside a step it may still finish.
    pub fn in_step(&self) -> bool {
        self.current.is_some()
    }

    fn report_failure(&mut self, generation: u64, step: u64, e: anyhow::Error) {
        if let Err(send_err) = self.report(generation, step, e, None) {
            tracing::warn!("worker {}: reporting a failure: {send_err:#}", self.id);
        }
    }

    /// Reports a failed step; the generation's remaining steps are dropped,
    /// its ring (unusable now) is closed, which ends its peers' waits, and
    /// the state counts as changed (the next generation puts it back).
    fn report(
        &mut self,
        generation: u64,
        step: u64,
        e: anyhow::Error,
        cause: Option<FailCause>,
    ) -> Result<()> {
        tracing::warn!("worker {}: generation {generation} step {step}: {e:#}", self.id);
        self.ring = None;
        self.queue.clear();
        self.window.clear();
        self.failed = Some(generation);
        if let Some(a) = self.applied {
            self.applied = Some(a.max(step + 1));
        }
        self.tell(&FromWorker::Failed { generation, step, error: format!("{e:#}"), cause })?;
        Ok(())
    }

    /// Queues a window of the current generation.
    fn enqueue(&mut self, generation: u64, steps: Vec<StepPlan>, shares: Vec<Share>) -> Result<()> {
        let Some(p) = self.place.filter(|p| p.generation == generation) else { return Ok(()) };
        if self.failed == Some(generation) {
            return Ok(());
        }
        if shares.len() != steps.len() {
            bail!("worker {}: a window of {} steps with {} shares", self.id, steps.len(), shares.len());
        }
        let n = steps.len();
        let len = self.spec.samples;
        self.queue.extend(steps.into_iter().zip(shares).enumerate().map(|(i, (plan, share))| {
            let gb = plan.hyper.global_batch.max(1) as usize;
            Step {
                generation,
                rank: p.rank,
                world: p.world,
                step: plan.step,
                epoch: plan.epoch,
                hyper: plan.hyper,
                indices: share.indices,
                global_rows: (plan.cursor + gb).min(len).saturating_sub(plan.cursor),
                base: p.base,
                ends_epoch: plan.cursor + gb >= len,
                start: share.start,
                end: share.end,
                opens: i == 0,
                closes: i + 1 == n,
            }
        }));
        Ok(())
    }

    /// Every step before `step` is committed: earlier rollback points go;
    /// rank 0 writes the checkpoint asked for.
    /// `stored`: the newest step the job's store holds; its rollback point
    /// stays, for a coordinator that takes the job over.
    fn commit(
        &mut self,
        step: u64,
        checkpoint: Option<Manifest>,
        wait: bool,
        stored: Option<u64>,
        state: &mut dyn State,
    ) -> Result<()> {
        self.committed = self.committed.max(step);
        if self.applied == Some(step) && self.current.is_none() && !self.snapshots.contains_key(&step) {
            self.snapshot(state)?;
        }
        self.release_before(stored.map_or(step, |s| s.min(step)));
        // A store that falls behind does not make the rollback points pile
        // up: beyond a few, the oldest go (a takeover then restores a checkpoint).
        while self.snapshots.len() > MAX_ROLLBACK_POINTS {
            let oldest = *self.snapshots.keys().next().expect("not empty");
            self.release_before(oldest + 1);
        }
        let Some(manifest) = checkpoint else { return Ok(()) };
        if let Err(e) = self.start_write(manifest) {
            self.written.push(Written { step, result: Err(format!("{e:#}")), secs: 0.0, bytes: 0 });
        }
        if wait {
            self.reap_write(true);
        }
        Ok(())
    }

    /// Keeps the current state as the rollback point of step `applied`,
    /// in the buffer of a released one when there is one.
    fn snapshot(&mut self, state: &mut dyn State) -> Result<()> {
        if let Some(a) = self.applied {
            let mut s = self.spare.take().unwrap_or_default();
            state.save_into(&mut s).context("saving the state")?;
            if s.len() != self.layout.numel() {
                bail!("the state holds {} values, its tensors {}", s.len(), self.layout.numel());
            }
            self.snapshots.insert(a, Arc::new(s));
        }
        Ok(())
    }

    /// Drops the rollback points before `step`, keeping one's buffer.
    fn release_before(&mut self, step: u64) {
        let kept = self.snapshots.split_off(&step);
        for old in std::mem::replace(&mut self.snapshots, kept).into_values() {
            // Shared with a checkpoint writer: that one frees it.
            if let Ok(s) = Arc::try_unwrap(old) {
                self.spare = Some(s);
            }
        }
    }

    /// Joins a generation: brings the state to its committed step (a
    /// checkpoint, the current state, a rollback point, or rank 0's by
    /// broadcast for a joiner), then builds the ring.
    fn start_generation(&mut self, g: &Generation, state: &mut dyn State) -> Result<()> {
        self.queue.clear();
        self.window.clear();
        self.current = None;
        self.ring = None;
        self.place =
            Some(Place { generation: g.generation, rank: g.rank, world: g.world, base: g.committed_steps });
        self.rendezvous = Some(Rendezvous {
            generation: g.generation,
            rank: g.rank,
            world: g.world,
            addr: crate::net::resolve(&g.rendezvous).context("the generation's rendezvous")?,
            key: g.rendezvous_key.clone(),
        });
        self.failed = None;
        let n = g.committed_steps;
        self.restored_from = None;
        if g.ps.is_some() {
            self.ps = g.ps.clone();
        }
        if let Some(path) = &g.init {
            let r = planned_checkpoint(&self.checkpoints, path, n)
                .map_err(|e| PlannedCheckpoint(format!("{e:#}")))?;
            let values = self
                .layout
                .reorder(&r.layout, &r.values)
                .map_err(|why| StateMismatch { what: format!("checkpoint {}", r.path.display()), why })?;
            load_state(state, &values, "loading the checkpoint into the state")?;
            self.applied = Some(n);
            self.snapshots.clear();
            self.restored_from = Some(r.path.clone());
        }
        if self.applied.is_none() && n == 0 && g.init.is_none() {
            // Every worker starts from the same initial state (the program's, seeded).
            self.applied = Some(0);
        }
        match self.applied {
            Some(a) if a == n => {}
            Some(a) => {
                // Back to the start without a checkpoint: step 0's state, kept.
                let origin = self.origin.clone().filter(|_| n == 0 && g.init.is_none());
                let s = self.snapshots.get(&n).cloned().or(origin).ok_or_else(|| {
                    anyhow!(
                        "state at step {a} (rollback points {:?}) cannot serve committed step {n}",
                        self.snapshots.keys().collect::<Vec<_>>()
                    )
                })?;
                load_state(state, &s, "restoring the rollback point")?;
                self.applied = Some(n);
            }
            None => {} // a joiner: gets the state by broadcast
        }
        self.snapshots.retain(|&k, _| k == n);
        self.setup_ms = self.join_generation(g, state)?;
        if !self.snapshots.contains_key(&n) {
            self.snapshot(state)?;
        }
        if n == 0 && g.init.is_none() && self.origin.is_none() {
            // Until the coordinator says a checkpoint is written.
            self.origin = self.snapshots.get(&0).cloned();
        }
        Ok(())
    }

    /// Where the ring listens: the address this host reaches the
    /// coordinator from (loopback for a one-machine job, the interface
    /// toward the cluster otherwise), or the one set for it. A worker that
    /// reaches the coordinator through its host's relay leaves from
    /// loopback: where the generation meets on another host, its ring
    /// listens on this host's address toward that one.
    fn ring_bind(&self, rendezvous: SocketAddr) -> std::net::IpAddr {
        if self.ring_chosen || !self.ring_ip.is_loopback() || rendezvous.ip().is_loopback() {
            return self.ring_ip;
        }
        match crate::net::routable_toward(&rendezvous.ip().to_string()) {
            Ok(ip) => ip,
            Err(e) => {
                tracing::warn!(
                    "worker {}: no address toward the rendezvous {rendezvous} ({e:#}); the ring listens on {} \
                     and ranks on other hosts cannot reach it",
                    self.id,
                    self.ring_ip
                );
                self.ring_ip
            }
        }
    }

    /// Builds the generation's ring and shares rank 0's state.
    fn join_generation(&mut self, g: &Generation, state: &mut dyn State) -> Result<f64> {
        let start = Instant::now();
        let rendezvous = self.rendezvous.as_ref().map(|r| r.addr).ok_or_else(|| anyhow!("no rendezvous"))?;
        let opts = RingOptions {
            timeout: Duration::from_millis(self.spec.collective_timeout_ms),
            bind: self.ring_bind(rendezvous),
            advertise: self.ring_advertise,
            auth: Some((self.auth.clone(), g.generation)),
            encrypt: !self.spec.gradients_in_clear,
            ..RingOptions::default()
        };
        let rdv = TcpRendezvous::new(rendezvous, g.rendezvous_key.clone())
            .with_auth(self.auth.clone(), g.generation);
        // The state to broadcast is taken before the ring is built: a
        // program that copies its state on demand (a model on a GPU) does
        // not keep its peers waiting inside the collective's bound.
        let mut values = self.spare.take().unwrap_or_default();
        if g.world > 1 && self.applied.is_some() {
            state.save_into(&mut values).context("saving the state")?;
        }
        let mut ring = TcpRing::connect(g.rank, g.world, &rdv, opts)
            .with_context(|| format!("building the ring of generation {}", g.generation))?;
        if g.world > 1 && g.rank == 0 && self.applied.is_none() {
            // Rank 0's state becomes everyone's: one it does not have is
            // no state at all.
            return Err(NoState(format!("rank 0 of a world of {}", g.world)).into());
        }
        if g.world > 1 {
            if self.applied.is_none() {
                values.clear();
                values.resize(self.layout.numel(), 0.0);
            }
            if values.len() != self.layout.numel() {
                bail!("the state holds {} values, its tensors {}", values.len(), self.layout.numel());
            }
            // Every rank must hold a state of the same size before one is
            // broadcast over the others: each puts its size in its own slot
            // (as two 20-bit halves, exact in f32) and the sum shows all.
            let mut sizes = vec![0.0f32; 2 * g.world];
            sizes[2 * g.rank] = (values.len() >> 20) as f32;
            sizes[2 * g.rank + 1] = (values.len() & 0xF_FFFF) as f32;
            ring.all_reduce(&mut sizes, ReduceOp::Sum).context("comparing state sizes")?;
            if sizes.chunks_exact(2).any(|s| s != [sizes[0], sizes[1]]) {
                return Err(StateMismatch {
                    what: "the generation's states".into(),
                    why: format!(
                        "the ranks hold states of different sizes (this one {} values)",
                        values.len()
                    ),
                }
                .into());
            }
            ring.broadcast(&mut values, 0).context("broadcasting the state from rank 0")?;
            load_state(state, &values, "loading rank 0's state")?;
            self.applied = Some(g.committed_steps);
            // Rank 0's state is everyone's rollback point now.
            self.snapshots.clear();
            self.snapshots.insert(g.committed_steps, Arc::new(values));
        } else {
            self.spare = Some(values);
            if self.applied.is_none() {
                return Err(NoState("a world of one".into()).into());
            }
        }
        self.ring = Some((g.generation, ring));
        Ok(start.elapsed().as_secs_f64() * 1e3)
    }

    /// Starts writing the committed state (rank 0) on a thread of its own,
    /// from its rollback point, so that steps and their collectives do not
    /// wait for the disk. An earlier write still under way is finished first.
    fn start_write(&mut self, manifest: Manifest) -> Result<()> {
        self.reap_write(true);
        let n = manifest.step;
        let values = self.snapshots.get(&n).cloned().ok_or_else(|| {
            anyhow!(
                "no state of step {n} to save (rollback points {:?})",
                self.snapshots.keys().collect::<Vec<_>>()
            )
        })?;
        let layout = self.layout.clone();
        let store = self.checkpoints.clone();
        // The tables are exported by the writer too: their servers keep
        // what undoes the steps after this one until the job hears that
        // the checkpoint is written (or this worker is gone).
        let export = self.table_export.clone();
        let generation = self.place.map(|p| p.generation);
        let started = std::time::Instant::now();
        let handle = std::thread::Builder::new().name("edl-checkpoint".into()).spawn(move || {
            let tables = match export {
                Some(export) => {
                    let mut export = export.lock().unwrap_or_else(|e| e.into_inner());
                    (*export)(n, generation).with_context(|| format!("the sparse tables at step {n}"))?
                }
                None => Vec::new(),
            };
            let rows: usize = tables.iter().map(|t| t.rows.len()).sum();
            let bytes = (std::mem::size_of_val(&values[..]) + rows * 4) as u64;
            let path = store.save_with_tables(&layout, &values, &tables, manifest)?;
            Ok((path, started.elapsed().as_secs_f64(), bytes))
        })?;
        self.writing = Some((n, handle));
        Ok(())
    }

    /// Collects the background write's outcome once it has ended (or
    /// waits for it, with `wait`), to be reported with the next answer.
    fn reap_write(&mut self, wait: bool) {
        if !self.writing.as_ref().is_some_and(|(_, h)| wait || h.is_finished()) {
            return;
        }
        let Some((step, handle)) = self.writing.take() else { return };
        let (result, secs, bytes) = match handle.join() {
            Ok(Ok((path, secs, bytes))) => (Ok(path), secs, bytes),
            Ok(Err(e)) => (Err(format!("{e:#}")), 0.0, 0),
            Err(_) => (Err("the checkpoint writer panicked".to_string()), 0.0, 0),
        };
        if let Err(e) = &result {
            tracing::warn!("worker {}: checkpoint of step {step}: {e}", self.id);
        }
        self.written.push(Written { step, result, secs, bytes });
    }
}

/// A generation's rank 0 (whose state becomes everyone's) holds none.
#[derive(Debug, thiserror::Error)]
#[error("{0} with a worker that has no state")]
pub struct NoState(String);

/// The checkpoint a generation's plan names cannot be loaded (gone, say,
/// pruned by a newer one's write, or of another step): the job chooses its
/// newest checkpoint again, as when no worker holds the state.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct PlannedCheckpoint(String);

/// Loading values into the program's state failed part way: what the
/// state holds is not known (the next generation puts it back).
#[derive(Debug, thiserror::Error)]
#[error("{what}: {why}")]
pub struct LoadFailed {
    what: &'static str,
    why: String,
}

fn load_state(state: &mut dyn State, values: &[f32], what: &'static str) -> Result<()> {
    state.load(values).map_err(|e| LoadFailed { what, why: format!("{e:#}") }.into())
}

/// The committed state cannot be loaded into this worker's.
#[derive(Debug, thiserror::Error)]
#[error("{what} does not fit this worker's state: {why}")]
pub struct StateMismatch {
    what: String,
    why: String,
}

/// A step's gradient in parts: each part's rows and squared norm.
type Parts = Vec<(usize, f64)>;

/// A checkpoint being written in the background: its path, seconds and
/// bytes once done.
type WriteThread = std::thread::JoinHandle<Result<(std::path::PathBuf, f64, u64)>>;

/// The checkpoint a generation's plan names, at the plan's step: that one,
/// not the newest (one finished after the coordinator chose may be newer).
fn planned_checkpoint(
    checkpoints: &Checkpoints,
    path: &std::path::Path,
    step: u64,
) -> Result<crate::checkpoint::Restored> {
    let r = checkpoints.read_at(path).with_context(|| format!("the plan's checkpoint {}", path.display()))?;
    if r.manifest.step != step {
        bail!("checkpoint {} is at step {}, the plan says {step}", r.path.display(), r.manifest.step);
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::TensorSpec;

    /// A coordinator that admits the worker's connection (the secret
    /// proven) and then says nothing, as one frozen between the two: the
    /// worker gives up after its wait for the welcome, saying so, instead
    /// of waiting forever.
    #[test]
    fn a_worker_admitted_but_never_welcomed_gives_up_saying_so() {
        let job = JobAuth { job: "j".into(), secret: Secret::generate().unwrap() };
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (done_tx, done) = mpsc::channel::<()>();
        let secret = job.secret.clone();
        let silent = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut deadline = auth::Deadline::new(&mut conn, Duration::from_secs(60));
            auth::accept(&mut deadline, &secret, |_| Ok(())).unwrap();
            // Held open, silent, until the worker has given up.
            let _ = done.recv();
        });
        let e = match Session::join_within(addr, 5, job, Duration::from_millis(300)) {
            Err(e) => format!("{e:#}"),
            Ok(_) => panic!("joined a coordinator that never welcomed it"),
        };
        assert!(e.contains("admitted it but did not welcome it (waited at most 300ms)"), "{e}");
        done_tx.send(()).unwrap();
        silent.join().unwrap();
    }

    fn manifest(step: u64) -> Manifest {
        Manifest {
            step,
            epoch: 0,
            cursor: 0,
            seed: 1,
            hyperparams: Hyperparams { global_batch: 8, local_batch: 4, lr: 0.1, momentum: 0.0 },
            plugin_state: Default::default(),
            files: Default::default(),
            fence: None,
        }
    }

    #[test]
    fn a_generation_loads_the_checkpoint_its_plan_names_even_when_a_newer_one_was_finished_since() {
        let dir = tempfile::tempdir().unwrap();
        let cps = Checkpoints::new(dir.path(), 3);
        let layout = Layout::new(vec![TensorSpec::new("w", vec![2])]).unwrap();
        let chosen = cps.save(&layout, &[250.0, 1.0], manifest(250)).unwrap();
        cps.save(&layout, &[300.0, 1.0], manifest(300)).unwrap();
        let r = planned_checkpoint(&cps, &chosen, 250).unwrap();
        assert_eq!((r.manifest.step, r.values[0]), (250, 250.0));
        let e =
            planned_checkpoint(&cps, &chosen, 300).err().expect("a step other than the plan's").to_string();
        assert!(e.contains("is at step 250, the plan says 300"), "{e}");
        std::fs::remove_dir_all(&chosen).unwrap();
        let e = format!(
            "{:#}",
            planned_checkpoint(&cps, &chosen, 250).err().expect("the plan's checkpoint gone")
        );
        assert!(e.contains("the plan's checkpoint") && e.contains("step-0000000250"), "{e}");
    }
}
