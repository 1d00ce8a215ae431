//! `edl-runtime ps`: one parameter server of a job's sparse tables. The job
//! starts its servers itself (`--ps-servers N`); another engine (ssh, srun)
//! may run this on other hosts.

use super::flags::listen_on;
use anyhow::{Context, Result};
use clap::Args;
use edl_runtime::ps::{Server, Service};
use std::{
    io::Write,
    net::SocketAddr,
    path::PathBuf,
    process::ExitCode,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::{Duration, Instant},
};

#[derive(Args)]
pub struct PsArgs {
    /// This server's id: the job places shards by it, so ids are unique in a job.
    #[arg(long, value_name = "N")]
    pub(super) id: u64,
    /// Address to serve on, with or without a port (without: 8300; port 0
    /// picks a free one).
    #[arg(long, value_name = "ADDR[:PORT]", default_value = "127.0.0.1:8300", value_parser = listen_on(8300))]
    pub(super) listen: SocketAddr,
    /// The job's name (default: $EDL_JOB).
    #[arg(long, value_name = "NAME", value_parser = super::flags::job_name)]
    pub(super) job: Option<String>,
    /// A file holding the job's secret, or `-` for standard input (default:
    /// $EDL_JOB_SECRET): its first line; the server then stops when its
    /// standard input closes. Never give the secret itself on a command line.
    #[arg(long, value_name = "FILE")]
    pub(super) secret_file: Option<PathBuf>,
    /// Most memory the rows of all tables may take, MiB (0: no bound). New
    /// rows past it are refused, naming the table; old ones keep being served.
    #[arg(long, value_name = "MIB", default_value_t = 0)]
    pub(super) memory_mib: u64,
    /// Longest a pull waits for the pushes of the steps before it, seconds.
    #[arg(long, value_name = "SECS", default_value_t = 300)]
    pull_timeout_secs: u64,
    /// Say where it serves as this host's address on its route to HOST
    /// (the job's coordinator), for a server listening on every interface
    /// on a host the job did not choose (placed by Slurm's srun).
    #[arg(long, value_name = "HOST")]
    advertise_toward: Option<String>,
}

/// Serves until the process is stopped.
pub fn run(a: PsArgs) -> Result<ExitCode> {
    let auth = super::flags::job_auth(a.secret_file.as_deref(), a.job.clone())?;
    if a.secret_file.as_deref() == Some(std::path::Path::new("-")) {
        super::flags::stop_when_stdin_closes(format!("ps {}", a.id), "server");
    }
    let listener =
        edl_host_gpu::comm::listen::listen(a.listen).with_context(|| format!("listening on {}", a.listen))?;
    let bound = (a.memory_mib > 0).then_some(a.memory_mib << 20);
    let service =
        Service::start(listener, auth, Server::new(a.id, bound), Duration::from_secs(a.pull_timeout_secs))?;
    let bound = match a.memory_mib {
        0 => "no memory bound".to_string(),
        m => format!("at most {m} MiB of rows"),
    };
    // The job reads this line for the address (a port of 0 is chosen here).
    let at = match &a.advertise_toward {
        Some(host) if service.addr().ip().is_unspecified() => {
            let ip = edl_runtime::net::routable_toward(host)?;
            SocketAddr::new(ip, service.addr().port())
        }
        _ => service.addr(),
    };
    println!("ps {} serving on {at} ({bound})", a.id);
    std::io::stdout().flush()?;
    // SIGTERM is notice: the server says so in its stats and serves on
    // while the job moves its shards elsewhere (the job then stops it); a
    // second SIGTERM, or the grace passing, ends it.
    let told = Arc::new(AtomicU32::new(0));
    let t = told.clone();
    // SAFETY: the handler only adds to an atomic (async-signal-safe).
    unsafe { signal_hook_registry::register(libc::SIGTERM, move || _ = t.fetch_add(1, Ordering::SeqCst)) }
        .context("hearing SIGTERM")?;
    let mut since: Option<Instant> = None;
    loop {
        std::thread::sleep(Duration::from_millis(50));
        match told.load(Ordering::SeqCst) {
            0 => {}
            1 => {
                let at = *since.get_or_insert_with(|| {
                    service.leave();
                    eprintln!("ps {}: told to go; serving on while the job moves its shards", a.id);
                    Instant::now()
                });
                if at.elapsed() >= LEAVE_GRACE {
                    eprintln!("ps {}: gone after {LEAVE_GRACE:?} of notice", a.id);
                    return Ok(ExitCode::from(143));
                }
            }
            _ => return Ok(ExitCode::from(143)),
        }
    }
}

/// Longest a server told to go serves on for its shards to move.
const LEAVE_GRACE: Duration = Duration::from_secs(60);
