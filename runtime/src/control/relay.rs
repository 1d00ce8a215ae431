//! A host's relay: the workers of one host reach the coordinator through one
//! connection instead of one each, so the coordinator's connections, reads,
//! writes, wake-ups and sealing per window are O(hosts), not O(ranks).
//!
//! The relay proves the job's secret to the coordinator on the `relay`
//! channel, and accepts its host's workers exactly as the coordinator would
//! (the secret's exchange on the `control` channel, each connection sealed
//! with keys of its own), through the same inbox: one thread reads every
//! worker's connection (epoll), however many the host has. It passes each
//! worker's claim on, so the coordinator's gate decides who is admitted (a
//! worker that lost its place is refused as before); it keeps heartbeats to
//! itself, closes a worker silent for the lease, and the coordinator hears
//! of the closing. A host window's reports are summed into one (see
//! [`crate::control::hostwindow`]); other messages go up as they are, and
//! those that arrive together go in one sealed write. The coordinator's
//! lines to the host come the same way; each is written to its worker as
//! it would have been directly. A worker cannot tell a relay from the
//! coordinator.
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
use crate::control::inbox::Inbound;
use crate::control::outbox::Outbox;
use crate::control::proto::{FromWorker, encode};
use edl_host_gpu::comm::auth::{self, Claim, JobAuth};
use edl_host_gpu::comm::sealed::{SealedReader, SealedWriter};
use std::{
    collections::HashMap,
    io::{self, BufReader, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    sync::{Arc, Mutex, mpsc},
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

/// Writes what is queued on `rx`, made into frames by `encode`, to `out`:
/// each burst in one write, until every sender is gone or a write fails.
/// Where `beat` is given, a heartbeat goes when nothing was written for
/// that long.
pub fn write_batches<T>(
    rx: mpsc::Receiver<T>,
    out: &mut impl Write,
    beat: Option<Duration>,
    mut encode: impl FnMut(T, &mut Vec<u8>),
) -> io::Result<()> {
    let mut buf = Vec::new();
    let mut wrote = Instant::now();
    loop {
        buf.clear();
        let first = match beat {
            Some(every) => match rx.recv_timeout(every.saturating_sub(wrote.elapsed())) {
                Ok(x) => Some(x),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
            },
            None => match rx.recv() {
                Ok(x) => Some(x),
                Err(_) => return Ok(()),
            },
        };
        if let Some(x) = first {
            encode(x, &mut buf);
        }
        while buf.len() < MAX_PAYLOAD
            && let Ok(x) = rx.try_recv()
        {
            encode(x, &mut buf);
        }
        if buf.is_empty() && beat.is_some_and(|every| wrote.elapsed() >= every) {
            Frame::Beat.encode(&mut buf);
        }
        if !buf.is_empty() {
            out.write_all(&buf)?;
            wrote = Instant::now();
        }
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
        let upward = Upward { workers: Default::default(), gatherings: Default::default() };
        let (workers, gatherings) = (upward.workers.clone(), upward.gatherings.clone());
        let (tx, rx) = mpsc::channel::<Inbound>();
        let mut out = SealedWriter::new(up.try_clone()?, Some(sealer));
        let beat = (cfg.lease / 4).max(Duration::from_millis(10));
        let shut = up.try_clone()?;
        std::thread::Builder::new().name("edl-relay-up".into()).spawn(move || {
            if let Err(e) = write_batches(rx, &mut out, Some(beat), |ev, buf| upward.encode(ev, buf)) {
                tracing::warn!("relay: writing to the coordinator: {e}");
            }
            let _ = shut.shutdown(std::net::Shutdown::Both);
        })?;
        crate::control::inbox::start_for_relay(listener, cfg.auth.clone(), cfg.lease, tx)?;
        let why = downward(SealedReader::new(up, Some(opener)), &workers, &gatherings);
        for (_, w) in lock(&workers).drain() {
            let _ = w.get_ref().shutdown(std::net::Shutdown::Both);
        }
        Ok(why)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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
                lock(gatherings).expect(&w);
                for (conn, msg) in split {
                    match encode(&msg) {
                        Ok(line) => write_to(workers, conn, &line),
                        Err(e) => return format!("a window for worker {conn}: {e}"),
                    }
                }
            }
            Frame::Closed { conn, .. } => {
                if let Some(w) = lock(workers).remove(&conn) {
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
    let mut map = lock(workers);
    if let Some(w) = map.get_mut(&conn)
        && w.write_all(line).is_err()
    {
        let _ = w.get_ref().shutdown(std::net::Shutdown::Both);
        map.remove(&conn);
    }
}

/// The relay's way up: what the inbox reading its workers' connections
/// hears (one thread for all of them, as the coordinator's), made into
/// frames for the coordinator. A host window's reports are held until
/// every rank of it reported, and go up as one.
struct Upward {
    workers: Workers,
    gatherings: Arc<Mutex<Gatherings>>,
}

impl Upward {
    /// Appends the frames for `ev` to `buf` (none while a report is held).
    fn encode(&self, ev: Inbound, buf: &mut Vec<u8>) {
        match ev {
            Inbound::Conn(conn, Outbox::Direct(link), claim) => {
                lock(&self.workers).insert(conn, link);
                Frame::Open { conn, claim }.encode(buf);
            }
            Inbound::Msg(conn, msg) => {
                let up = lock(&self.gatherings).take(conn, msg);
                match up {
                    Up::Held => {}
                    Up::Summed(done) => Frame::Done(Box::new(done)).encode(buf),
                    Up::Line(msg) => line(conn, &msg, buf),
                    Up::Release(held, msg) => {
                        held.iter().for_each(|(c, m)| line(*c, m, buf));
                        line(conn, &msg, buf);
                    }
                }
            }
            Inbound::Closed(conn, why) => {
                if let Some(w) = lock(&self.workers).remove(&conn) {
                    let _ = w.get_ref().shutdown(std::net::Shutdown::Both);
                }
                // What its host's other ranks reported with it goes up as
                // theirs, before its end.
                let held = lock(&self.gatherings).gone(conn);
                held.iter().for_each(|(c, m)| line(*c, m, buf));
                Frame::Closed { conn, why }.encode(buf);
            }
            // The relay's inbox admits workers only: no relay, so no
            // host's reports and nothing for a relay.
            Inbound::Conn(..) | Inbound::Host(..) | Inbound::RelayLost(_) | Inbound::ToRelay(..) => {}
        }
    }
}

/// Appends worker `conn`'s message `msg`, as its line, to `buf`.
fn line(conn: u64, msg: &FromWorker, buf: &mut Vec<u8>) {
    match encode(msg) {
        Ok(line) => Frame::Line { conn, line }.encode(buf),
        Err(e) => tracing::warn!("relay: worker {conn}'s message: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::proto::Link;

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
        write_batches(rx, &mut out, None, |f: Frame, buf| f.encode(buf)).unwrap();
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
    fn a_burst_that_makes_no_frame_still_keeps_the_heartbeat() {
        let (tx, rx) = mpsc::channel();
        for _ in 0..3 {
            tx.send(()).unwrap();
        }
        drop(tx);
        let mut out = Vec::new();
        write_batches(rx, &mut out, Some(Duration::ZERO), |(), _| {}).unwrap();
        let mut r = out.as_slice();
        let mut beats = 0;
        while let Some(f) = Frame::read(&mut r).unwrap() {
            assert_eq!(f, Frame::Beat, "nothing but heartbeats");
            beats += 1;
        }
        assert!(beats >= 1, "a heartbeat though the burst made no frame");
    }

    /// Two loopback ends: a worker's connection as the relay writes to it,
    /// and the worker's side.
    fn worker_link() -> (Link, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let worker = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (relay_side, _) = l.accept().unwrap();
        (Link::new(relay_side, None), worker)
    }

    fn frames_of(bytes: &[u8]) -> Vec<Frame> {
        let mut r = bytes;
        std::iter::from_fn(|| Frame::read(&mut r).unwrap()).collect()
    }

    #[test]
    fn the_workers_messages_go_up_as_frames_and_a_host_window_as_one_report() {
        use crate::control::proto::{Share, StepDone, StepPlan};
        let up = Upward { workers: Default::default(), gatherings: Default::default() };
        let claim = |who| Claim { job: "j".into(), channel: "control".into(), generation: 0, who };
        let (a, _a) = worker_link();
        let (b, _b) = worker_link();
        let mut buf = Vec::new();
        up.encode(Inbound::Conn(3, Outbox::Direct(a), claim(30)), &mut buf);
        up.encode(Inbound::Conn(4, Outbox::Direct(b), claim(40)), &mut buf);
        up.encode(Inbound::Msg(3, FromWorker::Ready { samples: None }), &mut buf);
        let ready = encode(&FromWorker::Ready { samples: None }).unwrap();
        assert_eq!(
            frames_of(&buf),
            vec![
                Frame::Open { conn: 3, claim: claim(30) },
                Frame::Open { conn: 4, claim: claim(40) },
                Frame::Line { conn: 3, line: ready },
            ]
        );
        assert_eq!(lock(&up.workers).len(), 2, "both written to from now on");

        // Ranks 0 and 1 of two, one step of 4 samples: each rank 2.
        let hyper = edl_plugin_sdk::Hyperparams { global_batch: 4, local_batch: 2, lr: 0.1, momentum: 0.0 };
        let window = |step: u64| HostWindow {
            generation: 1,
            world: 2,
            samples: 8,
            steps: vec![StepPlan { step, epoch: 0, cursor: 4 * step as usize, hyper }],
            conns: vec![3, 4],
            first: 0,
            shares: vec![Share {
                start: 4 * step as u32,
                end: 4 * step as u32 + 4,
                indices: vec![0, 1, 2, 3],
            }],
        };
        let done = |step: u64, rank: u32| FromWorker::Done {
            generation: 1,
            steps: vec![StepDone {
                step,
                epoch: 0,
                start: 4 * step as u32 + 2 * rank,
                end: 4 * step as u32 + 2 * rank + 2,
                loss: 0.25,
                compute_ms: 1.0,
                teacher_wait_ms: 0.0,
                metrics: Vec::new(),
                teacher_calls: Vec::new(),
                grad_sq: None,
                noise_terms: None,
            }],
            setup_ms: 0.0,
        };
        lock(&up.gatherings).expect(&window(0));
        buf.clear();
        up.encode(Inbound::Msg(3, done(0, 0)), &mut buf);
        assert!(buf.is_empty(), "held for the host's other rank");
        up.encode(Inbound::Msg(4, done(0, 1)), &mut buf);
        let mut up_frames = frames_of(&buf);
        assert_eq!(up_frames.len(), 1, "one report: {up_frames:?}");
        let Some(Frame::Done(h)) = up_frames.pop() else { panic!("a report") };
        let FromWorker::Done { steps, .. } = &h.done else { panic!("{h:?}") };
        assert_eq!((h.conns.clone(), steps[0].start, steps[0].end, steps[0].loss), (vec![3, 4], 0, 4, 0.5));

        // A rank lost with the other's report held: that goes up as its
        // own, before the loss; the lost one is written to no more.
        lock(&up.gatherings).expect(&window(1));
        buf.clear();
        up.encode(Inbound::Msg(3, done(1, 0)), &mut buf);
        up.encode(Inbound::Closed(4, "gone".into()), &mut buf);
        let held = encode(&done(1, 0)).unwrap();
        assert_eq!(
            frames_of(&buf),
            vec![Frame::Line { conn: 3, line: held }, Frame::Closed { conn: 4, why: "gone".into() }]
        );
        assert!(!lock(&up.workers).contains_key(&4));
    }
}
