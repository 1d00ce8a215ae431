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
//! A relay's job asks for one task with `--oversubscribe` (the partition
//! must let it share a node with the workers, or have a core to spare) and
//! none of the workers' extra options (no GPU of theirs).

use super::slurm::{SlurmOptions, quote, run, submit};
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

/// A node's relay.
enum NodeRelay {
    /// Submitted; not yet serving.
    Starting {
        id: u64,
        slurm: String,
        at: Instant,
        ran: Option<Instant>,
    },
    Serving {
        id: u64,
        slurm: String,
    },
    /// Slurm did not start it, or it ended before it served: this node's
    /// workers connect directly.
    Direct,
}

impl NodeRelay {
    fn job(&self) -> Option<(u64, &str)> {
        match self {
            NodeRelay::Starting { id, slurm, .. } | NodeRelay::Serving { id, slurm } => Some((*id, slurm)),
            NodeRelay::Direct => None,
        }
    }
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
    /// The coordinator's address and the job's secret, once a worker was
    /// started (a relay proves the same secret).
    to: Option<(String, JobAuth)>,
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
            to: None,
        }
    }

    /// The lines of a worker's batch script that set `$EDL_VIA` to where
    /// it connects: its node's relay, or `coordinator`.
    pub fn script_lines(&self, coordinator: &str) -> String {
        let polls = RELAY_WAIT.as_millis() / 200;
        format!(
            "EDL_VIA={coordinator}\n\
             f={dir}/\"$SLURMD_NODENAME\"\n\
             n=0\n\
             while [ -n \"$SLURMD_NODENAME\" ] && [ ! -s \"$f\" ] && [ $n -lt {polls} ]; do sleep 0.2; n=$((n+1)); done\n\
             if [ -n \"$SLURMD_NODENAME\" ] && [ -s \"$f\" ]; then a=$(cat \"$f\"); [ \"$a\" = {DIRECT} ] || EDL_VIA=$a; fi\n",
            coordinator = quote(coordinator),
            dir = quote(&self.dir.display().to_string()),
        )
    }

    /// The job's workers connect to `coordinator` and prove `auth`.
    pub fn connect_to(&mut self, coordinator: &str, auth: &JobAuth) -> Result<()> {
        std::fs::create_dir_all(&self.dir).with_context(|| format!("{}", self.dir.display()))?;
        self.to = Some((coordinator.to_string(), auth.clone()));
        Ok(())
    }

    /// Tends the relays, given the queue (`job id -> (state, node, reason)`) and
    /// the nodes running workers: a relay serving has its address written
    /// for the workers, one ended is forgotten (its node's next worker
    /// gets another), one Slurm did not start (or that did not serve) is
    /// cancelled and its node's workers connect directly; a node running
    /// workers without a relay gets one.
    pub fn tend(
        &mut self,
        listed: &BTreeMap<&str, (&str, &str, &str)>,
        nodes: &BTreeSet<String>,
        opts: &SlurmOptions,
    ) {
        let mut ended = Vec::new();
        for (node, relay) in &mut self.by_node {
            let step = match relay {
                NodeRelay::Starting { id, slurm, at, ran } => match listed.get(slurm.as_str()) {
                    Some(("RUNNING", _, _)) => {
                        let since = *ran.get_or_insert_with(Instant::now);
                        match serving_at(&self.log_dir.join(format!("relay-{id}.log"))) {
                            Some(addr) => Step::Serve(addr),
                            None if since.elapsed() > SERVE_BOUND => {
                                Step::Direct(format!("it printed no address within {SERVE_BOUND:?}"))
                            }
                            None => Step::Wait,
                        }
                    }
                    Some(("PENDING", _, reason)) if at.elapsed() >= opts.pending_bound => Step::Direct(
                        format!("Slurm did not start it within {:?} (pending: {reason})", opts.pending_bound),
                    ),
                    Some(_) => Step::Wait,
                    None => Step::Direct(format!("it ended before it served (see relay-{id}.log)")),
                },
                NodeRelay::Serving { id, slurm } => match listed.get(slurm.as_str()) {
                    Some(_) => Step::Wait,
                    None => Step::Ended(format!("relay {id}'s Slurm job {slurm} ended")),
                },
                NodeRelay::Direct => Step::Wait,
            };
            match step {
                Step::Wait => {}
                Step::Serve(addr) => {
                    let NodeRelay::Starting { id, slurm, .. } = relay else { continue };
                    match write_file(&self.dir, node, &addr) {
                        Ok(()) => {
                            tracing::info!(
                                "relay {id} carries {node}'s workers from {addr} (Slurm job {slurm})"
                            );
                            *relay = NodeRelay::Serving { id: *id, slurm: std::mem::take(slurm) };
                        }
                        Err(e) => {
                            tracing::warn!("relay {id} on {node}: {e:#}; its workers connect directly");
                            let _ = run("scancel", &[slurm]);
                            *relay = NodeRelay::Direct;
                        }
                    }
                }
                Step::Direct(why) => {
                    if let Some((id, slurm)) = relay.job() {
                        tracing::warn!("relay {id} on {node}: {why}; {node}'s workers connect directly");
                        let _ = run("scancel", &[slurm]);
                    }
                    if let Err(e) = write_file(&self.dir, node, DIRECT) {
                        tracing::warn!("{e:#}");
                    }
                    *relay = NodeRelay::Direct;
                }
                Step::Ended(why) => {
                    tracing::warn!("{why}: {node}'s next worker starts another");
                    ended.push(node.clone());
                }
            }
        }
        for node in ended {
            self.forget(&node);
        }
        for node in nodes {
            if !self.by_node.contains_key(node) {
                self.start(node, opts);
            }
        }
    }

    /// Submits `node`'s relay; one that cannot be submitted leaves the
    /// node's workers connecting directly.
    fn start(&mut self, node: &str, opts: &SlurmOptions) {
        let Some((coordinator, auth)) = &self.to else { return };
        self.started += 1;
        let id = self.started;
        let relay =
            match submit(&self.sbatch_args(id, node, &auth.job, opts), &self.script(id, coordinator, auth)) {
                Ok(slurm) => {
                    tracing::info!("relay {id}: Slurm job {slurm} on {node}");
                    NodeRelay::Starting { id, slurm, at: Instant::now(), ran: None }
                }
                Err(e) => {
                    tracing::warn!("relay {id} on {node}: {e:#}; {node}'s workers connect directly");
                    if let Err(e) = write_file(&self.dir, node, DIRECT) {
                        tracing::warn!("{e:#}");
                    }
                    NodeRelay::Direct
                }
            };
        self.by_node.insert(node.to_string(), relay);
    }

    /// The coordinator lost relay `id`'s connection: its job is cancelled
    /// and its node's next worker gets another.
    pub fn lost(&mut self, id: u64) {
        let node =
            self.by_node.iter().find(|(_, r)| r.job().is_some_and(|(i, _)| i == id)).map(|(n, _)| n.clone());
        if let Some(node) = node {
            self.forget(&node);
        }
    }

    /// Cancels `node`'s relay (if it has one) and removes its file.
    fn forget(&mut self, node: &str) {
        if let Some((_, slurm)) = self.by_node.remove(node).as_ref().and_then(NodeRelay::job) {
            let _ = run("scancel", &[slurm]);
        }
        let _ = std::fs::remove_file(self.dir.join(node));
    }

    /// Cancels every relay and removes the nodes' files.
    pub fn end(&mut self) {
        let nodes: Vec<String> = self.by_node.keys().cloned().collect();
        nodes.iter().for_each(|n| self.forget(n));
    }

    /// Relay `id`'s batch script: the secret in its environment, the relay
    /// exec'd, listening on the node's loopback.
    fn script(&self, id: u64, coordinator: &str, auth: &JobAuth) -> String {
        let lease = self.lease.as_millis().to_string();
        let id = id.to_string();
        let words = [
            &self.exe.display().to_string(),
            "relay",
            "--coordinator",
            coordinator,
            "--listen",
            "127.0.0.1:0",
            "--id",
            &id,
            "--job",
            &auth.job,
            "--lease-ms",
            &lease,
        ];
        let words: Vec<String> = words.iter().map(|w| quote(w)).collect();
        format!(
            "#!/bin/sh\nexport EDL_JOB_SECRET={}\nexport EDL_JOB={}\nexec {}\n",
            auth.secret.to_hex(),
            quote(&auth.job),
            words.join(" ")
        )
    }

    /// Relay `id`'s `sbatch` options: one task on `node`, sharing it.
    fn sbatch_args(&self, id: u64, node: &str, job: &str, opts: &SlurmOptions) -> Vec<String> {
        let log = self.log_dir.join(format!("relay-{id}.log"));
        let mut a = vec![
            "--parsable".to_string(),
            format!("--job-name=edl-{job}-relay-{id}"),
            format!("--output={}", log.display()),
            "--ntasks=1".to_string(),
            format!("--nodelist={node}"),
            "--oversubscribe".to_string(),
            "--export=ALL".to_string(),
            "--no-requeue".to_string(),
        ];
        a.extend(opts.placement());
        a
    }
}

/// What becomes of a node's relay at a poll.
enum Step {
    Wait,
    Serve(String),
    Direct(String),
    Ended(String),
}

/// The address a relay's log says it serves on, once it does.
fn serving_at(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines().find_map(super::relay::relaying_on)
}

/// Writes `node`'s file in `dir` (whole, or not at all: a script never
/// reads half an address).
fn write_file(dir: &Path, node: &str, text: &str) -> Result<()> {
    if node.is_empty() || node.contains('/') || node.starts_with('.') {
        anyhow::bail!("Slurm named a node {node:?}, which is no file name");
    }
    let (part, path) = (dir.join(format!(".{node}.part")), dir.join(node));
    std::fs::write(&part, format!("{text}\n"))
        .and_then(|()| std::fs::rename(&part, &path))
        .with_context(|| format!("{}", path.display()))
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
            extra: vec!["--gres=gpu:1".into()],
            pending_bound: Duration::from_secs(60),
        }
    }

    #[test]
    fn a_relay_s_job_runs_one_task_on_its_node_without_the_workers_extra_options() {
        let r =
            SlurmRelays::new("/opt/edl/edl-runtime".into(), Duration::from_millis(5000), Path::new("/logs"));
        let args = r.sbatch_args(3, "n7", "mnist", &opts());
        for want in [
            "--job-name=edl-mnist-relay-3",
            "--output=/logs/relay-3.log",
            "--nodelist=n7",
            "--ntasks=1",
            "--oversubscribe",
            "--partition=gpu",
            "--qos=low",
        ] {
            assert!(args.iter().any(|a| a == want), "{want} in {args:?}");
        }
        assert!(!args.iter().any(|a| a.contains("gres")), "{args:?}");
        let auth = JobAuth { job: "mnist".into(), secret: Secret::generate().unwrap() };
        let script = r.script(3, "10.0.0.1:7070", &auth);
        assert!(script.contains(&format!("export EDL_JOB_SECRET={}\n", auth.secret.to_hex())), "{script}");
        assert!(
            script.ends_with(
                "exec '/opt/edl/edl-runtime' 'relay' '--coordinator' '10.0.0.1:7070' '--listen' \
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
        for bad in ["", "../n1", "a/b", ".n1"] {
            let e = write_file(dir.path(), bad, DIRECT).unwrap_err();
            assert!(format!("{e:#}").contains("no file name"), "{bad}: {e:#}");
        }
    }

    #[test]
    fn a_relay_s_log_gives_its_address_once_it_serves() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("relay-1.log");
        assert_eq!(serving_at(&log), None, "no log yet");
        std::fs::write(&log, "starting\n").unwrap();
        assert_eq!(serving_at(&log), None);
        std::fs::write(&log, "starting\nrelay 1 relaying on 127.0.0.1:4100 for 10.0.0.1:7070\n").unwrap();
        assert_eq!(serving_at(&log).as_deref(), Some("127.0.0.1:4100"));
    }
}
