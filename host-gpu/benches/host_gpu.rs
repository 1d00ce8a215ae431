//! host-gpu benchmarks.
//!
//!     cargo bench -p edl-host-gpu --bench host_gpu
//!
//! - `soft-label/*`: bytes moved per second (student and teacher read, gradient
//!   written: 12 bytes per element) by the fused CPU loss, the naive
//!   three-pass version, and the CUDA kernel where a GPU is present.
//! - `all-reduce/*`: bus bandwidth (algorithm bandwidth x 2(n-1)/n) of the TCP
//!   ring on loopback, plain, authenticated (`-authenticated`: the default of
//!   a job with a secret) and encrypted (`-encrypted`), and `tcp-stream`: one
//!   plain TCP stream on loopback, measured in the same run.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use edl_host_gpu::comm::auth::{JobAuth, Secret};
use edl_host_gpu::comm::{Communicator, LocalRendezvous, ReduceOp, RingOptions, TcpRing};
use edl_host_gpu::device::check_cuda;
use edl_host_gpu::loss::{Batch, CudaSoftLabel, DeviceBatch, SoftLabelLoss, Teacher, naive_three_pass};
use std::{
    hint::black_box,
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    time::{Duration, Instant},
};

fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 16.0 - 8.0
        })
        .collect()
}

fn soft_label(c: &mut Criterion) {
    let p = SoftLabelLoss { temperature: 4.0, alpha: 0.9 };
    let cuda = match check_cuda(0) {
        Ok(()) => CudaSoftLabel::new(0).ok(),
        Err(why) => {
            eprintln!("soft-label/cuda skipped: {why}");
            None
        }
    };
    let mut g = c.benchmark_group("soft-label");
    for (rows, classes) in [(1024usize, 10usize), (1024, 100), (4096, 1000), (512, 50_000)] {
        let n = rows * classes;
        let (z, t) = (data(n, 1), data(n, 2));
        let labels: Vec<u32> = (0..rows).map(|r| (r % classes) as u32).collect();
        let b = Batch { student: &z, teacher: Teacher::Logits(&t), labels: Some(&labels), rows, classes };
        let mut grad = vec![0f32; n];
        g.throughput(Throughput::Bytes(12 * n as u64));
        let id = format!("{rows}x{classes}");
        g.bench_function(BenchmarkId::new("fused-cpu", &id), |bench| {
            bench.iter(|| p.forward_backward(black_box(&b), &mut grad).unwrap())
        });
        g.bench_function(BenchmarkId::new("naive-cpu", &id), |bench| {
            bench.iter(|| naive_three_pass(&p, black_box(&b), &mut grad).unwrap())
        });
        if let Some(k) = &cuda {
            let s = k.stream();
            let (dz, dt) = (s.clone_htod(&z).unwrap(), s.clone_htod(&t).unwrap());
            let dl = s.clone_htod(&labels).unwrap();
            let mut dg = s.alloc_zeros::<f32>(n).unwrap();
            let mut rl = s.alloc_zeros::<f32>(rows).unwrap();
            let db = DeviceBatch {
                student: &dz,
                teacher: &dt,
                teacher_is_probs: false,
                labels: Some(&dl),
                rows,
                classes,
            };
            // Each iteration synchronises (the mean loss is copied back).
            g.bench_function(BenchmarkId::new("cuda", &id), |bench| {
                bench.iter(|| k.forward_backward_device(&p, &db, &mut dg, &mut rl).unwrap())
            });
        }
    }
    g.finish();
}

const RING_BYTES: usize = 16 << 20;
/// The built-in job's student (784-128-10): its gradient, all-reduced every step.
const STUDENT_VALUES: usize = 784 * 128 + 128 + 128 * 10 + 10;

/// `iters` all-reduces of `values` floats on a ring of `n` threads, timed
/// on rank 0 from a barrier to the end; with a job's secret the links are
/// proven and every frame authenticated (`encrypt`: and encrypted), as in a
/// job across hosts.
fn time_ring(n: usize, values: usize, iters: u64, secret: bool, encrypt: bool) -> Duration {
    let rdv = LocalRendezvous::new();
    let auth = secret.then(|| (JobAuth { job: "bench".into(), secret: Secret::generate().unwrap() }, 0));
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let rdv = rdv.clone();
                let opts = RingOptions { auth: auth.clone(), encrypt, ..RingOptions::default() };
                s.spawn(move || {
                    let mut ring = TcpRing::connect(rank, n, &rdv, opts).unwrap();
                    let mut buf = vec![1f32; values];
                    ring.barrier().unwrap();
                    let start = Instant::now();
                    for _ in 0..iters {
                        ring.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                    }
                    start.elapsed()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).max().unwrap()
    })
}

/// `iters` transfers of 16 MiB over one loopback TCP stream.
fn time_stream(iters: u64) -> Duration {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let reader = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = vec![0u8; RING_BYTES];
        for _ in 0..iters {
            s.read_exact(&mut buf).unwrap();
        }
        s.write_all(&[1]).unwrap();
    });
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    let buf = vec![1u8; RING_BYTES];
    let start = Instant::now();
    for _ in 0..iters {
        s.write_all(&buf).unwrap();
    }
    let mut ack = [0u8];
    s.read_exact(&mut ack).unwrap();
    let took = start.elapsed();
    reader.join().unwrap();
    took
}

fn all_reduce(c: &mut Criterion) {
    let mut g = c.benchmark_group("all-reduce");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(RING_BYTES as u64));
    g.bench_function("tcp-stream", |b| b.iter_custom(time_stream));
    for n in [2usize, 4] {
        // Bus bandwidth: what each link carries, comparable across n.
        g.throughput(Throughput::Bytes((RING_BYTES * 2 * (n - 1) / n) as u64));
        for (name, secret, encrypt) in [
            ("ring-busbw", false, false),
            ("ring-busbw-authenticated", true, false),
            ("ring-busbw-encrypted", true, true),
        ] {
            g.bench_function(BenchmarkId::new(name, n), |b| {
                b.iter_custom(|iters| time_ring(n, RING_BYTES / 4, iters, secret, encrypt))
            });
        }
    }
    // A step's gradient of the built-in student: where a fixed cost per
    // operation shows.
    g.throughput(Throughput::Bytes((STUDENT_VALUES * 4) as u64));
    g.bench_function(BenchmarkId::new("ring-student-gradient-authenticated", 2), |b| {
        b.iter_custom(|iters| time_ring(2, STUDENT_VALUES, iters, true, false))
    });
    g.finish();
}

criterion_group!(benches, soft_label, all_reduce);
criterion_main!(benches);
