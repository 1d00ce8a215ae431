//! The teacher service: a model served over the Open Inference Protocol
//! (KServe v2 gRPC), with concurrent requests batched together up to a
//! maximum batch or a maximum delay, registered in the store under a lease
//! while it serves.

use crate::distill::oip::{self, GrpcInferenceService, GrpcInferenceServiceServer, pb};
use crate::store::{AnyStore, Lease, StoreError, keys};
use crate::trainer::model::Mlp;
use std::{net::SocketAddr, sync::Arc, time::Duration};
use tokio::sync::{mpsc, oneshot};
use tonic::{Request, Response, Status};

/// How a teacher serves.
#[derive(Clone, Debug)]
pub struct TeacherConfig {
    /// The model name clients ask for.
    pub model_name: String,
    /// Rows run together at most.
    pub max_batch: usize,
    /// How long the first request of a batch waits for others.
    pub max_delay: Duration,
    /// Largest request accepted, in rows.
    pub max_request_rows: usize,
    /// Added to every request's service time, to stand in for a heavier
    /// model in benchmarks and tests.
    pub extra_latency: Duration,
    /// An accelerator emulated: each model execution also takes this long
    /// per row, one execution at a time (zero: the model's compute only).
    pub emulate_row: Duration,
}

impl Default for TeacherConfig {
    fn default() -> Self {
        TeacherConfig {
            model_name: "teacher".into(),
            max_batch: 512,
            max_delay: Duration::from_millis(2),
            max_request_rows: 4096,
            extra_latency: Duration::ZERO,
            emulate_row: Duration::ZERO,
        }
    }
}

struct Job {
    rows: usize,
    input: Vec<f32>,
    reply: oneshot::Sender<Vec<f32>>,
    /// When it was queued for a batch.
    queued: std::time::Instant,
}

/// A count and the nanoseconds it took in all.
#[derive(Clone, Copy, Default)]
struct Tally {
    count: u64,
    ns: u64,
}

impl Tally {
    fn add(&mut self, d: Duration) {
        self.count += 1;
        self.ns += d.as_nanos() as u64;
    }

    fn pb(self) -> Option<pb::StatisticDuration> {
        Some(pb::StatisticDuration { count: self.count, ns: self.ns })
    }
}

/// What the teacher has done since it started, as Triton's statistics
/// extension reports it.
#[derive(Default)]
struct Stats {
    success: Tally,
    fail: Tally,
    queue: Tally,
    infer: Tally,
    /// Rows inferred, and model executions (batches).
    rows: u64,
    executions: u64,
    last_ms: u64,
    /// Executions and their time, by batch size.
    by_batch: std::collections::BTreeMap<u64, Tally>,
}

fn lock_stats(s: &std::sync::Mutex<Stats>) -> std::sync::MutexGuard<'_, Stats> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

/// The OIP service of one model.
#[derive(Clone)]
pub struct TeacherService {
    model: Arc<Mlp>,
    config: Arc<TeacherConfig>,
    jobs: mpsc::Sender<Job>,
    stats: Arc<std::sync::Mutex<Stats>>,
}

impl TeacherService {
    /// Starts the batching task (inside a Tokio runtime).
    pub fn new(model: Mlp, config: TeacherConfig) -> Self {
        let model = Arc::new(model);
        let (tx, rx) = mpsc::channel(1024);
        let stats = Arc::new(std::sync::Mutex::new(Stats::default()));
        tokio::spawn(batcher(model.clone(), config.clone(), rx, stats.clone()));
        TeacherService { model, config: Arc::new(config), jobs: tx, stats }
    }

    /// The model's logits for `rows` inputs, through the batcher.
    pub async fn infer(&self, input: Vec<f32>, rows: usize) -> Result<Vec<f32>, Status> {
        let (reply, rx) = oneshot::channel();
        self.jobs
            .send(Job { rows, input, reply, queued: std::time::Instant::now() })
            .await
            .map_err(|_| Status::unavailable("teacher is shutting down"))?;
        rx.await.map_err(|_| Status::internal("the batch failed"))
    }

    /// What it served so far: rows, successful requests, failed requests.
    pub fn served(&self) -> (u64, u64, u64) {
        let st = lock_stats(&self.stats);
        (st.rows, st.success.count, st.fail.count)
    }

    fn check_model(&self, name: &str) -> Result<(), Status> {
        if name == self.config.model_name {
            Ok(())
        } else {
            Err(Status::not_found(format!(
                "unknown model {name:?}; this server serves {:?}",
                self.config.model_name
            )))
        }
    }

    /// The model and its version: any version but the one served is
    /// unknown (an empty version means the latest), as in Triton.
    fn check_model_version(&self, name: &str, version: &str) -> Result<(), Status> {
        self.check_model(name)?;
        if version.is_empty() || version == MODEL_VERSION {
            return Ok(());
        }
        Err(Status::not_found(format!(
            "model {name:?} has no version {version:?}; versions served: [{MODEL_VERSION:?}]"
        )))
    }

    /// The request's tensors are the ones the model has: one input named
    /// `input`, and, if outputs are asked for by name, `logits` only.
    fn check_tensors(&self, req: &pb::ModelInferRequest) -> Result<(), Status> {
        let model = &self.config.model_name;
        if req.inputs.len() != 1 {
            return Err(Status::invalid_argument(format!(
                "model {model:?} takes 1 input ({INPUT:?}), the request has {}",
                req.inputs.len()
            )));
        }
        let given = &req.inputs[0].name;
        if given != INPUT {
            return Err(Status::invalid_argument(format!(
                "unexpected inference input {given:?} for model {model:?}; its input is {INPUT:?}"
            )));
        }
        if let Some(o) = req.outputs.iter().find(|o| o.name != OUTPUT) {
            return Err(Status::invalid_argument(format!(
                "unexpected inference output {:?} for model {model:?}; its output is {OUTPUT:?}",
                o.name
            )));
        }
        Ok(())
    }
}

/// Longest a stopping teacher waits for its connections to close once it
/// stopped serving.
pub const FINISH_WITHIN: Duration = Duration::from_secs(3);
/// A quiet client is pinged this often, and given up when a ping stays
/// unanswered this long.
const KEEPALIVE: Duration = Duration::from_secs(20);
/// Requests at once on one connection.
const STREAMS: u32 = 64;
/// How long a client may take to finish its TLS handshake.
const HANDSHAKE: Duration = Duration::from_secs(10);
/// How long a connection may take to send its first bytes (HTTP/2's
/// preface, or TLS's hello).
const FIRST_BYTES_WITHIN: Duration = Duration::from_secs(10);
/// Connections served at once: beyond it the next waits in the listener's
/// queue until one ends (a descriptor and an HTTP/2 connection's buffers
/// each; a student holds one or a few).
const MAX_CONNECTIONS: usize = 4096;

/// The one version of the model a teacher serves.
const MODEL_VERSION: &str = "1";
/// The model's input and output tensors.
const INPUT: &str = "input";
const OUTPUT: &str = "logits";

/// Collects jobs into batches and runs them off the async threads.
async fn batcher(
    model: Arc<Mlp>,
    config: TeacherConfig,
    mut rx: mpsc::Receiver<Job>,
    stats: Arc<std::sync::Mutex<Stats>>,
) {
    while let Some(first) = rx.recv().await {
        let mut jobs = vec![first];
        let mut rows = jobs[0].rows;
        let deadline = tokio::time::Instant::now() + config.max_delay;
        while rows < config.max_batch {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(j)) => {
                    rows += j.rows;
                    jobs.push(j);
                }
                _ => break,
            }
        }
        let m = model.clone();
        let inputs: Vec<f32> = jobs.iter().flat_map(|j| j.input.iter().copied()).collect();
        let started = std::time::Instant::now();
        let out = match tokio::task::spawn_blocking(move || m.forward(&inputs, rows)).await {
            Ok(out) => out,
            Err(_) => continue, // the forward pass panicked: the callers see their channel closed
        };
        if !config.emulate_row.is_zero() {
            // The device is busy for the whole batch: the next one waits.
            tokio::time::sleep(config.emulate_row * rows as u32).await;
        }
        let took = started.elapsed();
        {
            let mut st = lock_stats(&stats);
            st.executions += 1;
            st.rows += rows as u64;
            st.by_batch.entry(rows as u64).or_default().add(took);
            for j in &jobs {
                st.queue.add(started.saturating_duration_since(j.queued));
                st.infer.add(took);
            }
            st.last_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
        }
        let c = model.output_dim();
        let mut at = 0;
        for j in jobs {
            let _ = j.reply.send(out[at * c..(at + j.rows) * c].to_vec());
            at += j.rows;
        }
    }
}

#[tonic::async_trait]
impl GrpcInferenceService for TeacherService {
    async fn server_live(
        &self,
        _: Request<pb::ServerLiveRequest>,
    ) -> Result<Response<pb::ServerLiveResponse>, Status> {
        Ok(Response::new(pb::ServerLiveResponse { live: true }))
    }

    async fn server_ready(
        &self,
        _: Request<pb::ServerReadyRequest>,
    ) -> Result<Response<pb::ServerReadyResponse>, Status> {
        Ok(Response::new(pb::ServerReadyResponse { ready: true }))
    }

    async fn model_ready(
        &self,
        r: Request<pb::ModelReadyRequest>,
    ) -> Result<Response<pb::ModelReadyResponse>, Status> {
        let r = r.get_ref();
        Ok(Response::new(pb::ModelReadyResponse {
            ready: self.check_model_version(&r.name, &r.version).is_ok(),
        }))
    }

    async fn server_metadata(
        &self,
        _: Request<pb::ServerMetadataRequest>,
    ) -> Result<Response<pb::ServerMetadataResponse>, Status> {
        Ok(Response::new(pb::ServerMetadataResponse {
            name: "edl-runtime".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            extensions: Vec::new(),
        }))
    }

    async fn model_metadata(
        &self,
        r: Request<pb::ModelMetadataRequest>,
    ) -> Result<Response<pb::ModelMetadataResponse>, Status> {
        self.check_model_version(&r.get_ref().name, &r.get_ref().version)?;
        let tensor = |name: &str, dim: usize| pb::model_metadata_response::TensorMetadata {
            name: name.into(),
            datatype: "FP32".into(),
            shape: vec![-1, dim as i64],
        };
        Ok(Response::new(pb::ModelMetadataResponse {
            name: self.config.model_name.clone(),
            versions: vec![MODEL_VERSION.into()],
            platform: "edl-mlp".into(),
            inputs: vec![tensor(INPUT, self.model.input_dim())],
            outputs: vec![tensor(OUTPUT, self.model.output_dim())],
        }))
    }

    async fn model_infer(
        &self,
        r: Request<pb::ModelInferRequest>,
    ) -> Result<Response<pb::ModelInferResponse>, Status> {
        let req = r.into_inner();
        self.check_model_version(&req.model_name, &req.model_version)?;
        // A request for this model counts as a success or a failure.
        let start = std::time::Instant::now();
        let answer = self.answer(req).await;
        let mut st = lock_stats(&self.stats);
        if answer.is_ok() {
            st.success.add(start.elapsed())
        } else {
            st.fail.add(start.elapsed())
        }
        answer
    }

    async fn model_config(
        &self,
        r: Request<pb::ModelConfigRequest>,
    ) -> Result<Response<pb::ModelConfigResponse>, Status> {
        let r = r.get_ref();
        self.check_model_version(&r.name, &r.version)?;
        let c = &self.config;
        Ok(Response::new(pb::ModelConfigResponse {
            config: Some(pb::ModelConfig {
                name: c.model_name.clone(),
                platform: "edl-mlp".into(),
                backend: "edl".into(),
                // The first dimension of every tensor is the rows of a request.
                max_batch_size: c.max_request_rows.min(i32::MAX as usize) as i32,
                input: vec![pb::ModelInput {
                    name: INPUT.into(),
                    data_type: pb::DataType::TypeFp32 as i32,
                    dims: vec![self.model.input_dim() as i64],
                }],
                output: vec![pb::ModelOutput {
                    name: OUTPUT.into(),
                    data_type: pb::DataType::TypeFp32 as i32,
                    dims: vec![self.model.output_dim() as i64],
                }],
                dynamic_batching: Some(pb::ModelDynamicBatching {
                    preferred_batch_size: vec![c.max_batch.min(i32::MAX as usize) as i32],
                    max_queue_delay_microseconds: c.max_delay.as_micros() as u64,
                }),
            }),
        }))
    }

    async fn model_statistics(
        &self,
        r: Request<pb::ModelStatisticsRequest>,
    ) -> Result<Response<pb::ModelStatisticsResponse>, Status> {
        let r = r.get_ref();
        // No name: every model this server has (this one).
        if !r.name.is_empty() {
            self.check_model_version(&r.name, &r.version)?;
        }
        let st = lock_stats(&self.stats);
        let zero = Tally::default();
        Ok(Response::new(pb::ModelStatisticsResponse {
            model_stats: vec![pb::ModelStatistics {
                name: self.config.model_name.clone(),
                version: MODEL_VERSION.into(),
                last_inference: st.last_ms,
                inference_count: st.rows,
                execution_count: st.executions,
                inference_stats: Some(pb::InferStatistics {
                    success: st.success.pb(),
                    fail: st.fail.pb(),
                    queue: st.queue.pb(),
                    compute_input: zero.pb(),
                    compute_infer: st.infer.pb(),
                    compute_output: zero.pb(),
                }),
                batch_stats: st
                    .by_batch
                    .iter()
                    .map(|(&size, &t)| pb::InferBatchStatistics {
                        batch_size: size,
                        compute_input: zero.pb(),
                        compute_infer: t.pb(),
                        compute_output: zero.pb(),
                    })
                    .collect(),
            }],
        }))
    }
}

impl TeacherService {
    /// Checks a request for this model and runs it.
    async fn answer(&self, req: pb::ModelInferRequest) -> Result<Response<pb::ModelInferResponse>, Status> {
        self.check_tensors(&req)?;
        let (input, rows, cols) =
            oip::input_f32(&req, 0).map_err(|e| Status::invalid_argument(e.to_string()))?;
        if cols != self.model.input_dim() {
            return Err(Status::invalid_argument(format!(
                "input has {cols} features per row; the model takes {}",
                self.model.input_dim()
            )));
        }
        if rows > self.config.max_request_rows {
            return Err(Status::resource_exhausted(format!(
                "{rows} rows in one request; at most {} accepted",
                self.config.max_request_rows
            )));
        }
        let logits = if rows == 0 { Vec::new() } else { self.infer(input, rows).await? };
        if !self.config.extra_latency.is_zero() {
            tokio::time::sleep(self.config.extra_latency).await;
        }
        Ok(Response::new(pb::ModelInferResponse {
            model_name: self.config.model_name.clone(),
            model_version: MODEL_VERSION.into(),
            id: req.id,
            parameters: Default::default(),
            outputs: vec![pb::model_infer_response::InferOutputTensor {
                name: OUTPUT.into(),
                datatype: "FP32".into(),
                shape: vec![rows as i64, self.model.output_dim() as i64],
                parameters: Default::default(),
                contents: None,
            }],
            raw_output_contents: vec![oip::f32_bytes(&logits)],
        }))
    }
}

/// A serving teacher; stops (and deregisters) when dropped or on [`Teacher::shutdown`].
pub struct Teacher {
    pub addr: SocketAddr,
    /// Where clients are told it serves (registered in the store):
    /// `host:port`, or `grpcs://host:port` with TLS.
    pub advertised: String,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
    lease: Option<Lease<AnyStore>>,
}

/// Where and how a teacher serves: its address, the address it registers,
/// and who may call it.
#[derive(Clone, Debug)]
pub struct Serving {
    pub listen: SocketAddr,
    /// Host name or address clients reach it at (None: the listen address,
    /// or this host's routable one when listening on all interfaces).
    pub advertise: Option<String>,
    pub access: Access,
    /// Largest request message the transport reads, bytes.
    pub max_message_bytes: usize,
}

impl Serving {
    /// Plain gRPC on `listen`, open to any client.
    pub fn on(listen: SocketAddr) -> Self {
        Serving { listen, advertise: None, access: Access::default(), max_message_bytes: 256 << 20 }
    }

    /// Refuses messages larger than a request of `rows` rows of `features`
    /// values could be, before reading them.
    pub fn max_rows(self, rows: usize, features: usize) -> Self {
        // 4 bytes a value however it is sent, and room for the names,
        // shape and parameters around them.
        let bytes = rows.saturating_mul(features).saturating_mul(4).saturating_add(64 << 10);
        Serving { max_message_bytes: bytes, ..self }
    }
}

/// Who may call a teacher: a bearer token every call must carry, and TLS
/// (the server's certificate and key, PEM).
#[derive(Clone, Default)]
pub struct Access {
    pub token: Option<String>,
    pub tls: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The token and the key are never printed.
        f.debug_struct("Access")
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

/// The OIP service with an answer for the methods of Triton's service that
/// a teacher does not serve (repository index, shared memory, tracing, ...):
/// UNIMPLEMENTED naming the method and what is served, rather than an empty
/// status.
#[derive(Clone)]
struct Explained<S>(S);

/// The methods a teacher answers.
const SERVED: [&str; 8] = [
    "ServerLive",
    "ServerReady",
    "ModelReady",
    "ServerMetadata",
    "ModelMetadata",
    "ModelInfer",
    "ModelConfig",
    "ModelStatistics",
];

impl<S> tonic::server::NamedService for Explained<S> {
    const NAME: &'static str = "inference.GRPCInferenceService";
}

impl<S, B> tonic::codegen::Service<tonic::codegen::http::Request<B>> for Explained<S>
where
    S: tonic::codegen::Service<
            tonic::codegen::http::Request<B>,
            Response = tonic::codegen::http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        >,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = std::convert::Infallible;
    type Future = tonic::codegen::BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: tonic::codegen::http::Request<B>) -> Self::Future {
        let method = req.uri().path().rsplit('/').next().unwrap_or_default().to_string();
        if SERVED.contains(&method.as_str()) {
            return Box::pin(self.0.call(req));
        }
        let why = format!("this teacher does not serve {method}; it serves {}", SERVED.join(", "));
        Box::pin(async move { Ok(Status::unimplemented(why).into_http()) })
    }
}

/// Equal, in time that does not depend on where two strings differ.
pub(crate) fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Where a teacher registers its endpoint: under `service` in `store`, as
/// a lease of `ttl`, sealed with the job's registration key (students
/// ignore a registration that does not verify).
pub struct Registration {
    pub store: Arc<AnyStore>,
    pub service: String,
    pub ttl: Duration,
    pub key: crate::leader::seal::RecordKey,
}

/// A connection the teacher's server is given: its first bytes bounded in
/// time (TLS's hello, then HTTP/2's preface within the TLS session, each
/// within 10 s), where the server itself waits for them without a timer.
/// The TLS handshake is done here, bounded, rather than by the server: the
/// server's HTTP/2 would wait for a preface without a timer once it is done.
pub enum Incoming {
    Plain(Guarded<tokio::net::TcpStream>),
    Tls(Box<Guarded<tokio_rustls::server::TlsStream<Guarded<tokio::net::TcpStream>>>>),
}

type Guarded<I> = crate::net::first_bytes::FirstBytes<I>;

/// `io`, whose first bytes (TLS's hello, HTTP/2's preface) must come in time.
fn guarded<I>(io: I) -> Guarded<I> {
    crate::net::first_bytes::FirstBytes::new(io, crate::net::first_bytes::SNIFFED, FIRST_BYTES_WITHIN)
}

impl tonic::transport::server::Connected for Incoming {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        match self {
            Incoming::Plain(s) => s.connect_info(),
            Incoming::Tls(s) => s.get_ref().get_ref().0.connect_info(),
        }
    }
}

impl tokio::io::AsyncRead for Incoming {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Incoming::Plain(s) => std::pin::Pin::new(s).poll_read(cx, buf),
            Incoming::Tls(s) => std::pin::Pin::new(&mut **s).poll_read(cx, buf),
        }
    }
}

impl tokio::io::AsyncWrite for Incoming {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Incoming::Plain(s) => std::pin::Pin::new(s).poll_write(cx, buf),
            Incoming::Tls(s) => std::pin::Pin::new(&mut **s).poll_write(cx, buf),
        }
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Incoming::Plain(s) => std::pin::Pin::new(s).poll_flush(cx),
            Incoming::Tls(s) => std::pin::Pin::new(&mut **s).poll_flush(cx),
        }
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Incoming::Plain(s) => std::pin::Pin::new(s).poll_shutdown(cx),
            Incoming::Tls(s) => std::pin::Pin::new(&mut **s).poll_shutdown(cx),
        }
    }
}

type Accepted = tokio::sync::mpsc::Sender<std::io::Result<Incoming>>;

/// [`MAX_CONNECTIONS`], or fewer where the process may open fewer files
/// (the soft `RLIMIT_NOFILE`, less a reserve for everything else): past the
/// bound a connection waits in the listener's queue, past the limit its
/// accept would fail.
fn connection_bound() -> usize {
    let files = edl_host_gpu::comm::accept::open_files_limit().unwrap_or(MAX_CONNECTIONS);
    MAX_CONNECTIONS.min(files.saturating_sub(256)).max(16)
}

/// Accepts `listener`'s connections on a task of its own, at most `bound`
/// at once (the next waits in the listener's queue until one ends), for the
/// server to serve; with `tls`, each shakes hands on a task of its own
/// within [`HANDSHAKE`]. An accept that fails (out of descriptors) is said
/// and waited out, where the server's own loop would try again at once and
/// spin; the listener closes once the server is gone (stopped, or killed).
/// Small responses must not wait for delayed ACKs (Nagle): no delay on any
/// connection.
fn accept_on(
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
    bound: usize,
    tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>,
) -> (tokio::task::JoinHandle<()>, tokio_stream::wrappers::ReceiverStream<std::io::Result<Incoming>>) {
    let (accepted, incoming) = tokio::sync::mpsc::channel::<std::io::Result<Incoming>>(64);
    let slots = Arc::new(tokio::sync::Semaphore::new(bound));
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    let accepting = tokio::spawn(async move {
        loop {
            // At the bound, nothing is accepted until a connection ends.
            let slot = tokio::select! {
                _ = accepted.closed() => return,
                slot = slots.clone().acquire_owned() => slot,
            };
            let Ok(slot) = slot else { return };
            let next = tokio::select! {
                _ = accepted.closed() => return,
                next = listener.accept() => next,
            };
            match next {
                Ok((s, peer)) => {
                    let _ = s.set_nodelay(true);
                    let s = guarded(s).holding(slot);
                    match &acceptor {
                        None => {
                            if accepted.send(Ok(Incoming::Plain(s))).await.is_err() {
                                return;
                            }
                        }
                        Some(a) => {
                            tokio::spawn(shake_hands(a.clone(), s, peer, addr, accepted.clone()));
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!("teacher on {addr}: accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    });
    (accepting, tokio_stream::wrappers::ReceiverStream::new(incoming))
}

/// Shakes hands with `peer` over TLS within [`HANDSHAKE`], and hands the
/// session on for the server, its first bytes (HTTP/2's preface) bounded.
async fn shake_hands(
    acceptor: tokio_rustls::TlsAcceptor,
    tcp: Guarded<tokio::net::TcpStream>,
    peer: SocketAddr,
    addr: SocketAddr,
    accepted: Accepted,
) {
    match tokio::time::timeout(HANDSHAKE, acceptor.accept(tcp)).await {
        Ok(Ok(tls)) => {
            let _ = accepted.send(Ok(Incoming::Tls(Box::new(guarded(tls))))).await;
        }
        Ok(Err(e)) => tracing::debug!("teacher on {addr}: TLS handshake with {peer}: {e}"),
        Err(_) => tracing::debug!("teacher on {addr}: {peer} took too long to shake hands"),
    }
}

impl Teacher {
    /// Serves `service` on `listen` (port 0 picks one). With a store, the
    /// endpoint is registered under `edl/services/<service_name>/teachers/<addr>`
    /// as a lease of `ttl`.
    pub async fn start(
        listen: SocketAddr,
        service: TeacherService,
        registration: Option<Registration>,
    ) -> Result<Self, TeacherError> {
        Self::start_with(listen, service, registration).await
    }

    /// Serves any OIP service implementation (tests wrap [`TeacherService`] to inject faults).
    pub async fn start_with<S: GrpcInferenceService>(
        listen: SocketAddr,
        service: S,
        registration: Option<Registration>,
    ) -> Result<Self, TeacherError> {
        Self::serve(Serving::on(listen), service, registration).await
    }

    /// Serves as `serving` says. The address registered in the store is
    /// `host:port`, or `grpcs://host:port` for a teacher with TLS.
    pub async fn serve<S: GrpcInferenceService>(
        serving: Serving,
        service: S,
        registration: Option<Registration>,
    ) -> Result<Self, TeacherError> {
        let listen = serving.listen;
        let listener =
            tokio::net::TcpListener::bind(listen).await.map_err(|e| TeacherError::Bind(listen, e))?;
        let addr = listener.local_addr().map_err(|e| TeacherError::Bind(listen, e))?;
        let host_port = match serving.advertise {
            Some(host) => crate::net::host_port(&host, addr.port()),
            None if addr.ip().is_unspecified() => {
                let ip = crate::net::routable_ip(addr.is_ipv6())
                    .map_err(|e| TeacherError::Advertise(addr, format!("{e:#}")))?;
                SocketAddr::new(ip, addr.port()).to_string()
            }
            None => addr.to_string(),
        };
        let advertised =
            if serving.access.tls.is_some() { format!("grpcs://{host_port}") } else { host_port.clone() };
        let (stop, stopped) = oneshot::channel::<()>();
        let tls = match &serving.access.tls {
            Some((cert, key)) => {
                let config =
                    crate::net::tls::tls_config(cert, key).map_err(|e| TeacherError::Tls(e.to_string()))?;
                // gRPC is HTTP/2 alone.
                let mut config = (*config).clone();
                config.alpn_protocols = vec![b"h2".to_vec()];
                Some(Arc::new(config))
            }
            None => None,
        };
        let (accepting, incoming) = accept_on(listener, addr, connection_bound(), tls);
        let token = serving.access.token.clone();
        let check = move |req: Request<()>| -> Result<Request<()>, Status> {
            let Some(want) = &token else { return Ok(req) };
            let given = req.metadata().get("authorization").and_then(|v| v.to_str().ok());
            match given.and_then(|v| v.strip_prefix("Bearer ")) {
                Some(t) if same_secret(t.as_bytes(), want.as_bytes()) => Ok(req),
                Some(_) => Err(Status::unauthenticated("wrong bearer token")),
                None => Err(Status::unauthenticated(
                    "this teacher needs a bearer token (authorization: Bearer ...)",
                )),
            }
        };
        let server = tonic::service::interceptor::InterceptedService::new(
            Explained(
                GrpcInferenceServiceServer::new(service).max_decoding_message_size(serving.max_message_bytes),
            ),
            check,
        );
        // A client gone or frozen is given up once a ping stays unanswered;
        // requests at once on one connection are bounded (each message is
        // whole in memory before it is answered).
        let mut builder = tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(KEEPALIVE))
            .http2_keepalive_timeout(Some(KEEPALIVE))
            .max_concurrent_streams(STREAMS);
        let task = tokio::spawn(async move {
            let result = builder
                .add_service(server)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stopped.await;
                })
                .await;
            accepting.abort();
            if let Err(e) = result {
                tracing::warn!("teacher on {addr}: {e}");
            }
        });
        let lease = match registration {
            Some(r) => {
                let key = keys::teacher(&r.service, &host_port);
                let sealed = r.key.seal(&key, advertised.as_bytes());
                Some(Lease::hold(r.store, key, sealed, r.ttl).await.map_err(TeacherError::Store)?)
            }
            None => None,
        };
        Ok(Teacher { addr, advertised, stop: Some(stop), task, lease })
    }

    /// Deregisters, then stops serving (in-flight requests are finished,
    /// within [`FINISH_WITHIN`]).
    pub async fn shutdown(self) {
        self.drain_and_shutdown(Duration::ZERO).await
    }

    /// Deregisters, goes on serving for `drain` (students following the
    /// store stop sending to it meanwhile, so none of their requests is
    /// refused), then stops serving (in-flight requests are finished).
    pub async fn drain_and_shutdown(mut self, drain: Duration) {
        if let Some(lease) = self.lease.take()
            && let Err(e) = lease.release().await
        {
            tracing::warn!("teacher {}: could not deregister: {e}", self.addr);
        }
        if !drain.is_zero() {
            tokio::time::sleep(drain).await;
        }
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        // In-flight requests are finished, each connection closed as it
        // goes idle; a student that never answers the server's goodbye (a
        // process frozen with a connection open) is not waited for past
        // the bound. Its connection's own task ends when the student
        // answers no ping (HTTP/2's keepalive), or with the process.
        if tokio::time::timeout(FINISH_WITHIN, &mut self.task).await.is_err() {
            tracing::warn!(
                "teacher {}: connections still open {FINISH_WITHIN:?} after it stopped serving; not waited for",
                self.addr
            );
            self.task.abort();
        }
    }

    /// Stops at once, as a crash would: connections drop, the lease is left to expire.
    pub fn kill(mut self) {
        self.task.abort();
        if let Some(lease) = self.lease.take() {
            drop(lease);
        }
        self.stop.take();
    }
}

impl Drop for Teacher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Why a teacher could not start.
#[derive(Debug, thiserror::Error)]
pub enum TeacherError {
    #[error("listening on {0}: cannot tell which address other hosts reach ({1}); give --advertise")]
    Advertise(SocketAddr, String),
    #[error("TLS: {0}")]
    Tls(String),
    #[error("cannot listen on {0}: {1}")]
    Bind(SocketAddr, std::io::Error),
    #[error("cannot register in the store: {0}")]
    Store(StoreError),
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// A connection that never starts HTTP/2 (nor TLS) is closed within the
    /// time a first request has; a student's calls are answered meanwhile.
    #[test]
    fn a_connection_that_never_starts_http2_is_closed() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        rt.block_on(async {
            use tokio::io::AsyncReadExt;
            let model = crate::trainer::model::Mlp::random(&[4, 8, 3], 1);
            let service = TeacherService::new(model, TeacherConfig::default());
            let t = Teacher::start("127.0.0.1:0".parse().unwrap(), service, None).await.unwrap();
            let mut silent = tokio::net::TcpStream::connect(t.addr).await.unwrap();
            let url = format!("http://{}", t.addr);
            let mut c =
                super::super::oip::pb::grpc_inference_service_client::GrpcInferenceServiceClient::connect(
                    url,
                )
                .await
                .unwrap();
            assert!(
                c.server_live(super::super::oip::pb::ServerLiveRequest {}).await.unwrap().into_inner().live
            );
            // The server says its settings first; then it closes.
            let mut said = Vec::new();
            let within = FIRST_BYTES_WITHIN * 6;
            let closed = tokio::time::timeout(within, silent.read_to_end(&mut said)).await;
            assert!(closed.is_ok(), "still open after {} bytes", said.len());
            t.shutdown().await;
        });
    }

    /// At its bound of connections a teacher takes the next only when one
    /// ends: the next waits in the listener's queue, and is served then.
    #[test]
    fn past_its_bound_of_connections_a_teacher_takes_the_next_when_one_ends() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            use tokio_stream::StreamExt;
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let (accepting, mut incoming) = accept_on(listener, addr, 2, None);
            let mut clients = Vec::new();
            for _ in 0..3 {
                clients.push(tokio::net::TcpStream::connect(addr).await.unwrap());
            }
            let first = incoming.next().await.expect("a connection").unwrap();
            let _second = incoming.next().await.expect("a connection").unwrap();
            let third = tokio::time::timeout(Duration::from_millis(300), incoming.next()).await;
            assert!(third.is_err(), "a third connection taken past the bound of 2");
            drop(first);
            let third = tokio::time::timeout(Duration::from_secs(30), incoming.next()).await;
            assert!(matches!(third, Ok(Some(Ok(_)))), "the third is taken once one ends");
            accepting.abort();
        });
    }

    /// A student frozen with a connection open (it opened HTTP/2 and then
    /// answers nothing, not the server's goodbye either): the teacher's
    /// shutdown returns after [`FINISH_WITHIN`] instead of waiting for it
    /// forever.
    #[test]
    fn a_stopping_teacher_does_not_wait_forever_for_a_frozen_student() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        rt.block_on(async {
            let model = crate::trainer::model::Mlp::random(&[4, 8, 3], 1);
            let t = Teacher::start(
                "127.0.0.1:0".parse().unwrap(),
                TeacherService::new(model, TeacherConfig::default()),
                None,
            )
            .await
            .unwrap();
            let mut frozen = tokio::net::TcpStream::connect(t.addr).await.unwrap();
            // HTTP/2's preface and an empty SETTINGS frame; then silence.
            frozen.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0").await.unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
            let stopped = tokio::time::timeout(FINISH_WITHIN * 10, t.shutdown()).await;
            assert!(stopped.is_ok(), "still waiting for the frozen student");
            drop(frozen);
        });
    }
}
