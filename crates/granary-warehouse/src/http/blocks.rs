//! The block API: `/v1/blocks/{namespace}/{key}`, `/v1/lookup`, `/v1/events`.
//!
//! A block is stored exactly as sent, after [`KvBlock::decode`] has checked
//! its magic, version, both checksums and shape; a body that fails is
//! refused with the codec's reason and nothing is stored. Keys are block
//! hashes in their 64-char lowercase hex form, and the store key is that
//! text, so other protocols (RESP) see the same names.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{FromRequest, Path, RawQuery, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::Stream;
use granary_core::{BlockHash, KvBlock};
use serde_json::{json, Value};
use tokio::sync::broadcast::error::RecvError;

use super::error::ApiError;
use super::{data_access, mark_normal, Access, AppState, Params, MAX_LOOKUP_KEYS};
use crate::auth::Principal;
use crate::store::Hit;
use crate::types::{Condition, Event, PutOptions};

/// Longest accepted `ttl`: ten years, far from any overflow of the expiry clock.
const MAX_TTL_SECS: u64 = 10 * 365 * 24 * 3600;

fn parse_hash(text: &str, param: impl Into<String>) -> Result<BlockHash, ApiError> {
    text.parse::<BlockHash>().map_err(|e| ApiError::invalid(param, "invalid_block_hash", e.to_string()))
}

/// Authorizes and validates the path of a block request.
fn block_target(
    st: &AppState,
    headers: &HeaderMap,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<(String, Bytes), ApiError> {
    let access = data_access(st, headers)?;
    let Path((ns, key)) = path.map_err(|e| ApiError::invalid("path", "invalid_path", e.body_text()))?;
    access.check(&ns)?;
    parse_hash(&key, "key")?;
    Ok((ns, Bytes::from(key)))
}

fn body_or_error(body: Result<Bytes, BytesRejection>, limit: u64) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(limit)
        } else {
            ApiError::bad_request("body_read_failed", "could not read the request body")
        }
    })
}

/// The body, read only now: after the token and the parameters are checked,
/// so an unauthenticated client cannot make the server buffer a block.
async fn read_body(st: &AppState, req: Request, limit: u64) -> Result<Bytes, ApiError> {
    body_or_error(Bytes::from_request(req, st).await, limit)
}

pub(super) async fn put_block(
    State(st): State<AppState>,
    headers: HeaderMap,
    path: Result<Path<(String, String)>, PathRejection>,
    RawQuery(query): RawQuery,
    req: Request,
) -> Result<Response, ApiError> {
    let (ns, key) = block_target(&st, &headers, path)?;
    let q = Params::parse(query.as_deref());
    let ttl = q.u64("ttl", 1, MAX_TTL_SECS)?.map(Duration::from_secs);
    let depth = q.u64("depth", 0, u32::MAX as u64)?.unwrap_or(0) as u32;
    let durable = q.flag("durable")?;
    let condition = if q.flag("nx")? { Condition::IfAbsent } else { Condition::Always };
    let body = read_body(&st, req, st.body_limit).await?;
    KvBlock::decode(body.clone()).map_err(|e| ApiError::invalid("body", "invalid_block", e.to_string()))?;
    let bytes = body.len();
    let done = st.ctx.store.put_with(&ns, key, body, PutOptions { ttl, condition, durable, depth }).await?;
    let answer = Json(json!({ "stored": done.stored, "bytes": bytes, "durable": done.durable }));
    Ok(if done.stored {
        (StatusCode::CREATED, answer).into_response()
    } else {
        mark_normal((StatusCode::CONFLICT, answer).into_response())
    })
}

fn missing() -> Response {
    mark_normal(ApiError::not_found("block_not_found", "no such block").into_response())
}

fn tier_header(hit: &Hit) -> [(header::HeaderName, HeaderValue); 2] {
    [
        (header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream")),
        (header::HeaderName::from_static("x-granary-tier"), HeaderValue::from_static(hit.tier.as_str())),
    ]
}

pub(super) async fn get_block(
    State(st): State<AppState>,
    headers: HeaderMap,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<Response, ApiError> {
    let (ns, key) = block_target(&st, &headers, path)?;
    Ok(match st.ctx.store.get(&ns, &key).await? {
        Some(hit) => (tier_header(&hit), hit.value).into_response(),
        None => missing(),
    })
}

pub(super) async fn head_block(
    State(st): State<AppState>,
    headers: HeaderMap,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<Response, ApiError> {
    let (ns, key) = block_target(&st, &headers, path)?;
    Ok(match st.ctx.store.get(&ns, &key).await? {
        Some(hit) => {
            let len = HeaderValue::from(hit.value.len());
            (tier_header(&hit), [(header::CONTENT_LENGTH, len)]).into_response()
        }
        None => mark_normal(StatusCode::NOT_FOUND.into_response()),
    })
}

pub(super) async fn delete_block(
    State(st): State<AppState>,
    headers: HeaderMap,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<Response, ApiError> {
    let (ns, key) = block_target(&st, &headers, path)?;
    Ok(if st.ctx.store.delete(&ns, &key).await? { StatusCode::NO_CONTENT.into_response() } else { missing() })
}

/// `{"namespace": "...", "keys": ["<hex>", ...]}`, checked field by field so
/// an error names the field (`namespace`, `keys`, `keys[7]`).
fn parse_lookup(body: &[u8]) -> Result<(String, Vec<Bytes>), ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request("invalid_json", format!("request body is not valid JSON: {e}")))?;
    let obj =
        v.as_object().ok_or_else(|| ApiError::bad_request("invalid_json", "request body must be a JSON object"))?;
    if let Some(unknown) = obj.keys().find(|k| !matches!(k.as_str(), "namespace" | "keys")) {
        return Err(ApiError::invalid(unknown.clone(), "unknown_field", format!("unknown field {unknown:?}")));
    }
    let ns = match obj.get("namespace") {
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(ApiError::invalid("namespace", "invalid_type", "namespace must be a string")),
        None => return Err(ApiError::invalid("namespace", "missing_field", "missing namespace")),
    };
    let keys = match obj.get("keys") {
        Some(Value::Array(a)) => a,
        Some(_) => return Err(ApiError::invalid("keys", "invalid_type", "keys must be an array of block hashes")),
        None => return Err(ApiError::invalid("keys", "missing_field", "missing keys")),
    };
    if keys.len() > MAX_LOOKUP_KEYS {
        return Err(ApiError::invalid(
            "keys",
            "too_many_keys",
            format!("at most {MAX_LOOKUP_KEYS} keys per lookup, got {}", keys.len()),
        ));
    }
    let mut out = Vec::with_capacity(keys.len());
    for (i, k) in keys.iter().enumerate() {
        let param = format!("keys[{i}]");
        let Value::String(s) = k else {
            return Err(ApiError::invalid(param, "invalid_type", "each key must be a string"));
        };
        parse_hash(s, param)?;
        out.push(Bytes::copy_from_slice(s.as_bytes()));
    }
    Ok((ns, out))
}

pub(super) async fn lookup(State(st): State<AppState>, headers: HeaderMap, req: Request) -> Result<Response, ApiError> {
    let access = data_access(&st, &headers)?;
    let body = read_body(&st, req, super::LOOKUP_BODY_LIMIT as u64).await?;
    let (ns, keys) = parse_lookup(&body)?;
    access.check(&ns)?;
    let span = tracing::Span::current();
    span.record("granary.warehouse.keys", keys.len());
    let found = st.ctx.store.lookup(&ns, &keys).await?;
    span.record("granary.warehouse.matched", found.matched);
    Ok(Json(found).into_response())
}

/// Which events a subscriber receives.
struct EventFilter {
    access: Access,
    namespace: Option<String>,
}

impl EventFilter {
    fn accepts(&self, ev: &Event) -> bool {
        self.access.may_access(&ev.namespace) && self.namespace.as_deref().is_none_or(|n| n == ev.namespace)
    }

    /// The `lagged` notice. The count of missed events covers every
    /// namespace, so only a subscriber that may see them all (admin, open
    /// server) gets it; a tenant learns that it lagged, not how busy others are.
    fn lagged(&self, missed: u64) -> serde_json::Value {
        match self.access {
            Access::As(Principal::Namespace(_)) => json!({ "missed": null }),
            _ => json!({ "missed": missed }),
        }
    }
}

fn sse_json(name: &'static str, data: &impl serde::Serialize) -> SseEvent {
    let text = serde_json::to_string(data).unwrap_or_else(|_| "{}".to_string());
    SseEvent::default().event(name).data(text)
}

/// `GET /v1/events[?namespace=ns]`: store events as SSE. A namespace token
/// sees only its namespace; without `namespace`, the admin (or anyone on an
/// open server) sees every namespace.
pub(super) async fn events(
    State(st): State<AppState>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Result<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>, ApiError> {
    let access = data_access(&st, &headers)?;
    let q = Params::parse(query.as_deref());
    let namespace = match q.get("namespace") {
        Some(ns) => {
            access.check(ns)?;
            Some(ns.to_string())
        }
        None => match &access {
            Access::As(Principal::Namespace(own)) => Some(own.clone()),
            _ => None,
        },
    };
    let filter = EventFilter { access, namespace };
    let rx = st.ctx.store.subscribe();
    let state = (rx, filter, st.shutdown.clone());
    let stream = futures::stream::unfold(state, |(mut rx, filter, shutdown)| async move {
        loop {
            let next = tokio::select! {
                _ = shutdown.cancelled() => return None,
                r = rx.recv() => r,
            };
            let ev = match next {
                Ok(ev) if filter.accepts(&ev) => {
                    let name = match ev.kind {
                        crate::types::EventKind::Stored => "stored",
                        crate::types::EventKind::Removed => "removed",
                    };
                    sse_json(name, &ev)
                }
                Ok(_) => continue,
                // Missed events may have been from other namespaces: the
                // count is an upper bound, shown to the admin only.
                Err(RecvError::Lagged(n)) => sse_json("lagged", &filter.lagged(n)),
                Err(RecvError::Closed) => return None,
            };
            return Some((Ok(ev), (rx, filter, shutdown)));
        }
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_is_not_told_how_many_events_it_missed() {
        let tenant = EventFilter { access: Access::As(Principal::Namespace("a".into())), namespace: Some("a".into()) };
        assert_eq!(tenant.lagged(9000), json!({ "missed": null }));
        let admin = EventFilter { access: Access::As(Principal::Admin), namespace: Some("a".into()) };
        assert_eq!(admin.lagged(9000), json!({ "missed": 9000 }));
        assert_eq!(EventFilter { access: Access::Open, namespace: None }.lagged(3), json!({ "missed": 3 }));
    }
}
