//! Starting and stopping workers. The coordinator asks a [`Scaler`] for
//! workers and learns they exist when they connect:
//!
//! - [`LocalProcesses`] (the default) runs them as child processes of this
//!   machine (`edl-runtime worker ...`, or the user's program under
//!   `edl-runtime launch`), each logging to its own file (a program's
//!   output is also shown, prefixed `[worker N]`) and killed by the kernel
//!   if the coordinator dies;
//! - [`CommandScaler`] runs a command the operator gives for each worker
//!   (`ssh {host} ...`, `srun ...`), on a list of hosts and slots;
//! - [`ExternalWorkers`] starts nothing: workers started by another engine
//!   (a Kubernetes Deployment, a batch system) join with the job's secret.
//!
//! A worker finds its job through the environment: `EDL_COORDINATOR`
//! (`host:port`), `EDL_WORKER_ID`, `EDL_JOB` and `EDL_JOB_SECRET` (the
//! secret it proves on every connection; never on a command line).

pub mod command;
pub mod fenced;
pub mod kube_objects;
pub mod kube_relays;
pub mod kubernetes;
pub mod local;
pub mod relay;
pub mod slurm;
pub mod slurm_client;
pub mod slurm_relays;

mod external;

pub use command::CommandScaler;
pub use external::ExternalWorkers;
pub use local::LocalProcesses;

use edl_host_gpu::comm::auth::JobAuth;
use std::{
    collections::BTreeMap,
    path::PathBuf,
    time::{Duration, Instant},
};

/// Starts and stops workers.
pub trait Scaler: Send {
    /// Starts worker `id`, which will connect to `coordinator` (`host:port`)
    /// and prove `auth`.
    fn spawn(&mut self, id: u64, coordinator: &str, auth: &JobAuth) -> anyhow::Result<()>;
    /// Asks worker `id` to stop and makes sure it is gone within `grace`.
    fn stop(&mut self, id: u64, grace: Duration);
    /// Workers whose start, accepted by [`Scaler::spawn`] and carried on
    /// off the coordinator's thread, failed since the last call, with why:
    /// as if `spawn` had refused them.
    fn failed_spawns(&mut self) -> Vec<(u64, String)> {
        Vec::new()
    }
    /// Workers that exited since the last call, with how (none, for a
    /// scaler that runs no processes of its own).
    fn exited(&mut self) -> Vec<(u64, String)> {
        Vec::new()
    }
    /// Process id of a running worker, when it has one here.
    fn pid(&self, _id: u64) -> Option<u32> {
        None
    }
    /// Where worker `id` logs, when it logs here.
    fn log_of(&self, _id: u64) -> Option<PathBuf> {
        None
    }
    /// Whether workers this scaler did not start may join the job (they
    /// still prove its secret).
    fn admits_uninvited(&self) -> bool {
        false
    }
    /// Another coordinator leads the job now: the workers are its, so they
    /// are let go, not stopped (where they can outlive this process).
    fn release(&mut self) {}
    /// Whether the workers outlive this coordinator (they are not its
    /// children), so that they can follow one that takes the job over.
    fn workers_outlive(&self) -> bool {
        true
    }
    /// How many more workers the cluster could start right now, as its
    /// scheduler reports it (None: it does not say).
    fn capacity(&mut self) -> Option<u32> {
        None
    }
    /// How the scheduler knows worker `id` (`slurm:123`), for the report
    /// and for a coordinator that takes the job over. Known from its start
    /// (or adoption) and unchanged after: the watchers' list of members is
    /// made again only when the members change.
    fn handle(&self, _id: u64) -> Option<String> {
        None
    }
    /// Worker `id`, started by the coordinator this one took the job over
    /// from, is known to the scheduler as `handle` (what [`Scaler::handle`]
    /// said there): this scaler stops it, reports it and counts its place
    /// as taken, as if it had started it, in job `job`. False where the
    /// handle is not one this scaler knows how to read.
    fn adopt(&mut self, _id: u64, _handle: &str, _job: &str) -> bool {
        false
    }
    /// The coordinator lost the connection of relay `id` (one this scaler
    /// started for its workers): its workers are lost with it.
    fn relay_lost(&mut self, _id: u64) {}
    /// The coordinator lost member `id`'s connection while its process may
    /// live on (hung, frozen: its lease lapsed): its process tree is to be
    /// killed if it is still there after `after` (by
    /// [`Scaler::kill_lingering`]), so that its sockets close and the other
    /// ranks' collectives fail then rather than at their timeout. A scaler
    /// that has no way to (workers it did not start) leaves it to the
    /// generation's failure.
    fn kill_if_lingering(&mut self, _id: u64, _after: Duration) {}
    /// Kills the process trees of such members past their time; returns
    /// their ids, each with what was done. Their exits are reported as any.
    fn kill_lingering(&mut self) -> Vec<(u64, String)> {
        Vec::new()
    }
    /// Waits for the stops under way (each bounded by its grace and a few
    /// seconds): the coordinator settles them before it lets the job's
    /// lease go, so that nothing of this one acts after another leads.
    fn settle(&mut self) {}
    /// Waits, where a start would have to, for a stop in flight that holds
    /// the place the start needs (a slot): asked before the lease is
    /// checked for the start, so that the check is the last word.
    fn make_room(&mut self) {}
    /// From now on the stops that go on after [`Scaler::stop`] returned
    /// (a stop command, a cancel after the grace) check `fence` before they
    /// act, so that a coordinator deposed meanwhile reaches no worker that
    /// may be another's by then.
    fn fence_stops(&mut self, _fence: crate::leader::keeper::LeaseFence) {}
}

/// Runs `work`, which stops worker `id`, on a thread of its own, or here
/// where no thread can be made (said in the log); the thread, if any.
pub(crate) fn stop_on_a_thread(
    id: u64,
    work: impl FnOnce() + Send + 'static,
) -> Option<std::thread::JoinHandle<()>> {
    let (give, take) = std::sync::mpsc::channel::<Box<dyn FnOnce() + Send>>();
    let thread = std::thread::Builder::new().name(format!("edl-stop-{id}")).spawn(move || {
        if let Ok(work) = take.recv() {
            work()
        }
    });
    match thread {
        Ok(t) => {
            if let Err(std::sync::mpsc::SendError(work)) = give.send(Box::new(work)) {
                work();
            }
            Some(t)
        }
        Err(e) => {
            tracing::warn!("worker {id}: no thread to stop it on ({e}); stopped on the coordinator's");
            work();
            None
        }
    }
}

/// Waits for the stops under way on `threads` (see [`stop_on_a_thread`]).
pub(crate) fn join_stops(threads: impl IntoIterator<Item = std::thread::JoinHandle<()>>) {
    for t in threads {
        let _ = t.join();
    }
}

/// Why a stop may no longer act (`fence`: the coordinator's, where it has one).
pub(crate) fn stop_fenced(fence: &Option<crate::leader::keeper::LeaseFence>) -> Option<String> {
    fence.as_ref().and_then(crate::leader::keeper::LeaseFence::fenced).map(|why| why.to_string())
}

/// Workers a scaler is to kill if they still run at a set time (see
/// [`Scaler::kill_if_lingering`]).
#[derive(Default)]
pub(crate) struct Lingering {
    /// Each worker to kill, and when.
    at: BTreeMap<u64, Instant>,
    /// Workers whose kill was tried once more already.
    retried: std::collections::BTreeSet<u64>,
}

impl Lingering {
    /// Worker `id` is to be killed if it still runs `after` from now.
    pub(crate) fn mark(&mut self, id: u64, after: Duration) {
        self.at.insert(id, Instant::now() + after);
    }

    /// Worker `id` could not be killed (its scheduler did not answer):
    /// tried once more `after` from now, not again after that.
    pub(crate) fn again(&mut self, id: u64, after: Duration) {
        if self.retried.insert(id) {
            self.mark(id, after);
        }
    }

    /// The workers whose time came, each taken once; those the scaler no
    /// longer holds (`held` says which it does) are forgotten.
    pub(crate) fn due(&mut self, held: impl Fn(u64) -> bool) -> Vec<u64> {
        let now = Instant::now();
        self.at.retain(|id, _| held(*id));
        self.retried.retain(|id| held(*id));
        let due: Vec<u64> = self.at.iter().filter(|(_, at)| **at <= now).map(|(id, _)| *id).collect();
        for id in &due {
            self.at.remove(id);
        }
        due
    }
}

/// SIGKILL to the process group of each worker of `ids` whose process
/// (`child` finds it) still runs; the workers killed, each with `how`.
pub(crate) fn kill_running_groups<'a>(
    ids: Vec<u64>,
    child: impl Fn(u64) -> Option<&'a std::process::Child>,
    how: &str,
) -> Vec<(u64, String)> {
    ids.into_iter()
        .filter_map(|id| {
            let c = child(id).filter(|c| crate::process::runs(c))?;
            crate::process::signal_group(c, libc::SIGKILL);
            Some((id, how.to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lingering_worker_is_due_once_at_its_time_and_one_gone_meanwhile_is_forgotten() {
        let mut l = Lingering::default();
        l.mark(1, Duration::ZERO);
        l.mark(2, Duration::ZERO);
        l.mark(3, Duration::from_secs(3600));
        assert_eq!(l.due(|id| id != 2), [1]);
        // Taken once; 2 was forgotten, 3 is not due.
        assert!(l.due(|_| true).is_empty());
        assert_eq!(l.at.keys().copied().collect::<Vec<_>>(), [3]);
        // Tried once more after a failure, not twice.
        l.again(1, Duration::ZERO);
        assert_eq!(l.due(|_| true), [1]);
        l.again(1, Duration::ZERO);
        assert!(l.due(|_| true).is_empty());
    }
}
