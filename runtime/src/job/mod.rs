//! What a job is before it runs: its configuration, the checks made before
//! anything starts (and the job's lock), and the teacher processes a job of
//! the built-in student starts for itself.
//!
//! - [`assembly`]: the one place a job is put together from its
//!   configuration (checks, lock, secret, teacher processes), then run.
//! - [`config`]: [`JobConfig`], how a job runs, fixed once it starts.
//! - [`spec`]: [`JobSpec`], what every worker is told about the job.
//! - [`preflight`]: the store answers, the checkpoint directory can be
//!   written, no other coordinator runs the job.
//! - [`teacher_pool`]: the teacher model (trained and cached) and the
//!   teacher processes that serve it.
//! - [`teacher_command`]: teachers started by `--teacher-command` on slots
//!   of `--teacher-hosts`, and their registrations.
//! - [`teacher_kube`]: teachers in Kubernetes Pods of their own image.
//! - [`ps_servers`]: the job's parameter servers, here, by command, or
//!   in Kubernetes Pods ([`ps_kube`]).
//!
//! The job runs in [`crate::coordinator`]; its workers in [`crate::worker`].

pub mod assembly;
pub mod config;
pub mod preflight;
pub mod ps_kube;
pub mod ps_servers;
pub mod spec;
pub mod teacher_command;
pub mod teacher_kube;
pub mod teacher_pool;

pub use assembly::{Job, JobDirs, JobPlugins, PoolStart, TeacherStart};
pub use config::JobConfig;
pub use preflight::{JobLock, preflight};
pub use spec::{BuiltinModel, JobSpec, Program, TeacherSource};

/// A job name that could mean something to a shell or a path.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum JobNameError {
    #[error("a job name cannot be empty")]
    Empty,
    #[error("job name {start:?}...: longer than {MAX_JOB_NAME} characters")]
    TooLong { start: String },
    #[error("job name {name:?}: use letters, digits, '.', '_' and '-', starting with a letter or a digit")]
    Characters { name: String },
}

/// Longest job name.
pub const MAX_JOB_NAME: usize = 64;

/// Checks a job name: letters, digits, `.`, `_` and `-`, starting with a
/// letter or a digit, at most [`MAX_JOB_NAME`] characters. A job's name
/// becomes directory names, store keys and words of worker command lines
/// (`ssh {host} {program}`): nothing in it may mean anything to a shell or
/// a path.
pub fn check_job_name(name: &str) -> Result<(), JobNameError> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if name.is_empty() {
        return Err(JobNameError::Empty);
    }
    if name.len() > MAX_JOB_NAME {
        return Err(JobNameError::TooLong { start: name.chars().take(16).collect() });
    }
    if !name.starts_with(|c: char| c.is_ascii_alphanumeric()) || !name.chars().all(ok_char) {
        return Err(JobNameError::Characters { name: name.to_string() });
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
        for bad in [
            "",
            "x;touch /tmp/p;#",
            "../up",
            ".hidden",
            "-flag",
            "a b",
            "$(id)",
            "a/b",
            "é",
            &"x".repeat(65),
            &format!("a{}", "é".repeat(40)),
        ] {
            assert!(check_job_name(bad).is_err(), "{bad:?}");
        }
    }
}
