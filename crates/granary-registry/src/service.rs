//! [`Registry`]: the catalog and the blob store together, and the
//! operations that touch both: import, delete (with blob collection) and a
//! full garbage-collection pass.
//!
//! Consistency rules:
//! - A revision is recorded only after every one of its files is stored,
//!   in one catalog transaction; a failed import records nothing and
//!   collects the blobs it uploaded that nothing references.
//! - Blobs are shared between revisions; a blob is deleted once no
//!   revision references it. Imports and collection exclude each other
//!   (an RwLock), so a blob an import is about to reference is never
//!   collected under it. That lock is per process: run imports and deletes
//!   through one registry process per catalog.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use sha2::{Digest, Sha256};
use tokio::sync::{RwLock, Semaphore};

use crate::api::{
    check_file_path, check_name, check_revision, is_sha256, FileEntry, GcReport, ImportRequest, Revision,
    RevisionRequest,
};
use crate::blobs::BlobStore;
use crate::blobs::Stored;
use crate::catalog::Catalog;
use crate::error::RegistryError;
use crate::import::{self, ImportOptions, Source};
use crate::metrics::{ImportOutcome, Metrics};

type Result<T, E = RegistryError> = std::result::Result<T, E>;

/// Everything a registry needs to start.
#[derive(Clone, Debug)]
pub struct RegistryConfig {
    /// `sqlite:///path/registry.db`, `sqlite::memory:` or `postgres://…`.
    pub database: String,
    /// An object-store URL: `file:///dir`, `s3://bucket/prefix`, `gs://…`, `az://…`.
    pub store: String,
    /// Object-store options (`aws_endpoint`, `aws_allow_http`, ...) on top
    /// of the `AWS_*`/`GOOGLE_*`/`AZURE_*` environment.
    pub store_options: Vec<(String, String)>,
    /// The token of mutating endpoints; `None` disables them (403 `admin_disabled`).
    pub admin_token: Option<String>,
    /// Tokens that may read (the admin token may too).
    pub read_tokens: Vec<String>,
    /// Reads need no token.
    pub anonymous_read: bool,
    /// The registry's URL as clients reach it, for the blob URLs of
    /// `file://` stores; by default the request's `Host`.
    pub public_url: Option<String>,
    /// How long presigned URLs stay valid.
    pub url_ttl: Duration,
    /// The largest request body accepted (the import request's JSON).
    pub max_body: usize,
    /// Imports running at once; more wait.
    pub max_imports: usize,
    /// The header timeout and connection cap of the HTTP server.
    pub http: granary_core::serve::HttpLimits,
    /// Where and how imports find their files.
    pub import: ImportOptions,
    /// Where uploads are kept until complete [default: a directory under
    /// the system's temporary directory].
    pub upload_dir: Option<std::path::PathBuf>,
}

impl RegistryConfig {
    /// Defaults for everything but the catalog and the store.
    pub fn new(database: impl Into<String>, store: impl Into<String>) -> Self {
        RegistryConfig {
            database: database.into(),
            store: store.into(),
            store_options: Vec::new(),
            admin_token: None,
            read_tokens: Vec::new(),
            anonymous_read: false,
            public_url: None,
            url_ttl: Duration::from_secs(3600),
            max_body: 64 * 1024,
            max_imports: 2,
            http: granary_core::serve::HttpLimits::default(),
            import: ImportOptions::default(),
            upload_dir: None,
        }
    }
}

/// The registry: catalog, blob store, import options and metrics.
pub struct Registry {
    catalog: Catalog,
    blobs: BlobStore,
    import: ImportOptions,
    /// Imports hold it shared, blob collection exclusively.
    collect: RwLock<()>,
    imports: Semaphore,
    metrics: Metrics,
}

pub(crate) fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

impl Registry {
    /// Opens the catalog (running migrations) and the store.
    pub async fn open(cfg: &RegistryConfig) -> anyhow::Result<Self> {
        let catalog = Catalog::open(&cfg.database).await?;
        let blobs = BlobStore::open(&cfg.store, &cfg.store_options)?;
        Ok(Self::new(catalog, blobs, cfg.import.clone(), cfg.max_imports))
    }

    /// A registry over an open catalog and store.
    pub fn new(catalog: Catalog, blobs: BlobStore, import: ImportOptions, max_imports: usize) -> Self {
        Registry {
            catalog,
            blobs,
            import,
            collect: RwLock::new(()),
            imports: Semaphore::new(max_imports.max(1)),
            metrics: Metrics::default(),
        }
    }

    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    pub fn blobs(&self) -> &BlobStore {
        &self.blobs
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Imports a revision: finds the source's files, stores each as a blob
    /// (sha256 computed while uploading), then records the revision.
    pub async fn import(&self, req: ImportRequest) -> Result<Revision> {
        let res = self.import_inner(req).await;
        self.metrics.import(match &res {
            Ok(_) => ImportOutcome::Ok,
            Err(RegistryError::Conflict(_)) => ImportOutcome::Conflict,
            Err(RegistryError::Invalid { .. } | RegistryError::NotFound { .. }) => ImportOutcome::Invalid,
            Err(_) => ImportOutcome::Failed,
        });
        res
    }

    async fn import_inner(&self, req: ImportRequest) -> Result<Revision> {
        check_name(&req.name)
            .map_err(|m| RegistryError::invalid("name", "invalid_value", format!("Invalid `name`: {m}.")))?;
        if let Some(r) = &req.revision {
            check_revision(r).map_err(|m| {
                RegistryError::invalid("revision", "invalid_value", format!("Invalid `revision`: {m}."))
            })?;
        }
        check_license(req.license.as_deref())?;
        let source = Source::parse(&req.source)?;
        if let Some(r) = &req.revision {
            if self.catalog.exists(&req.name, r).await? {
                return Err(conflict(&req.name, r));
            }
        }
        let _slot = self.imports.acquire().await.map_err(|e| RegistryError::Internal(e.to_string()))?;
        let started = Instant::now();
        let staged = import::stage(&source, &self.import).await?;
        let format = import::detect_format(staged.files.iter().map(|f| f.path.as_str()))?;
        let revision = match req.revision.clone().or_else(|| staged.revision.clone()) {
            Some(r) => {
                check_revision(&r).map_err(|m| {
                    RegistryError::invalid(
                        "revision",
                        "invalid_value",
                        format!("The source's revision: {m}; pass `revision`."),
                    )
                })?;
                if self.catalog.exists(&req.name, &r).await? {
                    return Err(conflict(&req.name, &r));
                }
                Some(r)
            }
            None => None,
        };

        let mut total = 0u64;
        for f in &staged.files {
            let meta = tokio::fs::metadata(&f.local)
                .await
                .map_err(|e| RegistryError::Internal(format!("{}: {e}", f.local.display())))?;
            total += meta.len();
        }
        tracing::info!(name = %req.name, source = %req.source, files = staged.files.len(), bytes = total, "importing");
        let progress = Progress::new(&req.name, 2 * total);

        let guard = self.collect.read().await;
        let mut files = Vec::with_capacity(staged.files.len());
        let mut uploaded = Vec::new();
        let mut stored_result = Ok(());
        for f in &staged.files {
            let base = progress.done.load(Relaxed);
            let report = |n: u64| progress.report(base + n);
            match self.blobs.put_file(&f.local, &report).await {
                Ok(s) if f.expected_sha256.as_deref().is_some_and(|want| want != s.sha256) => {
                    if s.uploaded {
                        uploaded.push(s.sha256.clone());
                    }
                    stored_result = Err(RegistryError::invalid(
                        "source",
                        "source_corrupt",
                        format!(
                            "{} is named by the sha256 {} in the Hugging Face cache, but its bytes hash to {}; \
                             the cache copy is corrupt (download it again)",
                            f.path,
                            f.expected_sha256.as_deref().unwrap_or_default(),
                            s.sha256
                        ),
                    ));
                    break;
                }
                Ok(s) => {
                    progress.report(base + 2 * s.size);
                    if s.uploaded {
                        self.metrics.uploaded_bytes.fetch_add(s.size, Relaxed);
                        uploaded.push(s.sha256.clone());
                    } else {
                        self.metrics.deduplicated_bytes.fetch_add(s.size, Relaxed);
                    }
                    files.push(FileEntry { path: f.path.clone(), size: s.size, sha256: s.sha256 });
                }
                Err(e) => {
                    stored_result = Err(e);
                    break;
                }
            }
        }
        let recorded = match stored_result {
            Ok(()) => {
                let revision = revision.unwrap_or_else(|| content_revision(&files));
                let rev = Revision {
                    name: req.name.clone(),
                    revision,
                    format: format.to_string(),
                    license: req.license.clone().or(staged.license.clone()).map(|l| l.to_ascii_lowercase()),
                    created: 0,
                    size: files.iter().map(|f| f.size).sum(),
                    files,
                    source: Some(req.source.clone()),
                };
                let created_ms = now_ms();
                self.catalog
                    .insert(&rev, created_ms)
                    .await
                    .map(|()| Revision { created: created_ms.div_euclid(1000), ..rev })
            }
            Err(e) => Err(e),
        };
        drop(guard);
        match recorded {
            Ok(rev) => {
                tracing::info!(
                    name = %rev.name, revision = %rev.revision, files = rev.files.len(), bytes = rev.size,
                    seconds = started.elapsed().as_secs_f64(), "imported"
                );
                Ok(rev)
            }
            Err(e) => {
                // Nothing recorded: collect what this import uploaded, unless
                // another revision references it meanwhile.
                if let Err(gc) = self.collect_unreferenced(&uploaded).await {
                    tracing::warn!(error = %gc, "collecting the blobs of a failed import");
                }
                Err(e)
            }
        }
    }

    /// Stores a fully uploaded file (already checked against the sha256 it
    /// was uploaded as) as a blob; it is hashed again on the way into the store.
    pub async fn store_upload(&self, local: &std::path::Path) -> Result<Stored> {
        let _shared = self.collect.read().await;
        let s = self.blobs.put_file(local, &|_| {}).await?;
        if s.uploaded {
            self.metrics.uploaded_bytes.fetch_add(s.size, Relaxed);
        }
        Ok(s)
    }

    /// Records a revision of `name` made of blobs already stored (pushed
    /// through `/v1/uploads`): each must be there with its size.
    pub async fn record(&self, name: &str, req: RevisionRequest) -> Result<Revision> {
        check_name(name)
            .map_err(|m| RegistryError::invalid("name", "invalid_value", format!("Invalid `name`: {m}.")))?;
        if let Some(r) = &req.revision {
            check_revision(r).map_err(|m| {
                RegistryError::invalid("revision", "invalid_value", format!("Invalid `revision`: {m}."))
            })?;
        }
        check_license(req.license.as_deref())?;
        if req.files.is_empty() {
            return Err(RegistryError::invalid("files", "invalid_value", "A revision needs at least one file."));
        }
        if req.files.len() > self.import.max_files {
            return Err(RegistryError::invalid(
                "files",
                "too_many_files",
                format!("{} files; the limit is {}.", req.files.len(), self.import.max_files),
            ));
        }
        let mut files = req.files;
        files.sort_by(|a, b| a.path.cmp(&b.path));
        for (i, f) in files.iter().enumerate() {
            check_file_path(&f.path).map_err(|m| {
                RegistryError::invalid(&format!("files[{i}].path"), "unsafe_path", format!("Invalid file path: {m}."))
            })?;
            if i > 0 && files[i - 1].path == f.path {
                return Err(RegistryError::invalid(
                    "files",
                    "invalid_value",
                    format!("The file {} is listed twice.", f.path),
                ));
            }
            if !is_sha256(&f.sha256) {
                return Err(RegistryError::invalid(
                    &format!("files[{i}].sha256"),
                    "invalid_value",
                    "A sha256 is 64 lowercase hex characters.",
                ));
            }
        }
        let format = import::detect_format(files.iter().map(|f| f.path.as_str()))?;
        let revision = req.revision.unwrap_or_else(|| content_revision(&files));
        // Blobs checked and the revision recorded with collection held off,
        // so that no blob is collected between the check and the record.
        let _shared = self.collect.read().await;
        for f in &files {
            match self.blobs.head(&f.sha256).await? {
                Some(n) if n == f.size => {}
                Some(n) => {
                    return Err(RegistryError::invalid(
                        "files",
                        "size_mismatch",
                        format!("{}: the stored blob {} has {n} bytes, not {}.", f.path, f.sha256, f.size),
                    ))
                }
                None => {
                    return Err(RegistryError::invalid(
                        "files",
                        "blob_missing",
                        format!(
                            "{}: no blob {} is stored; upload it first (PATCH /v1/uploads/{}).",
                            f.path, f.sha256, f.sha256
                        ),
                    ))
                }
            }
        }
        if self.catalog.exists(name, &revision).await? {
            return Err(conflict(name, &revision));
        }
        let rev = Revision {
            name: name.to_string(),
            revision,
            format: format.to_string(),
            license: req.license.map(|l| l.to_ascii_lowercase()),
            created: 0,
            size: files.iter().map(|f| f.size).sum(),
            files,
            source: Some("push".into()),
        };
        let created_ms = now_ms();
        self.catalog.insert(&rev, created_ms).await?;
        tracing::info!(name, revision = %rev.revision, files = rev.files.len(), bytes = rev.size, "recorded a pushed revision");
        Ok(Revision { created: created_ms.div_euclid(1000), ..rev })
    }

    /// Deletes one revision (`rev` may be `latest`) or, with `None`, every
    /// revision of the model, then the blobs nothing references any more.
    /// Returns how many blobs were deleted.
    pub async fn delete(&self, name: &str, rev: Option<&str>) -> Result<u64> {
        check_name(name)
            .map_err(|m| RegistryError::invalid("name", "invalid_value", format!("Invalid `name`: {m}.")))?;
        let Some(shas) = self.catalog.delete(name, rev).await? else {
            return Err(match rev {
                Some(r) => RegistryError::not_found("revision_not_found", format!("No revision {r} of model {name}.")),
                None => RegistryError::not_found("model_not_found", format!("No model named {name}.")),
            });
        };
        tracing::info!(name, revision = rev.unwrap_or("(all)"), "deleted");
        self.collect_unreferenced(&shas).await
    }

    async fn collect_unreferenced(&self, shas: &[String]) -> Result<u64> {
        if shas.is_empty() {
            return Ok(0);
        }
        let _excl = self.collect.write().await;
        let mut deleted = 0;
        for sha in shas {
            if self.catalog.blob_size(sha).await?.is_none() {
                self.blobs.delete(sha).await?;
                deleted += 1;
            }
        }
        self.metrics.blobs_deleted.fetch_add(deleted, Relaxed);
        Ok(deleted)
    }

    /// Deletes every blob in the store that no revision references and that
    /// is older than `grace` (younger ones may belong to an import running
    /// in another process).
    pub async fn gc(&self, grace: Duration) -> Result<GcReport> {
        let _excl = self.collect.write().await;
        let cutoff = (now_ms() / 1000).saturating_sub(grace.as_secs() as i64);
        let mut report = GcReport::default();
        for b in self.blobs.list().await? {
            if self.catalog.blob_size(&b.sha256).await?.is_some() {
                report.referenced += 1;
            } else if b.modified > cutoff {
                report.kept_young += 1;
            } else {
                self.blobs.delete(&b.sha256).await?;
                report.deleted += 1;
                report.deleted_bytes += b.size;
            }
        }
        self.metrics.blobs_deleted.fetch_add(report.deleted, Relaxed);
        tracing::info!(?report, "garbage collection");
        Ok(report)
    }
}

fn check_license(license: Option<&str>) -> Result<()> {
    if let Some(l) = license {
        let ok = !l.is_empty() && l.len() <= 64 && !l.chars().any(|c| c.is_whitespace() || c.is_control());
        if !ok {
            return Err(RegistryError::invalid(
                "license",
                "invalid_value",
                "Invalid `license`: expected an SPDX-style id such as apache-2.0.",
            ));
        }
    }
    Ok(())
}

fn conflict(name: &str, rev: &str) -> RegistryError {
    RegistryError::Conflict(format!(
        "{name}@{rev} exists already; revisions are immutable (delete it first, or import under another revision)"
    ))
}

/// A directory import's default revision: the first 12 hex characters of
/// the sha256 of its manifest (path and sha256 of every file), so the same
/// contents get the same revision.
pub fn content_revision(files: &[FileEntry]) -> String {
    let mut h = Sha256::new();
    for f in files {
        h.update(f.path.as_bytes());
        h.update([0]);
        h.update(f.sha256.as_bytes());
        h.update([b'\n']);
    }
    hex::encode(h.finalize())[..12].to_string()
}

/// Logs an import's progress every few seconds.
struct Progress {
    name: String,
    total: u64,
    done: AtomicU64,
    last: Mutex<Instant>,
}

impl Progress {
    fn new(name: &str, total: u64) -> Arc<Self> {
        Arc::new(Progress { name: name.to_string(), total, done: AtomicU64::new(0), last: Mutex::new(Instant::now()) })
    }

    fn report(&self, done: u64) {
        self.done.store(done, Relaxed);
        let mut last = self.last.lock();
        if last.elapsed() >= Duration::from_secs(5) {
            *last = Instant::now();
            let pct = if self.total == 0 { 100.0 } else { done as f64 * 100.0 / self.total as f64 };
            tracing::info!(name = %self.name, percent = format!("{pct:.0}"), "import progress (hash + upload)");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_revisions_follow_the_contents() {
        let f = |p: &str, c: char| FileEntry { path: p.into(), size: 1, sha256: c.to_string().repeat(64) };
        let a = content_revision(&[f("a", '1'), f("b", '2')]);
        assert_eq!(a.len(), 12);
        assert_eq!(a, content_revision(&[f("a", '1'), f("b", '2')]));
        assert_ne!(a, content_revision(&[f("a", '1'), f("b", '3')]));
        assert_ne!(a, content_revision(&[f("a", '2'), f("b", '1')]));
        check_revision(&a).unwrap();
    }
}
