//! Exactly-once accounting: how many committed steps consumed each training
//! sample, epoch by epoch, from the sample ids the workers report having
//! trained on (not from the cursor arithmetic, so a bug there shows up).

use serde::{Deserialize, Serialize};

/// One finished epoch's tally.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochRecord {
    pub epoch: u64,
    /// Sample reads by committed steps (duplicates included).
    pub samples_committed: u64,
    /// Samples read by more than one committed step (counted once each).
    pub duplicates: u64,
    /// Samples no committed step read.
    pub missing: u64,
}

/// A committed step named a sample the training set does not have.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    #[error("sample id {0} is outside the training set")]
    OutsideTrainingSet(u32),
}

/// The tally of the current epoch and the records of the finished ones.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Ledger {
    pub epochs: Vec<EpochRecord>,
    /// Reads per sample in the current epoch.
    counts: Vec<u8>,
    reads: u64,
}

impl Ledger {
    pub fn new(samples: usize) -> Self {
        Ledger { epochs: Vec::new(), counts: vec![0; samples], reads: 0 }
    }

    /// Counts the samples a committed step read; ids out of range are an error.
    pub fn commit(&mut self, ids: &[u32]) -> Result<(), LedgerError> {
        for &id in ids {
            let c = self.counts.get_mut(id as usize).ok_or(LedgerError::OutsideTrainingSet(id))?;
            *c = c.saturating_add(1);
        }
        self.reads += ids.len() as u64;
        Ok(())
    }

    /// Closes the current epoch and starts the next.
    pub fn finish_epoch(&mut self, epoch: u64) -> EpochRecord {
        let rec = EpochRecord {
            epoch,
            samples_committed: self.reads,
            duplicates: self.counts.iter().filter(|&&c| c > 1).count() as u64,
            missing: self.counts.iter().filter(|&&c| c == 0).count() as u64,
        };
        self.epochs.push(rec.clone());
        self.counts.iter_mut().for_each(|c| *c = 0);
        self.reads = 0;
        rec
    }

    /// Samples of the training set.
    pub fn samples(&self) -> usize {
        self.counts.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_duplicates_and_missing_samples() {
        let mut l = Ledger::new(5);
        l.commit(&[0, 1, 2]).unwrap();
        l.commit(&[2, 3]).unwrap();
        assert!(l.commit(&[5]).is_err());
        let r = l.finish_epoch(0);
        assert_eq!(r, EpochRecord { epoch: 0, samples_committed: 5, duplicates: 1, missing: 1 });
        l.commit(&[4, 3, 2, 1, 0]).unwrap();
        let r = l.finish_epoch(1);
        assert_eq!((r.duplicates, r.missing, r.samples_committed), (0, 0, 5));
        let back: Ledger = serde_json::from_str(&serde_json::to_string(&l).unwrap()).unwrap();
        assert_eq!(back, l);
    }
}
