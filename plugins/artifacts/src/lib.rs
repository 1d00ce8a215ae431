//! Paths of the plugins built by this crate's build script: the shipped
//! plugins (also copied to `plugins/<name>.wasm`) and the adversarial test
//! plugins the runtime's test suite uses.

include!(concat!(env!("OUT_DIR"), "/gen.rs"));
