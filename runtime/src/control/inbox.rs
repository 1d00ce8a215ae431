//! The coordinator's side of its workers' control connections: one thread
//! accepts them, one thread reads all of them (epoll, through mio), so a
//! job of a thousand workers costs two threads, not a thousand. A host's
//! relay reads its workers' connections through the same
//! ([`start_for_relay`]).
//!
//! Connections stay blocking sockets, because the coordinator writes to them
//! with a write timeout; the reader only ever asks the kernel for what has
//! already arrived (`MSG_DONTWAIT`), draining each socket when epoll says it
//! is readable. Every complete JSON line becomes one message; a closed,
//! failed or misbehaving connection becomes one `Closed` event naming why.
//!
//! A worker sends heartbeats; a connection the reader hears nothing on for
//! the worker lease is closed as dead (its host or network went silent,
//! which TCP alone may not notice for many minutes).
//!
//! A connection counts only once its peer has proven the job's secret (a
//! short-lived thread per new connection runs the exchange, bounded by a
//! timeout); a refused one is logged with the reason and closed, and the
//! coordinator never hears of it.

use crate::control::frame::{self, Frame};
use crate::control::outbox::{Outbox, RelayOut};
use crate::control::proto::{FromWorker, Link};
use edl_host_gpu::comm::auth::{self, JobAuth};
use edl_host_gpu::comm::sealed::Opener;
use mio::{Events, Interest, Poll, Token, Waker, unix::SourceFd};
use nix::sys::socket::{self, MsgFlags};
use std::{
    collections::HashMap,
    io,
    net::{TcpListener, TcpStream},
    os::fd::AsRawFd,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
        mpsc,
    },
    time::{Duration, Instant},
};

/// A message a control connection carries: one JSON line; heartbeats only
/// keep the connection alive and are not passed on.
pub trait Message: serde::de::DeserializeOwned + Send + 'static {
    fn is_heartbeat(&self) -> bool;
    /// The worker a message says it is, where that must be the one the
    /// connection proved the secret as (a worker coming back to a new
    /// coordinator names itself in its message).
    fn names_worker(&self) -> Option<u64> {
        None
    }
}

impl Message for FromWorker {
    fn is_heartbeat(&self) -> bool {
        matches!(self, FromWorker::Heartbeat)
    }

    fn names_worker(&self) -> Option<u64> {
        match self {
            FromWorker::Return { worker, .. } => Some(*worker),
            _ => None,
        }
    }
}

/// What happens on the control connections.
pub enum Inbound<M = FromWorker> {
    /// A new connection, numbered, and what its peer proved to be; the
    /// coordinator writes to it here (a worker behind a relay is a
    /// connection of its own too).
    Conn(u64, Outbox, auth::Claim),
    Msg(u64, M),
    /// Workers of one host reported a window as one, through their relay:
    /// the relay's connection (its host's number), the workers' numbers on
    /// the relay in rank order (as the window named them), and the report.
    Host(u64, Vec<u64>, FromWorker),
    /// The connection of the relay that claimed this number ended while it
    /// carried workers, whose connections here are these (said before
    /// their ends): their processes may live on, cut off.
    RelayLost(u64, Vec<u64>),
    /// Frames the reader has for a relay (a refused worker's stop, the
    /// closing of a worker that sent a malformed line), for the coordinator
    /// to write: the reader never waits on a relay.
    ToRelay(RelayOut, Vec<Frame>),
    /// The connection ended, and why.
    Closed(u64, String),
}

/// A line longer than this is not a control message: the connection is dropped.
const MAX_LINE: usize = 64 << 20;
/// Bound on writing one control message to a worker.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(10);
const WAKE: Token = Token(usize::MAX);

/// Longest a new connection may take to prove the secret, all reads together.
const AUTH_TIMEOUT: Duration = Duration::from_secs(10);

/// Starts the accepting and the reading thread; events go to `tx`. A
/// connection silent for `lease` is closed.
/// Who may open a control connection: a process that proves the job's
/// secret and is not a worker coming back from a generation it lost.
pub struct Gate {
    auth: JobAuth,
    /// The channel connections claim (`control` for workers, `agent` for
    /// torchrun agents).
    channel: &'static str,
    /// The job's current generation (set by the coordinator as it starts each).
    generation: AtomicU64,
    /// Workers of the generation an earlier coordinator of the job ran,
    /// who may come back to this one (it took the job over).
    returning: std::sync::Mutex<Option<(u64, std::collections::BTreeSet<u64>)>>,
    /// A relay's gate: the job's secret is checked here, who may join is
    /// the coordinator's to say (the relay passes the claim on).
    relay_side: bool,
    /// The connections it refused, as the log says them.
    refusals: edl_host_gpu::comm::accept::Refusals,
}

impl Gate {
    pub fn set_generation(&self, g: u64) {
        self.generation.store(g, Ordering::Relaxed);
    }

    /// Admits `workers` of `generation`, an earlier coordinator's, coming
    /// back to this one; `None` ends that.
    pub fn expect_return(&self, workers: Option<(u64, std::collections::BTreeSet<u64>)>) {
        *self.returning.lock().unwrap_or_else(|p| p.into_inner()) = workers;
    }

    /// A new worker claims generation 0. One that names a generation was a
    /// member and lost its connection: it is out of the job (its place was
    /// or will be given up), so it is refused, saying why; unless it comes
    /// back from the coordinator this one took the job over from.
    fn check(&self, c: &auth::Claim) -> Result<(), String> {
        if self.relay_side {
            if c.channel == frame::CHANNEL {
                return Err("a relay is not taken through another relay".into());
            }
            return self.auth.check(c, self.channel, None);
        }
        if c.channel == frame::CHANNEL && self.channel == "control" {
            self.auth.check(c, frame::CHANNEL, None)?;
            // A relay's frames carry no number: its claim says it.
            return match crate::control::proto::protocol_mismatch(&format!("relay {}", c.who), c.protocol) {
                Some(why) => Err(why),
                None => Ok(()),
            };
        }
        let returning = self.returning.lock().unwrap_or_else(|p| p.into_inner());
        // A member of the last generation the store names, or of an
        // earlier one whose successor it was not told of before the loss.
        if let Some((g, ids)) = returning.as_ref()
            && (1..=*g).contains(&c.generation)
            && ids.contains(&c.who)
        {
            return self.auth.check(c, self.channel, Some(c.generation));
        }
        drop(returning);
        let now = self.generation.load(Ordering::Relaxed);
        self.auth.check(c, self.channel, (c.generation > 0).then_some(now))?;
        if c.generation > 0 {
            return Err(format!(
                "worker {} lost its connection in generation {}, the current one; a worker that lost \
                 its connection is not taken back",
                c.who, c.generation
            ));
        }
        Ok(())
    }
}

impl Gate {
    /// Checks the claim of a worker a relay admitted, as if it had come
    /// straight here (a relay behind a relay is refused).
    fn check_relayed(&self, c: &auth::Claim) -> Result<(), String> {
        if c.channel == frame::CHANNEL {
            return Err("a relay is not taken through another relay".into());
        }
        self.check(c)
    }
}

/// Starts accepting and reading control connections; the returned gate
/// is told each new generation.
pub fn start<M: Message>(
    listener: TcpListener,
    auth: JobAuth,
    lease: Duration,
    tx: mpsc::Sender<Inbound<M>>,
) -> io::Result<Arc<Gate>> {
    start_channel(listener, auth, "control", lease, tx)
}

/// As [`start`], for connections that claim `channel`.
pub fn start_channel<M: Message>(
    listener: TcpListener,
    auth: JobAuth,
    channel: &'static str,
    lease: Duration,
    tx: mpsc::Sender<Inbound<M>>,
) -> io::Result<Arc<Gate>> {
    let gate = Gate {
        auth,
        channel,
        generation: AtomicU64::new(0),
        returning: Default::default(),
        relay_side: false,
        refusals: Default::default(),
    };
    serve(listener, Arc::new(gate), lease, tx)
}

/// A host's relay's side of its workers' connections: the same two threads
/// for all of them; a worker's claim is checked for the job's secret only
/// and goes on with the connection (`Inbound::Conn`), for the coordinator
/// to admit or refuse.
pub fn start_for_relay(
    listener: TcpListener,
    auth: JobAuth,
    lease: Duration,
    tx: mpsc::Sender<Inbound>,
) -> io::Result<()> {
    let gate = Gate {
        auth,
        channel: "control",
        generation: AtomicU64::new(0),
        returning: Default::default(),
        relay_side: true,
        refusals: Default::default(),
    };
    serve(listener, Arc::new(gate), lease, tx).map(drop)
}

fn serve<M: Message>(
    listener: TcpListener,
    gate: Arc<Gate>,
    lease: Duration,
    tx: mpsc::Sender<Inbound<M>>,
) -> io::Result<Arc<Gate>> {
    let poll = Poll::new()?;
    let waker = Arc::new(Waker::new(poll.registry(), WAKE)?);
    let (new_tx, new_rx) = mpsc::channel::<Proven<M>>();
    let events = tx.clone();
    std::thread::Builder::new()
        .name("edl-control-in".into())
        .spawn(move || read_all(poll, new_rx, events, lease))?;
    let next = Arc::new(AtomicU64::new(0));
    let accepting = gate.clone();
    edl_host_gpu::comm::accept::serve_each(
        listener,
        "edl-accept",
        "control connections",
        move |conn, proving| {
            admit(conn, &accepting, lease, &next, &tx, &new_tx, &waker);
            drop(proving);
        },
    )?;
    Ok(gate)
}

/// A proven connection, handed to the reading thread.
struct Proven<M> {
    n: u64,
    stream: TcpStream,
    opener: Opener,
    kind: Kind<M>,
}

/// Who is at the other end of a connection being read.
enum Kind<M> {
    /// A worker (or agent), as it proved the secret (0: one to be given an id).
    Worker(u64),
    /// A host's relay, carrying workers.
    Relay(Box<Carried<M>>),
}

/// Runs the secret's exchange on a new connection and hands it on once proven.
fn admit<M: Message>(
    mut conn: TcpStream,
    gate: &Arc<Gate>,
    lease: Duration,
    next: &Arc<AtomicU64>,
    tx: &mpsc::Sender<Inbound<M>>,
    new_tx: &mpsc::Sender<Proven<M>>,
    waker: &Waker,
) {
    let peer = conn.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "a peer".into());

    // A send to a worker that stopped reading fails instead of blocking the
    // coordinator; keepalive notices a peer whose host went away.
    let _ = conn.set_write_timeout(Some(SEND_TIMEOUT));
    let (claim, keys) =
        match auth::accept(&mut auth::Deadline::new(&mut conn, AUTH_TIMEOUT), &gate.auth.secret, |c| {
            gate.check(c)
        }) {
            Ok(proven) => proven,
            // Closed by its peer without a word: a probe (a worker finding
            // its relay, a readiness check), nothing to warn of.
            Err(e @ auth::AuthError::Closed) => {
                tracing::debug!("a control connection from {peer} closed during the handshake: {e}");
                return;
            }
            Err(e) => {
                gate.refusals.refused("a control connection", &peer, &e);
                return;
            }
        };
    let _ = conn.set_read_timeout(None);
    let _ = conn.set_nodelay(true);
    crate::control::proto::keepalive(&conn);
    crate::control::proto::give_up_unacked(&conn, lease);
    let Ok(reader) = conn.try_clone() else { return };
    let (sealer, opener) = keys.split();
    let n = next.fetch_add(1, Ordering::Relaxed);
    let kind = if claim.channel == frame::CHANNEL {
        Kind::Relay(Box::new(Carried {
            gate: gate.clone(),
            next: next.clone(),
            tx: tx.clone(),
            peer,
            relay: claim.who,
            host: n,
            down: RelayOut::new(Link::new(conn, Some(sealer))),
            carrying: Carrying::default(),
        }))
    } else if tx.send(Inbound::Conn(n, Outbox::direct(Link::new(conn, Some(sealer))), claim.clone())).is_ok()
    {
        Kind::Worker(claim.who)
    } else {
        return;
    };
    if new_tx.send(Proven { n, stream: reader, opener, kind }).is_ok() {
        let _ = waker.wake();
    }
}

/// The workers a relay carries, as the coordinator sees them: each a
/// connection of its own, numbered as direct ones are.
struct Carried<M> {
    gate: Arc<Gate>,
    next: Arc<AtomicU64>,
    tx: mpsc::Sender<Inbound<M>>,
    peer: String,
    /// The relay's number (as it claims).
    relay: u64,
    /// This connection's number here: the host's, unique in the job.
    host: u64,
    /// Where frames to the relay go.
    down: RelayOut,
    carrying: Carrying,
}

impl<M: Message> Carried<M> {
    /// The relay's connection ended (`why`): every worker it carried is
    /// lost, said after the relay's own loss.
    fn lost(mut self, why: &str) -> Result<(), Gone> {
        let open: Vec<(u64, u64)> = self.carrying.open.drain().map(|(_, v)| v).collect();
        if open.is_empty() {
            tracing::debug!("relay {} at {} gone: {why}", self.relay, self.peer);
            return Ok(());
        }
        tracing::warn!("relay {} at {} lost with {} workers: {why}", self.relay, self.peer, open.len());
        let conns = open.iter().map(|&(n, _)| n).collect();
        self.tx.send(Inbound::RelayLost(self.relay, conns)).map_err(|_| Gone)?;
        for (n, who) in open {
            let lost = format!("worker {who}'s relay at {} was lost: {why}", self.peer);
            self.tx.send(Inbound::Closed(n, lost)).map_err(|_| Gone)?;
        }
        Ok(())
    }

    /// One frame from the relay; `Err` when the coordinator stopped listening.
    fn take(&mut self, frame: Frame) -> Result<(), Gone> {
        let carried = &mut self.carrying;
        match frame {
            Frame::Open { conn, .. } if carried.open.contains_key(&conn) || carried.ended.contains(&conn) => {
                tracing::warn!("the relay at {} opened its worker {conn} twice; ignored", self.peer);
            }
            Frame::Open { conn, claim } => match self.gate.check_relayed(&claim) {
                Err(reason) => {
                    tracing::warn!(
                        "refused a control connection through the relay at {}: {reason}",
                        self.peer
                    );
                    let stop = crate::control::proto::ToWorker::Stop { reason: reason.clone() };
                    let mut frames = Vec::new();
                    if let Ok(line) = crate::control::proto::encode(&stop) {
                        frames.push(Frame::Line { conn, line });
                    }
                    frames.push(Frame::Closed { conn, why: reason });
                    self.tx.send(Inbound::ToRelay(self.down.clone(), frames)).map_err(|_| Gone)?;
                }
                Ok(()) => {
                    let n = self.next.fetch_add(1, Ordering::Relaxed);
                    carried.open.insert(conn, (n, claim.who));
                    let name = format!("worker {} through the relay at {}", claim.who, self.peer);
                    let out = Outbox::Relayed { conn, host: self.host, relay: self.down.clone(), name };
                    self.tx.send(Inbound::Conn(n, out, claim)).map_err(|_| Gone)?;
                }
            },
            Frame::Line { conn, line } => {
                // Lines of a worker already dropped are dropped too.
                let Some(&(n, who)) = carried.open.get(&conn) else { return Ok(()) };
                let msg = serde_json::from_slice::<M>(line.trim_ascii_end())
                    .map_err(|e| format!("malformed message: {e}"))
                    .and_then(|m| match m.names_worker() {
                        Some(named) if named != who => {
                            Err(format!("says it is worker {named}, but proved the secret as worker {who}"))
                        }
                        _ => Ok(m),
                    });
                match msg {
                    Ok(m) if m.is_heartbeat() => {}
                    Ok(m) => self.tx.send(Inbound::Msg(n, m)).map_err(|_| Gone)?,
                    Err(why) => {
                        carried.close(conn);
                        let closing = vec![Frame::Closed { conn, why: why.clone() }];
                        self.tx.send(Inbound::ToRelay(self.down.clone(), closing)).map_err(|_| Gone)?;
                        let why = format!("worker {who} through the relay at {}: {why}", self.peer);
                        self.tx.send(Inbound::Closed(n, why)).map_err(|_| Gone)?;
                    }
                }
            }
            Frame::Closed { conn, why } => {
                if let Some(n) = carried.close(conn) {
                    self.tx
                        .send(Inbound::Closed(n, format!("{why} (through the relay at {})", self.peer)))
                        .map_err(|_| Gone)?;
                }
            }
            // Which ranks it names is the coordinator's to check, against
            // the window it sent (a comparison, not a look-up per rank).
            Frame::Done(h) => self.tx.send(Inbound::Host(self.host, h.conns, h.done)).map_err(|_| Gone)?,
            Frame::Window(_) | Frame::Fan { .. } | Frame::Generation(_) => {
                tracing::warn!("the relay at {} sent a frame only the coordinator sends; ignored", self.peer);
            }
            Frame::Beat => {}
        }
        Ok(())
    }
}

/// A relay's workers: their numbers on the relay, their numbers here and
/// who they proved to be.
#[derive(Default)]
struct Carrying {
    open: HashMap<u64, (u64, u64)>,
    /// Those whose connection ended: a number is not opened twice.
    ended: std::collections::HashSet<u64>,
}

impl Carrying {
    /// Worker `conn`'s connection ended: its number here, if it was open.
    fn close(&mut self, conn: u64) -> Option<u64> {
        let (n, _) = self.open.remove(&conn)?;
        self.ended.insert(conn);
        Some(n)
    }
}

/// One connection being read: its socket, who it is, the bytes of a line
/// (or a relay's frame) not complete yet.
struct Open<M> {
    stream: TcpStream,
    /// Opens what the peer sealed.
    opener: Opener,
    peer: String,
    kind: Kind<M>,
    pending: Vec<u8>,
    /// How much of `pending` is known to hold no line end: a line that comes
    /// in many reads is scanned once, not from its start at each.
    scanned: usize,
    /// When something last arrived.
    heard: Instant,
}

impl<M: Message> Open<M> {
    /// The connection ended (`why`): the coordinator hears of it (of a
    /// relay's, as the loss of every worker it carried).
    fn end(self, n: u64, why: String, tx: &mpsc::Sender<Inbound<M>>) -> Result<(), Gone> {
        match self.kind {
            Kind::Worker(_) => tx.send(Inbound::Closed(n, format!("{}: {why}", self.peer))).map_err(|_| Gone),
            Kind::Relay(carried) => {
                // Writes to it fail from now on, and the relay sees the end.
                let _ = self.stream.shutdown(std::net::Shutdown::Both);
                carried.lost(&why)
            }
        }
    }
}

/// How the end of a connection silent for its lease begins: the peer may
/// live on (hung, frozen), unlike one that hung up.
pub const SILENT: &str = "no heartbeat for";

/// The thread that reads every control connection.
struct ReadAll<M: Message> {
    poll: Poll,
    /// Connections the acceptor hands over.
    new: mpsc::Receiver<Proven<M>>,
    tx: mpsc::Sender<Inbound<M>>,
    /// A connection silent for this long is closed.
    lease: Duration,
    open: HashMap<u64, Open<M>>,
    buf: Vec<u8>,
}

/// The coordinator stopped listening: the reader ends.
struct Gone;

fn read_all<M: Message>(
    poll: Poll,
    new: mpsc::Receiver<Proven<M>>,
    tx: mpsc::Sender<Inbound<M>>,
    lease: Duration,
) {
    let mut reader = ReadAll { poll, new, tx, lease, open: HashMap::new(), buf: vec![0u8; 64 << 10] };
    let _ = reader.run();
}

impl<M: Message> ReadAll<M> {
    fn run(&mut self) -> Result<(), Gone> {
        let mut events = Events::with_capacity(1024);
        let sweep_every = (self.lease / 4).max(Duration::from_millis(10));
        let mut last_sweep = Instant::now();
        loop {
            if last_sweep.elapsed() >= sweep_every {
                last_sweep = Instant::now();
                self.close_silent()?;
            }
            if let Err(e) = self.poll.poll(&mut events, Some(sweep_every)) {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                tracing::error!("control connections: {e}");
                return Err(Gone);
            }
            for ev in events.iter() {
                if ev.token() == WAKE {
                    self.watch_new()?;
                } else {
                    self.read(ev.token().0 as u64)?;
                }
            }
        }
    }

    /// Closes the connections nothing arrived on (not even a heartbeat)
    /// within the lease.
    fn close_silent(&mut self) -> Result<(), Gone> {
        // One with bytes waiting spoke: this thread was late to read them
        // (epoll says so next), it was not silent.
        let silent: Vec<u64> = self
            .open
            .iter()
            .filter(|(_, c)| c.heard.elapsed() > self.lease && !has_bytes_waiting(&c.stream))
            .map(|(n, _)| *n)
            .collect();
        for n in silent {
            let Some(c) = self.open.remove(&n) else { continue };
            let fd = c.stream.as_raw_fd();
            let _ = self.poll.registry().deregister(&mut SourceFd(&fd));
            // Writes to it fail from now on, and the peer, if it comes back,
            // finds the connection gone.
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
            let why = format!(
                "{SILENT} {:.1} s (its host or network went silent)",
                c.heard.elapsed().as_secs_f64()
            );
            c.end(n, why, &self.tx)?;
        }
        Ok(())
    }

    /// Watches the connections the acceptor handed over.
    fn watch_new(&mut self) -> Result<(), Gone> {
        while let Ok(Proven { n, stream, opener, kind }) = self.new.try_recv() {
            let fd = stream.as_raw_fd();
            let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "peer".into());
            let conn =
                Open { stream, opener, peer, kind, pending: Vec::new(), scanned: 0, heard: Instant::now() };
            let added =
                self.poll.registry().register(&mut SourceFd(&fd), Token(n as usize), Interest::READABLE);
            if let Err(e) = added {
                conn.end(n, format!("cannot watch the connection: {e}"), &self.tx)?;
                continue;
            }
            self.open.insert(n, conn);
        }
        Ok(())
    }

    /// Reads what arrived on connection `n`; one that failed is closed.
    fn read(&mut self, n: u64) -> Result<(), Gone> {
        let Some(conn) = self.open.get_mut(&n) else { return Ok(()) };
        let Err(why) = drain(conn, &mut self.buf, n, &self.tx) else { return Ok(()) };
        let Some(conn) = self.open.remove(&n) else { return Ok(()) };
        let fd = conn.stream.as_raw_fd();
        let _ = self.poll.registry().deregister(&mut SourceFd(&fd));
        conn.end(n, why, &self.tx)
    }
}

/// Whether something has arrived on `stream` that is not read yet.
fn has_bytes_waiting(stream: &TcpStream) -> bool {
    let mut byte = [0u8; 1];
    // MSG_PEEK leaves it in the socket, MSG_DONTWAIT returns at once.
    let flags = MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT;
    socket::recv(stream.as_raw_fd(), &mut byte, flags).is_ok_and(|got| got > 0)
}

/// Takes what has already arrived on `stream` into `buf`, without waiting
/// (the socket stays blocking for its writers): the bytes taken, 0 when the
/// peer closed the connection, `WouldBlock` when nothing is there.
pub fn recv_arrived(stream: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        match socket::recv(stream.as_raw_fd(), buf, MsgFlags::MSG_DONTWAIT) {
            Ok(got) => return Ok(got.min(buf.len())),
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// Reads what has arrived on `conn` (edge-triggered: until the kernel has
/// nothing more) and passes on each complete line or frame; an error ends
/// the connection.
fn drain<M: Message>(
    conn: &mut Open<M>,
    buf: &mut [u8],
    n: u64,
    tx: &mpsc::Sender<Inbound<M>>,
) -> Result<(), String> {
    conn.heard = Instant::now();
    loop {
        let got = match recv_arrived(&conn.stream, buf) {
            Ok(0) => return Err("connection closed".into()),
            Ok(got) => got,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) => return Err(e.to_string()),
        };
        conn.opener.open(&buf[..got], &mut conn.pending).map_err(|e| e.to_string())?;
        match &mut conn.kind {
            Kind::Worker(who) => take_lines(&mut conn.pending, &mut conn.scanned, *who, n, tx)?,
            Kind::Relay(carried) => {
                let mut at = 0;
                while let Some((frame, len)) = Frame::first(&conn.pending[at..]).map_err(|e| e.to_string())? {
                    at += len;
                    carried.take(frame).map_err(|Gone| "the coordinator stopped".to_string())?;
                }
                conn.pending.drain(..at);
            }
        }
    }
}

/// Passes on each complete line of `pending` (worker `who`'s, on connection
/// `n`) and keeps the rest.
fn take_lines<M: Message>(
    pending: &mut Vec<u8>,
    scanned: &mut usize,
    who: u64,
    n: u64,
    tx: &mpsc::Sender<Inbound<M>>,
) -> Result<(), String> {
    let mut start = 0;
    while let Some(end) = pending[start.max(*scanned)..].iter().position(|&b| b == b'\n') {
        let end = start.max(*scanned) + end - start;
        *scanned = 0;
        let line = &pending[start..start + end];
        start += end + 1;
        let msg = serde_json::from_slice::<M>(line).map_err(|e| format!("malformed message: {e}"))?;
        if msg.is_heartbeat() {
            // Hearing it was the point; the coordinator need not.
            continue;
        }
        if let Some(named) = msg.names_worker()
            && named != who
        {
            return Err(format!("says it is worker {named}, but proved the secret as worker {who}"));
        }
        if tx.send(Inbound::Msg(n, msg)).is_err() {
            return Err("the coordinator stopped".into());
        }
    }
    pending.drain(..start);
    *scanned = pending.len();
    if pending.len() > MAX_LINE {
        return Err(format!("a message longer than {} MiB", MAX_LINE >> 20));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use edl_host_gpu::comm::sealed::SealedStream;
    use std::io::Write;

    fn next(rx: &mpsc::Receiver<Inbound>) -> Inbound {
        rx.recv_timeout(Duration::from_secs(30)).expect("an event")
    }

    fn job() -> JobAuth {
        JobAuth { job: "j".into(), secret: auth::Secret::generate().unwrap() }
    }

    /// Control connections of a new job on a free loopback port: its
    /// address, events, gate and secret.
    fn serve(lease: Duration) -> (std::net::SocketAddr, mpsc::Receiver<Inbound>, Arc<Gate>, JobAuth) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = mpsc::channel();
        let a = job();
        let gate = start(listener, a.clone(), lease, tx).unwrap();
        (addr, rx, gate, a)
    }

    /// Connects and proves `auth` for worker `who`.
    fn connect(addr: std::net::SocketAddr, a: &JobAuth, who: u64) -> Result<SealedStream, auth::AuthError> {
        let mut s = TcpStream::connect(addr).unwrap();
        let keys = auth::connect(&mut s, &a.secret, &a.claim("control", 0, who))?;
        Ok(SealedStream::new(s, Some(keys)).unwrap())
    }

    #[test]
    fn only_connections_that_prove_the_job_s_secret_reach_the_coordinator() {
        let (addr, rx, _, a) = serve(Duration::from_secs(3600));
        let stranger = job();
        assert_eq!(connect(addr, &stranger, 1).unwrap_err(), auth::AuthError::WrongSecret);
        let other_job = JobAuth { job: "other".into(), ..a.clone() };
        let e = connect(addr, &other_job, 1).unwrap_err();
        assert_eq!(e, auth::AuthError::Refused("this is job \"j\", not \"other\"".into()));
        // A peer that says nothing (or speaks another protocol) is not a connection either.
        let mut silent = TcpStream::connect(addr).unwrap();
        silent.write_all(b"{\"hello\":{\"worker\":7,\"pid\":42}}\n").unwrap();
        let _ok = connect(addr, &a, 2).unwrap();
        match next(&rx) {
            Inbound::Conn(0, ..) => {}
            _ => panic!("the proven connection, and it alone"),
        }
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err(), "nothing else was admitted");
    }

    #[test]
    fn a_worker_coming_back_from_a_generation_it_lost_is_refused_and_a_new_one_admitted() {
        let (addr, rx, gate, a) = serve(Duration::from_secs(3600));
        gate.set_generation(7);
        let back = |generation: u64| {
            let mut s = TcpStream::connect(addr).unwrap();
            auth::connect(&mut s, &a.secret, &a.claim("control", generation, 3)).map(|_| s)
        };
        let e = back(5).unwrap_err();
        assert_eq!(e, auth::AuthError::Refused("generation 5 is over (the job is at 7)".into()));
        // Before the coordinator has moved on: out all the same.
        let e = back(7).unwrap_err().to_string();
        assert!(e.contains("worker 3 lost its connection in generation 7"), "{e}");
        // A new worker (generation 0) comes in, and it alone.
        let _ok = back(0).unwrap();
        assert!(matches!(next(&rx), Inbound::Conn(0, ..)));
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err(), "nothing else was admitted");
    }

    /// A relay proves the job's secret and says the protocol it speaks in
    /// its claim: one that says none (an edl before the number) or another
    /// is refused, naming both.
    #[test]
    fn a_relay_speaking_another_protocol_is_refused_naming_both() {
        let (addr, rx, _, a) = serve(Duration::from_secs(3600));
        let relay = |claim: auth::Claim| {
            let mut s = TcpStream::connect(addr).unwrap();
            auth::connect(&mut s, &a.secret, &claim).map(|keys| SealedStream::new(s, Some(keys)).unwrap())
        };
        let plain = a.claim(frame::CHANNEL, 0, 4);
        let e = relay(plain.clone()).unwrap_err().to_string();
        assert!(e.contains("relay 4 speaks control protocol an earlier one without a number"), "{e}");
        assert!(e.contains(crate::control::proto::ONE_VERSION), "{e}");
        let newer = crate::control::proto::PROTOCOL + 1;
        let e = relay(plain.clone().speaking(newer)).unwrap_err().to_string();
        assert!(e.contains(&format!("relay 4 speaks control protocol {newer}")), "{e}");
        // One that speaks this edl's is admitted: the worker it opens
        // reaches the coordinator.
        let mut ok = relay(plain.speaking(crate::control::proto::PROTOCOL)).unwrap();
        ok.write_all(&framed(&[Frame::Open { conn: 1, claim: a.claim("control", 0, 7) }])).unwrap();
        assert!(matches!(next(&rx), Inbound::Conn(..)), "the relay's worker");
    }

    /// A relay's inbox admits any worker that proves the secret, a worker
    /// coming back from a generation among them, and passes its claim on
    /// for the coordinator to judge; it refuses a relay behind it.
    #[test]
    fn a_relay_s_inbox_checks_the_secret_and_passes_the_claim_on() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = mpsc::channel();
        let a = job();
        start_for_relay(listener, a.clone(), Duration::from_secs(3600), tx).unwrap();
        let claim = |channel: &str, generation, who| {
            let mut s = TcpStream::connect(addr).unwrap();
            auth::connect(&mut s, &a.secret, &a.claim(channel, generation, who)).map(|_| s)
        };
        let e = claim(frame::CHANNEL, 0, 9).unwrap_err().to_string();
        assert!(e.contains("a relay is not taken through another relay"), "{e}");
        assert!(matches!(claim("agent", 0, 9).unwrap_err(), auth::AuthError::Refused(_)));
        let stranger = job();
        let mut s = TcpStream::connect(addr).unwrap();
        let e = auth::connect(&mut s, &stranger.secret, &stranger.claim("control", 0, 9)).unwrap_err();
        assert_eq!(e, auth::AuthError::WrongSecret);
        let _back = claim("control", 5, 3).unwrap();
        let Inbound::Conn(0, Outbox::Direct(_), c) = next(&rx) else { panic!("the worker's connection") };
        assert_eq!((c.generation, c.who), (5, 3), "its claim, as it proved it");
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err(), "nothing else was admitted");
    }

    #[test]
    fn a_connection_silent_for_a_lease_is_closed_and_heartbeats_keep_another_open() {
        // A lease of 40 heartbeats: a loaded machine that starves the
        // beating thread for a while does not make it look silent.
        let (addr, rx, _, a) = serve(Duration::from_secs(4));
        let mut beating = connect(addr, &a, 1).unwrap();
        assert!(matches!(next(&rx), Inbound::Conn(0, ..)));
        // Beating from the start, before the silent one connects.
        let (stop, stopped) = mpsc::channel::<()>();
        let beats = std::thread::spawn(move || {
            loop {
                beating.write_all(b"\"heartbeat\"\n").unwrap();
                if !matches!(
                    stopped.recv_timeout(Duration::from_millis(100)),
                    Err(mpsc::RecvTimeoutError::Timeout)
                ) {
                    break;
                }
            }
        });
        let mut silent = connect(addr, &a, 2).unwrap();
        assert!(matches!(next(&rx), Inbound::Conn(1, ..)));
        // The first event is the silent one's end: heartbeats are not passed
        // on, and the connection that sends them stays.
        match next(&rx) {
            Inbound::Closed(1, why) => assert!(why.contains("no heartbeat for"), "{why}"),
            Inbound::Closed(n, why) => panic!("connection {n} closed first: {why}"),
            _ => panic!("the silent connection closed first"),
        }
        // Its peer finds the connection shut.
        let mut buf = [0u8; 8];
        assert_eq!(std::io::Read::read(&mut silent, &mut buf).unwrap_or(0), 0);
        drop(stop);
        beats.join().unwrap();
    }

    #[test]
    fn every_connection_is_read_by_one_thread_line_by_line_and_a_bad_line_closes_it() {
        let (addr, rx, _, a) = serve(Duration::from_secs(3600));
        let mut conns = Vec::new();
        for i in 0..50 {
            conns.push(connect(addr, &a, i).unwrap());
            match next(&rx) {
                Inbound::Conn(n, ..) => assert_eq!(n, i),
                _ => panic!("a connection first"),
            };
        }
        // A message in two writes, then two in one, on the last connection.
        let hello = b"{\"hello\":{\"worker\":7,\"pid\":42}}\n";
        let last = conns.last_mut().unwrap();
        last.write_all(&hello[..9]).unwrap();
        last.write_all(&hello[9..]).unwrap();
        last.write_all(b"{\"ready\":{}}\n{\"ready\":{\"samples\":9}}\n").unwrap();
        let mut got = Vec::new();
        for _ in 0..3 {
            match next(&rx) {
                Inbound::Msg(n, m) => got.push((n, format!("{m:?}"))),
                _ => panic!("messages"),
            }
        }
        assert_eq!(got[0], (49, "Hello { worker: 7, pid: 42, protocol: 0 }".to_string()));
        let ready = |s: &str| (49, format!("Ready {{ samples: {s} }}"));
        assert_eq!(got[1..], [ready("None"), ready("Some(9)")]);
        // A line that is not a message ends that connection, naming why.
        conns[3].write_all(b"{not json\n").unwrap();
        match next(&rx) {
            Inbound::Closed(3, why) => assert!(why.contains("malformed message"), "{why}"),
            _ => panic!("connection 3 closed"),
        }
        // A frame not sealed with the connection's keys (forged on the
        // way, or a peer that skips the encryption) ends it too.
        let mut forged = 29u16.to_be_bytes().to_vec();
        forged.extend_from_slice(b"{\"ready\":{}}\n0123456789abcdef");
        conns[5].writer.get_mut().write_all(&forged).unwrap();
        match next(&rx) {
            Inbound::Closed(5, why) => assert!(why.contains("failed its authentication"), "{why}"),
            _ => panic!("connection 5 closed"),
        }
        // A peer that goes away is a closed connection.
        drop(conns.remove(10));
        match next(&rx) {
            Inbound::Closed(10, why) => assert!(why.ends_with("connection closed"), "{why}"),
            _ => panic!("connection 10 closed"),
        }
    }

    #[test]
    fn a_worker_coming_back_may_name_itself_only() {
        let (addr, rx, gate, a) = serve(Duration::from_secs(3600));
        gate.set_generation(2);
        gate.expect_return(Some((1, std::collections::BTreeSet::from([3, 4]))));
        let back = |who: u64| {
            let mut s = TcpStream::connect(addr).unwrap();
            let keys = auth::connect(&mut s, &a.secret, &a.claim("control", 1, who)).unwrap();
            SealedStream::new(s, Some(keys)).unwrap()
        };
        let says = |worker: u64| {
            let mut line =
                serde_json::to_vec(&FromWorker::Return { worker, pid: 1, rollback: vec![5], protocol: 1 })
                    .unwrap();
            line.push(b'\n');
            line
        };
        let mut honest = back(3);
        assert!(matches!(next(&rx), Inbound::Conn(0, ..)));
        honest.write_all(&says(3)).unwrap();
        match next(&rx) {
            Inbound::Msg(0, FromWorker::Return { worker: 3, .. }) => {}
            _ => panic!("worker 3's return"),
        }
        // Worker 4 proved the secret as itself and claims to be worker 3.
        let mut liar = back(4);
        assert!(matches!(next(&rx), Inbound::Conn(1, ..)));
        liar.write_all(&says(3)).unwrap();
        match next(&rx) {
            Inbound::Closed(1, why) => assert!(why.contains("says it is worker 3, but proved"), "{why}"),
            _ => panic!("the liar's connection closed"),
        }
    }

    /// The bytes of `frames` as a relay writes them.
    fn framed(frames: &[Frame]) -> Vec<u8> {
        let mut b = Vec::new();
        frames.iter().for_each(|f| f.encode(&mut b));
        b
    }

    #[test]
    fn a_relay_s_workers_are_connections_of_their_own_and_are_lost_with_its_silence() {
        let (addr, rx, gate, a) = serve(Duration::from_secs(3));
        gate.set_generation(3);
        let mut relay = {
            let mut s = TcpStream::connect(addr).unwrap();
            let claim = a.claim(frame::CHANNEL, 0, 1).speaking(crate::control::proto::PROTOCOL);
            let keys = auth::connect(&mut s, &a.secret, &claim).unwrap();
            SealedStream::new(s, Some(keys)).unwrap()
        };
        // Two new workers, and one that lost its place in generation 3.
        let opens = [(10, 0, 7), (11, 0, 8), (12, 3, 9)]
            .map(|(conn, generation, who)| Frame::Open { conn, claim: a.claim("control", generation, who) });
        relay.write_all(&framed(&opens)).unwrap();
        let (n7, mut to7, n8) = match (next(&rx), next(&rx)) {
            (Inbound::Conn(n7, to7, _), Inbound::Conn(n8, ..)) => (n7, to7, n8),
            _ => panic!("two connections"),
        };
        assert_ne!(n7, n8);
        // The refused one is told why, and closed: the reader hands the
        // frames to the coordinator, which writes them to the relay.
        match next(&rx) {
            Inbound::ToRelay(out, frames) => out.send(&frames).unwrap(),
            _ => panic!("frames for the relay"),
        }
        match Frame::read(&mut relay).unwrap() {
            Some(Frame::Line { conn: 12, line }) => {
                assert!(String::from_utf8_lossy(&line).contains("lost its connection in generation 3"))
            }
            f => panic!("the refused worker's stop, not {f:?}"),
        }
        assert!(matches!(Frame::read(&mut relay).unwrap(), Some(Frame::Closed { conn: 12, .. })));
        // The coordinator writes to a worker as to any connection; the relay gets it for its number.
        to7.send(&crate::control::proto::ToWorker::Stop { reason: "done".into() }).unwrap();
        match Frame::read(&mut relay).unwrap() {
            Some(Frame::Line { conn: 10, line }) => assert!(String::from_utf8_lossy(&line).contains("done")),
            f => panic!("worker 7's line, not {f:?}"),
        }
        // A worker's line arrives as its connection's message; a heartbeat does not.
        let lines = [(11, "\"heartbeat\"\n"), (11, "{\"ready\":{}}\n")]
            .map(|(conn, l)| Frame::Line { conn, line: l.as_bytes().to_vec() });
        relay.write_all(&framed(&lines)).unwrap();
        assert!(matches!(next(&rx), Inbound::Msg(n, FromWorker::Ready { .. }) if n == n8));
        // A worker whose line is not a message is closed, here and (through
        // the coordinator) on the relay.
        relay.write_all(&framed(&[Frame::Open { conn: 13, claim: a.claim("control", 0, 10) }])).unwrap();
        let Inbound::Conn(n10, ..) = next(&rx) else { panic!("worker 10's connection") };
        relay.write_all(&framed(&[Frame::Line { conn: 13, line: b"{not json\n".to_vec() }])).unwrap();
        match next(&rx) {
            Inbound::ToRelay(out, frames) => {
                assert!(matches!(frames[..], [Frame::Closed { conn: 13, .. }]), "{frames:?}");
                out.send(&frames).unwrap();
            }
            _ => panic!("its closing, for the relay"),
        }
        match next(&rx) {
            Inbound::Closed(n, why) => assert!(n == n10 && why.contains("malformed message"), "{why}"),
            _ => panic!("worker 10 closed"),
        }
        assert!(matches!(Frame::read(&mut relay).unwrap(), Some(Frame::Closed { conn: 13, .. })));
        // Then silence for the lease: the relay is lost, and both its other workers.
        assert!(matches!(next(&rx), Inbound::RelayLost(1, _)));
        let mut lost = Vec::new();
        for _ in 0..2 {
            match next(&rx) {
                Inbound::Closed(n, why) => {
                    assert!(why.contains("relay at") && why.contains("no heartbeat for"), "{why}");
                    lost.push(n);
                }
                _ => panic!("the relay's workers closed"),
            }
        }
        lost.sort();
        assert_eq!(lost, [n7.min(n8), n7.max(n8)]);
        // Its connection is shut: the relay sees the end, writes to it fail.
        assert!(!matches!(Frame::read(&mut relay), Ok(Some(_))));
        assert!(to7.send(&crate::control::proto::ToWorker::Stop { reason: "late".into() }).is_err());
    }

    #[test]
    fn a_peer_that_trickles_its_handshake_is_cut_off_at_the_handshake_s_deadline() {
        use std::io::Read;
        let (addr, rx, _, a) = serve(Duration::from_secs(3600));
        let mut slow = std::net::TcpStream::connect(addr).unwrap();
        // A frame of 4000 bytes announced, then a byte every 200 ms: each
        // read gets something long before a per-read timeout.
        slow.write_all(&4000u32.to_le_bytes()).unwrap();
        let started = Instant::now();
        let cut = loop {
            std::thread::sleep(Duration::from_millis(200));
            if slow.write_all(b"x").is_err() {
                break true;
            }
            slow.set_nonblocking(true).unwrap();
            let mut buf = [0u8; 64];
            let closed = loop {
                match slow.read(&mut buf) {
                    Ok(0) => break true,
                    Ok(_) => continue, // the acceptor's hello
                    Err(_) => break false,
                }
            };
            slow.set_nonblocking(false).unwrap();
            // Bounded: a handshake has AUTH_TIMEOUT; this waits three times that.
            if closed || started.elapsed() > 3 * AUTH_TIMEOUT {
                break closed;
            }
        };
        assert!(cut, "a trickling peer held its handshake for {:?}", started.elapsed());
        // It never became a connection; a real worker still gets in.
        let _ok = connect(addr, &a, 1).unwrap();
        assert!(matches!(next(&rx), Inbound::Conn(0, ..)));
    }
}
