//! Batch size and learning-rate adaptation on resize (Lin et al., "Dynamic
//! Mini-batch SGD for Elastic Distributed Training", 2019).
//!
//! Mode `ramp` (default) keeps the local batch, so the global batch changes by
//! k = new / old workers. The learning rate moves to `lr x f(k)` (f = k for
//! `lr-scaling=linear`, sqrt(k) for `sqrt`, 1 for `none`), but over T =
//! `ramp-steps` steps, because the momentum buffer still holds gradients taken
//! at the old rate: gamma_t = 1 + (t - t0) / T (f - 1), lr_t = lr_0 gamma_t.
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

#[derive(Clone, Copy, Debug)]
struct Ramp {
    start: u64,
    base_lr: f32,
    factor: f32,
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
        let gamma = 1.0 + t / self.ramp_steps as f32 * (ramp.factor - 1.0);
        ramp.base_lr * gamma
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
        let (old, new) = (event.old_world_size.max(1), event.new_world_size.max(1));
        match self.mode {
            Mode::FixedGlobal => Hyperparams { local_batch: (current.global_batch / new).max(1), ..*current },
            Mode::Ramp => {
                let k = new as f32 / old as f32;
                let factor = match self.scaling {
                    Scaling::Linear => k,
                    Scaling::Sqrt => k.sqrt(),
                    Scaling::None => 1.0,
                };
                // A resize during a ramp starts from where the ramp had got to.
                let base_lr = match &self.ramp {
                    Some(r) => self.lr_at(r, event.step),
                    None => current.lr,
                };
                self.ramp = Some(Ramp { start: event.step, base_lr, factor });
                Hyperparams { global_batch: current.local_batch * new, lr: base_lr, ..*current }
            }
        }
    }

    fn on_step(&mut self, step: u64, current: &Hyperparams) -> Hyperparams {
        let Some(ramp) = self.ramp else { return *current };
        let lr = self.lr_at(&ramp, step);
        if step >= ramp.start + self.ramp_steps {
            self.ramp = None;
        }
        Hyperparams { lr, ..*current }
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
