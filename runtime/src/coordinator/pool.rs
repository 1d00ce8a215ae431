//! The job's teacher pool, sized as the students need it.
//!
//! At each look (every `--teacher-decide-secs`) the pool reads each
//! teacher's own statistics over the window (utilisation, queue, rows per
//! second, latencies, errors: [`crate::distill::stats`]), takes the share
//! of the students' compute spent waiting for soft labels, and asks the
//! teacher policy ([`PoolPolicy`]) how many teachers there should be. The
//! answer is clamped to `--min-teachers..=--max-teachers`; teachers are
//! started or stopped (a teacher told to go gets SIGTERM, deregisters,
//! serves on while students stop sending to it, then finishes what it holds)
//! through a [`TeacherLauncher`]. Students find the
//! teachers as they come and go through the job's store (their
//! registrations), so a pool that changes size needs a shared store.
//! Each change is a [`TeacherEvent`] in the report, with its reason.

use crate::distill::oip::GrpcInferenceServiceClient;
pub use crate::distill::reader::PoolSettings;
use crate::distill::reader::host_port;
use crate::distill::stats::{self, Reading, TeacherRequests, quantile_ms};
use crate::leader::record::TeacherHandle;
use anyhow::Result;
use edl_plugin_sdk::{TeacherPlan, TeacherStats, TeacherView};
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tonic::transport::Channel;

/// A change of the pool's size.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct TeacherEvent {
    /// The committed step and the seconds since the job started.
    pub step: u64,
    pub secs: f64,
    pub from: u32,
    pub to: u32,
    pub reason: String,
}

/// One decision of the teacher policy: what it saw and what it answered
/// (or why it failed), and the size the pool then kept (within its
/// bounds). A job's decisions, in its report, are a trace `plugin replay
/// --teacher-policy` replays.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct TeacherDecision {
    pub secs: f64,
    pub view: TeacherView,
    pub plan: Option<TeacherPlan>,
    pub error: Option<String>,
    /// The size kept: the plan's within the bounds (the view's count after an error).
    pub teachers: u32,
}

/// The decisions a report keeps at most (the newest).
const DECISIONS_KEPT: usize = 5_000;

/// What the pool did over a job: its changes and its policy's decisions.
#[derive(Clone, Debug, Default)]
pub struct PoolRecord {
    pub events: Vec<TeacherEvent>,
    pub decisions: Vec<TeacherDecision>,
}

/// What sizes the pool: the job's teacher policy plugin.
pub trait PoolPolicy: Send {
    /// How many teachers, and requests in flight at each; an error leaves
    /// the pool as it is, and is said.
    fn decide(&mut self, view: &TeacherView) -> Result<TeacherPlan, String>;
}

/// Starts and stops the job's teachers.
pub trait TeacherLauncher: Send {
    /// Starts a teacher; returns the address it serves on once it does.
    fn start(&mut self) -> Result<String>;
    /// Tells the teacher at `addr` to go (it deregisters first).
    fn stop(&mut self, addr: &str);
    /// Teachers that exited on their own since the last call: (address,
    /// how). They are no longer the launcher's.
    fn exited(&mut self) -> Vec<(String, String)>;
    /// Tells the students the pool's settings (through the job's store).
    fn publish(&mut self, settings: PoolSettings) -> Result<()>;
    /// Takes over a teacher the coordinator before started (it runs on);
    /// returns its address once it answers.
    fn adopt(&mut self, teacher: &TeacherHandle) -> Result<String> {
        anyhow::bail!("teachers of {} cannot be taken over", teacher.addr)
    }
    /// The coordinator was deposed: the teachers that outlive it are the
    /// new leader's; they are let go, not stopped.
    fn release(&mut self) {}
}

/// The pool's bounds and cadence.
#[derive(Clone, Debug)]
pub struct PoolBounds {
    pub min: u32,
    pub max: u32,
    /// Time between two looks.
    pub every: Duration,
    pub price_per_teacher_hour: f64,
    /// Requests each student keeps in flight at each teacher at the start.
    pub in_flight: u32,
}

/// One teacher of the pool.
struct Pooled {
    id: u64,
    addr: String,
    client: Option<GrpcInferenceServiceClient<Channel>>,
    last: Option<Reading>,
    /// Its statistics could not be read, and that was said.
    warned: bool,
}

/// What the students did over the window, as the coordinator measured it.
#[derive(Clone, Debug, Default)]
pub struct Students {
    pub step: u64,
    /// Share of their compute spent waiting for soft labels (None: no step
    /// was committed in the window).
    pub wait_share: Option<f64>,
    pub throughput: f64,
    pub world: u32,
    /// The world size the scaling policy last asked for.
    pub planned: u32,
    /// What their requests to each teacher did (by `host:port`).
    pub calls: BTreeMap<String, TeacherRequests>,
}

impl Students {
    /// The later of two tellings, with the requests of both.
    fn then(mut self, later: Students) -> Students {
        let mut calls = std::mem::take(&mut self.calls);
        for (at, c) in later.calls {
            calls.entry(at).or_default().merge(c);
        }
        Students { calls, ..later }
    }
}

/// The teacher pool of a job.
pub struct TeacherPool {
    policy: Box<dyn PoolPolicy>,
    launcher: Box<dyn TeacherLauncher>,
    bounds: PoolBounds,
    teachers: Vec<Pooled>,
    next_id: u64,
    in_flight: u32,
    changed: Instant,
    t0: Instant,
    access: StatsAccess,
    events: Vec<TeacherEvent>,
    /// Where the statistics are read.
    rt: tokio::runtime::Runtime,
    /// The size the pool keeps (the policy's last, within the bounds):
    /// teachers that exit are replaced up to it.
    target: u32,
    /// Starts held back after teachers kept exiting or failing to start.
    starts: Starts,
    decisions: std::collections::VecDeque<TeacherDecision>,
    /// The view of the newest decision, for the watchers (taken once told).
    last_view: Option<TeacherView>,
    /// A standby's pool: it starts nothing until its coordinator leads
    /// the job and takes over the teachers of the one before.
    held: bool,
    /// Each teacher's capacity (rows/s at full use, by `host:port`), as
    /// measured, and as the students were last told it.
    capacity: BTreeMap<String, f64>,
    told_capacity: BTreeMap<String, f64>,
}

/// When teachers may be started: not while they keep exiting or failing
/// to start (then after a pause that doubles each time, up to 5 minutes).
#[derive(Debug)]
struct Starts {
    /// Exits and failed starts of the last minute.
    troubles: std::collections::VecDeque<Instant>,
    held_until: Option<Instant>,
    pause: Duration,
}

/// Troubles within a minute that hold starts back.
const TROUBLES: usize = 3;

impl Starts {
    fn new() -> Self {
        Starts { troubles: Default::default(), held_until: None, pause: Duration::from_secs(5) }
    }

    /// Whether a teacher may be started now.
    fn open(&self) -> bool {
        self.held_until.is_none_or(|t| Instant::now() >= t)
    }

    /// A teacher exited or failed to start; returns the pause starts are
    /// held back for, when that made too many.
    fn trouble(&mut self) -> Option<Duration> {
        let now = Instant::now();
        self.troubles.push_back(now);
        while self.troubles.front().is_some_and(|t| now.duration_since(*t) > Duration::from_secs(60)) {
            self.troubles.pop_front();
        }
        if self.troubles.len() < TROUBLES {
            return None;
        }
        self.troubles.clear();
        let pause = self.pause;
        self.held_until = Some(now + pause);
        self.pause = (pause * 2).min(Duration::from_secs(300));
        Some(pause)
    }
}

/// How the pool reaches its teachers' statistics: their token, and the
/// certificate (PEM) they serve TLS with, if they do.
#[derive(Clone, Debug, Default)]
pub struct StatsAccess {
    pub token: Option<String>,
    pub ca_pem: Option<String>,
}

/// How long reading one teacher's statistics may take.
const STATS_WITHIN: Duration = Duration::from_secs(2);

impl TeacherPool {
    /// A pool of the teachers serving at `addrs` (started by `launcher`),
    /// sized from now on by `policy` within `bounds`.
    pub fn new(
        policy: Box<dyn PoolPolicy>,
        launcher: Box<dyn TeacherLauncher>,
        bounds: PoolBounds,
        addrs: Vec<String>,
        access: StatsAccess,
    ) -> Result<Self> {
        let now = Instant::now();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let mut pool = TeacherPool {
            policy,
            launcher,
            in_flight: bounds.in_flight.max(1),
            bounds,
            teachers: Vec::new(),
            next_id: 0,
            changed: now,
            t0: now,
            access,
            events: Vec::new(),
            rt,
            target: 0,
            starts: Starts::new(),
            decisions: Default::default(),
            last_view: None,
            held: false,
            capacity: BTreeMap::new(),
            told_capacity: BTreeMap::new(),
        };
        for addr in addrs {
            pool.adopt(addr);
        }
        pool.target = pool.teachers.len() as u32;
        Ok(pool)
    }

    fn adopt(&mut self, addr: String) {
        let client = self.client(&addr);
        if let Err(e) = &client {
            tracing::warn!("teacher {addr}: its statistics cannot be read: {e}");
        }
        self.teachers.push(Pooled { id: self.next_id, addr, client: client.ok(), last: None, warned: false });
        self.next_id += 1;
    }

    /// A gRPC client of the teacher at `addr` (TLS when the pool's teachers serve it).
    fn client(&self, addr: &str) -> Result<GrpcInferenceServiceClient<Channel>, tonic::transport::Error> {
        use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
        // An endpoint may carry its scheme, model and output kind.
        let tls = self.access.ca_pem.is_some() || addr.starts_with("grpcs://");
        let scheme = if tls { "https" } else { "http" };
        let _in = self.rt.enter();
        let mut ep =
            Endpoint::from_shared(format!("{scheme}://{}", crate::distill::reader::host_port(addr)))?;
        if tls {
            ep = ep.tls_config(match &self.access.ca_pem {
                Some(ca) => ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)),
                None => ClientTlsConfig::new().with_webpki_roots(),
            })?;
        }
        Ok(GrpcInferenceServiceClient::new(ep.connect_timeout(STATS_WITHIN).connect_lazy()))
    }

    /// Starts and stops nothing until [`TeacherPool::take_over`]: the pool
    /// of a standby, whose coordinator takes the teachers of the active one
    /// over when it takes the job over.
    pub fn hold(&mut self) {
        self.held = true;
    }

    /// The coordinator leads the job: the teachers of the coordinator
    /// before (`left`) are taken over where they still answer, and the pool
    /// goes on from them. Returns what could not be taken over.
    pub fn take_over(&mut self, left: Vec<TeacherHandle>) -> (Option<TeacherEvent>, Vec<String>) {
        let was_held = std::mem::replace(&mut self.held, false);
        let from = self.teachers.len() as u32;
        let mut said = Vec::new();
        for h in &left {
            match self.launcher.adopt(h) {
                Ok(addr) => self.adopt(addr),
                Err(e) => said
                    .push(format!("teacher {} of the coordinator before is not taken over: {e:#}", h.addr)),
            }
        }
        let to = self.teachers.len() as u32;
        if was_held {
            self.target = to;
        } else {
            self.target = self.target.max(to);
        }
        if to == from {
            return (None, said);
        }
        self.changed = Instant::now();
        let event = TeacherEvent {
            step: 0,
            secs: self.t0.elapsed().as_secs_f64(),
            from,
            to,
            reason: format!("{} teacher(s) of the coordinator before taken over", to - from),
        };
        self.events.push(event.clone());
        (Some(event), said)
    }

    /// The teachers serving now.
    pub fn addrs(&self) -> Vec<String> {
        self.teachers.iter().map(|t| t.addr.clone()).collect()
    }

    pub fn events(&self) -> &[TeacherEvent] {
        &self.events
    }

    /// Requests each student keeps in flight at each teacher.
    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// Replaces teachers that exited; then, given what the students did
    /// over a window (`students`: the coordinator tells it every
    /// `bounds.every`), reads the teachers' statistics, asks the policy,
    /// and starts or stops teachers. Returns the change made, and what went
    /// wrong on the way (said, not fatal).
    pub fn look(&mut self, at: u64, students: Option<Students>) -> (Option<TeacherEvent>, Vec<String>) {
        if self.held {
            return (None, Vec::new());
        }
        if let Some(replaced) = self.replace_exited(at) {
            return replaced;
        }
        let Some(students) = students else { return (None, Vec::new()) };
        if let Some(refused) = self.take_out_refused(&students) {
            return refused;
        }
        let stats = self.read_stats();
        self.measure_capacity(&stats);
        let view = self.view(&students, stats);
        self.last_view = Some(view.clone());
        let answer = self.policy.decide(&view);
        let kept = match &answer {
            Ok(p) => p.teachers.clamp(self.bounds.min, self.bounds.max),
            Err(_) => view.teacher_count,
        };
        if self.decisions.len() >= DECISIONS_KEPT {
            self.decisions.pop_front();
        }
        self.decisions.push_back(TeacherDecision {
            secs: self.t0.elapsed().as_secs_f64(),
            view: view.clone(),
            plan: answer.as_ref().ok().copied(),
            error: answer.as_ref().err().cloned(),
            teachers: kept,
        });
        let plan = match answer {
            Ok(p) => p,
            Err(e) => {
                return (
                    None,
                    vec![format!("the teacher policy failed; the pool stays at {}: {e}", view.teacher_count)],
                );
            }
        };
        let mut said = self.tell_settings(plan.in_flight_per_teacher.clamp(1, 64));
        let to = plan.teachers.clamp(self.bounds.min, self.bounds.max);
        self.target = to;
        let from = self.teachers.len() as u32;
        if to == from {
            return (None, said);
        }
        let reason = reason_of(&view, from, to);
        said.extend(self.start_up_to(to));
        while (self.teachers.len() as u32) > to {
            // The newest goes first: the oldest have warm caches and clients.
            let t = self.teachers.pop().expect("more than `to`");
            self.launcher.stop(&t.addr);
        }
        let now = self.teachers.len() as u32;
        if now == from {
            return (None, said);
        }
        self.changed = Instant::now();
        let event = TeacherEvent {
            step: students.step,
            secs: self.t0.elapsed().as_secs_f64(),
            from,
            to: now,
            reason,
        };
        self.events.push(event.clone());
        (Some(event), said)
    }

    /// Starts teachers up to `to`, while starts are not held back; says
    /// what did not start.
    fn start_up_to(&mut self, to: u32) -> Vec<String> {
        let mut said = Vec::new();
        while (self.teachers.len() as u32) < to && self.starts.open() {
            match self.launcher.start() {
                Ok(addr) => self.adopt(addr),
                Err(e) => {
                    said.push(format!("a teacher did not start: {e:#}"));
                    if let Some(pause) = self.starts.trouble() {
                        said.push(format!("teachers keep failing: none is started for {pause:?}"));
                    }
                    break;
                }
            }
        }
        said
    }

    /// Teachers that exited on their own leave the pool, and others are
    /// started in their place, up to the pool's size: a replacement, not the
    /// policy's decision. Teachers that keep exiting hold starts back.
    fn replace_exited(&mut self, step: u64) -> Option<PoolNews> {
        let exited = self.launcher.exited();
        let from = self.teachers.len() as u32;
        let wanted = self.target.max(self.bounds.min);
        if exited.is_empty() && (from >= wanted || !self.starts.open()) {
            return None;
        }
        let mut said = Vec::new();
        for (addr, how) in &exited {
            self.teachers.retain(|t| t.addr != *addr);
            said.push(format!("{how}; the pool starts another in its place"));
            if let Some(pause) = self.starts.trouble() {
                said.push(format!("teachers keep exiting: none is started for {pause:?}"));
            }
        }
        let left = self.teachers.len() as u32;
        said.extend(self.start_up_to(wanted));
        let to = self.teachers.len() as u32;
        if to == from && exited.is_empty() {
            return Some((None, said));
        }
        let lost: Vec<&str> = exited.iter().map(|(a, _)| a.as_str()).collect();
        let reason = match (lost.is_empty(), to > left) {
            (false, true) => format!("teacher {} exited; replaced", lost.join(", ")),
            (false, false) => format!("teacher {} exited; none started in its place yet", lost.join(", ")),
            (true, _) => "teachers started again, up to the pool's size".to_string(),
        };
        let event = TeacherEvent { step, secs: self.t0.elapsed().as_secs_f64(), from, to, reason };
        self.events.push(event.clone());
        Some((Some(event), said))
    }

    /// Teachers of the pool that students refused (a wrong shape, class
    /// count or model: nothing a retry fixes) are stopped and leave the
    /// pool, named; another is started in their place at the next look,
    /// held back as teachers that keep exiting are.
    fn take_out_refused(&mut self, students: &Students) -> Option<PoolNews> {
        let refused: Vec<(String, String)> = self
            .teachers
            .iter()
            .filter_map(|t| {
                let why = students.calls.get(&host_port(&t.addr))?.refused.as_ref()?;
                Some((t.addr.clone(), why.clone()))
            })
            .collect();
        if refused.is_empty() {
            return None;
        }
        let from = self.teachers.len() as u32;
        let mut said = Vec::new();
        for (addr, why) in &refused {
            self.teachers.retain(|t| t.addr != *addr);
            self.launcher.stop(addr);
            said.push(format!("teacher {addr} is taken out of the pool: the students refused it: {why}"));
            if let Some(pause) = self.starts.trouble() {
                said.push(format!("teachers keep being refused: none is started for {pause:?}"));
            }
        }
        let names: Vec<&str> = refused.iter().map(|(a, _)| a.as_str()).collect();
        let event = TeacherEvent {
            step: students.step,
            secs: self.t0.elapsed().as_secs_f64(),
            from,
            to: self.teachers.len() as u32,
            reason: format!("teacher {} refused by the students; taken out", names.join(", ")),
        };
        self.events.push(event.clone());
        Some((Some(event), said))
    }

    /// Each teacher's statistics over the window since the last look (a
    /// teacher that cannot be read, or was read for the first time, gives none).
    fn read_stats(&mut self) -> Vec<TeacherStats> {
        let token = self.access.token.clone();
        let mut out = Vec::new();
        for t in &mut self.teachers {
            let Some(client) = t.client.as_mut() else { continue };
            let now = match self.rt.block_on(stats::read(client, token.as_deref(), STATS_WITHIN)) {
                Ok(now) => now,
                Err(e) => {
                    if !t.warned {
                        t.warned = true;
                        tracing::warn!(
                            "teacher {}: its statistics cannot be read ({e}); the policy sees it without",
                            t.addr
                        );
                    }
                    continue;
                }
            };
            if let Some(w) = t.last.as_ref().and_then(|before| now.since(before, t.id)) {
                out.push(w);
            }
            t.last = Some(now);
        }
        out
    }

    /// Tells the students the requests to keep in flight at each teacher
    /// and the teachers' capacities, where either changed; says what.
    fn tell_settings(&mut self, in_flight: u32) -> Vec<String> {
        let moved = capacity_moved(&self.told_capacity, &self.capacity);
        if in_flight == self.in_flight && !moved {
            return Vec::new();
        }
        let settings = PoolSettings { in_flight_per_teacher: in_flight, capacity: self.capacity.clone() };
        if let Err(e) = self.launcher.publish(settings) {
            return vec![format!("the students could not be told the pool's settings: {e:#}")];
        }
        let mut said = Vec::new();
        if in_flight != self.in_flight {
            said.push(format!(
                "students keep {in_flight} requests in flight at each teacher (were {})",
                self.in_flight
            ));
        }
        self.in_flight = in_flight;
        self.told_capacity = self.capacity.clone();
        said
    }

    /// Each teacher's capacity from its window: the rows it answered per
    /// second of its model's compute. Measured only where it computed a
    /// fifth of the window or more (an idle teacher's rate says little);
    /// teachers gone are forgotten.
    fn measure_capacity(&mut self, stats: &[TeacherStats]) {
        let live: BTreeMap<u64, String> =
            self.teachers.iter().map(|t| (t.id, crate::distill::reader::host_port(&t.addr))).collect();
        self.capacity.retain(|at, _| live.values().any(|l| l == at));
        for s in stats.iter().filter(|s| s.utilisation >= 0.2 && s.rows_per_sec > 0.0) {
            if let Some(at) = live.get(&s.id) {
                self.capacity.insert(at.clone(), s.rows_per_sec / s.utilisation.min(1.0));
            }
        }
    }

    fn view(&self, students: &Students, mut teachers: Vec<TeacherStats>) -> TeacherView {
        // The students' times of their requests to each teacher.
        for t in &mut teachers {
            let Some(p) = self.teachers.iter().find(|p| p.id == t.id) else { continue };
            if let Some(c) = students.calls.get(&host_port(&p.addr)) {
                let mut us = c.latency_us.clone();
                t.p50_ms = quantile_ms(&mut us, 0.50);
                t.p99_ms = quantile_ms(&mut us, 0.99);
            }
        }
        TeacherView {
            step: students.step,
            wait_share: students.wait_share.unwrap_or(0.0),
            student_throughput: students.throughput,
            student_world_size: students.world,
            student_world_planned: students.planned,
            teacher_count: self.teachers.len() as u32,
            min_teachers: self.bounds.min,
            max_teachers: self.bounds.max,
            in_flight_per_teacher: self.in_flight,
            teachers,
            secs_since_change: self.changed.elapsed().as_secs_f64(),
            price_per_teacher_hour: self.bounds.price_per_teacher_hour,
        }
    }
}

impl PoolPolicy for Box<dyn crate::plugin::TeacherPolicyPlugin> {
    fn decide(&mut self, view: &TeacherView) -> Result<TeacherPlan, String> {
        crate::plugin::TeacherPolicyPlugin::decide(self.as_mut(), view).map_err(|e| e.to_string())
    }
}

/// Whether the students' weights are worth changing: a teacher's capacity
/// appeared, went, or moved by a quarter or more.
fn capacity_moved(told: &BTreeMap<String, f64>, now: &BTreeMap<String, f64>) -> bool {
    told.keys().ne(now.keys())
        || told.iter().zip(now.values()).any(|((_, a), b)| (a - b).abs() >= 0.25 * a.abs().max(f64::EPSILON))
}

/// What the pool's thread reports: a change, and what it had to say.
pub type PoolNews = (Option<TeacherEvent>, Vec<String>);

/// A pool run on a thread of its own: reading statistics and starting a
/// teacher take seconds, which the coordinator's loop cannot wait.
pub struct PoolThread {
    tx: Option<std::sync::mpsc::Sender<ToPool>>,
    news: std::sync::mpsc::Receiver<PoolNews>,
    thread: Option<std::thread::JoinHandle<PoolRecord>>,
    every: Duration,
    /// The changes told through [`PoolThread::news`] so far.
    told: Vec<TeacherEvent>,
    /// The view of the pool's newest decision, not yet taken.
    latest: Arc<Mutex<Option<TeacherView>>>,
}

/// What the coordinator tells the pool's thread.
enum ToPool {
    Students(Students),
    /// Take these teachers over, then answer.
    TakeOver(Vec<TeacherHandle>, std::sync::mpsc::Sender<Vec<String>>),
    /// The coordinator was deposed: let the lasting teachers go, and end.
    Release,
}

/// What the pool thread was told at once: the students' windows merged
/// into one, teachers taken over as asked. None: told to let the teachers
/// go (the coordinator was deposed), and to end.
fn take_in(
    pool: &mut TeacherPool,
    told: impl Iterator<Item = ToPool>,
    news: &std::sync::mpsc::Sender<PoolNews>,
) -> Option<Option<Students>> {
    let mut students: Option<Students> = None;
    for m in told {
        match m {
            ToPool::Students(s) => {
                students = Some(match students {
                    Some(before) => before.then(s),
                    None => s,
                })
            }
            ToPool::TakeOver(left, reply) => {
                let (event, said) = pool.take_over(left);
                let _ = reply.send(said);
                if event.is_some() {
                    let _ = news.send((event, Vec::new()));
                }
            }
            ToPool::Release => {
                pool.launcher.release();
                return None;
            }
        }
    }
    Some(students)
}

impl PoolThread {
    /// Runs `pool` on a thread of its own; with `watch`, a loop of that
    /// thread that has not come back within it (a native policy that does
    /// not return, a teacher's start that hangs) is said, and so is its
    /// coming back.
    pub fn start(mut pool: TeacherPool, watch: Option<Duration>) -> Result<PoolThread> {
        let every = pool.bounds.every;
        let (tx, rx) = std::sync::mpsc::channel::<ToPool>();
        let (news_tx, news) = std::sync::mpsc::channel();
        let latest = Arc::new(Mutex::new(None));
        let newest = latest.clone();
        // Told what the students did, or this passed: teachers that exited
        // are replaced either way (well within the bound of a stall).
        let wait = watch.map_or(Duration::from_secs(1), |b| (b / 4).min(Duration::from_secs(1)));
        let thread = std::thread::Builder::new().name("edl-teacher-pool".into()).spawn(move || {
            let mut watched = watch.map(|bound| WatchedLoop::start(bound, news_tx.clone()));
            let mut step = 0;
            loop {
                if let Some(w) = watched.as_mut() {
                    w.turned(&news_tx);
                }
                let students = match rx.recv_timeout(wait) {
                    Ok(first) => {
                        let all = std::iter::once(first).chain(rx.try_iter());
                        match take_in(&mut pool, all, &news_tx) {
                            Some(students) => students,
                            None => break,
                        }
                    }
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => None,
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
                };
                if let Some(w) = watched.as_mut() {
                    w.turned(&news_tx);
                }
                step = students.as_ref().map_or(step, |s| s.step);
                let (event, said) = pool.look(step, students);
                if let Some(view) = pool.last_view.take() {
                    *newest.lock().unwrap_or_else(|e| e.into_inner()) = Some(view);
                }
                if (event.is_some() || !said.is_empty()) && news_tx.send((event, said)).is_err() {
                    break;
                }
            }
            PoolRecord { events: pool.events, decisions: pool.decisions.into() }
        })?;
        Ok(PoolThread { tx: Some(tx), news, thread: Some(thread), every, told: Vec::new(), latest })
    }

    /// The coordinator was deposed: the teachers that outlive it are let
    /// go for the coordinator that leads now (see [`TeacherLauncher::release`]).
    pub fn release(&self) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(ToPool::Release);
        }
    }

    /// How often the coordinator tells it what the students did.
    pub fn every(&self) -> Duration {
        self.every
    }

    /// Tells the pool what the students did (it looks when its time has come).
    pub fn tell(&self, students: Students) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(ToPool::Students(students));
        }
    }

    /// The coordinator leads the job: the pool takes over the teachers of
    /// the coordinator before (`left`) and, if it was held, starts sizing
    /// from them. Waits for it (each teacher is asked whether it answers),
    /// at most a minute; returns what could not be taken over.
    pub fn take_over(&self, left: Vec<TeacherHandle>) -> Vec<String> {
        let Some(tx) = &self.tx else { return Vec::new() };
        let (reply, answer) = std::sync::mpsc::channel();
        if tx.send(ToPool::TakeOver(left, reply)).is_err() {
            return vec!["the teacher pool's thread is gone".into()];
        }
        answer.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| {
            vec!["the teacher pool did not take the teachers before over within a minute".into()]
        })
    }

    /// The view the pool's policy decided on last, once (None until a
    /// new decision).
    pub fn latest_view(&self) -> Option<TeacherView> {
        self.latest.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// What the pool did since the last call.
    pub fn news(&mut self) -> Vec<PoolNews> {
        let news: Vec<PoolNews> = self.news.try_iter().collect();
        self.told.extend(news.iter().filter_map(|(e, _)| e.clone()));
        news
    }

    /// Stops the pool's thread (its teachers stay, for the job to stop);
    /// returns every change it made and its policy's decisions. A thread
    /// still busy after 10 s (a policy that does not return, a teacher that
    /// does not start) is left behind, and the changes it told are returned
    /// (without the decisions).
    pub fn stop(&mut self) -> PoolRecord {
        drop(self.tx.take());
        let told = |me: &mut Self| PoolRecord { events: std::mem::take(&mut me.told), decisions: Vec::new() };
        let Some(thread) = self.thread.take() else { return told(self) };
        let until = Instant::now() + Duration::from_secs(10);
        while !thread.is_finished() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
        if thread.is_finished() {
            return thread.join().unwrap_or_else(|_| told(self));
        }
        tracing::warn!("the teacher pool's thread is still busy after 10 s; the job ends without it");
        self.news();
        told(self)
    }
}

/// The pool's thread, watched: a stall is said once, and so is its coming
/// back (and it is watched again from then).
struct WatchedLoop {
    bound: Duration,
    dog: super::watchdog::Watchdog,
    /// Set by the watchdog when it said a stall.
    said: Arc<std::sync::atomic::AtomicBool>,
    /// When the loop last came back.
    last: Instant,
}

impl WatchedLoop {
    fn start(bound: Duration, news: std::sync::mpsc::Sender<PoolNews>) -> WatchedLoop {
        let said = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = said.clone();
        let dog = super::watchdog::Watchdog::start(
            super::watchdog::Watched::TeacherPool,
            bound,
            Box::new(move |e| {
                flag.store(true, std::sync::atomic::Ordering::SeqCst);
                let _ = news.send((None, vec![format!("{e:#}")]));
            }),
        );
        WatchedLoop { bound, dog, said, last: Instant::now() }
    }

    /// The loop came back.
    fn turned(&mut self, news: &std::sync::mpsc::Sender<PoolNews>) {
        if self.said.load(std::sync::atomic::Ordering::SeqCst) {
            let away = self.last.elapsed().as_secs_f64();
            let back = format!("the teacher pool's loop came back after {away:.1} s");
            let _ = news.send((None, vec![back]));
            *self = WatchedLoop::start(self.bound, news.clone());
        }
        self.last = Instant::now();
        self.dog.turned();
    }
}

impl Drop for PoolThread {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Why the pool goes from `from` to `to` teachers, as the view showed it.
fn reason_of(view: &TeacherView, from: u32, to: u32) -> String {
    let busy = if view.teachers.is_empty() {
        String::from("teachers' use unknown")
    } else {
        let mean = view.teachers.iter().map(|t| t.utilisation).sum::<f64>() / view.teachers.len() as f64;
        format!("teachers {:.0}% busy", mean * 100.0)
    };
    let students = if view.student_world_planned != view.student_world_size {
        format!(", students {} -> {}", view.student_world_size, view.student_world_planned)
    } else {
        String::new()
    };
    let way = if to > from { "grows" } else { "shrinks" };
    format!(
        "the teacher policy {way} the pool: students waited {:.0}% of their compute, {busy}{students}",
        view.wait_share * 100.0
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// A policy that answers from a script and remembers what it saw.
    struct Scripted {
        answers: Vec<Result<TeacherPlan, String>>,
        seen: Arc<Mutex<Vec<TeacherView>>>,
    }

    impl PoolPolicy for Scripted {
        fn decide(&mut self, view: &TeacherView) -> Result<TeacherPlan, String> {
            self.seen.lock().unwrap().push(view.clone());
            self.answers.remove(0)
        }
    }

    /// Teachers that are addresses only; `fail_after` starts succeed.
    #[derive(Clone, Default)]
    struct Fake {
        started: Arc<Mutex<Vec<String>>>,
        stopped: Arc<Mutex<Vec<String>>>,
        died: Arc<Mutex<Vec<(String, String)>>>,
        published: Arc<Mutex<Vec<u32>>>,
        capacities: Arc<Mutex<Vec<BTreeMap<String, f64>>>>,
        fail_after: Option<usize>,
    }

    impl TeacherLauncher for Fake {
        fn start(&mut self) -> Result<String> {
            let mut s = self.started.lock().unwrap();
            if self.fail_after.is_some_and(|n| s.len() >= n) {
                anyhow::bail!("no room for another teacher");
            }
            let addr = format!("127.0.0.1:{}", 9000 + s.len());
            s.push(addr.clone());
            Ok(addr)
        }
        fn stop(&mut self, addr: &str) {
            self.stopped.lock().unwrap().push(addr.to_string());
        }
        fn exited(&mut self) -> Vec<(String, String)> {
            std::mem::take(&mut self.died.lock().unwrap())
        }
        fn publish(&mut self, settings: PoolSettings) -> Result<()> {
            self.published.lock().unwrap().push(settings.in_flight_per_teacher);
            self.capacities.lock().unwrap().push(settings.capacity);
            Ok(())
        }
        fn adopt(&mut self, teacher: &TeacherHandle) -> Result<String> {
            if teacher.addr.ends_with(":1") {
                anyhow::bail!("it does not answer ready");
            }
            Ok(teacher.addr.clone())
        }
    }

    fn plan(teachers: u32, in_flight: u32) -> Result<TeacherPlan, String> {
        Ok(TeacherPlan { teachers, in_flight_per_teacher: in_flight })
    }

    fn pool(
        answers: Vec<Result<TeacherPlan, String>>,
        fake: Fake,
    ) -> (TeacherPool, Arc<Mutex<Vec<TeacherView>>>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let bounds =
            PoolBounds { min: 1, max: 3, every: Duration::ZERO, price_per_teacher_hour: 0.5, in_flight: 2 };
        let policy = Box::new(Scripted { answers, seen: seen.clone() });
        (
            TeacherPool::new(
                policy,
                Box::new(fake),
                bounds,
                vec!["127.0.0.1:1".into()],
                StatsAccess::default(),
            )
            .unwrap(),
            seen,
        )
    }

    fn students(step: u64, wait: f64, world: u32, planned: u32) -> Students {
        Students { step, wait_share: Some(wait), throughput: 100.0, world, planned, calls: BTreeMap::new() }
    }

    /// A policy that does not answer until it is let go.
    struct Stuck(std::sync::mpsc::Receiver<()>);

    impl PoolPolicy for Stuck {
        fn decide(&mut self, _: &TeacherView) -> Result<TeacherPlan, String> {
            let _ = self.0.recv();
            plan(1, 2)
        }
    }

    /// What the pool's thread said, until a line contains `what`.
    fn said_until(t: &mut PoolThread, what: &str) -> Vec<String> {
        let mut said = Vec::new();
        let until = Instant::now() + Duration::from_secs(60);
        while !said.iter().any(|s: &String| s.contains(what)) {
            assert!(Instant::now() < until, "never said {what:?}: {said:?}");
            said.extend(t.news().into_iter().flat_map(|(_, s)| s));
            std::thread::sleep(Duration::from_millis(10));
        }
        said
    }

    #[test]
    fn a_pool_whose_policy_does_not_return_is_said_stalled_and_then_back() {
        let (release, held) = std::sync::mpsc::channel();
        let bounds =
            PoolBounds { min: 1, max: 3, every: Duration::ZERO, price_per_teacher_hour: 0.5, in_flight: 2 };
        let p = TeacherPool::new(
            Box::new(Stuck(held)),
            Box::new(Fake::default()),
            bounds,
            vec!["127.0.0.1:1".into()],
            StatsAccess::default(),
        )
        .unwrap();
        let mut t = PoolThread::start(p, Some(Duration::from_millis(300))).unwrap();
        t.tell(students(10, 0.4, 2, 2));
        let said = said_until(&mut t, "has not come back");
        let stall = said.iter().find(|s| s.contains("has not come back")).unwrap();
        assert!(
            stall.starts_with("the teacher pool's loop") && stall.contains("--loop-stall-secs 0.3"),
            "{stall}"
        );
        assert!(
            stall.contains("waiting in the kernel") && stall.contains("keep the teachers they have"),
            "{stall}"
        );
        release.send(()).unwrap();
        let said = said_until(&mut t, "came back after");
        assert!(said.iter().all(|s| !s.contains("has not come back")), "said once: {said:?}");
        // Watched again: a second stall is said too.
        t.tell(students(20, 0.4, 2, 2));
        said_until(&mut t, "has not come back");
        release.send(()).unwrap();
        t.stop();
    }

    #[test]
    fn the_pool_follows_the_policy_within_its_bounds_and_says_why() {
        let fake = Fake::default();
        let (mut p, seen) = pool(vec![plan(5, 4), plan(3, 4), plan(1, 99), Err("boom".into())], fake.clone());
        // Asked for 5, given the bound: 3.
        let (e, said) = p.look(0, Some(students(10, 0.4, 2, 4)));
        let e = e.unwrap();
        assert_eq!((e.from, e.to, e.step), (1, 3, 10));
        assert!(e.reason.contains("grows") && e.reason.contains("students waited 40%"), "{}", e.reason);
        assert!(e.reason.contains("students 2 -> 4"), "{}", e.reason);
        assert_eq!(said, vec!["students keep 4 requests in flight at each teacher (were 2)".to_string()]);
        assert_eq!(p.addrs().len(), 3);
        assert_eq!(p.in_flight(), 4);
        // The same size: no event; the students were told the new in-flight once.
        assert_eq!(p.look(0, Some(students(20, 0.1, 4, 4))).0, None);
        assert_eq!(*fake.published.lock().unwrap(), vec![4]);
        // Down to one; in flight clamped to 64; the newest teachers go first.
        let e = p.look(0, Some(students(30, 0.0, 1, 1))).0.unwrap();
        assert_eq!((e.from, e.to), (3, 1));
        assert!(e.reason.contains("shrinks"), "{}", e.reason);
        assert_eq!(
            *fake.stopped.lock().unwrap(),
            vec!["127.0.0.1:9001".to_string(), "127.0.0.1:9000".to_string()]
        );
        assert_eq!(p.addrs(), vec!["127.0.0.1:1".to_string()]);
        assert_eq!(p.in_flight(), 64);
        assert_eq!(*fake.published.lock().unwrap(), vec![4, 64]);
        // A failing policy leaves the pool as it is, and is said.
        let (e, said) = p.look(0, Some(students(40, 0.9, 1, 1)));
        assert!(e.is_none() && said[0].contains("the pool stays at 1: boom"), "{said:?}");
        assert_eq!(p.events().len(), 2);
        // The policy saw the students and the pool as they were.
        let seen = seen.lock().unwrap();
        assert_eq!((seen[0].teacher_count, seen[0].min_teachers, seen[0].max_teachers), (1, 1, 3));
        assert_eq!((seen[0].student_world_size, seen[0].student_world_planned), (2, 4));
        assert_eq!(seen[0].in_flight_per_teacher, 2);
        assert_eq!(seen[1].teacher_count, 3);
        assert!((seen[0].price_per_teacher_hour - 0.5).abs() < 1e-12);
    }

    #[test]
    fn a_teacher_the_students_refused_is_stopped_named_and_replaced() {
        let fake = Fake::default();
        let (mut p, seen) = pool(vec![plan(2, 2), plan(2, 2)], fake.clone());
        assert_eq!(p.look(0, Some(students(5, 0.5, 2, 2))).0.map(|e| e.to), Some(2));
        // A student's requests to 127.0.0.1:9000 were answered with the wrong shape.
        let mut told = students(10, 0.5, 2, 2);
        let refused = TeacherRequests {
            addr: "127.0.0.1:9000".into(),
            latency_us: vec![900],
            refused: Some("answered 7 classes; the student has 10".into()),
        };
        told.calls.insert(refused.addr.clone(), refused);
        let (e, said) = p.look(0, Some(told));
        let e = e.unwrap();
        assert_eq!((e.from, e.to, e.step), (2, 1, 10));
        assert!(e.reason.contains("127.0.0.1:9000 refused by the students"), "{}", e.reason);
        assert!(said[0].contains("answered 7 classes; the student has 10"), "{said:?}");
        assert_eq!(*fake.stopped.lock().unwrap(), vec!["127.0.0.1:9000".to_string()]);
        assert_eq!(p.addrs(), vec!["127.0.0.1:1".to_string()]);
        assert_eq!(seen.lock().unwrap().len(), 1, "the policy is not asked on a refusal");
        // Another takes its place, up to the pool's size.
        let e = p.look(0, None).0.unwrap();
        assert_eq!((e.from, e.to), (1, 2));
        assert_eq!(p.addrs(), vec!["127.0.0.1:1".to_string(), "127.0.0.1:9001".to_string()]);
        // Refusals of a teacher not in the pool (one registered by others) change nothing.
        let mut told = students(20, 0.5, 2, 2);
        let other = TeacherRequests {
            addr: "10.1.1.1:8001".into(),
            refused: Some("wrong".into()),
            ..Default::default()
        };
        told.calls.insert(other.addr.clone(), other);
        assert_eq!(p.look(0, Some(told)).0, None);
    }

    #[test]
    fn a_held_pool_starts_nothing_until_it_takes_the_teachers_before_over() {
        let fake = Fake::default();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let bounds =
            PoolBounds { min: 2, max: 3, every: Duration::ZERO, price_per_teacher_hour: 0.0, in_flight: 2 };
        let policy = Box::new(Scripted { answers: vec![plan(2, 2)], seen: seen.clone() });
        let mut p =
            TeacherPool::new(policy, Box::new(fake.clone()), bounds, Vec::new(), StatsAccess::default())
                .unwrap();
        p.hold();
        // Below its minimum, and told of students: a standby's pool waits.
        assert_eq!(p.look(0, None), (None, Vec::new()));
        assert_eq!(p.look(0, Some(students(5, 0.9, 1, 1))), (None, Vec::new()));
        assert!(fake.started.lock().unwrap().is_empty() && seen.lock().unwrap().is_empty());
        // Its coordinator leads: the teacher that answers is taken over, the other is named.
        let handle = |addr: &str, slot| TeacherHandle { addr: addr.into(), slot, id: slot as u32 };
        let (e, said) = p.take_over(vec![handle("10.0.0.7:8001", 0), handle("10.0.0.7:1", 1)]);
        let e = e.unwrap();
        assert_eq!((e.from, e.to), (0, 1));
        assert!(e.reason.contains("1 teacher(s) of the coordinator before taken over"), "{}", e.reason);
        assert_eq!(said.len(), 1);
        assert!(
            said[0].contains("10.0.0.7:1 of the coordinator before is not taken over: it does not answer")
        );
        assert_eq!(p.addrs(), vec!["10.0.0.7:8001".to_string()]);
        // From there it sizes as any pool: up to its minimum first.
        let e = p.look(0, None).0.unwrap();
        assert_eq!((e.from, e.to), (1, 2));
        assert_eq!(*fake.started.lock().unwrap(), vec!["127.0.0.1:9000".to_string()]);
    }

    #[test]
    fn a_teacher_that_does_not_start_is_said_and_the_pool_takes_what_started() {
        let fake = Fake { fail_after: Some(1), ..Default::default() };
        let (mut p, _) = pool(vec![plan(3, 2)], fake);
        let (e, said) = p.look(0, Some(students(5, 0.5, 2, 2)));
        assert_eq!(e.map(|e| (e.from, e.to)), Some((1, 2)));
        assert!(said[0].contains("no room for another teacher"), "{said:?}");
    }

    #[test]
    fn a_teacher_that_exits_is_replaced_without_the_policy_being_asked() {
        let fake = Fake::default();
        let (mut p, seen) = pool(vec![], fake.clone());
        fake.died
            .lock()
            .unwrap()
            .push(("127.0.0.1:1".into(), "teacher 127.0.0.1:1 exited (signal: 9)".into()));
        let (e, said) = p.look(7, None);
        let e = e.unwrap();
        assert_eq!(
            (e.step, e.from, e.to, e.reason.as_str()),
            (7, 1, 1, "teacher 127.0.0.1:1 exited; replaced")
        );
        assert_eq!(p.look(8, None), (None, Vec::new()), "nothing more to do");
        assert!(said[0].contains("signal: 9") && said[0].contains("starts another"), "{said:?}");
        assert_eq!(p.addrs(), vec!["127.0.0.1:9000".to_string()]);
        assert!(seen.lock().unwrap().is_empty(), "no policy decision");
    }

    #[test]
    fn teachers_that_keep_exiting_hold_starts_back_and_it_is_said() {
        let fake = Fake::default();
        let (mut p, _) = pool(vec![], fake.clone());
        for i in 0..3 {
            let addr = p.addrs()[0].clone();
            fake.died.lock().unwrap().push((addr.clone(), format!("teacher {addr} exited (exit status: 1)")));
            let (e, said) = p.look(i, None);
            let e = e.unwrap();
            if i < 2 {
                assert_eq!((e.from, e.to), (1, 1), "replaced: {said:?}");
            } else {
                // The third exit within a minute: nothing started for a while.
                assert_eq!((e.from, e.to), (1, 0), "{e:?}");
                assert!(e.reason.contains("none started in its place yet"), "{e:?}");
                assert!(
                    said.iter().any(|s| s.contains("teachers keep exiting: none is started for 5s")),
                    "{said:?}"
                );
            }
        }
        assert_eq!(fake.started.lock().unwrap().len(), 2);
        // Held back: later looks start nothing until the pause is over.
        assert_eq!(p.look(9, None), (None, Vec::new()));
        assert!(p.addrs().is_empty());
    }

    #[test]
    fn capacities_are_measured_where_teachers_worked_and_told_when_they_move() {
        let (mut p, _) = pool(vec![], Fake::default());
        p.adopt("https://127.0.0.1:2".into());
        let ids: Vec<u64> = p.teachers.iter().map(|t| t.id).collect();
        let window = |id: u64, utilisation: f64, rows_per_sec: f64| TeacherStats {
            id,
            utilisation,
            rows_per_sec,
            ..Default::default()
        };
        // Half busy at 500 rows/s: 1000 rows/s at full use. The second
        // teacher idled: its rate says nothing yet.
        p.measure_capacity(&[window(ids[0], 0.5, 500.0), window(ids[1], 0.05, 10.0)]);
        let want: BTreeMap<String, f64> = [("127.0.0.1:1".to_string(), 1000.0)].into();
        assert_eq!(p.capacity, want);
        assert!(capacity_moved(&BTreeMap::new(), &p.capacity), "a capacity appeared");
        let mut moved = want.clone();
        moved.insert("127.0.0.1:1".into(), 1200.0);
        assert!(!capacity_moved(&want, &moved), "20% is not worth telling");
        moved.insert("127.0.0.1:1".into(), 1300.0);
        assert!(capacity_moved(&want, &moved), "30% is");
        // A teacher that leaves the pool leaves the capacities.
        p.teachers.retain(|t| t.id != ids[0]);
        p.measure_capacity(&[]);
        assert!(p.capacity.is_empty());
    }

    #[test]
    fn the_students_are_told_capacities_that_moved_and_not_those_that_did_not() {
        let fake = Fake::default();
        let (mut p, _) = pool(vec![plan(1, 2), plan(1, 2), plan(1, 2)], fake.clone());
        let at = |c: f64| -> BTreeMap<String, f64> { [("127.0.0.1:1".to_string(), c)].into() };
        // Measured (as a window would): told with the pool's settings.
        p.capacity = at(1000.0);
        assert_eq!(p.look(0, Some(students(10, 0.0, 1, 1))).0, None);
        assert_eq!(*fake.capacities.lock().unwrap(), vec![at(1000.0)]);
        // 10% more: not worth telling.
        p.capacity = at(1100.0);
        p.look(0, Some(students(20, 0.0, 1, 1)));
        assert_eq!(fake.capacities.lock().unwrap().len(), 1);
        // Half: told.
        p.capacity = at(500.0);
        p.look(0, Some(students(30, 0.0, 1, 1)));
        assert_eq!(fake.capacities.lock().unwrap().last(), Some(&at(500.0)));
    }

    #[test]
    fn without_news_of_the_students_the_policy_is_not_asked() {
        let (mut p, seen) = pool(vec![plan(2, 2)], Fake::default());
        assert_eq!(p.look(1, None), (None, Vec::new()));
        assert!(seen.lock().unwrap().is_empty(), "the policy was not asked");
    }
}
