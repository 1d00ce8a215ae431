//! The `edl` Python package and `edl-runtime launch`, as real processes.
//! The package is the workspace's `edl-python` build (`lib_edl.so`) with
//! its Python sources, in a virtual environment under the target directory
//! that gets NumPy and pytest from the package registry once.

use crate::support::{
    job::{
        Alone, GROWING, assert_exactly_once, assert_noise_scale_measured, committed_checkpoint, finish,
        lines, report,
    },
    process::{children, sigkill, sigkill_worker},
    python::{PyEnv, py},
    root,
    servers::RedisServer,
    wait::wait_for,
};
use edl_plugin_artifacts as art;
use edl_runtime::{checkpoint::Checkpoints, job::BuiltinModel, trainer::worker};
use std::{
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

#[test]
fn the_python_package_passes_its_tests() {
    let py = py();
    let out = py
        .python()
        .current_dir(root())
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "runtime/python/tests"])
        .env("EDL_RUNTIME", env!("CARGO_BIN_EXE_edl-runtime"))
        .env("EDL_TEST_POLICY", art::AUTOSCALE_WASM)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    assert!(text.contains("9 passed"), "{text}");
}

/// The flags both the NumPy student and the built-in one run with: three
/// epochs under the schedule policy (1 -> 2 -> 3 workers and back).
fn schedule() -> Vec<&'static str> {
    [&GROWING[..], &["--no-distill", "--report", "report.json", "--plugin-cache"]].concat()
}

fn numpy_student(py: &PyEnv, dir: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_edl-runtime"));
    c.current_dir(dir)
        .args(["launch", "--samples", "4000"])
        .args(schedule())
        .arg(dir.join("plugin-cache"))
        .args(["--", "python"])
        .arg(root().join("examples/numpy-mlp/train.py"))
        // Slow enough that the kills below land mid-job.
        .env("STEP_DELAY_MS", "10")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    py.env(&mut c);
    c
}

#[test]
fn the_numpy_student_under_launch_trains_every_sample_once_through_resizes_kills_and_a_restart() {
    let py = py();
    let dir = tempfile::tempdir().unwrap();
    let mut child = numpy_student(py, dir.path()).spawn().unwrap();
    let coordinator = child.id();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    // Grown to three workers (in one resize or two, as the workers come
    // ready): kill worker 1 (rank 0) with SIGKILL.
    wait_for(&rx, " -> 3 workers", &mut seen, Duration::from_secs(120));
    sigkill_worker(coordinator, 1);
    wait_for(&rx, "worker 1 lost", &mut seen, Duration::from_secs(120));
    // Then kill the whole job once a checkpoint is on disk (rank 0 writes
    // it after the coordinator has printed the epoch's end), and run it again.
    let written = committed_checkpoint(&dir.path().join(".edl/launch/checkpoints"), &mut child);
    // Its workers die with it.
    sigkill(coordinator);
    let _ = child.wait();

    let mut child = numpy_student(py, dir.path()).spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert!(status.success(), "{text}");
    assert!(text.contains("resuming job \"launch\""), "{text}");
    // The program's own output is shown, line by line, naming its worker.
    assert!(
        seen.iter().any(|l| l.starts_with("[worker ") && l.contains("test accuracy")),
        "the workers' output is streamed: {text}"
    );
    let r = report(dir.path());
    // From that checkpoint, or one written after it before the kill.
    let resumed = r["resumed_from_step"].as_u64().unwrap();
    assert!(resumed > 0 && resumed >= written, "{r}, a checkpoint at step {written}");
    let epochs = r["epochs"].as_array().unwrap();
    assert_eq!(epochs.len(), 3, "{epochs:?}");
    for e in epochs {
        assert_eq!(
            (e["samples_committed"].as_u64(), e["duplicates"].as_u64(), e["missing"].as_u64()),
            (Some(4000), Some(0), Some(0)),
            "{e}"
        );
    }
    let events = r["scale_events"].as_array().unwrap();
    let policy = events.iter().filter(|e| e["reason"].as_str().unwrap().starts_with("policy")).count();
    assert!(policy >= 2, "at least two policy-driven resizes: {events:?}");
    // `step.all_reduce` measured the gradient noise scale, as the built-in trainer does.
    assert_noise_scale_measured(&r, Alone::Unmeasured);

    // The program's final state is the built-in student's layout: its
    // accuracy against the built-in trainer's, same flags.
    let model = BuiltinModel::mnist5k();
    let (_, test) = worker::load_data(&model).unwrap();
    let final_state = Checkpoints::read(Path::new(r["final_checkpoint"].as_str().unwrap())).unwrap();
    let numpy_acc = worker::mlp_of(&final_state).unwrap().accuracy(&test) as f64;

    let builtin_dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_edl-runtime"))
        .current_dir(builtin_dir.path())
        .args(schedule())
        .arg(builtin_dir.path().join("plugin-cache"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let builtin = report(builtin_dir.path());
    assert_noise_scale_measured(&builtin, Alone::Measured);
    let builtin_acc = builtin["student_test_accuracy"].as_f64().unwrap();
    assert!(
        (numpy_acc - builtin_acc).abs() <= 0.01,
        "NumPy student {numpy_acc:.4}, built-in {builtin_acc:.4}: more than a point apart"
    );
    assert!(numpy_acc > 0.85, "{numpy_acc}");
}

/// A job launched without `--samples`: each worker's program declares the
/// size of its data set (`job.samples = N`, worker 1 `first`, the others
/// `rest`; nothing when 0). Returns whether the job succeeded, its output
/// and its report when there is one.
fn declared_samples(first: u32, rest: u32) -> (bool, String, Option<serde_json::Value>) {
    let py = py();
    let dir = tempfile::tempdir().unwrap();
    let program = dir.path().join("declare.py");
    std::fs::write(
        &program,
        "import os, numpy as np, edl\n\
         job = edl.Job.from_env()\n\
         if job is not None:\n\
         \x20   n = int(os.environ['FIRST'] if job.worker_id == 1 else os.environ['REST'])\n\
         \x20   if n:\n\
         \x20       job.samples = n\n\
         \x20   w = np.zeros(4, dtype=np.float32)\n\
         \x20   job.register('w', w)\n\
         \x20   for step in job.steps():\n\
         \x20       step.commit(loss=float(len(step.indices)))\n",
    )
    .unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_edl-runtime"));
    c.current_dir(dir.path())
        .args(["launch", "--min-workers", "2", "--max-workers", "2", "--batch", "8", "--epochs", "2"])
        .args(["--no-distill", "--report", "report.json", "--policy", art::SCHEDULE_WASM, "--plugin-cache"])
        .arg(dir.path().join("plugin-cache"))
        .args(["--", "python"])
        .arg(&program)
        .env("FIRST", first.to_string())
        .env("REST", rest.to_string())
        .stdin(Stdio::null());
    py.env(&mut c);
    let out = c.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let r = std::fs::read(dir.path().join("report.json")).ok().and_then(|b| serde_json::from_slice(&b).ok());
    (out.status.success(), text, r)
}

#[test]
fn a_job_without_samples_takes_its_programs_data_set_size_and_refuses_a_worker_that_differs() {
    // Both programs read 61 samples: the job's epochs are of 61.
    let (ok, text, r) = declared_samples(61, 61);
    assert!(ok, "{text}");
    assert!(text.contains("the job's samples: 61"), "{text}");
    let r = r.unwrap();
    for e in r["epochs"].as_array().unwrap() {
        assert_eq!((e["samples_committed"].as_u64(), e["missing"].as_u64()), (Some(61), Some(0)), "{e}");
    }
    // Two programs that read different data sets: the job stops, naming both sizes.
    let (ok, text, _) = declared_samples(61, 60);
    assert!(!ok, "{text}");
    assert!(text.contains("every worker must read the same data set"), "{text}");
    assert!(
        text.contains("declared 60 samples; the job has 61")
            || text.contains("declared 61 samples; the job has 60")
    );
    // A program that declares nothing, with no --samples: told what to do.
    let (ok, text, _) = declared_samples(0, 0);
    assert!(!ok, "{text}");
    assert!(
        text.contains("the job's samples are unknown") && text.contains("job.samples = len(dataset)"),
        "{text}"
    );
}

/// Programs under `launch`, started by command (not the coordinator's
/// children), follow a standby coordinator that takes the job over when the
/// active one is killed: the same processes finish the job, no checkpoint
/// is restored, and every sample is trained exactly once.
#[test]
fn launched_programs_follow_a_standby_coordinator_when_the_active_one_is_killed() {
    let py = py();
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let url = redis.url();
    let launch = |standby: bool| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_edl-runtime"));
        c.current_dir(dir.path())
            .args(["launch", "--samples", "4000", "--epochs", "4", "--no-distill", "--job", "followed"])
            .args(["--store", &url, "--scaler", "command", "--worker-command", "{program}"])
            .args(["--hosts", "here:2", "--workers", "2", "--min-workers", "2", "--max-workers", "2"])
            .args(["--policy", art::HOSTILE_POLICY_WASM, "--policy-config", "mode=hold"])
            .args(["--report", if standby { "standby.json" } else { "active.json" }])
            .arg("--plugin-cache")
            .arg(dir.path().join("plugin-cache"));
        if standby {
            c.arg("--standby");
        }
        c.args(["--", "python"])
            .arg(root().join("examples/numpy-mlp/train.py"))
            .env("STEP_DELAY_MS", "10")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        py.env(&mut c);
        c
    };
    let mut active = launch(false).spawn().unwrap();
    let rx = lines(&mut active);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(180));
    let mut standby = launch(true).spawn().unwrap();
    let rx_b = lines(&mut standby);
    let mut seen_b = Vec::new();
    wait_for(&rx_b, "standby", &mut seen_b, Duration::from_secs(120));
    // The programs, as the active coordinator started them.
    let programs: Vec<u32> = children(active.id()).into_iter().map(|(p, _)| p).collect();
    assert_eq!(programs.len(), 2, "{programs:?}");
    sigkill(active.id());
    let _ = active.wait();
    wait_for(&rx_b, "came back with its state", &mut seen_b, Duration::from_secs(120));
    wait_for(&rx_b, "epoch     ", &mut seen_b, Duration::from_secs(120));
    let alive = |p: &u32| Path::new(&format!("/proc/{p}")).exists();
    assert!(programs.iter().all(alive), "the programs kept running: {programs:?}");
    let status = finish(standby, rx_b, &mut seen_b);
    let text = seen_b.join("\n");
    assert!(status.success(), "{text}");
    assert!(!text.contains("resuming job"), "no checkpoint was restored:\n{text}");
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("standby.json")).unwrap()).unwrap();
    assert_exactly_once(&r, 4, 4000);
    let events = r["scale_events"].as_array().unwrap();
    let taken =
        events.iter().filter_map(|e| e["reason"].as_str()).filter(|r| r.starts_with("coordinator takeover"));
    assert_eq!(taken.count(), 1, "{events:?}");
    assert_eq!(r["workers_started"].as_array().unwrap().len(), 2, "{r}");
}

/// A program that raises at the same step every time it gets there.
const RAISES: &str = r#"
import numpy as np
import edl

job = edl.Job.from_env()
if job is None:
    raise SystemExit(0)
w = np.zeros(4, dtype=np.float32)
job.register("w", w)
for step in job.steps():
    g = np.ones(4, dtype=np.float32)
    if step.step == 5:
        raise ValueError("bad batch at step 5")
    if not step.all_reduce([g]):
        continue
    w -= 0.01 * g
    step.commit(loss=1.0)
"#;

/// `launch` of [`RAISES`] (written to `dir`), two workers held by the
/// policy, a checkpoint every 2 steps, with `flags`.
fn launch_raises(py: &PyEnv, dir: &Path, flags: &[&str]) -> Command {
    let program = dir.join("raises.py");
    std::fs::write(&program, RAISES).unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_edl-runtime"));
    c.current_dir(dir)
        .args(["launch", "--samples", "400", "--epochs", "2", "--batch", "40", "--no-distill"])
        .args(["--workers", "2", "--min-workers", "1", "--max-workers", "2", "--checkpoint-every-steps", "2"])
        .args(["--policy", art::HOSTILE_POLICY_WASM, "--policy-config", "mode=hold", "--plugin-cache"])
        .arg(dir.join("plugin-cache"))
        .args(flags)
        .args(["--", "python"])
        .arg(&program)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    py.env(&mut c);
    c
}

/// Every worker raising the same error from the same checkpoint: the job
/// goes back once (`--max-restarts` 1 by default), then ends with exit
/// status 1, the traceback in its error and its report.
#[test]
fn a_program_error_that_repeats_from_the_same_checkpoint_ends_the_job_with_its_traceback() {
    let py = py();
    let dir = tempfile::tempdir().unwrap();
    let mut child = launch_raises(py, dir.path(), &["--report", "report.json"]).spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert_eq!(status.code(), Some(1), "{text}");
    // Once from the checkpoint it fails from (twice where the first loss
    // came before the newest checkpoint was written); not after the last.
    let restarts = text.matches("restarting from the newest checkpoint").count();
    assert!((1..=2).contains(&restarts), "{restarts} restarts:\n{text}");
    assert!(text.contains("every worker failed with the same error 2 times in a row from step"), "{text}");
    assert!(text.contains("ValueError: bad batch at step 5"), "{text}");
    // One traceback for the one failure: the workers that failed alike and
    // the job's error name it, they do not print it again.
    assert_eq!(text.matches("Traceback (most recent call last)").count(), 1, "{text}");
    assert!(text.contains("its traceback is shown above (whole in "), "{text}");
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("report.json")).unwrap()).unwrap();
    assert_eq!(r["status"], "failed", "{r}");
    assert!(r["error"].as_str().unwrap().contains("ValueError: bad batch at step 5"), "{r}");
}

/// The same crash under a coordinator with a standby: the job ends failed
/// in the store too, and the standby that takes the lease does not start
/// it again (it would fail the same way) but says why and exits 1.
#[test]
fn a_standby_does_not_restart_a_job_that_failed_the_same_way_again_and_again() {
    let py = py();
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let url = redis.url();
    let shared = ["--job", "crashes", "--store", url.as_str(), "--report"];
    let launch = |standby: bool| {
        let role: &[&str] = if standby { &["standby.json", "--standby"] } else { &["active.json"] };
        launch_raises(py, dir.path(), &[&shared[..], role].concat())
    };
    let mut active = launch(false).spawn().unwrap();
    let rx = lines(&mut active);
    let mut seen = Vec::new();
    wait_for(&rx, "coordinator at", &mut seen, Duration::from_secs(120));
    let mut standby = launch(true).spawn().unwrap();
    let rx_b = lines(&mut standby);
    let mut seen_b = Vec::new();
    wait_for(&rx_b, "standby", &mut seen_b, Duration::from_secs(120));
    let status = finish(active, rx, &mut seen);
    assert_eq!(status.code(), Some(1), "{}", seen.join("\n"));
    let status = finish(standby, rx_b, &mut seen_b);
    let text = seen_b.join("\n");
    assert_eq!(status.code(), Some(1), "{text}");
    assert!(text.contains("failed under the coordinator before"), "{text}");
    assert!(text.contains("ValueError: bad batch at step 5") || text.contains("same error"), "{text}");
    assert!(!text.contains("restarting from the newest checkpoint"), "the standby trained it again:\n{text}");
}

/// A program that distils: each step asks the teachers for its samples'
/// logits (features made from the sample ids) and checks their shape.
const DISTILS: &str = r#"
import numpy as np
import edl

job = edl.Job.from_env()
w = np.zeros(4, dtype=np.float32)
job.register("w", w)
for step in job.steps():
    ids = np.asarray(step.indices, dtype=np.float32)
    x = np.sin(ids[:, None] * np.arange(1, 9, dtype=np.float32)[None, :] / 97.0)
    soft = step.teacher_logits(x)
    assert soft is not None and soft.shape == (len(ids), 3), soft
    if not step.all_reduce([np.zeros(4, dtype=np.float32)]):
        continue
    step.commit(loss=float(np.abs(soft).mean()))
"#;

/// Runs [`DISTILS`] under `launch` with `flags` (samples, epochs, batch,
/// job), two workers the policy holds, and what `more` adds; returns how it
/// ended and what it said.
fn run_distils(
    py: &PyEnv,
    d: &Path,
    flags: &[&str],
    more: impl FnOnce(&mut Command),
) -> (std::process::ExitStatus, String) {
    std::fs::write(d.join("distils.py"), DISTILS).unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_edl-runtime"));
    c.current_dir(d).arg("launch").args(flags);
    more(&mut c);
    c.args(["--workers", "2", "--min-workers", "2", "--max-workers", "2"])
        .args(["--policy", art::HOSTILE_POLICY_WASM, "--policy-config", "mode=hold", "--plugin-cache"])
        .arg(d.join("plugin-cache"))
        .args(["--", "python"])
        .arg(d.join("distils.py"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    py.env(&mut c);
    let mut child = c.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    let status = finish(child, rx, &mut seen);
    (status, seen.join("\n"))
}

/// An `edl-runtime teacher` of `model` on loopback: the process and its address.
fn loopback_teacher(model: &Path) -> (crate::support::KillOnDrop, String) {
    use std::io::BufRead;
    let mut t = Command::new(env!("CARGO_BIN_EXE_edl-runtime"))
        .args(["teacher", "--listen", "127.0.0.1:0", "--store", "memory", "--model"])
        .arg(model)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufReader::new(t.stdout.as_mut().unwrap()).read_line(&mut first).unwrap();
    let addr = first.split("serving on ").nth(1).and_then(|r| r.split_whitespace().next()).unwrap();
    (crate::support::KillOnDrop(t), addr.to_string())
}

#[test]
fn a_launched_program_distils_from_its_share_of_the_teachers() {
    let py = py();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = d.join("teacher.safetensors");
    edl_runtime::trainer::model::Mlp::random(&[8, 16, 3], 5).save(&model).unwrap();
    let (mut a, at_a) = loopback_teacher(&model);
    let (mut b, at_b) = loopback_teacher(&model);
    let flags = ["--samples", "400", "--epochs", "2", "--batch", "40", "--job", "dl"];
    let (status, said) = run_distils(py, d, &flags, |c| {
        c.args(["--teachers", &format!("{at_a},{at_b}"), "--report", "report.json"]).env("EDL_LOG", "info");
    });
    assert!(status.success(), "{said}");
    assert_exactly_once(&report(d), 2, 400);
    // Each student called one teacher, a different one each.
    let mut shares = Vec::new();
    for e in std::fs::read_dir(d.join(".edl/dl/logs")).unwrap().flatten() {
        let log = std::fs::read_to_string(e.path()).unwrap();
        if let Some(l) = log.lines().rev().find(|l| l.contains(" of 2 calls ")) {
            assert!(l.contains("calls 1 of 2 teachers"), "{l}");
            shares.push(l.rsplit(": ").next().unwrap().to_string());
        }
    }
    shares.sort();
    assert_eq!(shares.len(), 2, "{said}");
    assert_ne!(shares[0], shares[1], "{shares:?}");
    // Both served, and said what as they stopped.
    for t in [&mut a.0, &mut b.0] {
        unsafe { libc::kill(t.id() as i32, libc::SIGTERM) };
        let mut out = String::new();
        std::io::Read::read_to_string(t.stdout.as_mut().unwrap(), &mut out).unwrap();
        t.wait().unwrap();
        let rows = out
            .split(": served ")
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .and_then(|n| n.parse::<u64>().ok());
        assert!(rows.is_some_and(|n| n > 0), "{out}");
    }
}

#[test]
fn a_launched_program_s_teacher_pool_grows_while_its_students_wait() {
    let py = py();
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = d.join("teacher.safetensors");
    edl_runtime::trainer::model::Mlp::random(&[8, 16, 3], 5).save(&model).unwrap();
    // Teachers of 2 ms a row, started by the job; a free block of ports.
    let port = crate::support::free_ports(3);
    let teacher = format!(
        "exec {{exe}} teacher --listen {{addr}}:{{port}} --store memory --emulate-row-us 2000 --model {}",
        model.display()
    );
    let flags = ["--samples", "800", "--epochs", "6", "--batch", "80", "--job", "lp"];
    let (status, said) = run_distils(py, d, &flags, |c| {
        c.args(["--store", &redis.url(), "--report", "report.json", "--teacher-command", &teacher])
            .args([
                "--teacher-hosts",
                "127.0.0.1:3",
                "--teacher-port",
                &port.to_string(),
                "--max-teachers",
                "3",
            ])
            .args(["--teacher-policy", art::TEACHER_AUTOSCALE_WASM, "--teacher-decide-secs", "1"])
            .args(["--teacher-policy-config", "settle-secs=1"]);
    });
    assert!(status.success(), "{said}");
    let r = report(d);
    assert_exactly_once(&r, 6, 800);
    assert!(said.contains("teachers  a pool of 1..3"), "{said}");
    let events = r["teacher_events"].as_array().unwrap();
    let first = events.first().unwrap_or_else(|| panic!("the pool never changed:\n{said}"));
    assert_eq!((first["from"].as_u64(), first["to"].as_u64()), (Some(1), Some(2)), "{events:?}");
    assert!(first["reason"].as_str().unwrap().contains("students waited"), "{events:?}");
}

/// A program that prints a line at every step, slowly enough for the bar
/// to be drawn between them.
const CHATTY: &str = r#"
import time
import numpy as np
import edl

job = edl.Job.from_env()
if job is None:
    raise SystemExit(0)
w = np.zeros(4, dtype=np.float32)
job.register("w", w)
for step in job.steps():
    print(f"chatty line of step {step.step}", flush=True)
    time.sleep(0.03)
    g = np.ones(4, dtype=np.float32)
    if not step.all_reduce([g]):
        continue
    step.commit(loss=1.0)
"#;

/// What a terminal shows on each row of `raw`: carriage returns go back to
/// the row's start, `ESC[2K` clears it, `ESC[K` clears from the cursor on,
/// other escape sequences draw nothing, and text overwrites what is there.
fn terminal_rows(raw: &str) -> Vec<String> {
    let mut rows = Vec::new();
    for line in raw.split('\n') {
        let (mut row, mut at) = (Vec::<char>::new(), 0usize);
        let mut chars = line.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '\r' => at = 0,
                '\x1b' if chars.peek() == Some(&'[') => {
                    chars.next();
                    let mut params = String::new();
                    while let Some(&p) = chars.peek() {
                        chars.next();
                        if p.is_ascii_alphabetic() {
                            match (p, params.as_str()) {
                                ('K', "2") => row.clear(),
                                ('K', "" | "0") => row.truncate(at),
                                _ => {}
                            }
                            break;
                        }
                        params.push(p);
                    }
                }
                c => {
                    if at < row.len() {
                        row[at] = c;
                    } else {
                        row.push(c);
                    }
                    at += 1;
                }
            }
        }
        rows.push(row.into_iter().collect());
    }
    rows
}

/// At a terminal, a launched program's lines are written above the job's
/// progress bar: each on a row of its own, never over or after the bar.
#[test]
fn at_a_terminal_a_program_s_lines_go_above_the_progress_bar() {
    let py = py();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("chatty.py"), CHATTY).unwrap();
    let line = format!(
        "cd '{}' && exec '{}' launch --samples 400 --epochs 2 --batch 40 --no-distill --workers 1 \
         --max-workers 1 --plugin-cache plugin-cache -- python chatty.py",
        dir.path().display(),
        env!("CARGO_BIN_EXE_edl-runtime")
    );
    let mut c = Command::new("script");
    c.args(["-qfec", &line, "/dev/null"]);
    py.env(&mut c);
    let out = c.output().unwrap();
    let raw = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{raw}");
    assert!(raw.contains(" left "), "no progress bar was drawn: {raw}");
    let rows = terminal_rows(&raw);
    let printed: Vec<&String> = rows.iter().filter(|r| r.contains("chatty line of step")).collect();
    assert!(printed.len() >= 10, "the program's lines: {printed:?}\n{raw}");
    for row in printed {
        let shown = row.trim_end();
        assert!(
            shown.starts_with("[worker 1] chatty line of step") && !shown.contains('%'),
            "a program's line drawn over or beside the bar: {shown:?}"
        );
    }
}
