//! `edl-runtime agent`: one host's share of a `launch --torchrun` job across
//! hosts. The launcher's `command` scaler starts it on each host (ssh, srun);
//! with `--scaler external` it is started by hand or another engine.

use anyhow::{Context, Result};
use clap::Args;
use edl_runtime::{
    torchrun::{AgentArgs, run_agent},
    worker::session::{self, JobAuth},
};
use std::{path::PathBuf, process::ExitCode};

#[derive(Args)]
pub struct AgentCliArgs {
    /// The launcher's agent port, `host:port` (it prints it: "agents join at ...").
    #[arg(long, value_name = "HOST:PORT")]
    coordinator: String,
    /// This agent's id (default: the launcher gives one).
    #[arg(long, value_name = "N", default_value_t = 0)]
    id: u64,
    /// The job's name (default: $EDL_JOB, else `launch`).
    #[arg(long, value_name = "NAME", value_parser = super::flags::job_name)]
    job: Option<String>,
    /// A file holding the job's secret, or `-` to read it from standard input
    /// (default: $EDL_JOB_SECRET). Never give the secret itself on a command line.
    #[arg(long, value_name = "FILE")]
    secret_file: Option<PathBuf>,
    /// Where the ranks' logs go (default: .edl/<job>/logs/agent-<id>).
    #[arg(long, value_name = "DIR")]
    log_dir: Option<PathBuf>,
}

/// Joins the job's launcher and runs this host's ranks until sent away.
pub fn run(a: AgentCliArgs) -> Result<ExitCode> {
    let coordinator = edl_runtime::net::resolve(&a.coordinator).context("--coordinator")?;
    let job = a.job.or_else(|| std::env::var("EDL_JOB").ok()).unwrap_or_else(|| "launch".into());
    edl_runtime::job::check_job_name(&job).map_err(|e| anyhow::anyhow!("{e} (--job or $EDL_JOB)"))?;
    let secret = match &a.secret_file {
        Some(p) => session::read_secret(p).context("--secret-file")?,
        None => session::auth_from_env()?.secret,
    };
    let log_dir = a
        .log_dir
        .unwrap_or_else(|| PathBuf::from(".edl").join(&job).join("logs").join(format!("agent-{}", a.id)));
    let reason = run_agent(AgentArgs { coordinator, id: a.id, auth: JobAuth { job, secret }, log_dir })?;
    eprintln!("agent {}: {reason}", a.id);
    Ok(ExitCode::SUCCESS)
}
