//! Tenants and keys in the database: their admin operations and the row
//! readers every query shares.

use super::*;

impl Identity {
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

pub(super) const TENANT_SELECT: &str =
    "SELECT id, name, namespace, priority, limits, log_prompts, disabled, created_ms FROM tenants";

pub(super) const KEY_SELECT: &str =
    "SELECT k.id, k.prefix, k.name, k.tenant_id, t.name, k.models, k.expires_ms, k.limits, \
     k.revoked_ms, k.created_ms, k.last_used_ms, k.old_expires_ms FROM api_keys k JOIN tenants t ON t.id = k.tenant_id";

pub(super) fn tenant_from_row(r: &AnyRow) -> Result<Tenant, sqlx::Error> {
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

pub(super) fn key_from_row(r: &AnyRow) -> Result<KeyInfo, sqlx::Error> {
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

pub(super) fn tenant_not_found(name: &str) -> AdminError {
    AdminError::NotFound(format!("No tenant named {name}."))
}

/// Tenant names and namespaces: `[a-z0-9][a-z0-9_-]{0,62}`.
pub(super) fn check_name(field: &str, name: &str) -> Result<(), AdminError> {
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

pub(super) fn is_unique_violation(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(d) => {
            d.is_unique_violation() || d.code().is_some_and(|c| c == "23505" || c == "2067" || c == "1555")
        }
        _ => false,
    }
}

pub(super) fn to_json<T: Serialize>(v: &T) -> String {
    // Limits and string lists always serialize.
    serde_json::to_string(v).unwrap_or_else(|_| "null".to_string())
}

pub(super) fn decode_err(index: usize, e: impl std::error::Error + Send + Sync + 'static) -> sqlx::Error {
    sqlx::Error::ColumnDecode { index: index.to_string(), source: Box::new(e) }
}

pub(super) fn json_col<T: serde::de::DeserializeOwned>(r: &AnyRow, i: usize) -> Result<T, sqlx::Error> {
    let s: String = r.try_get(i)?;
    serde_json::from_str(&s).map_err(|e| decode_err(i, e))
}

pub(super) fn json_opt<T: serde::de::DeserializeOwned>(r: &AnyRow, i: usize) -> Result<Option<T>, sqlx::Error> {
    let s: Option<String> = r.try_get(i)?;
    s.map(|s| serde_json::from_str(&s).map_err(|e| decode_err(i, e))).transpose()
}

pub(super) fn bool_col(r: &AnyRow, i: usize) -> Result<bool, sqlx::Error> {
    Ok(r.try_get::<i64, _>(i)? != 0)
}

pub(super) fn u64_col(r: &AnyRow, i: usize) -> Result<u64, sqlx::Error> {
    let v: Option<i64> = r.try_get(i)?;
    Ok(v.unwrap_or(0).max(0) as u64)
}

pub(super) fn priority_col(r: &AnyRow, i: usize) -> Result<Priority, sqlx::Error> {
    let s: String = r.try_get(i)?;
    s.parse().map_err(|e: String| decode_err(i, std::io::Error::other(e)))
}
