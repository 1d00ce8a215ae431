//! The checkpoints whose step the parameter servers must still be able to
//! export: until each is written, its step's undo records are kept.

/// The checkpoints asked of workers and not written yet: each
/// worker exports the tables as of its checkpoint's step in the background,
/// so the servers keep what undoes the steps after the oldest of them.
#[derive(Debug, Default)]
pub(crate) struct Pins(std::collections::BTreeSet<(u64, u64)>);

impl Pins {
    pub(crate) fn ask(&mut self, step: u64, worker: u64) {
        self.0.insert((step, worker));
    }

    /// Worker `worker`'s checkpoints of `steps` were written (or failed): a
    /// worker writes its checkpoints in order, so its earlier ones are done
    /// with too; another worker's are not.
    pub(crate) fn written(&mut self, worker: u64, steps: impl Iterator<Item = u64>) {
        if let Some(last) = steps.max() {
            self.0.retain(|&(step, w)| w != worker || step > last);
        }
    }

    /// The steps before this one are past undoing, given the `committed`
    /// steps and the workers still in the job (a pin of one gone is let go).
    pub(crate) fn safe(&mut self, committed: u64, members: &[u64]) -> u64 {
        self.0.retain(|(_, worker)| members.contains(worker));
        self.0.first().map_or(committed, |&(step, _)| step.min(committed))
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
        p.written(1, [10].into_iter());
        assert_eq!(p.safe(25, &[1]), 20);
        p.written(1, [20].into_iter());
        assert_eq!(p.safe(25, &[1]), 25);
        // Another worker's write lets go of its own pins only.
        p.ask(26, 1);
        p.ask(27, 3);
        p.written(3, [27].into_iter());
        assert_eq!(p.safe(30, &[1, 3]), 26);
        p.written(1, [26].into_iter());
        // A pin of a worker gone is let go.
        p.ask(30, 2);
        assert_eq!(p.safe(35, &[1, 2]), 30);
        assert_eq!(p.safe(35, &[1]), 35);
    }
}
