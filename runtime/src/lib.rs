//! edl-runtime: an elastic deep-learning runtime whose algorithms (scaling
//! policies, batch adapters, reader transforms) are WebAssembly plugins.
//!
//! The tree follows the system:
//! - [`job`]: the elastic job: the coordinator (membership, generations,
//!   step commits, the data cursor), the worker's session, the scalers that
//!   start and stop workers, `launch --torchrun`.
//! - [`trainer`]: the built-in student and teacher models, their data, and
//!   the built-in worker process.
//! - [`distill`]: service-based distillation: the teacher service (KServe v2
//!   gRPC and REST) and the student's `DistillReader`.
//! - [`checkpoint`]: checkpoints in a local directory or object storage.
//! - [`state`]: a training program's state as named tensors.
//! - [`plugin`]: the plugin host (wasmtime components and native libraries),
//!   policy replay and plugin scaffolding.
//! - [`store`]: the discovery and job-state store (embedded or Redis).
//! - [`plot`]: SVG charts of runs and replays.
//!
//! The command line (`edl-runtime`, in `src/cli/`) is a thin layer over these.

pub mod checkpoint;
pub mod distill;
pub mod job;
pub mod plot;
pub mod plugin;
pub mod state;
pub mod store;
pub mod trainer;
