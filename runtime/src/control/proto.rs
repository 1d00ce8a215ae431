//! The control protocol between the coordinator and its workers: one JSON
//! object per line over a TCP connection that the worker opens. The
//! connection is also the worker's liveness: when it closes (the process
//! died), the coordinator knows at once; and a worker sends a heartbeat
//! several times per lease, so one whose host or network went silent is
//! declared dead when its lease runs out.

use crate::checkpoint::Manifest;
use crate::job::spec::JobSpec;
use edl_host_gpu::comm::auth::Keys;
use edl_host_gpu::comm::sealed::{SealedReader, SealedWriter};
use edl_plugin_sdk::Hyperparams;
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use std::{
    io::{BufRead, BufReader, Write},
    net::TcpStream,
    path::PathBuf,
};

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
        /// No checkpoint is written yet, and the job may go back to its
        /// start while its workers live (a parameter server's rows lost):
        /// they keep the state of step 0 until one is.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        origin: bool,
    },
    Stop {
        reason: String,
    },
    /// The coordinator is alive: sent a few times per worker lease to every
    /// worker it welcomed, from a thread of its own, so that one frozen with
    /// its connection still open (the kernel acknowledging what is sent to
    /// it) is given up by its workers instead of waited for.
    Beat,
}

/// The control protocol's version: the coordinator and its workers, a
/// `launch --torchrun` launcher and its agents, and the coordinator and
/// its hosts' relays, and parameter servers and their clients (these two
/// say it in the claim they prove, their frames and requests carry none)
/// must speak the same one (each refuses the other's otherwise, naming
/// both), as every host of a job must run one version of edl. Raised with
/// every change of the messages either side must understand (1: the
/// coordinator's beats, and the number itself).
pub const PROTOCOL: u32 = 1;

/// What every refusal for another protocol says: a worker told it (by a
/// stop) fails, where a stop otherwise means it is not needed.
pub const ONE_VERSION: &str = "every host of a job must run the same version of edl";

/// Why a peer speaking control protocol `theirs` cannot be worked with.
pub fn protocol_mismatch(who: &str, theirs: u32) -> Option<String> {
    (theirs != PROTOCOL).then(|| {
        let theirs = match theirs {
            0 => "an earlier one without a number".to_string(),
            n => n.to_string(),
        };
        format!(
            "{who} speaks control protocol {theirs}, this edl ({}) speaks {PROTOCOL}: {ONE_VERSION}",
            env!("CARGO_PKG_VERSION")
        )
    })
}

/// How long a welcomed worker waits without a word from its coordinator
/// (beats come four times per lease) before it takes it for lost: three
/// leases.
pub fn coordinator_silence(lease: std::time::Duration) -> std::time::Duration {
    lease.max(std::time::Duration::from_millis(1)) * 3
}

/// A generation: who is in it, where its ring meets, and the state it starts from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
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
    /// The job's parameter servers in this generation, when it has them
    /// (they change when one is lost).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ps: Option<crate::job::spec::PsTopology>,
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
    /// The part of `compute_ms` this rank waited for its soft labels.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub teacher_wait_ms: f64,
    /// The program's own metrics of the step (accuracy, ...), each this
    /// rank's value weighted by its share of the step's samples, as `loss`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub metrics: Vec<(String, f64)>,
    /// What this rank's requests to each teacher did since its last step.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub teacher_calls: Vec<crate::distill::stats::TeacherRequests>,
    /// The squared norms of what this rank's all-reduces of the step gave
    /// and got back: the gradient noise scale's measure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_sq: Option<crate::coordinator::machine::noise::GradSq>,
    /// A host's ranks' report as one (from their relay): their noise
    /// measures summed, in place of one rank's `grad_sq`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub noise_terms: Option<crate::coordinator::machine::noise::NoiseTerms>,
}

#[cfg(test)]
impl StepDone {
    /// An account with positions `start..end`, a loss and a compute time,
    /// and nothing else.
    pub(crate) fn plain(step: u64, epoch: u64, start: u32, end: u32, loss: f64, compute_ms: f64) -> Self {
        StepDone {
            step,
            epoch,
            start,
            end,
            loss,
            compute_ms,
            teacher_wait_ms: 0.0,
            metrics: Vec::new(),
            teacher_calls: Vec::new(),
            grad_sq: None,
            noise_terms: None,
        }
    }
}

/// What a worker tells the coordinator.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FromWorker {
    Hello {
        worker: u64,
        pid: u32,
        /// The control protocol it speaks ([`PROTOCOL`]; 0: an edl from
        /// before the protocol had a number).
        #[serde(default)]
        protocol: u32,
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
    Saved { checkpoints: Vec<Written> },
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
    Leaving { reason: String },
    /// A worker whose coordinator is gone, to the one that took the job
    /// over: it kept its process and its state, and holds rollback points
    /// at these committed steps (the first message on its new connection).
    Return {
        worker: u64,
        pid: u32,
        rollback: Vec<u64>,
        /// As in [`FromWorker::Hello`].
        #[serde(default)]
        protocol: u32,
    },
}

/// A checkpoint write that ended: where it is, or why it failed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Written {
    /// The committed step it holds.
    pub step: u64,
    pub result: Result<PathBuf, String>,
    /// How long the write took, and the state's bytes it wrote.
    #[serde(default)]
    pub secs: f64,
    #[serde(default)]
    pub bytes: u64,
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

pub(crate) fn peer(s: &TcpStream) -> String {
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

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Peers of this protocol are worked with; of another, or of an edl
    /// from before the number (0, as a message without it reads), refused
    /// naming both.
    #[test]
    fn a_peer_of_another_control_protocol_is_refused_naming_both() {
        assert_eq!(protocol_mismatch("worker 3", PROTOCOL), None);
        let older = protocol_mismatch("worker 3", 0).expect("refused");
        assert!(
            older.starts_with("worker 3 speaks control protocol an earlier one without a number"),
            "{older}"
        );
        let newer = protocol_mismatch("the coordinator at h:1", PROTOCOL + 1).expect("refused");
        assert!(newer.contains(&format!("protocol {}, this edl", PROTOCOL + 1)), "{newer}");
        assert!(newer.contains(&format!("speaks {PROTOCOL}: every host")), "{newer}");
        // A hello without the field reads as protocol 0.
        let hello: FromWorker = serde_json::from_str(r#"{"hello":{"worker":7,"pid":1}}"#).unwrap();
        assert_eq!(hello, FromWorker::Hello { worker: 7, pid: 1, protocol: 0 });
    }
}
