//! The HTTP front: routes, request ids, and the gateway's lifetime.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde_json::json;

use crate::error::ApiError;
use crate::identity::keys::bearer;
use crate::identity::{admin_router_with, AdminOptions, AdminToken};
use crate::proxy::{handle, Endpoint, Gateway, REQUEST_ID_HEADER};

/// A request's id (`req_` + 24 hex digits), set on every response.
#[derive(Clone, Debug)]
pub struct RequestId(pub String);

pub(crate) fn new_request_id() -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let n: u128 = rand::random();
    let mut id = String::with_capacity(28);
    id.push_str("req_");
    // The low 96 bits, most significant digit first.
    id.extend((0..24).rev().map(|i| char::from(HEX[((n >> (4 * i)) & 0xf) as usize])));
    id
}

async fn request_id(mut req: Request, next: Next) -> Response {
    let id = new_request_id();
    req.extensions_mut().insert(RequestId(id.clone()));
    let mut resp = next.run(req).await;
    set_request_id(&mut resp, &id);
    resp
}

/// Names the request's id in its response's `x-request-id` header.
pub(crate) fn set_request_id(resp: &mut Response, id: &str) {
    if let Ok(v) = HeaderValue::from_str(id) {
        resp.headers_mut().insert(REQUEST_ID_HEADER, v);
    }
}

/// The public API, the admin API (when an admin token is set), `/health`
/// (readiness), `/livez` (liveness),
/// `/metrics` (admin or metrics token) and the OpenAPI description. The
/// scoped tokens (agent, metrics) come from the variables the gateway's
/// configuration names ([`crate::proxy::ScopedTokens`]).
pub fn router(gw: Arc<Gateway>, admin: Option<AdminToken>) -> Router {
    let scoped = gw.scoped.clone();
    let metrics_token = match (&admin, &scoped.metrics) {
        (Some(a), Some(m)) => Some(a.or(m)),
        (a, m) => a.clone().or_else(|| m.clone()),
    };
    let mut app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/livez", get(livez))
        .route("/openapi.json", get(openapi))
        .route("/metrics", get(metrics))
        .with_state(gw.clone());
    app = app.merge(crate::agents::admin_routes(gw.clone(), admin.clone(), scoped.agent.clone()));
    if let Some(token) = admin.clone() {
        let options = AdminOptions {
            rotation_grace: std::time::Duration::from_secs(gw.cfg.key_rotation_grace_s),
            prices: gw.cfg.prices.clone(),
        };
        app = app.merge(admin_router_with(gw.identity.clone(), token, options));
    } else {
        app = app.route("/admin/v1/{*rest}", axum::routing::any(admin_disabled));
    }
    app.fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(Extension(AdminGuard(metrics_token)))
        .layer(middleware::from_fn(request_id))
}

/// [`router`], with the generation routes served by the proxy directly
/// ([`crate::front::App`]): what the gateway's listener serves.
pub fn app(gw: Arc<Gateway>, admin: Option<AdminToken>) -> crate::front::App {
    crate::front::App::new(router(gw.clone(), admin), Some(gw))
}

#[derive(Clone)]
struct AdminGuard(Option<AdminToken>);

async fn chat(
    State(gw): State<Arc<Gateway>>,
    Extension(id): Extension<RequestId>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(gw, Endpoint::Chat, id.0, headers, body).await
}

async fn completions(
    State(gw): State<Arc<Gateway>>,
    Extension(id): Extension<RequestId>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(gw, Endpoint::Completions, id.0, headers, body).await
}

/// The models the caller's key may use, OpenAI's list shape.
async fn models(State(gw): State<Arc<Gateway>>, headers: HeaderMap) -> Response {
    let p = match gw.identity.authenticate(bearer(&headers)).await {
        Ok(p) => p,
        Err(e) => return e.to_api_error().into_response(),
    };
    let data: Vec<_> = gw
        .models_for(&p)
        .into_iter()
        .map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "granary"}))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// 200 while at least one upstream is routable or a live agent can load
/// models, else 503 (load balancers in front of gateway replicas use it).
async fn health(State(gw): State<Arc<Gateway>>) -> Response {
    let list = gw.upstreams.list();
    let up = list.iter().filter(|u| u.is_routable()).count();
    let agents = gw.agents.count();
    let ok = up > 0 || agents > 0;
    let status = if ok { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let body = json!({
        "status": if ok { "ok" } else { "no_upstream" },
        "upstreams_up": up,
        "upstreams": list.len(),
        "agents": agents,
    });
    (status, Json(body)).into_response()
}

/// Liveness: the process answers HTTP. Unlike `/health` (readiness: an
/// upstream is routable), an engine outage does not fail it, so an
/// orchestrator does not restart every gateway when the engines go.
async fn livez() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

async fn metrics(
    State(gw): State<Arc<Gateway>>,
    Extension(guard): Extension<AdminGuard>,
    headers: HeaderMap,
) -> Response {
    match &guard.0 {
        Some(t) if t.verify(bearer(&headers)) => {}
        Some(_) => {
            return ApiError::unauthorized("invalid_admin_token", "Metrics need the metrics or the admin token.")
                .into_response()
        }
        None => return ApiError::forbidden("admin_disabled", "No admin token is configured.").into_response(),
    }
    for u in gw.upstreams.list().iter() {
        u.export();
    }
    gw.refresh_counters();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        granary_core::metrics::to_prometheus_text(&gw.metrics.render()),
    )
        .into_response()
}

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], include_str!("../openapi.json")).into_response()
}

async fn admin_disabled() -> Response {
    ApiError::forbidden("admin_disabled", "The admin API is disabled: no admin token is configured.").into_response()
}

async fn not_found() -> Response {
    ApiError::not_found("Unknown path.").into_response()
}

async fn method_not_allowed() -> Response {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        crate::error::ErrorType::InvalidRequestError,
        "method_not_allowed",
        "Method not allowed for this path.",
    )
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_req_and_24_lowercase_hex_digits() {
        let ids: Vec<String> = (0..64).map(|_| new_request_id()).collect();
        for id in &ids {
            let hex = id.strip_prefix("req_").unwrap_or_else(|| panic!("{id}"));
            assert_eq!(hex.len(), 24, "{id}");
            assert!(hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)), "{id}");
        }
        // Random: 64 draws of 96 bits do not repeat, and every digit
        // position takes more than one value.
        let mut sorted = ids.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), ids.len());
        for pos in 4..28 {
            assert!(ids.iter().any(|i| i.as_bytes()[pos] != ids[0].as_bytes()[pos]), "digit {pos} never changes");
        }
    }
}
