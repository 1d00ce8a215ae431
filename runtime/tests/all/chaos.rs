//! The chaos suite: one small job per fault, the fault struck mid-job, and
//! the same outcomes checked after each: every sample trained exactly once
//! (no data lost), the job finished, no process of the job left running,
//! and a message that names what happened. docs/reliability.md has the
//! table of faults and outcomes.

use crate::support::{
    job::{assert_exactly_once, job, lines, report},
    process::{children, runs, sigkill},
    servers::{EtcdCluster, RedisServer},
    wait::{until, wait_exit, wait_for},
};
use edl_plugin_artifacts as art;
use std::{
    path::{Path, PathBuf},
    process::{Child, Command},
    sync::mpsc::Receiver,
    time::Duration,
};

const EPOCHS: u64 = 6;
const SAMPLES: u64 = 400;

/// The job every fault strikes: two workers held by the policy (one may
/// go), checkpoints every 5 steps, on `store`; its errors go to `err.log`.
/// A step delay in `extra` replaces the usual one.
fn chaos_job(dir: &Path, store: &str, extra: &[&str]) -> Command {
    let delay =
        if extra.contains(&"--step-delay-ms") { [].as_slice() } else { ["--step-delay-ms", "40"].as_slice() };
    let mut args = vec![
        "--policy",
        art::HOSTILE_POLICY_WASM,
        "--policy-config",
        "mode=hold",
        "--train-samples",
        "400",
        "--epochs",
        "6",
        "--workers",
        "2",
        "--min-workers",
        "1",
        "--max-workers",
        "2",
        "--checkpoint-every-steps",
        "5",
        "--worker-lease-secs",
        "3",
        "--store",
        store,
        "--job",
        "chaos",
    ];
    args.extend_from_slice(delay);
    if !extra.contains(&"--teachers") {
        args.push("--no-distill");
    }
    args.extend_from_slice(extra);
    let mut c = job(dir, &args);
    c.stderr(std::fs::File::create(dir.join("err.log")).unwrap());
    c
}

/// A running job of the suite.
struct Running {
    dir: PathBuf,
    child: Child,
    rx: Receiver<String>,
    seen: Vec<String>,
}

impl Running {
    /// The job started, once its first epoch is done.
    fn start(dir: &Path, store: &str, extra: &[&str]) -> Running {
        let mut r = Self::spawn(dir, store, extra);
        r.wait("epoch     0 done");
        r
    }

    fn spawn(dir: &Path, store: &str, extra: &[&str]) -> Running {
        Self::of(chaos_job(dir, store, extra), dir)
    }

    /// The job `cmd` (a [`chaos_job`] in `dir`), started.
    fn of(mut cmd: Command, dir: &Path) -> Running {
        let mut child = cmd.spawn().unwrap();
        let rx = lines(&mut child);
        Running { dir: dir.to_path_buf(), child, rx, seen: Vec::new() }
    }

    /// Waits until the job's errors (`err.log`) say `needle`.
    fn wait_err(&self, needle: &str) {
        let log = self.dir.join("err.log");
        until(&format!("{needle:?} in {}", log.display()), Duration::from_secs(60), || {
            std::fs::read_to_string(&log).unwrap_or_default().contains(needle)
        });
    }

    fn wait(&mut self, needle: &str) {
        wait_for(&self.rx, needle, &mut self.seen, Duration::from_secs(180));
    }

    /// The pid of worker `id` (one of the coordinator's children).
    fn worker(&self, id: u64) -> u32 {
        let tag = format!(" --id {id}");
        children(self.child.id())
            .into_iter()
            .find(|(_, cmd)| cmd.contains(" worker ") && cmd.contains(&tag))
            .unwrap_or_else(|| panic!("worker {id} among {:?}", children(self.child.id())))
            .0
    }

    fn teachers(&self) -> Vec<u32> {
        let all = children(self.child.id());
        all.into_iter().filter(|(_, cmd)| cmd.contains(" teacher ")).map(|(p, _)| p).collect()
    }

    /// Waits for the job's end; returns its exit status and all it said
    /// (its output, then its errors).
    fn end(mut self) -> (std::process::ExitStatus, String) {
        let status = wait_exit(&mut self.child, "the job", Duration::from_secs(300), || self.seen.join("\n"));
        while let Ok(l) = self.rx.recv_timeout(Duration::from_millis(200)) {
            self.seen.push(l);
        }
        let err = std::fs::read_to_string(self.dir.join("err.log")).unwrap_or_default();
        (status, format!("{}\n{err}", self.seen.join("\n")))
    }
}

fn signal(sig: &str, pid: u32) {
    assert!(Command::new("kill").args([sig, &pid.to_string()]).status().unwrap().success());
}

/// Processes (not zombies) whose working directory is under `dir`.
fn processes_in(dir: &Path) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(cwd) = std::fs::read_link(format!("/proc/{pid}/cwd")) else { continue };
        if cwd.starts_with(dir) && runs(pid) {
            out.push(pid);
        }
    }
    out
}

/// The outcomes every fault is held to: the job finished, every sample
/// once (the report in `reported`), `said` named what happened, and no
/// process of the job is left.
fn held(dirs: &[&Path], reported: &Path, status: std::process::ExitStatus, said: &str, named: &[&str]) {
    assert!(status.success(), "the job did not finish: {said}");
    assert_exactly_once(&report(reported), EPOCHS, SAMPLES);
    for n in named {
        assert!(said.contains(n), "{n:?} not said:\n{said}");
    }
    for d in dirs {
        until("the job's processes to be gone", Duration::from_secs(30), || processes_in(d).is_empty());
    }
}

#[test]
fn a_worker_killed() {
    let dir = tempfile::tempdir().unwrap();
    let mut r = Running::start(dir.path(), "memory", &[]);
    sigkill(r.worker(2));
    r.wait("redoing it with 1 worker(s)");
    let (status, said) = r.end();
    held(&[dir.path()], dir.path(), status, &said, &["worker 2 lost"]);
    assert!(!said.contains("restarting from the newest checkpoint"), "no committed step lost: {said}");
}

#[test]
fn a_worker_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let mut r = Running::start(dir.path(), "memory", &[]);
    signal("-STOP", r.worker(2));
    r.wait("redoing it with 1 worker(s)");
    let (status, said) = r.end();
    held(&[dir.path()], dir.path(), status, &said, &["no heartbeat for", "worker 2 lost"]);
    assert!(!said.contains("restarting from the newest checkpoint"), "no committed step lost: {said}");
}

/// Where two coordinators of one job run (`a`, `b`) and the checkpoint
/// directory they share, in a new temporary directory.
fn two_coordinators() -> (tempfile::TempDir, PathBuf, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    let ckpt = dir.path().join("checkpoints");
    (dir, a, b, ckpt)
}

/// A coordinator struck (`strike`) under a standby on Redis: the standby
/// finishes the job from the store and the checkpoints.
fn coordinator_under_standby(strike: &str) -> (tempfile::TempDir, String) {
    let redis = RedisServer::start();
    let (dir, a, b, ckpt) = two_coordinators();
    let shared = ["--checkpoint-dir", ckpt.to_str().unwrap()];
    let url = redis.url();
    let active = Running::start(&a, &url, &shared);
    let mut standby = Running::spawn(&b, &url, &[&shared[..], &["--standby"]].concat());
    standby.wait("waiting to take it over");
    let mut active = active;
    signal(strike, active.child.id());
    // Its workers die with it (local processes): the standby resumes from
    // the newest checkpoint with its own.
    standby.wait("resuming job \"chaos\"");
    if strike == "-STOP" {
        // Woken after the standby leads: it finds itself fenced and stops,
        // acting on nobody.
        signal("-CONT", active.child.id());
        let (status, said) = active.end();
        assert!(!status.success() && said.contains("fenced"), "{said}");
    } else {
        let _ = active.child.wait();
    }
    let (status, said) = standby.end();
    held(&[&a, &b], &b, status, &said, &["resuming job \"chaos\""]);
    (dir, said)
}

#[test]
fn the_coordinator_killed_under_a_standby() {
    coordinator_under_standby("-KILL");
}

#[test]
fn the_coordinator_stopped_under_a_standby() {
    coordinator_under_standby("-STOP");
}

/// libfaketime (Debian's `libfaketime`), which moves a process's wall
/// clock; None (the test skips, saying so) where it is missing outside CI.
fn faketime_or_skip() -> Option<&'static str> {
    let lib = [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    ]
    .into_iter()
    .find(|p| Path::new(p).exists());
    if lib.is_none() {
        assert!(std::env::var("CI").is_err(), "libfaketime is missing (.ci/run installs it)");
        eprintln!("skipped: libfaketime is missing (apt-get install libfaketime)");
    }
    lib
}

#[test]
fn the_wall_clock_stepped_under_a_standby() {
    let Some(faketime) = faketime_or_skip() else { return };
    let redis = RedisServer::start();
    let (dir, a, b, ckpt) = two_coordinators();
    let shared = ["--checkpoint-dir", ckpt.to_str().unwrap()];
    let url = redis.url();
    // The coordinator and its workers (one host) read the wall clock
    // through libfaketime, moved by writing an offset into a file; the
    // standby (another host) reads the real one.
    let offset = dir.path().join("clock-offset");
    std::fs::write(&offset, "+0").unwrap();
    let mut cmd = chaos_job(&a, &url, &[&shared[..], &["--step-delay-ms", "250"]].concat());
    cmd.env("LD_PRELOAD", faketime)
        .env("FAKETIME_TIMESTAMP_FILE", &offset)
        .env("FAKETIME_CACHE_DURATION", "1")
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
    let mut active = Running::of(cmd, &a);
    active.wait("epoch     0 done");
    let mut standby = Running::spawn(&b, &url, &[&shared[..], &["--standby"]].concat());
    standby.wait("waiting to take it over");
    // Two hours ahead, then three back: as NTP stepping a clock that was
    // wrong, or a person with `date -s`.
    std::fs::write(&offset, "+2h").unwrap();
    active.wait_err("the wall clock stepped +7200 s");
    std::fs::write(&offset, "-1h").unwrap();
    active.wait_err("the wall clock stepped -10800 s");
    let (status, said) = active.end();
    held(&[&a], &a, status, &said, &["the wall clock stepped +7200 s", "the wall clock stepped -10800 s"]);
    assert!(!said.contains("fenced") && !said.contains("restarting from"), "{said}");
    // The standby never took the job: it finds it finished and says so.
    let (status, said) = standby.end();
    assert!(status.success() && said.contains("finished before"), "{said}");
    assert!(!said.contains("resuming job"), "{said}");
    until("the job's processes to be gone", Duration::from_secs(30), || processes_in(&b).is_empty());
}

#[test]
fn a_teacher_killed() {
    let dir = tempfile::tempdir().unwrap();
    let mut r = Running::start(dir.path(), "memory", &["--teachers", "2"]);
    let teachers = r.teachers();
    assert_eq!(teachers.len(), 2, "{}", r.seen.join("\n"));
    sigkill(teachers[0]);
    r.wait("new workers will not be given it");
    let (status, said) = r.end();
    held(&[dir.path()], dir.path(), status, &said, &["signal: 9"]);
}

#[test]
fn a_teacher_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--teachers", "2", "--teacher-timeout-ms", "1000", "--teacher-cooldown-ms", "200"];
    let r = Running::start(dir.path(), "memory", &flags);
    let teachers = r.teachers();
    assert_eq!(teachers.len(), 2, "{}", r.seen.join("\n"));
    // The students' readers time the stopped teacher out and go on with
    // the other.
    signal("-STOP", teachers[0]);
    let (status, said) = r.end();
    // (Stopped with the job, it may be gone already.)
    let _ = Command::new("kill").args(["-CONT", &teachers[0].to_string()]).status();
    held(&[dir.path()], dir.path(), status, &said, &[]);
}

#[test]
fn the_store_restarted_without_its_data() {
    let mut redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let mut r = Running::start(dir.path(), &redis.url(), &[]);
    redis.restart();
    r.wait("epoch     2 done");
    let (status, said) = r.end();
    held(&[dir.path()], dir.path(), status, &said, &[]);
}

#[test]
fn the_store_s_leader_member_killed() {
    let mut etcd = EtcdCluster::start(3);
    let dir = tempfile::tempdir().unwrap();
    let mut r = Running::start(dir.path(), &etcd.url(), &[]);
    let leader = etcd.leader().expect("a leader");
    etcd.kill(leader);
    r.wait("epoch     2 done");
    let (status, said) = r.end();
    held(&[dir.path()], dir.path(), status, &said, &["the store's leader changed from etcd member"]);
}

#[test]
fn forged_store_records() {
    use edl_runtime::store::{AnyStore, Store, keys};
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let url = redis.url();
    let mut r = Running::start(dir.path(), &url, &[]);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let store = rt.block_on(async { AnyStore::open(&url) }).unwrap();
    // A store writer without the job's secret marks it finished, takes its
    // lease and names a coordinator of its own.
    let finished = br#"{"generation":99,"committed_steps":0,"epoch":0,"cursor":0,"next_worker_id":1,"members":[],"finished":true}"#;
    rt.block_on(store.put(&keys::job_state("chaos"), finished, None)).unwrap();
    rt.block_on(store.put(&keys::coordinator("chaos"), br#"{"host":"evil","pid":1}"#, None)).unwrap();
    r.wait("epoch     2 done");
    let (status, said) = r.end();
    held(&[dir.path()], dir.path(), status, &said, &["carries no MAC", "does not verify"]);
}

#[test]
fn sigterm_to_the_coordinator_then_a_rerun() {
    let dir = tempfile::tempdir().unwrap();
    let r = Running::start(dir.path(), "memory", &[]);
    signal("-TERM", r.child.id());
    let (status, said) = r.end();
    assert_eq!(status.code(), Some(143), "{said}");
    assert!(said.contains("stopped by SIGTERM: its state at step"), "{said}");
    let r = Running::spawn(dir.path(), "memory", &[]);
    let (status, said) = r.end();
    held(&[dir.path()], dir.path(), status, &said, &["resuming job \"chaos\""]);
}

/// A tmpfs of `size` mounted at `at` for the test (root only; None where
/// it cannot be mounted), unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: &Path, size: &str) -> Option<Tmpfs> {
        std::fs::create_dir_all(at).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Tmpfs(at.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[test]
fn the_checkpoint_directory_fills_up() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("checkpoints");
    let Some(_fs) = Tmpfs::mount(&ckpt, "4m") else {
        assert!(std::env::var("CI").is_err(), "CI runs as root and mounts a tmpfs");
        eprintln!("skipped: cannot mount a tmpfs here (not root)");
        return;
    };
    let flags = ["--checkpoint-dir", ckpt.to_str().unwrap(), "--keep-checkpoints", "1"];
    let mut r = Running::start(dir.path(), "memory", &flags);
    // Everything left is taken: the next checkpoints cannot be written.
    let filler = ckpt.join("filler");
    let _ = Command::new("dd")
        .arg("if=/dev/zero")
        .arg(format!("of={}", filler.display()))
        .args(["bs=64k"])
        .status();
    r.wait("No space left on device");
    // Space comes back: the job writes its checkpoints again and finishes.
    std::fs::remove_file(&filler).unwrap();
    let (status, said) = r.end();
    held(&[dir.path()], dir.path(), status, &said, &["checkpoint of step", "failed"]);
}
