//! What one plugin instance may use: its per-call deadline, its memory and
//! the stderr kept of it, and the tick the deadline is counted in.

use std::time::Duration;

/// Per-instance sandbox limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Wall-clock time a single call may take before it is stopped: epoch
    /// interruption stops a guest that computes, the bounded clocks one that sleeps.
    pub deadline: Duration,
    /// Linear memory a plugin instance may grow to.
    pub memory_bytes: usize,
    /// Bytes of guest stderr kept for logs and trap reports.
    pub stderr_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { deadline: Duration::from_millis(100), memory_bytes: 64 << 20, stderr_bytes: 16 << 10 }
    }
}

/// How often the engine's epoch advances; deadlines are counted in these ticks.
pub(crate) const EPOCH_TICK: Duration = Duration::from_millis(2);
