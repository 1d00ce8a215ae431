//! edl-host-gpu: the two hot operations of distributed distillation, the
//! fused soft-label loss and the gradient all-reduce, with CPU and CUDA
//! implementations side by side.
//!
//! This crate is empty so far: the workspace reserves its place in the layout.
