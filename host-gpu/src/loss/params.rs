//! The loss's parameters and the checks every implementation makes before
//! it computes anything.

use super::batch::{Batch, check_labels};
use super::error::LossError;

/// The loss's parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SoftLabelLoss {
    /// Softmax temperature T (> 0).
    pub temperature: f32,
    /// Weight of the distillation term; 1 - alpha weighs the hard-label term.
    pub alpha: f32,
}

impl Default for SoftLabelLoss {
    fn default() -> Self {
        SoftLabelLoss { temperature: 4.0, alpha: 0.9 }
    }
}

impl SoftLabelLoss {
    /// Checks the temperature and alpha.
    pub fn check_params(&self) -> Result<(), LossError> {
        let t = self.temperature;
        if !(t.is_finite() && t > 0.0) {
            return Err(LossError::Parameter(format!("temperature must be positive and finite, got {t}")));
        }
        if !(0.0..=1.0).contains(&self.alpha) {
            return Err(LossError::Parameter(format!("alpha must be in [0, 1], got {}", self.alpha)));
        }
        Ok(())
    }

    /// Checks the parameters and the shapes of a batch and of the gradient buffer.
    pub fn validate(&self, batch: &Batch<'_>, grad_len: usize) -> Result<(), LossError> {
        self.check_params()?;
        let n = batch
            .rows
            .checked_mul(batch.classes)
            .ok_or_else(|| LossError::Shape("rows x classes overflows".into()))?;
        if batch.classes == 0 && batch.rows > 0 {
            return Err(LossError::Shape("zero classes".into()));
        }
        let check = |what: &str, len: usize| {
            if len == n {
                Ok(())
            } else {
                Err(LossError::Shape(format!(
                    "{what} has {len} values, [{} x {}] needs {n}",
                    batch.rows, batch.classes
                )))
            }
        };
        check("student logits", batch.student.len())?;
        check("teacher output", batch.teacher.values().len())?;
        check("gradient buffer", grad_len)?;
        if let Some(labels) = batch.labels {
            if labels.len() != batch.rows {
                return Err(LossError::Shape(format!("{} labels for {} rows", labels.len(), batch.rows)));
            }
            check_labels(labels, batch.classes)?;
        }
        Ok(())
    }
}
