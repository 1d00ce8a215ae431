//! Host bindings of the three worlds, generated from `plugin-sdk/wit`, and the
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

use edl_plugin_sdk as sdk;
use policy::edl::plugins::types as wit;

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

pub fn cluster_view(v: &sdk::ClusterView) -> wit::ClusterView {
    wit::ClusterView {
        step: v.step,
        epoch: v.epoch,
        world_size: v.world_size,
        min_workers: v.min_workers,
        max_workers: v.max_workers,
        free_slots: v.free_slots,
        global_batch: v.global_batch,
        throughput: v.throughput,
        workers: v.workers.iter().map(|w| wit::WorkerStats { id: w.id, throughput: w.throughput }).collect(),
        secs_since_change: v.secs_since_change,
        price_per_worker_hour: v.price_per_worker_hour,
        samples_remaining: v.samples_remaining,
    }
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

pub fn batch(b: &sdk::Batch) -> wit::Batch {
    wit::Batch {
        data: b.data.clone(),
        shape: b.shape.clone(),
        dtype: match b.dtype {
            sdk::Dtype::Uint8 => wit::Dtype::Uint8,
            sdk::Dtype::Float32 => wit::Dtype::Float32,
        },
        labels: b.labels.clone(),
        ids: b.ids.clone(),
        seed: b.seed,
    }
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
