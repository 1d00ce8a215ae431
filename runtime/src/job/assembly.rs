//! One place that puts a job together from its configuration, in the order
//! it must happen: the checks a flag can fail, the job's lock, its secret
//! where an operator finds it, the teacher processes it serves itself.
//! The command line and the benches assemble a job here and run it with
//! [`crate::coordinator::run`]; the configuration is complete before this
//! starts and is not changed after.

use super::{
    JobConfig, JobLock, preflight,
    spec::TeacherSource,
    teacher_pool::{TeacherGuard, TeacherProcess, TeacherTls},
};
use crate::{
    plugin::{AdapterPlugin, PolicyPlugin},
    scalers::Scaler,
};
use anyhow::{Context, Result, bail};
use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

/// Where a job keeps its files on this machine.
#[derive(Clone, Debug)]
pub struct JobDirs {
    /// `.edl`, where the job's directory and the cached teachers are.
    pub root: PathBuf,
    /// `--checkpoint-dir`, or `.edl/<job>/checkpoints`.
    pub checkpoint_dir: PathBuf,
    /// Checkpoints in object storage: the job's local files (logs, the
    /// lock, the secret) stay in .edl/<job>/.
    pub remote: bool,
    /// The checkpoint directory's parent, or `.edl/<job>` when remote.
    pub job_dir: PathBuf,
    pub log_dir: PathBuf,
}

impl JobDirs {
    /// The directories of job `name`, its checkpoints at `checkpoint_dir`
    /// (a directory or an object store URL) or in `.edl/<name>/checkpoints`.
    pub fn new(name: &str, checkpoint_dir: Option<PathBuf>) -> JobDirs {
        let root = PathBuf::from(".edl");
        let checkpoint_dir = checkpoint_dir.unwrap_or_else(|| root.join(name).join("checkpoints"));
        let remote = crate::checkpoint::objects::is_url(&checkpoint_dir.to_string_lossy());
        let job_dir = if remote {
            root.join(name)
        } else {
            checkpoint_dir.parent().unwrap_or(&checkpoint_dir).to_path_buf()
        };
        let log_dir = job_dir.join("logs");
        JobDirs { root, checkpoint_dir, remote, job_dir, log_dir }
    }

    /// Where the job keeps its secret when no `--secret-file` is given.
    pub fn kept_secret(&self) -> PathBuf {
        self.job_dir.join("secret")
    }
}

/// The model a job's teachers serve, made when they start (trained here,
/// or taken from the cache): its file, and its test accuracy when known.
pub type TeacherModel = Box<dyn FnOnce() -> Result<(PathBuf, Option<f64>)>>;

/// Teacher processes a job starts for itself.
pub struct TeacherStart {
    pub count: u32,
    pub model: TeacherModel,
    /// The `edl-runtime` they run as (`edl-runtime teacher ...`).
    pub exe: PathBuf,
    /// The service they register under in the job's store.
    pub service: String,
    /// The token students present. They serve TLS, with a certificate the
    /// job makes, wherever a token is or they are reached from other hosts.
    pub token_file: Option<PathBuf>,
    /// An accelerator each emulates: µs a row of each batch (0: none).
    pub emulate_row_us: u64,
    /// Started by this command on its hosts instead of here.
    pub command: Option<super::teacher_command::TeacherCommand>,
    /// Started as Kubernetes Pods of their own image instead of here.
    pub kube: Option<super::teacher_kube::KubeTeacherSpec>,
    /// The pool that sizes them while the job runs (None: `count` for the
    /// whole job).
    pub pool: Option<PoolStart>,
}

/// How a job's teacher pool is sized: its policy, bounds and cadence.
pub struct PoolStart {
    pub policy: Box<dyn crate::coordinator::pool::PoolPolicy>,
    pub min: u32,
    pub max: u32,
    pub every: std::time::Duration,
    pub price_per_teacher_hour: f64,
    /// Requests each student keeps in flight at each teacher at the start.
    pub in_flight: u32,
}

impl PoolStart {
    fn bounds(&self) -> crate::coordinator::pool::PoolBounds {
        crate::coordinator::pool::PoolBounds {
            min: self.min,
            max: self.max,
            every: self.every,
            price_per_teacher_hour: self.price_per_teacher_hour,
            in_flight: self.in_flight,
        }
    }
}

/// The teacher processes a job started, which stop when it is dropped.
#[derive(Default)]
pub struct StartedTeachers {
    processes: Arc<Mutex<Vec<TeacherProcess>>>,
    /// Their certificate (PEM), when they serve TLS: students trust it
    /// beside any `--teacher-ca`.
    ca_pem: Option<String>,
    accuracy: Option<f64>,
    /// The pool that sizes them, until the coordinator takes it.
    pool: Option<crate::coordinator::pool::TeacherPool>,
    /// The handles of its teachers in Kubernetes Pods that outlive the coordinator.
    kube_handles: Option<Arc<Mutex<Vec<crate::leader::record::TeacherHandle>>>>,
}

impl Drop for StartedTeachers {
    fn drop(&mut self) {
        // Every teacher is told at once, so that they drain together; then
        // each is waited for as it is dropped.
        let mut all = self.processes.lock().unwrap_or_else(|e| e.into_inner());
        all.iter_mut().for_each(TeacherProcess::ask_to_stop);
        all.clear();
    }
}

impl StartedTeachers {
    /// The pool that sizes the teachers, if the job has one (taken once).
    pub(crate) fn take_pool(&mut self) -> Option<crate::coordinator::pool::TeacherPool> {
        self.pool.take()
    }

    /// The addresses they serve on, as students reach them.
    pub fn addrs(&self) -> Vec<String> {
        self.processes.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|p| p.addr.clone()).collect()
    }

    /// Their model's test accuracy, when the job trained it (or took it from the cache).
    pub fn accuracy(&self) -> Option<f64> {
        self.accuracy
    }

    /// Their certificate (PEM), when they serve TLS.
    pub fn ca_pem(&self) -> Option<&str> {
        self.ca_pem.as_deref()
    }

    /// The handles of those that outlive the coordinator, as they are when
    /// called (see [`TeacherProcess::handle`]).
    pub(crate) fn handles(&self) -> impl Fn() -> Vec<crate::leader::record::TeacherHandle> + Send + 'static {
        let (processes, kube) = (self.processes.clone(), self.kube_handles.clone());
        move || {
            let mut all: Vec<_> = processes
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .filter_map(TeacherProcess::handle)
                .collect();
            if let Some(k) = &kube {
                all.extend(k.lock().unwrap_or_else(|e| e.into_inner()).iter().cloned());
            }
            all
        }
    }

    /// What watches them while the job runs, if any were started.
    pub(crate) fn watch(&self) -> Option<Box<dyn super::teacher_pool::TeacherWatch>> {
        (!self.addrs().is_empty()).then(|| Box::new(self.processes.clone()) as Box<_>)
    }
}

/// The scaling policy and the batch adapter a job runs.
pub struct JobPlugins {
    pub policy: Box<dyn PolicyPlugin>,
    pub adapter: Option<Box<dyn AdapterPlugin>>,
}

/// A job put together, ready to run.
pub struct Job {
    pub(crate) cfg: JobConfig,
    pub(crate) lock: JobLock,
    pub(crate) plugins: JobPlugins,
    pub(crate) scaler: Box<dyn Scaler>,
    pub(crate) teachers: StartedTeachers,
    /// The parameter servers it started, stopped when the job ends.
    pub(crate) ps: super::ps_servers::PsServers,
    /// What is done with a stalled coordinator's error before the process
    /// ends, besides printing it.
    pub(crate) on_stall: Option<crate::coordinator::watchdog::OnStall>,
}

impl Job {
    /// Puts job `cfg` together: refuses what a flag got wrong before
    /// anything starts, takes the job's lock (naming the holder when another
    /// coordinator has it), writes a new secret to `secret_file` or the
    /// job's directory (mode 0600), then starts the teachers it serves
    /// itself, if any. Nothing is started when a check fails.
    pub fn assemble(
        cfg: JobConfig,
        dirs: &JobDirs,
        secret_file: Option<&Path>,
        plugins: JobPlugins,
        scaler: Box<dyn Scaler>,
        teachers: Option<TeacherStart>,
    ) -> Result<Job> {
        let job = Job::prepare(cfg, dirs, secret_file, plugins, scaler, teachers.is_some())?;
        match teachers {
            Some(start) => job.start_teachers(dirs, start, &mut |_, _| {}),
            None => Ok(job),
        }
    }

    /// The first half of [`Job::assemble`]: the checks, the lock and the
    /// secret (`starts_teachers`: teachers will be started, whose waits are
    /// checked too).
    pub fn prepare(
        cfg: JobConfig,
        dirs: &JobDirs,
        secret_file: Option<&Path>,
        plugins: JobPlugins,
        scaler: Box<dyn Scaler>,
        starts_teachers: bool,
    ) -> Result<Job> {
        check(&cfg, starts_teachers)?;
        refuse_tokens_in_clear(&cfg, &StartedTeachers::default())?;
        let lock = lock_and_keep_secret(&cfg, dirs, secret_file)?;
        if matches!(cfg.spec.teachers, Some(crate::job::spec::TeacherSource::Discovered { .. })) {
            keep_registration_key(&cfg, dirs)?;
        }
        let (teachers, ps) = Default::default();
        Ok(Job { cfg, lock, plugins, scaler, teachers, ps, on_stall: None })
    }

    /// The second half of [`Job::assemble`]: the teacher processes start
    /// (`serving` is told each one's number and address as it serves),
    /// and what students will be told of them is checked.
    pub fn start_teachers(
        mut self,
        dirs: &JobDirs,
        start: TeacherStart,
        serving: &mut dyn FnMut(u32, &str),
    ) -> Result<Job> {
        // A worker waiting for them must give up before it is declared dead.
        self.cfg.validate_teacher_wait()?;
        self.teachers = start_teachers(&self.cfg, dirs, start, serving)?;
        refuse_tokens_in_clear(&self.cfg, &self.teachers)?;
        Ok(self)
    }

    /// Starts the job's parameter servers beside the coordinator; workers
    /// are told where they serve.
    pub fn start_ps(mut self, dirs: &JobDirs, start: &super::ps_servers::PsStart) -> Result<Job> {
        let auth = crate::worker::session::JobAuth {
            job: self.cfg.spec.job.clone(),
            secret: self.cfg.secret.clone(),
        };
        self.ps = super::ps_servers::PsServers::start(start, &auth, &dirs.log_dir)?;
        self.cfg.spec.ps = Some(super::spec::PsTopology {
            servers: self.ps.addrs(),
            staleness: start.staleness,
            replicas: start.replicas,
            room: start.count < start.max,
        });
        Ok(self)
    }

    /// What is done with the error of a coordinator whose loop stalled,
    /// besides printing it, before the process ends.
    pub fn on_stall(mut self, said: crate::coordinator::watchdog::OnStall) -> Job {
        self.on_stall = Some(said);
        self
    }

    pub fn ps_servers(&self) -> &super::ps_servers::PsServers {
        &self.ps
    }

    pub fn config(&self) -> &JobConfig {
        &self.cfg
    }

    pub fn teachers(&self) -> &StartedTeachers {
        &self.teachers
    }
}

/// Everything a flag can get wrong, before anything starts.
fn check(cfg: &JobConfig, starts_teachers: bool) -> Result<()> {
    let refused = |e: anyhow::Error| super::config::Refused(format!("{e:#}"));
    cfg.validate().map_err(refused)?;
    if starts_teachers {
        cfg.validate_teacher_wait().map_err(refused)?;
    }
    preflight(cfg)
}

/// Where a job that finds its teachers in a store keeps the key they
/// register with, for the operator to give them (`edl-runtime teacher
/// --registration-key-file`).
pub fn registration_key_file(dirs: &JobDirs) -> PathBuf {
    dirs.job_dir.join("teacher-registration.key")
}

/// Writes the job's teacher registration key (readable by its owner only).
fn keep_registration_key(cfg: &JobConfig, dirs: &JobDirs) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = registration_key_file(dirs);
    let key = crate::leader::seal::RecordKey::teacher_registrations(&cfg.secret);
    let _ = std::fs::remove_file(&path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("{}: cannot write the teacher registration key", path.display()))?;
    std::io::Write::write_all(&mut f, key.to_hex().as_bytes()).with_context(|| format!("{}", path.display()))
}

/// Takes the job's lock, makes its log directory and writes a new secret
/// where an operator finds it: `secret_file`, or `.edl/<job>/secret`.
fn lock_and_keep_secret(cfg: &JobConfig, dirs: &JobDirs, secret_file: Option<&Path>) -> Result<JobLock> {
    let shared = cfg.store != "memory";
    let at = if dirs.remote { &dirs.job_dir } else { &cfg.spec.checkpoint_dir };
    let lock = JobLock::acquire(at, &cfg.spec.job, cfg.standby, shared)?;
    std::fs::create_dir_all(&dirs.log_dir).with_context(|| format!("{}", dirs.log_dir.display()))?;
    let kept = dirs.kept_secret();
    match secret_file {
        Some(f) if f.exists() => {}
        None if shared && kept.exists() => {}
        f => cfg.secret.write(f.unwrap_or(&kept))?,
    }
    Ok(lock)
}

/// Starts the teacher processes, beside the coordinator and reached at
/// the same host.
fn start_teachers(
    cfg: &JobConfig,
    dirs: &JobDirs,
    start: TeacherStart,
    serving: &mut dyn FnMut(u32, &str),
) -> Result<StartedTeachers> {
    let advertised = cfg.addresses.advertised_host()?;
    let listen = cfg.addresses.listen.ip();
    let (model, accuracy) = (start.model)()?;
    // Teachers started by command are the operator's servers: their TLS is theirs.
    let own = start.command.is_none() && start.kube.is_none();
    let tls = (own && (start.token_file.is_some() || !listen.is_loopback()))
        .then(|| TeacherTls::make(&dirs.job_dir.join("teacher-tls"), &advertised))
        .transpose()?;
    let ca_pem = tls.as_ref().map(|t| t.pem.clone());
    let registration = crate::leader::seal::RecordKey::teacher_registrations(&cfg.secret);
    let token = cfg.spec.teacher_access.token.clone();
    let guard = TeacherGuard { token_file: start.token_file, tls, registration: registration.clone() };
    let processes = Arc::new(Mutex::new(Vec::new()));
    let mut launcher = LocalTeachers {
        exe: start.exe,
        model,
        at: (listen, advertised),
        store: (cfg.store.clone(), start.service.clone()),
        guard,
        emulate_row_us: start.emulate_row_us,
        log_dir: dirs.log_dir.clone(),
        next: 0,
        processes: processes.clone(),
        command: match start.command {
            Some(c) => Some(ByCommand::new(c, cfg, &start.service, &registration, start.pool.is_some())?),
            None => None,
        },
        kube: start.kube.map(|spec| kube_teachers(cfg, spec, &start.service, &registration)).transpose()?,
    };
    // A standby whose pool's teachers outlive their coordinator starts none:
    // it takes over the active coordinator's when it takes the job over.
    let lasting = launcher.command.as_ref().is_some_and(|c| c.lasting())
        || launcher.kube.as_ref().is_some_and(|k| k.lasting());
    let held = cfg.standby && lasting;
    let kube_handles = launcher.kube.as_ref().map(|k| k.handles());
    let count = if held { 0 } else { start.count };
    for i in 0..count {
        let addr = crate::coordinator::pool::TeacherLauncher::start(&mut launcher)?;
        serving(i, &addr);
    }
    let pool = match start.pool {
        Some(p) => {
            let bounds = p.bounds();
            let addrs = launcher.addrs();
            // A pool of this service before (another run) may have left other settings.
            let settings = crate::coordinator::pool::PoolSettings {
                in_flight_per_teacher: p.in_flight,
                capacity: Default::default(),
            };
            crate::coordinator::pool::TeacherLauncher::publish(&mut launcher, settings)?;
            // The job's teachers' certificate, and any --teacher-ca (for those started by command).
            let trusted = with_ca(&cfg.spec.teacher_access, ca_pem.as_deref()).ca_pem;
            let access = crate::coordinator::pool::StatsAccess { token, ca_pem: trusted };
            let mut pool = crate::coordinator::pool::TeacherPool::new(
                p.policy,
                Box::new(launcher),
                bounds,
                addrs,
                access,
            )?;
            if held {
                pool.hold();
            }
            Some(pool)
        }
        None => None,
    };
    Ok(StartedTeachers { processes, ca_pem, accuracy, pool, kube_handles })
}

/// The job's teachers in Kubernetes Pods, registered under `service`.
fn kube_teachers(
    cfg: &JobConfig,
    spec: super::teacher_kube::KubeTeacherSpec,
    service: &str,
    registration: &crate::leader::seal::RecordKey,
) -> Result<super::teacher_kube::KubeTeachers> {
    let registry = match cfg.store.as_str() {
        "memory" => None,
        url => Some(super::teacher_command::Registry::open(url, service, registration.clone())?),
    };
    let (access, model_name) = (cfg.spec.teacher_access.clone(), &cfg.spec.teacher_model_name);
    let at = (cfg.spec.job.as_str(), service);
    super::teacher_kube::KubeTeachers::new(spec, at, registry, access, model_name)
}

/// Teacher processes beside the coordinator, reached at the same host:
/// how the job's teachers start, at the job's start and as its pool grows.
struct LocalTeachers {
    exe: PathBuf,
    model: PathBuf,
    at: (std::net::IpAddr, String),
    store: (String, String),
    guard: TeacherGuard,
    emulate_row_us: u64,
    log_dir: PathBuf,
    /// The number the next one's log carries.
    next: u32,
    processes: Arc<Mutex<Vec<TeacherProcess>>>,
    /// Started by `--teacher-command` instead.
    command: Option<ByCommand>,
    /// Started as Kubernetes Pods instead.
    kube: Option<super::teacher_kube::KubeTeachers>,
}

/// How long students following the store take to stop sending to a
/// teacher taken out of it (they look every 200 ms).
const DRAIN: std::time::Duration = std::time::Duration::from_secs(1);
/// How often a teacher taken over is asked whether it still answers.
const ADOPTED_LOOK: std::time::Duration = std::time::Duration::from_secs(5);

/// Teachers a job starts by command: the template, its slots, where their
/// endpoints are registered, and how readiness is asked.
struct ByCommand {
    cmd: super::teacher_command::TeacherCommand,
    slots: Vec<super::teacher_command::Slot>,
    /// None with the in-process store: students get the endpoints as a list.
    registry: Option<super::teacher_command::Registry>,
    job: String,
    access: crate::distill::TeacherAccess,
    model_name: String,
    /// A pool sizes them.
    pooled: bool,
}

impl ByCommand {
    fn new(
        cmd: super::teacher_command::TeacherCommand,
        cfg: &JobConfig,
        service: &str,
        registration: &crate::leader::seal::RecordKey,
        pooled: bool,
    ) -> Result<ByCommand> {
        let slots = cmd.slots()?;
        let registry = match cfg.store.as_str() {
            "memory" => None,
            url => Some(super::teacher_command::Registry::open(url, service, registration.clone())?),
        };
        Ok(ByCommand {
            cmd,
            slots,
            registry,
            job: cfg.spec.job.clone(),
            access: cfg.spec.teacher_access.clone(),
            model_name: cfg.spec.teacher_model_name.clone(),
            pooled,
        })
    }

    /// Its teachers outlive a coordinator killed without notice, for the
    /// one that takes the job over: pooled ones with a stop command, on a
    /// shared store.
    fn lasting(&self) -> bool {
        self.pooled && self.cmd.stop.is_some() && self.registry.is_some()
    }

    /// What `{...}` are filled with for teacher `id` on `slot`.
    /// (`service`, `model` and `exe`: the job's, as [`LocalTeachers`] keeps them.)
    fn filling<'a>(
        &'a self,
        (id, slot): (u32, usize),
        service: &'a str,
        model: &'a std::path::Path,
        exe: &'a std::path::Path,
    ) -> super::teacher_command::Filling<'a> {
        super::teacher_command::Filling { id, slot: &self.slots[slot], job: &self.job, service, model, exe }
    }
}

impl LocalTeachers {
    fn addrs(&self) -> Vec<String> {
        let mut all: Vec<String> =
            self.processes.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|p| p.addr.clone()).collect();
        all.extend(self.kube.iter().flat_map(|k| k.addrs()));
        all
    }

    /// Starts a teacher by `--teacher-command` on a free slot; returns its
    /// endpoint once it answers ready (and is registered). A slot where a
    /// server answers already (not this job's) is passed over, and said.
    fn start_by_command(&mut self) -> Result<String> {
        let c = self.command.as_ref().expect("started by command");
        let taken: Vec<usize> = self
            .processes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter_map(|t| t.slot())
            .collect();
        let id = self.next;
        let (service, model, exe) = (&self.store.1, &self.model, &self.exe);
        let filling = |slot: usize| c.filling((id, slot), service, model, exe);
        let mut found = None;
        for slot in (0..c.slots.len()).filter(|i| !taken.contains(i)) {
            let endpoint = c.cmd.fill(&c.cmd.endpoint, &filling(slot), false)?;
            // The token goes only where the students would send it.
            if let Some(why) = c.access.refusal(&endpoint) {
                bail!("--teacher-endpoint: {why}");
            }
            if super::teacher_command::answers_ready(&endpoint, &c.model_name, &c.access) {
                tracing::warn!(
                    "teacher slot {endpoint}: a server answers there already, not this job's; passed over"
                );
                continue;
            }
            found = Some((slot, endpoint));
            break;
        }
        let Some((slot, endpoint)) = found else {
            bail!("no free slot of --teacher-hosts ({} in all)", c.slots.len());
        };
        self.next += 1;
        let f = filling(slot);
        let line = c.cmd.fill(&c.cmd.start, &f, true)?;
        let stop = c.cmd.stop.as_ref().map(|t| c.cmd.fill(t, &f, true)).transpose()?;
        let log = super::teacher_command::log_path(&self.log_dir, id);
        let ready = |gone: &mut dyn FnMut() -> Option<String>| {
            super::teacher_command::wait_ready(&endpoint, &c.model_name, &c.access, c.cmd.ready_within, gone)
        };
        // Only a lasting one's stop command is kept for a coordinator taking over.
        let registry = c.registry.as_ref();
        let t = TeacherProcess::by_command(
            &line,
            &endpoint,
            (slot, id, stop, c.lasting()),
            &log,
            ready,
            registry,
        )?;
        self.processes.lock().unwrap_or_else(|e| e.into_inner()).push(t);
        Ok(endpoint)
    }
}

impl crate::coordinator::pool::TeacherLauncher for LocalTeachers {
    fn start(&mut self) -> Result<String> {
        if let Some(k) = self.kube.as_mut() {
            return k.start();
        }
        if self.command.is_some() {
            return self.start_by_command();
        }
        let log = self.log_dir.join(format!("teacher-{}.log", self.next));
        self.next += 1;
        let at = (self.at.0, self.at.1.as_str());
        let store = (self.store.0.as_str(), self.store.1.as_str());
        let t =
            TeacherProcess::start(&self.exe, &self.model, at, store, &self.guard, self.emulate_row_us, &log)?;
        let addr = t.addr.clone();
        self.processes.lock().unwrap_or_else(|e| e.into_inner()).push(t);
        Ok(addr)
    }

    fn stop(&mut self, addr: &str) {
        if let Some(k) = self.kube.as_mut() {
            k.stop(addr);
            return;
        }
        let gone = {
            let mut all = self.processes.lock().unwrap_or_else(|e| e.into_inner());
            all.iter().position(|t| t.addr == addr).map(|i| all.remove(i))
        };
        // One started by command is taken out of the store here, and
        // served on while the students stop sending to it.
        if let Some(mut t) = gone
            && t.deregister()
        {
            std::thread::sleep(DRAIN);
            drop(t);
        }
        // Dropped: told to go (it deregisters first), killed after a grace.
    }

    fn publish(&mut self, settings: crate::coordinator::pool::PoolSettings) -> Result<()> {
        let key = crate::store::keys::teacher_pool(&self.store.1);
        let value = self.guard.registration.seal(&key, &serde_json::to_vec(&settings)?);
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let url = self.store.0.clone();
        rt.block_on(async move {
            let store = crate::store::AnyStore::open(&url)?;
            tokio::time::timeout(
                std::time::Duration::from_secs(5),
                crate::store::Store::put(&store, &key, &value, None),
            )
            .await
            .map_err(|_| {
                anyhow::anyhow!("the store {} did not answer within 5 s", crate::store::redact(&url))
            })??;
            anyhow::Ok(())
        })
    }

    fn release(&mut self) {
        if let Some(k) = self.kube.as_mut() {
            k.release();
        }
        self.processes.lock().unwrap_or_else(|e| e.into_inner()).retain_mut(|t| !t.release());
    }

    fn adopt(&mut self, h: &crate::leader::record::TeacherHandle) -> Result<String> {
        if let Some(k) = self.kube.as_mut().filter(|k| k.lasting()) {
            return k.adopt(h);
        }
        let Some(c) = self.command.as_ref().filter(|c| c.lasting()) else {
            bail!(
                "this job's teachers are neither started by a command with a stop command on a shared store \
                 nor Pods owned by the coordinator's controller"
            )
        };
        if h.slot >= c.slots.len() {
            bail!("its slot {} is not one of --teacher-hosts' {}", h.slot, c.slots.len());
        }
        let f = c.filling((h.id, h.slot), &self.store.1, &self.model, &self.exe);
        let endpoint = c.cmd.fill(&c.cmd.endpoint, &f, false)?;
        if endpoint != h.addr {
            bail!("its slot is {endpoint} with this coordinator's flags");
        }
        let taken =
            self.processes.lock().unwrap_or_else(|e| e.into_inner()).iter().any(|t| t.slot() == Some(h.slot));
        if taken {
            bail!("its slot is this coordinator's own teacher's");
        }
        let stop = c.cmd.fill(c.cmd.stop.as_deref().expect("lasting"), &f, true)?;
        let log = super::teacher_command::log_path(&self.log_dir, h.id);
        if !super::teacher_command::ready_within(
            &endpoint,
            &c.model_name,
            &c.access,
            super::teacher_command::TAKEOVER_READY,
        ) {
            // This job's teacher by its handle, gone quiet: its stop command
            // ends whatever is left of it (dropped, it runs).
            drop(TeacherProcess::adopted(&endpoint, (h.slot, h.id, stop), &log, None)?);
            bail!("it does not answer ready; its stop command was run");
        }
        let t = TeacherProcess::adopted(&endpoint, (h.slot, h.id, stop), &log, c.registry.as_ref())?;
        self.next = self.next.max(h.id + 1);
        self.processes.lock().unwrap_or_else(|e| e.into_inner()).push(t);
        Ok(endpoint)
    }

    fn exited(&mut self) -> Vec<(String, String)> {
        let mut out = self.kube.as_mut().map(|k| k.exited()).unwrap_or_default();
        // Those taken over have no process here: whether they answer tells.
        // They are asked outside the lock (the job's state reads their handles under it).
        let due: Vec<String> = {
            let mut all = self.processes.lock().unwrap_or_else(|e| e.into_inner());
            all.iter_mut().filter_map(|t| t.look_due(ADOPTED_LOOK).then(|| t.addr.clone())).collect()
        };
        let command = self.command.as_ref();
        let answered: std::collections::BTreeMap<String, bool> = due
            .into_iter()
            .map(|at| {
                let up = command
                    .is_some_and(|c| super::teacher_command::answers_ready(&at, &c.model_name, &c.access));
                (at, up)
            })
            .collect();
        let mut all = self.processes.lock().unwrap_or_else(|e| e.into_inner());
        let asked = |t: &mut TeacherProcess| answered.get(&t.addr).and_then(|&up| t.looked(up));
        all.retain_mut(|t| match t.exited().or_else(|| asked(t)) {
            Some(how) => {
                out.push((t.addr.clone(), how));
                false
            }
            None => true,
        });
        out
    }
}

/// A token never goes to a teacher reached in clear.
fn refuse_tokens_in_clear(cfg: &JobConfig, teachers: &StartedTeachers) -> Result<()> {
    let access = with_ca(&cfg.spec.teacher_access, teachers.ca_pem());
    let told = match &cfg.spec.teachers {
        Some(TeacherSource::Fixed(list)) => list.clone(),
        Some(TeacherSource::Discovered { .. } | TeacherSource::InProcess { .. }) => return Ok(()),
        None => teachers.addrs(),
    };
    for addr in told {
        if let Some(why) = access.refusal(&addr) {
            bail!(why);
        }
    }
    Ok(())
}

/// `access`, also trusting the certificate of the teachers a job started.
pub(crate) fn with_ca(
    access: &crate::distill::TeacherAccess,
    ca_pem: Option<&str>,
) -> crate::distill::TeacherAccess {
    let mut access = access.clone();
    if let Some(pem) = ca_pem {
        access.ca_pem = Some(match access.ca_pem.take() {
            Some(given) => format!("{given}\n{pem}"),
            None => pem.to_string(),
        });
    }
    access
}
