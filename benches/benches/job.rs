//! Job efficiency: what share of an elastic job's step is training.
//!
//!     cargo build --release -p edl-runtime && cargo bench -p edl-benches --bench job
//!
//! For each global batch, side by side in one run:
//! - the trainer's step alone (forward, backward, SGD with momentum of the
//!   default student on the job's own training batches, hard labels, one
//!   thread), the median of many;
//! - the default job with one worker and no teachers
//!   (`edl-runtime --no-distill --max-workers 1`, policy, checkpoints and
//!   store as shipped), its steady-state time per step: the seconds between
//!   the committed steps of the report's timeline after the first fifth,
//!   divided by their count; the median of three runs.
//!
//! Efficiency is trainer step / job step (1.0: the job adds nothing).

use edl_host_gpu::loss::SoftLabelLoss;
use edl_runtime::trainer::{
    data::{self, Dataset, Source},
    model::Mlp,
    train::Trainer,
};
use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

/// The job's training set: mnist5k less its 1000 test rows, split as the job splits it.
fn training_set() -> Dataset {
    let (train, _) = Dataset::load(Source::Mnist5k).expect("the shipped data set").split(1000, 1);
    train
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median seconds of one trainer step on the epoch's batches, in order.
fn trainer_step(train: &Dataset, batch: usize) -> f64 {
    let perm = data::permutation(train.len(), 1, 0);
    let batches: Vec<(Vec<f32>, Vec<u32>)> = perm.chunks(batch).map(|ids| train.gather(ids)).collect();
    let mut t = Trainer::new(Mlp::random(&[784, 128, 10], 1));
    let loss = SoftLabelLoss { temperature: 4.0, alpha: 0.7 };
    let mut times = Vec::new();
    let rounds = (4000 / batches.len()).max(20);
    for i in 0..rounds * batches.len() {
        let (x, y) = &batches[i % batches.len()];
        let start = Instant::now();
        t.compute_gradient(x, y, None, &loss, y.len()).expect("a well-formed batch");
        t.apply(0.01, 0.9).expect("cpu");
        times.push(start.elapsed().as_secs_f64());
    }
    median(times)
}

fn binary() -> PathBuf {
    // target/release/deps/job-<hash> -> target/release/edl-runtime
    let exe = std::env::current_exe().expect("the bench's path");
    let bin = exe.parent().and_then(Path::parent).map(|d| d.join("edl-runtime"));
    match bin {
        Some(b) if b.exists() => b,
        _ => panic!("build the runtime first: cargo build --release -p edl-runtime"),
    }
}

/// Steady-state seconds per committed step of one run of the default job.
fn job_step(bin: &Path, batch: usize, epochs: u32, dir: &Path) -> f64 {
    let report = dir.join(format!("report-b{batch}.json"));
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace");
    let out = Command::new(bin)
        .current_dir(root)
        .args(["--no-distill", "--max-workers", "1", "--job", &format!("bench-job-b{batch}")])
        .args(["--batch", &batch.to_string(), "--epochs", &epochs.to_string()])
        .arg("--checkpoint-dir")
        .arg(dir.join(format!("ckpt-b{batch}")))
        .arg("--report")
        .arg(&report)
        .output()
        .expect("the runtime runs");
    assert!(out.status.success(), "the job failed: {}", String::from_utf8_lossy(&out.stderr));
    edl_benches::steady_step_secs(&report)
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` does not: nothing to measure then.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let train = training_set();
    let bin = binary();
    let dir = tempfile::tempdir().expect("a scratch directory");
    println!("| global batch | trainer step | job step | efficiency | samples/s (job) |");
    println!("|---|---|---|---|---|");
    for (batch, epochs) in [(64usize, 30u32), (512, 100)] {
        let trainer = trainer_step(&train, batch);
        let job = median((0..3).map(|_| job_step(&bin, batch, epochs, dir.path())).collect());
        println!(
            "| {batch} | {:.3} ms | {:.3} ms | {:.2} | {:.0} |",
            trainer * 1e3,
            job * 1e3,
            trainer / job,
            batch as f64 / job
        );
    }
}
