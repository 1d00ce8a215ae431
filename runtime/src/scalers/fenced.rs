//! A scaler that acts only while its coordinator holds the job's lease:
//! every start, stop and adoption checks the lease just before it runs, so
//! a coordinator that was frozen (or suspended) past its lease and woke
//! after a standby took the job over starts and stops nothing, whatever it
//! was in the middle of. What it reads (exits, logs, handles) and letting
//! its workers go to the new leader stay open to it.

use super::Scaler;
use crate::leader::keeper::LeaseFence;
use edl_host_gpu::comm::auth::JobAuth;
use std::{path::PathBuf, time::Duration};

/// A [`Scaler`] behind the coordinator's lease (none until it holds one).
pub struct FencedScaler {
    inner: Box<dyn Scaler>,
    fence: Option<LeaseFence>,
}

impl FencedScaler {
    pub fn new(inner: Box<dyn Scaler>) -> Self {
        FencedScaler { inner, fence: None }
    }

    /// From now on every action checks `fence` first.
    pub fn guard(&mut self, fence: LeaseFence) {
        self.inner.fence_stops(fence.clone());
        self.fence = Some(fence);
    }

    /// Why the coordinator may no longer act, if so.
    fn fenced(&self) -> Option<crate::leader::keeper::Fenced> {
        self.fence.as_ref().and_then(LeaseFence::fenced)
    }
}

impl Scaler for FencedScaler {
    fn spawn(&mut self, id: u64, coordinator: &str, auth: &JobAuth) -> anyhow::Result<()> {
        self.inner.make_room();
        if let Some(why) = self.fenced() {
            anyhow::bail!("worker {id} not started: {why}");
        }
        self.inner.spawn(id, coordinator, auth)
    }

    fn stop(&mut self, id: u64, grace: Duration) {
        match self.fenced() {
            Some(why) => tracing::warn!("worker {id} not stopped: {why}"),
            None => self.inner.stop(id, grace),
        }
    }

    fn exited(&mut self) -> Vec<(u64, String)> {
        self.inner.exited()
    }

    fn failed_spawns(&mut self) -> Vec<(u64, String)> {
        self.inner.failed_spawns()
    }

    fn pid(&self, id: u64) -> Option<u32> {
        self.inner.pid(id)
    }

    fn log_of(&self, id: u64) -> Option<PathBuf> {
        self.inner.log_of(id)
    }

    fn admits_uninvited(&self) -> bool {
        self.inner.admits_uninvited()
    }

    fn release(&mut self) {
        self.inner.release()
    }

    fn workers_outlive(&self) -> bool {
        self.inner.workers_outlive()
    }

    fn capacity(&mut self) -> Option<u32> {
        self.inner.capacity()
    }

    fn handle(&self, id: u64) -> Option<String> {
        self.inner.handle(id)
    }

    fn relay_lost(&mut self, id: u64) {
        self.inner.relay_lost(id)
    }

    fn kill_if_lingering(&mut self, id: u64, after: Duration) {
        match self.fenced() {
            Some(why) => tracing::warn!("worker {id} not killed: {why}"),
            None => self.inner.kill_if_lingering(id, after),
        }
    }

    fn kill_lingering(&mut self) -> Vec<(u64, String)> {
        match self.fenced() {
            Some(why) => {
                tracing::warn!("no lingering worker killed: {why}");
                Vec::new()
            }
            None => self.inner.kill_lingering(),
        }
    }

    fn settle(&mut self) {
        self.inner.settle()
    }

    fn make_room(&mut self) {
        self.inner.make_room()
    }

    fn fence_stops(&mut self, fence: LeaseFence) {
        self.inner.fence_stops(fence)
    }

    fn adopt(&mut self, id: u64, handle: &str, job: &str) -> bool {
        if let Some(why) = self.fenced() {
            tracing::warn!("worker {id} ({handle}) not adopted: {why}");
            return false;
        }
        self.inner.adopt(id, handle, job)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::BootInstant;
    use std::sync::{Arc, Mutex};

    /// Records what it was asked to do.
    #[derive(Clone, Default)]
    struct Calls(Arc<Mutex<Vec<String>>>);

    impl Scaler for Calls {
        fn spawn(&mut self, id: u64, _: &str, _: &JobAuth) -> anyhow::Result<()> {
            self.0.lock().unwrap().push(format!("spawn {id}"));
            Ok(())
        }
        fn stop(&mut self, id: u64, _: Duration) {
            self.0.lock().unwrap().push(format!("stop {id}"));
        }
        fn adopt(&mut self, id: u64, _: &str, _: &str) -> bool {
            self.0.lock().unwrap().push(format!("adopt {id}"));
            true
        }
        fn release(&mut self) {
            self.0.lock().unwrap().push("release".into());
        }
    }

    #[test]
    fn a_coordinator_whose_lease_lapsed_starts_stops_and_adopts_nothing_and_may_let_go() {
        let calls = Calls::default();
        let auth = JobAuth { job: "j".into(), secret: edl_host_gpu::comm::auth::Secret::generate().unwrap() };
        let mut s = FencedScaler::new(Box::new(calls.clone()));
        // Before the lease is held (nothing to check yet), and while it holds.
        s.spawn(1, "c:1", &auth).unwrap();
        s.guard(LeaseFence::confirmed_at(BootInstant::now(), Duration::from_secs(3600)));
        s.stop(1, Duration::ZERO);
        assert!(s.adopt(2, "slot:h/0", "j"));
        // Confirmed longer ago than its term: over, by the boot clock.
        let lapsed = BootInstant::now().earlier(Duration::from_secs(10));
        s.guard(LeaseFence::confirmed_at(lapsed, Duration::from_secs(5)));
        let e = s.spawn(3, "c:1", &auth).unwrap_err();
        assert!(e.to_string().starts_with("worker 3 not started: fenced"), "{e}");
        s.stop(1, Duration::ZERO);
        assert!(!s.adopt(4, "slot:h/1", "j"));
        s.release();
        assert_eq!(*calls.0.lock().unwrap(), ["spawn 1", "stop 1", "adopt 2", "release"]);
    }
}
