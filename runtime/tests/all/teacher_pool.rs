//! The elastic teacher pool, with real processes: students on Redis, the
//! job's teachers emulating an accelerator (a sleep per row, so that the
//! pool's size and not the two cores sets their pace), and the shipped
//! `teacher-autoscale` policy sizing the pool as the students come and go.

use crate::support::{
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

/// A command that starts an `edl-runtime teacher` on `{host}:{port}` with
/// the job's model, emulating `row_us` a row; it registers nowhere (the
/// job registers its endpoint).
fn edl_teacher_command(row_us: &str) -> String {
    format!(
        "exec {{exe}} teacher --listen {{host}}:{{port}} --model {{model}} --store memory --emulate-row-us {row_us}"
    )
}

/// A free block of `n` ports on loopback, two apart from `first`.
fn free_ports(n: u16) -> u16 {
    loop {
        let first = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        if first < 60000 && (0..2 * n).all(|i| std::net::TcpListener::bind(("127.0.0.1", first + i)).is_ok())
        {
            return first;
        }
    }
}

#[test]
fn teachers_started_by_command_join_the_pool_and_leave_it_drained() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let stopped = d.join("stopped");
    let port = free_ports(3).to_string();
    let stop = format!("echo {{id}} {{port}} >> {}", stopped.display());
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
    let sizes: Vec<(u64, u64)> = teacher_events(&r).iter().map(|e| (e.1, e.2)).collect();
    assert_eq!(sizes, vec![(3, 2), (2, 1)], "{said}");
    // Each got its stop command once: two as the pool shrank, the last at the end.
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
    cmd.args(["--teacher-endpoint", "http://{host}:{port}/digits@probs"]).stdout(Stdio::piped());
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
