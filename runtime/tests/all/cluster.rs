//! Jobs whose workers are not the coordinator's children: started by a
//! command per worker, or by another engine that only knows the
//! coordinator's address and the job's secret. On loopback, and across
//! hosts built from Linux network namespaces (veth pairs to a bridge, private
//! addresses that exist only inside the namespaces).

use crate::elastic::{finish, job, lines, report, wait_for};
use edl_plugin_artifacts as art;
use serde_json::Value;
use std::{
    path::Path,
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

const EXE: &str = env!("CARGO_BIN_EXE_edl-runtime");

/// Every epoch: every training sample in exactly one committed step.
fn assert_exactly_once(r: &Value, epochs: u64, samples: u64) {
    let list = r["epochs"].as_array().unwrap();
    assert_eq!(list.len() as u64, epochs, "{list:?}");
    for e in list {
        assert_eq!(
            (&e["samples_committed"], &e["duplicates"], &e["missing"]),
            (&samples.into(), &0.into(), &0.into()),
            "{e}"
        );
    }
}

/// The `host:port` the coordinator says workers join at.
fn coordinator_addr(rx: &mpsc::Receiver<String>, seen: &mut Vec<String>) -> String {
    wait_for(rx, "workers join with", seen, Duration::from_secs(120));
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

/// Waits (bounded) for a process to end.
fn wait_exit(child: &mut Child, what: &str, within: Duration) -> std::process::ExitStatus {
    let until = Instant::now() + within;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if Instant::now() > until {
            let _ = child.kill();
            panic!("{what} did not exit within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn workers_started_elsewhere_join_with_the_secret_and_only_within_the_maximum() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let secret = d.join("job.secret");
    let mut cmd = job(d, &["--scaler", "external", "--no-distill", "--teachers", "0"]);
    cmd.args(["--policy", art::HOSTILE_POLICY_WASM, "--policy-config", "mode=hold"]);
    cmd.args(["--max-workers", "2", "--epochs", "3", "--step-delay-ms", "40", "--secret-file"]).arg(&secret);
    let mut child = cmd.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    let addr = coordinator_addr(&rx, &mut seen);

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
    let status = wait_exit(&mut third, "the worker past the maximum", Duration::from_secs(120));
    assert!(status.success(), "{status}: {}", std::fs::read_to_string(d.join("w3.log")).unwrap());
    // One that does not know the secret is refused, saying so.
    let wrong = d.join("wrong.secret");
    std::fs::write(&wrong, "ab".repeat(32)).unwrap();
    let mut stranger = worker(&[], &addr, Some(&wrong), &d.join("w4.log")).spawn().unwrap();
    let status = wait_exit(&mut stranger, "the stranger", Duration::from_secs(60));
    let said = std::fs::read_to_string(d.join("w4.log")).unwrap();
    assert!(!status.success() && said.contains("the peer does not know the job's secret"), "{said}");

    let status = finish(child, rx, &mut seen);
    assert!(status.success(), "{}", seen.join("\n"));
    let r = report(d);
    assert_exactly_once(&r, 3, 1200);
    let joined = seen.iter().filter(|l| l.contains("joined uninvited")).count();
    assert!(joined >= 1, "{}", seen.join("\n"));
    assert_eq!(r["final_world_size"], 2, "{r}");
    for (w, name) in [(&mut first, "the first worker"), (&mut second, "the second worker")] {
        let status = wait_exit(w, name, Duration::from_secs(60));
        assert!(status.success(), "{name}: {status}");
    }
}
