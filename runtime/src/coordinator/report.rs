//! The report of a training run (`--report run.json`).

use crate::coordinator::machine::ledger::EpochRecord;
use crate::coordinator::{JobOutcome, StepRecord, StoreEvent};
use crate::leader::record::ScaleEvent;
use serde::{Deserialize, Serialize};

/// What a run did, as written to `--report`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    pub job: String,
    /// The built-in student's test accuracy (None for a program of one's own).
    pub student_test_accuracy: Option<f64>,
    /// The click-through model's test AUC and mean logistic loss (`--dataset ctr`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub student_test_auc: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub student_test_log_loss: Option<f64>,
    /// None when the teachers were not trained by this job (or not used).
    pub teacher_test_accuracy: Option<f64>,
    /// Samples committed per second of training, this run.
    pub samples_per_sec: f64,
    pub scale_events: Vec<ScaleEvent>,
    /// Median pause of the resizes of a running job (not its start).
    pub rescale_pause_ms_median: Option<f64>,
    pub epochs: Vec<EpochRecord>,
    pub resumed_from_step: Option<u64>,
    pub distill: bool,
    pub steps: u64,
    pub train_secs: f64,
    pub final_world_size: u32,
    pub generations: (u64, u64),
    pub checkpoints: Vec<String>,
    pub final_checkpoint: String,
    pub policy: String,
    pub adapter: Option<String>,
    pub store: String,
    /// Where the workers computed: `cpu` or `cuda:N`.
    pub device: String,
    pub seed: u64,
    pub workers_started: Vec<u64>,
    /// What happened to the job's store that it went on through (a
    /// replicated store's leader changed).
    #[serde(default)]
    pub store_events: Vec<StoreEvent>,
    /// How the teacher pool changed, each with its reason and its size
    /// before and after (as `scale_events`).
    #[serde(default)]
    pub teacher_events: Vec<crate::coordinator::pool::TeacherEvent>,
    /// Each decision of the teacher policy: the view it was given, its
    /// answer (or error) and the size kept; a trace for `plugin replay
    /// --teacher-policy`.
    #[serde(default)]
    pub teacher_decisions: Vec<crate::coordinator::pool::TeacherDecision>,
    /// Each decision of the scaling policy, holds too: the view it was
    /// given and its actions (or its error); a trace for `plugin replay
    /// --policy`.
    #[serde(default)]
    pub policy_decisions: Vec<crate::coordinator::PolicyDecision>,
    /// What the batch adapter was told of the training (the noise scale,
    /// step times) and answered; a trace for `plugin replay --adapter`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub adapter_decisions: Vec<crate::coordinator::AdapterDecision>,
    /// Each time the scaling policy was asked about the parameter servers:
    /// the view, its answer (or error) and the number the job took; a
    /// trace for `plugin replay --policy ... --servers`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub server_decisions: Vec<crate::coordinator::ServerDecision>,
    /// Each answer (or error) of the scaling policy about the warm spares:
    /// the view (what they cost, what they were used for), the answer and
    /// the number the job took when it changed them (the newest 5,000).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub spare_decisions: Vec<crate::coordinator::SpareDecision>,
    /// The warm spares at the job's end, as a policy sizing them would see
    /// them: spare-hours held, their price, the growths and places they
    /// took and those started cold, members lost, the time to ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spares: Option<edl_plugin_sdk::SpareView>,
    /// Workers asked for that the job ended before they joined, each with
    /// where it stood then (stopped unused).
    #[serde(default)]
    pub workers_unused: Vec<crate::coordinator::UnusedWorker>,
    /// Steps computed again (after failures, or a resume past the checkpoint).
    #[serde(default)]
    pub redone_steps: u64,
    /// How the scheduler knows each worker (`slurm:123`), by worker id.
    #[serde(default)]
    pub worker_handles: std::collections::BTreeMap<u64, String>,
    /// The parameter servers at the job's end: each one's tables (rows,
    /// bytes, steps applied), its memory and bound.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parameter_servers: Vec<crate::ps::Stats>,
    pub timeline: Vec<StepRecord>,
}

/// The median of the pauses of resizes (events that changed a running job).
pub fn median_pause(events: &[ScaleEvent]) -> Option<f64> {
    let mut p: Vec<f64> = events.iter().filter(|e| e.from > 0).map(|e| e.pause_ms).collect();
    if p.is_empty() {
        return None;
    }
    p.sort_by(f64::total_cmp);
    let n = p.len();
    Some(if n % 2 == 1 { p[n / 2] } else { (p[n / 2 - 1] + p[n / 2]) / 2.0 })
}

impl Report {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        job: &str,
        outcome: JobOutcome,
        student: Option<f64>,
        teacher: Option<f64>,
        distill: bool,
        policy: String,
        adapter: Option<String>,
        store: &str,
        device: String,
        seed: u64,
    ) -> Self {
        Report {
            job: job.to_string(),
            student_test_accuracy: student,
            student_test_auc: None,
            student_test_log_loss: None,
            teacher_test_accuracy: teacher,
            samples_per_sec: outcome.samples as f64 / outcome.train_secs.max(1e-9),
            rescale_pause_ms_median: median_pause(&outcome.scale_events),
            scale_events: outcome.scale_events,
            epochs: outcome.epochs,
            resumed_from_step: outcome.resumed_from_step,
            distill,
            steps: outcome.steps,
            train_secs: outcome.train_secs,
            final_world_size: outcome.final_world,
            generations: outcome.generations,
            checkpoints: outcome.checkpoints.iter().map(|p| p.display().to_string()).collect(),
            final_checkpoint: outcome.final_checkpoint.display().to_string(),
            policy,
            adapter,
            store: store.to_string(),
            device,
            seed,
            workers_started: outcome.workers_started,
            store_events: outcome.store_events,
            teacher_events: outcome.teacher_events,
            teacher_decisions: outcome.teacher_decisions,
            policy_decisions: outcome.policy_decisions,
            adapter_decisions: outcome.adapter_decisions,
            server_decisions: outcome.server_decisions,
            spare_decisions: outcome.spare_decisions,
            spares: outcome.spares,
            workers_unused: outcome.workers_unused,
            redone_steps: outcome.redone_steps,
            worker_handles: outcome.worker_handles,
            parameter_servers: outcome.parameter_servers,
            timeline: outcome.timeline,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(from: u32, pause_ms: f64) -> ScaleEvent {
        ScaleEvent {
            step: 1,
            from,
            to: from + 1,
            pause_ms,
            reason: String::new(),
            generation: 1,
            setup_ms: 0.0,
            join_ms: None,
            at_secs: 0.0,
            recovery: None,
        }
    }

    #[test]
    fn the_median_leaves_out_the_start() {
        assert_eq!(median_pause(&[ev(0, 900.0)]), None);
        assert_eq!(median_pause(&[ev(0, 900.0), ev(1, 30.0), ev(2, 10.0), ev(3, 20.0)]), Some(20.0));
        assert_eq!(median_pause(&[ev(1, 30.0), ev(2, 10.0)]), Some(20.0));
    }
}
