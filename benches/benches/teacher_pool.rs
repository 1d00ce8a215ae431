//! The seeds' table on this machine: the students' throughput with no
//! teachers, with the teacher computed in each student's own process (the
//! seeds' "same GPUs"), with fixed pools of 1, 2 and 4 teachers, and with the pool the
//! shipped teacher policy sizes (starting from 1), in one run, each against
//! the first. Teachers emulate an accelerator (`--teacher-emulate-row-us`:
//! a sleep per row, one batch at a time), so that the pool's size and not
//! the two cores sets their pace; the students' steps take a fixed
//! `--step-delay-ms` for the same reason.
//!
//!     cargo build --release -p edl-runtime && cargo bench -p edl-benches --bench teacher_pool [-- demand]
//!
//! For each row: committed samples per second over the steady part of the
//! job (from the report's timeline), its ratio to pure training, the
//! teacher-seconds it used (the pool's size over the job's training time,
//! from the report's teacher events), and for the policy's pool its
//! changes. Needs `redis-server` (the pool's students find teachers there).

use edl_benches::{RedisServer, release_runtime as runtime, steady_step_secs};
use std::{path::Path, process::Command};

/// Rows of each student's share a step, and the students.
const LOCAL_BATCH: u32 = 64;
const STUDENTS: u32 = 2;
/// Emulated time a teacher takes a row, and a student's step.
const ROW_US: &str = "250";
const STEP_MS: &str = "20";
/// The same for the change of demand: steps long enough that four students
/// on two cores still run at their emulated pace (so the rows asked of the
/// teachers do double), and teachers slow enough that four students need
/// about three.
const DEMAND_ROW_US: &str = "750";
const DEMAND_STEP_MS: &str = "60";

/// One job of the table: its flags beyond the common ones, and the
/// teachers' emulated time a row ("0": the model's real compute, on the
/// same two cores as the students).
struct Row {
    name: &'static str,
    flags: Vec<String>,
    row_us: &'static str,
}

fn rows() -> Vec<Row> {
    let fixed = |n: u32| Row { name: "", flags: vec!["--teachers".into(), n.to_string()], row_us: ROW_US };
    let mut out =
        vec![Row { name: "pure training (no teachers)", flags: vec!["--no-distill".into()], row_us: ROW_US }];
    // The seeds' "teacher and student on the same GPUs": the teacher on each
    // student's step path, on its (emulated) device.
    let same = |row_us| Row { name: "", flags: vec!["--teacher-in-process".into()], row_us };
    out.push(Row { name: "teacher in the student's process", ..same(ROW_US) });
    for (n, name) in [(1, "service, 1 teacher"), (2, "service, 2 teachers"), (4, "service, 4 teachers")] {
        out.push(Row { name, ..fixed(n) });
    }
    let policy = edl_plugin_artifacts::TEACHER_AUTOSCALE_WASM;
    let pooled = |name: &'static str, row_us: &'static str| Row {
        name,
        row_us,
        flags: [
            "--teachers",
            "1",
            "--max-teachers",
            "4",
            "--teacher-decide-secs",
            "1",
            "--teacher-policy",
            policy,
            "--teacher-policy-config",
            "busy=0.75",
        ]
        .map(String::from)
        .to_vec(),
    };
    out.push(pooled("service, the policy's pool (from 1, up to 4)", ROW_US));
    // The teachers' real compute, without the emulated accelerator.
    out.push(Row { name: "real compute: teacher in the student's process", ..same("0") });
    out.push(Row { name: "real compute: service, 1 teacher", row_us: "0", ..fixed(1) });
    out.push(pooled("real compute: the policy's pool (1 to 4)", "0"));
    out
}

/// Runs one job; returns (samples/s, teacher-seconds, the pool's changes).
fn run(dir: &Path, store: &str, row: &Row, job: &str) -> (f64, f64, Vec<String>) {
    let report = dir.join(format!("{job}.json"));
    let global = (LOCAL_BATCH * STUDENTS).to_string();
    let w = STUDENTS.to_string();
    let status = Command::new(runtime())
        .current_dir(dir)
        .args(["--store", store, "--job", job, "--epochs", "12", "--batch", &global])
        .args(["--workers", &w, "--min-workers", &w, "--max-workers", &w, "--step-delay-ms", STEP_MS])
        .args(["--teacher-emulate-row-us", row.row_us, "--teacher-hidden", "256", "--teacher-epochs", "3"])
        .args(&row.flags)
        .arg("--report")
        .arg(&report)
        .stdout(std::process::Stdio::null())
        .status()
        .expect("edl-runtime");
    assert!(status.success(), "{}: the job failed", row.name);
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let per_sec = (LOCAL_BATCH * STUDENTS) as f64 / steady_step_secs(&report);
    let start: f64 = match row.flags.iter().position(|f| f == "--teachers") {
        Some(i) => row.flags[i + 1].parse().unwrap(),
        None => 0.0,
    };
    let (used, changes) = teacher_seconds(&r, start);
    (per_sec, used, changes)
}

/// The teacher-seconds a job's pool used (from `start` teachers and the
/// report's teacher events), and its changes in words.
fn teacher_seconds(r: &serde_json::Value, start: f64) -> (f64, Vec<String>) {
    let secs = r["train_secs"].as_f64().unwrap_or(0.0);
    let events = r["teacher_events"].as_array().cloned().unwrap_or_default();
    // The pool's size over time, from its changes (seconds since its start,
    // which is within a second of training's).
    let (mut size, mut at, mut used) = (start, 0.0, 0.0);
    let mut changes = Vec::new();
    for e in &events {
        let t = e["secs"].as_f64().unwrap_or(0.0).min(secs);
        used += size * (t - at);
        (size, at) = (e["to"].as_f64().unwrap_or(size), t);
        changes.push(format!("{} -> {} at {:.1} s", e["from"], e["to"], t));
    }
    used += size * (secs - at).max(0.0);
    (used, changes)
}

/// A change of demand in the middle of a job: the students grow 2 -> 4
/// at step 100 (the `schedule` policy) keeping 64 rows each (the
/// `dynamic-batch` adapter), so the rows asked of the teachers double, and
/// shrink back at step 200. Returns the report.
fn demand_change(dir: &Path, store: &str, job: &str, flags: &[&str]) -> serde_json::Value {
    let report = dir.join(format!("{job}.json"));
    let global = (LOCAL_BATCH * STUDENTS).to_string();
    let status = Command::new(runtime())
        .current_dir(dir)
        .args(["--store", store, "--job", job, "--epochs", "16", "--batch", &global])
        .args([
            "--workers",
            "2",
            "--min-workers",
            "2",
            "--max-workers",
            "4",
            "--step-delay-ms",
            DEMAND_STEP_MS,
        ])
        .args(["--policy", edl_plugin_artifacts::SCHEDULE_WASM, "--policy-config", "every=100"])
        .args(["--policy-config", "by=2", "--decide-every-steps", "10"])
        .args(["--adapter", edl_plugin_artifacts::DYNAMIC_BATCH_WASM])
        .args(["--teacher-emulate-row-us", DEMAND_ROW_US, "--teacher-hidden", "256", "--teacher-epochs", "3"])
        .args(flags)
        .arg("--report")
        .arg(&report)
        .stdout(std::process::Stdio::null())
        .status()
        .expect("edl-runtime");
    assert!(status.success(), "{job}: the job failed");
    serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap()
}

/// The first scale-out of a report: (seconds, from, to).
fn scale_out(r: &serde_json::Value) -> (f64, u64, u64) {
    let events = r["scale_events"].as_array().expect("scale events");
    let e = events
        .iter()
        .find(|e| e["to"].as_u64() > e["from"].as_u64() && e["from"].as_u64() > Some(0))
        .expect("a scale-out in the middle of the job");
    (e["at_secs"].as_f64().unwrap(), e["from"].as_u64().unwrap(), e["to"].as_u64().unwrap())
}

/// Samples per second of the steps committed from `t0` on, until the next
/// scale event after it (each step's own rate, from the timeline).
fn rates_after(r: &serde_json::Value, t0: f64) -> Vec<(f64, f64)> {
    let until = r["scale_events"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["at_secs"].as_f64())
        .find(|&t| t > t0 + 1e-6)
        .unwrap_or(f64::MAX);
    let steps: Vec<(f64, f64)> = r["timeline"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["secs"].as_f64().unwrap(), s["samples_per_sec"].as_f64().unwrap_or(0.0)))
        .filter(|&(t, _)| t > t0 && t < until)
        .collect();
    steps
}

/// The median of `v`.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The second table: how fast the policy's pool follows a doubling of the
/// students' demand, against pure training through the same change.
fn the_demand_doubles(dir: &Path, store: &str) {
    println!();
    println!(
        "the students' demand doubles mid-job: 2 -> 4 students of {LOCAL_BATCH} rows a step of {DEMAND_STEP_MS} ms \
         at step 100, back at 200; teachers emulating {DEMAND_ROW_US} us a row"
    );
    let pure = demand_change(dir, store, "demand-pure", &["--no-distill"]);
    let policy = edl_plugin_artifacts::TEACHER_AUTOSCALE_WASM;
    let pooled = demand_change(
        dir,
        store,
        "demand-pool",
        &["--teachers", "2", "--max-teachers", "6", "--teacher-decide-secs", "1", "--teacher-policy", policy],
    );
    let (t_pure, from_pure, _) = scale_out(&pure);
    // Pure training's rate with four students, past the first second, and with two before.
    let target = median(rates_after(&pure, t_pure + 1.0).into_iter().map(|p| p.1).collect());
    let before = median(
        pure["timeline"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["secs"].as_f64().is_some_and(|t| t > 1.0 && t < t_pure))
            .filter_map(|s| s["samples_per_sec"].as_f64())
            .collect(),
    );
    let (t0, from, to) = scale_out(&pooled);
    let after = rates_after(&pooled, t0);
    // The first step from which the next five run at 0.95 of it or better.
    let reached = (0..after.len().saturating_sub(5))
        .find(|&i| median(after[i..i + 5].iter().map(|p| p.1).collect()) >= 0.95 * target)
        .map(|i| after[i].0 - t0);
    let steady = median(after.iter().filter(|p| p.0 > t0 + 1.0).map(|p| p.1).collect());
    let (used, changes) = teacher_seconds(&pooled, 2.0);
    println!("pure training: {before:.0} samples/s with {from_pure} students, {target:.0} with {to}");
    println!(
        "the policy's pool: students {from} -> {to} at {t0:.1} s; {}; {:.2}x of pure training from 1 s after; \
         {used:.1} teacher-seconds; {}",
        match reached {
            Some(s) => format!("0.95x of pure training {s:.1} s after the change"),
            None => "never at 0.95x of pure training".to_string(),
        },
        steady / target,
        changes.join(", ")
    );
}

fn main() {
    let (_redis, store) = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    // `cargo bench ... -- demand`: the second table only.
    if std::env::args().any(|a| a == "demand") {
        the_demand_doubles(dir.path(), &store);
        return;
    }
    println!(
        "{STUDENTS} students of {LOCAL_BATCH} rows a step of {STEP_MS} ms; teachers emulating {ROW_US} us a row"
    );
    println!("{:<46} {:>10} {:>8} {:>16}  pool", "", "samples/s", "ratio", "teacher-seconds");
    let mut base = None;
    for (i, row) in rows().iter().enumerate() {
        let (per_sec, used, changes) = run(dir.path(), &store, row, &format!("bench-{i}"));
        let b = *base.get_or_insert(per_sec);
        println!(
            "{:<46} {per_sec:>10.0} {:>7.2}x {used:>16.1}  {}",
            row.name,
            per_sec / b,
            changes.join(", ")
        );
    }
    the_demand_doubles(dir.path(), &store);
}
