//! The job's record in the store, kept by a thread of its own so that the
//! store is never on a step's path: a Redis outage slows nothing, and the
//! writes catch up when it is back.
//!
//! The coordinator hands over the latest [`JobState`] (only the newest one
//! queued is written), worker leases and removals. The job state is written
//! with compare-and-set on the token the coordinator read at start: a write
//! that finds another writer's token means a second coordinator took the
//! job, and this one is *fenced*: [`StoreKeeper::fenced`] says so and the
//! coordinator stops instead of overwriting. A key that vanished (the store
//! restarted without persistence) is written afresh.
//!
//! The keeper also renews the coordinator's lease on the job
//! ([`take_lease`]): while it lives, a second coordinator of the same job
//! on any host that shares the store is refused, naming the holder; a
//! coordinator whose lease was taken is fenced.

use crate::clock::{BootInstant, WallWatch};
use crate::leader::record::JobState;
use crate::leader::seal::RecordKey;
use crate::store::{AnyStore, Cas, Store, StoreError, redact};
use std::{
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};
use tokio::sync::{mpsc, oneshot};

/// Why a coordinator may no longer act on its job: another coordinator
/// holds it, or may hold it by now.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum Fenced {
    /// The store's lease names another coordinator.
    #[error("fenced: another coordinator took the job's lease; stopping instead of running it twice")]
    LeaseTaken,
    /// The lease could not be renewed for its whole term (`cause`: why the
    /// last renewal failed), so it may have lapsed and been taken.
    #[error(
        "fenced: the job's lease could not be renewed for {secs:.1} s, its whole term ({cause}); another \
         coordinator may hold it now, so this one stops"
    )]
    NotRenewed { secs: f64, cause: String },
    /// A state was due to be written after the lease's term was over by
    /// this process's clock (it was frozen, or cut off).
    #[error(
        "fenced: the job's lease was last confirmed {secs:.1} s ago, longer than its term; another coordinator \
         may hold it now, so this one stops"
    )]
    Lapsed { secs: f64 },
    /// The job's state holds another coordinator's write (tokens of the
    /// key: `theirs` found, `mine` expected).
    #[error(
        "fenced: another coordinator wrote the job's state (token {}, this coordinator's {}); stopping instead \
         of overwriting it",
        shown(.theirs),
        shown(.mine)
    )]
    StateWritten { theirs: Option<u64>, mine: Option<u64> },
}

fn shown(token: &Option<u64>) -> String {
    token.map_or("none".into(), |t| t.to_string())
}

/// Why [`StoreKeeper::flush`] could not tell that everything queued was tried.
#[derive(Debug, thiserror::Error)]
pub enum FlushError {
    #[error("the store keeper stopped")]
    Stopped,
    #[error("the store did not take the job's state within {0:?}")]
    TimedOut(Duration),
}

/// Why a renewal of the lease failed.
#[derive(Debug, thiserror::Error)]
enum RenewError {
    #[error(transparent)]
    Fenced(#[from] Fenced),
    #[error("no answer within {0:?}")]
    NoAnswer(Duration),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Why a store call bounded in time had no answer.
#[derive(Debug, thiserror::Error)]
enum CallError {
    #[error("the store did not answer in time")]
    NoAnswer,
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Why the job's state was not written.
#[derive(Debug, thiserror::Error)]
enum WriteError {
    #[error(transparent)]
    Fenced(#[from] Fenced),
    #[error("{0}")]
    Encode(#[from] serde_json::Error),
    #[error(transparent)]
    Call(#[from] CallError),
}

/// A refusal of [`take_lease`]: another coordinator holds the job's lease.
#[derive(Debug, thiserror::Error)]
#[error(
    "job {job:?} is already run by another coordinator: {holder} holds its lease in the store (it lapses \
     {ttl:?} after that coordinator stops)"
)]
struct LeaseHeld {
    job: String,
    holder: String,
    ttl: Duration,
    /// The lease's token as found (each renewal writes a new one).
    token: Option<u64>,
}

enum Cmd {
    State(JobState),
    /// Give the coordinator lease up (the job ended).
    Release,
    Lease {
        key: String,
        value: Vec<u8>,
        ttl: Duration,
    },
    Delete(String),
    /// Answered once everything queued before it was tried.
    Flush(oneshot::Sender<()>),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What the keeper's thread tells the coordinator's threads.
#[derive(Clone)]
struct Shared {
    /// Why the coordinator was fenced, once it was.
    fenced: Arc<Mutex<Option<Fenced>>>,
    /// The lease's term: when the store last confirmed it, and for how
    /// long. Read by [`LeaseFence::fenced`] on the coordinator's own clock,
    /// so a lease that lapsed fences it whatever the keeper's thread is
    /// waiting on.
    term: Arc<Mutex<Option<(BootInstant, Duration)>>>,
    /// The committed step of the newest job state the store took (0: none yet).
    stored: Arc<AtomicU64>,
    /// What happened to the store that the job went on through (a
    /// replicated store's leader changed), not yet taken.
    events: Arc<Mutex<Vec<String>>>,
}

/// Tells, from any thread, whether a keeper's coordinator still holds its
/// job: not when the store said another took it, nor once the lease has
/// not been confirmed for its whole term by this process's own clock.
#[derive(Clone)]
pub struct LeaseFence {
    fenced: Arc<Mutex<Option<Fenced>>>,
    term: Arc<Mutex<Option<(BootInstant, Duration)>>>,
}

impl LeaseFence {
    /// A fence of a lease the store last confirmed at `confirmed`, for `ttl`.
    pub fn confirmed_at(confirmed: BootInstant, ttl: Duration) -> Self {
        LeaseFence { fenced: Arc::new(Mutex::new(None)), term: Arc::new(Mutex::new(Some((confirmed, ttl)))) }
    }

    /// Why this coordinator may no longer act, if so.
    pub fn fenced(&self) -> Option<Fenced> {
        if let Some(why) = lock(&self.fenced).clone() {
            return Some(why);
        }
        let (confirmed, ttl) = (*lock(&self.term))?;
        (confirmed.elapsed() >= ttl).then(|| Fenced::NotRenewed {
            secs: confirmed.elapsed().as_secs_f64(),
            cause: "the store does not answer".into(),
        })
    }
}

/// Writes the job's state and worker leases in the background.
pub struct StoreKeeper {
    tx: mpsc::UnboundedSender<Cmd>,
    shared: Shared,
}

impl StoreKeeper {
    /// Starts the keeper of `key` in the store at `url`; `token` is the
    /// state's token as read at start (None: the job has no state yet).
    /// The state is sealed with `seal` (see [`crate::leader::seal`]).
    pub fn start(
        url: &str,
        key: String,
        token: Option<u64>,
        lease: Option<JobLease>,
        seal: RecordKey,
    ) -> anyhow::Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let store = {
            let _g = rt.enter();
            AnyStore::open(url)?
        };
        Self::start_on(rt, store, redact(url), key, token, lease, seal)
    }

    /// [`StoreKeeper::start`] on an open `store` (`shown` as logs name it),
    /// whose calls `rt` runs.
    fn start_on(
        rt: tokio::runtime::Runtime,
        store: AnyStore,
        shown: String,
        key: String,
        token: Option<u64>,
        lease: Option<JobLease>,
        seal: RecordKey,
    ) -> anyhow::Result<Self> {
        let (tx, rx) = mpsc::unbounded_channel::<Cmd>();
        let shared = Shared {
            fenced: Arc::new(Mutex::new(None)),
            term: Arc::new(Mutex::new(lease.as_ref().map(|l| (l.confirmed, l.ttl)))),
            stored: Arc::new(AtomicU64::new(0)),
            events: Arc::new(Mutex::new(Vec::new())),
        };
        let keeper = Keeper {
            store,
            key,
            shown,
            token,
            lost: Vec::new(),
            renew_every: lease.as_ref().map_or(Duration::from_secs(3600), |l| l.ttl / 3),
            retry_every: lease
                .as_ref()
                .map_or(Duration::from_secs(1), |l| crate::store::lease_retry_every(l.ttl)),
            lease,
            leader: None,
            seal,
            wall: WallWatch::new(),
            shared: shared.clone(),
        };
        std::thread::Builder::new()
            .name("edl-store-keeper".into())
            .spawn(move || rt.block_on(keeper.run(rx)))?;
        Ok(StoreKeeper { tx, shared })
    }

    /// Queues the newest job state.
    pub fn state(&self, s: JobState) {
        let _ = self.tx.send(Cmd::State(s));
    }

    /// What happened to the store since the last call (its leader changed).
    pub fn store_events(&self) -> Vec<String> {
        std::mem::take(&mut *lock(&self.shared.events))
    }

    /// The committed step of the newest job state the store took.
    pub fn stored_step(&self) -> u64 {
        self.shared.stored.load(Ordering::Acquire)
    }

    /// Gives the coordinator lease up (queued after everything before it).
    pub fn release(&self) {
        let _ = self.tx.send(Cmd::Release);
    }

    /// Queues a lease write.
    pub fn lease(&self, key: String, value: Vec<u8>, ttl: Duration) {
        let _ = self.tx.send(Cmd::Lease { key, value, ttl });
    }

    /// Queues a removal.
    pub fn delete(&self, key: String) {
        let _ = self.tx.send(Cmd::Delete(key));
    }

    /// Why this coordinator may no longer write the job's state, if so.
    pub fn fenced(&self) -> Option<Fenced> {
        self.fence().fenced()
    }

    /// The same answer, for other threads of this coordinator.
    pub fn fence(&self) -> LeaseFence {
        LeaseFence { fenced: self.shared.fenced.clone(), term: self.shared.term.clone() }
    }

    /// Waits (at most `within`) until everything queued so far was tried.
    pub fn flush(&self, within: Duration) -> Result<(), FlushError> {
        let (tx, mut rx) = oneshot::channel();
        self.tx.send(Cmd::Flush(tx)).map_err(|_| FlushError::Stopped)?;
        let deadline = Instant::now() + within;
        loop {
            match rx.try_recv() {
                Ok(()) => return Ok(()),
                Err(oneshot::error::TryRecvError::Closed) => return Err(FlushError::Stopped),
                Err(oneshot::error::TryRecvError::Empty) if Instant::now() >= deadline => {
                    return Err(FlushError::TimedOut(within));
                }
                Err(oneshot::error::TryRecvError::Empty) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }
}

/// The keeper's thread: the store, the lease it renews and what it knows
/// of the job's state in the store.
struct Keeper {
    store: AnyStore,
    key: String,
    /// The store's address as logs show it (without a password).
    shown: String,
    /// The state's token as this keeper last wrote or read it.
    token: Option<u64>,
    /// The bytes of the last state write whose answer never came.
    lost: Vec<Vec<u8>>,
    lease: Option<JobLease>,
    renew_every: Duration,
    /// After a renewal that failed, the next comes this soon.
    retry_every: Duration,
    /// The replicated store's leader, asked after each renewal.
    leader: Option<String>,
    /// What seals the job's state.
    seal: RecordKey,
    shared: Shared,
    /// Steps of the wall clock, said at the renewal that sees them.
    wall: WallWatch,
}

impl Keeper {
    /// Serves commands and renews the lease until the [`StoreKeeper`] is dropped.
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Cmd>) {
        let mut renew = tokio::time::interval(self.renew_every);
        renew.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                c = rx.recv() => match c {
                    Some(first) => self.commands(first, &mut rx).await,
                    None => break,
                },
                _ = renew.tick() => {
                    if !self.renew().await {
                        // Tried again soon, not a third of the term later:
                        // a replicated store electing a leader answers
                        // again within a second or two, and the lease is
                        // this coordinator's only while it is confirmed.
                        renew.reset_after(self.retry_every);
                    }
                }
            }
        }
    }

    /// Carries out `first` and the commands queued behind it. Of the
    /// states queued, only the newest is written.
    async fn commands(&mut self, first: Cmd, rx: &mut mpsc::UnboundedReceiver<Cmd>) {
        let mut cmds = vec![first];
        while let Ok(c) = rx.try_recv() {
            cmds.push(c);
        }
        let last_state = cmds.iter().rposition(|c| matches!(c, Cmd::State(_)));
        for (i, cmd) in cmds.into_iter().enumerate() {
            match cmd {
                Cmd::State(s) if Some(i) == last_state => self.write(&s).await,
                Cmd::State(_) => {}
                Cmd::Release => self.release().await,
                Cmd::Lease { key, value, ttl } => {
                    if let Err(e) = self.store.put(&key, &value, Some(ttl)).await {
                        tracing::warn!("store {}: lease {key}: {e}", self.shown);
                    }
                }
                Cmd::Delete(key) => {
                    if let Err(e) = self.store.delete(&key).await {
                        tracing::warn!("store {}: removing {key}: {e}", self.shown);
                    }
                }
                Cmd::Flush(done) => {
                    // The state written, one more look at the store's
                    // leader: a change during the last renewal period is
                    // news too, given longer to answer than a renewal's
                    // look (a member may still be electing a leader).
                    self.ask_leader(self.renew_every * 2).await;
                    let _ = done.send(());
                }
            }
        }
    }

    fn fence(&self, why: Fenced) {
        *lock(&self.shared.fenced) = Some(why);
    }

    /// Renews the lease. Self-fencing: a lease this coordinator cannot
    /// renew may have lapsed and been taken; it stops acting once the lease
    /// is over by its own clock, whether or not the store answers.
    /// Whether the lease is confirmed (or there is none to renew).
    async fn renew(&mut self) -> bool {
        if let Some(step) = self.wall.look() {
            tracing::warn!(
                "the wall clock stepped {step:+.0} s; the job's lease and timers count on the boot clock and are not moved"
            );
        }
        let Some(l) = self.lease.as_mut() else { return true };
        match l.renew(&self.store).await {
            Ok(()) => {
                *lock(&self.shared.term) = Some((l.confirmed, l.ttl));
                self.ask_leader(self.renew_every / 2).await;
                true
            }
            Err(e) => {
                let why = match &e {
                    RenewError::Fenced(f) => Some(f.clone()),
                    _ if l.confirmed.elapsed() >= l.ttl => Some(Fenced::NotRenewed {
                        secs: l.confirmed.elapsed().as_secs_f64(),
                        cause: e.to_string(),
                    }),
                    _ => None,
                };
                // Fenced: there is no lease to renew from here on.
                let fenced = why.is_some();
                if let Some(why) = why {
                    self.fence(why);
                    self.lease = None;
                }
                tracing::warn!("store {}: coordinator lease: {e}", self.shown);
                fenced
            }
        }
    }

    /// Notes a change of the replicated store's leader, as an event; a
    /// store that does not answer `within` leaves what is known as it is.
    async fn ask_leader(&mut self, within: Duration) {
        let now = tokio::time::timeout(within, self.store.leader()).await.ok().flatten();
        if let (Some(was), Some(is)) = (&self.leader, &now)
            && was != is
        {
            lock(&self.shared.events).push(format!("the store's leader changed from {was} to {is}"));
        }
        self.leader = now.or(self.leader.take());
    }

    /// Writes the job's state, unless this coordinator was fenced meanwhile.
    async fn write(&mut self, s: &JobState) {
        // A coordinator whose lease is over by its own clock (it was
        // frozen, or cut off) writes nothing: another may hold the job now.
        if let Some(l) = self.lease.as_ref().filter(|l| l.confirmed.elapsed() >= l.ttl) {
            self.fence(Fenced::Lapsed { secs: l.confirmed.elapsed().as_secs_f64() });
            return;
        }
        // Bounded by a third of the lease, as its renewals are.
        let bound = self.lease.as_ref().map_or(Duration::from_secs(10), |l| l.ttl / 3);
        let mine = self.lease.as_ref().map(|l| l.token.max(l.fence.unwrap_or(0)));
        let (store, seal) = (&self.store, &self.seal);
        match write_state(store, seal, &self.key, &mut self.token, &mut self.lost, s, bound, mine).await {
            Ok(()) => self.shared.stored.store(s.committed_steps, Ordering::Release),
            Err(e) => {
                if let WriteError::Fenced(why) = &e {
                    self.fence(why.clone());
                }
                tracing::warn!("store {}: job state: {e}", self.shown);
            }
        }
    }

    /// Gives the lease up: the coordinator no longer holds the job.
    async fn release(&mut self) {
        *lock(&self.shared.term) = None;
        if let Some(l) = self.lease.take() {
            l.release(&self.store).await;
        }
    }
}

/// Writes the job's state if the key still holds this coordinator's last
/// write (`token`), all its store calls together bounded by `bound` (a
/// third of the lease: a write stuck in a replicated store's election must
/// not hold up the lease's renewal). A conflict is not another
/// coordinator's doing when the key holds
/// - a state that names this coordinator's lease token (`mine`) as its
///   leader: its own write whose answer never came (a timeout, a leader
///   lost mid-call), which the store applied;
/// - a state a coordinator with a lower lease token wrote: a deposed one's
///   late write, landed after this one took the job over;
/// - the bytes of a write whose answer never came since the last one
///   confirmed (`lost`: one timed out, the next ones too while the store
///   elected a leader, and the first was applied), for a state that names
///   no leader.
#[allow(clippy::too_many_arguments)]
async fn write_state(
    store: &AnyStore,
    seal: &RecordKey,
    key: &str,
    token: &mut Option<u64>,
    lost: &mut Vec<Vec<u8>>,
    s: &JobState,
    bound: Duration,
    mine: Option<u64>,
) -> Result<(), WriteError> {
    let value = seal.seal(key, &serde_json::to_vec(s)?);
    let until = tokio::time::Instant::now() + bound;
    let mut overwritten = false;
    loop {
        let answer = match within(until, store.compare_and_set(key, *token, &value, None)).await {
            Ok(a) => a,
            Err(e) => {
                if lost.len() >= MAX_LOST {
                    lost.remove(0);
                }
                lost.push(value);
                return Err(e.into());
            }
        };
        let theirs = match answer {
            Cas::Written(t) => {
                *token = Some(t);
                lost.clear();
                return Ok(());
            }
            // The key is gone (a store restarted without persistence): write it afresh.
            Cas::Conflict { current: None } if token.is_some() && !overwritten => None,
            Cas::Conflict { current } if overwritten => {
                return Err(Fenced::StateWritten { theirs: current, mine: *token }.into());
            }
            Cas::Conflict { current: None } => {
                return Err(Fenced::StateWritten { theirs: None, mine: *token }.into());
            }
            Cas::Conflict { current: Some(theirs) } => {
                let held = within(until, store.get(key)).await?.filter(|e| e.token == theirs);
                let opened = held.as_ref().map(|e| seal.open(key, &e.value));
                let led = opened.as_ref().and_then(|o| o.as_ref().ok()).and_then(|v| leader_token(v));
                let ours = led.zip(mine).is_some_and(|(t, m)| t == m)
                    || held.as_ref().is_some_and(|e| lost.iter().any(|sent| &e.value == sent));
                let deposed = led.zip(mine).is_some_and(|(t, m)| t < m);
                // Written without the job's secret: no coordinator's.
                let forged = opened.as_ref().and_then(|o| o.as_ref().err());
                if !(ours || deposed || forged.is_some()) {
                    return Err(Fenced::StateWritten { theirs: Some(theirs), mine: *token }.into());
                }
                if let Some(why) = forged {
                    tracing::warn!("the job's state: {why}; it is overwritten");
                } else if deposed {
                    tracing::warn!(
                        "the job's state held a deposed coordinator's late write; it is overwritten"
                    );
                }
                Some(theirs)
            }
        };
        lost.clear();
        *token = theirs;
        overwritten = true;
    }
}

/// Unconfirmed state writes remembered (a store that answers none of them
/// for longer fences the coordinator by its lease first).
const MAX_LOST: usize = 16;

/// The lease token of the coordinator (or torchrun launcher) that wrote a
/// job state, where the state names it.
fn leader_token(value: &[u8]) -> Option<u64> {
    let s: JobState = serde_json::from_slice(value).ok()?;
    s.handover.map(|h| h.leader.token).or(s.torchrun.map(|g| g.leader.token))
}

/// A store call that must answer by `until`: an error means its answer
/// was not had.
async fn within<T>(
    until: tokio::time::Instant,
    call: impl std::future::Future<Output = Result<T, crate::store::StoreError>>,
) -> Result<T, CallError> {
    Ok(tokio::time::timeout_at(until, call).await.map_err(|_| CallError::NoAnswer)??)
}

/// The coordinator's lease on its job in the store.
pub struct JobLease {
    key: String,
    value: Vec<u8>,
    token: u64,
    ttl: Duration,
    /// When the store last confirmed the lease (the request that it
    /// answered was sent then): the lease holds until `ttl` after it, and
    /// not a moment longer as far as this coordinator can know.
    confirmed: BootInstant,
    /// What seals the lease's record (and opens the one found in its place).
    seal: RecordKey,
    /// The fencing token, where it is not the lease's first token: the
    /// store's sequence started again (it lost its data) below the tokens
    /// the job was fenced with (see [`JobLease::fence_above`]).
    fence: Option<u64>,
}

/// The coordinator's identity as the lease shows it: enough to tell, from
/// the same machine, whether that very process is still running.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct Holder {
    host: String,
    pid: u32,
    /// The kernel's boot id (`/proc/sys/kernel/random/boot_id`): the same
    /// machine, since its last boot. Absent in leases of older versions.
    #[serde(default)]
    boot: Option<String>,
    /// The pid namespace (`/proc/self/ns/pid`): the same container, where
    /// pids mean the same processes.
    #[serde(default)]
    pid_ns: Option<String>,
    /// The process's start time (clock ticks since boot): a pid reused by
    /// another process has another.
    #[serde(default)]
    started: Option<u64>,
}

impl Holder {
    fn me() -> Holder {
        let pid = std::process::id();
        Holder {
            host: std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default().trim().to_string(),
            pid,
            boot: boot_id(),
            pid_ns: pid_namespace(),
            started: start_time(pid),
        }
    }

    /// Whether this holder is proven gone, as seen from `me`: the same
    /// machine and pid namespace, and its process no longer running (its pid
    /// free, or taken by a process that started at another time). Anything
    /// less (another host, another container, a lease without the proof) is
    /// no proof: the lease is waited out.
    fn proven_dead(&self, me: &Holder) -> bool {
        let same_place =
            self.boot.is_some() && self.boot == me.boot && self.pid_ns.is_some() && self.pid_ns == me.pid_ns;
        // A start time that cannot be read (another user's process under
        // hidepid) proves nothing.
        let reused = matches!(start_time(self.pid), Some(t) if Some(t) != self.started);
        same_place && (!alive(self.pid) || reused)
    }
}

fn boot_id() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok().map(|s| s.trim().to_string())
}

fn pid_namespace() -> Option<String> {
    std::fs::read_link("/proc/self/ns/pid").ok().map(|p| p.to_string_lossy().into_owned())
}

/// Field 22 of `/proc/<pid>/stat`: when the process started, in clock ticks since boot.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces.
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(19)?.parse().ok()
}

/// Takes the job's coordinator lease (`ttl`, renewed by the keeper), or
/// says who holds it; a `standby` waits until the lease is free (its holder
/// gone: the lease lapsed, or proven dead on this machine).
pub async fn take_lease(
    store: &AnyStore,
    job: &str,
    ttl: Duration,
    standby: bool,
    seal: &RecordKey,
) -> anyhow::Result<JobLease> {
    let mut said = false;
    let mut unreachable: Option<Duration> = None;
    let mut said_unreachable: Option<std::time::Instant> = None;
    // The lease's token a standby last saw, and when it first saw it: its
    // holder renewed it no earlier.
    let mut renewed: Option<(Option<u64>, std::time::Instant)> = None;
    loop {
        if renewed.is_some_and(|(_, t)| t.elapsed() < ttl) && !lease_there(store, job).await {
            // Gone (or the store not answering) within a term of a renewal:
            // the store lost it (restarted without its data), not its
            // holder, who takes it again at its next renewal. It is taken
            // once a whole term has passed.
            tokio::time::sleep((ttl / 10).clamp(Duration::from_millis(100), Duration::from_secs(1))).await;
            continue;
        }
        match try_take_lease(store, job, ttl, seal).await {
            // A standby rides out a store that is away (restarting, cut
            // off): it tries again, backing off up to a lease's length.
            Err(e) if standby && e.is::<crate::store::StoreError>() => {
                if let Some(signal) = crate::process::stop_requested() {
                    let what = "the standby had not taken the job over".to_string();
                    return Err(crate::process::StopSignalled { signal, what }.into());
                }
                let wait = unreachable.map_or(Duration::from_millis(100), |w| (w * 2).min(ttl));
                // Said at once, and again every minute while it lasts (a
                // wrong certificate or password never passes).
                if said_unreachable.is_none_or(|t: std::time::Instant| t.elapsed() >= Duration::from_secs(60))
                {
                    println!("standby   {e:#}; trying again until the store answers");
                    said_unreachable = Some(std::time::Instant::now());
                }
                unreachable = Some(wait);
                tokio::time::sleep(wait).await;
            }
            Err(e) if standby && e.is::<LeaseHeld>() => {
                // A lease seen anew (a renewal) restarts the wait; one that
                // lapsed between the write and the read (no token) does not.
                let token = e.downcast_ref::<LeaseHeld>().and_then(|h| h.token);
                if token.is_some() && renewed.is_none_or(|(seen, _)| seen != token) {
                    renewed = Some((token, std::time::Instant::now()));
                }
                if unreachable.take().is_some() {
                    said_unreachable = None;
                    println!("standby   the store answers again");
                }
                if let Some(signal) = crate::process::stop_requested() {
                    let what = "the standby had not taken the job over".to_string();
                    return Err(crate::process::StopSignalled { signal, what }.into());
                }
                if !said {
                    println!("standby   {e:#}; waiting to take the job over when that lease lapses");
                    said = true;
                }
                tokio::time::sleep((ttl / 10).clamp(Duration::from_millis(100), Duration::from_secs(1)))
                    .await;
            }
            other => return other,
        }
    }
}

/// Whether the store answers that the job's lease is there.
async fn lease_there(store: &AnyStore, job: &str) -> bool {
    matches!(store.get(&crate::store::keys::coordinator(job)).await, Ok(Some(_)))
}

/// One attempt at [`take_lease`].
async fn try_take_lease(
    store: &AnyStore,
    job: &str,
    ttl: Duration,
    seal: &RecordKey,
) -> anyhow::Result<JobLease> {
    let key = crate::store::keys::coordinator(job);
    let me = Holder::me();
    let value = seal.seal(&key, &serde_json::to_vec(&me)?);
    let asked = BootInstant::now();
    let lease = |token| JobLease {
        key: key.clone(),
        value: value.clone(),
        token,
        ttl,
        confirmed: asked,
        fence: None,
        seal: seal.clone(),
    };
    match store.compare_and_set(&key, None, &value, Some(ttl)).await? {
        Cas::Written(token) => Ok(lease(token)),
        Cas::Conflict { .. } => {
            let entry = store.get(&key).await?;
            let opened = entry.as_ref().map(|e| seal.open(&key, &e.value));
            let found = opened
                .as_ref()
                .and_then(|o| o.as_ref().ok())
                .and_then(|v| serde_json::from_slice::<Holder>(v).ok());
            // This very process's write, applied though its answer was lost.
            if let (Some(e), Some(h)) = (&entry, &found)
                && *h == me
            {
                return Ok(lease(e.token));
            }
            // A coordinator of this machine and container that died (kill
            // -9, a crash): its lease is stale, and a restart takes it over
            // at once. A record that does not verify is held until it
            // expires: it may be a coordinator's with another secret.
            if let Some(e) = &entry
                && found.as_ref().is_some_and(|h| h.proven_dead(&me))
                && let Cas::Written(token) =
                    store.compare_and_set(&key, Some(e.token), &value, Some(ttl)).await?
            {
                return Ok(lease(token));
            }
            let holder = match (&entry, found) {
                (_, Some(h)) => format!("pid {} on {}", h.pid, h.host),
                (Some(_), None) if opened.as_ref().is_some_and(|o| o.is_err()) => {
                    "a holder whose record does not verify (a coordinator with another --secret-file, or a record \
                     not written by edl)"
                        .into()
                }
                (Some(_), None) => "an unreadable holder".into(),
                (None, _) => "a coordinator whose lease just ended (try again)".into(),
            };
            Err(LeaseHeld { job: job.into(), holder, ttl, token: entry.map(|e| e.token) }.into())
        }
    }
}

impl JobLease {
    /// The fencing token: the token the lease was taken with, higher than
    /// any its earlier holders had (the store's tokens come from one
    /// sequence), or above the job's fence where the store lost its data.
    pub fn token(&self) -> u64 {
        self.fence.unwrap_or(self.token)
    }

    /// Makes the fencing token higher than `floor` (the highest token the
    /// job's checkpoints were fenced with), where the store's is not: a
    /// store restarted without its data starts its sequence again. Returns
    /// whether it had to.
    pub fn fence_above(&mut self, floor: u64) -> bool {
        let below = self.token() <= floor;
        if below {
            self.fence = Some(floor + 1);
        }
        below
    }

    /// Extends the lease, if it is still this coordinator's.
    async fn renew(&mut self, store: &AnyStore) -> Result<(), RenewError> {
        let asked = BootInstant::now();
        // An answer later than a third of the lease is no use: by then the
        // next renewal is due.
        let within = (self.ttl / 3).clamp(Duration::from_millis(100), Duration::from_secs(10));
        let answer = tokio::time::timeout(
            within,
            store.compare_and_set(&self.key, Some(self.token), &self.value, Some(self.ttl)),
        )
        .await
        .map_err(|_| RenewError::NoAnswer(within))??;
        match answer {
            Cas::Written(t) => {
                self.token = t;
                self.confirmed = asked;
                Ok(())
            }
            // Gone while, by this coordinator's clock, it still held (the
            // store restarted empty): take it again if free. Past the lease,
            // another coordinator may have held it meanwhile: fenced.
            Cas::Conflict { current: None } if self.confirmed.elapsed() < self.ttl => {
                self.write_over(store, None, asked).await
            }
            // A renewal of this coordinator's, applied though its answer was
            // lost (a timeout, a leader election): the value is this
            // process's own (its pid and start time make it unique).
            Cas::Conflict { current: Some(t) } => match store.get(&self.key).await {
                // When it was applied is not known (only that it was after
                // the renewal that was not answered was sent): renewed over
                // it, so that the lease is confirmed from now.
                Ok(Some(e)) if e.token == t && e.value == self.value => {
                    self.write_over(store, Some(t), asked).await
                }
                // Written in its place, within this coordinator's term,
                // without the job's secret: no coordinator of this job holds
                // it, and it is written over.
                Ok(Some(e))
                    if e.token == t
                        && self.confirmed.elapsed() < self.ttl
                        && self.seal.open(&self.key, &e.value).is_err() =>
                {
                    tracing::warn!(
                        "the job's lease at {} was overwritten by a record that does not verify; renewed over it",
                        self.key
                    );
                    self.write_over(store, Some(t), asked).await
                }
                _ => Err(Fenced::LeaseTaken.into()),
            },
            Cas::Conflict { .. } => Err(Fenced::LeaseTaken.into()),
        }
    }

    /// Writes the lease again over what the key holds now (`found`: its
    /// token, None: nothing), as asked at `asked`; anything else written
    /// meanwhile is another coordinator's.
    async fn write_over(
        &mut self,
        store: &AnyStore,
        found: Option<u64>,
        asked: BootInstant,
    ) -> Result<(), RenewError> {
        match store.compare_and_set(&self.key, found, &self.value, Some(self.ttl)).await {
            Ok(Cas::Written(t)) => {
                self.token = t;
                self.confirmed = asked;
                Ok(())
            }
            Ok(Cas::Conflict { .. }) => Err(Fenced::LeaseTaken.into()),
            Err(e) => Err(e.into()),
        }
    }

    async fn release(self, store: &AnyStore) {
        let _ = store.delete_if(&self.key, self.token).await;
    }
}

/// Whether process `pid` of this host exists.
fn alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return false };
    if pid <= 0 {
        // 0 and negative ids name process groups, not a process.
        return false;
    }
    // SAFETY: signal 0 sends nothing; it only asks whether `pid` exists.
    let found = unsafe { libc::kill(pid, 0) } == 0;
    found || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

#[cfg(test)]
mod tests {
    use super::*;
    use edl_host_gpu::comm::auth::Secret;

    #[test]
    fn a_lease_is_taken_over_only_on_proof_that_its_holder_is_gone() {
        let me = Holder::me();
        assert!(me.boot.is_some() && me.pid_ns.is_some() && me.started.is_some(), "{me:?}");
        assert!(!me.proven_dead(&me), "a running holder");
        // A holder that exited: its pid is free.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        let exited = Holder { pid: gone, started: Some(1), ..me.clone() };
        assert!(exited.proven_dead(&me));
        // Its pid taken by another process since: another start time.
        let reused = Holder { started: me.started.map(|t| t + 1), ..me.clone() };
        assert!(reused.proven_dead(&me));
        // Another machine of the same name, another container of the same
        // machine, a holder without the proof: waited out, not taken.
        for other in [
            Holder { pid: gone, boot: Some("another boot".into()), ..me.clone() },
            Holder { pid: gone, pid_ns: Some("pid:[1]".into()), ..me.clone() },
            Holder { pid: gone, boot: None, pid_ns: None, started: None, ..me.clone() },
        ] {
            assert!(!other.proven_dead(&me), "{other:?}");
        }
    }

    #[test]
    fn a_dead_coordinator_s_lease_is_taken_at_once_and_a_foreign_one_is_not() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let store = AnyStore::open("memory").unwrap();
            let key = crate::store::keys::coordinator("j");
            let mut child = std::process::Command::new("true").spawn().unwrap();
            let gone = child.id();
            child.wait().unwrap();
            let dead = Holder { pid: gone, ..Holder::me() };
            let ttl = Duration::from_secs(60);
            let seal = RecordKey::job_records(&Secret::generate().unwrap());
            let t = store
                .put(&key, &seal.seal(&key, &serde_json::to_vec(&dead).unwrap()), Some(ttl))
                .await
                .unwrap();
            let lease = take_lease(&store, "j", ttl, false, &seal).await.unwrap();
            assert!(lease.token > t);
            // The same host name and pid, from another machine: refused.
            let foreign = Holder { boot: Some("elsewhere".into()), ..Holder::me() };
            store
                .put(&key, &seal.seal(&key, &serde_json::to_vec(&foreign).unwrap()), Some(ttl))
                .await
                .unwrap();
            let e = take_lease(&store, "j", ttl, false, &seal).await.err().unwrap().to_string();
            assert!(e.contains("already run by another coordinator"), "{e}");
        });
    }

    #[test]
    fn a_renewal_applied_though_its_answer_was_lost_is_taken_for_this_coordinator_s_own() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let store = AnyStore::open("memory").unwrap();
            let ttl = Duration::from_secs(60);
            let seal = RecordKey::job_records(&Secret::generate().unwrap());
            let mut lease = take_lease(&store, "j", ttl, false, &seal).await.unwrap();
            // The store applied a renewal whose answer never came back.
            let Cas::Written(applied) =
                store.compare_and_set(&lease.key, Some(lease.token), &lease.value, Some(ttl)).await.unwrap()
            else {
                panic!("a renewal")
            };
            let answered = lease.confirmed;
            lease.renew(&store).await.unwrap();
            // Taken as this coordinator's, and renewed over (when it was
            // applied is not known): confirmed from this renewal.
            assert!(lease.token > applied, "{} after {applied}", lease.token);
            assert!(lease.confirmed > answered);
            let over = lease.token;
            lease.renew(&store).await.unwrap();
            assert!(lease.token > over, "and renewed from it on");
            // Another holder's write is not taken for this one's.
            let other =
                seal.seal(&lease.key, &serde_json::to_vec(&Holder { pid: 1, ..Holder::me() }).unwrap());
            store.compare_and_set(&lease.key, Some(lease.token), &other, Some(ttl)).await.unwrap();
            assert!(matches!(lease.renew(&store).await, Err(RenewError::Fenced(Fenced::LeaseTaken))));
        });
    }

    const BOUND: Duration = Duration::from_secs(10);

    #[test]
    fn a_deposed_coordinator_s_late_write_is_overwritten_and_a_newer_one_s_fences() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let store = AnyStore::open("memory").unwrap();
            let seal = RecordKey::job_records(&Secret::generate().unwrap());
            let led_by = |token| JobState {
                torchrun: Some(crate::leader::record::GroupHandover {
                    group: 0,
                    agents: vec![1],
                    hosts: vec!["10.0.0.3".into()],
                    master_addr: "10.0.0.3".into(),
                    master_port: 29500,
                    nproc: 1,
                    restart_count: 0,
                    leader: crate::job::spec::Leader { addr: "10.0.0.2:7070".into(), token },
                    handles: Default::default(),
                }),
                ..Default::default()
            };
            // This one (lease token 5) read the state at `token`; then the
            // coordinator it took over from (token 3) landed a late write.
            let (mut token, mut lost) = (None, Vec::new());
            write_state(&store, &seal, "s", &mut token, &mut lost, &led_by(3), BOUND, Some(3)).await.unwrap();
            let read = token;
            store
                .compare_and_set("s", read, &seal.seal("s", &serde_json::to_vec(&led_by(3)).unwrap()), None)
                .await
                .unwrap();
            write_state(&store, &seal, "s", &mut token, &mut lost, &led_by(5), BOUND, Some(5)).await.unwrap();
            let held = store.get("s").await.unwrap().unwrap();
            assert_eq!(leader_token(seal.open("s", &held.value).unwrap()), Some(5));
            // Two writes of this one's lost their answers, and the store
            // applied the first: the key names this one, so it is its own.
            let first = JobState { committed_steps: 1, ..led_by(5) };
            store
                .compare_and_set("s", token, &seal.seal("s", &serde_json::to_vec(&first).unwrap()), None)
                .await
                .unwrap();
            lost = vec![
                seal.seal("s", &serde_json::to_vec(&JobState { committed_steps: 2, ..led_by(5) }).unwrap()),
            ];
            write_state(&store, &seal, "s", &mut token, &mut lost, &led_by(5), BOUND, Some(5)).await.unwrap();
            // A coordinator with a higher token than this one's wrote: fenced.
            store
                .compare_and_set("s", token, &seal.seal("s", &serde_json::to_vec(&led_by(8)).unwrap()), None)
                .await
                .unwrap();
            let err = write_state(&store, &seal, "s", &mut token, &mut lost, &led_by(5), BOUND, Some(5))
                .await
                .unwrap_err();
            assert!(matches!(err, WriteError::Fenced(Fenced::StateWritten { .. })), "{err}");
        });
    }

    #[test]
    fn a_state_write_applied_though_its_answer_was_lost_is_taken_for_this_coordinator_s_own() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let store = AnyStore::open("memory").unwrap();
            let seal = RecordKey::job_records(&Secret::generate().unwrap());
            let state = |step| JobState { committed_steps: step, members: vec![1, 2], ..Default::default() };
            let (mut token, mut lost) = (None, Vec::new());
            write_state(&store, &seal, "s", &mut token, &mut lost, &state(1), BOUND, None).await.unwrap();
            // The write of step 2 reached the store, but its answer was lost
            // (an etcd leader killed mid-call): the keeper only knows the bytes.
            // The next write timed out too, unapplied (the store was
            // electing a leader): the applied one is still known as its own.
            let bytes = seal.seal("s", &serde_json::to_vec(&state(2)).unwrap());
            store.compare_and_set("s", token, &bytes, None).await.unwrap();
            lost = vec![bytes, seal.seal("s", &serde_json::to_vec(&state(3)).unwrap())];
            write_state(&store, &seal, "s", &mut token, &mut lost, &state(3), BOUND, None).await.unwrap();
            let e = store.get("s").await.unwrap().unwrap();
            assert_eq!(Some(e.token), token);
            assert_eq!(
                serde_json::from_slice::<JobState>(seal.open("s", &e.value).unwrap())
                    .unwrap()
                    .committed_steps,
                3
            );
            // Another coordinator's write is never taken for this one's,
            // even with a lost write outstanding.
            store
                .compare_and_set("s", token, &seal.seal("s", &serde_json::to_vec(&state(9)).unwrap()), None)
                .await
                .unwrap();
            lost = vec![seal.seal("s", &serde_json::to_vec(&state(4)).unwrap())];
            let err = write_state(&store, &seal, "s", &mut token, &mut lost, &state(5), BOUND, None)
                .await
                .unwrap_err();
            assert!(matches!(err, WriteError::Fenced(Fenced::StateWritten { .. })), "{err}");
        });
    }

    #[test]
    fn a_renewal_that_failed_or_lost_its_answer_is_tried_again_soon_and_a_store_away_for_less_than_the_term_does_not_fence()
     {
        // A lease of 30 s is renewed every 10 s. The store fails the first
        // three renewals (as an etcd cluster electing a leader, or a Redis
        // restarting, would): they are tried again a second apart, and the
        // fourth confirms it, well before the next regular renewal is due.
        let crate::store::AnyStore::Memory(memory) = AnyStore::open("memory").unwrap() else {
            unreachable!()
        };
        let store = AnyStore::Memory(memory.clone());
        let seal = RecordKey::job_records(&Secret::generate().unwrap());
        let ttl = Duration::from_secs(30);
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let lease = rt.block_on(take_lease(&store, "j", ttl, false, &seal)).unwrap();
        let (taken, first) = (lease.confirmed, lease.token);
        // Two refused, then one applied whose answer is lost (an etcd
        // leader killed mid-call): the next try finds the keeper's own
        // write and renews over it, so the lease is confirmed from then on
        // (when the lost one was applied is not known).
        memory.refuse_writes(2);
        memory.lose_answers(1);
        let keeper =
            StoreKeeper::start_on(rt, store.clone(), "memory".into(), "s".into(), None, Some(lease), seal)
                .unwrap();
        let confirmed = || lock(&keeper.shared.term).map(|(at, _)| at);
        let waited = BootInstant::now();
        // Bounded well below the regular renewal (10 s after the first try).
        while confirmed() == Some(taken) && waited.elapsed() < Duration::from_secs(8) {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_ne!(confirmed(), Some(taken), "the lease was not renewed after the store came back");
        assert!(keeper.fenced().is_none(), "{:?}", keeper.fenced());
        // Renewed by this keeper over its own write whose answer was lost.
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let now = rt.block_on(store.get(&crate::store::keys::coordinator("j"))).unwrap().unwrap();
        assert_eq!(now.token, first + 2, "the lost write, then the one over it");
    }

    #[test]
    fn records_written_without_the_job_s_secret_neither_fence_the_job_nor_take_its_lease() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let store = AnyStore::open("memory").unwrap();
            let seal = RecordKey::job_records(&Secret::generate().unwrap());
            let ttl = Duration::from_secs(60);
            // A lease record that does not verify (planted, or a coordinator's
            // with another secret) keeps a new coordinator out until it expires.
            let key = crate::store::keys::coordinator("j");
            let planted =
                serde_json::to_vec(&Holder { pid: 1, boot: Some("elsewhere".into()), ..Holder::me() });
            store.put(&key, &planted.unwrap(), None).await.unwrap();
            let e = take_lease(&store, "j", ttl, false, &seal).await.err().unwrap().to_string();
            assert!(e.contains("does not verify") && e.contains("--secret-file"), "{e}");
            store.delete(&key).await.unwrap();
            let mut lease = take_lease(&store, "j", ttl, false, &seal).await.unwrap();
            // Planted again over the held lease: renewed over it, not fenced.
            let held = store.get(&key).await.unwrap().unwrap();
            store.compare_and_set(&key, Some(held.token), b"{}", None).await.unwrap();
            lease.renew(&store).await.unwrap();
            let now = store.get(&key).await.unwrap().unwrap();
            assert_eq!(now.value, lease.value);
            // A state that names a higher token but does not verify: written over.
            let (mut token, mut lost) = (None, Vec::new());
            let state = JobState { committed_steps: 1, ..Default::default() };
            write_state(&store, &seal, "s", &mut token, &mut lost, &state, BOUND, Some(5)).await.unwrap();
            let forged = JobState { finished: true, ..Default::default() };
            store.compare_and_set("s", token, &serde_json::to_vec(&forged).unwrap(), None).await.unwrap();
            let next = JobState { committed_steps: 2, ..Default::default() };
            write_state(&store, &seal, "s", &mut token, &mut lost, &next, BOUND, Some(5)).await.unwrap();
            let e = store.get("s").await.unwrap().unwrap();
            let s: JobState = serde_json::from_slice(seal.open("s", &e.value).unwrap()).unwrap();
            assert_eq!((s.committed_steps, s.finished), (2, false));
        });
    }
}
