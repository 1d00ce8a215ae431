//! edl-runtime: an elastic deep-learning runtime whose algorithms (scaling
//! policies, batch adapters, reader transforms) are WebAssembly plugins.
//!
//! - [`plugin`]: the plugin host (wasmtime components and native libraries).
//! - [`replay`]: drives a scaling policy over a recorded trace or a simulated cluster.
//! - [`checkpoint`]: checkpoints in a local directory or object storage ([`objects`]).

pub mod checkpoint;
pub mod data;
pub mod distill;
pub mod gemm;
pub mod job;
pub mod model;
pub mod objects;
pub mod oip;
pub mod plot;
pub mod plugin;
pub mod replay;
pub mod rest;
pub mod scaffold;
pub mod state;
pub mod store;
pub mod teacher;
pub mod train;
