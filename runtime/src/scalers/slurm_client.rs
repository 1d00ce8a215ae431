//! What the Slurm scalers ask of Slurm: where and how jobs are submitted,
//! its commands run with a bound, batch scripts that carry the job's
//! secret in their environment only.

use crate::worker::session::JobAuth;
use anyhow::{Result, anyhow, bail};
use std::{process::Command, time::Duration};

/// Where and how the workers are submitted.
#[derive(Clone, Debug, Default)]
pub struct SlurmOptions {
    pub partition: Option<String>,
    pub account: Option<String>,
    pub qos: Option<String>,
    /// More `sbatch` options, passed as they are (`--time=1:00:00`, `--gres=gpu:1`).
    pub extra: Vec<String>,
    /// A worker Slurm has not started after this long is cancelled and reported.
    pub pending_bound: Duration,
}

impl SlurmOptions {
    /// The partition, account and QOS options (not the extra ones).
    pub(crate) fn placement(&self) -> Vec<String> {
        [("partition", &self.partition), ("account", &self.account), ("qos", &self.qos)]
            .into_iter()
            .filter_map(|(flag, v)| v.as_ref().map(|v| format!("--{flag}={v}")))
            .collect()
    }
}

/// How long a Slurm client may take to answer: a controller that stopped
/// answering costs the job this, not a stall.
const CLIENT_BOUND: Duration = Duration::from_secs(10);

/// Runs a Slurm command; its standard output, or an error naming it.
pub(crate) fn run(program: &str, args: &[&str]) -> Result<String> {
    let mut cmd = Command::new(program);
    cmd.args(args);
    let out = crate::process::output(program, &mut cmd, b"", CLIENT_BOUND)
        .map_err(|e| anyhow!("{e:#} (is Slurm's client installed and its controller up?)"))?;
    if !out.status.success() {
        bail!("{program} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Submits a batch job (`sbatch args`, `script` on its standard input);
/// its Slurm job id. `--export=ALL` hands the job this environment, and
/// Slurm keeps a job's environment: the store's URL (its password) stays
/// out of it, and the secret goes only in the script.
pub(crate) fn submit(args: &[String], script: &str) -> Result<String> {
    let mut cmd = Command::new("sbatch");
    cmd.args(args).env_remove("EDL_STORE").env_remove("EDL_JOB_SECRET");
    let out = crate::process::output("sbatch", &mut cmd, script.as_bytes(), CLIENT_BOUND)
        .map_err(|e| anyhow!("{e:#} (is Slurm's client installed and its controller up?)"))?;
    if !out.status.success() {
        bail!("sbatch {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let slurm = text.trim().split(';').next().unwrap_or("").to_string();
    if slurm.is_empty() || !slurm.chars().all(|c| c.is_ascii_digit()) {
        return Err(anyhow!("sbatch answered {text:?}, not a job id"));
    }
    Ok(slurm)
}

/// A batch script: the job's secret and name in its environment (never on
/// a command line), `lines`, then `command` exec'd (so that Slurm's
/// signals reach it).
pub(crate) fn batch_script(auth: &JobAuth, lines: &str, command: &str) -> String {
    format!(
        "#!/bin/sh\nexport EDL_JOB_SECRET={}\nexport EDL_JOB={}\n{lines}exec {command}\n",
        auth.secret.to_hex(),
        quote(&auth.job)
    )
}

/// One word for `sh`, single-quoted.
pub(crate) fn quote(w: &str) -> String {
    format!("'{}'", w.replace('\'', r"'\''"))
}
