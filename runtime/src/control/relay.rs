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
//! Frames between relay and coordinator are [`crate::control::frame`]'s.

use crate::control::frame::{CHANNEL, FRAME_HEADER, Frame, MAX_PAYLOAD, write_batches};
use crate::control::hostwindow::{Gatherings, Up};
use crate::control::inbox::Inbound;
use crate::control::outbox::Outbox;
use crate::control::proto::{FromWorker, ToWorker, encode};
use edl_host_gpu::comm::auth::{self, JobAuth};
use edl_host_gpu::comm::sealed::{SealedReader, SealedWriter};
use std::{
    collections::HashMap,
    io::{self, BufReader, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    sync::{Arc, Mutex, mpsc},
    time::Duration,
};

/// Longest the relay may take to prove the secret to the coordinator.
const AUTH_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on writing one line to a worker, or a batch to the coordinator.
const SEND_TIMEOUT: Duration = Duration::from_secs(10);

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
        let claim = cfg.auth.claim(CHANNEL, 0, cfg.id).speaking(crate::control::proto::PROTOCOL);
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
            w.shut();
        }
        Ok(why)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The host's workers by number, for writing to them.
type Workers = Arc<Mutex<HashMap<u64, Carried>>>;

/// One of the host's workers.
struct Carried {
    /// Who it proved to be.
    who: u64,
    /// Where its lines are written; locked for a write, never with the map.
    link: Arc<Mutex<SealedWriter<TcpStream>>>,
    /// Its socket, to shut without waiting for a write under way.
    socket: TcpStream,
}

impl Carried {
    fn shut(&self) {
        let _ = self.socket.shutdown(std::net::Shutdown::Both);
    }
}

/// Writes the coordinator's lines to the workers, and a host window's to
/// each of its ranks; returns why it ended. What the coordinator sent
/// together (a window's commit and the window after it, a generation and
/// its first window) goes to each worker in one write: one sealing, one
/// wake-up of the worker, where a line each cost as many.
fn downward(down: SealedReader<TcpStream>, workers: &Workers, gatherings: &Mutex<Gatherings>) -> String {
    let mut down = BufReader::with_capacity(256 << 10, down);
    let mut out = Outgoing::default();
    loop {
        let why = match Frame::read(&mut down) {
            Ok(Some(f)) => take(f, &mut out, workers, gatherings).err(),
            Ok(None) => Some("the coordinator closed the connection".into()),
            Err(e) => Some(format!("the coordinator's connection: {e}")),
        };
        if let Some(why) = why {
            out.flush(workers);
            return why;
        }
        // Held only while the next frame can be read at once: whole here, or
        // its start in a sealed message received (the coordinator writes a
        // frame in one write, so its rest is on its way). Part of a frame
        // here and nothing more: what is held goes before waiting for it.
        let buffered = down.buffer();
        let more = Frame::whole_at_start(buffered) || (buffered.is_empty() && down.get_mut().holds_whole());
        if !more || out.bytes >= Outgoing::HOLD_AT_MOST {
            out.flush(workers);
        }
    }
}

/// Acts on one frame from the coordinator: its lines for the workers into
/// `out`; `Err` names why the relay cannot go on.
fn take(
    frame: Frame,
    out: &mut Outgoing,
    workers: &Workers,
    gatherings: &Mutex<Gatherings>,
) -> Result<(), String> {
    match frame {
        Frame::Line { conn, line } => out.push(conn, &line),
        Frame::Fan { conns, line } => conns.iter().for_each(|&conn| out.push(conn, &line)),
        Frame::Generation(g) => {
            for (conn, msg) in g.split() {
                out.encode(conn, &msg).map_err(|e| format!("a generation for worker {conn}: {e}"))?;
            }
        }
        Frame::Window(w) => {
            let split = w
                .split()
                .map_err(|e| format!("the coordinator sent a window this relay cannot share out: {e}"))?;
            // Gathered before any rank can answer it.
            lock(gatherings).expect(&w);
            for (conn, msg) in split {
                out.encode(conn, &msg).map_err(|e| format!("a window for worker {conn}: {e}"))?;
            }
        }
        Frame::Closed { conn, .. } => {
            // What was said to it before goes first.
            out.flush_one(conn, workers);
            if let Some(w) = lock(workers).remove(&conn) {
                w.shut();
            }
        }
        Frame::Open { .. } | Frame::Beat | Frame::Done(_) => {
            return Err("the coordinator sent a frame only a relay sends".into());
        }
    }
    Ok(())
}

/// The workers' lines from frames read together, held until no more are
/// here to read, then written to each worker at once.
#[derive(Default)]
struct Outgoing {
    /// Each worker's lines, in the order its first came.
    each: Vec<(u64, Vec<u8>)>,
    /// Where each worker is in `each`.
    at: HashMap<u64, usize>,
    /// Bytes held, all workers together.
    bytes: usize,
    /// Emptied buffers, for the next frames.
    spare: Vec<Vec<u8>>,
}

impl Outgoing {
    /// Held beyond this (checked after each frame), the lines go before
    /// more frames are read.
    const HOLD_AT_MOST: usize = 1 << 20;
    /// A buffer grown beyond this is not kept for reuse.
    const KEEP_AT_MOST: usize = 64 << 10;

    fn lines_of(&mut self, conn: u64) -> &mut Vec<u8> {
        let i = *self.at.entry(conn).or_insert_with(|| {
            self.each.push((conn, self.spare.pop().unwrap_or_default()));
            self.each.len() - 1
        });
        &mut self.each[i].1
    }

    fn push(&mut self, conn: u64, line: &[u8]) {
        self.lines_of(conn).extend_from_slice(line);
        self.bytes += line.len();
    }

    /// Appends `msg`'s line for worker `conn`.
    fn encode(&mut self, conn: u64, msg: &ToWorker) -> Result<(), String> {
        let lines = self.lines_of(conn);
        let at = lines.len();
        if let Err(e) = serde_json::to_writer(&mut *lines, msg) {
            lines.truncate(at);
            return Err(e.to_string());
        }
        lines.push(b'\n');
        let added = lines.len() - at;
        self.bytes += added;
        Ok(())
    }

    /// Writes every worker's lines.
    fn flush(&mut self, workers: &Workers) {
        for (conn, mut lines) in self.each.drain(..) {
            if !lines.is_empty() {
                write_to(workers, conn, &lines);
            }
            if lines.capacity() <= Self::KEEP_AT_MOST {
                lines.clear();
                self.spare.push(lines);
            }
        }
        self.at.clear();
        self.bytes = 0;
    }

    /// Writes worker `conn`'s lines now.
    fn flush_one(&mut self, conn: u64, workers: &Workers) {
        if let Some(&i) = self.at.get(&conn) {
            let lines = &mut self.each[i].1;
            if !lines.is_empty() {
                write_to(workers, conn, lines);
                self.bytes -= lines.len();
                lines.clear();
            }
        }
    }
}

/// Writes one line to worker `conn`; one that cannot take it is closed
/// (its reader says so). The map of workers is not held while writing: a
/// worker slow to read holds up no worker's joining or leaving, and
/// nothing that goes up.
fn write_to(workers: &Workers, conn: u64, line: &[u8]) {
    let Some(link) = lock(workers).get(&conn).map(|w| w.link.clone()) else { return };
    if lock(&link).write_all(line).is_err()
        && let Some(w) = lock(workers).remove(&conn)
    {
        w.shut();
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
                let cloned = lock(&link).get_ref().try_clone();
                let socket = match cloned {
                    Ok(s) => s,
                    Err(e) => {
                        // Its end goes up, for a connection never opened: ignored there.
                        tracing::warn!("relay: worker {}'s connection: {e}; closed", claim.who);
                        let _ = lock(&link).get_ref().shutdown(std::net::Shutdown::Both);
                        return;
                    }
                };
                let w = Carried { who: claim.who, link, socket };
                lock(&self.workers).insert(conn, w);
                Frame::Open { conn, claim }.encode(buf);
            }
            Inbound::Msg(conn, msg) => {
                let up = lock(&self.gatherings).take(conn, msg);
                match up {
                    Up::Held => {}
                    Up::Summed(done, parts) => {
                        let at = buf.len();
                        Frame::Done(Box::new(done)).encode(buf);
                        if buf.len() - at > FRAME_HEADER + MAX_PAYLOAD {
                            // Too large as one: each rank's account goes up
                            // as its own (each checked as any message).
                            buf.truncate(at);
                            parts.iter().for_each(|(c, m)| self.line(*c, m, buf));
                        }
                    }
                    Up::Line(msg) => self.line(conn, &msg, buf),
                    Up::Release(held, msg) => {
                        held.iter().for_each(|(c, m)| self.line(*c, m, buf));
                        self.line(conn, &msg, buf);
                    }
                }
            }
            Inbound::Closed(conn, why) => self.close(conn, why, buf),
            // The relay's inbox admits workers only: no relay, so no
            // host's reports and nothing for a relay.
            Inbound::Conn(..) | Inbound::Host(..) | Inbound::RelayLost(..) | Inbound::ToRelay(..) => {}
        }
    }

    /// Appends worker `conn`'s message `msg`, as its line, to `buf`; a
    /// message that cannot go up (larger than a frame holds) closes its
    /// worker, not the relay.
    fn line(&self, conn: u64, msg: &FromWorker, buf: &mut Vec<u8>) {
        let why = match encode(msg) {
            Ok(line) if line.len() <= MAX_PAYLOAD => return Frame::Line { conn, line }.encode(buf),
            Ok(line) => format!("a message of {} bytes, more than a frame holds ({MAX_PAYLOAD})", line.len()),
            Err(e) => format!("a message the relay cannot pass on: {e}"),
        };
        self.close(conn, why, buf);
    }

    /// Worker `conn`'s connection ended (or is ended here), and why: what
    /// its host's other ranks reported with it goes up as theirs, then its
    /// end, naming it. One ended here is ended again when its reader sees
    /// the shut socket: that second end, and any line the reader had
    /// already passed on, go up for a connection the coordinator has
    /// closed, which it ignores (numbers are not reused).
    fn close(&self, conn: u64, why: String, buf: &mut Vec<u8>) {
        let why = match lock(&self.workers).remove(&conn) {
            Some(w) => {
                w.shut();
                format!("worker {}: {why}", w.who)
            }
            None => why,
        };
        let held = lock(&self.gatherings).gone(conn);
        held.iter().for_each(|(c, m)| self.line(*c, m, buf));
        Frame::Closed { conn, why }.encode(buf);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::hostwindow::HostWindow;
    use crate::control::proto::Link;
    use edl_host_gpu::comm::auth::Claim;

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

    fn claim(who: u64) -> Claim {
        Claim { job: "j".into(), channel: "control".into(), generation: 0, who, protocol: 0 }
    }

    /// A relay's way up with workers 30 and 40 on its connections 3 and 4
    /// (their frames in `buf`), and the workers' ends of them.
    fn two_workers(buf: &mut Vec<u8>) -> (Upward, [TcpStream; 2]) {
        let up = Upward { workers: Default::default(), gatherings: Default::default() };
        let (a, a_end) = worker_link();
        let (b, b_end) = worker_link();
        up.encode(Inbound::Conn(3, Outbox::direct(a), claim(30)), buf);
        up.encode(Inbound::Conn(4, Outbox::direct(b), claim(40)), buf);
        (up, [a_end, b_end])
    }

    /// Step `step` (4 samples) for connections 3 and 4, ranks 0 and 1 of
    /// two: each rank 2 samples.
    fn window(step: u64) -> HostWindow {
        use crate::control::proto::{Share, StepPlan};
        let hyper = edl_plugin_sdk::Hyperparams { global_batch: 4, local_batch: 2, lr: 0.1, momentum: 0.0 };
        HostWindow {
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
        }
    }

    /// Two loopback ends that proved `a`'s secret to each other, each with its keys.
    fn sealed_pair(a: &JobAuth) -> ((TcpStream, auth::Keys), (TcpStream, auth::Keys)) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut near = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut far, _) = l.accept().unwrap();
        let secret = a.secret.clone();
        let accepting = std::thread::spawn(move || {
            let (_, keys) = auth::accept(&mut far, &secret, |_| Ok(())).unwrap();
            (far, keys)
        });
        let keys = auth::connect(&mut near, &a.secret, &a.claim("control", 0, 1)).unwrap();
        ((near, keys), accepting.join().unwrap())
    }

    /// Reads `end` until `want` whole lines have come; returns them, and
    /// how many sealed messages carried them.
    fn sealed_lines(
        end: &mut TcpStream,
        opener: &mut edl_host_gpu::comm::sealed::Opener,
        want: usize,
    ) -> (Vec<String>, usize) {
        use std::io::Read;
        end.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let (mut raw, mut plain, mut buf) = (Vec::new(), Vec::new(), [0u8; 4096]);
        while plain.iter().filter(|&&b| b == b'\n').count() < want {
            let n = end.read(&mut buf).unwrap();
            assert!(n > 0, "the connection ended after {:?}", String::from_utf8_lossy(&plain));
            raw.extend_from_slice(&buf[..n]);
            opener.open(&buf[..n], &mut plain).unwrap();
        }
        // Each sealed message: its length (two bytes), then itself.
        let (mut messages, mut at) = (0, 0);
        while at + 2 <= raw.len() {
            at += 2 + u16::from_be_bytes([raw[at], raw[at + 1]]) as usize;
            messages += 1;
        }
        let lines = String::from_utf8(plain).unwrap().lines().map(str::to_string).collect();
        (lines, messages)
    }

    #[test]
    fn what_the_coordinator_sent_together_reaches_each_worker_in_one_sealed_write() {
        let a = JobAuth { job: "j".into(), secret: auth::Secret::generate().unwrap() };
        let workers: Workers = Default::default();
        let gatherings: Arc<Mutex<Gatherings>> = Default::default();
        let mut ends = Vec::new();
        for (conn, who) in [(3, 30), (4, 40)] {
            let ((relay_side, relay_keys), (worker_end, worker_keys)) = sealed_pair(&a);
            let link = SealedWriter::new(relay_side.try_clone().unwrap(), Some(relay_keys.split().0));
            lock(&workers)
                .insert(conn, Carried { who, link: Arc::new(Mutex::new(link)), socket: relay_side });
            ends.push((worker_end, worker_keys.split().1));
        }
        let ((coordinator, c_keys), (up, r_keys)) = sealed_pair(&a);
        let mut to_relay = SealedWriter::new(coordinator, Some(c_keys.split().0));
        let reader = SealedReader::new(up, Some(r_keys.split().1));
        let relay = {
            let (workers, gatherings) = (workers.clone(), gatherings.clone());
            std::thread::spawn(move || downward(reader, &workers, &gatherings))
        };

        // A window's commit for both, and the window after it, in one write.
        let commit = ToWorker::Commit { step: 0, checkpoint: None, wait: false, stored: None, origin: false };
        let mut batch = Vec::new();
        Frame::Fan { conns: vec![3, 4], line: encode(&commit).unwrap() }.encode(&mut batch);
        Frame::Window(Box::new(window(1))).encode(&mut batch);
        to_relay.write_all(&batch).unwrap();
        for (end, opener) in &mut ends {
            let (lines, messages) = sealed_lines(end, opener, 2);
            assert!(lines[0].contains("\"commit\"") && lines[1].contains("\"steps\""), "{lines:?}");
            assert_eq!(messages, 1, "the commit and the window in one sealed message: {lines:?}");
        }

        // A line, then the coordinator's word to close that worker: the line first.
        let stop = ToWorker::Stop { reason: "leaving".into() };
        batch.clear();
        Frame::Line { conn: 3, line: encode(&stop).unwrap() }.encode(&mut batch);
        Frame::Closed { conn: 3, why: String::new() }.encode(&mut batch);
        to_relay.write_all(&batch).unwrap();
        let (end, opener) = &mut ends[0];
        let (lines, _) = sealed_lines(end, opener, 1);
        assert!(lines[0].contains("leaving"), "{lines:?}");
        let mut rest = [0u8; 64];
        assert_eq!(std::io::Read::read(end, &mut rest).unwrap(), 0, "closed after its line");
        assert!(!lock(&workers).contains_key(&3));

        drop(to_relay);
        assert_eq!(relay.join().unwrap(), "the coordinator closed the connection");
    }

    #[test]
    fn the_workers_messages_go_up_as_frames_and_a_host_window_as_one_report() {
        use crate::control::proto::StepDone;
        let mut buf = Vec::new();
        let (up, _ends) = two_workers(&mut buf);
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

        let done = |step: u64, rank: u32| FromWorker::Done {
            generation: 1,
            steps: vec![{
                let start = 4 * step as u32 + 2 * rank;
                StepDone::plain(step, 0, start, start + 2, 0.25, 1.0)
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
            vec![
                Frame::Line { conn: 3, line: held },
                Frame::Closed { conn: 4, why: "worker 40: gone".into() }
            ]
        );
        assert!(!lock(&up.workers).contains_key(&4));

        // A message larger than a frame holds closes its worker, not the
        // relay: the worker's end goes up, naming why.
        buf.clear();
        let huge = FromWorker::Failed { generation: 1, step: 2, error: "x".repeat(MAX_PAYLOAD), cause: None };
        up.encode(Inbound::Msg(3, huge), &mut buf);
        let [Frame::Closed { conn: 3, why }] = &frames_of(&buf)[..] else { panic!("its end, alone") };
        assert!(
            why.starts_with("worker 30: a message of") && why.contains("more than a frame holds"),
            "{why}"
        );
        assert!(lock(&up.workers).is_empty());
    }

    #[test]
    fn a_host_s_sum_larger_than_a_frame_goes_up_as_each_rank_s_own_report() {
        use crate::control::proto::StepDone;
        let mut buf = Vec::new();
        let (up, _ends) = two_workers(&mut buf);
        lock(&up.gatherings).expect(&window(0));
        // Each rank's report fits a frame; the two metrics' names together do not.
        let done = |rank: u32, name: char| {
            let mut d = StepDone::plain(0, 0, 2 * rank, 2 * rank + 2, 0.25, 1.0);
            d.metrics = vec![(name.to_string().repeat(MAX_PAYLOAD / 2 + 16), 1.0)];
            FromWorker::Done { generation: 1, steps: vec![d], setup_ms: 0.0 }
        };
        buf.clear();
        up.encode(Inbound::Msg(3, done(0, 'a')), &mut buf);
        up.encode(Inbound::Msg(4, done(1, 'b')), &mut buf);
        let frames = frames_of(&buf);
        assert_eq!(frames.len(), 2, "two reports, no end");
        for (f, (conn, rank, name)) in frames.iter().zip([(3, 0, 'a'), (4, 1, 'b')]) {
            let Frame::Line { conn: c, line } = f else { panic!("a worker's own line") };
            assert_eq!((*c, line), (conn, &encode(&done(rank, name)).unwrap()));
        }
        assert_eq!(lock(&up.workers).len(), 2, "no worker closed");
    }
}
