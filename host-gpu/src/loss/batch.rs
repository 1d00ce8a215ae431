//! The inputs of one call of the loss.

use super::error::LossError;

/// What the teacher sent for each sample.
#[derive(Clone, Copy, Debug)]
pub enum Teacher<'a> {
    /// Unnormalised log-probabilities, `[B, C]` row-major.
    Logits(&'a [f32]),
    /// Probabilities at temperature 1, `[B, C]`; each row sums to 1.
    Probs(&'a [f32]),
}

impl<'a> Teacher<'a> {
    /// The values, whichever kind they are.
    pub fn values(&self) -> &'a [f32] {
        match self {
            Teacher::Logits(v) | Teacher::Probs(v) => v,
        }
    }
}

/// One batch of inputs to the loss.
#[derive(Clone, Copy, Debug)]
pub struct Batch<'a> {
    /// Student logits, `[rows, classes]` row-major.
    pub student: &'a [f32],
    pub teacher: Teacher<'a>,
    /// Hard labels, one per row, if any.
    pub labels: Option<&'a [u32]>,
    pub rows: usize,
    pub classes: usize,
}

/// Checks that every label is below `classes`.
pub fn check_labels(labels: &[u32], classes: usize) -> Result<(), LossError> {
    match labels.iter().enumerate().find(|(_, l)| **l as usize >= classes) {
        Some((row, &label)) => Err(LossError::BadLabel { row, label, classes }),
        None => Ok(()),
    }
}
