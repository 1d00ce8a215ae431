//! `--scaler slurm`: each worker is a Slurm batch job of its own.
//!
//! Why one batch job per worker rather than `srun` steps inside one
//! allocation: an allocation fixes the job's size when it is granted, while
//! an elastic job grows into capacity that frees up later and gives it back
//! one worker at a time. A batch job per worker is queued, started,
//! preempted and cancelled on its own, by Slurm's own rules (partitions,
//! accounts, QOS, preemption), and `scancel` of one worker touches no other.
//!
//! A worker's batch script is written to `sbatch`'s standard input, never to
//! a command line or a file: it exports the job's secret and `exec`s the
//! worker, so the batch step is the worker itself and Slurm's signals
//! (`scancel --signal`, preemption's SIGTERM, `--signal`) reach it. The
//! scaler polls `squeue` about once a second: a job that Slurm did not start
//! within the pending bound is cancelled and reported, one that ended is
//! reported with Slurm's state and reason (`NODE_FAIL` on a node set down),
//! and the partition's idle nodes are the capacity the policy is told of.
//!
//! With `--relay`, each node the workers run on gets a relay of its own,
//! another batch job (see [`crate::scalers::slurm_relays`]).

pub use crate::scalers::slurm_client::SlurmOptions;
use crate::scalers::slurm_client::{batch_script, quote, run, submit};
use crate::scalers::slurm_relays::SlurmRelays;
use crate::scalers::{Lingering, Scaler, join_stops, stop_fenced, stop_on_a_thread};
use crate::worker::session::JobAuth;
use anyhow::{Context, Result};
use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
    time::{Duration, Instant},
};

/// A worker's batch job.
struct Submitted {
    slurm: String,
    at: Instant,
    running: bool,
    node: String,
}

/// Workers as Slurm batch jobs.
pub struct SlurmScaler {
    opts: SlurmOptions,
    log_dir: PathBuf,
    /// The worker command's words; `{coordinator}`, `{id}` and `{job}` filled in per worker.
    program: Vec<String>,
    job: String,
    jobs: BTreeMap<u64, Submitted>,
    /// Every worker's Slurm job id, for the report.
    handles: BTreeMap<u64, String>,
    exited: Vec<(u64, String)>,
    polled: Option<Instant>,
    idle: Option<(Instant, Option<u32>)>,
    /// Slurm's controller did not answer: asked again after a pause.
    quiet: crate::process::Backoff,
    /// Stops under way: a worker told to stop gets its grace, then `scancel`.
    stopping: Vec<std::thread::JoinHandle<()>>,
    /// The nodes of workers told to stop, until their grace ends: a node's
    /// relay stays while its workers may still hand their state over.
    draining: Vec<(String, Instant)>,
    /// A relay per node (`--relay`).
    relays: Option<SlurmRelays>,
    /// The coordinator's lease, checked by a stop before its late cancel.
    fence: Option<crate::leader::keeper::LeaseFence>,
    /// Workers silent for their lease, and when their jobs' processes are
    /// killed if Slurm still runs them (see [`Scaler::kill_if_lingering`]).
    lingering: Lingering,
}

/// How often `squeue` and `sinfo` are asked.
const POLL_EVERY: Duration = Duration::from_secs(1);

impl SlurmScaler {
    /// Workers running `edl-runtime worker` (this executable).
    pub fn new(opts: SlurmOptions, exe: PathBuf, log_dir: PathBuf) -> Self {
        let exe = exe.display().to_string().replace('{', "{{").replace('}', "}}");
        let program =
            [exe.as_str(), "worker", "--coordinator", "{coordinator}", "--id", "{id}", "--job", "{job}"];
        Self::with_program(opts, log_dir, program.iter().map(|w| w.to_string()).collect())
    }

    /// Workers running the user's `command` (under `launch`).
    pub fn for_program(opts: SlurmOptions, log_dir: PathBuf, command: &[String]) -> Self {
        let env = [
            "env",
            "EDL_COORDINATOR={coordinator}",
            "EDL_WORKER_ID={id}",
            "EDL_JOB={job}",
            "PYTHONUNBUFFERED=1",
        ];
        let program = env
            .iter()
            .map(|w| w.to_string())
            .chain(command.iter().map(|w| w.replace('{', "{{").replace('}', "}}")))
            .collect();
        Self::with_program(opts, log_dir, program)
    }

    fn with_program(opts: SlurmOptions, log_dir: PathBuf, program: Vec<String>) -> Self {
        SlurmScaler {
            opts,
            log_dir,
            program,
            job: String::new(),
            jobs: BTreeMap::new(),
            handles: BTreeMap::new(),
            exited: Vec::new(),
            polled: None,
            idle: None,
            quiet: Default::default(),
            stopping: Vec::new(),
            draining: Vec::new(),
            relays: None,
            fence: None,
            lingering: Lingering::default(),
        }
    }

    /// Each node's workers reach the coordinator through a relay there
    /// (`exe relay ...`, a batch job of its own), keeping `lease`.
    pub fn with_relays(mut self, exe: PathBuf, lease: Duration) -> Self {
        self.relays = Some(SlurmRelays::new(exe, lease, &self.log_dir));
        self
    }

    /// The batch script of worker `id`: the secret in its environment, the
    /// worker exec'd (so that Slurm's signals reach it). With relays, the
    /// script first finds its node's relay (`$EDL_VIA`) and the worker
    /// connects there.
    fn script(&self, id: u64, coordinator: &str, auth: &JobAuth) -> String {
        // A mark no word holds, for the address the script chooses.
        const VIA: &str = "\u{1}via\u{1}";
        let (at, find) = match &self.relays {
            Some(r) => (VIA, r.script_lines(coordinator)),
            None => (coordinator, String::new()),
        };
        let words: Vec<String> = crate::scalers::command::fill_words(&self.program, at, id, &auth.job)
            .iter()
            .map(|w| quote(w).replace(VIA, "'\"$EDL_VIA\"'"))
            .collect();
        batch_script(auth, &find, &words.join(" "))
    }

    /// The `sbatch` options of worker `id`.
    fn sbatch_args(&self, id: u64, job: &str) -> Vec<String> {
        let log = self.log_dir.join(format!("worker-{id}.log"));
        let mut a = vec![
            "--parsable".to_string(),
            format!("--job-name=edl-{job}-{id}"),
            format!("--output={}", log.display()),
            "--ntasks=1".to_string(),
            "--export=ALL".to_string(),
            // A worker Slurm ended (a node failed) is the coordinator's to
            // replace: Slurm does not start it again on its own.
            "--no-requeue".to_string(),
        ];
        a.extend(self.opts.placement());
        a.extend(self.opts.extra.iter().cloned());
        a
    }

    /// Asks `squeue` where the workers' jobs stand (at most once a second):
    /// ended ones and ones pending past the bound become exits.
    fn poll(&mut self) {
        let nothing = self.jobs.is_empty() && self.relays.as_ref().is_none_or(SlurmRelays::idle);
        if nothing || self.polled.is_some_and(|t| t.elapsed() < POLL_EVERY) || !self.quiet.open() {
            return;
        }
        self.polled = Some(Instant::now());
        let out = match run("squeue", &["--me", "--noheader", "--format=%i|%T|%N|%r"]) {
            Ok(out) => {
                self.quiet.answered();
                out
            }
            Err(e) => {
                self.quiet.failed(&e.context("slurm"));
                return;
            }
        };
        let listed: BTreeMap<&str, (&str, &str, &str)> = out
            .lines()
            .filter_map(|l| {
                let mut f = l.trim().splitn(4, '|');
                Some((f.next()?, (f.next()?, f.next()?, f.next()?)))
            })
            .collect();
        let mut gone = Vec::new();
        for (&id, j) in &mut self.jobs {
            match listed.get(j.slurm.as_str()) {
                Some((state, node, reason)) => {
                    if *state == "RUNNING" && (!j.running || j.node.is_empty()) {
                        j.running = true;
                        j.node = node.to_string();
                        tracing::info!("worker {id}: Slurm job {} runs on {node}", j.slurm);
                    }
                    if *state == "PENDING" && j.at.elapsed() >= self.opts.pending_bound {
                        let _ = run("scancel", &[&j.slurm]);
                        gone.push((
                            id,
                            format!(
                                "Slurm did not start its job {} within {:?} (pending: {reason}); cancelled",
                                j.slurm, self.opts.pending_bound
                            ),
                        ));
                    }
                }
                None => gone.push((id, ended(&j.slurm, &j.node))),
            }
        }
        for (id, why) in gone {
            self.jobs.remove(&id);
            self.exited.push((id, why));
        }
        if let Some(relays) = &mut self.relays {
            let nodes = busy_nodes(&self.jobs, &mut self.draining, Instant::now());
            relays.tend(&listed, &nodes, &self.opts);
        }
    }
}

/// The nodes that run workers: those of running workers, and those of
/// workers told to stop whose grace has not ended (`draining`, pruned of
/// the ended).
fn busy_nodes(
    jobs: &BTreeMap<u64, Submitted>,
    draining: &mut Vec<(String, Instant)>,
    now: Instant,
) -> BTreeSet<String> {
    draining.retain(|(_, until)| *until > now);
    let running = jobs.values().filter(|j| j.running && !j.node.is_empty()).map(|j| j.node.clone());
    running.chain(draining.iter().map(|(node, _)| node.clone())).collect()
}

/// How Slurm says job `slurm` ended (`scontrol show job` keeps it for a
/// while after the end).
fn ended(slurm: &str, node: &str) -> String {
    let shown = run("scontrol", &["--oneliner", "show", "job", slurm]).unwrap_or_default();
    let field =
        |name: &str| shown.split_whitespace().find_map(|f| f.strip_prefix(name)).unwrap_or("").to_string();
    let (state, reason) = (field("JobState="), field("Reason="));
    let on = if node.is_empty() { String::new() } else { format!(" on {node}") };
    match (state.as_str(), reason.as_str()) {
        ("", _) => format!("its Slurm job {slurm}{on} is gone"),
        (s, "None" | "") => format!("its Slurm job {slurm}{on} ended: {s}"),
        (s, r) => format!("its Slurm job {slurm}{on} ended: {s} ({r})"),
    }
}

impl Scaler for SlurmScaler {
    fn spawn(&mut self, id: u64, coordinator: &str, auth: &JobAuth) -> Result<()> {
        self.job = auth.job.clone();
        std::fs::create_dir_all(&self.log_dir).with_context(|| format!("{}", self.log_dir.display()))?;
        if let Some(relays) = &mut self.relays {
            relays.connect_to(coordinator, auth)?;
        }
        let slurm = submit(&self.sbatch_args(id, &auth.job), &self.script(id, coordinator, auth))?;
        tracing::info!("worker {id}: Slurm job {slurm}");
        self.handles.insert(id, format!("slurm:{slurm}"));
        self.jobs.insert(id, Submitted { slurm, at: Instant::now(), running: false, node: String::new() });
        Ok(())
    }

    fn stop(&mut self, id: u64, grace: Duration) {
        let Some(j) = self.jobs.remove(&id) else { return };
        if !j.running {
            // Nothing runs to hear a stop: out of the queue at once.
            let _ = run("scancel", &[&j.slurm]);
            return;
        }
        // Told to stop over its connection: it ends its Slurm job by
        // exiting; one still there after its grace is cancelled.
        if self.relays.is_some() && !j.node.is_empty() {
            self.draining.push((j.node.clone(), Instant::now() + grace));
        }
        let fence = self.fence.clone();
        let stopping = stop_on_a_thread(id, move || {
            let until = Instant::now() + grace;
            while Instant::now() < until {
                // Gone from the queue; a queue that does not answer is asked again.
                let listed = run("squeue", &["--noheader", "--format=%i", "--jobs", &j.slurm]);
                if listed.is_ok_and(|l| !l.lines().any(|l| l.trim() == j.slurm)) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            match stop_fenced(&fence) {
                Some(why) => tracing::warn!("worker {id}: its Slurm job {} not cancelled: {why}", j.slurm),
                None => drop(run("scancel", &[&j.slurm])),
            }
        });
        self.stopping.extend(stopping);
    }

    fn exited(&mut self) -> Vec<(u64, String)> {
        self.poll();
        std::mem::take(&mut self.exited)
    }

    fn log_of(&self, id: u64) -> Option<PathBuf> {
        Some(self.log_dir.join(format!("worker-{id}.log")))
    }

    fn capacity(&mut self) -> Option<u32> {
        if !self.quiet.open() {
            // Slurm does not answer: what it said before may no longer hold.
            return None;
        }
        if let Some((t, n)) = self.idle
            && t.elapsed() < POLL_EVERY
        {
            return n;
        }
        let mut args = vec!["--noheader", "--states=idle", "--format=%D"];
        let partition = self.opts.partition.as_ref().map(|p| format!("--partition={p}"));
        if let Some(p) = &partition {
            args.push(p);
        }
        let n = match run("sinfo", &args) {
            Ok(out) => {
                self.quiet.answered();
                Some(out.lines().filter_map(|l| l.trim().parse::<u32>().ok()).sum())
            }
            Err(e) => {
                self.quiet.failed(&e.context("slurm"));
                None
            }
        };
        self.idle = Some((Instant::now(), n));
        n
    }

    fn handle(&self, id: u64) -> Option<String> {
        self.handles.get(&id).cloned()
    }

    fn release(&mut self) {
        // The workers follow the coordinator that leads now: their batch
        // jobs are its, and nothing here cancels them. Relays serve this
        // coordinator only: the one that leads now starts its own.
        self.jobs.clear();
        if let Some(relays) = &mut self.relays {
            relays.end();
        }
    }

    fn relay_lost(&mut self, id: u64) {
        if let Some(relays) = &mut self.relays {
            relays.lost(id);
        }
    }

    fn settle(&mut self) {
        join_stops(self.stopping.drain(..));
    }

    fn fence_stops(&mut self, fence: crate::leader::keeper::LeaseFence) {
        self.fence = Some(fence);
    }

    fn kill_if_lingering(&mut self, id: u64, after: Duration) {
        if self.jobs.get(&id).is_some_and(|j| j.running) {
            self.lingering.mark(id, after);
        }
    }

    /// SIGKILL to every process of the worker's batch job (`scancel
    /// --full`: the batch step, which is the worker, and what it started; a
    /// hung or frozen program hears nothing else, and a cancel would give
    /// it Slurm's KillWait first). The job stays listed until the queue
    /// says it ended, so its end is reported as any, with Slurm's state.
    fn kill_lingering(&mut self) -> Vec<(u64, String)> {
        // What ended meanwhile is seen first (and reported as it ended).
        self.poll();
        let jobs = &self.jobs;
        let due = self.lingering.due(|id| jobs.contains_key(&id));
        let mut killed = Vec::new();
        for id in due {
            let slurm = jobs[&id].slurm.clone();
            if !self.quiet.open() {
                self.lingering.again(id, POLL_EVERY);
                continue;
            }
            match run("scancel", &["--full", "--signal=KILL", &slurm]) {
                Ok(_) => {
                    killed.push((id, format!("its Slurm job {slurm} killed (scancel --full --signal=KILL)")))
                }
                Err(e) => {
                    tracing::warn!("worker {id}: cannot kill its Slurm job {slurm}: {e:#}");
                    self.lingering.again(id, POLL_EVERY);
                }
            }
        }
        killed
    }

    fn adopt(&mut self, id: u64, handle: &str, job_name: &str) -> bool {
        let Some(slurm) =
            handle.strip_prefix("slurm:").filter(|j| !j.is_empty() && j.bytes().all(|b| b.is_ascii_digit()))
        else {
            return false;
        };
        // Only the batch job this scaler would have submitted for the
        // worker (Slurm names it): a handle read from the store never names
        // another job to cancel.
        let named = run("squeue", &["--noheader", "--format=%j", "--jobs", slurm]).unwrap_or_default();
        if named.trim() != format!("edl-{job_name}-{id}") {
            return false;
        }
        // A member of the job: its batch job runs (the queue says where).
        let job =
            Submitted { slurm: slurm.to_string(), at: Instant::now(), running: true, node: String::new() };
        self.job = job_name.to_string();
        self.jobs.insert(id, job);
        self.handles.insert(id, handle.to_string());
        true
    }
}

impl Drop for SlurmScaler {
    fn drop(&mut self) {
        // Whatever the pause, the queue is asked once more before cancelling.
        self.quiet = Default::default();
        // Relays end as the workers do: none is started again meanwhile.
        if let Some(relays) = &mut self.relays {
            relays.hold_back();
        }
        self.settle();
        // Told to stop (the job ended): their jobs end as they exit; what
        // is left after a few seconds is cancelled, so nothing stays queued.
        let until = Instant::now() + Duration::from_secs(5);
        while !self.jobs.is_empty() && Instant::now() < until {
            self.polled = None;
            self.poll();
            if !self.jobs.is_empty() {
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        for j in self.jobs.values() {
            let _ = run("scancel", &[&j.slurm]);
        }
        if let Some(relays) = &mut self.relays {
            relays.end();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::session::Secret;

    #[test]
    fn a_node_stays_busy_while_a_worker_told_to_stop_there_has_its_grace() {
        let t = Instant::now();
        let job = |node: &str, running| Submitted { slurm: "1".into(), at: t, running, node: node.into() };
        let jobs = BTreeMap::from([(1, job("n1", true)), (2, job("n2", false)), (3, job("", true))]);
        let mut draining = vec![("n3".to_string(), t + Duration::from_secs(3))];
        let nodes = busy_nodes(&jobs, &mut draining, t);
        assert_eq!(nodes, BTreeSet::from(["n1".to_string(), "n3".to_string()]));
        // Its grace over, the node is idle (and forgotten).
        let nodes = busy_nodes(&jobs, &mut draining, t + Duration::from_secs(3));
        assert_eq!(nodes, BTreeSet::from(["n1".to_string()]));
        assert!(draining.is_empty());
    }

    #[test]
    fn a_worker_s_script_carries_the_secret_in_its_environment_and_execs_the_worker_quoted() {
        let opts = SlurmOptions {
            partition: Some("gpu".into()),
            account: Some("lab".into()),
            qos: Some("low".into()),
            extra: vec!["--time=10".into()],
            pending_bound: Duration::from_secs(60),
        };
        let s = SlurmScaler::for_program(
            opts,
            "/logs".into(),
            &["python".into(), "it's {x}.py".into(), "{id}".into()],
        );
        let auth = JobAuth { job: "mnist".into(), secret: Secret::generate().unwrap() };
        let script = s.script(7, "10.0.0.1:7070", &auth);
        let lines: Vec<&str> = script.lines().collect();
        assert_eq!(lines[0], "#!/bin/sh");
        assert_eq!(lines[1], format!("export EDL_JOB_SECRET={}", auth.secret.to_hex()));
        assert_eq!(lines[2], "export EDL_JOB='mnist'");
        assert_eq!(
            lines[3],
            "exec 'env' 'EDL_COORDINATOR=10.0.0.1:7070' 'EDL_WORKER_ID=7' 'EDL_JOB=mnist' \
             'PYTHONUNBUFFERED=1' 'python' 'it'\\''s {x}.py' '{id}'"
        );
        let args = s.sbatch_args(7, "mnist");
        for want in ["--parsable", "--job-name=edl-mnist-7", "--output=/logs/worker-7.log", "--partition=gpu"]
        {
            assert!(args.iter().any(|a| a == want), "{want} in {args:?}");
        }
        assert!(args.iter().any(|a| a == "--account=lab") && args.iter().any(|a| a == "--qos=low"));
        assert_eq!(args.last().unwrap(), "--time=10");
        // The secret is in the script, on no command line.
        assert!(!args.iter().any(|a| a.contains(&auth.secret.to_hex())));
    }

    /// Runs a worker's batch script with `sh`, on node `node`; what it
    /// printed.
    fn run_script(script: &str, node: Option<&str>) -> String {
        use std::io::Write;
        let mut sh = std::process::Command::new("sh");
        sh.arg("-s").env_remove("SLURMD_NODENAME");
        if let Some(n) = node {
            sh.env("SLURMD_NODENAME", n);
        }
        let mut child =
            sh.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).spawn().unwrap();
        child.stdin.take().unwrap().write_all(script.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{script}");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    #[test]
    fn with_relays_a_worker_connects_to_its_node_s_relay_and_else_to_the_coordinator() {
        let dir = tempfile::tempdir().unwrap();
        let opts = SlurmOptions { pending_bound: Duration::from_secs(60), ..Default::default() };
        // The worker prints where it would connect, and its words after.
        let program = ["sh".into(), "-c".into(), "echo \"$EDL_COORDINATOR $0\"".into(), "it's".into()];
        let s = SlurmScaler::for_program(opts, dir.path().to_path_buf(), &program)
            .with_relays("/opt/edl-runtime".into(), Duration::from_secs(10));
        let auth = JobAuth { job: "mnist".into(), secret: Secret::generate().unwrap() };
        let script = s.script(7, "10.0.0.1:7070", &auth);
        let relays = dir.path().join("relays");
        std::fs::create_dir_all(&relays).unwrap();
        std::fs::write(relays.join("n1"), "127.0.0.1:4100 10.0.0.1:7070\n").unwrap();
        std::fs::write(relays.join("n2"), "direct 10.0.0.1:7070\n").unwrap();
        // Written for another coordinator (a deposed one): not this worker's.
        std::fs::write(relays.join("n3"), "127.0.0.1:4300 10.0.0.2:7070\n").unwrap();
        assert_eq!(run_script(&script, Some("n1")), "127.0.0.1:4100 it's", "n1's relay");
        assert_eq!(run_script(&script, Some("n2")), "10.0.0.1:7070 it's", "n2's relay did not start");
        assert_eq!(run_script(&script, Some("n3")), "10.0.0.1:7070 it's", "another coordinator's relay");
        assert_eq!(run_script(&script, None), "10.0.0.1:7070 it's", "not in a Slurm job");
        // Without relays, the script is as before: the coordinator, no search.
        let plain = SlurmScaler::for_program(
            SlurmOptions { pending_bound: Duration::from_secs(60), ..Default::default() },
            dir.path().to_path_buf(),
            &program,
        );
        let script = plain.script(7, "10.0.0.1:7070", &auth);
        assert!(!script.contains("EDL_VIA"), "{script}");
        assert_eq!(run_script(&script, Some("n1")), "10.0.0.1:7070 it's");
    }

    #[test]
    fn a_deposed_coordinator_leaves_the_batch_jobs_to_the_one_that_leads_now() {
        let opts = || SlurmOptions {
            partition: None,
            account: None,
            qos: None,
            extra: Vec::new(),
            pending_bound: Duration::from_secs(60),
        };
        let mut s = SlurmScaler::for_program(opts(), "/logs".into(), &["python".into()]);
        let job = Submitted { slurm: "4242".into(), at: Instant::now(), running: true, node: "n1".into() };
        s.jobs.insert(3, job);
        s.handles.insert(3, "slurm:4242".into());
        s.release();
        // Dropping it cancels only what it still holds: nothing.
        assert!(s.jobs.is_empty());
        assert_eq!(s.handle(3).as_deref(), Some("slurm:4242"), "the report still names it");
        // The one that leads now takes only a Slurm job id, and only one
        // Slurm names as this job's worker (the Slurm test takes one over).
        let mut next = SlurmScaler::for_program(opts(), "/logs".into(), &["python".into()]);
        assert!(!next.adopt(4, "slurm:42;rm", "mnist") && !next.adopt(4, "pod:w-4", "mnist"));
        // A job id Slurm does not name `edl-<job>-<id>` (here: no Slurm at
        // all) is not taken either; the real takeover is in the Slurm test.
        assert!(!next.adopt(3, "slurm:4242", "mnist"));
        assert!(next.jobs.is_empty());
    }
}
