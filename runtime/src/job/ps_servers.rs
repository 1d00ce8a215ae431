//! The parameter servers a job starts for itself (`--ps-servers N`):
//! `edl-runtime ps` processes on the coordinator's host, each in a process
//! group of its own, told the job's secret through the environment, stopped
//! with the job.

use crate::process::{die_with_parent, log_tail, terminate_group};
use crate::worker::session::JobAuth;
use anyhow::{Context, Result, anyhow, bail};
use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::Duration,
};

/// How the job's servers start.
#[derive(Clone, Debug)]
pub struct PsStart {
    pub count: u32,
    /// Most memory each server's rows may take, MiB (0: no bound).
    pub memory_mib: u64,
    /// Steps a pull may run ahead of the pushes applied (0: every step sees
    /// the one before it).
    pub staleness: u64,
    /// Servers holding each shard.
    pub replicas: usize,
    /// Most servers: one more is started when a server's rows pass 80% of
    /// its memory bound.
    pub max: u32,
    pub exe: PathBuf,
    /// Where they listen (port 0: each takes a free one), and the host
    /// workers reach them at.
    pub listen: IpAddr,
    pub advertise: String,
}

/// One running server.
pub struct PsProcess {
    pub id: u64,
    pub addr: String,
    pub log: PathBuf,
    child: Child,
}

/// The job's servers; dropping them stops them.
#[derive(Default)]
pub struct PsServers {
    pub servers: Vec<PsProcess>,
    /// How they were started (for more of them), and where they log.
    start: Option<(PsStart, JobAuth, PathBuf)>,
    next: u64,
}

impl PsServers {
    /// Starts `start.count` servers (ids 1..=count), each logging to
    /// `log_dir/ps-<id>.log`, and waits for each to say where it serves.
    pub fn start(start: &PsStart, auth: &JobAuth, log_dir: &Path) -> Result<PsServers> {
        std::fs::create_dir_all(log_dir).with_context(|| format!("{}", log_dir.display()))?;
        let mut servers = PsServers {
            servers: Vec::new(),
            start: Some((start.clone(), auth.clone(), log_dir.to_path_buf())),
            next: 1,
        };
        servers.more(start.count)?;
        Ok(servers)
    }

    /// Starts `n` more servers (with ids after every one started before);
    /// returns their ids and addresses.
    pub fn more(&mut self, n: u32) -> Result<Vec<(u64, String)>> {
        let (start, auth, log_dir) = self.start.clone().context("no servers were started")?;
        let mut added = Vec::new();
        for _ in 0..n {
            let id = self.next;
            self.next += 1;
            let p = PsProcess::start(&start, id, &auth, &log_dir.join(format!("ps-{id}.log")))
                .with_context(|| format!("starting parameter server {id}"))?;
            added.push((p.id, p.addr.clone()));
            self.servers.push(p);
        }
        Ok(added)
    }

    /// Each server's id and address, as workers are told them.
    pub fn addrs(&self) -> Vec<(u64, String)> {
        self.servers.iter().map(|p| (p.id, p.addr.clone())).collect()
    }

    /// Stops server `id` (its shards were moved).
    pub fn stop(&mut self, id: u64) {
        self.servers.retain(|p| p.id != id);
    }

    /// How many servers run.
    pub fn len(&self) -> usize {
        self.servers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.servers.is_empty()
    }

    /// The most memory a server's rows may take, bytes (None: no bound),
    /// and the most servers there may be.
    pub fn limits(&self) -> (Option<u64>, u32) {
        let Some((s, _, _)) = self.start.as_ref() else { return (None, 0) };
        (Some(s.memory_mib << 20).filter(|b| *b > 0), s.max)
    }

    /// The servers whose process ended since last asked: their ids, and
    /// how they ended with the end of their log.
    pub fn exited(&mut self) -> Vec<(u64, String)> {
        let mut gone = Vec::new();
        self.servers.retain_mut(|p| match p.child.try_wait() {
            Ok(Some(status)) => {
                gone.push((p.id, format!("{status}{}", log_tail(&p.log, 3))));
                false
            }
            _ => true,
        });
        gone
    }
}

impl PsProcess {
    fn start(s: &PsStart, id: u64, auth: &JobAuth, log: &Path) -> Result<PsProcess> {
        let log_file = std::fs::File::create(log).with_context(|| format!("{}", log.display()))?;
        let mut said = log_file.try_clone()?;
        let mut cmd = Command::new(&s.exe);
        cmd.args([
            "ps",
            "--id",
            &id.to_string(),
            "--listen",
            &std::net::SocketAddr::new(s.listen, 0).to_string(),
        ])
        .args(["--memory-mib", &s.memory_mib.to_string()])
        .env("EDL_JOB", &auth.job)
        .env("EDL_JOB_SECRET", auth.secret.to_hex())
        .env_remove("EDL_JOB_SECRET_FILE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log_file);
        die_with_parent(&mut cmd);
        // Ctrl-C is the coordinator's to act on, as for workers and teachers.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let mut child =
            crate::process::spawn_lasting(cmd).with_context(|| format!("running {}", s.exe.display()))?;
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || super::teacher_pool::copy_output(stdout, &mut said, tx));
        let line = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(l) => l,
            Err(e) => {
                terminate_group(&mut child, Duration::from_secs(1));
                let why = match e {
                    mpsc::RecvTimeoutError::Disconnected => "it exited before serving",
                    mpsc::RecvTimeoutError::Timeout => "it did not serve within 30 s",
                };
                bail!("{why}{}", log_tail(log, 5));
            }
        };
        let port = line
            .split("serving on ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|a| a.parse::<std::net::SocketAddr>().ok())
            .map(|a| a.port())
            .ok_or_else(|| anyhow!("unexpected output {line:?} (log: {})", log.display()))?;
        let addr = crate::net::host_port(&s.advertise, port);
        Ok(PsProcess { id, addr, log: log.to_path_buf(), child })
    }
}

impl Drop for PsProcess {
    fn drop(&mut self) {
        // Its tables are in the job's checkpoints: nothing to wait for (and
        // SIGTERM alone would be notice, on which it serves on).
        terminate_group(&mut self.child, Duration::ZERO);
    }
}
