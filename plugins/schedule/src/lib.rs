//! The EDL demo job server's heuristic: every `every` steps, scale out by
//! `by` workers until the maximum, then in by `by` until the minimum, and so on.

use edl_plugin_sdk::{Action, ClusterView, Config, PluginError, ScalingPolicy};

#[derive(Debug)]
pub struct Schedule {
    every: u64,
    by: u32,
    growing: bool,
    next_step: Option<u64>,
}

impl Default for Schedule {
    fn default() -> Self {
        Schedule { every: 100, by: 1, growing: true, next_step: None }
    }
}

impl ScalingPolicy for Schedule {
    fn init(&mut self, config: &Config) -> Result<(), PluginError> {
        config.expect_only(&["every", "by", "start"])?;
        self.every = config.get_or("every", 100)?;
        self.by = config.get_or("by", 1)?;
        self.growing = match config.raw("start").unwrap_or("out") {
            "out" => true,
            "in" => false,
            other => {
                return Err(PluginError::InvalidConfig(format!(
                    "`start` = {other:?}: expected \"out\" or \"in\""
                )));
            }
        };
        if self.every == 0 || self.by == 0 {
            return Err(PluginError::InvalidConfig("`every` and `by` must be at least 1".into()));
        }
        Ok(())
    }

    fn decide(&mut self, view: &ClusterView) -> Vec<Action> {
        let next = *self.next_step.get_or_insert(view.step + self.every);
        if view.step < next {
            return vec![Action::Hold];
        }
        self.next_step = Some(view.step + self.every);
        let (lo, hi) = (view.min_workers.max(1), view.max_workers);
        let ws = view.world_size;
        if self.growing && ws >= hi {
            self.growing = false;
        } else if !self.growing && ws <= lo {
            self.growing = true;
        }
        let n = if self.growing {
            self.by.min(hi.saturating_sub(ws)).min(view.free_slots)
        } else {
            self.by.min(ws.saturating_sub(lo))
        };
        match (n, self.growing) {
            (0, _) => vec![Action::Hold],
            (n, true) => vec![Action::ScaleOut(n)],
            (n, false) => vec![Action::ScaleIn(n)],
        }
    }
}

edl_plugin_sdk::export_scaling_policy!(Schedule);

#[cfg(test)]
mod tests {
    use super::*;
    use edl_plugin_sdk::testing::{self, SimCluster};

    #[test]
    fn bounces_between_the_limits() {
        let mut p = testing::policy::<Schedule>(&[("every", "40"), ("by", "2")]).unwrap();
        let mut sim = SimCluster::saturating(8, 1, 6);
        let sizes: Vec<u32> = sim.run(16, |v| p.decide(v)).iter().map(|r| r.world_size).collect();
        // One decision every 20 steps, a change every 40 steps.
        assert_eq!(sizes, vec![1, 1, 3, 3, 5, 5, 6, 6, 4, 4, 2, 2, 1, 1, 3, 3]);
    }

    #[test]
    fn rejects_bad_config() {
        assert!(testing::policy::<Schedule>(&[("every", "0")]).is_err());
        assert!(testing::policy::<Schedule>(&[("start", "sideways")]).is_err());
        assert!(testing::policy::<Schedule>(&[("speed", "1")]).is_err());
    }
}
