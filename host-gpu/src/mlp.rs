//! A multi-layer perceptron trained on one CUDA device: parameters, momentum
//! and gradient live on the device; the matrix products are cuBLAS's, the
//! loss is the fused soft-label kernel of [`crate::loss`], the rest are the
//! small kernels of `kernels/mlp.cu` (bias + ReLU, ReLU backward, bias
//! gradient, SGD with momentum).
//!
//! Layout, shared with the CPU trainer of edl-runtime so that checkpoints,
//! broadcasts and all-reduces see the same flat vector: layer by layer, the
//! weight `[inputs, outputs]` row-major, then the bias `[outputs]`. ReLU
//! between layers, logits out.
//!
//! A step for data parallelism: [`CudaMlp::compute_gradient`] computes the
//! gradient of the shard's summed loss divided by the *global* batch and
//! copies it to the host, where the ranks all-reduce it;
//! [`CudaMlp::apply`] takes the reduced gradient back and updates.

use crate::device::{CudaUnavailable, KernelError, check_cuda, cublas_present, kernel_module};
use crate::kernels;
use crate::loss::{CudaSoftLabel, DeviceBatch, LossError, SoftLabelLoss, check_labels};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

/// The kernels' CUDA C source ([`kernels::MLP`]).
pub const CUDA_SOURCE: &str = kernels::MLP.code;
const THREADS: u32 = 256;
/// Grid-stride kernels need no more blocks than this to fill a GPU.
const MAX_BLOCKS: usize = 4096;

/// Why a CUDA MLP operation failed.
#[derive(Debug, thiserror::Error)]
pub enum MlpError {
    #[error(transparent)]
    Unavailable(#[from] CudaUnavailable),
    /// The MLP kernels did not compile or load.
    #[error("CUDA: {0}")]
    Kernel(#[from] KernelError),
    #[error("CUDA: {0}")]
    Cuda(String),
    #[error("shape mismatch: {0}")]
    Shape(String),
    #[error(transparent)]
    Loss(#[from] LossError),
}

fn cuda_err(e: impl std::fmt::Debug) -> MlpError {
    MlpError::Cuda(format!("{e:?}"))
}

/// The number of parameters of an MLP with layer sizes `sizes` (input first).
pub fn param_count(sizes: &[usize]) -> usize {
    sizes.windows(2).map(|w| w[0] * w[1] + w[1]).sum()
}

struct Kernels {
    bias_act: CudaFunction,
    relu_backward: CudaFunction,
    column_sum: CudaFunction,
    sgd_momentum: CudaFunction,
}

/// Device buffers for batches of one row count.
struct Workspace {
    rows: usize,
    /// `acts[0]` is the input, `acts[i + 1]` the output of layer i.
    acts: Vec<CudaSlice<f32>>,
    /// `deltas[i]`: the loss gradient with respect to layer i's output.
    deltas: Vec<CudaSlice<f32>>,
    labels: CudaSlice<u32>,
    teacher: CudaSlice<f32>,
    row_loss: CudaSlice<f32>,
}

/// An MLP with its optimiser state on one CUDA device.
pub struct CudaMlp {
    sizes: Vec<usize>,
    /// Where each layer's weight starts in the flat vectors.
    offsets: Vec<usize>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    loss: CudaSoftLabel,
    kernels: Kernels,
    params: CudaSlice<f32>,
    velocity: CudaSlice<f32>,
    grad: CudaSlice<f32>,
    work: Option<Workspace>,
}

fn grid(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// A row-major matrix product `C[m, n] = op(A) op(B)`, `op` transposing
/// where `ta`/`tb` say; `lda`, `ldb`, `ldc` are the row lengths of A, B and C
/// as stored.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Product {
    ta: bool,
    tb: bool,
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    ldc: usize,
}

impl Product {
    /// A layer's forward: `Z[rows, outputs] = X[rows, inputs] W[inputs, outputs]`.
    fn forward(rows: usize, inputs: usize, outputs: usize) -> Self {
        let (ta, tb, m, n, k) = (false, false, rows, outputs, inputs);
        Product { ta, tb, m, n, k, lda: inputs, ldb: outputs, ldc: outputs }
    }

    /// The weight gradient: `dW[inputs, outputs] = X^T G`, G `[rows, outputs]`.
    fn weight_grad(rows: usize, inputs: usize, outputs: usize) -> Self {
        let (ta, tb, m, n, k) = (true, false, inputs, outputs, rows);
        Product { ta, tb, m, n, k, lda: inputs, ldb: outputs, ldc: outputs }
    }

    /// The gradient passed down: `G_in[rows, inputs] = G W^T`.
    fn input_grad(rows: usize, inputs: usize, outputs: usize) -> Self {
        let (ta, tb, m, n, k) = (false, true, rows, inputs, outputs);
        Product { ta, tb, m, n, k, lda: outputs, ldb: outputs, ldc: inputs }
    }

    /// The cuBLAS call that computes it, with the operands given B first.
    /// cuBLAS is column-major, where a stored row-major matrix reads as its
    /// transpose: it computes C^T = op(B)^T op(A)^T.
    fn cublas(&self) -> GemmConfig<f32> {
        let op = |t: bool| if t { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N };
        GemmConfig {
            transa: op(self.tb),
            transb: op(self.ta),
            m: self.n as i32,
            n: self.m as i32,
            k: self.k as i32,
            alpha: 1.0,
            lda: self.ldb as i32,
            ldb: self.lda as i32,
            beta: 0.0,
            ldc: self.ldc as i32,
        }
    }
}

impl CudaMlp {
    /// An MLP with layer sizes `sizes` (input first) and flat parameters
    /// `params` on device `ordinal`, momentum zero. An error value when the
    /// driver, the device, NVRTC or cuBLAS is missing.
    pub fn new(ordinal: usize, sizes: &[usize], params: &[f32]) -> Result<Self, MlpError> {
        if sizes.len() < 2 || sizes.contains(&0) {
            return Err(MlpError::Shape(format!("layer sizes {sizes:?}: need at least two, none zero")));
        }
        let n = param_count(sizes);
        if params.len() != n {
            return Err(MlpError::Shape(format!(
                "{} parameters for layer sizes {sizes:?}, which need {n}",
                params.len()
            )));
        }
        check_cuda(ordinal)?;
        if !cublas_present() {
            return Err(CudaUnavailable::NoCublas.into());
        }
        let loss = CudaSoftLabel::new(ordinal)?;
        let stream = loss.stream().clone();
        let module = kernel_module(stream.context(), ordinal, kernels::MLP)?;
        let load = |name| module.load_function(name).map_err(cuda_err);
        let kernels = Kernels {
            bias_act: load("bias_act")?,
            relu_backward: load("relu_backward")?,
            column_sum: load("column_sum")?,
            sgd_momentum: load("sgd_momentum")?,
        };
        let blas = CudaBlas::new(stream.clone()).map_err(cuda_err)?;
        let offsets = sizes
            .windows(2)
            .scan(0, |at, w| {
                let start = *at;
                *at += w[0] * w[1] + w[1];
                Some(start)
            })
            .collect();
        Ok(CudaMlp {
            sizes: sizes.to_vec(),
            offsets,
            params: stream.clone_htod(params).map_err(cuda_err)?,
            velocity: stream.alloc_zeros(n).map_err(cuda_err)?,
            grad: stream.alloc_zeros(n).map_err(cuda_err)?,
            stream,
            blas,
            loss,
            kernels,
            work: None,
        })
    }

    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    pub fn param_count(&self) -> usize {
        self.params.len()
    }

    fn check_len(&self, what: &str, len: usize) -> Result<(), MlpError> {
        if len == self.param_count() {
            Ok(())
        } else {
            Err(MlpError::Shape(format!(
                "{what} has {len} values, the model has {} parameters",
                self.param_count()
            )))
        }
    }

    /// The parameters, copied to the host.
    pub fn params(&self) -> Result<Vec<f32>, MlpError> {
        self.stream.clone_dtoh(&self.params).map_err(cuda_err)
    }

    pub fn load_params(&mut self, flat: &[f32]) -> Result<(), MlpError> {
        self.check_len("parameter vector", flat.len())?;
        self.stream.memcpy_htod(flat, &mut self.params).map_err(cuda_err)
    }

    /// The momentum buffer, copied to the host.
    pub fn velocity(&self) -> Result<Vec<f32>, MlpError> {
        self.stream.clone_dtoh(&self.velocity).map_err(cuda_err)
    }

    pub fn load_velocity(&mut self, flat: &[f32]) -> Result<(), MlpError> {
        self.check_len("momentum vector", flat.len())?;
        self.stream.memcpy_htod(flat, &mut self.velocity).map_err(cuda_err)
    }

    /// Buffers for `rows`-row batches, made when the row count changes.
    fn workspace(&mut self, rows: usize) -> Result<Workspace, MlpError> {
        if let Some(w) = self.work.take().filter(|w| w.rows == rows) {
            return Ok(w);
        }
        let s = &self.stream;
        let classes = *self.sizes.last().expect("two sizes at least");
        let alloc = |n: usize| s.alloc_zeros::<f32>(n).map_err(cuda_err);
        Ok(Workspace {
            rows,
            acts: self.sizes.iter().map(|&w| alloc(rows * w)).collect::<Result<_, _>>()?,
            deltas: self.sizes[1..].iter().map(|&w| alloc(rows * w)).collect::<Result<_, _>>()?,
            labels: s.alloc_zeros(rows).map_err(cuda_err)?,
            teacher: alloc(rows * classes)?,
            row_loss: alloc(rows)?,
        })
    }

    /// Runs `p` on the device: `a` and `b` are A and B as the product names them.
    fn gemm(
        blas: &CudaBlas,
        p: Product,
        a: &impl DevicePtr<f32>,
        b: &impl DevicePtr<f32>,
        c: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), MlpError> {
        // SAFETY: the callers pass buffers holding the matrices the product's
        // shapes and row lengths describe (made so by the workspace).
        unsafe { blas.gemm(p.cublas(), b, a, c) }.map_err(cuda_err)
    }

    /// Runs the layers on `x` (`[rows, inputs]`): fills the workspace's activations.
    fn forward_into(&mut self, w: &mut Workspace, x: &[f32]) -> Result<(), MlpError> {
        let rows = w.rows;
        if x.len() != rows * self.sizes[0] {
            return Err(MlpError::Shape(format!(
                "input has {} values, [{rows} x {}] needs {}",
                x.len(),
                self.sizes[0],
                rows * self.sizes[0]
            )));
        }
        self.stream.memcpy_htod(x, &mut w.acts[0]).map_err(cuda_err)?;
        let layers = self.sizes.len() - 1;
        for i in 0..layers {
            let (inputs, outputs, off) = (self.sizes[i], self.sizes[i + 1], self.offsets[i]);
            let weight = self.params.slice(off..off + inputs * outputs);
            let bias = self.params.slice(off + inputs * outputs..off + inputs * outputs + outputs);
            let (before, after) = w.acts.split_at_mut(i + 1);
            let (a, z) = (&before[i], &mut after[0]);
            Self::gemm(&self.blas, Product::forward(rows, inputs, outputs), a, &weight, z)?;
            let (r, c, relu) = (rows as i32, outputs as i32, (i + 1 < layers) as i32);
            let mut launch = self.stream.launch_builder(&self.kernels.bias_act);
            launch.arg(z).arg(&bias).arg(&r).arg(&c).arg(&relu);
            // SAFETY: z holds rows x outputs values and bias outputs.
            unsafe { launch.launch(grid(rows * outputs)) }.map_err(cuda_err)?;
        }
        Ok(())
    }

    /// Logits `[rows, classes]` of inputs `x` (`[rows, inputs]`).
    pub fn forward(&mut self, x: &[f32], rows: usize) -> Result<Vec<f32>, MlpError> {
        let mut w = self.workspace(rows)?;
        let result = self
            .forward_into(&mut w, x)
            .and_then(|()| self.stream.clone_dtoh(w.acts.last().expect("layers")).map_err(cuda_err));
        self.work = Some(w);
        result
    }

    /// Computes, on the device, the gradient of this shard's summed loss
    /// divided by `global_rows` and copies it into `grad_out`; returns the
    /// shard's summed loss. Without `teacher` logits the loss is plain
    /// cross-entropy with `labels`.
    pub fn compute_gradient(
        &mut self,
        x: &[f32],
        labels: &[u32],
        teacher: Option<&[f32]>,
        loss: &SoftLabelLoss,
        global_rows: usize,
        grad_out: &mut [f32],
    ) -> Result<f64, MlpError> {
        self.check_len("gradient buffer", grad_out.len())?;
        loss.check_params()?;
        let rows = labels.len();
        let classes = *self.sizes.last().expect("two sizes at least");
        check_labels(labels, classes)?;
        if let Some(t) = teacher
            && t.len() != rows * classes
        {
            return Err(MlpError::Shape(format!(
                "teacher output has {} values, [{rows} x {classes}] needs {}",
                t.len(),
                rows * classes
            )));
        }
        // A NaN input would vanish in the first ReLU (max(NaN, 0) = 0) and
        // train on garbage unnoticed: refuse it here.
        let inputs = self.sizes[0];
        if let Some((i, &value)) = x.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            let (row, class) = (i / inputs, i % inputs);
            return Err(LossError::NonFinite { what: "input features", row, class, value }.into());
        }
        if rows == 0 {
            grad_out.fill(0.0);
            return Ok(0.0);
        }
        let mut w = self.workspace(rows)?;
        let result = self.step_gradient(&mut w, x, labels, teacher, loss, global_rows);
        self.work = Some(w);
        let mean = result?;
        self.stream.memcpy_dtoh(&self.grad, grad_out).map_err(cuda_err)?;
        self.stream.synchronize().map_err(cuda_err)?;
        Ok(mean as f64 * rows as f64)
    }

    fn step_gradient(
        &mut self,
        w: &mut Workspace,
        x: &[f32],
        labels: &[u32],
        teacher: Option<&[f32]>,
        loss: &SoftLabelLoss,
        global_rows: usize,
    ) -> Result<f32, MlpError> {
        let rows = w.rows;
        let layers = self.sizes.len() - 1;
        let classes = self.sizes[layers];
        self.forward_into(w, x)?;
        self.stream.memcpy_htod(labels, &mut w.labels).map_err(cuda_err)?;
        let logits = &w.acts[layers];
        let (params, teacher_buf) = match teacher {
            Some(t) => {
                self.stream.memcpy_htod(t, &mut w.teacher).map_err(cuda_err)?;
                (*loss, &w.teacher)
            }
            // Hard labels only: the distillation term is weighted zero.
            None => (SoftLabelLoss { alpha: 0.0, ..*loss }, logits),
        };
        let batch = DeviceBatch {
            student: logits,
            teacher: teacher_buf,
            teacher_is_probs: false,
            labels: Some(&w.labels),
            rows,
            classes,
        };
        let scale = 1.0 / global_rows.max(1) as f32;
        let mean = self.loss.forward_backward_device_scaled(
            &params,
            &batch,
            scale,
            &mut w.deltas[layers - 1],
            &mut w.row_loss,
        )?;

        // Backward, last layer first.
        for i in (0..layers).rev() {
            let (inputs, outputs, off) = (self.sizes[i], self.sizes[i + 1], self.offsets[i]);
            let a = &w.acts[i];
            let (before, after) = w.deltas.split_at_mut(i);
            let g = &after[0];
            // dW = A^T G
            let mut dw = self.grad.slice_mut(off..off + inputs * outputs);
            Self::gemm(&self.blas, Product::weight_grad(rows, inputs, outputs), a, g, &mut dw)?;
            // db = column sums of G
            let mut db = self.grad.slice_mut(off + inputs * outputs..off + inputs * outputs + outputs);
            let (r, c) = (rows as i32, outputs as i32);
            let mut launch = self.stream.launch_builder(&self.kernels.column_sum);
            launch.arg(g).arg(&r).arg(&c).arg(&mut db);
            // SAFETY: g holds rows x outputs values, db outputs.
            unsafe { launch.launch(grid(outputs)) }.map_err(cuda_err)?;
            if i > 0 {
                // G_prev = G W^T, then through the ReLU of layer i - 1.
                let weight = self.params.slice(off..off + inputs * outputs);
                let prev = &mut before[i - 1];
                Self::gemm(&self.blas, Product::input_grad(rows, inputs, outputs), g, &weight, prev)?;
                let n = rows * inputs;
                let mut launch = self.stream.launch_builder(&self.kernels.relu_backward);
                launch.arg(prev).arg(a).arg(&n);
                // SAFETY: prev and a both hold rows x inputs values.
                unsafe { launch.launch(grid(n)) }.map_err(cuda_err)?;
            }
        }
        Ok(mean)
    }

    /// SGD with momentum (v = momentum v + g; w -= lr v). With `grad`, that
    /// host gradient (the all-reduced one) is used; without, the one left on
    /// the device by the last [`Self::compute_gradient`].
    pub fn apply(&mut self, grad: Option<&[f32]>, lr: f32, momentum: f32) -> Result<(), MlpError> {
        if let Some(g) = grad {
            self.check_len("gradient", g.len())?;
            self.stream.memcpy_htod(g, &mut self.grad).map_err(cuda_err)?;
        }
        let n = self.param_count();
        let mut launch = self.stream.launch_builder(&self.kernels.sgd_momentum);
        launch.arg(&mut self.params).arg(&mut self.velocity).arg(&self.grad).arg(&n).arg(&lr).arg(&momentum);
        // SAFETY: the three buffers hold n values each.
        unsafe { launch.launch(grid(n)) }.map_err(cuda_err)?;
        self.stream.synchronize().map_err(cuda_err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What cuBLAS's sgemm computes for `cfg`: column-major
    /// C = alpha op(A) op(B) + beta C, with A, B, C as flat buffers.
    fn column_major_sgemm(cfg: &GemmConfig<f32>, a: &[f32], b: &[f32], c: &mut [f32]) {
        let (m, n, k) = (cfg.m as usize, cfg.n as usize, cfg.k as usize);
        let (lda, ldb, ldc) = (cfg.lda as usize, cfg.ldb as usize, cfg.ldc as usize);
        let t = |op: cublasOperation_t| op == cublasOperation_t::CUBLAS_OP_T;
        // Element (i, j) of op(X) for a column-major X with leading dimension ld.
        let at = |x: &[f32], ld: usize, trans: bool, i: usize, j: usize| {
            if trans { x[j + i * ld] } else { x[i + j * ld] }
        };
        for i in 0..m {
            for j in 0..n {
                let s: f32 =
                    (0..k).map(|p| at(a, lda, t(cfg.transa), i, p) * at(b, ldb, t(cfg.transb), p, j)).sum();
                c[i + j * ldc] = cfg.alpha * s + cfg.beta * c[i + j * ldc];
            }
        }
    }

    #[test]
    fn each_row_major_product_maps_to_the_right_cublas_call() {
        let (rows, inputs, outputs) = (5, 3, 4);
        let fill = |n: usize, seed: usize| {
            (0..n).map(|i| ((i * 7 + seed * 3) % 11) as f32 - 5.0).collect::<Vec<_>>()
        };
        let x = fill(rows * inputs, 1); // [rows, inputs]
        let w = fill(inputs * outputs, 2); // [inputs, outputs]
        let g = fill(rows * outputs, 3); // [rows, outputs]
        // Row-major element (r, c) of a matrix with row length ld.
        let e = |m: &[f32], ld: usize, r: usize, c: usize| m[r * ld + c];
        type Case<'a> = (Product, &'a [f32], &'a [f32], Vec<f32>);
        let cases: [Case<'_>; 3] = [
            (
                Product::forward(rows, inputs, outputs),
                &x,
                &w,
                (0..rows * outputs)
                    .map(|i| {
                        (0..inputs)
                            .map(|p| e(&x, inputs, i / outputs, p) * e(&w, outputs, p, i % outputs))
                            .sum()
                    })
                    .collect(),
            ),
            (
                Product::weight_grad(rows, inputs, outputs),
                &x,
                &g,
                (0..inputs * outputs)
                    .map(|i| {
                        (0..rows)
                            .map(|p| e(&x, inputs, p, i / outputs) * e(&g, outputs, p, i % outputs))
                            .sum()
                    })
                    .collect(),
            ),
            (
                Product::input_grad(rows, inputs, outputs),
                &g,
                &w,
                (0..rows * inputs)
                    .map(|i| {
                        (0..outputs)
                            .map(|p| e(&g, outputs, i / inputs, p) * e(&w, outputs, i % inputs, p))
                            .sum()
                    })
                    .collect(),
            ),
        ];
        for (product, a, b, want) in cases {
            let mut c = vec![0.0; want.len()];
            column_major_sgemm(&product.cublas(), b, a, &mut c);
            assert_eq!(c, want, "{product:?}");
        }
    }
}
