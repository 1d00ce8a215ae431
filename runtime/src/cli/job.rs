//! The job of steps: the built-in student (`edl-runtime [job flags]`) or a
//! launched program (`edl-runtime launch`), run by the coordinator from the
//! same flags. [`run`] goes through it step by step: the plugins, the
//! directories and the workload (`workload.rs`), the job's configuration
//! and the checks before anything starts, the teachers (`teachers.rs`), the
//! run with its progress (`progress.rs`), and the summary (`summary.rs`).

use super::{
    flags::{ClusterArgs, PluginArgs, ScalerKind, TransformArgs},
    plugin_path,
    progress::ProgressDisplay,
    summary::{summarize, write_failed_report},
    teachers::Teachers,
    workload::{ALPHA, JobArgs, JobDirs, Prepared, TEMPERATURE, Workload},
};
use anyhow::{Context, Result};
use edl_host_gpu::comm::auth::Secret;
use edl_plugin_sdk::Hyperparams;
use edl_runtime::{
    coordinator::{self, report::Report},
    job::{self, JobConfig, JobLock, JobSpec},
    net,
    plugin::{AdapterPlugin, PluginHost, PolicyPlugin},
    scalers::{
        CommandScaler, ExternalWorkers, LocalProcesses, Scaler, kubernetes::KubernetesScaler,
        slurm::SlurmScaler,
    },
};
use std::{
    path::{Path, PathBuf},
    process::ExitCode,
    sync::Arc,
    time::Duration,
};

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
