//! A job's metrics in the Prometheus and OpenMetrics text format
//! (`prometheus-client`), kept from the coordinator's progress events:
//! names carry the `edl_` prefix, seconds end in `_seconds` and counters in
//! `_total`, as Prometheus' conventions ask.

use crate::{
    coordinator::{StepRecord, machine::ledger::EpochRecord, pool::TeacherEvent},
    leader::record::ScaleEvent,
};
use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram, info::Info},
    registry::{Registry, Unit},
};
use std::sync::atomic::AtomicU64;

/// A gauge of a real number.
type Real = Gauge<f64, AtomicU64>;

/// A label's value from outside the runtime (a program's metric name, a
/// plugin's, the job's, a teacher's address), written as the text format
/// asks: a backslash, a double quote and a line feed escaped
/// (`prometheus-client` writes a value as it is given, and one quote in it
/// would make Prometheus refuse the whole scrape).
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct Text(String);

impl EncodeLabelValue for Text {
    fn encode(&self, out: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        use std::fmt::Write;
        for c in self.0.chars() {
            match c {
                '\\' => out.write_str("\\\\")?,
                '"' => out.write_str("\\\"")?,
                '\n' => out.write_str("\\n")?,
                c => out.write_char(c)?,
            }
        }
        Ok(())
    }
}

/// A program's own metric (`step.commit(accuracy=...)`), by its name.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NameLabel {
    name: Text,
}

/// What a scaling policy's decision was.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ActionLabel {
    action: &'static str,
}

/// Where a worker stands.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StageLabel {
    stage: String,
}

/// A parameter server, by its id.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServerLabel {
    server: String,
}

/// A teacher of the pool, and a quantile of its students' request times.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TeacherLabel {
    teacher: Text,
}

/// Which plugin a call went to.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PluginLabel {
    plugin: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    phase: &'static str,
}

/// Which way a resize went.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabel {
    direction: &'static str,
}

/// The job's metrics, registered once and moved by [`JobMetrics::step`]
/// and its siblings.
pub struct JobMetrics {
    registry: Registry,
    committed_step: Gauge,
    epoch: Gauge,
    steps: Counter,
    samples: Counter,
    samples_per_second: Real,
    loss: Real,
    batch: Gauge,
    lr: Real,
    noise_scale: Real,
    efficiency: Real,
    goodput: Real,
    program: Family<NameLabel, Real>,
    world: Gauge,
    generation: Gauge,
    resizes: Family<DirectionLabel, Counter>,
    pause: Histogram,
    recovery: Family<PhaseLabel, Histogram>,
    setup: Histogram,
    join: Histogram,
    start: Histogram,
    load: Histogram,
    checkpoints: Counter,
    checkpoint_step: Gauge,
    checkpoint_write: Histogram,
    checkpoint_bytes: Gauge,
    redone: Counter,
    failures: Counter,
    decisions: Family<ActionLabel, Counter>,
    plugin_calls: Family<PluginLabel, Histogram>,
    workers: Family<StageLabel, Gauge>,
    wait_share: Real,
    teacher_use: Family<TeacherLabel, Real>,
    teacher_rows: Family<TeacherLabel, Real>,
    teacher_p50: Family<TeacherLabel, Real>,
    teacher_p99: Family<TeacherLabel, Real>,
    teachers: Gauge,
    teacher_changes: Counter,
    ps_servers: Gauge,
    ps_rows: Family<ServerLabel, Gauge>,
    ps_bytes: Family<ServerLabel, Gauge>,
    epochs: Counter,
    duplicates: Counter,
    missing: Counter,
    notes: Counter,
    /// Samples in an epoch, and the furthest (epoch, cursor) a step reached:
    /// what the next step's samples are counted from.
    rows: u64,
    furthest: Option<(u64, usize)>,
}

/// Buckets from 10 ms to about 80 s: a resize's pause is tens of
/// milliseconds, a worker's start seconds.
fn seconds_buckets() -> Histogram {
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(0.01, 2.0, 14))
}

impl JobMetrics {
    /// The metrics of job `job` (scaling policy `policy`), whose epochs
    /// have `rows` samples.
    pub fn new(job: &str, policy: &str, rows: u64) -> JobMetrics {
        let mut registry = Registry::with_prefix("edl");
        // `name`, not `job`: Prometheus gives every scraped series a `job`
        // label of its own (the scrape job's).
        let info = Info::new(vec![("name", Text(job.into())), ("policy", Text(policy.into()))]);
        registry.register("job", "The job this process coordinates", info);
        let m = JobMetrics {
            committed_step: Gauge::default(),
            epoch: Gauge::default(),
            steps: Counter::default(),
            samples: Counter::default(),
            samples_per_second: Real::default(),
            loss: Real::default(),
            batch: Gauge::default(),
            lr: Real::default(),
            noise_scale: Real::default(),
            efficiency: Real::default(),
            goodput: Real::default(),
            program: Family::default(),
            world: Gauge::default(),
            generation: Gauge::default(),
            resizes: Family::default(),
            pause: seconds_buckets(),
            recovery: Family::new_with_constructor(seconds_buckets),
            setup: seconds_buckets(),
            join: seconds_buckets(),
            start: seconds_buckets(),
            load: seconds_buckets(),
            checkpoints: Counter::default(),
            checkpoint_step: Gauge::default(),
            checkpoint_write: seconds_buckets(),
            checkpoint_bytes: Gauge::default(),
            redone: Counter::default(),
            failures: Counter::default(),
            decisions: Family::default(),
            workers: Family::default(),
            wait_share: Real::default(),
            teacher_use: Family::default(),
            teacher_rows: Family::default(),
            teacher_p50: Family::default(),
            teacher_p99: Family::default(),
            plugin_calls: Family::new_with_constructor(|| {
                // From 10 us to about 2.6 s: a policy's call is well under a millisecond.
                Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(1e-5, 4.0, 10))
            }),
            teachers: Gauge::default(),
            teacher_changes: Counter::default(),
            epochs: Counter::default(),
            duplicates: Counter::default(),
            missing: Counter::default(),
            notes: Counter::default(),
            ps_servers: Gauge::default(),
            ps_rows: Family::default(),
            ps_bytes: Family::default(),
            rows,
            furthest: None,
            registry,
        };
        m.register()
    }

    fn register(mut self) -> JobMetrics {
        self.register_steps();
        self.register_cluster();
        self.register_teachers();
        let r = &mut self.registry;
        r.register("parameter_servers", "The job's parameter servers", self.ps_servers.clone());
        r.register(
            "parameter_server_rows",
            "Rows a parameter server holds, all tables",
            self.ps_rows.clone(),
        );
        r.register_with_unit(
            "parameter_server_memory",
            "Memory a parameter server's rows take",
            Unit::Bytes,
            self.ps_bytes.clone(),
        );
        self
    }

    /// The training's own series: steps, samples, loss, batch, epochs.
    fn register_steps(&mut self) {
        let r = &mut self.registry;
        r.register("committed_step", "The job's newest committed step", self.committed_step.clone());
        r.register("epoch", "The epoch the job trains (from 0)", self.epoch.clone());
        r.register("steps", "Steps committed by this run", self.steps.clone());
        r.register("samples", "Samples committed by this run", self.samples.clone());
        r.register(
            "samples_per_second",
            "Committed samples per second over the last few steps",
            self.samples_per_second.clone(),
        );
        r.register("loss", "The loss of the newest committed step", self.loss.clone());
        r.register("global_batch", "The newest committed step's global batch", self.batch.clone());
        r.register("learning_rate", "The newest committed step's learning rate", self.lr.clone());
        r.register(
            "gradient_noise_scale",
            "The gradient noise scale (McCandlish et al.), smoothed; NaN until two ranks measured a step",
            self.noise_scale.clone(),
        );
        r.register(
            "statistical_efficiency",
            "The step's batch's progress per sample against the base batch's, from the noise scale (Pollux); NaN until measured",
            self.efficiency.clone(),
        );
        r.register(
            "goodput",
            "Samples per second times statistical efficiency: samples/s each worth one of the base batch; NaN until measured",
            self.goodput.clone(),
        );
        r.register(
            "program_metric",
            "A metric the program committed with its step (its name in `name`)",
            self.program.clone(),
        );
        r.register("epochs", "Epochs finished", self.epochs.clone());
        r.register(
            "duplicate_samples",
            "Samples read by more than one committed step of a finished epoch",
            self.duplicates.clone(),
        );
        r.register(
            "missing_samples",
            "Samples no committed step of a finished epoch read",
            self.missing.clone(),
        );
        r.register("notes", "Notes the coordinator printed (failures, hand-overs)", self.notes.clone());
    }

    /// The job's workers, resizes, checkpoints, failures and policy.
    fn register_cluster(&mut self) {
        let r = &mut self.registry;
        r.register("world_size", "Workers in the current generation", self.world.clone());
        r.register(
            "workers",
            "The job's workers by stage: training, starting, loading (the job), ready (for the next boundary), spare, spare starting",
            self.workers.clone(),
        );
        r.register("generation", "The current generation of the job's ring", self.generation.clone());
        r.register("resizes", "Resizes of the job, by direction", self.resizes.clone());
        r.register_with_unit(
            "resize_pause",
            "From a resize at a step boundary to the new generation's first committed step",
            Unit::Seconds,
            self.pause.clone(),
        );
        r.register_with_unit(
            "failure_recovery",
            "A failure's pause by phase: detect (the last window every rank finished to the first sign), abort \
             (to every survivor out of its collective), form (to the new generation), first_step (to its first \
             commit)",
            Unit::Seconds,
            self.recovery.clone(),
        );
        r.register_with_unit(
            "resize_setup",
            "The slowest rank's ring set-up and state broadcast, within a resize's pause",
            Unit::Seconds,
            self.setup.clone(),
        );
        r.register_with_unit(
            "worker_join",
            "From the policy's decision to grow to the new worker being ready",
            Unit::Seconds,
            self.join.clone(),
        );
        r.register_with_unit(
            "worker_start",
            "From a worker being started to its hello (its process start and connection)",
            Unit::Seconds,
            self.start.clone(),
        );
        r.register_with_unit(
            "worker_load",
            "From a worker's hello to its being ready (loading the job: data, model, teachers)",
            Unit::Seconds,
            self.load.clone(),
        );
        r.register("checkpoints", "Checkpoints written", self.checkpoints.clone());
        r.register("checkpoint_step", "The step of the newest checkpoint", self.checkpoint_step.clone());
        r.register_with_unit(
            "checkpoint_write",
            "How long rank 0's writer took to write a checkpoint (in the background of the steps)",
            Unit::Seconds,
            self.checkpoint_write.clone(),
        );
        r.register_with_unit(
            "checkpoint_size",
            "The state's bytes in the newest checkpoint",
            Unit::Bytes,
            self.checkpoint_bytes.clone(),
        );
        r.register(
            "redone_steps",
            "Steps computed again after a failure or a return to a checkpoint",
            self.redone.clone(),
        );
        r.register("step_failures", "Steps not committed because a rank failed", self.failures.clone());
        r.register("policy_decisions", "The scaling policy's decisions, by action", self.decisions.clone());
        r.register_with_unit(
            "plugin_call",
            "How long a plugin's call took, by plugin",
            Unit::Seconds,
            self.plugin_calls.clone(),
        );
    }

    /// The teacher pool's series.
    fn register_teachers(&mut self) {
        let r = &mut self.registry;
        r.register("teachers", "Teachers in the job's pool", self.teachers.clone());
        r.register(
            "teacher_pool_changes",
            "Changes of the teacher pool's size",
            self.teacher_changes.clone(),
        );
        r.register(
            "teacher_wait_share",
            "Share of the students' compute spent waiting for soft labels (teacher pool)",
            self.wait_share.clone(),
        );
        r.register(
            "teacher_utilisation",
            "Share of the window a teacher's model computed",
            self.teacher_use.clone(),
        );
        r.register(
            "teacher_rows_per_second",
            "Rows of soft labels a teacher answered per second",
            self.teacher_rows.clone(),
        );
        r.register_with_unit(
            "teacher_request_p50",
            "The median of the students' request times to a teacher over the pool's window (network and queue included)",
            Unit::Seconds,
            self.teacher_p50.clone(),
        );
        r.register_with_unit(
            "teacher_request_p99",
            "The 99th percentile of the students' request times to a teacher over the pool's window",
            Unit::Seconds,
            self.teacher_p99.clone(),
        );
    }

    /// A committed step.
    pub fn step(&mut self, s: &StepRecord) {
        self.committed_step.set(s.step as i64);
        self.epoch.set(s.epoch as i64);
        self.steps.inc();
        // Counted past the furthest position reached only: a step redone
        // after a return to a checkpoint adds nothing until it gets there.
        let n = samples_between(self.furthest, (s.epoch, s.cursor), self.rows);
        if n > 0 || self.furthest.is_none() {
            self.furthest = Some((s.epoch, s.cursor));
        }
        self.samples.inc_by(n);
        self.samples_per_second.set(s.samples_per_sec);
        self.loss.set(s.loss);
        self.batch.set(s.batch as i64);
        self.lr.set(s.lr as f64);
        self.noise_scale.set(s.noise_scale.unwrap_or(f64::NAN));
        self.efficiency.set(s.efficiency.unwrap_or(f64::NAN));
        self.goodput.set(s.goodput.unwrap_or(f64::NAN));
        self.world.set(s.world as i64);
        for (name, v) in &s.metrics {
            self.program.get_or_create(&NameLabel { name: Text(name.clone()) }).set(*v);
        }
    }

    /// A resize, at its new generation's first committed step.
    pub fn scale(&mut self, e: &ScaleEvent) {
        let direction = match e.to.cmp(&e.from) {
            std::cmp::Ordering::Greater => "grow",
            std::cmp::Ordering::Less => "shrink",
            std::cmp::Ordering::Equal => "replace",
        };
        self.resizes.get_or_create(&DirectionLabel { direction }).inc();
        self.world.set(e.to as i64);
        self.generation.set(e.generation as i64);
        self.pause.observe(e.pause_ms / 1e3);
        if let Some(r) = e.recovery {
            let phases = [
                ("detect", r.detect_ms),
                ("abort", r.abort_ms),
                ("form", r.form_ms),
                ("first_step", r.first_step_ms),
            ];
            for (phase, ms) in phases {
                self.recovery.get_or_create(&PhaseLabel { phase }).observe(ms / 1e3);
            }
        }
        self.setup.observe(e.setup_ms / 1e3);
        if let Some(j) = e.join_ms {
            self.join.observe(j / 1e3);
        }
    }

    pub fn epoch_done(&mut self, r: &EpochRecord) {
        self.epochs.inc();
        self.duplicates.inc_by(r.duplicates);
        self.missing.inc_by(r.missing);
    }

    /// A checkpoint written: its step, the writer's seconds and bytes.
    pub fn checkpoint(&mut self, step: u64, secs: f64, bytes: u64) {
        self.checkpoints.inc();
        self.checkpoint_step.set(step as i64);
        self.checkpoint_write.observe(secs);
        self.checkpoint_bytes.set(bytes as i64);
    }

    /// Steps done again: `redone` from a failed step (`failed`) or a
    /// checkpoint on.
    pub fn redone(&mut self, redone: u64, failed: bool) {
        if failed {
            self.failures.inc();
        }
        self.redone.inc_by(redone);
    }

    /// What the teacher pool's policy saw: teachers no longer in the pool
    /// leave the teacher series.
    pub fn teacher_view(&mut self, v: &edl_plugin_sdk::TeacherView) {
        self.wait_share.set(v.wait_share);
        self.teachers.set(v.teacher_count as i64);
        self.teacher_use.clear();
        self.teacher_rows.clear();
        self.teacher_p50.clear();
        self.teacher_p99.clear();
        for t in &v.teachers {
            let label = TeacherLabel { teacher: Text(t.id.to_string()) };
            self.teacher_use.get_or_create(&label).set(t.utilisation);
            self.teacher_rows.get_or_create(&label).set(t.rows_per_sec);
            self.teacher_p50.get_or_create(&label).set(t.p50_ms / 1e3);
            self.teacher_p99.get_or_create(&label).set(t.p99_ms / 1e3);
        }
    }

    /// The parameter servers now: servers gone leave the series.
    pub fn parameter_servers(&mut self, stats: &[crate::ps::Stats]) {
        self.ps_servers.set(stats.len() as i64);
        self.ps_rows.clear();
        self.ps_bytes.clear();
        for s in stats {
            let label = ServerLabel { server: s.server.to_string() };
            self.ps_rows.get_or_create(&label).set(s.tables.iter().map(|t| t.rows as i64).sum());
            self.ps_bytes.get_or_create(&label).set(s.bytes as i64);
        }
    }

    /// A worker became ready: how long it took to start and to load.
    pub fn worker_ready(&mut self, start_secs: f64, load_secs: f64) {
        self.start.observe(start_secs);
        self.load.observe(load_secs);
    }

    /// The workers and where each stands.
    pub fn workers(&mut self, workers: &[crate::coordinator::WorkerState]) {
        for stage in ["training", "starting", "loading", "ready", "spare", "spare starting"] {
            let n = workers.iter().filter(|w| w.stage == stage).count();
            self.workers.get_or_create(&StageLabel { stage: stage.to_string() }).set(n as i64);
        }
    }

    /// A decision of the scaling policy, and how long its call took.
    pub fn decision(&mut self, d: &crate::coordinator::PolicyDecision, call_secs: f64) {
        self.plugin_calls.get_or_create(&PluginLabel { plugin: "scaling-policy" }).observe(call_secs);
        let actions: Vec<&'static str> = match &d.error {
            Some(_) => vec!["error"],
            None => d
                .actions
                .iter()
                .map(|a| match a {
                    edl_plugin_sdk::Action::Hold => "hold",
                    edl_plugin_sdk::Action::ScaleOut(_) => "scale-out",
                    edl_plugin_sdk::Action::ScaleIn(_) => "scale-in",
                    edl_plugin_sdk::Action::Replace(_) => "replace",
                })
                .collect(),
        };
        for action in if actions.is_empty() { vec!["hold"] } else { actions } {
            self.decisions.get_or_create(&ActionLabel { action }).inc();
        }
    }

    pub fn teachers(&mut self, e: &TeacherEvent) {
        self.teacher_changes.inc();
        self.teachers.set(e.to as i64);
    }

    pub fn note(&mut self) {
        self.notes.inc();
    }

    /// The metrics in the OpenMetrics text format (which Prometheus reads).
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }
}

/// The content type of [`JobMetrics::encode`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Samples committed from position `last` (epoch, samples of it consumed)
/// to `now`, in epochs of `rows` samples; nothing for a position at or
/// before `last` (a job that returned to a checkpoint).
fn samples_between(last: Option<(u64, usize)>, now: (u64, usize), rows: u64) -> u64 {
    let (e1, c1) = (now.0, now.1 as u64);
    let Some((e0, c0)) = last else { return c1 };
    let c0 = c0 as u64;
    match e1.cmp(&e0) {
        std::cmp::Ordering::Equal => c1.saturating_sub(c0),
        std::cmp::Ordering::Greater => rows.saturating_sub(c0) + (e1 - e0 - 1).saturating_mul(rows) + c1,
        std::cmp::Ordering::Less => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_counted_across_epochs_and_not_again_after_a_return() {
        assert_eq!(samples_between(None, (0, 64), 400), 64);
        assert_eq!(samples_between(Some((0, 64)), (0, 128), 400), 64);
        // 400 - 384 of epoch 0, then 32 of epoch 1.
        assert_eq!(samples_between(Some((0, 384)), (1, 32), 400), 48);
        assert_eq!(samples_between(Some((0, 384)), (2, 32), 400), 448);
        assert_eq!(samples_between(Some((1, 32)), (0, 384), 400), 0);
        assert_eq!(samples_between(Some((1, 64)), (1, 32), 400), 0);
    }

    #[test]
    fn the_parameter_servers_are_counted_and_a_server_gone_leaves_the_series() {
        let mut m = JobMetrics::new("ctr", "p", 400);
        let server = |id: u64, rows: u64, bytes: u64| crate::ps::Stats {
            server: id,
            tables: vec![crate::ps::server::TableStats { name: "t".into(), dim: 8, rows, bytes, applied: 3 }],
            bytes,
            bound: None,
            leaving: false,
            refused: 0,
            requests: 0,
            working_bytes: 0,
        };
        m.parameter_servers(&[server(1, 10, 1024), server(2, 20, 2048)]);
        let text = m.encode();
        for line in [
            "edl_parameter_servers 2",
            "edl_parameter_server_rows{server=\"2\"} 20",
            "edl_parameter_server_memory_bytes{server=\"1\"} 1024",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in {text}");
        }
        m.parameter_servers(&[server(1, 10, 1024)]);
        assert!(!m.encode().contains("server=\"2\""), "{}", m.encode());
    }

    #[test]
    fn samples_redone_after_a_return_to_a_checkpoint_are_not_counted_twice() {
        let mut m = JobMetrics::new("j", "p", 400);
        for (step, cursor) in [(1, 64), (2, 128), (3, 192)] {
            m.step(&step_at(step, 0, cursor));
        }
        // Back to step 1's checkpoint: steps 2 and 3 again, then step 4.
        for (step, cursor) in [(2, 128), (3, 192), (4, 256)] {
            m.step(&step_at(step, 0, cursor));
        }
        assert!(m.encode().lines().any(|l| l == "edl_samples_total 256"), "{}", m.encode());
    }

    fn step_at(step: u64, epoch: u64, cursor: usize) -> StepRecord {
        StepRecord {
            step,
            epoch,
            world: 2,
            secs: step as f64,
            loss: 0.5,
            samples_per_sec: 1000.0,
            cursor,
            batch: 64,
            lr: 0.05,
            noise_scale: None,
            grad_var: None,
            grad_sqr: None,
            efficiency: None,
            goodput: None,
            metrics: [("accuracy".to_string(), 0.75)].into(),
            ps_servers: None,
        }
    }

    fn grew() -> ScaleEvent {
        ScaleEvent {
            step: 2,
            from: 1,
            to: 2,
            pause_ms: 50.0,
            reason: "grow".into(),
            generation: 2,
            setup_ms: 20.0,
            join_ms: Some(3000.0),
            at_secs: 1.0,
            recovery: None,
        }
    }

    #[test]
    fn the_text_names_every_metric_with_its_prefix_unit_and_value() {
        let mut m = JobMetrics::new("mnist", "autoscale 0.1.0", 400);
        m.step(&step_at(1, 0, 64));
        m.step(&step_at(2, 0, 128));
        m.scale(&grew());
        let recovery = crate::leader::record::Recovery {
            detect_ms: 20.0,
            abort_ms: 70.0,
            form_ms: 1.0,
            first_step_ms: 100.0,
        };
        m.scale(&ScaleEvent { from: 3, to: 2, join_ms: None, recovery: Some(recovery), ..grew() });
        m.checkpoint(2, 0.25, 407_080);
        m.redone(3, true);
        m.redone(4, false);
        let hold = crate::coordinator::PolicyDecision {
            secs: 1.0,
            view: Default::default(),
            actions: vec![edl_plugin_sdk::Action::Hold],
            error: None,
        };
        m.decision(&hold, 0.0003);
        m.decision(&crate::coordinator::PolicyDecision { error: Some("trap".into()), ..hold }, 0.1);
        let worker = |id, stage: &str| crate::coordinator::WorkerState {
            id,
            rank: None,
            stage: stage.into(),
            handle: None,
        };
        m.workers(&[worker(1, "training"), worker(2, "training"), worker(3, "loading"), worker(4, "spare")]);
        let teacher = |id, utilisation| edl_plugin_sdk::TeacherStats {
            id,
            utilisation,
            rows_per_sec: 900.0,
            p50_ms: 4.0,
            p99_ms: 12.5,
            ..Default::default()
        };
        let mut view = edl_plugin_sdk::TeacherView {
            wait_share: 0.25,
            teacher_count: 2,
            teachers: vec![teacher(0, 0.5), teacher(7, 0.75)],
            ..Default::default()
        };
        m.teacher_view(&view);
        // Teacher 0 left the pool: its series go.
        view.teachers.remove(0);
        view.teacher_count = 1;
        m.teacher_view(&view);
        let text = m.encode();
        assert!(!text.contains("teacher=\"0\""), "{text}");
        for line in [
            "edl_job_info{name=\"mnist\",policy=\"autoscale 0.1.0\"} 1",
            "edl_committed_step 2",
            "edl_steps_total 2",
            "edl_samples_total 128",
            "edl_loss 0.5",
            "edl_global_batch 64",
            "edl_learning_rate 0.05000000074505806",
            "edl_program_metric{name=\"accuracy\"} 0.75",
            "edl_world_size 2",
            "edl_generation 2",
            "edl_resizes_total{direction=\"grow\"} 1",
            "edl_resize_pause_seconds_count 2",
            "edl_resize_pause_seconds_sum 0.1",
            "edl_failure_recovery_seconds_sum{phase=\"abort\"} 0.07",
            "edl_failure_recovery_seconds_count{phase=\"first_step\"} 1",
            "edl_resizes_total{direction=\"shrink\"} 1",
            "edl_worker_join_seconds_sum 3.0",
            "# UNIT edl_resize_pause_seconds seconds",
            "edl_checkpoint_write_seconds_sum 0.25",
            "edl_checkpoint_size_bytes 407080",
            "edl_redone_steps_total 7",
            "edl_step_failures_total 1",
            "edl_policy_decisions_total{action=\"hold\"} 1",
            "edl_policy_decisions_total{action=\"error\"} 1",
            "edl_plugin_call_seconds_count{plugin=\"scaling-policy\"} 2",
            "edl_workers{stage=\"training\"} 2",
            "edl_workers{stage=\"loading\"} 1",
            "edl_workers{stage=\"spare\"} 1",
            "edl_workers{stage=\"starting\"} 0",
            "edl_teacher_wait_share 0.25",
            "edl_teachers 1",
            "edl_teacher_utilisation{teacher=\"7\"} 0.75",
            "edl_teacher_rows_per_second{teacher=\"7\"} 900.0",
            "edl_teacher_request_p99_seconds{teacher=\"7\"} 0.0125",
            "edl_teacher_request_p50_seconds{teacher=\"7\"} 0.004",
            "# EOF",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} missing from\n{text}");
        }
    }

    #[test]
    fn label_values_from_outside_are_escaped() {
        let mut m = JobMetrics::new("mnist", "my \"policy\" 0.1", 400);
        let mut s = step_at(1, 0, 64);
        s.metrics = [("acc \"top1\"\\k\nx".to_string(), 0.5)].into();
        m.step(&s);
        let text = m.encode();
        for line in [
            "edl_job_info{name=\"mnist\",policy=\"my \\\"policy\\\" 0.1\"} 1",
            "edl_program_metric{name=\"acc \\\"top1\\\"\\\\k\\nx\"} 0.5",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} missing from\n{text}");
        }
    }

    /// The names `edl_...` in `text`.
    fn edl_names(text: &str) -> std::collections::BTreeSet<String> {
        let mut names = std::collections::BTreeSet::new();
        let mut rest = text;
        while let Some(at) = rest.find("edl_") {
            let name: String =
                rest[at..].chars().take_while(|c| c.is_ascii_lowercase() || *c == '_').collect();
            rest = &rest[at + name.len()..];
            names.insert(name);
        }
        names
    }

    #[test]
    fn the_example_grafana_dashboard_asks_only_for_series_the_job_serves() {
        let dashboard: serde_json::Value =
            serde_json::from_str(include_str!("../../../examples/grafana/edl-job.json")).unwrap();
        let mut m = JobMetrics::new("j", "p", 400);
        m.step(&step_at(1, 0, 64));
        m.teachers(&TeacherEvent { step: 1, secs: 0.5, from: 1, to: 2, reason: "r".into() });
        m.checkpoint(1, 0.02, 407_080);
        m.scale(&grew());
        m.redone(2, true);
        m.decision(
            &crate::coordinator::PolicyDecision {
                secs: 1.0,
                view: Default::default(),
                actions: vec![edl_plugin_sdk::Action::ScaleOut(1)],
                error: None,
            },
            0.0002,
        );
        m.epoch_done(&EpochRecord { epoch: 0, samples_committed: 400, duplicates: 0, missing: 0 });
        let served: std::collections::BTreeSet<String> = m
            .encode()
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| l.split(['{', ' ']).next().unwrap().to_string())
            .collect();
        let asked = edl_names(&dashboard.to_string());
        assert!(asked.len() >= 10, "{asked:?}");
        let unknown: Vec<&String> = asked.iter().filter(|n| !served.contains(*n)).collect();
        assert!(unknown.is_empty(), "the dashboard asks for {unknown:?}, not among {served:?}");
    }
}
