//! The discovery and coordination store: a trait with two implementations.
//!
//! - [`MemoryStore`]: in-process, the embedded default (a one-machine job
//!   needs no server).
//! - [`RedisStore`]: Redis, shared by jobs and teachers and surviving a
//!   coordinator restart; reconnects with backoff after a Redis restart.
//! - [`EtcdStore`]: an etcd cluster, replicated and linearizable: it
//!   survives losing a minority of its members.
//!
//! Every value carries a *token*; tokens come from one sequence for the
//! whole store, so each write's is higher than any before, of any key:
//! [`Store::compare_and_set`] writes only if the token is still the one the
//! writer read, which makes it a fencing token for single-writer state.
//! A value written with a TTL is a *lease*: it disappears unless refreshed
//! ([`Lease`] refreshes one in the background). [`watch`] reports keys added,
//! changed and removed under a prefix. Key layout: `docs/store.md`.

mod etcd_store;
mod lease;
mod memory;
mod redis_store;
mod watch;

pub use etcd_store::EtcdStore;
pub use lease::Lease;
pub(crate) use lease::retry_every as lease_retry_every;
pub use memory::MemoryStore;
pub use redis_store::RedisStore;
pub use watch::{Change, watch};

use std::{future::Future, time::Duration};

/// A key's value and its write token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub key: String,
    pub value: Vec<u8>,
    pub token: u64,
}

/// What [`Store::compare_and_set`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cas {
    /// Written; the key's new token.
    Written(u64),
    /// Not written: the key's token is `current` (None: the key is absent).
    Conflict { current: Option<u64> },
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store {url}: {detail}")]
    Unavailable { url: String, detail: String },
    #[error("store {url}: unexpected reply for {op}: {detail}")]
    Protocol { url: String, op: &'static str, detail: String },
    #[error(
        "invalid store address {:?}: expected `memory`, `redis://host:port[/db]`, `rediss://...`, `etcd://host:port[,host:port...]` or `etcds://[user:password@]host:port[,...][?ca=FILE&cert=FILE&key=FILE]`",
        redact(.0)
    )]
    BadUrl(String),
}

/// A key-value store with leases, tokens and prefix listing.
pub trait Store: Send + Sync + 'static {
    /// Writes `value` (a lease when `ttl` is set); returns the new token.
    fn put(
        &self,
        key: &str,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Extends a lease; false when the key no longer exists.
    fn refresh(&self, key: &str, ttl: Duration) -> impl Future<Output = Result<bool, StoreError>> + Send;

    fn get(&self, key: &str) -> impl Future<Output = Result<Option<Entry>, StoreError>> + Send;

    /// Removes a key; false when it was not there.
    fn delete(&self, key: &str) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Removes a key only if its token is `token`, in one step (a lease
    /// given up never removes the next holder's); false when it was not.
    fn delete_if(&self, key: &str, token: u64) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Every entry whose key starts with `prefix`, sorted by key.
    fn list(&self, prefix: &str) -> impl Future<Output = Result<Vec<Entry>, StoreError>> + Send;

    /// Writes only if the key's token is `expected` (None: only if absent).
    fn compare_and_set(
        &self,
        key: &str,
        expected: Option<u64>,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> impl Future<Output = Result<Cas, StoreError>> + Send;
}

/// A store address fit to print: the password of a `redis://user:pass@host`
/// URL is replaced by `***`.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_string() };
    let Some((auth, host)) = rest.rsplit_once('@') else { return url.to_string() };
    let user = auth.split_once(':').map_or("", |(u, _)| u);
    if auth.contains(':') {
        format!("{scheme}://{user}:***@{host}")
    } else {
        format!("{scheme}://***@{host}")
    }
}

/// The store chosen at run time (`--store memory` or `--store redis://...`).
#[derive(Clone)]
pub enum AnyStore {
    Memory(MemoryStore),
    Redis(RedisStore),
    Etcd(EtcdStore),
}

impl AnyStore {
    /// Opens `memory` or a `redis://` URL (connecting lazily).
    pub fn open(url: &str) -> Result<Self, StoreError> {
        if url == "memory" {
            return Ok(AnyStore::Memory(MemoryStore::new()));
        }
        if url.starts_with("redis://") || url.starts_with("rediss://") {
            return Ok(AnyStore::Redis(RedisStore::open(url)?));
        }
        if url.starts_with("etcd://") || url.starts_with("etcds://") {
            return Ok(AnyStore::Etcd(EtcdStore::open(url)?));
        }
        Err(StoreError::BadUrl(url.to_string()))
    }
}

impl AnyStore {
    /// Which member leads a replicated store (etcd), as a name for the
    /// operator; None for a store of one server, or when it cannot be asked.
    pub async fn leader(&self) -> Option<String> {
        match self {
            AnyStore::Etcd(s) => {
                s.leader().await.ok().filter(|&id| id != 0).map(|id| format!("etcd member {id:x}"))
            }
            _ => None,
        }
    }
}

macro_rules! delegate {
    ($self:ident, $s:ident => $e:expr) => {
        match $self {
            AnyStore::Memory($s) => $e.await,
            AnyStore::Redis($s) => $e.await,
            AnyStore::Etcd($s) => $e.await,
        }
    };
}

impl Store for AnyStore {
    async fn put(&self, key: &str, value: &[u8], ttl: Option<Duration>) -> Result<u64, StoreError> {
        delegate!(self, s => s.put(key, value, ttl))
    }
    async fn refresh(&self, key: &str, ttl: Duration) -> Result<bool, StoreError> {
        delegate!(self, s => s.refresh(key, ttl))
    }
    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        delegate!(self, s => s.get(key))
    }
    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        delegate!(self, s => s.delete(key))
    }
    async fn delete_if(&self, key: &str, token: u64) -> Result<bool, StoreError> {
        delegate!(self, s => s.delete_if(key, token))
    }
    async fn list(&self, prefix: &str) -> Result<Vec<Entry>, StoreError> {
        delegate!(self, s => s.list(prefix))
    }
    async fn compare_and_set(
        &self,
        key: &str,
        expected: Option<u64>,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Cas, StoreError> {
        delegate!(self, s => s.compare_and_set(key, expected, value, ttl))
    }
}

/// Key names, namespaced by job and service so several jobs share one Redis.
pub mod keys {
    /// Root of everything edl writes.
    pub const ROOT: &str = "edl";

    /// Prefix of the teacher endpoints of `service`.
    pub fn teachers(service: &str) -> String {
        format!("{ROOT}/services/{service}/teachers/")
    }

    /// Everything of `service`: its teachers and its pool's settings.
    pub fn service(service: &str) -> String {
        format!("{ROOT}/services/{service}/")
    }

    /// The settings the pool of `service` gives its students (sealed with
    /// the registration key): the requests each keeps in flight at each teacher.
    pub fn teacher_pool(service: &str) -> String {
        format!("{ROOT}/services/{service}/pool")
    }

    /// One teacher endpoint of `service`.
    pub fn teacher(service: &str, id: &str) -> String {
        format!("{}{id}", teachers(service))
    }

    /// Prefix of a job's worker leases.
    pub fn workers(job: &str) -> String {
        format!("{ROOT}/jobs/{job}/workers/")
    }

    /// A job's coordinator state (generation, cursor), written with compare-and-set.
    pub fn job_state(job: &str) -> String {
        format!("{ROOT}/jobs/{job}/state")
    }

    /// The lease of the coordinator that runs the job.
    pub fn coordinator(job: &str) -> String {
        format!("{ROOT}/jobs/{job}/coordinator")
    }
}
