//! PyTorch programs under `edl-runtime launch`, for real: DDP over the
//! gloo process group `edl.torch` builds for each generation, with the job's
//! store (`tests/programs/torch_ddp.py`).

use crate::elastic::{children, finish, lines, report, wait_for};
use crate::python::torch_py;
use edl_plugin_artifacts as art;
use std::{
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

/// The worker id a launched program was given.
fn worker_id(pid: u32) -> Option<u64> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|&b| b == 0)
        .find_map(|kv| kv.strip_prefix(b"EDL_WORKER_ID="))
        .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
}

/// What a worker said when it stopped: (worker, why, generations it
/// trained in, params digest, accuracy).
fn farewells(lines: &[String]) -> Vec<(u64, String, u64, String, f64)> {
    lines
        .iter()
        .filter_map(|l| {
            let rest = l.split_once("] worker ")?.1;
            let (id, rest) = rest.split_once(": ")?;
            let (why, rest) = rest.split_once("; generations ")?;
            let generations = rest.split_once(';')?.0.parse().ok()?;
            let digest = rest.split_once("params ")?.1.split_once(';')?.0;
            let acc = rest.split_once("test accuracy ")?.1.trim_end_matches('%').parse().ok()?;
            Some((id.parse().ok()?, why.to_string(), generations, digest.to_string(), acc))
        })
        .collect()
}

#[test]
fn ddp_over_the_jobs_process_groups_trains_every_sample_once_through_resizes_and_a_kill() {
    let py = torch_py();
    let dir = tempfile::tempdir().unwrap();
    let program = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/torch_ddp.py");
    let mut c = Command::new(env!("CARGO_BIN_EXE_edl-runtime"));
    c.current_dir(dir.path())
        .args(["launch", "--samples", "1397", "--min-workers", "2", "--max-workers", "3"])
        .args(["--policy", art::SCHEDULE_WASM, "--policy-config", "every=8", "--decide-every-steps", "4"])
        .args(["--epochs", "6", "--no-distill", "--report", "report.json", "--plugin-cache"])
        .arg(dir.path().join("plugin-cache"))
        .args(["--", "python"])
        .arg(&program)
        // Slow enough for a third worker (PyTorch takes seconds to import)
        // to join and for the kill to land mid-job.
        .env("STEP_DELAY_MS", "60")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    py.env(&mut c);
    let mut child = c.spawn().unwrap();
    let coordinator = child.id();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    // Grown to three workers: kill one of them with SIGKILL, mid-collective
    // as likely as not; the others' gloo collectives fail and the step is redone.
    wait_for(&rx, " -> 3 workers", &mut seen, Duration::from_secs(180));
    let (victim, id) = children(coordinator)
        .into_iter()
        .find_map(|(p, _)| worker_id(p).filter(|&id| id == 2).map(|id| (p, id)))
        .unwrap_or_else(|| panic!("worker 2 among {:?}", children(coordinator)));
    // SAFETY: signalling a child of the job under test.
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    wait_for(&rx, &format!("worker {id} lost"), &mut seen, Duration::from_secs(120));
    let status = finish(child, rx, &mut seen);
    let text = seen.join("\n");
    assert!(status.success(), "{text}");

    let r = report(dir.path());
    let epochs = r["epochs"].as_array().unwrap();
    assert_eq!(epochs.len(), 6, "{epochs:?}");
    for e in epochs {
        assert_eq!(
            (e["samples_committed"].as_u64(), e["duplicates"].as_u64(), e["missing"].as_u64()),
            (Some(1397), Some(0), Some(0)),
            "{e}"
        );
    }
    let events = r["scale_events"].as_array().unwrap();
    let policy = events.iter().filter(|e| e["reason"].as_str().unwrap().starts_with("policy")).count();
    assert!(policy >= 1, "a policy-driven resize: {events:?}");
    // The workers that ended with the job hold one model: DDP's reductions
    // agreed across every generation, the redone steps included.
    // (A worker started near the end may have joined no generation: it
    // holds the untrained model and is no member.)
    let done: Vec<_> = farewells(&seen).into_iter().filter(|f| f.1 == "the job is done" && f.2 > 0).collect();
    assert!(done.len() >= 2, "two workers at the end: {text}");
    assert!(done.iter().all(|f| f.3 == done[0].3), "the final workers' models differ: {done:?}");
    assert!(done[0].4 > 85.0, "test accuracy {}: {text}", done[0].4);
}
