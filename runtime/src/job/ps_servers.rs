//! The parameter servers a job starts for itself (`--ps-servers N`):
//! `edl-runtime ps` processes on the coordinator's host, or started by a
//! command the operator gives on hosts of theirs (`--ps-command`, e.g.
//! `ssh {host} {program}` or `srun -w {host} {program}`), or by a command
//! that places each server itself (`srun {program}` without hosts: under
//! `--scaler slurm` the job's own), each in a process group of its own,
//! told the job's secret through the environment (or its standard input),
//! stopped with the job.

use super::ps_kube::{PsPods, ServerPod};
use crate::process::{die_with_parent, log_tail, terminate_group};
use crate::worker::session::JobAuth;
use anyhow::{Context, Result};
use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::Arc,
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
    /// Or each in a Kubernetes Pod of its own (under `--scaler kubernetes`).
    pub kube: Option<super::ps_kube::KubePsSpec>,
}

/// Servers started by a command on the operator's hosts (`--ps-command`).
#[derive(Clone, Debug)]
pub struct PsCommand {
    /// Starts server `{id}` on `{host}`; `{program}` is its command line.
    pub start: String,
    /// `host[:slots]` or `name=addr[:slots]` entries; none: the command
    /// places each server (a scheduler's), which listens on every interface
    /// of wherever it runs, on a port of its choosing, and says its
    /// address on its route to the coordinator.
    pub hosts: Vec<String>,
    /// The port of each host's first server; its next ones take the ports after it.
    pub port: u16,
}

/// What a `--ps-command` template may name.
pub const PLACEHOLDERS: [&str; 7] = ["program", "id", "host", "addr", "port", "job", "exe"];
/// What it may name when the command places the servers (no hosts given).
const PLACED_PLACEHOLDERS: [&str; 4] = ["program", "id", "job", "exe"];

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
    /// (across the hosts in turn), none when the command places the servers.
    pub fn slots(&self) -> Result<Vec<PsSlot>> {
        let names: &[&str] = if self.placed() { &PLACED_PLACEHOLDERS } else { &PLACEHOLDERS };
        if let Err(e) = crate::scalers::command::fill_known(&self.start, names, |_| (String::new(), false)) {
            let why = if self.placed() { " (without --ps-hosts the command places the servers)" } else { "" };
            crate::refuse!("--ps-command {:?}: {e}{why}", self.start);
        }
        let mut slots = Vec::new();
        for (host, addr, index) in crate::scalers::command::named_host_slots(&self.hosts, "--ps-hosts")? {
            let Some(port) = u16::try_from(self.port as usize + index).ok().filter(|p| *p > 0) else {
                crate::refuse!("--ps-port {}: server {index} on {host} has no port", self.port);
            };
            slots.push(PsSlot { host, addr, port });
        }
        Ok(slots)
    }

    /// Whether the command places each server itself (no hosts were given).
    pub fn placed(&self) -> bool {
        self.hosts.is_empty()
    }

    /// The shell line that starts server `id` on `slot` running `program`
    /// (quoted twice where the template goes through `ssh`, whose far
    /// side's shell parses the line again).
    fn line(&self, program: &[String], id: u64, slot: Option<&PsSlot>, job: &str) -> Result<String> {
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
                // Refused in the template when no slot is given (`slots`).
                "host" => slot.map(|s| s.host.clone()).unwrap_or_default(),
                "addr" => slot.map(|s| s.addr.clone()).unwrap_or_default(),
                "port" => slot.map(|s| s.port.to_string()).unwrap_or_default(),
                "job" => job.to_string(),
                _ => exe.clone(),
            };
            (if twice { once(&v) } else { v }, true)
        };
        crate::scalers::command::fill_known(&self.start, &PLACEHOLDERS, value)
    }
}

/// The command's slots (none when there is no command, or it places the servers).
fn slot_list(start: &PsStart) -> Result<Vec<PsSlot>> {
    start.command.as_ref().map_or(Ok(Vec::new()), PsCommand::slots)
}

/// One running server.
pub struct PsProcess {
    pub id: u64,
    pub addr: String,
    pub log: PathBuf,
    /// Its slot among the command's (None: started here).
    slot: Option<usize>,
    run: Run,
}

/// How a server runs.
enum Run {
    /// A process started here, or by a command.
    Process {
        child: Child,
        /// A server started by command: its standard input, held open
        /// while the job wants it (it read the job's secret there, and
        /// stops when it closes, wherever it runs).
        held: Option<std::process::ChildStdin>,
        by_command: bool,
    },
    /// A Kubernetes Pod.
    Pod { pod: ServerPod, pods: Arc<PsPods> },
}

/// The job's servers; dropping them stops them.
#[derive(Default)]
pub struct PsServers {
    pub servers: Vec<PsProcess>,
    /// How they were started (for more of them), and where they log.
    start: Option<(PsStart, JobAuth, PathBuf)>,
    next: u64,
    /// Servers being started on threads of their own: id, slot, thread
    /// (none only while places are handed out).
    starting: Vec<(u64, Option<usize>, Option<Starting>)>,
    /// The job's server Pods, where servers run in Pods.
    pods: Option<Arc<PsPods>>,
    /// Servers still starting that are no longer wanted (another of their
    /// batch failed): each is stopped once its start ends.
    abandoned: std::collections::BTreeSet<u64>,
}

/// The thread starting a server.
type Starting = std::thread::JoinHandle<Result<PsProcess>>;

/// A server started by [`PsServers::start_more`]: its id and address, or
/// its id and why it did not start.
pub type Started = std::result::Result<(u64, String), (u64, anyhow::Error)>;

impl PsServers {
    /// Starts `start.count` servers (ids from 1, or in Pods past those a
    /// coordinator before left), each logging to `log_dir/ps-<id>.log`, all
    /// at once, and waits for each to serve.
    pub fn start(start: &PsStart, auth: &JobAuth, log_dir: &Path) -> Result<PsServers> {
        let pods = start.kube.clone().map(|k| PsPods::new(k, &auth.job)).transpose()?;
        Self::start_on(start, auth, log_dir, pods)
    }

    /// As [`PsServers::start`], with Pods made through the API `api` gives
    /// (a stand-in's).
    #[cfg(test)]
    pub(crate) fn start_with_api(
        start: &PsStart,
        auth: &JobAuth,
        log_dir: &Path,
        api: impl FnOnce(&tokio::runtime::Runtime) -> kube::Api<k8s_openapi::api::core::v1::Pod>,
    ) -> Result<PsServers> {
        let pods = start.kube.clone().map(|k| PsPods::new(k, &auth.job)).transpose()?;
        Self::start_on(start, auth, log_dir, pods.map(|p| p.with_api(api)))
    }

    fn start_on(start: &PsStart, auth: &JobAuth, log_dir: &Path, pods: Option<PsPods>) -> Result<PsServers> {
        std::fs::create_dir_all(log_dir).with_context(|| format!("{}", log_dir.display()))?;
        let pods = pods.map(Arc::new);
        let next = pods.as_ref().map_or(Ok(1), |p| p.clear_left())?;
        let mut servers = PsServers {
            servers: Vec::new(),
            start: Some((start.clone(), auth.clone(), log_dir.to_path_buf())),
            next,
            starting: Vec::new(),
            pods,
            abandoned: Default::default(),
        };
        servers.more(start.count)?;
        Ok(servers)
    }

    /// Starts `n` more servers (with ids after every one started before),
    /// all at once, and waits for them; returns their ids and addresses.
    /// All or none: when one does not start, the wait ends there, those
    /// that did are stopped, and those still starting are stopped once
    /// their start ends.
    pub fn more(&mut self, n: u32) -> Result<Vec<(u64, String)>> {
        let ids = self.start_more(n)?;
        let (mut mine, others): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.starting).into_iter().partition(|s| ids.contains(&s.0));
        self.starting = others;
        let mut added = Vec::new();
        let mut failed = (ids.len() < n as usize).then(|| {
            anyhow::anyhow!(
                "starting parameter servers: no thread to start {} of {n}",
                n as usize - ids.len()
            )
        });
        // Each joined as its start ends (each start is bounded).
        while failed.is_none() && !mine.is_empty() {
            let (done, left): (Vec<_>, Vec<_>) =
                mine.into_iter().partition(|s| s.2.as_ref().is_none_or(|t| t.is_finished()));
            mine = left;
            for (id, _, thread) in done {
                match thread.map(|t| self.join_started(id, t)) {
                    Some(Ok(at)) => added.push(at),
                    Some(Err((_, e))) => failed = failed.or(Some(e)),
                    None => {}
                }
            }
            if failed.is_none() && !mine.is_empty() {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        if let Some(e) = failed {
            self.servers.retain(|p| !added.iter().any(|(id, _)| *id == p.id));
            self.abandoned.extend(mine.iter().map(|s| s.0));
            self.starting.extend(mine);
            return Err(e);
        }
        // In the order of their ids, whichever started first.
        added.sort_by_key(|a| a.0);
        self.servers.sort_by_key(|p| p.id);
        Ok(added)
    }

    /// Server `id`'s start on `thread`, joined: it serves (kept among the
    /// servers), or why not.
    fn join_started(&mut self, id: u64, thread: Starting) -> Started {
        match thread.join() {
            Ok(Ok(p)) => {
                let addr = p.addr.clone();
                self.servers.push(p);
                Ok((id, addr))
            }
            Ok(Err(e)) => Err((id, e.context(format!("starting parameter server {id}")))),
            Err(_) => Err((id, anyhow::anyhow!("starting parameter server {id}: its thread panicked"))),
        }
    }

    /// Starts `n` more servers, each on a thread of its own (a scheduler may
    /// take a while to place one): the job goes on meanwhile, and
    /// [`PsServers::started`] collects them. Returns their ids.
    pub fn start_more(&mut self, n: u32) -> Result<Vec<u64>> {
        let (start, auth, log_dir) = self.start.clone().context("no servers were started")?;
        // Every place first: none is started unless all have one.
        let slots = slot_list(&start)?;
        let mut places = Vec::new();
        for _ in 0..n {
            match self.next_place(&start, &slots) {
                Ok(place) => {
                    self.starting.push((place.0, place.1, None));
                    places.push(place);
                }
                Err(e) => {
                    self.starting.retain(|s| s.2.is_some());
                    return Err(e);
                }
            }
        }
        self.starting.retain(|s| s.2.is_some());
        let mut ids = Vec::new();
        for (id, slot) in places {
            let (start, auth, log) = (start.clone(), auth.clone(), log_dir.join(format!("ps-{id}.log")));
            let at = slot.map(|i| (i, slots[i].clone()));
            let pods = self.pods.clone();
            let thread = std::thread::Builder::new().name(format!("edl-ps-start-{id}")).spawn(move || {
                PsProcess::start(&start, id, &auth, &log, at.as_ref().map(|(i, s)| (*i, s)), pods.as_ref())
            });
            match thread {
                Ok(t) => self.starting.push((id, slot, Some(t))),
                // Those spawned go on; the job collects them as usual.
                Err(e) if !ids.is_empty() => {
                    tracing::warn!("parameter server {id}: not started: {e}");
                    break;
                }
                Err(e) => return Err(e.into()),
            }
            ids.push(id);
        }
        Ok(ids)
    }

    /// The servers [`PsServers::start_more`] started (or failed to) since
    /// last asked; those still starting are left, or with `wait`, waited for.
    pub fn started(&mut self, wait: bool) -> Vec<Started> {
        let (done, left): (Vec<_>, Vec<_>) = std::mem::take(&mut self.starting)
            .into_iter()
            .partition(|s| wait || s.2.as_ref().is_none_or(|t| t.is_finished()));
        self.starting = left;
        let mut started = Vec::new();
        for (id, thread) in done.into_iter().filter_map(|(id, _, thread)| Some((id, thread?))) {
            if self.abandoned.remove(&id) {
                // Not wanted any more: stopped on a thread of its own.
                if let Ok(Ok(p)) = thread.join() {
                    std::thread::spawn(move || drop(p));
                }
                continue;
            }
            started.push(self.join_started(id, thread));
        }
        started
    }

    /// The next server's id, and its slot among the command's hosts (none:
    /// started here, or placed by the command), past those of the servers
    /// running and starting.
    fn next_place(&mut self, start: &PsStart, slots: &[PsSlot]) -> Result<(u64, Option<usize>)> {
        let id = self.next;
        let slot = match &start.command {
            Some(c) if !c.placed() => {
                let taken: Vec<usize> = self
                    .servers
                    .iter()
                    .filter_map(|p| p.slot)
                    .chain(self.starting.iter().filter_map(|s| s.1))
                    .collect();
                let free = (0..slots.len()).find(|i| !taken.contains(i)).with_context(|| {
                    format!("parameter server {id}: every slot of --ps-hosts ({}) is taken", slots.len())
                })?;
                Some(free)
            }
            _ => None,
        };
        self.next += 1;
        Ok((id, slot))
    }

    /// Each server's id and address, as workers are told them.
    pub fn addrs(&self) -> Vec<(u64, String)> {
        self.servers.iter().map(|p| (p.id, p.addr.clone())).collect()
    }

    /// Stops server `id` (its shards were moved, or it was lost): let go
    /// on a thread of its own, so that the job does not wait for its end.
    pub fn stop(&mut self, id: u64) {
        if let Some(at) = self.servers.iter().position(|p| p.id == id) {
            let p = self.servers.remove(at);
            std::thread::spawn(move || drop(p));
        }
    }

    /// How many servers run, and are being started (and wanted).
    pub fn len(&self) -> usize {
        self.servers.len() + self.starting.iter().filter(|s| !self.abandoned.contains(&s.0)).count()
    }

    /// Whether servers are being started (and wanted).
    pub fn starting(&self) -> bool {
        self.starting.iter().any(|s| !self.abandoned.contains(&s.0))
    }

    /// How many servers run (those starting not counted).
    pub fn running(&self) -> usize {
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
        let names: Vec<&str> = self
            .servers
            .iter()
            .filter_map(|p| match &p.run {
                Run::Pod { pod, .. } => Some(pod.name.as_str()),
                Run::Process { .. } => None,
            })
            .collect();
        let ended = self.pods.as_ref().map_or_else(Vec::new, |pods| pods.ended(&names));
        let (mut gone, mut pods_gone) = (Vec::new(), Vec::new());
        let mut at = 0;
        while at < self.servers.len() {
            let p = &mut self.servers[at];
            let how = match &mut p.run {
                Run::Process { child, .. } => {
                    child.try_wait().ok().flatten().map(|status| status.to_string())
                }
                Run::Pod { pod, pods } => ended.iter().find(|(n, _)| *n == pod.name).map(|(_, how)| {
                    // Its log is kept before its Pod goes.
                    if how.contains(" ended: ") {
                        pods.keep_log(&pod.name, &p.log);
                    }
                    how.clone()
                }),
            };
            let Some(how) = how else {
                at += 1;
                continue;
            };
            let p = self.servers.remove(at);
            gone.push((p.id, format!("{how}{}", log_tail(&p.log, 3))));
            match p.run {
                // Deleted on a thread of its own: the job does not wait on the API.
                Run::Pod { .. } => pods_gone.push(p),
                Run::Process { .. } => drop(p),
            }
        }
        if !pods_gone.is_empty() {
            std::thread::spawn(move || drop(pods_gone));
        }
        gone
    }
}

impl PsProcess {
    /// Server `id`'s command line: here, or by the operator's command (on
    /// `slot`, or where the command places it).
    fn command(s: &PsStart, id: u64, auth: &JobAuth, slot: Option<&PsSlot>) -> Result<Command> {
        let by_command = s.command.is_some();
        let listen = match slot {
            // Every address of the host: the slot's may be a name only the others know.
            Some(slot) => std::net::SocketAddr::from(([0, 0, 0, 0], slot.port)),
            None if by_command => std::net::SocketAddr::from(([0, 0, 0, 0], 0)),
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
        if by_command {
            // The secret on standard input: it crosses ssh, and is on no command line.
            program.extend(["--job".into(), auth.job.clone(), "--secret-file".into(), "-".into()]);
        }
        if by_command && slot.is_none() {
            // Placed by the command: it says where it is, as seen from here.
            program.extend(["--advertise-toward".into(), s.advertise.clone()]);
        }
        Ok(match &s.command {
            Some(c) => {
                let mut sh = Command::new("sh");
                sh.arg("-c").arg(c.line(&program, id, slot, &auth.job)?);
                sh
            }
            None => {
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
        pods: Option<&Arc<PsPods>>,
    ) -> Result<PsProcess> {
        if let Some(pods) = pods {
            let (pod, addr) = pods.start(id, s.memory_mib, auth, log)?;
            let run = Run::Pod { pod, pods: pods.clone() };
            return Ok(PsProcess { id, addr, log: log.to_path_buf(), slot: None, run });
        }
        let log_file = std::fs::File::create(log).with_context(|| format!("{}", log.display()))?;
        let said = log_file.try_clone()?;
        let mut cmd = Self::command(s, id, auth, slot.map(|(_, p)| p))?;
        cmd.env("EDL_JOB", &auth.job).env_remove("EDL_JOB_SECRET_FILE");
        if s.command.is_some() {
            // The secret goes on its standard input only: a command such as
            // srun hands its whole environment to the server (and Slurm
            // keeps a job's), so neither it nor the store's URL is in it.
            cmd.env_remove("EDL_JOB_SECRET").env_remove("EDL_STORE");
        } else {
            cmd.env("EDL_JOB_SECRET", auth.secret.to_hex());
        }
        cmd.stdin(if s.command.is_some() { Stdio::piped() } else { Stdio::null() })
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
        // notes) is logged and passed over. A scheduler may queue it first.
        let within = if s.command.as_ref().is_some_and(|c| c.placed()) { PLACED_START } else { LOCAL_START };
        let at = crate::process::await_line(&mut child, log, said, within, serving_at)
            .map_err(|why| anyhow::anyhow!("{why}"))?;
        let addr = match (slot, &s.command) {
            (Some((_, slot)), _) => crate::net::host_port(&slot.addr, at.port()),
            (None, Some(_)) => at.to_string(),
            (None, None) => crate::net::host_port(&s.advertise, at.port()),
        };
        let run = Run::Process { child, held, by_command: s.command.is_some() };
        Ok(PsProcess { id, addr, log: log.to_path_buf(), slot: slot.map(|(i, _)| i), run })
    }
}

/// How long a server may take to say where it serves: started here or on a
/// host of the operator's, and placed by a scheduler (which may queue it).
const LOCAL_START: Duration = Duration::from_secs(30);
const PLACED_START: Duration = Duration::from_secs(120);

/// The address of a server's `ps N serving on ADDR:PORT (...)` line.
fn serving_at(line: &str) -> Option<std::net::SocketAddr> {
    let addr = line.split("serving on ").nth(1)?.split_whitespace().next()?;
    addr.parse().ok()
}

/// How long a server started by command is given to end once its standard
/// input is closed, before its command is killed.
const LET_GO: Duration = Duration::from_secs(5);

impl PsProcess {
    /// Closes the standard input of a server started by command: the server
    /// stops when it closes, wherever it runs (and its command with it: a
    /// killed `srun` would leave its Slurm job running).
    fn let_go(&mut self) {
        if let Run::Process { held, .. } = &mut self.run {
            *held = None;
        }
    }
}

impl PsProcess {
    /// Waits, until `until`, for a server started by command to end once
    /// let go; after that its command is killed (by the drop).
    fn wait_until(&mut self, until: std::time::Instant) {
        let Run::Process { child, by_command, .. } = &mut self.run else { return };
        while *by_command && std::time::Instant::now() < until && matches!(child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        *by_command = false;
    }
}

impl Drop for PsProcess {
    fn drop(&mut self) {
        self.let_go();
        self.wait_until(std::time::Instant::now() + LET_GO);
        // Its tables are in the job's checkpoints: nothing to wait for (and
        // SIGTERM alone would be notice, on which it serves on).
        match &mut self.run {
            Run::Process { child, .. } => terminate_group(child, Duration::ZERO),
            Run::Pod { pod, pods } => pods.delete(pod),
        }
    }
}

impl Drop for PsServers {
    fn drop(&mut self) {
        // Every server told at once, and given one deadline together.
        self.servers.iter_mut().for_each(PsProcess::let_go);
        let until = std::time::Instant::now() + LET_GO;
        self.servers.iter_mut().for_each(|p| p.wait_until(until));
        // Those still starting are stopped once they started, if that
        // comes before the deadline (a later one goes with this process,
        // or, in a Pod, with its owner).
        while !self.starting.is_empty() && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
            self.started(false);
        }
        if let Some(pods) = &self.pods {
            // Pods still starting are deleted, and any made later at once.
            let ids: Vec<u64> = self.starting.iter().map(|s| s.0).collect();
            pods.close(&ids);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_of_servers_whose_first_fails_is_given_up_at_once_and_the_rest_stopped_once_started() {
        let dir = tempfile::tempdir().unwrap();
        // Server 1 cannot start; server 2 takes long to (placed by the
        // command: it has 120 s to say where it serves).
        let start = "if [ {id} = 1 ]; then echo no room for server 1 >&2; exit 3; fi; sleep 30; exit 4";
        let spec = PsStart {
            count: 2,
            memory_mib: 0,
            staleness: 0,
            replicas: 1,
            min: 2,
            max: 2,
            exe: PathBuf::from("edl-runtime"),
            listen: IpAddr::from([127, 0, 0, 1]),
            advertise: "127.0.0.1".into(),
            command: Some(PsCommand { start: start.into(), hosts: Vec::new(), port: 0 }),
            kube: None,
        };
        let auth = JobAuth { job: "j".into(), secret: crate::worker::session::Secret::generate().unwrap() };
        let e = match PsServers::start(&spec, &auth, dir.path()) {
            Ok(_) => panic!("a server that cannot start"),
            Err(e) => format!("{e:#}"),
        };
        assert!(e.contains("parameter server 1") && e.contains("no room for server 1"), "{e}");

        // The same through more(): it returns with server 2 still starting,
        // which no longer counts and is stopped once its start ends.
        let mut servers = PsServers::default();
        servers.start = Some((spec, auth, dir.path().to_path_buf()));
        servers.next = 1;
        let e = format!("{:#}", servers.more(2).unwrap_err());
        assert!(e.contains("parameter server 1"), "{e}");
        assert_eq!(servers.starting.iter().map(|s| s.0).collect::<Vec<_>>(), vec![2], "not waited for");
        assert!(!servers.starting(), "and not counted");
        assert_eq!(servers.len(), 0, "and not counted");
    }
}
