//! Uploads: files pushed to the registry over HTTP, so that a laptop or a
//! CI job can publish a model into a registry whose store is S3 (imports
//! read the registry host's own disk, PyPI or the hub cache instead).
//!
//! | route | access | does |
//! | --- | --- | --- |
//! | `GET /v1/uploads/{sha256}` | admin | [`UploadStatus`]: bytes held so far, or `complete` |
//! | `PATCH /v1/uploads/{sha256}?size=N` | admin | appends the body at `Upload-Offset` |
//! | `POST /v1/models/{name}/revisions` | admin | records a revision of uploaded blobs → 201 |
//!
//! A file is uploaded under the sha256 it should have, in as many `PATCH`es
//! as the client likes: each appends its body to `<upload_dir>/<sha256>.part`
//! at the offset it names (`Upload-Offset`; another offset than the bytes
//! held is 409 `offset_mismatch`, with the right one in `Upload-Offset`).
//! What a broken request delivered stays, so a client resumes from
//! `GET`'s offset. With the last byte the part is hashed: a mismatch is 400
//! `checksum_mismatch` and the part is deleted; a match is stored as the
//! blob (hashed again on its way into the store) and the part deleted. A
//! blob the store holds already is `complete` at once (nothing is sent).

use std::path::PathBuf;

use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt as _;
use parking_lot::Mutex;
use tokio::io::AsyncWriteExt as _;

use crate::api::{is_sha256, RevisionRequest, UploadStatus};
use crate::error::{ApiError, ErrorType, RegistryError};
use crate::server::{parse_json, path_error, read_body, Access, AppState};

/// The header naming where a `PATCH`'s body goes, and where the next one starts.
pub const UPLOAD_OFFSET: &str = "upload-offset";

/// Uploads in progress (one request per file at a time) and where their parts are.
pub struct Uploads {
    dir: PathBuf,
    busy: Mutex<std::collections::HashSet<String>>,
}

/// Frees a file for the next request when dropped.
struct Busy<'a>(&'a Uploads, String);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.busy.lock().remove(&self.1);
    }
}

impl Uploads {
    pub fn new(dir: PathBuf) -> Self {
        Uploads { dir, busy: Mutex::new(Default::default()) }
    }

    fn part(&self, sha: &str) -> PathBuf {
        self.dir.join(format!("{sha}.part"))
    }

    fn held(&self, sha: &str) -> u64 {
        std::fs::metadata(self.part(sha)).map_or(0, |m| m.len())
    }

    fn take(&self, sha: &str) -> Result<Busy<'_>, ApiError> {
        if !self.busy.lock().insert(sha.to_string()) {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                ErrorType::InvalidRequestError,
                "upload_in_progress",
                format!("Another request is uploading {sha}; try again when it ends."),
            ));
        }
        Ok(Busy(self, sha.to_string()))
    }
}

fn sha_param(p: Result<Path<String>, PathRejection>) -> Result<String, ApiError> {
    let Path(sha) = p.map_err(path_error)?;
    if !is_sha256(&sha) {
        return Err(ApiError::bad_request(
            "invalid_value",
            "An upload is named by its sha256: 64 lowercase hex characters.",
        )
        .param("sha256"));
    }
    Ok(sha)
}

fn status(sha: &str, offset: u64, complete: bool) -> Response {
    let mut resp = Json(UploadStatus { sha256: sha.to_string(), offset, complete }).into_response();
    resp.headers_mut().insert(UPLOAD_OFFSET, HeaderValue::from(offset));
    resp
}

/// `GET /v1/uploads/{sha256}`.
pub(crate) async fn get_upload(
    State(s): State<AppState>,
    headers: HeaderMap,
    p: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    s.auth.check(&headers, Access::Admin)?;
    let sha = sha_param(p)?;
    if let Some(n) = s.reg.blobs().head(&sha).await? {
        return Ok(status(&sha, n, true));
    }
    Ok(status(&sha, s.uploads.held(&sha), false))
}

/// `PATCH /v1/uploads/{sha256}?size=N` with `Upload-Offset`.
pub(crate) async fn patch_upload(
    State(s): State<AppState>,
    headers: HeaderMap,
    p: Result<Path<String>, PathRejection>,
    RawQuery(q): RawQuery,
    body: Body,
) -> Result<Response, ApiError> {
    s.auth.check(&headers, Access::Admin)?;
    let sha = sha_param(p)?;
    let mut size = None;
    for (k, v) in url::form_urlencoded::parse(q.unwrap_or_default().as_bytes()) {
        match k.as_ref() {
            "size" => {
                size = Some(v.parse::<u64>().map_err(|_| {
                    ApiError::bad_request("invalid_value", format!("Invalid `size`: {v:?} is not a number of bytes."))
                        .param("size")
                })?)
            }
            other => {
                return Err(ApiError::bad_request("unknown_parameter", format!("Unknown query parameter `{other}`."))
                    .param(other.to_string()))
            }
        }
    }
    let size = size.ok_or_else(|| {
        ApiError::bad_request("missing_parameter", "`size` (the whole file's bytes) is required.").param("size")
    })?;
    let offset: u64 =
        headers.get(UPLOAD_OFFSET).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse().ok()).ok_or_else(
            || {
                ApiError::bad_request("missing_header", "`Upload-Offset` (where this body starts) is required.")
                    .param(UPLOAD_OFFSET)
            },
        )?;
    if let Some(n) = s.reg.blobs().head(&sha).await? {
        return Ok(status(&sha, n, true));
    }
    let _busy = s.uploads.take(&sha)?;
    let held = s.uploads.held(&sha);
    if offset != held {
        let mut resp = ApiError::new(
            StatusCode::CONFLICT,
            ErrorType::InvalidRequestError,
            "offset_mismatch",
            format!("The registry holds {held} bytes of {sha}; send from there."),
        )
        .into_response();
        resp.headers_mut().insert(UPLOAD_OFFSET, HeaderValue::from(held));
        return Ok(resp);
    }
    if offset > size {
        return Err(ApiError::bad_request("invalid_value", format!("`size` {size} is below the bytes held ({held})."))
            .param("size"));
    }
    let part = s.uploads.part(&sha);
    std::fs::create_dir_all(&s.uploads.dir).map_err(|e| io_err(&s.uploads.dir, e))?;
    let mut f =
        tokio::fs::OpenOptions::new().create(true).append(true).open(&part).await.map_err(|e| io_err(&part, e))?;
    let mut written = 0u64;
    let mut stream = body.into_data_stream();
    let mut broke = None;
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                broke = Some(e.to_string());
                break;
            }
        };
        if offset + written + chunk.len() as u64 > size {
            drop(f);
            truncate(&part, offset + written);
            return Err(ApiError::bad_request("too_much_data", format!("The body goes past the file's {size} bytes.")));
        }
        f.write_all(&chunk).await.map_err(|e| io_err(&part, e))?;
        written += chunk.len() as u64;
    }
    // What arrived is kept (and synced) for a resume, even from a broken request.
    f.flush().await.map_err(|e| io_err(&part, e))?;
    f.sync_data().await.map_err(|e| io_err(&part, e))?;
    drop(f);
    let now = offset + written;
    if let Some(why) = broke {
        return Err(ApiError::bad_request(
            "upload_interrupted",
            format!("The body broke off after {written} bytes ({why}); {now} bytes are held, resume from there."),
        ));
    }
    if now < size {
        return Ok(status(&sha, now, false));
    }
    let want = sha.clone();
    let (actual, _) = crate::blobs::hash_file(&part, &|_| {}).await?;
    if actual != want {
        let _ = std::fs::remove_file(&part);
        s.reg.metrics().integrity_failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return Err(ApiError::bad_request(
            "checksum_mismatch",
            format!("The uploaded bytes hash to {actual}, not {want}; the upload was discarded."),
        ));
    }
    let stored = s.reg.store_upload(&part).await;
    let _ = std::fs::remove_file(&part);
    let stored = stored?;
    if stored.sha256 != sha {
        return Err(RegistryError::Corrupt(format!("{sha} changed on its way into the store")).into());
    }
    tracing::info!(sha256 = %sha, bytes = size, "stored an upload");
    Ok(status(&sha, size, true))
}

/// `POST /v1/models/{name}/revisions`.
pub(crate) async fn post_revision(
    State(s): State<AppState>,
    headers: HeaderMap,
    p: Result<Path<String>, PathRejection>,
    body: Body,
) -> Result<Response, ApiError> {
    s.auth.check(&headers, Access::Admin)?;
    let Path(name) = p.map_err(path_error)?;
    // A manifest of 10 000 files is about 1.5 MB.
    let bytes = read_body(&headers, body, s.max_body.max(4 << 20)).await?;
    let req: RevisionRequest = parse_json(&bytes)?;
    let rev = s.reg.record(&name, req).await?;
    Ok((StatusCode::CREATED, Json(rev)).into_response())
}

fn io_err(path: &std::path::Path, e: std::io::Error) -> ApiError {
    RegistryError::Internal(format!("{}: {e}", path.display())).into()
}

fn truncate(path: &std::path::Path, len: u64) {
    if let Ok(f) = std::fs::OpenOptions::new().write(true).open(path) {
        let _ = f.set_len(len);
    }
}
