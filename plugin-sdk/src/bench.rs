//! Criterion helpers for a plugin crate's own benchmarks (feature `bench`):
//! the plugin's native build on the standard inputs, in a few lines.
//!
//! ```ignore
//! // benches/my_policy.rs, with `harness = false`
//! use criterion::{criterion_group, criterion_main, Criterion};
//! fn bench(c: &mut Criterion) {
//!     edl_plugin_sdk::bench::policy::<my_policy::MyPolicy>(c, "my-policy", &[]);
//! }
//! criterion_group!(benches, bench);
//! criterion_main!(benches);
//! ```

use crate::testing::{self, standard_batch, standard_teacher_trace, standard_trace};
use crate::{BatchAdapter, Hyperparams, ReaderTransform, ResizeEvent, ScalingPolicy, TeacherPolicy};
use criterion::{Criterion, Throughput};
use std::hint::black_box;

pub use criterion;

/// Benchmarks `decide` over the standard trace (time per decision).
pub fn policy<P: ScalingPolicy>(c: &mut Criterion, name: &str, config: &[(&str, &str)]) {
    let views = standard_trace();
    let mut p = testing::policy::<P>(config).expect("the plugin accepts this configuration");
    let mut g = c.benchmark_group(name);
    g.throughput(Throughput::Elements(views.len() as u64));
    g.bench_function("decide/standard-trace", |b| {
        b.iter(|| {
            for v in &views {
                black_box(p.decide(black_box(v)));
            }
        })
    });
    g.finish();
}

/// Benchmarks a resize followed by 16 steps.
pub fn adapter<A: BatchAdapter>(c: &mut Criterion, name: &str, config: &[(&str, &str)]) {
    let mut a = testing::adapter::<A>(config).expect("the plugin accepts this configuration");
    let start = Hyperparams { global_batch: 256, local_batch: 64, lr: 0.1, momentum: 0.9 };
    let mut g = c.benchmark_group(name);
    g.throughput(Throughput::Elements(17));
    g.bench_function("resize+16-steps", |b| {
        b.iter(|| {
            let ev = ResizeEvent { step: 100, old_world_size: 4, new_world_size: 6 };
            let mut h = a.on_resize(black_box(&ev), &start);
            for s in 100..116 {
                h = a.on_step(s, &h);
            }
            black_box(h)
        })
    });
    g.finish();
}

/// Benchmarks `apply` on the standard batch (256 x 28 x 28 uint8).
pub fn transform<T: ReaderTransform>(c: &mut Criterion, name: &str, config: &[(&str, &str)]) {
    let batch = standard_batch();
    let mut t = testing::transform::<T>(config).expect("the plugin accepts this configuration");
    let mut g = c.benchmark_group(name);
    g.throughput(Throughput::Elements(batch.len() as u64));
    g.bench_function("apply/standard-batch", |b| {
        b.iter(|| black_box(t.apply(black_box(batch.clone())).expect("apply succeeds")))
    });
    g.finish();
}

/// Benchmarks a teacher policy's `decide` over the standard teacher trace
/// (time per decision).
pub fn teacher_policy<P: TeacherPolicy>(c: &mut Criterion, name: &str, config: &[(&str, &str)]) {
    let views = standard_teacher_trace();
    let mut p = testing::teacher_policy::<P>(config).expect("the plugin accepts this configuration");
    let mut g = c.benchmark_group(name);
    g.throughput(Throughput::Elements(views.len() as u64));
    g.bench_function("decide/standard-teacher-trace", |b| {
        b.iter(|| {
            for v in &views {
                black_box(p.decide(black_box(v)));
            }
        })
    });
    g.finish();
}
