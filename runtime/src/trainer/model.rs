//! The student and teacher models: a multi-layer perceptron (ReLU between
//! layers, logits out), stored as safetensors.

use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use std::path::Path;

/// One fully connected layer: `y = x W + b`, `W` stored `[inputs, outputs]` row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct Layer {
    pub inputs: usize,
    pub outputs: usize,
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
}

/// A multi-layer perceptron.
#[derive(Clone, Debug, PartialEq)]
pub struct Mlp {
    pub layers: Vec<Layer>,
}

/// Why a model could not be loaded or saved.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: cannot read model: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("{path}: not a valid safetensors model: {detail}")]
    Corrupt { path: String, detail: String },
    #[error("{path}: cannot write model: {detail}")]
    Write { path: String, detail: String },
}

impl Mlp {
    /// A model with layer sizes `sizes` (input first), weights drawn from a
    /// seeded He-scaled uniform distribution.
    pub fn random(sizes: &[usize], seed: u64) -> Self {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        let layers = sizes
            .windows(2)
            .map(|w| {
                let scale = (6.0 / w[0] as f32).sqrt();
                Layer {
                    inputs: w[0],
                    outputs: w[1],
                    weight: (0..w[0] * w[1]).map(|_| next() * scale).collect(),
                    bias: vec![0.0; w[1]],
                }
            })
            .collect();
        Mlp { layers }
    }

    pub fn input_dim(&self) -> usize {
        self.layers.first().map_or(0, |l| l.inputs)
    }

    pub fn output_dim(&self) -> usize {
        self.layers.last().map_or(0, |l| l.outputs)
    }

    /// Layer sizes, input first.
    pub fn sizes(&self) -> Vec<usize> {
        self.layers.iter().map(|l| l.inputs).chain(self.layers.last().map(|l| l.outputs)).collect()
    }

    /// Number of parameters.
    pub fn param_count(&self) -> usize {
        self.layers.iter().map(|l| l.weight.len() + l.bias.len()).sum()
    }

    /// All parameters, layer by layer (weight then bias): the layout of
    /// gradients, broadcasts and edl-host-gpu's CUDA trainer.
    pub fn params_flat(&self) -> Vec<f32> {
        let mut out = Vec::new();
        self.params_into(&mut out);
        out
    }

    /// [`Mlp::params_flat`] into `out`, reusing its allocation.
    pub fn params_into(&self, out: &mut Vec<f32>) {
        out.clear();
        out.reserve(self.param_count());
        for l in &self.layers {
            out.extend_from_slice(&l.weight);
            out.extend_from_slice(&l.bias);
        }
    }

    /// Replaces all parameters from the layout of [`Mlp::params_flat`].
    ///
    /// # Panics
    /// When `flat` does not hold [`Mlp::param_count`] values.
    pub fn load_params_flat(&mut self, flat: &[f32]) {
        assert_eq!(flat.len(), self.param_count(), "flat parameter count");
        let mut at = 0;
        for l in &mut self.layers {
            let (w, b) = (l.weight.len(), l.bias.len());
            l.weight.copy_from_slice(&flat[at..at + w]);
            l.bias.copy_from_slice(&flat[at + w..at + w + b]);
            at += w + b;
        }
    }

    /// Share of `data` classified correctly.
    pub fn accuracy(&self, data: &crate::trainer::data::Dataset) -> f32 {
        let chunk = 512;
        let mut correct = 0usize;
        for start in (0..data.len()).step_by(chunk) {
            let rows = chunk.min(data.len() - start);
            let logits = self.forward(&data.features[start * data.dim..(start + rows) * data.dim], rows);
            for r in 0..rows {
                let row = &logits[r * data.classes..(r + 1) * data.classes];
                let best =
                    row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i).unwrap_or(0);
                correct += (best as u32 == data.labels[start + r]) as usize;
            }
        }
        correct as f32 / data.len().max(1) as f32
    }

    /// Logits `[rows, output_dim]` of inputs `[rows, input_dim]`.
    pub fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        assert_eq!(x.len(), rows * self.input_dim(), "input shape");
        let mut cur = x.to_vec();
        for (i, l) in self.layers.iter().enumerate() {
            let mut out = vec![0f32; rows * l.outputs];
            for r in 0..rows {
                out[r * l.outputs..(r + 1) * l.outputs].copy_from_slice(&l.bias);
            }
            crate::trainer::gemm::gemm(
                rows,
                l.inputs,
                l.outputs,
                crate::trainer::gemm::View::row_major(&cur, l.inputs),
                crate::trainer::gemm::View::row_major(&l.weight, l.outputs),
                &mut out,
                true,
            )
            .expect("a layer's operands have the layer's sizes");
            if i + 1 < self.layers.len() {
                out.iter_mut().for_each(|v| *v = v.max(0.0));
            }
            cur = out;
        }
        cur
    }

    /// Writes the model as safetensors (`layers.<i>.weight` `[in, out]`, `layers.<i>.bias`).
    pub fn save(&self, path: &Path) -> Result<(), ModelError> {
        let shown = path.display().to_string();
        let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = self
            .layers
            .iter()
            .enumerate()
            .flat_map(|(i, l)| {
                [
                    (
                        format!("layers.{i}.weight"),
                        crate::distill::oip::f32_bytes(&l.weight),
                        vec![l.inputs, l.outputs],
                    ),
                    (format!("layers.{i}.bias"), crate::distill::oip::f32_bytes(&l.bias), vec![l.outputs]),
                ]
            })
            .collect();
        let views: Vec<(String, TensorView<'_>)> = bytes
            .iter()
            .map(|(n, b, s)| Ok((n.clone(), TensorView::new(Dtype::F32, s.clone(), b)?)))
            .collect::<Result<_, safetensors::SafeTensorError>>()
            .map_err(|e| ModelError::Write { path: shown.clone(), detail: e.to_string() })?;
        let tmp = path.with_extension("tmp");
        safetensors::serialize_to_file(views, None, &tmp)
            .map_err(|e| ModelError::Write { path: shown.clone(), detail: e.to_string() })?;
        std::fs::rename(&tmp, path).map_err(|e| ModelError::Write { path: shown, detail: e.to_string() })
    }

    /// Reads a model written by [`Mlp::save`]; checks that the layers chain.
    pub fn load(path: &Path) -> Result<Self, ModelError> {
        let shown = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|source| ModelError::Read { path: shown.clone(), source })?;
        let corrupt = |detail: String| ModelError::Corrupt { path: shown.clone(), detail };
        let st = SafeTensors::deserialize(&bytes).map_err(|e| corrupt(e.to_string()))?;
        let mut layers = Vec::new();
        for i in 0.. {
            let (Ok(w), Ok(b)) =
                (st.tensor(&format!("layers.{i}.weight")), st.tensor(&format!("layers.{i}.bias")))
            else {
                break;
            };
            let (inputs, outputs) = match w.shape() {
                [a, b] => (*a, *b),
                s => return Err(corrupt(format!("layers.{i}.weight has shape {s:?}"))),
            };
            if w.dtype() != Dtype::F32 || b.dtype() != Dtype::F32 || b.shape() != [outputs] {
                return Err(corrupt(format!("layer {i}: weight/bias dtypes or shapes do not match")));
            }
            let floats = |d: &[u8]| {
                d.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<f32>>()
            };
            if let Some(prev) = layers.last().map(|l: &Layer| l.outputs)
                && prev != inputs
            {
                return Err(corrupt(format!(
                    "layer {i} takes {inputs} inputs but layer {} gives {prev}",
                    i - 1
                )));
            }
            layers.push(Layer { inputs, outputs, weight: floats(w.data()), bias: floats(b.data()) });
        }
        if layers.is_empty() {
            return Err(corrupt("no layers.0.weight / layers.0.bias tensors".into()));
        }
        Ok(Mlp { layers })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_matches_a_plain_loop_and_save_load_round_trips() {
        let m = Mlp::random(&[5, 7, 3], 1);
        let x: Vec<f32> = (0..10).map(|i| i as f32 * 0.1 - 0.5).collect();
        let y = m.forward(&x, 2);
        for r in 0..2 {
            let mut h = m.layers[0].bias.clone();
            for (j, hj) in h.iter_mut().enumerate() {
                for k in 0..5 {
                    *hj += x[r * 5 + k] * m.layers[0].weight[k * 7 + j];
                }
                *hj = hj.max(0.0);
            }
            for j in 0..3 {
                let mut o = m.layers[1].bias[j];
                for (k, hk) in h.iter().enumerate() {
                    o += hk * m.layers[1].weight[k * 3 + j];
                }
                assert!((o - y[r * 3 + j]).abs() < 1e-5);
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.safetensors");
        m.save(&p).unwrap();
        assert_eq!(Mlp::load(&p).unwrap(), m);
        std::fs::write(&p, b"garbage").unwrap();
        assert!(matches!(Mlp::load(&p), Err(ModelError::Corrupt { .. })));
    }
}
