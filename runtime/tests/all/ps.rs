//! Parameter servers as real processes: a launched program's sparse tables
//! on the servers a job starts (`--ps-servers`), through a lost worker.

use crate::support::{
    hosts::Hosts,
    job::{assert_exactly_once, committed_checkpoint, final_state, finish, lines, report, scale_event},
    process::sigkill,
    python::{PyEnv, py},
    root,
    wait::wait_for,
};
use edl_plugin_artifacts as art;
use edl_runtime::checkpoint::Checkpoints;
use std::{
    collections::BTreeMap,
    path::Path,
    process::{Command, Stdio},
    sync::Mutex,
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
fn ctr(py: &PyEnv, dir: &Path, servers: &str, flags: &[&str]) -> Command {
    ctr_of(py, dir, servers, flags, "1000")
}

/// [`ctr`] with `vocab` values per field.
fn ctr_of(py: &PyEnv, dir: &Path, servers: &str, flags: &[&str], vocab: &str) -> Command {
    std::fs::write(dir.join("dying.py"), DYING).unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_edl-runtime"));
    c.current_dir(dir)
        .args(["launch", "--samples", "6000", "--ps-servers", servers, "--no-distill", "--epochs", "3"])
        .args(["--batch", "128", "--workers", "2", "--min-workers", "1", "--max-workers", "3"])
        .args(["--warm-spares", "1", "--policy", art::AUTOSCALE_WASM, "--decide-every", "100000"])
        .args(["--report", "report.json", "--plugin-cache"])
        .arg(dir.join("plugin-cache"))
        .args(flags)
        .args(["--", "python"])
        .arg(dir.join("dying.py"))
        .arg(root().join("examples/ctr"))
        .env("CTR_ROWS", "6000")
        .env("CTR_VOCAB", vocab)
        // Slow enough that the kill below lands mid-job.
        .env("STEP_DELAY_MS", "15")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    py.env(&mut c);
    c
}

/// The job started, and run until it prints a line with `line`: the job,
/// its lines to come, and those printed so far.
fn started_until(
    mut cmd: Command,
    line: &str,
) -> (std::process::Child, std::sync::mpsc::Receiver<String>, Vec<String>) {
    let mut child = cmd.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, line, &mut seen, Duration::from_secs(120));
    (child, rx, seen)
}

/// The job run to its end, which it reached successfully: all it printed.
fn ended(child: std::process::Child, rx: std::sync::mpsc::Receiver<String>, mut seen: Vec<String>) -> String {
    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert!(status.success(), "{text}");
    text
}

/// The test AUCs the workers printed as they ended.
fn aucs(text: &str) -> Vec<f64> {
    text.lines()
        .filter_map(|l| l.split("test AUC before the last step ").nth(1))
        .map(|v| v.trim().parse().unwrap_or_else(|e| panic!("{v:?}: {e}")))
        .collect()
}

type Calm = (Vec<(String, Vec<f32>)>, Vec<f64>);

/// The job run undisturbed (on the data of `vocab` values per field), once
/// per test run: its final arrays and the AUCs its workers printed.
fn calm_of(vocab: &str) -> Calm {
    static CALM: Mutex<BTreeMap<String, Calm>> = Mutex::new(BTreeMap::new());
    let mut runs = CALM.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = runs.get(vocab) {
        return c.clone();
    }
    let dir = tempfile::tempdir().unwrap();
    let mut child = ctr_of(py(), dir.path(), "2", &[], vocab).spawn().unwrap();
    let rx = lines(&mut child);
    let seen = Vec::new();
    let text = ended(child, rx, seen);
    assert!(text.contains("ps        1 serving on 127.0.0.1:"), "{text}");
    assert_no_checkpoint_failed(&text);
    let r = report(dir.path());
    assert_exactly_once(&r, 3, 6000);
    assert_two_servers_said(&text, &r, 1000, 141);
    let auc = aucs(&text);
    assert!(auc.len() >= 2 && auc.iter().all(|a| *a > 0.65), "{auc:?}\n{text}");
    runs.insert(vocab.to_string(), (final_state(dir.path()), auc));
    runs[vocab].clone()
}

/// The job's two servers in its progress lines, as they fill, and in its
/// report at the end: both tables on each, with more than `rows` rows and
/// every one of the job's `steps` applied.
fn assert_two_servers_said(text: &str, r: &serde_json::Value, rows: u64, steps: u64) {
    assert!(
        text.lines().any(|l| l.starts_with("progress") && l.contains("| 2 parameter servers, ")),
        "{text}"
    );
    let servers = r["parameter_servers"].as_array().unwrap();
    assert_eq!(servers.len(), 2, "{servers:?}");
    for s in servers {
        let tables = s["tables"].as_array().unwrap();
        assert_eq!(tables.len(), 2, "{s}");
        assert!(tables.iter().all(|t| t["rows"].as_u64() > Some(rows) && t["applied"] == steps), "{s}");
    }
}

fn assert_no_checkpoint_failed(text: &str) {
    let failed = text.lines().find(|l| l.contains("checkpoint of step") && l.contains("failed"));
    assert!(failed.is_none(), "{failed:?}\n{text}");
}

/// Every dense array the same to the bit as the undisturbed run's: each
/// step's sparse update was applied exactly once in the history the job
/// kept (an update lost, doubled or computed from rows of a dead
/// generation would show in the gradients of every step after it).
fn assert_as_calm(dir: &Path, text: &str) {
    assert_as_calm_of("1000", dir, text);
}

fn assert_as_calm_of(vocab: &str, dir: &Path, text: &str) {
    let calm = calm_of(vocab);
    let (a, b) = (&calm.0, final_state(dir));
    assert_eq!(a.len(), b.len());
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        assert!(x == y, "{name} differs from the undisturbed run's\n{text}");
    }
    let auc = aucs(text);
    assert!(!auc.is_empty() && auc[..] == calm.1[..auc.len()], "{auc:?} {:?}\n{text}", calm.1);
}

#[test]
fn a_rank_killed_mid_job_costs_a_redone_step_and_the_model_ends_as_without_the_kill() {
    let py = py();
    // Worker 2 dies mid-step once the spare is ready, after its pushes:
    // the spare takes its place, the steps its generation had not committed
    // are redone, and the servers undo what that generation applied after
    // its last commit.
    let hit = tempfile::tempdir().unwrap();
    let (child, rx, seen) = started_until(ctr(py, hit.path(), "2", &[]), "warm spare 3 ready");
    std::fs::write(hit.path().join("die"), b"").unwrap();
    let text = ended(child, rx, seen);
    let r = report(hit.path());
    assert_exactly_once(&r, 3, 6000);
    let lost = scale_event(&r, "worker 2 lost", &text);
    assert_eq!((lost["from"].as_u64(), lost["to"].as_u64()), (Some(2), Some(2)), "{lost}");
    assert_no_checkpoint_failed(&text);
    assert_as_calm(hit.path(), &text);
}

#[test]
fn a_killed_job_resumes_its_tables_from_the_checkpoint_on_three_servers_as_if_never_stopped() {
    let py = py();
    let dir = tempfile::tempdir().unwrap();
    let (mut child, _rx, _seen) = started_until(ctr(py, dir.path(), "2", &[]), "epoch     0 done");
    let coordinator = child.id();
    let written = committed_checkpoint(&dir.path().join(".edl/launch/checkpoints"), &mut child);
    // The coordinator, its servers (they die with it) and its workers.
    sigkill(coordinator);
    let _ = child.wait();
    let saved = Checkpoints::read_newest(&dir.path().join(".edl/launch/checkpoints")).unwrap();
    let names: Vec<&str> = saved.tables.iter().map(|t| t.spec.name.as_str()).collect();
    assert_eq!(names, ["deep", "wide"], "the checkpoint holds the tables");
    assert!(saved.tables.iter().all(|t| t.ids.len() > 100), "rows updated by then");
    // The same tables from Python, to take elsewhere.
    let read = r#"
import sys, edl
t = edl.read_checkpoint(sys.argv[1])["tables"]["deep"]
assert t["values"].shape == (len(t["ids"]), 8) and t["state"].shape == (len(t["ids"]), 8), t
assert (t["updates"] > 0).all() and '"adagrad"' in t["spec"], t["spec"]
print("rows", len(t["ids"]))
"#;
    let out =
        py.python().arg("-c").arg(read).arg(dir.path().join(".edl/launch/checkpoints")).output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    let deep = saved.tables.iter().find(|t| t.spec.name == "deep").unwrap();
    assert_eq!(said.trim(), format!("rows {}", deep.ids.len()), "{}", String::from_utf8_lossy(&out.stderr));

    let mut child = ctr(py, dir.path(), "3", &[]).spawn().unwrap();
    let rx = lines(&mut child);
    let seen = Vec::new();
    let text = ended(child, rx, seen);
    assert!(text.contains("resuming job \"launch\"") && text.contains("ps        3 serving on"), "{text}");
    let r = report(dir.path());
    let resumed = r["resumed_from_step"].as_u64().unwrap();
    assert!(resumed > 0 && resumed >= written, "{r}");
    assert_as_calm(dir.path(), &text);
}

/// A program that asks the servers for what it should not, each refusal
/// checked for the words that name what was wrong.
const MISUSE: &str = r#"
import numpy as np, edl
job = edl.Job.from_env()
w = np.zeros(2, np.float32)
job.register("w", w)
def expect(fn, *words):
    try:
        fn()
    except Exception as e:
        m = str(e)
        assert all(x in m for x in words), f"{words} not in {m}"
        print("refused:", m, flush=True)
    else:
        raise SystemExit(f"accepted what should be refused: {words}")
if job.name == "without":
    expect(lambda: job.table("emb", 4), "no parameter servers", "--ps-servers")
    raise SystemExit(0)
job.table("emb", 4)
job.table("big", 1024)
expect(lambda: job.table("emb", 5), "already defined")
expect(lambda: job.table("x", 4, optimizer="rmsprop"), "rmsprop")
expect(lambda: job.table("y", 0), "dimension 0")
for step in job.steps():
    expect(lambda: step.pull("nope", [1]), "no table", "nope")
    expect(lambda: step.pull("emb", [-1]), "negative")
    expect(lambda: step.pull("emb", ["a"]), "integers")
    expect(lambda: step.pull("emb", [1.5]), "integers")
    expect(lambda: step.push("emb", [1, 2], np.zeros((2, 3), np.float32)), "dimension 4")
    expect(lambda: job.table("late", 4), "before the first step")
    expect(lambda: step.pull("big", np.arange(1000, 1300)), "memory bound", '"big"', f"worker {job.worker_id}")
    rows = step.pull("emb", [1, 2, 1])
    assert rows.shape == (3, 4) and (rows[0] == rows[2]).all(), rows
    step.push("emb", [1], np.ones((1, 4), np.float32))
    expect(lambda: step.push("emb", [1], np.ones((1, 4), np.float32)), "pushed it already")
    if step.all_reduce([w]):
        step.commit(loss=0.0)
print("every misuse refused", flush=True)
"#;

#[test]
fn misuse_of_the_tables_is_refused_naming_the_table_and_nothing_half_applied() {
    let py = py();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("misuse.py"), MISUSE).unwrap();
    let run = |job: &str, ps: &[&str]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_edl-runtime"));
        c.current_dir(dir.path())
            .args([
                "launch",
                "--job",
                job,
                "--samples",
                "64",
                "--batch",
                "32",
                "--epochs",
                "1",
                "--no-distill",
            ])
            .args(ps)
            .args(["--", "python", "misuse.py"]);
        py.env(&mut c);
        let out = c.output().unwrap();
        let text =
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success(), text)
    };
    // 1 MiB of rows: about 120 rows of 1,024 floats and their Adagrad state.
    let (ok, text) = run("misuse", &["--ps-servers", "1", "--ps-memory-mib", "1"]);
    assert!(ok, "{text}");
    assert!(text.contains("every misuse refused"), "{text}");
    assert!(text.contains("at most 1 MiB of rows"), "{text}");
    // A job without servers: the program is told so (and, ending before it
    // joined, the job ends with it).
    let (_, text) = run("without", &[]);
    assert!(text.contains("refused: table \"emb\": the job has no parameter servers"), "{text}");
}

#[test]
fn the_torch_wide_and_deep_trains_its_tables_through_resizes() {
    let py = crate::support::python::torch_py();
    let dir = tempfile::tempdir().unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_edl-runtime"));
    c.current_dir(dir.path())
        .args(["launch", "--samples", "6000", "--ps-servers", "2", "--batch", "128"])
        .args(crate::support::job::GROWING)
        .args(["--no-distill", "--report", "report.json", "--", "python"])
        .arg(root().join("examples/ctr/wide_deep_torch.py"))
        // Slow enough that workers join before the job ends.
        .env("STEP_DELAY_MS", "60")
        .env("CTR_ROWS", "6000")
        .env("CTR_VOCAB", "1000")
        .stdin(Stdio::null());
    py.env(&mut c);
    let out = c.output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    let r = report(dir.path());
    assert_exactly_once(&r, 3, 6000);
    let events = r["scale_events"].as_array().unwrap();
    assert!(events.iter().any(|e| e["to"].as_u64() == Some(3)), "grown to three workers: {events:?}");
    let auc = aucs(&text);
    assert!(!auc.is_empty() && auc.iter().all(|a| *a > 0.65), "{auc:?}\n{text}");
}

/// A table on the servers and `nn.Embedding(sparse=True)` under
/// `torch.optim.SparseAdam` in the same program, given the same gradients
/// step by step (rows first touched late among them): equal rows at the end.
const AS_SPARSE_ADAM: &str = r#"
import sys
import torch
import edl, edl.torch

job = edl.Job.from_env()
if job is None:
    sys.exit(0)
table = edl.torch.SparseEmbedding(job, "emb", 4, optimizer="adam", lr=0.05, init="zeros")
job.register("unused", torch.zeros(1).numpy())
peer = torch.nn.Embedding(200, 4, sparse=True)
torch.nn.init.zeros_(peer.weight)
adam = torch.optim.SparseAdam(peer.parameters(), lr=0.05)
target = torch.linspace(-1.0, 1.0, 4)
last = None
for step in job.steps():
    n = step.step
    # Rows seen every step, rows of every third step, and a new row every fifth.
    ids = torch.tensor([1, 2, 2, 3 + n % 4] + ([50 + n % 7] if n % 3 == 0 else []) + ([100 + n] if n % 5 == 0 else []))
    ((table(ids, step) - target * (n % 3 + 1)) ** 2).sum().backward()
    adam.zero_grad()
    ((peer(ids) - target * (n % 3 + 1)) ** 2).sum().backward()
    adam.step()
    last = step
    step.commit(loss=0.0)
seen = torch.tensor(sorted({1, 2, 3, 4, 5, 6} | {50 + k for k in range(7)} | {100 + k for k in range(0, 40, 5)}))
print("steps", last.step + 1 if last else 0, flush=True)
print("peer", ",".join(f"{v:.7f}" for v in peer.weight[seen].flatten().tolist()), flush=True)
"#;

#[test]
fn a_table_on_the_servers_trains_as_torch_s_sparse_adam() {
    let py = crate::support::python::torch_py();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("as_sparse_adam.py"), AS_SPARSE_ADAM).unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_edl-runtime"));
    c.current_dir(dir.path())
        .args([
            "launch",
            "--samples",
            "40",
            "--batch",
            "1",
            "--epochs",
            "1",
            "--ps-servers",
            "1",
            "--workers",
            "1",
        ])
        .args(["--min-workers", "1", "--max-workers", "1", "--no-distill", "--report", "report.json"])
        .args(["--", "python", "as_sparse_adam.py"])
        .stdin(Stdio::null());
    py.env(&mut c);
    let out = c.output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    assert!(text.contains("steps 40"), "{text}");
    let peer: Vec<f32> = text
        .lines()
        .find_map(|l| l.split("peer ").nth(1))
        .unwrap_or_else(|| panic!("{text}"))
        .split(',')
        .map(|v| v.trim().parse().unwrap())
        .collect();
    // The servers' rows, from the job's final checkpoint.
    let r = report(dir.path());
    let state = Checkpoints::read(Path::new(r["final_checkpoint"].as_str().unwrap())).unwrap();
    let table = state.tables.iter().find(|t| t.spec.name == "emb").expect("the table in the checkpoint");
    let w = table.spec.width();
    let mut seen: Vec<u64> = (1..=6).chain(50..57).chain((0..40).step_by(5).map(|k| 100 + k)).collect();
    seen.sort_unstable();
    for (i, id) in seen.iter().enumerate() {
        let at = table.ids.iter().position(|x| x == id).unwrap_or_else(|| panic!("row {id} missing"));
        let ours = &table.rows[at * w..at * w + 4];
        let theirs = &peer[i * 4..i * 4 + 4];
        for (a, b) in ours.iter().zip(theirs) {
            assert!((a - b).abs() < 2e-5, "row {id}: {ours:?} on the servers, {theirs:?} under SparseAdam");
        }
    }
}

#[test]
fn a_server_killed_with_two_replicas_loses_no_update_and_the_model_ends_as_without_the_kill() {
    let py = py();
    let dir = tempfile::tempdir().unwrap();
    let (child, rx, seen) =
        started_until(ctr(py, dir.path(), "3", &["--ps-replicas", "2"]), "epoch     0 done");
    let coordinator = child.id();
    sigkill(server_pid(coordinator, 2));
    let text = ended(child, rx, seen);
    assert!(text.contains("parameter server 2 lost"), "{text}");
    assert!(text.contains("parameter servers 3 -> 2: "), "{text}");
    assert_exactly_once(&report(dir.path()), 3, 6000);
    // The same model as two servers of one replica trained undisturbed:
    // every push of every step applied once, on whichever servers held it.
    assert_as_calm(dir.path(), &text);
}

#[test]
fn a_server_killed_with_one_replica_sends_the_job_back_to_its_checkpoint_saying_so() {
    let py = py();
    let dir = tempfile::tempdir().unwrap();
    let (mut child, rx, seen) = started_until(ctr(py, dir.path(), "2", &[]), "epoch     0 done");
    let coordinator = child.id();
    committed_checkpoint(&dir.path().join(".edl/launch/checkpoints"), &mut child);
    sigkill(server_pid(coordinator, 2));
    let text = ended(child, rx, seen);
    assert!(text.contains("parameter server 2 lost"), "{text}");
    assert!(text.contains("their rows are gone; restarting from the newest checkpoint"), "{text}");
    assert_exactly_once(&report(dir.path()), 3, 6000);
    // The tables came from the checkpoint onto server 1, and the steps
    // after it were trained again as they were the first time; server 3,
    // started in server 2's place while training went on, then joined.
    assert!(text.contains("starting server(s) 3 in place of those lost"), "{text}");
    assert!(text.contains("parameter server 3 serving on "), "{text}");
    assert!(text.contains("parameter servers 1 -> 2: "), "{text}");
    assert_as_calm(dir.path(), &text);
}

/// The pid of parameter server `id` among the job's processes.
fn server_pid(coordinator: u32, id: u64) -> u32 {
    let kids = crate::support::process::children(coordinator);
    let flag = format!(" ps --id {id} ");
    kids.iter().find(|(_, c)| c.contains(&flag)).unwrap_or_else(|| panic!("server {id} among {kids:?}")).0
}

#[test]
fn tables_over_one_server_s_memory_bound_grow_onto_three_servers_mid_job() {
    let py = py();
    let dir = tempfile::tempdir().unwrap();
    // About 4 MiB of rows by the end: one server of 2 MiB cannot hold
    // them; one more starts as a server passes 80% of its bound (and a step
    // that finds a server full is redone once one more has joined).
    let flags = ["--max-ps", "3", "--ps-memory-mib", "2"];
    let mut child = ctr_of(py, dir.path(), "1", &flags, "1500").spawn().unwrap();
    let rx = lines(&mut child);
    let seen = Vec::new();
    let text = ended(child, rx, seen);
    for (from, to) in [(1, 2), (2, 3)] {
        assert!(text.contains(&format!("parameter servers {from} -> {to}: ")), "{text}");
    }
    // Started on a thread of its own while training went on, then joined.
    assert!(text.contains("starting server 3, to join at the step boundary after it serves"), "{text}");
    assert!(text.contains("parameter server 3 serving on "), "{text}");
    assert_exactly_once(&report(dir.path()), 3, 6000);
    assert_as_calm_of("1500", dir.path(), &text);
}

#[test]
fn a_server_told_to_go_hands_its_shards_over_and_the_job_goes_on_on_the_others() {
    let py = py();
    let dir = tempfile::tempdir().unwrap();
    let (child, rx, seen) = started_until(ctr(py, dir.path(), "3", &[]), "epoch     0 done");
    let coordinator = child.id();
    // SAFETY: signalling a child of the job under test.
    unsafe { libc::kill(server_pid(coordinator, 2) as i32, libc::SIGTERM) };
    let text = ended(child, rx, seen);
    assert!(text.contains("parameter server 2 was told to go"), "{text}");
    assert!(text.contains("parameter servers 3 -> 2: "), "{text}");
    assert!(!text.contains("parameter server 2 lost"), "it was not lost: {text}");
    assert_exactly_once(&report(dir.path()), 3, 6000);
    assert_as_calm(dir.path(), &text);
}

/// The built-in job's wide-and-deep model (`--dataset ctr`) on 20,000
/// rows, two workers held by the policy, two epochs, servers of
/// `servers` (and `flags`), each step a little slow so that a kill lands
/// mid-job.
fn builtin_ctr(dir: &Path, servers: &str, flags: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_edl-runtime"));
    c.current_dir(dir)
        .args(["--dataset", "ctr", "--train-samples", "20000", "--ps-servers", servers, "--epochs", "2"])
        .args(["--workers", "2", "--min-workers", "1", "--max-workers", "3", "--step-delay-ms", "4"])
        .args(["--policy", art::AUTOSCALE_WASM, "--decide-every", "100000", "--report", "report.json"])
        .arg("--plugin-cache")
        .arg(dir.join("plugin-cache"))
        .args(flags)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Each epoch's test AUC and log loss, as the progress lines said them.
fn epoch_scores(text: &str) -> Vec<(f64, f64)> {
    let value = |l: &str, name: &str| -> Option<f64> {
        l.split(&format!("| {name} ")).nth(1)?.split_whitespace().next()?.parse().ok()
    };
    text.lines()
        .filter(|l| l.starts_with("progress"))
        .filter_map(|l| Some((value(l, "test_auc")?, value(l, "test_log_loss")?)))
        .collect()
}

/// The built-in model trained undisturbed on two servers of two replicas
/// (the command the docs give), once per test run: its final dense arrays
/// and each epoch's scores.
fn builtin_calm() -> (Vec<(String, Vec<f32>)>, Vec<(f64, f64)>) {
    static CALM: Mutex<Option<(Vec<(String, Vec<f32>)>, Vec<(f64, f64)>)>> = Mutex::new(None);
    let mut calm = CALM.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = calm.as_ref() {
        return c.clone();
    }
    let dir = tempfile::tempdir().unwrap();
    let mut child = builtin_ctr(dir.path(), "2", &["--ps-replicas", "2"]).spawn().unwrap();
    let rx = lines(&mut child);
    let text = ended(child, rx, Vec::new());
    assert!(
        text.starts_with("job \"ctr\": ctr (20000 training samples, 10000 test), wide and deep"),
        "{text}"
    );
    assert_no_checkpoint_failed(&text);
    let r = report(dir.path());
    assert_exactly_once(&r, 2, 20000);
    // Every epoch scored on the test set, and the model learns the ids:
    // the hidden model's own AUC is about 0.8, a coin's 0.5.
    let scores = epoch_scores(&text);
    assert_eq!(scores.len(), 2, "{text}");
    assert!(scores.iter().all(|(auc, loss)| *auc > 0.7 && *loss < 0.6), "{scores:?}");
    let auc = r["student_test_auc"].as_f64().unwrap();
    assert!(auc > 0.7 && r["student_test_log_loss"].as_f64().unwrap() < 0.6, "{r}");
    assert!(text.contains(&format!("test AUC {auc:.4}, log loss ")), "{text}");
    assert!(r["student_test_accuracy"].is_null(), "an AUC, not an accuracy: {r}");
    assert_two_servers_said(&text, &r, 10_000, 626);
    // Each step's servers in the report's timeline (what the plot draws).
    assert!(r["timeline"].as_array().unwrap().iter().all(|s| s["ps_servers"] == 2), "{r}");
    // The tables are in the final checkpoint.
    let state = Checkpoints::read(Path::new(r["final_checkpoint"].as_str().unwrap())).unwrap();
    let names: Vec<&str> = state.tables.iter().map(|t| t.spec.name.as_str()).collect();
    assert_eq!(names, ["deep", "wide"]);
    *calm = Some((final_state(dir.path()), scores));
    calm.clone().unwrap()
}

/// Every dense array the same to the bit as the built-in model's
/// undisturbed run's, and every epoch's scores the same.
fn assert_as_builtin_calm(dir: &Path, text: &str) {
    let (state, scores) = builtin_calm();
    for ((name, x), (_, y)) in state.iter().zip(&final_state(dir)) {
        assert!(x == y, "{name} differs from the undisturbed run's\n{text}");
    }
    assert_eq!(epoch_scores(text), scores);
}

/// The built-in job run with `flags` in `dir`, which it refused: its exit
/// code and what it said.
fn refusal(dir: &Path, flags: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_edl-runtime")).current_dir(dir).args(flags).output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn the_built_in_job_trains_wide_and_deep_on_parameter_servers_and_scores_each_epoch() {
    builtin_calm();
}

#[test]
fn a_server_killed_under_the_built_in_model_loses_no_update_and_the_model_ends_as_without_the_kill() {
    let dir = tempfile::tempdir().unwrap();
    let (child, rx, seen) =
        started_until(builtin_ctr(dir.path(), "3", &["--ps-replicas", "2"]), "epoch     0 done");
    let coordinator = child.id();
    sigkill(server_pid(coordinator, 2));
    let text = ended(child, rx, seen);
    assert!(text.contains("parameter server 2 lost"), "{text}");
    assert!(text.contains("parameter servers 3 -> 2: "), "{text}");
    assert_exactly_once(&report(dir.path()), 2, 20000);
    assert_as_builtin_calm(dir.path(), &text);
}

#[test]
fn a_server_lost_whose_replacement_does_not_start_is_replaced_by_another_to_keep_the_job_s_fewest() {
    let dir = tempfile::tempdir().unwrap();
    // One replica, at least two servers; server 3, the first started in
    // place of one lost, fails to start (as a host with no room would).
    let start = "if [ {id} = 3 ]; then echo no room for server 3 >&2; exit 3; fi; exec {program}";
    let flags =
        ["--min-ps", "2", "--ps-command", start, "--step-delay-ms", "10", "--checkpoint-every-steps", "50"];
    let (child, rx, seen) = started_until(builtin_ctr(dir.path(), "2", &flags), "epoch     0 done");
    let coordinator = child.id();
    sigkill(server_pid(coordinator, 2));
    let text = ended(child, rx, seen);
    assert!(text.contains("parameter server 2 lost"), "{text}");
    assert!(text.contains("starting server(s) 3 in place of those lost"), "{text}");
    assert!(text.contains("starting parameter server 3"), "its failure said: {text}");
    assert!(text.contains("parameter servers: 1, fewer than the job's 2: starting server(s) 4"), "{text}");
    assert!(text.contains("parameter server 4 serving on "), "{text}");
    assert!(text.contains("parameter servers 1 -> 2: "), "{text}");
    assert_exactly_once(&report(dir.path()), 2, 20000);
}

#[test]
fn a_server_lost_with_one_replica_before_any_checkpoint_sends_the_job_back_to_its_start() {
    let dir = tempfile::tempdir().unwrap();
    // Killed in the first epoch, before its end's checkpoint: the job goes
    // back to step 0 with its workers, which kept step 0's state for it.
    let flags = ["--step-delay-ms", "10", "--checkpoint-secs", "3600"];
    let (child, rx, seen) = started_until(builtin_ctr(dir.path(), "2", &flags), "progress  epoch 1/2 step");
    let coordinator = child.id();
    sigkill(server_pid(coordinator, 2));
    let text = ended(child, rx, seen);
    assert!(text.contains("their rows are gone; restarting from the newest checkpoint"), "{text}");
    assert!(!text.contains("cannot serve committed step"), "{text}");
    assert!(!text.contains("restarting from step"), "there was no checkpoint to restart from: {text}");
    assert_exactly_once(&report(dir.path()), 2, 20000);
}

#[test]
fn the_built_in_ctr_model_without_servers_is_refused_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    let (code, err) = refusal(dir.path(), &["--dataset", "ctr", "--epochs", "1"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("--dataset ctr keeps its embedding tables on parameter servers: add --ps-servers N"),
        "{err}"
    );
    assert!(!dir.path().join(".edl").exists(), "nothing started");
}

#[test]
fn servers_started_by_command_on_two_other_hosts_serve_the_built_in_model_and_stop_with_it() {
    let Some(hosts) = Hosts::build_or_skip(&["coord", "ps1", "ps2"]) else { return };
    let dir = tempfile::tempdir().unwrap();
    // The job (coordinator and workers) on one host, a server on each of
    // two others, started there by the operator's command.
    // A line before the server's own (as srun or a login script may print).
    let template =
        format!("echo starting {{id}} on {{host}}; ip netns exec {}-{{host}} {{program}}", hosts.prefix);
    let (ip1, ip2) = (hosts.ip("ps1"), hosts.ip("ps2"));
    let servers = format!("ps1={ip1},ps2={ip2}");
    let flags = ["--ps-replicas", "2", "--ps-command", &template, "--ps-hosts", &servers];
    let job = builtin_ctr(dir.path(), "2", &flags);
    let mut cmd = hosts.on("coord", env!("CARGO_BIN_EXE_edl-runtime"));
    cmd.args(job.get_args()).current_dir(dir.path());
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let (child, rx, seen) = started_until(cmd, "epoch     0 done");
    for host in ["ps1", "ps2"] {
        assert!(!hosts.pids(host).is_empty(), "a server runs on {host}");
    }
    let text = ended(child, rx, seen);
    assert!(text.contains(&format!("ps        1 serving on {ip1}:8300")), "{text}");
    assert!(text.contains(&format!("ps        2 serving on {ip2}:8300")), "{text}");
    assert_exactly_once(&report(dir.path()), 2, 20000);
    // The same model as the servers beside the coordinator trained.
    assert_as_builtin_calm(dir.path(), &text);
    // Stopped with the job: nothing left on their hosts.
    let gone = || hosts.pids("ps1").is_empty() && hosts.pids("ps2").is_empty();
    crate::support::wait::until("the servers stopped with the job", Duration::from_secs(30), gone);
}

#[test]
fn a_server_cut_off_by_the_network_is_dropped_as_lost_and_the_model_ends_as_without_the_cut() {
    let Some(hosts) = Hosts::build_or_skip(&["coord", "ps1", "ps2", "ps3"]) else { return };
    let dir = tempfile::tempdir().unwrap();
    let template = format!("ip netns exec {}-{{host}} {{program}}", hosts.prefix);
    let servers = format!("ps1={},ps2={},ps3={}", hosts.ip("ps1"), hosts.ip("ps2"), hosts.ip("ps3"));
    let flags = ["--ps-replicas", "2", "--ps-command", &template, "--ps-hosts", &servers];
    let job = builtin_ctr(dir.path(), "3", &flags);
    let mut cmd = hosts.on("coord", env!("CARGO_BIN_EXE_edl-runtime"));
    cmd.args(job.get_args()).current_dir(dir.path());
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let (child, rx, seen) = started_until(cmd, "epoch     0 done");
    assert!(seen.iter().any(|l| l.contains(&format!("ps        2 serving on {}:8300", hosts.ip("ps2")))));
    // Server 2's host vanishes from the network: no process ends, no
    // connection is closed; only silence.
    hosts.link("ps2", false);
    let text = ended(child, rx, seen);
    assert!(text.contains("parameter server 2 lost (unreachable"), "{text}");
    assert!(text.contains("parameter servers 3 -> 2: "), "{text}");
    assert_exactly_once(&report(dir.path()), 2, 20000);
    // Its shards served by their replicas and copied on: nothing lost.
    assert_as_builtin_calm(dir.path(), &text);
    // Its command was stopped, and the server with it.
    let gone = || hosts.pids("ps2").is_empty();
    crate::support::wait::until("the cut-off server stopped", Duration::from_secs(30), gone);
}

#[test]
fn servers_by_command_need_their_hosts_and_enough_slots() {
    let dir = tempfile::tempdir().unwrap();
    let run = |flags: &[&str]| refusal(dir.path(), &[&["--dataset", "ctr", "--epochs", "1"], flags].concat());
    let cases: [(&[&str], &str); 4] = [
        // Without hosts the command places each server: it cannot name one.
        (
            &["--ps-servers", "2", "--ps-command", "ssh {host} {program}"],
            "without --ps-hosts the command places",
        ),
        (
            &["--ps-servers", "3", "--ps-command", "ssh {host} {program}", "--ps-hosts", "a,b"],
            "--ps-hosts has 2 slot(s) for servers; the job may start 3",
        ),
        (&["--ps-servers", "1", "--ps-command", "ssh {host} {progam}", "--ps-hosts", "a"], "{progam}"),
        (
            &["--ps-command", "ssh {host} {program}", "--ps-hosts", "a"],
            "--ps-command starts the servers --ps-servers N asks for",
        ),
    ];
    for (flags, want) in cases {
        let (code, err) = run(flags);
        assert_eq!(code, Some(2), "{flags:?}: {err}");
        assert!(err.contains(want), "{flags:?}: {err}");
    }
    assert!(!dir.path().join(".edl").exists(), "nothing started");
}

#[test]
fn a_policy_grows_the_servers_2_to_3_and_back_to_2_mid_job_and_the_model_ends_as_without_it() {
    let dir = tempfile::tempdir().unwrap();
    // The schedule policy holds the workers and asks for a third server
    // at step 150, and for two again at step 400.
    let flags = [
        "--ps-replicas",
        "2",
        "--max-ps",
        "3",
        "--policy",
        art::SCHEDULE_WASM,
        "--policy-config",
        "every=100000",
        "--policy-config",
        "servers=150:3,400:2",
        "--decide-every",
        "50",
    ];
    let mut child = builtin_ctr(dir.path(), "2", &flags).spawn().unwrap();
    let rx = lines(&mut child);
    let text = ended(child, rx, Vec::new());
    assert!(text.contains("scaling policy: parameter servers 2 -> 3: starting server(s) 3"), "{text}");
    assert!(text.contains("parameter server 3 serving on "), "{text}");
    assert!(
        text.contains(
            "scaling policy: parameter servers 3 -> 2: server(s) 3 leave at the next step boundary"
        ),
        "{text}"
    );
    // Rows copied to the new server, and away from it again: the bulk
    // while training went on, the rows changed meanwhile at the boundary.
    let number_after =
        |l: &str, at: &str| -> Option<u64> { l.split(at).nth(1)?.split(' ').next()?.parse().ok() };
    for (from, to) in [(2, 3), (3, 2)] {
        let at = format!("parameter servers {from} -> {to}: ");
        let line = text.lines().find(|l| l.contains(&at) && l.contains(" rows moved"));
        let line = line.unwrap_or_else(|| panic!("{from} -> {to}:\n{text}"));
        let moved = number_after(line, &at).unwrap_or_else(|| panic!("{line}"));
        let bulk = number_after(line, "(");
        assert!(bulk.is_some_and(|n| n > 1000), "{from} -> {to}: {moved} at the boundary; {line}\n{text}");
        assert!(
            line.contains("rows copied ahead from step") && line.contains("while training went on"),
            "{line}"
        );
    }
    let r = report(dir.path());
    assert_exactly_once(&r, 2, 20000);
    assert_eq!(r["parameter_servers"].as_array().unwrap().len(), 2, "{r}");
    assert!(dir.path().join(".edl/ctr/logs/ps-3.log").exists());
    let counts: Vec<u64> =
        r["timeline"].as_array().unwrap().iter().map(|s| s["ps_servers"].as_u64().unwrap()).collect();
    let mut changes = counts.clone();
    changes.dedup();
    assert_eq!(changes, [2, 3, 2], "the servers each step had");
    // Each step's updates applied once, whichever servers held the rows.
    assert_as_builtin_calm(dir.path(), &text);
    replays_to_the_job_s_server_decisions(dir.path(), &r);
}

#[test]
fn a_server_slow_to_start_is_started_while_training_goes_on_placed_by_its_command() {
    let dir = tempfile::tempdir().unwrap();
    // A third server asked for at step 150, by a command that takes 4 s
    // before the server runs (as a scheduler's queue would), on no host
    // given: the server says where it serves.
    let flags = [
        "--max-ps",
        "3",
        "--policy",
        art::SCHEDULE_WASM,
        "--policy-config",
        "every=100000",
        "--policy-config",
        "servers=150:3",
        "--decide-every",
        "50",
        "--step-delay-ms",
        "10",
        "--ps-command",
        "sleep 4; exec {program}",
    ];
    let mut child = builtin_ctr(dir.path(), "2", &flags).spawn().unwrap();
    let rx = lines(&mut child);
    let text = ended(child, rx, Vec::new());
    assert!(text.contains("scaling policy: parameter servers 2 -> 3: starting server(s) 3"), "{text}");
    assert!(text.contains("parameter server 3 serving on 127.0.0.1:"), "{text}");
    assert!(text.contains("parameter servers 2 -> 3: "), "{text}");
    let r = report(dir.path());
    assert_exactly_once(&r, 2, 20000);
    // Steps were committed while it started: the job did not wait for it.
    let asked =
        r["server_decisions"].as_array().unwrap().iter().find(|d| d["servers"] == 3).expect("asked for 3");
    let at = asked["secs"].as_f64().unwrap();
    let during = r["timeline"].as_array().unwrap().iter().filter(|s| {
        let t = s["secs"].as_f64().unwrap();
        t > at + 0.5 && t < at + 3.5
    });
    assert!(during.count() > 10, "no steps committed while server 3 started (asked at {at:.2} s)\n{text}");
    assert_as_builtin_calm(dir.path(), &text);
}

/// The report's server decisions, replayed by `plugin replay --servers`
/// with the job's policy and configuration, come out as the job's policy
/// answered them: leaving the servers be before step 150, three from
/// there, two from step 400.
fn replays_to_the_job_s_server_decisions(d: &Path, r: &serde_json::Value) {
    let recorded = r["server_decisions"].as_array().unwrap();
    let answered = |d: &serde_json::Value| d["answer"].as_u64();
    let steps = |n: Option<u64>| {
        recorded.iter().filter(move |d| answered(d) == n).map(|d| d["view"]["step"].as_u64().unwrap())
    };
    assert!(steps(None).count() > 0 && steps(None).all(|s| s < 150), "{recorded:?}");
    assert!(steps(Some(3)).count() > 0 && steps(Some(3)).all(|s| (150..400).contains(&s)), "{recorded:?}");
    assert!(steps(Some(2)).count() > 0 && steps(Some(2)).all(|s| s >= 400), "{recorded:?}");
    // The view of each: the servers as the job last looked at them (once a
    // second, so a view may lag a change by a second's steps), and their rows.
    let last = recorded.last().unwrap();
    let mut counts = recorded.iter().map(|d| d["view"]["servers"].as_array().unwrap().len());
    assert!(counts.all(|n| n == 2 || n == 3), "{recorded:?}");
    assert!(last["view"]["servers"][0]["rows"].as_u64().unwrap() > 0, "{last}");
    let out = Command::new(env!("CARGO_BIN_EXE_edl-runtime"))
        .current_dir(d)
        .args([
            "plugin",
            "replay",
            "--policy",
            art::SCHEDULE_WASM,
            "--servers",
            "--trace",
            "report.json",
            "--json",
        ])
        .args(["--policy-config", "every=100000", "--policy-config", "servers=150:3,400:2"])
        .output()
        .unwrap();
    let (said, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{err}");
    let replayed: Vec<serde_json::Value> = said.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(replayed.len(), recorded.len(), "{said}");
    for (a, b) in replayed.iter().zip(recorded) {
        assert_eq!(a["step"], b["view"]["step"], "{a} {b}");
        assert_eq!(a["answer"], b["answer"], "replayed {a} against recorded {b}");
        assert_eq!(a["in_the_job"], b["answer"], "{a}");
    }
    let n = recorded.len();
    assert!(err.contains(&format!("{n} decisions of edl-plugin-schedule")), "{err}");
    assert!(err.contains(&format!("{n} of {n} answered as in the job")), "{err}");
}

#[test]
fn a_server_given_its_secret_on_standard_input_stops_when_that_input_closes() {
    use std::io::{BufRead, Write};
    let secret = edl_runtime::worker::session::Secret::generate().unwrap();
    let mut server = Command::new(env!("CARGO_BIN_EXE_edl-runtime"))
        .args(["ps", "--id", "4", "--listen", "127.0.0.1:0", "--job", "j", "--secret-file", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = server.stdin.take().unwrap();
    writeln!(stdin, "{}", secret.to_hex()).unwrap();
    let mut line = String::new();
    std::io::BufReader::new(server.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert!(line.starts_with("ps 4 serving on 127.0.0.1:"), "{line:?}");
    // Still serving while the input is held.
    std::thread::sleep(Duration::from_millis(300));
    assert!(server.try_wait().unwrap().is_none(), "it serves while its input is open");
    drop(stdin);
    let status =
        crate::support::wait::wait_exit(&mut server, "the server", Duration::from_secs(30), String::new);
    assert!(status.success(), "{status}");
    let mut said = String::new();
    std::io::Read::read_to_string(server.stderr.as_mut().unwrap(), &mut said).unwrap();
    assert!(said.contains("ps 4: standard input closed: the job let go of this server; stopping"), "{said}");
}
