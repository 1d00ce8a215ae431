//! The built-in trainer: the MLP student and teacher that the main job
//! trains, on the datasets the runtime ships.
//!
//! - [`builtin`]: what the built-in workers share (data, state, checkpoints).
//! - [`clicks`]: synthetic click-through data of Criteo's shape.
//! - [`ctr`]: the click-through model: wide and deep, its embedding tables
//!   on the job's parameter servers, on Criteo-shaped synthetic data.
//! - [`data`]: the datasets (MNIST 5k, UCI digits) and the exactly-once
//!   data order (the seeded permutation and each rank's shard of it).
//! - [`gemm`]: the matrix products the model runs on.
//! - [`model`]: the MLP, its forward and backward passes, safetensors I/O.
//! - [`train`]: the losses (hard labels and soft labels) and the optimiser step.
//! - [`worker`]: the built-in worker process, one per device, that trains the
//!   student through a [`Session`](crate::worker::session::Session).

pub mod builtin;
pub mod clicks;
pub mod ctr;
pub mod data;
pub mod gemm;
pub mod model;
pub mod train;
pub mod worker;
