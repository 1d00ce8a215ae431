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

/// A store in this process's memory. Expired leases vanish at the next access.
#[derive(Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Mutex<BTreeMap<String, Slot>>>,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    fn with<R>(&self, f: impl FnOnce(&mut BTreeMap<String, Slot>) -> R) -> R {
        let mut map = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        map.retain(|_, s| s.expires.is_none_or(|t| t > now));
        f(&mut map)
    }
}

fn expiry(ttl: Option<Duration>) -> Option<Instant> {
    ttl.map(|t| Instant::now() + t)
}

impl Store for MemoryStore {
    async fn put(&self, key: &str, value: &[u8], ttl: Option<Duration>) -> Result<u64, StoreError> {
        Ok(self.with(|m| {
            let token = m.get(key).map_or(1, |s| s.token + 1);
            m.insert(key.to_string(), Slot { value: value.to_vec(), token, expires: expiry(ttl) });
            token
        }))
    }

    async fn refresh(&self, key: &str, ttl: Duration) -> Result<bool, StoreError> {
        Ok(self.with(|m| match m.get_mut(key) {
            Some(s) => {
                s.expires = expiry(Some(ttl));
                true
            }
            None => false,
        }))
    }

    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        Ok(self.with(|m| {
            m.get(key).map(|s| Entry { key: key.to_string(), value: s.value.clone(), token: s.token })
        }))
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        Ok(self.with(|m| m.remove(key).is_some()))
    }

    async fn delete_if(&self, key: &str, token: u64) -> Result<bool, StoreError> {
        Ok(self.with(|m| {
            let ours = m.get(key).is_some_and(|s| s.token == token);
            if ours {
                m.remove(key);
            }
            ours
        }))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<Entry>, StoreError> {
        Ok(self.with(|m| {
            m.range(prefix.to_string()..)
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
        Ok(self.with(|m| {
            let current = m.get(key).map(|s| s.token);
            if current != expected {
                return Cas::Conflict { current };
            }
            let token = current.map_or(1, |t| t + 1);
            m.insert(key.to_string(), Slot { value: value.to_vec(), token, expires: expiry(ttl) });
            Cas::Written(token)
        }))
    }
}
