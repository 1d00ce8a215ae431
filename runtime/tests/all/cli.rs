//! The `edl-runtime` command line, run as a user would.

use edl_plugin_artifacts as art;
use std::process::Command;

fn edl(args: &[&str], cache: &std::path::Path) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_edl-runtime"))
        .args(args)
        .arg("--plugin-cache")
        .arg(cache)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn inspect_describes_a_plugin_and_its_cache_state() {
    let cache = tempfile::tempdir().unwrap();
    let (ok, out, err) = edl(&["plugin", "inspect", art::AUTOSCALE_WASM], cache.path());
    assert!(ok, "{err}");
    for want in [
        "world:       scaling-policy",
        "interface:   edl:plugins@0.1.0",
        "edl-plugin-autoscale 0.1.0",
        "edl:plugins/policy@0.1.0",
        "cached:      no",
        // The keys its configuration takes, with their defaults, as its init reads them.
        "config:      --policy-config KEY=VALUE, for",
        "  threshold = 0.1 (f64)",
        "  window = 3 (usize)",
    ] {
        assert!(out.contains(want), "missing {want:?} in\n{out}");
    }
    let (ok, out, err) = edl(&["plugin", "inspect", art::TEACHER_AUTOSCALE_WASM], cache.path());
    assert!(ok && out.contains("config:      --teacher-policy-config KEY=VALUE, for"), "{out}{err}");
    assert!(out.contains("  settle-secs = 10 (f64)") && out.contains("  shrink-after = 3 (u32)"), "{out}");
    let (_, again, _) = edl(&["plugin", "inspect", art::AUTOSCALE_WASM], cache.path());
    assert!(again.contains("cached:      yes"), "{again}");
    let (ok, out, err) = edl(&["plugin", "inspect", art::AUGMENT_SO], cache.path());
    assert!(ok, "{err}");
    assert!(out.contains("world:       reader-transform") && out.contains("native"), "{out}");
}

#[test]
fn inspect_fails_with_one_line_for_what_is_not_a_plugin() {
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let core = dir.path().join("core.wasm");
    std::fs::write(&core, b"\0asm\x01\0\0\0").unwrap();
    let text = dir.path().join("notes.txt");
    std::fs::write(&text, "hello").unwrap();
    for (file, want) in [(core.as_path(), "core WebAssembly module"), (text.as_path(), "not a plugin")] {
        let (ok, out, err) = edl(&["plugin", "inspect", file.to_str().unwrap()], cache.path());
        assert!(!ok);
        assert!(out.is_empty());
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 1, "{err}");
        assert!(lines[0].starts_with("error: ") && lines[0].contains(want), "{err}");
    }
}

#[test]
fn replay_prints_a_policys_decisions_over_a_trace() {
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.jsonl");
    let mut lines = String::from("# step, world size, throughput\n");
    for i in 0..6u64 {
        lines += &format!(
            "{{\"step\": {}, \"world_size\": 2, \"min_workers\": 1, \"max_workers\": 4, \"free_slots\": 2, \"throughput\": 1900.0}}\n",
            i * 50
        );
    }
    std::fs::write(&trace, lines).unwrap();
    let (ok, out, err) = edl(
        &[
            "plugin",
            "replay",
            "--policy",
            art::SCHEDULE_WASM,
            "--trace",
            trace.to_str().unwrap(),
            "--config",
            "every=100",
            "--json",
        ],
        cache.path(),
    );
    assert!(ok, "{err}");
    let actions: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(actions.len(), 6);
    assert_eq!(actions[2]["actions"], serde_json::json!([{"scale-out": 1}]), "{out}");
    assert_eq!(actions[1]["actions"], serde_json::json!(["hold"]), "{out}");
    // What it came to, as `simulate` says it.
    assert!(
        err.contains("6 decisions of edl-plugin-schedule over")
            && err.contains(": 2 would resize (2 grow, 0 shrink); the last leaves 2 workers"),
        "{err}"
    );
    // A misspelt field is named, not read as 0.
    std::fs::write(&trace, "{\"step\": 1, \"world_size\": 2, \"thruput\": 1900.0}\n").unwrap();
    let (ok, _, err) = edl(
        &["plugin", "replay", "--policy", art::SCHEDULE_WASM, "--trace", trace.to_str().unwrap()],
        cache.path(),
    );
    assert!(!ok);
    assert!(
        err.contains("trace.jsonl:1") && err.contains("unknown field `thruput` of a ClusterView"),
        "{err}"
    );

    std::fs::write(&trace, "{\"step\": 1}\nnot json\n").unwrap();
    let (ok, _, err) = edl(
        &["plugin", "replay", "--policy", art::SCHEDULE_WASM, "--trace", trace.to_str().unwrap()],
        cache.path(),
    );
    assert!(!ok);
    assert!(err.contains("trace.jsonl:2"), "{err}");
}

#[test]
fn replay_reads_teacher_views_and_refuses_a_field_it_does_not_know() {
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("teachers.jsonl");
    // Students waiting on one busy teacher, twice.
    let view = r#"{"step": 10, "wait_share": 0.5, "student_world_size": 4, "student_world_planned": 4, "teacher_count": 1, "min_teachers": 1, "max_teachers": 4, "in_flight_per_teacher": 4, "secs_since_change": 30.0, "teachers": [{"id": 0, "utilisation": 0.95, "rows_per_sec": 600.0}]}"#;
    std::fs::write(&trace, format!("# two looks\n{view}\n{view}\n")).unwrap();
    let args = [
        "plugin",
        "replay",
        "--teacher-policy",
        art::TEACHER_AUTOSCALE_WASM,
        "--trace",
        trace.to_str().unwrap(),
    ];
    let (ok, out, err) = edl(&args, cache.path());
    assert!(ok, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(lines[0].contains("teachers   1 ->   2") && lines[0].contains("students waited  50%"), "{out}");
    assert!(
        err.contains("2 decisions of edl-plugin-teacher-autoscale") && err.contains("2 would change"),
        "{err}"
    );
    // A misspelt field is named, not read as 0.
    std::fs::write(&trace, view.replace("wait_share", "wait_shar")).unwrap();
    let (ok, _, err) = edl(&args, cache.path());
    assert!(!ok);
    assert!(err.contains("teachers.jsonl:1") && err.contains("unknown field `wait_shar`"), "{err}");
    // A report of a job without a teacher pool: said so.
    std::fs::write(&trace, r#"{"job": "j", "timeline": []}"#).unwrap();
    let (ok, _, err) = edl(&args, cache.path());
    assert!(!ok && err.contains("a report without teacher decisions"), "{err}");
    // Both kinds at once, or neither: refused by the command line.
    let (ok, _, err) = edl(&["plugin", "replay", "--trace", trace.to_str().unwrap()], cache.path());
    assert!(!ok && err.contains("--policy"), "{err}");
}

#[test]
fn the_main_command_runs_a_policy_against_the_simulated_cluster() {
    let cache = tempfile::tempdir().unwrap();
    let (ok, out, err) = edl(
        &[
            "simulate",
            "--policy",
            art::AUTOSCALE_WASM,
            "--adapter",
            art::DYNAMIC_BATCH_WASM,
            "--decisions",
            "60",
            "--max-workers",
            "8",
        ],
        cache.path(),
    );
    assert!(ok, "{err}");
    assert!(out.contains("3 -> 4 workers") && out.contains("5 -> 4 workers"), "{out}");
    assert!(out.contains("replace(1)"), "{out}");
    assert!(out.contains("final world size 4"), "{out}");
}

#[test]
fn devices_reports_what_the_machine_has() {
    let cache = tempfile::tempdir().unwrap();
    let (ok, out, err) = edl(&["devices"], cache.path());
    assert!(ok, "{err}");
    assert!(out.starts_with("cpu "), "{out}");
    assert!(out.contains("\ncuda") && out.contains("\nnvrtc") && out.contains("\nnccl"), "{out}");
}

#[test]
fn replay_runs_a_scenario_and_draws_it() {
    let cache = tempfile::tempdir().unwrap();
    let out_dir = tempfile::tempdir().unwrap();
    let traces = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/traces");

    let svg = out_dir.path().join("straggler.svg");
    let trace = traces.join("straggler.json");
    let (ok, out, err) = edl(
        &[
            "plugin",
            "replay",
            "--policy",
            art::AUTOSCALE_WASM,
            "--trace",
            trace.to_str().unwrap(),
            "--json",
            "--plot",
            svg.to_str().unwrap(),
        ],
        cache.path(),
    );
    assert!(ok, "{err}");
    let decisions: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(decisions.len(), 60);
    let replaced: Vec<&serde_json::Value> =
        decisions.iter().filter(|d| d["actions"].to_string().contains("replace")).collect();
    assert_eq!(replaced.len(), 1, "one replacement of the slow worker: {out}");
    assert!(replaced[0]["step"].as_u64().unwrap() >= 600, "only after it turned slow");
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert!(picture.starts_with("<svg") && picture.contains("world size chosen by the policy"));
    assert!(picture.matches("<polyline").count() >= 3, "three curves drawn");

    // Capacity taken away: the job never holds more workers than offered.
    let trace = traces.join("capacity-drop.json");
    let (ok, out, err) = edl(
        &["plugin", "replay", "--policy", art::AUTOSCALE_WASM, "--trace", trace.to_str().unwrap(), "--json"],
        cache.path(),
    );
    assert!(ok, "{err}");
    let decisions: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let mut saw_drop = false;
    for d in &decisions {
        let (chosen, capacity) = (d["chosen"].as_u64().unwrap(), d["capacity"].as_u64().unwrap());
        assert!(chosen <= capacity, "{d}");
        saw_drop |= capacity == 3;
    }
    assert!(saw_drop);
    assert!(
        decisions.last().unwrap()["chosen"].as_u64().unwrap() > 3,
        "it grows again when capacity returns"
    );
}

#[test]
fn a_price_keeps_a_cost_aware_policy_small_in_replay_and_simulate() {
    let cache = tempfile::tempdir().unwrap();
    let trace = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/traces/priced.json");
    let final_size = |extra: &[&str]| {
        let mut args = vec![
            "plugin",
            "replay",
            "--policy",
            art::AUTOSCALE_WASM,
            "--policy-config",
            "value-per-hour=1",
            "--trace",
            trace.to_str().unwrap(),
            "--json",
        ];
        args.extend_from_slice(extra);
        let (ok, out, err) = edl(&args, cache.path());
        assert!(ok, "{err}");
        let last: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
        last["chosen"].as_u64().unwrap()
    };
    // The shipped trace's price keeps the job at one worker; free workers let it grow.
    assert_eq!(final_size(&[]), 1);
    assert!(final_size(&["--price", "0"]) > 1);

    let sim = |price: &str| {
        let (ok, out, err) = edl(
            &[
                "simulate",
                "--policy",
                art::AUTOSCALE_WASM,
                "--policy-config",
                "value-per-hour=1",
                "--price",
                price,
            ],
            cache.path(),
        );
        assert!(ok, "{err}");
        assert!(out.contains(&format!("at {price} per worker-hour")), "{out}");
        out
    };
    assert!(sim("1000").contains("final world size 1"));
    assert!(!sim("0").contains("final world size 1"));
    let (ok, _, err) = edl(&["simulate", "--policy", art::AUTOSCALE_WASM, "--price=-1"], cache.path());
    assert!(!ok && err.contains("--price -1"), "{err}");
    // Bounds a job refuses, refused alike (not simulated, nor clamped).
    for (bounds, want) in [
        (&["--min-workers", "5", "--max-workers", "2"][..], "--min-workers 5 and --max-workers 2"),
        (&["--workers", "9"], "--workers 9 is above --max-workers 4"),
    ] {
        let (ok, out, err) =
            edl(&[&["simulate", "--policy", art::AUTOSCALE_WASM][..], bounds].concat(), cache.path());
        assert!(!ok && err.contains(want) && !out.contains("simulated cluster"), "{out}{err}");
    }
}

/// `edl-runtime ARGS` in `dir`, output piped; (exit code, stdout, stderr).
fn edl_in(dir: &std::path::Path, args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_edl-runtime"))
        .current_dir(dir)
        .args(args)
        .arg("--plugin-cache")
        .arg(dir.join("plugin-cache"))
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// A refused command line: a usage error (status 2) whose message has every
/// one of `want`, and nothing started.
fn refused(args: &[&str], want: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let (code, out, err) = edl_in(dir.path(), args);
    assert_eq!(code, Some(2), "{args:?} was not refused: {out}{err}");
    for w in want {
        assert!(err.contains(w), "{args:?}: {w:?} missing from\n{err}");
    }
    assert!(!dir.path().join(".edl").exists(), "{args:?} started a job");
}

#[test]
fn without_a_terminal_the_job_prints_plain_progress_lines() {
    let dir = tempfile::tempdir().unwrap();
    let (code, out, err) = edl_in(
        dir.path(),
        &[
            "--policy",
            art::AUTOSCALE_WASM,
            "--dataset",
            "digits",
            "--train-samples",
            "400",
            "--epochs",
            "2",
            "--no-distill",
            "--max-workers",
            "1",
        ],
    );
    assert_eq!(code, Some(0), "{out}{err}");
    let lines: Vec<&str> = out.lines().collect();
    let epochs: Vec<usize> = (0..lines.len()).filter(|&i| lines[i].starts_with("epoch ")).collect();
    assert_eq!(epochs.len(), 2, "{out}");
    let progress = |from: usize, to: usize| {
        lines[from..to]
            .iter()
            .filter(|l| l.starts_with("progress  epoch ") && l.contains(" workers | "))
            .count()
    };
    // A line at the first step, and at least one in each epoch (its last
    // step's, at the latest): never only a bar nobody sees.
    assert!(progress(0, epochs[0]) >= 1, "no progress line in the first epoch:\n{out}");
    assert!(progress(epochs[0], epochs[1]) >= 1, "no progress line in the second epoch:\n{out}");
    assert!(lines.iter().any(|l| l.starts_with("scale ") && l.contains("0 -> 1 workers")), "{out}");
    assert!(out.contains("loss ") && out.contains("samples/s"), "{out}");
}

#[test]
fn launch_refuses_the_built_in_students_flags_naming_the_built_in_job() {
    for flag in [
        &["--hidden", "64"][..],
        &["--dataset", "digits"],
        &["--train-samples", "10"],
        &["--temperature", "2"],
        &["--alpha", "0.5"],
        &["--teacher-hidden", "32"],
        &["--teacher-epochs", "1"],
        &["--teacher-processes", "1"],
        &["--transform", "x.wasm"],
        &["--transform-config", "a=b"],
        &["--device", "cpu"],
        &["--step-delay-ms", "5"],
    ] {
        let name = flag[0];
        let args = [&["launch", "--samples", "8"][..], flag, &["--", "true"]].concat();
        // (`--transform` is `simulate`'s too, named after the built-in job.)
        let whose = format!("`{name}` is a flag of the built-in job (`edl-runtime [job flags]`)");
        refused(&args, &[&format!("unexpected argument '{name}'"), &whose, "not of `edl-runtime launch`"]);
    }
}

#[test]
fn launch_torchrun_refuses_the_job_flags_a_torchrun_script_does_not_use() {
    for flag in [
        &["--epochs", "2"][..],
        &["--batch", "8"],
        &["--checkpoint-dir", "ckpt"],
        &["--samples", "8"],
        &["--teachers", "127.0.0.1:8001"],
        &["--no-distill"],
        &["--adapter", "x.wasm"],
        &["--lr", "0.1"],
        &["--step-timeout-secs", "5"],
        &["--rendezvous-port", "7000"],
    ] {
        let name = flag[0];
        let args = [&["launch", "--torchrun"][..], flag, &["--", "true"]].concat();
        let what = format!("`{name}` is a flag of `edl-runtime launch` without --torchrun");
        refused(&args, &[&what, "`launch --torchrun` takes --job", "--decide-secs"]);
    }
    // Flags of a group across hosts, on a group on this host.
    refused(
        &["launch", "--torchrun", "--listen", "0.0.0.0", "--", "true"],
        &["`--listen` is for a torchrun group across hosts", "--scaler command or external"],
    );
    refused(
        &["launch", "--torchrun", "--nproc-per-node", "2", "--", "true"],
        &["`--nproc-per-node` is for a torchrun group across hosts"],
    );
    // A group on this host ends with its launcher: no store, no standby.
    refused(
        &["launch", "--torchrun", "--store", "redis://127.0.0.1:1", "--", "true"],
        &["`--store` is for a torchrun group across hosts"],
    );
    refused(
        &["launch", "--torchrun", "--standby", "--", "true"],
        &["`--standby` is for a torchrun group across hosts"],
    );
    refused(
        &["launch", "--torchrun", "--decide-every-steps", "4", "--", "true"],
        &["`--decide-every-steps`", "decides every --decide-secs seconds"],
    );
}

#[test]
fn a_flag_before_its_subcommand_is_refused_saying_where_it_goes() {
    refused(
        &["--max-workers", "8", "launch", "--samples", "8", "--", "true"],
        &["`--max-workers 8` goes after the subcommand: edl-runtime launch --max-workers 8 ..."],
    );
    refused(
        &["--policy", art::AUTOSCALE_WASM, "plugin", "replay", "--trace", "t.jsonl"],
        &["goes after the subcommand: edl-runtime plugin replay --policy"],
    );
    refused(
        &["--hidden", "64", "launch", "--samples", "8", "--", "true"],
        &[
            "`--hidden` is a flag of the built-in job (`edl-runtime [job flags]`), not of `edl-runtime launch`",
        ],
    );
    refused(
        &["--epochs", "2", "simulate"],
        &[
            "`--epochs` is a flag of the built-in job (`edl-runtime [job flags]`) and `edl-runtime launch`, not of `edl-runtime simulate`",
        ],
    );
    // The sandbox flags belong to every command, on either side of it.
    let cache = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_edl-runtime"))
        .args(["--no-plugin-cache", "plugin", "inspect", art::AUTOSCALE_WASM])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("cached:      cache disabled"));
    let (ok, out, err) = edl(&["plugin", "inspect", "--no-plugin-cache", art::AUTOSCALE_WASM], cache.path());
    assert!(ok && out.contains("cached:      cache disabled"), "{out}{err}");
}

#[test]
fn other_subcommands_refuse_flags_that_are_not_theirs_naming_whose_they_are() {
    refused(
        &["simulate", "--epochs", "2"],
        &[
            "`--epochs` is a flag of the built-in job (`edl-runtime [job flags]`) and `edl-runtime launch`, not of `edl-runtime simulate`",
        ],
    );
    refused(
        &["distill", "--hidden", "8"],
        &["`--hidden` is a flag of the built-in job", "not of `edl-runtime distill`"],
    );
    refused(
        &["teacher", "--model", "m.safetensors", "--teachers", "127.0.0.1:8001"],
        &[
            "`--teachers` is a flag of the built-in job (`edl-runtime [job flags]`), `edl-runtime launch` and `edl-runtime distill`, not of `edl-runtime teacher`",
        ],
    );
    refused(&["--samples", "8"], &["`--samples` is a flag of `edl-runtime launch`, not of the built-in job"]);
    refused(
        &["launch", "--samples", "4294967296", "--", "true"],
        &["--samples 4294967296: a job holds at most 4294967295 samples"],
    );
    refused(&["worker", "--coordinator", "127.0.0.1:1", "--epochs", "2"], &["not of `edl-runtime worker`"]);
}

#[test]
fn launch_takes_teacher_endpoints_not_a_count() {
    let dir = tempfile::tempdir().unwrap();
    let (code, _, err) = edl_in(
        dir.path(),
        &["launch", "--samples", "8", "--policy", art::AUTOSCALE_WASM, "--teachers", "2", "--", "true"],
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("--teachers 2: `launch` starts no teacher processes")
            && err.contains("--teacher-processes"),
        "{err}"
    );
    assert!(!dir.path().join(".edl").exists());
}

#[test]
fn a_launched_job_keeps_the_name_it_is_given() {
    // `.edl` a file: the job stops where it would create its directory,
    // which names the job.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(".edl"), b"").unwrap();
    let launch = |extra: &[&str]| {
        let args =
            [
                &[
                    "launch",
                    "--samples",
                    "8",
                    "--batch",
                    "4",
                    "--no-distill",
                    "--policy",
                    art::AUTOSCALE_WASM,
                ][..],
                extra,
                &["--", "true"],
            ]
            .concat();
        let (code, _, err) = edl_in(dir.path(), &args);
        assert_eq!(code, Some(1), "{err}");
        err
    };
    let err = launch(&["--job", "mnist"]);
    assert!(err.contains(".edl/mnist/checkpoints: cannot create it"), "{err}");
    let err = launch(&[]);
    assert!(err.contains(".edl/launch/checkpoints: cannot create it"), "the default name of launch: {err}");
}

#[test]
fn plugins_are_found_beside_the_installed_executable() {
    // An installation: bin/edl-runtime with plugins/ beside bin/, and
    // share/edl/plugins/.
    let root = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let bin = root.path().join("bin");
    std::fs::create_dir_all(bin.join("../plugins")).unwrap();
    std::fs::create_dir_all(root.path().join("share/edl/plugins")).unwrap();
    let exe = bin.join("edl-runtime");
    if std::fs::hard_link(env!("CARGO_BIN_EXE_edl-runtime"), &exe).is_err() {
        std::fs::copy(env!("CARGO_BIN_EXE_edl-runtime"), &exe).unwrap();
    }
    std::fs::copy(art::AUTOSCALE_WASM, root.path().join("plugins/autoscale.wasm")).unwrap();
    std::fs::copy(art::SCHEDULE_WASM, root.path().join("share/edl/plugins/schedule.wasm")).unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(&exe)
            .current_dir(elsewhere.path())
            .args(args)
            .arg("--plugin-cache")
            .arg(elsewhere.path().join("cache"))
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, out, err) = run(&["plugin", "inspect", "plugins/autoscale.wasm"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("edl-plugin-autoscale")
            && out.contains(&root.path().join("plugins").display().to_string()),
        "{out}"
    );
    let (ok, out, err) = run(&["simulate", "--policy", "plugins/schedule.wasm", "--decisions", "4"]);
    assert!(ok, "{err}");
    assert!(out.contains("edl-plugin-schedule"), "{out}");

    let (ok, _, err) = run(&["simulate", "--policy", "plugins/none.wasm"]);
    assert!(!ok);
    for place in [
        elsewhere.path().join("plugins/none.wasm"),
        bin.join("plugins/none.wasm"),
        root.path().join("plugins/none.wasm"),
        root.path().join("share/edl/plugins/none.wasm"),
    ] {
        assert!(err.contains(&place.display().to_string()), "{place:?} not named in {err}");
    }
}

#[test]
fn a_job_name_a_shell_or_a_path_would_read_is_refused_before_anything_starts() {
    for cmd in [&["launch", "--samples", "8"][..], &[], &["launch", "--torchrun"]] {
        for bad in ["x;touch /tmp/p;#", "../up", "a b"] {
            let args = [cmd, &["--job", bad, "--", "true"]].concat();
            let args: Vec<&str> = if cmd.is_empty() { vec!["--job", bad] } else { args };
            let dir = tempfile::tempdir().unwrap();
            let (code, out, err) = edl_in(dir.path(), &args);
            assert_eq!(code, Some(2), "{args:?}: {out}{err}");
            assert!(err.contains("use letters, digits, '.', '_' and '-'"), "{args:?}: {err}");
            assert!(
                !dir.path().join(".edl").exists() && !dir.path().join("up").exists(),
                "{args:?} started a job"
            );
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let (code, _, err) = edl_in(dir.path(), &["worker", "--coordinator", "127.0.0.1:9", "--job", "a;b"]);
    assert_eq!(code, Some(2), "{err}");
}

#[test]
fn a_launched_program_s_teacher_pool_needs_a_teacher_command_of_its_own_model() {
    let cache = tempfile::tempdir().unwrap();
    let launch = |extra: &[&str]| {
        let mut args = vec!["launch", "--samples", "10", "--store", "redis://127.0.0.1:1/"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--", "true"]);
        edl(&args, cache.path())
    };
    let (ok, _, err) = launch(&["--max-teachers", "2"]);
    assert!(!ok && err.contains("started by --teacher-command"), "{err}");
    let (ok, _, err) = launch(&["--teacher-command", "serve {model} {port}"]);
    assert!(!ok && err.contains("{model} is the built-in job's teacher model"), "{err}");
    let (ok, _, err) = launch(&["--teacher-command", "serve {port}", "--teachers", "a:1"]);
    assert!(!ok && err.contains("--teachers host:port,... names others"), "{err}");
    // Teachers in Kubernetes Pods: a pool's, with their command; not beside --teacher-command.
    let (ok, _, err) = launch(&["--teacher-kube-image", "triton", "--teacher-kube-command", "serve"]);
    assert!(!ok && err.contains("--max-teachers"), "{err}");
    let (ok, _, err) = launch(&["--teacher-kube-image", "triton", "--max-teachers", "2"]);
    assert!(!ok && err.contains("--teacher-kube-command"), "{err}");
    let both = ["--teacher-kube-image", "t", "--teacher-kube-command", "s", "--max-teachers", "2"];
    let (ok, _, err) = launch(&[&both[..], &["--teacher-command", "serve {port}"]].concat());
    assert!(!ok && err.contains("cannot be used with"), "{err}");
    let (ok, _, err) = launch(&["--teacher-kube-resource", "memory=1Gi"]);
    assert!(!ok && err.contains("--teacher-kube-image"), "{err}");
}

/// A job's report keeps every decision of its scaling policy, holds too,
/// with the view it was given; replayed as a trace, the same policy
/// answers each as it did in the job.
#[test]
fn a_job_s_report_keeps_every_policy_decision_and_replays_to_the_same_answers() {
    use crate::support::job::{GROWING, job, report};
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let out = job(d, &[&GROWING[..], &["--no-distill"]].concat()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r = report(d);
    let decisions = r["policy_decisions"].as_array().unwrap();
    let actions: Vec<serde_json::Value> = decisions.iter().map(|d| d["actions"].clone()).collect();
    assert!(actions.iter().any(|a| *a == serde_json::json!(["hold"])), "holds are kept: {actions:?}");
    assert!(actions.iter().any(|a| a.to_string().contains("scale-out")), "{actions:?}");
    assert!(decisions.iter().all(|d| d["view"]["max_workers"] == 3), "the views: {decisions:?}");
    let (ok, replayed, err) = edl(
        &[
            "plugin",
            "replay",
            "--policy",
            art::SCHEDULE_WASM,
            "--config",
            "every=8",
            "--trace",
            d.join("report.json").to_str().unwrap(),
            "--json",
        ],
        &d.join("plugin-cache"),
    );
    assert!(ok, "{err}");
    let again: Vec<serde_json::Value> = replayed
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["actions"].clone())
        .collect();
    assert_eq!(again, actions, "{replayed}");
    assert!(err.contains(&format!("{} decisions of edl-plugin-schedule", actions.len())), "{err}");
    // A report from before reports kept them is named as such.
    let replay = |name: &str, text: String| {
        std::fs::write(d.join(name), text).unwrap();
        let trace = d.join(name);
        let args = ["plugin", "replay", "--policy", art::SCHEDULE_WASM, "--trace", trace.to_str().unwrap()];
        edl(&args, &d.join("plugin-cache"))
    };
    let (ok, _, err) = replay("old.json", r#"{"job": "j", "timeline": []}"#.into());
    assert!(!ok && err.contains("a report without policy decisions"), "{err}");
    // A report's view that cannot be read is named by its decision, not a line.
    let mut edited = r.clone();
    edited["policy_decisions"][1]["view"]["thruput"] = serde_json::json!(1.0);
    let (ok, _, err) = replay("edited.json", serde_json::to_string_pretty(&edited).unwrap());
    assert!(!ok, "{err}");
    assert!(
        err.contains("edited.json: policy_decisions[2]: its view is not a cluster view")
            && err.contains("unknown field `thruput`"),
        "{err}"
    );
}

/// At a terminal (a pseudo-terminal `script` gives it) the job draws its
/// progress bar with the time left.
#[test]
fn at_a_terminal_the_progress_bar_shows_the_time_left() {
    let dir = tempfile::tempdir().unwrap();
    let line = format!(
        "cd '{}' && exec '{}' --no-distill --train-samples 400 --epochs 4 --step-delay-ms 30",
        dir.path().display(),
        env!("CARGO_BIN_EXE_edl-runtime")
    );
    let out = Command::new("script").args(["-qfec", &line, "/dev/null"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("%") && text.contains(" left "), "no bar with the time left: {text}");
    // And the lines above it whole, after the bar is gone.
    assert!(text.contains("epoch     3 done: 400 samples committed"), "{text}");
}
