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
//!
//! The parameters ([`SoftLabelLoss`]), the inputs ([`Batch`]) and the error
//! ([`LossError`]) each have a file that the CPU and CUDA implementations
//! build on; [`SoftLabelLoss::forward_backward`] is the CPU one.

mod batch;
mod cpu;
mod cuda;
mod error;
mod params;

pub use batch::{Batch, Teacher, check_labels};
pub use cpu::naive_three_pass;
pub use cuda::{CUDA_SOURCE, CudaSoftLabel, DeviceBatch};
pub use error::LossError;
pub use params::SoftLabelLoss;
