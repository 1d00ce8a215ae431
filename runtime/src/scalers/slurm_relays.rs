//! `--relay` under `--scaler slurm`: a relay on each node the workers run
//! on, itself a Slurm batch job pinned there (`--nodelist`), through which
//! that node's workers reach the coordinator over one connection.
//!
//! Slurm places each worker's batch job, so a worker's node is known only
//! once it runs. The scaler sees it in the queue, submits that node's relay
//! then (one relay a node, started again after its loss), reads the
//! address the relay prints into its log and writes it to
//! `<log dir>/relays/<node>`. A worker's batch script reads the file of the
//! node it runs on (`$SLURMD_NODENAME`): it waits up to [`RELAY_WAIT`] for
//! it, so that a node's first workers go through the relay they cause to be
//! started, and connects to the coordinator itself when there is none (the
//! file says `direct` where Slurm did not start the node's relay, which is
//! not tried there again). The log directory is shared with the nodes, as
//! the workers' logs already are.
//!
//! A relay's job asks for one task of one CPU and 256 MiB with
//! `--oversubscribe` (the partition must let it share a node with the
//! workers, or have a core to spare), and of the workers' extra options
//! only their time limit (no GPU of theirs). It ignores SIGTERM, so that a
//! node's workers told to go (preemption, a node set down) hand their
//! state over through it within Slurm's `KillWait`; the job cancels it with
//! SIGKILL. A relay whose node runs none of the job's workers any more is
//! cancelled; a node whose relays were lost [`RELAY_TRIES`] times goes
//! without one.

use super::slurm_client::{SlurmOptions, batch_script, quote, run, submit};
use crate::worker::session::JobAuth;
use anyhow::{Context, Result};
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

/// How long a worker's batch script waits for its node's relay before it
/// connects to the coordinator itself.
pub const RELAY_WAIT: Duration = Duration::from_secs(10);
/// How long a relay Slurm runs may take to print its address.
const SERVE_BOUND: Duration = Duration::from_secs(30);
/// What a node's file says when its workers connect directly.
const DIRECT: &str = "direct";
/// Relays lost on one node before its workers connect directly.
pub const RELAY_TRIES: u32 = 3;

/// A node's relay.
enum NodeRelay {
    /// Submitted; not yet serving.
    Starting { id: u64, slurm: String, at: Instant, ran: Option<Instant> },
    /// Serving at `addr`, written in the node's file.
    Serving { id: u64, slurm: String, addr: String },
    /// Slurm did not start it, it ended before it served, or the node's
    /// relays were lost too often: this node's workers connect directly.
    Direct,
}

impl NodeRelay {
    fn job(&self) -> Option<(u64, &str)> {
        match self {
            NodeRelay::Starting { id, slurm, .. } | NodeRelay::Serving { id, slurm, .. } => {
                Some((*id, slurm))
            }
            NodeRelay::Direct => None,
        }
    }

    /// What becomes of it at a poll, given the queue (`job id -> (state,
    /// node, reason)`) and whether its node runs workers (`busy`).
    fn step(
        &mut self,
        log_dir: &Path,
        listed: &BTreeMap<&str, (&str, &str, &str)>,
        busy: bool,
        opts: &SlurmOptions,
    ) -> Step {
        match self {
            NodeRelay::Starting { .. } if !busy => Step::Idle,
            NodeRelay::Starting { id, at, .. } if at.elapsed() > opts.pending_bound + SERVE_BOUND => {
                Step::Direct(format!(
                    "it was not serving {:?} after it was submitted (see relay-{id}.log)",
                    opts.pending_bound + SERVE_BOUND
                ))
            }
            NodeRelay::Starting { id, slurm, at, ran } => match listed.get(slurm.as_str()) {
                Some(("RUNNING", _, _)) => {
                    let since = *ran.get_or_insert_with(Instant::now);
                    match serving_at(&log_dir.join(format!("relay-{id}.log")), *id) {
                        Some(addr) => Step::Serve(addr),
                        None if since.elapsed() > SERVE_BOUND => Step::Direct(format!(
                            "it printed no address into relay-{id}.log within {SERVE_BOUND:?} (is the log \
                             directory shared with the nodes?)"
                        )),
                        None => Step::Wait,
                    }
                }
                Some(("PENDING", _, reason)) if at.elapsed() >= opts.pending_bound => Step::Direct(format!(
                    "Slurm did not start it within {:?} (pending: {reason})",
                    opts.pending_bound
                )),
                Some(_) => Step::Wait,
                None => Step::Direct(format!("it ended before it served (see relay-{id}.log)")),
            },
            NodeRelay::Serving { id, slurm, .. } => match listed.get(slurm.as_str()) {
                Some(_) if !busy => Step::Idle,
                Some(_) => Step::Wait,
                None => Step::Ended(format!("relay {id}'s Slurm job {slurm} ended")),
            },
            NodeRelay::Direct => Step::Wait,
        }
    }

    /// What this coordinator wrote in the node's file, if anything.
    fn written(&self) -> Option<&str> {
        match self {
            NodeRelay::Starting { .. } => None,
            NodeRelay::Serving { addr, .. } => Some(addr),
            NodeRelay::Direct => Some(DIRECT),
        }
    }
}

/// What becomes of a node's relay at a poll.
enum Step {
    Wait,
    Serve(String),
    Direct(String),
    Ended(String),
    /// The node runs none of the job's workers any more.
    Idle,
}

/// The relays of a Slurm job's nodes.
pub struct SlurmRelays {
    exe: PathBuf,
    lease: Duration,
    log_dir: PathBuf,
    /// `<log dir>/relays`: a file a node, read by the workers' scripts.
    dir: PathBuf,
    by_node: BTreeMap<String, NodeRelay>,
    /// Relays submitted so far (each one's number is the next).
    started: u64,
    /// Relays lost on each node.
    losses: BTreeMap<String, u32>,
    /// Cancels under way, off the coordinator's thread.
    cancels: Vec<std::thread::JoinHandle<()>>,
    /// The coordinator's address (which the nodes' files name) and the
    /// job's secret (a relay proves it too), once a worker was started.
    to: Option<(String, JobAuth)>,
    /// The job is ending: no relay is started.
    held_back: bool,
}

impl SlurmRelays {
    /// Relays running `exe relay ...`, keeping the job's worker `lease`.
    pub fn new(exe: PathBuf, lease: Duration, log_dir: &Path) -> Self {
        SlurmRelays {
            exe,
            lease,
            log_dir: log_dir.to_path_buf(),
            dir: log_dir.join("relays"),
            by_node: BTreeMap::new(),
            started: 0,
            losses: BTreeMap::new(),
            cancels: Vec::new(),
            to: None,
            held_back: false,
        }
    }

    /// The lines of a worker's batch script that set `$EDL_VIA` to where
    /// it connects: its node's relay, or `coordinator`. A node's file says
    /// `<relay's address or direct> <coordinator>`: one written for another
    /// coordinator (one deposed, or an earlier run's) is not this worker's.
    pub fn script_lines(&self, coordinator: &str) -> String {
        let polls = RELAY_WAIT.as_millis() / 200;
        format!(
            "EDL_VIA={coordinator}\n\
             f={dir}/\"$SLURMD_NODENAME\"\n\
             n=0\n\
             while [ -n \"$SLURMD_NODENAME\" ] && [ ! -s \"$f\" ] && [ $n -lt {polls} ]; do sleep 0.2; n=$((n+1)); done\n\
             if [ -n \"$SLURMD_NODENAME\" ] && [ -s \"$f\" ] && read -r a c < \"$f\" && [ \"$c\" = \"$EDL_VIA\" ] \
             && [ \"$a\" != {DIRECT} ]; then EDL_VIA=$a; fi\n",
            coordinator = quote(coordinator),
            dir = quote(&self.dir.display().to_string()),
        )
    }

    /// The job's workers connect to `coordinator` and prove `auth`. The
    /// first time, what an earlier run left in the nodes' files (relays
    /// of another coordinator) is removed.
    pub fn connect_to(&mut self, coordinator: &str, auth: &JobAuth) -> Result<()> {
        if self.to.is_none() {
            use std::os::unix::fs::DirBuilderExt;
            let shown = || format!("{}", self.dir.display());
            std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&self.dir).with_context(shown)?;
            for e in std::fs::read_dir(&self.dir).with_context(shown)?.flatten() {
                let _ = std::fs::remove_file(e.path());
            }
        }
        self.to = Some((coordinator.to_string(), auth.clone()));
        Ok(())
    }

    /// No relay is started from now on (the job is ending).
    pub fn hold_back(&mut self) {
        self.held_back = true;
    }

    /// Whether no relay is started or running (nothing to tend).
    pub fn idle(&self) -> bool {
        self.by_node.values().all(|r| r.job().is_none())
    }

    /// What goes in a node's file: `text` (an address, or `direct`) for
    /// the coordinator its workers are started for.
    fn file_text(&self, text: &str) -> Option<String> {
        self.to.as_ref().map(|(coordinator, _)| format!("{text} {coordinator}"))
    }

    /// Writes `node`'s file (none before a worker was started).
    fn write(&self, node: &str, text: &str) -> Result<()> {
        match self.file_text(text) {
            Some(t) => write_file(&self.dir, node, &t),
            None => Ok(()),
        }
    }

    /// Cancels a relay's job off the coordinator's thread: SIGKILL (it
    /// ignores SIGTERM), then the job.
    fn cancel(&mut self, slurm: &str) {
        self.cancels.retain(|t| !t.is_finished());
        let slurm = slurm.to_string();
        self.cancels.push(std::thread::spawn(move || {
            let _ = run("scancel", &["--signal=KILL", "--full", &slurm]);
            let _ = run("scancel", &[&slurm]);
        }));
    }

    /// Tends the relays, given the queue (`job id -> (state, node,
    /// reason)`) and the nodes running workers: a relay serving has its
    /// address written for the workers, one ended is forgotten (another is
    /// started while workers run on its node), one Slurm did not start (or
    /// that did not serve) is cancelled and its node's workers connect
    /// directly, one whose node runs no worker any more is cancelled; a
    /// node running workers without a relay gets one.
    pub fn tend(
        &mut self,
        listed: &BTreeMap<&str, (&str, &str, &str)>,
        nodes: &BTreeSet<String>,
        opts: &SlurmOptions,
    ) {
        let log_dir = &self.log_dir;
        let steps: Vec<(String, Step)> = (self.by_node.iter_mut())
            .map(|(node, relay)| (node.clone(), relay.step(log_dir, listed, nodes.contains(node), opts)))
            .collect();
        for (node, step) in steps {
            match step {
                Step::Wait => {}
                Step::Serve(addr) => self.serve(&node, addr),
                Step::Direct(why) => {
                    if let Some((id, slurm)) = self.by_node.get(&node).and_then(NodeRelay::job) {
                        tracing::warn!("relay {id} on {node}: {why}; {node}'s workers connect directly");
                        let slurm = slurm.to_string();
                        self.cancel(&slurm);
                    }
                    self.direct(&node);
                }
                Step::Ended(why) => {
                    tracing::warn!("{why}: its workers on {node} are lost with it");
                    self.forget(&node);
                    self.lost_on(&node);
                }
                Step::Idle => self.forget(&node),
            }
        }
        for node in nodes {
            if !self.by_node.contains_key(node) {
                self.start(node, opts);
            }
        }
    }

    /// `node`'s relay serves at `addr`: its workers are told.
    fn serve(&mut self, node: &str, addr: String) {
        let Some(NodeRelay::Starting { id, slurm, .. }) = self.by_node.get(node) else { return };
        let (id, slurm) = (*id, slurm.clone());
        match self.write(node, &addr) {
            Ok(()) => {
                tracing::info!("relay {id} carries {node}'s workers from {addr} (Slurm job {slurm})");
                self.by_node.insert(node.to_string(), NodeRelay::Serving { id, slurm, addr });
            }
            Err(e) => {
                tracing::warn!("relay {id} on {node}: {e:#}; its workers connect directly");
                self.cancel(&slurm);
                self.by_node.insert(node.to_string(), NodeRelay::Direct);
            }
        }
    }

    /// Submits `node`'s relay; one that cannot be submitted counts as lost
    /// there.
    fn start(&mut self, node: &str, opts: &SlurmOptions) {
        let Some((coordinator, auth)) = self.to.as_ref().filter(|_| !self.held_back) else { return };
        if let Err(e) = file_name(node) {
            // Its workers find no file there, and connect directly after the wait.
            tracing::warn!("{e:#}; its workers connect directly");
            self.by_node.insert(node.to_string(), NodeRelay::Direct);
            return;
        }
        self.started += 1;
        let id = self.started;
        // What an earlier relay of this number wrote there is not this one's address.
        let _ = std::fs::remove_file(self.log_dir.join(format!("relay-{id}.log")));
        match submit(&self.sbatch_args(id, node, &auth.job, opts), &self.script(id, coordinator, auth)) {
            Ok(slurm) => {
                tracing::info!("relay {id}: Slurm job {slurm} on {node}");
                let relay = NodeRelay::Starting { id, slurm, at: Instant::now(), ran: None };
                self.by_node.insert(node.to_string(), relay);
            }
            Err(e) => {
                tracing::warn!("relay {id} on {node}: {e:#}");
                self.lost_on(node);
            }
        }
    }

    /// The coordinator lost relay `id`'s connection: its job is cancelled
    /// and another is started while workers run on its node.
    pub fn lost(&mut self, id: u64) {
        let node =
            self.by_node.iter().find(|(_, r)| r.job().is_some_and(|(i, _)| i == id)).map(|(n, _)| n.clone());
        if let Some(node) = node {
            self.forget(&node);
            self.lost_on(&node);
        }
    }

    /// A relay on `node` was lost: past [`RELAY_TRIES`], the node's
    /// workers connect directly.
    fn lost_on(&mut self, node: &str) {
        let n = self.losses.entry(node.to_string()).or_default();
        *n += 1;
        if *n >= RELAY_TRIES {
            tracing::warn!("{n} relays lost on {node}: its workers connect directly from now on");
            self.direct(node);
        }
    }

    /// `node`'s workers connect directly from now on.
    fn direct(&mut self, node: &str) {
        if let Err(e) = self.write(node, DIRECT) {
            tracing::warn!("{e:#}");
        }
        self.by_node.insert(node.to_string(), NodeRelay::Direct);
    }

    /// Cancels `node`'s relay (if it has one) and removes its file, if the
    /// file still says what this coordinator wrote (one that took the job
    /// over may have written its own since).
    fn forget(&mut self, node: &str) {
        let Some(relay) = self.by_node.remove(node) else { return };
        if let Some((_, slurm)) = relay.job() {
            self.cancel(slurm);
        }
        let path = self.dir.join(node);
        let ours = relay.written().and_then(|w| self.file_text(w));
        if ours.is_some_and(|w| std::fs::read_to_string(&path).is_ok_and(|t| t.trim() == w)) {
            let _ = std::fs::remove_file(path);
        }
    }

    /// Cancels every relay and removes the nodes' files (those still this
    /// coordinator's); none is started after.
    pub fn end(&mut self) {
        self.held_back = true;
        let nodes: Vec<String> = self.by_node.keys().cloned().collect();
        nodes.iter().for_each(|n| self.forget(n));
        for t in self.cancels.drain(..) {
            let _ = t.join();
        }
    }

    /// Relay `id`'s batch script: the secret in its environment, SIGTERM
    /// ignored (an ignored signal stays so across `exec`), the relay
    /// exec'd, listening on the node's loopback.
    fn script(&self, id: u64, coordinator: &str, auth: &JobAuth) -> String {
        let words: Vec<String> = std::iter::once(self.exe.display().to_string())
            .chain(super::relay::relay_words(coordinator, id, &auth.job, self.lease, "127.0.0.1:0"))
            .map(|w| quote(&w))
            .collect();
        batch_script(auth, "trap '' TERM\n", &words.join(" "))
    }

    /// Relay `id`'s `sbatch` options: one small task on `node`, sharing it.
    fn sbatch_args(&self, id: u64, node: &str, job: &str, opts: &SlurmOptions) -> Vec<String> {
        let log = self.log_dir.join(format!("relay-{id}.log"));
        let mut a = vec![
            "--parsable".to_string(),
            format!("--job-name=edl-{job}-relay-{id}"),
            format!("--output={}", log.display()),
            "--open-mode=truncate".to_string(),
            "--ntasks=1".to_string(),
            "--cpus-per-task=1".to_string(),
            "--mem=256M".to_string(),
            format!("--nodelist={node}"),
            "--oversubscribe".to_string(),
            "--export=ALL".to_string(),
            "--no-requeue".to_string(),
        ];
        a.extend(opts.placement());
        // The workers' time limit: a partition's default would end the
        // relay, and its node's workers with it, before them.
        let mut extra = opts.extra.iter();
        while let Some(o) = extra.next() {
            if ["--time", "--time-min", "-t"].contains(&o.as_str()) {
                a.extend([Some(o), extra.next()].into_iter().flatten().cloned());
            } else if o.starts_with("--time=") || o.starts_with("--time-min=") || o.starts_with("-t") {
                a.push(o.clone());
            }
        }
        a
    }
}

/// The address relay `id`'s log says it serves on, once it does.
fn serving_at(log: &Path, id: u64) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    let own = format!("relay {id} relaying on ");
    text.lines().filter(|l| l.starts_with(&own)).find_map(super::relay::relaying_on)
}

/// Checks that `node` can name a file of the relays' directory.
fn file_name(node: &str) -> Result<()> {
    let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if node.is_empty() || node.starts_with('.') || !node.chars().all(plain) {
        anyhow::bail!("Slurm named a node {node:?}, which is no file name");
    }
    Ok(())
}

/// Writes `node`'s file in `dir` (whole, or not at all: a script never
/// reads half an address; a part file left there is replaced, never
/// followed).
fn write_file(dir: &Path, node: &str, text: &str) -> Result<()> {
    file_name(node)?;
    let (part, path) = (dir.join(format!(".{node}.part")), dir.join(node));
    let write = || -> std::io::Result<()> {
        use std::io::Write;
        let _ = std::fs::remove_file(&part);
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).open(&part)?;
        f.write_all(format!("{text}\n").as_bytes())?;
        std::fs::rename(&part, &path)
    };
    write().with_context(|| format!("{}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::session::Secret;

    fn opts() -> SlurmOptions {
        SlurmOptions {
            partition: Some("gpu".into()),
            account: None,
            qos: Some("low".into()),
            extra: vec![
                "--gres=gpu:1".into(),
                "--time=2:00:00".into(),
                "--time-min".into(),
                "1:00:00".into(),
            ],
            pending_bound: Duration::from_secs(60),
        }
    }

    #[test]
    fn a_relay_s_job_runs_one_small_task_on_its_node_with_the_workers_time_and_no_gpu_of_theirs() {
        let r =
            SlurmRelays::new("/opt/edl/edl-runtime".into(), Duration::from_millis(5000), Path::new("/logs"));
        let args = r.sbatch_args(3, "n7", "mnist", &opts());
        for want in [
            "--job-name=edl-mnist-relay-3",
            "--output=/logs/relay-3.log",
            "--open-mode=truncate",
            "--nodelist=n7",
            "--ntasks=1",
            "--cpus-per-task=1",
            "--oversubscribe",
            "--partition=gpu",
            "--qos=low",
            "--time=2:00:00",
            "--time-min",
            "1:00:00",
        ] {
            assert!(args.iter().any(|a| a == want), "{want} in {args:?}");
        }
        assert!(!args.iter().any(|a| a.contains("gres")), "{args:?}");
        let auth = JobAuth { job: "mnist".into(), secret: Secret::generate().unwrap() };
        let script = r.script(3, "10.0.0.1:7070", &auth);
        assert!(script.contains(&format!("export EDL_JOB_SECRET={}\n", auth.secret.to_hex())), "{script}");
        assert!(
            script.ends_with(
                "trap '' TERM\nexec '/opt/edl/edl-runtime' 'relay' '--coordinator' '10.0.0.1:7070' '--listen' \
                 '127.0.0.1:0' '--id' '3' '--job' 'mnist' '--lease-ms' '5000'\n"
            ),
            "{script}"
        );
        assert!(!args.iter().any(|a| a.contains(&auth.secret.to_hex())));
    }

    #[test]
    fn a_node_s_file_is_written_whole_and_a_name_that_is_no_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        write_file(dir.path(), "n1", "127.0.0.1:4000").unwrap();
        write_file(dir.path(), "n1", "127.0.0.1:4001").unwrap();
        assert_eq!(std::fs::read_to_string(dir.path().join("n1")).unwrap(), "127.0.0.1:4001\n");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "no part left");
        // A part file someone linked elsewhere is replaced, not written through.
        let elsewhere = dir.path().join("elsewhere");
        std::os::unix::fs::symlink(&elsewhere, dir.path().join(".n2.part")).unwrap();
        write_file(dir.path(), "n2", DIRECT).unwrap();
        assert!(!elsewhere.exists());
        assert_eq!(std::fs::read_to_string(dir.path().join("n2")).unwrap(), "direct\n");
        for bad in ["", "../n1", "a/b", ".n1", "n[1-2]", "n 1"] {
            let e = write_file(dir.path(), bad, DIRECT).unwrap_err();
            assert!(format!("{e:#}").contains("no file name"), "{bad}: {e:#}");
        }
    }

    #[test]
    fn a_relay_s_log_gives_its_own_address_once_it_serves() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("relay-2.log");
        assert_eq!(serving_at(&log, 2), None, "no log yet");
        std::fs::write(&log, "starting\n").unwrap();
        assert_eq!(serving_at(&log, 2), None);
        // Another relay's line (an earlier run's of the same number is
        // removed before the submit) is not this one's.
        std::fs::write(&log, "relay 1 relaying on 127.0.0.1:4000 for 10.0.0.1:7070\n").unwrap();
        assert_eq!(serving_at(&log, 2), None);
        std::fs::write(&log, "starting\nrelay 2 relaying on 127.0.0.1:4100 for 10.0.0.1:7070\n").unwrap();
        assert_eq!(serving_at(&log, 2).as_deref(), Some("127.0.0.1:4100"));
    }

    #[test]
    fn a_new_coordinator_clears_what_an_earlier_run_left_and_removes_only_its_own_files() {
        let dir = tempfile::tempdir().unwrap();
        let relays = dir.path().join("relays");
        std::fs::create_dir_all(&relays).unwrap();
        std::fs::write(relays.join("n1"), "127.0.0.1:4000\n").unwrap();
        let mut r = SlurmRelays::new("edl-runtime".into(), Duration::from_secs(10), dir.path());
        let auth = JobAuth { job: "mnist".into(), secret: Secret::generate().unwrap() };
        r.connect_to("10.0.0.1:7070", &auth).unwrap();
        assert_eq!(std::fs::read_dir(&relays).unwrap().count(), 0, "an earlier run's address is gone");
        // Lost three times, a node's workers connect directly.
        for _ in 0..RELAY_TRIES {
            r.lost_on("n2");
        }
        assert_eq!(std::fs::read_to_string(relays.join("n2")).unwrap(), "direct 10.0.0.1:7070\n");
        // A file another coordinator wrote since is left to it.
        r.direct("n3");
        std::fs::write(relays.join("n3"), "127.0.0.1:4200 10.0.0.2:7070\n").unwrap();
        r.end();
        assert!(!relays.join("n2").exists(), "its own removed");
        assert_eq!(std::fs::read_to_string(relays.join("n3")).unwrap(), "127.0.0.1:4200 10.0.0.2:7070\n");
        // Nothing is started once the job ends.
        let listed = BTreeMap::new();
        r.tend(&listed, &BTreeSet::from(["n4".to_string()]), &opts());
        assert!(r.by_node.is_empty() && r.started == 0);
    }
}
