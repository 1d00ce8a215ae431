//! `edl-runtime agent`: one host's share of a `launch --torchrun` job
//! across hosts. It proves the job's secret on the launcher's port, runs
//! the ranks of each group it is given, passes their output and exits on,
//! and stops them when told, when the launcher goes away, or when it is
//! itself stopped: no rank outlives its agent.

use super::hosts::{FromAgent, ToAgent};
use super::ranks::{Line, Placement, Ranks, free_port};
use crate::job::proto::{self, Receiver, Sender};
use anyhow::{Context, Result, anyhow, bail};
use edl_host_gpu::comm::auth::{self, JobAuth};
use std::{
    net::{IpAddr, SocketAddr, TcpStream},
    path::PathBuf,
    sync::mpsc,
    time::Duration,
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

/// What the agent's loop hears: the launcher, or the end of its connection.
enum Heard {
    Told(ToAgent),
    Gone(String),
}

/// Runs the agent until the launcher sends it away (Ok, with the reason)
/// or is lost (an error).
pub fn run_agent(a: AgentArgs) -> Result<String> {
    let mut stream = TcpStream::connect_timeout(&a.coordinator, CONNECT_TIMEOUT)
        .with_context(|| format!("connecting to the launcher at {}", a.coordinator))?;
    stream.set_read_timeout(Some(CONNECT_TIMEOUT))?;
    let keys = auth::connect(&mut stream, &a.auth.secret, &a.auth.claim("agent", 0, a.id))
        .map_err(|e| anyhow!("the launcher at {} refused this agent: {e}", a.coordinator))?;
    let _ = stream.set_nodelay(true);
    proto::keepalive(&stream);
    // The address this host reaches the launcher from is the one other
    // hosts reach it at (the store of group rank 0 listens there).
    let here = stream.local_addr()?.ip();
    let (to, from) = proto::seal(&stream, keys)?;
    let (to, mut from) = (Sender::new(to), Receiver::new(from));
    to.send(&FromAgent::Hello { agent: a.id, host: here.to_string(), pid: std::process::id() })?;
    let (id, job, command, nproc, max_restarts, heartbeat, grace) = match from.recv::<ToAgent>()? {
        ToAgent::Welcome { agent, job, command, nproc, max_restarts, heartbeat_ms, grace_ms } => (
            agent,
            job,
            command,
            nproc,
            max_restarts,
            Duration::from_millis(heartbeat_ms.max(10)),
            Duration::from_millis(grace_ms),
        ),
        ToAgent::Exit { reason } => bail!("the launcher sent this agent away: {reason}"),
        other => bail!("the launcher's first message was {other:?}, not the job"),
    };
    stream.set_read_timeout(None)?;
    eprintln!("agent {id}: joined job {job:?} at {}, {nproc} ranks on {here}", a.coordinator);
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
    std::thread::spawn(move || {
        while beat.send(&FromAgent::Heartbeat).is_ok() {
            std::thread::sleep(heartbeat);
        }
    });
    let (lines_tx, lines) = mpsc::channel::<Line>();
    let mut ranks: Option<Ranks> = None;
    loop {
        while let Ok((group, rank, line)) = lines.try_recv() {
            println!("[group {group} rank {rank}] {line}");
            let _ = to.send(&FromAgent::Output { group, rank, line });
        }
        if let Some(r) = &mut ranks
            && let Some((rank, exit)) = r.poll()
        {
            let group = r.place().group;
            let failure = (!exit.success()).then(|| {
                let mut f = r.failure(rank, exit);
                f.host = Some(here.to_string());
                f
            });
            to.send(&FromAgent::Exited { group, rank, exit, failure })?;
            continue;
        }
        let told = match rx.recv_timeout(Duration::from_millis(20)) {
            Ok(Heard::Told(m)) => m,
            Ok(Heard::Gone(why)) => {
                drop(ranks.take());
                bail!("lost the launcher at {}: {why}; this host's ranks were stopped", a.coordinator);
            }
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => bail!("the launcher's connection reader stopped"),
        };
        match told {
            ToAgent::Start { group, group_rank, group_world, restart_count, master_addr, master_port } => {
                if let Some(mut old) = ranks.take() {
                    old.stop(grace);
                }
                let (master_addr, master_port) = if master_port == 0 {
                    (here.to_string(), free_port(here)?)
                } else {
                    (master_addr, master_port)
                };
                let place = Placement {
                    group,
                    job: job.clone(),
                    restart_count,
                    max_restarts,
                    master_addr,
                    master_port,
                    group_rank,
                    group_world,
                    nproc,
                    log_dir: a.log_dir.join(format!("group-{group}")),
                    extra_env: collectives_env(here),
                };
                match Ranks::start(&command, &place, &lines_tx) {
                    Ok(r) => {
                        ranks = Some(r);
                        to.send(&FromAgent::Started { group, master_port })?;
                    }
                    Err(e) => {
                        // Told as the first rank's failure: the launcher
                        // restarts or gives up as for any failed rank.
                        eprintln!("agent {id}: cannot start group {group}: {e:#}");
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
                        to.send(&FromAgent::Exited {
                            group,
                            rank: place.rank(0),
                            exit,
                            failure: Some(failure),
                        })?;
                    }
                }
            }
            ToAgent::Stop { group } => {
                if let Some(mut r) = ranks.take() {
                    r.stop(grace);
                }
                // What the stopped ranks wrote last goes before the word that they stopped.
                while let Ok((g, rank, line)) = lines.recv_timeout(Duration::from_millis(50)) {
                    let _ = to.send(&FromAgent::Output { group: g, rank, line });
                }
                to.send(&FromAgent::Stopped { group })?;
            }
            ToAgent::Exit { reason } => {
                drop(ranks.take());
                return Ok(reason);
            }
            ToAgent::Welcome { .. } => {}
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
