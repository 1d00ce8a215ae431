//! A job's life: a finished job stays finished (for a rerun and for a
//! standby), `--restart` trains it again without losing the finished run's
//! checkpoints first, and a job whose accounting fails is not marked finished.

use crate::support::{
    job::{assert_exactly_once, finish, job, lines, report, run_to_end},
    process::{children, runs, sigkill},
    servers::RedisServer,
    wait::wait_for,
};
use edl_plugin_artifacts as art;
use std::{
    path::{Path, PathBuf},
    process::{Child, Command},
    sync::mpsc::Receiver,
    time::Duration,
};

fn small(dir: &Path, extra: &[&str]) -> Command {
    let mut args = vec![
        "--policy",
        art::AUTOSCALE_WASM,
        "--no-distill",
        "--train-samples",
        "400",
        "--decide-every-steps",
        "2",
    ];
    args.extend_from_slice(extra);
    job(dir, &args)
}

/// The checkpoint directories' names, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut n: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    n.sort();
    n
}

#[test]
fn a_finished_job_stays_finished_and_restart_trains_it_again_keeping_its_checkpoints_until_then() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join(".edl/mnist/checkpoints");
    let flags = ["--epochs", "2", "--checkpoint-every", "4"];
    let (status, out) = run_to_end(small(dir.path(), &flags));
    assert!(status.success(), "{out}");
    let finished = names(&ckpt);
    let first_report = std::fs::read(dir.path().join("report.json")).unwrap();

    // A rerun trains nothing: it names the final checkpoint and exits 0,
    // leaving the checkpoints and the report as they were.
    let (status, out) = run_to_end(small(dir.path(), &flags));
    assert!(status.success(), "{out}");
    let last = finished.last().unwrap();
    assert!(out.contains("job \"mnist\" finished before, its final checkpoint is"), "{out}");
    assert!(out.contains(last.as_str()) && out.contains("--restart"), "{out}");
    assert!(!out.contains("epoch     0 done"), "it trained again:\n{out}");
    assert!(out.contains("report.json is not written"), "the report asked for is said not written:\n{out}");
    assert_eq!(names(&ckpt), finished);
    assert_eq!(std::fs::read(dir.path().join("report.json")).unwrap(), first_report);
    // Nor does it start teachers first (a rerun with distillation on).
    let with_teachers = ["--policy", art::AUTOSCALE_WASM, "--train-samples", "400", "--epochs", "2"];
    let (status, out) = run_to_end(job(dir.path(), &with_teachers));
    assert!(status.success() && out.contains("finished before"), "{out}");
    assert!(!out.contains("serving on"), "teachers were started for a finished job:\n{out}");
    // More epochs than it trained are said not to be trained on.
    let (status, out) = run_to_end(small(dir.path(), &["--epochs", "5", "--checkpoint-every", "4"]));
    assert!(status.success() && out.contains("finished before"), "{out}");
    assert!(out.contains("it trained its 2 epochs; a finished job is not trained on to --epochs 5"), "{out}");

    // --restart trains it again from step 0; the finished run's checkpoints
    // are set aside until the new run has finished, then removed.
    let mut c =
        small(dir.path(), &[&flags[..], &["--restart", "--step-delay-ms", "30"]].concat()).spawn().unwrap();
    let rx = lines(&mut c);
    let mut seen = Vec::new();
    wait_for(&rx, "training it again from step 0", &mut seen, Duration::from_secs(120));
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(120));
    let during = names(&ckpt);
    for n in &finished {
        assert!(
            during.contains(&format!("finished-{n}")),
            "{n} set aside while the new run trains: {during:?}"
        );
    }
    let status = finish(c, rx, &mut seen);
    let out = seen.join("\n");
    assert!(status.success(), "{out}");
    let r = report(dir.path());
    assert!(r["resumed_from_step"].is_null(), "{r}");
    assert_exactly_once(&r, 2, 400);
    let after = names(&ckpt);
    assert!(after.iter().all(|n| !n.starts_with("finished-")), "{after:?}");
    assert!(after.iter().any(|n| n.starts_with("step-")), "{after:?}");
    assert!(ckpt.join("complete.json").exists());
}

#[test]
fn restart_resumes_an_unfinished_job_and_fewer_epochs_than_its_checkpoint_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join(".edl/mnist/checkpoints");
    let mut c = small(dir.path(), &["--epochs", "4", "--step-delay-ms", "5"]).spawn().unwrap();
    let rx = lines(&mut c);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     2 done", &mut seen, Duration::from_secs(120));
    // The whole job at once: no worker of it writes a checkpoint after.
    let job: Vec<u32> = children(c.id()).into_iter().map(|(p, _)| p).collect();
    c.kill().unwrap();
    c.wait().unwrap();
    job.iter().for_each(|&p| sigkill(p));
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while job.iter().any(|&p| runs(p)) && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
    }
    let steps = |dir: &Path| names(dir).into_iter().filter(|n| n.starts_with("step-")).collect::<Vec<_>>();
    let left = steps(&ckpt);
    assert!(!left.is_empty(), "{left:?}");

    // Its newest checkpoint is past 1 epoch: refused before a worker runs.
    let (status, out) = run_to_end(small(dir.path(), &["--epochs", "1"]));
    assert!(!status.success(), "{out}");
    assert!(out.contains("past this job's --epochs 1") && out.contains("another --job"), "{out}");
    assert!(out.contains(".edl/mnist/checkpoints/step-"), "the checkpoint is named: {out}");
    assert!(!out.contains("epoch     0 done"), "{out}");
    assert_eq!(steps(&ckpt), left, "the checkpoints stay as they were");

    // --restart on a job that has not finished: it resumes, saying so,
    // its checkpoints kept (a supervisor rerunning its flags loses nothing).
    let (status, out) = run_to_end(small(dir.path(), &["--epochs", "4", "--restart"]));
    assert!(status.success(), "{out}");
    assert!(out.contains("has not finished, so it resumes"), "{out}");
    let r = report(dir.path());
    assert!(r["resumed_from_step"].as_u64().is_some_and(|s| s > 0), "{r}");
    assert_exactly_once(&r, 4, 400);
}

/// An active coordinator (in `a`) past its first epoch, and a standby (in
/// `b`) waiting for its lease, on the store at `url`, their checkpoints
/// shared.
struct Pair {
    dir: tempfile::TempDir,
    b: PathBuf,
    checkpoints: PathBuf,
    active: Child,
    rx: Receiver<String>,
    seen: Vec<String>,
    standby: Child,
    rx_b: Receiver<String>,
    seen_b: Vec<String>,
}

impl Pair {
    fn start(url: &str, job_name: &str, extra: &[&str]) -> Pair {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        let checkpoints = dir.path().join("checkpoints");
        let shared = ["--store", url, "--job", job_name, "--step-delay-ms", "40", "--checkpoint-dir"];
        let args = [&shared[..], &[checkpoints.to_str().unwrap()], extra].concat();
        let mut active = small(&a, &args).spawn().unwrap();
        let rx = lines(&mut active);
        let mut seen = Vec::new();
        wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(120));
        let mut standby = small(&b, &[&args[..], &["--standby"]].concat()).spawn().unwrap();
        let rx_b = lines(&mut standby);
        let mut seen_b = Vec::new();
        wait_for(&rx_b, "waiting to take it over", &mut seen_b, Duration::from_secs(120));
        Pair { dir, b, checkpoints, active, rx, seen, standby, rx_b, seen_b }
    }
}

#[test]
fn a_standby_that_takes_the_lease_of_a_finished_job_says_so_and_exits_0_without_training() {
    let redis = RedisServer::start();
    let Pair { dir: _dir, b, checkpoints, active, rx, mut seen, standby, rx_b, mut seen_b } =
        Pair::start(&redis.url(), "fin", &["--epochs", "12"]);
    let status = finish(active, rx, &mut seen);
    assert!(status.success(), "{}", seen.join("\n"));
    let finished = names(&checkpoints);
    let status = finish(standby, rx_b, &mut seen_b);
    let out = seen_b.join("\n");
    assert!(status.success(), "{out}");
    assert!(out.contains("job \"fin\" finished before"), "{out}");
    assert!(!out.contains("epoch     0 done"), "the standby trained the finished job again:\n{out}");
    assert!(!b.join("report.json").exists(), "the standby wrote a report of a job it did not run");
    assert_eq!(names(&checkpoints), finished, "the finished job's checkpoints are as they were");
}

#[test]
fn sigterm_stops_the_job_with_a_checkpoint_of_its_committed_state_a_report_and_status_143() {
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--epochs", "30", "--step-delay-ms", "20", "--workers", "2", "--min-workers", "2"];
    let mut c = small(dir.path(), &flags).spawn().unwrap();
    let rx = lines(&mut c);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(120));
    let workers: Vec<u32> = crate::support::process::children(c.id()).into_iter().map(|(p, _)| p).collect();
    assert!(workers.len() >= 2, "{workers:?}");
    assert!(
        std::process::Command::new("kill").args(["-TERM", &c.id().to_string()]).status().unwrap().success()
    );
    let status = finish(c, rx, &mut seen);
    let out = seen.join("\n");
    assert_eq!(status.code(), Some(143), "{out}");
    assert!(out.contains("SIGTERM: stopping the job once its committed state is in a checkpoint"), "{out}");
    assert!(out.contains("stopped by SIGTERM: its state at step"), "{out}");
    let r = report(dir.path());
    assert_eq!(r["status"], "stopped", "{r}");
    // With what it trained until then: an epoch at least.
    assert!(
        r["timeline"].as_array().unwrap().len() >= 10 && !r["epochs"].as_array().unwrap().is_empty(),
        "{r}"
    );
    let left: Vec<u32> = workers.into_iter().filter(|&p| runs(p)).collect();
    assert!(left.is_empty(), "workers left running: {left:?}\n{out}");
    // The rerun goes on from that checkpoint: nothing committed was lost.
    let said = out.split("stopped by SIGTERM: its state at step ").nth(1).unwrap();
    let step: u64 = said.split_whitespace().next().unwrap().parse().unwrap();
    let (status, out) =
        run_to_end(small(dir.path(), &["--epochs", "30", "--workers", "2", "--min-workers", "2"]));
    assert!(status.success(), "{out}");
    let r = report(dir.path());
    assert_eq!(r["resumed_from_step"].as_u64(), Some(step), "{out}");
    assert_exactly_once(&r, 30, 400);
}

/// Redis restarted without its data under an active coordinator and a
/// standby: the standby waits on, and when the active one dies it takes the
/// job over with a fencing token above the checkpoints' fence (the store's
/// token sequence started again below it), and finishes the job.
#[test]
fn a_standby_rides_out_a_store_that_lost_its_data_and_fences_above_the_checkpoints() {
    let mut redis = RedisServer::start();
    let url = redis.url();
    // Tokens well above where the restarted store's sequence will be.
    let port = url.trim_end_matches('/').rsplit(':').next().unwrap().to_string();
    let set =
        Command::new("redis-cli").args(["-p", &port, "set", "edl-token-sequence", "1000"]).output().unwrap();
    assert!(set.status.success(), "{set:?}");
    let Pair { dir: _dir, b, mut active, rx, mut seen, standby, rx_b, mut seen_b, .. } =
        Pair::start(&url, "restarted", &["--epochs", "8", "--checkpoint-every-steps", "5"]);
    // The standby has seen the active one's lease in the store.
    wait_for(&rx_b, "when that lease lapses", &mut seen_b, Duration::from_secs(120));
    redis.restart();
    // The active one goes on (it takes its lease again) past another epoch.
    wait_for(&rx, "epoch     2 done", &mut seen, Duration::from_secs(120));
    assert!(
        std::process::Command::new("kill")
            .args(["-KILL", &active.id().to_string()])
            .status()
            .unwrap()
            .success()
    );
    let _ = active.wait();
    let status = finish(standby, rx_b, &mut seen_b);
    let out = seen_b.join("\n");
    assert!(status.success(), "{out}\nACTIVE:\n{}", seen.join("\n"));
    assert!(out.contains("the checkpoints' fence (token 1001)"), "{out}");
    assert!(out.contains("the store lost its data; this coordinator fences with token 1002"), "{out}");
    assert_exactly_once(&report(&b), 8, 400);
}

#[test]
fn restart_and_standby_are_refused_together() {
    let dir = tempfile::tempdir().unwrap();
    let out = small(dir.path(), &["--restart", "--standby"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--restart") && err.contains("cannot be used with") && err.contains("--standby"),
        "{err}"
    );
}

/// Ctrl-C in a terminal signals the job's whole process group: the workers
/// and teachers are in groups of their own, so the coordinator alone acts
/// on it, with a checkpoint first.
#[test]
fn ctrl_c_to_the_job_s_process_group_stops_it_with_a_checkpoint_and_status_130() {
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--epochs", "30", "--step-delay-ms", "20", "--workers", "2", "--min-workers", "2"];
    let mut c = small(dir.path(), &flags).process_group(0).spawn().unwrap();
    let rx = lines(&mut c);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(120));
    let group = format!("-{}", c.id());
    assert!(std::process::Command::new("kill").args(["-INT", "--", &group]).status().unwrap().success());
    let status = finish(c, rx, &mut seen);
    let out = seen.join("\n");
    assert_eq!(status.code(), Some(130), "{out}");
    assert!(out.contains("stopped by SIGINT: its state at step"), "{out}");
}
