//! The job's record in the store, as every party reads it: the
//! coordinator that writes it at each commit, a standby or a rerun that
//! carries the job on from it, a torchrun launcher that takes a group over.
//! Plain data, so that whoever reads it needs nothing of whoever wrote it.

use crate::coordinator::machine::ledger::Ledger;
use crate::job::spec::{JobSpec, Leader};
use serde::{Deserialize, Serialize};

/// What the store keeps about a job (survives a coordinator restart).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct JobState {
    pub generation: u64,
    pub committed_steps: u64,
    pub epoch: u64,
    pub cursor: usize,
    pub next_worker_id: u64,
    pub members: Vec<u64>,
    /// Every epoch is accounted for (a coordinator), or every rank
    /// succeeded (a torchrun launcher): a standby or a rerun trains it
    /// again only with `--restart`.
    pub finished: bool,
    /// A torchrun group that failed with no restart left, and why: a
    /// standby launcher does not start it again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<String>,
    /// The fencing token of the coordinator or launcher that wrote it: a
    /// record below the token a reader knows the job by is an earlier
    /// leader's (left over, or replayed by a store writer), and what it
    /// says (`finished` included) is not believed.
    #[serde(default)]
    pub fence: u64,
    /// What a coordinator taking the job over needs besides the above to
    /// carry it on where this one is (absent in states of older versions).
    #[serde(default)]
    pub handover: Option<Handover>,
    /// A `launch --torchrun` job across hosts: its running group and who
    /// leads it, for a launcher that takes the job over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub torchrun: Option<GroupHandover>,
    /// The teacher pool's teachers that outlive their coordinator: the
    /// coordinator that takes the job over takes them over (and stops them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub teachers: Vec<TeacherHandle>,
}

impl JobState {
    /// The state stored under `key`, if it verifies under `seal` and
    /// parses; what is wrong with it otherwise.
    pub fn open(key: &str, stored: &[u8], seal: &crate::leader::seal::RecordKey) -> Result<JobState, String> {
        let bytes = seal.open(key, stored).map_err(|e| e.to_string())?;
        serde_json::from_slice(bytes).map_err(|e| format!("{key} does not parse: {e}"))
    }
}

/// The rest of a running job's progress at its committed step: who leads
/// it, the hyperparameters of the next step, the epoch's ledger and the
/// scale events so far. Written at each commit, off the step's path.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Handover {
    pub leader: Leader,
    pub hyper: edl_plugin_sdk::Hyperparams,
    pub ledger: Ledger,
    pub events: Vec<ScaleEvent>,
    /// What the data order depends on: a coordinator started with other
    /// flags cannot take the job over.
    #[serde(default)]
    pub data: DataIdentity,
    /// The policy's and the adapter's memory at this step.
    #[serde(default)]
    pub plugins: PluginMemory,
    /// How the scheduler knows each member (`slurm:123`, `pod:...`,
    /// `slot:host/0`): the coordinator that takes over stops, reports and
    /// places around them as its own.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub handles: std::collections::BTreeMap<u64, String>,
}

/// A teacher started by `--teacher-command` on a slot of `--teacher-hosts`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TeacherHandle {
    /// Its endpoint, as the students reach it.
    pub addr: String,
    /// Its slot of `--teacher-hosts`, and the `{id}` its command was filled with.
    pub slot: usize,
    pub id: u32,
}

/// A change of world size, as the report shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScaleEvent {
    /// Committed steps when the new generation started.
    pub step: u64,
    pub from: u32,
    pub to: u32,
    /// From the resize at the step boundary to the first committed step of
    /// the new generation (ring, broadcast and one step included).
    pub pause_ms: f64,
    pub reason: String,
    pub generation: u64,
    /// The slowest rank's ring set-up and parameter broadcast, within the pause.
    pub setup_ms: f64,
    /// For scale-outs: from the policy's decision to the new worker being
    /// ready (process start and data load), while the others kept training.
    pub join_ms: Option<f64>,
    /// Seconds since the job (this run) started.
    pub at_secs: f64,
    /// For a resize that a failure forced: its pause in phases.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery: Option<Recovery>,
}

/// A failure's pause, phase by phase; together they are the whole time
/// without a commit, `pause_ms`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Recovery {
    /// From the last window every rank finished to the first sign of the
    /// failure (a connection closed, a process exited, a rank's error, a
    /// rank silent past the step timeout).
    pub detect_ms: f64,
    /// From then until every survivor answered: their collectives of the
    /// failed generation ended (the dead rank's sockets closed) or failed.
    pub abort_ms: f64,
    /// From then until the new generation was formed and its members told.
    pub form_ms: f64,
    /// From then until its first step was committed (ring set-up, state
    /// broadcast and the redone step).
    pub first_step_ms: f64,
}

/// What decides which samples a (step, cursor) names, and what the state is.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DataIdentity {
    samples: usize,
    seed: u64,
    program: String,
}

impl DataIdentity {
    /// The identity of job `spec` with `samples` training samples (known
    /// after the start when a program declares them).
    pub fn of(spec: &JobSpec, samples: usize) -> Self {
        DataIdentity { samples, seed: spec.seed, program: spec.program.identity() }
    }

    /// The same, but for the seed (a checkpoint of an older version
    /// records only that).
    pub fn with_seed(&self, seed: u64) -> Self {
        DataIdentity { seed, ..self.clone() }
    }

    /// The differences from `now`, as flags.
    pub fn differences(&self, now: &DataIdentity) -> Vec<String> {
        let mut d = Vec::new();
        let mut cmp = |flag: &str, was: String, is: String| {
            if was != is {
                d.push(format!("{flag} {was} (this run: {is})"));
            }
        };
        cmp("samples (--samples, --train-samples)", self.samples.to_string(), now.samples.to_string());
        cmp("--seed", self.seed.to_string(), now.seed.to_string());
        cmp("the program", self.program.clone(), now.program.clone());
        d
    }
}

/// What the policy and the adapter saved, as base64 (absent: the plugin
/// keeps no memory, or the state is of an older version).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginMemory {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapter: Option<String>,
}

/// What the store keeps of the running group for a launcher taking it over.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GroupHandover {
    pub group: u32,
    /// Its agents' ids in `GROUP_RANK` order, and their hosts' addresses.
    pub agents: Vec<u64>,
    pub hosts: Vec<String>,
    pub master_addr: String,
    pub master_port: u16,
    /// Ranks per host.
    pub nproc: u32,
    /// `TORCHELASTIC_RESTART_COUNT` its ranks saw.
    pub restart_count: u32,
    /// The launcher that formed it: its agent port and lease token.
    pub leader: Leader,
    /// How the scheduler knows each agent (`slot:host/0`, `slurm:123`):
    /// a launcher that takes over stops and places around them as its own.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub handles: std::collections::BTreeMap<u64, String>,
}
