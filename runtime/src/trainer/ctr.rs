//! The built-in click-through model (`--dataset ctr`): wide and deep
//! (Cheng et al. 2016) on Criteo-shaped data, its embedding tables on the
//! job's parameter servers and its dense layers on the ring.
//!
//! A row has 13 dense (count) features and 26 categorical ones, each
//! categorical value an id unique across fields (the field's number above
//! bit 40). The deep part looks each id up in table `deep` (8 floats),
//! concatenates the 26 embeddings after the dense features and runs the
//! MLP to one logit; the wide part adds each id's weight from table `wide`
//! (1 float). The loss is the logistic loss of the click label. Each step
//! pulls the rows its batch touches, pushes their gradients (summed per
//! id; the servers apply Adagrad), and all-reduces the MLP's. The data:
//! [`clicks`](crate::trainer::clicks).

use crate::checkpoint::Restored;
use crate::job::spec::BuiltinModel;
use crate::ps::{Init, Optimizer, TableSpec, Tables};
use crate::trainer::builtin::{MlpState, mlp_layout};
use crate::trainer::clicks::{DENSE, FIELDS};
use crate::trainer::data::Dataset;
use crate::trainer::train::Trainer;
use crate::worker::session::{Event, Session, Step};
use anyhow::{Context, Result, bail};
use std::collections::HashMap;
use std::time::Instant;

/// Floats of an id's embedding.
pub const EMBED: usize = 8;
/// The table of embeddings, and the table of the wide part's weights.
pub const DEEP: &str = "deep";
pub const WIDE: &str = "wide";

/// The MLP's input: the dense features, then each field's embedding.
pub fn input_dim() -> usize {
    DENSE + FIELDS * EMBED
}

/// The MLP's layer sizes for hidden layers `hidden`: one logit out.
pub fn layers(hidden: &[usize]) -> Vec<usize> {
    std::iter::once(input_dim()).chain(hidden.iter().copied()).chain([1]).collect()
}

/// The model's two tables: Adagrad on the servers, its sums started at
/// 0.1 as TensorFlow's are (a rare id's first update is not a full
/// `lr`-sized step whatever its gradient), embeddings drawn uniform in
/// ±0.05 from `seed`, wide weights from zero.
pub fn table_specs(seed: u64) -> [TableSpec; 2] {
    let optimizer = Optimizer::Adagrad { lr: 0.05, eps: 1e-10, initial: 0.1 };
    [
        TableSpec { name: DEEP.into(), dim: EMBED, optimizer, init: Init::Uniform { scale: 0.05 }, seed },
        TableSpec { name: WIDE.into(), dim: 1, optimizer, init: Init::Zeros, seed },
    ]
}

/// The logistic loss of logit `z` for label `y`, without overflow.
fn logistic_loss(z: f32, y: u32) -> f64 {
    let z = z as f64;
    z.max(0.0) - z * y as f64 + (-z.abs()).exp().ln_1p()
}

fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// The area under the ROC curve of `scores` for `labels` (ties counted
/// half): the chance that a positive scores above a negative. None when
/// the labels are all alike.
pub fn auc(scores: &[f32], labels: &[u32]) -> Option<f64> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]));
    let (mut rank_sum, mut at) = (0f64, 0usize);
    while at < order.len() {
        let tied = order[at..].iter().take_while(|&&i| scores[i] == scores[order[at]]).count();
        // The tied scores' average rank (1-based).
        let rank = at as f64 + (tied as f64 + 1.0) / 2.0;
        rank_sum += rank * order[at..at + tied].iter().filter(|&&i| labels[i] == 1).count() as f64;
        at += tied;
    }
    let pos = labels.iter().filter(|&&y| y == 1).count() as f64;
    let neg = labels.len() as f64 - pos;
    (pos > 0.0 && neg > 0.0).then(|| (rank_sum - pos * (pos + 1.0) / 2.0) / (pos * neg))
}

/// A batch's distinct ids, sorted, and where each of its ids is among them.
fn distinct(ids: &[u64]) -> (Vec<u64>, Vec<usize>) {
    let mut uniq = ids.to_vec();
    uniq.sort_unstable();
    uniq.dedup();
    let at: HashMap<u64, usize> = uniq.iter().enumerate().map(|(i, &id)| (id, i)).collect();
    let pos = ids.iter().map(|id| at[id]).collect();
    (uniq, pos)
}

/// The rows of a batch: the MLP's inputs and the wide part's logit.
struct Inputs {
    x: Vec<f32>,
    wide: Vec<f32>,
}

/// The inputs of `rows` rows with features `dense` and ids at `pos` among
/// rows `deep` (embeddings) and `wide` (weights) of the distinct ids.
fn inputs(dense: &[f32], pos: &[usize], deep: &[f32], wide: &[f32], rows: usize) -> Inputs {
    let mut x = Vec::with_capacity(rows * input_dim());
    let mut logit = Vec::with_capacity(rows);
    for r in 0..rows {
        x.extend_from_slice(&dense[r * DENSE..(r + 1) * DENSE]);
        let at = &pos[r * FIELDS..(r + 1) * FIELDS];
        at.iter().for_each(|&p| x.extend_from_slice(&deep[p * EMBED..(p + 1) * EMBED]));
        logit.push(at.iter().map(|&p| wide[p]).sum());
    }
    Inputs { x, wide: logit }
}

/// Reads rows of a table: the servers (as of a step) or a checkpoint.
type Lookup<'a> = dyn FnMut(&str, &[u64]) -> Result<Vec<f32>> + 'a;

/// Test AUC and mean logistic loss of the model on `test`, its rows read
/// through `lookup`.
pub fn evaluate(trainer: &Trainer, test: &Dataset, lookup: &mut Lookup<'_>) -> Result<(f64, f64)> {
    let mut scores = Vec::with_capacity(test.len());
    let mut loss = 0.0;
    let all: Vec<u32> = (0..test.len() as u32).collect();
    for chunk in all.chunks(2048) {
        let (dense, labels) = test.gather(chunk);
        let (uniq, pos) = distinct(&test.gather_ids(chunk));
        let (deep, wide) = (lookup(DEEP, &uniq)?, lookup(WIDE, &uniq)?);
        let Inputs { x, wide } = inputs(&dense, &pos, &deep, &wide, chunk.len());
        let logits = trainer.model().forward(&x, chunk.len());
        for ((z, w), y) in logits.iter().zip(&wide).zip(&labels) {
            loss += logistic_loss(z + w, *y);
            scores.push(sigmoid(z + w));
        }
    }
    let auc = auc(&scores, &test.labels).context("the test set's labels are all alike")?;
    Ok((auc, loss / test.len().max(1) as f64))
}

/// Test AUC and logistic loss of a checkpoint of the model: its MLP, and
/// its tables' rows (an id it does not hold has its initial values).
pub fn evaluate_checkpoint(r: &Restored, test: &Dataset) -> Result<(f64, f64)> {
    let trainer = Trainer::new(crate::trainer::builtin::mlp_of(r)?);
    let mut held: HashMap<&str, (&crate::ps::SavedTable, HashMap<u64, usize>)> = HashMap::new();
    for t in &r.tables {
        held.insert(&t.spec.name, (t, t.ids.iter().enumerate().map(|(i, &id)| (id, i)).collect()));
    }
    let mut lookup = |table: &str, ids: &[u64]| -> Result<Vec<f32>> {
        let Some((saved, at)) = held.get(table) else {
            bail!("{}: holds no table {table:?} (not a checkpoint of the ctr model)", r.path.display())
        };
        let (dim, width) = (saved.spec.dim, saved.spec.width());
        if saved.rows.len() != saved.ids.len() * width {
            bail!(
                "{}: table {table:?} holds {} values for {} rows of {width}",
                r.path.display(),
                saved.rows.len(),
                saved.ids.len()
            );
        }
        let mut out = vec![0f32; ids.len() * dim];
        for (row, id) in out.chunks_exact_mut(dim).zip(ids) {
            match at.get(id) {
                Some(&i) => row.copy_from_slice(&saved.rows[i * width..i * width + dim]),
                None => saved.spec.init_row(*id, row),
            }
        }
        Ok(out)
    };
    evaluate(&trainer, test, &mut lookup)
}

/// A rank's rows of a step: their dense features and labels, where each
/// of their ids is among the distinct ones, and those ids' rows.
struct Batch<'a> {
    dense: &'a [f32],
    labels: &'a [u32],
    pos: &'a [usize],
    deep: &'a [f32],
    wide: &'a [f32],
}

/// A batch's summed loss, and its gradients (each divided by the step's
/// `global_rows`): the MLP's into the trainer's buffer, each distinct id's
/// rows' returned.
struct Gradients {
    loss: f64,
    deep: Vec<f32>,
    wide: Vec<f32>,
}

fn gradients(trainer: &mut Trainer, b: Batch<'_>, global_rows: usize) -> Result<Gradients> {
    let rows = b.labels.len();
    let Inputs { x, wide: wide_logit } = inputs(b.dense, b.pos, b.deep, b.wide, rows);
    let scale = 1.0 / global_rows.max(1) as f32;
    let mut dx = Vec::new();
    let mut loss = 0.0;
    let mut dlogit = Vec::with_capacity(rows);
    trainer.compute_gradient_of(
        &x,
        rows,
        |logits| {
            for ((z, w), y) in logits.iter().zip(&wide_logit).zip(b.labels) {
                loss += logistic_loss(z + w, *y);
                dlogit.push((sigmoid(z + w) - *y as f32) * scale);
            }
            (loss, dlogit.clone())
        },
        &mut dx,
    )?;
    // Each id's gradient: the sum over the rows and fields that used it.
    let (mut deep, mut wide) = (vec![0f32; b.wide.len() * EMBED], vec![0f32; b.wide.len()]);
    for r in 0..rows {
        for (f, &p) in b.pos[r * FIELDS..(r + 1) * FIELDS].iter().enumerate() {
            let from = &dx[r * input_dim() + DENSE + f * EMBED..][..EMBED];
            deep[p * EMBED..(p + 1) * EMBED].iter_mut().zip(from).for_each(|(g, d)| *g += d);
            wide[p] += dlogit[r];
        }
    }
    Ok(Gradients { loss, deep, wide })
}

/// What one step of a rank computed.
struct Computed {
    /// The rank's summed loss over the step's global rows.
    loss: f64,
    /// The test AUC and loss, when this rank evaluated.
    scores: Option<(f64, f64)>,
}

/// One step of this rank: pulls the rows its samples touch, computes the
/// gradients, pushes the tables' (the MLP's stay in the trainer's buffer
/// for the all-reduce); at an epoch's end rank 0 scores the test set first.
fn compute(
    tables: &mut Tables,
    step: &Step,
    train: &Dataset,
    test: Option<&Dataset>,
    trainer: &mut Trainer,
) -> Result<Computed> {
    let (mark, tag) = (step.ps_mark(), step.ps_tag());
    let scores = match test {
        Some(test) => {
            // Read without making rows: ids seen only in the test set stay off the servers.
            let mut lookup = |table: &str, ids: &[u64]| tables.peek(table, mark, step.step, ids);
            Some(evaluate(trainer, test, &mut lookup)?)
        }
        None => None,
    };
    let rows = step.indices.len();
    let (dense, labels) = train.gather(&step.indices);
    let (uniq, pos) = distinct(&train.gather_ids(&step.indices));
    let (deep, wide) = if rows == 0 {
        (Vec::new(), Vec::new())
    } else {
        (tables.pull(DEEP, mark, step.step, &uniq)?, tables.pull(WIDE, mark, step.step, &uniq)?)
    };
    let g = gradients(
        trainer,
        Batch { dense: &dense, labels: &labels, pos: &pos, deep: &deep, wide: &wide },
        step.global_rows,
    )?;
    if rows > 0 {
        tables.push(DEEP, tag, &uniq, &g.deep)?;
        tables.push(WIDE, tag, &uniq, &g.wide)?;
    }
    Ok(Computed { loss: g.loss / step.global_rows.max(1) as f64, scores })
}

/// Runs a built-in worker of the ctr model until the coordinator stops it.
pub fn run(session: &mut Session, model: &BuiltinModel, train: Dataset) -> Result<()> {
    let id = session.id();
    let spec = session.spec().clone();
    let (_, test) =
        crate::trainer::builtin::load_data(&BuiltinModel { train_samples: None, ..model.clone() })?;
    let mut tables = Tables::new(spec.ps.clone(), session.auth().clone(), id);
    for t in table_specs(spec.seed) {
        tables.define(t, false).with_context(|| format!("worker {id}"))?;
    }
    if let Some(export) = tables.exporter() {
        session.set_table_export(export);
    }
    let trainer = Trainer::new(crate::trainer::model::Mlp::random(&model.layers, spec.seed));
    let mut state = MlpState::new(trainer, mlp_layout(&model.layers));
    session.ready(state.layout.clone(), None)?;
    tracing::info!("worker {id}: ready, {} training samples (ctr)", train.len());
    loop {
        let step = match session.next(&mut state)? {
            Event::Stop(reason) => {
                tracing::info!("worker {id}: {reason}");
                return Ok(());
            }
            Event::Step(s) => s,
        };
        tables.follow(session.ps_topology().cloned());
        tables.restore =
            session.restored_from().map(|p| (session.spec().checkpoint_dir.clone(), p.to_path_buf()));
        let start = Instant::now();
        let scoring = (step.rank == 0 && step.ends_epoch).then_some(&test);
        let computed = compute(&mut tables, &step, &train, scoring, &mut state.trainer);
        if spec.step_delay_ms > 0 {
            std::thread::sleep(std::time::Duration::from_millis(spec.step_delay_ms));
        }
        let done = computed.map(|c| (c, session.all_reduce(state.trainer.grad_mut()).is_ok()));
        let (computed, reduced) = match done {
            Ok(d) => d,
            Err(e) if tables.failed(&e) => {
                tracing::warn!("worker {id}: {e:#}; the step is redone");
                session.fail(e, None)?;
                continue;
            }
            Err(e) => return Err(e.context(format!("worker {id}: step {}", step.step))),
        };
        if !reduced {
            // Reported by the session; the next step is the redone one.
            continue;
        }
        let compute_ms = start.elapsed().as_secs_f64() * 1e3;
        state.trainer.apply(step.hyper.lr, step.hyper.momentum)?;
        if let Err(e) = tables.finish(step.ps_tag()) {
            if !tables.failed(&e) {
                return Err(e.context(format!("worker {id}: step {}", step.step)));
            }
            session.fail(e, None)?;
            continue;
        }
        let metrics = computed.scores.map_or_else(Vec::new, |(auc, loss)| {
            vec![("test_auc".to_string(), auc), ("test_log_loss".to_string(), loss)]
        });
        session.finish_with(computed.loss, compute_ms, metrics)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trainer::clicks::{VOCAB, generate, synthetic};
    use crate::trainer::model::Mlp;

    #[test]
    fn the_data_is_criteo_shaped_seeded_and_learnable() {
        let (a, logits) = generate(4000, 7);
        assert_eq!((a.len(), a.dim, a.fields, a.categorical.len()), (4000, DENSE, FIELDS, 4000 * FIELDS));
        assert_eq!(a, synthetic(4000, 7), "the same rows from the same seed");
        assert_ne!(a, synthetic(4000, 8));
        // Each id carries its field above bit 40; values are Zipf: a few
        // very frequent, a long tail.
        for (i, id) in a.categorical.iter().enumerate() {
            assert_eq!(id >> 40, (i % FIELDS) as u64);
            assert!(id & ((1 << 40) - 1) < VOCAB);
        }
        let first = a.categorical.iter().step_by(FIELDS).filter(|&&id| id == 0).count();
        assert!(first > 4000 / 10, "value 0 is the most frequent: {first}");
        let clicks = a.labels.iter().filter(|&&y| y == 1).count() as f64 / 4000.0;
        assert!((0.15..0.5).contains(&clicks), "{clicks}");
        assert!(a.labels.iter().all(|&y| y <= 1));
        // The hidden model itself ranks the clicks well: a ceiling to learn towards.
        let scores: Vec<f32> = logits.iter().map(|&z| z as f32).collect();
        let ceiling = auc(&scores, &a.labels).unwrap();
        assert!(ceiling > 0.75, "{ceiling}");
    }

    #[test]
    fn auc_counts_every_positive_negative_pair_and_ties_half() {
        let scores = [0.1f32, 0.4, 0.35, 0.8, 0.4, 0.2, 0.9, 0.4];
        let labels = [0u32, 1, 0, 1, 0, 0, 1, 1];
        let (mut wins, mut pairs) = (0.0, 0.0);
        for (p, _) in labels.iter().enumerate().filter(|(_, y)| **y == 1) {
            for (n, _) in labels.iter().enumerate().filter(|(_, y)| **y == 0) {
                pairs += 1.0;
                wins += match scores[p].total_cmp(&scores[n]) {
                    std::cmp::Ordering::Greater => 1.0,
                    std::cmp::Ordering::Equal => 0.5,
                    std::cmp::Ordering::Less => 0.0,
                };
            }
        }
        assert_eq!(auc(&scores, &labels), Some(wins / pairs));
        assert_eq!(auc(&[0.2, 0.9], &[0, 1]), Some(1.0));
        assert_eq!(auc(&[0.2, 0.9], &[1, 0]), Some(0.0));
        assert_eq!(auc(&[0.2, 0.9], &[1, 1]), None, "no negatives");
    }

    /// The batch's loss summed over its rows, as a function of every value
    /// it depends on.
    fn loss_at(model: &Mlp, b: &Batch<'_>) -> f64 {
        let rows = b.labels.len();
        let Inputs { x, wide } = inputs(b.dense, b.pos, b.deep, b.wide, rows);
        let logits = model.forward(&x, rows);
        logits.iter().zip(&wide).zip(b.labels).map(|((z, w), y)| logistic_loss(z + w, *y)).sum()
    }

    /// The central difference of `loss` in `values[i]`, the values left as they were.
    fn central(values: &mut [f32], i: usize, h: f32, loss: impl Fn(&[f32]) -> f64) -> f64 {
        let v = values[i];
        values[i] = v + h;
        let up = loss(values);
        values[i] = v - h;
        let down = loss(values);
        values[i] = v;
        (up - down) / (2.0 * h as f64)
    }

    #[test]
    fn the_gradients_of_the_rows_and_the_mlp_match_finite_differences() {
        let data = synthetic(3, 11);
        let (dense, labels) = data.gather(&[0, 1, 2]);
        // Ids shared between rows (and fields): their gradients are summed.
        let ids: Vec<u64> = (0..3 * FIELDS).map(|i| (i % 5) as u64).collect();
        let (uniq, pos) = distinct(&ids);
        let mut deep: Vec<f32> =
            (0..uniq.len() * EMBED).map(|i| ((i * 37) % 17) as f32 / 17.0 - 0.5).collect();
        let mut wide: Vec<f32> = (0..uniq.len()).map(|i| i as f32 * 0.1 - 0.2).collect();
        let mut trainer = Trainer::new(Mlp::random(&layers(&[6]), 3));
        let global = 5;
        let b = Batch { dense: &dense, labels: &labels, pos: &pos, deep: &deep, wide: &wide };
        let g = gradients(&mut trainer, b, global).unwrap();
        let mlp_grad = trainer.grad_mut().to_vec();
        let model = trainer.model().clone();
        let h = 1e-2f32;
        let close = |a: f32, n: f64, what: String| {
            let n = (n / global as f64) as f32;
            assert!((a - n).abs() < 2e-3 + 0.02 * n.abs(), "{what}: {a} vs {n}")
        };
        let base = Batch { dense: &dense, labels: &labels, pos: &pos, deep: &[], wide: &[] };
        for i in 0..deep.len() {
            let n = central(&mut deep, i, h, |d| loss_at(&model, &Batch { deep: d, wide: &wide, ..base }));
            close(g.deep[i], n, format!("deep value {i}"));
        }
        for i in 0..wide.len() {
            let n = central(&mut wide, i, h, |w| loss_at(&model, &Batch { deep: &deep, wide: w, ..base }));
            close(g.wide[i], n, format!("wide weight {i}"));
        }
        let mut flat = model.params_flat();
        for i in (0..flat.len()).step_by(7) {
            let n = central(&mut flat, i, h, |p| {
                let mut m = model.clone();
                m.load_params_flat(p);
                loss_at(&m, &Batch { deep: &deep, wide: &wide, ..base })
            });
            close(mlp_grad[i], n, format!("MLP parameter {i}"));
        }
        assert!(g.deep.iter().any(|v| v.abs() > 1e-4) && g.wide.iter().any(|v| v.abs() > 1e-4));
    }

    #[test]
    fn a_checkpoint_s_rows_score_as_the_servers_rows_did_and_unheld_ids_start_as_the_servers_make_them() {
        let test = synthetic(300, 5);
        let trainer = Trainer::new(Mlp::random(&layers(&[4]), 2));
        let specs = table_specs(9);
        // The "servers": every row made by its table's initialiser, a few moved.
        let row = |spec: &TableSpec, id: u64| {
            let mut r = vec![0f32; spec.dim];
            spec.init_row(id, &mut r);
            if id.is_multiple_of(3) {
                r.iter_mut().for_each(|v| *v += 0.25);
            }
            r
        };
        let mut served = |table: &str, ids: &[u64]| -> Result<Vec<f32>> {
            let spec = specs.iter().find(|s| s.name == table).unwrap();
            Ok(ids.iter().flat_map(|&id| row(spec, id)).collect())
        };
        let live = evaluate(&trainer, &test, &mut served).unwrap();
        // The checkpoint holds only the moved rows (and their optimiser state).
        let tables = specs
            .iter()
            .map(|spec| {
                let ids: Vec<u64> = test.categorical.iter().copied().filter(|id| id % 3 == 0).collect();
                let rows = ids
                    .iter()
                    .flat_map(|&id| [row(spec, id), vec![0.5; spec.width() - spec.dim]].concat())
                    .collect();
                crate::ps::SavedTable { spec: spec.clone(), updates: vec![1; ids.len()], ids, rows }
            })
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let layout = mlp_layout(&trainer.model().sizes());
        let mut values = trainer.params_flat();
        values.extend(vec![0.0; values.len()]);
        let r = Restored {
            path: dir.path().join("step-1"),
            manifest: crate::checkpoint::Manifest {
                step: 1,
                epoch: 0,
                cursor: 0,
                seed: 0,
                hyperparams: Default::default(),
                plugin_state: Default::default(),
                files: Default::default(),
                fence: None,
            },
            layout,
            values,
            tables,
        };
        assert_eq!(evaluate_checkpoint(&r, &test).unwrap(), live);
        assert!(live.0 > 0.3 && live.1 > 0.0);
    }
}
