//! The admin HTTP API, under `/admin/v1`; every route (and every unknown
//! path under it) needs `Authorization: Bearer <admin token>`.
//!
//! | route | does |
//! | --- | --- |
//! | `POST /admin/v1/tenants` | create a tenant ([`NewTenant`]) → 201 |
//! | `GET /admin/v1/tenants` | list tenants |
//! | `GET /admin/v1/tenants/{name}` | one tenant |
//! | `PATCH /admin/v1/tenants/{name}` | change it ([`TenantUpdate`]) |
//! | `DELETE /admin/v1/tenants/{name}` | disable it and revoke its keys |
//! | `POST /admin/v1/keys` | create a key → 201, the secret shown once |
//! | `GET /admin/v1/keys?tenant=` | list keys (no secrets, no hashes) |
//! | `PATCH /admin/v1/keys/{id}` | change a key's name, models, limits or expiry ([`KeyUpdate`]) |
//! | `POST /admin/v1/keys/{id}/rotate` | a new secret (shown once); the old one works for `grace_s` |
//! | `DELETE /admin/v1/keys/{id}` | revoke a key |
//! | `GET /admin/v1/usage?from=&to=&tenant=&format=json\|csv` | usage per tenant and model |
//! | `GET /admin/v1/audit?tenant=&limit=&since=` | audit records, newest first |

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use subtle::ConstantTimeEq;

use super::{
    current_month_ms, now_ms, AuditQuery, Identity, KeyUpdate, NewKey, NewTenant, TenantUpdate, UsageQuery, UsageRow,
};
use crate::{ApiError, KeyId, Limits};

/// An operator's shared secret (the admin token, or a scoped one: agent,
/// metrics), kept only as a blake3 hash and compared in constant time. A
/// route open to several scopes takes their [`AdminToken::or`].
#[derive(Clone)]
pub struct AdminToken {
    /// The accepted secrets' hashes; none for an empty secret, which admits
    /// nobody.
    hashes: Vec<[u8; 32]>,
}

impl AdminToken {
    /// A token from its secret. An empty secret admits nobody.
    pub fn new(secret: &str) -> Self {
        AdminToken {
            hashes: (!secret.is_empty()).then(|| *blake3::hash(secret.as_bytes()).as_bytes()).into_iter().collect(),
        }
    }

    /// A token that accepts either secret.
    pub fn or(&self, other: &AdminToken) -> AdminToken {
        AdminToken { hashes: self.hashes.iter().chain(&other.hashes).copied().collect() }
    }

    /// Whether `presented` is the secret (constant time per secret).
    pub fn verify(&self, presented: &str) -> bool {
        let h = blake3::hash(presented.as_bytes());
        self.hashes.iter().fold(false, |ok, hash| ok | bool::from(h.as_bytes().ct_eq(hash)))
    }
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(…)")
    }
}

#[derive(Clone)]
struct AdminState {
    identity: Identity,
    token: AdminToken,
    options: AdminOptions,
}

/// Settings of the admin API.
#[derive(Clone, Debug)]
pub struct AdminOptions {
    /// How long a key's previous secret keeps working after a rotation
    /// that does not say (`grace_s`).
    pub rotation_grace: std::time::Duration,
    /// Prices for the usage report's cost (none: no cost column).
    pub prices: crate::pricing::Prices,
}

impl Default for AdminOptions {
    fn default() -> Self {
        AdminOptions { rotation_grace: std::time::Duration::from_secs(24 * 3600), prices: Default::default() }
    }
}

/// The admin API, state applied, with default options.
pub fn admin_router(identity: Identity, token: AdminToken) -> Router {
    admin_router_with(identity, token, AdminOptions::default())
}

/// The admin API, state applied.
pub fn admin_router_with(identity: Identity, token: AdminToken, options: AdminOptions) -> Router {
    let state = AdminState { identity, token, options };
    Router::new()
        .route("/admin/v1/tenants", get(list_tenants).post(create_tenant))
        .route("/admin/v1/tenants/{name}", get(get_tenant).patch(update_tenant).delete(disable_tenant))
        .route("/admin/v1/keys", get(list_keys).post(create_key))
        .route("/admin/v1/keys/{id}", axum::routing::delete(revoke_key).patch(update_key))
        .route("/admin/v1/keys/{id}/rotate", post(rotate_key))
        .route("/admin/v1/usage", get(usage))
        .route("/admin/v1/audit", get(audit))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(state.clone(), require_token))
        .with_state(state)
}

async fn require_token(State(state): State<AdminState>, req: Request, next: Next) -> Response {
    require_admin(State(state.token), req, next).await
}

/// Middleware: the request must carry `Authorization: Bearer <admin token>`.
pub(crate) async fn require_admin(State(token): State<AdminToken>, req: Request, next: Next) -> Response {
    let presented = Some(super::keys::bearer(req.headers())).filter(|t| !t.is_empty());
    match presented {
        Some(t) if token.verify(t) => next.run(req).await,
        Some(_) => ApiError::unauthorized("invalid_admin_token", "Incorrect admin token provided.").into_response(),
        None => {
            ApiError::unauthorized("invalid_admin_token", "The admin API needs `Authorization: Bearer <admin token>`.")
                .into_response()
        }
    }
}

async fn not_found() -> ApiError {
    ApiError::not_found("No such admin route.")
}

/// Parses a JSON body, naming the field at fault.
pub(crate) fn parse_json_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let body = if body.iter().all(u8::is_ascii_whitespace) { b"{}".as_slice() } else { body };
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let inner = e.inner().to_string();
        let path = e.path().to_string();
        // A missing field is reported on the object that should hold it;
        // name the field itself. (Unknown fields are already in the path.)
        let field = quoted_field(&inner).filter(|_| inner.starts_with("missing field"));
        let param = match (path.as_str(), field) {
            (".", Some(f)) => f.to_string(),
            (p, Some(f)) => format!("{p}.{f}"),
            (".", None) => String::new(),
            (p, None) => p.to_string(),
        };
        let message = if param.is_empty() {
            format!("Invalid JSON body: {inner}")
        } else {
            format!("Invalid JSON body at `{param}`: {inner}")
        };
        let err = ApiError::bad_request("invalid_request_body", message);
        if param.is_empty() {
            err
        } else {
            err.param(param)
        }
    })
}

/// The first `` `name` `` in a serde message.
fn quoted_field(msg: &str) -> Option<&str> {
    let start = msg.find('`')? + 1;
    let len = msg[start..].find('`')?;
    Some(&msg[start..start + len])
}

/// Query parameters, refusing any not in `allowed` and any given twice.
pub(crate) fn query_params(raw: Option<String>, allowed: &[&str]) -> Result<Vec<(String, String)>, ApiError> {
    let mut out: Vec<(String, String)> = Vec::new();
    for (k, v) in url::form_urlencoded::parse(raw.unwrap_or_default().as_bytes()) {
        if !allowed.contains(&k.as_ref()) {
            return Err(ApiError::invalid(
                k.to_string(),
                "unknown_parameter",
                format!("Unknown query parameter `{k}` (expected one of: {}).", allowed.join(", ")),
            ));
        }
        if out.iter().any(|(x, _)| *x == k) {
            return Err(ApiError::invalid(k.to_string(), "invalid_value", format!("`{k}` is given twice.")));
        }
        out.push((k.into_owned(), v.into_owned()));
    }
    Ok(out)
}

fn param<'a>(params: &'a [(String, String)], name: &str) -> Option<&'a str> {
    params.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str()).filter(|v| !v.is_empty())
}

/// A time given as RFC 3339 or unix seconds, in unix milliseconds.
pub(super) fn parse_time(field: &str, s: &str) -> Result<i64, ApiError> {
    let s = s.trim();
    if let Ok(secs) = s.parse::<i64>() {
        return secs.checked_mul(1000).ok_or_else(|| time_error(field, s));
    }
    chrono::DateTime::parse_from_rfc3339(s).map(|t| t.timestamp_millis()).map_err(|_| time_error(field, s))
}

fn time_error(field: &str, s: &str) -> ApiError {
    ApiError::invalid(
        field,
        "invalid_value",
        format!("Invalid `{field}`: {s:?} is neither an RFC 3339 time nor unix seconds."),
    )
}

/// Writes usage rows as CSV, with a header line.
pub fn usage_csv(rows: &[UsageRow]) -> String {
    usage_csv_priced(rows, None)
}

/// [`usage_csv`] with `cost` and `currency` columns when `prices` are given
/// (the cost cell is empty for a model without a price).
pub fn usage_csv_priced(rows: &[UsageRow], prices: Option<&crate::pricing::Prices>) -> String {
    let mut out = String::from("tenant,model,requests,errors,prompt_tokens,completion_tokens,cached_tokens");
    out.push_str(if prices.is_some() { ",cost,currency\n" } else { "\n" });
    for r in rows {
        out.push_str(&format!(
            "{},{},{},{},{},{},{}",
            csv_field(&r.tenant),
            csv_field(&r.model),
            r.requests,
            r.errors,
            r.prompt_tokens,
            r.completion_tokens,
            r.cached_tokens
        ));
        if let Some(p) = prices {
            let cost = p.cost(&r.model, r.prompt_tokens, r.cached_tokens, r.completion_tokens);
            out.push_str(&format!(
                ",{},{}",
                cost.map(|c| format!("{c:.6}")).unwrap_or_default(),
                csv_field(&p.currency)
            ));
        }
        out.push('\n');
    }
    out
}

/// A CSV cell: quoted when needed, and a text starting like a formula
/// (`=`, `+`, `-`, `@`, tab, carriage return) made inert with a leading `'`,
/// since model names in the report come from clients.
fn csv_field(s: &str) -> String {
    let s = if s.starts_with(['=', '+', '-', '@', '\t', '\r']) { format!("'{s}") } else { s.to_string() };
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s
    }
}

fn list<T: serde::Serialize>(data: Vec<T>) -> Json<serde_json::Value> {
    Json(serde_json::json!({ "object": "list", "data": data }))
}

async fn create_tenant(State(s): State<AdminState>, body: Bytes) -> Result<Response, ApiError> {
    let t: NewTenant = parse_json_body(&body)?;
    let tenant = s.identity.create_tenant(t).await?;
    Ok((StatusCode::CREATED, Json(tenant)).into_response())
}

async fn list_tenants(State(s): State<AdminState>, RawQuery(q): RawQuery) -> Result<Response, ApiError> {
    query_params(q, &[])?;
    Ok(list(s.identity.list_tenants().await?).into_response())
}

async fn get_tenant(State(s): State<AdminState>, Path(name): Path<String>) -> Result<Response, ApiError> {
    Ok(Json(s.identity.get_tenant(&name).await?).into_response())
}

async fn update_tenant(
    State(s): State<AdminState>,
    Path(name): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let u: TenantUpdate = parse_json_body(&body)?;
    Ok(Json(s.identity.update_tenant(&name, u).await?).into_response())
}

async fn disable_tenant(State(s): State<AdminState>, Path(name): Path<String>) -> Result<Response, ApiError> {
    Ok(Json(s.identity.disable_tenant(&name).await?).into_response())
}

/// The body of `POST /admin/v1/keys`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateKeyBody {
    tenant: String,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    models: Option<Vec<String>>,
    /// RFC 3339.
    #[serde(default)]
    expires_at: Option<String>,
    #[serde(default)]
    expires_in_s: Option<u64>,
    #[serde(default)]
    limits: Option<Limits>,
}

/// `expires_at` (RFC 3339 or unix seconds) or `expires_in_s`, as unix ms.
pub(super) fn expiry(expires_at: Option<&str>, expires_in_s: Option<u64>) -> Result<Option<i64>, ApiError> {
    match (expires_at, expires_in_s) {
        (Some(_), Some(_)) => {
            Err(ApiError::invalid("expires_in_s", "invalid_value", "Give `expires_at` or `expires_in_s`, not both."))
        }
        (Some(at), None) => parse_time("expires_at", at).map(Some),
        (None, Some(secs)) => {
            let ms = i64::try_from(secs).ok().and_then(|s| s.checked_mul(1000)).and_then(|ms| ms.checked_add(now_ms()));
            match ms {
                Some(ms) if secs > 0 => Ok(Some(ms)),
                _ => Err(ApiError::invalid(
                    "expires_in_s",
                    "invalid_value",
                    "Invalid `expires_in_s`: must be a positive number of seconds.",
                )),
            }
        }
        (None, None) => Ok(None),
    }
}

async fn create_key(State(s): State<AdminState>, body: Bytes) -> Result<Response, ApiError> {
    let b: CreateKeyBody = parse_json_body(&body)?;
    let expires_ms = expiry(b.expires_at.as_deref(), b.expires_in_s)?;
    let created = s
        .identity
        .create_key(NewKey { tenant: b.tenant, name: b.name, models: b.models, expires_ms, limits: b.limits })
        .await?;
    let mut v = serde_json::to_value(&created.info).map_err(|e| ApiError::internal(&e))?;
    if let Some(obj) = v.as_object_mut() {
        obj.insert("key".into(), created.secret.into());
    }
    Ok((StatusCode::CREATED, Json(v)).into_response())
}

async fn list_keys(State(s): State<AdminState>, RawQuery(q): RawQuery) -> Result<Response, ApiError> {
    let params = query_params(q, &["tenant"])?;
    Ok(list(s.identity.list_keys(param(&params, "tenant")).await?).into_response())
}

fn key_id(id: &str) -> Result<KeyId, ApiError> {
    id.parse()
        .map_err(|_| ApiError::invalid("id", "invalid_value", format!("Invalid key `id`: {id:?} is not a number.")))
}

/// Deserializes a present field as `Some(value)`, so that with
/// `#[serde(default)]` an absent field is `None` and `null` is `Some(None)`.
fn present<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

/// The body of `PATCH /admin/v1/keys/{id}`; absent fields stay as they are.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UpdateKeyBody {
    #[serde(default)]
    name: Option<String>,
    /// A list, or `null` for every model.
    #[serde(default, deserialize_with = "present")]
    models: Option<Option<Vec<String>>>,
    /// Replaces the key's limits as a whole.
    #[serde(default)]
    limits: Option<Limits>,
    /// RFC 3339 or unix seconds, or `null` for never.
    #[serde(default, deserialize_with = "present")]
    expires_at: Option<Option<String>>,
    #[serde(default)]
    expires_in_s: Option<u64>,
}

async fn update_key(State(s): State<AdminState>, Path(id): Path<String>, body: Bytes) -> Result<Response, ApiError> {
    let id = key_id(&id)?;
    let b: UpdateKeyBody = parse_json_body(&body)?;
    let expires_ms = match (b.expires_at, b.expires_in_s) {
        (Some(None), None) => Some(None),
        (Some(None), Some(_)) => {
            return Err(ApiError::invalid(
                "expires_in_s",
                "invalid_value",
                "Give `expires_at` or `expires_in_s`, not both.",
            ))
        }
        (at, secs) => expiry(at.flatten().as_deref(), secs)?.map(Some),
    };
    let u = KeyUpdate { name: b.name, models: b.models, limits: b.limits, expires_ms };
    Ok(Json(s.identity.update_key(id, u).await?).into_response())
}

/// The body of `POST /admin/v1/keys/{id}/rotate`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RotateKeyBody {
    /// How long the current secret keeps working (default: the gateway's
    /// `key_rotation_grace_s`); 0 ends it at once.
    #[serde(default)]
    grace_s: Option<u64>,
}

async fn rotate_key(State(s): State<AdminState>, Path(id): Path<String>, body: Bytes) -> Result<Response, ApiError> {
    let id = key_id(&id)?;
    let b: RotateKeyBody = parse_json_body(&body)?;
    let grace = match b.grace_s {
        Some(secs) if secs > 366 * 86_400 => {
            return Err(ApiError::invalid("grace_s", "invalid_value", "Invalid `grace_s`: at most a year (31622400)."))
        }
        Some(secs) => std::time::Duration::from_secs(secs),
        None => s.options.rotation_grace,
    };
    let rotated = s.identity.rotate_key(id, grace).await?;
    let mut v = serde_json::to_value(&rotated.info).map_err(|e| ApiError::internal(&e))?;
    if let Some(obj) = v.as_object_mut() {
        obj.insert("key".into(), rotated.secret.into());
    }
    Ok(Json(v).into_response())
}

async fn revoke_key(State(s): State<AdminState>, Path(id): Path<String>) -> Result<Response, ApiError> {
    let id = key_id(&id)?;
    s.identity.revoke_key(id).await?;
    Ok(Json(s.identity.get_key(id).await?).into_response())
}

async fn usage(State(s): State<AdminState>, RawQuery(q): RawQuery) -> Result<Response, ApiError> {
    let params = query_params(q, &["from", "to", "tenant", "format"])?;
    // Prices configured: a cost per row (in the report's currency).
    let priced = Some(&s.options.prices).filter(|p| !p.models.is_empty());
    let (month_from, month_to) = current_month_ms();
    let from_ms = param(&params, "from").map(|v| parse_time("from", v)).transpose()?.unwrap_or(month_from);
    let to_ms = param(&params, "to").map(|v| parse_time("to", v)).transpose()?.unwrap_or(month_to);
    let csv = match param(&params, "format") {
        None | Some("json") => false,
        Some("csv") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                "format",
                "invalid_value",
                format!("Invalid `format`: {other:?} (json or csv)."),
            ))
        }
    };
    let query = UsageQuery { from_ms, to_ms, tenant: param(&params, "tenant").map(str::to_string) };
    let rows = s.identity.usage(&query).await?;
    if csv {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, header::HeaderValue::from_static("text/csv; charset=utf-8"));
        return Ok((headers, usage_csv_priced(&rows, priced)).into_response());
    }
    let mut body = serde_json::json!({ "object": "list", "from_ms": from_ms, "to_ms": to_ms, "data": rows });
    if let Some(p) = priced {
        body["currency"] = p.currency.clone().into();
        for (v, r) in body["data"].as_array_mut().into_iter().flatten().zip(&rows) {
            v["cost"] = p.cost(&r.model, r.prompt_tokens, r.cached_tokens, r.completion_tokens).into();
        }
    }
    Ok(Json(body).into_response())
}

async fn audit(State(s): State<AdminState>, RawQuery(q): RawQuery) -> Result<Response, ApiError> {
    let params = query_params(q, &["tenant", "limit", "since"])?;
    let limit = match param(&params, "limit") {
        None => AuditQuery::default().limit,
        Some(v) => match v.parse::<usize>() {
            Ok(n) if (1..=AuditQuery::MAX_LIMIT).contains(&n) => n,
            _ => {
                return Err(ApiError::invalid(
                    "limit",
                    "invalid_value",
                    format!("Invalid `limit`: {v:?} (a number from 1 to {}).", AuditQuery::MAX_LIMIT),
                ))
            }
        },
    };
    let since_ms = param(&params, "since").map(|v| parse_time("since", v)).transpose()?;
    let query = AuditQuery { tenant: param(&params, "tenant").map(str::to_string), limit, since_ms };
    Ok(list(s.identity.audit(&query).await?).into_response())
}
