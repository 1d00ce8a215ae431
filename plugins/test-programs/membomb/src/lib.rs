//! A policy that allocates without bound on odd steps (the runtime's memory
//! cap must stop it) and holds on even ones.

use edl_plugin_sdk::{Action, ClusterView, ScalingPolicy};

#[derive(Default)]
pub struct MemBomb {
    hoard: Vec<Vec<u8>>,
}

impl ScalingPolicy for MemBomb {
    // Allocating until stopped is the point of this plugin.
    #[allow(clippy::while_immutable_condition)]
    fn decide(&mut self, view: &ClusterView) -> Vec<Action> {
        while !view.step.is_multiple_of(2) {
            let mut chunk = vec![0u8; 1 << 20];
            chunk[0] = 1;
            self.hoard.push(std::hint::black_box(chunk));
        }
        vec![Action::Hold]
    }
}

edl_plugin_sdk::export_scaling_policy!(MemBomb);
