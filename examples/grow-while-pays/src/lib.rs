//! A scaling policy written from scratch with edl-plugin-sdk (the walk-through
//! in examples/README.md builds it step by step): add one worker at a time
//! while the last one added at least `min-gain` of a worker's throughput;
//! when one did not, take it back and settle.

use edl_plugin_sdk::{Action, ClusterView, Config, PluginError, ScalingPolicy};

#[derive(Default)]
pub struct GrowWhilePays {
    min_gain: f64,
    /// World size and throughput seen at the previous decision.
    last: Option<(u32, f64)>,
    settled: bool,
}

impl ScalingPolicy for GrowWhilePays {
    fn init(&mut self, config: &Config) -> Result<(), PluginError> {
        config.expect_only(&["min-gain"])?;
        self.min_gain = config.get_or("min-gain", 0.5)?;
        Ok(())
    }

    fn decide(&mut self, view: &ClusterView) -> Vec<Action> {
        let k = view.world_size;
        if self.settled {
            return vec![Action::Hold];
        }
        if let Some((prev_k, prev_throughput)) = self.last
            && k > prev_k
        {
            // Throughput the new workers added, in units of one worker's share before.
            let gain = (view.throughput - prev_throughput) / (prev_throughput / prev_k as f64);
            if gain < self.min_gain * (k - prev_k) as f64 {
                self.settled = true;
                return vec![Action::ScaleIn(k - prev_k)];
            }
        }
        self.last = Some((k, view.throughput));
        if k < view.max_workers && view.free_slots > 0 {
            vec![Action::ScaleOut(1)]
        } else {
            self.settled = true;
            vec![Action::Hold]
        }
    }
}

edl_plugin_sdk::export_scaling_policy!(GrowWhilePays);

#[cfg(test)]
mod tests {
    use super::*;
    use edl_plugin_sdk::testing::{self, SimCluster};

    #[test]
    fn settles_where_the_next_worker_stops_paying() {
        let mut policy = testing::policy::<GrowWhilePays>(&[]).unwrap();
        let mut cluster = SimCluster::saturating(4, 1, 8);
        cluster.run(20, |view| policy.decide(view));
        assert_eq!(cluster.world_size(), 4);
    }

    #[test]
    fn rejects_unknown_keys() {
        assert!(testing::policy::<GrowWhilePays>(&[("min_gain", "1")]).is_err());
    }
}
