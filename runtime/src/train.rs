//! The native trainer: forward and backward of the MLP on the CPU (GEMMs by
//! matrixmultiply), the loss and its gradient from edl-host-gpu's fused
//! soft-label loss, SGD with momentum.
//!
//! For data parallelism the gradient of a rank's shard is scaled by the
//! global batch, so summing the ranks' gradients (an all-reduce) gives the
//! gradient of the whole batch's mean loss: two workers on B/2 each take the
//! same step as one worker on B.

use crate::data::Dataset;
use crate::model::Mlp;
use edl_host_gpu::loss::{Batch as LossBatch, LossError, SoftLabelLoss, Teacher};

/// A model with its optimiser state and gradient buffer.
pub struct Trainer {
    pub model: Mlp,
    velocity: Vec<f32>,
    grad: Vec<f32>,
}

/// Multiplies row-major matrices with explicit strides: C = A B (+ C when `accumulate`).
#[allow(clippy::too_many_arguments)]
fn gemm(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    (rsa, csa): (isize, isize),
    b: &[f32],
    (rsb, csb): (isize, isize),
    c: &mut [f32],
    accumulate: bool,
) {
    assert!(c.len() >= m * n);
    // SAFETY: the callers pass slices of at least the extents the strides reach.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            rsa,
            csa,
            b.as_ptr(),
            rsb,
            csb,
            if accumulate { 1.0 } else { 0.0 },
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

impl Trainer {
    pub fn new(model: Mlp) -> Self {
        let n = model.layers.iter().map(|l| l.weight.len() + l.bias.len()).sum();
        Trainer { model, velocity: vec![0.0; n], grad: vec![0.0; n] }
    }

    /// Number of parameters (the length of gradients and flat parameters).
    pub fn param_count(&self) -> usize {
        self.grad.len()
    }

    /// All parameters, layer by layer (weight then bias).
    pub fn params_flat(&self) -> Vec<f32> {
        self.model.layers.iter().flat_map(|l| l.weight.iter().chain(&l.bias).copied()).collect()
    }

    /// Replaces all parameters (a joiner receives them by broadcast).
    pub fn load_params_flat(&mut self, flat: &[f32]) {
        assert_eq!(flat.len(), self.param_count());
        let mut at = 0;
        for l in &mut self.model.layers {
            let (w, b) = (l.weight.len(), l.bias.len());
            l.weight.copy_from_slice(&flat[at..at + w]);
            l.bias.copy_from_slice(&flat[at + w..at + w + b]);
            at += w + b;
        }
    }

    /// The optimiser's momentum buffer (checkpointed with the parameters).
    pub fn velocity(&self) -> &[f32] {
        &self.velocity
    }

    pub fn load_velocity(&mut self, v: &[f32]) {
        assert_eq!(v.len(), self.velocity.len());
        self.velocity.copy_from_slice(v);
    }

    /// The gradient buffer, to all-reduce between compute and apply.
    pub fn grad_mut(&mut self) -> &mut [f32] {
        &mut self.grad
    }

    /// Computes the gradient of this shard's summed loss divided by
    /// `global_rows` into the gradient buffer; returns the shard's summed loss.
    /// Without `teacher` logits the loss is plain cross-entropy.
    pub fn compute_gradient(
        &mut self,
        x: &[f32],
        labels: &[u32],
        teacher: Option<&[f32]>,
        loss: &SoftLabelLoss,
        global_rows: usize,
    ) -> Result<f64, LossError> {
        let rows = labels.len();
        self.grad.iter_mut().for_each(|g| *g = 0.0);
        if rows == 0 {
            return Ok(0.0);
        }
        // Forward, keeping each layer's input.
        let mut acts: Vec<Vec<f32>> = vec![x.to_vec()];
        for (i, l) in self.model.layers.iter().enumerate() {
            let mut z = vec![0f32; rows * l.outputs];
            for r in 0..rows {
                z[r * l.outputs..(r + 1) * l.outputs].copy_from_slice(&l.bias);
            }
            gemm(
                rows,
                l.inputs,
                l.outputs,
                &acts[i],
                (l.inputs as isize, 1),
                &l.weight,
                (l.outputs as isize, 1),
                &mut z,
                true,
            );
            if i + 1 < self.model.layers.len() {
                z.iter_mut().for_each(|v| *v = v.max(0.0));
            }
            acts.push(z);
        }
        let logits = acts.pop().expect("at least one layer");
        let classes = self.model.output_dim();
        let (params, teacher_values) = match teacher {
            Some(t) => (*loss, Teacher::Logits(t)),
            None => (SoftLabelLoss { alpha: 0.0, ..*loss }, Teacher::Logits(&logits)),
        };
        let mut g = vec![0f32; rows * classes];
        let mean = params.forward_backward(
            &LossBatch { student: &logits, teacher: teacher_values, labels: Some(labels), rows, classes },
            &mut g,
        )?;
        // The loss averaged over this shard; rescale to the global batch.
        let scale = rows as f32 / global_rows.max(1) as f32;
        g.iter_mut().for_each(|v| *v *= scale);

        // Backward, last layer first; gradient layout: per layer weight then bias.
        let mut offsets = Vec::new();
        let mut at = 0;
        for l in &self.model.layers {
            offsets.push(at);
            at += l.weight.len() + l.bias.len();
        }
        for li in (0..self.model.layers.len()).rev() {
            let l = &self.model.layers[li];
            let a = &acts[li];
            let off = offsets[li];
            let (dw, rest) = self.grad[off..].split_at_mut(l.weight.len());
            // dW = A^T G
            gemm(
                l.inputs,
                rows,
                l.outputs,
                a,
                (1, l.inputs as isize),
                &g,
                (l.outputs as isize, 1),
                dw,
                false,
            );
            for r in 0..rows {
                for (db, gv) in rest[..l.outputs].iter_mut().zip(&g[r * l.outputs..(r + 1) * l.outputs]) {
                    *db += gv;
                }
            }
            if li > 0 {
                // G_prev = G W^T, through the ReLU.
                let mut prev = vec![0f32; rows * l.inputs];
                gemm(
                    rows,
                    l.outputs,
                    l.inputs,
                    &g,
                    (l.outputs as isize, 1),
                    &l.weight,
                    (1, l.outputs as isize),
                    &mut prev,
                    false,
                );
                for (p, act) in prev.iter_mut().zip(a) {
                    if *act <= 0.0 {
                        *p = 0.0;
                    }
                }
                g = prev;
            }
        }
        Ok(mean as f64 * rows as f64)
    }

    /// SGD with momentum (v = momentum v + g; w -= lr v) with the gradient buffer.
    pub fn apply(&mut self, lr: f32, momentum: f32) {
        let mut at = 0;
        for l in &mut self.model.layers {
            for p in l.weight.iter_mut().chain(l.bias.iter_mut()) {
                let v = &mut self.velocity[at];
                *v = momentum * *v + self.grad[at];
                *p -= lr * *v;
                at += 1;
            }
        }
    }

    /// Share of `data` classified correctly.
    pub fn accuracy(&self, data: &Dataset) -> f32 {
        let chunk = 512;
        let mut correct = 0usize;
        for start in (0..data.len()).step_by(chunk) {
            let rows = chunk.min(data.len() - start);
            let logits =
                self.model.forward(&data.features[start * data.dim..(start + rows) * data.dim], rows);
            for r in 0..rows {
                let row = &logits[r * data.classes..(r + 1) * data.classes];
                let best =
                    row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i).unwrap_or(0);
                correct += (best as u32 == data.labels[start + r]) as usize;
            }
        }
        correct as f32 / data.len().max(1) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{self, Source};

    fn loss_of(t: &mut Trainer, x: &[f32], y: &[u32], teacher: Option<&[f32]>, p: &SoftLabelLoss) -> f64 {
        t.compute_gradient(x, y, teacher, p, y.len()).unwrap() / y.len() as f64
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let x: Vec<f32> = (0..4 * 6).map(|i| ((i * 7) % 11) as f32 / 11.0 - 0.3).collect();
        let y = [0u32, 3, 2, 1];
        let teacher: Vec<f32> = (0..4 * 4).map(|i| ((i * 5) % 7) as f32 / 7.0).collect();
        for (teacher, p) in [
            (None, SoftLabelLoss { temperature: 1.0, alpha: 0.0 }),
            (Some(&teacher[..]), SoftLabelLoss { temperature: 3.0, alpha: 0.7 }),
        ] {
            let mut t = Trainer::new(Mlp::random(&[6, 5, 4], 3));
            for l in &mut t.model.layers {
                l.bias.iter_mut().enumerate().for_each(|(i, b)| *b = 0.05 * i as f32);
            }
            loss_of(&mut t, &x, &y, teacher, &p);
            let analytic = t.grad.clone();
            let base = t.params_flat();
            let h = 1e-3;
            for i in 0..base.len() {
                let mut up = base.clone();
                up[i] += h;
                t.load_params_flat(&up);
                let lu = loss_of(&mut t, &x, &y, teacher, &p);
                up[i] -= 2.0 * h;
                t.load_params_flat(&up);
                let ld = loss_of(&mut t, &x, &y, teacher, &p);
                let fd = (lu - ld) / (2.0 * h as f64);
                assert!(
                    (analytic[i] as f64 - fd).abs() < 2e-3,
                    "param {i}: analytic {} finite difference {fd}",
                    analytic[i]
                );
            }
        }
    }

    #[test]
    fn learns_the_digits() {
        let (train, test) = Dataset::load(Source::Digits).unwrap().split(400, 1);
        let mut t = Trainer::new(Mlp::random(&[64, 64, 10], 1));
        let p = SoftLabelLoss { temperature: 1.0, alpha: 0.0 };
        for epoch in 0..8 {
            let order = data::permutation(train.len(), 1, epoch);
            for chunk in order.chunks(32) {
                let (x, y) = train.gather(chunk);
                t.compute_gradient(&x, &y, None, &p, y.len()).unwrap();
                t.apply(0.05, 0.9);
            }
        }
        let acc = t.accuracy(&test);
        assert!(acc > 0.9, "test accuracy {acc}");
    }
}
