//! A scaling policy that misbehaves on demand (`mode=...`):
//!
//! - `flood`: 10,000 `scale-out(1)` in one decision;
//! - `sleep-init` / `sleep-decide`: sleeps `ms` (default an hour) in `init` or `decide`;
//! - `replace`: replaces the first worker it sees measured, once;
//! - `recurse`: recurses with a 4 KiB frame until the guest's stack runs out;
//! - `clock`: reads the monotonic clock (a host import) `calls` times per
//!   decision, then holds (what one import call costs, for the benchmarks);
//! - `hold`: holds (the control).
//!
//! Whatever the mode, it counts its decisions and hands the count over as
//! its memory (a new instance given it goes on counting).

use edl_plugin_sdk::{Action, ClusterView, Config, PluginError, ScalingPolicy};
use std::time::Duration;

#[derive(Default)]
pub struct Hostile {
    mode: String,
    sleep: Duration,
    replaced: bool,
    calls: u32,
    decisions: u64,
}

impl ScalingPolicy for Hostile {
    fn init(&mut self, config: &Config) -> Result<(), PluginError> {
        config.expect_only(&["mode", "ms", "calls"])?;
        self.calls = config.get_or("calls", 0u32)?;
        self.mode = config.get_or("mode", "hold".to_string())?;
        self.sleep = Duration::from_millis(config.get_or("ms", 3_600_000u64)?);
        if self.mode == "sleep-init" {
            std::thread::sleep(self.sleep);
        }
        Ok(())
    }

    fn save_state(&self) -> Vec<u8> {
        self.decisions.to_le_bytes().to_vec()
    }

    fn load_state(&mut self, state: &[u8]) -> Result<(), PluginError> {
        let count = state.try_into().map_err(|_| PluginError::InvalidInput("not a decision count".into()))?;
        self.decisions = u64::from_le_bytes(count);
        Ok(())
    }

    fn decide(&mut self, view: &ClusterView) -> Vec<Action> {
        self.decisions += 1;
        match self.mode.as_str() {
            "flood" => vec![Action::ScaleOut(1); 10_000],
            "sleep-decide" => {
                std::thread::sleep(self.sleep);
                vec![Action::Hold]
            }
            "recurse" => vec![Action::ScaleOut(deep(u32::MAX) as u32)],
            "clock" => {
                for _ in 0..self.calls {
                    std::hint::black_box(std::time::Instant::now());
                }
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

/// Unbounded recursion whose frames live on the guest's stack in linear memory.
#[inline(never)]
fn deep(n: u32) -> u64 {
    let frame = std::hint::black_box([n as u8; 4096]);
    if n == 0 {
        return frame[0] as u64;
    }
    deep(std::hint::black_box(n - 1)) + frame[(n % 4096) as usize] as u64
}

edl_plugin_sdk::export_scaling_policy!(Hostile);
