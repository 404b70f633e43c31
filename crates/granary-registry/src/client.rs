//! [`RegistryClient`]: the registry's HTTP API from Rust, for the node agent,
//! the gateway and the `granary registry` command line.
//!
//! Whatever it downloads whole, it verifies: [`RegistryClient::fetch_blob`]
//! and [`RegistryClient::download`] hash the bytes as they arrive and refuse
//! them ([`ClientError::Integrity`]) unless the sha256 matches, and a
//! download goes to `<dest>.part` and is renamed into place only once
//! verified. Ranged reads ([`RegistryClient::fetch_range`]) cannot be
//! verified alone; whoever assembles a file from ranges verifies the whole.

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt as _;
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt as _;

use crate::api::{
    self, FileEntry, FileUrl, GcReport, ImportRequest, Model, ModelList, ModelSummary, Revision, RevisionRequest,
    UploadStatus,
};

/// Bytes per upload request of [`RegistryClient::push_dir`]: what a broken
/// connection can cost at most.
pub const PUSH_CHUNK: usize = 32 << 20;
/// Failed requests per file before [`RegistryClient::push_dir`] gives up.
pub const PUSH_RETRIES: u32 = 5;

/// What [`RegistryClient::push_dir`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PushReport {
    /// Files sent (whole or the rest of them).
    pub uploaded: u64,
    /// Files the registry held already (nothing sent).
    pub already_stored: u64,
    /// Bytes sent.
    pub sent_bytes: u64,
    /// Bytes of partial uploads the registry held from an earlier attempt.
    pub resumed_bytes: u64,
}

/// Why a registry call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The registry could not be reached, or the connection broke.
    #[error("registry request to {url} failed: {source}")]
    Transport {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    /// The registry answered with an error (its OpenAI-shaped body, decoded).
    #[error("registry answered {status}: {message}")]
    Api {
        /// HTTP status.
        status: u16,
        /// The error's `code` (`revision_exists`, `model_not_found`, ...).
        code: Option<String>,
        /// The request field at fault.
        param: Option<String>,
        message: String,
    },
    /// Downloaded bytes whose sha256 is not the one the catalog records;
    /// they were discarded.
    #[error("sha256 mismatch for {what}: expected {expected}, got {actual}; the download was discarded")]
    Integrity { what: String, expected: String, actual: String },
    /// The transfer ended early: the connection broke or the registry
    /// aborted it (it does so when the stored bytes fail their sha256 check).
    #[error(
        "download of {what} broke off after {got} of {expected} bytes{} (a network failure, or the registry \
         aborting a blob whose stored bytes failed their sha256 check); nothing was kept",
        cause.as_deref().map(|c| format!(": {c}")).unwrap_or_default()
    )]
    Truncated { what: String, got: u64, expected: u64, cause: Option<String> },
    /// A local file could not be written or read.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// An argument or an answer that makes no sense (a bad URL, an unsafe path).
    #[error("{0}")]
    Invalid(String),
}

impl ClientError {
    /// The HTTP status, when the registry answered with an error.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Api { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The error's `code`, when the registry answered with an error.
    pub fn code(&self) -> Option<&str> {
        match self {
            ClientError::Api { code, .. } => code.as_deref(),
            _ => None,
        }
    }

    /// Whether the registry said 404.
    pub fn is_not_found(&self) -> bool {
        self.status() == Some(404)
    }

    fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        ClientError::Io { context: context.into(), source }
    }
}

/// Result of a registry call.
pub type Result<T, E = ClientError> = std::result::Result<T, E>;

/// A registry's HTTP API. Cheap to clone.
#[derive(Clone, Debug)]
pub struct RegistryClient {
    /// Without a trailing slash.
    base: url::Url,
    token: Option<String>,
    http: reqwest::Client,
}

impl RegistryClient {
    /// A client of the registry at `base` (`http://127.0.0.1:8400`),
    /// sending `token` as `Authorization: Bearer` to it (never to presigned
    /// URLs of other hosts).
    pub fn new(base: &str, token: Option<String>) -> Result<Self> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| ClientError::Invalid(format!("building an HTTP client: {e}")))?;
        Self::with_http(base, token, http)
    }

    /// As [`RegistryClient::new`], with a caller's HTTP client (timeouts,
    /// proxies, connection pool).
    pub fn with_http(base: &str, token: Option<String>, http: reqwest::Client) -> Result<Self> {
        let mut url = url::Url::parse(base.trim_end_matches('/'))
            .map_err(|e| ClientError::Invalid(format!("registry URL {base:?}: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") || url.cannot_be_a_base() {
            return Err(ClientError::Invalid(format!("registry URL {base:?}: expected http:// or https://")));
        }
        if url.path() == "/" {
            url.set_path("");
        }
        Ok(RegistryClient { base: url, token: token.filter(|t| !t.is_empty()), http })
    }

    /// The registry's base URL.
    pub fn base(&self) -> &str {
        self.base.as_str().trim_end_matches('/')
    }

    /// Whether `url` is on the registry's own origin (where its token may go).
    pub fn is_own(&self, url: &str) -> bool {
        url::Url::parse(url).is_ok_and(|u| same_origin(&u, &self.base))
    }

    /// The bearer token sent to the registry.
    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// The URL of `path_segments` under the base, each segment escaped.
    fn url(&self, segments: &[&str]) -> url::Url {
        let mut url = self.base.clone();
        {
            let mut p = url.path_segments_mut().expect("checked in with_http");
            p.pop_if_empty();
            p.extend(segments);
        }
        url
    }

    /// `GET /v1/blobs/{sha256}` as a string.
    pub fn blob_url(&self, sha256: &str) -> String {
        self.url(&["v1", "blobs", sha256]).to_string()
    }

    fn request(&self, method: reqwest::Method, url: url::Url) -> reqwest::RequestBuilder {
        let send_token = same_origin(&url, &self.base);
        let mut req = self.http.request(method, url);
        if let (true, Some(t)) = (send_token, &self.token) {
            req = req.bearer_auth(t);
        }
        req
    }

    async fn send(&self, req: reqwest::RequestBuilder, url: &url::Url) -> Result<reqwest::Response> {
        let resp = req.send().await.map_err(|source| ClientError::Transport { url: url.to_string(), source })?;
        if resp.status().is_success() {
            Ok(resp)
        } else {
            Err(api_error(resp).await)
        }
    }

    async fn get_json<T: DeserializeOwned>(&self, segments: &[&str]) -> Result<T> {
        let url = self.url(segments);
        let resp = self.send(self.request(reqwest::Method::GET, url.clone()), &url).await?;
        resp.json().await.map_err(|source| ClientError::Transport { url: url.to_string(), source })
    }

    /// `GET /health`: whether the registry is up.
    pub async fn health(&self) -> Result<()> {
        let url = self.url(&["health"]);
        self.send(self.request(reqwest::Method::GET, url.clone()), &url).await.map(drop)
    }

    /// Every model, with its revisions' names.
    pub async fn list(&self) -> Result<Vec<ModelSummary>> {
        Ok(self.get_json::<ModelList>(&["v1", "models"]).await?.models)
    }

    /// One model with all its revisions.
    pub async fn model(&self, name: &str) -> Result<Model> {
        self.get_json(&["v1", "models", name]).await
    }

    /// One revision (`rev` may be `latest`).
    pub async fn revision(&self, name: &str, rev: &str) -> Result<Revision> {
        self.get_json(&["v1", "models", name, "revisions", rev]).await
    }

    /// Where to download one file of a revision: a presigned object-store
    /// URL, or the registry's own blob URL.
    pub async fn file_url(&self, name: &str, rev: &str, path: &str) -> Result<FileUrl> {
        api::check_file_path(path).map_err(ClientError::Invalid)?;
        let mut segments = vec!["v1", "models", name, "revisions", rev, "files"];
        segments.extend(path.split('/'));
        segments.push("url");
        self.get_json(&segments).await
    }

    /// Imports a model (admin token): returns once every file is stored and
    /// the revision recorded. A large PyPI or hub import takes a while; the
    /// request has no overall timeout.
    pub async fn import(&self, req: &ImportRequest) -> Result<Revision> {
        let url = self.url(&["v1", "models", "import"]);
        let resp = self.send(self.request(reqwest::Method::POST, url.clone()).json(req), &url).await?;
        resp.json().await.map_err(|source| ClientError::Transport { url: url.to_string(), source })
    }

    /// `GET /v1/uploads/{sha256}`: how much of an upload the registry holds (admin token).
    pub async fn upload_status(&self, sha256: &str) -> Result<UploadStatus> {
        self.get_json(&["v1", "uploads", sha256]).await
    }

    /// `PATCH /v1/uploads/{sha256}`: `body` appended at `offset` of the
    /// file of `size` bytes (admin token).
    pub async fn upload_part(&self, sha256: &str, size: u64, offset: u64, body: Bytes) -> Result<UploadStatus> {
        let mut url = self.url(&["v1", "uploads", sha256]);
        url.query_pairs_mut().append_pair("size", &size.to_string());
        let req =
            self.request(reqwest::Method::PATCH, url.clone()).header(crate::upload::UPLOAD_OFFSET, offset).body(body);
        let resp = self.send(req, &url).await?;
        resp.json().await.map_err(|source| ClientError::Transport { url: url.to_string(), source })
    }

    /// `POST /v1/models/{name}/revisions`: records a revision of uploaded blobs (admin token).
    pub async fn record_revision(&self, name: &str, req: &RevisionRequest) -> Result<Revision> {
        let url = self.url(&["v1", "models", name, "revisions"]);
        let resp = self.send(self.request(reqwest::Method::POST, url.clone()).json(req), &url).await?;
        resp.json().await.map_err(|source| ClientError::Transport { url: url.to_string(), source })
    }

    /// Uploads every file under `dir` (as a `dir:` import takes them) that
    /// the registry does not hold yet, resuming partial uploads, then
    /// records them as a revision of `name`. A request that fails on the
    /// way is retried from where the registry says it stands, up to
    /// [`PUSH_RETRIES`] times per file.
    pub async fn push_dir(
        &self,
        dir: &Path,
        name: &str,
        revision: Option<String>,
        license: Option<String>,
        progress: &(dyn Fn(&str, u64, u64) + Send + Sync),
    ) -> Result<(Revision, PushReport)> {
        let files = crate::import::list_dir(dir).map_err(|e| ClientError::Invalid(e.to_string()))?;
        if files.is_empty() {
            return Err(ClientError::Invalid(format!("{} holds no files", dir.display())));
        }
        let mut report = PushReport::default();
        let mut entries = Vec::with_capacity(files.len());
        for f in &files {
            let (sha256, size) = crate::blobs::hash_file(&f.local, &|_| {})
                .await
                .map_err(|e| ClientError::Invalid(format!("hashing {}: {e}", f.local.display())))?;
            self.push_file(&f.local, &f.path, &sha256, size, &mut report, progress).await?;
            entries.push(FileEntry { path: f.path.clone(), size, sha256 });
        }
        let rev = self.record_revision(name, &RevisionRequest { revision, license, files: entries }).await?;
        Ok((rev, report))
    }

    async fn push_file(
        &self,
        local: &Path,
        label: &str,
        sha256: &str,
        size: u64,
        report: &mut PushReport,
        progress: &(dyn Fn(&str, u64, u64) + Send + Sync),
    ) -> Result<()> {
        use tokio::io::{AsyncReadExt as _, AsyncSeekExt as _};
        let mut st = self.upload_status(sha256).await?;
        if st.complete {
            report.already_stored += 1;
            progress(label, size, size);
            return Ok(());
        }
        if st.offset > 0 {
            report.resumed_bytes += st.offset;
        }
        report.uploaded += 1;
        let mut f = tokio::fs::File::open(local).await.map_err(|e| ClientError::io(local.display().to_string(), e))?;
        let mut failures = 0;
        while !st.complete {
            f.seek(std::io::SeekFrom::Start(st.offset))
                .await
                .map_err(|e| ClientError::io(local.display().to_string(), e))?;
            let n = (size - st.offset).min(PUSH_CHUNK as u64) as usize;
            let mut buf = vec![0u8; n];
            f.read_exact(&mut buf).await.map_err(|e| ClientError::io(local.display().to_string(), e))?;
            match self.upload_part(sha256, size, st.offset, Bytes::from(buf)).await {
                Ok(next) => {
                    report.sent_bytes += next.offset.saturating_sub(st.offset);
                    st = next;
                    progress(label, st.offset, size);
                }
                // The registry holds another offset (a request that broke
                // after all), or the connection broke: ask where it stands.
                Err(e)
                    if failures < PUSH_RETRIES
                        && (e.code() == Some("offset_mismatch")
                            || e.status().is_none()
                            || e.code() == Some("upload_interrupted")) =>
                {
                    failures += 1;
                    tracing::warn!(file = label, error = %e, "upload request failed; resuming");
                    tokio::time::sleep(Duration::from_millis(200 * failures as u64)).await;
                    st = self.upload_status(sha256).await?;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Deletes one revision, or with `rev` `None` the whole model (admin
    /// token). Blobs no revision references any more are deleted too.
    pub async fn delete(&self, name: &str, rev: Option<&str>) -> Result<()> {
        let url = match rev {
            Some(r) => self.url(&["v1", "models", name, "revisions", r]),
            None => self.url(&["v1", "models", name]),
        };
        self.send(self.request(reqwest::Method::DELETE, url.clone()), &url).await.map(drop)
    }

    /// Deletes every blob no revision references that is older than
    /// `grace` (admin token).
    pub async fn gc(&self, grace: Duration) -> Result<GcReport> {
        let mut url = self.url(&["v1", "gc"]);
        url.query_pairs_mut().append_pair("grace_s", &grace.as_secs().to_string());
        let resp = self.send(self.request(reqwest::Method::POST, url.clone()), &url).await?;
        resp.json().await.map_err(|source| ClientError::Transport { url: url.to_string(), source })
    }

    /// A whole blob in memory, verified against `sha256`. For large files
    /// use [`RegistryClient::download`].
    pub async fn fetch_blob(&self, sha256: &str) -> Result<Bytes> {
        if !api::is_sha256(sha256) {
            return Err(ClientError::Invalid(format!("{sha256:?} is not a sha256 (64 lowercase hex characters)")));
        }
        let url = self.url(&["v1", "blobs", sha256]);
        let resp = self.send(self.request(reqwest::Method::GET, url.clone()), &url).await?;
        let expected = resp.content_length();
        let mut hasher = Sha256::new();
        let mut out = Vec::with_capacity(expected.unwrap_or(0).min(1 << 30) as usize);
        let mut body = resp.bytes_stream();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| ClientError::Truncated {
                what: format!("blob {sha256}"),
                got: out.len() as u64,
                expected: expected.unwrap_or(0),
                cause: Some(error_chain(&e)),
            })?;
            hasher.update(&chunk);
            out.extend_from_slice(&chunk);
        }
        let actual = hex::encode(hasher.finalize());
        if actual != sha256 {
            return Err(ClientError::Integrity { what: format!("blob {sha256}"), expected: sha256.into(), actual });
        }
        Ok(out.into())
    }

    /// Bytes `start..=end` of a blob (`Range: bytes=start-end`). Not
    /// verified: a range cannot be, alone.
    pub async fn fetch_range(&self, sha256: &str, start: u64, end: u64) -> Result<Bytes> {
        if end < start {
            return Err(ClientError::Invalid(format!("range {start}-{end} is empty")));
        }
        let url = self.url(&["v1", "blobs", sha256]);
        let req = self.request(reqwest::Method::GET, url.clone()).header("range", format!("bytes={start}-{end}"));
        let resp = self.send(req, &url).await?;
        if resp.status() != reqwest::StatusCode::PARTIAL_CONTENT {
            return Err(ClientError::Invalid(format!("asked for a range, got {} instead of 206", resp.status())));
        }
        resp.bytes().await.map_err(|source| ClientError::Transport { url: url.to_string(), source })
    }

    /// Downloads `file` from the registry into `dest`, verified (see
    /// [`RegistryClient::download_url`]).
    pub async fn download(&self, file: &FileEntry, dest: &Path) -> Result<u64> {
        let url = self.blob_url(&file.sha256);
        self.download_url(&url, file, dest).await
    }

    /// Downloads `url` (the registry's blob URL or a presigned one) into
    /// `dest`: written to `<dest>.part` while hashed, then renamed into place
    /// if its size and sha256 are `file`'s; otherwise the part file is
    /// removed and the error says why. The registry token goes only to the
    /// registry's own origin. Returns the bytes written.
    pub async fn download_url(&self, url: &str, file: &FileEntry, dest: &Path) -> Result<u64> {
        let parsed = url::Url::parse(url).map_err(|e| ClientError::Invalid(format!("download URL {url:?}: {e}")))?;
        if !api::is_sha256(&file.sha256) {
            return Err(ClientError::Invalid(format!("{:?} is not a sha256", file.sha256)));
        }
        let part = part_path(dest);
        let result = self.download_to(&parsed, file, &part).await;
        match result {
            Ok(n) => {
                tokio::fs::rename(&part, dest)
                    .await
                    .map_err(|e| ClientError::io(format!("renaming {} into place", part.display()), e))?;
                Ok(n)
            }
            Err(e) => {
                let _ = tokio::fs::remove_file(&part).await;
                Err(e)
            }
        }
    }

    async fn download_to(&self, url: &url::Url, file: &FileEntry, part: &Path) -> Result<u64> {
        let what = format!("{} ({})", file.path, file.sha256);
        let resp = self.send(self.request(reqwest::Method::GET, url.clone()), url).await?;
        let mut out = tokio::fs::File::create(part)
            .await
            .map_err(|e| ClientError::io(format!("creating {}", part.display()), e))?;
        let mut hasher = Sha256::new();
        let mut got = 0u64;
        let mut body = resp.bytes_stream();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| ClientError::Truncated {
                what: what.clone(),
                got,
                expected: file.size,
                cause: Some(error_chain(&e)),
            })?;
            got += chunk.len() as u64;
            if got > file.size {
                return Err(ClientError::Integrity {
                    what,
                    expected: file.sha256.clone(),
                    actual: format!("(more than the {} bytes recorded)", file.size),
                });
            }
            hasher.update(&chunk);
            out.write_all(&chunk).await.map_err(|e| ClientError::io(format!("writing {}", part.display()), e))?;
        }
        if got != file.size {
            return Err(ClientError::Truncated { what, got, expected: file.size, cause: None });
        }
        let actual = hex::encode(hasher.finalize());
        if actual != file.sha256 {
            return Err(ClientError::Integrity { what, expected: file.sha256.clone(), actual });
        }
        out.sync_all().await.map_err(|e| ClientError::io(format!("syncing {}", part.display()), e))?;
        Ok(got)
    }
}

/// `<dest>.part`.
fn part_path(dest: &Path) -> PathBuf {
    let mut s = dest.as_os_str().to_os_string();
    s.push(".part");
    PathBuf::from(s)
}

/// Whether two URLs have the same origin: scheme, host and port (the
/// scheme's default filled in). A token goes to its own origin only.
pub fn same_origin(a: &url::Url, b: &url::Url) -> bool {
    a.scheme() == b.scheme()
        && a.host_str().is_some()
        && a.host_str() == b.host_str()
        && a.port_or_known_default() == b.port_or_known_default()
}

/// An error and its causes on one line (reqwest's own message is terse).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// The registry's OpenAI-shaped error body, decoded; or the raw text.
async fn api_error(resp: reqwest::Response) -> ClientError {
    #[derive(serde::Deserialize)]
    struct Body {
        error: Inner,
    }
    #[derive(serde::Deserialize)]
    struct Inner {
        message: String,
        #[serde(default)]
        code: Option<String>,
        #[serde(default)]
        param: Option<String>,
    }
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap_or_default();
    match serde_json::from_str::<Body>(&text) {
        Ok(b) => ClientError::Api { status, code: b.error.code, param: b.error.param, message: b.error.message },
        Err(_) => {
            let message = if text.trim().is_empty() { format!("HTTP {status}") } else { text.trim().to_string() };
            ClientError::Api { status, code: None, param: None, message }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_escape_segments_and_keep_a_base_path() {
        let c = RegistryClient::new("http://127.0.0.1:8400/", None).unwrap();
        assert_eq!(c.base(), "http://127.0.0.1:8400");
        assert_eq!(c.blob_url("ab"), "http://127.0.0.1:8400/v1/blobs/ab");
        let u = c.url(&["v1", "models", "m", "revisions", "r", "files", "a b", "c?.gguf", "url"]);
        assert_eq!(u.as_str(), "http://127.0.0.1:8400/v1/models/m/revisions/r/files/a%20b/c%3F.gguf/url");
        let c = RegistryClient::new("https://reg.example/prefix", Some(String::new())).unwrap();
        assert_eq!(c.blob_url("ab"), "https://reg.example/prefix/v1/blobs/ab");
        assert_eq!(c.token(), None);
        assert!(RegistryClient::new("ftp://x", None).is_err());
        assert!(RegistryClient::new("not a url", None).is_err());
    }

    #[test]
    fn the_token_goes_only_to_the_registry_origin() {
        let base = url::Url::parse("http://127.0.0.1:8400").unwrap();
        assert!(same_origin(&url::Url::parse("http://127.0.0.1:8400/v1/blobs/x").unwrap(), &base));
        assert!(!same_origin(&url::Url::parse("http://127.0.0.1:9000/bucket/x?X-Amz-Signature=1").unwrap(), &base));
        assert!(!same_origin(&url::Url::parse("https://127.0.0.1:8400/").unwrap(), &base));
    }

    #[test]
    fn part_files_sit_next_to_the_destination() {
        assert_eq!(part_path(Path::new("/c/m.gguf")), PathBuf::from("/c/m.gguf.part"));
    }
}
