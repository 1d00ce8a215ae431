//! The control protocol between the coordinator and its workers: one JSON
//! object per line over a TCP connection that the worker opens. The
//! connection is also the worker's liveness: when it closes (the process
//! died), the coordinator knows at once; and a worker sends a heartbeat
//! several times per lease, so one whose host or network went silent is
//! declared dead when its lease runs out.

use crate::checkpoint::Manifest;
use edl_host_gpu::comm::auth::Keys;
use edl_host_gpu::comm::sealed::{SealedReader, SealedWriter};
use edl_plugin_sdk::Hyperparams;
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use std::{
    io::{BufRead, BufReader, Write},
    net::TcpStream,
    path::{Path, PathBuf},
};

/// Where students get soft labels.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TeacherSource {
    /// Fixed OIP endpoints (`host:port`).
    Fixed(Vec<String>),
    /// Teachers registered in a store under a service name.
    Discovered { store: String, service: String },
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
    /// with [`FailCause::NoTeachers`], ms.
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

/// Why a rank failed a step, where the coordinator acts on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FailCause {
    /// No teacher answered within the job's teacher wait: retrying the step
    /// elsewhere cannot help.
    NoTeachers,
    /// The worker's state cannot take the job's committed state (a
    /// checkpoint of another model, a program that registered other
    /// tensors): no generation can fix that.
    State,
    /// No rank holds the job's state: its only holder was lost while
    /// handing it over. Only a checkpoint gives it back.
    NoState,
}

/// What the coordinator tells a worker.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ToWorker {
    /// The id of a worker that joined without one (sent before the welcome).
    Assigned {
        worker: u64,
    },
    Welcome(Box<JobSpec>),
    /// Form a generation: build its ring and start from the committed state.
    Generation(Box<Generation>),
    /// The generation's next steps, in order: one window. Windows are sent
    /// ahead, so a worker goes from one step to the next without waiting.
    Steps {
        generation: u64,
        steps: Vec<StepPlan>,
        /// This rank's share of each step, in the same order.
        shares: Vec<Share>,
    },
    /// Every step before `step` is committed: older rollback points can go.
    /// Rank 0 writes `checkpoint` (of the state at `step`) in the
    /// background, or before it answers with [`FromWorker::Saved`] when
    /// `wait` (the job's final state).
    Commit {
        step: u64,
        checkpoint: Option<Manifest>,
        wait: bool,
        /// The newest step the job's store holds the bookkeeping of: the
        /// rollback point a coordinator taking the job over starts from is
        /// kept until a later one is stored (None: none is kept back).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stored: Option<u64>,
    },
    Stop {
        reason: String,
    },
}

/// A generation: who is in it, where its ring meets, and the state it starts from.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Generation {
    pub generation: u64,
    pub rank: usize,
    pub world: usize,
    /// The rendezvous server of the generation's ring (`host:port`); the
    /// key is per generation.
    pub rendezvous: String,
    pub rendezvous_key: String,
    /// Steps committed so far: the state every rank starts from.
    pub committed_steps: u64,
    /// Start from this checkpoint (first generation of a resumed job).
    pub init: Option<PathBuf>,
}

/// One step of a window.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepPlan {
    /// Steps before this one (0 for the job's first step).
    pub step: u64,
    pub epoch: u64,
    /// Position in the epoch's permutation where this step starts.
    pub cursor: usize,
    pub hyper: Hyperparams,
}

/// A rank's share of a step: the positions `start..end` of the epoch's
/// permutation and the sample indices there.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Share {
    pub start: u32,
    pub end: u32,
    pub indices: Vec<u32>,
}

/// One rank's account of one step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepDone {
    pub step: u64,
    pub epoch: u64,
    /// The positions `start..end` of the epoch's permutation this rank trained on.
    pub start: u32,
    pub end: u32,
    /// This rank's summed loss divided by the global batch.
    pub loss: f64,
    /// Forward, backward and teacher wait on this rank, ms.
    pub compute_ms: f64,
    /// The program's own metrics of the step (accuracy, ...), each this
    /// rank's value weighted by its share of the step's samples, as `loss`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub metrics: Vec<(String, f64)>,
}

/// What a worker tells the coordinator.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FromWorker {
    Hello {
        worker: u64,
        pid: u32,
    },
    /// Data loaded, model built: the worker can be given a rank. A program
    /// says how many samples its data set holds (`len(dataset)`), which a
    /// job launched without `--samples` takes.
    Ready {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        samples: Option<u64>,
    },
    /// A window of steps is done on this rank.
    Done {
        generation: u64,
        steps: Vec<StepDone>,
        /// Ring set-up and parameter broadcast of a new generation, ms
        /// (with the generation's first window).
        setup_ms: f64,
    },
    /// Checkpoint writes that ended.
    Saved {
        checkpoints: Vec<Written>,
    },
    Failed {
        generation: u64,
        step: u64,
        error: String,
        #[serde(default)]
        cause: Option<FailCause>,
    },
    /// The worker is alive (sent several times per lease).
    Heartbeat,
    /// The worker was told to go (SIGTERM from its scheduler's preemption,
    /// a spot-instance notice): it goes on with the steps it was sent and
    /// leaves at the next boundary, as a planned scale-in.
    Leaving {
        reason: String,
    },
    /// A worker whose coordinator is gone, to the one that took the job
    /// over: it kept its process and its state, and holds rollback points
    /// at these committed steps (the first message on its new connection).
    Return {
        worker: u64,
        pid: u32,
        rollback: Vec<u64>,
    },
}

/// A checkpoint write that ended: where it is, or why it failed.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Written {
    /// The committed step it holds.
    pub step: u64,
    pub result: Result<PathBuf, String>,
}

/// Why a message could not be sent or read.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("{peer}: connection closed")]
    Closed { peer: String },
    #[error("{peer}: {detail}")]
    Io { peer: String, detail: String },
    #[error("{peer}: malformed message: {detail}")]
    Malformed { peer: String, detail: String },
}

/// TCP keepalive on a control connection: a peer whose host vanished (power
/// loss, a cut link) is noticed within about 20 s, instead of never on an
/// idle connection.
pub fn keepalive(stream: &TcpStream) {
    let ka = socket2::TcpKeepalive::new()
        .with_time(std::time::Duration::from_secs(5))
        .with_interval(std::time::Duration::from_secs(5));
    #[cfg(any(target_os = "linux", target_os = "macos"))]
    let ka = ka.with_retries(3);
    if let Err(e) = socket2::SockRef::from(stream).set_tcp_keepalive(&ka) {
        tracing::debug!("keepalive on a control connection: {e}");
    }
}

/// Bounds how long data written on `stream` may stay unacknowledged before
/// the connection fails (Linux `TCP_USER_TIMEOUT`): a peer cut off by the
/// network is noticed within `within` even while messages are waiting to go.
pub fn give_up_unacked(stream: &TcpStream, within: std::time::Duration) {
    #[cfg(any(target_os = "linux", target_os = "android", target_os = "fuchsia"))]
    if let Err(e) = socket2::SockRef::from(stream).set_tcp_user_timeout(Some(within)) {
        tracing::debug!("TCP_USER_TIMEOUT on a control connection: {e}");
    }
    #[cfg(not(any(target_os = "linux", target_os = "android", target_os = "fuchsia")))]
    let _ = (stream, within);
}

fn peer(s: &TcpStream) -> String {
    s.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "peer".into())
}

/// The sending side of a control connection: sealed with the keys of the
/// secret's exchange.
pub type Link = SealedWriter<TcpStream>;

/// Both sides of a proven connection, sealed with `keys`.
pub fn seal(stream: &TcpStream, keys: Keys) -> std::io::Result<(Link, SealedReader<TcpStream>)> {
    let (sealer, opener) = keys.split();
    Ok((
        SealedWriter::new(stream.try_clone()?, Some(sealer)),
        SealedReader::new(stream.try_clone()?, Some(opener)),
    ))
}

/// Writes one message as a JSON line.
pub fn send<T: Serialize>(stream: &mut Link, msg: &T) -> Result<(), ProtoError> {
    let line =
        encode(msg).map_err(|detail| ProtoError::Malformed { peer: peer(stream.get_ref()), detail })?;
    send_encoded(stream, &line)
}

/// One message as its JSON line, to send to many peers.
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, String> {
    let mut line = serde_json::to_vec(msg).map_err(|e| e.to_string())?;
    line.push(b'\n');
    Ok(line)
}

/// Writes a line made by [`encode`].
pub fn send_encoded(stream: &mut Link, line: &[u8]) -> Result<(), ProtoError> {
    stream.write_all(line).map_err(|e| ProtoError::Io { peer: peer(stream.get_ref()), detail: e.to_string() })
}

/// The sending side of a control connection, shared by the threads that
/// write to it: each message is written whole, under a lock.
#[derive(Clone)]
pub struct Sender(std::sync::Arc<std::sync::Mutex<Link>>);

impl Sender {
    pub fn new(stream: Link) -> Self {
        Sender(std::sync::Arc::new(std::sync::Mutex::new(stream)))
    }

    /// Writes one message as a JSON line.
    pub fn send<T: Serialize>(&self, msg: &T) -> Result<(), ProtoError> {
        let mut stream = self.0.lock().unwrap_or_else(|p| p.into_inner());
        send(&mut stream, msg)
    }
}

/// A reader of JSON-line messages.
pub struct Receiver {
    inner: BufReader<SealedReader<TcpStream>>,
    peer: String,
    line: String,
}

impl Receiver {
    pub fn new(stream: SealedReader<TcpStream>) -> Self {
        let peer = peer(stream.get_ref());
        Receiver { inner: BufReader::new(stream), peer, line: String::new() }
    }

    /// The next message; blocks until one arrives or the connection ends.
    pub fn recv<T: DeserializeOwned>(&mut self) -> Result<T, ProtoError> {
        self.line.clear();
        match self.inner.read_line(&mut self.line) {
            Ok(0) => Err(ProtoError::Closed { peer: self.peer.clone() }),
            Ok(_) => serde_json::from_str(&self.line)
                .map_err(|e| ProtoError::Malformed { peer: self.peer.clone(), detail: e.to_string() }),
            Err(e) => Err(ProtoError::Io { peer: self.peer.clone(), detail: e.to_string() }),
        }
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
