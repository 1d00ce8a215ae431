//! `edl-runtime launch`: the user's own program as the job's workers, or,
//! with `--torchrun`, an unmodified torchrun script restarted as a group.

use super::{
    flags::{ScalerKind, secs},
    job,
    workload::{JobArgs, Workload},
};
use anyhow::{Context, Result, bail};
use clap::Args;
use edl_runtime::{
    job::JobLock,
    net::Addresses,
    plot,
    plugin::PluginHost,
    scalers::{CommandScaler, ExternalWorkers, Scaler},
    torchrun::{self, GroupEvent as TorchrunEvent, HostsConfig, Lead, TorchrunConfig, TorchrunOutcome},
    worker::session::{JobAuth, Secret},
};
use std::{
    path::{Path, PathBuf},
    process::ExitCode,
    sync::Arc,
    time::Duration,
};

/// The flags `launch --torchrun` takes, by argument id: the script runs its
/// own training loop, so the job's training, distillation, checkpoint,
/// store and cluster flags do not apply to it.
pub const TORCHRUN_FLAGS: &[&str] = &[
    "torchrun",
    "max_restarts",
    "decide_secs",
    "stop_grace_secs",
    "job",
    "policy",
    "policy_config",
    "min_workers",
    "max_workers",
    "workers",
    "price",
    "scaler",
    "report",
    "plot",
    "command",
    // Across hosts: an agent per host.
    "nproc_per_node",
    "listen",
    "advertise",
    "worker_command",
    "worker_stop_command",
    "hosts",
    "secret_file",
    "worker_lease_secs",
    "join_timeout_secs",
    // Across hosts with a shared store: the group outlives its launcher.
    "store",
    "standby",
    "restart",
    "worker_reconnect_secs",
];

#[derive(Args)]
pub struct LaunchArgs {
    /// The job's samples: steps hand each worker indices in 0..N (not with
    /// --torchrun). Default: as many as the program's data set holds (its
    /// first worker declares len(dataset); edl.torch.ElasticLoader does).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..), help_heading = "Your program")]
    pub samples: Option<u64>,
    /// Job name: its keys in the store and its directories under .edl/.
    #[arg(long, value_name = "NAME", default_value = "launch", value_parser = super::flags::job_name, help_heading = "Your program")]
    pub job: String,
    /// Run an unmodified torchrun script: its ranks get torchrun's
    /// environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) and the whole group
    /// restarts when the policy changes its size or a rank fails.
    #[arg(long, help_heading = "torchrun")]
    pub torchrun: bool,
    /// With --torchrun: seconds between two scaling-policy decisions (each
    /// resize restarts the group, so not too often).
    #[arg(
        long,
        value_name = "SECS",
        default_value_t = 30.0,
        requires = "torchrun",
        help_heading = "torchrun"
    )]
    pub decide_secs: f64,
    /// With --torchrun: seconds a stopped rank gets after SIGTERM before SIGKILL.
    #[arg(
        long,
        value_name = "SECS",
        default_value_t = 15.0,
        requires = "torchrun",
        help_heading = "torchrun"
    )]
    pub stop_grace_secs: f64,
    /// With --torchrun and --scaler command or external: ranks each host
    /// runs. The job then runs an agent per host (`edl-runtime agent`) and
    /// --min-workers / --max-workers count hosts.
    #[arg(long, value_name = "N", requires = "torchrun", help_heading = "torchrun")]
    pub nproc_per_node: Option<u32>,
    #[command(flatten)]
    pub run: JobArgs,
    #[command(flatten)]
    pub pool: super::workload::TeacherPoolArgs,
    /// The program and its arguments, run as each worker.
    #[arg(last = true, required = true, value_name = "CMD", help_heading = "Your program")]
    pub command: Vec<String>,
}

/// Runs `launch`, with or without `--torchrun`.
pub fn run(host: &Arc<PluginHost>, l: LaunchArgs) -> Result<ExitCode> {
    if l.torchrun {
        return torchrun(host, l);
    }
    // 0: the program's first worker declares them.
    let samples = l.samples.unwrap_or(0) as usize;
    // A number of teachers is the job's to start, by --teacher-command.
    if let Some(t) = &l.run.distillation.teachers
        && l.pool.teacher_command.is_none()
    {
        t.endpoints("launch")?;
    }
    let pool = Box::new(l.pool);
    job::run(host, l.job, l.run, Workload::Program { samples, command: l.command, pool })
}

/// `launch --torchrun`: an unmodified torchrun script, restarted as a group.
/// The flags it does not use were refused when the command line was read.
fn torchrun(host: &Arc<PluginHost>, l: LaunchArgs) -> Result<ExitCode> {
    let args = &l.run;
    super::summary::check_outputs(&args.output)?;
    let across = args.cluster.scaler != ScalerKind::Local;
    let job_dir = PathBuf::from(".edl").join(&l.job);
    let cfg = torchrun_config(&l, &job_dir)?;
    let (mut policy, policy_name, policy_path) = job::load_policy(host, &args.plugins)?;
    let _lock = lock_torchrun_job(&l, &job_dir, across)?;
    let nproc = l.nproc_per_node.unwrap_or(1);
    let (unit, place) =
        if across { ("hosts", format!(" of {nproc} ranks")) } else { ("ranks", " on this host".into()) };
    println!(
        "job {:?}: torchrun script {:?}, {}..{} {unit}{place}, up to {} restarts",
        l.job,
        cfg.command.join(" "),
        cfg.min_workers,
        cfg.max_workers,
        cfg.max_restarts
    );
    println!(
        "policy    {policy_name} ({}, {}), deciding every {:.1} s",
        policy_path.display(),
        policy.backend(),
        cfg.decide_every.as_secs_f64()
    );
    let mut on = |e: TorchrunEvent| print_torchrun_event(e, cfg.max_restarts);
    // SIGTERM or SIGINT stops the group with notice, writes the report and
    // exits 143 or 130.
    edl_runtime::process::hear_stop_signals();
    let _stops = edl_runtime::process::StopsWithNotice::begin(cfg.grace + Duration::from_secs(15));
    let outcome = if across {
        let (hc, mut scaler) = hosts_config(&l, &job_dir, nproc)?;
        match torchrun::run_hosts(&cfg, hc, scaler.as_mut(), policy.as_mut(), &mut on) {
            Err(e) => match e.downcast_ref::<edl_runtime::coordinator::AlreadyFinished>() {
                Some(done) => return Ok(super::summary::already_finished(done, &args.output, None)),
                None => return Err(e),
            },
            Ok(outcome) => outcome,
        }
    } else {
        torchrun::run(&cfg, policy.as_mut(), &mut on)?
    };
    let resizes = outcome.groups.iter().filter(|g| g.ended.starts_with("resized")).count();
    if let Some(out) = &args.output.report {
        write_torchrun_report(out, &l.job, &policy_name, resizes, &outcome)?;
    }
    if let Some(out) = &args.output.plot {
        let title = format!("{} (torchrun) with {policy_name}", l.job);
        plot::torchrun_run(out, &title, &outcome.groups)?;
    }
    Ok(torchrun_exit(outcome, resizes))
}

/// Takes the job's lock on this machine (see [`JobLock::acquire`]), after
/// checking that a --standby launcher has a shared store to meet in.
fn lock_torchrun_job(l: &LaunchArgs, job_dir: &Path, across: bool) -> Result<JobLock> {
    let state = &l.run.state;
    let lock_dir = std::path::absolute(job_dir.join("checkpoints"))?;
    // A group on this host ends with its launcher (--store and --standby
    // were refused there; $EDL_STORE is not its).
    let shared = across && state.store != "memory";
    if state.standby && !shared {
        edl_runtime::refuse!(
            "--standby needs a shared --store (redis://..., etcd://...): the launchers meet there"
        );
    }
    JobLock::acquire(&lock_dir, &l.job, state.standby, shared)
}

/// Prints what the group does, a line each.
fn print_torchrun_event(e: TorchrunEvent, max_restarts: u32) {
    match e {
        TorchrunEvent::Started(g) => {
            let hosts =
                if g.hosts.is_empty() { String::new() } else { format!(" on {}", g.hosts.join(", ")) };
            println!(
                "group     {}: {} ranks{hosts}, restart {}/{}, store {}:{} (sealed), logs {}",
                g.group,
                g.world,
                g.restart_count,
                max_restarts,
                g.master_addr,
                g.master_port,
                g.log_dir.display()
            )
        }
        TorchrunEvent::Output { rank, line } => println!("[rank{rank}]: {line}"),
        TorchrunEvent::Restarting { reason, failure: true } => println!("restart   {reason}"),
        TorchrunEvent::Restarting { reason, failure: false } => println!("scale     {reason}"),
        TorchrunEvent::PolicyFailed(n) => println!("note      {n}"),
        TorchrunEvent::Host(n) => println!("host      {n}"),
    }
}

/// Writes the `--report` of a torchrun job (JSON).
fn write_torchrun_report(
    out: &Path,
    job: &str,
    policy_name: &str,
    resizes: usize,
    outcome: &TorchrunOutcome,
) -> Result<()> {
    let report = serde_json::json!({
        "job": job,
        "mode": "torchrun",
        "status": match (&outcome.failure, outcome.stopped_by) {
            (_, Some(_)) => "stopped",
            (None, None) => "succeeded",
            (Some(_), None) => "failed",
        },
        "policy": policy_name,
        "resizes": resizes,
        "outcome": outcome,
    });
    super::summary::replace_file(out, &serde_json::to_vec_pretty(&report)?)
}

/// Says how the job ended; the exit code is the failed rank's, as torchrun's.
fn torchrun_exit(outcome: TorchrunOutcome, resizes: usize) -> ExitCode {
    if let Some(signal) = outcome.stopped_by {
        eprintln!(
            "stopped by {}: the group's ranks were stopped with notice after {:.1} s",
            edl_runtime::process::signal_name(signal),
            outcome.secs
        );
        return ExitCode::from(u8::try_from(128 + signal).unwrap_or(1));
    }
    match outcome.failure {
        None => {
            println!(
                "done      every rank succeeded in {:.1} s: {} groups, {resizes} resizes, {} restarts",
                outcome.secs,
                outcome.groups.len(),
                outcome.restarts
            );
            ExitCode::SUCCESS
        }
        Some(f) => {
            eprintln!("error: {f}");
            eprintln!("       no restart left ({} of {} used)", outcome.restarts, outcome.max_restarts);
            ExitCode::from(f.exit.launcher_code())
        }
    }
}

/// How the launcher meets its agents across hosts, and the scaler that starts them.
fn hosts_config(l: &LaunchArgs, job_dir: &Path, nproc: u32) -> Result<(HostsConfig, Box<dyn Scaler>)> {
    let c = &l.run.cluster;
    let secret = match &c.secret_file {
        Some(f) if f.exists() => edl_runtime::worker::session::read_secret_file(f)?,
        f => {
            let s = Secret::generate()?;
            s.write(&f.clone().unwrap_or_else(|| job_dir.join("secret")))?;
            s
        }
    };
    let log_dir = job_dir.join("logs");
    let scaler: Box<dyn Scaler> = match c.scaler {
        ScalerKind::Command => {
            let start = c.worker_command.as_deref().context("--scaler command needs --worker-command")?;
            let exe = std::env::current_exe().context("finding edl-runtime's own path for the agents")?;
            Box::new(CommandScaler::for_agents(
                start,
                c.worker_stop_command.as_deref(),
                &c.hosts,
                exe,
                &log_dir,
            )?)
        }
        ScalerKind::Slurm | ScalerKind::Kubernetes => bail!(
            "launch --torchrun does not take --scaler slurm or kubernetes yet: give --scaler command an \
             srun or kubectl template (`srun -N1 -n1 -w {{host}} {{program}}`), or start the agents yourself \
             (--scaler external)"
        ),
        _ => Box::new(ExternalWorkers),
    };
    let hc = HostsConfig {
        nproc,
        addresses: Addresses { listen: c.listen, rendezvous_port: 0, advertise: c.advertise.clone() },
        auth: JobAuth { job: l.job.clone(), secret },
        lease: Duration::from_secs(l.run.liveness.worker_lease_secs.max(1)),
        join_timeout: Duration::from_secs(l.run.liveness.join_timeout_secs.max(1)),
        lead: (l.run.state.store != "memory").then(|| Lead {
            store: l.run.state.store.clone(),
            standby: l.run.state.standby,
            restart: l.run.state.restart,
            reconnect: Duration::from_secs(l.run.liveness.worker_reconnect_secs),
        }),
    };
    Ok((hc, scaler))
}

fn torchrun_config(l: &LaunchArgs, job_dir: &std::path::Path) -> Result<TorchrunConfig> {
    let b = &l.run.scaling.bounds;
    let mut cfg = TorchrunConfig::new(&l.job, l.command.clone(), job_dir.join("logs"));
    cfg.min_workers = b.min_workers;
    cfg.max_workers = b.max_workers;
    cfg.initial_workers = b.initial();
    cfg.max_restarts = l.run.liveness.max_restarts.unwrap_or(3);
    cfg.decide_every = secs(l.decide_secs, "decide-secs")?;
    cfg.grace = secs(l.stop_grace_secs, "stop-grace-secs")?;
    cfg.price_per_worker_hour = l.run.scaling.price;
    if cfg.min_workers == 0 || cfg.min_workers > cfg.max_workers {
        bail!(
            "--min-workers {} and --max-workers {}: expected 1 <= min <= max",
            cfg.min_workers,
            cfg.max_workers
        );
    }
    Ok(cfg)
}
