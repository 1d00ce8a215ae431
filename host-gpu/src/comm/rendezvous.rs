//! How the ranks of a generation find each other: each publishes a few bytes
//! (its listening address, an NCCL unique id) and receives everyone's.

use super::CommError;
use super::auth::{self, Claim, JobAuth, Keys};
use super::kv::{self, KvStore};
use super::sealed::SealedStream;
use std::{
    collections::HashMap,
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    sync::atomic::{AtomicU64, Ordering},
    sync::{Arc, Condvar, Mutex},
    time::{Duration, Instant},
};

/// An exchange of one value per rank.
pub trait Rendezvous: Send + Sync {
    /// Publishes `mine` as `rank`'s value and returns all `world` values in
    /// rank order once every rank has published, or fails after `timeout`.
    fn exchange(
        &self,
        rank: usize,
        world: usize,
        mine: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>, CommError>;
}

/// Each rank's published value, once it has published.
type Slots = Vec<Option<Vec<u8>>>;

/// In-process rendezvous (ranks as threads); one per generation.
#[derive(Clone, Default)]
pub struct LocalRendezvous {
    inner: Arc<(Mutex<Slots>, Condvar)>,
}

impl LocalRendezvous {
    pub fn new() -> Self {
        Self::default()
    }
}

impl Rendezvous for LocalRendezvous {
    fn exchange(
        &self,
        rank: usize,
        world: usize,
        mine: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>, CommError> {
        let (lock, cv) = &*self.inner;
        let mut slots = lock.lock().unwrap_or_else(|e| e.into_inner());
        if slots.len() < world {
            slots.resize(world, None);
        }
        if rank >= world {
            return Err(CommError::InvalidArgument(format!("rank {rank} of a world of {world}")));
        }
        slots[rank] = Some(mine);
        cv.notify_all();
        let deadline = Instant::now() + timeout;
        loop {
            if slots.iter().take(world).all(Option::is_some) {
                return Ok(slots.iter().take(world).map(|s| s.clone().unwrap_or_default()).collect());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let missing: Vec<usize> = (0..world).filter(|&r| slots[r].is_none()).collect();
                return Err(CommError::Rendezvous(format!(
                    "ranks {missing:?} did not arrive within {timeout:?}"
                )));
            }
            slots = cv.wait_timeout(slots, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

/// A rendezvous server for ranks in separate processes: collects the values
/// published under a key (one key per generation) and answers every rank of
/// that key once all have arrived.
///
/// With the job's secret it also serves the generation's key-value store
/// ([`KvStore`]) on the same port, to connections that claim its channel.
pub struct RendezvousServer {
    addr: SocketAddr,
    /// The current generation: registrations of other ones are refused.
    generation: Arc<AtomicU64>,
    store: Arc<KvStore>,
    /// The largest world a registration may name.
    max_world: Arc<AtomicU64>,
}

/// Registrations waiting for the rest of their world, by key: the world,
/// when the first came, and each rank's value and connection.
type Waiting = HashMap<String, (usize, std::time::Instant, Vec<Option<(Vec<u8>, SealedStream)>>)>;

/// How long a key waits for the rest of its ranks before it is dropped
/// (its ranks gave up long before: their rendezvous has a deadline).
const KEY_TTL: Duration = Duration::from_secs(300);

/// The largest world a registration may name by default.
pub const DEFAULT_MAX_WORLD: usize = 1 << 16;

fn read_frame(s: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > 1 << 20 {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "rendezvous frame over 1 MiB"));
    }
    let mut buf = vec![0u8; len];
    s.read_exact(&mut buf)?;
    Ok(buf)
}

/// Appends one frame to a message being built (sent whole with one write).
fn frame(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// How long a client may take to prove the secret, and then each of its reads.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);

/// One rank's registration: the key of its generation, its place in the
/// world, and the value it publishes.
struct Registration {
    key: String,
    rank: usize,
    world: usize,
    value: Vec<u8>,
}

impl Registration {
    /// Reads the three frames of a registration (key, header, value) and
    /// checks the header's rank and world.
    fn read(conn: &mut SealedStream, max_world: usize) -> std::io::Result<Self> {
        let key = String::from_utf8_lossy(&read_frame(conn)?).into_owned();
        let header = read_frame(conn)?;
        let value = read_frame(conn)?;
        let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "bad rendezvous header");
        let word = |at: usize| -> std::io::Result<usize> {
            let bytes = header.get(at..at + 4).ok_or_else(bad)?.try_into().map_err(|_| bad())?;
            Ok(u32::from_le_bytes(bytes) as usize)
        };
        let (rank, world) = (word(0)?, word(4)?);
        if world == 0 || rank >= world {
            return Err(bad());
        }
        if world > max_world {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("a world of {world}, above the generation's ({max_world})"),
            ));
        }
        Ok(Registration { key, rank, world, value })
    }

    /// Joins the ranks waiting under the same key; the last to arrive
    /// answers every one of them with all the values in rank order.
    fn wait_or_answer(self, waiting: &Mutex<Waiting>, conn: SealedStream) -> std::io::Result<()> {
        let Registration { key, rank, world, value } = self;
        let mut all = waiting.lock().unwrap_or_else(|e| e.into_inner());
        // Keys whose ranks never all came (their clients gave up) go.
        all.retain(|_, (_, since, _)| since.elapsed() < KEY_TTL);
        let entry = all
            .entry(key.clone())
            .or_insert_with(|| (world, std::time::Instant::now(), (0..world).map(|_| None).collect()));
        if entry.0 != world {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "world size differs from other ranks",
            ));
        }
        entry.2[rank] = Some((value, conn));
        if entry.2.iter().all(Option::is_some) {
            let (_, _, ranks) = all.remove(&key).expect("entry exists");
            drop(all);
            let (values, conns): (Vec<Vec<u8>>, Vec<SealedStream>) =
                ranks.into_iter().map(|r| r.expect("all present")).unzip();
            let mut answer = (values.len() as u32).to_le_bytes().to_vec();
            for v in &values {
                frame(&mut answer, v);
            }
            for mut c in conns {
                let _ = c.write_all(&answer);
            }
        }
        Ok(())
    }
}

impl RendezvousServer {
    /// Serves on `addr` (port 0 picks one) from a background thread, to
    /// anyone.
    pub fn start(addr: &str) -> std::io::Result<Self> {
        Self::start_with(addr, None)
    }

    /// Serves on `addr`; with `auth`, a client registers only after proving
    /// the job's secret for the current generation ([`Self::set_generation`]).
    pub fn start_with(addr: &str, auth: Option<JobAuth>) -> std::io::Result<Self> {
        let listener = super::listen::listen_on(addr)?;
        let addr = listener.local_addr()?;
        let waiting: Arc<Mutex<Waiting>> = Arc::default();
        let generation = Arc::new(AtomicU64::new(0));
        let store = Arc::new(KvStore::default());
        let max_world = Arc::new(AtomicU64::new(DEFAULT_MAX_WORLD as u64));
        let (current, kv, most) = (generation.clone(), store.clone(), max_world.clone());
        // Before a client has proven the secret, it costs a thread for at
        // most the handshake's deadline, and only so many at once (and so
        // many from one address): the next wait to be served. Clients
        // dropped are said at most once a second, with a count.
        let dropped = Arc::new(super::accept::Refusals::default());
        super::accept::serve_each(listener, "edl-rendezvous", "rendezvous", move |conn, place| {
            let most = most.load(Ordering::Relaxed) as usize;
            let proved = move || drop(place);
            if let Err(e) = Self::serve(conn, &waiting, auth.as_ref(), &current, &kv, most, proved) {
                dropped.warn(&format_args!("rendezvous: dropped a client: {e}"));
            }
        })?;
        Ok(RendezvousServer { addr, generation, store, max_world })
    }

    /// The largest world a registration may name (the generation's size):
    /// a registration naming more is refused before anything is sized by it.
    pub fn set_max_world(&self, n: usize) {
        self.max_world.store(n.max(1) as u64, Ordering::Relaxed);
    }

    /// The generation whose ranks may register now.
    pub fn set_generation(&self, generation: u64) {
        self.generation.store(generation, Ordering::SeqCst);
        self.store.set_generation(generation);
    }

    /// Serves one client; `proved` is called once, when the client has
    /// proven the secret or failed to.
    fn serve(
        mut conn: TcpStream,
        waiting: &Mutex<Waiting>,
        auth: Option<&JobAuth>,
        generation: &AtomicU64,
        store: &KvStore,
        max_world: usize,
        proved: impl FnOnce(),
    ) -> std::io::Result<()> {
        conn.set_read_timeout(Some(CLIENT_TIMEOUT))?;
        // Answers go out as several small writes (length, then bytes): with
        // Nagle's algorithm each exchange waited for the client's delayed
        // ACK, about 40 ms per store request.
        conn.set_nodelay(true)?;
        let keys = match auth {
            None => {
                proved();
                None
            }
            Some(a) => {
                let (claim, keys) = Self::admit(&mut conn, a, generation, proved)?;
                if claim.channel == kv::CHANNEL {
                    return store.serve(&mut SealedStream::new(conn, Some(keys))?, claim.generation);
                }
                Some(keys)
            }
        };
        let mut conn = SealedStream::new(conn, keys)?;
        let registration = Registration::read(&mut conn, max_world)?;
        registration.wait_or_answer(waiting, conn)
    }

    /// Has the client prove the job's secret and claim the rendezvous or
    /// the store channel of the current generation; calls `proved` once the
    /// handshake is over, whatever its outcome.
    fn admit(
        conn: &mut TcpStream,
        auth: &JobAuth,
        generation: &AtomicU64,
        proved: impl FnOnce(),
    ) -> std::io::Result<(Claim, Keys)> {
        let peer = conn.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "a client".into());
        let g = generation.load(Ordering::SeqCst);
        let mut within = auth::Deadline::new(conn, CLIENT_TIMEOUT);
        let accepted = auth::accept(&mut within, &auth.secret, |c| {
            let channel = if c.channel == kv::CHANNEL { kv::CHANNEL } else { "rendezvous" };
            auth.check(c, channel, Some(g))
        });
        drop(within);
        proved();
        let admitted = accepted.map_err(|e| {
            std::io::Error::new(std::io::ErrorKind::PermissionDenied, format!("refused {peer}: {e}"))
        })?;
        // A proven client's requests get the usual timeout.
        conn.set_read_timeout(Some(CLIENT_TIMEOUT))?;
        Ok(admitted)
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

/// A client of a [`RendezvousServer`], for one generation (`key`).
#[derive(Clone, Debug)]
pub struct TcpRendezvous {
    server: SocketAddr,
    key: String,
    auth: Option<(JobAuth, u64)>,
}

impl TcpRendezvous {
    pub fn new(server: SocketAddr, key: impl Into<String>) -> Self {
        TcpRendezvous { server, key: key.into(), auth: None }
    }

    /// Proves the job's secret for `generation` before registering.
    pub fn with_auth(self, auth: JobAuth, generation: u64) -> Self {
        TcpRendezvous { auth: Some((auth, generation)), ..self }
    }
}

impl Rendezvous for TcpRendezvous {
    fn exchange(
        &self,
        rank: usize,
        world: usize,
        mine: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>, CommError> {
        let io = |e: std::io::Error| CommError::Rendezvous(format!("{}: {e}", self.server));
        let mut s = TcpStream::connect_timeout(&self.server, timeout).map_err(io)?;
        s.set_read_timeout(Some(timeout)).map_err(io)?;
        s.set_write_timeout(Some(timeout)).map_err(io)?;
        // The registration goes out as several small frames (see `serve`).
        s.set_nodelay(true).map_err(io)?;
        let mut keys = None;
        if let Some((a, generation)) = &self.auth {
            keys = Some(
                auth::connect(&mut s, &a.secret, &a.claim("rendezvous", *generation, rank as u64))
                    .map_err(|e| CommError::Rendezvous(format!("{}: {e}", self.server)))?,
            );
        }
        let mut s = SealedStream::new(s, keys).map_err(io)?;
        let mut header = (rank as u32).to_le_bytes().to_vec();
        header.extend_from_slice(&(world as u32).to_le_bytes());
        let mut registration = Vec::new();
        frame(&mut registration, self.key.as_bytes());
        frame(&mut registration, &header);
        frame(&mut registration, &mine);
        s.write_all(&registration).map_err(io)?;
        let mut n = [0u8; 4];
        s.read_exact(&mut n).map_err(|e| {
            CommError::Rendezvous(format!(
                "not every rank of {:?} arrived within {timeout:?} ({e})",
                self.key
            ))
        })?;
        (0..u32::from_le_bytes(n)).map(|_| read_frame(&mut s).map_err(io)).collect()
    }
}
