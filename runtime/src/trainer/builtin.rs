//! What the built-in workers share: their data sets, the MLP's state
//! tensors and its checkpoints, and the trainer as a session's state.

use crate::checkpoint::Restored;
use crate::job::spec::BuiltinModel;
use crate::state::{Layout, TensorSpec};
use crate::trainer::data::{Dataset, Source};
use crate::trainer::model::{Layer, Mlp};
use crate::trainer::train::Trainer;
use crate::worker::session::State;
use anyhow::{Result, anyhow, bail};

/// The training set and test set of the built-in model's data.
pub fn load_data(m: &BuiltinModel) -> Result<(Dataset, Dataset)> {
    let all = match m.dataset.as_str() {
        "mnist5k" => Dataset::load(Source::Mnist5k)?,
        "digits" => Dataset::load(Source::Digits)?,
        "ctr" => crate::trainer::clicks::synthetic(crate::trainer::clicks::ROWS, m.split_seed),
        other => bail!("unknown data set {other:?} (expected mnist5k, digits or ctr)"),
    };
    let (mut train, test) = all.split(m.test_rows, m.split_seed);
    if let Some(n) = m.train_samples {
        train.truncate(n);
    }
    Ok((train, test))
}

/// The state tensors of an MLP of `sizes` and its momentum buffer:
/// `layers.<i>.weight` `[in, out]`, `layers.<i>.bias`, then the same under `momentum.`.
pub fn mlp_layout(sizes: &[usize]) -> Layout {
    let params: Vec<TensorSpec> = sizes
        .windows(2)
        .enumerate()
        .flat_map(|(i, w)| {
            [
                TensorSpec::new(format!("layers.{i}.weight"), vec![w[0], w[1]]),
                TensorSpec::new(format!("layers.{i}.bias"), vec![w[1]]),
            ]
        })
        .collect();
    let momentum = params.iter().map(|t| TensorSpec::new(format!("momentum.{}", t.name), t.shape.clone()));
    let all: Vec<TensorSpec> = params.iter().cloned().chain(momentum).collect();
    Layout::new(all).expect("names are unique")
}

/// The MLP a checkpoint of the built-in model holds.
pub fn mlp_of(r: &Restored) -> Result<Mlp> {
    let mut layers = Vec::new();
    for i in 0.. {
        let name = format!("layers.{i}.weight");
        let Some(t) = r.layout.tensors().iter().find(|t| t.name == name) else { break };
        let [inputs, outputs] = t.shape[..] else {
            bail!("{}: {name} has shape {:?}", r.path.display(), t.shape)
        };
        let bias = r
            .tensor(&format!("layers.{i}.bias"))
            .ok_or_else(|| anyhow!("{}: no layers.{i}.bias", r.path.display()))?;
        let weight = r.tensor(&name).expect("found above").to_vec();
        layers.push(Layer { inputs, outputs, weight, bias: bias.to_vec() });
    }
    if layers.is_empty() {
        bail!("{}: holds no built-in model (no layers.0.weight)", r.path.display());
    }
    Ok(Mlp { layers })
}

/// The trainer as a session's state.
pub(crate) struct MlpState {
    pub(crate) trainer: Trainer,
    pub(crate) layout: Layout,
    /// Buffers of the split into parameters and momentum.
    params: Vec<f32>,
    velocity: Vec<f32>,
}

impl MlpState {
    pub(crate) fn new(trainer: Trainer, layout: Layout) -> Self {
        MlpState { trainer, layout, params: Vec::new(), velocity: Vec::new() }
    }
}

impl State for MlpState {
    fn layout(&self) -> &Layout {
        &self.layout
    }

    fn save_into(&mut self, out: &mut Vec<f32>) -> Result<()> {
        self.trainer.state_into(&mut self.params, &mut self.velocity);
        out.clear();
        out.extend_from_slice(&self.params);
        out.extend_from_slice(&self.velocity);
        Ok(())
    }

    fn load(&mut self, values: &[f32]) -> Result<()> {
        let n = self.trainer.param_count();
        if values.len() != 2 * n {
            bail!("{} values for a model of {n} parameters and its momentum", values.len());
        }
        self.trainer.load_params_flat(&values[..n])?;
        self.trainer.load_velocity(&values[n..])?;
        Ok(())
    }
}
