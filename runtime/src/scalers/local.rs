//! [`LocalProcesses`]: workers as child processes of this machine, each
//! logging to its own file and killed by the kernel if the coordinator dies.

use super::{Lingering, Scaler, join_stops, kill_running_groups, stop_on_a_thread};
use crate::process::{die_with_parent, ensure_dir, reap_groups, terminate_group};
use edl_host_gpu::comm::auth::JobAuth;
use std::{
    collections::BTreeMap,
    io::Write,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// Workers as local child processes.
pub struct LocalProcesses {
    exe: PathBuf,
    /// The arguments before the job's; None: the built-in worker's.
    args: Option<Vec<String>>,
    log_dir: PathBuf,
    children: BTreeMap<u64, Child>,
    /// The threads copying programs' output to their logs.
    streams: BTreeMap<u64, std::thread::JoinHandle<()>>,
    /// Workers told to stop, each given its grace on a thread of its own:
    /// the job goes on meanwhile (a scale-in does not wait for a program's
    /// exit), and dropping the scaler waits for them.
    stopping: Vec<std::thread::JoinHandle<()>>,
    /// Members whose connection was lost, each with when its process tree
    /// is killed if it still runs (see [`Scaler::kill_if_lingering`]).
    lingering: Lingering,
    /// The relay the workers reach the coordinator through (`--relay`),
    /// the `edl-runtime` that runs it, and the relays started so far.
    relay: Option<(super::relay::HostRelay, PathBuf, u64)>,
}

impl LocalProcesses {
    /// Workers run `exe worker --coordinator ADDR --id N`, logging to `log_dir/worker-N.log`.
    pub fn new(exe: impl Into<PathBuf>, log_dir: impl Into<PathBuf>) -> Self {
        LocalProcesses {
            exe: exe.into(),
            args: None,
            log_dir: log_dir.into(),
            children: BTreeMap::new(),
            streams: BTreeMap::new(),
            stopping: Vec::new(),
            lingering: Lingering::default(),
            relay: None,
        }
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
            streams: BTreeMap::new(),
            stopping: Vec::new(),
            lingering: Lingering::default(),
            relay: None,
        })
    }

    /// The workers reach the coordinator through `relay` (run by `exe`,
    /// this `edl-runtime`), one connection for all of them.
    pub fn relayed(mut self, relay: super::relay::HostRelay, exe: impl Into<PathBuf>) -> Self {
        self.relay = Some((relay, exe.into(), 0));
        self
    }

    fn log_path(&self, id: u64) -> PathBuf {
        self.log_dir.join(format!("worker-{id}.log"))
    }

    /// Starts worker `id`'s process; `cmd` (and with it any pipe's write
    /// end it holds) is dropped, so a reader sees the output end with the
    /// process.
    fn start(&self, id: u64, mut cmd: Command) -> anyhow::Result<Child> {
        die_with_parent(&mut cmd);
        // A process group of its own: a terminal's Ctrl-C reaches the
        // coordinator alone, which checkpoints and then stops the workers.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        cmd.spawn().map_err(|e| anyhow::anyhow!("cannot start worker {id} ({}): {e}", self.exe.display()))
    }
}

/// Copies worker `id`'s output to its log and to standard output, each line
/// prefixed `[worker N]`, until the worker closes it. Bytes that are not
/// UTF-8 are shown replaced and kept as they are in the log; the pipe is
/// drained to its end whatever happens to standard output, so a worker
/// never blocks or dies on a write.
fn stream_lines(id: u64, from: std::io::PipeReader, mut log: std::fs::File) -> std::thread::JoinHandle<()> {
    use std::io::BufRead;
    std::thread::spawn(move || {
        let mut from = std::io::BufReader::new(from);
        let mut line = Vec::new();
        let mut tracebacks = Tracebacks::default();
        loop {
            line.clear();
            match from.read_until(b'\n', &mut line) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
            let _ = log.write_all(&line);
            let text = String::from_utf8_lossy(&line);
            for shown in tracebacks.take(text.trim_end_matches(['\n', '\r'])) {
                crate::process::say_line(&format!("[worker {id}] {shown}"));
            }
        }
        for shown in tracebacks.end() {
            crate::process::say_line(&format!("[worker {id}] {shown}"));
        }
    })
}

/// One worker's output, line by line, holding a traceback back until it
/// is whole.
#[derive(Default)]
struct Tracebacks {
    block: Vec<String>,
}

impl Tracebacks {
    /// The lines to show now, given the next one.
    fn take(&mut self, line: &str) -> Vec<String> {
        if line.trim_start() == "Traceback (most recent call last):" && self.block.is_empty() {
            self.block.push(line.to_string());
            return Vec::new();
        }
        if self.block.is_empty() {
            return vec![line.to_string()];
        }
        self.block.push(line.to_string());
        // The exception's line (not indented) ends it.
        if line.starts_with([' ', '\t']) || line.is_empty() { Vec::new() } else { self.end() }
    }

    /// The traceback held back, as it is to be shown (the output ended).
    fn end(&mut self) -> Vec<String> {
        let block = std::mem::take(&mut self.block);
        if block.is_empty() {
            return block;
        }
        // One another worker printed already (every worker failing the
        // same way) is shown as one line naming it; the log keeps it all.
        if !crate::process::traceback_shown(&block) {
            return block;
        }
        let last = block.last().cloned().unwrap_or_default();
        vec![format!("{last} (the same traceback as shown above; whole in this worker's log)")]
    }
}

impl Scaler for LocalProcesses {
    fn relay_lost(&mut self, id: u64) {
        if let Some((r, _, _)) = &mut self.relay {
            r.lost(id);
        }
    }

    fn workers_outlive(&self) -> bool {
        // Children that die with their parent.
        false
    }

    fn spawn(&mut self, id: u64, coordinator: &str, auth: &JobAuth) -> anyhow::Result<()> {
        ensure_dir(&self.log_dir)?;
        let log = std::fs::File::create(self.log_path(id))
            .map_err(|e| anyhow::anyhow!("{}: {e}", self.log_path(id).display()))?;
        let relayed;
        let coordinator = match &mut self.relay {
            Some((r, exe, started)) => {
                let command = |_, words: &[String]| {
                    let mut cmd = Command::new(&*exe);
                    cmd.args(words).env_remove("EDL_JOB_SECRET");
                    Ok(cmd)
                };
                relayed = r
                    .addr(started, coordinator, auth, command)
                    .map_err(|e| anyhow::anyhow!("worker {id}: {e:#}"))?;
                relayed.as_str()
            }
            None => coordinator,
        };
        let mut cmd = Command::new(&self.exe);
        match &self.args {
            None => cmd.args(["worker", "--coordinator", coordinator, "--id", &id.to_string()]),
            Some(args) => cmd
                .args(args)
                .env("EDL_COORDINATOR", coordinator)
                .env("EDL_WORKER_ID", id.to_string())
                // The program's output reaches its log as it is written.
                .env("PYTHONUNBUFFERED", "1"),
        };
        cmd.env("EDL_JOB", &auth.job).env("EDL_JOB_SECRET", auth.secret.to_hex());
        cmd.stdin(Stdio::null());
        if self.args.is_none() {
            // The built-in worker reports through the coordinator; its own
            // output is for the log.
            cmd.stdout(log.try_clone()?).stderr(log);
        } else {
            // A user's program: its output is shown as it comes, each line
            // prefixed `[worker N]`, and kept in its log.
            let (reader, writer) = std::io::pipe()?;
            cmd.stdout(writer.try_clone()?).stderr(writer);
            let child = self.start(id, cmd)?;
            self.streams.insert(id, stream_lines(id, reader, log));
            self.children.insert(id, child);
            return Ok(());
        }
        let child = self.start(id, cmd)?;
        self.children.insert(id, child);
        Ok(())
    }

    fn stop(&mut self, id: u64, grace: Duration) {
        self.stopping.retain(|t| !t.is_finished());
        if let Some(mut c) = self.children.remove(&id) {
            // A worker told to stop gets the grace to exit by itself (a
            // program may have work after its last step), then a signal;
            // off the coordinator's thread, which goes on with the job.
            let stopping = stop_on_a_thread(id, move || {
                let until = Instant::now() + grace;
                while Instant::now() < until && crate::process::runs(&c) {
                    std::thread::sleep(Duration::from_millis(10));
                }
                // Its own children (a data loader's processes) with it.
                terminate_group(&mut c, Duration::from_secs(1));
            });
            self.stopping.extend(stopping);
        }
    }

    fn exited(&mut self) -> Vec<(u64, String)> {
        let gone = reap_groups(&mut self.children, |c| c);
        for (id, _) in &gone {
            // The output's last lines (a traceback) reach the log before it is quoted.
            if let Some(copy) = self.streams.remove(id) {
                let until = Instant::now() + Duration::from_secs(2);
                while !copy.is_finished() && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
        gone
    }

    fn pid(&self, id: u64) -> Option<u32> {
        self.children.get(&id).map(Child::id)
    }

    fn kill_if_lingering(&mut self, id: u64, after: Duration) {
        if self.children.contains_key(&id) {
            self.lingering.mark(id, after);
        }
    }

    /// SIGKILL to the group (a hung or frozen program hears nothing else);
    /// the child stays to be reaped, so its pid cannot name another.
    fn kill_lingering(&mut self) -> Vec<(u64, String)> {
        let children = &self.children;
        let due = self.lingering.due(|id| children.contains_key(&id));
        kill_running_groups(due, |id| children.get(&id), "killed with its process group")
    }

    fn log_of(&self, id: u64) -> Option<PathBuf> {
        Some(self.log_path(id))
    }

    fn settle(&mut self) {
        join_stops(self.stopping.drain(..));
    }
}

impl Drop for LocalProcesses {
    fn drop(&mut self) {
        for c in self.children.values_mut() {
            terminate_group(c, Duration::from_secs(2));
        }
        // Each ends within its worker's grace and a second.
        self.settle();
    }
}

#[cfg(test)]
mod traceback_tests {
    use super::Tracebacks;

    fn show(t: &mut Tracebacks, lines: &[&str]) -> Vec<String> {
        let mut out: Vec<String> = lines.iter().flat_map(|l| t.take(l)).collect();
        out.extend(t.end());
        out
    }

    #[test]
    fn a_traceback_every_worker_prints_alike_is_shown_whole_once() {
        let tb = [
            "Traceback (most recent call last):",
            "  File \"/x/unique_to_this_test.py\", line 3, in <module>",
            "    raise ValueError(\"bad batch 7f3\")",
            "ValueError: bad batch 7f3",
        ];
        let first = show(&mut Tracebacks::default(), &[&["step 1"][..], &tb[..], &["after"][..]].concat());
        assert_eq!(first, [&["step 1"][..], &tb[..], &["after"][..]].concat(), "whole, in order");
        let second = show(&mut Tracebacks::default(), &tb);
        assert_eq!(second.len(), 1, "{second:?}");
        assert!(
            second[0].starts_with("ValueError: bad batch 7f3 (the same traceback as shown above"),
            "{second:?}"
        );
        // Another error is shown whole; one cut off by the worker's end too.
        let other = [tb[0], tb[1], "    raise KeyError(1)", "KeyError: 1"];
        assert_eq!(show(&mut Tracebacks::default(), &other), other);
        let cut = [tb[0], "  File \"/x/cut_7f3.py\", line 1"];
        assert_eq!(show(&mut Tracebacks::default(), &cut), cut);
    }
}

#[cfg(test)]
mod group_tests {
    use super::{LocalProcesses, Scaler};
    use edl_host_gpu::comm::auth::{JobAuth, Secret};
    use std::time::{Duration, Instant};

    /// Whether `pid` runs (a zombie does not).
    fn runs(pid: i32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|s| s.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')))
    }

    /// Polls `done` every 10 ms for up to 30 s; whether it came true.
    fn within_30s(mut done: impl FnMut() -> bool) -> bool {
        let until = Instant::now() + Duration::from_secs(30);
        while Instant::now() < until {
            if done() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        done()
    }

    /// A worker whose program started a child of its own (a data loader's
    /// process, here `sleep`) that would outlive it: the child's pid.
    fn worker_with_a_child(dir: &std::path::Path) -> (LocalProcesses, i32) {
        let pidfile = dir.join("loader.pid");
        let script = format!("sleep 600 & echo $! > {}.tmp && mv {0}.tmp {0}; wait", pidfile.display());
        let mut s = LocalProcesses::program(&["sh".into(), "-c".into(), script], dir.join("logs")).unwrap();
        let auth = JobAuth { job: "j".into(), secret: Secret::generate().unwrap() };
        s.spawn(1, "127.0.0.1:9", &auth).unwrap();
        assert!(within_30s(|| pidfile.exists()), "the program started its child");
        let loader: i32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
        assert!(runs(loader));
        (s, loader)
    }

    #[test]
    fn a_killed_worker_s_own_children_die_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let (mut s, loader) = worker_with_a_child(dir.path());
        let main = s.pid(1).unwrap() as i32;
        // SAFETY: kill(2) on the worker this test started.
        unsafe { libc::kill(main, libc::SIGKILL) };
        let mut gone = Vec::new();
        assert!(within_30s(|| {
            gone.extend(s.exited());
            !gone.is_empty()
        }));
        assert_eq!(gone[0].0, 1);
        assert!(gone[0].1.contains("signal: 9"), "{gone:?}");
        assert!(within_30s(|| !runs(loader)), "the worker's child {loader} outlived it");
    }

    #[test]
    fn a_worker_told_to_stop_takes_its_own_children_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let (mut s, loader) = worker_with_a_child(dir.path());
        s.stop(1, Duration::ZERO);
        // Dropping the scaler waits for the stops under way.
        drop(s);
        assert!(within_30s(|| !runs(loader)), "the worker's child {loader} outlived it");
    }
}
