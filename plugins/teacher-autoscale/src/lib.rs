//! Sizes a distillation job's teacher pool from what the students and the
//! teachers measure.
//!
//! - Students wait (`wait_share` above `grow-wait`) and the teachers are
//!   busy (mean utilisation above `busy`): the pool is too small. It grows in
//!   proportion to the wait, `ceil(count x (1 + wait_share))`, by at least one.
//! - Students wait but the teachers are not busy: the pool is latency-bound,
//!   not short of compute; each student keeps twice as many requests in
//!   flight at each teacher (up to 16) instead of adding teachers.
//! - The scaling policy has planned more students: the pool grows ahead of
//!   them, in proportion, `ceil(count x planned / now)`. Students that
//!   joined without the policy having seen them planned (between two of its
//!   decisions) are grown for in the same proportion, from the largest
//!   world the pool was sized for since it last shrank (students that left
//!   and came back are not grown for twice).
//! - Teachers idle (mean utilisation below `idle`) and students do not wait
//!   for `shrink-after` decisions in a row, and the pool has not changed for
//!   `settle-secs`: one teacher goes. A single busy or waiting decision starts
//!   the count again, so the pool does not flap on a noisy signal.
//! - A pool of no teacher (not started yet) starts with `max(min, 1)`.
//!
//! The answer is always within the view's bounds. The idle streak is the
//! policy's memory (`save_state`), so a new instance goes on counting.

use edl_plugin_sdk::{Config, PluginError, TeacherPlan, TeacherPolicy, TeacherView};
use serde::{Deserialize, Serialize};

/// The most requests in flight per teacher this policy asks for.
pub const MAX_IN_FLIGHT: u32 = 16;

/// The teacher-pool policy; see the crate documentation.
#[derive(Debug)]
pub struct TeacherAutoscale {
    /// Wait share above which the students count as waiting.
    grow_wait: f64,
    /// Mean utilisation above which the teachers count as busy.
    busy: f64,
    /// Mean utilisation below which the teachers count as idle.
    idle: f64,
    /// No shrink within this many seconds of the pool's last change.
    settle_secs: f64,
    /// Consecutive idle decisions before one teacher goes.
    shrink_after: u32,
    mem: Memory,
}

/// What the policy carries from one decision to the next.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
struct Memory {
    /// Decisions in a row with idle teachers and students that did not wait.
    idle_streak: u32,
    /// The largest student world the pool was sized for since it last
    /// shrank (0: none yet).
    #[serde(default)]
    sized_for: u32,
}

impl Default for TeacherAutoscale {
    fn default() -> Self {
        TeacherAutoscale {
            grow_wait: 0.05,
            busy: 0.6,
            idle: 0.25,
            settle_secs: 10.0,
            shrink_after: 3,
            mem: Memory::default(),
        }
    }
}

fn bad(message: String) -> PluginError {
    PluginError::InvalidConfig(message)
}

impl TeacherPolicy for TeacherAutoscale {
    fn init(&mut self, config: &Config) -> Result<(), PluginError> {
        config.expect_only(&["grow-wait", "busy", "idle", "settle-secs", "shrink-after"])?;
        let d = TeacherAutoscale::default();
        self.grow_wait = config.get_or("grow-wait", d.grow_wait)?;
        self.busy = config.get_or("busy", d.busy)?;
        self.idle = config.get_or("idle", d.idle)?;
        self.settle_secs = config.get_or("settle-secs", d.settle_secs)?;
        self.shrink_after = config.get_or("shrink-after", d.shrink_after)?;
        if !(0.0..1.0).contains(&self.grow_wait) {
            return Err(bad(format!("`grow-wait` = {} must be in [0, 1)", self.grow_wait)));
        }
        if !(self.busy > 0.0 && self.busy <= 1.0) {
            return Err(bad(format!("`busy` = {} must be in (0, 1]", self.busy)));
        }
        if !(0.0..self.busy).contains(&self.idle) {
            return Err(bad(format!("`idle` = {} must be in [0, busy = {})", self.idle, self.busy)));
        }
        if !(self.settle_secs.is_finite() && self.settle_secs >= 0.0) {
            return Err(bad(format!("`settle-secs` = {} must be finite and at least 0", self.settle_secs)));
        }
        if self.shrink_after == 0 {
            return Err(bad("`shrink-after` must be at least 1".into()));
        }
        Ok(())
    }

    fn decide(&mut self, view: &TeacherView) -> TeacherPlan {
        let (lo, hi) = (view.min_teachers.min(view.max_teachers), view.max_teachers);
        let count = view.teacher_count;
        if count == 0 {
            self.mem.idle_streak = 0;
            let start = view.min_teachers.max(1).min(hi.max(1));
            return TeacherPlan { teachers: start, in_flight_per_teacher: view.in_flight_per_teacher.max(1) };
        }
        let plan = self.plan(view);
        TeacherPlan { teachers: plan.teachers.clamp(lo, hi), ..plan }
    }

    fn save_state(&self) -> Vec<u8> {
        // Two numbers: serialising them cannot fail.
        serde_json::to_vec(&self.mem).unwrap_or_default()
    }

    fn load_state(&mut self, state: &[u8]) -> Result<(), PluginError> {
        self.mem = serde_json::from_slice(state).map_err(|e| {
            PluginError::InvalidInput(format!("not the teacher-autoscale policy's memory: {e}"))
        })?;
        Ok(())
    }
}

impl TeacherAutoscale {
    /// The plan for a running pool (`teacher_count` at least 1), before the
    /// bounds are applied.
    fn plan(&mut self, view: &TeacherView) -> TeacherPlan {
        let count = view.teacher_count;
        let in_flight = view.in_flight_per_teacher.max(1);
        let utilisation = view.mean_utilisation();
        let waiting = view.wait_share > self.grow_wait;
        let mut teachers = count;
        let mut raised = in_flight;

        let (now, planned) = (view.student_world_size, view.student_world_planned);
        let scale_out = planned > now && now > 0;
        // The pool is sized for the largest world since it last shrank:
        // students that left do not lower it, and their return (planned or
        // seen) is grown for only beyond it.
        let sized_for = self.mem.sized_for;
        let base = if sized_for > 0 { sized_for } else { now };
        let want = if scale_out { planned } else { now };
        if base > 0 && want > base {
            teachers = teachers.max(ceil(count as f64 * want as f64 / base as f64));
        }
        self.mem.sized_for = want.max(sized_for);
        // A teacher without a whole window of statistics started since the
        // last look: the window does not show what it adds yet, so the pool
        // waits for it before growing again (no overshoot after a growth).
        let complete = view.teachers.len() as u32 >= count;
        if waiting && complete && utilisation > self.busy {
            let grown = ceil(count as f64 * (1.0 + view.wait_share.min(1.0))).max(count.saturating_add(1));
            teachers = teachers.max(grown);
        } else if waiting && complete && in_flight < MAX_IN_FLIGHT {
            raised = in_flight.saturating_mul(2).min(MAX_IN_FLIGHT);
        }

        // Teachers whose use is unknown (no statistics this window) are not
        // taken for idle: the pool is not shrunk on a guess.
        let known = !view.teachers.is_empty();
        let idle = known && !waiting && !scale_out && utilisation < self.idle;
        self.mem.idle_streak = if idle { self.mem.idle_streak.saturating_add(1) } else { 0 };
        let settled = view.secs_since_change >= self.settle_secs;
        let above_min = count > view.min_teachers.max(1);
        if teachers == count && above_min && self.mem.idle_streak >= self.shrink_after && settled {
            teachers = count - 1;
            self.mem.idle_streak = 0;
            self.mem.sized_for = now;
        }
        TeacherPlan { teachers, in_flight_per_teacher: raised }
    }
}

/// `x` rounded up to a teacher count (saturating; a non-finite `x` is 0).
fn ceil(x: f64) -> u32 {
    // Float-to-int `as` saturates, and maps NaN to 0.
    (x - 1e-9).ceil() as u32
}

edl_plugin_sdk::export_teacher_policy!(TeacherAutoscale);

#[cfg(test)]
mod tests;
