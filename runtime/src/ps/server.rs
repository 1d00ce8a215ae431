//! A parameter server's tables and the rule that applies a step's pushes
//! exactly once, without I/O (the service around it moves the bytes and
//! waits; see `service.rs`).
//!
//! Every rank of a generation pushes every step to every server, for every
//! table, even when it has no rows there: a server counts the step's pushes
//! and applies their sum once all `world` ranks' are in, in step order, so
//! a step is applied whole or not at all. Requests carry a [`Mark`]: the
//! generation and the committed step it started from (its base); the job's
//! own requests also say which steps are past undoing (a worker's never do).
//! - A push names its step and rank: the same push again (a retry)
//!   replaces the first, and one of a step already applied in the same
//!   generation is acknowledged and dropped: nothing counts twice.
//! - The first request of a newer generation rolls the table back to that
//!   generation's base: what the dead generation staged is dropped, and the
//!   steps it applied after the base are undone (each applied step keeps
//!   the rows it changed as they were, until the job says the step is
//!   past undoing). The
//!   steps the job redoes are then applied again, as if the failure had
//!   never been: the tables stay the state of the committed steps, as the
//!   dense parameters do. A request of an older generation is refused.
//!
//! A pull for step `s` is answered once the steps before `s - staleness`
//! are applied: with no staleness, a step sees every update before it.

use super::table::{Rows, SHARDS, SavedTable, TableSpec};
use std::collections::BTreeMap;

/// The id the job's coordinator connects to the servers with (not a
/// worker's).
pub(crate) const JOB_CLIENT: u64 = u64::MAX;

/// Who asked, as an error says it.
pub(crate) fn who(worker: &u64) -> String {
    match *worker {
        JOB_CLIENT => "the job's coordinator".into(),
        w => format!("worker {w}"),
    }
}

/// Why a request was refused; each names the table and who asked.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PsError {
    #[error(
        "parameter server {server} has no table {table:?} ({who} asked; a table is declared before use)", who = who(.worker))]
    UnknownTable { server: u64, table: String, worker: u64 },
    #[error("table {table:?} is declared as {have}; {who} declares it as {want}", who = who(.worker))]
    Conflict { table: String, worker: u64, have: String, want: String },
    #[error("bad table from {who}: {reason}", who = who(.worker))]
    BadSpec { worker: u64, reason: String },
    #[error("table {table:?}: {who} sent {got} gradient floats for {ids} ids of dimension {dim}", who = who(.worker))]
    Dimension { table: String, worker: u64, ids: usize, dim: usize, got: usize },
    #[error(
        "table {table:?} on parameter server {server} is at its memory bound ({bound_mib} MiB, {used_mib:.1} MiB used): {new} new rows from {who} refused", who = who(.worker))]
    AtBound { table: String, server: u64, worker: u64, bound_mib: u64, used_mib: f64, new: usize },
    #[error(
        "table {table:?}: {who} pushed step {step} of generation {generation}, which is over (generation {current} redoes it)", who = who(.worker))]
    Stale { table: String, worker: u64, step: u64, generation: u64, current: u64 },
    #[error(
        "table {table:?}: {who} pushed a gradient that is not finite ({value} for id {id}) at step {step}; \
         nothing of the push is applied (a program training in mixed precision skips the push of a step whose gradients overflowed)", who = who(.worker))]
    NotFinite { table: String, worker: u64, step: u64, id: u64, value: f32 },
    #[error("table {table:?}: {who} says it is rank {rank} of {world}{more}", who = who(.worker))]
    Rank { table: String, worker: u64, rank: u32, world: u32, more: String },
    #[error(
        "table {table:?} on parameter server {server} holds steps 0..{applied}, but generation {generation} starts after step {base}{why}"
    )]
    Behind { table: String, server: u64, applied: u64, generation: u64, base: u64, why: String },
}

/// Where a request stands in the job.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Mark {
    pub generation: u64,
    /// Steps committed when the generation formed: the state it started from.
    pub base: u64,
    /// The steps before this one will never be undone or taken for a
    /// checkpoint again: their undo records can go (0 from workers; the
    /// job tells it, knowing its commits and the checkpoints still due).
    pub committed: u64,
}

impl Mark {
    /// A worker's mark: its step's generation and that generation's base.
    /// The job, not a worker, tells the servers which steps are past
    /// undoing (it knows the checkpoints still to be taken).
    pub fn of_worker(generation: u64, base: u64) -> Mark {
        Mark { generation, base, committed: 0 }
    }
}

/// Where a push belongs: its generation, step, and rank among `world`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PushTag {
    pub mark: Mark,
    pub step: u64,
    pub rank: u32,
    pub world: u32,
}

/// What became of a push.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Pushed {
    /// Kept until the step's other ranks push; `applied` steps are applied.
    Staged { applied: u64 },
    /// Its step was applied before (a redone step): dropped.
    AlreadyApplied { applied: u64 },
}

/// One table as a server holds it.
#[derive(Debug)]
struct Served {
    spec: TableSpec,
    shards: Shards,
    /// Made by a copy of shards from other servers and never pushed to
    /// since: a new generation after its copy's step takes it as of its own
    /// base, the copy of the rows changed meanwhile following.
    copy_only: bool,
    rows: u64,
    /// Steps `0..applied` are applied.
    applied: u64,
    /// The newest generation that asked.
    generation: u64,
    staged: BTreeMap<u64, Staged>,
    /// Per applied step not known to be committed: the rows it changed, as
    /// they were before (values and optimiser state, update count).
    undo: BTreeMap<u64, Undo>,
}

/// A table's rows by shard: every shard's place, indexed directly.
#[derive(Debug)]
struct Shards(Vec<Rows>);

impl Shards {
    fn new() -> Shards {
        Shards((0..SHARDS).map(|_| Rows::default()).collect())
    }

    fn get(&self, shard: u32) -> &Rows {
        &self.0[shard as usize]
    }

    fn get_mut(&mut self, shard: u32) -> &mut Rows {
        &mut self.0[shard as usize]
    }

    /// The shards with rows, by number.
    fn held(&self) -> impl Iterator<Item = (u32, &Rows)> {
        self.0.iter().enumerate().filter(|(_, r)| !r.is_empty()).map(|(s, r)| (s as u32, r))
    }

    /// Forgets the rows of the shards `gone` names; returns how many.
    fn forget(&mut self, gone: impl Fn(u32) -> bool) -> u64 {
        let mut n = 0;
        for (s, rows) in self.0.iter_mut().enumerate() {
            if !rows.is_empty() && gone(s as u32) {
                n += rows.len() as u64;
                *rows = Rows::default();
            }
        }
        n
    }
}

/// The rows an applied step changed, as they were before it: per row its
/// id, update count and `width` floats (values, then optimiser state).
#[derive(Debug, Default)]
struct Undo {
    ids: Vec<u64>,
    updates: Vec<u32>,
    rows: Vec<f32>,
}

impl Undo {
    /// Bytes it takes.
    fn bytes(&self) -> u64 {
        (self.ids.len() * 12 + self.rows.len() * 4) as u64
    }

    /// Each row, newest first (the order that undoes them).
    fn rows_back(&self, w: usize) -> impl Iterator<Item = (u64, &[f32], u32)> {
        (0..self.ids.len()).rev().map(move |k| (self.ids[k], &self.rows[k * w..(k + 1) * w], self.updates[k]))
    }
}

/// The pushes of one step so far.
#[derive(Debug)]
struct Staged {
    world: u32,
    pushes: BTreeMap<u32, (Vec<u64>, Vec<f32>)>,
}

/// A table's size on a server.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TableStats {
    pub name: String,
    pub dim: usize,
    pub rows: u64,
    pub bytes: u64,
    pub applied: u64,
}

/// A server's tables and memory.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Stats {
    pub server: u64,
    pub tables: Vec<TableStats>,
    pub bytes: u64,
    pub bound: Option<u64>,
    /// Told to go (SIGTERM): it serves on until the job has moved its
    /// shards elsewhere.
    #[serde(default)]
    pub leaving: bool,
    /// New rows it refused at its memory bound, all told.
    #[serde(default)]
    pub refused: u64,
    /// Pulls and pushes it answered, all told.
    #[serde(default)]
    pub requests: u64,
    /// Bytes besides the rows (undo records, staged pushes); the memory
    /// bound counts them with the rows.
    #[serde(default)]
    pub working_bytes: u64,
}

/// A parameter server's state.
#[derive(Debug)]
pub struct Server {
    id: u64,
    /// Bytes of rows this server may hold.
    bound: Option<u64>,
    tables: BTreeMap<String, Served>,
    /// The newest generation in which it forgot rows of shards moved to
    /// other servers.
    moved_in: u64,
}

impl Server {
    pub fn new(id: u64, bound: Option<u64>) -> Self {
        Server { id, bound, tables: BTreeMap::new(), moved_in: 0 }
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// The newest generation in which this server forgot rows of shards
    /// that moved away (0: never).
    pub fn moved_in(&self) -> u64 {
        self.moved_in
    }

    pub fn has(&self, table: &str) -> bool {
        self.tables.contains_key(table)
    }

    /// The floats of a row of `table`, where it is declared here.
    pub fn dim(&self, table: &str) -> Option<usize> {
        self.tables.get(table).map(|t| t.spec.dim)
    }

    /// Makes `spec` a table here, as of the generation and base of `mark`
    /// (its steps before the base counted as applied: a job resumed at that
    /// step); the same spec again is a no-op.
    pub fn declare(&mut self, worker: u64, spec: TableSpec, mark: Mark) -> Result<(), PsError> {
        spec.check().map_err(|reason| PsError::BadSpec { worker, reason })?;
        if let Some(t) = self.tables.get(&spec.name) {
            if t.spec != spec {
                let show = |s: &TableSpec| serde_json::to_string(s).unwrap_or_default();
                return Err(PsError::Conflict {
                    table: spec.name.clone(),
                    worker,
                    have: show(&t.spec),
                    want: show(&spec),
                });
            }
            return Ok(());
        }
        let served = Served {
            spec: spec.clone(),
            shards: Shards::new(),
            copy_only: false,
            rows: 0,
            applied: mark.base,
            generation: mark.generation,
            staged: BTreeMap::new(),
            undo: BTreeMap::new(),
        };
        self.tables.insert(spec.name, served);
        Ok(())
    }

    fn table(&mut self, table: &str, worker: u64) -> Result<&mut Served, PsError> {
        let server = self.id;
        self.tables.get_mut(table).ok_or_else(|| PsError::UnknownTable {
            server,
            table: table.into(),
            worker,
        })
    }

    /// Bytes of rows held, all tables.
    pub fn bytes(&self) -> u64 {
        self.tables.values().map(|t| t.rows * t.spec.row_bytes()).sum()
    }

    /// Bytes besides the rows: the undo records of the steps not yet past
    /// undoing, and the pushes staged for steps not yet applied.
    pub fn working_bytes(&self) -> u64 {
        let staged =
            |s: &Staged| s.pushes.values().map(|(ids, g)| (ids.len() * 8 + g.len() * 4) as u64).sum::<u64>();
        self.tables
            .values()
            .map(|t| {
                t.undo.values().map(Undo::bytes).sum::<u64>() + t.staged.values().map(staged).sum::<u64>()
            })
            .sum()
    }

    /// Refuses the rows of `ids` not yet held in `table` where they would
    /// take the server past its bound (counted only when all of them
    /// might not fit).
    fn room(&self, table: &str, worker: u64, ids: &[u64]) -> Result<(), PsError> {
        let (Some(bound), Some(t)) = (self.bound, self.tables.get(table)) else { return Ok(()) };
        // The rows, and what undoes the recent steps and stages the next.
        let used = self.bytes() + self.working_bytes();
        let fits = |new: usize| new == 0 || used + new as u64 * t.spec.row_bytes() <= bound;
        if fits(ids.len()) {
            return Ok(());
        }
        let new = count_new(t, ids);
        if fits(new) {
            return Ok(());
        }
        Err(PsError::AtBound {
            table: table.into(),
            server: self.id,
            worker,
            bound_mib: bound >> 20,
            used_mib: used as f64 / (1 << 20) as f64,
            new,
        })
    }

    /// Rows `ids` of `table` (made on first touch), `dim` floats each in
    /// the order asked; `None` while steps before `need` are still to be
    /// applied (the caller waits for pushes and asks again).
    pub fn pull(
        &mut self,
        table: &str,
        worker: u64,
        mark: Mark,
        need: u64,
        ids: &[u64],
    ) -> Result<Option<Vec<f32>>, PsError> {
        self.read(table, worker, (mark, need), ids, true)
    }

    /// [`Server::pull`] that makes no row: one not held comes back with its
    /// initial values (what an evaluation reads).
    pub fn peek(
        &mut self,
        table: &str,
        worker: u64,
        mark: Mark,
        need: u64,
        ids: &[u64],
    ) -> Result<Option<Vec<f32>>, PsError> {
        self.read(table, worker, (mark, need), ids, false)
    }

    /// A pull (`make`: rows not held are made, within the memory bound) or
    /// a peek (they are read as their initial values, and not kept).
    fn read(
        &mut self,
        table: &str,
        worker: u64,
        (mark, need): (Mark, u64),
        ids: &[u64],
        make: bool,
    ) -> Result<Option<Vec<f32>>, PsError> {
        let server = self.id;
        let t = self.table(table, worker)?;
        enter(t, server, worker, of_worker(mark))?;
        if t.applied < need {
            return Ok(None);
        }
        if make {
            self.room(table, worker, ids)?;
        }
        let t = self.table(table, worker)?;
        let dim = t.spec.dim;
        let mut out = vec![0f32; ids.len() * dim];
        if make {
            // Every row's place first, then the copies: lookups that do not
            // wait on one another's copies overlap their cache misses.
            let mut places = Vec::with_capacity(ids.len());
            for &id in ids {
                let shard = t.spec.shard_of(id);
                let (at, new) = t.shards.get_mut(shard).place(&t.spec, id);
                t.rows += new as u64;
                places.push((shard, at));
            }
            for ((shard, at), row) in places.into_iter().zip(out.chunks_exact_mut(dim)) {
                row.copy_from_slice(t.shards.get(shard).values(&t.spec, at));
            }
        } else {
            for (id, row) in ids.iter().zip(out.chunks_exact_mut(dim)) {
                t.shards.get(t.spec.shard_of(*id)).peek(&t.spec, *id, row);
            }
        }
        Ok(Some(out))
    }

    /// Steps of `table` applied so far, and what the next one waits for.
    pub fn waiting(&self, table: &str) -> Option<(u64, String)> {
        let t = self.tables.get(table)?;
        let next = match t.staged.get(&t.applied) {
            Some(s) => format!("step {} has pushes from {} of {} ranks", t.applied, s.pushes.len(), s.world),
            None => format!("step {} has no pushes yet", t.applied),
        };
        Some((t.applied, next))
    }

    /// Stages a rank's gradients of a step (`ids.len() * dim` floats in
    /// `grads`), and applies every step whose pushes are all in.
    pub fn push(
        &mut self,
        table: &str,
        worker: u64,
        tag: PushTag,
        ids: Vec<u64>,
        grads: Vec<f32>,
    ) -> Result<Pushed, PsError> {
        let pushed = self.stage(table, worker, tag, ids, grads)?;
        self.apply_staged();
        let applied = self.tables.get(table).map_or(0, |t| t.applied);
        Ok(match pushed {
            Pushed::Staged { .. } => Pushed::Staged { applied },
            p => p,
        })
    }

    /// [`Server::push`] that leaves the steps it completes to
    /// [`Server::apply_staged`]: a server answers the push first and
    /// applies while the worker goes on. Whatever reads or changes the
    /// tables next applies them first.
    pub fn stage(
        &mut self,
        table: &str,
        worker: u64,
        tag: PushTag,
        ids: Vec<u64>,
        grads: Vec<f32>,
    ) -> Result<Pushed, PsError> {
        let server = self.id;
        let t = self.table(table, worker)?;
        check_push(t, worker, tag, &ids, &grads)?;
        enter(t, server, worker, of_worker(tag.mark))?;
        t.copy_only = false;
        if tag.step < t.applied {
            return Ok(Pushed::AlreadyApplied { applied: t.applied });
        }
        self.room(table, worker, &ids)?;
        let t = self.table(table, worker)?;
        let staged =
            t.staged.entry(tag.step).or_insert_with(|| Staged { world: tag.world, pushes: BTreeMap::new() });
        if staged.world != tag.world {
            let more = format!(", where generation {} has {} ranks", tag.mark.generation, staged.world);
            return Err(PsError::Rank {
                table: table.into(),
                worker,
                rank: tag.rank,
                world: tag.world,
                more,
            });
        }
        staged.pushes.insert(tag.rank, (ids, grads));
        Ok(Pushed::Staged { applied: t.applied })
    }

    /// Applies, in every table, the steps whose pushes are all in (in
    /// order); true when one was.
    pub fn apply_staged(&mut self) -> bool {
        self.tables.values_mut().fold(false, |any, t| apply_ready(t) | any)
    }

    pub fn stats(&self) -> Stats {
        let tables = self
            .tables
            .values()
            .map(|t| TableStats {
                name: t.spec.name.clone(),
                dim: t.spec.dim,
                rows: t.rows,
                bytes: t.rows * t.spec.row_bytes(),
                applied: t.applied,
            })
            .collect();
        let (leaving, refused, requests, working_bytes) = (false, 0, 0, self.working_bytes());
        let (bytes, bound) = (self.bytes(), self.bound);
        Stats { server: self.id, tables, bytes, bound, leaving, refused, requests, working_bytes }
    }

    /// `table` as it was after its steps before `step` (the newest steps
    /// undone on a copy): what a checkpoint of that step keeps (the rows
    /// updated by then; the others are their seeded initial values).
    pub fn export(&self, table: &str, worker: u64, step: u64) -> Result<SavedTable, PsError> {
        self.export_shards(table, worker, step, |_| true, None)
    }

    /// [`Server::export`] of the shards `keep` names; with `since`, only
    /// the rows the steps from `since` on changed (what a copy of those
    /// shards made as of `since` lacks).
    pub fn export_shards(
        &self,
        table: &str,
        worker: u64,
        step: u64,
        keep: impl Fn(u32) -> bool,
        since: Option<u64>,
    ) -> Result<SavedTable, PsError> {
        let server = self.id;
        let t = self.tables.get(table).ok_or_else(|| PsError::UnknownTable {
            server,
            table: table.into(),
            worker,
        })?;
        if step > t.applied || (step..t.applied).any(|s| !t.undo.contains_key(&s)) {
            return Err(PsError::Behind {
                table: table.into(),
                server,
                applied: t.applied,
                generation: t.generation,
                base: step,
                why: ": a checkpoint of that step cannot be made here".into(),
            });
        }
        let changed = match since {
            Some(since) => Some(changed_since(t, since).ok_or_else(|| PsError::Behind {
                table: table.into(),
                server,
                applied: t.applied,
                generation: t.generation,
                base: since,
                why: ": the rows changed since that step cannot be told here".into(),
            })?),
            None => None,
        };
        let wanted = |id: &u64| changed.as_ref().is_none_or(|c| c.contains(id));
        let w = t.spec.width();
        // The rows as held, by id...
        let mut rows: Vec<(u64, &[f32], u32)> = t
            .shards
            .held()
            .filter(|(s, _)| keep(*s))
            .flat_map(|(_, r)| r.each(w))
            .filter(|r| wanted(&r.0))
            .collect();
        rows.sort_unstable_by_key(|r| r.0);
        // ...then the steps after `step` undone, newest first: a row's
        // oldest record is what it was before them.
        for s in (step..t.applied).rev() {
            for (id, row, updates) in t.undo[&s].rows_back(w) {
                if let Ok(i) = rows.binary_search_by_key(&id, |r| r.0) {
                    rows[i] = (id, row, updates);
                }
            }
        }
        let mut saved =
            SavedTable { spec: t.spec.clone(), ids: Vec::new(), rows: Vec::new(), updates: Vec::new() };
        // A row never updated is its initial values: made again alike where needed.
        for (id, row, updates) in rows.into_iter().filter(|r| r.2 > 0) {
            saved.ids.push(id);
            saved.rows.extend_from_slice(row);
            saved.updates.push(updates);
        }
        Ok(saved)
    }

    /// Declares `spec` (as [`Server::declare`]) with the rows of `saved`
    /// that `keep` says are this server's (by shard).
    pub fn restore(
        &mut self,
        worker: u64,
        spec: TableSpec,
        mark: Mark,
        saved: &SavedTable,
        keep: impl Fn(u32) -> bool,
    ) -> Result<(), PsError> {
        if self.tables.contains_key(&spec.name) {
            return self.declare(worker, spec, mark);
        }
        if saved.spec.dim != spec.dim || saved.spec.optimizer.slots() != spec.optimizer.slots() {
            return Err(PsError::Conflict {
                table: spec.name.clone(),
                worker,
                have: format!("{:?} in the checkpoint", saved.spec),
                want: format!("{spec:?}"),
            });
        }
        self.declare(worker, spec.clone(), mark)?;
        let t = self.tables.get_mut(&spec.name).expect("just declared");
        let w = spec.width();
        for (i, &id) in saved.ids.iter().enumerate() {
            let shard = spec.shard_of(id);
            if keep(shard) {
                t.shards.get_mut(shard).put(&spec, id, &saved.rows[i * w..(i + 1) * w], saved.updates[i]);
                t.rows += 1;
            }
        }
        Ok(())
    }

    /// Takes `mark` for every table: a newer generation rolls them all back
    /// to its base (and releases pulls of the generation before).
    pub fn enter_all(&mut self, mark: Mark) -> Result<(), PsError> {
        let server = self.id;
        self.tables.values_mut().try_for_each(|t| enter(t, server, JOB_CLIENT, mark))
    }

    /// Puts the rows of `saved` here (shards copied from another server),
    /// the table made as of `mark` if it is new; rows already here are
    /// replaced.
    pub fn import(&mut self, saved: &SavedTable, mark: Mark) -> Result<(), PsError> {
        let spec = saved.spec.clone();
        let new = !self.tables.contains_key(&spec.name);
        // A table made (or held) alike: rows of another width would not fit.
        self.declare(JOB_CLIENT, spec.clone(), mark)?;
        let t = self.tables.get_mut(&spec.name).expect("declared");
        t.copy_only |= new;
        enter(t, self.id, JOB_CLIENT, mark)?;
        let w = spec.width();
        for (i, &id) in saved.ids.iter().enumerate() {
            let rows = t.shards.get_mut(spec.shard_of(id));
            if !rows.contains(id) {
                t.rows += 1;
            }
            rows.put(&spec, id, &saved.rows[i * w..(i + 1) * w], saved.updates[i]);
        }
        Ok(())
    }

    /// Forgets the shards `gone` of every table (moved to other servers).
    pub fn drop_shards(&mut self, gone: impl Fn(u32) -> bool) {
        for t in self.tables.values_mut() {
            let forgot = t.shards.forget(&gone);
            t.rows -= forgot;
            if forgot > 0 {
                self.moved_in = self.moved_in.max(t.generation);
            }
        }
    }

    /// Forgets how to undo the steps before `step` (committed, and no
    /// checkpoint of an earlier step still to be taken).
    pub fn trim(&mut self, step: u64) {
        for t in self.tables.values_mut() {
            t.undo.retain(|&s, _| s >= step);
        }
    }

    /// Forgets every table.
    pub fn reset(&mut self) {
        self.tables.clear();
    }

    /// Every row of `table` here, by id (for checks and exports).
    pub fn rows(&self, table: &str) -> BTreeMap<u64, Vec<f32>> {
        let Some(t) = self.tables.get(table) else { return BTreeMap::new() };
        t.shards
            .held()
            .flat_map(|(_, r)| r.export(&t.spec))
            .map(|(id, (values, _, _))| (id, values))
            .collect()
    }
}

/// The rows the steps from `since` on changed (or made), by their undo
/// records; None when some of those records are gone.
fn changed_since(t: &Served, since: u64) -> Option<rustc_hash::FxHashSet<u64>> {
    if since > t.applied {
        return None;
    }
    (since..t.applied).map(|s| t.undo.get(&s).map(|u| u.ids.iter().copied())).try_fold(
        rustc_hash::FxHashSet::default(),
        |mut all, ids| {
            all.extend(ids?);
            Some(all)
        },
    )
}

fn count_new(t: &Served, ids: &[u64]) -> usize {
    let mut fresh: Vec<u64> =
        ids.iter().copied().filter(|id| !t.shards.get(t.spec.shard_of(*id)).contains(*id)).collect();
    fresh.sort_unstable();
    fresh.dedup();
    fresh.len()
}

fn check_push(t: &Served, worker: u64, tag: PushTag, ids: &[u64], grads: &[f32]) -> Result<(), PsError> {
    let table = &t.spec.name;
    if tag.world == 0 || tag.rank >= tag.world {
        return Err(PsError::Rank {
            table: table.clone(),
            worker,
            rank: tag.rank,
            world: tag.world,
            more: String::new(),
        });
    }
    if grads.len() != ids.len() * t.spec.dim {
        let (ids, dim, got) = (ids.len(), t.spec.dim, grads.len());
        return Err(PsError::Dimension { table: table.clone(), worker, ids, dim, got });
    }
    // One infinite or NaN value would stay in every holder's row (and an
    // optimiser's moments) until a checkpoint is restored.
    if let Some(at) = grads.iter().position(|g| !g.is_finite()) {
        let (id, value) = (ids[at / t.spec.dim.max(1)], grads[at]);
        return Err(PsError::NotFinite { table: table.clone(), worker, step: tag.step, id, value });
    }
    if tag.mark.generation < t.generation {
        return Err(PsError::Stale {
            table: table.clone(),
            worker,
            step: tag.step,
            generation: tag.mark.generation,
            current: t.generation,
        });
    }
    Ok(())
}

/// A worker's pull or push says which generation it is in, never which
/// steps are past undoing: that is the job's to say (`enter_all`, `trim`),
/// so a worker that names a later commit cannot make the undo records a
/// going back needs disappear.
fn of_worker(mark: Mark) -> Mark {
    Mark { committed: 0, ..mark }
}

/// Takes a request's mark: a newer generation rolls the table back to
/// its base; a commit lets go of the undo records it covers.
fn enter(t: &mut Served, server: u64, worker: u64, mark: Mark) -> Result<(), PsError> {
    let table = &t.spec.name;
    if mark.generation < t.generation {
        let current = t.generation;
        return Err(PsError::Stale {
            table: table.clone(),
            worker,
            step: mark.base,
            generation: mark.generation,
            current,
        });
    }
    if mark.generation > t.generation
        && mark.base > t.applied
        && t.copy_only
        && t.staged.is_empty()
        && t.undo.is_empty()
    {
        // Copied ahead: the rows the steps between changed are copied next.
        t.applied = mark.base;
    }
    if mark.generation > t.generation {
        let behind = |why: &str| PsError::Behind {
            table: table.clone(),
            server,
            applied: t.applied,
            generation: mark.generation,
            base: mark.base,
            why: why.into(),
        };
        if mark.base > t.applied {
            return Err(behind(": the steps between were never pushed here (a server that lost its tables)"));
        }
        if (mark.base..t.applied).any(|s| !t.undo.contains_key(&s)) {
            return Err(behind(": steps after it were committed and cannot be undone"));
        }
        while t.applied > mark.base {
            t.applied -= 1;
            let undo = t.undo.remove(&t.applied).expect("checked");
            for (id, row, updates) in undo.rows_back(t.spec.width()) {
                t.shards.get_mut(t.spec.shard_of(id)).put(&t.spec, id, row, updates);
            }
        }
        t.generation = mark.generation;
        t.staged.clear();
    }
    t.undo.retain(|&step, _| step >= mark.committed);
    Ok(())
}

/// Applies staged steps in order while the next one has all its pushes:
/// the ranks' gradients summed per row, each row updated once, by id.
fn apply_ready(t: &mut Served) -> bool {
    let before = t.applied;
    while let Some(s) = t.staged.get(&t.applied) {
        if s.pushes.len() < s.world as usize {
            break;
        }
        let s = t.staged.remove(&t.applied).expect("just seen");
        let (dim, w) = (t.spec.dim, t.spec.width());
        // Every pushed row by id, then rank, then its place in the push:
        // each row's gradients summed in rank order, and the rows updated
        // by id, the same order on every server.
        let pushes: Vec<&(Vec<u64>, Vec<f32>)> = s.pushes.values().collect();
        let mut order: Vec<(u64, u32, u32)> = pushes
            .iter()
            .enumerate()
            .flat_map(|(p, (ids, _))| ids.iter().enumerate().map(move |(i, &id)| (id, p as u32, i as u32)))
            .collect();
        order.sort_unstable();
        let mut undo = Undo {
            ids: Vec::with_capacity(order.len()),
            updates: Vec::with_capacity(order.len()),
            rows: Vec::with_capacity(order.len() * w),
        };
        // Each row's place first, then the updates: lookups that do not
        // wait on one another's updates overlap their cache misses.
        let mut places = Vec::with_capacity(order.len());
        for same in order.chunk_by(|a, b| a.0 == b.0) {
            let (id, shard) = (same[0].0, t.spec.shard_of(same[0].0));
            let (at, new) = t.shards.get_mut(shard).place(&t.spec, id);
            t.rows += new as u64;
            places.push((shard, at));
        }
        let mut sum = vec![0f32; dim];
        let step_size = t.spec.optimizer.step_size(t.applied);
        for (same, (shard, at)) in order.chunk_by(|a, b| a.0 == b.0).zip(places) {
            sum.fill(0.0);
            for &(_, p, i) in same {
                let (p, i) = (p as usize, i as usize);
                sum.iter_mut().zip(&pushes[p].1[i * dim..(i + 1) * dim]).for_each(|(a, b)| *a += b);
            }
            let had = t.shards.get_mut(shard).update_at(&t.spec, at, &sum, &mut undo.rows, step_size);
            undo.ids.push(same[0].0);
            undo.updates.push(had);
        }
        t.undo.insert(t.applied, undo);
        t.applied += 1;
    }
    t.applied > before
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ps::table::{Init, Optimizer};

    fn spec() -> TableSpec {
        TableSpec { name: "item".into(), dim: 2, optimizer: Optimizer::sgd(1.0), init: Init::Zeros, seed: 0 }
    }

    fn mark(generation: u64, base: u64) -> Mark {
        Mark { generation, base, committed: base }
    }

    fn server() -> Server {
        let mut s = Server::new(1, None);
        s.declare(9, spec(), mark(1, 0)).unwrap();
        s
    }

    /// A push of generation `g` (which started at step `base`).
    fn tag((g, base): (u64, u64), step: u64, rank: u32, world: u32) -> PushTag {
        PushTag { mark: mark(g, base), step, rank, world }
    }

    const G1: (u64, u64) = (1, 0);

    fn row(s: &mut Server, g: (u64, u64), id: u64) -> Vec<f32> {
        s.pull("item", 9, mark(g.0, g.1), 0, &[id]).unwrap().unwrap()
    }

    #[test]
    fn a_staged_step_waits_for_apply_staged_and_is_applied_as_a_push_would() {
        let (mut staged, mut pushed) = (server(), server());
        let grads = vec![1.0, 2.0, 3.0, 4.0, 0.5, 0.5];
        // Ids repeated within a push, out of order: summed, then by id.
        let ids = vec![8, 3, 8];
        assert_eq!(
            staged.stage("item", 1, tag(G1, 0, 0, 1), ids.clone(), grads.clone()).unwrap(),
            Pushed::Staged { applied: 0 }
        );
        assert_eq!(staged.pull("item", 1, mark(1, 0), 1, &[8]).unwrap(), None, "not applied yet");
        assert!(staged.apply_staged());
        assert!(!staged.apply_staged(), "nothing left to apply");
        assert_eq!(
            pushed.push("item", 1, tag(G1, 0, 0, 1), ids, grads).unwrap(),
            Pushed::Staged { applied: 1 }
        );
        for id in [3, 8] {
            assert_eq!(row(&mut staged, G1, id), row(&mut pushed, G1, id));
        }
        assert_eq!(row(&mut staged, G1, 8), [-1.5, -2.5]);
    }

    #[test]
    fn a_step_is_applied_once_all_its_ranks_pushed_and_a_retry_counts_once() {
        let mut s = server();
        let pushed = s.push("item", 1, tag(G1, 0, 0, 2), vec![5, 5], vec![1.0, 0.0, 1.0, 0.0]).unwrap();
        assert_eq!(pushed, Pushed::Staged { applied: 0 });
        assert_eq!(row(&mut s, G1, 5), [0.0, 0.0], "half a step is not applied");
        assert_eq!(s.pull("item", 1, mark(1, 0), 1, &[5]).unwrap(), None, "step 1 waits for step 0");
        assert!(s.waiting("item").unwrap().1.contains("1 of 2 ranks"));
        // Rank 0 again (a retry): replaces its first push.
        s.push("item", 1, tag(G1, 0, 0, 2), vec![5], vec![2.0, 0.0]).unwrap();
        let done = s.push("item", 2, tag(G1, 0, 1, 2), vec![5, 6], vec![0.5, 1.0, 0.0, 3.0]).unwrap();
        assert_eq!(done, Pushed::Staged { applied: 1 });
        assert_eq!(row(&mut s, G1, 5), [-2.5, -1.0]);
        assert_eq!(row(&mut s, G1, 6), [0.0, -3.0]);
        // The same step pushed again after it was applied: dropped.
        let again = s.push("item", 2, tag(G1, 0, 1, 2), vec![5], vec![9.0, 9.0]).unwrap();
        assert_eq!(again, Pushed::AlreadyApplied { applied: 1 });
        assert_eq!(row(&mut s, G1, 5), [-2.5, -1.0]);
    }

    #[test]
    fn a_new_generation_undoes_what_the_dead_one_did_after_its_base_and_redoes_it_with_its_own_world() {
        let mut s = server();
        // Generation 1 of three ranks: steps 0 and 1 whole, step 2 from two
        // ranks (the third died mid-step); only step 0 was committed.
        for step in 0..2 {
            for r in 0..3 {
                s.push("item", r as u64, tag(G1, step, r, 3), vec![1, 2], vec![1.0; 4]).unwrap();
            }
        }
        s.push("item", 0, tag(G1, 2, 0, 3), vec![1], vec![10.0, 10.0]).unwrap();
        s.push("item", 1, tag(G1, 2, 1, 3), vec![1], vec![10.0, 10.0]).unwrap();
        assert_eq!(row(&mut s, G1, 1), [-6.0, -6.0]);
        // Generation 2 of two ranks starts from the commit of step 0: its
        // first request rolls the table back there.
        let g2 = (2, 1);
        assert_eq!(row(&mut s, g2, 1), [-3.0, -3.0]);
        assert_eq!(row(&mut s, g2, 2), [-3.0, -3.0]);
        assert_eq!(s.stats().tables[0].applied, 1);
        let late = s.push("item", 2, tag(G1, 2, 2, 3), vec![1], vec![10.0, 10.0]).unwrap_err();
        assert!(matches!(late, PsError::Stale { current: 2, .. }), "{late}");
        assert!(late.to_string().contains("\"item\"") && late.to_string().contains("worker 2"), "{late}");
        let e = s.pull("item", 2, mark(1, 0), 0, &[1]).unwrap_err();
        assert!(matches!(e, PsError::Stale { .. }), "a pull of the dead generation: {e}");
        // It redoes step 1 its own way.
        s.push("item", 0, tag(g2, 1, 0, 2), vec![1], vec![0.25, 0.0]).unwrap();
        s.push("item", 1, tag(g2, 1, 1, 2), vec![], vec![]).unwrap();
        assert_eq!(row(&mut s, g2, 1), [-3.25, -3.0]);
        assert_eq!(row(&mut s, g2, 2), [-3.0, -3.0], "generation 1's step 1 is gone");
    }

    #[test]
    fn committed_steps_cannot_be_undone_only_the_job_says_which_and_a_server_that_missed_steps_says_so() {
        let three_steps = || {
            let mut s = server();
            for step in 0..3 {
                // Each push names a later commit, as no worker should.
                let t = PushTag {
                    mark: Mark { generation: 1, base: 0, committed: step + 1 },
                    step,
                    rank: 0,
                    world: 1,
                };
                s.push("item", 0, t, vec![4], vec![1.0, 1.0]).unwrap();
            }
            s
        };
        // A worker's word lets go of nothing: the job can still go back to step 1.
        let mut s = three_steps();
        assert_eq!(s.pull("item", 0, mark(2, 1), 0, &[4]).unwrap(), Some(vec![-1.0, -1.0]));
        // Steps 0 and 1 are committed (as the job says): a generation
        // claiming to start at step 1 asks for an undo that is gone.
        let mut s = three_steps();
        s.trim(2);
        let e = s.pull("item", 0, mark(2, 1), 0, &[4]).unwrap_err();
        assert!(matches!(e, PsError::Behind { base: 1, applied: 3, .. }), "{e}");
        assert!(e.to_string().contains("cannot be undone"), "{e}");
        let e = s.pull("item", 0, mark(2, 7), 0, &[4]).unwrap_err();
        assert!(e.to_string().contains("never pushed here"), "{e}");
        assert_eq!(row(&mut s, (2, 2), 4), [-2.0, -2.0], "back to the commit of step 2");
    }

    #[test]
    fn steps_pushed_ahead_wait_their_turn_and_staleness_lets_a_pull_run_ahead() {
        let mut s = server();
        s.push("item", 0, tag(G1, 1, 0, 1), vec![3], vec![1.0, 0.0]).unwrap();
        assert_eq!(s.stats().tables[0].applied, 0, "step 1 waits for step 0");
        assert_eq!(s.pull("item", 0, mark(1, 0), 2, &[3]).unwrap(), None);
        assert_eq!(
            s.pull("item", 0, mark(1, 0), 0, &[3]).unwrap(),
            Some(vec![0.0, 0.0]),
            "staleness 2 at step 2"
        );
        s.push("item", 0, tag(G1, 0, 0, 1), vec![], vec![]).unwrap();
        assert_eq!(s.stats().tables[0].applied, 2);
        assert_eq!(s.pull("item", 0, mark(1, 0), 2, &[3]).unwrap(), Some(vec![-1.0, 0.0]));
    }

    #[test]
    fn bad_requests_name_the_table_and_the_worker_and_change_nothing() {
        let mut s = server();
        let e = s.pull("user", 4, mark(1, 0), 0, &[1]).unwrap_err();
        assert!(e.to_string().contains("no table \"user\"") && e.to_string().contains("worker 4"), "{e}");
        let e = s.push("item", 4, tag(G1, 0, 0, 1), vec![1, 2], vec![1.0; 3]).unwrap_err();
        assert!(e.to_string().contains("3 gradient floats for 2 ids of dimension 2"), "{e}");
        let e = s.push("item", 4, tag(G1, 0, 2, 2), vec![], vec![]).unwrap_err();
        assert!(e.to_string().contains("rank 2 of 2"), "{e}");
        let e =
            s.push("item", 4, tag(G1, 0, 0, 1), vec![7, 9], vec![0.5, 1.0, f32::INFINITY, 0.0]).unwrap_err();
        assert!(
            e.to_string().contains("not finite (inf for id 9)") && e.to_string().contains("worker 4"),
            "{e}"
        );
        let e = s.push("item", 4, tag(G1, 0, 0, 1), vec![7], vec![f32::NAN, 0.0]).unwrap_err();
        assert!(matches!(e, PsError::NotFinite { id: 7, .. }), "{e}");
        s.push("item", 4, tag(G1, 0, 0, 2), vec![], vec![]).unwrap();
        let e = s.push("item", 5, tag(G1, 0, 1, 3), vec![], vec![]).unwrap_err();
        assert!(e.to_string().contains("generation 1 has 2 ranks"), "{e}");
        let other = TableSpec { dim: 3, ..spec() };
        let e = s.declare(6, other.clone(), mark(1, 0)).unwrap_err();
        assert!(matches!(e, PsError::Conflict { .. }) && e.to_string().contains("worker 6"), "{e}");
        // Rows copied in by the job are the coordinator's, not a worker's.
        let copied = SavedTable { spec: other, ids: vec![], rows: vec![], updates: vec![] };
        let e = s.import(&copied, mark(1, 0)).unwrap_err();
        assert!(e.to_string().contains("the job's coordinator declares it as"), "{e}");
        s.declare(6, spec(), mark(1, 0)).unwrap();
        assert_eq!(s.stats().tables[0].rows, 0, "nothing was made");
    }

    #[test]
    fn a_server_at_its_bound_refuses_new_rows_and_keeps_serving_old_ones() {
        let per_row = spec().row_bytes();
        let mut s = Server::new(3, Some(per_row * 10));
        s.declare(1, spec(), mark(1, 0)).unwrap();
        let ids: Vec<u64> = (0..10).collect();
        s.pull("item", 1, mark(1, 0), 0, &ids).unwrap().unwrap();
        let e = s.pull("item", 7, mark(1, 0), 0, &[10, 11]).unwrap_err();
        assert!(matches!(e, PsError::AtBound { server: 3, worker: 7, new: 2, .. }), "{e}");
        assert!(e.to_string().contains("\"item\""), "{e}");
        assert_eq!(s.pull("item", 7, mark(1, 0), 0, &[3, 4]).unwrap().unwrap().len(), 4);
        let e = s.push("item", 7, tag(G1, 0, 0, 1), vec![1, 12], vec![1.0; 4]).unwrap_err();
        assert!(matches!(e, PsError::AtBound { new: 1, .. }), "{e}");
        assert_eq!(s.stats().tables[0].applied, 0, "nothing half applied");
        assert_eq!(s.stats().bytes, per_row * 10);
    }

    #[test]
    fn a_peek_reads_held_rows_and_the_initial_values_of_others_and_makes_none() {
        let uniform = TableSpec { init: Init::Uniform { scale: 0.5 }, ..spec() };
        let mut s = Server::new(1, None);
        s.declare(9, uniform.clone(), mark(1, 0)).unwrap();
        s.push("item", 1, tag(G1, 0, 0, 1), vec![5], vec![1.0, 2.0]).unwrap();
        let rows_before = s.stats().tables[0].rows;
        assert_eq!(s.peek("item", 1, mark(1, 0), 2, &[5]).unwrap(), None, "step 1 is not applied yet");
        let peeked = s.peek("item", 1, mark(1, 0), 1, &[5, 77]).unwrap().unwrap();
        let mut fresh = vec![0f32; 2];
        uniform.init_row(77, &mut fresh);
        assert!(fresh.iter().any(|v| *v != 0.0));
        assert_eq!(peeked[..2], row(&mut s, G1, 5)[..], "a held row as a pull reads it");
        assert_eq!(peeked[2..], fresh[..], "an id not held: its initial values");
        assert_eq!(s.stats().tables[0].rows, rows_before, "no row made");
        assert_eq!(row(&mut s, G1, 77), fresh, "and a pull then makes it with the same values");
    }

    #[test]
    fn the_bound_counts_the_undo_records_and_staged_pushes_until_the_steps_are_past_undoing() {
        let per_row = spec().row_bytes();
        // Room for 12 rows, and nothing besides.
        let mut s = Server::new(3, Some(per_row * 12));
        s.declare(1, spec(), mark(1, 0)).unwrap();
        let ids: Vec<u64> = (0..10).collect();
        s.pull("item", 1, mark(1, 0), 0, &ids).unwrap().unwrap();
        assert_eq!(s.working_bytes(), 0);
        // Step 0 changes all 10 rows: their undo records take more than two rows' room.
        s.push("item", 1, tag(G1, 0, 0, 1), ids.clone(), vec![1.0; 20]).unwrap();
        assert!(s.working_bytes() > 2 * per_row, "{}", s.working_bytes());
        assert_eq!(s.stats().working_bytes, s.working_bytes());
        let e = s.pull("item", 7, mark(1, 0), 1, &[10]).unwrap_err();
        assert!(matches!(e, PsError::AtBound { new: 1, .. }), "{e}");
        // A half-pushed step's staged gradients count too.
        let mut t = Server::new(4, Some(per_row * 11));
        t.declare(1, spec(), mark(1, 0)).unwrap();
        t.pull("item", 1, mark(1, 0), 0, &ids).unwrap().unwrap();
        t.push("item", 1, tag(G1, 0, 0, 2), ids.clone(), vec![1.0; 20]).unwrap();
        assert!(t.working_bytes() >= 10 * 16, "{}", t.working_bytes());
        assert!(matches!(t.pull("item", 7, mark(1, 0), 0, &[10]), Err(PsError::AtBound { .. })));
        // Step 0 past undoing: its records go, and the room is back.
        s.trim(1);
        assert_eq!(s.working_bytes(), 0);
        assert_eq!(s.pull("item", 7, mark(1, 0), 1, &[10, 11]).unwrap().unwrap().len(), 4);
    }

    #[test]
    fn an_export_is_the_table_at_its_step_and_a_restore_keeps_the_shards_asked_for() {
        let mut s = Server::new(1, None);
        let adam = TableSpec { optimizer: Optimizer::adam(0.1), ..spec() };
        s.declare(9, adam.clone(), mark(1, 0)).unwrap();
        for step in 0..3 {
            s.push("item", 0, tag(G1, step, 0, 1), vec![step, 10], vec![1.0; 4]).unwrap();
        }
        s.trim(1);
        let at1 = s.export("item", 0, 1).unwrap();
        assert_eq!(at1.ids, [0, 10], "row 1 was first updated by step 1, after the export's step");
        assert_eq!(at1.updates, [1, 1]);
        assert_eq!(at1.rows.len(), 2 * adam.width());
        let now = s.export("item", 0, 3).unwrap();
        assert_eq!(now.ids, [0, 1, 2, 10]);
        assert_eq!(now.updates, [1, 1, 1, 3]);
        let e = s.export("item", 0, 0).unwrap_err();
        assert!(e.to_string().contains("cannot be made"), "step 0 is before the commit: {e}");
        // Restored on a server that keeps even shards only.
        let mut r = Server::new(2, None);
        r.restore(4, adam.clone(), mark(2, 1), &at1, |shard| shard % 2 == 0).unwrap();
        let kept = r.export("item", 4, 1).unwrap();
        let want: Vec<u64> =
            at1.ids.iter().copied().filter(|&id| adam.shard_of(id).is_multiple_of(2)).collect();
        assert_eq!(kept.ids, want);
        for (i, id) in kept.ids.iter().enumerate() {
            let j = at1.ids.iter().position(|x| x == id).unwrap();
            let w = adam.width();
            assert_eq!(kept.rows[i * w..(i + 1) * w], at1.rows[j * w..(j + 1) * w]);
        }
        let other = TableSpec { dim: 3, ..adam };
        let e = Server::new(3, None).restore(4, other, mark(2, 1), &at1, |_| true).unwrap_err();
        assert!(matches!(e, PsError::Conflict { .. }), "{e}");
    }
}
