//! A host's relay: the workers of one host reach the coordinator through one
//! connection instead of one each, so the coordinator's connections, reads,
//! writes, wake-ups and sealing per window are O(hosts), not O(ranks).
//!
//! The relay proves the job's secret to the coordinator on the `relay`
//! channel, and accepts its host's workers exactly as the coordinator would
//! (the secret's exchange on the `control` channel, each connection sealed
//! with keys of its own). It passes each worker's claim on, so the
//! coordinator's gate decides who is admitted (a worker that lost its place
//! is refused as before); it passes the workers' lines on whole, unread
//! except for heartbeats, which it keeps: it closes a worker silent for the
//! lease itself, and the coordinator hears of the closing. Lines that arrive
//! together go in one sealed write, and the coordinator's lines to the host
//! come the same way; each is written to its worker as it would have been
//! directly. A worker cannot tell a relay from the coordinator.
//!
//! The relay is a host's single point of failure, as the host is: when its
//! connection to the coordinator ends, every worker it carried is lost (the
//! coordinator recovers them as a host's loss); when the coordinator's side
//! ends, the relay closes its workers' connections and exits.
//!
//! Frames between relay and coordinator, inside the sealed channel: a kind
//! byte, the connection's number on the relay (u64, little-endian), the
//! payload's length (u32) and the payload.

use crate::control::hostwindow::{Gatherings, HostDone, HostGeneration, HostWindow, Up};
use crate::control::proto::{FromWorker, encode};
use edl_host_gpu::comm::auth::{self, Claim, JobAuth};
use edl_host_gpu::comm::sealed::{SealedReader, SealedWriter};
use std::{
    collections::HashMap,
    io::{self, BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
        mpsc,
    },
    time::{Duration, Instant},
};

/// The channel a relay claims on the coordinator's control port.
pub const CHANNEL: &str = "relay";

/// The relay to the coordinator: a worker proved the secret with this claim.
const OPEN: u8 = 1;
/// A line between a worker and the coordinator (either way).
const LINE: u8 = 2;
/// The relay to the coordinator: a worker's connection ended, and why (the
/// coordinator to the relay: close it).
const CLOSED: u8 = 3;
/// The relay to the coordinator: it is alive.
const BEAT: u8 = 4;
/// The coordinator to the relay: a window for consecutive ranks of its host.
const WINDOW: u8 = 5;
/// The relay to the coordinator: such a window, reported by all its ranks as one.
const DONE: u8 = 6;
/// The coordinator to the relay: one line for several of its workers.
const FAN: u8 = 7;
/// The coordinator to the relay: a new generation for consecutive ranks of its host.
const GENERATION: u8 = 8;

/// A frame's payload may not exceed this (a control line's own bound).
const MAX_PAYLOAD: usize = 64 << 20;
/// Longest a worker may take to prove the secret to the relay.
const AUTH_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on writing one line to a worker, or a batch to the coordinator.
const SEND_TIMEOUT: Duration = Duration::from_secs(10);

/// One frame between relay and coordinator.
#[derive(Debug, PartialEq)]
pub enum Frame {
    Open { conn: u64, claim: Claim },
    Line { conn: u64, line: Vec<u8> },
    Closed { conn: u64, why: String },
    Beat,
    Window(Box<HostWindow>),
    Done(Box<HostDone>),
    Fan { conns: Vec<u64>, line: Vec<u8> },
    Generation(Box<HostGeneration>),
}

impl Frame {
    /// Appends the frame, as it goes on the wire, to `out`.
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        let (kind, conn, payload): (u8, u64, std::borrow::Cow<[u8]>) = match self {
            Frame::Open { conn, claim } => {
                (OPEN, *conn, serde_json::to_vec(claim).expect("a claim always encodes").into())
            }
            Frame::Line { conn, line } => (LINE, *conn, line.as_slice().into()),
            Frame::Closed { conn, why } => (CLOSED, *conn, why.as_bytes().into()),
            Frame::Beat => (BEAT, 0, (&[][..]).into()),
            Frame::Window(w) => (WINDOW, 0, serde_json::to_vec(w).expect("a window always encodes").into()),
            Frame::Generation(g) => {
                (GENERATION, 0, serde_json::to_vec(g).expect("a generation always encodes").into())
            }
            Frame::Done(d) => (DONE, 0, serde_json::to_vec(d).expect("a report always encodes").into()),
            Frame::Fan { conns, line } => {
                let mut p = Vec::with_capacity(4 + 8 * conns.len() + line.len());
                p.extend_from_slice(&(conns.len() as u32).to_le_bytes());
                conns.iter().for_each(|c| p.extend_from_slice(&c.to_le_bytes()));
                p.extend_from_slice(line);
                (FAN, 0, p.into())
            }
        };
        out.push(kind);
        out.extend_from_slice(&conn.to_le_bytes());
        out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        out.extend_from_slice(&payload);
    }

    /// The first frame of `bytes` and its length on the wire, once it has
    /// all arrived (`Ok(None)` until then); a frame announcing more than
    /// the bound is refused at its head.
    pub fn first(bytes: &[u8]) -> io::Result<Option<(Frame, usize)>> {
        let Some(head) = bytes.get(..13) else { return Ok(None) };
        let len = u32::from_le_bytes(head[9..13].try_into().expect("4 bytes")) as usize;
        if len > MAX_PAYLOAD {
            return Err(bad(format!("a frame of {len} bytes (at most {MAX_PAYLOAD})")));
        }
        let Some(whole) = bytes.get(..13 + len) else { return Ok(None) };
        let frame = Frame::read(&mut &whole[..])?.expect("a whole frame is there");
        Ok(Some((frame, whole.len())))
    }

    /// The next frame; `Ok(None)` at a clean end between frames.
    pub fn read(r: &mut impl Read) -> io::Result<Option<Frame>> {
        let mut head = [0u8; 13];
        match r.read(&mut head[..1])? {
            0 => return Ok(None),
            _ => r.read_exact(&mut head[1..])?,
        }
        let conn = u64::from_le_bytes(head[1..9].try_into().expect("8 bytes"));
        let len = u32::from_le_bytes(head[9..13].try_into().expect("4 bytes")) as usize;
        if len > MAX_PAYLOAD {
            return Err(bad(format!("a frame of {len} bytes (at most {MAX_PAYLOAD})")));
        }
        let mut payload = vec![0u8; len];
        r.read_exact(&mut payload)?;
        let text = |p: Vec<u8>| String::from_utf8(p).map_err(|_| bad("a frame's text is not UTF-8".into()));
        Ok(Some(match head[0] {
            OPEN => Frame::Open {
                conn,
                claim: serde_json::from_slice(&payload).map_err(|e| bad(format!("a worker's claim: {e}")))?,
            },
            LINE => Frame::Line { conn, line: payload },
            CLOSED => Frame::Closed { conn, why: text(payload)? },
            BEAT => Frame::Beat,
            GENERATION => Frame::Generation(
                serde_json::from_slice(&payload).map_err(|e| bad(format!("a host's generation: {e}")))?,
            ),
            WINDOW => Frame::Window(
                serde_json::from_slice(&payload).map_err(|e| bad(format!("a host's window: {e}")))?,
            ),
            DONE => Frame::Done(
                serde_json::from_slice(&payload).map_err(|e| bad(format!("a host's report: {e}")))?,
            ),
            FAN => {
                let n = payload.get(..4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize);
                let at = n.and_then(|n| n.checked_mul(8)).map(|b| b + 4).filter(|&at| at <= payload.len());
                let (Some(n), Some(at)) = (n, at) else { return Err(bad("a fan frame cut short".into())) };
                let conns = (0..n)
                    .map(|i| u64::from_le_bytes(payload[4 + 8 * i..12 + 8 * i].try_into().expect("8 bytes")))
                    .collect();
                Frame::Fan { conns, line: payload[at..].to_vec() }
            }
            k => return Err(bad(format!("a frame of unknown kind {k}"))),
        }))
    }
}

fn bad(detail: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, detail)
}

/// Writes every frame queued on `rx` to `out`, each burst in one write,
/// until every sender is gone or a write fails; a frame waited for longer
/// than `beat` is replaced by a heartbeat when `beat` is given.
pub fn write_batches(
    rx: mpsc::Receiver<Frame>,
    out: &mut impl Write,
    beat: Option<Duration>,
) -> io::Result<()> {
    let mut buf = Vec::new();
    loop {
        let first = match beat {
            Some(every) => match rx.recv_timeout(every) {
                Ok(f) => f,
                Err(mpsc::RecvTimeoutError::Timeout) => Frame::Beat,
                Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
            },
            None => match rx.recv() {
                Ok(f) => f,
                Err(_) => return Ok(()),
            },
        };
        buf.clear();
        first.encode(&mut buf);
        while buf.len() < MAX_PAYLOAD
            && let Ok(f) = rx.try_recv()
        {
            f.encode(&mut buf);
        }
        out.write_all(&buf)?;
    }
}

/// How a relay runs.
pub struct RelayConfig {
    /// The coordinator's control port.
    pub coordinator: SocketAddr,
    /// Where the host's workers reach the relay (port 0: any free one).
    pub listen: SocketAddr,
    pub auth: JobAuth,
    /// A worker silent for this long is closed; the relay beats four times
    /// within it.
    pub lease: Duration,
    /// This relay's number, for the coordinator's messages.
    pub id: u64,
}

/// A relay connected to its coordinator, its port bound, not yet serving.
pub struct Relay {
    cfg: RelayConfig,
    listener: TcpListener,
    up: TcpStream,
    keys: auth::Keys,
}

impl Relay {
    /// Connects to the coordinator, proves the secret and binds the port
    /// the workers come to.
    pub fn connect(cfg: RelayConfig) -> anyhow::Result<Relay> {
        use anyhow::Context;
        let mut up = TcpStream::connect_timeout(&cfg.coordinator, AUTH_TIMEOUT)
            .with_context(|| format!("the coordinator at {}", cfg.coordinator))?;
        let claim = cfg.auth.claim(CHANNEL, 0, cfg.id);
        let keys = auth::connect(&mut auth::Deadline::new(&mut up, AUTH_TIMEOUT), &cfg.auth.secret, &claim)
            .with_context(|| format!("the coordinator at {} refused the relay", cfg.coordinator))?;
        let _ = up.set_nodelay(true);
        let _ = up.set_write_timeout(Some(SEND_TIMEOUT));
        crate::control::proto::keepalive(&up);
        // A coordinator whose host vanished is noticed within the lease
        // while the relay has lines waiting to go.
        crate::control::proto::give_up_unacked(&up, cfg.lease);
        let listener = edl_host_gpu::comm::listen::listen(cfg.listen)
            .with_context(|| format!("--listen {}", cfg.listen))?;
        Ok(Relay { cfg, listener, up, keys })
    }

    /// Where the workers reach the relay.
    pub fn addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves until the coordinator's connection ends; returns why.
    pub fn serve(self) -> io::Result<String> {
        let Relay { cfg, listener, up, keys } = self;
        let (sealer, opener) = keys.split();
        let workers: Workers = Arc::new(Mutex::new(HashMap::new()));
        let gatherings = Arc::new(Mutex::new(Gatherings::default()));
        let (tx, rx) = mpsc::channel::<Frame>();
        let mut upward = SealedWriter::new(up.try_clone()?, Some(sealer));
        let beat = (cfg.lease / 4).max(Duration::from_millis(10));
        let shut = up.try_clone()?;
        std::thread::Builder::new().name("edl-relay-up".into()).spawn(move || {
            if let Err(e) = write_batches(rx, &mut upward, Some(beat)) {
                tracing::warn!("relay: writing to the coordinator: {e}");
            }
            let _ = shut.shutdown(std::net::Shutdown::Both);
        })?;
        let accepting = Accepting {
            auth: cfg.auth.clone(),
            lease: cfg.lease,
            workers: workers.clone(),
            gatherings: gatherings.clone(),
            tx,
        };
        std::thread::Builder::new().name("edl-relay-accept".into()).spawn(move || accepting.run(listener))?;
        let why = downward(SealedReader::new(up, Some(opener)), &workers, &gatherings);
        for (_, w) in workers.lock().unwrap_or_else(|p| p.into_inner()).drain() {
            let _ = w.get_ref().shutdown(std::net::Shutdown::Both);
        }
        Ok(why)
    }
}

/// The host's workers' connections by number, for writing to them.
type Workers = Arc<Mutex<HashMap<u64, SealedWriter<TcpStream>>>>;

/// Writes the coordinator's lines to the workers, and a host window's to
/// each of its ranks; returns why it ended.
fn downward(down: SealedReader<TcpStream>, workers: &Workers, gatherings: &Mutex<Gatherings>) -> String {
    let mut down = BufReader::with_capacity(256 << 10, down);
    loop {
        let frame = match Frame::read(&mut down) {
            Ok(Some(f)) => f,
            Ok(None) => return "the coordinator closed the connection".into(),
            Err(e) => return format!("the coordinator's connection: {e}"),
        };
        match frame {
            Frame::Line { conn, line } => write_to(workers, conn, &line),
            Frame::Fan { conns, line } => conns.iter().for_each(|&conn| write_to(workers, conn, &line)),
            Frame::Generation(g) => {
                for (conn, msg) in g.split() {
                    match encode(&msg) {
                        Ok(line) => write_to(workers, conn, &line),
                        Err(e) => return format!("a generation for worker {conn}: {e}"),
                    }
                }
            }
            Frame::Window(w) => {
                let split = match w.split() {
                    Ok(s) => s,
                    Err(e) => {
                        return format!("the coordinator sent a window this relay cannot share out: {e}");
                    }
                };
                // Gathered before any rank can answer it.
                gatherings.lock().unwrap_or_else(|p| p.into_inner()).expect(&w);
                for (conn, msg) in split {
                    match encode(&msg) {
                        Ok(line) => write_to(workers, conn, &line),
                        Err(e) => return format!("a window for worker {conn}: {e}"),
                    }
                }
            }
            Frame::Closed { conn, .. } => {
                if let Some(w) = workers.lock().unwrap_or_else(|p| p.into_inner()).remove(&conn) {
                    let _ = w.get_ref().shutdown(std::net::Shutdown::Both);
                }
            }
            Frame::Open { .. } | Frame::Beat | Frame::Done(_) => {
                return "the coordinator sent a frame only a relay sends".into();
            }
        }
    }
}

/// Writes one line to worker `conn`; one that cannot take it is closed
/// (its reader says so).
fn write_to(workers: &Workers, conn: u64, line: &[u8]) {
    let mut map = workers.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(w) = map.get_mut(&conn)
        && w.write_all(line).is_err()
    {
        let _ = w.get_ref().shutdown(std::net::Shutdown::Both);
        map.remove(&conn);
    }
}

/// The relay's side of its workers' connections.
struct Accepting {
    auth: JobAuth,
    lease: Duration,
    workers: Workers,
    gatherings: Arc<Mutex<Gatherings>>,
    tx: mpsc::Sender<Frame>,
}

impl Accepting {
    fn run(self, listener: TcpListener) {
        let next = Arc::new(AtomicU64::new(1));
        let me = Arc::new(self);
        for conn in listener.incoming() {
            let conn = match conn {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!("relay: accept: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            let (me, n) = (me.clone(), next.fetch_add(1, Ordering::Relaxed));
            let started =
                std::thread::Builder::new().name("edl-relay-worker".into()).spawn(move || me.worker(conn, n));
            if let Err(e) = started {
                tracing::warn!("relay: cannot start a thread for a worker: {e}");
            }
        }
    }

    /// Admits one worker and passes its lines on until its connection ends.
    fn worker(&self, mut conn: TcpStream, n: u64) {
        let peer = conn.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "a worker".into());
        let proven =
            auth::accept(&mut auth::Deadline::new(&mut conn, AUTH_TIMEOUT), &self.auth.secret, |c| {
                self.auth.check(c, "control", None)
            });
        let (claim, keys) = match proven {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!("relay: refused a connection from {peer}: {e}");
                return;
            }
        };
        let _ = conn.set_nodelay(true);
        let _ = conn.set_write_timeout(Some(SEND_TIMEOUT));
        let _ = conn.set_read_timeout(Some(self.lease));
        crate::control::proto::keepalive(&conn);
        let Ok(reader) = conn.try_clone() else { return };
        let (sealer, opener) = keys.split();
        self.workers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(n, SealedWriter::new(conn, Some(sealer)));
        if self.tx.send(Frame::Open { conn: n, claim }).is_err() {
            return;
        }
        let why = self.pass_lines(SealedReader::new(reader, Some(opener)), n, &peer);
        if let Some(w) = self.workers.lock().unwrap_or_else(|p| p.into_inner()).remove(&n) {
            let _ = w.get_ref().shutdown(std::net::Shutdown::Both);
        }
        // What its host's other ranks reported with it goes up as theirs,
        // before its end (under the lock: no other worker's line between).
        let mut gatherings = self.gatherings.lock().unwrap_or_else(|p| p.into_inner());
        self.send_each(gatherings.gone(n));
        let _ = self.tx.send(Frame::Closed { conn: n, why });
    }

    /// Passes a worker's lines on (heartbeats kept); returns why it ended.
    fn pass_lines(&self, r: SealedReader<TcpStream>, n: u64, peer: &str) -> String {
        let mut r = BufReader::new(r);
        let mut line = Vec::new();
        let mut heard = Instant::now();
        loop {
            line.clear();
            // A line fits a frame, its end included.
            match r.by_ref().take(MAX_PAYLOAD as u64).read_until(b'\n', &mut line) {
                Ok(0) => return format!("{peer}: connection closed"),
                Ok(_) if line.last() != Some(&b'\n') => {
                    return format!("{peer}: a message longer than {} MiB", MAX_PAYLOAD >> 20);
                }
                Ok(_) => heard = Instant::now(),
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                    return format!(
                        "{peer}: no heartbeat for {:.1} s (the worker's host or its network went silent)",
                        heard.elapsed().as_secs_f64()
                    );
                }
                Err(e) => return format!("{peer}: {e}"),
            }
            if is_heartbeat(&line) {
                continue;
            }
            // Under the lock until sent: reports released by another
            // worker's thread never fall behind this one's later lines.
            let mut gatherings = self.gatherings.lock().unwrap_or_else(|p| p.into_inner());
            // A line that does not read goes up as it came: the
            // coordinator closes the worker, naming why.
            let up = match serde_json::from_slice::<FromWorker>(line.trim_ascii_end()) {
                Ok(msg) => gatherings.take(n, msg),
                Err(_) => Up::Line,
            };
            let sent = match up {
                Up::Held => Ok(()),
                Up::Summed(done) => self.tx.send(Frame::Done(Box::new(done))),
                Up::Line => self.tx.send(Frame::Line { conn: n, line: std::mem::take(&mut line) }),
                Up::Release(held) => {
                    self.send_each(held);
                    self.tx.send(Frame::Line { conn: n, line: std::mem::take(&mut line) })
                }
            };
            drop(gatherings);
            if sent.is_err() {
                return "the relay stopped".into();
            }
        }
    }

    /// Reports held for a host's sum, sent up one by one, each its worker's.
    fn send_each(&self, held: Vec<(u64, FromWorker)>) {
        for (conn, msg) in held {
            if let Ok(line) = encode(&msg) {
                let _ = self.tx.send(Frame::Line { conn, line });
            }
        }
    }
}

/// Whether a worker's line is a heartbeat (`"heartbeat"`, as it encodes).
fn is_heartbeat(line: &[u8]) -> bool {
    line.trim_ascii() == b"\"heartbeat\""
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_read_back_as_written_and_bad_ones_are_refused() {
        let claim = Claim { job: "j".into(), channel: "control".into(), generation: 3, who: 7 };
        let frames = vec![
            Frame::Open { conn: 1, claim },
            Frame::Line { conn: 1, line: b"{\"ready\":{}}\n".to_vec() },
            Frame::Beat,
            Frame::Closed { conn: 9, why: "gone".into() },
            Frame::Fan { conns: vec![3, 5, 8], line: b"{\"commit\":{}}\n".to_vec() },
            Frame::Fan { conns: vec![], line: Vec::new() },
            Frame::Generation(Box::new(HostGeneration {
                conns: vec![4, 6],
                first: 2,
                generation: crate::control::proto::Generation {
                    generation: 3,
                    rank: 2,
                    world: 5,
                    rendezvous: "127.0.0.1:9".into(),
                    rendezvous_key: "j/generation-3".into(),
                    committed_steps: 40,
                    init: None,
                    ps: None,
                },
            })),
        ];
        let mut bytes = Vec::new();
        for f in &frames {
            f.encode(&mut bytes);
        }
        let mut r = bytes.as_slice();
        let mut back = Vec::new();
        while let Some(f) = Frame::read(&mut r).unwrap() {
            back.push(f);
        }
        assert_eq!(back, frames);
        // Taken from a buffer as they arrive: nothing until a frame is whole.
        let mut at = 0;
        let mut taken = Vec::new();
        for end in 0..=bytes.len() {
            if let Some((f, len)) = Frame::first(&bytes[at..end]).unwrap() {
                taken.push(f);
                at += len;
            }
        }
        assert_eq!((taken, at), (frames, bytes.len()));

        // Cut inside a frame: an error, not a clean end.
        let mut cut = &bytes[..bytes.len() - 2];
        let mut err = None;
        loop {
            match Frame::read(&mut cut) {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        assert!(err.is_some(), "a frame cut short reads as an error");

        let mut unknown = vec![77u8];
        unknown.extend_from_slice(&[0; 12]);
        let e = Frame::read(&mut unknown.as_slice()).unwrap_err();
        assert!(e.to_string().contains("unknown kind 77"), "{e}");

        let mut fan = vec![FAN];
        fan.extend_from_slice(&0u64.to_le_bytes());
        fan.extend_from_slice(&8u32.to_le_bytes());
        fan.extend_from_slice(&5u32.to_le_bytes());
        fan.extend_from_slice(&[0; 4]);
        let e = Frame::read(&mut fan.as_slice()).unwrap_err();
        assert!(e.to_string().contains("cut short"), "{e}");

        let mut huge = vec![LINE];
        huge.extend_from_slice(&1u64.to_le_bytes());
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        let e = Frame::read(&mut huge.as_slice()).unwrap_err();
        assert!(e.to_string().contains("at most"), "{e}");
        let e = Frame::first(&huge).unwrap_err();
        assert!(e.to_string().contains("at most"), "refused at its head, not waited for: {e}");
    }

    #[test]
    fn a_burst_of_frames_goes_out_in_one_write() {
        struct Writes(Vec<Vec<u8>>);
        impl Write for Writes {
            fn write(&mut self, b: &[u8]) -> io::Result<usize> {
                self.0.push(b.to_vec());
                Ok(b.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let (tx, rx) = mpsc::channel();
        for conn in 0..50 {
            tx.send(Frame::Line { conn, line: b"x\n".to_vec() }).unwrap();
        }
        drop(tx);
        let mut out = Writes(Vec::new());
        write_batches(rx, &mut out, None).unwrap();
        assert_eq!(out.0.len(), 1, "fifty queued frames, one write");
        let mut r = out.0[0].as_slice();
        let mut n = 0;
        while let Some(Frame::Line { conn, .. }) = Frame::read(&mut r).unwrap() {
            assert_eq!(conn, n);
            n += 1;
        }
        assert_eq!(n, 50);
    }

    #[test]
    fn only_a_heartbeat_line_is_kept_back() {
        assert!(is_heartbeat(b"\"heartbeat\"\n"));
        assert!(!is_heartbeat(b"{\"ready\":{}}\n"));
        let encoded = crate::control::proto::encode(&crate::control::proto::FromWorker::Heartbeat).unwrap();
        assert!(is_heartbeat(&encoded), "the worker's heartbeat as it encodes");
    }
}
