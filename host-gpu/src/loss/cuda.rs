//! CUDA soft-label loss: the kernels of `kernels/soft_label.cu`, compiled
//! once per process by NVRTC and loaded once per device.

use super::batch::{Batch, Teacher};
use super::error::LossError;
use super::params::SoftLabelLoss;
use crate::device::{check_cuda, kernel_module};
use crate::kernels;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use std::sync::Arc;

/// The kernels' CUDA C source ([`kernels::SOFT_LABEL`]).
pub const CUDA_SOURCE: &str = kernels::SOFT_LABEL.code;
/// Rows with at most this many classes get a warp each instead of a block.
const WARP_MAX_CLASSES: usize = 1024;
const BLOCK_THREADS: u32 = 256;
/// The kernel's "first invalid input" before any is found: it keeps the
/// smallest flat index of one (atomicMin), so none leaves this.
const NO_BAD_VALUE: u64 = u64::MAX;

fn cuda_err(e: impl std::fmt::Debug) -> LossError {
    LossError::Cuda(format!("{e:?}"))
}

/// The soft-label loss on one CUDA device.
pub struct CudaSoftLabel {
    stream: Arc<CudaStream>,
    block: CudaFunction,
    warp: CudaFunction,
}

/// Device buffers of one batch, for callers that keep their tensors on the device.
pub struct DeviceBatch<'a> {
    pub student: &'a CudaSlice<f32>,
    pub teacher: &'a CudaSlice<f32>,
    pub teacher_is_probs: bool,
    pub labels: Option<&'a CudaSlice<u32>>,
    pub rows: usize,
    pub classes: usize,
}

impl DeviceBatch<'_> {
    /// Checks the inputs and the output buffers against `[rows, classes]`.
    fn check_buffers(&self, grad: &CudaSlice<f32>, row_loss: &CudaSlice<f32>) -> Result<(), LossError> {
        let n = self.rows * self.classes;
        if self.student.len() != n || self.teacher.len() != n || grad.len() != n || row_loss.len() < self.rows
        {
            return Err(LossError::Shape(format!(
                "device buffers do not match [{} x {}]",
                self.rows, self.classes
            )));
        }
        Ok(())
    }

    /// The error for the invalid input at flat index `at`, as the kernel
    /// reported it. The value itself stays on the device: callers that hold
    /// a host copy name it (see [`CudaSoftLabel::forward_backward`]).
    fn bad_value_error(&self, at: u64) -> LossError {
        let (row, class) = ((at / self.classes as u64) as usize, (at % self.classes as u64) as usize);
        let value = f32::NAN;
        if self.teacher_is_probs {
            LossError::BadProbability { row, class, value }
        } else {
            LossError::NonFinite { what: "student or teacher input", row, class, value }
        }
    }
}

impl CudaSoftLabel {
    /// Loads the kernels on device `ordinal`; an error value when CUDA, the
    /// device or NVRTC is missing.
    pub fn new(ordinal: usize) -> Result<Self, LossError> {
        check_cuda(ordinal)?;
        let ctx = CudaContext::new(ordinal).map_err(cuda_err)?;
        let m = kernel_module(&ctx, ordinal, kernels::SOFT_LABEL)?;
        Ok(CudaSoftLabel {
            stream: ctx.default_stream(),
            block: m.load_function("soft_label_block").map_err(cuda_err)?,
            warp: m.load_function("soft_label_warp").map_err(cuda_err)?,
        })
    }

    /// The stream the kernels run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Runs the kernel on device buffers: writes the gradient of the mean
    /// loss and each row's loss, and returns the mean loss (this synchronises
    /// the stream).
    pub fn forward_backward_device(
        &self,
        p: &SoftLabelLoss,
        b: &DeviceBatch<'_>,
        grad: &mut CudaSlice<f32>,
        row_loss: &mut CudaSlice<f32>,
    ) -> Result<f32, LossError> {
        let grad_scale = 1.0 / b.rows.max(1) as f32;
        self.forward_backward_device_scaled(p, b, grad_scale, grad, row_loss)
    }

    /// As [`Self::forward_backward_device`], with the gradient of the summed
    /// loss multiplied by `grad_scale` (a data-parallel shard of a global
    /// batch of G rows passes 1/G, so the ranks' gradients sum to the
    /// gradient of the global mean).
    pub fn forward_backward_device_scaled(
        &self,
        p: &SoftLabelLoss,
        b: &DeviceBatch<'_>,
        grad_scale: f32,
        grad: &mut CudaSlice<f32>,
        row_loss: &mut CudaSlice<f32>,
    ) -> Result<f32, LossError> {
        b.check_buffers(grad, row_loss)?;
        if b.rows == 0 {
            return Ok(0.0);
        }
        let s = &self.stream;
        let mut first_bad = s.clone_htod(&[NO_BAD_VALUE]).map_err(cuda_err)?;
        self.launch(p, b, grad_scale, grad, row_loss, &mut first_bad)?;
        let first_bad = s.clone_dtoh(&first_bad).map_err(cuda_err)?[0];
        if first_bad != NO_BAD_VALUE {
            return Err(b.bad_value_error(first_bad));
        }
        let losses = s.clone_dtoh(&row_loss.slice(..b.rows)).map_err(cuda_err)?;
        Ok((losses.iter().map(|&l| l as f64).sum::<f64>() / b.rows as f64) as f32)
    }

    /// Queues the kernel for the batch's row length on the stream.
    fn launch(
        &self,
        p: &SoftLabelLoss,
        b: &DeviceBatch<'_>,
        grad_scale: f32,
        grad: &mut CudaSlice<f32>,
        row_loss: &mut CudaSlice<f32>,
        first_bad: &mut CudaSlice<u64>,
    ) -> Result<(), LossError> {
        // The kernel reads no label when `has_labels` is 0, but its argument
        // must still be a device pointer.
        let no_labels;
        let labels = match b.labels {
            Some(l) => l,
            None => {
                no_labels = self.stream.alloc_zeros::<u32>(1).map_err(cuda_err)?;
                &no_labels
            }
        };
        let (rows, classes) = (b.rows as i32, b.classes as i32);
        let (has_labels, probs) = (b.labels.is_some() as i32, b.teacher_is_probs as i32);
        let (func, cfg) = self.kernel_for(b.rows, b.classes);
        let mut launch = self.stream.launch_builder(func);
        launch
            .arg(b.student)
            .arg(b.teacher)
            .arg(labels)
            .arg(&has_labels)
            .arg(&rows)
            .arg(&classes)
            .arg(&probs)
            .arg(&p.temperature)
            .arg(&p.alpha)
            .arg(&grad_scale)
            .arg(grad)
            .arg(row_loss)
            .arg(first_bad);
        // SAFETY: the argument list matches the kernel's signature and every
        // buffer was checked against rows x classes by `check_buffers`.
        unsafe { launch.launch(cfg) }.map_err(cuda_err)?;
        Ok(())
    }

    /// The kernel for rows of `classes` classes and how to launch it on
    /// `rows` rows: a warp per row up to [`WARP_MAX_CLASSES`], a block per
    /// row beyond (of 1024 threads from 16K classes on).
    fn kernel_for(&self, rows: usize, classes: usize) -> (&CudaFunction, LaunchConfig) {
        let launch = |blocks: u32, threads: u32| LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        if classes <= WARP_MAX_CLASSES {
            let rows_per_block = BLOCK_THREADS / 32;
            (&self.warp, launch((rows as u32).div_ceil(rows_per_block), BLOCK_THREADS))
        } else {
            let threads = if classes >= 16 * 1024 { 1024 } else { BLOCK_THREADS };
            (&self.block, launch(rows as u32, threads))
        }
    }

    /// Host-memory convenience: copies the batch to the device, runs the
    /// kernel and copies the gradient back.
    pub fn forward_backward(
        &self,
        p: &SoftLabelLoss,
        b: &Batch<'_>,
        grad: &mut [f32],
    ) -> Result<f32, LossError> {
        p.validate(b, grad.len())?;
        if b.rows == 0 {
            return Ok(0.0);
        }
        let s = &self.stream;
        let student = s.clone_htod(b.student).map_err(cuda_err)?;
        let teacher = s.clone_htod(b.teacher.values()).map_err(cuda_err)?;
        let labels = match b.labels {
            Some(l) => Some(s.clone_htod(l).map_err(cuda_err)?),
            None => None,
        };
        let mut dgrad = s.alloc_zeros::<f32>(grad.len()).map_err(cuda_err)?;
        let mut row_loss = s.alloc_zeros::<f32>(b.rows).map_err(cuda_err)?;
        let db = DeviceBatch {
            student: &student,
            teacher: &teacher,
            teacher_is_probs: matches!(b.teacher, Teacher::Probs(_)),
            labels: labels.as_ref(),
            rows: b.rows,
            classes: b.classes,
        };
        let loss = match self.forward_backward_device(p, &db, &mut dgrad, &mut row_loss) {
            // Name the exact value from the host copy.
            Err(LossError::NonFinite { row, class, .. })
            | Err(LossError::BadProbability { row, class, .. }) => {
                let k = row * b.classes + class;
                let (zs, ts) = (b.student[k], b.teacher.values()[k]);
                return Err(if !zs.is_finite() {
                    LossError::NonFinite { what: "student logits", row, class, value: zs }
                } else if matches!(b.teacher, Teacher::Probs(_)) {
                    LossError::BadProbability { row, class, value: ts }
                } else {
                    LossError::NonFinite { what: "teacher logits", row, class, value: ts }
                });
            }
            other => other?,
        };
        s.memcpy_dtoh(&dgrad, grad).map_err(cuda_err)?;
        Ok(loss)
    }
}
