//! The data sets shipped with the runtime (`runtime/data/`, provenance in
//! `PROVENANCE.md`), their seeded split, and the global data cursor.
//!
//! The cursor makes data exactly-once across resizes: an epoch is a seeded
//! permutation of the training set; a step consumes the next `global_batch`
//! positions of it, split among the ranks; the cursor (positions consumed)
//! only moves when a step commits. A step redone after a failure, or with
//! another world size or batch, reads from the same cursor.

use flate2::read::GzDecoder;
use sha2::{Digest, Sha256};
use std::{io::Read, ops::Range, path::PathBuf};

/// A shipped data set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// 5000 MNIST digits, 28x28.
    Mnist5k,
    /// 1797 UCI digits, 8x8.
    Digits,
}

impl Source {
    fn file(self) -> (&'static str, &'static str, usize, f32) {
        match self {
            Source::Mnist5k => (
                "mnist_5k.csv.gz",
                "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d",
                784,
                255.0,
            ),
            Source::Digits => (
                "digits.csv.gz",
                "09f66e6debdee2cd2b5ae59e0d6abbb73fc2b0e0185d2e1957e9ebb51e23aa22",
                64,
                16.0,
            ),
        }
    }
}

/// Samples: `dim` float features a row, a label below `classes`, and
/// (click-through data) `fields` categorical ids a row.
#[derive(Clone, Debug, PartialEq)]
pub struct Dataset {
    pub features: Vec<f32>,
    pub labels: Vec<u32>,
    pub dim: usize,
    pub classes: usize,
    /// `fields` ids a row, unique across fields (empty without fields).
    pub categorical: Vec<u64>,
    pub fields: usize,
}

/// Why a data set could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: cannot read data: {source}{}", where_data_is(source))]
    Read { path: String, source: std::io::Error },
    #[error("{path}: checksum {found} is not the expected {expected}; the file is damaged or replaced")]
    Checksum { path: String, found: String, expected: String },
    #[error("{path}:{line}: {detail}")]
    Parse { path: String, line: usize, detail: String },
}

/// Where the shipped data sets are looked for, said when one is missing.
fn where_data_is(e: &std::io::Error) -> &'static str {
    match e.kind() {
        std::io::ErrorKind::NotFound => {
            " (the shipped data sets are read from $EDL_DATA_DIR where it is set, else from runtime/data in \
             the source checkout the runtime was built from: point EDL_DATA_DIR at a copy of that directory)"
        }
        _ => "",
    }
}

impl Dataset {
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Loads a shipped data set (from `$EDL_DATA_DIR` when set), checking its sha256.
    pub fn load(source: Source) -> Result<Self, DataError> {
        let (file, sha, dim, max) = source.file();
        let dir = std::env::var_os("EDL_DATA_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data"));
        let path = dir.join(file);
        let shown = path.display().to_string();
        let gz = std::fs::read(&path).map_err(|source| DataError::Read { path: shown.clone(), source })?;
        let found = hex::encode(Sha256::digest(&gz));
        if found != sha {
            return Err(DataError::Checksum { path: shown, found, expected: sha.into() });
        }
        let mut text = String::new();
        GzDecoder::new(gz.as_slice())
            .read_to_string(&mut text)
            .map_err(|source| DataError::Read { path: shown.clone(), source })?;
        let mut ds = Dataset {
            features: Vec::new(),
            labels: Vec::new(),
            dim,
            classes: 10,
            categorical: Vec::new(),
            fields: 0,
        };
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let values: Vec<&str> = line.split(',').collect();
            let bad = |detail: String| DataError::Parse { path: shown.clone(), line: i + 1, detail };
            if values.len() != dim + 1 {
                return Err(bad(format!("{} columns, expected {}", values.len(), dim + 1)));
            }
            for v in &values[..dim] {
                let x: f32 = v.trim().parse().map_err(|_| bad(format!("{v:?} is not a number")))?;
                ds.features.push(x / max);
            }
            let label: u32 =
                values[dim].trim().parse().map_err(|_| bad(format!("label {:?}", values[dim])))?;
            if label >= 10 {
                return Err(bad(format!("label {label} out of range")));
            }
            ds.labels.push(label);
        }
        Ok(ds)
    }

    /// The categorical ids of the rows at `idx`, in that order.
    pub fn gather_ids(&self, idx: &[u32]) -> Vec<u64> {
        let f = self.fields;
        idx.iter().flat_map(|&i| &self.categorical[i as usize * f..(i as usize + 1) * f]).copied().collect()
    }

    /// Keeps the first `n` samples.
    pub fn truncate(&mut self, n: usize) {
        let n = n.min(self.len());
        self.features.truncate(n * self.dim);
        self.labels.truncate(n);
        self.categorical.truncate(n * self.fields);
    }

    /// The rows at `idx`, in that order.
    pub fn gather(&self, idx: &[u32]) -> (Vec<f32>, Vec<u32>) {
        let mut x = Vec::with_capacity(idx.len() * self.dim);
        let mut y = Vec::with_capacity(idx.len());
        for &i in idx {
            let i = i as usize;
            x.extend_from_slice(&self.features[i * self.dim..(i + 1) * self.dim]);
            y.push(self.labels[i]);
        }
        (x, y)
    }

    /// A seeded shuffle split into (train, test) with `test_rows` test samples.
    pub fn split(&self, test_rows: usize, seed: u64) -> (Dataset, Dataset) {
        let order = permutation(self.len(), seed, u64::MAX);
        let (test_idx, train_idx) = order.split_at(test_rows.min(self.len()));
        let part = |idx: &[u32]| {
            let (features, labels) = self.gather(idx);
            let categorical = self.gather_ids(idx);
            Dataset { features, labels, categorical, ..*self }
        };
        (part(train_idx), part(test_idx))
    }
}

pub(crate) fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The most samples a job's data set may hold: a step's positions and
/// sample indices travel as 32-bit numbers.
pub const MAX_SAMPLES: usize = u32::MAX as usize;

/// The order of `n` samples in `epoch` under `seed` (Fisher-Yates).
pub fn permutation(n: usize, seed: u64, epoch: u64) -> Vec<u32> {
    let mut p: Vec<u32> = (0..n as u32).collect();
    let mut state = splitmix(seed ^ splitmix(epoch));
    for i in (1..n).rev() {
        state = splitmix(state);
        let j = (state % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}

/// Positions of the epoch's permutation that `rank` of `world` reads in the
/// step starting at `cursor` with `global_batch` samples (the last step of an
/// epoch may be shorter). Ranks get contiguous, balanced shares.
pub fn shard(
    cursor: usize,
    global_batch: usize,
    rank: usize,
    world: usize,
    epoch_len: usize,
) -> Range<usize> {
    let end = (cursor + global_batch).min(epoch_len);
    let b = end.saturating_sub(cursor);
    let world = world.max(1);
    let lo = cursor + b * rank / world;
    let hi = cursor + b * (rank + 1) / world;
    lo..hi
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_data_loads_and_splits() {
        let ds = Dataset::load(Source::Digits).unwrap();
        assert_eq!((ds.len(), ds.dim), (1797, 64));
        assert!(ds.features.iter().all(|v| (0.0..=1.0).contains(v)));
        let (train, test) = ds.split(400, 1);
        assert_eq!((train.len(), test.len()), (1397, 400));
        assert_ne!(
            test.labels.iter().collect::<std::collections::HashSet<_>>().len(),
            1,
            "shuffled, not sorted"
        );
    }

    #[test]
    fn shards_cover_each_step_exactly_once_whatever_the_world() {
        let n = 1003;
        for (world, batch) in [(1usize, 64usize), (3, 64), (4, 100), (7, 13)] {
            let mut seen = vec![0u8; n];
            let mut cursor = 0;
            while cursor < n {
                for r in 0..world {
                    for p in shard(cursor, batch, r, world, n) {
                        seen[p] += 1;
                    }
                }
                cursor = (cursor + batch).min(n);
            }
            assert!(seen.iter().all(|&c| c == 1), "world {world} batch {batch}");
        }
        let p = permutation(100, 7, 0);
        let mut sorted = p.clone();
        sorted.sort();
        assert_eq!(sorted, (0..100).collect::<Vec<u32>>());
        assert_ne!(p, permutation(100, 7, 1), "epochs differ");
        assert_eq!(p, permutation(100, 7, 0), "reproducible");
    }
}

#[cfg(test)]
mod order_tests {
    /// The order is part of the job's contract (checkpoints, the PyTorch
    /// comparison in benches/torch_compare.py): it must not drift.
    #[test]
    fn the_permutation_of_a_seed_and_epoch_is_fixed() {
        assert_eq!(super::permutation(10, 1, 0), vec![3, 9, 5, 0, 4, 1, 7, 6, 8, 2]);
    }
}
