//! The failure contract under hostile plugins and bad flags: every plugin
//! answer is checked before use, every plugin call ends within its deadline,
//! native code runs only when asked for, and a job refuses what it cannot
//! run before it starts anything.

use crate::support::{
    host, host_with,
    job::{assert_exactly_once, coordinator_note, finish, job, lines, report, run_to_end},
    pairs, path,
    process::children,
    servers::RedisServer,
    view,
    wait::{until, wait_for},
};
use edl_plugin_artifacts as art;
use edl_plugin_sdk::{Action, Batch, Dtype, Hyperparams};
use edl_runtime::plugin::{ArtifactCache, Error, HostOptions, Limits, PluginHost};
use std::{path::Path, process::Command, time::Duration};

fn batch(rows: usize) -> Batch {
    let x: Vec<f32> = (0..rows * 4).map(|i| i as f32 / 7.0).collect();
    Batch {
        data: x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        shape: vec![rows as u32, 4],
        dtype: Dtype::Float32,
        labels: (0..rows as u32).map(|i| i % 3).collect(),
        ids: (100..100 + rows as u64).collect(),
        seed: 7,
    }
}

#[test]
fn a_sleep_in_init_or_a_call_is_stopped_at_the_deadline() {
    // An hour's sleep: without the bounded clocks this test would hang.
    let (host, _d) = host_with(Limits { deadline: Duration::from_millis(50), ..Limits::default() });
    let err =
        host.load_policy(path(art::HOSTILE_POLICY_WASM), &pairs(&[("mode", "sleep-init")])).err().unwrap();
    assert!(matches!(err, Error::Deadline { call: "init", deadline_ms: 50, .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains("hostile_policy.wasm") && text.contains("asked to sleep 3600s"), "{text}");
    assert!(text.contains("wall-clock"), "{text}");

    let mut p =
        host.load_policy(path(art::HOSTILE_POLICY_WASM), &pairs(&[("mode", "sleep-decide")])).unwrap();
    let err = p.decide(&view(8)).unwrap_err();
    assert!(matches!(err, Error::Deadline { call: "decide", .. }), "{err}");
    // A short sleep inside the deadline is allowed.
    let (host, _d) = host_with(Limits { deadline: Duration::from_secs(5), ..Limits::default() });
    let mut p = host
        .load_policy(path(art::HOSTILE_POLICY_WASM), &pairs(&[("mode", "sleep-decide"), ("ms", "1")]))
        .unwrap();
    assert_eq!(p.decide(&view(8)).unwrap(), vec![Action::Hold]);
}

#[test]
fn a_guest_stack_overflow_is_named_as_one() {
    let (host, _d) = host();
    let mut p = host.load_policy(path(art::HOSTILE_POLICY_WASM), &pairs(&[("mode", "recurse")])).unwrap();
    let err = p.decide(&view(8)).unwrap_err();
    assert!(matches!(err, Error::Trap { call: "decide", .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains("stack overflow") && text.contains("calls deep in"), "{text}");
    // The instance is rebuilt after the trap and still answers.
    let mut p = host.load_policy(path(art::HOSTILE_POLICY_WASM), &pairs(&[("mode", "hold")])).unwrap();
    assert_eq!(p.decide(&view(8)).unwrap(), vec![Action::Hold]);
}

#[test]
fn every_broken_transform_output_is_refused_naming_the_plugin() {
    let (host, _d) = host();
    for (mode, want) in [
        ("fewer-labels", "4 labels for 8 sample ids"),
        ("empty", "0 samples out of 8 in"),
        ("nan", "value 0 of sample 0 is not finite"),
        ("huge", "800 samples out of 8 in"),
        ("foreign-ids", "sample id 1000100 was not in the input"),
    ] {
        let mut t =
            host.load_transform(path(art::HOSTILE_TRANSFORM_WASM), &pairs(&[("mode", mode)])).unwrap();
        let err = t.apply(&batch(8)).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, Error::Contract { call: "apply", .. }), "{mode}: {text}");
        assert!(text.contains("hostile_transform.wasm") && text.contains(want), "{mode}: {text}");
    }
    // A permutation of the same samples keeps the contract.
    let mut t =
        host.load_transform(path(art::HOSTILE_TRANSFORM_WASM), &pairs(&[("mode", "reverse")])).unwrap();
    let out = t.apply(&batch(8)).unwrap();
    assert_eq!(out.ids, (100..108).rev().collect::<Vec<u64>>());
}

#[test]
fn every_out_of_range_hyperparameter_is_refused_naming_the_adapter() {
    let (host, _d) = host();
    let current = Hyperparams { global_batch: 64, local_batch: 64, lr: 0.05, momentum: 0.9 };
    for (mode, want) in [
        ("nan-lr", "learning rate NaN"),
        ("inf-lr", "learning rate inf"),
        ("zero-lr", "learning rate 0"),
        ("momentum", "momentum 1.5"),
        ("batch0", "global batch 0"),
    ] {
        let mut a = host
            .load_adapter(path(art::HOSTILE_ADAPTER_WASM), &pairs(&[("mode", mode), ("from", "0")]))
            .unwrap();
        let err = a.on_step(1, &current).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, Error::Contract { call: "on-step", .. }), "{mode}: {text}");
        assert!(text.contains("hostile_adapter.wasm") && text.contains(want), "{mode}: {text}");
    }
}

#[test]
fn native_code_loads_only_when_asked_for_and_never_under_a_wasm_name() {
    let cache = tempfile::tempdir().unwrap();
    let strict =
        PluginHost::new(HostOptions { cache: ArtifactCache::at(cache.path()), ..Default::default() })
            .unwrap();
    let err = strict.load_policy(path(art::PANICKY_SO), &[]).err().unwrap();
    assert!(matches!(err, Error::NativeNotAllowed { .. }), "{err}");
    assert!(err.to_string().contains("--allow-native"), "{err}");
    // A native library renamed .wasm is refused even where native code is allowed.
    let dir = tempfile::tempdir().unwrap();
    let disguised = dir.path().join("policy.wasm");
    std::fs::copy(art::PANICKY_SO, &disguised).unwrap();
    let (host, _d) = host();
    let err = host.load_policy(&disguised, &[]).err().unwrap();
    assert!(err.to_string().contains("named .wasm but holds a native library"), "{err}");
    assert!(host.inspect(&disguised).is_err());
}

/// A native "plugin" whose constructor aborts the process that loads it.
fn booby_trapped_library(dir: &Path) -> Option<std::path::PathBuf> {
    let src = dir.join("bomb.c");
    std::fs::write(
        &src,
        "#include <stdlib.h>\n\
         __attribute__((constructor)) static void boom(void) { abort(); }\n\
         unsigned edl_plugin_abi_version(void) { return 1; }\n\
         int edl_policy_decide(void *h, const void *v, void *out) { return 0; }\n",
    )
    .unwrap();
    let lib = dir.join("libbomb.so");
    let status = Command::new("cc").args(["-shared", "-fPIC", "-o"]).arg(&lib).arg(&src).status();
    match status {
        Ok(s) if s.success() => Some(lib),
        _ => {
            eprintln!("SKIPPED: no C compiler (cc) to build the booby-trapped library");
            None
        }
    }
}

#[test]
fn inspect_reads_a_native_library_without_running_it() {
    let dir = tempfile::tempdir().unwrap();
    let Some(lib) = booby_trapped_library(dir.path()) else { return };
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_edl-runtime"))
            .args(["plugin", "inspect"])
            .arg(&lib)
            .args(extra)
            .arg("--plugin-cache")
            .arg(dir.path().join("cache"))
            .output()
            .unwrap()
    };
    let out = run(&[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "inspect ran the library's code: {out:?}");
    assert!(text.contains("world:       scaling-policy") && text.contains("native library"), "{text}");
    // Loading it is refused without --allow-native, before any of its code runs.
    let out = Command::new(env!("CARGO_BIN_EXE_edl-runtime"))
        .args(["simulate", "--policy"])
        .arg(&lib)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("load only with --allow-native"), "{err}");
}

#[test]
fn a_planted_or_altered_cache_entry_is_not_loaded() {
    let cache = tempfile::tempdir().unwrap();
    let make = || {
        PluginHost::new(HostOptions { cache: ArtifactCache::at(cache.path()), ..Default::default() }).unwrap()
    };
    let host = make();
    let wasm = std::fs::read(art::SCHEDULE_WASM).unwrap();
    let entry = host.cache_entry(&wasm).unwrap();
    host.load_policy(path(art::SCHEDULE_WASM), &[]).unwrap();
    assert!(entry.exists());
    // One flipped byte: the recorded checksum no longer matches.
    let mut bytes = std::fs::read(&entry).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&entry, &bytes).unwrap();
    let p = make().load_policy(path(art::SCHEDULE_WASM), &[]).unwrap();
    assert_eq!(
        p.backend(),
        edl_runtime::plugin::Backend::Wasm { cache: edl_runtime::plugin::CacheStatus::Miss }
    );
    // An entry planted without its checksum is ignored too.
    std::fs::remove_file(format!("{}.sha256", entry.display())).unwrap();
    let p = make().load_policy(path(art::SCHEDULE_WASM), &[]).unwrap();
    assert_eq!(
        p.backend(),
        edl_runtime::plugin::Backend::Wasm { cache: edl_runtime::plugin::CacheStatus::Miss }
    );
    // A cache directory others can write is not used at all.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(cache.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let p = make().load_policy(path(art::SCHEDULE_WASM), &[]).unwrap();
    assert_eq!(
        p.backend(),
        edl_runtime::plugin::Backend::Wasm { cache: edl_runtime::plugin::CacheStatus::Miss }
    );
    let p = make().load_policy(path(art::SCHEDULE_WASM), &[]).unwrap();
    assert_eq!(
        p.backend(),
        edl_runtime::plugin::Backend::Wasm { cache: edl_runtime::plugin::CacheStatus::Miss }
    );
}

/// A short job without teachers: 400 samples, batch 40, one epoch (later
/// flags override these).
fn small(dir: &Path, extra: &[&str]) -> Command {
    let mut args = vec![
        "--policy",
        art::AUTOSCALE_WASM,
        "--no-distill",
        "--train-samples",
        "400",
        "--epochs",
        "1",
        "--decide-every-steps",
        "2",
    ];
    args.extend_from_slice(extra);
    job(dir, &args)
}

/// Runs a small job with `flags` in a directory of its own; it must fail.
/// Returns what it printed.
fn failing_job(flags: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let (status, out) = run_to_end(small(dir.path(), flags));
    assert!(!status.success(), "{out}");
    out
}

#[test]
fn a_job_with_a_broken_transform_fails_naming_it_and_claims_nothing() {
    let out =
        failing_job(&["--transform", art::HOSTILE_TRANSFORM_WASM, "--transform-config", "mode=fewer-labels"]);
    assert!(
        out.contains("hostile_transform.wasm") && out.contains("apply broke the plugin contract"),
        "{out}"
    );
    // Named as the user passed it, not by the worker's copy of its bytes.
    assert!(out.contains(art::HOSTILE_TRANSFORM_WASM), "{out}");
    assert!(!out.contains("/shipped/"), "{out}");
    assert!(!out.contains("every sample exactly once: yes"), "{out}");
}

#[test]
fn a_job_whose_adapter_answers_nan_fails_naming_it() {
    let out = failing_job(&["--adapter", art::HOSTILE_ADAPTER_WASM, "--adapter-config", "mode=nan-lr"]);
    assert!(out.contains("batch adapter") && out.contains("learning rate NaN"), "{out}");
    let out = failing_job(&["--adapter", art::HOSTILE_ADAPTER_WASM, "--adapter-config", "mode=huge-batch"]);
    assert!(out.contains("global batch of 1000000000, above the 400 training samples"), "{out}");
}

/// A job under the hostile policy in `mode`, long enough (about 4 s of
/// steps) for the workers it starts to join; returns its report.
fn policy_job(dir: &Path, mode: &str, max_workers: &str) -> (serde_json::Value, String) {
    let config = format!("mode={mode}");
    let (status, out) = run_to_end(small(
        dir,
        &[
            "--policy",
            art::HOSTILE_POLICY_WASM,
            "--policy-config",
            &config,
            "--max-workers",
            max_workers,
            "--epochs",
            "20",
            "--step-delay-ms",
            "20",
        ],
    ));
    assert!(status.success(), "{out}");
    let r = report(dir);
    for e in r["epochs"].as_array().unwrap() {
        assert_eq!((e["duplicates"].as_u64(), e["missing"].as_u64()), (Some(0), Some(0)), "{e}");
    }
    (r, out)
}

#[test]
fn a_flood_of_scale_outs_never_passes_the_maximum() {
    let dir = tempfile::tempdir().unwrap();
    let (r, out) = policy_job(dir.path(), "flood", "3");
    let started = r["workers_started"].as_array().unwrap().len();
    assert!(started <= 3, "{started} workers started against --max-workers 3:\n{out}");
    assert!(r["scale_events"].as_array().unwrap().iter().any(|e| e["to"] == 3), "{out}");
}

#[test]
fn replacing_the_only_worker_hands_its_state_over() {
    let dir = tempfile::tempdir().unwrap();
    let (r, out) = policy_job(dir.path(), "replace", "1");
    assert!(out.contains("hands over to"), "{out}");
    assert!(out.contains("left after handing over its state"), "{out}");
    assert_eq!(r["workers_started"].as_array().unwrap().len(), 2, "{out}");
    assert_eq!(r["final_world_size"], 1);
}

#[test]
fn nonsensical_flags_are_one_line_errors_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a-file"), b"").unwrap();
    // Settings the job cannot run with are refusals of its command line
    // (status 2, as clap's); what the machine refuses (a store, a
    // directory, a data set) is an error (status 1).
    for (flags, want, code) in [
        (&["--epochs", "0"][..], "--epochs 0", 2),
        (&["--batch", "0"], "--batch 0", 2),
        (&["--batch", "5000"], "--batch 5000: need 1 <= batch <= 400", 2),
        (&["--min-workers", "3", "--max-workers", "2"], "--min-workers 3 and --max-workers 2", 2),
        (&["--workers", "2", "--min-workers", "3"], "--workers 2 is below --min-workers 3", 2),
        (&["--lr", "NaN"], "--lr NaN", 2),
        (&["--batch", "64", "--batch-max", "32"], "--batch-max 32 is below --batch 64", 2),
        (&["--momentum", "1"], "--momentum 1", 2),
        (&["--train-samples", "0"], "the job has no samples", 2),
        (&["--dataset", "nope"], "unknown data set \"nope\"", 1),
        (&["--store", "bogus://x"], "invalid store address", 1),
        (&["--store", "redis://:hunter2@127.0.0.1:1"], "--store redis://:***@127.0.0.1:1", 1),
        (&["--checkpoint-dir", "a-file/ckpt"], "a-file/ckpt: cannot create it", 1),
        (&["--checkpoint-dir", "a-file"], "a-file: not a directory", 1),
        (&["--report", "nowhere/run.json"], "--report nowhere/run.json: there is no directory nowhere", 1),
        (&["--plot", "a-file/run.svg"], "--plot a-file/run.svg: there is no directory a-file", 1),
        (&["--report", "."], "--report .: a directory, not a file", 1),
        (&["--decide-every-steps", "0"], "--decide-every-steps 0", 2),
        (&["--teacher-batch", "0"], "--teacher-batch 0: need at least 1", 2),
        (&["--max-teachers", "2"], "with --no-distill there are none", 2),
    ] {
        let out = small(dir.path(), flags).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{flags:?}: {err}");
        assert!(err.contains(want), "{flags:?}: {err}");
        assert!(!err.contains("hunter2") && !err.contains("panicked"), "{flags:?}: {err}");
        assert!(!dir.path().join(".edl/mnist/logs/worker-1.log").exists(), "{flags:?} started a worker");
    }
    // With teachers: a worker must give up on them before it is declared dead.
    let out =
        job(dir.path(), &["--policy", art::AUTOSCALE_WASM, "--teacher-wait-secs", "90"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--teacher-wait-secs 90 must be below --step-timeout-secs 60"), "{err}");
    assert!(!dir.path().join(".edl/mnist/logs/teacher-0.log").exists(), "a teacher started");
    // The teacher pool's bounds, and a pool without a store to be found in.
    for (flags, want) in [
        (&["--min-teachers", "3", "--max-teachers", "2"][..], "the pool needs 1 <= min <= max"),
        (&["--max-teachers", "2"], "--max-teachers needs a shared --store"),
    ] {
        let args = [&["--policy", art::AUTOSCALE_WASM][..], flags].concat();
        let out = job(dir.path(), &args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {err}");
        assert!(err.contains(want), "{flags:?}: {err}");
        assert!(!dir.path().join(".edl/mnist/logs/teacher-0.log").exists(), "{flags:?}: a teacher started");
    }
}

/// Slurm's client missing (no `sbatch` on the PATH): the job's error says
/// why its workers could not start, not only that none joined.
#[test]
fn a_job_whose_workers_cannot_start_says_why_in_its_error() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("no-slurm");
    std::fs::create_dir(&empty).unwrap();
    let out = small(dir.path(), &["--scaler", "slurm"]).env("PATH", &empty).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("no worker joined the job; the scaler could not start worker 1: sbatch"), "{err}");
    assert_eq!(err.matches("No such file or directory").count(), 1, "said once: {err}");
}

#[test]
fn a_second_coordinator_of_the_same_job_is_refused_naming_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = small(dir.path(), &["--epochs", "50", "--step-delay-ms", "20"]).spawn().unwrap();
    let rx = lines(&mut first);
    let mut seen = Vec::new();
    wait_for(&rx, "scale", &mut seen, Duration::from_secs(120));
    let out = small(dir.path(), &[]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let _ = first.kill();
    let _ = first.wait();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("already run by another coordinator") && err.contains(&format!("pid {}", first.id())),
        "{err}"
    );
}

#[test]
fn a_rerun_after_the_final_checkpoint_only_reports_and_other_data_flags_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (status, out) = run_to_end(small(dir.path(), &["--checkpoint-every", "3"]));
    assert!(status.success(), "{out}");
    let steps = report(dir.path())["steps"].as_u64().unwrap();
    // Killed after the final checkpoint, before the report: no report, no
    // completion mark. The rerun resumes at the end and trains nothing again.
    let ckpt = dir.path().join(".edl/mnist/checkpoints");
    std::fs::remove_file(ckpt.join("complete.json")).unwrap();
    std::fs::remove_file(dir.path().join("report.json")).unwrap();
    // Another seed walks another permutation: refused, naming the flag.
    let (status, out) = run_to_end(small(dir.path(), &["--seed", "2"]));
    assert!(!status.success(), "{out}");
    assert!(out.contains("was made with --seed 1 (this run: 2)"), "{out}");
    let (status, out) = run_to_end(small(dir.path(), &["--train-samples", "360"]));
    assert!(!status.success(), "{out}");
    assert!(out.contains("samples (--samples, --train-samples) 400 (this run: 360)"), "{out}");
    std::fs::create_dir(ckpt.join(".tmp-step-0000000099-1")).unwrap();
    let (status, out) = run_to_end(small(dir.path(), &[]));
    assert!(status.success(), "{out}");
    assert!(out.contains("left by an interrupted checkpoint write"), "{out}");
    let r = report(dir.path());
    assert_eq!(r["resumed_from_step"].as_u64(), Some(steps), "{out}");
    assert_eq!(r["timeline"].as_array().unwrap().len(), 0, "no step was trained again: {out}");
    assert_eq!(r["epochs"].as_array().unwrap().len(), 1);
    assert!(ckpt.join("complete.json").exists());
}

#[test]
fn a_failed_job_still_writes_a_report_saying_why() {
    let dir = tempfile::tempdir().unwrap();
    let (status, out) = run_to_end(small(
        dir.path(),
        &["--transform", art::HOSTILE_TRANSFORM_WASM, "--transform-config", "mode=nan"],
    ));
    assert!(!status.success(), "{out}");
    let r = report(dir.path());
    assert_eq!(r["status"], "failed");
    assert!(r["error"].as_str().unwrap().contains("is not finite"), "{r}");
}

#[test]
fn a_job_that_fails_midway_reports_and_draws_what_it_did_until_then() {
    let dir = tempfile::tempdir().unwrap();
    // 10 steps an epoch; the adapter asks for more rows than there are at step 15.
    let flags = ["--epochs", "3", "--adapter", art::HOSTILE_ADAPTER_WASM, "--plot", "run.svg"];
    let config = ["--adapter-config", "mode=huge-batch", "--adapter-config", "from=15"];
    let (status, out) = run_to_end(small(dir.path(), &[&flags[..], &config[..]].concat()));
    assert!(!status.success(), "{out}");
    let r = report(dir.path());
    assert_eq!(r["status"], "failed", "{r}");
    assert!(r["error"].as_str().unwrap().contains("above the 400 training samples"), "{r}");
    // What it did until then: its steps, its first epoch, its start, the
    // policy's decisions; no final checkpoint.
    let steps: Vec<u64> =
        r["timeline"].as_array().unwrap().iter().map(|s| s["step"].as_u64().unwrap()).collect();
    assert!((10..=16).contains(&steps.len()) && steps.windows(2).all(|w| w[1] == w[0] + 1), "{steps:?}");
    assert_eq!(r["epochs"].as_array().unwrap().len(), 1, "{r}");
    assert_eq!(r["scale_events"][0]["from"], 0, "{r}");
    assert!(!r["policy_decisions"].as_array().unwrap().is_empty(), "{r}");
    assert!(r.get("final_checkpoint").is_none(), "{r}");
    let svg = std::fs::read_to_string(dir.path().join("run.svg")).expect("the plot is drawn");
    assert!(svg.contains("(failed)"), "{svg}");
    // The report is a trace its policy replays.
    let trace = dir.path().join("report.json");
    let replay = Command::new(env!("CARGO_BIN_EXE_edl-runtime"))
        .args(["plugin", "replay", "--policy", art::AUTOSCALE_WASM, "--trace"])
        .arg(&trace)
        .arg("--plugin-cache")
        .arg(dir.path().join("plugin-cache"))
        .output()
        .unwrap();
    assert!(replay.status.success(), "{}", String::from_utf8_lossy(&replay.stderr));
}

/// A job with two teachers, one worker and a hold policy, long enough to be
/// interfered with; returns it, its output and its teachers' pids.
fn job_with_two_teachers(
    dir: &Path,
) -> (std::process::Child, std::sync::mpsc::Receiver<String>, Vec<String>, Vec<u32>) {
    let mut c = job(
        dir,
        &[
            "--policy",
            art::HOSTILE_POLICY_WASM,
            "--policy-config",
            "mode=hold",
            "--teachers",
            "2",
            "--epochs",
            "50",
            "--step-delay-ms",
            "20",
            "--teacher-wait-secs",
            "3",
        ],
    )
    .spawn()
    .unwrap();
    let rx = lines(&mut c);
    let mut seen = Vec::new();
    wait_for(&rx, "scale", &mut seen, Duration::from_secs(120));
    let teachers: Vec<u32> = children(c.id())
        .into_iter()
        .filter(|(_, cmd)| cmd.contains(" teacher "))
        .map(|(pid, _)| pid)
        .collect();
    assert_eq!(teachers.len(), 2, "{}", seen.join("\n"));
    (c, rx, seen, teachers)
}

fn signal(sig: &str, pid: u32) {
    assert!(Command::new("kill").args([sig, &pid.to_string()]).status().unwrap().success());
}

#[test]
fn losing_every_teacher_ends_the_job_at_once_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let (c, rx, mut seen, teachers) = job_with_two_teachers(dir.path());
    // One teacher dies: the job goes on with the other and says so.
    signal("-KILL", teachers[0]);
    wait_for(&rx, "new workers will not be given it", &mut seen, Duration::from_secs(120));
    let before = seen.len();
    // The last one dies: the job stops at once, naming why, without
    // retrying the step or blaming a worker.
    signal("-KILL", teachers[1]);
    let status = finish(c, rx, &mut seen);
    let out = seen.join("\n");
    assert!(!status.success(), "{out}");
    assert!(out.contains("every teacher of the job has exited"), "{out}");
    assert!(out.contains("signal: 9"), "the teachers' end is named: {out}");
    assert!(!seen[before..].iter().any(|l| l.contains("not committed")), "no step retried: {out}");
    assert_eq!(report(dir.path())["status"], "failed");
}

#[test]
fn teachers_that_answer_nothing_end_the_job_after_one_wait() {
    let dir = tempfile::tempdir().unwrap();
    let (c, rx, mut seen, teachers) = job_with_two_teachers(dir.path());
    // Alive but silent (stopped): the worker's reader gives up after
    // --teacher-wait-secs, and the coordinator does not retry what every
    // worker would fail the same way.
    for t in &teachers {
        signal("-STOP", *t);
    }
    let status = finish(c, rx, &mut seen);
    for t in &teachers {
        let _ = Command::new("kill").args(["-KILL", &t.to_string()]).status();
    }
    let out = seen.join("\n");
    assert!(!status.success(), "{out}");
    assert!(out.contains("no teacher answered within 3s"), "{out}");
    assert!(!out.contains("not committed"), "no step retried: {out}");
}

#[test]
fn a_second_coordinator_on_another_host_sharing_the_store_is_refused_by_the_lease() {
    // Two directories stand for two hosts: no shared lock file, one Redis.
    let redis = RedisServer::start();
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let url = redis.url();
    // The job's secret, handed to both hosts.
    let secret = a.path().join("job.secret");
    let secret = secret.to_str().unwrap();
    let shared = ["--store", url.as_str(), "--job", "leased"];
    let first_flags =
        [&shared[..], &["--epochs", "50", "--step-delay-ms", "20", "--secret-file", secret]].concat();
    let mut first = small(a.path(), &first_flags).spawn().unwrap();
    let rx = lines(&mut first);
    let mut seen = Vec::new();
    wait_for(&rx, "scale", &mut seen, Duration::from_secs(120));
    let out = small(b.path(), &[&shared[..], &["--secret-file", secret]].concat()).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("already run by another coordinator") && err.contains("holds its lease"), "{err}");
    assert!(err.contains(&format!("pid {} on ", first.id())), "{err}");
    // Without the job's secret (a new one of its own) it cannot read who
    // holds the lease, and is refused all the same, saying why.
    let out = small(b.path(), &shared).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("whose record does not verify") && err.contains("another --secret-file"), "{err}");
    // The refused coordinator changed nothing: the first one runs on.
    std::thread::sleep(Duration::from_millis(300));
    assert!(first.try_wait().unwrap().is_none(), "the first coordinator is still running");
    let _ = first.kill();
    let _ = first.wait();
}

#[test]
fn a_finished_job_gives_its_lease_up() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let url = redis.url();
    let args = ["--store", url.as_str(), "--job", "released"];
    let (status, out) = run_to_end(small(dir.path(), &args));
    assert!(status.success(), "{out}");
    // Another host can run the job's next round at once.
    let other = tempfile::tempdir().unwrap();
    let (status, out) = run_to_end(small(other.path(), &args));
    assert!(status.success(), "{out}");
}

#[test]
fn a_coordinator_whose_lease_is_taken_stops_instead_of_running_on() {
    use edl_runtime::store::{AnyStore, Store, keys};
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let url = redis.url();
    let args = ["--store", url.as_str(), "--job", "taken", "--epochs", "200", "--step-delay-ms", "20"];
    let mut first = small(dir.path(), &args).spawn().unwrap();
    let rx = lines(&mut first);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(120));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let store = rt.block_on(async { AnyStore::open(&url) }).unwrap();
    let key = keys::coordinator("taken");
    let other = br#"{"host":"elsewhere","pid":1}"#;
    // A store writer without the job's secret plants a lease record: it
    // holds nothing, and the job goes on past another epoch.
    rt.block_on(store.put(&key, other, Some(Duration::from_secs(60)))).unwrap();
    wait_for(&rx, "epoch     2 done", &mut seen, Duration::from_secs(120));
    // Another coordinator of the job (it knows the secret) takes the lease.
    let secret =
        edl_runtime::worker::session::read_secret_file(&dir.path().join(".edl/taken/secret")).unwrap();
    let sealed = edl_runtime::leader::seal::RecordKey::job_records(&secret).seal(&key, other);
    rt.block_on(store.put(&key, &sealed, Some(Duration::from_secs(60)))).unwrap();
    let status = finish(first, rx, &mut seen);
    let text = seen.join("\n");
    assert!(!status.success(), "{text}");
    let r = report(dir.path());
    assert!(r["error"].as_str().unwrap().contains("another coordinator took the job's lease"), "{r}");
}

#[test]
fn a_coordinator_that_cannot_reach_its_store_stops_when_its_lease_is_over() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let url = redis.url();
    let args = ["--store", url.as_str(), "--job", "cut-off", "--epochs", "200", "--step-delay-ms", "20"];
    let mut first = small(dir.path(), &args).spawn().unwrap();
    let rx = lines(&mut first);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(120));
    // The store goes silent (no error, no answer): the coordinator cannot
    // renew its lease, and training itself needs no store.
    redis.freeze(true);
    let status = finish(first, rx, &mut seen);
    redis.freeze(false);
    let text = seen.join("\n");
    assert!(!status.success(), "{text}");
    let r = report(dir.path());
    let e = r["error"].as_str().unwrap_or_else(|| panic!("{r}\n{text}"));
    assert!(e.contains("fenced: the job's lease could not be renewed"), "{r}");
}

#[test]
fn two_thousand_idle_and_trickling_connections_do_not_stop_a_running_job() {
    use std::io::Write;
    use std::net::TcpStream;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Long enough never to end on its own while the connections are opened,
    // however loaded the machine: it is stopped once it has trained on.
    let mut c =
        small(d, &["--epochs", "10000", "--min-workers", "2", "--max-workers", "2", "--step-delay-ms", "40"]);
    let mut child = c.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, "workers join with", &mut seen, Duration::from_secs(120));
    let (control, rendezvous) = coordinator_note(&seen);
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(120));

    // A thousand connections on each port: half say nothing, half send a
    // byte now and then, as a handshake that never ends would.
    let mut idle = Vec::new();
    let mut trickling = Vec::new();
    let mut failed = std::collections::BTreeMap::<String, usize>::new();
    for (i, addr) in std::iter::repeat_n([&control, &rendezvous], 500).flatten().enumerate() {
        for _ in 0..2 {
            // A connect the loaded machine's backlog turned away is tried again.
            let tried = (0..5).find_map(|t| {
                std::thread::sleep(Duration::from_millis(50 * t));
                TcpStream::connect(addr.as_str())
                    .map_err(|e| *failed.entry(e.to_string()).or_default() += 1)
                    .ok()
            });
            let Some(s) = tried else { continue };
            if i % 2 == 0 { idle.push(s) } else { trickling.push(s) }
        }
    }
    let opened = idle.len() + trickling.len();
    assert!(opened >= 1900, "{opened} connections opened; connects that failed: {failed:?}");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let dripping = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for s in &mut trickling {
                    let _ = s.write_all(b"\x01");
                }
                std::thread::sleep(Duration::from_millis(300));
            }
        })
    };
    // The job trains on through them: two more epochs, each exactly once,
    // then it stops with notice as it would have.
    let flooded = seen.len();
    wait_for(&rx, " done", &mut seen, Duration::from_secs(120));
    wait_for(&rx, " done", &mut seen, Duration::from_secs(120));
    let term = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(term.success());
    let status = finish(child, rx, &mut seen);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    dripping.join().unwrap();
    drop(idle);
    let out = seen.join("\n");
    assert_eq!(status.code(), Some(143), "{out}");
    let during = seen[flooded..]
        .iter()
        .filter(|l| l.contains(" done: 400 samples committed, 0 duplicates, 0 missing"))
        .count();
    assert!(during >= 2, "epochs trained while the connections were open: {during}\n{out}");
}

#[test]
fn a_standby_coordinator_waits_and_takes_the_job_over_when_the_active_one_dies() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    let checkpoints = dir.path().join("checkpoints");
    let url = redis.url();
    let checkpoints = checkpoints.to_str().unwrap();
    let args = [
        "--store",
        url.as_str(),
        "--job",
        "standby",
        "--epochs",
        "6",
        "--step-delay-ms",
        "40",
        "--checkpoint-every-steps",
        "5",
        "--checkpoint-dir",
        checkpoints,
    ];
    let mut active = small(&a, &args).spawn().unwrap();
    let rx = lines(&mut active);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(120));
    // A second coordinator of the job: a standby, not refused.
    let mut standby = small(&b, &[&args[..], &["--standby"]].concat()).spawn().unwrap();
    let rx_b = lines(&mut standby);
    let mut seen_b = Vec::new();
    wait_for(&rx_b, "standby", &mut seen_b, Duration::from_secs(120));
    assert!(seen_b.last().unwrap().contains("waiting to take it over"), "{seen_b:?}");
    // The active one dies at once (its workers with it); the standby takes
    // the job over from what the store and the checkpoints hold.
    signal("-KILL", active.id());
    let _ = active.wait();
    let status = finish(standby, rx_b, &mut seen_b);
    let out = seen_b.join("\n");
    assert!(status.success(), "{out}");
    assert!(out.contains("resuming job \"standby\""), "{out}");
    // The autoscale policy's search goes on from the checkpoint's memory.
    assert!(out.contains("the policy went on with its memory of step"), "{out}");
    let r = report(&b);
    assert!(r["resumed_from_step"].as_u64().is_some_and(|s| s >= 5), "{r}");
    assert_exactly_once(&r, 6, 400);
}

/// A worker told to go (SIGTERM, as a scheduler's preemption sends) leaves
/// at the next step boundary as a planned scale-in: no step is redone, no
/// sample lost, and the report names the notice.
#[test]
fn a_worker_told_to_go_by_sigterm_leaves_at_a_boundary_without_a_redone_step() {
    let dir = tempfile::tempdir().unwrap();
    let hold = ["--policy", art::HOSTILE_POLICY_WASM, "--policy-config", "mode=hold"];
    let bounds = ["--workers", "3", "--min-workers", "2", "--max-workers", "3", "--epochs", "3"];
    let mut c =
        small(dir.path(), &[&hold[..], &bounds[..], &["--step-delay-ms", "30"]].concat()).spawn().unwrap();
    let rx = lines(&mut c);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(120));
    let worker_2 = children(c.id())
        .into_iter()
        .find(|(_, cmd)| cmd.contains(" --id 2"))
        .unwrap_or_else(|| panic!("worker 2 among {:?}", children(c.id())))
        .0;
    signal("-TERM", worker_2);
    wait_for(&rx, "left with notice (SIGTERM)", &mut seen, Duration::from_secs(60));
    let status = finish(c, rx, &mut seen);
    let out = seen.join("\n");
    assert!(status.success(), "{out}");
    let r = report(dir.path());
    assert_exactly_once(&r, 3, 400);
    let events = r["scale_events"].as_array().unwrap();
    let left: Vec<&serde_json::Value> = events
        .iter()
        .filter(|e| e["reason"].as_str().unwrap().contains("worker 2 left with notice (SIGTERM)"))
        .collect();
    assert_eq!(left.len(), 1, "{events:?}");
    assert_eq!((left[0]["from"].as_u64(), left[0]["to"].as_u64()), (Some(3), Some(2)), "{events:?}");
    // Nothing was lost: no step failed, no worker replaced.
    assert!(!events.iter().any(|e| e["reason"].as_str().unwrap().contains("lost")), "{events:?}");
    assert_eq!(r["workers_started"].as_array().unwrap().len(), 3, "{r}");
}

/// Workers asked for that never join before the job ends are said, each
/// with where it stood, not lost in a "0 resizes" summary.
#[test]
fn a_job_that_ends_before_its_new_workers_join_says_so() {
    let dir = tempfile::tempdir().unwrap();
    // Worker 1 runs; any later one never gets as far as connecting.
    let template = "if [ {id} -ge 2 ]; then exec sleep 600; fi; exec {program}";
    let args = ["--scaler", "command", "--worker-command", template, "--hosts", "here:3"];
    let bounds = ["--workers", "1", "--min-workers", "1", "--max-workers", "2", "--step-delay-ms", "20"];
    let mut c = small(dir.path(), &[&args[..], &bounds[..], &["--report", "report.json"]].concat());
    let mut child = c.stdout(std::process::Stdio::piped()).spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    let status = finish(child, rx, &mut seen);
    let out = seen.join("\n");
    assert!(status.success(), "{out}");
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("report.json")).unwrap()).unwrap();
    assert!(r["workers_started"].as_array().unwrap().len() >= 2, "the policy asked for a second worker: {r}");
    assert!(out.contains("worker 2 was still starting when the job ended; stopped unused"), "{out}");
    assert_eq!(r["workers_unused"], serde_json::json!([{"id": 2, "stage": "still starting"}]), "{r}");
}

/// A small job whose policy holds its size, its workers started by the
/// command `template` on `slots` slots of this host, with `extra` flags.
fn held_by_command(dir: &Path, template: &str, slots: u32, extra: &[&str]) -> Command {
    let hosts = format!("here:{slots}");
    let mut args = vec!["--policy", art::HOSTILE_POLICY_WASM, "--policy-config", "mode=hold"];
    args.extend(["--scaler", "command", "--worker-command", template, "--hosts", &hosts]);
    args.extend_from_slice(extra);
    small(dir, &args)
}

/// The other two notices a cloud or a watcher gives: a file that appears
/// (`$EDL_NOTICE_FILE`) and a command that starts to succeed
/// (`$EDL_NOTICE_COMMAND`, as `curl -sf` of a spot-instance notice does).
/// Each worker has its own, set by the command scaler's template.
#[test]
fn a_worker_told_to_go_by_a_notice_file_or_a_notice_command_leaves_without_a_redone_step() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let template = format!(
        "EDL_NOTICE_FILE={d}/notice-{{id}} SPOT={d}/spot-{{id}} EDL_NOTICE_COMMAND='test -e \"$SPOT\"' \
         EDL_NOTICE_EVERY_SECS=0.2 {{program}}"
    );
    let bounds = ["--workers", "3", "--min-workers", "1", "--max-workers", "3", "--epochs", "6"];
    let args = [&bounds[..], &["--step-delay-ms", "30"]].concat();
    let mut c = held_by_command(dir.path(), &template, 3, &args).spawn().unwrap();
    let rx = lines(&mut c);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(120));
    std::fs::write(dir.path().join("notice-2"), b"").unwrap();
    wait_for(&rx, "worker 2 left with notice (notice file ", &mut seen, Duration::from_secs(60));
    std::fs::write(dir.path().join("spot-1"), b"").unwrap();
    wait_for(&rx, "worker 1 left with notice (notice command ", &mut seen, Duration::from_secs(60));
    let status = finish(c, rx, &mut seen);
    let out = seen.join("\n");
    assert!(status.success(), "{out}");
    let r = report(dir.path());
    assert_exactly_once(&r, 6, 400);
    let events = r["scale_events"].as_array().unwrap();
    // Nothing was lost: no step failed, no worker replaced.
    assert!(!events.iter().any(|e| e["reason"].as_str().unwrap().contains("lost")), "{events:?}");
    assert_eq!(r["workers_started"].as_array().unwrap().len(), 3, "{r}");
}

#[test]
fn a_sole_worker_told_to_go_checkpoints_and_if_lost_before_handing_over_the_job_restarts_from_there() {
    // The only worker is told to go and a replacement is started; before
    // the replacement is given the state, the worker dies. The replacement
    // has nothing to take the state from: the job goes back to its newest
    // checkpoint instead of forming a generation that holds no state.
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let template = format!(
        "touch {d}/started-{{id}}; while [ {{id}} -gt 1 ] && [ ! -e {d}/go-{{id}} ]; do sleep 0.05; done; \
         exec env EDL_NOTICE_FILE={d}/notice-{{id}} {{program}}"
    );
    let bounds = ["--workers", "1", "--min-workers", "1", "--max-workers", "2", "--epochs", "20"];
    // Only the kill below ends worker 1: no lease or step bound runs out first.
    let bounds_in_time =
        ["--worker-lease-secs", "600", "--step-timeout-secs", "600", "--step-delay-ms", "40"];
    let args = [&bounds[..], &bounds_in_time[..]].concat();
    let mut c = held_by_command(dir.path(), &template, 2, &args).spawn().unwrap();
    let coordinator = c.id();
    let rx = lines(&mut c);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(120));
    std::fs::write(dir.path().join("notice-1"), b"").unwrap();
    wait_for(&rx, "worker 1 was told to go", &mut seen, Duration::from_secs(60));
    // It holds the only state: that state goes to a checkpoint at once.
    let saved = "the state of step ";
    wait_for(&rx, saved, &mut seen, Duration::from_secs(60));
    let step_after = |line: &str, after: &str| -> u64 {
        let rest = line.split(after).nth(1).unwrap_or_default();
        rest.split(|c: char| !c.is_ascii_digit()).next().unwrap_or_default().parse().unwrap()
    };
    let saved_at = step_after(seen.last().unwrap(), saved);
    until("the replacement to be started", Duration::from_secs(120), || {
        dir.path().join("started-2").exists()
    });
    let is_worker = |cmd: &str, id: &str| {
        let words: Vec<&str> = cmd.split_whitespace().collect();
        words.contains(&"worker") && words.windows(2).any(|w| w == ["--id", id])
    };
    let (first, _) = children(coordinator)
        .into_iter()
        .find(|(_, cmd)| is_worker(cmd, "1"))
        .expect("worker 1 among the coordinator's children");
    // Frozen, worker 1 commits nothing more: the replacement cannot be
    // admitted before it dies.
    // SAFETY: kill(2) has no memory-safety preconditions; `first` was
    // just read as a running child of the job's coordinator.
    unsafe { libc::kill(first as i32, libc::SIGSTOP) };
    std::fs::write(dir.path().join("go-2"), b"").unwrap();
    until("the replacement to be ready", Duration::from_secs(120), || {
        walkdir::WalkDir::new(dir.path())
            .into_iter()
            .flatten()
            .find(|e| e.path().ends_with("logs/worker-2.log"))
            .and_then(|e| std::fs::read_to_string(e.path()).ok())
            .is_some_and(|t| t.contains("worker 2: ready"))
    });
    // SAFETY: as above; stopped since, it cannot have exited, so the pid
    // still names worker 1.
    unsafe { libc::kill(first as i32, libc::SIGKILL) };
    let status = finish(c, rx, &mut seen);
    let out = seen.join("\n");
    assert!(status.success(), "{out}");
    // (Worker 2's readiness and worker 1's end reach the coordinator on
    // two connections: either may be heard first.)
    let joining =
        "no worker holding the state is left (1 joining have none); restarting from the newest checkpoint";
    assert!(
        out.contains(joining) || out.contains("no worker left; restarting from the newest checkpoint"),
        "{out}"
    );
    // The restart lost no more than the steps since the notice's checkpoint.
    let restart = seen.iter().find(|l| l.contains("restarting from step ")).expect(&out);
    assert!(step_after(restart, "restarting from step ") >= saved_at, "{out}");
    assert_exactly_once(&report(dir.path()), 20, 400);
}

/// A coordinator whose loop does not come back to its workers (here a
/// native policy, trusted and called without a deadline, that never
/// returns from `decide`) ends once `--loop-stall-secs` is over, saying
/// where its thread is, rather than hold the job, its lease and its workers
/// for ever while it trains nothing; its report says the job failed and why.
#[test]
fn a_coordinator_whose_loop_stalls_ends_saying_where_its_thread_is() {
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--no-distill", "--epochs", "2", "--allow-native", "--policy", art::SPIN_SO];
    let mut cmd = job(dir.path(), &flags);
    cmd.args(["--policy-config", "spin=true", "--loop-stall-secs", "2"]);
    let (status, text) = run_to_end(cmd);
    assert_eq!(status.code(), Some(1), "{text}");
    assert!(text.contains("the coordinator's loop has not come back to its workers"), "{text}");
    assert!(
        text.contains("(--loop-stall-secs 2)") && text.contains("its thread is running (computing"),
        "{text}"
    );
    let r = report(dir.path());
    assert_eq!(r["status"], "failed", "{r}");
    assert!(r["error"].as_str().unwrap().contains("--loop-stall-secs 2"), "{r}");
}
