//! The parameter servers a job starts for itself (`--ps-servers N`):
//! `edl-runtime ps` processes on the coordinator's host, or started by a
//! command the operator gives on hosts of theirs (`--ps-command`, e.g.
//! `ssh {host} {program}` or `srun -w {host} {program}`), each in a
//! process group of its own, told the job's secret through the
//! environment (or the job's `--secret-file`), stopped with the job.

use crate::process::{die_with_parent, log_tail, terminate_group};
use crate::worker::session::JobAuth;
use anyhow::{Context, Result};
use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
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
    /// Fewest and most servers: one more is started when a server's rows
    /// pass 80% of its memory bound; a scaling policy may ask for any
    /// number between.
    pub min: u32,
    pub max: u32,
    pub exe: PathBuf,
    /// Where they listen (port 0: each takes a free one), and the host
    /// workers reach them at.
    pub listen: IpAddr,
    pub advertise: String,
    /// Started by the operator's command on hosts of theirs instead.
    pub command: Option<PsCommand>,
}

/// Servers started by a command on the operator's hosts (`--ps-command`).
#[derive(Clone, Debug)]
pub struct PsCommand {
    /// Starts server `{id}` on `{host}`; `{program}` is its command line.
    pub start: String,
    /// `host[:slots]` or `name=addr[:slots]` entries.
    pub hosts: Vec<String>,
    /// The port of each host's first server; its next ones take the ports after it.
    pub port: u16,
}

/// What a `--ps-command` template may name.
pub const PLACEHOLDERS: [&str; 7] = ["program", "id", "host", "addr", "port", "job", "exe"];

/// A place a server runs by command: a host's name, the address the job
/// reaches it at, and its port there.
#[derive(Clone, Debug, PartialEq)]
pub struct PsSlot {
    pub host: String,
    pub addr: String,
    pub port: u16,
}

impl PsCommand {
    /// Checks the template; the slots in the order they are handed out
    /// (across the hosts in turn).
    pub fn slots(&self) -> Result<Vec<PsSlot>> {
        if let Err(e) =
            crate::scalers::command::fill_known(&self.start, &PLACEHOLDERS, |_| (String::new(), false))
        {
            crate::refuse!("--ps-command {:?}: {e}", self.start);
        }
        let mut slots = Vec::new();
        for (host, addr, index) in crate::scalers::command::named_host_slots(&self.hosts, "--ps-hosts")? {
            let Some(port) = u16::try_from(self.port as usize + index).ok().filter(|p| *p > 0) else {
                crate::refuse!("--ps-port {}: server {index} on {host} has no port", self.port);
            };
            slots.push(PsSlot { host, addr, port });
        }
        if slots.is_empty() {
            crate::refuse!("--ps-command needs --ps-hosts (the hosts and slots servers run on)");
        }
        Ok(slots)
    }

    /// The shell line that starts server `id` on `slot` running `program`
    /// (quoted twice where the template goes through `ssh`, whose far
    /// side's shell parses the line again).
    fn line(&self, program: &[String], id: u64, slot: &PsSlot, job: &str) -> Result<String> {
        use crate::scalers::command::{quote, runs_remote_shell};
        let twice = runs_remote_shell(&self.start);
        let once = |w: &str| quote(w).unwrap_or_else(|_| w.to_string());
        let exe = program.first().cloned().unwrap_or_default();
        let program: Vec<String> = program.iter().map(|w| once(w)).collect();
        let program = program.join(" ");
        let value = |name: &str| {
            let v = match name {
                "program" => return (if twice { once(&program) } else { program.clone() }, false),
                "id" => id.to_string(),
                "host" => slot.host.clone(),
                "addr" => slot.addr.clone(),
                "port" => slot.port.to_string(),
                "job" => job.to_string(),
                _ => exe.clone(),
            };
            (if twice { once(&v) } else { v }, true)
        };
        crate::scalers::command::fill_known(&self.start, &PLACEHOLDERS, value)
    }
}

/// One running server.
pub struct PsProcess {
    pub id: u64,
    pub addr: String,
    pub log: PathBuf,
    /// Its slot among the command's (None: started here).
    slot: Option<usize>,
    child: Child,
    /// A server started by command: its standard input, held open while
    /// the job wants it (it read the job's secret there, and stops when
    /// it closes, wherever it runs).
    _held: Option<std::process::ChildStdin>,
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
        let slots = match &start.command {
            Some(c) => c.slots()?,
            None => Vec::new(),
        };
        for _ in 0..n {
            let id = self.next;
            self.next += 1;
            let slot = match &start.command {
                None => None,
                Some(_) => {
                    let taken: Vec<usize> = self.servers.iter().filter_map(|p| p.slot).collect();
                    let free = (0..slots.len()).find(|i| !taken.contains(i));
                    let free = free.with_context(|| {
                        format!("parameter server {id}: every slot of --ps-hosts ({}) is taken", slots.len())
                    })?;
                    Some((free, &slots[free]))
                }
            };
            let p = match PsProcess::start(&start, id, &auth, &log_dir.join(format!("ps-{id}.log")), slot) {
                Ok(p) => p,
                Err(e) => {
                    // All or none: those this call started are stopped.
                    self.servers.retain(|p| !added.iter().any(|(id, _)| *id == p.id));
                    return Err(e.context(format!("starting parameter server {id}")));
                }
            };
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

    /// The fewest and the most servers there may be.
    pub fn bounds(&self) -> (u32, u32) {
        self.start.as_ref().map_or((0, 0), |(s, _, _)| (s.min, s.max))
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
    /// Server `id`'s command line: on `slot` by the operator's command, or here.
    fn command(s: &PsStart, id: u64, auth: &JobAuth, slot: Option<&PsSlot>) -> Result<Command> {
        let listen = match slot {
            // Every address of the host: the slot's may be a name only the others know.
            Some(slot) => std::net::SocketAddr::from(([0, 0, 0, 0], slot.port)),
            None => std::net::SocketAddr::new(s.listen, 0),
        };
        let mut program =
            vec![s.exe.to_string_lossy().into_owned(), "ps".into(), "--id".into(), id.to_string()];
        program.extend([
            "--listen".into(),
            listen.to_string(),
            "--memory-mib".into(),
            s.memory_mib.to_string(),
        ]);
        if slot.is_some() {
            // The secret on standard input: it crosses ssh, and is on no command line.
            program.extend(["--job".into(), auth.job.clone(), "--secret-file".into(), "-".into()]);
        }
        Ok(match (&s.command, slot) {
            (Some(c), Some(slot)) => {
                let mut sh = Command::new("sh");
                sh.arg("-c").arg(c.line(&program, id, slot, &auth.job)?);
                sh
            }
            _ => {
                let mut cmd = Command::new(&program[0]);
                cmd.args(&program[1..]);
                cmd
            }
        })
    }

    fn start(
        s: &PsStart,
        id: u64,
        auth: &JobAuth,
        log: &Path,
        slot: Option<(usize, &PsSlot)>,
    ) -> Result<PsProcess> {
        let log_file = std::fs::File::create(log).with_context(|| format!("{}", log.display()))?;
        let said = log_file.try_clone()?;
        let mut cmd = Self::command(s, id, auth, slot.map(|(_, p)| p))?;
        cmd.env("EDL_JOB", &auth.job)
            .env("EDL_JOB_SECRET", auth.secret.to_hex())
            .env_remove("EDL_JOB_SECRET_FILE")
            .stdin(if slot.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(log_file);
        die_with_parent(&mut cmd);
        // Ctrl-C is the coordinator's to act on, as for workers and teachers.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let mut child =
            crate::process::spawn_lasting(cmd).with_context(|| format!("running {}", s.exe.display()))?;
        let held = child.stdin.take().and_then(|mut stdin| {
            use std::io::Write;
            // A command that exits at once closed it: found below.
            writeln!(stdin, "{}", auth.secret.to_hex()).ok().map(|()| stdin)
        });
        // What the command prints before the server (a banner, srun's
        // notes) is logged and passed over.
        let port = crate::process::await_line(&mut child, log, said, Duration::from_secs(30), serving_port)
            .map_err(|why| anyhow::anyhow!("{why}"))?;
        let addr = match slot {
            Some((_, slot)) => crate::net::host_port(&slot.addr, port),
            None => crate::net::host_port(&s.advertise, port),
        };
        Ok(PsProcess { id, addr, log: log.to_path_buf(), slot: slot.map(|(i, _)| i), child, _held: held })
    }
}

/// The port of a server's `ps N serving on ADDR:PORT (...)` line.
fn serving_port(line: &str) -> Option<u16> {
    let addr = line.split("serving on ").nth(1)?.split_whitespace().next()?;
    addr.parse::<std::net::SocketAddr>().ok().map(|a| a.port())
}

impl Drop for PsProcess {
    fn drop(&mut self) {
        // Its tables are in the job's checkpoints: nothing to wait for (and
        // SIGTERM alone would be notice, on which it serves on).
        terminate_group(&mut self.child, Duration::ZERO);
    }
}
