//! Time to a target test accuracy of the built-in job (MNIST 5k, the
//! 784-128-10 student, no distillation) under fixed and adapted batches, in
//! one run: fixed global batches of 64, 256, 512 and 1024 with the learning
//! rate scaled linearly from 0.05 at 64 (and 64 at four times that rate);
//! `dynamic-batch` (each worker's batch kept, the rate ramped, on every
//! resize); and `goodput` (batch and rate from the noise scale and the
//! measured step times, up to `--batch-max 1024`; the rate by AdaScale's
//! gain, and again by the linear rule; and once with the goodput policy
//! choosing the workers too). Each job but the last runs under the schedule
//! policy (1 -> 2 -> 3 -> 4 workers and back, a decision every 4 steps) and
//! writes a checkpoint every few steps; the bench then reads every
//! checkpoint, measures its test accuracy on the 1000 held-out images, and
//! takes the training time of the first that reaches the target (the job's
//! own clock, from its report) and the samples trained on by then (the
//! steps' batches summed): their ratio between fixed batches is the
//! statistical efficiency the goodput model estimates.
//!
//!     cargo build --release -p edl-runtime && cargo bench -p edl-benches --bench goodput [-- STEP_MS]
//!
//! `STEP_MS` (default 0) adds a fixed time to every step, whatever its
//! batch: steps bound by communication or a fixed launch cost, as on
//! accelerators, where larger batches pay off; 0 is this CPU as it is.
//! `EDL_BENCH_ONLY=a,b` runs only the settings whose names contain `a` or `b`;
//! `EDL_BENCH_TARGET` (a fraction, 0.92 by default) and `EDL_BENCH_EPOCHS`
//! (12) set the target and the jobs' length. Each setting's first run is
//! drawn to `target/goodput-STEP_MSms.svg`: test accuracy over the job's
//! seconds.

use edl_benches::release_runtime as runtime;
use edl_runtime::{checkpoint::Checkpoints, job::BuiltinModel, trainer::worker};
use std::{path::Path, process::Command};

const TARGET: f64 = 0.92;
const EPOCHS: &str = "12";
const RUNS: usize = 2;

/// The target accuracy and the epochs: `EDL_BENCH_TARGET` and
/// `EDL_BENCH_EPOCHS` where set, else 92% in 12 epochs.
fn target_and_epochs() -> (f64, String) {
    let target = match std::env::var("EDL_BENCH_TARGET") {
        Ok(t) => match t.parse::<f64>() {
            Ok(v) if v > 0.0 && v <= 1.0 => v,
            _ => panic!("EDL_BENCH_TARGET={t}: a test accuracy as a fraction, above 0 and at most 1 (0.94)"),
        },
        Err(_) => TARGET,
    };
    (target, std::env::var("EDL_BENCH_EPOCHS").unwrap_or_else(|_| EPOCHS.into()))
}

struct Setting {
    name: &'static str,
    flags: Vec<String>,
    /// Steps between checkpoints.
    every: u32,
}

fn settings() -> Vec<Setting> {
    let s = |v: &[&str]| v.iter().map(|f| f.to_string()).collect::<Vec<_>>();
    let art = |name: &str| {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugins").join(name).display().to_string()
    };
    vec![
        Setting { name: "fixed 64, lr 0.05", flags: s(&["--batch", "64", "--lr", "0.05"]), every: 8 },
        Setting { name: "fixed 64, lr 0.2", flags: s(&["--batch", "64", "--lr", "0.2"]), every: 8 },
        Setting { name: "fixed 256, lr x 4", flags: s(&["--batch", "256", "--lr", "0.2"]), every: 2 },
        Setting { name: "fixed 512, lr x 8", flags: s(&["--batch", "512", "--lr", "0.4"]), every: 1 },
        Setting { name: "fixed 1024, lr x 16", flags: s(&["--batch", "1024", "--lr", "0.8"]), every: 1 },
        Setting {
            name: "dynamic-batch",
            flags: [s(&["--batch", "64", "--lr", "0.05", "--adapter"]), vec![art("dynamic-batch.wasm")]]
                .concat(),
            every: 4,
        },
        Setting {
            name: "goodput",
            flags: [
                s(&["--batch", "64", "--lr", "0.05", "--batch-max", "1024", "--adapter"]),
                vec![art("goodput.wasm")],
            ]
            .concat(),
            every: 2,
        },
        Setting {
            name: "goodput, lr-rule=linear",
            flags: [
                s(&[
                    "--batch",
                    "64",
                    "--lr",
                    "0.05",
                    "--batch-max",
                    "1024",
                    "--adapter-config",
                    "lr-rule=linear",
                ]),
                s(&["--adapter"]),
                vec![art("goodput.wasm")],
            ]
            .concat(),
            every: 2,
        },
        Setting {
            name: "goodput, with the goodput policy",
            flags: [
                s(&["--batch", "64", "--lr", "0.05", "--batch-max", "1024", "--adapter"]),
                vec![art("goodput.wasm"), "--policy".into(), art("goodput-policy.wasm")],
            ]
            .concat(),
            every: 2,
        },
    ]
}

/// What one run of a setting gave.
struct Outcome {
    /// Each checkpoint's (seconds, test accuracy), in time.
    curve: Vec<(f64, f64)>,
    /// Seconds to the target, and the samples trained on by then.
    reached: Option<(f64, u64)>,
    /// The best accuracy and its seconds.
    best: (f64, f64),
    steps: u64,
    last_batch: u64,
}

/// Runs one setting.
fn run(s: &Setting, step_ms: &str) -> Outcome {
    let dir = tempfile::tempdir().unwrap();
    // The schedule policy, unless the setting names its own.
    let schedule =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugins/schedule.wasm").display().to_string();
    let policy: Vec<String> = match s.flags.iter().any(|f| f == "--policy") {
        true => Vec::new(),
        false => vec!["--policy".into(), schedule, "--policy-config".into(), "every=8".into()],
    };
    let (target, epochs) = target_and_epochs();
    let out = Command::new(runtime())
        .current_dir(dir.path())
        .args(["--no-distill", "--epochs", &epochs, "--max-workers", "4", "--decide-every-steps", "4"])
        .args(&policy)
        .args(["--step-delay-ms", step_ms, "--keep-checkpoints", "100000"])
        .args(["--checkpoint-every-steps", &s.every.to_string(), "--report", "r.json"])
        .args(&s.flags)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}: {}", s.name, String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("r.json")).unwrap()).unwrap();
    let timeline = r["timeline"].as_array().unwrap();
    let secs_at = |step: u64| {
        timeline.iter().find(|t| t["step"].as_u64() == Some(step)).and_then(|t| t["secs"].as_f64())
    };
    let model = BuiltinModel::mnist5k();
    let (_, test) = worker::load_data(&model).unwrap();
    // Samples trained on by the end of each step: the steps' batches summed.
    let samples_by = |step: u64| -> u64 {
        timeline
            .iter()
            .take_while(|t| t["step"].as_u64().is_some_and(|s| s <= step))
            .filter_map(|t| t["batch"].as_u64())
            .sum()
    };
    let mut points: Vec<(f64, f64, u64)> = Vec::new();
    for entry in std::fs::read_dir(dir.path().join(".edl/mnist/checkpoints")).unwrap().flatten() {
        let Ok(c) = Checkpoints::read(&entry.path()) else { continue };
        let Some(secs) = secs_at(c.manifest.step) else { continue };
        let acc = worker::mlp_of(&c).unwrap().accuracy(&test) as f64;
        points.push((secs, acc, c.manifest.step));
    }
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    let reached = points.iter().find(|p| p.1 >= target).map(|p| (p.0, samples_by(p.2)));
    let best = points.iter().fold((0.0, 0.0), |b, p| if p.1 > b.0 { (p.1, p.0) } else { b });
    let last = timeline.last().unwrap();
    Outcome {
        curve: points.iter().map(|p| (p.0, p.1)).collect(),
        reached,
        best,
        steps: last["step"].as_u64().unwrap(),
        last_batch: last["batch"].as_u64().unwrap(),
    }
}

fn main() {
    let step_ms = std::env::args().skip(1).find(|a| !a.starts_with('-')).unwrap_or_else(|| "0".into());
    let (target, epochs) = target_and_epochs();
    println!(
        "time to {:.1}% test accuracy, {epochs} epochs, {RUNS} runs each, --step-delay-ms {step_ms}",
        target * 100.0
    );
    println!(
        "| setting | seconds to the target (each run) | samples to it, thousands | best accuracy (at s) | steps | last batch |"
    );
    println!("|---|---|---|---|---|---|");
    let mut fastest: Vec<(String, f64)> = Vec::new();
    let mut curves: Vec<edl_runtime::plot::Curve> = Vec::new();
    // The latest any setting's first run reached the target.
    let mut slowest = 0.0f64;
    let only = std::env::var("EDL_BENCH_ONLY").unwrap_or_default();
    for s in settings().into_iter().filter(|s| only.split(',').any(|o| s.name.contains(o))) {
        let runs: Vec<Outcome> = (0..RUNS).map(|_| run(&s, &step_ms)).collect();
        curves.push((s.name.to_string(), runs[0].curve.clone()));
        if let Some((t, _)) = runs[0].reached {
            slowest = slowest.max(t);
        }
        let each = |f: &dyn Fn(f64, u64) -> String| {
            runs.iter().map(|r| r.reached.map_or("not reached".into(), |(t, n)| f(t, n))).collect::<Vec<_>>()
        };
        let (secs, samples) =
            (each(&|t, _| format!("{t:.2}")), each(&|_, n| format!("{:.1}", n as f64 / 1e3)));
        let (best, at) = runs.iter().map(|r| r.best).fold((0.0, 0.0), |b, p| if p.0 > b.0 { p } else { b });
        let r = &runs[0];
        println!(
            "| {} | {} | {} | {:.2}% ({at:.1} s) | {} | {} |",
            s.name,
            secs.join(", "),
            samples.join(", "),
            best * 100.0,
            r.steps,
            r.last_batch
        );
        // A setting's time: the mean of its runs, when every run got there.
        let reached: Vec<f64> = runs.iter().filter_map(|r| r.reached.map(|(t, _)| t)).collect();
        if reached.len() == RUNS {
            fastest.push((s.name.to_string(), reached.iter().sum::<f64>() / RUNS as f64));
        }
    }
    // Each setting's first run, drawn: test accuracy against the job's
    // seconds, near the target (from 12 percentage points below it, to twice the time
    // of the slowest first run that reached it).
    let cut = if slowest > 0.0 { 2.0 * slowest } else { f64::INFINITY };
    for c in curves.iter_mut() {
        c.1.retain(|&(secs, acc)| secs <= cut && acc >= target - 0.12);
    }
    let svg = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../target/goodput-{step_ms}ms.svg"));
    let title = format!("test accuracy over time, --step-delay-ms {step_ms} (the first run of each)");
    let target_line = format!("target {:.0}%", target * 100.0);
    match edl_runtime::plot::curves(
        &svg,
        &title,
        ("seconds", "test accuracy"),
        &curves,
        Some((target, &target_line)),
    ) {
        Ok(()) => println!("drawn to {}", svg.display()),
        Err(e) => eprintln!("{e}"),
    }
    let fixed =
        fastest.iter().filter(|f| f.0.starts_with("fixed")).map(|f| f.1).fold(f64::INFINITY, f64::min);
    for g in fastest.iter().filter(|f| f.0.starts_with("goodput") && fixed.is_finite()) {
        println!("{} against the best fixed setting: {:.2}x sooner", g.0, fixed / g.1);
    }
}
