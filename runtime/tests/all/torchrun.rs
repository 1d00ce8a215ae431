//! `edl-runtime launch --torchrun` with a stand-in for a torchrun script
//! (`tests/programs/torchrun_probe.py`, plain Python): the environment its
//! ranks get, resizes by the policy, restarts after failures, and how the
//! last failure is reported.

use crate::support::{
    job::report,
    wait::{poll_while_running, wait_exit},
};
use edl_plugin_artifacts as art;
use serde_json::Value;
use std::{
    collections::BTreeMap,
    path::Path,
    process::{Child, Command, Stdio},
    time::Duration,
};

/// The probe's records: MASTER_PORT (one per group) -> rank -> environment.
type Groups = BTreeMap<String, BTreeMap<u32, Value>>;

fn records(dir: &Path) -> Groups {
    let mut groups = Groups::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if !(name.starts_with("start-") && name.ends_with(".json")) {
            continue;
        }
        let v: Value = serde_json::from_slice(&std::fs::read(e.path()).unwrap()).unwrap();
        let port = v["MASTER_PORT"].as_str().unwrap().to_string();
        let rank = v["RANK"].as_str().unwrap().parse().unwrap();
        groups.entry(port).or_default().insert(rank, v);
    }
    groups
}

/// Polls until `done` holds of the records.
fn wait_until(dir: &Path, launcher: &mut Child, what: &str, done: impl Fn(&Groups) -> bool) -> Groups {
    let check = || Some(records(dir)).filter(|g| done(g));
    let context = || format!("{:?}\n{}", records(dir), output(dir));
    poll_while_running(launcher, what, Duration::from_secs(180), check, context)
}

fn output(dir: &Path) -> String {
    let read = |n: &str| std::fs::read_to_string(dir.join(n)).unwrap_or_default();
    format!("stdout:\n{}\nstderr:\n{}", read("stdout.txt"), read("stderr.txt"))
}

fn launch(dir: &Path, flags: &[&str]) -> Child {
    let probe = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/torchrun_probe.py");
    Command::new(env!("CARGO_BIN_EXE_edl-runtime"))
        .current_dir(dir)
        .args([
            "launch",
            "--torchrun",
            "--job",
            "probe",
            "--policy",
            art::SCHEDULE_WASM,
            "--report",
            "report.json",
        ])
        .args(flags)
        .arg("--plugin-cache")
        .arg(dir.join("plugin-cache"))
        .arg("--")
        .arg("python3")
        .arg(probe)
        .arg(dir)
        .env_remove("OMP_NUM_THREADS")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(dir.join("stdout.txt")).unwrap())
        .stderr(std::fs::File::create(dir.join("stderr.txt")).unwrap())
        .spawn()
        .unwrap()
}

/// Waits for the launcher to end (bounded, as above).
fn exit_of(mut launcher: Child, dir: &Path) -> std::process::ExitStatus {
    wait_exit(&mut launcher, "the launcher", Duration::from_secs(180), || output(dir))
}

/// True when a group of `world` ranks at restart `restart` has all started.
fn complete(g: &Groups, world: u32, restart: &str) -> bool {
    g.values().any(|ranks| {
        ranks.len() as u32 == world
            && ranks.values().all(|v| {
                v["WORLD_SIZE"] == world.to_string().as_str() && v["TORCHELASTIC_RESTART_COUNT"] == restart
            })
    })
}

#[test]
fn ranks_get_torchruns_environment_and_the_group_is_resized_by_the_policy() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut launcher = launch(
        d,
        &["--min-workers", "1", "--max-workers", "3", "--policy-config", "every=1", "--decide-secs", "1"],
    );
    // Once a rank of a group of 3 is up, the ranks finish: the group then
    // running ends the job (or the next one, should the policy resize first).
    wait_until(d, &mut launcher, "a group of 3 ranks", |g| {
        g.values().flat_map(|ranks| ranks.values()).any(|v| v["WORLD_SIZE"] == "3")
    });
    std::fs::write(d.join("done"), "").unwrap();
    let status = exit_of(launcher, d);
    assert!(status.success(), "{status}: {}", output(d));

    for (port, ranks) in records(d) {
        let first = ranks.values().next().unwrap();
        let world: u32 = first["WORLD_SIZE"].as_str().unwrap().parse().unwrap();
        assert!((1..=3).contains(&world), "{first}");
        for (rank, v) in &ranks {
            assert!(*rank < world, "rank {rank} in a group of {world}: {v}");
            let r = rank.to_string();
            for (key, want) in [
                ("LOCAL_RANK", r.as_str()),
                ("ROLE_RANK", &r),
                ("GROUP_RANK", "0"),
                ("GROUP_WORLD_SIZE", "1"),
                ("LOCAL_WORLD_SIZE", first["WORLD_SIZE"].as_str().unwrap()),
                ("ROLE_WORLD_SIZE", first["WORLD_SIZE"].as_str().unwrap()),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", &port),
                // Resizes are not restarts.
                ("TORCHELASTIC_RESTART_COUNT", "0"),
                ("TORCHELASTIC_MAX_RESTARTS", "3"),
                ("TORCHELASTIC_RUN_ID", "probe"),
            ] {
                assert_eq!(v[key], want, "{key} of rank {rank}: {v}");
            }
            let threads = if world > 1 { Value::from("1") } else { Value::Null };
            assert_eq!(v["OMP_NUM_THREADS"], threads, "{v}");
            assert!(
                v["TORCHELASTIC_ERROR_FILE"].as_str().unwrap().ends_with(&format!("rank-{rank}.error.json"))
            );
        }
    }

    let r = report(d);
    assert_eq!(r["status"], "succeeded", "{r}");
    assert_eq!(r["outcome"]["restarts"], 0, "{r}");
    let worlds: Vec<u64> =
        r["outcome"]["groups"].as_array().unwrap().iter().map(|g| g["world"].as_u64().unwrap()).collect();
    assert_eq!(worlds[..3], [1, 2, 3], "the schedule grows the group one rank at a time: {r}");
    assert!(r["resizes"].as_u64().unwrap() >= 2, "{r}");
    let out = output(d);
    assert!(out.contains("scale     the policy asked for 3 ranks (2 before)"), "{out}");
    assert!(out.contains("[rank2]: rank 2 of 3 started"), "the ranks' output is shown: {out}");
}

#[test]
fn a_killed_rank_restarts_the_whole_group_which_then_finishes() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut launcher = launch(d, &["--min-workers", "2", "--max-workers", "2", "--max-restarts", "2"]);
    let g = wait_until(d, &mut launcher, "the first group", |g| complete(g, 2, "0"));
    let victim = g.values().next().unwrap()[&1]["pid"].as_i64().unwrap();
    // SAFETY: signalling a rank the launcher under test started.
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    wait_until(d, &mut launcher, "the restarted group", |g| complete(g, 2, "1"));
    std::fs::write(d.join("done"), "").unwrap();
    let status = exit_of(launcher, d);
    assert!(status.success(), "{status}: {}", output(d));
    let out = output(d);
    assert!(out.contains("restart   rank 1 failed (killed by signal 9 (SIGKILL)); restart 1/2"), "{out}");
    let r = report(d);
    assert_eq!(r["outcome"]["restarts"], 1, "{r}");
    assert_eq!(r["outcome"]["groups"].as_array().unwrap().len(), 2, "{r}");
}

#[test]
fn when_the_restarts_are_spent_the_failing_rank_is_reported_with_its_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for f in ["fail-1-0", "fail-1-1"] {
        std::fs::write(d.join(f), "").unwrap();
    }
    let launcher = launch(d, &["--min-workers", "2", "--max-workers", "2", "--max-restarts", "1"]);
    let status = exit_of(launcher, d);
    assert_eq!(status.code(), Some(3), "the failing rank's exit code: {}", output(d));
    let err = std::fs::read_to_string(d.join("stderr.txt")).unwrap();
    assert!(err.contains("rank 1 (pid "), "{err}");
    assert!(err.contains("failed: exit code 3"), "{err}");
    assert!(
        err.contains("its error file says: RuntimeError: rank 1 cannot go on: injected failure at restart 1"),
        "{err}"
    );
    assert!(err.contains("group-1/rank-1.log"), "the log is named: {err}");
    assert!(err.contains("    rank 1 cannot go on: injected failure at restart 1"), "its last lines: {err}");
    assert!(err.contains("no restart left (1 of 1 used)"), "{err}");
    let groups = records(d);
    let restarts: Vec<&str> =
        groups.values().map(|ranks| ranks[&1]["TORCHELASTIC_RESTART_COUNT"].as_str().unwrap()).collect();
    let mut sorted = restarts.clone();
    sorted.sort();
    assert_eq!(sorted, ["0", "1"], "{groups:?}");
    let r = report(d);
    assert_eq!(r["status"], "failed", "{r}");
    assert_eq!(r["outcome"]["failure"]["rank"], 1, "{r}");
    assert_eq!(r["outcome"]["failure"]["exit"], "exit code 3", "{r}");
}

#[test]
fn sigterm_stops_the_group_with_notice_writes_the_report_and_exits_143() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut launcher = launch(d, &["--min-workers", "2", "--max-workers", "2"]);
    let g = wait_until(d, &mut launcher, "the first group", |g| complete(g, 2, "0"));
    let ranks: Vec<i64> = g.values().next().unwrap().values().map(|v| v["pid"].as_i64().unwrap()).collect();
    // SAFETY: signalling the launcher this test started.
    unsafe { libc::kill(launcher.id() as i32, libc::SIGTERM) };
    let status = exit_of(launcher, d);
    let out = output(d);
    assert_eq!(status.code(), Some(143), "{out}");
    assert!(out.contains("stopped by SIGTERM: the group's ranks were stopped with notice"), "{out}");
    let left: Vec<i64> = ranks.into_iter().filter(|&p| crate::support::process::runs(p as u32)).collect();
    assert!(left.is_empty(), "ranks left running: {left:?}\n{out}");
    let r = report(d);
    assert_eq!(r["status"], "stopped", "{r}");
    assert_eq!(r["outcome"]["stopped_by"], 15, "{r}");
    let last = r["outcome"]["groups"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["ended"], "stopped by SIGTERM", "{r}");
}

/// An agent of an earlier edl (its hello without the control protocol's
/// number) is sent away before it joins, told why, and the launcher says so.
#[test]
fn an_agent_of_another_version_of_edl_is_sent_away_naming_both() {
    use edl_host_gpu::comm::auth::{self, JobAuth};
    use edl_runtime::control::proto::{Receiver, seal, send_encoded};
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let secret = d.join("job.secret");
    let flags = ["--scaler", "external", "--min-workers", "1", "--max-workers", "1", "--secret-file"];
    let mut launcher = launch(d, &[&flags[..], &[secret.to_str().unwrap()]].concat());
    // The launcher says where agents join, once it listens.
    let said = || {
        output(d).split("agents join at ").nth(1).and_then(|r| r.split_whitespace().next()).map(String::from)
    };
    let addr = poll_while_running(&mut launcher, "it listens", Duration::from_secs(120), said, || output(d));
    let job = JobAuth {
        job: "probe".into(),
        secret: edl_runtime::worker::session::read_secret_file(&secret).unwrap(),
    };
    let mut stream = std::net::TcpStream::connect(&addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let keys = auth::connect(&mut stream, &job.secret, &job.claim("agent", 0, 0)).unwrap();
    let (mut out, reader) = seal(&stream, keys).unwrap();
    send_encoded(&mut out, b"{\"type\":\"hello\",\"agent\":0,\"host\":\"127.0.0.1\",\"pid\":1}\n").unwrap();
    let answer: Value = Receiver::new(reader).recv().unwrap();
    assert_eq!(answer["type"], "exit", "{answer}");
    let reason = answer["reason"].as_str().unwrap();
    assert!(
        reason.contains("speaks control protocol an earlier one without a number")
            && reason.contains("every host of a job must run the same version of edl"),
        "{reason}"
    );
    let refused = || output(d).contains("it is refused").then_some(());
    poll_while_running(&mut launcher, "it says so", Duration::from_secs(60), refused, || output(d));
    let _ = launcher.kill();
    let _ = launcher.wait();
}
