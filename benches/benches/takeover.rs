//! Losing the coordinator: how long a job stands still after `kill -9` of
//! its coordinator (from the kill to its next committed step) and how many
//! committed steps it trains again, two ways side by side in one run:
//!
//! - **standby**: a second coordinator started with `--standby` on the same
//!   Redis store takes the job over; the workers (started by command, so not
//!   the killed coordinator's children) follow it with their processes and
//!   state. On the same host the standby proves the holder dead and takes
//!   the lease at once; in a pid namespace of its own (`unshare --pid`, as
//!   root), as on another host, it cannot and waits for the lease to lapse.
//! - **rerun**: without a standby, the coordinator (embedded store, its
//!   workers its children) is started again the moment it dies, as a
//!   supervisor would at best, and resumes from the newest checkpoint with
//!   new workers (`--checkpoint-secs` at its default).
//!
//!     cargo build --release -p edl-runtime && cargo bench -p edl-benches --bench takeover
//!
//! The same job both ways (2 workers, 4,000 MNIST samples, batch 40, 20 ms
//! per step), killed during its third epoch; three runs each, medians. The
//! killed coordinator's last committed step is read from its debug log
//! (`committed step N`), the step the job goes on from from the report of
//! the coordinator that finished it. Needs `redis-server`.

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use edl_benches::{RedisServer, median, release_runtime as runtime};

/// Lines of a child's stdout and stderr as they come, each with when it was read.
fn lines(child: &mut Child) -> mpsc::Receiver<(Instant, String)> {
    let (tx, rx) = mpsc::channel();
    let out: Box<dyn std::io::Read + Send> = Box::new(child.stdout.take().expect("piped stdout"));
    let err: Box<dyn std::io::Read + Send> = Box::new(child.stderr.take().expect("piped stderr"));
    for pipe in [out, err] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                if tx.send((Instant::now(), line)).is_err() {
                    return;
                }
            }
        });
    }
    rx
}

/// Waits (bounded) for a line containing `needle`; returns it and when it came.
/// `seen` gets every line read meanwhile.
fn wait_for(
    rx: &mpsc::Receiver<(Instant, String)>,
    needle: &str,
    seen: &mut Vec<String>,
) -> (Instant, String) {
    let until = Instant::now() + Duration::from_secs(300);
    loop {
        let left = until.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((t, l)) => {
                seen.push(l.clone());
                if l.contains(needle) {
                    return (t, l);
                }
            }
            Err(_) => panic!("no line with {needle:?}; the last ones:\n{}", tail(seen)),
        }
    }
}

fn tail(seen: &[String]) -> String {
    seen[seen.len().saturating_sub(30)..].join("\n")
}

/// The last `committed step N` of a coordinator's debug log in `seen`.
fn last_commit(seen: &[String]) -> u64 {
    seen.iter()
        .rev()
        .find_map(|l| l.split("committed step ").nth(1).and_then(|n| n.trim().parse().ok()))
        .expect("the killed coordinator logged its commits")
}

/// A coordinator of job `job` in `dir` (its checkpoints in `dir/checkpoints`).
fn coordinator(dir: &Path, job: &str, extra: &[&str]) -> Command {
    coordinator_in(None, dir, job, extra)
}

/// The same, run by `wrap` (a command and its arguments) when given.
fn coordinator_in(wrap: Option<&[&str]>, dir: &Path, job: &str, extra: &[&str]) -> Command {
    let mut c = match wrap {
        Some(w) => {
            let mut c = Command::new(w[0]);
            c.args(&w[1..]).arg(runtime());
            c
        }
        None => Command::new(runtime()),
    };
    c.current_dir(dir)
        .args(["--no-distill", "--teachers", "0", "--train-samples", "4000", "--batch", "40"])
        .args(["--epochs", "6", "--step-delay-ms", "20", "--workers", "2", "--min-workers", "2"])
        .args(["--max-workers", "2", "--job", job, "--report", "report.json", "--checkpoint-dir"])
        .arg(dir.join("checkpoints"))
        .args(extra)
        .env("RUST_LOG", "edl_runtime::coordinator=debug")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// What one kill cost: seconds from the kill to the next committed step,
/// and the committed steps trained again.
struct Cost {
    secs: f64,
    redone: u64,
}

fn report(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("report.json")).expect("a report")).expect("JSON")
}

/// Kills the running coordinator `first` once its third epoch is under way.
fn kill_mid_job(
    first: &mut Child,
    rx: &mpsc::Receiver<(Instant, String)>,
    seen: &mut Vec<String>,
) -> (Instant, u64) {
    wait_for(rx, "epoch     1 done", seen);
    std::thread::sleep(Duration::from_millis(700));
    first.kill().expect("kill -9");
    let killed = Instant::now();
    let _ = first.wait();
    // What it logged before it died.
    while let Ok((_, l)) = rx.recv_timeout(Duration::from_millis(300)) {
        seen.push(l);
    }
    (killed, last_commit(seen))
}

/// Runs the standby in a pid namespace of its own where that can be done
/// (root): it cannot prove the killed coordinator dead, as on another host,
/// and waits for the lease to lapse.
const APART: &[&str] = &["unshare", "--pid", "--fork"];

fn apart_possible() -> bool {
    Command::new(APART[0]).args(&APART[1..]).arg("true").status().is_ok_and(|s| s.success())
}

fn standby_run(store: &str, n: u32, apart: bool) -> Cost {
    let dir = tempfile::tempdir().unwrap();
    let job = format!("takeover-{n}-{apart}");
    let command =
        ["--store", store, "--scaler", "command", "--worker-command", "{program}", "--hosts", "here:2"];
    let mut first = coordinator(dir.path(), &job, &command).spawn().unwrap();
    let rx = lines(&mut first);
    let mut seen = Vec::new();
    // The first one holds the lease before the standby starts.
    wait_for(&rx, "workers join with", &mut seen);
    let wrap = apart.then_some(APART);
    let mut standby =
        coordinator_in(wrap, dir.path(), &job, &[&command[..], &["--standby"]].concat()).spawn().unwrap();
    let rx_b = lines(&mut standby);
    let mut seen_b = Vec::new();
    wait_for(&rx_b, "standby", &mut seen_b);
    let (killed, last) = kill_mid_job(&mut first, &rx, &mut seen);
    let (back, _) = wait_for(&rx_b, "coordinator takeover", &mut seen_b);
    let status = standby.wait().unwrap();
    assert!(status.success(), "the standby failed:\n{}", tail(&seen_b));
    let r = report(dir.path());
    let from = r["resumed_from_step"].as_u64().expect("the step it took over at");
    Cost { secs: back.duration_since(killed).as_secs_f64(), redone: last.saturating_sub(from) }
}

fn rerun(n: u32) -> Cost {
    let dir = tempfile::tempdir().unwrap();
    let job = format!("rerun-{n}");
    let mut first = coordinator(dir.path(), &job, &[]).spawn().unwrap();
    let rx = lines(&mut first);
    let mut seen = Vec::new();
    let (killed, last) = kill_mid_job(&mut first, &rx, &mut seen);
    let mut again = coordinator(dir.path(), &job, &[]).spawn().unwrap();
    let rx_b = lines(&mut again);
    let mut seen_b = Vec::new();
    let (back, _) = wait_for(&rx_b, "job resumed", &mut seen_b);
    let status = again.wait().unwrap();
    assert!(status.success(), "the rerun failed:\n{}", tail(&seen_b));
    let from = report(dir.path())["resumed_from_step"].as_u64().expect("the step it resumed from");
    Cost { secs: back.duration_since(killed).as_secs_f64(), redone: last.saturating_sub(from) }
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` does not: nothing to measure then.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let (_redis, store) = RedisServer::start();
    let apart = apart_possible();
    let (mut here, mut elsewhere, mut again) = (Vec::new(), Vec::new(), Vec::new());
    for n in 0..3 {
        here.push(standby_run(&store, n, false));
        if apart {
            elsewhere.push(standby_run(&store, n, true));
        }
        again.push(rerun(n));
    }
    if !apart {
        println!(
            "(no pid namespace could be made here, so no standby that must wait for the lease: run as root)"
        );
    }
    println!(
        "| after kill -9 of the coordinator | back to a committed step (median) | steps trained again (median, each run) |"
    );
    println!("|---|---|---|");
    let rows = [
        ("standby on the same host (proves the holder dead), workers follow", &here),
        ("standby as on another host (waits for the 5 s lease), workers follow", &elsewhere),
        ("rerun at once from the newest checkpoint, new workers", &again),
    ];
    for (name, costs) in rows.into_iter().filter(|(_, c)| !c.is_empty()) {
        let redone: Vec<String> = costs.iter().map(|c| c.redone.to_string()).collect();
        println!(
            "| {name} | {:.2} s | {} ({}) |",
            median(costs.iter().map(|c| c.secs).collect()),
            median(costs.iter().map(|c| c.redone as f64).collect()),
            redone.join(", ")
        );
    }
}
