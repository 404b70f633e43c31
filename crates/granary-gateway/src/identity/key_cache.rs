//! Verified keys remembered for `key_cache`, and `last_used_ms` written
//! at most once a minute per key.

use super::*;

/// How often, at most, a key's `last_used_ms` is written.
pub(super) const TOUCH_EVERY_MS: i64 = 60_000;
/// Entries the key cache holds before it sheds expired ones (and, if that is
/// not enough, all of them).
pub(super) const KEY_CACHE_MAX: usize = 100_000;

/// Keys read from the database, by hash, with the time they were read.
#[derive(Default)]
pub(super) struct KeyCache {
    pub(super) entries: HashMap<String, (Instant, KeyRow)>,
    /// Bumped by every invalidation, so that a lookup that started before
    /// one does not put a stale row back.
    pub(super) generation: u64,
}

/// A key joined with its tenant: everything [`Identity::authenticate`]
/// needs.
#[derive(Clone, Debug)]
pub(super) struct KeyRow {
    pub(super) key_id: KeyId,
    pub(super) prefix: String,
    pub(super) key_hash: String,
    /// The secret before the last rotation, valid until `old_expires_ms`.
    pub(super) old_key_hash: Option<String>,
    pub(super) old_expires_ms: Option<i64>,
    pub(super) models: Option<Vec<String>>,
    pub(super) expires_ms: Option<i64>,
    pub(super) key_limits: Limits,
    pub(super) revoked_ms: Option<i64>,
    pub(super) tenant_id: TenantId,
    pub(super) tenant: String,
    pub(super) namespace: String,
    pub(super) priority: Priority,
    pub(super) tenant_limits: Limits,
    pub(super) log_prompts: bool,
    pub(super) disabled: bool,
}

impl Identity {
    pub(super) fn cached(&self, hash: &str) -> Option<KeyRow> {
        let ttl = self.inner.options.key_cache;
        if ttl.is_zero() {
            return None;
        }
        let cache = self.inner.cache.lock();
        let (at, row) = cache.entries.get(hash)?;
        (at.elapsed() < ttl).then(|| row.clone())
    }

    pub(super) fn cache_insert(&self, hash: String, row: KeyRow, generation: u64) {
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
    pub(super) fn invalidate(&self, matches: impl Fn(&KeyRow) -> bool) {
        let mut cache = self.inner.cache.lock();
        cache.generation += 1;
        cache.entries.retain(|_, (_, row)| !matches(row));
    }

    /// Writes `last_used_ms` in the background, at most once a minute per key.
    pub(super) fn touch(&self, key_id: KeyId, now: i64) {
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
}
