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
    Action, BatchAdapter, ClusterView, Config, PluginError, ReaderTransform, ScalingPolicy, WorkerStats,
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

#[cfg(test)]
mod tests {
    use super::*;

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
