//! [`CommandScaler`]: workers started by a command the operator gives
//! (`ssh {host} ...`, `srun ...`) on a list of hosts and slots.

use super::{
    Lingering, Scaler, join_stops, kill_running_groups, relay::HostRelay, stop_fenced, stop_on_a_thread,
};
use crate::process::{ensure_dir, reap, terminate_group};
use edl_host_gpu::comm::auth::JobAuth;
use std::{
    collections::BTreeMap,
    io::Write,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// Workers started by a command template per worker, on a list of slots.
///
/// The template is run with `sh -c`, its placeholders filled in (quoted for
/// the shell): `{id}`, `{coordinator}` (`host:port`), `{host}` and `{slot}`
/// (the slot's host and its index there), `{job}`, `{exe}` (this
/// `edl-runtime`), and `{program}`: the whole worker command line (for the
/// built-in worker `{exe} worker --coordinator .. --id .. --job ..
/// --secret-file -`; under `launch`, `env EDL_COORDINATOR=.. EDL_WORKER_ID=..
/// EDL_JOB=.. EDL_JOB_SECRET_FILE=- CMD ARGS..`), so that
/// `ssh {host} {program}` or `srun -w {host} -N1 -n1 {program}` is a whole template. The command gets the job's secret on its standard input
/// (one line, then end of input: `edl-runtime worker --secret-file -` reads
/// it, and ssh and srun forward it) and in `EDL_JOB_SECRET` for a local
/// command, never on its command line. It runs in a process group of its
/// own, logging to `log_dir/worker-N.log`; stopping a worker signals the
/// group, after the `stop` template when there is one, on a thread of its
/// own (the coordinator goes on meanwhile; the worker's slot stays taken
/// until it is done).
pub struct CommandScaler {
    start: String,
    stop: Option<String>,
    exe: PathBuf,
    log_dir: PathBuf,
    /// Slot index -> host, in the order slots are handed out.
    slots: Vec<(String, usize)>,
    /// Running commands: worker id -> (process, slot index).
    children: BTreeMap<u64, (Child, Option<usize>)>,
    /// Every worker started and not stopped yet, with its slot: a command
    /// that hands the worker to an engine (sbatch, kubectl run) exits at
    /// once, and the worker is still the engine's to stop.
    started: BTreeMap<u64, Option<usize>>,
    /// Workers another coordinator started on a slot, taken over with the
    /// job: no command of this one runs for them, their slots are taken.
    adopted: BTreeMap<u64, usize>,
    /// Every worker's slot (`slot:host/0`), for the report (kept after it stopped).
    handles: BTreeMap<u64, String>,
    job: String,
    /// The words `{program}` stands for (each filled in and quoted).
    program: Vec<String>,
    /// A relay per host the workers reach the coordinator through (`--relay`).
    relays: Option<Relays>,
    /// Workers silent for their lease whose commands are killed if they
    /// still run (see [`Scaler::kill_if_lingering`]).
    lingering: Lingering,
    /// Workers being stopped, each on a thread of its own.
    stopping: Vec<Stopping>,
    /// The coordinator's lease, checked by a stop before its stop command.
    fence: Option<crate::leader::keeper::LeaseFence>,
}

/// A worker being stopped, and the slot it keeps meanwhile: a stop
/// template by `{host}` or `{slot}` must reach it alone.
struct Stopping {
    thread: std::thread::JoinHandle<()>,
    slot: Option<usize>,
}

/// The relays of [`CommandScaler::relayed`]: each started by the worker
/// command on its host, as a worker is.
struct Relays {
    /// `edl-runtime` (its path on every host), which runs them.
    exe: PathBuf,
    lease: Duration,
    by_host: BTreeMap<String, HostRelay>,
    /// Relays started so far (each one's number is the next).
    started: u64,
}

/// The placeholders a template may use.
const PLACEHOLDERS: [&str; 7] = ["id", "coordinator", "host", "slot", "job", "exe", "program"];

impl CommandScaler {
    /// `hosts`: `host` or `host:slots` entries (empty: no limit, `{host}`
    /// is empty). Slots are handed out across hosts in turn.
    pub fn new(
        start: &str,
        stop: Option<&str>,
        hosts: &[String],
        exe: impl Into<PathBuf>,
        log_dir: impl Into<PathBuf>,
    ) -> anyhow::Result<Self> {
        Self::running(start, stop, hosts, exe, log_dir, "worker")
    }

    /// A scaler whose "workers" are torchrun agents, one per host
    /// (`{program}` is `{exe} agent --coordinator .. --id .. --job ..
    /// --secret-file -`).
    pub fn for_agents(
        start: &str,
        stop: Option<&str>,
        hosts: &[String],
        exe: impl Into<PathBuf>,
        log_dir: impl Into<PathBuf>,
    ) -> anyhow::Result<Self> {
        Self::running(start, stop, hosts, exe, log_dir, "agent")
    }

    /// Runs `{exe} <subcommand>` with the job's address, the id and the job.
    fn running(
        start: &str,
        stop: Option<&str>,
        hosts: &[String],
        exe: impl Into<PathBuf>,
        log_dir: impl Into<PathBuf>,
        subcommand: &str,
    ) -> anyhow::Result<Self> {
        let builtin =
            ["{exe}", subcommand, "--coordinator", "{coordinator}", "--id", "{id}", "--job", "{job}"];
        let program = builtin.iter().chain(&["--secret-file", "-"]).map(|w| w.to_string()).collect();
        Self::with_program(start, stop, hosts, exe, log_dir, program)
    }

    /// A scaler whose workers run the user's `command` (under `launch`):
    /// `{program}` is `env EDL_...=.. EDL_JOB_SECRET_FILE=- command...`.
    pub fn for_program(
        start: &str,
        stop: Option<&str>,
        hosts: &[String],
        log_dir: impl Into<PathBuf>,
        command: &[String],
    ) -> anyhow::Result<Self> {
        let env = ["env", "EDL_COORDINATOR={coordinator}", "EDL_WORKER_ID={id}", "EDL_JOB={job}"];
        let program = env
            .iter()
            .map(|w| w.to_string())
            .chain(["EDL_JOB_SECRET_FILE=-".to_string(), "PYTHONUNBUFFERED=1".to_string()])
            .chain(command.iter().map(|w| w.replace('{', "{{").replace('}', "}}")))
            .collect();
        Self::with_program(start, stop, hosts, PathBuf::from("edl-runtime"), log_dir, program)
    }

    fn with_program(
        start: &str,
        stop: Option<&str>,
        hosts: &[String],
        exe: impl Into<PathBuf>,
        log_dir: impl Into<PathBuf>,
        program: Vec<String>,
    ) -> anyhow::Result<Self> {
        for (flag, t) in [("--worker-command", Some(start)), ("--worker-stop-command", stop)] {
            if let Some(t) = t {
                check_template(t).map_err(|e| anyhow::anyhow!("{flag} {t:?}: {e}"))?;
            }
        }
        let slots = host_slots(hosts, "--hosts")?;
        Ok(CommandScaler {
            start: start.to_string(),
            stop: stop.map(str::to_string),
            exe: exe.into(),
            log_dir: log_dir.into(),
            slots,
            children: BTreeMap::new(),
            started: BTreeMap::new(),
            adopted: BTreeMap::new(),
            handles: BTreeMap::new(),
            job: String::new(),
            program,
            relays: None,
            lingering: Lingering::default(),
            stopping: Vec::new(),
            fence: None,
        })
    }

    /// The workers of each host reach the coordinator through a relay on
    /// that host (`exe relay ...`, started by the worker command there when
    /// the host's first worker is), keeping the job's worker `lease`: one
    /// connection a host. Needs `--hosts` (a relay's host is its slots').
    pub fn with_relays(mut self, exe: impl Into<PathBuf>, lease: Duration) -> anyhow::Result<Self> {
        if self.slots.is_empty() {
            crate::refuse!(
                "--relay with --scaler command needs --hosts: the workers' hosts, a relay on each"
            );
        }
        if !self.start.contains("{program}") {
            // The relay's command line is `{program}`: a template that
            // writes its own would start a worker in the relay's place.
            crate::refuse!(
                "--relay with --scaler command needs {{program}} in --worker-command (it stands for the relay's \
                 command line too)"
            );
        }
        self.relays = Some(Relays { exe: exe.into(), lease, by_host: BTreeMap::new(), started: 0 });
        Ok(self)
    }

    /// Where a worker on `slot` reaches the coordinator: `coordinator`, or
    /// with relays its host's relay (started now if it has none running).
    fn relayed(&mut self, slot: Option<usize>, coordinator: &str, auth: &JobAuth) -> anyhow::Result<String> {
        let Some(mut relays) = self.relays.take() else { return Ok(coordinator.to_string()) };
        let at = self.host_relay(&mut relays, slot, coordinator, auth);
        self.relays = Some(relays);
        at
    }

    /// The relay of `slot`'s host, started now if it has none running.
    /// The job's first relays are every host's of `--hosts`, started
    /// together (each start is an ssh, or an engine's, round trip): the
    /// others run on while this one is waited for, and each host's first
    /// worker waits only for its own (a host whose relay failed starts
    /// another then). A relay lost later is started again alone.
    fn host_relay(
        &self,
        relays: &mut Relays,
        slot: Option<usize>,
        coordinator: &str,
        auth: &JobAuth,
    ) -> anyhow::Result<String> {
        let i = slot.ok_or_else(|| anyhow::anyhow!("a relay needs the worker's host (--hosts)"))?;
        let Relays { exe, lease, by_host, started } = relays;
        let exe = exe.to_string_lossy().into_owned();
        let command = |j: usize| {
            let exe = exe.clone();
            move |id: u64, words: &[String]| -> anyhow::Result<Command> {
                let line = self.relay_line(&exe, (id, j), coordinator, words)?;
                tracing::info!("relay {id}: started `{line}`");
                let mut cmd = Command::new("sh");
                cmd.arg("-c").arg(&line).env("EDL_JOB", &self.job).env_remove("EDL_JOB_SECRET");
                Ok(cmd)
            }
        };
        let first = by_host.is_empty();
        let host = self.slots[i].0.clone();
        let relay = by_host.entry(host.clone()).or_insert_with(|| HostRelay::new(&self.log_dir, *lease));
        relay.start_ahead(started, coordinator, auth, command(i))?;
        if first {
            for (j, (h, _)) in self.slots.iter().enumerate() {
                if by_host.contains_key(h) {
                    continue;
                }
                let other = by_host.entry(h.clone()).or_insert_with(|| HostRelay::new(&self.log_dir, *lease));
                if let Err(e) = other.start_ahead(started, coordinator, auth, command(j)) {
                    tracing::warn!("the relay on {h}: {e:#}; its first worker starts another");
                }
            }
        }
        let relay = by_host.entry(host).or_insert_with(|| HostRelay::new(&self.log_dir, *lease));
        relay.addr(started, coordinator, auth, command(i))
    }

    /// The worker command's line that starts relay `id` on `slot`'s host:
    /// `{program}` is `exe` and the relay's `words`.
    fn relay_line(
        &self,
        exe: &str,
        (id, slot): (u64, usize),
        coordinator: &str,
        words: &[String],
    ) -> anyhow::Result<String> {
        // Its words as a program's: braces of their own doubled.
        let program: Vec<String> = std::iter::once(exe)
            .chain(words.iter().map(String::as_str))
            .map(|w| w.replace('{', "{{").replace('}', "}}"))
            .collect();
        self.fill(&self.start, (&format!("relay-{id}"), Some(slot)), coordinator, &program)
    }

    /// The slots, in the order they are handed out: `(host, index on it)`.
    pub fn slots(&self) -> &[(String, usize)] {
        &self.slots
    }

    fn free_slot(&self) -> Option<usize> {
        (0..self.slots.len()).find(|i| !self.slot_taken(*i))
    }

    fn slot_taken(&self, i: usize) -> bool {
        self.children.values().any(|(_, s)| *s == Some(i))
            || self.adopted.values().any(|s| *s == i)
            || self.stopping.iter().any(|s| s.slot == Some(i) && !s.thread.is_finished())
    }

    /// `template` filled in for worker (or relay) `id` on `slot`, whose
    /// `{program}` is the words `program`.
    fn fill(
        &self,
        template: &str,
        (id, slot): (&str, Option<usize>),
        coordinator: &str,
        program: &[String],
    ) -> anyhow::Result<String> {
        let (host, index) = match slot {
            Some(i) => (self.slots[i].0.clone(), self.slots[i].1.to_string()),
            None => (String::new(), "0".into()),
        };
        let exe = self.exe.to_string_lossy();
        let value = |name: &str| match name {
            "id" => id.to_string(),
            "coordinator" => coordinator.to_string(),
            "host" => host.clone(),
            "slot" => index.clone(),
            "job" => self.job.clone(),
            _ => exe.to_string(),
        };
        let mut words = Vec::new();
        if template.contains("{program}") {
            for word in program {
                // Each word of the program is one shell word, whatever it holds.
                let filled = fill_template(word, |n| (value(n), false))?;
                words.push(quote(&filled)?);
            }
        }
        let mut program = words.join(" ");
        if runs_remote_shell(template) {
            // ssh joins its arguments and hands the line to the remote
            // host's shell, which parses it again: quoted once more, each
            // word arrives there whole (a job name, an argument with spaces).
            program = quote(&program)?;
        }
        fill_template(template, |name| {
            if name == "program" { (program.clone(), false) } else { (value(name), true) }
        })
    }

    fn log_path(&self, id: u64) -> PathBuf {
        self.log_dir.join(format!("worker-{id}.log"))
    }

    /// `line` to run with `sh -c` in a process group of its own, logging to
    /// `log`; the job's secret in its environment when `auth` is given.
    fn shell_command(
        &self,
        line: &str,
        id: u64,
        auth: Option<&JobAuth>,
        log: std::fs::File,
    ) -> anyhow::Result<Command> {
        use std::os::unix::process::CommandExt;
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(line)
            .env("EDL_WORKER_ID", id.to_string())
            .env("EDL_JOB", &self.job)
            .stdin(if auth.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0);
        if let Some(a) = auth {
            cmd.env("EDL_JOB_SECRET", a.secret.to_hex());
        }
        Ok(cmd)
    }

    /// Runs `line` as [`CommandScaler::shell_command`] makes it, with the
    /// job's secret also on its input when `auth` is given.
    fn shell(
        &self,
        line: &str,
        id: u64,
        auth: Option<&JobAuth>,
        log: std::fs::File,
    ) -> anyhow::Result<Child> {
        let mut cmd = self.shell_command(line, id, auth, log)?;
        let mut child = cmd.spawn().map_err(|e| anyhow::anyhow!("cannot run sh: {e}"))?;
        if let (Some(mut stdin), Some(a)) = (child.stdin.take(), auth) {
            // A command that does not read its input may have closed it: fine.
            let _ = writeln!(stdin, "{}", a.secret.to_hex());
        }
        Ok(child)
    }
}

/// The slots of `hosts` (`host` or `host:slots` entries, given with
/// `flag`), in the order they are handed out: across the hosts in turn,
/// `(host, index on it)`.
pub(crate) fn host_slots(hosts: &[String], flag: &str) -> anyhow::Result<Vec<(String, usize)>> {
    let mut per_host = Vec::new();
    for h in hosts {
        // An IPv6 address's colons are not a slot count: bracketed
        // (`[fd00::7]:2`), or without slots.
        let (host, n) =
            match h.rsplit_once(':').filter(|(host, _)| !host.contains(':') || host.ends_with(']')) {
                Some((host, n)) if !host.is_empty() => {
                    let n: usize = n
                        .parse()
                        .ok()
                        .filter(|n| *n > 0)
                        .ok_or_else(|| anyhow::anyhow!("{flag} {h:?}: expected host or host:slots"))?;
                    (host.to_string(), n)
                }
                _ => (h.clone(), 1),
            };
        if host.is_empty() {
            anyhow::bail!("{flag}: an empty host name");
        }
        per_host.push((host, n));
    }
    let most = per_host.iter().map(|(_, n)| *n).max().unwrap_or(0);
    Ok((0..most)
        .flat_map(|i| per_host.iter().filter(move |(_, n)| i < *n).map(move |(h, _)| (h.clone(), i)))
        .collect())
}

/// The slots of `hosts` whose entries may also name an address apart,
/// `name=addr[:slots]` (`host[:slots]` otherwise: its name is its
/// address), in the order [`host_slots`] hands them out: `(name, addr,
/// index on the host)`.
pub(crate) fn named_host_slots(hosts: &[String], flag: &str) -> anyhow::Result<Vec<(String, String, usize)>> {
    let mut addrs = std::collections::BTreeMap::new();
    let mut names = Vec::new();
    for h in hosts {
        let Some((name, rest)) = h.split_once('=') else {
            names.push(h.clone());
            continue;
        };
        let (addr, n) = match rest.rsplit_once(':') {
            Some((a, n)) if n.parse::<usize>().is_ok() && (!a.contains(':') || a.ends_with(']')) => {
                (a, Some(n))
            }
            _ => (rest, None),
        };
        if name.is_empty() || addr.is_empty() {
            crate::refuse!("{flag} {h:?}: expected host[:slots] or name=addr[:slots]");
        }
        addrs.insert(name.to_string(), addr.to_string());
        names.push(n.map_or(name.to_string(), |n| format!("{name}:{n}")));
    }
    Ok(host_slots(&names, flag)?
        .into_iter()
        .map(|(host, index)| {
            let addr = addrs.get(&host).cloned().unwrap_or_else(|| host.clone());
            (host, addr, index)
        })
        .collect())
}

/// Checks that every `{name}` of a template is a known placeholder.
fn check_template(t: &str) -> Result<(), String> {
    fill_template(t, |_| (String::new(), false)).map(|_| ()).map_err(|e| e.to_string())
}

/// One word for the shell, quoted where it needs to be.
/// Whether `template` runs its command through a remote shell: `ssh` (by
/// any path) among its words, which joins what follows and has the remote
/// host's shell parse it. `srun`, `ip netns exec`, `kubectl exec -- ...`
/// start the command's words as they are.
pub(crate) fn runs_remote_shell(template: &str) -> bool {
    let words =
        shlex::split(template).unwrap_or_else(|| template.split_whitespace().map(String::from).collect());
    words.iter().any(|w| w == "ssh" || w.ends_with("/ssh"))
}

pub(crate) fn quote(word: &str) -> anyhow::Result<String> {
    if word.is_empty() {
        return Ok("''".into());
    }
    Ok(shlex::try_quote(word).map_err(|e| anyhow::anyhow!("{word:?}: {e}"))?.into_owned())
}

/// Replaces each `{name}` by `value(name)`: `(text, quote it for the
/// shell)`; `{{` and `}}` stand for braces.
fn fill_template(t: &str, value: impl Fn(&str) -> (String, bool)) -> anyhow::Result<String> {
    fill_known(t, &PLACEHOLDERS, value)
}

/// [`fill_template`] with its own placeholders: `known` (another is an error).
pub(crate) fn fill_known(
    t: &str,
    known: &[&str],
    value: impl Fn(&str) -> (String, bool),
) -> anyhow::Result<String> {
    let mut out = String::with_capacity(t.len());
    let mut rest = t;
    while let Some(i) = rest.find(['{', '}']) {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if tail.starts_with("{{") || tail.starts_with("}}") {
            out.push_str(&tail[..1]);
            rest = &tail[2..];
            continue;
        }
        let end = tail.find('}');
        if let Some(end) = end.filter(|_| tail.starts_with('{') && out.ends_with('$')) {
            // The shell's own `${...}`, left as it is.
            out.push_str(&tail[..=end]);
            rest = &tail[end + 1..];
            continue;
        }
        if tail.starts_with('}') {
            anyhow::bail!("a '}}' without its '{{' (write '}}}}' for a brace)");
        }
        let end = end.ok_or_else(|| anyhow::anyhow!("a '{{' without its '}}'"))?;
        let name = &tail[1..end];
        if !known.contains(&name) {
            anyhow::bail!(
                "unknown placeholder {{{name}}}; known: {}",
                known.iter().map(|p| format!("{{{p}}}")).collect::<Vec<_>>().join(" ")
            );
        }
        let (v, quoted) = value(name);
        if quoted && !v.is_empty() {
            out.push_str(&quote(&v).map_err(|e| anyhow::anyhow!("{{{name}}}: {e}"))?);
        } else {
            out.push_str(&v);
        }
        rest = &tail[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Fills `{coordinator}`, `{id}` and `{job}` in the words of a
/// scheduler's worker command, where the user's own braces are written
/// doubled: a literal `{id}` of theirs stays as it is.
pub(crate) fn fill_words(words: &[String], coordinator: &str, id: u64, job: &str) -> Vec<String> {
    let id = id.to_string();
    let value = |name: &str| match name {
        "coordinator" => (coordinator.to_string(), false),
        "id" => (id.clone(), false),
        "job" => (job.to_string(), false),
        other => (format!("{{{other}}}"), false),
    };
    // The words are built here, so they always parse; were one not to, it
    // goes as it is.
    words.iter().map(|w| fill_template(w, value).unwrap_or_else(|_| w.clone())).collect()
}

impl Scaler for CommandScaler {
    fn relay_lost(&mut self, id: u64) {
        if let Some(relays) = &mut self.relays {
            relays.by_host.values_mut().any(|r| r.lost(id));
        }
    }

    fn release(&mut self) {
        // Their process groups are their own: they run on without this one.
        self.children.clear();
    }

    fn spawn(&mut self, id: u64, coordinator: &str, auth: &JobAuth) -> anyhow::Result<()> {
        self.job = auth.job.clone();
        self.make_room();
        let slot = match self.slots.len() {
            0 => None,
            n => Some(self.free_slot().ok_or_else(|| anyhow::anyhow!("all {n} slots of --hosts are taken"))?),
        };
        let coordinator =
            self.relayed(slot, coordinator, auth).map_err(|e| anyhow::anyhow!("worker {id}: {e:#}"))?;
        let line = self.fill(&self.start, (&id.to_string(), slot), &coordinator, &self.program)?;
        ensure_dir(&self.log_dir)?;
        let log = std::fs::File::create(self.log_path(id))
            .map_err(|e| anyhow::anyhow!("{}: {e}", self.log_path(id).display()))?;
        let child =
            self.shell(&line, id, Some(auth), log).map_err(|e| anyhow::anyhow!("worker {id}: {e}"))?;
        tracing::info!("worker {id}: started `{line}`");
        self.children.insert(id, (child, slot));
        self.started.insert(id, slot);
        if let Some(i) = slot {
            self.handles.insert(id, format!("slot:{}/{}", self.slots[i].0, self.slots[i].1));
        }
        Ok(())
    }

    fn stop(&mut self, id: u64, grace: Duration) {
        self.stopping.retain(|s| !s.thread.is_finished());
        let Some(slot) = self.started.remove(&id) else { return };
        self.adopted.remove(&id);
        let child = self.children.remove(&id).map(|(c, _)| c);
        // A slot that another worker holds now is not this one's to name:
        // a stop command by {host} or {slot} would reach that worker.
        // Without its slot a worker that had one cannot be named to a stop
        // command that goes by {host} or {slot}: its process group is all.
        let named = slot.filter(|s| !self.slot_taken(*s));
        let engine_stop = match &self.stop {
            Some(stop) if named.is_some() || slot.is_none() => self
                .fill(stop, (&id.to_string(), named), "", &self.program)
                .and_then(|line| {
                    let log =
                        std::fs::OpenOptions::new().append(true).create(true).open(self.log_path(id))?;
                    self.shell_command(&line, id, None, log)
                })
                .map_err(|e| tracing::warn!("worker {id}: --worker-stop-command: {e:#}"))
                .ok(),
            _ => None,
        };
        let fence = self.fence.clone();
        if let Some(thread) = stop_on_a_thread(id, move || stop_worker(id, child, grace, engine_stop, fence))
        {
            self.stopping.push(Stopping { thread, slot });
        }
    }

    fn exited(&mut self) -> Vec<(u64, String)> {
        reap(&mut self.children, |(c, _)| c)
    }

    fn kill_if_lingering(&mut self, id: u64, after: Duration) {
        if self.children.contains_key(&id) {
            self.lingering.mark(id, after);
        }
    }

    /// SIGKILL to the start command's process group, while the command
    /// runs: a local command's worker dies with it; a remote one (`ssh`,
    /// `srun`) only as far as its command ends it when killed, which is
    /// the command's (a frozen process heeds no hang-up). A command that
    /// handed its worker to an engine and ended has nothing here to kill:
    /// the generation's failure stops that worker, by the stop template.
    fn kill_lingering(&mut self) -> Vec<(u64, String)> {
        let children = &self.children;
        let due = self.lingering.due(|id| children.contains_key(&id));
        let how = "its start command's process group killed";
        kill_running_groups(due, |id| children.get(&id).map(|(c, _)| c), how)
    }

    fn pid(&self, id: u64) -> Option<u32> {
        self.children.get(&id).map(|(c, _)| c.id())
    }

    fn settle(&mut self) {
        join_stops(self.stopping.drain(..).map(|s| s.thread));
    }

    fn fence_stops(&mut self, fence: crate::leader::keeper::LeaseFence) {
        self.fence = Some(fence);
    }

    /// A slot whose worker is being stopped is free once it is gone.
    fn make_room(&mut self) {
        if !self.slots.is_empty() && self.free_slot().is_none() {
            self.settle();
        }
    }

    fn log_of(&self, id: u64) -> Option<PathBuf> {
        Some(self.log_path(id))
    }

    fn admits_uninvited(&self) -> bool {
        true
    }

    fn handle(&self, id: u64) -> Option<String> {
        self.handles.get(&id).cloned()
    }

    fn adopt(&mut self, id: u64, handle: &str, job: &str) -> bool {
        let Some((host, index)) = handle.strip_prefix("slot:").and_then(|s| s.rsplit_once('/')) else {
            return false;
        };
        let Some(i) = self.slots.iter().position(|(h, n)| h == host && n.to_string() == index) else {
            return false;
        };
        if self.slot_taken(i) || self.started.contains_key(&id) {
            return false;
        }
        self.job = job.to_string();
        self.started.insert(id, Some(i));
        self.adopted.insert(id, i);
        self.handles.insert(id, handle.to_string());
        true
    }
}

/// Stops worker `id`: its start command (`child`, where it still runs
/// here) gets `grace` to end, then the engine's stop command
/// (`engine_stop`) runs where it is needed and the coordinator still holds
/// the job (`fence`), then what is left of the command's process group is
/// ended.
fn stop_worker(
    id: u64,
    mut child: Option<Child>,
    grace: Duration,
    engine_stop: Option<Command>,
    fence: Option<crate::leader::keeper::LeaseFence>,
) {
    let running = |c: &mut Option<Child>| c.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)));
    let was_running = running(&mut child);
    let until = Instant::now() + grace;
    while Instant::now() < until && running(&mut child) {
        std::thread::sleep(Duration::from_millis(10));
    }
    // The engine's stop command runs when the start command outlived the
    // grace, and when it had ended before the stop: it handed the worker
    // to an engine (sbatch, kubectl run), which holds it still (for a
    // worker that finished, the command is harmless). A start command
    // that ended within the grace took its worker with it.
    let needs_stop = running(&mut child) || !was_running;
    let fenced = stop_fenced(&fence);
    if let (Some(why), Some(_)) = (&fenced, &engine_stop) {
        tracing::warn!("worker {id}: --worker-stop-command not run: {why}");
    }
    if let Some(mut cmd) = engine_stop.filter(|_| needs_stop && fenced.is_none()) {
        // The engine's own way to stop it (scancel, kubectl delete, ...).
        match cmd.spawn() {
            Ok(mut c) => {
                let until = Instant::now() + Duration::from_secs(10);
                while Instant::now() < until && matches!(c.try_wait(), Ok(None)) {
                    std::thread::sleep(Duration::from_millis(10));
                }
                terminate_group(&mut c, Duration::from_secs(1));
            }
            Err(e) => tracing::warn!("worker {id}: --worker-stop-command: cannot run sh: {e}"),
        }
    }
    if let Some(c) = child.as_mut() {
        terminate_group(c, Duration::from_secs(1));
    }
}

impl Drop for CommandScaler {
    fn drop(&mut self) {
        for (c, _) in self.children.values_mut() {
            terminate_group(c, Duration::from_secs(2));
        }
        // Each ends within its worker's grace and 12 seconds.
        self.settle();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn host_lists_take_names_addresses_and_slots_and_leave_ipv6_colons_alone() {
        let hosts: Vec<String> = ["a:2", "b=10.0.0.2", "c=[fd00::7]:2", "d=fd00::8", "fd00::9"]
            .iter()
            .map(|h| h.to_string())
            .collect();
        let got = super::named_host_slots(&hosts, "--ps-hosts").unwrap();
        let want = [
            ("a", "a", 0),
            ("b", "10.0.0.2", 0),
            ("c", "[fd00::7]", 0),
            ("d", "fd00::8", 0),
            ("fd00::9", "fd00::9", 0),
            ("a", "a", 1),
            ("c", "[fd00::7]", 1),
        ];
        let want: Vec<(String, String, usize)> =
            want.iter().map(|(h, a, i)| (h.to_string(), a.to_string(), *i)).collect();
        assert_eq!(got, want);
        assert!(super::named_host_slots(&["=x".to_string()], "--ps-hosts").is_err());
    }

    use super::*;

    // A table of templates and what each must expand to or refuse.
    #[test]
    fn templates_fill_known_placeholders_quoted_and_refuse_unknown_ones() {
        let t =
            "ssh {host} {exe} worker --coordinator {coordinator} --id {id} --secret-file - # {{job}}={job}";
        let got = fill_template(t, |n| {
            let v = match n {
                "host" => "node-1",
                "exe" => "/opt/my edl/edl-runtime",
                "coordinator" => "10.0.0.1:7070",
                "id" => "3",
                _ => "mnist",
            };
            (v.to_string(), true)
        })
        .unwrap();
        assert_eq!(
            got,
            "ssh node-1 '/opt/my edl/edl-runtime' worker --coordinator 10.0.0.1:7070 --id 3 --secret-file - # {job}=mnist"
        );
        // {program}: the worker's whole command line, each word quoted once.
        let dir = tempfile::tempdir().unwrap();
        let s = CommandScaler::new(
            "ssh {host} {program}",
            None,
            &["n1".into()],
            "/opt/my edl/edl-runtime",
            dir.path(),
        )
        .unwrap();
        // Through ssh, quoted once more for the remote shell.
        let line = s.fill(&s.start, ("4", Some(0)), "c:7", &s.program).unwrap();
        let words = shlex::split(&line).unwrap();
        assert_eq!(words[..2], ["ssh", "n1"], "{line}");
        assert_eq!(words.len(), 3, "the remote command is one word: {line}");
        assert_eq!(
            shlex::split(&words[2]).unwrap(),
            [
                "/opt/my edl/edl-runtime",
                "worker",
                "--coordinator",
                "c:7",
                "--id",
                "4",
                "--job",
                "",
                "--secret-file",
                "-"
            ]
        );
        let cmd = ["python".to_string(), "train.py".into(), "--note".into(), "a {b} c".into()];
        let s = CommandScaler::for_program("srun {program}", None, &[], dir.path(), &cmd).unwrap();
        assert_eq!(
            s.fill(&s.start, ("4", None), "c:7", &s.program).unwrap(),
            "srun env 'EDL_COORDINATOR=c:7' 'EDL_WORKER_ID=4' 'EDL_JOB=' 'EDL_JOB_SECRET_FILE=-' 'PYTHONUNBUFFERED=1' python train.py --note 'a {b} c'"
        );
        let e = check_template("srun -w {node} edl-runtime worker").unwrap_err();
        assert!(e.contains("unknown placeholder {node}") && e.contains("{host}"), "{e}");
        assert!(check_template("echo {id").unwrap_err().contains("without its"));
    }

    #[test]
    fn a_relay_is_started_by_the_worker_command_on_its_host_and_needs_the_hosts() {
        let dir = tempfile::tempdir().unwrap();
        let hosts = ["n1:2".to_string(), "n2:2".to_string()];
        let cmd = ["python".to_string(), "train.py".into()];
        let s = CommandScaler::for_program("ssh {host} -l {id} {program}", None, &hosts, dir.path(), &cmd)
            .unwrap();
        let s = s.with_relays("/opt/my edl/edl-runtime", Duration::from_secs(10)).unwrap();
        let words: Vec<String> =
            ["relay", "--coordinator", "c:7", "--job", "j{x}"].iter().map(|w| w.to_string()).collect();
        // Slot 1 is n2's first.
        let line = s.relay_line("/opt/my edl/edl-runtime", (3, 1), "c:7", &words).unwrap();
        let parts = shlex::split(&line).unwrap();
        assert_eq!(parts[..4], ["ssh", "n2", "-l", "relay-3"], "{line}");
        assert_eq!(
            shlex::split(&parts[4]).unwrap(),
            ["/opt/my edl/edl-runtime", "relay", "--coordinator", "c:7", "--job", "j{x}"],
            "this edl-runtime runs it, not the program, its words whole: {line}"
        );
        let e = CommandScaler::for_program("ssh {host} {program}", None, &[], dir.path(), &cmd)
            .unwrap()
            .with_relays("edl-runtime", Duration::from_secs(10))
            .err()
            .expect("no hosts");
        assert!(e.to_string().contains("needs --hosts"), "{e}");
        let own = "ssh {host} edl-runtime worker --coordinator {coordinator} --id {id} --secret-file -";
        let e = CommandScaler::new(own, None, &hosts, "edl-runtime", dir.path())
            .unwrap()
            .with_relays("edl-runtime", Duration::from_secs(10))
            .err()
            .expect("a template without {program}");
        assert!(e.to_string().contains("needs {program} in --worker-command"), "{e}");
    }

    #[test]
    fn a_program_reaches_the_far_side_of_ssh_word_for_word() {
        // An ssh that does what ssh does: joins its arguments after the host
        // and has a shell (here, this machine's) parse the line.
        let dir = tempfile::tempdir().unwrap();
        let ssh = dir.path().join("ssh");
        std::fs::write(&ssh, "#!/bin/sh\nshift\nexec sh -c \"$*\"\n").unwrap();
        std::fs::set_permissions(&ssh, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let marker = dir.path().join("pwned");
        let hostile = format!("x;touch {};#", marker.display());
        let cmd = [
            "printf".to_string(),
            "<%s>\\n".into(),
            "two words".into(),
            "it's \"quoted\"".into(),
            hostile.clone(),
        ];
        let template = format!("{} {{host}} {{program}}", ssh.display());
        let mut s = CommandScaler::for_program(&template, None, &["h1".into()], dir.path(), &cmd).unwrap();
        let auth = JobAuth { job: "j".into(), secret: edl_host_gpu::comm::auth::Secret::generate().unwrap() };
        s.spawn(1, "10.0.0.1:7070", &auth).unwrap();
        while s.exited().is_empty() {
            std::thread::sleep(Duration::from_millis(10));
        }
        let log = std::fs::read_to_string(dir.path().join("worker-1.log")).unwrap();
        assert_eq!(log, format!("<two words>\n<it's \"quoted\">\n<{hostile}>\n"));
        assert!(!marker.exists(), "the remote shell ran part of an argument");
    }

    #[test]
    fn slots_go_round_the_hosts_and_a_full_list_refuses_to_start_more() {
        let dir = tempfile::tempdir().unwrap();
        let hosts = ["a:2".to_string(), "b".to_string(), "c:3".to_string()];
        let s = CommandScaler::new("true", None, &hosts, "/bin/true", dir.path()).unwrap();
        let order: Vec<String> = s.slots().iter().map(|(h, i)| format!("{h}{i}")).collect();
        assert_eq!(order, ["a0", "b0", "c0", "a1", "c1", "c2"]);
        assert!(CommandScaler::new("true", None, &["a:0".into()], "x", dir.path()).is_err());

        // Each worker's command runs with its slot filled in and the secret
        // on its input; a finished command frees its slot.
        let template = "read s; echo \"{id} {host} {slot} {coordinator} $EDL_JOB ${#s}\"";
        let mut s = CommandScaler::new(template, None, &["h1".into(), "h2".into()], "x", dir.path()).unwrap();
        let auth = JobAuth { job: "j".into(), secret: edl_host_gpu::comm::auth::Secret::generate().unwrap() };
        s.spawn(1, "10.0.0.1:7070", &auth).unwrap();
        s.spawn(2, "10.0.0.1:7070", &auth).unwrap();
        let e = s.spawn(3, "10.0.0.1:7070", &auth).unwrap_err();
        assert!(e.to_string().contains("all 2 slots of --hosts are taken"), "{e}");
        let mut gone = Vec::new();
        while gone.len() < 2 {
            gone.extend(s.exited().into_iter().map(|(id, _)| id));
            std::thread::sleep(Duration::from_millis(10));
        }
        gone.sort();
        assert_eq!(gone, [1, 2]);
        let log = |id| std::fs::read_to_string(dir.path().join(format!("worker-{id}.log"))).unwrap();
        assert_eq!(log(1).trim(), "1 h1 0 10.0.0.1:7070 j 64");
        assert_eq!(log(2).trim(), "2 h2 0 10.0.0.1:7070 j 64");
        s.spawn(3, "10.0.0.1:7070", &auth).unwrap();
        assert_eq!(s.children[&3].1, Some(0), "the freed first slot");
    }

    #[test]
    fn workers_taken_over_with_the_job_keep_their_slots_and_are_stopped_by_their_handle() {
        let dir = tempfile::tempdir().unwrap();
        let hosts = ["h1".to_string(), "h2".to_string(), "h3".to_string()];
        let stopped = dir.path().join("stopped");
        // Slow, as an engine's stop can be: the slot stays the stopped
        // worker's until it is done.
        let stop = format!("sleep 0.3; echo {{id}} {{host}} >> {}", stopped.display());
        let auth = JobAuth { job: "j".into(), secret: edl_host_gpu::comm::auth::Secret::generate().unwrap() };
        // The coordinator before: workers 1 and 2 on h1 and h2.
        let mut before = CommandScaler::new("sleep 5", Some(&stop), &hosts, "x", dir.path()).unwrap();
        before.spawn(1, "c:1", &auth).unwrap();
        before.spawn(2, "c:1", &auth).unwrap();
        let handles: Vec<String> = [1, 2].map(|id| before.handle(id).unwrap()).to_vec();
        assert_eq!(handles, ["slot:h1/0", "slot:h2/0"]);
        before.release();
        // The coordinator that took over: their slots are taken, the next
        // worker goes to h3, and none fits after it.
        let mut after = CommandScaler::new("sleep 5", Some(&stop), &hosts, "x", dir.path()).unwrap();
        assert!(after.adopt(1, &handles[0], "j") && after.adopt(2, &handles[1], "j"));
        assert!(!after.adopt(9, "slot:elsewhere/0", "j"), "a host not in --hosts");
        assert!(!after.adopt(9, "slurm:12", "j"), "another scheduler's");
        assert!(!after.adopt(9, &handles[0], "j"), "a slot already taken");
        after.spawn(3, "c:1", &auth).unwrap();
        assert_eq!(after.handle(3).as_deref(), Some("slot:h3/0"));
        let e = after.spawn(4, "c:1", &auth).unwrap_err();
        assert!(e.to_string().contains("all 3 slots of --hosts are taken"), "{e}");
        // Stopping one taken over runs the stop command on its host and frees its slot.
        // The next worker, with no other slot free, waits for that stop to
        // be done and takes the slot after it.
        after.stop(2, Duration::from_millis(10));
        after.spawn(4, "c:1", &auth).unwrap();
        assert_eq!(std::fs::read_to_string(&stopped).unwrap().trim(), "2 h2");
        assert_eq!(after.handle(4).as_deref(), Some("slot:h2/0"));
        after.stop(3, Duration::from_millis(10));
        after.stop(4, Duration::from_millis(10));
    }

    #[test]
    fn the_stop_command_runs_for_a_worker_whose_start_command_handed_it_on_and_exited() {
        let dir = tempfile::tempdir().unwrap();
        let stopped = dir.path().join("stopped");
        // As sbatch does: the start command returns at once; the worker is
        // the engine's now, and only the stop command reaches it.
        let stop = format!("echo {{id}} >> {}", stopped.display());
        let mut s = CommandScaler::new("true", Some(&stop), &[], "x", dir.path()).unwrap();
        let auth = JobAuth { job: "j".into(), secret: edl_host_gpu::comm::auth::Secret::generate().unwrap() };
        s.spawn(4, "c:1", &auth).unwrap();
        while s.exited().is_empty() {
            std::thread::sleep(Duration::from_millis(10));
        }
        s.stop(4, Duration::ZERO);
        s.settle();
        assert_eq!(std::fs::read_to_string(&stopped).unwrap(), "4\n");
        // A worker stopped twice, or never started, is not stopped again.
        s.stop(4, Duration::ZERO);
        s.stop(9, Duration::ZERO);
        s.settle();
        assert_eq!(std::fs::read_to_string(&stopped).unwrap(), "4\n");
        // A start command that runs the worker in the foreground and ends
        // within the grace took its worker with it: no stop command.
        let mut s = CommandScaler::new("read s; sleep 0.2", Some(&stop), &[], "x", dir.path()).unwrap();
        s.spawn(5, "c:1", &auth).unwrap();
        s.stop(5, Duration::from_secs(30));
        s.settle();
        assert_eq!(std::fs::read_to_string(&stopped).unwrap(), "4\n");
    }

    #[test]
    fn a_stop_returns_at_once_and_the_engine_s_stop_command_runs_on_a_thread_of_its_own() {
        use std::os::unix::fs::OpenOptionsExt;
        let dir = tempfile::tempdir().unwrap();
        let (go, done) = (dir.path().join("go"), dir.path().join("done"));
        assert!(Command::new("mkfifo").arg(&go).status().unwrap().success());
        // The engine's stop command waits until the test says go.
        let stop = format!("read x < {}; echo {{id}} $x >> {}", go.display(), done.display());
        let mut s = CommandScaler::new("true", Some(&stop), &[], "x", dir.path()).unwrap();
        let auth = JobAuth { job: "j".into(), secret: edl_host_gpu::comm::auth::Secret::generate().unwrap() };
        s.spawn(3, "c:1", &auth).unwrap();
        while s.exited().is_empty() {
            std::thread::sleep(Duration::from_millis(10));
        }
        s.stop(3, Duration::ZERO);
        // Back from the stop while its stop command still reads: the test
        // can be its writer (a stop that waited for the command would have
        // ended it after its 10 s bound, and nothing would read).
        let until = Instant::now() + Duration::from_secs(60);
        let mut w = loop {
            match std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NONBLOCK).open(&go) {
                Ok(w) => break w,
                Err(e) => assert!(Instant::now() < until, "no stop command reads: {e}"),
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        writeln!(w, "go").unwrap();
        drop(w);
        s.settle();
        assert_eq!(std::fs::read_to_string(&done).unwrap(), "3 go\n");
    }

    #[test]
    fn a_coordinator_deposed_while_a_worker_is_stopped_runs_no_stop_command() {
        let dir = tempfile::tempdir().unwrap();
        let stopped = dir.path().join("stopped");
        let stop = format!("echo {{id}} >> {}", stopped.display());
        let mut s = CommandScaler::new("true", Some(&stop), &[], "x", dir.path()).unwrap();
        // A lease confirmed longer ago than its term: over.
        let lapsed = crate::clock::BootInstant::now().earlier(Duration::from_secs(10));
        s.fence_stops(crate::leader::keeper::LeaseFence::confirmed_at(lapsed, Duration::from_secs(5)));
        let auth = JobAuth { job: "j".into(), secret: edl_host_gpu::comm::auth::Secret::generate().unwrap() };
        s.spawn(6, "c:1", &auth).unwrap();
        while s.exited().is_empty() {
            std::thread::sleep(Duration::from_millis(10));
        }
        s.stop(6, Duration::ZERO);
        s.settle();
        assert!(!stopped.exists(), "the stop command ran for a deposed coordinator");
    }

    #[test]
    fn stopping_a_command_stops_everything_it_started() {
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("grandchild.pid");
        // The command starts a child of its own and waits: both must go.
        let template = format!("sleep 600 & echo $! > {}; wait", pidfile.display());
        let mut s = CommandScaler::new(&template, None, &[], "x", dir.path()).unwrap();
        let auth = JobAuth { job: "j".into(), secret: edl_host_gpu::comm::auth::Secret::generate().unwrap() };
        s.spawn(1, "c:1", &auth).unwrap();
        let pid = loop {
            if let Some(p) = std::fs::read_to_string(&pidfile).ok().and_then(|t| t.trim().parse::<i32>().ok())
            {
                break p;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        s.stop(1, Duration::ZERO);
        // Running, not a zombie waiting for whoever adopted it to reap it.
        let alive = |pid: i32| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|st| st.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')))
        };
        let until = Instant::now() + Duration::from_secs(30);
        while alive(pid) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(!alive(pid), "the command's own child {pid} outlived the stop");
    }
}
