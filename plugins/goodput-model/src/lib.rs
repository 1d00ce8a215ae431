//! Goodput's model (Pollux, OSDI'21), shared by the goodput adapter and the
//! goodput policy: statistical efficiency from the gradient noise scale, a
//! step-time model fitted to the host's measures, and the batches tried.

use edl_plugin_sdk::TrainingStats;

/// A step-time model `alpha + beta * local batch` at one world size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepModel {
    pub alpha: f64,
    pub beta: f64,
}

impl StepModel {
    /// Fitted to the step times measured at `world` workers; `overhead`:
    /// the fixed share when only one batch was measured there (or, with
    /// none there, at the nearest world size measured).
    pub fn fit(stats: &TrainingStats, world: u32, overhead: f64) -> Option<StepModel> {
        let at = |n: u32| -> Vec<(f64, f64)> {
            let rows = stats.step_times.iter().filter(|t| t.world_size == n && t.secs > 0.0);
            rows.map(|t| (f64::from(t.global_batch) / f64::from(n.max(1)), t.secs)).collect()
        };
        let mut points = at(world);
        if points.is_empty() {
            let nearest = stats.step_times.iter().min_by_key(|t| t.world_size.abs_diff(world))?;
            points = at(nearest.world_size);
        }
        let n = points.len() as f64;
        let (mx, my) =
            (points.iter().map(|p| p.0).sum::<f64>() / n, points.iter().map(|p| p.1).sum::<f64>() / n);
        let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
        if points.len() >= 2 && sxx > 0.0 {
            let beta = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum::<f64>() / sxx;
            let alpha = my - beta * mx;
            if beta > 0.0 && alpha >= 0.0 {
                return Some(StepModel { alpha, beta });
            }
        }
        // One batch measured (or a line that does not fit): its time split.
        let beta = (1.0 - overhead) * my / mx.max(1e-9);
        Some(StepModel { alpha: overhead * my, beta })
    }

    pub fn secs(&self, global: u32, world: u32) -> f64 {
        self.alpha + self.beta * f64::from(global) / f64::from(world.max(1))
    }
}

/// The global batches whose step time was measured at `world` workers.
pub fn measured_batches(stats: &TrainingStats, world: u32) -> usize {
    stats.step_times.iter().filter(|t| t.world_size == world && t.secs > 0.0).count()
}

/// How far past the largest batch measured a choice may go, unless
/// configured otherwise: twice.
pub const GROWTH: f64 = 2.0;

/// The largest global batch worth choosing now: `growth` times the largest
/// measured (at any world size), at most `max`; `max` when nothing is
/// measured. The step-time model is a line fitted to the batches measured,
/// and a line through 64 and 128 says little about 1024; the rate follows
/// the batch, so a sixteenfold batch is a sixteenfold rate (by the linear
/// rule) at once. Bounded, the batch grows by measured steps, each choice
/// made on a model that has seen a batch within `growth` of it, and the rate
/// rises gradually (as a warm-up does).
pub fn reach(stats: &TrainingStats, growth: f64, max: u32) -> u32 {
    let measured = stats.step_times.iter().filter(|t| t.secs > 0.0).map(|t| t.global_batch).max();
    match measured {
        Some(m) if growth.is_finite() => {
            let bound = (f64::from(m) * growth.max(1.0)).floor();
            if bound >= f64::from(max) { max } else { bound as u32 }
        }
        _ => max,
    }
}

/// Statistical efficiency of batch `m` against `base` at noise scale `phi`.
pub fn efficiency(phi: f64, base: u32, m: u32) -> f64 {
    (phi + f64::from(base)) / (phi + f64::from(m.max(1)))
}

/// Goodput of batch `m` on `world` workers: samples/s times efficiency.
pub fn goodput(model: &StepModel, phi: f64, base: u32, m: u32, world: u32) -> f64 {
    f64::from(m) / model.secs(m, world).max(1e-12) * efficiency(phi, base, m)
}

/// The batches tried: `base * 2^(k/4)` from the base up to `max`, each a
/// multiple of `world`.
pub fn candidates(base: u32, max: u32, world: u32) -> Vec<u32> {
    let world = world.max(1);
    let lowest = base.max(world);
    let mut out = Vec::new();
    if lowest > max {
        // More workers than the largest batch has rows, or a bound below
        // the base: nothing to choose.
        return out;
    }
    for k in 0..64 {
        let m = (f64::from(lowest) * 2f64.powf(f64::from(k) / 4.0)).round() as u32;
        let m = (m / world).max(1) * world;
        if m > max {
            break;
        }
        if out.last() != Some(&m) {
            out.push(m);
        }
    }
    out
}
