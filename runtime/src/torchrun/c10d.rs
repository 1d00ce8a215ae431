//! The c10d store of a `launch --torchrun` group, kept inside the job.
//!
//! torch's ranks find each other through a c10d `TCPStore` at
//! `MASTER_ADDR:MASTER_PORT`. Left to torch, rank 0 serves it on every
//! interface, in clear, to whoever connects. Here the group's keys live in
//! edl's own store instead ([`GroupStore`], on group rank 0's host: a
//! [`RendezvousServer`]'s key-value store, reached only by a process that
//! proves the job's secret, over a sealed channel). Each host's ranks reach
//! it through a [`Bridge`]: an endpoint on the host's loopback speaking
//! torch's TCPStore protocol, which it forwards over the sealed channel.
//! The ranks are told `MASTER_ADDR=127.0.0.1` and the bridge's port, and
//! `TORCHELASTIC_USE_AGENT_STORE=True`, so no rank starts a store of its own
//! (a program that starts one itself at `MASTER_PORT` finds it taken).
//! What listens beyond loopback is edl's sealed store alone; the bridge
//! serves only connections of the job's own user in the host's network
//! namespace (the kernel's socket tables name each connection's owner).
//!
//! The protocol is torch's (`TCPStoreBackend`): a one-byte request code,
//! keys and values as a u64 length and their bytes, numbers in the host's
//! byte order; the first request of a connection proves it is a TCPStore
//! client (`VALIDATE` and a magic number). Queues and key listing (torch's
//! newest requests) are not served: a rank that asks is told so in the
//! launcher's log and its connection is closed.

use anyhow::{Context, Result, bail};
use edl_host_gpu::comm::{KvClient, RendezvousServer, auth::JobAuth};
use std::{
    io::{ErrorKind, Read, Write},
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

/// The group's store, on group rank 0's host.
pub struct GroupStore {
    server: RendezvousServer,
}

impl GroupStore {
    /// Serves on `ip` (a port picked), to processes that prove `auth`'s secret.
    pub fn serve(ip: IpAddr, auth: JobAuth) -> Result<GroupStore> {
        let server = RendezvousServer::start_with(&SocketAddr::new(ip, 0).to_string(), Some(auth))
            .with_context(|| format!("serving the group's c10d store on {ip}"))?;
        Ok(GroupStore { server })
    }

    /// Empties the store for `group`; connections of the groups before are
    /// refused from now on.
    pub fn open(&self, group: u32) {
        self.server.set_generation(group as u64);
    }

    pub fn port(&self) -> u16 {
        self.server.addr().port()
    }
}

/// torch's request codes (`QueryType`).
mod query {
    pub const VALIDATE: u8 = 0;
    pub const SET: u8 = 1;
    pub const COMPARE_SET: u8 = 2;
    pub const GET: u8 = 3;
    pub const ADD: u8 = 4;
    pub const CHECK: u8 = 5;
    pub const WAIT: u8 = 6;
    pub const GET_NUM_KEYS: u8 = 7;
    pub const DELETE_KEY: u8 = 8;
    pub const APPEND: u8 = 9;
    pub const MULTI_GET: u8 = 10;
    pub const MULTI_SET: u8 = 11;
    pub const CANCEL_WAIT: u8 = 12;
    pub const PING: u8 = 13;
    pub const BARRIER: u8 = 18;

    /// What a request code is called, for a message.
    pub fn name(code: u8) -> String {
        match code {
            14 => "QUEUE_PUSH".into(),
            15 => "QUEUE_POP".into(),
            16 => "QUEUE_LEN".into(),
            17 => "LIST_KEYS".into(),
            other => format!("request {other}"),
        }
    }
}

/// What a first request must carry (torch's `validationMagicNumber`).
const MAGIC: u32 = 0x3C85_F7CE;
/// `CheckResponseType` and `WaitResponseType`.
const READY: u8 = 0;
const NOT_READY: u8 = 1;
const STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;

/// Longest key or value a rank may send (the store's own bound).
const MAX_VALUE: u64 = 16 << 20;
/// Most keys one request may name (the store's own bound).
const MAX_KEYS: u64 = 4096;
/// Most bytes one answer may hold (a MULTI_GET of many large values).
const MAX_ANSWER: usize = 64 << 20;
/// How long the store may take to answer a request that waits for nothing.
const STORE_TIMEOUT: Duration = Duration::from_secs(60);
/// A wait is asked of the store in slices this long, so that a rank's
/// `CANCEL_WAIT` (its own timeout) is heard between them.
const WAIT_SLICE: Duration = Duration::from_millis(250);

/// One host's loopback endpoint for its ranks of one group.
pub struct Bridge {
    addr: SocketAddr,
    open: Arc<AtomicBool>,
}

impl Bridge {
    /// Listens on 127.0.0.1 for the ranks of `group`, forwarding to the
    /// group's store at `store` with `auth`.
    pub fn start(store: SocketAddr, auth: JobAuth, group: u32) -> Result<Bridge> {
        let listener =
            TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("opening the ranks' c10d endpoint")?;
        let addr = listener.local_addr()?;
        let open = Arc::new(AtomicBool::new(true));
        let still = open.clone();
        let connections = Arc::new(AtomicU64::new(0));
        std::thread::Builder::new().name("edl-c10d-bridge".into()).spawn(move || {
            let mut refused = 0u64;
            for conn in listener.incoming() {
                if !still.load(Ordering::SeqCst) {
                    return;
                }
                let conn = match conn {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of descriptors and the like: wait for some to close.
                        eprintln!("c10d store of group {group}: accept: {e}");
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    }
                };
                if let Err(e) = only_our_user(&conn, addr) {
                    refused += 1;
                    if refused.is_power_of_two() {
                        eprintln!("c10d store of group {group}: {e} ({refused} refused so far)");
                    }
                    continue;
                }
                let who = connections.fetch_add(1, Ordering::SeqCst);
                let auth = auth.clone();
                let _ = std::thread::Builder::new().name("edl-c10d-rank".into()).spawn(move || {
                    if let Err(e) = Forward::new(conn, store, &auth, group, who).and_then(Forward::run) {
                        eprintln!("c10d store of group {group}: {e:#}");
                    }
                });
            }
        })?;
        Ok(Bridge { addr, open })
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        self.open.store(false, Ordering::SeqCst);
        // Wakes the accepting thread, which then sees it is closed.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
    }
}

/// Refuses a connection made by another user than this process's (any
/// process on the host may reach loopback; only the job's own may use it).
fn only_our_user(conn: &TcpStream, ours: SocketAddr) -> Result<()> {
    let peer = conn.peer_addr()?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    // The tables are read in pieces while sockets come and go: a row can be
    // missed once, so it is looked for again before the connection is refused.
    let mut owner = socket_owner(peer, ours);
    for _ in 0..2 {
        if owner.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
        owner = socket_owner(peer, ours);
    }
    match owner {
        Some(uid) if uid == me => Ok(()),
        Some(uid) => bail!(
            "refused a connection from {peer} of uid {uid}: only uid {me}, the job's, may use its store"
        ),
        None => bail!("refused a connection from {peer}: its owner is not in /proc/net/tcp"),
    }
}

/// The uid owning the TCP socket `local` connected to `remote`, as the
/// kernel lists it in /proc/net/tcp, or in /proc/net/tcp6 for a dual-stack
/// socket (torch's client is one: its IPv4 peers are `::ffff:a.b.c.d`).
fn socket_owner(local: SocketAddr, remote: SocketAddr) -> Option<u32> {
    // Each 32-bit word of the address as the host reads it, in hex.
    let words = |octets: &[u8]| -> String {
        octets.chunks(4).map(|w| format!("{:08X}", u32::from_ne_bytes([w[0], w[1], w[2], w[3]]))).collect()
    };
    let v4 = |a: SocketAddr| match a.ip() {
        IpAddr::V4(ip) => format!("{}:{:04X}", words(&ip.octets()), a.port()),
        IpAddr::V6(ip) => format!("{}:{:04X}", words(&ip.octets()), a.port()),
    };
    let v6 = |a: SocketAddr| match a.ip() {
        IpAddr::V4(ip) => format!("{}:{:04X}", words(&ip.to_ipv6_mapped().octets()), a.port()),
        IpAddr::V6(ip) => format!("{}:{:04X}", words(&ip.octets()), a.port()),
    };
    [("/proc/net/tcp", v4(local), v4(remote)), ("/proc/net/tcp6", v6(local), v6(remote))]
        .into_iter()
        .find_map(|(table, local, remote)| {
            let table = std::fs::read_to_string(table).ok()?;
            table.lines().skip(1).find_map(|line| {
                // Established connections only (state 01): a closing socket's
                // row may name another owner.
                let f: Vec<&str> = line.split_whitespace().collect();
                (f.len() > 7 && f[1] == local && f[2] == remote && f[3] == "01")
                    .then(|| f[7].parse().ok())
                    .flatten()
            })
        })
}

/// One rank's TCPStore connection, forwarded to the group's store.
struct Forward {
    rank: TcpStream,
    store: KvClient,
}

impl Forward {
    fn new(rank: TcpStream, store: SocketAddr, auth: &JobAuth, group: u32, who: u64) -> Result<Forward> {
        rank.set_nodelay(true)?;
        let store = KvClient::connect(store, auth, group as u64, who, STORE_TIMEOUT)?;
        Ok(Forward { rank, store })
    }

    /// Serves the rank's requests until it closes its connection.
    fn run(mut self) -> Result<()> {
        match self.code()? {
            Some(query::VALIDATE) if self.u32()? == MAGIC => {}
            Some(_) => bail!("a connection that is not a TCPStore client's was closed"),
            None => return Ok(()),
        }
        while let Some(code) = self.code()? {
            self.request(code)?;
        }
        Ok(())
    }

    fn request(&mut self, code: u8) -> Result<()> {
        let mut out = Vec::new();
        match code {
            query::SET => {
                let (k, v) = (self.key()?, self.bytes()?);
                self.store.set(&k, &v)?;
            }
            query::COMPARE_SET => {
                let (k, expected, desired) = (self.key()?, self.bytes()?, self.bytes()?);
                put_bytes(&mut out, &self.store.compare_set(&k, &expected, &desired)?);
            }
            query::GET => {
                let k = self.key()?;
                put_bytes(&mut out, &self.get(&k)?);
            }
            query::ADD => {
                let (k, by) = (self.key()?, self.u64()? as i64);
                out.extend_from_slice(&self.store.add(&k, by)?.to_ne_bytes());
            }
            query::CHECK => {
                let keys = self.keys()?;
                let all = self.store.check(&keys.iter().map(String::as_str).collect::<Vec<_>>())?;
                out.push(if all { READY } else { NOT_READY });
            }
            query::WAIT => {
                let keys = self.keys()?;
                out.push(self.wait(&keys)?);
            }
            query::GET_NUM_KEYS => out.extend_from_slice(&(self.store.num_keys()? as i64).to_ne_bytes()),
            query::DELETE_KEY => {
                let k = self.key()?;
                out.extend_from_slice(&(self.store.delete(&k)? as i64).to_ne_bytes());
            }
            query::APPEND => {
                let (k, v) = (self.key()?, self.bytes()?);
                self.store.append(&k, &v)?;
            }
            query::MULTI_GET => {
                for k in self.keys()? {
                    put_bytes(&mut out, &self.get(&k)?);
                    if out.len() > MAX_ANSWER {
                        bail!("a rank's MULTI_GET asked for more than {MAX_ANSWER} bytes");
                    }
                }
            }
            query::MULTI_SET => {
                for _ in 0..self.count()? {
                    let (k, v) = (self.key()?, self.bytes()?);
                    self.store.set(&k, &v)?;
                }
            }
            // A cancel with no wait running: torch's store answers it all the same.
            query::CANCEL_WAIT => out.push(WAIT_CANCELED),
            query::PING => out.extend_from_slice(&self.u32()?.to_ne_bytes()),
            query::BARRIER => {
                let (k, world) = (self.key()?, self.u64()? as i64);
                out.push(self.barrier(&k, world)?);
            }
            other => bail!("a rank asked for {}, which edl's store does not serve", query::name(other)),
        }
        if !out.is_empty() {
            self.rank.write_all(&out)?;
        }
        Ok(())
    }

    /// What `key` holds; empty when unset (as torch's store answers).
    fn get(&mut self, key: &str) -> Result<Vec<u8>> {
        Ok(if self.store.check(&[key])? { self.store.get(key, Duration::ZERO)? } else { Vec::new() })
    }

    /// Waits until `keys` are all set (STOP_WAITING) or the rank gives up
    /// waiting (WAIT_CANCELED).
    fn wait(&mut self, keys: &[String]) -> Result<u8> {
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        loop {
            if self.store.wait_within(&keys, WAIT_SLICE)? {
                return Ok(STOP_WAITING);
            }
            self.rank.set_nonblocking(true)?;
            let mut next = [0u8];
            let heard = self.rank.peek(&mut next);
            self.rank.set_nonblocking(false)?;
            match heard {
                Ok(0) => bail!("the rank closed its connection while waiting for {keys:?}"),
                Ok(_) => {
                    self.rank.read_exact(&mut next)?;
                    if next[0] != query::CANCEL_WAIT {
                        bail!("a rank sent {} while waiting for {keys:?}", query::name(next[0]));
                    }
                    return Ok(WAIT_CANCELED);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// torch's barrier: counts the rank in at `key`; answers once `world`
    /// have come.
    fn barrier(&mut self, key: &str, world: i64) -> Result<u8> {
        let released = format!("{key}/edl-released");
        if self.store.add(key, 1)? >= world {
            self.store.set(&released, b"1")?;
        }
        self.wait(&[released])
    }

    /// The next request's code; None at the end of the connection.
    fn code(&mut self) -> Result<Option<u8>> {
        let mut c = [0u8];
        match self.rank.read_exact(&mut c) {
            Ok(()) => Ok(Some(c[0])),
            Err(e) if matches!(e.kind(), ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    fn u32(&mut self) -> Result<u32> {
        let mut b = [0u8; 4];
        self.rank.read_exact(&mut b)?;
        Ok(u32::from_ne_bytes(b))
    }

    fn u64(&mut self) -> Result<u64> {
        let mut b = [0u8; 8];
        self.rank.read_exact(&mut b)?;
        Ok(u64::from_ne_bytes(b))
    }

    fn bytes(&mut self) -> Result<Vec<u8>> {
        let n = self.u64()?;
        if n > MAX_VALUE {
            bail!("a rank sent a key or value of {n} bytes (at most {MAX_VALUE})");
        }
        let mut b = vec![0u8; n as usize];
        self.rank.read_exact(&mut b)?;
        Ok(b)
    }

    fn key(&mut self) -> Result<String> {
        String::from_utf8(self.bytes()?).context("a rank sent a key that is not UTF-8")
    }

    fn count(&mut self) -> Result<u64> {
        let n = self.u64()?;
        if n > MAX_KEYS {
            bail!("a rank named {n} keys in one request (at most {MAX_KEYS})");
        }
        Ok(n)
    }

    fn keys(&mut self) -> Result<Vec<String>> {
        (0..self.count()?).map(|_| self.key()).collect()
    }
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u64).to_ne_bytes());
    out.extend_from_slice(b);
}

#[cfg(test)]
mod tests {
    use super::*;
    use edl_host_gpu::comm::auth::Secret;

    /// A TCPStore client as torch's speaks, for the tests.
    struct Torch(TcpStream);

    impl Torch {
        fn connect(bridge: &Bridge) -> Torch {
            let s = TcpStream::connect(("127.0.0.1", bridge.port())).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            let mut t = Torch(s);
            t.send(query::VALIDATE, &[&MAGIC.to_ne_bytes()]);
            t
        }
        fn send(&mut self, code: u8, parts: &[&[u8]]) {
            let mut b = vec![code];
            parts.iter().for_each(|p| b.extend_from_slice(p));
            self.0.write_all(&b).unwrap();
        }
        fn s(text: &str) -> Vec<u8> {
            let mut b = (text.len() as u64).to_ne_bytes().to_vec();
            b.extend_from_slice(text.as_bytes());
            b
        }
        fn keys(keys: &[&str]) -> Vec<u8> {
            let mut b = (keys.len() as u64).to_ne_bytes().to_vec();
            keys.iter().for_each(|k| b.extend(Self::s(k)));
            b
        }
        fn byte(&mut self) -> u8 {
            let mut b = [0u8];
            self.0.read_exact(&mut b).unwrap();
            b[0]
        }
        fn i64(&mut self) -> i64 {
            let mut b = [0u8; 8];
            self.0.read_exact(&mut b).unwrap();
            i64::from_ne_bytes(b)
        }
        fn vec(&mut self) -> Vec<u8> {
            let mut b = vec![0u8; self.i64() as usize];
            self.0.read_exact(&mut b).unwrap();
            b
        }
        fn set(&mut self, k: &str, v: &str) {
            self.send(query::SET, &[&Self::s(k), &Self::s(v)]);
        }
        fn get(&mut self, k: &str) -> Vec<u8> {
            self.send(query::GET, &[&Self::s(k)]);
            self.vec()
        }
    }

    fn group() -> (GroupStore, JobAuth) {
        let auth = JobAuth { job: "c10d".into(), secret: Secret::generate().unwrap() };
        let store = GroupStore::serve(IpAddr::V4(Ipv4Addr::LOCALHOST), auth.clone()).unwrap();
        store.open(4);
        (store, auth)
    }

    fn at(store: &GroupStore) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, store.port()))
    }

    #[test]
    fn ranks_on_two_hosts_share_the_group_s_keys_through_their_bridges() {
        let (store, auth) = group();
        let (one, two) = (
            Bridge::start(at(&store), auth.clone(), 4).unwrap(),
            Bridge::start(at(&store), auth, 4).unwrap(),
        );
        let (mut a, mut b) = (Torch::connect(&one), Torch::connect(&two));
        // A wait on one host is answered when a rank on the other sets the key.
        b.send(query::WAIT, &[&Torch::keys(&["addr/0"])]);
        std::thread::sleep(Duration::from_millis(300));
        a.set("addr/0", "10.0.0.1:4000");
        assert_eq!(b.byte(), STOP_WAITING);
        assert_eq!(b.get("addr/0"), b"10.0.0.1:4000");
        assert_eq!(b.get("unset"), b"", "an unset key reads empty, as torch's store answers");
        a.send(query::ADD, &[&Torch::s("n"), &5i64.to_ne_bytes()]);
        assert_eq!(a.i64(), 5);
        b.send(query::ADD, &[&Torch::s("n"), &(-2i64).to_ne_bytes()]);
        assert_eq!(b.i64(), 3);
        b.send(query::CHECK, &[&Torch::keys(&["n", "addr/0"])]);
        assert_eq!(b.byte(), READY);
        b.send(query::CHECK, &[&Torch::keys(&["n", "nope"])]);
        assert_eq!(b.byte(), NOT_READY);
        a.send(query::COMPARE_SET, &[&Torch::s("lead"), &Torch::s(""), &Torch::s("a")]);
        assert_eq!(a.vec(), b"a");
        b.send(query::COMPARE_SET, &[&Torch::s("lead"), &Torch::s(""), &Torch::s("b")]);
        assert_eq!(b.vec(), b"a", "taken already");
        a.send(query::APPEND, &[&Torch::s("log"), &Torch::s("x")]);
        b.send(query::APPEND, &[&Torch::s("log"), &Torch::s("y")]);
        a.send(
            query::MULTI_SET,
            &[&2u64.to_ne_bytes(), &Torch::s("m1"), &Torch::s("1"), &Torch::s("m2"), &Torch::s("2")],
        );
        // A set is not answered: a round trip on each connection is what
        // tells the test that the store has them.
        assert_eq!((a.get("m1"), b.get("log").len()), (b"1".to_vec(), 2));
        b.send(query::MULTI_GET, &[&Torch::keys(&["m1", "m2", "log"])]);
        let got = (b.vec(), b.vec(), b.vec());
        assert_eq!((got.0.as_slice(), got.1.as_slice()), (&b"1"[..], &b"2"[..]));
        assert!(got.2 == b"xy" || got.2 == b"yx", "{:?}", got.2);
        a.send(query::GET_NUM_KEYS, &[]);
        assert_eq!(a.i64(), 6);
        a.send(query::DELETE_KEY, &[&Torch::s("lead")]);
        assert_eq!(a.i64(), 1);
        a.send(query::DELETE_KEY, &[&Torch::s("lead")]);
        assert_eq!(a.i64(), 0);
        a.send(query::PING, &[&0xfeedu32.to_ne_bytes()]);
        let mut nonce = [0u8; 4];
        a.0.read_exact(&mut nonce).unwrap();
        assert_eq!(u32::from_ne_bytes(nonce), 0xfeed);
    }

    #[test]
    fn a_rank_that_gives_up_waiting_is_answered_and_a_barrier_waits_for_the_world() {
        let (store, auth) = group();
        let bridge = Bridge::start(at(&store), auth, 4).unwrap();
        let mut a = Torch::connect(&bridge);
        a.send(query::WAIT, &[&Torch::keys(&["never"])]);
        std::thread::sleep(Duration::from_millis(100));
        a.send(query::CANCEL_WAIT, &[]);
        assert_eq!(a.byte(), WAIT_CANCELED);
        // The connection serves on after a cancelled wait.
        a.set("k", "v");
        assert_eq!(a.get("k"), b"v");

        let mut b = Torch::connect(&bridge);
        a.send(query::BARRIER, &[&Torch::s("bar"), &2i64.to_ne_bytes()]);
        std::thread::sleep(Duration::from_millis(300));
        b.send(query::BARRIER, &[&Torch::s("bar"), &2i64.to_ne_bytes()]);
        assert_eq!((a.byte(), b.byte()), (STOP_WAITING, STOP_WAITING));
    }

    /// Whether the connection gives any answer (false: closed unanswered).
    fn answers(mut s: TcpStream) -> bool {
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut b = [0u8; 8];
        matches!(s.read(&mut b), Ok(n) if n > 0)
    }

    #[test]
    fn a_client_that_is_not_torch_s_or_of_a_group_that_is_over_gets_nothing() {
        let (store, auth) = group();
        let bridge = Bridge::start(at(&store), auth.clone(), 4).unwrap();
        let mut s = TcpStream::connect(("127.0.0.1", bridge.port())).unwrap();
        s.write_all(&[query::GET_NUM_KEYS]).unwrap();
        assert!(!answers(s), "answered a client that never proved it speaks TCPStore");

        let mut old = Torch::connect(&bridge);
        old.set("k", "v");
        assert_eq!(old.get("k"), b"v");
        store.open(5);
        old.send(query::GET_NUM_KEYS, &[]);
        assert!(!answers(old.0), "a rank of a group that is over was answered");
        // A bridge of the new group sees none of the old group's keys.
        let next = Bridge::start(at(&store), auth, 5).unwrap();
        let mut new = Torch::connect(&next);
        assert_eq!(new.get("k"), b"");
        // Nothing listens beyond loopback for the ranks.
        assert!(bridge.addr.ip().is_loopback());
    }

    #[test]
    fn another_user_on_the_host_gets_nothing() {
        use std::os::unix::process::CommandExt;
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: running a client as another user needs root");
            return;
        }
        let (store, auth) = group();
        let bridge = Bridge::start(at(&store), auth, 4).unwrap();
        // VALIDATE, then GETNUMKEYS; prints how many answer bytes came back.
        let script = format!(
            "exec 3<>/dev/tcp/127.0.0.1/{}; printf '\\x00\\xce\\xf7\\x85\\x3c\\x07' >&3; timeout 10 head -c 8 <&3 | wc -c",
            bridge.port()
        );
        let run = |uid: Option<u32>| {
            let mut cmd = std::process::Command::new("bash");
            cmd.args(["-c", &script]);
            if let Some(uid) = uid {
                cmd.uid(uid).gid(uid);
            }
            let out = cmd.output().unwrap();
            String::from_utf8_lossy(&out.stdout).trim().to_string()
        };
        assert_eq!(run(None), "8", "the job's own user is answered");
        assert_eq!(run(Some(65534)), "0", "another user was answered");
    }
}
