//! The in-process store.

use super::{Cas, Entry, Store, StoreError};
use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

#[derive(Clone, Debug)]
struct Slot {
    value: Vec<u8>,
    token: u64,
    expires: Option<Instant>,
}

/// A store in this process's memory. Expired leases vanish at the next
/// access. Tokens come from one sequence for the whole store, as in Redis.
#[derive(Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Mutex<Keys>>,
    /// Compare-and-sets still to refuse as an unreachable store would.
    #[cfg(test)]
    refusals: Arc<std::sync::atomic::AtomicUsize>,
    /// Compare-and-sets still to apply and then fail, as a call whose
    /// answer was lost (a timeout, a leader election) would.
    #[cfg(test)]
    lost_answers: Arc<std::sync::atomic::AtomicUsize>,
}

#[derive(Default)]
struct Keys {
    map: BTreeMap<String, Slot>,
    /// The last token given.
    sequence: u64,
    /// No key expires before this (None: none expires): keys are swept
    /// only once it passed, not at every access (a job's thousands of
    /// worker leases would make each access a sweep of them all).
    soonest: Option<Instant>,
}

impl Keys {
    fn next_token(&mut self) -> u64 {
        self.sequence += 1;
        self.sequence
    }

    /// When a key given `ttl` now expires.
    fn expiry(&mut self, ttl: Option<Duration>) -> Option<Instant> {
        let at = ttl.map(|t| Instant::now() + t);
        if let Some(t) = at {
            self.soonest = Some(self.soonest.map_or(t, |s| s.min(t)));
        }
        at
    }

    /// Drops the keys expired by `now`.
    fn sweep(&mut self, now: Instant) {
        if self.soonest.is_none_or(|t| t > now) {
            return;
        }
        self.map.retain(|_, s| s.expires.is_none_or(|t| t > now));
        self.soonest = self.map.values().filter_map(|s| s.expires).min();
    }
}

/// Counts one down, if any is left.
#[cfg(test)]
fn take_one(left: &std::sync::atomic::AtomicUsize) -> bool {
    use std::sync::atomic::Ordering::SeqCst;
    left.fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1)).is_ok()
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// The next `n` compare-and-sets fail as on a store that cannot be
    /// reached.
    #[cfg(test)]
    pub(crate) fn refuse_writes(&self, n: usize) {
        self.refusals.store(n, std::sync::atomic::Ordering::SeqCst);
    }

    /// The next `n` compare-and-sets are applied, and then fail as calls
    /// whose answers were lost.
    #[cfg(test)]
    pub(crate) fn lose_answers(&self, n: usize) {
        self.lost_answers.store(n, std::sync::atomic::Ordering::SeqCst);
    }

    fn with<R>(&self, f: impl FnOnce(&mut Keys) -> R) -> R {
        let mut keys = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        keys.sweep(now);
        f(&mut keys)
    }
}

impl Store for MemoryStore {
    async fn put(&self, key: &str, value: &[u8], ttl: Option<Duration>) -> Result<u64, StoreError> {
        Ok(self.with(|k| {
            let token = k.next_token();
            let expires = k.expiry(ttl);
            k.map.insert(key.to_string(), Slot { value: value.to_vec(), token, expires });
            token
        }))
    }

    async fn refresh(&self, key: &str, ttl: Duration) -> Result<bool, StoreError> {
        Ok(self.with(|k| {
            let expires = k.expiry(Some(ttl));
            match k.map.get_mut(key) {
                Some(s) => {
                    s.expires = expires;
                    true
                }
                None => false,
            }
        }))
    }

    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        Ok(self.with(|k| {
            k.map.get(key).map(|s| Entry { key: key.to_string(), value: s.value.clone(), token: s.token })
        }))
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        Ok(self.with(|k| k.map.remove(key).is_some()))
    }

    async fn delete_if(&self, key: &str, token: u64) -> Result<bool, StoreError> {
        Ok(self.with(|k| {
            let ours = k.map.get(key).is_some_and(|s| s.token == token);
            if ours {
                k.map.remove(key);
            }
            ours
        }))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<Entry>, StoreError> {
        Ok(self.with(|k| {
            k.map
                .range(prefix.to_string()..)
                .take_while(|(k, _)| k.starts_with(prefix))
                .map(|(k, s)| Entry { key: k.clone(), value: s.value.clone(), token: s.token })
                .collect()
        }))
    }

    async fn compare_and_set(
        &self,
        key: &str,
        expected: Option<u64>,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Cas, StoreError> {
        #[cfg(test)]
        if take_one(&self.refusals) {
            return Err(StoreError::Unavailable { url: "memory".into(), detail: "refused".into() });
        }
        let done = self.with(|k| {
            let current = k.map.get(key).map(|s| s.token);
            if current != expected {
                return Cas::Conflict { current };
            }
            let token = k.next_token();
            let expires = k.expiry(ttl);
            k.map.insert(key.to_string(), Slot { value: value.to_vec(), token, expires });
            Cas::Written(token)
        });
        #[cfg(test)]
        if take_one(&self.lost_answers) {
            return Err(StoreError::Unavailable { url: "memory".into(), detail: "no answer".into() });
        }
        Ok(done)
    }
}
