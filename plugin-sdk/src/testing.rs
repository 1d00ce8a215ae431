//! A native test harness: exercise a plugin's logic with `cargo test` on the
//! host, without building WebAssembly.
//!
//! ```
//! use edl_plugin_sdk::testing::{self, SimCluster};
//! use edl_plugin_sdk::{Action, ClusterView, ScalingPolicy};
//!
//! #[derive(Default)]
//! struct AlwaysGrow;
//! impl ScalingPolicy for AlwaysGrow {
//!     fn decide(&mut self, _: &ClusterView) -> Vec<Action> { vec![Action::ScaleOut(1)] }
//! }
//!
//! let mut policy = testing::policy::<AlwaysGrow>(&[]).unwrap();
//! let mut sim = SimCluster::saturating(4, 1, 6);
//! let history = sim.run(20, |view| policy.decide(view));
//! assert_eq!(history.last().unwrap().world_size, 6);
//! ```

use crate::{
    Action, BatchAdapter, ClusterView, Config, PluginError, ReaderTransform, ScalingPolicy, TeacherPlan,
    TeacherPolicy, TeacherStats, TeacherView, WorkerStats,
};
use serde::{Deserialize, Serialize};

fn configured<P: Default>(
    pairs: &[(&str, &str)],
    init: impl FnOnce(&mut P, &Config) -> Result<(), PluginError>,
) -> Result<P, PluginError> {
    let mut plugin = P::default();
    init(&mut plugin, &Config::from_pairs(pairs))?;
    Ok(plugin)
}

/// A scaling policy created and initialised as the runtime would.
pub fn policy<P: ScalingPolicy>(config: &[(&str, &str)]) -> Result<P, PluginError> {
    configured(config, P::init)
}

/// A batch adapter created and initialised as the runtime would.
pub fn adapter<A: BatchAdapter>(config: &[(&str, &str)]) -> Result<A, PluginError> {
    configured(config, A::init)
}

/// A reader transform created and initialised as the runtime would.
pub fn transform<T: ReaderTransform>(config: &[(&str, &str)]) -> Result<T, PluginError> {
    configured(config, T::init)
}

/// A teacher policy created and initialised as the runtime would.
pub fn teacher_policy<P: TeacherPolicy>(config: &[(&str, &str)]) -> Result<P, PluginError> {
    configured(config, P::init)
}

#[derive(Clone, Debug, PartialEq)]
struct SimWorker {
    id: u64,
    speed: f64,
}

/// A synthetic cluster that reacts to a policy's actions: throughput follows
/// a curve of the world size, a slow worker slows the whole synchronous job.
#[derive(Clone, Debug)]
pub struct SimCluster {
    /// Job throughput (samples/s) with k healthy workers at `curve[k - 1]`;
    /// sizes past the end keep the last value.
    pub curve: Vec<f64>,
    pub min_workers: u32,
    pub max_workers: u32,
    /// Devices the cluster has for this job (free slots = capacity - world size).
    pub capacity: u32,
    /// Training steps between two decisions.
    pub steps_per_decision: u64,
    pub global_batch: u32,
    pub samples_total: u64,
    pub price_per_worker_hour: f64,
    workers: Vec<SimWorker>,
    next_id: u64,
    step: u64,
    samples_done: u64,
    secs_since_change: f64,
}

/// One decision of a simulated run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SimRecord {
    pub step: u64,
    pub world_size: u32,
    pub throughput: f64,
    pub actions: Vec<Action>,
}

impl SimCluster {
    /// A cluster whose job throughput is `curve[k - 1]` with k workers, starting at `start` workers.
    pub fn new(curve: Vec<f64>, start: u32, min_workers: u32, max_workers: u32) -> Self {
        let mut sim = SimCluster {
            curve,
            min_workers,
            max_workers,
            capacity: max_workers,
            steps_per_decision: 20,
            global_batch: 256,
            samples_total: 10_000_000,
            price_per_worker_hour: 0.0,
            workers: Vec::new(),
            next_id: 0,
            step: 0,
            samples_done: 0,
            secs_since_change: 0.0,
        };
        for _ in 0..start.max(1) {
            sim.spawn();
        }
        sim
    }

    /// Throughput that grows almost linearly up to `knee` workers and stays flat after
    /// (1000 samples/s per worker, 2% overhead per extra worker).
    pub fn saturating(knee: u32, min_workers: u32, max_workers: u32) -> Self {
        let curve = (1..=max_workers.max(knee) + 1)
            .map(|k| {
                let eff = k.min(knee) as f64;
                1000.0 * eff * (1.0 - 0.02 * (eff - 1.0))
            })
            .collect();
        SimCluster::new(curve, min_workers, min_workers, max_workers)
    }

    fn spawn(&mut self) {
        self.workers.push(SimWorker { id: self.next_id, speed: 1.0 });
        self.next_id += 1;
    }

    /// Current number of workers.
    pub fn world_size(&self) -> u32 {
        self.workers.len() as u32
    }

    /// Ids of the current workers, oldest first.
    pub fn worker_ids(&self) -> Vec<u64> {
        self.workers.iter().map(|w| w.id).collect()
    }

    /// Changes the devices the cluster gives this job; workers past the new
    /// capacity are taken away (newest first), as a preemption would.
    pub fn set_capacity(&mut self, capacity: u32) {
        self.capacity = capacity;
        let keep = capacity.max(self.min_workers).max(1) as usize;
        if self.workers.len() > keep {
            self.workers.truncate(keep);
            self.secs_since_change = 0.0;
        }
    }

    /// Makes the worker at `index` run at `speed` times the healthy rate.
    pub fn set_speed(&mut self, index: usize, speed: f64) {
        if let Some(w) = self.workers.get_mut(index) {
            w.speed = speed;
        }
    }

    fn healthy_throughput(&self) -> f64 {
        let k = self.workers.len().max(1);
        self.curve.get(k - 1).or(self.curve.last()).copied().unwrap_or(0.0)
    }

    /// Job throughput: a synchronous step waits for the slowest worker.
    pub fn throughput(&self) -> f64 {
        let slowest = self.workers.iter().map(|w| w.speed).fold(1.0, f64::min);
        self.healthy_throughput() * slowest
    }

    /// The view a policy would get now.
    pub fn view(&self) -> ClusterView {
        let per_worker = self.healthy_throughput() / self.workers.len().max(1) as f64;
        ClusterView {
            step: self.step,
            epoch: (self.samples_done / 60_000) as u32,
            world_size: self.world_size(),
            min_workers: self.min_workers,
            max_workers: self.max_workers,
            free_slots: self.capacity.saturating_sub(self.world_size()),
            global_batch: self.global_batch,
            throughput: self.throughput(),
            workers: self
                .workers
                .iter()
                .map(|w| WorkerStats { id: w.id, throughput: per_worker * w.speed })
                .collect(),
            secs_since_change: self.secs_since_change,
            price_per_worker_hour: self.price_per_worker_hour,
            samples_remaining: self.samples_total.saturating_sub(self.samples_done),
        }
    }

    /// Applies a policy's actions within the cluster's limits.
    pub fn apply(&mut self, actions: &[Action]) {
        let before = self.world_size();
        for action in actions {
            match *action {
                Action::Hold => {}
                Action::ScaleOut(n) => {
                    let room = self.max_workers.min(self.capacity).saturating_sub(self.world_size());
                    for _ in 0..n.min(room) {
                        self.spawn();
                    }
                }
                Action::ScaleIn(n) => {
                    let spare = self.world_size().saturating_sub(self.min_workers.max(1));
                    for _ in 0..n.min(spare) {
                        self.workers.pop();
                    }
                }
                Action::Replace(id) => {
                    if let Some(pos) = self.workers.iter().position(|w| w.id == id) {
                        self.workers.remove(pos);
                        self.spawn();
                    }
                }
            }
        }
        if self.world_size() != before {
            self.secs_since_change = 0.0;
        }
    }

    /// Trains for one decision period.
    pub fn advance(&mut self) {
        let samples = self.steps_per_decision * self.global_batch as u64;
        let tput = self.throughput().max(1e-9);
        self.step += self.steps_per_decision;
        self.samples_done += samples;
        self.secs_since_change += samples as f64 / tput;
    }

    /// Runs `decisions` rounds of view -> decide -> apply -> advance.
    pub fn run(
        &mut self,
        decisions: usize,
        mut decide: impl FnMut(&ClusterView) -> Vec<Action>,
    ) -> Vec<SimRecord> {
        let mut history = Vec::with_capacity(decisions);
        for _ in 0..decisions {
            let view = self.view();
            let actions = decide(&view);
            self.apply(&actions);
            history.push(SimRecord {
                step: view.step,
                world_size: self.world_size(),
                throughput: view.throughput,
                actions,
            });
            self.advance();
        }
        history
    }
}

/// The standard policy input of benchmarks: the views a job sees on a cluster
/// whose throughput saturates at 4 workers, grown one worker at a time up to
/// 6 and back, with one worker at half speed in the second half (120 views).
pub fn standard_trace() -> Vec<ClusterView> {
    let mut sim = SimCluster::saturating(4, 1, 6);
    let mut views = Vec::with_capacity(120);
    for i in 0..120 {
        if i == 60 {
            sim.set_speed(0, 0.5);
        }
        let view = sim.view();
        let k = view.world_size;
        let action = match (i / 10) % 12 {
            0..=5 if k < 6 => Action::ScaleOut(1),
            6..=11 if k > 1 => Action::ScaleIn(1),
            _ => Action::Hold,
        };
        views.push(view);
        if i % 10 == 9 {
            sim.apply(&[action]);
        }
        sim.advance();
    }
    views
}

/// The standard transform input of benchmarks: 256 MNIST-shaped samples
/// (28 x 28 uint8) of seeded noise.
pub fn standard_batch() -> crate::Batch {
    let n = 256;
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    crate::Batch {
        data: (0..n * 784)
            .map(|_| {
                x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                (x >> 56) as u8
            })
            .collect(),
        shape: vec![n as u32, 28, 28],
        dtype: crate::Dtype::Uint8,
        labels: (0..n as u32).map(|i| i % 10).collect(),
        ids: (0..n as u64).collect(),
        seed: 42,
    }
}

/// A teacher view to start a test from: `teachers` teachers (each at 50%
/// utilisation, no queue), bounds `min..=max`, four students with no change
/// planned, students that do not wait, 4 requests in flight per teacher and a
/// minute since the pool last changed. Change what a test is about with the
/// builder methods:
///
/// ```
/// use edl_plugin_sdk::testing::teacher_view;
/// let v = teacher_view(2, 1, 8).wait_share(0.3).utilisation(0.9).students(4, 8).build();
/// assert_eq!((v.teacher_count, v.teachers.len(), v.student_world_planned), (2, 2, 8));
/// assert_eq!(v.teachers[1].utilisation, 0.9);
/// ```
pub fn teacher_view(teachers: u32, min: u32, max: u32) -> TeacherViewBuilder {
    let mut view = TeacherView {
        step: 1000,
        wait_share: 0.0,
        student_throughput: 4000.0,
        student_world_size: 4,
        student_world_planned: 4,
        teacher_count: 0,
        min_teachers: min,
        max_teachers: max,
        in_flight_per_teacher: 4,
        teachers: Vec::new(),
        secs_since_change: 60.0,
        price_per_teacher_hour: 0.0,
    };
    set_teachers(&mut view, teachers, 0.5);
    TeacherViewBuilder(view)
}

fn set_teachers(view: &mut TeacherView, count: u32, utilisation: f64) {
    view.teacher_count = count;
    view.teachers = (0..count as u64)
        .map(|id| TeacherStats {
            id,
            utilisation,
            rows_per_sec: 4000.0 * utilisation,
            latency_ms: 20.0,
            p50_ms: 18.0,
            p99_ms: 40.0,
            ..TeacherStats::default()
        })
        .collect();
}

/// Builds a [`TeacherView`]; see [`teacher_view`].
#[derive(Clone, Debug)]
pub struct TeacherViewBuilder(TeacherView);

impl TeacherViewBuilder {
    /// The share of the students' step time spent waiting for soft labels.
    pub fn wait_share(mut self, share: f64) -> Self {
        self.0.wait_share = share;
        self
    }

    /// Every teacher's utilisation (and rows answered in proportion).
    pub fn utilisation(mut self, utilisation: f64) -> Self {
        let count = self.0.teacher_count;
        set_teachers(&mut self.0, count, utilisation);
        self
    }

    /// The teachers serving now, keeping their utilisation.
    pub fn teachers(mut self, count: u32) -> Self {
        let utilisation = self.0.mean_utilisation();
        set_teachers(&mut self.0, count, utilisation);
        self
    }

    /// Students now and the number the scaling policy asked for.
    pub fn students(mut self, size: u32, planned: u32) -> Self {
        self.0.student_world_size = size;
        self.0.student_world_planned = planned;
        self
    }

    /// Requests each student keeps in flight at each teacher.
    pub fn in_flight(mut self, n: u32) -> Self {
        self.0.in_flight_per_teacher = n;
        self
    }

    /// Seconds since the pool last changed size.
    pub fn secs_since_change(mut self, secs: f64) -> Self {
        self.0.secs_since_change = secs;
        self
    }

    /// The training step of the decision.
    pub fn step(mut self, step: u64) -> Self {
        self.0.step = step;
        self
    }

    /// The view.
    pub fn build(self) -> TeacherView {
        self.0
    }
}

/// A synthetic teacher pool that reacts to a teacher policy's plans.
///
/// Each student needs `demand_per_student` rows of soft labels per second.
/// A teacher answers at most `capacity` rows per second when kept busy; with
/// few requests in flight it is latency-bound: it answers at most
/// `students x in-flight x rows_per_request` rows per `latency_ms`. What
/// the pool cannot answer, the students wait for.
#[derive(Clone, Debug)]
pub struct SimTeacherPool {
    pub demand_per_student: f64,
    pub capacity: f64,
    pub latency_ms: f64,
    pub rows_per_request: f64,
    pub students: u32,
    pub planned_students: u32,
    pub min_teachers: u32,
    pub max_teachers: u32,
    /// Seconds between two decisions.
    pub secs_per_decision: f64,
    /// Training steps between two decisions.
    pub steps_per_decision: u64,
    teachers: u32,
    in_flight: u32,
    step: u64,
    secs_since_change: f64,
}

/// One decision of a simulated teacher pool.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SimTeacherRecord {
    pub step: u64,
    pub wait_share: f64,
    pub plan: TeacherPlan,
    /// The pool after the plan (clamped as the host clamps it).
    pub teachers: u32,
    pub in_flight_per_teacher: u32,
}

impl SimTeacherPool {
    /// `students` students of 1000 rows/s each, `teachers` teachers of
    /// 2000 rows/s each (20 ms a request of 32 rows), 4 requests in flight.
    pub fn new(students: u32, teachers: u32, min_teachers: u32, max_teachers: u32) -> Self {
        SimTeacherPool {
            demand_per_student: 1000.0,
            capacity: 2000.0,
            latency_ms: 20.0,
            rows_per_request: 32.0,
            students,
            planned_students: students,
            min_teachers,
            max_teachers,
            secs_per_decision: 5.0,
            steps_per_decision: 20,
            teachers,
            in_flight: 4,
            step: 0,
            secs_since_change: 0.0,
        }
    }

    /// Teachers serving now.
    pub fn teachers(&self) -> u32 {
        self.teachers
    }

    /// Requests each student keeps in flight at each teacher now.
    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// Rows per second one teacher answers now (busy- or latency-bound).
    fn per_teacher(&self) -> f64 {
        let offered = self.students as f64 * self.in_flight as f64 * self.rows_per_request * 1000.0
            / self.latency_ms.max(1e-9);
        self.capacity.min(offered)
    }

    /// The view a teacher policy would get now.
    pub fn view(&self) -> TeacherView {
        let demand = self.students as f64 * self.demand_per_student;
        let served = demand.min(self.teachers as f64 * self.per_teacher());
        let wait_share = if demand > 0.0 { 1.0 - served / demand } else { 0.0 };
        let each = served / self.teachers.max(1) as f64;
        let utilisation = (each / self.capacity).min(1.0);
        // A teacher kept busy queues what it cannot start at once.
        let queue_ms = if utilisation >= 0.999 { self.latency_ms * wait_share * 10.0 } else { 0.0 };
        TeacherView {
            step: self.step,
            wait_share,
            // 250 samples/s per student that gets all its soft labels.
            student_throughput: served / self.demand_per_student.max(1e-9) * 250.0,
            student_world_size: self.students,
            student_world_planned: self.planned_students,
            teacher_count: self.teachers,
            min_teachers: self.min_teachers,
            max_teachers: self.max_teachers,
            in_flight_per_teacher: self.in_flight,
            teachers: (0..self.teachers as u64)
                .map(|id| TeacherStats {
                    id,
                    utilisation,
                    queue_depth: queue_ms / self.latency_ms.max(1e-9),
                    rows_per_sec: each,
                    latency_ms: self.latency_ms + queue_ms,
                    queue_ms,
                    errors: 0,
                    // The tail waits twice the mean queue.
                    p50_ms: self.latency_ms + queue_ms,
                    p99_ms: self.latency_ms + 2.0 * queue_ms,
                })
                .collect(),
            secs_since_change: self.secs_since_change,
            price_per_teacher_hour: 0.0,
        }
    }

    /// Applies a plan, clamped as the host clamps it.
    pub fn apply(&mut self, plan: &TeacherPlan) {
        let lo = self.min_teachers.min(self.max_teachers);
        let teachers = plan.teachers.clamp(lo, self.max_teachers);
        if teachers != self.teachers {
            self.secs_since_change = 0.0;
        }
        self.teachers = teachers;
        self.in_flight = plan.in_flight_per_teacher.clamp(1, 64);
    }

    /// Students now and the number planned; the plan comes true at the next
    /// call with `size == planned`.
    pub fn set_students(&mut self, size: u32, planned: u32) {
        self.students = size;
        self.planned_students = planned;
    }

    /// Trains for one decision period.
    pub fn advance(&mut self) {
        self.step += self.steps_per_decision;
        self.secs_since_change += self.secs_per_decision;
    }

    /// Runs `decisions` rounds of view -> decide -> apply -> advance.
    pub fn run(
        &mut self,
        decisions: usize,
        mut decide: impl FnMut(&TeacherView) -> TeacherPlan,
    ) -> Vec<SimTeacherRecord> {
        (0..decisions)
            .map(|_| {
                let view = self.view();
                let plan = decide(&view);
                self.apply(&plan);
                self.advance();
                SimTeacherRecord {
                    step: view.step,
                    wait_share: view.wait_share,
                    plan,
                    teachers: self.teachers,
                    in_flight_per_teacher: self.in_flight,
                }
            })
            .collect()
    }
}

/// The standard teacher-policy input of benchmarks: the views of a pool of
/// 1 to 8 teachers serving 2 students that become 8 (announced ten
/// decisions ahead) and later 3, the pool grown and shrunk one teacher at a
/// time, in-flight requests between 1 and 8 (120 views).
pub fn standard_teacher_trace() -> Vec<TeacherView> {
    let mut pool = SimTeacherPool::new(2, 1, 1, 8);
    let mut views = Vec::with_capacity(120);
    for i in 0..120u32 {
        match i {
            30 => pool.set_students(2, 8),
            40 => pool.set_students(8, 8),
            90 => pool.set_students(3, 3),
            _ => {}
        }
        let view = pool.view();
        let grow = (i / 10) % 2 == 0;
        let teachers = if grow { view.teacher_count + 1 } else { view.teacher_count.saturating_sub(1) };
        let in_flight = 1 << (i % 4);
        views.push(view);
        if i % 5 == 4 {
            pool.apply(&TeacherPlan { teachers, in_flight_per_teacher: in_flight });
        }
        pool.advance();
    }
    views
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_too_small_makes_students_wait_and_a_latency_bound_one_idles() {
        let mut pool = SimTeacherPool::new(4, 1, 1, 8);
        let v = pool.view();
        assert!(v.wait_share > 0.4, "{v:?}");
        assert_eq!(v.teachers[0].utilisation, 1.0);
        pool.apply(&TeacherPlan { teachers: 2, in_flight_per_teacher: 4 });
        assert_eq!(pool.view().wait_share, 0.0);
        // One request in flight of one student: the teachers idle, the student waits.
        let mut slow = SimTeacherPool::new(1, 2, 1, 8);
        slow.apply(&TeacherPlan { teachers: 2, in_flight_per_teacher: 1 });
        (slow.latency_ms, slow.rows_per_request) = (80.0, 16.0);
        let v = slow.view();
        assert!(v.wait_share > 0.4 && v.mean_utilisation() < 0.2, "{v:?}");
    }

    #[test]
    fn plans_are_clamped_as_the_host_clamps_them() {
        let mut pool = SimTeacherPool::new(4, 2, 1, 3);
        pool.apply(&TeacherPlan { teachers: 10, in_flight_per_teacher: 100 });
        assert_eq!((pool.teachers(), pool.in_flight()), (3, 64));
        pool.apply(&TeacherPlan { teachers: 0, in_flight_per_teacher: 0 });
        assert_eq!((pool.teachers(), pool.in_flight()), (1, 1));
        assert_eq!(standard_teacher_trace().len(), 120);
    }

    #[test]
    fn saturating_curve_is_flat_past_the_knee() {
        let sim = SimCluster::saturating(4, 1, 8);
        assert!(sim.curve[3] > sim.curve[2]);
        assert_eq!(sim.curve[4], sim.curve[3]);
    }

    #[test]
    fn a_slow_worker_slows_the_job() {
        let mut sim = SimCluster::saturating(4, 2, 4);
        let healthy = sim.throughput();
        sim.set_speed(1, 0.5);
        assert!((sim.throughput() - healthy * 0.5).abs() < 1e-9);
        let view = sim.view();
        assert!((view.workers[1].throughput - view.workers[0].throughput * 0.5).abs() < 1e-9);
    }

    #[test]
    fn actions_respect_the_limits() {
        let mut sim = SimCluster::saturating(4, 1, 3);
        sim.apply(&[Action::ScaleOut(10)]);
        assert_eq!(sim.world_size(), 3);
        sim.apply(&[Action::ScaleIn(10)]);
        assert_eq!(sim.world_size(), 1);
        let id = sim.worker_ids()[0];
        sim.apply(&[Action::Replace(id)]);
        assert_eq!(sim.world_size(), 1);
        assert_ne!(sim.worker_ids()[0], id);
    }
}
