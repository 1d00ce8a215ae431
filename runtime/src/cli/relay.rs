//! `edl-runtime relay`: one host's relay, through which its workers reach
//! the coordinator over a single connection (see `edl_runtime::control::relay`).
//! A job started with `--relay` runs it itself; another engine (ssh, srun)
//! may run it on other hosts and point that host's workers at it.

use super::flags::listen_on;
use anyhow::{Context, Result};
use clap::Args;
use edl_runtime::control::relay::{Relay, RelayConfig};
use std::{io::Write, net::SocketAddr, path::PathBuf, process::ExitCode, time::Duration};

#[derive(Args)]
pub struct RelayArgs {
    /// The coordinator's control port, `host:port`.
    #[arg(long, value_name = "HOST:PORT")]
    coordinator: String,
    /// Where this host's workers reach the relay (port 0: a free one; the
    /// relay prints `relay N relaying on ADDR:PORT`).
    #[arg(long, value_name = "ADDR[:PORT]", default_value = "127.0.0.1:0", value_parser = listen_on(0))]
    listen: SocketAddr,
    /// This relay's number, for the coordinator's messages.
    #[arg(long, value_name = "N", default_value_t = 1)]
    id: u64,
    /// The job's name (default: $EDL_JOB).
    #[arg(long, value_name = "NAME", value_parser = super::flags::job_name)]
    job: Option<String>,
    /// A file holding the job's secret, or `-` for standard input (default:
    /// $EDL_JOB_SECRET): its first line; the relay then stops when its
    /// standard input closes. Never give the secret itself on a command line.
    #[arg(long, value_name = "FILE")]
    secret_file: Option<PathBuf>,
    /// A worker silent for this long is closed as dead: the job's
    /// `--worker-lease-secs`, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 10_000)]
    lease_ms: u64,
}

/// Relays until the coordinator's connection ends.
pub fn run(a: RelayArgs) -> Result<ExitCode> {
    let auth = super::flags::job_auth(a.secret_file.as_deref(), a.job.clone())?;
    if a.secret_file.as_deref() == Some(std::path::Path::new("-")) {
        super::flags::stop_when_stdin_closes(format!("relay {}", a.id), "relay");
    }
    let coordinator = edl_runtime::net::resolve(&a.coordinator).context("--coordinator")?;
    let lease = Duration::from_millis(a.lease_ms.max(100));
    let relay = Relay::connect(RelayConfig { coordinator, listen: a.listen, auth, lease, id: a.id })?;
    // The job reads this line for the address (a port of 0 is chosen here).
    println!("relay {} relaying on {} for {coordinator}", a.id, relay.addr()?);
    std::io::stdout().flush()?;
    let why = relay.serve()?;
    eprintln!("relay {}: {why}; stopping", a.id);
    Ok(ExitCode::SUCCESS)
}
