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
        let n = b.rows * b.classes;
        if b.student.len() != n || b.teacher.len() != n || grad.len() != n || row_loss.len() < b.rows {
            return Err(LossError::Shape(format!(
                "device buffers do not match [{} x {}]",
                b.rows, b.classes
            )));
        }
        if b.rows == 0 {
            return Ok(0.0);
        }
        let s = &self.stream;
        let mut bad = s.clone_htod(&[u64::MAX]).map_err(cuda_err)?;
        let dummy;
        let labels = match b.labels {
            Some(l) => l,
            None => {
                dummy = s.alloc_zeros::<u32>(1).map_err(cuda_err)?;
                &dummy
            }
        };
        let (rows, classes) = (b.rows as i32, b.classes as i32);
        let (has_labels, probs) = (b.labels.is_some() as i32, b.teacher_is_probs as i32);
        let warp_mode = b.classes <= WARP_MAX_CLASSES;
        let (func, cfg) = if warp_mode {
            let rows_per_block = BLOCK_THREADS / 32;
            let blocks = (b.rows as u32).div_ceil(rows_per_block);
            (
                &self.warp,
                LaunchConfig {
                    grid_dim: (blocks, 1, 1),
                    block_dim: (BLOCK_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                },
            )
        } else {
            let threads = if b.classes >= 16 * 1024 { 1024 } else { BLOCK_THREADS };
            (
                &self.block,
                LaunchConfig {
                    grid_dim: (b.rows as u32, 1, 1),
                    block_dim: (threads, 1, 1),
                    shared_mem_bytes: 0,
                },
            )
        };
        let mut launch = s.launch_builder(func);
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
            .arg(&mut *row_loss)
            .arg(&mut bad);
        // SAFETY: the argument list matches the kernel's signature and every
        // buffer was checked against rows x classes above.
        unsafe { launch.launch(cfg) }.map_err(cuda_err)?;
        let bad = s.clone_dtoh(&bad).map_err(cuda_err)?[0];
        if bad != u64::MAX {
            let (row, class) = ((bad / b.classes as u64) as usize, (bad % b.classes as u64) as usize);
            let value = f32::NAN;
            return Err(if b.teacher_is_probs {
                LossError::BadProbability { row, class, value }
            } else {
                LossError::NonFinite { what: "student or teacher input", row, class, value }
            });
        }
        let losses = s.clone_dtoh(&row_loss.slice(..b.rows)).map_err(cuda_err)?;
        Ok((losses.iter().map(|&l| l as f64).sum::<f64>() / b.rows as f64) as f32)
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
