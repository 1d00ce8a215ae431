//! One host's ranks of a torchrun group: their processes, their
//! environment (torchrun's, for this host's place in the group), their
//! output and how each ended. The launcher runs them for a group on its own
//! host; an agent (`edl-runtime agent`) runs them for its host's share of a
//! group across hosts.

use super::c10d::Bridge;
use crate::process::{die_with_parent, log_tail};
use anyhow::{Context, Result};
use edl_host_gpu::comm::auth::JobAuth;
use serde::{Deserialize, Serialize};
use std::{
    fmt,
    io::{BufRead, BufReader, Write},
    net::ToSocketAddrs,
    os::unix::process::ExitStatusExt,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

/// How a rank's process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Exit {
    Code(i32),
    Signal(i32),
}

impl Exit {
    fn of(status: ExitStatus) -> Exit {
        match (status.code(), status.signal()) {
            (Some(c), _) => Exit::Code(c),
            (None, Some(s)) => Exit::Signal(s),
            (None, None) => Exit::Code(-1),
        }
    }

    pub fn success(self) -> bool {
        self == Exit::Code(0)
    }

    /// The launcher's own exit code for this failure: the rank's code, or
    /// 128 + the signal, as a shell reports it.
    pub fn launcher_code(self) -> u8 {
        match self {
            Exit::Code(c) if (1..=255).contains(&c) => c as u8,
            Exit::Code(_) => 1,
            Exit::Signal(s) => 128u8.saturating_add(s.clamp(0, 127) as u8),
        }
    }
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Exit::Code(c) => write!(f, "exit code {c}"),
            Exit::Signal(s) => {
                let name = match s {
                    libc::SIGKILL => " (SIGKILL)",
                    libc::SIGTERM => " (SIGTERM)",
                    libc::SIGSEGV => " (SIGSEGV)",
                    libc::SIGABRT => " (SIGABRT)",
                    libc::SIGINT => " (SIGINT)",
                    libc::SIGBUS => " (SIGBUS)",
                    _ => "",
                };
                write!(f, "killed by signal {s}{name}")
            }
        }
    }
}

/// The failure that ended the job, or the one a restart followed.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RankFailure {
    /// The rank in the whole group.
    pub rank: u32,
    pub pid: u32,
    #[serde(serialize_with = "display", deserialize_with = "exit_back")]
    pub exit: Exit,
    /// The rank's log, on the host it ran on.
    pub log: PathBuf,
    /// The last lines of the rank's log.
    pub log_tail: String,
    /// The message of the rank's error file (torch's `@record`), if any.
    pub error: Option<String>,
    /// The host it ran on, for a group across hosts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
}

fn display<S: serde::Serializer>(v: &impl fmt::Display, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

/// Reads [`Exit`] back from its display form (`exit code 3`, `signal 9 (SIGKILL)`).
fn exit_back<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Exit, D::Error> {
    let s = String::deserialize(d)?;
    let number = |rest: &str| rest.split_whitespace().next().and_then(|n| n.parse::<i32>().ok());
    if let Some(rest) = s.strip_prefix("exit code ")
        && let Some(c) = number(rest)
    {
        return Ok(Exit::Code(c));
    }
    if let Some(rest) = s.strip_prefix("killed by signal ")
        && let Some(n) = number(rest)
    {
        return Ok(Exit::Signal(n));
    }
    Err(serde::de::Error::custom(format!("not an exit: {s:?}")))
}

impl fmt::Display for RankFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} (pid {}", self.rank, self.pid)?;
        if let Some(h) = &self.host {
            write!(f, " on {h}")?;
        }
        write!(f, ") failed: {}", self.exit)?;
        if let Some(e) = &self.error {
            write!(f, "\n  its error file says: {e}")?;
        }
        if !self.log_tail.is_empty() {
            write!(f, "\n  {}", self.log_tail.trim_start_matches("; "))?;
        }
        Ok(())
    }
}

/// One host's place in a group: what torchrun's environment tells its ranks.
#[derive(Clone, Debug)]
pub struct Placement {
    /// The group's number (a new one at each restart or resize).
    pub group: u32,
    /// `TORCHELASTIC_RUN_ID`.
    pub job: String,
    /// `TORCHELASTIC_RESTART_COUNT` and `TORCHELASTIC_MAX_RESTARTS`.
    pub restart_count: u32,
    pub max_restarts: u32,
    /// Where the group's c10d store is served (on group rank 0's host,
    /// sealed; the ranks reach it through this host's [`Bridge`]).
    pub master_addr: String,
    pub master_port: u16,
    /// This host's index among the group's hosts (`GROUP_RANK`), and their number.
    pub group_rank: u32,
    pub group_world: u32,
    /// Ranks on each host (`LOCAL_WORLD_SIZE`).
    pub nproc: u32,
    /// Where this host's ranks log (`rank-R.log`, R the global rank).
    pub log_dir: PathBuf,
    /// More variables for this host's ranks.
    pub extra_env: Vec<(String, String)>,
}

impl Placement {
    /// Ranks in the whole group.
    pub fn world(&self) -> u32 {
        self.group_world * self.nproc
    }

    /// The global rank of local rank `local`.
    pub fn rank(&self, local: u32) -> u32 {
        self.group_rank * self.nproc + local
    }

    /// torchrun's environment for local rank `local`.
    /// `bridge`: the port of this host's loopback endpoint to the store.
    fn env(&self, local: u32, bridge: u16) -> Vec<(&'static str, String)> {
        let (rank, world) = (self.rank(local).to_string(), self.world().to_string());
        vec![
            ("RANK", rank.clone()),
            ("LOCAL_RANK", local.to_string()),
            ("GROUP_RANK", self.group_rank.to_string()),
            ("ROLE_RANK", rank),
            ("ROLE_NAME", "default".into()),
            ("WORLD_SIZE", world.clone()),
            ("LOCAL_WORLD_SIZE", self.nproc.to_string()),
            ("ROLE_WORLD_SIZE", world),
            ("GROUP_WORLD_SIZE", self.group_world.to_string()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", bridge.to_string()),
            ("TORCHELASTIC_RESTART_COUNT", self.restart_count.to_string()),
            ("TORCHELASTIC_MAX_RESTARTS", self.max_restarts.to_string()),
            ("TORCHELASTIC_RUN_ID", self.job.clone()),
            // The store is the agent's (the bridge): no rank starts one of its own.
            ("TORCHELASTIC_USE_AGENT_STORE", "True".into()),
            ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1".into()),
            ("PYTHONUNBUFFERED", "1".into()),
        ]
    }
}

/// A line a rank wrote: (group, global rank, line).
pub type Line = (u32, u32, String);

/// One rank's process.
struct Rank {
    child: Child,
    log: PathBuf,
    error_file: PathBuf,
    exit: Option<Exit>,
}

/// This host's running ranks of one group.
pub struct Ranks {
    place: Placement,
    ranks: Vec<Rank>,
    /// The ranks' way to the group's store, open while they run.
    _bridge: Bridge,
}

impl Ranks {
    /// Starts this host's `place.nproc` ranks of `command`; their lines go
    /// to `lines`; they reach the group's store proving `store`'s secret.
    pub fn start(
        command: &[String],
        place: &Placement,
        store: &JobAuth,
        lines: &mpsc::Sender<Line>,
    ) -> Result<Ranks> {
        std::fs::create_dir_all(&place.log_dir).with_context(|| {
            format!("{}: cannot create the group's log directory", place.log_dir.display())
        })?;
        let (exe, args) = command.split_first().context("no program to launch")?;
        let store_addr = match place.master_addr.parse::<std::net::IpAddr>() {
            Ok(ip) => std::net::SocketAddr::new(ip, place.master_port),
            Err(_) => (place.master_addr.as_str(), place.master_port)
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.next())
                .with_context(|| {
                    format!(
                        "the group's store address {}:{} does not resolve",
                        place.master_addr, place.master_port
                    )
                })?,
        };
        let bridge = Bridge::start(store_addr, store.clone(), place.group)?;
        let mut ranks = Vec::new();
        for local in 0..place.nproc {
            let rank = place.rank(local);
            let log = place.log_dir.join(format!("rank-{rank}.log"));
            let error_file = place.log_dir.join(format!("rank-{rank}.error.json"));
            let (reader, writer) = std::io::pipe().context("creating a pipe for a rank's output")?;
            let mut cmd = Command::new(exe);
            cmd.args(args)
                .envs(place.env(local, bridge.port()))
                .envs(place.extra_env.iter().map(|(k, v)| (k, v)))
                .env("TORCHELASTIC_ERROR_FILE", &error_file)
                .stdin(Stdio::null())
                .stdout(writer.try_clone()?)
                .stderr(writer);
            if place.nproc > 1 && std::env::var_os("OMP_NUM_THREADS").is_none() {
                // As torchrun: ranks sharing a host do not each take every core.
                cmd.env("OMP_NUM_THREADS", "1");
            }
            die_with_parent(&mut cmd);
            // A process group of its own (as torchrun's ranks): when the
            // rank ends, what it started (its data loader's processes, which
            // hold its sockets) is stopped with it, so that the other ranks'
            // collectives fail at once instead of at their timeout.
            std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
            let child = cmd.spawn().with_context(|| format!("cannot start rank {rank} ({exe})"))?;
            // `cmd` holds the pipe's write end until it is dropped: the
            // reader sees the end of the output when the rank's are closed.
            drop(cmd);
            let file = std::fs::File::create(&log).with_context(|| format!("{}", log.display()))?;
            copy_lines(place.group, rank, reader, file, lines.clone());
            ranks.push(Rank { child, log, error_file, exit: None });
        }
        Ok(Ranks { place: place.clone(), ranks, _bridge: bridge })
    }

    pub fn place(&self) -> &Placement {
        &self.place
    }

    /// The first rank found ended since the last call: (global rank, exit).
    pub fn poll(&mut self) -> Option<(u32, Exit)> {
        for (i, r) in self.ranks.iter_mut().enumerate() {
            if r.exit.is_none()
                && let Ok(Some(status)) = crate::process::reap_one(&mut r.child)
            {
                let exit = Exit::of(status);
                r.exit = Some(exit);
                return Some((self.place.rank(i as u32), exit));
            }
        }
        None
    }

    /// SIGTERM to every rank still running, SIGKILL to those left after `grace`.
    pub fn stop(&mut self, grace: Duration) {
        // Ranks `poll` reaped already are not signalled: their pids may be
        // another process's by now.
        let live = |r: &&mut Rank| r.exit.is_none();
        for r in self.ranks.iter_mut().filter(live) {
            crate::process::signal_group(&r.child, libc::SIGTERM);
        }
        let until = Instant::now() + grace;
        while Instant::now() < until
            && self.ranks.iter().any(|r| r.exit.is_none() && crate::process::runs(&r.child))
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        for r in self.ranks.iter_mut().filter(live) {
            crate::process::signal_group(&r.child, libc::SIGKILL);
            let _ = r.child.wait();
        }
    }

    /// What is known of global rank `rank`'s failure.
    pub fn failure(&self, rank: u32, exit: Exit) -> RankFailure {
        let local = rank.saturating_sub(self.place.group_rank * self.place.nproc) as usize;
        let r = &self.ranks[local.min(self.ranks.len().saturating_sub(1))];
        RankFailure {
            rank,
            pid: r.child.id(),
            exit,
            log: r.log.clone(),
            log_tail: log_tail(&r.log, 20),
            error: error_message(&r.error_file),
            host: None,
        }
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(2));
    }
}

/// Copies a rank's output to its log and to `to`, line by line.
fn copy_lines(
    group: u32,
    rank: u32,
    from: std::io::PipeReader,
    mut log: std::fs::File,
    to: mpsc::Sender<Line>,
) {
    std::thread::spawn(move || {
        for line in BufReader::new(from).lines() {
            let Ok(line) = line else { break };
            let _ = writeln!(log, "{line}");
            // The launcher may be gone; the log still gets the rest.
            let _ = to.send((group, rank, line));
        }
    });
}

/// The message of a torchelastic error file (`{"message": {"message": ...}}`
/// as torch's `@record` writes it, or `{"message": "..."}`).
pub fn error_message(path: &Path) -> Option<String> {
    let text = std::fs::read(path).ok()?;
    let v: serde_json::Value = serde_json::from_slice(&text).ok()?;
    let m = &v["message"];
    let s = m["message"].as_str().or_else(|| m.as_str())?;
    Some(s.trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exits_read_as_a_shell_reports_them() {
        assert_eq!(Exit::Code(3).launcher_code(), 3);
        assert_eq!(Exit::Signal(9).launcher_code(), 137);
        assert_eq!(Exit::Code(300).launcher_code(), 1);
        assert_eq!(Exit::Signal(9).to_string(), "killed by signal 9 (SIGKILL)");
    }

    #[test]
    fn a_failure_travels_between_hosts_whole() {
        for exit in [Exit::Code(3), Exit::Signal(9), Exit::Signal(64), Exit::Code(-1)] {
            let f = RankFailure {
                rank: 5,
                pid: 77,
                exit,
                log: "/l/rank-5.log".into(),
                log_tail: "boom".into(),
                error: Some("ValueError: x".into()),
                host: Some("h2".into()),
            };
            let back: RankFailure = serde_json::from_str(&serde_json::to_string(&f).unwrap()).unwrap();
            assert_eq!((back.exit, back.rank, back.host.as_deref()), (exit, 5, Some("h2")));
        }
    }

    #[test]
    fn the_environment_places_each_rank_as_torchrun_does_across_hosts() {
        let p = Placement {
            group: 2,
            job: "j".into(),
            restart_count: 1,
            max_restarts: 3,
            master_addr: "10.0.0.1".into(),
            master_port: 29500,
            group_rank: 1,
            group_world: 3,
            nproc: 2,
            log_dir: "/tmp".into(),
            extra_env: Vec::new(),
        };
        let env: std::collections::HashMap<_, _> = p.env(1, 41000).into_iter().collect();
        for (k, v) in [
            ("RANK", "3"),
            ("LOCAL_RANK", "1"),
            ("GROUP_RANK", "1"),
            ("WORLD_SIZE", "6"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("GROUP_WORLD_SIZE", "3"),
            // The store is reached through this host's loopback bridge.
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "41000"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RESTART_COUNT", "1"),
        ] {
            assert_eq!(env[k], v, "{k}");
        }
    }
}
