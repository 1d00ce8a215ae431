//! The elastic teacher pool, with real processes: students on Redis, the
//! job's teachers emulating an accelerator (a sleep per row, so that the
//! pool's size and not the two cores sets their pace), and the shipped
//! `teacher-autoscale` policy sizing the pool as the students come and go.

use crate::support::{
    free_ports,
    job::{assert_exactly_once, finish, job, lines, report},
    servers::RedisServer,
};
use edl_plugin_artifacts as art;
use serde_json::Value;
use std::process::Stdio;

/// The teacher events of a report: (step, from, to, reason).
fn teacher_events(r: &Value) -> Vec<(u64, u64, u64, String)> {
    r["teacher_events"]
        .as_array()
        .unwrap_or_else(|| panic!("no teacher_events: {r}"))
        .iter()
        .map(|e| {
            let n = |k: &str| e[k].as_u64().unwrap();
            (n("step"), n("from"), n("to"), e["reason"].as_str().unwrap().to_string())
        })
        .collect()
}

/// A job of the built-in student on Redis whose teachers emulate `row_us`
/// µs a row, sized by the shipped teacher policy (deciding every second,
/// settling for a second, shrinking after two idle decisions in a row).
fn pooled_job(
    d: &std::path::Path,
    redis: &RedisServer,
    row_us: &str,
    extra: &[&str],
) -> std::process::Command {
    let mut cmd = job(d, extra);
    cmd.args(["--store", &redis.url(), "--job", "pool", "--train-samples", "4000"])
        .args(["--max-teachers", "3", "--teacher-emulate-row-us", row_us])
        .args(["--teacher-policy", art::TEACHER_AUTOSCALE_WASM, "--teacher-decide-secs", "1"])
        .args(["--teacher-policy-config", "settle-secs=1", "--teacher-policy-config", "shrink-after=2"])
        .stdout(Stdio::piped());
    cmd
}

/// Runs `cmd` to its end; returns its report and all it said.
fn run(cmd: &mut std::process::Command, d: &std::path::Path) -> (Value, String) {
    let mut child = cmd.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    let status = finish(child, rx, &mut seen);
    let said = seen.join("\n");
    assert!(status.success(), "{said}");
    (report(d), said)
}

#[test]
fn the_pool_grows_while_students_wait_on_busy_teachers() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Four students, 64 rows a step of 50 ms, for teachers that take 3 ms
    // a row: one teacher is busy all the time, and the students wait; two
    // keep them waiting still.
    let mut cmd = pooled_job(d, &redis, "3000", &["--teachers", "1", "--epochs", "2", "--batch", "64"]);
    cmd.args(["--workers", "4", "--min-workers", "4", "--max-workers", "4", "--step-delay-ms", "50"]);
    let (r, said) = run(&mut cmd, d);
    assert_exactly_once(&r, 2, 4000);
    let events = teacher_events(&r);
    assert!(events.iter().all(|e| e.2 == e.1 + 1 && e.3.contains("grows")), "one at a time: {events:?}");
    assert_eq!(events.last().map(|e| e.2), Some(3), "grown to the bound: {events:?}\n{said}");
    assert!(events[0].3.contains("students waited") && events[0].3.contains("busy"), "{events:?}");
    assert!(said.contains("teachers  step"), "the pool's changes are said as they happen: {said}");
    assert!(said.contains("teachers  a pool of 1..3, sized by edl-plugin-teacher-autoscale"), "{said}");
    assert!(said.contains("teacher pool: 1 -> 3 teachers in 2 changes (at most 3)"), "the summary: {said}");
    // Every teacher the pool started served: each one's log is there.
    let logs = std::fs::read_dir(d.join(".edl/pool/logs")).unwrap();
    let teachers = logs.flatten().filter(|e| e.file_name().to_string_lossy().starts_with("teacher-")).count();
    assert_eq!(teachers, 3, "teacher logs");
    // The policy saw the students' request times at each teacher: every
    // request carries a row or more at 3 ms a row.
    let seen: Vec<(f64, f64)> = r["teacher_decisions"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|d| d["view"]["teachers"].as_array().unwrap().clone())
        .map(|t| (t["p50_ms"].as_f64().unwrap(), t["p99_ms"].as_f64().unwrap()))
        .collect();
    assert!(!seen.is_empty() && seen.iter().any(|&(p50, _)| p50 > 0.0), "{seen:?}");
    for &(p50, p99) in seen.iter().filter(|t| t.0 > 0.0) {
        assert!(p50 >= 3.0 && p99 >= p50, "p50 {p50} ms, p99 {p99} ms");
    }
    replays_to_the_same_decisions(d, &r);
}

#[test]
fn the_pool_grows_ahead_of_the_students_the_scaling_policy_adds() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Two students, four from step 40 (the `schedule` policy), of steps of
    // 50 ms; teachers of 0.1 ms a row never keep them waiting: only the
    // planned scale-out can grow the pool.
    let mut cmd = pooled_job(d, &redis, "100", &["--teachers", "1", "--epochs", "1", "--batch", "32"]);
    cmd.args(["--workers", "2", "--min-workers", "2", "--max-workers", "4", "--step-delay-ms", "50"]);
    cmd.args(["--policy", art::SCHEDULE_WASM, "--policy-config", "every=40", "--policy-config", "by=2"]);
    cmd.args(["--decide-every-steps", "10"]);
    let (r, said) = run(&mut cmd, d);
    assert_exactly_once(&r, 1, 4000);
    let out = r["scale_events"]
        .as_array()
        .unwrap()
        .iter()
        // The two new students may join in one generation or in two (a
        // loaded machine readies them apart): the first growth is theirs.
        .find(|e| e["from"].as_u64() == Some(2) && e["to"].as_u64() > Some(2))
        .unwrap_or_else(|| panic!("no scale-out from 2: {}", r["scale_events"]))
        .clone();
    let events = teacher_events(&r);
    let first = events.first().unwrap_or_else(|| panic!("the pool never changed\n{said}"));
    // Told at once that two more students were planned, the pool doubled
    // before they joined, with that as its reason.
    assert_eq!((first.1, first.2), (1, 2), "{events:?}");
    assert!(first.3.contains("grows") && first.3.contains("students 2 -> 4"), "{events:?}");
    assert!(first.0 <= out["step"].as_u64().unwrap(), "grown at step {}, students joined at {out}", first.0);
}

/// The report's teacher decisions, replayed by `plugin replay
/// --teacher-policy` with the job's policy and configuration, come out as
/// the job's policy answered them.
fn replays_to_the_same_decisions(d: &std::path::Path, r: &Value) {
    let recorded = r["teacher_decisions"].as_array().unwrap();
    assert!(recorded.len() >= 3, "{recorded:?}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_edl-runtime"))
        .current_dir(d)
        .args(["plugin", "replay", "--teacher-policy", art::TEACHER_AUTOSCALE_WASM, "--trace", "report.json"])
        .args(["--config", "settle-secs=1", "--config", "shrink-after=2", "--json"])
        .output()
        .unwrap();
    let (said, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{err}");
    let replayed: Vec<Value> = said.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(replayed.len(), recorded.len(), "{said}");
    for (a, b) in replayed.iter().zip(recorded) {
        assert_eq!(a["plan"], b["plan"], "replayed {a} against recorded {b}");
    }
    assert!(err.contains(&format!("{} decisions of edl-plugin-teacher-autoscale", recorded.len())), "{err}");
}

#[test]
fn the_pool_shrinks_to_what_few_students_need_and_no_further() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // One student of 16 rows a step of 100 ms, three teachers of 0.1 ms a
    // row: the teachers idle, the student does not wait.
    let mut cmd = pooled_job(d, &redis, "100", &["--teachers", "3", "--epochs", "2", "--batch", "16"]);
    cmd.args(["--workers", "1", "--min-workers", "1", "--max-workers", "1", "--step-delay-ms", "100"]);
    cmd.args(["--train-samples", "1200"]);
    let (r, said) = run(&mut cmd, d);
    assert_exactly_once(&r, 2, 1200);
    let events = teacher_events(&r);
    let sizes: Vec<(u64, u64)> = events.iter().map(|e| (e.1, e.2)).collect();
    assert_eq!(sizes, vec![(3, 2), (2, 1)], "{events:?}\n{said}");
    assert!(events.iter().all(|e| e.3.contains("shrinks")), "{events:?}");
    // The teachers that went drained first: no student's request to them failed.
    let logs = d.join(".edl/pool/logs");
    for e in std::fs::read_dir(&logs).unwrap().flatten() {
        if e.file_name().to_string_lossy().starts_with("worker-") {
            let log = std::fs::read_to_string(e.path()).unwrap();
            assert!(log.contains("left; draining its"), "the student saw the teachers leave: {log}");
            for failed in ["its requests go elsewhere", "no more requests go to it", "request task failed"] {
                assert!(!log.contains(failed), "a request failed ({failed}): {log}");
            }
        }
    }
}

/// Rows each teacher of a job served, from the line each prints as it stops.
fn rows_served(logs: &std::path::Path) -> Vec<u64> {
    let mut rows = Vec::new();
    for e in std::fs::read_dir(logs).unwrap().flatten() {
        if !e.file_name().to_string_lossy().starts_with("teacher-") {
            continue;
        }
        let log = std::fs::read_to_string(e.path()).unwrap();
        let line =
            log.lines().find(|l| l.contains(": served ")).unwrap_or_else(|| panic!("no summary: {log}"));
        let n = line.split(": served ").nth(1).and_then(|r| r.split(' ').next()).unwrap();
        rows.push(n.parse().unwrap());
    }
    rows
}

#[test]
fn four_students_share_two_teachers_one_each_and_evenly() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut cmd = job(d, &["--teachers", "2", "--epochs", "1", "--batch", "64", "--job", "bal"]);
    cmd.args(["--workers", "4", "--min-workers", "4", "--max-workers", "4", "--train-samples", "4000"]);
    cmd.args(["--teacher-emulate-row-us", "200", "--step-delay-ms", "20"]).stdout(Stdio::piped());
    let (r, said) = run(&mut cmd, d);
    assert_exactly_once(&r, 1, 4000);
    let logs = d.join(".edl/bal/logs");
    let mut told = Vec::new();
    for e in std::fs::read_dir(&logs).unwrap().flatten() {
        if e.file_name().to_string_lossy().starts_with("worker-") {
            let log = std::fs::read_to_string(e.path()).unwrap();
            // Each student calls its own one of the two, not both.
            let share =
                log.lines().rev().find(|l| l.contains(" of 4 calls ")).unwrap_or_else(|| panic!("{log}"));
            assert!(share.contains("calls 1 of 2 teachers"), "{share}");
            told.push(share.rsplit(": ").next().unwrap().to_string());
            for failed in ["its requests go elsewhere", "no more requests go to it"] {
                assert!(!log.contains(failed), "a request failed ({failed}): {log}");
            }
        }
    }
    told.sort();
    assert_eq!(told.len(), 4, "{said}");
    assert!(told[0] == told[1] && told[2] == told[3] && told[1] != told[2], "two students each: {told:?}");
    let rows = rows_served(&logs);
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert!(rows.iter().sum::<u64>() >= 4000, "every sample got soft labels: {rows:?}");
    let (lo, hi) = (*rows.iter().min().unwrap() as f64, *rows.iter().max().unwrap() as f64);
    assert!(hi <= 1.5 * lo, "each teacher within 1.5x of the other's rows: {rows:?}");
}

/// A command that starts an `edl-runtime teacher` on `{addr}:{port}` with
/// the job's model, emulating `row_us` a row; it registers nowhere (the
/// job registers its endpoint).
fn edl_teacher_command(row_us: &str) -> String {
    format!(
        "exec {{exe}} teacher --listen {{addr}}:{{port}} --model {{model}} --store memory --emulate-row-us {row_us}"
    )
}

#[test]
fn teachers_started_by_command_join_the_pool_and_leave_it_drained() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let stopped = d.join("stopped");
    let port = free_ports(3).to_string();
    // Notes it, and gives the teacher notice (SIGTERM: it drains and exits).
    let stop = format!(
        "echo {{id}} {{port}} >> {}; pkill -TERM -f 'liste[n] 127.0.0.1:'{{port}}",
        stopped.display()
    );
    // The shrink test's job, its teachers started by command on three slots.
    let mut cmd = pooled_job(d, &redis, "100", &["--teachers", "3", "--epochs", "2", "--batch", "16"]);
    cmd.args(["--workers", "1", "--min-workers", "1", "--max-workers", "1", "--step-delay-ms", "100"]);
    cmd.args(["--train-samples", "1200", "--teacher-command", &edl_teacher_command("100")]);
    cmd.args(["--teacher-hosts", "127.0.0.1:3", "--teacher-port", &port, "--teacher-stop-command", &stop]);
    let (r, said) = run(&mut cmd, d);
    assert_exactly_once(&r, 2, 1200);
    for i in 0..3u16 {
        let at = format!("teacher   {i} serving on 127.0.0.1:{}", port.parse::<u16>().unwrap() + 2 * i);
        assert!(said.contains(&at), "{at}: {said}");
    }
    // The pool shrank, one at a time (how far depends on the machine's pace).
    let sizes: Vec<(u64, u64)> = teacher_events(&r).iter().map(|e| (e.1, e.2)).collect();
    assert!(!sizes.is_empty() && sizes.iter().all(|&(a, b)| b + 1 == a), "{sizes:?}\n{said}");
    // Each got its stop command once: as the pool shrank, or at the end.
    let mut ran: Vec<String> = std::fs::read_to_string(&stopped).unwrap().lines().map(String::from).collect();
    ran.sort();
    assert_eq!(ran.len(), 3, "{ran:?}");
    let logs = d.join(".edl/pool/logs");
    for e in std::fs::read_dir(&logs).unwrap().flatten() {
        if e.file_name().to_string_lossy().starts_with("worker-") {
            let log = std::fs::read_to_string(e.path()).unwrap();
            assert!(log.contains("left; draining its"), "the student saw the teachers leave: {log}");
            for failed in ["its requests go elsewhere", "no more requests go to it", "request task failed"] {
                assert!(!log.contains(failed), "a request failed ({failed}): {log}");
            }
        }
    }
    // Nothing serves on the slots once the job is over.
    for i in 0..3u16 {
        let p = port.parse::<u16>().unwrap() + 2 * i;
        assert!(std::net::TcpStream::connect(("127.0.0.1", p)).is_err(), "port {p} still open");
    }
}

#[test]
fn an_mlserver_started_by_command_serves_the_students_once_its_model_is_ready() {
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_edl-runtime"));
    let venv = exe.parent().unwrap().parent().unwrap().join("mlserver/venv");
    let bin = crate::support::python::venv_with(&venv, "import mlserver", &["mlserver>=1.7,<2"])
        .unwrap_or_else(|e| panic!("MLServer from the package registry: {e}"));
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let repo = d.join("models");
    std::fs::create_dir_all(repo.join("digits")).unwrap();
    std::fs::write(repo.join("digits/model.py"), crate::distill::MLSERVER_MODEL).unwrap();
    std::fs::write(
        repo.join("digits/model-settings.json"),
        r#"{"name": "digits", "implementation": "model.Probs"}"#,
    )
    .unwrap();
    // Its ports from the command's environment, the rest from its settings.
    std::fs::write(
        repo.join("settings.json"),
        r#"{"host": "127.0.0.1", "metrics_endpoint": null, "parallel_workers": 0}"#,
    )
    .unwrap();
    let start = format!(
        "MLSERVER_HTTP_PORT={{port}} MLSERVER_GRPC_PORT={{port2}} exec {} start {}",
        bin.join("mlserver").display(),
        repo.display()
    );
    let port = free_ports(1);
    let mut cmd = job(d, &["--teachers", "1", "--epochs", "1", "--job", "mls", "--teacher-command", &start]);
    cmd.args(["--teacher-hosts", "127.0.0.1", "--teacher-port", &port.to_string()]);
    cmd.args(["--teacher-endpoint", "http://{addr}:{port}/digits@probs"]).stdout(Stdio::piped());
    let (r, said) = run(&mut cmd, d);
    assert_exactly_once(&r, 1, 1200);
    assert!(said.contains(&format!("teacher   0 serving on http://127.0.0.1:{port}/digits@probs")), "{said}");
    // The students' requests reached it (it was asked ready first, then to infer).
    let log = std::fs::read_to_string(d.join(".edl/mls/logs/teacher-0.log")).unwrap();
    assert!(log.contains("GET /v2/models/digits/ready"), "{log}");
    let infers = log.matches("POST /v2/models/digits/infer").count();
    assert!(infers >= 1200 / 64, "{infers} requests: {log}");
    // It left with the job: stopped, its ports closed.
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err(), "still serving: {log}");
}

/// The teacher processes a coordinator started: its children running
/// `edl-runtime teacher`.
fn teacher_pids(coordinator: u32) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        // The parent is the fourth field, after the command in parentheses.
        let ppid = stat.rsplit_once(") ").and_then(|(_, r)| r.split(' ').nth(1)).and_then(|p| p.parse().ok());
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        if ppid == Some(coordinator) && String::from_utf8_lossy(&cmdline).contains("teacher\0--listen") {
            out.push(pid);
        }
    }
    out.sort();
    out
}

/// What the students' logs say of failed requests (none is the goal).
fn failed_requests(logs: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(logs).unwrap().flatten() {
        if e.file_name().to_string_lossy().starts_with("worker-") {
            let log = std::fs::read_to_string(e.path()).unwrap();
            let bad = ["its requests go elsewhere", "no more requests go to it", "request task failed"];
            out.extend(log.lines().filter(|l| bad.iter().any(|b| l.contains(b))).map(String::from));
        }
    }
    out
}

#[test]
fn a_teacher_sigtermed_mid_epoch_drains_losing_nothing_and_one_sigkilled_is_replaced() {
    use crate::support::wait::wait_for;
    use std::time::Duration;
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Two students, two teachers the pool keeps (a size the policy cannot change).
    let mut cmd = pooled_job(d, &redis, "200", &["--teachers", "2", "--epochs", "4", "--batch", "32"]);
    cmd.args(["--min-teachers", "2", "--max-teachers", "2", "--train-samples", "1200"]);
    cmd.args(["--workers", "2", "--min-workers", "2", "--max-workers", "2", "--step-delay-ms", "100"]);
    let mut child = cmd.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    // Training, the students calling both teachers.
    wait_for(&rx, "0 -> 2 workers", &mut seen, Duration::from_secs(120));
    std::thread::sleep(Duration::from_secs(1));
    let first = teacher_pids(child.id());
    assert_eq!(first.len(), 2, "{first:?}\n{}", seen.join("\n"));
    // SIGTERM, as Slurm or Kubernetes give notice: it deregisters, drains, exits.
    unsafe { libc::kill(first[0], libc::SIGTERM) };
    wait_for(&rx, "exited; replaced", &mut seen, Duration::from_secs(60));
    let logs = d.join(".edl/pool/logs");
    assert_eq!(failed_requests(&logs), Vec::<String>::new(), "no request failed with notice");
    // SIGKILL, without notice: its requests go elsewhere, and it is replaced.
    let now = teacher_pids(child.id());
    let other = *now.iter().find(|p| **p != first[0]).unwrap();
    unsafe { libc::kill(other, libc::SIGKILL) };
    let status = finish(child, rx, &mut seen);
    let said = seen.join("\n");
    assert!(status.success(), "{said}");
    let r = report(d);
    assert_exactly_once(&r, 4, 1200);
    let replaced: Vec<_> =
        teacher_events(&r).into_iter().filter(|e| e.3.contains("exited; replaced")).collect();
    assert_eq!(replaced.len(), 2, "both replaced: {replaced:?}\n{said}");
    assert!(replaced.iter().all(|e| (e.1, e.2) == (2, 2)), "{replaced:?}");
}

#[test]
fn a_standby_serves_the_job_with_its_own_teachers_and_sizes_them_once_it_takes_over() {
    use crate::support::wait::wait_for;
    use std::time::Duration;
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    let checkpoints = dir.path().join("checkpoints");
    let coordinator = |d: &std::path::Path, extra: &[&str]| {
        let mut cmd = pooled_job(d, &redis, "100", &["--teachers", "1", "--epochs", "20", "--batch", "16"]);
        cmd.args(["--workers", "1", "--min-workers", "1", "--max-workers", "1", "--step-delay-ms", "40"]);
        cmd.args(["--train-samples", "400", "--checkpoint-every-steps", "5", "--checkpoint-dir"]);
        cmd.arg(&checkpoints).args(extra);
        cmd
    };
    let mut active = coordinator(&a, &[]).spawn().unwrap();
    let rx = lines(&mut active);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(120));
    let old_teachers = teacher_pids(active.id());
    assert_eq!(old_teachers.len(), 1, "{}", seen.join("\n"));
    let mut standby = coordinator(&b, &["--standby"]).spawn().unwrap();
    let rx_b = lines(&mut standby);
    let mut seen_b = Vec::new();
    // Its teacher serves (the active job's students too) while it waits.
    wait_for(&rx_b, "teacher   0 serving on", &mut seen_b, Duration::from_secs(120));
    wait_for(&rx_b, "waiting to take the job over", &mut seen_b, Duration::from_secs(120));
    unsafe { libc::kill(active.id() as i32, libc::SIGKILL) };
    let _ = active.wait();
    let status = finish(standby, rx_b, &mut seen_b);
    let said = seen_b.join("\n");
    assert!(status.success(), "{said}");
    assert!(said.contains("resuming job \"pool\" from"), "{said}");
    let r = report(&b);
    assert_exactly_once(&r, 20, 400);
    // Its pool was its own from the takeover: it decided, on what it saw.
    assert!(!r["teacher_decisions"].as_array().unwrap().is_empty(), "{r}");
    // The dead coordinator's teacher died with it.
    let gone = |pid: i32| {
        !std::path::Path::new(&format!("/proc/{pid}")).exists()
            || std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") Z "))
    };
    assert!(old_teachers.iter().all(|&p| gone(p)), "{old_teachers:?}");
}

#[test]
fn a_standby_takes_over_the_teachers_started_by_command_and_stops_them_at_the_end() {
    use crate::support::wait::wait_for;
    use std::time::Duration;
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    let checkpoints = dir.path().join("checkpoints");
    let stopped = dir.path().join("stopped");
    let port = free_ports(2).to_string();
    let stop = format!(
        "echo {{id}} {{port}} >> {}; pkill -TERM -f 'liste[n] 127.0.0.1:'{{port}}",
        stopped.display()
    );
    // The same flags for both: a teacher by command on one of two slots.
    let coordinator = |d: &std::path::Path, extra: &[&str]| {
        let mut cmd = pooled_job(d, &redis, "100", &["--teachers", "1", "--epochs", "20", "--batch", "16"]);
        cmd.args(["--workers", "1", "--min-workers", "1", "--max-workers", "1", "--step-delay-ms", "40"]);
        cmd.args(["--train-samples", "400", "--checkpoint-every-steps", "5", "--checkpoint-dir"]);
        cmd.arg(&checkpoints).args(["--teacher-command", &edl_teacher_command("100")]);
        cmd.args([
            "--teacher-hosts",
            "127.0.0.1:2",
            "--teacher-port",
            &port,
            "--teacher-stop-command",
            &stop,
        ]);
        cmd.args(extra);
        cmd
    };
    let mut active = coordinator(&a, &[]).spawn().unwrap();
    let _kill_active = crate::support::KillPid(active.id() as i32);
    let rx = lines(&mut active);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(120));
    let old = teacher_pids(active.id());
    assert_eq!(old.len(), 1, "{}", seen.join("\n"));
    let _kill_teacher = crate::support::KillPid(old[0]);
    let mut standby = coordinator(&b, &["--standby"]).spawn().unwrap();
    let rx_b = lines(&mut standby);
    let mut seen_b = Vec::new();
    wait_for(&rx_b, "waiting to take the job over", &mut seen_b, Duration::from_secs(120));
    unsafe { libc::kill(active.id() as i32, libc::SIGKILL) };
    let _ = active.wait();
    let alive =
        |pid: i32| std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "));
    assert!(alive(old[0]), "the teacher outlives the coordinator killed without notice");
    let status = finish(standby, rx_b, &mut seen_b);
    let said = seen_b.join("\n");
    assert!(status.success(), "{said}");
    // The standby started no teacher of its own while it waited.
    assert!(!said.contains("serving on"), "{said}");
    let r = report(&b);
    assert_exactly_once(&r, 20, 400);
    let events = teacher_events(&r);
    assert!(
        events.iter().any(
            |e| (e.1, e.2) == (0, 1) && e.3.contains("1 teacher(s) of the coordinator before taken over")
        ),
        "{events:?}\n{said}"
    );
    // It served the standby's students: the teacher's log (opened by the
    // coordinator before) says what it served when it was stopped.
    let ran = std::fs::read_to_string(&stopped).unwrap();
    assert_eq!(ran.trim(), format!("0 {port}"), "stopped once, by its stop command, as teacher 0: {ran}");
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while alive(old[0]) && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!alive(old[0]), "stopped at the job's end");
    // Both coordinators keep their logs beside the checkpoints.
    let log = std::fs::read_to_string(dir.path().join("logs/teacher-0.log")).unwrap();
    let served: u64 = log
        .lines()
        .find_map(|l| l.split("served ").nth(1)?.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("{log}"));
    // Every epoch's soft labels came from it while it was the only teacher.
    let alone = events.iter().all(|e| e.2 <= 1);
    let least = if alone { 20 * 400 } else { 2 * 400 };
    assert!(served >= least, "it served the old coordinator's students and the standby's: {log}\n{events:?}");
}

#[test]
fn a_teacher_computed_in_the_students_processes_gives_them_its_soft_labels_without_a_service() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // The same job (seed, data, model) with its teacher in the students'
    // processes, and without a teacher.
    let first_loss = |job: &str, extra: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_edl-runtime"))
            .current_dir(d)
            .args(["--job", job])
            .args([
                "--train-samples",
                "600",
                "--batch",
                "40",
                "--teacher-hidden",
                "64",
                "--teacher-epochs",
                "2",
            ])
            .args(["--epochs", "1", "--workers", "2", "--max-workers", "2", "--report", "report.json"])
            .args(extra)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(out.status.success(), "{said}{}", String::from_utf8_lossy(&out.stderr));
        let r = report(d);
        assert_exactly_once(&r, 1, 600);
        (r["timeline"][0]["loss"].as_f64().unwrap(), r, said)
    };
    let (with, r, said) =
        first_loss("in-process", &["--teacher-in-process", "--teacher-emulate-row-us", "50"]);
    assert!(
        said.contains(
            "teachers  computed in each student's process, on its step's path, emulating 50 us a row"
        )
    );
    assert!(!said.contains("serving on"), "no teacher service starts: {said}");
    assert!(r["teacher_test_accuracy"].as_f64().is_some_and(|a| a > 0.5), "{r}");
    let (without, ..) = first_loss("plain", &["--no-distill"]);
    // The first step's loss has the soft-label term only with the teacher.
    assert!((with - without).abs() > 1e-3, "with the teacher {with}, without {without}");
}
