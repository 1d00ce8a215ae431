//! Batch size and learning-rate adaptation on resize (Lin et al., "Dynamic
//! Mini-batch SGD for Elastic Distributed Training", 2019).
//!
//! Mode `ramp` (default) keeps the local batch, so the global batch changes by
//! k = new / old workers. The learning rate moves to `lr x f(k)` (f = k for
//! `lr-scaling=linear`, sqrt(k) for `sqrt`, 1 for `none`), but over T =
//! `ramp-steps` steps, because the momentum buffer still holds gradients taken
//! at the old rate: gamma_t = 1 + (t - t0) / T (f - 1), lr_t = lr_0 gamma_t.
//! A resize during a ramp ramps from the rate reached towards the rate the
//! ramp was going to, times the new f: the rate stays the same function of
//! the world whatever the order and spacing of resizes (1 -> 2 -> 4 -> 1
//! workers ends at the rate of 1).
//!
//! Mode `fixed-global` keeps the global batch (local = global / world) and the
//! learning rate.

use edl_plugin_sdk::{BatchAdapter, Config, Hyperparams, PluginError, ResizeEvent};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Ramp,
    FixedGlobal,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Scaling {
    Linear,
    Sqrt,
    None,
}

/// A ramp of the rate from `from` at step `start` to `to`.
#[derive(Clone, Copy, Debug)]
struct Ramp {
    start: u64,
    from: f32,
    to: f32,
}

#[derive(Debug)]
pub struct DynamicBatch {
    mode: Mode,
    scaling: Scaling,
    ramp_steps: u64,
    ramp: Option<Ramp>,
}

impl Default for DynamicBatch {
    fn default() -> Self {
        DynamicBatch { mode: Mode::Ramp, scaling: Scaling::Linear, ramp_steps: 8, ramp: None }
    }
}

impl DynamicBatch {
    fn lr_at(&self, ramp: &Ramp, step: u64) -> f32 {
        let t = step.saturating_sub(ramp.start).min(self.ramp_steps) as f32;
        ramp.from + t / self.ramp_steps as f32 * (ramp.to - ramp.from)
    }
}

impl BatchAdapter for DynamicBatch {
    fn init(&mut self, config: &Config) -> Result<(), PluginError> {
        config.expect_only(&["mode", "lr-scaling", "ramp-steps"])?;
        self.mode = match config.raw("mode").unwrap_or("ramp") {
            "ramp" => Mode::Ramp,
            "fixed-global" => Mode::FixedGlobal,
            m => {
                return Err(PluginError::InvalidConfig(format!(
                    "`mode` = {m:?}: expected \"ramp\" or \"fixed-global\""
                )));
            }
        };
        self.scaling = match config.raw("lr-scaling").unwrap_or("linear") {
            "linear" => Scaling::Linear,
            "sqrt" => Scaling::Sqrt,
            "none" => Scaling::None,
            s => {
                return Err(PluginError::InvalidConfig(format!(
                    "`lr-scaling` = {s:?}: expected \"linear\", \"sqrt\" or \"none\""
                )));
            }
        };
        self.ramp_steps = config.get_or("ramp-steps", 8)?;
        if self.ramp_steps == 0 {
            return Err(PluginError::InvalidConfig("`ramp-steps` must be at least 1".into()));
        }
        Ok(())
    }

    fn on_resize(&mut self, event: &ResizeEvent, current: &Hyperparams) -> Hyperparams {
        let (old, new) = (event.old_world_size, event.new_world_size.max(1));
        if old == 0 {
            // The job starts (or starts again from a checkpoint that does
            // not say its world): its batch and rate as they are, shared by the world it starts with; a
            // ramp of before it is over.
            self.ramp = None;
            return Hyperparams { local_batch: current.global_batch.div_ceil(new), ..*current };
        }
        match self.mode {
            Mode::FixedGlobal => Hyperparams { local_batch: (current.global_batch / new).max(1), ..*current },
            Mode::Ramp => {
                let k = new as f32 / old as f32;
                let factor = match self.scaling {
                    Scaling::Linear => k,
                    Scaling::Sqrt => k.sqrt(),
                    Scaling::None => 1.0,
                };
                // A resize during a ramp starts from where the ramp had got
                // to, towards where it was going times the new factor.
                let (from, to) = match &self.ramp {
                    Some(r) => (self.lr_at(r, event.step), r.to),
                    None => (current.lr, current.lr),
                };
                self.ramp = Some(Ramp { start: event.step, from, to: to * factor });
                Hyperparams { global_batch: current.local_batch * new, lr: from, ..*current }
            }
        }
    }

    /// The ramp's rate at `step`. The ramp is kept once it ends: steps are
    /// planned ahead, and a generation that fails before committing them
    /// plans them again, so the next resize builds on where the ramp was
    /// going, not on a step that was never committed.
    fn on_step(&mut self, step: u64, current: &Hyperparams) -> Hyperparams {
        let Some(ramp) = self.ramp else { return *current };
        Hyperparams { lr: self.lr_at(&ramp, step), ..*current }
    }

    /// The ramp (its start, and its rates from and to), so that a
    /// coordinator taking the job over goes on with it.
    fn save_state(&self) -> Vec<u8> {
        let Some(r) = self.ramp else { return Vec::new() };
        [&r.start.to_le_bytes()[..], &r.from.to_le_bytes(), &r.to.to_le_bytes()].concat()
    }

    fn load_state(&mut self, state: &[u8]) -> Result<(), PluginError> {
        self.ramp = match state.len() {
            0 => None,
            16 => {
                let f32_at =
                    |i: usize| f32::from_le_bytes([state[i], state[i + 1], state[i + 2], state[i + 3]]);
                let mut start = [0u8; 8];
                start.copy_from_slice(&state[..8]);
                Some(Ramp { start: u64::from_le_bytes(start), from: f32_at(8), to: f32_at(12) })
            }
            n => {
                return Err(PluginError::InvalidInput(format!(
                    "{n} bytes: not dynamic-batch's memory (a ramp is 16 bytes)"
                )));
            }
        };
        Ok(())
    }
}

edl_plugin_sdk::export_batch_adapter!(DynamicBatch);

#[cfg(test)]
mod tests {
    use super::*;
    use edl_plugin_sdk::testing;

    fn hp() -> Hyperparams {
        Hyperparams { global_batch: 128, local_batch: 64, lr: 0.1, momentum: 0.9 }
    }

    #[test]
    fn ramps_lr_over_eight_steps_from_two_to_four_workers() {
        let mut a = testing::adapter::<DynamicBatch>(&[]).unwrap();
        let mut cur = a.on_resize(&ResizeEvent { step: 100, old_world_size: 2, new_world_size: 4 }, &hp());
        assert_eq!((cur.global_batch, cur.local_batch), (256, 64));
        let mut lrs = Vec::new();
        for step in 100..=110 {
            cur = a.on_step(step, &cur);
            lrs.push(cur.lr);
        }
        let want = [0.1, 0.1125, 0.125, 0.1375, 0.15, 0.1625, 0.175, 0.1875, 0.2, 0.2, 0.2];
        for (got, want) in lrs.iter().zip(want) {
            assert!((got - want).abs() < 1e-6, "{lrs:?}");
        }
    }

    #[test]
    fn resizes_during_a_ramp_end_at_the_rate_of_the_world_they_end_in() {
        let mut a = testing::adapter::<DynamicBatch>(&[]).unwrap();
        let one = Hyperparams { global_batch: 64, local_batch: 64, lr: 0.05, momentum: 0.9 };
        // 1 -> 2 -> 4 -> 3 -> 2 -> 1 workers, each 4 steps after the last
        // (half a ramp), then long enough for the last ramp to end.
        let worlds = [1, 2, 4, 3, 2, 1];
        let mut cur = one;
        for (i, w) in worlds.windows(2).enumerate() {
            let step = 100 + 4 * i as u64;
            cur = a.on_step(step, &cur);
            cur = a.on_resize(&ResizeEvent { step, old_world_size: w[0], new_world_size: w[1] }, &cur);
            assert_eq!(cur.global_batch, 64 * w[1]);
            cur.local_batch = 64;
        }
        for step in 120..140 {
            cur = a.on_step(step, &cur);
        }
        assert!((cur.lr - 0.05).abs() < 1e-6, "{}", cur.lr);
        assert_eq!(cur.global_batch, 64);
    }

    #[test]
    fn a_restart_ends_the_ramp_and_its_memory_goes_on_with_a_successor() {
        let mut a = testing::adapter::<DynamicBatch>(&[]).unwrap();
        let cur = a.on_resize(&ResizeEvent { step: 104, old_world_size: 2, new_world_size: 4 }, &hp());
        // A successor given the memory mid-ramp goes on with it.
        let mut b = testing::adapter::<DynamicBatch>(&[]).unwrap();
        b.load_state(&a.save_state()).unwrap();
        assert_eq!(b.on_step(108, &cur).lr, a.on_step(108, &cur).lr);
        assert!(b.load_state(&[1, 2, 3]).is_err());
        // The job starts again from a checkpoint that does not say its
        // world (old world 0): at its rate then; the ramp of before is over.
        let again = a.on_resize(&ResizeEvent { step: 100, old_world_size: 0, new_world_size: 1 }, &hp());
        assert_eq!(a.on_step(112, &again).lr, 0.1);
    }

    #[test]
    fn a_job_starting_on_several_workers_keeps_its_own_batch_and_rate() {
        let mut a = testing::adapter::<DynamicBatch>(&[]).unwrap();
        let start = ResizeEvent { step: 0, old_world_size: 0, new_world_size: 2 };
        let cur = a.on_resize(&start, &hp());
        assert_eq!((cur.global_batch, cur.local_batch, cur.lr), (128, 64, 0.1));
        assert_eq!(a.on_step(8, &cur).lr, 0.1);
    }

    #[test]
    fn sqrt_scaling_and_fixed_global_mode() {
        let mut a = testing::adapter::<DynamicBatch>(&[("lr-scaling", "sqrt")]).unwrap();
        let cur = a.on_resize(&ResizeEvent { step: 0, old_world_size: 1, new_world_size: 4 }, &hp());
        assert!((a.on_step(8, &cur).lr - 0.2).abs() < 1e-6);

        let mut f = testing::adapter::<DynamicBatch>(&[("mode", "fixed-global")]).unwrap();
        let cur = f.on_resize(&ResizeEvent { step: 0, old_world_size: 2, new_world_size: 4 }, &hp());
        assert_eq!((cur.global_batch, cur.local_batch, cur.lr), (128, 32, 0.1));
    }

    #[test]
    fn rejects_bad_config() {
        assert!(testing::adapter::<DynamicBatch>(&[("mode", "turbo")]).is_err());
        assert!(testing::adapter::<DynamicBatch>(&[("ramp-steps", "0")]).is_err());
    }
}
