//! The control API.
//!
//! | route | does |
//! | --- | --- |
//! | `POST /models/{name}/load` | body `{"revision": "latest"}` (optional); 200 once the engine is healthy |
//! | `POST /models/{name}/unload` | 200 `{"model","state":"unloaded"}`; 404 when not loaded |
//! | `GET /status` | engines, tiers, downloads in progress |
//! | `GET /models/{name}/logs?tail=N` | the end of the engine's log, as text |
//! | `GET /metrics` | Prometheus text (see [`crate::metrics`]) |
//! | `GET /health` | `{"status":"ok"}`, without a token |
//!
//! With an admin token configured every route but `/health` needs
//! `Authorization: Bearer <token>` (compared in constant time); a metrics
//! token, when configured, reads `/metrics` and nothing else. Without an
//! admin token the agent refuses to listen beyond loopback.

use std::future::Future;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use subtle::ConstantTimeEq;

use crate::agent::Agent;
use crate::error::AgentError;

/// `POST /models/{name}/load`'s body.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadRequest {
    /// A revision, or `latest`.
    pub revision: Option<String>,
}

#[derive(Clone)]
struct Ctx {
    agent: Arc<Agent>,
    /// blake3 of the admin token; none: open.
    token: Option<[u8; 32]>,
    /// blake3 of the metrics token (reads `/metrics` only).
    metrics_token: Option<[u8; 32]>,
}

/// The control API, state applied.
pub fn router(agent: Arc<Agent>) -> Router {
    let hashed = |t: Option<&str>| t.filter(|t| !t.is_empty()).map(|t| *blake3::hash(t.as_bytes()).as_bytes());
    let token = hashed(agent.config().admin_token.as_deref());
    let metrics_token = hashed(agent.config().metrics_token.as_deref());
    let ctx = Ctx { agent, token, metrics_token };
    let scraped = Router::new()
        .route("/metrics", get(metrics))
        .layer(axum::middleware::from_fn_with_state(ctx.clone(), require_metrics_token));
    let guarded = Router::new()
        .route("/models/{name}/load", post(load))
        .route("/models/{name}/unload", post(unload))
        .route("/models/{name}/logs", get(logs))
        .route("/status", get(status))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(ctx.clone(), require_token));
    Router::new().route("/health", get(health)).merge(scraped).merge(guarded).with_state(ctx)
}

/// Serves the control API on `listener` until `shutdown` resolves, then
/// detaches from the engines (they keep running for the next agent).
pub async fn serve(
    agent: Arc<Agent>,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(agent.clone());
    let limits = agent.config().http_limits();
    let r = granary_core::serve::serve_http(listener, app, limits, shutdown).await;
    agent.shutdown();
    r
}

/// The bearer token of a request, if it has one.
fn presented(req: &Request) -> Option<&str> {
    req.headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, t)| t.trim())
}

/// Whether `token` hashes to one of `wanted` (each compared in constant time).
fn matches(token: &str, wanted: &[Option<[u8; 32]>]) -> bool {
    let h = blake3::hash(token.as_bytes());
    wanted.iter().flatten().fold(false, |ok, w| ok | bool::from(h.as_bytes().ct_eq(w)))
}

/// `/metrics`: the metrics token or the admin token (open when there is
/// neither, as the rest of the API is without an admin token).
async fn require_metrics_token(State(ctx): State<Ctx>, req: Request, next: Next) -> Response {
    let wanted = [ctx.token, ctx.metrics_token];
    if wanted.iter().all(Option::is_none) {
        return next.run(req).await;
    }
    match presented(&req) {
        Some(t) if matches(t, &wanted) => next.run(req).await,
        Some(_) => AgentError::Unauthorized("Incorrect metrics token provided.").into_response(),
        None => AgentError::Unauthorized("`/metrics` needs `Authorization: Bearer <metrics or admin token>`.")
            .into_response(),
    }
}

async fn require_token(State(ctx): State<Ctx>, req: Request, next: Next) -> Response {
    let Some(want) = ctx.token else { return next.run(req).await };
    match presented(&req) {
        Some(t) if matches(t, &[Some(want)]) => next.run(req).await,
        Some(_) => AgentError::Unauthorized("Incorrect admin token provided.").into_response(),
        None => {
            AgentError::Unauthorized("The control API needs `Authorization: Bearer <admin token>`.").into_response()
        }
    }
}

async fn metrics(State(ctx): State<Ctx>) -> Response {
    let text = crate::metrics::render(&ctx.agent.status());
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], text).into_response()
}

async fn health() -> Json<serde_json::Value> {
    Json(serde_json::json!({"status": "ok"}))
}

async fn not_found() -> AgentError {
    AgentError::BadRequest { param: None, code: "not_found", message: "No such route.".into() }
}

async fn load(State(ctx): State<Ctx>, Path(name): Path<String>, body: Bytes) -> Result<Response, AgentError> {
    let req: LoadRequest = parse_body(&body)?;
    let r = ctx.agent.load(&name, req.revision.as_deref()).await?;
    // What the heartbeat will say of the engine, so that a gateway adding
    // it from this answer adds it as the heartbeat describes it.
    let mut v = serde_json::to_value(&r).expect("engine statuses serialize");
    v["kv_events"] = serde_json::json!(ctx.agent.config().engines.command.is_none());
    Ok(Json(v).into_response())
}

async fn unload(State(ctx): State<Ctx>, Path(name): Path<String>) -> Result<Response, AgentError> {
    ctx.agent.unload(&name).await?;
    Ok(Json(serde_json::json!({"model": name, "state": "unloaded"})).into_response())
}

async fn status(State(ctx): State<Ctx>) -> Json<crate::agent::AgentStatus> {
    Json(ctx.agent.status())
}

async fn logs(State(ctx): State<Ctx>, Path(name): Path<String>, RawQuery(q): RawQuery) -> Result<Response, AgentError> {
    crate::agent::check_name("name", &name)?;
    let mut tail = 100usize;
    for (k, v) in url::form_urlencoded::parse(q.unwrap_or_default().as_bytes()) {
        match k.as_ref() {
            "tail" => {
                tail = v.parse().ok().filter(|n| (1..=100_000).contains(n)).ok_or_else(|| {
                    AgentError::invalid("tail", format!("`tail` must be a number of lines from 1 to 100000; got {v:?}"))
                })?
            }
            other => {
                return Err(AgentError::BadRequest {
                    param: Some(other.to_string()),
                    code: "unknown_parameter",
                    message: format!("Unknown query parameter `{other}` (expected: tail)."),
                })
            }
        }
    }
    let path = ctx.agent.supervisor().log_path(&name);
    match crate::supervisor::tail_lines(&path, tail) {
        Ok(text) => Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(AgentError::NotLoaded(name)),
        Err(e) => Err(AgentError::io(format!("reading {}", path.display()), e)),
    }
}

/// Parses a JSON body (empty means `{}`), naming the field at fault.
fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, AgentError> {
    let body = if body.iter().all(u8::is_ascii_whitespace) { b"{}".as_slice() } else { body };
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let inner = e.inner().to_string();
        let path = e.path().to_string();
        // Unknown fields are in the message, not yet in the path.
        let unknown = inner.strip_prefix("unknown field `").and_then(|r| r.split('`').next()).map(str::to_string);
        let param = match (path.as_str(), unknown) {
            (".", Some(f)) => Some(f),
            (".", None) => None,
            (p, _) => Some(p.to_string()),
        };
        let message = match &param {
            Some(p) => format!("Invalid JSON body at `{p}`: {inner}"),
            None => format!("Invalid JSON body: {inner}"),
        };
        AgentError::BadRequest { param, code: "invalid_request_body", message }
    })
}

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;

    use super::*;

    #[test]
    fn bad_bodies_name_the_field() {
        let e = parse_body::<LoadRequest>(br#"{"revision": 3}"#).unwrap_err();
        assert_eq!(e.body()["error"]["param"], "revision");
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        let e = parse_body::<LoadRequest>(br#"{"revison": "1"}"#).unwrap_err();
        assert_eq!(e.body()["error"]["param"], "revison");
        let e = parse_body::<LoadRequest>(b"{not json").unwrap_err();
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert!(parse_body::<LoadRequest>(b"").unwrap().revision.is_none());
    }
}
