//! The DistillReader: batches in, the same batches out in the same order with
//! the teachers' soft labels attached. Teacher inference overlaps with the
//! student's training: batches are read ahead, cut into teacher requests,
//! and sent to whichever teachers are alive, least loaded first, a bounded
//! number in flight per teacher. A request that fails (error, timeout, wrong
//! shape) is sent again to another teacher at once and its teacher cools
//! down; no sample is lost, duplicated or reordered. Teachers come from a
//! fixed list or from the store, followed live.

use crate::distill::oip::{self, GrpcInferenceServiceClient, pb};
use crate::distill::stats::TeacherRequests;
use crate::plugin::TransformPlugin;
use crate::store::{AnyStore, Change, keys, watch};
use edl_plugin_sdk::{Batch, Dtype};
use std::{
    collections::{BTreeMap, VecDeque},
    ops::ControlFlow,
    sync::Arc,
    time::{Duration, Instant},
};
use tokio::{sync::mpsc, task::JoinSet};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

/// Where the teachers are.
#[derive(Clone)]
pub enum Teachers {
    /// Fixed endpoints (`host:port`), e.g. any OIP server.
    Fixed(Vec<String>),
    /// Teachers registered in the store under a service name, their
    /// registrations sealed with `key` (the job's registration key).
    Discovered { store: Arc<AnyStore>, service: String, key: crate::leader::seal::RecordKey },
}

/// How the reader works.
#[derive(Clone, Debug)]
pub struct DistillConfig {
    pub model_name: String,
    /// Rows per teacher request.
    pub teacher_batch: usize,
    /// Requests in flight per teacher.
    pub in_flight_per_teacher: usize,
    /// Batches read ahead of the consumer.
    pub read_ahead: usize,
    pub request_timeout: Duration,
    /// How long a failed teacher gets no requests.
    pub cooldown: Duration,
    /// How long to wait with no teacher at all before failing.
    pub wait_for_teachers: Duration,
    /// Classes the teachers must answer (the student's); when None, the
    /// first answer decides and later ones must agree.
    pub classes: Option<usize>,
    /// The token and TLS trust for teachers that need them.
    pub access: TeacherAccess,
    /// Which tensors are sent and read, and what the outputs hold.
    pub io: TeacherIo,
}

/// How students call teachers: per request and per teacher.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TeacherCalls {
    /// Longest one request may take, ms.
    pub request_timeout_ms: u64,
    /// Rows per request.
    pub teacher_batch: usize,
    /// Requests in flight per teacher.
    pub in_flight: usize,
    /// Rest after a failure, ms (doubled per failure in a row, to a cap).
    pub cooldown_ms: u64,
}

impl Default for TeacherCalls {
    fn default() -> Self {
        let d = DistillConfig::default();
        TeacherCalls {
            request_timeout_ms: d.request_timeout.as_millis() as u64,
            teacher_batch: d.teacher_batch,
            in_flight: d.in_flight_per_teacher,
            cooldown_ms: d.cooldown.as_millis() as u64,
        }
    }
}

impl TeacherCalls {
    /// `cfg` with these settings.
    pub fn apply(&self, cfg: DistillConfig) -> DistillConfig {
        DistillConfig {
            request_timeout: Duration::from_millis(self.request_timeout_ms.max(1)),
            teacher_batch: self.teacher_batch.max(1),
            in_flight_per_teacher: self.in_flight.max(1),
            cooldown: Duration::from_millis(self.cooldown_ms),
            ..cfg
        }
    }
}

/// The tensors students send and read.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TeacherIo {
    /// The input to send and the output to read (None: learnt from each
    /// teacher's model metadata at first contact).
    pub input_name: Option<String>,
    pub output_name: Option<String>,
    /// What the teachers' outputs hold (an endpoint may say otherwise for
    /// its teacher with `@logits` or `@probs`).
    pub output: OutputKind,
}

/// What a teacher's output holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OutputKind {
    /// Unnormalised scores (the student's loss applies the softmax).
    #[default]
    Logits,
    /// Probabilities (turned into log-probabilities, which the softmax
    /// maps back to them).
    Probs,
}

/// A word that names no [`OutputKind`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?}: expected logits or probs")]
pub struct UnknownOutputKind(pub String);

impl std::str::FromStr for OutputKind {
    type Err = UnknownOutputKind;
    fn from_str(s: &str) -> Result<Self, UnknownOutputKind> {
        match s {
            "logits" => Ok(OutputKind::Logits),
            "probs" => Ok(OutputKind::Probs),
            other => Err(UnknownOutputKind(other.to_string())),
        }
    }
}

/// The tensors a teacher's model takes and gives, as the reader uses them.
#[derive(Clone, Debug)]
struct Names {
    input: String,
    /// Its datatype: FP32, or FP64 (sent converted).
    input_fp64: bool,
    /// The output asked for (None: whichever comes first).
    output: Option<String>,
}

/// What a student needs to call teachers that check a bearer token or
/// serve TLS.
#[derive(Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TeacherAccess {
    /// Sent as `authorization: Bearer TOKEN` on every call.
    pub token: Option<String>,
    /// The CA (PEM) teachers' certificates are checked against. With it,
    /// teachers given as `host:port` are reached over TLS; `grpcs://` and `https://`
    /// teachers always are (checked against the web PKI roots without it).
    pub ca_pem: Option<String>,
    /// Send the token to teachers reached without TLS too (where the
    /// network itself is trusted). Without it, a teacher reached in clear
    /// is refused rather than told the token.
    #[serde(default)]
    pub allow_insecure_token: bool,
}

impl TeacherAccess {
    /// Why the teacher at `addr` must not be called with this access, if
    /// it must not: the token would cross in clear, or a CA was given (the
    /// student expects TLS) and the endpoint, as given or as registered in
    /// the store, names a protocol without it.
    pub fn refusal(&self, addr: &str) -> Option<String> {
        let scheme = addr.split_once("://").map(|(s, _)| s);
        let tls = match scheme {
            Some("https" | "grpcs") => true,
            Some("http" | "grpc") => false,
            _ => self.ca_pem.is_some(),
        };
        if tls {
            return None;
        }
        if self.ca_pem.is_some() {
            return Some(format!(
                "teacher {addr}: the student checks teachers' certificates (--teacher-ca, or the certificate \
                 of the teachers the job started), and this endpoint is reached without TLS"
            ));
        }
        (self.token.is_some() && !self.allow_insecure_token).then(|| {
            format!(
                "teacher {addr}: the bearer token goes only over TLS (https://, grpcs://, or host:port with \
                 --teacher-ca); this endpoint would carry it in clear (--allow-insecure-token allows that)"
            )
        })
    }
}

impl std::fmt::Debug for TeacherAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The token is never printed.
        f.debug_struct("TeacherAccess")
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field("ca_pem", &self.ca_pem.is_some())
            .field("allow_insecure_token", &self.allow_insecure_token)
            .finish()
    }
}

impl Default for DistillConfig {
    fn default() -> Self {
        DistillConfig {
            model_name: "teacher".into(),
            teacher_batch: 64,
            in_flight_per_teacher: 4,
            read_ahead: 8,
            request_timeout: Duration::from_secs(5),
            cooldown: Duration::from_secs(2),
            wait_for_teachers: Duration::from_secs(30),
            classes: None,
            access: TeacherAccess::default(),
            io: TeacherIo::default(),
        }
    }
}

/// A batch with its teachers' outputs.
#[derive(Clone, Debug)]
pub struct Distilled {
    /// The (transformed) batch the student trains on.
    pub batch: Batch,
    /// The teachers' logits, `[rows, classes]`.
    pub soft: Vec<f32>,
    pub classes: usize,
}

/// Why the reader stopped.
#[derive(Debug, thiserror::Error)]
pub enum DistillError {
    /// No teacher answered for `waited` while work was waiting: every one
    /// is gone, failing or cooling down. `last` holds each teacher's last
    /// error.
    #[error("no teacher answered for {waited:?}{}", describe_failures(last))]
    NoTeachers { waited: Duration, last: Vec<String> },
    /// Every teacher refused the requests for a reason retrying cannot fix
    /// (a wrong model name, input, datatype, class count or credentials).
    #[error("every teacher refused the requests: {}", reasons.join("; "))]
    Refused { reasons: Vec<String> },
    #[error("batch {seq}: {source}")]
    BadBatch { seq: u64, source: edl_plugin_sdk::PluginError },
    #[error(transparent)]
    Transform(#[from] crate::plugin::Error),
}

/// The reader's handle: call [`DistillReader::next`] for each batch.
pub struct DistillReader {
    rx: mpsc::Receiver<Result<Distilled, DistillError>>,
    calls: CallLog,
    /// The student's rank and world size, for its share of the teachers.
    place: tokio::sync::watch::Sender<Option<(usize, usize)>>,
}

impl DistillReader {
    /// Starts reading `source` (on a thread of its own) through `transform`
    /// (if any) and the teachers; runs on the current Tokio runtime.
    pub fn start(
        source: impl Iterator<Item = Batch> + Send + 'static,
        transform: Option<Box<dyn TransformPlugin>>,
        teachers: Teachers,
        config: DistillConfig,
    ) -> Self {
        let (batches_tx, batches_rx) = mpsc::channel::<Result<Batch, DistillError>>(config.read_ahead.max(1));
        std::thread::Builder::new()
            .name("edl-distill-source".into())
            .spawn(move || {
                let mut transform = transform;
                for b in source {
                    let b = match transform.as_mut() {
                        Some(t) => t.apply(&b).map_err(DistillError::from),
                        None => Ok(b),
                    };
                    let stop = b.is_err();
                    if batches_tx.blocking_send(b).is_err() || stop {
                        return;
                    }
                }
            })
            .expect("spawn the source thread");
        let (tx, rx) = mpsc::channel(config.read_ahead.max(1));
        let (place, placed) = tokio::sync::watch::channel(None);
        let mut pipeline = Pipeline::new(config, teachers);
        pipeline.placed = Some(placed);
        let calls = pipeline.calls.clone();
        tokio::spawn(pipeline.run(batches_rx, tx));
        DistillReader { rx, calls, place }
    }

    /// What this student's requests did at each teacher since the last
    /// call: the pool sizes itself by their times and takes out a teacher
    /// students refused.
    pub fn take_calls(&self) -> Vec<TeacherRequests> {
        let mut calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        std::mem::take(&mut *calls).into_values().collect()
    }

    /// Tells the reader this student is `rank` of `world`: from then on it
    /// calls its share of the teachers ([`super::assign::share`]), and the
    /// others only while none of its own can take requests. A reader never
    /// placed calls every teacher.
    pub fn place(&self, rank: usize, world: usize) {
        self.place.send_if_modified(|p| {
            let changed = *p != Some((rank, world));
            *p = Some((rank, world));
            changed
        });
    }

    /// The next batch with soft labels, in source order; None at the end.
    pub async fn next(&mut self) -> Option<Result<Distilled, DistillError>> {
        self.rx.recv().await
    }
}

struct Teacher {
    addr: String,
    /// The model asked of it, and its version (empty: the latest).
    model: String,
    version: String,
    wire: Wire,
    outstanding: usize,
    /// Requests this student sent it since its share last changed.
    sent: u64,
    cool_until: Option<Instant>,
    /// Transient failures in a row (each doubles the cool-down, up to a cap).
    failures: u32,
    draining: bool,
    /// It refused a request for a reason retrying cannot fix (a wrong
    /// model name, shapes, datatype or credentials): it gets no more.
    refused: Option<String>,
    /// Why its last request failed.
    last_error: Option<String>,
    /// Learnt once, at the first request.
    names: Arc<tokio::sync::OnceCell<Names>>,
    kind: OutputKind,
}

/// How a failed request is treated.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Failure {
    /// It may work later (unavailable, a timeout, overloaded): the teacher
    /// cools down, longer after each failure in a row.
    Transient,
    /// Retrying cannot help (NOT_FOUND, INVALID_ARGUMENT, an answer of the
    /// wrong kind): the teacher is dropped from the pool.
    Permanent,
    /// This student's credentials are refused (UNAUTHENTICATED,
    /// PERMISSION_DENIED): the student asks the teacher no more, but the
    /// teacher is not at fault.
    Denied,
}

impl Failure {
    fn of(code: tonic::Code) -> Self {
        use tonic::Code::*;
        match code {
            Unauthenticated | PermissionDenied => Failure::Denied,
            NotFound | InvalidArgument | Unimplemented | FailedPrecondition | OutOfRange | AlreadyExists => {
                Failure::Permanent
            }
            _ => Failure::Transient,
        }
    }
}

/// The longest a failing teacher is left alone before it is tried again.
const MAX_COOLDOWN: Duration = Duration::from_secs(30);

/// How long a teacher rests after `failures` transient failures in a row:
/// 1, 2, 4, ... times the cool-down, up to [`MAX_COOLDOWN`] (or the
/// cool-down itself, if longer).
fn backoff(cooldown: Duration, failures: u32) -> Duration {
    let doubled = cooldown.saturating_mul(1u32 << failures.saturating_sub(1).min(16));
    doubled.min(MAX_COOLDOWN.max(cooldown))
}

/// A teacher endpoint with an optional model (and version):
/// `host:port`, `host:port/model`, `host:port/model/version`, each also
/// with a scheme in front (`grpc://`, `grpcs://`, `http://`, `https://`).
pub fn parse_endpoint(spec: &str) -> (String, Option<String>, Option<String>) {
    let (scheme, rest) = match spec.split_once("://") {
        Some((s, r)) => (Some(s), r),
        None => (None, spec),
    };
    let mut parts = rest.splitn(3, '/');
    let authority = parts.next().unwrap_or_default();
    let model = parts.next().filter(|m| !m.is_empty()).map(str::to_string);
    let version = parts.next().filter(|v| !v.is_empty()).map(|v| v.trim_end_matches('/').to_string());
    let addr = match scheme {
        Some(s) => format!("{s}://{authority}"),
        None => authority.to_string(),
    };
    (addr, model, version)
}

fn describe_failures(last: &[String]) -> String {
    if last.is_empty() { " (none known)".into() } else { format!(": {}", last.join("; ")) }
}

/// A slice of one batch sent as one request.
#[derive(Clone)]
struct Piece {
    seq: u64,
    start: usize,
    rows: usize,
}

struct Pending {
    batch: Batch,
    features: Vec<f32>,
    dim: usize,
    soft: Vec<f32>,
    missing: usize,
}

struct Pipeline {
    cfg: DistillConfig,
    teachers: Teachers,
    pool: BTreeMap<String, Teacher>,
    queue: VecDeque<Piece>,
    pending: BTreeMap<u64, Pending>,
    classes: Option<usize>,
    /// The teacher whose first answer set `classes` (None: the student's).
    classes_from: Option<String>,
    next_in: u64,
    next_out: u64,
    source_done: bool,
    /// Since when work has waited without any teacher answering.
    stalled_since: Option<Instant>,
    /// Where the student's rank and world size come from, and the last told.
    placed: Option<tokio::sync::watch::Receiver<Option<(usize, usize)>>>,
    place: Option<(usize, usize)>,
    /// Each teacher's capacity (rows/s, by `host:port`), as the pool measured it.
    capacity: BTreeMap<String, f64>,
    /// This student's share of the teachers (by pool key) and their
    /// weights; empty: every teacher.
    assigned: BTreeMap<String, f64>,
    calls: CallLog,
}

/// A request's teacher, piece, answer and time taken.
type Outcome = (String, Piece, Result<Vec<f32>, (Failure, String)>, Duration);

/// What the student's requests did at each teacher (by `host:port`),
/// until [`DistillReader::take_calls`] takes it.
type CallLog = Arc<std::sync::Mutex<BTreeMap<String, TeacherRequests>>>;

/// Why a teacher endpoint cannot be used.
#[derive(Debug, thiserror::Error)]
enum EndpointError {
    /// The access settings forbid it (see [`TeacherAccess::refusal`]).
    #[error("{0}")]
    Refused(String),
    #[error("{0}:// is not a teacher protocol (http, https, grpc, grpcs)")]
    UnknownScheme(String),
    /// The REST client (or its certificates) could not be set up.
    #[error("{0}")]
    Http(reqwest::Error),
    /// The gRPC endpoint (or its TLS) could not be set up.
    #[error("{0}")]
    Grpc(tonic::transport::Error),
}

/// How a teacher is reached.
#[derive(Clone)]
enum Wire {
    Grpc(GrpcInferenceServiceClient<Channel>),
    /// KServe v2 over HTTP/REST at this base URL; whether the server takes
    /// binary tensors is asked once.
    Rest {
        base: String,
        http: reqwest::Client,
        binary: Arc<tokio::sync::OnceCell<bool>>,
    },
}

/// One request to one teacher, with what it needs to make it.
struct Ask {
    wire: Wire,
    model: String,
    version: String,
    names: Arc<tokio::sync::OnceCell<Names>>,
    kind: OutputKind,
    token: Option<String>,
    timeout: Duration,
}

/// Output names that say what they hold, preferred in this order.
const KNOWN_OUTPUTS: [&str; 5] = ["logits", "probs", "probabilities", "predict_proba", "output_probability"];

impl Ask {
    fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(msg);
        if let Some(token) = &self.token {
            match format!("Bearer {token}").parse() {
                Ok(v) => {
                    req.metadata_mut().insert("authorization", v);
                }
                Err(_) => tracing::warn!("the teacher token holds characters a header cannot; not sent"),
            }
        }
        req
    }

    /// The model's metadata; None when the server has none to give.
    async fn metadata(&self) -> Result<Option<pb::ModelMetadataResponse>, (Failure, String)> {
        let timeout = self.timeout;
        let late = || (Failure::Transient, format!("no metadata within {timeout:?}"));
        match &self.wire {
            Wire::Grpc(client) => {
                let asked =
                    pb::ModelMetadataRequest { name: self.model.clone(), version: self.version.clone() };
                let mut client = client.clone();
                match tokio::time::timeout(timeout, client.model_metadata(self.request(asked))).await {
                    Err(_) => Err(late()),
                    Ok(Err(s)) if s.code() == tonic::Code::Unimplemented => Ok(None),
                    Ok(Err(s)) => {
                        Err((Failure::of(s.code()), format!("model metadata: {}", describe_status(&s))))
                    }
                    Ok(Ok(m)) => Ok(Some(m.into_inner())),
                }
            }
            Wire::Rest { base, http, .. } => {
                let call = crate::distill::rest_client::metadata(
                    http,
                    base,
                    &self.model,
                    &self.version,
                    self.token.as_deref(),
                );
                match tokio::time::timeout(timeout, call).await {
                    Err(_) => Err(late()),
                    Ok(Err(e)) if e.status == Some(501) => Ok(None),
                    Ok(Err(e)) => Err((rest_failure(&e), format!("model metadata: {e}"))),
                    Ok(Ok(m)) => Ok(Some(m)),
                }
            }
        }
    }

    /// Sends one inference request.
    async fn send(&self, req: pb::ModelInferRequest) -> Result<pb::ModelInferResponse, (Failure, String)> {
        let timeout = self.timeout;
        let late = || (Failure::Transient, format!("no answer within {timeout:?}"));
        match &self.wire {
            Wire::Grpc(client) => {
                let mut client = client.clone();
                match tokio::time::timeout(timeout, client.model_infer(self.request(req))).await {
                    Err(_) => Err(late()),
                    Ok(Err(status)) => Err((Failure::of(status.code()), describe_status(&status))),
                    Ok(Ok(resp)) => Ok(resp.into_inner()),
                }
            }
            Wire::Rest { base, http, binary } => {
                let token = self.token.as_deref();
                let call = async {
                    let binary = *binary
                        .get_or_try_init(|| crate::distill::rest_client::speaks_binary(http, base, token))
                        .await?;
                    crate::distill::rest_client::infer(http, base, &req, token, binary).await
                };
                match tokio::time::timeout(timeout, call).await {
                    Err(_) => Err(late()),
                    Ok(Err(e)) => Err((rest_failure(&e), e.to_string())),
                    Ok(Ok(resp)) => Ok(resp),
                }
            }
        }
    }

    /// The teacher's model's input and output, from its metadata (or as given).
    async fn learn(&self, wanted: (Option<String>, Option<String>)) -> Result<Names, (Failure, String)> {
        let (input, output) = wanted;
        let Some(meta) = self.metadata().await? else {
            // A server without metadata: the names given, or the usual ones.
            return Ok(Names { input: input.unwrap_or_else(|| "input".into()), input_fp64: false, output });
        };
        let model = &self.model;
        let (input, input_fp64) = if meta.inputs.is_empty() {
            // A model that declares no input (MLServer's custom models): the
            // name given, or the usual one, in FP32.
            (input.unwrap_or_else(|| "input".into()), false)
        } else {
            let input_meta = match &input {
                Some(n) => meta.inputs.iter().find(|i| &i.name == n).ok_or_else(|| {
                    let names: Vec<&str> = meta.inputs.iter().map(|i| i.name.as_str()).collect();
                    (Failure::Permanent, format!("model {model:?} has no input {n:?} (it has {names:?})"))
                })?,
                None => &meta.inputs[0],
            };
            let input_fp64 = match input_meta.datatype.as_str() {
                "FP32" => false,
                "FP64" => true,
                other => {
                    let why = format!(
                        "model {model:?} takes {other} input {:?}; this reader sends FP32 or FP64 features",
                        input_meta.name
                    );
                    return Err((Failure::Permanent, why));
                }
            };
            (input_meta.name.clone(), input_fp64)
        };
        let floating = |d: &str| matches!(d, "FP32" | "FP64" | "FP16" | "BF16");
        let output = match output {
            Some(n) => {
                let o = meta.outputs.iter().find(|o| o.name == n).ok_or_else(|| {
                    let names: Vec<&str> = meta.outputs.iter().map(|o| o.name.as_str()).collect();
                    (Failure::Permanent, format!("model {model:?} has no output {n:?} (it has {names:?})"))
                })?;
                if !floating(&o.datatype) {
                    let why = format!(
                        "output {n:?} of model {model:?} is {}: soft labels need floating point",
                        o.datatype
                    );
                    return Err((Failure::Permanent, why));
                }
                Some(n)
            }
            None => {
                let known = KNOWN_OUTPUTS
                    .iter()
                    .find_map(|k| meta.outputs.iter().find(|o| o.name == *k && floating(&o.datatype)));
                match known.or_else(|| meta.outputs.iter().find(|o| floating(&o.datatype))) {
                    Some(o) => Some(o.name.clone()),
                    // Nothing declared: whatever the answer holds first.
                    None if meta.outputs.is_empty() => None,
                    None => {
                        let names: Vec<String> =
                            meta.outputs.iter().map(|o| format!("{} {}", o.name, o.datatype)).collect();
                        let why = format!("model {model:?} has no floating-point output ({names:?})");
                        return Err((Failure::Permanent, why));
                    }
                }
            }
        };
        Ok(Names { input, input_fp64, output })
    }

    /// Sends `piece` (its `features`, `dim` per row) and reads its soft labels.
    async fn infer(
        &self,
        piece: &Piece,
        features: Vec<f32>,
        dim: usize,
        wanted: (Option<String>, Option<String>),
    ) -> Result<Vec<f32>, (Failure, String)> {
        let names = self.names.get_or_try_init(|| self.learn(wanted)).await?.clone();
        let (datatype, raw) = if names.input_fp64 {
            ("FP64", features.iter().flat_map(|&v| (v as f64).to_le_bytes()).collect())
        } else {
            ("FP32", oip::f32_bytes(&features))
        };
        let req = pb::ModelInferRequest {
            model_name: self.model.clone(),
            model_version: self.version.clone(),
            id: format!("{}:{}", piece.seq, piece.start),
            inputs: vec![pb::model_infer_request::InferInputTensor {
                name: names.input.clone(),
                datatype: datatype.into(),
                shape: vec![piece.rows as i64, dim as i64],
                ..Default::default()
            }],
            outputs: names
                .output
                .iter()
                .map(|n| pb::model_infer_request::InferRequestedOutputTensor {
                    name: n.clone(),
                    ..Default::default()
                })
                .collect(),
            raw_input_contents: vec![raw],
            ..Default::default()
        };
        let resp = self.send(req).await?;
        let (v, rows, cols) = oip::output_as_f32(&resp, names.output.as_deref())
            .map_err(|e| (Failure::Permanent, e.to_string()))?;
        if rows != piece.rows {
            return Err((Failure::Permanent, format!("answered [{rows}, {cols}] for {} rows", piece.rows)));
        }
        match self.kind {
            OutputKind::Logits => Ok(v),
            OutputKind::Probs => {
                if let Some(bad) = v.iter().find(|p| !(-1e-6..=1.0 + 1e-6).contains(*p)) {
                    let why =
                        format!("read as probabilities, answered {bad} (outside [0, 1]); are they logits?");
                    return Err((Failure::Permanent, why));
                }
                Ok(v.iter().map(|p| p.max(1e-12).ln()).collect())
            }
        }
    }
}

/// How a failed REST call is treated: the client's mistakes are for good,
/// the server's troubles and the network's pass.
fn rest_failure(e: &crate::distill::rest_client::CallError) -> Failure {
    match e.status {
        Some(401 | 403) => Failure::Denied,
        Some(400 | 404 | 405 | 413 | 501) => Failure::Permanent,
        _ => Failure::Transient,
    }
}

/// A gRPC status in words: its code, and its message or what the transport said.
fn describe_status(status: &tonic::Status) -> String {
    let detail = super::with_causes(status.message().to_string(), std::error::Error::source(status));
    if detail.is_empty() { format!("{:?}", status.code()) } else { format!("{:?}: {detail}", status.code()) }
}

/// A batch's samples as f32 features (bytes scaled to [0, 1]), and the
/// features per sample.
fn features_of(b: &Batch) -> Result<(Vec<f32>, usize), edl_plugin_sdk::PluginError> {
    b.validate()?;
    let dim = b.sample_elems();
    Ok(match b.dtype {
        Dtype::Float32 => (b.to_f32().expect("float32"), dim),
        Dtype::Uint8 => (b.data.iter().map(|&v| v as f32 / 255.0).collect(), dim),
    })
}

impl Pipeline {
    fn new(cfg: DistillConfig, teachers: Teachers) -> Self {
        Pipeline {
            classes: cfg.classes,
            classes_from: None,
            cfg,
            teachers,
            pool: BTreeMap::new(),
            queue: VecDeque::new(),
            pending: BTreeMap::new(),
            next_in: 0,
            next_out: 0,
            source_done: false,
            stalled_since: None,
            placed: None,
            place: None,
            capacity: BTreeMap::new(),
            assigned: BTreeMap::new(),
            calls: CallLog::default(),
        }
    }

    /// Notes what a request to `addr` did, for the teacher pool.
    fn log_call(&self, addr: &str, note: impl FnOnce(&mut TeacherRequests)) {
        let at = host_port(addr);
        let mut calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        note(calls.entry(at.clone()).or_insert_with(|| TeacherRequests { addr: at, ..Default::default() }));
    }

    /// Works out this student's share of the teachers again (after the
    /// pool, the capacities or the student's place changed); says a change.
    fn reassign(&mut self) {
        let Some((rank, world)) = self.place else { return };
        let live: Vec<(String, f64)> = self
            .pool
            .values()
            .filter(|t| !t.draining && t.refused.is_none())
            .map(|t| {
                let at = host_port(&t.addr);
                let capacity = self.capacity.get(&at).copied().unwrap_or(0.0);
                (t.addr.clone(), capacity)
            })
            .collect();
        let assigned: BTreeMap<String, f64> =
            super::assign::share(rank, world, &live).into_iter().map(|a| (a.addr, a.weight)).collect();
        if assigned != self.assigned {
            let list: Vec<String> = assigned.iter().map(|(a, w)| format!("{a} ({w:.2})")).collect();
            tracing::info!(
                "student {rank} of {world} calls {} of {} teachers: {}",
                assigned.len(),
                live.len(),
                list.join(", ")
            );
            self.assigned = assigned;
            self.pool.values_mut().for_each(|t| t.sent = 0);
        }
    }

    /// Takes a new place told by the student, if there is one.
    fn follow_place(&mut self) {
        let Some(rx) = self.placed.as_ref() else { return };
        let now = *rx.borrow();
        if now != self.place {
            self.place = now;
            self.reassign();
        }
    }

    fn add_teacher(&mut self, spec: &str) {
        if let Some(t) = self.pool.get_mut(spec) {
            // Registered again while it drained: back in the shares, and a
            // server that left and came back at the same endpoint (the pool
            // replaced a refused teacher on its slot) is asked afresh.
            if std::mem::replace(&mut t.draining, false) {
                t.refused = None;
                t.failures = 0;
                self.reassign();
            }
            return;
        }
        let (spec_only, kind) = match spec.rsplit_once('@') {
            Some((rest, k)) if k.parse::<OutputKind>().is_ok() => (rest, k.parse().unwrap_or_default()),
            _ => (spec, self.cfg.io.output),
        };
        let (addr, model, version) = parse_endpoint(spec_only);
        let addr = addr.as_str();
        match self.wire(addr) {
            Ok(wire) => {
                let model = model.unwrap_or_else(|| self.cfg.model_name.clone());
                tracing::info!("teacher {addr} (model {model:?}) added");
                self.pool.insert(
                    spec.to_string(),
                    Teacher {
                        addr: spec.to_string(),
                        model,
                        version: version.unwrap_or_default(),
                        wire,
                        outstanding: 0,
                        sent: 0,
                        cool_until: None,
                        failures: 0,
                        draining: false,
                        refused: None,
                        last_error: None,
                        names: Arc::new(tokio::sync::OnceCell::new()),
                        kind,
                    },
                );
                self.reassign();
            }
            Err(e) => tracing::warn!("teacher endpoint {spec:?} is not usable: {e}"),
        }
    }

    /// How to reach `addr`: `http://` and `https://` are KServe v2 over
    /// REST; `grpc://` plain gRPC, `grpcs://` gRPC over TLS; a bare
    /// `host:port` gRPC, over TLS when a CA is given.
    fn wire(&self, addr: &str) -> Result<Wire, EndpointError> {
        if let Some(why) = self.cfg.access.refusal(addr) {
            return Err(EndpointError::Refused(why));
        }
        let ca = self.cfg.access.ca_pem.as_deref();
        if addr.starts_with("http://") || addr.starts_with("https://") {
            let mut http =
                reqwest::Client::builder().connect_timeout(Duration::from_secs(1)).tcp_nodelay(true);
            if let Some(ca) = ca {
                // Every certificate of the PEM (a --teacher-ca and the job's
                // own teachers'), and nothing else: as over gRPC, a CA given
                // is the only one trusted (not the platform's roots too).
                let certs =
                    reqwest::Certificate::from_pem_bundle(ca.as_bytes()).map_err(EndpointError::Http)?;
                http = http.tls_certs_only(certs);
            }
            return Ok(Wire::Rest {
                base: addr.trim_end_matches('/').to_string(),
                http: http.build().map_err(EndpointError::Http)?,
                binary: Arc::default(),
            });
        }
        let (tls, authority) = match addr.split_once("://") {
            Some(("grpc", a)) => (false, a),
            Some(("grpcs", a)) => (true, a),
            Some((scheme, _)) => {
                return Err(EndpointError::UnknownScheme(scheme.to_string()));
            }
            None => (ca.is_some(), addr),
        };
        let uri = format!("{}://{authority}", if tls { "https" } else { "http" });
        let mut ep = Endpoint::from_shared(uri).map_err(EndpointError::Grpc)?;
        if tls {
            let tls = match ca {
                Some(ca) => ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)),
                None => ClientTlsConfig::new().with_webpki_roots(),
            };
            ep = ep.tls_config(tls).map_err(EndpointError::Grpc)?;
        }
        let ch = ep.connect_timeout(Duration::from_secs(1)).tcp_nodelay(true).connect_lazy();
        Ok(Wire::Grpc(GrpcInferenceServiceClient::new(ch).max_decoding_message_size(256 << 20)))
    }

    /// The teacher at `host:port` left (its registration is gone).
    fn remove_teacher(&mut self, host_port: &str) {
        for t in self.pool.values_mut().filter(|t| self::host_port(&t.addr) == host_port) {
            tracing::info!("teacher {} left; draining its {} requests", t.addr, t.outstanding);
            t.draining = true;
        }
        self.reassign();
    }

    /// The teacher that takes the next request: of this student's share
    /// while one of it is healthy, the one furthest behind its weight (so
    /// each gets its part of the requests, however few are in flight);
    /// else the least loaded of every teacher.
    fn pick(&mut self) -> Option<String> {
        let now = Instant::now();
        let limit = self.cfg.in_flight_per_teacher;
        let healthy =
            |t: &&Teacher| !t.draining && t.refused.is_none() && t.cool_until.is_none_or(|c| c <= now);
        let own = |t: &&Teacher| self.assigned.contains_key(&t.addr);
        let mine = !self.assigned.is_empty() && self.pool.values().filter(healthy).any(|t| own(&t));
        let weight =
            |t: &Teacher| if mine { self.assigned.get(&t.addr).copied().unwrap_or(1.0) } else { 1.0 };
        self.pool
            .values()
            .filter(healthy)
            .filter(|t| !mine || own(t))
            .filter(|t| t.outstanding < limit)
            .min_by(|a, b| {
                let load = |t: &Teacher| {
                    if mine { (t.sent as f64 + 1.0) / weight(t) } else { t.outstanding as f64 }
                };
                load(a).total_cmp(&load(b))
            })
            .map(|t| t.addr.clone())
    }

    fn admit(&mut self, batch: Batch) -> Result<(), DistillError> {
        let seq = self.next_in;
        self.next_in += 1;
        let (features, dim) = features_of(&batch).map_err(|source| DistillError::BadBatch { seq, source })?;
        let rows = batch.len();
        let step = self.cfg.teacher_batch.max(1);
        let pieces: Vec<Piece> =
            (0..rows).step_by(step).map(|s| Piece { seq, start: s, rows: step.min(rows - s) }).collect();
        self.pending.insert(seq, Pending { batch, features, dim, soft: Vec::new(), missing: pieces.len() });
        self.queue.extend(pieces);
        Ok(())
    }

    fn dispatch(&mut self, running: &mut JoinSet<Outcome>) {
        while let Some(piece) = self.queue.front().cloned() {
            let Some(addr) = self.pick() else { break };
            self.queue.pop_front();
            let p = &self.pending[&piece.seq];
            let rows = p.features[piece.start * p.dim..(piece.start + piece.rows) * p.dim].to_vec();
            let dim = p.dim;
            let token = self.cfg.access.token.clone();
            let wanted = (self.cfg.io.input_name.clone(), self.cfg.io.output_name.clone());
            let t = self.pool.get_mut(&addr).expect("picked from the pool");
            t.outstanding += 1;
            t.sent += 1;
            let ask = Ask {
                wire: t.wire.clone(),
                model: t.model.clone(),
                version: t.version.clone(),
                names: t.names.clone(),
                kind: t.kind,
                token,
                timeout: self.cfg.request_timeout,
            };
            running.spawn(async move {
                let sent = Instant::now();
                let result = ask.infer(&piece, rows, dim, wanted).await;
                (addr, piece, result, sent.elapsed())
            });
        }
    }

    fn complete(&mut self, (addr, piece, result, took): Outcome) {
        if let Some(t) = self.pool.get_mut(&addr) {
            t.outstanding -= 1;
        }
        let expected = self.cfg.classes;
        let accepted = result.and_then(|v| {
            let cols = v.len() / piece.rows.max(1);
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                let why = format!("answered a non-finite value ({}) in row {}", v[i], i / cols.max(1));
                return Err((Failure::Transient, why));
            }
            match self.classes {
                Some(c) if c != cols => {
                    let whose = match (&expected, &self.classes_from) {
                        (Some(_), _) => format!("the student has {c}"),
                        (None, Some(first)) => format!(
                            "teacher {first}, the first to answer, gives {c} (the student's class count, \
                             where it is given, settles which is right)"
                        ),
                        (None, None) => format!("other teachers answer {c}"),
                    };
                    Err((Failure::Permanent, format!("answered {cols} classes; {whose}")))
                }
                _ => Ok((v, cols)),
            }
        });
        match accepted {
            Ok((v, cols)) => {
                if self.classes.is_none() {
                    self.classes_from = Some(addr.clone());
                }
                self.classes = Some(cols);
                self.stalled_since = None;
                self.log_call(&addr, |c| c.answered(took));
                if let Some(t) = self.pool.get_mut(&addr) {
                    t.failures = 0;
                }
                let p = self.pending.get_mut(&piece.seq).expect("pending batch");
                if p.soft.is_empty() {
                    p.soft = vec![0.0; p.batch.len() * cols];
                }
                p.soft[piece.start * cols..(piece.start + piece.rows) * cols].copy_from_slice(&v);
                p.missing -= 1;
            }
            Err((kind, why)) => self.failed(&addr, piece, kind, why),
        }
    }

    /// A request of `piece` to the teacher at `addr` failed: the piece goes
    /// back to the queue; the teacher is cooled down (`Transient`) or
    /// asked no more (`Permanent`: named, and this student's share of the
    /// teachers worked out again).
    fn failed(&mut self, addr: &str, piece: Piece, kind: Failure, why: String) {
        self.queue.push_front(piece);
        let cooldown = self.cfg.cooldown;
        let Some(t) = self.pool.get_mut(addr) else { return };
        let what = format!("{addr} (model {:?}): {why}", t.model);
        t.last_error = Some(what.clone());
        match kind {
            Failure::Transient => {
                t.failures += 1;
                let wait = backoff(cooldown, t.failures);
                t.cool_until = Some(Instant::now() + wait);
                if t.failures == 1 {
                    tracing::warn!("teacher {what}; its requests go elsewhere, retrying it in {wait:?}");
                } else {
                    tracing::debug!("teacher {what} (failure {} in a row); next try in {wait:?}", t.failures);
                }
            }
            Failure::Permanent | Failure::Denied if t.refused.is_none() => {
                tracing::error!("teacher {what}; no more requests go to it");
                t.refused = Some(what);
                // The pool hears of a teacher that answers what no student
                // can use, not of this student's credentials refused.
                if kind == Failure::Permanent {
                    self.log_call(addr, |c| c.refused = Some(why));
                }
                self.reassign();
            }
            Failure::Permanent | Failure::Denied => {}
        }
    }

    /// The reader's event loop (batches in, answers back, teachers coming
    /// and going), until every batch of the source is out, the consumer
    /// is gone, or the reader stops with an error, which it sends last.
    async fn run(
        mut self,
        mut batches: mpsc::Receiver<Result<Batch, DistillError>>,
        out: mpsc::Sender<Result<Distilled, DistillError>>,
    ) {
        let mut changes = self.follow_teachers();
        let mut running: JoinSet<Outcome> = JoinSet::new();
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        loop {
            if self.emit_finished(&out).await.is_break() {
                return;
            }
            self.follow_place();
            self.dispatch(&mut running);
            if let Err(e) = self.check_progress(running.is_empty()) {
                let _ = out.send(Err(e)).await;
                return;
            }
            let room = self.pending.len() < self.cfg.read_ahead.max(1) && !self.source_done;
            let step = tokio::select! {
                Some(done) = running.join_next(), if !running.is_empty() => {
                    match done {
                        Ok(outcome) => self.complete(outcome),
                        Err(e) => tracing::warn!("a teacher request task failed: {e}"),
                    }
                    Ok(())
                }
                next = batches.recv(), if room => self.take_batch(next),
                Some(change) = next_change(&mut changes), if changes.is_some() => {
                    self.teacher_changed(change);
                    Ok(())
                }
                _ = tick.tick() => Ok(()),
            };
            if let Err(e) = step {
                let _ = out.send(Err(e)).await;
                return;
            }
            // Forget drained teachers.
            self.pool.retain(|_, t| !(t.draining && t.outstanding == 0));
        }
    }

    /// Adds the fixed teachers, or starts following the store's list of
    /// them (its changes, for [`Pipeline::teacher_changed`]).
    fn follow_teachers(&mut self) -> Option<mpsc::Receiver<Change>> {
        match &self.teachers {
            Teachers::Fixed(list) => {
                for a in list.clone() {
                    self.add_teacher(&a);
                }
                None
            }
            // The teachers' registrations and the pool's settings.
            Teachers::Discovered { store, service, .. } => {
                Some(watch(store.clone(), keys::service(service), Duration::from_millis(200)))
            }
        }
    }

    /// Sends the batches whose answers are all in, in source order. Breaks
    /// when the consumer is gone or the source is done and nothing is left.
    async fn emit_finished(
        &mut self,
        out: &mpsc::Sender<Result<Distilled, DistillError>>,
    ) -> ControlFlow<()> {
        while self.pending.get(&self.next_out).is_some_and(|p| p.missing == 0) {
            let p = self.pending.remove(&self.next_out).expect("checked above");
            self.next_out += 1;
            let classes = self.classes.unwrap_or(0);
            if out.send(Ok(Distilled { batch: p.batch, soft: p.soft, classes })).await.is_err() {
                return ControlFlow::Break(());
            }
        }
        if self.source_done && self.pending.is_empty() {
            return ControlFlow::Break(());
        }
        ControlFlow::Continue(())
    }

    /// Why the reader must give up now, if it must: work waited a whole
    /// wait with no answer, or every fixed teacher refused. `idle`: no
    /// request is in flight.
    fn check_progress(&mut self, idle: bool) -> Result<(), DistillError> {
        // Teachers gone, failing or cooling down (retried in turn): only an
        // accepted answer resets the wait.
        if self.queue.is_empty() && idle {
            self.stalled_since = None;
        } else {
            let since = *self.stalled_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= self.cfg.wait_for_teachers {
                let last = self.pool.values().filter_map(|t| t.last_error.clone()).collect();
                return Err(DistillError::NoTeachers { waited: self.cfg.wait_for_teachers, last });
            }
        }
        // Refused for a reason retrying cannot fix: say so now rather than
        // after the wait.
        let all_refused = !self.pool.is_empty() && self.pool.values().all(|t| t.refused.is_some());
        if matches!(self.teachers, Teachers::Fixed(_)) && all_refused && idle {
            let reasons = self.pool.values().filter_map(|t| t.refused.clone()).collect();
            return Err(DistillError::Refused { reasons });
        }
        if !self.queue.is_empty() && idle && self.pool.values().all(|t| t.draining) {
            tracing::warn!("no teacher available; waiting up to {:?}", self.cfg.wait_for_teachers);
        }
        Ok(())
    }

    /// Takes the source's next batch (None: the source is done); a batch
    /// that cannot be taken, or the source's error, stops the reader.
    fn take_batch(&mut self, next: Option<Result<Batch, DistillError>>) -> Result<(), DistillError> {
        match next {
            Some(batch) => self.admit(batch?),
            None => {
                self.source_done = true;
                Ok(())
            }
        }
    }

    /// A teacher registered, re-registered or left the store, or the
    /// pool's settings changed.
    fn teacher_changed(&mut self, change: Change) {
        let Teachers::Discovered { key: seal, service, .. } = &self.teachers else { return };
        let (teachers, pool) = (keys::teachers(service), keys::teacher_pool(service));
        match change {
            Change::Added(e) | Change::Updated(e) if e.key == pool => match seal.open(&e.key, &e.value) {
                Ok(settings) => self.pool_settings(settings),
                Err(why) => tracing::warn!("the teacher pool's settings ignored: {why}"),
            },
            Change::Added(e) | Change::Updated(e) if e.key.starts_with(&teachers) => {
                match seal.open(&e.key, &e.value) {
                    Ok(addr) => self.add_teacher(&String::from_utf8_lossy(addr)),
                    Err(why) => tracing::warn!("teacher registration ignored: {why}"),
                }
            }
            Change::Removed(key) if key.starts_with(&teachers) => {
                let addr = key.rsplit('/').next().unwrap_or_default().to_string();
                self.remove_teacher(&addr);
            }
            _ => {}
        }
    }

    /// The pool's settings, as its coordinator wrote them: the requests
    /// kept in flight at each teacher.
    fn pool_settings(&mut self, settings: &[u8]) {
        match serde_json::from_slice::<PoolSettings>(settings) {
            Ok(s) => {
                if s.capacity != self.capacity {
                    self.capacity = s.capacity;
                    self.reassign();
                }
                let n = (s.in_flight_per_teacher as usize).clamp(1, 64);
                if n != self.cfg.in_flight_per_teacher {
                    tracing::debug!(
                        "requests in flight per teacher: {} -> {n}",
                        self.cfg.in_flight_per_teacher
                    );
                    self.cfg.in_flight_per_teacher = n;
                }
            }
            Err(e) => tracing::warn!("the teacher pool's settings ignored: {e}"),
        }
    }
}

/// What a job's teacher pool tells its students through the store
/// ([`keys::teacher_pool`], sealed with the registration key).
/// What the job's teacher pool tells its students.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PoolSettings {
    pub in_flight_per_teacher: u32,
    /// Each teacher's capacity in rows per second (by `host:port`), as
    /// measured: the weights of the students' shares.
    #[serde(default)]
    pub capacity: BTreeMap<String, f64>,
}

/// The `host:port` of a teacher endpoint (its scheme, model and output
/// kind dropped).
pub fn host_port(spec: &str) -> String {
    let spec =
        spec.rsplit_once('@').filter(|(_, k)| k.parse::<OutputKind>().is_ok()).map_or(spec, |(s, _)| s);
    let (addr, _, _) = parse_endpoint(spec);
    addr.split_once("://").map_or(addr.clone(), |(_, a)| a.to_string())
}

/// The next change to the teachers followed (never, when none are).
async fn next_change(changes: &mut Option<mpsc::Receiver<Change>>) -> Option<Change> {
    match changes.as_mut() {
        Some(rx) => rx.recv().await,
        None => None,
    }
}

/// Parses `host:port,host:port` (duplicates dropped, order kept).
pub fn endpoints(list: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for s in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        if !out.iter().any(|o| o == s) {
            out.push(s.to_string());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn students_take_the_pool_s_sealed_settings_and_ignore_forged_ones() {
        let secret = edl_host_gpu::comm::auth::Secret::generate().unwrap();
        let seal = crate::leader::seal::RecordKey::teacher_registrations(&secret);
        let store = Arc::new(AnyStore::open("memory").unwrap());
        let teachers = Teachers::Discovered { store, service: "svc".into(), key: seal.clone() };
        let mut p =
            Pipeline::new(DistillConfig { in_flight_per_teacher: 4, ..DistillConfig::default() }, teachers);
        let key = keys::teacher_pool("svc");
        let settings = |n: u32| {
            serde_json::to_vec(&PoolSettings { in_flight_per_teacher: n, capacity: BTreeMap::new() }).unwrap()
        };
        let entry = |value: Vec<u8>| crate::store::Entry { key: key.clone(), value, token: 1 };
        p.teacher_changed(Change::Added(entry(seal.seal(&key, &settings(12)))));
        assert_eq!(p.cfg.in_flight_per_teacher, 12, "the pool's setting is taken");
        // Written without the job's key, or under another key's seal: ignored.
        p.teacher_changed(Change::Updated(entry(settings(1))));
        let other = crate::leader::seal::RecordKey::teacher_registrations(
            &edl_host_gpu::comm::auth::Secret::generate().unwrap(),
        );
        p.teacher_changed(Change::Updated(entry(other.seal(&key, &settings(2)))));
        p.teacher_changed(Change::Updated(entry(seal.seal(&keys::teacher("svc", "x"), &settings(3)))));
        assert_eq!(p.cfg.in_flight_per_teacher, 12, "forged settings are ignored");
        // Out of range: clamped.
        p.teacher_changed(Change::Updated(entry(seal.seal(&key, &settings(1000)))));
        assert_eq!(p.cfg.in_flight_per_teacher, 64);
        // The settings are not taken for a teacher, nor their removal for one leaving.
        assert!(p.pool.is_empty());
        p.teacher_changed(Change::Removed(key.clone()));
        assert_eq!(p.cfg.in_flight_per_teacher, 64);
    }

    #[tokio::test]
    async fn a_placed_student_calls_its_share_and_others_only_while_its_own_are_unhealthy() {
        let cfg = DistillConfig { in_flight_per_teacher: 2, ..DistillConfig::default() };
        let mut p = Pipeline::new(cfg, Teachers::Fixed(Vec::new()));
        for t in ["10.0.0.1:9000", "10.0.0.2:9000"] {
            p.add_teacher(t);
        }
        // Unplaced: every teacher, least loaded first.
        p.pool.get_mut("10.0.0.1:9000").unwrap().outstanding = 1;
        assert_eq!(p.pick().as_deref(), Some("10.0.0.2:9000"));
        // Student 0 of 4 calls the first teacher only, busier or not.
        let (tx, rx) = tokio::sync::watch::channel(Some((0, 4)));
        p.placed = Some(rx);
        p.follow_place();
        assert_eq!(p.assigned.keys().collect::<Vec<_>>(), ["10.0.0.1:9000"]);
        assert_eq!(p.pick().as_deref(), Some("10.0.0.1:9000"));
        // Its own teacher full: it waits rather than open another connection.
        p.pool.get_mut("10.0.0.1:9000").unwrap().outstanding = 2;
        assert_eq!(p.pick(), None);
        // Its own teacher cooling down after a failure: the other takes over.
        p.pool.get_mut("10.0.0.1:9000").unwrap().cool_until = Some(Instant::now() + Duration::from_secs(60));
        assert_eq!(p.pick().as_deref(), Some("10.0.0.2:9000"));
        // Moved to rank 3: the second teacher is its own.
        tx.send(Some((3, 4))).unwrap();
        p.follow_place();
        assert_eq!(p.assigned.keys().collect::<Vec<_>>(), ["10.0.0.2:9000"]);
        // The pool's capacities weigh the shares: the first teacher three
        // times the second takes three of the four students.
        let settings = PoolSettings {
            in_flight_per_teacher: 2,
            capacity: [("10.0.0.1:9000".to_string(), 300.0), ("10.0.0.2:9000".to_string(), 100.0)].into(),
        };
        p.pool_settings(&serde_json::to_vec(&settings).unwrap());
        assert_eq!(p.assigned.keys().collect::<Vec<_>>(), ["10.0.0.2:9000"], "rank 3 of 4");
        tx.send(Some((2, 4))).unwrap();
        p.follow_place();
        assert_eq!(p.assigned.keys().collect::<Vec<_>>(), ["10.0.0.1:9000"], "rank 2 of 4");
        // Weights are kept with one request in flight at a time: a student
        // with a third of one teacher and two thirds of another sends them
        // a third and two thirds of its requests.
        let mut p = Pipeline::new(DistillConfig::default(), Teachers::Fixed(Vec::new()));
        p.add_teacher("10.0.0.1:9000");
        p.add_teacher("10.0.0.2:9000");
        p.add_teacher("10.0.0.3:9000");
        let (_tx, rx) = tokio::sync::watch::channel(Some((1, 4)));
        p.placed = Some(rx);
        p.follow_place();
        let mut to = BTreeMap::<String, u32>::new();
        for _ in 0..300 {
            let t = p.pick().unwrap();
            p.pool.get_mut(&t).unwrap().sent += 1;
            *to.entry(t).or_default() += 1;
        }
        assert_eq!(to.values().copied().collect::<Vec<_>>(), [100, 200], "{to:?}");
        let mut p = {
            let mut p = Pipeline::new(DistillConfig::default(), Teachers::Fixed(Vec::new()));
            p.add_teacher("10.0.0.1:9000");
            p.add_teacher("10.0.0.2:9000");
            p.placed = Some(tokio::sync::watch::channel(Some((2, 4))).1);
            p.follow_place();
            p.capacity = [("10.0.0.1:9000".to_string(), 300.0), ("10.0.0.2:9000".to_string(), 100.0)].into();
            p
        };
        p.reassign();
        // A teacher that leaves is out of every share at once, and back in
        // when it registers again (while still draining).
        p.remove_teacher("10.0.0.1:9000");
        assert_eq!(p.assigned.keys().collect::<Vec<_>>(), ["10.0.0.2:9000"]);
        p.add_teacher("10.0.0.1:9000");
        assert_eq!(p.assigned.keys().collect::<Vec<_>>(), ["10.0.0.1:9000"]);
    }

    #[test]
    fn a_failing_teacher_rests_longer_after_each_failure_up_to_a_cap() {
        let ms = |v: u64| Duration::from_millis(v);
        let got: Vec<Duration> = (1..=7).map(|n| backoff(ms(2000), n)).collect();
        assert_eq!(got, [2000, 4000, 8000, 16000, 30000, 30000, 30000].map(ms));
        assert_eq!(backoff(ms(50), 40), MAX_COOLDOWN, "no overflow");
        assert_eq!(backoff(ms(60_000), 3), ms(60_000), "a cool-down above the cap is kept");
    }

    #[test]
    fn an_endpoint_may_name_its_model_and_version() {
        let e = |s: &str| parse_endpoint(s);
        assert_eq!(e("10.0.0.1:8001"), ("10.0.0.1:8001".into(), None, None));
        assert_eq!(e("t1:8001/resnet"), ("t1:8001".into(), Some("resnet".into()), None));
        assert_eq!(e("t1:8001/resnet/3"), ("t1:8001".into(), Some("resnet".into()), Some("3".into())));
        assert_eq!(e("https://t1:443/m/2/"), ("https://t1:443".into(), Some("m".into()), Some("2".into())));
        assert_eq!(e("http://t1:80"), ("http://t1:80".into(), None, None));
    }
}
