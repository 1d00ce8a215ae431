//! `edl-runtime worker`: join a job as one of its workers. The coordinator's
//! scaler starts it; another engine (ssh, srun, Kubernetes) runs it on other hosts.

use super::flags::parse_ring_listen;
use anyhow::{Context, Result};
use clap::Args;
use edl_runtime::{
    trainer::worker::{self, Join},
    worker::session::{self, JobAuth},
};
use std::{net::IpAddr, path::PathBuf, process::ExitCode};

#[derive(Args)]
pub struct WorkerArgs {
    /// The coordinator's control port, `host:port`.
    #[arg(long, value_name = "HOST:PORT")]
    coordinator: String,
    /// This worker's id (default: the coordinator gives one).
    #[arg(long, value_name = "N", default_value_t = 0)]
    id: u64,
    /// The job's name (default: $EDL_JOB, else `mnist`, the built-in job's default).
    #[arg(long, value_name = "NAME", value_parser = super::flags::job_name)]
    job: Option<String>,
    /// A file holding the job's secret, or `-` to read it from standard input
    /// (default: $EDL_JOB_SECRET). Never give the secret itself on a command line.
    #[arg(long, value_name = "FILE")]
    secret_file: Option<PathBuf>,
    /// Address this worker's ring listens on (default: the address it
    /// reaches the coordinator from); the ring takes a new port each
    /// generation, so a port, if given, must be 0.
    #[arg(long, value_name = "ADDR", value_parser = parse_ring_listen)]
    listen: Option<IpAddr>,
    /// Address the other workers reach this one's ring at (behind NAT;
    /// default: the listen address).
    #[arg(long, value_name = "ADDR")]
    advertise: Option<IpAddr>,
}

/// Joins the job and runs the steps it is given until it is told to stop.
pub fn run(w: WorkerArgs) -> Result<ExitCode> {
    worker::run(join(w)?)?;
    Ok(ExitCode::SUCCESS)
}

/// Who a worker is and how it proves it: the job's name and secret from
/// the flags, or from the environment the coordinator's scaler set.
fn join(w: WorkerArgs) -> Result<Join> {
    use edl_runtime::net::{RELAY_VAR, worker_reaches};
    let at = worker_reaches(&w.coordinator);
    let coordinator = edl_runtime::net::resolve(&at).context(if at == w.coordinator {
        "--coordinator"
    } else {
        RELAY_VAR
    })?;
    let job = w.job.or_else(|| std::env::var("EDL_JOB").ok()).unwrap_or_else(|| "mnist".into());
    edl_runtime::job::check_job_name(&job).map_err(|e| anyhow::anyhow!("{e} (--job or $EDL_JOB)"))?;
    let secret = match &w.secret_file {
        Some(p) => session::read_secret(p).context("--secret-file")?,
        None => session::auth_from_env()?.secret,
    };
    Ok(Join {
        coordinator,
        id: w.id,
        auth: JobAuth { job, secret },
        ring_listen: w.listen,
        ring_advertise: w.advertise,
    })
}
