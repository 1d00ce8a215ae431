//! Starting and stopping workers. The coordinator asks a [`Scaler`] for
//! workers and learns they exist when they connect; the default one runs
//! them as child processes of this machine (`edl-runtime worker ...`, or the
//! user's program under `edl-runtime launch`), each logging to its own file
//! and killed by the kernel if the coordinator dies.
//!
//! A worker finds its job through the environment: `EDL_COORDINATOR`
//! (`host:port`), `EDL_WORKER_ID`, `EDL_JOB` and `EDL_JOB_SECRET` (the
//! secret it proves on every connection; never on a command line).

use edl_host_gpu::comm::auth::JobAuth;
use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// Starts and stops workers.
pub trait Scaler: Send {
    /// Starts worker `id`, which will connect to `coordinator` and prove `auth`.
    fn spawn(&mut self, id: u64, coordinator: SocketAddr, auth: &JobAuth) -> anyhow::Result<()>;
    /// Asks worker `id` to stop and makes sure it is gone within `grace`.
    fn stop(&mut self, id: u64, grace: Duration);
    /// Workers that exited since the last call, with how.
    fn exited(&mut self) -> Vec<(u64, String)>;
    /// Process id of a running worker, when it has one.
    fn pid(&self, id: u64) -> Option<u32>;
    /// Where worker `id` logs.
    fn log_of(&self, id: u64) -> Option<PathBuf>;
}

/// Workers as local child processes.
pub struct LocalProcesses {
    exe: PathBuf,
    /// The arguments before the job's; None: the built-in worker's.
    args: Option<Vec<String>>,
    log_dir: PathBuf,
    children: BTreeMap<u64, Child>,
}

impl LocalProcesses {
    /// Workers run `exe worker --coordinator ADDR --id N`, logging to `log_dir/worker-N.log`.
    pub fn new(exe: impl Into<PathBuf>, log_dir: impl Into<PathBuf>) -> Self {
        LocalProcesses { exe: exe.into(), args: None, log_dir: log_dir.into(), children: BTreeMap::new() }
    }

    /// Workers run `command` (a program and its arguments) with the job in
    /// their environment, logging to `log_dir/worker-N.log`.
    pub fn program(command: &[String], log_dir: impl Into<PathBuf>) -> anyhow::Result<Self> {
        let (exe, args) = command.split_first().ok_or_else(|| anyhow::anyhow!("no program to launch"))?;
        Ok(LocalProcesses {
            exe: exe.into(),
            args: Some(args.to_vec()),
            log_dir: log_dir.into(),
            children: BTreeMap::new(),
        })
    }

    fn log_path(&self, id: u64) -> PathBuf {
        self.log_dir.join(format!("worker-{id}.log"))
    }
}

/// Makes a child die with its parent (Linux); elsewhere a child notices the
/// closed control connection and exits.
pub fn die_with_parent(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl is async-signal-safe and touches only this process.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

/// Sends SIGTERM, waits up to `grace`, then SIGKILL.
pub fn terminate(child: &mut Child, grace: Duration) {
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    // SAFETY: signalling our own child by pid.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    let until = Instant::now() + grace;
    while Instant::now() < until {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The last `lines` lines of a child's log, indented, for an error message
/// (empty when the log is empty or unreadable).
pub fn log_tail(path: &Path, lines: usize) -> String {
    let Ok(text) = std::fs::read(path) else { return String::new() };
    let text = String::from_utf8_lossy(&text);
    let all: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = &all[all.len().saturating_sub(lines)..];
    if tail.is_empty() {
        return String::new();
    }
    format!("; last lines of {}:\n    {}", path.display(), tail.join("\n    "))
}

fn ensure_dir(p: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(p)
        .map_err(|e| anyhow::anyhow!("{}: cannot create log directory: {e}", p.display()))
}

impl Scaler for LocalProcesses {
    fn spawn(&mut self, id: u64, coordinator: SocketAddr, auth: &JobAuth) -> anyhow::Result<()> {
        ensure_dir(&self.log_dir)?;
        let log = std::fs::File::create(self.log_path(id))
            .map_err(|e| anyhow::anyhow!("{}: {e}", self.log_path(id).display()))?;
        let mut cmd = Command::new(&self.exe);
        match &self.args {
            None => cmd.args(["worker", "--coordinator", &coordinator.to_string(), "--id", &id.to_string()]),
            Some(args) => cmd
                .args(args)
                .env("EDL_COORDINATOR", coordinator.to_string())
                .env("EDL_WORKER_ID", id.to_string())
                // The program's output reaches its log as it is written.
                .env("PYTHONUNBUFFERED", "1"),
        };
        cmd.env("EDL_JOB", &auth.job).env("EDL_JOB_SECRET", auth.secret.to_hex());
        cmd.stdin(Stdio::null()).stdout(log.try_clone()?).stderr(log);
        die_with_parent(&mut cmd);
        let child = cmd
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start worker {id} ({}): {e}", self.exe.display()))?;
        self.children.insert(id, child);
        Ok(())
    }

    fn stop(&mut self, id: u64, grace: Duration) {
        if let Some(mut c) = self.children.remove(&id) {
            // A worker told to stop gets the grace to exit by itself (a
            // program may have work after its last step), then a signal.
            let until = Instant::now() + grace;
            while Instant::now() < until && matches!(c.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(10));
            }
            terminate(&mut c, Duration::from_secs(1));
        }
    }

    fn exited(&mut self) -> Vec<(u64, String)> {
        let mut gone = Vec::new();
        for (id, c) in &mut self.children {
            if let Ok(Some(status)) = c.try_wait() {
                gone.push((*id, status.to_string()));
            }
        }
        for (id, _) in &gone {
            self.children.remove(id);
        }
        gone
    }

    fn pid(&self, id: u64) -> Option<u32> {
        self.children.get(&id).map(Child::id)
    }

    fn log_of(&self, id: u64) -> Option<PathBuf> {
        Some(self.log_path(id))
    }
}

impl Drop for LocalProcesses {
    fn drop(&mut self) {
        for c in self.children.values_mut() {
            terminate(c, Duration::from_secs(2));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::log_tail;

    #[test]
    fn a_log_tail_holds_the_last_lines_that_say_something() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("teacher-0.log");
        assert_eq!(log_tail(&log, 3), "", "no log, nothing to add");
        std::fs::write(&log, "one\ntwo\n\nthree\nError: cannot reach the store\n\n").unwrap();
        let tail = log_tail(&log, 3);
        assert!(tail.starts_with(&format!("; last lines of {}:", log.display())), "{tail}");
        assert!(tail.ends_with("two\n    three\n    Error: cannot reach the store"), "{tail}");
        assert!(!tail.contains("one"));
    }
}
