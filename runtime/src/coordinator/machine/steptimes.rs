//! Step times measured at each (world size, global batch): what a batch
//! adapter models throughput from (the goodput plugin), fed once per
//! decision window whose world size and batch did not change.

use edl_plugin_sdk::StepTime;
use std::collections::BTreeMap;

/// The weight of a new window in a key's mean.
const SMOOTHING: f64 = 0.3;

/// The mean step time at each (world size, global batch), and the
/// window being measured.
#[derive(Clone, Debug, Default)]
pub struct StepTimes {
    means: BTreeMap<(u32, u32), (f64, u32)>,
    /// The (world size, global batch) of the window's committed steps,
    /// their count, and whether they were not all alike.
    window: Option<(u32, u32)>,
    steps: u32,
    mixed: bool,
}

impl StepTimes {
    /// A step of the window committed at `(world, batch)`.
    pub fn committed(&mut self, world: u32, batch: u32) {
        match self.window {
            None => self.window = Some((world, batch)),
            Some(key) if key != (world, batch) => self.mixed = true,
            Some(_) => {}
        }
        self.steps = self.steps.saturating_add(1);
    }

    /// The window ended, `throughput` committed samples per second over
    /// it; `resized`: the world changed in it. A window whose steps were
    /// all at one world size and batch adds to that key's mean.
    pub fn window_ended(&mut self, throughput: f64, resized: bool) {
        let (window, steps, mixed) =
            (self.window.take(), std::mem::take(&mut self.steps), std::mem::take(&mut self.mixed));
        let Some((world, batch)) = window.filter(|_| !mixed && !resized && steps > 0) else { return };
        if throughput <= 0.0 || batch == 0 {
            return;
        }
        let secs = f64::from(batch) / throughput;
        let e = self.means.entry((world, batch)).or_insert((secs, 0));
        if e.1 > 0 {
            e.0 = (1.0 - SMOOTHING) * e.0 + SMOOTHING * secs;
        }
        e.1 = e.1.saturating_add(steps);
    }

    /// The table as adapters see it.
    pub fn table(&self) -> Vec<StepTime> {
        self.means
            .iter()
            .map(|(&(world_size, global_batch), &(secs, steps))| StepTime {
                world_size,
                global_batch,
                secs,
                steps,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(t: &mut StepTimes, keys: &[(u32, u32)], throughput: f64, resized: bool) {
        keys.iter().for_each(|&(w, b)| t.committed(w, b));
        t.window_ended(throughput, resized);
    }

    #[test]
    fn only_windows_at_one_world_and_batch_throughout_are_measured() {
        let mut t = StepTimes::default();
        window(&mut t, &[(2, 64); 4], 3200.0, false);
        assert_eq!(t.table(), [StepTime { world_size: 2, global_batch: 64, secs: 0.02, steps: 4 }]);
        // A window with a resize in it, or with two batches, is not.
        window(&mut t, &[(3, 64); 4], 4800.0, true);
        window(&mut t, &[(2, 64), (2, 64), (2, 128), (2, 128)], 4800.0, false);
        assert_eq!(t.table().len(), 1);
        window(&mut t, &[(2, 128); 4], 6400.0, false);
        window(&mut t, &[(2, 64); 4], 1600.0, false);
        let table = t.table();
        assert!((table[1].secs - 0.02).abs() < 1e-12, "{table:?}");
        // Smoothed: 0.7 of 20 ms and 0.3 of 40 ms.
        assert!((table[0].secs - 0.026).abs() < 1e-12 && table[0].steps == 8, "{table:?}");
    }
}
