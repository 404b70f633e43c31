//! The warehouse's HTTP server: the block API for engines and routers, and
//! the admin endpoints for operators.
//!
//! - `PUT|GET|HEAD|DELETE /v1/blocks/{namespace}/{hash}`: one encoded
//!   [`granary_core::KvBlock`], stored as-is under the hash's hex text;
//! - `POST /v1/lookup`: the longest cached prefix of a list of hashes;
//! - `GET /v1/events`: `stored` / `removed` events as Server-Sent Events;
//! - `/health`, `/ready` (no auth), `/metrics`, `/stats`, `/cache/list`,
//!   `/cache/get` (admin token).
//!
//! Clients authenticate with `Authorization: Bearer <token>`: a namespace
//! token opens its own namespace, the admin token opens all of them and the
//! admin endpoints, a metrics token opens `/metrics` alone. Token checks
//! come before a request body is read. A server with no token configured is open for the data
//! endpoints. Every failure is answered by [`error::ApiError`] in one JSON
//! shape. [`serve`] counts connections and bytes at the socket and refuses
//! one past `max_connections` with a 503 (`too_many_connections`), and
//! closes a connection whose client takes longer than `header_timeout_secs`
//! to send a request's headers (slowloris, or a kept-alive connection left
//! idle); a middleware counts requests and times them for `/metrics`.

mod admin;
mod blocks;
pub mod error;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::auth::Principal;
use crate::metrics::HttpMetrics;
use crate::server::ServerCtx;
use error::ApiError;

/// Route templates (also the `route` label of the latency histogram).
pub const ROUTE_BLOCK: &str = "/v1/blocks/{namespace}/{key}";
pub const ROUTE_LOOKUP: &str = "/v1/lookup";
pub const ROUTE_EVENTS: &str = "/v1/events";
pub const ROUTE_HEALTH: &str = "/health";
pub const ROUTE_READY: &str = "/ready";
pub const ROUTE_METRICS: &str = "/metrics";
pub const ROUTE_STATS: &str = "/stats";
pub const ROUTE_CACHE_LIST: &str = "/cache/list";
pub const ROUTE_CACHE_GET: &str = "/cache/get";
const ROUTES: [&str; 9] = [
    ROUTE_BLOCK,
    ROUTE_LOOKUP,
    ROUTE_EVENTS,
    ROUTE_HEALTH,
    ROUTE_READY,
    ROUTE_METRICS,
    ROUTE_STATS,
    ROUTE_CACHE_LIST,
    ROUTE_CACHE_GET,
];

/// Most hashes accepted by one `POST /v1/lookup`.
pub const MAX_LOOKUP_KEYS: usize = 4096;
/// Body limit of `POST /v1/lookup` (room for [`MAX_LOOKUP_KEYS`] quoted hashes).
const LOOKUP_BODY_LIMIT: usize = 1 << 20;

/// What every handler sees.
#[derive(Clone)]
struct AppState {
    ctx: Arc<ServerCtx>,
    metrics: HttpMetrics,
    started: Instant,
    /// Cancelled when the server shuts down, ending event streams.
    shutdown: CancellationToken,
    /// Largest accepted block body.
    body_limit: u64,
}

/// Marks an answer with an error status that is still a normal outcome
/// (a cache miss, an NX put that found the key), so it is not counted as an error.
#[derive(Clone, Copy)]
struct NormalAnswer;

fn mark_normal(mut r: Response) -> Response {
    r.extensions_mut().insert(NormalAnswer);
    r
}

/// The router over `ctx`. Event streams opened through it end only when
/// their client leaves; [`serve`] also ends them at shutdown.
pub fn router(ctx: Arc<ServerCtx>) -> Router {
    build(ctx, CancellationToken::new())
}

fn build(ctx: Arc<ServerCtx>, shutdown: CancellationToken) -> Router {
    let body_limit = ctx.store.config().max_value.as_u64();
    let state = AppState { ctx, metrics: HttpMetrics::default(), started: Instant::now(), shutdown, body_limit };
    let block_limit = usize::try_from(body_limit).unwrap_or(usize::MAX);
    Router::new()
        .route(
            ROUTE_BLOCK,
            get(blocks::get_block)
                .head(blocks::head_block)
                .put(blocks::put_block)
                .delete(blocks::delete_block)
                .layer(DefaultBodyLimit::max(block_limit)),
        )
        .route(ROUTE_LOOKUP, post(blocks::lookup).layer(DefaultBodyLimit::max(LOOKUP_BODY_LIMIT)))
        .route(ROUTE_EVENTS, get(blocks::events))
        .route(ROUTE_HEALTH, get(admin::health))
        .route(ROUTE_READY, get(admin::ready))
        .route(ROUTE_METRICS, get(admin::metrics))
        .route(ROUTE_STATS, get(admin::stats))
        .route(ROUTE_CACHE_LIST, get(admin::cache_list))
        .route(ROUTE_CACHE_GET, get(admin::cache_get))
        .fallback(unknown_path)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(state.clone(), track))
        .with_state(state)
}

async fn unknown_path() -> ApiError {
    ApiError::not_found("unknown_path", "no such endpoint")
}

async fn method_not_allowed() -> ApiError {
    ApiError::method_not_allowed()
}

fn method_label(m: &Method) -> &'static str {
    match *m {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::PUT => "PUT",
        Method::POST => "POST",
        Method::DELETE => "DELETE",
        _ => "other",
    }
}

/// The `warehouse_op` span of a block-API request, continuing the caller's
/// trace (other routes get none: health checks and scrapes are no traces).
fn op_span(method: &'static str, route: &str, headers: &HeaderMap) -> Option<tracing::Span> {
    let op = match (route, method) {
        (ROUTE_LOOKUP, _) => "lookup",
        (ROUTE_BLOCK, "GET") => "get",
        (ROUTE_BLOCK, "HEAD") => "head",
        (ROUTE_BLOCK, "PUT") => "put",
        (ROUTE_BLOCK, "DELETE") => "delete",
        _ => return None,
    };
    let span = tracing::info_span!(
        "warehouse_op",
        "otel.kind" = "server",
        "granary.warehouse.op" = op,
        "granary.warehouse.keys" = tracing::field::Empty,
        "granary.warehouse.matched" = tracing::field::Empty,
        "granary.warehouse.tier" = tracing::field::Empty,
        "http.response.status_code" = tracing::field::Empty,
    );
    if op != "lookup" {
        span.record("granary.warehouse.keys", 1);
    }
    granary_core::trace::continue_from(&span, headers);
    Some(span)
}

/// Counts each request in `ctx.http` and times it for the histogram.
async fn track(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let start = Instant::now();
    let method = method_label(req.method());
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .and_then(|m| ROUTES.iter().copied().find(|r| *r == m.as_str()))
        .unwrap_or("unmatched");
    let resp = match op_span(method, route, req.headers()) {
        Some(span) => {
            let resp = next.run(req).instrument(span.clone()).await;
            span.record("http.response.status_code", resp.status().as_u16());
            if let Some(tier) = resp.headers().get("x-granary-tier").and_then(|v| v.to_str().ok()) {
                span.record("granary.warehouse.tier", tier);
            }
            resp
        }
        None => next.run(req).await,
    };
    let status = resp.status();
    let http = &st.ctx.http;
    if status.as_u16() < 400 || resp.extensions().get::<NormalAnswer>().is_some() {
        http.requests_ok.fetch_add(1, Relaxed);
    } else {
        http.requests_error.fetch_add(1, Relaxed);
    }
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        http.protocol_errors.fetch_add(1, Relaxed);
    }
    st.metrics.observe(method, route, status.as_u16(), start.elapsed());
    resp
}

/// Who may do what on a data endpoint.
enum Access {
    /// No token is configured: every namespace is open.
    Open,
    As(Principal),
}

impl Access {
    fn may_access(&self, ns: &str) -> bool {
        match self {
            Access::Open => true,
            Access::As(p) => p.may_access(ns),
        }
    }

    fn check(&self, ns: &str) -> Result<(), ApiError> {
        if self.may_access(ns) {
            Ok(())
        } else {
            Err(ApiError::forbidden("namespace_forbidden", "this token does not grant access to the namespace")
                .param("namespace"))
        }
    }
}

/// The bearer token of a request, if any; an `Authorization` header of
/// another scheme is an error rather than silently ignored.
fn bearer(headers: &HeaderMap) -> Result<Option<&[u8]>, ApiError> {
    let Some(v) = headers.get(axum::http::header::AUTHORIZATION) else { return Ok(None) };
    let v = v.as_bytes();
    match v.split_at_checked(7) {
        Some((scheme, token)) if scheme.eq_ignore_ascii_case(b"bearer ") && !token.trim_ascii().is_empty() => {
            Ok(Some(token.trim_ascii()))
        }
        _ => Err(ApiError::unauthenticated("invalid_authorization", "Authorization must be 'Bearer <token>'")),
    }
}

fn authenticate(st: &AppState, headers: &HeaderMap) -> Result<Principal, ApiError> {
    let token = bearer(headers)?
        .ok_or_else(|| ApiError::unauthenticated("missing_credentials", "missing 'Authorization: Bearer <token>'"))?;
    st.ctx.auth.authenticate(None, token).ok_or_else(|| ApiError::unauthenticated("invalid_token", "invalid token"))
}

fn data_access(st: &AppState, headers: &HeaderMap) -> Result<Access, ApiError> {
    if st.ctx.auth.is_open() {
        return Ok(Access::Open);
    }
    match authenticate(st, headers)? {
        Principal::Metrics => {
            Err(ApiError::forbidden("metrics_only", "this token opens /metrics only").param("authorization"))
        }
        p => Ok(Access::As(p)),
    }
}

fn admin_access(st: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    if !st.ctx.auth.has_admin() {
        return Err(ApiError::forbidden("no_admin_token", "no admin token configured"));
    }
    match authenticate(st, headers)? {
        Principal::Admin => Ok(()),
        Principal::Namespace(_) | Principal::Metrics => {
            Err(ApiError::forbidden("admin_required", "this endpoint needs the admin token"))
        }
    }
}

/// `/metrics`: the admin token or the metrics-only token.
fn metrics_access(st: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    if !st.ctx.auth.has_admin() && !st.ctx.auth.has_metrics() {
        return Err(ApiError::forbidden("no_admin_token", "no admin token configured"));
    }
    match authenticate(st, headers)? {
        Principal::Admin | Principal::Metrics => Ok(()),
        Principal::Namespace(_) => {
            Err(ApiError::forbidden("admin_required", "this endpoint needs the admin or the metrics token"))
        }
    }
}

/// Query parameters, decoded once; getters name the parameter in errors.
struct Params(Vec<(String, String)>);

impl Params {
    fn parse(raw: Option<&str>) -> Params {
        Params(url::form_urlencoded::parse(raw.unwrap_or("").as_bytes()).into_owned().collect())
    }

    fn get(&self, name: &str) -> Option<&str> {
        self.0.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    fn required(&self, name: &'static str) -> Result<&str, ApiError> {
        self.get(name).ok_or_else(|| ApiError::invalid(name, "missing_parameter", format!("missing {name}")))
    }

    fn u64(&self, name: &'static str, min: u64, max: u64) -> Result<Option<u64>, ApiError> {
        let Some(v) = self.get(name) else { return Ok(None) };
        match v.parse::<u64>() {
            Ok(n) if (min..=max).contains(&n) => Ok(Some(n)),
            _ => Err(ApiError::invalid(
                name,
                "invalid_parameter",
                format!("{name} must be an integer from {min} to {max}"),
            )),
        }
    }

    fn flag(&self, name: &'static str) -> Result<bool, ApiError> {
        match self.get(name) {
            None => Ok(false),
            Some("true" | "1" | "yes") => Ok(true),
            Some("false" | "0" | "no") => Ok(false),
            Some(_) => Err(ApiError::invalid(name, "invalid_parameter", format!("{name} must be true or false"))),
        }
    }
}

/// Serves `router(ctx)` on `listener` until `shutdown` resolves, then
/// ends event streams and waits for in-flight requests.
///
/// Each connection is HTTP/1.1 through hyper with a timer, so that
/// `header_timeout_secs` closes one whose client does not finish a
/// request's headers in time.
pub async fn serve(
    listener: TcpListener,
    ctx: Arc<ServerCtx>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::serve::Listener as _;
    let token = CancellationToken::new();
    let app = build(ctx.clone(), token.clone());
    let header_timeout = ctx.limits.header_timeout();
    let mut listener = CountingListener { inner: listener, ctx };
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (io, peer) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => accepted,
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(header_timeout);
        let conn = graceful.watch(http.serve_connection(hyper_util::rt::TokioIo::new(io), service));
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "HTTP connection ended with an error");
            }
        });
    }
    // Event streams end first; then the requests in flight finish.
    token.cancel();
    graceful.shutdown().await;
    Ok(())
}

/// A TCP listener whose connections count themselves in `ctx.http` and
/// are refused past `ctx.limits.max_connections`.
struct CountingListener {
    inner: TcpListener,
    ctx: Arc<ServerCtx>,
}

impl axum::serve::Listener for CountingListener {
    type Io = CountedStream;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let (stream, addr) = granary_core::serve::accept(&self.inner).await;
            if self.ctx.http.connections_open.load(Relaxed) >= self.ctx.limits.max_connections as u64 {
                // Past the cap: told why in the usual JSON shape, then
                // closed. `try_write` so that a client that never reads
                // cannot stall the accept loop; the answer fits in an
                // empty socket buffer.
                self.ctx.http.requests_error.fetch_add(1, Relaxed);
                let _ = stream.try_write(granary_core::serve::too_many_connections().as_bytes());
                continue;
            }
            let _ = stream.set_nodelay(true);
            self.ctx.http.connections_open.fetch_add(1, Relaxed);
            self.ctx.http.connections_total.fetch_add(1, Relaxed);
            return (CountedStream { inner: stream, ctx: self.ctx.clone() }, addr);
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// A connection that adds its traffic to `ctx.http` and closes itself in it when dropped.
struct CountedStream {
    inner: TcpStream,
    ctx: Arc<ServerCtx>,
}

impl Drop for CountedStream {
    fn drop(&mut self) {
        self.ctx.http.connections_open.fetch_sub(1, Relaxed);
    }
}

impl AsyncRead for CountedStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        self.ctx.http.bytes_read.fetch_add(n as u64, Relaxed);
        r
    }
}

impl AsyncWrite for CountedStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = &r {
            self.ctx.http.bytes_written.fetch_add(*n as u64, Relaxed);
        }
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = &r {
            self.ctx.http.bytes_written.fetch_add(*n as u64, Relaxed);
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A key as text: UTF-8 as is, anything else as `hex:<hex>`.
fn display_key(key: &[u8]) -> String {
    match std::str::from_utf8(key) {
        Ok(s) => s.to_string(),
        Err(_) => format!("hex:{}", hex::encode(key)),
    }
}
