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

    // The endless loop is the point of this plugin.
    #[allow(clippy::while_immutable_condition)]
    fn decide(&mut self, view: &ClusterView) -> Vec<Action> {
        // Spin only on even steps so a test can see the next call succeed.
        let mut x = view.step;
        while self.spin && view.step.is_multiple_of(2) {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        std::hint::black_box(x);
        vec![Action::Hold]
    }
}

edl_plugin_sdk::export_scaling_policy!(Spin);
