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
//!
//! Here: the store and authentication; `types` holds the public types,
//! `store` tenants' and keys' admin operations and the row readers,
//! `key_cache` the verified-key cache.

mod audit;
mod cli;
mod http;
mod key_cache;
pub mod keys;
mod store;
#[cfg(test)]
mod tests;
mod types;

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

pub use cli::{run_admin, run_admin_priced, AdminCmd, KeyCmd, LimitArgs, TenantCmd};
pub use http::{admin_router, admin_router_with, usage_csv, usage_csv_priced, AdminOptions, AdminToken};
pub(crate) use http::{parse_json_body, query_params, require_admin};
use key_cache::*;
use store::*;
pub use types::*;

static MIGRATOR_SQLITE: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/sqlite");
static MIGRATOR_POSTGRES: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/postgres");

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
                // Write-ahead logging: a commit appends to the log instead of
                // writing, syncing and deleting a rollback journal, and
                // readers (the CLI, reports) do not block the audit writer.
                // A committed batch survives the process being killed; only
                // a power cut may lose the last ones before a checkpoint.
                pool_options = pool_options.max_connections(4);
                if !url.contains("mode=ro") {
                    pool_options = pool_options.after_connect(|conn, _| {
                        Box::pin(async move {
                            sqlx::query("PRAGMA journal_mode = WAL").execute(&mut *conn).await?;
                            sqlx::query("PRAGMA synchronous = NORMAL").execute(&mut *conn).await?;
                            Ok(())
                        })
                    });
                }
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
    /// `since_ms`'s day on, and their cost at `prices`, from the
    /// `usage_daily` rollup: what day and month budgets are reloaded from
    /// at start.
    pub async fn budget_usage(
        &self,
        since_ms: i64,
        prices: &crate::pricing::Prices,
    ) -> Result<Vec<DailyUsage>, AdminError> {
        let rows = sqlx::query(
            "SELECT tenant_id, key_id, day_ms, model, CAST(SUM(prompt_tokens) AS BIGINT), \
             CAST(SUM(completion_tokens) AS BIGINT), CAST(SUM(cached_tokens) AS BIGINT) \
             FROM usage_daily WHERE day_ms >= $1 GROUP BY tenant_id, key_id, day_ms, model",
        )
        .bind(audit::day_of(since_ms))
        .fetch_all(&self.inner.pool)
        .await?;
        // Summed over models here: the cost needs each model's price.
        let mut days: std::collections::BTreeMap<(i64, i64, i64), DailyUsage> = Default::default();
        for r in &rows {
            let (tenant_id, key_id, day_ms): (i64, i64, i64) = (r.try_get(0)?, r.try_get(1)?, r.try_get(2)?);
            let model: String = r.try_get(3)?;
            let (prompt, completion, cached) = (u64_col(r, 4)?, u64_col(r, 5)?, u64_col(r, 6)?);
            let day = days.entry((tenant_id, key_id, day_ms)).or_insert(DailyUsage {
                tenant_id,
                key_id,
                day_ms,
                tokens: 0,
                spend: crate::pricing::Money(0),
            });
            day.tokens = day.tokens.saturating_add(prompt.saturating_add(completion));
            day.spend.0 = day.spend.0.saturating_add(prices.spend(&model, prompt, cached, completion).0);
        }
        Ok(days.into_values().collect())
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
