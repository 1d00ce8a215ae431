//! The control plane at scale: N simulated workers on H simulated hosts
//! against the real coordinator.
//!
//!     cargo bench -p edl-benches --bench control_plane
//!     cargo bench -p edl-benches --bench control_plane -- --bench --sizes 64:8,1024:32 --compute-ms 2 --modes relay
//!
//! Each simulated host is a process of its own (this program again, with
//! `--sim-host`); its workers speak the real protocol over real loopback
//! sockets (hello, ready, generations, windows of steps, commits), each on
//! a connection of its own, sealed, either to the coordinator or to the
//! host's relay (`edl_runtime::control::relay`, in the host's process), the
//! two side by side at each size. A host's workers run on one thread, an
//! event loop over their connections: a worker's compute is `--compute-ms`
//! per step of a window, a timer after which its report goes (a window's
//! compute starting when the one before it is done), and it builds no ring
//! (the all-reduce is the data plane, not the control plane). So what the
//! simulated workers cost the shared cores is the protocol's own work, not
//! a thread per worker waking for every step. The coordinator is the job's own
//! (`edl_runtime::job::Job`, run by `edl_runtime::coordinator::run`) with its
//! membership, step pipeline, ledger, store and checkpoint cadence, alone in
//! this process; the policy is a fixed one so every run sees the same events.
//! Per N:
//!
//! - coordinator CPU per step: this process's CPU (getrusage, user and
//!   system) over 64 steady-state steps;
//! - control-plane time per step: wall time per committed step less the
//!   simulated compute, over the same steps;
//! - failure recovery: one worker's connection drops mid-window; from the
//!   failure to the first committed step of the next generation;
//! - resize pause: the policy adds a worker; from the boundary to the first
//!   committed step of the generation that has it.
//!
//! Prints a table and writes `target/control-plane.svg` (the figures against N).

use edl_host_gpu::comm::sealed::Opener;
use edl_plugin_sdk::{Action, ClusterView, Hyperparams, PluginInfo};
use edl_runtime::{
    control::{
        proto::{self, FromWorker, Link, StepDone, ToWorker, Written, send},
        relay::{Relay, RelayConfig},
    },
    coordinator::{self, Progress},
    job::{Job, JobConfig, JobDirs, JobPlugins, JobSpec, Program},
    plugin::{Backend, Error, Plugin, PolicyPlugin},
    scalers::Scaler,
    worker::session::{JobAuth, Secret},
};
use std::{
    collections::HashMap,
    net::{SocketAddr, TcpStream},
    path::PathBuf,
    time::{Duration, Instant},
};

/// CPU seconds this process used, user and system (getrusage).
fn process_cpu() -> f64 {
    let (user, system) = process_cpu_split();
    user + system
}

/// CPU seconds this process used: in user space, and in the kernel (which
/// on loopback includes delivering what it sends to the receiving socket).
fn process_cpu_split() -> (f64, f64) {
    // SAFETY: an all-zero rusage is a valid value of the plain C struct the call fills.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `u` is a live rusage the call fills; nothing else is read.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    assert_eq!(rc, 0, "getrusage: {}", std::io::Error::last_os_error());
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    (secs(u.ru_utime), secs(u.ru_stime))
}

/// Each thread's CPU seconds and what it does, by thread id.
type Threads = HashMap<u64, (&'static str, f64)>;

/// CPU seconds each live thread of this process has run (the scheduler's
/// own count, `/proc/self/task/*/schedstat`, in ns), by thread id, with
/// what it does: the coordinator's thread (the process's first), the one
/// reading every control connection, the job's store, or another.
fn thread_cpu() -> Threads {
    let mut by = HashMap::new();
    let me = u64::from(std::process::id());
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return by };
    for task in tasks.flatten() {
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse::<u64>().ok()) else { continue };
        let path = task.path();
        let ns = std::fs::read_to_string(path.join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse::<f64>().ok()));
        let Some(ns) = ns else { continue };
        let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        let what = match comm.trim() {
            _ if tid == me => "the coordinator's thread",
            "edl-control-in" => "reading the control connections",
            "edl-store-keepe" => "the job's store",
            _ => "other threads",
        };
        by.insert(tid, (what, ns * 1e-9));
    }
    by
}

/// Each part's CPU per step between two readings of [`thread_cpu`] (threads
/// alive at both, by what they do), and the rest of the process's (`total`,
/// seconds, from getrusage at the same readings): threads that started or
/// ended between them. Largest first, the rest last.
fn thread_split(from: &Threads, to: &Threads, total: f64, steps: f64) -> Vec<(&'static str, f64)> {
    let mut parts: HashMap<&'static str, f64> = HashMap::new();
    for (tid, &(what, secs)) in to {
        if let Some(&(was, before)) = from.get(tid)
            && was == what
        {
            *parts.entry(what).or_insert(0.0) += secs - before;
        }
    }
    let named: f64 = parts.values().sum();
    let mut each: Vec<(&'static str, f64)> = parts.into_iter().map(|(k, v)| (k, v / steps * 1e3)).collect();
    each.sort_by(|a, b| b.1.total_cmp(&a.1));
    // Off zero (either way) by the little the process ran between its threads' reading and its own.
    each.push(("the rest", (total - named) / steps * 1e3));
    each
}

/// CLOCK_MONOTONIC in seconds: the clock `perf record -k CLOCK_MONOTONIC`
/// stamps its samples with, so that a profile can be cut to the steps measured.
fn monotonic() -> f64 {
    // SAFETY: an all-zero timespec is a valid value of the plain C struct the call fills.
    let mut t: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: `t` is a live timespec the call fills; nothing else is read.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    assert_eq!(rc, 0, "clock_gettime: {}", std::io::Error::last_os_error());
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// What a simulated host's workers share.
#[derive(Clone, Copy)]
struct Sim {
    compute: Duration,
    /// Worker id that drops its connection when it is sent this step.
    victim: Option<(u64, u64)>,
}

/// One simulated worker: its connection, read by its host's event loop.
struct SimRank {
    id: u64,
    stream: TcpStream,
    out: Link,
    opener: Opener,
    /// Opened bytes short of a whole line.
    pending: Vec<u8>,
    welcomed: bool,
    /// The generation it was last given.
    place: u64,
    /// When the compute of the windows it was given is over.
    busy_until: Instant,
}

/// What a simulated worker does once its compute is over.
enum Then {
    Report(FromWorker),
    /// The victim drops its connection.
    Drop,
}

/// Connects worker `id` to `addr` (its relay or the coordinator) and
/// proves the job's secret.
fn sim_connect(addr: SocketAddr, id: u64, auth: &JobAuth) -> anyhow::Result<SimRank> {
    use edl_host_gpu::comm::auth;
    let mut stream = TcpStream::connect(addr)?;
    let mut within = auth::Deadline::new(&mut stream, Duration::from_secs(10));
    let keys = auth::connect(&mut within, &auth.secret, &auth.claim("control", 0, id))?;
    drop(within);
    stream.set_nodelay(true)?;
    let (sealer, opener) = keys.split();
    let out = Link::new(stream.try_clone()?, Some(sealer));
    Ok(SimRank {
        id,
        stream,
        out,
        opener,
        pending: Vec::new(),
        welcomed: false,
        place: 0,
        busy_until: Instant::now(),
    })
}

impl SimRank {
    /// Reads what has arrived (until the socket has nothing more) and acts
    /// on each whole message; `Err` when the connection is to end.
    fn drain(&mut self, buf: &mut [u8], sim: Sim, due: &mut Vec<(Instant, Then)>) -> anyhow::Result<()> {
        loop {
            let got = match edl_runtime::control::inbox::recv_arrived(&self.stream, buf) {
                Ok(0) => anyhow::bail!("connection closed"),
                Ok(got) => got,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(e.into()),
            };
            self.opener.open(&buf[..got], &mut self.pending)?;
            let mut at = 0;
            while let Some(end) = self.pending[at..].iter().position(|&b| b == b'\n') {
                let msg: ToWorker = serde_json::from_slice(&self.pending[at..at + end])?;
                at += end + 1;
                self.on(msg, sim, due)?;
            }
            self.pending.drain(..at);
        }
    }

    /// Acts on one message from the coordinator. A window's compute starts
    /// when the windows before it are done, as on a real worker.
    fn on(&mut self, msg: ToWorker, sim: Sim, due: &mut Vec<(Instant, Then)>) -> anyhow::Result<()> {
        match msg {
            ToWorker::Welcome(_) if !self.welcomed => {
                self.welcomed = true;
                send(&mut self.out, &FromWorker::Ready { samples: None })?
            }
            ToWorker::Generation(g) => self.place = g.generation,
            ToWorker::Steps { generation, steps, shares } if generation == self.place => {
                let start = self.busy_until.max(Instant::now());
                if let Some(k) = steps.iter().position(|s| sim.victim == Some((self.id, s.step))) {
                    due.push((start + sim.compute * k as u32, Then::Drop));
                    self.busy_until = Instant::now() + Duration::from_secs(3600);
                    return Ok(());
                }
                self.busy_until = start + sim.compute * steps.len() as u32;
                let done = steps
                    .into_iter()
                    .zip(shares)
                    .map(|(s, share)| StepDone {
                        step: s.step,
                        epoch: s.epoch,
                        start: share.start,
                        end: share.end,
                        loss: 0.0,
                        compute_ms: sim.compute.as_secs_f64() * 1e3,
                        teacher_wait_ms: 0.0,
                        metrics: Vec::new(),
                        teacher_calls: Vec::new(),
                        grad_sq: None,
                        noise_terms: None,
                    })
                    .collect();
                let report = FromWorker::Done { generation, steps: done, setup_ms: 0.0 };
                due.push((self.busy_until, Then::Report(report)));
            }
            ToWorker::Steps { .. } | ToWorker::Commit { wait: false, .. } | ToWorker::Beat => {}
            ToWorker::Commit { step, wait: true, .. } => {
                let written = Written { step, result: Ok(PathBuf::from("(simulated)")), secs: 0.0, bytes: 0 };
                send(&mut self.out, &FromWorker::Saved { checkpoints: vec![written] })?;
            }
            ToWorker::Stop { .. } => anyhow::bail!("stopped"),
            ToWorker::Welcome(_) | ToWorker::Assigned { .. } => anyhow::bail!("a second welcome"),
        }
        Ok(())
    }
}

/// A simulated host: this program with `--sim-host`. Its workers are
/// connected (their secret proven) as it reads their ids on its standard
/// input, and then all run on one thread, an event loop over their
/// connections: each window's compute a timer, its report sent when the
/// timer is due. So the simulated workers cost the shared cores only the
/// protocol's own work, not a thread's wake-ups and switches each.
fn sim_host() -> anyhow::Result<()> {
    use mio::{Events, Interest, Poll, Token, Waker, unix::SourceFd};
    use std::io::BufRead;
    use std::os::fd::AsRawFd;
    let auth = edl_runtime::worker::session::auth_from_env()?;
    let coordinator: SocketAddr = arg("--coordinator").expect("--coordinator").parse()?;
    let compute = Duration::from_micros(arg("--compute-us").expect("--compute-us").parse()?);
    let victim = arg("--victim").and_then(|v| {
        let (id, step) = v.split_once(':')?;
        Some((id.parse().ok()?, step.parse().ok()?))
    });
    let sim = Sim { compute, victim };
    let to = match arg("--relay").as_deref() {
        Some("1") => {
            let lease = Duration::from_secs(600);
            let cfg =
                RelayConfig { coordinator, listen: "127.0.0.1:0".parse()?, auth: auth.clone(), lease, id: 1 };
            let relay = Relay::connect(cfg)?;
            let addr = relay.addr()?;
            std::thread::spawn(move || relay.serve());
            addr
        }
        _ => coordinator,
    };
    const WAKE: Token = Token(usize::MAX);
    let mut poll = Poll::new()?;
    let waker = std::sync::Arc::new(Waker::new(poll.registry(), WAKE)?);
    let (tx, rx) = std::sync::mpsc::channel::<SimRank>();
    // The bench ends its hosts by closing their standard input: the host
    // ends then, its event loop with it.
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let id = match line.map(|l| l.trim().parse::<u64>()) {
                Ok(Ok(id)) => id,
                Ok(Err(e)) => {
                    eprintln!("simulated host: a worker id that is not one: {e}");
                    std::process::exit(1);
                }
                Err(_) => break,
            };
            match sim_connect(to, id, &auth) {
                Ok(r) => {
                    if tx.send(r).is_err() || waker.wake().is_err() {
                        return;
                    }
                }
                Err(e) => eprintln!("simulated worker {id}: {e:#}"),
            }
        }
        std::process::exit(0);
    });
    let mut ranks: Vec<Option<SimRank>> = Vec::new();
    // Reports and drops by when they are due (and a number, to keep each).
    let mut timers: std::collections::BTreeMap<(Instant, u64), (usize, Then)> = Default::default();
    let mut timed = 0u64;
    let mut due = Vec::new();
    let mut events = Events::with_capacity(1024);
    let mut buf = vec![0u8; 256 << 10];
    let close = |ranks: &mut Vec<Option<SimRank>>, poll: &Poll, i: usize, why: &str| {
        if let Some(r) = ranks[i].take() {
            let _ = poll.registry().deregister(&mut SourceFd(&r.stream.as_raw_fd()));
            if why != "stopped" {
                eprintln!("simulated worker {}: {why}", r.id);
            }
        }
    };
    loop {
        let wait = timers.first_key_value().map(|((at, _), _)| at.saturating_duration_since(Instant::now()));
        if let Err(e) = poll.poll(&mut events, wait) {
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e.into());
        }
        for ev in events.iter() {
            if ev.token() == WAKE {
                while let Ok(mut r) = rx.try_recv() {
                    let i = ranks.len();
                    poll.registry().register(
                        &mut SourceFd(&r.stream.as_raw_fd()),
                        Token(i),
                        Interest::READABLE,
                    )?;
                    let hello = FromWorker::Hello {
                        worker: r.id,
                        pid: std::process::id(),
                        protocol: proto::PROTOCOL,
                    };
                    let said = send(&mut r.out, &hello);
                    ranks.push(Some(r));
                    if let Err(e) = said {
                        close(&mut ranks, &poll, i, &e.to_string());
                    }
                }
                continue;
            }
            let i = ev.token().0;
            let Some(r) = ranks.get_mut(i).and_then(Option::as_mut) else { continue };
            let read = r.drain(&mut buf, sim, &mut due);
            for (at, then) in due.drain(..) {
                timers.insert((at, timed), (i, then));
                timed += 1;
            }
            if let Err(e) = read {
                close(&mut ranks, &poll, i, &format!("{e:#}"));
            }
        }
        let now = Instant::now();
        while let Some(entry) = timers.first_entry().filter(|e| e.key().0 <= now) {
            let (i, then) = entry.remove();
            let Some(r) = ranks.get_mut(i).and_then(Option::as_mut) else { continue };
            match then {
                Then::Drop => close(&mut ranks, &poll, i, "stopped"),
                Then::Report(msg) => {
                    if let Err(e) = send(&mut r.out, &msg) {
                        close(&mut ranks, &poll, i, &e.to_string());
                    }
                }
            }
        }
    }
}

/// Starts simulated workers on `hosts` host processes, round robin.
struct SimScaler {
    sim: Sim,
    hosts: usize,
    relay: bool,
    started: Vec<(std::process::Child, std::process::ChildStdin)>,
}

impl SimScaler {
    fn start_hosts(&mut self, coordinator: &str, auth: &JobAuth) -> anyhow::Result<()> {
        for _ in 0..self.hosts {
            let mut cmd = std::process::Command::new(std::env::current_exe()?);
            cmd.args(["--sim-host", "--coordinator", coordinator])
                .args(["--compute-us", &self.sim.compute.as_micros().to_string()])
                .args(["--relay", if self.relay { "1" } else { "0" }])
                .env("EDL_JOB", &auth.job)
                .env("EDL_JOB_SECRET", auth.secret.to_hex())
                .stdin(std::process::Stdio::piped());
            if let Some((id, step)) = self.sim.victim {
                cmd.args(["--victim", &format!("{id}:{step}")]);
            }
            let mut child = cmd.spawn()?;
            let stdin = child.stdin.take().expect("piped");
            self.started.push((child, stdin));
        }
        Ok(())
    }
}

impl Scaler for SimScaler {
    fn spawn(&mut self, id: u64, coordinator: &str, auth: &JobAuth) -> anyhow::Result<()> {
        use std::io::Write;
        if self.started.is_empty() {
            self.start_hosts(coordinator, auth)?;
        }
        let host = (id as usize - 1) % self.hosts;
        writeln!(self.started[host].1, "{id}")?;
        Ok(())
    }
    fn stop(&mut self, _id: u64, _grace: Duration) {}
}

impl Drop for SimScaler {
    fn drop(&mut self) {
        for (mut child, stdin) in self.started.drain(..) {
            drop(stdin);
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Adds one worker at the first decision from `at` on; holds otherwise.
struct AddOne {
    info: PluginInfo,
    at: u64,
    done: bool,
}

impl Plugin for AddOne {
    fn info(&self) -> &PluginInfo {
        &self.info
    }
    fn backend(&self) -> Backend {
        Backend::Native
    }
}

impl PolicyPlugin for AddOne {
    fn decide(&mut self, view: &ClusterView) -> Result<Vec<Action>, Error> {
        if !self.done && view.step >= self.at && view.world_size < view.max_workers {
            self.done = true;
            return Ok(vec![Action::ScaleOut(1)]);
        }
        Ok(vec![Action::Hold])
    }
}

struct Figures {
    n: u32,
    hosts: usize,
    relay: bool,
    cpu_per_step_ms: f64,
    /// Of it, in the kernel.
    kernel_per_step_ms: f64,
    /// Of it, by thread (what each does), largest first, then the rest.
    threads_per_step_ms: Vec<(&'static str, f64)>,
    control_ms: f64,
    recovery_ms: f64,
    /// The recovery's phases, as the job's report has them.
    phases: Option<edl_runtime::leader::record::Recovery>,
    resize_ms: f64,
    /// The coordinator's CPU (the bench process's) over each pause.
    recovery_cpu_ms: f64,
    resize_cpu_ms: f64,
}

/// Steady-state steps measured, and where the events fall.
const FROM: u64 = 24;
const TO: u64 = FROM + 64;
const KILL_AT: u64 = TO + 10;
const ADD_AT: u64 = KILL_AT + 24;

fn run(n: u32, hosts: usize, relay: bool, compute: Duration) -> anyhow::Result<Figures> {
    let dir = tempfile::tempdir()?;
    let spec = JobSpec {
        job: format!("scale-{n}"),
        samples: 4000,
        seed: 1,
        epochs: 3,
        program: Program::External { command: vec!["(simulated)".into()] },
        temperature: 4.0,
        alpha: 0.7,
        teachers: None,
        teacher_model_name: String::new(),
        transform: None,
        transform_config: Vec::new(),
        collective_timeout_ms: 5000,
        gradients_in_clear: false,
        checkpoint_dir: dir.path().join("checkpoints"),
        keep_checkpoints: 2,
        step_delay_ms: 0,
        device: "cpu".into(),
        plugin_deadline_ms: 100,
        plugin_memory_mib: 64,
        allow_native: false,
        teacher_wait_ms: 20_000,
        // The simulated workers send no heartbeats: they are heard through
        // their reports, and a joiner may wait long at this scale.
        worker_lease_ms: 600_000,
        worker_reconnect_ms: 0,
        teacher_access: Default::default(),
        teacher_io: Default::default(),
        teacher_calls: Default::default(),
        follow: None,
        protocol: proto::PROTOCOL,
        ps: None,
    };
    // The highest id: the last rank.
    let sim = Sim { compute, victim: Some((n as u64, KILL_AT)) };
    let cfg = JobConfig {
        standby: false,
        restart: false,
        max_restarts: 1,
        spec: spec.clone(),
        min_workers: n.saturating_sub(1).max(1),
        max_workers: n,
        initial_workers: n,
        warm_spares: 0,
        decide_every: 8,
        checkpoint_every: None,
        checkpoint_interval: Duration::from_secs(30),
        hyper: Hyperparams { global_batch: 64, local_batch: 64, lr: 0.05, momentum: 0.9 },
        batch_max: None,
        store: "memory".into(),
        step_timeout: Duration::from_secs(120),
        join_timeout: Duration::from_secs(120),
        loop_stall: None,
        price_per_worker_hour: 0.0,
        secret: Secret::generate()?,
        addresses: Default::default(),
    };
    let info = PluginInfo { name: "add-one".into(), version: "0".into(), description: String::new() };
    let policy = Box::new(AddOne { info, at: ADD_AT, done: false });
    let mut marks: HashMap<u64, (Instant, f64)> = HashMap::new();
    let mut kernel: HashMap<u64, f64> = HashMap::new();
    // At each mark: every thread's CPU, and the process's.
    let mut threads: HashMap<u64, (Threads, f64)> = HashMap::new();
    // The process's CPU at the last two commits: a scale event comes just
    // after its generation's first commit, so their difference is the
    // coordinator's work from the last commit before the pause to the first after.
    let (mut before, mut last) = (0.0, 0.0);
    let mut pause_cpu: HashMap<&'static str, f64> = HashMap::new();
    let marks_wanted = std::env::var_os("EDL_BENCH_MARKS").is_some();
    let mut progress = |p: Progress| match p {
        Progress::Step(r) => {
            if marks_wanted {
                // For `perf report --time A,B` of a run recorded with `-k
                // CLOCK_MONOTONIC`: the steady steps, a pause (from the
                // commit before its scale event to the one after).
                eprintln!("step {} at {:.6}", r.step, monotonic());
            }
            (before, last) = (last, process_cpu());
            if r.step == FROM || r.step == TO {
                // The threads, then the process: the figure per step and its
                // parts by thread come from the same readings.
                let each = thread_cpu();
                let (user, system) = process_cpu_split();
                marks.insert(r.step, (Instant::now(), user + system));
                kernel.insert(r.step, system);
                threads.insert(r.step, (each, user + system));
            }
        }
        Progress::Scale(e) => {
            if marks_wanted {
                eprintln!("scale {} at {:.6}", e.reason, monotonic());
            }
            for what in ["lost", "policy"] {
                if e.reason.contains(what) {
                    pause_cpu.entry(what).or_insert((last - before) * 1e3);
                }
            }
        }
        _ => {}
    };
    let dirs = JobDirs::new(&spec.job, Some(spec.checkpoint_dir.clone()));
    let plugins = JobPlugins { policy, adapter: None };
    let job = Job::assemble(
        cfg,
        &dirs,
        None,
        plugins,
        Box::new(SimScaler { sim, hosts, relay, started: Vec::new() }),
        None,
    )?;
    let outcome = coordinator::run(job, &mut progress)?;
    let ((t0, c0), (t1, c1)) = (marks[&FROM], marks[&TO]);
    let steps = (TO - FROM) as f64;
    let wall = t1.duration_since(t0).as_secs_f64() / steps;
    let event = |what: &str| {
        outcome
            .scale_events
            .iter()
            .find(|e| e.reason.contains(what))
            .ok_or_else(|| anyhow::anyhow!("N = {n}: no {what:?} event in {:?}", outcome.scale_events))
    };
    let cpu = |what: &str| pause_cpu.get(what).copied().unwrap_or(f64::NAN);
    Ok(Figures {
        n,
        hosts,
        relay,
        cpu_per_step_ms: (c1 - c0) / steps * 1e3,
        kernel_per_step_ms: (kernel[&TO] - kernel[&FROM]) / steps * 1e3,
        threads_per_step_ms: {
            let ((from, c0), (to, c1)) = (&threads[&FROM], &threads[&TO]);
            thread_split(from, to, c1 - c0, steps)
        },
        control_ms: (wall - compute.as_secs_f64()) * 1e3,
        recovery_ms: event("lost")?.pause_ms,
        phases: event("lost")?.recovery,
        resize_ms: event("policy")?.pause_ms,
        recovery_cpu_ms: cpu("lost"),
        resize_cpu_ms: cpu("policy"),
    })
}

/// The least-squares line `a + b x` through `points` (two or more, not all at one x).
fn fit_line(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let n = points.len() as f64;
    let (sx, sy) = points.iter().fold((0.0, 0.0), |(sx, sy), (x, y)| (sx + x, sy + y));
    let (mx, my) = (sx / n, sy / n);
    let sxx: f64 = points.iter().map(|(x, _)| (x - mx) * (x - mx)).sum();
    let sxy: f64 = points.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
    (points.len() >= 2 && sxx > 0.0).then(|| (my - sxy / sxx * mx, sxy / sxx))
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

/// The four figures against N, both axes logarithmic.
fn plot(figures: &[Figures], path: &std::path::Path) -> std::io::Result<()> {
    let (w, h, m) = (640.0, 380.0, 60.0);
    type Series = (&'static str, &'static str, fn(&Figures) -> f64);
    let series: [Series; 4] = [
        ("coordinator CPU per step", "#1f77b4", |f| f.cpu_per_step_ms),
        ("control-plane time per step", "#ff7f0e", |f| f.control_ms),
        ("failure recovery", "#d62728", |f| f.recovery_ms),
        ("resize pause", "#2ca02c", |f| f.resize_ms),
    ];
    let values = || figures.iter().flat_map(|f| series.iter().map(move |s| (s.2)(f).max(1e-3)));
    let lo = values().fold(f64::INFINITY, f64::min).log10().floor();
    let hi = values().fold(1e-3, f64::max).log10().ceil().max(lo + 1.0);
    let (n_lo, n_hi) = (
        figures.iter().map(|f| f.n).min().unwrap_or(1).max(1) as f64,
        figures.iter().map(|f| f.n).max().unwrap_or(2).max(2) as f64,
    );
    let x = |n: f64| m + (n.log2() - n_lo.log2()) / (n_hi.log2() - n_lo.log2()).max(1e-9) * (w - 2.0 * m);
    let y = |v: f64| h - m - (v.max(1e-3).log10() - lo) / (hi - lo) * (h - 2.0 * m);
    let mut svg = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' font-family='sans-serif' font-size='11'>\
         <rect width='100%' height='100%' fill='white'/>\
         <line x1='{m}' y1='{b}' x2='{r}' y2='{b}' stroke='black'/><line x1='{m}' y1='{m}' x2='{m}' y2='{b}' stroke='black'/>\
         <text x='{cx}' y='{bot}' text-anchor='middle'>simulated workers N</text>\
         <text x='12' y='{cy}' transform='rotate(-90 12 {cy})' text-anchor='middle'>ms (log scale)</text>",
        b = h - m,
        r = w - m,
        cx = w / 2.0,
        bot = h - 14.0,
        cy = h / 2.0,
    );
    let mut e = lo;
    while e <= hi {
        let v = 10f64.powf(e);
        svg += &format!(
            "<line x1='{m}' y1='{yy:.1}' x2='{r}' y2='{yy:.1}' stroke='#ddd'/><text x='{t}' y='{yy:.1}' text-anchor='end'>{v}</text>",
            yy = y(v),
            r = w - m,
            t = m - 4.0
        );
        e += 1.0;
    }
    for f in figures {
        svg += &format!(
            "<text x='{:.1}' y='{}' text-anchor='middle'>{}</text>",
            x(f.n as f64),
            h - m + 14.0,
            f.n
        );
    }
    for (i, (name, color, get)) in series.iter().enumerate() {
        // Solid: through a relay per host; dashed: each worker directly.
        for relay in [false, true] {
            let pts: Vec<String> = figures
                .iter()
                .filter(|f| f.relay == relay)
                .map(|f| format!("{:.1},{:.1}", x(f.n as f64), y(get(f))))
                .collect();
            let dash = if relay { "" } else { " stroke-dasharray='5 4'" };
            svg += &format!(
                "<polyline fill='none' stroke='{color}' stroke-width='2'{dash} points='{}'/>",
                pts.join(" ")
            );
        }
        svg += &format!("<text x='{}' y='{}' fill='{color}'>{name}</text>", m + 10.0, 16.0 + 13.0 * i as f64);
    }
    svg += &format!(
        "<text x='{}' y='{}' fill='#555'>solid: a relay per host; dashed: each worker directly</text>",
        m + 10.0,
        16.0 + 13.0 * series.len() as f64
    );
    svg += "</svg>";
    std::fs::write(path, svg)
}

fn main() -> anyhow::Result<()> {
    if std::env::args().any(|a| a == "--sim-host") {
        return sim_host();
    }
    // `cargo bench` passes --bench; `cargo test --benches` does not: nothing to measure then.
    if !std::env::args().any(|a| a == "--bench") {
        return Ok(());
    }
    let sizes: Vec<(u32, usize)> = arg("--sizes")
        .unwrap_or_else(|| "64:8,256:16,1024:32,4096:64".into())
        .split(',')
        .map(|s| {
            let (n, h) = s.trim().split_once(':').unwrap_or((s.trim(), "8"));
            Ok::<_, anyhow::Error>((n.parse()?, h.parse()?))
        })
        .collect::<Result<_, _>>()?;
    let compute = Duration::from_secs_f64(arg("--compute-ms").map_or(Ok(2.0), |s| s.parse())? / 1e3);
    // `--modes relay` (or `direct`) runs one side only.
    let modes = arg("--modes").unwrap_or_else(|| "direct,relay".into());
    let modes: Vec<bool> = [("direct", false), ("relay", true)]
        .into_iter()
        .filter(|(name, _)| modes.split(',').any(|m| m.trim() == *name))
        .map(|(_, relay)| relay)
        .collect();
    println!("simulated compute {:?} per step, global batch 64, policy decisions every 8 steps", compute);
    println!(
        "| N | hosts | workers reach the coordinator | coordinator CPU per step | control-plane time per step | failure recovery | resize pause |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut figures = Vec::new();
    for (n, hosts) in sizes {
        for &relay in &modes {
            let f = run(n, hosts, relay, compute)?;
            println!(
                "| {} | {} | {} | {:.3} ms | {:.3} ms | {:.0} ms | {:.0} ms |",
                f.n,
                f.hosts,
                if f.relay { "through a relay per host" } else { "each directly" },
                f.cpu_per_step_ms,
                f.control_ms,
                f.recovery_ms,
                f.resize_ms
            );
            figures.push(f);
        }
    }
    println!(
        "\n| N | workers reach the coordinator | failure recovery: detect / survivors out / formed / first step | \
         coordinator CPU in it | resize pause | coordinator CPU in it |"
    );
    println!("|---|---|---|---|---|---|");
    for f in &figures {
        let phases = f.phases.map_or("-".into(), |p| {
            format!("{:.0} / {:.0} / {:.0} / {:.0} ms", p.detect_ms, p.abort_ms, p.form_ms, p.first_step_ms)
        });
        println!(
            "| {} | {} | {phases} | {:.1} ms | {:.0} ms | {:.1} ms |",
            f.n,
            if f.relay { "through a relay per host" } else { "each directly" },
            f.recovery_cpu_ms,
            f.resize_ms,
            f.resize_cpu_ms
        );
    }
    // On loopback the kernel delivers what the coordinator sends to the
    // receiving sockets in the sender's context: part of its system time
    // is the relays' and workers' receiving, which a cluster does on their hosts.
    for f in &figures {
        let threads: Vec<String> =
            f.threads_per_step_ms.iter().map(|(t, ms)| format!("{t} {ms:.3} ms")).collect();
        println!(
            "N = {}, {}: coordinator CPU per step {:.3} ms, of it in the kernel {:.3} ms; by thread: {}",
            f.n,
            if f.relay { "through a relay per host" } else { "each directly" },
            f.cpu_per_step_ms,
            f.kernel_per_step_ms,
            threads.join(", ")
        );
    }
    for relay in modes {
        let points: Vec<(f64, f64)> = figures
            .iter()
            .filter(|f| f.relay == relay)
            .map(|f| (f64::from(f.n), f.cpu_per_step_ms))
            .collect();
        if let Some((a, b)) = fit_line(&points) {
            let how = if relay { "through a relay per host" } else { "each directly" };
            println!(
                "coordinator CPU per step, workers {how}: {a:.3} ms + {:.3} us x N (least squares over N = {}); \
                 at N = 16384: {:.2} ms",
                b * 1e3,
                points.iter().map(|p| p.0.to_string()).collect::<Vec<_>>().join(", "),
                a + b * 16384.0
            );
        }
    }
    let svg = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/control-plane.svg");
    plot(&figures, &svg)?;
    println!("plot: {}", svg.display());
    Ok(())
}
