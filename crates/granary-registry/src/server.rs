//! The registry's HTTP API.
//!
//! | route | access | does |
//! | --- | --- | --- |
//! | `GET /health` | open | `{"status":"ok"}` |
//! | `GET /metrics` | read | Prometheus text |
//! | `GET /v1/models` | read | every model and its revisions' names |
//! | `GET /v1/models/{name}` | read | a model with its revisions |
//! | `GET /v1/models/{name}/revisions/{rev}` | read | a revision (`rev` may be `latest`) |
//! | `GET /v1/models/{name}/revisions/{rev}/files/{path}/url` | read | a download URL of one file |
//! | `GET\|HEAD /v1/models/{name}/revisions/{rev}/files/{path}` | read | the file's bytes |
//! | `GET\|HEAD /v1/blobs/{sha256}` | read | a blob's bytes, `Range` supported |
//! | `POST /v1/models/import` | admin | import a revision → 201 |
//! | `DELETE /v1/models/{name}/revisions/{rev}` | admin | delete a revision → 204 |
//! | `DELETE /v1/models/{name}` | admin | delete a model → 204 |
//! | `POST /v1/gc?grace_s=N` | admin | delete unreferenced blobs older than N s (default 3600) |
//! | `GET /v1/uploads/{sha256}` | admin | how much of an upload the registry holds ([`crate::upload`]) |
//! | `PATCH /v1/uploads/{sha256}?size=N` | admin | append to an upload at `Upload-Offset` |
//! | `POST /v1/models/{name}/revisions` | admin | record a revision of uploaded files → 201 |
//!
//! Read access: the admin token or a read token as `Authorization: Bearer`,
//! or none with `anonymous_read`. Tokens are kept as sha256 digests and
//! compared in constant time. Every error is OpenAI-shaped JSON.
//!
//! A whole-blob GET is verified while it streams: the last chunk is held
//! back until the sha256 of everything before it checks out, and on a
//! mismatch the transfer is aborted (the client sees a broken body, never a
//! complete one) and counted in `granary_registry_integrity_failures_total`.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{MatchedPath, Path, RawQuery, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt as _;
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::api::{check_file_path, check_name, is_sha256, FileUrl, ImportRequest, ModelList, LATEST};
use crate::blobs::verifying_stream;
use crate::error::{ApiError, ErrorType, RegistryError};
use crate::service::{now_ms, Registry, RegistryConfig};
use crate::upload::{get_upload, patch_upload, post_revision, Uploads};

/// Who may do what, kept as token digests.
#[derive(Clone)]
pub(crate) struct Auth {
    admin: Option<[u8; 32]>,
    read: Vec<[u8; 32]>,
    anonymous_read: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    Read,
    Admin,
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl Auth {
    fn new(cfg: &RegistryConfig) -> Self {
        Auth {
            admin: cfg.admin_token.as_deref().filter(|t| !t.is_empty()).map(digest),
            read: cfg.read_tokens.iter().filter(|t| !t.is_empty()).map(|t| digest(t)).collect(),
            anonymous_read: cfg.anonymous_read,
        }
    }

    pub(crate) fn check(&self, headers: &HeaderMap, need: Access) -> Result<(), ApiError> {
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, t)| digest(t.trim()));
        let is_admin = match (&presented, &self.admin) {
            (Some(p), Some(a)) => bool::from(p.ct_eq(a)),
            _ => false,
        };
        let is_reader = presented
            .as_ref()
            .is_some_and(|p| self.read.iter().fold(subtle::Choice::from(0), |acc, r| acc | p.ct_eq(r)).into());
        match need {
            Access::Admin if self.admin.is_none() => Err(ApiError::forbidden(
                "admin_disabled",
                "No admin token is configured: start the registry with --admin-token to allow changes.",
            )),
            Access::Admin if is_admin => Ok(()),
            Access::Admin if is_reader => Err(ApiError::forbidden(
                "insufficient_permissions",
                "This needs the admin token; a read token was given.",
            )),
            Access::Read if is_admin || is_reader || self.anonymous_read => Ok(()),
            _ if presented.is_none() => {
                Err(ApiError::unauthorized("No token given. Send it as `Authorization: Bearer <token>`."))
            }
            _ => Err(ApiError::unauthorized("Incorrect token provided.")),
        }
    }
}

#[derive(Clone)]
pub(crate) struct AppState {
    pub(crate) reg: Arc<Registry>,
    pub(crate) auth: Auth,
    public_url: Option<String>,
    local_addr: Option<SocketAddr>,
    url_ttl: Duration,
    pub(crate) max_body: usize,
    pub(crate) uploads: Arc<Uploads>,
}

/// The registry's routes, state applied. `local_addr` is a fallback for
/// blob URLs when neither `public_url` nor the request's `Host` is known.
pub fn router(reg: Arc<Registry>, cfg: &RegistryConfig, local_addr: Option<SocketAddr>) -> Router {
    let state =
        AppState {
            reg,
            auth: Auth::new(cfg),
            public_url: cfg.public_url.as_ref().map(|u| u.trim_end_matches('/').to_string()),
            local_addr,
            url_ttl: cfg.url_ttl,
            max_body: cfg.max_body,
            uploads: Arc::new(Uploads::new(cfg.upload_dir.clone().unwrap_or_else(|| {
                std::env::temp_dir().join(format!("granary-registry-uploads-{}", std::process::id()))
            }))),
        };
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(list_models))
        .route("/v1/models/import", post(import))
        .route("/v1/models/{name}", get(get_model).delete(delete_model))
        .route("/v1/models/{name}/revisions/{rev}", get(get_revision).delete(delete_revision))
        .route("/v1/models/{name}/revisions/{rev}/files/{*rest}", get(get_file))
        .route("/v1/blobs/{sha256}", get(get_blob))
        .route("/v1/gc", post(gc))
        .route("/v1/models/{name}/revisions", post(post_revision))
        .route("/v1/uploads/{sha256}", get(get_upload).patch(patch_upload))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(state.clone(), count_requests))
        .with_state(state)
}

/// Opens the registry and serves it on `listener` until `shutdown`
/// completes. Prints nothing; the caller says where it listens.
pub async fn serve(
    cfg: RegistryConfig,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let reg = Arc::new(Registry::open(&cfg).await?);
    serve_registry(reg, &cfg, listener, shutdown).await
}

/// As [`serve`], for a registry already open.
pub async fn serve_registry(
    reg: Arc<Registry>,
    cfg: &RegistryConfig,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let app = router(reg, cfg, listener.local_addr().ok());
    granary_core::serve::serve_http(listener, app, cfg.http, shutdown).await?;
    Ok(())
}

async fn count_requests(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let route: &'static str = match req.extensions().get::<MatchedPath>().map(MatchedPath::as_str) {
        Some("/health") => "/health",
        Some("/metrics") => "/metrics",
        Some("/v1/models") => "/v1/models",
        Some("/v1/models/import") => "/v1/models/import",
        Some("/v1/models/{name}") => "/v1/models/{name}",
        Some("/v1/models/{name}/revisions/{rev}") => "/v1/models/{name}/revisions/{rev}",
        Some("/v1/models/{name}/revisions/{rev}/files/{*rest}") => "/v1/models/{name}/revisions/{rev}/files/{*rest}",
        Some("/v1/blobs/{sha256}") => "/v1/blobs/{sha256}",
        Some("/v1/gc") => "/v1/gc",
        Some("/v1/models/{name}/revisions") => "/v1/models/{name}/revisions",
        Some("/v1/uploads/{sha256}") => "/v1/uploads/{sha256}",
        _ => "unmatched",
    };
    let method: &'static str = match *req.method() {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        _ => "other",
    };
    let resp = next.run(req).await;
    state.reg.metrics().http(method, route, resp.status().as_u16());
    resp
}

async fn not_found() -> ApiError {
    ApiError::not_found("not_found", "No such route.")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        ErrorType::InvalidRequestError,
        "method_not_allowed",
        "Method not allowed on this route.",
    )
}

async fn health() -> Json<serde_json::Value> {
    Json(serde_json::json!({"status": "ok"}))
}

async fn metrics(State(s): State<AppState>, headers: HeaderMap) -> Result<Response, ApiError> {
    s.auth.check(&headers, Access::Read)?;
    let counts = match s.reg.catalog().counts().await {
        Ok(c) => Some(c),
        Err(e) => {
            tracing::warn!(error = %e, "catalog counts for /metrics");
            None
        }
    };
    let text = s.reg.metrics().render(counts);
    Ok(([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], text).into_response())
}

pub(crate) fn path_error(e: PathRejection) -> ApiError {
    ApiError::bad_request("invalid_path", format!("Invalid path: {}", e.body_text()))
}

fn valid_name(name: &str) -> Result<(), ApiError> {
    check_name(name)
        .map_err(|m| ApiError::bad_request("invalid_value", format!("Invalid model name: {m}.")).param("name"))
}

fn valid_rev(rev: &str) -> Result<(), ApiError> {
    if rev == LATEST {
        return Ok(());
    }
    crate::api::check_revision(rev)
        .map_err(|m| ApiError::bad_request("invalid_value", format!("Invalid revision: {m}.")).param("revision"))
}

async fn list_models(State(s): State<AppState>, headers: HeaderMap) -> Result<Json<ModelList>, ApiError> {
    s.auth.check(&headers, Access::Read)?;
    Ok(Json(ModelList { models: s.reg.catalog().list().await? }))
}

async fn get_model(
    State(s): State<AppState>,
    headers: HeaderMap,
    name: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    s.auth.check(&headers, Access::Read)?;
    let Path(name) = name.map_err(path_error)?;
    valid_name(&name)?;
    match s.reg.catalog().model(&name).await? {
        Some(m) => Ok(Json(m).into_response()),
        None => Err(ApiError::not_found("model_not_found", format!("No model named {name}."))),
    }
}

async fn revision_of(s: &AppState, name: &str, rev: &str) -> Result<crate::api::Revision, ApiError> {
    valid_name(name)?;
    valid_rev(rev)?;
    match s.reg.catalog().revision(name, rev).await? {
        Some(r) => Ok(r),
        None if rev == LATEST => Err(ApiError::not_found("model_not_found", format!("No model named {name}."))),
        None => Err(ApiError::not_found("revision_not_found", format!("No revision {rev} of model {name}."))),
    }
}

async fn get_revision(
    State(s): State<AppState>,
    headers: HeaderMap,
    p: Result<Path<(String, String)>, PathRejection>,
) -> Result<Response, ApiError> {
    s.auth.check(&headers, Access::Read)?;
    let Path((name, rev)) = p.map_err(path_error)?;
    Ok(Json(revision_of(&s, &name, &rev).await?).into_response())
}

async fn get_file(
    State(s): State<AppState>,
    method: Method,
    headers: HeaderMap,
    p: Result<Path<(String, String, String)>, PathRejection>,
) -> Result<Response, ApiError> {
    s.auth.check(&headers, Access::Read)?;
    let Path((name, rev, rest)) = p.map_err(path_error)?;
    let revision = revision_of(&s, &name, &rev).await?;
    let check = |p: &str| {
        check_file_path(p)
            .map_err(|m| ApiError::bad_request("unsafe_path", format!("Invalid file path: {m}.")).param("path"))
    };
    // `…/files/{path}/url` asks for a URL, unless a file is named so.
    if let Some(path) = rest.strip_suffix("/url") {
        check(path)?;
        if let Some(f) = revision.file(path) {
            if method == Method::HEAD {
                return Err(ApiError::new(
                    StatusCode::METHOD_NOT_ALLOWED,
                    ErrorType::InvalidRequestError,
                    "method_not_allowed",
                    "Use GET for a download URL.",
                ));
            }
            return file_url(&s, &headers, f).await.map(|u| Json(u).into_response());
        }
    }
    check(&rest)?;
    let Some(f) = revision.file(&rest) else {
        return Err(ApiError::not_found("file_not_found", format!("{name}@{} has no file {rest}.", revision.revision)));
    };
    send_blob(&s, &f.sha256, f.size, &method, &headers).await
}

async fn file_url(s: &AppState, headers: &HeaderMap, f: &crate::api::FileEntry) -> Result<FileUrl, ApiError> {
    let expires_at = now_ms() / 1000 + s.url_ttl.as_secs() as i64;
    if let Some(url) = s.reg.blobs().presign(&f.sha256, s.url_ttl).await? {
        s.reg.metrics().presigned_urls.fetch_add(1, Relaxed);
        return Ok(FileUrl {
            url: url.to_string(),
            expires_at,
            size: f.size,
            sha256: f.sha256.clone(),
            presigned: true,
        });
    }
    let base = match (&s.public_url, headers.get(header::HOST).and_then(|h| h.to_str().ok()), s.local_addr) {
        (Some(u), _, _) => u.clone(),
        (None, Some(host), _) => format!("{}://{host}", request_scheme(headers)),
        (None, None, Some(addr)) => format!("http://{addr}"),
        (None, None, None) => {
            return Err(ApiError::internal(&"no public URL configured and no Host header"));
        }
    };
    Ok(FileUrl {
        url: format!("{base}/v1/blobs/{}", f.sha256),
        expires_at,
        size: f.size,
        sha256: f.sha256.clone(),
        presigned: false,
    })
}

/// The scheme the client used, as a TLS-terminating proxy in front reports
/// it (`Forwarded: proto=…`, else `X-Forwarded-Proto`); `http` without one
/// (this server itself speaks plain HTTP). Only `http` and `https` are taken.
fn request_scheme(headers: &HeaderMap) -> &'static str {
    let forwarded = headers.get("forwarded").and_then(|v| v.to_str().ok()).and_then(|v| {
        // The first proxy's element: `for=…;proto=https;host=…`.
        let first = v.split(',').next()?;
        first.split(';').find_map(|pair| {
            let (k, val) = pair.trim().split_once('=')?;
            k.trim().eq_ignore_ascii_case("proto").then(|| val.trim().trim_matches('"').to_string())
        })
    });
    let proto = forwarded.or_else(|| {
        let v = headers.get("x-forwarded-proto")?.to_str().ok()?;
        Some(v.split(',').next()?.trim().to_string())
    });
    match proto {
        Some(p) if p.eq_ignore_ascii_case("https") => "https",
        _ => "http",
    }
}

async fn get_blob(
    State(s): State<AppState>,
    method: Method,
    headers: HeaderMap,
    p: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    s.auth.check(&headers, Access::Read)?;
    let Path(sha) = p.map_err(path_error)?;
    if !is_sha256(&sha) {
        return Err(ApiError::bad_request(
            "invalid_value",
            "A blob is named by its sha256: 64 lowercase hex characters.",
        )
        .param("sha256"));
    }
    // Only blobs some revision references are served (and their size is
    // known from the catalog).
    let Some(size) = s.reg.catalog().blob_size(&sha).await? else {
        return Err(ApiError::not_found("blob_not_found", format!("No file has the sha256 {sha}.")));
    };
    send_blob(&s, &sha, size, &method, &headers).await
}

/// A `Range: bytes=…` header against a blob of `size` bytes: `None` to send
/// the whole (no header, or one this server does not honour, such as
/// several ranges), `Some(Ok(range))` for a part, `Some(Err(()))` when it
/// cannot be satisfied.
fn parse_range(value: &str, size: u64) -> Option<Result<std::ops::Range<u64>, ()>> {
    let spec = value.trim().strip_prefix("bytes=")?.trim();
    if spec.contains(',') {
        return None;
    }
    let (a, b) = spec.split_once('-')?;
    let (a, b) = (a.trim(), b.trim());
    let range = if a.is_empty() {
        let n: u64 = b.parse().ok()?;
        if n == 0 {
            return Some(Err(()));
        }
        size.saturating_sub(n)..size
    } else {
        let start: u64 = a.parse().ok()?;
        let end = if b.is_empty() {
            size
        } else {
            let last: u64 = b.parse().ok()?;
            if last < start {
                return None;
            }
            last.saturating_add(1).min(size)
        };
        start..end
    };
    if range.start >= size || range.is_empty() {
        return Some(Err(()));
    }
    Some(Ok(range))
}

fn corrupt(s: &AppState, why: String) -> ApiError {
    s.reg.metrics().integrity_failures.fetch_add(1, Relaxed);
    RegistryError::Corrupt(why).into()
}

async fn send_blob(
    s: &AppState,
    sha: &str,
    size: u64,
    method: &Method,
    headers: &HeaderMap,
) -> Result<Response, ApiError> {
    let etag = format!("\"{sha}\"");
    let common = |mut resp: Response| {
        let h = resp.headers_mut();
        h.insert(header::ETAG, HeaderValue::from_str(&etag).expect("hex is a valid header value"));
        h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("private, max-age=31536000, immutable"));
        resp
    };
    if headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == etag || t.trim() == "*"))
    {
        return Ok(common(StatusCode::NOT_MODIFIED.into_response()));
    }
    let range = match headers.get(header::RANGE).and_then(|v| v.to_str().ok()).and_then(|v| parse_range(v, size)) {
        Some(Err(())) => {
            let mut resp = ApiError::new(
                StatusCode::RANGE_NOT_SATISFIABLE,
                ErrorType::InvalidRequestError,
                "range_not_satisfiable",
                format!("The range is outside the blob's {size} bytes."),
            )
            .into_response();
            resp.headers_mut()
                .insert(header::CONTENT_RANGE, HeaderValue::from_str(&format!("bytes */{size}")).expect("ascii"));
            return Ok(common(resp));
        }
        Some(Ok(r)) => Some(r),
        None => None,
    };
    if *method == Method::HEAD {
        match s.reg.blobs().head(sha).await? {
            Some(n) if n == size => {}
            Some(n) => return Err(corrupt(s, format!("stored blob {sha} has {n} bytes; the catalog says {size}"))),
            None => return Err(corrupt(s, format!("stored blob {sha} is missing from the store"))),
        }
        let (status, len) = match &range {
            Some(r) => (StatusCode::PARTIAL_CONTENT, r.end - r.start),
            None => (StatusCode::OK, size),
        };
        let mut resp = status.into_response();
        resp.headers_mut().insert(header::CONTENT_LENGTH, HeaderValue::from(len));
        if let Some(r) = &range {
            resp.headers_mut().insert(
                header::CONTENT_RANGE,
                HeaderValue::from_str(&format!("bytes {}-{}/{size}", r.start, r.end - 1)).expect("ascii"),
            );
        }
        return Ok(common(resp));
    }
    let reading = match s.reg.blobs().get(sha, range.clone()).await {
        Ok(r) => r,
        Err(RegistryError::NotFound { .. }) => {
            return Err(corrupt(s, format!("stored blob {sha} is missing from the store")))
        }
        Err(e) => return Err(e.into()),
    };
    if reading.total != size {
        return Err(corrupt(s, format!("stored blob {sha} has {} bytes; the catalog says {size}", reading.total)));
    }
    let reg = s.reg.clone();
    let sent = reading.stream;
    let mut resp = match range {
        Some(r) => {
            let len = r.end - r.start;
            let counted = sent.map(move |c| {
                if let Ok(b) = &c {
                    reg.metrics().blob_sent_bytes.fetch_add(b.len() as u64, Relaxed);
                }
                c.map_err(std::io::Error::other)
            });
            let mut resp = Response::new(Body::from_stream(counted));
            *resp.status_mut() = StatusCode::PARTIAL_CONTENT;
            resp.headers_mut().insert(header::CONTENT_LENGTH, HeaderValue::from(len));
            resp.headers_mut().insert(
                header::CONTENT_RANGE,
                HeaderValue::from_str(&format!("bytes {}-{}/{size}", r.start, r.end - 1)).expect("ascii"),
            );
            resp
        }
        None => {
            let on_bad = {
                let reg = reg.clone();
                move |why: String| {
                    tracing::error!(error = %why, "integrity failure: aborting the transfer");
                    reg.metrics().integrity_failures.fetch_add(1, Relaxed);
                }
            };
            let verified = verifying_stream(sent, sha.to_string(), size, on_bad).map(move |c| {
                if let Ok(b) = &c {
                    reg.metrics().blob_sent_bytes.fetch_add(b.len() as u64, Relaxed);
                }
                c
            });
            let mut resp = Response::new(Body::from_stream(verified));
            resp.headers_mut().insert(header::CONTENT_LENGTH, HeaderValue::from(size));
            resp
        }
    };
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
    Ok(common(resp))
}

/// Reads a request body, refusing one over `limit` with 413.
pub(crate) async fn read_body(headers: &HeaderMap, body: Body, limit: usize) -> Result<Vec<u8>, ApiError> {
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::too_large(limit));
    }
    let mut out = Vec::new();
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk =
            chunk.map_err(|e| ApiError::bad_request("invalid_request_body", format!("Reading the body: {e}")))?;
        if out.len() + chunk.len() > limit {
            return Err(ApiError::too_large(limit));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

/// Parses a JSON body, naming the field at fault.
pub(crate) fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        if !e.inner().is_data() {
            return ApiError::bad_request("invalid_request_body", format!("The body is not valid JSON: {}", e.inner()));
        }
        let inner = e.inner().to_string();
        let path = e.path().to_string();
        // A missing field is reported on the object that should hold it;
        // name the field itself.
        let missing = inner.strip_prefix("missing field `").and_then(|r| r.split('`').next());
        let param = match (path.as_str(), missing) {
            (".", Some(f)) => f.to_string(),
            (p, Some(f)) => format!("{p}.{f}"),
            (".", None) => String::new(),
            (p, None) => p.to_string(),
        };
        let unknown = inner.strip_prefix("unknown field `").and_then(|r| r.split('`').next());
        let param = match (param.is_empty(), unknown) {
            (true, Some(f)) => f.to_string(),
            _ => param,
        };
        if param.is_empty() {
            ApiError::bad_request("invalid_request_body", format!("Invalid JSON body: {inner}"))
        } else {
            ApiError::bad_request("invalid_request_body", format!("Invalid JSON body at `{param}`: {inner}"))
                .param(param)
        }
    })
}

async fn import(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    s.auth.check(&headers, Access::Admin)?;
    let bytes = read_body(&headers, body, s.max_body).await?;
    let req: ImportRequest = parse_json(&bytes)?;
    // Run to the end even if the client goes away: a half-done import
    // would only leave blobs to collect.
    let reg = s.reg.clone();
    let rev = tokio::spawn(async move { reg.import(req).await })
        .await
        .map_err(|e| ApiError::internal(&format!("import task: {e}")))??;
    Ok((StatusCode::CREATED, Json(rev)).into_response())
}

async fn delete_model(
    State(s): State<AppState>,
    headers: HeaderMap,
    p: Result<Path<String>, PathRejection>,
) -> Result<StatusCode, ApiError> {
    s.auth.check(&headers, Access::Admin)?;
    let Path(name) = p.map_err(path_error)?;
    valid_name(&name)?;
    s.reg.delete(&name, None).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn delete_revision(
    State(s): State<AppState>,
    headers: HeaderMap,
    p: Result<Path<(String, String)>, PathRejection>,
) -> Result<StatusCode, ApiError> {
    s.auth.check(&headers, Access::Admin)?;
    let Path((name, rev)) = p.map_err(path_error)?;
    valid_name(&name)?;
    valid_rev(&rev)?;
    s.reg.delete(&name, Some(&rev)).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn gc(State(s): State<AppState>, headers: HeaderMap, RawQuery(q): RawQuery) -> Result<Response, ApiError> {
    s.auth.check(&headers, Access::Admin)?;
    let mut grace = Duration::from_secs(3600);
    for (k, v) in url::form_urlencoded::parse(q.unwrap_or_default().as_bytes()) {
        match k.as_ref() {
            "grace_s" => {
                let n: u64 = v.parse().map_err(|_| {
                    ApiError::bad_request(
                        "invalid_value",
                        format!("Invalid `grace_s`: {v:?} is not a number of seconds."),
                    )
                    .param("grace_s")
                })?;
                grace = Duration::from_secs(n);
            }
            other => {
                return Err(ApiError::bad_request("unknown_parameter", format!("Unknown query parameter `{other}`."))
                    .param(other.to_string()))
            }
        }
    }
    let report = s.reg.gc(grace).await?;
    Ok(Json(report).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        assert_eq!(parse_range("bytes=0-9", 100), Some(Ok(0..10)));
        assert_eq!(parse_range("bytes=90-", 100), Some(Ok(90..100)));
        assert_eq!(parse_range("bytes=-10", 100), Some(Ok(90..100)));
        assert_eq!(parse_range("bytes=-1000", 100), Some(Ok(0..100)));
        assert_eq!(parse_range("bytes=50-1000", 100), Some(Ok(50..100)));
        assert_eq!(parse_range("bytes=100-", 100), Some(Err(())));
        assert_eq!(parse_range("bytes=-0", 100), Some(Err(())));
        assert_eq!(parse_range("bytes=9-3", 100), None);
        assert_eq!(parse_range("bytes=0-1,5-6", 100), None);
        assert_eq!(parse_range("items=0-1", 100), None);
        assert_eq!(parse_range("bytes=x-1", 100), None);
    }

    #[test]
    fn blob_urls_follow_the_scheme_a_proxy_reports() {
        let h = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.insert(*k, HeaderValue::from_static(v));
            }
            h
        };
        assert_eq!(request_scheme(&h(&[])), "http");
        assert_eq!(request_scheme(&h(&[("x-forwarded-proto", "https")])), "https");
        assert_eq!(request_scheme(&h(&[("x-forwarded-proto", "https, http")])), "https");
        assert_eq!(request_scheme(&h(&[("forwarded", "for=192.0.2.60;proto=HTTPS;by=203.0.113.43")])), "https");
        assert_eq!(request_scheme(&h(&[("forwarded", "for=a;proto=\"https\", for=b;proto=http")])), "https");
        assert_eq!(
            request_scheme(&h(&[("forwarded", "for=a;proto=http"), ("x-forwarded-proto", "https")])),
            "http",
            "Forwarded wins"
        );
        assert_eq!(request_scheme(&h(&[("x-forwarded-proto", "gopher")])), "http");
    }

    #[test]
    fn tokens_grant_what_they_should() {
        let mut cfg = RegistryConfig::new("sqlite::memory:", "file:///tmp/x");
        cfg.admin_token = Some("admin-secret-0123456789".into());
        cfg.read_tokens = vec!["reader-secret-0123456789".into()];
        let auth = Auth::new(&cfg);
        let h = |t: Option<&str>| {
            let mut h = HeaderMap::new();
            if let Some(t) = t {
                h.insert(header::AUTHORIZATION, HeaderValue::from_str(&format!("Bearer {t}")).unwrap());
            }
            h
        };
        let status = |r: Result<(), ApiError>| r.err().map(|e| e.status.as_u16());
        assert_eq!(status(auth.check(&h(Some("admin-secret-0123456789")), Access::Admin)), None);
        assert_eq!(status(auth.check(&h(Some("admin-secret-0123456789")), Access::Read)), None);
        assert_eq!(status(auth.check(&h(Some("reader-secret-0123456789")), Access::Read)), None);
        assert_eq!(status(auth.check(&h(Some("reader-secret-0123456789")), Access::Admin)), Some(403));
        assert_eq!(status(auth.check(&h(Some("wrong")), Access::Read)), Some(401));
        assert_eq!(status(auth.check(&h(None), Access::Read)), Some(401));
        assert_eq!(status(auth.check(&h(None), Access::Admin)), Some(401));
        cfg.admin_token = None;
        cfg.anonymous_read = true;
        let auth = Auth::new(&cfg);
        assert_eq!(status(auth.check(&h(None), Access::Read)), None);
        let e = auth.check(&h(Some("anything")), Access::Admin).unwrap_err();
        assert_eq!((e.status.as_u16(), e.code), (403, "admin_disabled"));
    }

    #[test]
    fn json_errors_name_the_field() {
        let e = parse_json::<ImportRequest>(br#"{"source":"dir:/x"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("name"));
        let e = parse_json::<ImportRequest>(br#"{"name":1,"source":"dir:/x"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("name"));
        let e = parse_json::<ImportRequest>(br#"{"name":"a","source":"dir:/x","nope":true}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("nope"));
        let e = parse_json::<ImportRequest>(b"{not json").unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.param.is_none());
    }
}
