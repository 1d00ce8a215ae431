//! PyTorch programs under `edl-runtime launch`, for real
//! (`tests/programs/torch_state.py`): a CNN with BatchNorm, AdamW or
//! RMSprop and a cosine schedule, whole in `edl.torch.ElasticState`,
//! trained with DDP over the gloo process group `edl.torch` builds for each
//! generation on the job's authenticated store.

use crate::support::{
    capture::{Capture, contains, tcpdump_or_skip},
    hosts::Hosts,
    job::{
        Alone, assert_exactly_once, assert_noise_scale_measured, committed_checkpoint, finish, lines, report,
    },
    process::{sigkill, sigkill_worker},
    python::{PyEnv, torch_py},
    root,
    wait::wait_for,
};
use edl_plugin_artifacts as art;
use serde_json::Value;
use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

fn program() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/torch_state.py")
}

/// The job: `min` to 3 workers under the schedule policy, on the first
/// `samples` of digits' 1397, in global batches of `batch`.
/// `samples` None: as many as the program's data set holds (1397).
fn job(
    py: &PyEnv,
    dir: &Path,
    optimizer: &str,
    min: u32,
    epochs: u32,
    samples: Option<u32>,
    batch: u32,
) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_edl-runtime"));
    c.current_dir(dir).arg("launch");
    if let Some(n) = samples {
        c.args(["--samples", &n.to_string()]);
    }
    c.args(["--batch", &batch.to_string()])
        .args(["--min-workers", &min.to_string(), "--max-workers", "3"])
        .args(["--policy", art::SCHEDULE_WASM, "--policy-config", "every=8", "--decide-every-steps", "4"])
        .arg("--epochs")
        .arg(epochs.to_string())
        .args(["--no-distill", "--report", "report.json", "--plot", "run.svg", "--plugin-cache"])
        .arg(dir.join("plugin-cache"))
        .args(["--", "python"])
        .arg(program())
        .env("OPTIMIZER", optimizer)
        .env("EPOCHS", epochs.to_string())
        // Slow enough for a third worker (PyTorch takes seconds to import)
        // to join, and for the kills to land mid-job.
        .env("STEP_DELAY_MS", "60")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    py.env(&mut c);
    c
}

/// The value after `key ` in `line`, up to the next `;`.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let rest = line.split_once(&format!("{key} "))?.1;
    Some(rest.split(';').next()?.trim().trim_end_matches('%'))
}

/// The workers that ended with the job having trained: (params digest, accuracy).
fn finishers(lines: &[String]) -> Vec<(String, f64)> {
    lines
        .iter()
        .filter(|l| l.contains(": the job is done; generations "))
        .filter(|l| field(l, "generations").is_some_and(|g| g != "0"))
        .filter_map(|l| Some((field(l, "params")?.to_string(), field(l, "test accuracy")?.parse().ok()?)))
        .collect()
}

#[test]
fn the_torch_module_passes_its_tests() {
    let out = torch_py()
        .python()
        .current_dir(root())
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "runtime/python/tests/test_torch.py"])
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    assert!(text.contains(" passed") && !text.contains("skipped"), "{text}");
}

/// The program's own test accuracy without edl: one process, the same
/// seed, epochs and global batch.
fn plain_accuracy(py: &PyEnv, samples: u32, batch: u32, epochs: u32) -> f64 {
    let mut c = Command::new(py.bin().join("python"));
    py.env(&mut c);
    let out = c
        .arg(program())
        .args(["--plain", &samples.to_string(), &batch.to_string()])
        .env("EPOCHS", epochs.to_string())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    field(&said, "test accuracy").and_then(|a| a.parse().ok()).unwrap_or_else(|| panic!("{said}"))
}

/// Every `worker W: step S of generation G starts at params D` line: (S, G, D).
fn step_digests(lines: &[String]) -> Vec<(u64, u64, String)> {
    lines
        .iter()
        .filter_map(|l| {
            let rest = l.split_once(": step ")?.1;
            let (step, rest) = rest.split_once(" of generation ")?;
            let (generation, digest) = rest.split_once(" starts at params ")?;
            Some((step.parse().ok()?, generation.parse().ok()?, digest.trim().to_string()))
        })
        .collect()
}

/// The ranks of a generation start each step with one model; a generation
/// that starts at a step the generation before it took too (a rollback to
/// the last commit) starts it with the model that one started it with: the
/// committed state. (Any other earlier attempt of that step may have started
/// from steps later rolled back, or redone by a group of another size, whose
/// reductions sum in another order: not compared bit for bit. A generation
/// that starts where the one before stopped, at a resize's boundary, has no
/// earlier attempt to compare with: the final models and their accuracy
/// check those.)
fn assert_one_model(digests: &[(u64, u64, String)]) {
    for (step, generation, digest) in digests {
        let rank0 = &digests.iter().find(|d| (d.0, d.1) == (*step, *generation)).unwrap().2;
        assert_eq!(
            digest, rank0,
            "generation {generation}'s ranks started step {step} from two models: {digests:?}"
        );
    }
    let generations: std::collections::BTreeSet<u64> = digests.iter().map(|d| d.1).collect();
    for (&before, &g) in generations.iter().zip(generations.iter().skip(1)) {
        let (start, digest) = digests.iter().filter(|d| d.1 == g).map(|d| (d.0, &d.2)).min().unwrap();
        if let Some(earlier) = digests.iter().find(|d| (d.0, d.1) == (start, before)) {
            assert_eq!(
                &earlier.2, digest,
                "generation {g} rolled back to step {start} and started it from another model than generation \
                 {before} did: {digests:?}"
            );
        }
    }
}

#[test]
fn a_cnn_with_batchnorm_adamw_and_a_schedule_trains_whole_through_resizes_and_a_kill() {
    let py = torch_py();
    let dir = tempfile::tempdir().unwrap();
    // 1396 samples in steps of 93: each epoch ends with a step of one
    // sample, where a rank has none and still takes part in DDP.
    let (samples, batch, epochs) = (1396, 93, 6);
    let mut child = job(py, dir.path(), "adamw", 1, epochs, Some(samples), batch)
        .env("HOLD_UNTIL_WORLD", "3")
        .env("DIGEST_EVERY", "3")
        // Far longer than a recovery may take: the kill must end the
        // survivors' collectives, not their timeout.
        .env("COLLECTIVE_TIMEOUT_S", "120")
        .spawn()
        .unwrap();
    let coordinator = child.id();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    // Grown 1 -> 2 -> 3 workers: kill one's main process with SIGKILL (its
    // data loader's two processes, holding its sockets, are left to the
    // runtime), mid-collective as likely as not; the others' collectives
    // fail at once and the step is redone.
    wait_for(&rx, " -> 3 workers", &mut seen, Duration::from_secs(180));
    let id = 2;
    sigkill_worker(coordinator, id);
    wait_for(&rx, &format!("worker {id} lost"), &mut seen, Duration::from_secs(120));
    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert!(status.success(), "{text}");
    let r = report(dir.path());
    assert_exactly_once(&r, epochs as u64, samples as u64);
    let events = r["scale_events"].as_array().unwrap();
    let by_policy = |from: u64, to: u64| {
        events.iter().any(|e| {
            e["reason"].as_str().unwrap().starts_with("policy")
                && (e["from"].as_u64(), e["to"].as_u64()) == (Some(from), Some(to))
        })
    };
    // Grown by the policy to 3: one worker at a time, or both at one
    // boundary when the second was asked for before the first was ready
    // (a slow torch import).
    assert!((by_policy(1, 2) && by_policy(2, 3)) || by_policy(1, 3), "{events:?}");
    // The kill shrank the group of 3 (to 2, or to 1 when the schedule's
    // own scale-in fell at the same step boundary).
    let lost = format!("worker {id} lost");
    let lost = events
        .iter()
        .find(|e| e["from"] == 3 && e["reason"].as_str().is_some_and(|r| r.contains(&lost)))
        .unwrap_or_else(|| panic!("{events:?}"));
    // The whole time without a commit, in phases; the survivors were out
    // of their collectives long before the collectives' 120 s timeout.
    let phase = |k: &str| lost["recovery"][k].as_f64().unwrap_or_else(|| panic!("{k}: {lost}"));
    let sum: f64 = ["detect_ms", "abort_ms", "form_ms", "first_step_ms"].iter().map(|k| phase(k)).sum();
    assert!((sum - lost["pause_ms"].as_f64().unwrap()).abs() < 1.0, "{lost}");
    assert!(phase("abort_ms") < 30_000.0, "the survivors waited for their timeout: {lost}");
    // The program's own metric (`step.commit(loss=..., accuracy=...)`): in
    // the live progress, in every step of the report, in the plot.
    assert!(seen.iter().any(|l| l.starts_with("progress") && l.contains("| accuracy 0.")), "{text}");
    let timeline = r["timeline"].as_array().unwrap();
    let last = timeline.last().unwrap()["metrics"]["accuracy"].as_f64().unwrap();
    assert!(timeline.iter().all(|s| s["metrics"]["accuracy"].is_number()), "{r}");
    assert!(last > 0.8 && last <= 1.0, "the last step's training accuracy {last}");
    let svg = std::fs::read_to_string(dir.path().join("run.svg")).unwrap();
    assert!(svg.contains("accuracy"), "the plot names the metric");
    // ElasticDDP's communication hook measured the gradient noise scale.
    assert_noise_scale_measured(&r, Alone::Unmeasured);
    if timeline.iter().any(|s| s["noise_scale"].is_number()) {
        assert!(svg.contains("gradient noise scale"), "the plot draws the noise scale");
    }

    // Every rank of a generation starts a step with the same parameters, and
    // a generation starts where the one before left its state (or rolled
    // back to): the reductions agreed in every generation.
    let digests = step_digests(&seen);
    let starts: std::collections::BTreeSet<u64> = digests.iter().map(|d| d.0).collect();
    assert!(starts.len() >= 20, "{digests:?}");
    let generations: std::collections::BTreeSet<u64> = digests.iter().map(|d| d.1).collect();
    assert!(generations.len() >= 3, "grown twice and shrunk by the kill: {digests:?}");
    assert_one_model(&digests);
    let done = finishers(&seen);
    assert!(!done.is_empty(), "a worker at the end: {text}");
    assert!(done.iter().all(|f| f.0 == done[0].0), "the final workers' models differ: {done:?}");
    // As good as the same script without edl, to a point.
    let alone = plain_accuracy(py, samples, batch, epochs);
    assert!(
        (done[0].1 - alone).abs() <= 1.0,
        "test accuracy {} under edl, {alone} without: {text}",
        done[0].1
    );

    // The final checkpoint, loaded into a plain PyTorch model, optimizer
    // and scheduler: the same parameters, the same accuracy (within a
    // point: BatchNorm's running statistics are rank 0's), and an optimizer
    // and a schedule that stepped once per committed step.
    // Given the job's checkpoint directory, it loads the newest complete
    // checkpoint: the final one, which `latest` names.
    let ckpt = std::path::Path::new(r["final_checkpoint"].as_str().unwrap());
    let folder = ckpt.parent().unwrap();
    let latest = std::fs::read_to_string(folder.join("latest")).unwrap();
    assert_eq!(latest.trim(), ckpt.file_name().unwrap().to_str().unwrap());
    let mut check = Command::new(py.bin().join("python"));
    py.env(&mut check);
    let out =
        check.arg(program()).arg("--check").arg(folder).env("EPOCHS", epochs.to_string()).output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert_eq!(field(&said, "params"), Some(done[0].0.as_str()), "{said}");
    let acc: f64 = field(&said, "test accuracy").unwrap().parse().unwrap();
    assert!((acc - done[0].1).abs() <= 1.0, "checkpoint {acc}, workers {}: {said}", done[0].1);
    let steps = r["steps"].as_u64().unwrap().to_string();
    assert_eq!(field(&said, "optimizer steps"), Some(steps.as_str()), "{said}");
    assert_eq!(field(&said, "scheduler steps"), Some(steps.as_str()), "{said}");
}

#[test]
fn a_killed_rmsprop_job_resumes_with_its_optimizer_and_schedule_where_they_were() {
    let py = torch_py();
    let dir = tempfile::tempdir().unwrap();
    // Gloo's connections made at the first collective, as NCCL makes its
    // communicator: the group's store must outlive `init_process_group`.
    let mut child =
        job(py, dir.path(), "rmsprop", 2, 4, None, 64).env("TORCH_GLOO_LAZY_INIT", "1").spawn().unwrap();
    let coordinator = child.id();
    let _rx = lines(&mut child);
    let written = committed_checkpoint(&dir.path().join(".edl/launch/checkpoints"), &mut child);
    // Its workers die with it.
    sigkill(coordinator);
    let _ = child.wait();

    let mut child = job(py, dir.path(), "rmsprop", 2, 4, None, 64).spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert!(status.success(), "{text}");
    let r = report(dir.path());
    let resumed = r["resumed_from_step"].as_u64().unwrap();
    assert!(resumed > 0 && resumed >= written, "{r}, a checkpoint at step {written}");
    assert_exactly_once(&r, 4, 1397);
    // Each worker's first step (the resumed one, or a later one for a
    // worker that joined later) finds RMSprop's state (made lazily by
    // PyTorch, here from the start) and the schedule as the checkpoint or
    // its peers had them: one optimizer and one scheduler step per committed
    // step. A reset optimizer or schedule would say 0.
    let firsts: Vec<&String> = seen.iter().filter(|l| l.contains(": first step ")).collect();
    assert!(firsts.iter().any(|l| field(l, "first step") == Some(&resumed.to_string())), "{text}");
    for l in firsts {
        let step = field(l, "first step").unwrap();
        assert_eq!(field(l, "optimizer steps"), Some(step), "{l}");
        assert_eq!(field(l, "scheduler steps"), Some(step), "{l}");
    }
    let done = finishers(&seen);
    assert!(done.len() >= 2 && done.iter().all(|f| f.0 == done[0].0), "{done:?}: {text}");
}

/// `[rankR]: env K=V ...` lines: each rank's torchrun environment.
fn rank_envs(lines: &[String]) -> Vec<std::collections::HashMap<String, String>> {
    lines
        .iter()
        .filter_map(|l| l.split_once("]: env ").map(|(_, e)| e))
        .map(|e| {
            e.split_whitespace()
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.into(), v.into()))
                .collect()
        })
        .collect()
}

#[test]
fn a_torchrun_ddp_script_runs_across_hosts_and_a_dead_host_restarts_the_group_on_the_survivor() {
    let Some(tcpdump) = tcpdump_or_skip() else { return };
    let Some(hosts) = Hosts::build_or_skip(&["launcher", "b", "c", "stranger"]) else { return };
    let py = torch_py();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // What host c's ranks say to the group's store on b crosses c's eth0.
    let capture = Capture::start(&hosts, "c", tcpdump, d);
    let (launcher, b, c) = (hosts.ip("launcher"), hosts.ip("b"), hosts.ip("c"));
    let program = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/ddp_hosts.py");
    let mut cmd = hosts.on("launcher", env!("CARGO_BIN_EXE_edl-runtime"));
    cmd.current_dir(d)
        .args(["launch", "--torchrun", "--job", "hosts", "--nproc-per-node", "2"])
        .args(["--min-workers", "1", "--max-workers", "2", "--workers", "2"])
        .args(["--scaler", "command", "--hosts", "b,c", "--listen", &launcher])
        .arg("--worker-command")
        .arg(format!("ip netns exec {}-{{host}} {{program}}", hosts.prefix))
        .args(["--policy", art::SCHEDULE_WASM, "--decide-secs", "600", "--max-restarts", "0"])
        .args(["--worker-lease-secs", "3", "--stop-grace-secs", "2", "--report", "report.json"])
        .arg("--")
        .arg(py.bin().join("python"))
        .arg(&program)
        .arg(d.join("snapshot.pt"))
        .arg("3")
        // The group of 4 waits after its first epoch: the host is taken away there.
        .env("HOLD_WHILE_WORLD", "4")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    py.env(&mut cmd);
    let mut child = cmd.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen: Vec<String> = Vec::new();
    // Every rank of the group of 4 holds (in whatever order they say so).
    while seen.iter().filter(|l| l.contains("holding with 4 ranks")).count() < 4 {
        wait_for(&rx, "holding with 4 ranks", &mut seen, Duration::from_secs(240));
    }
    // A stranger on another host who knows where the group's store is
    // gets nothing from it with torch's own client.
    let started = seen.iter().find(|l| l.starts_with("group     0:")).cloned().unwrap_or_default();
    let master = started.split("store ").nth(1).and_then(|m| m.split([',', ' ']).next()).unwrap_or_default();
    let (host, port) = master.rsplit_once(':').expect("the group's line names its store");
    assert_eq!(host, b, "the store is on group rank 0's host: {started}");
    let stranger = "import datetime, sys, torch.distributed as dist\n\
        try:\n    s = dist.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, \
        timeout=datetime.timedelta(seconds=5), wait_for_workers=False)\n    \
        print('stranger read', s.num_keys(), s.get('/worker/attempt_0/init/'))\n\
        except Exception as e:\n    print('stranger refused:', e)\n";
    let mut probe = hosts.on("stranger", py.bin().join("python").to_str().unwrap());
    py.env(&mut probe);
    let out = probe.args(["-c", stranger, host, port]).output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("stranger refused"), "{said}{}", String::from_utf8_lossy(&out.stderr));
    // Host c dies: its agent and both its ranks.
    assert!(hosts.kill_all("c") >= 3, "an agent and two ranks on c");
    wait_for(&rx, &format!("host {c} lost"), &mut seen, Duration::from_secs(60));
    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert!(status.success(), "{text}");

    // The first group: 2 hosts of 2 ranks, placed as torchrun places them
    // across hosts, the store on group rank 0's host.
    let envs = rank_envs(&seen);
    let first: Vec<_> = envs.iter().filter(|e| e["WORLD_SIZE"] == "4").collect();
    assert_eq!(first.len(), 4, "{text}");
    for e in &first {
        let rank: u32 = e["RANK"].parse().unwrap();
        let group_rank: u32 = e["GROUP_RANK"].parse().unwrap();
        let local: u32 = e["LOCAL_RANK"].parse().unwrap();
        assert_eq!(rank, group_rank * 2 + local, "{e:?}");
        assert_eq!((e["GROUP_WORLD_SIZE"].as_str(), e["LOCAL_WORLD_SIZE"].as_str()), ("2", "2"), "{e:?}");
        // The ranks reach the store through their host's loopback bridge.
        assert_eq!(e["MASTER_ADDR"], "127.0.0.1", "{e:?}");
    }
    // Then the group on the host left: 2 ranks, one host, from the snapshot.
    let last: Vec<_> = envs.iter().filter(|e| e["WORLD_SIZE"] == "2").collect();
    assert_eq!(last.len(), 2, "{text}");
    assert!(last.iter().all(|e| e["GROUP_WORLD_SIZE"] == "1" && e["MASTER_ADDR"] == "127.0.0.1"), "{last:?}");
    assert!(seen.iter().any(|l| l.contains("rank 0: trained 3 epochs")), "{text}");

    // c's ranks used the store on b, sealed: none of torch's c10d keys
    // crossed c's interface in clear.
    let flows = capture.stop();
    let to_store: usize =
        flows.iter().filter(|((_, to), _)| *to == format!("{b}:{port}")).map(|(_, bytes)| bytes.len()).sum();
    assert!(to_store > 0, "c's ranks said nothing to the store on {b}:{port}: {:?}", flows.keys());
    let everything: Vec<u8> = flows.values().flatten().copied().collect();
    for key in ["/worker/attempt_", "default_pg", "init/"] {
        assert!(!contains(&everything, key.as_bytes()), "{key:?} crossed c's interface in clear");
    }

    let r = report(d);
    let groups = r["outcome"]["groups"].as_array().unwrap();
    assert_eq!(groups[0]["hosts"], serde_json::json!([b, c]), "{r}");
    assert_eq!(groups[0]["master_addr"], b, "{r}");
    let last = groups.last().unwrap();
    assert_eq!((last["hosts"].clone(), last["world"].as_u64()), (serde_json::json!([b]), Some(2)), "{r}");
    assert_eq!(last["ended"], "succeeded", "{r}");
    assert!(groups[0]["ended"].as_str().unwrap().contains(&format!("host {c} lost")), "{r}");
    // A lost host is a change of membership, not a failure restart.
    assert_eq!(r["outcome"]["restarts"], 0, "{r}");
    // Nothing is left running on the host that stayed.
    let until = std::time::Instant::now() + Duration::from_secs(20);
    while !hosts.pids("b").is_empty() && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(hosts.pids("b").is_empty(), "left on b: {:?}", hosts.pids("b"));
}

/// A torchrun job across two agent hosts (w1, w2) whose launcher can be
/// taken over: the active launcher on host a, a standby on host b, Redis
/// on host store. The DDP script holds after its first epoch until the
/// file `release` exists.
struct TorchrunTakeover<'h> {
    hosts: &'h Hosts,
    py: &'h PyEnv,
    dir: PathBuf,
}

/// What a takeover left: the standby's report and output, the processes
/// on the agent hosts before and after it, and the first launcher.
struct LauncherTakenOver {
    report: Value,
    said: String,
    before: Vec<i32>,
    after: Vec<i32>,
    first: std::process::Child,
    first_said: std::sync::mpsc::Receiver<String>,
}

impl TorchrunTakeover<'_> {
    fn launcher(&self, host: &str, extra: &[&str]) -> Command {
        let cwd = self.dir.join(host);
        std::fs::create_dir_all(&cwd).unwrap();
        let program = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/ddp_hosts.py");
        let store = format!("redis://{}:6379/", self.hosts.ip("store"));
        let mut c = self.hosts.on(host, env!("CARGO_BIN_EXE_edl-runtime"));
        c.current_dir(&cwd)
            .args(["launch", "--torchrun", "--job", "follow", "--nproc-per-node", "2"])
            .args(["--min-workers", "2", "--max-workers", "2", "--workers", "2"])
            .args(["--scaler", "command", "--hosts", "w1,w2", "--listen", &self.hosts.ip(host)])
            .arg("--worker-command")
            .arg(format!("ip netns exec {}-{{host}} {{program}}", self.hosts.prefix))
            .args(["--policy", art::SCHEDULE_WASM, "--decide-secs", "600", "--max-restarts", "0"])
            .args(["--worker-lease-secs", "3", "--stop-grace-secs", "2", "--report", "report.json"])
            .args(["--store", &store])
            .arg("--secret-file")
            .arg(self.dir.join("job.secret"))
            .args(extra)
            .arg("--")
            .arg(self.py.bin().join("python"))
            .arg(&program)
            .arg(self.dir.join("snapshot.pt"))
            .arg("3")
            .env("HOLD_UNTIL", self.dir.join("release"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(self.dir.join(format!("{host}.stderr"))).unwrap());
        self.py.env(&mut c);
        c
    }

    /// Waits (bounded) for a line of `host`'s launcher holding `needle`;
    /// on failure shows what it wrote on both streams.
    fn wait(&self, host: &str, rx: &std::sync::mpsc::Receiver<String>, needle: &str, seen: &mut Vec<String>) {
        let until = std::time::Instant::now() + Duration::from_secs(240);
        while let Ok(l) = rx.recv_timeout(until.saturating_duration_since(std::time::Instant::now())) {
            let hit = l.contains(needle);
            seen.push(l);
            if hit {
                return;
            }
        }
        let err = std::fs::read_to_string(self.dir.join(format!("{host}.stderr"))).unwrap_or_default();
        panic!("no line with {needle:?} from the launcher on {host}:\n{}\nstderr:\n{err}", seen.join("\n"));
    }

    /// The processes on the agent hosts: each agent and its two ranks.
    fn processes(&self) -> Vec<i32> {
        let mut p = [self.hosts.pids("w1"), self.hosts.pids("w2")].concat();
        p.sort();
        p
    }

    /// Runs the active launcher on a until its group of 4 holds, a standby
    /// on b; `strike` does to the active one what the test is about, then
    /// the standby must take the group over with all its agents, `then`
    /// runs, the group is released and the standby finishes the job.
    fn run(&self, strike: impl FnOnce(&mut std::process::Child), then: impl FnOnce()) -> LauncherTakenOver {
        let mut first = self.launcher("a", &[]).spawn().unwrap();
        let first_said = lines(&mut first);
        let mut seen_a: Vec<String> = Vec::new();
        while seen_a.iter().filter(|l| l.contains("holding until")).count() < 4 {
            self.wait("a", &first_said, "holding until", &mut seen_a);
        }
        let mut standby = self.launcher("b", &["--standby"]).spawn().unwrap();
        let rx = lines(&mut standby);
        let mut seen = Vec::new();
        self.wait("b", &rx, "standby", &mut seen);
        let before = self.processes();
        assert!(before.len() >= 6, "an agent and two ranks on each of w1 and w2: {before:?}");
        strike(&mut first);
        self.wait("b", &rx, "taking the job over from the launcher at", &mut seen);
        self.wait("b", &rx, "coordinator takeover", &mut seen);
        let after = self.processes();
        then();
        std::fs::write(self.dir.join("release"), "").unwrap();
        let status = finish(standby, rx, &mut seen);
        let said = seen.join("\n");
        let err = std::fs::read_to_string(self.dir.join("b.stderr")).unwrap_or_default();
        assert!(status.success(), "{said}\nstderr:\n{err}");
        LauncherTakenOver { report: report(&self.dir.join("b")), said, before, after, first, first_said }
    }
}

#[test]
fn a_torchrun_group_across_hosts_keeps_running_when_a_standby_takes_over_from_its_killed_launcher() {
    let Some(hosts) = Hosts::build_or_skip(&["store", "a", "b", "w1", "w2"]) else { return };
    let py = torch_py();
    let dir = tempfile::tempdir().unwrap();
    let mut redis = hosts.redis("store", dir.path());
    let t = TorchrunTakeover { hosts: &hosts, py, dir: dir.path().to_path_buf() };
    let mut out = t.run(|a| a.kill().unwrap(), || {});
    let _ = out.first.wait();
    let _ = (redis.kill(), redis.wait());
    let (said, r) = (&out.said, &out.report);
    // The agents and ranks on both hosts are the processes they were.
    assert_eq!(out.before, out.after, "the ranks kept their processes:\n{said}");
    assert!(said.contains("all 2 agents of group 0 came back with their ranks running"), "{said}");
    // The group was not restarted: the standby started no rank, and its
    // one group is the one it took over, which succeeded.
    assert!(!said.contains("]: env "), "no rank started again:\n{said}");
    let groups = r["outcome"]["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 1, "{r}");
    assert_eq!(
        (groups[0]["group"].as_u64(), groups[0]["taken_over"].as_bool()),
        (Some(0), Some(true)),
        "{r}"
    );
    assert_eq!(groups[0]["world"], 4, "{r}");
    assert_eq!(groups[0]["ended"], "succeeded", "{r}");
    assert_eq!(r["outcome"]["restarts"], 0, "{r}");
    // The ranks trained on to the end, their output now through the standby.
    assert!(said.contains("rank 0: trained 3 epochs"), "{said}");
    // Nothing is left on the agent hosts.
    let until = std::time::Instant::now() + Duration::from_secs(20);
    while !t.processes().is_empty() && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(t.processes().is_empty(), "left on w1, w2: {:?}", t.processes());
}

#[test]
fn a_frozen_torchrun_launcher_is_taken_over_and_acts_on_nobody_when_it_wakes() {
    let Some(hosts) = Hosts::build_or_skip(&["store", "a", "b", "w1", "w2"]) else { return };
    let py = torch_py();
    let dir = tempfile::tempdir().unwrap();
    let mut redis = hosts.redis("store", dir.path());
    let t = TorchrunTakeover { hosts: &hosts, py, dir: dir.path().to_path_buf() };
    let frozen = std::cell::Cell::new(0i32);
    // SIGSTOP: its connections stay open, its lease lapses; woken once the
    // standby leads the group, before the group is released.
    let mut out = t.run(
        |a| {
            frozen.set(a.id() as i32);
            // SAFETY: signalling a child of this test by its pid.
            unsafe { libc::kill(a.id() as i32, libc::SIGSTOP) };
        },
        || {
            // SAFETY: as above.
            unsafe { libc::kill(frozen.get(), libc::SIGCONT) };
            std::thread::sleep(Duration::from_secs(2));
        },
    );
    let until = std::time::Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = out.first.try_wait().unwrap() {
            break s;
        }
        assert!(std::time::Instant::now() < until, "the woken launcher did not stop");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut first_said = Vec::new();
    while let Ok(l) = out.first_said.try_recv() {
        first_said.push(l);
    }
    let _ = (redis.kill(), redis.wait());
    let err = std::fs::read_to_string(t.dir.join("a.stderr")).unwrap_or_default();
    assert!(!status.success(), "the deposed launcher finished: {first_said:?}");
    assert!(err.contains("fenced"), "{err}");
    // It sent nobody away and started nothing: the ranks ran on, not
    // restarted, and the standby finished the job with them.
    assert_eq!(out.before, out.after, "{}", out.said);
    for deed in ["lost", "agent 3", "scale     ", "restart   ", "sent away"] {
        assert!(!first_said.iter().any(|l| l.contains(deed)), "{deed:?}: {first_said:?}");
    }
    let groups = out.report["outcome"]["groups"].as_array().unwrap();
    assert_eq!((groups.len(), groups[0]["ended"].as_str()), (1, Some("succeeded")), "{}", out.report);
    assert!(out.said.contains("rank 0: trained 3 epochs"), "{}", out.said);
}

/// The program docs/your-own-program.md shows first, taken from the page
/// as it is and run under `launch` with two workers: it trains, as written.
#[test]
fn the_docs_ddp_program_runs_as_written() {
    let py = torch_py();
    let page = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/your-own-program.md"),
    )
    .unwrap();
    let section = page.split("## 2. Make the training loop elastic").nth(1).unwrap();
    let code = section.split("```python\n").nth(1).unwrap().split("```").next().unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("train.py"), code).unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_edl-runtime"));
    c.current_dir(dir.path())
        .args(["launch", "--batch", "64", "--epochs", "2", "--workers", "2", "--min-workers", "2"])
        .args(["--max-workers", "2", "--no-distill", "--report", "report.json", "--plugin-cache"])
        .arg(dir.path().join("plugin-cache"))
        .args(["--", "python", "train.py"])
        .stdin(Stdio::null());
    py.env(&mut c);
    let out = c.output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("report.json")).unwrap()).unwrap();
    assert_eq!(r["epochs"].as_array().unwrap().len(), 2, "{r}");
    let last = r["timeline"].as_array().unwrap().last().unwrap().clone();
    assert!(last["metrics"]["accuracy"].as_f64().unwrap() > 0.5, "it learns: {last}");
}

/// examples/pytorch/train_cnn.py under the goodput adapter, on two workers
/// whose steps are mostly a fixed cost: `ElasticDDP` measures the noise
/// scale, the adapter grows the batch and the rate, the program follows,
/// every sample is committed once, and the final checkpoint, put back into
/// the example's model as `benches/goodput_torch.py` does, is the model
/// rank 0 ended with (the same test accuracy, to the digit).
#[test]
fn the_cnn_example_trains_with_the_batch_and_rate_the_goodput_adapter_chooses() {
    let py = torch_py();
    let dir = tempfile::tempdir().unwrap();
    let example = root().join("examples/pytorch/train_cnn.py");
    let mut c = Command::new(env!("CARGO_BIN_EXE_edl-runtime"));
    c.current_dir(dir.path())
        .args(["launch", "--samples", "2000", "--epochs", "3", "--batch", "64", "--lr", "0.05"])
        .args(["--workers", "2", "--min-workers", "2", "--max-workers", "2", "--no-distill"])
        .args(["--policy", art::SCHEDULE_WASM, "--decide-every-steps", "4"])
        .args(["--adapter", art::GOODPUT_WASM, "--batch-max", "512", "--report", "report.json"])
        .args(["--plugin-cache"])
        .arg(dir.path().join("plugin-cache"))
        .args(["--", "python"])
        .arg(&example)
        .env("STEP_DELAY_MS", "30")
        .stdin(Stdio::null());
    py.env(&mut c);
    let out = c.output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    let r = report(dir.path());
    assert_exactly_once(&r, 3, 2000);
    assert_noise_scale_measured(&r, Alone::Unmeasured);
    let steps = r["timeline"].as_array().unwrap();
    assert_eq!(steps[0]["batch"].as_u64(), Some(64), "it starts at --batch");
    let measured = steps.iter().position(|s| s.get("noise_scale").is_some()).unwrap();
    let grown = steps.iter().position(|s| s["batch"].as_u64().unwrap() > 64);
    let grown = grown.unwrap_or_else(|| panic!("the batch never grew: {steps:?}"));
    assert!(grown > measured, "grown at step {grown}, measured from {measured}");
    let lr = steps[grown]["lr"].as_f64().unwrap();
    assert!(lr > 0.05, "a larger batch, a larger rate: {}", steps[grown]);
    assert!(steps.iter().all(|s| s["batch"].as_u64().unwrap() <= 512), "within --batch-max");

    // What the workers said of their model, and what the final checkpoint holds.
    let said_acc: Vec<&str> = said
        .lines()
        .filter_map(|l| l.split("test accuracy ").nth(1))
        .map(|a| a.trim_end_matches('%'))
        .collect();
    assert_eq!(said_acc.len(), 2, "both workers trained to the end: {said}");
    let check = format!(
        "import sys, torch; sys.path.insert(0, {dir:?}); import edl.torch, train_cnn\n\
         torch.set_num_threads(1)\n\
         (_, _), (x, y) = train_cnn.data(); m = train_cnn.build()\n\
         opt = torch.optim.SGD(m.parameters(), lr=0.0, momentum=0.0)\n\
         edl.torch.load_checkpoint({ckpt:?}, m, opt)\n\
         print(f'{{train_cnn.accuracy(m, x, y) * 100:.2f}} {{opt.param_groups[0][\"lr\"]!r}}')",
        dir = example.parent().unwrap().display().to_string(),
        ckpt = dir.path().join(".edl/launch/checkpoints").display().to_string(),
    );
    let out = py.python().args(["-c", &check]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    let (from_checkpoint, opt_lr) = printed.trim().split_once(' ').unwrap();
    let from_checkpoint = from_checkpoint.to_string();
    // The optimiser took the rate of each step (its last, as checkpointed).
    let last_lr = steps.last().unwrap()["lr"].as_f64().unwrap();
    let opt_lr: f64 = opt_lr.parse().unwrap();
    assert!(
        (opt_lr - last_lr).abs() <= 1e-6 * last_lr,
        "the optimiser's rate {opt_lr}, the step's {last_lr}"
    );
    // Rank 0's (each rank's BatchNorm statistics take in its own last batch).
    assert!(
        said_acc.contains(&from_checkpoint.as_str()),
        "the final checkpoint is the model rank 0 ended with: {from_checkpoint} against {said_acc:?}"
    );
    // It learns (chance is 10%). How far depends on the batches and rates the
    // adapter chose, from step times this machine's load moves: 89-97% here.
    let acc: f64 = from_checkpoint.parse().unwrap();
    assert!(acc > 80.0, "it learns: {acc}%");
}
