//! The four kinds of plugin, one trait per WIT world. They sit apart from
//! the export macros of the crate root so that the C ABI of [`crate::native`]
//! can call them while the macros call that ABI.

use crate::{
    Action, Batch, ClusterView, Config, Hyperparams, PluginError, ResizeEvent, ServerView, SpareView,
    TeacherPlan, TeacherView, TrainingStats,
};

/// Decides how many workers the job should have (WIT world `scaling-policy`).
pub trait ScalingPolicy: Default + 'static {
    /// Reads the configuration; the default accepts none.
    fn init(&mut self, config: &Config) -> Result<(), PluginError> {
        config.expect_only(&[])
    }

    /// Called on a fixed cadence with the job's current state.
    fn decide(&mut self, view: &ClusterView) -> Vec<Action>;

    /// What the host measured of the training, just before each
    /// `decide` (see [`BatchAdapter::on_training`]); the default ignores
    /// it. Components only: a native policy is not told.
    fn on_training(&mut self, stats: &TrainingStats) {
        let _ = stats;
    }

    /// The parameter servers the job should have, asked just after each
    /// `decide` in jobs with servers, or None to leave them to the job's own
    /// rule (one more when a server passes 80% of its memory bound). The
    /// host keeps the answer within `min_servers..=max_servers`. The
    /// default: None. Components only: a native policy is not asked.
    fn decide_servers(&mut self, view: &ServerView) -> Option<u32> {
        let _ = view;
        None
    }

    /// The warm spares the job should keep, asked just after each `decide`
    /// (after [`decide_servers`](Self::decide_servers)), or None to keep
    /// them as they are (`--warm-spares`). The view says what the spares
    /// cost and what they were used for. The host keeps the answer below
    /// `max_workers`; surplus spares are stopped. The default: None.
    fn decide_spares(&mut self, view: &SpareView) -> Option<u32> {
        let _ = view;
        None
    }

    /// The policy's memory between decisions, as bytes [`load_state`](Self::load_state)
    /// reads back. The host stores it at every commit, so that a standby
    /// coordinator taking the job over, a resume from a checkpoint and a hot
    /// reload go on from it instead of from a fresh `init`. The default:
    /// no memory.
    fn save_state(&self) -> Vec<u8> {
        Vec::new()
    }

    /// Called after `init` on a new instance with what `save_state` gave
    /// (possibly an older version's). The default ignores it.
    fn load_state(&mut self, state: &[u8]) -> Result<(), PluginError> {
        let _ = state;
        Ok(())
    }
}

/// Adapts batch size, learning rate and momentum (WIT world `batch-adapter`).
pub trait BatchAdapter: Default + 'static {
    /// Reads the configuration; the default accepts none.
    fn init(&mut self, config: &Config) -> Result<(), PluginError> {
        config.expect_only(&[])
    }

    /// Called once when the world size changes, before the first step of the new size.
    fn on_resize(&mut self, event: &ResizeEvent, current: &Hyperparams) -> Hyperparams;

    /// Called before every step; the default keeps the settings.
    fn on_step(&mut self, step: u64, current: &Hyperparams) -> Hyperparams {
        let _ = step;
        *current
    }

    /// What the host measured of the training (the gradient noise scale,
    /// step times by world size and batch), after each decision of the
    /// scaling policy; the default ignores it. Components only: a native
    /// adapter is not told.
    fn on_training(&mut self, stats: &TrainingStats) {
        let _ = stats;
    }

    /// The adapter's memory between calls; see [`ScalingPolicy::save_state`].
    fn save_state(&self) -> Vec<u8> {
        Vec::new()
    }

    /// Restores what `save_state` gave; see [`ScalingPolicy::load_state`].
    fn load_state(&mut self, state: &[u8]) -> Result<(), PluginError> {
        let _ = state;
        Ok(())
    }
}

/// Transforms a columnar batch before teachers and student see it (WIT world `reader-transform`).
pub trait ReaderTransform: Default + 'static {
    /// Reads the configuration; the default accepts none.
    fn init(&mut self, config: &Config) -> Result<(), PluginError> {
        config.expect_only(&[])
    }

    /// Returns the transformed batch (same samples, same order).
    fn apply(&mut self, batch: Batch) -> Result<Batch, PluginError>;
}

/// Sizes the job's teacher pool (WIT world `teacher-pool-policy`): how many
/// teachers serve the students and how many requests each student keeps in
/// flight at each.
pub trait TeacherPolicy: Default + 'static {
    /// Reads the configuration; the default accepts none.
    fn init(&mut self, config: &Config) -> Result<(), PluginError> {
        config.expect_only(&[])
    }

    /// Called on a fixed cadence with the pool's and the students' state.
    /// The host clamps the plan's `teachers` to the view's bounds and its
    /// `in_flight_per_teacher` to 1..=64.
    fn decide(&mut self, view: &TeacherView) -> TeacherPlan;

    /// The policy's memory between decisions; see [`ScalingPolicy::save_state`].
    fn save_state(&self) -> Vec<u8> {
        Vec::new()
    }

    /// Restores what `save_state` gave; see [`ScalingPolicy::load_state`].
    fn load_state(&mut self, state: &[u8]) -> Result<(), PluginError> {
        let _ = state;
        Ok(())
    }
}
