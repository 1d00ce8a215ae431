//! Click-through data of Criteo's shape, synthetic and of a known
//! structure: 13 dense (count) features and 26 categorical ones a row, each
//! categorical value an id unique across fields (the field's number above
//! bit 40). Each field's values are Zipf-distributed (a few very frequent,
//! a long tail), and the label is drawn from a hidden logistic model of
//! per-id weights and the dense features, so that a model that learns the
//! ids reaches a test AUC well above 0.5, and the ceiling is known.

use crate::trainer::data::Dataset;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, LogNormal, Normal, Zipf};

/// Dense features a row.
pub const DENSE: usize = 13;
/// Categorical features a row.
pub const FIELDS: usize = 26;
/// Rows the data set holds (test and training).
pub const ROWS: usize = 100_000;
/// Rows held out for the test.
pub const TEST_ROWS: usize = 10_000;
/// Distinct values a field may take.
pub(crate) const VOCAB: u64 = 10_000;
/// The exponent of each field's Zipf distribution.
const ZIPF: f64 = 1.2;
/// The hidden model's weight of an id: a hash of it, spread as N(0, 0.8).
fn hidden_weight(id: u64) -> f64 {
    let x = crate::trainer::data::splitmix(id ^ 0x5eed_c11c);
    let u1 = ((x >> 40) as f64 + 0.5) / (1u64 << 24) as f64;
    let u2 = (((x >> 16) & 0xFF_FFFF) as f64 + 0.5) / (1u64 << 24) as f64;
    0.8 * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// `rows` rows of click-through data from `seed`: features `ln(1 + count)`
/// of log-normal counts, ids of Zipf-distributed values, labels 0 or 1.
pub fn synthetic(rows: usize, seed: u64) -> Dataset {
    generate(rows, seed).0
}

/// [`synthetic`]'s rows, and the hidden model's logit of each.
pub(crate) fn generate(rows: usize, seed: u64) -> (Dataset, Vec<f64>) {
    let mut rng = rand_pcg::Pcg64Mcg::seed_from_u64(seed);
    let counts = LogNormal::new(1.0, 1.2).expect("valid parameters");
    let values = Zipf::new(VOCAB as f64, ZIPF).expect("valid parameters");
    let dense_weights = Normal::new(0.0, 0.3).expect("valid parameters");
    let features: Vec<f32> = (0..rows * DENSE).map(|_| (counts.sample(&mut rng) as f32).ln_1p()).collect();
    let categorical: Vec<u64> = (0..rows * FIELDS)
        .map(|i| ((i % FIELDS) as u64) << 40 | (values.sample(&mut rng) as u64 - 1))
        .collect();
    let hidden: Vec<f64> = (0..DENSE).map(|_| dense_weights.sample(&mut rng)).collect();
    let mut mean = [0f64; DENSE];
    for row in features.chunks_exact(DENSE) {
        row.iter().zip(&mut mean).for_each(|(v, m)| *m += *v as f64 / rows.max(1) as f64);
    }
    let logits: Vec<f64> = (0..rows)
        .map(|r| {
            let ids = &categorical[r * FIELDS..(r + 1) * FIELDS];
            let wide: f64 = ids.iter().map(|&id| hidden_weight(id)).sum::<f64>() / (FIELDS as f64).sqrt();
            let dense: f64 = features[r * DENSE..(r + 1) * DENSE]
                .iter()
                .zip(&mean)
                .zip(&hidden)
                .map(|((v, m), w)| (*v as f64 - m) * w)
                .sum();
            1.6 * wide + dense - 1.0
        })
        .collect();
    let labels = logits.iter().map(|z| u32::from(rng.random::<f64>() < 1.0 / (1.0 + (-z).exp()))).collect();
    (Dataset { features, labels, dim: DENSE, classes: 2, categorical, fields: FIELDS }, logits)
}
