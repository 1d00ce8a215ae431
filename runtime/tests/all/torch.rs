//! PyTorch programs under `edl-runtime launch`, for real
//! (`tests/programs/torch_state.py`): a CNN with BatchNorm, AdamW or
//! RMSprop and a cosine schedule, whole in `edl.torch.ElasticState`,
//! trained with DDP over the gloo process group `edl.torch` builds for each
//! generation on the job's authenticated store.

use crate::elastic::{finish, lines, report, wait_for};
use crate::python::{PyEnv, committed_checkpoint, sigkill, sigkill_worker, torch_py};
use edl_plugin_artifacts as art;
use serde_json::Value;
use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

fn program() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/torch_state.py")
}

/// The job: 2 to 3 workers under the schedule policy, on the first
/// `samples` of digits' 1397, in global batches of `batch`.
fn job(py: &PyEnv, dir: &Path, optimizer: &str, epochs: u32, samples: u32, batch: u32) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_edl-runtime"));
    c.current_dir(dir)
        .arg("launch")
        .args(["--samples", &samples.to_string(), "--batch", &batch.to_string()])
        .args(["--min-workers", "2", "--max-workers", "3"])
        .args(["--policy", art::SCHEDULE_WASM, "--policy-config", "every=8", "--decide-every-steps", "4"])
        .arg("--epochs")
        .arg(epochs.to_string())
        .args(["--no-distill", "--report", "report.json", "--plot", "run.svg", "--plugin-cache"])
        .arg(dir.join("plugin-cache"))
        .args(["--", "python"])
        .arg(program())
        .env("OPTIMIZER", optimizer)
        .env("EPOCHS", epochs.to_string())
        // Slow enough for a third worker (PyTorch takes seconds to import)
        // to join, and for the kills to land mid-job.
        .env("STEP_DELAY_MS", "60")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    py.env(&mut c);
    c
}

/// The value after `key ` in `line`, up to the next `;`.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let rest = line.split_once(&format!("{key} "))?.1;
    Some(rest.split(';').next()?.trim().trim_end_matches('%'))
}

/// The workers that ended with the job having trained: (params digest, accuracy).
fn finishers(lines: &[String]) -> Vec<(String, f64)> {
    lines
        .iter()
        .filter(|l| l.contains(": the job is done; generations "))
        .filter(|l| field(l, "generations").is_some_and(|g| g != "0"))
        .filter_map(|l| Some((field(l, "params")?.to_string(), field(l, "test accuracy")?.parse().ok()?)))
        .collect()
}

fn every_sample_once(r: &Value, epochs: usize, samples: u64) {
    let done = r["epochs"].as_array().unwrap();
    assert_eq!(done.len(), epochs, "{done:?}");
    for e in done {
        assert_eq!(
            (e["samples_committed"].as_u64(), e["duplicates"].as_u64(), e["missing"].as_u64()),
            (Some(samples), Some(0), Some(0)),
            "{e}"
        );
    }
}

#[test]
fn the_torch_module_passes_its_tests() {
    let out = torch_py()
        .python()
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap())
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "runtime/python/tests/test_torch.py"])
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    assert!(text.contains(" passed") && !text.contains("skipped"), "{text}");
}

#[test]
fn a_cnn_with_batchnorm_adamw_and_a_schedule_trains_whole_through_resizes_and_a_kill() {
    let py = torch_py();
    let dir = tempfile::tempdir().unwrap();
    // 1396 samples in steps of 93: each epoch ends with a step of one
    // sample, where a rank has none and still takes part in DDP.
    let mut child = job(py, dir.path(), "adamw", 6, 1396, 93).env("HOLD_UNTIL_WORLD", "3").spawn().unwrap();
    let coordinator = child.id();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    // Grown to three workers: kill one with SIGKILL, mid-collective as
    // likely as not; the others' collectives fail and the step is redone.
    wait_for(&rx, " -> 3 workers", &mut seen, Duration::from_secs(180));
    let id = 2;
    sigkill_worker(coordinator, id);
    wait_for(&rx, &format!("worker {id} lost"), &mut seen, Duration::from_secs(120));
    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert!(status.success(), "{text}");
    let r = report(dir.path());
    every_sample_once(&r, 6, 1396);
    let events = r["scale_events"].as_array().unwrap();
    assert!(events.iter().any(|e| e["reason"].as_str().unwrap().starts_with("policy")), "{events:?}");
    // The program's own metric (`step.commit(loss=..., accuracy=...)`): in
    // the live progress, in every step of the report, in the plot.
    assert!(seen.iter().any(|l| l.starts_with("progress") && l.contains("| accuracy 0.")), "{text}");
    let timeline = r["timeline"].as_array().unwrap();
    let last = timeline.last().unwrap()["metrics"]["accuracy"].as_f64().unwrap();
    assert!(timeline.iter().all(|s| s["metrics"]["accuracy"].is_number()), "{r}");
    assert!(last > 0.8 && last <= 1.0, "the last step's training accuracy {last}");
    let svg = std::fs::read_to_string(dir.path().join("run.svg")).unwrap();
    assert!(svg.contains("accuracy"), "the plot names the metric");

    // The workers that ended together hold one model: the reductions
    // agreed in every generation, the redone steps included.
    let done = finishers(&seen);
    assert!(done.len() >= 2, "two workers at the end: {text}");
    assert!(done.iter().all(|f| f.0 == done[0].0), "the final workers' models differ: {done:?}");
    assert!(done[0].1 > 85.0, "test accuracy {}: {text}", done[0].1);

    // The final checkpoint, loaded into a plain PyTorch model, optimizer
    // and scheduler: the same parameters, the same accuracy (within a
    // point: BatchNorm's running statistics are rank 0's), and an optimizer
    // and a schedule that stepped once per committed step.
    let ckpt = r["final_checkpoint"].as_str().unwrap();
    let mut check = Command::new(py.bin().join("python"));
    py.env(&mut check);
    let out = check.arg(program()).args(["--check", ckpt]).env("EPOCHS", "6").output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert_eq!(field(&said, "params"), Some(done[0].0.as_str()), "{said}");
    let acc: f64 = field(&said, "test accuracy").unwrap().parse().unwrap();
    assert!((acc - done[0].1).abs() <= 1.0, "checkpoint {acc}, workers {}: {said}", done[0].1);
    let steps = r["steps"].as_u64().unwrap().to_string();
    assert_eq!(field(&said, "optimizer steps"), Some(steps.as_str()), "{said}");
    assert_eq!(field(&said, "scheduler steps"), Some(steps.as_str()), "{said}");
}

#[test]
fn a_killed_rmsprop_job_resumes_with_its_optimizer_and_schedule_where_they_were() {
    let py = torch_py();
    let dir = tempfile::tempdir().unwrap();
    let mut child = job(py, dir.path(), "rmsprop", 4, 1397, 64).spawn().unwrap();
    let coordinator = child.id();
    let _rx = lines(&mut child);
    let written = committed_checkpoint(&dir.path().join(".edl/launch/checkpoints"), &mut child);
    // Its workers die with it.
    sigkill(coordinator);
    let _ = child.wait();

    let mut child = job(py, dir.path(), "rmsprop", 4, 1397, 64).spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert!(status.success(), "{text}");
    let r = report(dir.path());
    let resumed = r["resumed_from_step"].as_u64().unwrap();
    assert!(resumed > 0 && resumed >= written, "{r}, a checkpoint at step {written}");
    every_sample_once(&r, 4, 1397);
    // Each worker's first step (the resumed one, or a later one for a
    // worker that joined later) finds RMSprop's state (made lazily by
    // PyTorch, here from the start) and the schedule as the checkpoint or
    // its peers had them: one optimizer and one scheduler step per committed
    // step. A reset optimizer or schedule would say 0.
    let firsts: Vec<&String> = seen.iter().filter(|l| l.contains(": first step ")).collect();
    assert!(firsts.iter().any(|l| field(l, "first step") == Some(&resumed.to_string())), "{text}");
    for l in firsts {
        let step = field(l, "first step").unwrap();
        assert_eq!(field(l, "optimizer steps"), Some(step), "{l}");
        assert_eq!(field(l, "scheduler steps"), Some(step), "{l}");
    }
    let done = finishers(&seen);
    assert!(done.len() >= 2 && done.iter().all(|f| f.0 == done[0].0), "{done:?}: {text}");
}
