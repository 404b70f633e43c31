//! The remote tier: entries as objects in a store shared by many nodes (S3,
//! GCS, Azure Blob through `object_store`, or a shared POSIX mount such as
//! Weka, CephFS or NFS through `file://`).
//!
//! This module owns the object layout under the configured URL's prefix:
//!
//! ```text
//! <prefix>/<namespace>/<hex(blake3(key)[..16])>     one [`AtRest`] record per entry
//! ```
//!
//! The record carries the namespace, key and metadata, so the tier keeps no
//! index: other nodes write to the same prefix and any local index would be
//! stale. Consequences, by design:
//!
//! - `contains` and `meta` read only the record's head with one ranged GET
//!   (the same round trip as a HEAD, but it knows the expiry);
//! - `scan` lists the namespace and reads every object's head, then pages
//!   in memory: O(entries) requests per page, fine for admin listing, not a
//!   hot path;
//! - `set_expiry` rewrites the object;
//! - there is no budget (capacity 0: the object store's lifecycle rules
//!   bound it), and `bytes`/`entries` are not tracked (no single writer
//!   knows them); hits, misses, expirations, corrupt drops and errors are.
//!
//! A read that fails verification (checksum, tag, a record of another
//! entry, a format this build cannot read) counts it in `verify_failed`
//! and reports the entry absent to this node, and never deletes the
//! object: the tier is shared, and a node with the wrong key or an older
//! build must not destroy what other nodes can read. Expired objects are
//! deleted (expiry is read from a verified head).
//!
//! TTL sweep: [`Tier::purge_expired`] walks the whole prefix a page at a
//! time (`list_with_offset` from where the previous pass stopped, wrapping
//! around), reads each object's head and deletes the verified, expired ones
//! whose record names the object's own path. The store calls it every
//! few seconds with a small page, which bounds the request rate one node
//! adds to the bucket. An object another node rewrites between the head read
//! and the delete is lost (object stores offer no conditional delete); that
//! costs a cache miss, never a wrong value.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{GetOptions, GetRange, GetResult, GetResultPayload, ObjectStore, PutPayload};

use super::{EventSink, Tier, TierEvents, TierKind};
use crate::config::RemoteConfig;
use crate::error::{Result, WarehouseError};
use crate::tier::at_rest::{value_offset, AlignedBuf, AtRest, Corrupt, Record, RecordHead, MAX_HEAD, PREAMBLE};
use crate::tier::keys::cut_page;
use crate::types::{now_ms, scan_hash, EntryMeta, Evicted, ScanPage, Stored, TierStats};

/// Heads read in parallel by `scan`.
const SCAN_PARALLEL: usize = 16;
/// Heads read in parallel by the TTL sweep.
const SWEEP_PARALLEL: usize = 8;

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    expirations: AtomicU64,
    verify_failed: AtomicU64,
    errors: AtomicU64,
}

/// The remote tier; see the module docs.
pub struct RemoteTier {
    store: Arc<dyn ObjectStore>,
    prefix: Path,
    at_rest: AtRest,
    c: Counters,
    events: TierEvents,
    /// Whether listings come in name order (object stores do; `file://`
    /// lists in directory order).
    sorted_listing: bool,
    /// The last object the TTL sweep examined; `None`: start of the prefix.
    /// The lock also keeps sweeps from overlapping.
    sweep_after: tokio::sync::Mutex<Option<Path>>,
}

fn remote_err(op: &str, path: &Path, e: object_store::Error) -> WarehouseError {
    WarehouseError::Remote(format!("{op} {path}: {e}"))
}

fn object_name(key: &[u8]) -> String {
    hex::encode(&blake3::hash(key).as_bytes()[..16])
}

/// Opens the remote tier at `cfg.url` (for `file://`, creating the
/// directory if missing). Options not given in `cfg.options` are taken from
/// `AWS_*`, `GOOGLE_*` and `AZURE_*` environment variables.
pub async fn open_remote(cfg: &RemoteConfig, at_rest: AtRest) -> Result<RemoteTier> {
    let url =
        url::Url::parse(&cfg.url).map_err(|e| WarehouseError::Config(format!("remote url {:?}: {e}", cfg.url)))?;
    if url.scheme() == "file" {
        let dir = url
            .to_file_path()
            .map_err(|_| WarehouseError::Config(format!("remote url {:?} is not a local path", cfg.url)))?;
        std::fs::create_dir_all(&dir)
            .map_err(|e| WarehouseError::Config(format!("remote directory {}: {e}", dir.display())))?;
    }
    let mut opts: HashMap<String, String> = std::env::vars()
        .filter(|(k, _)| ["AWS_", "GOOGLE_", "AZURE_"].iter().any(|p| k.starts_with(p)))
        .map(|(k, v)| (k.to_ascii_lowercase(), v))
        .collect();
    opts.extend(cfg.options.iter().map(|(k, v)| (k.to_ascii_lowercase(), v.clone())));
    let (store, prefix) = object_store::parse_url_opts(&url, opts)
        .map_err(|e| WarehouseError::Config(format!("remote url {:?}: {e}", cfg.url)))?;
    Ok(RemoteTier {
        store: Arc::from(store),
        prefix,
        at_rest,
        c: Counters::default(),
        events: TierEvents::default(),
        sweep_after: tokio::sync::Mutex::new(None),
        sorted_listing: url.scheme() != "file",
    })
}

impl RemoteTier {
    /// The namespace's prefix and every object path under it.
    async fn list_namespace(&self, ns: &str) -> Result<(Path, Vec<Path>)> {
        let dir = self.ns_path(ns);
        let paths = self
            .store
            .list(Some(&dir))
            .map_ok(|m| m.location)
            .try_collect()
            .await
            .map_err(|e| self.fail("list", &dir, e))?;
        Ok((dir, paths))
    }

    fn ns_path(&self, ns: &str) -> Path {
        self.prefix.child(ns)
    }

    /// Where an entry's object lives.
    pub fn object_path(&self, ns: &str, key: &[u8]) -> Path {
        self.ns_path(ns).child(object_name(key))
    }

    fn fail(&self, op: &str, path: &Path, e: object_store::Error) -> WarehouseError {
        self.c.errors.fetch_add(1, Relaxed);
        remote_err(op, path, e)
    }

    /// The whole object, `None` if absent; placed so that a plain record's
    /// value (at `value_at`) is aligned (see [`AlignedBuf`]).
    async fn fetch(&self, path: &Path, value_at: usize) -> Result<Option<Bytes>> {
        let got = match self.store.get(path).await {
            Ok(g) => read_aligned(g, value_at).await,
            Err(e) => Err(e),
        };
        match got {
            Ok(b) => Ok(Some(b)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.fail("get", path, e)),
        }
    }

    /// The first `n` bytes of an object (fewer if it is shorter), `None` if absent.
    async fn fetch_prefix(&self, path: &Path, n: usize) -> Result<Option<Bytes>> {
        let opts = GetOptions { range: Some(GetRange::Bounded(0..n as u64)), ..Default::default() };
        let got = match self.store.get_opts(path, opts).await {
            Ok(g) => g.bytes().await,
            Err(e) => Err(e),
        };
        match got {
            Ok(b) => Ok(Some(b)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            // The range starts at 0, so the only object that cannot serve it
            // is an empty one; the stores report that as a generic error
            // whose type is private, so ask the store for the object's size
            // instead of reading the message.
            Err(e) => match self.store.head(path).await {
                Ok(m) if m.size == 0 => Ok(Some(Bytes::new())),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                _ => Err(self.fail("get", path, e)),
            },
        }
    }

    /// Counts an object that failed verification; leaves it in place.
    fn skip_unverified(&self, path: &Path, reason: &Corrupt) {
        tracing::warn!(%path, %reason, "remote tier: skipping an object that failed verification");
        self.c.verify_failed.fetch_add(1, Relaxed);
    }

    /// Reads and verifies an entry; `None` when absent or corrupt (dropped).
    async fn read(&self, ns: &str, key: &[u8]) -> Result<Option<Record>> {
        let path = self.object_path(ns, key);
        let Some(bytes) = self.fetch(&path, value_offset(ns, key)).await? else { return Ok(None) };
        match self.at_rest.open(bytes, Some((ns, key))) {
            Ok(r) => Ok(Some(r)),
            Err(c) => {
                self.skip_unverified(&path, &c);
                Ok(None)
            }
        }
    }

    /// Reads an object's head (one ranged GET, a second only for long keys).
    async fn read_head(&self, path: &Path) -> Result<Option<Result<RecordHead, Corrupt>>> {
        let first = 4096;
        let Some(mut bytes) = self.fetch_prefix(path, first).await? else { return Ok(None) };
        let span = match AtRest::head_span(&bytes[..bytes.len().min(PREAMBLE)], None) {
            Ok(s) => s,
            Err(c) => return Ok(Some(Err(c))),
        };
        if span > bytes.len() && bytes.len() == first && span <= PREAMBLE + MAX_HEAD {
            let Some(more) = self.fetch_prefix(path, span).await? else { return Ok(None) };
            bytes = more;
        }
        Ok(Some(self.at_rest.open_head(&bytes, None)))
    }

    /// The live head of an entry; drops corrupt objects, expired ones count.
    async fn live_head(&self, ns: &str, key: &[u8]) -> Result<Option<RecordHead>> {
        let path = self.object_path(ns, key);
        match self.read_head(&path).await? {
            None => Ok(None),
            Some(Err(c)) => {
                self.skip_unverified(&path, &c);
                Ok(None)
            }
            Some(Ok(h)) if h.namespace != ns || h.key != key => {
                let c = Corrupt::Mismatch {
                    found_ns: h.namespace,
                    found_key: String::from_utf8_lossy(&h.key).into_owned(),
                };
                self.skip_unverified(&path, &c);
                Ok(None)
            }
            Some(Ok(h)) if h.meta.is_expired(now_ms()) => Ok(None),
            Some(Ok(h)) => Ok(Some(h)),
        }
    }

    async fn delete(&self, path: &Path) -> Result<()> {
        match self.store.delete(path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.fail("delete", path, e)),
        }
    }
}

#[async_trait]
impl Tier for RemoteTier {
    fn kind(&self) -> TierKind {
        TierKind::Remote
    }

    fn set_event_sink(&self, sink: EventSink) -> bool {
        self.events.set(sink);
        false
    }

    async fn get(&self, ns: &str, key: &[u8]) -> Result<Option<Stored>> {
        let rec = match self.read(ns, key).await {
            Ok(Some(r)) => r,
            other => {
                self.c.misses.fetch_add(1, Relaxed);
                return other.map(|_| None);
            }
        };
        if rec.meta.is_expired(now_ms()) {
            self.c.misses.fetch_add(1, Relaxed);
            self.c.expirations.fetch_add(1, Relaxed);
            self.delete(&self.object_path(ns, key)).await?;
            self.events.removed(ns, key);
            return Ok(None);
        }
        self.c.hits.fetch_add(1, Relaxed);
        Ok(Some(Stored { value: rec.value, meta: rec.meta, hits: 1 }))
    }

    async fn contains(&self, ns: &str, key: &[u8]) -> Result<bool> {
        Ok(self.live_head(ns, key).await?.is_some())
    }

    fn contains_local(&self, _ns: &str, _key: &[u8]) -> Option<bool> {
        None
    }

    async fn put(&self, ns: &str, key: Bytes, value: Bytes, meta: EntryMeta) -> Result<Vec<Evicted>> {
        let sealed = if value.len() >= 1 << 20 {
            // Compression and encryption of large values off the async threads.
            let (a, n, k) = (self.at_rest.clone(), ns.to_string(), key.clone());
            tokio::task::spawn_blocking(move || a.seal(&n, &k, meta, &value))
                .await
                .map_err(|e| WarehouseError::Remote(format!("seal task failed: {e}")))??
        } else {
            self.at_rest.seal(ns, &key, meta, &value)?
        };
        let path = self.object_path(ns, &key);
        self.store.put(&path, PutPayload::from(sealed)).await.map_err(|e| self.fail("put", &path, e))?;
        Ok(Vec::new())
    }

    async fn remove(&self, ns: &str, key: &[u8]) -> Result<bool> {
        // The head, not just the object's existence: an expired entry (or a
        // corrupt object) is removed but is not a key DEL removed.
        let path = self.object_path(ns, key);
        let live = match self.read_head(&path).await? {
            None => return Ok(false),
            Some(Ok(h)) => h.namespace == ns && h.key == key && !h.meta.is_expired(now_ms()),
            Some(Err(_)) => false,
        };
        self.delete(&path).await?;
        Ok(live)
    }

    async fn remove_namespace(&self, ns: &str) -> Result<u64> {
        let (dir, paths) = self.list_namespace(ns).await?;
        let n = paths.len() as u64;
        let mut deleted = self.store.delete_stream(futures::stream::iter(paths.into_iter().map(Ok)).boxed());
        while let Some(r) = deleted.next().await {
            match r {
                Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(self.fail("delete", &dir, e)),
            }
        }
        Ok(n)
    }

    async fn set_expiry(&self, ns: &str, key: &[u8], expires_at_ms: Option<u64>) -> Result<bool> {
        let Some(rec) = self.read(ns, key).await? else { return Ok(false) };
        if rec.meta.is_expired(now_ms()) {
            return Ok(false);
        }
        let meta = EntryMeta { expires_at_ms, ..rec.meta };
        self.put(ns, rec.key, rec.value, meta).await?;
        Ok(true)
    }

    async fn meta(&self, ns: &str, key: &[u8]) -> Result<Option<EntryMeta>> {
        Ok(self.live_head(ns, key).await?.map(|h| h.meta))
    }

    async fn scan(&self, ns: &str, cursor: u64, count: usize) -> Result<ScanPage> {
        let count = count.max(1);
        let (_, paths) = self.list_namespace(ns).await?;
        let now = now_ms();
        let heads: Vec<Result<Option<(u64, Bytes)>>> = futures::stream::iter(paths)
            .map(|p| async move {
                Ok(match self.read_head(&p).await? {
                    Some(Ok(h)) if h.namespace == ns && !h.meta.is_expired(now) => {
                        let sh = scan_hash(&h.key);
                        (sh >= cursor).then_some((sh, h.key))
                    }
                    _ => None,
                })
            })
            .buffer_unordered(SCAN_PARALLEL)
            .collect()
            .await;
        let mut cand = Vec::with_capacity(heads.len());
        for h in heads {
            cand.extend(h?);
        }
        cand.sort();
        Ok(cut_page(cand, count))
    }

    async fn namespaces(&self) -> Result<Vec<String>> {
        let listed =
            self.store.list_with_delimiter(Some(&self.prefix)).await.map_err(|e| self.fail("list", &self.prefix, e))?;
        let mut out = Vec::new();
        for p in listed.common_prefixes {
            let Some(name) = p.filename().map(str::to_string) else { continue };
            // A shared filesystem keeps empty directories: only count namespaces with objects.
            let mut objects = self.store.list(Some(&p));
            if let Some(first) = objects.next().await {
                first.map_err(|e| self.fail("list", &p, e))?;
                out.push(name);
            }
        }
        out.sort();
        Ok(out)
    }

    /// One page of the TTL sweep: examines at most `limit` objects from
    /// where the previous page stopped; deletes the expired ones.
    async fn purge_expired(&self, limit: usize) -> Result<u64> {
        // A pass still running (slow bucket): this one is skipped, not queued.
        let Ok(mut after) = self.sweep_after.try_lock() else { return Ok(0) };
        let listing = match after.as_ref() {
            Some(a) => self.store.list_with_offset(Some(&self.prefix), a),
            None => self.store.list(Some(&self.prefix)),
        };
        let listing = listing.map_ok(|m| m.location);
        let page: Vec<Path> = if self.sorted_listing {
            listing.take(limit.max(1)).try_collect().await
        } else {
            // A filesystem lists in directory order: the page is the
            // smallest names after the cursor, from the whole listing.
            listing.try_collect::<Vec<_>>().await.map(|mut all| {
                all.sort_unstable();
                all.truncate(limit.max(1));
                all
            })
        }
        .map_err(|e| self.fail("list", &self.prefix, e))?;
        // A short page reached the end: the next pass starts over.
        *after = if page.len() < limit.max(1) { None } else { page.last().cloned() };
        let now = now_ms();
        let removed = futures::stream::iter(page)
            .map(|path| async move {
                // Only a verified head that names this very object is trusted
                // to say it expired; anything else is left alone.
                let Ok(Some(Ok(h))) = self.read_head(&path).await else { return false };
                if !h.meta.is_expired(now) || self.object_path(&h.namespace, &h.key) != path {
                    return false;
                }
                if self.delete(&path).await.is_err() {
                    return false;
                }
                self.events.removed(&h.namespace, &h.key);
                true
            })
            .buffer_unordered(SWEEP_PARALLEL)
            .filter(|&gone| std::future::ready(gone))
            .count()
            .await as u64;
        self.c.expirations.fetch_add(removed, Relaxed);
        Ok(removed)
    }

    fn stats(&self) -> TierStats {
        TierStats {
            tier: Some(TierKind::Remote),
            hits: self.c.hits.load(Relaxed),
            misses: self.c.misses.load(Relaxed),
            expirations: self.c.expirations.load(Relaxed),
            verify_failed: self.c.verify_failed.load(Relaxed),
            errors: self.c.errors.load(Relaxed),
            ..Default::default()
        }
    }
}

/// An object's bytes in an [`AlignedBuf`]: a local file is read straight
/// into it, a stream's chunks are gathered into it.
async fn read_aligned(got: GetResult, value_at: usize) -> object_store::Result<Bytes> {
    let len = (got.range.end - got.range.start) as usize;
    let generic = |e: std::io::Error| object_store::Error::Generic { store: "remote tier", source: Box::new(e) };
    match got.payload {
        GetResultPayload::File(mut file, _) => {
            let start = got.range.start;
            let read = tokio::task::spawn_blocking(move || {
                use std::io::{Read, Seek, SeekFrom};
                let mut buf = AlignedBuf::new(len, value_at);
                file.seek(SeekFrom::Start(start))?;
                file.take(len as u64).read_to_end(buf.vec())?;
                Ok::<_, std::io::Error>(buf.freeze())
            })
            .await
            .map_err(|e| generic(std::io::Error::other(e)))?;
            read.map_err(generic)
        }
        GetResultPayload::Stream(mut chunks) => {
            let mut buf = AlignedBuf::new(len, value_at);
            while let Some(chunk) = chunks.next().await {
                buf.vec().extend_from_slice(&chunk?);
            }
            Ok(buf.freeze())
        }
    }
}
