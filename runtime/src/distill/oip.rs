//! The Open Inference Protocol (KServe v2) messages and service, generated
//! from `proto/grpc_predict_v2.proto`, and the tensor conversions both ends use.

#[allow(clippy::all, missing_docs)]
pub mod pb {
    tonic::include_proto!("inference");
}

pub use crate::state::f32_bytes;
pub use pb::grpc_inference_service_client::GrpcInferenceServiceClient;
pub use pb::grpc_inference_service_server::{GrpcInferenceService, GrpcInferenceServiceServer};

/// The header that splits a binary KServe v2 REST request or response: the
/// length of its JSON part.
pub const HEADER_LENGTH: &str = "inference-header-content-length";

/// Why a tensor of an inference request or answer cannot be read as f32
/// values; the shapes are the peer's, as sent.
#[derive(Debug, thiserror::Error)]
pub enum TensorError {
    #[error("request has no input {0}")]
    NoInput(usize),
    #[error("input {name:?} has datatype {datatype:?}; FP32 is needed")]
    InputDatatype { name: String, datatype: String },
    #[error("input {name:?} has shape {shape:?}; [rows, features] is needed")]
    InputShape { name: String, shape: Vec<i64> },
    #[error("input {name:?}: shape [{rows}, {cols}] is larger than any tensor can be")]
    InputTooLarge { name: String, rows: usize, cols: usize },
    #[error("input {name:?}: {got} raw bytes for shape [{rows}, {cols}] (needs {needs})")]
    RawInputSize { name: String, got: usize, rows: usize, cols: usize, needs: usize },
    #[error("input {name:?}: {got} values for shape [{rows}, {cols}]")]
    InputValues { name: String, got: usize, rows: usize, cols: usize },
    #[error("the answer has no output {wanted:?} (it has {names:?})")]
    NoSuchOutput { wanted: String, names: Vec<String> },
    #[error("response has no output")]
    NoOutput,
    #[error("output {name:?} has shape {shape:?}; [rows, classes] is needed")]
    OutputShape { name: String, shape: Vec<i64> },
    #[error("output {name:?}: shape [{rows}, {cols}] is larger than any tensor can be")]
    OutputTooLarge { name: String, rows: usize, cols: usize },
    #[error("output {name:?} ({datatype}) came without its raw bytes")]
    NoRawBytes { name: String, datatype: String },
    #[error("output {name:?}: {got} bytes for {datatype} [{rows}, {cols}]")]
    RawOutputSize { name: String, got: usize, datatype: String, rows: usize, cols: usize },
    #[error(
        "output {name:?} has datatype {datatype}: soft labels need floating point (FP32, FP64, FP16 or BF16)"
    )]
    NotFloatingPoint { name: String, datatype: String },
    #[error("output {name:?}: {got} values for shape [{rows}, {cols}]")]
    OutputValues { name: String, got: usize, rows: usize, cols: usize },
    #[error("a number out of range")]
    NumberOutOfRange,
    #[error("{0} is not a number")]
    NotANumber(serde_json::Value),
}

/// An FP32 tensor `[rows, cols]` from an infer input: raw bytes (the
/// request's `raw_input_contents[index]`) or the typed `fp32_contents`.
pub fn input_f32(req: &pb::ModelInferRequest, index: usize) -> Result<(Vec<f32>, usize, usize), TensorError> {
    let t = req.inputs.get(index).ok_or(TensorError::NoInput(index))?;
    let name = || t.name.clone();
    if t.datatype != "FP32" {
        return Err(TensorError::InputDatatype { name: name(), datatype: t.datatype.clone() });
    }
    let (rows, cols) = match t.shape.as_slice() {
        [r, c] if *r >= 0 && *c >= 0 => (*r as usize, *c as usize),
        other => return Err(TensorError::InputShape { name: name(), shape: other.to_vec() }),
    };
    let want = rows
        .checked_mul(cols)
        .filter(|n| n.checked_mul(4).is_some())
        .ok_or_else(|| TensorError::InputTooLarge { name: name(), rows, cols })?;
    let data: Vec<f32> = if let Some(raw) = req.raw_input_contents.get(index) {
        if raw.len() != want * 4 {
            return Err(TensorError::RawInputSize {
                name: name(),
                got: raw.len(),
                rows,
                cols,
                needs: want * 4,
            });
        }
        raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    } else {
        let v = t.contents.as_ref().map(|c| c.fp32_contents.clone()).unwrap_or_default();
        if v.len() != want {
            return Err(TensorError::InputValues { name: name(), got: v.len(), rows, cols });
        }
        v
    };
    Ok((data, rows, cols))
}

/// The first output of a response as FP32 `[rows, cols]`.
pub fn output_f32(resp: &pb::ModelInferResponse) -> Result<(Vec<f32>, usize, usize), TensorError> {
    output_as_f32(resp, None)
}

/// Output `name` of a response (the first one when None) as f32 `[rows,
/// cols]`: FP32 as it is, FP64, FP16 and BF16 converted. Integer outputs
/// (class ids, counts) are refused: they are not soft labels.
pub fn output_as_f32(
    resp: &pb::ModelInferResponse,
    name: Option<&str>,
) -> Result<(Vec<f32>, usize, usize), TensorError> {
    let index = match name {
        None => 0,
        Some(n) => {
            resp.outputs.iter().position(|o| o.name == n).ok_or_else(|| TensorError::NoSuchOutput {
                wanted: n.to_string(),
                names: resp.outputs.iter().map(|o| o.name.clone()).collect(),
            })?
        }
    };
    let t = resp.outputs.get(index).ok_or(TensorError::NoOutput)?;
    let name = || t.name.clone();
    let (rows, cols) = match t.shape.as_slice() {
        [r, c] if *r >= 0 && *c >= 0 => (*r as usize, *c as usize),
        other => return Err(TensorError::OutputShape { name: name(), shape: other.to_vec() }),
    };
    // Shapes come from the peer: arithmetic on them is checked, so that
    // an absurd one is an error, not an overflow.
    let values = rows
        .checked_mul(cols)
        .filter(|n| n.checked_mul(8).is_some())
        .ok_or_else(|| TensorError::OutputTooLarge { name: name(), rows, cols })?;
    let raw = resp.raw_output_contents.get(index);
    let typed = t.contents.as_ref();
    let width = |w: usize| -> Result<&[u8], TensorError> {
        let raw =
            raw.ok_or_else(|| TensorError::NoRawBytes { name: name(), datatype: t.datatype.clone() })?;
        if raw.len() != values * w {
            return Err(TensorError::RawOutputSize {
                name: name(),
                got: raw.len(),
                datatype: t.datatype.clone(),
                rows,
                cols,
            });
        }
        Ok(raw)
    };
    let data: Vec<f32> = match t.datatype.as_str() {
        "FP32" => match raw {
            Some(_) => {
                width(4)?.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            }
            None => typed.map(|c| c.fp32_contents.clone()).unwrap_or_default(),
        },
        "FP64" => match raw {
            Some(_) => width(8)?
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32)
                .collect(),
            None => typed.map(|c| c.fp64_contents.iter().map(|&v| v as f32).collect()).unwrap_or_default(),
        },
        "FP16" => {
            width(2)?.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
        }
        "BF16" => {
            width(2)?.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
        }
        other => {
            return Err(TensorError::NotFloatingPoint { name: name(), datatype: other.to_string() });
        }
    };
    if data.len() != values {
        return Err(TensorError::OutputValues { name: name(), got: data.len(), rows, cols });
    }
    Ok((data, rows, cols))
}

/// Every number of a JSON array (a KServe v2 REST tensor's `data`), nested
/// or flat, in order.
pub fn json_numbers(v: &serde_json::Value, out: &mut Vec<f32>) -> Result<(), TensorError> {
    match v {
        serde_json::Value::Array(items) => items.iter().try_for_each(|i| json_numbers(i, out)),
        serde_json::Value::Number(n) => {
            out.push(n.as_f64().ok_or(TensorError::NumberOutOfRange)? as f32);
            Ok(())
        }
        other => Err(TensorError::NotANumber(other.clone())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(name: &str, datatype: &str, raw: Vec<u8>) -> pb::ModelInferResponse {
        pb::ModelInferResponse {
            outputs: vec![
                pb::model_infer_response::InferOutputTensor {
                    name: "label".into(),
                    datatype: "INT64".into(),
                    shape: vec![2, 1],
                    ..Default::default()
                },
                pb::model_infer_response::InferOutputTensor {
                    name: name.into(),
                    datatype: datatype.into(),
                    shape: vec![2, 2],
                    ..Default::default()
                },
            ],
            raw_output_contents: vec![vec![0; 16], raw],
            ..Default::default()
        }
    }

    #[test]
    fn shapes_too_large_for_any_tensor_are_errors_not_overflows() {
        let mut huge = answer("probs", "FP32", vec![0; 16]);
        huge.outputs[1].shape = vec![i64::MAX, i64::MAX];
        let e = output_as_f32(&huge, Some("probs")).unwrap_err().to_string();
        assert!(e.contains("larger than any tensor can be"), "{e}");
        let req = pb::ModelInferRequest {
            inputs: vec![pb::model_infer_request::InferInputTensor {
                name: "input".into(),
                datatype: "FP32".into(),
                shape: vec![1 << 40, 1 << 22],
                ..Default::default()
            }],
            raw_input_contents: vec![vec![0; 16]],
            ..Default::default()
        };
        let e = input_f32(&req, 0).unwrap_err().to_string();
        assert!(e.contains("larger than any tensor can be"), "{e}");
    }

    #[test]
    fn floating_outputs_of_any_width_become_f32_and_integers_are_refused() {
        let want = vec![0.25f32, 0.75, 1.5, -2.0];
        let fp64: Vec<u8> = want.iter().flat_map(|&v| (v as f64).to_le_bytes()).collect();
        let fp16: Vec<u8> = want.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect();
        let bf16: Vec<u8> = want.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect();
        for (dt, raw) in [("FP32", f32_bytes(&want)), ("FP64", fp64), ("FP16", fp16), ("BF16", bf16)] {
            let got = output_as_f32(&answer("probs", dt, raw), Some("probs")).unwrap();
            assert_eq!(got, (want.clone(), 2, 2), "{dt}");
        }
        let e = output_as_f32(&answer("probs", "FP32", f32_bytes(&want)), None).unwrap_err().to_string();
        assert!(e.contains("\"label\" has datatype INT64: soft labels need floating point"), "{e}");
        let e = output_as_f32(&answer("probs", "FP32", f32_bytes(&want)), Some("logits"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no output \"logits\" (it has [\"label\", \"probs\"])"), "{e}");
        let e = output_as_f32(&answer("probs", "FP64", vec![0; 8]), Some("probs")).unwrap_err().to_string();
        assert!(e.contains("8 bytes for FP64 [2, 2]"), "{e}");
    }
}
