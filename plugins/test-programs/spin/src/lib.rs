//! A policy that never returns from `decide` once `spin=true` (the runtime's
//! per-call deadline must stop it), and holds otherwise.

use edl_plugin_sdk::{Action, ClusterView, Config, PluginError, ScalingPolicy};

#[derive(Default)]
pub struct Spin {
    spin: bool,
}

impl ScalingPolicy for Spin {
    fn init(&mut self, config: &Config) -> Result<(), PluginError> {
        config.expect_only(&["spin"])?;
        self.spin = config.get_or("spin", true)?;
        Ok(())
    }

    fn decide(&mut self, view: &ClusterView) -> Vec<Action> {
        // Spin only on even steps so a test can see the next call succeed.
        let mut x = view.step;
        while self.spin && view.step % 2 == 0 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        vec![Action::Hold; (x % 1 + 1) as usize]
    }
}

edl_plugin_sdk::export_scaling_policy!(Spin);
