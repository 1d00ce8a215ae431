//! Autoscaling by throughput scaling efficiency (Or, Zhang, Freedman,
//! "Resource Elasticity in Distributed Deep Learning", MLSys 2020).
//!
//! Each world size k is measured for a window before it is judged: R_k is the
//! job's mean throughput there. The scaling efficiency of the last worker is
//! s_k = (R_k - R_{k-1}) / r_k with r_k = R_k / k. The policy scales out while
//! s stays above `threshold` and the value of the time saved beats the added
//! cost (price x workers x remaining time); it scales back in when the last
//! step out was not worth it and settles there. A measurement that drifts by
//! more than `drift` from the last one at the same size means the cluster
//! changed, and the search starts again.
//!
//! Stragglers: an EWMA (`ewma-alpha`) of each worker's throughput; a worker
//! below `straggler-ratio` x the median is replaced (the runtime starts the
//! replacement before removing it).

use edl_plugin_sdk::{Action, ClusterView, Config, PluginError, ScalingPolicy};

#[derive(Debug)]
pub struct Autoscale {
    threshold: f64,
    warmup: u32,
    window: usize,
    drift: f64,
    value_per_hour: f64,
    straggler_ratio: f64,
    alpha: f64,
    straggler_min_obs: u32,
    /// Settled throughput per world size (index = size).
    measured: Vec<Option<f64>>,
    /// Smallest size found not worth it.
    ceiling: Option<u32>,
    size: u32,
    skip: u32,
    samples: Vec<f64>,
    /// Per-worker throughput EWMA. Small vectors rather than maps: a job has
    /// tens of workers, and a decision then allocates nothing.
    ewma: Vec<Tracked>,
    replaced: Vec<u64>,
    scratch: Vec<f64>,
}

#[derive(Clone, Copy, Debug)]
struct Tracked {
    id: u64,
    value: f64,
    observations: u32,
}

/// The median of `values` (reordered in place); None when empty.
fn median(values: &mut [f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_unstable_by(f64::total_cmp);
    let mid = values.len() / 2;
    Some(if values.len() % 2 == 1 { values[mid] } else { (values[mid - 1] + values[mid]) / 2.0 })
}

impl Default for Autoscale {
    fn default() -> Self {
        Autoscale {
            threshold: 0.1,
            warmup: 1,
            window: 3,
            drift: 0.3,
            value_per_hour: 1.0e6,
            straggler_ratio: 0.8,
            alpha: 0.1,
            straggler_min_obs: 3,
            measured: Vec::new(),
            ceiling: None,
            size: 0,
            skip: 0,
            samples: Vec::new(),
            ewma: Vec::new(),
            replaced: Vec::new(),
            scratch: Vec::new(),
        }
    }
}

const KEYS: &[&str] = &[
    "threshold",
    "warmup",
    "window",
    "drift",
    "value-per-hour",
    "straggler-ratio",
    "ewma-alpha",
    "straggler-min-obs",
];

impl Autoscale {
    /// True when some worker is below the straggler ratio right now: the
    /// job's throughput is then no measure of its size.
    fn suspect(&mut self, view: &ClusterView) -> bool {
        self.scratch.clear();
        self.scratch.extend(view.workers.iter().map(|w| w.throughput));
        let slowest = self.scratch.iter().copied().fold(f64::INFINITY, f64::min);
        match median(&mut self.scratch) {
            Some(m) if self.scratch.len() >= 2 && m > 0.0 => slowest / m < self.straggler_ratio,
            _ => false,
        }
    }

    /// Updates the per-worker EWMAs; returns the workers to replace.
    fn stragglers(&mut self, view: &ClusterView) -> Vec<u64> {
        let present = |id: u64| view.workers.iter().any(|w| w.id == id);
        self.ewma.retain(|t| present(t.id));
        self.replaced.retain(|&id| present(id));
        for w in &view.workers {
            match self.ewma.iter_mut().find(|t| t.id == w.id) {
                Some(t) => {
                    t.value = self.alpha * w.throughput + (1.0 - self.alpha) * t.value;
                    t.observations += 1;
                }
                None => self.ewma.push(Tracked { id: w.id, value: w.throughput, observations: 1 }),
            }
        }
        if self.ewma.len() < 2 {
            return Vec::new();
        }
        self.scratch.clear();
        self.scratch.extend(self.ewma.iter().map(|t| t.value));
        let median = median(&mut self.scratch).unwrap_or(0.0);
        if median <= 0.0 {
            return Vec::new();
        }
        let mut slow = Vec::new();
        for t in &self.ewma {
            if t.observations >= self.straggler_min_obs
                && t.value / median < self.straggler_ratio
                && !self.replaced.contains(&t.id)
            {
                slow.push(t.id);
            }
        }
        slow.sort_unstable();
        self.replaced.extend_from_slice(&slow);
        slow
    }

    fn measured_at(&self, size: u32) -> Option<f64> {
        self.measured.get(size as usize).copied().flatten()
    }

    /// Hours to finish `remaining` samples at `rate` samples/s.
    fn hours(remaining: u64, rate: f64) -> f64 {
        remaining as f64 / rate.max(1e-9) / 3600.0
    }

    /// True when going from size `k` at `r_k` to `k2` at `r_k2` is worth it.
    fn worth(&self, view: &ClusterView, k: u32, r_k: f64, k2: u32, r_k2: f64) -> bool {
        let (t, t2) = (Self::hours(view.samples_remaining, r_k), Self::hours(view.samples_remaining, r_k2));
        let value = self.value_per_hour * (t - t2);
        let cost = view.price_per_worker_hour * (k2 as f64 * t2 - k as f64 * t);
        value > cost
    }
}

impl ScalingPolicy for Autoscale {
    fn init(&mut self, config: &Config) -> Result<(), PluginError> {
        config.expect_only(KEYS)?;
        let d = Autoscale::default();
        self.threshold = config.get_or("threshold", d.threshold)?;
        self.warmup = config.get_or("warmup", d.warmup)?;
        self.window = config.get_or("window", d.window)?;
        self.drift = config.get_or("drift", d.drift)?;
        self.value_per_hour = config.get_or("value-per-hour", d.value_per_hour)?;
        self.straggler_ratio = config.get_or("straggler-ratio", d.straggler_ratio)?;
        self.alpha = config.get_or("ewma-alpha", d.alpha)?;
        self.straggler_min_obs = config.get_or("straggler-min-obs", d.straggler_min_obs)?;
        if self.window == 0 {
            return Err(PluginError::InvalidConfig("`window` must be at least 1".into()));
        }
        if !(0.0..=1.0).contains(&self.alpha) || self.alpha == 0.0 {
            return Err(PluginError::InvalidConfig("`ewma-alpha` must be in (0, 1]".into()));
        }
        Ok(())
    }

    fn decide(&mut self, view: &ClusterView) -> Vec<Action> {
        let slow = self.stragglers(view);
        if !slow.is_empty() {
            // A replaced worker changes the throughput: measure this size again.
            self.samples.clear();
            self.skip = self.warmup;
            return slow.into_iter().map(Action::Replace).collect();
        }
        if self.suspect(view) {
            // Wait for the EWMA to confirm (or clear) a straggler before measuring.
            self.samples.clear();
            return vec![Action::Hold];
        }

        let k = view.world_size;
        if k != self.size {
            self.size = k;
            self.samples.clear();
            self.skip = self.warmup;
        }
        if self.skip > 0 {
            self.skip -= 1;
            return vec![Action::Hold];
        }
        self.samples.push(view.throughput);
        if self.samples.len() < self.window {
            return vec![Action::Hold];
        }
        let r_k = self.samples.iter().sum::<f64>() / self.samples.len() as f64;
        self.samples.clear();
        if let Some(old) = self.measured_at(k)
            && (r_k - old).abs() > self.drift * old
        {
            // The cluster changed under us (other jobs, slower links): search again.
            self.measured.clear();
            self.ceiling = None;
        }
        if self.measured.len() <= k as usize {
            self.measured.resize(k as usize + 1, None);
        }
        self.measured[k as usize] = Some(r_k);

        if k > view.min_workers.max(1)
            && let Some(r_prev) = self.measured_at(k - 1)
        {
            let efficiency = (r_k - r_prev) / (r_k / k as f64);
            if efficiency <= self.threshold || !self.worth(view, k - 1, r_prev, k, r_k) {
                self.ceiling = Some(k);
                return vec![Action::ScaleIn(1)];
            }
        }

        let below_ceiling = self.ceiling.is_none_or(|c| k + 1 < c);
        if below_ceiling && k < view.max_workers && view.free_slots > 0 {
            // Predict the next size from the last step (linear at first).
            let gain = match self.measured_at(k.saturating_sub(1)) {
                Some(r_prev) if k > 1 => r_k - r_prev,
                _ => r_k / k.max(1) as f64,
            };
            if gain / (r_k / k.max(1) as f64) > self.threshold && self.worth(view, k, r_k, k + 1, r_k + gain)
            {
                return vec![Action::ScaleOut(1)];
            }
        }
        vec![Action::Hold]
    }
}

edl_plugin_sdk::export_scaling_policy!(Autoscale);

#[cfg(test)]
mod tests {
    use super::*;
    use edl_plugin_sdk::testing::{self, SimCluster};

    #[test]
    fn settles_at_the_knee_of_a_saturating_curve() {
        let mut p = testing::policy::<Autoscale>(&[]).unwrap();
        let mut sim = SimCluster::saturating(4, 1, 8);
        let history = sim.run(80, |v| p.decide(v));
        assert_eq!(sim.world_size(), 4, "{history:#?}");
        // It tried 5 once and came back.
        assert_eq!(history.iter().map(|r| r.world_size).max(), Some(5));
        assert!(history[60..].iter().all(|r| r.world_size == 4));
    }

    #[test]
    fn replaces_a_half_speed_worker() {
        let mut p = testing::policy::<Autoscale>(&[]).unwrap();
        let mut sim = SimCluster::saturating(8, 4, 4);
        sim.set_speed(2, 0.5);
        let slow = sim.worker_ids()[2];
        let history = sim.run(10, |v| p.decide(v));
        let replaced: Vec<_> =
            history.iter().flat_map(|r| &r.actions).filter(|a| matches!(a, Action::Replace(_))).collect();
        assert_eq!(replaced, vec![&Action::Replace(slow)]);
        assert!(!sim.worker_ids().contains(&slow));
    }

    #[test]
    fn a_straggler_does_not_move_a_settled_job() {
        let mut p = testing::policy::<Autoscale>(&[]).unwrap();
        let mut sim = SimCluster::saturating(4, 1, 8);
        sim.run(60, |v| p.decide(v));
        assert_eq!(sim.world_size(), 4);
        sim.set_speed(1, 0.5);
        let history = sim.run(30, |v| p.decide(v));
        assert!(history.iter().all(|r| r.world_size == 4), "{history:#?}");
        assert_eq!(
            history.iter().flat_map(|r| &r.actions).filter(|a| matches!(a, Action::Replace(_))).count(),
            1
        );
    }

    #[test]
    fn a_high_price_keeps_the_job_small() {
        let mut p = testing::policy::<Autoscale>(&[("value-per-hour", "1")]).unwrap();
        let mut sim = SimCluster::saturating(4, 1, 8);
        sim.price_per_worker_hour = 100.0;
        sim.run(40, |v| p.decide(v));
        assert_eq!(sim.world_size(), 1);
    }

    #[test]
    fn rejects_unknown_and_bad_config() {
        assert!(matches!(
            testing::policy::<Autoscale>(&[("treshold", "0.2")]),
            Err(PluginError::InvalidConfig(m)) if m.contains("treshold")
        ));
        assert!(testing::policy::<Autoscale>(&[("window", "0")]).is_err());
        assert!(testing::policy::<Autoscale>(&[("threshold", "x")]).is_err());
    }
}
