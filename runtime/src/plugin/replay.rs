//! Drives a scaling policy without a training job: over a recorded trace of
//! cluster views (open loop: the trace does not react), or through a
//! scenario, a simulated cluster that reacts to the policy's actions and to
//! scripted events (a straggler, capacity taken away), with an optional batch
//! adapter following the resizes.

use crate::plugin::{AdapterPlugin, Error, PolicyPlugin};
use edl_plugin_sdk::{Action, ClusterView, Hyperparams, ResizeEvent, testing::SimCluster};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{path}: cannot read trace: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("{path}:{line}: not a cluster view: {source}")]
    Parse { path: String, line: usize, source: serde_json::Error },
    #[error("{path}: not a scenario: {source}")]
    Scenario { path: String, source: serde_json::Error },
    #[error("{path}: the trace holds no cluster view")]
    Empty { path: String },
    /// A line of JSON lines of views (`what`: `teacher view`, `server view`).
    #[error("{path}:{line}: not a {what}: {source}")]
    ViewParse { path: String, line: usize, what: &'static str, source: serde_json::Error },
    #[error("{path}: a report without teacher decisions (its job had no teacher pool)")]
    NoTeacherDecisions { path: String },
    #[error(
        "{path}: a report without server decisions (its job had no parameter servers, or no scaling policy was asked about them)"
    )]
    NoServerDecisions { path: String },
    #[error(
        "{path}: a report without spare decisions (no scaling policy of its job answered about the warm spares)"
    )]
    NoSpareDecisions { path: String },
    #[error("{path}: a report without policy decisions (written before reports kept them)")]
    NoPolicyDecisions { path: String },
    #[error("{path}: not a job's report (JSON): {source}")]
    NotAReport { path: String, source: serde_json::Error },
    #[error("{path}: a report without adapter decisions (its job had no batch adapter told of the training)")]
    NoAdapterDecisions { path: String },
    /// A report's recorded decision (`list`: `policy_decisions` or
    /// `teacher_decisions`; `index` counts from 1) whose view cannot be read.
    #[error("{path}: {list}[{index}]: its view is not a {what}: {source}")]
    ReportParse {
        path: String,
        list: &'static str,
        index: usize,
        what: &'static str,
        source: serde_json::Error,
    },
}

/// A trace: recorded views, or a scenario to simulate.
#[derive(Clone, Debug)]
pub enum Trace {
    Recorded(Vec<ClusterView>),
    Scenario(Scenario),
}

impl Trace {
    /// The trace with every view (or the scenario) at `price` per
    /// worker-hour, when one is given.
    pub fn priced(self, price: Option<f64>) -> Trace {
        let Some(price) = price else { return self };
        match self {
            Trace::Recorded(views) => Trace::Recorded(
                views.into_iter().map(|v| ClusterView { price_per_worker_hour: price, ..v }).collect(),
            ),
            Trace::Scenario(sc) => Trace::Scenario(Scenario { price_per_worker_hour: price, ..sc }),
        }
    }
}

/// A simulated cluster and what happens to it, as a JSON document:
/// `{"scenario": {"knee": 4, "start": 1, "min_workers": 1, "max_workers": 8,
/// "decisions": 80, "events": [{"at": 40, "slow": {"worker": 1, "speed": 0.5}}]}}`
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Job throughput with k workers at `curve[k - 1]`; or give `knee` for a
    /// curve that grows almost linearly up to `knee` workers and stays flat.
    #[serde(default)]
    pub curve: Option<Vec<f64>>,
    #[serde(default)]
    pub knee: Option<u32>,
    #[serde(default = "one")]
    pub start: u32,
    #[serde(default = "one")]
    pub min_workers: u32,
    pub max_workers: u32,
    /// Devices the cluster gives the job at first (default: max_workers).
    #[serde(default)]
    pub capacity: Option<u32>,
    pub decisions: usize,
    #[serde(default)]
    pub price_per_worker_hour: f64,
    #[serde(default)]
    pub events: Vec<ScenarioEvent>,
}

fn one() -> u32 {
    1
}

/// Something that happens before decision `at`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ScenarioEvent {
    pub at: usize,
    /// A worker (by position, oldest first) starts running at `speed` x.
    #[serde(default)]
    pub slow: Option<SlowWorker>,
    /// The cluster now gives the job this many devices.
    #[serde(default)]
    pub capacity: Option<u32>,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SlowWorker {
    pub worker: usize,
    pub speed: f64,
}

#[derive(Deserialize)]
struct ScenarioFile {
    scenario: Scenario,
}

impl Scenario {
    /// The simulated cluster this scenario starts from.
    pub fn cluster(&self) -> SimCluster {
        let mut sim = match (&self.curve, self.knee) {
            (Some(curve), _) => {
                SimCluster::new(curve.clone(), self.start, self.min_workers, self.max_workers)
            }
            (None, knee) => {
                let mut s = SimCluster::saturating(knee.unwrap_or(4), self.min_workers, self.max_workers);
                s.apply(&[Action::ScaleOut(self.start.saturating_sub(s.world_size()))]);
                s
            }
        };
        sim.price_per_worker_hour = self.price_per_worker_hour;
        sim.set_capacity(self.capacity.unwrap_or(self.max_workers));
        sim
    }

    /// Applies the events scheduled before decision `round`.
    pub fn before(&self, round: usize, sim: &mut SimCluster) {
        for e in self.events.iter().filter(|e| e.at == round) {
            if let Some(s) = &e.slow {
                sim.set_speed(s.worker, s.speed);
            }
            if let Some(c) = e.capacity {
                sim.set_capacity(c);
            }
        }
    }
}

/// Reads a trace: a scenario (one JSON document with a `scenario` key), a
/// job's report (the views of its `policy_decisions`), or one JSON cluster
/// view per line (blank lines and `#` lines skipped; missing
/// fields default to zero; a field a view does not have is refused, naming it).
pub fn read_trace(path: &Path) -> Result<Trace, TraceError> {
    let shown = path.display().to_string();
    let text =
        std::fs::read_to_string(path).map_err(|source| TraceError::Read { path: shown.clone(), source })?;
    let body: String =
        text.lines().filter(|l| !l.trim_start().starts_with('#')).collect::<Vec<_>>().join("\n");
    let whole = serde_json::from_str::<serde_json::Value>(&body).ok().filter(|v| v.is_object());
    if whole.as_ref().is_some_and(|v| v.get("scenario").is_some()) {
        let file: ScenarioFile =
            serde_json::from_str(&body).map_err(|source| TraceError::Scenario { path: shown, source })?;
        return Ok(Trace::Scenario(file.scenario));
    }
    if let Some(report) = whole.filter(|v| v.get("timeline").is_some() || v.get("policy_decisions").is_some())
    {
        return report_views(report, shown).map(Trace::Recorded);
    }
    let mut views = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        views.push(cluster_view(serde_json::from_str(line), &shown, i + 1)?);
    }
    if views.is_empty() {
        return Err(TraceError::Empty { path: shown });
    }
    Ok(Trace::Recorded(views))
}

/// A cluster view read strictly, or the error naming the trace's line.
fn cluster_view(
    parsed: Result<Strict<ClusterView>, serde_json::Error>,
    path: &str,
    line: usize,
) -> Result<ClusterView, TraceError> {
    parsed.map(|v| v.0).map_err(|source| TraceError::Parse { path: path.to_string(), line, source })
}

/// The views a job's report recorded its scaling policy deciding on
/// (its `policy_decisions`, holds too), in order.
fn report_views(report: serde_json::Value, shown: String) -> Result<Vec<ClusterView>, TraceError> {
    let Some(decisions) = report.get("policy_decisions").and_then(|d| d.as_array()) else {
        return Err(TraceError::NoPolicyDecisions { path: shown });
    };
    let mut views = Vec::with_capacity(decisions.len());
    for (i, d) in decisions.iter().enumerate() {
        let view = serde_json::from_value::<Strict<ClusterView>>(d.get("view").cloned().unwrap_or_default());
        views.push(view.map(|v| v.0).map_err(|source| TraceError::ReportParse {
            path: shown.clone(),
            list: "policy_decisions",
            index: i + 1,
            what: "cluster view",
            source,
        })?);
    }
    if views.is_empty() {
        return Err(TraceError::Empty { path: shown });
    }
    Ok(views)
}

/// What a job's report says its batch adapter was told of the training
/// (its `adapter_decisions`), in order.
pub fn read_adapter_trace(path: &Path) -> Result<Vec<crate::coordinator::AdapterDecision>, TraceError> {
    let shown = path.display().to_string();
    let text =
        std::fs::read_to_string(path).map_err(|source| TraceError::Read { path: shown.clone(), source })?;
    let report: serde_json::Value = serde_json::from_str(&text)
        .map_err(|source| TraceError::NotAReport { path: shown.clone(), source })?;
    let Some(list) = report.get("adapter_decisions").and_then(|d| d.as_array()) else {
        return Err(TraceError::NoAdapterDecisions { path: shown });
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, d) in list.iter().enumerate() {
        out.push(serde_json::from_value(d.clone()).map_err(|source| TraceError::ReportParse {
            path: shown.clone(),
            list: "adapter_decisions",
            index: i + 1,
            what: "record of what the adapter was told",
            source,
        })?);
    }
    if out.is_empty() {
        return Err(TraceError::NoAdapterDecisions { path: shown });
    }
    Ok(out)
}

/// The teacher views of a trace: a job's report (the views of its
/// `teacher_decisions`), or JSON lines each a teacher view or a decision
/// (`#` lines are comments). An unknown field is refused, naming it.
pub fn read_teacher_trace(path: &Path) -> Result<Vec<edl_plugin_sdk::TeacherView>, TraceError> {
    let missing = |path| TraceError::NoTeacherDecisions { path };
    let views =
        read_views::<edl_plugin_sdk::TeacherView>(path, "teacher_decisions", "teacher view", missing)?;
    Ok(views.into_iter().map(|(v, _)| v).collect())
}

/// A view of a trace of a policy's sizing (of the parameter servers, of
/// the warm spares), with the answer the job had from its policy when the
/// trace records one.
#[derive(Clone, Debug, PartialEq)]
pub struct SizingTraceEntry<V> {
    pub view: V,
    /// `Some(answer)` where the trace holds the job's decision.
    pub in_the_job: Option<Option<u32>>,
}

/// A server view of a trace.
pub type ServerTraceEntry = SizingTraceEntry<edl_plugin_sdk::ServerView>;
/// A spare view of a trace.
pub type SpareTraceEntry = SizingTraceEntry<edl_plugin_sdk::SpareView>;

/// The server views of a trace: a job's report (its `server_decisions`),
/// or JSON lines each a server view or a decision (`{"view": ..,
/// "answer": ..}`), as for teachers.
pub fn read_server_trace(path: &Path) -> Result<Vec<ServerTraceEntry>, TraceError> {
    let missing = |path| TraceError::NoServerDecisions { path };
    read_sizing_trace(path, "server_decisions", "server view", missing)
}

/// The spare views of a trace: a job's report (its `spare_decisions`), or
/// JSON lines each a spare view or a decision, as for servers.
pub fn read_spare_trace(path: &Path) -> Result<Vec<SpareTraceEntry>, TraceError> {
    let missing = |path| TraceError::NoSpareDecisions { path };
    read_sizing_trace(path, "spare_decisions", "spare view", missing)
}

fn read_sizing_trace<V: Default + Serialize + serde::de::DeserializeOwned>(
    path: &Path,
    list: &'static str,
    what: &'static str,
    missing: impl Fn(String) -> TraceError,
) -> Result<Vec<SizingTraceEntry<V>>, TraceError> {
    let views = read_views::<V>(path, list, what, missing)?;
    Ok(views
        .into_iter()
        .map(|(view, decision)| {
            // A decision that failed had no answer to compare with.
            let recorded = decision.filter(|d| d.get("error").is_none_or(|e| e.is_null()));
            let in_the_job = recorded.and_then(|d| {
                let answer = d.get("answer")?;
                Some(answer.as_u64().and_then(|n| u32::try_from(n).ok()))
            });
            SizingTraceEntry { view, in_the_job }
        })
        .collect())
}

/// The views of a trace, each with the decision it came in (None for a
/// bare view): a job's report (the `view`s of its list `list`; a report
/// without the list is `missing`'s error), or JSON lines each a view or a
/// decision holding one (`#` lines are comments). An unknown field is
/// refused, naming it.
fn read_views<T: Default + Serialize + serde::de::DeserializeOwned>(
    path: &Path,
    list: &'static str,
    what: &'static str,
    missing: impl Fn(String) -> TraceError,
) -> Result<Vec<(T, Option<serde_json::Value>)>, TraceError> {
    let shown = path.display().to_string();
    let text =
        std::fs::read_to_string(path).map_err(|source| TraceError::Read { path: shown.clone(), source })?;
    let mut views = Vec::new();
    let whole = serde_json::from_str::<serde_json::Value>(&text).ok().filter(|v| v.is_object());
    if whole.as_ref().is_some_and(|r| r.get(list).is_none() && r.get("timeline").is_some()) {
        return Err(missing(shown));
    }
    if let Some(report) = whole
        && let Some(decisions) = report.get(list).and_then(|d| d.as_array())
    {
        for (i, d) in decisions.iter().enumerate() {
            let view = serde_json::from_value::<Strict<T>>(d.get("view").cloned().unwrap_or_default())
                .map_err(|source| TraceError::ReportParse {
                    path: shown.clone(),
                    list,
                    index: i + 1,
                    what,
                    source,
                })?;
            views.push((view.0, Some(d.clone())));
        }
    } else {
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let parse_err = |source| TraceError::ViewParse { path: shown.clone(), line: i + 1, what, source };
            let value = serde_json::from_str::<serde_json::Value>(line).map_err(parse_err)?;
            let (view, decision) = match value.get("view") {
                Some(v) => (v.clone(), Some(value.clone())),
                None => (value, None),
            };
            let checked: Strict<T> = serde_json::from_value(view).map_err(parse_err)?;
            views.push((checked.0, decision));
        }
    }
    if views.is_empty() {
        return Err(TraceError::Empty { path: shown });
    }
    Ok(views)
}

/// A view read strictly: a field the view does not have (a typo,
/// `thruput`) is refused, naming it, rather than read as a zero.
struct Strict<T>(T);

impl<'de, T: Default + Serialize + serde::de::DeserializeOwned> serde::Deserialize<'de> for Strict<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let value = serde_json::Value::deserialize(d)?;
        let known = serde_json::to_value(T::default()).map_err(serde::de::Error::custom)?;
        if let (Some(given), Some(known)) = (value.as_object(), known.as_object())
            && let Some(unknown) = given.keys().find(|k| !known.contains_key(*k))
        {
            let what = std::any::type_name::<T>().rsplit("::").next().unwrap_or("view");
            let names: Vec<&String> = known.keys().collect();
            return Err(serde::de::Error::custom(format!(
                "unknown field `{unknown}` of a {what} (known: {names:?})"
            )));
        }
        serde_json::from_value(value).map(Strict).map_err(serde::de::Error::custom)
    }
}

/// One decision of a replay or a simulation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Decision {
    pub step: u64,
    /// World size the policy saw.
    pub world_size: u32,
    /// World size after the policy's actions (for a recorded trace: what the
    /// policy asked for, since the trace does not react).
    pub chosen: u32,
    pub throughput: f64,
    /// Devices the cluster offered (world size + free slots).
    pub capacity: u32,
    pub actions: Vec<Action>,
}

/// The world size a view's owner would have after `actions`, within its limits.
pub(crate) fn asked(view: &ClusterView, actions: &[Action]) -> u32 {
    let mut k = view.world_size as i64;
    for a in actions {
        match *a {
            Action::ScaleOut(n) => k += n as i64,
            Action::ScaleIn(n) => k -= n as i64,
            Action::Hold | Action::Replace(_) => {}
        }
    }
    let hi = view.max_workers.min(view.world_size + view.free_slots).max(view.world_size) as i64;
    k.clamp(view.min_workers.max(1) as i64, hi.max(1)) as u32
}

/// Feeds every view of a recorded trace to the policy.
pub fn replay(policy: &mut dyn PolicyPlugin, views: &[ClusterView]) -> Result<Vec<Decision>, Error> {
    views
        .iter()
        .map(|v| {
            let actions = policy.decide(v)?;
            Ok(Decision {
                step: v.step,
                world_size: v.world_size,
                chosen: asked(v, &actions),
                throughput: v.throughput,
                capacity: v.world_size + v.free_slots,
                actions,
            })
        })
        .collect()
}

/// A change of world size in a simulation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SimulatedResize {
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
    pub events: Vec<SimulatedResize>,
    pub final_world_size: u32,
}

/// Runs `rounds` decisions of the policy against `sim`. `before` may change
/// the cluster before each round (scenario events); `on_round` sees each
/// decision as it is made (progress); `adapter` follows every resize.
pub fn simulate(
    policy: &mut dyn PolicyPlugin,
    mut adapter: Option<&mut dyn AdapterPlugin>,
    sim: &mut SimCluster,
    rounds: usize,
    mut hyper: Hyperparams,
    mut before: impl FnMut(usize, &mut SimCluster),
    mut on_round: impl FnMut(&Decision, Option<&SimulatedResize>),
) -> Result<Simulation, Error> {
    let mut out = Simulation { decisions: Vec::new(), events: Vec::new(), final_world_size: 0 };
    for round in 0..rounds {
        let seen = sim.world_size();
        before(round, sim);
        let view = sim.view();
        if view.world_size != seen {
            // The cluster resized the job itself (preemption): the adapter follows that too.
            let mut chosen = None;
            if let Some(a) = adapter.as_deref_mut() {
                let ev =
                    ResizeEvent { step: view.step, old_world_size: seen, new_world_size: view.world_size };
                hyper = a.on_resize(&ev, &hyper)?;
                chosen = Some(hyper);
            }
            out.events.push(SimulatedResize {
                step: view.step,
                from: seen,
                to: view.world_size,
                reason: "the cluster took workers away".into(),
                hyperparams: chosen,
            });
        }
        let actions = policy.decide(&view)?;
        let before_size = sim.world_size();
        sim.apply(&actions);
        let after = sim.world_size();
        let mut event = None;
        let replaced = actions
            .iter()
            .any(|a| matches!(a, Action::Replace(id) if view.workers.iter().any(|w| w.id == *id)));
        if after != before_size || replaced {
            let reason = actions.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(", ");
            let mut chosen = None;
            if let Some(a) = adapter.as_deref_mut()
                && after != before_size
            {
                let ev = ResizeEvent { step: view.step, old_world_size: before_size, new_world_size: after };
                hyper = a.on_resize(&ev, &hyper)?;
                chosen = Some(hyper);
            }
            event = Some(SimulatedResize {
                step: view.step,
                from: before_size,
                to: after,
                reason,
                hyperparams: chosen,
            });
        }
        if let Some(a) = adapter.as_deref_mut() {
            for s in view.step..view.step + sim.steps_per_decision {
                hyper = a.on_step(s, &hyper)?;
            }
        }
        let decision = Decision {
            step: view.step,
            world_size: view.world_size,
            chosen: after,
            throughput: view.throughput,
            capacity: view.world_size + view.free_slots,
            actions,
        };
        on_round(&decision, event.as_ref());
        out.decisions.push(decision);
        out.events.extend(event);
        sim.advance();
    }
    out.final_world_size = sim.world_size();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.jsonl");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    #[test]
    fn a_server_trace_reads_views_and_decisions_and_refuses_what_is_not_one() {
        let (_d, path) = trace(
            "# a comment\n\
             {\"step\": 5, \"servers\": [{\"id\": 1, \"rows\": 7}], \"max_servers\": 4}\n\
             {\"view\": {\"step\": 9}, \"answer\": 3, \"servers\": 3}\n\
             {\"view\": {\"step\": 12}, \"answer\": null, \"servers\": null}\n\
             {\"view\": {\"step\": 15}, \"answer\": null, \"error\": \"trapped\", \"servers\": null}\n",
        );
        let entries = read_server_trace(&path).unwrap();
        let got: Vec<(u64, Option<Option<u32>>)> =
            entries.iter().map(|e| (e.view.step, e.in_the_job)).collect();
        assert_eq!(got, [(5, None), (9, Some(Some(3))), (12, Some(None)), (15, None)]);
        assert_eq!(entries[0].view.servers[0].rows, 7);
        assert_eq!(entries[0].view.max_servers, 4);
        // A misspelt field is named, with the line.
        let (_d, bad) = trace("{\"step\": 1, \"severs\": []}\n");
        let err = read_server_trace(&bad).unwrap_err().to_string();
        assert!(err.contains(":1: not a server view") && err.contains("severs"), "{err}");
        // A job's report from a job without servers says so.
        let (_d, report) = trace("{\"timeline\": [], \"policy_decisions\": []}");
        let err = read_server_trace(&report).unwrap_err().to_string();
        assert!(err.contains("a report without server decisions"), "{err}");
    }

    #[test]
    fn a_spare_trace_reads_a_report_s_decisions_and_says_when_it_has_none() {
        let (_d, path) = trace(
            "{\"spare_decisions\": [\
             {\"secs\": 1.0, \"view\": {\"step\": 4, \"price_per_spare_hour\": 2.5}, \"answer\": 1, \"spares\": 1},\
             {\"secs\": 2.0, \"view\": {\"step\": 8, \"spares_wanted\": 1}, \"answer\": null, \"error\": \"trapped\", \"spares\": null}]}",
        );
        let entries = read_spare_trace(&path).unwrap();
        let got: Vec<(u64, Option<Option<u32>>)> =
            entries.iter().map(|e| (e.view.step, e.in_the_job)).collect();
        assert_eq!(got, [(4, Some(Some(1))), (8, None)]);
        assert_eq!(entries[0].view.price_per_spare_hour, 2.5);
        let (_d, report) = trace("{\"timeline\": [], \"policy_decisions\": []}");
        let err = read_spare_trace(&report).unwrap_err().to_string();
        assert!(err.contains("a report without spare decisions"), "{err}");
    }
}
