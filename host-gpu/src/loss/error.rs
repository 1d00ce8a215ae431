//! Why the loss could not be computed.

use crate::device::{CudaUnavailable, KernelError};

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
    CudaUnavailable(#[from] CudaUnavailable),
    /// The loss kernels did not compile or load.
    #[error("CUDA: {0}")]
    Kernel(#[from] KernelError),
    #[error("CUDA: {0}")]
    Cuda(String),
}
