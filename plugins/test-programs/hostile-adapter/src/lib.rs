//! A batch adapter that answers out-of-range hyperparameters from step
//! `from` on (`mode=nan-lr|inf-lr|zero-lr|momentum|batch0|huge-batch`); on
//! resize it passes the current values through.

use edl_plugin_sdk::{BatchAdapter, Config, Hyperparams, PluginError, ResizeEvent};

#[derive(Default)]
pub struct Hostile {
    mode: String,
    from: u64,
}

impl BatchAdapter for Hostile {
    fn init(&mut self, config: &Config) -> Result<(), PluginError> {
        config.expect_only(&["mode", "from"])?;
        self.mode = config.get_or("mode", "nan-lr".to_string())?;
        self.from = config.get_or("from", 3u64)?;
        Ok(())
    }

    fn on_resize(&mut self, _event: &ResizeEvent, current: &Hyperparams) -> Hyperparams {
        *current
    }

    fn on_step(&mut self, step: u64, current: &Hyperparams) -> Hyperparams {
        let mut h = *current;
        if step < self.from {
            return h;
        }
        match self.mode.as_str() {
            "nan-lr" => h.lr = f32::NAN,
            "inf-lr" => h.lr = f32::INFINITY,
            "zero-lr" => h.lr = 0.0,
            "momentum" => h.momentum = 1.5,
            "batch0" => h.global_batch = 0,
            "huge-batch" => {
                h.global_batch = 1_000_000_000;
                h.local_batch = 1_000_000_000;
            }
            _ => {}
        }
        h
    }
}

edl_plugin_sdk::export_batch_adapter!(Hostile);
