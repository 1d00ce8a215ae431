//! The step path of a generation: windows of step plans sent ahead,
//! reports gathered, steps committed (the cursor moves and the samples enter
//! the ledger), failures turned into the next generation.

use super::held::HeldRelays;
use super::records::*;
use super::routes::{Routes, Run};
use super::{AHEAD, CHORES_EVERY, Coordinator, MAX_WINDOW, SECOND, WINDOW_WORK_MS, ms};
use crate::control::frame::Frame;
use crate::control::hostwindow::{HostGeneration, HostWindow};
use crate::control::outbox::{Outbox, RelayOut};
use crate::control::proto::{Generation, Share, StepDone, StepPlan, ToWorker, encode};
use crate::coordinator::machine::membership::Worker;
use crate::coordinator::machine::pipeline::{Committed, Failure, Pipeline};
use crate::coordinator::machine::tally::permutation_of;
use crate::coordinator::machine::timers::Timer;
use crate::leader::record::ScaleEvent;
use crate::scalers::Scaler;
use anyhow::{Result, anyhow, bail};
use edl_plugin_sdk::Hyperparams;
use std::{
    collections::HashMap,
    sync::mpsc,
    time::{Duration, Instant},
};

impl Coordinator<'_> {
    /// Runs the current generation's steps, forming it first when it is
    /// new, until it drains for a membership change or the job's end
    /// (`None`), or fails.
    pub(super) fn run_generation(&mut self) -> Result<Option<Failure>> {
        // A relay gets the last generation's last commit (if it was held),
        // the new generation and its first windows in one write.
        let held = match self.begin_generation() {
            Ok(held) => held,
            Err(e) => {
                self.release_drained();
                return Err(e);
            }
        };
        let filled = self.fill_windows();
        match held {
            Some(held) => {
                self.release(held);
                self.release_drained();
            }
            // The same generation goes on (nothing changed at the
            // boundary): the held relays' ranks are its own.
            None => {
                if let Some(drained) = self.drained_relays.take() {
                    self.release(drained);
                }
            }
        }
        filled?;
        self.timers.set(Timer::Chores, Instant::now() + CHORES_EVERY);
        loop {
            self.fill_windows()?;
            while let Some(c) = self.pipe.as_mut().and_then(Pipeline::poll_commit) {
                // A relay gets the commit and the window after it in one write.
                let held = self.hold_relays();
                let done = self.commit_window(c).and_then(|()| self.fill_windows());
                let pipe = self.pipe.as_ref().expect("formed above");
                if done.is_ok()
                    && pipe.drained()
                    && !pipe.failed()
                    && self.drained_relays.is_none()
                    && self.may_hold_last_commit()
                {
                    // The generation's last commit: it goes with what comes
                    // next, the next generation's first messages.
                    self.drained_relays = Some(held);
                } else {
                    self.release(held);
                }
                done?;
            }
            let pipe = self.pipe.as_mut().expect("formed above");
            if let Some(f) = pipe.settled_failure() {
                self.pipe = None;
                self.release_drained();
                return Ok(Some(f));
            }
            if pipe.drained() && !pipe.failed() {
                return Ok(None);
            }
            // Ranks' timeouts are checked with the chores (their bound is
            // seconds; checking on every message would cost O(N) each).
            self.wait_for_news()?;
            let now = Instant::now();
            if self.timers.fire(Timer::Chores, now, CHORES_EVERY) {
                self.chores(now)?;
            }
        }
    }

    /// Holds what is sent to the generation's relays until each is
    /// released (see [`RelayOut::hold`]).
    fn hold_relays(&mut self) -> HeldRelays {
        let routes = Routes::of(&mut self.routes, self.membership.members(), &self.conns);
        HeldRelays::hold(
            routes
                .runs
                .iter()
                .filter_map(|r| Some((r.relay.as_ref()?.out.clone(), r.first..r.end)))
                .collect(),
        )
    }

    /// Waits for what the workers say, up to the next timeout, and handles
    /// all that has arrived.
    fn wait_for_news(&mut self) -> Result<()> {
        let wake =
            [self.membership.poll_timeout(), self.timers.get(Timer::Chores)].into_iter().flatten().min();
        let left = wake.map_or(CHORES_EVERY, |t| t.saturating_duration_since(Instant::now()));
        match self.receive(left) {
            Ok(ev) => {
                self.handle(ev);
                // Whatever else has arrived, before planning again.
                while let Ok(ev) = self.io.rx.try_recv() {
                    self.handle(ev);
                }
                self.check_fatal()
            }
            Err(mpsc::RecvTimeoutError::Timeout) => Ok(()),
            Err(mpsc::RecvTimeoutError::Disconnected) => bail!("the control listener stopped"),
        }
    }

    /// The periodic work: store news, ranks' timeouts (their bound is
    /// seconds; checking on every message would cost O(N) each), starters,
    /// leases, teachers, the job's state.
    fn chores(&mut self, now: Instant) -> Result<()> {
        // A coordinator that lost its lease (it was frozen, or cut off)
        // stops before it acts on anyone.
        self.fenced()?;
        self.stop_signalled()?;
        self.store_news();
        let late = self.pipe.as_mut().map(|p| p.handle_timeout(now)).unwrap_or_default();
        for rank in late {
            let id = self.membership.members()[rank].id;
            self.scaler.stop(id, Duration::from_secs(1));
        }
        self.check_spawning();
        self.lease_members(now);
        if self.timers.fire(Timer::TeacherCheck, now, SECOND) {
            self.check_teachers()?;
            self.watch_ps();
        }
        if self.timers.is_due(Timer::SaveState, now) {
            self.save_state(false);
        }
        self.fenced()
    }

    /// Forms the current generation unless it is formed already.
    pub(super) fn ensure_generation(&mut self) -> Result<()> {
        if let Some(held) = self.begin_generation()? {
            self.release(held);
        }
        Ok(())
    }

    /// Whether a drained generation's last commit may wait for the next
    /// generation's first messages. Not where workers are to outlive this
    /// coordinator (a standby may take them over): the store names the
    /// committed step as soon as it is committed, and a worker comes back
    /// to a standby only with the state of that step, which it keeps when
    /// the commit reaches it. Nor with parameter servers, whose reshaping
    /// at the boundary can take seconds.
    fn may_hold_last_commit(&self) -> bool {
        self.told.follow.is_none() && self.ps.servers.is_none()
    }

    /// Writes what a drained generation's relays were sent since its last
    /// commit. A relay whose write fails is shut, and its reader reports
    /// it and the workers behind it lost (the ranks held are the drained
    /// generation's, not the current one's).
    pub(super) fn release_drained(&mut self) {
        if let Some(held) = self.drained_relays.take() {
            let _ = held.release();
        }
    }

    /// Writes what the held relays were sent; the ranks behind one whose
    /// write failed are lost to the generation.
    fn release(&mut self, held: HeldRelays) {
        let lost = held.release();
        if let Some(pipe) = self.pipe.as_mut() {
            let now = Instant::now();
            lost.iter().for_each(|(rank, why)| pipe.lost(now, *rank, why));
        }
    }

    /// Forms the current generation unless it is formed already; what its
    /// relays are sent is held until the answer, if any, is released.
    fn begin_generation(&mut self) -> Result<Option<HeldRelays>> {
        if self.pipe.as_ref().map(|p| p.generation) == Some(self.generation) {
            return Ok(None);
        }
        self.start_generation().map(Some)
    }

    /// Tells every member its place in the new generation; planning starts
    /// again from the committed step. What the generation's relays are sent
    /// is held until the answer is released (or dropped).
    fn start_generation(&mut self) -> Result<HeldRelays> {
        self.training_since.get_or_insert_with(Instant::now);
        let ps = self.reform_ps()?;
        let key = format!("{}/generation-{}", self.cfg.spec.job, self.generation);
        self.io.rendezvous.set_generation(self.generation);
        self.io.gate.set_generation(self.generation);
        // A host's ranks behind one relay are consecutive: they report as one.
        let conns = &self.conns;
        self.membership.group_by(|m| conns.get(&m.conn).and_then(Outbox::relay).map(|(host, ..)| host));
        self.routes = None;
        let names: Vec<String> =
            self.membership.members().iter().map(|m| format!("worker {} (pid {})", m.id, m.pid)).collect();
        let world = names.len();
        // A registration naming a larger world is not one of this generation's.
        self.io.rendezvous.set_max_world(world);
        let mut pipe = Pipeline::new(
            self.generation,
            names,
            self.tally.committed,
            Instant::now(),
            self.cfg.step_timeout,
        );
        // A host's ranks behind one relay get one message for them all (the
        // relay tells each its rank), as they get their windows.
        let mut relayed: Vec<(u64, RelayOut, HostGeneration)> = Vec::new();
        for (rank, m) in self.membership.members().iter().enumerate() {
            let g = Generation {
                generation: self.generation,
                rank,
                world,
                rendezvous: self.io.rendezvous_at.clone(),
                rendezvous_key: key.clone(),
                committed_steps: self.tally.committed,
                init: self.init.clone(),
                ps: ps.clone(),
            };
            let Some(stream) = self.conns.get_mut(&m.conn).filter(|_| !self.membership.is_closed(m.conn))
            else {
                pipe.lost(Instant::now(), rank, "connection closed");
                continue;
            };
            let Some((host, conn, relay)) = stream.relay() else {
                if let Err(e) = stream.send(&ToWorker::Generation(Box::new(g))) {
                    pipe.lost(Instant::now(), rank, &e.to_string());
                }
                continue;
            };
            match relayed.last_mut() {
                Some((h, _, hg)) if *h == host && hg.first + hg.conns.len() == rank => hg.conns.push(conn),
                _ => relayed.push((
                    host,
                    relay.clone(),
                    HostGeneration { conns: vec![conn], first: rank, generation: g },
                )),
            }
        }
        let held =
            HeldRelays::hold(relayed.iter().map(|(_, relay, hg)| (relay.clone(), hg.ranks())).collect());
        for (_, relay, hg) in relayed {
            let ranks = hg.ranks();
            if let Err(why) = relay.send(&[Frame::Generation(Box::new(hg))]) {
                ranks.for_each(|rank| pipe.lost(Instant::now(), rank, &why));
            }
        }
        self.pipe = Some(pipe);
        self.ranks = self.membership.members().iter().enumerate().map(|(r, m)| (m.conn, r)).collect();
        self.plan_at = StepPlan {
            step: self.tally.committed,
            epoch: self.tally.epoch,
            cursor: self.tally.cursor,
            hyper: self.hyper,
        };
        Ok(held)
    }

    /// Sends windows ahead while membership is stable: the first window of
    /// a generation is one step; later ones hold about `WINDOW_WORK_MS` of
    /// steps and end where a checkpoint, a policy decision or an epoch's
    /// end falls.
    pub(super) fn fill_windows(&mut self) -> Result<()> {
        let total = self.cfg.spec.epochs;
        loop {
            let Some(pipe) = self.pipe.as_ref() else { return Ok(()) };
            if pipe.failed() || pipe.windows() >= self.windows_ahead() || self.plan_at.epoch >= total {
                return Ok(());
            }
            if pipe.started() && self.change_waiting() {
                return Ok(());
            }
            let n = if pipe.started() { self.window_len() } else { 1 };
            let mut steps = Vec::with_capacity(n as usize);
            for _ in 0..n {
                steps.push(self.plan_at);
                let cut = self.advance_plan()?;
                if cut || self.plan_at.epoch >= total {
                    break;
                }
            }
            let (len, seed) = (self.tally.train_len(), self.cfg.spec.seed);
            let perm = permutation_of(&mut self.plan_perm, len, seed, steps[0].epoch);
            let to = Window { generation: self.generation, steps: &steps, perm, samples: len };
            let members = self.membership.members();
            let routes = Routes::of(&mut self.routes, members, &self.conns);
            let lost = to.send(members, &routes.runs, &mut self.conns)?;
            let pipe = self.pipe.as_mut().expect("checked above");
            let now = Instant::now();
            pipe.issue(now, steps);
            for (rank, e) in lost {
                pipe.lost(now, rank, &e);
            }
        }
    }

    /// Windows kept ahead of the ranks. The built-in students that ask
    /// teachers for soft labels get one more: a window reaches a rank just
    /// after it starts the step before, too late to ask for it then; with
    /// one more queued, the next step's soft labels are asked for a whole
    /// step ahead. (A launched program asks its teachers itself.)
    pub(super) fn windows_ahead(&self) -> usize {
        let builtin = matches!(self.cfg.spec.program, crate::job::spec::Program::Builtin(_));
        if builtin && self.told.teachers.is_some() { AHEAD + 1 } else { AHEAD }
    }

    pub(super) fn window_len(&self) -> u64 {
        match self.step_ms {
            Some(ms) if ms > 0.0 => ((WINDOW_WORK_MS / ms) as u64).clamp(1, MAX_WINDOW),
            _ => 1,
        }
    }

    /// Moves the plan to the next step, asking the adapter for its
    /// hyperparameters. True when a window must end there.
    pub(super) fn advance_plan(&mut self) -> Result<bool> {
        let mut p = self.plan_at;
        p.cursor += p.hyper.global_batch.max(1) as usize;
        p.step += 1;
        let mut cut = false;
        if p.cursor >= self.tally.train_len() {
            p.cursor = 0;
            p.epoch += 1;
            cut = true;
        }
        cut |= self.cfg.checkpoint_every.is_some_and(|n| p.step.is_multiple_of(n.max(1)))
            || p.step.is_multiple_of(self.cfg.decide_every.max(1));
        if let Some(a) = self.adapter.as_mut() {
            let before = p.hyper;
            let answer = a.on_step(p.step, &p.hyper);
            let kept = self.adapter_answer("on-step", answer)?;
            if let Some(h) = kept {
                p.hyper = h;
            }
            // The first answer after it was told of the training, for the
            // report (none where the call failed and the settings were kept).
            if let Some(d) = self.adapter_decisions.back_mut().filter(|d| d.step == u64::MAX) {
                (d.step, d.current, d.answer) = (p.step, before, kept);
            }
        }
        self.plan_at = p;
        Ok(cut)
    }

    /// Every rank finished a window: its steps enter the ledger, in order.
    pub(super) fn commit_window(&mut self, c: Committed) -> Result<()> {
        let first_of_generation =
            self.pending.as_ref().is_some_and(|p| p.generation == Some(self.generation))
                && c.steps.first().map(|s| s.step) == Some(self.tally.committed);
        if !first_of_generation && !c.steps.is_empty() {
            // The slowest rank's compute per step: windows are sized by the
            // work in them, not by the time the control plane itself takes.
            let per = c
                .reports
                .iter()
                .map(|(_, r)| r.iter().map(|d| d.compute_ms).sum::<f64>() / c.steps.len() as f64)
                .fold(0.0, f64::max);
            self.step_ms = Some(self.step_ms.map_or(per, |m| 0.7 * m + 0.3 * per));
        }
        // The step after the window: the next one sent, or the next to plan.
        let after = self.pipe.as_ref().and_then(Pipeline::next_planned).unwrap_or(self.plan_at);
        // The worker of each report (a host's: the first of its ranks).
        let members = self.membership.members();
        let by: Vec<u64> = c.reports.iter().map(|(rank, _)| members.get(*rank).map_or(0, |m| m.id)).collect();
        for (i, plan) in c.steps.iter().enumerate() {
            let reports: Vec<StepDone> = c.reports.iter().map(|(_, r)| r[i].clone()).collect();
            let next = c.steps.get(i + 1).copied().unwrap_or(after);
            self.commit_step(plan, &reports, &by, first_of_generation && i == 0, c.setup_ms, next.hyper)?;
        }
        self.init = None;
        tracing::debug!("committed step {}", self.tally.committed);
        // At the job's end the final checkpoint is asked for on its own.
        let checkpoint = if self.tally.epoch < self.cfg.spec.epochs { self.checkpoint_due() } else { None };
        let step = self.tally.committed;
        let wrote = checkpoint.is_some();
        if let (true, Some(m0)) = (wrote, self.membership.members().first()) {
            let id = m0.id;
            self.pin_ps(step, id);
        }
        self.trim_ps();
        // A job that can be taken over stores its progress at every commit;
        // the workers keep the rollback point of the newest stored step.
        let follow = self.told.follow.is_some();
        if follow {
            self.save_state(false);
        }
        let stored = self.keeper.as_ref().filter(|_| follow).map(|k| k.stored_step());
        // Before its first checkpoint, a job whose servers may lose rows
        // goes back to its start with its workers: they keep step 0's state.
        let origin = self.ps.servers.is_some() && self.checkpoints.is_empty();
        let commit = |checkpoint| {
            encode(&ToWorker::Commit { step, checkpoint, wait: false, stored, origin })
                .map_err(|e| anyhow!("a commit: {e}"))
        };
        // Rank 0's message differs only when it carries a checkpoint.
        let rank0 = checkpoint.map(|c| commit(Some(c))).transpose()?;
        let rest = commit(None)?;
        self.send_commits(rank0.as_deref(), &rest);
        if !follow && (wrote || self.timers.is_due(Timer::SaveState, Instant::now())) {
            self.save_state(false);
        }
        if self.tally.committed.is_multiple_of(self.cfg.decide_every.max(1))
            && self.tally.epoch < self.cfg.spec.epochs
        {
            self.decide();
        }
        Ok(())
    }

    /// Tells every rank the commit (`rank0`: rank 0's own, when it carries
    /// a checkpoint): one message to each relay for all its ranks.
    fn send_commits(&mut self, rank0: Option<&[u8]>, rest: &[u8]) {
        let members = self.membership.members();
        for &Run { first, end, ref relay } in &Routes::of(&mut self.routes, members, &self.conns).runs {
            let mut from = first;
            if let (0, Some(line)) = (first, rank0) {
                if let Some(stream) = self.conns.get_mut(&members[0].conn) {
                    let _ = stream.send_encoded(line);
                }
                from = 1;
            }
            if let Some(relay) = relay.as_ref().filter(|_| end - from > 1) {
                let conns = relay.conns[from - first..].to_vec();
                // A relay gone closes its workers' connections; their readers report that.
                let _ = relay.out.send(&[Frame::Fan { conns, line: rest.to_vec() }]);
                continue;
            }
            for m in &members[from..end] {
                if let Some(stream) = self.conns.get_mut(&m.conn) {
                    // A failed send closes the connection; its reader reports that.
                    let _ = stream.send_encoded(rest);
                }
            }
        }
    }

    /// Commits one step every rank finished: its samples enter the ledger
    /// (the ids at the positions each rank reported), the cursor moves.
    /// `next_hyper`: the hyperparameters planned for the step after it.
    /// What the commit adds up to is said in the order the report keeps:
    /// the step, the resize it completes, the epoch it ends.
    pub(super) fn commit_step(
        &mut self,
        plan: &StepPlan,
        reports: &[StepDone],
        by: &[u64],
        first: bool,
        setup_ms: f64,
        next_hyper: Hyperparams,
    ) -> Result<()> {
        let totals = self.tally.commit(Instant::now(), plan, reports, by, first)?;
        self.hyper = next_hyper;
        self.step_times.committed(self.membership.world(), plan.hyper.global_batch);
        let base = self.cfg.hyper.global_batch;
        let efficiency =
            totals.noise_scale.map(|b| super::machine::noise::efficiency(b, base, plan.hyper.global_batch));
        let rec = StepRecord {
            step: self.tally.committed,
            epoch: self.tally.epoch,
            world: self.membership.world(),
            secs: self.started.elapsed().as_secs_f64(),
            loss: totals.loss,
            samples_per_sec: totals.samples_per_sec,
            cursor: self.tally.cursor.min(self.tally.train_len()),
            batch: plan.hyper.global_batch,
            lr: plan.hyper.lr,
            noise_scale: totals.noise_scale,
            grad_var: totals.noise_parts.map(|p| p.0),
            grad_sqr: totals.noise_parts.map(|p| p.1),
            efficiency,
            goodput: efficiency.map(|e| e * totals.samples_per_sec),
            metrics: totals.metrics,
            ps_servers: self.ps.servers.as_ref().map(|(c, _)| c.topology().servers.len() as u32),
        };
        (self.progress)(Progress::Step(&rec));
        self.timeline.push(rec);
        if first {
            self.complete_resize(setup_ms);
        }
        if let Some(rec) = self.tally.end_epoch() {
            (self.progress)(Progress::Epoch(&rec));
        }
        Ok(())
    }

    /// The first step of a generation is committed: the resize that made
    /// it becomes a scale event.
    fn complete_resize(&mut self, setup_ms: f64) {
        let Some(p) = self.pending.take() else { return };
        let now = Instant::now();
        let ev = ScaleEvent {
            recovery: p.recovery(now),
            setup_ms,
            step: self.tally.committed - 1,
            from: p.from,
            to: self.membership.world(),
            pause_ms: ms(now.saturating_duration_since(p.boundary)),
            reason: p.reason,
            generation: self.generation,
            join_ms: p.join_ms,
            at_secs: self.started.elapsed().as_secs_f64(),
        };
        (self.progress)(Progress::Scale(&ev));
        self.events.push(ev);
    }
}

/// One window of steps on its way to the ranks.
struct Window<'a> {
    generation: u64,
    steps: &'a [StepPlan],
    /// The epoch's permutation, and its samples.
    perm: &'a [u32],
    samples: usize,
}

impl Window<'_> {
    /// Sends each rank its own samples of every step: consecutive ranks
    /// behind one relay get one window for them all (the relay shares it
    /// out), every other rank its own. Returns the ranks it could not reach.
    fn send(
        &self,
        members: &[Worker],
        routes: &[Run],
        conns: &mut HashMap<u64, Outbox>,
    ) -> Result<Vec<(usize, String)>> {
        let world = members.len();
        let mut lost = Vec::new();
        for &Run { first, end, ref relay } in routes {
            let Some(relay) = relay else {
                let m = &members[first];
                let shares = self.steps.iter().map(|p| self.share(p, first, first, world)).collect();
                let line = encode(&ToWorker::Steps {
                    generation: self.generation,
                    steps: self.steps.to_vec(),
                    shares,
                })
                .map_err(|e| anyhow!("encoding a window: {e}"))?;
                if let Some(stream) = conns.get_mut(&m.conn)
                    && let Err(e) = stream.send_encoded(&line)
                {
                    lost.push((first, e.to_string()));
                }
                continue;
            };
            let w = HostWindow {
                generation: self.generation,
                world,
                samples: self.samples,
                steps: self.steps.to_vec(),
                conns: relay.conns.clone(),
                first,
                shares: self.steps.iter().map(|p| self.share(p, first, end - 1, world)).collect(),
            };
            if let Err(why) = relay.out.send(&[Frame::Window(Box::new(w))]) {
                lost.extend((first..end).map(|r| (r, why.clone())));
            }
        }
        Ok(lost)
    }

    /// The positions of ranks `first..=last` in step `p` together, and the samples there.
    fn share(&self, p: &StepPlan, first: usize, last: usize, world: usize) -> Share {
        let gb = p.hyper.global_batch.max(1) as usize;
        let lo = crate::trainer::data::shard(p.cursor, gb, first, world, self.samples).start;
        let hi = crate::trainer::data::shard(p.cursor, gb, last, world, self.samples).end;
        Share { start: lo as u32, end: hi as u32, indices: self.perm[lo..hi].to_vec() }
    }
}
