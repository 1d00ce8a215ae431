//! The checkpoints whose step the parameter servers must still be able to
//! export: until each is written, its step's undo records are kept.

/// The checkpoints asked of workers and not written yet, by step: each
/// worker exports the tables as of its checkpoint's step in the background,
/// so the servers keep what undoes the steps after the oldest of them.
#[derive(Debug, Default)]
pub(crate) struct Pins(std::collections::BTreeMap<u64, u64>);

impl Pins {
    pub(crate) fn ask(&mut self, step: u64, worker: u64) {
        self.0.insert(step, worker);
    }

    /// Checkpoints of `steps` were written (or failed): a worker writes its
    /// checkpoints in order, so the earlier ones are done with too.
    pub(crate) fn written(&mut self, steps: impl Iterator<Item = u64>) {
        if let Some(last) = steps.max() {
            self.0.retain(|&step, _| step > last);
        }
    }

    /// The steps before this one are past undoing, given the `committed`
    /// steps and the workers still in the job (a pin of one gone is let go).
    pub(crate) fn safe(&mut self, committed: u64, members: &[u64]) -> u64 {
        self.0.retain(|_, worker| members.contains(worker));
        self.0.keys().next().map_or(committed, |&step| step.min(committed))
    }
}

#[cfg(test)]
mod tests {
    use super::Pins;

    #[test]
    fn the_oldest_checkpoint_not_yet_written_holds_the_undo_records() {
        let mut p = Pins::default();
        assert_eq!(p.safe(10, &[1]), 10);
        p.ask(10, 1);
        p.ask(20, 1);
        assert_eq!(p.safe(25, &[1]), 10);
        // The first written, the second still exporting its tables.
        p.written([10].into_iter());
        assert_eq!(p.safe(25, &[1]), 20);
        p.written([20].into_iter());
        assert_eq!(p.safe(25, &[1]), 25);
        // A pin of a worker gone is let go.
        p.ask(30, 2);
        assert_eq!(p.safe(35, &[1, 2]), 30);
        assert_eq!(p.safe(35, &[1]), 35);
    }
}
