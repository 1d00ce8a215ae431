//! A key-value store for one generation's ranks, served beside the
//! rendezvous on the same port: what `torch.distributed` process groups
//! (gloo, NCCL) need to find each other (a c10d `Store`: set, blocking get,
//! add, compare-and-set, wait, check, delete, count).
//!
//! Only a process that proved the job's secret for the current generation
//! reaches it (the `store` channel of [`auth`](super::auth)), so the
//! addresses and NCCL ids published here are never given to a stranger. Each
//! generation starts with an empty store; a connection of a generation that
//! is over is answered with an error at its next request (and a request
//! waiting for a key is woken with one), so the ranks of a torn-down group
//! fail fast instead of waiting on keys that will never come.

use super::CommError;
use super::auth::{self, JobAuth};
use super::sealed::SealedStream;
use std::{
    collections::HashMap,
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    sync::{Condvar, Mutex},
    time::{Duration, Instant},
};

/// The channel a store connection claims.
pub const CHANNEL: &str = "store";

/// Longest one value or key may be.
const MAX_FRAME: usize = 16 << 20;

/// Most keys one request may name.
const MAX_KEYS_PER_REQUEST: u64 = 4096;

/// Most bytes of keys and values the store holds: a process group needs
/// kilobytes per rank; a program that stores more is refused, not the job
/// brought down.
const MAX_STORED: usize = 256 << 20;

/// Longest a request may wait for keys, whatever it asks for.
const MAX_WAIT: Duration = Duration::from_secs(3600);

mod op {
    pub const SET: u8 = 1;
    pub const GET: u8 = 2;
    pub const ADD: u8 = 3;
    pub const COMPARE_SET: u8 = 4;
    pub const CHECK: u8 = 5;
    pub const WAIT: u8 = 6;
    pub const DELETE: u8 = 7;
    pub const NUM_KEYS: u8 = 8;
    pub const APPEND: u8 = 9;
}

/// How a wait that ran out of time is refused (see [`KvClient::wait_within`]).
const TIMED_OUT: &str = "timed out after";

/// The server side: one store, emptied when the generation moves on.
#[derive(Default)]
pub struct KvStore {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    /// The generation the keys belong to, and the one now running.
    keys_of: u64,
    current: u64,
    map: HashMap<String, Vec<u8>>,
}

fn read_frame(s: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a store frame of {len} bytes (at most {MAX_FRAME})"),
        ));
    }
    let mut buf = vec![0u8; len];
    s.read_exact(&mut buf)?;
    Ok(buf)
}

/// Writes frames as one message (one sealed frame, one packet where it fits).
fn write_frames(s: &mut impl Write, frames: &[&[u8]]) -> std::io::Result<()> {
    let mut out = Vec::with_capacity(frames.iter().map(|f| 4 + f.len()).sum());
    for f in frames {
        out.extend_from_slice(&(f.len() as u32).to_le_bytes());
        out.extend_from_slice(f);
    }
    s.write_all(&out)
}

fn bad(what: impl Into<String>) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what.into())
}

fn u64_of(b: &[u8], what: &str) -> std::io::Result<u64> {
    Ok(u64::from_le_bytes(b.try_into().map_err(|_| bad(format!("{what}: not 8 bytes")))?))
}

/// A request's answer: a value, or the reason it was refused.
type Answer = Result<Vec<u8>, String>;

impl KvStore {
    /// The generation whose ranks may use the store now; waiting requests
    /// of the one before are woken and refused.
    pub fn set_generation(&self, generation: u64) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.current = generation;
        self.changed.notify_all();
    }

    /// Serves one authenticated connection of `generation` until it closes.
    pub fn serve(&self, conn: &mut SealedStream, generation: u64) -> std::io::Result<()> {
        // Requests may wait for keys; the connection lives as long as its rank.
        conn.get_ref().set_read_timeout(None)?;
        loop {
            let code = match read_frame(conn) {
                Ok(c) => c,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            };
            let &[code] = code.as_slice() else { return Err(bad("a store request without its code")) };
            let answer = self.request(conn, code, generation)?;
            match answer {
                Ok(v) => write_frames(conn, &[b"ok", &v])?,
                Err(reason) => write_frames(conn, &[b"er", reason.as_bytes()])?,
            }
        }
    }

    fn request(&self, conn: &mut SealedStream, code: u8, generation: u64) -> std::io::Result<Answer> {
        let key = |c: &mut SealedStream| -> std::io::Result<String> {
            String::from_utf8(read_frame(c)?).map_err(|_| bad("a key that is not UTF-8"))
        };
        let keys = |c: &mut SealedStream| -> std::io::Result<Vec<String>> {
            let n = u64_of(&read_frame(c)?, "key count")?;
            if n > MAX_KEYS_PER_REQUEST {
                return Err(bad(format!("{n} keys in one request")));
            }
            (0..n).map(|_| key(c)).collect()
        };
        Ok(match code {
            op::SET => {
                let (k, v) = (key(conn)?, read_frame(conn)?);
                self.with(generation, |s| {
                    Self::room_for(s, k.len() + v.len())?;
                    s.map.insert(k, v);
                    Ok(Vec::new())
                })
            }
            op::APPEND => {
                let (k, v) = (key(conn)?, read_frame(conn)?);
                self.with(generation, |s| {
                    Self::room_for(s, k.len() + v.len())?;
                    s.map.entry(k).or_default().extend_from_slice(&v);
                    Ok(Vec::new())
                })
            }
            op::GET => {
                let (k, wait) = (key(conn)?, u64_of(&read_frame(conn)?, "timeout")?);
                // The value is taken under the same lock that saw it set.
                self.wait_for(generation, std::slice::from_ref(&k), wait, |s| s.map.get(&k).cloned())
            }
            op::ADD => {
                let (k, by) = (key(conn)?, u64_of(&read_frame(conn)?, "amount")? as i64);
                self.with(generation, |s| {
                    let now = match s.map.get(&k) {
                        Some(v) => std::str::from_utf8(v)
                            .ok()
                            .and_then(|t| t.parse::<i64>().ok())
                            .ok_or_else(|| format!("key {k:?} does not hold a number"))?,
                        None => 0,
                    };
                    let new = now.wrapping_add(by);
                    s.map.insert(k, new.to_string().into_bytes());
                    Ok(new.to_le_bytes().to_vec())
                })
            }
            op::COMPARE_SET => {
                let (k, expected, desired) = (key(conn)?, read_frame(conn)?, read_frame(conn)?);
                self.with(generation, |s| match s.map.get(&k) {
                    // As c10d: a missing key counts as matching an empty expected value.
                    None if expected.is_empty() => {
                        s.map.insert(k, desired.clone());
                        Ok(desired)
                    }
                    None => Ok(expected),
                    Some(v) if *v == expected => {
                        s.map.insert(k, desired.clone());
                        Ok(desired)
                    }
                    Some(v) => Ok(v.clone()),
                })
            }
            op::CHECK => {
                let ks = keys(conn)?;
                self.with(generation, |s| Ok(vec![ks.iter().all(|k| s.map.contains_key(k)) as u8]))
            }
            op::WAIT => {
                let (ks, wait) = (keys(conn)?, u64_of(&read_frame(conn)?, "timeout")?);
                self.wait_for(generation, &ks, wait, |_| Some(Vec::new()))
            }
            op::DELETE => {
                let k = key(conn)?;
                self.with(generation, |s| Ok(vec![s.map.remove(&k).is_some() as u8]))
            }
            op::NUM_KEYS => self.with(generation, |s| Ok((s.map.len() as u64).to_le_bytes().to_vec())),
            other => return Err(bad(format!("unknown store request {other}"))),
        })
    }

    /// Refuses a write of `more` bytes that would overfill the store.
    fn room_for(s: &State, more: usize) -> Result<(), String> {
        let held: usize = s.map.iter().map(|(k, v)| k.len() + v.len()).sum();
        if held + more > MAX_STORED {
            return Err(format!("the store is full ({held} bytes held, at most {MAX_STORED})"));
        }
        Ok(())
    }

    /// Runs `f` on the keys of `generation`, if it is still the current one.
    fn with(&self, generation: u64, f: impl FnOnce(&mut State) -> Answer) -> Answer {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        Self::current(&mut s, generation)?;
        let answer = f(&mut s);
        self.changed.notify_all();
        answer
    }

    /// Refuses a generation that is over; empties the store for a new one.
    fn current(s: &mut State, generation: u64) -> Result<(), String> {
        if generation != s.current {
            return Err(format!("generation {generation} is over (the job is at {})", s.current));
        }
        if s.keys_of != generation {
            s.map.clear();
            s.keys_of = generation;
        }
        Ok(())
    }

    /// Waits until every one of `keys` is set, up to `wait_ms`; then
    /// answers with `then`, under the lock that saw them set.
    fn wait_for(
        &self,
        generation: u64,
        keys: &[String],
        wait_ms: u64,
        then: impl Fn(&State) -> Option<Vec<u8>>,
    ) -> Answer {
        let until = Instant::now() + Duration::from_millis(wait_ms).min(MAX_WAIT);
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            Self::current(&mut s, generation)?;
            if keys.iter().all(|k| s.map.contains_key(k))
                && let Some(answer) = then(&s)
            {
                return Ok(answer);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let missing: Vec<&str> =
                    keys.iter().filter(|k| !s.map.contains_key(*k)).map(String::as_str).collect();
                return Err(format!("{TIMED_OUT} {wait_ms} ms waiting for {missing:?}"));
            }
            s = self.changed.wait_timeout(s, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

/// A rank's connection to the store of its generation.
pub struct KvClient {
    conn: SealedStream,
    server: SocketAddr,
    /// Bound on a request that does not wait for keys.
    timeout: Duration,
    /// An i/o error left the connection mid-answer: it is not used again.
    broken: Option<String>,
}

impl KvClient {
    /// Connects to the store at `server` as rank `rank` of `generation`,
    /// proving the job's secret.
    pub fn connect(
        server: SocketAddr,
        auth: &JobAuth,
        generation: u64,
        rank: u64,
        timeout: Duration,
    ) -> Result<KvClient, CommError> {
        let err = |e: &dyn std::fmt::Display| CommError::Rendezvous(format!("store at {server}: {e}"));
        let mut conn = TcpStream::connect_timeout(&server, timeout).map_err(|e| err(&e))?;
        conn.set_nodelay(true).map_err(|e| err(&e))?;
        conn.set_read_timeout(Some(timeout)).map_err(|e| err(&e))?;
        conn.set_write_timeout(Some(timeout)).map_err(|e| err(&e))?;
        let keys = auth::connect(&mut conn, &auth.secret, &auth.claim(CHANNEL, generation, rank))
            .map_err(|e| err(&e))?;
        let conn = SealedStream::new(conn, Some(keys)).map_err(|e| err(&e))?;
        Ok(KvClient { conn, server, timeout, broken: None })
    }

    fn call(&mut self, code: u8, args: &[&[u8]], waits: Option<Duration>) -> Result<Vec<u8>, CommError> {
        let server = self.server;
        if let Some(why) = &self.broken {
            return Err(CommError::Rendezvous(format!(
                "store at {server}: the connection broke earlier: {why}"
            )));
        }
        let r = self.exchange(code, args, waits);
        if let Err(CommError::Rendezvous(e)) = &r
            && !e.starts_with("refused: ")
        {
            self.broken = Some(e.clone());
        }
        r.map_err(|e| match e {
            CommError::Rendezvous(m) => {
                CommError::Rendezvous(format!("store at {server}: {}", m.trim_start_matches("refused: ")))
            }
            other => other,
        })
    }

    fn exchange(&mut self, code: u8, args: &[&[u8]], waits: Option<Duration>) -> Result<Vec<u8>, CommError> {
        let io = |e: std::io::Error| CommError::Rendezvous(e.to_string());
        // A request that waits for keys may take its whole wait before the answer.
        let read = self.timeout + waits.unwrap_or_default();
        self.conn.get_ref().set_read_timeout(Some(read)).map_err(io)?;
        let code = [code];
        let mut frames: Vec<&[u8]> = vec![&code];
        frames.extend_from_slice(args);
        write_frames(&mut self.conn, &frames).map_err(io)?;
        let status = read_frame(&mut self.conn).map_err(io)?;
        let body = read_frame(&mut self.conn).map_err(io)?;
        match status.as_slice() {
            b"ok" => Ok(body),
            // The server answered: the connection is sound, the request refused.
            _ => Err(CommError::Rendezvous(format!("refused: {}", String::from_utf8_lossy(&body)))),
        }
    }

    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), CommError> {
        self.call(op::SET, &[key.as_bytes(), value], None).map(drop)
    }

    /// The value of `key`, waiting up to `wait` for it to be set.
    pub fn get(&mut self, key: &str, wait: Duration) -> Result<Vec<u8>, CommError> {
        let ms = (wait.as_millis() as u64).to_le_bytes();
        self.call(op::GET, &[key.as_bytes(), &ms], Some(wait))
    }

    /// Adds `by` to the number `key` holds (0 when unset); returns the sum.
    pub fn add(&mut self, key: &str, by: i64) -> Result<i64, CommError> {
        let v = self.call(op::ADD, &[key.as_bytes(), &by.to_le_bytes()], None)?;
        let bytes: [u8; 8] =
            v.try_into().map_err(|_| CommError::Rendezvous("store: a short answer".into()))?;
        Ok(i64::from_le_bytes(bytes))
    }

    /// Sets `key` to `desired` if it holds `expected` (or is unset and
    /// `expected` is empty); returns the value it holds afterwards.
    pub fn compare_set(&mut self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>, CommError> {
        self.call(op::COMPARE_SET, &[key.as_bytes(), expected, desired], None)
    }

    fn key_list(keys: &[&str]) -> Vec<Vec<u8>> {
        let mut out = vec![(keys.len() as u64).to_le_bytes().to_vec()];
        out.extend(keys.iter().map(|k| k.as_bytes().to_vec()));
        out
    }

    /// Whether every one of `keys` is set, without waiting.
    pub fn check(&mut self, keys: &[&str]) -> Result<bool, CommError> {
        let args = Self::key_list(keys);
        let refs: Vec<&[u8]> = args.iter().map(Vec::as_slice).collect();
        Ok(self.call(op::CHECK, &refs, None)? == [1])
    }

    /// Waits up to `wait` until every one of `keys` is set.
    pub fn wait(&mut self, keys: &[&str], wait: Duration) -> Result<(), CommError> {
        let mut args = Self::key_list(keys);
        args.push((wait.as_millis() as u64).to_le_bytes().to_vec());
        let refs: Vec<&[u8]> = args.iter().map(Vec::as_slice).collect();
        self.call(op::WAIT, &refs, Some(wait)).map(drop)
    }

    /// Waits up to `wait` until every one of `keys` is set: whether they
    /// all were (false: the wait ran out, the connection still sound).
    pub fn wait_within(&mut self, keys: &[&str], wait: Duration) -> Result<bool, CommError> {
        match self.wait(keys, wait) {
            Ok(()) => Ok(true),
            Err(CommError::Rendezvous(e))
                if self.broken.is_none()
                    && e.starts_with(&format!("store at {}: {TIMED_OUT} ", self.server)) =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Appends `value` to what `key` holds (sets it when unset).
    pub fn append(&mut self, key: &str, value: &[u8]) -> Result<(), CommError> {
        self.call(op::APPEND, &[key.as_bytes(), value], None).map(drop)
    }

    /// Removes `key`; whether it was set.
    pub fn delete(&mut self, key: &str) -> Result<bool, CommError> {
        Ok(self.call(op::DELETE, &[key.as_bytes()], None)? == [1])
    }

    /// How many keys are set.
    pub fn num_keys(&mut self) -> Result<u64, CommError> {
        let v = self.call(op::NUM_KEYS, &[], None)?;
        let bytes: [u8; 8] =
            v.try_into().map_err(|_| CommError::Rendezvous("store: a short answer".into()))?;
        Ok(u64::from_le_bytes(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{RendezvousServer, auth::Secret};

    fn job() -> JobAuth {
        JobAuth { job: "kv".into(), secret: Secret::generate().unwrap() }
    }

    fn client(server: &RendezvousServer, auth: &JobAuth, generation: u64) -> Result<KvClient, CommError> {
        KvClient::connect(server.addr(), auth, generation, 0, Duration::from_secs(5))
    }

    #[test]
    fn ranks_of_a_generation_share_keys_and_wait_for_each_other() {
        let auth = job();
        let server = RendezvousServer::start_with("127.0.0.1:0", Some(auth.clone())).unwrap();
        server.set_generation(3);
        let mut a = client(&server, &auth, 3).unwrap();
        let mut b = client(&server, &auth, 3).unwrap();
        let waiter = std::thread::spawn(move || b.get("addr/1", Duration::from_secs(10)).map(|v| (v, b)));
        std::thread::sleep(Duration::from_millis(50));
        a.set("addr/1", b"10.0.0.2:4000").unwrap();
        let (got, mut b) = waiter.join().unwrap().unwrap();
        assert_eq!(got, b"10.0.0.2:4000");
        assert_eq!(a.add("arrived", 1).unwrap(), 1);
        assert_eq!(b.add("arrived", 2).unwrap(), 3);
        assert_eq!(a.get("arrived", Duration::ZERO).unwrap(), b"3");
        assert_eq!(a.compare_set("leader", b"", b"0").unwrap(), b"0");
        assert_eq!(b.compare_set("leader", b"", b"1").unwrap(), b"0", "taken already");
        assert_eq!(b.compare_set("leader", b"0", b"1").unwrap(), b"1");
        assert!(a.check(&["addr/1", "arrived"]).unwrap());
        assert!(!a.check(&["addr/1", "nope"]).unwrap());
        assert_eq!(a.num_keys().unwrap(), 3);
        assert!(a.delete("leader").unwrap());
        assert!(!a.delete("leader").unwrap());
        let e = a.wait(&["never"], Duration::from_millis(50)).unwrap_err().to_string();
        assert!(e.contains("timed out") && e.contains("never"), "{e}");
        assert!(
            !a.wait_within(&["never"], Duration::from_millis(20)).unwrap(),
            "ran out, the connection sound"
        );
        assert!(a.wait_within(&["addr/1"], Duration::from_millis(20)).unwrap());
        a.append("log", b"ab").unwrap();
        a.append("log", b"cd").unwrap();
        assert_eq!(a.get("log", Duration::ZERO).unwrap(), b"abcd");
        // A request of a wrong shape is an error naming it, not a hang.
        assert!(a.get("arrived", Duration::ZERO).is_ok());
    }

    #[test]
    fn a_new_generation_starts_empty_and_wakes_the_last_ones_waiters() {
        let auth = job();
        let server = RendezvousServer::start_with("127.0.0.1:0", Some(auth.clone())).unwrap();
        server.set_generation(1);
        let mut old = client(&server, &auth, 1).unwrap();
        old.set("k", b"v").unwrap();
        let mut waiting = client(&server, &auth, 1).unwrap();
        let waiter = std::thread::spawn(move || waiting.get("never", Duration::from_secs(60)));
        std::thread::sleep(Duration::from_millis(50));
        server.set_generation(2);
        let e = waiter.join().unwrap().unwrap_err().to_string();
        assert!(e.contains("generation 1 is over"), "{e}");
        assert!(old.set("k", b"w").unwrap_err().to_string().contains("generation 1 is over"));
        let mut new = client(&server, &auth, 2).unwrap();
        assert!(!new.check(&["k"]).unwrap(), "the keys of generation 1 are gone");
    }

    #[test]
    fn only_a_process_that_proves_the_secret_of_the_current_generation_gets_in() {
        let auth = job();
        let server = RendezvousServer::start_with("127.0.0.1:0", Some(auth.clone())).unwrap();
        server.set_generation(5);
        let stranger = JobAuth { job: "kv".into(), secret: Secret::generate().unwrap() };
        assert!(client(&server, &stranger, 5).is_err(), "a wrong secret");
        let e = client(&server, &auth, 4).err().unwrap().to_string();
        assert!(e.contains("generation 4 is over"), "{e}");
        // Without authentication the port gives nothing away.
        let mut raw = TcpStream::connect(server.addr()).unwrap();
        raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        write_frames(&mut raw, &[&[op::NUM_KEYS]]).unwrap();
        let mut buf = Vec::new();
        let _ = raw.read_to_end(&mut buf);
        assert!(!buf.windows(6).any(|w| w == b"\x02\0\0\0ok"), "answered a stranger: {buf:?}");
    }
}
