//! Parameter servers as real processes: a launched program's sparse tables
//! on the servers a job starts (`--ps-servers`), through a lost worker.

use crate::support::{
    job::{assert_exactly_once, finish, lines, report},
    python::{PyEnv, py},
    root,
    wait::wait_for,
};
use edl_plugin_artifacts as art;
use edl_runtime::checkpoint::Checkpoints;
use std::{
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

/// The wide-and-deep example, with worker 2 killing itself with SIGKILL in
/// the first step it starts once the file `die` exists, after its pushes and
/// before its all-reduce: the servers then hold an update of a step the job
/// will redo.
const DYING: &str = r#"
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import wide_deep
train_step = wide_deep.train_step
def dying(step, *args):
    loss = train_step(step, *args)
    if os.environ.get("EDL_WORKER_ID") == "2" and os.path.exists("die"):
        os.kill(os.getpid(), signal.SIGKILL)
    return loss
wide_deep.train_step = dying
sys.exit(wide_deep.main())
"#;

/// The wide-and-deep example on 6,000 synthetic rows (a vocabulary of 1,000
/// values per field), two servers, two workers and a warm spare, three
/// epochs, the policy holding the size.
fn ctr(py: &PyEnv, dir: &Path) -> Command {
    std::fs::write(dir.join("dying.py"), DYING).unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_edl-runtime"));
    c.current_dir(dir)
        .args(["launch", "--samples", "6000", "--ps-servers", "2", "--no-distill", "--epochs", "3"])
        .args(["--batch", "128", "--workers", "2", "--min-workers", "1", "--max-workers", "3"])
        .args(["--warm-spares", "1", "--policy", art::AUTOSCALE_WASM, "--decide-every", "100000"])
        .args(["--report", "report.json", "--plugin-cache"])
        .arg(dir.join("plugin-cache"))
        .args(["--", "python"])
        .arg(dir.join("dying.py"))
        .arg(root().join("examples/ctr"))
        .env("CTR_ROWS", "6000")
        .env("CTR_VOCAB", "1000")
        // Slow enough that the kill below lands mid-job.
        .env("STEP_DELAY_MS", "15")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    py.env(&mut c);
    c
}

/// The final checkpoint's arrays, by name.
fn final_state(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let r = report(dir);
    let state = Checkpoints::read(Path::new(r["final_checkpoint"].as_str().unwrap())).unwrap();
    state.layout.ranges().map(|(t, at)| (t.name.clone(), state.values[at].to_vec())).collect()
}

/// The test AUCs the workers printed as they ended.
fn aucs(text: &str) -> Vec<f64> {
    text.lines()
        .filter_map(|l| l.split("test AUC at the last epoch's start ").nth(1))
        .map(|v| v.trim().parse().unwrap_or_else(|e| panic!("{v:?}: {e}")))
        .collect()
}

#[test]
fn a_rank_killed_mid_job_costs_a_redone_step_and_the_model_ends_as_without_the_kill() {
    let py = py();
    // Undisturbed.
    let calm = tempfile::tempdir().unwrap();
    let mut child = ctr(py, calm.path()).spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert!(status.success(), "{text}");
    assert!(text.contains("ps        1 serving on 127.0.0.1:"), "{text}");
    assert_exactly_once(&report(calm.path()), 3, 6000);
    let calm_auc = aucs(&text);
    assert!(calm_auc.len() >= 2 && calm_auc.iter().all(|a| *a > 0.65), "{calm_auc:?}\n{text}");

    // Worker 2 dies mid-step once the spare is ready, after its pushes:
    // the spare takes its place, the steps its generation had not committed
    // are redone, and the servers undo what that generation applied after
    // its last commit.
    let hit = tempfile::tempdir().unwrap();
    let mut child = ctr(py, hit.path()).spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, "warm spare 3 ready", &mut seen, Duration::from_secs(120));
    std::fs::write(hit.path().join("die"), b"").unwrap();
    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert!(status.success(), "{text}");
    let r = report(hit.path());
    assert_exactly_once(&r, 3, 6000);
    let events = r["scale_events"].as_array().unwrap();
    let lost = events
        .iter()
        .find(|e| e["reason"].as_str().unwrap().contains("worker 2 lost"))
        .unwrap_or_else(|| panic!("{events:?}\n{text}"));
    assert_eq!((lost["from"].as_u64(), lost["to"].as_u64()), (Some(2), Some(2)), "{lost}");
    // Every dense array the same to the bit: each step's sparse update was
    // applied exactly once in the history the job kept (an update lost,
    // doubled or computed from rows of a dead generation would show in
    // the gradients of every step after it).
    let (a, b) = (final_state(calm.path()), final_state(hit.path()));
    assert_eq!(a.len(), b.len());
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        assert!(x == y, "{name} differs after the kill");
    }
    assert_eq!(aucs(&text), calm_auc[..aucs(&text).len()], "{text}");
}
