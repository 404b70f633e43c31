//! The identity store's public types: tenants, keys, audit records, usage,
//! queries and errors.

use super::*;

/// Tuning for [`Identity::open`].
#[derive(Clone, Debug)]
pub struct IdentityOptions {
    /// How long a verified key is served from memory before the database is
    /// asked again. Revocation through the same [`Identity`] takes effect at
    /// once; through another process (another gateway replica, the admin
    /// CLI) within this time. Zero disables the cache.
    pub key_cache: Duration,
    /// Audit records that may wait for the writer; past this, new records
    /// are dropped and counted ([`Identity::audit_dropped`]).
    pub audit_queue: usize,
    /// Where audit batches the database refuses are spooled (a file per
    /// batch) until it takes them again; `None`: such batches are dropped
    /// and counted.
    pub audit_spool_dir: Option<std::path::PathBuf>,
    /// The most the spool may hold, in bytes; past it batches are dropped
    /// and counted.
    pub audit_spool_max_bytes: u64,
    /// How long one audit batch write may take before it counts as failed
    /// (and is retried, then spooled).
    pub audit_write_timeout: Duration,
}

impl Default for IdentityOptions {
    fn default() -> Self {
        IdentityOptions {
            key_cache: Duration::from_secs(2),
            audit_queue: 65_536,
            audit_spool_dir: None,
            audit_spool_max_bytes: 1 << 30,
            audit_write_timeout: Duration::from_secs(5),
        }
    }
}

/// A tenant: a customer of the gateway, with its own KV namespace, priority
/// and limits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Tenant {
    /// Database id.
    pub id: TenantId,
    /// Unique; `[a-z0-9][a-z0-9_-]{0,62}`.
    pub name: String,
    /// The KV namespace its requests run in.
    pub namespace: String,
    /// Its priority tier when upstreams are busy.
    pub priority: Priority,
    /// Limits over all its keys together.
    pub limits: Limits,
    /// Whether its audit records keep the prompt text.
    pub log_prompts: bool,
    /// A disabled tenant's keys are refused with 403.
    pub disabled: bool,
    /// When it was created, unix milliseconds.
    pub created_ms: i64,
}

/// A tenant to create; also the body of `POST /admin/v1/tenants`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewTenant {
    /// `[a-z0-9][a-z0-9_-]{0,62}`, unique.
    pub name: String,
    /// Defaults to the name.
    #[serde(default)]
    pub namespace: Option<String>,
    /// Defaults to `standard`.
    #[serde(default)]
    pub priority: Option<Priority>,
    /// Defaults to unlimited.
    #[serde(default)]
    pub limits: Option<Limits>,
    /// Defaults to false.
    #[serde(default)]
    pub log_prompts: Option<bool>,
}

/// Changes to a tenant; absent fields stay as they are. Also the body of
/// `PATCH /admin/v1/tenants/{name}`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantUpdate {
    /// A new priority tier.
    #[serde(default)]
    pub priority: Option<Priority>,
    /// Replaces the tenant's limits as a whole.
    #[serde(default)]
    pub limits: Option<Limits>,
    /// Whether audit records keep prompt text.
    #[serde(default)]
    pub log_prompts: Option<bool>,
    /// Disable (refuse its keys with 403) or enable again.
    #[serde(default)]
    pub disabled: Option<bool>,
}

/// A key to create.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NewKey {
    /// The tenant's name.
    pub tenant: String,
    /// A label for people.
    pub name: Option<String>,
    /// Models the key may use; `None` is all.
    pub models: Option<Vec<String>>,
    /// When the key stops working, unix milliseconds; `None` is never.
    pub expires_ms: Option<i64>,
    /// The key's own limits (on top of the tenant's); `None` is unlimited.
    pub limits: Option<Limits>,
}

/// Changes to a key; absent fields stay as they are. Also the body of
/// `PATCH /admin/v1/keys/{id}` (there with `expires_at`/`expires_in_s`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KeyUpdate {
    /// A new label.
    pub name: Option<String>,
    /// `Some(None)`: every model; `Some(Some(list))`: only these.
    pub models: Option<Option<Vec<String>>>,
    /// Replaces the key's own limits as a whole.
    pub limits: Option<Limits>,
    /// `Some(None)`: never expires; `Some(Some(ms))`: expires then.
    pub expires_ms: Option<Option<i64>>,
}

/// What is known of a key, without its secret or hash.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KeyInfo {
    /// Database id (what `revoke` takes).
    pub id: KeyId,
    /// The public prefix (`gk_` + 8 characters).
    pub prefix: String,
    /// A label for people.
    pub name: Option<String>,
    /// The owning tenant's id.
    pub tenant_id: TenantId,
    /// The owning tenant's name.
    pub tenant: String,
    /// Models the key may use; `None` is all.
    pub models: Option<Vec<String>>,
    /// Expiry, unix milliseconds; `None` is never.
    pub expires_ms: Option<i64>,
    /// The key's own limits.
    pub limits: Limits,
    /// When it was revoked, unix milliseconds.
    pub revoked_ms: Option<i64>,
    /// When it was created, unix milliseconds.
    pub created_ms: i64,
    /// Roughly when it was last used (written at most once a minute).
    pub last_used_ms: Option<i64>,
    /// After a rotation: until when the previous secret still works.
    #[serde(default)]
    pub previous_valid_until_ms: Option<i64>,
}

/// A key just created: the only time its secret is known.
#[derive(Clone, Debug, PartialEq)]
pub struct CreatedKey {
    pub info: KeyInfo,
    /// The whole key, to hand to the client; it cannot be recovered later.
    pub secret: String,
}

/// Tokens one key (or, `key_id` 0, requests without one) of a tenant used
/// on one UTC day, and what they cost, from the `usage_daily` rollup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DailyUsage {
    pub tenant_id: TenantId,
    pub key_id: KeyId,
    /// The day's start, unix milliseconds.
    pub day_ms: i64,
    /// Prompt plus completion tokens.
    pub tokens: u64,
    /// Their cost at the configured prices (each model's day rounded up to
    /// whole micro-units; nothing for models without a price).
    pub spend: crate::pricing::Money,
}

/// One request, as the audit log keeps it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AuditRecord {
    /// When the request arrived, unix milliseconds.
    pub time_ms: i64,
    /// The gateway's id of the request (also in its response headers and logs).
    pub request_id: String,
    /// The tenant, when the key was verified.
    pub tenant_id: Option<TenantId>,
    /// The tenant's name; usage is aggregated by it.
    pub tenant: Option<String>,
    /// The key, when it was verified.
    pub key_id: Option<KeyId>,
    /// `/v1/chat/completions`, ...
    pub endpoint: String,
    /// The model asked for.
    pub model: Option<String>,
    /// The upstream that answered, if any.
    pub upstream: Option<String>,
    /// The HTTP status returned to the client.
    pub status: u16,
    /// The error `code` returned, if any.
    pub error_code: Option<String>,
    /// Whether the answer was streamed.
    pub stream: bool,
    /// Prompt tokens, as the upstream counted them.
    pub prompt_tokens: u64,
    /// Completion tokens, as the upstream counted them.
    pub completion_tokens: u64,
    /// Prompt tokens served from the KV cache.
    pub cached_tokens: u64,
    /// Time from arrival to the last byte of the answer.
    pub latency_ms: f64,
    /// Time to the first byte of the answer.
    pub ttft_ms: Option<f64>,
    /// Only when the tenant has `log_prompts`.
    pub prompt: Option<String>,
}

/// Which audit records to aggregate: `[from_ms, to_ms)`, optionally one
/// tenant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsageQuery {
    /// Start, unix milliseconds, inclusive.
    pub from_ms: i64,
    /// End, unix milliseconds, exclusive.
    pub to_ms: i64,
    /// A tenant's name; `None` is all tenants.
    pub tenant: Option<String>,
}

impl UsageQuery {
    /// The current UTC calendar month.
    pub fn current_month(tenant: Option<String>) -> Self {
        let (from_ms, to_ms) = current_month_ms();
        UsageQuery { from_ms, to_ms, tenant }
    }
}

/// Usage of one tenant and model over a [`UsageQuery`]'s period.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageRow {
    /// Empty for records without a tenant (refused before authentication).
    pub tenant: String,
    /// Empty for records without a model.
    pub model: String,
    /// Requests, answered or refused.
    pub requests: u64,
    /// Requests answered with status 400 or above.
    pub errors: u64,
    /// Sum of prompt tokens.
    pub prompt_tokens: u64,
    /// Sum of completion tokens.
    pub completion_tokens: u64,
    /// Sum of prompt tokens served from the KV cache.
    pub cached_tokens: u64,
}

/// Which audit records to list, newest first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuditQuery {
    /// A tenant's name; `None` is all.
    pub tenant: Option<String>,
    /// At most this many (capped at [`AuditQuery::MAX_LIMIT`]).
    pub limit: usize,
    /// Only records at or after this time, unix milliseconds.
    pub since_ms: Option<i64>,
}

impl AuditQuery {
    /// The most records one query returns.
    pub const MAX_LIMIT: usize = 1000;
}

impl Default for AuditQuery {
    fn default() -> Self {
        AuditQuery { tenant: None, limit: 100, since_ms: None }
    }
}

/// Why a bearer token was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// No token at all.
    #[error("no API key")]
    Missing,
    /// Not of the shape of a key this gateway issues.
    #[error("malformed API key")]
    Malformed,
    /// Well formed, but no such key.
    #[error("unknown API key")]
    Unknown,
    /// The key was revoked (401 `invalid_api_key`).
    #[error("API key {prefix} was revoked")]
    Revoked {
        /// The key's public prefix.
        prefix: String,
    },
    /// The key is past its expiry (401 `expired_api_key`).
    #[error("API key {prefix} has expired")]
    Expired {
        /// The key's public prefix.
        prefix: String,
    },
    /// The key's tenant is disabled (403 `tenant_disabled`).
    #[error("tenant {tenant} is disabled")]
    TenantDisabled {
        /// The tenant's name.
        tenant: String,
    },
    /// The key store could not be asked; the detail went to the log.
    #[error("the key store is unavailable")]
    Unavailable,
}

impl AuthError {
    /// The answer to the client: 401 for anything wrong with the key, 403
    /// for a disabled tenant, 503 when the database cannot be reached.
    pub fn to_api_error(&self) -> ApiError {
        match self {
            AuthError::Missing => ApiError::unauthorized(
                "invalid_api_key",
                "You didn't provide an API key. Send it as `Authorization: Bearer <key>`.",
            ),
            AuthError::Malformed | AuthError::Unknown => {
                ApiError::unauthorized("invalid_api_key", "Incorrect API key provided.")
            }
            AuthError::Revoked { prefix } => {
                ApiError::unauthorized("invalid_api_key", format!("The API key {prefix}… has been revoked."))
            }
            AuthError::Expired { prefix } => {
                ApiError::unauthorized("expired_api_key", format!("The API key {prefix}… has expired."))
            }
            AuthError::TenantDisabled { tenant } => {
                ApiError::forbidden("tenant_disabled", format!("The tenant {tenant} is disabled."))
            }
            AuthError::Unavailable => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorType::ServerError,
                "auth_unavailable",
                "API keys cannot be checked right now; try again shortly.",
            )
            .retry_after(Duration::from_secs(1)),
        }
    }
}

/// Why an admin operation failed.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// No such tenant or key.
    #[error("{0}")]
    NotFound(String),
    /// The name is taken.
    #[error("{0}")]
    Conflict(String),
    /// A field's value is not acceptable.
    #[error("{field}: {message}")]
    Invalid {
        /// The field at fault (`name`, `models[1]`, ...).
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// The database failed (the detail is logged, not shown to clients).
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
}

impl AdminError {
    pub(super) fn invalid(field: &str, message: impl Into<String>) -> Self {
        AdminError::Invalid { field: field.to_string(), message: message.into() }
    }
}

impl From<AdminError> for ApiError {
    fn from(e: AdminError) -> Self {
        match e {
            AdminError::NotFound(m) => ApiError::not_found(m),
            AdminError::Conflict(m) => {
                ApiError::new(StatusCode::CONFLICT, ErrorType::InvalidRequestError, "conflict", m)
            }
            AdminError::Invalid { field, message } => {
                ApiError::invalid(field.clone(), "invalid_value", format!("Invalid `{field}`: {message}"))
            }
            AdminError::Database(e) if is_unavailable(&e) => {
                tracing::error!(error = %e, "identity database unavailable");
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    ErrorType::ServerError,
                    "database_unavailable",
                    "The identity database is unavailable; try again shortly.",
                )
                .retry_after(Duration::from_secs(1))
            }
            AdminError::Database(e) => ApiError::internal(&e),
        }
    }
}

pub(super) fn is_unavailable(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Tls(_))
}
