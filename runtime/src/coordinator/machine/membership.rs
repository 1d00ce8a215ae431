//! Who is in the job, as a state machine without I/O: events in (a worker
//! said hello, became ready, lost its connection, its process exited),
//! commands out (start a worker, welcome it, stop it, say something), and
//! every timeout inside it as a value of time the caller passes in. The
//! coordinator owns the sockets and the processes and carries the commands
//! out; this module decides. Tested without a process or a socket.
//!
//! A worker goes through: **spawning** (started, not connected) ->
//! **welcomed** (said hello, was sent the job, loading) -> **joiner** (ready,
//! waiting for a step boundary) -> **member** (has a rank). Started workers
//! that do not say hello, and welcomed ones that are not ready, within the
//! join timeout are given up. At a boundary joiners become members (up to
//! the maximum), replacements take their old worker's place, and a one-worker
//! handover keeps the old worker one more step so its state reaches the new.
//!
//! **Warm spares** (`set_spares`) are workers started ahead and kept ready
//! outside the ring: a growth the policy decides, or a lost member's place,
//! takes one at the next boundary (as a joiner) instead of starting a
//! worker then, and another spare is started behind it. They count toward
//! the maximum.

use edl_plugin_sdk::Action;
use std::{
    collections::{BTreeMap, BTreeSet, VecDeque},
    time::{Duration, Instant},
};

/// A control connection, numbered by the coordinator as it accepts them.
pub type Conn = u64;
/// A worker id, given when it is started.
pub type WorkerId = u64;

/// Something that happened to a worker.
#[derive(Clone, Debug, PartialEq)]
pub enum MemberEvent {
    /// A connection introduced itself as `worker`.
    Hello { conn: Conn, worker: WorkerId, pid: u32 },
    /// The worker on `conn` loaded its data and can be given a rank.
    Ready { conn: Conn },
    /// The connection ended (the process died, or the network).
    Closed { conn: Conn, why: String },
    /// The process of `worker` exited, as its scaler saw it.
    Exited { worker: WorkerId, status: String },
    /// A worker of the coordinator this one took the job over from came
    /// back on `conn`; `holds`: it kept a rollback point at the committed
    /// step the job goes on from.
    Returned { conn: Conn, worker: WorkerId, pid: u32, holds: bool },
}

/// What the coordinator is to do.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    /// Start worker `worker`.
    Spawn { worker: WorkerId },
    /// Send the job to the worker on `conn` (first its id, when it joined
    /// without one).
    Welcome { conn: Conn, assigned: Option<WorkerId> },
    /// Tell `conn` it is not wanted, and close it.
    Refuse { conn: Conn, reason: String },
    /// Tell the worker (on `conn`, if connected) to stop, make sure its
    /// process is gone within `grace`, and drop its lease.
    Stop { worker: WorkerId, conn: Option<Conn>, reason: String, grace: Duration },
    /// Something to tell the operator; `log_of` names a worker whose log
    /// explains it.
    Note { text: String, log_of: Option<WorkerId> },
}

/// A connected worker.
#[derive(Clone, Debug, PartialEq)]
pub struct Worker {
    pub id: WorkerId,
    pub conn: Conn,
    pub pid: u32,
    /// When it said hello.
    pub since: Instant,
}

#[cfg(test)]
impl Worker {
    /// Worker `id` on connection `id`, pid `100 + id`.
    pub(crate) fn numbered(id: WorkerId) -> Worker {
        Worker { id, conn: id, pid: 100 + id as u32, since: Instant::now() }
    }
}

/// What a step boundary changed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Boundary {
    /// Membership changed: a new generation must be formed.
    pub changed: bool,
    pub admitted: usize,
    /// What happened, for the scale event's reason.
    pub reasons: Vec<String>,
}

/// What a worker told to go does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leave {
    /// It left: the next generation is formed without it.
    Now(String),
    /// It holds the only state: it stays until another worker holds it.
    AfterHandover(String),
}

/// How long a worker took to become ready: from being started to saying
/// hello (its process start and connection), and from then to being ready
/// (loading the job: data, model, teachers).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Readied {
    pub id: WorkerId,
    pub start: Duration,
    pub load: Duration,
}

/// The job's workers in every state, and the bounds it keeps them in.
#[derive(Debug)]
pub struct Membership {
    min: u32,
    max: u32,
    join_timeout: Duration,
    next_id: WorkerId,
    /// Started, not connected: id -> when.
    spawning: BTreeMap<WorkerId, Instant>,
    /// Connected and loading: id -> when it was started.
    started_at: BTreeMap<WorkerId, Instant>,
    /// How long each worker that became ready since the last look took.
    readied: Vec<Readied>,
    welcomed: Vec<Worker>,
    joiners: Vec<Worker>,
    members: Vec<Worker>,
    /// Replacement id -> the worker it replaces.
    replacing: BTreeMap<WorkerId, WorkerId>,
    /// Replaced workers kept one more step to hand their state over.
    retiring: Vec<WorkerId>,
    /// Sole members told to go by their scheduler, with the reason: each
    /// leaves once another worker holds the state, whichever worker that
    /// is (its own replacement may never start).
    told: BTreeMap<WorkerId, Told>,
    /// Retiring workers whose handover's generation failed: kept one more.
    handover_again: BTreeSet<WorkerId>,
    /// Connections that ended.
    closed: BTreeSet<Conn>,
    /// Membership changed since the last generation was formed.
    changed: bool,
    commands: VecDeque<Command>,
    /// Ids of every worker started.
    started: Vec<WorkerId>,
    /// Workers nobody asked for (started by another engine) may join.
    uninvited: bool,
    /// Members of the coordinator this one took the job over from, who
    /// may still come back.
    returning: BTreeSet<WorkerId>,
    /// Warm spares the job keeps, and the workers started as spares
    /// (starting, loading or held); the held ones, ready.
    spares_wanted: u32,
    spare_ids: BTreeSet<WorkerId>,
    held: Vec<Worker>,
    /// Spares lost before they were ready, in a row: past
    /// [`SPARE_TRIES`] the job stops keeping spares.
    spares_lost: u32,
    /// The job stopped keeping spares (after [`SPARE_TRIES`] lost): for good.
    spares_given_up: bool,
    /// What the spares were for, as a policy sizing them sees it.
    spare_counts: SpareCounts,
    /// The last worker the scaler could not start, and why (until a
    /// worker connects).
    start_failed: Option<String>,
}

/// What a job's warm spares were used for, all told.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SpareCounts {
    /// Growths and lost members' places a spare took.
    pub from_spares: u64,
    /// Growths and places for which a worker had to be started (no spare
    /// was there).
    pub started_cold: u64,
    /// Members lost with a failed generation.
    pub members_lost: u64,
    /// Workers that became ready, and their time from start to ready.
    pub readied: u64,
    pub ready_time: Duration,
}

/// A sole member told to go: why, and how many replacements were started for it.
#[derive(Debug)]
struct Told {
    why: String,
    tries: u32,
}

/// Replacements started for a sole member told to go before it waits for
/// any worker to join instead.
const REPLACEMENT_TRIES: u32 = 3;

/// Warm spares lost before they were ready, in a row, before the job
/// stops keeping spares (a program that cannot start is not started again
/// and again).
const SPARE_TRIES: u32 = 3;

/// How long a worker told to stop gets before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(3);

impl Membership {
    pub fn new(min: u32, max: u32, join_timeout: Duration, next_id: WorkerId) -> Self {
        Membership {
            min: min.max(1),
            max: max.max(1),
            join_timeout,
            next_id: next_id.max(1),
            spawning: BTreeMap::new(),
            started_at: BTreeMap::new(),
            readied: Vec::new(),
            welcomed: Vec::new(),
            joiners: Vec::new(),
            members: Vec::new(),
            replacing: BTreeMap::new(),
            retiring: Vec::new(),
            told: BTreeMap::new(),
            handover_again: BTreeSet::new(),
            closed: BTreeSet::new(),
            changed: true,
            commands: VecDeque::new(),
            started: Vec::new(),
            uninvited: false,
            returning: BTreeSet::new(),
            spares_wanted: 0,
            spare_ids: BTreeSet::new(),
            held: Vec::new(),
            spares_lost: 0,
            spares_given_up: false,
            spare_counts: SpareCounts::default(),
            start_failed: None,
        }
    }

    /// The last worker the scaler could not start, and why.
    pub fn start_failed(&self) -> Option<&str> {
        self.start_failed.as_deref()
    }

    /// Keeps `n` warm spares from now on (within the maximum): more are
    /// started, and surplus ones stopped (those still starting first, then
    /// those loading, then the ready ones, newest first). False, and
    /// nothing done, once the job gave spares up ([`SPARE_TRIES`] lost
    /// before they were ready).
    pub fn set_spares(&mut self, now: Instant, n: u32) -> bool {
        if self.spares_given_up && n > self.spares_wanted {
            return false;
        }
        self.spares_wanted = n;
        self.shed_spares(n);
        self.keep_spares(now);
        true
    }

    /// Spares the job keeps.
    pub fn spares_wanted(&self) -> u32 {
        self.spares_wanted
    }

    /// Whether the job stopped keeping spares, after [`SPARE_TRIES`] in a
    /// row were lost before they were ready.
    pub fn spares_gave_up(&self) -> bool {
        self.spares_given_up
    }

    /// Counts a spare lost before it was ready; the [`SPARE_TRIES`]th in a
    /// row ends the keeping of spares for good (true then).
    fn spare_failed(&mut self) -> bool {
        self.spares_lost += 1;
        if self.spares_lost < SPARE_TRIES || self.spares_given_up {
            return false;
        }
        self.spares_given_up = true;
        self.spares_wanted = 0;
        true
    }

    /// What the spares were used for, all told.
    pub fn spare_counts(&self) -> SpareCounts {
        self.spare_counts
    }

    /// Stops spares beyond `n`: the least ready first.
    fn shed_spares(&mut self, n: u32) {
        let reason = "fewer warm spares wanted";
        let before = self.spare_ids.clone();
        let mut surplus = self.spares().saturating_sub(n);
        let starting: Vec<WorkerId> =
            self.spawning.keys().rev().filter(|id| self.spare_ids.contains(id)).copied().collect();
        for worker in starting.into_iter().take(surplus as usize) {
            self.spawning.remove(&worker);
            self.spare_ids.remove(&worker);
            let grace = Duration::from_secs(1);
            self.commands.push_back(Command::Stop { worker, conn: None, reason: reason.into(), grace });
            surplus -= 1;
        }
        while surplus > 0 {
            let spare = |w: &Worker| self.spare_ids.contains(&w.id);
            let w = match self.welcomed.iter().rposition(spare) {
                Some(i) => self.welcomed.remove(i),
                None => match self.held.pop() {
                    Some(w) => w,
                    None => break,
                },
            };
            self.spare_ids.remove(&w.id);
            self.started_at.remove(&w.id);
            self.stop(&w, reason.into(), STOP_GRACE);
            surplus -= 1;
        }
        let stopped: Vec<String> = before.difference(&self.spare_ids).map(|id| id.to_string()).collect();
        if !stopped.is_empty() {
            self.note(format!("warm spare(s) {} stopped: {reason}", stopped.join(", ")), None);
        }
    }

    /// Starts `n` workers for the ring, none being a spare.
    fn spawn_cold(&mut self, now: Instant, n: u32) {
        self.spare_counts.started_cold += u64::from(n);
        self.spawn(now, n);
    }

    /// Warm spares: started, loading or ready.
    pub fn spares(&self) -> u32 {
        self.spare_ids.len() as u32
    }

    /// Warm spares ready to join.
    pub fn spares_ready(&self) -> u32 {
        self.held.len() as u32
    }

    /// Starts spares up to the number wanted, within the maximum.
    fn keep_spares(&mut self, now: Instant) {
        if self.spares_given_up {
            return;
        }
        let used = self.world() + self.coming() + self.spares();
        let room = self.max.saturating_sub(used);
        let short = self.spares_wanted.saturating_sub(self.spares()).min(room);
        for _ in 0..short {
            let id = self.next_id;
            self.spare_ids.insert(id);
            self.spawn(now, 1);
        }
    }

    /// Makes up to `n` spares joiners (ready ones first; those still
    /// loading join when ready); returns how many.
    fn take_spares(&mut self, n: u32) -> u32 {
        (0..n).take_while(|_| self.take_spare().is_some()).count() as u32
    }

    /// Makes one spare a joiner (a ready one first; one still loading
    /// joins when ready); returns its id.
    fn take_spare(&mut self) -> Option<WorkerId> {
        let id = match self.held.first() {
            Some(_) => {
                let w = self.held.remove(0);
                let id = w.id;
                self.joiners.push(w);
                id
            }
            None => *self.spare_ids.iter().next()?,
        };
        self.spare_ids.remove(&id);
        self.spare_counts.from_spares += 1;
        Some(id)
    }

    /// A spare that was starting, loading or held is gone: another is started.
    fn spare_lost(&mut self, now: Instant, id: WorkerId, why: &str) -> bool {
        if !self.spare_ids.remove(&id) {
            return false;
        }
        let was_ready = self.held.iter().any(|w| w.id == id);
        self.held.retain(|w| w.id != id);
        if !was_ready && self.spare_failed() {
            self.note(
                format!(
                    "warm spare {id} was lost before it was ready ({why}), the {SPARE_TRIES}th in a row: \
                     the job keeps no spares from now on"
                ),
                Some(id),
            );
            return true;
        }
        let behind = if self.spares_given_up { "" } else { "; another is started" };
        self.note(format!("warm spare {id} was lost while waiting ({why}){behind}"), Some(id));
        self.keep_spares(now);
        true
    }

    /// The job was taken over from another coordinator: its members
    /// `workers` may come back (with their state) until [`Self::end_return`].
    pub fn expect_return(&mut self, workers: &[WorkerId]) {
        self.returning = workers.iter().copied().collect();
    }

    /// Workers still expected back.
    pub fn returning(&self) -> usize {
        self.returning.len()
    }

    /// No more workers come back; returns those that did not.
    pub fn end_return(&mut self) -> Vec<WorkerId> {
        std::mem::take(&mut self.returning).into_iter().collect()
    }

    /// Whether workers that were not started for the job may join it: they
    /// proved the job's secret, and are admitted at a boundary like any
    /// joiner, up to the maximum.
    pub fn admit_uninvited(&mut self, yes: bool) {
        self.uninvited = yes;
    }

    /// Whether worker `id` is connected, in any state.
    fn connected(&self, id: WorkerId) -> bool {
        self.welcomed.iter().chain(&self.joiners).chain(&self.members).chain(&self.held).any(|w| w.id == id)
    }

    /// The next command to carry out.
    pub fn poll_command(&mut self) -> Option<Command> {
        self.commands.pop_front()
    }

    /// The members, rank order.
    pub fn members(&self) -> &[Worker] {
        &self.members
    }

    /// Orders the members after the first so that those of one key (the
    /// relay of their host) are consecutive ranks, keys in the order they
    /// first appear; the first member stays first (it holds the state, or
    /// hands it over). A host's ranks then report as one.
    pub fn group_by(&mut self, key: impl Fn(&Worker) -> Option<u64>) {
        if self.members.len() < 3 {
            return;
        }
        let mut order: std::collections::HashMap<Option<u64>, usize> = Default::default();
        for m in &self.members {
            let next = order.len();
            order.entry(key(m)).or_insert(next);
        }
        self.members[1..].sort_by_key(|m| order[&key(m)]);
    }

    pub fn world(&self) -> u32 {
        self.members.len() as u32
    }

    /// Workers on their way: started, loading, or ready for the next
    /// boundary (warm spares not counted).
    pub fn coming(&self) -> u32 {
        let spare = |id: &WorkerId| self.spare_ids.contains(id);
        let starting = self.spawning.keys().filter(|id| !spare(id)).count();
        let loading = self.welcomed.iter().filter(|w| !spare(&w.id)).count();
        (starting + loading + self.joiners.len()) as u32
    }

    pub fn joiners(&self) -> usize {
        self.joiners.len()
    }

    /// The workers on their way, each with where it is: started and not
    /// connected yet, loading the job, or ready for the next boundary.
    pub fn on_the_way(&self) -> Vec<(WorkerId, &'static str)> {
        let spare = |id: &WorkerId| self.spare_ids.contains(id);
        let mut out: Vec<(WorkerId, &'static str)> = self
            .spawning
            .keys()
            .map(|&id| (id, if spare(&id) { "a warm spare, still starting" } else { "still starting" }))
            .collect();
        out.extend(self.welcomed.iter().map(|w| {
            (w.id, if spare(&w.id) { "a warm spare, still loading the job" } else { "still loading the job" })
        }));
        out.extend(self.joiners.iter().map(|w| (w.id, "ready, waiting for the next step boundary")));
        out.extend(self.held.iter().map(|w| (w.id, "a warm spare, ready")));
        out.sort_by_key(|w| w.0);
        out
    }

    /// The workers that became ready since the last call, with their times.
    pub fn take_readied(&mut self) -> Vec<Readied> {
        std::mem::take(&mut self.readied)
    }

    /// Nothing is starting or loading: waiting for more joiners is pointless.
    pub fn nothing_loading(&self) -> bool {
        let spare = |id: &WorkerId| self.spare_ids.contains(id);
        self.spawning.keys().all(spare) && self.welcomed.iter().all(|w| spare(&w.id))
    }

    /// Worker ids go on from `next` (those of an earlier run of the job).
    pub fn resume_ids(&mut self, next: WorkerId) {
        self.next_id = self.next_id.max(next);
    }

    /// The id the next started worker gets.
    pub fn next_id(&self) -> WorkerId {
        self.next_id
    }

    pub fn started(&self) -> &[WorkerId] {
        &self.started
    }

    /// The rank of the member on `conn`.
    pub fn rank_of(&self, conn: Conn) -> Option<usize> {
        self.members.iter().position(|m| m.conn == conn)
    }

    /// Whether `conn` has ended.
    pub fn is_closed(&self, conn: Conn) -> bool {
        self.closed.contains(&conn)
    }

    /// A step boundary now would change membership: joiners are ready, a
    /// handover is due, or members changed.
    pub fn change_waiting(&self) -> bool {
        self.changed || !self.joiners.is_empty() || !self.retiring.is_empty()
    }

    /// A handover is under way (the policy waits for it to end).
    pub fn handing_over(&self) -> bool {
        !self.retiring.is_empty()
    }

    /// When the next timeout falls, if any is pending.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let spawning = self.spawning.values().copied();
        let welcomed = self.welcomed.iter().map(|w| w.since);
        spawning.chain(welcomed).min().map(|t| t + self.join_timeout)
    }

    /// Starts `n` workers.
    pub fn spawn(&mut self, now: Instant, n: u32) {
        for _ in 0..n {
            let worker = self.next_id;
            self.next_id += 1;
            self.spawning.insert(worker, now);
            self.started.push(worker);
            self.commands.push_back(Command::Spawn { worker });
        }
    }

    /// The scaler could not start `worker`.
    pub fn spawn_failed(&mut self, worker: WorkerId, why: String) {
        self.spawning.remove(&worker);
        self.started.retain(|w| *w != worker);
        let spare = self.spare_ids.remove(&worker);
        self.replacement_lost(Instant::now(), worker);
        self.note(format!("could not start worker {worker}: {why}"), None);
        self.start_failed = Some(format!("worker {worker}: {why}"));
        // Not started again from here: the scaler refuses now, and would
        // refuse the next one alike. The next change of the job tries.
        if spare && self.spare_failed() {
            self.note(
                format!("the scaler refused {SPARE_TRIES} warm spares in a row: the job keeps no spares from now on"),
                None,
            );
        }
    }

    fn note(&mut self, text: String, log_of: Option<WorkerId>) {
        self.commands.push_back(Command::Note { text, log_of });
    }

    fn stop(&mut self, w: &Worker, reason: String, grace: Duration) {
        self.commands.push_back(Command::Stop { worker: w.id, conn: Some(w.conn), reason, grace });
    }

    /// Feeds one event. Returns the id of a member whose connection ended
    /// (the step in progress has lost that rank).
    pub fn handle(&mut self, now: Instant, ev: MemberEvent) -> Option<WorkerId> {
        match ev {
            MemberEvent::Hello { conn, worker, pid } => self.hello(now, conn, worker, pid),
            MemberEvent::Ready { conn } => {
                if let Some(i) = self.welcomed.iter().position(|w| w.conn == conn) {
                    let w = self.welcomed.remove(i);
                    if let Some(started) = self.started_at.remove(&w.id) {
                        let (start, load) = (w.since.saturating_duration_since(started), now - w.since);
                        self.readied.push(Readied { id: w.id, start, load });
                        self.spare_counts.readied += 1;
                        self.spare_counts.ready_time += start + load;
                    }
                    if self.spare_ids.contains(&w.id) {
                        self.note(format!("warm spare {} ready", w.id), None);
                        self.spares_lost = 0;
                        self.held.push(w);
                    } else {
                        self.joiners.push(w);
                    }
                }
            }
            MemberEvent::Closed { conn, why } => return self.closed(now, conn, &why),
            MemberEvent::Returned { conn, worker, pid, holds } => {
                self.returned(now, conn, worker, pid, holds)
            }
            MemberEvent::Exited { worker, status } => {
                if self.spawning.remove(&worker).is_some() {
                    if self.spare_lost(now, worker, &status) {
                        return None;
                    }
                    self.replacement_lost(now, worker);
                    self.note(format!("worker {worker} exited before joining: {status}"), Some(worker));
                } else {
                    // Its connection says it is gone; its scheduler says how.
                    self.note(format!("worker {worker}: {status}"), None);
                }
            }
        }
        None
    }

    /// A worker said hello: one this job started, one another engine
    /// started (where they may join uninvited), or one refused.
    fn hello(&mut self, now: Instant, conn: Conn, worker: WorkerId, pid: u32) {
        if let Some(started) = self.spawning.remove(&worker) {
            self.started_at.insert(worker, started);
            self.welcome(now, conn, worker, pid, None);
        } else if let Some(&asked) = self.spawning.keys().next().filter(|_| self.uninvited && worker == 0) {
            // A worker without an id, where another engine starts them: it
            // takes the place of the oldest one asked for.
            self.spawning.remove(&asked);
            self.welcome(now, conn, asked, pid, Some(asked));
        } else if !self.uninvited {
            let reason = format!("unknown worker id {worker}");
            self.commands.push_back(Command::Refuse { conn, reason });
        } else if self.connected(worker) {
            let reason = format!("worker id {worker} is already in the job");
            self.commands.push_back(Command::Refuse { conn, reason });
        } else {
            // Started by another engine: an id of its own choosing (kept
            // clear of the ids this job gives), or a new one.
            let id = if worker == 0 { self.next_id } else { worker };
            self.next_id = self.next_id.max(id + 1);
            self.note(format!("worker {id} (pid {pid}) joined uninvited"), None);
            self.welcome(now, conn, id, pid, (worker == 0).then_some(id));
        }
    }

    fn welcome(&mut self, now: Instant, conn: Conn, id: WorkerId, pid: u32, assigned: Option<WorkerId>) {
        self.welcomed.push(Worker { id, conn, pid, since: now });
        self.commands.push_back(Command::Welcome { conn, assigned });
        // A worker started since: an older refusal is not why none joins.
        self.start_failed = None;
    }

    /// A connection closed: a joiner or a starter is given up (and
    /// replaced where it was one); a member's id is returned, for the
    /// caller to fail its generation.
    fn closed(&mut self, now: Instant, conn: Conn, why: &str) -> Option<WorkerId> {
        self.closed.insert(conn);
        if let Some(id) = self.held.iter().chain(&self.welcomed).find(|w| w.conn == conn).map(|w| w.id)
            && self.spare_ids.contains(&id)
        {
            self.welcomed.retain(|w| w.id != id);
            self.started_at.remove(&id);
            self.spare_lost(now, id, why);
        } else if let Some(i) = self.joiners.iter().position(|w| w.conn == conn) {
            let w = self.joiners.remove(i);
            self.replacement_lost(now, w.id);
            self.note(format!("worker {} left before it was given a rank ({why})", w.id), None);
        } else if let Some(i) = self.welcomed.iter().position(|w| w.conn == conn) {
            let w = self.welcomed.remove(i);
            self.started_at.remove(&w.id);
            self.replacement_lost(now, w.id);
            self.note(format!("worker {} failed while starting ({why})", w.id), Some(w.id));
        } else if let Some(m) = self.members.iter().find(|m| m.conn == conn) {
            return Some(m.id);
        }
        None
    }

    /// A worker of the coordinator this one took the job over from came
    /// back: with its state it is ready at once.
    fn returned(&mut self, now: Instant, conn: Conn, worker: WorkerId, pid: u32, holds: bool) {
        if !self.returning.remove(&worker) {
            let reason = format!("worker {worker} is not one this coordinator took the job over with");
            self.commands.push_back(Command::Refuse { conn, reason });
        } else if !holds {
            let reason = format!("worker {worker} kept no state at the job's committed step");
            self.commands.push_back(Command::Refuse { conn, reason });
        } else {
            self.started.push(worker);
            self.joiners.push(Worker { id: worker, conn, pid, since: now });
            self.commands.push_back(Command::Welcome { conn, assigned: None });
            self.note(format!("worker {worker} (pid {pid}) came back with its state"), None);
        }
    }

    /// Gives up the workers that did not say hello, or were not ready,
    /// within the join timeout.
    pub fn handle_timeout(&mut self, now: Instant) {
        let timeout = self.join_timeout;
        let late: Vec<WorkerId> =
            self.spawning.iter().filter(|(_, t)| now >= **t + timeout).map(|(id, _)| *id).collect();
        for worker in late {
            self.spawning.remove(&worker);
            self.spare_ids.remove(&worker);
            self.replacement_lost(now, worker);
            self.commands.push_back(Command::Stop {
                worker,
                conn: None,
                reason: "did not join in time".into(),
                grace: Duration::from_secs(1),
            });
            self.note(format!("worker {worker} did not join within {timeout:?}; gave it up"), Some(worker));
        }
        let (late, loading): (Vec<Worker>, Vec<Worker>) =
            std::mem::take(&mut self.welcomed).into_iter().partition(|w| now >= w.since + timeout);
        self.welcomed = loading;
        for w in late {
            self.spare_ids.remove(&w.id);
            self.replacement_lost(now, w.id);
            self.stop(&w, format!("not ready within {timeout:?}"), Duration::from_secs(1));
            self.note(
                format!("worker {} said hello but was not ready within {timeout:?}; gave it up", w.id),
                Some(w.id),
            );
        }
        self.keep_spares(now);
    }

    /// At a step boundary: workers that handed over their state leave,
    /// joiners are admitted (when `admit`), replacements take their place.
    /// `init_pending`: the next generation loads a checkpoint, so a
    /// replaced sole worker's state is not needed.
    pub fn boundary(&mut self, admit: bool, init_pending: bool) -> Boundary {
        let mut out = Boundary::default();
        for old in std::mem::take(&mut self.retiring) {
            if self.members.len() < 2 {
                // Whom it was handing over to is gone: it stays.
                self.handover_again.remove(&old);
                continue;
            }
            if self.handover_again.remove(&old) {
                // Its handover's generation failed: it goes first in the next.
                self.retiring.push(old);
                continue;
            }
            if let Some(i) = self.members.iter().position(|m| m.id == old) {
                let m = self.members.remove(i);
                match self.told.remove(&old) {
                    Some(t) => {
                        let why = t.why;
                        self.stop(&m, format!("left with notice ({why})"), STOP_GRACE);
                        out.reasons.push(format!(
                            "worker {old} left with notice ({why}) after handing over its state"
                        ));
                    }
                    None => {
                        self.stop(&m, "replaced".into(), STOP_GRACE);
                        out.reasons.push(format!("worker {old} left after handing over its state"));
                    }
                }
                self.replacing.retain(|_, o| *o != old);
                self.changed = true;
            }
        }
        self.told.retain(|id, _| self.members.iter().any(|m| m.id == *id));
        let stateful = self.members.len();
        while admit && !self.joiners.is_empty() {
            let j = self.joiners.remove(0);
            if let Some(old) = self.replacing.remove(&j.id) {
                if stateful == 1 && !init_pending && self.members.first().is_some_and(|m| m.id == old) {
                    // The replaced worker holds the only state: it stays rank 0
                    // for one step (the new generation's broadcast gives the
                    // replacement its state) and leaves at the next boundary.
                    self.retiring.push(old);
                    out.reasons.push(format!("worker {old} hands over to {}", j.id));
                } else if let Some(i) = self.members.iter().position(|m| m.id == old) {
                    let m = self.members.remove(i);
                    let (stop, said) = match self.told.remove(&old) {
                        Some(t) => {
                            let said = format!("left with notice ({}); replaced by worker {}", t.why, j.id);
                            (said.clone(), format!("worker {old} {said}"))
                        }
                        None => (
                            format!("replaced by worker {}", j.id),
                            format!("worker {old} replaced by {}", j.id),
                        ),
                    };
                    self.stop(&m, stop, STOP_GRACE);
                    out.reasons.push(said);
                }
            } else if self.members.len() >= self.max as usize {
                self.stop(&j, "the job is at its maximum size".into(), STOP_GRACE);
                continue;
            }
            self.members.push(j);
            out.admitted += 1;
            self.changed = true;
        }
        self.release_told(init_pending, &mut out);
        out.changed = std::mem::take(&mut self.changed);
        out
    }

    /// Workers told to go that stayed as the only holders of the state
    /// leave once other members hold it too: at once where rank 0 is
    /// another (it had the state before this boundary) or a checkpoint
    /// gives it, after one more generation otherwise (as rank 0 it
    /// broadcasts the state to those that joined).
    fn release_told(&mut self, init_pending: bool, out: &mut Boundary) {
        let told: Vec<WorkerId> = self.told.keys().copied().collect();
        for id in told {
            if self.retiring.contains(&id) || self.members.len() < 2 {
                continue;
            }
            let Some(i) = self.members.iter().position(|m| m.id == id) else { continue };
            if i == 0 && !init_pending {
                self.retiring.push(id);
                out.reasons.push(format!("worker {id} hands over its state before it leaves"));
                self.changed = true;
            } else {
                let m = self.members.remove(i);
                let why = self.told.remove(&id).map(|t| t.why).unwrap_or_default();
                self.stop(&m, format!("left with notice ({why})"), STOP_GRACE);
                out.reasons.push(format!("worker {id} left with notice ({why})"));
                self.replacing.retain(|_, o| *o != id);
                self.changed = true;
            }
        }
    }

    /// The replacement `new` will not join. A worker told to go that it
    /// was to take over from, and that still holds the only state, gets
    /// another (up to [`REPLACEMENT_TRIES`] in all).
    fn replacement_lost(&mut self, now: Instant, new: WorkerId) {
        let Some(old) = self.replacing.remove(&new) else { return };
        if self.told.contains_key(&old) && self.members.len() == 1 && self.members[0].id == old {
            self.note(
                format!("worker {new}, which was to take over from worker {old} (told to go), will not join"),
                None,
            );
            self.replace_told(now, old);
        }
    }

    /// Starts a replacement for `old`, told to go, when it holds the only
    /// state and none is on its way (up to [`REPLACEMENT_TRIES`] in all).
    /// Returns whether it did.
    fn replace_told(&mut self, now: Instant, old: WorkerId) -> bool {
        let sole = self.members.len() == 1 && self.members[0].id == old;
        let coming = self.replacing.values().any(|o| *o == old);
        let Some(t) = self.told.get_mut(&old).filter(|_| sole && !coming) else { return false };
        if t.tries >= REPLACEMENT_TRIES {
            let tries = t.tries;
            self.note(
                format!(
                    "worker {old}, told to go, holds the job's only state; {tries} replacements did not start: \
                     it leaves once another worker joins"
                ),
                None,
            );
            return false;
        }
        t.tries += 1;
        let next = self.next_id;
        self.spawn(now, 1);
        self.replacing.insert(next, old);
        self.note(format!("worker {next} is started to take the state over from worker {old}"), None);
        true
    }

    /// The generation failed: the dead are dropped (and the job kept at
    /// its minimum). A worker handing its state over survives as rank 0 of
    /// the next generation, so that its broadcast is done again.
    pub fn fail(&mut self, now: Instant, dead: &BTreeSet<WorkerId>) {
        for &worker in dead {
            self.commands.push_back(Command::Stop {
                worker,
                conn: None,
                reason: "lost".into(),
                grace: Duration::from_millis(500),
            });
        }
        let before = self.members.len();
        self.members.retain(|m| !dead.contains(&m.id));
        // Warm spares take the lost members' places at the boundary that
        // forms the next generation.
        let lost = (before - self.members.len()) as u32;
        self.spare_counts.members_lost += u64::from(lost);
        let taken = self.take_spares(lost);
        if taken > 0 {
            self.note(format!("{taken} warm spare(s) take the place of the {lost} lost"), None);
        }
        self.retiring.retain(|r| !dead.contains(r));
        for &r in self.retiring.iter().rev() {
            if let Some(i) = self.members.iter().position(|m| m.id == r) {
                let m = self.members.remove(i);
                self.members.insert(0, m);
            }
            self.handover_again.insert(r);
        }
        if let Some(first) = self.members.first().map(|m| m.id) {
            // Its replacement was lost with the generation: another comes.
            self.replace_told(now, first);
        }
        self.changed = true;
        let have = self.world() + self.coming();
        if have < self.min {
            self.spawn_cold(now, self.min - have);
        }
        self.keep_spares(now);
    }

    /// Every member is gone: starts workers up to the minimum, counting
    /// those already on their way.
    pub fn refill(&mut self, now: Instant) {
        let missing = self.min.saturating_sub(self.coming());
        self.spawn_cold(now, missing);
        self.changed = true;
    }

    /// Reduces a policy decision to one target size within the bounds and
    /// acts on it: pending starts count toward the maximum, so no list of
    /// actions can start more workers than the maximum allows; replacements
    /// are deduplicated and only name current members. Returns the
    /// decision's description when it resizes the job.
    pub fn apply_decision(&mut self, now: Instant, actions: &[Action]) -> Option<String> {
        let world = self.world();
        let (min, max) = (self.min as i64, self.max as i64);
        let have = (world + self.coming()) as i64;
        let mut target = have;
        let mut replace: Vec<WorkerId> = Vec::new();
        for a in actions {
            match *a {
                Action::Hold => {}
                Action::ScaleOut(n) => target = target.saturating_add(n as i64),
                Action::ScaleIn(n) => target = target.saturating_sub(n as i64),
                Action::Replace(id) => {
                    if !replace.contains(&id) {
                        replace.push(id)
                    }
                }
            }
        }
        let target = target.clamp(min.min(max), max);
        let described = in_words(actions);
        let mut resize = None;
        if target > have {
            // Warm spares first, ready ones at the next boundary; workers
            // are started for the rest.
            let more = (target - have) as u32;
            let taken = self.take_spares(more);
            self.spawn_cold(now, more - taken);
            resize = Some(described);
        } else if target < world as i64 {
            let keep = (target as usize).max(min as usize);
            if keep < self.members.len() {
                let removed: Vec<Worker> = self.members.drain(keep..).collect();
                for m in removed {
                    self.stop(&m, described.clone(), STOP_GRACE);
                }
                self.changed = true;
                resize = Some(described);
            }
        }
        for id in replace {
            let member = self.members.iter().any(|m| m.id == id);
            let busy = self.replacing.values().any(|&o| o == id) || self.retiring.contains(&id);
            if !member {
                self.note(
                    format!("policy asked to replace worker {id}, which is not a member; ignored"),
                    None,
                );
                continue;
            }
            if busy {
                continue;
            }
            let new = self.next_id;
            self.spawn(now, 1);
            self.replacing.insert(new, id);
            resize = Some(format!("policy: replace worker {id}, slower than the others, by worker {new}"));
        }
        self.keep_spares(now);
        resize
    }

    /// Worker `worker` was told to go by its scheduler (preemption, a spot
    /// notice): it leaves now, at a boundary, as a planned scale-in (a sole
    /// member first hands its state to a replacement), and workers are
    /// started to keep the minimum. Returns what happened, None when it
    /// was not in the job.
    pub fn leave(&mut self, now: Instant, worker: WorkerId, reason: &str) -> Option<Leave> {
        let why = format!("left with notice ({reason})");
        if let Some(i) = self.members.iter().position(|m| m.id == worker) {
            if !self.told.contains_key(&worker) {
                // Its scheduler took it: a loss the job did not choose.
                self.spare_counts.members_lost += 1;
            }
            if self.members.len() == 1 {
                self.told.entry(worker).or_insert_with(|| Told { why: reason.to_string(), tries: 1 });
                let new = match self.replacing.iter().find(|(_, o)| **o == worker) {
                    Some((new, _)) => *new,
                    None => {
                        // A warm spare takes the state over where there is
                        // one; a worker is started where there is none.
                        let new = match self.take_spare() {
                            Some(spare) => spare,
                            None => {
                                let new = self.next_id;
                                self.spawn_cold(now, 1);
                                new
                            }
                        };
                        self.replacing.insert(new, worker);
                        self.keep_spares(now);
                        new
                    }
                };
                return Some(Leave::AfterHandover(format!(
                    "worker {worker} was told to go ({reason}): it hands its state to worker {new} first"
                )));
            }
            let m = self.members.remove(i);
            self.stop(&m, why.clone(), STOP_GRACE);
            self.retiring.retain(|r| *r != worker);
            self.told.remove(&worker);
            self.changed = true;
            // A warm spare takes its place at the next boundary.
            self.take_spares(1);
        } else if let Some(i) = self.joiners.iter().position(|w| w.id == worker) {
            let w = self.joiners.remove(i);
            self.replacement_lost(now, w.id);
            self.stop(&w, why.clone(), STOP_GRACE);
        } else if let Some(i) = self.welcomed.iter().position(|w| w.id == worker) {
            let w = self.welcomed.remove(i);
            self.spare_ids.remove(&w.id);
            self.replacement_lost(now, w.id);
            self.stop(&w, why.clone(), STOP_GRACE);
        } else if let Some(i) = self.held.iter().position(|w| w.id == worker) {
            let w = self.held.remove(i);
            self.spare_ids.remove(&w.id);
            self.stop(&w, why.clone(), STOP_GRACE);
        } else {
            return None;
        }
        let have = self.world() + self.coming();
        if have < self.min {
            self.spawn_cold(now, self.min - have);
        }
        self.keep_spares(now);
        Some(Leave::Now(format!("worker {worker} {why}")))
    }

    /// The only member was told to go: it holds the job's state alone.
    pub fn told_alone(&self) -> bool {
        self.members.len() == 1 && self.told.contains_key(&self.members[0].id)
    }

    /// The id of the worker on `conn`, in any state.
    pub fn worker_on(&self, conn: Conn) -> Option<WorkerId> {
        let all = self.welcomed.iter().chain(&self.joiners).chain(&self.members).chain(&self.held);
        all.into_iter().find(|w| w.conn == conn).map(|w| w.id)
    }

    /// The job is done, or failed: every worker, in whatever state, is
    /// told to stop.
    pub fn stop_all(&mut self, reason: &str) {
        self.spares_wanted = 0;
        self.spare_ids.clear();
        let all: Vec<Worker> = std::mem::take(&mut self.members)
            .into_iter()
            .chain(std::mem::take(&mut self.joiners))
            .chain(std::mem::take(&mut self.welcomed))
            .chain(std::mem::take(&mut self.held))
            .collect();
        for w in all {
            self.stop(&w, reason.to_string(), STOP_GRACE);
        }
        for worker in std::mem::take(&mut self.spawning).into_keys() {
            self.commands.push_back(Command::Stop {
                worker,
                conn: None,
                reason: reason.to_string(),
                grace: Duration::from_secs(1),
            });
        }
    }

    /// No more workers will be admitted: those waiting or loading are stopped.
    pub fn stop_newcomers(&mut self, reason: &str) {
        self.spares_wanted = 0;
        for worker in std::mem::take(&mut self.spare_ids) {
            if self.spawning.remove(&worker).is_some() {
                self.commands.push_back(Command::Stop {
                    worker,
                    conn: None,
                    reason: reason.to_string(),
                    grace: Duration::from_secs(1),
                });
            }
        }
        let waiting: Vec<Worker> = std::mem::take(&mut self.joiners)
            .into_iter()
            .chain(std::mem::take(&mut self.welcomed))
            .chain(std::mem::take(&mut self.held))
            .collect();
        for w in waiting {
            self.stop(&w, reason.to_string(), STOP_GRACE);
        }
    }
}

/// A policy's decision as a scale line says it: `policy: add 2 workers`.
fn in_words(actions: &[Action]) -> String {
    let plural = |n: u32| if n == 1 { "worker" } else { "workers" };
    let said: Vec<String> = actions
        .iter()
        .filter(|a| !matches!(a, Action::Hold))
        .take(4)
        .map(|a| match *a {
            Action::ScaleOut(n) => format!("add {n} {}", plural(n)),
            Action::ScaleIn(n) => format!("remove {n} {}", plural(n)),
            Action::Replace(id) => format!("replace worker {id}, slower than the others"),
            Action::Hold => unreachable!("filtered out above"),
        })
        .collect();
    let more = actions.iter().filter(|a| !matches!(a, Action::Hold)).count().saturating_sub(4);
    match (said.is_empty(), more) {
        (true, _) => "policy: hold".into(),
        (false, 0) => format!("policy: {}", said.join(", ")),
        (false, m) => format!("policy: {} (and {m} more)", said.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const JOIN: Duration = Duration::from_secs(60);

    fn drain(m: &mut Membership) -> Vec<Command> {
        std::iter::from_fn(|| m.poll_command()).collect()
    }

    /// A job of `n` members (ids 1..=n on connections 101..), formed at `t`.
    fn formed(n: u32, min: u32, max: u32, t: Instant) -> Membership {
        let mut m = Membership::new(min, max, JOIN, 1);
        m.spawn(t, n);
        for id in 1..=n as u64 {
            m.handle(t, MemberEvent::Hello { conn: 100 + id, worker: id, pid: 1000 + id as u32 });
            m.handle(t, MemberEvent::Ready { conn: 100 + id });
        }
        let b = m.boundary(true, false);
        assert!(b.changed && b.admitted == n as usize);
        drain(&mut m);
        m
    }

    #[test]
    fn members_of_one_host_become_consecutive_ranks_and_the_first_stays_first() {
        let t = Instant::now();
        let mut m = formed(6, 1, 6, t);
        // Workers 1..=6 alternate between two hosts' relays; worker 1 holds the state.
        let host = |w: &Worker| Some(w.id % 2);
        m.group_by(host);
        let ids: Vec<WorkerId> = m.members().iter().map(|w| w.id).collect();
        assert_eq!(ids, vec![1, 3, 5, 2, 4, 6]);
        // Workers on their own connections (no relay) stay together too.
        m.group_by(|w| (w.id > 3).then_some(7));
        let ids: Vec<WorkerId> = m.members().iter().map(|w| w.id).collect();
        assert_eq!(ids, vec![1, 3, 2, 5, 4, 6]);
    }

    fn stops(cmds: &[Command]) -> Vec<WorkerId> {
        cmds.iter()
            .filter_map(|c| if let Command::Stop { worker, .. } = c { Some(*worker) } else { None })
            .collect()
    }

    #[test]
    fn a_ready_worker_tells_how_long_it_took_to_start_and_to_load() {
        let t = Instant::now();
        let mut m = Membership::new(1, 4, JOIN, 1);
        m.spawn(t, 2);
        m.handle(t + Duration::from_millis(1500), MemberEvent::Hello { conn: 7, worker: 1, pid: 42 });
        m.handle(t + Duration::from_millis(1600), MemberEvent::Hello { conn: 8, worker: 2, pid: 43 });
        assert!(m.take_readied().is_empty(), "not ready yet");
        m.handle(t + Duration::from_millis(2000), MemberEvent::Ready { conn: 7 });
        // Worker 2 fails while loading: nothing to tell of it.
        m.handle(t + Duration::from_millis(2100), MemberEvent::Closed { conn: 8, why: "gone".into() });
        let r = m.take_readied();
        assert_eq!(
            r,
            [Readied { id: 1, start: Duration::from_millis(1500), load: Duration::from_millis(500) }]
        );
        assert!(m.take_readied().is_empty(), "told once");
    }

    #[test]
    fn a_worker_goes_from_started_to_member_at_a_boundary() {
        let t = Instant::now();
        let mut m = Membership::new(1, 4, JOIN, 1);
        m.spawn(t, 1);
        assert_eq!(drain(&mut m), vec![Command::Spawn { worker: 1 }]);
        m.handle(t, MemberEvent::Hello { conn: 7, worker: 1, pid: 42 });
        assert_eq!(drain(&mut m), vec![Command::Welcome { conn: 7, assigned: None }]);
        assert_eq!(m.world(), 0);
        m.handle(t, MemberEvent::Ready { conn: 7 });
        assert_eq!(m.joiners(), 1);
        let b = m.boundary(true, false);
        assert!(b.changed);
        assert_eq!(m.members()[0].id, 1);
        assert_eq!(m.rank_of(7), Some(0));
        assert!(!m.boundary(true, false).changed, "nothing changed since");
    }

    #[test]
    fn after_a_takeover_the_old_members_that_kept_their_state_come_back_as_they_are() {
        let t = Instant::now();
        let mut m = Membership::new(1, 4, JOIN, 8);
        m.expect_return(&[3, 5, 6]);
        assert_eq!(m.returning(), 3);
        // Back with its state: ready at once, no start, no loading.
        m.handle(t, MemberEvent::Returned { conn: 1, worker: 3, pid: 33, holds: true });
        assert_eq!(drain(&mut m)[0], Command::Welcome { conn: 1, assigned: None });
        assert_eq!(m.joiners(), 1);
        // Without the committed step's state, or not one of the old members: refused.
        m.handle(t, MemberEvent::Returned { conn: 2, worker: 5, pid: 55, holds: false });
        assert!(
            matches!(&drain(&mut m)[..], [Command::Refuse { conn: 2, reason }] if reason.contains("no state"))
        );
        m.handle(t, MemberEvent::Returned { conn: 4, worker: 9, pid: 99, holds: true });
        assert!(matches!(&drain(&mut m)[..], [Command::Refuse { conn: 4, .. }]));
        // A second return of the same worker is not taken either.
        m.handle(t, MemberEvent::Returned { conn: 7, worker: 3, pid: 33, holds: true });
        assert!(matches!(&drain(&mut m)[..], [Command::Refuse { conn: 7, .. }]));
        assert_eq!(m.end_return(), vec![6]);
        assert_eq!(m.returning(), 0);
        let b = m.boundary(true, false);
        assert!(b.changed && b.admitted == 1);
        assert_eq!((m.members()[0].id, m.members()[0].pid), (3, 33));
        assert!(m.started().contains(&3));
    }

    #[test]
    fn a_worker_told_to_go_leaves_as_a_scale_in_and_a_sole_one_hands_over_first() {
        let t = Instant::now();
        let mut m = formed(3, 2, 3, t);
        assert_eq!(m.leave(t, 2, "SIGTERM"), Some(Leave::Now("worker 2 left with notice (SIGTERM)".into())));
        let cmds = drain(&mut m);
        assert!(
            matches!(&cmds[..], [Command::Stop { worker: 2, reason, .. }] if reason == "left with notice (SIGTERM)"),
            "{cmds:?}"
        );
        assert_eq!(m.members().iter().map(|w| w.id).collect::<Vec<_>>(), vec![1, 3]);
        assert!(m.boundary(true, false).changed);
        // Below the minimum: a worker is started to keep it.
        assert!(m.leave(t, 3, "notice file /run/spot").is_some());
        assert!(drain(&mut m).contains(&Command::Spawn { worker: 4 }));
        assert_eq!(m.leave(t, 99, "SIGTERM"), None, "not in the job");
        // The sole member stays until its replacement took its state (one
        // replacement, however often it is told).
        let mut one = formed(1, 1, 2, t);
        let said = one.leave(t, 1, "SIGTERM").unwrap();
        assert!(
            matches!(&said, Leave::AfterHandover(s) if s.contains("hands its state to worker 2")),
            "{said:?}"
        );
        assert!(one.leave(t, 1, "SIGTERM").is_some());
        assert_eq!(drain(&mut one), vec![Command::Spawn { worker: 2 }]);
        assert_eq!(one.world(), 1);
    }

    #[test]
    fn a_sole_worker_told_to_go_leaves_once_any_other_worker_holds_the_state() {
        let t = Instant::now();
        let mut one = formed(1, 1, 3, t);
        one.leave(t, 1, "SIGTERM on n1").unwrap();
        assert_eq!(drain(&mut one), vec![Command::Spawn { worker: 2 }]);
        // Its replacement does not start (the partition is down): another
        // is asked for...
        one.handle(t, MemberEvent::Exited { worker: 2, status: "Slurm did not start it".into() });
        assert!(drain(&mut one).contains(&Command::Spawn { worker: 3 }));
        assert!(!one.boundary(true, false).changed);
        assert_eq!(one.world(), 1, "the only state stays");
        // ...but a worker the policy asked for joins first: the told worker
        // hands its state over in their first generation and leaves at the
        // next boundary.
        assert!(one.apply_decision(t, &[Action::ScaleOut(1)]).is_some());
        assert_eq!(drain(&mut one), vec![Command::Spawn { worker: 4 }]);
        one.handle(t, MemberEvent::Hello { conn: 204, worker: 4, pid: 44 });
        one.handle(t, MemberEvent::Ready { conn: 204 });
        let b = one.boundary(true, false);
        assert_eq!(b.admitted, 1);
        assert_eq!(one.members()[0].id, 1, "rank 0 broadcasts the state");
        assert!(stops(&drain(&mut one)).is_empty());
        let b = one.boundary(true, false);
        assert!(b.changed);
        assert!(
            b.reasons
                .iter()
                .any(|r| r == "worker 1 left with notice (SIGTERM on n1) after handing over its state"),
            "{:?}",
            b.reasons
        );
        assert_eq!(stops(&drain(&mut one)), vec![1]);
        assert_eq!(one.members().iter().map(|w| w.id).collect::<Vec<_>>(), vec![4]);
        // Its second replacement, when it comes, is a joiner like any other.
        one.handle(t, MemberEvent::Hello { conn: 203, worker: 3, pid: 33 });
        one.handle(t, MemberEvent::Ready { conn: 203 });
        assert_eq!(one.boundary(true, false).admitted, 1);
        assert_eq!(one.members().iter().map(|w| w.id).collect::<Vec<_>>(), vec![4, 3]);
        // Where a checkpoint gives the state, it leaves at once.
        let mut two = told_with_its_replacement_ready(t);
        let b = two.boundary(true, true);
        assert!(
            b.reasons.iter().any(|r| r == "worker 1 left with notice (SIGTERM); replaced by worker 2"),
            "{:?}",
            b.reasons
        );
        assert_eq!(two.members().iter().map(|w| w.id).collect::<Vec<_>>(), vec![2]);
    }

    /// A job whose one member (worker 1) was told to go, with its
    /// replacement (worker 2) ready to join.
    fn told_with_its_replacement_ready(t: Instant) -> Membership {
        let mut m = formed(1, 1, 3, t);
        m.leave(t, 1, "SIGTERM").unwrap();
        drain(&mut m);
        m.handle(t, MemberEvent::Hello { conn: 202, worker: 2, pid: 22 });
        m.handle(t, MemberEvent::Ready { conn: 202 });
        m
    }

    #[test]
    fn a_sole_worker_told_to_go_gets_a_few_replacements_and_a_failed_handover_is_done_again() {
        let t = Instant::now();
        let mut one = formed(1, 1, 3, t);
        one.leave(t, 1, "SIGTERM").unwrap();
        assert_eq!(drain(&mut one), vec![Command::Spawn { worker: 2 }]);
        // Replacements that never join are started again, three in all.
        one.spawn_failed(2, "no slot".into());
        assert!(drain(&mut one).contains(&Command::Spawn { worker: 3 }));
        one.handle(t, MemberEvent::Exited { worker: 3, status: "pending too long".into() });
        assert!(drain(&mut one).contains(&Command::Spawn { worker: 4 }));
        one.handle_timeout(t + JOIN);
        let said = drain(&mut one);
        assert!(!said.iter().any(|c| matches!(c, Command::Spawn { .. })), "{said:?}");
        assert!(
            said.iter().any(
                |c| matches!(c, Command::Note { text, .. } if text.contains("3 replacements did not start"))
            ),
            "{said:?}"
        );
        assert_eq!(one.world(), 1, "it still holds the state");

        // A handover whose generation fails is done again, the worker
        // handing over first; one whose new worker died is not done at all.
        let mut two = told_with_its_replacement_ready(t);
        assert!(two.boundary(true, false).changed);
        two.fail(t, &BTreeSet::new());
        assert!(two.boundary(true, false).changed);
        assert_eq!(two.members().iter().map(|w| w.id).collect::<Vec<_>>(), vec![1, 2], "handing over again");
        assert!(stops(&drain(&mut two)).is_empty());
        assert!(two.boundary(true, false).changed);
        assert_eq!(stops(&drain(&mut two)), vec![1]);
        let mut three = told_with_its_replacement_ready(t);
        three.boundary(true, false);
        three.fail(t, &BTreeSet::from([2]));
        assert!(drain(&mut three).contains(&Command::Spawn { worker: 3 }), "another replacement");
        three.boundary(true, false);
        three.boundary(true, false);
        assert_eq!(three.members().iter().map(|w| w.id).collect::<Vec<_>>(), vec![1], "it stays");
        assert!(three.told_alone());
    }

    #[test]
    fn an_unknown_worker_is_refused() {
        let mut m = Membership::new(1, 4, JOIN, 1);
        m.handle(Instant::now(), MemberEvent::Hello { conn: 3, worker: 99, pid: 1 });
        assert!(matches!(&drain(&mut m)[..], [Command::Refuse { conn: 3, reason }] if reason.contains("99")));
    }

    #[test]
    fn where_uninvited_workers_may_join_they_get_ids_and_wait_for_a_boundary_within_the_maximum() {
        let t = Instant::now();
        let mut m = formed(1, 1, 2, t);
        m.admit_uninvited(true);
        // Without an id: given the next one. With one: kept, and new ids go past it.
        m.handle(t, MemberEvent::Hello { conn: 20, worker: 0, pid: 5 });
        m.handle(t, MemberEvent::Hello { conn: 21, worker: 9, pid: 6 });
        let cmds = drain(&mut m);
        assert!(cmds.contains(&Command::Welcome { conn: 20, assigned: Some(2) }), "{cmds:?}");
        assert!(cmds.contains(&Command::Welcome { conn: 21, assigned: None }), "{cmds:?}");
        assert_eq!(m.next_id(), 10);
        // Asked for and filled by a worker without an id: it gets the id asked for.
        m.spawn(t, 1);
        assert_eq!(drain(&mut m), vec![Command::Spawn { worker: 10 }]);
        m.handle(t, MemberEvent::Hello { conn: 23, worker: 0, pid: 8 });
        assert_eq!(drain(&mut m), vec![Command::Welcome { conn: 23, assigned: Some(10) }]);
        assert!(!m.nothing_loading() && m.poll_timeout().is_some());
        m.handle(t, MemberEvent::Closed { conn: 23, why: "gone".into() });
        drain(&mut m);
        // An id already in the job is refused.
        m.handle(t, MemberEvent::Hello { conn: 22, worker: 9, pid: 7 });
        assert!(
            matches!(&drain(&mut m)[..], [Command::Refuse { conn: 22, reason }] if reason.contains("already"))
        );
        // Both get ready; the boundary admits up to the maximum and sends the other away.
        m.handle(t, MemberEvent::Ready { conn: 20 });
        m.handle(t, MemberEvent::Ready { conn: 21 });
        let b = m.boundary(true, false);
        assert_eq!((b.admitted, m.world()), (1, 2));
        assert_eq!(stops(&drain(&mut m)), vec![9]);
    }

    #[test]
    fn every_wait_for_a_worker_ends_at_the_join_timeout() {
        let t = Instant::now();
        let mut m = Membership::new(1, 4, JOIN, 1);
        m.spawn(t, 2);
        m.handle(t + Duration::from_secs(10), MemberEvent::Hello { conn: 5, worker: 2, pid: 9 });
        drain(&mut m);
        // Worker 1 never connects; worker 2 connects at 10 s and never gets ready.
        assert_eq!(m.poll_timeout(), Some(t + JOIN));
        m.handle_timeout(t + JOIN - Duration::from_millis(1));
        assert!(drain(&mut m).is_empty(), "nothing before the timeout");
        m.handle_timeout(t + JOIN);
        assert_eq!(stops(&drain(&mut m)), vec![1]);
        assert_eq!(m.poll_timeout(), Some(t + Duration::from_secs(10) + JOIN));
        m.handle_timeout(t + Duration::from_secs(10) + JOIN);
        let cmds = drain(&mut m);
        assert!(matches!(&cmds[0], Command::Stop { worker: 2, conn: Some(5), .. }), "{cmds:?}");
        assert!(m.nothing_loading() && m.poll_timeout().is_none());
    }

    #[test]
    fn a_flood_of_scale_outs_starts_only_up_to_the_maximum_counting_pending_starts() {
        let t = Instant::now();
        let mut m = formed(1, 1, 3, t);
        assert!(m.apply_decision(t, &vec![Action::ScaleOut(1); 10_000]).is_some());
        assert_eq!(drain(&mut m).iter().filter(|c| matches!(c, Command::Spawn { .. })).count(), 2);
        // The starts are pending: another flood starts nothing.
        assert!(m.apply_decision(t, &vec![Action::ScaleOut(5); 100]).is_none());
        assert!(drain(&mut m).is_empty());
    }

    #[test]
    fn scale_in_keeps_the_minimum_and_stops_the_highest_ranks() {
        let t = Instant::now();
        let mut m = formed(4, 2, 4, t);
        m.apply_decision(t, &[Action::ScaleIn(3)]);
        assert_eq!(stops(&drain(&mut m)), vec![3, 4]);
        assert_eq!(m.world(), 2);
        assert!(m.boundary(true, false).changed);
    }

    #[test]
    fn a_replacement_takes_its_workers_place_and_a_sole_worker_hands_over() {
        let t = Instant::now();
        let mut m = formed(2, 1, 4, t);
        m.apply_decision(t, &[Action::Replace(1), Action::Replace(1), Action::Replace(77)]);
        let cmds = drain(&mut m);
        assert_eq!(cmds.iter().filter(|c| matches!(c, Command::Spawn { worker: 3 })).count(), 1, "{cmds:?}");
        assert!(cmds.iter().any(|c| matches!(c, Command::Note { text, .. } if text.contains("77"))));
        m.handle(t, MemberEvent::Hello { conn: 9, worker: 3, pid: 3 });
        m.handle(t, MemberEvent::Ready { conn: 9 });
        let b = m.boundary(true, false);
        assert_eq!(stops(&drain(&mut m)), vec![1]);
        assert!(b.changed && b.reasons[0].contains("worker 1 replaced by 3"));
        assert_eq!(m.members().iter().map(|w| w.id).collect::<Vec<_>>(), vec![2, 3]);

        // One worker: it stays for one step so the broadcast gives the new one its state.
        let mut m = formed(1, 1, 4, t);
        m.apply_decision(t, &[Action::Replace(1)]);
        drain(&mut m);
        m.handle(t, MemberEvent::Hello { conn: 9, worker: 2, pid: 2 });
        m.handle(t, MemberEvent::Ready { conn: 9 });
        let b = m.boundary(true, false);
        assert!(stops(&drain(&mut m)).is_empty() && m.world() == 2 && m.handing_over());
        assert!(b.reasons[0].contains("hands over"));
        let b = m.boundary(true, false);
        assert_eq!(stops(&drain(&mut m)), vec![1]);
        assert!(b.changed && m.members()[0].id == 2 && !m.handing_over());
    }

    #[test]
    fn joiners_past_the_maximum_are_sent_away() {
        let t = Instant::now();
        let mut m = formed(2, 1, 2, t);
        m.spawn(t, 1);
        m.handle(t, MemberEvent::Hello { conn: 9, worker: 3, pid: 3 });
        m.handle(t, MemberEvent::Ready { conn: 9 });
        drain(&mut m);
        assert!(!m.boundary(true, false).changed);
        assert_eq!(stops(&drain(&mut m)), vec![3]);
    }

    #[test]
    fn a_failed_step_drops_the_dead_and_refills_to_the_minimum() {
        let t = Instant::now();
        let mut m = formed(3, 3, 4, t);
        assert_eq!(m.handle(t, MemberEvent::Closed { conn: 102, why: "eof".into() }), Some(2));
        assert!(m.is_closed(102));
        m.fail(t, &BTreeSet::from([2]));
        let cmds = drain(&mut m);
        assert_eq!(stops(&cmds), vec![2]);
        assert!(cmds.contains(&Command::Spawn { worker: 4 }));
        assert_eq!(m.members().iter().map(|w| w.id).collect::<Vec<_>>(), vec![1, 3]);
        assert!(m.boundary(true, false).changed);
    }

    fn spawned(cmds: &[Command]) -> Vec<WorkerId> {
        cmds.iter()
            .filter_map(|c| if let Command::Spawn { worker } = c { Some(*worker) } else { None })
            .collect()
    }

    /// Worker `id` connects (on 100 + id) and becomes ready.
    fn ready(m: &mut Membership, t: Instant, id: WorkerId) {
        m.handle(t, MemberEvent::Hello { conn: 100 + id, worker: id, pid: 1000 + id as u32 });
        m.handle(t, MemberEvent::Ready { conn: 100 + id });
    }

    #[test]
    fn warm_spares_wait_outside_the_ring_and_a_growth_takes_one_at_once() {
        let t = Instant::now();
        let mut m = formed(2, 1, 5, t);
        m.set_spares(t, 2);
        assert_eq!(spawned(&drain(&mut m)), vec![3, 4]);
        assert_eq!((m.spares(), m.coming()), (2, 0), "spares are not workers on their way");
        ready(&mut m, t, 3);
        ready(&mut m, t, 4);
        assert_eq!(m.spares_ready(), 2);
        assert!(!m.boundary(true, false).changed, "a ready spare does not join by itself");
        assert_eq!(m.world(), 2);
        assert!(m.on_the_way().contains(&(3, "a warm spare, ready")));
        // The policy grows by one: spare 3 joins at the next boundary,
        // and one more spare is started, within the maximum of 5.
        assert!(m.apply_decision(t, &[Action::ScaleOut(1)]).is_some());
        assert_eq!(spawned(&drain(&mut m)), vec![5], "no worker started for the growth, one spare behind");
        let b = m.boundary(true, false);
        assert_eq!((b.changed, b.admitted), (true, 1));
        assert_eq!(m.members().iter().map(|w| w.id).collect::<Vec<_>>(), vec![1, 2, 3]);
        // At the maximum: 3 members and 2 spares; growing by two takes both
        // and starts no spare (no room).
        ready(&mut m, t, 5);
        assert!(m.apply_decision(t, &[Action::ScaleOut(2)]).is_some());
        assert!(spawned(&drain(&mut m)).is_empty());
        assert_eq!(m.boundary(true, false).admitted, 2);
        assert_eq!((m.world(), m.spares()), (5, 0));
    }

    #[test]
    fn a_lost_member_s_place_is_taken_by_a_spare_and_a_new_spare_is_started() {
        let t = Instant::now();
        let mut m = formed(3, 1, 5, t);
        m.set_spares(t, 1);
        assert_eq!(spawned(&drain(&mut m)), vec![4]);
        ready(&mut m, t, 4);
        assert_eq!(m.handle(t, MemberEvent::Closed { conn: 102, why: "eof".into() }), Some(2));
        m.fail(t, &BTreeSet::from([2]));
        let cmds = drain(&mut m);
        assert_eq!(stops(&cmds), vec![2]);
        assert_eq!(spawned(&cmds), vec![5], "a spare behind the one taken");
        let b = m.boundary(true, false);
        assert_eq!(b.admitted, 1, "the spare joins the generation the failure forms");
        assert_eq!(m.members().iter().map(|w| w.id).collect::<Vec<_>>(), vec![1, 3, 4]);
    }

    #[test]
    fn a_spare_that_dies_while_waiting_is_replaced_and_never_joins() {
        let t = Instant::now();
        let mut m = formed(1, 1, 4, t);
        m.set_spares(t, 1);
        assert_eq!(spawned(&drain(&mut m)), vec![2]);
        ready(&mut m, t, 2);
        assert_eq!(m.handle(t, MemberEvent::Closed { conn: 102, why: "killed".into() }), None);
        let cmds = drain(&mut m);
        assert_eq!(spawned(&cmds), vec![3]);
        assert!(
            cmds.iter()
                .any(|c| matches!(c, Command::Note { text, .. } if text.contains("warm spare 2 was lost")))
        );
        // One that dies before it connects, likewise.
        m.handle(t, MemberEvent::Exited { worker: 3, status: "exit status: 1".into() });
        assert_eq!(spawned(&drain(&mut m)), vec![4]);
        assert_eq!((m.spares(), m.world()), (1, 1));
        assert!(!m.boundary(true, false).changed);
        // The job's end stops the spares too.
        ready(&mut m, t, 4);
        m.stop_all("done");
        assert_eq!(stops(&drain(&mut m)), vec![1, 4]);
    }

    #[test]
    fn spares_that_cannot_start_are_not_counted_nor_started_again_and_again() {
        let t = Instant::now();
        let mut m = formed(1, 1, 4, t);
        m.set_spares(t, 1);
        assert_eq!(spawned(&drain(&mut m)), vec![2]);
        // The scaler refuses it: no phantom spare left to take.
        m.spawn_failed(2, "no slot".into());
        drain(&mut m);
        assert_eq!(m.spares(), 0);
        assert!(m.apply_decision(t, &[Action::ScaleOut(1)]).is_some());
        let cmds = drain(&mut m);
        assert_eq!(spawned(&cmds).len(), 2, "a worker for the growth and a spare: {cmds:?}");
        // Spares whose program dies before it is ready: the third in a row
        // ends the keeping of spares.
        let spare = *spawned(&cmds).last().unwrap();
        m.handle(t, MemberEvent::Exited { worker: spare, status: "exit status: 1".into() });
        let again = spawned(&drain(&mut m));
        assert_eq!(again.len(), 1);
        m.handle(t, MemberEvent::Exited { worker: again[0], status: "exit status: 1".into() });
        let cmds = drain(&mut m);
        assert!(spawned(&cmds).is_empty(), "{cmds:?}");
        assert!(
            cmds.iter().any(|c| matches!(c, Command::Note { text, .. } if text.contains("keeps no spares")))
        );
        assert_eq!(m.spares(), 0);
    }

    #[test]
    fn fewer_spares_wanted_stops_the_least_ready_first_and_starts_none_behind() {
        let t = Instant::now();
        let mut m = formed(1, 1, 6, t);
        assert!(m.set_spares(t, 3));
        assert_eq!(spawned(&drain(&mut m)), vec![2, 3, 4]);
        ready(&mut m, t, 2);
        m.handle(t, MemberEvent::Hello { conn: 103, worker: 3, pid: 1003 });
        drain(&mut m);
        // 2 ready, 3 loading, 4 not yet connected: 4 goes first, then 3.
        assert!(m.set_spares(t, 1));
        let cmds = drain(&mut m);
        assert_eq!(stops(&cmds), vec![4, 3]);
        assert!(spawned(&cmds).is_empty());
        assert!(matches!(&cmds[0], Command::Stop { worker: 4, conn: None, .. }), "{cmds:?}");
        assert!(matches!(&cmds[1], Command::Stop { worker: 3, conn: Some(103), .. }), "{cmds:?}");
        assert!(
            matches!(&cmds[2], Command::Note { text, .. } if text == "warm spare(s) 3, 4 stopped: fewer warm spares wanted"),
            "{cmds:?}"
        );
        assert_eq!((m.spares(), m.spares_ready(), m.spares_wanted()), (1, 1, 1));
        // The stopped ones going is no loss: nothing is started for them.
        m.handle(t, MemberEvent::Closed { conn: 103, why: "stopped".into() });
        m.handle(t, MemberEvent::Exited { worker: 4, status: "signal: 15".into() });
        assert!(spawned(&drain(&mut m)).is_empty());
        assert!(m.set_spares(t, 0));
        assert_eq!(stops(&drain(&mut m)), vec![2]);
        assert_eq!((m.spares(), m.world()), (0, 1));
        // A growth now starts a worker: none is there to take.
        m.apply_decision(t, &[Action::ScaleOut(1)]);
        assert_eq!(spawned(&drain(&mut m)), vec![5]);
        assert_eq!(m.spare_counts().started_cold, 1);
    }

    #[test]
    fn what_the_spares_were_used_for_is_counted() {
        let t = Instant::now();
        let mut m = formed(2, 2, 6, t);
        m.set_spares(t, 1);
        drain(&mut m);
        let later = t + Duration::from_secs(3);
        ready(&mut m, later, 3);
        // A growth by two: one from the spare, one started cold.
        m.apply_decision(later, &[Action::ScaleOut(2)]);
        drain(&mut m);
        m.boundary(true, false);
        // A member lost: the spare started behind, still starting, takes
        // its place (it joins once ready).
        m.fail(later, &BTreeSet::from([1]));
        drain(&mut m);
        let c = m.spare_counts();
        assert_eq!((c.from_spares, c.started_cold, c.members_lost), (2, 1, 1), "{c:?}");
        // The formed members became ready at once, spare 3 after 3 s.
        assert_eq!((c.readied, c.ready_time), (3, Duration::from_secs(3)));
    }

    #[test]
    fn once_spares_were_given_up_a_policy_cannot_start_them_again() {
        let t = Instant::now();
        let mut m = formed(1, 1, 4, t);
        m.set_spares(t, 1);
        for _ in 0..SPARE_TRIES {
            let id = *spawned(&drain(&mut m)).last().unwrap();
            m.handle(t, MemberEvent::Exited { worker: id, status: "exit status: 1".into() });
        }
        drain(&mut m);
        assert!(m.spares_gave_up());
        assert!(!m.set_spares(t, 1));
        assert!(spawned(&drain(&mut m)).is_empty());
        assert!(m.set_spares(t, 0), "asking for none is no start");
        // Spares the scaler refuses, three in a row, likewise: no more
        // are started at the job's next changes.
        let mut m = formed(1, 1, 4, t);
        m.set_spares(t, 1);
        for _ in 0..SPARE_TRIES {
            let id = *spawned(&drain(&mut m)).last().unwrap();
            m.spawn_failed(id, "no slot".into());
            m.apply_decision(t, &[Action::Hold]);
        }
        let cmds = drain(&mut m);
        assert!(spawned(&cmds).is_empty(), "{cmds:?}");
        assert!(
            cmds.iter().any(|c| matches!(c, Command::Note { text, .. } if text.contains("keeps no spares")))
        );
        assert!(m.spares_gave_up() && !m.set_spares(t, 2));
    }

    #[test]
    fn a_sole_member_told_to_go_hands_its_state_to_a_ready_spare() {
        let t = Instant::now();
        let mut m = formed(1, 1, 3, t);
        m.set_spares(t, 1);
        assert_eq!(spawned(&drain(&mut m)), vec![2]);
        ready(&mut m, t, 2);
        assert!(
            matches!(m.leave(t, 1, "spot notice"), Some(Leave::AfterHandover(s)) if s.contains("worker 2"))
        );
        assert_eq!(spawned(&drain(&mut m)), vec![3], "no worker started for it, a spare behind");
        // The spare joins beside it, takes the state, and it leaves.
        assert!(m.boundary(true, false).changed);
        assert_eq!(m.members().iter().map(|w| w.id).collect::<Vec<_>>(), vec![1, 2]);
        m.boundary(true, false);
        assert_eq!(stops(&drain(&mut m)), vec![1]);
        assert_eq!(m.members().iter().map(|w| w.id).collect::<Vec<_>>(), vec![2]);
        let c = m.spare_counts();
        assert_eq!((c.from_spares, c.started_cold, c.members_lost), (1, 0, 1), "{c:?}");
    }

    #[test]
    fn a_member_leaving_with_notice_is_replaced_by_a_ready_spare() {
        let t = Instant::now();
        let mut m = formed(2, 1, 4, t);
        m.set_spares(t, 1);
        drain(&mut m);
        ready(&mut m, t, 3);
        assert!(matches!(m.leave(t, 2, "spot notice"), Some(Leave::Now(_))));
        let cmds = drain(&mut m);
        assert_eq!(stops(&cmds), vec![2]);
        assert_eq!(spawned(&cmds), vec![4], "a spare behind the one taken");
        m.boundary(true, false);
        assert_eq!(m.members().iter().map(|w| w.id).collect::<Vec<_>>(), vec![1, 3]);
    }

    #[test]
    fn a_worker_that_dies_while_starting_is_named_with_its_log() {
        let t = Instant::now();
        let mut m = Membership::new(1, 4, JOIN, 1);
        m.spawn(t, 2);
        m.handle(t, MemberEvent::Exited { worker: 1, status: "exit status: 1".into() });
        m.handle(t, MemberEvent::Hello { conn: 4, worker: 2, pid: 2 });
        m.handle(t, MemberEvent::Closed { conn: 4, why: "eof".into() });
        let notes: Vec<(String, Option<WorkerId>)> = drain(&mut m)
            .into_iter()
            .filter_map(|c| if let Command::Note { text, log_of } = c { Some((text, log_of)) } else { None })
            .collect();
        assert!(notes[0].0.contains("worker 1 exited before joining") && notes[0].1 == Some(1));
        assert!(notes[1].0.contains("worker 2 failed while starting") && notes[1].1 == Some(2));
        assert!(m.nothing_loading());
    }
}
