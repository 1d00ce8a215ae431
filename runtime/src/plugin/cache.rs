//! Precompiled components on disk, keyed by the plugin's sha256 and the
//! engine's compatibility hash, so loading a plugin a second time skips
//! compilation. Files are written to a temporary name and renamed, so a
//! crash never leaves a half-written artifact under a valid key.
//!
//! A compiled artifact is machine code that runs outside the sandbox, so an
//! entry is used only when the directory and the file belong to the user
//! running the runtime and nobody else can write them, and when the file's
//! sha256 matches the one recorded beside it (`<entry>.sha256`) when it was
//! written. Anything else is logged and the plugin compiled afresh.

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
        let trusted = trusted_dir(entry.parent().expect("cache entries live in a directory"));
        if let Err(why) = &trusted {
            tracing::warn!("plugin cache not used: {why}");
        }
        if trusted.is_ok() && entry.exists() {
            match verified(&entry) {
                // SAFETY: the bytes are the ones this runtime serialised (their
                // sha256 was recorded at write time, and only this user can
                // write the directory and files); wasmtime also checks the
                // header and engine compatibility and errors on a mismatch.
                Ok(bytes) => match unsafe { Component::deserialize(engine, &bytes) } {
                    Ok(component) => return Ok((component, CacheStatus::Hit)),
                    Err(e) => tracing::warn!("ignoring unusable cached plugin {}: {e}", entry.display()),
                },
                Err(why) => tracing::warn!("ignoring cached plugin {}: {why}", entry.display()),
            }
        }
        let component = Component::new(engine, wasm)?;
        if trusted.is_ok()
            && let Err(e) = store(&entry, &component.serialize()?)
        {
            tracing::warn!("cannot cache compiled plugin at {}: {e}", entry.display());
        }
        Ok((component, CacheStatus::Miss))
    }
}

fn digest_file(entry: &Path) -> PathBuf {
    let mut name = entry.as_os_str().to_owned();
    name.push(".sha256");
    PathBuf::from(name)
}

/// Why the cache directory or a cached artifact is not used.
#[derive(Debug, thiserror::Error)]
enum CacheError {
    #[error("no recorded checksum ({0}); it was not written by this runtime")]
    NoChecksum(std::io::Error),
    #[error("{0}")]
    Read(std::io::Error),
    #[error("checksum mismatch (recorded {recorded}, found {actual})")]
    ChecksumMismatch { recorded: String, actual: String },
    #[error("cannot create {}: {source}", dir.display())]
    CreateDir { dir: PathBuf, source: std::io::Error },
    #[error("{}: {source}", path.display())]
    Stat { path: PathBuf, source: std::io::Error },
    #[error("{} belongs to uid {owner}, not to this user ({me})", path.display())]
    ForeignOwner { path: PathBuf, owner: u32, me: u32 },
    #[error("{} can be written by other users (mode {mode:o})", path.display())]
    WritableByOthers { path: PathBuf, mode: u32 },
}

/// The entry's bytes, when they are this user's and match their recorded digest.
fn verified(entry: &Path) -> Result<Vec<u8>, CacheError> {
    owned_by_me(entry)?;
    let recorded = std::fs::read_to_string(digest_file(entry)).map_err(CacheError::NoChecksum)?;
    let bytes = std::fs::read(entry).map_err(CacheError::Read)?;
    let actual = hex::encode(Sha256::digest(&bytes));
    if recorded.trim() != actual {
        return Err(CacheError::ChecksumMismatch { recorded: recorded.trim().to_string(), actual });
    }
    Ok(bytes)
}

/// Creates the directory (mode 0700) when missing; refuses one that another
/// user owns or can write.
fn trusted_dir(dir: &Path) -> Result<(), CacheError> {
    if !dir.exists() {
        let mut b = std::fs::DirBuilder::new();
        b.recursive(true);
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
        b.create(dir).map_err(|source| CacheError::CreateDir { dir: dir.to_path_buf(), source })?;
    }
    owned_by_me(dir)
}

#[cfg(unix)]
fn owned_by_me(path: &Path) -> Result<(), CacheError> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::symlink_metadata(path)
        .map_err(|source| CacheError::Stat { path: path.to_path_buf(), source })?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(CacheError::ForeignOwner { path: path.to_path_buf(), owner: meta.uid(), me });
    }
    if meta.mode() & 0o022 != 0 {
        return Err(CacheError::WritableByOthers { path: path.to_path_buf(), mode: meta.mode() & 0o777 });
    }
    Ok(())
}

#[cfg(not(unix))]
fn owned_by_me(_path: &Path) -> Result<(), CacheError> {
    Ok(())
}

fn store(entry: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = entry.parent().expect("cache entries live in a directory");
    let write = |path: &Path, data: &[u8]| -> std::io::Result<()> {
        let tmp = tempfile_in(dir)?;
        let mut opts = std::fs::OpenOptions::new();
        opts.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
        let result = opts.open(&tmp).and_then(|mut f| {
            std::io::Write::write_all(&mut f, data)?;
            f.sync_all()
        });
        result.and_then(|()| std::fs::rename(&tmp, path)).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
    };
    // The checksum first: an entry is never visible without its digest.
    write(&digest_file(entry), hex::encode(Sha256::digest(bytes)).as_bytes())?;
    write(entry, bytes)
}

fn tempfile_in(dir: &Path) -> std::io::Result<PathBuf> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    Ok(dir.join(format!(".tmp-{}-{nanos}.cwasm", std::process::id())))
}
