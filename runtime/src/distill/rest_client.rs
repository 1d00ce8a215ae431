//! KServe v2 over HTTP/REST, the client side: a DistillReader's calls to a
//! teacher that speaks it, as the same messages the gRPC side uses.

use super::oip::{HEADER_LENGTH, json_numbers, pb};
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
// Long: one call's binary framing both ways (request out, response in),
// read together because each side mirrors the other.
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
    let mut head = json!({ "id": req.id, "inputs": inputs, "parameters": { "binary_data_output": true } });
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
        let shape: Vec<i64> =
            o["shape"].as_array().map(|s| s.iter().filter_map(Value::as_i64).collect()).unwrap_or_default();
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
                json_numbers(&o["data"], &mut values).map_err(|e| bad(format!("output {name:?}: {e}")))?;
                match datatype.as_str() {
                    "FP64" => values.iter().flat_map(|&x| (x as f64).to_le_bytes()).collect(),
                    _ => crate::distill::oip::f32_bytes(&values),
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
