//! A worker's sparse tables on the job's parameter servers: tables the
//! program defines (`job.table(...)`, before its first step), declared on
//! the servers at the first step that uses them (as of that step's
//! generation), pulls and pushes marked with the step's generation, and the
//! empty pushes a step owes every table it did not push, so that the
//! servers can count every rank's push of every step.

use crate::job::spec::PsTopology;
use crate::ps::{Client, Mark, PushTag, TableSpec};
use crate::worker::session::JobAuth;
use anyhow::{Context, Result, bail};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// The job's servers as of the current generation, shared with the
/// checkpoints' exporter.
type Shared = Arc<Mutex<Option<PsTopology>>>;

fn current(t: &Shared) -> Option<PsTopology> {
    t.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Connects to the servers of `t` as `worker`.
fn connect(t: &PsTopology, auth: &JobAuth, worker: u64) -> Result<Client> {
    let servers =
        t.servers.iter().map(|(id, a)| Ok((*id, crate::net::resolve(a)?))).collect::<Result<Vec<_>>>()?;
    let mut client = Client::connect(&servers, t.replicas, auth, worker)?;
    // Longer than a server waits for the pushes a pull needs (300 s): a
    // server wedged, not gone, fails the step instead of holding it.
    client.set_timeout(std::time::Duration::from_secs(330))?;
    Ok(client)
}

/// The tables of one worker.
pub struct Tables {
    topology: Shared,
    /// The servers `client` is connected to.
    connected: Option<PsTopology>,
    auth: JobAuth,
    worker: u64,
    /// Connected, with every table declared, at the first step that uses one.
    client: Option<Client>,
    specs: BTreeMap<String, TableSpec>,
    /// The step (generation, step) the pushes in `pushed` belong to.
    pushing: (u64, u64),
    pushed: BTreeSet<String>,
    /// The job's checkpoint location and the checkpoint the current
    /// generation started from: where a server that makes a table takes
    /// its rows.
    pub restore: Option<(PathBuf, PathBuf)>,
}

impl Tables {
    pub fn new(topology: Option<PsTopology>, auth: JobAuth, worker: u64) -> Tables {
        Tables {
            topology: Arc::new(Mutex::new(topology)),
            connected: None,
            auth,
            worker,
            client: None,
            specs: BTreeMap::new(),
            pushing: (u64::MAX, u64::MAX),
            pushed: BTreeSet::new(),
            restore: None,
        }
    }

    /// Defines a table (again with the same spec: a no-op); `started`: the
    /// program's steps have begun, when tables can no longer be added.
    pub fn define(&mut self, spec: TableSpec, started: bool) -> Result<()> {
        if current(&self.topology).is_none() {
            bail!("table {:?}: the job has no parameter servers (start it with --ps-servers N)", spec.name);
        }
        spec.check().map_err(anyhow::Error::msg)?;
        if started && !self.specs.contains_key(&spec.name) {
            bail!(
                "table {:?}: define the tables before the first step (every rank pushes every table every step)",
                spec.name
            );
        }
        match self.specs.get(&spec.name) {
            Some(had) if *had != spec => bail!("table {:?} is already defined otherwise: {had:?}", spec.name),
            _ => {
                self.specs.insert(spec.name.clone(), spec);
                Ok(())
            }
        }
    }

    pub fn dim(&self, table: &str) -> Result<usize> {
        self.specs.get(table).map(|s| s.dim).with_context(|| {
            format!("no table {table:?} (define it with job.table({table:?}, dim=...) first)")
        })
    }

    /// The servers as the current generation knows them (a new set: the
    /// next request connects to it).
    pub fn follow(&mut self, topology: Option<PsTopology>) {
        if topology.is_some() {
            *self.topology.lock().unwrap_or_else(|e| e.into_inner()) = topology;
        }
    }

    /// Whether the job may add servers (a full one then makes a step wait).
    pub fn room(&self) -> bool {
        current(&self.topology).is_some_and(|t| t.room)
    }

    /// A request failed: the connections are dropped (the next request
    /// makes new ones, whatever was left on these); true when the step is
    /// to be redone (a server gone, the generation over, a server full
    /// while the job may add one), false for an error of the program's.
    pub fn failed(&mut self, e: &anyhow::Error) -> bool {
        self.disconnect();
        crate::ps::service::redo(e, self.room())
    }

    /// Forgets the connections (one broke): the next request makes new ones.
    pub fn disconnect(&mut self) {
        self.client = None;
        self.connected = None;
    }

    /// The client, connected (and every table declared, as of `mark`) at
    /// first use and again when the servers changed.
    fn client(&mut self, table: &str, mark: Mark) -> Result<&mut Client> {
        self.dim(table)?;
        let now = current(&self.topology);
        if self.client.is_none() || self.connected != now {
            // Pushes sent on the old connections are answered first: a
            // refusal among them fails the step.
            if let Some(mut old) = self.client.take() {
                old.settle()?;
            }
            let t = now.as_ref().expect("checked at define");
            let mut client = connect(t, &self.auth, self.worker)?;
            let restore = self.restore.as_ref().map(|(l, p)| (l.as_path(), p.as_path()));
            for spec in self.specs.values() {
                client.declare(spec.clone(), mark, restore)?;
            }
            self.client = Some(client);
            self.connected = now;
        }
        Ok(self.client.as_mut().expect("just made"))
    }

    /// What gives the checkpoints rank 0 writes the tables at their step:
    /// a connection of its own to every server, made at the first one.
    pub fn exporter(&self) -> Option<crate::worker::session::TableExport> {
        current(&self.topology)?;
        let (shared, auth, worker, specs) =
            (self.topology.clone(), self.auth.clone(), self.worker, self.specs.clone());
        let mut client: Option<(Client, PsTopology)> = None;
        Some(Box::new(move |step, generation| {
            let now = current(&shared).expect("a job with servers");
            if client.as_ref().is_none_or(|(_, t)| *t != now) {
                let mut c = connect(&now, &auth, worker)?;
                specs.values().for_each(|s| c.know(s.clone()));
                client = Some((c, now));
            }
            let c = &mut client.as_mut().expect("just made").0;
            let tables =
                specs.keys().map(|name| c.export(name, step, generation)).collect::<Result<Vec<_>>>();
            if tables.is_err() {
                // A connection left mid-answer is not used again.
                client = None;
            }
            tables
        }))
    }

    /// Rows `ids` of `table` for step `step` (`ids.len() * dim` floats).
    pub fn pull(&mut self, table: &str, mark: Mark, step: u64, ids: &[u64]) -> Result<Vec<f32>> {
        Ok(self.pull_many(&[(table, ids)], mark, step)?.remove(0))
    }

    /// [`Tables::pull`] of several tables in one flight to the servers.
    pub fn pull_many(&mut self, reads: &[(&str, &[u64])], mark: Mark, step: u64) -> Result<Vec<Vec<f32>>> {
        let Some(&(first, _)) = reads.first() else { return Ok(Vec::new()) };
        for (table, _) in reads {
            self.dim(table)?;
        }
        self.forget_abandoned((mark.generation, step));
        let need = self.need(step);
        self.client(first, mark)?.pull_many(reads, mark, need)
    }

    /// [`Tables::pull`] that makes no row on the servers (an evaluation's
    /// read: an id not held comes back with its initial values).
    pub fn peek(&mut self, table: &str, mark: Mark, step: u64, ids: &[u64]) -> Result<Vec<f32>> {
        self.forget_abandoned((mark.generation, step));
        let need = self.need(step);
        self.client(table, mark)?.peek(table, mark, need, ids)
    }

    /// The pushes of a step other than `now` (generation, step) whose
    /// answers are still owed: that step was abandoned without its commit;
    /// their answers are read and let go (a refusal among them was that
    /// step's), so that they do not fail this one.
    fn forget_abandoned(&mut self, now: (u64, u64)) {
        if self.pushing == now || self.pushing == (u64::MAX, u64::MAX) {
            return;
        }
        if let Some(c) = self.client.as_mut()
            && c.settle().is_err()
        {
            self.disconnect();
        }
        self.pushing = (u64::MAX, u64::MAX);
        self.pushed.clear();
    }

    /// The steps a read for `step` waits to be applied: those before it,
    /// less the staleness the job allows.
    fn need(&self, step: u64) -> u64 {
        step.saturating_sub(current(&self.topology).map_or(0, |t| t.staleness))
    }

    /// This rank's gradients of `table`'s rows `ids` in the step `tag` names;
    /// the servers' answers are read by [`Tables::finish`] (or the next
    /// request), so that a refusal fails the step there.
    pub fn push(&mut self, table: &str, tag: PushTag, ids: &[u64], grads: &[f32]) -> Result<()> {
        self.forget_abandoned((tag.mark.generation, tag.step));
        self.pushing = (tag.mark.generation, tag.step);
        if !self.pushed.insert(table.to_string()) {
            bail!("table {table:?}: step {} pushed it already (push each table once a step)", tag.step);
        }
        // Answered at the step's end (`finish`): the servers apply it meanwhile.
        self.client(table, tag.mark)?.push_later(table, tag, ids, grads)
    }

    /// The step is done: every table it did not push is pushed empty (the
    /// servers count every rank's push of a step), and the answers to the
    /// step's pushes are read.
    pub fn finish(&mut self, tag: PushTag) -> Result<()> {
        self.forget_abandoned((tag.mark.generation, tag.step));
        // Every table this program defines, touched or not: another rank
        // may have touched it, and its step waits for this rank's push.
        let owed: Vec<String> = self.specs.keys().filter(|t| !self.pushed.contains(*t)).cloned().collect();
        for table in owed {
            self.client(&table, tag.mark)?.push_later(&table, tag, &[], &[])?;
        }
        self.pushed.clear();
        self.pushing = (u64::MAX, u64::MAX);
        // Every push of the step answered: a refusal fails the step here.
        match self.client.as_mut() {
            Some(c) => c.settle(),
            None => Ok(()),
        }
    }
}
