//! The warm spares a scaling policy sizes (its optional `spare-policy`):
//! what they cost and what they were used for, asked just after each
//! `decide`; the answer kept below the job's maximum.

use super::Coordinator;
use edl_plugin_sdk::SpareView;
use std::time::Instant;

impl Coordinator<'_> {
    /// The job's spares as of `now`: what they cost and what they were
    /// used for (the spare-hours summed up to `now`).
    pub(super) fn spare_view(&mut self, now: Instant) -> SpareView {
        let holding = self.membership.spares();
        let book = &mut self.spare_book;
        book.held_secs += f64::from(holding) * now.duration_since(book.looked).as_secs_f64();
        book.looked = now;
        let counts = self.membership.spare_counts();
        SpareView {
            step: self.tally.committed,
            world_size: self.membership.world(),
            min_workers: self.cfg.min_workers,
            max_workers: self.cfg.max_workers,
            spares_wanted: self.membership.spares_wanted(),
            spares_ready: self.membership.spares_ready(),
            spares_starting: holding - self.membership.spares_ready(),
            price_per_spare_hour: self.cfg.price_per_worker_hour,
            spare_hours: book.held_secs / 3600.0,
            from_spares: counts.from_spares,
            started_cold: counts.started_cold,
            members_lost: counts.members_lost,
            ready_secs: if counts.readied == 0 {
                0.0
            } else {
                counts.ready_time.as_secs_f64() / counts.readied as f64
            },
            hours: self.training_since.map_or(0.0, |t| now.duration_since(t).as_secs_f64() / 3600.0),
            secs_since_change: now.duration_since(book.changed).as_secs_f64(),
        }
    }

    /// Asks the scaling policy how many warm spares the job should keep
    /// (a policy that sizes them; just after its `decide`), and keeps the
    /// answer below `max-workers` (as `--warm-spares`). Each answer (a
    /// number) or error is kept for the report.
    pub(super) fn decide_spares(&mut self) {
        let now = Instant::now();
        let view = self.spare_view(now);
        let answer = match self.policy.decide_spares(&view) {
            Ok(None) => return,
            Ok(Some(n)) => Ok(n),
            Err(e) => Err(e.to_string()),
        };
        let mut decision = super::records::SpareDecision {
            secs: self.started.elapsed().as_secs_f64(),
            view,
            answer: answer.as_ref().ok().copied(),
            error: answer.as_ref().err().cloned(),
            spares: None,
        };
        let asked = match answer {
            Ok(n) => n,
            Err(e) => {
                self.keep_spare_decision(decision);
                return self.note(format!("scaling policy: decide-spares failed, spares as they are: {e}"));
            }
        };
        // The bound `--warm-spares` has: below the maximum.
        let want = asked.min(self.cfg.max_workers.saturating_sub(1));
        if want != asked && self.spare_book.clamped != Some(asked) {
            self.note(format!("scaling policy asked for {asked} warm spares; {want} (below --max-workers)"));
        }
        self.spare_book.clamped = (want != asked).then_some(asked);
        let was = decision.view.spares_wanted;
        if want == was {
            return self.keep_spare_decision(decision);
        }
        if !self.membership.set_spares(now, want) {
            self.keep_spare_decision(decision);
            if !std::mem::replace(&mut self.spare_book.told_gave_up, true) {
                self.note(format!(
                    "scaling policy asked for {want} warm spares; the job keeps none, having lost spares before they were ready"
                ));
            }
            return;
        }
        decision.spares = Some(want);
        self.keep_spare_decision(decision);
        self.spare_book.changed = now;
        self.note(format!("scaling policy: warm spares {was} -> {want}"));
        self.execute();
    }

    /// Keeps a decision for the report (the newest of them).
    fn keep_spare_decision(&mut self, decision: super::records::SpareDecision) {
        let kept = &mut self.spare_book.decisions;
        if kept.len() >= super::records::POLICY_DECISIONS_KEPT {
            kept.pop_front();
        }
        kept.push_back(decision);
    }
}
