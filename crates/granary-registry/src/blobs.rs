//! Weights in an object store, content-addressed: the file whose sha256 is
//! `h` is the object `<prefix>/blobs/sha256/<h>`, written once and never
//! changed, shared by every revision that holds the same bytes.
//!
//! The store is any `object_store` URL: `file:///dir` (a local disk or a
//! shared POSIX mount), `s3://bucket/prefix`, `gs://bucket/prefix`,
//! `az://container/prefix`. Credentials and endpoints come from the usual
//! `AWS_*`, `GOOGLE_*` and `AZURE_*` environment variables, then from the
//! options given. S3, GCS and Azure stores can presign download URLs
//! (`object_store::signer::Signer`) so that clients fetch weights from the
//! store directly.
//!
//! [`BlobStore::put_file`] hashes a local file, skips the upload when the
//! blob is already stored, and otherwise uploads it (multipart above
//! [`SINGLE_PUT_MAX`]) while hashing again, so that a file that changed
//! between the two passes is refused and never stored under a wrong name.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{StreamExt as _, TryStreamExt as _};
use object_store::path::Path;
use object_store::signer::Signer;
use object_store::{GetOptions, GetRange, ObjectStore, PutPayload, WriteMultipart};
use sha2::{Digest, Sha256};
use tokio::io::AsyncReadExt as _;

use crate::api::is_sha256;
use crate::error::RegistryError;

type Result<T, E = RegistryError> = std::result::Result<T, E>;

/// Files up to this size are uploaded in one request; larger ones in parts.
pub const SINGLE_PUT_MAX: u64 = 16 << 20;
/// Part size of multipart uploads (S3 needs at least 5 MiB).
pub const PART_SIZE: usize = 16 << 20;
/// Parts in flight at once per upload.
const PARTS_IN_FLIGHT: usize = 4;
/// Read buffer of the hashing passes.
const READ_BUF: usize = 1 << 20;

/// Which kind of store a URL named.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    File,
    S3,
    Gcs,
    Azure,
}

impl StoreKind {
    pub fn as_str(self) -> &'static str {
        match self {
            StoreKind::File => "file",
            StoreKind::S3 => "s3",
            StoreKind::Gcs => "gcs",
            StoreKind::Azure => "azure",
        }
    }
}

/// A blob put by [`BlobStore::put_file`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    pub sha256: String,
    pub size: u64,
    /// False when the store already held it (nothing was uploaded).
    pub uploaded: bool,
}

/// A blob in the store, as [`BlobStore::list`] finds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listed {
    pub sha256: String,
    pub size: u64,
    /// When the object was last written, unix seconds.
    pub modified: i64,
}

/// An object being read: its total size, the range sent, and the bytes.
pub struct Reading {
    pub total: u64,
    pub range: Range<u64>,
    pub stream: BoxStream<'static, Result<Bytes, object_store::Error>>,
}

/// The content-addressed blob store.
#[derive(Clone)]
pub struct BlobStore {
    store: Arc<dyn ObjectStore>,
    signer: Option<Arc<dyn Signer>>,
    prefix: Path,
    kind: StoreKind,
    url: String,
}

impl std::fmt::Debug for BlobStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlobStore").field("url", &self.url).field("kind", &self.kind).finish()
    }
}

fn config_err(url: &str, e: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("object store {url:?}: {e}")
}

impl BlobStore {
    /// Opens the store at `url` (creating a `file://` directory when
    /// missing); `options` (`aws_endpoint`, `aws_allow_http`, ...) override
    /// the environment's.
    pub fn open(url: &str, options: &[(String, String)]) -> anyhow::Result<Self> {
        let parsed = url::Url::parse(url).map_err(|e| config_err(url, e))?;
        let prefix = Path::from_url_path(parsed.path().trim_matches('/')).map_err(|e| config_err(url, e))?;
        let (store, signer, kind, prefix): (Arc<dyn ObjectStore>, Option<Arc<dyn Signer>>, _, _) = match parsed.scheme()
        {
            "file" => {
                let dir = parsed.to_file_path().map_err(|_| config_err(url, "not a local path"))?;
                std::fs::create_dir_all(&dir)
                    .map_err(|e| config_err(url, format!("creating {}: {e}", dir.display())))?;
                let fs = object_store::local::LocalFileSystem::new_with_prefix(&dir)
                    .map_err(|e| config_err(url, e))?
                    .with_automatic_cleanup(true);
                (Arc::new(fs), None, StoreKind::File, Path::default())
            }
            "s3" | "s3a" => {
                let mut b = object_store::aws::AmazonS3Builder::from_env().with_url(url);
                for (k, v) in options {
                    b = b.with_config(k.to_ascii_lowercase().parse().map_err(|e| config_err(url, e))?, v);
                }
                let s = Arc::new(b.build().map_err(|e| config_err(url, e))?);
                (s.clone(), Some(s as Arc<dyn Signer>), StoreKind::S3, prefix)
            }
            "gs" => {
                let mut b = object_store::gcp::GoogleCloudStorageBuilder::from_env().with_url(url);
                for (k, v) in options {
                    b = b.with_config(k.to_ascii_lowercase().parse().map_err(|e| config_err(url, e))?, v);
                }
                let s = Arc::new(b.build().map_err(|e| config_err(url, e))?);
                (s.clone(), Some(s as Arc<dyn Signer>), StoreKind::Gcs, prefix)
            }
            "az" | "azure" | "abfs" | "abfss" => {
                let mut b = object_store::azure::MicrosoftAzureBuilder::from_env().with_url(url);
                for (k, v) in options {
                    b = b.with_config(k.to_ascii_lowercase().parse().map_err(|e| config_err(url, e))?, v);
                }
                let s = Arc::new(b.build().map_err(|e| config_err(url, e))?);
                (s.clone(), Some(s as Arc<dyn Signer>), StoreKind::Azure, prefix)
            }
            other => {
                return Err(config_err(url, format!("unsupported scheme {other:?} (file://, s3://, gs:// or az://)")))
            }
        };
        Ok(BlobStore { store, signer, prefix, kind, url: url.to_string() })
    }

    /// The store's URL as given.
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn kind(&self) -> StoreKind {
        self.kind
    }

    /// The object key of the blob `sha256`: `<prefix>/blobs/sha256/<sha256>`.
    pub fn key(&self, sha256: &str) -> Path {
        self.blobs_dir().child(sha256)
    }

    fn blobs_dir(&self) -> Path {
        self.prefix.child("blobs").child("sha256")
    }

    /// The stored size of a blob, or `None` when it is not there.
    pub async fn head(&self, sha256: &str) -> Result<Option<u64>> {
        match self.store.head(&self.key(sha256)).await {
            Ok(meta) => Ok(Some(meta.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(RegistryError::store("head", e)),
        }
    }

    /// Stores a local file as a blob (see the module's notes); `progress`
    /// is told the bytes read so far, over both passes.
    pub async fn put_file(&self, local: &std::path::Path, progress: &(dyn Fn(u64) + Send + Sync)) -> Result<Stored> {
        let (sha256, size) = hash_file(local, progress).await?;
        if self.head(&sha256).await? == Some(size) {
            return Ok(Stored { sha256, size, uploaded: false });
        }
        let key = self.key(&sha256);
        let changed = || {
            RegistryError::invalid(
                "source",
                "source_changed",
                format!("{} changed while it was being imported; try again", local.display()),
            )
        };
        if size <= SINGLE_PUT_MAX {
            let bytes = tokio::fs::read(local).await.map_err(|e| io_err(local, e))?;
            if bytes.len() as u64 != size || hex::encode(Sha256::digest(&bytes)) != sha256 {
                return Err(changed());
            }
            progress(2 * size);
            self.store.put(&key, PutPayload::from(bytes)).await.map_err(|e| RegistryError::store("put", e))?;
        } else {
            let upload = self.store.put_multipart(&key).await.map_err(|e| RegistryError::store("put", e))?;
            let mut w = WriteMultipart::new_with_chunk_size(upload, PART_SIZE);
            let sent = async {
                let mut f = tokio::fs::File::open(local).await.map_err(|e| io_err(local, e))?;
                let mut buf = vec![0u8; READ_BUF];
                let mut hasher = Sha256::new();
                let mut n = 0u64;
                loop {
                    let k = f.read(&mut buf).await.map_err(|e| io_err(local, e))?;
                    if k == 0 {
                        break;
                    }
                    hasher.update(&buf[..k]);
                    n += k as u64;
                    w.wait_for_capacity(PARTS_IN_FLIGHT).await.map_err(|e| RegistryError::store("put part", e))?;
                    w.write(&buf[..k]);
                    progress(size + n);
                }
                Ok::<_, RegistryError>((hex::encode(hasher.finalize()), n))
            }
            .await;
            match sent {
                Ok((h, n)) if h == sha256 && n == size => {
                    w.finish().await.map_err(|e| RegistryError::store("complete upload", e))?;
                }
                Ok(_) => {
                    let _ = w.abort().await;
                    return Err(changed());
                }
                Err(e) => {
                    let _ = w.abort().await;
                    return Err(e);
                }
            }
        }
        Ok(Stored { sha256, size, uploaded: true })
    }

    /// Reads a blob, whole or `range` (end exclusive, clamped to the size).
    pub async fn get(&self, sha256: &str, range: Option<Range<u64>>) -> Result<Reading> {
        let opts = GetOptions { range: range.map(GetRange::Bounded), ..Default::default() };
        match self.store.get_opts(&self.key(sha256), opts).await {
            Ok(r) => {
                let total = r.meta.size;
                let range = r.range.clone();
                Ok(Reading { total, range, stream: r.into_stream() })
            }
            Err(object_store::Error::NotFound { .. }) => {
                Err(RegistryError::not_found("blob_missing", format!("The blob {sha256} is missing from the store.")))
            }
            Err(e) => Err(RegistryError::store("get", e)),
        }
    }

    /// Deletes a blob; deleting a missing one is not an error.
    pub async fn delete(&self, sha256: &str) -> Result<()> {
        match self.store.delete(&self.key(sha256)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(RegistryError::store("delete", e)),
        }
    }

    /// Every blob in the store (objects under `blobs/sha256/` whose name is
    /// a sha256; anything else there is left alone).
    pub async fn list(&self) -> Result<Vec<Listed>> {
        let dir = self.blobs_dir();
        let metas: Vec<_> =
            self.store.list(Some(&dir)).try_collect().await.map_err(|e| RegistryError::store("list", e))?;
        Ok(metas
            .into_iter()
            .filter_map(|m| {
                let name = m.location.filename()?;
                is_sha256(name).then(|| Listed {
                    sha256: name.to_string(),
                    size: m.size,
                    modified: m.last_modified.timestamp(),
                })
            })
            .collect())
    }

    /// A presigned GET URL of the blob, valid for `ttl`; `None` for stores
    /// that cannot sign (`file://`).
    pub async fn presign(&self, sha256: &str, ttl: Duration) -> Result<Option<url::Url>> {
        let Some(signer) = &self.signer else { return Ok(None) };
        signer
            .signed_url(axum::http::Method::GET, &self.key(sha256), ttl)
            .await
            .map(Some)
            .map_err(|e| RegistryError::store("presign", e))
    }
}

fn io_err(path: &std::path::Path, e: std::io::Error) -> RegistryError {
    RegistryError::Internal(format!("reading {}: {e}", path.display()))
}

/// sha256 (hex) and size of a local file.
pub async fn hash_file(path: &std::path::Path, progress: &(dyn Fn(u64) + Send + Sync)) -> Result<(String, u64)> {
    let mut f = tokio::fs::File::open(path).await.map_err(|e| io_err(path, e))?;
    let mut buf = vec![0u8; READ_BUF];
    let mut hasher = Sha256::new();
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf).await.map_err(|e| io_err(path, e))?;
        if k == 0 {
            break;
        }
        hasher.update(&buf[..k]);
        n += k as u64;
        progress(n);
    }
    Ok((hex::encode(hasher.finalize()), n))
}

/// Wraps a blob's byte stream so that it is verified as it is sent: the
/// last chunk is held back until the whole has been hashed, and if the
/// sha256 (or the length) is not `expected`, the stream ends in an error
/// instead, so the receiver sees a broken transfer, never a clean one of
/// wrong bytes. `on_mismatch` is called once on a mismatch.
pub fn verifying_stream(
    mut inner: BoxStream<'static, Result<Bytes, object_store::Error>>,
    expected_sha256: String,
    expected_len: u64,
    on_mismatch: impl FnOnce(String) + Send + 'static,
) -> BoxStream<'static, Result<Bytes, std::io::Error>> {
    async_stream::try_stream! {
        let mut hasher = Sha256::new();
        let mut held: Option<Bytes> = None;
        let mut n = 0u64;
        while let Some(chunk) = inner.next().await {
            let chunk = chunk.map_err(std::io::Error::other)?;
            hasher.update(&chunk);
            n += chunk.len() as u64;
            if let Some(prev) = held.replace(chunk) {
                yield prev;
            }
        }
        let actual = hex::encode(hasher.finalize());
        if actual != expected_sha256 || n != expected_len {
            let why = format!(
                "stored blob {expected_sha256} is corrupt: {n} bytes hashing to {actual} (expected {expected_len} bytes)"
            );
            on_mismatch(why.clone());
            Err(std::io::Error::other(why))?;
        }
        if let Some(last) = held {
            yield last;
        }
    }
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_store(dir: &std::path::Path) -> BlobStore {
        BlobStore::open(url::Url::from_directory_path(dir).unwrap().as_str(), &[]).unwrap()
    }

    #[tokio::test]
    async fn puts_files_by_content_and_skips_what_is_stored() {
        let dir = tempfile::tempdir().unwrap();
        let store = file_store(&dir.path().join("store"));
        let src = dir.path().join("m.gguf");
        std::fs::write(&src, b"hello weights").unwrap();
        let s = store.put_file(&src, &|_| {}).await.unwrap();
        assert_eq!(s.sha256, hex::encode(Sha256::digest(b"hello weights")));
        assert!(s.uploaded);
        let on_disk = dir.path().join("store/blobs/sha256").join(&s.sha256);
        assert_eq!(std::fs::read(&on_disk).unwrap(), b"hello weights");
        let again = store.put_file(&src, &|_| {}).await.unwrap();
        assert!(!again.uploaded);
        assert_eq!(store.head(&s.sha256).await.unwrap(), Some(13));
        let r = store.get(&s.sha256, Some(6..9)).await.unwrap();
        assert_eq!((r.total, r.range.clone()), (13, 6..9));
        let got: Vec<Bytes> = r.stream.try_collect().await.unwrap();
        assert_eq!(got.concat(), b"wei");
        assert_eq!(store.list().await.unwrap().len(), 1);
        store.delete(&s.sha256).await.unwrap();
        store.delete(&s.sha256).await.unwrap();
        assert_eq!(store.head(&s.sha256).await.unwrap(), None);
        assert!(matches!(store.get(&s.sha256, None).await, Err(RegistryError::NotFound { .. })));
        assert!(store.presign(&s.sha256, Duration::from_secs(60)).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn large_files_go_up_in_parts() {
        let dir = tempfile::tempdir().unwrap();
        let store = file_store(&dir.path().join("store"));
        let src = dir.path().join("big.safetensors");
        let data: Vec<u8> = (0..(SINGLE_PUT_MAX as usize + PART_SIZE + 12345)).map(|i| (i * 31 % 251) as u8).collect();
        std::fs::write(&src, &data).unwrap();
        let seen = std::sync::atomic::AtomicU64::new(0);
        let s = store
            .put_file(&src, &|n| {
                seen.fetch_max(n, std::sync::atomic::Ordering::Relaxed);
            })
            .await
            .unwrap();
        assert_eq!(s.size, data.len() as u64);
        assert_eq!(seen.into_inner(), 2 * data.len() as u64, "progress covers both passes");
        let r = store.get(&s.sha256, None).await.unwrap();
        let got: Vec<Bytes> = r.stream.try_collect().await.unwrap();
        assert_eq!(hex::encode(Sha256::digest(got.concat())), s.sha256);
    }

    #[tokio::test]
    async fn the_verifying_stream_withholds_the_end_of_corrupt_bytes() {
        let chunks =
            || futures::stream::iter(vec![Ok(Bytes::from_static(b"abc")), Ok(Bytes::from_static(b"def"))]).boxed();
        let good = hex::encode(Sha256::digest(b"abcdef"));
        let out: Vec<Bytes> =
            verifying_stream(chunks(), good.clone(), 6, |_| panic!("no mismatch")).try_collect().await.unwrap();
        assert_eq!(out.concat(), b"abcdef");

        let flagged = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let f = flagged.clone();
        let mut s =
            verifying_stream(chunks(), "0".repeat(64), 6, move |_| f.store(true, std::sync::atomic::Ordering::SeqCst));
        let mut sent = Vec::new();
        let mut failed = None;
        while let Some(item) = s.next().await {
            match item {
                Ok(b) => sent.extend_from_slice(&b),
                Err(e) => failed = Some(e.to_string()),
            }
        }
        assert_eq!(sent, b"abc", "the last chunk must not be sent");
        assert!(failed.unwrap().contains("corrupt"));
        assert!(flagged.load(std::sync::atomic::Ordering::SeqCst));
    }

    #[test]
    fn urls_pick_the_store() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(file_store(dir.path()).kind(), StoreKind::File);
        let s3 = BlobStore::open(
            "s3://bucket/some/prefix",
            &[
                ("aws_region".into(), "us-east-1".into()),
                ("aws_access_key_id".into(), "a".into()),
                ("aws_secret_access_key".into(), "b".into()),
            ],
        )
        .unwrap();
        assert_eq!(s3.kind(), StoreKind::S3);
        assert_eq!(s3.key(&"a".repeat(64)).as_ref(), format!("some/prefix/blobs/sha256/{}", "a".repeat(64)));
        assert!(BlobStore::open("ftp://x/y", &[]).is_err());
        assert!(BlobStore::open("s3://bucket", &[("no_such_option".into(), "1".into())]).is_err());
    }
}
