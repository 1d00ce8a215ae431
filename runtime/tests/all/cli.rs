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
    ] {
        assert!(out.contains(want), "missing {want:?} in\n{out}");
    }
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

    std::fs::write(&trace, "{\"step\": 1}\nnot json\n").unwrap();
    let (ok, _, err) = edl(
        &["plugin", "replay", "--policy", art::SCHEDULE_WASM, "--trace", trace.to_str().unwrap()],
        cache.path(),
    );
    assert!(!ok);
    assert!(err.contains("trace.jsonl:2"), "{err}");
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
}
