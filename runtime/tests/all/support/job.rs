//! The main job as a process: its command, its output as it comes, its end
//! and its report, and the exactly-once check on that report.

use crate::support::wait::poll_while_running;
use edl_plugin_artifacts as art;
use edl_runtime::checkpoint::Checkpoints;
use serde_json::Value;
use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

/// The job's command in `dir` (its own .edl/, teacher cache and checkpoints).
pub(crate) fn job(dir: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_edl-runtime"));
    c.current_dir(dir)
        .args([
            "--train-samples",
            "1200",
            "--batch",
            "40",
            "--teacher-hidden",
            "64",
            "--teacher-epochs",
            "2",
            "--teachers",
            "1",
            "--report",
            "report.json",
            "--plugin-cache",
        ])
        .arg(dir.join("plugin-cache"))
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Stdout lines of a running job, as they come.
pub(crate) fn lines(child: &mut Child) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                return;
            }
        }
    });
    rx
}

/// Waits for the job to end (bounded); returns its status and the rest of its output.
pub(crate) fn finish(
    mut child: Child,
    rx: mpsc::Receiver<String>,
    seen: &mut Vec<String>,
) -> std::process::ExitStatus {
    let until = Instant::now() + Duration::from_secs(240);
    loop {
        while let Ok(l) = rx.try_recv() {
            seen.push(l);
        }
        if let Some(status) = child.try_wait().unwrap() {
            while let Ok(l) = rx.recv_timeout(Duration::from_millis(200)) {
                seen.push(l);
            }
            if !status.success()
                && let Some(mut stderr) = child.stderr.take()
            {
                let mut err = String::new();
                use std::io::Read;
                let _ = stderr.read_to_string(&mut err);
                seen.push(format!("stderr: {err}"));
            }
            return status;
        }
        if Instant::now() > until {
            let _ = child.kill();
            panic!("the job did not end within 240 s:\n{}", seen.join("\n"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs a job to its end (bounded); its status and all it said.
pub(crate) fn run_to_end(mut c: Command) -> (std::process::ExitStatus, String) {
    let mut child = c.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    let status = finish(child, rx, &mut seen);
    (status, seen.join("\n"))
}

/// The report a job (or a launcher) wrote to `report.json` in `dir`.
pub(crate) fn report(dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join("report.json")).expect("the job wrote its report"))
        .unwrap()
}

/// Three epochs under the schedule policy, which grows the job 1 -> 2 -> 3
/// workers and shrinks it again, a decision every 4 steps.
pub(crate) const GROWING: [&str; 10] = [
    "--policy",
    art::SCHEDULE_WASM,
    "--policy-config",
    "every=8",
    "--decide-every-steps",
    "4",
    "--max-workers",
    "3",
    "--epochs",
    "3",
];

/// Every epoch, numbered in order: every training sample consumed by
/// exactly one committed step.
pub(crate) fn assert_exactly_once(r: &Value, epochs: u64, samples: u64) {
    let list = r["epochs"].as_array().unwrap();
    assert_eq!(list.len() as u64, epochs, "{list:?}");
    for (i, e) in list.iter().enumerate() {
        assert_eq!(e["epoch"], i as u64, "{e}");
        assert_eq!(e["samples_committed"], samples, "epoch {i}: {e}");
        assert_eq!(e["duplicates"], 0, "epoch {i}: {e}");
        assert_eq!(e["missing"], 0, "epoch {i}: {e}");
    }
}

/// Waits until `dir` holds a checkpoint that verifies; returns its step.
pub(crate) fn committed_checkpoint(dir: &Path, job: &mut Child) -> u64 {
    let store = Checkpoints::new(dir, 1);
    let check = || store.latest().ok()?.0.map(|r| r.manifest.step);
    let context = || format!("checkpoints in {}", dir.display());
    poll_while_running(job, "a checkpoint", Duration::from_secs(120), check, context)
}

/// Whether a job measures the gradient noise scale on one worker: the
/// built-in trainer does (two parts of its batch), a program only once two
/// ranks share a step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Alone {
    Measured,
    Unmeasured,
}

/// The gradient noise scale in a report's timeline of a job that grows to
/// two workers or more: on one worker measured or not as `alone` says
/// (a program's single rank has nothing to compare), and its smoothed
/// parts (`grad_var`, `grad_sqr`) finite on every step from the first
/// measured on. The noise scale itself, where given, is their ratio and
/// positive (it is left out while the smoothed `|G|^2` is not above 0,
/// which a short or noisy job may see throughout); with it, the step's
/// efficiency and goodput.
pub(crate) fn assert_noise_scale_measured(r: &Value, alone: Alone) {
    let timeline = r["timeline"].as_array().unwrap();
    let shared = timeline.iter().position(|s| s["world"].as_u64().unwrap() >= 2);
    let shared = shared.unwrap_or_else(|| panic!("no step with two workers: {timeline:?}"));
    let from = match alone {
        Alone::Unmeasured => {
            for s in &timeline[..shared] {
                assert!(
                    s.get("grad_var").is_none() && s.get("noise_scale").is_none(),
                    "measured on one worker: {s}"
                );
            }
            shared
        }
        Alone::Measured => 0,
    };
    let first = timeline[from..].iter().position(|s| s.get("grad_var").is_some());
    let first = first.unwrap_or_else(|| panic!("never measured: {:?}", &timeline[from..]));
    if alone == Alone::Measured && shared > 0 {
        assert!(first < shared, "not measured on one worker: {timeline:?}");
    }
    for s in &timeline[from + first..] {
        let (var, sqr) = (s["grad_var"].as_f64(), s["grad_sqr"].as_f64());
        let (var, sqr) = var.zip(sqr).unwrap_or_else(|| panic!("a measured step without its parts: {s}"));
        assert!(var.is_finite() && sqr.is_finite(), "{s}");
        if let Some(b) = s["noise_scale"].as_f64() {
            assert!(b > 0.0 && sqr > 0.0 && (b - var / sqr).abs() <= 1e-9 * b, "{s}");
        }
    }
    for s in timeline.iter().filter(|s| s.get("noise_scale").is_some()) {
        let (e, g) = (s["efficiency"].as_f64().unwrap(), s["goodput"].as_f64().unwrap());
        let rate = s["samples_per_sec"].as_f64().unwrap();
        assert!(e > 0.0 && e <= 1.0 + 1e-9, "{s}");
        assert!((g - rate * e).abs() <= 1e-6 * rate.max(1.0), "{s}");
    }
}

/// The final checkpoint's arrays of the job in `dir`, by name.
pub(crate) fn final_state(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let r = report(dir);
    let state = Checkpoints::read(Path::new(r["final_checkpoint"].as_str().unwrap())).unwrap();
    state.layout.ranges().map(|(t, at)| (t.name.clone(), state.values[at].to_vec())).collect()
}

/// The scale event of report `r` whose reason names `what` (a panic listing
/// them, and the job's output `text`, when none does).
pub(crate) fn scale_event<'a>(r: &'a Value, what: &str, text: &str) -> &'a Value {
    let events = r["scale_events"].as_array().unwrap();
    events
        .iter()
        .find(|e| e["reason"].as_str().unwrap().contains(what))
        .unwrap_or_else(|| panic!("no scale event for {what:?}: {events:?}\n{text}"))
}

/// The control port's and the rendezvous' addresses from the job's note
/// among the lines `seen` (`coordinator at ADDR (rendezvous ADDR); ...`).
pub(crate) fn coordinator_note(seen: &[String]) -> (String, String) {
    let line = seen.iter().find(|l| l.contains("coordinator at ")).expect("the coordinator's note");
    let field =
        |after: &str| line.split(after).nth(1).unwrap().split([' ', ')', ';']).next().unwrap().to_string();
    (field("coordinator at "), field("(rendezvous "))
}
