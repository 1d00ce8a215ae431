//! A directory in object storage (`s3://bucket/prefix`, `gs://bucket/prefix`,
//! `az://container/prefix`), through the `object_store` crate, for code that
//! is not async: each call runs on a small runtime of its own.
//!
//! Credentials and endpoints come from the environment the cloud's own
//! tools read (`AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT`, `AWS_ALLOW_HTTP`,
//! `GOOGLE_SERVICE_ACCOUNT`, `AZURE_STORAGE_ACCOUNT_NAME`, ...). A single
//! object is written whole or not at all; callers that write several make
//! the last one the commit marker.

use object_store::{
    ObjectStore, ObjectStoreExt, aws::AmazonS3Builder, azure::MicrosoftAzureBuilder,
    gcp::GoogleCloudStorageBuilder, memory::InMemory, path::Path as ObjPath,
};
use std::sync::Arc;
use tokio_stream::StreamExt;

/// Objects from this size on are uploaded in parts.
pub const MULTIPART_FROM: usize = 64 << 20;
/// The size of each part of a multipart upload (S3 wants at least 5 MiB).
const PART_BYTES: usize = 16 << 20;

/// Why a directory in object storage could not be opened or used; each
/// message starts with the URL of the directory or object concerned.
#[derive(Debug, thiserror::Error)]
pub enum ObjectStoreError {
    #[error("{url}: not a URL: {source}")]
    NotAUrl { url: String, source: url::ParseError },
    #[error("{url}: {scheme}:// is not object storage this runtime knows")]
    UnknownScheme { url: String, scheme: String },
    /// The store's client could not be configured from the URL and the environment.
    #[error("{url}: {source}")]
    Config { url: String, source: object_store::Error },
    #[error("{url}: {source}")]
    Prefix { url: String, source: object_store::path::Error },
    #[error("{url}: cannot start the I/O runtime: {source}")]
    Runtime { url: String, source: std::io::Error },
    /// A read, write or removal of the object at `url` failed.
    #[error("{url}: {source}")]
    Object { url: String, source: object_store::Error },
    #[error("{url}: listing: {source}")]
    Listing { url: String, source: object_store::Error },
}

/// The version of an object as read, for a conditional write.
#[derive(Clone, Debug)]
pub struct Version(object_store::UpdateVersion);

/// The URL schemes that name object storage shared between hosts.
const SCHEMES: [&str; 7] = ["s3", "s3a", "gs", "az", "azure", "abfs", "abfss"];

/// A prefix in an object store, used like a directory.
#[derive(Clone)]
pub struct ObjectDir {
    store: Arc<dyn ObjectStore>,
    prefix: ObjPath,
    /// The URL it was opened with, without a trailing slash.
    url: String,
    rt: Arc<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for ObjectDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ObjectDir({})", self.url)
    }
}

/// Whether `location` names object storage rather than a local path.
pub fn is_url(location: &str) -> bool {
    location.split_once("://").is_some_and(|(scheme, _)| SCHEMES.contains(&scheme))
}

impl ObjectDir {
    /// Opens `url`; the store is not contacted yet. `memory:///prefix` is a
    /// store of this process alone (for tests).
    pub fn open(url: &str) -> Result<Self, ObjectStoreError> {
        let parsed =
            url::Url::parse(url).map_err(|source| ObjectStoreError::NotAUrl { url: url.into(), source })?;
        let config = |source| ObjectStoreError::Config { url: url.into(), source };
        let store: Arc<dyn ObjectStore> = match parsed.scheme() {
            "s3" | "s3a" => Arc::new(AmazonS3Builder::from_env().with_url(url).build().map_err(config)?),
            "gs" => Arc::new(GoogleCloudStorageBuilder::from_env().with_url(url).build().map_err(config)?),
            "az" | "azure" | "abfs" | "abfss" => {
                Arc::new(MicrosoftAzureBuilder::from_env().with_url(url).build().map_err(config)?)
            }
            "memory" => Arc::new(InMemory::new()),
            other => {
                return Err(ObjectStoreError::UnknownScheme { url: url.into(), scheme: other.into() });
            }
        };
        let prefix = ObjPath::parse(parsed.path().trim_matches('/'))
            .map_err(|source| ObjectStoreError::Prefix { url: url.into(), source })?;
        Self::with_store(store, prefix, url.trim_end_matches('/'))
    }

    /// A directory in a store made elsewhere (tests use an in-memory one).
    pub fn with_store(
        store: Arc<dyn ObjectStore>,
        prefix: ObjPath,
        url: &str,
    ) -> Result<Self, ObjectStoreError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| ObjectStoreError::Runtime { url: url.into(), source })?;
        Ok(ObjectDir { store, prefix, url: url.to_string(), rt: Arc::new(rt) })
    }

    /// The URL of `rel` (a `/`-separated name under this directory).
    pub fn url_of(&self, rel: &str) -> String {
        if rel.is_empty() { self.url.clone() } else { format!("{}/{rel}", self.url) }
    }

    /// `rel` back from a URL made by [`ObjectDir::url_of`].
    pub fn rel_of<'a>(&self, url: &'a str) -> Option<&'a str> {
        url.strip_prefix(&self.url).map(|r| r.trim_start_matches('/'))
    }

    /// The error of a call on the object `rel`.
    fn failed(&self, rel: &str) -> impl FnOnce(object_store::Error) -> ObjectStoreError {
        let url = self.url_of(rel);
        move |source| ObjectStoreError::Object { url, source }
    }

    fn path(&self, rel: &str) -> ObjPath {
        rel.split('/').filter(|p| !p.is_empty()).fold(self.prefix.clone(), |p, part| p.join(part))
    }

    /// Runs `f` to completion: on this directory's runtime, or, when called
    /// from async code, on a thread of its own (a runtime cannot block
    /// inside another).
    fn block<T: Send>(&self, f: impl std::future::Future<Output = T> + Send) -> T {
        if tokio::runtime::Handle::try_current().is_ok() {
            std::thread::scope(|s| {
                s.spawn(|| self.rt.block_on(f)).join().expect("object storage call panicked")
            })
        } else {
            self.rt.block_on(f)
        }
    }

    /// Writes `bytes` as `rel` (whole or not at all). Above
    /// [`MULTIPART_FROM`] bytes the object goes up in parts (a single PUT
    /// holds at most 5 GiB on S3), and appears only when every part is there.
    pub fn put(&self, rel: &str, bytes: Vec<u8>) -> Result<(), ObjectStoreError> {
        self.put_in_parts_from(rel, bytes, MULTIPART_FROM)
    }

    /// As [`Self::put`], in parts from `threshold` bytes on.
    pub fn put_in_parts_from(
        &self,
        rel: &str,
        bytes: Vec<u8>,
        threshold: usize,
    ) -> Result<(), ObjectStoreError> {
        let path = self.path(rel);
        let done = if bytes.len() < threshold {
            self.block(async { self.store.put(&path, bytes.into()).await.map(drop) })
        } else {
            self.block(async {
                let upload = self.store.put_multipart(&path).await?;
                let mut parts = object_store::WriteMultipart::new_with_chunk_size(upload, PART_BYTES);
                parts.write(&bytes);
                parts.finish().await.map(drop)
            })
        };
        done.map_err(self.failed(rel))
    }

    /// Reads `rel` with its version (an ETag); None when there is no such object.
    pub fn get_versioned(&self, rel: &str) -> Result<Option<(Vec<u8>, Version)>, ObjectStoreError> {
        let path = self.path(rel);
        self.block(async {
            match self.store.get(&path).await {
                Ok(r) => {
                    let version = Version(object_store::UpdateVersion {
                        e_tag: r.meta.e_tag.clone(),
                        version: r.meta.version.clone(),
                    });
                    r.bytes().await.map(|b| Some((b.to_vec(), version)))
                }
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(e),
            }
        })
        .map_err(self.failed(rel))
    }

    /// Writes `rel` only if it is still at `seen` (None: only if absent).
    /// Ok(false): someone wrote it meanwhile. A store without conditional
    /// updates (S3 without its conditional-put option) writes it anyway,
    /// which the callers' rules allow for.
    pub fn put_if(
        &self,
        rel: &str,
        bytes: Vec<u8>,
        seen: Option<&Version>,
    ) -> Result<bool, ObjectStoreError> {
        let path = self.path(rel);
        let mode = match seen {
            None => object_store::PutMode::Create,
            Some(v) => object_store::PutMode::Update(v.0.clone()),
        };
        let put = self.block(async {
            let opts = object_store::PutOptions { mode, ..Default::default() };
            match self.store.put_opts(&path, bytes.clone().into(), opts).await {
                Ok(_) => Ok(true),
                Err(object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. }) => {
                    Ok(false)
                }
                Err(object_store::Error::NotImplemented { .. }) => {
                    static SAID: std::sync::Once = std::sync::Once::new();
                    SAID.call_once(|| {
                        tracing::warn!(
                            "{}: this object store has no conditional writes (for S3, set \
                             AWS_CONDITIONAL_PUT=etag); fence and checkpoint switches are written \
                             unconditionally, and only the fence's rules on reading protect them",
                            self.url
                        )
                    });
                    self.store.put(&path, bytes.into()).await.map(|_| true)
                }
                Err(e) => Err(e),
            }
        });
        put.map_err(self.failed(rel))
    }

    /// Reads `rel`; None when there is no such object.
    pub fn get(&self, rel: &str) -> Result<Option<Vec<u8>>, ObjectStoreError> {
        let path = self.path(rel);
        self.block(async {
            match self.store.get(&path).await {
                Ok(r) => r.bytes().await.map(|b| Some(b.to_vec())),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(e),
            }
        })
        .map_err(self.failed(rel))
    }

    /// Removes `rel` (absent already is fine).
    pub fn delete(&self, rel: &str) -> Result<(), ObjectStoreError> {
        let path = self.path(rel);
        self.block(async {
            match self.store.delete(&path).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                Err(e) => Err(e),
            }
        })
        .map_err(self.failed(rel))
    }

    /// The names of the "directories" right under this one.
    pub fn dirs(&self) -> Result<Vec<String>, ObjectStoreError> {
        let listed = self.block(async { self.store.list_with_delimiter(Some(&self.prefix)).await });
        let listed = listed.map_err(|source| ObjectStoreError::Listing { url: self.url.clone(), source })?;
        Ok(listed.common_prefixes.iter().filter_map(|p| p.filename().map(str::to_string)).collect())
    }

    /// Removes every object under `rel/`.
    pub fn delete_dir(&self, rel: &str) -> Result<(), ObjectStoreError> {
        let dir = self.path(rel);
        self.block(async {
            let mut names = Vec::new();
            let mut listing = self.store.list(Some(&dir));
            while let Some(meta) = listing.next().await {
                names.push(meta?.location);
            }
            for name in names {
                match self.store.delete(&name).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        })
        .map_err(self.failed(rel))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_in_object_storage_holds_lists_and_drops_objects() {
        assert!(is_url("s3://bucket/ckpt") && is_url("gs://b/p") && is_url("az://c/p"));
        assert!(
            !is_url("/data/ckpt") && !is_url("ckpt") && !is_url("file:///data") && !is_url("memory:///x")
        );
        let d = ObjectDir::open("memory:///jobs/mnist").unwrap();
        assert_eq!(d.url_of("step-1/manifest.json"), "memory:///jobs/mnist/step-1/manifest.json");
        assert_eq!(d.rel_of("memory:///jobs/mnist/step-1"), Some("step-1"));
        assert_eq!(d.get("nothing").unwrap(), None);
        d.put("step-1/a", b"one".to_vec()).unwrap();
        d.put("step-1/b", b"two".to_vec()).unwrap();
        d.put("step-2/a", b"three".to_vec()).unwrap();
        d.put("marker", b"m".to_vec()).unwrap();
        assert_eq!(d.get("step-1/b").unwrap().as_deref(), Some(&b"two"[..]));
        let mut dirs = d.dirs().unwrap();
        dirs.sort();
        assert_eq!(dirs, ["step-1", "step-2"]);
        d.delete_dir("step-1").unwrap();
        assert_eq!(d.dirs().unwrap(), ["step-2"]);
        d.delete("marker").unwrap();
        d.delete("marker").unwrap();
        assert_eq!(d.get("marker").unwrap(), None);
        // From async code too (a thread of its own runs the call).
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        assert_eq!(rt.block_on(async { d.get("step-2/a").unwrap() }).as_deref(), Some(&b"three"[..]));
        assert!(ObjectDir::open("ftp://x/y").unwrap_err().to_string().contains("not object storage"));
    }

    #[test]
    fn a_conditional_write_lands_only_on_the_version_it_read() {
        let d = ObjectDir::open("memory:///jobs/x").unwrap();
        assert!(d.put_if("pointer", b"a".to_vec(), None).unwrap(), "created");
        assert!(!d.put_if("pointer", b"b".to_vec(), None).unwrap(), "not created twice");
        let (_, seen) = d.get_versioned("pointer").unwrap().unwrap();
        assert!(d.put_if("pointer", b"c".to_vec(), Some(&seen)).unwrap(), "on the version read");
        assert!(!d.put_if("pointer", b"d".to_vec(), Some(&seen)).unwrap(), "not on a stale one");
        assert_eq!(d.get("pointer").unwrap().unwrap(), b"c");
    }
}
