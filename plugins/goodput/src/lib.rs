//! The global batch and learning rate that maximise goodput (Pollux, Qiao
//! et al., OSDI'21): throughput times statistical efficiency.
//!
//! After each decision of the scaling policy the host tells the adapter the
//! gradient noise scale `phi` and the step times it measured at each (world
//! size, global batch). For a global batch `M` on the current `N` workers:
//!
//! - statistical efficiency `E(M) = (phi + M0) / (phi + M)`, against the
//!   job's own batch `M0` (`--batch`): the progress a sample makes;
//! - step time `T(M) = alpha + beta * M / N`, fitted to the step times
//!   measured at `N` workers (a least-squares line through two batches or
//!   more; through one, `overhead` of it taken as fixed);
//! - goodput `G(M) = M / T(M) * E(M)`.
//!
//! The adapter moves to the `M` of the largest goodput among `M0 * 2^(k/4)`
//! up to `--batch-max` (a multiple of `N`) and at most `growth` (2) times the
//! largest batch measured, when it beats the current one by `min-gain`; the learning rate follows AdaScale's gain
//! `r = (phi / M0 + 1) / (phi / M + 1)` (`lr-rule=adascale`, for SGD), or the
//! square-root rule (`sqrt`, for Adam), or the linear one (`linear`).
//! Until the noise scale is measured (by a program, once two workers share
//! a step; by the built-in trainer on one CPU worker too), it keeps
//! the batch it has; where only one batch was measured at the current world
//! size, it measures twice that batch once (`probe=false`: it does not, and
//! takes `overhead` of the one measured step time as fixed).

use edl_plugin_sdk::{BatchAdapter, Config, Hyperparams, PluginError, ResizeEvent, TrainingStats};
use goodput_model::GROWTH;
pub use goodput_model::{StepModel, candidates, efficiency, goodput, measured_batches, reach};

/// How the learning rate follows the batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LrRule {
    AdaScale,
    Sqrt,
    Linear,
}

#[derive(Debug)]
pub struct Goodput {
    rule: LrRule,
    /// Share of a step's time taken as fixed when one batch was measured.
    overhead: f64,
    /// Smallest relative gain in goodput worth a change of batch.
    min_gain: f64,
    /// How far past the largest batch measured a choice may go (a factor).
    growth: f64,
    /// Measure twice the batch once where only one batch was measured, and
    /// the (world size, batch) probed.
    probe: bool,
    probed: Option<(u32, u32)>,
    /// What the host told last, and whether the next step should act on it.
    stats: Option<TrainingStats>,
    fresh: bool,
}

impl Default for Goodput {
    fn default() -> Self {
        Goodput {
            rule: LrRule::AdaScale,
            overhead: 0.3,
            min_gain: 0.05,
            growth: GROWTH,
            probe: true,
            probed: None,
            stats: None,
            fresh: false,
        }
    }
}

impl Goodput {
    /// The learning rate for batch `m`.
    pub fn lr(&self, stats: &TrainingStats, m: u32) -> f32 {
        let (phi, base) = (stats.noise_scale, f64::from(stats.base_batch.max(1)));
        let scale = f64::from(m) / base;
        let gain = match self.rule {
            LrRule::AdaScale => (phi / base + 1.0) / (phi / f64::from(m.max(1)) + 1.0),
            LrRule::Sqrt => scale.sqrt(),
            LrRule::Linear => scale,
        };
        (f64::from(stats.base_lr) * gain) as f32
    }

    /// The hyperparameters for `world` workers now at `current`: the
    /// batch of the largest goodput (None: keep `current`).
    pub fn choose(
        &mut self,
        stats: &TrainingStats,
        world: u32,
        current: &Hyperparams,
    ) -> Option<Hyperparams> {
        let phi = stats.noise_scale;
        if !(phi.is_finite() && phi > 0.0) || stats.base_batch == 0 {
            return None;
        }
        let base = stats.base_batch;
        let now = current.global_batch;
        if self.probe && measured_batches(stats, world) < 2 {
            // One batch measured here: how much of a step is fixed cost is a
            // guess until another is. Measure twice the batch, once a world
            // size: until it is measured, wait for it.
            let measured =
                |b: u32| stats.step_times.iter().any(|t| (t.world_size, t.global_batch) == (world, b));
            match self.probed {
                Some((w, b)) if w == world && !measured(b) => return None,
                Some((w, _)) if w == world => {}
                _ => {
                    let higher = candidates(base, stats.max_batch, world)
                        .into_iter()
                        .find(|&m| m >= now.saturating_mul(2));
                    if let Some(probe) = higher {
                        self.probed = Some((world, probe));
                        return Some(self.hyper(stats, probe, world, current));
                    }
                }
            }
        }
        let model = StepModel::fit(stats, world, self.overhead)?;
        let of = |m: u32| goodput(&model, phi, base, m, world);
        let within = reach(stats, self.growth, stats.max_batch);
        let best = candidates(base, within, world).into_iter().max_by(|a, b| of(*a).total_cmp(&of(*b)))?;
        if best == now || of(best) < of(now) * (1.0 + self.min_gain) {
            return None;
        }
        Some(self.hyper(stats, best, world, current))
    }

    fn hyper(&self, stats: &TrainingStats, m: u32, world: u32, current: &Hyperparams) -> Hyperparams {
        Hyperparams {
            global_batch: m,
            local_batch: m.div_ceil(world.max(1)),
            lr: self.lr(stats, m),
            momentum: current.momentum,
        }
    }
}

impl BatchAdapter for Goodput {
    fn init(&mut self, config: &Config) -> Result<(), PluginError> {
        config.expect_only(&["lr-rule", "overhead", "min-gain", "probe", "growth"])?;
        self.probe = config.get_or("probe", true)?;
        self.rule = match config.raw("lr-rule").unwrap_or("adascale") {
            "adascale" => LrRule::AdaScale,
            "sqrt" => LrRule::Sqrt,
            "linear" => LrRule::Linear,
            other => {
                return Err(PluginError::InvalidConfig(format!(
                    "lr-rule {other:?}: expected adascale, sqrt or linear"
                )));
            }
        };
        self.overhead = config.get_or("overhead", 0.3)?;
        if !(0.0..1.0).contains(&self.overhead) {
            return Err(PluginError::InvalidConfig(format!(
                "overhead {}: need 0 <= overhead < 1",
                self.overhead
            )));
        }
        self.min_gain = config.get_or("min-gain", 0.05)?;
        if self.min_gain.is_nan() || self.min_gain < 0.0 {
            return Err(PluginError::InvalidConfig(format!("min-gain {}: need 0 or more", self.min_gain)));
        }
        self.growth = config.get_or("growth", GROWTH)?;
        if self.growth.is_nan() || self.growth <= 1.0 {
            return Err(PluginError::InvalidConfig(format!(
                "growth {}: need more than 1 (inf: no bound)",
                self.growth
            )));
        }
        Ok(())
    }

    fn on_training(&mut self, stats: &TrainingStats) {
        self.stats = Some(stats.clone());
        self.fresh = true;
    }

    fn on_resize(&mut self, event: &ResizeEvent, current: &Hyperparams) -> Hyperparams {
        let world = event.new_world_size.max(1);
        // Chosen for the new world now; the next step does not choose again
        // for the world the measures were taken in.
        self.fresh = false;
        let stats = self.stats.take();
        let chosen = stats.as_ref().and_then(|s| self.choose(s, world, current));
        self.stats = stats.map(|s| TrainingStats { world_size: world, ..s });
        let mut h = chosen.unwrap_or(*current);
        h.local_batch = h.global_batch.div_ceil(world);
        h
    }

    fn on_step(&mut self, _step: u64, current: &Hyperparams) -> Hyperparams {
        if !std::mem::take(&mut self.fresh) {
            return *current;
        }
        let Some(stats) = self.stats.take() else { return *current };
        let chosen = self.choose(&stats, stats.world_size.max(1), current);
        self.stats = Some(stats);
        chosen.unwrap_or(*current)
    }
}

edl_plugin_sdk::export_batch_adapter!(Goodput);

#[cfg(test)]
mod tests {
    use super::*;
    use edl_plugin_sdk::StepTime;

    fn stats(phi: f64, times: &[(u32, u32, f64)]) -> TrainingStats {
        TrainingStats {
            step: 100,
            world_size: 2,
            noise_scale: phi,
            base_batch: 64,
            base_lr: 0.05,
            max_batch: 1024,
            throughput: 0.0,
            step_times: times
                .iter()
                .map(|&(world_size, global_batch, secs)| StepTime {
                    world_size,
                    global_batch,
                    secs,
                    steps: 8,
                })
                .collect(),
        }
    }

    const NOW: Hyperparams = Hyperparams { global_batch: 64, local_batch: 32, lr: 0.05, momentum: 0.9 };

    #[test]
    fn a_noisy_gradient_and_a_step_of_fixed_costs_take_a_larger_batch_and_scale_the_rate() {
        // 20 ms a step, 16 of them fixed (two batches measured); noise scale 2000.
        let s = stats(2000.0, &[(2, 64, 0.020), (2, 128, 0.024)]);
        let mut g = Goodput::default();
        let h = g.choose(&s, 2, &NOW).expect("a larger batch");
        assert!(h.global_batch >= 256, "{h:?}");
        assert_eq!(h.local_batch, h.global_batch / 2);
        // AdaScale's gain: between 1 and the batch's ratio.
        let r = (2000.0 / 64.0 + 1.0) / (2000.0 / f64::from(h.global_batch) + 1.0);
        assert!((f64::from(h.lr) - 0.05 * r).abs() < 1e-6, "{h:?} against a gain of {r}");
        assert!(h.lr > 0.05 && f64::from(h.lr) < 0.05 * f64::from(h.global_batch) / 64.0);
    }

    #[test]
    fn a_compute_bound_step_or_a_small_noise_scale_keeps_the_batch() {
        // Twice the batch, twice the time: no throughput to gain.
        let bound = stats(2000.0, &[(2, 64, 0.020), (2, 128, 0.040)]);
        assert_eq!(Goodput::default().choose(&bound, 2, &NOW), None);
        // Fixed costs, but the noise scale is far below the batch: each
        // sample of a larger one is worth much less.
        let quiet = stats(8.0, &[(2, 64, 0.020), (2, 128, 0.024)]);
        assert_eq!(Goodput::default().choose(&quiet, 2, &NOW), None);
        // Not measured yet: keep (not even a probe).
        assert_eq!(Goodput::default().choose(&stats(0.0, &[(2, 64, 0.02)]), 2, &NOW), None);
    }

    #[test]
    fn one_batch_measured_is_followed_by_twice_that_batch_once() {
        let s = stats(100.0, &[(2, 64, 0.020)]);
        let h = Goodput::default().choose(&s, 2, &NOW).unwrap();
        assert_eq!((h.global_batch, h.local_batch), (128, 64));
        // Without probing: the one time split by `overhead` (0.3): a
        // batch of 128 takes 1.7 times as long, for 0.78 of the progress a sample.
        let mut no_probe = Goodput { probe: false, ..Goodput::default() };
        assert_eq!(no_probe.choose(&s, 2, &NOW), None);
    }

    #[test]
    fn a_probe_is_waited_for_not_repeated_and_a_bound_below_the_workers_chooses_nothing() {
        let mut g = Goodput::default();
        let s = stats(100.0, &[(2, 64, 0.020)]);
        assert_eq!(g.choose(&s, 2, &NOW).map(|h| h.global_batch), Some(128));
        // Told again before the probe's batch was measured: it waits.
        let at_probe = Hyperparams { global_batch: 128, local_batch: 64, ..NOW };
        assert_eq!(g.choose(&s, 2, &at_probe), None);
        // Measured: the model decides (here: 256 beats 128 by far).
        let both = stats(100.0, &[(2, 64, 0.020), (2, 128, 0.021)]);
        assert!(g.choose(&both, 2, &at_probe).is_some_and(|h| h.global_batch > 128));
        // 16 workers, a bound of 8 rows: no batch fits.
        let mut few = stats(100.0, &[(16, 8, 0.02)]);
        (few.base_batch, few.max_batch) = (8, 8);
        assert!(candidates(8, 8, 16).is_empty());
        assert_eq!(Goodput::default().choose(&few, 16, &Hyperparams { global_batch: 8, ..NOW }), None);
        // An infinite noise scale is not a measure.
        assert_eq!(Goodput::default().choose(&stats(f64::INFINITY, &[(2, 64, 0.02)]), 2, &NOW), None);
    }

    #[test]
    fn after_a_resize_the_next_step_keeps_what_the_resize_chose() {
        let mut g = Goodput::default();
        g.on_training(&stats(2000.0, &[(2, 64, 0.020), (2, 128, 0.024)]));
        let ev = ResizeEvent { step: 100, old_world_size: 2, new_world_size: 1 };
        let h = g.on_resize(&ev, &NOW);
        assert_eq!(g.on_step(101, &h), h, "the step does not choose again for two workers");
    }

    #[test]
    fn the_batch_stays_within_its_bound_and_a_multiple_of_the_workers() {
        let mut s = stats(1e6, &[(3, 96, 0.020), (3, 192, 0.021)]);
        s.base_batch = 96;
        s.max_batch = 300;
        let h = Goodput::default().choose(&s, 3, &Hyperparams { global_batch: 96, ..NOW }).unwrap();
        assert!(h.global_batch <= 300 && h.global_batch % 3 == 0, "{h:?}");
        assert_eq!(candidates(64, 64, 2), [64]);
        assert_eq!(candidates(64, 256, 2), [64, 76, 90, 108, 128, 152, 180, 214, 256]);
    }

    #[test]
    fn a_choice_goes_at_most_twice_past_the_largest_batch_measured() {
        // Steps almost all fixed cost and a large noise scale: the model
        // favours the largest batch, 1024, from measures at 64 and 128.
        let s = stats(2000.0, &[(2, 64, 0.020), (2, 128, 0.0201)]);
        let at = |growth: f64, now: u32| {
            let mut g = Goodput { growth, ..Goodput::default() };
            g.choose(&s, 2, &Hyperparams { global_batch: now, local_batch: now / 2, ..NOW })
        };
        let h = at(GROWTH, 128).expect("a larger batch");
        assert_eq!((h.global_batch, h.local_batch), (256, 128), "twice the largest measured");
        assert_eq!(at(f64::INFINITY, 128).map(|h| h.global_batch), Some(1024), "unbounded");
        // A batch measured at another world size counts too, and the bound
        // never passes --batch-max.
        let far = stats(2000.0, &[(2, 64, 0.020), (2, 128, 0.0201), (4, 768, 0.021)]);
        assert_eq!(reach(&far, GROWTH, 1024), 1024);
        assert_eq!(reach(&far, 1.0, 1024), 768);
        assert_eq!(reach(&stats(1.0, &[]), GROWTH, 1024), 1024, "nothing measured: the bound alone");
        // Configured: a growth of 1 or less is refused, by name.
        let mut g = Goodput::default();
        let e = g.init(&Config::from_pairs(&[("growth", "1")])).unwrap_err();
        assert!(e.to_string().contains("growth"), "{e}");
    }

    #[test]
    fn the_step_model_fits_a_line_through_two_batches_or_splits_one() {
        let m = StepModel::fit(&stats(1.0, &[(2, 64, 0.020), (2, 128, 0.024)]), 2, 0.3).unwrap();
        assert!((m.alpha - 0.016).abs() < 1e-9 && (m.beta - 0.004 / 32.0).abs() < 1e-12, "{m:?}");
        let one = StepModel::fit(&stats(1.0, &[(4, 64, 0.010)]), 2, 0.3).unwrap();
        assert!((one.alpha - 0.003).abs() < 1e-12, "the nearest world's, split: {one:?}");
        assert_eq!(StepModel::fit(&stats(1.0, &[]), 2, 0.3), None);
    }

    #[test]
    fn the_rules_scale_the_rate_as_named() {
        let s = stats(640.0, &[]);
        let rate = |rule| Goodput { rule, ..Goodput::default() }.lr(&s, 256);
        assert!((rate(LrRule::Linear) - 0.2).abs() < 1e-6);
        assert!((rate(LrRule::Sqrt) - 0.1).abs() < 1e-6);
        // (640/64 + 1) / (640/256 + 1) = 11 / 3.5.
        assert!((f64::from(rate(LrRule::AdaScale)) - 0.05 * 11.0 / 3.5).abs() < 1e-6);
    }

    #[test]
    fn a_resize_rechooses_for_the_new_world_and_splits_the_batch() {
        let mut g = Goodput::default();
        g.on_training(&stats(2000.0, &[(2, 64, 0.020), (2, 128, 0.024)]));
        let ev = ResizeEvent { step: 100, old_world_size: 2, new_world_size: 4 };
        let h = g.on_resize(&ev, &NOW);
        assert_eq!(h.local_batch, h.global_batch.div_ceil(4));
        assert!(h.global_batch > 64, "{h:?}");
        // Told nothing: a resize only splits the batch anew.
        let h = Goodput::default().on_resize(&ev, &NOW);
        assert_eq!((h.global_batch, h.local_batch), (64, 16));
    }
}
