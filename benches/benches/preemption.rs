//! A worker leaving with notice against one killed without, on the same
//! job: three workers, one sent SIGTERM (as a scheduler's preemption sends)
//! during the second epoch and another SIGKILL (no notice) during the
//! fourth, three runs, medians.
//!
//!     cargo build --release -p edl-runtime && cargo bench -p edl-benches --bench preemption
//!
//! For each: the resize's pause as the report records it (from the
//! boundary to the new generation's first committed step); the longest
//! time without a committed step around it, from the report's timeline
//! (what the job lost: a dropped window's work is in it); and the time from
//! the signal to the new generation's first commit on the coordinator's
//! output (a worker with notice first finishes the window it has).

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use edl_benches::{median, release_runtime as runtime};

fn hold_policy() -> PathBuf {
    Path::new(edl_plugin_artifacts::HOSTILE_POLICY_WASM).to_path_buf()
}

fn lines(child: &mut Child) -> mpsc::Receiver<(Instant, String)> {
    let (tx, rx) = mpsc::channel();
    let out = child.stdout.take().expect("piped stdout");
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send((Instant::now(), line)).is_err() {
                return;
            }
        }
    });
    rx
}

fn wait_for(rx: &mpsc::Receiver<(Instant, String)>, needle: &str) -> (Instant, String) {
    let until = Instant::now() + Duration::from_secs(300);
    loop {
        let left = until.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((t, l)) if l.contains(needle) => return (t, l),
            Ok(_) => {}
            Err(_) => panic!("no line with {needle:?}"),
        }
    }
}

/// The pid of worker `id`, a child of the coordinator `parent`.
fn worker_pid(parent: u32, id: u64) -> i32 {
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else { continue };
        let ppid: u32 =
            stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1)?.parse().ok()).unwrap_or(0);
        let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if ppid == parent && (cmd.contains(&format!(" --id {id} ")) || cmd.ends_with(&format!(" --id {id}")))
        {
            return p;
        }
    }
    panic!("no worker {id} under {parent}")
}

struct Cost {
    pause_ms: f64,
    gap_ms: f64,
    seen_ms: f64,
}

/// One job: worker 2 told to go, worker 3 killed; what each cost.
fn run(n: u32) -> (Cost, Cost) {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(runtime())
        .current_dir(dir.path())
        .args([
            "--no-distill",
            "--teachers",
            "0",
            "--train-samples",
            "4000",
            "--batch",
            "40",
            "--epochs",
            "5",
        ])
        .args(["--step-delay-ms", "20", "--workers", "3", "--min-workers", "1", "--max-workers", "3"])
        .arg("--policy")
        .arg(hold_policy())
        .args(["--policy-config", "mode=hold", "--job", &format!("preempt-{n}"), "--report", "report.json"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("edl-runtime");
    let rx = lines(&mut child);
    wait_for(&rx, "epoch     0 done");
    std::thread::sleep(Duration::from_millis(500));
    // SAFETY: signals to this bench's own grandchildren, by pid.
    unsafe { libc::kill(worker_pid(child.id(), 2), libc::SIGTERM) };
    let told = Instant::now();
    let (noticed, _) = wait_for(&rx, "left with notice");
    wait_for(&rx, "epoch     2 done");
    std::thread::sleep(Duration::from_millis(500));
    unsafe { libc::kill(worker_pid(child.id(), 3), libc::SIGKILL) };
    let killed = Instant::now();
    let (lost, _) = wait_for(&rx, "worker 3 lost");
    assert!(child.wait().unwrap().success(), "the job failed");
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("report.json")).unwrap()).unwrap();
    let events = r["scale_events"].as_array().unwrap();
    let timeline = r["timeline"].as_array().unwrap();
    // The event's pause, and the gap between the last step committed
    // before it and the first after (no progress meanwhile: a dropped
    // window's work is in it).
    let cost = |needle: &str, signalled: Instant, seen: Instant| {
        let e = events
            .iter()
            .find(|e| e["reason"].as_str().unwrap().contains(needle))
            .unwrap_or_else(|| panic!("an event with {needle:?}"));
        let step = e["step"].as_u64().unwrap();
        let at =
            |s: u64| timeline.iter().find(|t| t["step"].as_u64() == Some(s)).and_then(|t| t["secs"].as_f64());
        let gap = at(step + 1).zip(at(step)).map(|(b, a)| (b - a) * 1e3).expect("the steps around it");
        Cost {
            pause_ms: e["pause_ms"].as_f64().unwrap(),
            gap_ms: gap,
            seen_ms: seen.duration_since(signalled).as_secs_f64() * 1e3,
        }
    };
    (cost("left with notice", told, noticed), cost("worker 3 lost", killed, lost))
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let runs: Vec<(Cost, Cost)> = (0..3).map(run).collect();
    println!(
        "| a worker of three goes | resize pause (median) | longest time without a commit around it (median) | signal to the new generation's first commit (median) |"
    );
    println!("|---|---|---|---|");
    for (name, pick) in [
        ("with notice (SIGTERM): leaves at the boundary", 0usize),
        ("without (SIGKILL): its window is dropped and redone", 1),
    ] {
        let costs: Vec<&Cost> = runs.iter().map(|r| if pick == 0 { &r.0 } else { &r.1 }).collect();
        let m = |f: fn(&Cost) -> f64| median(costs.iter().map(|c| f(c)).collect());
        println!(
            "| {name} | {:.0} ms | {:.0} ms | {:.0} ms |",
            m(|c| c.pause_ms),
            m(|c| c.gap_ms),
            m(|c| c.seen_ms)
        );
    }
}
