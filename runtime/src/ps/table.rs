//! A sparse table's rows on one server: float32 rows of the table's
//! dimension, created on first touch with a seeded initialiser (the same
//! values whichever server creates a row, so a shard can move or be rebuilt
//! without changing the model), each with its optimiser's state beside it.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// How many shards every table is split into. Fixed for the life of a
/// job (and its checkpoints): servers own shards, not ids, so adding a
/// server moves whole shards and a checkpoint can be read on any number of
/// servers.
pub const SHARDS: u32 = 1024;

/// What a table is: its name, row width, optimiser and initialiser.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TableSpec {
    pub name: String,
    pub dim: usize,
    pub optimizer: Optimizer,
    pub init: Init,
    /// Seeds the initialiser (with the table's name and each row's id).
    #[serde(default)]
    pub seed: u64,
}

/// The optimiser a server applies to each row it is pushed a gradient for.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Optimizer {
    Sgd {
        lr: f32,
    },
    /// Duchi et al.: a per-element sum of squared gradients, started at `initial`.
    Adagrad {
        lr: f32,
        eps: f32,
        initial: f32,
    },
    /// Kingma and Ba as `torch.optim.SparseAdam` (and TorchRec's fused
    /// Adam) apply it: a row's moments move only when it is updated, and
    /// the bias corrections count the job's steps (the `t`-th step of the
    /// job, whichever steps the row was in), the step size
    /// `lr * sqrt(1 - beta2^t) / (1 - beta1^t)` times `m / (sqrt(v) + eps)`.
    Adam {
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
    },
}

impl Optimizer {
    pub fn sgd(lr: f32) -> Self {
        Optimizer::Sgd { lr }
    }
    pub fn adagrad(lr: f32) -> Self {
        Optimizer::Adagrad { lr, eps: 1e-10, initial: 0.0 }
    }
    pub fn adam(lr: f32) -> Self {
        Optimizer::Adam { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8 }
    }

    /// State vectors of the row's width kept beside each row.
    pub fn slots(&self) -> usize {
        match self {
            Optimizer::Sgd { .. } => 0,
            Optimizer::Adagrad { .. } => 1,
            Optimizer::Adam { .. } => 2,
        }
    }

    /// Checks the hyper-parameters: finite, and where they must be, positive.
    pub fn check(&self) -> Result<(), String> {
        let ok = |name: &str, v: f32, lo: f32, hi: f32| {
            if v.is_finite() && v >= lo && v <= hi {
                Ok(())
            } else {
                Err(format!("{name} = {v} is outside [{lo}, {hi}]"))
            }
        };
        match *self {
            Optimizer::Sgd { lr } => ok("lr", lr, 0.0, f32::MAX),
            Optimizer::Adagrad { lr, eps, initial } => {
                ok("lr", lr, 0.0, f32::MAX)?;
                ok("eps", eps, 0.0, 1.0)?;
                ok("initial", initial, 0.0, f32::MAX)
            }
            Optimizer::Adam { lr, beta1, beta2, eps } => {
                ok("lr", lr, 0.0, f32::MAX)?;
                ok("beta1", beta1, 0.0, 0.999_999)?;
                ok("beta2", beta2, 0.0, 0.999_999_9)?;
                ok("eps", eps, 0.0, 1.0)
            }
        }
    }

    /// Adam's step size at the job's step `step` (its `step + 1`-th: the
    /// bias corrections count the job's steps); 1 for the others.
    pub fn step_size(&self, step: u64) -> f32 {
        match *self {
            Optimizer::Adam { lr, beta1, beta2, .. } => {
                let t = i32::try_from(step.saturating_add(1)).unwrap_or(i32::MAX);
                let (c1, c2) = (1.0 - f64::from(beta1).powi(t), 1.0 - f64::from(beta2).powi(t));
                (f64::from(lr) * c2.sqrt() / c1) as f32
            }
            _ => 1.0,
        }
    }

    /// One update of `row` (and its `state`, `slots()` vectors of its
    /// width) by `grad`; `step_size` from [`Optimizer::step_size`] for the
    /// step the update is in.
    fn apply(&self, row: &mut [f32], state: &mut [f32], step_size: f32, grad: &[f32]) {
        let d = row.len();
        match *self {
            Optimizer::Sgd { lr } => {
                for (w, g) in row.iter_mut().zip(grad) {
                    *w -= lr * g;
                }
            }
            Optimizer::Adagrad { lr, eps, .. } => {
                for ((w, acc), g) in row.iter_mut().zip(&mut state[..d]).zip(grad) {
                    *acc += g * g;
                    *w -= lr * g / (acc.sqrt() + eps);
                }
            }
            Optimizer::Adam { beta1, beta2, eps, .. } => {
                let (m, v) = state.split_at_mut(d);
                for i in 0..d {
                    let g = grad[i];
                    m[i] = beta1 * m[i] + (1.0 - beta1) * g;
                    v[i] = beta2 * v[i] + (1.0 - beta2) * g * g;
                    row[i] -= step_size * m[i] / (v[i].sqrt() + eps);
                }
            }
        }
    }

    fn initial_state(&self, state: &mut [f32]) {
        let fill = match *self {
            Optimizer::Adagrad { initial, .. } => initial,
            _ => 0.0,
        };
        state.fill(fill);
    }
}

/// How a row's values start.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Init {
    Zeros,
    /// Uniform in `[-scale, scale]`.
    Uniform {
        scale: f32,
    },
    /// Normal with mean 0.
    Normal {
        std: f32,
    },
}

/// SplitMix64's finaliser: a well-mixed 64-bit hash of a 64-bit value.
pub(crate) fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A stable 64-bit hash of a name (FNV-1a, then mixed): the same in every
/// process and every build, unlike `std`'s hasher.
pub(crate) fn name_hash(name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    mix(h)
}

/// A uniform value in `(0, 1)` from a hash (24 bits, never 0).
fn unit(h: u64) -> f32 {
    ((h >> 40) as f32 + 0.5) / (1u64 << 24) as f32
}

impl TableSpec {
    /// Checks the spec; the error names the table.
    pub fn check(&self) -> Result<(), String> {
        if self.name.is_empty() || self.name.len() > 128 || self.name.chars().any(|c| c.is_control()) {
            return Err(format!("table name {:?}: 1-128 printable characters", self.name));
        }
        if self.dim == 0 || self.dim > 1 << 16 {
            return Err(format!("table {:?}: dimension {} is outside 1..=65536", self.name, self.dim));
        }
        self.optimizer.check().map_err(|e| format!("table {:?}: optimizer {e}", self.name))?;
        let scale = match self.init {
            Init::Zeros => 0.0,
            Init::Uniform { scale } => scale,
            Init::Normal { std } => std,
        };
        if !(scale.is_finite() && scale >= 0.0) {
            return Err(format!("table {:?}: initialiser scale {scale} must be finite and >= 0", self.name));
        }
        Ok(())
    }

    /// The shard row `id` of this table lives in.
    pub fn shard_of(&self, id: u64) -> u32 {
        (mix(id ^ name_hash(&self.name)) % SHARDS as u64) as u32
    }

    /// Row `id`'s initial values (the same on every server).
    pub fn init_row(&self, id: u64, row: &mut [f32]) {
        let base = mix(self.seed ^ name_hash(&self.name)) ^ mix(id);
        let at = |j: usize| mix(base.wrapping_add(j as u64));
        match self.init {
            Init::Zeros => row.fill(0.0),
            Init::Uniform { scale } => {
                for (j, v) in row.iter_mut().enumerate() {
                    *v = (2.0 * unit(at(j)) - 1.0) * scale;
                }
            }
            Init::Normal { std } => {
                // Box-Muller on two uniforms per value.
                for (j, v) in row.iter_mut().enumerate() {
                    let h = at(j);
                    let (u1, u2) = (unit(h), unit(mix(h)));
                    *v = std * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos();
                }
            }
        }
    }

    /// Floats kept per row: the row and its optimiser's state.
    pub fn width(&self) -> usize {
        self.dim * (1 + self.optimizer.slots())
    }

    /// Bytes a row costs on a server: its floats, its update count and its
    /// place in the index (a hash map entry and its share of spare capacity).
    pub fn row_bytes(&self) -> u64 {
        (self.width() * 4 + 4 + 24) as u64
    }
}

/// A table's rows as a checkpoint keeps them: per row its id, its values
/// and optimiser state (`dim * (1 + slots)` floats), and its update count.
#[derive(Clone, Debug, PartialEq)]
pub struct SavedTable {
    pub spec: TableSpec,
    pub ids: Vec<u64>,
    pub rows: Vec<f32>,
    pub updates: Vec<u32>,
}

/// The rows of one shard of a table.
#[derive(Default, Debug)]
pub struct Rows {
    index: rustc_hash::FxHashMap<u64, u32>,
    /// Per row: its values, then its optimiser's state.
    data: Vec<f32>,
    /// Per row: how many updates it had.
    updates: Vec<u32>,
}

impl Rows {
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    pub fn contains(&self, id: u64) -> bool {
        self.index.contains_key(&id)
    }

    /// Row `id`'s place, created with its initial values if it is new
    /// (then `true` beside it).
    fn slot(&mut self, spec: &TableSpec, id: u64) -> (usize, bool) {
        let w = spec.width();
        let next = self.updates.len() as u32;
        let at = *self.index.entry(id).or_insert(next) as usize;
        let new = at == self.updates.len();
        if new {
            self.data.resize(self.data.len() + w, 0.0);
            let row = &mut self.data[at * w..(at + 1) * w];
            let (values, state) = row.split_at_mut(spec.dim);
            spec.init_row(id, values);
            spec.optimizer.initial_state(state);
            self.updates.push(0);
        }
        (at, new)
    }

    /// Row `id`'s place (created if new), and whether it was made: its
    /// values are then [`Rows::values`] of it.
    pub fn place(&mut self, spec: &TableSpec, id: u64) -> (u32, bool) {
        let (at, new) = self.slot(spec, id);
        (at as u32, new)
    }

    /// The values of the row at `at` (a place [`Rows::place`] gave).
    pub fn values(&self, spec: &TableSpec, at: u32) -> &[f32] {
        let at = at as usize * spec.width();
        &self.data[at..at + spec.dim]
    }

    /// Copies row `id` (created if new) into `out`; true when it was made.
    pub fn read(&mut self, spec: &TableSpec, id: u64, out: &mut [f32]) -> bool {
        let (at, new) = self.slot(spec, id);
        let w = spec.width();
        out.copy_from_slice(&self.data[at * w..at * w + spec.dim]);
        new
    }

    /// Copies row `id` into `out`, or its initial values where it is not
    /// held (nothing is made).
    pub fn peek(&self, spec: &TableSpec, id: u64, out: &mut [f32]) {
        match self.index.get(&id) {
            Some(&at) => {
                let (at, w) = (at as usize, spec.width());
                out.copy_from_slice(&self.data[at * w..at * w + spec.dim]);
            }
            None => spec.init_row(id, out),
        }
    }

    /// Applies a gradient to row `id` (created if new) in the job's step `step`.
    pub fn update(&mut self, spec: &TableSpec, id: u64, grad: &[f32], step: u64) {
        let (at, _) = self.place(spec, id);
        self.update_at(spec, at, grad, &mut Vec::new(), spec.optimizer.step_size(step));
    }

    /// Applies a gradient to the row at `at` (a place [`Rows::place`]
    /// gave), first appending it whole (values, then optimiser state) to
    /// `before`: what undoes the update. Returns its update count before.
    pub fn update_at(
        &mut self,
        spec: &TableSpec,
        at: u32,
        grad: &[f32],
        before: &mut Vec<f32>,
        step_size: f32,
    ) -> u32 {
        let (at, w) = (at as usize, spec.width());
        let row = &mut self.data[at * w..(at + 1) * w];
        before.extend_from_slice(row);
        let had = self.updates[at];
        self.updates[at] += 1;
        let (values, state) = row.split_at_mut(spec.dim);
        spec.optimizer.apply(values, state, step_size, grad);
        had
    }

    /// Puts row `id` (values then optimiser state) with its update count.
    pub fn put(&mut self, spec: &TableSpec, id: u64, row: &[f32], updates: u32) {
        let (at, _) = self.slot(spec, id);
        let w = spec.width();
        self.data[at * w..(at + 1) * w].copy_from_slice(row);
        self.updates[at] = updates;
    }

    /// Every row, in no order: its id, its `w` floats (values, then
    /// optimiser state) and its update count.
    pub fn each(&self, w: usize) -> impl Iterator<Item = (u64, &[f32], u32)> {
        self.index.iter().map(move |(&id, &at)| {
            let at = at as usize;
            (id, &self.data[at * w..(at + 1) * w], self.updates[at])
        })
    }

    /// Every row: its id, values, optimiser state and update count, by id.
    pub fn export(&self, spec: &TableSpec) -> BTreeMap<u64, (Vec<f32>, Vec<f32>, u32)> {
        let w = spec.width();
        self.index
            .iter()
            .map(|(&id, &at)| {
                let at = at as usize;
                let row = &self.data[at * w..(at + 1) * w];
                (id, (row[..spec.dim].to_vec(), row[spec.dim..].to_vec(), self.updates[at]))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(optimizer: Optimizer, init: Init) -> TableSpec {
        TableSpec { name: "user".into(), dim: 4, optimizer, init, seed: 7 }
    }

    #[test]
    fn adam_counts_the_job_s_steps_as_sparse_adam_does_not_the_row_s_updates() {
        let s = spec(Optimizer::adam(0.01), Init::Zeros);
        let g = [0.5f32, -1.0, 2.0, 0.0];
        // A row first updated at the job's step 999 (its first update, the
        // job's 1000th step): SparseAdam's step, not a first step's.
        let mut rows = Rows::default();
        rows.update(&s, 1, &g, 999);
        let mut out = [0f32; 4];
        rows.read(&s, 1, &mut out);
        for (w, g) in out.iter().zip(g) {
            let (g, t) = (g as f64, 1000);
            let (m, v) = (0.1 * g, 0.001 * g * g);
            let size = 0.01 * (1.0 - 0.999f64.powi(t)).sqrt() / (1.0 - 0.9f64.powi(t));
            let want = -size * m / (v.sqrt() + 1e-8);
            assert!((*w as f64 - want).abs() < 1e-6, "{w} {want}");
        }
        // Steps past i32 are the same as its largest (the corrections are 1 long before).
        assert_eq!(s.optimizer.step_size(u64::MAX), s.optimizer.step_size(i32::MAX as u64));
        assert_eq!(Optimizer::sgd(0.1).step_size(5), 1.0);
    }

    #[test]
    fn a_row_starts_the_same_wherever_it_is_made_and_differs_from_its_neighbours() {
        let s = spec(Optimizer::sgd(0.1), Init::Uniform { scale: 0.05 });
        let (mut a, mut b) = (Rows::default(), Rows::default());
        let (mut x, mut y, mut z) = ([0f32; 4], [0f32; 4], [0f32; 4]);
        b.read(&s, 99, &mut z);
        a.read(&s, 12345, &mut x);
        b.read(&s, 12345, &mut y);
        assert_eq!(x, y);
        assert_ne!(x, z);
        assert!(x.iter().all(|v| v.abs() <= 0.05) && x.iter().any(|v| *v != 0.0), "{x:?}");
        let other = TableSpec { seed: 8, ..s.clone() };
        let mut w = [0f32; 4];
        Rows::default().read(&other, 12345, &mut w);
        assert_ne!(x, w, "another seed, other values");
    }

    #[test]
    fn the_initialisers_have_the_moments_they_promise() {
        let n = 20_000;
        let moments = |init| {
            let s = TableSpec { dim: 1, ..spec(Optimizer::sgd(0.1), init) };
            let mut v = [0f32];
            let xs: Vec<f64> = (0..n)
                .map(|id| {
                    s.init_row(id, &mut v);
                    v[0] as f64
                })
                .collect();
            let mean = xs.iter().sum::<f64>() / n as f64;
            let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
            (mean, var)
        };
        let (m, v) = moments(Init::Uniform { scale: 1.0 });
        assert!(m.abs() < 0.02 && (v - 1.0 / 3.0).abs() < 0.02, "uniform: {m} {v}");
        let (m, v) = moments(Init::Normal { std: 2.0 });
        assert!(m.abs() < 0.05 && (v - 4.0).abs() < 0.15, "normal: {m} {v}");
    }

    #[test]
    fn each_optimizer_matches_its_formula() {
        let g = [0.5f32, -1.0, 2.0, 0.0];
        // Two updates of a row that starts at zero, against the formulas in f64.
        let run = |o: Optimizer| {
            let s = spec(o, Init::Zeros);
            let mut rows = Rows::default();
            rows.update(&s, 1, &g, 0);
            rows.update(&s, 1, &g, 1);
            let mut out = [0f32; 4];
            rows.read(&s, 1, &mut out);
            out
        };
        let close = |a: [f32; 4], b: [f64; 4]| a.iter().zip(b).all(|(x, y)| (*x as f64 - y).abs() < 1e-5);
        let sgd = g.map(|g| -2.0 * 0.1 * g as f64);
        assert!(close(run(Optimizer::sgd(0.1)), sgd));
        let ada = g.map(|g| {
            let g = g as f64;
            let a1 = g * g;
            let w1 = -0.1 * g / (a1.sqrt() + 1e-10);
            w1 - 0.1 * g / ((2.0 * a1).sqrt() + 1e-10)
        });
        assert!(close(run(Optimizer::adagrad(0.1)), ada), "{:?} {ada:?}", run(Optimizer::adagrad(0.1)));
        let adam = g.map(|g| {
            let (g, mut m, mut v, mut w) = (g as f64, 0.0, 0.0, 0.0);
            for t in 1..=2 {
                m = 0.9 * m + 0.1 * g;
                v = 0.999 * v + 0.001 * g * g;
                let size = 0.01 * (1.0 - 0.999f64.powi(t)).sqrt() / (1.0 - 0.9f64.powi(t));
                w -= size * m / (v.sqrt() + 1e-8);
            }
            w
        });
        assert!(close(run(Optimizer::adam(0.01)), adam), "{:?} {adam:?}", run(Optimizer::adam(0.01)));
    }

    #[test]
    fn specs_out_of_range_are_refused_by_name() {
        let bad = [
            TableSpec { dim: 0, ..spec(Optimizer::sgd(0.1), Init::Zeros) },
            spec(Optimizer::sgd(f32::NAN), Init::Zeros),
            spec(Optimizer::Adam { lr: 0.1, beta1: 1.0, beta2: 0.9, eps: 1e-8 }, Init::Zeros),
            spec(Optimizer::sgd(0.1), Init::Uniform { scale: -1.0 }),
        ];
        for s in bad {
            let e = s.check().unwrap_err();
            assert!(e.contains("\"user\""), "{e}");
        }
        assert!(TableSpec { name: String::new(), ..spec(Optimizer::sgd(0.1), Init::Zeros) }.check().is_err());
        spec(Optimizer::adam(0.1), Init::Normal { std: 0.01 }).check().unwrap();
    }

    #[test]
    fn ids_spread_over_the_shards() {
        let s = spec(Optimizer::sgd(0.1), Init::Zeros);
        let mut count = vec![0u32; SHARDS as usize];
        for id in 0..(SHARDS as u64 * 100) {
            count[s.shard_of(id) as usize] += 1;
        }
        let (lo, hi) = (count.iter().min().unwrap(), count.iter().max().unwrap());
        assert!(*lo > 50 && *hi < 160, "{lo}..{hi}");
    }
}
