//! What a job reports: its scale events, committed steps and outcome, and
//! the resize under way that becomes a scale event.

use crate::coordinator::machine::ledger::EpochRecord;
use crate::coordinator::machine::membership::Worker;
use crate::leader::record::{Recovery, ScaleEvent};
use edl_plugin_sdk::Hyperparams;
use serde::{Deserialize, Serialize};
use std::{path::PathBuf, time::Instant};

/// One committed step, for the progress display and the plot.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StepRecord {
    pub step: u64,
    pub epoch: u64,
    pub world: u32,
    pub secs: f64,
    pub loss: f64,
    /// Committed samples per second over the last few steps.
    pub samples_per_sec: f64,
    /// Samples of the epoch consumed after this step.
    pub cursor: usize,
    /// The step's global batch and learning rate (0 in reports written
    /// before they were kept).
    #[serde(default)]
    pub batch: u32,
    #[serde(default)]
    pub lr: f32,
    /// The gradient noise scale so far (smoothed), once a step with two or
    /// more ranks measured it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub noise_scale: Option<f64>,
    /// Its smoothed parts once measured, whatever their signs (the noise
    /// scale is shown only while `grad_sqr` is above 0 and `grad_var` not
    /// below it): `grad_var`, the trace
    /// of the per-sample gradients' covariance `S`, and `grad_sqr`, the
    /// squared norm of the true gradient `|G|^2`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_var: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_sqr: Option<f64>,
    /// With the noise scale: the statistical efficiency of the step's
    /// batch against the job's base batch (`--batch`), and the goodput,
    /// `samples_per_sec * efficiency` (samples per second, each worth one
    /// in the base batch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub efficiency: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub goodput: Option<f64>,
    /// The program's own metrics (`step.commit(loss=..., accuracy=...)`),
    /// averaged over the step's samples.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub metrics: std::collections::BTreeMap<String, f64>,
    /// The parameter servers the step's generation had (jobs with servers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ps_servers: Option<u32>,
}

/// What the coordinator reports while it runs.
pub enum Progress<'a> {
    Step(&'a StepRecord),
    Scale(&'a ScaleEvent),
    Epoch(&'a EpochRecord),
    Checkpoint {
        step: u64,
        path: &'a std::path::Path,
        /// How long its writer took, and the state's bytes.
        secs: f64,
        bytes: u64,
    },
    Note(String),
    /// Steps are done again from `step` on, `redone` of them: a step not
    /// committed because a rank failed (`failed`), or a return to a
    /// checkpoint (a resume, or a job left without workers).
    Redone {
        step: u64,
        redone: u64,
        failed: bool,
    },
    /// The scaling policy decided (holds too); its call took `call_secs`.
    Decision {
        decision: &'a PolicyDecision,
        call_secs: f64,
    },
    /// The job's workers and where each stands, when that changed (looked
    /// at once a second).
    Workers(&'a [WorkerState]),
    /// A worker became ready: from being started to saying hello
    /// (`start_secs`), and from then to being ready (`load_secs`).
    WorkerReady {
        id: u64,
        start_secs: f64,
        load_secs: f64,
    },
    /// What the teacher pool's policy saw at its newest decision: the
    /// students' wait and each teacher's statistics.
    TeacherView(&'a edl_plugin_sdk::TeacherView),
    /// The teacher pool changed size.
    Teachers(&'a super::pool::TeacherEvent),
    /// The parameter servers' tables and memory (looked at once a second).
    ParameterServers(&'a [crate::ps::Stats]),
}

/// The end of a job.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct JobOutcome {
    pub final_checkpoint: PathBuf,
    pub steps: u64,
    pub epochs: Vec<EpochRecord>,
    pub scale_events: Vec<ScaleEvent>,
    pub timeline: Vec<StepRecord>,
    pub resumed_from_step: Option<u64>,
    /// Samples committed by this run, and the seconds it trained: from its
    /// first generation on, so the workers' start-up is not counted.
    pub samples: u64,
    pub train_secs: f64,
    pub generations: (u64, u64),
    pub checkpoints: Vec<PathBuf>,
    pub final_world: u32,
    pub hyper: Hyperparams,
    /// Ids of the workers this run started.
    pub workers_started: Vec<u64>,
    /// What happened to the store that the job went on through.
    pub store_events: Vec<StoreEvent>,
    /// How the teacher pool changed, and why.
    #[serde(default)]
    pub teacher_events: Vec<super::pool::TeacherEvent>,
    /// The teacher policy's decisions, what it saw and answered.
    #[serde(default)]
    pub teacher_decisions: Vec<super::pool::TeacherDecision>,
    /// The scaling policy's decisions, holds too: what it saw and answered.
    #[serde(default)]
    pub policy_decisions: Vec<PolicyDecision>,
    /// What the batch adapter was told of the training, and answered.
    #[serde(default)]
    pub adapter_decisions: Vec<AdapterDecision>,
    /// What the scaling policy was asked about the parameter servers, and answered.
    #[serde(default)]
    pub server_decisions: Vec<ServerDecision>,
    /// The scaling policy's answers about the warm spares.
    #[serde(default)]
    pub spare_decisions: Vec<SpareDecision>,
    /// The warm spares at the job's end: what they cost and what they were
    /// used for (in a job that kept or was asked for any).
    #[serde(default)]
    pub spares: Option<edl_plugin_sdk::SpareView>,
    /// Workers asked for that the job ended before they joined, each with
    /// where it stood (`still starting`, `still loading the job`, ...).
    #[serde(default)]
    pub workers_unused: Vec<UnusedWorker>,
    /// Steps computed again: after each failure, the step and those sent
    /// ahead of it; after a resume, the steps committed after the checkpoint.
    #[serde(default)]
    pub redone_steps: u64,
    /// How the scheduler knows each worker it started (`slurm:123`).
    pub worker_handles: std::collections::BTreeMap<u64, String>,
    /// The parameter servers at the end: each one's tables, rows and memory.
    #[serde(default)]
    pub parameter_servers: Vec<crate::ps::Stats>,
}

/// One decision of the scaling policy, as the report keeps it: when, the
/// view it was given, and its actions (or why it failed: the job held).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PolicyDecision {
    /// Seconds since the coordinator started.
    pub secs: f64,
    pub view: edl_plugin_sdk::ClusterView,
    pub actions: Vec<edl_plugin_sdk::Action>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One of the job's workers and where it stands.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerState {
    pub id: u64,
    /// Its rank in the current generation, for a member.
    pub rank: Option<usize>,
    /// `training` (a member), `starting`, `loading` (the job) or `ready`
    /// (waiting for the next step boundary).
    pub stage: String,
    /// How the scheduler knows it (`slurm:123`, `pid 4242`), where it says.
    pub handle: Option<String>,
}

/// What a batch adapter was told of the training, the hyperparameters in
/// force then, and what it answered at the next step (None: the job ended
/// first): a trace `plugin replay --adapter` replays.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdapterDecision {
    /// Seconds since the coordinator started.
    pub secs: f64,
    pub stats: edl_plugin_sdk::TrainingStats,
    /// The step whose `on-step` answered (u64::MAX: none did before the
    /// job ended or the adapter was told again), and the hyperparameters
    /// it was given.
    pub step: u64,
    pub current: Hyperparams,
    pub answer: Option<Hyperparams>,
}

/// One time the scaling policy was asked about the parameter servers: the
/// view it was given, its answer (None: leave them be) or its error, and
/// the number the job took from it (within the bounds; None when it kept
/// them as they were): a trace `plugin replay --servers` replays.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServerDecision {
    /// Seconds since the coordinator started.
    pub secs: f64,
    pub view: edl_plugin_sdk::ServerView,
    pub answer: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub servers: Option<u32>,
}

/// Each time the scaling policy answered how many warm spares the job
/// should keep: the view it was given, its answer or its error, and the
/// number the job took from it when that changed the spares.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SpareDecision {
    /// Seconds since the coordinator started.
    pub secs: f64,
    pub view: edl_plugin_sdk::SpareView,
    pub answer: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub spares: Option<u32>,
}

/// A worker the job ended before it joined.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UnusedWorker {
    pub id: u64,
    pub stage: String,
}

/// The policy decisions a report keeps at most (the newest).
pub const POLICY_DECISIONS_KEPT: usize = 5_000;

/// Something that happened to the job's store (a replicated store's
/// leader changed), as the report shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StoreEvent {
    /// Seconds since the coordinator started.
    pub at_secs: f64,
    /// The job's committed step then.
    pub step: u64,
    pub what: String,
}

/// A resize waiting for the first committed step of its generation.
pub(super) struct Pending {
    pub(super) from: u32,
    pub(super) reason: String,
    pub(super) boundary: Instant,
    pub(super) join_ms: Option<f64>,
    /// The generation it made, once formed.
    pub(super) generation: Option<u64>,
    /// It follows a failure (workers lost), not a decision.
    pub(super) failure: bool,
    /// For a failure: when its first sign came and when it settled (every
    /// survivor out of its collective); the boundary is then when the last
    /// window was complete.
    pub(super) first_sign: Option<Instant>,
    pub(super) settled: Option<Instant>,
    /// When the new generation was formed (its members told).
    pub(super) formed: Option<Instant>,
}

impl Pending {
    /// A resize decided now, from a world of `from`.
    pub(super) fn new(from: u32, reason: String) -> Self {
        Pending {
            from,
            reason,
            boundary: Instant::now(),
            join_ms: None,
            generation: None,
            failure: false,
            first_sign: None,
            settled: None,
            formed: None,
        }
    }

    /// A failure's pause in its phases, its first step committed `now`.
    pub(super) fn recovery(&self, now: Instant) -> Option<Recovery> {
        let (sign, settled, formed) = (self.first_sign?, self.settled?, self.formed?);
        let between = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64() * 1e3;
        Some(Recovery {
            detect_ms: between(self.boundary, sign),
            abort_ms: between(sign, settled),
            form_ms: between(settled, formed),
            first_step_ms: between(formed, now),
        })
    }
}

/// The members' lease records in the store (key and value), made once a
/// generation: a member's pid and generation hold for it, and a job of
/// thousands of workers refreshes hundreds a second.
pub struct LeaseRecords {
    generation: u64,
    /// Each member's, in rank order.
    pub(super) each: Vec<LeaseRecord>,
}

/// A member's lease record, and who it is for.
pub(super) struct LeaseRecord {
    pub id: u64,
    pid: u32,
    pub key: String,
    pub value: Vec<u8>,
}

impl LeaseRecords {
    /// The records of `members` in `generation`, made again unless `kept`
    /// holds them (the same generation, members and pids).
    pub(super) fn of<'a>(
        kept: &'a mut Option<LeaseRecords>,
        prefix: &str,
        generation: u64,
        members: &[Worker],
    ) -> &'a Self {
        let fresh = kept.as_ref().is_some_and(|r| {
            r.generation == generation
                && r.each.iter().map(|r| (r.id, r.pid)).eq(members.iter().map(|m| (m.id, m.pid)))
        });
        if !fresh {
            let record = |m: &Worker| LeaseRecord {
                id: m.id,
                pid: m.pid,
                key: format!("{prefix}{}", m.id),
                value: serde_json::json!({"pid": m.pid, "generation": generation}).to_string().into_bytes(),
            };
            *kept = Some(LeaseRecords { generation, each: members.iter().map(record).collect() });
        }
        kept.as_ref().expect("made above")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_s_lease_record_is_made_once_a_generation_and_again_when_members_change() {
        let records = |r: &LeaseRecords| -> Vec<(u64, String, String)> {
            r.each
                .iter()
                .map(|r| (r.id, r.key.clone(), String::from_utf8(r.value.clone()).unwrap()))
                .collect()
        };
        let mut kept = None;
        let members: Vec<Worker> = [3, 5].map(Worker::numbered).to_vec();
        let first = records(LeaseRecords::of(&mut kept, "edl/jobs/j/workers/", 2, &members));
        assert_eq!(
            first,
            vec![
                (3, "edl/jobs/j/workers/3".into(), r#"{"generation":2,"pid":103}"#.into()),
                (5, "edl/jobs/j/workers/5".into(), r#"{"generation":2,"pid":105}"#.into()),
            ]
        );
        // Kept while nothing changes: the same allocation, not made again.
        let at = kept.as_ref().unwrap().each.as_ptr();
        LeaseRecords::of(&mut kept, "edl/jobs/j/workers/", 2, &members);
        assert_eq!(kept.as_ref().unwrap().each.as_ptr(), at);
        // A new generation, a member whose pid changed, a member gone: made again.
        let next = records(LeaseRecords::of(&mut kept, "edl/jobs/j/workers/", 3, &members));
        assert_eq!(next[1].2, r#"{"generation":3,"pid":105}"#);
        let mut restarted = members.clone();
        restarted[1].pid = 999;
        let again = records(LeaseRecords::of(&mut kept, "edl/jobs/j/workers/", 3, &restarted));
        assert_eq!(again[1].2, r#"{"generation":3,"pid":999}"#);
        let fewer = records(LeaseRecords::of(&mut kept, "edl/jobs/j/workers/", 3, &restarted[..1]));
        assert_eq!(fewer, vec![(3, "edl/jobs/j/workers/3".into(), r#"{"generation":3,"pid":103}"#.into())]);
    }
}
