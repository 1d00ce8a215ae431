//! The main job end to end, as real processes: the coordinator
//! (`edl-runtime --policy ...`), its worker processes and teacher processes.
//! Workers are killed with SIGKILL, the whole job too.

use crate::support::{
    job::{GROWING, assert_exactly_once, finish, job, lines, report, run_to_end, scale_event},
    process::{children, runs, sigkill, sigkill_worker, signal_worker, worker_pid},
    servers::RedisServer,
    wait::{until, wait_for},
};
use edl_plugin_artifacts as art;
use serde_json::Value;
use std::{
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.rsplit_once(')').is_some_and(|(_, r)| r.trim_start().starts_with('Z')))
        .unwrap_or(false)
}

#[test]
fn exactly_once_across_policy_resizes_and_a_killed_worker() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = job(dir.path(), &[&GROWING[..], &["--step-delay-ms", "25"]].concat()).spawn().unwrap();
    let coordinator = child.id();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    // The schedule grows the job 1 -> 2 -> 3 (one resize 1 -> 3 when the
    // second worker is asked for before the first is ready); then kill
    // worker 1, rank 0 (a scale-in removes the highest ranks, so it is still
    // in the job).
    wait_for(&rx, " -> 3 workers", &mut seen, Duration::from_secs(120));
    let workers: Vec<(u32, String)> =
        children(coordinator).into_iter().filter(|(_, c)| c.contains(" worker ")).collect();
    assert!(workers.len() >= 2, "{workers:?}");
    let (victim, _) = workers
        .iter()
        .find(|(_, c)| c.trim_end().ends_with("--id 1"))
        .unwrap_or_else(|| panic!("worker 1 among {workers:?}"))
        .clone();
    // SAFETY: signalling a child of the job under test.
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert!(status.success(), "{text}");
    let r = report(dir.path());
    assert_exactly_once(&r, 3, 1200);
    let events = r["scale_events"].as_array().unwrap();
    let policy = events.iter().filter(|e| e["reason"].as_str().unwrap().starts_with("policy")).count();
    assert!(policy >= 2, "at least two policy-driven resizes: {events:?}");
    let lost = events
        .iter()
        .find(|e| e["reason"].as_str().unwrap().contains("lost"))
        .unwrap_or_else(|| panic!("no event for the killed worker: {events:?}\n{text}"));
    assert!(lost["from"].as_u64().unwrap() >= 2, "{lost}");
    assert!(lost["reason"].as_str().unwrap().contains("worker 1 lost"), "{lost}");
    assert!(lost["pause_ms"].as_f64().unwrap() < 5000.0, "survivors went on within seconds: {lost}");
    assert_recovery_adds_up(lost);
    assert!(text.contains("not committed"), "the interrupted step is redone: {text}");
    assert!(text.contains("survivors out"), "the pause's phases are shown: {text}");
    assert!(!alive(victim));
    assert_eq!(r["distill"], true);
    assert!(r["student_test_accuracy"].as_f64().unwrap() > 0.8, "{}", r["student_test_accuracy"]);
    assert!(r["teacher_test_accuracy"].as_f64().unwrap() > 0.8);
    assert!(r["samples_per_sec"].as_f64().unwrap() > 0.0);
    assert!(r["resumed_from_step"].is_null());
}

#[test]
fn a_killed_job_resumes_from_its_checkpoint_with_redis_state() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "--policy",
        art::AUTOSCALE_WASM,
        "--store",
        &redis.url(),
        "--epochs",
        "2",
        "--checkpoint-every-steps",
        "5",
        "--step-delay-ms",
        "30",
        "--job",
        "resume-test",
    ];
    let mut child = job(dir.path(), &args).spawn().unwrap();
    let coordinator = child.id();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(120));
    let before: Vec<u32> = children(coordinator).into_iter().map(|(p, _)| p).collect();
    assert!(!before.is_empty());
    // The whole job dies at once.
    child.kill().unwrap();
    child.wait().unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    while before.iter().any(|&p| alive(p)) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(before.iter().all(|&p| !alive(p)), "workers and teachers die with the coordinator");
    // Damage the newest checkpoint: it is reported by name and the one before it used.
    let cps = dir.path().join(".edl/resume-test/checkpoints");
    let mut steps: Vec<_> = std::fs::read_dir(&cps)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("step-"))
        .collect();
    steps.sort();
    assert!(steps.len() >= 2, "{steps:?}");
    let newest = steps.last().unwrap().join("state.safetensors");
    let bytes = std::fs::read(&newest).unwrap();
    std::fs::write(&newest, &bytes[..bytes.len() / 3]).unwrap();
    let previous: u64 = steps[steps.len() - 2].file_name().unwrap().to_string_lossy()[5..].parse().unwrap();

    let mut child = job(dir.path(), &args).spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert!(status.success(), "{text}");
    assert!(text.contains("resuming job \"resume-test\""), "{text}");
    assert!(
        text.contains("skipping an unusable checkpoint") && text.contains(&newest.display().to_string()),
        "{text}"
    );
    let r = report(dir.path());
    let from = r["resumed_from_step"].as_u64().unwrap_or_else(|| panic!("not resumed: {r}"));
    assert_eq!(from, previous, "resumed from the checkpoint before the damaged one");
    assert!(from >= 20, "resumed from step {from}: near the first epoch's end (30)");
    assert!(r["steps"].as_u64().unwrap() == 60, "2 epochs of 30 steps: {}", r["steps"]);
    assert_exactly_once(&r, 2, 1200);
    // The job state in Redis outlived the coordinator: generations and
    // worker ids go on from where the killed run left them.
    let first_gen = r["generations"][0].as_u64().unwrap();
    assert!(first_gen > 1, "generation numbering restarted: {}", r["generations"]);
    let first_worker = r["workers_started"][0].as_u64().unwrap();
    assert!(first_worker > 1, "worker ids restarted: {}", r["workers_started"]);
    assert!(r["student_test_accuracy"].as_f64().unwrap() > 0.8);
}

#[test]
fn distillation_beats_plain_training_on_a_small_transfer_set() {
    // One worker and a policy that never resizes: both runs are deterministic.
    let dir = tempfile::tempdir().unwrap();
    let run = |extra: &[&str], job_name: &str| -> Value {
        let mut args = vec![
            "--policy",
            art::SCHEDULE_WASM,
            "--policy-config",
            "every=100000",
            "--max-workers",
            "1",
            "--train-samples",
            "1000",
            "--epochs",
            "8",
            "--teacher-hidden",
            "256",
            "--teacher-epochs",
            "5",
            "--job",
            job_name,
        ];
        args.extend_from_slice(extra);
        let mut child = job(dir.path(), &args).spawn().unwrap();
        let rx = lines(&mut child);
        let mut seen = Vec::new();
        let status = finish(child, rx, &mut seen);
        assert!(status.success(), "{}", seen.join("\n"));
        report(dir.path())
    };
    let distilled = run(&[], "distilled");
    let plain = run(&["--no-distill"], "plain");
    let (d, p) = (
        distilled["student_test_accuracy"].as_f64().unwrap(),
        plain["student_test_accuracy"].as_f64().unwrap(),
    );
    assert_eq!((distilled["distill"].as_bool(), plain["distill"].as_bool()), (Some(true), Some(false)));
    assert!(plain["teacher_test_accuracy"].is_null());
    assert!(d >= p + 0.005, "distilled {d} vs plain {p}: distillation should help by half a point or more");
}

#[test]
fn a_step_that_keeps_failing_ends_the_job_with_the_reason() {
    // Every worker takes longer than the step timeout: each is declared hung,
    // stopped and replaced, and after five attempts the job gives up.
    let dir = tempfile::tempdir().unwrap();
    let mut child = job(
        dir.path(),
        &[
            "--policy",
            art::SCHEDULE_WASM,
            "--no-distill",
            "--step-timeout-secs",
            "1",
            "--step-delay-ms",
            "1500",
        ],
    )
    .spawn()
    .unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    let started = Instant::now();
    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert!(!status.success(), "{text}");
    assert!(text.contains("step 0 failed 5 times in a row"), "{text}");
    assert!(text.contains("answered nothing within 1s"), "{text}");
    assert!(started.elapsed() < Duration::from_secs(60), "bounded: {:?}", started.elapsed());
}

#[test]
fn a_job_on_cuda_without_a_gpu_stops_before_starting_anything() {
    if edl_host_gpu::device::driver_present() {
        eprintln!(
            "SKIPPED a_job_on_cuda_without_a_gpu_stops_before_starting_anything: a CUDA driver is present"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = job(dir.path(), &["--policy", art::SCHEDULE_WASM, "--device", "cuda"]).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains(
            "checking --device before the job starts: cuda:0: no CUDA driver library (libcuda) found"
        ),
        "{text}"
    );
    assert!(!text.contains("teacher "), "no teacher was trained or started: {text}");
    assert!(!dir.path().join("report.json").exists());
}

#[test]
fn a_job_on_cuda_resizes_and_trains_every_sample_once() {
    if !edl_host_gpu::testing::cuda_or_skip("a_job_on_cuda_resizes_and_trains_every_sample_once") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Steps slow enough for joiners to arrive: a CUDA worker's start (its
    // context, the kernels compiled by NVRTC, cuBLAS) takes a second or two,
    // and on a GPU the job's own steps take well under one millisecond.
    let args = [&GROWING[..], &["--device", "cuda:0", "--step-delay-ms", "60"]].concat();
    let mut child = job(dir.path(), &args).spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    let status = finish(child, rx, &mut seen);
    assert!(status.success(), "{}", seen.join("\n"));
    let r = report(dir.path());
    assert_eq!(r["device"], "cuda:0");
    assert_exactly_once(&r, 3, 1200);
    let resizes =
        r["scale_events"].as_array().unwrap().iter().filter(|e| e["from"].as_u64() > Some(0)).count();
    assert!(resizes >= 2, "{}", r["scale_events"]);
    assert!(r["student_test_accuracy"].as_f64().unwrap() > 0.8, "{}", r["student_test_accuracy"]);
}

#[test]
fn a_worker_killed_while_later_windows_are_out_loses_no_sample() {
    let dir = tempfile::tempdir().unwrap();
    // Fast steps: the coordinator keeps windows of many steps ahead of the
    // ranks; the three workers stay until the kill.
    let args = ["--workers", "3", "--min-workers", "2", "--max-workers", "3", "--epochs", "40"];
    let (status, text) = kill_worker_after(steady(dir.path(), &args), "epoch     2 done", 2);
    assert!(status.success(), "{text}");
    assert_exactly_once(&report(dir.path()), 40, 1200);
    let note = text.lines().find(|l| l.contains("not committed")).unwrap_or_else(|| panic!("{text}"));
    assert!(note.contains("worker 2 (pid") && note.contains("lost"), "{note}");
    assert!(note.contains("later step(s) sent ahead dropped"), "windows were out when it died: {note}");
    // The report counts them: the step and those sent ahead, all redone.
    let at = note.find(" later step(s) sent ahead dropped").unwrap();
    let dropped: u64 = note[..at].rsplit(' ').next().unwrap().parse().unwrap();
    let redone = report(dir.path())["redone_steps"].as_u64().unwrap();
    assert!(redone > dropped, "{redone} redone, {dropped} dropped: {note}");
}

/// Runs a job in `dir` to its end, successfully; its report.
fn run_to_its_report(mut cmd: Command, dir: &Path) -> serde_json::Value {
    let mut child = cmd.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    let status = finish(child, rx, &mut seen);
    assert!(status.success(), "{}", seen.join("\n"));
    report(dir)
}

/// A job without teachers whose policy never acts, with `extra` flags.
fn steady(dir: &Path, extra: &[&str]) -> Command {
    let mut args = vec!["--policy", art::AUTOSCALE_WASM, "--decide-every", "100000", "--no-distill"];
    args.extend_from_slice(extra);
    job(dir, &args)
}

/// A one-worker job of `epochs` epochs.
fn sole_worker(dir: &Path, epochs: &str) -> Command {
    steady(dir, &["--min-workers", "1", "--max-workers", "1", "--step-delay-ms", "5", "--epochs", epochs])
}

/// Runs `cmd`, kills worker `id` with SIGKILL once a line with `after` is
/// printed, and returns how the job ended and everything it printed.
fn kill_worker_after(mut cmd: Command, after: &str, id: u64) -> (std::process::ExitStatus, String) {
    let mut child = cmd.spawn().unwrap();
    let coordinator = child.id();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, after, &mut seen, Duration::from_secs(120));
    let (victim, _) = children(coordinator)
        .into_iter()
        .find(|(_, c)| c.contains(" worker ") && c.trim_end().ends_with(&format!("--id {id}")))
        .unwrap_or_else(|| panic!("worker {id} among {:?}", children(coordinator)));
    // SAFETY: signalling a child of the job under test.
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    let status = finish(child, rx, &mut seen);
    (status, seen.join("\n"))
}

#[test]
fn a_warm_spare_takes_a_lost_worker_s_place_and_the_job_goes_on_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "--workers",
        "2",
        "--min-workers",
        "1",
        "--max-workers",
        "3",
        "--warm-spares",
        "1",
        "--step-delay-ms",
        "5",
        "--epochs",
        "6",
    ];
    let (status, text) = kill_worker_after(steady(dir.path(), &args), "warm spare 3 ready", 2);
    assert!(status.success(), "{text}");
    let r = report(dir.path());
    assert_exactly_once(&r, 6, 1200);
    let lost = scale_event(&r, "worker 2 lost", &text);
    // The spare took the place in the generation the failure formed: the
    // job stayed at two workers, and no worker was started for it.
    assert_eq!((lost["from"].as_u64(), lost["to"].as_u64()), (Some(2), Some(2)), "{lost}");
    assert!(text.contains("1 warm spare(s) take the place of the 1 lost"), "{text}");
    assert_recovery_adds_up(lost);
    // Another spare was started behind it: worker 4 (without spares, a
    // job above its minimum starts nobody for a lost worker).
    let logs = dir.path().join(".edl/mnist/logs");
    assert!(logs.join("worker-4.log").exists(), "{:?}", std::fs::read_dir(&logs).map(|d| d.count()));
    let timeline = r["timeline"].as_array().unwrap();
    assert!(timeline.iter().all(|s| s["world"].as_u64() <= Some(2)), "a spare never trained beside two");
}

#[test]
fn a_warm_spare_killed_while_it_waits_is_replaced_and_the_job_never_notices() {
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "--workers",
        "1",
        "--min-workers",
        "1",
        "--max-workers",
        "2",
        "--warm-spares",
        "1",
        "--step-delay-ms",
        "10",
        "--epochs",
        "20",
    ];
    let mut child = steady(dir.path(), &args).spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, "warm spare 2 ready", &mut seen, Duration::from_secs(120));
    sigkill_worker(child.id(), 2);
    wait_for(&rx, "warm spare 2 was lost while waiting", &mut seen, Duration::from_secs(60));
    wait_for(&rx, "warm spare 3 ready", &mut seen, Duration::from_secs(120));
    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert!(status.success(), "{text}");
    let r = report(dir.path());
    assert_exactly_once(&r, 20, 1200);
    // Its loss was no failure of the job: no step redone, one worker throughout.
    assert_eq!(r["redone_steps"], 0, "{text}");
    let timeline = r["timeline"].as_array().unwrap();
    assert!(timeline.iter().all(|s| s["world"] == 1), "the spare never trained");
}

/// A steady job of 2 workers (1 to 4) whose schedule policy sizes the
/// warm spares (`--warm-spares` 0) by `spares`, deciding every 4 steps.
fn spares_by_policy(dir: &Path, spares: &str, epochs: &str) -> Command {
    let schedule = format!("spares={spares}");
    let args = ["--policy", art::SCHEDULE_WASM, "--policy-config", "every=100000", "--policy-config"];
    let mut cmd = job(dir, &args);
    cmd.args([schedule.as_str(), "--decide-every-steps", "4", "--no-distill", "--workers", "2"]).args([
        "--min-workers",
        "1",
        "--max-workers",
        "4",
        "--step-delay-ms",
        "10",
        "--epochs",
        epochs,
    ]);
    cmd
}

#[test]
fn a_spare_the_policy_asked_for_takes_a_lost_worker_s_place() {
    let dir = tempfile::tempdir().unwrap();
    let cmd = spares_by_policy(dir.path(), "0:1", "12");
    let (status, text) = kill_worker_after(cmd, "warm spare 3 ready", 2);
    assert!(status.success(), "{text}");
    assert!(text.contains("scaling policy: warm spares 0 -> 1"), "{text}");
    assert!(text.contains("1 warm spare(s) take the place of the 1 lost"), "{text}");
    let r = report(dir.path());
    assert_exactly_once(&r, 12, 1200);
    let lost = scale_event(&r, "worker 2 lost", &text);
    assert_eq!((lost["from"].as_u64(), lost["to"].as_u64()), (Some(2), Some(2)), "{lost}");
    // The policy keeps asking for one: another is started behind it.
    assert!(dir.path().join(".edl/mnist/logs/worker-4.log").exists(), "{text}");
    // The report says what the spares cost and what they were used for.
    let s = &r["spares"];
    assert_eq!((s["from_spares"].as_u64(), s["members_lost"].as_u64()), (Some(1), Some(1)), "{s}");
    assert_eq!(s["started_cold"], 0, "{s}");
    // As the job's end found them, before it stopped them.
    assert_eq!((s["spares_wanted"].as_u64(), s["world_size"].as_u64()), (Some(1), Some(2)), "{s}");
    assert!(s["spare_hours"].as_f64() > Some(0.0) && s["ready_secs"].as_f64() > Some(0.0), "{s}");
    let decisions = r["spare_decisions"].as_array().unwrap();
    assert_eq!(decisions[0]["spares"], 1, "the first answer started one: {decisions:?}");
    assert!(decisions[1..].iter().all(|d| d["answer"] == 1 && d["spares"].is_null()), "{decisions:?}");
}

#[test]
fn a_policy_asking_for_fewer_spares_has_the_surplus_stopped_and_none_ever_trains() {
    let dir = tempfile::tempdir().unwrap();
    let (status, text) = run_to_end(spares_by_policy(dir.path(), "0:2,40:0", "4"));
    assert!(status.success(), "{text}");
    let (up, down) = ("scaling policy: warm spares 0 -> 2", "scaling policy: warm spares 2 -> 0");
    let at = |line: &str| text.find(line).unwrap_or_else(|| panic!("no {line:?} in:\n{text}"));
    assert!(at(up) < at(down), "{text}");
    // Stopped as asked, neither counts as lost nor is started again.
    assert!(!text.contains("was lost"), "{text}");
    let logs = dir.path().join(".edl/mnist/logs");
    assert!(!logs.join("worker-5.log").exists(), "{text}");
    let r = report(dir.path());
    assert_exactly_once(&r, 4, 1200);
    assert!(r["timeline"].as_array().unwrap().iter().all(|s| s["world"] == 2), "no spare trained");
    // Stopped when the policy asked, not kept to the job's end.
    assert!(text.contains("warm spare(s) 3, 4 stopped: fewer warm spares wanted"), "{text}");
    let taken: Vec<&Value> = r["spare_decisions"].as_array().unwrap().iter().map(|d| &d["spares"]).collect();
    let changes: Vec<&&Value> = taken.iter().filter(|s| !s.is_null()).collect();
    assert_eq!(changes, [&&serde_json::json!(2), &&serde_json::json!(0)], "{taken:?}");
    assert_eq!(
        (r["spares"]["spares_wanted"].as_u64(), r["spares"]["world_size"].as_u64()),
        (Some(0), Some(2))
    );
    // `plugin replay --spares` over the report, with the job's policy and
    // configuration, answers every decision as the job's policy did.
    let out = Command::new(env!("CARGO_BIN_EXE_edl-runtime"))
        .current_dir(dir.path())
        .args(["plugin", "replay", "--policy", art::SCHEDULE_WASM, "--spares", "--trace", "report.json"])
        .args(["--policy-config", "spares=0:2,40:0"])
        .output()
        .unwrap();
    let (said, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{err}");
    let n = taken.len();
    assert_eq!(said.lines().count(), n, "{said}");
    assert!(said.lines().next().unwrap().contains("spares   0 ->   2"), "{said}");
    assert!(err.contains(&format!("{n} of {n} answered as in the job")), "{err}");
    assert!(err.contains("2 would change the spares"), "{err}");
}

#[test]
fn a_frozen_worker_is_killed_once_its_lease_lapses_and_the_others_do_not_wait_out_their_collective() {
    frozen_worker_killed(&[], "killed with its process group");
}

#[test]
fn a_frozen_worker_started_by_a_command_is_killed_once_its_lease_lapses() {
    // The worker is the command's child (`sh -c ...`): its process group goes.
    let scaler = ["--scaler", "command", "--worker-command", "{program}"];
    frozen_worker_killed(&scaler, "its start command's process group killed");
}

/// A job of 3 under `scaler` whose worker 2 is stopped (SIGSTOP) after an
/// epoch: it is killed once its lease lapses (the note says `how`), the
/// others go on without waiting for their collective's bound.
fn frozen_worker_killed(scaler: &[&str], how: &str) {
    let dir = tempfile::tempdir().unwrap();
    // The collectives' bound (60 s) far past the lease (3 s): the others
    // would wait it out on the frozen worker's open sockets.
    let args = ["--workers", "3", "--min-workers", "1", "--max-workers", "3", "--step-delay-ms", "10"];
    let mut cmd = steady(dir.path(), &args);
    cmd.args(["--epochs", "8", "--collective-timeout-ms", "60000", "--worker-lease-secs", "3"]);
    cmd.args(scaler);
    let mut child = cmd.spawn().unwrap();
    let coordinator = child.id();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     1 done", &mut seen, Duration::from_secs(120));
    // Frozen: its connections stay open, it says nothing.
    signal_worker(coordinator, 2, libc::SIGSTOP);
    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert!(status.success(), "{text}");
    let r = report(dir.path());
    assert_exactly_once(&r, 8, 1200);
    let lost = scale_event(&r, "worker 2 lost", &text);
    assert_eq!((lost["from"].as_u64(), lost["to"].as_u64()), (Some(3), Some(2)), "{lost}");
    assert!(text.contains("lost: ") && text.contains("no heartbeat for"), "its lease lapsed: {text}");
    // Its process killed a second after, the others' collectives failed
    // on its closed sockets: none waited for the 60 s bound.
    assert!(!text.contains("timed out"), "{text}");
    assert!(text.contains("closed the connection (dead or failed)"), "{text}");
    let killed = format!("worker 2 went silent for its lease and still ran a second later: {how}");
    assert!(text.contains(&killed), "{text}");
}

/// A coordinator frozen (SIGSTOP) keeps its connections open and its
/// kernel acknowledges what its workers send: each worker, directly or
/// through its host's relay (`extra`), hears no beat for three leases,
/// gives it up and ends saying so, instead of waiting for it forever.
fn frozen_coordinator_given_up(extra: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let args = ["--workers", "2", "--min-workers", "1", "--max-workers", "2", "--step-delay-ms", "10"];
    let bounds = ["--epochs", "400", "--worker-lease-secs", "2", "--worker-reconnect-secs", "1"];
    let mut child = steady(dir.path(), &[&args[..], &bounds, extra].concat()).spawn().unwrap();
    let coordinator = child.id();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(120));
    let workers: Vec<u32> = (1..=2).map(|id| worker_pid(coordinator, id)).collect();
    // SAFETY: kill(2) takes plain integers; `coordinator` is the job this
    // test started and has not reaped.
    unsafe { libc::kill(coordinator as i32, libc::SIGSTOP) };
    let log = |id: u64| {
        std::fs::read_to_string(dir.path().join(format!(".edl/mnist/logs/worker-{id}.log")))
            .unwrap_or_default()
    };
    until("both workers to give their frozen coordinator up", Duration::from_secs(120), || {
        workers.iter().all(|&p| !runs(p))
    });
    sigkill(coordinator);
    let _ = child.wait();
    for id in 1..=2 {
        let log = log(id);
        assert!(log.contains("lost the coordinator at"), "worker {id}: {log}");
        assert!(log.contains("it said nothing for") && log.contains("where it beats every 0.5 s"), "{log}");
    }
}

#[test]
fn a_frozen_coordinator_is_given_up_by_its_workers() {
    frozen_coordinator_given_up(&[]);
}

#[test]
fn a_frozen_coordinator_is_given_up_by_its_workers_behind_a_relay() {
    frozen_coordinator_given_up(&["--relay"]);
}

/// Beats keep a worker that waits long without a step (a warm spare)
/// with its coordinator: still there after twice the bound of silence, it
/// is never taken for lost.
#[test]
fn a_warm_spare_waiting_longer_than_the_silence_bound_stays_with_its_coordinator() {
    let dir = tempfile::tempdir().unwrap();
    let args = ["--workers", "1", "--min-workers", "1", "--max-workers", "2", "--warm-spares", "1"];
    // Far more epochs than the test waits for: it is stopped after.
    let bounds = ["--step-delay-ms", "5", "--epochs", "100000", "--worker-lease-secs", "2"];
    let mut child = steady(dir.path(), &[&args[..], &bounds].concat()).spawn().unwrap();
    let coordinator = child.id();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, "warm spare 2 ready", &mut seen, Duration::from_secs(120));
    let spare = worker_pid(coordinator, 2);
    // Twice the bound of silence (three leases of 2 s) with no step for it.
    std::thread::sleep(Duration::from_secs(12));
    let log = std::fs::read_to_string(dir.path().join(".edl/mnist/logs/worker-2.log")).unwrap_or_default();
    assert!(runs(spare) && !log.contains("said nothing"), "the spare gave its coordinator up: {log}");
    // SAFETY: kill(2) takes plain integers; the job this test started.
    unsafe { libc::kill(coordinator as i32, libc::SIGTERM) };
    let _ = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert!(text.contains("SIGTERM: stopping the job once its committed state is in a checkpoint"), "{text}");
    assert!(!text.contains("warm spare 2 was lost"), "{text}");
}

#[test]
fn losing_the_only_worker_restarts_from_the_newest_checkpoint_and_trains_every_sample_once() {
    let dir = tempfile::tempdir().unwrap();
    let (status, text) = kill_worker_after(sole_worker(dir.path(), "3"), "epoch     0 done", 1);
    assert!(status.success(), "{text}");
    assert!(text.contains("no worker left; restarting from the newest checkpoint"), "{text}");
    assert_exactly_once(&report(dir.path()), 3, 1200);
}

#[test]
fn losing_the_only_worker_as_the_job_ends_still_ends_it_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    // The last epoch's end: the final checkpoint is being asked for or written.
    let (status, text) = kill_worker_after(sole_worker(dir.path(), "2"), "epoch     1 done", 1);
    assert!(status.success(), "{text}");
    assert_exactly_once(&report(dir.path()), 2, 1200);
}

#[test]
fn an_adapter_that_keeps_each_worker_s_batch_grows_the_global_batch_with_the_world() {
    let dir = tempfile::tempdir().unwrap();
    // 2 -> 4 workers at step 20 (and back 20 steps after they joined);
    // dynamic-batch keeps 20 rows each. Steps of 30 ms: the job outlasts a
    // slow start of the new workers.
    let flags = ["--no-distill", "--epochs", "10", "--batch", "40", "--workers", "2", "--min-workers", "2"];
    let mut cmd = job(dir.path(), &flags);
    cmd.args(["--max-workers", "4", "--policy", art::SCHEDULE_WASM, "--policy-config", "every=20"]);
    cmd.args(["--policy-config", "by=2", "--decide-every-steps", "5", "--step-delay-ms", "30"]);
    cmd.args(["--adapter", art::DYNAMIC_BATCH_WASM]);
    let r = run_to_its_report(cmd, dir.path());
    assert_exactly_once(&r, 10, 1200);
    // Samples a step, by the world it ran in (within an epoch).
    let steps = r["timeline"].as_array().unwrap();
    let mut per_step = std::collections::BTreeSet::new();
    for w in steps.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        if a["epoch"] == b["epoch"] && a["world"] == b["world"] {
            let rows = b["cursor"].as_u64().unwrap() - a["cursor"].as_u64().unwrap();
            per_step.insert((b["world"].as_u64().unwrap(), rows));
        }
    }
    assert!(per_step.contains(&(2, 40)) && per_step.contains(&(4, 80)), "{per_step:?}");
    // Back at 2 workers, the global batch and the rate are what they were:
    // the adapter is told the world went from 4 to 2, though the workers
    // told to go left before the boundary.
    let grown = steps.iter().position(|s| s["world"] == 4).expect("the job grew to 4 workers");
    let lr = |s: &serde_json::Value| s["lr"].as_f64().unwrap();
    // Each stretch at 2 workers after that: the batch of 2 workers, and the
    // job's own rate once the rate's ramp (8 steps) is over.
    let mut over = 0;
    for back in steps[grown..].chunk_by(|a, b| a["world"] == b["world"]).filter(|c| c[0]["world"] == 2) {
        assert!(back.iter().all(|s| s["batch"] == 40), "{back:?}");
        if let Some(s) = back.get(8) {
            assert!((lr(s) - lr(&steps[0])).abs() < 1e-6, "{} -> {}", lr(&steps[0]), lr(s));
            over += 1;
        }
    }
    assert!(over > 0, "no stretch at 2 workers past its ramp: {steps:?}");
    // The job's first steps, on the 2 workers it starts with, train at its
    // own rate (`--lr`, 0.05 by default).
    let first = steps.iter().take_while(|s| s["world"] == 2);
    assert!(first.clone().count() >= 20 && first.clone().all(|s| (lr(s) - 0.05).abs() < 1e-6), "{steps:?}");
}

/// A job killed on 2 workers and resumed on 1: the adapter is told the
/// world goes from the 2 its checkpoint's hyperparameters were set for to
/// 1, so `dynamic-batch` (each worker keeps its 20 rows) halves the global
/// batch, rather than taking the checkpoint's 40 for the new world's own.
#[test]
fn a_job_resumed_on_fewer_workers_tells_the_adapter_the_world_of_its_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--no-distill", "--epochs", "3", "--checkpoint-every-steps", "5", "--step-delay-ms", "30"];
    let on = |workers: &'static str| {
        let mut cmd = job(dir.path(), &flags);
        cmd.args([
            "--job",
            "adapter-resume",
            "--policy",
            art::SCHEDULE_WASM,
            "--adapter",
            art::DYNAMIC_BATCH_WASM,
        ]);
        cmd.args(["--workers", workers, "--min-workers", workers, "--max-workers", workers]);
        cmd
    };
    let mut child = on("2").spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(120));
    child.kill().unwrap();
    child.wait().unwrap();
    let r = run_to_its_report(on("1"), dir.path());
    let from = r["resumed_from_step"].as_u64().unwrap_or_else(|| panic!("not resumed: {r}"));
    assert!(from >= 5, "resumed from step {from}");
    assert_exactly_once(&r, 3, 1200);
    let steps = r["timeline"].as_array().unwrap();
    let resumed: Vec<&Value> = steps.iter().filter(|s| s["step"].as_u64().unwrap() > from).collect();
    assert!(!resumed.is_empty() && resumed.iter().all(|s| s["world"] == 1), "{resumed:?}");
    assert!(resumed.iter().all(|s| s["batch"] == 20), "each worker's 20 rows: {resumed:?}");
    // And the rate with it: a ramp from the job's 0.05, which its 2
    // workers trained at, to half of it once its 8 steps are over.
    let lr = |s: &&Value| s["lr"].as_f64().unwrap();
    assert!((lr(&resumed[0]) - 0.05).abs() < 1e-6, "{resumed:?}");
    assert!(resumed.len() > 9 && resumed[9..].iter().all(|s| (lr(s) - 0.025).abs() < 1e-6), "{resumed:?}");
}

/// The goodput adapter on two workers whose steps are mostly fixed cost
/// (40 ms each, whatever the batch): once the noise scale is measured, a
/// larger batch gives more goodput, and the adapter takes one, within
/// `--batch-max`, with the learning rate raised by AdaScale's gain.
#[test]
fn the_goodput_adapter_grows_the_batch_when_steps_are_mostly_fixed_cost() {
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--no-distill", "--epochs", "4", "--batch", "16", "--batch-max", "160", "--lr", "0.02"];
    let mut cmd = job(dir.path(), &flags);
    cmd.args(["--workers", "2", "--min-workers", "2", "--max-workers", "2"]);
    cmd.args(["--policy", art::SCHEDULE_WASM, "--decide-every-steps", "4", "--step-delay-ms", "40"]);
    cmd.args(["--adapter", art::GOODPUT_WASM]);
    let r = run_to_its_report(cmd, dir.path());
    assert_exactly_once(&r, 4, 1200);
    let steps = r["timeline"].as_array().unwrap();
    let batches: Vec<u64> = steps.iter().map(|s| s["batch"].as_u64().unwrap()).collect();
    assert_eq!(batches[0], 16, "it starts at --batch");
    let grown =
        steps.iter().find(|s| s["batch"].as_u64().unwrap() > 16).unwrap_or_else(|| panic!("{batches:?}"));
    assert!(
        batches.iter().all(|&b| b <= 160 && b % 2 == 0),
        "within --batch-max, a multiple of the workers: {batches:?}"
    );
    // Only once the noise scale is measured, and with a larger rate.
    let first_measured = steps.iter().position(|s| s.get("noise_scale").is_some()).unwrap();
    let first_grown = steps.iter().position(|s| s["batch"].as_u64().unwrap() > 16).unwrap();
    assert!(first_grown > first_measured, "grown at {first_grown}, measured from {first_measured}");
    let lr = grown["lr"].as_f64().unwrap();
    assert!(lr > 0.02 && lr < 0.02 * grown["batch"].as_f64().unwrap() / 16.0, "{grown}");
    // What it was told and answered is in the report; replayed, the adapter
    // answers the same.
    let told = r["adapter_decisions"].as_array().unwrap();
    assert!(told.iter().any(|d| d["stats"]["noise_scale"].as_f64().unwrap() > 0.0), "{told:?}");
    let out = Command::new(env!("CARGO_BIN_EXE_edl-runtime"))
        .args(["plugin", "replay", "--adapter", art::GOODPUT_WASM, "--json", "--trace"])
        .arg(dir.path().join("report.json"))
        .arg("--plugin-cache")
        .arg(dir.path().join("plugin-cache"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let lines: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), told.len());
    for (replayed, d) in lines.iter().zip(told) {
        if !d["answer"].is_null() {
            let (a, b) = (&replayed["answer"], &d["answer"]);
            let lr = |h: &serde_json::Value| h["lr"].as_f64().unwrap() as f32;
            assert_eq!(
                (&a["global_batch"], &a["local_batch"]),
                (&b["global_batch"], &b["local_batch"]),
                "{d}"
            );
            assert_eq!(lr(a), lr(b), "{replayed} against {d}");
        }
    }
    let answered = told.iter().filter(|d| !d["answer"].is_null()).count();
    assert!(err.contains(&format!("{answered} answered as in the job")), "{err}");
}

/// A job of one worker measures the gradient noise scale too: the built-in
/// trainer computes its batch in two parts, which the estimate compares
/// as it compares two ranks' shares.
#[test]
fn one_worker_measures_the_noise_scale_from_two_parts_of_its_batch() {
    let dir = tempfile::tempdir().unwrap();
    let cmd =
        steady(dir.path(), &["--epochs", "2", "--workers", "1", "--min-workers", "1", "--max-workers", "1"]);
    let r = run_to_its_report(cmd, dir.path());
    assert_exactly_once(&r, 2, 1200);
    let steps = r["timeline"].as_array().unwrap();
    assert!(steps.iter().all(|s| s["world"] == 1), "one worker throughout");
    let measured: Vec<f64> = steps.iter().filter_map(|s| s.get("noise_scale")?.as_f64()).collect();
    assert!(measured.len() * 2 > steps.len(), "{} of {} steps measured", measured.len(), steps.len());
    assert!(measured.iter().all(|b| b.is_finite() && *b > 0.0), "{measured:?}");
    // Measured on every fourth step (plan step k = 0, 4, 8, ...; its
    // record says step k + 1): the smoothed parts move there and only there.
    let var = |s: &Value| s["grad_var"].as_f64();
    let moved: Vec<u64> = steps
        .windows(2)
        .filter(|w| var(&w[1]) != var(&w[0]))
        .map(|w| w[1]["step"].as_u64().unwrap() - 1)
        .collect();
    assert!(moved.iter().all(|k| k % 4 == 0), "measured at steps {moved:?}");
    assert!(moved.len() * 4 + 8 >= steps.len(), "measured at {moved:?} of {} steps", steps.len());
}

/// The goodput policy, from one worker, on steps of fixed cost (40 ms
/// whatever the rows) and a batch that cannot grow (`--batch-max` is the
/// batch): its model of two workers, guessed from one (a fixed share of the
/// one measured step time), says a second pays, so it grows to two; it
/// tries each next count while the model says so, and once measured finds
/// the workers past the first add next to no goodput (the step's time does
/// not fall with fewer rows each): it settles back at one.
#[test]
fn the_goodput_policy_tries_two_workers_and_keeps_one_that_pays() {
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--no-distill", "--epochs", "6", "--batch", "16", "--batch-max", "16", "--lr", "0.02"];
    let mut cmd = job(dir.path(), &flags);
    cmd.args(["--workers", "1", "--min-workers", "1", "--max-workers", "3", "--decide-every-steps", "4"]);
    cmd.args(["--step-delay-ms", "40", "--policy", art::GOODPUT_POLICY_WASM, "--adapter", art::GOODPUT_WASM]);
    let r = run_to_its_report(cmd, dir.path());
    assert_exactly_once(&r, 6, 1200);
    let sizes: Vec<(u64, u64, String)> = r["scale_events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["from"].as_u64().unwrap(),
                e["to"].as_u64().unwrap(),
                e["reason"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let first = &sizes[1];
    assert!((first.0, first.1) == (1, 2) && first.2.starts_with("policy"), "grew to two first: {sizes:?}");
    let last = sizes.last().unwrap();
    assert!((last.0, last.1) == (2, 1) && last.2.starts_with("policy"), "settled at one: {sizes:?}");
    assert_eq!(r["final_world_size"], 1, "{sizes:?}");
    // One worker a decision, up or down.
    assert!(sizes.iter().all(|e| e.0.abs_diff(e.1) == 1), "{sizes:?}");
    let timeline = r["timeline"].as_array().unwrap();
    let with_two = timeline.iter().filter(|s| s["world"] == 2);
    assert!(with_two.clone().count() > 0 && with_two.clone().all(|s| s.get("noise_scale").is_some()));
}

/// A failure's scale event splits its pause into phases that add up to it,
/// and the survivors were out of their collectives well before the
/// collectives' 5 s bound (the dead worker's sockets closed with it).
fn assert_recovery_adds_up(event: &serde_json::Value) {
    let r = &event["recovery"];
    let phases = ["detect_ms", "abort_ms", "form_ms", "first_step_ms"]
        .map(|k| r[k].as_f64().unwrap_or_else(|| panic!("{k} in a failure's event: {event}")));
    assert!(phases.iter().all(|&p| p >= 0.0), "{event}");
    let sum: f64 = phases.iter().sum();
    let pause = event["pause_ms"].as_f64().unwrap();
    assert!((sum - pause).abs() < 1.0, "phases {phases:?} add up to {sum}, the pause is {pause}: {event}");
    assert!(phases[1] < 4000.0, "the survivors waited for the collective's bound: {event}");
}
