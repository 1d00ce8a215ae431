//! A policy that panics with a known message on step 13 and counts its calls
//! otherwise (so a test can see the instance rebuilt after the trap).

use edl_plugin_sdk::{Action, ClusterView, ScalingPolicy};

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
}

edl_plugin_sdk::export_scaling_policy!(Panicky);
