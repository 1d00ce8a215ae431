//! `edl-runtime agent`: one host's share of a `launch --torchrun` job
//! across hosts. It proves the job's secret on the launcher's port, runs
//! the ranks of each group it is given, passes their output and exits on,
//! and stops them when told, when the launcher goes away, or when it is
//! itself stopped: no rank outlives its agent. With a shared store an agent
//! whose launcher goes away keeps its ranks for a while and follows the
//! launcher that takes the job over (a higher lease token, never a lower).

use super::c10d::GroupStore;
use super::follow::{Found, Lookup};
use super::hosts::{FromAgent, ToAgent};
use super::ranks::{Line, Placement, Ranks};
use crate::control::outbox::{Outbox, Sender};
use crate::control::proto::{self, Receiver};
use crate::job::spec::{Follow, Leader};
use anyhow::{Context, Result, anyhow, bail};
use edl_host_gpu::comm::auth::{self, JobAuth};
use std::{
    net::{IpAddr, SocketAddr, TcpStream},
    path::PathBuf,
    sync::mpsc,
    time::{Duration, Instant},
};

/// Who the agent is and where it reports.
pub struct AgentArgs {
    /// The launcher's agent port.
    pub coordinator: SocketAddr,
    /// This agent's id (0: the launcher gives one).
    pub id: u64,
    pub auth: JobAuth,
    /// Where its groups' ranks log (`group-G/rank-R.log`).
    pub log_dir: PathBuf,
}

/// How long connecting to the launcher may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest one write to the launcher may block, if the lease is shorter.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// How often an agent that lost its launcher asks the store who leads the job.
const LOOK_EVERY: Duration = Duration::from_millis(250);

/// What the agent's loop hears: the launcher, or the end of its connection.
enum Heard {
    Told(ToAgent),
    Gone(String),
}

/// The job as the launcher gave it.
struct Job {
    id: u64,
    job: String,
    command: Vec<String>,
    nproc: u32,
    max_restarts: u32,
    heartbeat: Duration,
    grace: Duration,
    /// The store and the token of the launcher followed (None: the ranks
    /// end with the launcher).
    follow: Option<Follow>,
    reconnect: Duration,
    /// A launcher silent this long is lost (zero: only a closed connection is).
    lease: Duration,
}

/// A connection to a launcher that welcomed this agent.
struct Launcher {
    addr: SocketAddr,
    stream: TcpStream,
    to: Sender,
    rx: mpsc::Receiver<Heard>,
    heard: Instant,
    /// The address this host reaches the launcher from.
    here: IpAddr,
}

impl Launcher {
    /// Joins the launcher at `addr` as agent `id` (0: it gives one),
    /// saying which group's ranks run here; returns it and the job.
    fn join(addr: SocketAddr, id: u64, auth: &JobAuth, running: Option<u32>) -> Result<(Launcher, Job)> {
        let mut stream = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
            .with_context(|| format!("connecting to the launcher at {addr}"))?;
        stream.set_read_timeout(Some(CONNECT_TIMEOUT))?;
        let keys = auth::connect(&mut stream, &auth.secret, &auth.claim("agent", 0, id))
            .map_err(|e| anyhow!("the launcher at {addr} refused this agent: {e}"))?;
        let _ = stream.set_nodelay(true);
        proto::keepalive(&stream);
        // The address this host reaches the launcher from is the one other
        // hosts reach it at (the store of group rank 0 listens there).
        let here = stream.local_addr()?.ip();
        let (to, from) = proto::seal(&stream, keys)?;
        let (to, mut from) = (Sender::new(Outbox::direct(to)), Receiver::new(from));
        let pid = std::process::id();
        let protocol = proto::PROTOCOL;
        to.send(&FromAgent::Hello { agent: id, host: here.to_string(), pid, running, protocol })?;
        let job = Job::of(from.recv::<ToAgent>()?)?;
        stream.set_read_timeout(None)?;
        // A launcher frozen (SIGSTOP, a paused VM) reads nothing: a write
        // to it fails within the lease (10 s at least), and the connection
        // once what was sent stays unacknowledged that long, rather than
        // every write blocking for good once the ranks' output has filled
        // its buffer (and the check of its silence with them).
        // At least the lease: a launcher frozen for less gets what was
        // written whole when it wakes (a write given up midway would leave
        // half a sealed frame in the stream).
        stream.set_write_timeout(Some(WRITE_TIMEOUT.max(job.lease)))?;
        proto::give_up_unacked(&stream, job.lease.max(Duration::from_secs(1)));
        let (tx, rx) = mpsc::channel::<Heard>();
        std::thread::spawn(move || {
            loop {
                match from.recv::<ToAgent>() {
                    Ok(m) => {
                        if tx.send(Heard::Told(m)).is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Heard::Gone(e.to_string()));
                        return;
                    }
                }
            }
        });
        let beat = to.clone();
        let every = job.heartbeat;
        std::thread::spawn(move || {
            while beat.send(&FromAgent::Heartbeat).is_ok() {
                std::thread::sleep(every);
            }
        });
        Ok((Launcher { addr, stream, to, rx, heard: Instant::now(), here }, job))
    }

    /// What the launcher said within `wait`: a message, its loss (closed,
    /// or silent for `lease`), or nothing yet.
    fn hear(&mut self, wait: Duration, lease: Duration) -> Option<Heard> {
        match self.rx.recv_timeout(wait) {
            Ok(Heard::Told(ToAgent::Heartbeat)) => {
                self.heard = Instant::now();
                None
            }
            Ok(Heard::Told(m)) => {
                self.heard = Instant::now();
                Some(Heard::Told(m))
            }
            Ok(gone) => Some(gone),
            Err(mpsc::RecvTimeoutError::Timeout) if !lease.is_zero() && self.heard.elapsed() > lease => {
                Some(Heard::Gone(format!("silent for {:.1} s", self.heard.elapsed().as_secs_f64())))
            }
            Err(mpsc::RecvTimeoutError::Timeout) => None,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                Some(Heard::Gone("its connection's reader stopped".into()))
            }
        }
    }
}

/// The agent's ranks and what they said that the launcher has not heard.
struct Here {
    ranks: Option<Ranks>,
    lines: mpsc::Receiver<Line>,
    lines_tx: mpsc::Sender<Line>,
    /// Exits of ranks that the launcher could not be told (it was lost):
    /// told to the launcher that takes the job over.
    untold: Vec<FromAgent>,
    /// The c10d store of the groups whose rank 0 this host holds, served
    /// once asked for.
    store: Option<GroupStore>,
}

impl Here {
    /// Passes the ranks' output and exits on; an exit the launcher cannot
    /// take is kept for the next one.
    fn report(&mut self, to: &Sender, here: IpAddr) {
        // After a write that failed (a launcher gone or frozen), the rest
        // is printed here only: one blocked write per line would keep the
        // agent from hearing that its launcher is lost.
        let mut passing = true;
        while let Ok((group, rank, line)) = self.lines.try_recv() {
            println!("[group {group} rank {rank}] {line}");
            passing = passing && to.send(&FromAgent::Output { group, rank, line }).is_ok();
        }
        let Some(r) = &mut self.ranks else { return };
        while let Some((rank, exit)) = r.poll() {
            let group = r.place().group;
            let failure = (!exit.success()).then(|| {
                let mut f = r.failure(rank, exit);
                f.host = Some(here.to_string());
                f
            });
            let msg = FromAgent::Exited { group, rank, exit, failure };
            if to.send(&msg).is_err() {
                self.untold.push(msg);
            }
        }
    }
}

/// Runs the agent until the launcher sends it away (Ok, with the reason)
/// or is lost (an error). With a store, an agent that loses its launcher
/// keeps its ranks and follows the launcher that takes the job over.
pub fn run_agent(a: AgentArgs) -> Result<String> {
    let (mut l, mut job) = Launcher::join(a.coordinator, a.id, &a.auth, None)?;
    eprintln!(
        "agent {}: joined job {:?} at {}, {} ranks on {}",
        job.id, job.job, a.coordinator, job.nproc, l.here
    );
    let (lines_tx, lines) = mpsc::channel::<Line>();
    let mut h = Here { ranks: None, lines, lines_tx, untold: Vec::new(), store: None };
    loop {
        h.report(&l.to, l.here);
        let told = match l.hear(Duration::from_millis(20), job.lease) {
            Some(Heard::Told(m)) => m,
            Some(Heard::Gone(why)) => {
                let _ = l.stream.shutdown(std::net::Shutdown::Both);
                match follow(&a, &mut l, &mut job, &mut h, &why)? {
                    Some(reason) => return Ok(reason),
                    None => continue,
                }
            }
            None => continue,
        };
        if let Some(reason) = obey(told, &l, &job, &a, &mut h)? {
            return Ok(reason);
        }
    }
}

/// Does what the launcher said; Some: it sent the agent away, saying why.
fn obey(told: ToAgent, l: &Launcher, job: &Job, a: &AgentArgs, h: &mut Here) -> Result<Option<String>> {
    let (to, here) = (&l.to, l.here);
    match told {
        ToAgent::Start { group, group_rank, group_world, restart_count, master_addr, master_port } => {
            if let Some(mut old) = h.ranks.take() {
                old.stop(job.grace);
            }
            let (master_addr, master_port) = if master_port == 0 {
                if h.store.is_none() {
                    h.store = Some(GroupStore::serve(here, a.auth.clone())?);
                }
                let store = h.store.as_ref().expect("served just above");
                store.open(group);
                (here.to_string(), store.port())
            } else {
                (master_addr, master_port)
            };
            let place = Placement {
                group,
                job: job.job.clone(),
                restart_count,
                max_restarts: job.max_restarts,
                master_addr,
                master_port,
                group_rank,
                group_world,
                nproc: job.nproc,
                log_dir: a.log_dir.join(format!("group-{group}")),
                extra_env: collectives_env(here),
            };
            match Ranks::start(&job.command, &place, &a.auth, &h.lines_tx) {
                Ok(r) => {
                    h.ranks = Some(r);
                    to.send(&FromAgent::Started { group, master_port })?;
                }
                Err(e) => {
                    // Told as the first rank's failure: the launcher
                    // restarts or gives up as for any failed rank.
                    eprintln!("agent {}: cannot start group {group}: {e:#}", job.id);
                    let exit = super::Exit::Code(127);
                    let failure = super::RankFailure {
                        rank: place.rank(0),
                        pid: 0,
                        exit,
                        log: place.log_dir.clone(),
                        log_tail: format!("{e:#}"),
                        error: None,
                        host: Some(here.to_string()),
                    };
                    to.send(&FromAgent::Exited { group, rank: place.rank(0), exit, failure: Some(failure) })?;
                }
            }
        }
        ToAgent::Stop { group } => {
            if let Some(mut r) = h.ranks.take() {
                r.stop(job.grace);
            }
            // What the stopped ranks wrote last goes before the word that they stopped.
            while let Ok((g, rank, line)) = h.lines.recv_timeout(Duration::from_millis(50)) {
                let _ = to.send(&FromAgent::Output { group: g, rank, line });
            }
            h.untold.clear();
            to.send(&FromAgent::Stopped { group })?;
        }
        ToAgent::Exit { reason } => {
            drop(h.ranks.take());
            return Ok(Some(reason));
        }
        ToAgent::Welcome { .. } | ToAgent::Heartbeat => {}
    }
    Ok(None)
}

/// The launcher was lost (`why`). Without a store the ranks stop with it.
/// With one, the ranks run on while the agent asks the store, every
/// [`LOOK_EVERY`] for the job's reconnect time, who leads the job: a
/// launcher with a higher lease token than the lost one's is joined (the
/// agent proves the job's secret and says which group it runs), and told
/// the exits it missed. Some: the job ended meanwhile (the reason).
fn follow(a: &AgentArgs, l: &mut Launcher, job: &mut Job, h: &mut Here, why: &str) -> Result<Option<String>> {
    let lost = format!("agent {}: lost the launcher at {} ({why})", job.id, l.addr);
    let Some(f) = job.follow.clone().filter(|_| !job.reconnect.is_zero()) else {
        drop(h.ranks.take());
        bail!("{lost}; this host's ranks were stopped");
    };
    eprintln!("{lost}; its ranks run on while it looks for the launcher that takes the job over");
    let lookup = Lookup::open(&f.store, &job.job, &a.auth.secret);
    let deadline = Instant::now() + job.reconnect;
    let mut last = String::from("the store names no other launcher");
    while Instant::now() < deadline {
        h.report(&l.to, l.here);
        let found = match &lookup {
            Ok(s) => s.look(f.token).map_err(|e| e.to_string()),
            Err(e) => Err(format!("{e:#}")),
        };
        match found {
            Ok(Found::Leader(leader)) => match rejoin(a, job, h, &leader) {
                Ok((next, next_job)) => {
                    eprintln!(
                        "agent {}: now with the launcher at {} (lease token {})",
                        job.id, leader.addr, leader.token
                    );
                    (*l, *job) = (next, next_job);
                    for msg in std::mem::take(&mut h.untold) {
                        let _ = l.to.send(&msg);
                    }
                    return Ok(None);
                }
                Err(Rejoined::Sent(reason)) => {
                    drop(h.ranks.take());
                    return Ok(Some(reason));
                }
                Err(Rejoined::OtherVersion(why)) => {
                    drop(h.ranks.take());
                    bail!("{why}; this host's ranks were stopped");
                }
                Err(Rejoined::Failed(e)) => last = e,
            },
            Ok(Found::Finished) => {
                drop(h.ranks.take());
                return Ok(Some("the job is over (the store says so)".into()));
            }
            Ok(Found::Nothing) => {}
            Err(e) => last = e,
        }
        std::thread::sleep(LOOK_EVERY.min(deadline.saturating_duration_since(Instant::now())));
    }
    drop(h.ranks.take());
    bail!(
        "{lost}; no launcher took the job over within {:.0} s ({last}); this host's ranks were stopped",
        job.reconnect.as_secs_f64()
    )
}

impl Job {
    /// The job the launcher's first message gives (its welcome), or why
    /// there is none: it sent the agent away, or speaks another protocol.
    fn of(first: ToAgent) -> Result<Job> {
        Ok(match first {
            ToAgent::Welcome {
                agent,
                job,
                command,
                nproc,
                max_restarts,
                heartbeat_ms,
                grace_ms,
                follow,
                reconnect_ms,
                lease_ms,
                protocol,
            } => {
                if let Some(why) = proto::protocol_mismatch("the launcher", protocol) {
                    bail!("{why}");
                }
                Job {
                    id: agent,
                    job,
                    command,
                    nproc,
                    max_restarts,
                    heartbeat: Duration::from_millis(heartbeat_ms.max(10)),
                    grace: Duration::from_millis(grace_ms),
                    follow,
                    reconnect: Duration::from_millis(reconnect_ms),
                    lease: Duration::from_millis(lease_ms),
                }
            }
            ToAgent::Exit { reason } => bail!("the launcher sent this agent away: {reason}"),
            other => bail!("the launcher's first message was {other:?}, not the job"),
        })
    }
}

/// Why joining the next launcher did not happen.
enum Rejoined {
    /// It sent the agent away.
    Sent(String),
    /// It runs another version of edl (it or the agent refused the other):
    /// trying again cannot help.
    OtherVersion(String),
    Failed(String),
}

/// Joins `leader`, which took the job over, saying which group's ranks
/// run here; it welcomes the agent with the job (and its own token).
fn rejoin(a: &AgentArgs, job: &Job, h: &Here, leader: &Leader) -> Result<(Launcher, Job), Rejoined> {
    let addr = crate::net::resolve(&leader.addr).map_err(|e| Rejoined::Failed(format!("{e:#}")))?;
    let running = h.ranks.as_ref().map(|r| r.place().group);
    match Launcher::join(addr, job.id, &a.auth, running) {
        Ok((l, mut next)) => {
            // Never back to a lower token, whatever the launcher says.
            if let Some(f) = next.follow.as_mut() {
                f.token = f.token.max(leader.token);
            }
            Ok((l, next))
        }
        Err(e) => {
            let text = format!("{e:#}");
            if text.contains(proto::ONE_VERSION) {
                return Err(Rejoined::OtherVersion(text));
            }
            match text.strip_prefix("the launcher sent this agent away: ") {
                Some(reason) => Err(Rejoined::Sent(reason.to_string())),
                None => Err(Rejoined::Failed(text)),
            }
        }
    }
}

/// The interface that holds `ip`.
fn interface_of(ip: IpAddr) -> Option<String> {
    let addrs = nix::ifaddrs::getifaddrs().ok()?;
    for i in addrs {
        let Some(a) = i.address else { continue };
        let held = a
            .as_sockaddr_in()
            .map(|s| IpAddr::V4(s.ip()))
            .or_else(|| a.as_sockaddr_in6().map(|s| IpAddr::V6(s.ip())));
        if held == Some(ip) {
            return Some(i.interface_name);
        }
    }
    None
}

/// Gloo and NCCL choose the interface their connections use from the
/// host's name, which can resolve to loopback (a container, a host whose
/// `/etc/hosts` maps its own name to 127.0.1.1): the peers on other hosts
/// then cannot reach them. The ranks are told the interface this host
/// reaches the launcher on, unless the environment already names one.
fn collectives_env(here: IpAddr) -> Vec<(String, String)> {
    let Some(name) = interface_of(here) else { return Vec::new() };
    ["GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"]
        .into_iter()
        .filter(|k| std::env::var_os(k).is_none())
        .map(|k| (k.to_string(), name.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_collectives_use_the_interface_that_holds_the_address() {
        assert_eq!(interface_of(IpAddr::from([127, 0, 0, 1])).as_deref(), Some("lo"));
        assert_eq!(interface_of(IpAddr::from([192, 0, 2, 77])), None);
        let env = collectives_env(IpAddr::from([127, 0, 0, 1]));
        if std::env::var_os("GLOO_SOCKET_IFNAME").is_none() {
            assert!(env.contains(&("GLOO_SOCKET_IFNAME".into(), "lo".into())), "{env:?}");
        }
    }
}
