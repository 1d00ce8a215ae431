//! A parameter server's tables and the rule that applies a step's pushes
//! exactly once, without I/O (the service around it moves the bytes and
//! waits; see `service.rs`).
//!
//! Every rank of a generation pushes every step to every server, for every
//! table, even when it has no rows there: a server counts the step's pushes
//! and applies their sum once all `world` ranks' are in, in step order, so
//! a step is applied whole or not at all. A push is tagged with its
//! generation, step and rank:
//! - the same push again (a retry) replaces the first: nothing counts twice;
//! - a push of a step already applied is acknowledged and dropped: a step
//!   redone after a rank died (its dense part rolled back to the last
//!   commit) finds its sparse update in place, computed from the same rows;
//! - a push of a newer generation drops what the older one staged: the
//!   dead generation's partial steps are redone by the new one, with its
//!   own world size; a push of an older generation is refused.
//!
//! A pull for step `s` is answered once the steps before `s - staleness`
//! are applied: with no staleness, a step sees every update before it.

use super::table::{Rows, TableSpec};
use std::collections::{BTreeMap, HashMap};

/// Why a request was refused; each names the table and who asked.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PsError {
    #[error(
        "parameter server {server} has no table {table:?} (worker {worker} asked; a table is declared before use)"
    )]
    UnknownTable { server: u64, table: String, worker: u64 },
    #[error("table {table:?} is declared as {have}; worker {worker} declares it as {want}")]
    Conflict { table: String, worker: u64, have: String, want: String },
    #[error("bad table from worker {worker}: {reason}")]
    BadSpec { worker: u64, reason: String },
    #[error("table {table:?}: worker {worker} sent {got} gradient floats for {ids} ids of dimension {dim}")]
    Dimension { table: String, worker: u64, ids: usize, dim: usize, got: usize },
    #[error(
        "table {table:?} on parameter server {server} is at its memory bound ({bound_mib} MiB, {used_mib:.1} MiB used): {new} new rows from worker {worker} refused"
    )]
    AtBound { table: String, server: u64, worker: u64, bound_mib: u64, used_mib: f64, new: usize },
    #[error(
        "table {table:?}: worker {worker} pushed step {step} of generation {generation}, which is over (generation {current} redoes it)"
    )]
    Stale { table: String, worker: u64, step: u64, generation: u64, current: u64 },
    #[error("table {table:?}: worker {worker} says it is rank {rank} of {world}{more}")]
    Rank { table: String, worker: u64, rank: u32, world: u32, more: String },
}

/// Where a push belongs: its generation, step, and rank among `world`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PushTag {
    pub generation: u64,
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
    shards: HashMap<u32, Rows>,
    rows: u64,
    /// Steps `0..applied` are applied.
    applied: u64,
    /// The newest generation that pushed.
    generation: u64,
    staged: BTreeMap<u64, Staged>,
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
}

/// A parameter server's state.
#[derive(Debug)]
pub struct Server {
    id: u64,
    /// Bytes of rows this server may hold.
    bound: Option<u64>,
    tables: BTreeMap<String, Served>,
}

impl Server {
    pub fn new(id: u64, bound: Option<u64>) -> Self {
        Server { id, bound, tables: BTreeMap::new() }
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// Makes `spec` a table here, its steps before `from_step` counted as
    /// applied (a job resumed at that step); the same spec again is a no-op.
    pub fn declare(&mut self, worker: u64, spec: TableSpec, from_step: u64) -> Result<(), PsError> {
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
            shards: HashMap::new(),
            rows: 0,
            applied: from_step,
            generation: 0,
            staged: BTreeMap::new(),
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

    /// Refuses `new` rows of `table` that would take the server past its bound.
    fn room(&self, table: &str, worker: u64, new: usize) -> Result<(), PsError> {
        let (Some(bound), Some(t)) = (self.bound, self.tables.get(table)) else { return Ok(()) };
        let used = self.bytes();
        if new > 0 && used + new as u64 * t.spec.row_bytes() > bound {
            return Err(PsError::AtBound {
                table: table.into(),
                server: self.id,
                worker,
                bound_mib: bound >> 20,
                used_mib: used as f64 / (1 << 20) as f64,
                new,
            });
        }
        Ok(())
    }

    /// Rows `ids` of `table` (made on first touch), `dim` floats each in
    /// the order asked; `None` while steps before `need` are still to be
    /// applied (the caller waits for pushes and asks again).
    pub fn pull(
        &mut self,
        table: &str,
        worker: u64,
        need: u64,
        ids: &[u64],
    ) -> Result<Option<Vec<f32>>, PsError> {
        let t = self.table(table, worker)?;
        if t.applied < need {
            return Ok(None);
        }
        let new = count_new(t, ids);
        self.room(table, worker, new)?;
        let t = self.table(table, worker)?;
        let dim = t.spec.dim;
        let mut out = vec![0f32; ids.len() * dim];
        for (id, row) in ids.iter().zip(out.chunks_exact_mut(dim)) {
            t.shards.entry(t.spec.shard_of(*id)).or_default().read(&t.spec, *id, row);
        }
        t.rows += new as u64;
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
        let t = self.table(table, worker)?;
        check_push(t, worker, tag, &ids, &grads)?;
        if tag.step < t.applied {
            return Ok(Pushed::AlreadyApplied { applied: t.applied });
        }
        if tag.generation > t.generation {
            t.generation = tag.generation;
            t.staged.clear();
        }
        let new = count_new(t, &ids);
        self.room(table, worker, new)?;
        let t = self.table(table, worker)?;
        let staged =
            t.staged.entry(tag.step).or_insert_with(|| Staged { world: tag.world, pushes: BTreeMap::new() });
        if staged.world != tag.world {
            let more = format!(", where generation {} has {} ranks", tag.generation, staged.world);
            return Err(PsError::Rank {
                table: table.into(),
                worker,
                rank: tag.rank,
                world: tag.world,
                more,
            });
        }
        staged.pushes.insert(tag.rank, (ids, grads));
        apply_ready(t);
        Ok(Pushed::Staged { applied: t.applied })
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
        Stats { server: self.id, tables, bytes: self.bytes(), bound: self.bound }
    }

    /// Every row of `table` here, by id (for checks and exports).
    pub fn rows(&self, table: &str) -> BTreeMap<u64, Vec<f32>> {
        let Some(t) = self.tables.get(table) else { return BTreeMap::new() };
        t.shards.values().flat_map(|r| r.export(&t.spec)).map(|(id, (values, _, _))| (id, values)).collect()
    }
}

fn count_new(t: &Served, ids: &[u64]) -> usize {
    let mut fresh: Vec<u64> = ids
        .iter()
        .copied()
        .filter(|id| !t.shards.get(&t.spec.shard_of(*id)).is_some_and(|r| r.contains(*id)))
        .collect();
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
    if tag.generation < t.generation && tag.step >= t.applied {
        return Err(PsError::Stale {
            table: table.clone(),
            worker,
            step: tag.step,
            generation: tag.generation,
            current: t.generation,
        });
    }
    Ok(())
}

/// Applies staged steps in order while the next one has all its pushes:
/// the ranks' gradients summed per row, each row updated once, by id.
fn apply_ready(t: &mut Served) {
    while let Some(s) = t.staged.get(&t.applied) {
        if s.pushes.len() < s.world as usize {
            return;
        }
        let s = t.staged.remove(&t.applied).expect("just seen");
        let dim = t.spec.dim;
        let mut sum: BTreeMap<u64, Vec<f32>> = BTreeMap::new();
        for (ids, grads) in s.pushes.values() {
            for (id, g) in ids.iter().zip(grads.chunks_exact(dim)) {
                let acc = sum.entry(*id).or_insert_with(|| vec![0.0; dim]);
                acc.iter_mut().zip(g).for_each(|(a, b)| *a += b);
            }
        }
        for (id, g) in sum {
            let rows = t.shards.entry(t.spec.shard_of(id)).or_default();
            if !rows.contains(id) {
                t.rows += 1;
            }
            rows.update(&t.spec, id, &g);
        }
        t.applied += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ps::table::{Init, Optimizer};

    fn spec() -> TableSpec {
        TableSpec { name: "item".into(), dim: 2, optimizer: Optimizer::sgd(1.0), init: Init::Zeros, seed: 0 }
    }

    fn server() -> Server {
        let mut s = Server::new(1, None);
        s.declare(9, spec(), 0).unwrap();
        s
    }

    fn tag(generation: u64, step: u64, rank: u32, world: u32) -> PushTag {
        PushTag { generation, step, rank, world }
    }

    fn row(s: &mut Server, id: u64) -> Vec<f32> {
        s.pull("item", 9, 0, &[id]).unwrap().unwrap()
    }

    #[test]
    fn a_step_is_applied_once_all_its_ranks_pushed_and_a_retry_counts_once() {
        let mut s = server();
        let pushed = s.push("item", 1, tag(1, 0, 0, 2), vec![5, 5], vec![1.0, 0.0, 1.0, 0.0]).unwrap();
        assert_eq!(pushed, Pushed::Staged { applied: 0 });
        assert_eq!(row(&mut s, 5), [0.0, 0.0], "half a step is not applied");
        assert_eq!(s.pull("item", 1, 1, &[5]).unwrap(), None, "step 1 waits for step 0");
        assert!(s.waiting("item").unwrap().1.contains("1 of 2 ranks"));
        // Rank 0 again (a retry): replaces its first push.
        s.push("item", 1, tag(1, 0, 0, 2), vec![5], vec![2.0, 0.0]).unwrap();
        let done = s.push("item", 2, tag(1, 0, 1, 2), vec![5, 6], vec![0.5, 1.0, 0.0, 3.0]).unwrap();
        assert_eq!(done, Pushed::Staged { applied: 1 });
        assert_eq!(row(&mut s, 5), [-2.5, -1.0]);
        assert_eq!(row(&mut s, 6), [0.0, -3.0]);
        // The same step pushed again after it was applied: dropped.
        let again = s.push("item", 2, tag(2, 0, 0, 1), vec![5], vec![9.0, 9.0]).unwrap();
        assert_eq!(again, Pushed::AlreadyApplied { applied: 1 });
        assert_eq!(row(&mut s, 5), [-2.5, -1.0]);
    }

    #[test]
    fn a_new_generation_drops_what_the_dead_one_staged_and_redoes_it_with_its_own_world() {
        let mut s = server();
        // Generation 1 of three ranks: step 0 whole, step 1 from two ranks
        // (the third died mid-step).
        for r in 0..3 {
            s.push("item", r as u64, tag(1, 0, r, 3), vec![1], vec![1.0, 1.0]).unwrap();
        }
        s.push("item", 0, tag(1, 1, 0, 3), vec![1], vec![10.0, 10.0]).unwrap();
        s.push("item", 1, tag(1, 1, 1, 3), vec![1], vec![10.0, 10.0]).unwrap();
        assert_eq!(row(&mut s, 1), [-3.0, -3.0]);
        // Generation 2 of two ranks redoes step 1.
        s.push("item", 0, tag(2, 1, 0, 2), vec![1], vec![0.25, 0.0]).unwrap();
        let late = s.push("item", 2, tag(1, 1, 2, 3), vec![1], vec![10.0, 10.0]).unwrap_err();
        assert!(matches!(late, PsError::Stale { current: 2, .. }), "{late}");
        assert!(late.to_string().contains("\"item\"") && late.to_string().contains("worker 2"), "{late}");
        s.push("item", 1, tag(2, 1, 1, 2), vec![1], vec![0.25, 0.0]).unwrap();
        assert_eq!(row(&mut s, 1), [-3.5, -3.0], "generation 1's half step is gone");
    }

    #[test]
    fn steps_pushed_ahead_wait_their_turn_and_staleness_lets_a_pull_run_ahead() {
        let mut s = server();
        s.push("item", 0, tag(1, 1, 0, 1), vec![3], vec![1.0, 0.0]).unwrap();
        assert_eq!(s.stats().tables[0].applied, 0, "step 1 waits for step 0");
        assert_eq!(s.pull("item", 0, 2, &[3]).unwrap(), None);
        assert_eq!(s.pull("item", 0, 0, &[3]).unwrap(), Some(vec![0.0, 0.0]), "staleness 2 at step 2");
        s.push("item", 0, tag(1, 0, 0, 1), vec![], vec![]).unwrap();
        assert_eq!(s.stats().tables[0].applied, 2);
        assert_eq!(s.pull("item", 0, 2, &[3]).unwrap(), Some(vec![-1.0, 0.0]));
    }

    #[test]
    fn bad_requests_name_the_table_and_the_worker_and_change_nothing() {
        let mut s = server();
        let e = s.pull("user", 4, 0, &[1]).unwrap_err();
        assert!(e.to_string().contains("no table \"user\"") && e.to_string().contains("worker 4"), "{e}");
        let e = s.push("item", 4, tag(1, 0, 0, 1), vec![1, 2], vec![1.0; 3]).unwrap_err();
        assert!(e.to_string().contains("3 gradient floats for 2 ids of dimension 2"), "{e}");
        let e = s.push("item", 4, tag(1, 0, 2, 2), vec![], vec![]).unwrap_err();
        assert!(e.to_string().contains("rank 2 of 2"), "{e}");
        s.push("item", 4, tag(1, 0, 0, 2), vec![], vec![]).unwrap();
        let e = s.push("item", 5, tag(1, 0, 1, 3), vec![], vec![]).unwrap_err();
        assert!(e.to_string().contains("generation 1 has 2 ranks"), "{e}");
        let other = TableSpec { dim: 3, ..spec() };
        let e = s.declare(6, other, 0).unwrap_err();
        assert!(matches!(e, PsError::Conflict { .. }) && e.to_string().contains("worker 6"), "{e}");
        s.declare(6, spec(), 0).unwrap();
        assert_eq!(s.stats().tables[0].rows, 0, "nothing was made");
    }

    #[test]
    fn a_server_at_its_bound_refuses_new_rows_and_keeps_serving_old_ones() {
        let per_row = spec().row_bytes();
        let mut s = Server::new(3, Some(per_row * 10));
        s.declare(1, spec(), 0).unwrap();
        let ids: Vec<u64> = (0..10).collect();
        s.pull("item", 1, 0, &ids).unwrap().unwrap();
        let e = s.pull("item", 7, 0, &[10, 11]).unwrap_err();
        assert!(matches!(e, PsError::AtBound { server: 3, worker: 7, new: 2, .. }), "{e}");
        assert!(e.to_string().contains("\"item\""), "{e}");
        assert_eq!(s.pull("item", 7, 0, &[3, 4]).unwrap().unwrap().len(), 4);
        let e = s.push("item", 7, tag(1, 0, 0, 1), vec![1, 12], vec![1.0; 4]).unwrap_err();
        assert!(matches!(e, PsError::AtBound { new: 1, .. }), "{e}");
        assert_eq!(s.stats().tables[0].applied, 0, "nothing half applied");
        assert_eq!(s.stats().bytes, per_row * 10);
    }
}
