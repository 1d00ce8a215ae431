//! The gradient noise scale (McCandlish et al., "An Empirical Model of
//! Large-Batch Training", 2018), measured every step without a collective
//! of its own: each rank tells the squared norm of its gradient before the
//! all-reduce and of the reduced one after it; the coordinator, which hears
//! every rank, compares them.
//!
//! A rank with `b` of the step's `B` samples holds `g_i = (b/B) G_i`, where
//! `G_i` is the mean gradient over its own samples; the reduced gradient is
//! `G_B`, the mean over all `B`. With `G` the true gradient and `S` the
//! trace of the per-sample gradients' covariance,
//! `E|G_i|^2 = |G|^2 + S/b` and `E|G_B|^2 = |G|^2 + S/B`, so with `A` the
//! ranks' mean of `|G_i|^2` and `H` their mean of `1/b`:
//!
//! ```text
//! S     = (A - |G_B|^2) / (H - 1/B)
//! |G|^2 = |G_B|^2 - S/B
//! ```
//!
//! both unbiased (equal batches give the paper's two-batch estimators).
//! Each is noisy from one step, so each is smoothed (an exponential moving
//! average) before their ratio, the noise scale `B_noise = S / |G|^2`, is
//! taken: the batch size at which a step's noise equals its signal.

use serde::{Deserialize, Serialize};

/// What a rank tells of its step's all-reduce: the squared norm of what it
/// gave (its share of the mean gradient) and of what came back (the mean).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GradSq {
    pub local: f64,
    pub reduced: f64,
}

/// The ranks' part of one step's estimate, summed over them: a host's
/// relay sums its ranks' and sends one for them all. With `b_i` a rank's
/// rows, `|G_i|^2 = |g_i|^2 (B/b_i)^2`, so the sums below give `A` and `H`
/// once `B` (the step's rows) is known.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NoiseTerms {
    /// Ranks that had rows.
    pub ranks: u32,
    /// The sum of `|g_i|^2 / b_i^2`.
    pub a: f64,
    /// The sum of `1 / b_i`.
    pub h: f64,
    /// `|G_B|^2`, which every rank got alike.
    pub reduced: f64,
}

impl NoiseTerms {
    /// One rank's part: `rows` of the step and its norms (nothing for a
    /// rank without rows).
    pub fn of(rows: usize, sq: GradSq) -> NoiseTerms {
        if rows == 0 {
            return NoiseTerms::default();
        }
        let b = rows as f64;
        NoiseTerms { ranks: 1, a: sq.local / (b * b), h: 1.0 / b, reduced: sq.reduced }
    }

    /// One rank's step computed in parts (each its rows and the squared
    /// norm of its share of the mean gradient), `reduced` the squared norm
    /// of the step's mean gradient: each part counts as a rank would.
    pub fn of_parts(parts: &[(usize, f64)], reduced: f64) -> NoiseTerms {
        let mut terms = NoiseTerms::default();
        for &(rows, local) in parts {
            terms.add(NoiseTerms::of(rows, GradSq { local, reduced }));
        }
        terms
    }

    /// Adds another's ranks.
    pub fn add(&mut self, other: NoiseTerms) {
        if other.ranks == 0 {
            return;
        }
        if self.ranks == 0 {
            self.reduced = other.reduced;
        }
        self.ranks += other.ranks;
        self.a += other.a;
        self.h += other.h;
    }

    /// The step's unbiased estimates `(S, |G|^2)` given its `rows` (`B`);
    /// `None` when fewer than two ranks had rows (nothing to compare) or a
    /// value is not finite.
    pub fn estimate(&self, rows: usize) -> Option<(f64, f64)> {
        if self.ranks < 2 || rows == 0 {
            return None;
        }
        let (n, big) = (f64::from(self.ranks), rows as f64);
        let a = big * big * self.a / n;
        let h = self.h / n;
        let s = (a - self.reduced) / (h - 1.0 / big);
        let g2 = self.reduced - s / big;
        (s.is_finite() && g2.is_finite()).then_some((s, g2))
    }
}

/// One step's unbiased estimates, from the ranks' `(rows, GradSq)`;
/// `None` when fewer than two ranks had samples (nothing to compare) or a
/// value is not finite.
pub fn estimate(ranks: &[(usize, GradSq)]) -> Option<(f64, f64)> {
    let (terms, rows) = terms_of(ranks);
    terms.estimate(rows)
}

fn terms_of(ranks: &[(usize, GradSq)]) -> (NoiseTerms, usize) {
    let mut terms = NoiseTerms::default();
    for &(b, sq) in ranks {
        terms.add(NoiseTerms::of(b, sq));
    }
    (terms, ranks.iter().map(|(b, _)| b).sum())
}

/// The squared norm of `values`, summed in f64 (a gradient of millions of
/// small values loses nothing to rounding).
pub fn squared_norm(values: &[f32]) -> f64 {
    values.iter().map(|&v| f64::from(v) * f64::from(v)).sum()
}

/// Statistical efficiency (Pollux, OSDI'21): the progress a sample makes in
/// a global batch of `batch`, against one in the base batch `base`, at
/// noise scale `noise`: `(noise + base) / (noise + batch)`. At 1 for the
/// base batch, lower for larger ones (each sample adds less once the batch
/// is well past the noise scale).
pub fn efficiency(noise: f64, base: u32, batch: u32) -> f64 {
    (noise + f64::from(base)) / (noise + f64::from(batch.max(1)))
}

/// The smoothed estimates and the noise scale from them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NoiseScale {
    /// Moving averages of `S` and `|G|^2` from zero, and the weight they
    /// have gathered (`1 - (1 - SMOOTHING)^steps`), which they are divided
    /// by: Adam's bias correction, so the first steps count as much as any
    /// (starting the averages at the first step instead would give that
    /// one step, often the noisiest, a weight that fades twenty times more
    /// slowly than the others').
    s: f64,
    g2: f64,
    weight: f64,
}

/// The weight of a new step in the moving averages: about the last 20 steps.
const SMOOTHING: f64 = 0.05;

impl NoiseScale {
    /// Takes one step's ranks; returns the noise scale so far (`None`
    /// until a step could be measured, or while `|G|^2` is not above 0).
    pub fn step(&mut self, ranks: &[(usize, GradSq)]) -> Option<f64> {
        let (terms, rows) = terms_of(ranks);
        self.step_terms(terms, rows)
    }

    /// As [`NoiseScale::step`], from the ranks' parts summed and the step's rows.
    pub fn step_terms(&mut self, terms: NoiseTerms, rows: usize) -> Option<f64> {
        if let Some((s, g2)) = terms.estimate(rows) {
            self.add(s, g2);
        }
        self.value()
    }

    fn add(&mut self, s: f64, g2: f64) {
        let w = SMOOTHING;
        self.s = (1.0 - w) * self.s + w * s;
        self.g2 = (1.0 - w) * self.g2 + w * g2;
        self.weight = (1.0 - w) * self.weight + w;
    }

    /// The noise scale from the steps seen so far: `None` also while the
    /// smoothed `|G|^2` is not above 0 (the gradient all noise as far as
    /// the steps so far can tell, late in training or on small batches).
    pub fn value(&self) -> Option<f64> {
        let (s, g2) = self.parts()?;
        (g2 > 0.0 && s >= 0.0).then(|| s / g2)
    }

    /// The smoothed estimates `(S, |G|^2)` once a step was measured, the
    /// noise scale's two parts, whatever their signs.
    pub fn parts(&self) -> Option<(f64, f64)> {
        (self.weight > 0.0).then(|| (self.s / self.weight, self.g2 / self.weight))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic normal sample (Box-Muller over a small LCG).
    struct Normal(u64);
    impl Normal {
        fn uniform(&mut self) -> f64 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        }
        fn next(&mut self) -> f64 {
            let (u, v) = (self.uniform(), self.uniform());
            (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
        }
    }

    /// Per-sample gradients `G + noise` in `dim` dimensions, the noise of
    /// variance `var` in each: `S = dim * var`, and the noise scale is
    /// `S / |G|^2`. The ranks' batches as `sizes`; each rank's share as the
    /// runtime gives it (its rows' sum over the global batch).
    fn step_of(rng: &mut Normal, g: &[f64], var: f64, sizes: &[usize]) -> Vec<(usize, GradSq)> {
        let big: usize = sizes.iter().sum();
        let shares: Vec<Vec<f64>> = sizes
            .iter()
            .map(|&b| {
                let mut sum = vec![0.0; g.len()];
                for _ in 0..b {
                    for (s, gi) in sum.iter_mut().zip(g) {
                        *s += gi + var.sqrt() * rng.next();
                    }
                }
                sum.iter().map(|v| v / big as f64).collect()
            })
            .collect();
        let reduced: Vec<f64> = (0..g.len()).map(|k| shares.iter().map(|s| s[k]).sum()).collect();
        let sq = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>();
        let reduced = sq(&reduced);
        sizes.iter().zip(&shares).map(|(&b, s)| (b, GradSq { local: sq(s), reduced })).collect()
    }

    fn measured(sizes: &[usize], steps: usize) -> (f64, f64) {
        let dim = 64;
        let g: Vec<f64> = (0..dim).map(|k| if k % 2 == 0 { 0.05 } else { -0.05 }).collect();
        let var = 0.01;
        let truth = dim as f64 * var / g.iter().map(|x| x * x).sum::<f64>();
        let mut rng = Normal(7);
        let mut noise = NoiseScale::default();
        let mut last = None;
        for _ in 0..steps {
            last = noise.step(&step_of(&mut rng, &g, var, sizes));
        }
        (last.unwrap(), truth)
    }

    #[test]
    fn the_noise_scale_of_a_synthetic_gradient_is_found_within_ten_percent() {
        // The truth is 4: the noise of one sample is four times the signal.
        for sizes in [&[16, 16][..], &[8, 8, 8, 8], &[32, 16, 8]] {
            let (got, truth) = measured(sizes, 400);
            assert!((got / truth - 1.0).abs() < 0.10, "{sizes:?}: {got} against {truth}");
        }
    }

    #[test]
    fn a_wild_first_step_fades_as_fast_as_any_other() {
        // The first step's |G|^2 far below 0 (one noisy step), then forty
        // steps of 1: the average is theirs, and the noise scale shown.
        let mut n = NoiseScale::default();
        n.add(50.0, -20.0);
        for _ in 0..40 {
            n.add(50.0, 1.0);
        }
        let (s, g2) = n.parts().unwrap();
        assert!((s - 50.0).abs() < 1e-9, "{s}");
        assert!(g2 > 0.8 && g2 < 1.0, "{g2}");
        assert!((n.value().unwrap() - s / g2).abs() < 1e-9);
        // One step alone is its own average.
        let mut one = NoiseScale::default();
        one.add(3.0, 2.0);
        let (s, g2) = one.parts().unwrap();
        assert!((s - 3.0).abs() < 1e-12 && (g2 - 2.0).abs() < 1e-12, "{s} {g2}");
        assert_eq!(NoiseScale::default().parts(), None);
    }

    #[test]
    fn hosts_summing_their_ranks_terms_estimate_as_the_ranks_one_by_one() {
        let mut rng = Normal(11);
        let g: Vec<f64> = (0..16).map(|k| 0.1 + 0.01 * k as f64).collect();
        let sizes = [8, 8, 4, 12, 0, 4];
        let ranks = step_of(&mut rng, &g, 0.02, &sizes);
        let one_by_one = estimate(&ranks).unwrap();
        // Two hosts: ranks 0..2 and 2..6, each summed, then the hosts.
        let mut hosts = [NoiseTerms::default(); 2];
        for (i, &(b, sq)) in ranks.iter().enumerate() {
            hosts[usize::from(i >= 2)].add(NoiseTerms::of(b, sq));
        }
        let mut all = NoiseTerms::default();
        hosts.iter().for_each(|h| all.add(*h));
        assert_eq!(all.ranks, 5, "the rank without rows is not counted");
        let summed = all.estimate(sizes.iter().sum()).unwrap();
        assert!((summed.0 / one_by_one.0 - 1.0).abs() < 1e-12, "{summed:?} {one_by_one:?}");
        assert!((summed.1 / one_by_one.1 - 1.0).abs() < 1e-12, "{summed:?} {one_by_one:?}");
    }

    #[test]
    fn one_rank_s_batch_in_two_parts_finds_the_noise_scale_as_two_ranks_do() {
        // One rank's 24 rows in parts of 12 and 12 (and 11 and 13): the same
        // sums as two ranks of those rows, hence the same estimate and,
        // over many steps, the known noise scale within 10%.
        let g: Vec<f64> = (0..64).map(|k| if k % 2 == 0 { 0.05 } else { -0.05 }).collect();
        let (var, dim) = (0.01, 64.0);
        let truth = dim * var / g.iter().map(|x| x * x).sum::<f64>();
        for sizes in [[12, 12], [11, 13]] {
            let mut rng = Normal(5);
            let mut noise = NoiseScale::default();
            let mut last = None;
            for _ in 0..400 {
                let ranks = step_of(&mut rng, &g, var, &sizes);
                let parts: Vec<(usize, f64)> = ranks.iter().map(|(b, sq)| (*b, sq.local)).collect();
                let terms = NoiseTerms::of_parts(&parts, ranks[0].1.reduced);
                assert_eq!(terms.ranks, 2);
                let (a, b) = (terms.estimate(24).unwrap(), estimate(&ranks).unwrap());
                assert!((a.0 - b.0).abs() <= 1e-9 * b.0.abs() && (a.1 - b.1).abs() <= 1e-9 * b.1.abs());
                last = noise.step_terms(terms, 24);
            }
            let got = last.unwrap();
            assert!((got / truth - 1.0).abs() < 0.10, "{sizes:?}: {got} against {truth}");
        }
        // One part is one rank: nothing to compare.
        assert_eq!(NoiseTerms::of_parts(&[(24, 1.0)], 1.0).estimate(24), None);
    }

    #[test]
    fn one_rank_or_a_rank_without_rows_measures_nothing() {
        let g = GradSq { local: 1.0, reduced: 1.0 };
        assert_eq!(estimate(&[(16, g)]), None);
        assert_eq!(estimate(&[(16, g), (0, GradSq::default())]), None);
        let mut n = NoiseScale::default();
        assert_eq!(n.step(&[(16, g)]), None);
    }

    #[test]
    fn efficiency_is_one_at_the_base_batch_and_falls_past_the_noise_scale() {
        assert_eq!(efficiency(100.0, 64, 64), 1.0);
        // Far below the noise scale a larger batch costs little efficiency;
        // far above it, efficiency falls as 1/batch.
        assert!((efficiency(10_000.0, 64, 128) - 0.9937).abs() < 1e-3);
        assert!((efficiency(10.0, 64, 640) - 74.0 / 650.0).abs() < 1e-12);
    }

    #[test]
    fn equal_batches_give_the_papers_two_batch_estimators() {
        // B_small = 8, B_big = 16: |G_small|^2 = 3, |G_big|^2 = 2.
        let (b, big) = (8.0, 16.0);
        let local = 3.0 * (b / big) * (b / big);
        let r = |_| (8, GradSq { local, reduced: 2.0 });
        let (s, g2) = estimate(&[r(0), r(1)]).unwrap();
        let s_paper = (3.0 - 2.0) / (1.0 / b - 1.0 / big);
        let g2_paper = (big * 2.0 - b * 3.0) / (big - b);
        assert!((s - s_paper).abs() < 1e-9 && (g2 - g2_paper).abs() < 1e-9, "{s} {g2}");
    }
}
