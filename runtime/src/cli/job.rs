//! The job of steps: the built-in student (`edl-runtime [job flags]`) or a
//! launched program (`edl-runtime launch`), run by the coordinator from the
//! same flags. [`run`] goes through it step by step: the plugins, the
//! directories, the workload, the job's configuration and the checks
//! before anything starts, the teachers (`teachers.rs`), the run with its
//! progress (`progress.rs`), and the summary (`summary.rs`).

use super::{
    flags::{
        ClusterArgs, DistillationArgs, LivenessArgs, OutputArgs, PluginArgs, ScalerKind, ScalingArgs,
        StateArgs, TrainingArgs, TransformArgs,
    },
    plugin_path,
    progress::ProgressDisplay,
    summary::{summarize, write_failed_report},
    teachers::Teachers,
};
use anyhow::{Context, Result};
use clap::Args;
use edl_host_gpu::{Device, comm::auth::Secret};
use edl_plugin_sdk::Hyperparams;
use edl_runtime::{
    checkpoint::Checkpoints,
    coordinator::{self, JobOutcome, report::Report},
    job::{self, BuiltinModel, JobConfig, JobLock, JobSpec, Program},
    net,
    plugin::{AdapterPlugin, PluginHost, PolicyPlugin},
    scalers::{
        CommandScaler, ExternalWorkers, LocalProcesses, Scaler, kubernetes::KubernetesScaler,
        slurm::SlurmScaler,
    },
    trainer::{
        data::Dataset,
        model::Mlp,
        train::Trainer,
        worker::{load_data, mlp_of},
    },
};
use std::{
    path::{Path, PathBuf},
    process::ExitCode,
    sync::Arc,
    time::Duration,
};

/// Flags of every job of steps: the built-in one and `launch`'s.
#[derive(Args)]
pub struct JobArgs {
    #[command(flatten)]
    pub plugins: PluginArgs,
    #[command(flatten)]
    pub scaling: ScalingArgs,
    #[command(flatten)]
    pub training: TrainingArgs,
    #[command(flatten)]
    pub distillation: DistillationArgs,
    #[command(flatten)]
    pub state: StateArgs,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    #[command(flatten)]
    pub liveness: LivenessArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// The built-in student's distillation temperature, by default; a
/// launched program's job carries it unused.
pub const TEMPERATURE: f32 = 4.0;
/// The built-in student's weight of the soft-label term, by default.
pub const ALPHA: f32 = 0.7;

/// Flags of the built-in student and its teachers only (`launch` refuses them).
#[derive(Args)]
#[command(next_help_heading = "Built-in student")]
pub struct StudentArgs {
    /// `mnist5k` (4000 train / 1000 test) or `digits` (1397 / 400).
    #[arg(long, value_name = "NAME", default_value = "mnist5k")]
    pub dataset: String,
    /// Train the student on the first N training samples only (a small transfer set).
    #[arg(long, value_name = "N")]
    pub train_samples: Option<usize>,
    /// Student hidden layer sizes, comma separated.
    #[arg(long, value_name = "SIZES", default_value = "128")]
    pub hidden: String,
    /// Where workers (and the teacher's training) compute: `cpu`, `cuda` or
    /// `cuda:N` (cuBLAS and the CUDA loss kernel; checked before the job starts).
    #[arg(long, value_name = "DEVICE", default_value = "cpu", help_heading = "Training")]
    pub device: Device,
    /// Extra milliseconds each step takes on each worker (emulates slower devices).
    #[arg(long, value_name = "MS", default_value_t = 0, help_heading = "Training")]
    pub step_delay_ms: u64,
    #[command(flatten)]
    pub transform: TransformArgs,
    /// Teacher processes to start, serving a wider model trained here and
    /// cached (0: use the teachers registered in --store).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 2,
        conflicts_with = "teachers",
        help_heading = "Distillation"
    )]
    pub teacher_processes: u32,
    /// Teacher hidden layer sizes, comma separated.
    #[arg(long, value_name = "SIZES", default_value = "512", help_heading = "Distillation")]
    pub teacher_hidden: String,
    /// Epochs the teacher trains for, on hard labels (once: later runs with
    /// the same settings take it from .edl/teachers/).
    #[arg(long, value_name = "N", default_value_t = 10, help_heading = "Distillation")]
    pub teacher_epochs: u64,
    /// Distillation temperature.
    #[arg(long, value_name = "T", default_value_t = TEMPERATURE, help_heading = "Distillation")]
    pub temperature: f32,
    /// Weight of the soft-label term (1 - alpha goes to the hard labels).
    #[arg(long, value_name = "A", default_value_t = ALPHA, help_heading = "Distillation")]
    pub alpha: f32,
}

/// What the job's workers run.
pub enum Workload {
    /// The built-in student on its data set.
    Builtin(StudentArgs),
    /// The user's program (`launch`), on the samples `0..samples`.
    Program { samples: usize, command: Vec<String> },
}

/// Runs a job to its end and prints its summary.
pub fn run(host: &Arc<PluginHost>, name: String, args: JobArgs, work: Workload) -> Result<ExitCode> {
    let transform = match &work {
        Workload::Builtin(s) => Some(&s.transform),
        Workload::Program { .. } => None,
    };
    let plugins = Plugins::load(host, &args.plugins, transform)?;
    let dirs = JobDirs::new(&name, args.state.checkpoint_dir.clone());
    let exe = std::env::current_exe().context("locating edl-runtime")?;
    let work = Prepared::new(work)?;
    let spec = job_spec(host, &name, &args, &work, &dirs, plugins.transform.as_deref())?;
    work.check_device(args.training.seed)?;
    let distill = work.distills(&args.distillation);
    let mut cfg = job_config(&args, spec)?;
    let kept = dirs.job_dir.join("secret");
    if args.cluster.secret_file.is_none() && cfg.store != "memory" && kept.exists() {
        // The job's workers may outlive its coordinator and come back to
        // the next one (a standby, a rerun): it keeps the job's secret.
        cfg.secret = edl_runtime::worker::session::read_secret_file(&kept)?;
    }
    // Teachers this job starts listen beside the coordinator and are
    // reached at the same host.
    let advertised = cfg.addresses.advertised_host()?;
    let lock = prepare_to_start(&cfg, distill, &dirs, &name, args.cluster.secret_file.as_deref())?;
    print_header(&name, &args, &work, &plugins);

    let teachers = Teachers::start(&args, &name, &work, distill, &dirs, (&advertised, &exe))?;
    cfg.spec.teachers = teachers.source.clone();
    if let Some(pem) = &teachers.ca_pem {
        let access = &mut cfg.spec.teacher_access;
        access.ca_pem = Some(match access.ca_pem.take() {
            Some(given) => format!("{given}\n{pem}"),
            None => pem.clone(),
        });
    }
    // A token never goes to a teacher reached in clear.
    if let Some(edl_runtime::job::TeacherSource::Fixed(list)) = &cfg.spec.teachers {
        for addr in list {
            if let Some(why) = cfg.spec.teacher_access.refusal(addr) {
                anyhow::bail!(why);
            }
        }
    }
    if !teachers.processes.lock().unwrap_or_else(|e| e.into_inner()).is_empty() {
        cfg.teacher_watch = Some(Box::new(teachers.processes.clone()));
    }
    let spec = cfg.spec.clone();
    let scaler = scaler(&args.cluster, &exe, &dirs.log_dir, work.command())?;
    let mut display = ProgressDisplay::new(work.rows() as u64, args.training.epochs)?;
    let Plugins { policy, policy_name, adapter, adapter_name, .. } = plugins;
    let outcome = match coordinator::run(cfg, lock, policy, adapter, scaler, &mut |p| display.show(p)) {
        Ok(o) => o,
        Err(e) => {
            display.finish();
            write_failed_report(args.output.report.as_deref(), &name, &e, &dirs.checkpoint_dir);
            return Err(e);
        }
    };
    display.finish();
    drop(teachers.processes);

    let student_accuracy = work.student_accuracy(&spec.checkpoint_dir, &outcome)?;
    let report = Report::new(
        &name,
        outcome,
        student_accuracy,
        teachers.accuracy,
        distill,
        policy_name,
        adapter_name,
        &edl_runtime::store::redact(&args.state.store),
        work.device().to_string(),
        args.training.seed,
    );
    summarize(&report, &args.output, &dirs.checkpoint_dir, &spec.checkpoint_dir)
}

/// The plugins the coordinator runs, loaded (and the transform tried)
/// before anything starts.
struct Plugins {
    policy: Box<dyn PolicyPlugin>,
    /// Name and version.
    policy_name: String,
    /// Where the policy was found.
    policy_path: PathBuf,
    adapter: Option<Box<dyn AdapterPlugin>>,
    adapter_name: Option<String>,
    /// Where the transform was found, if there is one.
    transform: Option<PathBuf>,
}

impl Plugins {
    fn load(host: &PluginHost, args: &PluginArgs, transform: Option<&TransformArgs>) -> Result<Plugins> {
        let (policy, policy_name, policy_path) = load_policy(host, args)?;
        let adapter = match &args.adapter {
            Some(p) => Some(host.load_adapter(&plugin_path::resolve("--adapter", p)?, &args.adapter_config)?),
            None => None,
        };
        let adapter_name = adapter.as_ref().map(|a| format!("{} {}", a.info().name, a.info().version));
        let transform = match transform.and_then(|t| Some((t.transform.as_ref()?, &t.transform_config))) {
            Some((p, config)) => {
                let p = plugin_path::resolve("--transform", p)?;
                // Loaded here once so a broken plugin fails the job before it starts.
                host.load_transform(&p, config)?;
                Some(p)
            }
            None => None,
        };
        Ok(Plugins { policy, policy_name, policy_path, adapter, adapter_name, transform })
    }
}

/// The scaling policy `--policy` names (found as given or beside the
/// executable), its name and version, and where it was found.
pub fn load_policy(
    host: &PluginHost,
    plugins: &PluginArgs,
) -> Result<(Box<dyn PolicyPlugin>, String, PathBuf)> {
    let path = plugin_path::resolve("--policy", &plugins.policy)?;
    let policy = host.load_policy(&path, &plugins.policy_config)?;
    let name = format!("{} {}", policy.info().name, policy.info().version);
    Ok((policy, name, path))
}

/// Where a job keeps its files.
pub(super) struct JobDirs {
    /// `.edl`, where the job's directory and the cached teachers are.
    pub(super) root: PathBuf,
    /// `--checkpoint-dir`, or `.edl/<job>/checkpoints`.
    pub(super) checkpoint_dir: PathBuf,
    /// Checkpoints in object storage: the job's local files (logs, the
    /// lock, the secret) stay in .edl/<job>/.
    pub(super) remote: bool,
    /// The checkpoint directory's parent, or `.edl/<job>` when remote.
    pub(super) job_dir: PathBuf,
    pub(super) log_dir: PathBuf,
}

impl JobDirs {
    fn new(name: &str, checkpoint_dir: Option<PathBuf>) -> JobDirs {
        let root = PathBuf::from(".edl");
        let checkpoint_dir = checkpoint_dir.unwrap_or_else(|| root.join(name).join("checkpoints"));
        let remote = edl_runtime::checkpoint::objects::is_url(&checkpoint_dir.to_string_lossy());
        let job_dir = if remote {
            root.join(name)
        } else {
            checkpoint_dir.parent().unwrap_or(&checkpoint_dir).to_path_buf()
        };
        let log_dir = job_dir.join("logs");
        JobDirs { root, checkpoint_dir, remote, job_dir, log_dir }
    }
}

/// The workload, ready: the built-in student with its data, or the program.
#[allow(clippy::large_enum_variant, reason = "one value per run, never moved in a loop")]
pub(super) enum Prepared {
    Builtin { student: StudentArgs, model: BuiltinModel, train: Dataset, test: Dataset },
    Program { samples: usize, command: Vec<String> },
}

impl Prepared {
    fn new(work: Workload) -> Result<Prepared> {
        Ok(match work {
            Workload::Builtin(student) => {
                let mut model = BuiltinModel {
                    dataset: student.dataset.clone(),
                    test_rows: if student.dataset == "digits" { 400 } else { 1000 },
                    split_seed: 1,
                    train_samples: student.train_samples,
                    layers: Vec::new(),
                };
                let (train, test) = load_data(&BuiltinModel { train_samples: None, ..model.clone() })?;
                let hidden = sizes(&student.hidden, "hidden")?;
                model.layers = std::iter::once(train.dim).chain(hidden).chain([train.classes]).collect();
                Prepared::Builtin { student, model, train, test }
            }
            Workload::Program { samples, command } => Prepared::Program { samples, command },
        })
    }

    /// Samples per epoch.
    fn rows(&self) -> usize {
        match self {
            Prepared::Builtin { student, train, .. } => {
                student.train_samples.map_or(train.len(), |n| n.min(train.len()))
            }
            Prepared::Program { samples, .. } => *samples,
        }
    }

    fn program(&self) -> Program {
        match self {
            Prepared::Builtin { model, .. } => Program::Builtin(model.clone()),
            Prepared::Program { command, .. } => Program::External { command: command.clone() },
        }
    }

    /// The launched command, if any.
    fn command(&self) -> Option<&[String]> {
        match self {
            Prepared::Builtin { .. } => None,
            Prepared::Program { command, .. } => Some(command),
        }
    }

    /// Where the built-in workers compute (a launched program decides for itself).
    fn device(&self) -> Device {
        match self {
            Prepared::Builtin { student, .. } => student.device,
            Prepared::Program { .. } => Device::Cpu,
        }
    }

    /// Whether the job distils: the built-in student unless --no-distill; a
    /// launched program only from the teachers it is given.
    fn distills(&self, d: &DistillationArgs) -> bool {
        match self {
            Prepared::Builtin { .. } => !d.no_distill,
            Prepared::Program { .. } => !d.no_distill && (d.teachers.is_some() || d.service.is_some()),
        }
    }

    /// A missing driver, GPU, cuBLAS or NVRTC stops the job here, before
    /// any process starts.
    fn check_device(&self, seed: u64) -> Result<()> {
        if let Prepared::Builtin { student, model, .. } = self
            && student.device != Device::Cpu
        {
            Trainer::on(student.device, Mlp::random(&model.layers, seed))
                .context("checking --device before the job starts")?;
        }
        Ok(())
    }

    /// What the job trains, for its first line.
    fn describe(&self) -> String {
        match self {
            Prepared::Builtin { student, model, test, .. } => format!(
                "{} ({} training samples, {} test), student {:?}",
                student.dataset,
                self.rows(),
                test.len(),
                model.layers
            ),
            Prepared::Program { command, samples: 0 } => {
                format!("{:?} on the samples its data set holds", command.join(" "))
            }
            Prepared::Program { command, samples } => {
                format!("{:?} on samples 0..{samples}", command.join(" "))
            }
        }
    }

    /// The built-in student's test accuracy, from the final checkpoint.
    fn student_accuracy(&self, checkpoint_dir: &Path, outcome: &JobOutcome) -> Result<Option<f64>> {
        match self {
            Prepared::Builtin { test, .. } => {
                let store = Checkpoints::open(checkpoint_dir, 1)?;
                let restored = mlp_of(&store.read_at(&outcome.final_checkpoint)?)?;
                Ok(Some(restored.accuracy(test) as f64))
            }
            Prepared::Program { .. } => Ok(None),
        }
    }
}

pub(super) fn sizes(list: &str, what: &str) -> Result<Vec<usize>> {
    list.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().parse::<usize>().ok().filter(|&n| n > 0))
        .collect::<Option<Vec<_>>>()
        .with_context(|| format!("--{what} {list:?}: expected positive sizes separated by commas"))
}

/// What every worker is told about the job (its teachers come later).
fn job_spec(
    host: &PluginHost,
    name: &str,
    args: &JobArgs,
    work: &Prepared,
    dirs: &JobDirs,
    transform: Option<&Path>,
) -> Result<JobSpec> {
    let (temperature, alpha, step_delay_ms, transform_config) = match work {
        Prepared::Builtin { student: s, .. } => {
            (s.temperature, s.alpha, s.step_delay_ms, s.transform.transform_config.clone())
        }
        Prepared::Program { .. } => (TEMPERATURE, ALPHA, 0, Vec::new()),
    };
    let d = &args.distillation;
    Ok(JobSpec {
        job: name.to_string(),
        samples: work.rows(),
        seed: args.training.seed,
        epochs: args.training.epochs,
        program: work.program(),
        temperature,
        alpha,
        teachers: None,
        teacher_model_name: "teacher".into(),
        transform: match transform {
            Some(p) => Some(job::spec::ShippedPlugin::read(p)?),
            None => None,
        },
        transform_config,
        collective_timeout_ms: args.liveness.collective_timeout_ms,
        gradients_in_clear: args.cluster.gradients_in_clear,
        checkpoint_dir: if dirs.remote {
            dirs.checkpoint_dir.clone()
        } else {
            std::path::absolute(&dirs.checkpoint_dir)?
        },
        keep_checkpoints: args.state.keep_checkpoints,
        step_delay_ms,
        device: work.device().to_string(),
        plugin_deadline_ms: host.limits().deadline.as_millis() as u64,
        plugin_memory_mib: host.limits().memory_bytes >> 20,
        allow_native: host.allows_native(),
        teacher_wait_ms: d.teacher_wait_secs.saturating_mul(1000),
        worker_lease_ms: args.liveness.worker_lease_secs.saturating_mul(1000),
        worker_reconnect_ms: args.liveness.worker_reconnect_secs.saturating_mul(1000),
        teacher_access: d.teacher_access.read()?,
        teacher_io: d.teacher_io.io(),
        teacher_calls: d.teacher_calls.calls(),
        follow: None,
    })
}

/// How the coordinator runs the job.
fn job_config(args: &JobArgs, spec: JobSpec) -> Result<JobConfig> {
    let (s, t, c, l) = (&args.scaling, &args.training, &args.cluster, &args.liveness);
    Ok(JobConfig {
        spec,
        min_workers: s.bounds.min_workers,
        max_workers: s.bounds.max_workers,
        initial_workers: s.bounds.initial(),
        decide_every: s.decide_every_steps,
        checkpoint_every: args.state.checkpoint_every_steps,
        checkpoint_interval: Duration::from_secs(args.state.checkpoint_secs),
        hyper: Hyperparams { global_batch: t.batch, local_batch: t.batch, lr: t.lr, momentum: t.momentum },
        store: args.state.store.clone(),
        standby: args.state.standby,
        step_timeout: Duration::from_secs(l.step_timeout_secs),
        join_timeout: Duration::from_secs(l.join_timeout_secs.max(1)),
        price_per_worker_hour: s.price,
        teacher_watch: None,
        secret: match &c.secret_file {
            Some(f) if f.exists() => edl_runtime::worker::session::read_secret_file(f)?,
            _ => Secret::generate()?,
        },
        addresses: net::Addresses {
            listen: c.listen,
            rendezvous_port: c.rendezvous_port,
            advertise: c.advertise.clone(),
        },
    })
}

/// Refuses, before a teacher or worker starts, everything a flag can get
/// wrong; then takes the job's lock and writes its secret.
fn prepare_to_start(
    cfg: &JobConfig,
    distill: bool,
    dirs: &JobDirs,
    name: &str,
    secret_file: Option<&Path>,
) -> Result<JobLock> {
    cfg.validate()?;
    if distill {
        cfg.validate_teacher_wait()?;
    }
    job::preflight(cfg)?;
    let lock = JobLock::acquire(
        if dirs.remote { &dirs.job_dir } else { &cfg.spec.checkpoint_dir },
        name,
        cfg.standby,
        cfg.store != "memory",
    )?;
    std::fs::create_dir_all(&dirs.log_dir).with_context(|| format!("{}", dirs.log_dir.display()))?;
    // A new secret is written where an operator finds it (mode 0600):
    // --secret-file, or .edl/<job>/secret.
    let kept = dirs.job_dir.join("secret");
    match secret_file {
        Some(f) if f.exists() => {}
        None if cfg.store != "memory" && kept.exists() => {}
        f => cfg.secret.write(f.unwrap_or(&kept))?,
    }
    Ok(lock)
}

fn print_header(name: &str, args: &JobArgs, work: &Prepared, plugins: &Plugins) {
    let b = &args.scaling.bounds;
    let on = match work {
        Prepared::Builtin { student, .. } => format!(" on {}", student.device),
        Prepared::Program { .. } => String::new(),
    };
    println!(
        "job {name:?}: {}, {} epochs, {}..{} workers{on}, store {}",
        work.describe(),
        args.training.epochs,
        b.min_workers,
        b.max_workers,
        edl_runtime::store::redact(&args.state.store)
    );
    println!(
        "policy    {} ({}, {})",
        plugins.policy_name,
        plugins.policy_path.display(),
        plugins.policy.backend()
    );
    if let Some(a) = &plugins.adapter_name {
        println!("adapter   {a}");
    }
}

/// The scaler `--scaler` names; `program`: the launched command, if any.
fn scaler(
    args: &ClusterArgs,
    exe: &Path,
    log_dir: &Path,
    program: Option<&[String]>,
) -> Result<Box<dyn Scaler>> {
    let (stop, hosts) = (args.worker_stop_command.as_deref(), &args.hosts[..]);
    Ok(match (args.scaler, program) {
        (ScalerKind::Local, None) => Box::new(LocalProcesses::new(exe, log_dir)),
        (ScalerKind::Local, Some(command)) => Box::new(LocalProcesses::program(command, log_dir)?),
        (ScalerKind::Command, program) => {
            let start = args.worker_command.as_deref().context("--scaler command needs --worker-command")?;
            Box::new(match program {
                None => CommandScaler::new(start, stop, hosts, exe, log_dir)?,
                Some(command) => CommandScaler::for_program(start, stop, hosts, log_dir, command)?,
            })
        }
        (ScalerKind::Slurm, None) => {
            Box::new(SlurmScaler::new(args.slurm.options(), exe.to_path_buf(), log_dir.to_path_buf()))
        }
        (ScalerKind::Slurm, Some(command)) => {
            Box::new(SlurmScaler::for_program(args.slurm.options(), log_dir.to_path_buf(), command))
        }
        (ScalerKind::Kubernetes, None) => Box::new(KubernetesScaler::new(args.kube.options())?),
        (ScalerKind::Kubernetes, Some(command)) => {
            Box::new(KubernetesScaler::for_program(args.kube.options(), command)?)
        }
        (ScalerKind::External, _) => Box::new(ExternalWorkers),
    })
}
