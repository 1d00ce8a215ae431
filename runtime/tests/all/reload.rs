//! Hot reload: a changed file is used at the next call; a broken one is not.

use crate::support::{host, pairs, path};
use edl_plugin_artifacts as art;
use edl_plugin_sdk::{Action, ClusterView, testing::SimCluster};
use edl_runtime::plugin::{Plugin, PolicyPlugin, Reloading};
use std::time::Duration;

fn replace_file(from: &str, to: &std::path::Path) {
    // Write next to the target and rename, as a deployment would.
    let tmp = to.with_extension("tmp");
    std::fs::copy(from, &tmp).unwrap();
    std::fs::rename(&tmp, to).unwrap();
}

#[test]
fn a_new_version_is_used_at_the_next_call_and_a_broken_one_is_not() {
    let (host, _d) = host();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policy.wasm");
    std::fs::copy(art::SCHEDULE_WASM, &file).unwrap();
    let mut p = Reloading::policy(host, &file, &pairs(&[])).unwrap().with_poll_interval(Duration::ZERO);
    let view = ClusterView {
        step: 0,
        world_size: 1,
        min_workers: 1,
        max_workers: 4,
        free_slots: 3,
        ..Default::default()
    };
    assert_eq!(p.info().name, "edl-plugin-schedule");
    assert_eq!(p.decide(&view).unwrap(), vec![Action::Hold]);

    replace_file(art::PANICKY_WASM, &file);
    assert_eq!(p.decide(&view).unwrap(), vec![Action::ScaleOut(1)]);
    assert_eq!(p.info().name, "edl-test-plugin-panicky");
    assert_eq!(p.reloads(), 1);

    // A truncated upload: the running version stays, the reason is kept.
    let bytes = std::fs::read(art::SCHEDULE_WASM).unwrap();
    let tmp = file.with_extension("tmp");
    std::fs::write(&tmp, &bytes[..bytes.len() / 3]).unwrap();
    std::fs::rename(&tmp, &file).unwrap();
    assert_eq!(p.decide(&view).unwrap(), vec![Action::ScaleOut(2)]);
    assert_eq!(p.reloads(), 1);
    assert!(p.last_error().unwrap().contains("policy.wasm"), "{:?}", p.last_error());

    // The wrong world is refused the same way.
    replace_file(art::AUGMENT_WASM, &file);
    assert_eq!(p.decide(&view).unwrap(), vec![Action::ScaleOut(3)]);
    assert!(p.last_error().unwrap().contains("reader-transform"));

    // A good file again is picked up.
    replace_file(art::SCHEDULE_WASM, &file);
    assert_eq!(p.decide(&view).unwrap(), vec![Action::Hold]);
    assert_eq!(p.reloads(), 2);
    assert!(p.last_error().is_none());
}

/// Drives `p` over a cluster of five useful workers until its size search
/// is under way and a straggler is under watch: a memory worth handing over.
fn warmed(p: &mut dyn PolicyPlugin) -> SimCluster {
    let mut sim = SimCluster::saturating(5, 1, 8);
    sim.run(9, |v| p.decide(v).unwrap());
    sim.set_speed(1, 0.5);
    sim.run(2, |v| p.decide(v).unwrap());
    sim
}

#[test]
fn a_policy_s_memory_goes_on_in_a_new_instance_sandboxed_or_native() {
    let (host, _d) = host();
    for file in [art::AUTOSCALE_WASM, art::AUTOSCALE_SO] {
        let load = || host.load_policy(path(file), &[]).unwrap();
        let mut first = load();
        let mut sim = warmed(first.as_mut());
        let (mut twin, mut bare) = (sim.clone(), sim.clone());
        let saved = first.save_state().unwrap().expect("autoscale keeps a memory");
        let mut second = load();
        assert!(second.load_state(&saved).unwrap(), "{file}");
        let mut fresh = load();
        let a = sim.run(60, |v| first.decide(v).unwrap());
        let b = twin.run(60, |v| second.decide(v).unwrap());
        let c = bare.run(60, |v| fresh.decide(v).unwrap());
        assert_eq!(a, b, "{file}: the new instance decided otherwise");
        assert_ne!(a, c, "{file}: the memory made no difference, so this shows nothing");
        // Bytes that are not its memory are refused, naming the plugin and the call.
        let err = second.load_state(b"{").unwrap_err().to_string();
        assert!(err.contains("autoscale") && err.contains("load"), "{err}");
    }
}

#[test]
fn a_reloaded_policy_goes_on_with_the_running_version_s_memory() {
    let (host, _d) = host();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policy.wasm");
    std::fs::copy(art::AUTOSCALE_WASM, &file).unwrap();
    let mut p =
        Reloading::policy(host.clone(), &file, &pairs(&[])).unwrap().with_poll_interval(Duration::ZERO);
    let mut kept = host.load_policy(path(art::AUTOSCALE_WASM), &[]).unwrap();
    let mut sim = warmed(&mut p);
    let mut twin = warmed(kept.as_mut());
    // A new version lands mid-job (here the same build, a new file).
    replace_file(art::AUTOSCALE_WASM, &file);
    let a = sim.run(60, |v| p.decide(v).unwrap());
    assert_eq!(p.reloads(), 1);
    let b = twin.run(60, |v| kept.decide(v).unwrap());
    assert_eq!(a, b, "the reloaded policy did not go on from the running one's memory");
}

/// `simulate --watch`, as the plugin author's workflow uses it: it runs
/// round after round until interrupted, and a rebuilt plugin written over
/// the file is loaded at its next decision, saying so.
#[test]
fn simulate_watch_runs_until_interrupted_and_takes_up_a_rebuilt_policy() {
    use crate::support::{job::lines, wait::wait_for};
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policy.wasm");
    std::fs::copy(art::SCHEDULE_WASM, &file).unwrap();
    let mut cmd = std::process::Command::new("sh");
    cmd.args(["-c", "exec \"$0\" \"$@\" 2>&1", env!("CARGO_BIN_EXE_edl-runtime"), "simulate", "--policy"])
        .arg(&file)
        .args(["--watch", "--decide-every-secs", "0.02", "--decisions", "20"])
        .stdout(std::process::Stdio::piped());
    // Ctrl-C as at a terminal: a test run in the background (a shell's
    // `&`) has SIGINT ignored, and its children would inherit that.
    // SAFETY: signal(2) is async-signal-safe and touches only the child.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    let within = Duration::from_secs(120);
    wait_for(&rx, "watching", &mut seen, within);
    // It does not end after one run of the scenario.
    wait_for(&rx, "round 2", &mut seen, within);
    assert!(child.try_wait().unwrap().is_none(), "it ended: {seen:?}");
    replace_file(art::AUTOSCALE_WASM, &file);
    wait_for(&rx, "reloaded plugin edl-plugin-autoscale", &mut seen, within);
    // Its log, piped, carries no terminal colour codes.
    assert!(seen.iter().all(|l| !l.contains('\u{1b}')), "{seen:?}");
    wait_for(&rx, "round", &mut seen, within);
    assert!(child.try_wait().unwrap().is_none(), "it ended: {seen:?}");
    // Ctrl-C ends it.
    let int = std::process::Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(int.success());
    let until = std::time::Instant::now() + within;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if std::time::Instant::now() > until {
            let _ = child.kill();
            panic!("SIGINT did not end it within {within:?}: {seen:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(!status.success(), "{status:?}");
}
