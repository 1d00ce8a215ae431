//! The job of steps: the built-in student (`edl-runtime [job flags]`) or a
//! launched program (`edl-runtime launch`), run by the coordinator from the
//! same flags. [`run`] goes through it step by step: the plugins, the
//! directories and the workload (`workload.rs`), the job's configuration
//! and the checks before anything starts, the teachers (`teachers.rs`), the
//! run with its progress (`progress.rs`), and the summary (`summary.rs`).

use super::{
    flags::{ClusterArgs, PluginArgs, ScalerKind, TransformArgs, WatchArgs},
    plugin_path,
    progress::ProgressDisplay,
    summary::{summarize, unfinished},
    teachers::TeacherPlan,
    workload::{ALPHA, JobArgs, Prepared, TEMPERATURE, Workload},
};
use anyhow::{Context, Result};
use edl_host_gpu::comm::auth::Secret;
use edl_plugin_sdk::Hyperparams;
use edl_runtime::{
    coordinator::{self, report::Report},
    job::{Job, JobConfig, JobDirs, JobPlugins, JobSpec, TeacherSource, ps_servers::PsStart},
    net,
    observe::{self, Watch, WatchAccess},
    plugin::{AdapterPlugin, PluginHost, PolicyPlugin},
    scalers::{
        CommandScaler, ExternalWorkers, LocalProcesses, Scaler, kubernetes::KubernetesScaler,
        relay::HostRelay, slurm::SlurmScaler,
    },
};
use std::{
    path::{Path, PathBuf},
    process::ExitCode,
    sync::Arc,
    time::Duration,
};

/// Starts the teachers and the parameter servers the job serves itself.
fn start_servers(
    mut job: Job,
    teachers: Option<edl_runtime::job::TeacherStart>,
    args: &JobArgs,
    dirs: &JobDirs,
    exe: &Path,
) -> Result<Job> {
    if let Some(start) = teachers {
        job = job.start_teachers(dirs, start, &mut |i, addr| println!("teacher   {i} serving on {addr}"))?;
    }
    let p = &args.ps;
    if p.ps_servers == 0 {
        return Ok(job);
    }
    let c = &args.cluster;
    let at = net::Addresses { listen: c.listen, advertise: c.advertise.clone(), ..Default::default() };
    let start = PsStart {
        count: p.ps_servers,
        memory_mib: p.ps_memory_mib,
        staleness: p.ps_staleness,
        replicas: p.ps_replicas,
        min: p.min_ps.unwrap_or(1).max(p.ps_replicas as u32),
        max: p.max_ps.unwrap_or(p.ps_servers),
        exe: exe.to_path_buf(),
        listen: c.listen.ip(),
        advertise: at.advertised_host()?,
        command: ps_command(p, c),
        kube: ps_kube(p, c),
    };
    let job = job.start_ps(dirs, &start)?;
    let bound = match p.ps_memory_mib {
        0 => String::new(),
        m => format!(", at most {m} MiB of rows"),
    };
    for s in &job.ps_servers().servers {
        println!("ps        {} serving on {}{bound}", s.id, s.addr);
    }
    Ok(job)
}

/// The port servers on other hosts serve on by default.
const PS_PORT: u16 = 8300;

/// Under `--scaler kubernetes` (and no `--ps-command`): each server a Pod
/// of its own, made as the workers' are.
pub(super) fn ps_kube(
    p: &super::flags::PsArgs,
    c: &ClusterArgs,
) -> Option<edl_runtime::job::ps_kube::KubePsSpec> {
    if c.scaler != ScalerKind::Kubernetes || p.ps_command.is_some() {
        return None;
    }
    let o = c.kube.options();
    Some(edl_runtime::job::ps_kube::KubePsSpec {
        image: p.ps_kube_image.clone().unwrap_or(o.image),
        secret: o.secret,
        port: p.ps_port.unwrap_or(PS_PORT),
        resources: p.ps_kube_resource.clone(),
        node_selector: p.ps_kube_node_selector.clone(),
        namespace: o.namespace,
        owner: o.owner,
        pod_name: o.pod_name,
        ready_within: o.pending_bound,
    })
}

/// The servers' command: the operator's (`--ps-command`), or under
/// `--scaler slurm` the job's own, `srun` placing each server as a Slurm
/// job of its own (in the workers' partition, account and QOS; not with
/// the workers' `--slurm-arg`s, which may ask for a GPU or a whole node).
fn ps_command(p: &super::flags::PsArgs, c: &ClusterArgs) -> Option<edl_runtime::job::ps_servers::PsCommand> {
    use edl_runtime::job::ps_servers::PsCommand;
    if let Some(start) = p.ps_command.clone() {
        return Some(PsCommand { start, hosts: p.ps_hosts.clone(), port: p.ps_port.unwrap_or(PS_PORT) });
    }
    (c.scaler == ScalerKind::Slurm && p.ps_servers > 0).then(|| PsCommand {
        start: srun_server(&c.slurm.options()),
        hosts: Vec::new(),
        port: 0,
    })
}

/// The `srun` line a server runs by under `--scaler slurm`: one task, named
/// `edl-<job>-ps-<id>` (as the workers' batch jobs are `edl-<job>-<id>`), a
/// job of its own even from inside an allocation: srun is run with no
/// `SLURM_*` variable but `SLURM_CONF` (an allocation's id would make the
/// server a step of it, and its resources, GPUs or memory, srun's
/// defaults), and the server gets no more than `PATH` and `HOME`.
fn srun_server(o: &edl_runtime::scalers::slurm::SlurmOptions) -> String {
    let mut line = String::from(
        "env -i PATH=\"$PATH\" HOME=\"$HOME\" ${{SLURM_CONF:+SLURM_CONF=\"$SLURM_CONF\"}} \
         srun --ntasks=1 --nodes=1 --job-name=edl-{job}-ps-{id}",
    );
    for (flag, v) in [("partition", &o.partition), ("account", &o.account), ("qos", &o.qos)] {
        if let Some(v) = v {
            // Quoted for `sh`; their braces are theirs, not placeholders.
            let w = format!("--{flag}={v}");
            let w = shlex::try_quote(&w).map_or_else(|_| w.clone(), |q| q.into_owned());
            line.push(' ');
            line.push_str(&w.replace('{', "{{").replace('}', "}}"));
        }
    }
    line + " {program}"
}

/// Refuses parameter-server flags that do not fit together, before anything starts.
pub(super) fn check_ps(p: &super::flags::PsArgs, cluster: &ClusterArgs) -> Result<()> {
    if let Some(c) = ps_command(p, cluster) {
        let slots = c.slots()?.len();
        let most = p.max_ps.unwrap_or(p.ps_servers);
        if p.ps_servers == 0 {
            edl_runtime::refuse!("--ps-command starts the servers --ps-servers N asks for; give it");
        }
        if !c.placed() && most as usize > slots {
            edl_runtime::refuse!("--ps-hosts has {slots} slot(s) for servers; the job may start {most}");
        }
    }
    let for_pods =
        p.ps_kube_image.is_some() || !p.ps_kube_resource.is_empty() || !p.ps_kube_node_selector.is_empty();
    if for_pods && ps_kube(p, cluster).is_none() {
        edl_runtime::refuse!(
            "--ps-kube-image, --ps-kube-resource and --ps-kube-node-selector are for servers in Pods (--scaler kubernetes)"
        );
    }
    match p.ps_port {
        Some(_) if p.ps_command.is_none() && ps_kube(p, cluster).is_none() => {
            edl_runtime::refuse!(
                "--ps-port is for servers started by --ps-command or in Pods (--scaler kubernetes); those beside the coordinator take free ports"
            )
        }
        Some(0) if ps_kube(p, cluster).is_some() => {
            edl_runtime::refuse!(
                "--ps-port 0: a server Pod serves on a port fixed ahead, where the job reaches it"
            )
        }
        _ => {}
    }
    if p.ps_servers == 0 {
        if p.ps_replicas != 1
            || p.ps_memory_mib != 0
            || p.ps_staleness != 0
            || p.max_ps.is_some()
            || p.min_ps.is_some()
            || p.ps_port.is_some()
            || for_pods
        {
            edl_runtime::refuse!(
                "--ps-replicas, --ps-memory-mib, --ps-staleness, --min-ps, --max-ps, --ps-port and --ps-kube-* are for the servers --ps-servers N starts"
            );
        }
        return Ok(());
    }
    if !(1..=2).contains(&p.ps_replicas) || p.ps_replicas as u32 > p.ps_servers {
        edl_runtime::refuse!(
            "--ps-replicas {}: 1 or 2, and at most --ps-servers ({})",
            p.ps_replicas,
            p.ps_servers
        );
    }
    if let Some(max) = p.max_ps
        && max < p.ps_servers
    {
        edl_runtime::refuse!("--max-ps {max} is below --ps-servers {}", p.ps_servers);
    }
    if let Some(min) = p.min_ps
        && !(1..=p.ps_servers).contains(&min)
    {
        edl_runtime::refuse!("--min-ps {min}: at least 1, and at most --ps-servers ({})", p.ps_servers);
    }
    Ok(())
}

/// Runs a job to its end and prints its summary.
pub fn run(host: &Arc<PluginHost>, name: String, args: JobArgs, work: Workload) -> Result<ExitCode> {
    let transform = match &work {
        Workload::Builtin(s) => Some(&s.transform),
        Workload::Program { .. } => None,
    };
    check_ps(&args.ps, &args.cluster)?;
    super::summary::check_outputs(&args.output)?;
    let plugins = Plugins::load(host, &args.plugins, transform)?;
    let dirs = JobDirs::new(&name, args.state.checkpoint_dir.clone());
    let exe = std::env::current_exe().context("locating edl-runtime")?;
    let work = Prepared::new(work)?;
    work.check(args.training.seed, args.ps.ps_servers)?;
    let distill = work.distills(&args.distillation);
    let teachers = TeacherPlan::new(host, &args, &name, &work, distill, &dirs)?;
    let spec = job_spec(host, &name, &args, &work, &dirs, plugins.transform.as_deref(), teachers.source)?;
    let cfg = job_config(&args, spec, &dirs)?;
    let checkpoint_dir = cfg.spec.checkpoint_dir.clone();
    let scaler = scaler(&args.cluster, &exe, &dirs.log_dir, work.command(), cfg.spec.worker_lease_ms)?;
    let header = header(&name, &args, &work, &plugins);
    let watch = watch(&args.watch, &name, &plugins.policy_name, args.training.epochs, work.rows() as u64)?;
    let Plugins { policy, policy_name, adapter, adapter_name, .. } = plugins;
    let job_plugins = JobPlugins { policy, adapter };
    let secret_file = args.cluster.secret_file.as_deref();
    let starts_teachers = teachers.start.is_some();
    let mut job = Job::prepare(cfg, &dirs, secret_file, job_plugins, scaler, starts_teachers)?;
    let said = [Some(&header), watch.as_ref().map(|w| &w.1), teachers.pool_line.as_ref()];
    said.into_iter().flatten().for_each(|line| println!("{line}"));
    let watch = watch.map(|(w, _)| w);
    if !args.state.restart
        && let Some(done) = coordinator::finished_here(&checkpoint_dir, &name)?
    {
        return Ok(super::summary::already_finished(&done, &args.output, Some(args.training.epochs)));
    }
    job = start_servers(job, teachers.start, &args, &dirs, &exe)?;
    let mut display = ProgressDisplay::new(work.rows() as u64, args.training.epochs)?;
    let teacher_accuracy = job.teachers().accuracy().or(teachers.accuracy);
    // SIGTERM or SIGINT stops the job with notice: a checkpoint, its
    // workers stopped, its report written, exit status 143 or 130.
    edl_runtime::process::hear_stop_signals();
    let _stops = edl_runtime::process::StopsWithNotice::begin(edl_runtime::process::STOP_WITHIN);
    let board = tensorboard(args.watch.tensorboard.as_deref())?;
    let (store, device, seed) =
        (edl_runtime::store::redact(&args.state.store), work.device().to_string(), args.training.seed);
    let report_of = |outcome, student: Option<f64>| {
        let (policy, adapter) = (policy_name.clone(), adapter_name.clone());
        Report::new(
            &name,
            outcome,
            student,
            teacher_accuracy,
            distill,
            policy,
            adapter,
            &store,
            device.clone(),
            seed,
        )
    };
    let job = job.on_stall(super::summary::on_stall(&args.output, &name, &dirs.checkpoint_dir));
    let outcome = match watched_run(job, &mut display, watch, board) {
        Ok(o) => o,
        Err(u) => {
            display.finish();
            if let Some(done) = u.error.downcast_ref::<coordinator::AlreadyFinished>() {
                return Ok(super::summary::already_finished(done, &args.output, Some(args.training.epochs)));
            }
            return unfinished(u, &args.output, &name, &dirs.checkpoint_dir, |o| report_of(o, None));
        }
    };
    display.finish();
    let student = work.scores_or_none(&checkpoint_dir, &outcome);
    let mut report = report_of(outcome, student.accuracy);
    (report.student_test_auc, report.student_test_log_loss) = (student.auc, student.log_loss);
    summarize(&report, &args.output, &dirs.checkpoint_dir, &checkpoint_dir)
}

/// The job's live page and metrics, served when `--metrics-listen` asks
/// for them, and the line that says where.
fn watch(
    args: &WatchArgs,
    job: &str,
    policy: &str,
    epochs: u64,
    rows: u64,
) -> Result<Option<(Watch, String)>> {
    let Some(addr) = args.metrics_listen else { return Ok(None) };
    let token = super::flags::read_token(args.metrics_token_file.as_deref(), "--metrics-token-file")?;
    let tls = match (&args.metrics_tls_cert, &args.metrics_tls_key) {
        (Some(c), Some(k)) => Some((
            std::fs::read(c).with_context(|| format!("--metrics-tls-cert {}", c.display()))?,
            std::fs::read(k).with_context(|| format!("--metrics-tls-key {}", k.display()))?,
        )),
        _ => None,
    };
    let w = Watch::new(job, policy, epochs, rows);
    let at = observe::serve(addr, w.clone(), WatchAccess { token, tls }).map_err(|e| match e {
        observe::ServeError::InClear(_) => {
            anyhow::Error::new(edl_runtime::job::config::Refused(e.to_string()))
        }
        e => e.into(),
    })?;
    Ok(Some((w, format!("watch     {} (Prometheus metrics at {}metrics)", at.url(), at.url()))))
}

/// Runs the job, its progress shown by `display` and recorded by the
/// watch and the event file where there are.
fn watched_run(
    job: Job,
    display: &mut ProgressDisplay,
    watch: Option<Watch>,
    mut board: Option<observe::tensorboard::TensorBoard>,
) -> Result<coordinator::JobOutcome, coordinator::Unfinished> {
    let outcome = coordinator::run_recorded(job, &mut |p| {
        if let Some(w) = &watch {
            w.record(&p);
        }
        if let Some(b) = board.as_mut() {
            b.record(&p);
        }
        display.show(p)
    });
    if let Some(w) = &watch {
        w.end(match &outcome {
            Ok(_) => "finished",
            Err(u) if u.error.is::<coordinator::AlreadyFinished>() => "finished",
            Err(u) if u.error.is::<edl_runtime::process::StopSignalled>() => "stopped",
            Err(_) => "failed",
        });
    }
    outcome
}

/// The job's TensorBoard event file, when `--tensorboard DIR` asks for one.
fn tensorboard(dir: Option<&Path>) -> Result<Option<observe::tensorboard::TensorBoard>> {
    let Some(dir) = dir else { return Ok(None) };
    let board = observe::tensorboard::TensorBoard::create(dir)
        .with_context(|| format!("--tensorboard {}: cannot write an event file there", dir.display()))?;
    println!("tensorboard {} (tensorboard --logdir {})", board.path().display(), dir.display());
    Ok(Some(board))
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

/// What every worker is told about the job.
fn job_spec(
    host: &PluginHost,
    name: &str,
    args: &JobArgs,
    work: &Prepared,
    dirs: &JobDirs,
    transform: Option<&Path>,
    teachers: Option<TeacherSource>,
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
        teachers,
        teacher_model_name: "teacher".into(),
        transform: match transform {
            Some(p) => Some(edl_runtime::job::spec::ShippedPlugin::read(p)?),
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
        protocol: edl_runtime::control::proto::PROTOCOL,
        ps: None,
    })
}

/// How the coordinator runs the job.
fn job_config(args: &JobArgs, spec: JobSpec, dirs: &JobDirs) -> Result<JobConfig> {
    let (s, t, c, l) = (&args.scaling, &args.training, &args.cluster, &args.liveness);
    Ok(JobConfig {
        spec,
        min_workers: s.bounds.min_workers,
        max_workers: s.bounds.max_workers,
        initial_workers: s.bounds.initial(),
        warm_spares: s.warm_spares,
        decide_every: s.decide_every_steps,
        checkpoint_every: args.state.checkpoint_every_steps,
        checkpoint_interval: Duration::from_secs(args.state.checkpoint_secs),
        hyper: Hyperparams { global_batch: t.batch, local_batch: t.batch, lr: t.lr, momentum: t.momentum },
        batch_max: t.batch_max,
        store: args.state.store.clone(),
        standby: args.state.standby,
        restart: args.state.restart,
        step_timeout: Duration::from_secs(l.step_timeout_secs),
        join_timeout: Duration::from_secs(l.join_timeout_secs.max(1)),
        loop_stall: (l.loop_stall_secs > 0).then(|| Duration::from_secs(l.loop_stall_secs)),
        max_restarts: l.max_restarts.unwrap_or(1),
        price_per_worker_hour: s.price,
        secret: job_secret(c.secret_file.as_deref(), &args.state.store, dirs)?,
        addresses: net::Addresses {
            listen: c.listen,
            rendezvous_port: c.rendezvous_port,
            advertise: c.advertise.clone(),
        },
    })
}

/// The job's secret: `--secret-file` when it exists; else the one the
/// job kept (its workers may outlive their coordinator and come back to
/// the next, a standby or a rerun), where the store is shared; else a new one.
fn job_secret(secret_file: Option<&Path>, store: &str, dirs: &JobDirs) -> Result<Secret> {
    let kept = dirs.kept_secret();
    match secret_file {
        Some(f) if f.exists() => Ok(edl_runtime::worker::session::read_secret_file(f)?),
        None if store != "memory" && kept.exists() => {
            Ok(edl_runtime::worker::session::read_secret_file(&kept)?)
        }
        _ => Ok(Secret::generate()?),
    }
}

/// What the job is, as its first lines say it.
fn header(name: &str, args: &JobArgs, work: &Prepared, plugins: &Plugins) -> String {
    let b = &args.scaling.bounds;
    let on = match work {
        Prepared::Builtin { student, .. } => format!(" on {}", student.device),
        Prepared::Program { .. } => String::new(),
    };
    let mut lines = vec![
        format!(
            "job {name:?}: {}, {} epochs, {}..{} workers{on}, store {}",
            work.describe(),
            args.training.epochs,
            b.min_workers,
            b.max_workers,
            edl_runtime::store::redact(&args.state.store)
        ),
        format!(
            "policy    {} ({}, {})",
            plugins.policy_name,
            plugins.policy_path.display(),
            plugins.policy.backend()
        ),
    ];
    if let Some(a) = &plugins.adapter_name {
        lines.push(format!("adapter   {a}"));
    }
    lines.join("\n")
}

/// The scaler `--scaler` names; `program`: the launched command, if any.
fn scaler(
    args: &ClusterArgs,
    exe: &Path,
    log_dir: &Path,
    program: Option<&[String]>,
    lease_ms: u64,
) -> Result<Box<dyn Scaler>> {
    let (stop, hosts) = (args.worker_stop_command.as_deref(), &args.hosts[..]);
    if args.relay && matches!(args.scaler, ScalerKind::External) {
        edl_runtime::refuse!(
            "--relay is for --scaler local (its workers on this host), --scaler command (a relay on each of \
             --hosts), --scaler slurm and --scaler kubernetes (a relay on each node the workers run on)"
        );
    }
    let relayed = |local: LocalProcesses| match args.relay {
        true => local.relayed(HostRelay::new(log_dir, Duration::from_millis(lease_ms)), exe),
        false => local,
    };
    Ok(match (args.scaler, program) {
        (ScalerKind::Local, None) => Box::new(relayed(LocalProcesses::new(exe, log_dir))),
        (ScalerKind::Local, Some(command)) => Box::new(relayed(LocalProcesses::program(command, log_dir)?)),
        (ScalerKind::Command, program) => {
            let start = args.worker_command.as_deref().context("--scaler command needs --worker-command")?;
            let scaler = match program {
                None => CommandScaler::new(start, stop, hosts, exe, log_dir)?,
                Some(command) => CommandScaler::for_program(start, stop, hosts, log_dir, command)?,
            };
            Box::new(match args.relay {
                true => scaler.with_relays(exe, Duration::from_millis(lease_ms))?,
                false => scaler,
            })
        }
        (ScalerKind::Slurm, program) => {
            let scaler = match program {
                None => SlurmScaler::new(args.slurm.options(), exe.to_path_buf(), log_dir.to_path_buf()),
                Some(command) => {
                    SlurmScaler::for_program(args.slurm.options(), log_dir.to_path_buf(), command)
                }
            };
            Box::new(match args.relay {
                true => scaler.with_relays(exe.to_path_buf(), Duration::from_millis(lease_ms)),
                false => scaler,
            })
        }
        (ScalerKind::Kubernetes, program) => {
            let scaler = match program {
                None => KubernetesScaler::new(args.kube.options(), log_dir)?,
                Some(command) => KubernetesScaler::for_program(args.kube.options(), log_dir, command)?,
            };
            Box::new(match args.relay {
                true => scaler.with_relays(Duration::from_millis(lease_ms)),
                false => scaler,
            })
        }
        (ScalerKind::External, _) => Box::new(ExternalWorkers),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn servers_under_slurm_run_by_srun_in_the_workers_partition_without_their_extra_options() {
        let o = edl_runtime::scalers::slurm::SlurmOptions {
            partition: Some("gpu {a}".into()),
            account: None,
            qos: Some("low".into()),
            extra: vec!["--gres=gpu:1".into()],
            pending_bound: Duration::from_secs(60),
        };
        let line = srun_server(&o);
        assert_eq!(
            line,
            "env -i PATH=\"$PATH\" HOME=\"$HOME\" ${{SLURM_CONF:+SLURM_CONF=\"$SLURM_CONF\"}} srun \
             --ntasks=1 --nodes=1 --job-name=edl-{job}-ps-{id} '--partition=gpu {{a}}' '--qos=low' {program}"
        );
        // As the job fills it: its placeholders only, the operator's braces kept.
        let c = edl_runtime::job::ps_servers::PsCommand { start: line, hosts: Vec::new(), port: 0 };
        assert!(c.placed() && c.slots().unwrap().is_empty());
    }
}
