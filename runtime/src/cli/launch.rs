//! `edl-runtime launch`: the user's own program as the job's workers, or,
//! with `--torchrun`, an unmodified torchrun script restarted as a group.

use super::{
    flags::{ScalerKind, secs},
    job::{self, JobArgs, Workload},
};
use anyhow::{Context, Result, bail};
use clap::Args;
use edl_runtime::{
    job::{
        JobLock,
        torchrun::{self, Event as TorchrunEvent, TorchrunConfig},
    },
    plot,
    plugin::PluginHost,
};
use std::{path::PathBuf, process::ExitCode, sync::Arc};

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
];

#[derive(Args)]
pub struct LaunchArgs {
    /// The job's samples: steps hand each worker indices in 0..N (not with --torchrun).
    #[arg(long, value_name = "N", required_unless_present = "torchrun", help_heading = "Your program")]
    pub samples: Option<usize>,
    /// Job name: its keys in the store and its directories under .edl/.
    #[arg(long, value_name = "NAME", default_value = "launch", help_heading = "Your program")]
    pub job: String,
    /// Run an unmodified torchrun script: its ranks get torchrun's
    /// environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) and the whole group
    /// restarts when the policy changes its size or a rank fails.
    #[arg(long, help_heading = "torchrun")]
    pub torchrun: bool,
    /// With --torchrun: group restarts after rank failures before the job
    /// gives up (resizes do not count).
    #[arg(long, value_name = "N", default_value_t = 3, requires = "torchrun", help_heading = "torchrun")]
    pub max_restarts: u32,
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
    #[command(flatten)]
    pub run: JobArgs,
    /// The program and its arguments, run as each worker.
    #[arg(last = true, required = true, value_name = "CMD", help_heading = "Your program")]
    pub command: Vec<String>,
}

/// Runs `launch`, with or without `--torchrun`.
pub fn run(host: &Arc<PluginHost>, l: LaunchArgs) -> Result<ExitCode> {
    if l.torchrun {
        return torchrun(host, l);
    }
    let samples = l.samples.context("--samples is required without --torchrun")?;
    if let Some(t) = &l.run.distillation.teachers {
        t.endpoints("launch")?;
    }
    job::run(host, l.job, l.run, Workload::Program { samples, command: l.command })
}

/// `launch --torchrun`: an unmodified torchrun script, restarted as a group.
/// The flags it does not use were refused when the command line was read.
fn torchrun(host: &Arc<PluginHost>, l: LaunchArgs) -> Result<ExitCode> {
    let args = &l.run;
    if args.cluster.scaler != ScalerKind::Local {
        bail!(
            "--torchrun runs its group on this host: --scaler {:?} is for jobs without --torchrun",
            args.cluster.scaler
        );
    }
    let job_dir = PathBuf::from(".edl").join(&l.job);
    let cfg = torchrun_config(&l, &job_dir)?;
    let (mut policy, policy_name, policy_path) = job::load_policy(host, &args.plugins)?;
    let lock_dir = std::path::absolute(job_dir.join("checkpoints"))?;
    let _lock = JobLock::acquire(&lock_dir, &l.job)?;
    println!(
        "job {:?}: torchrun script {:?}, {}..{} ranks on this host, up to {} restarts",
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
    let outcome = torchrun::run(&cfg, policy.as_mut(), &mut |e| match e {
        TorchrunEvent::Started(g) => println!(
            "group     {}: {} ranks, restart {}/{}, master {}:{}, logs {}",
            g.group,
            g.world,
            g.restart_count,
            cfg.max_restarts,
            cfg.master_addr,
            g.master_port,
            g.log_dir.display()
        ),
        TorchrunEvent::Output { rank, line } => println!("[rank{rank}]: {line}"),
        TorchrunEvent::Restarting { reason, failure: true } => println!("restart   {reason}"),
        TorchrunEvent::Restarting { reason, failure: false } => println!("scale     {reason}"),
        TorchrunEvent::PolicyFailed(n) => println!("note      {n}"),
    })?;
    let resizes = outcome.groups.iter().filter(|g| g.ended.starts_with("resized")).count();
    if let Some(out) = &args.output.report {
        let report = serde_json::json!({
            "job": l.job,
            "mode": "torchrun",
            "status": if outcome.failure.is_none() { "succeeded" } else { "failed" },
            "policy": policy_name,
            "resizes": resizes,
            "outcome": outcome,
        });
        std::fs::write(out, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("{}", out.display()))?;
    }
    if let Some(out) = &args.output.plot {
        let title = format!("{} (torchrun) with {policy_name}", l.job);
        plot::policy_run(out, &title, &outcome.decisions, false)?;
    }
    match outcome.failure {
        None => {
            println!(
                "done      every rank succeeded in {:.1} s: {} groups, {resizes} resizes, {} restarts",
                outcome.secs,
                outcome.groups.len(),
                outcome.restarts
            );
            Ok(ExitCode::SUCCESS)
        }
        Some(f) => {
            eprintln!("error: {f}");
            eprintln!("       no restart left ({} of {} used)", outcome.restarts, outcome.max_restarts);
            Ok(ExitCode::from(f.exit.launcher_code()))
        }
    }
}

fn torchrun_config(l: &LaunchArgs, job_dir: &std::path::Path) -> Result<TorchrunConfig> {
    let b = &l.run.scaling.bounds;
    let mut cfg = TorchrunConfig::new(&l.job, l.command.clone(), job_dir.join("logs"));
    cfg.min_workers = b.min_workers;
    cfg.max_workers = b.max_workers;
    cfg.initial_workers = b.initial();
    cfg.max_restarts = l.max_restarts;
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
