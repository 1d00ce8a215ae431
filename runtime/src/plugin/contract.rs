//! What a plugin's answers must satisfy before the runtime uses them. Every
//! loaded plugin, sandboxed or native, is wrapped in [`Checked`], so no path
//! (the worker's own transform, the DistillReader, simulation, replay) sees an
//! answer that breaks the contract; a broken answer is an
//! [`Error::Contract`] naming the plugin file and the call.
//!
//! - `apply` (reader transform): the same samples out as in: as many rows as
//!   labels as ids, the output ids a permutation of the input's, a shape whose
//!   product matches the data buffer, finite `float32` values.
//! - `on-resize` / `on-step` (batch adapter): a finite learning rate above 0,
//!   a momentum in [0, 1), global and local batches of at least 1 with the
//!   local batch not above the global one.
//! - `decide` (scaling policy): any list of actions; the coordinator reduces
//!   it to one target size within its bounds (see `docs/plugins.md`).
//! - `decide` (teacher policy): any plan; the host clamps its teacher count
//!   to the view's `min_teachers..=max_teachers` and its requests in flight
//!   to 1..=64, and logs what it changed ([`clamp_teacher_plan`]).

use super::{
    AdapterPlugin, Backend, Error, Loaded, Plugin, PolicyPlugin, TeacherPolicyPlugin, TransformPlugin,
};
use edl_plugin_sdk::{
    Action, Batch, ClusterView, Dtype, Hyperparams, PluginInfo, ResizeEvent, TeacherPlan, TeacherView,
};
use std::fmt;

/// A plugin whose answers are checked against the contract.
pub struct Checked<T: ?Sized> {
    path: String,
    inner: Box<T>,
}

/// Wraps whatever was loaded from `path`.
pub fn checked(loaded: Loaded, path: &str) -> Loaded {
    let path = path.to_string();
    match loaded {
        Loaded::Policy(inner) => Loaded::Policy(Box::new(Checked { path, inner })),
        Loaded::Adapter(inner) => Loaded::Adapter(Box::new(Checked { path, inner })),
        Loaded::Transform(inner) => Loaded::Transform(Box::new(Checked { path, inner })),
        Loaded::TeacherPolicy(inner) => Loaded::TeacherPolicy(Box::new(Checked { path, inner })),
    }
}

/// The most requests a student may keep in flight at one teacher.
pub const MAX_IN_FLIGHT_PER_TEACHER: u32 = 64;

/// What the host changed in a teacher plan to bring it within bounds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TeacherPlanClamp {
    /// The plan as the policy gave it.
    pub asked: TeacherPlan,
    /// The plan the pool gets.
    pub used: TeacherPlan,
    /// The teacher bounds of the view it answered.
    pub min_teachers: u32,
    pub max_teachers: u32,
}

impl fmt::Display for TeacherPlanClamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if self.asked.teachers != self.used.teachers {
            parts.push(format!(
                "{} teachers, outside {}..={}; {} used",
                self.asked.teachers, self.min_teachers, self.max_teachers, self.used.teachers
            ));
        }
        if self.asked.in_flight_per_teacher != self.used.in_flight_per_teacher {
            parts.push(format!(
                "{} requests in flight per teacher, outside 1..={MAX_IN_FLIGHT_PER_TEACHER}; {} used",
                self.asked.in_flight_per_teacher, self.used.in_flight_per_teacher
            ));
        }
        write!(f, "asked for {}", parts.join(" and "))
    }
}

/// Brings a teacher plan within the view's bounds: `teachers` to
/// `min_teachers..=max_teachers` (bounds given the wrong way round count as
/// `max_teachers..=max_teachers`), `in_flight_per_teacher` to 1..=64.
/// Returns the plan to use and, when it differs from `plan`, what changed.
pub fn clamp_teacher_plan(view: &TeacherView, plan: TeacherPlan) -> (TeacherPlan, Option<TeacherPlanClamp>) {
    let (max, min) = (view.max_teachers, view.min_teachers.min(view.max_teachers));
    let used = TeacherPlan {
        teachers: plan.teachers.clamp(min, max),
        in_flight_per_teacher: plan.in_flight_per_teacher.clamp(1, MAX_IN_FLIGHT_PER_TEACHER),
    };
    let clamp = (used != plan).then_some(TeacherPlanClamp {
        asked: plan,
        used,
        min_teachers: view.min_teachers,
        max_teachers: view.max_teachers,
    });
    (used, clamp)
}

/// The most memory a plugin may hand over: it is stored at every commit.
pub const MAX_STATE_BYTES: usize = 64 << 10;

/// How a plugin's answer breaks the contract.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ContractBreach {
    #[error("saved {bytes} bytes of state, more than the {MAX_STATE_BYTES} allowed")]
    StateTooLarge { bytes: usize },
    #[error("learning rate {0} (must be finite and above 0)")]
    LearningRate(f32),
    #[error("momentum {0} (must be in [0, 1))")]
    Momentum(f32),
    #[error("global batch {global} and local batch {local} (both must be at least 1)")]
    ZeroBatch { global: u32, local: u32 },
    #[error("local batch {local} above the global batch {global}")]
    LocalAboveGlobal { local: u32, global: u32 },
    #[error("{labels} labels for {ids} sample ids")]
    LabelCount { labels: usize, ids: usize },
    #[error("{out} samples out of {input} in")]
    SampleCount { out: usize, input: usize },
    #[error("shape {shape:?} says {first} samples, the batch has {rows}")]
    ShapeRows { shape: Vec<u32>, first: u32, rows: usize },
    #[error("an empty shape")]
    EmptyShape,
    /// The shape's size (None: more than can be addressed) is not the data's.
    #[error("shape {shape:?} of {dtype:?} needs {} bytes, the data has {data}", needed(.needs))]
    DataSize { shape: Vec<u32>, dtype: Dtype, needs: Option<usize>, data: usize },
    #[error("sample id {0} was not in the input")]
    ForeignId(u64),
    #[error("sample id {0} of the input is missing (another one repeats)")]
    MissingId(u64),
    #[error("the sample ids are not those of the input")]
    OtherIds,
    #[error("value {value} of sample {sample} is not finite")]
    NotFinite { value: usize, sample: usize },
}

fn needed(bytes: &Option<usize>) -> String {
    bytes.map_or("more than addressable".to_string(), |b| b.to_string())
}

impl<T: ?Sized + Plugin> Plugin for Checked<T> {
    fn info(&self) -> &PluginInfo {
        self.inner.info()
    }

    fn backend(&self) -> Backend {
        self.inner.backend()
    }

    fn save_state(&mut self) -> Result<Option<Vec<u8>>, Error> {
        let state = self.inner.save_state()?;
        if let Some(bytes) = &state
            && bytes.len() > MAX_STATE_BYTES
        {
            return Err(self.broken("save", ContractBreach::StateTooLarge { bytes: bytes.len() }));
        }
        Ok(state)
    }

    fn load_state(&mut self, bytes: &[u8]) -> Result<bool, Error> {
        self.inner.load_state(bytes)
    }
}

impl<T: ?Sized + PolicyPlugin> PolicyPlugin for Checked<T> {
    fn decide(&mut self, view: &ClusterView) -> Result<Vec<Action>, Error> {
        self.inner.decide(view)
    }

    fn on_training(&mut self, stats: &edl_plugin_sdk::TrainingStats) -> Result<bool, Error> {
        self.inner.on_training(stats)
    }

    fn decide_servers(&mut self, view: &edl_plugin_sdk::ServerView) -> Result<Option<u32>, Error> {
        self.inner.decide_servers(view)
    }

    fn decide_spares(&mut self, view: &edl_plugin_sdk::SpareView) -> Result<Option<u32>, Error> {
        self.inner.decide_spares(view)
    }
}

impl<T: ?Sized + TeacherPolicyPlugin> TeacherPolicyPlugin for Checked<T> {
    fn decide(&mut self, view: &TeacherView) -> Result<TeacherPlan, Error> {
        let (plan, clamp) = clamp_teacher_plan(view, self.inner.decide(view)?);
        if let Some(clamp) = clamp {
            tracing::warn!(target: "edl::plugin", "{}: decide {clamp}", self.path);
        }
        Ok(plan)
    }
}

impl<T: ?Sized + AdapterPlugin> AdapterPlugin for Checked<T> {
    fn on_resize(&mut self, event: &ResizeEvent, current: &Hyperparams) -> Result<Hyperparams, Error> {
        let h = self.inner.on_resize(event, current)?;
        check_hyperparams(&h).map_err(|detail| self.broken("on-resize", detail))?;
        Ok(h)
    }

    fn on_step(&mut self, step: u64, current: &Hyperparams) -> Result<Hyperparams, Error> {
        let h = self.inner.on_step(step, current)?;
        check_hyperparams(&h).map_err(|detail| self.broken("on-step", detail))?;
        Ok(h)
    }

    fn on_training(&mut self, stats: &edl_plugin_sdk::TrainingStats) -> Result<bool, Error> {
        self.inner.on_training(stats)
    }
}

impl<T: ?Sized + TransformPlugin> TransformPlugin for Checked<T> {
    fn apply(&mut self, batch: &Batch) -> Result<Batch, Error> {
        let out = self.inner.apply(batch)?;
        check_batch(batch, &out).map_err(|detail| self.broken("apply", detail))?;
        Ok(out)
    }
}

impl<T: ?Sized> Checked<T> {
    fn broken(&self, call: &'static str, breach: ContractBreach) -> Error {
        Error::Contract { path: self.path.clone(), call, detail: breach.to_string() }
    }
}

/// Hyperparameters a job can train with.
pub fn check_hyperparams(h: &Hyperparams) -> Result<(), ContractBreach> {
    if !(h.lr.is_finite() && h.lr > 0.0) {
        return Err(ContractBreach::LearningRate(h.lr));
    }
    if !(h.momentum.is_finite() && (0.0..1.0).contains(&h.momentum)) {
        return Err(ContractBreach::Momentum(h.momentum));
    }
    if h.global_batch == 0 || h.local_batch == 0 {
        return Err(ContractBreach::ZeroBatch { global: h.global_batch, local: h.local_batch });
    }
    if h.local_batch > h.global_batch {
        return Err(ContractBreach::LocalAboveGlobal { local: h.local_batch, global: h.global_batch });
    }
    Ok(())
}

/// A transform's output against its input.
pub fn check_batch(input: &Batch, out: &Batch) -> Result<(), ContractBreach> {
    let rows = out.ids.len();
    if out.labels.len() != rows {
        return Err(ContractBreach::LabelCount { labels: out.labels.len(), ids: rows });
    }
    if rows != input.ids.len() {
        return Err(ContractBreach::SampleCount { out: rows, input: input.ids.len() });
    }
    match out.shape.first() {
        Some(&n) if n as usize == rows => {}
        Some(&first) => return Err(ContractBreach::ShapeRows { shape: out.shape.clone(), first, rows }),
        None => return Err(ContractBreach::EmptyShape),
    }
    let elems = out.shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d as usize));
    let needs = elems.and_then(|e| e.checked_mul(out.dtype.size()));
    if needs != Some(out.data.len()) {
        return Err(ContractBreach::DataSize {
            shape: out.shape.clone(),
            dtype: out.dtype,
            needs,
            data: out.data.len(),
        });
    }
    let mut before = input.ids.clone();
    let mut after = out.ids.clone();
    before.sort_unstable();
    after.sort_unstable();
    if before != after {
        let missing = before.iter().find(|i| after.binary_search(i).is_err());
        let foreign = after.iter().find(|i| before.binary_search(i).is_err());
        return Err(match (missing, foreign) {
            (_, Some(&f)) => ContractBreach::ForeignId(f),
            (Some(&m), None) => ContractBreach::MissingId(m),
            (None, None) => ContractBreach::OtherIds,
        });
    }
    if out.dtype == Dtype::Float32 {
        let row = out.data.len() / rows.max(1);
        if let Some(at) =
            out.data.chunks_exact(4).position(|c| !f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite())
        {
            return Err(ContractBreach::NotFinite {
                value: at % (row / 4).max(1),
                sample: at * 4 / row.max(1),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(rows: usize, width: usize) -> Batch {
        let x: Vec<f32> = (0..rows * width).map(|i| i as f32).collect();
        Batch {
            data: x.iter().flat_map(|v| v.to_le_bytes()).collect(),
            shape: vec![rows as u32, width as u32],
            dtype: Dtype::Float32,
            labels: (0..rows as u32).collect(),
            ids: (10..10 + rows as u64).collect(),
            seed: 1,
        }
    }

    #[test]
    fn an_unchanged_or_reordered_batch_passes() {
        let b = batch(4, 3);
        check_batch(&b, &b).unwrap();
        let mut r = b.clone();
        r.ids.reverse();
        check_batch(&b, &r).unwrap();
    }

    #[test]
    fn each_broken_output_is_named() {
        let b = batch(4, 3);
        let cases: Vec<(Box<dyn Fn(&mut Batch)>, &str)> = vec![
            (Box::new(|o| o.labels.pop().map(drop).unwrap_or(())), "3 labels for 4 sample ids"),
            (
                Box::new(|o| {
                    o.ids.pop();
                    o.labels.pop();
                }),
                "3 samples out of 4 in",
            ),
            (Box::new(|o| o.shape[1] = 4), "needs 64 bytes, the data has 48"),
            (Box::new(|o| o.shape[0] = 5), "says 5 samples"),
            (Box::new(|o| o.shape.clear()), "an empty shape"),
            (Box::new(|o| o.ids[0] = 99), "sample id 99 was not in the input"),
            (Box::new(|o| o.ids[0] = 11), "sample id 10 of the input is missing"),
            (Box::new(|o| o.data[8..12].copy_from_slice(&f32::NAN.to_le_bytes())), "value 2 of sample 0"),
            (Box::new(|o| o.shape = vec![4, u32::MAX, u32::MAX, u32::MAX]), "more than addressable"),
        ];
        for (break_it, want) in cases {
            let mut o = b.clone();
            break_it(&mut o);
            let e = check_batch(&b, &o).unwrap_err().to_string();
            assert!(e.contains(want), "{e:?} should say {want:?}");
        }
    }

    #[test]
    fn a_teacher_plan_is_clamped_to_the_bounds_and_the_change_is_described() {
        let view = TeacherView { min_teachers: 2, max_teachers: 6, ..Default::default() };
        let ok = TeacherPlan { teachers: 4, in_flight_per_teacher: 8 };
        assert_eq!(clamp_teacher_plan(&view, ok), (ok, None));
        for (asked, used, want) in [
            ((9, 8), (6, 8), "asked for 9 teachers, outside 2..=6; 6 used"),
            ((0, 8), (2, 8), "asked for 0 teachers, outside 2..=6; 2 used"),
            ((4, 0), (4, 1), "asked for 0 requests in flight per teacher, outside 1..=64; 1 used"),
            ((4, 500), (4, 64), "500 requests in flight per teacher, outside 1..=64; 64 used"),
            ((1, 99), (2, 64), "1 teachers, outside 2..=6; 2 used and 99 requests"),
        ] {
            let asked = TeacherPlan { teachers: asked.0, in_flight_per_teacher: asked.1 };
            let (plan, clamp) = clamp_teacher_plan(&view, asked);
            assert_eq!(plan, TeacherPlan { teachers: used.0, in_flight_per_teacher: used.1 });
            let said = clamp.expect("a change is described").to_string();
            assert!(said.contains(want), "{said:?} should say {want:?}");
        }
        // Bounds the wrong way round: the maximum wins.
        let odd = TeacherView { min_teachers: 5, max_teachers: 3, ..Default::default() };
        assert_eq!(clamp_teacher_plan(&odd, ok).0.teachers, 3);
    }

    #[test]
    fn hyperparameters_outside_their_ranges_are_refused() {
        let ok = Hyperparams { global_batch: 64, local_batch: 32, lr: 0.1, momentum: 0.9 };
        check_hyperparams(&ok).unwrap();
        for (h, want) in [
            (Hyperparams { lr: f32::NAN, ..ok }, "learning rate NaN"),
            (Hyperparams { lr: f32::INFINITY, ..ok }, "learning rate inf"),
            (Hyperparams { lr: 0.0, ..ok }, "learning rate 0"),
            (Hyperparams { lr: -1.0, ..ok }, "learning rate -1"),
            (Hyperparams { momentum: 1.0, ..ok }, "momentum 1"),
            (Hyperparams { momentum: -0.1, ..ok }, "momentum -0.1"),
            (Hyperparams { global_batch: 0, ..ok }, "global batch 0"),
            (Hyperparams { local_batch: 0, ..ok }, "local batch 0"),
            (Hyperparams { local_batch: 65, ..ok }, "local batch 65 above"),
        ] {
            let e = check_hyperparams(&h).unwrap_err().to_string();
            assert!(e.contains(want), "{e:?} should say {want:?}");
        }
    }
}
