//! Criterion benchmarks across the edl crates live in `benches/`; this
//! library holds what several of them share.

use std::{
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// The median of `v` (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A plugin host as the job has one: compiled components cached (in a
/// directory of its own, which lives as long as the returned guard) and
/// native libraries allowed.
pub fn plugin_host() -> (tempfile::TempDir, std::sync::Arc<edl_runtime::plugin::PluginHost>) {
    use edl_runtime::plugin::{ArtifactCache, HostOptions, PluginHost};
    let cache = tempfile::tempdir().expect("a directory for the bench's compiled plugins");
    let options =
        HostOptions { cache: ArtifactCache::at(cache.path()), allow_native: true, ..Default::default() };
    let host = PluginHost::new(options).expect("a plugin host");
    (cache, host)
}

/// The release build of `edl-runtime` beside the running bench
/// (target/release), which the bench's doc says to build first.
pub fn release_runtime() -> PathBuf {
    let exe = std::env::current_exe().expect("the bench's path");
    let dir = exe.parent().and_then(Path::parent).expect("target/release").to_path_buf();
    let bin = dir.join("edl-runtime");
    assert!(bin.exists(), "build first: cargo build --release -p edl-runtime ({} missing)", bin.display());
    bin
}

/// Steady-state seconds per committed step of a job, from its report: the
/// time between the committed steps of the report's timeline after the
/// first fifth, divided by their count.
pub fn steady_step_secs(report: &Path) -> f64 {
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(report).expect("the report")).expect("a JSON report");
    let secs: Vec<f64> =
        r["timeline"].as_array().expect("a timeline").iter().filter_map(|s| s["secs"].as_f64()).collect();
    assert!(secs.len() >= 3, "{}: too few steps to measure", report.display());
    let k0 = secs.len() / 5;
    (secs[secs.len() - 1] - secs[k0]) / (secs.len() - 1 - k0) as f64
}

/// A `redis-server` of a bench's own on a free loopback port, stopped when
/// dropped.
pub struct RedisServer(Child);

impl RedisServer {
    /// Starts one; returns it and its URL.
    pub fn start() -> (RedisServer, String) {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server (apt-get install redis-server)");
        let until = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < until, "redis-server did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
        (RedisServer(child), format!("redis://127.0.0.1:{port}/"))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
