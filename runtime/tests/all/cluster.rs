//! Jobs whose workers are not the coordinator's children: started by a
//! command per worker, or by another engine that only knows the
//! coordinator's address and the job's secret. On loopback, and across
//! hosts built from Linux network namespaces (veth pairs to a bridge, private
//! addresses that exist only inside the namespaces).

use crate::support::{
    hosts::Hosts,
    job::{assert_exactly_once, finish, job, lines, report},
    process::accepted_on,
    servers::{EtcdCluster, RedisServer},
    wait::{wait_exit, wait_for},
};
use edl_plugin_artifacts as art;
use serde_json::Value;
use std::{
    path::Path,
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::Duration,
};

const EXE: &str = env!("CARGO_BIN_EXE_edl-runtime");

/// The `host:port` the coordinator says workers join at.
fn coordinator_addr(rx: &mpsc::Receiver<String>, seen: &mut Vec<String>) -> String {
    wait_for(rx, "workers join with", seen, Duration::from_secs(120));
    addr_in(seen)
}

fn addr_in(seen: &[String]) -> String {
    let line = seen.last().unwrap();
    line.split("--coordinator ").nth(1).unwrap().trim_end_matches('`').to_string()
}

/// `edl-runtime worker` as another engine would start it (in `dir`, logging to `log`).
fn worker(prefix: &[&str], coordinator: &str, secret: Option<&Path>, log: &Path) -> Command {
    let mut c = Command::new(prefix.first().copied().unwrap_or(EXE));
    if !prefix.is_empty() {
        c.args(&prefix[1..]).arg(EXE);
    }
    c.args(["worker", "--coordinator", coordinator]);
    if let Some(s) = secret {
        c.arg("--secret-file").arg(s);
    }
    let log = std::fs::File::create(log).unwrap();
    c.stdin(Stdio::null()).stdout(log.try_clone().unwrap()).stderr(log);
    c
}

#[test]
fn workers_started_elsewhere_join_with_the_secret_and_only_within_the_maximum() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let secret = d.join("job.secret");
    let mut cmd = job(d, &["--scaler", "external", "--no-distill", "--teachers", "0"]);
    cmd.args(["--policy", art::HOSTILE_POLICY_WASM, "--policy-config", "mode=hold"]);
    // The reader transform exists only where the coordinator starts: the
    // workers get its bytes from the coordinator.
    let plugins = d.join("coordinator-only");
    std::fs::create_dir(&plugins).unwrap();
    std::fs::copy(art::AUGMENT_WASM, plugins.join("augment.wasm")).unwrap();
    cmd.arg("--transform").arg(plugins.join("augment.wasm"));
    // Where the transform runs is checked here, not its speed.
    cmd.args(["--plugin-deadline-ms", "30000"]);
    cmd.args(["--max-workers", "2", "--epochs", "3", "--step-delay-ms", "40", "--secret-file"]).arg(&secret);
    let mut child = cmd.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    let addr = coordinator_addr(&rx, &mut seen);
    std::fs::remove_dir_all(&plugins).unwrap();

    // The first worker, asked for at the start, comes from elsewhere with the
    // secret file; it gets an id from the coordinator.
    let mut first = worker(&[], &addr, Some(&secret), &d.join("w1.log")).spawn().unwrap();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(120));
    // A second one, uninvited, with the secret in its environment: admitted.
    let mut second = worker(&[], &addr, None, &d.join("w2.log"));
    second.env("EDL_JOB", "mnist").env("EDL_JOB_SECRET", std::fs::read_to_string(&secret).unwrap().trim());
    let mut second = second.spawn().unwrap();
    wait_for(&rx, "1 -> 2 workers", &mut seen, Duration::from_secs(120));
    // A third is past the maximum: sent away, and it exits without an error.
    let mut third = worker(&[], &addr, Some(&secret), &d.join("w3.log")).spawn().unwrap();
    let status = wait_exit(&mut third, "the worker past the maximum", Duration::from_secs(120), String::new);
    assert!(status.success(), "{status}: {}", std::fs::read_to_string(d.join("w3.log")).unwrap());
    // One that does not know the secret is refused, saying so.
    let wrong = d.join("wrong.secret");
    std::fs::write(&wrong, "ab".repeat(32)).unwrap();
    let mut stranger = worker(&[], &addr, Some(&wrong), &d.join("w4.log")).spawn().unwrap();
    let status = wait_exit(&mut stranger, "the stranger", Duration::from_secs(60), String::new);
    let said = std::fs::read_to_string(d.join("w4.log")).unwrap();
    assert!(!status.success() && said.contains("the peer does not know the job's secret"), "{said}");
    // Written with this process's umask (0644): named as readable by others.
    assert!(said.contains("readable by others on this host (mode 644)"), "{said}");
    let first_log = std::fs::read_to_string(d.join("w1.log")).unwrap();
    assert!(!first_log.contains("readable by others"), "the job's own secret file is 0600: {first_log}");

    let status = finish(child, rx, &mut seen);
    assert!(status.success(), "{}", seen.join("\n"));
    let r = report(d);
    assert_exactly_once(&r, 3, 1200);
    let joined = seen.iter().filter(|l| l.contains("joined uninvited")).count();
    assert!(joined >= 1, "{}", seen.join("\n"));
    assert_eq!(r["final_world_size"], 2, "{r}");
    for (w, name) in [(&mut first, "the first worker"), (&mut second, "the second worker")] {
        let status = wait_exit(w, name, Duration::from_secs(60), String::new);
        assert!(status.success(), "{name}: {status}");
    }
}

/// A worker of an earlier edl (its hello carries no protocol number) is
/// told why it is refused and let go, before it is given anything it
/// cannot read; the job waits for workers that speak its protocol.
#[test]
fn a_worker_of_another_version_of_edl_is_refused_naming_both() {
    use edl_host_gpu::comm::auth::{self, JobAuth};
    use edl_runtime::control::proto::{Receiver, ToWorker, seal, send_encoded};
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let secret = d.join("job.secret");
    let mut cmd = job(d, &["--scaler", "external", "--no-distill", "--teachers", "0", "--secret-file"]);
    cmd.arg(&secret);
    let mut child = cmd.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    let addr = coordinator_addr(&rx, &mut seen);
    let job_auth = JobAuth {
        job: "mnist".into(),
        secret: edl_runtime::worker::session::read_secret_file(&secret).unwrap(),
    };
    let mut stream = std::net::TcpStream::connect(&addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let keys = auth::connect(&mut stream, &job_auth.secret, &job_auth.claim("control", 0, 0)).unwrap();
    let (mut out, reader) = seal(&stream, keys).unwrap();
    // An earlier edl's hello: no protocol number.
    send_encoded(&mut out, b"{\"hello\":{\"worker\":0,\"pid\":1}}\n").unwrap();
    let answer = Receiver::new(reader).recv::<ToWorker>();
    let Ok(ToWorker::Stop { reason }) = answer else { panic!("{answer:?}") };
    assert!(
        reason.contains("speaks control protocol an earlier one without a number")
            && reason.contains("every host of a job must run the same version of edl"),
        "{reason}"
    );
    wait_for(&rx, "it is refused", &mut seen, Duration::from_secs(60));
    let _ = child.kill();
    let _ = child.wait();
}

/// Workers started elsewhere and told of a relay (`EDL_RELAY`, as a
/// Kubernetes job tells its Pods of the relay Service) reach the job
/// through it: the coordinator holds the relay's connection alone.
#[test]
fn workers_told_of_a_relay_reach_their_job_through_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let secret = d.join("job.secret");
    let mut cmd = job(d, &["--scaler", "external", "--no-distill", "--teachers", "0"]);
    cmd.args(["--policy", art::HOSTILE_POLICY_WASM, "--policy-config", "mode=hold"]);
    cmd.args([
        "--workers",
        "2",
        "--max-workers",
        "2",
        "--epochs",
        "4",
        "--step-delay-ms",
        "20",
        "--secret-file",
    ]);
    cmd.arg(&secret);
    let mut child = cmd.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    let addr = coordinator_addr(&rx, &mut seen);
    let port: u16 = addr.rsplit(':').next().unwrap().parse().unwrap();
    let mut relay = Command::new(EXE)
        .args(["relay", "--coordinator", &addr, "--job", "mnist", "--lease-ms", "10000", "--secret-file"])
        .arg(&secret)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(d.join("relay.log")).unwrap())
        .spawn()
        .unwrap();
    let said = std::io::BufRead::lines(std::io::BufReader::new(relay.stdout.take().unwrap())).next();
    let said = said.unwrap().unwrap();
    let at = said.split("relaying on ").nth(1).and_then(|r| r.split_whitespace().next()).unwrap().to_string();
    let mut workers: Vec<Child> = (1..=2)
        .map(|n| {
            let mut w = worker(&[], &addr, Some(&secret), &d.join(format!("w{n}.log")));
            w.env("EDL_RELAY", &at).spawn().unwrap()
        })
        .collect();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(120));
    assert_eq!(accepted_on(port), 1, "the relay's connection alone: {}", seen.join("\n"));
    let status = finish(child, rx, &mut seen);
    assert!(status.success(), "{}", seen.join("\n"));
    assert_exactly_once(&report(d), 4, 1200);
    for (n, w) in workers.iter_mut().enumerate() {
        let status = wait_exit(w, "a worker", Duration::from_secs(60), String::new);
        assert!(status.success(), "worker {n}: {status}");
    }
    let _ = relay.kill();
    let _ = relay.wait();
    // Each worker's try of the relay, closed before a word, is no refusal.
    let log = std::fs::read_to_string(d.join("relay.log")).unwrap();
    assert!(!log.contains("refused"), "{log}");
}

#[test]
fn a_first_generation_whose_ring_cannot_form_leaves_the_state_at_the_start_for_the_next() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let secret = d.join("job.secret");
    let mut cmd = job(d, &["--scaler", "external", "--no-distill", "--teachers", "0"]);
    cmd.args(["--policy", art::HOSTILE_POLICY_WASM, "--policy-config", "mode=hold"]);
    cmd.args(["--min-workers", "2", "--max-workers", "2", "--epochs", "2", "--secret-file"]).arg(&secret);
    let mut child = cmd.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    let addr = coordinator_addr(&rx, &mut seen);
    let good = worker(&[], &addr, Some(&secret), &d.join("w1.log")).spawn().unwrap();
    // Its ring listens on 127.0.0.1 and it tells its peers 127.0.0.2:
    // nothing answers there, and the first generation's ring fails.
    let mut bad = worker(&[], &addr, Some(&secret), &d.join("w2.log"));
    let mut bad = bad.args(["--listen", "127.0.0.1", "--advertise", "127.0.0.2"]).spawn().unwrap();
    wait_for(&rx, "step 0 not committed (generation 1", &mut seen, Duration::from_secs(120));
    let _ = (bad.kill(), bad.wait());
    // The next generation, with one that can be reached, starts from step 0.
    let other = worker(&[], &addr, Some(&secret), &d.join("w3.log")).spawn().unwrap();
    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert!(status.success(), "{text}");
    assert!(!text.contains("cannot serve committed step"), "{text}");
    assert_exactly_once(&report(d), 2, 1200);
    for mut w in [good, other] {
        let _ = (w.kill(), w.wait());
    }
}

#[test]
fn a_job_across_hosts_survives_a_dead_host_and_a_cut_off_one_and_refuses_it_after() {
    let names = ["coord", "w1", "w2", "w3", "teacher"];
    let Some(hosts) = Hosts::build_or_skip(&names) else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let coord = hosts.ip("coord");

    // The store on the coordinator's host; a teacher on a host of its own,
    // registered there under the job's service.
    let mut redis = hosts.redis("coord", d);
    let store = format!("redis://{coord}:6379/");
    let model = d.join("teacher.safetensors");
    edl_runtime::trainer::model::Mlp::random(&[784, 32, 10], 7).save(&model).unwrap();
    // The job's secret, made beforehand; the teacher gets the registration
    // key derived from it (not the secret).
    let secret = d.join("job.secret");
    let made = edl_runtime::worker::session::Secret::generate().unwrap();
    made.write(&secret).unwrap();
    let key_file = d.join("teacher-registration.key");
    let key = edl_runtime::leader::seal::RecordKey::teacher_registrations(&made);
    std::fs::write(&key_file, key.to_hex()).unwrap();
    let mut teacher = hosts.on("teacher", EXE);
    teacher.args(["teacher", "--listen", &format!("{}:8001", hosts.ip("teacher")), "--store", &store]);
    teacher.args(["--service", "fleet", "--registration-key-file"]).arg(&key_file).arg("--model").arg(&model);
    let teacher_log = std::fs::File::create(d.join("teacher.log")).unwrap();
    let mut teacher = teacher.stdout(teacher_log.try_clone().unwrap()).stderr(teacher_log).spawn().unwrap();

    // The coordinator starts workers on w1 and w2 by command; w3 comes on its own.
    let template = format!("ip netns exec {}-{{host}} {{program}}", hosts.prefix);
    let cmd = job(d, &["--teachers", "0", "--service", "fleet", "--store", &store]);
    let on_coord = cmd.get_program().to_owned();
    let mut coordinator = hosts.on("coord", on_coord.to_str().unwrap());
    coordinator.args(cmd.get_args()).current_dir(d);
    coordinator.args(["--policy", art::HOSTILE_POLICY_WASM, "--policy-config", "mode=hold"]);
    coordinator.args(["--scaler", "command", "--worker-command", &template, "--hosts", "w1:2,w2:2"]);
    coordinator.args(["--listen", &format!("{coord}:7070"), "--min-workers", "2", "--max-workers", "3"]);
    coordinator.args(["--epochs", "30", "--step-delay-ms", "60", "--worker-lease-secs", "3"]);
    // A worker that lost the coordinator keeps trying to reach it for as
    // long as this test may keep it cut off.
    coordinator.args(["--worker-reconnect-secs", "600"]);
    // The lease (3 s) runs out well before a ring operation gives up (8 s):
    // the coordinator, not a neighbour's timeout, finds the cut-off worker.
    coordinator.args(["--collective-timeout-ms", "8000", "--secret-file"]).arg(&secret);
    let errors = d.join("coordinator.err");
    let stderr = std::fs::File::create(&errors).unwrap();
    coordinator.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(stderr);
    let mut child = coordinator.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    // What the coordinator said, when a step of the test does not come.
    let expect = |needle: &str, seen: &mut Vec<String>, secs: u64| {
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            wait_for(&rx, needle, seen, Duration::from_secs(secs))
        }));
        if caught.is_err() {
            panic!("stderr of the coordinator: {}", std::fs::read_to_string(&errors).unwrap_or_default());
        }
    };
    expect("workers join with", &mut seen, 120);
    let addr = addr_in(&seen);
    assert_eq!(addr, format!("{coord}:7070"));
    expect("epoch     0 done", &mut seen, 180);

    // (0) A worker started on w3 by another engine joins: 2 -> 3.
    let mut w3 = hosts.on("w3", EXE);
    w3.args(["worker", "--coordinator", &addr, "--secret-file"]).arg(&secret);
    let w3_log = std::fs::File::create(d.join("w3.log")).unwrap();
    let mut w3 = w3.stdin(Stdio::null()).stdout(w3_log.try_clone().unwrap()).stderr(w3_log).spawn().unwrap();
    expect("2 -> 3 workers", &mut seen, 120);

    // (a) Every process of host w1 dies: the job goes on with w2 and w3.
    assert!(hosts.kill_all("w1") >= 1, "a worker ran on w1");
    expect("3 -> 2 workers", &mut seen, 120);

    // (b) w3 is cut off: declared dead within its lease, the job goes on,
    // refilled to its minimum by a worker started on w1 or w2.
    hosts.link("w3", false);
    expect("2 -> 1 workers", &mut seen, 120);
    expect("1 -> 2 workers", &mut seen, 120);
    hosts.link("w3", true);
    // The cut-off worker does not come back into the job: when its link is
    // back it reaches the coordinator, which refuses it by its generation,
    // and it exits saying so.
    let status = wait_exit(&mut w3, "the cut-off worker", Duration::from_secs(120), String::new);
    let said = std::fs::read_to_string(d.join("w3.log")).unwrap();
    assert!(!status.success(), "{status}: {said}");
    assert!(said.contains("lost the coordinator"), "{said}");
    assert!(said.contains("on its return the coordinator refused it: generation "), "{said}");
    assert!(said.contains(" is over (the job is at "), "{said}");
    let refused = std::fs::read_to_string(&errors).unwrap();
    assert!(
        refused.contains("refused a control connection from") && refused.contains(" is over"),
        "{refused}"
    );

    let status = finish(child, rx, &mut seen);
    let _ = (teacher.kill(), redis.kill(), teacher.wait(), redis.wait());
    assert!(status.success(), "{}", seen.join("\n"));
    let r = report(d);
    assert_exactly_once(&r, 30, 1200);
    let reasons: Vec<&str> =
        r["scale_events"].as_array().unwrap().iter().filter_map(|e| e["reason"].as_str()).collect();
    assert_eq!(reasons.iter().filter(|r| r.ends_with(" lost")).count(), 2, "{reasons:?}");
    // Why each was lost, as the operator was told.
    let notes = seen.iter().filter(|l| l.starts_with("note")).cloned().collect::<Vec<_>>().join("\n");
    assert!(notes.contains("no heartbeat for"), "the cut-off worker's lease ran out:\n{notes}");
    assert!(notes.contains("connection closed") || notes.contains("reset by peer"), "{notes}");
}

/// The command lines of every process on this machine, but this one.
fn command_lines() -> Vec<(u32, String)> {
    let me = std::process::id();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        if pid == me {
            continue;
        }
        if let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) {
            out.push((pid, String::from_utf8_lossy(&cmd).replace('\0', " ")));
        }
    }
    out
}

#[test]
fn the_job_s_secret_and_the_store_s_password_are_on_no_command_line_and_in_no_output() {
    let password = "pw-4d1b9c";
    let redis = RedisServer::start_with(Some(password));
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut cmd = job(d, &["--epochs", "2", "--step-delay-ms", "20", "--plot", "run.svg", "--job", "quiet"]);
    cmd.args(["--policy", art::SCHEDULE_WASM, "--policy-config", "every=4", "--max-workers", "2"]);
    cmd.env("EDL_STORE", redis.url());
    let mut child = cmd.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(180));
    let secret = std::fs::read_to_string(d.join(".edl/quiet/secret")).unwrap();
    let secret = secret.trim();
    assert_eq!(secret.len(), 64);
    // Teachers, workers, the coordinator: none carries either on its command line.
    let lines_now = command_lines();
    assert!(lines_now.iter().any(|(_, c)| c.contains("edl-runtime teacher")), "a teacher runs");
    assert!(lines_now.iter().any(|(_, c)| c.contains("edl-runtime worker")), "a worker runs");
    for (pid, c) in &lines_now {
        assert!(!c.contains(password) && !c.contains(secret), "process {pid}: {c}");
    }
    let status = finish(child, rx, &mut seen);
    assert!(status.success(), "{}", seen.join("\n"));
    // Nor in what the job printed, its report, its plot or its logs.
    let mut files = vec![d.join("report.json"), d.join("run.svg")];
    files.extend(std::fs::read_dir(d.join(".edl/quiet/logs")).unwrap().flatten().map(|e| e.path()));
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        assert!(!text.contains(password) && !text.contains(secret), "{}", f.display());
    }
    let out = seen.join("\n");
    assert!(!out.contains(password) && !out.contains(secret), "{out}");
    assert!(out.contains("redis://:***@127.0.0.1"), "the store is shown, redacted: {out}");
}

#[test]
fn a_coordinator_firewalled_from_its_store_stops_and_another_host_takes_the_job_over() {
    let nft = ["/usr/sbin/nft", "/sbin/nft"].into_iter().find(|p| Path::new(p).exists());
    let Some(nft) = nft else {
        assert!(std::env::var("CI").is_err(), "nft is missing (.ci/run installs nftables)");
        eprintln!("skipped: nft is missing (apt-get install nftables)");
        return;
    };
    let Some(hosts) = Hosts::build_or_skip(&["store", "a", "b"]) else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let store_ip = hosts.ip("store");
    let mut redis = hosts.redis("store", d);
    let url = format!("redis://{store_ip}:6379/");
    // The checkpoints are shared (as object storage or a network file
    // system would be); each host has its own working directory.
    let checkpoints = d.join("checkpoints");
    let coordinator_on = |host: &str, cwd: &Path| {
        std::fs::create_dir_all(cwd).unwrap();
        let args = ["--no-distill", "--teachers", "0", "--store", &url, "--job", "walled", "--epochs", "8"];
        let cmd = job(cwd, &args);
        let mut c = hosts.on(host, cmd.get_program().to_str().unwrap());
        c.args(cmd.get_args()).current_dir(cwd);
        c.args(["--checkpoint-every-steps", "5", "--step-delay-ms", "40", "--checkpoint-dir"])
            .arg(&checkpoints);
        c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        c
    };

    let (da, db) = (d.join("a"), d.join("b"));
    let mut first = coordinator_on("a", &da).spawn().unwrap();
    let rx = lines(&mut first);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(120));
    // A firewall rule on host a drops everything it sends to the store.
    let ns = hosts.ns("a");
    for rule in [
        "add table inet wall".to_string(),
        "add chain inet wall out { type filter hook output priority 0 ; }".to_string(),
        format!("add rule inet wall out ip daddr {store_ip} tcp dport 6379 drop"),
    ] {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &ns, nft]).args(rule.split(' '));
        assert!(c.status().unwrap().success(), "nft {rule}");
    }
    // It cannot renew its lease: it stops by its own clock, saying why.
    let status = finish(first, rx, &mut seen);
    let text = seen.join("\n");
    assert!(!status.success(), "{text}");
    let error = report(&da)["error"].as_str().unwrap_or_default().to_string();
    assert!(error.contains("fenced: the job's lease could not be renewed"), "{error}\n{text}");

    // Host b takes the job over once the lease has lapsed in the store (a
    // start before that is refused, naming the holder).
    let mut attempts = 0;
    let (status, text) = loop {
        attempts += 1;
        let mut second = coordinator_on("b", &db).spawn().unwrap();
        let rx = lines(&mut second);
        let mut seen = Vec::new();
        let status = finish(second, rx, &mut seen);
        let text = seen.join("\n");
        if !status.success() && text.contains("already run by another coordinator") && attempts < 60 {
            std::thread::sleep(Duration::from_secs(1));
            continue;
        }
        break (status, text);
    };
    let _ = (redis.kill(), redis.wait());
    assert!(status.success(), "{text}");
    assert!(text.contains("resuming job \"walled\""), "{text}");
    assert!(!text.contains("skipping an unusable checkpoint"), "{text}");
    let r = report(&db);
    assert!(r["resumed_from_step"].as_u64().is_some_and(|s| s >= 5), "{r}");
    assert_exactly_once(&r, 8, 1200);
    // The checkpoints are consistent: every one verifies, and the newest
    // is the second coordinator's final state.
    let cps = edl_runtime::checkpoint::Checkpoints::new(&checkpoints, 3);
    let (newest, skipped) = cps.latest().unwrap();
    assert!(skipped.is_empty(), "{skipped:?}");
    assert_eq!(newest.unwrap().manifest.step, r["steps"].as_u64().unwrap());
    let fence = cps.fence().unwrap().expect("the second coordinator claimed the checkpoints");
    assert!(fence.from_step >= 5, "{fence:?}");
}

/// A job across hosts that can be taken over: workers started by command
/// on w1 and w2, the active coordinator on host a, a standby on host b,
/// the store at `store`, the checkpoints shared.
struct Takeover<'h> {
    hosts: &'h Hosts,
    dir: std::path::PathBuf,
    store: String,
    /// The job's epochs (about 0.9 s each).
    epochs: u32,
}

/// What a takeover left: the standby's report and what it said, the worker
/// processes before and after, and the first coordinator.
struct TakenOver {
    report: Value,
    said: String,
    before: Vec<i32>,
    after: Vec<i32>,
    first: Child,
    first_said: mpsc::Receiver<String>,
}

impl Takeover<'_> {
    fn coordinator(&self, host: &str, extra: &[&str]) -> Command {
        let cwd = self.dir.join(host);
        std::fs::create_dir_all(&cwd).unwrap();
        let template = format!("ip netns exec {}-{{host}} {{program}}", self.hosts.prefix);
        let epochs = self.epochs.to_string();
        let args =
            ["--no-distill", "--teachers", "0", "--store", &self.store, "--job", "led", "--epochs", &epochs];
        let cmd = job(&cwd, &args);
        let mut c = self.hosts.on(host, cmd.get_program().to_str().unwrap());
        c.args(cmd.get_args()).current_dir(&cwd);
        c.args(["--policy", art::HOSTILE_POLICY_WASM, "--policy-config", "mode=hold"]);
        c.args(["--scaler", "command", "--worker-command", &template, "--hosts", "w1:1,w2:1"]);
        c.args(["--listen", &format!("{}:7070", self.hosts.ip(host)), "--workers", "2"]);
        c.args(["--min-workers", "2", "--max-workers", "2", "--step-delay-ms", "40"]);
        c.args(["--checkpoint-every-steps", "20", "--checkpoint-dir"]).arg(self.dir.join("checkpoints"));
        c.arg("--secret-file").arg(self.dir.join("job.secret"));
        c.args(extra);
        c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        c
    }

    /// The worker processes on w1 and w2 (their shells and programs).
    fn workers(&self) -> Vec<i32> {
        let mut p = [self.hosts.pids("w1"), self.hosts.pids("w2")].concat();
        p.sort();
        p
    }

    /// Runs the active coordinator on a and a standby on b; `strike` does
    /// to the active one what the test is about, `then` runs once the
    /// workers came back to the standby, which then finishes the job.
    fn run(&self, strike: impl FnOnce(&mut Child), then: impl FnOnce()) -> TakenOver {
        let mut first = self.coordinator("a", &[]).spawn().unwrap();
        let first_said = lines(&mut first);
        let mut seen_a = Vec::new();
        wait_for(&first_said, "epoch     1 done", &mut seen_a, Duration::from_secs(180));
        let mut standby = self.coordinator("b", &["--standby"]).spawn().unwrap();
        let rx = lines(&mut standby);
        let mut seen = Vec::new();
        wait_for(&rx, "standby", &mut seen, Duration::from_secs(120));
        assert!(seen.last().unwrap().contains("waiting to take it over"), "{seen:?}");
        let before = self.workers();
        assert!(before.len() >= 2, "workers run on w1 and w2: {before:?}");
        strike(&mut first);
        wait_for(&rx, "taking job \"led\" over", &mut seen, Duration::from_secs(120));
        // The policy counts its decisions on from the active one's count.
        wait_for(&rx, "the policy went on with its memory of step", &mut seen, Duration::from_secs(60));
        wait_for(&rx, "came back with its state", &mut seen, Duration::from_secs(60));
        then();
        wait_for(&rx, "epoch     ", &mut seen, Duration::from_secs(120));
        let after = self.workers();
        let status = finish(standby, rx, &mut seen);
        let said = seen.join("\n");
        assert!(status.success(), "{said}");
        TakenOver { report: report(&self.dir.join("b")), said, before, after, first, first_said }
    }
}

/// The report's scale events that are takeovers.
fn takeovers(r: &Value) -> Vec<String> {
    let events = r["scale_events"].as_array().unwrap();
    let reasons = events.iter().filter_map(|e| e["reason"].as_str());
    reasons.filter(|r| r.starts_with("coordinator takeover")).map(String::from).collect()
}

#[test]
fn workers_follow_a_standby_that_takes_over_from_a_killed_coordinator_on_etcd_that_loses_its_leader() {
    let Some(hosts) = Hosts::build_or_skip(&["etcd", "a", "b", "w1", "w2"]) else { return };
    let mut etcd = EtcdCluster::start_on(&hosts, "etcd", 3);
    let dir = tempfile::tempdir().unwrap();
    // Long enough that the standby sees the store's new leader well before
    // the job ends (the election takes a few seconds, renewals fail
    // meanwhile, and the job goes on).
    let t = Takeover { hosts: &hosts, dir: dir.path().to_path_buf(), store: etcd.url(), epochs: 24 };
    let mut lost_leader = None;
    let mut out = t.run(
        // The active coordinator dies at once.
        |a| a.kill().unwrap(),
        // Then the store's leader member dies: the others elect another.
        || {
            let leader = etcd.leader().expect("an etcd leader");
            etcd.kill(leader);
            lost_leader = Some(leader);
            // The two members left elect another before the job ends.
            let elected = (0..600).any(|_| {
                std::thread::sleep(Duration::from_millis(100));
                etcd.leader().is_some_and(|l| l != leader)
            });
            assert!(elected, "the two etcd members left elected no leader in a minute");
        },
    );
    let _ = out.first.wait();
    let r = &out.report;
    assert_eq!(out.before, out.after, "the workers kept their processes:\n{}", out.said);
    // Every sample exactly once over the whole job, both coordinators' steps.
    assert_exactly_once(r, 24, 1200);
    let taken = takeovers(r);
    assert_eq!(taken.len(), 1, "{r}");
    assert!(taken[0].contains("2 of its 2 workers came back with their state"), "{taken:?}");
    // No worker was started again (the two the first coordinator started came back).
    assert_eq!(r["workers_started"].as_array().unwrap().len(), 2, "{r}");
    // The standby took them as its own, on the slots they hold.
    let mut slots: Vec<&str> =
        r["worker_handles"].as_object().unwrap().values().filter_map(|h| h.as_str()).collect();
    slots.sort();
    assert_eq!(slots, ["slot:w1/0", "slot:w2/0"], "{r}");
    assert!(!out.said.contains("resuming job"), "no checkpoint was restored:\n{}", out.said);
    // The store lost its leader member and went on under another, and
    // the report shows that takeover too.
    let now = etcd.leader().expect("the two members left elected a leader");
    assert_ne!(Some(now), lost_leader);
    let store_events = r["store_events"].as_array().unwrap();
    assert!(
        store_events
            .iter()
            .any(|e| e["what"].as_str().unwrap().contains("the store's leader changed from etcd member")),
        "{store_events:?}"
    );
}

#[test]
fn a_frozen_coordinator_is_taken_over_on_redis_and_writes_nothing_when_it_wakes() {
    let Some(hosts) = Hosts::build_or_skip(&["store", "a", "b", "w1", "w2"]) else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut redis = hosts.redis("store", dir.path());
    let store = format!("redis://{}:6379/", hosts.ip("store"));
    let t = Takeover { hosts: &hosts, dir: dir.path().to_path_buf(), store, epochs: 10 };
    let frozen = std::cell::Cell::new(0u32);
    let mut out = t.run(
        // SIGSTOP: its connections stay open, its lease lapses.
        |a| {
            frozen.set(a.id());
            // SAFETY: signalling a child of this test by its pid.
            unsafe { libc::kill(a.id() as i32, libc::SIGSTOP) };
        },
        // Woken once the standby leads with the workers: it finds itself
        // fenced by its own clock and stops without writing anything.
        || unsafe {
            libc::kill(frozen.get() as i32, libc::SIGCONT);
        },
    );
    let status = wait_exit(&mut out.first, "the woken coordinator", Duration::from_secs(60), String::new);
    let mut said = Vec::new();
    while let Ok(l) = out.first_said.try_recv() {
        said.push(l);
    }
    let error = report(&t.dir.join("a"))["error"].as_str().unwrap_or_default().to_string();
    let _ = (redis.kill(), redis.wait());
    assert!(!status.success(), "the deposed coordinator finished: {said:?}");
    assert!(error.contains("fenced"), "{error}\n{said:?}");
    let r = &out.report;
    assert_eq!(out.before, out.after, "the workers kept their processes:\n{}", out.said);
    assert_exactly_once(r, 10, 1200);
    assert_eq!(takeovers(r).len(), 1, "{r}");
    // Nothing of the deposed coordinator's: every checkpoint verifies, the
    // newest is the standby's final state, and the fence is the standby's.
    let cps = edl_runtime::checkpoint::Checkpoints::new(t.dir.join("checkpoints"), 3);
    let (newest, skipped) = cps.latest().unwrap();
    assert!(skipped.is_empty(), "{skipped:?}");
    assert_eq!(newest.unwrap().manifest.step, r["steps"].as_u64().unwrap());
    let fence = cps.fence().unwrap().expect("the standby claimed the checkpoints");
    assert!(fence.from_step > 0, "{fence:?}");
    // The woken coordinator started no worker: only the standby's two ever ran.
    assert_eq!(r["workers_started"].as_array().unwrap().len(), 2, "{r}");
}
