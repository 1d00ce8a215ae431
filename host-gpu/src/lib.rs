//! edl-host-gpu: the two hot operations of distributed distillation, with
//! CPU and CUDA implementations side by side.
//!
//! - [`loss`]: the fused soft-label (knowledge-distillation) loss and its
//!   gradient, in one call: [`loss::SoftLabelLoss`].
//! - [`comm`]: collectives for data-parallel training: a [`comm::Communicator`]
//!   per generation of an elastic job, over a TCP ring or NCCL.
//! - [`mlp`]: an MLP trainer on one CUDA device (cuBLAS products, the loss
//!   kernel, SGD with momentum), the CUDA side of edl-runtime's trainer.
//! - [`device`]: which devices and CUDA libraries this machine has.
//! - [`kernels`]: the CUDA C sources, compiled at run time by NVRTC.
//!
//! Everything CUDA is loaded at run time: the crate builds and its CPU paths
//! run on machines with no GPU, and a missing driver, NVRTC or NCCL is an
//! error value ([`device::CudaUnavailable`]), never a panic.

pub mod comm;
pub mod device;
pub mod kernels;
pub mod loss;
pub mod mlp;
pub mod testing;

pub use device::{Device, DeviceReport};
