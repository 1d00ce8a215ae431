//! [`ExternalWorkers`]: workers another engine starts.

use super::Scaler;
use edl_host_gpu::comm::auth::JobAuth;
use std::time::Duration;

/// Starts nothing: workers are started by another engine and join with
/// `edl-runtime worker --coordinator HOST:PORT` and the job's secret. A
/// worker the policy asks for is awaited (up to the join timeout); one that
/// comes uninvited is admitted at the next boundary, within the maximum.
#[derive(Default)]
pub struct ExternalWorkers;

impl Scaler for ExternalWorkers {
    fn spawn(&mut self, id: u64, coordinator: &str, _auth: &JobAuth) -> anyhow::Result<()> {
        tracing::info!("worker {id}: waiting for a worker to join at {coordinator}");
        Ok(())
    }

    fn stop(&mut self, _id: u64, _grace: Duration) {
        // Told to stop on its control connection; its engine decides what next.
    }

    fn admits_uninvited(&self) -> bool {
        true
    }
}
