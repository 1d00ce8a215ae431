//! KServe v2 over HTTP/REST, served next to gRPC by the same teacher
//! (`edl-runtime teacher --http-listen ADDR`): health, server and model
//! metadata, readiness, inference with JSON tensors or the binary-data
//! extension (`Inference-Header-Content-Length`), and Triton's model
//! configuration and statistics. Each route turns its request into the
//! gRPC message and asks the same service, so both protocols answer alike.

use crate::oip::{GrpcInferenceService, pb};
use crate::teacher::TeacherService;
use axum::{
    Router,
    body::Bytes,
    extract::{Path, State},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use serde_json::{Value, json};
use std::sync::Arc;
use tonic::{Code, Request};

/// The header that splits a binary request or response: the length of its JSON part.
const HEADER_LENGTH: &str = "inference-header-content-length";

#[derive(Clone)]
struct Served {
    service: TeacherService,
    token: Option<Arc<str>>,
}

/// The routes of the REST protocol for `service`; with `token`, every call
/// must carry `Authorization: Bearer TOKEN`.
pub fn router(service: TeacherService, token: Option<String>) -> Router {
    let served = Served { service, token: token.map(Arc::from) };
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
        .with_state(served)
}

/// Serves `router` on `listener` until the process ends.
pub async fn serve(listener: tokio::net::TcpListener, router: Router) {
    if let Err(e) = axum::serve(listener, router).await {
        tracing::warn!("teacher REST endpoint: {e}");
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
        _ => StatusCode::BAD_REQUEST,
    };
    error(code, s.message())
}

impl Served {
    fn admit(&self, headers: &HeaderMap) -> Result<(), Response> {
        let Some(want) = &self.token else { return Ok(()) };
        let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        match given.and_then(|v| v.strip_prefix("Bearer ")) {
            Some(t) if crate::teacher::same_secret(t.as_bytes(), want.as_bytes()) => Ok(()),
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
            let m = m.into_inner();
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

/// Every number of a JSON array, nested or flat, in order.
fn flatten(v: &Value, out: &mut Vec<f32>) -> Result<(), String> {
    match v {
        Value::Array(items) => items.iter().try_for_each(|i| flatten(i, out)),
        Value::Number(n) => {
            out.push(n.as_f64().ok_or("a number out of range")? as f32);
            Ok(())
        }
        other => Err(format!("{other} is not a number")),
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
    let head: Value =
        serde_json::from_slice(&body[..json_len]).map_err(|e| format!("the request is not JSON: {e}"))?;
    let mut binary = &body[json_len..];
    let inputs = head["inputs"].as_array().ok_or("the request has no \"inputs\" array")?;
    let mut req = pb::ModelInferRequest {
        model_name: model,
        model_version: version,
        id: head["id"].as_str().unwrap_or_default().to_string(),
        ..Default::default()
    };
    for input in inputs {
        let name = input["name"].as_str().ok_or("an input without a name")?.to_string();
        let datatype =
            input["datatype"].as_str().ok_or(format!("input {name:?} without a datatype"))?.to_string();
        let shape: Vec<i64> = input["shape"]
            .as_array()
            .ok_or(format!("input {name:?} without a shape"))?
            .iter()
            .map(|d| d.as_i64().ok_or(format!("input {name:?}: a dimension that is not an integer")))
            .collect::<Result<_, _>>()?;
        let raw = match input["parameters"]["binary_data_size"].as_u64() {
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
                let mut values = Vec::new();
                flatten(&input["data"], &mut values).map_err(|e| format!("input {name:?}: {e}"))?;
                crate::oip::f32_bytes(&values)
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
    let mut binary_out = head["parameters"]["binary_data_output"].as_bool().unwrap_or(false);
    if let Some(outputs) = head["outputs"].as_array() {
        for o in outputs {
            let name = o["name"].as_str().ok_or("an output without a name")?.to_string();
            binary_out |= o["parameters"]["binary_data"].as_bool().unwrap_or(false);
            req.outputs
                .push(pb::model_infer_request::InferRequestedOutputTensor { name, ..Default::default() });
        }
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

/// The client side: a DistillReader's calls to a teacher that speaks KServe
/// v2 over HTTP/REST, as the same messages the gRPC side uses.
pub mod client {
    use super::{HEADER_LENGTH, pb};
    use serde_json::{Value, json};

    /// A failed call: the HTTP status, if one came, and what was said.
    #[derive(Debug)]
    pub struct CallError {
        pub status: Option<u16>,
        pub detail: String,
    }

    impl std::fmt::Display for CallError {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            match self.status {
                Some(s) => write!(f, "HTTP {s}: {}", self.detail),
                None => write!(f, "{}", self.detail),
            }
        }
    }

    fn transport(e: reqwest::Error) -> CallError {
        let detail = crate::distill::with_causes(e.to_string(), std::error::Error::source(&e));
        CallError { status: None, detail }
    }

    fn model_url(base: &str, model: &str, version: &str) -> String {
        if version.is_empty() {
            format!("{base}/v2/models/{model}")
        } else {
            format!("{base}/v2/models/{model}/versions/{version}")
        }
    }

    fn authorized(req: reqwest::RequestBuilder, token: Option<&str>) -> reqwest::RequestBuilder {
        match token {
            Some(t) => req.bearer_auth(t),
            None => req,
        }
    }

    /// The body of an answer, or the error it carries.
    async fn body(resp: reqwest::Response) -> Result<(reqwest::header::HeaderMap, Vec<u8>), CallError> {
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = resp.bytes().await.map_err(transport)?.to_vec();
        if status.is_success() {
            return Ok((headers, bytes));
        }
        let detail = serde_json::from_slice::<Value>(&bytes)
            .ok()
            .and_then(|v| v["error"].as_str().map(str::to_string))
            .unwrap_or_else(|| String::from_utf8_lossy(&bytes).trim().to_string());
        Err(CallError { status: Some(status.as_u16()), detail })
    }

    /// `GET /v2/models/{model}[/versions/{v}]`.
    pub async fn metadata(
        http: &reqwest::Client,
        base: &str,
        model: &str,
        version: &str,
        token: Option<&str>,
    ) -> Result<pb::ModelMetadataResponse, CallError> {
        let resp =
            authorized(http.get(model_url(base, model, version)), token).send().await.map_err(transport)?;
        let (_, bytes) = body(resp).await?;
        let v: Value = serde_json::from_slice(&bytes)
            .map_err(|e| CallError { status: None, detail: format!("metadata is not JSON: {e}") })?;
        let tensors = |key: &str| -> Vec<pb::model_metadata_response::TensorMetadata> {
            v[key]
                .as_array()
                .map(|ts| {
                    ts.iter()
                        .map(|t| pb::model_metadata_response::TensorMetadata {
                            name: t["name"].as_str().unwrap_or_default().into(),
                            datatype: t["datatype"].as_str().unwrap_or_default().into(),
                            shape: t["shape"]
                                .as_array()
                                .map(|s| s.iter().filter_map(Value::as_i64).collect())
                                .unwrap_or_default(),
                        })
                        .collect()
                })
                .unwrap_or_default()
        };
        Ok(pb::ModelMetadataResponse {
            name: v["name"].as_str().unwrap_or(model).into(),
            versions: v["versions"]
                .as_array()
                .map(|a| a.iter().filter_map(|x| x.as_str().map(String::from)).collect())
                .unwrap_or_default(),
            platform: v["platform"].as_str().unwrap_or_default().into(),
            inputs: tensors("inputs"),
            outputs: tensors("outputs"),
        })
    }

    /// `POST .../infer` with the binary-data extension both ways.
    pub async fn infer(
        http: &reqwest::Client,
        base: &str,
        req: &pb::ModelInferRequest,
        token: Option<&str>,
    ) -> Result<pb::ModelInferResponse, CallError> {
        let inputs: Vec<Value> = req
            .inputs
            .iter()
            .zip(&req.raw_input_contents)
            .map(|(t, raw)| {
                json!({
                    "name": t.name, "datatype": t.datatype, "shape": t.shape,
                    "parameters": { "binary_data_size": raw.len() },
                })
            })
            .collect();
        let outputs: Vec<Value> = req
            .outputs
            .iter()
            .map(|o| json!({ "name": o.name, "parameters": { "binary_data": true } }))
            .collect();
        let mut head =
            json!({ "id": req.id, "inputs": inputs, "parameters": { "binary_data_output": true } });
        if !outputs.is_empty() {
            head["outputs"] = Value::Array(outputs);
        }
        let mut payload =
            serde_json::to_vec(&head).map_err(|e| CallError { status: None, detail: e.to_string() })?;
        let json_len = payload.len();
        for raw in &req.raw_input_contents {
            payload.extend_from_slice(raw);
        }
        let url = format!("{}/infer", model_url(base, &req.model_name, &req.model_version));
        let call = http
            .post(url)
            .header(HEADER_LENGTH, json_len.to_string())
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .body(payload);
        let resp = authorized(call, token).send().await.map_err(transport)?;
        let (headers, bytes) = body(resp).await?;
        let bad = |detail: String| CallError { status: None, detail };
        let json_len = match headers.get(HEADER_LENGTH).and_then(|v| v.to_str().ok()) {
            Some(v) => v
                .parse::<usize>()
                .ok()
                .filter(|&n| n <= bytes.len())
                .ok_or_else(|| bad(format!("{HEADER_LENGTH} {v:?} is not a length within the body")))?,
            None => bytes.len(),
        };
        let v: Value = serde_json::from_slice(&bytes[..json_len])
            .map_err(|e| bad(format!("the answer is not JSON: {e}")))?;
        let mut blobs = &bytes[json_len..];
        let mut out = pb::ModelInferResponse {
            model_name: v["model_name"].as_str().unwrap_or_default().into(),
            model_version: v["model_version"].as_str().unwrap_or_default().into(),
            id: v["id"].as_str().unwrap_or_default().into(),
            ..Default::default()
        };
        for o in v["outputs"].as_array().ok_or_else(|| bad("the answer has no outputs".into()))? {
            let name = o["name"].as_str().unwrap_or_default().to_string();
            let datatype = o["datatype"].as_str().unwrap_or_default().to_string();
            let shape: Vec<i64> = o["shape"]
                .as_array()
                .map(|s| s.iter().filter_map(Value::as_i64).collect())
                .unwrap_or_default();
            let raw = match o["parameters"]["binary_data_size"].as_u64() {
                Some(n) => {
                    let n = n as usize;
                    if n > blobs.len() {
                        return Err(bad(format!(
                            "output {name:?}: {n} binary bytes announced, {} there",
                            blobs.len()
                        )));
                    }
                    let (mine, rest) = blobs.split_at(n);
                    blobs = rest;
                    mine.to_vec()
                }
                // JSON values, as raw bytes of the datatype given.
                None => {
                    let mut values = Vec::new();
                    super::flatten(&o["data"], &mut values)
                        .map_err(|e| bad(format!("output {name:?}: {e}")))?;
                    match datatype.as_str() {
                        "FP64" => values.iter().flat_map(|&x| (x as f64).to_le_bytes()).collect(),
                        _ => crate::oip::f32_bytes(&values),
                    }
                }
            };
            out.outputs.push(pb::model_infer_response::InferOutputTensor {
                name,
                datatype,
                shape,
                ..Default::default()
            });
            out.raw_output_contents.push(raw);
        }
        Ok(out)
    }
}
