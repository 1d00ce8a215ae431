//! What is checked before a job starts anything: the store answers, the
//! checkpoint directory can be written, and no other coordinator runs the
//! same job. Each failure is one line naming the flag or the holder.

use super::config::JobConfig;
use crate::store::{AnyStore, Store, redact};
use anyhow::{Context, Result, bail};
use std::{
    fs::File,
    io::Write,
    path::{Path, PathBuf},
    time::Duration,
};

/// How long the store may take to answer the first request.
const STORE_PROBE: Duration = Duration::from_secs(5);

/// Checks the store and the checkpoint directory.
pub fn preflight(cfg: &JobConfig) -> Result<()> {
    check_store(&cfg.store)?;
    let dir = &cfg.spec.checkpoint_dir;
    crate::checkpoint::Checkpoints::open(dir, 1)
        .and_then(|c| c.probe())
        .with_context(|| format!("--checkpoint-dir {}", dir.display()))?;
    Ok(())
}

fn check_store(url: &str) -> Result<()> {
    let shown = redact(url);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let store = {
        let _g = rt.enter();
        AnyStore::open(url).with_context(|| format!("--store {shown}"))?
    };
    let probe = rt.block_on(async { tokio::time::timeout(STORE_PROBE, store.get("edl/probe")).await });
    match probe {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => bail!("--store {shown}: {e}"),
        Err(_) => bail!("--store {shown}: no answer within {STORE_PROBE:?}"),
    }
}

/// The one coordinator of a job on this machine: an exclusive `flock` on
/// `<checkpoint dir>/coordinator.lock`, released by the kernel when the
/// process ends however it ends (so a killed coordinator never leaves a stale
/// lock). The file names the holder for the message a second one prints.
pub struct JobLock {
    _file: File,
    path: PathBuf,
}

impl JobLock {
    /// Takes the job's lock, or says who holds it; a `standby` waits for
    /// it (the kernel releases it when the holder ends, however it ends),
    /// unless the job is `leased` in a shared store: the lease alone then
    /// says when it takes over.
    pub fn acquire(checkpoint_dir: &Path, job: &str, standby: bool, leased: bool) -> Result<JobLock> {
        std::fs::create_dir_all(checkpoint_dir)
            .with_context(|| format!("--checkpoint-dir {}", checkpoint_dir.display()))?;
        let path = checkpoint_dir.join("coordinator.lock");
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("{}", path.display()))?;
        if let Err(e) = file.try_lock() {
            let holder = std::fs::read_to_string(&path).unwrap_or_default();
            let holder = holder.trim();
            if standby && matches!(e, std::fs::TryLockError::WouldBlock) {
                println!(
                    "standby   job {job:?} is run by another coordinator ({holder}); waiting to take it over"
                );
                if leased {
                    // The job's lease in a shared store decides who leads:
                    // a holder that is frozen keeps its lock, not its lease.
                    return Ok(JobLock { _file: file, path });
                }
                file.lock().with_context(|| format!("{}", path.display()))?;
                let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
                file.set_len(0)?;
                writeln!(file, "pid {} on {}", std::process::id(), host.trim())?;
                return Ok(JobLock { _file: file, path });
            }
            bail!(
                "job {job:?} is already run by another coordinator ({}; lock {}): {}",
                if holder.is_empty() { "holder unknown" } else { holder },
                path.display(),
                match e {
                    std::fs::TryLockError::WouldBlock => "refusing to start a second one".to_string(),
                    std::fs::TryLockError::Error(e) => e.to_string(),
                }
            );
        }
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        file.set_len(0)?;
        writeln!(file, "pid {} on {}", std::process::id(), host.trim())?;
        Ok(JobLock { _file: file, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}
