//! Precompiled components on disk, keyed by the plugin's sha256 and the
//! engine's compatibility hash, so loading a plugin a second time skips
//! compilation. Files are written to a temporary name and renamed, so a
//! crash never leaves a half-written artifact under a valid key.

use sha2::{Digest, Sha256};
use std::{
    hash::{DefaultHasher, Hash, Hasher},
    path::{Path, PathBuf},
};
use wasmtime::{Engine, component::Component};

/// Where a component's compiled form came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheStatus {
    /// Loaded from the cache without compiling.
    Hit,
    /// Compiled now (and stored, if the cache is writable).
    Miss,
    /// Compiled now; the cache is disabled.
    Disabled,
}

/// The on-disk cache of compiled components.
#[derive(Clone, Debug)]
pub struct ArtifactCache {
    dir: Option<PathBuf>,
}

impl ArtifactCache {
    /// A cache in `dir` (created when first written).
    pub fn at(dir: impl Into<PathBuf>) -> Self {
        ArtifactCache { dir: Some(dir.into()) }
    }

    /// No cache: every load compiles.
    pub fn disabled() -> Self {
        ArtifactCache { dir: None }
    }

    /// `$EDL_PLUGIN_CACHE`, else `$XDG_CACHE_HOME/edl/plugins`, else `~/.cache/edl/plugins`.
    pub fn default_location() -> Self {
        let dir = std::env::var_os("EDL_PLUGIN_CACHE")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("edl/plugins")))
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/edl/plugins")));
        ArtifactCache { dir }
    }

    /// The cache directory, if enabled.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The file a component with these bytes would be cached in.
    pub fn entry(&self, engine: &Engine, wasm: &[u8]) -> Option<PathBuf> {
        let dir = self.dir.as_ref()?;
        let digest = hex::encode(Sha256::digest(wasm));
        let mut h = DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut h);
        Some(dir.join(format!("{digest}-{:016x}.cwasm", h.finish())))
    }

    /// The component for `wasm`, from the cache when possible.
    pub fn load(&self, engine: &Engine, wasm: &[u8]) -> wasmtime::Result<(Component, CacheStatus)> {
        let Some(entry) = self.entry(engine, wasm) else {
            return Ok((Component::new(engine, wasm)?, CacheStatus::Disabled));
        };
        if entry.exists() {
            // SAFETY: the cache directory belongs to this user and holds only
            // artifacts this code serialised; wasmtime checks the header and
            // engine compatibility and errors on a mismatch.
            match unsafe { Component::deserialize_file(engine, &entry) } {
                Ok(component) => return Ok((component, CacheStatus::Hit)),
                Err(e) => tracing::warn!("ignoring unusable cached plugin {}: {e}", entry.display()),
            }
        }
        let component = Component::new(engine, wasm)?;
        if let Err(e) = store(&entry, &component.serialize()?) {
            tracing::warn!("cannot cache compiled plugin at {}: {e}", entry.display());
        }
        Ok((component, CacheStatus::Miss))
    }
}

fn store(entry: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = entry.parent().expect("cache entries live in a directory");
    std::fs::create_dir_all(dir)?;
    let tmp = tempfile_in(dir)?;
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, entry).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

fn tempfile_in(dir: &Path) -> std::io::Result<PathBuf> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    Ok(dir.join(format!(".tmp-{}-{nanos}.cwasm", std::process::id())))
}
