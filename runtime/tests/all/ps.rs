//! Parameter servers as real processes: a launched program's sparse tables
//! on the servers a job starts (`--ps-servers`), through a lost worker.

use crate::support::{
    job::{assert_exactly_once, committed_checkpoint, finish, lines, report},
    process::sigkill,
    python::{PyEnv, py},
    root,
    wait::wait_for,
};
use edl_plugin_artifacts as art;
use edl_runtime::checkpoint::Checkpoints;
use std::{
    path::Path,
    process::{Command, Stdio},
    sync::OnceLock,
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
fn ctr(py: &PyEnv, dir: &Path, servers: &str) -> Command {
    std::fs::write(dir.join("dying.py"), DYING).unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_edl-runtime"));
    c.current_dir(dir)
        .args(["launch", "--samples", "6000", "--ps-servers", servers, "--no-distill", "--epochs", "3"])
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

/// The job run undisturbed, once per test run: its final arrays and the
/// AUCs its workers printed.
fn calm() -> &'static (Vec<(String, Vec<f32>)>, Vec<f64>) {
    static CALM: OnceLock<(Vec<(String, Vec<f32>)>, Vec<f64>)> = OnceLock::new();
    CALM.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let mut child = ctr(py(), dir.path(), "2").spawn().unwrap();
        let rx = lines(&mut child);
        let mut seen = Vec::new();
        let status = finish(child, rx, &mut seen);
        let text = seen.join("\n");
        assert!(status.success(), "{text}");
        assert!(text.contains("ps        1 serving on 127.0.0.1:"), "{text}");
        assert_exactly_once(&report(dir.path()), 3, 6000);
        let auc = aucs(&text);
        assert!(auc.len() >= 2 && auc.iter().all(|a| *a > 0.65), "{auc:?}\n{text}");
        (final_state(dir.path()), auc)
    })
}

/// Every dense array the same to the bit as the undisturbed run's: each
/// step's sparse update was applied exactly once in the history the job
/// kept (an update lost, doubled or computed from rows of a dead
/// generation would show in the gradients of every step after it).
fn assert_as_calm(dir: &Path, text: &str) {
    let (a, b) = (&calm().0, final_state(dir));
    assert_eq!(a.len(), b.len());
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        assert!(x == y, "{name} differs from the undisturbed run's");
    }
    let auc = aucs(text);
    assert!(!auc.is_empty() && auc[..] == calm().1[..auc.len()], "{auc:?} {:?}\n{text}", calm().1);
}

#[test]
fn a_rank_killed_mid_job_costs_a_redone_step_and_the_model_ends_as_without_the_kill() {
    let py = py();
    // Worker 2 dies mid-step once the spare is ready, after its pushes:
    // the spare takes its place, the steps its generation had not committed
    // are redone, and the servers undo what that generation applied after
    // its last commit.
    let hit = tempfile::tempdir().unwrap();
    let mut child = ctr(py, hit.path(), "2").spawn().unwrap();
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
    assert_as_calm(hit.path(), &text);
}

#[test]
fn a_killed_job_resumes_its_tables_from_the_checkpoint_on_three_servers_as_if_never_stopped() {
    let py = py();
    let dir = tempfile::tempdir().unwrap();
    let mut child = ctr(py, dir.path(), "2").spawn().unwrap();
    let coordinator = child.id();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(120));
    let written = committed_checkpoint(&dir.path().join(".edl/launch/checkpoints"), &mut child);
    // The coordinator, its servers (they die with it) and its workers.
    sigkill(coordinator);
    let _ = child.wait();
    let saved = Checkpoints::read_newest(&dir.path().join(".edl/launch/checkpoints")).unwrap();
    let names: Vec<&str> = saved.tables.iter().map(|t| t.spec.name.as_str()).collect();
    assert_eq!(names, ["deep", "wide"], "the checkpoint holds the tables");
    assert!(saved.tables.iter().all(|t| t.ids.len() > 100), "rows updated by then");

    let mut child = ctr(py, dir.path(), "3").spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert!(status.success(), "{text}");
    assert!(text.contains("resuming job \"launch\"") && text.contains("ps        3 serving on"), "{text}");
    let r = report(dir.path());
    let resumed = r["resumed_from_step"].as_u64().unwrap();
    assert!(resumed > 0 && resumed >= written, "{r}");
    assert_as_calm(dir.path(), &text);
}
