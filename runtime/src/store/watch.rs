//! Change notification by polling: the watcher lists a prefix every
//! `interval` and reports the difference, which works the same on every
//! store and survives reconnects (a missed event is seen at the next poll).

use super::{Entry, Store};
use std::{collections::BTreeMap, sync::Arc, time::Duration};
use tokio::sync::mpsc;

/// A change under a watched prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    Added(Entry),
    Updated(Entry),
    Removed(String),
}

/// Watches `prefix`: the receiver gets the entries present at the start as
/// `Added`, then every change within `interval`. Stops when the receiver is
/// dropped. Store errors are logged and the poll retried.
pub fn watch<S: Store>(store: Arc<S>, prefix: String, interval: Duration) -> mpsc::Receiver<Change> {
    let (tx, rx) = mpsc::channel(256);
    tokio::spawn(async move {
        let mut known: BTreeMap<String, Entry> = BTreeMap::new();
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let now = match store.list(&prefix).await {
                Ok(entries) => entries,
                Err(e) => {
                    tracing::warn!("watching {prefix}: {e}");
                    continue;
                }
            };
            let mut next = BTreeMap::new();
            let mut changes = Vec::new();
            for e in now {
                match known.get(&e.key) {
                    None => changes.push(Change::Added(e.clone())),
                    Some(old) if old.token != e.token || old.value != e.value => {
                        changes.push(Change::Updated(e.clone()))
                    }
                    Some(_) => {}
                }
                next.insert(e.key.clone(), e);
            }
            changes
                .extend(known.keys().filter(|k| !next.contains_key(*k)).map(|k| Change::Removed(k.clone())));
            known = next;
            for c in changes {
                if tx.send(c).await.is_err() {
                    return;
                }
            }
        }
    });
    rx
}
