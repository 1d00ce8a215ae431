//! One training step of the native trainer (forward, backward with the
//! distillation loss, SGD with momentum), on the CPU and, where a GPU is
//! usable, on CUDA, side by side in one run.
//!
//!     cargo bench -p edl-benches --bench trainer
//!
//! Throughput is in samples per second. The CUDA step includes what a
//! worker's step pays: the batch and teacher logits copied to the device,
//! the gradient copied back for the all-reduce and up again for the update,
//! and the host mirror of the parameters and momentum refreshed.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use edl_host_gpu::{Device, loss::SoftLabelLoss};
use edl_runtime::trainer::{model::Mlp, train::Trainer};
use std::{hint::black_box, time::Duration};

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32
        })
        .collect()
}

fn step(c: &mut Criterion) {
    // Every requirement at once (driver, device, NVRTC, cuBLAS, the kernels).
    let cuda = match Trainer::on(Device::Cuda(0), Mlp::random(&[2, 2], 0)) {
        Ok(_) => true,
        Err(why) => {
            eprintln!("trainer-step/cuda skipped: {why}");
            false
        }
    };
    let loss = SoftLabelLoss { temperature: 4.0, alpha: 0.7 };
    let mut g = c.benchmark_group("trainer-step");
    g.warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(4)).sample_size(20);
    // The job's student and teacher at its default batch, and a wider
    // network at a larger batch, where a GPU has work worth the copies.
    for (name, sizes, rows) in [
        ("student 784-128-10 b64", vec![784, 128, 10], 64usize),
        ("teacher 784-512-10 b64", vec![784, 512, 10], 64),
        ("wide 784-1024-1024-10 b512", vec![784, 1024, 1024, 10], 512),
    ] {
        let x = values(rows * sizes[0], 1);
        let labels: Vec<u32> = (0..rows).map(|r| (r % 10) as u32).collect();
        let teacher: Vec<f32> = values(rows * 10, 2).iter().map(|v| v * 8.0 - 4.0).collect();
        g.throughput(Throughput::Elements(rows as u64));
        let devices = if cuda { vec![Device::Cpu, Device::Cuda(0)] } else { vec![Device::Cpu] };
        for device in devices {
            let mut t = Trainer::on(device, Mlp::random(&sizes, 3)).expect("usable: tried above");
            g.bench_function(BenchmarkId::new(device.to_string(), name), |b| {
                b.iter(|| {
                    let l = t.compute_gradient(&x, &labels, Some(&teacher), &loss, rows).unwrap();
                    t.apply(0.01, 0.9).unwrap();
                    black_box(l)
                })
            });
        }
        // One worker's step: its batch in two parts, for the noise scale.
        let mut t = Trainer::new(Mlp::random(&sizes, 3));
        g.bench_function(BenchmarkId::new("cpu, in two parts", name), |b| {
            b.iter(|| {
                let l = t.compute_gradient_in_parts(&x, &labels, Some(&teacher), &loss, rows).unwrap();
                t.apply(0.01, 0.9).unwrap();
                black_box(l)
            })
        });
    }
    g.finish();
}

criterion_group!(benches, step);
criterion_main!(benches);
