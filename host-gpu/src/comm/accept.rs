//! Accepting a listener's connections, each served on a thread of its own,
//! with a bound on those that have not yet proven the job's secret: a port
//! open to a network costs at most [`MAX_PROVING`] threads, each for at most
//! its handshake's deadline, however fast connections are opened; and no
//! one address holds more than [`MAX_PROVING_PER_PEER`] of them, so that a
//! stranger opening connections that prove nothing delays its own, not the
//! others'. (An IPv6 stranger free to take any address of its prefix counts
//! as as many strangers: the workers of a subnet share one /64, and must
//! not share a bound with it.)

use std::{
    cell::Cell,
    collections::{HashMap, VecDeque},
    net::{IpAddr, TcpListener, TcpStream},
    sync::{Arc, Condvar, Mutex},
    time::{Duration, Instant},
};

/// Most connections of one listener proving the secret at once; past it,
/// the next is accepted only once a place is given up (it waits in the
/// listener's queue meanwhile).
pub const MAX_PROVING: usize = 256;

/// Most places one address holds at once; its next connections wait,
/// accepted and not served, until one of its places is given up.
pub const MAX_PROVING_PER_PEER: usize = MAX_PROVING / 4;

/// Most connections of one listener waiting for their address's place,
/// all addresses together, where the process may open many files; past
/// it, a connection from an address at its bound is closed.
pub const MAX_WAITING: usize = 16_384;

/// The files this process may open (the soft `RLIMIT_NOFILE`), where the
/// system says.
pub fn open_files_limit() -> Option<usize> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit(2) only writes the struct it is given, a valid,
    // exclusively borrowed local of the type it expects.
    let got = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
    got.then(|| usize::try_from(limit.rlim_cur).unwrap_or(usize::MAX))
}

/// [`MAX_WAITING`], or an eighth of the files the process may open where
/// that is fewer: connections waiting hold a descriptor each, and a
/// stranger must not use up the process's.
fn waiting_bound() -> usize {
    MAX_WAITING.min(open_files_limit().unwrap_or(1024) / 8).max(16)
}

/// Who a place is counted against: the peer's address, an IPv4 address
/// mapped into IPv6 as itself.
fn peer_of(ip: IpAddr) -> IpAddr {
    ip.to_canonical()
}

/// Starts a thread named `name` running `f`; a thread that cannot start
/// drops `f` on the caller's thread.
type StartThread = fn(&str, Box<dyn FnOnce() + Send>) -> std::io::Result<()>;

fn start_thread(name: &str, f: Box<dyn FnOnce() + Send>) -> std::io::Result<()> {
    std::thread::Builder::new().name(name.into()).spawn(f).map(drop)
}

thread_local! {
    /// This thread is handing a place on (see [`Proving`]'s drop).
    static HANDING_ON: Cell<bool> = const { Cell::new(false) };
}

/// Serves one connection with its place.
type Serve = Arc<dyn Fn(TcpStream, Proving) + Send + Sync>;

/// The places taken, by whom, and a wake-up when one is given up.
struct Places {
    state: Mutex<Taken>,
    freed: Condvar,
    serve: Serve,
    start: StartThread,
    conn_name: String,
    what: &'static str,
}

#[derive(Default)]
struct Taken {
    all: usize,
    /// Each address's places, and its connections waiting for one.
    peers: HashMap<IpAddr, Peer>,
    waiting: usize,
}

#[derive(Default)]
struct Peer {
    taken: usize,
    waiting: VecDeque<TcpStream>,
}

impl Places {
    fn lock(&self) -> std::sync::MutexGuard<'_, Taken> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Serves `conn` from `peer` with a place taken for it.
    fn serve(self: &Arc<Self>, conn: TcpStream, peer: IpAddr) {
        let (place, serve) = (Proving(self.clone(), peer), self.serve.clone());
        // A thread that cannot start drops its closure, and the place with it.
        if let Err(e) = (self.start)(&self.conn_name, Box::new(move || serve(conn, place))) {
            tracing::warn!("{}: no thread for a new connection: {e}", self.what);
        }
    }
}

/// A connection's place among its listener's connections proving the
/// secret, given up when dropped (once it has proven it, or failed to):
/// to the next connection of the same address waiting for one, if any.
pub struct Proving(Arc<Places>, IpAddr);

impl Drop for Proving {
    fn drop(&mut self) {
        let Proving(places, peer) = self;
        // A place handed on whose thread did not start comes back here, on
        // the same thread: it is freed then, and its address's waiting
        // connections closed, rather than handed on again and again.
        let failed_start = HANDING_ON.with(Cell::get);
        let (next, closed) = {
            let mut t = places.lock();
            let Taken { all, peers, waiting } = &mut *t;
            let p = peers.entry(*peer).or_default();
            let next = if failed_start { None } else { p.waiting.pop_front() };
            let closed = if failed_start { std::mem::take(&mut p.waiting) } else { VecDeque::new() };
            *waiting -= next.iter().count() + closed.len();
            if next.is_none() {
                p.taken = p.taken.saturating_sub(1);
                *all = all.saturating_sub(1);
                if p.taken == 0 && p.waiting.is_empty() {
                    peers.remove(peer);
                }
            }
            (next, closed)
        };
        drop(closed);
        match next {
            // The place goes on to it, served outside the lock.
            Some(conn) => {
                HANDING_ON.with(|h| h.set(true));
                places.serve(conn, *peer);
                HANDING_ON.with(|h| h.set(false));
            }
            None => places.freed.notify_one(),
        }
    }
}

/// Accepts `listener`'s connections on a thread named `name` and serves
/// each with `serve` on a thread of its own (`name`-conn), with its
/// [`Proving`] place: `serve` drops it once the secret is proven. With
/// [`MAX_PROVING`] places taken, the next connection is accepted only once
/// one is given up (each is given up within its handshake's deadline, so a
/// stranger holding every place delays the others, it does not turn them
/// away; said at the 1st, 2nd, 4th, 8th... wait, so that a flood does not
/// flood the log). An address holding [`MAX_PROVING_PER_PEER`] places has
/// its next connections wait for one of its own, accepted (at most
/// [`MAX_WAITING`] of them, fewer where the process may open fewer files;
/// past that they are closed), while the others' are served. An accept that fails (out of descriptors) is tried again
/// 100 ms later rather than at once. `what` names the listener in its
/// warnings.
pub fn serve_each<F>(listener: TcpListener, name: &str, what: &'static str, serve: F) -> std::io::Result<()>
where
    F: Fn(TcpStream, Proving) + Clone + Send + Sync + 'static,
{
    let places = Arc::new(Places {
        state: Mutex::default(),
        freed: Condvar::new(),
        serve: Arc::new(serve),
        start: start_thread,
        conn_name: format!("{name}-conn"),
        what,
    });
    std::thread::Builder::new().name(name.into()).spawn(move || {
        let mut waits = 0u64;
        let full = Refusals::default();
        let most_waiting = waiting_bound();
        loop {
            let mut taken = places.lock();
            if taken.all >= MAX_PROVING {
                waits += 1;
                if waits.is_power_of_two() {
                    tracing::warn!(
                        "{what}: {MAX_PROVING} connections proving the secret; the next waits for one to end \
                         ({waits} waits so far)"
                    );
                }
                while taken.all >= MAX_PROVING {
                    taken = places.freed.wait(taken).unwrap_or_else(|p| p.into_inner());
                }
            }
            drop(taken);
            let (conn, from) = match listener.accept() {
                Ok(c) => c,
                Err(e) => {
                    // The connection stays queued: wait for descriptors
                    // to close instead of spinning on it.
                    tracing::warn!("{what}: accept: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            let peer = peer_of(from.ip());
            let mut taken = places.lock();
            let at_bound = taken.peers.get(&peer).is_some_and(|p| p.taken >= MAX_PROVING_PER_PEER);
            if !at_bound {
                taken.all += 1;
                taken.peers.entry(peer).or_default().taken += 1;
                drop(taken);
                places.serve(conn, peer);
            } else if taken.waiting < most_waiting {
                taken.waiting += 1;
                taken.peers.entry(peer).or_default().waiting.push_back(conn);
            } else {
                drop(taken);
                let why = format!("{most_waiting} connections wait for their address's places already");
                full.refused(&format!("a connection to the {what}"), &from.to_string(), &why);
            }
        }
    })?;
    Ok(())
}

/// The warnings of refused connections, at most one a second, each with
/// the count of those refused since the last said: connections that fail
/// the secret's check as fast as they can be opened (a port open to a
/// network, a scanner) do not flood the log.
#[derive(Default)]
pub struct Refusals {
    /// When the last warning was said, and how many refusals went unsaid since.
    said: std::sync::Mutex<(Option<Instant>, u64)>,
}

impl Refusals {
    /// Whether a refusal at `now` is said, and if so how many before it
    /// went unsaid.
    fn say(&self, now: Instant) -> Option<u64> {
        let mut said = self.said.lock().unwrap_or_else(|p| p.into_inner());
        let (last, unsaid) = &mut *said;
        if last.is_some_and(|t| now.saturating_duration_since(t) < Duration::from_secs(1)) {
            *unsaid += 1;
            return None;
        }
        *last = Some(now);
        Some(std::mem::take(unsaid))
    }

    /// Warns that `what` from `peer` was refused (`why`), or says it at
    /// debug level within a second of the last warning.
    pub fn refused(&self, what: &str, peer: &str, why: &dyn std::fmt::Display) {
        self.warn(&format_args!("refused {what} from {peer}: {why}"));
    }

    /// Warns `text`, or says it at debug level within a second of the last
    /// warning (the next one counts those).
    pub fn warn(&self, text: &dyn std::fmt::Display) {
        match self.say(Instant::now()) {
            Some(0) => tracing::warn!("{text}"),
            Some(n) => tracing::warn!("{text} ({n} more since the last warning of one, said at debug level)"),
            None => tracing::debug!("{text}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{io::Read, sync::mpsc};

    #[test]
    fn a_mapped_ipv4_address_counts_as_itself() {
        let at = |s: &str| peer_of(s.parse().unwrap());
        assert_eq!(at("::ffff:10.0.0.1"), at("10.0.0.1"));
        assert_ne!(at("10.0.0.1"), at("10.0.0.2"));
        assert_ne!(at("2001:db8:1:2::1"), at("2001:db8:1:2::2"));
    }

    /// Threads that would not start, in the test below.
    static REFUSED_STARTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    /// A place handed on to an address's waiting connection whose thread
    /// does not start comes back to the drop on the same thread: it is
    /// freed and the address's waiting connections are closed, not handed
    /// on again (once per waiting connection, each a level deeper).
    #[test]
    fn a_place_whose_thread_does_not_start_is_freed_and_its_address_s_waiting_closed() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let pair = || {
            let client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            (client, l.accept().unwrap().0)
        };
        let places = Arc::new(Places {
            state: Mutex::default(),
            freed: Condvar::new(),
            serve: Arc::new(|_, _| {}),
            start: |_, f| {
                REFUSED_STARTS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                drop(f);
                Err(std::io::Error::other("no thread"))
            },
            conn_name: "test-conn".into(),
            what: "test",
        });
        let peer = IpAddr::from([127, 0, 0, 1]);
        let mut clients = Vec::new();
        {
            let mut t = places.lock();
            (t.all, t.waiting) = (1, 3);
            let p = t.peers.entry(peer).or_default();
            p.taken = 1;
            for _ in 0..3 {
                let (client, waiting) = pair();
                clients.push(client);
                p.waiting.push_back(waiting);
            }
        }
        // The place's connection has proven itself (or failed): its place
        // goes on to the first waiting, whose thread does not start.
        drop(Proving(places.clone(), peer));
        assert_eq!(REFUSED_STARTS.load(std::sync::atomic::Ordering::SeqCst), 1, "handed on once only");
        let t = places.lock();
        assert_eq!((t.all, t.waiting, t.peers.len()), (0, 0, 0));
        drop(t);
        for mut c in clients {
            c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            assert_eq!(c.read(&mut [0u8; 1]).unwrap(), 0, "the waiting connection was closed");
        }
    }

    #[test]
    fn refused_connections_are_said_at_most_once_a_second_with_the_count_of_those_not_said() {
        let r = Refusals::default();
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        assert_eq!(r.say(at(0)), Some(0), "the first is said");
        assert_eq!(r.say(at(10)), None);
        assert_eq!(r.say(at(999)), None);
        // A second after the last said: said, with the two in between.
        assert_eq!(r.say(at(1000)), Some(2));
        assert_eq!(r.say(at(1500)), None);
        assert_eq!(r.say(at(5000)), Some(1));
        assert_eq!(r.say(at(6000)), Some(0));
    }

    /// A connection from `from` (a loopback address) to `to`.
    fn connect_from(from: [u8; 4], to: std::net::SocketAddr) -> TcpStream {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        s.bind(&std::net::SocketAddr::from((from, 0)).into()).unwrap();
        s.connect(&to.into()).unwrap();
        s.into()
    }

    /// Serves `listener`'s connections by handing each one's place (and the
    /// address it came from) to the test, which holds it until it lets go.
    fn held(listener: TcpListener) -> mpsc::Receiver<(Proving, IpAddr)> {
        let (places_tx, places) = mpsc::channel();
        let places_tx = Arc::new(Mutex::new(places_tx));
        serve_each(listener, "test-accept", "test", move |conn, place| {
            let from = conn.peer_addr().unwrap().ip();
            // Kept open and its place held until the test lets it go.
            std::mem::forget(conn);
            let _ = places_tx.lock().unwrap().send((place, from));
        })
        .unwrap();
        places
    }

    /// Connections that never prove anything hold their places; past the
    /// bound, the next one waits (open, not served) until a place is given
    /// up, and is served then.
    #[test]
    fn past_the_bound_of_connections_proving_the_secret_the_next_waits_for_a_place() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let places = held(listener);
        // From four addresses, each within its own bound.
        let peers = MAX_PROVING / MAX_PROVING_PER_PEER;
        let held: Vec<TcpStream> =
            (0..MAX_PROVING).map(|i| connect_from([127, 0, 0, 1 + (i % peers) as u8], addr)).collect();
        let mut taken: Vec<Proving> =
            (0..MAX_PROVING).map(|_| places.recv_timeout(Duration::from_secs(60)).unwrap().0).collect();
        let mut next = connect_from([127, 0, 0, 9], addr);
        assert!(places.recv_timeout(Duration::from_millis(300)).is_err(), "served past the bound");
        next.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        let e = next.read(&mut [0u8; 1]).unwrap_err();
        assert!(matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut), "{e}");
        drop(taken.pop());
        let (_, from) =
            places.recv_timeout(Duration::from_secs(60)).expect("served once a place was given up");
        assert_eq!(from, IpAddr::from([127, 0, 0, 9]));
        drop(held);
    }

    /// One address holding its bound of places (connections that prove
    /// nothing) has its next connection wait, while another address's is
    /// served at once; given up, one of its places goes to its own next.
    #[test]
    fn an_address_at_its_bound_waits_for_its_own_places_and_delays_no_other() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let places = held(listener);
        let stranger = [127, 0, 0, 7];
        let mut conns: Vec<TcpStream> =
            (0..MAX_PROVING_PER_PEER).map(|_| connect_from(stranger, addr)).collect();
        let mut taken: Vec<Proving> = (0..MAX_PROVING_PER_PEER)
            .map(|_| places.recv_timeout(Duration::from_secs(60)).unwrap().0)
            .collect();
        conns.push(connect_from(stranger, addr));
        conns.push(connect_from([127, 0, 0, 8], addr));
        let (_, from) = places.recv_timeout(Duration::from_secs(60)).expect("the other address is served");
        assert_eq!(from, IpAddr::from([127, 0, 0, 8]));
        assert!(places.recv_timeout(Duration::from_millis(300)).is_err(), "the stranger's next was served");
        drop(taken.pop());
        let (_, from) =
            places.recv_timeout(Duration::from_secs(60)).expect("its next takes the place given up");
        assert_eq!(from, IpAddr::from(stranger));
        drop(conns);
    }
}
