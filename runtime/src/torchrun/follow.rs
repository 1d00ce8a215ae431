//! A `launch --torchrun` group across hosts that outlives its launcher.
//!
//! With a shared store the launcher holds the job's lease as the main
//! coordinator does ([`take_lease`], renewed and fenced by the
//! [`StoreKeeper`]) and writes, whenever a group forms, what a successor
//! needs to carry that group on ([`GroupHandover`]): the group, its agents
//! in group-rank order, the c10d store's address, and itself as leader. An
//! agent that loses its launcher keeps its ranks and looks in the store
//! for a leader with a higher lease token ([`Lookup`]); a launcher that
//! took the job over (`--standby`) keeps the group when all its agents
//! came back, restarts it on those that did, or starts afresh ([`adopt`]).

use crate::job::spec::Leader;
use crate::leader::keeper::{Fenced, LeaseFence, StoreKeeper, take_lease};
use crate::leader::record::{GroupHandover, JobState};
use crate::leader::seal::RecordKey;
use crate::store::{AnyStore, Store, keys, redact};
use anyhow::{Context, Result};
use edl_host_gpu::comm::auth::Secret;
use std::{collections::BTreeSet, time::Duration};

/// What a launcher that took the job over does with the group it found.
#[derive(Debug, PartialEq)]
pub enum Adopt {
    /// Every agent of the group came back: it runs on untouched.
    Keep,
    /// Some did: the group restarts on them (a change of membership).
    Restart { on: Vec<u64>, missing: Vec<u64> },
    /// None did: the job starts afresh.
    Afresh,
}

/// Decides [`Adopt`] from the group's agents and those that came back
/// running it (in the group's order, whatever order they came back in).
pub fn adopt(group: &[u64], back: &BTreeSet<u64>) -> Adopt {
    let on: Vec<u64> = group.iter().copied().filter(|a| back.contains(a)).collect();
    let missing: Vec<u64> = group.iter().copied().filter(|a| !back.contains(a)).collect();
    match (on.is_empty(), missing.is_empty()) {
        (true, _) => Adopt::Afresh,
        (false, true) => Adopt::Keep,
        (false, false) => Adopt::Restart { on, missing },
    }
}

/// The leader an agent that follows the one of token `current` goes over
/// to: only one with a higher token (a launcher that took the job over
/// after it), never back to a lower one.
pub fn newer(current: u64, found: Option<Leader>) -> Option<Leader> {
    found.filter(|l| l.token > current)
}

/// What the store says of the job, as an agent reads it.
#[derive(Debug, PartialEq)]
pub enum Found {
    /// A launcher with a higher token than the one followed leads it.
    Leader(Leader),
    /// The job is over.
    Finished,
    Nothing,
}

/// An agent's reader of the job's record in the store.
pub struct Lookup {
    rt: tokio::runtime::Runtime,
    store: AnyStore,
    url: String,
    key: String,
    /// Opens the job's record (written with the job's secret).
    seal: RecordKey,
}

impl Lookup {
    pub fn open(url: &str, job: &str, secret: &Secret) -> Result<Lookup> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let store = {
            let _g = rt.enter();
            AnyStore::open(url).with_context(|| format!("the job's store {}", redact(url)))?
        };
        let seal = RecordKey::job_records(secret);
        Ok(Lookup { rt, store, url: url.into(), key: keys::job_state(job), seal })
    }

    /// Who leads the job, when it is a launcher newer than token `current`
    /// (each read bounded: a store that does not answer is "nothing yet").
    pub fn look(&self, current: u64) -> Result<Found, LookupError> {
        let store = redact(&self.url);
        let got = self
            .rt
            .block_on(async { tokio::time::timeout(Duration::from_secs(2), self.store.get(&self.key)).await })
            .map_err(|_| LookupError::NoAnswer { store: store.clone() })?
            .map_err(|cause| LookupError::Store { store: store.clone(), cause })?;
        let Some(entry) = got else { return Ok(Found::Nothing) };
        let s = JobState::open(&self.key, &entry.value, &self.seal)
            .map_err(|cause| LookupError::Unreadable { store, cause })?;
        // (A finished mark of an earlier launcher's is left over, or replayed.)
        if s.finished && s.fence >= current {
            return Ok(Found::Finished);
        }
        Ok(newer(current, s.torchrun.map(|g| g.leader)).map_or(Found::Nothing, Found::Leader))
    }
}

/// Why [`Lookup::look`] could not read the job's record (`store`: its
/// address as shown, without a password).
#[derive(Debug, thiserror::Error)]
pub enum LookupError {
    #[error("the job's store {store} did not answer within 2 s")]
    NoAnswer { store: String },
    #[error("the job's store {store}: {cause}")]
    Store { store: String, cause: crate::store::StoreError },
    #[error("the job's state in {store} is ignored: {cause}")]
    Unreadable { store: String, cause: String },
}

/// The launcher's hold on the job in a shared store.
pub struct Hold {
    keeper: StoreKeeper,
    /// Its lease token: agents follow only a launcher with a higher one.
    pub token: u64,
    /// The group the store names, when a launcher led the job before and
    /// did not finish it.
    pub found: Option<GroupHandover>,
    /// The job finished under a launcher before.
    pub finished: bool,
    /// The job failed under a launcher before, and why.
    pub failed: Option<String>,
}

impl Hold {
    /// Takes the job's lease in the store at `url` (a `standby` waits
    /// until it is free) and reads where an earlier launcher left the job.
    pub fn take(url: &str, job: &str, standby: bool, secret: &Secret) -> Result<Hold> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let store = {
            let _g = rt.enter();
            AnyStore::open(url).with_context(|| format!("--store {}", redact(url)))?
        };
        let ttl = crate::coordinator::LEASE_TTL;
        let seal = RecordKey::job_records(secret);
        let lease = rt.block_on(take_lease(&store, job, ttl, standby, &seal))?;
        let key = keys::job_state(job);
        let entry = rt
            .block_on(async { tokio::time::timeout(Duration::from_secs(10), store.get(&key)).await })
            .map_err(|_| anyhow::anyhow!("the store {} did not answer within 10 s", redact(url)))?
            .with_context(|| format!("reading job {job:?}'s state"))?;
        let state_token = entry.as_ref().map(|e| e.token);
        let before = match entry.map(|e| JobState::open(&key, &e.value, &seal)) {
            Some(Ok(s)) => s,
            Some(Err(why)) => {
                tracing::warn!("the job's state in the store is ignored: {why}");
                JobState::default()
            }
            None => JobState::default(),
        };
        let found = before.torchrun.filter(|_| !before.finished && before.failed.is_none());
        let token = lease.token();
        let keeper = StoreKeeper::start(url, key, state_token, Some(lease), seal)?;
        Ok(Hold { keeper, token, found, finished: before.finished, failed: before.failed })
    }

    /// A job that starts again from the beginning is neither finished nor
    /// failed in the store from here on.
    pub fn started_afresh(&self) {
        self.keeper.state(JobState { fence: self.token, ..JobState::default() });
    }

    /// Records the group that formed (it names this launcher as leader).
    pub fn formed(&self, g: GroupHandover) {
        self.keeper.state(JobState {
            generation: u64::from(g.group) + 1,
            members: g.agents.clone(),
            torchrun: Some(g),
            fence: self.token,
            ..JobState::default()
        });
    }

    /// Why this launcher may no longer act, if so: another took the job.
    pub fn fenced(&self) -> Option<Fenced> {
        self.keeper.fenced()
    }

    /// The same answer, for the launcher's other threads.
    pub fn fence(&self) -> LeaseFence {
        self.keeper.fence()
    }

    /// The launcher stops without ending the job: its lease is given up.
    pub fn release(&self) {
        self.keeper.release();
        if let Err(e) = self.keeper.flush(Duration::from_secs(5)) {
            tracing::warn!("giving the job's lease up: {e}");
        }
    }

    /// The job ended (`failed`: with no restart left, and why): the store
    /// says so (agents looking stop looking) and the lease is given up.
    pub fn finish(&self, failed: Option<String>) {
        self.keeper.state(JobState {
            finished: failed.is_none(),
            failed,
            fence: self.token,
            ..JobState::default()
        });
        self.keeper.release();
        if let Err(e) = self.keeper.flush(Duration::from_secs(10)) {
            tracing::warn!("the job's end in the store: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leader(token: u64) -> Leader {
        Leader { addr: "10.0.0.2:7070".into(), token }
    }

    #[test]
    fn a_launcher_that_took_over_keeps_the_group_only_when_every_agent_came_back() {
        let group = [4, 2, 7];
        assert_eq!(adopt(&group, &BTreeSet::from([2, 4, 7])), Adopt::Keep);
        // Those that came back keep the group's order; the others are named.
        assert_eq!(
            adopt(&group, &BTreeSet::from([7, 4, 9])),
            Adopt::Restart { on: vec![4, 7], missing: vec![2] }
        );
        assert_eq!(adopt(&group, &BTreeSet::from([9])), Adopt::Afresh);
        assert_eq!(adopt(&group, &BTreeSet::new()), Adopt::Afresh);
    }

    #[test]
    fn an_agent_follows_only_a_higher_token() {
        assert_eq!(newer(5, Some(leader(6))), Some(leader(6)));
        assert_eq!(newer(5, Some(leader(5))), None, "the launcher it follows");
        assert_eq!(newer(5, Some(leader(3))), None, "never back to a deposed one");
        assert_eq!(newer(5, None), None);
    }

    #[test]
    fn the_store_names_the_newest_launcher_and_the_job_s_end() {
        let url = "memory";
        let l = Lookup::open(url, "j", &Secret::generate().unwrap()).unwrap();
        assert_eq!(l.look(0).unwrap(), Found::Nothing);
        let g = GroupHandover {
            group: 2,
            agents: vec![1, 2],
            hosts: vec!["10.0.0.3".into(), "10.0.0.4".into()],
            master_addr: "10.0.0.3".into(),
            master_port: 29500,
            nproc: 2,
            restart_count: 0,
            leader: leader(9),
            handles: [(1, "slot:w1/0".to_string())].into(),
        };
        let state = |s: JobState| l.seal.seal(&l.key, &serde_json::to_vec(&s).unwrap());
        let put = |v: Vec<u8>| l.rt.block_on(l.store.put(&l.key, &v, None)).unwrap();
        put(state(JobState { torchrun: Some(g.clone()), ..JobState::default() }));
        assert_eq!(l.look(3).unwrap(), Found::Leader(leader(9)));
        assert_eq!(l.look(9).unwrap(), Found::Nothing);
        put(state(JobState { finished: true, fence: 9, ..JobState::default() }));
        assert_eq!(l.look(3).unwrap(), Found::Finished);
        assert_eq!(l.look(9).unwrap(), Found::Finished);
        // An earlier launcher's finished mark (left over, or replayed by a
        // store writer) ends nothing for an agent that follows a later one.
        put(state(JobState { finished: true, fence: 2, ..JobState::default() }));
        assert_eq!(l.look(3).unwrap(), Found::Nothing);
        // The record reads back as written (a successor reads it so).
        let written = state(JobState { torchrun: Some(g.clone()), ..JobState::default() });
        assert_eq!(JobState::open(&l.key, &written, &l.seal).unwrap().torchrun, Some(g.clone()));
        // One written without the job's secret names nobody and ends nothing.
        put(serde_json::to_vec(&JobState { finished: true, ..JobState::default() }).unwrap());
        let e = l.look(3).unwrap_err().to_string();
        assert!(e.contains("is ignored") && e.contains("carries no MAC"), "{e}");
    }
}
