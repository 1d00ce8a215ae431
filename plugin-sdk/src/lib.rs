//! Write edl plugins as plain Rust.
//!
//! A plugin is a struct that implements one of four traits and one export
//! macro call; the same crate builds to a sandboxed WebAssembly component
//! (`--target wasm32-wasip2`) or to a trusted native `cdylib` (`.so`), and its
//! logic is unit-tested on the host with [`testing`].
//!
//! ```
//! use edl_plugin_sdk::{Action, ClusterView, Config, PluginError, ScalingPolicy};
//!
//! /// Grows the job by one worker every `every` steps.
//! #[derive(Default)]
//! pub struct Grow { every: u64 }
//!
//! impl ScalingPolicy for Grow {
//!     fn init(&mut self, config: &Config) -> Result<(), PluginError> {
//!         config.expect_only(&["every"])?;
//!         self.every = config.get_or("every", 100)?;
//!         Ok(())
//!     }
//!     fn decide(&mut self, view: &ClusterView) -> Vec<Action> {
//!         if view.step > 0 && view.step % self.every == 0 && view.world_size < view.max_workers {
//!             vec![Action::ScaleOut(1)]
//!         } else {
//!             vec![Action::Hold]
//!         }
//!     }
//! }
//!
//! edl_plugin_sdk::export_scaling_policy!(Grow);
//! # fn main() {}
//! ```
//!
//! The plugin's name, version and description are its crate's (`Cargo.toml`).

#[cfg(feature = "bench")]
pub mod bench;
mod config;
pub mod native;
mod plugin;
pub mod testing;
pub mod types;

pub use config::{Config, ConfigKey, DESCRIBE, DESCRIBED};
pub use plugin::{BatchAdapter, ReaderTransform, ScalingPolicy, TeacherPolicy};
pub use types::{
    Action, Batch, ClusterView, Dtype, Hyperparams, PluginError, PluginInfo, ResizeEvent, ServerStats,
    ServerView, SpareView, StepTime, TeacherPlan, TeacherStats, TeacherView, TrainingStats, WorkerStats,
};

include!(concat!(env!("OUT_DIR"), "/wit.rs"));

/// The calling crate's name, version and description, as a [`PluginInfo`].
#[macro_export]
macro_rules! plugin_info {
    () => {
        $crate::PluginInfo {
            name: ::std::string::String::from(env!("CARGO_PKG_NAME")),
            version: ::std::string::String::from(env!("CARGO_PKG_VERSION")),
            description: ::std::string::String::from(env!("CARGO_PKG_DESCRIPTION")),
        }
    };
}

/// Implements the `training-observer` export of a component's generated
/// world for the plugin in `SLOT`, through its trait's `on_training`.
#[doc(hidden)]
#[macro_export]
macro_rules! __edl_training_observer {
    ($trait:path) => {
        impl exports::edl::plugins::training_observer::Guest for Export {
            fn on_training(stats: exports::edl::plugins::training_observer::TrainingStats) {
                let stats = $crate::TrainingStats {
                    step: stats.step,
                    world_size: stats.world_size,
                    noise_scale: stats.noise_scale,
                    base_batch: stats.base_batch,
                    base_lr: stats.base_lr,
                    max_batch: stats.max_batch,
                    throughput: stats.throughput,
                    step_times: stats
                        .step_times
                        .into_iter()
                        .map(|t| $crate::StepTime {
                            world_size: t.world_size,
                            global_batch: t.global_batch,
                            secs: t.secs,
                            steps: t.steps,
                        })
                        .collect(),
                };
                SLOT.with(|p| <_ as $trait>::on_training(p, &stats))
            }
        }
    };
}

/// Exports a [`ScalingPolicy`] implementation as this crate's plugin.
///
/// Built for `wasm32-wasip2` it becomes a component of world
/// `spare-scaling-policy` (a `scaling-policy` told the training's measures
/// and asked about the parameter servers and the warm spares);
/// built as a native `cdylib` it exports the C ABI of [`native`].
#[macro_export]
macro_rules! export_scaling_policy {
    ($ty:ty) => {
        #[cfg(target_arch = "wasm32")]
        #[doc(hidden)]
        mod __edl_wasm_export {
            #[allow(unused_imports)]
            use super::*;
            $crate::__edl_generate_world!("spare-scaling-policy");
            static SLOT: $crate::__private::Slot<$ty> = $crate::__private::Slot::new();
            struct Export;
            impl exports::edl::plugins::policy::Guest for Export {
                fn info() -> $crate::PluginInfo {
                    $crate::plugin_info!()
                }
                fn init(
                    config: ::std::vec::Vec<(::std::string::String, ::std::string::String)>,
                ) -> ::std::result::Result<(), $crate::PluginError> {
                    let mut plugin = <$ty as ::std::default::Default>::default();
                    let config = $crate::Config::new(config);
                    $crate::ScalingPolicy::init(&mut plugin, &config)?;
                    config.described()?;
                    SLOT.set(plugin);
                    Ok(())
                }
                fn decide(view: $crate::ClusterView) -> ::std::vec::Vec<$crate::Action> {
                    SLOT.with(|p| $crate::ScalingPolicy::decide(p, &view))
                }
            }
            impl exports::edl::plugins::state::Guest for Export {
                fn save() -> ::std::vec::Vec<u8> {
                    SLOT.with(|p| $crate::ScalingPolicy::save_state(p))
                }
                fn load(state: ::std::vec::Vec<u8>) -> ::std::result::Result<(), $crate::PluginError> {
                    SLOT.with(|p| $crate::ScalingPolicy::load_state(p, &state))
                }
            }
            $crate::__edl_training_observer!($crate::ScalingPolicy);
            impl exports::edl::plugins::server_policy::Guest for Export {
                fn decide_servers(view: exports::edl::plugins::server_policy::ServerView) -> Option<u32> {
                    let view = $crate::ServerView {
                        step: view.step,
                        servers: view
                            .servers
                            .into_iter()
                            .map(|s| $crate::ServerStats {
                                id: s.id,
                                rows: s.rows,
                                bytes: s.bytes,
                                working_bytes: s.working_bytes,
                                bound_bytes: s.bound_bytes,
                                requests_per_sec: s.requests_per_sec,
                                refused: s.refused,
                            })
                            .collect(),
                        min_servers: view.min_servers,
                        max_servers: view.max_servers,
                        replicas: view.replicas,
                        secs_since_change: view.secs_since_change,
                    };
                    SLOT.with(|p| $crate::ScalingPolicy::decide_servers(p, &view))
                }
            }
            impl exports::edl::plugins::spare_policy::Guest for Export {
                fn decide_spares(v: exports::edl::plugins::spare_policy::SpareView) -> Option<u32> {
                    let view = $crate::SpareView {
                        step: v.step,
                        world_size: v.world_size,
                        min_workers: v.min_workers,
                        max_workers: v.max_workers,
                        spares_wanted: v.spares_wanted,
                        spares_ready: v.spares_ready,
                        spares_starting: v.spares_starting,
                        price_per_spare_hour: v.price_per_spare_hour,
                        spare_hours: v.spare_hours,
                        from_spares: v.from_spares,
                        started_cold: v.started_cold,
                        members_lost: v.members_lost,
                        ready_secs: v.ready_secs,
                        hours: v.hours,
                        secs_since_change: v.secs_since_change,
                    };
                    SLOT.with(|p| $crate::ScalingPolicy::decide_spares(p, &view))
                }
            }
            export!(Export);
        }
        $crate::__native_exports!("scaling-policy", $ty, $crate::ScalingPolicy, {
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn edl_policy_decide(
                handle: *mut ::std::ffi::c_void,
                view: *const $crate::native::RawClusterView,
                out: *mut $crate::native::RawSlice<$crate::native::RawAction>,
            ) -> i32 {
                unsafe { $crate::native::policy_decide::<$ty>(handle, view, out) }
            }
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn edl_policy_decide_servers(
                handle: *mut ::std::ffi::c_void,
                view: *const $crate::native::RawServerView,
                out: *mut $crate::native::RawServerAnswer,
            ) -> i32 {
                unsafe { $crate::native::policy_decide_servers::<$ty>(handle, view, out) }
            }
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn edl_policy_decide_spares(
                handle: *mut ::std::ffi::c_void,
                view: *const $crate::SpareView,
                out: *mut $crate::native::RawServerAnswer,
            ) -> i32 {
                unsafe { $crate::native::policy_decide_spares::<$ty>(handle, view, out) }
            }
            $crate::__native_state_exports!($ty, $crate::ScalingPolicy);
        });
    };
}

/// Exports a [`BatchAdapter`] implementation as this crate's plugin.
#[macro_export]
macro_rules! export_batch_adapter {
    ($ty:ty) => {
        #[cfg(target_arch = "wasm32")]
        #[doc(hidden)]
        mod __edl_wasm_export {
            #[allow(unused_imports)]
            use super::*;
            $crate::__edl_generate_world!("training-batch-adapter");
            static SLOT: $crate::__private::Slot<$ty> = $crate::__private::Slot::new();
            struct Export;
            impl exports::edl::plugins::adapter::Guest for Export {
                fn info() -> $crate::PluginInfo {
                    $crate::plugin_info!()
                }
                fn init(
                    config: ::std::vec::Vec<(::std::string::String, ::std::string::String)>,
                ) -> ::std::result::Result<(), $crate::PluginError> {
                    let mut plugin = <$ty as ::std::default::Default>::default();
                    let config = $crate::Config::new(config);
                    $crate::BatchAdapter::init(&mut plugin, &config)?;
                    config.described()?;
                    SLOT.set(plugin);
                    Ok(())
                }
                fn on_resize(
                    event: $crate::ResizeEvent,
                    current: $crate::Hyperparams,
                ) -> $crate::Hyperparams {
                    SLOT.with(|p| $crate::BatchAdapter::on_resize(p, &event, &current))
                }
                fn on_step(step: u64, current: $crate::Hyperparams) -> $crate::Hyperparams {
                    SLOT.with(|p| $crate::BatchAdapter::on_step(p, step, &current))
                }
            }
            impl exports::edl::plugins::state::Guest for Export {
                fn save() -> ::std::vec::Vec<u8> {
                    SLOT.with(|p| $crate::BatchAdapter::save_state(p))
                }
                fn load(state: ::std::vec::Vec<u8>) -> ::std::result::Result<(), $crate::PluginError> {
                    SLOT.with(|p| $crate::BatchAdapter::load_state(p, &state))
                }
            }
            $crate::__edl_training_observer!($crate::BatchAdapter);
            export!(Export);
        }
        $crate::__native_exports!("batch-adapter", $ty, $crate::BatchAdapter, {
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn edl_adapter_on_resize(
                handle: *mut ::std::ffi::c_void,
                event: *const $crate::ResizeEvent,
                current: *const $crate::Hyperparams,
                out: *mut $crate::Hyperparams,
            ) -> i32 {
                unsafe { $crate::native::adapter_on_resize::<$ty>(handle, event, current, out) }
            }
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn edl_adapter_on_step(
                handle: *mut ::std::ffi::c_void,
                step: u64,
                current: *const $crate::Hyperparams,
                out: *mut $crate::Hyperparams,
            ) -> i32 {
                unsafe { $crate::native::adapter_on_step::<$ty>(handle, step, current, out) }
            }
            $crate::__native_state_exports!($ty, $crate::BatchAdapter);
        });
    };
}

/// Exports a [`ReaderTransform`] implementation as this crate's plugin.
#[macro_export]
macro_rules! export_reader_transform {
    ($ty:ty) => {
        #[cfg(target_arch = "wasm32")]
        #[doc(hidden)]
        mod __edl_wasm_export {
            #[allow(unused_imports)]
            use super::*;
            $crate::__edl_generate_world!("reader-transform");
            static SLOT: $crate::__private::Slot<$ty> = $crate::__private::Slot::new();
            struct Export;
            impl exports::edl::plugins::transform::Guest for Export {
                fn info() -> $crate::PluginInfo {
                    $crate::plugin_info!()
                }
                fn init(
                    config: ::std::vec::Vec<(::std::string::String, ::std::string::String)>,
                ) -> ::std::result::Result<(), $crate::PluginError> {
                    let mut plugin = <$ty as ::std::default::Default>::default();
                    let config = $crate::Config::new(config);
                    $crate::ReaderTransform::init(&mut plugin, &config)?;
                    config.described()?;
                    SLOT.set(plugin);
                    Ok(())
                }
                fn apply(batch: $crate::Batch) -> ::std::result::Result<$crate::Batch, $crate::PluginError> {
                    SLOT.with(|p| $crate::ReaderTransform::apply(p, batch))
                }
            }
            export!(Export);
        }
        $crate::__native_exports!("reader-transform", $ty, $crate::ReaderTransform, {
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn edl_transform_apply(
                handle: *mut ::std::ffi::c_void,
                input: *const $crate::native::RawBatch,
                out: *mut $crate::native::RawBatch,
            ) -> i32 {
                unsafe { $crate::native::transform_apply::<$ty>(handle, input, out) }
            }
        });
    };
}

/// Exports a [`TeacherPolicy`] implementation as this crate's plugin.
///
/// Built for `wasm32-wasip2` it becomes a component of world
/// `teacher-pool-policy` (with its `state`); built as a native `cdylib` it
/// exports the C ABI of [`native`].
#[macro_export]
macro_rules! export_teacher_policy {
    ($ty:ty) => {
        #[cfg(target_arch = "wasm32")]
        #[doc(hidden)]
        mod __edl_wasm_export {
            #[allow(unused_imports)]
            use super::*;
            $crate::__edl_generate_world!("stateful-teacher-pool-policy");
            use exports::edl::plugins::teacher_policy as wit;
            static SLOT: $crate::__private::Slot<$ty> = $crate::__private::Slot::new();
            struct Export;
            // The teacher records belong to the exported interface, so the
            // bindings declare their own; they are copied field by field.
            fn view_from_wit(v: wit::TeacherView) -> $crate::TeacherView {
                $crate::TeacherView {
                    step: v.step,
                    wait_share: v.wait_share,
                    student_throughput: v.student_throughput,
                    student_world_size: v.student_world_size,
                    student_world_planned: v.student_world_planned,
                    teacher_count: v.teacher_count,
                    min_teachers: v.min_teachers,
                    max_teachers: v.max_teachers,
                    in_flight_per_teacher: v.in_flight_per_teacher,
                    teachers: v
                        .teachers
                        .into_iter()
                        .map(|t| $crate::TeacherStats {
                            id: t.id,
                            utilisation: t.utilisation,
                            queue_depth: t.queue_depth,
                            rows_per_sec: t.rows_per_sec,
                            latency_ms: t.latency_ms,
                            queue_ms: t.queue_ms,
                            errors: t.errors,
                            p50_ms: t.p50_ms,
                            p99_ms: t.p99_ms,
                        })
                        .collect(),
                    secs_since_change: v.secs_since_change,
                    price_per_teacher_hour: v.price_per_teacher_hour,
                }
            }
            impl wit::Guest for Export {
                fn info() -> $crate::PluginInfo {
                    $crate::plugin_info!()
                }
                fn init(
                    config: ::std::vec::Vec<(::std::string::String, ::std::string::String)>,
                ) -> ::std::result::Result<(), $crate::PluginError> {
                    let mut plugin = <$ty as ::std::default::Default>::default();
                    let config = $crate::Config::new(config);
                    $crate::TeacherPolicy::init(&mut plugin, &config)?;
                    config.described()?;
                    SLOT.set(plugin);
                    Ok(())
                }
                fn decide(view: wit::TeacherView) -> wit::TeacherPlan {
                    let view = view_from_wit(view);
                    let plan = SLOT.with(|p| $crate::TeacherPolicy::decide(p, &view));
                    wit::TeacherPlan {
                        teachers: plan.teachers,
                        in_flight_per_teacher: plan.in_flight_per_teacher,
                    }
                }
            }
            impl exports::edl::plugins::state::Guest for Export {
                fn save() -> ::std::vec::Vec<u8> {
                    SLOT.with(|p| $crate::TeacherPolicy::save_state(p))
                }
                fn load(state: ::std::vec::Vec<u8>) -> ::std::result::Result<(), $crate::PluginError> {
                    SLOT.with(|p| $crate::TeacherPolicy::load_state(p, &state))
                }
            }
            export!(Export);
        }
        $crate::__native_exports!("teacher-pool-policy", $ty, $crate::TeacherPolicy, {
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn edl_teacher_policy_decide(
                handle: *mut ::std::ffi::c_void,
                view: *const $crate::native::RawTeacherView,
                out: *mut $crate::TeacherPlan,
            ) -> i32 {
                unsafe { $crate::native::teacher_policy_decide::<$ty>(handle, view, out) }
            }
            $crate::__native_state_exports!($ty, $crate::TeacherPolicy);
        });
    };
}

/// The C ABI symbols of a plugin's memory (`edl_plugin_save_state`, `edl_plugin_load_state`).
#[doc(hidden)]
#[macro_export]
macro_rules! __native_state_exports {
    ($ty:ty, $trait:path) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn edl_plugin_save_state(
            handle: *mut ::std::ffi::c_void,
            out: *mut $crate::native::RawSlice<u8>,
        ) -> i32 {
            unsafe { $crate::native::plugin_save_state::<$ty>(handle, out, <$ty as $trait>::save_state) }
        }
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn edl_plugin_load_state(
            handle: *mut ::std::ffi::c_void,
            ptr: *const u8,
            len: usize,
        ) -> i32 {
            unsafe { $crate::native::plugin_load_state::<$ty>(handle, ptr, len, <$ty as $trait>::load_state) }
        }
    };
}

/// The C ABI symbols every native plugin exports, plus the world's own (`$world_fns`).
/// Left out of the crate's own unit tests so test binaries never carry them.
#[doc(hidden)]
#[macro_export]
macro_rules! __native_exports {
    ($world:literal, $ty:ty, $trait:path, { $($world_fns:item)* }) => {
        #[cfg(all(not(target_arch = "wasm32"), not(test)))]
        #[doc(hidden)]
        mod __edl_native_export {
            #[allow(unused_imports)]
            use super::*;
            #[unsafe(no_mangle)]
            pub extern "C" fn edl_plugin_abi_version() -> u32 {
                $crate::native::ABI_VERSION
            }
            #[unsafe(no_mangle)]
            pub extern "C" fn edl_plugin_world() -> $crate::native::RawStr {
                $crate::native::RawStr::from_static($world)
            }
            #[unsafe(no_mangle)]
            pub extern "C" fn edl_plugin_info() -> $crate::native::RawInfo {
                $crate::native::RawInfo {
                    name: $crate::native::RawStr::from_static(env!("CARGO_PKG_NAME")),
                    version: $crate::native::RawStr::from_static(env!("CARGO_PKG_VERSION")),
                    description: $crate::native::RawStr::from_static(env!("CARGO_PKG_DESCRIPTION")),
                }
            }
            #[unsafe(no_mangle)]
            pub extern "C" fn edl_plugin_new() -> *mut ::std::ffi::c_void {
                $crate::native::plugin_new::<$ty>()
            }
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn edl_plugin_free(handle: *mut ::std::ffi::c_void) {
                unsafe { $crate::native::plugin_free::<$ty>(handle) }
            }
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn edl_plugin_init(
                handle: *mut ::std::ffi::c_void,
                pairs: *const $crate::native::RawPair,
                len: usize,
            ) -> i32 {
                unsafe {
                    $crate::native::plugin_init::<$ty>(handle, pairs, len, <$ty as $trait>::init)
                }
            }
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn edl_plugin_last_error(
                handle: *mut ::std::ffi::c_void,
            ) -> $crate::native::RawStr {
                unsafe { $crate::native::plugin_last_error::<$ty>(handle) }
            }
            $($world_fns)*
        }
    };
}

#[doc(hidden)]
pub mod __private {
    #[cfg(target_arch = "wasm32")]
    pub use wit_bindgen;

    /// The one plugin instance of a component (created on first use or by `init`).
    #[cfg(target_arch = "wasm32")]
    pub struct Slot<T>(core::cell::RefCell<Option<T>>);

    // SAFETY: a wasm32-wasip2 component instance runs on one thread; the
    // RefCell is never reached from another.
    #[cfg(target_arch = "wasm32")]
    unsafe impl<T> Sync for Slot<T> {}

    #[cfg(target_arch = "wasm32")]
    impl<T: Default> Slot<T> {
        #[allow(clippy::new_without_default)]
        pub const fn new() -> Self {
            Slot(core::cell::RefCell::new(None))
        }
        pub fn set(&self, value: T) {
            *self.0.borrow_mut() = Some(value);
        }
        pub fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
            let mut guard = self.0.borrow_mut();
            f(guard.get_or_insert_with(T::default))
        }
    }
}
