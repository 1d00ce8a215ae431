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
//! Stragglers: a worker is replaced (the runtime starts the replacement before
//! removing it) only on evidence that persists, and only when a replacement
//! can be faster. At each decision every worker's reading is divided by the
//! median reading of that decision, so a slowdown that all workers share
//! (another job on the machine) cancels out. A worker is a straggler when
//!
//! - its relative speed was below `straggler-ratio` at each of the last
//!   `straggler-persist` decisions (one reading at or above resets the count),
//!   and
//! - its smoothed relative speed (EWMA with `ewma-alpha`, starting at 1: a new
//!   worker is presumed as fast as the others) is below the ratio too, so a
//!   short run of dips among typical readings is not enough, and the milder
//!   the lag the longer it must last (at the defaults a half-speed worker is
//!   replaced at its 5th slow decision), and
//! - it has been observed at least `straggler-min-obs` times.
//!
//! Even then it is not replaced when
//!
//! - the job has outgrown what the cluster gives it: the per-worker throughput
//!   at this world size (upper median, which one straggler cannot pull down;
//!   averaged over the decisions at that size) has been below the ratio x the
//!   best seen at a smaller size for `straggler-persist` decisions in a row.
//!   Workers then share devices or cores (or each pays an overhead that grows
//!   with the world), their differences come from that sharing, and a new
//!   worker would share them as well: the size search (scaling in) is the
//!   remedy, not a replacement. The view carries no host or device layout, so
//!   this is read from the throughputs;
//! - it was itself started as a replacement and has not yet passed a full
//!   persistence window at speed (at least `straggler-persist` readings, the
//!   last one and the smoothed speed at or above the ratio): a replacement
//!   as slow as the worker it replaced shows that the slowness is in where
//!   workers run, not in the worker, so it is kept;
//! - another replacement was asked for fewer than `straggler-cooldown`
//!   decisions ago; at most one worker is replaced per decision.
//!
//! While a worker that may still be replaced is below the ratio, the job's
//! throughput is no measure of its size and that decision's sample is left
//! out; a slowness that will not lead to a replacement is part of what the
//! size delivers and is measured.
//!
//! Configuration (`key=value`, defaults in brackets): `threshold` [0.1],
//! `warmup` decisions after a resize [1], `window` samples per size [3, at
//! least 1], `drift` [0.3], `value-per-hour` [1e6], `straggler-ratio` [0.8,
//! in [0, 1); 0 never replaces], `straggler-persist` consecutive decisions
//! [3, at least 1], `straggler-cooldown` decisions between two replacements
//! [10], `straggler-min-obs` [3], `ewma-alpha` [0.1, in (0, 1]].
//!
//! Warm spares, with `spare-losses-per-hour` (the members the job expects
//! to lose an hour; unset, the job keeps `--warm-spares`): one spare is
//! kept while what it saves is worth its price. A spare saves each loss
//! the time a worker takes from its start to ready (`ready-secs`, measured
//! in the job), at the value of what that loss stops: the whole job's
//! time (`value-per-hour`) when it takes the job below its minimum (the
//! job waits for a worker), one worker's share of it otherwise (the job
//! goes on one short). With the loss rate the larger of the expected one
//! and the job's own (members lost / hours trained), a spare is kept when
//! rate x ready hours x value lost per hour >= its price per hour. Spares
//! kept (by the rule or `--warm-spares`) stay, as many as they are, until
//! they save less than half their price and ten minutes have passed since
//! the spares last changed, so that a world moving about its minimum does
//! not start and stop them. Until a worker was ready nothing is known of
//! the time saved, and the spares are left as they are.

use edl_plugin_sdk::{Action, ClusterView, Config, PluginError, ScalingPolicy, SpareView};
use serde::{Deserialize, Serialize};

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
    straggler_persist: u32,
    straggler_cooldown: u32,
    /// Members expected lost an hour: the spare rule is on when set.
    spare_losses_per_hour: Option<f64>,
    /// What it learned of the job so far: handed over to a new instance.
    mem: Memory,
    scratch: Vec<f64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
struct Tracked {
    id: u64,
    /// Smoothed speed relative to the median (1 = typical).
    relative: f64,
    /// The last reading relative to that decision's median.
    last: f64,
    observations: u32,
    /// Consecutive decisions below the straggler ratio.
    below: u32,
    /// Started in place of a straggler and not yet seen to be faster.
    replacement: bool,
    /// A replacement was asked for; the runtime keeps it until that one joins.
    replaced: bool,
}

/// The median and the upper median (the higher middle value) of `values`
/// (reordered in place); None when empty.
fn middle(values: &mut [f64]) -> Option<(f64, f64)> {
    if values.is_empty() {
        return None;
    }
    values.sort_unstable_by(f64::total_cmp);
    let mid = values.len() / 2;
    let median = if values.len() % 2 == 1 { values[mid] } else { (values[mid - 1] + values[mid]) / 2.0 };
    Some((median, values[mid]))
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
            straggler_persist: 3,
            straggler_cooldown: 10,
            spare_losses_per_hour: None,
            mem: Memory::default(),
            scratch: Vec::new(),
        }
    }
}

/// Seconds after a change of the spares before the rule lets them go.
const SPARE_SETTLE_SECS: f64 = 600.0;

const KEYS: &[&str] = &[
    "spare-losses-per-hour",
    "threshold",
    "warmup",
    "window",
    "drift",
    "value-per-hour",
    "straggler-ratio",
    "ewma-alpha",
    "straggler-min-obs",
    "straggler-persist",
    "straggler-cooldown",
];

impl Autoscale {
    /// True when a worker that may still be replaced is below the straggler
    /// ratio right now: the job's throughput is then no measure of its size.
    /// Slowness that will not lead to a replacement (a contended size, a slow
    /// replacement) is what this size delivers, so it does not count; were
    /// it to, such a job would never be measured and never scale in.
    fn lagging(&self) -> bool {
        // A worker already asked to be replaced no longer holds the
        // measurement back: if its replacement never comes, the size search
        // must not wait for it forever (the replacement's arrival starts the
        // size's measurement again anyway).
        !self.mem.contended
            && self.mem.tracked.iter().any(|t| t.last < self.straggler_ratio && !t.replacement && !t.replaced)
    }

    /// Records what one worker gets at world size `k`: the mean of the
    /// readings until there are 1/alpha of them, an EWMA after, so a size
    /// visited for a few decisions is not judged by its first reading.
    fn record_share(&mut self, k: u32, per_worker: f64) {
        if self.mem.share.len() <= k as usize {
            self.mem.share.resize(k as usize + 1, (0.0, 0));
        }
        let (value, n) = &mut self.mem.share[k as usize];
        *n = n.saturating_add(1);
        let weight = self.alpha.max(1.0 / *n as f64);
        *value = weight * per_worker + (1.0 - weight) * *value;
    }

    /// True when each worker at size `k` gets less than the straggler ratio
    /// x what one got at the best smaller size: workers then share devices
    /// or cores (or pay a per-worker overhead), a cause no replacement removes.
    fn outgrown_at(&self, k: u32) -> bool {
        let Some(&(now, _)) = self.mem.share.get(k as usize).filter(|s| s.1 > 0) else { return false };
        let best =
            self.mem.share.iter().take(k as usize).filter(|s| s.1 > 0).map(|s| s.0).fold(0.0, f64::max);
        now < self.straggler_ratio * best
    }

    /// Updates the per-worker evidence; returns the worker to replace, if any.
    fn straggler(&mut self, view: &ClusterView) -> Option<u64> {
        self.mem.cooldown = self.mem.cooldown.saturating_sub(1);
        let present = |id: u64| view.workers.iter().any(|w| w.id == id);
        self.mem.tracked.retain(|t| present(t.id));
        self.scratch.clear();
        self.scratch.extend(view.workers.iter().map(|w| w.throughput));
        let (median, upper) = middle(&mut self.scratch)?;
        self.record_share(view.world_size, upper);
        self.mem.outgrown =
            if self.outgrown_at(view.world_size) { self.mem.outgrown.saturating_add(1) } else { 0 };
        self.mem.contended = self.mem.outgrown >= self.straggler_persist;

        let (ratio, alpha, persist) = (self.straggler_ratio, self.alpha, self.straggler_persist);
        for w in &view.workers {
            let t = match self.mem.tracked.iter().position(|t| t.id == w.id) {
                Some(i) => &mut self.mem.tracked[i],
                None => {
                    // The first workers to appear after a Replace are taken
                    // for its replacements. A worker from a scale-out that was
                    // still starting may be taken instead; it then only has to
                    // show a full window at speed before it can be replaced.
                    let replacement = self.mem.awaiting > 0;
                    self.mem.awaiting -= u32::from(replacement);
                    self.mem.tracked.push(Tracked {
                        id: w.id,
                        relative: 1.0,
                        last: 1.0,
                        observations: 0,
                        below: 0,
                        replacement,
                        replaced: false,
                    });
                    self.mem.tracked.last_mut().expect("just pushed")
                }
            };
            if median <= 0.0 {
                // Nothing is moving: no evidence either way.
                continue;
            }
            let rel = w.throughput / median;
            t.last = rel;
            t.relative = alpha * rel + (1.0 - alpha) * t.relative;
            t.observations = t.observations.saturating_add(1);
            t.below = if rel < ratio { t.below.saturating_add(1) } else { 0 };
            if t.replacement && t.observations >= persist && t.below == 0 && t.relative >= ratio {
                // A full window at speed: an ordinary worker from now on.
                t.replacement = false;
            }
        }

        if view.workers.len() < 2 || median <= 0.0 || self.mem.contended || self.mem.cooldown > 0 {
            return None;
        }
        let min_obs = self.straggler_min_obs;
        let slowest = self
            .mem
            .tracked
            .iter_mut()
            .filter(|t| {
                t.observations >= min_obs
                    && t.below >= persist
                    && t.relative < ratio
                    && !t.replacement
                    && !t.replaced
            })
            .min_by(|a, b| a.relative.total_cmp(&b.relative).then(a.id.cmp(&b.id)))?;
        slowest.replaced = true;
        let id = slowest.id;
        self.mem.awaiting += 1;
        // Counted down at the start of each decision: two replacements are at
        // least `straggler-cooldown` decisions apart.
        self.mem.cooldown = self.straggler_cooldown;
        Some(id)
    }

    fn measured_at(&self, size: u32) -> Option<f64> {
        self.mem.measured.get(size as usize).copied().flatten()
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

/// The policy's memory between decisions (what `init` does not set): the
/// size search, the straggler evidence and the per-worker shares, so that a
/// coordinator taking the job over decides as this one would have.
#[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
struct Memory {
    /// Settled throughput per world size (index = size).
    measured: Vec<Option<f64>>,
    /// Smallest size found not worth it.
    ceiling: Option<u32>,
    size: u32,
    skip: u32,
    samples: Vec<f64>,
    /// Per-worker straggler evidence. Small vectors rather than maps: a job
    /// has tens of workers, and a decision then allocates nothing.
    tracked: Vec<Tracked>,
    /// Per-worker throughput (upper median) per world size (index = size),
    /// smoothed, and the number of readings behind it: what one worker gets
    /// when that many share the cluster. Kept when the search restarts: a
    /// drift is often a straggler's doing, and a stale value errs towards not
    /// replacing.
    share: Vec<(f64, u32)>,
    /// Consecutive decisions whose size gave each worker less than the ratio
    /// x what a smaller size did.
    outgrown: u32,
    /// True once that has lasted `straggler-persist` decisions: the evidence
    /// that excuses a slow worker persists as long as the one that condemns it.
    contended: bool,
    /// Replacements asked for whose new worker has not been seen yet: the
    /// next new workers are those replacements.
    awaiting: u32,
    /// Decisions left before another replacement may be asked for.
    cooldown: u32,
}

impl ScalingPolicy for Autoscale {
    fn save_state(&self) -> Vec<u8> {
        // Plain numbers and vectors: serialising them cannot fail.
        serde_json::to_vec(&self.mem).unwrap_or_default()
    }

    fn load_state(&mut self, state: &[u8]) -> Result<(), PluginError> {
        self.mem = serde_json::from_slice(state)
            .map_err(|e| PluginError::InvalidInput(format!("not the autoscale policy's memory: {e}")))?;
        Ok(())
    }

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
        self.straggler_persist = config.get_or("straggler-persist", d.straggler_persist)?;
        self.straggler_cooldown = config.get_or("straggler-cooldown", d.straggler_cooldown)?;
        self.spare_losses_per_hour = match config.raw("spare-losses-per-hour") {
            None => None,
            Some(v) => Some(v.trim().parse::<f64>().ok().filter(|r| r.is_finite() && *r >= 0.0).ok_or_else(
                || {
                    PluginError::InvalidConfig(format!(
                        "`spare-losses-per-hour` = {v:?}: expected a number >= 0"
                    ))
                },
            )?),
        };
        if self.window == 0 {
            return Err(PluginError::InvalidConfig("`window` must be at least 1".into()));
        }
        if !(0.0..=1.0).contains(&self.alpha) || self.alpha == 0.0 {
            return Err(PluginError::InvalidConfig("`ewma-alpha` must be in (0, 1]".into()));
        }
        // At 1 or more every worker at the median would be a straggler.
        if !(0.0..1.0).contains(&self.straggler_ratio) {
            return Err(PluginError::InvalidConfig(format!(
                "`straggler-ratio` must be in [0, 1) (0 never replaces), got {}",
                self.straggler_ratio
            )));
        }
        if self.straggler_persist == 0 {
            return Err(PluginError::InvalidConfig("`straggler-persist` must be at least 1".into()));
        }
        Ok(())
    }

    fn decide_spares(&mut self, view: &SpareView) -> Option<u32> {
        let expected = self.spare_losses_per_hour?;
        if view.ready_secs <= 0.0 {
            return None;
        }
        // The job's own rate, once it has trained a while (an early loss
        // over a few seconds is no rate).
        let seen = if view.hours > 0.1 { view.members_lost as f64 / view.hours } else { 0.0 };
        let rate = expected.max(seen);
        let halts = view.world_size <= view.min_workers;
        let lost_per_hour =
            if halts { self.value_per_hour } else { self.value_per_hour / f64::from(view.world_size.max(1)) };
        let saved_per_hour = rate * view.ready_secs / 3600.0 * lost_per_hour;
        let price = view.price_per_spare_hour;
        if view.spares_wanted > 0 {
            // Kept spares go only once clearly not worth it, and not soon
            // after the last change: a world moving about its minimum
            // does not start and stop them.
            let settled = view.secs_since_change >= SPARE_SETTLE_SECS;
            let keep = saved_per_hour >= price / 2.0 || !settled;
            return Some(if keep { view.spares_wanted } else { 0 });
        }
        Some(u32::from(saved_per_hour >= price))
    }

    fn decide(&mut self, view: &ClusterView) -> Vec<Action> {
        if let Some(id) = self.straggler(view) {
            // A replaced worker changes the throughput: measure this size again.
            self.mem.samples.clear();
            self.mem.skip = self.warmup;
            return vec![Action::Replace(id)];
        }

        let k = view.world_size;
        if k != self.mem.size {
            self.mem.size = k;
            self.mem.samples.clear();
            self.mem.skip = self.warmup;
        }
        if self.mem.skip > 0 {
            self.mem.skip -= 1;
            return vec![Action::Hold];
        }
        if self.lagging() {
            // Leave this sample out until the worker recovers or is replaced;
            // the samples before it were taken at full speed and still count
            // (a noisy worker would otherwise keep emptying the window).
            return vec![Action::Hold];
        }
        self.mem.samples.push(view.throughput);
        if self.mem.samples.len() < self.window {
            return vec![Action::Hold];
        }
        let r_k = self.mem.samples.iter().sum::<f64>() / self.mem.samples.len() as f64;
        self.mem.samples.clear();
        if let Some(old) = self.measured_at(k)
            && (r_k - old).abs() > self.drift * old
        {
            // The cluster changed under us (other jobs, slower links): search again.
            self.mem.measured.clear();
            self.mem.ceiling = None;
        }
        if self.mem.measured.len() <= k as usize {
            self.mem.measured.resize(k as usize + 1, None);
        }
        self.mem.measured[k as usize] = Some(r_k);

        if k > view.min_workers.max(1)
            && let Some(r_prev) = self.measured_at(k - 1)
        {
            let efficiency = (r_k - r_prev) / (r_k / k as f64);
            if efficiency <= self.threshold || !self.worth(view, k - 1, r_prev, k, r_k) {
                self.mem.ceiling = Some(k);
                return vec![Action::ScaleIn(1)];
            }
        }

        let below_ceiling = self.mem.ceiling.is_none_or(|c| k + 1 < c);
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
    use edl_plugin_sdk::testing::{self, SimCluster, SimRecord};

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
    fn a_new_instance_given_the_memory_decides_as_the_old_one_would_have() {
        // A search half done and a straggler under watch: the memory holds
        // both. Clusters in the same place, driven on by the first instance,
        // by a new instance given its memory, and by one without it.
        let mut first = testing::policy::<Autoscale>(&[]).unwrap();
        let mut sim = SimCluster::saturating(5, 1, 8);
        sim.run(9, |v| first.decide(v));
        sim.set_speed(1, 0.5);
        sim.run(2, |v| first.decide(v));
        let (mut twin, mut bare) = (sim.clone(), sim.clone());
        let mut second = testing::policy::<Autoscale>(&[]).unwrap();
        second.load_state(&first.save_state()).unwrap();
        let mut fresh = testing::policy::<Autoscale>(&[]).unwrap();
        let a = sim.run(60, |v| first.decide(v));
        let b = twin.run(60, |v| second.decide(v));
        let c = bare.run(60, |v| fresh.decide(v));
        assert_eq!(a, b);
        assert_ne!(a, c, "the memory made no difference, so this test shows nothing");
        assert!(
            matches!(second.load_state(b"{"), Err(PluginError::InvalidInput(m)) if m.contains("autoscale"))
        );
    }

    #[test]
    fn a_spare_is_kept_while_what_it_saves_is_worth_its_price() {
        let p = |rate: &str| testing::policy::<Autoscale>(&[("spare-losses-per-hour", rate)]).unwrap();
        // 8 workers above a minimum of 2; a worker takes 60 s to be ready;
        // the job's hour is worth 1e6, a spare costs 3 an hour.
        let view = SpareView {
            world_size: 8,
            min_workers: 2,
            max_workers: 12,
            price_per_spare_hour: 3.0,
            ready_secs: 60.0,
            hours: 2.0,
            ..SpareView::default()
        };
        // One worker's share of an hour lost is 125,000: a loss saves
        // 2083 for 60 s, so one loss in ~694 hours pays for the spare.
        assert_eq!(p("0.01").decide_spares(&view), Some(1));
        assert_eq!(p("0.001").decide_spares(&view), Some(0));
        // At its minimum a loss stops the whole job: worth 8x as much.
        let at_min = SpareView { world_size: 2, ..view.clone() };
        assert_eq!(p("0.0003").decide_spares(&at_min), Some(1));
        assert_eq!(p("0.0003").decide_spares(&view), Some(0));
        // The job's own losses count once it has trained a while.
        let lossy = SpareView { members_lost: 1, hours: 200.0, ..view.clone() };
        assert_eq!(p("0").decide_spares(&lossy), Some(1));
        assert_eq!(p("0").decide_spares(&SpareView { hours: 0.05, ..lossy }), Some(0));
        // Kept spares stay until they save less than half their price,
        // ten minutes after the last change; then they go.
        let kept = |saved_rate: &str, secs| {
            let v = SpareView { spares_wanted: 2, secs_since_change: secs, ..view.clone() };
            p(saved_rate).decide_spares(&v)
        };
        assert_eq!(kept("0.002", 900.0), Some(2), "4.2 saved: kept, all of them");
        assert_eq!(kept("0.001", 900.0), Some(2), "2.1 saved: below the price, above half of it");
        assert_eq!(kept("0.0005", 900.0), Some(0), "1.04 saved: under half the price");
        assert_eq!(kept("0.0005", 60.0), Some(2), "too soon after the last change");
        // Nothing known of the time a spare saves yet, or the rule off.
        assert_eq!(p("1").decide_spares(&SpareView { ready_secs: 0.0, ..view.clone() }), None);
        assert_eq!(testing::policy::<Autoscale>(&[]).unwrap().decide_spares(&view), None);
        for bad in ["-1", "x", "inf"] {
            let e = testing::policy::<Autoscale>(&[("spare-losses-per-hour", bad)]).unwrap_err();
            assert!(e.to_string().contains("spare-losses-per-hour"), "{bad}: {e}");
        }
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
        for (key, value) in [
            ("straggler-persist", "0"),
            ("straggler-persist", "x"),
            ("straggler-cooldown", "-1"),
            ("straggler-ratio", "1.5"),
            ("straggler-ratio", "-0.1"),
            ("straggler-ratio", "NaN"),
        ] {
            assert!(
                matches!(
                    testing::policy::<Autoscale>(&[(key, value)]),
                    Err(PluginError::InvalidConfig(m)) if m.contains(key)
                ),
                "{key}={value}"
            );
        }
        assert!(
            testing::policy::<Autoscale>(&[
                ("straggler-persist", "1"),
                ("straggler-cooldown", "0"),
                ("straggler-ratio", "0")
            ])
            .is_ok()
        );
    }

    /// The ids a run asked to replace, in order.
    fn replaced(history: &[SimRecord]) -> Vec<u64> {
        history
            .iter()
            .flat_map(|r| &r.actions)
            .filter_map(|a| match a {
                Action::Replace(id) => Some(*id),
                _ => None,
            })
            .collect()
    }

    /// The decision (index) of each Replace.
    fn replaced_at(history: &[SimRecord]) -> Vec<usize> {
        (0..history.len())
            .filter(|&i| history[i].actions.iter().any(|a| matches!(a, Action::Replace(_))))
            .collect()
    }

    /// Deterministic pseudo-random numbers in [0, 1) from a 64-bit LCG.
    struct Lcg(u64);

    impl Lcg {
        fn next(&mut self) -> f64 {
            self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            (self.0 >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    #[test]
    fn noisy_workers_are_not_replaced() {
        let mut p = testing::policy::<Autoscale>(&[]).unwrap();
        let mut sim = SimCluster::saturating(4, 1, 4);
        // A fixed seed, so the run is the same every time; the assertions
        // after it check that this noise has the features the test is about.
        let mut rng = Lcg(1);
        // Per worker id: consecutive readings below the ratio x the median.
        let mut run = vec![0u32; 256];
        let (mut dips, mut longest) = (0, 0);
        // Workers seen among others, and those whose first such reading was a dip.
        let (mut judged, mut first_dips) = (vec![false; 256], 0);
        let mut decide = |v: &ClusterView| {
            let mut v = v.clone();
            for w in &mut v.workers {
                // Mostly within 15% of the rate; one reading in six far below it.
                let f =
                    if rng.next() < 1.0 / 6.0 { 0.5 + 0.25 * rng.next() } else { 0.85 + 0.3 * rng.next() };
                w.throughput *= f;
            }
            let mut readings: Vec<f64> = v.workers.iter().map(|w| w.throughput).collect();
            let (median, _) = middle(&mut readings).unwrap();
            for w in v.workers.iter().filter(|_| v.workers.len() > 1) {
                let r = &mut run[w.id as usize];
                *r = if w.throughput < 0.8 * median { *r + 1 } else { 0 };
                dips += u32::from(*r > 0);
                longest = longest.max(*r);
                if !std::mem::replace(&mut judged[w.id as usize], true) {
                    first_dips += u32::from(*r > 0);
                }
            }
            let actions = p.decide(&v);
            assert!(!p.mem.contended, "the noise alone must not look like an outgrown machine");
            actions
        };
        // The cluster takes two devices back now and then and returns them,
        // so the job keeps starting fresh workers, whose first readings are
        // as noisy as any.
        let mut history = Vec::new();
        for round in 0..12 {
            history.extend(sim.run(25, &mut decide));
            sim.set_capacity(if round % 2 == 0 { 2 } else { 4 });
        }
        assert_eq!(replaced(&history), Vec::<u64>::new());
        // The noise dips below the ratio often, now and then for a whole
        // persistence window, and on some fresh worker's first reading (a
        // record started from that reading would take it for a trend).
        assert!(
            dips > 50 && longest >= 3 && first_dips >= 1,
            "{dips} dips, longest run {longest}, {first_dips} first"
        );
    }

    #[test]
    fn a_slowdown_every_worker_shares_replaces_none() {
        let mut p = testing::policy::<Autoscale>(&[]).unwrap();
        // A machine with two workers' worth of cores: past 2, workers share it.
        let mut sim = SimCluster::saturating(2, 2, 4);
        let mut history = sim.run(20, |v| p.decide(v));
        assert_eq!(sim.world_size(), 2);
        // Four workers are kept on it: each gets half of what one got, the
        // two that joined from their first reading, the others from now on.
        sim.min_workers = 4;
        sim.apply(&[Action::ScaleOut(2)]);
        history.extend(sim.run(30, |v| p.decide(v)));
        // Then another job takes 40% of the machine from all of them at once.
        sim.curve.iter_mut().for_each(|c| *c *= 0.6);
        history.extend(sim.run(30, |v| p.decide(v)));
        assert!(history[20..].iter().all(|r| r.world_size == 4));
        assert_eq!(replaced(&history), Vec::<u64>::new());
    }

    #[test]
    fn a_lagging_worker_on_an_outgrown_machine_is_not_replaced() {
        let mut p = testing::policy::<Autoscale>(&[]).unwrap();
        let mut sim = SimCluster::saturating(2, 2, 4);
        let mut history = sim.run(20, |v| p.decide(v));
        // Four workers on two workers' worth of cores, one of them persistently
        // getting less of it than the others: the spread is the sharing.
        sim.min_workers = 4;
        sim.apply(&[Action::ScaleOut(2)]);
        sim.set_speed(3, 0.6);
        history.extend(sim.run(40, |v| p.decide(v)));
        assert!(p.mem.contended);
        assert_eq!(replaced(&history), Vec::<u64>::new());
    }

    #[test]
    fn a_persistent_straggler_is_replaced_once_and_a_slow_replacement_is_kept() {
        let mut p = testing::policy::<Autoscale>(&[]).unwrap();
        let mut sim = SimCluster::saturating(8, 4, 4);
        sim.set_speed(2, 0.5);
        let slow = sim.worker_ids()[2];
        let mut history = sim.run(5, |v| p.decide(v));
        // Judged on its 5th slow decision: 3 below the ratio in a row, and
        // the smoothed speed (from 1) below it as well.
        assert_eq!(replaced_at(&history), vec![4]);
        assert_eq!(replaced(&history), vec![slow]);
        assert!(!sim.worker_ids().contains(&slow));
        // The replacement runs where the slow worker ran, and is as slow:
        // replacing it again would not be faster.
        sim.set_speed(3, 0.5);
        history.extend(sim.run(60, |v| p.decide(v)));
        assert_eq!(replaced(&history), vec![slow]);
        assert_eq!(sim.world_size(), 4);
    }

    #[test]
    fn a_replacement_at_speed_becomes_an_ordinary_worker() {
        let mut p = testing::policy::<Autoscale>(&[]).unwrap();
        let mut sim = SimCluster::saturating(8, 4, 4);
        sim.set_speed(2, 0.5);
        let mut history = sim.run(20, |v| p.decide(v));
        assert_eq!(replaced(&history).len(), 1);
        let replacement = *sim.worker_ids().last().unwrap();
        assert!(p.mem.tracked.iter().any(|t| t.id == replacement && !t.replacement));
        // Its device degrades later: then it is a straggler like any other.
        sim.set_speed(3, 0.5);
        history.extend(sim.run(20, |v| p.decide(v)));
        assert_eq!(replaced(&history)[1..], [replacement]);
    }

    #[test]
    fn replacements_are_spaced_by_the_cooldown() {
        let mut p = testing::policy::<Autoscale>(&[]).unwrap();
        let mut sim = SimCluster::saturating(8, 6, 6);
        sim.set_speed(1, 0.5);
        sim.set_speed(4, 0.5);
        let ids = sim.worker_ids();
        let history = sim.run(30, |v| p.decide(v));
        assert_eq!(replaced(&history), vec![ids[1], ids[4]]);
        let at = replaced_at(&history);
        assert_eq!(at[1] - at[0], 10, "{at:?}");
    }

    #[test]
    fn straggler_keys_take_effect() {
        let half_speed = |config: &[(&str, &str)]| {
            let mut p = testing::policy::<Autoscale>(config).unwrap();
            let mut sim = SimCluster::saturating(8, 4, 4);
            sim.set_speed(2, 0.5);
            replaced_at(&sim.run(30, |v| p.decide(v)))
        };
        assert_eq!(half_speed(&[]), vec![4]);
        assert_eq!(half_speed(&[("straggler-persist", "8")]), vec![7]);
        assert_eq!(half_speed(&[("straggler-ratio", "0")]), Vec::<usize>::new());
    }
}
