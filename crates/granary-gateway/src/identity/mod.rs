//! Tenants, API keys, audit records and usage, in SQLite or PostgreSQL.
//!
//! One code path through `sqlx::Any`: the URL's scheme picks the driver
//! (`sqlite://path/gateway.db`, `sqlite::memory:`, `postgres://…`) and the
//! migration set (`migrations/sqlite` or `migrations/postgres`, the same
//! tables); every query is written once, in SQL both accept. Timestamps are
//! BIGINT unix milliseconds, booleans BIGINT 0/1, limits and model lists
//! JSON text.
//!
//! - [`Identity::authenticate`] turns a bearer token into a
//!   [`Principal`]. Keys are stored only as a blake3 hash plus their public
//!   prefix; verified keys are cached for [`IdentityOptions::key_cache`].
//! - [`Identity::record`] queues an [`AuditRecord`] without waiting; a
//!   background task writes them in batches (retried, then spooled to disk
//!   while the database refuses them; see `audit`), and adds them to the
//!   `usage_daily` rollup. [`Identity::usage`] aggregates
//!   them per tenant and model.
//! - [`admin_router`] is the admin HTTP API, [`AdminCmd`] / [`run_admin`]
//!   the admin command line.

mod audit;
mod cli;
mod http;
pub mod keys;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use axum::http::StatusCode;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{AnyPool, Row};
use tokio::sync::mpsc;

use crate::error::ErrorType;
pub(crate) use crate::types::now_ms;
use crate::{ApiError, KeyId, Limits, Principal, Priority, TenantId};

pub use cli::{run_admin, AdminCmd, KeyCmd, LimitArgs, TenantCmd};
pub use http::{admin_router, admin_router_with, usage_csv, AdminOptions, AdminToken};
pub(crate) use http::{parse_json_body, query_params, require_admin};

static MIGRATOR_SQLITE: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/sqlite");
static MIGRATOR_POSTGRES: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/postgres");

/// How often, at most, a key's `last_used_ms` is written.
const TOUCH_EVERY_MS: i64 = 60_000;
/// Entries the key cache holds before it sheds expired ones (and, if that is
/// not enough, all of them).
const KEY_CACHE_MAX: usize = 100_000;

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
/// on one UTC day, from the `usage_daily` rollup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DailyUsage {
    pub tenant_id: TenantId,
    pub key_id: KeyId,
    /// The day's start, unix milliseconds.
    pub day_ms: i64,
    /// Prompt plus completion tokens.
    pub tokens: u64,
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
    fn invalid(field: &str, message: impl Into<String>) -> Self {
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

fn is_unavailable(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Tls(_))
}

/// The identity store. Cheap to clone; every clone shares the pool, the key
/// cache and the audit writer.
#[derive(Clone)]
pub struct Identity {
    inner: Arc<Inner>,
}

struct Inner {
    pool: AnyPool,
    backend: &'static str,
    options: IdentityOptions,
    cache: Mutex<KeyCache>,
    /// When each key's `last_used_ms` was last written.
    touched: Mutex<HashMap<KeyId, i64>>,
    audit_tx: mpsc::Sender<audit::Msg>,
    stats: Arc<audit::AuditStats>,
}

/// Keys read from the database, by hash, with the time they were read.
#[derive(Default)]
struct KeyCache {
    entries: HashMap<String, (Instant, KeyRow)>,
    /// Bumped by every invalidation, so that a lookup that started before
    /// one does not put a stale row back.
    generation: u64,
}

/// A key joined with its tenant: everything [`Identity::authenticate`]
/// needs.
#[derive(Clone, Debug)]
struct KeyRow {
    key_id: KeyId,
    prefix: String,
    key_hash: String,
    /// The secret before the last rotation, valid until `old_expires_ms`.
    old_key_hash: Option<String>,
    old_expires_ms: Option<i64>,
    models: Option<Vec<String>>,
    expires_ms: Option<i64>,
    key_limits: Limits,
    revoked_ms: Option<i64>,
    tenant_id: TenantId,
    tenant: String,
    namespace: String,
    priority: Priority,
    tenant_limits: Limits,
    log_prompts: bool,
    disabled: bool,
}

/// Which driver a URL names.
fn backend_of(url: &str) -> anyhow::Result<&'static str> {
    if url.starts_with("sqlite:") {
        Ok("sqlite")
    } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        Ok("postgres")
    } else {
        anyhow::bail!("unsupported database URL (expected sqlite://PATH, sqlite::memory: or postgres://…)")
    }
}

/// An SQLite URL that creates the file when missing, unless a mode is given.
fn sqlite_url_creating(url: &str) -> String {
    if url.contains(":memory:") || url.contains("mode=") {
        return url.to_string();
    }
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}mode=rwc")
}

/// The file path of an SQLite URL, when it names one.
fn sqlite_path(url: &str) -> Option<&str> {
    if url.contains(":memory:") {
        return None;
    }
    let rest = url.strip_prefix("sqlite://").or_else(|| url.strip_prefix("sqlite:"))?;
    let path = rest.split('?').next().unwrap_or(rest);
    (!path.is_empty()).then_some(path)
}

impl Identity {
    /// Connects, runs the migrations and starts the audit writer.
    pub async fn open(url: &str, options: IdentityOptions) -> anyhow::Result<Self> {
        sqlx::any::install_default_drivers();
        let backend = backend_of(url)?;
        let mut pool_options = AnyPoolOptions::new().acquire_timeout(Duration::from_secs(10));
        let connect_url = if backend == "sqlite" {
            if url.contains(":memory:") {
                // Every connection to `sqlite::memory:` is a database of its
                // own: keep exactly one, forever.
                pool_options = pool_options.max_connections(1).min_connections(1).idle_timeout(None).max_lifetime(None);
            } else {
                if let Some(dir) = sqlite_path(url).and_then(|p| std::path::Path::new(p).parent()) {
                    if !dir.as_os_str().is_empty() {
                        std::fs::create_dir_all(dir)
                            .with_context(|| format!("creating the directory {}", dir.display()))?;
                    }
                }
                pool_options = pool_options.max_connections(4);
            }
            sqlite_url_creating(url)
        } else {
            pool_options = pool_options.max_connections(16);
            url.to_string()
        };
        let pool = pool_options
            .connect(&connect_url)
            .await
            .with_context(|| format!("connecting to the {backend} identity database"))?;
        let migrator = if backend == "sqlite" { &MIGRATOR_SQLITE } else { &MIGRATOR_POSTGRES };
        migrator.run(&pool).await.context("migrating the identity database")?;

        let stats = Arc::new(audit::AuditStats::default());
        let spool = options
            .audit_spool_dir
            .clone()
            .map(|dir| audit::SpoolConfig { dir, max_bytes: options.audit_spool_max_bytes });
        let audit_tx = audit::spawn_writer(
            pool.clone(),
            options.audit_queue.max(1),
            stats.clone(),
            spool,
            options.audit_write_timeout,
        );
        Ok(Identity {
            inner: Arc::new(Inner {
                pool,
                backend,
                options,
                cache: Mutex::new(KeyCache::default()),
                touched: Mutex::new(HashMap::new()),
                audit_tx,
                stats,
            }),
        })
    }

    /// `"sqlite"` or `"postgres"`.
    pub fn backend(&self) -> &'static str {
        self.inner.backend
    }

    /// The connection pool (for the crate's own tests and tools).
    #[cfg(test)]
    pub(crate) fn pool(&self) -> &AnyPool {
        &self.inner.pool
    }

    // ---- authentication ----

    /// Verifies a bearer token (the `Authorization` value, with or without
    /// its `Bearer` scheme) and says who it belongs to.
    pub async fn authenticate(&self, bearer: &str) -> Result<Principal, AuthError> {
        let token = keys::strip_bearer(bearer);
        if token.is_empty() {
            return Err(AuthError::Missing);
        }
        if !keys::well_formed(token) {
            return Err(AuthError::Malformed);
        }
        let hash = keys::hash(token);
        let row = match self.cached(&hash) {
            Some(row) => row,
            None => {
                let generation = self.inner.cache.lock().generation;
                let row = self.load_key(&hash).await.map_err(|e| {
                    tracing::error!(error = %e, "reading an API key from the identity database");
                    AuthError::Unavailable
                })?;
                let Some(row) = row else { return Err(AuthError::Unknown) };
                self.cache_insert(hash.clone(), row.clone(), generation);
                row
            }
        };
        let now = now_ms();
        if !keys::hashes_equal(&row.key_hash, &hash) {
            // The secret before a rotation works for its grace period.
            let old = row.old_key_hash.as_deref().is_some_and(|h| keys::hashes_equal(h, &hash));
            if !old {
                return Err(AuthError::Unknown);
            }
            if row.old_expires_ms.is_none_or(|e| e <= now) {
                return Err(AuthError::Expired { prefix: keys::prefix_of(token).to_string() });
            }
        }
        if row.revoked_ms.is_some() {
            return Err(AuthError::Revoked { prefix: row.prefix });
        }
        if row.expires_ms.is_some_and(|e| e <= now) {
            return Err(AuthError::Expired { prefix: row.prefix });
        }
        if row.disabled {
            return Err(AuthError::TenantDisabled { tenant: row.tenant });
        }
        self.touch(row.key_id, now);
        Ok(Principal {
            key_id: row.key_id,
            key_prefix: row.prefix,
            tenant_id: row.tenant_id,
            tenant: row.tenant,
            namespace: row.namespace,
            models: row.models,
            priority: row.priority,
            key_limits: row.key_limits,
            tenant_limits: row.tenant_limits,
            log_prompts: row.log_prompts,
        })
    }

    fn cached(&self, hash: &str) -> Option<KeyRow> {
        let ttl = self.inner.options.key_cache;
        if ttl.is_zero() {
            return None;
        }
        let cache = self.inner.cache.lock();
        let (at, row) = cache.entries.get(hash)?;
        (at.elapsed() < ttl).then(|| row.clone())
    }

    fn cache_insert(&self, hash: String, row: KeyRow, generation: u64) {
        let ttl = self.inner.options.key_cache;
        if ttl.is_zero() {
            return;
        }
        let mut cache = self.inner.cache.lock();
        if cache.generation != generation {
            return;
        }
        if cache.entries.len() >= KEY_CACHE_MAX {
            cache.entries.retain(|_, (at, _)| at.elapsed() < ttl);
            if cache.entries.len() >= KEY_CACHE_MAX {
                cache.entries.clear();
            }
        }
        cache.entries.insert(hash, (Instant::now(), row));
    }

    /// Forgets cached keys that match; the next lookup reads the database.
    fn invalidate(&self, matches: impl Fn(&KeyRow) -> bool) {
        let mut cache = self.inner.cache.lock();
        cache.generation += 1;
        cache.entries.retain(|_, (_, row)| !matches(row));
    }

    /// Writes `last_used_ms` in the background, at most once a minute per key.
    fn touch(&self, key_id: KeyId, now: i64) {
        {
            let mut touched = self.inner.touched.lock();
            let last = touched.entry(key_id).or_insert(i64::MIN);
            if now.saturating_sub(*last) < TOUCH_EVERY_MS {
                return;
            }
            *last = now;
            if touched.len() > KEY_CACHE_MAX {
                touched.retain(|_, t| now.saturating_sub(*t) < TOUCH_EVERY_MS);
            }
        }
        let pool = self.inner.pool.clone();
        tokio::spawn(async move {
            let r = sqlx::query("UPDATE api_keys SET last_used_ms = $1 WHERE id = $2")
                .bind(now)
                .bind(key_id)
                .execute(&pool)
                .await;
            if let Err(e) = r {
                tracing::warn!(error = %e, key_id, "recording when an API key was last used");
            }
        });
    }

    async fn load_key(&self, hash: &str) -> Result<Option<KeyRow>, sqlx::Error> {
        let row = sqlx::query(
            "SELECT k.id, k.prefix, k.key_hash, k.models, k.expires_ms, k.limits, k.revoked_ms, \
             t.id, t.name, t.namespace, t.priority, t.limits, t.log_prompts, t.disabled, \
             k.old_key_hash, k.old_expires_ms \
             FROM api_keys k JOIN tenants t ON t.id = k.tenant_id WHERE k.key_hash = $1 OR k.old_key_hash = $2",
        )
        .bind(hash)
        .bind(hash)
        .fetch_optional(&self.inner.pool)
        .await?;
        let Some(r) = row else { return Ok(None) };
        Ok(Some(KeyRow {
            key_id: r.try_get(0)?,
            prefix: r.try_get(1)?,
            key_hash: r.try_get(2)?,
            models: json_opt(&r, 3)?,
            expires_ms: r.try_get(4)?,
            key_limits: json_col(&r, 5)?,
            revoked_ms: r.try_get(6)?,
            tenant_id: r.try_get(7)?,
            tenant: r.try_get(8)?,
            namespace: r.try_get(9)?,
            priority: priority_col(&r, 10)?,
            tenant_limits: json_col(&r, 11)?,
            log_prompts: bool_col(&r, 12)?,
            disabled: bool_col(&r, 13)?,
            old_key_hash: r.try_get(14)?,
            old_expires_ms: r.try_get(15)?,
        }))
    }

    // ---- audit ----

    /// Queues a record for the audit log. Never waits and never fails: when
    /// the queue is full the record is dropped and counted.
    pub fn record(&self, rec: AuditRecord) {
        if self.inner.audit_tx.try_send(audit::Msg::Record(Box::new(rec))).is_err() {
            let n = self.inner.stats.dropped.fetch_add(1, Ordering::Relaxed) + 1;
            if n.is_power_of_two() {
                tracing::warn!(dropped = n, "audit queue full: records dropped");
            }
        }
    }

    /// Waits until every record queued before this call is written, or
    /// spooled (or dropped and counted) after the database refused it.
    pub async fn flush(&self) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.inner.audit_tx.send(audit::Msg::Flush(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }

    /// Audit records lost so far: dropped on a full queue, or not written
    /// because the database failed and the spool was full or absent.
    pub fn audit_dropped(&self) -> u64 {
        self.inner.stats.dropped.load(Ordering::Relaxed)
    }

    /// Audit records waiting in the spool for the database.
    pub fn audit_spooled(&self) -> u64 {
        self.inner.stats.spooled.load(Ordering::Relaxed)
    }

    /// Audit batch writes the database refused (each retried or spooled).
    pub fn audit_write_errors(&self) -> u64 {
        self.inner.stats.write_errors.load(Ordering::Relaxed)
    }

    /// Tokens (prompt plus completion) per tenant, key and UTC day from
    /// `since_ms`'s day on, from the `usage_daily` rollup: what day and
    /// month budgets are reloaded from at start.
    pub async fn budget_usage(&self, since_ms: i64) -> Result<Vec<DailyUsage>, AdminError> {
        let rows = sqlx::query(
            "SELECT tenant_id, key_id, day_ms, CAST(SUM(prompt_tokens + completion_tokens) AS BIGINT) \
             FROM usage_daily WHERE day_ms >= $1 GROUP BY tenant_id, key_id, day_ms",
        )
        .bind(audit::day_of(since_ms))
        .fetch_all(&self.inner.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(DailyUsage {
                    tenant_id: r.try_get(0)?,
                    key_id: r.try_get(1)?,
                    day_ms: r.try_get(2)?,
                    tokens: u64_col(r, 3)?,
                })
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()
            .map_err(AdminError::from)
    }

    /// Usage per tenant and model over `[from_ms, to_ms)`, sorted by tenant
    /// then model.
    pub async fn usage(&self, q: &UsageQuery) -> Result<Vec<UsageRow>, AdminError> {
        if q.to_ms <= q.from_ms {
            return Err(AdminError::invalid("to", "must be after `from`"));
        }
        let mut sql = String::from(
            "SELECT COALESCE(tenant, ''), COALESCE(model, ''), CAST(COUNT(*) AS BIGINT), \
             CAST(SUM(CASE WHEN status >= 400 THEN 1 ELSE 0 END) AS BIGINT), \
             CAST(SUM(prompt_tokens) AS BIGINT), CAST(SUM(completion_tokens) AS BIGINT), \
             CAST(SUM(cached_tokens) AS BIGINT) \
             FROM audit_log WHERE time_ms >= $1 AND time_ms < $2",
        );
        if q.tenant.is_some() {
            sql.push_str(" AND tenant = $3");
        }
        sql.push_str(" GROUP BY tenant, model");
        let mut query = sqlx::query(&sql).bind(q.from_ms).bind(q.to_ms);
        if let Some(t) = &q.tenant {
            query = query.bind(t.clone());
        }
        let rows = query.fetch_all(&self.inner.pool).await?;
        let mut out = rows
            .iter()
            .map(|r| {
                Ok(UsageRow {
                    tenant: r.try_get(0)?,
                    model: r.try_get(1)?,
                    requests: u64_col(r, 2)?,
                    errors: u64_col(r, 3)?,
                    prompt_tokens: u64_col(r, 4)?,
                    completion_tokens: u64_col(r, 5)?,
                    cached_tokens: u64_col(r, 6)?,
                })
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()?;
        out.sort_by(|a, b| (&a.tenant, &a.model).cmp(&(&b.tenant, &b.model)));
        Ok(out)
    }

    /// Audit records, newest first.
    pub async fn audit(&self, q: &AuditQuery) -> Result<Vec<AuditRecord>, AdminError> {
        if q.limit == 0 || q.limit > AuditQuery::MAX_LIMIT {
            return Err(AdminError::invalid("limit", format!("must be between 1 and {}", AuditQuery::MAX_LIMIT)));
        }
        let mut sql = String::from(
            "SELECT time_ms, request_id, tenant_id, tenant, key_id, endpoint, model, upstream, status, error_code, \
             stream, prompt_tokens, completion_tokens, cached_tokens, latency_ms, ttft_ms, prompt \
             FROM audit_log WHERE 1 = 1",
        );
        let mut n = 0;
        let mut next = || {
            n += 1;
            format!("${n}")
        };
        if q.tenant.is_some() {
            sql.push_str(&format!(" AND tenant = {}", next()));
        }
        if q.since_ms.is_some() {
            sql.push_str(&format!(" AND time_ms >= {}", next()));
        }
        sql.push_str(&format!(" ORDER BY time_ms DESC, id DESC LIMIT {}", next()));
        let mut query = sqlx::query(&sql);
        if let Some(t) = &q.tenant {
            query = query.bind(t.clone());
        }
        if let Some(s) = q.since_ms {
            query = query.bind(s);
        }
        query = query.bind(q.limit as i64);
        let rows = query.fetch_all(&self.inner.pool).await?;
        Ok(rows.iter().map(audit::from_row).collect::<Result<Vec<_>, _>>()?)
    }

    // ---- tenants ----

    /// Creates a tenant; a taken name is [`AdminError::Conflict`].
    pub async fn create_tenant(&self, t: NewTenant) -> Result<Tenant, AdminError> {
        check_name("name", &t.name)?;
        let namespace = t.namespace.unwrap_or_else(|| t.name.clone());
        check_name("namespace", &namespace)?;
        let priority = t.priority.unwrap_or_default();
        let limits = t.limits.unwrap_or_default();
        let log_prompts = t.log_prompts.unwrap_or(false);
        let created_ms = now_ms();
        let r = sqlx::query(
            "INSERT INTO tenants (name, namespace, priority, limits, log_prompts, disabled, created_ms) \
             VALUES ($1, $2, $3, $4, $5, 0, $6) RETURNING id",
        )
        .bind(t.name.clone())
        .bind(namespace.clone())
        .bind(priority.as_str())
        .bind(to_json(&limits))
        .bind(i64::from(log_prompts))
        .bind(created_ms)
        .fetch_one(&self.inner.pool)
        .await;
        let id: i64 = match r {
            Ok(row) => row.try_get(0)?,
            Err(e) if is_unique_violation(&e) => {
                return Err(AdminError::Conflict(format!("A tenant named {} already exists.", t.name)))
            }
            Err(e) => return Err(e.into()),
        };
        Ok(Tenant { id, name: t.name, namespace, priority, limits, log_prompts, disabled: false, created_ms })
    }

    /// Every tenant, by name.
    pub async fn list_tenants(&self) -> Result<Vec<Tenant>, AdminError> {
        let rows = sqlx::query(&format!("{TENANT_SELECT} ORDER BY name")).fetch_all(&self.inner.pool).await?;
        Ok(rows.iter().map(tenant_from_row).collect::<Result<Vec<_>, _>>()?)
    }

    /// One tenant by name.
    pub async fn get_tenant(&self, name: &str) -> Result<Tenant, AdminError> {
        let row = sqlx::query(&format!("{TENANT_SELECT} WHERE name = $1"))
            .bind(name.to_string())
            .fetch_optional(&self.inner.pool)
            .await?;
        match row {
            Some(r) => Ok(tenant_from_row(&r)?),
            None => Err(tenant_not_found(name)),
        }
    }

    /// Changes a tenant's priority, limits, prompt logging or disabled flag.
    pub async fn update_tenant(&self, name: &str, u: TenantUpdate) -> Result<Tenant, AdminError> {
        let mut sets: Vec<String> = Vec::new();
        let mut n = 0;
        let mut next = || {
            n += 1;
            format!("${n}")
        };
        if u.priority.is_some() {
            sets.push(format!("priority = {}", next()));
        }
        if u.limits.is_some() {
            sets.push(format!("limits = {}", next()));
        }
        if u.log_prompts.is_some() {
            sets.push(format!("log_prompts = {}", next()));
        }
        if u.disabled.is_some() {
            sets.push(format!("disabled = {}", next()));
        }
        if sets.is_empty() {
            return self.get_tenant(name).await;
        }
        let sql = format!("UPDATE tenants SET {} WHERE name = {}", sets.join(", "), next());
        let mut query = sqlx::query(&sql);
        if let Some(p) = u.priority {
            query = query.bind(p.as_str());
        }
        if let Some(l) = &u.limits {
            query = query.bind(to_json(l));
        }
        if let Some(b) = u.log_prompts {
            query = query.bind(i64::from(b));
        }
        if let Some(b) = u.disabled {
            query = query.bind(i64::from(b));
        }
        let done = query.bind(name.to_string()).execute(&self.inner.pool).await?;
        if done.rows_affected() == 0 {
            return Err(tenant_not_found(name));
        }
        self.invalidate(|row| row.tenant == name);
        self.get_tenant(name).await
    }

    /// Disables a tenant and revokes all its keys.
    pub async fn disable_tenant(&self, name: &str) -> Result<Tenant, AdminError> {
        let tenant = self.get_tenant(name).await?;
        let now = now_ms();
        let mut tx = self.inner.pool.begin().await?;
        sqlx::query("UPDATE tenants SET disabled = 1 WHERE id = $1").bind(tenant.id).execute(&mut *tx).await?;
        sqlx::query("UPDATE api_keys SET revoked_ms = $1 WHERE tenant_id = $2 AND revoked_ms IS NULL")
            .bind(now)
            .bind(tenant.id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        self.invalidate(|row| row.tenant_id == tenant.id);
        Ok(Tenant { disabled: true, ..tenant })
    }

    // ---- keys ----

    /// Creates a key for a tenant; the secret is in the answer and nowhere
    /// else.
    pub async fn create_key(&self, k: NewKey) -> Result<CreatedKey, AdminError> {
        let tenant = self.get_tenant(&k.tenant).await?;
        if let Some(models) = &k.models {
            if models.is_empty() {
                return Err(AdminError::invalid("models", "must name at least one model (omit it for all models)"));
            }
            if let Some(i) = models.iter().position(|m| m.trim().is_empty() || m.len() > 256) {
                return Err(AdminError::invalid(&format!("models[{i}]"), "must be a model name of 1 to 256 bytes"));
            }
        }
        if let Some(name) = &k.name {
            if name.len() > 256 {
                return Err(AdminError::invalid("name", "must be at most 256 bytes"));
            }
        }
        let created_ms = now_ms();
        if let Some(e) = k.expires_ms {
            if e <= created_ms {
                return Err(AdminError::invalid("expires_at", "must be in the future"));
            }
        }
        let limits = k.limits.unwrap_or_default();
        let (secret, prefix) = keys::generate();
        let row = sqlx::query(
            "INSERT INTO api_keys (tenant_id, name, prefix, key_hash, models, expires_ms, limits, created_ms) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8) RETURNING id",
        )
        .bind(tenant.id)
        .bind(k.name.clone())
        .bind(prefix.clone())
        .bind(keys::hash(&secret))
        .bind(k.models.as_ref().map(to_json))
        .bind(k.expires_ms)
        .bind(to_json(&limits))
        .bind(created_ms)
        .fetch_one(&self.inner.pool)
        .await?;
        let id: KeyId = row.try_get(0)?;
        let info = KeyInfo {
            id,
            prefix,
            name: k.name,
            tenant_id: tenant.id,
            tenant: tenant.name,
            models: k.models,
            expires_ms: k.expires_ms,
            limits,
            revoked_ms: None,
            created_ms,
            last_used_ms: None,
            previous_valid_until_ms: None,
        };
        Ok(CreatedKey { info, secret })
    }

    /// Keys (never their secrets or hashes), of one tenant or of all, by id.
    pub async fn list_keys(&self, tenant: Option<&str>) -> Result<Vec<KeyInfo>, AdminError> {
        let rows = match tenant {
            Some(t) => {
                self.get_tenant(t).await?;
                sqlx::query(&format!("{KEY_SELECT} WHERE t.name = $1 ORDER BY k.id"))
                    .bind(t.to_string())
                    .fetch_all(&self.inner.pool)
                    .await?
            }
            None => sqlx::query(&format!("{KEY_SELECT} ORDER BY k.id")).fetch_all(&self.inner.pool).await?,
        };
        Ok(rows.iter().map(key_from_row).collect::<Result<Vec<_>, _>>()?)
    }

    /// One key by id.
    pub async fn get_key(&self, id: KeyId) -> Result<KeyInfo, AdminError> {
        let row =
            sqlx::query(&format!("{KEY_SELECT} WHERE k.id = $1")).bind(id).fetch_optional(&self.inner.pool).await?;
        match row {
            Some(r) => Ok(key_from_row(&r)?),
            None => Err(AdminError::NotFound(format!("No API key with id {id}."))),
        }
    }

    /// Gives a key a new secret; the current one keeps working for `grace`
    /// (zero: not at all), a secret from an earlier rotation stops now.
    /// Limits, models, expiry and usage stay with the key.
    pub async fn rotate_key(&self, id: KeyId, grace: Duration) -> Result<CreatedKey, AdminError> {
        let info = self.get_key(id).await?;
        if info.revoked_ms.is_some() {
            return Err(AdminError::invalid("id", "the key is revoked"));
        }
        let (secret, prefix) = keys::generate();
        let grace_ms = i64::try_from(grace.as_millis()).unwrap_or(i64::MAX);
        let until = now_ms().saturating_add(grace_ms);
        let done = sqlx::query(
            "UPDATE api_keys SET old_key_hash = key_hash, old_expires_ms = $1, key_hash = $2, prefix = $3 \
             WHERE id = $4 AND revoked_ms IS NULL",
        )
        .bind(until)
        .bind(keys::hash(&secret))
        .bind(prefix)
        .bind(id)
        .execute(&self.inner.pool)
        .await?;
        self.invalidate(|row| row.key_id == id);
        if done.rows_affected() == 0 {
            return Err(AdminError::invalid("id", "the key is revoked"));
        }
        Ok(CreatedKey { info: self.get_key(id).await?, secret })
    }

    /// Changes a key's label, models, limits or expiry; at once for this
    /// [`Identity`], within the cache time for other processes.
    pub async fn update_key(&self, id: KeyId, u: KeyUpdate) -> Result<KeyInfo, AdminError> {
        if let Some(Some(models)) = &u.models {
            if models.is_empty() {
                return Err(AdminError::invalid("models", "must name at least one model (null for all models)"));
            }
            if let Some(i) = models.iter().position(|m| m.trim().is_empty() || m.len() > 256) {
                return Err(AdminError::invalid(&format!("models[{i}]"), "must be a model name of 1 to 256 bytes"));
            }
        }
        if u.name.as_ref().is_some_and(|n| n.len() > 256) {
            return Err(AdminError::invalid("name", "must be at most 256 bytes"));
        }
        if let Some(Some(e)) = u.expires_ms {
            if e <= now_ms() {
                return Err(AdminError::invalid("expires_at", "must be in the future"));
            }
        }
        let mut sets: Vec<String> = Vec::new();
        let mut n = 0;
        let mut next = || {
            n += 1;
            format!("${n}")
        };
        if u.name.is_some() {
            sets.push(format!("name = {}", next()));
        }
        if u.models.is_some() {
            sets.push(format!("models = {}", next()));
        }
        if u.limits.is_some() {
            sets.push(format!("limits = {}", next()));
        }
        if u.expires_ms.is_some() {
            sets.push(format!("expires_ms = {}", next()));
        }
        if sets.is_empty() {
            return self.get_key(id).await;
        }
        let sql = format!("UPDATE api_keys SET {} WHERE id = {}", sets.join(", "), next());
        let mut query = sqlx::query(&sql);
        if let Some(name) = &u.name {
            query = query.bind(name.clone());
        }
        if let Some(models) = &u.models {
            query = query.bind(models.as_ref().map(to_json));
        }
        if let Some(l) = &u.limits {
            query = query.bind(to_json(l));
        }
        if let Some(e) = u.expires_ms {
            query = query.bind(e);
        }
        let done = query.bind(id).execute(&self.inner.pool).await?;
        self.invalidate(|row| row.key_id == id);
        if done.rows_affected() == 0 {
            return Err(AdminError::NotFound(format!("No API key with id {id}.")));
        }
        self.get_key(id).await
    }

    /// Revokes a key; at once for this [`Identity`], within the cache time
    /// for other processes. Revoking a revoked key changes nothing.
    pub async fn revoke_key(&self, id: KeyId) -> Result<(), AdminError> {
        let done = sqlx::query("UPDATE api_keys SET revoked_ms = $1 WHERE id = $2 AND revoked_ms IS NULL")
            .bind(now_ms())
            .bind(id)
            .execute(&self.inner.pool)
            .await?;
        self.invalidate(|row| row.key_id == id);
        if done.rows_affected() == 0 {
            // Either unknown or already revoked.
            self.get_key(id).await?;
        }
        Ok(())
    }
}

const TENANT_SELECT: &str =
    "SELECT id, name, namespace, priority, limits, log_prompts, disabled, created_ms FROM tenants";

const KEY_SELECT: &str = "SELECT k.id, k.prefix, k.name, k.tenant_id, t.name, k.models, k.expires_ms, k.limits, \
     k.revoked_ms, k.created_ms, k.last_used_ms, k.old_expires_ms FROM api_keys k JOIN tenants t ON t.id = k.tenant_id";

fn tenant_from_row(r: &AnyRow) -> Result<Tenant, sqlx::Error> {
    Ok(Tenant {
        id: r.try_get(0)?,
        name: r.try_get(1)?,
        namespace: r.try_get(2)?,
        priority: priority_col(r, 3)?,
        limits: json_col(r, 4)?,
        log_prompts: bool_col(r, 5)?,
        disabled: bool_col(r, 6)?,
        created_ms: r.try_get(7)?,
    })
}

fn key_from_row(r: &AnyRow) -> Result<KeyInfo, sqlx::Error> {
    Ok(KeyInfo {
        id: r.try_get(0)?,
        prefix: r.try_get(1)?,
        name: r.try_get(2)?,
        tenant_id: r.try_get(3)?,
        tenant: r.try_get(4)?,
        models: json_opt(r, 5)?,
        expires_ms: r.try_get(6)?,
        limits: json_col(r, 7)?,
        revoked_ms: r.try_get(8)?,
        created_ms: r.try_get(9)?,
        last_used_ms: r.try_get(10)?,
        previous_valid_until_ms: r.try_get(11)?,
    })
}

fn tenant_not_found(name: &str) -> AdminError {
    AdminError::NotFound(format!("No tenant named {name}."))
}

/// Tenant names and namespaces: `[a-z0-9][a-z0-9_-]{0,62}`.
fn check_name(field: &str, name: &str) -> Result<(), AdminError> {
    let b = name.as_bytes();
    let ok = !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'_' || *c == b'-');
    if ok {
        Ok(())
    } else {
        Err(AdminError::invalid(
            field,
            format!("{name:?} is not a valid name (1 to 63 of a-z, 0-9, '_' and '-', starting with a letter or digit)"),
        ))
    }
}

fn is_unique_violation(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(d) => {
            d.is_unique_violation() || d.code().is_some_and(|c| c == "23505" || c == "2067" || c == "1555")
        }
        _ => false,
    }
}

fn to_json<T: Serialize>(v: &T) -> String {
    // Limits and string lists always serialize.
    serde_json::to_string(v).unwrap_or_else(|_| "null".to_string())
}

fn decode_err(index: usize, e: impl std::error::Error + Send + Sync + 'static) -> sqlx::Error {
    sqlx::Error::ColumnDecode { index: index.to_string(), source: Box::new(e) }
}

fn json_col<T: serde::de::DeserializeOwned>(r: &AnyRow, i: usize) -> Result<T, sqlx::Error> {
    let s: String = r.try_get(i)?;
    serde_json::from_str(&s).map_err(|e| decode_err(i, e))
}

fn json_opt<T: serde::de::DeserializeOwned>(r: &AnyRow, i: usize) -> Result<Option<T>, sqlx::Error> {
    let s: Option<String> = r.try_get(i)?;
    s.map(|s| serde_json::from_str(&s).map_err(|e| decode_err(i, e))).transpose()
}

fn bool_col(r: &AnyRow, i: usize) -> Result<bool, sqlx::Error> {
    Ok(r.try_get::<i64, _>(i)? != 0)
}

fn u64_col(r: &AnyRow, i: usize) -> Result<u64, sqlx::Error> {
    let v: Option<i64> = r.try_get(i)?;
    Ok(v.unwrap_or(0).max(0) as u64)
}

fn priority_col(r: &AnyRow, i: usize) -> Result<Priority, sqlx::Error> {
    let s: String = r.try_get(i)?;
    s.parse().map_err(|e: String| decode_err(i, std::io::Error::other(e)))
}

/// The current UTC calendar month, `[first day, first day of the next)`, in
/// unix milliseconds.
pub(crate) fn current_month_ms() -> (i64, i64) {
    use chrono::{Datelike, NaiveDate};
    let today = chrono::Utc::now().date_naive();
    let first = NaiveDate::from_ymd_opt(today.year(), today.month(), 1).unwrap_or(today);
    let next = first.checked_add_months(chrono::Months::new(1)).unwrap_or(first);
    let ms = |d: NaiveDate| d.and_hms_opt(0, 0, 0).map(|t| t.and_utc().timestamp_millis()).unwrap_or(0);
    (ms(first), ms(next))
}
