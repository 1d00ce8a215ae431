//! The worker count that maximises goodput (Pollux, OSDI'21), chosen with
//! the batch the goodput adapter would take at each count: a scaling
//! policy for `--policy plugins/goodput-policy.wasm --adapter
//! plugins/goodput.wasm`.
//!
//! At each decision, from what the host measured (the noise scale, the
//! step time at each world size and batch), the goodput `G(k)` of `k`
//! workers is the best over the adapter's batches (up to `--batch-max`,
//! where the adapter heads, not only those within its reach now) of
//! `M / T_k(M) * E(M)`
//! (see `goodput-model`), with `T_k` fitted to the step times measured
//! at `k` workers or, where none were, at the nearest count measured. Like
//! `autoscale`, it judges the last worker by its scaling efficiency
//! `s_k = (G(k) - G(k-1)) / (G(k) / k)`: it adds a worker while the next
//! one's is at least `threshold` [0.5], and removes the last while its own
//! is below it, one worker a decision, each count measured before it is
//! judged. Without a noise scale yet (a program measures it only where two
//! workers share a step; the built-in trainer on one CPU worker too), a job of
//! one worker grows to two to measure it. A worker it asked for
//! is waited for (up to [`WAIT_DECISIONS`] decisions) before it decides
//! again: a worker slow to start is not asked for twice.

use edl_plugin_sdk::{Action, ClusterView, Config, PluginError, ScalingPolicy, TrainingStats};
use goodput_model::{StepModel, candidates, goodput, measured_batches};

#[derive(Debug)]
pub struct GoodputPolicy {
    threshold: f64,
    overhead: f64,
    stats: Option<TrainingStats>,
    /// The world it asked for by growing, and the decisions since.
    asked: Option<(u32, u32)>,
}

impl Default for GoodputPolicy {
    fn default() -> Self {
        GoodputPolicy { threshold: 0.5, overhead: 0.3, stats: None, asked: None }
    }
}

/// Decisions a worker asked for is waited for before the policy decides
/// again without it (one that never came).
pub const WAIT_DECISIONS: u32 = 30;

/// The best goodput of `k` workers over the adapter's batches (None: not
/// modelled: nothing measured anywhere).
pub fn best_goodput(stats: &TrainingStats, k: u32, overhead: f64) -> Option<f64> {
    let model = StepModel::fit(stats, k, overhead)?;
    let (phi, base) = (stats.noise_scale, stats.base_batch);
    candidates(base, stats.max_batch, k)
        .into_iter()
        .map(|m| goodput(&model, phi, base, m, k))
        .reduce(f64::max)
}

/// The scaling efficiency of the `k`-th worker: what it adds over `k - 1`,
/// against what each of `k` delivers.
fn efficiency_of(stats: &TrainingStats, k: u32, overhead: f64) -> Option<f64> {
    let (with, without) = (best_goodput(stats, k, overhead)?, best_goodput(stats, k - 1, overhead)?);
    (with > 0.0).then(|| (with - without) / (with / f64::from(k)))
}

impl GoodputPolicy {
    /// The actions for `view`, given the measures `stats`.
    pub fn choose(&self, view: &ClusterView, stats: &TrainingStats) -> Action {
        let k = view.world_size;
        let phi = stats.noise_scale;
        if !(phi.is_finite() && phi > 0.0) {
            // A program measures it only where two workers share a step.
            let room = k < view.max_workers && view.free_slots > 0;
            return if k == 1 && room { Action::ScaleOut(1) } else { Action::Hold };
        }
        if measured_batches(stats, k) == 0 {
            return Action::Hold; // this count is judged once measured
        }
        if k < view.max_workers
            && view.free_slots > 0
            && efficiency_of(stats, k + 1, self.overhead).is_some_and(|s| s >= self.threshold)
        {
            return Action::ScaleOut(1);
        }
        if k > view.min_workers.max(1)
            && efficiency_of(stats, k, self.overhead).is_some_and(|s| s < self.threshold)
        {
            return Action::ScaleIn(1);
        }
        Action::Hold
    }
}

impl ScalingPolicy for GoodputPolicy {
    fn init(&mut self, config: &Config) -> Result<(), PluginError> {
        config.expect_only(&["threshold", "overhead"])?;
        self.threshold = config.get_or("threshold", 0.5)?;
        if !(self.threshold.is_finite() && self.threshold >= 0.0) {
            return Err(PluginError::InvalidConfig(format!("threshold {}: need 0 or more", self.threshold)));
        }
        self.overhead = config.get_or("overhead", 0.3)?;
        if !(0.0..1.0).contains(&self.overhead) {
            return Err(PluginError::InvalidConfig(format!(
                "overhead {}: need 0 <= overhead < 1",
                self.overhead
            )));
        }
        Ok(())
    }

    fn on_training(&mut self, stats: &TrainingStats) {
        self.stats = Some(stats.clone());
    }

    fn decide(&mut self, view: &ClusterView) -> Vec<Action> {
        if let Some((world, waited)) = self.asked {
            if view.world_size < world && waited < WAIT_DECISIONS {
                self.asked = Some((world, waited + 1));
                return vec![Action::Hold];
            }
            self.asked = None;
        }
        let action = match &self.stats {
            Some(stats) => self.choose(view, stats),
            None => Action::Hold,
        };
        if let Action::ScaleOut(n) = action {
            self.asked = Some((view.world_size + n, 0));
        }
        vec![action]
    }
}

edl_plugin_sdk::export_scaling_policy!(GoodputPolicy);

#[cfg(test)]
mod tests {
    use super::*;
    use edl_plugin_sdk::StepTime;

    fn stats(phi: f64, times: &[(u32, u32, f64)]) -> TrainingStats {
        TrainingStats {
            noise_scale: phi,
            base_batch: 64,
            base_lr: 0.05,
            max_batch: 1024,
            step_times: times
                .iter()
                .map(|&(world_size, global_batch, secs)| StepTime {
                    world_size,
                    global_batch,
                    secs,
                    steps: 8,
                })
                .collect(),
            ..Default::default()
        }
    }

    fn view(world: u32) -> ClusterView {
        ClusterView {
            world_size: world,
            min_workers: 1,
            max_workers: 4,
            free_slots: 4 - world,
            ..Default::default()
        }
    }

    #[test]
    fn a_worker_asked_for_is_waited_for_before_deciding_again() {
        let mut p = GoodputPolicy::default();
        p.on_training(&stats(0.0, &[]));
        assert_eq!(p.decide(&view(1)), vec![Action::ScaleOut(1)]);
        // Still one worker: the second is starting.
        assert_eq!(p.decide(&view(1)), vec![Action::Hold]);
        assert_eq!(p.decide(&view(2)), vec![Action::Hold], "two, and no noise scale needed more");
        // One that never comes is asked for again after the wait.
        let mut p = GoodputPolicy::default();
        p.on_training(&stats(0.0, &[]));
        p.decide(&view(1));
        for _ in 0..WAIT_DECISIONS {
            assert_eq!(p.decide(&view(1)), vec![Action::Hold]);
        }
        assert_eq!(p.decide(&view(1)), vec![Action::ScaleOut(1)]);
    }

    #[test]
    fn without_a_noise_scale_one_worker_grows_to_two_to_measure_it() {
        let p = GoodputPolicy::default();
        assert_eq!(p.choose(&view(1), &stats(0.0, &[])), Action::ScaleOut(1));
        assert_eq!(p.choose(&view(2), &stats(0.0, &[])), Action::Hold);
    }

    #[test]
    fn workers_are_added_while_the_next_one_pays_and_removed_when_the_last_does_not() {
        let p = GoodputPolicy::default();
        // Steps of fixed cost at 2 workers: a third is predicted to add
        // nearly a worker's share.
        let s = stats(500.0, &[(2, 64, 0.020), (2, 128, 0.024)]);
        assert_eq!(p.choose(&view(2), &s), Action::ScaleOut(1));
        // Measured at 3: each step takes four times as long (the ring's
        // cost grew), so the third adds less than it costs: back to two.
        let s = stats(500.0, &[(2, 64, 0.020), (2, 128, 0.024), (3, 96, 0.080), (3, 192, 0.084)]);
        assert_eq!(p.choose(&view(3), &s), Action::ScaleIn(1));
        // Not measured at this count yet: hold.
        assert_eq!(p.choose(&view(3), &stats(500.0, &[(2, 64, 0.020)])), Action::Hold);
        // Four workers each as fast as three (the same time for the same
        // rows each): the fourth pays its way, and there is no fifth.
        let s = stats(500.0, &[(3, 96, 0.020), (3, 192, 0.024), (4, 128, 0.020), (4, 256, 0.024)]);
        assert_eq!(p.choose(&view(4), &s), Action::Hold);
        // Nor a fourth without a free slot.
        let s = stats(500.0, &[(2, 64, 0.020), (2, 128, 0.024), (3, 96, 0.020), (3, 192, 0.024)]);
        assert_eq!(p.choose(&ClusterView { free_slots: 0, ..view(3) }, &s), Action::Hold);
    }
}
