//! The runtime's integration tests: one binary, one module per concern.
//! Plugins come from `edl-plugin-artifacts`, built as part of this build.

mod cache;
mod chaos;
mod cli;
mod cluster;
mod distill;
mod elastic;
mod hardening;
mod house;
mod kubernetes;
mod lifecycle;
mod ps;
mod python;
mod relay;
mod reload;
mod sandbox;
mod scaffold;
mod sealed;
mod shipped;
mod slurm;
mod storage;
mod store;
mod store_tls;
mod support;
mod teacher_pool;
mod torch;
mod torchrun;
mod train;
mod watch;
