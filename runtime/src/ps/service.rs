//! Parameter servers on the network: the server's listener (a thread per
//! client connection, the tables behind one lock, pulls that wait for
//! their step's pushes on a condition variable) and the client that
//! splits a worker's pulls and pushes by shard owner.
//!
//! Connections prove the job's secret on the `ps` channel and are sealed,
//! as the job's other channels are.

use super::placement;
use super::server::{Mark, PushTag, Pushed, Server, Stats};
use super::table::{SHARDS, SavedTable, TableSpec};
use super::wire::{self, Request, Response};
use anyhow::{Context, Result, anyhow, bail};
use edl_host_gpu::comm::auth::{self, JobAuth};
use edl_host_gpu::comm::sealed::SealedStream;
use std::{
    collections::HashMap,
    net::{SocketAddr, TcpListener, TcpStream},
    path::Path,
    sync::{Arc, Condvar, Mutex},
    time::{Duration, Instant},
};

/// Shards an export or a copy asks for in one frame: a frame stays far
/// below the wire's bound for tables of millions of rows a server.
const SHARDS_A_FRAME: usize = 16;

/// The channel name parameter-server connections claim.
pub const CHANNEL: &str = "ps";

/// Who connects for the job (not a worker id).
pub(crate) use super::server::JOB_CLIENT;

const HANDSHAKE: Duration = Duration::from_secs(10);
/// How long data sent to a server may stay unacknowledged before its
/// connection fails.
const CUT_OFF_WITHIN: Duration = Duration::from_secs(20);

/// A server's tables, shared by its connections.
struct Shared {
    server: Mutex<Server>,
    /// Signalled whenever a push was staged (a step may have been applied).
    pushed: Condvar,
    /// Longest a pull waits for the pushes of the steps before it.
    pull_timeout: Duration,
    /// Told to go: said in its stats, for the job to move its shards.
    leaving: std::sync::atomic::AtomicBool,
    /// New rows refused at the memory bound, all told.
    refused: std::sync::atomic::AtomicU64,
    /// Warnings of connections that did not prove the job's secret.
    refusals: edl_host_gpu::comm::accept::Refusals,
    /// Pulls and pushes answered, all told.
    requests: std::sync::atomic::AtomicU64,
    /// The most bytes an export answers in one frame (the wire's bound).
    export_bound: std::sync::atomic::AtomicUsize,
}

/// The steps applied on a server, as a push's answer says (`u64::MAX`
/// when it says nothing).
fn applied(resp: &Response) -> u64 {
    match resp {
        Response::Ok {
            pushed: Some(Pushed::Staged { applied } | Pushed::AlreadyApplied { applied }),
            ..
        } => *applied,
        _ => u64::MAX,
    }
}

/// A running parameter server.
pub struct Service {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl Service {
    /// Serves `server` on `listener` to processes of the job `auth` names.
    pub fn start(
        listener: TcpListener,
        auth: JobAuth,
        server: Server,
        pull_timeout: Duration,
    ) -> Result<Service> {
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            server: Mutex::new(server),
            pushed: Condvar::new(),
            pull_timeout,
            leaving: Default::default(),
            refused: Default::default(),
            refusals: Default::default(),
            requests: Default::default(),
            export_bound: wire::MAX_BODY.into(),
        });
        let s = shared.clone();
        edl_host_gpu::comm::accept::serve_each(
            listener,
            "ps-accept",
            "parameter server",
            move |conn, proving| serve(conn, &auth, &s, proving),
        )?;
        Ok(Service { addr, shared })
    }

    /// Answers exports in frames of at most `bytes` (the wire's bound
    /// otherwise), to show tables too large for one frame.
    #[cfg(test)]
    fn bound_exports(&self, bytes: usize) {
        self.shared.export_bound.store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Says in the stats that this server was told to go: the job moves
    /// its shards to the others at its next step boundary, then stops it.
    pub fn leave(&self) {
        self.shared.leaving.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn stats(&self) -> Stats {
        self.shared.server.lock().unwrap_or_else(|_| poisoned()).stats()
    }

    /// Every row of `table` this server holds, by id.
    pub fn rows(&self, table: &str) -> std::collections::BTreeMap<u64, Vec<f32>> {
        let mut server = self.shared.server.lock().unwrap_or_else(|_| poisoned());
        server.apply_staged();
        server.rows(table)
    }
}

/// One client connection: the handshake (holding its place among those
/// proving the secret), then requests until it closes.
fn serve(mut conn: TcpStream, job: &JobAuth, shared: &Shared, proving: edl_host_gpu::comm::accept::Proving) {
    let peer = conn.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
    let checked = auth::accept(&mut auth::Deadline::new(&mut conn, HANDSHAKE), &job.secret, |c| {
        job.check(c, CHANNEL, None)?;
        // The requests carry no number: the client's claim says it.
        let who = super::server::who(&c.who);
        match crate::control::proto::protocol_mismatch(&who, c.protocol) {
            Some(why) => Err(why),
            None => Ok(()),
        }
    });
    drop(proving);
    let (claim, keys) = match checked {
        Ok(k) => k,
        Err(e) => return shared.refusals.refused("a parameter-server connection", &peer, &e),
    };
    let _ = conn.set_nodelay(true);
    let mut stream = match SealedStream::new(conn, Some(keys)) {
        Ok(s) => s,
        Err(e) => return tracing::warn!("parameter server: {peer}: {e}"),
    };
    let worker = claim.who;
    loop {
        let (req, body) = match wire::read::<Request>(&mut stream) {
            Ok(Some(r)) => r,
            Ok(None) => return,
            Err(e) => return tracing::warn!("parameter server: worker {worker} at {peer}: {e}"),
        };
        let pushed = matches!(req, Request::Push { .. });
        let (resp, out) = answer(shared, worker, req, &body);
        if let Err(e) = wire::write(&mut stream, &resp, &out) {
            return tracing::warn!("parameter server: worker {worker} at {peer}: {e}");
        }
        // A push is answered once staged; the step it completes is applied
        // now, while the worker goes on (pulls waiting for it wake).
        if pushed && shared.server.lock().unwrap_or_else(|_| poisoned()).apply_staged() {
            shared.pushed.notify_all();
        }
    }
}

type Answer = (Response, Vec<u8>);

fn refused(error: String) -> Answer {
    (Response::Refused { error, over: false, full: false, too_large: false }, Vec::new())
}

fn done() -> Answer {
    (Response::ok(), Vec::new())
}

/// A refusal of the server's, marked for the client: a generation over, or
/// a server full (counted for the job's stats).
fn ps_refused(shared: &Shared, e: super::PsError) -> Answer {
    // A table gone (the servers reset for a checkpoint) is a generation over too.
    let over = matches!(e, super::PsError::Stale { .. } | super::PsError::UnknownTable { .. });
    let full = matches!(e, super::PsError::AtBound { .. });
    if let super::PsError::AtBound { new, .. } = e {
        shared.refused.fetch_add(new as u64, std::sync::atomic::Ordering::SeqCst);
    }
    (Response::Refused { error: e.to_string(), over, full, too_large: false }, Vec::new())
}

fn or_refused(r: Result<(), super::PsError>) -> Answer {
    r.map_or_else(|e| refused(e.to_string()), |()| done())
}

/// What moves the job's tables as a whole is the job's to ask, never a
/// worker's (a worker's trim would let go of the undo records a going
/// back needs; its reset, every table): refused from a worker.
fn coordinator_only(req: &Request, worker: u64) -> Option<Answer> {
    let what = match req {
        Request::Import { .. } => "an import of rows",
        Request::Enter { .. } => "entering a generation",
        Request::Drop { .. } => "dropping shards",
        Request::Trim { .. } => "trimming the undo records",
        Request::Reset => "a reset of every table",
        _ => return None,
    };
    (worker != JOB_CLIENT).then(|| {
        refused(format!("worker {worker} asked for {what}, which only the job's coordinator asks for"))
    })
}

/// A request's response and body.
fn answer(shared: &Shared, worker: u64, req: Request, body: &[u8]) -> Answer {
    if matches!(req, Request::Pull { .. } | Request::PullMany { .. } | Request::Push { .. }) {
        shared.requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    if let Some(refusal) = coordinator_only(&req, worker) {
        return refusal;
    }
    let mut server = shared.server.lock().unwrap_or_else(|_| poisoned());
    // Steps staged by pushes answered but not applied yet: every other
    // request sees them applied.
    if !matches!(req, Request::Push { .. }) && server.apply_staged() {
        shared.pushed.notify_all();
    }
    match req {
        Request::Declare { table, mark, restore: Some(r) } if !server.has(&table.name) => {
            drop(server);
            declare_restored(shared, worker, table, mark, &r)
        }
        Request::Declare { table, mark, .. } => or_refused(server.declare(worker, table, mark)),
        Request::Export { table, step, shards, since, generation } => {
            let bound = shared.export_bound.load(std::sync::atomic::Ordering::Relaxed);
            export(&server, worker, &table, (step, shards, since, generation), bound)
        }
        Request::Import { table, mark, rows } => match saved_of(table, rows, body) {
            Some(saved) => or_refused(server.import(&saved, mark)),
            None => refused(format!("worker {worker}: an import whose body is not its rows")),
        },
        Request::Enter { mark } => {
            let entered = server.enter_all(mark);
            // Pulls of the generation before give up now.
            shared.pushed.notify_all();
            or_refused(entered)
        }
        Request::Drop { shards } => {
            server.drop_shards(|s| shards.binary_search(&s).is_ok());
            done()
        }
        Request::Trim { step } => {
            server.trim(step);
            done()
        }
        Request::Reset => {
            server.reset();
            // Pulls waiting for a table that is gone give up now.
            shared.pushed.notify_all();
            done()
        }
        Request::Stats => {
            let mut stats = server.stats();
            stats.leaving = shared.leaving.load(std::sync::atomic::Ordering::SeqCst);
            stats.refused = shared.refused.load(std::sync::atomic::Ordering::SeqCst);
            stats.requests = shared.requests.load(std::sync::atomic::Ordering::SeqCst);
            (Response::Ok { pushed: None, stats: Some(stats), exported: None }, Vec::new())
        }
        Request::Push { table, tag, ids } => {
            let Some((ids, grads)) = wire::decode(body, ids) else {
                return refused(format!(
                    "table {table:?}: worker {worker} sent a push whose body is not its ids and floats"
                ));
            };
            let pushed = server.stage(&table, worker, tag, ids, grads);
            match pushed {
                Ok(p) => (Response::Ok { pushed: Some(p), stats: None, exported: None }, Vec::new()),
                Err(e) => ps_refused(shared, e),
            }
        }
        Request::Pull { table, mark, need, peek } => {
            let tables = [(table, body.len() / 8)];
            pull(shared, server, worker, (mark, need, peek), &tables, body)
        }
        Request::PullMany { tables, mark, need, peek } => {
            pull(shared, server, worker, (mark, need, peek), &tables, body)
        }
    }
}

/// An export of `table` as of `step` (of `shards`, of the rows changed
/// `since`), for a client that knows the servers of `generation`.
fn export(
    server: &Server,
    worker: u64,
    table: &str,
    (step, shards, since, generation): (u64, Option<Vec<u32>>, Option<u64>, Option<u64>),
    bound: usize,
) -> Answer {
    if let Some(g) = generation.filter(|g| server.moved_in() > *g) {
        return refused(format!(
            "table {table:?}: shards moved away from parameter server {} after generation {g} (in generation {}): ask the servers of the newer generation",
            server.id(),
            server.moved_in()
        ));
    }
    let keep = |s: u32| shards.as_ref().is_none_or(|v| v.binary_search(&s).is_ok());
    match server.export_shards(table, worker, step, keep, since) {
        Ok(t) => {
            // Its size known before it is encoded (an id, the row's floats
            // and its updates a row): an answer too large is not made.
            let n = t.ids.len();
            let bytes = n.saturating_mul(16 + 4 * t.spec.width());
            if bytes > bound {
                let asked = shards.map_or(SHARDS as usize, |s| s.len());
                let error = format!(
                    "table {table:?}: {n} rows of {asked} shards are {bytes} bytes, past the {bound} bytes of a frame{}",
                    if asked > 1 { "" } else { "; one shard this large cannot be moved" }
                );
                return (Response::Refused { error, over: false, full: false, too_large: true }, Vec::new());
            }
            let body = saved_body(&t);
            (Response::Ok { pushed: None, stats: None, exported: Some((t.spec, n)) }, body)
        }
        Err(e) => refused(e.to_string()),
    }
}

/// A request panicked while it held the tables: what they hold may be
/// half changed, so the server ends (status 1) rather than serve it, and
/// the job takes it for lost (its shards come back from their replicas or
/// the newest checkpoint).
fn poisoned() -> ! {
    eprintln!("parameter server: a request failed while it changed the tables; this server ends");
    std::process::exit(1)
}

/// Makes a table from its rows in a checkpoint: read without the lock, so
/// the other tables go on being served.
fn declare_restored(shared: &Shared, worker: u64, table: TableSpec, mark: Mark, r: &wire::Restore) -> Answer {
    if r.servers.is_empty() {
        return refused(format!(
            "worker {worker}: a restore of table {:?} names no servers to place it on",
            table.name
        ));
    }
    let saved = match restored(r, &table.name) {
        Ok(s) => s,
        Err(e) => return refused(e),
    };
    let mut server = shared.server.lock().unwrap_or_else(|_| poisoned());
    let me = server.id();
    let holds = |shard| placement::ranked(&r.servers, shard).iter().take(r.replicas.max(1)).any(|s| *s == me);
    or_refused(server.restore(worker, table, mark, &saved, holds))
}

/// Each table's ids of a [`Request::PullMany`]'s body (`None` when the
/// body is not exactly their counts of ids).
fn split_ids(tables: &[(String, usize)], body: &[u8]) -> Option<Vec<(String, Vec<u64>)>> {
    let total = tables.iter().try_fold(0usize, |n, (_, k)| n.checked_add(*k))?;
    let (ids, rest) = wire::decode(body, total)?;
    if !rest.is_empty() {
        return None;
    }
    let mut at = 0;
    Some(
        tables
            .iter()
            .map(|(t, k)| {
                at += k;
                (t.clone(), ids[at - k..at].to_vec())
            })
            .collect(),
    )
}

/// A pull of each of `tables` (name, count of ids) in turn, `body` their
/// ids: their rows, one table after the other, once the steps before
/// `need` are applied (waiting on the pushes, up to the pull timeout).
fn pull(
    shared: &Shared,
    mut server: std::sync::MutexGuard<'_, Server>,
    worker: u64,
    (mark, need, peek): (Mark, u64, bool),
    tables: &[(String, usize)],
    body: &[u8],
) -> Answer {
    let Some(reads) = split_ids(tables, body) else {
        let names: Vec<&String> = tables.iter().map(|(t, _)| t).collect();
        return refused(format!("tables {names:?}: worker {worker} sent a pull whose body is not their ids"));
    };
    // The answer is refused before anything is made for it where it could
    // not be sent.
    let bytes = reads.iter().fold(0usize, |n, (table, ids)| {
        n.saturating_add(ids.len().saturating_mul(server.dim(table).unwrap_or(0)).saturating_mul(4))
    });
    if bytes > wire::MAX_BODY {
        let names: Vec<&String> = reads.iter().map(|(t, _)| t).collect();
        return refused(format!(
            "tables {names:?}: worker {worker} asked for {bytes} bytes of rows at once, past the wire's bound of {} \
             bytes: ask for fewer rows at a time",
            wire::MAX_BODY
        ));
    }
    let deadline = Instant::now() + shared.pull_timeout;
    let mut out = Vec::new();
    for (table, ids) in &reads {
        loop {
            // A step staged by a push still being answered on another connection.
            if server.apply_staged() {
                shared.pushed.notify_all();
            }
            let rows = if peek {
                server.peek(table, worker, mark, need, ids)
            } else {
                server.pull(table, worker, mark, need, ids)
            };
            match rows {
                Ok(Some(rows)) => {
                    out.extend(rows);
                    break;
                }
                Err(e) => return ps_refused(shared, e),
                Ok(None) => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let (applied, next) = server.waiting(table).unwrap_or_default();
                return refused(format!(
                    "table {table:?}: worker {worker} waited {:?} for step {} (steps before it applied: {applied}; {next})",
                    shared.pull_timeout,
                    need.saturating_sub(1)
                ));
            }
            server = shared.pushed.wait_timeout(server, left).expect("ps state").0;
        }
    }
    (Response::ok(), wire::encode(&[], &out))
}

/// An export's body: ids, update counts (as u64), rows.
fn saved_body(t: &SavedTable) -> Vec<u8> {
    let updates: Vec<u64> = t.updates.iter().map(|&u| u as u64).collect();
    let mut body = wire::encode(&t.ids, &[]);
    body.extend(wire::encode(&updates, &t.rows));
    body
}

/// The rows of table `spec` in an export's body of `n` rows.
fn saved_of(spec: TableSpec, n: usize, body: &[u8]) -> Option<SavedTable> {
    spec.check().ok()?;
    let floats = n.checked_mul(spec.width())?;
    let (head, rows) = wire::decode(body, n.checked_mul(2)?).filter(|(_, r)| r.len() == floats)?;
    let updates = head[n..].iter().map(|&u| u as u32).collect();
    Some(SavedTable { spec, ids: head[..n].to_vec(), rows, updates })
}

/// Table `name` of the checkpoint `r` names.
fn restored(r: &wire::Restore, name: &str) -> Result<SavedTable, String> {
    let shown = r.path.display();
    let checkpoints = crate::checkpoint::Checkpoints::open(&r.location, 1).map_err(|e| e.to_string())?;
    let cp = checkpoints.read_at(&r.path).map_err(|e| format!("restoring table {name:?}: {e}"))?;
    cp.tables
        .into_iter()
        .find(|t| t.spec.name == name)
        .ok_or_else(|| format!("checkpoint {shown} holds no table {name:?} (it was written without it)"))
}

/// A server that cannot be reached (gone, or its connection broke): the
/// step is redone once the job has its servers in order again, unlike a
/// request the server refused.
#[derive(Debug, thiserror::Error)]
#[error("parameter server {server} at {addr} is unreachable: {detail}")]
pub struct Unreachable {
    pub server: u64,
    pub addr: SocketAddr,
    pub detail: String,
}

/// A request of a generation that is over (the job formed a newer one):
/// the step is redone there.
#[derive(Debug, thiserror::Error)]
#[error("parameter server {server}: {detail}")]
pub struct Superseded {
    pub server: u64,
    pub detail: String,
}

/// An export's answer would not fit in a frame: its shards are asked for
/// fewer at a time.
#[derive(Debug, thiserror::Error)]
#[error("parameter server {server}: {detail}")]
pub struct TooLarge {
    pub server: u64,
    pub detail: String,
}

/// What an export asks of a server, but for its shards.
#[derive(Clone, Copy)]
struct Export<'a> {
    table: &'a str,
    step: u64,
    since: Option<u64>,
    generation: Option<u64>,
}

impl Export<'_> {
    fn request(&self, shards: Vec<u32>) -> Request {
        let (table, step, since, generation) = (self.table.into(), self.step, self.since, self.generation);
        Request::Export { table, step, shards: Some(shards), since, generation }
    }
}

/// A server at its memory bound refused new rows.
#[derive(Debug, thiserror::Error)]
#[error("parameter server {server}: {detail}")]
pub struct Full {
    pub server: u64,
    pub detail: String,
}

/// Whether `e` means the step cannot go on but will be redone once the
/// job's next generation has its servers in order (a server gone, the
/// step's generation over, or a server full while the job may add one:
/// `room`), rather than a request the servers refused.
pub fn redo(e: &anyhow::Error, room: bool) -> bool {
    e.chain().any(|c| c.is::<Unreachable>() || c.is::<Superseded>() || (room && c.is::<Full>()))
}

/// A worker's connections to every parameter server of the job.
pub struct Client {
    worker: u64,
    servers: Vec<Conn>,
    /// Per shard, the servers holding it (its owner first, then its replicas).
    holders: Vec<Vec<usize>>,
    replicas: usize,
    dims: HashMap<String, TableSpec>,
    /// Per server, the pushes sent whose answers are still to be read
    /// ([`Client::push_later`]); read before anything else is asked.
    unanswered: Vec<usize>,
    /// Most bytes of ids or rows one request of a read asks a server for;
    /// a read past it goes in rounds ([`rounds`]).
    read_bound: usize,
}

/// A part of one table's read from one server: the table (its index in
/// the plans) and the range of that server's unique ids asked.
type Part = (usize, std::ops::Range<usize>);

/// The requests of a read from `servers` servers, round by round: in each,
/// each server is asked once, for parts of its ids of some tables. One
/// round, unless a server's request (its ids) or answer (their rows) would
/// pass `bound` bytes: then more, one after the other, a table whose rows
/// alone pass it asked in parts.
fn rounds(servers: usize, plans: &[ReadPlan], bound: usize) -> Vec<Vec<Vec<Part>>> {
    let mut rounds: Vec<Vec<Vec<Part>>> = Vec::new();
    for s in 0..servers {
        let (mut round, mut bytes) = (0, 0);
        for (p, plan) in plans.iter().enumerate() {
            let (ids, per) = (plan.unique[s].len(), 8.max(plan.dim * 4));
            let most = (bound / per).max(1);
            let mut from = 0;
            while from < ids {
                let take = (ids - from).min(most);
                if bytes > 0 && bytes + take * per > bound {
                    (round, bytes) = (round + 1, 0);
                }
                if rounds.len() <= round {
                    rounds.push(vec![Vec::new(); servers]);
                }
                rounds[round][s].push((p, from..from + take));
                (bytes, from) = (bytes + take * per, from + take);
            }
        }
    }
    rounds
}

/// A read of one table: each server's unique ids, and where each id asked
/// is found in the answers (server, position).
struct ReadPlan {
    dim: usize,
    unique: Vec<Vec<u64>>,
    at: Vec<(u32, u32)>,
}

struct Conn {
    id: u64,
    addr: SocketAddr,
    stream: SealedStream,
}

impl Conn {
    fn unreachable(&self, detail: impl std::fmt::Display) -> anyhow::Error {
        Unreachable { server: self.id, addr: self.addr, detail: detail.to_string() }.into()
    }

    fn send(&mut self, req: &Request, body: &[u8]) -> Result<()> {
        wire::write(&mut self.stream, req, body).map_err(|e| match e.kind() {
            // Too large to send (refused before a byte is written) is the
            // request's fault, not the server's: said as it is, not taken
            // for a server out of reach (and redone).
            std::io::ErrorKind::InvalidInput => anyhow!("parameter server {} at {}: {e}", self.id, self.addr),
            _ => self.unreachable(e),
        })
    }

    fn receive(&mut self) -> Result<(Response, Vec<u8>)> {
        let got = wire::read::<Response>(&mut self.stream).map_err(|e| self.unreachable(e))?;
        let Some((resp, body)) = got else { return Err(self.unreachable("it closed the connection")) };
        match resp {
            Response::Refused { error, over: true, .. } => {
                Err(Superseded { server: self.id, detail: error }.into())
            }
            Response::Refused { error, full: true, .. } => {
                Err(Full { server: self.id, detail: error }.into())
            }
            Response::Refused { error, too_large: true, .. } => {
                Err(TooLarge { server: self.id, detail: error }.into())
            }
            Response::Refused { error, .. } => {
                bail!("parameter server {} at {}: {error}", self.id, self.addr)
            }
            ok => Ok((ok, body)),
        }
    }
}

impl Client {
    /// Connects to `servers` (their ids and addresses) as `worker`; each
    /// shard is held by `replicas` of them (its owner and the next ones in
    /// its rendezvous order).
    pub fn connect(
        servers: &[(u64, SocketAddr)],
        replicas: usize,
        job: &JobAuth,
        worker: u64,
    ) -> Result<Client> {
        if servers.is_empty() {
            bail!("no parameter servers to connect to");
        }
        let mut conns = Vec::new();
        for &(id, addr) in servers {
            let conn = (|| -> std::io::Result<Conn> {
                let mut s = TcpStream::connect_timeout(&addr, HANDSHAKE)?;
                s.set_nodelay(true)?;
                // A server cut off (its host gone, a link down) fails the
                // request waiting on it within about 20 s, whether it waits
                // for an answer (keepalive) or to send (unacknowledged data).
                crate::control::proto::keepalive(&s);
                crate::control::proto::give_up_unacked(&s, CUT_OFF_WITHIN);
                s.set_read_timeout(Some(HANDSHAKE))?;
                let keys = auth::connect(
                    &mut s,
                    &job.secret,
                    &job.claim(CHANNEL, 0, worker).speaking(crate::control::proto::PROTOCOL),
                )
                .map_err(std::io::Error::other)?;
                s.set_read_timeout(None)?;
                Ok(Conn { id, addr, stream: SealedStream::new(s, Some(keys))? })
            })()
            .map_err(|e| Unreachable {
                server: id,
                addr,
                detail: format!("connecting: {e}"),
            })?;
            conns.push(conn);
        }
        let ids: Vec<u64> = conns.iter().map(|c| c.id).collect();
        let at = |o: u64| ids.iter().position(|&i| i == o).expect("a server among them");
        let holders: Vec<Vec<usize>> = (0..SHARDS)
            .map(|shard| placement::ranked(&ids, shard).into_iter().take(replicas.max(1)).map(at).collect())
            .collect();
        let unanswered = vec![0; conns.len()];
        Ok(Client {
            worker,
            servers: conns,
            holders,
            replicas: replicas.max(1),
            dims: HashMap::new(),
            unanswered,
            read_bound: wire::MAX_BODY / 2,
        })
    }

    /// Declares `spec` on every server as of `mark` (the same spec again
    /// is a no-op); a server that makes it takes its rows from the
    /// checkpoint at `restore` (in the job's checkpoint `location`), if any.
    pub fn declare(&mut self, spec: TableSpec, mark: Mark, restore: Option<(&Path, &Path)>) -> Result<()> {
        let servers = self.servers.iter().map(|c| c.id).collect();
        let restore = restore.map(|(location, path)| wire::Restore {
            location: location.to_path_buf(),
            path: path.to_path_buf(),
            servers,
            replicas: self.replicas,
        });
        let req = Request::Declare { table: spec.clone(), mark, restore };
        self.ask(&self.all(), |_| (req.clone(), Vec::new()))?;
        self.dims.insert(spec.name.clone(), spec);
        Ok(())
    }

    /// Knows `spec` without declaring it (a client that only exports).
    pub fn know(&mut self, spec: TableSpec) {
        self.dims.insert(spec.name.clone(), spec);
    }

    /// Sends each of the servers `which` (indices) its request, then reads
    /// every answer, so that a refusal leaves no answer behind on any
    /// connection; the first error, if any, once all are read. One request
    /// a server at a time: a server writing a long answer never waits on a
    /// client still writing to it.
    fn ask(
        &mut self,
        which: &[usize],
        mut req: impl FnMut(usize) -> (Request, Vec<u8>),
    ) -> Result<Vec<(Response, Vec<u8>)>> {
        self.settle()?;
        let mut sent = Vec::with_capacity(which.len());
        let mut first: Option<anyhow::Error> = None;
        for &s in which {
            let (r, body) = req(s);
            match self.servers[s].send(&r, &body) {
                Ok(()) => sent.push(s),
                Err(e) => _ = first.get_or_insert(e),
            }
        }
        let mut out = Vec::with_capacity(sent.len());
        for s in sent {
            match self.servers[s].receive() {
                Ok(a) => out.push(a),
                Err(e) => _ = first.get_or_insert(e),
            }
        }
        match first {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    fn all(&self) -> Vec<usize> {
        (0..self.servers.len()).collect()
    }

    fn spec(&self, table: &str) -> Result<&TableSpec> {
        self.dims
            .get(table)
            .with_context(|| format!("table {table:?} was not declared by worker {}", self.worker))
    }

    /// Rows `ids` of `table` (in order, repeats allowed), once the steps
    /// before `need` are applied; each server is asked once for its unique ids.
    pub fn pull(&mut self, table: &str, mark: Mark, need: u64, ids: &[u64]) -> Result<Vec<f32>> {
        Ok(self.read(&[(table, ids)], mark, need, false)?.remove(0))
    }

    /// [`Client::pull`] of several tables at once: one request to each
    /// server for all of them, one answer back (a round trip a server, not
    /// one a table).
    pub fn pull_many(&mut self, reads: &[(&str, &[u64])], mark: Mark, need: u64) -> Result<Vec<Vec<f32>>> {
        self.read(reads, mark, need, false)
    }

    /// [`Client::pull`] that makes no row on the servers: one not held
    /// comes back with its initial values (an evaluation's read).
    pub fn peek(&mut self, table: &str, mark: Mark, need: u64, ids: &[u64]) -> Result<Vec<f32>> {
        Ok(self.read(&[(table, ids)], mark, need, true)?.remove(0))
    }

    fn read(&mut self, reads: &[(&str, &[u64])], mark: Mark, need: u64, peek: bool) -> Result<Vec<Vec<f32>>> {
        let plans: Vec<ReadPlan> =
            reads.iter().map(|&(table, ids)| self.plan_read(table, ids)).collect::<Result<_>>()?;
        let mut rows: Vec<Vec<Vec<f32>>> = plans
            .iter()
            .map(|plan| plan.unique.iter().map(|ids| vec![0.0; ids.len() * plan.dim]).collect())
            .collect();
        for asks in rounds(self.servers.len(), &plans, self.read_bound) {
            self.read_round(reads, &plans, &asks, (mark, need, peek), &mut rows)?;
        }
        Ok(plans
            .iter()
            .zip(&rows)
            .map(|(plan, rows)| {
                let d = plan.dim;
                let mut out = Vec::with_capacity(plan.at.len() * d);
                for &(s, i) in &plan.at {
                    let i = i as usize;
                    out.extend_from_slice(&rows[s as usize][i * d..(i + 1) * d]);
                }
                out
            })
            .collect())
    }

    /// One request to each server of its parts `asks[server]`, their rows
    /// put in their places in `rows[table][server]`.
    fn read_round(
        &mut self,
        reads: &[(&str, &[u64])],
        plans: &[ReadPlan],
        asks: &[Vec<Part>],
        (mark, need, peek): (Mark, u64, bool),
        rows: &mut [Vec<Vec<f32>>],
    ) -> Result<()> {
        let asked: Vec<usize> = (0..self.servers.len()).filter(|&s| !asks[s].is_empty()).collect();
        let answers = self.ask(&asked, |s| {
            let body: Vec<u8> = asks[s]
                .iter()
                .flat_map(|(p, r)| wire::encode(&plans[*p].unique[s][r.clone()], &[]))
                .collect();
            let req = match &asks[s][..] {
                [(p, _)] => Request::Pull { table: reads[*p].0.into(), mark, need, peek },
                _ => {
                    let tables = asks[s].iter().map(|(p, r)| (reads[*p].0.to_string(), r.len())).collect();
                    Request::PullMany { tables, mark, need, peek }
                }
            };
            (req, body)
        })?;
        for (&s, (_, body)) in asked.iter().zip(answers) {
            let want: usize = asks[s].iter().map(|(p, r)| r.len() * plans[*p].dim).sum();
            let (_, all) = wire::decode(&body, 0).filter(|(_, r)| r.len() == want).with_context(|| {
                let names: Vec<&str> = asks[s].iter().map(|(p, _)| reads[*p].0).collect();
                format!(
                    "parameter server {}: a pull of {names:?} answered with the wrong size",
                    self.servers[s].id
                )
            })?;
            let mut at = 0;
            for (p, r) in &asks[s] {
                let d = plans[*p].dim;
                let n = r.len() * d;
                rows[*p][s][r.start * d..r.end * d].copy_from_slice(&all[at..at + n]);
                at += n;
            }
        }
        Ok(())
    }

    /// Which server each of `ids` is asked of, each once.
    fn plan_read(&self, table: &str, ids: &[u64]) -> Result<ReadPlan> {
        let spec = self.spec(table)?;
        let mut unique: Vec<Vec<u64>> = vec![Vec::new(); self.servers.len()];
        let mut place: rustc_hash::FxHashMap<u64, (u32, u32)> =
            rustc_hash::FxHashMap::with_capacity_and_hasher(ids.len(), Default::default());
        let at = ids
            .iter()
            .map(|&id| {
                *place.entry(id).or_insert_with(|| {
                    let s = self.holders[spec.shard_of(id) as usize][0];
                    unique[s].push(id);
                    (s as u32, (unique[s].len() - 1) as u32)
                })
            })
            .collect();
        Ok(ReadPlan { dim: spec.dim, unique, at })
    }

    /// Pushes `grads` (`ids.len() * dim` floats) of a step to every server:
    /// a row's repeats summed, each server sent its rows (or none, so that
    /// it counts this rank's push). Returns the steps applied on the
    /// slowest server.
    pub fn push(&mut self, table: &str, tag: PushTag, ids: &[u64], grads: &[f32]) -> Result<u64> {
        let mut per = self.pushes(table, tag, ids, grads)?;
        let answers =
            self.ask(&self.all(), |s| std::mem::replace(&mut per[s], (Request::Stats, Vec::new())))?;
        Ok(answers.iter().map(|(resp, _)| applied(resp)).min().unwrap_or(u64::MAX))
    }

    /// [`Client::push`] whose answers are read later: by [`Client::settle`],
    /// or before the next request. The servers apply the step while the
    /// worker goes on; a refusal shows when the answers are read.
    pub fn push_later(&mut self, table: &str, tag: PushTag, ids: &[u64], grads: &[f32]) -> Result<()> {
        let per = self.pushes(table, tag, ids, grads)?;
        // Answers come back in order: they may wait behind one another.
        for (s, (req, body)) in per.iter().enumerate() {
            self.servers[s].send(req, body)?;
            self.unanswered[s] += 1;
        }
        Ok(())
    }

    /// Reads the answers of the pushes sent by [`Client::push_later`]: the
    /// first refusal, if any, once all are read (a connection that broke
    /// is not to be used again).
    pub fn settle(&mut self) -> Result<()> {
        let mut first: Option<anyhow::Error> = None;
        for s in 0..self.servers.len() {
            while self.unanswered[s] > 0 {
                self.unanswered[s] -= 1;
                if let Err(e) = self.servers[s].receive() {
                    first.get_or_insert(e);
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Each server's push of a step's rows: a row's repeats summed, each
    /// server its rows (those of the shards it holds, owner or replica), or
    /// none (so that it counts this rank's push).
    fn pushes(
        &self,
        table: &str,
        tag: PushTag,
        ids: &[u64],
        grads: &[f32],
    ) -> Result<Vec<(Request, Vec<u8>)>> {
        let spec = self.spec(table)?;
        let d = spec.dim;
        if grads.len() != ids.len() * d {
            bail!("table {table:?}: {} gradient floats for {} ids of dimension {d}", grads.len(), ids.len());
        }
        // A row's repeats summed, in the order rows first appear.
        let (mut unique, mut summed) = (Vec::with_capacity(ids.len()), Vec::with_capacity(grads.len()));
        let mut at: rustc_hash::FxHashMap<u64, usize> =
            rustc_hash::FxHashMap::with_capacity_and_hasher(ids.len(), Default::default());
        for (&id, g) in ids.iter().zip(grads.chunks_exact(d)) {
            let i = *at.entry(id).or_insert_with(|| {
                unique.push(id);
                summed.extend(std::iter::repeat_n(0.0, d));
                unique.len() - 1
            });
            summed[i * d..(i + 1) * d].iter_mut().zip(g).for_each(|(a, b)| *a += b);
        }
        let mut per: Vec<(Vec<u64>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); self.servers.len()];
        for (i, &id) in unique.iter().enumerate() {
            for &s in &self.holders[spec.shard_of(id) as usize] {
                per[s].0.push(id);
                per[s].1.extend_from_slice(&summed[i * d..(i + 1) * d]);
            }
        }
        let pushes: Vec<(Request, Vec<u8>)> = per
            .into_iter()
            .map(|(ids, grads)| {
                (Request::Push { table: table.into(), tag, ids: ids.len() }, wire::encode(&ids, &grads))
            })
            .collect();
        // Refused before any server has it: a step pushed to some servers
        // and not others is never left behind by a size.
        if let Some((s, (_, body))) = pushes.iter().enumerate().find(|(_, (_, b))| b.len() > wire::MAX_BODY) {
            bail!(
                "table {table:?}: a push of {} bytes to parameter server {} passes the wire's bound of {} bytes: \
                 push fewer rows a step",
                body.len(),
                self.servers[s].id,
                wire::MAX_BODY
            );
        }
        Ok(pushes)
    }

    /// `table` as it was after its steps before `step`, from every server.
    /// `generation`: the one whose servers this client knows (a server
    /// that gave shards away since refuses).
    pub fn export(&mut self, table: &str, step: u64, generation: Option<u64>) -> Result<SavedTable> {
        let spec = self.spec(table)?.clone();
        // Each shard from its owner (a replica holds the same rows), a few
        // shards a frame, asked of the servers at once.
        let mut parts: Vec<SavedTable> = Vec::new();
        let ask = Export { table, step, since: None, generation };
        for chunk in (0..SHARDS).collect::<Vec<_>>().chunks(SHARDS_A_FRAME) {
            let mut owned: Vec<Vec<u32>> = vec![Vec::new(); self.servers.len()];
            chunk.iter().for_each(|&shard| owned[self.holders[shard as usize][0]].push(shard));
            let asked: Vec<usize> = (0..self.servers.len()).filter(|&s| !owned[s].is_empty()).collect();
            let answers = match self.ask(&asked, |s| (ask.request(owned[s].clone()), Vec::new())) {
                Ok(answers) => asked.iter().map(|&s| self.servers[s].id).zip(answers).collect(),
                // Rows too many for a frame: each server's asked again, fewer at a time.
                Err(e) if e.is::<TooLarge>() => {
                    let mut answers = Vec::new();
                    for &s in &asked {
                        let id = self.servers[s].id;
                        answers.extend(self.export_from(s, ask, &owned[s])?.into_iter().map(|a| (id, a)));
                    }
                    answers
                }
                Err(e) => return Err(e),
            };
            for (id, (resp, body)) in answers {
                let Response::Ok { exported: Some((_, n)), .. } = resp else {
                    bail!("parameter server {id}: no rows in its export of {table:?}")
                };
                parts.push(saved_of(spec.clone(), n, &body).with_context(|| {
                    format!("parameter server {id}: an export of {table:?} of the wrong size")
                })?);
            }
        }
        // The parts' rows by id (each shard came from one server).
        let w = spec.width();
        let mut order: Vec<(u64, usize, usize)> = parts
            .iter()
            .enumerate()
            .flat_map(|(p, t)| t.ids.iter().enumerate().map(move |(i, &id)| (id, p, i)))
            .collect();
        order.sort_unstable();
        order.dedup_by_key(|r| r.0);
        let mut all = SavedTable {
            spec,
            ids: Vec::with_capacity(order.len()),
            rows: Vec::with_capacity(order.len() * w),
            updates: Vec::with_capacity(order.len()),
        };
        for (id, p, i) in order {
            all.ids.push(id);
            all.rows.extend_from_slice(&parts[p].rows[i * w..(i + 1) * w]);
            all.updates.push(parts[p].updates[i]);
        }
        Ok(all)
    }

    fn conn(&mut self, server: u64) -> Result<&mut Conn> {
        self.servers
            .iter_mut()
            .find(|c| c.id == server)
            .with_context(|| format!("no parameter server {server}"))
    }

    /// A new generation on every server: each table rolled back to `mark`'s base.
    pub fn enter_all(&mut self, mark: Mark) -> Result<()> {
        self.ask(&self.all(), |_| (Request::Enter { mark }, Vec::new())).map(drop)
    }

    /// Copies the rows of `shards` of `table` as of `step` from server
    /// `from` to server `to` (which makes the table as of `mark` if new);
    /// with `since`, only the rows the steps from it on changed. Returns
    /// the rows copied.
    pub fn copy_shards(
        &mut self,
        table: &str,
        (shards, since): (&[u32], Option<u64>),
        step: u64,
        (from, to): (u64, u64),
        mark: Mark,
    ) -> Result<usize> {
        let mut copied = 0;
        let ask = Export { table, step, since, generation: None };
        let src = self
            .servers
            .iter()
            .position(|c| c.id == from)
            .with_context(|| format!("no parameter server {from}"))?;
        // A few shards a frame.
        for chunk in shards.chunks(SHARDS_A_FRAME) {
            for (resp, body) in self.export_from(src, ask, chunk)? {
                let Response::Ok { exported: Some((spec, n)), .. } = resp else {
                    bail!("parameter server {from}: no rows in its export of {table:?}")
                };
                let dst = self.conn(to)?;
                dst.send(&Request::Import { table: spec, mark, rows: n }, &body)?;
                dst.receive()?;
                copied += n;
            }
        }
        Ok(copied)
    }

    /// `shards` exported by server `s` (its index here), in as many frames
    /// as their rows need: halved while an answer would not fit in one.
    fn export_from(&mut self, s: usize, ask: Export, shards: &[u32]) -> Result<Vec<(Response, Vec<u8>)>> {
        let c = &mut self.servers[s];
        c.send(&ask.request(shards.to_vec()), &[])?;
        match c.receive() {
            Ok(answer) => Ok(vec![answer]),
            Err(e) if e.is::<TooLarge>() && shards.len() > 1 => {
                let (a, b) = shards.split_at(shards.len() / 2);
                let mut answers = self.export_from(s, ask, a)?;
                answers.extend(self.export_from(s, ask, b)?);
                Ok(answers)
            }
            Err(e) => Err(e),
        }
    }

    /// Tells every server to forget how to undo the steps before `step`.
    pub fn trim_all(&mut self, step: u64) -> Result<()> {
        self.ask(&self.all(), |_| (Request::Trim { step }, Vec::new())).map(drop)
    }

    /// Tells every server to forget every table.
    pub fn reset_all(&mut self) -> Result<()> {
        self.ask(&self.all(), |_| (Request::Reset, Vec::new())).map(drop)
    }

    /// Tells `server` to forget `shards` of every table.
    pub fn drop_shards(&mut self, server: u64, shards: &[u32]) -> Result<()> {
        let c = self.conn(server)?;
        c.send(&Request::Drop { shards: shards.to_vec() }, &[])?;
        c.receive().map(drop)
    }

    /// Every server's tables and memory.
    pub fn stats(&mut self) -> Result<Vec<Stats>> {
        let answers = self.ask(&self.all(), |_| (Request::Stats, Vec::new()))?;
        answers
            .into_iter()
            .zip(&self.servers)
            .map(|(a, c)| match a {
                (Response::Ok { stats: Some(s), .. }, _) => Ok(s),
                _ => bail!("parameter server {}: no stats in its answer", c.id),
            })
            .collect()
    }

    /// Bounds every read of an answer (a server wedged ends a request
    /// instead of holding its caller).
    pub fn set_timeout(&mut self, within: Duration) -> Result<()> {
        for c in &self.servers {
            c.stream.get_ref().set_read_timeout(Some(within))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ps::table::{Init, Optimizer};
    use auth::Secret;

    fn job() -> JobAuth {
        JobAuth { job: "ctr".into(), secret: Secret::generate().unwrap() }
    }

    fn start(job: &JobAuth, id: u64, timeout: Duration) -> Service {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        Service::start(l, job.clone(), Server::new(id, None), timeout).unwrap()
    }

    fn spec() -> TableSpec {
        TableSpec {
            name: "emb".into(),
            dim: 3,
            optimizer: Optimizer::sgd(0.5),
            init: Init::Uniform { scale: 0.1 },
            seed: 1,
        }
    }

    /// The ids rank `rank` touches at `step` (repeats and a shared hot id).
    fn batch(step: u64, rank: u64) -> Vec<u64> {
        let mut ids: Vec<u64> =
            (0..6).map(|i| crate::ps::table::mix(step * 31 + rank * 7 + i) % 40).collect();
        ids.push(7);
        ids.push(ids[0]);
        ids
    }

    /// A gradient that depends on the rows a step read, so a pull that did
    /// not wait for the step before it shows in the result.
    fn grads(rows: &[f32], step: u64) -> Vec<f32> {
        rows.iter().enumerate().map(|(i, w)| 0.3 * w + 0.01 * ((step as usize + i) % 5) as f32).collect()
    }

    #[test]
    fn a_read_too_big_for_one_frame_a_server_goes_in_rounds() {
        let plan = |dim, sizes: [usize; 2]| ReadPlan {
            dim,
            unique: sizes.iter().map(|&n| (0..n as u64).collect()).collect(),
            at: Vec::new(),
        };
        // Server 0: three tables of 100 ids (rows of 1, 1 and 64 floats:
        // 800, 800 and 25,600 bytes); server 1: the first two only.
        let plans = [plan(1, [100, 10]), plan(1, [100, 10]), plan(64, [100, 0])];
        let all = [vec![(0, 0..100), (1, 0..100), (2, 0..100)], vec![(0, 0..10), (1, 0..10)]];
        assert_eq!(rounds(2, &plans, 1 << 20), [all]);
        // A bound of 2,000 bytes: server 0's third table after the others,
        // in parts of 7 rows (1,792 bytes), one a round.
        let r = rounds(2, &plans, 2000);
        assert_eq!(r[0], [vec![(0, 0..100), (1, 0..100)], vec![(0, 0..10), (1, 0..10)]]);
        assert_eq!(r.len(), 1 + 15);
        let parts: Vec<Part> = r[1..].iter().flat_map(|round| round[0].clone()).collect();
        let want: Vec<Part> = (0..100).step_by(7).map(|a| (2, a..(a + 7).min(100))).collect();
        assert_eq!(parts, want, "every row asked once, in order");
        assert!(r[1..].iter().all(|round| round[0].len() == 1 && round[1].is_empty()));
        // Nothing asked of anyone: no round.
        assert!(rounds(2, &[plan(3, [0, 0])], 2000).is_empty());
    }

    #[test]
    fn an_export_too_large_for_a_frame_comes_in_smaller_ones_and_reads_as_one_would() {
        let job = job();
        let services = [start(&job, 1, Duration::from_secs(60)), start(&job, 2, Duration::from_secs(60))];
        let addrs: Vec<(u64, SocketAddr)> = vec![(1, services[0].addr()), (2, services[1].addr())];
        let mark = Mark { generation: 1, base: 0, committed: 0 };
        let mut c = Client::connect(&addrs, 1, &job, JOB_CLIENT).unwrap();
        c.declare(spec(), mark, None).unwrap();
        let ids: Vec<u64> = (0..3000).collect();
        c.pull("emb", mark, 0, &ids).unwrap();
        c.push("emb", PushTag { mark, step: 0, rank: 0, world: 1 }, &ids, &vec![1.0; ids.len() * 3]).unwrap();
        c.pull("emb", mark, 1, &ids[..1]).unwrap();
        let whole = c.export("emb", 1, None).unwrap();
        assert_eq!(whole.ids.len(), 3000);
        // Frames that hold the largest shard's rows (28 bytes a row: id,
        // three floats, updates), not the 16 shards first asked for.
        let mut per_shard = vec![0usize; SHARDS as usize];
        whole.ids.iter().for_each(|&id| per_shard[spec().shard_of(id) as usize] += 1);
        let frame = per_shard.iter().max().unwrap() * 28;
        let firsts: Vec<u64> = (0..16).map(|shard| placement::owner(&[1, 2], shard)).collect();
        let asked_first = (1..=2).map(|server| {
            (0..16).filter(|&sh| firsts[sh] == server).map(|sh| per_shard[sh] * 28).sum::<usize>()
        });
        assert!(asked_first.max().unwrap() > frame, "the first ask passes a frame");
        services.iter().for_each(|s| s.bound_exports(frame));
        let parted = c.export("emb", 1, None).unwrap();
        assert_eq!((&parted.ids, &parted.rows, &parted.updates), (&whole.ids, &whole.rows, &whole.updates));
        // A copy of server 1's shards to server 2, alike.
        let owned: Vec<u32> = (0..SHARDS).filter(|&s| placement::owner(&[1, 2], s) == 1).collect();
        let copied = c.copy_shards("emb", (&owned, None), 1, (1, 2), mark).unwrap();
        let of_1 = whole.ids.iter().filter(|&&id| placement::owner(&[1, 2], spec().shard_of(id)) == 1);
        assert_eq!(copied, of_1.count());
        // One shard past a frame cannot be split: said, naming the table.
        services.iter().for_each(|s| s.bound_exports(64));
        let e = format!("{:#}", c.export("emb", 1, None).unwrap_err());
        assert!(e.contains("table \"emb\"") && e.contains("one shard this large cannot be moved"), "{e}");
    }

    #[test]
    fn a_read_past_the_bound_of_one_request_reads_as_one_request_would() {
        let job = job();
        let services = [start(&job, 1, Duration::from_secs(60)), start(&job, 2, Duration::from_secs(60))];
        let addrs: Vec<(u64, SocketAddr)> = vec![(1, services[0].addr()), (2, services[1].addr())];
        let mark = Mark { generation: 1, base: 0, committed: 0 };
        let (mut one, mut parts) =
            (Client::connect(&addrs, 1, &job, 3).unwrap(), Client::connect(&addrs, 1, &job, 4).unwrap());
        one.declare(spec(), mark, None).unwrap();
        parts.declare(spec(), mark, None).unwrap();
        let ids: Vec<u64> = (0..500).map(|i| i * 7919 % 4001).collect();
        let whole = one.pull("emb", mark, 0, &ids).unwrap();
        // Rows of 3 floats, 100 bytes a request: 8 rows at a time.
        parts.read_bound = 100;
        assert_eq!(parts.pull("emb", mark, 0, &ids).unwrap(), whole);
        let both = parts.pull_many(&[("emb", &ids), ("emb", &ids[..3])], mark, 0).unwrap();
        assert_eq!(both, [whole.clone(), whole[..9].to_vec()]);
        // A server asked for more than it could send refuses before making
        // anything, naming the size; the connection stays in step.
        let wide = TableSpec { name: "wide".into(), dim: 1 << 16, ..spec() };
        one.declare(wide, mark, None).unwrap();
        let many = (wire::MAX_BODY / 4 / (1 << 16) + 1) as u64;
        let body = wire::encode(&(0..many).collect::<Vec<_>>(), &[]);
        let req = Request::Pull { table: "wide".into(), mark, need: 0, peek: true };
        one.servers[0].send(&req, &body).unwrap();
        let err = format!("{:#}", one.servers[0].receive().unwrap_err());
        assert!(err.contains("past the wire's bound") && err.contains("fewer rows at a time"), "{err}");
        assert_eq!(one.pull("emb", mark, 0, &ids).unwrap(), whole);
        // A request too large to send is the request's error, not a server out of reach.
        let err = one.servers[0].send(&req, &vec![0; wire::MAX_BODY + 8]).unwrap_err();
        assert!(
            err.downcast_ref::<Unreachable>().is_none()
                && format!("{err}").contains("passes the wire's bound")
        );
    }

    #[test]
    fn tables_pulled_together_read_as_each_pulled_alone_across_servers() {
        let job = job();
        let services = [start(&job, 1, Duration::from_secs(60)), start(&job, 2, Duration::from_secs(60))];
        let addrs: Vec<(u64, SocketAddr)> = vec![(1, services[0].addr()), (2, services[1].addr())];
        let mut c = Client::connect(&addrs, 1, &job, 3).unwrap();
        let mark = Mark { generation: 1, base: 0, committed: 0 };
        let wide = TableSpec { name: "wide".into(), dim: 1, seed: 9, ..spec() };
        c.declare(spec(), mark, None).unwrap();
        c.declare(wide, mark, None).unwrap();
        // Step 0 trains both tables, so that step 1's reads see its update.
        let ids = batch(0, 0);
        let tag = PushTag { mark, step: 0, rank: 0, world: 1 };
        c.push("emb", tag, &ids, &vec![1.0; ids.len() * 3]).unwrap();
        c.push("wide", tag, &ids, &vec![2.0; ids.len()]).unwrap();
        let (a, b) = (batch(1, 0), batch(2, 1));
        let many = c.pull_many(&[("emb", &a), ("wide", &b), ("emb", &[])], mark, 1).unwrap();
        let alone = [c.pull("emb", mark, 1, &a).unwrap(), c.pull("wide", mark, 1, &b).unwrap(), Vec::new()];
        assert_eq!(many, alone);
        assert_eq!((many[0].len(), many[1].len()), (a.len() * 3, b.len()));
        // Rows on both servers were read, and step 0 is in them.
        assert!(services.iter().all(|s| !s.rows("emb").is_empty()));
        let fresh = TableSpec { name: "wide".into(), dim: 1, seed: 9, ..spec() };
        let at = b.iter().position(|id| ids.contains(id)).expect("an id trained at step 0");
        let mut initial = [0.0];
        fresh.init_row(b[at], &mut initial);
        assert_ne!(many[1][at], initial[0], "step 0's push is not in the read");
        // A table not declared is refused before anything is sent.
        let err = c.pull_many(&[("emb", &a), ("nope", &a)], mark, 1).unwrap_err();
        assert!(format!("{err:#}").contains("\"nope\""), "{err:#}");
        assert_eq!(c.pull("emb", mark, 1, &a).unwrap(), many[0], "the connection is still in step");
        // A request the servers refuse (a generation they left) leaves
        // every connection in step for the next.
        let next = Mark { generation: 2, base: 1, committed: 1 };
        // (A worker may not; the job's coordinator does.)
        let e = c.enter_all(next).unwrap_err();
        assert!(format!("{e:#}").contains("worker 3 asked for entering a generation"), "{e:#}");
        Client::connect(&addrs, 1, &job, JOB_CLIENT).unwrap().enter_all(next).unwrap();
        let err = c.pull_many(&[("emb", &a), ("wide", &b)], mark, 1).unwrap_err();
        assert!(err.downcast_ref::<Superseded>().is_some(), "{err:#}");
        assert_eq!(c.pull_many(&[("emb", &a), ("wide", &b)], next, 1).unwrap(), many[..2]);
        // A pull whose body does not hold the ids it names is refused, naming the tables.
        let bad = Request::PullMany {
            tables: vec![("emb".into(), 3), ("wide".into(), 2)],
            mark: next,
            need: 1,
            peek: false,
        };
        c.servers[0].send(&bad, &wire::encode(&[1, 2, 3], &[])).unwrap();
        let err = format!("{:#}", c.servers[0].receive().unwrap_err());
        assert!(err.contains("[\"emb\", \"wide\"]") && err.contains("body is not their ids"), "{err}");
    }

    #[test]
    fn two_ranks_on_two_servers_train_as_one_process_would() {
        let job = job();
        let services = [start(&job, 1, Duration::from_secs(60)), start(&job, 2, Duration::from_secs(60))];
        let addrs: Vec<(u64, SocketAddr)> = vec![(1, services[0].addr()), (2, services[1].addr())];
        let steps = 25;
        let ranks: Vec<_> = (0..2u64)
            .map(|rank| {
                let (job, addrs) = (job.clone(), addrs.clone());
                std::thread::spawn(move || {
                    let mut c = Client::connect(&addrs, 1, &job, 10 + rank).unwrap();
                    let mark = Mark { generation: 1, base: 0, committed: 0 };
                    c.declare(spec(), mark, None).unwrap();
                    for step in 0..steps {
                        if rank == 1 && step % 3 == 0 {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        let ids = batch(step, rank);
                        let rows = c.pull("emb", mark, step, &ids).unwrap();
                        let tag = PushTag { mark, step, rank: rank as u32, world: 2 };
                        c.push("emb", tag, &ids, &grads(&rows, step)).unwrap();
                    }
                    c.stats().unwrap()
                })
            })
            .collect();
        let stats: Vec<Vec<Stats>> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
        // One process, step by step: both ranks read the rows of the step
        // before, and the sum of their gradients is applied.
        let s = spec();
        let mut shadow: HashMap<u64, Vec<f32>> = HashMap::new();
        for step in 0..steps {
            let mut sum: HashMap<u64, Vec<f32>> = HashMap::new();
            for rank in 0..2 {
                let ids = batch(step, rank);
                let rows: Vec<f32> = ids
                    .iter()
                    .flat_map(|id| {
                        shadow
                            .entry(*id)
                            .or_insert_with(|| {
                                let mut r = vec![0.0; 3];
                                s.init_row(*id, &mut r);
                                r
                            })
                            .clone()
                    })
                    .collect();
                for (id, g) in ids.iter().zip(grads(&rows, step).chunks(3)) {
                    let acc = sum.entry(*id).or_insert_with(|| vec![0.0; 3]);
                    acc.iter_mut().zip(g).for_each(|(a, b)| *a += b);
                }
            }
            for (id, g) in sum {
                shadow.get_mut(&id).unwrap().iter_mut().zip(g).for_each(|(w, g)| *w -= 0.5 * g);
            }
        }
        let mut held: HashMap<u64, Vec<f32>> = HashMap::new();
        for svc in &services {
            for (id, row) in svc.rows("emb") {
                assert!(held.insert(id, row).is_none(), "row {id} on two servers");
            }
        }
        assert_eq!(held.len(), shadow.len());
        for (id, want) in &shadow {
            let got = &held[id];
            assert!(got.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-5), "row {id}: {got:?} != {want:?}");
        }
        let last = &stats[0];
        assert!(last.iter().all(|s| s.tables[0].applied >= steps - 1), "{last:?}");
        assert!(services.iter().all(|s| s.stats().tables[0].applied == steps));
        assert!(services.iter().all(|s| s.stats().tables[0].rows > 5), "both servers hold rows");
    }

    #[test]
    fn pushes_answered_later_are_applied_before_the_next_read_and_a_refusal_shows_when_settled() {
        let job = job();
        let svc = start(&job, 5, Duration::from_secs(60));
        let mut c = Client::connect(&[(5, svc.addr())], 1, &job, 3).unwrap();
        let mut other = Client::connect(&[(5, svc.addr())], 1, &job, 4).unwrap();
        let mark = Mark { generation: 1, base: 0, committed: 0 };
        c.declare(spec(), mark, None).unwrap();
        other.declare(spec(), mark, None).unwrap();
        let before = c.pull("emb", mark, 0, &[1, 2]).unwrap();
        // Steps 0 and 1 pushed back to back, no answer read in between.
        for step in 0..2 {
            let tag = PushTag { mark, step, rank: 0, world: 1 };
            c.push_later("emb", tag, &[1, 2], &[1.0; 6]).unwrap();
        }
        // Another worker's read of step 2 sees both applied (sgd at 0.5).
        let after = other.pull("emb", mark, 2, &[1, 2]).unwrap();
        for (b, a) in before.iter().zip(&after) {
            assert!((b - 1.0 - a).abs() < 1e-6, "{before:?} -> {after:?}");
        }
        c.settle().unwrap();
        // A push of a generation the server has left is refused, at settle.
        let coordinator = Client::connect(&[(5, svc.addr())], 1, &job, JOB_CLIENT);
        coordinator.unwrap().enter_all(Mark { generation: 2, base: 2, committed: 2 }).unwrap();
        let stale = PushTag { mark, step: 2, rank: 0, world: 1 };
        c.push_later("emb", stale, &[1], &[1.0; 3]).unwrap();
        let e = c.settle().unwrap_err();
        assert!(e.downcast_ref::<Superseded>().is_some(), "{e:#}");
        // The connection still answers in step, and nothing was applied.
        let newer = Mark { generation: 2, base: 2, committed: 2 };
        assert_eq!(c.pull("emb", newer, 2, &[1, 2]).unwrap(), after);
    }

    #[test]
    fn a_pull_whose_step_never_comes_ends_with_what_it_waited_for_and_strangers_are_refused() {
        let job = job();
        let svc = start(&job, 4, Duration::from_millis(100));
        let mut c = Client::connect(&[(4, svc.addr())], 1, &job, 3).unwrap();
        let mark = Mark { generation: 1, base: 0, committed: 0 };
        c.declare(spec(), mark, None).unwrap();
        let tag = PushTag { mark, step: 0, rank: 0, world: 2 };
        c.push("emb", tag, &[1], &[0.0; 3]).unwrap();
        let e = c.pull("emb", mark, 1, &[1]).unwrap_err().to_string();
        assert!(e.contains("waited") && e.contains("step 0 has pushes from 1 of 2 ranks"), "{e}");
        let e = c.pull("nope", mark, 0, &[1]).unwrap_err().to_string();
        assert!(e.contains("\"nope\" was not declared by worker 3"), "{e}");
        let e = c.push("emb", tag, &[1, 2], &[0.0; 3]).unwrap_err().to_string();
        assert!(e.contains("3 gradient floats for 2 ids"), "{e}");
        // Still serving after the refusals, on the same connection.
        assert_eq!(c.pull("emb", mark, 0, &[1]).unwrap().len(), 3);
        let other = JobAuth { job: "ctr".into(), secret: Secret::generate().unwrap() };
        let e = Client::connect(&[(4, svc.addr())], 1, &other, 3).err().unwrap();
        assert!(format!("{e:#}").contains("parameter server 4"), "{e:#}");
        // A client of an edl that says no protocol in its claim is refused,
        // naming both.
        let mut s = TcpStream::connect(svc.addr()).unwrap();
        let e = auth::connect(&mut s, &job.secret, &job.claim(CHANNEL, 0, 5)).unwrap_err().to_string();
        assert!(e.contains("worker 5 speaks control protocol an earlier one without a number"), "{e}");
    }
}
