//! KServe v2 over HTTP/REST, served next to gRPC by the same teacher
//! (`edl-runtime teacher --http-listen ADDR`): health, server and model
//! metadata, readiness, inference with JSON tensors or the binary-data
//! extension (`Inference-Header-Content-Length`), and Triton's model
//! configuration and statistics. Each route turns its request into the
//! gRPC message and asks the same service, so both protocols answer alike.

use super::oip::{GrpcInferenceService, HEADER_LENGTH, pb};
use super::teacher::TeacherService;
use axum::{
    Router,
    body::Bytes,
    extract::{Path, State},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use serde_json::{Value, json};
use std::{net::SocketAddr, sync::Arc};
use tonic::{Code, Request};

#[derive(Clone)]
struct Served {
    service: TeacherService,
    token: Option<Arc<str>>,
    /// Without a token, on loopback: the port whose loopback names are the
    /// only `Host` answered (see [`crate::net::loopback_host`]).
    loopback_port: Option<u16>,
}

/// The routes of the REST protocol for `service`, served on `listening`;
/// with `token`, every call must carry `Authorization: Bearer TOKEN`;
/// without one on loopback, every call must name a loopback host at its
/// port (a page whose name was rebound to 127.0.0.1 is refused).
pub fn router(
    service: TeacherService,
    token: Option<String>,
    max_body: usize,
    listening: std::net::SocketAddr,
) -> Router {
    let loopback_port = (token.is_none() && listening.ip().is_loopback()).then_some(listening.port());
    let served = Served { service, token: token.map(Arc::from), loopback_port };
    Router::new()
        .route("/v2/health/live", get(|| async { StatusCode::OK }))
        .route("/v2/health/ready", get(|| async { StatusCode::OK }))
        .route("/v2", get(server_metadata))
        .route("/v2/models/{model}", get(model_metadata))
        .route("/v2/models/{model}/versions/{version}", get(model_metadata_v))
        .route("/v2/models/{model}/ready", get(model_ready))
        .route("/v2/models/{model}/versions/{version}/ready", get(model_ready_v))
        .route("/v2/models/{model}/config", get(model_config))
        .route("/v2/models/{model}/stats", get(model_stats))
        .route("/v2/models/{model}/infer", post(infer))
        .route("/v2/models/{model}/versions/{version}/infer", post(infer_v))
        .fallback(|| async {
            error(StatusCode::NOT_FOUND, "no such route in KServe v2 as this teacher serves it")
        })
        // The token is checked before a request's body is read: a client
        // without it cannot make the teacher read a large body.
        .layer(axum::middleware::from_fn_with_state(served.clone(), admit_first))
        .with_state(served)
        // As large as the largest request the teacher takes (axum's default
        // of 2 MiB refused requests that gRPC takes).
        .layer(axum::extract::DefaultBodyLimit::max(max_body))
}

/// Refuses a request without the teacher's token before anything else of it
/// is read (health checks excepted, as probes carry no token), and without a
/// token on loopback one that names another host.
async fn admit_first(
    State(s): State<Served>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if req.uri().path().starts_with("/v2/health/") {
        return next.run(req).await;
    }
    if let Some(port) = s.loopback_port
        && !crate::net::loopback_host(req.uri(), req.headers(), port)
    {
        return error(
            StatusCode::FORBIDDEN,
            "this teacher has no token and answers only loopback names (127.0.0.1, localhost, [::1]) at its port",
        );
    }
    if let Err(refused) = s.admit(req.headers()) {
        return refused;
    }
    next.run(req).await
}

/// The largest request body for `rows` rows of `features` values: JSON
/// spends up to about 24 bytes on a value, the binary extension 4.
pub fn max_body(rows: usize, features: usize) -> usize {
    rows.saturating_mul(features).saturating_mul(24).saturating_add(64 << 10)
}

/// Most connections served at once: past it new ones wait in the
/// listener's backlog, so clients that connect and stay can neither take
/// the process's file descriptors nor its memory.
const MAX_CONNECTIONS: usize = 256;
/// How long a client may take to finish its TLS handshake, and to send a
/// request's headers (the first, and each next one on a kept connection).
const HANDSHAKE_TIME: std::time::Duration = std::time::Duration::from_secs(10);
const HEADER_TIME: std::time::Duration = std::time::Duration::from_secs(10);
/// How long a write to a client may wait for it to read: one that sends
/// requests and never reads its answers gives its slot back after this.
const WRITE_TIME: std::time::Duration = std::time::Duration::from_secs(30);
/// An HTTP/2 client is pinged this often when quiet, and given up when a
/// ping stays unanswered this long: a connection whose client is gone or
/// frozen gives its slot back.
const KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(20);
/// Requests at once on one HTTP/2 connection (each body whole in memory).
const STREAMS: u32 = 16;
// What tells HTTP/2 from HTTP/1 is read before hyper's own timers start:
// bounded here by [`HEADER_TIME`].
use crate::net::first_bytes::SNIFFED;

/// Serves `router` on `listener` until the process ends (`what` names
/// the endpoint in its warnings).
pub async fn serve(listener: tokio::net::TcpListener, router: Router, what: &'static str) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Some((tcp, _, slot)) = accept(&listener, &slots, what).await else { return };
        let router = router.clone();
        tokio::spawn(async move {
            serve_connection(tcp, router, what).await;
            drop(slot);
        });
    }
}

/// The next connection, once a slot is free for it (None: the listener is
/// gone). An error accepting (out of descriptors, say) is said and waited out.
async fn accept(
    listener: &tokio::net::TcpListener,
    slots: &Arc<tokio::sync::Semaphore>,
    what: &'static str,
) -> Option<(tokio::net::TcpStream, SocketAddr, tokio::sync::OwnedSemaphorePermit)> {
    let slot = slots.clone().acquire_owned().await.ok()?;
    loop {
        match listener.accept().await {
            Ok((tcp, peer)) => return Some((tcp, peer, slot)),
            Err(e) => {
                tracing::warn!("{what}: accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    }
}

/// Serves HTTP/1.1 or HTTP/2 on one connection, whose client must start
/// its first request and send each request's headers within
/// [`HEADER_TIME`], answer HTTP/2's pings within [`KEEPALIVE`], and read
/// what it is sent (no write waits on it longer than [`WRITE_TIME`]).
async fn serve_connection<I>(io: I, router: Router, what: &'static str)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    serve_connection_within(io, router, what, WRITE_TIME).await
}

async fn serve_connection_within<I>(
    io: I,
    router: Router,
    what: &'static str,
    write_time: std::time::Duration,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut io = tokio_io_timeout::TimeoutStream::new(io);
    io.set_write_timeout(Some(write_time));
    let io = Box::pin(io);
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(HEADER_TIME);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(KEEPALIVE))
        .keep_alive_timeout(KEEPALIVE)
        .max_concurrent_streams(STREAMS);
    let service = hyper_util::service::TowerToHyperService::new(router);
    let io = crate::net::first_bytes::FirstBytes::new(io, SNIFFED, HEADER_TIME).until_http1();
    if let Err(e) = builder.serve_connection_with_upgrades(TokioIo::new(io), service).await {
        tracing::debug!("{what}: a connection ended: {e}");
    }
}

pub use crate::net::tls::{TlsConfigError, tls_config};

/// Serves `router` over TLS on `listener` until the process ends. Each
/// connection, its handshake (bounded by [`HANDSHAKE_TIME`]) included, runs
/// on a task of its own and holds one of [`MAX_CONNECTIONS`] slots, so a
/// client that stalls holds up no one else.
pub async fn serve_tls(
    listener: tokio::net::TcpListener,
    router: Router,
    config: Arc<tokio_rustls::rustls::ServerConfig>,
    what: &'static str,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Some((tcp, peer, slot)) = accept(&listener, &slots, what).await else { return };
        let (acceptor, router) = (acceptor.clone(), router.clone());
        tokio::spawn(async move {
            match tokio::time::timeout(HANDSHAKE_TIME, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => serve_connection(tls, router, what).await,
                Ok(Err(e)) => tracing::debug!("{what}: TLS handshake with {peer}: {e}"),
                Err(_) => tracing::debug!("{what}: {peer} took too long to shake hands"),
            }
            drop(slot);
        });
    }
}

fn error(code: StatusCode, message: impl Into<String>) -> Response {
    (code, axum::Json(json!({ "error": message.into() }))).into_response()
}

/// A gRPC status as the REST protocol answers it.
fn from_status(s: tonic::Status) -> Response {
    let code = match s.code() {
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => StatusCode::BAD_REQUEST,
        Code::ResourceExhausted => StatusCode::PAYLOAD_TOO_LARGE,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        // A failure of the server's, not of the request: Internal, Unknown,
        // DataLoss, Aborted, Cancelled.
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    error(code, s.message())
}

impl Served {
    fn admit(&self, headers: &HeaderMap) -> Result<(), Response> {
        // (Without a token on loopback, the host was checked first.)
        let Some(want) = &self.token else { return Ok(()) };
        let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        match given.and_then(|v| v.strip_prefix("Bearer ")) {
            Some(t) if crate::distill::teacher::same_secret(t.as_bytes(), want.as_bytes()) => Ok(()),
            Some(_) => Err(error(StatusCode::UNAUTHORIZED, "wrong bearer token")),
            None => Err(error(
                StatusCode::UNAUTHORIZED,
                "this teacher needs a bearer token (Authorization: Bearer ...)",
            )),
        }
    }
}

async fn server_metadata(State(s): State<Served>, headers: HeaderMap) -> Response {
    if let Err(r) = s.admit(&headers) {
        return r;
    }
    match s.service.server_metadata(Request::new(pb::ServerMetadataRequest {})).await {
        Ok(m) => {
            let mut m = m.into_inner();
            // Binary tensors are this endpoint's to offer (KServe v2's REST extension).
            m.extensions.push("binary_tensor_data".into());
            axum::Json(json!({ "name": m.name, "version": m.version, "extensions": m.extensions }))
                .into_response()
        }
        Err(e) => from_status(e),
    }
}

async fn model_metadata(state: State<Served>, headers: HeaderMap, Path(model): Path<String>) -> Response {
    metadata(state, headers, model, String::new()).await
}

async fn model_metadata_v(
    state: State<Served>,
    headers: HeaderMap,
    Path((model, version)): Path<(String, String)>,
) -> Response {
    metadata(state, headers, model, version).await
}

async fn metadata(State(s): State<Served>, headers: HeaderMap, name: String, version: String) -> Response {
    if let Err(r) = s.admit(&headers) {
        return r;
    }
    match s.service.model_metadata(Request::new(pb::ModelMetadataRequest { name, version })).await {
        Ok(m) => {
            let m = m.into_inner();
            let tensors = |ts: &[pb::model_metadata_response::TensorMetadata]| -> Vec<Value> {
                ts.iter()
                    .map(|t| json!({ "name": t.name, "datatype": t.datatype, "shape": t.shape }))
                    .collect()
            };
            axum::Json(json!({
                "name": m.name,
                "versions": m.versions,
                "platform": m.platform,
                "inputs": tensors(&m.inputs),
                "outputs": tensors(&m.outputs),
            }))
            .into_response()
        }
        Err(e) => from_status(e),
    }
}

async fn model_ready(state: State<Served>, headers: HeaderMap, Path(model): Path<String>) -> Response {
    ready(state, headers, model, String::new()).await
}

async fn model_ready_v(
    state: State<Served>,
    headers: HeaderMap,
    Path((model, version)): Path<(String, String)>,
) -> Response {
    ready(state, headers, model, version).await
}

async fn ready(State(s): State<Served>, headers: HeaderMap, name: String, version: String) -> Response {
    if let Err(r) = s.admit(&headers) {
        return r;
    }
    match s.service.model_ready(Request::new(pb::ModelReadyRequest { name, version })).await {
        Ok(r) if r.get_ref().ready => StatusCode::OK.into_response(),
        Ok(_) => StatusCode::BAD_REQUEST.into_response(),
        Err(e) => from_status(e),
    }
}

fn datatype_name(t: i32) -> String {
    pb::DataType::try_from(t).map(|d| d.as_str_name().to_string()).unwrap_or_else(|_| "TYPE_INVALID".into())
}

async fn model_config(State(s): State<Served>, headers: HeaderMap, Path(name): Path<String>) -> Response {
    if let Err(r) = s.admit(&headers) {
        return r;
    }
    let asked = pb::ModelConfigRequest { name, version: String::new() };
    match s.service.model_config(Request::new(asked)).await {
        Ok(c) => {
            let Some(c) = c.into_inner().config else {
                return error(StatusCode::INTERNAL_SERVER_ERROR, "no config");
            };
            let io = |name: &str, data_type: i32, dims: &[i64]| json!({ "name": name, "data_type": datatype_name(data_type), "dims": dims });
            let batching = c.dynamic_batching.map(|d| {
                json!({
                    "preferred_batch_size": d.preferred_batch_size,
                    "max_queue_delay_microseconds": d.max_queue_delay_microseconds,
                })
            });
            axum::Json(json!({
                "name": c.name,
                "platform": c.platform,
                "backend": c.backend,
                "max_batch_size": c.max_batch_size,
                "input": c.input.iter().map(|i| io(&i.name, i.data_type, &i.dims)).collect::<Vec<_>>(),
                "output": c.output.iter().map(|o| io(&o.name, o.data_type, &o.dims)).collect::<Vec<_>>(),
                "dynamic_batching": batching,
            }))
            .into_response()
        }
        Err(e) => from_status(e),
    }
}

async fn model_stats(State(s): State<Served>, headers: HeaderMap, Path(name): Path<String>) -> Response {
    if let Err(r) = s.admit(&headers) {
        return r;
    }
    let asked = pb::ModelStatisticsRequest { name, version: String::new() };
    match s.service.model_statistics(Request::new(asked)).await {
        Ok(r) => {
            let d = |t: Option<pb::StatisticDuration>| {
                let t = t.unwrap_or_default();
                json!({ "count": t.count, "ns": t.ns })
            };
            let stats: Vec<Value> = r
                .into_inner()
                .model_stats
                .into_iter()
                .map(|m| {
                    let i = m.inference_stats.unwrap_or_default();
                    json!({
                        "name": m.name,
                        "version": m.version,
                        "last_inference": m.last_inference,
                        "inference_count": m.inference_count,
                        "execution_count": m.execution_count,
                        "inference_stats": {
                            "success": d(i.success), "fail": d(i.fail), "queue": d(i.queue),
                            "compute_input": d(i.compute_input), "compute_infer": d(i.compute_infer),
                            "compute_output": d(i.compute_output),
                        },
                        "batch_stats": m.batch_stats.iter().map(|b| json!({
                            "batch_size": b.batch_size,
                            "compute_input": d(b.compute_input),
                            "compute_infer": d(b.compute_infer),
                            "compute_output": d(b.compute_output),
                        })).collect::<Vec<_>>(),
                    })
                })
                .collect();
            axum::Json(json!({ "model_stats": stats })).into_response()
        }
        Err(e) => from_status(e),
    }
}

async fn infer(state: State<Served>, headers: HeaderMap, Path(model): Path<String>, body: Bytes) -> Response {
    infer_at(state, headers, model, String::new(), body).await
}

async fn infer_v(
    state: State<Served>,
    headers: HeaderMap,
    Path((model, version)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    infer_at(state, headers, model, version, body).await
}

/// A KServe v2 inference request's JSON part, read as it arrives: each
/// input's numbers go straight into one flat list (a tree of JSON values,
/// one node for every number, took about 16 times the body). Parameters
/// are small and read as values; unknown fields are ignored.
#[derive(serde::Deserialize)]
struct InferBody {
    #[serde(default)]
    id: Option<String>,
    inputs: Vec<InputBody>,
    #[serde(default)]
    outputs: Vec<OutputBody>,
    #[serde(default)]
    parameters: Params,
}

#[derive(serde::Deserialize)]
struct InputBody {
    name: String,
    datatype: String,
    shape: Vec<i64>,
    #[serde(default)]
    parameters: Params,
    #[serde(default)]
    data: Numbers,
}

#[derive(serde::Deserialize)]
struct OutputBody {
    name: String,
    #[serde(default)]
    parameters: Params,
}

/// The parameters this endpoint reads; any other is skipped unread, and
/// one of an unexpected type counts as absent (as the protocol's clients
/// expect of a server that does not know it).
#[derive(Default, serde::Deserialize)]
#[serde(default)]
struct Params {
    binary_data_size: Scalar,
    binary_data_output: Scalar,
    binary_data: Scalar,
}

/// A parameter's value where a number or a flag is expected: anything
/// else is read through without being kept (an array is not built up).
#[derive(Default)]
enum Scalar {
    #[default]
    Other,
    Count(u64),
    Flag(bool),
}

impl Scalar {
    fn count(&self) -> Option<u64> {
        match self {
            Scalar::Count(n) => Some(*n),
            _ => None,
        }
    }

    fn flag(&self) -> bool {
        matches!(self, Scalar::Flag(true))
    }
}

impl<'de> serde::Deserialize<'de> for Scalar {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Read;
        impl<'de> serde::de::Visitor<'de> for Read {
            type Value = Scalar;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a parameter's value")
            }
            fn visit_u64<E>(self, v: u64) -> Result<Scalar, E> {
                Ok(Scalar::Count(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Scalar, E> {
                Ok(u64::try_from(v).map_or(Scalar::Other, Scalar::Count))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Scalar, E> {
                Ok(Scalar::Other)
            }
            fn visit_bool<E>(self, v: bool) -> Result<Scalar, E> {
                Ok(Scalar::Flag(v))
            }
            fn visit_str<E>(self, _: &str) -> Result<Scalar, E> {
                Ok(Scalar::Other)
            }
            fn visit_unit<E>(self) -> Result<Scalar, E> {
                Ok(Scalar::Other)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Scalar, A::Error> {
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(Scalar::Other)
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Scalar, A::Error> {
                while map.next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?.is_some() {}
                Ok(Scalar::Other)
            }
        }
        d.deserialize_any(Read)
    }
}

/// An input's `data`, nested arrays of numbers, flattened as read; what is
/// not a number is noted (a `BYTES` input's strings, a `null`), for the
/// input's datatype to be judged first.
#[derive(Default)]
struct Numbers {
    values: Vec<f32>,
    not_a_number: Option<String>,
}

impl<'de> serde::Deserialize<'de> for Numbers {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut n = Numbers::default();
        d.deserialize_any(Flatten(&mut n))?;
        Ok(n)
    }
}

/// Reads numbers, or arrays of them at any depth, into one list.
struct Flatten<'a>(&'a mut Numbers);

impl Flatten<'_> {
    fn other(self, what: String) {
        self.0.not_a_number.get_or_insert(what);
    }
}

impl<'de> serde::de::Visitor<'de> for Flatten<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("numbers, or arrays of them")
    }
    fn visit_f64<E>(self, v: f64) -> Result<(), E> {
        match v as f32 {
            x if x.is_finite() => self.0.values.push(x),
            _ => self.other(format!("{v} (beyond f32's range)")),
        }
        Ok(())
    }
    fn visit_i64<E>(self, v: i64) -> Result<(), E> {
        self.0.values.push(v as f32);
        Ok(())
    }
    fn visit_u64<E>(self, v: u64) -> Result<(), E> {
        self.0.values.push(v as f32);
        Ok(())
    }
    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        let shown: String = v.chars().take(32).collect();
        self.other(format!("{shown:?}"));
        Ok(())
    }
    fn visit_bool<E>(self, v: bool) -> Result<(), E> {
        self.other(v.to_string());
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        self.other("null".into());
        Ok(())
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Flatten(&mut *self.0))?.is_some() {}
        Ok(())
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?.is_some() {}
        self.other("an object".into());
        Ok(())
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for Flatten<'_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

/// A REST inference request as the gRPC message, with its binary tensors.
fn to_grpc(
    model: String,
    version: String,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<(pb::ModelInferRequest, bool), String> {
    let json_len = match headers.get(HEADER_LENGTH) {
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n <= body.len())
            .ok_or("Inference-Header-Content-Length is not a length within the body")?,
        None => body.len(),
    };
    let head: InferBody = serde_json::from_slice(&body[..json_len])
        .map_err(|e| format!("the request is not a KServe v2 inference request: {e}"))?;
    let mut binary = &body[json_len..];
    let mut req = pb::ModelInferRequest {
        model_name: model,
        model_version: version,
        id: head.id.unwrap_or_default(),
        ..Default::default()
    };
    for input in head.inputs {
        let InputBody { name, datatype, shape, parameters, data } = input;
        let raw = match parameters.binary_data_size.count() {
            Some(n) => {
                let n = n as usize;
                if n > binary.len() {
                    return Err(format!("input {name:?}: {n} binary bytes announced, {} left", binary.len()));
                }
                let (mine, rest) = binary.split_at(n);
                binary = rest;
                mine.to_vec()
            }
            None => {
                if datatype != "FP32" {
                    return Err(format!("input {name:?} has datatype {datatype:?}; FP32 is needed"));
                }
                if let Some(what) = data.not_a_number {
                    return Err(format!("input {name:?}: {what} in its data is not a number"));
                }
                crate::distill::oip::f32_bytes(&data.values)
            }
        };
        req.inputs.push(pb::model_infer_request::InferInputTensor {
            name,
            datatype,
            shape,
            ..Default::default()
        });
        req.raw_input_contents.push(raw);
    }
    let mut binary_out = head.parameters.binary_data_output.flag();
    for o in head.outputs {
        binary_out |= o.parameters.binary_data.flag();
        req.outputs
            .push(pb::model_infer_request::InferRequestedOutputTensor { name: o.name, ..Default::default() });
    }
    Ok((req, binary_out))
}

async fn infer_at(
    State(s): State<Served>,
    headers: HeaderMap,
    model: String,
    version: String,
    body: Bytes,
) -> Response {
    if let Err(r) = s.admit(&headers) {
        return r;
    }
    let (req, binary) = match to_grpc(model, version, &headers, &body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    let answer = match s.service.model_infer(Request::new(req)).await {
        Ok(a) => a.into_inner(),
        Err(e) => return from_status(e),
    };
    let mut outputs = Vec::new();
    let mut blobs = Vec::new();
    for (i, o) in answer.outputs.iter().enumerate() {
        let raw = answer.raw_output_contents.get(i).cloned().unwrap_or_default();
        if binary {
            outputs.push(json!({
                "name": o.name, "datatype": o.datatype, "shape": o.shape,
                "parameters": { "binary_data_size": raw.len() },
            }));
            blobs.extend_from_slice(&raw);
        } else {
            let data: Vec<f32> =
                raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            outputs.push(json!({ "name": o.name, "datatype": o.datatype, "shape": o.shape, "data": data }));
        }
    }
    let head = json!({
        "model_name": answer.model_name,
        "model_version": answer.model_version,
        "id": answer.id,
        "outputs": outputs,
    });
    if !binary {
        return axum::Json(head).into_response();
    }
    let mut body = serde_json::to_vec(&head).unwrap_or_default();
    let json_len = body.len();
    body.extend_from_slice(&blobs);
    let mut r = (StatusCode::OK, body).into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
    if let Ok(v) = HeaderValue::from_str(&json_len.to_string()) {
        r.headers_mut().insert(HEADER_LENGTH, v);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn request(json: &str) -> Result<(pb::ModelInferRequest, bool), String> {
        to_grpc("m".into(), String::new(), &HeaderMap::new(), json.as_bytes())
    }

    /// An input's nested arrays are read as one flat list of f32 values;
    /// parameters and fields a request may carry beyond these are read or
    /// let be; what is not a number is refused naming the input, after its
    /// datatype.
    #[test]
    fn a_json_request_s_numbers_are_read_flat_and_anything_else_is_refused_by_name() {
        let (req, binary) = request(
            r#"{"id": "r1", "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2],
                "data": [[1, 2.5], [-3, 4e1]], "parameters": {"other": [1, {"a": 2}]}}],
                "outputs": [{"name": "probs", "parameters": {"binary_data": true}}], "extra": {"k": [1]}}"#,
        )
        .unwrap();
        assert_eq!((req.id.as_str(), req.inputs[0].shape.as_slice(), binary), ("r1", &[2i64, 2][..], true));
        let values: Vec<f32> =
            req.raw_input_contents[0].chunks(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
        assert_eq!(values, [1.0, 2.5, -3.0, 40.0]);
        assert_eq!(req.outputs[0].name, "probs");
        let refused = |json: &str| request(json).unwrap_err();
        let e = refused(r#"{"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": ["abc"]}]}"#);
        assert!(e.contains("input \"x\" has datatype \"BYTES\"; FP32 is needed"), "{e}");
        let e =
            refused(r#"{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1, null]}]}"#);
        assert!(e.contains("input \"x\": null in its data is not a number"), "{e}");
        let e = refused(r#"{"inputs": [{"name": "x", "datatype": "FP32", "data": [1]}]}"#);
        assert!(e.contains("missing field `shape`"), "{e}");
        let e = refused(r#"{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1.5], "data": [1]}]}"#);
        assert!(e.contains("not a KServe v2 inference request"), "{e}");
        let e = refused(r#"{"outputs": []}"#);
        assert!(e.contains("missing field `inputs`"), "{e}");
        let e = refused(r#"{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1e39]}]}"#);
        assert!(e.contains("(beyond f32's range) in its data is not a number"), "{e}");
        // Parameters of another type count as absent: the data is read.
        let (req, binary) = request(
            r#"{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [2],
                "parameters": {"binary_data_size": "4"}}], "parameters": {"binary_data_output": [true]}}"#,
        )
        .unwrap();
        assert_eq!((req.raw_input_contents[0].as_slice(), binary), (&2f32.to_le_bytes()[..], false));
    }

    /// A client that connects and sends nothing, or only the start of
    /// HTTP/2's preface, gives its slot back within the header time; one
    /// that asks is answered.
    #[test]
    fn a_connection_that_starts_no_request_is_closed_and_one_that_asks_is_answered() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        rt.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let router = Router::new().route("/x", axum::routing::get(|| async { "here" }));
            tokio::spawn(serve(listener, router, "test endpoint"));
            let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
            let mut started = tokio::net::TcpStream::connect(addr).await.unwrap();
            started.write_all(b"PRI").await.unwrap();
            let mut asking = tokio::net::TcpStream::connect(addr).await.unwrap();
            asking
                .write_all(b"GET /x HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")
                .await
                .unwrap();
            let mut answer = String::new();
            asking.read_to_string(&mut answer).await.unwrap();
            assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("here"), "{answer}");
            for (name, conn) in [("silent", &mut silent), ("started", &mut started)] {
                let closed = tokio::time::timeout(HEADER_TIME * 6, conn.read(&mut [0u8; 64])).await;
                assert!(matches!(closed, Ok(Ok(0) | Err(_))), "{name}: {closed:?}");
            }
        });
    }

    /// A client that asks and asks and never reads: the write that waits
    /// on it past its time ends the connection (its slot given back), where
    /// it would wait for as long as the client stayed.
    #[test]
    fn a_client_that_never_reads_is_given_up() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        rt.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let big = vec![b'x'; 64 << 10];
            let router = Router::new().route("/big", axum::routing::get(move || async move { big.clone() }));
            let served = tokio::spawn(async move {
                let (tcp, _) = listener.accept().await.unwrap();
                serve_connection_within(tcp, router, "test endpoint", std::time::Duration::from_secs(1))
                    .await;
            });
            let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
            // 400 answers of 64 KiB: far more than the sockets' buffers hold.
            let asks = b"GET /big HTTP/1.1\r\nhost: localhost\r\n\r\n".repeat(400);
            client.write_all(&asks).await.unwrap();
            // Not read meanwhile: the server's write waits, then gives up.
            tokio::time::timeout(std::time::Duration::from_secs(60), served).await.unwrap().unwrap();
            let mut got = 0usize;
            let mut piece = vec![0u8; 1 << 16];
            while let Ok(Ok(n @ 1..)) =
                tokio::time::timeout(std::time::Duration::from_secs(10), client.read(&mut piece)).await
            {
                got += n;
            }
            assert!(got < 400 * (64 << 10), "every answer was written: {got} bytes");
        });
    }
}
