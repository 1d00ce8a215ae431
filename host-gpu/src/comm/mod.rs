//! Collectives for data-parallel training.
//!
//! A [`Communicator`] is made for one *generation* of an elastic job: a fixed
//! set of ranks that found each other through a [`Rendezvous`]. When a worker
//! joins or leaves, the job makes a new generation and new communicators.
//! Every operation is bounded by a timeout: a rank that dies or stalls makes
//! every other rank's operation fail within it (never a hang), and a failed
//! communicator refuses further use; nothing is reported as success unless
//! every rank's data went into it.

pub mod accept;
pub mod auth;
pub mod kv;
pub mod listen;
mod nccl;
mod rendezvous;
mod ring;
pub mod sealed;

pub use kv::{KvClient, KvStore};
pub use nccl::NcclCommunicator;
pub use rendezvous::{LocalRendezvous, Rendezvous, RendezvousServer, TcpRendezvous};
pub use ring::{RingOptions, TcpRing};

use std::time::Duration;

/// How values are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Average,
}

/// Why a collective failed.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error("rank {rank}: {op} timed out: no progress with rank {peer} for {after:?}")]
    Timeout { rank: usize, op: &'static str, peer: usize, after: Duration },
    #[error("rank {rank}: {op}: rank {peer} closed the connection (dead or failed)")]
    PeerClosed { rank: usize, op: &'static str, peer: usize },
    #[error("rank {rank}: {op}: i/o with rank {peer}: {source}")]
    Io { rank: usize, op: &'static str, peer: usize, source: std::io::Error },
    #[error("rank {rank}: this communicator failed earlier ({why}); make a new generation")]
    Broken { rank: usize, why: String },
    #[error("rendezvous: {0}")]
    Rendezvous(String),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error(transparent)]
    CudaUnavailable(#[from] crate::device::CudaUnavailable),
    #[error("NCCL: {0}")]
    Nccl(String),
}

/// Collectives among the ranks of one generation. Every rank calls the same
/// operations in the same order with buffers of the same length.
pub trait Communicator: Send {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;

    /// Combines `buf` across ranks, in place; every rank ends with the result.
    fn all_reduce(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError>;

    /// Copies `root`'s `buf` into every rank's `buf`.
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError>;

    /// Returns once every rank has called it.
    fn barrier(&mut self) -> Result<(), CommError> {
        let mut token = [0f32];
        self.all_reduce(&mut token, ReduceOp::Sum)
    }
}
