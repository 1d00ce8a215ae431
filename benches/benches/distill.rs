//! Service-based distillation benchmarks (a bench binary; prints tables).
//!
//!     cargo bench -p edl-benches --bench distill
//!
//! 1. Pipeline efficiency: samples/s the student sees with the DistillReader
//!    feeding it from 1, 2 and 4 teachers that each add 5 ms per request, as
//!    a ratio to reading the same data with no teachers, in the same run.
//!    The student's step is 10 ms per 256-sample batch (standing in for a
//!    training step on its own device).
//! 2. The teacher service alone: requests/s and latency percentiles for
//!    batch-32 MNIST-shaped requests from 8 concurrent clients on loopback.

use edl_plugin_sdk::{Batch, testing::standard_batch};
use edl_runtime::{
    distill::{
        DistillConfig, DistillReader, Teachers,
        oip::{self, GrpcInferenceServiceClient, pb},
        teacher::{Teacher, TeacherConfig, TeacherService},
    },
    trainer::model::Mlp,
};
use std::time::{Duration, Instant};

const BATCHES: usize = 60;
const STUDENT_STEP: Duration = Duration::from_millis(10);

fn data() -> Vec<Batch> {
    (0..BATCHES as u64)
        .map(|b| {
            let mut x = standard_batch();
            x.ids.iter_mut().for_each(|id| *id += b * 256);
            x
        })
        .collect()
}

fn model() -> Mlp {
    Mlp::random(&[784, 256, 10], 1)
}

/// Student-side samples/s over the data, fed by `reader` or directly.
async fn student(reader: Option<DistillReader>, data: &[Batch]) -> f64 {
    let start = Instant::now();
    let mut samples = 0usize;
    match reader {
        Some(mut r) => {
            while let Some(b) = r.next().await {
                samples += b.expect("distilled batch").batch.len();
                tokio::time::sleep(STUDENT_STEP).await;
            }
        }
        None => {
            for b in data {
                let b = std::hint::black_box(b.clone());
                samples += b.len();
                tokio::time::sleep(STUDENT_STEP).await;
            }
        }
    }
    samples as f64 / start.elapsed().as_secs_f64()
}

async fn pipeline() {
    let any = "127.0.0.1:0".parse().unwrap();
    let mut teachers = Vec::new();
    for _ in 0..4 {
        let cfg = TeacherConfig { extra_latency: Duration::from_millis(5), ..Default::default() };
        teachers.push(Teacher::start(any, TeacherService::new(model(), cfg), None).await.unwrap());
    }
    let data = data();
    let base = student(None, &data).await;
    println!(
        "## Pipeline efficiency (student step {STUDENT_STEP:?} per 256 samples, teachers +5 ms per request)\n"
    );
    println!("| teachers | in flight per teacher | teacher batch | samples/s | ratio to no teachers |");
    println!("| --- | --- | --- | --- | --- |");
    println!("| 0 (plain read) | - | - | {base:.0} | 1.00 |");
    for n in [1usize, 2, 4] {
        for in_flight in [1usize, 4] {
            let cfg = DistillConfig {
                teacher_batch: 64,
                in_flight_per_teacher: in_flight,
                read_ahead: 8,
                ..Default::default()
            };
            let list = Teachers::Fixed(teachers[..n].iter().map(|t| t.addr.to_string()).collect());
            let reader = DistillReader::start(data.clone().into_iter(), None, list, cfg);
            let rate = student(Some(reader), &data).await;
            println!("| {n} | {in_flight} | 64 | {rate:.0} | {:.2} |", rate / base);
        }
    }
    for t in teachers {
        t.shutdown().await;
    }
}

async fn service() {
    let t = Teacher::start(
        "127.0.0.1:0".parse().unwrap(),
        TeacherService::new(model(), TeacherConfig::default()),
        None,
    )
    .await
    .unwrap();
    let x: Vec<f32> = (0..32 * 784).map(|i| (i % 255) as f32 / 255.0).collect();
    let req = pb::ModelInferRequest {
        model_name: "teacher".into(),
        inputs: vec![pb::model_infer_request::InferInputTensor {
            name: "input".into(),
            datatype: "FP32".into(),
            shape: vec![32, 784],
            ..Default::default()
        }],
        raw_input_contents: vec![oip::f32_bytes(&x)],
        ..Default::default()
    };
    let run_for = Duration::from_secs(3);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (addr, req) = (t.addr, req.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = GrpcInferenceServiceClient::connect(format!("http://{addr}")).await.unwrap();
            let mut lat = Vec::new();
            while start.elapsed() < run_for {
                let t0 = Instant::now();
                c.model_infer(req.clone()).await.unwrap();
                lat.push(t0.elapsed());
            }
            lat
        }));
    }
    let mut lat: Vec<Duration> = Vec::new();
    for task in tasks {
        lat.extend(task.await.unwrap());
    }
    let secs = start.elapsed().as_secs_f64();
    lat.sort();
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    println!("\n## Teacher service (784-256-10 MLP, batch 32, 8 concurrent clients, loopback)\n");
    println!("| requests/s | samples/s | p50 | p99 |");
    println!("| --- | --- | --- | --- |");
    println!(
        "| {:.0} | {:.0} | {:.2} ms | {:.2} ms |",
        lat.len() as f64 / secs,
        lat.len() as f64 * 32.0 / secs,
        pct(0.50).as_secs_f64() * 1e3,
        pct(0.99).as_secs_f64() * 1e3
    );
    t.shutdown().await;
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` does not, and only
    // checks that the binary runs.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    rt.block_on(async {
        pipeline().await;
        service().await;
    });
}
