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

/// An FP32 tensor `[rows, cols]` from an infer input: raw bytes (the
/// request's `raw_input_contents[index]`) or the typed `fp32_contents`.
pub fn input_f32(req: &pb::ModelInferRequest, index: usize) -> Result<(Vec<f32>, usize, usize), String> {
    let t = req.inputs.get(index).ok_or_else(|| format!("request has no input {index}"))?;
    if t.datatype != "FP32" {
        return Err(format!("input {:?} has datatype {:?}; FP32 is needed", t.name, t.datatype));
    }
    let (rows, cols) = match t.shape.as_slice() {
        [r, c] if *r >= 0 && *c >= 0 => (*r as usize, *c as usize),
        other => return Err(format!("input {:?} has shape {other:?}; [rows, features] is needed", t.name)),
    };
    let want = rows.checked_mul(cols).filter(|n| n.checked_mul(4).is_some()).ok_or_else(|| {
        format!("input {:?}: shape [{rows}, {cols}] is larger than any tensor can be", t.name)
    })?;
    let data: Vec<f32> = if let Some(raw) = req.raw_input_contents.get(index) {
        if raw.len() != want * 4 {
            return Err(format!(
                "input {:?}: {} raw bytes for shape [{rows}, {cols}] (needs {})",
                t.name,
                raw.len(),
                want * 4
            ));
        }
        raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    } else {
        let v = t.contents.as_ref().map(|c| c.fp32_contents.clone()).unwrap_or_default();
        if v.len() != want {
            return Err(format!("input {:?}: {} values for shape [{rows}, {cols}]", t.name, v.len()));
        }
        v
    };
    Ok((data, rows, cols))
}

/// The first output of a response as FP32 `[rows, cols]`.
pub fn output_f32(resp: &pb::ModelInferResponse) -> Result<(Vec<f32>, usize, usize), String> {
    output_as_f32(resp, None)
}

/// Output `name` of a response (the first one when None) as f32 `[rows,
/// cols]`: FP32 as it is, FP64, FP16 and BF16 converted. Integer outputs
/// (class ids, counts) are refused: they are not soft labels.
pub fn output_as_f32(
    resp: &pb::ModelInferResponse,
    name: Option<&str>,
) -> Result<(Vec<f32>, usize, usize), String> {
    let index = match name {
        None => 0,
        Some(n) => resp.outputs.iter().position(|o| o.name == n).ok_or_else(|| {
            let names: Vec<&str> = resp.outputs.iter().map(|o| o.name.as_str()).collect();
            format!("the answer has no output {n:?} (it has {names:?})")
        })?,
    };
    let t = resp.outputs.get(index).ok_or("response has no output")?;
    let (rows, cols) = match t.shape.as_slice() {
        [r, c] if *r >= 0 && *c >= 0 => (*r as usize, *c as usize),
        other => return Err(format!("output {:?} has shape {other:?}; [rows, classes] is needed", t.name)),
    };
    // Shapes come from the peer: arithmetic on them is checked, so that
    // an absurd one is an error, not an overflow.
    let values = rows.checked_mul(cols).filter(|n| n.checked_mul(8).is_some()).ok_or_else(|| {
        format!("output {:?}: shape [{rows}, {cols}] is larger than any tensor can be", t.name)
    })?;
    let raw = resp.raw_output_contents.get(index);
    let typed = t.contents.as_ref();
    let width = |w: usize| -> Result<&[u8], String> {
        let raw =
            raw.ok_or_else(|| format!("output {:?} ({}) came without its raw bytes", t.name, t.datatype))?;
        if raw.len() != values * w {
            return Err(format!(
                "output {:?}: {} bytes for {} [{rows}, {cols}]",
                t.name,
                raw.len(),
                t.datatype
            ));
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
            return Err(format!(
                "output {:?} has datatype {other}: soft labels need floating point (FP32, FP64, FP16 or BF16)",
                t.name
            ));
        }
    };
    if data.len() != values {
        return Err(format!("output {:?}: {} values for shape [{rows}, {cols}]", t.name, data.len()));
    }
    Ok((data, rows, cols))
}

/// Every number of a JSON array (a KServe v2 REST tensor's `data`), nested
/// or flat, in order.
pub fn json_numbers(v: &serde_json::Value, out: &mut Vec<f32>) -> Result<(), String> {
    match v {
        serde_json::Value::Array(items) => items.iter().try_for_each(|i| json_numbers(i, out)),
        serde_json::Value::Number(n) => {
            out.push(n.as_f64().ok_or("a number out of range")? as f32);
            Ok(())
        }
        other => Err(format!("{other} is not a number")),
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
        let e = output_as_f32(&huge, Some("probs")).unwrap_err();
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
        let e = input_f32(&req, 0).unwrap_err();
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
        let e = output_as_f32(&answer("probs", "FP32", f32_bytes(&want)), None).unwrap_err();
        assert!(e.contains("\"label\" has datatype INT64: soft labels need floating point"), "{e}");
        let e = output_as_f32(&answer("probs", "FP32", f32_bytes(&want)), Some("logits")).unwrap_err();
        assert!(e.contains("no output \"logits\" (it has [\"label\", \"probs\"])"), "{e}");
        let e = output_as_f32(&answer("probs", "FP64", vec![0; 8]), Some("probs")).unwrap_err();
        assert!(e.contains("8 bytes for FP64 [2, 2]"), "{e}");
    }
}
