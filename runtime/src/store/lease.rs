//! A lease held by refreshing it in the background.

use super::{Store, StoreError};
use std::{sync::Arc, time::Duration};
use tokio::task::JoinHandle;

/// Keeps `key` alive by refreshing it every third of its TTL (sooner after
/// a refresh that failed: [`retry_every`]); if the key is found gone
/// (expired during a Redis outage, say) it is written again.
/// [`Lease::release`] (or dropping the lease) stops refreshing; release also
/// deletes the key so watchers see it go at once.
pub struct Lease<S: Store> {
    store: Arc<S>,
    key: String,
    task: JoinHandle<()>,
}

/// How soon a lease of `ttl` whose refresh failed is refreshed again: a
/// twentieth of its term, 100 ms to 1 s (250 ms for a 5 s lease), not a
/// third of it later. A store that was away (an etcd cluster electing a
/// leader, a Redis restarting) answers within a second or two, and the
/// lease is to be refreshed before its term ends.
pub(crate) fn retry_every(ttl: Duration) -> Duration {
    (ttl / 20).clamp(Duration::from_millis(100), Duration::from_secs(1))
}

impl<S: Store> Lease<S> {
    /// Writes the key and starts refreshing it. Must run inside a Tokio runtime.
    pub async fn hold(store: Arc<S>, key: String, value: Vec<u8>, ttl: Duration) -> Result<Self, StoreError> {
        store.put(&key, &value, Some(ttl)).await?;
        let (s, k) = (store.clone(), key.clone());
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(ttl / 3);
            tick.tick().await;
            loop {
                tick.tick().await;
                let held = match s.refresh(&k, ttl).await {
                    Ok(true) => true,
                    Ok(false) => match s.put(&k, &value, Some(ttl)).await {
                        Ok(_) => true,
                        Err(e) => {
                            tracing::warn!("lease {k}: cannot write it again: {e}");
                            false
                        }
                    },
                    Err(e) => {
                        tracing::warn!("lease {k}: refresh failed, retrying: {e}");
                        false
                    }
                };
                if !held {
                    tick.reset_after(retry_every(ttl));
                }
            }
        });
        Ok(Lease { store, key, task })
    }

    /// The key held.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Stops refreshing and deletes the key.
    pub async fn release(self) -> Result<(), StoreError> {
        self.task.abort();
        self.store.delete(&self.key).await.map(|_| ())
    }
}

impl<S: Store> Drop for Lease<S> {
    fn drop(&mut self) {
        self.task.abort();
    }
}
