//! The plugin host: loads scaling policies, batch adapters, reader
//! transforms and teacher policies as sandboxed WebAssembly components (wasmtime) or as trusted
//! native libraries (`.so`), behind one trait per world.
//!
//! - [`PluginHost`] owns the engine, the precompiled-artifact cache and the
//!   sandbox limits, and loads plugins.
//! - [`PolicyPlugin`], [`AdapterPlugin`], [`TransformPlugin`],
//!   [`TeacherPolicyPlugin`]: what the rest of the runtime calls, whichever
//!   way the plugin was built.
//! - [`Reloading`]: a plugin that follows its file on disk (hot reload).
//! - [`replay`]: drives a scaling policy over a recorded trace or a simulated cluster.
//! - [`scaffold`]: `plugin new`, a plugin crate to start from.

mod bindings;
mod cache;
mod contract;
mod error;
mod host;
mod limits;
mod native;
mod reload;
pub mod replay;
pub mod scaffold;
mod stderr;
mod ticker;
mod wasm;

pub use cache::{ArtifactCache, CacheStatus};
pub use contract::{ContractBreach, TeacherPlanClamp, check_batch, check_hyperparams, clamp_teacher_plan};
pub use error::Error;
pub use host::{HostOptions, Inspection, PluginHost};
pub use limits::Limits;
pub use reload::Reloading;

use edl_plugin_sdk::{
    Action, Batch, ClusterView, Hyperparams, PluginInfo, ResizeEvent, TeacherPlan, TeacherView,
};
use std::fmt;

/// A loaded plugin of any world.
pub enum Loaded {
    Policy(Box<dyn PolicyPlugin>),
    Adapter(Box<dyn AdapterPlugin>),
    Transform(Box<dyn TransformPlugin>),
    TeacherPolicy(Box<dyn TeacherPolicyPlugin>),
}

impl Loaded {
    pub fn world(&self) -> World {
        match self {
            Loaded::Policy(_) => World::ScalingPolicy,
            Loaded::Adapter(_) => World::BatchAdapter,
            Loaded::Transform(_) => World::ReaderTransform,
            Loaded::TeacherPolicy(_) => World::TeacherPolicy,
        }
    }

    pub fn info(&self) -> &PluginInfo {
        match self {
            Loaded::Policy(p) => p.info(),
            Loaded::Adapter(p) => p.info(),
            Loaded::Transform(p) => p.info(),
            Loaded::TeacherPolicy(p) => p.info(),
        }
    }
}

/// The four kinds of plugin (the WIT worlds).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum World {
    ScalingPolicy,
    BatchAdapter,
    ReaderTransform,
    /// Sizes the teacher pool (WIT world `teacher-pool-policy`).
    TeacherPolicy,
}

impl World {
    /// Every world.
    pub const ALL: [World; 4] =
        [World::ScalingPolicy, World::BatchAdapter, World::ReaderTransform, World::TeacherPolicy];

    /// The WIT world name.
    pub fn name(self) -> &'static str {
        match self {
            World::ScalingPolicy => "scaling-policy",
            World::BatchAdapter => "batch-adapter",
            World::ReaderTransform => "reader-transform",
            World::TeacherPolicy => "teacher-pool-policy",
        }
    }

    /// The interface the world exports (`edl:plugins/<interface>@version`).
    pub fn interface(self) -> &'static str {
        match self {
            World::ScalingPolicy => "policy",
            World::BatchAdapter => "adapter",
            World::ReaderTransform => "transform",
            World::TeacherPolicy => "teacher-policy",
        }
    }

    /// The runtime's command-line flag that loads a plugin of this world
    /// into a job.
    pub fn run_flag(self) -> Option<&'static str> {
        match self {
            World::ScalingPolicy => Some("--policy"),
            World::BatchAdapter => Some("--adapter"),
            World::ReaderTransform => Some("--transform"),
            World::TeacherPolicy => Some("--teacher-policy"),
        }
    }

    /// The world with this name.
    pub fn from_name(name: &str) -> Option<World> {
        World::ALL.into_iter().find(|w| w.name() == name)
    }

    fn from_interface(interface: &str) -> Option<World> {
        World::ALL.into_iter().find(|w| w.interface() == interface)
    }
}

impl fmt::Display for World {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How a plugin was loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backend {
    /// A sandboxed component, and whether its compiled form came from the cache.
    Wasm { cache: CacheStatus },
    /// A trusted native library.
    Native,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Backend::Wasm { cache: CacheStatus::Hit } => f.write_str("sandboxed component, from the cache"),
            Backend::Wasm { cache: CacheStatus::Miss } => {
                f.write_str("sandboxed component, compiled and cached")
            }
            Backend::Wasm { cache: CacheStatus::Disabled } => f.write_str("sandboxed component, compiled"),
            Backend::Native => f.write_str("native library, trusted"),
        }
    }
}

/// The WIT interface through which a plugin hands its memory over
/// (`edl:plugins/state`), exported beside its world's own.
pub(crate) const STATE_INTERFACE: &str = "state";
/// The interface a batch adapter is told the training's measures through.
pub(crate) const TRAINING_INTERFACE: &str = "training-observer";
/// The interface a scaling policy sizes the parameter servers through.
pub(crate) const SERVER_INTERFACE: &str = "server-policy";
/// The interface a scaling policy sizes the warm spares through.
pub(crate) const SPARE_INTERFACE: &str = "spare-policy";

/// What every loaded plugin can tell about itself.
pub trait Plugin: Send {
    /// The plugin's `info()`, read once at load.
    fn info(&self) -> &PluginInfo;
    /// How it was loaded.
    fn backend(&self) -> Backend;
    /// The plugin's memory between calls, as it saves it; `None` for a
    /// plugin that keeps none (exports no `state`).
    fn save_state(&mut self) -> Result<Option<Vec<u8>>, Error> {
        Ok(None)
    }
    /// Gives this instance the memory an earlier one saved. `Ok(false)`: the
    /// plugin keeps none, and nothing was given.
    fn load_state(&mut self, state: &[u8]) -> Result<bool, Error> {
        let _ = state;
        Ok(false)
    }
}

/// A loaded scaling policy.
pub trait PolicyPlugin: Plugin {
    fn decide(&mut self, view: &ClusterView) -> Result<Vec<Action>, Error>;
    /// Tells it what the host measured of the training before a decision;
    /// true when it was told (see [`AdapterPlugin::on_training`]).
    fn on_training(&mut self, stats: &edl_plugin_sdk::TrainingStats) -> Result<bool, Error> {
        let _ = stats;
        Ok(false)
    }
    /// How many parameter servers the job should have; None from a policy
    /// that leaves them be (or cannot be asked: a native one, a component
    /// built before).
    fn decide_servers(&mut self, view: &edl_plugin_sdk::ServerView) -> Result<Option<u32>, Error> {
        let _ = view;
        Ok(None)
    }
    /// How many warm spares the job should keep; None from a policy that
    /// keeps them as they are (or cannot be asked: a plugin built before).
    fn decide_spares(&mut self, view: &edl_plugin_sdk::SpareView) -> Result<Option<u32>, Error> {
        let _ = view;
        Ok(None)
    }
}

/// A loaded batch adapter.
pub trait AdapterPlugin: Plugin {
    fn on_resize(&mut self, event: &ResizeEvent, current: &Hyperparams) -> Result<Hyperparams, Error>;
    fn on_step(&mut self, step: u64, current: &Hyperparams) -> Result<Hyperparams, Error>;
    /// Tells it what the host measured of the training; true when it was
    /// told (an adapter that does not observe it, a native one or a
    /// component built before, is not).
    fn on_training(&mut self, stats: &edl_plugin_sdk::TrainingStats) -> Result<bool, Error> {
        let _ = stats;
        Ok(false)
    }
}

/// A loaded reader transform.
pub trait TransformPlugin: Plugin {
    fn apply(&mut self, batch: &Batch) -> Result<Batch, Error>;
}

/// A loaded teacher policy. Its plan comes back clamped to the view's
/// bounds (`min_teachers..=max_teachers`, 1..=64 requests in flight).
pub trait TeacherPolicyPlugin: Plugin {
    fn decide(&mut self, view: &TeacherView) -> Result<TeacherPlan, Error>;
}
