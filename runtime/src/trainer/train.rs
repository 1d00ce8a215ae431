//! The native trainer: forward and backward of the MLP, the loss and its
//! gradient from edl-host-gpu's fused soft-label loss, SGD with momentum; on
//! the CPU (GEMMs by matrixmultiply) or on a CUDA device (edl-host-gpu's
//! [`CudaMlp`]: cuBLAS, the CUDA loss kernel).
//!
//! On CUDA the device holds the parameters and momentum; the trainer keeps a
//! host mirror of both, refreshed after every update, because an elastic
//! worker snapshots the committed state on the host every step anyway (for
//! rollback, broadcast to joiners and checkpoints). The gradient comes to the
//! host for the all-reduce and goes back for the update.
//!
//! For data parallelism the gradient of a rank's shard is scaled by the
//! global batch, so summing the ranks' gradients (an all-reduce) gives the
//! gradient of the whole batch's mean loss: two workers on B/2 each take the
//! same step as one worker on B.

use crate::coordinator::machine::noise::squared_norm;
use crate::trainer::data::Dataset;
use crate::trainer::gemm::{ShapeError, View, gemm};
use crate::trainer::model::Mlp;
use edl_host_gpu::Device;
use edl_host_gpu::loss::{Batch as LossBatch, LossError, SoftLabelLoss, Teacher};
use edl_host_gpu::mlp::{CudaMlp, MlpError};

/// Why a training operation failed.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Loss(#[from] LossError),
    #[error("{device}: {source}")]
    Device { device: Device, source: MlpError },
    #[error("{what} has {got} values, the model has {want} parameters")]
    Shape { what: &'static str, got: usize, want: usize },
    #[error("batch of {rows} rows: {detail}")]
    Batch { rows: usize, detail: String },
    #[error(transparent)]
    Product(#[from] ShapeError),
}

/// A model with its optimiser state and gradient buffer.
pub struct Trainer {
    /// The parameters (on CUDA, the host mirror of the device's).
    model: Mlp,
    velocity: Vec<f32>,
    grad: Vec<f32>,
    /// The first part's gradient while the second is computed.
    part: Vec<f32>,
    cuda: Option<(usize, CudaMlp)>,
}

impl Trainer {
    /// A trainer on the CPU.
    pub fn new(model: Mlp) -> Self {
        let n = model.param_count();
        Trainer { model, velocity: vec![0.0; n], grad: vec![0.0; n], part: Vec::new(), cuda: None }
    }

    /// A trainer on `device`: an error value when that device cannot be used
    /// (no driver, no such GPU, no cuBLAS or NVRTC).
    pub fn on(device: Device, model: Mlp) -> Result<Self, TrainError> {
        let mut t = Trainer::new(model);
        if let Device::Cuda(ordinal) = device {
            let sizes = t.model.sizes();
            let mlp = CudaMlp::new(ordinal, &sizes, &t.model.params_flat())
                .map_err(|source| TrainError::Device { device, source })?;
            t.cuda = Some((ordinal, mlp));
        }
        Ok(t)
    }

    /// Where the trainer computes.
    pub fn device(&self) -> Device {
        self.cuda.as_ref().map_or(Device::Cpu, |(i, _)| Device::Cuda(*i))
    }

    fn device_err(&self) -> impl Fn(MlpError) -> TrainError + use<> {
        let device = self.device();
        move |source| TrainError::Device { device, source }
    }

    /// The model (on CUDA, as of the last update).
    pub fn model(&self) -> &Mlp {
        &self.model
    }

    pub fn into_model(self) -> Mlp {
        self.model
    }

    /// Number of parameters (the length of gradients and flat parameters).
    pub fn param_count(&self) -> usize {
        self.grad.len()
    }

    fn check_len(&self, what: &'static str, got: usize) -> Result<(), TrainError> {
        match self.param_count() {
            want if want == got => Ok(()),
            want => Err(TrainError::Shape { what, got, want }),
        }
    }

    /// All parameters, layer by layer (weight then bias).
    pub fn params_flat(&self) -> Vec<f32> {
        self.model.params_flat()
    }

    /// The parameters and momentum into `params` and `velocity`, reusing
    /// their allocations (a rollback point taken every window).
    pub fn state_into(&self, params: &mut Vec<f32>, velocity: &mut Vec<f32>) {
        self.model.params_into(params);
        velocity.clear();
        velocity.extend_from_slice(&self.velocity);
    }

    /// Replaces all parameters (a joiner receives them by broadcast).
    pub fn load_params_flat(&mut self, flat: &[f32]) -> Result<(), TrainError> {
        self.check_len("parameter vector", flat.len())?;
        let err = self.device_err();
        if let Some((_, mlp)) = &mut self.cuda {
            mlp.load_params(flat).map_err(err)?;
        }
        self.model.load_params_flat(flat);
        Ok(())
    }

    /// The optimiser's momentum buffer (checkpointed with the parameters).
    pub fn velocity(&self) -> &[f32] {
        &self.velocity
    }

    pub fn load_velocity(&mut self, v: &[f32]) -> Result<(), TrainError> {
        self.check_len("momentum vector", v.len())?;
        let err = self.device_err();
        if let Some((_, mlp)) = &mut self.cuda {
            mlp.load_velocity(v).map_err(err)?;
        }
        self.velocity.copy_from_slice(v);
        Ok(())
    }

    /// The gradient buffer, to all-reduce between compute and apply.
    pub fn grad_mut(&mut self) -> &mut [f32] {
        &mut self.grad
    }

    /// Checks a batch against the model: `rows x input` finite features,
    /// labels below the class count, `rows x classes` finite teacher logits.
    fn check_batch(&self, x: &[f32], labels: &[u32], teacher: Option<&[f32]>) -> Result<(), TrainError> {
        let rows = labels.len();
        let (input, classes) = (self.model.input_dim(), self.model.output_dim());
        let bad = |detail: String| Err(TrainError::Batch { rows, detail });
        if Some(x.len()) != rows.checked_mul(input) {
            return bad(format!("{} feature values, the model takes {input} per row", x.len()));
        }
        if let Some(i) = x.iter().position(|v| !v.is_finite()) {
            return bad(format!("feature {} of row {} is {}", i % input.max(1), i / input.max(1), x[i]));
        }
        if let Some((r, y)) = labels.iter().enumerate().find(|(_, y)| **y as usize >= classes) {
            return bad(format!("label {y} of row {r} is not below the {classes} classes"));
        }
        if let Some(t) = teacher {
            if Some(t.len()) != rows.checked_mul(classes) {
                return bad(format!("{} teacher logits, {classes} per row expected", t.len()));
            }
            if let Some(i) = t.iter().position(|v| !v.is_finite()) {
                return bad(format!("teacher logit {} of row {} is {}", i % classes, i / classes, t[i]));
            }
        }
        Ok(())
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
    ) -> Result<f64, TrainError> {
        self.check_batch(x, labels, teacher)?;
        self.checked_gradient(x, labels, teacher, loss, global_rows)
    }

    /// [`Trainer::compute_gradient`] of a batch already checked.
    fn checked_gradient(
        &mut self,
        x: &[f32],
        labels: &[u32],
        teacher: Option<&[f32]>,
        loss: &SoftLabelLoss,
        global_rows: usize,
    ) -> Result<f64, TrainError> {
        let err = self.device_err();
        if let Some((_, mlp)) = &mut self.cuda {
            return mlp.compute_gradient(x, labels, teacher, loss, global_rows, &mut self.grad).map_err(err);
        }
        let rows = labels.len();
        self.grad.iter_mut().for_each(|g| *g = 0.0);
        if rows == 0 {
            return Ok(0.0);
        }
        let mut acts = forward(&self.model, x, rows)?;
        let logits = acts.pop().expect("at least one layer");
        let (mean, g) = logits_gradient(&logits, labels, teacher, loss, global_rows)?;
        backward(&self.model, x, rows, &acts, g, &mut self.grad, None)?;
        Ok(mean as f64 * rows as f64)
    }

    /// [`Trainer::compute_gradient`] in two parts, the shard's first half of
    /// rows and then the rest, summed into the gradient buffer as one pass
    /// would give it. Returns the summed loss and each part's rows and the
    /// squared norm of its gradient (its share of the step's mean gradient):
    /// two batches from one rank, which the gradient noise scale compares
    /// as it compares ranks. Fewer than two rows, or a CUDA trainer: one
    /// part (the one-pass gradient).
    pub fn compute_gradient_in_parts(
        &mut self,
        x: &[f32],
        labels: &[u32],
        teacher: Option<&[f32]>,
        loss: &SoftLabelLoss,
        global_rows: usize,
    ) -> Result<(f64, Vec<(usize, f64)>), TrainError> {
        let rows = labels.len();
        // On CUDA the gradient stays one pass (the parts would each cross the bus).
        if rows < 2 || self.cuda.is_some() {
            let summed = self.compute_gradient(x, labels, teacher, loss, global_rows)?;
            return Ok((summed, vec![(rows, squared_norm(&self.grad))]));
        }
        self.check_batch(x, labels, teacher)?;
        let (input, classes, half) = (self.model.input_dim(), self.model.output_dim(), rows / 2);
        let first = self.checked_gradient(
            &x[..half * input],
            &labels[..half],
            teacher.map(|t| &t[..half * classes]),
            loss,
            global_rows,
        )?;
        let mut part = std::mem::take(&mut self.part);
        part.clear();
        part.extend_from_slice(&self.grad);
        let second = self.checked_gradient(
            &x[half * input..],
            &labels[half..],
            teacher.map(|t| &t[half * classes..]),
            loss,
            global_rows,
        )?;
        let parts = vec![(half, squared_norm(&part)), (rows - half, squared_norm(&self.grad))];
        self.grad.iter_mut().zip(&part).for_each(|(g, p)| *g += p);
        self.part = part;
        Ok((first + second, parts))
    }

    /// On the CPU, the gradient of a loss of the logits into the gradient
    /// buffer, and the loss's gradient with respect to the inputs into
    /// `input_grad` (`rows x input` values): `loss_of(logits)` gives the
    /// loss and its gradient with respect to the logits, which this returns
    /// with the logits' gradient applied.
    pub fn compute_gradient_of(
        &mut self,
        x: &[f32],
        rows: usize,
        loss_of: impl FnOnce(&[f32]) -> (f64, Vec<f32>),
        input_grad: &mut Vec<f32>,
    ) -> Result<f64, TrainError> {
        let input = self.model.input_dim();
        if self.cuda.is_some() {
            return Err(TrainError::Batch { rows, detail: "this model trains on the CPU only".into() });
        }
        if Some(x.len()) != rows.checked_mul(input) {
            return Err(TrainError::Batch {
                rows,
                detail: format!("{} input values, the model takes {input} per row", x.len()),
            });
        }
        self.grad.iter_mut().for_each(|g| *g = 0.0);
        input_grad.clear();
        input_grad.resize(rows * input, 0.0);
        if rows == 0 {
            return Ok(0.0);
        }
        let mut acts = forward(&self.model, x, rows)?;
        let logits = acts.pop().expect("at least one layer");
        let (loss, g) = loss_of(&logits);
        if g.len() != logits.len() {
            return Err(TrainError::Batch { rows, detail: format!("{} logit gradients", g.len()) });
        }
        backward(&self.model, x, rows, &acts, g, &mut self.grad, Some(input_grad))?;
        Ok(loss)
    }

    /// SGD with momentum (v = momentum v + g; w -= lr v) with the gradient buffer.
    pub fn apply(&mut self, lr: f32, momentum: f32) -> Result<(), TrainError> {
        let err = self.device_err();
        if let Some((_, mlp)) = &mut self.cuda {
            let (params, velocity) = mlp
                .apply(Some(&self.grad), lr, momentum)
                .and_then(|()| Ok((mlp.params()?, mlp.velocity()?)))
                .map_err(err)?;
            self.model.load_params_flat(&params);
            self.velocity = velocity;
            return Ok(());
        }
        let mut at = 0;
        for l in &mut self.model.layers {
            for part in [&mut l.weight, &mut l.bias] {
                let n = part.len();
                let (v, g) = (&mut self.velocity[at..at + n], &self.grad[at..at + n]);
                for ((p, v), g) in part.iter_mut().zip(v).zip(g) {
                    *v = momentum * *v + g;
                    *p -= lr * *v;
                }
                at += n;
            }
        }
        Ok(())
    }

    /// Share of `data` classified correctly.
    pub fn accuracy(&self, data: &Dataset) -> f32 {
        self.model.accuracy(data)
    }
}

/// The forward pass on the CPU: each layer's output for the `rows` rows of
/// `x` (ReLU after all but the last), kept for the backward pass; the last
/// is the logits.
fn forward(model: &Mlp, x: &[f32], rows: usize) -> Result<Vec<Vec<f32>>, TrainError> {
    let mut acts: Vec<Vec<f32>> = Vec::with_capacity(model.layers.len());
    for (i, l) in model.layers.iter().enumerate() {
        let input = if i == 0 { x } else { &acts[i - 1] };
        let mut z = vec![0f32; rows * l.outputs];
        for r in 0..rows {
            z[r * l.outputs..(r + 1) * l.outputs].copy_from_slice(&l.bias);
        }
        gemm(
            rows,
            l.inputs,
            l.outputs,
            View::row_major(input, l.inputs),
            View::row_major(&l.weight, l.outputs),
            &mut z,
            true,
        )?;
        if i + 1 < model.layers.len() {
            z.iter_mut().for_each(|v| *v = v.max(0.0));
        }
        acts.push(z);
    }
    Ok(acts)
}

/// The shard's mean loss, and its gradient with respect to the logits,
/// scaled so that the ranks' gradients sum to the global batch's.
fn logits_gradient(
    logits: &[f32],
    labels: &[u32],
    teacher: Option<&[f32]>,
    loss: &SoftLabelLoss,
    global_rows: usize,
) -> Result<(f32, Vec<f32>), TrainError> {
    let rows = labels.len();
    let classes = logits.len() / rows;
    let (params, teacher_values) = match teacher {
        Some(t) => (*loss, Teacher::Logits(t)),
        None => (SoftLabelLoss { alpha: 0.0, ..*loss }, Teacher::Logits(logits)),
    };
    let mut g = vec![0f32; rows * classes];
    let mean = params.forward_backward(
        &LossBatch { student: logits, teacher: teacher_values, labels: Some(labels), rows, classes },
        &mut g,
    )?;
    // The loss averaged over this shard; rescale to the global batch.
    let scale = rows as f32 / global_rows.max(1) as f32;
    g.iter_mut().for_each(|v| *v *= scale);
    Ok((mean, g))
}

/// The backward pass on the CPU for the `rows` rows of `x`, last layer
/// first, from `g`, the gradient with respect to the logits: adds each
/// layer's weight and bias gradients into `grad` (laid out per layer, weight
/// then bias). `acts` are the hidden layers' outputs from [`forward`].
/// With `input_grad`, the gradient with respect to `x` too.
fn backward(
    model: &Mlp,
    x: &[f32],
    rows: usize,
    acts: &[Vec<f32>],
    mut g: Vec<f32>,
    grad: &mut [f32],
    mut input_grad: Option<&mut [f32]>,
) -> Result<(), TrainError> {
    let mut offsets = Vec::new();
    let mut at = 0;
    for l in &model.layers {
        offsets.push(at);
        at += l.weight.len() + l.bias.len();
    }
    for li in (0..model.layers.len()).rev() {
        let l = &model.layers[li];
        let a: &[f32] = if li == 0 { x } else { &acts[li - 1] };
        let (dw, rest) = grad[offsets[li]..].split_at_mut(l.weight.len());
        // dW = A^T G
        gemm(
            l.inputs,
            rows,
            l.outputs,
            View::transposed(a, l.inputs),
            View::row_major(&g, l.outputs),
            dw,
            false,
        )?;
        for r in 0..rows {
            for (db, gv) in rest[..l.outputs].iter_mut().zip(&g[r * l.outputs..(r + 1) * l.outputs]) {
                *db += gv;
            }
        }
        if li == 0 && input_grad.is_none() {
            break;
        }
        // G_prev = G W^T: the gradient of this layer's input.
        let mut prev = vec![0f32; rows * l.inputs];
        gemm(
            rows,
            l.outputs,
            l.inputs,
            View::row_major(&g, l.outputs),
            View::transposed(&l.weight, l.outputs),
            &mut prev,
            false,
        )?;
        if li == 0 {
            // The model's inputs (no ReLU before them).
            if let Some(dx) = input_grad.as_deref_mut() {
                dx.copy_from_slice(&prev);
            }
            break;
        }
        // Through the ReLU of the layer below.
        for (p, act) in prev.iter_mut().zip(a) {
            if *act <= 0.0 {
                *p = 0.0;
            }
        }
        g = prev;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trainer::data::{self, Source};

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
                t.load_params_flat(&up).unwrap();
                let lu = loss_of(&mut t, &x, &y, teacher, &p);
                up[i] -= 2.0 * h;
                t.load_params_flat(&up).unwrap();
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
    fn a_batch_that_does_not_fit_the_model_is_an_error_not_a_read_past_it() {
        let mut t = Trainer::new(Mlp::random(&[4, 3, 2], 1));
        let p = SoftLabelLoss { temperature: 2.0, alpha: 0.5 };
        let x = vec![0.5f32; 3 * 4];
        let soft = vec![0.1f32; 3 * 2];
        let cases: Vec<(Vec<f32>, Vec<u32>, Option<Vec<f32>>, &str)> = vec![
            (x.clone(), vec![0, 1], None, "12 feature values, the model takes 4 per row"),
            (x[..8].to_vec(), vec![0, 1, 0], None, "8 feature values"),
            (vec![0.5; 3 * 5], vec![0, 1, 0], None, "15 feature values"),
            (x.clone(), vec![0, 1, 2], None, "label 2 of row 2 is not below the 2 classes"),
            (x.clone(), vec![0, 1, 0], Some(soft[..4].to_vec()), "4 teacher logits"),
            (x.clone(), vec![0, 1, 0], Some(vec![f32::NAN; 6]), "teacher logit 0 of row 0 is NaN"),
            ([&x[..5], &[f32::INFINITY], &x[6..]].concat(), vec![0, 1, 0], None, "feature 1 of row 1 is inf"),
        ];
        for (x, y, teacher, want) in cases {
            let e = t.compute_gradient(&x, &y, teacher.as_deref(), &p, 3).unwrap_err().to_string();
            assert!(e.contains(want), "{e:?} should say {want:?}");
        }
        t.compute_gradient(&x, &[0, 1, 0], Some(&soft), &p, 3).unwrap();
    }

    #[test]
    fn a_gradient_in_two_parts_is_the_one_pass_gradient_and_tells_each_part_s_norm() {
        let (rows, p) = (7, SoftLabelLoss { temperature: 2.0, alpha: 0.5 });
        let x: Vec<f32> = (0..rows * 6).map(|i| ((i * 7) % 13) as f32 / 13.0 - 0.4).collect();
        let y: Vec<u32> = (0..rows as u32).map(|r| r % 4).collect();
        let soft: Vec<f32> = (0..rows * 4).map(|i| ((i * 5) % 9) as f32 / 9.0).collect();
        let mut t = Trainer::new(Mlp::random(&[6, 5, 4], 2));
        // The step's mean gradient over 10 rows (other ranks hold the rest).
        let whole = t.compute_gradient(&x, &y, Some(&soft), &p, 10).unwrap();
        let one_pass = t.grad.clone();
        let (first, second) = (rows / 2, rows - rows / 2);
        t.compute_gradient(&x[..first * 6], &y[..first], Some(&soft[..first * 4]), &p, 10).unwrap();
        let head = squared_norm(&t.grad);
        t.compute_gradient(&x[first * 6..], &y[first..], Some(&soft[first * 4..]), &p, 10).unwrap();
        let tail = squared_norm(&t.grad);
        let (summed, parts) = t.compute_gradient_in_parts(&x, &y, Some(&soft), &p, 10).unwrap();
        assert!((summed - whole).abs() < 1e-5 * whole.abs(), "{summed} against {whole}");
        for (a, b) in t.grad.iter().zip(&one_pass) {
            assert!((a - b).abs() <= 1e-6 + 1e-5 * b.abs(), "{a} against {b}");
        }
        assert_eq!(parts.len(), 2);
        assert_eq!((parts[0].0, parts[1].0), (first, second));
        assert!((parts[0].1 - head).abs() < 1e-9 && (parts[1].1 - tail).abs() < 1e-9, "{parts:?}");
        assert!(head > 0.0 && tail > 0.0 && head != tail);
        // One row cannot be split: one part, the whole gradient's norm.
        let (_, one) = t.compute_gradient_in_parts(&x[..6], &y[..1], None, &p, 10).unwrap();
        assert_eq!(one, vec![(1, squared_norm(&t.grad))]);
        // A bad batch is refused whole, before either part is computed: a
        // bad value in the second half leaves the gradient as it was.
        let before = t.grad.clone();
        let mut bad = x.clone();
        bad[rows * 6 - 1] = f32::NAN;
        let e = t.compute_gradient_in_parts(&bad, &y, None, &p, 10).unwrap_err().to_string();
        assert!(e.contains("feature 5 of row 6 is NaN"), "{e}");
        assert_eq!(t.grad, before);
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
                t.apply(0.05, 0.9).unwrap();
            }
        }
        let acc = t.accuracy(&test);
        assert!(acc > 0.9, "test accuracy {acc}");
    }
}
