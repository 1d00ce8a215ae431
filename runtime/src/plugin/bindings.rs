//! Host bindings of the four worlds, generated from `plugin-sdk/wit`, and the
//! conversions between their types and the SDK's.

pub mod policy {
    wasmtime::component::bindgen!({
        path: "../plugin-sdk/wit",
        world: "scaling-policy",
    });
}

pub mod adapter {
    wasmtime::component::bindgen!({
        path: "../plugin-sdk/wit",
        world: "batch-adapter",
        with: { "edl:plugins/types": super::policy::edl::plugins::types },
    });
}

pub mod transform {
    wasmtime::component::bindgen!({
        path: "../plugin-sdk/wit",
        world: "reader-transform",
        with: { "edl:plugins/types": super::policy::edl::plugins::types },
    });
}

pub mod teacher_policy {
    wasmtime::component::bindgen!({
        path: "../plugin-sdk/wit",
        world: "teacher-pool-policy",
        with: { "edl:plugins/types": super::policy::edl::plugins::types },
    });
}

/// A plugin's optional `state` export, looked up beside its world's.
pub mod state {
    wasmtime::component::bindgen!({
        path: "../plugin-sdk/wit",
        world: "plugin-state",
        with: { "edl:plugins/types": super::policy::edl::plugins::types },
    });
}

/// A batch adapter's optional `training-observer` export.
pub mod training {
    wasmtime::component::bindgen!({
        path: "../plugin-sdk/wit",
        world: "plugin-training-observer",
    });
}

/// A scaling policy's optional `server-policy` export.
pub mod servers {
    wasmtime::component::bindgen!({
        path: "../plugin-sdk/wit",
        world: "plugin-server-policy",
    });
}

/// A scaling policy's optional `spare-policy` export.
pub mod spares {
    wasmtime::component::bindgen!({
        path: "../plugin-sdk/wit",
        world: "plugin-spare-policy",
    });
}

use edl_plugin_sdk as sdk;
use policy::edl::plugins::types as wit;
use teacher_policy::exports::edl::plugins::teacher_policy as wit_teacher;

impl From<wit::PluginInfo> for sdk::PluginInfo {
    fn from(i: wit::PluginInfo) -> Self {
        sdk::PluginInfo { name: i.name, version: i.version, description: i.description }
    }
}

impl From<wit::PluginError> for sdk::PluginError {
    fn from(e: wit::PluginError) -> Self {
        match e {
            wit::PluginError::InvalidConfig(m) => sdk::PluginError::InvalidConfig(m),
            wit::PluginError::InvalidInput(m) => sdk::PluginError::InvalidInput(m),
            wit::PluginError::Failed(m) => sdk::PluginError::Failed(m),
        }
    }
}

impl Default for wit::ClusterView {
    fn default() -> Self {
        wit::ClusterView {
            step: 0,
            epoch: 0,
            world_size: 0,
            min_workers: 0,
            max_workers: 0,
            free_slots: 0,
            global_batch: 0,
            throughput: 0.0,
            workers: Vec::new(),
            secs_since_change: 0.0,
            price_per_worker_hour: 0.0,
            samples_remaining: 0,
        }
    }
}

/// Overwrites `out` with `v`, reusing `out`'s worker list.
pub fn fill_cluster_view(out: &mut wit::ClusterView, v: &sdk::ClusterView) {
    out.step = v.step;
    out.epoch = v.epoch;
    out.world_size = v.world_size;
    out.min_workers = v.min_workers;
    out.max_workers = v.max_workers;
    out.free_slots = v.free_slots;
    out.global_batch = v.global_batch;
    out.throughput = v.throughput;
    out.workers.clear();
    out.workers.extend(v.workers.iter().map(|w| wit::WorkerStats { id: w.id, throughput: w.throughput }));
    out.secs_since_change = v.secs_since_change;
    out.price_per_worker_hour = v.price_per_worker_hour;
    out.samples_remaining = v.samples_remaining;
}

impl From<wit::Action> for sdk::Action {
    fn from(a: wit::Action) -> Self {
        match a {
            wit::Action::Hold => sdk::Action::Hold,
            wit::Action::ScaleOut(n) => sdk::Action::ScaleOut(n),
            wit::Action::ScaleIn(n) => sdk::Action::ScaleIn(n),
            wit::Action::Replace(id) => sdk::Action::Replace(id),
        }
    }
}

pub fn hyperparams(h: &sdk::Hyperparams) -> wit::Hyperparams {
    wit::Hyperparams {
        global_batch: h.global_batch,
        local_batch: h.local_batch,
        lr: h.lr,
        momentum: h.momentum,
    }
}

impl From<wit::Hyperparams> for sdk::Hyperparams {
    fn from(h: wit::Hyperparams) -> Self {
        sdk::Hyperparams {
            global_batch: h.global_batch,
            local_batch: h.local_batch,
            lr: h.lr,
            momentum: h.momentum,
        }
    }
}

pub fn resize_event(e: &sdk::ResizeEvent) -> wit::ResizeEvent {
    wit::ResizeEvent { step: e.step, old_world_size: e.old_world_size, new_world_size: e.new_world_size }
}

impl Default for wit::Batch {
    fn default() -> Self {
        wit::Batch {
            data: Vec::new(),
            shape: Vec::new(),
            dtype: wit::Dtype::Uint8,
            labels: Vec::new(),
            ids: Vec::new(),
            seed: 0,
        }
    }
}

/// Overwrites `out` with `b`, reusing `out`'s buffers.
pub fn fill_batch(out: &mut wit::Batch, b: &sdk::Batch) {
    fn refill<T: Copy>(dst: &mut Vec<T>, src: &[T]) {
        dst.clear();
        dst.extend_from_slice(src);
    }
    refill(&mut out.data, &b.data);
    refill(&mut out.shape, &b.shape);
    refill(&mut out.labels, &b.labels);
    refill(&mut out.ids, &b.ids);
    out.dtype = match b.dtype {
        sdk::Dtype::Uint8 => wit::Dtype::Uint8,
        sdk::Dtype::Float32 => wit::Dtype::Float32,
    };
    out.seed = b.seed;
}

impl From<wit::Batch> for sdk::Batch {
    fn from(b: wit::Batch) -> Self {
        sdk::Batch {
            data: b.data,
            shape: b.shape,
            dtype: match b.dtype {
                wit::Dtype::Uint8 => sdk::Dtype::Uint8,
                wit::Dtype::Float32 => sdk::Dtype::Float32,
            },
            labels: b.labels,
            ids: b.ids,
            seed: b.seed,
        }
    }
}

impl Default for wit_teacher::TeacherView {
    fn default() -> Self {
        wit_teacher::TeacherView {
            step: 0,
            wait_share: 0.0,
            student_throughput: 0.0,
            student_world_size: 0,
            student_world_planned: 0,
            teacher_count: 0,
            min_teachers: 0,
            max_teachers: 0,
            in_flight_per_teacher: 0,
            teachers: Vec::new(),
            secs_since_change: 0.0,
            price_per_teacher_hour: 0.0,
        }
    }
}

/// Overwrites `out` with `v`, reusing `out`'s teacher list.
pub fn fill_teacher_view(out: &mut wit_teacher::TeacherView, v: &sdk::TeacherView) {
    out.step = v.step;
    out.wait_share = v.wait_share;
    out.student_throughput = v.student_throughput;
    out.student_world_size = v.student_world_size;
    out.student_world_planned = v.student_world_planned;
    out.teacher_count = v.teacher_count;
    out.min_teachers = v.min_teachers;
    out.max_teachers = v.max_teachers;
    out.in_flight_per_teacher = v.in_flight_per_teacher;
    out.teachers.clear();
    out.teachers.extend(v.teachers.iter().map(|t| wit_teacher::TeacherStats {
        id: t.id,
        utilisation: t.utilisation,
        queue_depth: t.queue_depth,
        rows_per_sec: t.rows_per_sec,
        latency_ms: t.latency_ms,
        queue_ms: t.queue_ms,
        errors: t.errors,
        p50_ms: t.p50_ms,
        p99_ms: t.p99_ms,
    }));
    out.secs_since_change = v.secs_since_change;
    out.price_per_teacher_hour = v.price_per_teacher_hour;
}

impl From<wit_teacher::TeacherPlan> for sdk::TeacherPlan {
    fn from(p: wit_teacher::TeacherPlan) -> Self {
        sdk::TeacherPlan { teachers: p.teachers, in_flight_per_teacher: p.in_flight_per_teacher }
    }
}

/// The training statistics as the `training-observer` export takes them.
pub fn training_stats(
    s: &sdk::TrainingStats,
) -> training::exports::edl::plugins::training_observer::TrainingStats {
    use training::exports::edl::plugins::training_observer as wit_training;
    wit_training::TrainingStats {
        step: s.step,
        world_size: s.world_size,
        noise_scale: s.noise_scale,
        base_batch: s.base_batch,
        base_lr: s.base_lr,
        max_batch: s.max_batch,
        throughput: s.throughput,
        step_times: s
            .step_times
            .iter()
            .map(|t| wit_training::StepTime {
                world_size: t.world_size,
                global_batch: t.global_batch,
                secs: t.secs,
                steps: t.steps,
            })
            .collect(),
    }
}

/// The parameter servers' view as the `server-policy` export takes it.
pub fn server_view(v: &sdk::ServerView) -> servers::exports::edl::plugins::server_policy::ServerView {
    use servers::exports::edl::plugins::server_policy as wit_servers;
    wit_servers::ServerView {
        step: v.step,
        servers: v
            .servers
            .iter()
            .map(|s| wit_servers::ServerStats {
                id: s.id,
                rows: s.rows,
                bytes: s.bytes,
                working_bytes: s.working_bytes,
                bound_bytes: s.bound_bytes,
                requests_per_sec: s.requests_per_sec,
                refused: s.refused,
            })
            .collect(),
        min_servers: v.min_servers,
        max_servers: v.max_servers,
        replicas: v.replicas,
        secs_since_change: v.secs_since_change,
    }
}

/// The warm spares' view as the `spare-policy` export takes it.
pub fn spare_view(v: &sdk::SpareView) -> spares::exports::edl::plugins::spare_policy::SpareView {
    spares::exports::edl::plugins::spare_policy::SpareView {
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
    }
}
