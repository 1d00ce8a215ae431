//! The EDL demo job server's heuristic: every `every` steps, scale out by
//! `by` workers until the maximum, then in by `by` until the minimum, and so on.
//! With `servers` (`STEP:N,STEP:N,...`), the job's parameter servers follow
//! a schedule too: N servers from each STEP on; with `spares` (the same
//! form, N from 0), the job's warm spares do.

use edl_plugin_sdk::{Action, ClusterView, Config, PluginError, ScalingPolicy, ServerView, SpareView};

#[derive(Debug)]
pub struct Schedule {
    every: u64,
    by: u32,
    growing: bool,
    next_step: Option<u64>,
    /// From each step on, this many parameter servers (in step order).
    servers: Vec<(u64, u32)>,
    /// From each step on, this many warm spares (in step order).
    spares: Vec<(u64, u32)>,
}

impl Default for Schedule {
    fn default() -> Self {
        Schedule {
            every: 100,
            by: 1,
            growing: true,
            next_step: None,
            servers: Vec::new(),
            spares: Vec::new(),
        }
    }
}

/// `key`'s `STEP:N,STEP:N,...`, in step order, each N at least `least`.
fn schedule(key: &str, text: &str, least: u32) -> Result<Vec<(u64, u32)>, PluginError> {
    let bad = |what: &str| PluginError::InvalidConfig(format!("`{key}` = {text:?}: {what}"));
    let mut out: Vec<(u64, u32)> = Vec::new();
    for entry in text.split(',').filter(|e| !e.trim().is_empty()) {
        let (step, n) = entry.split_once(':').ok_or_else(|| bad("expected STEP:N entries"))?;
        let step: u64 = step.trim().parse().map_err(|_| bad("a step is not a whole number"))?;
        let n: u32 = n.trim().parse().ok().filter(|n| *n >= least).ok_or_else(|| {
            bad(if least > 0 { "N is not a positive number" } else { "N is not a whole number" })
        })?;
        if out.last().is_some_and(|(s, _)| *s >= step) {
            return Err(bad("the steps must increase"));
        }
        out.push((step, n));
    }
    Ok(out)
}

impl ScalingPolicy for Schedule {
    fn init(&mut self, config: &Config) -> Result<(), PluginError> {
        config.expect_only(&["every", "by", "start", "servers", "spares"])?;
        self.servers = schedule("servers", config.raw("servers").unwrap_or(""), 1)?;
        self.spares = schedule("spares", config.raw("spares").unwrap_or(""), 0)?;
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

    fn decide_servers(&mut self, view: &ServerView) -> Option<u32> {
        due(&self.servers, view.step)
    }

    fn decide_spares(&mut self, view: &SpareView) -> Option<u32> {
        due(&self.spares, view.step)
    }
}

/// What a schedule says at `step`; None before its first entry.
fn due(schedule: &[(u64, u32)], step: u64) -> Option<u32> {
    schedule.iter().rev().find(|(from, _)| *from <= step).map(|(_, n)| *n)
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
    fn the_servers_follow_their_schedule_and_are_left_be_before_it() {
        let mut p = testing::policy::<Schedule>(&[("servers", "100:3,200:2")]).unwrap();
        let at = |step| ServerView { step, ..ServerView::default() };
        let asked: Vec<Option<u32>> = [0, 99, 100, 150, 200, 900].map(|s| p.decide_servers(&at(s))).to_vec();
        assert_eq!(asked, [None, None, Some(3), Some(3), Some(2), Some(2)]);
        let mut quiet = testing::policy::<Schedule>(&[]).unwrap();
        assert_eq!(quiet.decide_servers(&at(500)), None, "no schedule: the job's own rule");
        for bad in ["100", "100:0", "x:2", "200:2,100:3"] {
            assert!(testing::policy::<Schedule>(&[("servers", bad)]).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_spares_follow_their_schedule_down_to_none() {
        let mut p = testing::policy::<Schedule>(&[("spares", "0:1,50:2,90:0")]).unwrap();
        let at = |step| SpareView { step, ..SpareView::default() };
        let asked: Vec<Option<u32>> = [0, 49, 50, 89, 90, 900].map(|s| p.decide_spares(&at(s))).to_vec();
        assert_eq!(asked, [Some(1), Some(1), Some(2), Some(2), Some(0), Some(0)]);
        let mut quiet = testing::policy::<Schedule>(&[]).unwrap();
        assert_eq!(quiet.decide_spares(&at(500)), None, "no schedule: --warm-spares");
        for bad in ["5", "x:1", "9:1,3:0", "1:-1"] {
            let e = testing::policy::<Schedule>(&[("spares", bad)]).unwrap_err();
            assert!(e.to_string().contains("`spares`"), "{bad}: {e}");
        }
    }

    #[test]
    fn rejects_bad_config() {
        assert!(testing::policy::<Schedule>(&[("every", "0")]).is_err());
        assert!(testing::policy::<Schedule>(&[("start", "sideways")]).is_err());
        assert!(testing::policy::<Schedule>(&[("speed", "1")]).is_err());
    }
}
