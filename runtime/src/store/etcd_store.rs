//! The etcd store (`etcd://host1:port,host2:port,...`): a replicated,
//! linearizable store that survives losing a minority of its members.
//!
//! `etcds://` reaches the members over TLS: `?ca=FILE` is the CA their
//! certificates are checked against (default: the web PKI's roots),
//! `&cert=FILE&key=FILE` the client certificate members that demand one
//! (`--client-cert-auth`) check, `&domain=NAME` the name their
//! certificates carry where it is not the host's. `user:password@` before
//! the hosts authenticates to a cluster with auth enabled (with `etcd://`
//! the password would cross in clear: it is refused). The files are read
//! when the store is opened, and an error names the one that is wrong.
//!
//! Tokens are etcd's own revisions: every write of the cluster gets the next
//! one, so they strictly increase across keys, deletions and expiries, as the
//! [`super::Store`] contract asks. A key written with a TTL is attached to an
//! etcd lease of that TTL (etcd counts leases in whole seconds, at least the
//! cluster's minimum: a TTL is rounded up). Compare-and-set and
//! compare-and-delete are etcd transactions on the key's `mod_revision`.
//! A call is sent again only when it failed before it was sent (see
//! [`transient`]).

use super::{Cas, Entry, Store, StoreError};
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, DeleteOptions, GetOptions, PutOptions, Txn, TxnOp,
    TxnOpResponse,
};
use std::{sync::Arc, time::Duration};

/// A store in an etcd cluster; connects on first use.
#[derive(Clone)]
pub struct EtcdStore {
    /// As logs show it (without a password).
    url: Arc<str>,
    endpoints: Arc<[String]>,
    /// User name and password, for a cluster with auth enabled.
    user: Option<(String, String)>,
    tls: Option<etcd_client::TlsOptions>,
    client: Arc<tokio::sync::OnceCell<Client>>,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EtcdStore({})", self.url)
    }
}

/// A lease's TTL in etcd's whole seconds (rounded up, at least one).
fn seconds(ttl: Duration) -> i64 {
    ttl.as_millis().div_ceil(1000).max(1) as i64
}

fn token(revision: i64) -> u64 {
    revision.max(0) as u64
}

impl EtcdStore {
    /// A store at `url`: `etcd://host:port[,host:port...]` (the members'
    /// client addresses). Nothing is contacted yet.
    pub fn open(url: &str) -> Result<Self, StoreError> {
        let shown = super::redact(url);
        let bad = || StoreError::BadUrl(shown.clone());
        let (secure, rest) = match (url.strip_prefix("etcds://"), url.strip_prefix("etcd://")) {
            (Some(rest), _) => (true, rest),
            (None, Some(rest)) => (false, rest),
            _ => return Err(bad()),
        };
        // The user and password come first (a password may hold `?`).
        let (user, rest) = match rest.rsplit_once('@') {
            Some((auth, rest)) => {
                let (name, password) = auth.split_once(':').ok_or_else(bad)?;
                (Some((name.to_string(), password.to_string())), rest)
            }
            None => (None, rest),
        };
        let (hosts, query) = rest.split_once('?').unwrap_or((rest, ""));
        if !secure && !query.is_empty() {
            return Err(StoreError::Unavailable {
                url: shown,
                detail: "TLS settings (?ca=, cert=, key=) over etcd:// would be ignored: use etcds://".into(),
            });
        }
        if user.is_some() && !secure {
            return Err(StoreError::Unavailable {
                url: shown,
                detail: "a user and password over etcd:// would cross in clear: use etcds://".into(),
            });
        }
        let scheme = if secure { "https" } else { "http" };
        let endpoints: Vec<String> = hosts
            .trim_end_matches('/')
            .split(',')
            .filter(|e| !e.is_empty())
            .map(|e| format!("{scheme}://{e}"))
            .collect();
        if endpoints.is_empty() {
            return Err(bad());
        }
        let tls = if secure { Some(tls_options(query, &shown)?) } else { None };
        Ok(EtcdStore { url: shown.into(), endpoints: endpoints.into(), user, tls, client: Arc::default() })
    }

    fn err(&self, e: etcd_client::Error) -> StoreError {
        StoreError::Unavailable { url: self.url.to_string(), detail: e.to_string() }
    }

    /// The client, connected (each call clones it: its channels are shared).
    async fn client(&self) -> Result<Client, StoreError> {
        let connect = || async {
            let mut options = ConnectOptions::new()
                .with_connect_timeout(Duration::from_secs(1))
                .with_timeout(Duration::from_secs(2))
                .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2));
            if let Some((name, password)) = &self.user {
                // The token etcd gives for the password expires (its TTL, a
                // change of users): the client asks for a new one then.
                options = options.with_user(name, password).with_auto_token_refresh(true);
            }
            if let Some(tls) = &self.tls {
                options = options.with_tls(tls.clone());
            }
            Client::connect(self.endpoints.as_ref(), Some(options)).await.map_err(|e| self.err(e))
        };
        self.client.get_or_try_init(connect).await.cloned()
    }

    /// Runs `op`, again on a member that answers while a member is down
    /// (the client spreads calls over the members, and one that went away
    /// is not dropped at once), for up to [`RETRY_FOR`]: what the caller
    /// sees of losing a member is a pause.
    async fn call<T, F, Fut>(&self, mut op: F) -> Result<T, StoreError>
    where
        F: FnMut(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        let client = self.client().await?;
        let deadline = std::time::Instant::now() + RETRY_FOR;
        loop {
            match op(client.clone()).await {
                Ok(v) => return Ok(v),
                Err(e) if transient(&e) && std::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(self.err(e)),
            }
        }
    }

    /// The id of the member that leads the cluster now (as the member
    /// asked knows it).
    pub async fn leader(&self) -> Result<u64, StoreError> {
        Ok(self.call(|mut c| async move { c.status().await }).await?.leader())
    }

    /// Put options for a write with `ttl`: a new lease of that TTL.
    async fn lease_for(&self, ttl: Option<Duration>) -> Result<Option<PutOptions>, StoreError> {
        let Some(ttl) = ttl else { return Ok(None) };
        let lease = self.call(|mut c| async move { c.lease_grant(seconds(ttl), None).await }).await?;
        Ok(Some(PutOptions::new().with_lease(lease.id())))
    }
}

/// The TLS settings `?ca=FILE&cert=FILE&key=FILE&domain=NAME` ask for,
/// their files read now; an error names the setting and the file.
fn tls_options(query: &str, shown: &str) -> Result<etcd_client::TlsOptions, StoreError> {
    use etcd_client::{Certificate, Identity, TlsOptions};
    let mut params = std::collections::BTreeMap::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if !matches!(k, "ca" | "cert" | "key" | "domain") {
            return Err(StoreError::Unavailable {
                url: shown.to_string(),
                detail: format!("unknown setting {k:?} (etcds:// takes ca, cert, key and domain)"),
            });
        }
        params.insert(k, v.to_string());
    }
    let read = |name: &str| -> Result<Option<Vec<u8>>, StoreError> {
        let Some(path) = params.get(name) else { return Ok(None) };
        std::fs::read(path).map(Some).map_err(|e| StoreError::Unavailable {
            url: shown.to_string(),
            detail: format!("{name}={path}: {e}"),
        })
    };
    let mut tls = match read("ca")? {
        Some(ca) => TlsOptions::new().ca_certificate(Certificate::from_pem(ca)),
        None => TlsOptions::new().with_webpki_roots(),
    };
    match (read("cert")?, read("key")?) {
        (Some(cert), Some(key)) => tls = tls.identity(Identity::from_pem(cert, key)),
        (None, None) => {}
        _ => {
            return Err(StoreError::Unavailable {
                url: shown.to_string(),
                detail: "cert= and key= go together (the client certificate and its key)".into(),
            });
        }
    }
    if let Some(domain) = params.get("domain") {
        tls = tls.domain_name(domain.clone());
    }
    Ok(tls)
}

/// How long a call is tried again on members that answer.
const RETRY_FOR: Duration = Duration::from_secs(5);

/// Whether an error came before the request was sent (a member down: its
/// connection refused), so that sending it again is safe. An error after
/// sending ("leader changed", a timeout) may come with the write applied:
/// it is the caller's, who can read the key to tell (a compare-and-set sent
/// again would find its own write and report a conflict).
fn transient(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => {
            s.code() == tonic::Code::Unavailable && s.message().contains("connect")
        }
        etcd_client::Error::TransportError(_) => true,
        _ => false,
    }
}

impl Store for EtcdStore {
    async fn put(&self, key: &str, value: &[u8], ttl: Option<Duration>) -> Result<u64, StoreError> {
        let options = self.lease_for(ttl).await?;
        let r = self.call(|mut c| {
            let options = options.clone();
            async move { c.put(key, value, options).await }
        });
        Ok(token(r.await?.header().map_or(0, |h| h.revision())))
    }

    async fn refresh(&self, key: &str, ttl: Duration) -> Result<bool, StoreError> {
        let r = self.call(|mut c| async move { c.get(key, None).await }).await?;
        let Some(kv) = r.kvs().first() else { return Ok(false) };
        if kv.lease() == 0 {
            // Written without a TTL: put it under a lease now.
            let options = self.lease_for(Some(ttl)).await?;
            let (revision, value) = (kv.mod_revision(), kv.value().to_vec());
            let done = self.call(|mut c| {
                let txn = Txn::new()
                    .when([Compare::mod_revision(key, CompareOp::Equal, revision)])
                    .and_then([TxnOp::put(key, value.clone(), options.clone())]);
                async move { c.txn(txn).await }
            });
            return Ok(done.await?.succeeded());
        }
        let lease = kv.lease();
        let answer = self
            .call(|mut c| async move {
                let (mut keeper, mut answers) = c.lease_keep_alive(lease).await?;
                keeper.keep_alive().await?;
                answers.message().await
            })
            .await?;
        // A lease that already ended answers with a TTL of 0.
        Ok(answer.is_some_and(|a| a.ttl() > 0))
    }

    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        let r = self.call(|mut c| async move { c.get(key, None).await }).await?;
        Ok(r.kvs().first().map(|kv| Entry {
            key: key.to_string(),
            value: kv.value().to_vec(),
            token: token(kv.mod_revision()),
        }))
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let r = self.call(|mut c| async move { c.delete(key, None).await }).await?;
        Ok(r.deleted() > 0)
    }

    async fn delete_if(&self, key: &str, token: u64) -> Result<bool, StoreError> {
        let r = self.call(|mut c| {
            let txn = Txn::new()
                .when([Compare::mod_revision(key, CompareOp::Equal, token as i64)])
                .and_then([TxnOp::delete(key, None::<DeleteOptions>)]);
            async move { c.txn(txn).await }
        });
        Ok(r.await?.succeeded())
    }

    async fn list(&self, prefix: &str) -> Result<Vec<Entry>, StoreError> {
        let r = self.call(|mut c| async move { c.get(prefix, Some(GetOptions::new().with_prefix())).await });
        let mut out: Vec<Entry> = r
            .await?
            .kvs()
            .iter()
            .filter_map(|kv| {
                Some(Entry {
                    key: kv.key_str().ok()?.to_string(),
                    value: kv.value().to_vec(),
                    token: token(kv.mod_revision()),
                })
            })
            .collect();
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    async fn compare_and_set(
        &self,
        key: &str,
        expected: Option<u64>,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Cas, StoreError> {
        let options = self.lease_for(ttl).await?;
        let r = self
            .call(|mut c| {
                let condition = match expected {
                    // Absent: never created (or deleted since).
                    None => Compare::create_revision(key, CompareOp::Equal, 0),
                    Some(t) => Compare::mod_revision(key, CompareOp::Equal, t as i64),
                };
                let txn = Txn::new()
                    .when([condition])
                    .and_then([TxnOp::put(key, value, options.clone())])
                    .or_else([TxnOp::get(key, None)]);
                async move { c.txn(txn).await }
            })
            .await?;
        if r.succeeded() {
            return Ok(Cas::Written(token(r.header().map_or(0, |h| h.revision()))));
        }
        let current = r.op_responses().into_iter().find_map(|op| match op {
            TxnOpResponse::Get(g) => Some(g.kvs().first().map(|kv| token(kv.mod_revision()))),
            _ => None,
        });
        Ok(Cas::Conflict { current: current.flatten() })
    }
}
