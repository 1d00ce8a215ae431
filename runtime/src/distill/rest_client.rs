//! KServe v2 over HTTP/REST, the client side: a DistillReader's calls to a
//! teacher that speaks it, as the same messages the gRPC side uses.

use super::oip::{HEADER_LENGTH, TensorError, json_numbers, pb};
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

/// The largest answer read (as the gRPC client's largest message).
pub const MAX_ANSWER: usize = 256 << 20;

/// The body of an answer, or the error it carries; an answer larger than
/// [`MAX_ANSWER`] is refused as it comes, not read whole first.
async fn body(mut resp: reqwest::Response) -> Result<(reqwest::header::HeaderMap, Vec<u8>), CallError> {
    let status = resp.status();
    let headers = resp.headers().clone();
    let too_large = |n: u64| CallError {
        status: None,
        detail: format!("an answer of {n} bytes or more, above the {MAX_ANSWER} this client reads"),
    };
    if let Some(n) = resp.content_length().filter(|&n| n > MAX_ANSWER as u64) {
        return Err(too_large(n));
    }
    let mut bytes = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(transport)? {
        if bytes.len() + chunk.len() > MAX_ANSWER {
            return Err(too_large((bytes.len() + chunk.len()) as u64));
        }
        bytes.extend_from_slice(&chunk);
    }
    if status.is_success() {
        return Ok((headers, bytes));
    }
    let detail = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).trim().to_string());
    Err(CallError { status: Some(status.as_u16()), detail })
}

/// A JSON tensor's values as the bytes a binary answer of `datatype`
/// would hold (which the decoding of answers then reads).
fn raw_of_json(datatype: &str, data: &Value) -> Result<Vec<u8>, TensorError> {
    let mut values = Vec::new();
    json_numbers(data, &mut values)?;
    Ok(match datatype {
        "FP64" => values.iter().flat_map(|&x| (x as f64).to_le_bytes()).collect(),
        "FP16" => values.iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect(),
        "BF16" => values.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect(),
        _ => crate::distill::oip::f32_bytes(&values),
    })
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

/// Whether the server at `base` takes and gives tensors as binary data
/// (`GET /v2` lists the `binary_tensor_data` extension, as Triton's does);
/// a server that does not (MLServer) is spoken to in JSON.
pub async fn speaks_binary(
    http: &reqwest::Client,
    base: &str,
    token: Option<&str>,
) -> Result<bool, CallError> {
    let resp = authorized(http.get(format!("{base}/v2")), token).send().await.map_err(transport)?;
    let (_, bytes) = match body(resp).await {
        // No server metadata to give: the protocol's base, JSON.
        Err(CallError { status: Some(404 | 501), .. }) => return Ok(false),
        other => other?,
    };
    let v: Value = serde_json::from_slice(&bytes)
        .map_err(|e| CallError { status: None, detail: format!("server metadata is not JSON: {e}") })?;
    Ok(v["extensions"].as_array().is_some_and(|x| x.iter().any(|e| e == "binary_tensor_data")))
}

/// A raw FP32 or FP64 input's values, for a JSON request.
fn json_values(datatype: &str, raw: &[u8]) -> Result<Value, CallError> {
    let values: Vec<Value> = match datatype {
        "FP32" => raw.chunks_exact(4).map(|c| json!(f32::from_le_bytes([c[0], c[1], c[2], c[3]]))).collect(),
        "FP64" => {
            raw.chunks_exact(8).map(|c| json!(f64::from_le_bytes(c.try_into().expect("8 bytes")))).collect()
        }
        other => {
            return Err(local_error(format!("an input of datatype {other} cannot be sent as JSON here")));
        }
    };
    Ok(Value::Array(values))
}

/// `POST .../infer`: with the binary-data extension both ways where the
/// server has it (`binary`), in JSON tensors otherwise.
pub async fn infer(
    http: &reqwest::Client,
    base: &str,
    req: &pb::ModelInferRequest,
    token: Option<&str>,
    binary: bool,
) -> Result<pb::ModelInferResponse, CallError> {
    let (payload, json_len) = request_body(req, binary)?;
    let url = format!("{}/infer", model_url(base, &req.model_name, &req.model_version));
    let call = if binary {
        http.post(url)
            .header(HEADER_LENGTH, json_len.to_string())
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .body(payload)
    } else {
        http.post(url).header(reqwest::header::CONTENT_TYPE, "application/json").body(payload)
    };
    let resp = authorized(call, token).send().await.map_err(transport)?;
    let (headers, bytes) = body(resp).await?;
    decode_answer(&headers, &bytes)
}

/// A failure on this side of a call, with no HTTP status to tell.
fn local_error(detail: String) -> CallError {
    CallError { status: None, detail }
}

/// An infer request's body, and the length of its JSON part: the JSON head,
/// followed with `binary` by the inputs' raw bytes in order.
fn request_body(req: &pb::ModelInferRequest, binary: bool) -> Result<(Vec<u8>, usize), CallError> {
    let head = request_head(req, binary)?;
    let mut payload = serde_json::to_vec(&head).map_err(|e| local_error(e.to_string()))?;
    let json_len = payload.len();
    if binary {
        for raw in &req.raw_input_contents {
            payload.extend_from_slice(raw);
        }
    }
    Ok((payload, json_len))
}

/// An infer request's JSON head: the inputs (their values in it unless
/// `binary`, where they follow it) and the outputs asked for.
fn request_head(req: &pb::ModelInferRequest, binary: bool) -> Result<Value, CallError> {
    let inputs: Vec<Value> = req
        .inputs
        .iter()
        .zip(&req.raw_input_contents)
        .map(|(t, raw)| {
            let mut input = json!({ "name": t.name, "datatype": t.datatype, "shape": t.shape });
            if binary {
                input["parameters"] = json!({ "binary_data_size": raw.len() });
            } else {
                input["data"] = json_values(&t.datatype, raw)?;
            }
            Ok(input)
        })
        .collect::<Result<_, CallError>>()?;
    let outputs: Vec<Value> = req
        .outputs
        .iter()
        .map(|o| {
            if binary {
                json!({ "name": o.name, "parameters": { "binary_data": true } })
            } else {
                json!({ "name": o.name })
            }
        })
        .collect();
    let mut head = json!({ "id": req.id, "inputs": inputs });
    if binary {
        head["parameters"] = json!({ "binary_data_output": true });
    }
    if !outputs.is_empty() {
        head["outputs"] = Value::Array(outputs);
    }
    Ok(head)
}

/// An infer answer as the gRPC message: its JSON part (all of the body
/// unless [`HEADER_LENGTH`] says less), then the binary outputs after it.
fn decode_answer(
    headers: &reqwest::header::HeaderMap,
    bytes: &[u8],
) -> Result<pb::ModelInferResponse, CallError> {
    let json_len =
        match headers.get(HEADER_LENGTH).and_then(|v| v.to_str().ok()) {
            Some(v) => v.parse::<usize>().ok().filter(|&n| n <= bytes.len()).ok_or_else(|| {
                local_error(format!("{HEADER_LENGTH} {v:?} is not a length within the body"))
            })?,
            None => bytes.len(),
        };
    let v: Value = serde_json::from_slice(&bytes[..json_len])
        .map_err(|e| local_error(format!("the answer is not JSON: {e}")))?;
    let mut blobs = &bytes[json_len..];
    let mut out = pb::ModelInferResponse {
        model_name: v["model_name"].as_str().unwrap_or_default().into(),
        model_version: v["model_version"].as_str().unwrap_or_default().into(),
        id: v["id"].as_str().unwrap_or_default().into(),
        ..Default::default()
    };
    for o in v["outputs"].as_array().ok_or_else(|| local_error("the answer has no outputs".into()))? {
        let (tensor, raw) = decode_output(o, &mut blobs)?;
        out.outputs.push(tensor);
        out.raw_output_contents.push(raw);
    }
    Ok(out)
}

/// One output of an answer and its values as raw bytes: the next of
/// `blobs` where it announces binary data, else its JSON values converted
/// to its datatype.
fn decode_output(
    o: &Value,
    blobs: &mut &[u8],
) -> Result<(pb::model_infer_response::InferOutputTensor, Vec<u8>), CallError> {
    let name = o["name"].as_str().unwrap_or_default().to_string();
    let datatype = o["datatype"].as_str().unwrap_or_default().to_string();
    let shape: Vec<i64> =
        o["shape"].as_array().map(|s| s.iter().filter_map(Value::as_i64).collect()).unwrap_or_default();
    let raw = match o["parameters"]["binary_data_size"].as_u64() {
        Some(n) => {
            let n = n as usize;
            if n > blobs.len() {
                return Err(local_error(format!(
                    "output {name:?}: {n} binary bytes announced, {} there",
                    blobs.len()
                )));
            }
            let (mine, rest) = blobs.split_at(n);
            *blobs = rest;
            mine.to_vec()
        }
        None => {
            raw_of_json(&datatype, &o["data"]).map_err(|e| local_error(format!("output {name:?}: {e}")))?
        }
    };
    let tensor = pb::model_infer_response::InferOutputTensor { name, datatype, shape, ..Default::default() };
    Ok((tensor, raw))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_outputs_of_every_float_width_decode_to_their_values() {
        let data = json!([[0.25, 0.75], [1.5, -2.0]]);
        for datatype in ["FP32", "FP64", "FP16", "BF16"] {
            let raw = raw_of_json(datatype, &data).unwrap();
            let resp = pb::ModelInferResponse {
                outputs: vec![pb::model_infer_response::InferOutputTensor {
                    name: "probs".into(),
                    datatype: datatype.into(),
                    shape: vec![2, 2],
                    ..Default::default()
                }],
                raw_output_contents: vec![raw],
                ..Default::default()
            };
            let (values, rows, cols) = crate::distill::oip::output_f32(&resp).unwrap();
            assert_eq!((values, rows, cols), (vec![0.25, 0.75, 1.5, -2.0], 2, 2), "{datatype}");
        }
    }
}
