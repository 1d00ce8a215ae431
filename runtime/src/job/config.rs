//! How a job runs: [`JobConfig`] and the checks made before anything starts.

use crate::job::spec::JobSpec;
use anyhow::{Result, bail};
use edl_host_gpu::comm::auth::Secret;
use edl_plugin_sdk::Hyperparams;
use std::time::Duration;

/// How the job runs.
pub struct JobConfig {
    pub spec: JobSpec,
    pub min_workers: u32,
    pub max_workers: u32,
    /// Workers at the start.
    pub initial_workers: u32,
    /// Warm spares kept ready outside the ring (`--warm-spares`).
    pub warm_spares: u32,
    /// Steps between two policy decisions.
    pub decide_every: u64,
    /// Steps between two checkpoints (and one at each epoch's end).
    pub checkpoint_every: Option<u64>,
    /// Longest training time between two checkpoints.
    pub checkpoint_interval: Duration,
    /// Hyperparameters at the start (the adapter changes them).
    pub hyper: Hyperparams,
    /// The largest global batch an adapter is told it may ask for
    /// (`--batch-max`; None: 16 times the starting batch, at most the samples).
    pub batch_max: Option<u32>,
    /// `memory` or `redis://...`.
    pub store: String,
    /// Wait for the job's lease as a standby instead of refusing to start.
    pub standby: bool,
    /// Train a finished job again from step 0 (its checkpoints set aside).
    pub restart: bool,
    /// A rank that answers no step within this is declared dead.
    pub step_timeout: Duration,
    /// A started worker that does not join within this is given up.
    pub join_timeout: Duration,
    /// A coordinator whose loop does not come back to its workers within
    /// this ends (see [`crate::coordinator::watchdog`]); None: never.
    pub loop_stall: Option<Duration>,
    /// Restarts from the same checkpoint after every worker was lost to
    /// the same program error, before the job ends.
    pub max_restarts: u32,
    pub price_per_worker_hour: f64,
    /// The job's secret: every control connection, rendezvous registration
    /// and ring link proves it.
    pub secret: Secret,
    /// Where the control port and the rendezvous listen, and what workers are told.
    pub addresses: crate::net::Addresses,
}

/// A setting of the command line a job cannot run with, refused before
/// anything starts: the command exits with status 2, as for every refusal
/// of its command line.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// Returns a [`Refused`] error: a setting of the command line refused
/// before anything starts (exit status 2), written as `bail!`.
#[macro_export]
macro_rules! refuse {
    ($($arg:tt)*) => {
        return Err($crate::job::config::Refused(format!($($arg)*)).into())
    };
}

/// Refuses worker bounds no job (nor a simulation of one) can keep:
/// `--min-workers`, `--max-workers` and `--workers` at the start.
pub fn worker_bounds(min: u32, max: u32, initial: u32) -> Result<()> {
    if min == 0 || min > max {
        bail!("--min-workers {min} and --max-workers {max}: need 1 <= min <= max");
    }
    if initial > max {
        bail!("--workers {initial} is above --max-workers {max}");
    }
    if initial < min {
        bail!("--workers {initial} is below --min-workers {min}");
    }
    Ok(())
}

impl JobConfig {
    /// Refuses settings a job cannot run with, naming the flag, before
    /// anything starts.
    pub fn validate(&self) -> Result<()> {
        let h = &self.hyper;
        let train_len = self.spec.samples;
        // A program's job launched without --samples takes them from its
        // first worker (and checks the batch then).
        let from_program =
            train_len == 0 && matches!(self.spec.program, crate::job::spec::Program::External { .. });
        if train_len == 0 && !from_program {
            bail!("the job has no samples (--samples 0, or --train-samples 0)");
        }
        if train_len > crate::trainer::data::MAX_SAMPLES {
            bail!(
                "--samples {train_len}: a job holds at most {} samples (a step's positions are 32-bit)",
                crate::trainer::data::MAX_SAMPLES
            );
        }
        if self.spec.epochs == 0 {
            bail!("--epochs 0: a job trains at least one epoch");
        }
        worker_bounds(self.min_workers, self.max_workers, self.initial_workers)?;
        if self.warm_spares > 0 && self.warm_spares >= self.max_workers {
            bail!(
                "--warm-spares {} leaves no worker of --max-workers {} to train: spares count toward it",
                self.warm_spares,
                self.max_workers
            );
        }
        if h.global_batch == 0 || (!from_program && h.global_batch as usize > train_len) {
            bail!("--batch {}: need 1 <= batch <= {train_len} (the training samples)", h.global_batch);
        }
        if let Some(max) = self.batch_max.filter(|&m| m < h.global_batch) {
            bail!("--batch-max {max} is below --batch {}", h.global_batch);
        }
        if !(h.lr.is_finite() && h.lr > 0.0) {
            bail!("--lr {}: need a finite learning rate above 0", h.lr);
        }
        if !(h.momentum.is_finite() && (0.0..1.0).contains(&h.momentum)) {
            bail!("--momentum {}: need 0 <= momentum < 1", h.momentum);
        }
        let spec = &self.spec;
        if !(spec.temperature.is_finite() && spec.temperature > 0.0) {
            bail!("--temperature {}: need a finite temperature above 0", spec.temperature);
        }
        if !(spec.alpha.is_finite() && (0.0..=1.0).contains(&spec.alpha)) {
            bail!("--alpha {}: need 0 <= alpha <= 1", spec.alpha);
        }
        for (flag, v) in [
            ("--decide-every-steps", self.decide_every),
            ("--checkpoint-every-steps", self.checkpoint_every.unwrap_or(1)),
            ("--checkpoint-secs", self.checkpoint_interval.as_secs()),
            ("--keep-checkpoints", spec.keep_checkpoints as u64),
            ("--collective-timeout-ms", spec.collective_timeout_ms),
            ("--step-timeout-secs", self.step_timeout.as_secs()),
            ("--teacher-wait-secs", spec.teacher_wait_ms),
            ("--worker-lease-secs", spec.worker_lease_ms),
            ("--teacher-timeout-ms", spec.teacher_calls.request_timeout_ms),
            ("--teacher-batch", spec.teacher_calls.teacher_batch as u64),
            ("--teacher-in-flight", spec.teacher_calls.in_flight as u64),
        ] {
            if v == 0 {
                bail!("{flag} 0: need at least 1");
            }
        }
        if spec.teachers.is_some() {
            self.validate_teacher_wait()?;
        }
        Ok(())
    }

    /// For a job with teachers: a worker waiting for them must give up
    /// before the coordinator declares it dead.
    pub fn validate_teacher_wait(&self) -> Result<()> {
        let wait = self.spec.teacher_wait_ms;
        if Duration::from_millis(wait) >= self.step_timeout {
            bail!(
                "--teacher-wait-secs {} must be below --step-timeout-secs {}: a worker waiting for teachers \
                 would be declared dead first",
                wait / 1000,
                self.step_timeout.as_secs()
            );
        }
        Ok(())
    }
}
