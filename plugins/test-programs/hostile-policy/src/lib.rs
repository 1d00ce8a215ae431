//! A scaling policy that misbehaves on demand (`mode=...`):
//!
//! - `flood`: 10,000 `scale-out(1)` in one decision;
//! - `sleep-init` / `sleep-decide`: sleeps `ms` (default an hour) in `init` or `decide`;
//! - `replace`: replaces the first worker it sees measured, once;
//! - `hold`: holds (the control).

use edl_plugin_sdk::{Action, ClusterView, Config, PluginError, ScalingPolicy};
use std::time::Duration;

#[derive(Default)]
pub struct Hostile {
    mode: String,
    sleep: Duration,
    replaced: bool,
}

impl ScalingPolicy for Hostile {
    fn init(&mut self, config: &Config) -> Result<(), PluginError> {
        config.expect_only(&["mode", "ms"])?;
        self.mode = config.get_or("mode", "hold".to_string())?;
        self.sleep = Duration::from_millis(config.get_or("ms", 3_600_000u64)?);
        if self.mode == "sleep-init" {
            std::thread::sleep(self.sleep);
        }
        Ok(())
    }

    fn decide(&mut self, view: &ClusterView) -> Vec<Action> {
        match self.mode.as_str() {
            "flood" => vec![Action::ScaleOut(1); 10_000],
            "sleep-decide" => {
                std::thread::sleep(self.sleep);
                vec![Action::Hold]
            }
            "replace" if !self.replaced => match view.workers.first() {
                Some(w) => {
                    self.replaced = true;
                    vec![Action::Replace(w.id), Action::Replace(w.id)]
                }
                None => vec![Action::Hold],
            },
            _ => vec![Action::Hold],
        }
    }
}

edl_plugin_sdk::export_scaling_policy!(Hostile);
