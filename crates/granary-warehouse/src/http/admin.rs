//! Operator endpoints: `/health` and `/ready` for probes (no auth), and
//! `/metrics`, `/stats`, `/cache/list`, `/cache/get` behind the admin token
//! (`/stats` also answers a namespace token, about its namespace alone).

use std::sync::atomic::Ordering::Relaxed;

use axum::body::Bytes;
use axum::extract::{RawQuery, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::error::ApiError;
use super::{admin_access, authenticate, display_key, mark_normal, metrics_access, AppState, Params};
use crate::auth::Principal;
use crate::types::Ttl;

/// Largest page `/cache/list` returns.
const MAX_LIST_COUNT: u64 = 10_000;

pub(super) async fn health() -> Response {
    Json(json!({ "status": "ok" })).into_response()
}

pub(super) async fn ready(State(st): State<AppState>) -> Response {
    if st.ctx.ready.load(Relaxed) {
        Json(json!({ "ready": true })).into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, Json(json!({ "ready": false }))).into_response()
    }
}

pub(super) async fn metrics(State(st): State<AppState>, headers: HeaderMap) -> Result<Response, ApiError> {
    metrics_access(&st, &headers)?;
    let text = crate::metrics::render(&st.ctx, Some(&st.metrics), st.started.elapsed());
    // OpenMetrics for scrapers that ask for it (Prometheus does), the
    // classic text format for everyone else.
    let openmetrics = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/openmetrics-text"));
    Ok(if openmetrics {
        ([(header::CONTENT_TYPE, HeaderValue::from_static(crate::metrics::CONTENT_TYPE))], text).into_response()
    } else {
        let text = crate::metrics::to_prometheus_text(&text);
        ([(header::CONTENT_TYPE, HeaderValue::from_static(crate::metrics::PROMETHEUS_CONTENT_TYPE))], text)
            .into_response()
    })
}

/// `/stats`: the admin sees the whole store; a namespace token sees only
/// its own namespace (what it holds per tier, its quotas, its key count).
pub(super) async fn stats(State(st): State<AppState>, headers: HeaderMap) -> Result<Response, ApiError> {
    if !st.ctx.auth.is_open() {
        if let Principal::Namespace(ns) = authenticate(&st, &headers)? {
            return Ok(Json(json!({
                "namespace": ns,
                "tiers": st.ctx.store.namespace_usage(&ns),
                "keys": st.ctx.store.count(&ns).await?,
            }))
            .into_response());
        }
    }
    admin_access(&st, &headers)?;
    Ok(Json(json!({
        "store": st.ctx.store.stats(),
        "protocols": { "http": st.ctx.http.snapshot(), "resp": st.ctx.resp.snapshot() },
        "uptime_seconds": st.started.elapsed().as_secs_f64(),
    }))
    .into_response())
}

/// `?namespace=ns&cursor=0&count=100`: one page of keys held locally.
pub(super) async fn cache_list(
    State(st): State<AppState>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    admin_access(&st, &headers)?;
    let q = Params::parse(query.as_deref());
    let ns = q.required("namespace")?;
    let cursor = q.u64("cursor", 0, u64::MAX)?.unwrap_or(0);
    let count = q.u64("count", 1, MAX_LIST_COUNT)?.unwrap_or(100);
    let page = st.ctx.store.scan(ns, cursor, count as usize).await?;
    let keys: Vec<String> = page.keys.iter().map(|k| display_key(k)).collect();
    Ok(Json(json!({ "namespace": ns, "keys": keys, "next_cursor": page.next })).into_response())
}

/// A key given as text: `hex:<hex>` for binary keys, anything else as its UTF-8 bytes.
fn parse_key(text: &str) -> Result<Bytes, ApiError> {
    match text.strip_prefix("hex:") {
        Some(h) => hex::decode(h)
            .map(Bytes::from)
            .map_err(|_| ApiError::invalid("key", "invalid_parameter", "key after 'hex:' must be hex digits")),
        None => Ok(Bytes::copy_from_slice(text.as_bytes())),
    }
}

/// `?namespace=ns&key=k[&raw=1]`: where a key lives, its size and time to
/// live; with `raw`, its bytes. Reading counts as a hit, like any read.
pub(super) async fn cache_get(
    State(st): State<AppState>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    admin_access(&st, &headers)?;
    let q = Params::parse(query.as_deref());
    let ns = q.required("namespace")?;
    let key = parse_key(q.required("key")?)?;
    let raw = q.flag("raw")?;
    let Some(hit) = st.ctx.store.get(ns, &key).await? else {
        return Ok(mark_normal(ApiError::not_found("key_not_found", "no such key").into_response()));
    };
    if raw {
        let headers = [
            (header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream")),
            (header::HeaderName::from_static("x-granary-tier"), HeaderValue::from_static(hit.tier.as_str())),
        ];
        return Ok((headers, hit.value).into_response());
    }
    let ttl_seconds = match st.ctx.store.ttl(ns, &key).await? {
        Ttl::Remaining(d) => Some(d.as_secs_f64()),
        Ttl::Persistent | Ttl::Missing => None,
    };
    Ok(Json(json!({
        "found": true,
        "namespace": ns,
        "key": display_key(&key),
        "tier": hit.tier,
        "size": hit.value.len(),
        "ttl_seconds": ttl_seconds,
        "depth": hit.meta.depth,
    }))
    .into_response())
}
