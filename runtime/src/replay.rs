//! Drives a scaling policy without a training job: over a recorded trace of
//! cluster views (no feedback), or against a simulated cluster that reacts to
//! the policy's actions (with an optional batch adapter following the resizes).

use crate::plugin::{AdapterPlugin, Error, PolicyPlugin};
use edl_plugin_sdk::{Action, ClusterView, Hyperparams, ResizeEvent, testing::SimCluster};
use serde::Serialize;
use std::path::Path;

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{path}: cannot read trace: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("{path}:{line}: not a cluster view: {source}")]
    Parse { path: String, line: usize, source: serde_json::Error },
    #[error("{path}: the trace holds no cluster view")]
    Empty { path: String },
}

/// Reads a trace: one JSON cluster view per line; blank lines and lines
/// starting with `#` are skipped. Missing fields default to zero.
pub fn read_trace(path: &Path) -> Result<Vec<ClusterView>, TraceError> {
    let shown = path.display().to_string();
    let text =
        std::fs::read_to_string(path).map_err(|source| TraceError::Read { path: shown.clone(), source })?;
    let mut views = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let view = serde_json::from_str(line).map_err(|source| TraceError::Parse {
            path: shown.clone(),
            line: i + 1,
            source,
        })?;
        views.push(view);
    }
    if views.is_empty() {
        return Err(TraceError::Empty { path: shown });
    }
    Ok(views)
}

/// One decision of a replay or a simulation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Decision {
    pub step: u64,
    /// World size the policy saw.
    pub world_size: u32,
    pub throughput: f64,
    pub actions: Vec<Action>,
}

/// Feeds every view of a trace to the policy.
pub fn replay(policy: &mut dyn PolicyPlugin, views: &[ClusterView]) -> Result<Vec<Decision>, Error> {
    views
        .iter()
        .map(|v| {
            Ok(Decision {
                step: v.step,
                world_size: v.world_size,
                throughput: v.throughput,
                actions: policy.decide(v)?,
            })
        })
        .collect()
}

/// A change of world size in a simulation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ScaleEvent {
    pub step: u64,
    pub from: u32,
    pub to: u32,
    pub reason: String,
    /// Hyperparameters the adapter chose for the new size.
    pub hyperparams: Option<Hyperparams>,
}

/// The outcome of [`simulate`].
#[derive(Clone, Debug, Serialize)]
pub struct Simulation {
    pub decisions: Vec<Decision>,
    pub events: Vec<ScaleEvent>,
    pub final_world_size: u32,
}

/// Runs `decisions` rounds of the policy against `sim`; `on_round` sees each
/// decision as it is made (progress), and `adapter` follows every resize.
pub fn simulate(
    policy: &mut dyn PolicyPlugin,
    mut adapter: Option<&mut dyn AdapterPlugin>,
    sim: &mut SimCluster,
    decisions: usize,
    mut hyper: Hyperparams,
    mut on_round: impl FnMut(&Decision, Option<&ScaleEvent>),
) -> Result<Simulation, Error> {
    let mut out = Simulation { decisions: Vec::new(), events: Vec::new(), final_world_size: 0 };
    for _ in 0..decisions {
        let view = sim.view();
        let actions = policy.decide(&view)?;
        let before = sim.world_size();
        sim.apply(&actions);
        let after = sim.world_size();
        let mut event = None;
        if after != before || actions.iter().any(|a| matches!(a, Action::Replace(_))) {
            let reason = actions.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(", ");
            let mut chosen = None;
            if let Some(a) = adapter.as_deref_mut()
                && after != before
            {
                let ev = ResizeEvent { step: view.step, old_world_size: before, new_world_size: after };
                hyper = a.on_resize(&ev, &hyper)?;
                chosen = Some(hyper);
            }
            event =
                Some(ScaleEvent { step: view.step, from: before, to: after, reason, hyperparams: chosen });
        }
        if let Some(a) = adapter.as_deref_mut() {
            for s in view.step..view.step + sim.steps_per_decision {
                hyper = a.on_step(s, &hyper)?;
            }
        }
        let decision =
            Decision { step: view.step, world_size: view.world_size, throughput: view.throughput, actions };
        on_round(&decision, event.as_ref());
        out.decisions.push(decision);
        out.events.extend(event);
        sim.advance();
    }
    out.final_world_size = sim.world_size();
    Ok(out)
}
