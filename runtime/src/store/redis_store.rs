//! The Redis store. Each key is a hash `{v: value, t: token}`; writes go
//! through Lua scripts so the token and the value change together. Tokens
//! come from one sequence for the whole store (the key [`SEQUENCE`], never
//! expiring), so a key written again after it expired or was deleted gets a
//! token higher than any it had: a fencing token stays a fencing token. The
//! connection manager reconnects with exponential backoff after a Redis
//! restart; while Redis is away, operations fail within the response timeout
//! with an error naming the server.

use super::{Cas, Entry, Store, StoreError};
use redis::{AsyncCommands, Client, Script, aio::ConnectionManager, aio::ConnectionManagerConfig};
use std::{sync::Arc, time::Duration};

/// The store's token sequence.
pub const SEQUENCE: &str = "edl-token-sequence";

const PUT: &str = r"
local t = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], 'v', ARGV[1], 't', t)
if tonumber(ARGV[2]) > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) else redis.call('PERSIST', KEYS[1]) end
return t
";

const CAS: &str = r"
local cur = redis.call('HGET', KEYS[1], 't')
if (cur == false and ARGV[1] ~= '') or (cur ~= false and cur ~= ARGV[1]) then
  if cur == false then return {0, -1} end
  return {0, tonumber(cur)}
end
local t = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], 'v', ARGV[2], 't', t)
if tonumber(ARGV[3]) > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[3]) else redis.call('PERSIST', KEYS[1]) end
return {1, t}
";

const DELETE_IF: &str = r"
if redis.call('HGET', KEYS[1], 't') == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
";

/// A store in Redis.
#[derive(Clone)]
pub struct RedisStore {
    url: Arc<str>,
    conn: ConnectionManager,
    put: Arc<Script>,
    cas: Arc<Script>,
    delete_if: Arc<Script>,
}

fn ttl_ms(ttl: Option<Duration>) -> u64 {
    ttl.map_or(0, |t| (t.as_millis() as u64).max(1))
}

/// A `rediss://` URL's `?ca=FILE`: the URL without it, and the CA (PEM)
/// read from the file (an error names it). None: no CA was given.
fn tls_root(url: &str, shown: &str) -> Result<Option<(String, Vec<u8>)>, StoreError> {
    let Some((base, query)) = url.split_once('?') else { return Ok(None) };
    if !url.starts_with("rediss://") {
        if query.split('&').any(|p| p.starts_with("ca=")) {
            return Err(StoreError::Unavailable {
                url: shown.to_string(),
                detail: "?ca= over redis:// would be ignored: use rediss://".into(),
            });
        }
        return Ok(None);
    }
    let (mut ca, mut rest) = (None, Vec::new());
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.strip_prefix("ca=") {
            Some(path) => ca = Some(path.to_string()),
            None => rest.push(pair),
        }
    }
    let Some(path) = ca else { return Ok(None) };
    let pem = std::fs::read(&path)
        .map_err(|e| StoreError::Unavailable { url: shown.to_string(), detail: format!("ca={path}: {e}") })?;
    let url = if rest.is_empty() { base.to_string() } else { format!("{base}?{}", rest.join("&")) };
    Ok(Some((url, pem)))
}

/// Escapes a prefix for a SCAN MATCH pattern.
fn glob_escape(prefix: &str) -> String {
    let mut out = String::with_capacity(prefix.len() + 1);
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('*');
    out
}

impl RedisStore {
    /// A store at `url` (`redis://host:port[/db]`, or `rediss://` over TLS,
    /// checked against the system's roots or `?ca=FILE`); connects on first
    /// use. Must be called inside a Tokio runtime.
    pub fn open(url: &str) -> Result<Self, StoreError> {
        let shown = super::redact(url);
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(StoreError::Unavailable {
                url: shown,
                detail: "opened outside a Tokio runtime (the connection lives on one)".into(),
            });
        }
        let client = match tls_root(url, &shown)? {
            Some((url, ca)) => {
                let certs = redis::TlsCertificates { client_tls: None, root_cert: Some(ca) };
                Client::build_with_tls(url.as_str(), certs).map_err(|_| StoreError::BadUrl(shown.clone()))?
            }
            None => Client::open(url).map_err(|_| StoreError::BadUrl(shown.clone()))?,
        };
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_response_timeout(Some(Duration::from_secs(2)))
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_secs(1))
            .set_number_of_retries(6);
        let conn = ConnectionManager::new_lazy_with_config(client, config)
            .map_err(|e| StoreError::Unavailable { url: url.to_string(), detail: e.to_string() })?;
        Ok(RedisStore {
            url: super::redact(url).into(),
            conn,
            put: Arc::new(Script::new(PUT)),
            cas: Arc::new(Script::new(CAS)),
            delete_if: Arc::new(Script::new(DELETE_IF)),
        })
    }

    fn err(&self, e: redis::RedisError) -> StoreError {
        StoreError::Unavailable { url: self.url.to_string(), detail: e.to_string() }
    }
}

impl Store for RedisStore {
    async fn put(&self, key: &str, value: &[u8], ttl: Option<Duration>) -> Result<u64, StoreError> {
        let mut c = self.conn.clone();
        self.put
            .key(key)
            .key(SEQUENCE)
            .arg(value)
            .arg(ttl_ms(ttl))
            .invoke_async(&mut c)
            .await
            .map_err(|e| self.err(e))
    }

    async fn refresh(&self, key: &str, ttl: Duration) -> Result<bool, StoreError> {
        let mut c = self.conn.clone();
        c.pexpire(key, ttl_ms(Some(ttl)) as i64).await.map_err(|e| self.err(e))
    }

    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        let mut c = self.conn.clone();
        let (v, t): (Option<Vec<u8>>, Option<u64>) = redis::cmd("HMGET")
            .arg(key)
            .arg("v")
            .arg("t")
            .query_async(&mut c)
            .await
            .map_err(|e| self.err(e))?;
        Ok(match (v, t) {
            (Some(value), Some(token)) => Some(Entry { key: key.to_string(), value, token }),
            _ => None,
        })
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let mut c = self.conn.clone();
        let n: u64 = c.del(key).await.map_err(|e| self.err(e))?;
        Ok(n > 0)
    }

    async fn delete_if(&self, key: &str, token: u64) -> Result<bool, StoreError> {
        let mut c = self.conn.clone();
        let n: u64 = self
            .delete_if
            .key(key)
            .arg(token.to_string())
            .invoke_async(&mut c)
            .await
            .map_err(|e| self.err(e))?;
        Ok(n > 0)
    }

    async fn list(&self, prefix: &str) -> Result<Vec<Entry>, StoreError> {
        let mut c = self.conn.clone();
        let pattern = glob_escape(prefix);
        let mut keys: Vec<String> = Vec::new();
        let mut cursor: u64 = 0;
        loop {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut c)
                .await
                .map_err(|e| self.err(e))?;
            keys.extend(batch);
            if next == 0 {
                break;
            }
            cursor = next;
        }
        keys.sort();
        keys.dedup();
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for k in &keys {
            pipe.cmd("HMGET").arg(k).arg("v").arg("t");
        }
        let rows: Vec<(Option<Vec<u8>>, Option<u64>)> =
            pipe.query_async(&mut c).await.map_err(|e| self.err(e))?;
        Ok(keys
            .into_iter()
            .zip(rows)
            .filter_map(|(key, row)| match row {
                (Some(value), Some(token)) => Some(Entry { key, value, token }),
                _ => None, // expired between SCAN and HMGET
            })
            .collect())
    }

    async fn compare_and_set(
        &self,
        key: &str,
        expected: Option<u64>,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Cas, StoreError> {
        let mut c = self.conn.clone();
        let want = expected.map(|t| t.to_string()).unwrap_or_default();
        let reply: Vec<i64> = self
            .cas
            .key(key)
            .key(SEQUENCE)
            .arg(want)
            .arg(value)
            .arg(ttl_ms(ttl))
            .invoke_async(&mut c)
            .await
            .map_err(|e| self.err(e))?;
        match reply.as_slice() {
            [1, t] => Ok(Cas::Written(*t as u64)),
            [0, -1] => Ok(Cas::Conflict { current: None }),
            [0, t] => Ok(Cas::Conflict { current: Some(*t as u64) }),
            other => Err(StoreError::Protocol {
                url: self.url.to_string(),
                op: "compare-and-set",
                detail: format!("{other:?}"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn prefixes_are_escaped_for_scan() {
        assert_eq!(super::glob_escape("edl/a*b?[x]"), "edl/a\\*b\\?\\[x\\]*");
    }
}
