//! The job's parameter servers as the coordinator tends them: watched
//! once a second (a server lost, one told to go, one near its memory
//! bound), and changed at a generation boundary, where every table is
//! rolled back to the committed step and shards move to the servers that
//! hold them from then on.

use super::Coordinator;
use crate::job::spec::PsTopology;
use anyhow::Result;

/// A server's rows past this share of its memory bound: one more server.
const GROW_AT: f64 = 0.8;
/// How long the job waits before it starts servers again to reach its
/// fewest, when those it started for that did not start (doubling each
/// time, up to the most).
const FLOOR_RETRY: std::time::Duration = std::time::Duration::from_secs(5);
const FLOOR_RETRY_MOST: std::time::Duration = std::time::Duration::from_secs(300);

/// Server ids as a person reads them: `3, 4`.
fn id_list(ids: &[u64]) -> String {
    ids.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
}

impl Coordinator<'_> {
    /// Once a second: the servers' stats; one told to go is moved away
    /// from, and one near its memory bound gets a new server beside it
    /// (within the job's most), both at the next boundary.
    pub(super) fn watch_ps(&mut self) {
        // Servers started meanwhile, whether or not the others answer now.
        for said in self.ps_started(false) {
            self.note(said);
        }
        self.keep_ps_floor();
        let safe = self.ps_safe();
        let Some((control, _)) = self.ps.servers.as_mut() else { return };
        let stats = match control.stats(safe) {
            Ok(s) => s,
            // A server gone: the next generation finds out and says so.
            Err(_) => return,
        };
        (self.progress)(super::Progress::ParameterServers(&stats));
        self.ps_looked(&stats);
        let Some((_, processes)) = self.ps.servers.as_mut() else { return };
        let (bound, max) = processes.limits();
        let mut said = Vec::new();
        for s in &stats {
            // The last one stays (until its notice runs out: then it is lost).
            let others = stats.len() - self.ps.leaving.len() > 1 || !self.ps.added.is_empty();
            if s.leaving && !self.ps.leaving.contains(&s.server) && others {
                self.ps.leaving.push(s.server);
                said.push(format!(
                    "parameter server {} was told to go; its shards move at the next step boundary",
                    s.server
                ));
            }
        }
        let refused: u64 = stats.iter().map(|s| s.refused).sum();
        let newly_refused = refused > self.ps.refused;
        self.ps.refused = refused;
        let full = bound
            .and_then(|b| stats.iter().find(|s| (s.bytes + s.working_bytes) as f64 > GROW_AT * b as f64));
        let planned = processes.len() as u32;
        let why = match (full, newly_refused) {
            (Some(s), _) => Some(format!(
                "parameter server {} holds {:.1} MiB of rows and {:.1} MiB of undo records and staged pushes, over {:.0}% of its bound",
                s.server,
                s.bytes as f64 / (1 << 20) as f64,
                s.working_bytes as f64 / (1 << 20) as f64,
                GROW_AT * 100.0
            )),
            (None, true) => Some("a parameter server refused new rows at its memory bound".to_string()),
            (None, false) => None,
        };
        // A step refused for want of room is redone once the server it
        // asks for has joined (the boundary waits for its start).
        self.ps.want_room |= newly_refused;
        if let Some(why) = why
            && self.ps.added.is_empty()
            && !processes.starting()
            && !self.ps.sized_by_policy
            && planned < max
        {
            match processes.start_more(1) {
                Ok(ids) => said.push(format!(
                    "{why}: starting server {}, to join at the step boundary after it serves",
                    ids[0]
                )),
                Err(e) => said.push(format!("{why}; no server started: {e:#}")),
            }
        }
        for s in said {
            self.note(s);
        }
        // Servers added or told to go get their shards moving now.
        self.copy_ahead();
    }

    /// Keeps what the servers said, and each one's requests per second
    /// since the look before.
    fn ps_looked(&mut self, stats: &[crate::ps::Stats]) {
        let now = std::time::Instant::now();
        let counts: std::collections::BTreeMap<u64, u64> =
            stats.iter().map(|s| (s.server, s.requests)).collect();
        if let Some((then, before)) = self.ps.looked.take() {
            let secs = now.duration_since(then).as_secs_f64().max(1e-3);
            self.ps.rates = counts
                .iter()
                .filter_map(|(id, n)| Some((*id, n.saturating_sub(*before.get(id)?) as f64 / secs)))
                .collect();
        }
        self.ps.looked = Some((now, counts));
        self.ps.seen = stats.to_vec();
    }

    /// Asks the scaling policy how many parameter servers the job should
    /// have (a policy that sizes them; just after its `decide`): more are
    /// started, to join at the next step boundary; fewer leave there, newest
    /// first, their shards handed over first. One change at a time.
    pub(super) fn decide_servers(&mut self) {
        let Some((control, processes)) = self.ps.servers.as_ref() else { return };
        if self.ps_change_pending() || self.ps.seen.is_empty() {
            return;
        }
        let (bound, _) = processes.limits();
        let (min, max) = processes.bounds();
        let replicas = control.topology().replicas as u32;
        let servers = self
            .ps
            .seen
            .iter()
            .map(|s| edl_plugin_sdk::ServerStats {
                id: s.server,
                rows: s.tables.iter().map(|t| t.rows).sum(),
                bytes: s.bytes,
                working_bytes: s.working_bytes,
                bound_bytes: bound.unwrap_or(0),
                requests_per_sec: self.ps.rates.get(&s.server).copied().unwrap_or(0.0),
                refused: s.refused,
            })
            .collect();
        let view = edl_plugin_sdk::ServerView {
            step: self.tally.committed,
            servers,
            min_servers: min,
            max_servers: max,
            replicas,
            secs_since_change: self.ps.changed.unwrap_or(self.started).elapsed().as_secs_f64(),
        };
        let answer = self.policy.decide_servers(&view);
        let mut decision = super::ServerDecision {
            secs: self.started.elapsed().as_secs_f64(),
            view,
            answer: answer.as_ref().ok().copied().flatten(),
            error: answer.as_ref().err().map(|e| e.to_string()),
            servers: None,
        };
        let asked = match answer {
            Ok(Some(n)) => n,
            Ok(None) => {
                self.ps.sized_by_policy = false;
                return self.keep_server_decision(decision);
            }
            Err(e) => {
                self.keep_server_decision(decision);
                return self.note(format!("scaling policy: decide-servers failed, servers as they are: {e}"));
            }
        };
        // The policy sizes them: the memory rule stands aside.
        self.ps.sized_by_policy = true;
        let want = asked.max(min.max(replicas)).min(max);
        if want != asked {
            self.note(format!(
                "scaling policy asked for {asked} parameter servers; {want} (within {min}..={max})"
            ));
        }
        decision.servers = Some(want);
        self.keep_server_decision(decision);
        self.resize_ps(want);
    }

    /// Keeps a decision for the report (the newest of them).
    fn keep_server_decision(&mut self, decision: super::ServerDecision) {
        if self.ps.decisions.len() >= super::records::POLICY_DECISIONS_KEPT {
            self.ps.decisions.pop_front();
        }
        self.ps.decisions.push_back(decision);
    }

    /// Starts servers, or tells the newest to go, towards `want` servers.
    fn resize_ps(&mut self, want: u32) {
        let Some((_, processes)) = self.ps.servers.as_mut() else { return };
        let now = processes.len() as u32;
        let said = if want > now {
            match processes.start_more(want - now) {
                Ok(ids) => format!(
                    "scaling policy: parameter servers {now} -> {want}: starting server(s) {}, to join at the step boundary after they serve",
                    id_list(&ids)
                ),
                Err(e) => format!("scaling policy: parameter servers {now} -> {want}: none started: {e:#}"),
            }
        } else if want < now {
            let mut ids: Vec<u64> = processes.addrs().iter().map(|(id, _)| *id).collect();
            ids.sort_unstable_by(|a, b| b.cmp(a));
            ids.truncate((now - want) as usize);
            self.ps.leaving.extend(&ids);
            self.copy_ahead();
            format!(
                "scaling policy: parameter servers {now} -> {want}: server(s) {} leave at the next step boundary, their shards handed over first",
                id_list(&ids)
            )
        } else {
            return;
        };
        self.note(said);
    }

    /// Fewer servers than the job's fewest (`--min-ps`, at least its
    /// replicas: one that was to replace a lost one did not start, say):
    /// as many more started, to join as any added server does; tried again
    /// after a pause while they do not start.
    fn keep_ps_floor(&mut self) {
        let pending = self.ps_change_pending();
        let Some((_, processes)) = self.ps.servers.as_mut() else { return };
        let ((min, _), have) = (processes.bounds(), processes.len() as u32);
        if have >= min {
            self.ps.floor_tried = None;
            return;
        }
        if pending || self.ps.floor_tried.is_some_and(|(t, pause)| t.elapsed() < pause) {
            return;
        }
        // Tried again after a pause that doubles while they do not start.
        let pause = self.ps.floor_tried.map_or(FLOOR_RETRY, |(_, p)| (p * 2).min(FLOOR_RETRY_MOST));
        self.ps.floor_tried = Some((std::time::Instant::now(), pause));
        let said = match processes.start_more(min - have) {
            Ok(ids) => format!(
                "parameter servers: {have}, fewer than the job's {min}: starting server(s) {}, to join at the step boundary after they serve",
                id_list(&ids)
            ),
            Err(e) => format!("parameter servers: {have}, fewer than the job's {min}; none started: {e:#}"),
        };
        self.note(said);
    }

    fn note_lost(&mut self, gone: &[(u64, String)]) {
        for (id, how) in gone {
            self.note(format!("parameter server {id} lost ({how})"));
        }
    }

    /// Each server's tables, rows and memory now (none when they cannot be asked).
    pub(super) fn ps_stats(&mut self) -> Vec<crate::ps::Stats> {
        let safe = self.ps_safe();
        let Some((control, _)) = self.ps.servers.as_mut() else { return Vec::new() };
        control.stats(safe).unwrap_or_default()
    }

    /// Says what each server holds (at the job's end).
    pub(super) fn say_ps(&mut self) {
        for s in self.ps_stats() {
            let rows: u64 = s.tables.iter().map(|t| t.rows).sum();
            let bound = s.bound.map(|b| format!(" of {} MiB", b >> 20)).unwrap_or_default();
            self.note(format!(
                "parameter server {}: {} table(s), {rows} rows, {:.2} MiB{bound}",
                s.server,
                s.tables.len(),
                s.bytes as f64 / (1 << 20) as f64
            ));
        }
    }

    /// A checkpoint of `step` was asked of worker `id`: until it is written
    /// (or the worker gone), the servers keep what undoes the steps after it.
    pub(super) fn pin_ps(&mut self, step: u64, id: u64) {
        if self.ps.servers.is_some() {
            self.ps.pins.ask(step, id);
        }
    }

    /// After a commit: the servers forget how to undo the steps now past
    /// undoing, so that their undo records take one window's steps or so,
    /// not a second's.
    pub(super) fn trim_ps(&mut self) {
        let safe = self.ps_safe();
        // After a failure, trims wait for the once-a-second look (a server
        // wedged or gone must not hold every commit).
        if self.ps.trim_failed.is_some_and(|t| t.elapsed() < std::time::Duration::from_secs(1)) {
            return;
        }
        let Some((control, _)) = self.ps.servers.as_mut() else { return };
        if safe != self.ps.trimmed {
            match control.trim(safe) {
                Ok(()) => (self.ps.trimmed, self.ps.trim_failed) = (safe, None),
                Err(_) => self.ps.trim_failed = Some(std::time::Instant::now()),
            }
        }
    }

    /// Checkpoint writes that ended release the pins they held.
    pub(super) fn unpin_ps(&mut self, worker: u64, written: &[crate::control::proto::Written]) {
        self.ps.pins.written(worker, written.iter().map(|w| w.step));
    }

    /// The steps before this one are past undoing: committed, and no
    /// checkpoint of an earlier one still to be exported.
    fn ps_safe(&mut self) -> u64 {
        let members: Vec<u64> = self.membership.members().iter().map(|m| m.id).collect();
        let safe = self.ps.pins.safe(self.tally.committed, &members);
        // A copy ahead needs the rows changed since its step.
        self.ps.ahead.as_ref().map_or(safe, |(since, _)| safe.min(*since))
    }

    /// Whether the servers change at the next boundary: servers added
    /// once they have their shards, servers told to go.
    pub(super) fn ps_change_waiting(&self) -> bool {
        let copied = self.ps.ahead.as_ref().is_none_or(|(_, copying)| copying.is_finished());
        self.ps_change_decided() && copied
    }

    /// Whether servers are to join or leave at a boundary.
    fn ps_change_decided(&self) -> bool {
        !self.ps.added.is_empty() || !self.ps.leaving.is_empty()
    }

    /// Whether a change of servers is under way, servers still starting
    /// included (one change at a time).
    fn ps_change_pending(&self) -> bool {
        self.ps_change_decided() || self.ps.servers.as_ref().is_some_and(|(_, p)| p.starting())
    }

    /// The servers started on their own threads since the look before:
    /// those serving join at a step boundary (their shards copied to them
    /// first, while training goes on); what to say of each.
    fn ps_started(&mut self, wait: bool) -> Vec<String> {
        let Some((_, processes)) = self.ps.servers.as_mut() else { return Vec::new() };
        let mut said = Vec::new();
        for s in processes.started(wait) {
            match s {
                Ok((id, addr)) => {
                    said.push(format!(
                        "parameter server {id} serving on {addr}; it joins at a step boundary"
                    ));
                    self.ps.added.push((id, addr));
                }
                Err((_, e)) => said.push(format!("{e:#}")),
            }
        }
        said
    }

    /// Starts giving the servers the shards they will hold once those
    /// added have joined and those told to go have left, while training
    /// goes on; the change is made at the boundary after it ends, with only
    /// the rows changed meanwhile.
    fn copy_ahead(&mut self) {
        if self.ps.ahead.is_some() || !self.ps_change_decided() {
            return;
        }
        let safe = self.ps_safe();
        let Some((control, _)) = self.ps.servers.as_ref() else { return };
        let mark =
            crate::ps::Mark { generation: self.generation, base: self.tally.committed, committed: safe };
        let job = control.ahead_of((&self.ps.added, &self.ps.leaving), mark);
        let copying = std::thread::Builder::new()
            .name("edl-ps-copy".into())
            .spawn(move || crate::ps::control::copy_ahead(job));
        match copying {
            Ok(h) => self.ps.ahead = Some((mark.base, h)),
            Err(e) => self.note(format!(
                "parameter servers: no thread to copy shards ahead ({e}); they move when the servers join"
            )),
        }
    }

    /// The copy ahead of the servers joining now, once it ended: what it
    /// copied, or None (none ran, or it failed: saying so; every shard is
    /// then copied whole at the boundary).
    fn ahead_done(&mut self) -> Option<crate::ps::control::Ahead> {
        let (_, copying) = self.ps.ahead.take()?;
        match copying.join() {
            Ok(Ok(a)) => Some(a),
            Ok(Err(e)) => {
                self.note(format!("parameter servers: the copy ahead failed ({e:#}); the shards move now"));
                None
            }
            Err(_) => {
                self.note("parameter servers: the copy ahead panicked; the shards move now".to_string());
                None
            }
        }
    }

    /// A last look at the servers before a boundary: a step that failed for
    /// want of room asks for a server now, and waits for it to start,
    /// before it is redone.
    fn ps_before_boundary(&mut self) {
        self.watch_ps();
        if std::mem::take(&mut self.ps.want_room) {
            for said in self.ps_started(true) {
                self.note(said);
            }
        }
    }

    /// The parameter servers for a new generation: every table rolled back
    /// to the committed step (pulls of the generation before released), the
    /// servers lost dropped (their shards served by their replicas and
    /// copied to new ones, or with one replica, the job back to its newest
    /// checkpoint), those told to go moved away from and stopped, those
    /// started joined. Returns the servers the generation is told.
    pub(super) fn reform_ps(&mut self) -> Result<Option<PsTopology>> {
        self.ps_before_boundary();
        let safe = self.ps_safe();
        if self.ps.servers.is_none() {
            return Ok(None);
        }
        // Servers added join with the rows changed since their copy ahead
        // (a boundary that comes before it ended, a worker lost or a step
        // that found a server full, waits for it: the copy the pause would
        // have held otherwise).
        let mut added = std::mem::take(&mut self.ps.added);
        let leaving = std::mem::take(&mut self.ps.leaving);
        let ahead = self.ahead_done();
        let mut suspects: Vec<u64> = Vec::new();
        let mark =
            crate::ps::Mark { generation: self.generation, base: self.tally.committed, committed: safe };
        let mut gone: Vec<(u64, String)> = Vec::new();
        let mut tries = 0;
        let before = self.ps.servers.as_ref().expect("above").0.topology().servers.len();
        let moved = loop {
            let (control, processes) = self.ps.servers.as_mut().expect("above");
            // A server that dies while the shards move is found on the next try.
            gone.extend(processes.exited());
            let lost: Vec<u64> = gone.iter().map(|(id, _)| *id).collect();
            // One added that died before it joined is not waited for.
            added.retain(|(id, _)| !lost.contains(id));
            let leaving: Vec<u64> = leaving.iter().copied().filter(|id| !lost.contains(id)).collect();
            match control.reform(mark, (&lost, &leaving), &added, ahead.as_ref()) {
                Ok(m) => break m,
                Err(e) if e.is::<crate::ps::control::ShardsLost>() => {
                    return self.ps_rows_lost(e, (&lost, &leaving), added, &gone);
                }
                Err(e) if let Some((id, why)) = unreachable(&e).filter(|(id, _)| suspects.contains(id)) => {
                    // A server that cannot be reached twice running (cut
                    // off, its host gone) is lost: its command is stopped
                    // and its shards are served by their other holders, as
                    // if it had died.
                    processes.stop(id);
                    added.retain(|(a, _)| *a != id);
                    gone.push((id, format!("unreachable: {why}")));
                }
                Err(e) if let Some((id, _)) = unreachable(&e).filter(|(id, _)| !lost.contains(id)) => {
                    suspects.push(id);
                    self.note(format!("parameter servers: {e:#}; trying again"));
                    std::thread::sleep(std::time::Duration::from_secs(1));
                }
                Err(e) if tries < 2 => {
                    tries += 1;
                    self.note(format!("parameter servers: {e:#}; trying again"));
                    std::thread::sleep(std::time::Duration::from_secs(1));
                }
                Err(e) => return Err(e.context("the parameter servers")),
            }
        };
        self.note_lost(&gone);
        let (control, processes) = self.ps.servers.as_mut().expect("above");
        for id in &leaving {
            processes.stop(*id);
        }
        // Room while the job may still grow: servers starting count as room.
        control.set_room((processes.running() as u32) < processes.limits().1);
        let topology = control.topology().clone();
        let now = topology.servers.len();
        if now != before {
            self.ps.changed = Some(std::time::Instant::now());
        }
        if moved.rows > 0 || now != before {
            self.note_moved((before, now), moved.rows, ahead.as_ref());
        }
        Ok(Some(topology))
    }

    /// Shards lost with all their holders (`e`): the tables made again from
    /// the newest checkpoint on the servers left (those `lost` and
    /// `leaving` out), and as many servers again started, to join as any
    /// added server does; with none left, or where servers have a memory
    /// bound (the rows of those lost would not fit on the rest), the job
    /// waits for them first. Returns the servers the generation is told.
    fn ps_rows_lost(
        &mut self,
        e: anyhow::Error,
        (lost, leaving): (&[u64], &[u64]),
        added: Vec<(u64, String)>,
        gone: &[(u64, String)],
    ) -> Result<Option<PsTopology>> {
        let (control, processes) = self.ps.servers.as_mut().expect("a job with servers");
        let mut added = added;
        // Servers told to go leave now too (their rows are made again elsewhere).
        let out: Vec<u64> = lost.iter().chain(leaving).copied().collect();
        let left = control.topology().servers.iter().filter(|(id, _)| !out.contains(id)).count();
        let again = lost.len() as u32;
        let bounded = processes.limits().0.is_some();
        let starting = if left + added.len() == 0 || bounded {
            match processes.more(again) {
                Ok(started) => {
                    added.extend(started);
                    None
                }
                Err(e) if left + added.len() == 0 => {
                    return Err(
                        e.context("no parameter server is left, and none started in place of those lost")
                    );
                }
                // The rest take the rows; the job's fewest brings more later.
                Err(e) => Some(Err(e)),
            }
        } else {
            Some(processes.start_more(again))
        };
        control.reset(&out, &added)?;
        for id in leaving {
            processes.stop(*id);
        }
        let topology = control.topology().clone();
        self.note_lost(gone);
        if topology.servers.len() < topology.replicas {
            self.note(format!(
                "parameter servers: {} left for {} replica(s) a shard until more join",
                topology.servers.len(),
                topology.replicas
            ));
        }
        match starting {
            Some(Ok(ids)) => self.note(format!(
                "parameter servers: starting server(s) {} in place of those lost, to join at the step boundary after they serve",
                id_list(&ids)
            )),
            Some(Err(e)) => self.note(format!("parameter servers: none started in place of those lost: {e:#}")),
            None => {}
        }
        self.restore_newest(format!("{e}"))?;
        Ok(Some(topology))
    }

    /// Says what a change of servers moved (and what was copied ahead).
    fn note_moved(
        &mut self,
        (before, now): (usize, usize),
        rows: usize,
        ahead: Option<&crate::ps::control::Ahead>,
    ) {
        let early = match ahead {
            Some(a) if a.rows > 0 => format!(
                " ({} rows copied ahead from step {} while training went on; these changed since)",
                a.rows, a.since
            ),
            _ => String::new(),
        };
        self.note(format!(
            "parameter servers {before} -> {now}: {rows} rows moved at step {}{early}",
            self.tally.committed
        ));
    }
}

/// The server an error says could not be reached, and why.
fn unreachable(e: &anyhow::Error) -> Option<(u64, String)> {
    e.chain()
        .find_map(|c| c.downcast_ref::<crate::ps::service::Unreachable>())
        .map(|u| (u.server, u.detail.clone()))
}
