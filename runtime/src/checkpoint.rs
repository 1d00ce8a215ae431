//! Checkpoints: the model and the optimiser state as safetensors, and a JSON
//! manifest (step, epoch, data cursor, hyperparameters, plugin state, the
//! sha256 of each file). A checkpoint is written into a temporary directory
//! and renamed into place, so a crash never leaves a half-written one under
//! a valid name; the last `keep` are kept. Loading takes the newest that
//! verifies; a corrupt or truncated one is reported by name and skipped.

use crate::model::{Mlp, ModelError};
use crate::train::Trainer;
use edl_plugin_sdk::Hyperparams;
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
    pub plugin_state: serde_json::Value,
    /// File name -> sha256, filled in by [`Checkpoints::save`].
    #[serde(default)]
    pub files: BTreeMap<String, String>,
}

/// A checkpoint read back.
pub struct Restored {
    pub path: PathBuf,
    pub manifest: Manifest,
    pub model: Mlp,
    pub velocity: Vec<f32>,
}

/// Why checkpoints could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {detail}")]
    Io { path: String, detail: String },
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// A directory of checkpoints `step-<n>/`.
pub struct Checkpoints {
    dir: PathBuf,
    keep: usize,
}

fn io(path: &Path, e: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Io { path: path.display().to_string(), detail: e.to_string() }
}

fn sha256_of(path: &Path) -> Result<String, CheckpointError> {
    Ok(hex::encode(Sha256::digest(std::fs::read(path).map_err(|e| io(path, e))?)))
}

impl Checkpoints {
    pub fn new(dir: impl Into<PathBuf>, keep: usize) -> Self {
        Checkpoints { dir: dir.into(), keep: keep.max(1) }
    }

    /// The checkpoint directories, oldest first.
    pub fn list(&self) -> Vec<(u64, PathBuf)> {
        let mut out: Vec<(u64, PathBuf)> = std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.strip_prefix("step-").and_then(|n| n.parse().ok()).map(|n| (n, e.path()))
            })
            .collect();
        out.sort();
        out
    }

    /// Writes a checkpoint of `trainer` at `manifest.step`; prunes old ones.
    pub fn save(&self, trainer: &Trainer, mut manifest: Manifest) -> Result<PathBuf, CheckpointError> {
        std::fs::create_dir_all(&self.dir).map_err(|e| io(&self.dir, e))?;
        let name = format!("step-{:010}", manifest.step);
        let tmp = self.dir.join(format!(".tmp-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
        trainer.model().save(&tmp.join("model.safetensors"))?;
        let v = crate::oip::f32_bytes(trainer.velocity());
        let view =
            TensorView::new(Dtype::F32, vec![trainer.velocity().len()], &v).map_err(|e| io(&tmp, e))?;
        safetensors::serialize_to_file([("velocity", view)], None, &tmp.join("optimizer.safetensors"))
            .map_err(|e| io(&tmp, e))?;
        manifest.files.clear();
        for f in ["model.safetensors", "optimizer.safetensors"] {
            manifest.files.insert(f.into(), sha256_of(&tmp.join(f))?);
        }
        let json = serde_json::to_vec_pretty(&manifest).map_err(|e| io(&tmp, e))?;
        std::fs::write(tmp.join("manifest.json"), json).map_err(|e| io(&tmp, e))?;
        let dest = self.dir.join(&name);
        let _ = std::fs::remove_dir_all(&dest);
        std::fs::rename(&tmp, &dest).map_err(|e| io(&dest, e))?;
        let all = self.list();
        for (_, old) in all.iter().take(all.len().saturating_sub(self.keep)) {
            let _ = std::fs::remove_dir_all(old);
        }
        Ok(dest)
    }

    fn read(path: &Path) -> Result<Restored, CheckpointError> {
        let text =
            std::fs::read(path.join("manifest.json")).map_err(|e| io(&path.join("manifest.json"), e))?;
        let manifest: Manifest = serde_json::from_slice(&text)
            .map_err(|e| io(&path.join("manifest.json"), format!("not a manifest: {e}")))?;
        for f in ["model.safetensors", "optimizer.safetensors"] {
            let want = manifest.files.get(f).ok_or_else(|| io(path, format!("manifest lists no {f}")))?;
            let got = sha256_of(&path.join(f))?;
            if &got != want {
                return Err(io(&path.join(f), format!("sha256 {got} does not match the manifest's {want}")));
            }
        }
        let model = Mlp::load(&path.join("model.safetensors"))?;
        let opt_path = path.join("optimizer.safetensors");
        let bytes = std::fs::read(&opt_path).map_err(|e| io(&opt_path, e))?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| io(&opt_path, e))?;
        let t = st.tensor("velocity").map_err(|e| io(&opt_path, e))?;
        let velocity: Vec<f32> =
            t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        Ok(Restored { path: path.to_path_buf(), manifest, model, velocity })
    }

    /// The newest checkpoint that verifies, and the ones skipped (newest
    /// first) with why.
    pub fn latest(&self) -> (Option<Restored>, Vec<CheckpointError>) {
        let mut skipped = Vec::new();
        for (_, path) in self.list().into_iter().rev() {
            match Self::read(&path) {
                Ok(r) => return (Some(r), skipped),
                Err(e) => {
                    tracing::warn!("checkpoint {} is unusable, trying the previous one: {e}", path.display());
                    skipped.push(e);
                }
            }
        }
        (None, skipped)
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
            plugin_state: serde_json::json!({"autoscale": {"ceiling": 5}}),
            files: BTreeMap::new(),
        }
    }

    #[test]
    fn keeps_the_last_k_and_falls_back_past_a_corrupt_one() {
        let dir = tempfile::tempdir().unwrap();
        let cps = Checkpoints::new(dir.path(), 2);
        let mut model = Mlp::random(&[4, 3, 2], 1);
        let mut t = Trainer::new(model.clone());
        for step in [10, 20, 30] {
            model.layers[0].bias[0] = step as f32;
            t = Trainer::new(model.clone());
            t.load_velocity(&vec![0.5; t.param_count()]).unwrap();
            cps.save(&t, manifest(step)).unwrap();
        }
        let steps: Vec<u64> = cps.list().into_iter().map(|(s, _)| s).collect();
        assert_eq!(steps, vec![20, 30], "only the last two are kept");
        let (r, skipped) = cps.latest();
        let r = r.unwrap();
        assert!(skipped.is_empty());
        assert_eq!((r.manifest.step, r.model.layers[0].bias[0]), (30, 30.0));
        assert_eq!(r.manifest.plugin_state["autoscale"]["ceiling"], 5);
        assert_eq!(r.velocity, vec![0.5; t.param_count()]);

        // Truncate the newest model file: reported by name, the previous one is used.
        let newest = cps.list().last().unwrap().1.join("model.safetensors");
        let bytes = std::fs::read(&newest).unwrap();
        std::fs::write(&newest, &bytes[..bytes.len() / 2]).unwrap();
        let (r, skipped) = cps.latest();
        assert_eq!(r.unwrap().manifest.step, 20);
        assert_eq!(skipped.len(), 1);
        assert!(skipped[0].to_string().contains("step-0000000030/model.safetensors"), "{}", skipped[0]);

        // A garbled manifest too: nothing usable is left.
        std::fs::write(cps.list()[0].1.join("manifest.json"), b"{not json").unwrap();
        let (r, skipped) = cps.latest();
        assert!(r.is_none());
        assert_eq!(skipped.len(), 2);
        assert!(skipped[1].to_string().contains("not a manifest"), "{}", skipped[1]);
    }

    #[test]
    fn an_empty_directory_has_no_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let (r, skipped) = Checkpoints::new(dir.path().join("none"), 3).latest();
        assert!(r.is_none() && skipped.is_empty());
    }
}
