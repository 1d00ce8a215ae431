//! A training program's state as named float32 tensors: what the runtime
//! snapshots at commits, restores when a step is redone, broadcasts to
//! joiners and writes to checkpoints. The runtime knows only the names and
//! shapes (the [`Layout`]) and the values laid end to end in that order; what
//! they mean is the program's business.

use serde::{Deserialize, Serialize};
use std::ops::Range;

/// One tensor of a state: its name and shape (row-major float32).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    pub fn new(name: impl Into<String>, shape: Vec<usize>) -> Self {
        TensorSpec { name: name.into(), shape }
    }

    /// Values the tensor holds.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Why a list of tensors is no layout.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("a state tensor has an empty name")]
    EmptyName,
    #[error("state tensor {0:?} is registered twice")]
    Duplicate(String),
}

/// The tensors of a state, in the order their values are laid out.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    tensors: Vec<TensorSpec>,
}

impl Layout {
    /// A layout; names must be unique and not empty.
    pub fn new(tensors: Vec<TensorSpec>) -> Result<Self, LayoutError> {
        let mut seen = std::collections::HashSet::new();
        for t in &tensors {
            if t.name.is_empty() {
                return Err(LayoutError::EmptyName);
            }
            if !seen.insert(t.name.as_str()) {
                return Err(LayoutError::Duplicate(t.name.clone()));
            }
        }
        Ok(Layout { tensors })
    }

    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    /// Values of the whole state.
    pub fn numel(&self) -> usize {
        self.tensors.iter().map(TensorSpec::numel).sum()
    }

    /// [`Layout::numel`], or None where it does not fit a `usize` (a
    /// layout read from a file, before it is believed).
    pub fn checked_numel(&self) -> Option<usize> {
        self.tensors.iter().try_fold(0usize, |sum, t| {
            let n = t.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))?;
            sum.checked_add(n)
        })
    }

    /// Each tensor with the range of its values in the flat state.
    pub fn ranges(&self) -> impl Iterator<Item = (&TensorSpec, Range<usize>)> {
        let mut at = 0;
        self.tensors.iter().map(move |t| {
            let r = at..at + t.numel();
            at = r.end;
            (t, r)
        })
    }

    /// Why a state of layout `other` cannot be loaded into one of this
    /// layout (None: it can), naming the first tensor that differs.
    pub fn mismatch(&self, other: &Layout) -> Option<String> {
        for t in &self.tensors {
            match other.tensors.iter().find(|o| o.name == t.name) {
                None => return Some(format!("it has no tensor {:?}", t.name)),
                Some(o) if o.shape != t.shape => {
                    return Some(format!(
                        "tensor {:?} has shape {:?}, expected {:?}",
                        t.name, o.shape, t.shape
                    ));
                }
                Some(_) => {}
            }
        }
        other
            .tensors
            .iter()
            .find(|o| !self.tensors.iter().any(|t| t.name == o.name))
            .map(|o| format!("it has a tensor {:?} that is not registered", o.name))
    }

    /// `values` (laid out as `from`) reordered into this layout; the
    /// layouts must hold the same tensors ([`Layout::mismatch`] is None).
    pub fn reorder(&self, from: &Layout, values: &[f32]) -> Result<Vec<f32>, String> {
        if let Some(m) = self.mismatch(from) {
            return Err(m);
        }
        if values.len() != from.numel() {
            return Err(format!("{} values for a state of {}", values.len(), from.numel()));
        }
        let mut out = Vec::with_capacity(self.numel());
        for t in &self.tensors {
            let (_, r) = from.ranges().find(|(o, _)| o.name == t.name).expect("checked by mismatch");
            out.extend_from_slice(&values[r]);
        }
        Ok(out)
    }
}

/// Raw little-endian bytes of f32 values.
pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * 4);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_follow_the_order_and_mismatches_name_the_tensor() {
        let a = Layout::new(vec![TensorSpec::new("w", vec![2, 3]), TensorSpec::new("b", vec![3])]).unwrap();
        let r: Vec<_> = a.ranges().map(|(t, r)| (t.name.clone(), r)).collect();
        assert_eq!(r, vec![("w".to_string(), 0..6), ("b".to_string(), 6..9)]);
        assert_eq!(a.numel(), 9);
        assert!(Layout::new(vec![TensorSpec::new("w", vec![1]), TensorSpec::new("w", vec![1])]).is_err());

        let swapped =
            Layout::new(vec![TensorSpec::new("b", vec![3]), TensorSpec::new("w", vec![2, 3])]).unwrap();
        assert_eq!(a.mismatch(&swapped), None);
        let values: Vec<f32> = (0..9).map(|i| i as f32).collect(); // b = 0..3, w = 3..9
        assert_eq!(a.reorder(&swapped, &values).unwrap(), vec![3., 4., 5., 6., 7., 8., 0., 1., 2.]);

        let reshaped =
            Layout::new(vec![TensorSpec::new("w", vec![3, 2]), TensorSpec::new("b", vec![3])]).unwrap();
        assert!(a.mismatch(&reshaped).unwrap().contains("\"w\" has shape [3, 2]"));
        let fewer = Layout::new(vec![TensorSpec::new("w", vec![2, 3])]).unwrap();
        assert!(a.mismatch(&fewer).unwrap().contains("no tensor \"b\""));
        assert!(fewer.mismatch(&a).unwrap().contains("\"b\" that is not registered"));
    }
}
