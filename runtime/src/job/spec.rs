//! What a job is, as every worker is told when it joins: its data, its
//! program (the built-in student or the user's own), its teachers, its
//! plugins and the bounds it runs within.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Where students get soft labels.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TeacherSource {
    /// Fixed OIP endpoints (`host:port`).
    Fixed(Vec<String>),
    /// Teachers registered in a store under a service name.
    Discovered { store: String, service: String },
    /// The teacher computed in each student's own process on its step's
    /// path (the seeds' "same GPUs"): the model at `model`, or with
    /// `emulate_row_us` > 0 a sleep that long a row instead.
    InProcess { model: std::path::PathBuf, emulate_row_us: u64 },
}

/// What the workers train.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Program {
    /// The built-in MLP student on a shipped data set.
    Builtin(BuiltinModel),
    /// The user's own program (`edl-runtime launch -- CMD ...`): it
    /// registers its state with the runtime and reads its samples itself.
    External { command: Vec<String> },
}

impl Program {
    /// What a checkpoint's state depends on besides the data order, to
    /// compare on resume.
    pub fn identity(&self) -> String {
        match self {
            Program::Builtin(m) => format!(
                "the built-in MLP {:?} on {} ({} test rows, split seed {})",
                m.layers, m.dataset, m.test_rows, m.split_seed
            ),
            Program::External { .. } => "an external program".into(),
        }
    }
}

/// The built-in student and its data.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BuiltinModel {
    /// `mnist5k` or `digits`.
    pub dataset: String,
    /// Rows held out for testing, and the seed of the split.
    pub test_rows: usize,
    pub split_seed: u64,
    /// Train on the first N training samples only (a small transfer set).
    pub train_samples: Option<usize>,
    /// Student layer sizes, input first.
    pub layers: Vec<usize>,
}

impl BuiltinModel {
    /// The default job's student: the 784-128-10 MLP on MNIST 5k (4000
    /// training and 1000 test images, split with seed 1).
    pub fn mnist5k() -> BuiltinModel {
        BuiltinModel {
            dataset: "mnist5k".into(),
            test_rows: 1000,
            split_seed: 1,
            train_samples: None,
            layers: vec![784, 128, 10],
        }
    }
}

/// Everything a worker needs to know about the job, sent when it joins.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobSpec {
    pub job: String,
    /// The job's data: the sample indices `0..samples`.
    pub samples: usize,
    /// Seed of each epoch's order (and of the built-in student's weights).
    pub seed: u64,
    /// Epochs the job trains for (read-ahead stops there).
    pub epochs: u64,
    pub program: Program,
    pub temperature: f32,
    pub alpha: f32,
    /// None: plain training on hard labels.
    pub teachers: Option<TeacherSource>,
    pub teacher_model_name: String,
    /// Reader-transform plugin (shipped: no worker host needs the file)
    /// and its configuration.
    pub transform: Option<ShippedPlugin>,
    pub transform_config: Vec<(String, String)>,
    /// Bound on every collective (and on building the ring), milliseconds.
    pub collective_timeout_ms: u64,
    /// Whether the gradient ring's data crosses in clear, authenticated
    /// only (otherwise it is encrypted too).
    #[serde(default)]
    pub gradients_in_clear: bool,
    pub checkpoint_dir: PathBuf,
    pub keep_checkpoints: usize,
    /// Extra time each step takes on each worker (to emulate slower devices), ms.
    pub step_delay_ms: u64,
    /// Where workers compute: `cpu` or `cuda:N`.
    pub device: String,
    /// The sandbox the workers load the reader transform into.
    pub plugin_deadline_ms: u64,
    pub plugin_memory_mib: usize,
    pub allow_native: bool,
    /// A worker whose teachers answer nothing for this long fails its step
    /// with [`crate::control::proto::FailCause::NoTeachers`], ms.
    #[serde(default = "default_teacher_wait_ms")]
    pub teacher_wait_ms: u64,
    /// A worker the coordinator hears nothing from (not even a heartbeat)
    /// for this long is declared dead, ms.
    #[serde(default = "default_worker_lease_ms")]
    pub worker_lease_ms: u64,
    /// A worker that lost its connection to the coordinator tries to reach
    /// it again for this long, to hear where it stands, ms (0: not at all).
    #[serde(default = "default_worker_reconnect_ms")]
    pub worker_reconnect_ms: u64,
    /// The bearer token and TLS trust for the teachers (sent only over the
    /// authenticated control connection; never printed).
    #[serde(default)]
    pub teacher_access: crate::distill::TeacherAccess,
    /// Which tensors the students send and read, and what outputs hold.
    #[serde(default)]
    pub teacher_io: crate::distill::TeacherIo,
    /// Request timeout, rows per request, requests in flight, cool-down.
    #[serde(default)]
    pub teacher_calls: crate::distill::TeacherCalls,
    /// Where a worker that lost its coordinator finds the next one: the
    /// job's store and the lease token of the coordinator that sent this
    /// (None: the job's store is the coordinator's own, nobody takes over).
    #[serde(default)]
    pub follow: Option<Follow>,
    /// The control protocol the coordinator speaks
    /// ([`crate::control::proto::PROTOCOL`]; 0: an edl from before it had a
    /// number): a worker of another refuses the job.
    #[serde(default)]
    pub protocol: u32,
    /// The job's parameter servers (None: it has none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ps: Option<PsTopology>,
}

/// Where a job's parameter servers serve, and how far pulls may run ahead.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PsTopology {
    /// Each server's id (shards are placed by it) and `host:port`.
    pub servers: Vec<(u64, String)>,
    /// Steps a pull may run ahead of the pushes applied (0: a step sees
    /// every update before it).
    pub staleness: u64,
    /// Servers holding each shard: its owner and the next in its
    /// rendezvous order (2: a server lost loses nothing).
    #[serde(default = "one")]
    pub replicas: usize,
    /// Whether the job may add servers (a server full makes a step wait
    /// for one, rather than fail).
    #[serde(default)]
    pub room: bool,
}

fn one() -> usize {
    1
}

/// How a worker follows the job's leader from one coordinator to the next.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
pub struct Follow {
    /// The job's store (`redis://...`, `etcd://...`); it may hold a password,
    /// so it travels only over the sealed control connection and is never printed.
    pub store: String,
    /// The lease token of the coordinator that welcomed the worker: a
    /// coordinator is followed only to one with a higher token.
    pub token: u64,
}

impl std::fmt::Debug for Follow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Follow {{ store: {:?}, token: {} }}", crate::store::redact(&self.store), self.token)
    }
}

/// The coordinator holding a job's lease, as the store names it for the
/// job's workers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Leader {
    /// Its control port, `host:port`.
    pub addr: String,
    /// Its lease token.
    pub token: u64,
}

fn default_teacher_wait_ms() -> u64 {
    20_000
}

fn default_worker_lease_ms() -> u64 {
    10_000
}

fn default_worker_reconnect_ms() -> u64 {
    30_000
}

/// A plugin the coordinator sends its workers: the file's bytes and their
/// SHA-256, checked by the worker before it loads them.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
pub struct ShippedPlugin {
    /// The file as the user named it (`--transform plugins/augment.wasm`):
    /// messages about the plugin name it so, wherever its bytes were written.
    pub name: String,
    /// SHA-256 of `bytes`, hex.
    pub sha256: String,
    #[serde(with = "base64_bytes")]
    pub bytes: Vec<u8>,
}

impl std::fmt::Debug for ShippedPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({} bytes, sha256 {})", self.name, self.bytes.len(), self.sha256)
    }
}

impl ShippedPlugin {
    /// Reads a plugin file to ship.
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Ok(ShippedPlugin { name: path.display().to_string(), sha256: sha256_hex(&bytes), bytes })
    }

    /// Checks the bytes against their hash and writes them (once per
    /// content) under `dir` as `<hash>/<name>`, for the plugin loader.
    pub fn unpack(&self, dir: &Path) -> anyhow::Result<PathBuf> {
        let got = sha256_hex(&self.bytes);
        if got != self.sha256 {
            anyhow::bail!(
                "plugin {}: the bytes received do not match their hash (sent {}, received {got})",
                self.name,
                self.sha256
            );
        }
        let name = Path::new(&self.name)
            .file_name()
            .ok_or_else(|| anyhow::anyhow!("plugin {:?}: no file name", self.name))?;
        let home = dir.join(&self.sha256);
        let path = home.join(name);
        if std::fs::read(&path).is_ok_and(|b| b == self.bytes) {
            return Ok(path);
        }
        std::fs::create_dir_all(&home).map_err(|e| anyhow::anyhow!("{}: {e}", home.display()))?;
        // Written aside and renamed: a loader never sees half a plugin.
        let part = home.join(format!(".{}.{}", std::process::id(), name.to_string_lossy()));
        std::fs::write(&part, &self.bytes)
            .and_then(|()| std::fs::rename(&part, &path))
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Ok(path)
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

/// Bytes as one base64 string in JSON (not an array of numbers).
mod base64_bytes {
    use base64::{Engine, engine::general_purpose::STANDARD};
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        STANDARD.decode(text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shipped_plugin_travels_as_base64_and_is_unpacked_only_when_its_hash_matches() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t.wasm");
        std::fs::write(&file, b"\0asm plugin bytes").unwrap();
        let p = ShippedPlugin::read(&file).unwrap();
        let json = serde_json::to_string(&p).unwrap();
        assert!(json.contains(r#""bytes":"AGFzbSBwbHVnaW4gYnl0ZXM=""#), "{json}");
        let back: ShippedPlugin = serde_json::from_str(&json).unwrap();
        assert_eq!(back, p);
        let unpacked = back.unpack(&dir.path().join("cache")).unwrap();
        assert_eq!(std::fs::read(&unpacked).unwrap(), b"\0asm plugin bytes");
        assert!(unpacked.ends_with(format!("{}/t.wasm", p.sha256)), "{}", unpacked.display());
        // Bytes changed on the way: refused, naming the plugin and both hashes.
        let mut bad = back.clone();
        bad.bytes[0] ^= 1;
        let e = bad.unpack(&dir.path().join("cache")).unwrap_err().to_string();
        // Named as the user passed it.
        let want = format!("plugin {}: the bytes received do not match their hash", file.display());
        assert!(e.contains(&want), "{e}");
        // A name cannot reach outside the directory it is unpacked into.
        let sneaky = ShippedPlugin { name: "../../evil.wasm".into(), ..p };
        let at = sneaky.unpack(&dir.path().join("cache")).unwrap();
        assert!(at.starts_with(dir.path().join("cache")), "{}", at.display());
    }
}
