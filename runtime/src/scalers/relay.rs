//! [`HostRelay`]: the relay of one host's workers (`edl-runtime relay`, see
//! [`crate::control::relay`]), started by the scaler when the first worker
//! on that host is, and again after it is lost, when the next worker there
//! starts. The local scaler runs it itself; the command scaler by its
//! worker command on the host (`ssh {host} {program}`), one a host.

use crate::process::{await_line, die_with_parent, terminate_group};
use edl_host_gpu::comm::auth::JobAuth;
use std::{
    io::Write,
    path::PathBuf,
    process::{Child, ChildStdin, Command, Stdio},
    time::Duration,
};

/// The relay one host's workers reach the coordinator through.
pub struct HostRelay {
    log_dir: PathBuf,
    /// The job's worker lease, which the relay keeps for the coordinator.
    lease: Duration,
    running: Option<Running>,
    /// One started ahead ([`Self::start_ahead`]), not yet waited for.
    pending: Option<Starting>,
}

struct Running {
    /// Its number (among the job's relays, and its log's).
    id: u64,
    child: Child,
    /// Where workers reach it.
    addr: String,
    /// Held open while the job wants it: it stops when this closes.
    _stdin: Option<ChildStdin>,
}

impl HostRelay {
    pub fn new(log_dir: impl Into<PathBuf>, lease: Duration) -> Self {
        HostRelay { log_dir: log_dir.into(), lease, running: None, pending: None }
    }

    /// Where a new worker is to connect: the running relay, or one started
    /// now (the one before was lost: its workers with it) for the
    /// coordinator at `coordinator`, numbered `next` (then counted).
    /// `command` makes the process that runs relay `id`'s command line
    /// (`edl-runtime` left out: `relay --coordinator ...`) on this host.
    pub fn addr(
        &mut self,
        next: &mut u64,
        coordinator: &str,
        auth: &JobAuth,
        command: impl FnOnce(u64, &[String]) -> anyhow::Result<Command>,
    ) -> anyhow::Result<String> {
        if let Some(addr) = self.running_addr() {
            return Ok(addr);
        }
        self.start_ahead(next, coordinator, auth, command)?;
        let starting = self.pending.take().ok_or_else(|| anyhow::anyhow!("no relay started"))?;
        let r = starting.serving()?;
        let addr = r.addr.clone();
        self.running = Some(r);
        Ok(addr)
    }

    /// Starts this host's relay now, without waiting for it (unless one
    /// runs or was started so): the next [`Self::addr`] waits for it. A
    /// relay started ahead that fails is started again there.
    pub fn start_ahead(
        &mut self,
        next: &mut u64,
        coordinator: &str,
        auth: &JobAuth,
        command: impl FnOnce(u64, &[String]) -> anyhow::Result<Command>,
    ) -> anyhow::Result<()> {
        if self.pending.is_none() && self.running_addr().is_none() {
            self.pending = Some(self.launch(next, coordinator, auth, command)?);
        }
        Ok(())
    }

    /// The running relay's address; None when there is none (a relay that
    /// ended is let go).
    fn running_addr(&mut self) -> Option<String> {
        let r = self.running.as_mut()?;
        match r.child.try_wait() {
            Ok(None) => return Some(r.addr.clone()),
            Ok(Some(status)) => tracing::warn!("relay {} ended ({status}); starting another", r.id),
            Err(e) => tracing::warn!("relay {}: {e}; starting another", r.id),
        }
        if let Some(mut r) = self.running.take() {
            terminate_group(&mut r.child, Duration::ZERO);
        }
        None
    }

    /// Starts relay `next + 1` (then counted) without waiting for it to
    /// serve ([`Starting::serving`] waits).
    fn launch(
        &self,
        next: &mut u64,
        coordinator: &str,
        auth: &JobAuth,
        command: impl FnOnce(u64, &[String]) -> anyhow::Result<Command>,
    ) -> anyhow::Result<Starting> {
        *next += 1;
        let id = *next;
        crate::process::ensure_dir(&self.log_dir)?;
        let path = self.log_dir.join(format!("relay-{id}.log"));
        let log = std::fs::File::create(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let words: Vec<String> = relay_words(coordinator, id, &auth.job, self.lease, "127.0.0.1:0")
            .into_iter()
            .chain(["--secret-file".to_string(), "-".to_string()])
            .collect();
        let mut cmd = command(id, &words).map_err(|e| anyhow::anyhow!("relay {id}: {e:#}"))?;
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(log.try_clone()?);
        die_with_parent(&mut cmd);
        // Ctrl-C is the coordinator's to act on, as for the workers.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let shown = format!("{:?}", cmd.get_program());
        let mut child = crate::process::spawn_lasting(cmd)
            .map_err(|e| anyhow::anyhow!("cannot start relay {id} ({shown}): {e}"))?;
        let stdin =
            child.stdin.take().and_then(|mut s| writeln!(s, "{}", auth.secret.to_hex()).ok().map(|()| s));
        Ok(Starting { id, child: Some(child), path, log: Some(log), stdin })
    }

    /// The coordinator lost relay `id`'s connection: if that is this
    /// host's, its workers are lost, and the next worker here starts
    /// another relay (a relay killed may still listen for a moment while
    /// its process ends). Whether it was this host's.
    pub fn lost(&mut self, id: u64) -> bool {
        if self.pending.as_ref().is_some_and(|s| s.id == id) {
            // Started ahead and not yet waited for: the next worker here
            // starts another.
            self.pending = None;
            return true;
        }
        if self.running.as_ref().is_none_or(|r| r.id != id) {
            return false;
        }
        if let Some(mut r) = self.running.take() {
            terminate_group(&mut r.child, Duration::ZERO);
        }
        self.pending = None;
        true
    }

    /// The running relay's process id.
    pub fn pid(&self) -> Option<u32> {
        self.running.as_ref().map(|r| r.child.id())
    }
}

/// A relay started, not yet serving; stopped if dropped so.
struct Starting {
    id: u64,
    child: Option<Child>,
    path: PathBuf,
    log: Option<std::fs::File>,
    stdin: Option<ChildStdin>,
}

impl Starting {
    /// Waits (30 s at most) for the relay to say where it serves; a relay
    /// that does not is stopped.
    fn serving(mut self) -> anyhow::Result<Running> {
        let id = self.id;
        let (Some(mut child), Some(log)) = (self.child.take(), self.log.take()) else {
            anyhow::bail!("relay {id}: waited for twice");
        };
        let addr = match await_line(&mut child, &self.path, log, Duration::from_secs(30), relaying_on) {
            Ok(addr) => addr,
            Err(why) => {
                terminate_group(&mut child, Duration::ZERO);
                anyhow::bail!("relay {id}: {why}");
            }
        };
        tracing::info!("relay {id} carries its host's workers from {addr}");
        Ok(Running { id, child, addr, _stdin: self.stdin.take() })
    }
}

impl Drop for Starting {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            terminate_group(&mut child, Duration::ZERO);
        }
    }
}

/// The words of relay `id`'s command line after the executable: for the
/// coordinator at `coordinator`, listening on the host's loopback, keeping
/// the job's worker `lease` (its secret given as the caller chooses).
pub(crate) fn relay_words(
    coordinator: &str,
    id: u64,
    job: &str,
    lease: Duration,
    listen: &str,
) -> Vec<String> {
    let (id, lease) = (id.to_string(), lease.as_millis().to_string());
    [
        "relay",
        "--coordinator",
        coordinator,
        "--listen",
        listen,
        "--id",
        &id,
        "--job",
        job,
        "--lease-ms",
        &lease,
    ]
    .iter()
    .map(|w| w.to_string())
    .collect()
}

/// The address of a relay's `relay N relaying on ADDR:PORT ...` line.
pub(crate) fn relaying_on(line: &str) -> Option<String> {
    let addr = line.split("relaying on ").nth(1)?.split_whitespace().next()?;
    addr.parse::<std::net::SocketAddr>().ok().map(|a| a.to_string())
}

impl Drop for HostRelay {
    fn drop(&mut self) {
        if let Some(mut r) = self.running.take() {
            terminate_group(&mut r.child, Duration::from_secs(1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A relay started ahead (not yet waited for) whose connection the
    /// coordinator lost is its host's: it is let go (and stopped), and the
    /// host's next worker starts another.
    #[test]
    fn a_relay_lost_before_it_was_waited_for_is_let_go() {
        let dir = tempfile::tempdir().unwrap();
        let auth = JobAuth { job: "j".into(), secret: crate::worker::session::Secret::generate().unwrap() };
        let mut relay = HostRelay::new(dir.path(), Duration::from_secs(10));
        let mut next = 0;
        let sleeper = |_: u64, _: &[String]| {
            let mut c = Command::new("sh");
            c.args(["-c", "exec sleep 30"]);
            Ok(c)
        };
        relay.start_ahead(&mut next, "127.0.0.1:1", &auth, sleeper).unwrap();
        assert_eq!(next, 1);
        assert!(!relay.lost(2), "another relay's loss");
        assert!(relay.pending.is_some());
        assert!(relay.lost(1));
        assert!(relay.pending.is_none(), "let go");
        relay.start_ahead(&mut next, "127.0.0.1:1", &auth, sleeper).unwrap();
        assert_eq!(next, 2, "the next start is another relay");
    }

    #[test]
    fn the_relay_s_address_is_read_from_its_line() {
        assert_eq!(
            super::relaying_on("relay 2 relaying on 127.0.0.1:4100 for 127.0.0.1:7000").as_deref(),
            Some("127.0.0.1:4100")
        );
        assert_eq!(super::relaying_on("starting up"), None);
        assert_eq!(super::relaying_on("relay 2 relaying on nowhere"), None);
    }
}
