//! A job as it runs, for the people and tools that watch it: Prometheus
//! metrics (`/metrics`), a live page (`/`, its data at `/api/state`), both
//! kept from the coordinator's progress events by a [`Watch`] and served
//! by [`serve`] on `--metrics-listen`; and TensorBoard event files
//! ([`tensorboard`], `--tensorboard DIR`).

pub mod metrics;
mod serve;
pub mod tensorboard;

pub use serve::{Listening, ServeError, WatchAccess, serve};

use crate::coordinator::{Progress, StepRecord, machine::ledger::EpochRecord, pool::TeacherEvent};
use crate::leader::record::ScaleEvent;
use serde::Serialize;
use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::Instant,
};

/// Most points of the curves kept: past it, every other one is dropped
/// (the oldest first thinned), so a long job's page stays light.
const MAX_POINTS: usize = 4_000;
/// Most notes, scale events, teacher changes and epochs kept (the newest):
/// the page shows the newest 30, the report has them all.
const MAX_NOTES: usize = 200;
const MAX_EVENTS: usize = 500;

/// Drops the oldest of `list` past `max`.
fn keep_newest<T>(list: &mut Vec<T>, max: usize) {
    if list.len() > max {
        list.drain(..list.len() - max);
    }
}

/// What the watchers of one job see, shared by the coordinator's thread
/// (which records) and the server's (which reads).
#[derive(Clone)]
pub struct Watch {
    inner: Arc<Mutex<Watched>>,
}

struct Watched {
    metrics: metrics::JobMetrics,
    live: Live,
}

/// The job's state as the live page draws it.
#[derive(Clone, Debug, Serialize)]
pub struct Live {
    pub job: String,
    pub policy: String,
    /// When this process began watching (UNIX seconds): a page that sees
    /// it change (another coordinator, a rerun) starts its curves over.
    pub started_unix: f64,
    /// `running`, then `finished`, `stopped` (SIGTERM or Ctrl-C) or `failed`.
    pub status: String,
    pub epochs: u64,
    pub rows: u64,
    pub step: u64,
    pub epoch: u64,
    pub world: u32,
    pub generation: u64,
    /// The teacher pool's size, once it changed (a job without a pool: none).
    pub teachers: Option<u32>,
    pub checkpoint_step: Option<u64>,
    /// Steps computed again after failures.
    pub redone_steps: u64,
    /// The workers and where each stands.
    pub workers: Vec<crate::coordinator::WorkerState>,
    /// What the teacher pool's policy saw last (a job with a pool).
    pub teacher_view: Option<edl_plugin_sdk::TeacherView>,
    /// Seconds since the watch began.
    pub secs: f64,
    pub points: Vec<Point>,
    pub scale_events: Vec<ScaleEvent>,
    pub teacher_events: Vec<TeacherEvent>,
    pub epochs_done: Vec<EpochRecord>,
    pub notes: Vec<Note>,
    /// Points recorded so far.
    pub recorded: u64,
}

/// One committed step on the curves.
#[derive(Clone, Debug, Serialize)]
pub struct Point {
    /// Counts the points recorded (a step redone after a return to a
    /// checkpoint is a new point): what the page asks for points after.
    pub seq: u64,
    pub step: u64,
    pub secs: f64,
    pub world: u32,
    pub loss: f64,
    pub samples_per_sec: f64,
    pub batch: u32,
    pub lr: f32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub noise_scale: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub goodput: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub efficiency: Option<f64>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub metrics: BTreeMap<String, f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Note {
    pub secs: f64,
    pub text: String,
}

impl Watch {
    /// The watch of job `job` under scaling policy `policy`, `epochs`
    /// epochs of `rows` samples.
    pub fn new(job: &str, policy: &str, epochs: u64, rows: u64) -> Watch {
        let live = Live {
            job: job.to_string(),
            policy: policy.to_string(),
            started_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs_f64(),
            status: "running".into(),
            epochs,
            rows,
            step: 0,
            epoch: 0,
            world: 0,
            generation: 0,
            teachers: None,
            checkpoint_step: None,
            redone_steps: 0,
            workers: Vec::new(),
            teacher_view: None,
            secs: 0.0,
            points: Vec::new(),
            scale_events: Vec::new(),
            teacher_events: Vec::new(),
            epochs_done: Vec::new(),
            notes: Vec::new(),
            recorded: 0,
        };
        let metrics = metrics::JobMetrics::new(job, policy, rows);
        Watch { inner: Arc::new(Mutex::new(Watched { metrics, live })) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Watched> {
        // A panic elsewhere while holding it leaves plain numbers behind.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records one event of the job.
    pub fn record(&self, p: &Progress) {
        let w = &mut *self.lock();
        match p {
            Progress::Step(s) => {
                w.metrics.step(s);
                w.live.step(s);
            }
            Progress::Scale(e) => {
                w.metrics.scale(e);
                w.live.world = e.to;
                w.live.generation = e.generation;
                w.live.scale_events.push((*e).clone());
                keep_newest(&mut w.live.scale_events, MAX_EVENTS);
            }
            Progress::Epoch(r) => {
                w.metrics.epoch_done(r);
                w.live.epochs_done.push((*r).clone());
                keep_newest(&mut w.live.epochs_done, MAX_EVENTS);
            }
            Progress::Checkpoint { step, secs, bytes, .. } => {
                w.metrics.checkpoint(*step, *secs, *bytes);
                w.live.checkpoint_step = Some(*step);
            }
            Progress::Redone { redone, failed, .. } => {
                w.metrics.redone(*redone, *failed);
                w.live.redone_steps += redone;
            }
            Progress::Decision { decision, call_secs } => w.metrics.decision(decision, *call_secs),
            Progress::TeacherView(v) => {
                w.metrics.teacher_view(v);
                w.live.teacher_view = Some((*v).clone());
            }
            Progress::WorkerReady { start_secs, load_secs, .. } => {
                w.metrics.worker_ready(*start_secs, *load_secs)
            }
            Progress::Workers(workers) => {
                w.metrics.workers(workers);
                w.live.workers = workers.to_vec();
            }
            Progress::Note(n) => {
                w.metrics.note();
                w.live.note(n);
            }
            Progress::ParameterServers(s) => w.metrics.parameter_servers(s),
            Progress::Teachers(e) => {
                w.metrics.teachers(e);
                w.live.teachers = Some(e.to);
                w.live.teacher_events.push((*e).clone());
                keep_newest(&mut w.live.teacher_events, MAX_EVENTS);
            }
        }
    }

    /// The job ended (`ok`: finished; else failed or stopped).
    pub fn end(&self, status: &str) {
        self.lock().live.status = status.to_string();
    }

    /// The metrics in the OpenMetrics text format.
    pub fn metrics_text(&self) -> String {
        self.lock().metrics.encode()
    }

    /// The page's state, its points after point `since` only (all with `None`).
    pub fn live(&self, since: Option<u64>, started: Instant) -> Live {
        let w = self.lock();
        let mut live = Live { points: Vec::new(), ..w.live.clone_without_points() };
        live.points = w.live.points.iter().filter(|p| since.is_none_or(|s| p.seq > s)).cloned().collect();
        live.secs = started.elapsed().as_secs_f64();
        live
    }
}

impl Live {
    fn step(&mut self, s: &StepRecord) {
        self.step = s.step;
        self.epoch = s.epoch;
        self.world = s.world;
        self.recorded += 1;
        self.points.push(Point {
            seq: self.recorded,
            step: s.step,
            secs: s.secs,
            world: s.world,
            loss: s.loss,
            samples_per_sec: s.samples_per_sec,
            batch: s.batch,
            lr: s.lr,
            noise_scale: s.noise_scale,
            goodput: s.goodput,
            efficiency: s.efficiency,
            metrics: s.metrics.clone(),
        });
        if self.points.len() > MAX_POINTS {
            let mut i = 0;
            self.points.retain(|_| {
                i += 1;
                i % 2 == 1
            });
        }
    }

    fn note(&mut self, text: &str) {
        let secs = self.points.last().map_or(0.0, |p| p.secs);
        self.notes.push(Note { secs, text: text.to_string() });
        keep_newest(&mut self.notes, MAX_NOTES);
    }

    /// Everything but the points (which are filtered by the caller).
    fn clone_without_points(&self) -> Live {
        Live {
            job: self.job.clone(),
            policy: self.policy.clone(),
            status: self.status.clone(),
            points: Vec::new(),
            scale_events: self.scale_events.clone(),
            teacher_events: self.teacher_events.clone(),
            epochs_done: self.epochs_done.clone(),
            notes: self.notes.clone(),
            workers: self.workers.clone(),
            teacher_view: self.teacher_view.clone(),
            teachers: self.teachers,
            checkpoint_step: self.checkpoint_step,
            ..*self
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(step: u64) -> StepRecord {
        StepRecord {
            step,
            epoch: 0,
            world: 1,
            secs: step as f64 * 0.1,
            loss: 1.0 / step as f64,
            samples_per_sec: 100.0,
            cursor: (step as usize * 8) % 400,
            batch: 8,
            lr: 0.1,
            noise_scale: None,
            grad_var: None,
            grad_sqr: None,
            efficiency: None,
            goodput: None,
            metrics: BTreeMap::new(),
            ps_servers: None,
        }
    }

    #[test]
    fn the_page_gets_the_points_after_the_step_it_has_and_a_long_job_is_thinned() {
        let w = Watch::new("j", "p", 2, 400);
        let t0 = Instant::now();
        for s in 1..=10 {
            w.record(&Progress::Step(&step(s)));
        }
        let after: Vec<u64> = w.live(Some(7), t0).points.iter().map(|p| p.step).collect();
        assert_eq!(after, [8, 9, 10]);
        // A step redone after a return to a checkpoint is a new point.
        w.record(&Progress::Step(&step(9)));
        let after: Vec<u64> = w.live(Some(10), t0).points.iter().map(|p| p.step).collect();
        assert_eq!(after, [9]);
        assert_eq!(w.live(None, t0).points.len(), 11);
        for s in 11..=(MAX_POINTS as u64) {
            w.record(&Progress::Step(&step(s)));
        }
        let all = w.live(None, t0).points;
        assert!(all.len() <= MAX_POINTS / 2 + 1, "{}", all.len());
        assert_eq!(all.first().unwrap().step, 1);
        assert!(all.windows(2).all(|p| p[0].seq < p[1].seq));
        // The newest step is kept whatever the thinning.
        w.record(&Progress::Step(&step(MAX_POINTS as u64 + 2)));
        assert_eq!(w.live(None, t0).points.last().unwrap().step, MAX_POINTS as u64 + 2);
    }
}
