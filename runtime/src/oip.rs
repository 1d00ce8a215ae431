//! The Open Inference Protocol (KServe v2) messages and service, generated
//! from `proto/grpc_predict_v2.proto`, and the tensor conversions both ends use.

#[allow(clippy::all, missing_docs)]
pub mod pb {
    tonic::include_proto!("inference");
}

pub use pb::grpc_inference_service_client::GrpcInferenceServiceClient;
pub use pb::grpc_inference_service_server::{GrpcInferenceService, GrpcInferenceServiceServer};

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
    let want = rows.checked_mul(cols).ok_or("shape overflows")?;
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

/// Raw little-endian bytes of f32 values.
pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * 4);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// The first output of a response as FP32 `[rows, cols]`.
pub fn output_f32(resp: &pb::ModelInferResponse) -> Result<(Vec<f32>, usize, usize), String> {
    let t = resp.outputs.first().ok_or("response has no output")?;
    if t.datatype != "FP32" {
        return Err(format!("output {:?} has datatype {:?}, not FP32", t.name, t.datatype));
    }
    let (rows, cols) = match t.shape.as_slice() {
        [r, c] if *r >= 0 && *c >= 0 => (*r as usize, *c as usize),
        other => return Err(format!("output {:?} has shape {other:?}", t.name)),
    };
    let data: Vec<f32> = match resp.raw_output_contents.first() {
        Some(raw) => raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        None => t.contents.as_ref().map(|c| c.fp32_contents.clone()).unwrap_or_default(),
    };
    if data.len() != rows * cols {
        return Err(format!("output {:?}: {} values for shape [{rows}, {cols}]", t.name, data.len()));
    }
    Ok((data, rows, cols))
}
