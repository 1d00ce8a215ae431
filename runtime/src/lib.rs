//! edl-runtime: an elastic deep-learning runtime whose algorithms (scaling
//! policies, batch adapters, reader transforms) are WebAssembly plugins.
//!
//! The tree follows the system:
//! - [`job`]: what a job is before it runs: its configuration, the checks
//!   before it starts, the teacher processes it starts for itself.
//! - [`coordinator`]: the job server, a thin shell of sockets, store and
//!   processes around [`coordinator::machine`], its decisions without I/O.
//! - [`leader`]: the job's lease and the record every party reads.
//! - [`control`]: the control channel between coordinator and workers.
//! - [`worker`]: the worker's side of the protocol, for any program.
//! - [`scalers`]: how workers are started and stopped: here, by a command,
//!   as Slurm batch jobs or Kubernetes Pods.
//! - [`torchrun`]: `launch --torchrun`, unmodified scripts as a group.
//! - [`trainer`]: the built-in student and teacher models, their data, and
//!   the built-in worker process.
//! - [`distill`]: service-based distillation: the teacher service (KServe v2
//!   gRPC and REST) and the student's `DistillReader`.
//! - [`checkpoint`]: checkpoints in a local directory or object storage.
//! - [`state`]: a training program's state as named tensors.
//! - [`ps`]: parameter servers for sparse models: sharded tables, per-row
//!   optimisers on the servers, a step's pushes applied exactly once.
//! - [`plugin`]: the plugin host (wasmtime components and native libraries),
//!   policy replay and plugin scaffolding.
//! - [`store`]: the discovery and job-state store (embedded, Redis, etcd).
//! - [`net`] and [`process`]: where listeners bind, and other programs run
//!   within a bound.
//! - [`plot`]: SVG charts of runs and replays.
//!
//! The command line (`edl-runtime`, in `src/cli/`) is a thin layer over these.

pub mod checkpoint;
pub mod clock;
pub mod control;
pub mod coordinator;
pub mod distill;
pub mod job;
pub mod leader;
pub mod net;
pub mod observe;
pub mod plot;
pub mod plugin;
pub mod process;
pub mod ps;
pub mod scalers;
pub mod state;
pub mod store;
pub mod torchrun;
pub mod trainer;
pub mod worker;

/// An error and its causes on one line: a cause whose text the line
/// already holds (an error that says its source in its own message) is not
/// said again.
pub fn error_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if text.is_empty() || line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_line_says_each_cause_once() {
        let io = || std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory");
        // A cause said in its error's own message, and again as its source.
        #[derive(Debug, thiserror::Error)]
        #[error("m.bin: cannot read: {source}")]
        struct Read {
            source: std::io::Error,
        }
        let e = anyhow::Error::new(Read { source: io() }).context("loading the model");
        assert_eq!(error_line(&e), "loading the model: m.bin: cannot read: No such file or directory");
        // Causes not said before are all said, in order.
        let e = anyhow::Error::new(io()).context("m.bin").context("loading the model");
        assert_eq!(error_line(&e), "loading the model: m.bin: No such file or directory");
    }
}
