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

pub mod bounded;
pub mod coordinator;
pub mod inbox;
pub mod keeper;
pub mod kubernetes;
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
pub mod slurm;
pub mod teachers;
pub mod torchrun;

pub use coordinator::{JobConfig, JobOutcome, Progress, ScaleEvent, StepRecord};
pub use ledger::{EpochRecord, Ledger};
pub use preflight::{JobLock, preflight};
pub use proto::{BuiltinModel, JobSpec, Program, TeacherSource};
pub use scaler::{LocalProcesses, Scaler};

/// Longest job name.
pub const MAX_JOB_NAME: usize = 64;

/// Checks a job name: letters, digits, `.`, `_` and `-`, starting with a
/// letter or a digit, at most [`MAX_JOB_NAME`] characters. A job's name
/// becomes directory names, store keys and words of worker command lines
/// (`ssh {host} {program}`): nothing in it may mean anything to a shell or
/// a path.
pub fn check_job_name(name: &str) -> Result<(), String> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if name.is_empty() {
        return Err("a job name cannot be empty".into());
    }
    if name.len() > MAX_JOB_NAME {
        return Err(format!("job name {:?}...: longer than {MAX_JOB_NAME} characters", &name[..16]));
    }
    if !name.starts_with(|c: char| c.is_ascii_alphanumeric()) || !name.chars().all(ok_char) {
        return Err(format!(
            "job name {name:?}: use letters, digits, '.', '_' and '-', starting with a letter or a digit"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod name_tests {
    use super::check_job_name;

    #[test]
    fn job_names_mean_nothing_to_a_shell_or_a_path() {
        for ok in ["mnist", "launch", "run-2.b_3", "7"] {
            assert_eq!(check_job_name(ok), Ok(()), "{ok}");
        }
        for bad in
            ["", "x;touch /tmp/p;#", "../up", ".hidden", "-flag", "a b", "$(id)", "a/b", "é", &"x".repeat(65)]
        {
            assert!(check_job_name(bad).is_err(), "{bad:?}");
        }
    }
}
