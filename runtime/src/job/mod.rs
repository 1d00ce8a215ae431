//! The elastic training job: a coordinator process that owns membership,
//! generations and the data cursor and runs the plugins; worker processes
//! that train; teachers that serve soft labels.
//!
//! - [`coordinator`]: the job server and its step protocol.
//! - [`session`]: the worker's side of the protocol, for any training program.
//! - the built-in worker (the MLP student) lives in [`crate::trainer::worker`].
//! - [`inbox`]: the control connections: one thread accepts, one reads them all.
//! - [`scaler`]: how workers are started and stopped: here, by a command, or by another engine.
//! - [`net`]: where the listeners bind and the addresses other hosts are told.
//! - [`phase`]: the job's phase (training, the final checkpoint) and when failures end it.
//! - [`pipeline`]: the step barrier of a generation: windows ahead, commits, failures.
//! - [`ledger`]: exactly-once accounting of training samples.
//! - [`teachers`]: the teacher model (trained and cached) and teacher processes.
//! - [`report`]: the run report and its plot.
//! - [`keeper`]: the job's state and worker leases in the store, off the step's path.
//! - [`preflight`]: checks before anything starts, and the job's lock.
//! - [`torchrun`]: `launch --torchrun`, unmodified torchrun scripts restarted as a group.

pub mod coordinator;
pub mod inbox;
pub mod keeper;
pub mod ledger;
pub mod membership;
pub mod net;
pub mod phase;
pub mod pipeline;
pub mod preflight;
pub mod proto;
pub mod report;
pub mod scaler;
pub mod session;
pub mod teachers;
pub mod torchrun;

pub use coordinator::{JobConfig, JobOutcome, Progress, ScaleEvent, StepRecord};
pub use ledger::{EpochRecord, Ledger};
pub use preflight::{JobLock, preflight};
pub use proto::{BuiltinModel, JobSpec, Program, TeacherSource};
pub use scaler::{LocalProcesses, Scaler};
