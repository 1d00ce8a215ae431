//! Resizes: the scaling policy's decisions on its cadence, the batch
//! adapter's answer at each resize, and the step boundary where the world
//! changes.

use super::records::*;
use super::{Coordinator, ms};
use crate::scalers::Scaler;
use anyhow::{Result, bail};
use edl_plugin_sdk::{Action, ClusterView, Hyperparams, ResizeEvent, WorkerStats};
use std::time::Instant;

impl Coordinator<'_> {
    /// At a step boundary: admits joiners, applies replacements, forms a new
    /// generation when membership changed.
    pub(super) fn boundary(&mut self) -> Result<()> {
        let from = self.membership.world();
        let b = self.membership.boundary(true, self.init.is_some());
        self.execute();
        let (mut reasons, admitted) = (b.reasons, b.admitted);
        let servers = self.ps_change_waiting();
        if !b.changed && !servers {
            return Ok(());
        }
        if servers {
            reasons.push("parameter servers changed".into());
        }
        self.generation += 1;
        self.pipe = None;
        self.lease_now = true;
        let to = self.membership.world();
        let mut pending = match self.pending.take() {
            Some(p) => p,
            // A decision's workers join later: the world they join is this one.
            None => self
                .decided_for(admitted)
                .map_or(Pending::new(from, String::new()), |p| Pending { from, ..p }),
        };
        let decided = !pending.reason.is_empty();
        if pending.reason.is_empty() {
            // Nobody decided this change: say what happened. A replacement
            // (as many workers as before) is said by `reasons` alone.
            pending.reason = match (from, self.init.is_some()) {
                (0, true) => "job resumed".into(),
                (0, false) => "job started".into(),
                _ if to > from => "workers joined".into(),
                _ if to < from => "workers left".into(),
                _ => String::new(),
            };
        }
        if decided && admitted > 0 && pending.join_ms.is_none() && from > 0 && !pending.failure {
            // The policy decided earlier; the others trained while the new worker started.
            pending.join_ms = Some(ms(pending.boundary.elapsed()));
            pending.boundary = Instant::now();
        }
        if !reasons.is_empty() {
            pending.reason = match pending.reason.is_empty() {
                true => reasons.join(", "),
                false => format!("{}; {}", pending.reason, reasons.join(", ")),
            };
        }
        pending.generation = Some(self.generation);
        pending.formed = Some(Instant::now());
        self.pending = Some(pending);
        // The adapter is shown the hyperparameters in force: each worker's
        // batch in the world they were set for (a policy keeping it grows
        // the global batch with the world), which is the world before
        // whatever left it before this boundary.
        let old = self.hyper_world;
        let before = if old > 0 { old } else { to };
        self.hyper.local_batch = (self.hyper.global_batch / before.max(1)).max(1);
        if let Some(a) = self.adapter.as_mut() {
            let ev = ResizeEvent { step: self.tally.committed, old_world_size: old, new_world_size: to };
            let answer = a.on_resize(&ev, &self.hyper);
            if let Some(h) = self.adapter_answer("on-resize", answer)? {
                self.hyper = h;
            }
        }
        // Each worker's share of the global batch in the new world.
        self.hyper.local_batch = (self.hyper.global_batch / to.max(1)).max(1);
        self.hyper_world = to;
        self.last_change = Instant::now();
        self.save_state(false);
        Ok(())
    }

    /// The adapter's hyperparameters, to use. An answer that breaks the
    /// contract (the plugin layer checked it) or asks for a batch larger
    /// than the training set ends the job, naming the adapter: training on
    /// it would be garbage. A trap or a deadline keeps the current
    /// hyperparameters (`None`).
    pub(super) fn adapter_answer(
        &mut self,
        call: &str,
        answer: Result<Hyperparams, crate::plugin::Error>,
    ) -> Result<Option<Hyperparams>> {
        let name = self.adapter.as_ref().map(|a| a.info().name.clone()).unwrap_or_default();
        match answer {
            Ok(h) if h.global_batch as usize > self.tally.train_len() => bail!(
                "batch adapter {name}: {call} asked for a global batch of {}, above the {} training samples",
                h.global_batch,
                self.tally.train_len()
            ),
            Ok(h) => Ok(Some(h)),
            Err(e @ crate::plugin::Error::Contract { .. }) => bail!("batch adapter {name}: {e}"),
            Err(e) => {
                self.note(format!("batch adapter {name}: {call} failed, hyperparameters kept: {e}"));
                Ok(None)
            }
        }
    }

    /// Carries out a policy decision.
    pub(super) fn apply_decision(&mut self, actions: &[Action]) {
        let world = self.membership.world();
        // Workers asked for join later, each at a boundary of its own: the
        // decision waits for them. Workers removed leave at the next one.
        let starts = actions.iter().any(|a| matches!(a, Action::ScaleOut(_) | Action::Replace(_)));
        if let Some(reason) = self.membership.apply_decision(Instant::now(), actions) {
            match self.pending.as_mut() {
                // A failure's resize not formed yet: one event says both.
                Some(p) if p.generation.is_none() && p.failure => {
                    p.reason = format!("{}; {reason}", p.reason)
                }
                _ if starts => self.decided.push_back(Pending::new(world, reason)),
                _ => self.pending = Some(Pending::new(world, reason)),
            }
        }
        self.execute();
    }

    /// The decisions that asked for the `admitted` workers that just joined,
    /// oldest first, as one resize (None: nobody asked for them). Decisions
    /// older than the join timeout are forgotten: their workers never came.
    fn decided_for(&mut self, admitted: usize) -> Option<Pending> {
        let timeout = self.cfg.join_timeout;
        self.decided.retain(|p| p.boundary.elapsed() <= timeout);
        let mut taken = self.decided.drain(..admitted.min(self.decided.len()));
        let mut first = taken.next()?;
        // Each decision once, with how many times it was made: `policy: add 1 worker (x2)`.
        let mut said: Vec<(String, usize)> = vec![(std::mem::take(&mut first.reason), 1)];
        for p in taken {
            match said.iter_mut().find(|(r, _)| *r == p.reason) {
                Some((_, n)) => *n += 1,
                None => said.push((p.reason, 1)),
            }
        }
        let parts: Vec<String> =
            said.into_iter().map(|(r, n)| if n > 1 { format!("{r} (x{n})") } else { r }).collect();
        first.reason = parts.join("; ");
        Some(first)
    }

    /// Keeps a decision of the policy for the report (the newest ones).
    /// and tells the watchers (with the call's seconds).
    fn record_decision<E: std::fmt::Display>(
        &mut self,
        view: ClusterView,
        answer: &Result<Vec<Action>, E>,
        call_secs: f64,
    ) {
        if self.policy_decisions.len() >= super::records::POLICY_DECISIONS_KEPT {
            self.policy_decisions.pop_front();
        }
        let decision = super::records::PolicyDecision {
            secs: self.started.elapsed().as_secs_f64(),
            view,
            actions: answer.as_ref().cloned().unwrap_or_default(),
            error: answer.as_ref().err().map(|e| e.to_string()),
        };
        (self.progress)(Progress::Decision { decision: &decision, call_secs });
        self.policy_decisions.push_back(decision);
    }

    /// Tells the policy and the adapter what was measured of the training
    /// over the decision window that just ended (the noise scale, step times).
    fn tell_training(&mut self, world: u32, throughput: f64) {
        let resized = self.last_change >= self.window_started;
        self.window_started = Instant::now();
        self.step_times.window_ended(throughput, resized);
        let stats = self.training_stats(world, throughput);
        if let Err(e) = self.policy.on_training(&stats) {
            let name = self.policy.info().name.clone();
            self.note(format!(
                "scaling policy {name}: on-training failed, it decides without this window: {e}"
            ));
        }
        let Some(adapter) = self.adapter.as_mut() else { return };
        match adapter.on_training(&stats) {
            Ok(true) => {}
            // Not an observer: nothing to keep for a replay.
            Ok(false) => return,
            Err(e) => {
                let name = adapter.info().name.clone();
                self.note(format!(
                    "batch adapter {name}: on-training failed, it decides without this window: {e}"
                ));
                return;
            }
        }
        if self.adapter_decisions.len() >= POLICY_DECISIONS_KEPT {
            self.adapter_decisions.pop_front();
        }
        let secs = self.started.elapsed().as_secs_f64();
        let current = self.plan_at.hyper;
        // `step` is set by the next `on-step` (u64::MAX until then).
        self.adapter_decisions.push_back(AdapterDecision {
            secs,
            stats,
            step: u64::MAX,
            current,
            answer: None,
        });
    }

    /// What was measured of the training, as plugins are told it.
    fn training_stats(&self, world: u32, throughput: f64) -> edl_plugin_sdk::TrainingStats {
        let base = self.cfg.hyper;
        let samples = self.tally.train_len().max(1) as u32;
        edl_plugin_sdk::TrainingStats {
            step: self.tally.committed,
            world_size: world,
            noise_scale: self.tally.noise_scale().filter(|b| b.is_finite()).unwrap_or(0.0),
            base_batch: base.global_batch,
            base_lr: base.lr,
            max_batch: self.cfg.batch_max.unwrap_or(base.global_batch.saturating_mul(16)).min(samples),
            throughput,
            step_times: self.step_times.table(),
        }
    }

    /// Each member's throughput since the last decision, where measured: a
    /// host's ranks that reported as one share their host's evenly.
    fn worker_rates(&mut self, rates: &std::collections::HashMap<u64, f64>) -> Vec<WorkerStats> {
        let members = self.membership.members();
        let own = |m: &crate::coordinator::machine::membership::Worker| {
            Some(WorkerStats { id: m.id, throughput: *rates.get(&m.id)? })
        };
        let mut out = Vec::with_capacity(members.len());
        for &super::routes::Run { first, end, .. } in
            &super::routes::Routes::of(&mut self.routes, members, &self.conns).runs
        {
            let run = &members[first..end];
            match rates.get(&run[0].id) {
                Some(&rate) if run[1..].iter().all(|m| !rates.contains_key(&m.id)) => {
                    let each = rate / run.len() as f64;
                    out.extend(run.iter().map(|m| WorkerStats { id: m.id, throughput: each }));
                }
                _ => out.extend(run.iter().filter_map(own)),
            }
        }
        out
    }

    /// Asks the policy what to do.
    pub(super) fn decide(&mut self) {
        if self.membership.handing_over() {
            // A handover is under way; the policy sees the job after it.
            return;
        }
        let (throughput, rates) = self.tally.since_decision(Instant::now());
        let world = self.membership.world();
        self.tell_training(world, throughput);
        let coming = self.membership.coming();
        let remaining = self.tally.remaining(self.cfg.spec.epochs);
        let capacity = self.scaler.capacity();
        if capacity.is_some() && capacity != self.capacity {
            let n = capacity.unwrap_or_default();
            self.note(format!("the scheduler has room for {n} more worker{}", if n == 1 { "" } else { "s" }));
            self.capacity = capacity;
        }
        let workers = self.worker_rates(&rates);
        let view = ClusterView {
            step: self.tally.committed,
            epoch: self.tally.epoch as u32,
            world_size: world,
            min_workers: self.cfg.min_workers,
            max_workers: self.cfg.max_workers,
            // Within the job's bounds, and what the scheduler has free.
            free_slots: self.cfg.max_workers.saturating_sub(world + coming).min(capacity.unwrap_or(u32::MAX)),
            global_batch: self.hyper.global_batch,
            throughput,
            workers,
            secs_since_change: self.last_change.elapsed().as_secs_f64(),
            price_per_worker_hour: self.cfg.price_per_worker_hour,
            samples_remaining: remaining,
        };
        let asked = Instant::now();
        let answer = self.policy.decide(&view);
        self.record_decision(view, &answer, asked.elapsed().as_secs_f64());
        match answer {
            Err(e) => self.note(format!("scaling policy failed, holding: {e}")),
            Ok(actions) if actions.iter().any(|a| matches!(a, Action::ScaleIn(_))) => {
                // Workers leave at a step boundary: once the windows already
                // sent are committed.
                self.decision = Some(actions);
            }
            // Starting workers (and replacements) needs no boundary: they
            // join at one once ready.
            Ok(actions) => self.apply_decision(&actions),
        }
        // Asked whether or not the workers' decision failed: each is a
        // call of its own.
        self.decide_servers();
        self.decide_spares();
    }
}
