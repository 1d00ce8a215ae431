//! A host's workers through one relay (`--relay`): the coordinator holds one
//! connection for all of them; training is the same to the bit; a worker
//! lost behind the relay is lost as before, and the relay lost is its
//! host's workers lost, recovered as such.

use crate::support::{
    KillOnDrop,
    hosts::Hosts,
    job::{
        Alone, assert_exactly_once, assert_noise_scale_measured, coordinator_note, final_state, finish, job,
        lines, report, run_to_end, scale_event,
    },
    process::{accepted_on, children, sigkill, sigkill_worker},
    python::py,
    root,
    wait::wait_for,
};
use edl_plugin_artifacts as art;
use std::{
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

/// A job of three workers whose policy never acts, for `epochs` epochs.
fn three_workers(dir: &Path, epochs: &str, extra: &[&str]) -> Command {
    let mut args = vec!["--policy", art::AUTOSCALE_WASM, "--decide-every", "100000", "--no-distill"];
    args.extend_from_slice(&["--workers", "3", "--min-workers", "1", "--max-workers", "3"]);
    args.extend_from_slice(&["--step-delay-ms", "5", "--epochs", epochs]);
    args.extend_from_slice(extra);
    job(dir, &args)
}

/// The control port the job's note names.
fn control_port(seen: &[String]) -> u16 {
    coordinator_note(seen).0.rsplit(':').next().unwrap().parse().unwrap()
}

#[test]
fn workers_through_a_relay_hold_one_connection_and_train_to_the_bit_as_without_it() {
    let direct = tempfile::tempdir().unwrap();
    let mut child = three_workers(direct.path(), "4", &[]).spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(120));
    let port = control_port(&seen);
    assert_eq!(accepted_on(port), 3, "one connection a worker without a relay");
    assert!(finish(child, rx, &mut seen).success(), "{}", seen.join("\n"));

    let relayed = tempfile::tempdir().unwrap();
    let mut child = three_workers(relayed.path(), "4", &["--relay"]).spawn().unwrap();
    let coordinator = child.id();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(120));
    let port = control_port(&seen);
    assert_eq!(accepted_on(port), 1, "the relay's connection alone");
    let procs = children(coordinator);
    let relay = procs.iter().find(|(_, c)| c.contains(" relay ")).unwrap_or_else(|| panic!("{procs:?}"));
    let workers: Vec<_> = procs.iter().filter(|(_, c)| c.contains(" worker ")).collect();
    assert_eq!(workers.len(), 3, "{procs:?}");
    for (_, w) in &workers {
        assert!(!w.contains(&format!(":{port} ")), "a worker sent to the relay, not the coordinator: {w}");
    }
    assert!(relay.1.contains(&format!(":{port} ")), "the relay reaches the coordinator: {}", relay.1);
    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert!(status.success(), "{text}");
    assert_exactly_once(&report(relayed.path()), 4, 1200);
    // The relay summed the ranks' noise-scale terms.
    assert_noise_scale_measured(&report(relayed.path()), Alone::Measured);
    let (a, b) = (final_state(direct.path()), final_state(relayed.path()));
    assert_eq!(a.len(), b.len());
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        assert!(x == y, "{name} differs from the run without a relay");
    }
    let log = std::fs::read_to_string(relayed.path().join(".edl/mnist/logs/relay-1.log")).unwrap();
    assert!(log.contains("relaying on 127.0.0.1:"), "{log}");
}

#[test]
fn a_worker_killed_behind_the_relay_is_lost_and_its_step_redone_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = three_workers(dir.path(), "6", &["--relay"]).spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     1 done", &mut seen, Duration::from_secs(120));
    sigkill_worker(child.id(), 2);
    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert!(status.success(), "{text}");
    let r = report(dir.path());
    assert_exactly_once(&r, 6, 1200);
    let lost = scale_event(&r, "worker 2 lost", &text);
    assert_eq!((lost["from"].as_u64(), lost["to"].as_u64()), (Some(3), Some(2)), "{lost}");
    assert!(text.contains("through the relay at"), "the loss names the relay: {text}");
    assert!(!dir.path().join(".edl/mnist/logs/relay-2.log").exists(), "the relay itself lived on");
}

#[test]
fn the_relay_killed_loses_its_host_s_workers_and_the_job_recovers_through_a_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let mut child =
        three_workers(dir.path(), "6", &["--relay", "--checkpoint-every-steps", "10"]).spawn().unwrap();
    let coordinator = child.id();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     1 done", &mut seen, Duration::from_secs(120));
    let procs = children(coordinator);
    let relay = procs.iter().find(|(_, c)| c.contains(" relay ")).unwrap_or_else(|| panic!("{procs:?}"));
    sigkill(relay.0);
    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    let first = std::fs::read_to_string(dir.path().join(".edl/mnist/logs/relay-1.log")).unwrap_or_default();
    assert!(status.success(), "{text}\nrelay 1's log:\n{first}");
    let r = report(dir.path());
    assert_exactly_once(&r, 6, 1200);
    assert!(
        text.contains("relay at") && text.contains("was lost"),
        "the workers' loss names their relay: {text}"
    );
    // Every worker went with it; those started after reached the job
    // through a second relay.
    let log = std::fs::read_to_string(dir.path().join(".edl/mnist/logs/relay-2.log")).unwrap();
    assert!(log.contains("relaying on"), "{log}");
    assert!(r["final_world_size"].as_u64().unwrap() >= 1, "{r}");
}

#[test]
fn a_relay_is_refused_where_it_cannot_run_beside_the_workers() {
    let dir = tempfile::tempdir().unwrap();
    let args = ["--relay", "--scaler", "external"];
    let out = job(dir.path(), &args).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--relay is for --scaler local"));
    // By command, a relay runs on each of the workers' hosts: they must be named.
    let args = ["--relay", "--scaler", "command", "--worker-command", "true"];
    let out = job(dir.path(), &args).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--relay with --scaler command needs --hosts"));
}

#[test]
fn a_launched_numpy_program_trains_through_a_relay_every_sample_once() {
    let py = py();
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_edl-runtime"));
    cmd.current_dir(dir.path())
        .args([
            "launch",
            "--relay",
            "--samples",
            "4000",
            "--no-distill",
            "--epochs",
            "2",
            "--report",
            "report.json",
        ])
        .args(["--workers", "3", "--min-workers", "3", "--max-workers", "3", "--policy", art::AUTOSCALE_WASM])
        .arg("--plugin-cache")
        .arg(dir.path().join("plugin-cache"))
        .args(["--", "python"])
        .arg(root().join("examples/numpy-mlp/train.py"))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    py.env(&mut cmd);
    let (status, text) = run_to_end(cmd);
    assert!(status.success(), "{text}");
    let r = report(dir.path());
    assert_exactly_once(&r, 2, 4000);
    assert_noise_scale_measured(&r, Alone::Unmeasured);
    let log = std::fs::read_to_string(dir.path().join(".edl/launch/logs/relay-1.log")).unwrap();
    assert!(log.contains("relaying on"), "{log}");
    let done = text.lines().filter(|l| l.starts_with("[worker ") && l.contains("test accuracy")).count();
    assert_eq!(done, 3, "every program ran to the end: {text}");
}

/// A launched Python program told of a relay (`EDL_RELAY`, as a Kubernetes
/// job tells its worker Pods of the relay Service) reaches its job through
/// it: the workers' command waits for the relay the test starts, and the
/// coordinator then holds the relay's connection alone.
#[test]
fn a_launched_python_program_told_of_a_relay_reaches_its_job_through_it() {
    let py = py();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let relay_at = d.join("relay-at");
    let template = format!(
        "until [ -s {at} ]; do sleep 0.05; done; exec env EDL_RELAY=\"$(cat {at})\" {{program}}",
        at = relay_at.display()
    );
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_edl-runtime"));
    cmd.current_dir(d)
        .args(["launch", "--samples", "4000", "--no-distill", "--epochs", "2", "--report", "report.json"])
        .args(["--workers", "2", "--min-workers", "2", "--max-workers", "2", "--policy", art::AUTOSCALE_WASM])
        .args(["--scaler", "command", "--worker-command", &template, "--hosts", "h:2"])
        .arg("--plugin-cache")
        .arg(d.join("plugin-cache"))
        .args(["--", "python"])
        .arg(root().join("examples/numpy-mlp/train.py"))
        .env("STEP_DELAY_MS", "5")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    py.env(&mut cmd);
    let mut child = cmd.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, "coordinator at ", &mut seen, Duration::from_secs(120));
    let (addr, _) = coordinator_note(&seen);
    let port: u16 = addr.rsplit(':').next().unwrap().parse().unwrap();
    let mut relay = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_edl-runtime"))
            .args([
                "relay",
                "--coordinator",
                &addr,
                "--job",
                "launch",
                "--lease-ms",
                "10000",
                "--secret-file",
            ])
            .arg(d.join(".edl/launch/secret"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let said = std::io::BufRead::lines(std::io::BufReader::new(relay.0.stdout.take().unwrap())).next();
    let said = said.unwrap().unwrap();
    let at = said.split("relaying on ").nth(1).and_then(|r| r.split_whitespace().next()).unwrap().to_string();
    std::fs::write(&relay_at, &at).unwrap();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(180));
    assert_eq!(accepted_on(port), 1, "the relay's connection alone: {}", seen.join("\n"));
    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert!(status.success(), "{text}");
    assert_exactly_once(&report(d), 2, 4000);
    let logs = d.join(".edl/launch/logs");
    for n in 1..=2 {
        let log = std::fs::read_to_string(logs.join(format!("worker-{n}.log"))).unwrap_or_default();
        assert!(log.contains("test accuracy"), "worker {n} ran to the end: {log}");
    }
}

/// Two hosts' relays, started by a worker command that lets neither serve
/// until both have started (each waits for the other's mark): started one
/// after the other, the first would wait for a second that never comes.
/// Both start together, each once, and the job runs through them.
#[test]
fn the_relays_of_every_host_start_together() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let marks = d.join("marks");
    std::fs::create_dir(&marks).unwrap();
    let m = marks.display();
    let template = format!(
        "touch {m}/{{host}}; until [ -e {m}/a ] && [ -e {m}/b ]; do sleep 0.05; done; exec {{program}}"
    );
    let mut args = vec!["--policy", art::AUTOSCALE_WASM, "--decide-every", "100000", "--no-distill"];
    args.extend_from_slice(&["--workers", "2", "--min-workers", "2", "--max-workers", "2", "--epochs", "2"]);
    args.extend_from_slice(&["--relay", "--scaler", "command", "--worker-command", &template]);
    args.extend_from_slice(&["--hosts", "a:1,b:1"]);
    let (status, text) = run_to_end(job(d, &args));
    assert!(status.success(), "{text}");
    assert_exactly_once(&report(d), 2, 1200);
    let logs = d.join(".edl/mnist/logs");
    for n in 1..=2 {
        let log = std::fs::read_to_string(logs.join(format!("relay-{n}.log"))).unwrap_or_default();
        assert!(log.contains("relaying on 127.0.0.1:"), "relay {n} serves: {log}\n{text}");
    }
    assert!(!logs.join("relay-3.log").exists(), "no relay started again: {text}");
}

/// A host whose relay never comes up (its command hangs) holds up no other
/// host's worker: the job's one worker, on the other host, trains through
/// its own relay and the job ends, never having waited for the hung one.
#[test]
fn a_host_whose_relay_hangs_holds_up_no_other_host_s_workers() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let template = "if [ {host} = b ]; then exec sleep 600; fi; exec {program}";
    let mut args = vec!["--policy", art::AUTOSCALE_WASM, "--decide-every", "100000", "--no-distill"];
    args.extend_from_slice(&["--workers", "1", "--min-workers", "1", "--max-workers", "1", "--epochs", "2"]);
    args.extend_from_slice(&["--relay", "--scaler", "command", "--worker-command", template]);
    args.extend_from_slice(&["--hosts", "a:1,b:1"]);
    let (status, text) = run_to_end(job(d, &args));
    assert!(status.success(), "{text}");
    assert_exactly_once(&report(d), 2, 1200);
    let logs = d.join(".edl/mnist/logs");
    let a = std::fs::read_to_string(logs.join("relay-1.log")).unwrap_or_default();
    assert!(a.contains("relaying on 127.0.0.1:"), "a's relay serves: {a}\n{text}");
    assert!(logs.join("relay-2.log").exists(), "b's relay was started with a's: {text}");
    assert!(!text.contains("did not say where it serves"), "nobody waited for b's relay: {text}");
}

/// The command lines of host `name`'s processes.
#[test]
fn workers_started_by_command_on_two_hosts_reach_the_job_through_a_relay_on_each() {
    let Some(hosts) = Hosts::build_or_skip(&["coord", "w1", "w2"]) else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let coord = hosts.ip("coord");
    let template = format!("ip netns exec {}-{{host}} {{program}}", hosts.prefix);
    let mut args = vec!["--policy", art::AUTOSCALE_WASM, "--decide-every", "100000", "--no-distill"];
    args.extend_from_slice(&["--workers", "4", "--min-workers", "4", "--max-workers", "4"]);
    args.extend_from_slice(&[
        "--step-delay-ms",
        "5",
        "--epochs",
        "6",
        "--relay",
        "--checkpoint-every-steps",
        "10",
        // A minute: survivors that waited for it would show.
        "--collective-timeout-ms",
        "60000",
    ]);
    let cmd = job(d, &args);
    let mut coordinator = hosts.on("coord", cmd.get_program().to_str().unwrap());
    coordinator.args(cmd.get_args()).current_dir(d);
    coordinator.args(["--scaler", "command", "--worker-command", &template, "--hosts", "w1:2,w2:2"]);
    coordinator.args(["--listen", &format!("{coord}:7070")]);
    coordinator.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = coordinator.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(180));

    // Two connections reach the coordinator: a relay's from each host.
    let ss =
        hosts.on("coord", "ss").args(["-tnH", "state", "established", "( sport = :7070 )"]).output().unwrap();
    let text = String::from_utf8_lossy(&ss.stdout).into_owned();
    let peers: Vec<&str> = text.lines().filter_map(|l| l.split_whitespace().last()).collect();
    assert_eq!(peers.len(), 2, "one connection a host: {text}");
    for host in ["w1", "w2"] {
        assert!(peers.iter().any(|p| p.starts_with(&format!("{}:", hosts.ip(host)))), "{host}: {text}");
        let procs = hosts.command_lines(host);
        let relays: Vec<_> = procs.iter().filter(|(_, c)| c.contains(" relay ")).collect();
        assert_eq!(relays.len(), 1, "one relay on {host}: {procs:?}");
        assert!(relays[0].1.contains(&format!("--coordinator {coord}:7070")), "{relays:?}");
        let workers: Vec<_> = procs.iter().filter(|(_, c)| c.contains(" worker ")).collect();
        assert_eq!(workers.len(), 2, "{host}: {procs:?}");
        for (_, w) in workers {
            assert!(w.contains("--coordinator 127.0.0.1:"), "a worker of {host} goes to its relay: {w}");
        }
    }

    // The secret reaches relays and workers on their input, never a command line.
    let secret = std::fs::read_to_string(d.join(".edl/mnist/secret")).unwrap();
    let secret = secret.trim();
    assert!(secret.len() >= 32, "{secret:?}");
    for host in ["coord", "w1", "w2"] {
        for (pid, line) in hosts.command_lines(host) {
            assert!(!line.contains(secret), "the secret on the command line of {pid} on {host}");
        }
    }

    // w1's relay killed: w1's workers are lost with it, and those started
    // in their place reach the job through a new relay there.
    let relay = hosts.command_lines("w1").into_iter().find(|(_, c)| c.contains(" relay ")).unwrap();
    sigkill(u32::try_from(relay.0).expect("a process id"));
    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert!(status.success(), "{text}");
    let r = report(d);
    assert_exactly_once(&r, 6, 1200);
    assert!(text.contains("relay at") && text.contains("was lost"), "the loss names the relay: {text}");
    // w1's workers were stopped as they were lost (alive, their relay
    // gone), so w2's ended their collectives then, not at the timeout.
    let failed = seen.iter().find(|l| l.contains("relay at") && l.contains("was lost: ")).unwrap();
    assert!(!failed.contains("timed out"), "{failed}");
    let logs = d.join(".edl/mnist/logs");
    let relay_logs: Vec<String> = (1..=3)
        .map(|n| std::fs::read_to_string(logs.join(format!("relay-{n}.log"))).unwrap_or_default())
        .collect();
    assert!(relay_logs.iter().all(|l| l.contains("relaying on 127.0.0.1:")), "three relays: {relay_logs:?}");
    assert_eq!(r["final_world_size"].as_u64(), Some(4), "{r}");
}
