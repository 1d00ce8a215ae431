//! A policy that panics with a known message on step 13 and counts its calls
//! otherwise (so a test can see the instance rebuilt after the trap). The
//! count is its memory: a rebuilt instance given it goes on counting.

use edl_plugin_sdk::{Action, ClusterView, PluginError, ScalingPolicy};

#[derive(Default)]
pub struct Panicky {
    calls: u32,
}

impl ScalingPolicy for Panicky {
    fn decide(&mut self, view: &ClusterView) -> Vec<Action> {
        if view.step == 13 {
            eprintln!("about to fail on step {}", view.step);
            panic!("unlucky step {}", view.step);
        }
        self.calls += 1;
        vec![Action::ScaleOut(self.calls)]
    }

    fn save_state(&self) -> Vec<u8> {
        self.calls.to_le_bytes().to_vec()
    }

    fn load_state(&mut self, state: &[u8]) -> Result<(), PluginError> {
        match <[u8; 4]>::try_from(state) {
            Ok(bytes) => self.calls = u32::from_le_bytes(bytes),
            // Another plugin's memory (a hot reload from one without any).
            Err(_) if state.is_empty() => {}
            Err(_) => return Err(PluginError::InvalidInput(format!("{} bytes, not a count", state.len()))),
        }
        Ok(())
    }
}

edl_plugin_sdk::export_scaling_policy!(Panicky);
