//! The soft-label loss of knowledge distillation (Hinton, Vinyals, Dean 2015)
//! and its gradient, fused into one call.
//!
//! Per sample, with p_T = softmax(teacher / T), q_T = softmax(student / T)
//! and q_1 = softmax(student):
//!
//!   L = alpha T^2 KL(p_T || q_T) + (1 - alpha) CE(y, q_1)
//!   dL/dz_i = alpha T (q_T,i - p_T,i) + (1 - alpha) (q_1,i - y_i)
//!
//! averaged over the batch. Without hard labels the CE term is left out.
//! The teacher gives logits, or probabilities (at T = 1; p_T is then
//! proportional to p^(1/T)), as OIP teachers may send either.

mod cpu;
mod cuda;

pub use cpu::naive_three_pass;
pub use cuda::{CUDA_SOURCE, CudaSoftLabel, DeviceBatch};

/// What the teacher sent for each sample.
#[derive(Clone, Copy, Debug)]
pub enum Teacher<'a> {
    /// Unnormalised log-probabilities, `[B, C]` row-major.
    Logits(&'a [f32]),
    /// Probabilities at temperature 1, `[B, C]`; each row sums to 1.
    Probs(&'a [f32]),
}

impl<'a> Teacher<'a> {
    pub fn values(&self) -> &'a [f32] {
        match self {
            Teacher::Logits(v) | Teacher::Probs(v) => v,
        }
    }
}

/// One batch of inputs to the loss.
#[derive(Clone, Copy, Debug)]
pub struct Batch<'a> {
    /// Student logits, `[rows, classes]` row-major.
    pub student: &'a [f32],
    pub teacher: Teacher<'a>,
    /// Hard labels, one per row, if any.
    pub labels: Option<&'a [u32]>,
    pub rows: usize,
    pub classes: usize,
}

/// Why the loss could not be computed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum LossError {
    #[error("shape mismatch: {0}")]
    Shape(String),
    #[error("invalid parameter: {0}")]
    Parameter(String),
    #[error("{what} has a non-finite value ({value}) at row {row}, class {class}")]
    NonFinite { what: &'static str, row: usize, class: usize, value: f32 },
    #[error("teacher probability {value} at row {row}, class {class} is outside [0, 1]")]
    BadProbability { row: usize, class: usize, value: f32 },
    #[error("label {label} at row {row} is not below the class count {classes}")]
    BadLabel { row: usize, label: u32, classes: usize },
    #[error(transparent)]
    CudaUnavailable(#[from] crate::device::CudaUnavailable),
    #[error("CUDA: {0}")]
    Cuda(String),
}

/// Checks that every label is below `classes`.
pub fn check_labels(labels: &[u32], classes: usize) -> Result<(), LossError> {
    match labels.iter().enumerate().find(|(_, l)| **l as usize >= classes) {
        Some((row, &label)) => Err(LossError::BadLabel { row, label, classes }),
        None => Ok(()),
    }
}

/// The loss's parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SoftLabelLoss {
    /// Softmax temperature T (> 0).
    pub temperature: f32,
    /// Weight of the distillation term; 1 - alpha weighs the hard-label term.
    pub alpha: f32,
}

impl Default for SoftLabelLoss {
    fn default() -> Self {
        SoftLabelLoss { temperature: 4.0, alpha: 0.9 }
    }
}

impl SoftLabelLoss {
    /// Checks the temperature and alpha.
    pub fn check_params(&self) -> Result<(), LossError> {
        let t = self.temperature;
        if !(t.is_finite() && t > 0.0) {
            return Err(LossError::Parameter(format!("temperature must be positive and finite, got {t}")));
        }
        if !(0.0..=1.0).contains(&self.alpha) {
            return Err(LossError::Parameter(format!("alpha must be in [0, 1], got {}", self.alpha)));
        }
        Ok(())
    }

    /// Checks the parameters and the shapes of a batch and of the gradient buffer.
    pub fn validate(&self, batch: &Batch<'_>, grad_len: usize) -> Result<(), LossError> {
        self.check_params()?;
        let n = batch
            .rows
            .checked_mul(batch.classes)
            .ok_or_else(|| LossError::Shape("rows x classes overflows".into()))?;
        if batch.classes == 0 && batch.rows > 0 {
            return Err(LossError::Shape("zero classes".into()));
        }
        let check = |what: &str, len: usize| {
            if len == n {
                Ok(())
            } else {
                Err(LossError::Shape(format!(
                    "{what} has {len} values, [{} x {}] needs {n}",
                    batch.rows, batch.classes
                )))
            }
        };
        check("student logits", batch.student.len())?;
        check("teacher output", batch.teacher.values().len())?;
        check("gradient buffer", grad_len)?;
        if let Some(labels) = batch.labels {
            if labels.len() != batch.rows {
                return Err(LossError::Shape(format!("{} labels for {} rows", labels.len(), batch.rows)));
            }
            check_labels(labels, batch.classes)?;
        }
        Ok(())
    }

    /// Mean loss over the batch, and its gradient with respect to the student
    /// logits written to `grad` (`[rows, classes]`), on the CPU: rows spread
    /// over threads, no allocation. Rows of up to 1024 classes keep their
    /// exponentials in stack buffers between the statistics and the gradient
    /// (three per element, and at ten classes a few lanes per row); longer
    /// rows take a streaming pass (online softmax) and a gradient pass.
    pub fn forward_backward(&self, batch: &Batch<'_>, grad: &mut [f32]) -> Result<f32, LossError> {
        self.validate(batch, grad.len())?;
        cpu::fused(self, batch, grad)
    }
}
