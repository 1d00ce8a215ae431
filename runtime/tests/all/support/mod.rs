//! What more than one test file uses: plugin hosts, jobs and their
//! reports, waits, processes, stores, namespace hosts and Python
//! environments.

pub(crate) mod capture;
pub(crate) mod hosts;
pub(crate) mod job;
pub(crate) mod process;
pub(crate) mod python;
pub(crate) mod servers;
pub(crate) mod wait;

use edl_plugin_sdk::ClusterView;
use edl_runtime::plugin::{ArtifactCache, HostOptions, Limits, PluginHost};
use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

/// A host with its own cache directory (kept alive by the returned guard).
pub(crate) fn host_with(limits: Limits) -> (Arc<PluginHost>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let host =
        PluginHost::new(HostOptions { limits, cache: ArtifactCache::at(dir.path()), allow_native: true })
            .unwrap();
    (host, dir)
}

pub(crate) fn host() -> (Arc<PluginHost>, tempfile::TempDir) {
    host_with(Limits::default())
}

pub(crate) fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
    p.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

pub(crate) fn path(p: &str) -> &Path {
    Path::new(p)
}

/// The workspace's root directory.
pub(crate) fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// A one-worker job at `step` that may grow to four.
pub(crate) fn view(step: u64) -> ClusterView {
    ClusterView { step, world_size: 1, min_workers: 1, max_workers: 4, free_slots: 3, ..Default::default() }
}

/// A tokio runtime of two worker threads.
pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// The first of `n` free ports on loopback, two apart (a teacher slot's
/// port and the one above it), below 60000.
pub(crate) fn free_ports(n: u16) -> u16 {
    loop {
        let first = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        if first < 60000 && (0..2 * n).all(|i| std::net::TcpListener::bind(("127.0.0.1", first + i)).is_ok())
        {
            return first;
        }
    }
}

/// A process the test started, killed when the test ends however it ends.
pub(crate) struct KillOnDrop(pub(crate) std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A process the test did not start itself (a teacher a coordinator left
/// running), killed when the test ends however it ends.
pub(crate) struct KillPid(pub(crate) i32);

impl Drop for KillPid {
    fn drop(&mut self) {
        // SAFETY: signalling a pid; one already gone gives ESRCH, ignored.
        unsafe { libc::kill(self.0, libc::SIGKILL) };
    }
}
