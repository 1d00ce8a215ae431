//! All-reduce over a ring of TCP connections: reduce-scatter then all-gather
//! (Patarasuk & Yuan), so each rank sends 2(n-1)/n of the buffer whatever n
//! is. Each chunk is cut into segments; a sender thread ships segment j of
//! step i as soon as the receiving side has reduced segment j of step i-1,
//! so sending, receiving and adding overlap.

use super::auth::{self, JobAuth, Keys};
use super::sealed::{Opener, SealedReader, SealedWriter, Sealer};
use super::{CommError, Communicator, ReduceOp, Rendezvous};
use std::{
    io::{ErrorKind, Read, Write},
    net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream},
    ops::Range,
    sync::mpsc,
    time::{Duration, Instant},
};

/// How a ring is built and run.
#[derive(Clone, Debug)]
pub struct RingOptions {
    /// Longest an operation may go without progress: no byte from the
    /// previous rank (or no room to send to the next) for this long fails
    /// it. An operation that keeps moving data is never cut short, however
    /// large its buffer; building the ring is bounded by it as a whole.
    pub timeout: Duration,
    /// Address to listen on; loopback by default.
    pub bind: IpAddr,
    /// Address the other ranks reach this one at (None: the bound address,
    /// which must then be a specific one, not `0.0.0.0`).
    pub advertise: Option<IpAddr>,
    /// Bytes per pipelined segment.
    pub segment_bytes: usize,
    /// The job's secret and the generation this ring belongs to: each link
    /// proves both before any data crosses it, and every frame after is
    /// authenticated (none: links are not checked).
    pub auth: Option<(JobAuth, u64)>,
    /// Whether proven links are also encrypted (otherwise the data crosses
    /// in clear, authenticated only: see [`super::sealed`]).
    pub encrypt: bool,
}

impl Default for RingOptions {
    fn default() -> Self {
        RingOptions {
            timeout: Duration::from_secs(30),
            bind: IpAddr::V4(Ipv4Addr::LOCALHOST),
            advertise: None,
            segment_bytes: 1 << 20,
            auth: None,
            encrypt: true,
        }
    }
}

/// A ring communicator over TCP.
pub struct TcpRing {
    rank: usize,
    world: usize,
    links: Option<Links>,
    opts: RingOptions,
    scratch: Vec<f32>,
    broken: Option<String>,
}

/// A link's sending and receiving halves: encrypting, or authenticating only.
fn halves(keys: Keys, encrypt: bool) -> (Sealer, Opener) {
    if encrypt { keys.split() } else { keys.split_authenticated() }
}

/// A rank's two links, sealed where the ring has the job's secret.
struct Links {
    /// To rank + 1: we send on it.
    to_next: SealedWriter<TcpStream>,
    /// From rank - 1: we receive on it.
    from_prev: SealedReader<TcpStream>,
    /// The two sockets again, for one side to close while the other is busy.
    next_sock: TcpStream,
    prev_sock: TcpStream,
}

impl Links {
    /// Closes both, so that the neighbours' pending operations fail at once.
    fn close(&self) {
        let _ = self.next_sock.shutdown(Shutdown::Both);
        let _ = self.prev_sock.shutdown(Shutdown::Both);
    }
}

const MAGIC: u32 = 0xED1_0001;

/// Longest an accepted link may take to prove itself and say who it is,
/// all of its handshake together (shorter in this crate's unit tests, which
/// trickle a handshake past it).
#[cfg(not(test))]
const STRAY_PATIENCE: Duration = Duration::from_secs(5);
#[cfg(test)]
const STRAY_PATIENCE: Duration = Duration::from_secs(2);

impl TcpRing {
    /// Builds the ring for `rank` of `world`, finding the peers through `rendezvous`.
    pub fn connect(
        rank: usize,
        world: usize,
        rendezvous: &dyn Rendezvous,
        opts: RingOptions,
    ) -> Result<Self, CommError> {
        if world == 0 || rank >= world {
            return Err(CommError::InvalidArgument(format!("rank {rank} of a world of {world}")));
        }
        let mut ring = TcpRing { rank, world, links: None, scratch: Vec::new(), broken: None, opts };
        if world == 1 {
            return Ok(ring);
        }
        let io = |peer: usize, op: &'static str| {
            move |source: std::io::Error| CommError::Io { rank, op, peer, source }
        };
        let listener = TcpListener::bind(SocketAddr::new(ring.opts.bind, 0)).map_err(io(rank, "listen"))?;
        let mut me = listener.local_addr().map_err(io(rank, "listen"))?;
        if let Some(ip) = ring.opts.advertise {
            me.set_ip(ip);
        } else if me.ip().is_unspecified() {
            return Err(CommError::InvalidArgument(format!(
                "rank {rank}: listening on {} needs an address to advertise",
                me.ip()
            )));
        }
        let all = rendezvous.exchange(rank, world, me.to_string().into_bytes(), ring.opts.timeout)?;
        let next = (rank + 1) % world;
        let next_addr: SocketAddr = String::from_utf8_lossy(&all[next])
            .parse()
            .map_err(|_| CommError::Rendezvous(format!("rank {next} published no address")))?;
        let deadline = Instant::now() + ring.opts.timeout;

        // Linking to the next rank (which proves the secret and so waits for
        // its answer) runs beside accepting the previous one: every rank
        // does both at once, or the ring would wait on itself.
        let opts = &ring.opts;
        let (to_next, from_prev) = std::thread::scope(|scope| {
            let linking = scope.spawn(|| Self::link_next(rank, world, next_addr, opts, deadline));
            let accepted = Self::accept_prev(rank, world, &listener, opts, deadline);
            let linked = linking.join().unwrap_or_else(|_| {
                Err(CommError::Rendezvous(format!("rank {rank}: linking to rank {next} failed")))
            });
            Ok::<_, CommError>((linked?, accepted?))
        })?;
        for s in [to_next.get_ref(), from_prev.get_ref()] {
            s.set_nodelay(true).map_err(io(rank, "configure"))?;
            s.set_read_timeout(Some(ring.opts.timeout)).map_err(io(rank, "configure"))?;
            s.set_write_timeout(Some(ring.opts.timeout)).map_err(io(rank, "configure"))?;
        }
        let next_sock = to_next.get_ref().try_clone().map_err(io(next, "configure"))?;
        let prev_sock = from_prev.get_ref().try_clone().map_err(io(rank, "configure"))?;
        ring.links = Some(Links { to_next, from_prev, next_sock, prev_sock });
        Ok(ring)
    }

    /// Connects to the next rank and introduces this one (proving the
    /// secret first, where the ring has one).
    fn link_next(
        rank: usize,
        world: usize,
        next_addr: SocketAddr,
        opts: &RingOptions,
        deadline: Instant,
    ) -> Result<SealedWriter<TcpStream>, CommError> {
        let next = (rank + 1) % world;
        let io = |peer: usize, op: &'static str| {
            move |source: std::io::Error| CommError::Io { rank, op, peer, source }
        };
        let mut to_next = loop {
            match TcpStream::connect_timeout(&next_addr, opts.timeout) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(io(next, "connect")(e)),
            }
        };
        let mut keys = None;
        if let Some((a, generation)) = &opts.auth {
            to_next.set_read_timeout(Some(opts.timeout)).map_err(io(next, "connect"))?;
            keys = Some(
                auth::connect(&mut to_next, &a.secret, &a.claim("ring", *generation, rank as u64)).map_err(
                    |e| CommError::Rendezvous(format!("rank {rank}: the link to rank {next} refused: {e}")),
                )?,
            );
        }
        let mut to_next = SealedWriter::new(to_next, keys.map(|k| halves(k, opts.encrypt).0));
        let mut hello = MAGIC.to_le_bytes().to_vec();
        hello.extend_from_slice(&(rank as u32).to_le_bytes());
        hello.extend_from_slice(&(world as u32).to_le_bytes());
        to_next.write_all(&hello).map_err(io(next, "connect"))?;
        Ok(to_next)
    }

    /// Waits for the previous rank's link, refusing strays and stale peers.
    fn accept_prev(
        rank: usize,
        world: usize,
        listener: &TcpListener,
        opts: &RingOptions,
        deadline: Instant,
    ) -> Result<SealedReader<TcpStream>, CommError> {
        let prev = (rank + world - 1) % world;
        let io = |peer: usize, op: &'static str| {
            move |source: std::io::Error| CommError::Io { rank, op, peer, source }
        };
        listener.set_nonblocking(true).map_err(io(prev, "accept"))?;
        let timed_out = || CommError::Timeout { rank, op: "accept", peer: prev, after: opts.timeout };
        loop {
            // Checked whatever arrives: a stream of stray peers, each
            // refused in turn, does not keep the ring waiting past it.
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(timed_out());
            }
            match listener.accept() {
                Ok((s, _)) => {
                    s.set_nonblocking(false).map_err(io(prev, "accept"))?;
                    // A peer that connects and then says nothing, or
                    // trickles its handshake a byte at a time, holds the
                    // ring up for a short while only, not the whole timeout.
                    let patience = opts.timeout.min(STRAY_PATIENCE).min(left).max(Duration::from_millis(1));
                    match Self::admit(rank, world, s, opts, patience) {
                        Ok(s) => return Ok(s),
                        // A stray or stale peer: drop it, keep waiting for ours.
                        Err(why) => eprintln!("ring rank {rank}: {why}"),
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => return Err(io(prev, "accept")(e)),
            }
        }
    }

    /// Takes an accepted link if it is the previous rank of this ring: it
    /// proves the job's secret, generation and rank (where the ring has a
    /// secret), then introduces itself. Everything a peer must send before
    /// it is proven is read under one deadline, `patience` from now, however
    /// it is spread over time; a proven peer's sealed introduction is read
    /// with what is left of it as its reads' timeout. `Err` says why the link
    /// was dropped.
    fn admit(
        rank: usize,
        world: usize,
        mut s: TcpStream,
        opts: &RingOptions,
        patience: Duration,
    ) -> Result<SealedReader<TcpStream>, String> {
        let prev = (rank + world - 1) % world;
        let until = Instant::now() + patience;
        let mut got = [0u8; 12];
        let unintroduced = |e: std::io::Error| format!("dropped a link that did not introduce itself: {e}");
        let mut keys = None;
        {
            let mut within = auth::Deadline::new(&mut s, patience);
            match &opts.auth {
                Some((a, generation)) => {
                    let (_, k) = auth::accept(&mut within, &a.secret, |c| {
                        a.check(c, "ring", Some(*generation))?;
                        (c.who == prev as u64).then_some(()).ok_or_else(|| {
                            format!("rank {rank} takes its link from rank {prev}, not {}", c.who)
                        })
                    })
                    .map_err(|e| format!("refused a link: {e}"))?;
                    keys = Some(k);
                }
                // No secret: the introduction is all a peer says first.
                None => within.read_exact(&mut got).map_err(unintroduced)?,
            }
        }
        let proven = keys.is_some();
        let mut s = SealedReader::new(s, keys.map(|k| halves(k, opts.encrypt).1));
        if proven {
            let left = until.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            s.get_ref().set_read_timeout(Some(left)).map_err(unintroduced)?;
            s.read_exact(&mut got).map_err(unintroduced)?;
        }
        let word = |i: usize| u32::from_le_bytes(got[i * 4..i * 4 + 4].try_into().expect("4 bytes"));
        if word(0) == MAGIC && word(1) as usize == prev && word(2) as usize == world {
            return Ok(s);
        }
        Err(format!(
            "dropped a link that is not rank {prev}'s of this ring (a stale generation, a stray client)"
        ))
    }

    fn check(&self) -> Result<(), CommError> {
        match &self.broken {
            Some(why) => Err(CommError::Broken { rank: self.rank, why: why.clone() }),
            None => Ok(()),
        }
    }

    /// Marks the ring unusable and closes it, so that the neighbours' pending
    /// operations fail at once instead of waiting for their timeout.
    fn fail(&mut self, err: CommError) -> CommError {
        self.broken = Some(err.to_string());
        if let Some(links) = self.links.take() {
            links.close();
        }
        err
    }

    fn io_error(&self, op: &'static str, peer: usize, e: std::io::Error) -> CommError {
        match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => {
                CommError::Timeout { rank: self.rank, op, peer, after: self.opts.timeout }
            }
            ErrorKind::UnexpectedEof
            | ErrorKind::ConnectionReset
            | ErrorKind::BrokenPipe
            | ErrorKind::ConnectionAborted => CommError::PeerClosed { rank: self.rank, op, peer },
            _ => CommError::Io { rank: self.rank, op, peer, source: e },
        }
    }
}

/// A buffer shared by the sender and receiver threads of one all-reduce.
#[derive(Clone, Copy)]
struct Shared {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: the two threads touch the same segment only in the order the
// algorithm imposes: the sender reads a segment after the receiver has
// finished writing it (a channel message), and the receiver overwrites a
// segment only with data that causally follows the sender's write of it.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Shared {
    /// # Safety
    /// No other thread writes `range` meanwhile (its bounds are checked here).
    unsafe fn slice(&self, range: Range<usize>) -> &[f32] {
        assert!(range.start <= range.end && range.end <= self.len, "segment {range:?} of {}", self.len);
        // SAFETY: in bounds (checked above); the caller keeps writers away.
        unsafe { std::slice::from_raw_parts(self.ptr.add(range.start), range.len()) }
    }
    /// # Safety
    /// No other thread touches `range` meanwhile (its bounds are checked here).
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice_mut(&self, range: Range<usize>) -> &mut [f32] {
        assert!(range.start <= range.end && range.end <= self.len, "segment {range:?} of {}", self.len);
        // SAFETY: in bounds (checked above); the caller keeps other threads away.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len()) }
    }
}

fn chunk(len: usize, n: usize, c: usize) -> Range<usize> {
    (c * len / n)..((c + 1) * len / n)
}

fn segments(r: Range<usize>, seg: usize) -> impl Iterator<Item = Range<usize>> {
    let seg = seg.max(1);
    (r.start..r.end).step_by(seg).map(move |s| s..(s + seg).min(r.end))
}

/// A failure on one link: the rank at its other end, and the error.
type LinkFailure = (usize, std::io::Error);

/// Which part of the buffer each step of one rank's all-reduce moves. Of
/// the 2(n - 1) steps, the first n - 1 reduce-scatter (each adds the chunk
/// it receives) and the last n - 1 all-gather (each copies it).
#[derive(Clone, Copy)]
struct Schedule {
    rank: usize,
    world: usize,
    /// Values in the buffer.
    len: usize,
    /// Values per pipelined segment.
    segment: usize,
}

impl Schedule {
    fn steps(&self) -> usize {
        2 * (self.world - 1)
    }

    fn next(&self) -> usize {
        (self.rank + 1) % self.world
    }

    fn prev(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    /// Whether step `i` adds what it receives (reduce-scatter) rather than
    /// copying it (all-gather).
    fn reduces(&self, i: usize) -> bool {
        i < self.world - 1
    }

    /// The chunk step `i` sends; for i >= 1 it is the one step i - 1 received.
    fn sent_chunk(&self, i: usize) -> usize {
        let (n, r) = (self.world, self.rank);
        if i < n - 1 { (r + n - i) % n } else { (r + 1 + n - (i - (n - 1))) % n }
    }

    /// The chunk step `i` receives.
    fn received_chunk(&self, i: usize) -> usize {
        let (n, r) = (self.world, self.rank);
        if i < n - 1 { (r + 2 * n - i - 1) % n } else { (r + n - (i - (n - 1))) % n }
    }

    /// The segments step `i` sends, in order.
    fn sent(&self, i: usize) -> impl Iterator<Item = Range<usize>> {
        segments(chunk(self.len, self.world, self.sent_chunk(i)), self.segment)
    }

    /// The segments step `i` receives, in order.
    fn received(&self, i: usize) -> impl Iterator<Item = Range<usize>> {
        segments(chunk(self.len, self.world, self.received_chunk(i)), self.segment)
    }
}

/// The sending half of an all-reduce: ships each segment of every step to
/// the next rank, after step 0 only once the receiving half has said (on
/// `done`) that it has finished the segment. A failed send closes the link from
/// the previous rank, so that the receiving half stops too.
fn send_segments(
    schedule: Schedule,
    shared: Shared,
    to_next: &mut SealedWriter<TcpStream>,
    done: mpsc::Receiver<()>,
    timeout: Duration,
    prev_sock: &TcpStream,
) -> Result<(), LinkFailure> {
    for i in 0..schedule.steps() {
        for s in schedule.sent(i) {
            if i > 0 && done.recv_timeout(timeout).is_err() {
                // The receiving side failed or stalled; it reports why.
                return Ok(());
            }
            // SAFETY: segment s of this chunk was finished by the receiver
            // (the message above), and it does not write it again until
            // data that follows this write comes back around the ring.
            let data = unsafe { shared.slice(s) };
            if let Err(e) = to_next.write_all(bytemuck::cast_slice(data)) {
                let _ = prev_sock.shutdown(Shutdown::Both);
                return Err((schedule.next(), e));
            }
        }
    }
    Ok(())
}

/// The receiving half of an all-reduce: reads each segment of every step
/// from the previous rank into `scratch`, adds it into the buffer or copies
/// it there, and tells the sending half (on `done`) that it may send it on.
fn receive_segments(
    schedule: Schedule,
    shared: Shared,
    from_prev: &mut SealedReader<TcpStream>,
    scratch: &mut [f32],
    done: mpsc::Sender<()>,
    timeout: Duration,
    prev_sock: &TcpStream,
) -> Result<(), LinkFailure> {
    let prev = schedule.prev();
    // Each read must make progress within the timeout.
    prev_sock.set_read_timeout(Some(timeout)).map_err(|e| (prev, e))?;
    for i in 0..schedule.steps() {
        for s in schedule.received(i) {
            let tmp = &mut scratch[..s.len()];
            from_prev.read_exact(bytemuck::cast_slice_mut(tmp)).map_err(|e| (prev, e))?;
            // SAFETY: the sender is not reading this segment now (see `send_segments`).
            let dst = unsafe { shared.slice_mut(s) };
            if schedule.reduces(i) {
                for (d, v) in dst.iter_mut().zip(tmp.iter()) {
                    *d += *v;
                }
            } else {
                dst.copy_from_slice(tmp);
            }
            let _ = done.send(());
        }
    }
    Ok(())
}

impl TcpRing {
    /// Reduce-scatter then all-gather of `buf` (in a ring of two or more),
    /// sending and receiving on two threads so that both overlap the
    /// additions. First each rank tells the next how many values it
    /// reduces: ranks that disagree (a program's arrays of different
    /// lengths) fail at once, saying both, instead of reading each other's
    /// values out of step until the timeout.
    fn reduce_around_ring(&mut self, buf: &mut [f32]) -> Result<(), LinkFailure> {
        let schedule = Schedule {
            rank: self.rank,
            world: self.world,
            len: buf.len(),
            segment: (self.opts.segment_bytes / 4).max(1),
        };
        self.same_length(schedule)?;
        if buf.is_empty() {
            return Ok(());
        }
        if self.scratch.len() < schedule.segment {
            self.scratch.resize(schedule.segment, 0.0);
        }
        let shared = Shared { ptr: buf.as_mut_ptr(), len: buf.len() };
        let timeout = self.opts.timeout;
        let Links { to_next, from_prev, next_sock, prev_sock } =
            self.links.as_mut().expect("a ring of two or more has links");
        let (next_sock, prev_sock) = (&*next_sock, &*prev_sock);
        let scratch = &mut self.scratch;
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let (sent, received) = std::thread::scope(|scope| {
            let sender =
                scope.spawn(move || send_segments(schedule, shared, to_next, done_rx, timeout, prev_sock));
            let received =
                receive_segments(schedule, shared, from_prev, scratch, done_tx, timeout, prev_sock);
            if received.is_err() {
                let _ = next_sock.shutdown(Shutdown::Both);
            }
            let sent = sender
                .join()
                .unwrap_or_else(|_| Err((schedule.next(), std::io::Error::other("sender panicked"))));
            (sent, received)
        });
        received.and(sent)
    }
}

impl TcpRing {
    /// Tells the next rank this rank's length and checks the previous one's.
    fn same_length(&mut self, schedule: Schedule) -> Result<(), LinkFailure> {
        let (next, prev) = (schedule.next(), schedule.prev());
        let Links { to_next, from_prev, prev_sock, .. } =
            self.links.as_mut().expect("a ring of two or more has links");
        let mine = schedule.len as u64;
        to_next.write_all(&mine.to_le_bytes()).and_then(|()| to_next.flush()).map_err(|e| (next, e))?;
        prev_sock.set_read_timeout(Some(self.opts.timeout)).map_err(|e| (prev, e))?;
        let mut theirs = [0u8; 8];
        from_prev.read_exact(&mut theirs).map_err(|e| (prev, e))?;
        let theirs = u64::from_le_bytes(theirs);
        if theirs != mine {
            let why = format!("rank {prev} all-reduces {theirs} values, rank {} {mine}", self.rank);
            return Err((prev, std::io::Error::new(ErrorKind::InvalidData, why)));
        }
        Ok(())
    }
}

impl Communicator for TcpRing {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        self.check()?;
        let n = self.world;
        if n > 1
            && let Err((peer, e)) = self.reduce_around_ring(buf)
        {
            let err = self.io_error("all-reduce", peer, e);
            return Err(self.fail(err));
        }
        if op == ReduceOp::Average && n > 1 {
            let inv = 1.0 / n as f32;
            buf.iter_mut().for_each(|v| *v *= inv);
        }
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        self.check()?;
        let (n, r) = (self.world, self.rank);
        if root >= n {
            return Err(CommError::InvalidArgument(format!("broadcast root {root} of a world of {n}")));
        }
        if n == 1 || buf.is_empty() {
            return Ok(());
        }
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let seg = (self.opts.segment_bytes / 4).max(1);
        let timeout = self.opts.timeout;
        let Links { to_next, from_prev, prev_sock, .. } = self.links.as_mut().expect("links");
        let forward = next != root;
        let result = (|| -> Result<(), (usize, std::io::Error)> {
            // Each read must make progress within the timeout.
            prev_sock.set_read_timeout(Some(timeout)).map_err(|e| (prev, e))?;
            for s in segments(0..buf.len(), seg) {
                if r != root {
                    from_prev
                        .read_exact(bytemuck::cast_slice_mut(&mut buf[s.clone()]))
                        .map_err(|e| (prev, e))?;
                }
                if forward {
                    to_next.write_all(bytemuck::cast_slice(&buf[s])).map_err(|e| (next, e))?;
                }
            }
            Ok(())
        })();
        if let Err((peer, e)) = result {
            let err = self.io_error("broadcast", peer, e);
            return Err(self.fail(err));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{LocalRendezvous, auth::Secret};
    use std::sync::Mutex;

    /// How long the stranger trickles before it gives up on its own.
    const TRICKLE_FOR: usize = 300;

    /// A rendezvous that, once the ranks' addresses are known, has a stranger
    /// connect to rank 1's listener before rank 0 links to it, and trickle a
    /// handshake there a byte at a time.
    struct Trickle {
        inner: LocalRendezvous,
        stranger: Mutex<Option<std::thread::JoinHandle<(usize, bool)>>>,
    }

    impl Rendezvous for Trickle {
        fn exchange(
            &self,
            rank: usize,
            world: usize,
            mine: Vec<u8>,
            timeout: Duration,
        ) -> Result<Vec<Vec<u8>>, CommError> {
            let all = self.inner.exchange(rank, world, mine, timeout)?;
            if rank == 0 {
                let addr: SocketAddr = String::from_utf8_lossy(&all[1]).parse().expect("rank 1's address");
                // Connected before this returns: queued ahead of rank 0's link.
                let s = TcpStream::connect(addr).expect("the stranger connects");
                *self.stranger.lock().unwrap() = Some(std::thread::spawn(move || trickle(s)));
            }
            Ok(all)
        }
    }

    /// Announces a frame of 4000 bytes (the secret's exchange reads it all)
    /// and sends one byte of it every 200 ms: each read of the acceptor gets
    /// a byte long before any per-read timeout. Returns how many bytes went
    /// and whether the far side dropped the link before the stranger gave up
    /// (a minute in).
    fn trickle(mut s: TcpStream) -> (usize, bool) {
        let header = 4000u32.to_le_bytes();
        for sent in 0..TRICKLE_FOR {
            let byte = header.get(sent).copied().unwrap_or(0x55);
            if s.write_all(&[byte]).is_err() {
                return (sent, true);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        (TRICKLE_FOR, false)
    }

    #[test]
    fn a_stranger_trickling_its_handshake_is_dropped_and_the_ring_still_forms() {
        let job = JobAuth { job: "j".into(), secret: Secret::generate().unwrap() };
        // With the secret, the stranger trickles the secret's exchange; without
        // it, the introduction.
        for auth in [Some((job, 1)), None] {
            let rdv = Trickle { inner: LocalRendezvous::new(), stranger: Mutex::new(None) };
            let o = RingOptions {
                timeout: Duration::from_secs(20),
                auth: auth.clone(),
                ..RingOptions::default()
            };
            assert!(STRAY_PATIENCE < o.timeout);
            let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..2)
                    .map(|rank| {
                        let (rdv, o) = (&rdv, o.clone());
                        s.spawn(move || {
                            let mut ring = TcpRing::connect(rank, 2, rdv, o).expect("the ring forms");
                            let mut buf = vec![rank as f32 + 1.0; 1000];
                            ring.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                            buf
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            assert!(sums.iter().all(|b| b.iter().all(|&v| v == 3.0)), "secret {}", auth.is_some());
            let stranger = rdv.stranger.lock().unwrap().take().expect("a stranger came");
            let (sent, dropped) = stranger.join().unwrap();
            assert!(dropped, "the stranger was dropped before it gave up, after {sent} bytes");
        }
    }

    /// Ranks that all-reduce arrays of different lengths (an empty one
    /// included) fail, saying both lengths or that the other failed;
    /// arrays of one length, empty ones too, reduce as ever.
    #[test]
    fn ranks_that_all_reduce_different_lengths_fail_saying_both() {
        let run = |lens: [usize; 3]| -> Vec<Result<Vec<f32>, String>> {
            let rdv = LocalRendezvous::new();
            let o = RingOptions { timeout: Duration::from_secs(120), ..RingOptions::default() };
            std::thread::scope(|s| {
                let hs: Vec<_> = (0..3)
                    .map(|rank| {
                        let (rdv, o) = (&rdv, o.clone());
                        s.spawn(move || {
                            let mut ring = TcpRing::connect(rank, 3, rdv, o).expect("the ring forms");
                            let mut buf = vec![1.0; lens[rank]];
                            ring.all_reduce(&mut buf, ReduceOp::Sum).map(|()| buf).map_err(|e| e.to_string())
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            })
        };
        let got = run([4, 3, 4]);
        let said: Vec<&String> = got.iter().filter_map(|r| r.as_ref().err()).collect();
        assert_eq!(said.len(), 3, "every rank fails: {got:?}");
        assert!(said.iter().any(|e| e.contains("rank 0 all-reduces 4 values, rank 1 3")), "{said:?}");
        assert!(said.iter().any(|e| e.contains("rank 1 all-reduces 3 values, rank 2 4")), "{said:?}");
        let got = run([0, 2, 2]);
        assert!(got.iter().all(|r| r.is_err()), "the rank with none fails too: {got:?}");
        assert_eq!(run([2, 2, 2]).into_iter().map(Result::unwrap).collect::<Vec<_>>(), vec![vec![3.0; 2]; 3]);
        assert_eq!(
            run([0, 0, 0]).into_iter().map(Result::unwrap).collect::<Vec<_>>(),
            vec![Vec::<f32>::new(); 3]
        );
    }
}
