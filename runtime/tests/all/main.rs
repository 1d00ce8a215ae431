//! The runtime's integration tests: one binary, one module per concern.
//! Plugins come from `edl-plugin-artifacts`, built as part of this build.

mod cache;
mod cli;
mod cluster;
mod distill;
mod elastic;
mod hardening;
mod house;
mod kubernetes;
mod python;
mod reload;
mod sandbox;
mod scaffold;
mod sealed;
mod shipped;
mod slurm;
mod storage;
mod store;
mod torch;
mod torchrun;
mod train;

use edl_runtime::plugin::{ArtifactCache, HostOptions, Limits, PluginHost};
use std::{path::Path, sync::Arc};

/// A host with its own cache directory (kept alive by the returned guard).
pub fn host_with(limits: Limits) -> (Arc<PluginHost>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let host =
        PluginHost::new(HostOptions { limits, cache: ArtifactCache::at(dir.path()), allow_native: true })
            .unwrap();
    (host, dir)
}

pub fn host() -> (Arc<PluginHost>, tempfile::TempDir) {
    host_with(Limits::default())
}

pub fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
    p.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

pub fn path(p: &str) -> &Path {
    Path::new(p)
}
