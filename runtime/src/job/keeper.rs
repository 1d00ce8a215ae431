//! The job's record in the store, kept by a thread of its own so that the
//! store is never on a step's path: a Redis outage slows nothing, and the
//! writes catch up when it is back.
//!
//! The coordinator hands over the latest [`JobState`] (only the newest one
//! queued is written), worker leases and removals. The job state is written
//! with compare-and-set on the token the coordinator read at start: a write
//! that finds another writer's token means a second coordinator took the
//! job, and this one is *fenced*: [`StoreKeeper::fenced`] says so and the
//! coordinator stops instead of overwriting. A key that vanished (the store
//! restarted without persistence) is written afresh.

use super::coordinator::JobState;
use crate::store::{AnyStore, Cas, Store, redact};
use std::{
    sync::{Arc, Mutex},
    time::Duration,
};
use tokio::sync::{mpsc, oneshot};

enum Cmd {
    State(JobState),
    Lease { key: String, value: Vec<u8>, ttl: Duration },
    Delete(String),
    Flush(oneshot::Sender<Result<(), String>>),
}

/// Writes the job's state and worker leases in the background.
pub struct StoreKeeper {
    tx: mpsc::UnboundedSender<Cmd>,
    fenced: Arc<Mutex<Option<String>>>,
}

impl StoreKeeper {
    /// Starts the keeper of `key` in the store at `url`; `token` is the
    /// state's token as read at start (None: the job has no state yet).
    pub fn start(url: &str, key: String, token: Option<u64>) -> anyhow::Result<Self> {
        let (tx, mut rx) = mpsc::unbounded_channel::<Cmd>();
        let fenced = Arc::new(Mutex::new(None));
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let store = {
            let _g = rt.enter();
            AnyStore::open(url)?
        };
        let shown = redact(url);
        let flag = fenced.clone();
        std::thread::Builder::new().name("edl-store-keeper".into()).spawn(move || {
            rt.block_on(async move {
                let mut token = token;
                while let Some(first) = rx.recv().await {
                    // Coalesce: of the states queued, only the newest is written.
                    let mut cmds = vec![first];
                    while let Ok(c) = rx.try_recv() {
                        cmds.push(c);
                    }
                    let last_state = cmds.iter().rposition(|c| matches!(c, Cmd::State(_)));
                    for (i, cmd) in cmds.into_iter().enumerate() {
                        match cmd {
                            Cmd::State(s) if Some(i) == last_state => {
                                if let Err(e) = write_state(&store, &key, &mut token, &s).await {
                                    if e.starts_with("fenced") {
                                        *flag.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.clone());
                                    }
                                    tracing::warn!("store {shown}: job state: {e}");
                                }
                            }
                            Cmd::State(_) => {}
                            Cmd::Lease { key, value, ttl } => {
                                if let Err(e) = store.put(&key, &value, Some(ttl)).await {
                                    tracing::warn!("store {shown}: lease {key}: {e}");
                                }
                            }
                            Cmd::Delete(key) => {
                                if let Err(e) = store.delete(&key).await {
                                    tracing::warn!("store {shown}: removing {key}: {e}");
                                }
                            }
                            Cmd::Flush(done) => {
                                let _ = done.send(Ok(()));
                            }
                        }
                    }
                }
            })
        })?;
        Ok(StoreKeeper { tx, fenced })
    }

    /// Queues the newest job state.
    pub fn state(&self, s: JobState) {
        let _ = self.tx.send(Cmd::State(s));
    }

    /// Queues a lease write.
    pub fn lease(&self, key: String, value: Vec<u8>, ttl: Duration) {
        let _ = self.tx.send(Cmd::Lease { key, value, ttl });
    }

    /// Queues a removal.
    pub fn delete(&self, key: String) {
        let _ = self.tx.send(Cmd::Delete(key));
    }

    /// Why this coordinator may no longer write the job's state, if so.
    pub fn fenced(&self) -> Option<String> {
        self.fenced.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Waits (at most `within`) until everything queued so far was tried.
    pub fn flush(&self, within: Duration) -> Result<(), String> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Cmd::Flush(tx)).map_err(|_| "the store keeper stopped".to_string())?;
        let deadline = std::time::Instant::now() + within;
        let mut rx = rx;
        loop {
            match rx.try_recv() {
                Ok(r) => return r,
                Err(oneshot::error::TryRecvError::Closed) => return Err("the store keeper stopped".into()),
                Err(oneshot::error::TryRecvError::Empty) if std::time::Instant::now() >= deadline => {
                    return Err(format!("the store did not take the job's state within {within:?}"));
                }
                Err(oneshot::error::TryRecvError::Empty) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }
}

async fn write_state(
    store: &AnyStore,
    key: &str,
    token: &mut Option<u64>,
    s: &JobState,
) -> Result<(), String> {
    let value = serde_json::to_vec(s).map_err(|e| e.to_string())?;
    let answer =
        tokio::time::timeout(Duration::from_secs(10), store.compare_and_set(key, *token, &value, None))
            .await
            .map_err(|_| "no answer within 10 s".to_string())?
            .map_err(|e| e.to_string())?;
    match answer {
        Cas::Written(t) => {
            *token = Some(t);
            Ok(())
        }
        // The key is gone (a store restarted without persistence): write it afresh.
        Cas::Conflict { current: None } => {
            match store.compare_and_set(key, None, &value, None).await.map_err(|e| e.to_string())? {
                Cas::Written(t) => {
                    *token = Some(t);
                    Ok(())
                }
                Cas::Conflict { current } => Err(fenced(*token, current)),
            }
        }
        Cas::Conflict { current } => Err(fenced(*token, current)),
    }
}

fn fenced(mine: Option<u64>, theirs: Option<u64>) -> String {
    format!(
        "fenced: another coordinator wrote the job's state (token {}, this coordinator's {}); \
         stopping instead of overwriting it",
        theirs.map_or("none".into(), |t| t.to_string()),
        mine.map_or("none".into(), |t| t.to_string())
    )
}
