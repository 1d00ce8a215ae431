//! Benchmarks any plugin files side by side with the shipped plugin of the
//! same world: load time (compile, and from the artifact cache) and call
//! latency on the standard input (the SDK's `testing::standard_trace`,
//! `standard_batch` and `standard_teacher_trace`).
//!
//!     EDL_BENCH_PLUGINS=path/a.wasm,path/libb.so cargo bench -p edl-benches --bench any_plugin
//!
//! Without `EDL_BENCH_PLUGINS`, the shipped plugins alone are measured.

use criterion::{
    BatchSize, BenchmarkGroup, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main,
    measurement::WallTime,
};
use edl_plugin_artifacts as art;
use edl_plugin_sdk::{Hyperparams, ResizeEvent, testing};
use edl_runtime::plugin::{ArtifactCache, HostOptions, PluginHost, World};
use std::{
    hint::black_box,
    path::{Path, PathBuf},
};

fn shipped_for(world: World) -> (&'static str, &'static str) {
    match world {
        World::ScalingPolicy => ("autoscale", art::AUTOSCALE_WASM),
        World::BatchAdapter => ("dynamic-batch", art::DYNAMIC_BATCH_WASM),
        World::ReaderTransform => ("augment", art::AUGMENT_WASM),
        World::TeacherPolicy => ("teacher-autoscale", art::TEACHER_AUTOSCALE_WASM),
    }
}

/// cargo runs benchmarks in the package directory: a relative path that is
/// not there is taken from the workspace root.
fn resolve(p: &str) -> PathBuf {
    let path = PathBuf::from(p);
    if path.is_relative() && !path.exists() {
        return Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path);
    }
    path
}

fn any_plugin(c: &mut Criterion) {
    let (_cache, host) = edl_benches::plugin_host();
    let cold =
        PluginHost::new(HostOptions { cache: ArtifactCache::disabled(), ..Default::default() }).unwrap();

    let given: Vec<PathBuf> = std::env::var("EDL_BENCH_PLUGINS")
        .map(|v| v.split(',').filter(|s| !s.trim().is_empty()).map(|s| resolve(s.trim())).collect())
        .unwrap_or_default();
    let mut worlds: Vec<(World, Vec<(String, PathBuf)>)> = Vec::new();
    for path in &given {
        let world = match host.inspect(path) {
            Ok(i) => i.world,
            Err(e) => panic!("EDL_BENCH_PLUGINS: {e}"),
        };
        let label =
            path.file_name().map_or_else(|| path.display().to_string(), |f| f.to_string_lossy().into_owned());
        match worlds.iter_mut().find(|(w, _)| *w == world) {
            Some((_, list)) => list.push((label, path.clone())),
            None => worlds.push((world, vec![(label, path.clone())])),
        }
    }
    if worlds.is_empty() {
        worlds = World::ALL.map(|w| (w, Vec::new())).to_vec();
    }

    for (world, mut plugins) in worlds {
        let (name, file) = shipped_for(world);
        plugins.push((format!("shipped-{name}"), PathBuf::from(file)));
        let mut g = c.benchmark_group(world.name());
        for (label, path) in &plugins {
            let path: &Path = path;
            g.throughput(Throughput::Elements(1));
            g.sample_size(10);
            g.bench_function(BenchmarkId::new("load-compile", label), |b| {
                b.iter_batched(
                    || (),
                    |()| cold.load(path, &[], Some(world)).unwrap(),
                    BatchSize::PerIteration,
                )
            });
            host.load(path, &[], Some(world)).unwrap();
            g.bench_function(BenchmarkId::new("load-cached", label), |b| {
                b.iter(|| host.load(path, &[], Some(world)).unwrap())
            });
            g.sample_size(50);
            calls(&mut g, &host, world, path, label);
        }
        g.finish();
    }
}

/// Call latency of one plugin of `world` on its world's standard input.
fn calls(g: &mut BenchmarkGroup<'_, WallTime>, host: &PluginHost, world: World, path: &Path, label: &str) {
    match world {
        World::ScalingPolicy => {
            let views = testing::standard_trace();
            let mut p = host.load_policy(path, &[]).unwrap();
            g.throughput(Throughput::Elements(views.len() as u64));
            g.bench_function(BenchmarkId::new("decide-standard-trace", label), |b| {
                b.iter(|| {
                    for v in &views {
                        black_box(p.decide(black_box(v)).unwrap());
                    }
                })
            });
        }
        World::BatchAdapter => {
            let mut a = host.load_adapter(path, &[]).unwrap();
            let start = Hyperparams { global_batch: 256, local_batch: 64, lr: 0.1, momentum: 0.9 };
            g.throughput(Throughput::Elements(17));
            g.bench_function(BenchmarkId::new("resize+16-steps", label), |b| {
                b.iter(|| {
                    let ev = ResizeEvent { step: 100, old_world_size: 4, new_world_size: 6 };
                    let mut h = a.on_resize(&ev, &start).unwrap();
                    for s in 100..116 {
                        h = a.on_step(s, &h).unwrap();
                    }
                    black_box(h)
                })
            });
        }
        World::TeacherPolicy => {
            let views = testing::standard_teacher_trace();
            let mut p = host.load_teacher_policy(path, &[]).unwrap();
            g.throughput(Throughput::Elements(views.len() as u64));
            g.bench_function(BenchmarkId::new("decide-standard-teacher-trace", label), |b| {
                b.iter(|| {
                    for v in &views {
                        black_box(p.decide(black_box(v)).unwrap());
                    }
                })
            });
        }
        World::ReaderTransform => {
            let batch = testing::standard_batch();
            let mut t = host.load_transform(path, &[]).unwrap();
            g.throughput(Throughput::Elements(batch.len() as u64));
            g.bench_function(BenchmarkId::new("apply-standard-batch", label), |b| {
                b.iter(|| black_box(t.apply(black_box(&batch)).unwrap()))
            });
        }
    }
}

criterion_group!(benches, any_plugin);
criterion_main!(benches);
