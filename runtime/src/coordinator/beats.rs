//! The coordinator's heartbeats to the workers it welcomed: a line four
//! times per worker lease, from a thread of its own (the coordinator's loop
//! may be busy for longer, verifying a checkpoint or waiting on a stop
//! command), so that a worker tells a coordinator that is slow from one
//! that is frozen with its connection still open, which it would otherwise
//! wait for forever (see [`crate::control::proto::coordinator_silence`]).
//! Workers behind a relay get one frame per relay, which the relay fans
//! out to them.

use crate::control::frame::Frame;
use crate::control::outbox::{Outbox, RelayOut, SharedLink, lock_link};
use crate::control::proto::{ToWorker, encode, send_encoded};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

/// Where a beat for one worker goes.
#[derive(Clone)]
enum Target {
    Direct(SharedLink),
    /// The worker's number on its relay, and the relay (by its host's number).
    Relayed {
        host: u64,
        conn: u64,
        relay: RelayOut,
    },
}

type Targets = Arc<Mutex<HashMap<u64, Target>>>;

fn lock(t: &Targets) -> std::sync::MutexGuard<'_, HashMap<u64, Target>> {
    t.lock().unwrap_or_else(|p| p.into_inner())
}

/// The workers beaten, and the thread that beats them (it ends when this
/// is dropped).
pub struct Beats {
    targets: Targets,
    _stop: mpsc::Sender<()>,
}

impl Beats {
    /// Beats every `every` the workers added. Without a thread (the system
    /// refused one) nothing is beaten and the job goes on: its workers then
    /// take a quiet coordinator for lost, as a frozen one.
    pub fn start(every: Duration) -> Self {
        let targets = Targets::default();
        let (stop, stopped) = mpsc::channel::<()>();
        let theirs = targets.clone();
        let every = every.max(Duration::from_millis(50));
        let spawned = std::thread::Builder::new().name("edl-beat".into()).spawn(move || {
            let line = encode(&ToWorker::Beat).expect("a unit variant encodes");
            while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(every) {
                beat(&theirs, &line);
            }
        });
        if let Err(e) = spawned {
            tracing::warn!("no heartbeats to the workers (no thread for them: {e})");
        }
        Beats { targets, _stop: stop }
    }

    /// Beats the worker on connection `conn`, written to through `out`.
    pub fn add(&self, conn: u64, out: &Outbox) {
        let target = match out {
            Outbox::Direct(link) => Target::Direct(link.clone()),
            Outbox::Relayed { conn: on_relay, host, relay, .. } => {
                Target::Relayed { host: *host, conn: *on_relay, relay: relay.clone() }
            }
        };
        lock(&self.targets).insert(conn, target);
    }

    /// Beats the worker on connection `conn` no more.
    pub fn remove(&self, conn: u64) {
        lock(&self.targets).remove(&conn);
    }
}

/// One beat to every worker added: a line on each direct connection, a
/// frame per relay for the workers behind it. A connection that cannot
/// take it is left to its reader, which reports it closed.
fn beat(targets: &Targets, line: &[u8]) {
    let now: Vec<Target> = lock(targets).values().cloned().collect();
    let mut fans: HashMap<u64, (RelayOut, Vec<u64>)> = HashMap::new();
    for target in now {
        match target {
            Target::Direct(link) => {
                let _ = send_encoded(&mut lock_link(&link), line);
            }
            Target::Relayed { host, conn, relay } => {
                fans.entry(host).or_insert_with(|| (relay, Vec::new())).1.push(conn);
            }
        }
    }
    for (relay, conns) in fans.into_values() {
        let _ = relay.send(&[Frame::Fan { conns, line: line.to_vec() }]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::proto::{Link, Receiver, seal};
    use edl_host_gpu::comm::auth::{JobAuth, Secret};

    /// A sealed connection on loopback: the coordinator's writing side, the
    /// worker's reading side and its socket.
    fn sealed() -> (Link, Receiver, std::net::TcpStream) {
        let auth = JobAuth { job: "j".into(), secret: Secret::generate().unwrap() };
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let secret = auth.secret.clone();
        let accepted = std::thread::spawn(move || {
            let (mut conn, _) = l.accept().unwrap();
            let keys = {
                let mut deadline =
                    edl_host_gpu::comm::auth::Deadline::new(&mut conn, Duration::from_secs(10));
                edl_host_gpu::comm::auth::accept(&mut deadline, &secret, |_| Ok(())).unwrap()
            };
            (conn, keys)
        });
        let mut worker = std::net::TcpStream::connect(addr).unwrap();
        worker.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let keys = edl_host_gpu::comm::auth::connect(&mut worker, &auth.secret, &auth.claim("control", 0, 1))
            .unwrap();
        let (conn, (_, coordinator_keys)) = accepted.join().unwrap();
        let (link, _) = seal(&conn, coordinator_keys).unwrap();
        let (_, rx) = seal(&worker, keys).unwrap();
        (link, Receiver::new(rx), worker)
    }

    #[test]
    fn a_worker_added_hears_beats_until_it_is_removed() {
        let (link, mut rx, worker) = sealed();
        let mut out = Outbox::direct(link);
        let beats = Beats::start(Duration::from_millis(50));
        beats.add(7, &out);
        for _ in 0..3 {
            assert!(matches!(rx.recv::<ToWorker>(), Ok(ToWorker::Beat)), "a beat every 50 ms");
        }
        // What the coordinator sends goes whole between beats.
        out.send_encoded(&encode(&ToWorker::Stop { reason: "done".into() }).unwrap()).unwrap();
        let stop = std::iter::from_fn(|| rx.recv::<ToWorker>().ok())
            .find(|m| !matches!(m, ToWorker::Beat))
            .expect("the stop among the beats");
        assert!(matches!(stop, ToWorker::Stop { reason } if reason == "done"));
        beats.remove(7);
        // Removed: beats written before (or under way) arrive within a few
        // of their periods; after them, nothing for a second (twenty beats'
        // time): the read times out.
        worker.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        for _ in 0..10 {
            if rx.recv::<ToWorker>().is_err() {
                break;
            }
        }
        worker.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        let after = rx.recv::<ToWorker>();
        assert!(after.is_err(), "a beat after the worker was removed: {after:?}");
    }

    #[test]
    fn workers_behind_a_relay_get_one_fan_frame_per_relay() {
        let (out, mut relay_end) = crate::control::outbox::relay_pair();
        let relayed = |conn: u64| Outbox::Relayed {
            conn,
            host: 40,
            relay: out.clone(),
            name: format!("worker {conn} through relay 40"),
        };
        let targets = Targets::default();
        let beats = Beats { targets: targets.clone(), _stop: mpsc::channel().0 };
        beats.add(1, &relayed(11));
        beats.add(2, &relayed(12));
        let line = encode(&ToWorker::Beat).unwrap();
        beat(&targets, &line);
        let frame = Frame::read(&mut relay_end).unwrap().expect("a frame");
        let Frame::Fan { mut conns, line: fanned } = frame else { panic!("{frame:?}") };
        conns.sort();
        assert_eq!((conns, fanned), (vec![11, 12], line));
    }
}
