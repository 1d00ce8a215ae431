//! Plugin host benchmarks: what a call costs through the sandbox, against a
//! native library and a plain Rust call; what loading costs with and without
//! the artifact cache.
//!
//!     cargo bench -p edl-benches --bench plugins

use autoscale::Autoscale;
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use edl_plugin_artifacts as art;
use edl_plugin_sdk::{ClusterView, ScalingPolicy, WorkerStats, testing};
use edl_runtime::plugin::{ArtifactCache, HostOptions, PluginHost};
use std::{hint::black_box, path::Path};

fn steady_view() -> ClusterView {
    ClusterView {
        step: 1000,
        world_size: 4,
        min_workers: 1,
        max_workers: 8,
        free_slots: 4,
        global_batch: 256,
        throughput: 3760.0,
        workers: (0..4).map(|id| WorkerStats { id, throughput: 940.0 }).collect(),
        secs_since_change: 30.0,
        samples_remaining: 1_000_000,
        ..Default::default()
    }
}

fn policy_decision(c: &mut Criterion) {
    let (_cache, host) = edl_benches::plugin_host();
    let view = steady_view();
    let mut wasm = host.load_policy(Path::new(art::AUTOSCALE_WASM), &[]).unwrap();
    let mut native = host.load_policy(Path::new(art::AUTOSCALE_SO), &[]).unwrap();
    let mut rust = testing::policy::<Autoscale>(&[]).unwrap();

    let mut g = c.benchmark_group("policy-decision");
    g.bench_function("wasm", |b| b.iter(|| wasm.decide(black_box(&view)).unwrap()));
    g.bench_function("native-so", |b| b.iter(|| native.decide(black_box(&view)).unwrap()));
    g.bench_function("rust-call", |b| b.iter(|| rust.decide(black_box(&view))));
    g.finish();

    // The cost of crossing into the sandbox itself: `schedule` does almost nothing.
    let mut wasm = host.load_policy(Path::new(art::SCHEDULE_WASM), &[]).unwrap();
    let mut native = host.load_policy(Path::new(art::SCHEDULE_SO), &[]).unwrap();
    let mut g = c.benchmark_group("policy-call-overhead");
    g.bench_function("wasm", |b| b.iter(|| wasm.decide(black_box(&view)).unwrap()));
    g.bench_function("native-so", |b| b.iter(|| native.decide(black_box(&view)).unwrap()));
    let no_workers = ClusterView { workers: Vec::new(), ..view.clone() };
    g.bench_function("wasm-no-worker-list", |b| b.iter(|| wasm.decide(black_box(&no_workers)).unwrap()));
    // The floor of one call into a component: flat arguments and a flat
    // result (no realloc, no post-return), `dynamic-batch`'s on-step with
    // no ramp under way (it returns its input).
    let mut adapter = host.load_adapter(Path::new(art::DYNAMIC_BATCH_WASM), &[]).unwrap();
    let hyper = edl_plugin_sdk::Hyperparams { global_batch: 256, local_batch: 64, lr: 0.1, momentum: 0.9 };
    g.bench_function("wasm-flat-call", |b| {
        b.iter(|| adapter.on_step(black_box(1000), black_box(&hyper)).unwrap())
    });
    // What the guest pays per call into the host (a flat import: the
    // monotonic clock): the same decision with 0 and with 8 such calls.
    for calls in ["0", "8"] {
        let config = [("mode".to_string(), "clock".to_string()), ("calls".to_string(), calls.to_string())];
        let mut p = host.load_policy(Path::new(art::HOSTILE_POLICY_WASM), &config).unwrap();
        g.bench_function(format!("wasm-{calls}-host-calls"), |b| {
            b.iter(|| p.decide(black_box(&no_workers)).unwrap())
        });
    }
    g.finish();
}

fn augment_transform(c: &mut Criterion) {
    let (_cache, host) = edl_benches::plugin_host();
    let batch = testing::standard_batch();
    let mut wasm = host.load_transform(Path::new(art::AUGMENT_WASM), &[]).unwrap();
    let mut native = host.load_transform(Path::new(art::AUGMENT_SO), &[]).unwrap();

    let mut g = c.benchmark_group("augment-256x784");
    g.throughput(Throughput::Elements(256));
    g.bench_function("wasm", |b| b.iter(|| wasm.apply(black_box(&batch)).unwrap()));
    g.bench_function("native-so", |b| b.iter(|| native.apply(black_box(&batch)).unwrap()));
    g.finish();
}

/// A teacher policy's decision on a pool of four busy teachers whose
/// students wait (the view a pool controller sees when it must grow), in the
/// sandbox and natively.
fn teacher_decision(c: &mut Criterion) {
    let (_cache, host) = edl_benches::plugin_host();
    let view = testing::teacher_view(4, 1, 8).wait_share(0.2).utilisation(0.9).build();
    let mut wasm = host.load_teacher_policy(Path::new(art::TEACHER_AUTOSCALE_WASM), &[]).unwrap();
    let mut native = host.load_teacher_policy(Path::new(art::TEACHER_AUTOSCALE_SO), &[]).unwrap();

    let mut g = c.benchmark_group("teacher-policy-decision");
    g.bench_function("wasm", |b| b.iter(|| wasm.decide(black_box(&view)).unwrap()));
    g.bench_function("native-so", |b| b.iter(|| native.decide(black_box(&view)).unwrap()));
    g.finish();
}

/// A scaling policy's sizing of the warm spares (`decide-spares`, a flat
/// record each way): `autoscale`'s price rule, in the sandbox, natively and
/// as a plain Rust call.
fn spare_decision(c: &mut Criterion) {
    let (_cache, host) = edl_benches::plugin_host();
    let view = edl_plugin_sdk::SpareView {
        step: 1000,
        world_size: 8,
        min_workers: 2,
        max_workers: 12,
        spares_wanted: 1,
        spares_ready: 1,
        price_per_spare_hour: 3.0,
        spare_hours: 0.5,
        from_spares: 2,
        members_lost: 2,
        ready_secs: 60.0,
        hours: 2.0,
        secs_since_change: 900.0,
        ..Default::default()
    };
    let config = [("spare-losses-per-hour", "0.01")];
    let owned: Vec<(String, String)> = config.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let mut wasm = host.load_policy(Path::new(art::AUTOSCALE_WASM), &owned).unwrap();
    let mut native = host.load_policy(Path::new(art::AUTOSCALE_SO), &owned).unwrap();
    let mut rust = testing::policy::<Autoscale>(&config).unwrap();
    assert_eq!(wasm.decide_spares(&view).unwrap(), rust.decide_spares(&view), "the same rule");

    let mut g = c.benchmark_group("spare-decision");
    g.bench_function("wasm", |b| b.iter(|| wasm.decide_spares(black_box(&view)).unwrap()));
    g.bench_function("native-so", |b| b.iter(|| native.decide_spares(black_box(&view)).unwrap()));
    g.bench_function("rust-call", |b| b.iter(|| rust.decide_spares(black_box(&view))));
    g.finish();
}

fn plugin_load(c: &mut Criterion) {
    let cold =
        PluginHost::new(HostOptions { cache: ArtifactCache::disabled(), ..Default::default() }).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let warm =
        PluginHost::new(HostOptions { cache: ArtifactCache::at(dir.path()), ..Default::default() }).unwrap();
    let file = Path::new(art::AUTOSCALE_WASM);
    warm.load_policy(file, &[]).unwrap();

    let mut g = c.benchmark_group("plugin-load");
    g.sample_size(10);
    g.bench_function("compile", |b| {
        b.iter_batched(|| (), |()| cold.load_policy(file, &[]).unwrap(), BatchSize::PerIteration)
    });
    g.bench_function("cached", |b| b.iter(|| warm.load_policy(file, &[]).unwrap()));
    g.finish();
}

criterion_group!(benches, policy_decision, augment_transform, teacher_decision, spare_decision, plugin_load);
criterion_main!(benches);
