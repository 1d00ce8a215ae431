//! The elastic training job: a coordinator process that owns membership,
//! generations and the data cursor and runs the plugins; worker processes
//! that train; teachers that serve soft labels.
//!
//! - [`coordinator`]: the job server and its step protocol.
//! - [`worker`]: one training process per device.
//! - [`scaler`]: how workers are started and stopped.
//! - [`ledger`]: exactly-once accounting of training samples.
//! - [`teachers`]: the teacher model (trained and cached) and teacher processes.
//! - [`report`]: the run report and its plot.

pub mod coordinator;
pub mod ledger;
pub mod proto;
pub mod report;
pub mod scaler;
pub mod teachers;
pub mod worker;

pub use coordinator::{JobConfig, JobOutcome, Progress, ScaleEvent, StepRecord};
pub use ledger::{EpochRecord, Ledger};
pub use proto::{JobSpec, TeacherSource};
pub use scaler::{LocalProcesses, Scaler};
