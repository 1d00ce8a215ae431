//! Checkpoints: a training program's state (named float32 tensors, see
//! [`crate::state`]) as one safetensors file, and a JSON manifest (step, epoch, data cursor, hyperparameters, plugin state, the
//! sha256 of each file). A checkpoint is written into a temporary directory
//! and renamed into place, so a crash never leaves a half-written one under
//! a valid name; the last `keep` are kept. Loading takes the newest that
//! verifies; a corrupt or truncated one is reported by name and skipped.
//!
//! The directory may be object storage instead (`s3://bucket/prefix`,
//! `gs://`, `az://`; see [`crate::checkpoint::objects`]), so that no host needs a shared
//! file system: there each file is one object written whole, and
//! `manifest.sha256` is written last, as the commit marker: a reader finds a
//! checkpoint complete, or skips it as incomplete, never half of one.
//!
//! Durability: every file is fsynced before the rename and the directory
//! after it; a checkpoint of the same step that already exists is moved
//! aside and removed only once the new one is in place (a crash between the
//! two renames is repaired by [`Checkpoints::list`]). The manifest carries
//! its own sha256 in `manifest.sha256`, so a bit flip that leaves valid JSON
//! (a step, a cursor) is caught like a damaged tensor file.

pub mod objects;

use crate::state::{Layout, TensorSpec};
use edl_plugin_sdk::Hyperparams;
use objects::{ObjectDir, ObjectStoreError};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

/// What a checkpoint records besides the tensors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub step: u64,
    pub epoch: u64,
    /// Samples of the epoch's permutation already committed.
    pub cursor: usize,
    pub seed: u64,
    pub hyperparams: Hyperparams,
    /// Whatever the plugins need to resume (opaque to the runtime).
    #[serde(default)]
    pub plugin_state: PluginState,
    /// File name -> sha256, filled in by [`Checkpoints::save`].
    #[serde(default)]
    pub files: BTreeMap<String, String>,
    /// The lease token of the coordinator this checkpoint was written for
    /// (see [`Fence`]); None where checkpoints are not fenced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fence: Option<u64>,
}

/// What the coordinator and its plugins keep in a checkpoint to resume
/// from, as the JSON it was written as: made once when the checkpoint is
/// asked for, it goes to the worker that writes it and into the manifest
/// without being parsed into a tree on the way (it holds a count for each
/// sample and a record for each epoch done).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PluginState(Box<serde_json::value::RawValue>);

impl PluginState {
    /// `value` as JSON.
    pub fn of<T: Serialize>(value: &T) -> serde_json::Result<Self> {
        serde_json::value::to_raw_value(value).map(PluginState)
    }

    /// What it holds, read as a `T`.
    pub fn read<T: serde::de::DeserializeOwned>(&self) -> serde_json::Result<T> {
        serde_json::from_str(self.0.get())
    }

    /// Its JSON text.
    pub fn json(&self) -> &str {
        self.0.get()
    }
}

impl Default for PluginState {
    /// Nothing kept: `null`.
    fn default() -> Self {
        PluginState::of(&()).expect("null is JSON")
    }
}

impl PartialEq for PluginState {
    fn eq(&self, other: &Self) -> bool {
        self.json() == other.json()
    }
}

/// Who may write a checkpoint location: the highest lease token a
/// coordinator claimed it with, and the step that coordinator resumed from.
/// A checkpoint of a later step written with a lower token comes from a
/// deposed coordinator (one that ran on after its lease was taken): it is
/// refused where the write lands, and where it got through (object storage
/// between a check and a write), never resumed from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fence {
    pub token: u64,
    pub from_step: u64,
}

/// The fence's file beside the checkpoints.
const FENCE_FILE: &str = "fence.json";
/// The lock a local writer holds while it checks the fence and writes.
const LOCK_FILE: &str = ".fence.lock";

impl Fence {
    /// Whether `m` was written by a coordinator this fence deposed.
    fn deposes(&self, m: &Manifest) -> bool {
        m.step > self.from_step && m.fence.unwrap_or(0) < self.token
    }
}

/// A checkpoint read back: the state's tensors laid out end to end.
pub struct Restored {
    pub path: PathBuf,
    pub manifest: Manifest,
    pub layout: Layout,
    pub values: Vec<f32>,
    /// The job's sparse tables at the checkpoint's step (parameter servers).
    pub tables: Vec<crate::ps::SavedTable>,
}

impl Restored {
    /// The values of tensor `name`.
    pub fn tensor(&self, name: &str) -> Option<&[f32]> {
        self.layout.ranges().find(|(t, _)| t.name == name).map(|(_, r)| &self.values[r])
    }
}

/// The file of a checkpoint that holds the state.
pub const STATE_FILE: &str = "state.safetensors";
/// The checkpoint's commit marker: the manifest's sha256 (in object storage
/// followed by the manifest's name); until it is there, readers skip it.
const SUM_FILE: &str = "manifest.sha256";
/// The file in a local checkpoint directory that names its newest complete checkpoint.
pub const LATEST: &str = "latest";

/// Why checkpoints could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {detail}")]
    Io { path: String, detail: String },
    /// The checkpoint was read and is unusable (incomplete, a checksum that
    /// does not match, not a state): another one may be used instead. A
    /// checkpoint that could not be read is an [`Io`](Self::Io) or
    /// [`Store`](Self::Store) error, never this.
    #[error("{path}: {detail}")]
    Corrupt { path: String, detail: String },
    /// An object storage call failed; the message names the object.
    #[error(transparent)]
    Store(#[from] ObjectStoreError),
    /// Another writer switched the checkpoint in object storage to its own
    /// copy while this one uploaded; that copy is kept.
    #[error("{url}: another writer switched this checkpoint while it was written")]
    Overtaken { url: String },
    /// A coordinator with a higher lease token has claimed the checkpoints:
    /// this one was deposed and must not write.
    #[error("{0}")]
    Fenced(String),
}

/// A directory of checkpoints `step-<n>/`, local or in object storage.
#[derive(Clone)]
pub struct Checkpoints {
    dir: PathBuf,
    keep: usize,
    remote: Option<ObjectDir>,
    /// Checkpoints known good (written or verified by this process), which
    /// pruning need not read again.
    good: std::sync::Arc<std::sync::Mutex<std::collections::BTreeSet<PathBuf>>>,
}

fn io(path: &Path, e: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Io { path: path.display().to_string(), detail: e.to_string() }
}

fn corrupt(path: &Path, e: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Corrupt { path: path.display().to_string(), detail: e.to_string() }
}

/// Writes a file and forces it to disk.
fn write_durably(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut f = std::fs::File::create(path).map_err(|e| io(path, e))?;
    std::io::Write::write_all(&mut f, bytes).map_err(|e| io(path, e))?;
    f.sync_all().map_err(|e| io(path, e))
}

/// Creates the directory and proves a file can be written and renamed in it.
fn check_writable(dir: &Path) -> Result<(), CheckpointError> {
    if dir.exists() && !dir.is_dir() {
        return Err(io(dir, "not a directory: a directory of checkpoints is wanted here"));
    }
    std::fs::create_dir_all(dir).map_err(|e| io(dir, format!("cannot create it: {e}")))?;
    let probe = dir.join(format!(".write-probe-{}", std::process::id()));
    let result = write_durably(&probe, b"probe")
        .and_then(|()| std::fs::rename(&probe, dir.join(".write-probe")).map_err(|e| io(dir, e)));
    let _ = std::fs::remove_file(&probe);
    let _ = std::fs::remove_file(dir.join(".write-probe"));
    result.map_err(|e| io(dir, format!("cannot write in it: {e}")))
}

/// Makes renames and removals inside `dir` durable.
fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    std::fs::File::open(dir).and_then(|f| f.sync_all()).map_err(|e| io(dir, e))
}

/// The checkpoint's name for `step`.
/// The name's prefix of a finished run's checkpoint set aside by `--restart`.
const FINISHED_PREFIX: &str = "finished-";

fn step_name(step: u64) -> String {
    format!("step-{step:010}")
}

/// The metadata key listing a checkpoint's sparse tables (their specs);
/// each table's rows are the tensors `ps/<name>/ids` (U64 `[n]`),
/// `ps/<name>/rows` (F32 `[n, dim * (1 + optimizer slots)]`: the values,
/// then the optimiser's state) and `ps/<name>/updates` (U32 `[n]`).
const TABLES_META: &str = "edl.tables";

/// The state as a safetensors file's bytes, with the tensors' order, and
/// the sparse tables beside it.
fn encode_state(
    layout: &Layout,
    values: &[f32],
    tables: &[crate::ps::SavedTable],
    at: &Path,
) -> Result<Vec<u8>, CheckpointError> {
    if values.len() != layout.numel() {
        return Err(io(at, format!("{} values for a state of {}", values.len(), layout.numel())));
    }
    let mut bytes: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = layout
        .ranges()
        .map(|(t, r)| {
            (t.name.clone(), Dtype::F32, t.shape.clone(), crate::distill::oip::f32_bytes(&values[r]))
        })
        .collect();
    for t in tables {
        let (n, name) = (t.ids.len(), &t.spec.name);
        let width = t.rows.len().checked_div(n).unwrap_or(0);
        let ids = t.ids.iter().flat_map(|i| i.to_le_bytes()).collect();
        let updates = t.updates.iter().flat_map(|u| u.to_le_bytes()).collect();
        bytes.push((format!("ps/{name}/ids"), Dtype::U64, vec![n], ids));
        bytes.push((
            format!("ps/{name}/rows"),
            Dtype::F32,
            vec![n, width],
            crate::distill::oip::f32_bytes(&t.rows),
        ));
        bytes.push((format!("ps/{name}/updates"), Dtype::U32, vec![n], updates));
    }
    let views = bytes
        .iter()
        .map(|(n, d, s, b)| Ok((n.clone(), TensorView::new(*d, s.clone(), b)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()
        .map_err(|e| io(at, e))?;
    // The order of the tensors, which safetensors does not keep.
    let order = serde_json::to_string(layout).map_err(|e| io(at, e))?;
    let mut meta = std::collections::HashMap::from([("edl.layout".to_string(), order)]);
    if !tables.is_empty() {
        let specs: Vec<&crate::ps::TableSpec> = tables.iter().map(|t| &t.spec).collect();
        meta.insert(TABLES_META.to_string(), serde_json::to_string(&specs).map_err(|e| io(at, e))?);
    }
    safetensors::serialize(views, Some(meta)).map_err(|e| io(at, e))
}

/// A state file's tensors (in the order its metadata names), values and
/// sparse tables; `file` names it in errors.
fn read_state(
    file: &Path,
    bytes: &[u8],
) -> Result<(Layout, Vec<f32>, Vec<crate::ps::SavedTable>), CheckpointError> {
    let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| corrupt(file, e))?;
    let st = SafeTensors::deserialize(bytes).map_err(|e| corrupt(file, e))?;
    let layout: Layout = match meta.metadata().as_ref().and_then(|m| m.get("edl.layout")) {
        Some(order) => {
            serde_json::from_str(order).map_err(|e| corrupt(file, format!("tensor order: {e}")))?
        }
        None => {
            let mut names: Vec<(String, Vec<usize>)> =
                st.tensors().into_iter().map(|(n, t)| (n, t.shape().to_vec())).collect();
            names.sort();
            Layout::new(names.into_iter().map(|(n, s)| TensorSpec::new(n, s)).collect())
                .map_err(|e| corrupt(file, e))?
        }
    };
    // The order is the file's own word: believed only as far as the
    // file holds the values it names.
    let numel = layout.checked_numel().filter(|&n| n <= bytes.len() / 4).ok_or_else(|| {
        corrupt(file, format!("its tensor order names more values than its {} bytes hold", bytes.len()))
    })?;
    let mut values = Vec::with_capacity(numel);
    for t in layout.tensors() {
        let v = st.tensor(&t.name).map_err(|e| corrupt(file, format!("tensor {:?}: {e}", t.name)))?;
        if v.dtype() != Dtype::F32 || v.shape() != t.shape.as_slice() {
            return Err(corrupt(
                file,
                format!("tensor {:?} is {:?} {:?}, expected F32 {:?}", t.name, v.dtype(), v.shape(), t.shape),
            ));
        }
        values.extend(v.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
    }
    let tables = match meta.metadata().as_ref().and_then(|m| m.get(TABLES_META)) {
        Some(specs) => read_tables(&st, specs).map_err(|e| corrupt(file, e))?,
        None => Vec::new(),
    };
    Ok((layout, values, tables))
}

/// The sparse tables `specs` (the metadata's JSON) names, read from `st`.
fn read_tables(st: &SafeTensors, specs: &str) -> Result<Vec<crate::ps::SavedTable>, String> {
    let specs: Vec<crate::ps::TableSpec> = serde_json::from_str(specs).map_err(|e| format!("tables: {e}"))?;
    let tensor = |name: String, dtype: Dtype| {
        let v = st.tensor(&name).map_err(|e| format!("tensor {name:?}: {e}"))?;
        if v.dtype() != dtype {
            return Err(format!("tensor {name:?} is {:?}, expected {dtype:?}", v.dtype()));
        }
        Ok(v)
    };
    let mut out = Vec::new();
    for spec in specs {
        spec.check()?;
        let name = spec.name.clone();
        let ids: Vec<u64> = tensor(format!("ps/{name}/ids"), Dtype::U64)?
            .data()
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        let rows = tensor(format!("ps/{name}/rows"), Dtype::F32)?;
        let width = spec.dim * (1 + spec.optimizer.slots());
        if ids.is_empty() {
            out.push(crate::ps::SavedTable { spec, ids, rows: Vec::new(), updates: Vec::new() });
            continue;
        }
        if rows.shape() != [ids.len(), width] {
            return Err(format!(
                "table {name:?}: rows of shape {:?}, expected [{}, {width}]",
                rows.shape(),
                ids.len()
            ));
        }
        let rows =
            rows.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
        let updates: Vec<u32> = tensor(format!("ps/{name}/updates"), Dtype::U32)?
            .data()
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        if updates.len() != ids.len() {
            return Err(format!("table {name:?}: {} update counts for {} rows", updates.len(), ids.len()));
        }
        out.push(crate::ps::SavedTable { spec, ids, rows, updates });
    }
    Ok(out)
}

/// Writes a checkpoint's files into the local directory `dir` (which exists):
/// the state, the manifest listing its sha256, and last the manifest's own
/// sha256, each forced to disk.
fn write_checkpoint_files(
    dir: &Path,
    (layout, values, tables): (&Layout, &[f32], &[crate::ps::SavedTable]),
    mut manifest: Manifest,
) -> Result<(), CheckpointError> {
    let state = encode_state(layout, values, tables, dir)?;
    write_durably(&dir.join(STATE_FILE), &state)?;
    manifest.files = BTreeMap::from([(STATE_FILE.to_string(), hex::encode(Sha256::digest(&state)))]);
    let json = serde_json::to_vec_pretty(&manifest).map_err(|e| io(dir, e))?;
    write_durably(&dir.join("manifest.json"), &json)?;
    write_durably(&dir.join(SUM_FILE), hex::encode(Sha256::digest(&json)).as_bytes())?;
    sync_dir(dir)
}

/// One write of a checkpoint to object storage: the state and the manifest
/// under names of this write alone (`state-<version>.safetensors`,
/// `manifest-<version>.json`) in the step's directory, which readers see
/// only once the step's checksum names the manifest.
struct ObjectUpload<'a> {
    dir: &'a ObjectDir,
    /// The step's directory under `dir`.
    step: &'a str,
    state_name: String,
    manifest_name: String,
}

impl<'a> ObjectUpload<'a> {
    /// A write of the step `step` under fresh names; `at` is its URL, for errors.
    fn new(dir: &'a ObjectDir, step: &'a str, at: &Path) -> Result<Self, CheckpointError> {
        let mut nonce = [0u8; 8];
        getrandom::fill(&mut nonce).map_err(|e| io(at, e))?;
        let version = hex::encode(nonce);
        Ok(ObjectUpload {
            dir,
            step,
            state_name: format!("state-{version}.safetensors"),
            manifest_name: format!("manifest-{version}.json"),
        })
    }

    /// Uploads the state's and the manifest's bytes.
    fn put(&self, state: Vec<u8>, manifest: Vec<u8>) -> Result<(), CheckpointError> {
        for (file, bytes) in [(&self.state_name, state), (&self.manifest_name, manifest)] {
            self.dir.put(&format!("{}/{file}", self.step), bytes)?;
        }
        Ok(())
    }

    /// Removes what this write uploaded, once it will never be switched to.
    fn discard(&self) {
        for file in [&self.state_name, &self.manifest_name] {
            let _ = self.dir.delete(&format!("{}/{file}", self.step));
        }
    }

    /// Removes the files of the copy this write replaced, whose checksum
    /// file read `old_sum` before the switch (best effort: a leftover is
    /// only space).
    fn remove_replaced(&self, old_sum: &[u8]) {
        let old_sum = String::from_utf8_lossy(old_sum);
        let old_manifest = old_sum.split_once(' ').map_or("manifest.json", |(_, m)| m.trim()).to_string();
        if let Ok(Some(text)) = self.dir.get(&format!("{}/{old_manifest}", self.step))
            && let Ok(m) = serde_json::from_slice::<Manifest>(&text)
        {
            for f in m.files.keys().filter(|f| **f != self.state_name) {
                let _ = self.dir.delete(&format!("{}/{f}", self.step));
            }
        }
        if old_manifest != self.manifest_name {
            let _ = self.dir.delete(&format!("{}/{old_manifest}", self.step));
        }
    }
}

impl Checkpoints {
    /// Checkpoints in the local directory `dir`.
    pub fn new(dir: impl Into<PathBuf>, keep: usize) -> Self {
        Checkpoints { dir: dir.into(), keep: keep.max(1), remote: None, good: Default::default() }
    }

    /// Checkpoints at `location`: a local directory, or object storage
    /// (`s3://bucket/prefix`, `gs://...`, `az://...`).
    pub fn open(location: &Path, keep: usize) -> Result<Self, CheckpointError> {
        let shown = location.to_string_lossy();
        if !objects::is_url(&shown) {
            return Ok(Self::new(location, keep));
        }
        let remote = ObjectDir::open(&shown)
            .map_err(|e| CheckpointError::Io { path: shown.to_string(), detail: e.to_string() })?;
        Ok(Checkpoints {
            dir: location.to_path_buf(),
            keep: keep.max(1),
            remote: Some(remote),
            good: Default::default(),
        })
    }

    /// Checkpoints in a directory of object storage opened elsewhere.
    pub fn in_objects(dir: ObjectDir, keep: usize) -> Self {
        Checkpoints {
            dir: PathBuf::from(dir.url_of("")),
            keep: keep.max(1),
            remote: Some(dir),
            good: Default::default(),
        }
    }

    /// Whether the checkpoints are in object storage.
    pub fn is_remote(&self) -> bool {
        self.remote.is_some()
    }

    /// Proves checkpoints can be written here: a probe written, read back and removed.
    pub fn probe(&self) -> Result<(), CheckpointError> {
        let Some(r) = &self.remote else { return check_writable(&self.dir) };
        r.put(".write-probe", b"probe".to_vec())?;
        match r.get(".write-probe")? {
            Some(b) if b == b"probe" => {}
            _ => {
                return Err(CheckpointError::Io {
                    path: r.url_of(".write-probe"),
                    detail: "the probe written could not be read back".into(),
                });
            }
        }
        r.delete(".write-probe").map_err(CheckpointError::from)
    }

    /// Writes a small file beside the checkpoints (a marker).
    pub fn put_file(&self, name: &str, bytes: &[u8]) -> Result<(), CheckpointError> {
        match &self.remote {
            Some(r) => r.put(name, bytes.to_vec()).map_err(CheckpointError::from),
            None => write_durably(&self.dir.join(name), bytes),
        }
    }

    /// The small file `name` beside the checkpoints, if there.
    pub fn get_file(&self, name: &str) -> Result<Option<Vec<u8>>, CheckpointError> {
        match &self.remote {
            Some(r) => r.get(name).map_err(CheckpointError::from),
            None => {
                let path = self.dir.join(name);
                match std::fs::read(&path) {
                    Ok(b) => Ok(Some(b)),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(e) => Err(io(&path, e)),
                }
            }
        }
    }

    /// Whether the file `name` is there; an error when that cannot be told.
    pub fn has_file(&self, name: &str) -> Result<bool, CheckpointError> {
        match &self.remote {
            Some(r) => r.get(name).map(|b| b.is_some()).map_err(CheckpointError::from),
            None => {
                let path = self.dir.join(name);
                path.try_exists().map_err(|e| io(&path, e))
            }
        }
    }

    /// Removes the file `name`, if there.
    pub fn remove_file(&self, name: &str) {
        match &self.remote {
            Some(r) => {
                let _ = r.delete(name);
            }
            None => {
                let _ = std::fs::remove_file(self.dir.join(name));
            }
        }
    }

    /// Removes the checkpoint at `path` (as [`Checkpoints::list`] gives it).
    pub fn remove(&self, path: &Path) {
        match &self.remote {
            Some(r) => {
                if let Some(rel) = r.rel_of(&path.to_string_lossy()) {
                    let _ = r.delete_dir(rel);
                }
            }
            None => {
                let _ = std::fs::remove_dir_all(path);
            }
        }
    }

    /// The checkpoint directories, oldest first (none when the directory
    /// does not exist yet); an error when they cannot be listed, so that a
    /// store that fails is never taken for an empty one. A checkpoint moved
    /// aside by a writer that crashed before the new copy took its place is
    /// put back.
    pub fn list(&self) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
        if let Some(r) = &self.remote {
            let names = r.dirs()?;
            let mut out: Vec<(u64, PathBuf)> = names
                .iter()
                .filter_map(|n| {
                    n.strip_prefix("step-")?.parse().ok().map(|s| (s, PathBuf::from(r.url_of(n))))
                })
                .collect();
            out.sort();
            return Ok(out);
        }
        let entries = || -> Result<Vec<std::fs::DirEntry>, CheckpointError> {
            match std::fs::read_dir(&self.dir) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
                Err(e) => Err(io(&self.dir, e)),
                Ok(dir) => dir.map(|e| e.map_err(|e| io(&self.dir, e))).collect(),
            }
        };
        // A writer between its two renames has a step moved aside on
        // purpose: the repair is only for one that crashed there, so it
        // waits for a moment when no one holds the lock.
        if let Some(_held) = self.lock_if_free() {
            self.put_back_moved_aside(&entries()?);
        }
        let mut out: Vec<(u64, PathBuf)> = entries()?
            .into_iter()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.strip_prefix("step-").and_then(|n| n.parse().ok()).map(|n| (n, e.path()))
            })
            .collect();
        out.sort();
        Ok(out)
    }

    /// The location's fence, if a coordinator claimed it.
    pub fn fence(&self) -> Result<Option<Fence>, CheckpointError> {
        Ok(self.fence_versioned()?.map(|(f, _)| f))
    }

    fn fence_versioned(&self) -> Result<Option<(Fence, Option<objects::Version>)>, CheckpointError> {
        let (bytes, version, at) = match &self.remote {
            Some(r) => match r.get_versioned(FENCE_FILE)? {
                Some((b, v)) => (b, Some(v), r.url_of(FENCE_FILE)),
                None => return Ok(None),
            },
            None => {
                let path = self.dir.join(FENCE_FILE);
                match std::fs::read(&path) {
                    Ok(b) => (b, None, path.display().to_string()),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                    Err(e) => return Err(io(&path, e)),
                }
            }
        };
        let fence = serde_json::from_slice(&bytes)
            .map_err(|e| CheckpointError::Io { path: at, detail: format!("not a fence: {e}") })?;
        Ok(Some((fence, version)))
    }

    /// Holds the local directory's lock while `f` runs (object storage has
    /// none: its writes check the fence before and after). A lock another
    /// process holds is waited for, and said: a writer hung on a file
    /// system holds it for as long.
    fn locked<T>(&self, f: impl FnOnce() -> Result<T, CheckpointError>) -> Result<T, CheckpointError> {
        self.locked_with(false, f)
    }

    /// As [`Checkpoints::locked`]; `lenient`: where the file system has no
    /// locks (NFS without its lock service), `f` runs without, said.
    fn locked_with<T>(
        &self,
        lenient: bool,
        f: impl FnOnce() -> Result<T, CheckpointError>,
    ) -> Result<T, CheckpointError> {
        if self.remote.is_some() {
            return f();
        }
        let (file, path) = self.lock_file()?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                tracing::warn!("{}: waiting for another process's checkpoint write to end", path.display());
                file.lock().map_err(|e| io(&path, format!("cannot lock: {e}")))?;
            }
            Err(std::fs::TryLockError::Error(e)) if lenient => {
                tracing::warn!("{}: cannot lock ({e}); written without the lock", path.display());
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io(&path, format!("cannot lock: {e}"))),
        }
        let out = f();
        drop(file);
        out
    }

    fn lock_file(&self) -> Result<(std::fs::File, PathBuf), CheckpointError> {
        std::fs::create_dir_all(&self.dir).map_err(|e| io(&self.dir, e))?;
        let path = self.dir.join(LOCK_FILE);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| io(&path, e))?;
        Ok((file, path))
    }

    /// The local directory's lock, where no one holds it (held until the
    /// file is dropped).
    fn lock_if_free(&self) -> Option<std::fs::File> {
        let (file, _) = self.lock_file().ok()?;
        file.try_lock().ok().map(|()| file)
    }

    /// Puts back each step a writer moved aside (`.old-step-N-PID`) and
    /// crashed before its new copy took the place. Only under the lock.
    fn put_back_moved_aside(&self, entries: &[std::fs::DirEntry]) {
        for e in entries {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix(".old-") else { continue };
            let Some((step, _pid)) = rest.rsplit_once('-') else { continue };
            let dest = self.dir.join(step);
            if step.starts_with("step-") && !dest.exists() {
                let _ = std::fs::rename(e.path(), &dest);
            }
        }
    }

    /// Fails when a coordinator with a token above `token` has claimed
    /// the location.
    fn check_fence(&self, token: u64) -> Result<(), CheckpointError> {
        match self.fence()? {
            Some(f) if f.token > token => Err(CheckpointError::Fenced(format!(
                "fenced: the checkpoints at {} were claimed by a coordinator with lease token {} \
                 (this one's is {token}): another coordinator took the job over, and this one stops. \
                 If instead the store was wiped or replaced (its tokens start again), remove {} to let \
                 the job resume here",
                self.dir.display(),
                f.token,
                match &self.remote {
                    Some(r) => r.url_of(FENCE_FILE),
                    None => self.dir.join(FENCE_FILE).display().to_string(),
                }
            ))),
            _ => Ok(()),
        }
    }

    /// Claims the location for the coordinator holding lease token `token`,
    /// which resumed from `from_step`: from now on a checkpoint of a later
    /// step written with a lower token is refused, and never resumed from.
    /// Fails when a higher token claimed it already. `force` (a coordinator
    /// whose store is its own: its tokens start again with each run, and
    /// the location is locked for it) replaces any earlier claim.
    pub fn claim(&self, token: u64, from_step: u64, force: bool) -> Result<(), CheckpointError> {
        let fence = Fence { token, from_step };
        let json = serde_json::to_vec(&fence).map_err(|e| io(&self.dir, e))?;
        // What was judged good before may be a deposed writer's now.
        self.good.lock().unwrap_or_else(|p| p.into_inner()).clear();
        let Some(r) = &self.remote else {
            return self.locked(|| {
                if !force {
                    self.check_fence(token)?;
                }
                let tmp = self.dir.join(format!(".{FENCE_FILE}-{}", std::process::id()));
                write_durably(&tmp, &json)?;
                let dest = self.dir.join(FENCE_FILE);
                std::fs::rename(&tmp, &dest).map_err(|e| io(&dest, e))?;
                sync_dir(&self.dir)
            });
        };
        // A conditional write, read again when someone wrote between.
        for _ in 0..8 {
            let current = self.fence_versioned()?;
            if let Some((f, _)) = &current
                && f.token > token
                && !force
            {
                return self.check_fence(token);
            }
            let seen = current.as_ref().map(|(_, v)| v.clone().ok_or_else(|| io(&self.dir, "no version")));
            let seen = seen.transpose()?;
            if r.put_if(FENCE_FILE, json.clone(), seen.as_ref())? {
                return Ok(());
            }
        }
        Err(CheckpointError::Fenced(format!(
            "{}: the fence kept changing while this coordinator claimed it; another coordinator runs the job",
            r.url_of(FENCE_FILE)
        )))
    }

    /// Writes a checkpoint of the state `values` (laid out as `layout`) at
    /// `manifest.step`; prunes old ones.
    pub fn save(
        &self,
        layout: &Layout,
        values: &[f32],
        manifest: Manifest,
    ) -> Result<PathBuf, CheckpointError> {
        self.save_with_tables(layout, values, &[], manifest)
    }

    /// [`Checkpoints::save`], with the job's sparse tables at the same step
    /// in the same state file.
    pub fn save_with_tables(
        &self,
        layout: &Layout,
        values: &[f32],
        tables: &[crate::ps::SavedTable],
        manifest: Manifest,
    ) -> Result<PathBuf, CheckpointError> {
        // Local writes hold the directory's lock whether or not fenced: a
        // coordinator's clean-up and repair wait for them (see `locked`).
        // Unfenced, on a file system without locks (NFS without its lock
        // service), a write goes on without it, as it did before.
        let lenient = manifest.fence.is_none();
        self.locked_with(lenient, || self.save_unfenced((layout, values, tables), manifest))
    }

    fn save_unfenced(
        &self,
        (layout, values, tables): (&Layout, &[f32], &[crate::ps::SavedTable]),
        manifest: Manifest,
    ) -> Result<PathBuf, CheckpointError> {
        if let Some(token) = manifest.fence {
            self.check_fence(token)?;
        }
        let name = step_name(manifest.step);
        let fence = manifest.fence;
        let at = match &self.remote {
            Some(r) => self.save_to_objects(r, &name, (layout, values, tables), manifest)?,
            None => self.save_to_directory(&name, (layout, values, tables), manifest)?,
        };
        self.known_good(&at);
        self.prune(fence);
        Ok(at)
    }

    /// Writes the checkpoint `name` to object storage: its files under names
    /// of their own, then switched to by one write of the checksum (naming
    /// the manifest), so that a rewrite of a step never touches the copy it
    /// replaces before the new one is whole.
    fn save_to_objects(
        &self,
        r: &ObjectDir,
        name: &str,
        (layout, values, tables): (&Layout, &[f32], &[crate::ps::SavedTable]),
        mut manifest: Manifest,
    ) -> Result<PathBuf, CheckpointError> {
        let at = PathBuf::from(r.url_of(name));
        let upload = ObjectUpload::new(r, name, &at)?;
        let sum_rel = format!("{name}/{SUM_FILE}");
        let before = r.get_versioned(&sum_rel)?;
        let state = encode_state(layout, values, tables, &at)?;
        manifest.files = BTreeMap::from([(upload.state_name.clone(), hex::encode(Sha256::digest(&state)))]);
        let json = serde_json::to_vec_pretty(&manifest).map_err(|e| io(&at, e))?;
        let sum = format!("{} {}", hex::encode(Sha256::digest(&json)), upload.manifest_name).into_bytes();
        upload.put(state, json)?;
        // The fence again, just before the switch: a coordinator that was
        // deposed while it uploaded stops here.
        if let Some(token) = manifest.fence
            && let Err(e) = self.check_fence(token)
        {
            upload.discard();
            return Err(e);
        }
        // Only if no one switched this step since it was read (a newer
        // coordinator's write of it is never replaced).
        if !r.put_if(&sum_rel, sum, before.as_ref().map(|(_, v)| v))? {
            upload.discard();
            if let Some(token) = manifest.fence {
                self.check_fence(token)?;
            }
            return Err(CheckpointError::Overtaken { url: r.url_of(name) });
        }
        if let Some((old_sum, _)) = before {
            upload.remove_replaced(&old_sum);
        }
        Ok(at)
    }

    /// Writes the checkpoint `name` into a temporary directory, then renames
    /// it into place in the local directory.
    fn save_to_directory(
        &self,
        name: &str,
        state: (&Layout, &[f32], &[crate::ps::SavedTable]),
        manifest: Manifest,
    ) -> Result<PathBuf, CheckpointError> {
        std::fs::create_dir_all(&self.dir).map_err(|e| io(&self.dir, e))?;
        let tmp = self.dir.join(format!(".tmp-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
        let dest = self.dir.join(name);
        let written = write_checkpoint_files(&tmp, state, manifest)
            .and_then(|()| self.move_into_place(&tmp, &dest, name));
        if let Err(e) = written {
            // A partial write holds space the next write may need (a disk
            // that filled): it goes now, not at the job's next start.
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
        // `latest` names the newest complete checkpoint, for people and tools.
        // Only ever forward (names sort by step): an older step written late
        // does not take it back.
        let pointer = self.dir.join(LATEST);
        let newer = std::fs::read_to_string(&pointer).is_ok_and(|was| was.trim() > name);
        if !newer {
            let next = self.dir.join(format!("{LATEST}.tmp-{}", std::process::id()));
            let written = write_durably(&next, format!("{name}\n").as_bytes())
                .and_then(|()| std::fs::rename(&next, &pointer).map_err(|e| io(&pointer, e)));
            if let Err(e) = written {
                tracing::warn!("{}: {e}", pointer.display());
            }
        }
        Ok(dest)
    }

    /// Renames the complete checkpoint `tmp` to `dest`; a copy already at
    /// `dest` is moved aside first and removed only once the new one is
    /// durable (a crash between the renames is repaired by [`Checkpoints::list`]).
    fn move_into_place(&self, tmp: &Path, dest: &Path, name: &str) -> Result<(), CheckpointError> {
        let aside = self.dir.join(format!(".old-{name}-{}", std::process::id()));
        let replacing = dest.exists();
        if replacing {
            let _ = std::fs::remove_dir_all(&aside);
            std::fs::rename(dest, &aside).map_err(|e| io(dest, e))?;
        }
        std::fs::rename(tmp, dest).map_err(|e| io(dest, e))?;
        sync_dir(&self.dir)?;
        if replacing {
            let _ = std::fs::remove_dir_all(&aside);
        }
        Ok(())
    }

    fn known_good(&self, path: &Path) {
        self.good.lock().unwrap_or_else(|p| p.into_inner()).insert(path.to_path_buf());
    }

    /// Whether the checkpoint at `path` verifies (read once per process).
    fn verifies(&self, path: &Path) -> Result<bool, CheckpointError> {
        if self.good.lock().unwrap_or_else(|p| p.into_inner()).contains(path) {
            return Ok(true);
        }
        match self.verify_unread(path) {
            Ok(()) => {
                self.known_good(path);
                Ok(true)
            }
            Err(CheckpointError::Corrupt { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Keeps the newest `keep` checkpoints that verify. An unusable one goes
    /// only once a newer good one exists; the newest good one always stays.
    /// A checkpoint that cannot be read (the store failing, not the
    /// checkpoint) stops the pruning, as a failed listing does: nothing is
    /// removed on a guess, and the next write prunes again.
    fn prune(&self, token: Option<u64>) {
        // A writer the fence has deposed removes nothing.
        if let Some(token) = token
            && let Err(e) = self.check_fence(token)
        {
            tracing::warn!("checkpoints not pruned: {e}");
            return;
        }
        let all = match self.list() {
            Ok(all) => all,
            Err(e) => {
                tracing::warn!("checkpoints not pruned: {e}");
                return;
            }
        };
        let mut kept_good = 0;
        let mut doomed = Vec::new();
        for (_, path) in all.iter().rev() {
            match self.verifies(path) {
                Ok(true) if kept_good < self.keep => kept_good += 1,
                Ok(true) => doomed.push(path),
                // Unusable, behind a newer good one.
                Ok(false) if kept_good > 0 => doomed.push(path),
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!("checkpoints not pruned: {e}");
                    return;
                }
            }
        }
        for path in doomed {
            self.remove(path);
            self.good.lock().unwrap_or_else(|p| p.into_inner()).remove(path);
        }
    }

    /// Sets a finished run's checkpoints aside (`step-N` becomes
    /// `finished-step-N`), out of the way of a run that trains the job
    /// again from step 0: nothing resumes from them or prunes them. Returns
    /// how many were set aside. Checkpoints in object storage cannot be
    /// renamed: they are refused, naming the location.
    pub fn set_aside_finished(&self) -> Result<usize, CheckpointError> {
        if let Some(r) = &self.remote {
            return Err(CheckpointError::Io {
                path: r.url_of(""),
                detail: "a job's checkpoints in object storage cannot be set aside for --restart; \
                         remove them (or choose another --checkpoint-dir) to train the job again"
                    .into(),
            });
        }
        let all = self.list()?;
        // `latest` names none of them from now on: the new run's first
        // checkpoint writes it again.
        let _ = std::fs::remove_file(self.dir.join(LATEST));
        for (_, path) in &all {
            let Some(name) = path.file_name() else { continue };
            let aside = self.dir.join(format!("{FINISHED_PREFIX}{}", name.to_string_lossy()));
            // One set aside by an earlier restart is older than this one.
            if aside.exists() {
                std::fs::remove_dir_all(&aside).map_err(|e| io(&aside, e))?;
            }
            std::fs::rename(path, &aside).map_err(|e| io(path, e))?;
        }
        sync_dir(&self.dir)?;
        self.good.lock().unwrap_or_else(|p| p.into_inner()).clear();
        Ok(all.len())
    }

    /// Removes the checkpoints [`Checkpoints::set_aside_finished`] set
    /// aside (once the run that trained the job again has finished).
    pub fn remove_set_aside(&self) -> Vec<PathBuf> {
        if self.remote.is_some() {
            return Vec::new();
        }
        let mut removed = Vec::new();
        for e in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            let set_aside = e.file_name().to_string_lossy().starts_with(FINISHED_PREFIX);
            if set_aside && e.path().is_dir() && std::fs::remove_dir_all(e.path()).is_ok() {
                removed.push(e.path());
            }
        }
        removed
    }

    /// Removes what an interrupted writer left: temporary directories, once
    /// a checkpoint moved aside by a crash is put back. Under the lock: a
    /// writer still at work (the rank 0 of a coordinator taken over, its
    /// write outlasting the lease) is waited for, never cut short.
    pub fn clean_leftovers(&self) -> Vec<PathBuf> {
        if self.remote.is_some() {
            // Objects are written whole: nothing is left half written.
            return Vec::new();
        }
        let cleaned = self.locked(|| {
            let listed = || std::fs::read_dir(&self.dir).into_iter().flatten().flatten().collect::<Vec<_>>();
            self.put_back_moved_aside(&listed());
            let mut removed = Vec::new();
            for e in listed() {
                let name = e.file_name().to_string_lossy().into_owned();
                let leftover = name.starts_with(".tmp-step-") || name.starts_with(".old-step-");
                if leftover && e.path().is_dir() && std::fs::remove_dir_all(e.path()).is_ok() {
                    removed.push(e.path());
                }
            }
            Ok(removed)
        });
        // A directory that cannot be locked is the resume's error to say.
        cleaned.unwrap_or_default()
    }

    /// Reads and verifies the checkpoint `path` names: a checkpoint's own
    /// directory, or a directory of checkpoints, whose newest complete one
    /// is read (the one its `latest` file names, else the newest `step-*`
    /// that verifies).
    pub fn read_newest(path: &Path) -> Result<Restored, CheckpointError> {
        let own = path.file_name().is_some_and(|n| n.to_string_lossy().starts_with("step-"));
        if own || path.join(SUM_FILE).exists() {
            return Self::read(path);
        }
        // The newest that verifies: `latest` names it when all went well,
        // and a pointer left behind by a failed write is never trusted over it.
        let mut steps: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|e| io(path, e))?
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("step-") && e.path().is_dir())
            .map(|e| e.path())
            .collect();
        steps.sort();
        let mut why = Vec::new();
        for p in steps.into_iter().rev() {
            match Self::read(&p) {
                Ok(r) => {
                    if !why.is_empty() {
                        tracing::warn!(
                            "{}: newer checkpoints unusable ({}); read this one",
                            p.display(),
                            why.join("; ")
                        );
                    }
                    return Ok(r);
                }
                Err(e @ CheckpointError::Corrupt { .. }) => why.push(e.to_string()),
                // Not the checkpoint's fault (a file that cannot be read):
                // an older one would be read in its place unseen.
                Err(e) => return Err(e),
            }
        }
        Err(corrupt(
            path,
            match why.is_empty() {
                true => "neither a checkpoint nor a directory of checkpoints (no step-* in it)".to_string(),
                false => format!("no complete checkpoint in it: {}", why.join("; ")),
            },
        ))
    }

    /// Reads and verifies the checkpoint in the local directory `path`.
    pub fn read(path: &Path) -> Result<Restored, CheckpointError> {
        Self::verify(path, |name| {
            let file = path.join(name);
            std::fs::read(&file).map_err(|e| match e.kind() {
                // A file the writer never got to: an incomplete checkpoint.
                std::io::ErrorKind::NotFound => corrupt(&file, "no such file; not a complete checkpoint"),
                _ => io(&file, e),
            })
        })
    }

    /// Reads and verifies the checkpoint at `path`, as [`Checkpoints::list`]
    /// gives it; one written by a deposed coordinator (see [`Fence`]) is
    /// unusable.
    pub fn read_at(&self, path: &Path) -> Result<Restored, CheckpointError> {
        let r = self.read_unfenced(path)?;
        self.unless_deposed(path, &r.manifest)?;
        Ok(r)
    }

    /// Refuses a checkpoint a deposed coordinator wrote (see [`Fence`]).
    fn unless_deposed(&self, path: &Path, manifest: &Manifest) -> Result<(), CheckpointError> {
        if let Some(f) = self.fence()?
            && f.deposes(manifest)
        {
            return Err(corrupt(
                path,
                format!(
                    "written by a deposed coordinator (lease token {}, below the token {} of the one that took \
                     the job over at step {})",
                    manifest.fence.unwrap_or(0),
                    f.token,
                    f.from_step
                ),
            ));
        }
        Ok(())
    }

    fn read_unfenced(&self, path: &Path) -> Result<Restored, CheckpointError> {
        let Some(r) = &self.remote else { return Self::read(path) };
        let shown = path.to_string_lossy();
        let rel = r.rel_of(&shown).ok_or_else(|| io(path, format!("not under {}", self.dir.display())))?;
        Self::verify(path, |name| {
            let at = format!("{rel}/{name}");
            match r.get(&at) {
                Ok(Some(b)) => Ok(b),
                Ok(None) => Err(corrupt(&path.join(name), "no such object; not a complete checkpoint")),
                Err(detail) => Err(CheckpointError::Store(detail)),
            }
        })
    }

    /// Verifies a checkpoint whose files `fetch` reads, and decodes its state.
    fn verify(
        path: &Path,
        fetch: impl Fn(&str) -> Result<Vec<u8>, CheckpointError>,
    ) -> Result<Restored, CheckpointError> {
        let (manifest, state_name) = Self::verified_manifest(path, &fetch)?;
        let file = path.join(&state_name);
        let bytes = fetch(&state_name)?;
        Self::state_sum_matches(&manifest, &state_name, &file, Sha256::digest(&bytes).into())?;
        let (layout, values, tables) = read_state(&file, &bytes)?;
        Ok(Restored { path: path.to_path_buf(), manifest, layout, values, tables })
    }

    /// The manifest of the checkpoint at `path`, once it matches the
    /// checksum beside it, and the name of the state file it lists.
    fn verified_manifest(
        path: &Path,
        fetch: &impl Fn(&str) -> Result<Vec<u8>, CheckpointError>,
    ) -> Result<(Manifest, String), CheckpointError> {
        let sum_path = path.join("manifest.sha256");
        let recorded = fetch("manifest.sha256").map_err(|e| match e {
            CheckpointError::Corrupt { .. } => {
                corrupt(&sum_path, format!("no manifest checksum ({e}); not a complete checkpoint"))
            }
            e => e,
        })?;
        let recorded = String::from_utf8_lossy(&recorded).trim().to_string();
        // `<sha256>` (manifest.json) or `<sha256> <manifest's name>`.
        let (recorded, manifest_name) = match recorded.split_once(' ') {
            Some((sum, name)) if name.starts_with("manifest-") && !name.contains('/') => {
                (sum.to_string(), name.trim().to_string())
            }
            Some(_) => return Err(corrupt(&sum_path, "names no manifest of this checkpoint")),
            None => (recorded, "manifest.json".to_string()),
        };
        let text = fetch(&manifest_name)?;
        let actual = hex::encode(Sha256::digest(&text));
        if recorded != actual {
            return Err(corrupt(
                &path.join(&manifest_name),
                format!("sha256 {actual} does not match manifest.sha256 ({recorded})"),
            ));
        }
        let manifest: Manifest = serde_json::from_slice(&text)
            .map_err(|e| corrupt(&path.join(&manifest_name), format!("not a manifest: {e}")))?;
        let state_name = manifest
            .files
            .keys()
            .find(|f| f.ends_with(".safetensors") && !f.contains('/'))
            .cloned()
            .ok_or_else(|| corrupt(path, format!("manifest lists no {STATE_FILE}")))?;
        Ok((manifest, state_name))
    }

    /// Whether the state file `file`, whose sha256 is `got`, is the one
    /// the manifest lists.
    fn state_sum_matches(
        manifest: &Manifest,
        state_name: &str,
        file: &Path,
        got: [u8; 32],
    ) -> Result<(), CheckpointError> {
        let want = &manifest.files[state_name];
        let got = hex::encode(got);
        if &got != want {
            return Err(corrupt(file, format!("sha256 {got} does not match the manifest's {want}")));
        }
        Ok(())
    }

    /// Verifies the checkpoint at `path` without decoding its state: the
    /// manifest against its checksum and the state file against the
    /// manifest's sum, a local file read through in pieces (what pruning
    /// needs to know, at a fraction of the memory of reading it back); one
    /// written by a deposed coordinator is unusable.
    fn verify_unread(&self, path: &Path) -> Result<(), CheckpointError> {
        let manifest = match &self.remote {
            // An object comes whole; only its decoding is saved.
            Some(_) => return self.read_at(path).map(drop),
            None => {
                let fetch = |name: &str| {
                    let file = path.join(name);
                    std::fs::read(&file).map_err(|e| match e.kind() {
                        std::io::ErrorKind::NotFound => {
                            corrupt(&file, "no such file; not a complete checkpoint")
                        }
                        _ => io(&file, e),
                    })
                };
                let (manifest, state_name) = Self::verified_manifest(path, &fetch)?;
                let file = path.join(&state_name);
                let mut f = std::fs::File::open(&file).map_err(|e| match e.kind() {
                    std::io::ErrorKind::NotFound => corrupt(&file, "no such file; not a complete checkpoint"),
                    _ => io(&file, e),
                })?;
                let (mut hasher, mut piece) = (Sha256::new(), vec![0u8; 1 << 20]);
                loop {
                    match std::io::Read::read(&mut f, &mut piece) {
                        Ok(0) => break,
                        Ok(n) => hasher.update(&piece[..n]),
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(io(&file, e)),
                    }
                }
                Self::state_sum_matches(&manifest, &state_name, &file, hasher.finalize().into())?;
                manifest
            }
        };
        self.unless_deposed(path, &manifest)
    }

    /// The newest checkpoint that verifies, and the unusable ones skipped
    /// (newest first) with why; an error when the checkpoints cannot be
    /// listed or one cannot be read (a store error is never taken for a
    /// corrupt checkpoint: falling back past it would undo training).
    pub fn latest(&self) -> Result<(Option<Restored>, Vec<CheckpointError>), CheckpointError> {
        let mut skipped = Vec::new();
        for (_, path) in self.list()?.into_iter().rev() {
            match self.read_at(&path) {
                Ok(r) => {
                    self.known_good(&path);
                    return Ok((Some(r), skipped));
                }
                Err(e @ (CheckpointError::Io { .. } | CheckpointError::Store(_))) => {
                    return Err(CheckpointError::Io {
                        path: path.display().to_string(),
                        detail: format!(
                            "cannot be read, so it cannot be judged ({e}); fix the store and run again"
                        ),
                    });
                }
                Err(e) => {
                    tracing::warn!("checkpoint {} is unusable, trying the previous one: {e}", path.display());
                    skipped.push(e);
                }
            }
        }
        Ok((None, skipped))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(step: u64) -> Manifest {
        Manifest {
            step,
            epoch: step / 10,
            cursor: (step % 10) as usize * 32,
            seed: 7,
            hyperparams: Hyperparams { global_batch: 64, local_batch: 32, lr: 0.1, momentum: 0.9 },
            plugin_state: PluginState::of(&serde_json::json!({"autoscale": {"ceiling": 5}})).unwrap(),
            files: BTreeMap::new(),
            fence: None,
        }
    }

    fn layout() -> Layout {
        Layout::new(vec![TensorSpec::new("w", vec![4, 3]), TensorSpec::new("b", vec![3])]).unwrap()
    }

    /// A state whose `b[0]` is `mark`.
    fn state(mark: f32) -> Vec<f32> {
        let mut v = vec![0.5; 15];
        v[12] = mark;
        v
    }

    /// One store, walked through every way a checkpoint goes bad, in turn.
    #[test]
    fn keeps_the_last_k_and_falls_back_past_a_corrupt_one() {
        let dir = tempfile::tempdir().unwrap();
        let cps = Checkpoints::new(dir.path(), 2);
        for step in [10, 20, 30] {
            cps.save(&layout(), &state(step as f32), manifest(step)).unwrap();
        }
        let steps: Vec<u64> = cps.list().unwrap().into_iter().map(|(s, _)| s).collect();
        assert_eq!(steps, vec![20, 30], "only the last two are kept");
        let (r, skipped) = cps.latest().unwrap();
        let r = r.unwrap();
        assert!(skipped.is_empty());
        assert_eq!((r.manifest.step, r.tensor("b").unwrap()[0]), (30, 30.0));
        let kept: serde_json::Value = r.manifest.plugin_state.read().unwrap();
        assert_eq!(kept["autoscale"]["ceiling"], 5);
        assert_eq!((r.layout.clone(), r.values.clone()), (layout(), state(30.0)), "order and values kept");

        // Truncate the newest state file: reported by name, the previous one is used.
        let newest = cps.list().unwrap().last().unwrap().1.join(STATE_FILE);
        let bytes = std::fs::read(&newest).unwrap();
        std::fs::write(&newest, &bytes[..bytes.len() / 2]).unwrap();
        let (r, skipped) = cps.latest().unwrap();
        assert_eq!(r.unwrap().manifest.step, 20);
        assert_eq!(skipped.len(), 1);
        assert!(skipped[0].to_string().contains("step-0000000030/state.safetensors"), "{}", skipped[0]);

        // A garbled manifest too: nothing usable is left.
        std::fs::write(cps.list().unwrap()[0].1.join("manifest.json"), b"{not json").unwrap();
        let (r, skipped) = cps.latest().unwrap();
        assert!(r.is_none());
        assert_eq!(skipped.len(), 2);
        assert!(skipped[1].to_string().contains("does not match manifest.sha256"), "{}", skipped[1]);
    }

    /// Rewrites a checkpoint's state file as `edit` changes its header, and
    /// its checksums to match: a file whose hashes all agree.
    fn rewrite_header(at: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
        let state = at.join(STATE_FILE);
        let bytes = std::fs::read(&state).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        edit(&mut header);
        let mut text = serde_json::to_vec(&header).unwrap();
        text.resize(text.len().next_multiple_of(8), b' ');
        let mut out = (text.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&text);
        out.extend_from_slice(&bytes[8 + n..]);
        std::fs::write(&state, &out).unwrap();
        let sum = std::fs::read_to_string(at.join(SUM_FILE)).unwrap();
        let name = sum.trim().split_once(' ').map_or("manifest.json".to_string(), |(_, n)| n.to_string());
        let mut m: Manifest = serde_json::from_slice(&std::fs::read(at.join(&name)).unwrap()).unwrap();
        m.files.insert(STATE_FILE.into(), hex::encode(Sha256::digest(&out)));
        let text = serde_json::to_vec(&m).unwrap();
        std::fs::write(at.join(&name), &text).unwrap();
        let line = match sum.trim().split_once(' ') {
            Some((_, n)) => format!("{} {n}", hex::encode(Sha256::digest(&text))),
            None => hex::encode(Sha256::digest(&text)),
        };
        std::fs::write(at.join(SUM_FILE), line).unwrap();
    }

    #[test]
    fn a_tensor_order_naming_more_values_than_the_file_holds_is_a_corrupt_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let cps = Checkpoints::new(dir.path(), 3);
        for step in [10, 20] {
            cps.save(&layout(), &state(step as f32), manifest(step)).unwrap();
        }
        let newest = cps.list().unwrap().last().unwrap().1.clone();
        // Shapes whose product overflows, then one that only claims too much.
        for shape in [serde_json::json!([1u64 << 40, 1u64 << 40]), serde_json::json!([1u64 << 40])] {
            rewrite_header(&newest, |h| {
                let order = serde_json::json!({"tensors": [{"name": "w", "shape": shape}]});
                h["__metadata__"]["edl.layout"] = order.to_string().into();
            });
            let (r, skipped) = cps.latest().unwrap();
            assert_eq!(r.unwrap().manifest.step, 10, "the one before is used");
            assert_eq!(skipped.len(), 1);
            let e = skipped[0].to_string();
            assert!(e.contains("step-0000000020/state.safetensors"), "{e}");
            assert!(e.contains("its tensor order names more values than its"), "{e}");
        }
    }

    #[test]
    fn the_plugin_state_goes_through_a_manifest_as_written_and_an_earlier_manifest_still_reads() {
        #[derive(Debug, PartialEq, Serialize, Deserialize)]
        struct Kept {
            counts: Vec<u8>,
            name: String,
        }
        let kept = Kept { counts: vec![0, 1, 2, 1], name: "autoscale".into() };
        let manifest = Manifest {
            step: 7,
            epoch: 1,
            cursor: 3,
            seed: 9,
            hyperparams: Hyperparams::default(),
            plugin_state: PluginState::of(&kept).unwrap(),
            files: BTreeMap::new(),
            fence: None,
        };
        assert_eq!(manifest.plugin_state.json(), r#"{"counts":[0,1,2,1],"name":"autoscale"}"#);
        // Inside a message and in a manifest file, pretty or not: the same text, read back.
        for json in [serde_json::to_vec(&manifest).unwrap(), serde_json::to_vec_pretty(&manifest).unwrap()] {
            let back: Manifest = serde_json::from_slice(&json).unwrap();
            assert_eq!(back, manifest);
            assert_eq!(back.plugin_state.read::<Kept>().unwrap(), kept);
        }
        // As the commit that asks rank 0 for the checkpoint carries it, and as the worker reads it.
        use crate::control::proto::{ToWorker, encode};
        let commit = ToWorker::Commit {
            step: 7,
            checkpoint: Some(manifest.clone()),
            wait: false,
            stored: None,
            origin: false,
        };
        let line = encode(&commit).unwrap();
        match serde_json::from_slice::<ToWorker>(line.trim_ascii_end()).unwrap() {
            ToWorker::Commit { checkpoint: Some(m), .. } => {
                assert_eq!(m.plugin_state.read::<Kept>().unwrap(), kept)
            }
            _ => panic!("not the commit sent"),
        }
        // Written by an earlier version: an indented object; or none at all.
        let earlier = r#"{"step": 7, "epoch": 1, "cursor": 3, "seed": 9,
            "hyperparams": {"global_batch": 64, "local_batch": 32, "lr": 0.1, "momentum": 0.9},
            "plugin_state": {
                "counts": [0, 1, 2, 1],
                "name": "autoscale"
            }}"#;
        let back: Manifest = serde_json::from_str(earlier).unwrap();
        assert_eq!(back.plugin_state.read::<Kept>().unwrap(), kept);
        let none: Manifest = serde_json::from_str(
            r#"{"step": 7, "epoch": 1, "cursor": 3, "seed": 9,
            "hyperparams": {"global_batch": 64, "local_batch": 32, "lr": 0.1, "momentum": 0.9}}"#,
        )
        .unwrap();
        assert_eq!(none.plugin_state, PluginState::default());
        assert!(none.plugin_state.read::<Kept>().is_err(), "null is not the state");
    }

    #[test]
    fn in_object_storage_a_checkpoint_counts_once_its_checksum_is_written_and_old_ones_go() {
        let objects = ObjectDir::open("memory:///jobs/mnist/checkpoints").unwrap();
        let cps = Checkpoints::in_objects(objects.clone(), 2);
        cps.probe().unwrap();
        for step in [10, 20, 30] {
            let at = cps.save(&layout(), &state(step as f32), manifest(step)).unwrap();
            assert_eq!(at, PathBuf::from(format!("memory:///jobs/mnist/checkpoints/step-{step:010}")));
        }
        let steps: Vec<u64> = cps.list().unwrap().into_iter().map(|(s, _)| s).collect();
        assert_eq!(steps, vec![20, 30], "only the last two are kept");
        assert!(!objects.dirs().unwrap().contains(&"step-0000000010".to_string()), "pruned objects are gone");
        let (r, skipped) = cps.latest().unwrap();
        assert!(skipped.is_empty());
        assert_eq!((r.unwrap().values, 30.0), (state(30.0), 30.0));

        // A writer that stopped before the checksum: skipped as incomplete.
        let half = "step-0000000040";
        objects.put(&format!("{half}/state.safetensors"), vec![1, 2, 3]).unwrap();
        objects.put(&format!("{half}/manifest.json"), b"{}".to_vec()).unwrap();
        let (r, skipped) = cps.latest().unwrap();
        assert_eq!(r.unwrap().manifest.step, 30);
        assert!(skipped[0].to_string().contains("not a complete checkpoint"), "{}", skipped[0]);
        // A damaged state: named, and the one before is used.
        objects.delete_dir(half).unwrap();
        let pointer = objects.get("step-0000000030/manifest.sha256").unwrap().unwrap();
        let pointer = String::from_utf8(pointer).unwrap();
        let (_, manifest_name) = pointer.split_once(' ').expect("the checksum names its manifest");
        let m: Manifest = serde_json::from_slice(
            &objects.get(&format!("step-0000000030/{manifest_name}")).unwrap().unwrap(),
        )
        .unwrap();
        let state_name = m.files.keys().next().unwrap().clone();
        assert!(state_name.starts_with("state-") && state_name.ends_with(".safetensors"), "{state_name}");
        objects.put(&format!("step-0000000030/{state_name}"), b"garbage".to_vec()).unwrap();
        let (r, skipped) = cps.latest().unwrap();
        assert_eq!(r.unwrap().manifest.step, 20);
        assert!(skipped[0].to_string().contains(&format!("step-0000000030/{state_name}")), "{}", skipped[0]);

        // Markers beside the checkpoints.
        assert!(!cps.has_file("complete.json").unwrap());
        cps.put_file("complete.json", b"[]").unwrap();
        assert!(cps.has_file("complete.json").unwrap());
        cps.remove_file("complete.json");
        assert!(!cps.has_file("complete.json").unwrap());
    }

    #[test]
    fn a_finished_run_set_aside_is_neither_resumed_nor_pruned_until_removed() {
        let dir = tempfile::tempdir().unwrap();
        let cps = Checkpoints::new(dir.path(), 2);
        cps.save(&layout(), &state(1.0), manifest(50)).unwrap();
        cps.save(&layout(), &state(2.0), manifest(60)).unwrap();
        assert_eq!(cps.set_aside_finished().unwrap(), 2);
        assert!(cps.list().unwrap().is_empty());
        assert!(cps.latest().unwrap().0.is_none(), "nothing to resume from");
        // The new run writes its own (lower steps); the old ones stay.
        cps.save(&layout(), &state(3.0), manifest(10)).unwrap();
        cps.save(&layout(), &state(4.0), manifest(20)).unwrap();
        cps.save(&layout(), &state(5.0), manifest(30)).unwrap();
        assert_eq!(cps.list().unwrap().iter().map(|(s, _)| *s).collect::<Vec<_>>(), [20, 30]);
        // `latest` names the new run's newest, not the finished run's.
        assert_eq!(std::fs::read_to_string(dir.path().join(LATEST)).unwrap(), "step-0000000030\n");
        let aside = dir.path().join("finished-step-0000000060");
        assert_eq!(Checkpoints::read(&aside).unwrap().manifest.step, 60, "the finished state is intact");
        let removed = cps.remove_set_aside();
        assert_eq!(removed.len(), 2);
        assert!(!aside.exists());
        assert_eq!(cps.latest().unwrap().0.unwrap().manifest.step, 30);
    }

    #[test]
    fn latest_names_the_newest_and_the_directory_reads_as_its_newest_complete_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let cps = Checkpoints::new(dir.path(), 3);
        let none = Checkpoints::read_newest(dir.path()).err().unwrap().to_string();
        assert!(none.contains("no step-*"), "{none}");
        for step in [10, 20] {
            cps.save(&layout(), &state(step as f32), manifest(step)).unwrap();
        }
        assert_eq!(std::fs::read_to_string(dir.path().join(LATEST)).unwrap(), "step-0000000020\n");
        assert_eq!(Checkpoints::read_newest(dir.path()).unwrap().manifest.step, 20);
        // A checkpoint's own directory is read as it is.
        assert_eq!(Checkpoints::read_newest(&dir.path().join("step-0000000010")).unwrap().manifest.step, 10);
        // An older step written late does not take the pointer back.
        cps.save(&layout(), &state(5.0), manifest(5)).unwrap();
        assert_eq!(std::fs::read_to_string(dir.path().join(LATEST)).unwrap(), "step-0000000020\n");
        std::fs::remove_dir_all(dir.path().join("step-0000000005")).unwrap();
        // The newest broken: the one before it, whatever `latest` says.
        std::fs::remove_file(dir.path().join("step-0000000020/manifest.sha256")).unwrap();
        assert_eq!(Checkpoints::read_newest(dir.path()).unwrap().manifest.step, 10);
        // A checkpoint's own directory, incomplete, is refused as such.
        let e = Checkpoints::read_newest(&dir.path().join("step-0000000020")).err().unwrap().to_string();
        assert!(e.contains("not a complete checkpoint"), "{e}");
        // Nothing usable: each is named with why.
        std::fs::remove_file(dir.path().join("step-0000000010/manifest.sha256")).unwrap();
        let e = Checkpoints::read_newest(dir.path()).err().unwrap().to_string();
        assert!(e.contains("no complete checkpoint") && e.contains("step-0000000010"), "{e}");
        // The pointer is no checkpoint to the job's own listing.
        assert_eq!(cps.list().unwrap().len(), 2);
    }

    #[test]
    fn a_manifest_altered_into_other_valid_json_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let cps = Checkpoints::new(dir.path(), 3);
        cps.save(&layout(), &state(1.0), manifest(10)).unwrap();
        cps.save(&layout(), &state(1.0), manifest(20)).unwrap();
        let newest = cps.list().unwrap().last().unwrap().1.join("manifest.json");
        let text = std::fs::read_to_string(&newest).unwrap();
        std::fs::write(&newest, text.replace("\"cursor\": 0", "\"cursor\": 64")).unwrap();
        let (r, skipped) = cps.latest().unwrap();
        assert_eq!(r.unwrap().manifest.step, 10);
        assert!(skipped[0].to_string().contains("does not match manifest.sha256"), "{}", skipped[0]);
    }

    #[test]
    fn rewriting_a_step_never_leaves_it_missing_and_leftovers_are_cleaned() {
        let dir = tempfile::tempdir().unwrap();
        let cps = Checkpoints::new(dir.path(), 3);
        cps.save(&layout(), &state(1.0), manifest(10)).unwrap();
        cps.save(&layout(), &state(42.0), manifest(10)).unwrap();
        assert_eq!(cps.latest().unwrap().0.unwrap().tensor("b").unwrap()[0], 42.0);
        // A crash after the old copy was moved aside and before the new one
        // took its place: the old one comes back.
        let step = cps.list().unwrap()[0].1.clone();
        std::fs::rename(&step, dir.path().join(".old-step-0000000010-999")).unwrap();
        std::fs::create_dir(dir.path().join(".tmp-step-0000000020-999")).unwrap();
        assert_eq!(cps.latest().unwrap().0.unwrap().manifest.step, 10);
        let removed = cps.clean_leftovers();
        assert_eq!(removed.len(), 1, "{removed:?}");
        assert!(!dir.path().join(".tmp-step-0000000020-999").exists());
    }

    #[test]
    fn an_empty_directory_has_no_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let (r, skipped) = Checkpoints::new(dir.path().join("none"), 3).latest().unwrap();
        assert!(r.is_none() && skipped.is_empty());
    }

    #[test]
    fn a_directory_that_cannot_be_listed_is_an_error_not_an_empty_one() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("not-a-directory");
        std::fs::write(&file, b"x").unwrap();
        let cps = Checkpoints::new(&file, 3);
        let e = cps.latest().err().expect("listing a file as a directory fails");
        assert!(e.to_string().contains("not-a-directory"), "{e}");
        assert!(cps.list().is_err());
    }

    /// An object store in memory that can be told to fail: to list (as a
    /// bucket whose credentials lack the list permission), or to write
    /// objects whose names end a certain way (a crash at that write); it
    /// counts multipart uploads.
    #[derive(Debug, Default)]
    struct Faulty {
        inner: object_store::memory::InMemory,
        refuse_listing: bool,
        fail_puts_ending: std::sync::Mutex<Option<&'static str>>,
        multipart_uploads: std::sync::atomic::AtomicUsize,
    }

    impl std::fmt::Display for Faulty {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Faulty")
        }
    }

    type Stream<T> = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = object_store::Result<T>> + Send>>;

    #[async_trait::async_trait]
    impl object_store::ObjectStore for Faulty {
        async fn put_opts(
            &self,
            at: &object_store::path::Path,
            payload: object_store::PutPayload,
            opts: object_store::PutOptions,
        ) -> object_store::Result<object_store::PutResult> {
            let failing = *self.fail_puts_ending.lock().unwrap();
            if let Some(end) = failing
                && at.as_ref().ends_with(end)
            {
                return Err(object_store::Error::Generic {
                    store: "Faulty",
                    source: "the writer crashed".into(),
                });
            }
            self.inner.put_opts(at, payload, opts).await
        }
        async fn put_multipart_opts(
            &self,
            at: &object_store::path::Path,
            opts: object_store::PutMultipartOptions,
        ) -> object_store::Result<Box<dyn object_store::MultipartUpload>> {
            self.multipart_uploads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.inner.put_multipart_opts(at, opts).await
        }
        async fn get_opts(
            &self,
            at: &object_store::path::Path,
            opts: object_store::GetOptions,
        ) -> object_store::Result<object_store::GetResult> {
            self.inner.get_opts(at, opts).await
        }
        fn delete_stream(&self, at: Stream<object_store::path::Path>) -> Stream<object_store::path::Path> {
            self.inner.delete_stream(at)
        }
        fn list(&self, at: Option<&object_store::path::Path>) -> Stream<object_store::ObjectMeta> {
            if self.refuse_listing {
                return Box::pin(tokio_stream::once(Err(refused())));
            }
            self.inner.list(at)
        }
        async fn list_with_delimiter(
            &self,
            at: Option<&object_store::path::Path>,
        ) -> object_store::Result<object_store::ListResult> {
            if self.refuse_listing {
                return Err(refused());
            }
            self.inner.list_with_delimiter(at).await
        }
        async fn copy_opts(
            &self,
            from: &object_store::path::Path,
            to: &object_store::path::Path,
            opts: object_store::CopyOptions,
        ) -> object_store::Result<()> {
            self.inner.copy_opts(from, to, opts).await
        }
    }

    fn faulty() -> (std::sync::Arc<Faulty>, Checkpoints) {
        let store = std::sync::Arc::new(Faulty::default());
        let objects =
            ObjectDir::with_store(store.clone(), "jobs/mnist".into(), "s3://edl/jobs/mnist").unwrap();
        (store, Checkpoints::in_objects(objects, 3))
    }

    #[test]
    fn rewriting_a_step_in_object_storage_never_touches_the_copy_it_replaces() {
        let (store, cps) = faulty();
        cps.save(&layout(), &state(1.0), manifest(10)).unwrap();
        // The rewrite's writer dies at its switch: its new objects are
        // there, but the checkpoint is still the old one, whole.
        *store.fail_puts_ending.lock().unwrap() = Some("manifest.sha256");
        assert!(cps.save(&layout(), &state(2.0), manifest(10)).is_err());
        let fresh = Checkpoints::in_objects(cps.remote.clone().unwrap(), 3);
        let (r, skipped) = fresh.latest().unwrap();
        assert!(skipped.is_empty(), "{skipped:?}");
        assert_eq!(r.unwrap().tensor("b").unwrap()[0], 1.0);
        // A rewrite that completes replaces it, and what it replaced goes.
        *store.fail_puts_ending.lock().unwrap() = None;
        cps.save(&layout(), &state(3.0), manifest(10)).unwrap();
        assert_eq!(fresh.latest().unwrap().0.unwrap().tensor("b").unwrap()[0], 3.0);
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let names: Vec<String> = rt.block_on(async {
            use object_store::ObjectStore;
            use tokio_stream::StreamExt;
            let mut listing = store.inner.list(None);
            let mut names = Vec::new();
            while let Some(m) = listing.next().await {
                names.push(m.unwrap().location.to_string());
            }
            names
        });
        let states = names.iter().filter(|n| n.ends_with(".safetensors")).count();
        let manifests = names.iter().filter(|n| n.contains("/manifest-")).count();
        assert_eq!(
            (states, manifests),
            (2, 2),
            "the live copy and the crashed writer's leftovers: {names:?}"
        );
    }

    #[test]
    fn a_large_state_goes_up_in_parts() {
        let (store, cps) = faulty();
        let objects = cps.remote.clone().unwrap();
        let big = vec![7u8; 20 << 20];
        objects.put_in_parts_from("big", big.clone(), 1 << 20).unwrap();
        assert_eq!(store.multipart_uploads.load(std::sync::atomic::Ordering::Relaxed), 1);
        assert_eq!(objects.get("big").unwrap().unwrap(), big);
        objects.put_in_parts_from("small", vec![1; 10], 1 << 20).unwrap();
        assert_eq!(store.multipart_uploads.load(std::sync::atomic::Ordering::Relaxed), 1, "one PUT");
    }

    #[test]
    fn a_deposed_coordinator_can_neither_write_nor_be_resumed_from() {
        let dir = tempfile::tempdir().unwrap();
        let (_, remote) = faulty();
        for cps in [Checkpoints::new(dir.path(), 3), remote] {
            let fenced = |step: u64, token: u64| Manifest { fence: Some(token), ..manifest(step) };
            cps.claim(5, 0, false).unwrap();
            cps.save(&layout(), &state(10.0), fenced(10, 5)).unwrap();
            // The old coordinator writes step 20 as the new one takes over
            // from step 10 (on object storage a write can get past the
            // check this way).
            let late = cps.save(&layout(), &state(20.0), fenced(20, 5)).unwrap();
            cps.claim(9, 10, false).unwrap();
            // From now on the old one is refused, by name ...
            let e = cps.save(&layout(), &state(30.0), fenced(30, 5)).unwrap_err();
            assert!(matches!(e, CheckpointError::Fenced(_)), "{e}");
            assert!(e.to_string().contains("lease token 9"), "{e}");
            assert!(matches!(cps.claim(5, 10, false), Err(CheckpointError::Fenced(_))));
            // ... and what it wrote late is never resumed from.
            let (r, skipped) = cps.latest().unwrap();
            assert_eq!(r.unwrap().manifest.step, 10);
            assert!(skipped[0].to_string().contains("deposed coordinator"), "{}", skipped[0]);
            // The new coordinator's own writes count, and prune the late one.
            cps.save(&layout(), &state(15.0), fenced(15, 9)).unwrap();
            cps.save(&layout(), &state(25.0), fenced(25, 9)).unwrap();
            assert_eq!(cps.latest().unwrap().0.unwrap().manifest.step, 25);
            assert!(!cps.list().unwrap().iter().any(|(_, p)| *p == late), "the deposed write is pruned");
            // A coordinator whose store is its own replaces the claim.
            cps.claim(0, 25, true).unwrap();
            cps.save(&layout(), &state(26.0), fenced(26, 0)).unwrap();
        }
    }

    fn refused() -> object_store::Error {
        object_store::Error::PermissionDenied {
            path: "jobs".into(),
            source: "s3:ListBucket not allowed".into(),
        }
    }

    #[test]
    fn a_store_that_cannot_list_is_an_error_not_an_empty_one() {
        let store = std::sync::Arc::new(Faulty { refuse_listing: true, ..Default::default() });
        let objects = ObjectDir::with_store(store, "jobs/mnist".into(), "s3://edl/jobs/mnist").unwrap();
        let cps = Checkpoints::in_objects(objects, 3);
        // Writing works (the preflight passes) ...
        cps.probe().unwrap();
        cps.save(&layout(), &state(1.0), manifest(10)).unwrap();
        // ... but what is there cannot be told: an error naming the store
        // and why, never "no checkpoint" (which would start the job over).
        let e = cps.latest().err().expect("a listing that fails is an error");
        let text = e.to_string();
        assert!(text.contains("s3://edl/jobs/mnist") && text.contains("ListBucket"), "{text}");
        assert!(cps.list().is_err());
    }

    /// Truncates the state file of the checkpoint at `step`.
    fn spoil(cps: &Checkpoints, step: u64) {
        let path = cps.list().unwrap().into_iter().find(|(s, _)| *s == step).unwrap().1;
        std::fs::write(path.join(STATE_FILE), b"torn").unwrap();
    }

    fn steps(cps: &Checkpoints) -> Vec<u64> {
        cps.list().unwrap().into_iter().map(|(s, _)| s).collect()
    }

    #[test]
    fn newer_unusable_checkpoints_never_cost_the_good_ones_written_after_them() {
        let dir = tempfile::tempdir().unwrap();
        let cps = Checkpoints::new(dir.path(), 2);
        for step in [10, 20, 30] {
            cps.save(&layout(), &state(step as f32), manifest(step)).unwrap();
        }
        // 20 and 30 (the two keep 2 left) go bad: a new run (a process of
        // its own: nothing known good) finds no usable one and starts over.
        spoil(&cps, 20);
        spoil(&cps, 30);
        let rerun = Checkpoints::new(dir.path(), 2);
        let (r, skipped) = rerun.latest().unwrap();
        assert!(r.is_none() && skipped.len() == 2, "{skipped:?}");
        // It writes from the start again. The unusable ones go only behind a
        // newer good one, which here none is (their steps are higher): they
        // stay, and the newest two of the new ones with them.
        for step in [5, 6, 7] {
            rerun.save(&layout(), &state(step as f32), manifest(step)).unwrap();
        }
        assert_eq!(
            steps(&rerun),
            [6, 7, 20, 30],
            "the newest two good ones and the unusable ones above them"
        );
        let (r, _) = rerun.latest().unwrap();
        assert_eq!(r.unwrap().manifest.step, 7, "a kill now resumes from the newest good one");
        // A good one above the unusable ones: they go, and the oldest good one.
        rerun.save(&layout(), &state(40.0), manifest(40)).unwrap();
        assert_eq!(steps(&rerun), [7, 40]);
    }

    #[test]
    fn a_checkpoint_that_cannot_be_read_is_an_error_not_a_reason_to_go_back() {
        let dir = tempfile::tempdir().unwrap();
        let cps = Checkpoints::new(dir.path(), 3);
        for step in [10, 20] {
            cps.save(&layout(), &state(step as f32), manifest(step)).unwrap();
        }
        // The newest's state cannot be read (a directory where the file is:
        // EISDIR, as EACCES or EIO would be).
        let newest = cps.list().unwrap().last().unwrap().1.clone();
        std::fs::remove_file(newest.join(STATE_FILE)).unwrap();
        std::fs::create_dir(newest.join(STATE_FILE)).unwrap();
        let rerun = Checkpoints::new(dir.path(), 3);
        let Err(e) = rerun.latest() else { panic!("a checkpoint that cannot be read was skipped") };
        let e = e.to_string();
        assert!(e.contains("step-") && e.contains("cannot be read"), "{e}");
        // Nor is it passed over when the directory is read as a program's.
        let Err(e) = Checkpoints::read_newest(dir.path()) else { panic!("read the one before unseen") };
        assert!(e.to_string().contains(&newest.join(STATE_FILE).display().to_string()), "{e}");
        // Nor does a write prune on it.
        rerun.save(&layout(), &state(30.0), manifest(30)).unwrap();
        rerun.save(&layout(), &state(40.0), manifest(40)).unwrap();
        assert_eq!(steps(&rerun), [10, 20, 30, 40]);
    }

    #[test]
    fn a_write_that_fails_leaves_no_partial_copy_behind() {
        let dir = tempfile::tempdir().unwrap();
        let cps = Checkpoints::new(dir.path(), 3);
        cps.save(&layout(), &state(1.0), manifest(10)).unwrap();
        // Fails once its directory is made: a state of the wrong size.
        let e = cps.save(&layout(), &[0.0; 3], manifest(20)).unwrap_err();
        assert!(e.to_string().contains("3 values for a state of 15"), "{e}");
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into())
            .collect();
        assert!(names.iter().all(|n| !n.starts_with(".tmp-")), "{names:?}");
        assert_eq!(steps(&cps), [10]);
    }

    #[test]
    fn a_step_moved_aside_is_put_back_and_leftovers_cleaned_only_when_no_one_writes() {
        let dir = tempfile::tempdir().unwrap();
        let cps = Checkpoints::new(dir.path(), 3);
        cps.save(&layout(), &state(1.0), manifest(10)).unwrap();
        let aside = dir.path().join(".old-step-0000000010-999");
        std::fs::rename(dir.path().join(step_name(10)), &aside).unwrap();
        std::fs::create_dir(dir.path().join(".tmp-step-0000000020-999")).unwrap();
        // A writer between its renames (as it holds the lock): left alone.
        let writer = cps.lock_if_free().expect("the lock is free");
        assert!(cps.list().unwrap().is_empty() && aside.exists(), "repaired under a writer");
        let cleaning = {
            let cps = cps.clone();
            std::thread::spawn(move || cps.clean_leftovers())
        };
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert!(aside.exists(), "cleaned under a writer");
        assert!(dir.path().join(".tmp-step-0000000020-999").exists(), "cleaned under a writer");
        drop(writer);
        let removed = cleaning.join().unwrap();
        assert_eq!(removed, vec![dir.path().join(".tmp-step-0000000020-999")]);
        assert_eq!(steps(&cps), [10], "the step moved aside is back");
        assert_eq!(cps.latest().unwrap().0.unwrap().tensor("b").unwrap()[0], 1.0);
    }
}
